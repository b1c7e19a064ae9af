"""Orbax writing the numpy arrays the calling process holds, on any process, without a copy of them in memory:
what lets each process of a multi-process run persist its own shards as an ordinary orbax checkpoint, and any
process persist a state as large as its RAM allows.

Orbax's numpy handler takes a numpy array to be replicated on every process, so it writes only from process 0:
in a multi-process job another process's checkpoint comes out with its metadata and no data. A process that
persists its own shards holds arrays nobody else has, so it must write them itself. `ProcessLocalNumpyHandler`
is orbax's handler with that one difference, and without its defensive copy of every array: the persistent tier
saves synchronously, from read-only views of a committed memory-tier snapshot (or arrays its caller holds
still until the save returns), which nothing changes meanwhile. The copy is made in orbax's `serialize`, always
up to orbax-checkpoint 0.12.4 and by default after it (0.12.5 added a `deepcopy_host_arrays` switch that earlier
versions refuse), so the handler replaces `serialize`, the one method that copies, on every version alike.
It needs orbax-checkpoint 0.11.34 or later (`ParamInfo.await_path_creation`), pyproject.toml's floor, which
scripts/test_lowest_versions.sh tests.
The arrays are written uncompressed: orbax's zstd holds each compressed array in memory until it is written.
Measured (experiments/bench/persist_memory.py, results/persist_memory_cpu.jsonl): persisting 1 GiB of float32
took 1.84 GiB of memory beside the snapshot with orbax's stock handler and 1 MiB with this one, in 0.35 of the time;
on a trained gpt_tiny checkpoint (weights and AdamW moments) compression saved 9% of the disk.

What it writes is what orbax's own handler writes (type 'np.ndarray', zarr in OCDBT), so plain orbax restores it
with its default handlers.
"""

from __future__ import annotations

import asyncio
from typing import Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint._src.serialization import ocdbt_utils
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils


class ProcessLocalNumpyHandler(ocp.type_handlers.NumpyHandler):
    """Writes every numpy array handed to it, on whichever process calls it."""

    async def serialize(self, values: Sequence[np.ndarray], infos: Sequence[ocp.type_handlers.ParamInfo],
                        args: Optional[Sequence[ocp.SaveArgs]] = None) -> Sequence[ocp.future.Future]:
        """Orbax's `serialize` less its copy of `values`: the write starts once orbax's directory signals are in."""
        args = args or [ocp.SaveArgs()] * len(values)
        # _background_serialize zips the three: a shorter one would drop arrays without a word.
        if not len(values) == len(infos) == len(args):
            raise ValueError(f"{len(values)} arrays, {len(infos)} infos and {len(args)} save args do not match")
        return [ocp.future.CommitFutureAwaitingContractedSignals(self._background_serialize(values, infos, args),
                                                                 name="np_type_handler")]

    async def _background_serialize(self, values: Sequence[np.ndarray], infos: Sequence[ocp.type_handlers.ParamInfo],
                                     args: Optional[Sequence[ocp.SaveArgs]] = None) -> None:
        args = args or [ocp.SaveArgs()] * len(values)
        writes = []
        for value, info, arg in zip(values, infos, args):
            await info.await_path_creation()
            subdir = ocdbt_utils.get_process_index_for_subdir(
                use_ocdbt=bool(info.is_ocdbt_checkpoint), override_ocdbt_process_id=self._override_ocdbt_process_id)
            spec = ts_utils.build_array_write_spec(
                info=info, arg=arg, global_shape=value.shape, local_shape=value.shape, dtype=value.dtype,
                use_ocdbt=bool(info.is_ocdbt_checkpoint), process_index=subdir, metadata_key=self._metadata_key)
            writes.append(self._open_and_write(value, spec.json, info.ts_context))
        await asyncio.gather(*writes)


def state_handler(multiprocessing: ocp.options.MultiprocessingOptions) -> ocp.PyTreeCheckpointHandler:
    """The handler of a checkpoint's flat {name: np.ndarray} item: written on the calling process, from the arrays
    themselves, uncompressed (save with `ocp.args.PyTreeSave`; it restores with `StandardRestore` or `PyTreeRestore`
    and orbax's default handlers)."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (np.ndarray, ProcessLocalNumpyHandler()),
        # Never used for our flat numpy states; registered so that orbax keeps its array-metadata store on.
        (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry, multiprocessing_options=multiprocessing,
                                       use_compression=False)

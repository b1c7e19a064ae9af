"""The formats a training state is checkpointed in: one home per format, keyed by the engine that wrote it.

    fmt = format_of(engine_meta)                  # a checkpoint's meta["engine"]
    fmt.processes(engine_meta)                    # how many processes wrote it (each its own shards)
    arrays = fmt.assemble(parts)                  # every process's shards -> whole arrays (lazy)
    params = fmt.params(cfg, arrays, engine_meta, where)   # the model's parameters (numpy, `init` structure)

Restore (train/checkpointing.py), reading a run's weights for export and sampling (train/weights.py) and the
engines themselves (train/engines.py, train/paged.py) name arrays and read metas through this module only.

**leaves** (the in-memory engine, `"engine": "in_memory"`): one array per leaf of the training state, named by its
path (`params/blocks/qkv/kernel`, `opt_state/...`). Sharded across processes (mesh.fsdp over several processes),
each process writes its pieces of every leaf, `<leaf>#<k>`, and its meta says where each piece goes:
`{"pieces": {leaf: {"shape", "index"}}, "process": {"index", "count"}}`.

**pages** (the paged engine, `"engine": "paged"`): every page family under stable names,

    params/<stage>/<k>       parameter pages (k-th page of the stage)
    opt/<stage>/<k>          optimizer-state pages
    opt_small/<stage>/<j>    the optimizer's small leaves (step counts)
    step, applied            steps taken; updates applied (those the anomaly guard dropped not counted)

and a meta of the page size, the ranks the pages are sharded over (ZeRO-3; absent before sharding: 1), a layout
fingerprint (per stage: dtype and length of every page, dtype and shape of every small leaf) and, sharded across
processes, `shards` (which ranks' shards this process's pages hold, `ShardMeta`).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import jax
import numpy as np

from angel_jax.checkpoint.state import LazyArray
from angel_jax.config import Config
from angel_jax.memory import PageLayout
from angel_jax.memory.sharded_layout import layout_over
from angel_jax.memory.shards import ShardMeta, assemble, assemble_pieces
from angel_jax.schedule.blueprint import params_layout
from angel_jax.train.protocol import StateMismatch, check_arrays, path_name
import models

PARAMS_PREFIX = "params/"
"""Both formats name the parameter arrays under this prefix; reading weights leaves every other array unread."""

Parts = Mapping[int, tuple[Mapping[str, Any], Mapping[str, Any]]]
"""process -> (its arrays, its engine meta): one step's shards as every process wrote them."""


class StateFormat(Protocol):
    engine: str
    """The engine that writes this format (its `name`, the meta's "engine")."""

    def processes(self, engine_meta: Mapping[str, Any]) -> int:
        """How many processes wrote the shard checkpoint this process's engine meta belongs to (ValueError or
        KeyError when the meta does not say)."""

    def assemble(self, parts: Parts) -> dict[str, Any]:
        """The whole state's arrays from every process's shards (`LazyArray`s, read one at a time)."""

    def params(self, cfg: Config, arrays: Mapping[str, Any], engine_meta: Mapping[str, Any], where: str) -> Any:
        """The model's parameters from a whole state's `params/` arrays (StateMismatch naming `where` and what
        differs when they do not fit the config)."""


def format_of(engine_meta: Mapping[str, Any]) -> StateFormat:
    """The format of a checkpoint whose engine meta is `engine_meta` (no engine named: the in-memory engine's,
    as checkpoints written before the paged engine existed)."""
    name = engine_meta.get("engine", Leaves.engine)
    if name not in FORMATS:
        raise StateMismatch(f"the checkpoint was written by an engine named {name!r}; this version reads "
                            f"{sorted(FORMATS)}")
    return FORMATS[name]


# ------------------------------------------------------------------------------------------------ leaves


def piece_name(leaf: str, k: int) -> str:
    """The array of one process's k-th piece of a leaf."""
    return f"{leaf}#{k}"


class Leaves:
    engine = "in_memory"

    def processes(self, engine_meta: Mapping[str, Any]) -> int:
        return int((engine_meta.get("process") or {})["count"])

    def assemble(self, parts: Parts) -> dict[str, Any]:
        """Every leaf from every process's pieces of it (`<leaf>#<k>`, their indices in each process's meta)."""
        arrays0, engine0 = parts[0]
        whole: dict[str, Any] = {}
        for name, info in engine0["pieces"].items():
            def read(name: str = name, info: Mapping[str, Any] = info) -> np.ndarray:
                pieces = [(tuple(tuple(d) for d in index), np.asarray(a[piece_name(name, k)]))
                          for a, engine in parts.values() for k, index in enumerate(engine["pieces"][name]["index"])]
                return assemble_pieces(tuple(info["shape"]), pieces[0][1].dtype, pieces)

            whole[name] = LazyArray(tuple(info["shape"]), arrays0[piece_name(name, 0)].dtype, read)
        return whole

    def params(self, cfg: Config, arrays: Mapping[str, Any], engine_meta: Mapping[str, Any], where: str) -> Any:
        _, abstract = models.get(cfg.model).abstract()
        leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        names = [PARAMS_PREFIX + path_name(path) for path, _ in leaves]
        check_arrays({n: (leaf.shape, leaf.dtype) for n, (_, leaf) in zip(names, leaves)}, arrays,
                     f"the parameters in {where}")
        return jax.tree_util.tree_unflatten(treedef, [np.array(arrays[n]) for n in names])


# ------------------------------------------------------------------------------------------------ pages

PAGE_FAMILIES = ("params", "opt")
"""The page families a checkpoint names page by page; a process's shard checkpoint holds its shards of these, the
other arrays (small optimizer leaves, counters) whole."""


def page_name(family: str, stage: str, k: int) -> str:
    """The array of a stage's k-th page of `family` ("params" or "opt")."""
    return f"{family}/{stage}/{k}"


def small_name(stage: str, j: int) -> str:
    """The array of a stage's j-th small optimizer leaf."""
    return f"opt_small/{stage}/{j}"


def pages_fingerprint(layout: PageLayout, stage: str) -> list[list]:
    """[dtype, length] of each of a stage's pages."""
    return [[p.dtype.name, p.length] for p in layout.stage(stage).pages]


def first_layout_difference(mine: dict, theirs: Any,
                            families: tuple[str, ...] = ("params", "opt", "opt_small")) -> str | None:
    """The first difference between two layout fingerprints in the page families named, or None."""
    if not isinstance(theirs, dict):
        return "the checkpoint has no page layout"
    for name in mine:
        if name not in theirs:
            return f"stage {name!r} is missing from the checkpoint (its stages: {', '.join(theirs)})"
        for family in families:
            a, b = mine[name][family], theirs[name].get(family)
            if a != b:
                return (f"stage {name!r}, {family} pages: this run has {len(a)} x {a[:2]}..., the checkpoint "
                        f"{len(b or [])} x {(b or [])[:2]}...")
    extra = [n for n in theirs if n not in mine]
    return f"the checkpoint has stages this run lacks: {extra}" if extra else None


def checked_ranks(engine_meta: Mapping[str, Any], page_size: int, where: str, page_fit: bool) -> int:
    """The ranks a checkpoint's pages are sharded over, once its page size is `page_size` and its pages were
    fitted as `page_fit` says (StateMismatch naming `where` otherwise, or when its ranks are not a positive
    integer)."""
    if engine_meta.get("page_size") != page_size:
        raise StateMismatch(f"{where}: the checkpoint's pages are {engine_meta.get('page_size')} B, this run's "
                            f"memory.page_size is {page_size} B; use the same page size")
    theirs = engine_meta.get("page_fit", False)  # absent: written before pages were fitted, at page_size
    if theirs != page_fit:
        raise StateMismatch(f"{where}: the checkpoint's pages were laid out with memory.page_fit={str(theirs).lower()}, "
                            f"this run has memory.page_fit={str(page_fit).lower()}; resume with "
                            f"memory.page_fit={str(theirs).lower()}")
    ranks = engine_meta.get("ranks", 1)  # absent: written before pages were sharded, by one device
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise StateMismatch(f"{where}: the checkpoint's number of ranks is {ranks!r}, not a positive integer (a "
                            "damaged or hand-edited checkpoint?)")
    return ranks


def shard_meta_of(engine_meta: Mapping[str, Any], where: str) -> ShardMeta | None:
    """Which ranks' shards a process's checkpoint holds (None: whole pages)."""
    if "shards" not in engine_meta:
        return None
    try:
        return ShardMeta.from_dict(engine_meta["shards"])
    except ValueError as e:
        raise StateMismatch(f"{where}: {e}") from None


class Pages:
    engine = "paged"

    def processes(self, engine_meta: Mapping[str, Any]) -> int:
        return ShardMeta.from_dict(engine_meta.get("shards") or {}).processes

    def assemble(self, parts: Parts) -> dict[str, Any]:
        """The global pages from every process's rank shards, end to end; the other arrays are process 0's."""
        shards = {p: ShardMeta.from_dict(engine["shards"]) for p, (_, engine) in parts.items()}
        arrays0, total, ranks0 = parts[0][0], shards[0].total_ranks, shards[0].ranks
        whole: dict[str, Any] = {}
        for name, local in arrays0.items():
            if name.split("/", 1)[0] in PAGE_FAMILIES:
                whole[name] = LazyArray(
                    (local.shape[0] // len(ranks0) * total,), local.dtype,
                    lambda name=name: assemble([(np.asarray(a[name]), shards[p].ranks)
                                                for p, (a, _) in parts.items()], total))
            else:
                whole[name] = np.asarray(local)
        return whole

    def params(self, cfg: Config, arrays: Mapping[str, Any], engine_meta: Mapping[str, Any], where: str) -> Any:
        """Pages `params/<stage>/<k>` unpacked stage by stage with the layout the engine builds from the config,
        over the checkpoint's ranks (pages sharded over N devices are N ranks' pages end to end), checked against
        the checkpoint's fingerprint first."""
        layout = self.params_layout(cfg, engine_meta, where)
        expected = {name: spec for s in layout.stages for name, spec in stage_pages(layout, s.name).items()}
        check_arrays(expected, arrays, f"the parameter pages in {where}")
        staged = models.get(cfg.model)
        stage_params = [self.stage_params(layout, s.name, arrays, where) for s in staged.stages]
        return jax.tree.map(np.asarray, staged.merge(stage_params))

    def params_layout(self, cfg: Config, engine_meta: Mapping[str, Any], where: str) -> Any:
        """The parameters' page layout the engine builds from the config, over the checkpoint's ranks, once it is
        the checkpoint's (StateMismatch naming `where` and the first difference otherwise)."""
        ranks = checked_ranks(engine_meta, cfg.memory.page_size, where, cfg.memory.page_fit)
        layout = layout_over(params_layout(cfg), ranks)
        mine = {s.name: {"params": pages_fingerprint(layout, s.name)} for s in layout.stages}
        problem = first_layout_difference(mine, engine_meta.get("layout"), families=("params",))
        if problem:
            raise StateMismatch(f"{where}: the page layout rebuilt from the run's config differs from the "
                                f"checkpoint's: {problem}")
        return layout

    def stage_params(self, layout: Any, stage: str, arrays: Mapping[str, Any], where: str) -> Any:
        """One stage's parameters (numpy) from its pages `params/<stage>/<k>` in `arrays`: only those are read
        (lazy arrays stay unread for the other stages), so a model larger than RAM is read a stage at a time."""
        expected = stage_pages(layout, stage)
        pages = {name: arrays[name] for name in expected if name in arrays}
        check_arrays(expected, pages, f"the parameter pages of stage {stage!r} in {where}")
        return layout.stage(stage).unpack(tuple(np.asarray(pages[name]) for name in expected))


def stage_pages(layout: Any, stage: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """A stage's parameter pages in order: name -> (shape, dtype) as a checkpoint stores them."""
    return {page_name("params", stage, k): ((p.length,), p.dtype) for k, p in enumerate(layout.stage(stage).pages)}


def stage_page_prefix(stage: str) -> str:
    """The prefix of exactly one stage's parameter pages ('params/block.1/' is not a prefix of block.10's)."""
    return f"params/{stage}/"


FORMATS: dict[str, StateFormat] = {Leaves.engine: Leaves(), Pages.engine: Pages()}

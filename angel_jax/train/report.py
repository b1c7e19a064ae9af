"""The memory report printed before step 1: what the training state takes, and where."""

from __future__ import annotations

import shutil
from typing import Any

import jax
import psutil

from angel_jax.config import Config
from angel_jax.memory import block_cache
from angel_jax.units import device_memory_stats, human_bytes
import models
from models.common import precision_line


def tree_bytes(tree: Any) -> int:
    return sum(leaf.nbytes for leaf in jax.tree.leaves(tree) if hasattr(leaf, "nbytes"))


def memory_report(cfg: Config, mesh: jax.sharding.Mesh, placement: list[str] = ()) -> str:
    """A few lines: parameter count, bytes of params / optimizer state / gradients, activations estimate,
    where the engine keeps the state (`placement`), per-device memory where the backend reports it, host RSS."""
    from angel_jax.train.engines import state_bytes

    staged = models.get(cfg.model)
    counts = staged.param_count
    params = counts["total"] * jax.numpy.dtype(cfg.model.param_dtype).itemsize
    opt = state_bytes(cfg) - 2 * params
    m = cfg.model
    per_device_batch = cfg.train.batch_size // mesh.size
    # Saved activations per block without remat: ~ (attention inputs, qkv, mlp hidden, residuals) in compute
    # dtype; a rough figure (x 34 * d bytes/token for bf16, Korthikanti et al. 2022, without the T^2 term that
    # fused attention does not store).
    act_bytes = 34 * m.d_model * m.seq_len * per_device_batch * (m.n_layers if not m.remat else 1)
    lines = [
        f"model: {counts['total'] / 1e6:.2f}M parameters ({counts['matmul'] / 1e6:.2f}M in matmuls), "
        f"stages {stage_summary(staged.kinds())}, d_model {m.d_model}, seq_len {m.seq_len}",
        f"precision: {precision_line(m)}",
        f"state: params {human_bytes(params)}, optimizer {human_bytes(opt)}, "
        f"gradients {human_bytes(params)}, activations ~{human_bytes(act_bytes)}"
        f" -> ~{human_bytes(2 * params + opt + act_bytes)}",
    ]
    lines += list(placement)
    for device in [d for d in mesh.devices.flat if d.process_index == jax.process_index()][:4]:
        stats = device_memory_stats(device)
        if "bytes_limit" in stats:
            lines.append(f"{device}: in use {human_bytes(stats.get('bytes_in_use', 0))} of "
                         f"{human_bytes(stats['bytes_limit'])}")
    lines.append(f"host: RSS {human_bytes(psutil.Process().memory_info().rss)}, "
                 f"available {human_bytes(psutil.virtual_memory().available)}; "
                 f"{jax.device_count()} x {jax.devices()[0].device_kind} over {jax.process_count()} process(es), "
                 f"platform {jax.default_backend()}")
    if (cache := block_cache.active()) is not None:
        lines.append(f"  {cache.describe()}")
    if jax.default_backend() == "cpu" and shutil.which("nvidia-smi"):
        lines.append("note: this machine has an NVIDIA GPU, but this jax runs on the CPU (no CUDA plugin): "
                     "`make ACCEL=cuda setup`, or install angel-jax[cuda]")
    return "\n".join(lines)


def stage_summary(kinds: dict[str, list[int]]) -> str:
    """The stages by kind in forward order, e.g. 'embed, 4 x block, head' or, for an encoder-decoder, 'embed,
    2 x encoder, encoder_norm, 2 x decoder, head': the family's own names, so no family is named here."""
    return ", ".join(kind if len(idx) == 1 else f"{len(idx)} x {kind}"
                     for kind, idx in sorted(kinds.items(), key=lambda kv: kv[1][0]))

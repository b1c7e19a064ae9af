"""Pages keep their bits by construction: no program that moves pages takes or returns a float-typed page.

On a processor without native bfloat16 (an AMD EPYC with AVX2 only, say), XLA's CPU backend moves a
bfloat16-typed array through float32 and quiets NaN payloads (0xffcc -> 0xffc0): a page that left a program typed
as bfloat16 could come back with other bits than it went in with, depending on the machine. So pages are held as
unsigned integers of their dtype's width everywhere (memory/layout.py), and these tests look at the programs
themselves, which holds on every machine: pack's outputs, unpack's inputs, the pages a paged engine's store holds
in each tier, and the all-gather of ZeRO-3 pages are all unsigned. The example that failed on such a machine is
run again here with XLA limited to AVX2, which reproduces that machine's code on any x86 CPU.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from angel_jax.memory import PageLayout
from angel_jax.memory.layout import bits_dtype, to_bits, to_values

DTYPES = [np.dtype(d) for d in (np.float32, np.float16, jnp.bfloat16, np.int32, np.bool_, ml_dtypes.float8_e4m3fn)]


def _tree() -> dict:
    rng = np.random.default_rng(0)
    return {str(d): np.frombuffer(rng.bytes(7 * d.itemsize), d).copy() if d != np.bool_ else
            rng.integers(0, 2, 7).astype(bool) for d in DTYPES}


def _unsigned(avals) -> list[str]:
    """The avals among `avals` that are not unsigned integers."""
    return [str(a) for a in avals if not jnp.issubdtype(a.dtype, jnp.unsignedinteger)]


def test_pack_returns_and_unpack_takes_only_unsigned_pages():
    tree = _tree()
    layout = PageLayout.build([("s", tree)], page_size_bytes=64)
    stage = layout.stage("s")
    packed = jax.jit(stage.pack).trace(tree).jaxpr
    assert not _unsigned(packed.out_avals), f"pack returns float-typed pages: {_unsigned(packed.out_avals)}"
    pages = stage.pack(tree)
    unpacked = jax.jit(stage.unpack).trace(pages).jaxpr
    assert not _unsigned(unpacked.in_avals), f"unpack takes float-typed pages: {_unsigned(unpacked.in_avals)}"
    assert [np.dtype(p.dtype) for p in pages] == [spec.bits for spec in stage.pages]
    assert all(spec.abstract.dtype == spec.bits for spec in stage.pages)
    with pytest.raises(ValueError, match="must be uint16"):  # a float page handed to a program is refused
        bf16 = next(i for i, spec in enumerate(stage.pages) if spec.dtype == jnp.bfloat16)
        stage.unpack(tuple(jnp.asarray(p).view(stage.pages[i].dtype) if i == bf16 else p
                           for i, p in enumerate(pages)))


def test_bits_and_values_are_exact_inverses():
    for dtype in DTYPES:
        x = _tree()[str(dtype)]
        bits = to_bits(x)
        assert bits.dtype == bits_dtype(dtype) and bits.dtype.kind == "u"
        assert to_values(bits, dtype).tobytes() == x.tobytes()
        under_jit = jax.jit(lambda b, d=dtype: to_bits(to_values(b, d)))(bits)
        assert np.asarray(under_jit).tobytes() == bits.tobytes()


def test_a_paged_engine_holds_only_unsigned_pages_in_every_tier(tmp_path):
    """A tiny GPT streamed from the host and the disk (bfloat16 compute over float32 parameters, AdamW), after a
    step: every page in every tier is bits."""
    from angel_jax.config import Config, MemoryConfig, ModelConfig, OptimizerConfig, TrainConfig
    from angel_jax.schedule.runtime import build_paged_runtime
    from models import gpt

    # test_paged_state.py's mixed placement (some stages resident, the rest streamed, optimizer state partly on
    # disk), with bfloat16 compute.
    model = ModelConfig(d_model=64, n_layers=8, n_heads=2, seq_len=16)
    (tmp_path / "disk").mkdir()
    cfg = Config(model=model, optimizer=OptimizerConfig(name="adamw", lr=1e-3),
                 train=TrainConfig(steps=2, batch_size=2),
                 memory=MemoryConfig(mode="paged", page_size=64 * 1024, device_budget=3_600_000,
                                     host_budget=4_200_000, disk_dir=str(tmp_path / "disk")))
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 17)), jnp.int32)
    engine = build_paged_runtime(cfg, jax.tree.map(np.array, gpt.init(model, 0)[1]), batch)
    try:
        engine.executor.step(batch)
        engine.updater.drain()
        store = engine.store
        store.wait_all()
        seen = set()
        for pid in store.page_ids():
            for tier in store.where(pid):
                seen.add(tier)
                page = store.read(pid) if tier == "disk" else store.get(pid, tier)
                assert jnp.issubdtype(page.dtype, jnp.unsignedinteger), f"page {pid} on the {tier} tier is {page.dtype}"
        assert {"device", "host", "disk"} <= seen, seen
    finally:
        engine.close()


# The example hypothesis found on a 2-core AMD EPYC without AVX-512 (test_memory_layout.py's explicit example):
# a bfloat16 leaf packed and unpacked under jit changed a NaN payload. XLA limited to AVX2 compiles the code that
# machine ran; with float-typed pages it fails on any x86 CPU, with pages held as bits it passes.
_AVX2_EXAMPLE = textwrap.dedent("""
    import jax, numpy as np, jax.numpy as jnp
    from angel_jax.memory import PageLayout
    rng = np.random.default_rng(1530)
    pattern = np.arange(2 ** 16, dtype=np.uint32).astype(np.uint16)  # every bfloat16, NaN payloads included
    trees = [("stage0", {"w0": rng.permutation(pattern)[:20].view(jnp.bfloat16).reshape(4, 5)}),
             ("stage1", {"all": pattern.view(jnp.bfloat16)})]
    layout = PageLayout.build(trees, page_size_bytes=4096)  # (32 pages for the 128 KiB leaf: it spans pages)
    names = [n for n, _ in trees]
    opts = {"xla_backend_optimization_level": 3}
    pages = jax.jit(lambda ts: [layout.pack(n, t) for n, t in zip(names, ts)]).lower(
        [t for _, t in trees]).compile(compiler_options=opts)([t for _, t in trees])
    back = jax.jit(lambda ps: [layout.unpack(n, p) for n, p in zip(names, ps)]).lower(pages).compile(
        compiler_options=opts)(pages)
    for (name, tree), got in zip(trees, back):
        for key in tree:
            a, b = np.asarray(tree[key]).view(np.uint16), np.asarray(got[key]).view(np.uint16)
            assert np.array_equal(a, b), (name, key, [(hex(x), hex(y)) for x, y in zip(a.ravel(), b.ravel()) if x != y][:4])
    print("bits kept")
""")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="--xla_cpu_max_isa=AVX2 is an x86 flag")
def test_the_avx2_example_keeps_its_bits():
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_max_isa=AVX2", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, "-c", _AVX2_EXAMPLE], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and "bits kept" in proc.stdout, proc.stderr[-3000:]

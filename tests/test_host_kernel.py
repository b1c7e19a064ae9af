"""The host optimizer kernel (optim/kernels/host_optimizer_cpu.cc through optim/fused.py) against XLA's flat update
(optim/flat.py), which tests/test_optim_flat.py holds to the leaf-wise optax update: the same pages, step counts,
sum of squares and verdict, on pages cut so that segments start mid-page (and the optimizer families mid-page),
with and without clipping, for AdamW, Adam and Lion; a dropped update leaves every page bit for bit; the first pass
writes nothing; and a compiler that fails is reported, not hidden."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from angel_jax.config import OptimizerConfig
from angel_jax.memory import PageLayout
from angel_jax.memory.layout import bits_dtype, to_bits
from angel_jax.optim.factory import make_optimizer
from angel_jax.optim.fused import host_optimizer, host_update_by, kernel_table, kernel_threads
from angel_jax.optim.kernels import HOST_OPTIMIZER, build, load_host_optimizer
from angel_jax.optim.stage_update import make_stage_update, make_stage_update_norm, split_opt_state
from test_optim_flat import _setup, _tree

STEPS = 10


def _updates(name: str, clip: float, state_dtype: str = "float32", master: bool = False):
    cfg = OptimizerConfig(name=name, lr=1e-2, warmup_steps=3, b1=0.9, b2=0.95, weight_decay=0.1, grad_clip=clip,
                          state_dtype=state_dtype, master_weights=master)
    tx, schedule = make_optimizer(cfg, STEPS, clip=False)
    spec = host_optimizer(cfg, schedule)
    assert spec is not None, "the host kernel could not be built here"
    prep, orep, layout, inputs = _setup(tx, _tree(1), dtype=jnp.bfloat16 if master else np.float32)
    xla = make_stage_update(tx, prep, orep, layout, clip, elementwise=True)
    kernel = make_stage_update(tx, prep, orep, layout, clip, elementwise=True, kernel=spec)
    norms = (make_stage_update_norm(tx, prep, orep, layout, clip, elementwise=True),
             make_stage_update_norm(tx, prep, orep, layout, clip, elementwise=True, kernel=spec))
    return xla, kernel, norms, inputs


def _as_values(x) -> np.ndarray:
    """A page held as bits (memory/layout.py) as its values: here every 32-bit page is float32 and every 16-bit
    one bfloat16 (the kernel's dtypes)."""
    x = np.asarray(x)
    return {np.dtype(np.uint32): lambda: x.view(np.float32), np.dtype(np.uint16): lambda: x.view(jnp.bfloat16)}.get(
        x.dtype, lambda: x)()


def _assert_equal(a, b, *, exact: bool = False):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        if exact:
            np.testing.assert_array_equal(x, y)
        else:
            assert x.dtype == y.dtype
            np.testing.assert_allclose(_as_values(y), _as_values(x), rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize("name,clip,norm,state_dtype", [
    ("adamw", 1.0, 3.0, "float32"), ("adamw", 1.0, 0.5, "float32"), ("adam", 0.0, 3.0, "float32"),
    ("adamw", 1.0, 3.0, "bfloat16"), ("lion", 1.0, 3.0, "float32"), ("lion", 0.0, 3.0, "bfloat16")],
    ids=["adamw-clipped", "adamw-under-the-clip", "adam-no-clip", "bf16-state", "lion", "lion-bf16-state"])
def test_kernel_steps_equal_xla_steps(name, clip, norm, state_dtype):
    """Ten steps fed back into themselves (warm-up, bias corrections and the schedule's count move each step)."""
    xla, kernel, _, (pp, gp, op, small) = _updates(name, clip, state_dtype)
    assert op[0].dtype == bits_dtype(state_dtype)  # (pages are held as the bits of their values)
    assert HOST_OPTIMIZER in jax.jit(kernel).lower(pp, gp, op, small, jnp.float32(norm), jnp.bool_(True),
                                               jnp.float32(0.5)).as_text()
    a = b = (pp, op, small)
    rng = np.random.default_rng(3)
    for _ in range(STEPS):
        grads = tuple(to_bits(jnp.asarray(rng.standard_normal(g.shape).astype(np.float32))) for g in gp)
        args = (jnp.float32(norm), jnp.bool_(True), jnp.float32(0.5))
        ra, rb = jax.jit(xla)(a[0], grads, a[1], a[2], *args), jax.jit(kernel)(b[0], grads, b[1], b[2], *args)
        _assert_equal(ra[:3], rb[:3])  # XLA rounds some elements differently by one unit in the last place
        np.testing.assert_allclose(float(rb[3]), float(ra[3]), rtol=1e-5)
        assert bool(ra[4]) and bool(rb[4])
        a, b = ra[:3], rb[:3]
    assert not np.array_equal(np.asarray(b[0][0]), np.asarray(pp[0]))  # it did train


@pytest.mark.parametrize("name,state_dtype", [("adamw", "float32"), ("adamw", "bfloat16"), ("lion", "bfloat16")],
                         ids=["adamw", "adamw-bf16-moments", "lion-bf16-moments"])
def test_kernel_steps_with_master_weights_equal_xla_steps(name, state_dtype):
    """optimizer.master_weights: bfloat16 parameter and gradient pages, a float32 master among the optimizer
    pages (beside bfloat16 moments: pages of two dtypes, which only the leaf-wise XLA update handles otherwise).
    The kernel steps the master and rounds the parameters to it as `with_master_weights` does."""
    xla, kernel, _, (pp, gp, op, small) = _updates(name, 1.0, state_dtype, master=True)
    assert pp[0].dtype == bits_dtype(jnp.bfloat16) and \
        {str(o.dtype) for o in op} == {"uint32", str(bits_dtype(state_dtype))}
    assert HOST_OPTIMIZER in jax.jit(kernel).lower(pp, gp, op, small, jnp.float32(3.0), jnp.bool_(True),
                                               jnp.float32(0.5)).as_text()
    # Each step from the same state (XLA's last): XLA keeps excess precision where it fuses (a bfloat16 rounding
    # of the clipped gradient may be skipped, xla_allow_excess_precision), so a bfloat16 value is an ulp apart now
    # and then, and chained steps would drift apart from it.
    state = (pp, op, small)
    rng = np.random.default_rng(4)
    for _ in range(STEPS):
        grads = tuple(to_bits(jnp.asarray(rng.standard_normal(g.shape), jnp.bfloat16)) for g in gp)
        args = (jnp.float32(3.0), jnp.bool_(True), jnp.float32(0.5))
        ra, rb = jax.jit(xla)(*state[:1], grads, *state[1:], *args), jax.jit(kernel)(*state[:1], grads, *state[1:],
                                                                                     *args)
        for x, y in zip((*ra[0], *ra[1]), (*rb[0], *rb[1])):
            x, y = _as_values(x).astype(np.float32), _as_values(y).astype(np.float32)
            close = np.isclose(y, x, rtol=2e-6, atol=1e-12)  # float32: the same to its rounding
            assert close.mean() > 0.97 and np.allclose(y, x, rtol=2 ** -7, atol=1e-6), (x[~close], y[~close])
        _assert_equal(ra[2], rb[2], exact=True)
        np.testing.assert_allclose(float(rb[3]), float(ra[3]), rtol=1e-2)  # (the step to the master: a flipped
        # bfloat16 parameter moves it by its ulp)
        state = ra[:3]
    assert not np.array_equal(np.asarray(state[0][0]), np.asarray(pp[0]))  # it did train
    out = jax.jit(kernel)(pp, gp, op, small, jnp.float32(3.0), jnp.bool_(False), jnp.float32(1.0))
    _assert_equal((pp, op, small), out[:3], exact=True)  # a dropped update changes nothing


def test_a_dropped_update_leaves_every_page_and_count_bit_for_bit():
    xla, kernel, _, (pp, gp, op, small) = _updates("adamw", 1.0)
    out = jax.jit(kernel)(pp, gp, op, small, jnp.float32(3.0), jnp.bool_(False), jnp.float32(1.0))
    _assert_equal((pp, op, small), out[:3], exact=True)
    assert not bool(out[4])
    ref = jax.jit(xla)(pp, gp, op, small, jnp.float32(3.0), jnp.bool_(False), jnp.float32(1.0))
    np.testing.assert_allclose(float(out[3]), float(ref[3]), rtol=1e-5)  # the update's norm is still reported


def test_donated_pages_are_updated_in_place():
    """As the updater calls it (parameters and optimizer pages donated): no copy of a page, the results live in
    the buffers the operands did."""
    _, kernel, _, (pp, gp, op, small) = _updates("adamw", 1.0)
    fn = jax.jit(kernel, donate_argnums=(0, 2))
    args = (jnp.float32(3.0), jnp.bool_(True), jnp.float32(1.0))
    hlo = fn.lower(pp, gp, op, small, *args).compile().as_text()
    assert not re.search(r"[uf]32\[\d+\]\{0\} copy\(", hlo)  # scalars may be copied, never a page
    pp, op = tuple(jnp.asarray(p) + 0 for p in pp), tuple(jnp.asarray(o) + 0 for o in op)  # buffers of its own
    before = [p.unsafe_buffer_pointer() for p in (*pp, *op)]
    out = fn(pp, gp, op, small, *args)
    assert [p.unsafe_buffer_pointer() for p in (*out[0], *out[1])] == before


def test_the_first_pass_computes_the_norm_and_writes_nothing():
    _, _, (xla_norm, kernel_norm), (pp, gp, op, small) = _updates("adamw", 1.0)
    hlo = jax.jit(kernel_norm).lower(pp, gp, op, small, jnp.float32(3.0), jnp.float32(1.0)).as_text()
    assert HOST_OPTIMIZER in hlo
    np.testing.assert_allclose(float(jax.jit(kernel_norm)(pp, gp, op, small, jnp.float32(3.0), jnp.float32(1.0))),
                               float(jax.jit(xla_norm)(pp, gp, op, small, jnp.float32(3.0), jnp.float32(1.0))),
                               rtol=1e-5)


def test_processes_on_one_machine_share_its_cores():
    assert kernel_threads({}, cores=16) == 16
    assert kernel_threads({"ANGEL_JAX_LOCAL_PROCESSES": "4"}, cores=16) == 4
    assert kernel_threads({"SLURM_NTASKS_PER_NODE": "8(x2)"}, cores=16) == 2
    assert kernel_threads({"ANGEL_JAX_LOCAL_PROCESSES": "4"}, cores=2) == 1
    assert kernel_threads({"SLURM_NTASKS_PER_NODE": "odd"}, cores=2) == 2


def test_other_optimizers_keep_xla():
    schedule = optax.constant_schedule(1e-3)
    assert host_optimizer(OptimizerConfig(name="sgd"), schedule) is None
    assert host_optimizer(OptimizerConfig(name="adafactor"), schedule) is None
    assert host_optimizer(OptimizerConfig(host_kernel=False), schedule) is None
    assert host_update_by(OptimizerConfig(name="sgd")) == \
        "XLA (the host kernel updates adamw, adam, lion; the optimizer is sgd)"
    assert host_update_by(OptimizerConfig(host_kernel=False)) == "XLA (optimizer.host_kernel is off)"
    assert host_update_by(OptimizerConfig(name="lion")) == "the fused host kernel (lion), on every core"


def test_a_compiler_that_fails_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("ANGEL_JAX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # found on PATH, exits 1
    with pytest.raises(RuntimeError, match="failed"):
        build()
    assert not list(tmp_path.iterdir())  # nothing half-built left in the cache


def test_lowered_for_a_gpu_the_update_is_xlas():
    """Device-resident stages on an accelerator compile the same update function: lowered for CUDA (no GPU needed
    to lower) it must not call the CPU-only kernel, and for the CPU it must."""
    _, kernel, (_, kernel_norm), (pp, gp, op, small) = _updates("adamw", 1.0)
    args = (jnp.float32(3.0), jnp.bool_(True), jnp.float32(1.0))
    for platform, calls in (("cpu", True), ("cuda", False)):
        text = jax.jit(kernel).trace(pp, gp, op, small, *args).lower(lowering_platforms=(platform,)).as_text()
        assert (HOST_OPTIMIZER in text) is calls, platform
    text = jax.jit(kernel_norm).trace(pp, gp, op, small, jnp.float32(3.0), jnp.float32(1.0)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert HOST_OPTIMIZER not in text


def test_any_number_of_threads_gives_the_same_bits():
    """The kernel's chunks (64 Ki elements) spread over threads; its sum of squares is summed per chunk in chunk
    order, so one thread and several give the same pages and the same sum, bit for bit."""
    n = 5 * 65536 + 123  # six chunks, the last one short
    rng = np.random.default_rng(0)
    p, g, m = (jnp.asarray(rng.standard_normal(n).astype(np.float32)) for _ in range(3))
    v = jnp.asarray(rng.random(n).astype(np.float32))
    coeffs = jnp.asarray([0.1, 0.9, 0.05, 0.95, 0.2, 0.1, 0.0, 1e-8, 0.1, -1e-3, 0.5, 3.0, 1.0, 0.0, 1.0],
                         jnp.float32)  # clipping on (trigger 0), applied
    table = np.asarray([0, 0, -1, 0, 0, 0, 1, 0, n], np.int64)  # params 0, no master, mu page 0, nu page 1
    assert load_host_optimizer() is None

    def run(threads: int):
        shapes = [jax.ShapeDtypeStruct((n,), jnp.float32)] * 3
        call = jax.ffi.ffi_call(HOST_OPTIMIZER, (jax.ShapeDtypeStruct((), jnp.float32), *shapes))
        return call(coeffs, p, g, m, v, table=table, param_pages=np.int64(1), opt_pages=np.int64(2),
                    threads=np.int64(threads), lion=np.int64(0), master=np.int64(0))

    one = run(-1)  # (negative: exactly that many threads, however few elements each gets)
    for threads in (-2, -5):
        _assert_equal(one, run(threads), exact=True)
    assert float(one[0]) > 0 and not np.array_equal(np.asarray(one[1]), np.asarray(p))


def test_fresh_outputs_for_pages_that_cannot_be_donated():
    """Pages aliased from an accelerator's pinned memory cannot be donated: the kernel's variant writes buffers of
    its own instead of in place (no copy of the operands first), with the same results; a dropped update fills
    them with the old pages, bit for bit, and the operands are never written."""
    _, kernel, _, (pp, gp, op, small) = _updates("adamw", 1.0)
    pp, op = tuple(jnp.asarray(p) for p in pp), tuple(jnp.asarray(o) for o in op)
    before = [np.array(a) for a in (*pp, *op)]
    fresh = jax.jit(kernel.fresh_outputs)
    hlo = fresh.lower(pp, gp, op, small, jnp.float32(3.0), jnp.bool_(True), jnp.float32(1.0)).compile().as_text()
    assert "output_to_operand_aliasing" not in hlo and not re.search(r"[uf]32\[\d+\]\{0\} copy\(", hlo)
    for ok in (True, False):
        args = (jnp.float32(3.0), jnp.bool_(ok), jnp.float32(1.0))
        _assert_equal(jax.jit(kernel)(pp, gp, op, small, *args)[:4], fresh(pp, gp, op, small, *args)[:4],
                      exact=True)
    _assert_equal(before, [np.asarray(a) for a in (*pp, *op)], exact=True)  # the operands kept their bytes
    _assert_equal((pp, op), fresh(pp, gp, op, small, jnp.float32(3.0), jnp.bool_(False), jnp.float32(1.0))[:2],
                  exact=True)


def test_leaves_that_follow_one_another_in_every_family_make_one_segment():
    """The table cuts a stage's elements where a page of any family ends, and nowhere else: with pages that hold
    the whole stage, one segment (one pass of the kernel over long runs, as over the flat update's segments)."""
    cfg = OptimizerConfig(name="adamw", lr=1e-2, warmup_steps=3)
    tx, schedule = make_optimizer(cfg, STEPS, clip=False)
    params = _tree(0)
    big, _, layout = split_opt_state(tx.init(params))
    whole = 1 << 20  # bytes: every family on one page
    prep = PageLayout.build([("s", params)], whole).stage("s")
    orep = PageLayout.build([("s", [np.asarray(b) for b in big])], whole).stage("s")
    spec = host_optimizer(cfg, schedule)
    size = sum(s.size for s in prep.slots)
    table = kernel_table(tx, prep, orep, layout.paged, spec).reshape(-1, 9)
    assert table.tolist() == [[0, 0, -1, 0, 0, 0, 0, size, size]]  # mu, then nu after it on the same page
    small = kernel_table(tx, *_setup(tx, _tree(1))[:2], layout.paged, spec).reshape(-1, 9)
    # 64-element pages: the parameters' and mu's first page ends at element 64, nu (from element 81 of the optimizer
    # pages) reaches its second page's end at 128 - 81 = 47: cut there, and only there.
    assert small[:, 8].tolist() == [47, 17, 17]

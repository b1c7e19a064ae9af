"""PageLayout: pack/unpack are bit-exact for arbitrary pytrees, dtypes, shapes and page sizes, eagerly and under
jit; the layout rules (one dtype per page, stages never share pages, spanning, sharing, padding) hold."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from angel_jax.memory import LeafSlot, PageLayout

DTYPES = [np.dtype(d) for d in (np.float32, np.float16, jnp.bfloat16, np.int8, np.uint8, np.int16, np.uint16,
                                np.int32, np.uint32, np.bool_, ml_dtypes.float8_e4m3fn)]


def random_array(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Arbitrary bit patterns (NaNs with payloads, infinities, subnormals) except for bool (0/1 only)."""
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    return np.frombuffer(rng.bytes(n * dtype.itemsize), dtype).reshape(shape).copy()


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@st.composite
def staged_trees(draw, max_dim: int = 40, page_sizes: tuple[int, ...] = (8, 16, 24, 64, 200, 1024)):
    """[(stage name, {leaf name: (shape, dtype) or [..]})], page size (a multiple of every itemsize)."""
    shapes = st.lists(st.integers(0, max_dim), min_size=0, max_size=3).map(tuple)
    leaf = st.tuples(shapes, st.sampled_from(DTYPES))
    n_stages = draw(st.integers(1, 3))
    stages = []
    for s in range(n_stages):
        leaves = draw(st.lists(leaf, min_size=0, max_size=5))
        nested = draw(st.booleans())
        tree = {f"w{i}": spec for i, spec in enumerate(leaves)}
        if nested and leaves:
            tree = {"a": [spec for spec in leaves[: len(leaves) // 2]], "b": {"c": leaves[len(leaves) // 2:]}}
        stages.append((f"stage{s}", tree))
    page_size = draw(st.sampled_from(page_sizes))
    seed = draw(st.integers(0, 2**31))
    return stages, page_size, seed


def materialize(stages, seed):
    rng = np.random.default_rng(seed)
    is_spec = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], np.dtype)  # noqa: E731
    return [(name, jax.tree.map(lambda s: random_array(rng, *s), tree, is_leaf=is_spec)) for name, tree in stages]


def _as_shipped(fn, args):
    """jit(fn)(args) compiled with XLA's default backend optimisation (level 3), as training compiles it: the suite
    compiles at level 0 (conftest.py), where a bfloat16 subnormal that passes through the CPU backend's
    unoptimised code comes back as zero. Bit-exactness is a property of the programs training runs."""
    return jax.jit(fn).lower(args).compile(compiler_options={"xla_backend_optimization_level": 3})(args)


def check_round_trip(layout: PageLayout, trees, mode: str) -> None:
    """numpy: pack/unpack with numpy ops; jit: every stage packed in one jitted program, unpacked in another."""
    names = [name for name, _ in trees]
    if mode == "numpy":
        all_pages = [layout.pack(name, tree) for name, tree in trees]
        assert all(isinstance(p, np.ndarray) for pages in all_pages for p in pages)
        backs = [layout.unpack(name, pages) for name, pages in zip(names, all_pages)]
    else:
        all_pages = _as_shipped(lambda ts: [layout.pack(n, t) for n, t in zip(names, ts)], [t for _, t in trees])
        backs = _as_shipped(lambda ps: [layout.unpack(n, p) for n, p in zip(names, ps)], all_pages)
    for (name, tree), pages, back in zip(trees, all_pages, backs):
        stage = layout.stage(name)
        assert len(pages) == len(stage.pages)
        for spec, page in zip(stage.pages, pages):
            assert page.shape == (spec.length,) and np.dtype(page.dtype) == spec.bits  # held as bits
            assert spec.nbytes == layout.page_size_bytes
        flat_in, tdef_in = jax.tree.flatten(tree)
        flat_out, tdef_out = jax.tree.flatten(back)
        assert tdef_in == tdef_out
        for slot, a, b in zip(stage.slots, flat_in, flat_out):
            assert same_bits(a, b), f"{mode}: {name}{slot.path} differs"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(staged_trees())
def test_pack_unpack_bit_exact_numpy(case):
    stages, page_size, seed = case
    trees = materialize(stages, seed)
    layout = PageLayout.build(trees, page_size_bytes=page_size)
    check_round_trip(layout, trees, "numpy")
    check_invariants(layout)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(staged_trees(max_dim=12, page_sizes=(24, 64, 200)))  # bounded page counts: compile time grows with them
# Found by hypothesis once (bfloat16 subnormals and a NaN payload): kept as an example for every run.
@example(([("stage0", {"w0": ((4, 5), np.dtype(jnp.bfloat16))})], 200, 1530))
def test_pack_unpack_bit_exact_under_jit(case):
    stages, page_size, seed = case
    trees = materialize(stages, seed)
    layout = PageLayout.build(trees, page_size_bytes=page_size)
    check_round_trip(layout, trees, "jit")


def every_bit_pattern(dtype: np.dtype) -> np.ndarray:
    """Every value a dtype can hold, as an array: all 2**8 / 2**16 patterns of the 8- and 16-bit dtypes (every
    subnormal, both zeros, every NaN payload, the infinities); for 32-bit dtypes the classes' edges (zeros,
    subnormals, normals, infinities, quiet and signalling NaNs with payloads, both signs) and 4096 random ones."""
    if dtype == np.bool_:
        return np.array([False, True])
    if dtype.itemsize <= 2:
        return np.arange(2 ** (8 * dtype.itemsize), dtype=np.uint64).astype(f"u{dtype.itemsize}").view(dtype)
    edges = np.array([0x0, 0x1, 0x2, 0x7FFFFF, 0x400000, 0x800000, 0x800001, 0x3F800000, 0x7F7FFFFF, 0x7F800000,
                      0x7F800001, 0x7FA00000, 0x7FBFFFFF, 0x7FC00000, 0x7FC00001, 0x7FFFFFFF], np.uint32)
    rng = np.random.default_rng(0)
    pattern = np.concatenate([edges, edges | 0x80000000, rng.integers(0, 2**32, 4096, dtype=np.uint64)])
    return pattern.astype(np.uint32).view(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_bit_pattern_survives_pack_unpack(dtype):
    """Explicit, not drawn: every bit pattern of each accepted dtype, through numpy, eager jax and jit, in leaves
    that share pages, span pages and start at odd offsets."""
    values = every_bit_pattern(dtype)
    tree = {"head": values[:7], "all": values, "tail": values[::-1][:3].copy()}
    layout = PageLayout.build([("s", tree)], page_size_bytes=8192)
    assert len(layout.stage("s").pages) > 1 or values.nbytes < 8192
    back_np = layout.unpack("s", layout.pack("s", tree))
    jax_tree = jax.tree.map(jnp.asarray, tree)
    back_eager = layout.unpack("s", layout.pack("s", jax_tree))
    pages = jax.jit(lambda t: layout.pack("s", t))(tree)
    back_jit = jax.jit(lambda p: layout.unpack("s", p))(pages)
    both_jit = jax.jit(lambda t: layout.unpack("s", layout.pack("s", t)))(tree)
    for how, back in (("numpy", back_np), ("eager", back_eager), ("jit", back_jit), ("one jit", both_jit)):
        for key in tree:
            assert same_bits(tree[key], back[key]), f"{how}: {dtype} leaf {key!r} changed bits"
    for spec, page in zip(layout.stage("s").pages, pages):  # the pages themselves hold the bits unchanged
        expect = layout.pack("s", tree)[spec.id]
        assert same_bits(expect, page), f"jit pack: {dtype} page {spec.id} differs from numpy's"


def test_pack_unpack_bit_exact_eager_jax():
    """Eager jax arrays in, jax arrays out (the same code path as under jit, op by op)."""
    rng = np.random.default_rng(7)
    tree = {"a": random_array(rng, (5, 7), np.dtype(np.float32)), "b": random_array(rng, (0, 3), DTYPES[2]),
            "c": random_array(rng, (40,), DTYPES[2]), "d": random_array(rng, (9,), np.dtype(np.bool_))}
    layout = PageLayout.build([("s", tree)], page_size_bytes=32)
    pages = layout.pack("s", jax.tree.map(jnp.asarray, tree))
    assert all(isinstance(p, jax.Array) for p in pages)
    back = layout.unpack("s", pages)
    assert all(same_bits(x, y) for x, y in zip(jax.tree.leaves(tree), jax.tree.leaves(back)))


def check_invariants(layout: PageLayout) -> None:
    """Slots tile each (stage, dtype) group without overlap, in order; page ids are global and consecutive."""
    ids = [p.id for p in layout.pages]
    assert ids == list(range(layout.num_pages))
    for stage in layout.stages:
        by_page = {p.id: p for p in stage.pages}
        used = {p.id: 0 for p in stage.pages}
        for slot in stage.slots:
            if slot.size == 0:
                assert slot.page == -1
                continue
            spans = slot.spans(by_page[slot.page].length)
            assert sum(b - a for _, a, b in spans) == slot.size
            for pid, a, b in spans:
                assert by_page[pid].dtype == slot.dtype  # a page holds one dtype
                assert by_page[pid].stage == stage.name  # pages never mix stages
                assert a == used[pid], "leaves are laid end to end"
                used[pid] = b
        for p in stage.pages:
            assert used[p.id] == p.used and 0 < p.used <= p.length
    data = sum(s.nbytes for st_ in layout.stages for s in st_.slots)
    assert layout.data_bytes == data
    assert layout.waste_bytes == layout.total_bytes - data


def test_spanning_sharing_and_waste():
    f32 = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    trees = [("embed", {"big": f32(10), "small": f32(3)}),   # big spans pages 0..2 (page = 4 floats)
             ("head", {"b": np.zeros(2, jnp.bfloat16), "w": f32(1), "x": np.zeros(3, jnp.bfloat16)})]
    layout = PageLayout.build(trees, page_size_bytes=16)
    embed, head = layout.stage("embed"), layout.stage("head")
    big, small = embed.slots
    assert (big.page, big.offset, big.size) == (0, 0, 10)
    assert [p for p, _, _ in big.spans(4)] == [0, 1, 2]
    assert (small.page, small.offset) == (2, 2)  # shares page 2 with big's tail, spills into page 3
    assert embed.page_ids == (0, 1, 2, 3)
    # head starts on a fresh page; bf16 leaves share one page, the f32 leaf gets its own.
    assert head.page_ids == (4, 5)
    assert [layout.page(i).dtype for i in head.page_ids] == [np.dtype(jnp.bfloat16), np.dtype(np.float32)]
    b, w, x = head.slots
    assert (b.page, b.offset, x.page, x.offset, w.page) == (4, 0, 4, 2, 5)
    # waste: embed 16 floats for 13 -> 12 B; head bf16 8 slots for 5 -> 6 B, f32 4 for 1 -> 12 B
    assert layout.waste_bytes == 12 + 6 + 12
    assert layout.total_bytes == 6 * 16
    assert layout.waste_fraction == pytest.approx(30 / 96)
    assert layout.summary()["stages"]["head"]["pages"] == [4, 5]
    assert isinstance(big, LeafSlot)
    # The page size on which each stage's group of one dtype fits a page: embed's 13 floats (52 B) -> 64 B.
    assert layout.fitted_page_size(smallest=1) == 64
    assert layout.fitted_page_size() == 4096  # never below the smallest page the config allows
    refitted = PageLayout.build(trees, page_size_bytes=64)
    assert [len(s.pages) for s in refitted.stages] == [1, 2]


def test_pages_packed_under_jit_are_written_into_zeros_with_numpys_bits():
    """Under jit a page is its leaves written into a zero buffer: the same bits as numpy's concatenation with a zero
    tail, padding included, and no concatenation or pad in the program (XLA's CPU backend fuses those into the
    page's readers as a slow loop, see `written_page`)."""
    rng = np.random.default_rng(3)
    tree = {"big": rng.standard_normal(10).astype(np.float32), "small": rng.standard_normal(3).astype(np.float32),
            "half": rng.standard_normal(5).astype(jnp.bfloat16)}
    stage = PageLayout.build([("s", tree)], page_size_bytes=16).stage("s")  # spanning, sharing and padding
    expected = stage.pack(tree)
    packed = _as_shipped(stage.pack, jax.tree.map(jnp.asarray, tree))
    assert len(packed) == len(expected) == 5  # 13 float32 in pages of 4, 5 bfloat16 in one of 8
    for a, b in zip(packed, expected):
        assert same_bits(a, b)
    primitives = {eqn.primitive.name for eqn in jax.make_jaxpr(stage.pack)(tree).eqns}
    assert "dynamic_update_slice" in primitives and not primitives & {"concatenate", "pad"}


def test_a_model_much_smaller_than_its_pages_is_told_the_page_size_that_fits_it():
    """A layout of 64 MiB pages for stages of a few KiB is nearly all padding; the fitted size is the next power
    of two above the largest stage's bytes of one dtype."""
    stages = [(f"block{i}", {"w": np.zeros((64, 48), np.float32), "b": np.zeros(48, np.float32)}) for i in range(4)]
    layout = PageLayout.build(stages, page_size_bytes=64 << 20)
    assert layout.waste_fraction > 0.99
    assert layout.fitted_page_size() == 16384  # (64 * 48 + 48) * 4 = 12480 B
    assert PageLayout.build(stages, page_size_bytes=16384).waste_fraction < 0.25


@pytest.mark.compares_programs  # a jitted matmul against numpy
def test_stage_function_takes_only_its_pages_and_unpacks_inside_jit():
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((8, 8)).astype(np.float32), "b": rng.standard_normal(8).astype(np.float32)}
    other = {"w": rng.standard_normal((3, 3)).astype(np.float32)}
    layout = PageLayout.build([("block", params), ("other", other)], page_size_bytes=128)
    stage = layout.stage("block")
    assert len(stage.pages) == 3  # 72 floats in 32-float pages

    @jax.jit
    def apply(pages, x):
        p = stage.unpack(pages)
        return jnp.tanh(x @ p["w"] + p["b"])

    x = rng.standard_normal((2, 8)).astype(np.float32)
    pages = tuple(jnp.asarray(p) for p in stage.pack(params))
    expected = np.tanh(x @ params["w"] + params["b"])
    np.testing.assert_allclose(np.asarray(apply(pages, x)), expected, rtol=1e-5, atol=1e-6)
    hlo = apply.lower(pages, x).as_text()
    assert "slice" in hlo  # unpacking is slices + reshapes in the stage's own program
    with pytest.raises(ValueError, match="expected 3 pages"):
        stage.unpack(pages[:2])


def test_errors_name_the_problem():
    tree = {"w": np.zeros((2, 3), np.float32)}
    layout = PageLayout.build([("s", tree)], page_size_bytes=64)
    with pytest.raises(ValueError, match=r"\['w'\] must be float32\[2, 3\]"):
        layout.pack("s", {"w": np.zeros((3, 2), np.float32)})
    with pytest.raises(ValueError, match="structure differs"):
        layout.pack("s", {"v": np.zeros((2, 3), np.float32)})
    with pytest.raises(KeyError, match="no stage 'x'"):
        layout.stage("x")
    with pytest.raises(ValueError, match="not a multiple of the int32 item size"):
        PageLayout.build([("s", {"a": np.zeros(3, np.int32)})], page_size_bytes=6)
    with pytest.raises(ValueError, match="appears twice"):
        PageLayout.build([("s", tree), ("s", tree)], page_size_bytes=64)
    if not jax.config.jax_enable_x64:
        with pytest.raises(TypeError, match="float64"):
            PageLayout.build([("s", {"a": np.zeros(3, np.float64)})], page_size_bytes=64)
    with pytest.raises(TypeError, match="no shape/dtype"):
        PageLayout.build([("s", {"a": 1.0})], page_size_bytes=64)


def test_built_from_abstract_shapes_and_hashable():
    abstract = {"w": jax.ShapeDtypeStruct((1000,), jnp.bfloat16)}
    layout = PageLayout.build([("s", abstract)])
    assert layout.page_size_bytes == 64 * 2**20
    assert layout.stage("s").pages[0].length == 32 * 2**20
    assert hash(layout) == hash(PageLayout.build([("s", abstract)]))


def test_fitted_page_size_puts_each_block_on_its_own_bytes_without_more_pages():
    """The scale benchmark's GPT (d_model 2048): a block's 50,358,272 float32 parameters are 201.4 MB, 106 KB more
    than 3 pages of 64 MiB, so at 64 MiB its 4 pages are a quarter padding; fitted, the same 4 pages are 50.4 MB
    each (the block's bytes / 4 rounded up to 64 KiB), and the small embedding and head keep one page each."""
    from angel_jax.memory.layout import FIT_ALIGN, fit_page_size

    block = {"w": jax.ShapeDtypeStruct((50_358_272,), np.float32)}
    stages = [("embed", {"e": jax.ShapeDtypeStruct((256, 2048), np.float32)})] + \
        [(f"block.{i}", block) for i in range(8)] + [("head", {"h": jax.ShapeDtypeStruct((2048, 256), np.float32)})]
    limit = 64 * 2**20
    size = fit_page_size(stages, limit)
    assert size == 50_397_184 == -(-50_358_272 * 4 // 4 // FIT_ALIGN) * FIT_ALIGN
    at_limit, fitted = PageLayout.build(stages, limit), PageLayout.build(stages, size)
    assert fitted.num_pages == at_limit.num_pages == 34
    assert at_limit.stage("block.0").waste_bytes / at_limit.stage("block.0").nbytes > 0.24
    assert fitted.stage("block.0").waste_bytes == 4 * size - 50_358_272 * 4 < 4 * FIT_ALIGN
    # A model whose stages are all much smaller than the page: pages of the largest stage's bytes, one per stage.
    tiny = [("embed", {"e": jax.ShapeDtypeStruct((512 * 1024,), np.float32)}),
            ("block", {"w": jax.ShapeDtypeStruct((50_000,), np.float32)})]
    assert fit_page_size(tiny, limit) == 2 * 2**20
    # Fitting never multiplies the pages: a tiny block beside a large embedding does not cut the embedding into
    # block-sized pages (18 pages instead of 2), and a limit under the alignment is kept as it is.
    assert PageLayout.build(tiny, fit_page_size(tiny, limit)).num_pages == 2
    assert fit_page_size(tiny, 4096) == 4096

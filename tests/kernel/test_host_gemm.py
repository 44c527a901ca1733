"""The host's register-tiled contractions (``opt.tile_gemm``, rendered by ``CRenderer.render_gemm``): the plan the
pass makes, the C it renders, and that every tile (every ``search_space`` candidate, remainders in every
dimension, batches, transposed operands, float32/float64/int32, wide accumulators, fused epilogues) computes
what the pass-off path and NumPy compute."""

from __future__ import annotations

import contextlib
import ctypes
import math

import numpy as np
import pytest
from conftest import host_without_blas, kernels_of, passes_off
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import zyx
from zyx import dtypes
from zyx.backends.base import DeviceInfo
from zyx.backends.registry import registry
from zyx.kernel import ir, opt
from zyx.kernel.contraction import find_contraction
from zyx.kernel.ir import Kernel, Param, Store
from zyx.kernel.render import CRenderer
from zyx.ops import Ops

HOST2 = DeviceInfo("host", "host", compute_units=2, vector_bytes=64, vector_registers=32)  # AVX-512
AVX2 = DeviceInfo("host", "host", compute_units=2, vector_bytes=32, vector_registers=16)
NP = {dtypes.float32: np.float32, dtypes.float64: np.float64, dtypes.int32: np.int32}


def _mm_kernel(m: int, kk: int, n: int, d=dtypes.float32, ta: bool = False, tb: bool = False, batch: int = 1,
               epilogue: bool = False, shared_b: bool = False) -> Kernel:
    """out[b, i, j] = sum_r a[b, i, r] * b[b, r, j] (``ta``/``tb``: the operand is stored transposed), plus
    ``p3[j]`` and a max with 0 when ``epilogue``; ``shared_b``: one ``b`` for every batch index."""
    loops = ((ir.range_(9, batch),) if batch > 1 else ()) + (ir.range_(0, m), ir.range_(1, n))
    i, j, r = loops[-2], loops[-1], ir.range_(2, kk)
    bo = loops[0] if batch > 1 else ir.const(0, ir.index_dtype)
    ia = bo * (m * kk) + (r * m + i if ta else i * kk + r)
    ib = (ir.const(0, ir.index_dtype) if shared_b else bo * (kk * n)) + (j * kk + r if tb else r * n + j)
    red = ir.reduce(Ops.ADD, ir.alu(Ops.MUL, ir.load(1, d, ia), ir.load(2, d, ib)), (r,))
    params = [Param("p0", d, "out", batch * m * n), Param("p1", d, "in", batch * m * kk),
              Param("p2", d, "in", (1 if shared_b else batch) * kk * n)]
    val = red
    if epilogue:
        params.append(Param("p3", d, "in", n))
        val = ir.alu(Ops.MAX, ir.alu(Ops.ADD, red, ir.load(3, d, j)), ir.const(0, d))
    return Kernel("k", tuple(params), loops, (Store(0, bo * (m * n) + i * n + j, val),))


def _inputs(m: int, kk: int, n: int, d, ta: bool, tb: bool, batch: int, seed: int = 0,
            shared_b: bool = False) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    t = NP[d]

    def rand(*shape):
        if d is dtypes.int32:
            return rng.integers(-50, 50, shape).astype(t)
        return rng.standard_normal(shape).astype(t)

    nb = 1 if shared_b else batch
    return [rand(batch, kk, m) if ta else rand(batch, m, kk), rand(nb, n, kk) if tb else rand(nb, kk, n), rand(n)]


def _reference(xs: list[np.ndarray], ta: bool, tb: bool, epilogue: bool, d) -> np.ndarray:
    wide = np.int64 if d is dtypes.int32 else np.float64
    a = xs[0].astype(wide).transpose(0, 2, 1) if ta else xs[0].astype(wide)
    b = xs[1].astype(wide).transpose(0, 2, 1) if tb else xs[1].astype(wide)
    out = a @ b
    if epilogue:
        out = np.maximum(out + xs[2].astype(wide), 0)
    return out


_LIBS: dict[str, ctypes.CDLL] = {}


def _host():
    return next(dv for dv in registry().get("host").devices if dv.info().kind == "host")


def _run_kernel(k: Kernel, xs: list[np.ndarray], params: dict | None = None, off: bool = False,
                info: DeviceInfo = HOST2) -> tuple[np.ndarray, Kernel]:
    """Optimize (``"gemm"`` disabled when ``off``), render, compile and run ``k`` on ``xs``; the output and the
    optimized kernel."""
    with passes_off("gemm") if off else contextlib.nullcontext():
        ko = opt.optimize(k, info, params)
    src = CRenderer().render(ko)
    lib = _LIBS.get(src)
    if lib is None:
        lib = _LIBS[src] = _host().compiler.compile(src, k.name)
    out = np.zeros(k.params[0].size, NP[k.params[0].dtype])
    bufs = [out] + [np.ascontiguousarray(x).ravel() for x in xs[: len(k.params) - 1]]
    args = (ctypes.c_void_p * len(bufs))(*[b.ctypes.data for b in bufs])
    fn = getattr(lib, k.name)
    fn.argtypes = [ctypes.c_void_p]
    fn(args)
    return out, ko


def _check(out: np.ndarray, ref: np.ndarray, d, kk: int) -> None:
    ref = ref.ravel()
    if d is dtypes.int32:
        np.testing.assert_array_equal(out, ref.astype(np.int32))
    else:
        eps = np.finfo(NP[d]).eps
        np.testing.assert_allclose(out, ref, rtol=0, atol=8 * eps * kk ** 0.5 * (1 + np.abs(ref).max()))


# ---- the plan and its rendering ------------------------------------------------------------------------------


@pytest.mark.parametrize("registers,n_vectors,tile", [(32, 8, (6, 4)), (32, 3, (12, 2)), (32, 1, (12, 1)),
                                                       (16, 8, (6, 2)), (16, 2, (6, 2)), (16, 1, (12, 1)),
                                                       (8, 8, (6, 1))])
def test_the_register_tile_fits_the_targets_registers(registers, n_vectors, tile):
    mr, vecs = opt._gemm_shape(n_vectors, registers)
    assert (mr, vecs) == tile and mr * vecs + vecs + 1 <= registers


def test_an_avx2_target_gets_a_tile_of_16_registers_and_it_computes_the_same():
    k = _mm_kernel(96, 40, 72)
    g = opt.optimize(k, AVX2).gemm
    assert (g.mr, g.nr) == (6, 16)
    assert opt.search_space(k, AVX2)["gemm_nr"][:2] == (16, 8)
    xs = _inputs(96, 40, 72, dtypes.float32, False, False, 1)
    out, _ = _run_kernel(k, xs, info=AVX2)
    _check(out, _reference(xs, False, False, False, dtypes.float32), dtypes.float32, 40)


def test_256_cube_float32_gets_the_register_tile():
    k = opt.optimize(_mm_kernel(256, 256, 256), HOST2)
    g = k.gemm
    assert (g.mr, g.nr) == (6, 64) and g.kc == 256 and g.direct and not g.partial
    assert k.vector_acc is None
    src = CRenderer().render(k)
    assert "float zc[6][64];" in src and "ZYX_GEMM_ATTR void" in src
    assert src.count("zc[") >= 6 + 1 and "fmaf(za, zbk[zj]" in src


def test_short_contractions_weight_gradients_and_ragged_columns_get_the_narrow_tile_on_avx512():
    """On a 32-register target (where it measured faster: ``opt._gemm_narrow``) 8 rows of one vector go to
    k <= GEMM_SHORT_K, to columns that whole 64-wide micro-panels would overrun by more than an eighth (196 of them:
    60 past the end), and to a weight gradient of few rows (its pack runs along k: columns read out of order). Long
    contractions with columns that fill their panels (or overrun them by less: 784 in 832) keep 6 x 4 vectors, as
    does a weight gradient of many rows; a 16-register target keeps its own tile. The narrow tile computes what
    NumPy does."""
    narrow = (opt.GEMM_NARROW_ROWS, 16)
    for m, kk, n in [(288, 64, 1024), (1024, 32, 1024), (160, 5, 400), (256, 512, 196)]:
        g = opt.optimize(_mm_kernel(m, kk, n), HOST2).gemm
        assert (g.mr, g.nr) == narrow, (m, kk, n)
    for m, kk, n in [(256, opt.GEMM_SHORT_K + 1, 256), (128, 512, 784)]:
        g = opt.optimize(_mm_kernel(m, kk, n), HOST2).gemm
        assert (g.mr, g.nr) == (6, 64), (m, kk, n)
    assert (opt.optimize(_mm_kernel(96, 40, 72), AVX2).gemm.mr, opt.optimize(_mm_kernel(96, 40, 72), AVX2).gemm.nr) \
        == (6, 16)
    f32, third, kk = dtypes.float32, 32, 512  # columns read out of order (see the test at the end)
    for m, tile in [(opt.GEMM_NARROW_K_INNER_ROWS, narrow), (opt.GEMM_NARROW_K_INNER_ROWS + 1, (6, 64))]:
        i, j, r = ir.range_(0, m), ir.range_(1, 3 * third), ir.range_(2, kk)
        red = ir.reduce(Ops.ADD, ir.alu(Ops.MUL, ir.load(1, f32, i * kk + r),
                                        ir.load(2, f32, r * 3 * third + (j % 3) * third + j // 3)), (r,))
        k = Kernel("k", (Param("p0", f32, "out", m * 3 * third), Param("p1", f32, "in", m * kk),
                         Param("p2", f32, "in", kk * 3 * third)), (i, j), (Store(0, i * 3 * third + j, red),))
        g = opt.optimize(k, HOST2).gemm
        assert g.pack_k_inner and (g.mr, g.nr) == tile, m
    xs = _inputs(288, 64, 200, dtypes.float32, False, False, 1)
    out, ko = _run_kernel(_mm_kernel(288, 64, 200), xs)
    assert (ko.gemm.mr, ko.gemm.nr) == narrow
    _check(out, _reference(xs, False, False, False, dtypes.float32), dtypes.float32, 64)


def test_whole_micro_panels_pack_without_clamped_columns():
    """n = 200 makes three whole 64-column micro-panels and one of 8: only that one clamps its column index (the
    clamp kept gcc from proving the loads contiguous: it gathered, and packing cost more than the tiles' arithmetic
    when m is small). (The heuristic would take 16-column panels here, overrunning by fewer columns.)"""
    wide = {"gemm_mr": 6, "gemm_nr": 64}
    src = CRenderer().render(opt.optimize(_mm_kernel(64, 288, 200), HOST2, wide))
    whole = src.index("if (zjc + zp * 64 + 64 <= 200) {")
    edge = src.index("else {", whole)
    assert "const long long r1 = zjc + zp * 64 + zj;" in src[whole:edge] and "? zn :" not in src[whole:edge]
    assert "const long long r1 = zn < 200 ? zn : 199;" in src[edge:]
    xs = _inputs(64, 288, 200, dtypes.float32, False, False, 1)
    out, _ = _run_kernel(_mm_kernel(64, 288, 200), xs, wide)
    _check(out, _reference(xs, False, False, False, dtypes.float32), dtypes.float32, 288)


def test_small_and_non_contractions_keep_their_paths():
    assert opt.optimize(_mm_kernel(4, 8, 8), HOST2).gemm is None  # too little work
    i, j = ir.range_(0, 256), ir.range_(1, 256)
    r = ir.range_(2, 256)
    red = ir.reduce(Ops.ADD, ir.load(1, dtypes.float32, i * 65536 + r * 256 + j), (r,))  # a column sum
    k = Kernel("k", (Param("p0", dtypes.float32, "out", 65536), Param("p1", dtypes.float32, "in", 1 << 24)), (i, j),
               (Store(0, i * 256 + j, red),))
    assert find_contraction(k) is None and opt.optimize(k, HOST2).gemm is None
    with passes_off("gemm"):
        assert opt.optimize(_mm_kernel(256, 256, 256), HOST2).gemm is None


def test_search_space_lists_the_tile_with_the_heuristic_first():
    k = _mm_kernel(256, 256, 256)
    space = opt.search_space(k, HOST2)
    g = opt.optimize(k, HOST2).gemm
    assert space["gemm_mr"][0] == g.mr and space["gemm_nr"][0] == g.nr and space["gemm_kc"][0] == g.kc
    assert space["gemm_nc"][0] == g.nc
    assert "gemm_mr" not in opt.search_space(_mm_kernel(4, 8, 8), HOST2)


def test_long_float32_sums_accumulate_in_float64_partials():
    k = opt.optimize(_mm_kernel(16, 4096, 64), HOST2)
    g = k.gemm
    assert k.wide_acc and g.partial and not g.direct and g.kc == 4096
    assert "double zd[" in CRenderer().render(k)


# ---- meaning ------------------------------------------------------------------------------------------------

CASES = [  # m, k, n, dtype, a transposed, b transposed, batch, epilogue
    (64, 64, 64, dtypes.float32, False, False, 1, False),
    (67, 45, 131, dtypes.float32, False, False, 1, False),
    (13, 300, 70, dtypes.float32, True, False, 1, False),
    (50, 60, 97, dtypes.float32, False, True, 1, True),
    (31, 64, 47, dtypes.float32, True, True, 3, False),
    (40, 80, 45, dtypes.float64, False, False, 2, True),
    (37, 140, 53, dtypes.int32, False, True, 1, False),
    (9, 2100, 40, dtypes.float32, False, False, 1, False),  # wide accumulators
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}x{c[2]}-{c[3].name}-t{int(c[4])}{int(c[5])}"
                         f"-b{c[6]}{'-epi' if c[7] else ''}")
def test_tiled_matches_untiled_and_numpy(case):
    m, kk, n, d, ta, tb, batch, epi = case
    k = _mm_kernel(m, kk, n, d, ta, tb, batch, epi)
    xs = _inputs(m, kk, n, d, ta, tb, batch)
    ref = _reference(xs, ta, tb, epi, d)
    on, ko = _run_kernel(k, xs)
    off, kf = _run_kernel(k, xs, off=True)
    assert ko.gemm is not None and kf.gemm is None
    _check(on, ref, d, kk)
    _check(off, ref, d, kk)


SWEEP = [(29, 70, 83, dtypes.float32, False, True, 2, False), (45, 130, 37, dtypes.float64, True, False, 1, True),
         (20, 150, 70, dtypes.int32, False, False, 1, False)]


@pytest.mark.parametrize("case", SWEEP, ids=lambda c: c[3].name)
def test_every_search_space_value_computes_the_same(case, monkeypatch):
    """One parameter at a time over its candidates (and a few odd values), the others the heuristic's; the pack
    runs along the columns or along k (``gemm_pack_k``) for any operand."""
    monkeypatch.setattr(opt, "GEMM_MIN_WORK", 1)
    m, kk, n, d, ta, tb, batch, epi = case
    k = _mm_kernel(m, kk, n, d, ta, tb, batch, epi)
    xs = _inputs(m, kk, n, d, ta, tb, batch, seed=1)
    ref = _reference(xs, ta, tb, epi, d)
    space = {name: v for name, v in opt.search_space(k, HOST2).items() if name.startswith("gemm_")}
    assert set(space) == {"gemm_mr", "gemm_nr", "gemm_nc", "gemm_kc", "gemm_pack_k"} | \
        ({"gemm_batch"} if batch >= 2 else set())
    assert space["gemm_pack_k"] == (int(tb), int(not tb))  # the heuristic's direction first (along k for b.T)
    extra = {"gemm_mr": (1, 5), "gemm_nr": (7, 24), "gemm_nc": (1, 33), "gemm_kc": (1, 37), "gemm_batch": (),
             "gemm_pack_k": ()}
    for name, values in space.items():
        for v in (*values, *extra[name]):
            out, ko = _run_kernel(k, xs, {name: v})
            assert ko.gemm is not None
            if name == "gemm_pack_k":
                assert ko.gemm.pack_k_inner == bool(v)
            _check(out, ref, d, kk)


@pytest.mark.parametrize("per_batch", [False, True])
def test_batches_split_among_threads_or_each_batch_shared(per_batch, monkeypatch):
    """Both ways of running a batched GEMM on several threads compute the same: the threads share each batch's
    tiles (a barrier after packing and after the tiles), or take whole batch indices, each with its own packed
    panel (no barrier). Two batch loops that do not merge (the weights broadcast over the first) are one
    worksharing loop (``collapse(2)``)."""
    monkeypatch.setattr(opt, "_gemm_per_batch", lambda k, c, info: int(per_batch))
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 3, 33, 40)).astype(np.float32)
    w = rng.standard_normal((3, 40, 50)).astype(np.float32)
    with host_without_blas():
        out = zyx.Tensor(x) @ zyx.Tensor(w)
        (k,) = kernels_of(out)
        ko = opt.optimize(k, registry().get("host").primary.info())
        got = out.numpy()
    assert ko.gemm is not None and ko.gemm.per_batch is per_batch
    src = CRenderer().render(ko)
    assert ("collapse(2)" in src) is per_batch
    assert src.count("#pragma omp for") == (1 if per_batch else 2)
    np.testing.assert_allclose(got, x @ w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape,perm", [((33, 5, 40), (1, 0, 2)), ((5, 7, 9, 80), (0, 2, 1, 3))])
def test_a_right_operand_shared_by_the_batches_folds_them_into_the_rows(shape, perm):
    """A left operand whose batch loops do not merge with its rows (a permuted input) times one right operand
    for every batch index (a Linear layer): the batch loops and ``c.m`` tile as the rows of one GEMM (one pack of
    the right operand, not one per batch index; row tiles cross batch boundaries), the flat row split back into
    the loops innermost fastest. Bit for bit what the per-batch GEMM computes, and NumPy's product. (5 and 45
    batch indices on 2 threads: the heuristic folds the first (odd and few) and the second (k > ``GEMM_SHORT_K``).)"""
    rng = np.random.default_rng(12)
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal((shape[-1], 72)).astype(np.float32)
    info = HOST2
    got = {}
    for fold in (True, False):
        with host_without_blas(), contextlib.nullcontext() if fold else passes_off("fold_batch"):
            out = zyx.Tensor(x).permute(*perm) @ zyx.Tensor(w)
            (k,) = kernels_of(out)
            ko = opt.optimize(k, info)
            got[fold] = out.numpy()
        g = ko.gemm
        assert g is not None
        batch = ko.loops[:ko.loops.index(g.c.m)]
        assert len(batch) == len(shape) - 2
        if fold:
            assert g.rows == (*batch, g.c.m) and not g.per_batch
            assert g.m == math.prod(x.shape[:-1]) and g.m % g.mr != 0  # a row tile crosses a batch boundary
            src = CRenderer().render(ko)
            body = src[src.index(f"void {k.name}("):]
            assert body.count("aligned_alloc") == 1 and body.index("aligned_alloc") < body.index("omp parallel")
            assert "zr /= " in body and "zrw[0][zi]" in body
        else:
            assert g.rows == () and g.m == g.c.m.arg[1]
    np.testing.assert_array_equal(got[True], got[False])
    np.testing.assert_allclose(got[True], x.transpose(perm) @ w, rtol=1e-4, atol=1e-4)
    # every way of running the batch indices (``gemm_batch``, the fold first) computes the same, bit for bit
    assert opt.search_space(k, info)["gemm_batch"] == (2, 0, 1)
    by_size = {x.size: x, w.size: w}
    for mode in (2, 0, 1):
        out, ko = _run_kernel(k, [by_size[p.size] for p in k.params[1:]], {"gemm_batch": mode}, info=info)
        assert bool(ko.gemm.rows) is (mode == 2) and ko.gemm.per_batch is (mode == 1)
        np.testing.assert_array_equal(out, got[True].ravel())


def test_a_shared_right_operand_folds_the_batches_unless_short_and_per_batch(monkeypatch):
    """``gemm_batch`` 2 (the fold) for a right operand every batch index shares, except a short contraction
    (k <= ``GEMM_SHORT_K``) whose batches the threads would take whole; a right operand per batch index never
    folds."""
    monkeypatch.setattr(opt, "GEMM_MIN_WORK", 1)
    for batch, kk, shared, want in [(32, 384, True, 2), (5, 40, True, 2), (16, 64, True, 1), (16, 65, True, 2),
                                    (3, 64, True, 2), (16, 384, False, 1), (3, 384, False, 0)]:
        # a stored transposed: its batch loop does not merge with the rows
        ko = opt.optimize(_mm_kernel(56, kk, 96, ta=True, batch=batch, shared_b=shared), HOST2)
        mode = 2 if ko.gemm.rows else int(ko.gemm.per_batch)
        assert mode == want, (batch, kk, shared)


def test_per_batch_heuristic_wants_even_or_many_batches(monkeypatch):
    """Threads take whole batch indices when those divide evenly among them or are at least 8 per thread."""
    monkeypatch.setattr(opt, "GEMM_MIN_WORK", 1)
    for batch, units, want in [(2, 2, True), (3, 2, False), (16, 2, True), (17, 2, True), (12, 16, False),
                               (17, 16, False), (64, 16, True), (1, 2, False), (4, 1, False)]:
        k = _mm_kernel(40, 48, 64, batch=batch)
        ko = opt.optimize(k, DeviceInfo("host", "host", compute_units=units, vector_bytes=32, vector_registers=16))
        assert ko.gemm is not None and ko.gemm.per_batch is want, (batch, units)


# ---- end to end: the graph's matmuls on the generated path ----------------------------------------------------


@pytest.mark.parametrize("kind", ["plain", "at", "bt", "batched", "broadcast", "f64", "bias_relu", "prologue"])
def test_tensor_matmuls_agree_with_gemm_off(kind):
    """``broadcast``: a batch that only ``a`` has (``b`` broadcast over it, axes the GEMM matcher leaves in place,
    permuted): the contraction's m is the innermost of ``a``'s own loops, the rest a batch (it used to find none)."""
    rng = np.random.default_rng(3)
    t = np.float64 if kind == "f64" else np.float32
    a = rng.standard_normal((3, 70, 90) if kind in ("batched", "broadcast") else (70, 90)).astype(t)
    b = rng.standard_normal((3, 90, 130) if kind == "batched" else (90, 130)).astype(t)
    bias = rng.standard_normal(130).astype(t)

    def fn():
        A, B = zyx.Tensor(a), zyx.Tensor(b)
        if kind == "at":
            return (zyx.Tensor(np.ascontiguousarray(a.T)).permute(1, 0) @ B).numpy()
        if kind == "bt":
            return (A @ zyx.Tensor(np.ascontiguousarray(b.T)).permute(1, 0)).numpy()
        if kind == "bias_relu":
            return (A @ B + zyx.Tensor(bias)).relu().numpy()
        if kind == "prologue":
            return ((A * 0.5 + 1.0) @ B.tanh()).numpy()
        if kind == "broadcast":
            k = kernels_of(zyx.Tensor(np.ascontiguousarray(a.transpose(1, 0, 2))).permute(1, 0, 2) @ B)
            assert [x for x in k if x.reduces()] and all(find_contraction(x) for x in k if x.reduces())
            return (zyx.Tensor(np.ascontiguousarray(a.transpose(1, 0, 2))).permute(1, 0, 2) @ B).numpy()
        return (A @ B).numpy()

    ref = a.astype(np.float64) @ b.astype(np.float64)
    if kind == "bias_relu":
        ref = np.maximum(ref + bias, 0)
    if kind == "prologue":
        ref = (a.astype(np.float64) * 0.5 + 1.0) @ np.tanh(b.astype(np.float64))
    with host_without_blas():
        on = fn()
        with passes_off("gemm"):
            off = fn()
    tol = 1e-4 if t is np.float32 else 1e-10
    np.testing.assert_allclose(on, ref, rtol=tol, atol=tol)
    np.testing.assert_allclose(off, ref, rtol=tol, atol=tol)


@settings(max_examples=16, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(m=st.integers(1, 40), kk=st.integers(1, 90), n=st.integers(1, 80), batch=st.integers(1, 3),
       ta=st.booleans(), tb=st.booleans(), epi=st.booleans(), d=st.sampled_from(list(NP)),
       mr=st.sampled_from(opt.GEMM_MR), vecs=st.sampled_from(opt.GEMM_NR), kc=st.integers(1, 64),
       shared=st.booleans(), mode=st.sampled_from((0, 1, 2)))
def test_random_contractions_match_numpy(m, kk, n, batch, ta, tb, epi, d, mr, vecs, kc, shared, mode, monkeypatch):
    """Random shapes (tiny ones too: the work threshold is off), layouts, tiles and ways of running the batch
    indices (``gemm_batch``; ``shared``: one right operand for every batch index, which the fold needs)."""
    monkeypatch.setattr(opt, "GEMM_MIN_WORK", 1)
    k = _mm_kernel(m, kk, n, d, ta, tb, batch, epi, shared)
    xs = _inputs(m, kk, n, d, ta, tb, batch, seed=m * n + kk, shared_b=shared)
    params = {"gemm_mr": mr, "gemm_nr": vecs * 64 // d.itemsize, "gemm_kc": kc, "gemm_batch": mode}
    out, ko = _run_kernel(k, xs, params)
    assert (ko.gemm is not None) == (opt.gemm_contraction(opt.merge_loops(opt.drop_unit_loops(k))) is not None)
    _check(out, _reference(xs, ta, tb, epi, d), d, kk)


@settings(max_examples=10, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(m=st.integers(2, 30), kk=st.integers(4, 90), n=st.integers(8, 80), batch=st.integers(2, 5),
       tb=st.booleans(), epi=st.booleans(), d=st.sampled_from(list(NP)), mr=st.sampled_from(opt.GEMM_MR),
       vecs=st.sampled_from(opt.GEMM_NR), kc=st.integers(1, 64))
def test_random_folded_contractions_match_numpy(m, kk, n, batch, tb, epi, d, mr, vecs, kc, monkeypatch):
    """The fold (``gemm_batch`` 2) on random shapes and tiles (those ``gemm_contraction`` takes): row tiles
    crossing batch boundaries, rows fewer than a tile, k in blocks (``kc``)."""
    monkeypatch.setattr(opt, "GEMM_MIN_WORK", 1)
    k = _mm_kernel(m, kk, n, d, True, tb, batch, epi, shared_b=True)  # a transposed: a batch apart from the rows
    xs = _inputs(m, kk, n, d, True, tb, batch, seed=m * n + kk, shared_b=True)
    params = {"gemm_mr": mr, "gemm_nr": vecs * 64 // d.itemsize, "gemm_kc": kc, "gemm_batch": 2}
    out, ko = _run_kernel(k, xs, params)
    assert ko.gemm is not None and ko.gemm.rows
    _check(out, _reference(xs, True, tb, epi, d), d, kk)


def test_fuzz_reaches_the_pass(monkeypatch):
    monkeypatch.setattr(opt, "GEMM_MIN_WORK", 1)
    assert opt.optimize(_mm_kernel(3, 5, 8), HOST2).gemm is not None


# ---- several column loops: a convolution's positions (implicit im2col) ------------------------------------------


def _conv_kernel(batch: int, o: int, c: int, h: int, w: int, kh: int, kw: int, pad: int) -> Kernel:
    """out[b, oc, y, x] = sum over (ci, i, j) merged into one range of weight[oc, ci, i, j] * x[b, ci, y + i - pad,
    x + j - pad] (0 outside): the fused im2col GEMM a convolution's graph lowers to. Its output positions (y, x)
    are two loops (the padding's bounds keep them from merging)."""
    oh, ow = h + 2 * pad - kh + 1, w + 2 * pad - kw + 1
    kk = c * kh * kw
    b, oc, y, x = ir.range_(0, batch), ir.range_(1, o), ir.range_(2, oh), ir.range_(3, ow)
    r = ir.range_(4, kk)
    ci, i, j = r // (kh * kw), (r // kw) % kh, r % kw
    yy, xx = y + i - pad, x + j - pad
    inside = ir.alu(Ops.AND, ir.alu(Ops.AND, ir.alu(Ops.CMPLE, ir.const(0, ir.index_dtype), yy),
                                    ir.alu(Ops.CMPLT, yy, ir.const(h, ir.index_dtype))),
                    ir.alu(Ops.AND, ir.alu(Ops.CMPLE, ir.const(0, ir.index_dtype), xx),
                           ir.alu(Ops.CMPLT, xx, ir.const(w, ir.index_dtype))))
    f32 = dtypes.float32
    pixel = ir.alu(Ops.WHERE, inside, ir.load(2, f32, b * (c * h * w) + ci * (h * w) + yy * w + xx),
                   ir.const(0.0, f32))
    red = ir.reduce(Ops.ADD, ir.alu(Ops.MUL, ir.load(1, f32, oc * kk + r), pixel), (r,))
    params = (Param("p0", f32, "out", batch * o * oh * ow), Param("p1", f32, "in", o * kk),
              Param("p2", f32, "in", batch * c * h * w))
    return Kernel("conv", params, (b, oc, y, x), (Store(0, ((b * o + oc) * oh + y) * ow + x, red),))


def _conv_reference(xs: list[np.ndarray], o: int, kh: int, kw: int, pad: int) -> np.ndarray:
    x, wt = xs[1].astype(np.float64), xs[0].astype(np.float64).reshape(o, -1, kh, kw)
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = xp.shape[2] - kh + 1, xp.shape[3] - kw + 1
    cols = np.stack([xp[:, :, i:i + oh, j:j + ow] for i in range(kh) for j in range(kw)], 2)  # b, c, k, oh, ow
    return np.einsum("ock,bckyx->boyx", wt.reshape(o, -1, kh * kw), cols)


def _conv_inputs(batch, o, c, h, w, kh, kw, seed=0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((o, c * kh * kw)).astype(np.float32),
            rng.standard_normal((batch, c, h, w)).astype(np.float32)]


def test_a_convolutions_positions_tile_as_the_columns_of_one_gemm():
    """The output loops after m that only the input depends on, (y, x), are the GEMM's columns, flattened; the
    heuristic's micro-panels divide the row (x: 32), so each packs and stores as one affine run."""
    k = _conv_kernel(2, 64, 32, 32, 32, 3, 3, 1)
    ko = opt.optimize(k, HOST2)
    g = ko.gemm
    assert g is not None and [r.arg[0] for r in g.cols] == [2, 3] and g.n == 1024 and g.c.m.arg[0] == 1
    assert 32 % g.nr == 0
    src = CRenderer().render(ko)
    assert "const long long r2 = (zq / 32) % 32;" in src and "const long long r3 = zo + zt;" in src
    xs = _conv_inputs(2, 64, 32, 32, 32, 3, 3)
    out, _ = _run_kernel(k, xs)
    _check(out, _conv_reference(xs, 64, 3, 3, 1), dtypes.float32, 288)


@settings(max_examples=14, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(batch=st.integers(1, 2), o=st.integers(2, 20), c=st.integers(1, 4), h=st.integers(1, 9), w=st.integers(1, 40),
       kh=st.integers(1, 3), kw=st.integers(1, 3), pad=st.integers(0, 2), mr=st.sampled_from(opt.GEMM_MR),
       nr=st.sampled_from((16, 32, 48, 64, 7)), nc=st.sampled_from((1, 33, 64, 512)), kc=st.integers(1, 40))
def test_random_convolutions_tile_and_match_numpy(batch, o, c, h, w, kh, kw, pad, mr, nr, nc, kc, monkeypatch):
    """Rows of the innermost column loop shorter, longer and not multiples of the micro-panels (runs cross rows;
    ragged last panels), any tile."""
    monkeypatch.setattr(opt, "GEMM_MIN_WORK", 1)
    if h + 2 * pad < kh or w + 2 * pad < kw:
        return
    k = _conv_kernel(batch, o, c, h, w, kh, kw, pad)
    xs = _conv_inputs(batch, o, c, h, w, kh, kw, seed=o * w + c)
    params = {"gemm_mr": mr, "gemm_nr": nr, "gemm_nc": nc, "gemm_kc": kc}
    out, ko = _run_kernel(k, xs, params)
    tiled = opt.gemm_contraction(opt.merge_loops(opt.drop_unit_loops(k))) is not None
    assert (ko.gemm is not None) == tiled
    _check(out, _conv_reference(xs, o, kh, kw, pad), dtypes.float32, c * kh * kw)


def test_a_padded_convolutions_pack_copies_its_window_and_fills_the_borders():
    """The padding's guards are comparisons affine in the innermost column (x + j - pad in [0, w)): the pack
    computes per run where they all hold (``opt.gate_window``), copies the input there with no select, and stores
    the guards' false value (0) before and after. The output is bitwise the one packed with selects."""
    k = _conv_kernel(2, 64, 8, 12, 40, 3, 3, 1)
    ko = opt.optimize(k, HOST2)
    w = ko.gemm.window
    assert w is not None and sorted(b[3] for b in w.bounds) == [-1, 0, 0, 1]
    assert Ops.WHERE not in {e.op for e in ir.toposort([w.inside])}
    assert w.outside.op is Ops.CONST and w.outside.arg == 0
    src = CRenderer().render(ko)
    assert "zlo" in src and "for (int zt = zlo; zt < zhi; zt++)" in src
    xs = _conv_inputs(2, 64, 8, 12, 40, 3, 3)
    out, _ = _run_kernel(k, xs)
    with passes_off("pack_window"):
        assert opt.optimize(k, HOST2).gemm.window is None
        off, _ = _run_kernel(k, xs)
    np.testing.assert_array_equal(out, off)
    _check(out, _conv_reference(xs, 64, 3, 3, 1), dtypes.float32, 72)


def test_a_window_needs_affine_guards():
    """A gated load whose index is no affine function of the loop has no window (its loads would not run along
    the loop); a select on a value (relu) is no guard and stays in both parts; guards with different conditions
    keep the guarded value outside the window."""
    f32, it = dtypes.float32, ir.index_dtype
    r, q = ir.range_(0, 16), ir.range_(1, 4)
    lt = ir.alu(Ops.CMPLT, r, ir.const(10, it))
    assert opt.gate_window(ir.load(1, f32, (r * r), lt), r) is None
    x = ir.load(1, f32, r + q * 16)
    relu = ir.alu(Ops.WHERE, ir.alu(Ops.CMPLT, ir.const(0.0, f32), x), x, ir.const(0.0, f32))
    assert opt.gate_window(relu, r) is None
    guarded = ir.load(2, f32, r + 3, lt)
    w = opt.gate_window(ir.alu(Ops.ADD, relu, guarded), r)
    assert w is not None and w.bounds == ((r, ir.const(10, it), True, 1),)
    assert Ops.WHERE in {e.op for e in ir.toposort([w.inside])} and w.outside.op is not Ops.CONST
    ge = ir.alu(Ops.CMPLE, ir.const(2, it), r + q)
    two = opt.gate_window(ir.alu(Ops.ADD, guarded, ir.load(2, f32, r, ge)), r)
    assert len(two.bounds) == 2 and two.outside is ir.alu(Ops.ADD, guarded, ir.load(2, f32, r, ge))


@settings(max_examples=10, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(dims=st.sampled_from((1, 2)), size=st.integers(3, 40), kernel=st.integers(2, 5), stride=st.integers(1, 3),
       padding=st.integers(1, 3), dilation=st.integers(1, 2), flip=st.sampled_from(("no", "input", "padded")),
       seed=st.integers(0, 99))
def test_windowed_packs_of_convolutions_match_torch(dims, size, kernel, stride, padding, dilation, flip, seed,
                                                    monkeypatch):
    """conv1d (one column loop: whole micro-panels) and conv2d (runs along a row), any stride (coefficients 2 and
    3 in the guards), dilation and padding; the input reversed before the padding, or after an uneven one (the
    guards' coefficients negative): the windowed pack computes what the pack with selects computes, bitwise, and
    torch's convolution."""
    torch = pytest.importorskip("torch")
    from zyx.nn import functional as F

    assume(((size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1) ** dims >= 8)  # 8 columns to tile
    monkeypatch.setattr(opt, "GEMM_MIN_WORK", 1)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 3) + (size,) * dims).astype(np.float32)
    w = rng.standard_normal((10, 3) + (kernel,) * dims).astype(np.float32)
    conv, tconv = (F.conv1d, torch.nn.functional.conv1d) if dims == 1 else (F.conv2d, torch.nn.functional.conv2d)
    kw = dict(stride=stride, padding=0 if flip == "padded" else padding, dilation=dilation)
    pads = ((0, 0), (0, 0)) + ((padding, padding + 1),) * dims
    xr = {"no": x, "input": x[..., ::-1], "padded": np.pad(x, pads)[..., ::-1]}[flip]
    ref = tconv(torch.from_numpy(xr.copy()), torch.from_numpy(w), **kw).numpy()
    outs = []
    with host_without_blas():
        for off in ((), ("pack_window",)):
            with passes_off(*off):
                X = zyx.Tensor(x)
                X = {"no": X, "input": X.flip(-1), "padded": X.pad(pads).flip(-1)}[flip]
                y = conv(X, zyx.Tensor(w), **kw)
                plans = [p for k in kernels_of(y) if (p := opt.optimize(k, _host().info()).gemm) is not None]
                assert plans and all((p.window is None) == bool(off) for p in plans), plans
                if flip == "padded" and not off:
                    assert any(b[3] < 0 for p in plans for b in p.window.bounds if b[2]), plans
                outs.append(y.numpy())
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_allclose(outs[0], ref, rtol=1e-4, atol=1e-4)


def test_columns_are_only_loops_the_left_operand_does_not_read():
    """A batch both operands read, placed innermost (after n), is no column: the contraction keeps its path."""
    m, n, kk, bt = ir.range_(0, 32), ir.range_(1, 48), ir.range_(2, 64), ir.range_(3, 4)
    f32 = dtypes.float32
    red = ir.reduce(Ops.ADD, ir.alu(Ops.MUL, ir.load(1, f32, (bt * 32 + m) * 64 + kk),
                                    ir.load(2, f32, (bt * 64 + kk) * 48 + n)), (kk,))
    k = Kernel("k", (Param("p0", f32, "out", 4 * 32 * 48), Param("p1", f32, "in", 4 * 32 * 64),
                     Param("p2", f32, "in", 4 * 64 * 48)), (m, n, bt), (Store(0, (bt * 32 + m) * 48 + n, red),))
    c = find_contraction(k)
    assert c is not None and (c.m, c.n) == (m, n)
    assert opt.gemm_columns(k, c) is None and opt.gemm_contraction(k) is None


def test_a_convolution_without_blas_is_one_tiled_kernel_matching_torch():
    """conv2d on the generated path: the windows of the padded input feed the GEMM's packing (no im2col buffer)."""
    torch = pytest.importorskip("torch")
    from zyx.nn import functional as F

    rng = np.random.default_rng(4)
    x = rng.standard_normal((6, 5, 13, 11)).astype(np.float32)
    w = rng.standard_normal((24, 5, 3, 3)).astype(np.float32)
    ref = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), padding=1, stride=(1, 2)).numpy()
    with host_without_blas():
        y = F.conv2d(zyx.Tensor(x), zyx.Tensor(w), padding=1, stride=(1, 2))
        (kernel,) = kernels_of(y)
        ko = opt.optimize(kernel, _host().info())
        assert ko.gemm is not None and len(ko.gemm.cols) == 2
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-4)


def test_matmuls_sharing_an_operand_stay_separate_tiled_kernels():
    """x @ wq, x @ wk, x @ wv realized together: one kernel each, tiled. The fuser used to put the three in one
    kernel (they read x), whose three reduces no contraction pass takes: 212 ms against 2 ms here."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((64, 96)).astype(np.float32)
    ws = [rng.standard_normal((96, 80)).astype(np.float32) for _ in range(3)]
    with host_without_blas():
        X = zyx.Tensor(x)
        outs = [X @ zyx.Tensor(w) for w in ws]
        kernels = kernels_of(*outs)
        assert len(kernels) == 3 and all(opt.optimize(k, _host().info()).gemm is not None for k in kernels)
        zyx.realize(*outs)
        for o, w in zip(outs, ws):
            np.testing.assert_allclose(o.numpy(), x.astype(np.float64) @ w, rtol=1e-4, atol=1e-4)


def test_contractions_added_together_are_each_a_tiled_kernel():
    """A recurrent cell's x @ wx + h @ wh (and a relu on one side): each product a kernel of its own, tiled, then
    the sum. Inlined into the sum's kernel, side by side, they were one loop nest: 139 ms against 1.4 ms at
    256x512x512."""
    rng = np.random.default_rng(9)
    x, h = (rng.standard_normal((64, 96)).astype(np.float32) for _ in range(2))
    wx, wh = (rng.standard_normal((96, 80)).astype(np.float32) for _ in range(2))
    with host_without_blas():
        y = zyx.Tensor(x) @ zyx.Tensor(wx) + (zyx.Tensor(h) @ zyx.Tensor(wh)).relu()
        kernels = kernels_of(y)
        tiled = [k for k in kernels if opt.optimize(k, _host().info()).gemm is not None]
        assert len(tiled) == 2 and all(len(k.reduces()) <= 1 for k in kernels), [k.name for k in kernels]
        ref = x.astype(np.float64) @ wx + np.maximum(h.astype(np.float64) @ wh, 0)
        np.testing.assert_allclose(y.numpy(), ref, rtol=1e-4, atol=1e-4)


def test_contractions_inside_another_reduce_are_stored_and_tiled():
    """A convolution's loss ``sum(conv2d(x, w) * g)`` and a matmul's mean: the contraction, read inside the outer
    sum's loops, is a tiled kernel of its own (nested, each output was an untiled dot product: 1 s instead of 3
    ms for a 32x32x32x32 3x3 convolution to 64 channels once autotuning chose the generated GEMM). A row's dot
    product inside a mean reuses neither factor and stays in one kernel."""
    rng = np.random.default_rng(10)
    x = rng.standard_normal((2, 8, 16, 16)).astype(np.float32)
    w = rng.standard_normal((16, 8, 3, 3)).astype(np.float32)
    g = rng.standard_normal((2, 16, 16, 16)).astype(np.float32)
    a, b = rng.standard_normal((64, 96)).astype(np.float32), rng.standard_normal((96, 80)).astype(np.float32)
    with host_without_blas():
        loss = (zyx.nn.functional.conv2d(zyx.Tensor(x), zyx.Tensor(w), padding=1) * zyx.Tensor(g)).sum()
        mean = (zyx.Tensor(a) @ zyx.Tensor(b)).mean()
        for out in (loss, mean):
            kernels = kernels_of(out)
            assert len(kernels) == 2 and all(len(k.reduces()) == 1 for k in kernels), [k.name for k in kernels]
            assert sum(opt.optimize(k, _host().info()).gemm is not None for k in kernels) == 1
        ref = np.zeros((2, 16, 16, 16))
        xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
        for i in range(3):
            for j in range(3):
                ref += np.einsum("nchw,oc->nohw", xp[:, :, i:i + 16, j:j + 16], w[:, :, i, j].astype(np.float64))
        np.testing.assert_allclose(loss.numpy(), (ref * g).sum(), rtol=1e-4)
        np.testing.assert_allclose(mean.numpy(), (a.astype(np.float64) @ b).mean(), rtol=1e-4, atol=1e-5)
        c, d = (zyx.Tensor(rng.standard_normal((16, 24)).astype(np.float32)) for _ in range(2))
        assert len(kernels_of((c * d).sum(-1).mean())) == 1


def test_costly_factors_of_a_contraction_are_stored():
    """The left factor gelu(h + b) of a generated GEMM (a transformer's FFN down-projection) is computed once into a
    buffer; inlined, the GEMM evaluated erf once per element and column panel (MiniLM's, with autotuning choosing
    the generated GEMM: 101 ms instead of 4.2). A cheap factor (a scale) stays inlined: one kernel."""
    rng = np.random.default_rng(12)
    h = rng.standard_normal((64, 96)).astype(np.float32)
    b = rng.standard_normal(96).astype(np.float32)
    w = rng.standard_normal((96, 80)).astype(np.float32)
    with host_without_blas():
        H, B, W = zyx.Tensor(h), zyx.Tensor(b), zyx.Tensor(w)
        y = (H + B).gelu() @ W
        kernels = kernels_of(y)
        assert len(kernels) == 2 and sum(opt.optimize(k, _host().info()).gemm is not None for k in kernels) == 1
        assert not any(Ops.ERF in {e.op for e in ir.toposort([s.value for s in k.stores])} for k in kernels
                       if opt.optimize(k, _host().info()).gemm is not None)
        torch = pytest.importorskip("torch")
        ref = torch.nn.functional.gelu(torch.from_numpy(h).double() + torch.from_numpy(b).double()) @ \
            torch.from_numpy(w).double()
        np.testing.assert_allclose(y.numpy(), ref.numpy(), rtol=1e-4, atol=1e-4)
        assert len(kernels_of((H * 0.5) @ W)) == 1


def _permuted_columns_kernel(m: int, kk: int, third: int, split: bool, d) -> Kernel:
    """``a @ b[:, perm]`` with ``perm[j] = (j % 3) * third + j // 3`` (no affine column index: the pack runs along
    k), the columns in one loop or two (``split``)."""
    n = 3 * third
    i, r = ir.range_(0, m), ir.range_(2, kk)
    cols = (ir.range_(1, 3), ir.range_(3, third)) if split else (ir.range_(1, n),)
    j = cols[0] * third + cols[1] if split else cols[0]
    stored = (j % 3) * third + j // 3
    red = ir.reduce(Ops.ADD, ir.alu(Ops.MUL, ir.load(1, d, i * kk + r), ir.load(2, d, r * n + stored)), (r,))
    return Kernel("k", (Param("p0", d, "out", m * n), Param("p1", d, "in", m * kk), Param("p2", d, "in", kk * n)),
                  (i, *cols), (Store(0, i * n + j, red),))


@pytest.mark.parametrize("ta,tb,batch", [(False, True, 1), (True, True, 1), (False, True, 3), (False, False, 1),
                                         (True, False, 2)])
def test_a_right_operand_contiguous_along_k_packs_along_k(ta, tb, batch, monkeypatch):
    """``x @ W.T``: the right operand is contiguous along k and strided along the columns, so its pack runs along k
    (and transposes through registers) instead of gathering a column from every line; stored along the columns,
    it keeps packing along them. The narrow tile stays a weight gradient's (gathered columns): 32 rows of
    ``x @ W.T`` keep the heuristic's wide tile. The product is NumPy's."""
    monkeypatch.setattr(opt, "GEMM_MIN_WORK", 1)
    m, kk, n = 32, 70, 128  # (k past GEMM_SHORT_K, the columns whole micro-panels: no narrow tile for those)
    k = _mm_kernel(m, kk, n, ta=ta, tb=tb, batch=batch)
    xs = _inputs(m, kk, n, dtypes.float32, ta, tb, batch)
    out, ko = _run_kernel(k, xs)
    assert ko.gemm is not None and ko.gemm.pack_k_inner == tb
    assert (ko.gemm.mr, ko.gemm.nr) != (opt.GEMM_NARROW_ROWS, 16)
    a = xs[0].transpose(0, 2, 1) if ta else xs[0]
    b = xs[1].transpose(0, 2, 1) if tb else xs[1]
    _check(out, a.astype(np.float64) @ b.astype(np.float64), dtypes.float32, kk)


_F32, _F64 = dtypes.float32, dtypes.float64


@pytest.mark.parametrize("nr,dtype,kk,third,split,chunk", [
    (16, _F32, 50, 7, False, 64), (16, _F32, 37, 5, True, 7), (8, _F32, 23, 11, True, 64), (4, _F64, 19, 6, False, 3),
    (8, _F64, 64, 9, True, 16), (32, _F32, 40, 12, False, 64)])
def test_a_pack_along_k_transposes_blocks_through_registers(nr, dtype, kk, third, split, chunk, monkeypatch):
    """A pack along k stages each chunk column by column, contiguous along k, and stores it into the micro-panel in
    nr x nr blocks transposed through vector shuffles (``render.transpose_staged``; the rest of a chunk element
    by element): for 4, 8 and 16-wide panels of float32 or float64, chunks and columns that the blocks do not
    divide, one column loop or two. Other widths pack straight. The product is NumPy's."""
    monkeypatch.setattr(opt, "GEMM_MIN_WORK", 1)
    monkeypatch.setattr(opt, "GEMM_PACK_K_CHUNK", chunk)
    m = 9
    k = _permuted_columns_kernel(m, kk, third, split, dtype)
    rng = np.random.default_rng(kk * third)
    a, b = (rng.standard_normal(s).astype(NP[dtype]) for s in ((m, kk), (kk, 3 * third)))
    out, ko = _run_kernel(k, [a, b], {"gemm_mr": 4, "gemm_nr": nr, "gemm_nc": 512, "gemm_kc": kk})
    assert ko.gemm is not None and ko.gemm.pack_k_inner and ko.gemm.nr == nr
    src = CRenderer().render(ko)
    assert ("__builtin_shuffle" in src and "ztmp[" in src) == (nr in (4, 8, 16))
    perm = [(c % 3) * third + c // 3 for c in range(3 * third)]
    _check(out, a.astype(np.float64) @ b[:, perm].astype(np.float64), dtype, kk)


@pytest.mark.parametrize("stride,kernel,padding", [(1, 3, 1), (2, 7, 3), (1, (2, 3), 0)])
def test_a_weight_gradient_packs_along_k_and_matches_torch(stride, kernel, padding, monkeypatch):
    """A convolution's weight gradient is a GEMM whose columns are (input channel, tap) and whose k runs over the
    output positions: the tap index is no affine function of its column loop (tap // kw, tap % kw), so the pack
    runs k innermost (``GemmTile.pack_k_inner``); the forward GEMM's columns are output positions, read along a
    row, and keep the columns innermost. The gradients match torch's."""
    torch = pytest.importorskip("torch")
    from zyx.nn import functional as F

    monkeypatch.setattr(opt, "GEMM_MIN_WORK", 1)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4, 12, 14)).astype(np.float32)
    w = rng.standard_normal((6, 4) + ((kernel,) * 2 if isinstance(kernel, int) else kernel)).astype(np.float32)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    ty = torch.nn.functional.conv2d(tx, tw, stride=stride, padding=padding)
    g = rng.standard_normal(tuple(ty.shape)).astype(np.float32)
    (ty * torch.from_numpy(g)).sum().backward()
    with host_without_blas():
        X, W = zyx.Tensor(x, requires_grad=True), zyx.Tensor(w, requires_grad=True)
        y = F.conv2d(X, W, stride=stride, padding=padding)
        (y * zyx.Tensor(g)).sum().backward()

        def plans(*ts):
            return [p for k in kernels_of(*ts) if (p := opt.optimize(k, _host().info()).gemm) is not None]

        forward, weight_grad = plans(y), plans(W.grad)
        np.testing.assert_allclose(W.grad.numpy(), tw.grad.numpy(), rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(X.grad.numpy(), tx.grad.numpy(), rtol=1e-4, atol=1e-4)
    assert forward and not any(p.pack_k_inner for p in forward), forward
    assert any(p.pack_k_inner for p in weight_grad), weight_grad
    chunk = opt.GEMM_PACK_K_CHUNK
    assert all(p.k_chunk == (chunk if p.pack_k_inner and p.kc > chunk else 0) for p in forward + weight_grad)


@settings(max_examples=8, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(m=st.integers(2, 20), kk=st.integers(4, 50), third=st.integers(4, 30), split=st.booleans(),
       mr=st.sampled_from(opt.GEMM_MR), nr=st.sampled_from((16, 32, 7)), nc=st.sampled_from((1, 33, 512)),
       kc=st.integers(1, 40), chunk=st.sampled_from((1, 3, 7, 64)))
def test_columns_read_out_of_order_pack_along_k_and_match_numpy(m, kk, third, split, mr, nr, nc, kc, chunk,
                                                                 monkeypatch):
    """The right operand's columns permuted (column j reads stored column (j % 3) * third + j // 3: no affine
    index), in one column loop or two (``split``: (j // third, j % third)), any tile and chunk of k: the pack runs k
    innermost and the product is NumPy's."""
    monkeypatch.setattr(opt, "GEMM_MIN_WORK", 1)
    monkeypatch.setattr(opt, "GEMM_PACK_K_CHUNK", chunk)
    n, f32 = 3 * third, dtypes.float32
    i, r = ir.range_(0, m), ir.range_(2, kk)
    cols = (ir.range_(1, 3), ir.range_(3, third)) if split else (ir.range_(1, n),)
    j = cols[0] * third + cols[1] if split else cols[0]
    stored = (j % 3) * third + j // 3
    red = ir.reduce(Ops.ADD, ir.alu(Ops.MUL, ir.load(1, f32, i * kk + r), ir.load(2, f32, r * n + stored)), (r,))
    k = Kernel("k", (Param("p0", f32, "out", m * n), Param("p1", f32, "in", m * kk), Param("p2", f32, "in", kk * n)),
               (i, *cols), (Store(0, i * n + j, red),))
    rng = np.random.default_rng(m * kk + n)
    a, b = rng.standard_normal((m, kk)).astype(np.float32), rng.standard_normal((kk, n)).astype(np.float32)
    out, ko = _run_kernel(k, [a, b], {"gemm_mr": mr, "gemm_nr": nr, "gemm_nc": nc, "gemm_kc": kk if split else kc})
    assert ko.gemm is not None and ko.gemm.pack_k_inner
    assert ko.gemm.k_chunk == (chunk if ko.gemm.kc > chunk else 0)
    perm = [(c % 3) * third + c // 3 for c in range(n)]
    _check(out, a.astype(np.float64) @ b[:, perm].astype(np.float64), f32, kk)

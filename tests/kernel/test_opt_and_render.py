"""Kernel IR passes and the C renderer, one at a time."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zyx
from zyx import dtypes
from zyx.backends.base import DeviceInfo
from zyx.kernel import ir, opt
from zyx.kernel.ir import Kernel, Param, Store
from zyx.kernel.linearize import Reduce, linearize, walk
from zyx.kernel.render import CRenderer
from zyx.ops import Ops


def _copy_kernel(shape, perm=None) -> Kernel:
    rs = tuple(ir.range_(i, s) for i, s in enumerate(shape))
    flat = ir.const(0, ir.index_dtype)
    stride = 1
    order = list(range(len(shape)))[::-1] if perm is None else perm
    for d in order:
        flat = flat + rs[d] * stride
        stride *= shape[d]
    out = ir.const(0, ir.index_dtype)
    stride = 1
    for d in reversed(range(len(shape))):
        out = out + rs[d] * stride
        stride *= shape[d]
    v = ir.load(1, dtypes.float32, flat)
    n = int(np.prod(shape))
    return Kernel("k", (Param("p0", dtypes.float32, "out", n), Param("p1", dtypes.float32, "in", n)), rs,
                  (Store(0, out, v),))


def test_merge_contiguous_loops():
    k = opt.merge_loops(_copy_kernel((4, 5, 6)))
    assert [r.arg[1] for r in k.loops] == [120]


def test_no_merge_across_a_transpose():
    # the load walks axis 0 fastest, then axes 2 and 1: axes 1 and 2 merge, axis 0 stays apart
    k = opt.merge_loops(_copy_kernel((4, 5, 6), perm=[0, 2, 1]))
    assert [r.arg[1] for r in k.loops] == [4, 30]
    full_transpose = opt.merge_loops(_copy_kernel((4, 5, 6), perm=[1, 2, 0]))
    assert [r.arg[1] for r in full_transpose.loops] == [4, 5, 6]


def test_drop_unit_loops():
    k = opt.drop_unit_loops(_copy_kernel((1, 5, 1)))
    assert [r.arg[1] for r in k.loops] == [5]


def test_parallel_and_vector_marks():
    info = DeviceInfo("host", "host", compute_units=2)
    big = opt.optimize(_copy_kernel((512, 512)), info)
    assert big.parallel == 1 and big.vector
    small = opt.optimize(_copy_kernel((4, 4)), info)
    assert small.parallel == 0


def test_linearize_hoists_loop_invariants():
    i, k = ir.range_(0, 8), ir.range_(1, 16)
    row = ir.load(1, dtypes.float32, i)  # depends on i only
    red = ir.reduce(Ops.ADD, ir.alu(Ops.MUL, ir.load(2, dtypes.float32, i * 16 + k), row), (k,))
    kern = Kernel("k", (Param("p0", dtypes.float32, "out", 8), Param("p1", dtypes.float32, "in", 8),
                        Param("p2", dtypes.float32, "in", 128)), (i,), (Store(0, i, red),))
    root = linearize(kern)
    body = root.inner.body
    assert row in body.stmts  # loaded once per row, outside the reduce loop
    reds = [s for s in walk(root) if isinstance(s, Reduce)]
    assert len(reds) == 1 and row not in reds[0].loop.body.stmts


def test_rendered_c_compiles_and_runs():
    x = zyx.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    src = zyx.debug.kernel_source((x * 2).sum(1))[0]
    assert "#pragma omp simd reduction(+:" in src
    np.testing.assert_allclose((x * 2).sum(1).numpy(), (np.arange(12).reshape(3, 4) * 2).sum(1))


def test_renderer_literals():
    r = CRenderer()
    assert r.literal(float("inf"), dtypes.float32) == "INFINITY"
    assert r.literal(-(2**63), dtypes.int64).startswith("(-9223372036854775807LL")
    assert r.literal(2**64 - 1, dtypes.uint64) == "18446744073709551615ULL"
    assert r.literal(True, dtypes.bool_) == "1"


def test_interchange_reduce_for_strided_reduce_axis():
    """matmul's B[k, j] and column sums walk the output axis contiguously: the reduce gets one accumulator
    per output element of a tile and the tile loop runs innermost."""
    info = DeviceInfo("host", "host", compute_units=2)
    x = zyx.Tensor(np.arange(64 * 96, dtype=np.float32).reshape(64, 96) / 1000)
    col = (x * 1.0).sum(0)
    from zyx.graph import schedule as sched

    k = sched.scheduled_steps([col.cls])[0].source
    ko = opt.optimize(k, info)
    assert ko.vector_acc is not None
    np.testing.assert_allclose(col.numpy(), x.numpy().sum(0), rtol=1e-5)
    row = (x * 1.0).sum(1)  # contiguous reduce axis: no interchange
    k = sched.scheduled_steps([row.cls])[0].source
    assert opt.optimize(k, info).vector_acc is None
    m = x.max(0)
    np.testing.assert_array_equal(m.numpy(), x.numpy().max(0))
    nan = zyx.Tensor(np.array([[1.0, 2.0], [np.nan, 0.0], [3.0, 1.0]] * 8, np.float32))
    np.testing.assert_array_equal(np.isnan(nan.max(0).numpy()), [True, False])


def test_sibling_column_reduces_are_interchanged_together():
    """Column reduces side by side in one kernel (a sum, a max, a dot product of two columns) or nested (a column
    variance: the mean inside the sum of squares) each keep one accumulator per output element of the tile; left
    walking their columns a row apart, the sum and max of a 4096x1024 matrix took 24 ms, its variance along axis 0
    25 ms (0.4 and 0.5 ms interchanged)."""
    from conftest import kernels_of

    info = DeviceInfo("host", "host", compute_units=2)
    xn, yn = (np.random.default_rng(s).standard_normal((64, 96)).astype(np.float32) for s in (3, 4))
    xn[5, 7] = np.nan
    x, y = zyx.Tensor(xn), zyx.Tensor(yn)
    outs = x.sum(0), x.max(0), (x * y).sum(0)
    (k,) = kernels_of(*outs)
    ko = opt.optimize(k, info)
    assert len(k.reduces()) == 3 and ko.vector_acc is not None
    # side by side over ranges of one size: one loop nest, each reduce its own accumulators (the rows read once)
    (red,) = [x for x in walk(linearize(ko)) if isinstance(x, Reduce)]
    assert len(red.exprs) == 3 and red.vec is ko.vector_acc
    assert CRenderer().render(ko).count("for (long long r") == 4  # output blocks, rows, tile, the stores' tile
    zyx.realize(*outs)
    np.testing.assert_allclose(outs[0].numpy(), xn.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(outs[1].numpy(), xn.max(0))
    np.testing.assert_allclose(outs[2].numpy(), (xn * yn).sum(0), rtol=1e-5, atol=1e-5)
    centered = ((y - y.mean(0)) ** 2).sum(0)  # the mean inside the sum's loops
    (k,) = kernels_of(centered)
    ko = opt.optimize(k, info)
    assert len(k.reduces()) == 2 and ko.vector_acc is not None
    assert [len(x.exprs) for x in walk(linearize(ko)) if isinstance(x, Reduce)] == [1, 1]  # nested: loops apart
    np.testing.assert_allclose(centered.numpy(), ((yn - yn.mean(0)) ** 2).sum(0), rtol=1e-5)
    np.testing.assert_allclose(x.var(0).numpy(), np.nanvar(xn, 0) * np.where(np.isnan(xn).any(0), np.nan, 1),
                               rtol=1e-5, equal_nan=True)


@settings(max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(rows=st.integers(2, 70), cols=st.integers(1, 200), picks=st.lists(st.integers(0, 6), min_size=2, max_size=4),
       nan=st.booleans())
def test_random_sibling_column_reduces_match_numpy(rows, cols, picks, nan):
    """Several column reduces of one kernel (sums, extremes, dot products, a nested variance), over any sizes (tiles
    that do not divide the columns, a single column) and with NaNs: interchanged together, side-by-side ones in one
    loop nest (``join_vector``), each equals NumPy's."""
    rng = np.random.default_rng(rows * 1000 + cols)
    xn, yn = (rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(2))
    if nan:
        xn[rng.integers(rows), rng.integers(cols)] = np.nan
    x, y = zyx.Tensor(xn), zyx.Tensor(yn)
    x64, y64 = xn.astype(np.float64), yn.astype(np.float64)
    table = [(lambda: x.sum(0), x64.sum(0)), (lambda: x.max(0), x64.max(0)), (lambda: y.min(0), y64.min(0)),
             (lambda: (x * y).sum(0), (x64 * y64).sum(0)), (lambda: (y * y).sum(0), (y64 * y64).sum(0)),
             (lambda: x.mean(0), x64.mean(0)), (lambda: y.var(0), y64.var(0))]
    outs = [table[i][0]() for i in picks]
    zyx.realize(*outs)
    for i, got in zip(picks, outs):
        np.testing.assert_allclose(got.numpy(), table[i][1], rtol=2e-5, atol=2e-5, equal_nan=True)


def test_a_reduce_read_inside_another_and_beside_it_is_rewritten_once():
    """Batch norm's running statistics in one kernel: the mean over (n, h, w) is stored and also read inside the
    variance's sum. ``merge_reduce_ranges`` rewrites the variance over the merged mean (it had kept the unmerged
    one beside the merged: the mean ran twice, and the render named one loop's index in the other, which gcc
    refused)."""
    from conftest import kernels_of

    xn = np.random.default_rng(6).standard_normal((16, 4, 8, 8)).astype(np.float32)
    x = zyx.Tensor(xn)
    m = x.mean((0, 2, 3))
    v = ((x - m.reshape(1, 4, 1, 1)) ** 2).mean((0, 2, 3))
    outs = m * 0.1 + 1, v * 0.2 + 1
    (k,) = kernels_of(*outs)
    ko = opt.optimize(k, DeviceInfo("host", "host", compute_units=2))
    assert len(k.reduces()) == len(ko.reduces()) == 2 and all(len(r.arg[1]) == 2 for r in ko.reduces())
    zyx.realize(*outs)
    mn = xn.mean((0, 2, 3))
    np.testing.assert_allclose(outs[0].numpy(), mn * 0.1 + 1, rtol=1e-6)
    np.testing.assert_allclose(outs[1].numpy(), ((xn - mn[:, None, None]) ** 2).mean((0, 2, 3)) * 0.2 + 1, rtol=1e-6)


def test_bool_accumulators_and_stashed_masks_are_bytes(tmp_path):
    """Bools kept across iterations (an ``any`` accumulator, a stashed mask row) are rendered as ``unsigned char``
    (GCC vectorizes no loop loading a ``_Bool`` array or reducing into a ``_Bool``), and gcc then vectorizes the
    loops; the values stay right."""
    import shutil
    import subprocess

    x = np.random.default_rng(2).standard_normal((64, 256)).astype(np.float32)
    x[3, 7] = np.nan
    X = zyx.Tensor(x)
    y = X.isnan().any(1)
    utils_log = zyx.utils.KERNEL_LOG
    zyx.utils.KERNEL_LOG = []
    try:
        got = y.numpy()
        (k,) = zyx.utils.KERNEL_LOG
    finally:
        zyx.utils.KERNEL_LOG = utils_log
    np.testing.assert_array_equal(got, np.isnan(x).any(1))
    src = CRenderer().render(opt.optimize(k, DeviceInfo("host", "host", compute_units=2)))
    assert "unsigned char acc" in src and "_Bool acc" not in src
    cc = shutil.which("gcc")
    if cc is None:
        return
    (tmp_path / "k.c").write_text(src)
    r = subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-fopt-info-vec-missed", "-c", "k.c", "-o", "k.o"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "relevant phi not supported" not in r.stderr


def test_reduce_ranges_merge_when_contiguous():
    """``merge_reduce_ranges``: a mean over (h, w) of a contiguous tensor becomes one long sum (one range, then the
    long-sum lanes); over (n, w) of an (n, c, w) tensor the ranges are not adjacent in memory and stay two."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 6, 32, 64)).astype(np.float32)
    info = DeviceInfo("host", "host", compute_units=2)
    outer, zyx.utils.KERNEL_LOG = zyx.utils.KERNEL_LOG, []
    try:
        got = zyx.Tensor(x).mean((2, 3)).numpy()
        strided = zyx.Tensor(x[:, :, 0]).sum((0, 2)).numpy()
        (k1, k2) = zyx.utils.KERNEL_LOG
    finally:
        zyx.utils.KERNEL_LOG = outer
    np.testing.assert_allclose(got, x.astype(np.float64).mean((2, 3)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(strided, x[:, :, 0].astype(np.float64).sum((0, 2)), rtol=1e-5, atol=1e-5)
    (red,) = opt.optimize(k1, info).reduces()
    assert [r.arg[1] for r in red.arg[1]] == [32 * 64] and opt.optimize(k1, info).reduce_lanes > 1
    (red2,) = opt.merge_reduce_ranges(opt.merge_loops(opt.drop_unit_loops(k2))).reduces()
    assert len(red2.arg[1]) == 2

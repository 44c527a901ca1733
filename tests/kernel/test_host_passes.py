"""Host kernel passes of ``zyx.kernel.opt`` that change how a kernel runs, not what it computes: column blocks
and register tiles of column sums (``column_block``, ``block_vector_reduce``) and row values computed once
(``stash_row_values``). Each is checked on its own kernels (the IR it builds, the C it renders) and on the
fuzzer's random programs, run with the passes on and off: the outputs must agree (bit for bit where the pass
does not reassociate sums) and match NumPy."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import zyx
from zyx import dtypes, utils
from zyx.backends.base import DeviceInfo
from zyx.kernel import ir, opt
from zyx.kernel.ir import Kernel, Param, Store
from zyx.kernel.render import CRenderer
from zyx.ops import Ops

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import passes_off  # noqa: E402
from fuzz_programs import compare, programs, run_zyx  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

PASSES = ("column_block", "block_vector_reduce", "stash_row_values", "split_divmod_loops", "split_divmod_reduces",
          "ungate_loads", "upcast_taps", "unroll_divmod_loops", "unroll_compared_loops", "unroll_reduce", "upcast_rows",
          "transpose", "transpose_block", "prefetch", "prefetch_streams", "scatter", "pack_window",
          "fold_batch")
HOST2 = DeviceInfo("host", "host", compute_units=2)


def _run(fn, off: tuple[str, ...] = ()) -> list[np.ndarray]:
    with passes_off(*off), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = fn()
    return [np.asarray(o) for o in (out if isinstance(out, (list, tuple)) else [out])]


def _same(a: np.ndarray, b: np.ndarray, exact: bool) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    if exact or not np.issubdtype(a.dtype, np.floating):
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(np.nanmax(np.abs(b), initial=0))))


def _kernels(fn) -> list[Kernel]:
    """The kernel IRs that computing ``fn()`` compiles."""
    outer, utils.KERNEL_LOG = utils.KERNEL_LOG, []
    try:
        _run(fn)
        return list(utils.KERNEL_LOG)
    finally:
        if outer is not None:
            outer.extend(utils.KERNEL_LOG)
        utils.KERNEL_LOG = outer


# ---- segments of a split loop ----------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes,parallel", [((60000, 9000), (1, 1)), ((60000, 4000), (1, 0)),
                                            ((20000, 9000), (0, 0))])
def test_segments_of_a_big_kernel_run_in_parallel_from_less_work(sizes, parallel):
    """``cat``'s pieces are segments of one kernel (``split_segments``): when the kernel has PARALLEL_MIN_WORK in
    all, a segment runs in parallel from PARALLEL_SEGMENT_MIN_WORK (the threads are awake already); a small kernel
    keeps every segment on one thread. Values are NumPy's either way."""
    assert 4000 < opt.PARALLEL_SEGMENT_MIN_WORK < 9000 and 20000 + 9000 < opt.PARALLEL_MIN_WORK < 60000
    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    ts = [zyx.Tensor(x).realize() for x in xs]
    (k,) = _kernels(lambda: (zyx.cat(ts) * 2).numpy())
    ko = opt.optimize(k, HOST2)
    segments = (ko, *ko.then)
    assert len(segments) == 2 and tuple(min(1, s.parallel) for s in segments) == parallel
    assert CRenderer().render(ko).count("omp parallel") == sum(parallel)
    np.testing.assert_array_equal(_run(lambda: (zyx.cat(ts) * 2).numpy())[0], np.concatenate(xs) * 2)


# ---- column sums ---------------------------------------------------------------------------------------------


def _col_sum_kernel(rows: int, cols: int, d=dtypes.float32, op=Ops.ADD) -> Kernel:
    j, r = ir.range_(0, cols), ir.range_(1, rows)
    red = ir.reduce(op, ir.load(1, d, r * cols + j), (r,))
    return Kernel("k", (Param("p0", d, "out", cols), Param("p1", d, "in", rows * cols)), (j,), (Store(0, j, red),))


def test_column_sum_takes_wide_blocks_and_register_tiles():
    k = opt.optimize(_col_sum_kernel(4096, 4096), HOST2)
    vec = k.vector_acc
    assert vec.arg[1] == 2048 and k.loops[0].arg[1] == 2  # one column block per compute unit
    assert k.vector_block == (opt.ROW_BLOCK, opt.VECTOR_TILE)
    src = CRenderer().render(k)
    assert f"+= {opt.ROW_BLOCK})" in src and "acc2_t[64]" in src


def test_column_blocks_leave_work_for_every_unit():
    k = opt.optimize(_col_sum_kernel(512, 1024), DeviceInfo("host", "host", compute_units=16))
    assert k.loops[0].arg[1] >= 16 and k.vector_acc.arg[1] == 64


def test_matmul_keeps_its_tile():
    i, j, r = ir.range_(0, 64), ir.range_(1, 256), ir.range_(2, 64)
    a, b = ir.load(1, dtypes.float32, i * 64 + r), ir.load(2, dtypes.float32, r * 256 + j)
    red = ir.reduce(Ops.ADD, ir.alu(Ops.MUL, a, b), (r,))
    k = Kernel("k", (Param("p0", dtypes.float32, "out", 64 * 256), Param("p1", dtypes.float32, "in", 64 * 64),
                     Param("p2", dtypes.float32, "in", 64 * 256)), (i, j), (Store(0, i * 256 + j, red),))
    with passes_off("gemm"):  # the interchanged path (large enough contractions take ``opt.tile_gemm``)
        assert opt.optimize(k, HOST2).vector_acc.arg[1] == 64  # a[i, r] does not walk j
    assert opt.optimize(k, HOST2).gemm is not None


@pytest.mark.parametrize("kernel,stride,width", [(3, 1, 56), (5, 1, 40), (3, 2, 30)])
def test_depthwise_taps_split_and_the_output_row_becomes_the_vector(kernel, stride, width):
    """A depthwise convolution's taps are one reduce range read as ``r // k`` and ``r % k``; split into (kh, kw)
    (``split_divmod_reduces``), the input walks the output row contiguously and the taps with strides, so the
    row (at most 64 wide: whole) becomes the vector of accumulators (32x128x56^2, 3x3: 17.8 ms -> 3.0 ms). Same
    terms in the same order: bit-identical with the split off, and equal to a float64 reference."""
    from conftest import host_without_blas

    import zyx.nn.functional as F

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, width, width)).astype(np.float32)
    w = rng.standard_normal((3, 1, kernel, kernel)).astype(np.float32)
    X, W = zyx.Tensor(x).realize(), zyx.Tensor(w).realize()
    pad = kernel // 2

    def fn():
        return F.conv2d(X, W, stride=stride, padding=pad, groups=3).numpy()

    with host_without_blas():
        (k,) = _kernels(fn)
        ko = opt.optimize(k, HOST2)
        on, off = _run(fn), _run(fn, ("split_divmod_reduces",))
    (red,) = ko.reduces()
    assert [r.arg[1] for r in red.arg[1]] == [kernel, kernel]
    out_w = (width + 2 * pad - kernel) // stride + 1
    assert ko.vector_acc is not None and ko.vector_acc.arg[1] == out_w
    assert not any(e.op in (Ops.DIV, Ops.MOD) for s in ko.stores for e in ir.toposort([s.index, s.value]))
    np.testing.assert_array_equal(on[0], off[0])
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    span = stride * (out_w - 1) + 1
    want = sum(xp[:, :, i:i + span:stride, j:j + span:stride] * w[None, :, 0, i, j, None, None]
               for i in range(kernel) for j in range(kernel))
    np.testing.assert_allclose(on[0], want, rtol=1e-5, atol=1e-5)


def _depthwise_step(n: int = 2, c: int = 3, size: int = 48, kernel: int = 3):
    """A depthwise convolution's training step on the host without BLAS: returns a function computing the input
    and weight gradients of ``sum(conv(x, w) * g)``, and the float64 references of both."""
    import zyx.nn.functional as F

    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, c, size, size)).astype(np.float32)
    w = rng.standard_normal((c, 1, kernel, kernel)).astype(np.float32)
    g = rng.standard_normal((n, c, size, size)).astype(np.float32)
    G = zyx.Tensor(g).realize()

    def fn():
        X, W = zyx.Tensor(x, requires_grad=True), zyx.Tensor(w, requires_grad=True)
        (F.conv2d(X, W, padding=kernel // 2, groups=c) * G).sum().backward()
        return [X.grad.numpy(), W.grad.numpy()]

    p = kernel // 2
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (p, p), (p, p)))
    gp = np.pad(g.astype(np.float64), ((0, 0), (0, 0), (p, p), (p, p)))
    dw = np.array([[[(xp[:, ch, i:i + size, j:j + size] * g[:, ch]).sum() for j in range(kernel)]
                    for i in range(kernel)] for ch in range(c)])[:, None]
    dx = sum(gp[:, :, kernel - 1 - i:kernel - 1 - i + size, kernel - 1 - j:kernel - 1 - j + size] *
             w[None, :, 0, i, j, None, None] for i in range(kernel) for j in range(kernel))
    return fn, dx, dw


def test_depthwise_weight_gradient_sums_every_tap_in_one_pass():
    """The weight gradient of a depthwise convolution is, per channel and tap, a sum over the batch and the
    positions. ``upcast_taps`` unrolls the 3 x 3 taps so that one pass over the input computes all nine (32x128x56^2:
    the kernel went from 9 passes, 56 ms, to 14 ms with the lanes below); the innermost range of each sum keeps a
    float partial per position (``CRenderer.nest_lanes``), where a reduction clause had added the vector up every
    row; ``ungate_loads`` lets the input gradient's loop vectorize (a gated weight load from an invariant
    address kept it scalar: 63 -> 11 ms). Results agree with a float64 reference and with the taps' pass off (each
    output sums the same terms in the same order; without the pass, the nine sums are interchanged side by side,
    ``interchange_reduce``, with float64 accumulators instead of float lanes)."""
    from conftest import host_without_blas

    fn, dx, dw = _depthwise_step()
    with host_without_blas():
        ks = [opt.optimize(k, HOST2) for k in _kernels(fn)]
        on, off = _run(fn), _run(fn, ("upcast_taps",))
        ungated = _run(fn, ("ungate_loads",))
    (wk,) = [k for k in ks if k.reduces()]
    assert wk.upcast_rows == 9 and len(wk.loops) == 1
    src = CRenderer().render(wk)
    assert "_l[48]" in src and "ZYX_NO_IFCVT void" not in src
    (xk,) = [k for k in ks if not k.reduces()]
    inner = xk.loops[-1]
    assert not any(e.op is Ops.LOAD and len(e.srcs) > 1 and inner not in e.srcs[0].ranges and
                   inner in e.srcs[1].ranges for s in xk.stores for e in ir.toposort([s.value]))  # no per-lane gate
    _same(on[1], off[1], exact=False)
    np.testing.assert_array_equal(on[0], ungated[0])
    np.testing.assert_allclose(on[0], dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(on[1], dw, rtol=1e-5, atol=1e-4)


def test_max_columns_are_not_blocked():
    k = opt.optimize(_col_sum_kernel(256, 256, op=Ops.MAX), HOST2)
    assert k.vector_block is None and k.vector_acc.arg[1] == 64


@pytest.mark.parametrize("shape,axis,dtype", [
    ((4096, 512), 0, np.float32), ((300, 1024), 0, np.float32), ((17, 128), 0, np.float32),
    ((64, 33, 256), 1, np.float32), ((2000, 640), 0, np.int32), ((1000, 256), 0, np.float64),
    ((8, 3000, 192), 1, np.float32), ((1000, 512), 0, np.float16),
])
def test_column_sums_match_with_blocks_off(shape, axis, dtype):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 4).astype(dtype)
    X = zyx.Tensor(x).realize()
    on = _run(lambda: X.sum(axis).numpy())
    for off in (PASSES, ("block_vector_reduce",)):
        _same(on[0], _run(lambda: X.sum(axis).numpy(), off)[0], exact=False)
    want = x.astype(np.float64).sum(axis)
    tol = 1e-2 if dtype is np.float16 else 1e-4
    np.testing.assert_allclose(on[0].astype(np.float64), want, rtol=tol, atol=tol * np.abs(x).sum(axis).max())


def test_column_max_keeps_nan():
    x = np.random.default_rng(4).standard_normal((512, 256)).astype(np.float32)
    x[100, 7] = np.nan
    got = zyx.Tensor(x).max(0).numpy()
    assert np.isnan(got[7]) and np.array_equal(got[8:], x.max(0)[8:])


# ---- row values computed once ----------------------------------------------------------------------------------


def _ops(k: Kernel) -> set[Ops]:
    return {e.op for s in k.stores for e in ir.toposort([s.value])}


def test_softmax_computes_exp_once():
    X = zyx.Tensor(np.random.default_rng(0).standard_normal((64, 1024)).astype(np.float32)).realize()
    (k,) = _kernels(lambda: X.softmax(-1).numpy())
    ko = opt.optimize(k, HOST2)
    assert {Ops.STASH, Ops.LOCAL} <= _ops(ko)
    src = CRenderer().render(ko)
    body = src[src.rindex("\nvoid "):]
    assert body.count("zyx_expf(") == 1 and "zloc0[1024]" in body


def test_masked_softmax_and_layernorm_stash_their_row_values():
    rng = np.random.default_rng(1)
    x = zyx.Tensor(rng.standard_normal((2, 3, 56, 56)).astype(np.float32)).realize()
    m = zyx.Tensor(np.where(rng.random((2, 1, 1, 56)) < 0.2, -1e9, 0).astype(np.float32)).realize()
    plain = CRenderer()
    plain.tail_bytes = 0  # each loop rendered once (no overlapped last vector: ``CRenderer.tail_bytes``)
    (k,) = _kernels(lambda: (x * 0.125 + m).softmax(-1).numpy())
    body = plain.render(opt.optimize(k, HOST2))
    body = body[body.rindex("\nvoid "):]
    assert body.count("zyx_expf(") == 1 and body.count("* 0.125f") == 1  # scale * x + mask once per element
    a = zyx.Tensor(rng.standard_normal((4, 56, 384)).astype(np.float32)).realize()
    b = zyx.Tensor(rng.standard_normal((4, 56, 384)).astype(np.float32)).realize()

    def ln():
        h = a + b
        d = h - h.mean(-1, keepdim=True)
        return (d / ((d * d).mean(-1, keepdim=True) + 1e-12).sqrt()).numpy()

    (k,) = _kernels(ln)
    body = plain.render(opt.optimize(k, HOST2))
    body = body[body.rindex("\nvoid "):]
    assert body.count(" + v") >= 1 and body.count("p1[") == 1 and body.count("p2[") == 1  # a + b once


# ---- overlapped vector tails (``CRenderer.tail_bytes``) ------------------------------------------------------

@contextlib.contextmanager
def _tails_off():
    """Within the block the host renders every simd loop whole (no overlapped last vector)."""
    from zyx.backends.registry import registry
    from zyx.graph import schedule

    dev = next(d for d in registry().get("host").devices if d.info().kind == "host")
    saved, dev.renderer.tail_bytes = dev.renderer.tail_bytes, 0
    schedule.clear_cache()
    try:
        yield
    finally:
        dev.renderer.tail_bytes = saved
        schedule.clear_cache()


def test_a_short_row_runs_whole_vectors_then_its_last_vector_again():
    """A softmax over rows of 56 float32: each loop along the row runs 48 (three vectors of 16), then 40..56 (the
    last vector again); only the iterations past 48 accumulate there (the maximum and its NaN flag see -inf,
    the sum 0), and the stores of 40..48 store what they stored. The two reduces keep one accumulator per lane
    through both parts, combined once after them by halving. Rows of 64 keep whole loops; cheap elements (a row
    sum) overlap over a few whole vectors (rows of 56), not over more (rows of 150)."""
    x = zyx.Tensor(np.random.default_rng(3).standard_normal((8, 56)).astype(np.float32)).realize()
    (k,) = _kernels(lambda: x.softmax(-1).numpy())
    body = CRenderer().render(opt.optimize(k, HOST2))
    body = body[body.rindex("\nvoid "):]
    # the maximum's and the sum's loops: whole vectors in blocks of 16 lanes, then the last vector from 40
    assert len(re.findall(r"for \(long long (r\d+)_o = 0; \1_o < 48; \1_o \+= 16\)", body)) == 2
    assert len(re.findall(r"const long long (r\d+) = 40 \+ \1_l;", body)) == 2
    # each combined once: 16 -> 8 -> 4 -> 2 -> 1 lanes, then into its accumulator
    assert len(re.findall(r"for \(int t = 0; t < 8; t\+\+\) \{ acc\d+_v\[t\] ", body)) == 2
    assert len(re.findall(r"for \(int t = 0; t < 1; t\+\+\) \{ acc\d+_v\[t\] ", body)) == 2
    assert "_v_nan[t] |= acc" in body and "_v_nan[t + 8];" in body and "reduction(" not in body
    into_max = r"acc(\d+) = \(acc\1_v\[0\] > acc\1\) \? acc\1_v\[0\] : acc\1; acc\1_nan \|= acc\1_v_nan\[0\];"
    assert len(re.findall(into_max, body)) == 1
    assert len(re.findall(r"acc(\d+) \+= acc\1_v\[0\];", body)) == 1
    # the division's loop (no reduce)
    assert len(re.findall(r"for \(long long (r\d+) = 0; \1 < 48; \1\+\+\)", body)) == 1
    assert len(re.findall(r"for \(long long (r\d+) = 40; \1 < 56; \1\+\+\)", body)) == 1
    assert "zyx__sel32(r" in body and ">= 48, " in body and "(-INFINITY))" in body and ", 0.0f)" in body
    y = zyx.Tensor(np.ones((8, 64), np.float32)).realize()
    (k,) = _kernels(lambda: y.softmax(-1).numpy())
    whole = CRenderer().render(opt.optimize(k, HOST2))
    assert ">= 48" not in whole and "< 64;" in whole
    (k,) = _kernels(lambda: x.sum(-1).numpy())
    assert ">= 48" in CRenderer().render(opt.optimize(k, HOST2))
    z = zyx.Tensor(np.ones((8, 150), np.float32)).realize()
    (k,) = _kernels(lambda: z.sum(-1).numpy())
    assert ">= 144" not in CRenderer().render(opt.optimize(k, HOST2))


def _tail_programs(n: int):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((5, 3, n)) * 3).astype(np.float32)
    x[0, 0, n - 12] = np.nan  # in the overlap of a 16-wide last vector (56, 77)
    x[1, 2, n - 1] = np.inf
    x[2, 1, :] = -np.inf
    x[3, 0, n - 3] = 1e30
    X, D, H = (zyx.Tensor(x.astype(t)).realize() for t in (np.float32, np.float64, np.float16))
    return {
        "softmax": lambda: X.softmax(-1).numpy(),
        "log_softmax_f64": lambda: D.log_softmax(-1).numpy(),
        "softmax_f16": lambda: H.softmax(-1).numpy(),
        "max_min_argmax": lambda: [X.max(-1).numpy(), X.min(-1).numpy(), X.argmax(-1).numpy()],
        "costly_sums": lambda: [X.exp().sum(-1).numpy(), (X / 7).sum(-1).numpy(), (X * X).tanh().prod(-1).numpy()],
        "layernorm": lambda: zyx.nn.functional.layer_norm(X, (n,)).numpy(),
        "cheap": lambda: [X.sum(-1).numpy(), X.var(-1).numpy(), (X * 100).cast(zyx.int32).sum(-1).numpy(),
                          (X > 1).any(-1).numpy(), (X - X.mean(-1, keepdim=True)).numpy(), D.sum(-1).numpy()],
    }


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("n", [23, 56, 77])
@pytest.mark.parametrize("name", list(_tail_programs(23)))
def test_overlapped_tails_agree_with_whole_loops(n, name):
    """Rows of 23, 56 and 77 (a last vector overlapping 9, 8 and 3 of the whole ones; NaN, infinities and a row of
    -inf among them) computed with overlapped tails and with whole loops: maxima, minima and their positions
    equal; sums and products within rounding (the tail's partial sums associate anew)."""
    fn = _tail_programs(n)[name]
    on = _run(fn)
    with _tails_off():
        off = _run(fn)
    for a, b in zip(on, off):
        _same(a, b, exact=not np.issubdtype(a.dtype, np.floating) or name == "max_min_argmax")


def _two_outputs(X):
    a, b = X.exp() / X.exp().sum(-1, keepdim=True), X.exp().sum(-1)
    zyx.realize(a, b)
    return [a.numpy(), b.numpy()]


def _row_programs():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 5, 130)).astype(np.float32) * 3
    x[1, 2, 7] = np.nan
    x[2, 0, 3] = np.inf
    x[3, 1, :] = -np.inf
    X = zyx.Tensor(x).realize()
    M = zyx.Tensor(np.where(rng.random((6, 1, 130)) < 0.3, -np.inf, 0).astype(np.float32)).realize()
    H = zyx.Tensor(x.astype(np.float16)).realize()
    D = zyx.Tensor(x.astype(np.float64)).realize()
    g = zyx.Tensor(rng.standard_normal(130).astype(np.float32)).realize()

    def layernorm(t):
        h = t * 2 + g
        d = h - h.mean(-1, keepdim=True)
        return d / ((d * d).mean(-1, keepdim=True) + 1e-5).sqrt() * g

    return {
        "softmax": lambda: X.softmax(-1).numpy(),
        "log_softmax": lambda: X.log_softmax(-1).numpy(),
        "masked": lambda: (X * 0.5 + M).softmax(-1).numpy(),
        "softmax_f16": lambda: H.softmax(-1).numpy(),
        "softmax_f64": lambda: D.softmax(-1).numpy(),
        "layernorm": lambda: layernorm(X).numpy(),
        "two_outputs": lambda: _two_outputs(X),
        "softmax_axis1": lambda: X.softmax(1).numpy(),
    }


@pytest.mark.parametrize("name", list(_row_programs()))
def test_row_programs_bit_identical_with_stash_off(name):
    fn = _row_programs()[name]
    on, off = _run(fn), _run(fn, ("stash_row_values",))
    for a, b in zip(on, off):
        _same(a, b, exact=True)


# ---- loops indexed by // and % -----------------------------------------------------------------------------


def test_head_merge_splits_its_loop():
    x = np.random.default_rng(2).standard_normal((2, 12, 5, 32)).astype(np.float32)
    X = zyx.Tensor(x).realize()

    def fn():
        return X.permute(0, 2, 1, 3).reshape(2, 5, 384).numpy()

    (k,) = _kernels(fn)
    ko = opt.optimize(k, HOST2)
    assert [r.arg[1] for r in ko.loops][-2:] == [12, 32]
    assert not any(e.op in (Ops.DIV, Ops.MOD) for s in ko.stores for e in ir.toposort([s.index, s.value]))
    on, off = _run(fn), _run(fn, ("split_divmod_loops",))
    np.testing.assert_array_equal(on[0], off[0])
    np.testing.assert_array_equal(on[0], x.transpose(0, 2, 1, 3).reshape(2, 5, 384))


@pytest.mark.parametrize("shape,perm", [((3, 4, 6), (1, 0, 2)), ((4, 6, 5), (2, 0, 1)), ((2, 3, 4, 5), (0, 2, 1, 3)),
                                        ((6, 8), (1, 0)), ((3, 16, 8), (1, 0, 2)), ((2, 4, 9, 12), (0, 2, 1, 3))])
def test_permuted_reshapes_match_with_split_off(shape, perm, eager_passes):
    x = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    X = zyx.Tensor(x).realize()

    def fn():
        return (X.permute(*perm).reshape(-1) * 3 + 1).numpy()

    on, off = _run(fn), _run(fn, ("split_divmod_loops",))
    np.testing.assert_array_equal(on[0], off[0])
    np.testing.assert_array_equal(on[0], x.transpose(perm).reshape(-1) * 3 + 1)


# ---- random programs, passes on and off ------------------------------------------------------------------------

EXAMPLES = int(os.environ.get("ZYX_PASS_FUZZ_EXAMPLES", "120"))


@pytest.fixture
def eager_passes(monkeypatch):
    """Thresholds low enough that the small random programs below exercise every pass."""
    monkeypatch.setattr(opt, "VECTOR_TILE", 4)
    monkeypatch.setattr(opt, "ROW_BLOCK", 2)
    monkeypatch.setattr(opt, "COLUMN_BLOCKS", (32, 16, 8, 4))
    monkeypatch.setattr(opt, "STASH_MIN_COST", 1)
    monkeypatch.setattr(opt, "STASH_TOTAL_BYTES", 1 << 9)  # forces the size limit to matter too
    monkeypatch.setattr(opt, "SPLIT_MIN_INNER", 2)
    monkeypatch.setattr(opt, "WIDE_ACC_MIN", 8)  # long-sum blocks (and their lanes) on short rows
    monkeypatch.setattr(opt, "REDUCE_LANES", 4)
    monkeypatch.setattr(opt, "UPCAST_ROWS", 2)  # two rows of two lanes
    monkeypatch.setattr(opt, "UPCAST_MIN_LANES", 1)
    monkeypatch.setattr(opt, "PREFETCH_MIN_INPUT", 0)
    monkeypatch.setattr(opt, "PREFETCH_MIN_BYTES", 4)
    monkeypatch.setattr(opt, "PREFETCH_MIN_LOADS", 2)
    monkeypatch.setattr(CRenderer, "sum_block", 8)
    monkeypatch.setattr(CRenderer, "lane_depth", 2)  # several blocks of lanes per row


def _agree(a: np.ndarray, b: np.ndarray, what: str) -> None:
    """Passes on (``a``) and off (``b``): same NaNs and infinities, finite values within reassociation error."""
    if a.dtype.kind != "f" or not a.size:
        np.testing.assert_array_equal(a, b)
        return
    assert np.array_equal(np.isnan(a), np.isnan(b)), f"{what}: NaN positions differ"
    fin = np.isfinite(a) & np.isfinite(b)
    assert np.array_equal(a[~fin & ~np.isnan(a)], b[~fin & ~np.isnan(b)]), f"{what}: infinities differ"
    scale = max(1.0, float(np.max(np.abs(b[fin]), initial=0)))
    assert np.allclose(a[fin].astype(np.float64), b[fin].astype(np.float64), rtol=1e-3, atol=1e-3 * scale), \
        f"{what}: passes on and off differ"


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(prog=programs())
def test_fuzz_programs_agree_with_passes_off(prog, eager_passes):
    on = _run(lambda: run_zyx(prog, "host"))
    off = _run(lambda: run_zyx(prog, "host"), PASSES)
    for i, a, b in zip(prog.outputs, on, off):
        assert compare(a, prog.vals[i]) is None, f"v{i} with passes on differs from NumPy"
        _agree(a, b, f"v{i}")


_DIMS = st.sampled_from([1, 2, 3, 4, 5, 8, 12, 16, 24, 33])
_PRE = {
    "x": lambda x, y: x,
    "affine": lambda x, y: x * 0.5 + y,
    "exp": lambda x, y: (x - y).exp(),
    "relu_mul": lambda x, y: (x + y).relu() * x,
    "sqrt": lambda x, y: x.abs().sqrt() - y,
    "tanh": lambda x, y: (x * y).tanh(),
}
_RED = {"sum": lambda t, a, kd: t.sum(a, keepdim=kd), "max": lambda t, a, kd: t.max(a, keepdim=kd),
        "min": lambda t, a, kd: t.min(a, keepdim=kd), "mean": lambda t, a, kd: t.mean(a, keepdim=kd)}


def _pattern(name: str, t, red, axis: int):
    if name == "reduce":
        return red(t, axis, False)
    if name == "center":  # a row value, then a second reduce over the same row
        d = t - red(t, axis, True)
        return (d * d).sum(axis)
    if name == "softmax":
        e = (t - t.max(axis, keepdim=True)).exp()
        return e / e.sum(axis, keepdim=True)
    if name == "layernorm":
        d = t - t.mean(axis, keepdim=True)
        return d / ((d * d).mean(axis, keepdim=True) + 1e-5).sqrt()
    if name == "nested":  # row values under another reduce (the stash must stay inside its loop)
        e = (t - t.max(axis, keepdim=True)).exp()
        return red((e / e.sum(axis, keepdim=True)) * t, (axis + 1) % t.ndim, False)
    if name == "merge":  # a permuted reshape (its loops are indexed by // and %), then the reduce
        perm = list(range(t.ndim))
        perm[axis], perm[-1] = perm[-1], perm[axis]
        m = t.permute(*perm)
        mm = m.reshape(*m.shape[:-2], m.shape[-2] * m.shape[-1]) * 2
        return mm * red(mm, -1, True)
    return t * red(t, axis, True)  # "scale": the output loop recomputes what the reduce computed


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(shape=st.lists(_DIMS, min_size=2, max_size=3), data=st.data())
def test_row_and_column_programs_agree_with_passes_off(shape, data, eager_passes):
    axis = data.draw(st.integers(0, len(shape) - 1), label="axis")
    pre = data.draw(st.sampled_from(sorted(_PRE)), label="pre")
    red = data.draw(st.sampled_from(sorted(_RED)), label="red")
    pat = data.draw(st.sampled_from(["reduce", "center", "softmax", "layernorm", "scale", "merge",
                                          "nested"]), label="pattern")
    dt = data.draw(st.sampled_from([np.float32, np.float64, np.float16]), label="dtype")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    x = (rng.standard_normal(shape) * 2).astype(dt)
    if data.draw(st.booleans(), label="specials"):
        x.flat[rng.integers(0, x.size, 2)] = [np.nan, -np.inf]
    ybshape = [1 if rng.random() < 0.5 else n for n in shape]
    y = rng.standard_normal(ybshape).astype(dt)
    X, Y = zyx.Tensor(x).realize(), zyx.Tensor(y).realize()

    def fn():
        return _pattern(pat, _PRE[pre](X, Y), _RED[red], axis).numpy()

    on, off = _run(fn)[0], _run(fn, PASSES)[0]
    _agree(on, off, f"{pat}/{pre}/{red} axis {axis}")


def test_random_programs_reach_the_passes(eager_passes):
    """The eager thresholds do make the random shapes above block column sums and stash row values."""
    X = zyx.Tensor(np.ones((16, 24), np.float32)).realize()
    ks = _kernels(lambda: [X.sum(0).numpy(), (X.exp() / X.exp().sum(1, keepdim=True)).numpy(), X.sum(1).numpy()])
    ko = [opt.optimize(k, HOST2) for k in ks]
    assert any(k.vector_block is not None for k in ko)
    assert any(Ops.STASH in _ops(k) for k in ko)
    assert any(k.reduce_lanes > 1 for k in ko)
    assert any(k.upcast_rows > 1 for k in ko)


def test_pass_names_are_known():
    assert set(PASSES) | {"gemm"} == opt.PASS_NAMES  # every optional pass is compared on and off here
    assert math.isfinite(opt.STASH_MAX_BYTES)


# ---- reduce lanes ----------------------------------------------------------------------------------------------

def test_long_row_sums_keep_independent_lanes():
    """A long float32 row sum adds its blocks in ``target_lanes`` partial sums, shared by ``UPCAST_ROWS`` rows
    computed together where the rows and lanes divide evenly; lengths the lanes do not tile keep one partial;
    values match NumPy's float64 sums either way, and the passes off."""
    rng = np.random.default_rng(7)
    kernels = {}
    lanes = opt.target_lanes(HOST2)
    per_row = lanes // opt.UPCAST_ROWS
    for cols in (4096, 4100):
        x = rng.standard_normal((8, cols)).astype(np.float32)
        X = zyx.Tensor(x).realize()
        (k,) = _kernels(lambda X=X: X.sum(1).numpy())
        kernels[cols] = k
        ko = opt.optimize(k, HOST2)
        tiled = cols % per_row == 0
        assert ko.reduce_lanes == (per_row if tiled else lanes)
        assert ko.upcast_rows == (opt.UPCAST_ROWS if tiled else 1)
        src = CRenderer().render(ko)
        assert src.count(f"_b_t[{per_row}];") == (opt.UPCAST_ROWS if tiled else 0)
        assert "_b_t[" not in src or tiled
        on = _run(lambda X=X: X.sum(1).numpy())[0]
        off = _run(lambda X=X: X.sum(1).numpy(), ("unroll_reduce",))[0]
        one_row = _run(lambda X=X: X.sum(1).numpy(), ("upcast_rows",))[0]
        ref = x.astype(np.float64).sum(1)
        # float32 blocks into a double: NumPy's own float32 sum is 1.2e-5 off here, a sequential float32 sum
        # 1.5e-4 (the order within a block follows the compiler's vector width, so the last bits vary)
        for got in (on, off, one_row):
            np.testing.assert_allclose(got, ref, rtol=1e-6, atol=3e-5)
    for lanes in (1, 16, 128):  # the search space's other values, one row at a time
        for cols, k in kernels.items():
            src = CRenderer().render(opt.optimize(k, HOST2, {"reduce_lanes": lanes, "upcast_rows": 1}))
            assert (f"_b_t[{lanes}]" in src) == (lanes > 1 and cols % lanes == 0)


def test_lanes_that_are_not_a_power_of_two_fold_their_excess_then_halve(tmp_path):
    """48 partial sums (``reduce_lanes`` of the search space need not be a power of two): lanes 32..47 fold into
    0..15, then 32 -> 16 -> ... -> 1, each step a loop of its own; the sums match NumPy's float64 ones."""
    import ctypes
    import subprocess

    from zyx.backends.host.compiler import BASE_FLAGS

    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    x = np.random.default_rng(9).standard_normal((4, 48 * 96)).astype(np.float32)
    X = zyx.Tensor(x).realize()
    (k,) = _kernels(lambda: X.sum(1).numpy())
    src = CRenderer().render(opt.optimize(k, HOST2, {"reduce_lanes": 48, "upcast_rows": 1}))
    steps = re.findall(r"for \(int t = 0; t < (\d+); t\+\+\) \{ (acc\d+_b)_t\[t\] \+= \2_t\[t \+ (\d+)\]; \}", src)
    assert [(int(n), int(o)) for n, _, o in steps] == [(16, 32), (16, 16), (8, 8), (4, 4), (2, 2), (1, 1)]
    (name,) = re.findall(r"void (\w+)\(void \*\*args\)", src)
    (tmp_path / "k.c").write_text(src)
    flags = [f for f in BASE_FLAGS] + ["-fopenmp"]
    subprocess.run([cc, *flags, str(tmp_path / "k.c"), "-o", str(tmp_path / "k.so")], check=True)
    fn = getattr(ctypes.CDLL(str(tmp_path / "k.so")), name)
    out = np.zeros(4, np.float32)
    fn((ctypes.c_void_p * 2)(out.ctypes.data, x.ctypes.data))
    np.testing.assert_allclose(out, x.astype(np.float64).sum(1), rtol=1e-6, atol=3e-5)


def test_sums_the_lanes_do_not_tile_take_a_half_or_a_quarter_of_them():
    """A row the target's lanes do not tile takes half or a quarter of them (at least 32) where those do: rows of
    3136 (56x56) get 64 partial sums, rows of 4100 (4 x 1025) none; the values match NumPy's float64 sums."""
    rng = np.random.default_rng(8)
    avx512 = DeviceInfo("host", "host", compute_units=2, vector_bytes=64)
    assert opt.target_lanes(avx512) == 128
    for cols, want in ((4096, 128), (3136, 64), (4100, 0)):
        x = rng.standard_normal((4, cols)).astype(np.float32)
        X = zyx.Tensor(x).realize()
        (k,) = _kernels(lambda X=X: X.sum(1).numpy())
        src = CRenderer().render(opt.optimize(k, avx512, {"upcast_rows": 1}))
        assert (f"_b_t[{want}];" in src) == bool(want) and ("_b_t[" in src) == bool(want)
        np.testing.assert_allclose(_run(lambda X=X: X.sum(1).numpy())[0], x.astype(np.float64).sum(1),
                                   rtol=1e-6, atol=3e-5)


def test_a_nested_sums_long_innermost_range_adds_in_blocks_of_float_lanes():
    """A float32 sum over several ranges whose innermost one is long and contiguous (a batch norm's per-channel
    sum over the batch and the positions) adds that range in blocks of float partial sums, each block's sum into
    the double accumulator, as a row sum does: one double add per element had bound it (BatchNorm2d statistics of
    32x64x56^2, mean and variance: 1.48 -> 0.85-0.90 ms on 2 cores). Values match NumPy's float64 sums, with the
    pass that sets the lanes on and off."""
    rng = np.random.default_rng(9)
    x = (rng.standard_normal((8, 4, 3136)) + 5).astype(np.float32)
    X = zyx.Tensor(x).realize()
    fn = lambda: (X.sum((0, 2)).numpy(), ((X - X.mean((0, 2), keepdim=True)) ** 2).sum((0, 2)).numpy())  # noqa: E731
    ks = _kernels(fn)
    src = "".join(CRenderer().render(opt.optimize(k, HOST2)) for k in ks)
    # every sum in blocks of 64 lanes (3136 = 49 x 64), no simd reduction into a double accumulator
    assert src.count("_b_t[64];") == 3 and not re.search(r"reduction\(\+:acc\d+\)", src), src
    x64 = x.astype(np.float64)
    want = (x64.sum((0, 2)), ((x64 - x64.mean((0, 2), keepdims=True)) ** 2).sum((0, 2)))
    for off in ((), ("unroll_reduce",)):
        for got, ref in zip(_run(fn, off), want):
            np.testing.assert_allclose(got, ref, rtol=1e-6)


def test_host_decisions_are_part_of_the_kernels_identity():
    """What the host passes decide (lanes, rows, tiles) are typed kernel fields, compared and hashed: kernels that
    differ only there are different kernels (a cache keyed by the kernel never confuses them); the same
    parameters give equal kernels."""
    X = zyx.Tensor(np.ones((8, 4096), np.float32)).realize()
    (k,) = _kernels(lambda: X.sum(1).numpy())
    a, b = opt.optimize(k, HOST2, {"reduce_lanes": 32}), opt.optimize(k, HOST2, {"reduce_lanes": 16})
    assert (a.reduce_lanes, b.reduce_lanes) == (32, 16) and a.loops == b.loops and a.stores == b.stores
    assert a != b and hash(a) != hash(b)
    c = opt.optimize(k, HOST2, {"reduce_lanes": 32, "upcast_rows": 2})
    assert c.upcast_rows == 2 and c != opt.optimize(k, HOST2, {"reduce_lanes": 32})
    again = opt.optimize(k, HOST2, {"reduce_lanes": 32})
    assert again == a and hash(again) == hash(a) and again is not a


@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_upcast_rows_share_one_loop(rows, monkeypatch):
    """``upcast_rows``: each of ``rows`` outputs keeps its own accumulators inside one shared loop nest, a row's
    mean and the sum of squares around it included (a reduce reading another reduce of the same row); rows that
    the count does not divide (or leave under two iterations) are left to one output per iteration."""
    from zyx.kernel.linearize import Reduce, linearize, walk

    rng = np.random.default_rng(3)
    for n_rows in (8, 6):
        x = rng.standard_normal((n_rows, 2048)).astype(np.float32)  # long enough for lanes
        X = zyx.Tensor(x).realize()

        def fn(X=X):
            return [X.sum(1).numpy(), ((X - X.mean(1, keepdim=True)) ** 2).sum(1).numpy()]

        for k in _kernels(fn):
            ko = opt.optimize(k, HOST2, {"upcast_rows": rows})
            applies = rows > 1 and n_rows % rows == 0 and n_rows // rows >= 2
            assert ko.upcast_rows == (rows if applies else 1)
            reds = [s for s in walk(linearize(ko)) if isinstance(s, Reduce)]
            assert all(len(r.exprs) == (rows if applies else 1) for r in reds)
            assert len(ko.stores) == len(k.stores) * (rows if applies else 1)
        monkeypatch.setattr(opt, "UPCAST_ROWS", rows)
        got = _run(fn, ("column_block",))  # (any name: fresh schedules with this row count)
        np.testing.assert_allclose(got[0], x.astype(np.float64).sum(1), rtol=1e-6, atol=3e-5)
        c = x.astype(np.float64) - x.astype(np.float64).mean(1, keepdims=True)
        np.testing.assert_allclose(got[1], (c * c).sum(1), rtol=1e-5)


# ---- interleaved phases ------------------------------------------------------------------------------------------


def _divmods(k: Kernel) -> int:
    return sum(e.op in (Ops.DIV, Ops.MOD) for e in ir.toposort(opt._all_roots(k)))


_PHASE_CASES = {
    # a stride-2 transposed convolution's col2im interleaves its 2x2 phases: (t + 1) // 2 and (t + 1) % 2 per axis
    "conv_transpose2d s2 p1": (lambda x, w: zyx.nn.functional.conv_transpose2d(x, w, stride=2, padding=1), 4),
    # nearest 2x upsampling of both axes: t // 2
    "upsample 2x": (lambda x, w: x[:, :, :, None, :, None].expand(2, 3, 6, 2, 8, 2).reshape(2, 3, 12, 16), 4),
    # pixel shuffle by 2: t // 2 and t % 2 of a permuted reshape
    "pixel shuffle": (lambda x, w: x.reshape(2, 3, 1, 1, 6, 8).expand(2, 3, 2, 2, 6, 8).permute(0, 1, 4, 2, 5, 3)
                      .reshape(2, 3, 12, 16) * 2.0, 4),
    # a sorting network's exchange of element t with t ^ 2 (halves of blocks of 4 flipped): t // 4, t // 2 % 2 and
    # t % 2; unrolled by 2, a // 2 and a % 2 would remain, so by 4 (a 2048^2 sort: 1.6 ms such a stage, not 8.8)
    "pair exchange": (lambda x, w: x.reshape(2, 3, 12, 2, 2).flip(-2).reshape(2, 3, 48) * 2.0, 4),
    # t with t ^ 4: split into blocks of 8 first (split_divmod_loops), whose b // 4 and b % 4 would leave a loop of 2
    # to vectorize: the block loop is unrolled whole (a 2048^2 sort: 1.5 ms such a stage, not 4.2)
    "pair exchange in blocks of 8": (lambda x, w: x.reshape(2, 3, 6, 2, 4).flip(-2).reshape(2, 3, 48) * 2.0, 8),
}


@pytest.mark.parametrize("name", list(_PHASE_CASES))
def test_interleaved_phases_unroll(name):
    """``unroll_divmod_loops``: an interleave of phases loses every division and remainder, one copy of the stores
    per phase (2 x 2 here); the outputs equal the pass-off ones bit for bit (the same expressions, folded)."""
    rng = np.random.default_rng(7)
    X = zyx.Tensor(rng.standard_normal((2, 3, 6, 8)).astype(np.float32)).realize()
    W = zyx.Tensor(rng.standard_normal((3, 4, 4, 4)).astype(np.float32)).realize()
    build, copies = _PHASE_CASES[name]

    def fn():
        return build(X, W).numpy()

    phased = [k for k in _kernels(fn) if _divmods(opt.merge_loops(opt.drop_unit_loops(k)))]
    assert phased, "no kernel divides its loop indices"
    for k in phased:
        ko = opt.optimize(k, HOST2)
        assert _divmods(ko) == 0
        assert len(ko.stores) == copies * len(k.stores)
        assert all(r.arg[1] > 1 for r in ko.loops), ko.loops  # a loop unrolled whole leaves no unit loop behind
    on, off = _run(fn), _run(fn, ("unroll_divmod_loops",))
    np.testing.assert_array_equal(on[0], off[0])
    if name == "upsample 2x":
        np.testing.assert_array_equal(on[0], X.numpy().repeat(2, 2).repeat(2, 3))


def _inner_gated_loads(k: Kernel) -> list[ir.Expr]:
    """``k``'s gated loads in its innermost loop (address or gate walking it) whose index stays in its buffer."""
    inner = k.loops[-1]
    return [e for e in ir.toposort(opt._all_roots(k)) if e.op is Ops.LOAD and len(e.srcs) > 1 and
            (inner in e.srcs[0].ranges or inner in e.srcs[1].ranges) and 0 <= e.srcs[0].vmin and
            e.srcs[0].vmax < k.params[e.arg].size]


def _simd_loops_vectorized(src: str, tmp_path: Path) -> tuple[int, int]:
    """(simd loops, of them reported vectorized) when GCC compiles ``src`` with the host backend's flags."""
    import subprocess

    from zyx.backends.host.compiler import BASE_FLAGS

    path = tmp_path / "kernel.c"
    path.write_text(src)
    flags = [f for f in BASE_FLAGS if f not in ("-shared", "-fPIC")]
    out = subprocess.run([shutil.which("gcc"), *flags, "-fopenmp", "-S", "-o", os.devnull, "-fopt-info-vec-optimized",
                          str(path)], capture_output=True, text=True, check=True).stderr
    done = [int(m) for m in re.findall(r":(\d+):\d+: optimized: loop vectorized", out)]  # 1-based, in the body
    lines = src.splitlines()
    body = src[:src.index("void **args)")].count("\n")  # the kernel's first line, 0-based
    spans = []
    for i in range(body, len(lines)):
        if "#pragma omp simd" in lines[i]:  # the loop: from the next line to its closing brace
            depth, j = 0, i + 1
            while True:
                depth += lines[j].count("{") - lines[j].count("}")
                if depth <= 0 and "}" in lines[j]:
                    break
                j += 1
            spans.append((i + 2, j + 1))
    return len(spans), sum(any(a <= d <= b for d in done) for a, b in spans)


_COL2IM_CASES = {
    # a transposed convolution's col2im: each tap of a 2 x 2 phase gated by its output row and column
    "conv_transpose2d 4x4 s2 p1": (lambda: zyx.nn.functional.conv_transpose2d, (2, 6, 8, 8), (6, 4, 4, 4),
                                   dict(stride=2, padding=1)),
    # a 7x7 stride-2 stem's input gradient (45 gated taps a phase)
    "conv2d 7x7 s2 p3 input gradient": (lambda: zyx.nn.functional.conv2d, (2, 3, 16, 16), (4, 3, 7, 7),
                                        dict(stride=2, padding=3)),
}


@pytest.mark.skipif(shutil.which("gcc") is None, reason="reads GCC's vectorizer report")
@pytest.mark.parametrize("name", list(_COL2IM_CASES))
def test_col2im_taps_load_ungated_and_vectorize(name, tmp_path):
    """``ungate_loads``: a strided col2im gates its taps by conditions on the output row, invariant in the vector
    loop, and GCC 12 vectorized none of that loop ("complicated access pattern"; the stem's input gradient,
    16x3x64x64, ran 0.85 ms scalar and 0.17-0.20 ms vectorized). With the pass, no gated load of the innermost loop
    stays in bounds (each became a load and a select) and every simd loop of the kernel compiles vectorized: with
    it off, none did (GCC 12.2). The outputs equal the pass-off ones bit for bit."""
    conv, xs, ws, kw = _COL2IM_CASES[name]
    rng = np.random.default_rng(5)
    x, w = (rng.standard_normal(s).astype(np.float32) for s in (xs, ws))
    G = zyx.Tensor(rng.standard_normal(conv()(zyx.Tensor(x), zyx.Tensor(w), **kw).shape).astype(np.float32))

    def fn():
        if conv() is zyx.nn.functional.conv_transpose2d:
            return conv()(zyx.Tensor(x), zyx.Tensor(w), **kw).numpy()
        X = zyx.Tensor(x, requires_grad=True)
        (conv()(X, zyx.Tensor(w), **kw) * G).sum().backward()
        return X.grad.numpy()

    col2im = []
    for k in _kernels(fn):
        with passes_off("ungate_loads"):
            off = opt.optimize(k, HOST2)
        if not off.reduces() and off.gemm is None and off.loops and _inner_gated_loads(off):
            col2im.append(opt.optimize(k, HOST2))
    assert col2im, "no kernel gates in-bounds loads in its innermost loop"
    for on in col2im:
        assert not _inner_gated_loads(on)
        loops, vectorized = _simd_loops_vectorized(CRenderer().render(on), tmp_path)
        assert loops and vectorized == loops, f"{vectorized} of {loops} simd loops vectorized"
    np.testing.assert_array_equal(_run(fn)[0], _run(fn, ("ungate_loads",))[0])


def test_a_sort_stage_pair_decides_its_halves():
    """The first stage pair of a merge of 2048 compares ``r // 1024 == 0`` (the halves of the mirror stage) and
    ``r // 512 % 2 == 0``: ``split_divmod_loops`` makes loops of 2 of them and ``unroll_compared_loops`` unrolls
    them, so no loop range is compared with a constant; the outputs equal the pass-off ones bit for bit."""
    from zyx.sorting import _merge_stages

    rng = np.random.default_rng(3)
    keys = zyx.Tensor(rng.standard_normal((4, 2048)).astype(np.float32)).realize()
    tags = zyx.Tensor(np.tile(np.arange(2048, dtype=np.int32), (4, 1))).realize()

    def fn():
        a, b = _merge_stages(keys, tags, 2048, 1024, 2, False)
        zyx.realize(a, b)
        return a.numpy(), b.numpy()

    (k,) = [k for k in _kernels(fn) if len(k.stores) == 2]
    ko = opt.optimize(k, HOST2)
    assert not ko.then and len(ko.stores) == 4 * 2  # 2 x 2 copies of both stores
    assert not [e for e in ir.toposort(opt._all_roots(ko)) if e.op is Ops.CMPEQ and
                any(x.op is Ops.RANGE for x in e.srcs)]
    on, off = _run(fn), _run(fn, ("unroll_compared_loops",))
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("shape, pads", [((1, 2, 3), ((0, 0), (1, 1), (0, 0))), ((2, 4, 2), ((0, 0), (2, 1), (0, 0))),
                                         ((3, 5, 8), ((1, 0), (1, 2), (0, 0)))])
def test_padded_reshapes_compute_their_interleaved_copies(shape, pads):
    """A pad then a reshape that merges the padded axis: ``unroll_divmod_loops`` makes one store per element of the
    last axis, each a gated load ``p[3 i + u - 3]`` (a masked interleaved group). GCC 12 vectorized such a group
    wrong (the composition fuzzer found 4 of 12 elements 0.0 for the first shape), so the kernel renders with
    ``ZYX_NO_IFCVT``; one with a single gated load per iteration, or none, keeps if-conversion. (A last axis of 8
    is past the pass's copies: one gated load.)"""
    from zyx.kernel.render import CRenderer

    x = np.random.default_rng(0).standard_normal(shape)
    n = math.prod(s + a + b for s, (a, b) in zip(shape, pads))
    y = zyx.Tensor(x).pad(pads, value=0.5).reshape(1, n)
    np.testing.assert_array_equal(y.numpy(), np.pad(x, pads, constant_values=0.5).reshape(1, n))
    (k,) = _kernels(lambda: zyx.Tensor(x).pad(pads, value=0.5).reshape(1, n).numpy())
    ko = opt.optimize(k, HOST2)
    assert CRenderer.no_if_convert(ko) == (len(ko.stores) > 1) == (shape[-1] < 8)
    assert ("ZYX_NO_IFCVT void" in CRenderer().render(ko)) == (shape[-1] < 8)
    assert not CRenderer.no_if_convert(k)  # before the pass: one gated load, contiguous
    X = zyx.Tensor(np.ones((2, 3, 16, 16), np.float32)).realize()
    for ko in (opt.optimize(k, HOST2) for k in _kernels(lambda: zyx.nn.functional.max_pool2d(X, 3, 2, 1).numpy())):
        assert not CRenderer.no_if_convert(ko)


def test_unroll_divmod_leaves_ragged_and_reducing_loops():
    """A loop whose extent the divisor does not split evenly, or a kernel with a reduce, keeps its divisions."""
    i, j = ir.range_(0, 7), ir.range_(1, 4)
    x = ir.load(1, dtypes.float32, ir.idiv(i + 1, 2) * 4 + j)
    ragged = Kernel("k", (Param("p0", dtypes.float32, "out", 28), Param("p1", dtypes.float32, "in", 16)), (i, j),
                    (Store(0, i * 4 + j, x),))
    assert opt.unroll_divmod_loops(ragged) is ragged
    r = ir.range_(2, 6)
    red = ir.reduce(Ops.ADD, ir.load(1, dtypes.float32, ir.idiv(r + 1, 2) * 4 + j), (r,))
    summed = Kernel("k", (Param("p0", dtypes.float32, "out", 4), Param("p1", dtypes.float32, "in", 16)), (j,),
                    (Store(0, j, red),))
    assert opt.unroll_divmod_loops(summed) is summed


def test_a_ragged_interleave_splits_off_its_remainder_and_the_rest_unrolls():
    """``split_ragged_phases``: a loop of 7 indexed through ``(i + 1) // 2`` becomes a segment of 6 iterations, which
    ``unroll_divmod_loops`` unrolls (no division left), and one of the last iteration; other loops and kernels with a
    reduce stay whole. In ``optimize``, a 1-D transposed convolution (kernel 5, stride 3, 1502 outputs a row, cropped
    from 3 x 501 phases) unrolls its first 1500 outputs a row, the last 2 a segment of their own; equal bit for bit
    with the passes off."""
    i, j = ir.range_(0, 7), ir.range_(1, 4)
    x = ir.load(1, dtypes.float32, ir.idiv(i + 1, 2) * 4 + j)
    ragged = Kernel("k", (Param("p0", dtypes.float32, "out", 28), Param("p1", dtypes.float32, "in", 16)), (i, j),
                    (Store(0, i * 4 + j, x),))
    head, tail = opt.split_ragged_phases(ragged)
    assert [r.arg[1] for r in head.loops] == [6, 4] and [r.arg[1] for r in tail.loops] == [4]  # (a unit loop dropped)
    assert _divmods(head) > 0 and _divmods(opt.unroll_divmod_loops(head)) == 0
    even = replace(ragged, loops=(ir.range_(0, 8), j))
    assert opt.split_ragged_phases(even) == [even]
    # ragged halves on every loop: the remainders split off where the unrolling's 8 copies reach (the inner three
    # loops here, 2 copies each), and every segment of the inner two unrolls to no division
    def halves(*sizes):
        rs = [ir.range_(10 + a, n) for a, n in enumerate(sizes)]
        zero = ir.const(0, ir.index_dtype)
        index = sum((ir.idiv(r + 1, 2) * 32 ** (len(rs) - 1 - a) for a, r in enumerate(rs)), zero)
        out = sum((r * 64 ** (len(rs) - 1 - a) for a, r in enumerate(rs)), zero)
        return Kernel("k", (Param("p0", dtypes.float32, "out", 64 ** len(rs)),
                            Param("p1", dtypes.float32, "in", 32 ** len(rs))), tuple(rs),
                      (Store(0, out, ir.load(1, dtypes.float32, index)),))

    parts = opt.split_ragged_phases(halves(9, 33))
    assert sorted(tuple(r.arg[1] for r in p.loops) for p in parts) == [(), (8,), (8, 32), (32,)]
    assert all(_divmods(opt.unroll_divmod_loops(p)) == 0 for p in parts)
    parts = opt.split_ragged_phases(halves(9, 9, 9, 33))
    assert (9, 8, 8, 32) in [tuple(r.arg[1] for r in p.loops) for p in parts]  # the outer loop: past the budget
    r = ir.range_(2, 6)
    red = ir.reduce(Ops.ADD, ir.load(1, dtypes.float32, ir.idiv(r + 1, 2) * 4 + j), (r,))
    summed = Kernel("k", (Param("p0", dtypes.float32, "out", 4), Param("p1", dtypes.float32, "in", 16)), (j,),
                    (Store(0, j, red),))
    assert opt.split_ragged_phases(summed) == [summed]

    rng = np.random.default_rng(8)
    X = zyx.Tensor(rng.standard_normal((2, 6, 500)).astype(np.float32)).realize()
    W = zyx.Tensor(rng.standard_normal((6, 3, 5)).astype(np.float32)).realize()

    def fn():
        return zyx.nn.functional.conv_transpose1d(X, W, stride=3).numpy()

    (k,) = [k for k in _kernels(fn) if _divmods(opt.merge_loops(opt.drop_unit_loops(k)))]
    ko = opt.optimize(k, HOST2)
    head, *rest = (ko, *ko.then)
    assert _divmods(head) == 0 and len(head.stores) == 3 * len(k.stores)
    assert [math.prod(r.arg[1] for r in p.loops) for p in rest] == [2 * 3 * 2]  # the last 2 outputs of each row
    on, off = _run(fn), _run(fn, ("unroll_divmod_loops",))
    np.testing.assert_array_equal(on[0], off[0])


def test_unrolled_copies_count_as_work():
    """``work`` counts every store: the 3-D phases of a transposed convolution (4 x 8 x 16^3 outputs, 8 copies of the
    stores after ``unroll_divmod_loops``) still run in parallel, as before the unrolling."""
    rng = np.random.default_rng(9)
    X = zyx.Tensor(rng.standard_normal((4, 16, 8, 8, 8)).astype(np.float32)).realize()
    W = zyx.Tensor(rng.standard_normal((16, 8, 4, 4, 4)).astype(np.float32)).realize()
    (k,) = [k for k in _kernels(lambda: zyx.nn.functional.conv_transpose3d(X, W, stride=2, padding=1).numpy())
            if _divmods(opt.merge_loops(opt.drop_unit_loops(k)))]
    ko = opt.optimize(k, HOST2)
    assert len(ko.stores) == 8 and _divmods(ko) == 0
    assert opt.work(ko) == k.size >= opt.PARALLEL_MIN_WORK and ko.parallel


# ---- prefetch ----------------------------------------------------------------------------------------------------


def _conv_input_grad(n=8, c=16, hw=16):
    rng = np.random.default_rng(5)
    X = zyx.Tensor(rng.standard_normal((n, c, hw, hw)).astype(np.float32), requires_grad=True)
    W = zyx.Tensor(rng.standard_normal((c, c, 3, 3)).astype(np.float32)).realize()
    G = zyx.Tensor(rng.standard_normal((n, c, hw, hw)).astype(np.float32)).realize()

    def fn():
        X.grad = None
        (zyx.nn.functional.conv2d(X, W, padding=1) * G).sum().backward()
        return X.grad.numpy()
    return fn


def test_col2im_prefetches_the_next_channels_columns(monkeypatch):
    """``prefetch_blocks``: a 3x3 convolution's input gradient overlap-adds 9 taps of its columns (n, c, 9, h*w):
    each output channel reads one block of 9 * h * w floats as 9 short streams, and the next channel's block is
    prefetched (rendered at the top of the parallel loop); a long row sum, one stream, is left to the hardware."""
    monkeypatch.setattr(opt, "PREFETCH_MIN_INPUT", 0)
    fn = _conv_input_grad()
    col2im = [ko for ko in (opt.optimize(k, HOST2) for k in _kernels(fn)) if ko.prefetch]
    assert len(col2im) == 1
    (f,) = col2im[0].prefetch
    assert f.loop is col2im[0].loops[0] and f.stride == 9 * 16 * 16 and f.length <= f.stride
    src = CRenderer().render(col2im[0])
    assert src.count(f"__builtin_prefetch(p{f.param} + zq") == 1
    X = zyx.Tensor(np.ones((64, 4096), np.float32)).realize()
    assert not any(opt.optimize(k, HOST2).prefetch for k in _kernels(lambda: X.sum(1).numpy()))
    on, off = _run(fn), _run(fn, ("prefetch",))
    np.testing.assert_array_equal(on[0], off[0])


def test_prefetch_needs_one_stride_and_a_dense_block(monkeypatch):
    """Loads that advance by different strides per iteration, or read a block far wider than the stride (not read
    once each), get no prefetch; small inputs get none by default."""
    monkeypatch.setattr(opt, "PREFETCH_MIN_INPUT", 0)
    r, j = ir.range_(0, 64), ir.range_(1, 256)
    p = (Param("p0", dtypes.float32, "out", 64 * 256), Param("p1", dtypes.float32, "in", 64 * 768))

    def kernel(*indices):
        v = ir.load(1, dtypes.float32, indices[0])
        for i in indices[1:]:
            v = ir.alu(Ops.ADD, v, ir.load(1, dtypes.float32, i))
        return replace(Kernel("k", p, (r, j), (Store(0, r * 256 + j, v),)), parallel=1)

    dense = kernel(r * 768 + j, r * 768 + j + 256, r * 768 + j + 512)
    assert opt.prefetch_blocks(dense).prefetch == (ir.Prefetch(1, r, 768, 0, 768),)
    assert not opt.prefetch_blocks(kernel(r * 768 + j, r * 512 + j + 256, r * 768 + j + 512)).prefetch
    assert not opt.prefetch_blocks(kernel(r * 256 + j, r * 256 + j + 2048, r * 256 + j + 4096)).prefetch
    monkeypatch.undo()
    assert not opt.prefetch_blocks(dense).prefetch  # 192 KiB: below the default smallest input


def test_long_row_sums_prefetch_their_stream(monkeypatch):
    """``prefetch_streams``: a long row sum with lanes prefetches its input ``STREAM_PREFETCH_BYTES`` ahead into L2
    (locality 2: the L1 is left to the hardware prefetcher), once per block of lanes, for each row computed together
    (the range redefined ahead in a scope of its own, the block clipped to the buffer); the values are those of the
    kernel without it, bit for bit. Small inputs get none by default, ``prefetch_distance`` 0 (a search
    candidate) turns it off and ``prefetch_locality`` 3 (another) fetches into L1."""
    rng = np.random.default_rng(11)
    X = zyx.Tensor(rng.standard_normal((8, 4096)).astype(np.float32)).realize()
    (k,) = _kernels(lambda: X.sum(1).numpy())
    assert opt.optimize(k, HOST2).stream_prefetch is None  # 128 KiB: below the smallest input
    monkeypatch.setattr(opt, "PREFETCH_MIN_INPUT", 0)
    stream = ir.StreamPrefetch((1,), opt.STREAM_PREFETCH_BYTES // 4, opt.STREAM_PREFETCH_LOCALITY)
    for rows in (1, 2):
        ko = opt.optimize(k, HOST2, {"upcast_rows": rows})
        assert ko.stream_prefetch == stream
        src = CRenderer().render(ko)
        lanes = ko.reduce_lanes
        assert src.count(f"_o + {opt.STREAM_PREFETCH_BYTES // 4}LL; const long long zi =") == rows
        assert src.count(f"zl < {lanes}; zl += 16) __builtin_prefetch(p1 + zq + zl, 0, 2);") == rows
        assert f"zi < {8 * 4096 - lanes}LL ? zi : {8 * 4096 - lanes}LL" in src
    assert opt.optimize(k, HOST2, {"prefetch_distance": 0}).stream_prefetch is None
    l1 = CRenderer().render(opt.optimize(k, HOST2, {"prefetch_locality": 3}))  # a search candidate: into L1
    assert "__builtin_prefetch(p1 + zq + zl, 0, 3);" in l1 and "__builtin_prefetch(p1 + zq + zl, 0, 2);" not in l1
    on, off = _run(lambda: X.sum(1).numpy()), _run(lambda: X.sum(1).numpy(), ("prefetch_streams",))
    np.testing.assert_array_equal(on[0], off[0])


def test_stream_prefetch_skips_gated_and_gathered_loads(monkeypatch):
    """Only plain loads that walk the sum's range contiguously are prefetched: a padded (gated) load, a load
    through a loaded index and a strided one are not."""
    monkeypatch.setattr(opt, "PREFETCH_MIN_INPUT", 0)
    i, r = ir.range_(0, 8), ir.range_(1, 512)
    f32 = dtypes.float32
    params = (Param("p0", f32, "out", 8), Param("p1", f32, "in", 8 * 1024), Param("p2", dtypes.int32, "in", 512))

    def kernel(value):
        k = Kernel("k", params, (i,), (Store(0, i, ir.reduce(Ops.ADD, value, (r,))),))
        return replace(k, wide_acc=True, reduce_lanes=64, parallel=1)

    plain = kernel(ir.load(1, f32, i * 512 + r))
    stream = ir.StreamPrefetch((1,), opt.STREAM_PREFETCH_BYTES // 4, opt.STREAM_PREFETCH_LOCALITY)
    assert opt.prefetch_streams(plain).stream_prefetch == stream
    gated = ir.load(1, f32, i * 512 + r, ir.alu(Ops.CMPLT, r, ir.const(500, ir.index_dtype)))
    gather = ir.load(1, f32, ir.cast(ir.load(2, dtypes.int32, r), ir.index_dtype))
    strided = ir.load(1, f32, r * 2 + i)
    for value in (gated, strided):
        assert opt.prefetch_streams(kernel(value)).stream_prefetch is None
    # the index stream itself is contiguous along the sum: it, not the gathered input, is prefetched
    assert opt.prefetch_streams(kernel(gather)).stream_prefetch.params == (2,)
    assert opt.prefetch_streams(replace(plain, reduce_lanes=0)).stream_prefetch is None


# ---- one-hot sums as scatters ------------------------------------------------------------------------------------


def _scatters(fn) -> list[Kernel]:
    return [ko for ko in (opt.optimize(k, HOST2) for k in _kernels(fn))
            if any(part.scatter is not None for part in (ko, *ko.then))]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_one_hot_sums_add_at_their_rows(dtype):
    """``scatter_one_hot``: an embedding's and an index_select's gradients (one-hot sums over the lookups) zero the
    output, then add each lookup's row at the row its index picks (negative indices from the end, repeats adding
    up), in lookup order: np.add.at's values; the same within rounding with the pass off (a double accumulator)."""
    rng = np.random.default_rng(11)
    w = rng.standard_normal((50, 8)).astype(dtype)
    idx = rng.integers(-50, 50, (6, 7))
    idx[0, :3] = 4  # repeats
    g = rng.standard_normal((6, 7, 8)).astype(dtype)
    x = rng.standard_normal((3, 40, 5)).astype(dtype)
    sel = rng.integers(0, 40, 30)
    gs = rng.standard_normal((3, 30, 5)).astype(dtype)

    def grads():
        W, X = zyx.Tensor(w, requires_grad=True), zyx.Tensor(x, requires_grad=True)
        loss = (zyx.nn.functional.embedding(zyx.Tensor(idx), W) * zyx.Tensor(g)).sum() + \
            (X.index_select(1, zyx.Tensor(sel)) * zyx.Tensor(gs)).sum()
        loss.backward()
        return [W.grad.numpy(), X.grad.numpy()]

    want_w, want_x = np.zeros_like(w, np.float64), np.zeros_like(x, np.float64)
    np.add.at(want_w, idx.reshape(-1) % 50, g.reshape(-1, 8))
    np.add.at(want_x, (slice(None), sel), gs)
    on = _run(grads)
    tol = 1e-5 if dtype == "float32" else 1e-12
    np.testing.assert_allclose(on[0], want_w, rtol=tol, atol=tol)
    np.testing.assert_allclose(on[1], want_x, rtol=tol, atol=tol)
    off = _run(grads, ("scatter",))
    for a, b in zip(on, off):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol)
    assert len(_scatters(grads)) == 2


def test_one_hot_sums_scatter_only_what_they_can():
    """A one-hot sum whose index varies along another output axis (take_along_axis's gradient), or over fewer than
    ``SCATTER_MIN_TARGETS`` rows, keeps its compare-every-row reduce; the values are right either way."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((4, 30)).astype(np.float32)
    idx = rng.integers(0, 30, (4, 6))
    small = rng.standard_normal((4, 3)).astype(np.float32)

    def grads():
        X, S = zyx.Tensor(x, requires_grad=True), zyx.Tensor(small, requires_grad=True)
        (X.gather(1, zyx.Tensor(idx)).sum() + S[:, zyx.Tensor(np.array([2, 0, 2]))].sum()).backward()
        return [X.grad.numpy(), S.grad.numpy()]

    assert _scatters(grads) == []
    gx, gs = _run(grads)
    want = np.zeros_like(x)
    np.add.at(want, (np.arange(4)[:, None], idx), 1.0)
    np.testing.assert_array_equal(gx, want)
    np.testing.assert_array_equal(gs, np.tile(np.array([1.0, 0.0, 2.0], np.float32), (4, 1)))


def test_one_hot_sum_feeding_an_update_gets_a_kernel_of_its_own():
    """An SGD step on an embedding: fusion would inline the weight's one-hot gradient into the update kernel (a
    compare per row for every element: 1.29 s a step at 30000 rows); it stores the sum instead (a kernel of its own,
    which scatters), and the update reads it. Values against NumPy's np.add.at."""
    rng = np.random.default_rng(13)
    w0 = rng.standard_normal((40, 6)).astype(np.float32)
    idx = rng.integers(0, 40, (5, 9))
    g = rng.standard_normal((5, 9, 6)).astype(np.float32)

    def step():
        emb = zyx.nn.Embedding(40, 6)
        emb.weight.assign(zyx.Tensor(w0))
        sgd = zyx.optim.SGD(emb.parameters(), lr=0.5)
        (emb(zyx.Tensor(idx)) * zyx.Tensor(g)).sum().backward()
        sgd.step()
        return emb.weight.numpy()

    grad = np.zeros((40, 6), np.float64)
    np.add.at(grad, idx.reshape(-1), g.reshape(-1, 6))
    np.testing.assert_allclose(_run(step)[0], w0 - 0.5 * grad, rtol=1e-5, atol=1e-5)
    assert len(_scatters(step)) == 1


# ---- integer selects -------------------------------------------------------------------------------------------


def test_integer_selects_outside_vector_loops_are_bit_masks():
    """An int64 ``WHERE`` in scalar code renders as ``zyx__seli64`` (GCC had made a branch of the ternary that picks
    a max pooling window's first maximal tap: mispredicted at random taps); in a vectorized loop (an argmax's long
    row) it stays a ternary, which GCC turns into a blend. Values are PyTorch's either way, ties and NaN included."""
    torch = pytest.importorskip("torch")
    from zyx.nn import functional as F

    rng = np.random.default_rng(9)
    x = rng.integers(-3, 3, (2, 3, 12, 12)).astype(np.float32)  # ties inside most windows
    x[0, 1, 4, 5] = np.nan
    X = zyx.Tensor(x, requires_grad=True)

    def pool_grad():
        X.grad = None
        F.max_pool2d(X, 3, 2, 1).sum().backward()
        return X.grad.numpy()

    def body(k: Kernel) -> str:  # without the prelude, which defines the helpers
        src = CRenderer().render(opt.optimize(k, HOST2))
        return src[src.rindex(f"void {k.name}("):]

    first = [k for k in _kernels(pool_grad) if k.name.endswith("_int64")]
    assert first and all("zyx__seli64(" in body(k) for k in first)
    tx = torch.tensor(x, requires_grad=True)
    torch.nn.functional.max_pool2d(tx, 3, 2, 1).sum().backward()
    np.testing.assert_array_equal(pool_grad(), tx.grad.numpy())

    rows = rng.integers(0, 4, (64, 1024)).astype(np.float32)
    (k,) = _kernels(lambda: zyx.Tensor(rows).argmax(-1).numpy())
    assert "zyx__seli64(" not in body(k) and " ? r" in body(k)
    np.testing.assert_array_equal(zyx.Tensor(rows).argmax(-1).numpy(), torch.tensor(rows).argmax(-1).numpy())


def _post_order(roots: list[ir.Expr]) -> list[ir.Expr]:
    """The reference order: a recursive depth-first post-order, each node's sources (then a reduce's ranges) left
    to right, every node once."""
    out: list[ir.Expr] = []
    seen: set[int] = set()

    def visit(e: ir.Expr) -> None:
        if id(e) in seen:
            return
        seen.add(id(e))
        for s in (*e.srcs, *(e.arg[1] if e.op is Ops.REDUCE else ())):
            visit(s)
        out.append(e)

    for r in roots:
        visit(r)
    return out


def test_toposort_is_the_recursive_post_order():
    """``ir.toposort`` (iterative) lists the nodes a recursive post-order lists, in the same order (passes that take
    the first or the last match depend on it): on a sorting network's kernels (deep, much shared), a softmax's and
    a column sum's."""
    x = np.random.default_rng(3).standard_normal((3, 200))
    X = zyx.Tensor(x).realize()
    ks = _kernels(lambda: [X.topk(5).values.numpy(), (X.exp() / X.exp().sum(1, keepdim=True)).numpy(),
                           X.sum(0).numpy()])
    assert len(ks) >= 3
    for k in ks:
        roots = opt._all_roots(k)
        assert [id(e) for e in ir.toposort(roots)] == [id(e) for e in utils.deep_call(_post_order, roots)]


def test_a_kernels_reduces_are_listed_once():
    """``Kernel.reduces`` lists the reduces once per kernel (the passes ask for them again and again); a kernel
    rebuilt with other stores lists its own."""
    X = zyx.Tensor(np.ones((16, 24), np.float32)).realize()
    (k,) = _kernels(lambda: X.softmax(1).numpy())
    reds = k.reduces()
    assert reds is k.reduces() and len(reds) == 2
    assert reds == tuple(e for e in ir.toposort([s.value for s in k.stores]) if e.op is Ops.REDUCE)
    plain = replace(k, stores=tuple(Store(s.param, s.index, ir.const(1.0, s.value.dtype)) for s in k.stores))
    assert plain.reduces() == ()

"""Named regression tests: programs that once hung, folded to a wrong value or cost too much, with NumPy's answers.

Each program runs under a wall-clock guard, so a scheduler that spins again fails here in seconds instead of
stalling the suite.
"""

from __future__ import annotations

import re
import signal
import warnings
from contextlib import contextmanager

import numpy as np
import pytest
from conftest import kernels_of

import zyx
from zyx import debug, dtypes
from zyx.kernel import ir
from zyx.ops import Ops


@contextmanager
def finishes_within(seconds: int):
    def fail(signum, frame):
        raise TimeoutError(f"did not finish within {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# ---- issue 9: the five programs -------------------------------------------------------------------------------


def test_reduce_of_an_expanded_product_schedules(device):
    with finishes_within(30):
        got = (zyx.Tensor(np.ones((1, 4, 1), np.float32), device=device) *
               zyx.Tensor(np.ones((4, 2), np.float32), device=device)).expand(3, 4, 2).sum(1).numpy()
    np.testing.assert_array_equal(got, np.full((3, 2), 4.0, np.float32))


def test_integer_matmul_with_an_expanded_operand_schedules(device):
    with finishes_within(30):
        got = (zyx.Tensor(np.ones((1, 64), np.int32), device=device).expand(128, 64) @
               zyx.Tensor(np.ones((64, 32), np.int32), device=device)).numpy()
    np.testing.assert_array_equal(got, np.full((128, 32), 64, np.int32))


def test_int8_overflow_is_not_folded_away_in_a_comparison(device):
    with finishes_within(30):
        got = (zyx.arange(100, dtype=zyx.int8, device=device) + 100 > 0).numpy().sum()
    want = (np.arange(100, dtype=np.int8) + np.int8(100) > 0).sum()
    assert got == want == 28


def test_int8_floor_division_after_overflow(device):
    with finishes_within(30):
        got = ((zyx.arange(100, dtype=zyx.int8, device=device) + 100) // 3).numpy()
    np.testing.assert_array_equal(got, (np.arange(100, dtype=np.int8) + np.int8(100)) // np.int8(3))


def test_int32_overflow_is_not_folded_away_in_a_comparison(device):
    with finishes_within(30):
        got = ((zyx.arange(10, dtype=zyx.int32, device=device) + (2**31 - 5)) > 0).numpy()
    np.testing.assert_array_equal(got, (np.arange(10, dtype=np.int32) + np.int32(2**31 - 5)) > 0)
    assert got.tolist() == [True] * 5 + [False] * 5


def test_fusion_planning_takes_few_rounds(monkeypatch):
    from zyx.graph import fuse, schedule

    calls = []
    real = fuse.recompute_factors
    monkeypatch.setattr(fuse, "recompute_factors", lambda k, *a: calls.append(k.name) or real(k, *a))
    schedule.clear_cache()
    x = zyx.Tensor(np.ones((1, 4, 1), np.float32)) * zyx.Tensor(np.ones((4, 2), np.float32))
    debug.schedule(x.expand(3, 4, 2).sum(1), zyx.Tensor(np.ones((1, 64), np.int32)).expand(128, 64) @
                   zyx.Tensor(np.ones((64, 32), np.int32)))
    assert 0 < len(calls) <= 8, calls  # one check per kernel per round; a reduce its own kernel stores ends it


def test_a_reduce_of_an_expanded_value_runs_once_per_distinct_value(monkeypatch):
    from zyx import utils
    from zyx.graph import schedule

    monkeypatch.setattr(utils, "KERNEL_LOG", [])
    schedule.clear_cache()
    a = np.random.default_rng(0).random((1, 64, 8), dtype=np.float32)
    x = zyx.Tensor(a)
    y = x.expand(256, 64, 8).sum(1)  # every one of the 256 rows is the same 8 sums
    debug.schedule(y)
    with_reduce = [k for k in utils.KERNEL_LOG if k.reduces()]
    assert [k.size for k in with_reduce] == [8]  # 8 sums of 64, not 256 * 8
    np.testing.assert_allclose(y.numpy(), np.broadcast_to(a.sum(1), (256, 8)), rtol=1e-5)
    assert debug.schedule(x.expand(256, 64, 8).max(0)) == []  # max over copies: no work at all
    np.testing.assert_array_equal(x.expand(256, 64, 8).max(0).numpy(), a[0])


def test_group_norm_computes_each_group_statistic_once(monkeypatch):
    """A group's mean and variance reach the per-element loops through a division of their flat (channel, h, w)
    index: every loop seems to matter, so the fusion's recompute estimate saw no recomputation and inlined both
    reduces into the output kernel, one 6272-element sum per output element (16x64x56^2 in 8 groups: 1.8 s, torch
    0.7 ms). The estimate now bounds the distinct values by the reduce's own size: one reduce kernel of one mean and
    one variance per group (the mean summed once), and an elementwise kernel whose loops merge and split at the group
    (no division left)."""
    from zyx import utils
    from zyx.graph import schedule
    from zyx.kernel import opt
    from zyx.kernel.target import DeviceInfo

    monkeypatch.setattr(utils, "KERNEL_LOG", [])
    schedule.clear_cache()
    x = np.random.default_rng(0).standard_normal((2, 8, 6, 6)).astype(np.float32)
    y = zyx.nn.functional.group_norm(zyx.Tensor(x), 4)
    with finishes_within(60):
        debug.schedule(y)
    reducing = [k for k in utils.KERNEL_LOG if k.reduces()]
    assert [k.size for k in reducing] == [2 * 4] and len(reducing[0].reduces()) == 2
    (elementwise,) = [k for k in utils.KERNEL_LOG if not k.reduces()]
    ko = opt.optimize(elementwise, DeviceInfo("host", "host", compute_units=2))
    assert not any(e.op in (Ops.DIV, Ops.MOD) for e in ir.toposort(opt._all_roots(ko)))
    g = x.reshape(2, 4, -1).astype(np.float64)
    want = ((g - g.mean(-1, keepdims=True)) / np.sqrt(g.var(-1, keepdims=True) + 1e-5)).reshape(x.shape)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)


def test_a_whole_tensor_variance_splits_both_sums_across_threads(monkeypatch):
    """``x.std()``: the mean nested in the sum of squares made one kernel without output loops, which runs one
    thread (only a lone reduce splits): 10.6 ms for 4096^2 (torch 5.4). The mean is stored, and both sums split."""
    from zyx import utils
    from zyx.graph import schedule
    from zyx.kernel import opt
    from zyx.kernel.target import DeviceInfo

    monkeypatch.setattr(utils, "KERNEL_LOG", [])
    schedule.clear_cache()
    x = np.random.default_rng(1).standard_normal((256, 512)).astype(np.float32) + 3.0
    y = zyx.Tensor(x).std()
    debug.schedule(y)
    kernels = [opt.optimize(k, DeviceInfo("host", "host", compute_units=2)) for k in utils.KERNEL_LOG]
    assert len(kernels) == 2 and all(k.split_reduce for k in kernels)
    np.testing.assert_allclose(y.numpy(), x.astype(np.float64).std(), rtol=1e-5)
    assert len(kernels_of(zyx.Tensor(x[:8, :8]).std())) == 1  # a small one stays one kernel


def test_a_mean_of_row_reductions_runs_its_rows_in_parallel(monkeypatch):
    """A mean cross-entropy nests each row's max and log-sum-exp in the mean over rows, in one kernel without
    output loops: one thread (1.85 ms for 4096x1000, torch 1.18). The row reduces are stored (kernels over the
    rows, in parallel) and the mean sums their values: 1.03 ms."""
    from zyx import utils
    from zyx.graph import schedule
    from zyx.kernel import opt
    from zyx.kernel.target import DeviceInfo

    monkeypatch.setattr(utils, "KERNEL_LOG", [])
    schedule.clear_cache()
    rng = np.random.default_rng(2)
    x = rng.standard_normal((256, 200)).astype(np.float32)
    t = rng.integers(0, 200, 256)
    y = zyx.nn.functional.cross_entropy(zyx.Tensor(x), zyx.Tensor(t))
    debug.schedule(y)
    kernels = [opt.optimize(k, DeviceInfo("host", "host", compute_units=2)) for k in utils.KERNEL_LOG]
    *rows, last = kernels
    assert rows and all(k.parallel for k in rows)
    nested = [e for r in last.reduces() for e in ir.toposort([r.srcs[0]]) if e.op is Ops.REDUCE]
    assert nested == []  # the mean (and the count of valid targets beside it) sums values loaded per row
    xd = x.astype(np.float64)
    lse = np.log(np.exp(xd - xd.max(1, keepdims=True)).sum(1)) + xd.max(1)
    np.testing.assert_allclose(y.numpy(), (lse - xd[np.arange(256), t]).mean(), rtol=1e-5)


# ---- integer bounds in the kernel IR --------------------------------------------------------------------------


@pytest.mark.parametrize("d", [dtypes.int8, dtypes.uint8, dtypes.int16, dtypes.int32, dtypes.int64])
def test_bounds_that_may_wrap_cover_the_whole_range(d):
    lo, hi = dtypes.int_range(d)
    x = ir.cast(ir.range_(0, 100), d)
    assert (x.vmin, x.vmax) == (0, 99)
    wide = ir.add(x, ir.const(hi - 50, d))  # may exceed the range: nothing is known
    assert (wide.vmin, wide.vmax) == (lo, hi)
    assert ir.alu(Ops.CMPLT, ir.const(0, d), wide).op is not Ops.CONST  # not decided from wrong bounds
    fits = ir.add(x, ir.const(hi - 99, d))  # provably no wrap: exact bounds, and decided comparisons
    assert (fits.vmin, fits.vmax) == (hi - 99, hi)
    assert ir.alu(Ops.CMPLE, ir.const(hi - 99, d), fits).arg is True


def test_integer_constants_wrap_in_their_dtype():
    assert ir.const(200, dtypes.int8).arg == -56 and ir.const(-1, dtypes.uint16).arg == 65535
    x = ir.cast(ir.range_(0, 10), dtypes.int8)
    s = ir.add(ir.add(x, ir.const(100, dtypes.int8)), ir.const(100, dtypes.int8))  # reassociated in the ring
    assert any(e.op is Ops.CONST and e.arg == -56 for e in ir.toposort([s]))


# ---- float -> integer casts: the defined conversion -----------------------------------------------------------


def test_float_to_int_casts_of_nan_inf_and_out_of_range(device):
    vals = np.array([np.nan, np.inf, -np.inf, 300.7, -300.7, 1e10, -1e10, 3e9, -1.5, 2.5e19, 1.5e19], np.float64)
    want = {
        "int8": [0, 0, 0, 44, -44, 0, 0, 0, -1, 0, 0],
        "uint8": [0, 0, 0, 44, 212, 0, 0, 0, 255, 0, 0],
        "int32": [-2**31] * 3 + [300, -300, -2**31, -2**31, -2**31, -1, -2**31, -2**31],
        "uint32": [0, 0, 0, 300, 2**32 - 300, 1410065408, 2884901888, 3000000000, 2**32 - 1, 0, 0],
        "int64": [-2**63] * 3 + [300, -300, 10**10, -10**10, 3 * 10**9, -1, -2**63, -2**63],
        "uint64": [2**63, 0, 2**63, 300, 2**64 - 300, 10**10, 2**64 - 10**10, 3 * 10**9, 2**64 - 1, 0,
                   15 * 10**18],
    }
    x = zyx.Tensor(vals, device=device)
    for name, w in want.items():
        got = x.cast(getattr(zyx, name))
        assert got.numpy().tolist() == w, name
        folded = zyx.full((len(vals),), 0.0, zyx.float64, device=device) + x  # not a constant: the kernel path
        assert folded.cast(getattr(zyx, name)).numpy().tolist() == w, name
    for v, w in zip(vals, want["int32"]):  # constant folding agrees with the kernels
        assert zyx.full((2,), float(v), zyx.float64, device=device).cast(zyx.int32).numpy().tolist() == [w, w]


# ---- cat / stack ------------------------------------------------------------------------------------------------


def test_cat_of_64_pieces_is_one_kernel_with_one_load_per_element():
    pieces = [zyx.Tensor(np.random.default_rng(i).standard_normal(1000).astype(np.float32)) for i in range(64)]
    y = zyx.cat(pieces)
    launches = debug.schedule(y)
    assert [x.kind for x in launches] == ["generated"]
    src = debug.kernel_source(y)[0]
    body = src[src.index("void "):]
    segments = body.split("\n  {\n")[1:]
    assert len(segments) == 64
    for seg in segments:
        reads = re.findall(r"= (p\d+)\[", seg)
        assert len(reads) == 1 and "?" not in seg  # one ungated load, no select, whatever the piece count
    np.testing.assert_array_equal(y.numpy(), np.concatenate([p.numpy() for p in pieces]))


def test_cat_and_stack_keep_every_bit(device):
    a = np.array([-0.0, 0.0, np.nan, -np.inf], np.float32)
    b = np.array([[-0.0, 1.0], [0.0, -0.0]], np.float32)
    x, y = zyx.Tensor(a, device=device), zyx.Tensor(b, device=device)
    got = zyx.cat([x, x[::-1], x], 0).numpy()
    want = np.concatenate([a, a[::-1], a])
    assert got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    assert np.signbit(zyx.stack([x, x], 1).numpy()).tolist() == np.signbit(np.stack([a, a], 1)).tolist()
    assert np.signbit(zyx.cat([y, y], 1).numpy()).tolist() == np.signbit(np.concatenate([b, b], 1)).tolist()
    bools = zyx.cat([x > 0, x.isnan()]).numpy()
    assert bools.tolist() == np.concatenate([a > 0, np.isnan(a)]).tolist()


def test_gated_load_under_its_own_condition_is_the_load():
    r = ir.range_(0, 10)
    g = ir.alu(Ops.CMPLT, r, ir.const(5, ir.index_dtype))
    ld = ir.load(1, dtypes.float32, r, g)
    assert ir.where(g, ld, ir.const(0.0, dtypes.float32)) is ld
    assert ir.where(g, ld, ir.const(-0.0, dtypes.float32)) is not ld  # -0.0 is not what a false gate yields


# ---- cumsum / cumprod as a scan ---------------------------------------------------------------------------------


def test_cumsum_of_a_million_is_a_few_linear_kernels(device):
    a = np.random.default_rng(0).random((1, 1_000_000), dtype=np.float32)
    y = zyx.Tensor(a, device=device).cumsum(1)
    assert len(debug.schedule(y)) <= 4
    ref = np.cumsum(a.astype(np.float64), 1)
    assert np.abs(y.numpy() - ref).max() <= 2e-6 * ref[0, -1]  # NumPy's own float32 cumsum: ~1e-5


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int32", "bool", "float16", "float64"])
def test_cumsum_and_cumprod_match_numpy(device, dtype):
    rng = np.random.default_rng(3)
    a = (rng.integers(0, 2, (3, 2500)) if dtype == "bool" else rng.integers(-100, 100, (3, 2500))).astype(dtype)
    x = zyx.Tensor(a, device=device)
    for axis in (0, 1, -1):
        got, want = x.cumsum(axis).numpy(), np.cumsum(a, axis)
        assert got.dtype == want.dtype, (got.dtype, want.dtype)
        if dtype == "float16":  # accumulates in float32 (as reductions do): at least as close as NumPy's
            exact = np.cumsum(a.astype(np.float64), axis)
            assert np.abs(got - exact).max() <= np.abs(want.astype(np.float64) - exact).max()
        else:
            np.testing.assert_array_equal(got, want)
    small = a[:, :7]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = np.cumprod(small, 1)
    got = zyx.Tensor(small, device=device).cumprod(1).numpy()
    if dtype == "float16":
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-2)
    else:
        np.testing.assert_array_equal(got, want)


def test_cumsum_gradient_is_a_reverse_running_sum():
    x = zyx.Tensor(np.arange(1.0, 6.0, dtype=np.float32), requires_grad=True)
    w = zyx.Tensor(np.array([1.0, 2.0, 3.0, 4.0, 5.0], np.float32))
    (x.cumsum(0) * w).sum().backward()
    assert x.grad.numpy().tolist() == [15.0, 14.0, 12.0, 9.0, 5.0]
    x = zyx.Tensor(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=True)
    x.cumprod(0).sum().backward()  # d/dx of x0 + x0 x1 + x0 x1 x2
    assert x.grad.numpy().tolist() == [1 + 2 + 6, 1 + 3, 2]


def test_elementwise_float_arithmetic_rounds_every_operation_as_numpy(device):
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(4096).astype(np.float32) for _ in range(3))
    x, y, z = (zyx.Tensor(v, device=device) for v in (a, b, c))
    np.testing.assert_array_equal((x * y + z).numpy(), a * b + c)  # no fused multiply-add contraction
    v = zyx.Tensor(np.full((108,), -27, np.int64), device=device).mean()
    assert ((0.0 - v) + v).item() == 0.0


def test_logical_ops_with_a_scalar_beyond_int64(device):
    x = zyx.Tensor(np.array([0, 5], np.uint64), device=device)
    assert x.logical_or(2**63).numpy().tolist() == [True, True]
    assert x.logical_and(2**64 - 1).numpy().tolist() == [False, True]
    assert x.logical_xor(0.0).numpy().tolist() == [False, True]


def test_weak_float_scalars_round_to_the_tensor_dtype(device):
    # fuzz: float16(-32768) - (-32767) is 0 in NumPy: the scalar becomes float16(-32768) first
    x = zyx.Tensor(np.zeros((2, 3), np.float16), device=device) + (-32768)
    np.testing.assert_array_equal((x - (-32767)).numpy(), np.zeros((2, 3), np.float16))
    y = zyx.Tensor(np.ones(3, np.float32), device=device)
    np.testing.assert_array_equal((y * 0.1).numpy(), np.ones(3, np.float32) * 0.1)


# ---- bugs the fuzzer found (tests/test_fuzz.py), one test each --------------------------------------------------


def test_fuzz_f1_zero_and_negative_zero_are_different_constants(device):
    x = zyx.Tensor(np.array([1.0, 2.0], np.float32), device=device)
    assert np.signbit((x * 0.0).numpy()).tolist() == [False, False]
    assert np.signbit((x * -0.0).numpy()).tolist() == [True, True]
    assert np.signbit(zyx.full((2,), -0.0, device=device).numpy()).tolist() == [True, True]
    z = zyx.Tensor(np.zeros(2, np.float32), device=device)
    assert np.signbit((-0.0 - z).numpy()).tolist() == [True, True]


def test_fuzz_f3_realize_a_view_or_reduce_with_an_op_on_it(device):
    x = zyx.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), device=device)
    a = x.reshape(6)
    b = a.tanh()
    zyx.realize(a, b)
    np.testing.assert_allclose(b.numpy(), np.tanh(np.arange(6, dtype=np.float32)), rtol=1e-6)
    m = zyx.Tensor(np.array([[1.0, 0.0]], np.float32), device=device).max(0)
    e = m.exp()
    zyx.realize(m, e)
    assert m.numpy().tolist() == [1.0, 0.0]
    np.testing.assert_allclose(e.numpy(), [np.e, 1.0], rtol=1e-6)


def test_fuzz_f4_negation_of_a_negative_constant(device):
    assert (-zyx.full((2,), -2, dtype=zyx.int16, device=device)).numpy().tolist() == [2, 2]
    assert (-zyx.full((2,), -129.5, dtype=zyx.float16, device=device)).numpy().tolist() == [129.5, 129.5]


def test_fuzz_f5_f7_signed_zeros_of_float_remainder_and_floor_division(device):
    a = np.array([-2.0, 3.0, -0.0, 0.0, 5.0, -7.0, 4.0], np.float32)
    b = np.array([1.0, -1.0, 3.0, -3.0, np.inf, -np.inf, 2.0], np.float32)
    x, y = zyx.Tensor(a, device=device), zyx.Tensor(b, device=device)
    with np.errstate(all="ignore"):
        for got, want in (((x % y).numpy(), a % b), ((x // y).numpy(), a // b)):
            np.testing.assert_array_equal(got, want)
            assert np.signbit(got).tolist() == np.signbit(want).tolist()


def test_fuzz_half_floor_division_and_remainder_round_once(device):
    import ml_dtypes

    for dt, s in ((ml_dtypes.bfloat16, -2.0829148276588544e16), (np.float16, -3.3)):
        a = np.array([1.8446744073709552e19 if dt is ml_dtypes.bfloat16 else 6e4, 7.5, -7.5, 1e4]).astype(dt)
        x = zyx.Tensor(a, device=device)
        with np.errstate(all="ignore"):
            np.testing.assert_array_equal((x // s).numpy(), a // dt(s))  # bf16: -888, not -884
            np.testing.assert_array_equal((x % s).numpy(), a % dt(s))


def test_fuzz_padding_an_empty_reshaped_tensor(device):
    x = zyx.Tensor(np.ones((1, 4, 6), np.float16), device=device).repeat(1, 0, 0, 0)  # shape (1, 0, 0, 0)
    y = x.pad(((0, 0), (0, 1), (0, 1), (0, 1)), value=3.0)
    np.testing.assert_array_equal(y.numpy(), np.full((1, 1, 1, 1), 3.0, np.float16))
    z = zyx.Tensor(np.ones((0, 3), np.float32), device=device).reshape(3, 0).pad(((1, 0), (0, 2)), value=-1.0)
    np.testing.assert_array_equal(z.numpy(), np.full((4, 2), -1.0, np.float32))


def test_fuzz_a_kernel_never_loads_a_reshape_of_its_own_output(device):
    """Found by a random run (seed 171203, cuda:0; the host had it too): realized together, an output ``v5``
    whose kernel was merged with ``v1``'s (same shape, and v5 reads v1) loaded ``v2 = v1.flatten()``, which
    shares v1's buffer, before the kernel wrote v1: the int8 sum read stale memory (4 or -4 instead of 0)."""
    v1 = -zyx.full((), 0, dtype=zyx.int8, device=device)
    v2 = v1.flatten()
    v4 = (v2 + v2) + (v2 + v2)
    v5 = v4.sum()
    zyx.realize(v1, v2, v4, v5)
    assert int(v5.numpy()) == 0 and v2.numpy().tolist() == [0]
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    x = zyx.Tensor(a, device=device) * 2  # stored, then read through its reshape by a kernel of x's shape
    y = x.reshape(6)
    z = (y * 3 + 1).reshape(2, 3)
    zyx.realize(x, y, z)
    np.testing.assert_array_equal(z.numpy(), a * 6 + 1)
    np.testing.assert_array_equal(y.numpy(), (a * 2).reshape(6))


def test_fuzz_a_merged_kernel_runs_after_the_kernels_it_waits_for(device):
    """Found by the gradient fuzzer under jit (emulated cuda:0): a loss and the gradients of its inputs realized
    together. Fusion merged ``x - mean(x)`` with ``x``'s gradient (which reads it) into one kernel; the loss, which
    reads ``x - mean(x)``, sat between the two in the graph's order, and its depth was taken before the merged
    kernel's was settled: the loss ran first and read the difference before it was written (NaN on the emulator).
    Every step of a plan now reads only leaves and what earlier steps wrote, or planning raises."""
    x = zyx.Tensor(np.array([1.0, 3.0]), device=device, requires_grad=True)
    b = zyx.Tensor(np.array(1.0), device=device, requires_grad=True)
    zyx.realize(x, b)
    v = x.var(None, keepdim=False)
    u = v + b
    u2 = u + u
    u4 = u2 + u2
    u8 = u4 + u4
    terms = [(t * zyx.Tensor(np.array(c), device=device)).sum()
             for t, c in zip((v, u, u2, u4, u8), (0.5, 0.25, -0.25, -0.75, -0.5))]
    loss = terms[0] + terms[1] + terms[2] + terms[3] + terms[4]
    loss.backward()
    zyx.realize(loss, x.grad, b.grad)  # planning checks the order (schedule._check_order)
    # v = 1, u = 2; dloss/du = 0.25 - 0.5 - 3 - 4 = -7.25, dloss/dv = 0.5 + dloss/du; dv/dx = x - mean
    np.testing.assert_allclose(loss.numpy(), 0.5 + 2 * -7.25)
    np.testing.assert_allclose(b.grad.numpy(), -7.25)
    np.testing.assert_allclose(x.grad.numpy(), [6.75, -6.75])


# ---- NumPy names ------------------------------------------------------------------------------------------------


def test_keepdims_on_every_reduction(device):
    a = np.random.default_rng(1).standard_normal((3, 4, 5)).astype(np.float32)
    x = zyx.Tensor(a, device=device)
    for name in ("sum", "prod", "max", "min", "mean", "var", "std", "any", "all", "argmax", "argmin", "logsumexp"):
        fn = getattr(x, name)
        assert fn(axis=1, keepdims=True).shape == (3, 1, 5), name
        assert fn(axis=1, keepdims=False).shape == (3, 5), name
        assert fn(1, keepdim=True).shape == (3, 1, 5), name
    np.testing.assert_allclose(x.sum(axis=(0, 2), keepdims=True).numpy(), a.sum(axis=(0, 2), keepdims=True),
                               rtol=1e-5)


def test_python_scalars_of_one_element_tensors(device):
    t = zyx.Tensor(np.array([[2.75]], np.float32), device=device)
    assert float(t) == 2.75 and int(t) == 2 and bool(t) is True
    assert int(zyx.Tensor(np.array(-3.9), device=device)) == -3
    assert [10, 20, 30][zyx.Tensor(np.array(1), device=device)] == 20
    with pytest.raises(ValueError, match=r"float\(\) needs a tensor with one element.*\(2,\)"):
        float(zyx.Tensor(np.ones(2, np.float32), device=device))
    with pytest.raises(ValueError, match="ambiguous"):
        bool(zyx.Tensor(np.ones(2, np.float32), device=device))
    with pytest.raises(TypeError, match="integer tensors"):
        [1, 2][zyx.Tensor(np.array(1.0), device=device)]


def test_a_deep_chain_of_reduces_plans_in_linear_time(device):
    """Transformer layers on the generated path (no BLAS / cuDNN alternative): matmuls feeding matmuls, each layer
    reading its input several times. Fusion used to lower every path through the chain at its own index before
    finding that the reduces must be stored: here 1.3 s for two layers, 10 s for three, and MiniLM's six did not
    plan in hours. A reduce that an enclosing reduce would recompute is now found while lowering (and stored)."""
    from conftest import host_without_blas

    def layer_norm(t, mean, sqrt):
        m = mean(t)
        return (t - m) / sqrt(mean((t - m) ** 2) + 1e-5)

    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((2, 8, 8)).astype(np.float32)
    layers = [[rng.standard_normal(s).astype(np.float32) / 3 for s in [(8, 8)] * 4 + [(8, 16), (16, 8)]]
              for _ in range(5)]
    want = x_np.astype(np.float64)
    for wq, wk, wv, wo, w1, w2 in layers:
        mean = lambda t: t.mean(-1, keepdims=True)  # noqa: E731
        s = (want @ wq) @ (want @ wk).transpose(0, 2, 1) * 0.3
        e = np.exp(s - s.max(-1, keepdims=True))
        want = layer_norm((e / e.sum(-1, keepdims=True)) @ (want @ wv) @ wo + want, mean, np.sqrt)
        want = layer_norm(np.maximum(want @ w1, 0) @ w2 + want, mean, np.sqrt)
    with host_without_blas(), finishes_within(60):
        h = zyx.Tensor(x_np, device=device)
        for ws in layers:
            wq, wk, wv, wo, w1, w2 = (zyx.Tensor(w, device=device) for w in ws)
            mean = lambda t: t.mean(-1, keepdim=True)  # noqa: E731
            a = (h @ wq @ (h @ wk).transpose(-1, -2) * 0.3).softmax(-1) @ (h @ wv)
            h = layer_norm(a @ wo + h, mean, lambda t: t.sqrt())
            h = layer_norm((h @ w1).relu() @ w2 + h, mean, lambda t: t.sqrt())
        got = h.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", ["int32", "int64"])
def test_signed_overflow_wraps_as_numpy(device, dtype):
    """Every signed op that can overflow wraps (C leaves it undefined; NVRTC and g++ without -fwrapv fold it)."""
    info = np.iinfo(dtype)
    a = np.array([info.max - 4, info.min + 3, 7, info.max // 2 + 1], dtype)
    x = zyx.Tensor(a, device=device)
    with np.errstate(over="ignore"):
        cases = {"x + 10 > 0": ((x + 10) > 0, (a + 10) > 0), "x * 3": (x * 3, a * 3), "-x": (-x, -a),
                 "x - 10": (x - 10, a - 10), "x.sum()": (x.sum(), a.sum()),
                 "x.prod()": (x.prod(), a.prod()), "x ** 3": (x ** 3, a ** 3)}
    for name, (got, want) in cases.items():
        np.testing.assert_array_equal(got.numpy(), want, err_msg=name)


def test_stored_stages_read_elsewhere_stay_separate_kernels(device):
    """A chain of stored stages, each reading the previous one at other elements (a bitonic sort's stages): fusion
    merged every stage into one kernel with the next, which then recomputed the previous stage at each element it
    read, so the work doubled per stage (a 16-element argsort took 115 s to plan). Each stage is its own kernel."""
    from conftest import kernels_of

    x_np = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    want = x_np.astype(np.float64)
    with finishes_within(60):
        x = zyx.Tensor(x_np, device=device)
        for i in range(16):
            x = (x.flip(-1) * 0.5 + x.roll(1, -1) * 0.25 + i).contiguous()
            want = np.flip(want, -1) * 0.5 + np.roll(want, 1, -1) * 0.25 + i
        if device == "host":
            assert len(kernels_of(x)) == 16
        got = x.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_a_float32_round_trip_of_float64_survives_gccs_slp_vectorizer():
    """Found by the gradient fuzzer (seed 20261206): the float64 sum of ``x.float().double()`` weighted, beside a sum
    reading ``x`` transposed, in one kernel, added two of the unrounded values: GCC 12.2 at -O3 -march=native
    vectorized the loop's last two lanes without the float32 pack and unpack (a loss off by 6e-8). Kernels that
    narrow float64 are compiled without SLP vectorization (``CRenderer.narrows_float64``)."""
    from zyx.kernel.render import CRenderer

    a = np.ones((3, 5))
    a[2, 3] = 0.6606165530365694  # not a float32: its round trip changes it
    rng = np.random.default_rng(0)
    w4, w5 = rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 5, 3))
    v2 = zyx.Tensor(a).broadcast_to((2, 3, 5)) * 2
    loss = ((v2 * 2).float().cast(zyx.float64) * zyx.Tensor(w4)).sum() + (v2.mT * zyx.Tensor(w5)).sum()
    sources = debug.kernel_source(loss)
    n2 = np.broadcast_to(a, (2, 3, 5)) * 2
    want = ((n2 * 2).astype(np.float32).astype(np.float64) * w4).sum() + (np.swapaxes(n2, -1, -2) * w5).sum()
    np.testing.assert_allclose(loss.item(), want, rtol=1e-13)
    assert any("ZYX_NO_SLP void" in src for src in sources)
    assert not CRenderer.narrows_float64(kernels_of(zyx.Tensor(a) * 2)[0])

"""Differential fuzzing: random zyx programs (small DAGs over the whole op set) against a NumPy reference.

Default (CI): a deterministic run of ``ZYX_FUZZ_EXAMPLES`` (default 300) programs per device (about 15 s with a
cold kernel cache). A long random run::

    ZYX_FUZZ_EXAMPLES=3000 ZYX_FUZZ_RANDOM=1 python -m pytest tests/test_fuzz.py -x

Beside the plain runs: the same programs with kernel search on (``ZYX_FUZZ_SEARCH_EXAMPLES``), as ``zyx.jit``
functions captured on other inputs and replayed (``ZYX_FUZZ_JIT_EXAMPLES``), and differentiable float64 programs
whose gradients are checked against finite differences (``fuzz_grads``, ``ZYX_FUZZ_GRAD_EXAMPLES``).

``ZYX_FUZZ_SEED=N`` fixes the seed of a random run, ``ZYX_FUZZ_TIMEOUT`` (seconds, default 20) bounds one program
(a hang becomes a failure with a reproducer), ``ZYX_FUZZ_AVOID=flag,...`` steers away from known bugs (see
``fuzz_programs.AVOID``), ``ZYX_FUZZ_STRICT_FMA=0`` compares float ``a*b+c`` with a tolerance instead of bit for
bit. A failure prints a standalone Python reproducer and the NumPy result.
"""

from __future__ import annotations

import contextlib
import os
import signal
import warnings

import fuzz_grads
import ml_dtypes
import numpy as np
import pytest
from fuzz_grads import grad_programs
from fuzz_programs import (
    TOL,
    Program,
    Val,
    _cumprod_scale,
    _prod_scale,
    _singular_scale,
    _square_scale,
    compare,
    cumsum_ref,
    programs,
    run_zyx,
    run_zyx_jit,
)
from hypothesis import HealthCheck, Phase, given, note, seed, settings

import zyx

EXAMPLES = int(os.environ.get("ZYX_FUZZ_EXAMPLES", "300"))
RANDOM = os.environ.get("ZYX_FUZZ_RANDOM", "") == "1" or "ZYX_FUZZ_SEED" in os.environ
TIMEOUT = int(os.environ.get("ZYX_FUZZ_TIMEOUT", "20"))

settings.register_profile(
    "zyx-fuzz",
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not RANDOM,
    database=None,
    print_blob=RANDOM,
    phases=(Phase.generate, Phase.target, Phase.shrink, Phase.explain) if RANDOM else (Phase.generate, Phase.shrink),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                           HealthCheck.large_base_example],
)


class FuzzTimeout(Exception):
    """A program ran (compiled, scheduled) longer than ``ZYX_FUZZ_TIMEOUT`` seconds."""


def _alarm(signum, frame):  # noqa: ARG001
    raise FuzzTimeout(f"timeout: the program did not finish within {TIMEOUT} s")


@contextlib.contextmanager
def _time_limit():
    """Raise :class:`FuzzTimeout` in the block after ``ZYX_FUZZ_TIMEOUT`` seconds."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(TIMEOUT)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _quietly(fn, *args):
    """``fn(*args)`` within ``ZYX_FUZZ_TIMEOUT``, RuntimeWarnings (NumPy's, zyx's) silenced."""
    with _time_limit(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return fn(*args)


def check_program(prog: Program, device: str) -> None:
    """Run ``prog`` on ``device`` and compare every output with the NumPy reference."""
    note("reproducer:\n" + prog.source(device))
    note("numpy reference:\n" + prog.expected_src())
    got = _quietly(run_zyx, prog, device)
    errors = []
    for i, g in zip(prog.outputs, got):
        msg = compare(np.asarray(g), prog.vals[i])
        if msg:
            errors.append(f"v{i}: {msg}")
    assert not errors, "zyx differs from NumPy:\n" + "\n".join(errors)


_seed = int(os.environ["ZYX_FUZZ_SEED"]) if "ZYX_FUZZ_SEED" in os.environ else None


def _fuzz_test(strategy, examples: int, *health_checks: HealthCheck):
    """The decorators of a fuzz test of ``prog`` drawn from ``strategy``: the fuzz profile with ``examples``
    programs (``health_checks`` suppressed too), the fixed seed of a random run, warnings that are expected."""
    profile = settings.get_profile("zyx-fuzz")

    def wrap(f):
        f = given(prog=strategy)(f)
        f = seed(_seed)(f) if _seed is not None else f
        f = settings(profile, max_examples=examples,
                     suppress_health_check=[*profile.suppress_health_check, *health_checks])(f)
        f = pytest.mark.filterwarnings("ignore:The recursion limit will not be reset")(f)
        return pytest.mark.filterwarnings("ignore::RuntimeWarning")(f)

    return wrap


@_fuzz_test(programs(), EXAMPLES)
def test_fuzz_programs(prog: Program, device: str) -> None:
    check_program(prog, device)


SEARCH_EXAMPLES = int(os.environ.get("ZYX_FUZZ_SEARCH_EXAMPLES", "40"))


@pytest.fixture
def search_on(monkeypatch, tmp_path):
    """Kernel search and measured extraction on, with private caches, so that programs run with pass parameters
    the heuristics never choose (and library-versus-generated decided by the clock)."""
    from zyx.backends import autotune
    from zyx.graph import measure, schedule

    monkeypatch.setattr(autotune, "CACHE_DIR", tmp_path / "autotune")
    monkeypatch.setattr(measure, "STORE", measure.MeasuredCosts(tmp_path / "measured.json"))
    autotune.clear_memory()
    schedule.clear_cache()
    with autotune.configured(True, budget_s=120, kernel_s=0.05):
        yield
    autotune.clear_memory()
    schedule.clear_cache()


@_fuzz_test(programs(), SEARCH_EXAMPLES, HealthCheck.function_scoped_fixture)
def test_fuzz_programs_with_search_on(prog: Program, device: str, search_on) -> None:
    """The fuzzer's programs with search on (``ZYX_FUZZ_SEARCH_EXAMPLES``, default 40, per device). A long random
    run with search on found an empty batched matmul that the measured extraction timed and the BLAS split
    divided by (its regression test: tests/graph/test_measured_costs.py)."""
    check_program(prog, device)


JIT_EXAMPLES = int(os.environ.get("ZYX_FUZZ_JIT_EXAMPLES", "60"))


@_fuzz_test(programs(), JIT_EXAMPLES)
def test_fuzz_programs_under_jit(prog: Program, device: str) -> None:
    """The fuzzer's programs as ``zyx.jit`` functions of their inputs (``ZYX_FUZZ_JIT_EXAMPLES``, default 60, per
    device): captured with the inputs' values in another order, then replayed twice on the real inputs; both
    replays must match the reference (a replay that reads a captured buffer instead of its argument fails)."""
    note("reproducer:\n" + prog.jit_source(device))
    note("numpy reference:\n" + prog.expected_src())
    runs = _quietly(run_zyx_jit, prog, device)
    errors = [f"replay {r + 1}, v{i}: {msg}" for r, got in enumerate(runs) for i, g in zip(prog.outputs, got)
              if (msg := compare(np.asarray(g), prog.vals[i]))]
    assert not errors, "zyx.jit differs from NumPy:\n" + "\n".join(errors)


GRAD_EXAMPLES = int(os.environ.get("ZYX_FUZZ_GRAD_EXAMPLES", "60"))


@_fuzz_test(grad_programs(), GRAD_EXAMPLES)
def test_fuzz_gradients(prog: Program, device: str) -> None:
    """Random differentiable float64 programs (``fuzz_grads``; ``ZYX_FUZZ_GRAD_EXAMPLES``, default 60, per device):
    the gradient of a weighted sum of the outputs against central differences of the NumPy reference."""
    _check_program_gradients(prog, device)


@_fuzz_test(grad_programs(dtype=zyx.float32), GRAD_EXAMPLES)
def test_fuzz_gradients_float32(prog: Program, device: str) -> None:
    """The gradient fuzzer in float32 (the kernels and library calls training runs in), against float64
    differences with float32's tolerance."""
    _check_program_gradients(prog, device)


def _check_program_gradients(prog: Program, device: str) -> None:
    weights = fuzz_grads.loss_weights(prog)
    note("reproducer:\n" + fuzz_grads.grad_source(prog, device, weights))
    if not weights:
        return
    loss, got = _quietly(fuzz_grads.run_zyx_grads, prog, device, weights)
    _check_gradients(prog, weights, [(loss, got)])


def _check_gradients(prog: Program, weights: dict, runs: list) -> None:
    want_loss = fuzz_grads.reference_loss(prog, weights, {})
    want = fuzz_grads.finite_differences(prog, weights)
    note("finite differences:\n" + "\n".join(f"v{i}: {g!r}" for i, g in want.items()))
    for k, (loss, got) in enumerate(runs):
        msg = fuzz_grads.compare_loss(prog, loss, want_loss)
        assert msg is None, f"run {k}: {msg}"
        errors = fuzz_grads.compare_grads(prog, got, want)
        assert not errors, f"run {k}: zyx's gradients differ from finite differences:\n" + "\n".join(errors)


@_fuzz_test(programs(), JIT_EXAMPLES // 2, HealthCheck.function_scoped_fixture)
def test_fuzz_programs_libraries_first(prog: Program, device: str, libraries_first) -> None:
    """The value fuzzer's programs with every matched library call taken (``ZYX_FUZZ_JIT_EXAMPLES`` / 2)."""
    check_program(prog, device)


@_fuzz_test(grad_programs(dtype=zyx.float32), JIT_EXAMPLES // 2, HealthCheck.function_scoped_fixture)
def test_fuzz_gradients_libraries_first(prog: Program, device: str, libraries_first) -> None:
    """The float32 gradient fuzzer with every matched library call taken (BLAS matmuls and attention on the host,
    the emulated GPU's cuDNN stand-in), forward and backward (``ZYX_FUZZ_JIT_EXAMPLES`` / 2)."""
    _check_program_gradients(prog, device)


@_fuzz_test(grad_programs(), JIT_EXAMPLES // 2)
def test_fuzz_gradients_under_jit(prog: Program, device: str) -> None:
    """The gradient fuzzer's programs with the forward, the loss and backward inside a ``zyx.jit`` function
    (``ZYX_FUZZ_JIT_EXAMPLES`` / 2 per device): captured on the inputs' values in another order, replayed twice on
    the real inputs; both replays' losses and gradients are checked."""
    weights = fuzz_grads.loss_weights(prog)
    note("reproducer (without jit):\n" + fuzz_grads.grad_source(prog, device, weights))
    if not weights:
        return
    runs = _quietly(fuzz_grads.run_zyx_grads_jit, prog, device, weights)
    _check_gradients(prog, weights, runs)


def test_var_error_scale_covers_the_sum_of_squares(device: str) -> None:
    """Found by a random run (seed 261203, cuda:0): float32 var of uint64 values near 2^64 is 1.9e37, but the sum
    of its 20 squared deviations, 3.9e38, overflows float32 (host and GPU sum these 20 in float32, as NumPy's
    float32 var does). The reference's error scale, mean(x^2) = 2.1e37, was below its overflow bound (FLT_MAX / 8)
    although the sum, 20 times that, is above it."""
    import zyx
    from zyx import dtypes

    x = np.zeros((2, 2, 5), np.uint64)
    x[0, 0, :2] = (2 ** 63, 2 ** 64 - 2)
    s = x.astype(np.float64)  # the generator's error scale of an integer input: its values
    scale = _square_scale(s, dtypes.float32, None, False, std=False)
    assert np.isinf(scale)
    assert float(_square_scale(s, dtypes.float64, None, False, std=False)) == pytest.approx(np.mean(s * s))
    want = np.var(s).astype(np.float32)
    got = zyx.Tensor(x, device=device).var().numpy()
    assert np.isinf(got) or abs(float(got) / float(want) - 1) < 1e-5
    assert compare(got, Val(np.asarray(want), np.abs(want) + scale, exact=False)) is None
    one = np.array([3.0, 4.0])  # mean(s^2) = 12.5, far from any bound: the scale itself
    assert float(_square_scale(one, dtypes.float32, None, False, std=True)) == pytest.approx(
        np.sqrt(12.5 / TOL[dtypes.float32]))


def test_log_of_a_value_of_unknown_sign_may_be_nan() -> None:
    """Found by a random run (seed 88888, host): log(16 * tan(2^62)). tan beyond 2^44 is meaningless (documented in
    zyx/kernel/c_math.py; zyx gives -1.83, NumPy 0.988), so its error bound exceeds its magnitude and log of it may
    be nan. An exact input, or one whose error bound is below its magnitude, keeps a finite scale."""
    from zyx import dtypes

    tol = TOL[dtypes.float32]
    v = Val(np.asarray(np.float32(15.8)), np.asarray(9.2e18), exact=False)
    scale = _singular_scale(np.asarray(2.76), np.asarray(9.2e18), v, tol)
    assert np.isinf(scale)
    assert compare(np.asarray(np.float32(np.nan)), Val(np.asarray(np.float32(2.76)), scale, exact=False)) is None
    near = _singular_scale(np.asarray(2.76), np.asarray(15.8), v, tol)  # error bound 1.2e-4 of 15.8
    assert np.isfinite(near) and float(near) == pytest.approx(2.76 + 1.0)
    exact = Val(np.asarray(np.float32(15.8)), np.asarray(9.2e18), exact=True)
    assert np.isfinite(_singular_scale(np.asarray(2.76), np.asarray(9.2e18), exact, tol))
    assert compare(np.asarray(np.float32(np.nan)), Val(np.asarray(np.float32(2.76)), near, exact=False)) is not None


def test_a_product_that_can_overflow_in_some_order_may_be_nan(device: str) -> None:
    """Found by a random run (seed 31203, search on, host): the bfloat16 prod of [2, 0, 0, 0, 3e38] is 0 in order,
    nan when vector lanes form 2 * 3e38 (inf in float32) first, as PyTorch's float32 prod does for the same pattern
    32 apart. The error scale is unbounded where some order overflows (or underflows next to large factors), and
    keeps the product of the scales elsewhere."""
    import zyx
    from zyx import dtypes

    x = np.array([2.0, 0.0, 0.0, 0.0, 3.00405527e38], dtype=ml_dtypes.bfloat16)
    s = np.abs(x.astype(np.float64))  # the generator's error scale of an exact input: its magnitudes
    scale = _prod_scale(s, dtypes.bfloat16, None, False)
    assert np.isinf(scale)
    got = zyx.Tensor(x, device=device).prod().numpy()
    assert compare(np.asarray(got), Val(np.asarray(np.zeros((), x.dtype)), scale, exact=False)) is None
    assert np.isfinite(_prod_scale(s, dtypes.float64, None, False))  # float64 holds 6e38
    ok = np.array([0.5, 3.0, 1e-3, 4.0])  # every order stays in range: the product of the scales
    assert float(_prod_scale(ok, dtypes.float32, None, False)) == pytest.approx(6e-3)
    assert np.isinf(_prod_scale(np.array([1e-30, 1e-30, 1e30]), dtypes.float32, None, False))  # 1e-60 first
    assert np.isfinite(_prod_scale(np.array([1e-30, 1e-30, 0.5]), dtypes.float32, None, False))  # all below 1


def test_std_of_values_whose_squares_underflow_may_be_zero(device: str) -> None:
    """Found by a random run (seed 141203, host): the bfloat16 std of 79 zeros and 3.0e-34 is 0, as NumPy's float32
    std: the squared deviation, 9e-68, is below float32's smallest subnormal. The error scale allows that absolute
    error (the square root of the smallest subnormal for std) and nothing more for values of ordinary size."""
    import zyx
    from zyx import dtypes

    x = np.zeros(80, ml_dtypes.bfloat16)
    x[-1] = 3.0e-34
    s = np.abs(x.astype(np.float64))
    want = np.asarray(np.std(s)).astype(ml_dtypes.bfloat16)  # 3.4e-35
    got = zyx.Tensor(x, device=device).std().numpy()
    assert float(got) == 0.0 or abs(float(got) / float(want) - 1) < 0.05
    assert compare(got, Val(want, _square_scale(s, dtypes.bfloat16, None, False, std=True), exact=False)) is None
    tiny = float(np.finfo(np.float32).smallest_subnormal)
    assert float(_square_scale(s, dtypes.bfloat16, None, False, std=False)) == pytest.approx(
        np.mean(s * s) + tiny / TOL[dtypes.bfloat16])
    ones = np.ones(4)  # ordinary values: the scale is mean(s^2) (plus nothing visible)
    assert float(_square_scale(ones, dtypes.float32, None, False, std=False)) == pytest.approx(1.0, rel=1e-12)


def test_products_through_subnormals_round_there(device: str) -> None:
    """Found by a random run (seed 211203, cuda:0): the float32 cumprod of [0.25, 1e-40, 300.7] passes through the
    subnormal 2.5e-41 (14 significant bits), so its last value is 7.517249e-39 where the float64 reference says
    7.51746e-39. The error scale of a product adds those roundings, scaled by the later factors; for values of
    ordinary size it is the running product of the scales."""
    import zyx
    from zyx import dtypes

    x = np.array([0.25, 1e-40, 300.7], np.float32)
    s = np.abs(x.astype(np.float64))
    got = zyx.Tensor(x, device=device).cumprod(0).numpy()
    want = cumsum_ref(x, 0, "cumprod")
    assert compare(got, Val(want, _cumprod_scale(s, dtypes.float32, 0), exact=False)) is None
    assert compare(np.array([0.25, 2.5e-41, 7.517249e-39], np.float32),
                   Val(want, cumsum_ref(s, 0, "cumprod"), exact=False)) is not None  # the old scale: too strict
    ordinary = np.array([2.0, 3.0, 4.0])
    np.testing.assert_allclose(_cumprod_scale(ordinary, dtypes.float32, 0), [2, 6, 24], rtol=1e-30)
    assert float(_prod_scale(ordinary, dtypes.float32, None, False)) == pytest.approx(24, rel=1e-30)

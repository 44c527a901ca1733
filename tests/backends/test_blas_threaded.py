"""The BLAS device's threaded runner (OpenMP threads each calling CBLAS single-threaded): every split gives
NumPy's product, and the calling thread's OpenBLAS thread count is left as it was."""

from __future__ import annotations

import numpy as np
import pytest

import zyx
from zyx.backends.blas import threaded
from zyx.backends.registry import registry


def _blas():
    devs = [d for d in registry().get("host").devices if type(d).__name__ == "BlasDevice"]
    if not devs or devs[0].backend != "cblas":
        pytest.skip("no CBLAS found next to NumPy")
    dev = devs[0]
    if dev._runner() is None:
        pytest.skip("no OpenMP compiler: the runner is not built")
    return dev


@pytest.mark.parametrize("shape", [
    ((300, 128), (128, 200)),      # rows split in blocks (above RUNNER_SINGLE_THREAD_FLOPS)
    ((8, 512), (512, 1100)),       # few rows: columns split
    ((4, 33, 17), (4, 17, 9)),     # batched, single-threaded by size
    ((6, 128, 96), (96, 128)),     # batched with a broadcast operand
    ((0, 5), (5, 4)),              # empty
])
def test_runner_products_equal_numpy(shape) -> None:
    _blas()
    rng = np.random.default_rng(3)
    a = rng.standard_normal(shape[0]).astype(np.float32)
    b = rng.standard_normal(shape[1]).astype(np.float32)
    got = (zyx.Tensor(a) @ zyx.Tensor(b)).numpy()
    np.testing.assert_allclose(got, a @ b, rtol=1e-5, atol=1e-4)
    got_t = (zyx.Tensor(b).mT @ zyx.Tensor(a).mT).numpy()  # transposed operands: the other layouts
    np.testing.assert_allclose(got_t, np.swapaxes(a @ b, -1, -2), rtol=1e-5, atol=1e-4)


def test_splits_cover_every_output_once() -> None:
    dev = _blas()
    runner = dev._runner()
    rng = np.random.default_rng(4)
    for m, n, along_n, blocks in ((37, 5, False, 4), (3, 41, True, 5), (64, 64, False, 64)):
        a = rng.standard_normal((m, 7)).astype(np.float32)
        b = rng.standard_normal((7, n)).astype(np.float32)
        c = np.full((m, n), np.nan, np.float32)
        off = threaded.batch_offsets((), 0, 0, (), (), ())
        runner.run(4, 2, False, False, m, n, 7, a.ctypes.data, 7, b.ctypes.data, n, c.ctypes.data, n, off, blocks,
                   along_n)
        np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-5)


def test_batch_offsets_follow_row_major_batch_order() -> None:
    off = threaded.batch_offsets((2, 3), 5, 7, (30, 10), (0, 4), (12, 4))
    assert off.shape == (6, 3) and off.dtype == np.int64
    assert off[:, 0].tolist() == [5, 15, 25, 35, 45, 55]
    assert off[:, 1].tolist() == [7, 11, 15, 7, 11, 15]
    assert off[:, 2].tolist() == [0, 4, 8, 12, 16, 20]


def _library(t: zyx.Tensor) -> list[str]:
    return [s.name for s in zyx.debug.schedule(t) if s.kind == "library"]


@pytest.mark.parametrize("x_shape,out", [
    ((300, 128), 200),     # rows split in blocks (above RUNNER_SINGLE_THREAD_FLOPS)
    ((8, 512), 1100),      # few rows: columns split, each block starts from its part of the bias
    ((4, 50, 64), 96),     # leading axes folded into rows
    ((2, 256), 300),       # two rows
])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_bias_is_added_inside_the_gemm(x_shape, out, dtype) -> None:
    """``x @ w.T + b`` is one GEMM starting from the bias row: no elementwise pass, NumPy's values."""
    _blas()
    from zyx.nn import functional as F

    rng = np.random.default_rng(4)
    x = rng.standard_normal(x_shape).astype(dtype)
    w = rng.standard_normal((out, x_shape[-1])).astype(dtype)
    b = rng.standard_normal(out).astype(dtype)
    y = F.linear(zyx.Tensor(x), zyx.Tensor(w), zyx.Tensor(b))
    launches = zyx.debug.schedule(y)
    assert [s.kind for s in launches] == ["library"] and "gemm_bias" in launches[0].name, launches
    # within rounding of the exact value, relative to the magnitudes summed (the summation order is the BLAS's:
    # beside NumPy's own float32 product, 2e-5 apart at -0.11 on an AMD EPYC)
    exact = x.astype(np.float64) @ w.T.astype(np.float64) + b
    bound = (1e-5 if dtype == np.float32 else 1e-12) * (np.abs(x) @ np.abs(w).T + np.abs(b))
    assert np.all(np.abs(y.numpy() - exact) <= bound)
    h = (zyx.Tensor(x) @ zyx.Tensor(w).T + zyx.Tensor(b)).relu()  # the bias add feeding a fused kernel
    assert np.all(np.abs(h.numpy() - np.maximum(exact, 0)) <= bound)


def test_adds_that_are_not_a_row_bias_stay_generated() -> None:
    """A column (m, 1) added, a full matrix added, or a bias of another dtype: the plain GEMM and an add."""
    _blas()
    rng = np.random.default_rng(5)
    a = rng.standard_normal((64, 32)).astype(np.float32)
    w = rng.standard_normal((32, 48)).astype(np.float32)
    for other in (rng.standard_normal((64, 1)), rng.standard_normal((64, 48)), rng.standard_normal(48)):
        o = other.astype(np.float64 if other.ndim == 1 else np.float32)
        y = zyx.Tensor(a) @ zyx.Tensor(w) + zyx.Tensor(o)
        assert not any("bias" in n for n in _library(y)), _library(y)
        np.testing.assert_allclose(y.numpy(), a @ w + o, rtol=1e-5, atol=1e-5)


def test_training_a_linear_layer_with_the_fused_bias_gives_numpys_gradients() -> None:
    _blas()
    rng = np.random.default_rng(6)
    x = rng.standard_normal((40, 24)).astype(np.float32)
    w = rng.standard_normal((16, 24)).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    W, B = zyx.Tensor(w, requires_grad=True), zyx.Tensor(b, requires_grad=True)
    y = zyx.Tensor(x) @ W.T + B
    (y * y).sum().backward()
    g = 2 * (x @ w.T + b)
    np.testing.assert_allclose(W.grad.numpy(), g.T @ x, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(B.grad.numpy(), g.sum(0), rtol=1e-4, atol=1e-3)

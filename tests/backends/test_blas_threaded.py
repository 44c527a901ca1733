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
    ((300, 64), (64, 200)),        # rows split in blocks
    ((8, 64), (64, 1000)),         # few rows: columns split
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

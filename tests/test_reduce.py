"""Reductions against NumPy: axes (int, tuple, None, negative), keepdim, dtypes, empty axes, NaN."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

import zyx

AXES = [None, 0, 1, -1, (0, 2), (1, 2), (0, 1, 2)]


@pytest.mark.parametrize("axis", AXES, ids=str)
@pytest.mark.parametrize("keepdim", [False, True])
@pytest.mark.parametrize("name", ["sum", "mean", "max", "min", "prod"])
def test_reductions(device, rng, name, axis, keepdim):
    a = rng.uniform(0.5, 1.5, size=(4, 5, 6)).astype(np.float32)
    x = zyx.Tensor(a, device=device)
    got = getattr(x, name)(axis, keepdim=keepdim)
    want = getattr(np, name)(a.astype(np.float64), axis=axis, keepdims=keepdim)
    assert_close(got, want, rtol=2e-6, atol=1e-6, dtype=np.float32)


@pytest.mark.parametrize("axis", [None, 0, 1, (0, 1)], ids=str)
@pytest.mark.parametrize("name", ["var", "std"])
@pytest.mark.parametrize("ddof", [0, 1])
def test_var_std(device, rng, name, axis, ddof):
    a = rng.standard_normal((7, 9)).astype(np.float32)
    got = getattr(zyx.Tensor(a, device=device), name)(axis, ddof=ddof)
    assert_close(got, getattr(np, name)(a.astype(np.float64), axis=axis, ddof=ddof), rtol=1e-5, atol=1e-6)


def test_correction_alias_and_dim_alias(device, rng):
    a = rng.standard_normal((3, 8)).astype(np.float32)
    x = zyx.Tensor(a, device=device)
    assert_close(x.var(dim=1, correction=1), a.var(axis=1, ddof=1), rtol=1e-5)
    assert_close(x.sum(dim=0), a.sum(axis=0), rtol=1e-6)


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint8", "int32", "int64", "uint32", "float16", "float64"])
def test_sum_dtypes_like_numpy(device, rng, dtype):
    a = rng.integers(0, 5, size=(6, 7)).astype(dtype)
    x = zyx.Tensor(a, device=device)
    want = a.sum(axis=1)
    assert_close(x.sum(1), want, dtype=want.dtype, rtol=1e-3)
    assert_close(x.max(0), a.max(0), dtype=a.dtype)
    assert_close(x.prod(1), a.prod(1), dtype=a.prod(1).dtype, rtol=1e-3)


@pytest.mark.parametrize("axis", [None, 0, 1, -1], ids=str)
@pytest.mark.parametrize("keepdim", [False, True])
def test_argmax_argmin(device, rng, axis, keepdim):
    a = rng.integers(0, 4, size=(5, 6)).astype(np.float32)  # ties: first occurrence wins
    x = zyx.Tensor(a, device=device)
    assert_close(x.argmax(axis, keepdim=keepdim), np.argmax(a, axis=axis, keepdims=keepdim), dtype=np.int64)
    assert_close(x.argmin(axis, keepdim=keepdim), np.argmin(a, axis=axis, keepdims=keepdim), dtype=np.int64)


def test_nan_propagation(device):
    a = np.array([[1.0, np.nan, 3.0], [4.0, 5.0, 6.0]], np.float32)
    x = zyx.Tensor(a, device=device)
    assert_close(x.max(1), a.max(1))
    assert_close(x.min(1), a.min(1))
    assert_close(x.sum(1), a.sum(1))
    assert_close(x.argmax(1), np.argmax(a, 1))
    assert_close(x.argmin(1), np.argmin(a, 1))
    i = np.array([[-np.inf, np.inf], [np.inf, np.inf]], np.float32)
    assert_close(zyx.Tensor(i, device=device).sum(1), i.sum(1))


def test_any_all(device, rng):
    a = rng.random((4, 5)) > 0.7
    x = zyx.Tensor(a, device=device)
    for axis in (None, 0, 1):
        assert_close(x.any(axis), a.any(axis=axis), dtype=bool)
        assert_close(x.all(axis), a.all(axis=axis), dtype=bool)
    f = zyx.Tensor(np.array([0.0, 0.5]), device=device)
    assert f.any().item() is True and f.all().item() is False


def test_empty_axes(device):
    e = np.zeros((3, 0), np.float32)
    x = zyx.Tensor(e, device=device)
    assert_close(x.sum(1), e.sum(1))
    assert_close(x.prod(1), e.prod(1))
    assert_close(x.any(1), e.any(1))
    assert_close(x.all(1), e.all(1))
    with pytest.raises(ValueError, match="empty axis"):
        x.max(1)
    with pytest.raises(ValueError, match="empty axis"):
        x.argmax(1)
    assert_close(zyx.Tensor(np.zeros((0, 4), np.float32), device=device).sum(1), np.zeros((0,), np.float32))


def test_zero_dim_reductions(device):
    x = zyx.Tensor(np.float32(2.5), device=device)
    assert x.sum().item() == 2.5
    assert x.max(0).item() == 2.5
    assert x.argmax().item() == 0


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_softmax_log_softmax_logsumexp(device, rng, axis):
    a = (rng.standard_normal((5, 7)) * 10).astype(np.float32)
    a[0, 0] = 80.0  # large values must not overflow
    x = zyx.Tensor(a, device=device)
    a64 = a.astype(np.float64)
    m = a64.max(axis, keepdims=True)
    lse = np.log(np.exp(a64 - m).sum(axis, keepdims=True)) + m
    assert_close(x.softmax(axis), np.exp(a64 - lse), rtol=1e-5, atol=1e-7)
    assert_close(x.log_softmax(axis), a64 - lse, rtol=1e-5, atol=1e-5)
    assert_close(x.logsumexp(axis), lse.squeeze(axis), rtol=1e-6)
    assert_close(zyx.Tensor(np.array([-np.inf, -np.inf]), device=device).logsumexp(0), -np.inf)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_cumsum(device, rng, axis):
    a = rng.standard_normal((4, 6)).astype(np.float32)
    assert_close(zyx.Tensor(a, device=device).cumsum(axis), np.cumsum(a, axis=axis), rtol=1e-5, atol=1e-6)
    ints = rng.integers(0, 9, size=(10,)).astype(np.int32)
    assert_close(zyx.Tensor(ints, device=device).cumsum(0), np.cumsum(ints), dtype=np.int64)


def test_reduce_non_contiguous(device, rng):
    a = rng.standard_normal((8, 6, 4)).astype(np.float32)
    x = zyx.Tensor(a, device=device)
    assert_close(x.permute(2, 0, 1).sum((0, 2)), a.transpose(2, 0, 1).sum((0, 2)), rtol=1e-5, atol=1e-5)
    assert_close(x[::2, ::-1].max(1), a[::2, ::-1].max(1))
    assert_close(x.reshape(6, 32).T.mean(0), a.reshape(6, 32).T.mean(0), rtol=1e-5, atol=1e-6)


def test_large_sum_accuracy(device, rng):
    a = rng.uniform(0, 1, size=(1 << 20,)).astype(np.float32)
    got = zyx.Tensor(a, device=device).sum().item()
    assert abs(got - a.astype(np.float64).sum()) / a.sum() < 1e-6

"""Selection by integer tensors: gather, take_along_dim / take_along_axis, index_select (values against NumPy and
PyTorch, gradients against PyTorch, fusion, jit, errors)."""

from __future__ import annotations

import numpy as np
import pytest

import zyx

torch = pytest.importorskip("torch")


def _grads_match(fz, ft, x: np.ndarray, device: str, seed: int = 0) -> None:
    """loss = sum(f(x) * w) with a random w: values and x's gradient agree with PyTorch's (float64)."""
    xz = zyx.Tensor(x, device=device, requires_grad=True)
    xt = torch.tensor(x, requires_grad=True)
    out_z, out_t = fz(xz), ft(xt)
    assert out_z.shape == tuple(out_t.shape)
    w = np.random.default_rng(seed).standard_normal(tuple(out_t.shape))
    (out_z * zyx.Tensor(w, device=device)).sum().backward()
    (out_t * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(out_z.numpy(), out_t.detach().numpy(), rtol=1e-12, atol=0)
    np.testing.assert_allclose(xz.grad.numpy(), xt.grad.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim, index_shape", [(0, (6, 4, 5)), (1, (3, 9, 5)), (2, (3, 4, 2)), (-1, (2, 3, 7)),
                                              (1, (1, 1, 1)), (0, (0, 4, 5))])
def test_gather_matches_torch(device, dim, index_shape):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 4, 5))
    n = x.shape[dim]
    idx = rng.integers(0, n, index_shape)  # repeats: their gradients add up
    _grads_match(lambda t: t.gather(dim, zyx.Tensor(idx, device=device)),
                 lambda t: torch.gather(t, dim, torch.tensor(idx)), x, device)
    assert zyx.gather(zyx.Tensor(x, device=device), dim, idx).shape == index_shape


def test_gather_of_a_computed_tensor_is_one_kernel(device):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 10)).astype(np.float32)
    idx = rng.integers(0, 10, (8, 3))
    y = (zyx.Tensor(x, device=device).exp() * 2).gather(1, idx).sum(1)
    assert [launch.kind for launch in zyx.debug.schedule(y) if launch.kind != "copy"] == ["generated"]  # uploads aside
    np.testing.assert_allclose(y.numpy(), np.take_along_axis(np.exp(x) * 2, idx, 1).sum(1), rtol=1e-5)


def test_gather_by_a_computed_index(device):
    """The index may itself be lazy (argmax here): its values are read inside the same kernel."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 9)).astype(np.float32)
    X = zyx.Tensor(x, device=device)
    picked = X.gather(1, X.argmax(1, keepdim=True))
    np.testing.assert_array_equal(picked.numpy(), x.max(1, keepdims=True))


@pytest.mark.parametrize("x_shape, idx_shape, axis", [((3, 4, 5), (3, 2, 5), 1), ((3, 4, 5), (1, 6, 1), 1),
                                                      ((1, 4, 5), (3, 4, 2), 2), ((3, 4, 5), (3, 4, 5), None),
                                                      ((3, 4, 5), (7,), None), ((5,), (5,), 0)])
def test_take_along_axis_matches_numpy(device, x_shape, idx_shape, axis):
    rng = np.random.default_rng(4)
    x = rng.standard_normal(x_shape).astype(np.float32)
    n = x.size if axis is None else x_shape[axis]
    idx = rng.integers(-n, n, idx_shape)  # negative indices count from the end, as in NumPy
    want = torch.take_along_dim(torch.tensor(x), torch.tensor(idx % n), axis).numpy()  # torch: no negatives
    np.testing.assert_array_equal(zyx.Tensor(x, device=device).take_along_dim(idx, axis).numpy(), want)
    if axis is not None or len(idx_shape) == 1:  # NumPy flattens only the tensor, and wants 1-D indices
        np.testing.assert_array_equal(np.take_along_axis(x, idx, axis), want)
        np.testing.assert_array_equal(zyx.take_along_axis(zyx.Tensor(x, device=device), idx, axis).numpy(), want)


def test_take_along_dim_gradient_matches_torch(device):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 4, 5))
    idx = rng.integers(0, 5, (3, 4, 2))  # x broadcast along dim 0: three copies add into its one row
    _grads_match(lambda t: t.take_along_dim(zyx.Tensor(idx, device=device), 2),
                 lambda t: torch.take_along_dim(t, torch.tensor(idx), 2), x, device)


def test_negative_indices_count_from_the_end_in_gradients_too(device):
    x = np.arange(12.0).reshape(3, 4)
    idx = np.array([[-1, 0], [-4, -4], [3, -2]])
    xz = zyx.Tensor(x, device=device, requires_grad=True)
    xz.gather(1, idx).sum().backward()
    want = np.zeros_like(x)
    np.add.at(want, (np.arange(3)[:, None], idx % 4), 1.0)
    np.testing.assert_array_equal(xz.grad.numpy(), want)


def test_index_select_matches_torch(device):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((4, 6, 3))
    idx = np.array([5, 0, 5, 2])
    _grads_match(lambda t: t.index_select(1, zyx.Tensor(idx, device=device)),
                 lambda t: torch.index_select(t, 1, torch.tensor(idx)), x, device)
    np.testing.assert_array_equal(zyx.index_select(zyx.Tensor(x, device=device), -1, [2, 2]).numpy(), x[..., [2, 2]])


def test_gather_under_jit_reads_each_calls_index(device):
    rng = np.random.default_rng(7)
    x = zyx.Tensor(rng.standard_normal((5, 8)).astype(np.float32), device=device).realize()

    @zyx.jit
    def pick(idx):
        return x.gather(1, idx) * 3

    replays = zyx.debug.stats()["jit_replays"]
    for _ in range(4):
        idx = rng.integers(0, 8, (5, 2))
        out = pick(zyx.Tensor(idx, device=device))
        np.testing.assert_allclose(out.numpy(), np.take_along_axis(x.numpy(), idx, 1) * 3, rtol=1e-6)
    assert zyx.debug.stats()["jit_replays"] - replays == 2  # call 1 runs, call 2 captures


def test_gather_errors_name_the_problem():
    x = zyx.Tensor(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"index of shape \(3,\) does not fit a tensor of shape \(3, 4\)"):
        x.gather(1, np.zeros(3, np.int64))
    with pytest.raises(ValueError, match=r"shape \(4, 1\) does not fit .* each but dim 1 no larger"):
        x.gather(1, np.zeros((4, 1), np.int64))
    with pytest.raises(IndexError, match="index 4 is out of bounds for axis 1 with size 4"):
        x.gather(1, np.array([[0], [4], [1]]))
    with pytest.raises(IndexError, match="must be integers, got float32"):
        x.gather(1, np.zeros((3, 1), np.float32))
    with pytest.raises(ValueError, match=r"shapes \(3, 4\) and \(2, 1\) do not broadcast off dim 1"):
        x.take_along_dim(np.zeros((2, 1), np.int64), 1)
    with pytest.raises(ValueError, match="need as many dimensions"):
        x.take_along_dim(np.zeros(2, np.int64), 1)
    with pytest.raises(ValueError, match=r"index must be 1-D, got shape \(1, 1\)"):
        x.index_select(0, np.zeros((1, 1), np.int64))
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        x.gather(2, np.zeros((3, 4), np.int64))

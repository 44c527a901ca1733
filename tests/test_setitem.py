"""``x[index] = value``: NumPy's results on every device, gradients through the value, rebinding semantics (earlier
readers keep the old value), zyx.jit, and the errors."""

from __future__ import annotations

import numpy as np
import pytest

import zyx

CASES = [  # (shape, index, value shape)
    ((4, 5), (slice(None), 0), (4,)),
    ((4, 5), 1, (5,)),
    ((4, 5), 1, ()),  # a scalar broadcast over the row
    ((4, 5), (slice(1, None, 2), slice(None, None, -2)), (2, 3)),
    ((4, 5, 3), (Ellipsis, 1), (1,)),
    ((4, 5, 3), (None, 1, slice(None)), (5, 3)),
    ((4, 5, 3), (-1, -2, -3), ()),
    ((4, 5, 3), np.array([2, 0, 2]), (3, 5, 3)),  # a repeated position: the last write wins, as in NumPy
    ((4, 5, 3), (slice(None), np.array([4, -1, 0])), (3, 3)),
    ((4, 5, 3), (0, slice(None), np.array([2, 1])), (2, 5)),  # non-adjacent advanced indices: their dim first
    ((4, 5, 3), (0, [2, 1], 1), (2,)),
    ((4, 5, 3), (slice(None), slice(2, 2)), (4, 0, 3)),  # an empty selection changes nothing
    ((4, 5), (Ellipsis,), (5,)),  # everything: the value itself, broadcast
    ((), (), ()),
]


@pytest.mark.parametrize("shape, index, vshape", CASES)
def test_setitem_matches_numpy(device, shape, index, vshape):
    a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    v = -np.arange(1, 1 + int(np.prod(vshape)), dtype=np.float32).reshape(vshape)
    want = a.copy()
    want[index] = v
    x = zyx.Tensor(a, device=device)
    x[index] = v
    np.testing.assert_array_equal(x.numpy(), want)
    y = zyx.Tensor(a, device=device)
    y[index] = zyx.Tensor(v, device=device)  # a tensor value too
    np.testing.assert_array_equal(y.numpy(), want)


def test_setitem_casts_the_value_to_the_tensors_dtype(device):
    x = zyx.Tensor(np.zeros(4, np.int32), device=device)
    x[1:3] = 2.7  # NumPy's cast: toward zero
    x[0] = zyx.Tensor(np.array(-1.5), device=device)
    assert x.dtype == zyx.int32
    np.testing.assert_array_equal(x.numpy(), [-1, 2, 2, 0])


def test_setitem_is_one_kernel(device):
    x = zyx.Tensor(np.ones((16, 8), np.float32), device=device).exp()
    x[:, 0] = 0
    x[3] = x[2] * 2  # reads the value assigned above
    assert [launch.kind for launch in zyx.debug.schedule(x) if launch.kind != "copy"] == ["generated"]
    want = np.exp(np.ones((16, 8), np.float32))
    want[:, 0] = 0
    want[3] = want[2] * 2
    np.testing.assert_allclose(x.numpy(), want, rtol=1e-6)


def test_earlier_readers_keep_the_old_value(device):
    x = zyx.Tensor(np.arange(4.0, dtype=np.float32), device=device)
    doubled = x * 2
    alias = x
    x[0] = 100
    np.testing.assert_array_equal(doubled.numpy(), [0, 2, 4, 6])
    np.testing.assert_array_equal(alias.numpy(), [100, 1, 2, 3])  # the same tensor object, rebound


def test_gradient_flows_to_the_assigned_value(device):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    v, w = rng.standard_normal((3, 2)), rng.standard_normal((4, 5))
    vz = zyx.Tensor(v, device=device, requires_grad=True)
    xz = zyx.Tensor(np.ones((4, 5)), device=device)
    xz[1:, np.array([4, 0])] = vz * 3
    (xz * zyx.Tensor(w, device=device)).sum().backward()
    vt = torch.tensor(v, requires_grad=True)
    xt = torch.ones((4, 5), dtype=torch.float64)
    xt[1:, torch.tensor([4, 0])] = vt * 3
    (xt * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(xz.numpy(), xt.detach().numpy(), rtol=1e-12)
    np.testing.assert_allclose(vz.grad.numpy(), vt.grad.numpy(), rtol=1e-12)


def test_setitem_under_no_grad_keeps_a_parameter_a_leaf(device):
    w = zyx.Tensor(np.ones((2, 3), np.float32), device=device, requires_grad=True)
    with zyx.no_grad():
        w[0] = 0
    (w * 2).sum().backward()
    np.testing.assert_array_equal(w.numpy(), [[0, 0, 0], [1, 1, 1]])
    np.testing.assert_array_equal(w.grad.numpy(), np.full((2, 3), 2.0))


def test_setitem_under_jit_rebinds_state_on_every_replay(device):
    state = zyx.Tensor(np.zeros(3, np.float32), device=device).realize()

    @zyx.jit
    def step(v):
        state[1] = v.sum()
        return state * 1

    for k in range(4):
        out = step(zyx.Tensor(np.full(2, k, np.float32), device=device))
        np.testing.assert_array_equal(out.numpy(), [0, 2 * k, 0])
    np.testing.assert_array_equal(state.numpy(), [0, 6, 0])


def test_setitem_errors_name_the_problem(tmp_path):
    x = zyx.Tensor(np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match=r"shape \(2,\) does not broadcast to x\[index\]'s shape \(3,\)"):
        x[:, 1] = np.ones(2, np.float32)
    with pytest.raises(IndexError, match="index 5 is out of bounds for axis 1 with size 4"):
        x[:, [0, 5]] = 1
    with pytest.raises(IndexError, match=r"1-D integer tensor index, got shape \(1, 1\)"):
        x[np.zeros((1, 1), np.int64)] = 1
    with pytest.raises(IndexError, match="index 3 is out of bounds for axis 0 with size 3"):
        x[3] = 1
    w = zyx.Tensor(np.zeros(3, np.float32), requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad .* under zyx.no_grad"):
        w[0] = 1
    np.testing.assert_array_equal(x.numpy(), np.zeros((3, 4)))  # nothing was changed by a failed assignment


def test_setitem_under_jit_takes_constant_indices_and_rejects_tensor_ones(device):
    @zyx.jit
    def spread(v):
        out = zyx.zeros(4, device=device)
        out[[2, 0]] = v  # a constant index: positions fixed when captured
        return out

    for k in range(3):
        np.testing.assert_array_equal(spread(zyx.Tensor(np.array([k, -k], np.float32), device=device)).numpy(),
                                      [-k, 0, k, 0])

    @zyx.jit
    def by_tensor(v, idx):
        out = zyx.zeros(4, device=device)
        out[idx] = v  # positions that would differ per call
        return out

    with pytest.raises(zyx.CaptureError, match="reading a tensor's value"):
        for _ in range(2):
            by_tensor(zyx.Tensor(np.ones(2, np.float32), device=device), zyx.Tensor(np.array([1, 3]), device=device))

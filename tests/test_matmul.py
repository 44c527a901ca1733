"""matmul / @ / dot with NumPy semantics: 1-D operands, batch broadcasting, transposed and strided inputs."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

import zyx

SHAPES = [
    ((3,), (3,)), ((3,), (3, 4)), ((2, 3), (3,)), ((2, 3), (3, 4)), ((5, 2, 3), (3, 4)), ((2, 3), (5, 3, 4)),
    ((1, 2, 3), (4, 3, 2)), ((2, 1, 2, 3), (3, 3, 2)), ((0, 3), (3, 2)), ((2, 0), (0, 3)), ((1, 1), (1, 1)),
]


@pytest.mark.parametrize("sa,sb", SHAPES, ids=[f"{a}@{b}" for a, b in SHAPES])
def test_matmul_shapes(device, rng, sa, sb):
    a = rng.standard_normal(sa).astype(np.float32)
    b = rng.standard_normal(sb).astype(np.float32)
    got = zyx.Tensor(a, device=device) @ zyx.Tensor(b, device=device)
    assert_close(got, np.matmul(a.astype(np.float64), b.astype(np.float64)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64"])
def test_matmul_dtypes(device, rng, dtype):
    a = rng.integers(-3, 4, size=(4, 6)).astype(dtype)
    b = rng.integers(-3, 4, size=(6, 5)).astype(dtype)
    want = a @ b
    assert_close(zyx.Tensor(a, device=device) @ zyx.Tensor(b, device=device), want, dtype=want.dtype)


def test_matmul_transposed_and_strided(device, rng):
    a = rng.standard_normal((8, 6)).astype(np.float32)
    b = rng.standard_normal((5, 8)).astype(np.float32)
    x, y = zyx.Tensor(a, device=device), zyx.Tensor(b, device=device)
    assert_close(x.T @ y.T, a.T @ b.T, rtol=1e-5, atol=1e-5)
    assert_close(x[::2].T @ y[:, ::2].T, a[::2].T @ b[:, ::2].T, rtol=1e-5, atol=1e-5)
    assert_close(x.matmul(x.T), a @ a.T, rtol=1e-5, atol=1e-5)


def test_dot_and_rmatmul(device, rng):
    v = rng.standard_normal(7).astype(np.float32)
    w = rng.standard_normal(7).astype(np.float32)
    V, W = zyx.Tensor(v, device=device), zyx.Tensor(w, device=device)
    r = V.dot(W)
    assert r.shape == ()
    assert_close(r, np.dot(v, w), rtol=1e-5)
    m = rng.standard_normal((3, 7)).astype(np.float32)
    assert_close(zyx.matmul(zyx.Tensor(m, device=device), V), m @ v, rtol=1e-5)


def test_matmul_mixed_promotes(device, rng):
    a = rng.standard_normal((2, 3)).astype(np.float32)
    b = rng.integers(0, 3, size=(3, 2)).astype(np.int64)
    got = zyx.Tensor(a, device=device) @ zyx.Tensor(b, device=device)
    assert_close(got, a @ b, rtol=1e-5, dtype=np.float64)


def test_matmul_errors():
    a = zyx.Tensor(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"\(2, 3\) and \(4, 5\)"):
        a @ zyx.Tensor(np.ones((4, 5), np.float32))
    with pytest.raises(ValueError, match="at least 1 dimension"):
        a @ zyx.Tensor(np.float32(1))
    with pytest.raises(ValueError, match="cannot be broadcast"):
        zyx.Tensor(np.ones((2, 2, 3))) @ zyx.Tensor(np.ones((3, 3, 2)))


def test_gradients_of_a_summed_matmul_read_the_ones_as_a_constant():
    """``(a @ b.T).sum().backward()``: the gradient of the sum is a broadcast constant 1. The matcher had read it as
    a dense (m, n, k) operand: a batch of GEMVs over a materialized m * n * k constant (2.4 GB for a 32768 x 64 x
    288 convolution). Now the product with 1 folds away and the gradients are sums of the other operand."""
    a = zyx.Tensor(np.ones((256, 48), np.float32), requires_grad=True).realize()
    b = zyx.Tensor(np.ones((32, 48), np.float32), requires_grad=True).realize()
    (a @ b.T).sum().backward()
    launches = zyx.debug.schedule(a.grad, b.grad)
    assert all(launch.kind == "generated" and "256_48_32" not in launch.name and "32_48_256" not in launch.name
               for launch in launches), launches
    np.testing.assert_array_equal(a.grad.numpy(), np.full((256, 48), 32.0))
    np.testing.assert_array_equal(b.grad.numpy(), np.full((32, 48), 256.0))


def test_a_product_with_one_is_the_other_operand():
    from zyx.graph import ops as g
    from zyx.ops import Ops

    x = zyx.Tensor(np.arange(6.0).reshape(2, 3)).cls
    one = g.const(1.0, (2, 3), x.dtype, x.device)
    assert g.binary(Ops.MUL, x, one) is x and g.binary(Ops.MUL, one, x) is x
    assert g.binary(Ops.MUL, x, g.const(2.0, (2, 3), x.dtype, x.device)) is not x


def test_broadcast_left_operand_gives_the_right_one_its_gradient_in_its_own_layout():
    """``w @ x`` with ``w`` broadcast over ``x``'s batch (a convolution's weight over its columns): ``x.grad`` is
    ``w^T @ grad`` computed in ``x``'s (k, n) layout, not the (n, k) transpose the composite path reduced into
    (a convolution's col2im then read it ``k`` floats apart)."""
    from zyx.ops import Ops

    rng = np.random.default_rng(0)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    x = rng.standard_normal((3, 5, 7)).astype(np.float32)
    g = rng.standard_normal((3, 6, 7)).astype(np.float32)
    W, X = zyx.Tensor(w, requires_grad=True), zyx.Tensor(x, requires_grad=True)
    ((W @ X) * zyx.Tensor(g)).sum().backward()
    c = X.grad.cls
    while c.op is Ops.RESHAPE:
        c = c.nodes[0].srcs[0]
    assert c.op is Ops.REDUCE, c
    np.testing.assert_allclose(X.grad.numpy(), np.einsum("mk,bmn->bkn", w, g), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(W.grad.numpy(), np.einsum("bmn,bkn->mk", g, x), rtol=1e-5, atol=1e-5)

"""Module-level functions (zyx.exp(x), zyx.maximum(a, b), ...) and PyTorch's method names for the operators."""

from __future__ import annotations

import numpy as np
import pytest

import zyx
from zyx import functions

X = np.array([[1.5, -2.0, 0.25], [3.0, -0.5, 2.0]], np.float32)
Y = np.array([[0.5, 4.0, -1.0], [2.0, 2.0, -3.0]], np.float32)


def test_every_function_is_a_tensor_method_and_exported():
    for name, (first, second) in functions.BINARY.items():
        assert callable(getattr(zyx.Tensor, first)) and callable(getattr(zyx.Tensor, second)), name
    for name in functions.UNARY_AND_REDUCE:
        assert callable(getattr(zyx.Tensor, name)), name
    for name in functions.FUNCTIONS:
        assert getattr(zyx, name) is functions.FUNCTIONS[name] and name in zyx.__all__


@pytest.mark.parametrize("name,ref", [("exp", np.exp), ("abs", np.abs), ("tanh", np.tanh), ("floor", np.floor),
                                      ("square", np.square), ("negative", np.negative)])
def test_unary_functions_match_numpy(name, ref, device: str):
    got = getattr(zyx, name)(zyx.Tensor(X, device=device)).numpy()
    np.testing.assert_allclose(got, ref(X), rtol=1e-6)


def test_reductions_and_movement_take_their_arguments(device: str):
    x = zyx.Tensor(X, device=device)
    np.testing.assert_allclose(zyx.sum(x, 1).numpy(), X.sum(1), rtol=1e-6)
    np.testing.assert_allclose(zyx.mean(x, dim=0, keepdim=True).numpy(), X.mean(0, keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(zyx.argmax(x, 1).numpy(), X.argmax(1))
    np.testing.assert_array_equal(zyx.transpose(x, 0, 1).numpy(), X.T)
    np.testing.assert_array_equal(zyx.clamp(x, -1.0, 1.0).numpy(), np.clip(X, -1.0, 1.0))
    np.testing.assert_allclose(zyx.exp([0.0, 1.0]).numpy(), np.exp(np.array([0.0, 1.0], np.float32)))


@pytest.mark.parametrize("name,ref", [
    ("add", np.add), ("sub", np.subtract), ("mul", np.multiply), ("div", np.true_divide), ("pow", np.power),
    ("maximum", np.maximum), ("minimum", np.minimum), ("lt", np.less), ("le", np.less_equal), ("gt", np.greater),
    ("ge", np.greater_equal), ("eq", np.equal), ("ne", np.not_equal), ("floor_divide", np.floor_divide),
    ("remainder", np.remainder)])
def test_binary_functions_take_the_tensor_on_either_side(name, ref, device: str):
    fn = getattr(zyx, name)
    x, y = zyx.Tensor(X, device=device), zyx.Tensor(Y, device=device)
    with np.errstate(all="ignore"):
        np.testing.assert_allclose(fn(x, y).numpy(), ref(X, Y), rtol=1e-6)
        for s in (2, 0.5):
            left, right = fn(s, x), fn(x, s)  # a Python scalar stays weak on either side: float32 results
            np.testing.assert_allclose(left.numpy(), ref(np.float32(s), X), rtol=1e-6)
            np.testing.assert_allclose(right.numpy(), ref(X, np.float32(s)), rtol=1e-6)
            assert left.dtype == right.dtype == (zyx.bool if ref(X, Y).dtype == np.bool_ else zyx.float32)


def test_pytorch_method_names(device: str):
    x, y = zyx.Tensor(X, device=device), zyx.Tensor(Y, device=device)
    np.testing.assert_allclose(x.add(y, alpha=2).numpy(), X + 2 * Y)
    np.testing.assert_allclose(x.sub(y, alpha=0.5).numpy(), X - 0.5 * Y)
    np.testing.assert_allclose(x.div(y, rounding_mode="floor").numpy(), X // Y)
    np.testing.assert_allclose(zyx.add(x, y, alpha=3).numpy(), X + 3 * Y)
    np.testing.assert_allclose(x.multiply(y).numpy(), X * Y)
    with pytest.raises(ValueError, match="rounding_mode"):
        x.div(y, rounding_mode="trunc")
    with pytest.raises(TypeError, match="tensor first"):
        zyx.add(1.0, y, alpha=2)

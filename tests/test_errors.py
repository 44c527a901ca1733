"""Bad input raises a clear error when the op is built, before any kernel is compiled or launched."""

from __future__ import annotations

import numpy as np
import pytest

import zyx


@pytest.fixture
def x():
    return zyx.Tensor(np.ones((2, 3), np.float32))


@pytest.fixture(autouse=True)
def nothing_runs():
    zyx.debug.reset_stats()
    yield
    st = zyx.debug.stats()
    assert st["launches"] == 0 and st["compiles"] == 0


def test_shape_mismatch_names_both_shapes(x):
    with pytest.raises(ValueError, match=r"\(2, 3\) and \(4,\) cannot be broadcast"):
        x + zyx.Tensor(np.ones(4, np.float32))


def test_bad_axis(x):
    with pytest.raises(ValueError, match="axis 2 is out of range for a tensor with 2 dimension"):
        x.sum(2)
    with pytest.raises(ValueError, match="axis -3 is out of range"):
        x.max(-3)
    with pytest.raises(ValueError, match="repeated axis"):
        x.sum((0, 0))
    with pytest.raises(TypeError, match="axis must be an int"):
        x.sum(1.5)
    with pytest.raises(ValueError, match="axis 3 is out of range"):
        x.softmax(3)


def test_impossible_reshape(x):
    with pytest.raises(ValueError, match=r"cannot reshape tensor of shape \(2, 3\) \(6 elements\) into shape \(4, 2\)"):
        x.reshape(4, 2)
    with pytest.raises(ValueError, match="only one dimension can be -1"):
        x.reshape(-1, -1)
    with pytest.raises(ValueError, match=r"into shape \(-1, 4\)"):
        x.reshape(-1, 4)


def test_index_out_of_range(x):
    with pytest.raises(IndexError, match="index 2 is out of bounds for axis 0 with size 2"):
        x[2]
    with pytest.raises(IndexError, match="index -4 is out of bounds for axis 1 with size 3"):
        x[0, -4]
    with pytest.raises(IndexError, match="too many indices"):
        x[0, 0, 0]
    with pytest.raises(IndexError, match="index 5 is out of bounds for axis 1 with size 3"):
        x[:, [0, 5]]
    with pytest.raises(IndexError, match="must be integers"):
        x[zyx.Tensor(np.array([0.5]))]


def test_unsupported_dtype():
    with pytest.raises(TypeError, match="complex128 has no zyx equivalent"):
        zyx.Tensor(np.ones(3, np.complex128))
    with pytest.raises(TypeError, match="unknown dtype 'float8'"):
        zyx.zeros(3, dtype="float8")
    with pytest.raises(TypeError, match="bitwise and needs bool or integer"):
        zyx.Tensor(np.ones(3, np.float32)) & zyx.Tensor(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="ragged"):
        zyx.Tensor([[1, 2], [3]])


def test_other_bad_calls(x):
    with pytest.raises(ValueError, match="not a permutation"):
        x.permute(0, 0)
    with pytest.raises(ValueError, match="cannot broadcast a tensor of shape"):
        x.broadcast_to((3, 3))
    with pytest.raises(ValueError, match="squeeze: axis 1 has size 3"):
        x.squeeze(1)
    with pytest.raises(ValueError, match="differ outside axis"):
        zyx.cat([x, zyx.Tensor(np.ones((3, 3), np.float32))], 1)
    with pytest.raises(ValueError, match="need the same shape"):
        zyx.stack([x, x.T])
    with pytest.raises(ValueError, match="do not add up"):
        x.split([1, 1], 1)
    with pytest.raises(ValueError, match="step must not be zero"):
        zyx.arange(0, 5, 0)
    with pytest.raises(ValueError, match="item\\(\\) needs a tensor with one element"):
        x.item()
    with pytest.raises(ValueError, match="unknown device name"):
        x.to("tpu")
    with pytest.raises(ValueError, match="randint: high"):
        zyx.randint(5, 5, (2,))
    with pytest.raises(ValueError, match="ambiguous"):
        bool(x)


NEGATIVE_SHAPES = [lambda: zyx.full((2, -1), 1.0), lambda: zyx.zeros(3, -2), lambda: zyx.ones((-1,)),
                   lambda: zyx.randn(-1), lambda: zyx.rand(2, -3), lambda: zyx.eye(-2), lambda: zyx.eye(2, -1),
                   lambda: zyx.randint(0, 5, (-4,)),
                   lambda: zyx.Tensor(np.ones((2, 1), np.float32)).broadcast_to((2, -1)),
                   lambda: zyx.Tensor(np.ones((2, 3), np.float32)).expand(-1, 2, 3)]


@pytest.mark.parametrize("make", NEGATIVE_SHAPES)
def test_negative_dimensions_are_refused_when_the_tensor_is_made(make):
    with pytest.raises(ValueError, match="negative dimension"):
        make()

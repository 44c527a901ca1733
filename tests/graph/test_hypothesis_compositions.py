"""Random compositions of movement and elementwise ops, checked against NumPy step by step."""

from __future__ import annotations

import math

import numpy as np
from conftest import assert_close
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import zyx


def _factorizations(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def programs(draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    ops = []
    cur = shape
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["permute", "reshape", "expand", "pad", "slice", "flip", "unary", "binary",
                                     "scalar", "reduce"]))
        nd = len(cur)
        if kind == "permute":
            perm = draw(st.permutations(range(nd)))
            ops.append(("permute", tuple(perm)))
            cur = tuple(cur[p] for p in perm)
        elif kind == "reshape":
            n = math.prod(cur)
            a = draw(st.sampled_from(_factorizations(n)))
            b = draw(st.sampled_from(_factorizations(n // a)))
            new = (a, b, n // a // b)
            ops.append(("reshape", new))
            cur = new
        elif kind == "expand" and nd < 4:
            axis = draw(st.integers(0, nd))
            size = draw(st.integers(1, 3))
            ops.append(("expand", (axis, size)))
            cur = cur[:axis] + (size,) + cur[axis:]
        elif kind == "pad":
            pads = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(nd))
            ops.append(("pad", pads))
            cur = tuple(s + a + b for s, (a, b) in zip(cur, pads))
        elif kind == "slice":
            sl = []
            for s in cur:
                step = draw(st.sampled_from([1, 2, -1, -2]))
                start = draw(st.integers(0, s - 1))
                sl.append(slice(start, None, step))
            ops.append(("slice", tuple(sl)))
            cur = tuple(len(range(*x.indices(s))) for x, s in zip(sl, cur))
        elif kind == "flip":
            ops.append(("flip", draw(st.integers(0, nd - 1))))
        elif kind in ("unary", "binary", "scalar"):
            ops.append((kind, draw(st.integers(0, 3))))
        elif kind == "reduce":
            ops.append(("reduce", (draw(st.integers(0, nd - 1)), draw(st.sampled_from(["sum", "max"])))))
            cur = tuple(1 if i == ops[-1][1][0] else s for i, s in enumerate(cur))
        if 0 in cur:
            break
    return shape, ops


def _apply(x, op, is_np: bool):
    kind, arg = op
    if kind == "permute":
        return x.transpose(arg) if is_np else x.permute(arg)
    if kind == "reshape":
        return x.reshape(arg)
    if kind == "expand":
        axis, size = arg
        y = np.expand_dims(x, axis) if is_np else x.unsqueeze(axis)
        shape = y.shape[:axis] + (size,) + y.shape[axis + 1:]
        return np.broadcast_to(y, shape) if is_np else y.expand(shape)
    if kind == "pad":
        return np.pad(x, arg, constant_values=0.5) if is_np else x.pad(arg, value=0.5)
    if kind == "slice":
        return x[arg]
    if kind == "flip":
        return np.flip(x, arg) if is_np else x.flip(arg)
    if kind == "unary":
        fns = [lambda v: v * -1.0, lambda v: abs(v), lambda v: (np.exp(v * 0.1) if is_np else (v * 0.1).exp()),
               lambda v: (np.maximum(v, 0.25) if is_np else v.maximum(0.25))]
        return fns[arg](x)
    if kind == "binary":
        other = np.flip(x, -1) if is_np else x.flip(-1)
        fns = [lambda a, b: a + b, lambda a, b: a * b, lambda a, b: a - b,
               lambda a, b: np.minimum(a, b) if is_np else a.minimum(b)]
        return fns[arg](x, other)
    if kind == "scalar":
        return [x + 1.5, x * 0.75, 2.0 - x, x / 4.0][arg]
    if kind == "reduce":
        axis, name = arg
        return getattr(x, name)(axis, keepdims=True) if is_np else getattr(x, name)(axis, keepdim=True)
    raise AssertionError(kind)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.integers(0, 2**32 - 1))
def test_random_compositions_match_numpy(prog, seed):
    shape, ops = prog
    a = np.random.default_rng(seed).standard_normal(shape)
    x = zyx.Tensor(a, device="host")
    y = a
    for op in ops:
        x, y = _apply(x, op, False), _apply(y, op, True)
        assert x.shape == y.shape, (op, x.shape, y.shape)
    assert_close(x, y, rtol=1e-12, atol=1e-12)

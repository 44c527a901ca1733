"""Invariants the fast graph-building paths must keep: hash-consing keys, the exact structure key of a realize,
context-free forwards, constant rounding, and the host device's packed launch arguments."""

from __future__ import annotations

import gc
import math

import numpy as np
import pytest

import zyx
from zyx import autograd as F
from zyx import dtypes
from zyx.graph import node, schedule
from zyx.graph import ops as g
from zyx.ops import Ops
from zyx.tensor import broadcast_shapes


def _host(a) -> zyx.Tensor:
    return zyx.Tensor(np.asarray(a, np.float32), device="host")


def test_hash_consing_shares_equal_nodes_and_counts_only_new_ones():
    x = _host([1.0, 2.0])
    zyx.debug.reset_stats()
    a = x * 2.0 + 1.0
    built = zyx.debug.stats()["graph_nodes"]
    b = x * 2.0 + 1.0
    assert a.cls is b.cls
    assert zyx.debug.stats()["graph_nodes"] == built  # a hit builds nothing


@pytest.mark.parametrize("pair", [(0.0, -0.0), (0, -0.0), (1.0, 1.5)])
def test_constants_that_compare_equal_but_differ_stay_apart(pair):
    p, q = pair
    a = g.const(p, (2,), dtypes.float32, "host")
    b = g.const(q, (2,), dtypes.float32, "host")
    assert a is not b
    assert math.copysign(1.0, a.nodes[0].arg) == math.copysign(1.0, float(p))
    assert math.copysign(1.0, b.nodes[0].arg) == math.copysign(1.0, float(q))


def test_equal_scalars_of_other_types_build_the_same_constant():
    a = g.const(1, (3,), dtypes.float32, "host")
    b = g.const(1.0, (3,), dtypes.float32, "host")
    c = g.const(True, (3,), dtypes.float32, "host")
    assert a is b is c and type(a.nodes[0].arg) is float


def test_constant_rounding_matches_the_dtype():
    for d in (dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64):
        for v in (0.1, 1e-8, 65504.0, 3.0, -2.5):
            c = g.const(v, (), d, "host")
            assert c.nodes[0].arg == dtypes.as_python(v, d)
    nan = g.const(float("nan"), (), dtypes.float32, "host")
    assert math.isnan(nan.nodes[0].arg)


def test_pad_fill_sign_of_zero_is_kept():
    x = _host([1.0, 2.0])
    pos, neg = x.pad(((1, 1),), 0.0), x.pad(((1, 1),), -0.0)
    assert pos.cls is not neg.cls
    assert np.signbit(neg.numpy()[0]) and not np.signbit(pos.numpy()[0])


def test_cache_entries_leave_with_their_classes():
    gc.collect()
    base = node.live_classes()
    x = _host(np.arange(8))
    y = x
    for _ in range(50):
        y = (y + 1.0) * 0.5
    assert node.live_classes() > base
    del y
    gc.collect()
    assert node.live_classes() == base


def test_a_realized_class_leaves_the_cache_and_is_rebuilt_fresh():
    x = _host([1.0, 2.0, 3.0])
    a = x + 1.0
    old = a.cls
    a.realize()
    assert old.realized and old.key is None
    b = x + 1.0
    assert b.cls is not old and not b.cls.realized
    np.testing.assert_allclose(b.numpy(), [2.0, 3.0, 4.0])


def test_deep_chain_is_freed_without_recursion_errors():
    x = _host([1.0])
    y = x
    for _ in range(100_000):
        y = y + 1.0
    del y
    gc.collect()
    z = x
    for _ in range(2000):
        z = z + 1.0
    assert z.item() == 2001.0


def test_structure_key_tells_sharing_apart():
    x, y = _host([1.0, 2.0]), _host([3.0, 4.0])
    same, other = (x + x), (x + y)
    _, leaves_same, key_same = schedule.walk([same.cls])
    _, leaves_other, key_other = schedule.walk([other.cls])
    assert len(leaves_same) == 1 and len(leaves_other) == 2
    assert key_same != key_other
    np.testing.assert_allclose(same.numpy(), [2.0, 4.0])
    np.testing.assert_allclose(other.numpy(), [4.0, 6.0])


def test_structure_key_ignores_buffers_and_variable_values_only():
    x1, x2 = _host([1.0, 2.0]), _host([5.0, 6.0])
    v1, v2 = zyx.Tensor.variable(2.0, device="host"), zyx.Tensor.variable(3.0, device="host")
    k1 = schedule.walk([(x1 * v1 + 1.0).cls])[2]
    k2 = schedule.walk([(x2 * v2 + 1.0).cls])[2]
    assert k1 == k2
    k3 = schedule.walk([(x2 * v2 + 2.0).cls])[2]  # a different constant is a different structure
    k4 = schedule.walk([(x2 * v2 - 0.0).cls])[2]
    k5 = schedule.walk([(x2 * v2 + 0.0).cls])[2]
    assert len({k1, k3, k4, k5}) == 4


def test_walk_lists_sources_first_and_each_class_once():
    x = _host(np.ones(4))
    a = x * 2.0
    b = (a + a) * a
    order, leaves, _ = schedule.walk([b.cls, a.cls])
    assert len(order) == len({id(c) for c in order})
    pos = {id(c): i for i, c in enumerate(order)}
    for c in order:
        for s in c.nodes[0].srcs:
            if not s.realized and s.nodes[0].op is not Ops.VAR:
                assert pos[id(s)] < pos[id(c)]
    assert [lf.buffer for lf in leaves] == [x.cls.buffer]


def test_plan_cache_hits_on_repeated_structure_with_new_inputs():
    def step(v):
        return ((_host(v) * 1.5).relu() - 0.25).realize()

    step([1.0, -1.0])
    zyx.debug.reset_stats()
    out = step([2.0, -2.0])
    s = zyx.debug.stats()
    assert s["schedule_cache_hits"] == 1 and s["schedule_cache_misses"] == 0
    np.testing.assert_allclose(out.numpy(), [2.75, -0.25])


def test_context_free_forward_records_no_context():
    x = _host([1.0, -2.0])
    y = (x * 2.0).exp().sum()
    assert y._ctx is None and not y.requires_grad
    w = _host([1.0, -2.0]).requires_grad_()
    with zyx.no_grad():
        z = (w * 2.0).exp().sum()
    assert z._ctx is None and not z.requires_grad
    loss = (w * 2.0).exp().sum()
    assert loss.requires_grad and loss._ctx is not None
    loss.backward()
    np.testing.assert_allclose(w.grad.numpy(), 2 * np.exp(2 * np.array([1.0, -2.0])), rtol=1e-6)


@pytest.mark.parametrize("fn", [F.Add, F.Sub, F.Mul, F.Div, F.Maximum, F.Minimum, F.Pow])
def test_direct_binary_builds_what_forward_builds(fn):
    a, b = _host([1.0, 2.0]), _host([3.0, 0.5])
    ctx = fn(a, b)
    assert fn.direct(a.cls, b.cls) is ctx.forward(a.cls, b.cls)


def test_direct_movement_and_reduce_build_what_forward_builds():
    x = _host(np.arange(6.0).reshape(2, 3))
    c = x.cls
    cases = [(F.Sum, {"axes": (1,)}), (F.Max, {"axes": (0,)}), (F.Min, {"axes": (1,)}), (F.Prod, {"axes": (0,)}),
             (F.Reshape, {"shape": (3, 2)}), (F.Permute, {"order": (1, 0)}), (F.Expand, {"shape": (2, 3)}),
             (F.Pad, {"pads": ((1, 0), (0, 2)), "fill": 1.0}), (F.Shrink, {"spec": ((0, 2, 1), (2, -1, -1))}),
             (F.Cast, {"dtype": dtypes.float64}), (F.Scan, {"op": Ops.ADD, "axis": 1}), (F.Contiguous, {})]
    for fn, kw in cases:
        assert fn.direct(c, **kw) is fn(x).forward(c, **kw), fn.__name__


def test_broadcast_shapes_results_and_errors():
    assert broadcast_shapes((3, 1), (4,)) == (3, 4)
    assert broadcast_shapes((1,), (2, 0)) == (2, 0)
    assert broadcast_shapes((2, 3), (2, 3)) == (2, 3)
    assert broadcast_shapes((5, 1, 2), (1, 4, 1), (4, 2)) == (5, 4, 2)
    with pytest.raises(ValueError, match=r"shapes \(2, 3\) and \(4,\) cannot be broadcast together \(axis -1 has"):
        broadcast_shapes((2, 3), (4,))


def test_shape_arguments_keep_their_checks():
    x = _host(np.ones((2, 3)))
    with pytest.raises(TypeError, match="shape entries must be ints"):
        x.reshape(True, 6)
    with pytest.raises(ValueError, match="cannot reshape"):
        x.reshape(4, 2)
    with pytest.raises(ValueError, match="only one dimension can be -1"):
        x.reshape(-1, -1)
    assert x.reshape(np.int64(3), 2).shape == (3, 2)
    assert x.permute(-1, 0).shape == (3, 2)
    with pytest.raises(ValueError, match="is not a permutation"):
        x.permute(0, 0)


def test_host_launches_reuse_packed_arguments_with_new_values():
    v = zyx.Tensor.variable(2.0, device="host")
    outs = []
    for i, scale in enumerate((2.0, 3.0, -1.0)):
        v.cls.var_value = scale
        x = _host(np.full(4, float(i + 1)))
        outs.append((x * v + 1.0).numpy())
    np.testing.assert_allclose(outs, [np.full(4, 3.0), np.full(4, 7.0), np.full(4, -2.0)])


@pytest.mark.parametrize("dt", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("scalar", [1.5, 2, 0, -0.0, float("nan")])
def test_scalar_fast_path_builds_the_general_paths_classes(dt, scalar):
    """``Tensor._scalar_op`` (a Python scalar with a float tensor, no gradient) builds the classes that
    ``_operand`` + ``Function.apply`` build: hash-consing makes them the very same objects."""
    x = zyx.Tensor(np.arange(4, dtype=dt) - 1.5, device="host")
    cases = [(x + scalar, F.Add, False), (scalar + x, F.Add, True), (x - scalar, F.Sub, False),
             (scalar - x, F.Sub, True), (x * scalar, F.Mul, False), (scalar * x, F.Mul, True),
             (x.maximum(scalar), F.Maximum, False)]
    for fast, fn, reverse in cases:
        a, b = x._operand(scalar, reverse=reverse)
        assert fast.cls is fn.apply(a, b).cls
        assert fast.dtype is x.dtype and not fast.requires_grad


def test_scalar_fast_path_leaves_gradients_and_other_dtypes_to_the_general_path():
    w = zyx.Tensor(np.array([1.0, -2.0], np.float32), requires_grad=True)
    y = (w * 3.0 - 1).maximum(0.0)
    assert y.requires_grad
    y.sum().backward()
    assert w.grad.numpy().tolist() == [3.0, 0.0]
    with zyx.no_grad():
        assert not (w * 3.0)._ctx and not (w * 3.0).requires_grad
    i = zyx.Tensor(np.array([1, 2], np.int32))
    assert (i * 2).dtype is dtypes.int32 and (i * 2.5).dtype is dtypes.default_float
    assert (i * 2.5).numpy().tolist() == [2.5, 5.0]
    b = zyx.Tensor(np.array([True, False]))
    assert (b + 1).numpy().tolist() == [2, 1]


def test_interned_classes_set_every_slot_the_constructors_set():
    """``node._interned`` builds classes and nodes slot by slot, past their constructors: every slot either
    constructor sets is set, to the value the constructor would give (a slot added to ``Class`` or ``Node`` and
    forgotten there fails here)."""
    x = _host([1.0, 2.0])
    c = g.binary(Ops.ADD, x.cls, g.const(1.0, (2,), dtypes.float32, "host"))
    ref = node.Class(c.shape, c.dtype, c.device, node.Node(Ops.ADD, c.nodes[0].srcs, None))
    for name in (s for s in node.Class.__slots__ if s != "__weakref__"):
        assert hasattr(c, name), name
        if name not in ("nodes", "key"):
            assert getattr(c, name) == getattr(ref, name), name
    for name in node.Node.__slots__:
        assert getattr(c.nodes[0], name) == getattr(ref.nodes[0], name), name
    assert node._cache[c.key]() is c

"""match_matmul positives and negatives, extraction properties, and matmul parity with BLAS on and off."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from conftest import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

import zyx
from zyx import dtypes
from zyx.backends.base import LibraryKernel
from zyx.backends.registry import registry
from zyx.graph import schedule
from zyx.graph.extract import extract, total_cost
from zyx.graph.match import match_matmul
from zyx.graph.node import Class, Node
from zyx.ops import Ops


def _reduce_class(t: zyx.Tensor) -> Class:
    c = t.cls
    while c.op in (Ops.RESHAPE, Ops.CAST):
        c = c.srcs[0]
    return c


def T(shape, dtype=np.float32):
    return zyx.Tensor(np.random.default_rng(0).standard_normal(shape).astype(dtype))


# ---- matcher ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sa,sb,batch,m,n,k", [
    ((4, 3), (3, 5), (), 4, 5, 3),
    ((2, 4, 3), (2, 3, 5), (2,), 4, 5, 3),
    ((2, 4, 3), (3, 5), (), 8, 5, 3),  # a batched operand against a shared matrix: batch folds into m
    ((4, 3), (6, 3, 5), (6,), 4, 5, 3),
    ((7, 1, 4, 3), (2, 3, 5), (7, 2), 4, 5, 3),
    ((3,), (3, 5), (), 1, 5, 3),
    ((4, 3), (3,), (), 4, 1, 3),
])
def test_matches_what_matmul_lowers_to(sa, sb, batch, m, n, k):
    mm = match_matmul(_reduce_class(T(sa) @ T(sb)))
    assert mm is not None
    assert (mm.batch, mm.m, mm.n, mm.k) == (batch, m, n, k)
    assert mm.acc_dtype is dtypes.float32


def test_transposed_operands_are_strides_not_copies():
    a, b = T((3, 4)), T((5, 3))
    mm = match_matmul(_reduce_class(a.T @ b.T))
    assert mm.a.view.base is a.cls and mm.b.view.base is b.cls
    assert (mm.a.row_stride, mm.a.col_stride) == (1, 4)  # A^T: m walks columns of a
    assert (mm.b.row_stride, mm.b.col_stride) == (1, 3)


def test_half_inputs_accumulate_in_float32():
    a, b = T((4, 8), np.float16), T((8, 2), np.float16)
    mm = match_matmul(_reduce_class(a @ b))
    assert mm.acc_dtype is dtypes.float32
    assert mm.input_dtypes() == (dtypes.float16, dtypes.float16)
    assert mm.a.view.base is a.cls and mm.a.view.cast is dtypes.float32
    bf = zyx.Tensor(np.ones((4, 8), np.float32)).cast(zyx.bfloat16).realize()
    mm = match_matmul(_reduce_class(bf @ bf.T))
    assert mm.input_dtypes() == (dtypes.bfloat16, dtypes.bfloat16)


def test_einsum_like_sum_of_product_matches():
    a, b = T((4, 3)), T((3, 5))
    manual = (a.reshape(4, 1, 3) * b.T.reshape(1, 5, 3)).sum(-1)
    assert match_matmul(_reduce_class(manual)) is not None


def test_non_matches():
    a, b = T((4, 3)), T((4, 3))
    # sum over an axis that is not shared: b is an expand of size 1 along it
    not_shared = (a.reshape(4, 1, 3) * T((1, 5, 1)).expand(4, 5, 3)).sum(-1)
    assert match_matmul(_reduce_class(not_shared)) is None
    assert match_matmul((a * b).cls) is None  # multiply with no reduce
    assert match_matmul(_reduce_class((a.reshape(4, 1, 3) * b.reshape(1, 4, 3)).max(-1))) is None  # max-reduce
    assert match_matmul(_reduce_class((a.exp()).sum(-1))) is None  # reduce of a non-product
    assert match_matmul(_reduce_class((a * b).sum(-1))) is None  # elementwise product: no m or n axis... dot rows
    two_axes = (a.reshape(4, 1, 3) * b.reshape(1, 4, 3)).sum((0, 2))
    assert match_matmul(_reduce_class(two_axes)) is None


# ---- extraction ------------------------------------------------------------------------------------------------


def _fresh(op: Ops, *srcs: Class) -> Class:
    """A class outside the hash-cons cache, so alternatives added by one test never leak into another."""
    return Class((4,), dtypes.float32, "host", Node(op, srcs, None))


def _graph_with_shared_input(lib_cost: float, shared_cost: float, gen_cost: float):
    """Two classes X, Y each computable by a generated node (gen_cost) or a library node (lib_cost) that
    needs a shared input P (shared_cost)."""
    src = _fresh(Ops.CONST)
    p = _fresh(Ops.EXP, src)
    x = _fresh(Ops.SIN, src)
    y = _fresh(Ops.COS, src)
    out = _fresh(Ops.ADD, x, y)
    costs: dict[int, float] = {id(p.node): shared_cost, id(x.node): gen_cost, id(y.node): gen_cost}
    for c in (x, y):
        lib = LibraryKernel(None, 0, (p,), lib_cost, f"lib_{c.node.op.value}")
        n = Node(Ops.KERNEL, (p,), lib)
        c.nodes.append(n)
        costs[id(n)] = lib_cost

    def cost(c, n):
        return costs.get(id(n), 0.0)

    return out, (x, y), cost


def test_extraction_beats_per_class_greedy_when_inputs_are_shared():
    out, (x, y), cost = _graph_with_shared_input(lib_cost=2, shared_cost=10, gen_cost=8)
    # per class, library = 2 + 10 > 8 = generated; together the shared 10 is paid once: 2 + 2 + 10 < 16
    choice = extract([out], cost)
    assert choice[id(x)].op is Ops.KERNEL and choice[id(y)].op is Ops.KERNEL
    assert total_cost([out], choice, cost) == 14
    # the improvement search (used past the exhaustive limit) reaches the same optimum here
    assert total_cost([out], extract([out], cost, exhaustive_limit=1), cost) == 14


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 20), st.floats(0, 20)), min_size=1, max_size=5), st.floats(0, 30))
def test_exhaustive_extraction_is_optimal(alts, shared):
    src = _fresh(Ops.CONST)
    p = _fresh(Ops.EXP, src)
    classes, costs = [], {id(p.node): shared}
    acc = None
    for i, (gen, lib) in enumerate(alts):
        c = _fresh(Ops.MUL, src, src)
        costs[id(c.node)] = gen
        n = Node(Ops.KERNEL, (p,), LibraryKernel(None, 0, (p,), lib, f"l{i}"))
        c.nodes.append(n)
        costs[id(n)] = lib
        classes.append(c)
        acc = c if acc is None else _fresh(Ops.ADD, acc, c)

    def cost(c, n):
        return costs.get(id(n), 0.0)

    best = min(total_cost([acc], {id(c): n for c, n in zip(classes, combo)}, cost)
               for combo in itertools.product(*(c.nodes for c in classes)))
    assert math.isclose(total_cost([acc], extract([acc], cost), cost), best)
    # branch and bound (used past the exhaustive limit) finds the optimum too on graphs this size
    assert math.isclose(total_cost([acc], extract([acc], cost, exhaustive_limit=1), cost), best)


def test_a_generated_matmul_costs_its_flops_at_the_devices_contraction_rate():
    """``default_cost`` counts a matmul's generated reduce as one launch plus its flops at the device's
    ``contraction_gflops`` (float64 at half the rate) and its product as nothing (multiplied as it accumulates);
    a device without a register-tiled GEMM (rate 0) counts elements as for any reduce."""
    from zyx.graph.extract import contraction_flops, default_cost
    from zyx.kernel.target import DeviceInfo

    for dtype, per_flop in ((np.float32, 1 / 10), (np.float64, 2 / 10)):
        y = T((8, 16), dtype) @ T((16, 4), dtype)
        c = _reduce_class(y)
        (mm,) = [m for m in map(match_matmul, [c]) if m is not None]
        flops = contraction_flops([mm])
        tiled = default_cost(lambda _: DeviceInfo("host", "host", compute_units=2, contraction_gflops=10.0,
                                                  launch_overhead_ns=100), contractions=flops)
        assert math.isclose(tiled(c, c.nodes[0]), 100 + 2 * 8 * 16 * 4 * per_flop)
        assert tiled(c.srcs[0], c.srcs[0].nodes[0]) == 0
        plain = default_cost(lambda _: DeviceInfo("host", "host", compute_units=2), contractions=flops)
        assert plain(c, c.nodes[0]) == 8 * 16 * 4 / 2 and plain(c.srcs[0], c.srcs[0].nodes[0]) == 8 * 16 * 4 / 2


def test_debug_sched_names_the_winner(capfd):
    from zyx.utils import set_debug

    set_debug("sched")
    try:
        zyx.debug.schedule(T((64, 64)) @ T((64, 32)))
    finally:
        set_debug(0)
    err = capfd.readouterr().err
    assert "chose library:sgemm" in err and "generated:reduce=" in err


# ---- BLAS on and off -------------------------------------------------------------------------------------------


@pytest.fixture(params=["blas", "generated"])
def path(request):
    pl = registry().get("host")
    saved = list(pl.devices)
    if request.param == "generated":
        pl.devices[:] = [d for d in pl.devices if d.info().kind != "blas"]
    elif not any(d.info().kind == "blas" for d in pl.devices):
        pytest.skip("BLAS disabled in this configuration")
    schedule.clear_cache()
    yield request.param
    pl.devices[:] = saved
    schedule.clear_cache()


SHAPES = [((3,), (3,)), ((3,), (3, 4)), ((2, 3), (3,)), ((16, 32), (32, 8)), ((5, 2, 3), (3, 4)),
          ((2, 3), (5, 3, 4)), ((1, 2, 3), (4, 3, 2)), ((2, 1, 2, 3), (3, 3, 2)), ((0, 3), (3, 2)), ((1, 1), (1, 1))]


@pytest.mark.parametrize("sa,sb", SHAPES, ids=[f"{a}@{b}" for a, b in SHAPES])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_parity_blas_on_and_off(path, rng, sa, sb, dtype):
    a = rng.standard_normal(sa).astype(dtype)
    b = rng.standard_normal(sb).astype(dtype)
    A, B = zyx.Tensor(a), zyx.Tensor(b)
    kinds = [s.kind for s in zyx.debug.schedule(A @ B)]
    if path == "generated":
        assert "library" not in kinds
    tol = 1e-5 if dtype == "float32" else 1e-12
    assert_close(A @ B, a.astype(np.float64) @ b.astype(np.float64), rtol=tol, atol=tol)


def test_transposed_and_strided_operands(path, rng):
    a = rng.standard_normal((40, 30)).astype(np.float32)
    b = rng.standard_normal((50, 40)).astype(np.float32)
    A, B = zyx.Tensor(a), zyx.Tensor(b)
    for got, want in [(A.T @ B.T, a.T @ b.T), (A[::2].T @ B[:, ::2].T, a[::2].T @ b[:, ::2].T),
                      (A[5:25, 3:13] @ B[:10, 7:9], a[5:25, 3:13] @ b[:10, 7:9]), (B @ A, b @ a)]:
        assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_mlp_is_two_library_launches_and_two_kernels(path, rng):
    x = zyx.Tensor(rng.standard_normal((32, 64)).astype(np.float32))
    w1, b1 = zyx.Tensor(rng.standard_normal((64, 128)).astype(np.float32)), zyx.Tensor(np.ones(128, np.float32))
    w2, b2 = zyx.Tensor(rng.standard_normal((128, 10)).astype(np.float32)), zyx.Tensor(np.ones(10, np.float32))
    out = (x @ w1 + b1).relu() @ w2 + b2
    kinds = [s.kind for s in zyx.debug.schedule(out)]
    if path == "blas":
        assert kinds.count("library") == 2 and kinds.count("generated") <= 2
    xn, w1n, w2n = x.numpy(), w1.numpy(), w2.numpy()
    assert_close(out, np.maximum(xn @ w1n + 1, 0) @ w2n + 1, rtol=1e-4, atol=1e-3)


def test_linear_layer_weight_transposed(path, rng):
    x = zyx.Tensor(rng.standard_normal((6, 50, 80)).astype(np.float32))
    w = zyx.Tensor(rng.standard_normal((40, 80)).astype(np.float32))  # (out, in) as nn.Linear stores it
    y = x @ w.T
    if path == "blas":
        assert [s.kind for s in zyx.debug.schedule(y)] == ["library"]
    assert_close(y, x.numpy() @ w.numpy().T, rtol=1e-4, atol=1e-4)


def test_config_blas_disabled_leaves_only_the_generated_path(tmp_path):
    from zyx.backends.registry import Registry

    f = tmp_path / "c.json"
    f.write_text('{"blas": {"enabled": false}}')
    kinds = [d.info().kind for d in Registry(f).get("host").devices]
    assert kinds == ["host"]


# ---- bias adds -------------------------------------------------------------------------------------------------


def _bias_adds(t: zyx.Tensor):
    from zyx.graph.extract import Graph
    from zyx.graph.schedule import collect

    order, _ = collect([t.cls])
    return Graph(order, [t.cls]).bias_adds()


def test_a_matmul_plus_a_row_is_a_bias_add_in_either_order_and_any_rank():
    x, w, b = zyx.randn(4, 6, 8), zyx.randn(5, 8), zyx.randn(5)
    for t in (x @ w.T + b, b + x @ w.T, x[0] @ w.T + b):
        found = _bias_adds(t)
        assert len(found) == 1 and found[0].cls is t.cls and found[0].bias.base is b.cls
        assert found[0].bias.strides[-1] == 1 and not any(found[0].bias.strides[:-1])


def test_columns_matrices_and_transposed_results_are_not_bias_adds():
    x, w = zyx.randn(6, 8), zyx.randn(8, 5)
    assert not _bias_adds(x @ w + zyx.randn(6, 1))  # a column: varies along m
    assert not _bias_adds(x @ w + zyx.randn(6, 5))  # a whole matrix
    assert not _bias_adds((x @ w).T + zyx.randn(6))  # the result read transposed


def test_the_search_over_a_large_graph_is_bounded_in_class_visits(monkeypatch):
    """Many library alternatives (a deep stack of biased linears): the branch and bound examines at most
    ``SEARCH_VISITS`` / (classes) partial choices, each of which walks the graph once."""
    from zyx.graph import extract as ex

    calls = []
    real = ex._lower_bound
    monkeypatch.setattr(ex, "_lower_bound", lambda *a: calls.append(1) or real(*a))
    x = zyx.randn(64, 64)
    for _ in range(24):
        x = (x @ zyx.randn(64, 64).T + zyx.randn(64)).relu()
    order, _ = schedule.collect([x.cls])
    schedule.clear_cache()
    x.realize()
    assert len(calls) <= max(ex.MIN_SEARCH_BUDGET, ex.SEARCH_VISITS // len(order)) + 1

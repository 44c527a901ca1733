"""Index arithmetic simplification: equivalence by exhaustive evaluation, plus the rewrites fusion relies on."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from zyx.graph.lower import reshape_index
from zyx.kernel import ir
from zyx.ops import Ops


def evaluate(e: ir.Expr, env: dict) -> int:
    if e.op is Ops.CONST:
        return e.arg
    if e.op is Ops.RANGE:
        return env[e]
    a = [evaluate(s, env) for s in e.srcs]
    if e.op is Ops.ADD:
        return a[0] + a[1]
    if e.op is Ops.MUL:
        return a[0] * a[1]
    if e.op is Ops.DIV:
        return a[0] // a[1]
    if e.op is Ops.MOD:
        return a[0] % a[1]
    if e.op is Ops.MAX:
        return max(a)
    if e.op is Ops.MIN:
        return min(a)
    raise AssertionError(e.op)


@st.composite
def index_exprs(draw):
    rs = [ir.range_(i, draw(st.integers(1, 6))) for i in range(draw(st.integers(1, 3)))]
    e = ir.const(draw(st.integers(0, 5)), ir.index_dtype)
    for r in rs:
        e = e + r * draw(st.integers(0, 12))
    for _ in range(draw(st.integers(0, 3))):
        c = draw(st.integers(1, 8))
        e = ir.idiv(e, c) if draw(st.booleans()) else ir.mod(e, c)
        if draw(st.booleans()):
            e = e * draw(st.integers(1, 4)) + rs[0]
    return rs, e


@settings(max_examples=300, deadline=None)
@given(index_exprs())
def test_simplified_expression_has_correct_bounds(prog):
    rs, e = prog
    for combo in itertools.product(*(range(r.arg[1]) for r in rs)):
        v = evaluate(e, dict(zip(rs, combo)))
        assert e.vmin <= v <= e.vmax


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_reshape_roundtrip_is_identity(shape, data):
    """ravel(unravel(flat)) over any shape folds back to the flat index (what fused reshapes need)."""
    n = 1
    for s in shape:
        n *= s
    assume(n > 1)  # a range of size 1 is the constant 0, which is what the fold returns
    flat = ir.range_(0, n)
    idx = []
    acc = n
    for s in shape:
        acc //= s
        idx.append(ir.mod(ir.idiv(flat, acc), s))
    back = ir.const(0, ir.index_dtype)
    stride = 1
    for i, s in reversed(list(zip(idx, shape))):
        back = back + i * stride
        stride *= s
    assert back is flat


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 9), st.integers(-12, 12), st.integers(-20, 20), st.integers(1, 9),
       st.sampled_from([Ops.DIV, Ops.MOD]))
def test_floor_division_of_a_signed_index_has_correct_bounds(n, a, b, c, op):
    """``alu`` DIV / MOD of an index that may be negative (floor semantics, as the renderers' zyx_idiv / zyx_mod)
    by a positive constant bound the result, so comparisons on it fold: the clamped integer source rows of a
    linear resampling (``max((2i - 1) // 4, 0)``) need no range checks on their gathers."""
    r = ir.range_(0, n)
    e = ir.alu(op, r * a + b, ir.const(c, ir.index_dtype))
    values = [evaluate(e, {r: i}) for i in range(n)]
    assert e.vmin <= min(values) and max(values) <= e.vmax
    clamped = ir.alu(Ops.MAX, e, ir.const(0, ir.index_dtype))
    assert ir.alu(Ops.CMPLT, clamped, ir.const(0, ir.index_dtype)).arg is False
    if op is Ops.MOD:
        assert ir.alu(Ops.CMPLT, e, ir.const(c, ir.index_dtype)).arg is True


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.integers(-12, 12), st.integers(-20, 20), st.integers(2, 9))
def test_floor_quotient_and_remainder_of_a_signed_index_recombine(n, a, b, c):
    """``c * (e // c) + e % c`` folds back to ``e`` where ``e`` may be negative (floor semantics): the input
    gradient of a padded convolution shifts its flat index by -1 and re-splits it into rows, and the unfolded
    form left a division function call per tap in a loop that then did not vectorize."""
    r = ir.range_(0, n)
    e = r * a + b
    c_ = ir.const(c, ir.index_dtype)
    back = ir.alu(Ops.DIV, e, c_) * c + ir.alu(Ops.MOD, e, c_)
    assert back is e
    assert all(evaluate(back, {r: i}) == i * a + b for i in range(n))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.sampled_from([1, 2, 3, 4, 8, 16, 24, 64, -1, -8, -64])),
                min_size=1, max_size=3),
       st.integers(-40, 400), st.sampled_from([2, 3, 4, 6, 8, 16, 32, 48, 64, 128]))
def test_quotient_and_remainder_of_an_affine_index_equal_python_floor_division(terms, k0, c):
    rs = [ir.range_(i, n) for i, (n, _) in enumerate(terms)]
    e = ir.const(k0, ir.index_dtype)
    for r, (_, k) in zip(rs, terms):
        e = e + r * k
    q, m = ir.idiv(e, c), ir.mod(e, c)
    for combo in itertools.product(*(range(r.arg[1]) for r in rs)):
        v = k0 + sum(i * k for i, (_, k) in zip(combo, terms))
        env = dict(zip(rs, combo))
        assert (evaluate(q, env), evaluate(m, env)) == (v // c, v % c), (terms, k0, c, combo)


def test_a_division_by_a_multiple_of_the_high_digits_unit_keeps_only_the_high_digits():
    """``(256 r2 + r3) // 1024`` with ``0 <= r3 < 256`` is ``r2 // 4`` (and the remainder ``256 (r2 % 4) + r3``):
    a loop merged over a 4-D view with flips (a sort's paired stages) otherwise divided in its vector loop."""
    r2, r3 = ir.range_(0, 8), ir.range_(1, 256)
    e = r2 * 256 + r3
    assert ir.idiv(e, 1024) is ir.idiv(r2, 4)
    assert ir.mod(e, 1024) is ir.mod(r2, 4) * 256 + r3
    assert ir.idiv(e + 1024, 512) is ir.idiv(r2, 2) + 2


def test_basic_rewrites():
    r = ir.range_(0, 8)
    q = ir.range_(1, 4)
    e = r * 4 + q
    assert ir.idiv(e, 4) is r
    assert ir.mod(e, 4) is q
    assert ir.mod(r, 16) is r
    assert ir.idiv(r, 16).op is Ops.CONST
    assert ir.idiv(ir.idiv(r * 6 + q, 2), 3) is ir.idiv(r * 6 + q, 6)
    assert (r + 0) is r and (r * 1) is r
    assert ir.alu(Ops.CMPLT, r, ir.const(8, ir.index_dtype)).arg is True
    assert ir.alu(Ops.CMPLT, r, ir.const(0, ir.index_dtype)).arg is False


def test_interning_makes_equal_expressions_identical():
    r = ir.range_(3, 5)
    assert (r * 2 + 1) is (1 + 2 * r)
    x = ir.load(0, ir.index_dtype, r)
    assert ir.alu(Ops.MAX, x, r) is ir.alu(Ops.MAX, x, r)


def test_gate_false_removes_load():
    r = ir.range_(0, 4)
    assert ir.load(0, ir.index_dtype, r, ir.const(False, ir.dtypes.bool_)).op is Ops.CONST
    assert len(ir.load(0, ir.index_dtype, r, ir.const(True, ir.dtypes.bool_)).srcs) == 1


def _ops_in(e: ir.Expr) -> set:
    return {e.op} | set().union(*(_ops_in(s) for s in e.srcs))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.data())
def test_reshape_index_reads_the_element_numpy_reads(factors, data):
    """Any regrouping of the same elements (ones inserted anywhere): the source index of every output position is
    the one NumPy's row-major reshape reads."""
    def group(fs):
        cuts = sorted(data.draw(st.sets(st.integers(1, max(len(fs) - 1, 1)), max_size=len(fs) - 1)))
        parts = [fs[a:b] for a, b in zip([0, *cuts], [*cuts, len(fs)])]
        shape = [int(np.prod(p)) for p in parts]
        for _ in range(data.draw(st.integers(0, 2))):
            shape.insert(data.draw(st.integers(0, len(shape))), 1)
        return tuple(shape)

    out_shape, in_shape = group(factors), group(factors)
    rs = [ir.range_(i, s) for i, s in enumerate(out_shape)]
    src = reshape_index(tuple(rs), out_shape, in_shape)
    for combo in itertools.product(*map(range, out_shape)):
        env = dict(zip(rs, combo))
        want = np.unravel_index(np.ravel_multi_index(combo, out_shape), in_shape)
        assert tuple(evaluate(e, env) for e in src) == tuple(int(w) for w in want)


def test_reshape_that_merges_axes_divides_nothing():
    """(32, 32, 4, 4, 16, 16) read from (32, 1, 512, 256): each source axis is a sum of scaled output indices (the
    flatten-and-unflatten of the whole index had divided by 256, 512 and 131072)."""
    out_shape = (32, 32, 4, 4, 16, 16)
    src = reshape_index(tuple(ir.range_(i, s) for i, s in enumerate(out_shape)), out_shape, (32, 1, 512, 256))
    assert not set().union(*map(_ops_in, src)) & {Ops.DIV, Ops.MOD}

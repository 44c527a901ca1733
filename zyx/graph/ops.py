"""Graph builders: one function per node kind, computing the result's shape and dtype.

Callers (the Tensor layer) validate user input; these functions assume operands already agree (same shape
for elementwise ops, same device) and only assert it.
"""

from __future__ import annotations

import math

from zyx import dtypes
from zyx.dtypes import DType
from zyx.graph.node import Class, make, make_const
from zyx.ops import BINARY, COMPARE, IDEMPOTENT, REDUCE_OPS, SCAN_OPS, Ops

# (value, dtype) -> dtypes.as_python(value, dtype), for nonzero, non-NaN Python ints and floats. Exact: values
# that compare equal (1, 1.0, True) give equal results in every dtype, and the ones that compare equal while
# differing (0.0, -0.0, 0) or never compare equal (NaN) are not kept. Bounded: cleared when full.
_ROUNDED: dict = {}
_ROUNDED_MAX = 4096


def const(value, shape: tuple[int, ...], dtype: DType, device: str) -> Class:
    t = type(value)
    if (t is float or t is int) and value and value == value:
        k = (value, dtype)
        v = _ROUNDED.get(k)
        if v is None:
            v = dtypes.as_python(value, dtype)
            if len(_ROUNDED) >= _ROUNDED_MAX:
                _ROUNDED.clear()
            _ROUNDED[k] = v
    elif t is int and not value:  # integer zero (relu's 0): as_python's result, without NumPy
        v = 0.0 if dtype.kind == "f" else (False if dtype.kind == "b" else 0)
    else:
        v = dtypes.as_python(value, dtype)
    return make_const(v, tuple(shape), dtype, device)


def iota(n: int, dtype: DType, device: str) -> Class:
    return make(Ops.IOTA, (), None, (n,), dtype, device)


def unary(op: Ops, x: Class) -> Class:
    d = dtypes.bool_ if op in COMPARE else x.dtype
    return make(op, (x,), None, x.shape, d, x.device)


def cast(x: Class, dtype: DType) -> Class:
    if x.dtype is dtype:
        return x
    return make(Ops.CAST, (x,), None, x.shape, dtype, x.device)


def binary(op: Ops, a: Class, b: Class) -> Class:
    """``op(a, b)``; a product with a constant 1 is the other operand itself (exact in every dtype), so that
    the ones-gradient of a sum leaves matmul and reduce patterns as they were."""
    assert op in BINARY and a.shape == b.shape and a.device == b.device, (op, a, b)
    if op is Ops.MUL and a.dtype is b.dtype:
        if _op(b) is Ops.CONST and b.nodes[0].arg == 1:
            return a
        if _op(a) is Ops.CONST and a.nodes[0].arg == 1:
            return b
    d = dtypes.bool_ if op in COMPARE else a.dtype
    return make(op, (a, b), None, a.shape, d, a.device)


def where(c: Class, a: Class, b: Class) -> Class:
    assert c.shape == a.shape == b.shape and a.dtype is b.dtype
    return make(Ops.WHERE, (c, a, b), None, a.shape, a.dtype, a.device)


EMPTY_REDUCE = {Ops.ADD: 0, Ops.MUL: 1, Ops.OR: False, Ops.AND: True}  # the value of a reduce over no elements


def reduce(op: Ops, x: Class, axes: tuple[int, ...]) -> Class:
    """Reduce over ``axes`` keeping them as size 1. A reduce of an expanded value is computed before the expand
    (once per distinct value, not once per copy) when no reduced axis was expanded, or when the op ignores
    copies (max, min, or, and: those axes are dropped). Over an empty axis it is ``EMPTY_REDUCE``'s constant
    (max and min have none: the tensor layer raises first)."""
    assert op in REDUCE_OPS, op
    xs = x.shape
    if len(axes) == 1:  # the common case, without a generator (a few us each when the caches are cold)
        axes = axes if xs[axes[0]] != 1 else ()
    else:
        axes = tuple(sorted(a for a in axes if xs[a] != 1))
    if not axes:
        return x
    shape = list(xs)
    for a in axes:
        shape[a] = 1
    shape = tuple(shape)
    if 0 in xs and op in EMPTY_REDUCE and any(xs[a] == 0 for a in axes):
        return const(EMPTY_REDUCE[op], shape, x.dtype, x.device)
    if x.nodes and x.nodes[0].op is Ops.EXPAND:
        src = x.nodes[0].srcs[0]
        copied = {i for i, (s, o) in enumerate(zip(src.shape, x.shape)) if s != o}
        if op in IDEMPOTENT or not copied & set(axes):
            return expand(reduce(op, src, tuple(a for a in axes if a not in copied)), shape)
    return make(Ops.REDUCE, (x,), (op, axes), shape, x.dtype, x.device)


def scan(op: Ops, x: Class, axis: int) -> Class:
    """Inclusive running ``op`` (``SCAN_OPS``) along ``axis``."""
    assert op in SCAN_OPS, op
    if x.shape[axis] == 1:
        return x
    return make(Ops.SCAN, (x,), (op, axis), x.shape, x.dtype, x.device)


def _op(x: Class) -> Ops:
    """``x.op`` without the property call: a realized class has no nodes."""
    n = x.nodes
    return n[0].op if n else Ops.BUFFER


def reshape(x: Class, shape: tuple[int, ...]) -> Class:
    shape = tuple(shape)
    if shape == x.shape:
        return x
    assert math.prod(shape) == math.prod(x.shape), (x.shape, shape)
    op = _op(x)
    if op is Ops.RESHAPE:
        x = x.nodes[0].srcs[0]
        if x.shape == shape:
            return x
        op = _op(x)
    if op is Ops.CONST:
        return const(x.nodes[0].arg, shape, x.dtype, x.device)
    return make(Ops.RESHAPE, (x,), shape, shape, x.dtype, x.device)


def permute(x: Class, order: tuple[int, ...]) -> Class:
    order = tuple(order)
    if order == tuple(range(len(order))):
        return x
    op = _op(x)
    if op is Ops.CONST:
        return const(x.nodes[0].arg, tuple(x.shape[o] for o in order), x.dtype, x.device)
    if op is Ops.PERMUTE:
        inner = x.nodes[0].arg
        return permute(x.nodes[0].srcs[0], tuple(inner[o] for o in order))
    return make(Ops.PERMUTE, (x,), order, tuple(x.shape[o] for o in order), x.dtype, x.device)


def expand(x: Class, shape: tuple[int, ...]) -> Class:
    shape = tuple(shape)
    if shape == x.shape:
        return x
    assert len(shape) == len(x.shape) and all(s == o or s == 1 for s, o in zip(x.shape, shape)), (x.shape, shape)
    if _op(x) is Ops.CONST:
        return const(x.nodes[0].arg, shape, x.dtype, x.device)
    return make(Ops.EXPAND, (x,), shape, shape, x.dtype, x.device)


_ZERO_FILL = {"f": 0.0, "b": False}  # a fill of integer 0 in each dtype kind (``as_python``'s value), ints 0


def pad(x: Class, pads: tuple[tuple[int, int], ...], fill=0) -> Class:
    """Pad every axis by (before, after) elements of ``fill``. (One loop, no generators, and a zero fill without
    NumPy: a transposed convolution's col2im builds a pad per kernel tap.)"""
    assert len(pads) == len(x.shape), (pads, x.shape)
    norm, shape, padded = [], [], False
    for s, (a, b) in zip(x.shape, pads):
        a, b = int(a), int(b)
        padded = padded or a != 0 or b != 0
        norm.append((a, b))
        shape.append(s + a + b)
    if not padded:
        return x
    fill = _ZERO_FILL.get(x.dtype.kind, 0) if type(fill) is int and fill == 0 else dtypes.as_python(fill, x.dtype)
    return make(Ops.PAD, (x,), (tuple(norm), fill), tuple(shape), x.dtype, x.device)


def shrink(x: Class, spec: tuple[tuple[int, int, int], ...]) -> Class:
    """Slice every axis by (start, stop, step) as Python's ``range``; negative steps flip."""
    shape, arg, whole = [], [], True
    for (a, b, c), s in zip(spec, x.shape):
        n = len(range(a, b, c))
        whole = whole and n == s and a == 0 and c == 1
        shape.append(n)
        arg.append((a, c))
    if whole and len(spec) == len(x.shape):
        return x
    shape = tuple(shape)
    if _op(x) is Ops.CONST:
        return const(x.nodes[0].arg, shape, x.dtype, x.device)
    return make(Ops.SHRINK, (x,), tuple(arg), shape, x.dtype, x.device)


def gather(x: Class, index: Class, axis: int) -> Class:
    shape = x.shape[:axis] + index.shape + x.shape[axis + 1:]
    return make(Ops.GATHER, (x, index), axis, shape, x.dtype, x.device)


def take_along(x: Class, index: Class, axis: int) -> Class:
    """``x`` at every position of ``index`` with its ``axis`` coordinate replaced by the index value there
    (NumPy's ``take_along_axis`` without broadcasting): the shapes agree off ``axis``."""
    assert len(x.shape) == len(index.shape) and all(a == b for d, (a, b) in enumerate(zip(x.shape, index.shape))
                                                    if d != axis), (x.shape, index.shape, axis)
    return make(Ops.TAKE_ALONG, (x, index), axis, index.shape, x.dtype, x.device)


def copy_to(x: Class, device: str) -> Class:
    return make(Ops.COPY, (x,), device, x.shape, x.dtype, device)


def contiguous(x: Class) -> Class:
    return make(Ops.CONTIGUOUS, (x,), None, x.shape, x.dtype, x.device)

"""Attention recognition: ``softmax(q·kᵀ·scale + mask)·v`` as ``@``, ``*`` and ``Tensor.softmax`` build it.

``match_attention(cls)`` recognises, for the class ``cls`` that ``weights @ v`` returns (the matmul's sum with its
reduced axis dropped, optionally cast to the inputs' float dtype):

- the outer matmul's left operand is, read straight (no transpose, no broadcast, offset 0), the softmax over the
  last axis of the logits: ``e / sum(e, -1)`` with ``e = exp(x - max(x, -1))``, both reductions over the last axis
  of exactly those classes (``Tensor.softmax``; a detached max is the same class);
- the logits ``x`` are ``scores * c`` (either operand order), ``scores / c`` or ``scores`` (scale 1), each
  optionally plus a mask (either operand order), where ``c`` is a scalar constant (a ``CONST`` through movement
  ops, finite) and ``scores`` is the result of a matmul ``q @ kᵀ`` with the same batch axes as the outer one.

When ``weights @ v`` casts its float32 sum back to half inputs' dtype, both the uncast result and the cast are
matched (each computes the attention, in its own dtype). The q, k, v (and mask) ``View``s have strides over
``batch + (L, E)``, ``batch + (S, E)``, ``batch + (S, Ev)`` (and ``batch + (L, S)``): a layout such as the
``(B, L, H, D) -> (B, H, L, D)`` permute is in the strides, never a copy. The match describes values, not layouts:
a ``v`` read transposed (``P @ vᵀ``) is an attention whose value tensor is ``vᵀ``, reported with those strides
(devices needing a unit head-dim stride decline it). Devices decide dtypes, sizes and layouts.

Not matched: a softmax over another axis, a max- instead of a sum-reduce, a scale applied after the softmax, a
non-constant scale, a softmax read transposed or broadcast by the outer matmul (a contraction over its query
axis), logits that are not a matmul result, a log-softmax, or anything whose operands are not views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zyx.dtypes import DType
from zyx.graph.match import View, match_matmul, view_of
from zyx.graph.node import Class, contiguous_strides
from zyx.ops import Ops

_MOVES = (Ops.RESHAPE, Ops.PERMUTE, Ops.EXPAND, Ops.SHRINK)


@dataclass(frozen=True)
class Attention:
    """``cls[..., l, :] = sum_s softmax_s(scale * q[..., l, :]·k[..., s, :] + mask[..., l, s]) * v[..., s, :]``.

    ``batch`` are all leading axes (the last one is the heads, when there are any); ``cls.shape`` is
    ``batch + (L, Ev)`` (contiguous output). ``dtype`` is the dtype the logits and the softmax are computed in;
    each view keeps its base's dtype (and the matmul's float widening, in ``cast``).
    """

    cls: Class
    batch: tuple[int, ...]
    L: int
    S: int
    E: int
    Ev: int
    q: View  # strides over batch + (L, E)
    k: View  # strides over batch + (S, E)
    v: View  # strides over batch + (S, Ev)
    mask: View | None  # strides over batch + (L, S)
    scale: float
    dtype: DType

    @property
    def heads(self) -> int:
        return self.batch[-1] if self.batch else 1

    @property
    def batch_size(self) -> int:
        """The leading axes before the heads, flattened."""
        return math.prod(self.batch[:-1])

    @property
    def out_dtype(self) -> DType:
        return self.cls.dtype

    @property
    def out_strides(self) -> tuple[int, ...]:
        return contiguous_strides(self.cls.shape)

    @property
    def flops(self) -> int:
        """The two matmuls' multiply-adds (the softmax is not counted)."""
        return 2 * math.prod(self.batch) * self.L * self.S * (self.E + self.Ev)


def _live(c: Class, op: Ops) -> bool:
    return not c.realized and c.op is op


def _matmul_reduce(c: Class) -> Class | None:
    """The sum-reduce of the matmul whose result (as ``@`` returns it) is ``c``: an optional float cast of the
    reshape that drops the reduced (last, kept as size 1) axis of a ``match_matmul`` reduce."""
    if _live(c, Ops.CAST):
        if not (c.dtype.is_float and c.srcs[0].dtype.is_float):
            return None
        c = c.srcs[0]
    if not _live(c, Ops.RESHAPE):
        return None
    r = c.srcs[0]
    if not _live(r, Ops.REDUCE) or r.shape[:-1] != c.shape or r.shape[-1] != 1:
        return None
    rop, axes = r.node.arg
    if rop != Ops.ADD or tuple(axes) != (len(r.shape) - 1,) or len(r.shape) < 3 or match_matmul(r) is None:
        return None
    return r


def _operands(r: Class) -> list[tuple[View, View]]:
    """The ways to read the matmul reduce ``r`` as (left, right) operand views over its product's shape
    ``batch + (m, n, k)``: the left one constant along n, the right one constant along m."""
    prod = r.srcs[0]
    m, n = prod.shape[-3], prod.shape[-2]
    a, b = (view_of(s) for s in prod.srcs)
    return [(x, y) for x, y in ((a, b), (b, a)) if (n == 1 or x.strides[-2] == 0) and (m == 1 or y.strides[-3] == 0)]


def _drop(strides: tuple[int, ...], axis: int) -> tuple[int, ...]:
    s = list(strides)
    del s[axis]
    return tuple(s)


def _constant(c: Class) -> float | None:
    """The value of a scalar constant read through movement ops, or None (not constant, not finite)."""
    while not c.realized and c.op in _MOVES:
        c = c.srcs[0]
    if not _live(c, Ops.CONST):
        return None
    value = c.node.arg
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _scaled_scores(x: Class) -> tuple[Class, float] | None:
    """(the q @ kᵀ reduce, scale) when ``x`` is ``scores * c``, ``c * scores``, ``scores / c`` or ``scores``."""
    if _live(x, Ops.MUL):
        for s, c in (x.srcs, x.srcs[::-1]):
            value, r = _constant(c), _matmul_reduce(s)
            if value is not None and r is not None:
                return r, value
        return None
    if _live(x, Ops.DIV):
        value, r = _constant(x.srcs[1]), _matmul_reduce(x.srcs[0])
        return (r, 1.0 / value) if value and r is not None else None
    r = _matmul_reduce(x)
    return (r, 1.0) if r is not None else None


def _last_axis_reduce_of(c: Class, rop: Ops, src: Class) -> bool:
    """``c`` is ``src`` reduced with ``rop`` over its last axis (kept), broadcast back to ``src``'s shape."""
    if _live(c, Ops.EXPAND):
        c = c.srcs[0]
    if not _live(c, Ops.REDUCE) or c.srcs[0] is not src or c.shape != src.shape[:-1] + (1,):
        return False
    op, axes = c.node.arg
    return op == rop and tuple(axes) == (len(src.shape) - 1,)


def _softmax_input(p: Class) -> Class | None:
    """``x`` when ``p`` is ``Tensor.softmax(x, -1)``: ``e / sum(e, -1)`` with ``e = exp(x - max(x, -1))``."""
    if not _live(p, Ops.DIV):
        return None
    e, den = p.srcs
    if not _live(e, Ops.EXP) or not _last_axis_reduce_of(den, Ops.ADD, e):
        return None
    z = e.srcs[0]
    if not _live(z, Ops.SUB) or not _last_axis_reduce_of(z.srcs[1], Ops.MAX, z.srcs[0]):
        return None
    return z.srcs[0]


def _read_straight(view: View, shape: tuple[int, ...]) -> bool:
    """``view`` (over the outer product's ``batch + (L, Ev, S)``) reads its base of shape ``batch + (L, S)``
    element for element: contiguous strides on batch, L and S, stride 0 along Ev, no offset."""
    batch, L, S = shape[:-3], shape[-3], shape[-1]
    if view.offset != 0 or view.base.shape != batch + (L, S):
        return False
    cs = contiguous_strides(view.base.shape)
    want = cs[:-2] + (cs[-2], 0, cs[-1])
    return all(size == 1 or got == w for size, got, w in zip(shape, view.strides, want))


def match_attention(c: Class) -> Attention | None:
    """The attention ``c`` computes, or None (see the module docstring for what matches)."""
    r2 = _matmul_reduce(c)
    if r2 is None:
        return None
    shape2 = r2.srcs[0].shape
    batch, (L, Ev, S) = shape2[:-3], shape2[-3:]
    found = [(x, vv) for pv, vv in _operands(r2)
             if (x := _softmax_input(pv.base)) is not None and _read_straight(pv, shape2)]
    if not found:
        return None
    x, vv = found[0]
    mask, scaled = None, None
    if _live(x, Ops.ADD):
        for s, m in (x.srcs, x.srcs[::-1]):
            scaled = _scaled_scores(s)
            if scaled is not None:
                mask = m
                break
    else:
        scaled = _scaled_scores(x)
    if scaled is None:
        return None
    r1, scale = scaled
    shape1 = r1.srcs[0].shape
    if shape1[:-1] != batch + (L, S):
        return None
    ops1 = _operands(r1)
    if not ops1:
        return None
    qv, kv = ops1[0]  # two readings only when L == S == 1, where q·kᵀ is symmetric
    E = shape1[-1]
    q = View(qv.base, _drop(qv.strides, -2), qv.offset, qv.cast)
    k = View(kv.base, _drop(kv.strides, -3), kv.offset, kv.cast)
    vs = _drop(vv.strides, -3)  # over batch + (Ev, S)
    v = View(vv.base, vs[:-2] + (vs[-1], vs[-2]), vv.offset, vv.cast)
    mview = view_of(mask) if mask is not None else None
    if mview is not None and mask.shape != batch + (L, S):
        return None
    return Attention(c, batch, L, S, E, Ev, q, k, v, mview, scale, x.dtype)

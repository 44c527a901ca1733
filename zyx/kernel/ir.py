"""Kernel IR: an interned, typed expression DAG plus the stores of one kernel.

Invariants:
- ``Expr`` nodes are interned: structurally equal expressions are the same object, so ``is`` is equality
  and a dict keyed by ``Expr`` is CSE.
- Integer expressions carry bounds (``vmin``, ``vmax``) that hold for the value as computed, with wraparound:
  an interval that would leave its dtype's range becomes the whole range (``_sound_bounds``), so narrow
  integers that overflow are never folded from wrong bounds. Constructors simplify with them (``ir.add``,
  ``ir.mul``, ``ir.idiv``, ``ir.mod``, comparisons); sums and products are reassociated only in the ring of
  their dtype (constants wrap), which wraparound preserves. Integer ``DIV``/``MOD`` floor (NumPy semantics);
  the division simplifications are applied only to provably non-negative numerators.
- ``LOAD`` may carry a gate: a false gate yields 0 and touches no memory.
- ``REDUCE`` owns its ``RANGE`` nodes; ranges are unique to the reduce or output loop that declares them.
- ``SCAN`` runs along an output loop: that loop is the kernel's innermost, serial, and never merged, split or
  reordered (``Kernel.scan_ranges``).
- ``STASH``/``LOCAL`` (host only, made last by ``opt.stash_row_values``): a ``STASH`` inside a single-range reduce
  writes its value to a local array at the reduce's range; a ``LOCAL`` reads it and depends on that reduce, so
  every read is placed after the writes and within the same iteration of the loops around the reduce.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zyx import dtypes
from zyx.dtypes import DType
from zyx.ops import COMPARE, REDUCE_OPS, SCAN_OPS, Ops

if TYPE_CHECKING:
    from collections.abc import Collection, Iterator

    from zyx.kernel.gpu import Geometry
    from zyx.kernel.opt import GemmTile

index_dtype = dtypes.int64

_interned: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


class Expr:
    """One interned IR node. Build through the constructors below, never directly."""

    __slots__ = ("op", "dtype", "srcs", "arg", "vmin", "vmax", "skey", "_ranges", "__weakref__")

    op: Ops
    dtype: DType
    srcs: tuple[Expr, ...]
    arg: object
    vmin: int | float
    vmax: int | float
    skey: bytes

    def __repr__(self) -> str:
        if self.op is Ops.CONST:
            return f"{self.arg!r}"
        if self.op is Ops.RANGE:
            return f"r{self.arg[0]}"
        inner = ", ".join(repr(s) for s in self.srcs)
        extra = f"; {self.arg}" if self.arg is not None else ""
        return f"{self.op.name}({inner}{extra})"

    def __lt__(self, other: Expr) -> bool:
        return self.skey < other.skey

    @property
    def ranges(self) -> frozenset[Expr]:
        """The loop ranges this value depends on (a reduce hides its own)."""
        if self._ranges is None:
            if self.op is Ops.RANGE:
                r = frozenset((self,))
            elif self.op is Ops.REDUCE:
                r = self.srcs[0].ranges - frozenset(self.arg[1])
            else:
                r = frozenset().union(*(s.ranges for s in self.srcs)) if self.srcs else frozenset()
            self._ranges = r
        return self._ranges

    # arithmetic sugar for index code
    def __add__(self, o):
        return add(self, _c(o))

    __radd__ = __add__

    def __mul__(self, o):
        return mul(self, _c(o))

    __rmul__ = __mul__

    def __floordiv__(self, o: int):
        return idiv(self, o)

    def __mod__(self, o: int):
        return mod(self, o)

    def __neg__(self):
        return mul(self, const(-1, self.dtype))

    def __sub__(self, o):
        return add(self, mul(_c(o), const(-1, index_dtype)))


def _c(x) -> Expr:
    return x if isinstance(x, Expr) else const(x, index_dtype)


def _dtype_bounds(d: DType) -> tuple:
    if d.kind == "b":
        return 0, 1
    if d.is_int:
        return dtypes.min_max(d)
    return -math.inf, math.inf


def _sound_bounds(bounds: tuple | None, dtype: DType) -> tuple:
    """The value interval of a ``dtype`` result whose exact (non-wrapping) interval is ``bounds``: an interval
    that leaves the dtype's range means the value may have wrapped, so nothing is known beyond the range."""
    lo, hi = full = _dtype_bounds(dtype)
    if bounds is None or bounds[0] < lo or bounds[1] > hi:
        return full
    return bounds


def _make(op: Ops, dtype: DType, srcs: tuple[Expr, ...] = (), arg=None, bounds: tuple | None = None) -> Expr:
    if op is Ops.REDUCE:
        karg = (arg[0], tuple(map(id, arg[1])))
    elif type(arg) is float:
        karg = ("f", arg.hex())  # -0.0 and 0.0 are different constants; every NaN is the same one
    else:
        karg = arg
    key = (op, dtype.name, tuple(id(s) for s in srcs), karg)
    e = _interned.get(key)
    if e is not None:
        return e
    e = object.__new__(Expr)
    e.op, e.dtype, e.srcs, e.arg = op, dtype, srcs, arg
    e.vmin, e.vmax = _sound_bounds(bounds, dtype)
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{op.value}|{dtype.name}|{arg if op is not Ops.REDUCE else arg[0]!r}|".encode())
    for s in srcs:
        h.update(s.skey)
    if op is Ops.REDUCE:
        for r in arg[1]:
            h.update(r.skey)
    e.skey = h.digest()
    e._ranges = None
    _interned[key] = e
    return e


# ---------------------------------------------------------------------------------------------------------------
# leaves


def const(value, dtype: DType) -> Expr:
    value = dtypes.as_python(value, dtype)
    if dtype.is_int:
        value = dtypes.wrap(value, dtype)
    b = (value, value) if not (isinstance(value, float) and math.isnan(value)) else (-math.inf, math.inf)
    return _make(Ops.CONST, dtype, (), value, b)


def range_(rid: int, size: int) -> Expr:
    return _make(Ops.RANGE, index_dtype, (), (rid, size), (0, max(size - 1, 0)))


def var(param: int, dtype: DType) -> Expr:
    return _make(Ops.VAR, dtype, (), param)


def load(param: int, dtype: DType, index: Expr, gate: Expr | None = None) -> Expr:
    if gate is not None and gate.op is Ops.CONST:
        if not gate.arg:
            return const(0, dtype)
        gate = None
    return _make(Ops.LOAD, dtype, (index,) if gate is None else (index, gate), param)


# ---------------------------------------------------------------------------------------------------------------
# integer index arithmetic with bounds-based simplification


def affine_coefficient(e: Expr, r: Expr) -> int | None:
    """The coefficient of range ``r`` in the integer index ``e`` when ``e`` is affine in ``r`` (0 when ``e`` does
    not depend on it), else None (``r`` under a division, a modulo, a product of ranges...)."""
    if r not in e.ranges:
        return 0
    if e is r:
        return 1
    if e.op is Ops.ADD:
        a, b = affine_coefficient(e.srcs[0], r), affine_coefficient(e.srcs[1], r)
        return None if a is None or b is None else a + b
    if e.op is Ops.MUL:
        x, y = e.srcs
        if y.op is Ops.CONST:
            x, y = y, x
        if x.op is Ops.CONST and e.dtype.is_int:
            c = affine_coefficient(y, r)
            return None if c is None else c * x.arg
    return None


def _linear(e: Expr) -> tuple[dict[Expr, int], int]:
    """Decompose an integer expression into sum(coef * atom) + constant."""
    if e.op is Ops.CONST:
        return {}, e.arg
    if e.op is Ops.ADD:
        t0, c0 = _linear(e.srcs[0])
        t1, c1 = _linear(e.srcs[1])
        for k, v in t1.items():
            t0[k] = t0.get(k, 0) + v
        return t0, c0 + c1
    if e.op is Ops.MUL and e.srcs[1].op is Ops.CONST:
        t, c = _linear(e.srcs[0])
        k = e.srcs[1].arg
        return {a: v * k for a, v in t.items()}, c * k
    return {e: 1}, 0


def _fold_divmod_pairs(terms: dict[Expr, int]) -> None:
    """k*(a % m) + k*m*(a // m) -> k*a, where a // m of a = x // c is interned as x // (c*m); repeats
    until nothing folds (so digit-by-digit unravel/ravel chains collapse back to the flat index)."""
    changed = True
    while changed:
        changed = False
        for atom in [a for a in terms if a is not _CONST_SLOT and a.op is Ops.MOD]:
            if atom not in terms or atom.srcs[1].op is not Ops.CONST:
                continue
            a, m = atom.srcs[0], atom.srcs[1].arg
            k = terms[atom]
            if a.op is Ops.DIV and a.srcs[1].op is Ops.CONST:
                qkey = (Ops.DIV, atom.dtype.name, (id(a.srcs[0]),), a.srcs[1].arg * m)
            else:
                qkey = (Ops.DIV, atom.dtype.name, (id(a),), m)
            q = _div_index.get(qkey)
            if q is None or terms.get(q) != k * m:
                continue
            del terms[atom], terms[q]
            lin, c0 = _linear(a)
            for t, v in lin.items():
                terms[t] = terms.get(t, 0) + v * k
            terms[_CONST_SLOT] = terms.get(_CONST_SLOT, 0) + c0 * k
            changed = True


_div_index: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # (DIV, dtype, (id(x),), c) -> x // c


_CONST_SLOT = None  # key for a constant produced while folding; popped by _rebuild


def _rebuild(terms: dict, c: int, dtype: DType) -> Expr:
    c += terms.pop(_CONST_SLOT, 0)
    out: Expr | None = None
    for atom in sorted((a for a, v in terms.items() if v != 0), key=lambda a: a.skey):
        k = terms[atom]
        t = atom if k == 1 else _make(Ops.MUL, dtype, (atom, const(k, dtype)), None,
                                      _mul_bounds(atom, k))
        out = t if out is None else _make(Ops.ADD, dtype, (out, t), None, (out.vmin + t.vmin, out.vmax + t.vmax))
    if out is None:
        return const(c, dtype)
    if c != 0:
        out = _make(Ops.ADD, dtype, (out, const(c, dtype)), None, (out.vmin + c, out.vmax + c))
    return out


def _mul_bounds(a: Expr, k: int) -> tuple:
    lo, hi = a.vmin * k, a.vmax * k
    return (min(lo, hi), max(lo, hi))


def _is_index(*es: Expr) -> bool:
    return all(e.dtype.is_int for e in es)


def add(a: Expr, b: Expr) -> Expr:
    if _is_index(a, b) and a.dtype is b.dtype:
        t0, c0 = _linear(a)
        t1, c1 = _linear(b)
        for k, v in t1.items():
            t0[k] = t0.get(k, 0) + v
        _fold_divmod_pairs(t0)
        return _rebuild(t0, c0 + c1, a.dtype)
    return alu(Ops.ADD, a, b)


def mul(a: Expr, b: Expr) -> Expr:
    if _is_index(a, b) and a.dtype is b.dtype:
        if a.op is Ops.CONST:
            a, b = b, a
        if b.op is Ops.CONST:
            if b.arg == 0:
                return const(0, a.dtype)
            t, c = _linear(a)
            return _rebuild({k: v * b.arg for k, v in t.items()}, c * b.arg, a.dtype)
        a, b = sorted((a, b))
        return _make(Ops.MUL, a.dtype, (a, b), None, _bounds(Ops.MUL, a.dtype, (a, b)))
    return alu(Ops.MUL, a, b)


def _split_digit(terms: dict[Expr, int], k0: int, c: int, dtype: DType) -> tuple[Expr, Expr, int] | None:
    """``(q, low, g)`` with ``sum(terms) + k0 == g * q + low``, ``0 <= low < g``, ``1 < g < c`` and ``g`` dividing
    ``c``, so that ``a // c == q // (c / g)`` and ``a % c == g * (q % (c / g)) + low`` (floor semantics, any sign
    of ``q``): the terms whose coefficients ``g`` divides are the high digits, the rest fit below ``g``. None when no
    such split exists (e.g. ``(256 r2 + r3) // 1024`` with ``0 <= r3 < 256`` is ``r2 // 4``)."""
    order = sorted(terms.items(), key=lambda kv: -abs(kv[1]))
    for i in range(1, len(order)):
        g = math.gcd(c, *(v for _, v in order[:i]))
        if g <= 1 or g >= c:
            continue
        low = _rebuild(dict(order[i:]), k0 % g, dtype)
        if low.vmin >= 0 and low.vmax < g:
            return _rebuild({k: v // g for k, v in order[:i]}, k0 // g, dtype), low, g
    return None


def idiv(a: Expr, c: int) -> Expr:
    """a // c for a non-negative index expression ``a`` and a positive constant ``c``."""
    assert c > 0
    if c == 1:
        return a
    if a.vmin >= 0:
        if a.vmax < c:
            return const(0, a.dtype)
        terms, k0 = _linear(a)
        g = math.gcd(c, k0, *terms.values())
        if g > 1:
            return idiv(_rebuild({k: v // g for k, v in terms.items()}, k0 // g, a.dtype), c // g)
        whole = {k: v // c for k, v in terms.items() if v % c == 0}
        rest = {k: v for k, v in terms.items() if v % c != 0}
        if whole or k0 >= c:
            r = _rebuild(dict(rest), k0 % c, a.dtype)
            if r.vmin >= 0:
                return add(_rebuild(whole, k0 // c, a.dtype), idiv(r, c))
        split = _split_digit(terms, k0, c, a.dtype)
        if split is not None:
            return idiv(split[0], c // split[2])
        if a.op is Ops.DIV and a.srcs[1].op is Ops.CONST and a.srcs[0].vmin >= 0:
            return idiv(a.srcs[0], a.srcs[1].arg * c)
        q = _make(Ops.DIV, a.dtype, (a, const(c, a.dtype)), None, (a.vmin // c, a.vmax // c))
        _div_index[(Ops.DIV, a.dtype.name, (id(a),), c)] = q
        return q
    return alu(Ops.DIV, a, const(c, a.dtype))


def mod(a: Expr, c: int) -> Expr:
    """a % c for a non-negative index expression ``a`` and a positive constant ``c``."""
    assert c > 0
    if c == 1:
        return const(0, a.dtype)
    if a.vmin >= 0:
        if a.vmax < c:
            return a
        terms, k0 = _linear(a)
        rest = {k: v for k, v in terms.items() if v % c != 0}
        if len(rest) < len(terms) or k0 >= c:
            r = _rebuild(rest, k0 % c, a.dtype)
            if r.vmin >= 0:
                return mod(r, c)
        split = _split_digit(terms, k0, c, a.dtype)
        if split is not None:
            q, low, g = split
            return add(mul(mod(q, c // g), const(g, a.dtype)), low)
        if a.op is Ops.MOD and a.srcs[1].op is Ops.CONST and a.srcs[1].arg % c == 0:
            return mod(a.srcs[0], c)
        return _make(Ops.MOD, a.dtype, (a, const(c, a.dtype)), None, (0, min(c - 1, a.vmax)))
    return alu(Ops.MOD, a, const(c, a.dtype))


# ---------------------------------------------------------------------------------------------------------------
# generic ALU with light folding


def _result_dtype(op: Ops, srcs: tuple[Expr, ...]) -> DType:
    if op in COMPARE:
        return dtypes.bool_
    if op is Ops.WHERE:
        return srcs[1].dtype
    return srcs[0].dtype


def _bounds(op: Ops, dtype: DType, srcs: tuple[Expr, ...]) -> tuple | None:
    if not dtype.is_int and dtype.kind != "b":
        return None
    if op in COMPARE or dtype.kind == "b":
        return 0, 1
    a = srcs[0]
    if op is Ops.ADD:
        return a.vmin + srcs[1].vmin, a.vmax + srcs[1].vmax
    if op is Ops.MUL:
        b = srcs[1]
        cands = [a.vmin * b.vmin, a.vmin * b.vmax, a.vmax * b.vmin, a.vmax * b.vmax]
        if any(math.isinf(x) or math.isnan(x) for x in cands):
            return None
        return min(cands), max(cands)
    if op is Ops.WHERE:
        return min(srcs[1].vmin, srcs[2].vmin), max(srcs[1].vmax, srcs[2].vmax)
    if op is Ops.MAX:
        return max(a.vmin, srcs[1].vmin), max(a.vmax, srcs[1].vmax)
    if op is Ops.MIN:
        return min(a.vmin, srcs[1].vmin), min(a.vmax, srcs[1].vmax)
    if op is Ops.NEG and not dtype.is_unsigned:
        return -a.vmax, -a.vmin
    if op in (Ops.DIV, Ops.MOD) and srcs[1].op is Ops.CONST and srcs[1].arg > 0:  # floor division and modulo
        c = srcs[1].arg
        if op is Ops.MOD:
            return 0, (min(c - 1, a.vmax) if a.vmin >= 0 else c - 1)
        if not any(isinstance(v, float) and not math.isfinite(v) for v in (a.vmin, a.vmax)):
            return a.vmin // c, a.vmax // c
    return None


def may_wrap(e: Expr) -> bool:
    """Whether the signed int32 / int64 ``ADD``, ``SUB``, ``MUL`` or ``NEG`` ``e`` can leave its dtype's range for
    operand values within their bounds. C leaves such an overflow undefined and compilers fold comparisons by it
    (NVRTC has no ``-fwrapv``), so renderers compute these in unsigned arithmetic, which wraps as NumPy does."""
    if e.dtype.kind != "i" or e.dtype.itemsize < 4 or e.op not in (Ops.ADD, Ops.SUB, Ops.MUL, Ops.NEG):
        return False
    if e.op is Ops.SUB:
        a, b = e.srcs
        exact = (a.vmin - b.vmax, a.vmax - b.vmin)
    else:
        exact = _bounds(e.op, e.dtype, e.srcs)
    if exact is None or any(isinstance(x, float) and not math.isfinite(x) for x in exact):
        return True
    lo, hi = dtypes.min_max(e.dtype)
    return exact[0] < lo or exact[1] > hi


def _decide_compare(op: Ops, a: Expr, b: Expr) -> bool | None:
    if not (_is_index(a, b)):
        return None
    if op is Ops.CMPLT:
        if a.vmax < b.vmin:
            return True
        if a.vmin >= b.vmax:
            return False
    if op is Ops.CMPLE:
        if a.vmax <= b.vmin:
            return True
        if a.vmin > b.vmax:
            return False
    if op in (Ops.CMPEQ, Ops.CMPNE) and (a.vmax < b.vmin or a.vmin > b.vmax):
        return op is Ops.CMPNE
    return None


def alu(op: Ops, *srcs: Expr) -> Expr:
    srcs = tuple(srcs)
    dtype = _result_dtype(op, srcs)
    if op in COMPARE and len(srcs) == 2:
        decided = _decide_compare(op, *srcs)
        if decided is not None:
            return const(decided, dtypes.bool_)
    if op is Ops.AND and dtype.kind == "b":
        a, b = srcs
        if a.op is Ops.CONST:
            return b if a.arg else a
        if b.op is Ops.CONST:
            return a if b.arg else b
        if a is b:
            return a
    if op is Ops.OR and dtype.kind == "b":
        a, b = srcs
        if a.op is Ops.CONST:
            return a if a.arg else b
        if b.op is Ops.CONST:
            return b if b.arg else a
    if op is Ops.WHERE:
        c, x, y = srcs
        if c.op is Ops.CONST:
            return x if c.arg else y
        if x is y:
            return x
        if x.op is Ops.LOAD and len(x.srcs) > 1 and x.srcs[1] is c and y.op is Ops.CONST and y.arg == 0 and \
                not (isinstance(y.arg, float) and math.copysign(1.0, y.arg) < 0):
            return x  # a load gated by the condition already yields 0 where it is false
    if op is Ops.MUL and dtype.is_float:
        a, b = srcs
        if b.op is Ops.CONST and b.arg == 1.0:
            return a
        if a.op is Ops.CONST and a.arg == 1.0:
            return b
    if op in (Ops.ADD, Ops.MUL) and _is_index(*srcs) and srcs[0].dtype is srcs[1].dtype:
        return add(*srcs) if op is Ops.ADD else mul(*srcs)
    if op is Ops.NOT and srcs[0].op is Ops.NOT:
        return srcs[0].srcs[0]
    out = _make(op, dtype, srcs, None, _bounds(op, dtype, srcs))
    if op is Ops.DIV and dtype.is_int and srcs[1].op is Ops.CONST and srcs[1].arg > 0:
        # a floor division of a value that may be negative (``idiv`` indexes the others): indexed for
        # ``_fold_divmod_pairs``, since c * (a // c) + a % c == a for floor division of either sign
        _div_index[(Ops.DIV, dtype.name, (id(srcs[0]),), srcs[1].arg)] = out
    return out


def where(c: Expr, x: Expr, y: Expr) -> Expr:
    return alu(Ops.WHERE, c, x, y)


def and_(a: Expr, b: Expr) -> Expr:
    return alu(Ops.AND, a, b)


def cast(x: Expr, dtype: DType) -> Expr:
    if x.dtype is dtype:
        return x
    if x.op is Ops.CONST:
        v = x.arg
        if dtype.is_int and x.dtype.is_float:
            v = dtypes.float_to_int(v, dtype)
        elif dtype.kind == "b":
            v = v != 0  # NaN is true
        return const(v, dtype)
    b = (x.vmin, x.vmax) if (x.dtype.is_int or x.dtype.kind == "b") and dtype.is_int and \
        _dtype_bounds(dtype)[0] <= x.vmin and x.vmax <= _dtype_bounds(dtype)[1] else None
    return _make(Ops.CAST, dtype, (x,), None, b)


def bitcast(x: Expr, dtype: DType) -> Expr:
    return x if x.dtype is dtype else _make(Ops.BITCAST, dtype, (x,))


def reduce(op: Ops, value: Expr, ranges: tuple[Expr, ...], acc_dtype: DType | None = None) -> Expr:
    """Reduce ``value`` over ``ranges`` (removed from its dependencies)."""
    assert op in REDUCE_OPS
    ranges = tuple(r for r in ranges if r.arg[1] != 1 or r in value.ranges)
    if not ranges:
        return value
    return _make(Ops.REDUCE, acc_dtype or value.dtype, (value,), (op, ranges))




def scan(op: Ops, value: Expr, r: Expr) -> Expr:
    """Inclusive running ``op`` of ``value`` along output loop ``r`` (a loop of one iteration: ``value``)."""
    assert op in SCAN_OPS
    if r.op is Ops.CONST:
        return value
    if r.op is not Ops.RANGE:
        raise ValueError(f"a scan runs along a loop range, not {r!r}")
    return _make(Ops.SCAN, value.dtype, (value, r), op)


def stash(value: Expr, r: Expr, slot: int) -> Expr:
    """``value`` (which depends on loop range ``r``), also written to the local array ``slot`` at ``r``."""
    assert r.op is Ops.RANGE and r in value.ranges
    return _make(Ops.STASH, value.dtype, (value, r), slot, (value.vmin, value.vmax))


def local(slot: int, size: int, dtype: DType, index: Expr, after: Expr, bounds: tuple | None = None) -> Expr:
    """Element ``index`` of local array ``slot`` (``size`` elements), which the stashes inside reduce ``after``
    filled: depending on ``after`` orders the read after the writes."""
    return _make(Ops.LOCAL, dtype, (index, after), (slot, size), bounds)


def substitute(e: Expr, mapping: dict[Expr, Expr], memo: dict | None = None) -> Expr:
    """Rebuild ``e`` with nodes replaced per ``mapping``, re-simplifying on the way up."""
    memo = {} if memo is None else memo
    if e in mapping:
        return mapping[e]
    if e in memo:
        return memo[e]
    if not e.srcs and e.op is not Ops.REDUCE:
        return e
    srcs = tuple(substitute(s, mapping, memo) for s in e.srcs)
    if e.op is Ops.REDUCE:
        # a range replaced by a constant (a loop of size 1 dropped) no longer loops
        rngs = tuple(x for x in (substitute(r, mapping, memo) for r in e.arg[1]) if x.op is Ops.RANGE)
        out = reduce(e.arg[0], srcs[0], rngs, e.dtype)
    elif all(a is b for a, b in zip(srcs, e.srcs)):
        out = e
    elif e.op is Ops.LOAD:
        out = load(e.arg, e.dtype, srcs[0], srcs[1] if len(srcs) > 1 else None)
    elif e.op is Ops.CAST:
        out = cast(srcs[0], e.dtype)
    elif e.op is Ops.BITCAST:
        out = bitcast(srcs[0], e.dtype)
    elif e.op is Ops.SCAN:
        out = scan(e.arg, *srcs)
    elif e.op is Ops.STASH:
        out = stash(srcs[0], srcs[1], e.arg)
    elif e.op is Ops.LOCAL:
        out = local(e.arg[0], e.arg[1], e.dtype, srcs[0], srcs[1], (e.vmin, e.vmax))
    elif e.op is Ops.DIV and e.dtype.is_int and srcs[1].op is Ops.CONST and srcs[1].arg > 0 and srcs[0].vmin >= 0:
        out = idiv(srcs[0], srcs[1].arg)
    elif e.op is Ops.MOD and e.dtype.is_int and srcs[1].op is Ops.CONST and srcs[1].arg > 0 and srcs[0].vmin >= 0:
        out = mod(srcs[0], srcs[1].arg)
    else:
        out = alu(e.op, *srcs)
    memo[e] = out
    return out


def toposort(roots: list[Expr]) -> list[Expr]:
    """Every node reachable from ``roots`` (including reduce ranges), sources first: a depth-first post-order,
    each node's sources then a reduce's ranges left to right (iterators on one stack, the roots' own at the
    bottom: no list per node, half the time of a stack of flags)."""
    out: list[Expr] = []
    seen: set[int] = set()
    add, emit = seen.add, out.append
    reduce_op = Ops.REDUCE
    stack: list[tuple[Expr | None, Iterator[Expr]]] = [(None, iter(roots))]
    push, pop = stack.append, stack.pop
    while stack:
        e, it = stack[-1]
        for s in it:
            if id(s) not in seen:
                add(id(s))
                push((s, iter((*s.srcs, *s.arg[1]) if s.op is reduce_op else s.srcs)))
                break
        else:
            pop()
            if e is not None:
                emit(e)
    return out


# ---------------------------------------------------------------------------------------------------------------
# kernels


@dataclass(frozen=True)
class Param:
    """A kernel parameter: a buffer read (``in``), a buffer written (``out``), or a scalar (``var``)."""

    name: str
    dtype: DType
    kind: str  # "in", "out", "var"
    size: int = 0  # elements, for buffers


@dataclass(frozen=True)
class Store:
    param: int
    index: Expr
    value: Expr


@dataclass(frozen=True)
class Prefetch:
    """A software prefetch, at the top of each iteration of output loop ``loop``, of the block of input ``param``
    that the next iteration reads: elements ``stride * (r + 1) + offset`` up to ``length`` further (clipped to the
    buffer; ``opt.prefetch_blocks``)."""

    param: int
    loop: Expr
    stride: int
    offset: int
    length: int


@dataclass(frozen=True)
class StreamPrefetch:
    """Software prefetches ``distance`` elements ahead along the long sums of a kernel with ``reduce_lanes``: once
    per block of lanes, for every load of an input in ``params`` that walks the sum's range contiguously
    (``opt.prefetch_streams``; clipped to the buffer), into the cache level ``locality`` names (as
    ``__builtin_prefetch``'s: 3 the nearest, 1 the farthest)."""

    params: tuple[int, ...]
    distance: int
    locality: int


@dataclass(frozen=True)
class Scatter:
    """A one-hot sum turned around (``opt.scatter_one_hot``): ``out[v, o] = sum over ranges of x where index == v``
    runs as ``out[index, o] += x`` for each iteration of ``ranges`` in order, the kernel's loops (the output's other
    axes ``o``) inside, after a segment that zeroes the output; an ``index`` outside ``[0, target's extent)`` adds
    nowhere. ``x`` is the segment's store value. Work: the sum's iterations times the other axes, not also times
    the target's extent."""

    target: Expr  # the output loop the one-hot compare matched (named by the index while the stores run)
    index: Expr  # the target row of each iteration of ``ranges`` (depends on nothing else)
    ranges: tuple[Expr, ...]  # the sum's ranges, outermost first, run in order on one thread


@dataclass(frozen=True)
class Kernel:
    """One launch: loops (outer first) over which every store runs, and the stores.

    ``then`` holds the other segments of a kernel whose loop was split (``opt.split_segments``): each is a
    complete loop nest over the same params. ``parallel`` is how many outer loops the target may run in
    parallel; ``vector`` marks the innermost loop as free of loop-carried dependencies (safe to vectorize).
    ``launch`` is the GPU launch (``gpu.Geometry``: strategy, split of the loops, block, grid) that the GPU
    passes build (``gpu.optimize``); part of the kernel's identity, None until then and on the host.
    Optimizations return new kernels.
    """

    name: str
    params: tuple[Param, ...]
    loops: tuple[Expr, ...]
    stores: tuple[Store, ...]
    parallel: int = 0
    vector: bool = False
    wide_acc: bool = False  # accumulate float32 sums in float64 (host: accuracy of long sums)
    split_reduce: bool = False  # run the single root reduce across threads (no output loops)
    # what the host passes (``kernel.opt``) decided, rendered by ``CRenderer``; defaults: not applied
    reduce_lanes: int = 0  # independent float32 partial sums per block of a long sum (``unroll_reduce``)
    upcast_rows: int = 1  # consecutive row sums computed in one loop nest (``upcast_rows``)
    vector_acc: Expr | None = None  # the tile range a reduce keeps one accumulator per (``interchange_reduce``)
    vector_block: tuple[int, int] | None = None  # (row block, register tile) of a column sum (``block_vector_reduce``)
    gemm: GemmTile | None = None  # register tiles and packed panels of a contraction (``tile_gemm``)
    prefetch: tuple[Prefetch, ...] = ()  # next iteration's input blocks fetched ahead (``prefetch_blocks``)
    stream_prefetch: StreamPrefetch | None = None  # long sums' inputs fetched ahead (``prefetch_streams``)
    then: tuple[Kernel, ...] = ()  # further loop nests over the same params, run after this one in one launch
    scatter: Scatter | None = None  # this segment adds into its output at computed rows (``opt.scatter_one_hot``)
    transpose_block: int = 0  # edge of the register transposes staging a transpose's loads (``opt.tile_transpose``)
    launch: Geometry | None = None

    @property
    def size(self) -> int:
        return math.prod(r.arg[1] for r in self.loops)

    def reduces(self) -> tuple[Expr, ...]:
        """The reduces the stores' values read, sources first (listed once per kernel: passes ask often)."""
        reds = self.__dict__.get("_reduces")
        if reds is None:
            reds = tuple(e for e in toposort([s.value for s in self.stores]) if e.op is Ops.REDUCE)
            object.__setattr__(self, "_reduces", reds)  # a cache beside the fields (frozen: the stores never change)
        return reds

    def scan_ranges(self) -> frozenset[Expr]:
        """The output loop ranges that scans run along."""
        return frozenset(e.srcs[1] for e in toposort([s.value for s in self.stores]) if e.op is Ops.SCAN)


TRANSPOSE_BLOCK = 8  # a register transpose's edge: 8 x 8 elements, eight vectors of 16, 32 or 64 bytes
# float16 is left out: converting the staged block one F16C element at a time made ``x.T * 2`` (2048^2) 1.4-1.9x
# slower than the strided loads
TRANSPOSE_DTYPES = ("bfloat16", "int16", "uint16", "float32", "int32", "uint32", "float64", "int64", "uint64")


def transposed_block_loads(k: Kernel, dtype_names: Collection[str] | None = TRANSPOSE_DTYPES) -> list[Expr]:
    """The loads of ``k`` (last loops ``(i, j)``, ``j`` innermost) that blocks of ``TRANSPOSE_BLOCK`` x
    ``TRANSPOSE_BLOCK`` register transposes can stage: ungated, of a 2-, 4- or 8-byte type (``TRANSPOSE_DTYPES``;
    the block holds what memory holds, bfloat16 still to convert), with an index affine in both loops,
    contiguous along ``i`` and at least a block's edge apart along ``j``. A block's element ``(i, j)`` offsets is
    then ``base + j * stride + i``. ``dtype_names=None`` takes every type (the GPU's shared-memory tiles, which
    hold any element)."""
    if len(k.loops) < 2:
        return []
    i, j = k.loops[-2], k.loops[-1]
    out = []
    for e in toposort([s.value for s in k.stores]):
        if e.op is not Ops.LOAD or len(e.srcs) > 1 or \
                (dtype_names is not None and k.params[e.arg].dtype.name not in dtype_names):
            continue
        sj = affine_coefficient(e.srcs[0], j)
        if affine_coefficient(e.srcs[0], i) == 1 and sj is not None and abs(sj) >= TRANSPOSE_BLOCK:
            out.append(e)
    return out


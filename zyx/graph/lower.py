"""Lower one fused kernel of the graph to the kernel IR.

``lower(cls, idx, gate)`` returns the IR value of ``cls`` at the index tuple ``idx`` (one index expression per
dimension); movement ops only transform ``idx``, pads add gates, reduces open fresh ranges, materialized
classes become loads. NumPy semantics for floor division, remainder and NaN-propagating max/min are built
here from the IR's primitives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from zyx import dtypes
from zyx.graph.node import Class, contiguous_strides
from zyx.kernel import ir
from zyx.kernel.ir import Expr
from zyx.kernel.linearize import Block, Reduce, linearize
from zyx.ops import ELEMENTWISE, Ops

# graph ops that lower to the same kernel op, elementwise (CAST, IDIV and MOD have rules of their own)
DIRECT = ELEMENTWISE - {Ops.CAST, Ops.IDIV, Ops.MOD}
_HALFS = (dtypes.float16, dtypes.bfloat16)


def ravel(idx: Sequence[Expr], shape: Sequence[int]) -> Expr:
    flat = ir.const(0, ir.index_dtype)
    for i, n, st in zip(idx, shape, contiguous_strides(tuple(shape))):
        if n != 1:  # a size-1 axis is only ever indexed by 0
            flat = flat + i * st
    return flat


def reshape_index(idx: tuple[Expr, ...], out_shape: tuple[int, ...], in_shape: tuple[int, ...]) -> tuple[Expr, ...]:
    """The source index of a reshape, group by group: runs of axes whose sizes multiply to the same product on both
    sides map to each other alone, so a merge or a split of some axes costs index arithmetic on those axes only
    (a merge is a sum of scaled indices, no division), not a division by every extent of the flattened whole."""
    zero = ir.const(0, ir.index_dtype)
    if 0 in in_shape:  # an empty source: no element is ever read (a pad around it gates every access)
        return tuple(zero for _ in in_shape)
    outs = [(i, s) for i, s in zip(idx, out_shape) if s != 1]
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    result = [zero] * len(in_shape)
    o = 0
    n = 0
    while n < len(ins):
        group_in, group_out = [ins[n]], [outs[o]]
        p_in, p_out = in_shape[ins[n]], outs[o][1]
        n, o = n + 1, o + 1
        while p_in != p_out:
            if p_in < p_out:
                group_in.append(ins[n])
                p_in *= in_shape[ins[n]]
                n += 1
            else:
                group_out.append(outs[o])
                p_out *= outs[o][1]
                o += 1
        flat = ravel([i for i, _ in group_out], [s for _, s in group_out])
        acc = 1
        for k in range(len(group_in) - 1, -1, -1):
            d = group_in[k]
            q = flat if acc == 1 else _div(flat, acc)
            result[d] = q if k == 0 else _mod(q, in_shape[d])
            acc *= in_shape[d]
    return tuple(result)


_ZERO = ir.const(0, ir.index_dtype)


def _unit_axes_zero(idx: tuple[Expr, ...], shape: tuple[int, ...]) -> tuple[Expr, ...]:
    """``idx`` with the index of every axis of size 1 written as 0 (what any index of it is), so that a class read
    at one element through different index expressions is lowered once."""
    if 1 not in shape:
        return idx
    return tuple(_ZERO if s == 1 else i for i, s in zip(idx, shape))


def _div(a: Expr, c: int) -> Expr:
    return ir.idiv(a, c) if a.vmin >= 0 else ir.alu(Ops.DIV, a, ir.const(c, a.dtype))


def _mod(a: Expr, c: int) -> Expr:
    return ir.mod(a, c) if a.vmin >= 0 else ir.alu(Ops.MOD, a, ir.const(c, a.dtype))


class KernelBuilder:
    """Builds one ir.Kernel: params are outputs first, then inputs and scalars in order of first use.

    ``recomputed``: the reduce classes outside ``stored`` that an enclosing reduce would run again for values it
    already computed (the factor ``recompute_factors`` gives, estimated from the index they are lowered at). Such a
    class is lowered as a load instead of its computation: the kernel is then a planning draft, which fusion
    rebuilds with the class stored. Without the shortcut a chain of reduces feeding reduces (a transformer's matmuls on
    generated kernels) is lowered at a new index per path through it: exponential in the depth of the chain."""

    def __init__(self, name: str, materialized: set[Class], stored: set[Class] | None = None) -> None:
        self.name = name
        self.materialized = materialized
        self.stored = materialized if stored is None else stored  # may be computed here, never drafted
        self.params: list[ir.Param] = []
        self.param_classes: list[Class] = []
        self._param_of: dict[int, int] = {}
        self._memo: dict[tuple, Expr] = {}
        self._next_range = 0
        self.reduce_class: dict[Expr, Class] = {}
        self.stores: list[ir.Store] = []
        self.loops: tuple[Expr, ...] = ()  # one range per output dimension
        self.loop_order: tuple[Expr, ...] = ()  # the loop nest, outermost first, when not ``loops``
        self.recomputed: dict[Class, int] = {}
        self._reduce_ranges: list[Expr] = []  # the ranges of the reduces being lowered, outermost first

    def new_range(self, size: int) -> Expr:
        r = ir.range_(self._next_range, size)
        self._next_range += 1
        return r

    def _param(self, c: Class, kind: str) -> int:
        p = self._param_of.get(id(c))
        if p is None:
            p = len(self.params)
            self.params.append(ir.Param(f"p{p}", c.dtype, kind, c.numel))
            self.param_classes.append(c)
            self._param_of[id(c)] = p
        return p

    def add_output(self, c: Class) -> None:
        """Store ``c`` contiguously over loops covering its shape (all outputs share one shape). A scan's
        axis becomes the innermost loop: the scan carries its accumulator along that loop."""
        if not self.loops:
            self.loops = tuple(self.new_range(s) for s in c.shape)
            if c.op is Ops.SCAN:
                ax = c.node.arg[1]
                self.loop_order = self.loops[:ax] + self.loops[ax + 1:] + (self.loops[ax],)
        p = self._param(c, "out")
        self.stores.append(ir.Store(p, ravel(self.loops, c.shape), self._lower_root(c, self.loops)))

    def kernel(self) -> ir.Kernel:
        return ir.Kernel(self.name, tuple(self.params), self.loop_order or self.loops, tuple(self.stores))

    def _lower_root(self, c: Class, idx: tuple[Expr, ...]) -> Expr:
        """``c`` computed at ``idx`` (never loaded: the kernel stores it), the same expression a later read of it in
        this kernel at that element finds (a variance reading the mean that its kernel stores too)."""
        idx = _unit_axes_zero(idx, c.shape)
        key = (id(c), idx, None)
        e = self._memo.get(key)
        if e is None:
            e = self._memo[key] = self._compute(c, idx, None)
        return e

    def lower(self, c: Class, idx: tuple[Expr, ...], gate: Expr | None) -> Expr:
        idx = _unit_axes_zero(idx, c.shape)
        key = (id(c), idx, gate)
        e = self._memo.get(key)
        if e is None:
            if c.realized or c in self.materialized:
                if c.op is Ops.VAR:
                    e = ir.var(self._param(c, "var"), c.dtype)
                else:
                    e = ir.load(self._param(c, "in"), c.dtype, ravel(idx, c.shape), gate)
            else:
                e = self._compute(c, idx, gate)
            self._memo[key] = e
        return e

    def _rerun_factor(self, idx: tuple[Expr, ...], values: int) -> int:
        """How often a reduce of ``values`` elements lowered at ``idx`` inside the reduces being lowered would run
        per distinct value: placed in the innermost loop its index depends on, it runs once per iteration of that
        loop and the loops around it (``recompute_factors`` on the finished kernel)."""
        loops = [*(self.loop_order or self.loops), *self._reduce_ranges]
        deps = {r for x in idx for r in x.ranges}
        deepest = max((i for i, r in enumerate(loops) if r in deps), default=-1)
        runs = math.prod(r.arg[1] for r in loops[:deepest + 1])
        return runs // max(min(math.prod(r.arg[1] for r in loops if r in deps), values), 1)

    def _compute(self, c: Class, idx: tuple[Expr, ...], gate: Expr | None) -> Expr:  # noqa: C901
        node = c.node
        op, srcs, arg = node.op, node.srcs, node.arg
        if op is Ops.CONST:
            return ir.const(arg, c.dtype)
        if op is Ops.VAR:
            return ir.var(self._param(c, "var"), c.dtype)
        if op is Ops.IOTA:
            return ir.cast(idx[0], c.dtype)
        if op is Ops.CONTIGUOUS:
            return self.lower(srcs[0], idx, gate)
        if op is Ops.CAST:
            return ir.cast(self.lower(srcs[0], idx, gate), c.dtype)
        if op is Ops.IDIV:
            return self._floordiv(*(self.lower(s, idx, gate) for s in srcs))
        if op is Ops.MOD:
            return self._remainder(*(self.lower(s, idx, gate) for s in srcs))
        if op in DIRECT:
            return ir.alu(op, *(self.lower(s, idx, gate) for s in srcs))
        if op is Ops.REDUCE:
            rop, axes = arg
            src = srcs[0]
            if self._reduce_ranges and c not in self.stored and (factor := self._rerun_factor(idx, c.numel)) > 1:
                self.recomputed[c] = factor
                return ir.load(self._param(c, "in"), c.dtype, ravel(idx, c.shape), gate)
            new = list(idx)
            rngs = []
            for a in axes:
                r = self.new_range(src.shape[a])
                new[a] = r
                rngs.append(r)
            self._reduce_ranges.extend(rngs)
            try:
                e = ir.reduce(rop, self.lower(src, tuple(new), gate), tuple(rngs))
            finally:
                del self._reduce_ranges[-len(rngs):]
            if e.op is Ops.REDUCE:
                self.reduce_class[e] = c
            return e
        if op is Ops.SCAN:
            rop, axis = arg
            r = idx[axis]
            if r.op is not Ops.RANGE or not self.loop_order or r is not self.loop_order[-1]:
                raise NotImplementedError("a scan is computed only by its own kernel (it is always stored)")
            return ir.scan(rop, self.lower(srcs[0], idx, gate), r)
        if op is Ops.RESHAPE:
            return self.lower(srcs[0], reshape_index(idx, c.shape, srcs[0].shape), gate)
        if op is Ops.PERMUTE:
            inv = [None] * len(arg)
            for d, o in enumerate(arg):
                inv[o] = idx[d]
            return self.lower(srcs[0], tuple(inv), gate)
        if op is Ops.EXPAND:
            zero = ir.const(0, ir.index_dtype)
            src_shape = srcs[0].shape
            new = tuple(zero if s == 1 and o != 1 else i for i, s, o in zip(idx, src_shape, c.shape))
            return self.lower(srcs[0], new, gate)
        if op is Ops.SHRINK:
            new = tuple(i * step + start if (start, step) != (0, 1) else i for i, (start, step) in zip(idx, arg))
            return self.lower(srcs[0], new, gate)
        if op is Ops.PAD:
            pads, fill = arg
            valid = ir.const(True, dtypes.bool_)
            new = []
            for i, (before, _after), s in zip(idx, pads, srcs[0].shape):
                if before or _after:
                    lo = ir.alu(Ops.CMPLE, ir.const(before, ir.index_dtype), i)
                    hi = ir.alu(Ops.CMPLT, i, ir.const(before + s, ir.index_dtype))
                    valid = ir.and_(valid, ir.and_(lo, hi))
                new.append(i - before if before else i)
            inner_gate = valid if gate is None else ir.and_(gate, valid)
            v = self.lower(srcs[0], tuple(new), inner_gate if valid.op is not Ops.CONST else gate)
            return ir.where(valid, v, ir.const(fill, c.dtype))
        if op is Ops.GATHER or op is Ops.TAKE_ALONG:
            x, index = srcs
            axis = arg
            if op is Ops.GATHER:  # the index's own coordinates sit where x's axis was
                nd = len(index.shape)
                pre, at, post = idx[:axis], idx[axis:axis + nd], idx[axis + nd:]
            else:  # the index shares every coordinate with the output
                pre, at, post = idx[:axis], idx, idx[axis + 1:]
            iv = ir.cast(self.lower(index, tuple(at), gate), ir.index_dtype)
            n = x.shape[axis]
            zero = ir.const(0, ir.index_dtype)
            iv = ir.where(ir.alu(Ops.CMPLT, iv, zero), iv + n, iv)
            valid = ir.and_(ir.alu(Ops.CMPLE, zero, iv), ir.alu(Ops.CMPLT, iv, ir.const(n, ir.index_dtype)))
            g = valid if gate is None else ir.and_(gate, valid)
            v = self.lower(x, tuple(pre) + (iv,) + tuple(post), g)
            return ir.where(valid, v, ir.const(0, c.dtype))
        raise NotImplementedError(f"cannot fuse {op.name} into a kernel")

    @staticmethod
    def _floordiv(a: Expr, b: Expr) -> Expr:
        if not a.dtype.is_float:
            return ir.alu(Ops.DIV, a, b)
        if a.dtype in _HALFS:  # computed in float32 and rounded once, as NumPy and ml_dtypes do
            return ir.cast(KernelBuilder._floordiv(ir.cast(a, dtypes.float32), ir.cast(b, dtypes.float32)), a.dtype)
        # NumPy's floor_divide: exact via fmod, then rounding of the quotient
        d = a.dtype
        zero = ir.const(0.0, d)
        m = ir.alu(Ops.FMOD, a, b)
        div = ir.alu(Ops.DIV, ir.alu(Ops.SUB, a, m), b)
        adjust = ir.and_(ir.alu(Ops.CMPNE, m, zero),
                         ir.alu(Ops.CMPNE, ir.alu(Ops.CMPLT, b, zero), ir.alu(Ops.CMPLT, m, zero)))
        div = ir.where(adjust, ir.alu(Ops.SUB, div, ir.const(1.0, d)), div)
        fl = ir.alu(Ops.FLOOR, div)
        fl = ir.where(ir.alu(Ops.CMPLT, ir.const(0.5, d), ir.alu(Ops.SUB, div, fl)),
                      ir.alu(Ops.ADD, fl, ir.const(1.0, d)), fl)
        q = ir.alu(Ops.DIV, a, b)
        fl = ir.where(ir.alu(Ops.CMPEQ, div, zero), _signed_zero(q), fl)  # a zero quotient has the sign of a / b
        return ir.where(ir.alu(Ops.CMPEQ, b, zero), q, fl)

    @staticmethod
    def _remainder(a: Expr, b: Expr) -> Expr:
        if not a.dtype.is_float:
            return ir.alu(Ops.MOD, a, b)
        if a.dtype in _HALFS:
            return ir.cast(KernelBuilder._remainder(ir.cast(a, dtypes.float32), ir.cast(b, dtypes.float32)), a.dtype)
        zero = ir.const(0.0, a.dtype)
        m = ir.alu(Ops.FMOD, a, b)
        fix = ir.and_(ir.alu(Ops.CMPNE, m, zero),
                      ir.alu(Ops.CMPNE, ir.alu(Ops.CMPLT, b, zero), ir.alu(Ops.CMPLT, m, zero)))
        m = ir.where(ir.alu(Ops.CMPEQ, m, zero), _signed_zero(b), m)  # a zero remainder has the divisor's sign
        return ir.where(fix, ir.alu(Ops.ADD, m, b), m)


def _signed_zero(x: Expr) -> Expr:
    """``copysign(0, x)`` for a float ``x`` (the sign of a zero is the sign of its reciprocal)."""
    d = x.dtype
    zero = ir.const(0.0, d)
    neg = ir.alu(Ops.OR, ir.alu(Ops.CMPLT, x, zero),
                 ir.and_(ir.alu(Ops.CMPEQ, x, zero), ir.alu(Ops.CMPLT, ir.alu(Ops.RECIP, x), zero)))
    return ir.where(neg, ir.const(-0.0, d), zero)


def recompute_factors(k: ir.Kernel, values: dict[Expr, int] | None = None) -> dict[Expr, int]:
    """For each reduce: how many times LICM placement runs it per distinct value (1 = no recomputation). The
    distinct values are at most the iterations of the loops it depends on and, where ``values`` gives it, the
    reduce's own element count: a group's mean that the loops reach through a division of their flat index (group
    norm: ``(c * hw + i) // (c * hw / groups)``) depends on every loop, yet has one value per group."""
    out: dict[Expr, int] = {}
    values = values or {}

    def walk(block: Block, enclosing: tuple[Expr, ...]) -> None:
        for s in block.stmts:
            if isinstance(s, Reduce):
                runs = math.prod(r.arg[1] for r in enclosing)
                for e in s.exprs:
                    distinct = math.prod(r.arg[1] for r in e.ranges)
                    out[e] = runs // max(min(distinct, values.get(e, distinct)), 1)
                walk(s.loop.body, enclosing + (s.loop.range,))
        if block.inner is not None:
            walk(block.inner.body, enclosing + (block.inner.range,))

    walk(linearize(k), ())
    return out

"""Renderers from the kernel IR to C-like source; ``CRenderer`` for the host, CUDA subclasses the base.

Type model shared by every C-like target: values live in "register" types; float16 and bfloat16 live in
``float`` registers and are rounded back to their dtype after every operation (per-op rounding, as NumPy
and PyTorch compute), and are stored as 16-bit patterns. Integer division and remainder by zero give 0
(NumPy's result); shifts by the type's width or more give 0 (or -1 for negative right shifts).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from zyx import dtypes
from zyx.dtypes import DType
from zyx.kernel import ir
from zyx.kernel.c_math import C_MATH_FUNCTIONS, C_MATH_PRELUDE
from zyx.kernel.ir import Expr, Kernel, Store
from zyx.kernel.linearize import Block, Loop, Reduce, ScanInit, linearize, walk
from zyx.ops import COMPARE, TRANSCENDENTAL, Ops

if TYPE_CHECKING:
    from collections.abc import Callable

    from zyx.kernel.opt import GemmTile

HALFS = (dtypes.float16, dtypes.bfloat16)

_INFIX = {Ops.ADD: "+", Ops.SUB: "-", Ops.MUL: "*", Ops.CMPLT: "<", Ops.CMPLE: "<=", Ops.CMPEQ: "==",
          Ops.CMPNE: "!=", Ops.XOR: "^"}
_FLOAT_FN = {Ops.FLOOR: "floor", Ops.CEIL: "ceil", Ops.ROUND: "rint", Ops.TRUNC: "trunc", Ops.POW: "pow"}


class CStyleRenderer:
    """Shared C-like rendering; subclasses fill the target's types, math functions, and kernel frame."""

    index_type = "long long"
    restrict = "__restrict__"
    sum_block = 256  # elements per float partial sum of a long float32 reduction
    lane_depth = 32  # with ``reduce_lanes``, elements each lane adds per block: blocks of lanes * lane_depth
    math_fns: dict[tuple[str, str], str] = {}
    supports_f64 = True

    # ---- types -----------------------------------------------------------------------------------------------
    def reg_type(self, d: DType) -> str:
        if d in HALFS:
            return "float"
        if d is dtypes.bool_:
            return "_Bool"
        return d.c_type

    def storage_type(self, d: DType) -> str:
        if d in HALFS:
            return "unsigned short"
        if d is dtypes.bool_:
            return "unsigned char"
        return d.c_type

    def acc_type(self, e: Expr, k: Kernel) -> str:
        if k.wide_acc and e.dtype is dtypes.float32 and e.arg[0] in (Ops.ADD, Ops.MUL) and self.supports_f64:
            return "double"
        return self.reg_type(e.dtype)

    # ---- constants -------------------------------------------------------------------------------------------
    def literal(self, v, d: DType) -> str:
        if d is dtypes.bool_:
            return "1" if v else "0"
        if d.is_int:
            v = int(v)
            suffix = {8: "LL", 4: ""}.get(d.itemsize, "")
            if d.is_unsigned:
                suffix = "U" + suffix
            if d.itemsize == 8 and not d.is_unsigned and v == -(2**63):
                return "(-9223372036854775807LL-1)"
            if d.itemsize == 4 and not d.is_unsigned and v == -(2**31):
                return "(-2147483647-1)"
            return f"{v}{suffix}" if v >= 0 or d.itemsize < 4 else f"({v}{suffix})"
        f = d is not dtypes.float64
        if math.isnan(v):
            return "NAN" if f else "((double)NAN)"
        if math.isinf(v):
            s = "INFINITY" if f else "((double)INFINITY)"
            return s if v > 0 else f"(-{s})"
        r = repr(float(v))
        return f"{r}f" if f else r

    # ---- expressions -----------------------------------------------------------------------------------------
    def round_half(self, s: str, d: DType) -> str:
        return f"zyx_round_{d.name}({s})" if d in HALFS else s

    def from_storage(self, s: str, d: DType) -> str:
        if d in HALFS:
            return f"zyx_{d.name}_to_f32({s})"
        return s

    def to_storage(self, s: str, d: DType) -> str:
        if d in HALFS:
            return f"zyx_f32_to_{d.name}({s})"
        if d is dtypes.bool_:
            return f"(unsigned char)({s})"
        return s

    def math_fn(self, op: Ops, d: DType) -> str:
        key = (op.name.lower(), "float64" if d is dtypes.float64 else "float32")
        if key in self.math_fns:
            return self.math_fns[key]
        base = {Ops.EXP: "exp", Ops.EXP2: "exp2", Ops.LOG: "log", Ops.LOG2: "log2", Ops.SIN: "sin", Ops.COS: "cos",
                Ops.TAN: "tan", Ops.TANH: "tanh", Ops.ERF: "erf", Ops.SQRT: "sqrt"}[op]
        return base if d is dtypes.float64 else base + "f"

    def select(self, cond: str, a: str, b: str, dtype) -> str:
        """``cond ? a : b`` for values of ``dtype``."""
        return f"({cond} ? {a} : {b})"

    def alu(self, e: Expr, a: list[str]) -> str:
        op, d = e.op, e.dtype
        sd = e.srcs[0].dtype if e.srcs else d
        fl = sd.is_float
        suf = "" if sd is dtypes.float64 else "f"
        if op in (Ops.ADD, Ops.SUB, Ops.MUL, Ops.NEG) and ir.may_wrap(e):  # wraps, never undefined
            return wrapping(op, a[0], a[1] if len(a) > 1 else "", d)
        if op in _INFIX:
            return f"({a[0]} {_INFIX[op]} {a[1]})"
        if op is Ops.NEG:
            return f"(-({a[0]}))" if d.kind != "b" else f"({a[0]})"
        if op is Ops.NOT:
            return f"(!{a[0]})" if d.kind == "b" else f"(~{a[0]})"
        if op in (Ops.AND, Ops.OR):
            return f"({a[0]} {'&' if op is Ops.AND else '|'} {a[1]})"
        if op is Ops.WHERE:
            return self.select(a[0], a[1], a[2], d)
        if op is Ops.FMOD:
            return f"fmod{suf}({a[0]}, {a[1]})"
        if op is Ops.DIV and fl:
            return f"({a[0]} / {a[1]})"
        if op in (Ops.DIV, Ops.MOD):
            assert not fl, "float MOD is lowered to FMOD"
            if e.srcs[1].op is Ops.CONST and e.srcs[1].arg > 0 and e.srcs[0].vmin >= 0:
                return f"({a[0]} {'/' if op is Ops.DIV else '%'} {a[1]})"
            return f"zyx_{'idiv' if op is Ops.DIV else 'mod'}_{sd.name}({a[0]}, {a[1]})"
        if op in (Ops.MAX, Ops.MIN):
            c = ">" if op is Ops.MAX else "<"
            if fl:
                # "|", not "||": no short circuit (NaN propagates)
                return self.select(f"(({a[0]} {c} {a[1]}) | ({a[0]} != {a[0]}))", a[0], a[1], d)
            return f"(({a[0]} {c} {a[1]}) ? {a[0]} : {a[1]})"
        if op is Ops.SHL:
            return f"zyx_shl_{sd.name}({a[0]}, {a[1]})"
        if op is Ops.SHR:
            return f"zyx_shr_{sd.name}({a[0]}, {a[1]})"
        if op is Ops.POW:
            return f"pow{suf}({a[0]}, {a[1]})" if fl else f"zyx_ipow_{sd.name}({a[0]}, {a[1]})"
        if op is Ops.ABS:
            return f"fabs{suf}({a[0]})" if fl else f"(({a[0]}) < 0 ? -({a[0]}) : ({a[0]}))"
        if op is Ops.RECIP:
            return f"({self.literal(1.0, sd if sd is dtypes.float64 else dtypes.float32)} / {a[0]})"
        if op is Ops.ISNAN:
            return f"({a[0]} != {a[0]})" if fl else "0"
        if op is Ops.ISINF:
            inf = self.literal(math.inf, dtypes.float64 if sd is dtypes.float64 else dtypes.float32)
            return f"({a[0]} == {inf} || {a[0]} == -{inf})" if fl else "0"
        if op in _FLOAT_FN:
            return f"{_FLOAT_FN[op]}{suf}({a[0]})" if fl else a[0]
        if op in TRANSCENDENTAL or op is Ops.SQRT:
            return f"{self.math_fn(op, sd)}({a[0]})"
        raise NotImplementedError(f"renderer has no rule for {op.name}")

    def cast(self, e: Expr, a: str) -> str:
        d, sd = e.dtype, e.srcs[0].dtype
        if d is dtypes.bool_:
            return f"({a} != 0)"
        if d in HALFS:  # from a double: rounded once (to odd, then to the half)
            return self.round_half(f"zyx_f64_to_f32_odd({a})" if sd is dtypes.float64 else f"(float)({a})", d)
        if sd.is_float and d.is_int:
            return self.float_to_int(a, sd, d)
        if sd is dtypes.bool_ and d in (dtypes.float32, dtypes.float64):
            return self.select(a, "1.0f" if d is dtypes.float32 else "1.0", "0.0f" if d is dtypes.float32 else "0.0", d)
        return f"({self.reg_type(d)})({a})"

    def float_to_int(self, a: str, sd: DType, d: DType) -> str:
        return f"zyx_f2i_{d.name}((double)({a}))"

    def operand_namer(self, e: Expr, name: dict[Expr, str]):
        """How the operands of ``e`` are spelled (targets may vary it per expression, e.g. index widths)."""

        def n(x: Expr) -> str:
            if x.op is Ops.CONST:
                return self.literal(x.arg, x.dtype)
            if x.op is Ops.RANGE:
                return f"r{x.arg[0]}"
            return name[x]

        return n

    def expr(self, e: Expr, name: dict[Expr, str], params: tuple[ir.Param, ...]) -> str:
        n = self.operand_namer(e, name)
        if e.op is Ops.LOAD:
            p = params[e.arg]
            s = self.from_storage(f"p{e.arg}[{n(e.srcs[0])}]", p.dtype)
            if len(e.srcs) > 1:
                s = f"({n(e.srcs[1])} ? {s} : {self.literal(0, e.dtype)})"
            return s
        if e.op is Ops.VAR:
            return f"a{e.arg}"
        if e.op is Ops.LOCAL:
            return f"zloc{e.arg[0]}[{n(e.srcs[0])}]"
        if e.op is Ops.CAST:
            return self.cast(e, n(e.srcs[0]))
        if e.op is Ops.BITCAST:
            raise NotImplementedError("BITCAST is not rendered yet")
        s = self.alu(e, [n(x) for x in e.srcs])
        if e.dtype in HALFS and e.op not in COMPARE:
            s = self.round_half(s, e.dtype)
        return s

    # ---- statements ------------------------------------------------------------------------------------------
    @staticmethod
    def tracks_nan(e: Expr) -> bool:
        """A float max/min reduce keeps an int NaN flag beside its accumulator: its comparisons skip NaNs, the flag
        makes the result NaN (as NumPy's)."""
        return e.arg[0] in (Ops.MAX, Ops.MIN) and e.dtype.is_float

    def nan_result(self, acc: str, at: str, flag: str | None = None) -> str:
        """A NaN-tracking reduce's value: NaN when its flag (``<acc>_nan`` unless named) is set, else ``acc``."""
        nan_lit = self.literal(math.nan, dtypes.float64 if at == "double" else dtypes.float32)
        return f"({flag or acc + '_nan'} ? {nan_lit} : {acc})"

    def identity(self, op: Ops, e: Expr, acc_t: str) -> str:
        d = e.dtype
        if op is Ops.ADD or op is Ops.OR:
            v = 0
        elif op is Ops.MUL or op is Ops.AND:
            v = 1
        else:
            lo, hi = dtypes.min_max(d)
            v = lo if op is Ops.MAX else hi
        lit_d = dtypes.float64 if acc_t == "double" else (dtypes.float32 if d in HALFS else d)
        return self.literal(v, lit_d)

    def scan_init(self, e: Expr, acc: str) -> str:
        """Declare scan ``e``'s running value (float registers for 16-bit floats, as every value)."""
        lit_d = dtypes.float32 if e.dtype in HALFS else e.dtype
        return f"{self.reg_type(e.dtype)} {acc} = {self.literal(0 if e.arg is Ops.ADD else 1, lit_d)};"

    def scan_step(self, e: Expr, acc: str, v: str) -> str:
        """Fold one value into the running result (16-bit floats accumulate in float, as reductions do)."""
        return f"{acc} {_INFIX[e.arg]}= {v};"

    def accumulate(self, e: Expr, acc: str, acc_t: str, n) -> str:
        """The update of reduce ``e``'s accumulator ``acc`` (C type ``acc_t``); ``n`` spells an operand. A sum of
        float products accumulates with ``fma`` (kernels are compiled without contraction, so elementwise
        code rounds every operation as NumPy does; a sum of products gains speed and accuracy from it)."""
        v = e.srcs[0]
        if e.arg[0] is Ops.ADD and v.op is Ops.MUL and v.dtype in (dtypes.float32, dtypes.float64):
            if acc_t == "double":  # explicit: CUDA has no fma(float, float, double) overload to pick
                return f"{acc} = fma((double){n(v.srcs[0])}, (double){n(v.srcs[1])}, {acc});"
            return f"{acc} = fmaf({n(v.srcs[0])}, {n(v.srcs[1])}, {acc});"
        return self.update(e.arg[0], acc, n(v), e.dtype)

    def update(self, op: Ops, acc: str, v: str, d: DType) -> str:
        if op in (Ops.ADD, Ops.MUL) and d.kind == "i" and d.itemsize >= 4:  # wraps, never undefined
            return f"{acc} = {wrapping(op, acc, v, d)};"
        if op is Ops.ADD:
            return f"{acc} += {v};"
        if op is Ops.MUL:
            return f"{acc} *= {v};"
        if op is Ops.OR:
            return f"{acc} |= {v};"
        if op is Ops.AND:
            return f"{acc} &= {v};"
        c = ">" if op is Ops.MAX else "<"
        if d.is_float:
            flag = acc.replace("[", "_nan[", 1) if acc.endswith("]") else f"{acc}_nan"
            return f"{acc} = ({v} {c} {acc}) ? {v} : {acc}; {flag} |= ({v} != {v});"
        return f"{acc} = ({v} {c} {acc}) ? {v} : {acc};"

    def render(self, k: Kernel) -> str:
        raise NotImplementedError


class CRenderer(CStyleRenderer):
    """C11 + OpenMP for the host compiler (gcc or clang)."""

    restrict = "restrict"

    math_fns = C_MATH_FUNCTIONS
    # a float sum over several ranges whose innermost has at most this many iterations keeps one partial sum per
    # iteration of it (summed after the nest): a reduction clause would add the vector up at the end of every
    # row (a depthwise convolution's weight gradient sums rows of 56 positions)
    nest_lanes = 64
    # a short simd loop whose trip count is not a whole number of vectors of this many bytes runs the whole vectors,
    # then its last vector again, overlapping the previous one (``overlapped_tail``): GCC 12 ran the rest one
    # element at a time (a softmax over rows of 56: 8 exponentials of 56 scalar, 1.3 ms against 0.64 for rows of
    # 64 at 21504 rows). 64: a whole AVX-512 vector, two AVX2 ones
    tail_bytes = 64
    # loops of cheap elements (sums, differences) take an overlapped tail only over at most this many whole vectors
    # (``overlapped_tail``)
    cheap_tail_vectors = 6

    def prelude(self) -> str:
        return _HOST_PRELUDE

    def memory_type(self, d: DType) -> str:
        """The type of a bool kept across iterations (an accumulator, a stashed row): ``unsigned char``, since GCC
        vectorizes no loop that loads a ``_Bool`` array or carries a ``_Bool`` reduction (a top-k selection pass,
        an ``any`` beside a stashed mask, ran scalar: 8.5 ms instead of 1.2 at 2048x2048)."""
        return "unsigned char" if d is dtypes.bool_ else self.reg_type(d)

    def acc_type(self, e: Expr, k: Kernel) -> str:
        return self.memory_type(e.dtype) if e.dtype is dtypes.bool_ else super().acc_type(e, k)

    def select(self, cond: str, a: str, b: str, dtype) -> str:
        # a float select as bit masks: GCC turns a ternary with a constant arm into control flow (under
        # -ftrapping-math), and finds no vector type for a _Bool -> float conversion: either keeps the whole
        # loop scalar (relu's gradient ran 20x slower)
        if dtype is dtypes.float32:
            return f"zyx__sel32({cond}, {a}, {b})"
        if dtype is dtypes.float64:
            return f"zyx__sel64({cond}, {a}, {b})"
        return super().select(cond, a, b, dtype)

    def scalar_select(self, e: Expr, name: dict[Expr, str]) -> str | None:
        """An int64 / int32 ``WHERE`` outside vectorized loops as bit masks (``zyx__seli64`` / ``zyx__seli32``);
        None for other dtypes. GCC made a branch of the ternary that picks a 3x3 max pooling window's first
        maximal tap, mispredicted at random taps (16x64x28^2 windows: 4.7 -> 3.2 ms); in a vectorized loop the
        ternary stays, a blend (a 4096x1024 argmax: 279 us, 372 with masks)."""
        fn = _MASK_SELECTS.get(e.dtype)
        if fn is None:
            return None
        n = self.operand_namer(e, name)
        return f"{fn}({', '.join(n(x) for x in e.srcs)})"

    def render(self, k: Kernel) -> str:
        lines: list[str] = []
        name: dict[Expr, str] = {}
        counter = [0]

        def fresh(prefix: str) -> str:
            counter[0] += 1
            return f"{prefix}{counter[0]}"

        def rng(r: Expr) -> str:
            return f"r{r.arg[0]}"

        def operand(x: Expr) -> str:
            if x.op is Ops.CONST:
                return self.literal(x.arg, x.dtype)
            return rng(x) if x.op is Ops.RANGE else name[x]

        vector_depth = [0]  # vectorized loops around the statement being emitted (``vectorized``)

        def vectorized(loop: Loop) -> bool:
            """Whether GCC vectorizes ``loop``: marked simd and long enough for a vector of 64-bit lanes."""
            return loop.kind in ("simd", "parallel_simd") and loop.range.arg[1] >= VECTOR_MIN_TRIP

        def emit_block(b: Block, ind: str, vector: bool = False) -> None:
            vector_depth[0] += vector
            for s in b.stmts:
                emit_stmt(s, ind)
            if b.inner is not None:
                emit_loop(b.inner, ind)
            for s in b.tail:
                emit_stmt(s, ind)
            vector_depth[0] -= vector

        def emit_stmt(s, ind: str) -> None:
            if isinstance(s, Reduce):
                emit_reduce(s, ind)
            elif isinstance(s, ScanInit):
                acc_name[s.expr] = fresh("scan")
                lines.append(ind + self.scan_init(s.expr, acc_name[s.expr]))
            elif isinstance(s, Store):
                p = k.params[s.param]
                v = s.value
                if v.op is Ops.CAST and p.dtype in HALFS and v.srcs[0].dtype is dtypes.float32:
                    v = v.srcs[0]  # the storage conversion rounds once, as the cast would have first
                val = operand(v)
                if s.value.dtype is not p.dtype:
                    raise AssertionError(f"store of {s.value.dtype} into {p.dtype} param")
                idx = operand(s.index)
                lines.append(f"{ind}p{s.param}[{idx}] = {self.to_storage(val, p.dtype)};")
            elif s.op is Ops.REDUCE:  # the accumulate statement at the end of the innermost reduce loop
                at = "float" if s in float_partials else self.acc_type(s, k)
                lines.append(ind + self.accumulate(s, acc_name[s], at, operand if gate[0] is None else gated(s, ind)))
            elif s.op is Ops.SCAN:
                lines.append(ind + self.scan_step(s, acc_name[s], operand(s.srcs[0])))
                name[s] = self.round_half(acc_name[s], s.dtype)
            elif s.op is Ops.STASH:
                name[s] = operand(s.srcs[0])
                lines.append(f"{ind}zloc{s.arg}[{rng(s.srcs[1])}] = {name[s]};")
            elif s in staged:
                name[s] = staged[s]
            else:
                nm = fresh("v")
                rhs = (s.op is Ops.WHERE and not vector_depth[0] and self.scalar_select(s, name)) or \
                    self.expr(s, name, k.params)
                lines.append(f"{ind}const {self.reg_type(s.dtype)} {nm} = {rhs};")
                name[s] = nm

        acc_name: dict[Expr, str] = {}
        float_partials: set[Expr] = set()  # reduces accumulating a block in float (then added into a double)
        gate: list[str | None] = [None]  # in an overlapped tail: the condition under which an iteration accumulates

        def gated(e: Expr, ind: str) -> Callable[[Expr], str]:
            """``operand`` for reduce ``e``'s accumulate in an overlapped tail: its value, and both factors of a
            fused multiply-add, defined anew as the op's identity (0 for a factor) where ``gate`` does not hold."""
            v = e.srcs[0]
            fused = e.arg[0] is Ops.ADD and v.op is Ops.MUL and v.dtype in (dtypes.float32, dtypes.float64)
            spelled: dict[Expr, str] = {}
            for x in dict.fromkeys(v.srcs if fused else (v,)):  # (``accumulate``'s operands)
                rd = dtypes.float32 if x.dtype in HALFS else x.dtype
                neutral = self.identity(e.arg[0], e, self.reg_type(rd)) if x is v else self.literal(0, rd)
                nm = fresh("zg")
                lines.append(f"{ind}const {self.reg_type(x.dtype)} {nm} = "
                             f"{self.select(gate[0], operand(x), neutral, rd)};")
                spelled[x] = nm
            return lambda x: spelled.get(x) or operand(x)

        def overlapped_tail(loop: Loop, lo: str, hi: str, accumulates: bool) -> tuple[int, int] | None:
            """(whole, lanes): ``loop`` runs ``[0, whole)`` in whole vectors of ``tail_bytes``, then ``[n - lanes,
            n)`` again (``n`` its trip count), when ``n`` is more than a vector and at least 2 past whole ones: an
            innermost simd loop over its whole range whose statements are values, contiguous (or invariant) loads
            and stores, local rows (all idempotent: the overlap recomputes and stores the same values) and, if
            ``accumulates``, the accumulates of its own reduce (gated in the tail); and whose elements cost (an
            exponential or another transcendental, a float division, a NaN-tracking maximum or minimum), or which
            has at most ``cheap_tail_vectors`` whole vectors and runs once per output element (not a kernel's
            single total). Kernels alone, 2-core Zen 4, 2M-element float32 inputs, in turns, against costly loops
            only (one combine per reduce, ``lane_reduce_loop``): rows of 23-77, layer norms 0.54-0.66, variances
            0.41-0.57, row sums 0.81-1.06; rows of 100, 0.81-0.86, 0.80-0.87, 1.07-1.19. Every loop overlapped,
            rows of 120 and 150 made row sums 1.06-1.28x slower and layer norms no faster; leaving a plain sum's
            loop whole lost most of a layer norm's gain (rows of 23 and 56: 0.88-0.91). (With a reduction clause
            on each part, row sums of 17-1000 had run 1.2-2.0x slower.) None otherwise."""
            n = loop.range.arg[1]
            if loop.kind != "simd" or (lo, hi) != ("0", str(n)) or loop.body.inner is not None or \
                    loop.range in prefetch or n < VECTOR_MIN_TRIP:
                return None
            sizes, costly = [], False
            for x in walk(loop.body):
                if isinstance(x, Expr) and (x.op in TRANSCENDENTAL or (x.op is Ops.DIV and x.dtype.is_float) or
                                            (x.op is Ops.REDUCE and self.tracks_nan(x))):
                    costly = True
                if isinstance(x, Store):
                    sizes.append(k.params[x.param].dtype.itemsize)
                    index = x.index
                elif not isinstance(x, Expr) or x.op is Ops.SCAN or (x.op is Ops.REDUCE and not accumulates):
                    return None
                elif x.op is Ops.LOAD:
                    sizes.append(k.params[x.arg].dtype.itemsize)
                    index = x.srcs[0]
                elif x.op in (Ops.LOCAL, Ops.STASH):  # a local row's elements
                    sizes.append(x.dtype.itemsize)
                    continue
                else:
                    continue
                if ir.affine_coefficient(index, loop.range) not in (0, 1):  # a gather or a strided access: GCC
                    return None  # keeps such loops scalar, with no tail to spare (and their sums in order)
            if not self.tail_bytes or not sizes:
                return None
            lanes = self.tail_bytes // min(sizes)
            if n <= lanes or n % lanes < 2:  # (one element left: as cheap alone as a vector again)
                return None
            if not costly and (n // lanes > self.cheap_tail_vectors or not k.loops):  # (no output loop: runs once)
                return None
            return n - n % lanes, lanes

        def simd_loop(loop: Loop, ind: str, lo: str, hi: str, pragmas: list[str]) -> None:
            """``loop`` over ``lo`` .. ``hi`` under ``pragmas``; with an ``overlapped_tail`` (a loop of values and
            stores: a reduce's own loop takes its tail in ``lane_reduce_loop``), its whole vectors, then its last
            vector again."""
            r = rng(loop.range)
            split = overlapped_tail(loop, lo, hi, False)
            parts = [(lo, hi)] if split is None else [("0", str(split[0])), (str(loop.range.arg[1] - split[1]), hi)]
            for a, b in parts:
                lines.extend(ind + h for h in pragmas)
                lines.append(f"{ind}for ({self.index_type} {r} = {a}; {r} < {b}; {r}++) {{")
                for f in prefetch.get(loop.range, ()):
                    lines.extend(ind + "  " + x for x in self.prefetch(f, k.params[f.param], r, hi))
                emit_block(loop.body, ind + "  ", vectorized(loop))
                lines.append(f"{ind}}}")

        def emit_reduce(red: Reduce, ind: str) -> None:
            if red.vec is not None:
                emit_vector_reduce(red, ind)
                return
            for x in walk(red.loop.body):  # the local arrays this reduce fills, one row per iteration outside it
                if not isinstance(x, (Reduce, Store, ScanInit)) and x.op is Ops.STASH:
                    lines.append(f"{ind}{self.memory_type(x.dtype)} zloc{x.arg}[{x.srcs[1].arg[1]}];")
            members, kinds = [], set()
            for e in red.exprs:
                acc, at = fresh("acc"), self.acc_type(e, k)
                nan = self.tracks_nan(e)
                # long float sums: float partial sums over blocks (vectorized), accumulated in double
                kinds.add(at == "double" and e.dtype is not dtypes.float64 and e.arg[0] is Ops.ADD
                          and len(e.arg[1]) == 1)
                lines.append(f"{ind}{at} {acc} = {self.identity(e.arg[0], e, at)};")
                if nan:
                    lines.append(f"{ind}int {acc}_nan = 0;")
                members.append((e, acc, at, nan))
            assert len(kinds) == 1, "reduces sharing loops accumulate alike"
            blocked = kinds.pop()
            n = red.loop.range.arg[1]
            if red.split:
                assert not red.siblings, "a split reduce is a kernel's only reduce"
                emit_split_reduce(red, ind, members[0], blocked)
            else:
                reduce_loop(red, ind, "0", str(n), [(e, acc, nan) for e, acc, _, nan in members], blocked)
            for e, acc, at, nan in members:
                fin = self.nan_result(acc, at) if nan else acc
                nm = fresh("v")
                rt = self.reg_type(e.dtype)
                lines.append(f"{ind}const {rt} {nm} = ({rt})({fin});")
                name[e] = nm

        def emit_split_reduce(red: Reduce, ind: str, member: tuple, blocked: bool) -> None:
            """A root reduce split across threads: per-thread partials in ``acc_part``, combined after."""
            e, acc, at, nan = member
            op, n, ident = e.arg[0], red.loop.range.arg[1], self.identity(e.arg[0], e, at)
            lines.append(f"{ind}{at} {acc}_part[256]; int {acc}_nt = 1;")
            if nan:
                lines.append(f"{ind}int {acc}_nanp[256];")
            lines.append(f"{ind}#pragma omp parallel num_threads(zyx_threads(256))")
            lines.append(f"{ind}{{")
            i2 = ind + "  "
            lines.append(f"{i2}const int tid = omp_get_thread_num(), nt = omp_get_num_threads();")
            lines.append(f"{i2}const long long lo = ({n}LL * tid) / nt, hi = ({n}LL * (tid + 1)) / nt;")
            lines.append(f"{i2}{at} {acc} = {ident};")
            if nan:
                lines.append(f"{i2}int {acc}_nan = 0;")
            reduce_loop(red, i2, "lo", "hi", [(e, acc, nan)], blocked)
            lines.append(f"{i2}{acc}_part[tid] = {acc}; {acc}_nt = nt;")
            if nan:
                lines.append(f"{i2}{acc}_nanp[tid] = {acc}_nan;")
            lines.append(f"{ind}}}")
            lines.append(f"{ind}for (int t = 0; t < {acc}_nt; t++) {{")
            comb = self.update(op, acc, f"{acc}_part[t]", e.dtype).split(";")[0] + ";"
            lines.append(f"{ind}  {comb}" + (f" {acc}_nan |= {acc}_nanp[t];" if nan else ""))
            lines.append(f"{ind}}}")

        def emit_vector_reduce(red: Reduce, ind: str) -> None:
            """One accumulator per iteration of ``red.vec`` for each reduce of ``red`` (siblings share its loops),
            ``red.vec`` running innermost (vectorized) inside the reduce loops; a value is read as ``acc[r]`` inside
            the output loop of that range."""
            r, n = rng(red.vec), red.vec.arg[1]
            accs = []
            for e in red.exprs:
                acc, at, nan = fresh("acc"), self.acc_type(e, k), self.tracks_nan(e)
                lines.append(f"{ind}{at} {acc}[{n}];" + (f" int {acc}_nan[{n}];" if nan else ""))
                lines.append(f"{ind}for (int t = 0; t < {n}; t++) {{ {acc}[t] = {self.identity(e.arg[0], e, at)};"
                             + (f" {acc}_nan[t] = 0;" if nan else "") + " }")
                accs.append((e, acc, at, nan))
            if red.block is None:
                for e, acc, _, _ in accs:
                    acc_name[e] = f"{acc}[{r}]"
                emit_loop(red.loop, ind)
            else:
                (e, acc, at, _), = accs  # a register-tiled column sum is its kernel's only reduce
                emit_blocked_vector_loop(red, ind, acc, at)
            for e, acc, at, nan in accs:
                rt = self.reg_type(e.dtype)
                name[e] = f"(({rt}){self.nan_result(f'{acc}[{r}]', at, f'{acc}_nan[{r}]') if nan else f'{acc}[{r}]'})"

        def emit_blocked_vector_loop(red: Reduce, ind: str, acc: str, at: str) -> None:
            """The loops of a register-tiled column sum (``opt.block_vector_reduce``): blocks of ``rb`` reduce
            iterations; per block and tile of ``t`` columns, partial sums (float32 under a float64
            accumulator) that are then added into ``acc``."""
            e, (rb, t) = red.expr, red.block
            r, j = rng(red.loop.range), rng(red.vec)
            n, cols = red.loop.range.arg[1], red.vec.arg[1]
            pt = "float" if at == "double" and e.dtype is dtypes.float32 else at
            if pt != at:
                float_partials.add(e)
            part = f"{acc}_t"
            acc_name[e] = f"{part}[{j} - {j}_t]"
            it = self.index_type
            lines.append(f"{ind}for ({it} {r}_b = 0; {r}_b < {n}; {r}_b += {rb}) {{")
            i2, i3 = ind + "  ", ind + "    "
            lines.append(f"{i2}const {it} {r}_e = {r}_b + {rb} < {n} ? {r}_b + {rb} : {n};")
            lines.append(f"{i2}for ({it} {j}_t = 0; {j}_t < {cols}; {j}_t += {t}) {{")
            lines.append(f"{i3}{pt} {part}[{t}];")
            lines.append(f"{i3}for (int t = 0; t < {t}; t++) {{ {part}[t] = {self.identity(Ops.ADD, e, pt)}; }}")
            lines.append(f"{i3}for ({it} {r} = {r}_b; {r} < {r}_e; {r}++) {{")
            bounds[red.loop.body.inner] = (f"{j}_t", f"{j}_t + {t}")
            emit_block(red.loop.body, i3 + "  ")
            lines.append(f"{i3}}}")
            lines.append(f"{i3}#pragma omp simd")
            lines.append(f"{i3}for (int t = 0; t < {t}; t++) {{ {acc}[{j}_t + t] += {part}[t]; }}")
            lines.append(f"{i2}}}")
            lines.append(f"{ind}}}")

        bounds: dict[Loop, tuple[str, str]] = {}  # loops rendered over other bounds than 0 .. size
        # innermost loops of multi-range reduce nests -> their reduction clauses (without one, a simd loop
        # accumulating a scalar stayed a sequential loop: a sum over (h, w) rows of 56 ran one add at a time)
        inner_reds: dict[Loop, list] = {}
        # long innermost loops of multi-range float32 sums -> the (expr, double accumulator) pairs they add into in
        # blocks (``blocked_loop``): a batch norm's per-channel sums over (n, h*w) had added one double at a time
        blocked_inner: dict[Loop, list[tuple[Expr, str]]] = {}

        def inline(x: Expr) -> str:
            """``x`` spelled in place: named values by name, the rest from its operands (an index's arithmetic)."""
            if x.op in (Ops.CONST, Ops.RANGE) or x in name:
                return operand(x)
            return f"({self.expr(x, {s: inline(s) for s in x.srcs}, k.params)})"

        def stream_prefetches(loop: Loop, lanes: int) -> list[str]:
            """``Kernel.stream_prefetch``'s statements at the top of a block of ``lanes``: for each contiguous load
            of a prefetched input in ``loop``, the lines of the block ``distance`` elements ahead (its range
            redefined in a scope of its own as ``r_o + distance``, so the index renders as in the loop)."""
            f = next((part.stream_prefetch for part in (k, *k.then) if part.stream_prefetch is not None), None)
            if f is None:
                return []
            r, it = rng(loop.range), self.index_type
            out: list[str] = []
            seen: set[Expr] = set()
            for x in walk(loop.body):
                if isinstance(x, Expr) and x.op is Ops.LOAD and x.arg in f.params and len(x.srcs) == 1 and \
                        x.srcs[0] not in seen and ir.affine_coefficient(x.srcs[0], loop.range) == 1:
                    seen.add(x.srcs[0])
                    p = k.params[x.arg]
                    line = max(64 // p.dtype.itemsize, 1)
                    last = max(p.size - lanes, 0)  # the block's start, clipped so that the block stays in the buffer
                    out += [f"{{ const {it} {r} = {r}_o + {f.distance}LL; const {it} zi = {inline(x.srcs[0])};",
                            f"  const {it} zq = zi < {last}LL ? zi : {last}LL;",
                            f"  for (int zl = 0; zl < {lanes}; zl += {line}) "
                            f"__builtin_prefetch(p{x.arg} + zq + zl, 0, {f.locality}); }}"]
            return out

        def reduce_loop(red: Reduce, ind: str, lo: str, hi: str, members: list[tuple[Expr, str, bool]],
                        blocked: bool) -> None:
            """The loops of ``red``, accumulating each (expr, accumulator, tracks NaN) of ``members``."""
            loop = red.loop
            if not blocked:
                reds = []
                for e, acc, nan in members:
                    acc_name[e] = acc
                    reds += [(_OMP_RED[e.arg[0]], acc)] + ([("|", f"{acc}_nan")] if nan else [])
                inner = loop  # the clauses go on the nest's innermost loop, the one marked simd
                for _ in range(len(red.expr.arg[1]) - 1):
                    inner = inner.body.inner
                n_lanes = inner.range.arg[1]
                lanes = inner is not loop and inner.kind == "simd" and n_lanes <= self.nest_lanes and \
                    all(e.arg[0] is Ops.ADD and e.dtype.is_float and not nan for e, _, nan in members)
                long_inner = inner is not loop and inner.kind == "simd" and n_lanes > self.nest_lanes and all(
                    e.arg[0] is Ops.ADD and e.dtype is dtypes.float32 and self.acc_type(e, k) == "double" and not nan
                    for e, _, nan in members)
                if long_inner:  # a long contiguous innermost loop: blocks of float partial sums, as a row sum's
                    blocked_inner[inner] = [(e, acc) for e, acc, _ in members]
                    reds = []
                elif lanes:  # one partial sum per iteration of the innermost loop, summed after the nest
                    ri = rng(inner.range)
                    # float lanes under a double accumulator when each adds at most ``sum_block`` terms (as the
                    # blocks of long sums do): a float converted to double under a gate kept GCC from
                    # if-converting the loop (the conversion may trap)
                    depth = math.prod(r.arg[1] for r in red.expr.arg[1][:-1])
                    for e, acc, _ in members:
                        lt = self.acc_type(e, k)
                        if lt == "double" and e.dtype is dtypes.float32 and depth <= self.sum_block:
                            lt = "float"
                            float_partials.add(e)
                        lines.append(f"{ind}{lt} {acc}_l[{n_lanes}];")
                        lines.append(f"{ind}for (int t = 0; t < {n_lanes}; t++) {{ {acc}_l[t] = 0; }}")
                        acc_name[e] = f"{acc}_l[{ri}]"
                    reds = []
                elif inner is not loop:
                    inner_reds[inner] = reds
                    reds = []
                split = overlapped_tail(loop, lo, hi, True) if inner is loop else None
                if split is not None:
                    lane_reduce_loop(loop, ind, members, *split)
                    return
                simd_loop(loop, ind, lo, hi, self.pragmas(loop, reds))
                if lanes:
                    for _, acc, _ in members:
                        lines.append(f"{ind}for (int t = 0; t < {n_lanes}; t++) {{ {acc} += {acc}_l[t]; }}")
                return
            blocked_loop(loop, ind, lo, hi, [(e, acc) for e, acc, _ in members])

        def lane_reduce_loop(loop: Loop, ind: str, members: list[tuple[Expr, str, bool]], whole: int,
                             lanes: int) -> None:
            """A reduce's own simd loop with an ``overlapped_tail``: one accumulator per lane (``<acc>_v``, ``lanes``
            of them) through its whole vectors and its gated last vector, then the lanes combined into each (expr,
            accumulator, tracks NaN) of ``members`` once. Reduction clauses on the two loops had combined a vector
            at the end of each (a softmax over rows of 56, 2-core Zen 4: 0.67 ms against 0.55 with one combine)."""
            r, it, n = rng(loop.range), self.index_type, loop.range.arg[1]
            for e, acc, nan in members:
                at = self.acc_type(e, k)
                lines.append(f"{ind}{at} {acc}_v[{lanes}];" + (f" int {acc}_v_nan[{lanes}];" if nan else ""))
                lines.append(f"{ind}for (int t = 0; t < {lanes}; t++) {{ {acc}_v[t] = {self.identity(e.arg[0], e, at)};"
                             + (f" {acc}_v_nan[t] = 0;" if nan else "") + " }")
                acc_name[e] = f"{acc}_v[{r}_l]"
            lines.append(f"{ind}for ({it} {r}_o = 0; {r}_o < {whole}; {r}_o += {lanes}) {{")
            for start, i2, g in ((f"{r}_o", ind + "  ", None), (str(n - lanes), ind, f"{r} >= {whole}")):
                lines.append(f"{i2}#pragma omp simd")
                lines.append(f"{i2}for (int {r}_l = 0; {r}_l < {lanes}; {r}_l++) {{")
                lines.append(f"{i2}  const {it} {r} = {start} + {r}_l;")
                gate[0] = g
                emit_block(loop.body, i2 + "  ", True)
                gate[0] = None
                lines.append(f"{i2}}}")
                if g is None:
                    lines.append(f"{ind}}}")
            for e, acc, nan in members:
                def fold(dst: str, src: str, e=e, acc=acc, nan=nan) -> str:
                    return (self.update(e.arg[0], f"{acc}_v[{dst}]", f"{acc}_v[{src}]", e.dtype).split(";")[0] + ";"
                            + (f" {acc}_v_nan[{dst}] |= {acc}_v_nan[{src}];" if nan else ""))
                halving_combine(ind, lanes, fold)
                lines.append(f"{ind}" + self.update(e.arg[0], acc, f"{acc}_v[0]", e.dtype).split(";")[0] + ";"
                             + (f" {acc}_nan |= {acc}_v_nan[0];" if nan else ""))

        def halving_combine(ind: str, lanes: int, fold: Callable[[str, str], str]) -> None:
            """Fold ``lanes`` partials into the first: what lies past the largest power of two, then halves, each
            step a vectorized loop (``fold(dst, src)`` spells one lane's step). A reduction clause over the lanes
            had compiled into one add after another (16 scalar adds and 7 vector ones for a row sum's 128 lanes:
            the 4096^2 row sum kernel alone ran 0.2-4% slower)."""
            p = 1 << (lanes.bit_length() - 1)
            steps = [(p, lanes - p)] if lanes > p else []
            h = p // 2
            while h:
                steps.append((h, h))
                h //= 2
            for off, count in steps:
                lines.append(f"{ind}#pragma omp simd")
                lines.append(f"{ind}for (int t = 0; t < {count}; t++) {{ {fold('t', f't + {off}')} }}")

        def blocked_loop(loop: Loop, ind: str, lo: str, hi: str, members: list[tuple[Expr, str]]) -> None:
            """``loop`` over ``lo`` .. ``hi`` adding float32 terms into each (expr, double accumulator) of
            ``members`` in blocks: float partial sums per block (``reduce_lanes`` of them where they tile it),
            each block's sum then added into the accumulator."""
            r = rng(loop.range)
            parts = [(e, acc, f"{acc}_b") for e, acc in members]
            float_partials.update(e for e, _ in members)
            it = self.index_type
            lanes = _tiling_lanes(k.reduce_lanes, lo, hi)
            # with lanes, each lane adds ``lane_depth`` elements per block: a block's lane sum and its add into
            # the wide accumulator (~50 cycles) cost 20% of a row sum's time at blocks of 256
            b = lanes * self.lane_depth if lanes > 1 else self.sum_block
            if lanes > 1 and int(hi) - int(lo) <= b:
                lines.append(f"{ind}{{")
                lines.append(f"{ind}  const {it} {r}_b = {lo}, {r}_e = {hi};")
            else:
                lines.append(f"{ind}for ({it} {r}_b = {lo}; {r}_b < {hi}; {r}_b += {b}) {{")
                lines.append(f"{ind}  const {it} {r}_e = {r}_b + {b} < {hi} ? {r}_b + {b} : {hi};")
            i2 = ind + "  "
            for _, _, part in parts:
                lines.append(f"{i2}float {part} = 0.0f;")
            if lanes > 1:  # ``opt.unroll_reduce``: ``lanes`` independent partial sums, then their sum
                i3 = i2 + "  "
                for e, _, part in parts:
                    acc_name[e] = f"{part}_t[{r}_l]"
                    lines.append(f"{i2}float {part}_t[{lanes}];")
                    lines.append(f"{i2}for (int t = 0; t < {lanes}; t++) {{ {part}_t[t] = 0.0f; }}")
                lines.append(f"{i2}for ({it} {r}_o = {r}_b; {r}_o < {r}_e; {r}_o += {lanes}) {{")
                lines.extend(i3 + x for x in stream_prefetches(loop, lanes))
                lines.append(f"{i3}#pragma omp simd")
                # a lane counter with a constant trip count (``r_o + lanes`` may wrap under -fwrapv, which
                # kept GCC from holding the lanes in registers)
                lines.append(f"{i3}for (int {r}_l = 0; {r}_l < {lanes}; {r}_l++) {{")
                lines.append(f"{i3}  const {it} {r} = {r}_o + {r}_l;")
                emit_block(loop.body, i3 + "  ", True)
                lines.append(f"{i3}}}")
                lines.append(f"{i2}}}")
                for _, _, part in parts:
                    halving_combine(i2, lanes, lambda dst, src, part=part: f"{part}_t[{dst}] += {part}_t[{src}];")
                    lines.append(f"{i2}{part} += {part}_t[0];")
            else:
                for e, _, part in parts:
                    acc_name[e] = part
                lines.extend(i2 + h for h in self.pragmas(loop, [("+", part) for _, _, part in parts]))
                lines.append(f"{i2}for ({it} {r} = {r}_b; {r} < {r}_e; {r}++) {{")
                emit_block(loop.body, i2 + "  ", vectorized(loop))
                lines.append(f"{i2}}}")
            for _, acc, part in parts:
                lines.append(f"{i2}{acc} += {part};")
            lines.append(f"{ind}}}")

        def emit_loop(loop: Loop, ind: str, reds: list | None = None) -> None:
            part = transposing.get(loop.range)
            if part is not None and loop not in block_loops and loop.body.inner is not None and \
                    loop.body.inner.range is part.loops[-1]:
                emit_transpose_blocks(loop, part, ind)
                return
            if loop in block_loops:  # a constant trip count (``base + b`` may wrap under -fwrapv: GCC then kept a
                # 4096^2 transpose's blocks at 12 ms, 7 with the count)
                r, (base, b) = rng(loop.range), block_loops[loop]
                lines.extend(ind + h for h in self.pragmas(loop, []))
                lines.append(f"{ind}for (int {r}_l = 0; {r}_l < {b}; {r}_l++) {{")
                lines.append(f"{ind}  const {self.index_type} {r} = {base} + {r}_l;")
                emit_block(loop.body, ind + "  ", vectorized(loop))
                lines.append(f"{ind}}}")
                return
            lo, hi = bounds.get(loop, ("0", str(loop.range.arg[1])))
            if loop in blocked_inner:
                blocked_loop(loop, ind, lo, hi, blocked_inner[loop])
                return
            simd_loop(loop, ind, lo, hi, self.pragmas(loop, reds or inner_reds.get(loop, [])))

        def emit_transpose_blocks(loop: Loop, part: Kernel, ind: str) -> None:
            """The tile loops ``(i, j)`` of ``part`` (``Kernel.transpose_block``) in blocks of ``b`` x ``b``: each
            staged load's block transposed through registers into ``zt`` (``register_transpose``: rows of ``b``
            along ``i`` at the load's stride along ``j``), then both loops over the block, the load read from
            ``zt``."""
            inner, b, it = loop.body.inner, part.transpose_block, self.index_type
            ri, rj = rng(loop.range), rng(inner.range)
            lines.append(f"{ind}for ({it} zjb = 0; zjb < {inner.range.arg[1]}; zjb += {b}) {{")
            lines.append(f"{ind}  for ({it} zib = 0; zib < {loop.range.arg[1]}; zib += {b}) {{")
            i2 = ind + "    "
            for e in ir.transposed_block_loads(part):
                pd, zt = k.params[e.arg].dtype, fresh("zt")
                ct = self.storage_type(pd)
                stride = ir.affine_coefficient(e.srcs[0], inner.range)
                lines.append(f"{i2}{ct} {zt}[{b * b}];")
                lines.append(f"{i2}{{ const {it} {ri} = zib, {rj} = zjb;")
                lines.append(f"{i2}  const {ct} *zs = p{e.arg} + {inline(e.srcs[0])};")
                lines.append("#if defined(__GNUC__) && !defined(__clang__)")
                lines.extend(vector_types(i2 + "  ", ct, pd.itemsize, b))
                lines.extend(register_transpose(i2 + "  ", b, f"zs + zj * {stride}LL", f"&{zt}[zj * {b}]"))
                lines.append("#else")
                lines.append(f"{i2}  for (int zj = 0; zj < {b}; zj++) for (int zi = 0; zi < {b}; zi++) "
                             f"{zt}[zi * {b} + zj] = zs[zj * {stride}LL + zi];")
                lines.append("#endif")
                lines.append(f"{i2}}}")
                staged[e] = self.from_storage(f"{zt}[{ri}_l * {b} + {rj}_l]", pd)
            block_loops[loop], block_loops[inner] = ("zib", b), ("zjb", b)
            emit_loop(loop, i2)
            lines.append(f"{ind}  }}")
            lines.append(f"{ind}}}")

        # the loop ``i`` of each tiled transpose staging loads in register-transposed blocks -> its segment
        transposing = {part.loops[-2]: part for part in (k, *k.then) if part.transpose_block}
        staged: dict[Expr, str] = {}  # a staged load -> its element of the block (``emit_transpose_blocks``)
        block_loops: dict[Loop, tuple[str, int]] = {}  # a loop over one block -> (its first value, the block's edge)
        prefetch: dict[Expr, list[ir.Prefetch]] = {}
        for part in (k, *k.then):
            for f in part.prefetch:
                prefetch.setdefault(f.loop, []).append(f)
        for i, p in enumerate(k.params):
            if p.kind == "var":
                lines.append(f"  const {self.reg_type(p.dtype)} a{i} = *(const {self.reg_type(p.dtype)}*)args[{i}];")
            else:
                c = "const " if p.kind == "in" else ""
                st = self.storage_type(p.dtype)
                lines.append(f"  {c}{st} *{self.restrict} p{i} = ({c}{st}*)args[{i}];")
        if not k.then and k.gemm is None:
            emit_block(linearize(k), "  ")
        else:
            for part in (k, *k.then):  # one scope per segment: names never leak between them
                name.clear()
                acc_name.clear()
                staged.clear()
                lines.append("  {")
                if part.gemm is not None:
                    lines.extend(self.render_gemm(part, part.gemm, "    "))
                elif part.scatter is not None:
                    lines.extend(self.render_scatter(part, part.scatter, "    "))
                else:
                    emit_block(linearize(part), "    ")
                lines.append("  }")
        body = "\n".join(lines)
        attr = ""
        if any(part.gemm is not None for part in (k, *k.then)):
            attr = "ZYX_GEMM_ATTR "
        if self.no_if_convert(k):
            attr += "ZYX_NO_IFCVT "
        if self.narrows_float64(k):
            attr += "ZYX_NO_SLP "
        return f"{self.prelude()}\n{attr}void {k.name}(void **args) {{\n{body}\n}}\n"

    @staticmethod
    def narrows_float64(k: Kernel) -> bool:
        """Whether ``k`` casts float64 to a narrower float, which GCC 12's SLP vectorizer may drop (``ZYX_NO_SLP``): a
        float64 sum of ``x.float().double()`` beside a sum reading ``x`` transposed added two of the unrounded values
        (-O3 -march=native, GCC 12.2: the 2-lane part of the vectorized loop skipped the float32 pack and unpack)."""
        return any(e.op is Ops.CAST and e.srcs[0].dtype is dtypes.float64 and e.dtype.is_float and
                   e.dtype.itemsize < 8 for part in (k, *k.then)
                   for e in ir.toposort([x for s in part.stores for x in (s.index, s.value)]))

    @staticmethod
    def no_if_convert(k: Kernel) -> bool:
        """Whether ``k`` has a masked interleaved group, which GCC 12 vectorizes wrong (``ZYX_NO_IFCVT``): two gated
        loads of one input whose indices advance by the same stride of 2 or more along an innermost loop (an output
        nest's last loop or a reduce's last range). ``opt.unroll_divmod_loops`` makes them from a padded reshape;
        compiled without if-conversion, such loops run scalar but right."""
        for part in (k, *k.then):
            roots = [x for s in part.stores for x in (s.index, s.value)]
            exprs = ir.toposort(roots)
            reds = [e for e in exprs if e.op is Ops.REDUCE and e.arg[1]]
            inner = {e.arg[1][-1] for e in reds  # the last range of a reduce around no other reduce
                     if not any(x.op is Ops.REDUCE for x in ir.toposort([e.srcs[0]]))}
            # the last output loop, unless reduces too long for GCC to unroll whole run inside it (then it does
            # not vectorize: a depthwise weight gradient's channel loop around sums over the batch and positions)
            if part.loops and not any(part.loops[-1] in e.ranges and
                                      math.prod(r.arg[1] for r in e.arg[1]) >= 64 for e in reds):
                inner.add(part.loops[-1])
            gated = [e for e in exprs if e.op is Ops.LOAD and len(e.srcs) > 1]
            for r in inner:
                seen: dict[tuple[int, int], Expr] = {}
                for e in gated:
                    c = ir.affine_coefficient(e.srcs[0], r)
                    if c is None or abs(c) < 2:
                        continue
                    first = seen.setdefault((e.arg, c), e.srcs[0])
                    if first is not e.srcs[0]:
                        return True
        return False

    def render_scatter(self, k: Kernel, sc: ir.Scatter, ind: str) -> list[str]:
        """``opt.scatter_one_hot``'s adding segment: the sum's ranges in order (one thread), the target row of each
        iteration named as the target loop's variable, then the kernel's other loops (the innermost vectorized:
        one row's elements are distinct) adding the store's value into its element."""
        (st,) = k.stores
        p = k.params[st.param]
        lines: list[str] = []
        name: dict[Expr, str] = {}

        def n(x: Expr) -> str:
            return self.operand_namer(x, name)(x)

        def define(roots: list[Expr], at: str) -> None:
            for e in ir.toposort(roots):
                if e not in name and e.op not in (Ops.CONST, Ops.RANGE):
                    nm = f"s{len(name)}"
                    lines.append(f"{at}const {self.reg_type(e.dtype)} {nm} = {self.expr(e, name, k.params)};")
                    name[e] = nm

        def loop(r: Expr, at: str) -> None:
            v = f"r{r.arg[0]}"
            lines.append(f"{at}for ({self.index_type} {v} = 0; {v} < {r.arg[1]}; {v}++) {{")

        at = ind
        for r in sc.ranges:
            loop(r, at)
            at += "  "
        define([sc.index], at)
        t = f"r{sc.target.arg[0]}"
        lines.append(f"{at}const {self.index_type} {t} = {n(sc.index)};")
        lines.append(f"{at}if ({t} >= 0 && {t} < {sc.target.arg[1]}) {{")
        at += "  "
        for i, r in enumerate(k.loops):
            if i == len(k.loops) - 1:
                lines.append(f"{at}#pragma omp simd")
            loop(r, at)
            at += "  "
        define([st.index, st.value], at)
        dst = f"p{st.param}[{n(st.index)}]"
        lines.append(f"{at}{dst} = {self.to_storage(f'{self.from_storage(dst, p.dtype)} + {n(st.value)}', p.dtype)};")
        for _ in range(len(sc.ranges) + 1 + len(k.loops)):
            at = at[:-2]
            lines.append(f"{at}}}")
        return lines

    def render_gemm(self, k: Kernel, g: GemmTile, ind: str) -> list[str]:
        """The loop nest of a register-tiled contraction (``opt.GemmTile`` ``g``): inside one parallel region,
        per batch index, column panel and k block, the threads pack ``g.c.b`` into ``zpk`` (``nr``-wide
        micro-panels, k-major, zero past the last column), then share the ``mr`` x ``nr`` tiles (``g.per_batch``:
        each thread takes whole batch indices and has a ``zpk`` of its own, with no worksharing inside; with
        ``g.rows`` there are no batch loops left: they run inside the rows, ``split_rows``); a tile
        accumulates in ``zc`` (a local array of constant shape that gcc keeps in vector registers), then the
        stores run per element of the tile with the reduce read from it."""
        c = g.c
        lines: list[str] = []
        counter = [0]
        it = self.index_type
        d = c.red.dtype
        at = self.acc_type(c.red, k)
        pt = self.reg_type(d)  # the tile's type (float32 partials under float64 accumulators)
        rt = self.reg_type(d)
        m, n, kk = g.m, g.n, c.k.arg[1]
        mr, nr, nc, kc = g.mr, g.nr, g.nc, g.kc
        rm, rn, rk = (f"r{x.arg[0]}" for x in (c.m, c.n, c.k))
        n_inner = c.n.arg[1]  # the innermost column loop's size (``n`` with one column loop)

        def values(roots: list[Expr], ind: str, name: dict[Expr, str]) -> None:
            """Define every value of ``roots`` not yet named, sources first."""
            order: list[Expr] = []
            seen: set[int] = set()

            def visit(e: Expr) -> None:  # sources first, never below a named value (the reduce)
                if id(e) in seen or e in name or e.op in (Ops.CONST, Ops.RANGE):
                    return
                seen.add(id(e))
                for x in e.srcs:
                    visit(x)
                order.append(e)

            for r in roots:
                visit(r)
            for e in order:
                counter[0] += 1
                nm = f"g{counter[0]}"
                lines.append(f"{ind}const {self.reg_type(e.dtype)} {nm} = {self.expr(e, name, k.params)};")
                name[e] = nm

        def operand(x: Expr, name: dict[Expr, str]) -> str:
            return self.literal(x.arg, x.dtype) if x.op is Ops.CONST else name[x]

        def split_rows(ind: str) -> None:
            """With ``g.rows`` (the batch loops folded into the rows): fill ``zrw[l][zi]``, row loop ``l``'s value
            at each row ``zi`` of the tile at ``zi0`` (rows past the end clamped to the last), innermost fastest.
            Once per row tile and thread: consecutive tiles of a thread share their rows across the panels."""
            lines.append(f"{ind}if (zi0 != zrl) {{")
            i1 = ind + "  "
            lines.append(f"{i1}zrl = zi0;")
            lines.append(f"{i1}for (int zi = 0; zi < {mr}; zi++) {{")
            i2 = i1 + "  "
            lines.append(f"{i2}{it} zr = zi0 + zi < {m} ? zi0 + zi : {m - 1};")
            for level in range(len(g.rows) - 1, 0, -1):
                size = g.rows[level].arg[1]
                lines.append(f"{i2}zrw[{level}][zi] = zr % {size}; zr /= {size};")
            lines.append(f"{i2}zrw[0][zi] = zr;")
            lines.append(f"{i1}}}")
            lines.append(f"{ind}}}")

        def row(ind: str, at: str) -> None:
            """Define the row loops' variables at row ``at`` of the tile (``zi0 + at``, clamped to the last row)."""
            if g.rows:
                lines.extend(f"{ind}const {it} r{r.arg[0]} = zrw[{level}][{at}];" for level, r in enumerate(g.rows))
            else:
                lines.append(f"{ind}const {it} {rm} = zi0 + {at} < {m} ? zi0 + {at} : {m - 1};")

        def fma(a: str, b: str, acc: str) -> str:
            if d is dtypes.float32:
                return f"{acc} = fmaf({a}, {b}, {acc});"
            if d is dtypes.float64:
                return f"{acc} = fma({a}, {b}, {acc});"
            return f"{acc} += ({rt})({a} * {b});"

        def segments(first: str, count: str, ind: str, body: Callable[[str], None]) -> None:
            """Columns ``first .. first + count`` (several column loops) as runs along the innermost loop: per run,
            the outer column loops' values, the run's length ``zl`` and its offset ``zj`` in the range, then
            ``body(ind)``, which runs the innermost loop as ``rn = zo + zt`` for ``zt < zl``."""
            lines.append(f"{ind}for (int zj = 0; zj < {count}; ) {{")
            i1 = ind + "  "
            lines.append(f"{i1}const {it} zq = {first} + zj, zo = zq % {n_inner};")
            rest = f"zq / {n_inner}"
            for r in reversed(g.cols[:-1]):
                lines.append(f"{i1}const {it} r{r.arg[0]} = ({rest}) % {r.arg[1]};")
                rest = f"({rest}) / {r.arg[1]}"
            lines.append(f"{i1}const int zl = {count} - zj < {n_inner} - zo ? (int)({count} - zj) : "
                         f"(int)({n_inner} - zo);")
            body(i1)
            lines.append(f"{i1}zj += zl;")
            lines.append(f"{ind}}}")

        def pack(ind: str, columns: tuple[str, str, str, list[str]], target: str, inside: str | None = None,
                 base: str | None = None) -> None:
            """One pack loop nest storing ``c.b`` into ``target`` (0 where ``inside`` is false): the column loop
            ``columns`` (its variable's type and name, trip count, and the values it defines) and the k loop, k
            outer unless ``g.pack_k_inner``; the inner loop is the vectorized one. With ``g.window`` and ``base``
            (the innermost column index at the column loop's first iteration), the column loop runs in three
            parts: the window's value outside it before and after it, and its value inside it in the middle."""
            k_loop = (it, "zk", "zk1" if g.k_chunk else "zkc", [f"const {it} {rk} = zpc + zk;"])
            outer, inner = (columns, k_loop) if g.pack_k_inner else (k_loop, columns)
            t, var, count, defs = outer
            lines.append(f"{ind}for ({t} {var} = 0; {var} < {count}; {var}++) {{")
            lines.extend(f"{ind}  {x}" for x in defs)
            i1 = ind + "  "
            if g.window is None or base is None:  # (no window along k: ``tile_gemm`` gives k-inner packs none)
                parts = [("zk0" if g.k_chunk else "0", inner[2], c.b, True)]
            else:
                window(i1, base, inner[2])
                w = g.window
                parts = [("0", "zlo", w.outside, False), ("zlo", "zhi", w.inside, True),
                         ("zhi", inner[2], w.outside, False)]
            t, var, _, defs = inner
            for lo, hi, v, simd in parts:
                if simd:
                    lines.append(f"{i1}#pragma omp simd")
                lines.append(f"{i1}for ({t} {var} = {lo}; {var} < {hi}; {var}++) {{")
                if v.op is not Ops.CONST:
                    lines.extend(f"{i1}  {x}" for x in defs)
                name: dict[Expr, str] = {}
                values([v], i1 + "  ", name)
                value = operand(v, name)
                lines.append(f"{i1}  {target} = {value if inside is None else f'{inside} ? {value} : {zero}'};")
                lines.append(f"{i1}}}")
            lines.append(f"{ind}}}")

        def window(ind: str, base: str, count: str) -> None:
            """Define ``zlo`` <= ``zhi`` in [0, ``count``]: the column loop's iterations where every bound of
            ``g.window`` holds, the innermost column index being ``base`` + the iteration. A bound ``lhs - rhs +
            coef * t < 0`` (``e + coef * t < 0`` with ``e`` = lhs - rhs, less 1 when not strict) gives ``t < -e /
            coef`` for ``coef`` > 0, ``t > e / -coef`` for ``coef`` < 0, and holds everywhere or nowhere for 0."""
            lines.append(f"{ind}int zlo = 0, zhi = (int)({count});")
            lines.append(f"{ind}{{")
            i1 = ind + "  "
            lines.append(f"{i1}const {it} {rn} = {base};")
            name: dict[Expr, str] = {}
            values([x for b in g.window.bounds for x in b[:2]], i1, name)
            for lhs, rhs, strict, coef in g.window.bounds:
                e = f"({operand(lhs, name)} - {operand(rhs, name)}{'' if strict else ' - 1'})"
                if coef == 0:
                    lines.append(f"{i1}if ({e} >= 0) zhi = 0;")
                    continue
                q = abs(coef)  # t < ceil(-e / coef) = floor((q - 1 - e) / q), or t > floor(e / q)
                num = f"{q - 1} - {e}" if coef > 0 else e
                floor = "zgn" if q == 1 else f"(zgn >= 0 ? zgn / {q} : -((-zgn + {q - 1}) / {q}))"
                lines.append(f"{i1}{{ const {it} zgn = {num}, zgb = {floor}; " +
                             ("if (zgb < zhi) zhi = (int)zgb; }" if coef > 0 else
                              "if (zgb + 1 > zlo) zlo = (int)(zgb + 1); }"))
            lines.append(f"{ind}}}")
            lines.append(f"{ind}if (zlo > {count}) zlo = {count};")
            lines.append(f"{ind}if (zhi < zlo) zhi = zlo;")

        zero = self.literal(0, d)
        pack_bytes = -(-kc * nc * d.itemsize // 64) * 64 + 64

        def allocate(ind: str) -> None:
            lines.append(f"{ind}{rt} *zpk = ({rt}*)aligned_alloc(64, {pack_bytes}ULL);")
            lines.append(f'{ind}if (!zpk) {{ fputs("zyx: out of memory for the {pack_bytes}-byte packing buffer of '
                         f'kernel {k.name}\\n", stderr); abort(); }}')

        # worksharing of the pack and the tiles: none when each thread runs whole batch indices
        share = "" if g.per_batch else "#pragma omp for schedule(static)"
        if not g.per_batch:
            allocate(ind)
        lines.append(f"{ind}#pragma omp parallel num_threads(zyx_threads(64))")
        lines.append(f"{ind}{{")
        i1 = ind + "  "
        batch = [] if g.rows else k.loops[:k.loops.index(c.m)]
        if g.per_batch:
            allocate(i1)
            collapse = f" collapse({len(batch)})" if len(batch) > 1 else ""
            lines.append(f"{i1}#pragma omp for schedule(static){collapse}")
        for r in batch:
            lines.append(f"{i1}for ({it} r{r.arg[0]} = 0; r{r.arg[0]} < {r.arg[1]}; r{r.arg[0]}++) {{")
            i1 += "  "
        lines.append(f"{i1}for ({it} zjc = 0; zjc < {n}; zjc += {nc}) {{")
        i2 = i1 + "  "
        lines.append(f"{i2}const {it} znp = (({n} - zjc < {nc} ? {n} - zjc : {nc}) + {nr - 1}) / {nr};")
        lines.append(f"{i2}for ({it} zpc = 0; zpc < {kk}; zpc += {kc}) {{")
        i3 = i2 + "  "
        lines.append(f"{i3}const {it} zkc = {kk} - zpc < {kc} ? {kk} - zpc : {kc};")
        # pack the right operand: micro-panel p holds columns zjc + p*nr .. +nr, k-major
        if share:
            lines.append(f"{i3}{share}")
        lines.append(f"{i3}for ({it} zp = 0; zp < znp; zp++) {{")
        i4 = i3 + "  "
        lines.append(f"{i4}{rt} *zb = zpk + zp * {kc * nr};")
        several = len(g.cols) > 1  # column loops: packed and stored in runs along the innermost (``segments``)
        # a pack along k stages each chunk in ``ztmp`` (one row per column, contiguous along k) and transposes it
        # into the micro-panel in square blocks (``transpose_staged``): stored straight, every value of a column
        # went to its own line of the panel, a stride of nr apart
        staged = g.pack_k_inner and rt in ("float", "double") and nr in (4, 8, 16)
        k_lo, k_hi = ("zk0", "zk1") if g.k_chunk else ("0", "zkc")
        if several:  # zero past the last column
            lines.append(f"{i4}const {it} zs0 = zjc + zp * {nr};")
            lines.append(f"{i4}const int zw = {n} - zs0 < {nr} ? (int)({n} - zs0) : {nr};")
            if n % nr and not staged:
                lines.append(f"{i4}for ({it} zk = 0; zk < zkc; zk++) for (int zj = zw; zj < {nr}; zj++) "
                             f"zb[zk * {nr} + zj] = {zero};")
        if g.k_chunk:  # every column of the micro-panel per chunk of k: its stores stay within the L1 cache
            lines.append(f"{i4}for ({it} zk0 = 0; zk0 < zkc; zk0 += {g.k_chunk}) {{")
            lines.append(f"{i4}  const {it} zk1 = zkc - zk0 < {g.k_chunk} ? zkc : zk0 + {g.k_chunk};")
            i4 += "  "
        if staged:
            lines.append(f"{i4}{rt} ztmp[{nr}][{g.k_chunk or kc}];")
            if several and n % nr:
                lines.append(f"{i4}for (int zj = zw; zj < {nr}; zj++) for ({it} zk = {k_lo}; zk < {k_hi}; zk++) "
                             f"ztmp[zj][zk - {k_lo}] = {zero};")

        def to_panel(column: str) -> str:
            return f"ztmp[{column}][zk - {k_lo}]" if staged else f"zb[zk * {nr} + {column}]"

        if several:

            def pack_run(ind: str) -> None:
                pack(ind, ("int", "zt", "zl", [f"const {it} {rn} = zo + zt;"]), to_panel("zj + zt"), base="zo")

            segments("zs0", "zw", i4, pack_run)
        # a whole micro-panel needs no clamped column index: its loads stay affine in zj, so a right operand
        # contiguous along n packs with vector loads (the clamp made gcc gather with 64-bit indices, which cost
        # more than the tiles' arithmetic when the left operand has few rows)
        # (n a multiple of nr: every micro-panel is whole, and the clamped copy is not rendered)
        ragged = n % nr != 0
        kinds = () if several else (True, False) if ragged else (True,)  # (several column loops: packed above)
        for whole in kinds:
            i5 = i4 + "  "
            if not ragged:
                lines.append(f"{i4}{{")
            else:
                lines.append(f"{i4}if (zjc + zp * {nr} + {nr} <= {n}) {{" if whole else f"{i4}else {{")
            if whole:
                pack(i5, (it, "zj", str(nr), [f"const {it} {rn} = zjc + zp * {nr} + zj;"]), to_panel("zj"),
                     base=f"zjc + zp * {nr}")
            else:
                pack(i5, (it, "zj", str(nr), [f"const {it} zn = zjc + zp * {nr} + zj;",
                                          f"const {it} {rn} = zn < {n} ? zn : {n - 1};"]),
                     to_panel("zj"), f"zn < {n}")
            lines.append(f"{i4}}}")
        if staged:
            lines.extend(transpose_staged(i4, rt, nr, k_lo, k_hi, it))
        if g.k_chunk:
            i4 = i4[:-2]
            lines.append(f"{i4}}}")
        lines.append(f"{i3}}}")
        # the tiles of the panel, row tiles outer (a thread keeps its rows of the left operand while it sweeps)
        nt = -(-m // mr)
        if g.rows:
            lines.append(f"{i3}{it} zrw[{len(g.rows)}][{mr}], zrl = -1;")
        if share:
            lines.append(f"{i3}{share}")
        lines.append(f"{i3}for ({it} zt = 0; zt < {nt} * znp; zt++) {{")
        lines.append(f"{i4}const {it} zi0 = (zt / znp) * {mr}, zp = zt % znp;")
        lines.append(f"{i4}const {rt} *zb = zpk + zp * {kc * nr};")
        if g.rows:
            split_rows(i4)
        if g.partial:
            lines.append(f"{i4}{at} zd[{mr}][{nr}];")
            lines.append(f"{i4}for (int zi = 0; zi < {mr}; zi++) for (int zj = 0; zj < {nr}; zj++) zd[zi][zj] = 0;")
        lines.append(f"{i4}{pt} zc[{mr}][{nr}];")
        blk = g.partial or kc
        inner = i4
        if g.partial:
            lines.append(f"{i4}for ({it} zkb = 0; zkb < zkc; zkb += {blk}) {{")
            inner = i4 + "  "
            lines.append(f"{inner}const {it} zke = zkb + {blk} < zkc ? zkb + {blk} : zkc;")
            lo, hi = "zkb", "zke"
        else:
            lo, hi = "0", "zkc"
        lines.append(f"{inner}for (int zi = 0; zi < {mr}; zi++) for (int zj = 0; zj < {nr}; zj++) zc[zi][zj] = {zero};")
        lines.append(f"{inner}for ({it} zk = {lo}; zk < {hi}; zk++) {{")
        ik = inner + "  "
        lines.append(f"{ik}const {it} {rk} = zpc + zk;")
        lines.append(f"{ik}const {rt} *zbk = zb + zk * {nr};")
        for i in range(mr):  # unrolled rows: one broadcast of the left operand per row and k
            lines.append(f"{ik}{{")
            ir_ = ik + "  "
            row(ir_, str(i))
            name = {}
            values([c.a], ir_, name)
            lines.append(f"{ir_}const {rt} za = {operand(c.a, name)};")
            lines.append(f"{ir_}#pragma omp simd")
            lines.append(f"{ir_}for (int zj = 0; zj < {nr}; zj++) {{ {fma('za', 'zbk[zj]', f'zc[{i}][zj]')} }}")
            lines.append(f"{ik}}}")
        lines.append(f"{inner}}}")
        if g.partial:
            lines.append(f"{inner}for (int zi = 0; zi < {mr}; zi++) for (int zj = 0; zj < {nr}; zj++) "
                         f"zd[zi][zj] += zc[zi][zj];")
            lines.append(f"{i4}}}")
        acc = "zd" if g.partial else "zc"
        # the stores of the tile's elements (rows and columns past the end are skipped)
        lines.append(f"{i4}const {it} zj0 = zjc + zp * {nr};")
        lines.append(f"{i4}const int zjn = {n} - zj0 < {nr} ? (int)({n} - zj0) : {nr};")
        lines.append(f"{i4}for (int zi = 0; zi < {mr}; zi++) {{")
        i5 = i4 + "  "
        if g.rows:
            lines.append(f"{i5}if (zi0 + zi >= {m}) break;")
            row(i5, "zi")
        else:
            lines.append(f"{i5}const {it} {rm} = zi0 + zi;")
            lines.append(f"{i5}if ({rm} >= {m}) break;")

        def store_run(ind: str, column: str) -> None:
            """The stores of the columns ``zt`` of a run: the innermost loop's ``rn`` is ``column``."""
            lines.append(f"{ind}#pragma omp simd")
            lines.append(f"{ind}for (int zt = 0; zt < zl; zt++) {{")
            i6 = ind + "  "
            lines.append(f"{i6}const {it} {rn} = {column};")
            name = {c.red: f"(({rt}){acc}[zi][zj + zt])"}
            for st in k.stores:
                values([st.index, st.value], i6, name)
            for st in k.stores:
                p = k.params[st.param]
                idx, val = operand(st.index, name), operand(st.value, name)
                if g.direct and kc < kk:
                    val = f"(zpc == 0 ? {val} : p{st.param}[{idx}] + {val})"
                lines.append(f"{i6}p{st.param}[{idx}] = {self.to_storage(val, p.dtype)};")
            lines.append(f"{ind}}}")

        if several:
            segments("zj0", "zjn", i5, lambda ind: store_run(ind, "zo + zt"))
        else:
            lines.append(f"{i5}{{ const int zj = 0, zl = zjn;")
            store_run(i5 + "  ", "zj0 + zt")
            lines.append(f"{i5}}}")
        lines.append(f"{i4}}}")
        lines.append(f"{i3}}}")  # tiles
        lines.append(f"{i2}}}")  # k blocks
        lines.append(f"{i1}}}")  # column panels
        for _ in batch:
            i1 = i1[:-2]
            lines.append(f"{i1}}}")
        if g.per_batch:
            lines.append(f"{i1}free(zpk);")
        lines.append(f"{ind}}}")
        if not g.per_batch:
            lines.append(f"{ind}free(zpk);")
        return lines

    def prefetch(self, f: ir.Prefetch, p: ir.Param, r: str, hi: str) -> list[str]:
        """Statements prefetching ``f``'s block for iteration ``r + 1`` (none after the last, ``hi``), a cache line
        at a time, clipped to the buffer."""
        it, line = self.index_type, max(64 // p.dtype.itemsize, 1)
        return [f"if ({r} + 1 < {hi}) {{",
                f"  const {it} zpf = ({r} + 1) * {f.stride}LL + {f.offset}LL;",
                f"  for ({it} zq = zpf < 0 ? 0 : zpf; zq < zpf + {f.length}LL && zq < {p.size}LL; zq += {line})",
                f"    __builtin_prefetch(p{f.param} + zq, 0, 3);",
                "}"]

    def pragmas(self, loop: Loop, reds: list[tuple[str, str]]) -> list[str]:
        red = " ".join(f"reduction({o}:{v})" for o, v in reds)
        if loop.kind == "parallel":
            c = f" collapse({loop.collapse})" if loop.collapse > 1 else ""
            return [f"#pragma omp parallel for schedule(static){c} num_threads(zyx_threads(64))"]
        if loop.kind == "parallel_simd":
            return ["#pragma omp parallel for simd schedule(static) num_threads(zyx_threads(64))"]
        if loop.kind == "simd":
            return [f"#pragma omp simd {red}".rstrip()]
        return []


_MASK_SELECTS = {dtypes.int64: "zyx__seli64", dtypes.int32: "zyx__seli32"}  # ``CRenderer.scalar_select``
VECTOR_MIN_TRIP = 8  # iterations of a simd loop that GCC vectorizes (eight 64-bit lanes: one AVX-512 register)
MIN_TILING_LANES = 32  # the fewest partial sums a fallback keeps: two AVX-512 registers (four AVX2) of float32


def _tiling_lanes(lanes: int, lo: str, hi: str) -> int:
    """The partial sums of a blocked float32 sum over ``lo`` .. ``hi``: ``lanes`` (``Kernel.reduce_lanes``), or a
    half or a quarter of them (at least ``MIN_TILING_LANES``) when that divides the length and ``lanes`` does not
    (rows of 3136, 56x56, take 64); 0 (one partial per block) when none does or the bounds are not constants: the
    lanes must tile every block exactly."""
    if lanes <= 1 or not (lo.isdigit() and hi.isdigit()):
        return 0
    n = int(hi) - int(lo)
    fewer = tuple(x for x in (lanes // 2, lanes // 4) if x >= MIN_TILING_LANES)
    return next((x for x in (lanes, *fewer) if n % x == 0), 0)


def vector_types(ind: str, ct: str, size: int, nr: int) -> list[str]:
    """GCC typedefs of ``register_transpose``'s vectors: ``zv``, ``nr`` elements of C type ``ct`` (``size`` bytes),
    and ``zm``, its shuffle masks."""
    idx = {2: "short", 4: "int", 8: "long long"}[size]
    return [f"{ind}typedef {ct} zv __attribute__((vector_size({nr * size})));",
            f"{ind}typedef {idx} zm __attribute__((vector_size({nr * size})));"]


def register_transpose(ind: str, nr: int, src: str, dst: str) -> list[str]:
    """GCC statements transposing ``nr`` x ``nr`` elements through registers (the vector types of ``vector_types``
    in scope): row ``zj`` (a whole vector, ``src`` spelled with ``zj``) becomes column ``zj`` (stored to ``dst``
    spelled with ``zj``) through a butterfly of ``log2(nr)`` stages of two-vector shuffles (``__builtin_shuffle``;
    on AVX-512 one ``vpermt2ps`` each). Callers guard them with ``#if defined(__GNUC__) && !defined(__clang__)``
    and copy element by element otherwise."""
    lines = [f"{ind}zv zr[{nr}];", f"{ind}for (int zj = 0; zj < {nr}; zj++) memcpy(&zr[zj], {src}, sizeof(zv));"]
    b = nr // 2
    while b:
        lo = ", ".join(str(i if not i & b else nr + i - b) for i in range(nr))
        hi = ", ".join(str(i + b if not i & b else nr + i) for i in range(nr))
        lines.append(f"{ind}{{ const zm lo = {{{lo}}}, hi = {{{hi}}};")
        lines.append(f"{ind}  for (int zj = 0; zj < {nr}; zj++) if (!(zj & {b})) {{ const zv a = zr[zj], "
                     f"c = zr[zj + {b}]; zr[zj] = __builtin_shuffle(a, c, lo); "
                     f"zr[zj + {b}] = __builtin_shuffle(a, c, hi); }} }}")
        b //= 2
    lines.append(f"{ind}for (int zj = 0; zj < {nr}; zj++) memcpy({dst}, &zr[zj], sizeof(zv));")
    return lines


def transpose_staged(ind: str, rt: str, nr: int, k_lo: str, k_hi: str, it: str) -> list[str]:
    """C statements storing the staged chunk ``ztmp[j][k - k_lo]`` (``nr`` columns by the chunk's k) into the
    micro-panel as ``zb[k * nr + j]``, for ``k`` in ``[k_lo, k_hi)``. With GCC, ``nr`` x ``nr`` blocks go through
    registers (``register_transpose``), every load and store a whole vector. The rest of the chunk, and other
    compilers, copy element by element."""
    lines = [f"{ind}{{", f"{ind}  const {it} zkn = {k_hi} - {k_lo};", f"{ind}  {it} zkb = 0;"]
    lines.append("#if defined(__GNUC__) && !defined(__clang__)")
    lines += vector_types(ind + "  ", rt, 4 if rt == "float" else 8, nr)
    lines.append(f"{ind}  for (; zkb + {nr} <= zkn; zkb += {nr}) {{")
    lines += register_transpose(ind + "    ", nr, "&ztmp[zj][zkb]", f"&zb[({k_lo} + zkb + zj) * {nr}]")
    lines.append(f"{ind}  }}")
    lines.append("#endif")
    lines.append(f"{ind}  for (; zkb < zkn; zkb++) for (int zj = 0; zj < {nr}; zj++) "
                 f"zb[({k_lo} + zkb) * {nr} + zj] = ztmp[zj][zkb];")
    lines.append(f"{ind}}}")
    return lines


_OMP_RED = {Ops.ADD: "+", Ops.MUL: "*", Ops.MAX: "max", Ops.MIN: "min", Ops.OR: "|", Ops.AND: "&"}

C_PRELUDE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <stdio.h>
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define ZYX_GEMM_ATTR __attribute__((target("prefer-vector-width=512")))
#else
#define ZYX_GEMM_ATTR
#endif
/* GCC 12 miscompiles masked loads in an interleaved group (gated p[2i - 2], p[2i - 1] in one vectorized loop:
   some lanes read 0); kernels with such a group are compiled without loop if-conversion (CRenderer.no_if_convert) */
#if defined(__GNUC__) && !defined(__clang__)
#define ZYX_NO_IFCVT __attribute__((optimize("no-tree-loop-if-convert")))
#else
#define ZYX_NO_IFCVT
#endif
/* GCC 12's SLP vectorizer may drop a float64 -> float32 -> float64 round trip (the 2-lane part of a vectorized loop
   used the unrounded value); kernels narrowing float64 are compiled without it (CRenderer.narrows_float64) */
#if defined(__GNUC__) && !defined(__clang__)
#define ZYX_NO_SLP __attribute__((optimize("no-tree-slp-vectorize")))
#else
#define ZYX_NO_SLP
#endif
#ifdef _OPENMP
#include <omp.h>
#else
static inline int omp_get_thread_num(void) { return 0; }
static inline int omp_get_num_threads(void) { return 1; }
#endif
static int zyx_nthreads = 0;
void zyx_set_threads(int n) { zyx_nthreads = n; }
static inline int zyx_threads(int cap) { int n = zyx_nthreads > 0 ? zyx_nthreads : 1;
#ifdef _OPENMP
  if (zyx_nthreads <= 0) n = omp_get_max_threads();
#endif
  return n < cap ? n : cap; }
static inline float zyx_bfloat16_to_f32(unsigned short h) { uint32_t u = (uint32_t)h << 16; float f;
  memcpy(&f, &u, 4); return f; }
/* NaNs quieted, the rest rounded to nearest even; a select, not a branch, so that loops converting vectorize */
static inline unsigned short zyx_f32_to_bfloat16(float f) { uint32_t u; memcpy(&u, &f, 4);
  uint32_t nan = (u >> 16) | 0x40u, r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (unsigned short)((u & 0x7fffffffu) > 0x7f800000u ? nan : r); }
static inline float zyx_round_bfloat16(float f) { return zyx_bfloat16_to_f32(zyx_f32_to_bfloat16(f)); }
#if defined(__F16C__) && defined(__GNUC__)
/* F16C: one instruction each way (rounding to nearest even, imm 0; NaNs quieted keeping their payload's top bits,
   as the portable code below), where the branches below kept converting loops scalar (4096^2 f32 -> f16: 22 ms).
   Widening, the hardware quiets a signaling NaN, which NumPy keeps: its quiet bit is cleared again */
typedef float zyx__v4sf __attribute__((vector_size(16)));
typedef short zyx__v8hi __attribute__((vector_size(16)));
static inline float zyx_float16_to_f32(unsigned short h) {
  zyx__v8hi v = {(short)h, 0, 0, 0, 0, 0, 0, 0}; float f = __builtin_ia32_vcvtph2ps(v)[0]; uint32_t u;
  memcpy(&u, &f, 4); u &= ~((uint32_t)(((h & 0x7e00u) == 0x7c00u) & ((h & 0x1ffu) != 0u)) << 22);
  memcpy(&f, &u, 4); return f; }
static inline unsigned short zyx_f32_to_float16(float f) {
  zyx__v4sf v = {f, 0.0f, 0.0f, 0.0f}; return (unsigned short)__builtin_ia32_vcvtps2ph(v, 0)[0]; }
#else
static inline float zyx_float16_to_f32(unsigned short h) {
  uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
  if (e == 0x1fu) u = s | 0x7f800000u | (m << 13);
  else if (e != 0) u = s | ((e + 112u) << 23) | (m << 13);
  else { float f = (float)m * 5.9604644775390625e-08f; memcpy(&u, &f, 4); u |= s; }
  float f; memcpy(&f, &u, 4); return f; }
static inline unsigned short zyx_f32_to_float16(float f) {
  uint32_t u; memcpy(&u, &f, 4); uint32_t s = (u >> 16) & 0x8000u; uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (unsigned short)(s | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return (unsigned short)(s | 0x7c00u);
  if (a < 0x38800000u) { float v; memcpy(&v, &a, 4); v = v * 16777216.0f; /* exact scale to 2^-24 units */
    uint32_t q = (uint32_t)v; float rem = v - (float)q;
    if (rem > 0.5f || (rem == 0.5f && (q & 1u))) q++; return (unsigned short)(s | q); }
  uint32_t r = a - 0x38000000u; r += 0xfffu + ((r >> 13) & 1u); return (unsigned short)(s | (r >> 13)); }
#endif
static inline float zyx_round_float16(float f) { return zyx_float16_to_f32(zyx_f32_to_float16(f)); }
/* double -> float rounded to odd (toward zero, the last bit set when inexact): rounding that float to a 16-bit
   float rounds the double once, as NumPy does (a plain (float) first would round twice) */
static inline float zyx_f64_to_f32_odd(double d) { float t = (float)d; uint32_t u; memcpy(&u, &t, 4);
  if ((double)t != d && d == d) { if (fabs((double)t) > fabs(d)) u -= 1u; u |= 1u; }
  memcpy(&t, &u, 4); return t; }
"""


def wrapping(op: Ops, a: str, b: str, d: DType) -> str:
    """``a op b`` (``-a`` for ``NEG``) of signed ``d`` computed in its unsigned twin, so an overflow wraps as in
    NumPy instead of being undefined behaviour that C compilers fold away (NVRTC has no ``-fwrapv``)."""
    ct = d.c_type
    ut = "unsigned " + ct.removeprefix("signed ")
    if op is Ops.NEG:
        return f"(({ct})(0 - ({ut})({a})))"
    return f"(({ct})(({ut})({a}) {_INFIX[op]} ({ut})({b})))"


def _int_helpers() -> str:
    out = []
    for d in dtypes.ALL:
        if not d.is_int:
            continue
        t = d.c_type
        bits = d.bits

        def mul(a: str, b: str) -> str:
            return f"({t})({a} * {b})" if d.is_unsigned else wrapping(Ops.MUL, a, b, d)  # noqa: B023

        if d.is_unsigned:
            div = f"return b == 0 ? 0 : ({t})(a / b);"
            md = f"return b == 0 ? 0 : ({t})(a % b);"
            shr = f"return b >= {bits} ? 0 : ({t})(a >> b);"
        else:
            ut = "unsigned " + t.replace("signed ", "")
            div = (f"if (b == 0) return 0; if (b == -1) return ({t})(0u - ({ut})a); "
                   f"{t} q = ({t})(a / b); if ((a % b != 0) && ((a < 0) != (b < 0))) q--; return q;")
            md = (f"if (b == 0 || b == -1) return 0; {t} r = ({t})(a % b); "
                  f"if (r != 0 && ((r < 0) != (b < 0))) r += b; return r;")
            shr = f"return b >= {bits} ? (a < 0 ? -1 : 0) : (b < 0 ? 0 : ({t})(a >> b));"
        out.append(f"static inline {t} zyx_idiv_{d.name}({t} a, {t} b) {{ {div} }}")
        out.append(f"static inline {t} zyx_mod_{d.name}({t} a, {t} b) {{ {md} }}")
        out.append(f"static inline {t} zyx_shl_{d.name}({t} a, {t} b) {{ "
                   f"return (b >= {bits} || b < 0) ? 0 : ({t})((unsigned long long)a << b); }}")
        out.append(f"static inline {t} zyx_shr_{d.name}({t} a, {t} b) {{ {shr} }}")
        out.append(f"static inline {t} zyx_ipow_{d.name}({t} a, {t} b) {{ {t} r = 1; "
                   f"if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0); "
                   f"while (b) {{ if (b & 1) r = {mul('r', 'a')}; a = {mul('a', 'a')}; b >>= 1; }} return r; }}")
    out.extend(_float_to_int_helpers())
    return "\n".join(out) + "\n"


def _float_to_int_helpers() -> list[str]:
    """Float -> integer conversion, defined everywhere as x86-64 computes it (C leaves NaN, infinities and
    out-of-range values undefined): truncation toward zero; int32/int64 give their minimum for NaN, infinities
    and values out of range; 8- and 16-bit types convert through int32 and wrap, uint32 through int64;
    uint64 converts values from 2**63 on through the offset ``x - 2**63`` (NaN and -inf give 2**63, +inf 0)."""
    bad32 = "(x != x || x >= 2147483648.0 || x <= -2147483649.0)"
    bad64 = "(x != x || x >= 9223372036854775808.0 || x < -9223372036854775808.0)"
    i32 = f"({bad32} ? (-2147483647-1) : (int)x)"
    i64 = f"({bad64} ? (-9223372036854775807LL-1) : (long long)x)"
    out = []
    for d in dtypes.ALL:
        if not d.is_int:
            continue
        t = d.c_type
        if d.itemsize <= 4 and d is not dtypes.uint32:
            body = f"return ({t}){i32};"
        elif d is dtypes.uint64:
            body = (f"if (x >= 9223372036854775808.0) {{ x -= 9223372036854775808.0; "
                    f"return (unsigned long long){i64} ^ 9223372036854775808ULL; }} return ({t}){i64};")
        else:
            body = f"return ({t}){i64};"
        out.append(f"static inline {t} zyx_f2i_{d.name}(double x) {{ {body} }}")
    return out


_HOST_PRELUDE = C_PRELUDE + C_MATH_PRELUDE + _int_helpers()

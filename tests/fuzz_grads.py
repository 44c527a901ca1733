"""Random differentiable programs for gradient fuzzing: zyx's backward against central differences of the NumPy
reference.

:class:`SmoothBuilder` is the fuzzer's :class:`~fuzz_programs.Builder` restricted to float64 values and to ops with
a derivative, and it refuses an op whose inputs sit within a margin of a kink or a jump (``abs`` near 0, ``max`` of
near-ties, a comparison of near-equal values, ``floor`` near an integer, ``log`` near 0, ...): there a one-sided
change of an input would flip the result, and no finite difference can say what the derivative is. Values stay
finite and below ``LIMIT`` in magnitude.

The same programs in float32 (:class:`SmoothBuilder32`) run zyx's float32 kernels and library calls.

Round trips through another float dtype (``x.cast(float16).cast(float64)``, :meth:`SmoothBuilder.g_round_trip`)
round in the forward and, as PyTorch's casts, round the gradient in the backward. The reference holds each rounding
offset fixed (its derivative is 1, straight through), and :func:`finite_differences` adds the gradient's rounding,
computed from differences taken at the round trip's output.

The loss is ``sum(w_k * v_k)`` over every float value ``v_k`` the program computes, with fixed random weights; its
gradient with respect to every float input is compared, element by element, with ``(L(x + h e_j) - L(x - h e_j)) /
2h`` computed by the NumPy reference (the instruction references the value fuzzer checks zyx's forward with).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
from fuzz_programs import (
    GENERATORS,
    TOL,
    Builder,
    Program,
    _axes,
    _erf,
    array_src,
    cast_ref,
    decoy,
    programs,
    softmax_ref,
    zdt,
)
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import zyx
from zyx import dtypes
from zyx.dtypes import DType

LIMIT = 1e4  # largest magnitude of a value
MARGIN = 1e-3  # smallest distance of an input to a kink or a jump
STEP = 1e-6  # finite-difference step, relative to the input's magnitude (at least 1)


class Rejected(ValueError):
    """The op would put a value out of range or an input near a kink; the generator tries another op."""


def _gap_to_tie(x: np.ndarray, axes: tuple[int, ...], top: bool) -> float:
    """Smallest gap between the extreme and the runner-up along ``axes`` (inf when every group has one value)."""
    if x.size == 0 or not axes:
        return math.inf
    rest = [i for i in range(x.ndim) if i not in axes]
    g = np.sort(np.transpose(x, rest + list(axes)).reshape(*(x.shape[i] for i in rest), -1), axis=-1)
    if g.shape[-1] < 2:
        return math.inf
    d = g[..., -1] - g[..., -2] if top else g[..., 1] - g[..., 0]
    return float(np.min(d))


def _reduced_axes(template: str, nd: int) -> tuple[int, ...]:
    """The axes a ``{0}.max(axis, keepdim=...)`` template reduces."""
    call = template.split(".", 1)[1].split("(", 1)[1].rsplit(")", 1)[0]
    axis = eval(f"(lambda axis=None, keepdim=False, keepdims=False: axis)({call})")  # noqa: S307 - our literal
    return tuple(sorted(_axes(axis, nd)))


class SmoothBuilder(Builder):
    """float64 programs of differentiable ops, each applied away from its kinks (see the module docstring)."""

    FLOAT = dtypes.float64

    BINARY_OPS = ("add", "sub", "mul", "truediv", "pow", "maximum", "minimum", "lt", "gt", "add", "mul", "sub")
    UNARY_OPS = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "erf", "sigmoid",
                 "relu", "floor", "sign", "square", "neg", "tanh", "sin")
    REDUCE_OPS = ("sum", "prod", "mean", "var", "std", "logsumexp", "softmax", "log_softmax", "cumsum", "cumprod",
                  "sum", "max", "min", "mean")
    INPUT_KINDS = ("data",) * 6 + ("full",)
    SCALARS = (0.5, -0.5, 1.5, -1.5, 2.0, 0.75, -1.25, 3.0, 0.3)
    ROUND_TRIPS = (dtypes.float32, dtypes.float16, dtypes.bfloat16)  # the dtypes g_round_trip passes through

    def dtype(self, like: DType | None = None, pred: Callable[[DType], bool] = lambda d: True) -> DType:
        return self.FLOAT if pred(self.FLOAT) else super().dtype(like, pred)

    def scalar(self, d: DType) -> Any:
        if not d.is_float:
            return super().scalar(d)
        return self.draw(st.sampled_from(self.SCALARS))

    def array(self, d: DType, shape: tuple[int, ...]) -> np.ndarray:
        if d is not self.FLOAT:
            return super().array(d, shape)
        magnitude = st.floats(0.125, 2.0, exclude_min=True, exclude_max=True, width=8 * d.itemsize)
        el = st.one_of(magnitude, magnitude.map(lambda v: -v))
        return self.draw(hnp.arrays(d.np_dtype, shape, elements=el))

    def emit(self, template: str, args: Any, ref: Callable[..., np.ndarray], **kw: Any) -> int:
        ins = [self.vals[a].arr for a in args]
        ops = kw.get("ops", ())
        if ops:
            self._check_margin(ops[0], template, ins)
        i = super().emit(template, args, ref, **kw)
        out = self.vals[i].arr
        if zdt(out).is_float and out.size and not (np.all(np.isfinite(out)) and np.max(np.abs(out)) <= LIMIT
                                                   and (ops[:1] != ("std",) or np.min(out) > 0.05)):
            del self.instrs[i:], self.vals[i:], self.tags[i:]
            raise Rejected(f"{template}: a value out of range (or a std near 0, its kink)")
        return i

    # ---- casts ----------------------------------------------------------------------------------------------
    def g_round_trip(self) -> bool:
        """``x.cast(d).cast(back)`` of a float value, ``d`` from ``ROUND_TRIPS`` (spelled as ``cast``, ``astype``,
        ``half()``/``float()``, a zyx, NumPy or string dtype): rounded to ``d`` once (NumPy's float16, ml_dtypes'
        bfloat16). The reference adds the rounding offset at the drawn values, held fixed (straight through), so
        the differences see the derivative 1 of a cast; refused when a value sits within zyx's error of a point
        where its rounding changes (and, from float64 to 16 bits, within float32's rounding of one: zyx rounds
        there through float32, as PyTorch on the CPU)."""
        a = self.pick(lambda v: _is_float(v.arr) and v.arr.size > 0)
        if a is None:
            return False
        d = self.draw(st.sampled_from(self.ROUND_TRIPS))
        v = self.vals[a]
        x = v.arr.astype(np.float64)
        allowance = np.zeros(x.shape) if v.exact else TOL[self.FLOAT] * self.scale_of(a)
        if self.FLOAT.itemsize == 8 and d.itemsize == 2:
            allowance = allowance + 2.0 ** -24 * np.abs(x)
        if np.any(gap_to_rounding_change(x, d) <= allowance):
            raise Rejected(f"cast to {d.name}: a value near a change of its rounding")
        r = cast_ref(cast_ref(v.arr, d), self.FLOAT)
        offset = r.astype(np.float64) - x

        def ref(y: np.ndarray) -> np.ndarray:
            return np.asarray(y.astype(np.float64) + offset).astype(y.dtype)

        if not np.array_equal(ref(v.arr), r):  # x + (r - x) is r where the difference is exact
            raise Rejected(f"cast to {d.name}: an offset that does not restore the rounded value")
        tmpl = "{0}" + self._cast_call(d) + self._cast_call(self.FLOAT)
        self.emit(tmpl, (a,), ref, kind="neg", ops=("round_trip", d.name))
        return True

    def _cast_call(self, d: DType) -> str:
        """A call casting to ``d``, in one of the spellings zyx takes."""
        short = {dtypes.float16: "half", dtypes.float32: "float"}.get(d)
        if short is not None and self.draw(st.booleans()):
            return f".{short}()"
        method = self.draw(st.sampled_from(("cast", "astype")))
        module = "ml_dtypes" if d is dtypes.bfloat16 else "np"
        return f".{method}({self.draw(st.sampled_from((f'zyx.{d.name}', f'{d.name!r}', f'{module}.{d.name}')))})"

    # ---- zyx.nn.functional --------------------------------------------------------------------------------------
    def g_nn(self) -> bool:
        op = self.draw(st.sampled_from(("attention", "attention", "layer_norm", "gelu", "silu", "softplus",
                                        "leaky_relu", "conv", "conv", "pool", "conv_transpose")))
        if op == "attention":
            return self._attention()
        if op in ("conv", "pool"):
            return self._conv_or_pool(op)
        if op == "conv_transpose":
            return self._conv_transpose()
        a = self.pick(lambda v: _is_float(v.arr) and v.arr.ndim >= (1 if op == "layer_norm" else 0))
        if a is None:
            return False
        x = self.vals[a].arr
        if op == "layer_norm":
            k = self.draw(st.integers(1, min(2, x.ndim)))
            shape = x.shape[x.ndim - k:]
            if x.size and np.min(x.astype(np.float64).var(tuple(range(x.ndim - k, x.ndim)))) <= 0.01:
                # near a constant row the result bends on the scale of sqrt(var + eps): finite differences fail
                raise Rejected("layer_norm: a row near constant")
            if self.draw(st.booleans()):
                w, b = self.new_input(shape, self.FLOAT, "data"), self.new_input(shape, self.FLOAT, "data")
                self.emit(f"{_NN}.layer_norm({{0}}, {shape!r}, {{1}}, {{2}})", (a, w, b),
                          lambda y, ww, bb: layer_norm_ref(y, k, ww, bb), exact=False, ops=("layer_norm",))
            else:
                self.emit(f"{_NN}.layer_norm({{0}}, {shape!r})", (a,), lambda y: layer_norm_ref(y, k),
                          exact=False, ops=("layer_norm",))
            return True
        refs = {"gelu": lambda y: _gelu_ref(y.astype(np.float64), "none"),
                "silu": lambda y: y.astype(np.float64) / (1 + np.exp(-y.astype(np.float64))),
                "softplus": lambda y: np.where(y > 20, y, np.log1p(np.exp(np.minimum(y, 20).astype(np.float64)))),
                "leaky_relu": lambda y: np.where(y > 0, y, 0.1 * y.astype(np.float64))}
        template = {"gelu": "{0}.gelu()", "silu": "{0}.silu()", "softplus": "{0}.softplus()",
                    "leaky_relu": "{0}.leaky_relu(0.1)"}[op]
        if op == "gelu" and self.draw(st.booleans()):
            refs["gelu"], template = (lambda y: _gelu_ref(y.astype(np.float64), "tanh")), '{0}.gelu("tanh")'
        ref = refs[op]
        self.emit(template, (a,), lambda y: np.asarray(ref(y)).astype(y.dtype), exact=False, ops=(op,))
        return True

    def _conv_or_pool(self, op: str) -> bool:
        """conv1d/conv2d (stride, padding, dilation, groups, bias) or avg_pool1d/2d of a float value of rank 3 or 4
        (N, C, *spatial), against ``conv_ref``."""
        a = self.pick(lambda v: _is_float(v.arr) and v.arr.ndim in (3, 4) and 0 not in v.arr.shape)
        if a is None:
            return False
        x = self.vals[a].arr
        nd, c, spatial = x.ndim - 2, x.shape[1], x.shape[2:]
        kernel = tuple(self.draw(st.integers(1, min(3, s))) for s in spatial)
        dilation = tuple(self.draw(st.sampled_from([1, 2])) if (k - 1) * 2 < s else 1 for k, s in zip(kernel, spatial))
        padding = tuple(self.draw(st.integers(0, k // 2)) for k in kernel)
        stride = tuple(self.draw(st.integers(1, 2)) for _ in kernel)
        if op == "pool":
            args = f"{kernel!r}, {stride!r}, {padding!r}"
            self.emit(f"{_NN}.avg_pool{nd}d({{0}}, {args})", (a,),
                      lambda y: conv_ref(y, None, None, stride, padding, (1,) * nd, c, kernel), exact=False,
                      ops=("avg_pool",))
            return True
        groups = self.draw(st.sampled_from([g for g in (1, 2, c) if c % g == 0]))
        out = groups * self.draw(st.integers(1, 2))
        w = self.new_input((out, c // groups, *kernel), self.FLOAT, "data")
        args = f"stride={stride!r}, padding={padding!r}, dilation={dilation!r}, groups={groups}"
        if self.draw(st.booleans()):
            b = self.new_input((out,), self.FLOAT, "data")
            self.emit(f"{_NN}.conv{nd}d({{0}}, {{1}}, {{2}}, {args})", (a, w, b),
                      lambda y, ww, bb: conv_ref(y, ww, bb, stride, padding, dilation, groups), exact=False,
                      ops=("conv",))
        else:
            self.emit(f"{_NN}.conv{nd}d({{0}}, {{1}}, {args})", (a, w),
                      lambda y, ww: conv_ref(y, ww, None, stride, padding, dilation, groups), exact=False,
                      ops=("conv",))
        return True

    def _conv_transpose(self) -> bool:
        """conv_transpose1d/2d (stride, padding, output_padding, dilation, groups, bias) of a float value of rank 3
        or 4, against ``conv_transpose_ref`` (a scatter-add, independent of zyx's GEMM and col2im)."""
        a = self.pick(lambda v: _is_float(v.arr) and v.arr.ndim in (3, 4) and 0 not in v.arr.shape)
        if a is None:
            return False
        x = self.vals[a].arr
        nd, c = x.ndim - 2, x.shape[1]
        kernel = tuple(self.draw(st.integers(1, 3)) for _ in range(nd))
        stride = tuple(self.draw(st.integers(1, 3)) for _ in range(nd))
        dilation = tuple(self.draw(st.integers(1, 2)) for _ in range(nd))
        output_padding = tuple(self.draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
        padding = tuple(self.draw(st.integers(0, d * (k - 1))) for k, d in zip(kernel, dilation))
        if any((n - 1) * s - 2 * p + d * (k - 1) + op + 1 < 1
               for n, s, p, d, k, op in zip(x.shape[2:], stride, padding, dilation, kernel, output_padding)):
            return False
        groups = self.draw(st.sampled_from([g for g in (1, 2, c) if c % g == 0]))
        w = self.new_input((c, self.draw(st.integers(1, 2)), *kernel), self.FLOAT, "data")
        args = (f"stride={stride!r}, padding={padding!r}, output_padding={output_padding!r}, groups={groups}, "
                f"dilation={dilation!r}")
        geometry = (stride, padding, output_padding, dilation, groups)
        if self.draw(st.booleans()):
            b = self.new_input((self.vals[w].arr.shape[1] * groups,), self.FLOAT, "data")
            self.emit(f"{_NN}.conv_transpose{nd}d({{0}}, {{1}}, {{2}}, {args})", (a, w, b),
                      lambda y, ww, bb: conv_transpose_ref(y, ww, bb, *geometry), exact=False,
                      ops=("conv_transpose",))
        else:
            self.emit(f"{_NN}.conv_transpose{nd}d({{0}}, {{1}}, {args})", (a, w),
                      lambda y, ww: conv_transpose_ref(y, ww, None, *geometry), exact=False,
                      ops=("conv_transpose",))
        return True

    def _attention(self) -> bool:
        q = self.pick(lambda v: _is_float(v.arr) and v.arr.ndim >= 2 and 0 not in v.arr.shape[-2:])
        if q is None:
            return False
        *batch, L, E = self.vals[q].arr.shape  # noqa: N806 - the papers' names
        S, Ev = self.draw(st.integers(1, 4)), self.draw(st.integers(1, 4))  # noqa: N806
        k = self.new_input((*batch, S, E), self.FLOAT, "data")
        v = self.new_input((*batch, S, Ev), self.FLOAT, "data")
        form = self.draw(st.sampled_from(("plain", "causal", "bool", "float")))
        call = f"{_NN}.scaled_dot_product_attention({{0}}, {{1}}, {{2}}"
        if form in ("plain", "causal"):
            causal = form == "causal"
            self.emit(call + (", is_causal=True)" if causal else ")"), (q, k, v),
                      lambda a, b, c: attention_ref(a, b, c, None, causal), exact=False, ops=("attention",))
            return True
        if form == "bool":
            arr = self.draw(hnp.arrays(np.bool_, (L, S)))
            m = self.emit("", (), lambda: arr, data=arr, ops=("input",))
        else:
            m = self.new_input((L, S), self.FLOAT, "data")
        self.emit(call + ", attn_mask={3})", (q, k, v, m), lambda a, b, c, mm: attention_ref(a, b, c, mm, False),
                  exact=False, ops=("attention",))
        return True

    def _check_margin(self, op: str, template: str, ins: list[np.ndarray]) -> None:
        x = ins[0].astype(np.float64) if ins else None  # bools too: True < v jumps where v crosses 1
        if x is None or x.size == 0:
            return
        with np.errstate(all="ignore"):
            if op in ("abs", "relu", "sign", "leaky_relu"):
                near = np.min(np.abs(x)) <= MARGIN
            elif op == "floor":
                near = np.min(np.abs(x - np.round(x))) <= MARGIN
            elif op in ("log", "sqrt", "rsqrt"):
                near = np.min(x) <= 0.05
            elif op == "reciprocal":
                near = np.min(np.abs(x)) <= 0.05
            elif op == "truediv":  # near a zero denominator
                denominator = x if template.startswith("((") else (ins[1] if len(ins) > 1 else np.ones(1))
                near = np.min(np.abs(denominator)) <= 0.05
            elif op == "pow":  # the base away from 0, and positive where the exponent varies (a negative base has
                # a power only at integers: (-1) ** 72 is 1, (-1) ** (72 + h) NaN)
                if template.startswith("(("):
                    near = _scalar_operand(template) <= 0.05
                elif len(ins) > 1:
                    near = np.min(x) <= 0.05
                else:
                    near = np.min(np.abs(x)) <= 0.05
            elif op in ("maximum", "minimum", "lt", "gt"):
                other = ins[1].astype(np.float64) if len(ins) > 1 else _scalar_operand(template)
                near = np.min(np.abs(x - other)) <= MARGIN
            elif op == "cast" and template.endswith(".bool()"):
                ax = np.abs(x)
                near = bool(np.any((ax > 0) & (ax <= MARGIN)))  # exact zeros stay zero (constants)
            elif op in ("max", "min"):
                near = _gap_to_tie(x, _reduced_axes(template, x.ndim), op == "max") <= MARGIN
            else:
                near = False
        if near:
            raise Rejected(f"{op}: an input near a kink")


_NN = "zyx.nn.functional"


def _gelu_ref(x: np.ndarray, approximate: str) -> np.ndarray:
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


def attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, causal: bool) -> np.ndarray:
    """PyTorch's scaled dot-product attention in float64, returned in the operands' common dtype; query rows whose
    keys are all masked out give zeros."""
    d = np.result_type(q, k, v)
    q, k, v = (a.astype(np.float64) for a in (q, k, v))
    s = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
    alive = np.ones(s.shape[:-1] + (1,), bool)
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    elif mask is not None and mask.dtype == np.bool_:
        s = np.where(mask, s, -np.inf)
        alive = np.broadcast_to(np.any(mask, axis=-1, keepdims=True), alive.shape)
    elif mask is not None:
        s = s + mask.astype(np.float64)
    with np.errstate(all="ignore"):
        out = softmax_ref("softmax", s, -1) @ v  # a row of -inf only gives NaN: zeroed below
    return np.where(alive, out, 0.0).astype(d)


def conv_ref(x: np.ndarray, w: np.ndarray | None, b: np.ndarray | None, stride, padding, dilation, groups: int,
             kernel: tuple[int, ...] | None = None) -> np.ndarray:
    """PyTorch's convolution (cross-correlation) of (N, C, *spatial) ``x`` by (O, C / groups, *kernel) ``w`` plus
    ``b``, in float64; with ``w`` None, the average pooling over ``kernel`` (zero padding counted)."""
    nd = x.ndim - 2
    xp = np.pad(x.astype(np.float64), [(0, 0), (0, 0)] + [(p, p) for p in padding])
    kernel = w.shape[2:] if w is not None else kernel
    out = [(xp.shape[2 + i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1 for i in range(nd)]
    n, c = x.shape[:2]
    o = w.shape[0] if w is not None else c
    result = np.zeros((n, o, *out))
    for off in np.ndindex(*kernel):
        window = xp[(slice(None), slice(None), *(slice(j * d, j * d + (m - 1) * s + 1, s)
                                                for j, d, m, s in zip(off, dilation, out, stride)))]
        if w is None:
            result += window / math.prod(kernel)
            continue
        cg, og = c // groups, o // groups
        for gi in range(groups):
            taps = w[(slice(gi * og, (gi + 1) * og), slice(None), *off)].astype(np.float64)  # (og, cg)
            result[:, gi * og:(gi + 1) * og] += np.einsum("nc...,oc->no...", window[:, gi * cg:(gi + 1) * cg], taps)
    if b is not None:
        result += b.astype(np.float64).reshape((o,) + (1,) * nd)
    return result.astype(np.result_type(*(a for a in (x, w, b) if a is not None)))  # the operands' common dtype


def conv_transpose_ref(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, stride, padding, output_padding,
                       dilation, groups: int) -> np.ndarray:
    """PyTorch's transposed convolution of (N, C, *spatial) ``x`` by (C, O / groups, *kernel) ``w`` plus ``b``, in
    float64: every input element times every tap, added at ``i * stride + j * dilation - padding``."""
    nd = x.ndim - 2
    n, c = x.shape[:2]
    og, kernel, spatial = w.shape[1], w.shape[2:], x.shape[2:]
    cg = c // groups
    out = [(m - 1) * s - 2 * p + d * (k - 1) + op + 1
           for m, s, p, d, k, op in zip(spatial, stride, padding, dilation, kernel, output_padding)]
    full = np.zeros((n, og * groups, *[(m - 1) * s + d * (k - 1) + 1 + op
                                       for m, s, d, k, op in zip(spatial, stride, dilation, kernel, output_padding)]))
    for off in np.ndindex(*kernel):
        at = tuple(slice(j * d, j * d + (m - 1) * s + 1, s) for j, d, m, s in zip(off, dilation, spatial, stride))
        for gi in range(groups):
            taps = w[(slice(gi * cg, (gi + 1) * cg), slice(None), *off)].astype(np.float64)  # (cg, og)
            full[(slice(None), slice(gi * og, (gi + 1) * og), *at)] += np.einsum(
                "nc...,co->no...", x[:, gi * cg:(gi + 1) * cg].astype(np.float64), taps)
    result = full[(slice(None), slice(None), *(slice(p, p + o) for p, o in zip(padding, out)))]
    if b is not None:
        result = result + b.astype(np.float64).reshape((og * groups,) + (1,) * nd)
    return result.astype(np.result_type(*(a for a in (x, w, b) if a is not None)))  # the operands' common dtype


def layer_norm_ref(x: np.ndarray, k: int, w: np.ndarray | None = None, b: np.ndarray | None = None) -> np.ndarray:
    axes = tuple(range(x.ndim - k, x.ndim))
    x64 = x.astype(np.float64)
    d = x64 - x64.mean(axes, keepdims=True)
    y = d / np.sqrt((d * d).mean(axes, keepdims=True) + 1e-5)
    y = y * w if w is not None else y
    return (y + b if b is not None else y).astype(np.result_type(*(a for a in (x, w, b) if a is not None)))


def _scalar_operand(template: str) -> float:
    """The Python scalar in a one-tensor binary template such as ``({0} < (1.5))``, ``((-0.5) ** {0})``,
    ``((False) ** {0})`` or ``{0}.maximum(0.5)``."""
    m = re.search(r"-?\d+(?:\.\d*)?(?:e[-+]?\d+)?|True|False", template.replace("{0}", ""))
    assert m is not None, template
    return float(m.group() == "True") if m.group() in ("True", "False") else float(m.group())


class SmoothBuilder32(SmoothBuilder):
    """The same programs in float32 (zyx's float32 kernels and library calls, checked against float64 differences)."""

    FLOAT = dtypes.float32
    ROUND_TRIPS = (dtypes.float64, dtypes.float16, dtypes.bfloat16)


# setitem: the fuzzer assigns into a detached copy, which cuts the gradient the reference sees
GRAD_GENERATORS = tuple(name for name, (_, w) in GENERATORS.items() if name not in ("cast", "setitem")
                        for _ in range(w)) + ("nn",) * 3 + ("round_trip",) * 3
# per float dtype: the relative tolerance of a gradient and its allowance for rounding, per unit of the summed
# magnitude of the program's values (float64: the finite differences' own rounding; float32: zyx's)
TOLERANCE = {np.dtype(np.float64): (1e-5, 1e-15 / STEP), np.dtype(np.float32): (2e-3, 1e-6)}
LOSS_TOLERANCE = {np.dtype(np.float64): (1e-9, 1e-13), np.dtype(np.float32): (1e-5, 1e-6)}


def grad_programs(max_ops: int = 6, dtype: DType = dtypes.float64) -> st.SearchStrategy[Program]:
    builder = SmoothBuilder if dtype is dtypes.float64 else SmoothBuilder32
    return programs(max_ops=max_ops, builder=builder, generators=GRAD_GENERATORS)


def _is_float(a: np.ndarray) -> bool:
    return a.dtype.kind == "f"


def loss_weights(prog: Program) -> dict[int, np.ndarray]:
    """Fixed random weights per float value the program computes, in its dtype (every one, so that no op's gradient
    is left out: the generator builds on any earlier value, and many are not on the way to the outputs)."""
    rng = np.random.default_rng(len(prog.instrs))
    return {i: rng.standard_normal(v.arr.shape).astype(v.arr.dtype) for i, v in enumerate(prog.vals)
            if _is_float(v.arr) and not v.is_input}


def grad_inputs(prog: Program) -> list[int]:
    return [i for i, ins in enumerate(prog.instrs) if ins.data is not None and _is_float(ins.data)]


def gap_to_rounding_change(x: np.ndarray, d: DType) -> np.ndarray:
    """Per element of float64 ``x``, its distance to the nearest point where its rounding to ``d`` changes (a
    midpoint between neighbours of ``d``); inf for float64, which holds every value the programs cast to it."""
    if d.itemsize >= 8:
        return np.full(x.shape, math.inf)
    r = x.astype(d.np_dtype)
    up = np.nextafter(r, np.asarray(np.inf, d.np_dtype)).astype(np.float64)
    down = np.nextafter(r, np.asarray(-np.inf, d.np_dtype)).astype(np.float64)
    r64 = r.astype(np.float64)
    with np.errstate(all="ignore"):
        return np.minimum(np.abs(x - (r64 + up) / 2), np.abs(x - (r64 + down) / 2))


def round_trips(prog: Program) -> dict[int, DType]:
    """The program's round trips (:meth:`SmoothBuilder.g_round_trip`): instruction, the dtype it passes through."""
    return {i: dtypes.to_dtype(ins.ops[1]) for i, ins in enumerate(prog.instrs) if ins.ops[:1] == ("round_trip",)}


def _reference_values(prog: Program, data: dict[int, np.ndarray], shift: dict[int, np.ndarray] | None = None
                      ) -> list[np.ndarray]:
    """Every value of the NumPy reference in float64 (float inputs widened), with the inputs in ``data`` replaced
    and ``shift`` added to the values it names (the differences at a value)."""
    arrs: list[np.ndarray] = []
    with np.errstate(all="ignore"):
        for i, ins in enumerate(prog.instrs):
            if ins.data is not None:
                x = data.get(i, ins.data)
                arrs.append(x.astype(np.float64) if _is_float(x) else x)
            else:
                arrs.append(np.asarray(ins.ref(*(arrs[a] for a in ins.args))))
            if shift and i in shift:
                arrs[-1] = np.asarray(arrs[-1] + shift[i])
    return arrs


def _weighted(arrs: list[np.ndarray], weights: dict[int, np.ndarray]) -> float:
    with np.errstate(all="ignore"):
        return float(sum(np.sum(arrs[i].astype(np.float64) * w) for i, w in weights.items()))


def reference_loss(prog: Program, weights: dict[int, np.ndarray], data: dict[int, np.ndarray]) -> float:
    """The loss computed by the NumPy reference in float64 (float inputs widened), with the inputs in ``data``
    replaced."""
    return _weighted(_reference_values(prog, data), weights)


class Reference(dict):
    """The reference gradient per float input, and ``allowance``: per input, the error a gradient rounding whose
    direction the differences cannot tell may add (zeros without round trips)."""

    allowance: dict[int, np.ndarray]


def _step(x: float) -> float:
    return STEP * max(1.0, abs(x))


def _round_gradient(prog: Program, c: int, g: np.ndarray, tol: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """zyx's rounding of the gradient ``g`` reaching round trip ``c`` (to the program's float dtype, then to the
    dtype passed through, and back), and per element one unit in the last place of that dtype where ``g`` lies
    within ``tol`` of a change of its rounding (from float64 to 16 bits, zyx rounds through float32: where that
    differs, too), else 0."""
    d, f = round_trips(prog)[c], zdt(prog.vals[c].arr)
    rounded = cast_ref(cast_ref(cast_ref(g, f), d), dtypes.float64)
    if d.itemsize >= f.itemsize:
        return rounded, np.zeros(g.shape)
    if f.itemsize == 8 and d.itemsize == 2:
        tol = tol + 2.0 ** -24 * np.abs(g)
    r = cast_ref(rounded, d)
    with np.errstate(all="ignore"):
        ulp = np.maximum(np.nextafter(r, np.asarray(np.inf, r.dtype)).astype(np.float64) - rounded,
                         rounded - np.nextafter(r, np.asarray(-np.inf, r.dtype)).astype(np.float64))
    return rounded, np.where(gap_to_rounding_change(g, d) <= tol, ulp, 0.0)


def finite_differences(prog: Program, weights: dict[int, np.ndarray]) -> Reference:
    """Central differences of :func:`reference_loss` per element of every float input.

    With round trips: zyx's backward rounds the gradient ``g`` reaching a round trip ``c`` (its weight plus what
    later values pass back) to the dtype passed through, an error ``e``; as the gradient is linear in the weights,
    that adds the gradient of ``e * v_c``, so ``e`` is added to ``c``'s weight. ``g`` is the central difference at
    ``v_c``, taken from the last round trip to the first (a later one's ``e`` reaches an earlier one). Where ``g``
    is within the check's tolerance of a change of its rounding, the unit in the last place it may round by,
    times ``|d v_c / d input|`` (from the same differences), goes to ``allowance``. A gradient beyond the range of
    the dtype passed through (inf in zyx) leaves nothing to check: NaN."""
    w = {i: a.astype(np.float64) for i, a in weights.items()}
    unsure: dict[int, np.ndarray] = {}
    magnitude = _magnitude(prog)
    for c in sorted(round_trips(prog), reverse=True):
        v = prog.vals[c].arr
        g = np.zeros(v.shape)
        for j in np.ndindex(v.shape):
            h = _step(float(v[j]))
            up, down = np.zeros(v.shape), np.zeros(v.shape)
            up[j], down[j] = h, -h
            g[j] = (_weighted(_reference_values(prog, {}, {c: up}), w)
                    - _weighted(_reference_values(prog, {}, {c: down}), w)) / (2 * h)
        rtol, per_magnitude = TOLERANCE[v.dtype]
        rounded, ulp = _round_gradient(prog, c, g, rtol * (1 + np.abs(g)) + per_magnitude * magnitude)
        if not np.all(np.isfinite(rounded)):
            out = Reference({i: np.full(prog.instrs[i].data.shape, np.nan) for i in grad_inputs(prog)})
            out.allowance = {}
            return out
        w[c] = w[c] + (rounded - g)
        if np.any(ulp):
            unsure[c] = ulp
    out, out.allowance = Reference(), {}
    for i in grad_inputs(prog):
        x = prog.instrs[i].data.astype(np.float64)
        g, allow = np.zeros(x.shape), np.zeros(x.shape)
        for j in np.ndindex(x.shape):
            h = _step(float(x[j]))
            up, down = x.copy(), x.copy()
            up[j] += h
            down[j] -= h
            hi, lo = _reference_values(prog, {i: up}), _reference_values(prog, {i: down})
            g[j] = (_weighted(hi, w) - _weighted(lo, w)) / (2 * h)
            allow[j] = sum(float(np.sum(np.abs(hi[c] - lo[c]) * u)) for c, u in unsure.items()) / (2 * h)
        out[i], out.allowance[i] = g, allow
    return out


def _loss_and_grads(prog: Program, device: str, weights: dict[int, np.ndarray], inputs: dict[int, zyx.Tensor]
                    ) -> tuple[zyx.Tensor, list[zyx.Tensor | None]]:
    """Build the program on ``inputs`` (uploaded tensors by instruction), the loss, and run backward: the loss and
    the gradient of every float input (None where the loss does not depend on it)."""
    env: dict[str, Any] = {"zyx": zyx, "np": np, "ml_dtypes": ml_dtypes, "device": device, "inf": math.inf,
                           "nan": math.nan}
    for i, ins in enumerate(prog.instrs):
        env[f"v{i}"] = inputs[i] if ins.data is not None else eval(  # noqa: S307
            ins.template.format(*(f"v{a}" for a in ins.args)), env)
    loss = None
    for i, w in weights.items():
        term = (env[f"v{i}"] * zyx.Tensor(w, device=device)).sum()
        loss = term if loss is None else loss + term
    assert loss is not None
    if loss.requires_grad:  # else no float input reaches the loss
        loss.backward()
    return loss, [inputs[i].grad for i in grad_inputs(prog)]


def _upload(prog: Program, device: str, transform: Callable[[np.ndarray], np.ndarray] = np.copy
            ) -> dict[int, zyx.Tensor]:
    return {i: zyx.Tensor(transform(ins.data), device=device, requires_grad=_is_float(ins.data))
            for i, ins in enumerate(prog.instrs) if ins.data is not None}


def _as_arrays(prog: Program, loss: zyx.Tensor, grads: list) -> tuple[float, dict[int, np.ndarray]]:
    """The loss and gradients as NumPy, realized together (one plan with several outputs, as a training step)."""
    zyx.realize(loss, *(g for g in grads if g is not None))
    return float(loss.numpy()), {i: g.numpy() if g is not None else np.zeros(prog.instrs[i].data.shape)
                                 for i, g in zip(grad_inputs(prog), grads)}


def run_zyx_grads(prog: Program, device: str, weights: dict[int, np.ndarray]) -> tuple[float, dict[int, np.ndarray]]:
    """zyx's loss and its gradient per float input (zeros where the loss does not depend on an input)."""
    return _as_arrays(prog, *_loss_and_grads(prog, device, weights, _upload(prog, device)))


def run_zyx_grads_jit(prog: Program, device: str, weights: dict[int, np.ndarray]
                      ) -> list[tuple[float, dict[int, np.ndarray]]]:
    """:func:`run_zyx_grads` as a ``zyx.jit`` function of the inputs (the forward, the loss and backward inside,
    the loss and the gradients returned): run and captured on :func:`~fuzz_programs.decoy` inputs, then two
    replays on the real ones, whose results are returned."""
    keys = sorted(i for i, ins in enumerate(prog.instrs) if ins.data is not None)

    @zyx.jit
    def step(*tensors: zyx.Tensor) -> tuple:
        loss, grads = _loss_and_grads(prog, device, weights, dict(zip(keys, tensors)))
        return (loss, *grads)

    for _ in range(2):
        zyx.realize(*(t for t in step(*_upload(prog, device, decoy).values()) if t is not None))
    assert step.captures == 1, f"expected one capture, got {step.captures}"
    runs = []
    for _ in range(2):
        loss, *grads = step(*_upload(prog, device).values())
        runs.append(_as_arrays(prog, loss, grads))
    return runs


def grad_source(prog: Program, device: str, weights: dict[int, np.ndarray]) -> str:
    """A standalone reproducer printing zyx's gradients."""
    lines = ["import ml_dtypes", "import numpy as np", "import zyx", "from math import inf, nan", "",
             f"device = {device!r}"]
    for i, line in enumerate(prog.lines()):
        if i in grad_inputs(prog):
            line = line[:-1] + ", requires_grad=True)"
        lines.append(line)
    terms = " + ".join(f"(v{i} * zyx.Tensor({array_src(w)}, device=device)).sum()"
                       for i, w in weights.items())
    grads = ", ".join(f"v{i}.grad" for i in grad_inputs(prog))
    lines += [f"loss = {terms}", "loss.backward()",
              f"zyx.realize(*(t for t in (loss, {grads}) if t is not None))"]
    lines += [f"print('v{i}.grad', repr(v{i}.grad.numpy() if v{i}.grad is not None else None))"
              for i in grad_inputs(prog)]
    return "\n".join(lines)


def _magnitude(prog: Program) -> float:
    """The summed magnitude of every float value of the program (the scale of rounding errors that cancel)."""
    return sum(float(np.sum(np.abs(v.arr.astype(np.float64)))) for v in prog.vals if _is_float(v.arr))


def compare_loss(prog: Program, got: float, want: float) -> str | None:
    """A mismatch of zyx's loss against the float64 reference, or None."""
    narrowest = min((v.arr.dtype for v in prog.vals if _is_float(v.arr)), key=lambda d: d.itemsize)
    rtol, per_magnitude = LOSS_TOLERANCE[narrowest]
    ok = abs(got - want) <= rtol * (1 + abs(want)) + per_magnitude * _magnitude(prog)
    return None if ok else f"loss: zyx {got!r}, numpy {want!r}"


def compare_grads(prog: Program, got: dict[int, np.ndarray], want: dict[int, np.ndarray]) -> list[str]:
    """Mismatches of zyx's gradients against the finite differences (tolerance: the differences' own error, from
    the step's truncation and the rounding of every value the loss sums, plus a :class:`Reference`'s
    ``allowance`` for gradient roundings the differences cannot tell)."""
    magnitude = _magnitude(prog)
    errors = []
    for i, w in want.items():
        g = got[i].astype(np.float64)
        rtol, per_magnitude = TOLERANCE[prog.instrs[i].data.dtype]
        tol = rtol * (1 + np.abs(w)) + per_magnitude * magnitude + getattr(want, "allowance", {}).get(i, 0.0)
        bad = ~(np.abs(g - w) <= tol) & np.isfinite(w)  # a difference that is not finite judges nothing
        if np.any(bad):
            idx = [tuple(int(k) for k in ix) for ix in np.argwhere(bad)[:4]]
            where = "; ".join(f"at {ix}: zyx {g[ix]!r} vs finite differences {w[ix]!r}" for ix in idx)
            errors.append(f"v{i}.grad: {int(np.sum(bad))} of {w.size} elements differ: {where}")
    return errors

"""Random zyx programs (small DAGs of tensor ops) and a NumPy reference interpreter for them.

A :class:`Program` is a list of :class:`Instr`. Each instruction has a zyx expression in Python source (run with
``eval`` on the zyx side, so the printed reproducer is exactly what ran) and a NumPy reference function that
follows zyx's documented semantics (README "Semantics worth knowing", ``zyx.dtypes``): NumPy 2 promotion with weak
Python scalars, float32 where NumPy would invent float64 from integers, reductions of float16/bfloat16 accumulated
in float32, x86-64 rules for float -> int casts of NaN / inf / out-of-range values, and lazily computed tensor
indices that wrap negatives and read 0 when out of range.

The generator (:func:`programs`, a Hypothesis strategy) builds each program from Hypothesis draws, so Hypothesis
shrinks a failing program to a small one. While generating it evaluates the reference eagerly, so every value
knows its shape, dtype, a float error *scale* (an upper-bound-ish magnitude used for tolerances) and whether it is
*exact* (computed only by correctly rounded operations, so that zyx must agree with NumPy bit for bit). Ops
whose result is discontinuous in a float input (casts to int, comparisons, floor, argmax, ...) are only applied
to exact values; otherwise a one-ulp difference in an approximate value would flip an integer result.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import zyx
from zyx import dtypes
from zyx.dtypes import DType

BF16 = np.dtype(ml_dtypes.bfloat16)
ALL_DTYPES: tuple[DType, ...] = dtypes.ALL
INT_DTYPES = tuple(d for d in ALL_DTYPES if d.is_int)
FLOAT_DTYPES = tuple(d for d in ALL_DTYPES if d.is_float)
MAX_NUMEL = 256

# Steering flags (comma-separated in $ZYX_FUZZ_AVOID) that keep the generator away from a class of programs, so
# that a long run can look past a known bug while it is being fixed. The default (empty) covers everything. Each
# flag names the bug the fuzzer found (all fixed now; tests/test_regressions.py holds their reproducers):
#   expand_reduce     reduce / integer matmul whose operand is an expanded (broadcast) view (scheduler hang)
#   narrow_overflow   comparisons, // and % applied to narrow-int arithmetic that may have wrapped
#   cat_negzero       cat/stack of floats (turned -0.0 into +0.0)
#   float_int_cast    float -> int casts of NaN / inf / out-of-range values
#   negzero_const     -0.0 as a constant (conflated with 0.0 by hash-consing, finding F1)
#   neg_const         negation of a negative constant (rendered as `--c`, a C compile error, F4)
#   float_mod         float % (gave -0.0 where NumPy gives +0.0, F5)
#   view_output       extra outputs that are views (movement ops) next to other outputs (KeyError in fuse, F3)
#   logical_bigint    logical_and/or/xor with a Python int above int64 (OverflowError, F6)
#   multi_output      realize only the last value (realize of a reduce/view with an op on it: KeyError, F3)
#   float_floordiv    float // (sign of zero results differed, F7)
AVOID = frozenset(s.strip() for s in os.environ.get("ZYX_FUZZ_AVOID", "").split(",") if s.strip())
# float32/float64 a*b+c is bit-exact (zyx compiles without contraction, F2); $ZYX_FUZZ_STRICT_FMA=0 relaxes it to
# a tolerance, for a target that contracts.
STRICT_FMA = os.environ.get("ZYX_FUZZ_STRICT_FMA", "1") != "0"


def zdt(a: np.ndarray) -> DType:
    """The zyx dtype of a NumPy array."""
    return dtypes.to_dtype(a.dtype)


# ---------------------------------------------------------------------------------------------------------------
# reference semantics


def _arr(x: Any, d: DType) -> np.ndarray:
    """``x`` (array or Python scalar) as an array of dtype ``d`` (Python scalars are converted exactly as zyx's
    constants: ``int``/``float``/``bool`` of the value, then the dtype)."""
    if isinstance(x, np.ndarray):
        return x if x.dtype == d.np_dtype else cast_ref(x, d)
    return np.asarray(dtypes.as_python(x, d)).astype(d.np_dtype)


def result_dtype(a: Any, b: Any) -> DType:
    """zyx's dtype for ``a op b`` where each is an array or a weak Python scalar."""
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return dtypes.promote_types(zdt(a), zdt(b))
    if isinstance(a, np.ndarray):
        return dtypes.scalar_dtype(b, zdt(a))
    if isinstance(b, np.ndarray):
        return dtypes.scalar_dtype(a, zdt(b))
    raise TypeError("at least one operand must be an array")


def fcompute(fn: Callable[..., Any], d: DType, *xs: np.ndarray) -> np.ndarray:
    """Apply a float function in dtype ``d``: float16/bfloat16 in float32 then rounded (once per op)."""
    with np.errstate(all="ignore"):
        if d in (dtypes.float16, dtypes.bfloat16):
            return np.asarray(fn(*(x.astype(np.float32) for x in xs))).astype(d.np_dtype)
        return np.asarray(fn(*xs)).astype(d.np_dtype)


def _int_rule(x64: np.ndarray, bits: int) -> np.ndarray:
    """x86-64 cvttsd2si: truncate; NaN, +-inf and out-of-range give INT_MIN of the width."""
    lo, hi = -(2.0 ** (bits - 1)), 2.0 ** (bits - 1)
    nptype = np.int32 if bits == 32 else np.int64
    with np.errstate(all="ignore"):
        t = np.trunc(x64)
        ok = np.isfinite(t) & (t >= lo) & (t < hi)
        r = np.where(ok, t, 0).astype(nptype)
    return np.where(ok, r, nptype(np.iinfo(nptype).min))


def float_to_int(x: np.ndarray, d: DType) -> np.ndarray:
    """zyx's float -> int cast (x86-64 semantics for NaN / inf / out-of-range, truncation otherwise)."""
    x64 = x.astype(np.float64)
    if d is dtypes.int32:
        return _int_rule(x64, 32)
    if d is dtypes.int64:
        return _int_rule(x64, 64)
    if d in (dtypes.int8, dtypes.int16, dtypes.uint8, dtypes.uint16):
        return _int_rule(x64, 32).astype(d.np_dtype)
    if d is dtypes.uint32:
        return _int_rule(x64, 64).astype(np.uint32)
    if d is dtypes.uint64:
        with np.errstate(all="ignore"):
            big = x64 >= 2.0 ** 63
            hi = _int_rule(x64 - 2.0 ** 63, 64) ^ np.int64(np.iinfo(np.int64).min)
        return np.where(big, hi, _int_rule(x64, 64)).astype(np.uint64)
    raise TypeError(d)


def cast_ref(x: np.ndarray, d: DType) -> np.ndarray:
    """``x.cast(d)`` as zyx defines it."""
    s = zdt(x)
    if s is d:
        return x
    with np.errstate(all="ignore"):
        if s.is_float and d.kind == "b":
            return x.astype(np.float64) != 0
        if s.is_float and d.is_int:
            return float_to_int(x, d)
        if s is dtypes.bfloat16 and d.is_float:
            return x.astype(np.float32).astype(d.np_dtype)
        return x.astype(d.np_dtype)


def _ffloat(x: np.ndarray) -> np.ndarray:
    """zyx's ``_float``: non-float inputs become float32."""
    return x if zdt(x).is_float else cast_ref(x, dtypes.float32)


_BIN_NP = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "truediv": np.true_divide, "floordiv": np.floor_divide,
    "mod": np.remainder, "pow": np.power, "maximum": np.maximum, "minimum": np.minimum,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal, "eq": np.equal,
    "ne": np.not_equal, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
    "shl": np.left_shift, "shr": np.right_shift,
}
BIN_SRC = {"add": "+", "sub": "-", "mul": "*", "truediv": "/", "floordiv": "//", "mod": "%", "pow": "**",
           "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "&", "or": "|", "xor": "^",
           "shl": "<<", "shr": ">>"}
COMPARE = {"lt", "le", "gt", "ge", "eq", "ne"}


def binary_ref(op: str, a: Any, b: Any) -> np.ndarray:
    """NumPy reference of a zyx binary op (``a``/``b`` arrays or Python scalars)."""
    if op in ("logical_and", "logical_or", "logical_xor"):
        fa, fb = (_arr(v, dtypes.bool_) if isinstance(v, np.ndarray) else np.asarray(bool(v)) for v in (a, b))
        return np.asarray(getattr(np, op)(fa, fb))
    d = result_dtype(a, b)
    x, y = _arr(a, d), _arr(b, d)
    with np.errstate(all="ignore"):
        if op == "truediv":
            if not d.is_float:
                x, y, d = cast_ref(x, dtypes.float32), cast_ref(y, dtypes.float32), dtypes.float32
            return fcompute(np.true_divide, d, x, y)
        if d.kind == "b":
            if op == "add":
                return np.asarray(np.logical_or(x, y))
            if op == "mul":
                return np.asarray(np.logical_and(x, y))
            if op in ("floordiv", "mod"):
                x, y, d = x.astype(np.int8), y.astype(np.int8), dtypes.int8
        fn = _BIN_NP[op]
        if op in COMPARE:
            if d is dtypes.bfloat16:
                x, y = x.astype(np.float32), y.astype(np.float32)
            return np.asarray(fn(x, y))
        if d.is_float:
            return fcompute(fn, d, x, y)
        return np.asarray(fn(x, y)).astype(d.np_dtype)


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[np.float64])(x.astype(np.float64)) if x.size else x.astype(np.float64)


_UNARY_FLOAT = {
    "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2, "sqrt": np.sqrt,
    "reciprocal": lambda x: np.float32(1) / x if x.dtype == np.float32 else 1 / x,
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "tanh": np.tanh, "erf": _erf,
}
UNARY_EXACT_FLOAT = {"sqrt", "reciprocal", "rsqrt"}


def unary_ref(op: str, x: np.ndarray) -> np.ndarray:
    """NumPy reference of a zyx unary op."""
    d = zdt(x)
    with np.errstate(all="ignore"):
        if op == "neg":
            return fcompute(np.negative, d, x) if d.is_float else np.negative(x)
        if op == "abs":
            return x if d.kind in "bu" else (fcompute(np.abs, d, x) if d.is_float else np.abs(x))
        if op == "invert":
            return np.invert(x)
        if op == "logical_not":
            return ~cast_ref(x, dtypes.bool_)
        if op in ("floor", "ceil", "trunc", "round"):
            return x if not d.is_float else fcompute(getattr(np, op), d, x)
        if op == "relu":
            return x if d.kind == "b" else binary_ref("maximum", x, 0)
        if op == "sign":
            if d.kind == "b":
                return x
            if d.kind == "u":
                return (x > 0).astype(x.dtype)
            return fcompute(np.sign, d, x) if d.is_float else np.sign(x).astype(x.dtype)
        if op in ("isnan", "isinf", "isfinite"):
            return getattr(np, op)(x.astype(np.float32) if d is dtypes.bfloat16 or not d.is_float else x)
        xf = _ffloat(x)
        fd = zdt(xf)
        if op == "rsqrt":
            return fcompute(lambda v: np.asarray(1, v.dtype) / v, fd, fcompute(np.sqrt, fd, xf))
        if op == "sigmoid":
            return fcompute(lambda v: 1 / (1 + np.exp(-v.astype(np.float64))), fd, xf)
        if op == "square":
            return fcompute(np.multiply, fd, xf, xf)
        return fcompute(_UNARY_FLOAT[op], fd, xf)


def _acc(x: np.ndarray) -> tuple[np.ndarray, DType]:
    """Accumulation array and result dtype for sum/prod/cumsum (zyx's ``_sum_dtype``; float accumulates wide)."""
    d = zdt(x)
    if d.kind == "b" or (d.kind == "i" and d.itemsize < 8):
        return x.astype(np.int64), dtypes.int64
    if d.kind == "u" and d.itemsize < 8:
        return x.astype(np.uint64), dtypes.uint64
    if d.is_float:
        return x.astype(np.float64), d
    return x, d


def reduce_ref(op: str, x: np.ndarray, axis: Any, keepdim: bool) -> np.ndarray:
    """NumPy reference of sum/prod/max/min/mean/any/all/var/std/logsumexp."""
    d = zdt(x)
    ax = axis if axis is None or isinstance(axis, int) else tuple(axis)
    with np.errstate(all="ignore"):
        if op in ("sum", "prod"):
            a, rd = _acc(x)
            r = (np.sum if op == "sum" else np.prod)(a, axis=ax, keepdims=keepdim)
            return np.asarray(r).astype(rd.np_dtype) if not rd.is_float else np.asarray(r).astype(rd.np_dtype)
        if op in ("max", "min"):
            a = x.astype(np.float32) if d is dtypes.bfloat16 else x
            return np.asarray((np.max if op == "max" else np.min)(a, axis=ax, keepdims=keepdim)).astype(x.dtype)
        if op in ("any", "all"):
            return np.asarray((np.any if op == "any" else np.all)(cast_ref(x, dtypes.bool_), axis=ax,
                                                                  keepdims=keepdim))
        xf = _ffloat(x)
        fd = zdt(xf)
        a = xf.astype(np.float64)
        if op == "mean":
            r = np.mean(a, axis=ax, keepdims=keepdim) if a.size else np.sum(a, axis=ax, keepdims=keepdim) * np.nan
            n = math.prod(x.shape[i] for i in _axes(axis, x.ndim))
            if n == 0:
                r = np.sum(a, axis=ax, keepdims=keepdim) * np.nan
            return np.asarray(r).astype(fd.np_dtype)
        if op in ("var", "std"):
            r = np.var(a, axis=ax, keepdims=keepdim)
            return np.asarray(np.sqrt(r) if op == "std" else r).astype(fd.np_dtype)
        if op == "logsumexp":
            m = np.max(a, axis=ax, keepdims=True)
            m = np.where(np.isinf(m), 0, m)
            r = np.log(np.sum(np.exp(a - m), axis=ax, keepdims=True)) + m
            if not keepdim:
                r = r.reshape(tuple(s for i, s in enumerate(x.shape) if i not in _axes(axis, x.ndim)))
            return np.asarray(r).astype(fd.np_dtype)
    raise ValueError(op)


def _square_scale(s: np.ndarray, d: DType, axis: Any, keepdim: bool, std: bool) -> np.ndarray:
    """Error scale of var (mean(s^2), ``s`` the input's float64 error scale) or of std = sqrt(var)
    (sqrt(TOL * mean(s^2)) / TOL); unbounded where var's intermediates reach the overflow region of ``d``, the
    dtype zyx computes in (the reference computes in float64). That is the sum of squared deviations, up to
    n * mean(s^2): it is accumulated before the division by n (found by the fuzzer: float32 var of uint64 values
    near 2^64 is 1.9e37, but the sum of its 20 squared deviations, 3.9e38, is inf in float32, as in NumPy's
    float32 var). At the other end, squares below the smallest subnormal are 0 (found by a random run, seed 141203,
    host: the bfloat16 std of 79 zeros and 3.0e-34 is 0 in float32, as in NumPy's float32 std; the float64
    reference says 3.4e-35, and so does PyTorch, which accumulates in double)."""
    fi = np.finfo(np.float32 if d is dtypes.bfloat16 else d.np_dtype)
    big = float(fi.max) / 8
    n = math.prod(s.shape[i] for i in _axes(axis, s.ndim))
    with np.errstate(all="ignore"):
        mean_sq = reduce_ref("mean", s * s, axis, keepdim).astype(np.float64)
        # a square below the smallest subnormal rounds to 0: each loses up to that much, and so does var, n of them
        # divided by n (an absolute error; std's is its square root)
        mean_sq = mean_sq + float(fi.smallest_subnormal) / TOL[d]
        return np.where(n * mean_sq > big, np.inf, np.sqrt(mean_sq / TOL[d]) if std else mean_sq)


def _multiply_finfo(d: DType) -> np.finfo:
    """The range of the type zyx multiplies floats of ``d`` in: float64 for float64, float32 below it."""
    return np.finfo(np.float64 if d is dtypes.float64 else np.float32)


def _prod_scale(s: np.ndarray, d: DType, axis: Any, keepdim: bool) -> np.ndarray:
    """Error scale of a float prod (``s`` the input's float64 error scale): the product of the scales, unbounded
    where some order of the multiplications leaves the range of the dtype zyx multiplies in (float32 below
    float64; the reference multiplies in float64, in order). Vector lanes reorder a product as they reorder a sum:
    the largest partial product an order can form is the product of the factors above 1, the smallest that of
    the nonzero factors below 1 (underflow matters only when large factors can meet it). Found by a random run
    (seed 31203, search on, host): the bfloat16 prod of [2, 0, 0, 0, 3e38] is 0 in order, nan in lanes (2 * 3e38
    is inf in float32, then times 0); PyTorch's float32 prod gives nan for the same pattern 32 apart."""
    fi = _multiply_finfo(d)
    ax = _axes(axis, s.ndim)
    with np.errstate(all="ignore"):
        scale = reduce_ref("prod", s, axis, keepdim).astype(np.float64)
        big = np.prod(np.maximum(s, 1.0), axis=ax, keepdims=keepdim)
        small = np.prod(np.where((s > 0) & (s < 1), s, 1.0), axis=ax, keepdims=keepdim)
        n = math.prod(s.shape[i] for i in ax)
        scale = scale + _subnormal_error(n, big, d)
        return np.where((big > fi.max) | ((small < fi.tiny) & (big > 1)), np.inf, scale)


def _subnormal_error(n, amplification, d: DType):
    """Error scale of the subnormal roundings in a product of ``n`` factors: each partial product below the
    normal range keeps only its multiples of the smallest subnormal (half of it lost at most), and the later
    factors scale that loss by at most ``amplification`` (the product of the factors above 1). Found by a random
    run (seed 211203, cuda:0): the float32 cumprod of [0.25, 1e-40, 300.7] rounds 2.5e-41 to a subnormal with 14
    significant bits, and times 300.7 that is 7.517249e-39 where the float64 reference says 7.51746e-39."""
    sub = float(_multiply_finfo(d).smallest_subnormal)
    return n * sub * amplification / TOL[d]


def _cumprod_scale(s: np.ndarray, d: DType, axis: int) -> np.ndarray:
    """Error scale of a float cumprod: the running product of the scales, plus its subnormal roundings."""
    if s.ndim == 0:
        s, axis = s.reshape(1), 0
    with np.errstate(all="ignore"):
        n = np.cumsum(np.ones_like(s), axis=axis)
        return np.cumprod(s, axis=axis) + _subnormal_error(n, np.cumprod(np.maximum(s, 1.0), axis=axis), d)


def _singular_scale(scale: np.ndarray, s: np.ndarray, x: Val, tol: float) -> np.ndarray:
    """Error scale of log/log2/sqrt/rsqrt/reciprocal of ``x`` (input error scale ``s``): grows as ``s / |x|``, and is
    unbounded where ``x`` is approximate with an error bound (``tol * s``) reaching its magnitude: its sign is not
    known, so the result may be nan on one side only (found by the fuzzer: log(16 * tan(2^62)), where tan beyond
    2^44 is documented as meaningless; NumPy's is 0.988, zyx's -1.83)."""
    a = np.abs(x.arr.astype(np.float64))
    with np.errstate(all="ignore"):
        scale = scale + s / a
        return scale if x.exact else np.where(tol * s >= a, np.inf, scale)


def _var_dtype(x: np.ndarray) -> DType:
    """The float dtype zyx computes var/std of ``x`` in."""
    return zdt(_ffloat(x))


def _axes(axis: Any, nd: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(nd))
    if isinstance(axis, int):
        return (axis % nd,) if nd else ()
    return tuple(a % nd for a in axis)


def arg_ref(op: str, x: np.ndarray, axis: int | None, keepdim: bool) -> np.ndarray:
    """argmax/argmin (int64; the first NaN wins as in NumPy)."""
    a = x.astype(np.float32) if zdt(x) is dtypes.bfloat16 else x
    if a.dtype == np.bool_:
        a = a.astype(np.int8)
    if x.ndim == 0:
        return np.asarray(0, np.int64)
    fn = np.argmax if op == "argmax" else np.argmin
    return np.asarray(fn(a, axis=axis, keepdims=keepdim)).astype(np.int64)


def softmax_ref(op: str, x: np.ndarray, axis: int) -> np.ndarray:
    """softmax / log_softmax computed in float64, returned in zyx's float dtype."""
    xf = _ffloat(x)
    a = xf.astype(np.float64)
    with np.errstate(all="ignore"):
        m = np.max(a, axis=axis, keepdims=True)
        if op == "softmax":
            e = np.exp(a - m)
            r = e / np.sum(e, axis=axis, keepdims=True)
        else:
            mm = np.where(np.isinf(m), 0, m)
            r = a - (np.log(np.sum(np.exp(a - mm), axis=axis, keepdims=True)) + mm)
    return r.astype(xf.dtype)


def cumsum_ref(x: np.ndarray, axis: int, op: str = "cumsum") -> np.ndarray:
    """cumsum / cumprod (0-d becomes shape (1,), as NumPy)."""
    if x.ndim == 0:
        x = x.reshape(1)
        axis = 0
    a, rd = _acc(x)
    with np.errstate(all="ignore"):
        return (np.cumsum if op == "cumsum" else np.cumprod)(a, axis=axis).astype(rd.np_dtype)


def _wrap_obj(r: np.ndarray, d: DType) -> np.ndarray:
    """An object array of Python ints, wrapped into integer dtype ``d``."""
    bits = d.bits
    flat = [int(v) % (1 << bits) for v in r.reshape(-1)]
    if d.kind == "i":
        flat = [v - (1 << bits) if v >= 1 << (bits - 1) else v for v in flat]
    return np.array(flat, dtype=d.np_dtype).reshape(r.shape)


def matmul_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """NumPy matmul; integers exact with wraparound, floats in float64 then the result dtype."""
    d = dtypes.promote_types(zdt(a), zdt(b))
    if d.kind == "b":
        return np.matmul(a.astype(bool), b.astype(bool))
    if d.is_int:
        x, y = _arr(a, d).astype(object), _arr(b, d).astype(object)
        shape = np.matmul(np.zeros(x.shape, np.int8), np.zeros(y.shape, np.int8)).shape
        r = np.matmul(x, y) if x.size and y.size else np.zeros(shape, dtype=object)
        r = np.asarray(r, dtype=object)
        if r.ndim == 0:
            r = r.reshape(())
        return _wrap_obj(r, d)
    with np.errstate(all="ignore"):
        return np.asarray(np.matmul(_arr(a, d).astype(np.float64), _arr(b, d).astype(np.float64))).astype(d.np_dtype)


def pad_ref(x: np.ndarray, pads: Sequence[tuple[int, int]], value: Any) -> np.ndarray:
    """Constant padding; negative widths crop, as in zyx."""
    sl = tuple(slice(max(-a, 0), s - max(-b, 0)) for (a, b), s in zip(pads, x.shape))
    x = x[sl]
    pads = [(max(a, 0), max(b, 0)) for a, b in pads]
    out = np.full(tuple(s + a + b for s, (a, b) in zip(x.shape, pads)), _arr(value, zdt(x)), dtype=x.dtype)
    out[tuple(slice(a, a + s) for s, (a, _b) in zip(x.shape, pads))] = x
    return out


def getitem_ref(x: np.ndarray, index: tuple, gaxis: int | None, gi: np.ndarray | None) -> np.ndarray:
    """NumPy indexing; an integer tensor index (on axis ``gaxis``) wraps negatives and reads 0 out of range."""
    if gi is None:
        return np.asarray(x[index])
    n = x.shape[gaxis]
    i = gi.astype(np.int64)
    i = np.where(i < 0, i + n, i)
    i = np.where((i < 0) | (i >= n), n, i)  # an extra zero slice at position n
    zero = np.zeros(x.shape[:gaxis] + (1,) + x.shape[gaxis + 1:], x.dtype)
    xe = np.concatenate([x, zero], axis=gaxis)
    return np.asarray(xe[tuple(i if isinstance(ix, TensorIndex) else ix for ix in index)])


class TensorIndex:
    """Placeholder for the integer tensor in an index tuple."""


def split_sizes(n: int, size: int) -> list[int]:
    """zyx/PyTorch ``split(size)`` piece sizes."""
    return [min(size, n - i) for i in range(0, n, size)] or [0]


def split_ref(x: np.ndarray, sizes: Sequence[int], axis: int, k: int) -> np.ndarray:
    start = sum(sizes[:k])
    sl = [slice(None)] * x.ndim
    sl[axis] = slice(start, start + sizes[k])
    return x[tuple(sl)]


def cat_ref(xs: Sequence[np.ndarray], axis: int, stack: bool) -> np.ndarray:
    d = zdt(xs[0])
    for x in xs[1:]:
        d = dtypes.promote_types(d, zdt(x))
    ys = [_arr(x, d) for x in xs]
    return np.stack(ys, axis=axis) if stack else np.concatenate(ys, axis=axis)


def where_ref(c: np.ndarray, x: Any, y: Any) -> np.ndarray:
    """zyx.where: scalars weak against the tensor, then tensor promotion."""
    if isinstance(x, np.ndarray) and not isinstance(y, np.ndarray):
        y = _arr(y, dtypes.scalar_dtype(y, zdt(x)))
    elif isinstance(y, np.ndarray) and not isinstance(x, np.ndarray):
        x = _arr(x, dtypes.scalar_dtype(x, zdt(y)))
    d = dtypes.promote_types(zdt(x), zdt(y))
    return np.asarray(np.where(cast_ref(c, dtypes.bool_), _arr(x, d), _arr(y, d)))


# ---------------------------------------------------------------------------------------------------------------
# programs


@dataclass(eq=False)
class Val:
    """A value of the reference run: the array, its float error scale, and exactness."""

    arr: np.ndarray
    scale: np.ndarray | None  # float64, same shape; None for bool/int
    exact: bool  # only correctly rounded float ops so far: zyx must match bit for bit
    contract: bool = False  # a float32/float64 product that gcc may fuse with a following add into an FMA
    is_input: bool = False
    zsign: bool = False  # the sign of a zero is unspecified (max/min of +-0.0 upstream)


@dataclass
class Instr:
    """``v{i} = <src>`` with args ``{0}``, ``{1}``... naming earlier values."""

    template: str
    args: tuple[int, ...]
    ref: Callable[..., np.ndarray]  # called with the args' arrays
    kind: str = "default"  # scale rule, see Builder.emit
    ops: tuple[str, ...] = ()  # op names, for statistics and steering
    data: np.ndarray | None = None  # for uploaded inputs


@dataclass(repr=False)
class Program:
    """Instructions plus the indices of the values to realize and compare."""

    instrs: list[Instr]
    vals: list[Val]
    outputs: list[int]
    ops: set[str] = field(default_factory=set)

    def __repr__(self) -> str:
        return "Program(\n    " + "\n    ".join(self.lines()) + f"\n    outputs={self.outputs})"

    def lines(self) -> list[str]:
        out = []
        for i, ins in enumerate(self.instrs):
            if ins.data is not None:
                out.append(f"v{i} = zyx.Tensor({array_src(ins.data)}, device=device)")
            else:
                out.append(f"v{i} = " + ins.template.format(*(f"v{a}" for a in ins.args)))
        return out

    def source(self, device: str = "host") -> str:
        """A standalone Python reproducer."""
        head = ["import ml_dtypes", "import numpy as np", "import zyx", "from math import inf, nan", "",
                f"device = {device!r}"]
        outs = ", ".join(f"v{i}" for i in self.outputs)
        tail = [f"outs = [{outs}]", "zyx.realize(*outs)", "for o in outs:",
                "    print(o.dtype, o.shape, repr(o.numpy()))"]
        return "\n".join(head + self.lines() + tail)

    def jit_source(self, device: str = "host") -> str:
        """A standalone reproducer of :func:`run_zyx_jit`."""
        inputs = [i for i, ins in enumerate(self.instrs) if ins.data is not None]
        params = ", ".join(f"v{i}" for i in inputs)
        body = [f"    {line}" for i, line in enumerate(self.lines()) if self.instrs[i].data is None]
        outs = ", ".join(f"v{i}" for i in self.outputs)
        data = [f"    {array_src(self.instrs[i].data)}," for i in inputs]
        return "\n".join([
            "import ml_dtypes", "import numpy as np", "import zyx", "from math import inf, nan", "",
            f"device = {device!r}", "data = [", *data, "]", "", "@zyx.jit", f"def fn({params}):", *body,
            f"    return ({outs},)", "",
            "def flipped(a):", "    return np.roll(a.reshape(-1)[::-1], 1).reshape(a.shape).copy()", "",
            "for _ in range(2):  # run, capture (with the inputs' values in another order)",
            "    zyx.realize(*fn(*(zyx.Tensor(flipped(a), device=device) for a in data)))",
            "for o in fn(*(zyx.Tensor(a.copy(), device=device) for a in data)):  # replay",
            "    print(o.dtype, o.shape, repr(o.numpy()))"])

    def expected_src(self) -> str:
        return "\n".join(f"v{i}: {self.vals[i].arr.dtype} {self.vals[i].arr.shape} {self.vals[i].arr!r}"
                         for i in self.outputs)


def array_src(a: np.ndarray) -> str:
    """Python source for an array (bfloat16 values written as float32 literals, which they are exactly)."""
    dt = "ml_dtypes.bfloat16" if a.dtype == BF16 else f"np.{a.dtype.name}"
    vals = a.astype(np.float32).tolist() if a.dtype == BF16 else a.tolist()
    if a.ndim == 0:
        return f"np.array({vals!r}, dtype={dt})"
    return f"np.array({vals!r}, dtype={dt}).reshape({a.shape!r})"


def run_zyx(prog: Program, device: str) -> list[np.ndarray]:
    """Run the program with zyx (each instruction's source is eval'ed) and return the outputs as NumPy."""
    env: dict[str, Any] = {"zyx": zyx, "np": np, "ml_dtypes": ml_dtypes, "device": device, "inf": math.inf,
                           "nan": math.nan}
    for i, ins in enumerate(prog.instrs):
        if ins.data is not None:
            env[f"v{i}"] = zyx.Tensor(ins.data.copy(), device=device)
        else:
            env[f"v{i}"] = eval(ins.template.format(*(f"v{a}" for a in ins.args)), env)  # noqa: S307
    outs = [env[f"v{i}"] for i in prog.outputs]
    zyx.realize(*outs)
    return [o.numpy() for o in outs]


def decoy(a: np.ndarray) -> np.ndarray:
    """``a``'s values in another order (reversed, then rolled by one): what a jitted program captures with, so that
    a replay still reading a captured buffer instead of its argument gives a wrong answer."""
    return np.roll(a.reshape(-1)[::-1], 1).reshape(a.shape).copy()


def run_zyx_jit(prog: Program, device: str) -> list[list[np.ndarray]]:
    """Run the program as a ``zyx.jit`` function of its uploaded inputs: a warm-up call and the capture with
    :func:`decoy` inputs, then two replays on the real inputs (fresh tensors each). Returns both replays' outputs."""
    inputs = [i for i, ins in enumerate(prog.instrs) if ins.data is not None]

    def fn(*args: zyx.Tensor) -> tuple:
        env: dict[str, Any] = {"zyx": zyx, "np": np, "ml_dtypes": ml_dtypes, "device": device, "inf": math.inf,
                               "nan": math.nan}
        env.update((f"v{i}", a) for i, a in zip(inputs, args))
        for i, ins in enumerate(prog.instrs):
            if ins.data is None:
                env[f"v{i}"] = eval(ins.template.format(*(f"v{a}" for a in ins.args)), env)  # noqa: S307
        return tuple(env[f"v{i}"] for i in prog.outputs)

    jitted = zyx.jit(fn)
    for _ in range(2):
        outs = jitted(*(zyx.Tensor(decoy(prog.instrs[i].data), device=device) for i in inputs))
        zyx.realize(*outs)
    assert jitted.captures == 1, f"expected one capture, got {jitted.captures}"
    runs = []
    for _ in range(2):
        outs = jitted(*(zyx.Tensor(prog.instrs[i].data.copy(), device=device) for i in inputs))
        runs.append([o.numpy() for o in outs])
    return runs


# ---------------------------------------------------------------------------------------------------------------
# comparison

TOL = {dtypes.float16: 8 * 2.0 ** -10, dtypes.bfloat16: 8 * 2.0 ** -7, dtypes.float32: 64 * 2.0 ** -23,
       dtypes.float64: 1e-10}


def compare(got: np.ndarray, want: Val) -> str | None:
    """None when ``got`` (zyx) matches the reference value, else a description of the first mismatches."""
    w = want.arr
    if got.dtype != w.dtype:
        return f"dtype {got.dtype} != expected {w.dtype}"
    if got.shape != w.shape:
        return f"shape {got.shape} != expected {w.shape}"
    d = zdt(w)
    if not d.is_float:
        bad = got != w
    else:
        g, r = got.astype(np.float64), w.astype(np.float64)
        gn, rn = np.isnan(g), np.isnan(r)
        if want.exact:
            same_sign = True if want.zsign else np.signbit(g) == np.signbit(r)
            bad = ~((g == r) & same_sign | (gn & rn))
        else:
            s = np.abs(want.scale) if want.scale is not None else np.abs(r)
            with np.errstate(all="ignore"):
                tol = TOL[d] * (s + float(np.finfo(np.float32 if d.itemsize <= 4 else np.float64).tiny))
                close = (np.abs(g - r) <= tol) | (g == r) | (gn & rn)
                big = float(np.finfo(w.dtype if d is not dtypes.bfloat16 else np.float32).max) / 8
                # overflow region: an approximate value near the top of the range, or one whose intermediates are
                # (its error scale: var's mean of squares), may round to inf on one side
                lenient = (~np.isfinite(s) | (~np.isfinite(g) & (np.maximum(np.abs(r), s) > big))
                           | (~np.isfinite(r) & (np.abs(g) > big)))
            bad = ~(close | lenient)
    if not np.any(bad):
        return None
    idx = np.argwhere(np.asarray(bad))[:5]
    parts = [f"at {tuple(int(i) for i in ix)}: zyx {got[tuple(ix)]!r} vs numpy {w[tuple(ix)]!r}" for ix in idx]
    how = "exact" if want.exact else "approx"
    return f"{int(np.sum(bad))} of {w.size} elements differ ({how}): " + "; ".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# generation

_DIMS = [1, 2, 3, 4, 5, 2, 3, 1, 4, 0, 6]
_RANKS = [0, 1, 1, 2, 2, 2, 3, 3, 4]


def _int_special(d: DType) -> list[int]:
    lo, hi = dtypes.int_range(d)
    vals = {lo, lo + 1, hi, hi - 1, 0, 1, 2, hi // 2 + 1, 100 if hi >= 100 else hi, 127 if hi >= 127 else hi}
    if lo < 0:
        vals |= {-1, -2, lo // 2, -100, -127}
    return sorted(v for v in vals if lo <= v <= hi)


_FLOAT_SPECIAL = [0.0, -0.0, 0.5, -0.5, 1.5, 2.5, -2.5, 3.0, math.nan, math.inf, -math.inf, 127.5, 300.7, -129.5,
                  65504.0, 2.0 ** 31, -(2.0 ** 31), 2.0 ** 32 + 3.0 * 2 ** 9, 2.0 ** 63, -(2.0 ** 63), 2.0 ** 64, 1e10,
                  -1e10, 1e-5, 1e-40, 3e38]


def _round_to(v: float, d: DType) -> float:
    with np.errstate(all="ignore"):
        return float(np.asarray(v, np.float64).astype(d.np_dtype).astype(np.float64))


def _no_negzero(v: float) -> float:
    return 0.0 if v == 0 and "negzero_const" in AVOID else v


def scalar_strategy(d: DType, negzero: bool = False) -> st.SearchStrategy:
    """Python scalars whose value is representable in dtype ``d`` (ints in range); ``negzero``: -0.0 even when
    the ``negzero_const`` flag steers constants away from it."""
    if d.kind == "b":
        return st.booleans()
    if d.is_int:
        lo, hi = dtypes.int_range(d)
        return st.one_of(st.integers(max(lo, -3), min(hi, 3)), st.sampled_from(_int_special(d)), st.integers(lo, hi))
    small = st.floats(-4, 4, width=32)
    return st.one_of(small, st.sampled_from(_FLOAT_SPECIAL), st.floats(width=64)).map(
        lambda v: _round_to(v, d) if negzero else _no_negzero(_round_to(v, d)))


def array_strategy(d: DType, shape: tuple[int, ...]) -> st.SearchStrategy:
    """Arrays of dtype ``d`` with small, extreme and special values."""
    el = scalar_strategy(d, negzero=True)
    if d is dtypes.bfloat16:
        return hnp.arrays(np.float32, shape, elements=el).map(lambda a: a.astype(BF16))
    if d.kind == "b":
        return hnp.arrays(np.bool_, shape, elements=st.booleans())
    return hnp.arrays(d.np_dtype, shape, elements=el)


def _bcast(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return None


def _factorize(n: int, k: int, draw: Callable) -> tuple[int, ...]:
    """A shape with ``k`` dims and ``n`` elements."""
    if n == 0:
        dims = [draw(st.integers(0, 3)) for _ in range(k)]
        if k:
            dims[draw(st.integers(0, k - 1))] = 0
        return tuple(dims)
    dims = []
    rest = n
    for _ in range(k - 1):
        divs = [q for q in range(1, rest + 1) if rest % q == 0]
        q = draw(st.sampled_from(divs))
        dims.append(q)
        rest //= q
    return tuple(dims + [rest]) if k else ()


def _is_float(v: Val) -> bool:
    return zdt(v.arr).is_float


class Builder:
    """Accumulates instructions while evaluating the NumPy reference eagerly."""

    BINARY_OPS = ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "maximum", "minimum", "lt", "le", "gt",
                  "ge", "eq", "ne", "and", "or", "xor", "shl", "shr", "logical_and", "logical_or", "logical_xor",
                  "add", "mul", "sub")
    UNARY_OPS = ("neg", "abs", "invert", "logical_not", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "reciprocal",
                 "sin", "cos", "tan", "tanh", "erf", "sigmoid", "relu", "floor", "ceil", "round", "trunc", "sign",
                 "isnan", "isinf", "isfinite", "square", "neg", "abs")
    REDUCE_OPS = ("sum", "prod", "max", "min", "mean", "any", "all", "argmax", "argmin", "cumsum", "var", "std",
                  "logsumexp", "softmax", "log_softmax", "sum", "max", "cumprod")
    INPUT_KINDS = ("data",) * 8 + ("full", "arange")

    def __init__(self, draw: Callable) -> None:
        self.draw = draw
        self.instrs: list[Instr] = []
        self.vals: list[Val] = []
        self.tags: list[set[str]] = []

    # ---- helpers -------------------------------------------------------------------------------------------
    def scale_of(self, i: int) -> np.ndarray:
        v = self.vals[i]
        return v.scale if v.scale is not None else np.asarray(np.abs(v.arr.astype(np.float64)))

    def emit(self, template: str, args: Sequence[int], ref: Callable[..., np.ndarray], *, kind: str = "default",
             exact: bool = True, ops: tuple[str, ...] = (), data_args: Sequence[int] | None = None,
             scale_fn: Callable[..., np.ndarray] | None = None, tags: set[str] | None = None,
             data: np.ndarray | None = None) -> int:
        """Append ``v = template(args)``; ``exact``: the op is correctly rounded in floats (and keeps exactness);
        ``kind`` selects the error-scale rule (move/add/mul/div/unary/singular/default)."""
        args = tuple(args)
        ins = Instr(template, args, ref, kind, ops, data)
        ins_vals = [self.vals[a] for a in args]
        with np.errstate(all="ignore"):
            out = np.asarray(ref(*(v.arr for v in ins_vals))) if data is None else data
        d = zdt(out)
        ex = exact and all(v.exact for v in ins_vals)
        contract = False
        if d.is_float and d.itemsize >= 4 and not STRICT_FMA:
            if kind == "mul" or "product" in ops:
                contract = True
            elif kind == "add" and any(v.contract for v in ins_vals):
                ex = False  # gcc may fuse the product into an FMA (one rounding instead of two)
            elif kind in ("move", "neg"):
                contract = any(v.contract for v in ins_vals)
        scale = None
        if d.is_float:
            with np.errstate(all="ignore"):
                r = np.abs(out.astype(np.float64))
                ss = [self.scale_of(a) for a in args]
                for j, v in enumerate(ins_vals):  # an approximate narrower input carries its own, larger error
                    dj = zdt(v.arr)
                    if dj.is_float and not v.exact and TOL[dj] > TOL[d]:
                        ss[j] = ss[j] * (TOL[dj] / TOL[d])
                if scale_fn is not None:
                    scale = r + np.abs(scale_fn(*ss))
                elif data is not None or not ss:
                    scale = r
                elif kind == "move":
                    da = range(len(args)) if data_args is None else data_args
                    margs = [ss[j] if j in da else ins_vals[j].arr for j in range(len(args))]
                    scale = np.abs(np.asarray(ref(*margs)).astype(np.float64))
                elif kind in ("add", "neg"):
                    scale = r + sum(ss)
                elif kind == "mul":
                    scale = r + math.prod(ss)
                elif kind == "div":
                    b = np.abs(ins_vals[1].arr.astype(np.float64)) if len(ss) > 1 else 1.0
                    scale = r + (ss[0] + r * (ss[1] if len(ss) > 1 else 0)) / b
                elif kind in ("unary", "singular"):
                    scale = r + ss[0] * (1 + r)
                    if kind == "singular":
                        scale = _singular_scale(scale, ss[0], ins_vals[0], TOL[d])
                else:
                    m = max((float(np.max(s)) if s.size else 0.0) for s in ss)
                    scale = r + m * (1 + r)
                scale = np.broadcast_to(scale, out.shape).astype(np.float64)
        self.instrs.append(ins)
        t = set().union(*(self.tags[a] for a in args)) if args else set()
        t |= tags or set()
        self.vals.append(Val(out, scale, ex, contract, is_input=data is not None or not args,
                             zsign="zsign" in t))
        self.tags.append(t)
        return len(self.vals) - 1

    def pick(self, pred: Callable[[Val], bool] = lambda v: True) -> int | None:
        cands = [i for i in reversed(range(len(self.vals))) if pred(self.vals[i])]
        if not cands:
            return None
        return self.draw(st.sampled_from(cands))

    def shape(self, min_rank: int = 0) -> tuple[int, ...]:
        rank = self.draw(st.sampled_from([r for r in _RANKS if r >= min_rank]))
        dims = [self.draw(st.sampled_from(_DIMS)) for _ in range(rank)]
        while math.prod(dims) > MAX_NUMEL:
            dims[dims.index(max(dims))] //= 2
        return tuple(dims)

    def dtype(self, like: DType | None = None, pred: Callable[[DType], bool] = lambda d: True) -> DType:
        opts = [d for d in ALL_DTYPES if pred(d)]
        if like is not None and pred(like) and self.draw(st.booleans()):
            return like
        return self.draw(st.sampled_from(opts))

    def new_input(self, shape: tuple[int, ...] | None = None, dtype: DType | None = None,
                  kind: str | None = None) -> int:
        """A fresh input: uploaded host data (mostly), ``zyx.arange`` or ``zyx.full``."""
        shape = self.shape() if shape is None else shape
        d = self.dtype() if dtype is None else dtype
        kind = kind or self.draw(st.sampled_from(self.INPUT_KINDS))
        if kind == "arange" and len(shape) == 1:
            n = shape[0]
            lo, hi = dtypes.int_range(dtypes.int64)
            start = self.draw(st.sampled_from([0, 1, -3, 100, -100, 120, 250, 30000, 2 ** 31 - 2]))
            step = self.draw(st.sampled_from([1, 2, -1, 3, 7, 100]))
            stop = start + n * step
            if d.kind == "b" or not lo <= stop <= hi:
                kind = "full"
            else:
                tmpl = f"zyx.arange({start}, {stop}, {step}, dtype=zyx.{d.name}, device=device)"
                ref = lambda: cast_ref(np.arange(start, stop, step, dtype=np.int64) if not d.is_float  # noqa: E731
                                       else np.arange(n, dtype=np.float64) * step + start, d)
                return self.emit(tmpl, (), ref, ops=("arange",))
        if kind in ("full", "arange"):
            v = self.scalar(d)
            tmpl = f"zyx.full({shape!r}, {v!r}, dtype=zyx.{d.name}, device=device)"
            return self.emit(tmpl, (), lambda: np.full(shape, _arr(v, d), dtype=d.np_dtype), ops=("full",),
                             tags={"const"})
        arr = self.array(d, shape)
        return self.emit("", (), lambda: arr, data=arr, ops=("input",))

    def operand_like(self, i: int, same_shape: bool = False, int_only: bool = False) -> int:
        """An existing value or a fresh input whose shape broadcasts with value ``i``."""
        sh = self.vals[i].arr.shape
        da = zdt(self.vals[i].arr)
        pred_d = (lambda d: d.is_int) if int_only else (lambda d: True)

        def ok(v: Val) -> bool:
            if int_only and not zdt(v.arr).is_int:
                return False
            if same_shape:
                return v.arr.shape == sh
            bs = _bcast(sh, v.arr.shape)
            return bs is not None and math.prod(bs) <= MAX_NUMEL * 2

        if self.draw(st.integers(0, 2)) == 0:
            j = self.pick(ok)
            if j is not None:
                return j
        if same_shape:
            shape = sh
        else:
            dims = []
            for s in sh:
                c = self.draw(st.integers(0, 3))
                dims.append(1 if c == 1 else (self.draw(st.integers(2, 3)) if c == 2 and s == 1 else s))
            drop = self.draw(st.integers(0, len(dims)))
            dims = dims[drop:] if self.draw(st.integers(0, 2)) == 0 else dims
            if self.draw(st.integers(0, 5)) == 0 and len(dims) < 4:
                dims = [self.draw(st.integers(1, 3))] + dims
            shape = tuple(dims)
            if _bcast(sh, shape) is None or math.prod(_bcast(sh, shape)) > MAX_NUMEL * 2:
                shape = sh
        return self.new_input(shape, self.dtype(da, pred_d))

    def scalar(self, d: DType) -> Any:
        """A Python scalar constant of dtype ``d``'s range."""
        return self.draw(scalar_strategy(d))

    def array(self, d: DType, shape: tuple[int, ...]) -> np.ndarray:
        """The data of an uploaded input."""
        return self.draw(array_strategy(d, shape))

    def avoid(self, flag: str) -> bool:
        return flag in AVOID

    # ---- op generators (each returns False when it does not apply) -----------------------------------------
    def g_binary(self) -> bool:
        op = self.draw(st.sampled_from(self.BINARY_OPS))
        a = self.pick()
        va = self.vals[a]
        da = zdt(va.arr)
        form = self.draw(st.sampled_from(["tensor", "tensor", "scalar", "rscalar"]))
        if op in ("shl", "shr"):
            return self._shift(op, a, form)
        if form == "tensor":
            b = self.operand_like(a)
            d = dtypes.promote_types(da, zdt(self.vals[b].arr))
            other = None
        else:
            sd = self.draw(st.sampled_from(["same", "int", "float", "bool"]))
            if sd == "same":
                sd = "bool" if da.kind == "b" else "int" if da.is_int else "float"
            if sd == "bool":
                other = self.draw(st.booleans())
            elif sd == "int":
                other = int(self.scalar(da if da.is_int else dtypes.int16))
            else:
                other = float(self.scalar(da if da.is_float else dtypes.float64))
            d = dtypes.scalar_dtype(other, da)
            b = None
        ins = [self.vals[a]] + ([self.vals[b]] if b is not None else [])
        if op == "sub" and d.kind == "b":
            return False
        if op in ("and", "or", "xor") and d.is_float:
            return False
        if op == "mod" and d.is_float and self.avoid("float_mod"):
            return False
        if op == "floordiv" and d.is_float and self.avoid("float_floordiv"):
            return False
        if op == "pow":
            if d.kind == "b":
                return False
            if d.is_int:  # integer powers: a non-negative Python int exponent (NumPy rejects negative ones)
                if form != "scalar":
                    return False
                other = self.draw(st.integers(0, 3))
        discontinuous = op in COMPARE or op in ("floordiv", "mod") or op.startswith("logical_")
        if discontinuous and any(zdt(v.arr).is_float and not v.exact for v in ins):
            return False
        if self.avoid("narrow_overflow") and (op in COMPARE or op in ("floordiv", "mod")) and any(
                "narrow_arith" in self.tags[i] for i in ([a] + ([b] if b is not None else []))):
            return False
        exact = op not in ("pow",)
        kind = {"add": "add", "sub": "add", "mul": "mul", "truediv": "div"}.get(op, "default")
        if op in ("maximum", "minimum"):
            kind = "move"
            tags_extra = {"zsign"}
        else:
            tags_extra = set()
        tags = {"narrow_arith"} if d.is_int and d.itemsize < 4 and op in ("add", "sub", "mul", "pow") else set()
        if b is not None and self.vals[a].arr.shape != self.vals[b].arr.shape:
            tags.add("expanded")
        tags |= tags_extra
        if op in ("truediv", "floordiv", "mod", "pow") and any("zsign" in self.tags[i] for i in
                                                              ([a] + ([b] if b is not None else []))):
            exact = False  # 1 / (+-0.0): the sign of an infinity would follow an unspecified zero sign
        if op.startswith("logical_") or op in ("maximum", "minimum"):
            name = op
            if b is not None:
                tmpl = f"{{0}}.{name}({{1}})"
                return self._emit_bin(tmpl, (a, b), lambda x, y: binary_ref(op, x, y), kind, exact, op, tags)
            if form == "rscalar" and op.startswith("logical_"):
                form = "scalar"
            if op.startswith("logical_") and isinstance(other, int) and not isinstance(other, bool) and (
                    other > 2 ** 63 - 1 and self.avoid("logical_bigint")):
                return False
            if form == "rscalar":
                return False  # a 0-d tensor from a Python scalar is not weak; covered by the scalar form
            tmpl = f"{{0}}.{name}({other!r})"
            return self._emit_bin(tmpl, (a,), lambda x: binary_ref(op, x, other), kind, exact, op, tags)
        sym = BIN_SRC[op]
        if b is not None:
            tmpl = f"({{0}} {sym} {{1}})"
            return self._emit_bin(tmpl, (a, b), lambda x, y: binary_ref(op, x, y), kind, exact, op, tags)
        if form == "rscalar" and op != "pow" or (op == "pow" and d.is_float and form == "rscalar"):
            tmpl = f"(({other!r}) {sym} {{0}})"
            return self._emit_bin(tmpl, (a,), lambda x: binary_ref(op, other, x), kind, exact, op, tags)
        tmpl = f"({{0}} {sym} ({other!r}))"
        return self._emit_bin(tmpl, (a,), lambda x: binary_ref(op, x, other), kind, exact, op, tags)

    def _emit_bin(self, tmpl: str, args: tuple[int, ...], ref: Callable, kind: str, exact: bool, op: str,
                  tags: set[str]) -> bool:
        if kind == "move":
            self.emit(tmpl, args, ref, kind="default" if len(args) < 2 else "move", exact=exact, ops=(op,),
                      tags=tags, scale_fn=(lambda *s: np.maximum(*s) if len(s) > 1 else s[0]))
        else:
            self.emit(tmpl, args, ref, kind=kind, exact=exact, ops=(op,), tags=tags)
        return True

    def _shift(self, op: str, a: int, form: str) -> bool:
        da = zdt(self.vals[a].arr)
        if not da.is_int:
            return False
        sym = BIN_SRC[op]
        if form != "tensor":
            k = self.draw(st.integers(0, da.bits - 1))
            self.emit(f"({{0}} {sym} {k})", (a,), lambda x: binary_ref(op, x, k), ops=(op,),
                      tags={"narrow_arith"} if da.itemsize < 4 and op == "shl" else set())
            return True
        b = self.operand_like(a, int_only=True)
        db = zdt(self.vals[b].arr)
        d = dtypes.promote_types(da, db)
        if not d.is_int:
            return False
        mask = d.bits - 1
        m = self.emit(f"({{0}} & {mask})", (b,), lambda y: binary_ref("and", y, mask), ops=("and",))
        tags = {"narrow_arith"} if d.itemsize < 4 and op == "shl" else set()
        self.emit(f"({{0}} {sym} {{1}})", (a, m), lambda x, y: binary_ref(op, x, y), ops=(op,), tags=tags)
        return True

    def g_unary(self) -> bool:
        op = self.draw(st.sampled_from(self.UNARY_OPS))
        a = self.pick()
        v = self.vals[a]
        d = zdt(v.arr)
        if op == "neg" and d.kind == "b":
            return False
        if op == "neg" and self.avoid("neg_const") and "const" in self.tags[a]:
            return False
        if op == "invert" and d.is_float:
            return False
        if op == "square" and not d.is_float:
            return False
        if op in ("floor", "ceil", "round", "trunc", "sign", "isnan", "isinf", "isfinite", "logical_not") and (
                d.is_float and not v.exact):
            return False
        exact = op in ("neg", "abs", "invert", "logical_not", "relu", "floor", "ceil", "round", "trunc", "sign",
                       "isnan", "isinf", "isfinite", "square") or op in UNARY_EXACT_FLOAT
        tmpl = {"neg": "(-{0})", "abs": "abs({0})", "invert": "(~{0})", "square": "({0} ** 2)"}.get(op, f"{{0}}.{op}()")
        kind = {"neg": "neg", "abs": "neg", "square": "mul", "relu": "move", "log": "singular", "log2": "singular",
                "sqrt": "singular", "rsqrt": "singular", "reciprocal": "singular"}.get(op, "unary")
        tags = {"narrow_arith"} if d.is_int and d.itemsize < 4 and op in ("neg", "abs") else set()
        if op == "relu":
            self.emit(tmpl, (a,), lambda x: unary_ref(op, x), kind="default", exact=exact, ops=(op,),
                      tags=tags | {"zsign"},
                      scale_fn=lambda s: s)
        else:
            self.emit(tmpl, (a,), lambda x: unary_ref(op, x), kind=kind, exact=exact, ops=(op,), tags=tags)
        return True

    def g_cast(self) -> bool:
        a = self.pick()
        v = self.vals[a]
        s = zdt(v.arr)
        d = self.dtype()
        if s.is_float and not d.is_float:
            if not v.exact:
                return False
            if self.avoid("float_int_cast") and d.is_int:
                lo, hi = dtypes.int_range(d)
                x = v.arr.astype(np.float64)
                if not np.all(np.isfinite(x) & (np.trunc(x) >= lo) & (np.trunc(x) <= hi)):
                    return False
        self.emit(f"{{0}}.cast(zyx.{d.name})", (a,), lambda x: cast_ref(x, d), kind="neg", ops=("cast",))
        return True

    # ---- movement ------------------------------------------------------------------------------------------
    def _move(self, tmpl: str, a: int, ref: Callable, op: str, tags: set[str] | None = None) -> bool:
        self.emit(tmpl, (a,), ref, kind="move", ops=(op,), tags=tags)
        return True

    def g_reshape(self) -> bool:
        a = self.pick()
        x = self.vals[a].arr
        k = self.draw(st.integers(0, 4))
        if x.size != 1 and k == 0:
            k = 1
        shape = _factorize(x.size, k, self.draw)
        if x.size and k and self.draw(st.integers(0, 3)) == 0:
            shape = tuple(-1 if i == 0 else s for i, s in enumerate(shape))
        return self._move(f"{{0}}.reshape({shape!r})", a, lambda y: y.reshape(shape), "reshape")

    def g_permute(self) -> bool:
        a = self.pick(lambda v: v.arr.ndim >= 2)
        if a is None:
            return False
        nd = self.vals[a].arr.ndim
        if self.draw(st.booleans()):
            perm = tuple(self.draw(st.permutations(range(nd))))
            return self._move(f"{{0}}.permute({perm!r})", a, lambda y: np.transpose(y, perm), "permute")
        i, j = self.draw(st.integers(-nd, nd - 1)), self.draw(st.integers(-nd, nd - 1))
        return self._move(f"{{0}}.transpose({i}, {j})", a, lambda y: np.swapaxes(y, i, j), "transpose")

    def g_expand(self) -> bool:
        a = self.pick(lambda v: v.arr.ndim < 4)
        if a is None:
            return False
        sh = self.vals[a].arr.shape
        lead = tuple(self.draw(st.integers(1, 3)) for _ in range(self.draw(st.integers(0, 4 - len(sh)))))
        new = tuple(self.draw(st.integers(1, 4)) if s == 1 and self.draw(st.booleans()) else s for s in sh)
        full = lead + new
        if math.prod(full) > MAX_NUMEL * 2:
            return False
        if self.draw(st.booleans()):
            arg = lead + tuple(-1 if s == n and self.draw(st.booleans()) else n for s, n in zip(sh, new))
            tmpl = f"{{0}}.expand({arg!r})"
        else:
            tmpl = f"{{0}}.broadcast_to({full!r})"
        return self._move(tmpl, a, lambda y: np.broadcast_to(y, full).copy(), "expand", {"expanded"})

    def g_pad(self) -> bool:
        a = self.pick(lambda v: v.arr.ndim >= 1)
        if a is None:
            return False
        x = self.vals[a].arr
        pads = tuple((self.draw(st.integers(-1 if s >= 2 else 0, 2)), self.draw(st.integers(-1 if s >= 3 else 0, 2)))
                     for s in x.shape)
        d = zdt(x)
        value = self.scalar(d)
        if d.is_int:
            value = int(value)
        if math.prod(s + max(p, 0) + max(q, 0) for s, (p, q) in zip(x.shape, pads)) > MAX_NUMEL * 2:
            return False
        return self._move(f"{{0}}.pad({pads!r}, value={value!r})", a, lambda y: pad_ref(y, pads, value), "pad")

    def _slice(self, n: int) -> slice:
        step = self.draw(st.sampled_from([None, 1, 2, -1, -2, 3, -3]))
        start = self.draw(st.one_of(st.none(), st.integers(-n - 1, n + 1)))
        stop = self.draw(st.one_of(st.none(), st.integers(-n - 1, n + 1)))
        return slice(start, stop, step)

    def _basic_index(self, n: int, subscript: bool) -> tuple[Any, str]:
        """An int (a quarter of the time, on a non-empty axis) or a slice of an axis of size ``n``, and its source:
        subscript syntax, or a ``slice(...)`` call (inside a tuple display)."""
        if n and self.draw(st.integers(0, 3)) == 0:
            i = self.draw(st.integers(-n, n - 1))
            return i, str(i)
        sl = self._slice(n)
        if subscript:
            return sl, ":".join("" if p is None else str(p) for p in (sl.start, sl.stop, sl.step))
        return sl, f"slice({sl.start}, {sl.stop}, {sl.step})"

    def g_getitem(self) -> bool:
        a = self.pick(lambda v: v.arr.ndim >= 1)
        if a is None:
            return False
        x = self.vals[a].arr
        nd = x.ndim
        gaxis = self.draw(st.integers(0, nd - 1)) if self.draw(st.integers(0, 2)) == 0 else None
        if gaxis is not None and x.shape[gaxis] == 0:
            gaxis = None
        index: list[Any] = []
        src: list[str] = []
        for ax in range(nd):
            if self.draw(st.integers(0, 5)) == 0:
                index.append(None)
                src.append("None")
            n = x.shape[ax]
            if ax == gaxis:
                index.append(TensorIndex())
                src.append("{1}")
            else:
                ix, text = self._basic_index(n, subscript=True)
                index.append(ix)
                src.append(text)
        if gaxis is None and nd >= 2 and self.draw(st.integers(0, 3)) == 0:  # trailing axes via Ellipsis
            cut = self.draw(st.integers(1, nd))
            index, src = index[:cut] + [Ellipsis], src[:cut] + ["..."]
            while any(ix is None for ix in index[cut:]):
                break
        tmpl = "{0}[" + ", ".join(src) + ("," if len(src) == 1 else "") + "]"
        tindex = tuple(index)
        if gaxis is None:
            return self._move(tmpl, a, lambda y: getitem_ref(y, tindex, None, None), "slice")
        n = x.shape[gaxis]
        lazy = self.draw(st.integers(0, 2)) == 0
        # a lazily computed index: made by an op of two or more tensors, which zyx cannot fold into a realized
        # input (a no-op like x.repeat_interleave(1) returns the host data itself, which raises IndexError)
        cands = [i for i in reversed(range(len(self.vals))) if len(self.instrs[i].args) >= 2
                 and zdt(self.vals[i].arr).is_int and zdt(self.vals[i].arr) is not dtypes.uint64
                 and 0 < self.vals[i].arr.size <= 16]
        j = self.draw(st.sampled_from(cands)) if lazy and cands else None
        if j is None:  # host data: NumPy's rule, indices in [-n, n)
            ishape = tuple(self.draw(st.integers(1, 4)) for _ in range(self.draw(st.integers(0, 2))))
            idt = self.draw(st.sampled_from([dtypes.int64, dtypes.int32, dtypes.int8, dtypes.uint8, dtypes.int16]))
            lo = -n if idt.kind == "i" else 0
            arr = self.draw(hnp.arrays(idt.np_dtype, ishape, elements=st.integers(max(lo, -128), min(n - 1, 127))))
            j = self.emit("", (), lambda: arr, data=arr, ops=("input",))
        self.emit(tmpl, (a, j), lambda y, i: getitem_ref(y, tindex, gaxis, i), kind="move", data_args=(0,),
                  ops=("gather",))
        return True

    def g_take_along(self) -> bool:
        """``gather`` (PyTorch: the index no larger than x off the axis) or ``take_along_dim`` (broadcasting), by
        uploaded indices in [-n, n) read as they are or through a flip (a lazy index: no range check)."""
        a = self.pick(lambda v: v.arr.ndim >= 1 and v.arr.size > 0)
        if a is None:
            return False
        x = self.vals[a].arr
        nd = x.ndim
        ax = self.draw(st.integers(0, nd - 1))
        n = x.shape[ax]
        along = self.draw(st.booleans())
        ishape = tuple(self.draw(st.integers(1, 4)) if d == ax else
                       (self.draw(st.sampled_from([1, s])) if along else self.draw(st.integers(min(s, 1), s)))
                       for d, s in enumerate(x.shape))
        idt = self.draw(st.sampled_from([dtypes.int64, dtypes.int32, dtypes.int16, dtypes.uint8]))
        lo = -n if idt.kind == "i" else 0
        arr = self.draw(hnp.arrays(idt.np_dtype, ishape, elements=st.integers(max(lo, -128), min(n - 1, 127))))
        j = self.emit("", (), lambda: arr, data=arr, ops=("input",))
        flip = self.draw(st.booleans())
        index = f"{{1}}.flip({ax})" if flip else "{1}"
        axis = ax - nd if self.draw(st.booleans()) else ax
        tmpl = f"{{0}}.take_along_dim({index}, {axis})" if along else f"{{0}}.gather({axis}, {index})"

        def ref(y: np.ndarray, i: np.ndarray) -> np.ndarray:
            i = (np.flip(i, ax) if flip else i).astype(np.int64) % n
            if not along:  # gather: x cut to the index's sizes off the axis
                y = y[tuple(slice(None) if d == ax else slice(0, s) for d, s in enumerate(i.shape))]
            shape = np.broadcast_shapes(tuple(1 if d == ax else s for d, s in enumerate(y.shape)),
                                        tuple(1 if d == ax else s for d, s in enumerate(i.shape)))
            y = np.broadcast_to(y, shape[:ax] + (n,) + shape[ax + 1:])
            return np.take_along_axis(y, np.broadcast_to(i, shape[:ax] + (i.shape[ax],) + shape[ax + 1:]), ax)

        self.emit(tmpl, (a, j), ref, kind="move", data_args=(0,), ops=("gather",))
        return True

    def g_setitem(self) -> bool:
        """``x[index] = v`` on a detached copy of a value (the program's ``x`` stays as it was): slices, ints and
        at most one 1-D host index (repeats too), ``v`` a new input of any dtype broadcast to ``x[index]``."""
        a = self.pick(lambda v: v.arr.ndim >= 1)
        if a is None:
            return False
        x = self.vals[a].arr
        taxis = self.draw(st.integers(0, x.ndim - 1)) if self.draw(st.integers(0, 2)) == 0 else None
        index: list[Any] = []
        src: list[str] = []
        for ax, n in enumerate(x.shape):
            if ax == taxis and n:
                arr = np.array(self.draw(st.lists(st.integers(-n, n - 1), min_size=0, max_size=4)), np.int64)
                index.append(arr)
                src.append(f"np.array({arr.tolist()!r}, np.int64)")
            else:
                ix, text = self._basic_index(n, subscript=False)
                index.append(ix)
                src.append(text)
        tindex = tuple(index)
        target = x[tindex].shape
        drop = self.draw(st.integers(0, len(target)))
        vshape = tuple(1 if self.draw(st.integers(0, 3)) == 0 else s for s in target[drop:])
        j = self.new_input(vshape, self.dtype())
        d = zdt(x)

        def ref(y: np.ndarray, v: np.ndarray) -> np.ndarray:
            out = y.copy()
            out[tindex] = cast_ref(v, d)
            return out

        tmpl = "(_t := {0}.detach(), _t.__setitem__((" + ", ".join(src) + ",), {1}), _t)[2]"
        self.emit(tmpl, (a, j), ref, kind="move", data_args=(0, 1), ops=("setitem",))
        return True

    def g_flip(self) -> bool:
        a = self.pick()
        nd = self.vals[a].arr.ndim
        form = self.draw(st.integers(0, 2))
        if form == 0 or nd == 0:
            return self._move("{0}.flip()", a, lambda y: np.flip(y).copy(), "flip")
        if form == 1:
            ax = self.draw(st.integers(-nd, nd - 1))
            return self._move(f"{{0}}.flip({ax})", a, lambda y: np.flip(y, ax).copy(), "flip")
        axes = tuple(sorted(set(self.draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd)))))
        return self._move(f"{{0}}.flip({axes!r})", a, lambda y: np.flip(y, axes).copy(), "flip")

    def g_squeeze(self) -> bool:
        a = self.pick()
        sh = self.vals[a].arr.shape
        nd = len(sh)
        if self.draw(st.booleans()) or nd >= 4:
            ones = [i for i, s in enumerate(sh) if s == 1]
            if ones and self.draw(st.booleans()):
                ax = self.draw(st.sampled_from(ones)) - (nd if self.draw(st.booleans()) else 0)
                return self._move(f"{{0}}.squeeze({ax})", a, lambda y: np.squeeze(y, ax), "squeeze")
            return self._move("{0}.squeeze()", a, lambda y: np.squeeze(y), "squeeze")
        ax = self.draw(st.integers(-nd - 1, nd))
        return self._move(f"{{0}}.unsqueeze({ax})", a, lambda y: np.expand_dims(y, ax), "unsqueeze")

    def g_repeat(self) -> bool:
        a = self.pick(lambda v: v.arr.ndim < 4)
        if a is None:
            return False
        x = self.vals[a].arr
        if self.draw(st.booleans()):
            reps = tuple(self.draw(st.integers(0 if i else 1, 3)) for i in
                         range(max(x.ndim, 1) + self.draw(st.integers(0, 1))))
            if math.prod(reps) * max(x.size, 1) > MAX_NUMEL * 2:
                return False
            return self._move(f"{{0}}.repeat{reps!r}" if len(reps) > 1 else f"{{0}}.repeat({reps[0]})", a,
                              lambda y: np.tile(y, reps), "repeat", {"expanded"})
        r = self.draw(st.integers(1, 3))
        ax = None if x.ndim == 0 or self.draw(st.booleans()) else self.draw(st.integers(-x.ndim, x.ndim - 1))
        if r * max(x.size, 1) > MAX_NUMEL * 2:
            return False
        return self._move(f"{{0}}.repeat_interleave({r}, axis={ax})", a, lambda y: np.repeat(y, r, axis=ax),
                          "repeat_interleave", {"expanded"})

    def g_flatten(self) -> bool:
        a = self.pick()
        nd = self.vals[a].arr.ndim
        if nd == 0:
            return self._move("{0}.flatten()", a, lambda y: y.reshape(1), "flatten")
        s = self.draw(st.integers(0, nd - 1))
        e = self.draw(st.integers(s, nd - 1))
        sh = self.vals[a].arr.shape
        new = sh[:s] + (math.prod(sh[s:e + 1]),) + sh[e + 1:]
        return self._move(f"{{0}}.flatten({s}, {e})", a, lambda y: y.reshape(new), "flatten")

    def g_split(self) -> bool:
        a = self.pick(lambda v: v.arr.ndim >= 1)
        if a is None:
            return False
        x = self.vals[a].arr
        ax = self.draw(st.integers(0, x.ndim - 1))
        n = x.shape[ax]
        form = self.draw(st.integers(0, 2))
        if form == 0 and n:
            c = self.draw(st.integers(1, 4))
            sizes = split_sizes(n, max(1, -(-n // c)))
            tmpl = f"{{0}}.chunk({c}, {ax})"
        elif form == 1 and n:
            cut = self.draw(st.integers(0, n))
            sizes = [cut, n - cut]
            tmpl = f"{{0}}.split({sizes!r}, {ax})"
        else:
            size = self.draw(st.integers(1, max(n, 1)))
            sizes = split_sizes(n, size)
            tmpl = f"{{0}}.split({size}, {ax})"
        k = self.draw(st.integers(0, len(sizes) - 1))
        return self._move(tmpl + f"[{k}]", a, lambda y: split_ref(y, sizes, ax, k), "split")

    def g_cat(self) -> bool:
        stack = self.draw(st.booleans())
        a = self.pick(lambda v: v.arr.ndim >= 1 or stack)
        if a is None:
            return False
        x = self.vals[a].arr
        nd = x.ndim
        ax = self.draw(st.integers(-(nd + 1) if stack else -nd, nd if stack else nd - 1))
        parts = [a]
        for _ in range(self.draw(st.integers(1, 2))):
            c = self.draw(st.integers(0, 2))
            if c == 0:
                parts.append(a)
            elif stack or c == 1:
                parts.append(self.operand_like(a, same_shape=True))
            else:
                shape = list(x.shape)
                shape[ax % nd] = self.draw(st.integers(0, 3))
                parts.append(self.new_input(tuple(shape), self.dtype(zdt(x))))
        ds = [zdt(self.vals[p].arr) for p in parts]
        if self.avoid("cat_negzero") and any(d.is_float for d in ds):
            return False
        names = ", ".join(f"{{{i}}}" for i in range(len(parts)))
        fn = "stack" if stack else "cat"
        tmpl = f"zyx.{fn}([{names}], {ax})"
        self.emit(tmpl, tuple(parts), lambda *xs: cat_ref(xs, ax, stack), kind="move", ops=(fn,))
        return True

    def g_where(self) -> bool:
        a = self.pick()
        sh = self.vals[a].arr.shape
        c = self.pick(lambda v: v.arr.dtype == np.bool_ and _bcast(v.arr.shape, sh) is not None)
        if c is None or self.draw(st.booleans()):
            c = self.operand_like(a)
            if self.vals[c].arr.dtype != np.bool_:
                cv = self.vals[c]
                if zdt(cv.arr).is_float and not cv.exact:
                    return False
                c = self.emit("{0}.bool()", (c,), lambda y: cast_ref(y, dtypes.bool_), ops=("cast",))
        form = self.draw(st.integers(0, 2))
        da = zdt(self.vals[a].arr)
        if form == 0:
            b = self.operand_like(a)
            if _bcast(self.vals[c].arr.shape, sh, self.vals[b].arr.shape) is None:
                return False
            tmpl = "zyx.where({0}, {1}, {2})" if self.draw(st.booleans()) else "{0}.where({1}, {2})"
            self.emit(tmpl, (c, a, b), lambda cc, x, y: where_ref(cc, x, y), kind="move", data_args=(1, 2),
                      ops=("where",))
            return True
        sd = self.draw(st.sampled_from([da, dtypes.int64, dtypes.float32, dtypes.bool_]))
        s = self.scalar(da if sd is da else sd)
        s = int(s) if sd.is_int else (float(s) if sd.is_float else bool(s))
        if sd.is_int and da.is_int:
            lo, hi = dtypes.int_range(da)
            if not lo <= s <= hi:
                return False
        if form == 1:
            self.emit(f"zyx.where({{0}}, {{1}}, {s!r})", (c, a), lambda cc, x: where_ref(cc, x, s), kind="move",
                      data_args=(1,), ops=("where",))
        else:
            self.emit(f"zyx.where({{0}}, {s!r}, {{1}})", (c, a), lambda cc, x: where_ref(cc, s, x), kind="move",
                      data_args=(1,), ops=("where",))
        return True

    # ---- reductions ----------------------------------------------------------------------------------------
    def _axis_arg(self, nd: int) -> Any:
        if nd == 0:
            return self.draw(st.sampled_from([None, ()]))
        form = self.draw(st.integers(0, 2))
        if form == 0:
            return None
        if form == 1:
            return self.draw(st.integers(-nd, nd - 1))
        axes = self.draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True))
        return tuple(a - nd if self.draw(st.booleans()) else a for a in axes)

    def g_reduce(self) -> bool:
        op = self.draw(st.sampled_from(self.REDUCE_OPS))
        a = self.pick()
        v = self.vals[a]
        x = v.arr
        d = zdt(x)
        nd = x.ndim
        if self.avoid("expand_reduce") and "expanded" in self.tags[a]:
            return False
        if op in ("max", "min", "argmax", "argmin", "any", "all") and d.is_float and not v.exact and op not in (
                "max", "min"):
            return False
        keep = self.draw(st.booleans())
        kw = self.draw(st.sampled_from(["keepdim", "keepdims"]))  # PyTorch's and NumPy's spelling
        if op in ("argmax", "argmin"):
            ax = None if nd == 0 or self.draw(st.booleans()) else self.draw(st.integers(-nd, nd - 1))
            if x.size == 0:
                return False
            self.emit(f"{{0}}.{op}({ax}, {kw}={keep})", (a,), lambda y: arg_ref(op, y, ax, keep), ops=(op,))
            return True
        if op in ("cumsum", "cumprod"):
            ax = self.draw(st.integers(-max(nd, 1), max(nd, 1) - 1))
            sfn = (lambda s: _cumprod_scale(s, d, ax)) if op == "cumprod" and d.is_float else \
                (lambda s: cumsum_ref(s, ax, op))
            self.emit(f"{{0}}.{op}({ax})", (a,), lambda y: cumsum_ref(y, ax, op), exact=not d.is_float, ops=(op,),
                      scale_fn=sfn)
            return True
        if op in ("softmax", "log_softmax"):
            if nd == 0:
                return False
            ax = self.draw(st.integers(-nd, nd - 1))
            if x.shape[ax] == 0:
                return False  # max of an empty axis: an error in zyx and NumPy
            self.emit(f"{{0}}.{op}({ax})", (a,), lambda y: softmax_ref(op, y, ax), exact=False, ops=(op,))
            return True
        axis = self._axis_arg(nd)
        axes = _axes(axis, nd)
        if op in ("max", "min", "logsumexp") and any(x.shape[i] == 0 for i in axes):
            return False
        tmpl = f"{{0}}.{op}({axis!r}, {kw}={keep})"
        exact = op in ("max", "min", "any", "all") or (op in ("sum", "prod") and not d.is_float)
        sfn = {"sum": lambda s: reduce_ref("sum", s, axis, keep),
               "prod": lambda s: _prod_scale(s, d, axis, keep) if d.is_float else reduce_ref("prod", s, axis, keep),
               "mean": lambda s: reduce_ref("mean", s, axis, keep), "max": lambda s: reduce_ref("max", s, axis, keep),
               "min": lambda s: reduce_ref("max", s, axis, keep),
               # var = mean((x - mean)^2) cancels: its error is relative to mean(x^2), not to the result (found
               # by the fuzzer: float32 var of 32 equal values 5.7e7 is 576 = (3 ulp of the mean)^2, not 0)
               "var": lambda s: _square_scale(s, _var_dtype(x), axis, keep, std=False),
               "std": lambda s: _square_scale(s, _var_dtype(x), axis, keep, std=True)}.get(op)
        ops = (op, "product") if op in ("mean", "var") else (op,)  # s * (1 / n): an FMA candidate
        # max/min of +0.0 and -0.0 may return either (IEEE maxNum/minNum; NumPy's SIMD loops too)
        zs = {"zsign"} if op in ("max", "min") else set()
        self.emit(tmpl, (a,), lambda y: reduce_ref(op, y, axis, keep), exact=exact, ops=ops, scale_fn=sfn, tags=zs)
        return True

    def g_matmul(self) -> bool:
        a = self.pick(lambda v: v.arr.ndim >= 1)
        if a is None:
            return False
        va = self.vals[a]
        sh = va.arr.shape
        da = zdt(va.arr)
        k = sh[-1]
        c = self.draw(st.integers(0, 3))
        if c == 0 and va.arr.ndim >= 2:
            b = self.emit("{0}.mT", (a,), lambda y: np.swapaxes(y, -1, -2), kind="move", ops=("transpose",))
        else:
            n = self.draw(st.integers(1, 4))
            if self.draw(st.integers(0, 3)) == 0:
                bshape: tuple[int, ...] = (k,)
            else:
                batch = tuple(self.draw(st.sampled_from([1, s])) for s in sh[:-2])
                if batch and self.draw(st.booleans()):
                    batch = batch[self.draw(st.integers(0, len(batch))):]
                if not sh[:-2] and self.draw(st.integers(0, 3)) == 0:
                    batch = (self.draw(st.integers(1, 3)),)
                bshape = batch + (k, n)
            b = self.new_input(bshape, self.dtype(da))
            if len(bshape) >= 2 and self.draw(st.integers(0, 3)) == 0:  # an explicitly expanded operand
                nb = tuple(self.draw(st.integers(1, 3)) for _ in range(self.draw(st.integers(0, 1)))) + bshape
                if _bcast(sh[:-2], nb[:-2]) is not None:
                    b = self.emit(f"{{0}}.expand({nb!r})", (b,), lambda y: np.broadcast_to(y, nb).copy(),
                                  kind="move", ops=("expand",), tags={"expanded"})
        vb = self.vals[b]
        if vb.arr.ndim >= 2 and _bcast(sh[:-2], vb.arr.shape[:-2]) is None:
            return False
        d = dtypes.promote_types(da, zdt(vb.arr))
        batch_bcast = va.arr.ndim >= 2 and vb.arr.ndim >= 2 and sh[:-2] != vb.arr.shape[:-2]
        expanded = batch_bcast or "expanded" in self.tags[a] | self.tags[b]
        if self.avoid("expand_reduce") and not d.is_float and expanded:
            return False
        tmpl = "({0} @ {1})" if self.draw(st.booleans()) else "zyx.matmul({0}, {1})"
        self.emit(tmpl, (a, b), matmul_ref, exact=not d.is_float, ops=("matmul",),
                  scale_fn=lambda s, t: np.matmul(s, t))
        return True


GENERATORS = {
    "binary": (Builder.g_binary, 7), "unary": (Builder.g_unary, 3), "cast": (Builder.g_cast, 2),
    "reshape": (Builder.g_reshape, 1), "permute": (Builder.g_permute, 1), "expand": (Builder.g_expand, 1),
    "pad": (Builder.g_pad, 1), "getitem": (Builder.g_getitem, 2), "take_along": (Builder.g_take_along, 1),
    "setitem": (Builder.g_setitem, 1), "flip": (Builder.g_flip, 1),
    "squeeze": (Builder.g_squeeze, 1), "repeat": (Builder.g_repeat, 1), "flatten": (Builder.g_flatten, 1),
    "split": (Builder.g_split, 1), "cat": (Builder.g_cat, 1), "where": (Builder.g_where, 1),
    "reduce": (Builder.g_reduce, 4), "matmul": (Builder.g_matmul, 1),
}
_GEN_LIST = [name for name, (_, w) in GENERATORS.items() for _ in range(w)]


@st.composite
def programs(draw: Callable, max_ops: int = 6, builder: type[Builder] = Builder,
             generators: Sequence[str] = tuple(_GEN_LIST)) -> Program:
    """A random program of 1..``max_ops`` instructions (plus the inputs it creates), built by ``builder`` from the
    ``generators`` named (repeated names weigh more)."""
    b = builder(draw)
    b.new_input()
    n_ops = 1
    while n_ops < max_ops and draw(st.integers(0, 7)) != 0:  # shrinks towards fewer ops; about 5 on average
        n_ops += 1
    emitted = 0
    for _ in range(n_ops):
        for _attempt in range(6):
            name = draw(st.sampled_from(generators))
            mark = len(b.vals)
            try:
                # a builder may override a generator, or add its own (named g_<name>)
                ok = getattr(b, GENERATORS[name][0].__name__ if name in GENERATORS else f"g_{name}")()
            except (ValueError, IndexError, TypeError, AttributeError) as e:  # a case the generator missed
                if os.environ.get("ZYX_FUZZ_STRICT_GEN"):
                    raise
                del b.instrs[mark:], b.vals[mark:], b.tags[mark:]
                ok = False
                _ = e
            if ok:
                emitted += 1
                break
    if not emitted:
        b.emit("{0}.cast(zyx.float32)", (len(b.vals) - 1,), lambda y: cast_ref(y, dtypes.float32), kind="neg",
               ops=("cast",))
    non_inputs = [i for i, v in enumerate(b.vals) if not v.is_input]
    extra = [i for i in non_inputs[:-1] if draw(st.integers(0, 4)) == 0]
    if "view_output" in AVOID:
        extra = [i for i in extra if b.instrs[i].kind != "move"]
    if "multi_output" in AVOID:
        extra = []
    outputs = [non_inputs[-1]] + extra
    ops = set().union(*(ins.ops for ins in b.instrs))
    return Program(b.instrs, b.vals, sorted(outputs), ops)

"""Data types and promotion.

Promotion follows NumPy 2 (NEP 50) between tensors, with Python scalars "weak" (they adopt the tensor's
kind when they fit in it), and one deliberate difference shared with PyTorch: wherever NumPy would invent
float64 from non-float operands (int tensor with a float scalar, true division or a float-only function
of integers, mean of integers) zyx uses the default float dtype, ``float32``. bfloat16 promotes with
float16 to float32 and with any wider float to that float.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np


@dataclass(frozen=True, eq=False)
class DType:
    name: str
    itemsize: int
    kind: str  # "b" bool, "i" signed, "u" unsigned, "f" float
    np_dtype: np.dtype
    c_type: str
    priority: int

    def __repr__(self) -> str:
        return f"zyx.{self.name}"

    def __reduce__(self) -> str:
        return self.name

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.kind in "iu"

    @property
    def is_unsigned(self) -> bool:
        return self.kind == "u"

    @property
    def bits(self) -> int:
        return 8 * self.itemsize


def _d(name: str, itemsize: int, kind: str, npd, c_type: str, priority: int) -> DType:
    return DType(name, itemsize, kind, np.dtype(npd), c_type, priority)


bool_ = _d("bool", 1, "b", np.bool_, "_Bool", 0)
int8 = _d("int8", 1, "i", np.int8, "signed char", 1)
uint8 = _d("uint8", 1, "u", np.uint8, "unsigned char", 2)
int16 = _d("int16", 2, "i", np.int16, "short", 3)
uint16 = _d("uint16", 2, "u", np.uint16, "unsigned short", 4)
int32 = _d("int32", 4, "i", np.int32, "int", 5)
uint32 = _d("uint32", 4, "u", np.uint32, "unsigned int", 6)
int64 = _d("int64", 8, "i", np.int64, "long long", 7)
uint64 = _d("uint64", 8, "u", np.uint64, "unsigned long long", 8)
float16 = _d("float16", 2, "f", np.float16, "half", 9)
bfloat16 = _d("bfloat16", 2, "f", ml_dtypes.bfloat16, "bfloat16", 10)
float32 = _d("float32", 4, "f", np.float32, "float", 11)
float64 = _d("float64", 8, "f", np.float64, "double", 12)

ALL: tuple[DType, ...] = (bool_, int8, uint8, int16, uint16, int32, uint32, int64, uint64,
                          float16, bfloat16, float32, float64)
BY_NAME: dict[str, DType] = {d.name: d for d in ALL}
BY_NAME.update({"bool_": bool_, "half": float16, "float": float32, "double": float64, "long": int64,
                "int": int32})
default_float = float32
default_int = int64
_BY_NP: dict[np.dtype, DType] = {np.dtype(d.np_dtype): d for d in ALL}  # NumPy dtype -> zyx dtype


def to_dtype(x) -> DType:
    """Accept a zyx dtype, its name, a NumPy dtype or type, or a Python type."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        if x in BY_NAME:
            return BY_NAME[x]
        raise TypeError(f"unknown dtype {x!r}; zyx dtypes are {', '.join(d.name for d in ALL)}")
    if x is bool:
        return bool_
    if x is int:
        return default_int
    if x is float:
        return default_float
    try:
        npd = x if isinstance(x, np.dtype) else np.dtype(x)
    except TypeError:
        raise TypeError(f"cannot interpret {x!r} as a dtype; zyx dtypes are {', '.join(d.name for d in ALL)}") from None
    d = _BY_NP.get(npd)  # every Tensor made from an array asks (a scan over ALL cost ~2.5 us)
    if d is not None:
        return d
    raise TypeError(f"NumPy dtype {npd} has no zyx equivalent; zyx dtypes are {', '.join(d.name for d in ALL)}")


def as_python(value, d: DType):
    """``value`` as the Python scalar that represents it in dtype ``d`` (bool, int, or float rounded to ``d``)."""
    if d.kind == "b":
        return bool(value)
    if d.is_int:
        return int(value)
    value = float(value)
    if d is float64 or value != value:
        return value
    # the nearest value of the dtype (a weak scalar rounds to it, as in NumPy); only a value beyond float16's
    # largest finite one can overflow, so the error-state switch stays off the common path
    if -65504.0 <= value <= 65504.0:
        return float(d.np_dtype.type(value))
    with np.errstate(over="ignore"):
        return float(d.np_dtype.type(value))


def promote_types(a: DType, b: DType) -> DType:
    """Result dtype of a binary op between two tensors (NumPy rules, plus bfloat16)."""
    if a is b:
        return a
    if a is bfloat16 or b is bfloat16:
        other = b if a is bfloat16 else a
        if other.kind in "biu":
            return bfloat16
        return float32 if other is float16 else other
    r = np.promote_types(a.np_dtype, b.np_dtype)
    if r == np.float64 and not (a is float64 or b is float64) and (a.is_float or b.is_float):
        # int64/uint64 with float32 or float16: NumPy says float64 only because of the integer's range.
        return float64
    return to_dtype(r)


def scalar_dtype(value, other: DType) -> DType:
    """Result dtype of ``tensor(other) op python_scalar(value)`` (weak scalar)."""
    if isinstance(value, bool):
        return other
    if isinstance(value, int):
        return other if other.kind != "b" else default_int
    if isinstance(value, float):
        return other if other.is_float else default_float
    raise TypeError(f"unsupported scalar {value!r} of type {type(value).__name__}")


def min_max(d: DType) -> tuple:
    """Identity elements for max/min reductions of dtype ``d``."""
    if d.is_float:
        return float("-inf"), float("inf")
    if d.kind == "b":
        return False, True
    info = np.iinfo(d.np_dtype)
    return int(info.min), int(info.max)


_INT_RANGE = {d: (int(np.iinfo(d.np_dtype).min), int(np.iinfo(d.np_dtype).max)) for d in ALL if d.is_int}


def int_range(d: DType) -> tuple[int, int]:
    return _INT_RANGE[d]


def wrap(value: int, d: DType) -> int:
    """``value`` reduced modulo 2**bits into the range of integer dtype ``d`` (two's complement wraparound)."""
    lo, hi = _INT_RANGE[d]
    if lo <= value <= hi:
        return value
    return (value - lo) % (hi - lo + 1) + lo


def float_to_int(value: float, d: DType) -> int:
    """A float converted to integer dtype ``d`` as every zyx target computes it (x86-64 semantics; see the
    renderer's ``zyx_f2i_*``): truncation, with NaN, infinities and out-of-range values mapped as the
    hardware does."""
    def via(bits: int, x: float) -> int:
        lo = -(1 << (bits - 1))
        return lo if math.isnan(x) or not lo - 1 < x < -lo else int(x)

    if d is uint64 and value >= 2.0**63:
        return via(64, value - 2.0**63) % (1 << 64) ^ (1 << 63)
    return wrap(via(32 if d.itemsize < 4 or d is int32 else 64, value), d)

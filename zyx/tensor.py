"""``zyx.Tensor``: a lazy n-dimensional array with NumPy broadcasting and PyTorch-like names.

Nothing runs until ``numpy()``, ``tolist()``, ``item()``, ``realize()`` or ``to()`` onto a data-only device.
Bad input (shape mismatch, bad axis, impossible reshape, index out of range, unsupported dtype) raises
``ValueError`` / ``IndexError`` / ``TypeError`` when the op is built, naming the shapes or the axis.

dtype rules are in ``zyx.dtypes`` (NumPy promotion, weak Python scalars, float32 as the default float).
``var``/``std`` default to ``ddof=0`` (NumPy); pass ``correction=1`` for PyTorch's unbiased estimate.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from zyx import autograd as F
from zyx import capture, dtypes
from zyx.backends.registry import canonical_name, registry
from zyx.dtypes import DType
from zyx.graph import ops as g
from zyx.graph import schedule, transfer
from zyx.graph.node import Class
from zyx.graph.node import var as var_class
from zyx.ops import Ops

Scalar = int | float | bool
_new = object.__new__


# ---------------------------------------------------------------------------------------------------------------
# helpers


def _differentiable(dtype: DType) -> bool:
    """True for a float dtype; a clear error for any other (PyTorch's rule: only floats carry gradients)."""
    if not dtype.is_float:
        raise TypeError(f"only floating-point tensors can require gradients, this one is {dtype.name}: "
                        f"cast it first (t.float()) or leave requires_grad off")
    return True


def _device(device: str | None) -> str:
    return registry().default_device() if device is None else canonical_name(device)


def _norm_axis(axis: int, ndim: int, what: str = "axis") -> int:
    if not isinstance(axis, (int, np.integer)) or isinstance(axis, bool):
        raise TypeError(f"{what} must be an int, got {axis!r}")
    n = max(ndim, 1) if what != "insert" else ndim + 1
    if not -n <= axis < n:
        raise ValueError(f"{what} {axis} is out of range for a tensor with {ndim} dimension(s)")
    return int(axis) % n


def _norm_axes(axis, ndim: int) -> tuple[int, ...]:
    if type(axis) is int and -ndim <= axis < ndim:  # the common case, checked
        return (axis % ndim,)
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (list, tuple)):
        out = tuple(_norm_axis(a, ndim) for a in axis)
        if len(set(out)) != len(out):
            raise ValueError(f"repeated axis in {tuple(axis)}")
        return out
    if ndim == 0 and axis in (0, -1):
        return ()
    return (_norm_axis(axis, ndim),)


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    if len(shapes) == 2:  # hot path (every binary op of two tensors)
        a, b = shapes
        if a == b:
            return tuple(a)
        la, lb = len(a), len(b)
        if la != lb:
            a, b = (1,) * (lb - la) + tuple(a), (1,) * (la - lb) + tuple(b)
        out = []
        for x, y in zip(a, b):
            if x == y or y == 1:
                out.append(x)
            elif x == 1:
                out.append(y)
            else:
                return _broadcast_general(shapes)
        return tuple(out)
    return _broadcast_general(shapes)


def _broadcast_general(shapes) -> tuple[int, ...]:
    """Broadcast any number of shapes; raises naming the shapes and the first axis that disagrees."""
    nd = max(len(s) for s in shapes)
    out = []
    for i in range(nd):
        dims = {s[len(s) - nd + i] for s in shapes if len(s) - nd + i >= 0} - {1}
        if len(dims) > 1:
            raise ValueError(f"shapes {' and '.join(str(tuple(s)) for s in shapes)} cannot be broadcast together "
                             f"(axis {i - nd} has sizes {sorted(dims)})")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _np_from(data, dtype: DType | None) -> np.ndarray:
    if isinstance(data, np.ndarray):
        arr = data
    elif isinstance(data, (bool, int, float, list, tuple, np.generic)):
        try:
            arr = np.asarray(data)
        except ValueError as e:
            raise TypeError(f"cannot make a Tensor from {type(data).__name__} with ragged or non-numeric "
                            f"elements ({e})") from None
        if dtype is None:
            if arr.dtype.kind == "f" and not isinstance(data, np.generic):
                arr = arr.astype(np.float32)
            elif arr.dtype.kind == "i" and not isinstance(data, np.generic):
                arr = arr.astype(np.int64)
    else:
        try:
            arr = np.asarray(data)
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"cannot make a Tensor from {type(data).__name__}") from e
    if arr.dtype == object:
        raise TypeError(f"cannot make a Tensor from {type(data).__name__} with ragged or non-numeric elements")
    if dtype is not None:
        arr = arr.astype(dtype.np_dtype)
    else:
        dtypes.to_dtype(arr.dtype)  # raises TypeError for dtypes zyx lacks
    return arr if arr.flags.c_contiguous else np.array(arr, order="C")


# ---------------------------------------------------------------------------------------------------------------


class Tensor:
    """A lazy array. ``Tensor(data, dtype=None, device=None, requires_grad=False)``."""

    __slots__ = ("cls", "requires_grad", "grad", "_ctx", "__weakref__")
    __array_priority__ = 1000

    def __init__(self, data, dtype=None, device: str | None = None, requires_grad: bool = False) -> None:
        d = dtypes.to_dtype(dtype) if dtype is not None else None
        if isinstance(data, Tensor):
            t = data.to(device) if device is not None else data
            t = t.cast(d) if d is not None else t
            self.cls = t.cls
        else:
            arr = _np_from(data, d)
            if requires_grad:
                _differentiable(dtypes.to_dtype(arr.dtype))  # raises before the upload
            self.cls = transfer.upload(arr, _device(device))
        self.requires_grad = bool(requires_grad) and _differentiable(self.cls.dtype)
        self.grad: Tensor | None = None
        self._ctx = None

    @classmethod
    def _from_class(cls, c: Class) -> Tensor:
        t = _new(cls)
        t.cls = c
        t.requires_grad = False
        t.grad = None
        t._ctx = None
        return t

    # ---- properties ------------------------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.cls.shape

    @property
    def dtype(self) -> DType:
        return self.cls.dtype

    @property
    def device(self) -> str:
        return self.cls.device

    @property
    def ndim(self) -> int:
        return len(self.cls.shape)

    def numel(self) -> int:
        return self.cls.numel

    def size(self, axis: int | None = None):
        return self.shape if axis is None else self.shape[_norm_axis(axis, self.ndim)]

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __repr__(self) -> str:
        state = "realized" if self.cls.realized else "lazy"
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor(shape={self.shape}, dtype={self.dtype.name}, device={self.device!r}, {state}{grad})"

    def __hash__(self) -> int:
        return id(self)

    def __bool__(self) -> bool:
        if self.numel() != 1:
            raise ValueError(f"the truth value of a tensor with {self.numel()} elements is ambiguous; "
                             "use .any() or .all()")
        return bool(self.item())

    def _scalar(self, kind: str) -> Scalar:
        if self.numel() != 1:
            raise ValueError(f"{kind}() needs a tensor with one element, this one has shape {self.shape}; "
                             "index it or reduce it first")
        return self.item()

    def __float__(self) -> float:
        return float(self._scalar("float"))

    def __int__(self) -> int:
        return int(self._scalar("int"))

    def __index__(self) -> int:
        if self.dtype.is_float or self.dtype.kind == "b":
            raise TypeError(f"only integer tensors of one element can be used as an index, not {self.dtype.name}")
        return int(self._scalar("index"))

    # ---- realization and output ------------------------------------------------------------------------------
    def realize(self) -> Tensor:
        if self.cls.buffer is None:
            schedule.realize([self.cls])
        return self

    def _on_compute(self) -> Tensor:
        return self.to(registry().default_device()) if self.cls.device == "disk" else self

    def numpy(self) -> np.ndarray:
        """A new NumPy array with the tensor's values (bfloat16 via ml_dtypes)."""
        capture.forbid("reading a tensor's value (.numpy(), .item(), .tolist(), float(t), if t: ...)")
        self.realize()
        out = np.empty(self.shape, self.dtype.np_dtype)
        transfer.read_into(self.cls, out)
        return out

    def __array__(self, dtype=None, copy=None):
        a = self.numpy()
        return a if dtype is None else a.astype(dtype)

    def tolist(self):
        return self.numpy().tolist()

    def item(self) -> Scalar:
        if self.numel() != 1:
            raise ValueError(f"item() needs a tensor with one element, this one has shape {self.shape}")
        return self.numpy().reshape(-1)[0].item()

    def to(self, device: str) -> Tensor:
        device = canonical_name(device)
        if device == self.device:
            return self
        if device == "disk":
            raise ValueError("tensors cannot be moved to 'disk'; save them with zyx.save(path, tensors)")
        registry().get(device)
        return F.Copy.apply(self, device=device)

    def cpu(self) -> Tensor:
        return self.to("host")

    def cuda(self, index: int = 0) -> Tensor:
        return self.to(f"cuda:{index}")

    def detach(self) -> Tensor:
        return Tensor._from_class(self.cls)

    def contiguous(self) -> Tensor:
        return F.Contiguous.apply(self._on_compute())

    # ---- creation --------------------------------------------------------------------------------------------
    @staticmethod
    def full(shape, value: Scalar, dtype=None, device: str | None = None) -> Tensor:
        shape = _new_shape(shape)
        d = dtypes.to_dtype(dtype) if dtype is not None else _scalar_default(value)
        return Tensor._from_class(g.const(value, shape, d, _device(device)))

    @staticmethod
    def zeros(*shape, dtype=None, device: str | None = None) -> Tensor:
        return Tensor.full(shape, 0, dtype or dtypes.default_float, device)

    @staticmethod
    def ones(*shape, dtype=None, device: str | None = None) -> Tensor:
        return Tensor.full(shape, 1, dtype or dtypes.default_float, device)

    @staticmethod
    def arange(start, stop=None, step=1, dtype=None, device: str | None = None) -> Tensor:
        if stop is None:
            start, stop = 0, start
        if step == 0:
            raise ValueError("arange: step must not be zero")
        n = max(0, math.ceil((stop - start) / step))
        is_float = any(isinstance(v, float) for v in (start, stop, step))
        d = dtypes.to_dtype(dtype) if dtype is not None else (dtypes.default_float if is_float else dtypes.int64)
        dev = _device(device)
        idx = Tensor._from_class(g.iota(n, dtypes.int64 if not d.is_float else dtypes.float64, dev))
        out = idx * step + start if (step != 1 or start != 0) else idx
        return out.cast(d)

    @staticmethod
    def linspace(start: float, stop: float, num: int = 50, dtype=None, device: str | None = None) -> Tensor:
        if num < 0:
            raise ValueError(f"linspace: num must be non-negative, got {num}")
        d = dtypes.to_dtype(dtype) if dtype is not None else dtypes.default_float
        dev = _device(device)
        if num == 1:
            return Tensor.full((1,), start, d, dev)
        step = (stop - start) / max(num - 1, 1)
        i = Tensor._from_class(g.iota(num, dtypes.float64, dev))
        v = i * step + start
        last = Tensor._from_class(g.iota(num, dtypes.int64, dev)) == num - 1
        return last.where(float(stop), v).cast(d)

    @staticmethod
    def eye(n: int, m: int | None = None, dtype=None, device: str | None = None) -> Tensor:
        n, m = _new_shape((n, n if m is None else m))
        dev = _device(device)
        r = Tensor._from_class(g.iota(n, dtypes.int64, dev)).reshape(n, 1)
        c = Tensor._from_class(g.iota(m, dtypes.int64, dev)).reshape(1, m)
        return (r == c).cast(dtypes.to_dtype(dtype) if dtype is not None else dtypes.default_float)

    @staticmethod
    def variable(value: Scalar, dtype=None, device: str | None = None) -> Tensor:
        """A 0-d tensor whose value is a launch argument: a new value reuses the compiled kernels (learning
        rates, step counts, random seeds)."""
        d = dtypes.to_dtype(dtype) if dtype is not None else _scalar_default(value)
        return Tensor._from_class(var_class(value, d, _device(device)))

    def full_like(self, value: Scalar, dtype=None) -> Tensor:
        return Tensor.full(self.shape, value, dtype or self.dtype, self.device)

    def zeros_like(self, dtype=None) -> Tensor:
        return self.full_like(0, dtype)

    def ones_like(self, dtype=None) -> Tensor:
        return self.full_like(1, dtype)

    # ---- dtype -----------------------------------------------------------------------------------------------
    def cast(self, dtype) -> Tensor:
        d = dtype if type(dtype) is DType else dtypes.to_dtype(dtype)
        if d is self.cls.dtype:
            return self
        x = self._on_compute()
        return F.Cast.apply(x, dtype=d) if d.kind == "f" and x.cls.dtype.kind == "f" else \
            _from_class(g.cast(x.cls, d))

    astype = cast

    def float(self) -> Tensor:
        return self.cast(dtypes.float32)

    def half(self) -> Tensor:
        return self.cast(dtypes.float16)

    def int(self) -> Tensor:
        return self.cast(dtypes.int32)

    def long(self) -> Tensor:
        return self.cast(dtypes.int64)

    def bool(self) -> Tensor:
        return self.cast(dtypes.bool_)

    # ---- broadcasting ----------------------------------------------------------------------------------------
    def _operand(self, other, *, reverse: bool = False) -> tuple[Tensor, Tensor]:
        """Promote and broadcast ``self`` and ``other`` for an elementwise binary op."""
        a = self if self.cls.device != "disk" else self._on_compute()
        t = type(other)
        if t is float or t is int or t is bool:  # hot path: Python scalars (dtypes.scalar_dtype, inlined)
            c = a.cls
            ad = c.dtype
            if t is float:
                d = ad if ad.kind == "f" else dtypes.default_float
            elif t is int:
                d = ad if ad.kind != "b" else dtypes.default_int
                if d.kind in "iu":
                    lo, hi = dtypes.int_range(d)
                    if not lo <= other <= hi:
                        raise OverflowError(f"Python integer {other} out of bounds for {d.name}")
            else:
                d = ad
            if d is not ad:
                a = a.cast(d)
                c = a.cls
            b = _from_class(g.const(other, c.shape, d, c.device))
            return (b, a) if reverse else (a, b)
        if isinstance(other, Tensor):
            b = other._on_compute()
            if a.cls.device != b.cls.device:
                raise ValueError(f"expected all tensors on the same device, got {a.device} and {b.device}; "
                                 "move one with .to(...)")
            da, db = a.cls.dtype, b.cls.dtype
            d = da if da is db else dtypes.promote_types(da, db)
        elif isinstance(other, (bool, int, float, np.generic)):
            if isinstance(other, np.generic):
                other = other.item()
            d = dtypes.scalar_dtype(other, a.dtype)
            if d.is_int and isinstance(other, int) and not isinstance(other, bool):
                lo, hi = dtypes.min_max(d)
                if not lo <= other <= hi:
                    raise OverflowError(f"Python integer {other} out of bounds for {d.name}")
            b = Tensor._from_class(g.const(other, a.shape, d, a.device))
        elif isinstance(other, (list, tuple, np.ndarray)):
            return self._operand(Tensor(other, device=a.device), reverse=reverse)
        else:
            raise TypeError(f"unsupported operand type {type(other).__name__} for a Tensor op")
        if a.cls.dtype is not d:
            a = a.cast(d)
        if b.cls.dtype is not d:
            b = b.cast(d)
        sa, sb = a.cls.shape, b.cls.shape
        if sa != sb:
            shape = broadcast_shapes(sa, sb)
            a, b = a._broadcast_to(shape), b._broadcast_to(shape)
        return (b, a) if reverse else (a, b)

    def _broadcast_to(self, shape: tuple[int, ...]) -> Tensor:
        """``self`` broadcast to ``shape``, which the caller has checked it broadcasts to."""
        s = self.cls.shape
        if s == shape:
            return self
        x = self._on_compute()
        if len(s) != len(shape):
            s = (1,) * (len(shape) - len(s)) + s
            x = F.Reshape.apply(x, shape=s)
        return F.Expand.apply(x, shape=shape) if s != shape else x

    def broadcast_to(self, shape) -> Tensor:
        shape = _new_shape(shape)
        ok = len(shape) >= self.ndim and all(s == o or s == 1 for s, o in zip(self.shape[::-1], shape[::-1]))
        if not ok:
            raise ValueError(f"cannot broadcast a tensor of shape {self.shape} to shape {shape}")
        return self._broadcast_to(shape)

    def expand(self, *shape) -> Tensor:
        shape = _shape_arg(shape)
        if len(shape) < self.ndim:
            raise ValueError(f"expand: the target {tuple(shape)} has fewer dimensions than the shape {self.shape}")
        lead = len(shape) - self.ndim
        full = tuple(self.shape[i - lead] if s == -1 and i >= lead else s for i, s in enumerate(shape))
        return self.broadcast_to(full)

    # ---- elementwise -----------------------------------------------------------------------------------------
    def _float(self) -> Tensor:
        x = self._on_compute()
        return x if x.dtype.is_float else x.cast(dtypes.default_float)

    def _scalar_op(self, o, op: Ops, reverse: bool = False) -> Tensor | None:
        """``self op o`` (``o op self`` when ``reverse``) for a Python float or int ``o`` and a float tensor that
        records no gradient: the very classes ``_operand`` and ``Function.apply`` would build (an int scalar
        takes the tensor's float dtype either way), without the operand tensor and the context. None when
        those conditions do not hold (the general path decides)."""
        t = type(o)
        c = self.cls
        if (t is not float and t is not int) or c.dtype.kind != "f" or c.device == "disk" or \
                (self.requires_grad and F.grad_enabled()):
            return None
        k = g.const(o, c.shape, c.dtype, c.device)
        return _from_class(g.binary(op, k, c) if reverse else g.binary(op, c, k))

    def __add__(self, o):
        t = self._scalar_op(o, Ops.ADD)
        if t is not None:
            return t
        a, b = self._operand(o)
        return F.Add.apply(a, b) if a.cls.dtype.kind != "b" else a | b

    def __radd__(self, o):
        t = self._scalar_op(o, Ops.ADD, reverse=True)
        if t is not None:
            return t
        a, b = self._operand(o, reverse=True)
        return F.Add.apply(a, b) if a.cls.dtype.kind != "b" else a | b

    def __sub__(self, o):
        t = self._scalar_op(o, Ops.SUB)
        if t is not None:
            return t
        a, b = self._operand(o)
        _no_bool("subtract", a)
        return F.Sub.apply(a, b)

    def __rsub__(self, o):
        t = self._scalar_op(o, Ops.SUB, reverse=True)
        if t is not None:
            return t
        a, b = self._operand(o, reverse=True)
        _no_bool("subtract", a)
        return F.Sub.apply(a, b)

    def __mul__(self, o):
        t = self._scalar_op(o, Ops.MUL)
        if t is not None:
            return t
        a, b = self._operand(o)
        return F.Mul.apply(a, b) if a.cls.dtype.kind != "b" else a & b

    def __rmul__(self, o):
        t = self._scalar_op(o, Ops.MUL, reverse=True)
        if t is not None:
            return t
        a, b = self._operand(o, reverse=True)
        return F.Mul.apply(a, b) if a.cls.dtype.kind != "b" else a & b

    def __truediv__(self, o):
        a, b = self._operand(o)
        return F.Div.apply(a._float(), b._float())

    def __rtruediv__(self, o):
        a, b = self._operand(o, reverse=True)
        return F.Div.apply(a._float(), b._float())

    def __floordiv__(self, o):
        a, b = self._operand(o)
        return _binary_nograd(Ops.IDIV, a, b)

    def __rfloordiv__(self, o):
        a, b = self._operand(o, reverse=True)
        return _binary_nograd(Ops.IDIV, a, b)

    def __mod__(self, o):
        a, b = self._operand(o)
        return _binary_nograd(Ops.MOD, a, b)

    def __rmod__(self, o):
        a, b = self._operand(o, reverse=True)
        return _binary_nograd(Ops.MOD, a, b)

    def __pow__(self, o):
        if isinstance(o, (int, float)) and not isinstance(o, bool) and self.dtype.is_float:
            if o == 2:
                return self * self
            if o == 1:
                return self
            if o == 0.5:
                return self.sqrt()
            if o == -1:
                return self.reciprocal()
        a, b = self._operand(o)
        if a.dtype.is_int and isinstance(o, int) and o < 0:
            raise ValueError("integers to negative integer powers are not allowed")
        return F.Pow.apply(a, b)

    def __rpow__(self, o):
        a, b = self._operand(o, reverse=True)
        return F.Pow.apply(a, b)

    def __neg__(self):
        if self.dtype.kind == "b":
            raise TypeError("negation of a bool tensor is not supported; use ~x or logical_not()")
        return F.Neg.apply(self._on_compute())

    def __pos__(self):
        return self

    def __abs__(self):
        return self.abs()

    def __lt__(self, o):
        return _compare(Ops.CMPLT, *self._operand(o))

    def __le__(self, o):
        return _compare(Ops.CMPLE, *self._operand(o))

    def __gt__(self, o):
        a, b = self._operand(o)
        return _compare(Ops.CMPLT, b, a)

    def __ge__(self, o):
        a, b = self._operand(o)
        return _compare(Ops.CMPLE, b, a)

    def __eq__(self, o):  # type: ignore[override]
        return _compare(Ops.CMPEQ, *self._operand(o))

    def __ne__(self, o):  # type: ignore[override]
        return _compare(Ops.CMPNE, *self._operand(o))

    def __and__(self, o):
        return _bitwise(Ops.AND, *self._operand(o))

    __rand__ = __and__

    def __or__(self, o):
        return _bitwise(Ops.OR, *self._operand(o))

    __ror__ = __or__

    def __xor__(self, o):
        return _bitwise(Ops.XOR, *self._operand(o))

    __rxor__ = __xor__

    def __invert__(self):
        x = self._on_compute()
        if x.dtype.is_float:
            raise TypeError(f"bitwise not needs a bool or integer tensor, got {x.dtype.name}")
        return Tensor._from_class(g.unary(Ops.NOT, x.cls))

    def __lshift__(self, o):
        return _shift(Ops.SHL, *self._operand(o))

    def __rshift__(self, o):
        return _shift(Ops.SHR, *self._operand(o))

    def __rlshift__(self, o):
        return _shift(Ops.SHL, *self._operand(o, reverse=True))

    def __rrshift__(self, o):
        return _shift(Ops.SHR, *self._operand(o, reverse=True))

    # PyTorch's method names for the operators
    def add(self, other, alpha=1):
        """``self + alpha * other``."""
        return self + (other if alpha == 1 else other * alpha)

    def sub(self, other, alpha=1):
        """``self - alpha * other``."""
        return self - (other if alpha == 1 else other * alpha)

    def div(self, other, rounding_mode: str | None = None):
        """``self / other``; ``rounding_mode="floor"``: ``self // other``."""
        if rounding_mode is None:
            return self / other
        if rounding_mode == "floor":
            return self // other
        raise ValueError(f"div: rounding_mode must be None or 'floor', got {rounding_mode!r} (for 'trunc' use "
                         "(a / b).trunc())")

    def mul(self, other):
        return self * other

    def pow(self, exponent):
        return self ** exponent

    def floor_divide(self, other):
        return self // other

    def remainder(self, other):
        """Python's ``%``: the sign of the divisor."""
        return self % other

    def eq(self, other):
        return self == other

    def ne(self, other):
        return self != other

    def lt(self, other):
        return self < other

    def le(self, other):
        return self <= other

    def gt(self, other):
        return self > other

    def ge(self, other):
        return self >= other

    subtract, multiply, divide, true_divide = sub, mul, div, div

    def neg(self):
        return -self

    negative = neg

    def exp(self):
        return F.Exp.apply(self._float())

    def exp2(self):
        return F.Exp2.apply(self._float())

    def log(self):
        return F.Log.apply(self._float())

    def log2(self):
        return F.Log2.apply(self._float())

    def sqrt(self):
        return F.Sqrt.apply(self._float())

    def rsqrt(self):
        return self.sqrt().reciprocal()

    def reciprocal(self):
        return F.Recip.apply(self._float())

    def square(self):
        """``self * self`` in the tensor's own dtype (integers wrap, as NumPy's and PyTorch's ``square``)."""
        return self * self

    def sin(self):
        return F.Sin.apply(self._float())

    def cos(self):
        return F.Cos.apply(self._float())

    def tan(self):
        return F.Tan.apply(self._float())

    def tanh(self):
        return F.Tanh.apply(self._float())

    def erf(self):
        return F.Erf.apply(self._float())

    def abs(self):
        x = self._on_compute()
        if x.dtype.kind in "bu":
            return x
        return F.Abs.apply(x)

    def sigmoid(self):
        x = self._float()
        # exp of a non-positive argument only: no overflow for large |x|
        e = (-x.abs()).exp()
        return (x >= 0).where(1 / (1 + e), e / (1 + e))

    def relu(self):
        return self.maximum(0) if self.cls.dtype.kind != "b" else self

    def leaky_relu(self, negative_slope: float = 0.01):
        return (self > 0).where(self, self * negative_slope)

    def gelu(self, approximate: str = "none"):
        x = self._float()
        if approximate == "tanh":
            return 0.5 * x * (1 + (math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)).tanh())
        if approximate != "none":
            raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
        return 0.5 * x * (1 + (x * (1 / math.sqrt(2))).erf())

    def silu(self):
        return self * self.sigmoid()

    def softplus(self, beta: float = 1.0, threshold: float = 20.0):
        x = self._float()
        bx = x * beta
        soft = (1 + (-bx.abs()).exp()).log() / beta + x.maximum(0)
        return (bx > threshold).where(x, soft)

    def floor(self):
        return _rounding(Ops.FLOOR, self)

    def ceil(self):
        return _rounding(Ops.CEIL, self)

    def round(self):
        return _rounding(Ops.ROUND, self)

    def trunc(self):
        return _rounding(Ops.TRUNC, self)

    def sign(self):
        x = self._on_compute()
        if x.dtype.kind == "b":
            return x
        s = (x > 0).cast(x.dtype) - (x < 0).cast(x.dtype) if x.dtype.kind != "u" else (x > 0).cast(x.dtype)
        return x.isnan().where(x, s) if x.dtype.is_float else s

    def clip(self, min=None, max=None):  # noqa: A002 - NumPy's names
        if min is None and max is None:
            raise ValueError("clip: give min, max, or both")
        x = self
        if min is not None:
            x = x.maximum(min)
        if max is not None:
            x = x.minimum(max)
        return x

    clamp = clip

    def maximum(self, o):
        t = self._scalar_op(o, Ops.MAX)
        if t is not None:
            return t
        a, b = self._operand(o)
        return F.Maximum.apply(a, b)

    def minimum(self, o):
        a, b = self._operand(o)
        return F.Minimum.apply(a, b)

    def where(self, x, y):
        """``self`` is the condition: elements of ``x`` where true, of ``y`` where false."""
        return where(self, x, y)

    def masked_fill(self, mask, value) -> Tensor:
        """``value`` where the bool ``mask`` is true, else ``self`` (PyTorch's): mask and self broadcast
        together, the result keeps ``self``'s dtype; ``value`` is a Python scalar or a 0-d tensor."""
        m = mask if isinstance(mask, Tensor) else Tensor(mask, device=self.device)
        if m.dtype.kind != "b":
            raise TypeError(f"masked_fill: mask must be bool, got {m.dtype.name} (mask shape {m.shape}, "
                            f"tensor shape {self.shape})")
        broadcast_shapes(self.shape, m.shape)  # raises naming both shapes
        if isinstance(value, Tensor):
            if value.ndim != 0:
                raise ValueError(f"masked_fill: value must be a 0-d tensor, got shape {value.shape}")
            v = value.cast(self.dtype)
        else:
            fill = value if self.dtype.is_float else (bool(value) if self.dtype.kind == "b" else int(value))
            v = Tensor.full((), fill, self.dtype, self.device)
        return where(m, v, self)

    def logical_not(self):
        return Tensor._from_class(g.unary(Ops.NOT, self.bool().cls))

    def _logical(self, op: Ops, o) -> Tensor:
        if isinstance(o, (bool, int, float, np.generic)):
            o = bool(o)  # only its truth matters (a Python int beyond int64 included)
        a, b = self.bool()._operand(o)
        return Tensor._from_class(g.binary(op, a.bool().cls, b.bool().cls))

    def logical_and(self, o):
        return self._logical(Ops.AND, o)

    def logical_or(self, o):
        return self._logical(Ops.OR, o)

    def logical_xor(self, o):
        return self._logical(Ops.XOR, o)

    def isnan(self):
        return Tensor._from_class(g.unary(Ops.ISNAN, self._on_compute().cls))

    def isinf(self):
        return Tensor._from_class(g.unary(Ops.ISINF, self._on_compute().cls))

    def isfinite(self):
        return (self.isnan() | self.isinf()).logical_not()

    # ---- reductions ------------------------------------------------------------------------------------------
    def _reduce(self, fn, axis, keepdim: bool, name: str, identity=None) -> Tensor:
        x = self._on_compute()
        shape = x.cls.shape
        axes = _norm_axes(axis, len(shape))
        if 0 in shape and any(shape[a] == 0 for a in axes):
            if identity is None:
                raise ValueError(f"{name} of an empty axis has no identity (shape {shape}, axis {axis})")
        out = fn.apply(x, axes=axes) if axes else x  # over an empty axis: the identity (``ops.reduce``)
        if not keepdim and axes:  # drop the reduced axes (size 1 now): a reshape known to be valid
            if len(axes) == 1:  # without a generator (see ``ops.reduce``)
                kept = shape[:axes[0]] + shape[axes[0] + 1:]
            else:
                kept = tuple(s for i, s in enumerate(shape) if i not in axes)
            out = F.Reshape.apply(out, shape=kept)
        return out

    def sum(self, axis=None, keepdim: bool = False, dtype=None, dim=None, keepdims: bool | None = None):
        keepdim = _keepdim(keepdim, keepdims)
        axis = _alias(axis, dim)
        d = dtypes.to_dtype(dtype) if dtype is not None else _sum_dtype(self.cls.dtype)
        return (self if d is self.cls.dtype else self.cast(d))._reduce(F.Sum, axis, keepdim, "sum", 0)

    def prod(self, axis=None, keepdim: bool = False, dtype=None, dim=None, keepdims: bool | None = None):
        keepdim = _keepdim(keepdim, keepdims)
        axis = _alias(axis, dim)
        x = self._on_compute()
        d = dtypes.to_dtype(dtype) if dtype is not None else _sum_dtype(x.dtype)
        return x.cast(d)._reduce(F.Prod, axis, keepdim, "prod", 1)

    def max(self, axis=None, keepdim: bool = False, dim=None, keepdims: bool | None = None):
        keepdim = _keepdim(keepdim, keepdims)
        return self._reduce(F.Max, _alias(axis, dim), keepdim, "max")

    def min(self, axis=None, keepdim: bool = False, dim=None, keepdims: bool | None = None):
        keepdim = _keepdim(keepdim, keepdims)
        return self._reduce(F.Min, _alias(axis, dim), keepdim, "min")

    amax = max
    amin = min

    def mean(self, axis=None, keepdim: bool = False, dim=None, keepdims: bool | None = None):
        keepdim = _keepdim(keepdim, keepdims)
        axis = _alias(axis, dim)
        x = self._float()
        axes = _norm_axes(axis, x.ndim)
        n = math.prod(x.shape[a] for a in axes)
        s = x.sum(axis, keepdim)
        return s * (1.0 / n) if n else s * math.nan

    def var(self, axis=None, keepdim: bool = False, ddof: int = 0, correction: int | None = None, dim=None,
            keepdims: bool | None = None):
        keepdim = _keepdim(keepdim, keepdims)
        axis = _alias(axis, dim)
        ddof = correction if correction is not None else ddof
        x = self._float()
        axes = _norm_axes(axis, x.ndim)
        n = math.prod(x.shape[a] for a in axes)
        d = x - x.mean(axes, keepdim=True)
        ss = (d * d).sum(axes, keepdim)
        return ss * (1.0 / (n - ddof)) if n - ddof > 0 else ss * math.nan

    def std(self, axis=None, keepdim: bool = False, ddof: int = 0, correction: int | None = None, dim=None,
            keepdims: bool | None = None):
        keepdim = _keepdim(keepdim, keepdims)
        return self.var(axis, keepdim, ddof, correction, dim).sqrt()

    def any(self, axis=None, keepdim: bool = False, dim=None, keepdims: bool | None = None):
        keepdim = _keepdim(keepdim, keepdims)
        return _bool_reduce(self, Ops.OR, _alias(axis, dim), keepdim, False)

    def all(self, axis=None, keepdim: bool = False, dim=None, keepdims: bool | None = None):
        keepdim = _keepdim(keepdim, keepdims)
        return _bool_reduce(self, Ops.AND, _alias(axis, dim), keepdim, True)

    def _arg_extreme(self, axis, keepdim: bool, largest: bool) -> Tensor:
        x = self._on_compute()
        if axis is None:
            x = x.reshape(-1)
            ax = 0
        else:
            ax = _norm_axis(axis, x.ndim)
        if x.ndim == 0:
            return Tensor.full((), 0, dtypes.int64, x.device)
        if x.shape[ax] == 0:
            raise ValueError(f"arg{'max' if largest else 'min'} of an empty axis (shape {x.shape}, axis {ax})")
        with F.no_grad():
            m = x.max(ax, keepdim=True) if largest else x.min(ax, keepdim=True)
            hit = x == m
            if x.dtype.is_float:
                hit = hit | x.isnan()
            n = x.shape[ax]
            shape = [1] * x.ndim
            shape[ax] = n
            idx = Tensor._from_class(g.iota(n, dtypes.int64, x.device)).reshape(shape)
            out = hit.where(idx, n).min(ax, keepdim=keepdim)
        if axis is None and keepdim:
            out = out.reshape((1,) * self.ndim)
        return out

    def argmax(self, axis=None, keepdim: bool = False, dim=None, keepdims: bool | None = None):
        keepdim = _keepdim(keepdim, keepdims)
        return self._arg_extreme(_alias(axis, dim), keepdim, True)

    def argmin(self, axis=None, keepdim: bool = False, dim=None, keepdims: bool | None = None):
        keepdim = _keepdim(keepdim, keepdims)
        return self._arg_extreme(_alias(axis, dim), keepdim, False)

    def logsumexp(self, axis=None, keepdim: bool = False, dim=None, keepdims: bool | None = None):
        keepdim = _keepdim(keepdim, keepdims)
        axis = _alias(axis, dim)
        x = self._float()
        axes = _norm_axes(axis, x.ndim)
        m = x.max(axes, keepdim=True).detach()
        m = m.isinf().where(0.0, m)
        out = (x - m).exp().sum(axes, keepdim=True).log() + m
        return out if keepdim else out.reshape(tuple(s for i, s in enumerate(x.shape) if i not in axes))

    def softmax(self, axis: int = -1, dim=None):
        axis = _alias(axis, dim)
        x = self._float()
        e = (x - x.max(axis, keepdim=True).detach()).exp()
        return e / e.sum(axis, keepdim=True)

    def log_softmax(self, axis: int = -1, dim=None):
        axis = _alias(axis, dim)
        x = self._float()
        if x.ndim == 0:
            return x - x.logsumexp(axis, keepdim=True)
        return F.LogSoftmax.apply(x, axis=_norm_axes(axis, x.ndim)[0])

    def cumsum(self, axis: int = 0, dim=None, dtype=None):
        """Inclusive running sum along ``axis`` (integers and bool accumulate in 64 bits, as NumPy)."""
        return self._scan(axis, dim, dtype, Ops.ADD)

    def cumprod(self, axis: int = 0, dim=None, dtype=None):
        """Inclusive running product along ``axis``."""
        return self._scan(axis, dim, dtype, Ops.MUL)

    def _scan(self, axis, dim, dtype, op: Ops) -> Tensor:
        x = self._on_compute()
        if x.ndim == 0:
            x = x.reshape(1)
        ax = _norm_axis(_alias(axis, dim), x.ndim)
        x = x.cast(dtypes.to_dtype(dtype) if dtype is not None else _sum_dtype(x.dtype))
        if x.shape[ax] == 0:
            return x
        return _scan_last(x.transpose(ax, -1), op).transpose(ax, -1)

    # ---- movement --------------------------------------------------------------------------------------------
    def reshape(self, *shape) -> Tensor:
        shape = _shape_arg(shape)
        if shape == self.cls.shape:
            return self
        if -1 not in shape and math.prod(shape) == self.cls.numel and (not shape or min(shape) >= 0):
            return F.Reshape.apply(self._on_compute(), shape=shape)
        shape = list(shape)
        n = self.numel()
        if shape.count(-1) > 1:
            raise ValueError(f"reshape: only one dimension can be -1, got {tuple(shape)}")
        if -1 in shape:
            rest = math.prod(s for s in shape if s != -1)
            if rest == 0 or n % rest:
                raise ValueError(f"cannot reshape tensor of shape {self.shape} ({n} elements) into shape "
                                 f"{tuple(shape)}")
            shape[shape.index(-1)] = n // rest
        if any(s < 0 for s in shape) or math.prod(shape) != n:
            raise ValueError(f"cannot reshape tensor of shape {self.shape} ({n} elements) into shape {tuple(shape)}")
        shape = tuple(shape)
        return self if shape == self.shape else F.Reshape.apply(self._on_compute(), shape=shape)

    view = reshape

    def permute(self, *order) -> Tensor:
        order = _shape_arg(order)
        nd = len(self.cls.shape)
        if len(order) == nd and set(order) == set(range(nd)):  # hot path: already normalized
            return self if order == tuple(range(nd)) else F.Permute.apply(self._on_compute(), order=order)
        if sorted(_norm_axis(o, self.ndim) for o in order) != list(range(self.ndim)) or len(order) != self.ndim:
            raise ValueError(f"permute: {order} is not a permutation of the {self.ndim} axes of shape {self.shape}")
        order = tuple(_norm_axis(o, self.ndim) for o in order)
        return self if order == tuple(range(self.ndim)) else F.Permute.apply(self._on_compute(), order=order)

    def transpose(self, axis0: int = -2, axis1: int = -1) -> Tensor:
        if self.ndim < 2 and axis0 in (-2, -1) and axis1 in (-2, -1):
            return self
        a, b = _norm_axis(axis0, self.ndim), _norm_axis(axis1, self.ndim)
        order = list(range(self.ndim))
        order[a], order[b] = order[b], order[a]
        return self.permute(order)

    swapaxes = transpose

    @property
    def T(self) -> Tensor:  # noqa: N802
        return self.permute(tuple(range(self.ndim - 1, -1, -1))) if self.ndim > 1 else self

    @property
    def mT(self) -> Tensor:  # noqa: N802
        return self.transpose(-2, -1)

    def squeeze(self, axis=None, dim=None) -> Tensor:
        axis = _alias(axis, dim)
        if axis is None:
            return self.reshape(tuple(s for s in self.shape if s != 1))
        axes = _norm_axes(axis, self.ndim)
        for a in axes:
            if self.shape[a] != 1:
                raise ValueError(f"squeeze: axis {a} has size {self.shape[a]}, not 1 (shape {self.shape})")
        return self.reshape(tuple(s for i, s in enumerate(self.shape) if i not in axes))

    def unsqueeze(self, axis: int, dim=None) -> Tensor:
        axis = _alias(axis, dim)
        a = _norm_axis(axis, self.ndim, "insert")
        return self.reshape(self.shape[:a] + (1,) + self.shape[a:])

    def flatten(self, start_dim: int = 0, end_dim: int = -1) -> Tensor:
        if self.ndim == 0:
            return self.reshape(1)
        s, e = _norm_axis(start_dim, self.ndim), _norm_axis(end_dim, self.ndim)
        if s > e:
            raise ValueError(f"flatten: start_dim {start_dim} comes after end_dim {end_dim}")
        return self.reshape(self.shape[:s] + (math.prod(self.shape[s:e + 1]),) + self.shape[e + 1:])

    def pad(self, pad_width, value: Scalar = 0) -> Tensor:
        """Constant padding. ``pad_width``: NumPy style ((before, after), ...) per axis, one (before, after)
        pair for every axis, or PyTorch style flat (left, right, top, bottom, ...) starting at the last axis."""
        pads = _pad_arg(pad_width, self.ndim)
        x = self._on_compute()
        if any(a < 0 or b < 0 for a, b in pads):
            spec = tuple((max(-a, 0), s - max(-b, 0), 1) for (a, b), s in zip(pads, x.shape))
            if any(st > sp for st, sp, _ in spec):
                raise ValueError(f"pad: negative padding {pads} removes more than the shape {x.shape}")
            x = x._shrink(spec)
            pads = tuple((max(a, 0), max(b, 0)) for a, b in pads)
        if isinstance(value, float) and not x.dtype.is_float and not value.is_integer():
            raise TypeError(f"pad: value {value} does not fit {x.dtype.name}")
        return F.Pad.apply(x, pads=pads, fill=value) if any(p != (0, 0) for p in pads) else x

    def _shrink(self, spec) -> Tensor:
        spec = tuple(spec)
        if all((a, b, c) == (0, s, 1) for (a, b, c), s in zip(spec, self.shape)):
            return self
        return F.Shrink.apply(self._on_compute(), spec=spec)

    def flip(self, axis=None, dims=None) -> Tensor:
        axes = _norm_axes(_alias(axis, dims), self.ndim)
        return self._shrink(tuple((s - 1, -1, -1) if i in axes and s > 0 else (0, s, 1)
                                  for i, s in enumerate(self.shape)))

    def roll(self, shifts, dims=None) -> Tensor:
        """Elements shifted cyclically by ``shifts`` along ``dims`` (one int each, or sequences of equal length);
        with ``dims`` None the flattened tensor is rolled and reshaped back, as PyTorch's ``roll``."""
        if dims is None:
            if not isinstance(shifts, int):
                raise ValueError(f"roll: without dims, shifts must be one int, got {shifts!r}")
            return self.reshape(-1).roll(shifts, 0).reshape(self.shape)
        shifts, dims = ((shifts,), (dims,)) if isinstance(dims, int) else (tuple(shifts), tuple(dims))
        if len(shifts) != len(dims):
            raise ValueError(f"roll: shifts {shifts} and dims {dims} differ in length")
        x = self
        for shift, d in zip(shifts, dims):
            d = _norm_axis(d, x.ndim)
            n = x.shape[d]
            k = shift % n if n else 0
            if k:
                x = cat([x._slice_axis(d, n - k, n), x._slice_axis(d, 0, n - k)], d)
        return x

    def sort(self, dim: int = -1, descending: bool = False, stable: bool = True):
        """``(values, indices)`` sorted along ``dim``: stable, NaN last ascending and first descending, the values
        differentiable (``zyx.sorting``: a bitonic network of zyx ops, one kernel per stage)."""
        from zyx import sorting

        return sorting.sort(self, dim, descending, stable)

    def argsort(self, dim: int = -1, descending: bool = False, stable: bool = True) -> Tensor:
        """The int64 positions that sort this tensor along ``dim`` (``sort``'s order)."""
        from zyx import sorting

        return sorting.argsort(self, dim, descending, stable)

    def topk(self, k: int, dim: int = -1, largest: bool = True, sorted: bool = True):  # noqa: A002
        """``(values, indices)`` of the ``k`` largest (or smallest) elements along ``dim``, in order."""
        from zyx import sorting

        return sorting.topk(self, k, dim, largest, sorted)

    def tril(self, diagonal: int = 0) -> Tensor:
        """Zeros above the ``diagonal``-th diagonal of the last two axes (element (i, j) kept when j - i <=
        diagonal)."""
        return self._triangle(diagonal, lower=True)

    def triu(self, diagonal: int = 0) -> Tensor:
        """Zeros below the ``diagonal``-th diagonal of the last two axes (element (i, j) kept when j - i >=
        diagonal)."""
        return self._triangle(diagonal, lower=False)

    def _triangle(self, diagonal: int, lower: bool) -> Tensor:
        if self.ndim < 2:
            raise ValueError(f"{'tril' if lower else 'triu'}: needs at least 2 dimensions, got shape {self.shape}")
        n, m = self.shape[-2:]
        dev = self._on_compute().device
        offset = (Tensor._from_class(g.iota(m, dtypes.int64, dev)).reshape(1, m)
                  - Tensor._from_class(g.iota(n, dtypes.int64, dev)).reshape(n, 1))
        keep = offset <= diagonal if lower else offset >= diagonal
        return keep.where(self, Tensor.zeros((), dtype=self.dtype, device=dev))

    def norm(self, p="fro", dim=None, keepdim: bool = False) -> Tensor:
        """Vector norm over ``dim`` (every axis when None), PyTorch's ``norm`` / ``linalg.vector_norm``: ``p`` 2 or
        "fro" (the gradient at a zero vector is 0, as PyTorch's), 1, inf, -inf, 0 (the count of nonzeros) or any
        other real."""
        x = self._float()
        a = x.abs()
        if p in ("fro", 2, 2.0):
            s = (x * x).sum(dim, keepdim=keepdim)
            zero = s == 0  # sqrt's gradient there is inf: take the root of 1 instead and select 0
            return zero.where(0.0, zero.where(1.0, s).sqrt())
        if p in (1, 1.0):
            return a.sum(dim, keepdim=keepdim)
        if p == math.inf:
            return a.max(dim, keepdim=keepdim)
        if p == -math.inf:
            return a.min(dim, keepdim=keepdim)
        if p == 0:
            return (x != 0).cast(x.dtype).sum(dim, keepdim=keepdim)
        if not isinstance(p, (int, float)):
            raise ValueError(f"norm: p must be a number, inf, -inf or 'fro', got {p!r}")
        return (a ** p).sum(dim, keepdim=keepdim) ** (1.0 / p)

    def outer(self, other: Tensor) -> Tensor:
        """The outer product of two 1-D tensors."""
        if self.ndim != 1 or other.ndim != 1:
            raise ValueError(f"outer: needs two 1-D tensors, got shapes {self.shape} and {other.shape}")
        return self.reshape(-1, 1) * other.reshape(1, -1)

    def repeat(self, *repeats) -> Tensor:
        """Tile the tensor (PyTorch's ``repeat``, NumPy's ``tile``)."""
        reps = tuple(_shape_arg(repeats))
        if len(reps) < self.ndim:
            raise ValueError(f"repeat: need at least {self.ndim} repeat counts for shape {self.shape}, got {reps}")
        x = self.reshape((1,) * (len(reps) - self.ndim) + self.shape)
        inter = []
        for s in x.shape:
            inter += [1, s]
        x = x.reshape(inter)
        big = []
        for r, s in zip(reps, x.shape[1::2]):
            big += [r, s]
        return x.broadcast_to(tuple(big)).reshape(tuple(r * s for r, s in zip(reps, x.shape[1::2])))

    tile = repeat

    def repeat_interleave(self, repeats: int, axis: int | None = None) -> Tensor:
        x = self.reshape(-1) if axis is None else self
        ax = 0 if axis is None else _norm_axis(axis, x.ndim)
        shape = x.shape[:ax + 1] + (repeats,) + x.shape[ax + 1:]
        y = x.unsqueeze(ax + 1).broadcast_to(shape)
        return y.reshape(x.shape[:ax] + (x.shape[ax] * repeats,) + x.shape[ax + 1:])

    def split(self, split_size_or_sections, axis: int = 0, dim=None) -> list[Tensor]:
        axis = _norm_axis(_alias(axis, dim), self.ndim)
        n = self.shape[axis]
        if isinstance(split_size_or_sections, int):
            if split_size_or_sections <= 0:
                raise ValueError(f"split: size must be positive, got {split_size_or_sections}")
            sizes = [min(split_size_or_sections, n - i) for i in range(0, n, split_size_or_sections)] or [0]
        else:
            sizes = list(split_size_or_sections)
            if sum(sizes) != n:
                raise ValueError(f"split: sizes {sizes} do not add up to {n}, the size of axis {axis}")
        out, start = [], 0
        for s in sizes:
            out.append(self._slice_axis(axis, start, start + s))
            start += s
        return out

    def chunk(self, chunks: int, axis: int = 0, dim=None) -> list[Tensor]:
        axis = _norm_axis(_alias(axis, dim), self.ndim)
        if chunks <= 0:
            raise ValueError(f"chunk: number of chunks must be positive, got {chunks}")
        n = self.shape[axis]
        size = max(1, -(-n // chunks))
        return self.split(size, axis)

    def _slice_axis(self, axis: int, start: int, stop: int) -> Tensor:
        return self._shrink(tuple((start, stop, 1) if i == axis else (0, s, 1) for i, s in enumerate(self.shape)))

    # ---- selection by integer tensors (negative indices count from the end, as in NumPy) -------------------
    def gather(self, dim: int, index) -> Tensor:
        """PyTorch's ``gather``: for ``dim`` 1, ``out[i, j, k] = self[i, index[i, j, k], k]``. ``index`` has this
        tensor's number of dimensions and, off ``dim``, sizes no larger than its own; the output has the index's
        shape."""
        x = self._on_compute()
        axis = _norm_axis(dim, x.ndim, "dim")
        idx = _index_operand(index, x, axis, "gather")
        if idx.ndim != x.ndim or any(i > s for d, (i, s) in enumerate(zip(idx.shape, x.shape)) if d != axis):
            raise ValueError(f"gather: an index of shape {idx.shape} does not fit a tensor of shape {x.shape} along "
                             f"dim {axis}: it needs {x.ndim} dimensions, each but dim {axis} no larger than the "
                             f"tensor's")
        x = x._shrink(tuple((0, s if d == axis else i, 1) for d, (i, s) in enumerate(zip(idx.shape, x.shape))))
        return F.TakeAlong.apply(x, idx.detach(), axis=axis)

    def take_along_dim(self, indices, dim: int | None = None) -> Tensor:
        """PyTorch's ``take_along_dim`` (NumPy's ``take_along_axis``): ``gather`` with the sizes off ``dim``
        broadcast between the tensor and ``indices``; with ``dim`` None, both are flattened first."""
        x = self._on_compute()
        if dim is None:
            return x.reshape(-1).take_along_dim(_index_operand(indices, x, None, "take_along_dim").reshape(-1), 0)
        axis = _norm_axis(dim, x.ndim, "dim")
        idx = _index_operand(indices, x, axis, "take_along_dim")
        if idx.ndim != x.ndim:
            raise ValueError(f"take_along_dim: indices of shape {idx.shape} need as many dimensions as the tensor "
                             f"({x.shape})")
        try:
            common = list(np.broadcast_shapes(*(tuple(1 if d == axis else s for d, s in enumerate(t.shape))
                                                for t in (x, idx))))
        except ValueError:
            raise ValueError(f"take_along_dim: shapes {x.shape} and {idx.shape} do not broadcast off dim "
                             f"{axis}") from None
        x = x.broadcast_to(tuple(common[:axis] + [x.shape[axis]] + common[axis + 1:]))
        idx = idx.broadcast_to(tuple(common[:axis] + [idx.shape[axis]] + common[axis + 1:]))
        return F.TakeAlong.apply(x, idx.detach(), axis=axis)

    def index_select(self, dim: int, index) -> Tensor:
        """PyTorch's ``index_select``: the entries of a 1-D integer ``index`` along ``dim``, in its order."""
        x = self._on_compute()
        axis = _norm_axis(dim, x.ndim, "dim")
        idx = _index_operand(index, x, axis, "index_select")
        if idx.ndim != 1:
            raise ValueError(f"index_select: the index must be 1-D, got shape {idx.shape}")
        return F.Gather.apply(x, idx.detach(), axis=axis)

    def __setitem__(self, index, value) -> None:
        """NumPy's and PyTorch's ``x[index] = value``. A tensor is a value, so ``x`` is rebound to a new lazy one
        (one fused select); tensors computed from ``x`` before keep what they read. ``value`` is cast to ``x``'s
        dtype and broadcast to ``x[index]``'s shape. A tensor index must be 1-D; its values are read here
        (repeated positions: the last write wins)."""
        if self.cls.device == "disk":
            raise TypeError("x[...] = v: tensors on disk are read-only; copy one with .to(device) first")
        if self.requires_grad and F.grad_enabled():
            raise RuntimeError("x[...] = v on a tensor that requires grad would change a value its gradient "
                               "depends on; build the new value out of place (zyx.where, masked_fill) or assign "
                               "under zyx.no_grad()")
        new = _setitem(self, index, value)
        capture.note_assign(self, self.cls)
        self.cls = new.cls
        if new.requires_grad and F.grad_enabled():  # a value that requires grad: x joins its graph
            self.requires_grad, self._ctx = True, new._ctx

    def __getitem__(self, index) -> Tensor:
        if self.cls.device == "disk":
            from zyx.io import disk_getitem  # reads only the byte range the index touches

            return disk_getitem(self, index)
        return _getitem(self, index)

    # ---- matmul ----------------------------------------------------------------------------------------------
    def matmul(self, other: Tensor) -> Tensor:
        return matmul(self, other)

    __matmul__ = matmul

    def __rmatmul__(self, other) -> Tensor:
        return matmul(Tensor(other, device=self.device), self)

    def dot(self, other: Tensor) -> Tensor:
        """Inner product of 1-D tensors (a 0-d result); for higher dimensions the same as ``matmul``."""
        return matmul(self, other)

    # ---- DLPack (zero-copy exchange with NumPy, PyTorch, ...; the logic is in zyx.dlpack) ---------------------
    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule sharing this tensor's realized buffer (the buffer lives while the consumer holds it)."""
        from zyx.dlpack import to_dlpack

        return to_dlpack(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        from zyx.dlpack import dlpack_device

        return dlpack_device(self)

    # ---- autograd --------------------------------------------------------------------------------------------
    def backward(self, gradient: Tensor | None = None) -> None:
        from zyx.backward import backward

        backward(self, gradient)

    def requires_grad_(self, flag: bool = True) -> Tensor:
        self.requires_grad = bool(flag) and _differentiable(self.cls.dtype)
        return self

    # ---- in-place style updates (rebind the tensor to a new value) --------------------------------------------
    def assign(self, value) -> Tensor:
        """Make this tensor hold ``value`` (same shape); used by optimizers. Returns self."""
        v = value if isinstance(value, Tensor) else Tensor(value, dtype=self.dtype, device=self.device)
        if v.shape != self.shape:
            raise ValueError(f"assign: shape {v.shape} does not match {self.shape}")
        capture.note_assign(self, self.cls)
        self.cls = v.cast(self.dtype).to(self.device).cls
        return self


F.Function.tensor_type = Tensor
F._from_class = _from_class = Tensor._from_class

# ---------------------------------------------------------------------------------------------------------------
# module-level op helpers


def _keepdim(keepdim: bool, keepdims: bool | None) -> bool:
    """PyTorch's ``keepdim`` or NumPy's ``keepdims``."""
    return keepdim if keepdims is None else bool(keepdims)


def _alias(axis, dim):
    return dim if dim is not None else axis


def _shape_arg(shape) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (list, tuple)):
        shape = shape[0]
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    for s in shape:
        if type(s) is not int:
            break
    else:  # hot path: plain ints (bools and NumPy integers take the checks below)
        return tuple(shape)
    out = []
    for s in shape:
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool):
            raise TypeError(f"shape entries must be ints, got {s!r} in {tuple(shape)}")
        out.append(int(s))
    return tuple(out)


def _new_shape(shape) -> tuple[int, ...]:
    """The shape of a tensor being made: ints, none negative (-1 means "infer" only in reshape and expand)."""
    shape = _shape_arg(shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"a tensor cannot have a negative dimension, got shape {shape}")
    return shape


def _pad_arg(pad_width, ndim: int) -> tuple[tuple[int, int], ...]:
    """Per axis (before, after) from NumPy's forms (an int; one (n,) or (before, after) for every axis; one per
    axis) or PyTorch's flat (left, right, top, bottom, ...) starting at the last axis."""
    def count(v, where: str) -> int:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"pad: {where} must be an int, got {v!r}")
        return int(v)

    if isinstance(pad_width, (int, np.integer)) and not isinstance(pad_width, bool):
        return ((count(pad_width, "the padding"),) * 2,) * ndim
    if not isinstance(pad_width, (list, tuple)):
        raise TypeError(f"pad: expected an int, (before, after) pairs per axis or a flat PyTorch-style sequence, "
                        f"got {type(pad_width).__name__}")
    pw = list(pad_width)
    if pw and all(isinstance(p, (list, tuple)) for p in pw):
        if len(pw) == 1 and ndim != 1:
            pw = pw * ndim
        if len(pw) != ndim:
            raise ValueError(f"pad: got {len(pw)} (before, after) pairs for a tensor with {ndim} dimension(s)")
        out = []
        for axis, p in enumerate(pw):
            if len(p) not in (1, 2):
                raise ValueError(f"pad: axis {axis} needs (before, after) or (both,), got {tuple(p)}")
            out.append((count(p[0], f"axis {axis}'s padding"), count(p[-1], f"axis {axis}'s padding")))
        return tuple(out)
    if len(pw) % 2 or len(pw) // 2 > ndim:
        raise ValueError(f"pad: a flat padding needs an even count up to {2 * ndim} values, got {len(pw)}")
    pads = [(0, 0)] * ndim
    for i in range(len(pw) // 2):
        pads[ndim - 1 - i] = (count(pw[2 * i], "a padding"), count(pw[2 * i + 1], "a padding"))
    return tuple(pads)


def _scalar_default(v) -> DType:
    if isinstance(v, bool):
        return dtypes.bool_
    if isinstance(v, int):
        return dtypes.int64
    return dtypes.default_float


SCAN_BLOCK = 1024


def _scan_last(x: Tensor, op: Ops) -> Tensor:
    """Inclusive scan along the last axis. Short axes are one scan kernel (a serial loop per row, rows in
    parallel); a long axis is cut into blocks of ``SCAN_BLOCK`` scanned in parallel, the block totals are
    scanned recursively, and each block then combines with the total of the blocks before it: O(n) work."""
    n, lead = x.shape[-1], x.shape[:-1]
    if n <= 2 * SCAN_BLOCK:
        return F.Scan.apply(x, op=op, axis=x.ndim - 1)
    ident = 0 if op == Ops.ADD else 1
    b = SCAN_BLOCK
    nb = -(-n // b)
    if nb * b != n:
        x = x.pad(((0, 0),) * len(lead) + ((0, nb * b - n),), value=ident)
    local = F.Scan.apply(x.reshape(*lead, nb, b), op=op, axis=len(lead) + 1)
    totals = _scan_last(local[..., b - 1], op)  # inclusive totals of blocks 0..k
    before = totals.pad(((0, 0),) * len(lead) + ((1, 0),), value=ident)[..., :nb].unsqueeze(-1)
    out = local + before if op == Ops.ADD else local * before
    return out.reshape(*lead, nb * b)[..., :n]


def _sum_dtype(d: DType) -> DType:
    if d.kind == "b" or (d.kind == "i" and d.itemsize < 8):
        return dtypes.int64
    if d.kind == "u" and d.itemsize < 8:
        return dtypes.uint64
    return d


def _no_bool(what: str, a: Tensor) -> None:
    if a.cls.dtype.kind == "b":
        raise TypeError(f"cannot {what} bool tensors; use logical_xor or cast to an integer dtype first")


def _binary_nograd(op: Ops, a: Tensor, b: Tensor) -> Tensor:
    if a.dtype.kind == "b":
        a, b = a.cast(dtypes.int8), b.cast(dtypes.int8)
    return Tensor._from_class(g.binary(op, a.cls, b.cls))


def _compare(op: Ops, a: Tensor, b: Tensor) -> Tensor:
    return Tensor._from_class(g.binary(op, a.cls, b.cls))


def _bitwise(op: Ops, a: Tensor, b: Tensor) -> Tensor:
    if a.dtype.is_float:
        raise TypeError(f"bitwise {op.name.lower()} needs bool or integer tensors, got {a.dtype.name}")
    return Tensor._from_class(g.binary(op, a.cls, b.cls))


def _shift(op: Ops, a: Tensor, b: Tensor) -> Tensor:
    if not a.dtype.is_int:
        raise TypeError(f"shifts need integer tensors, got {a.dtype.name}")
    return Tensor._from_class(g.binary(op, a.cls, b.cls))


def _rounding(op: Ops, x: Tensor) -> Tensor:
    x = x._on_compute()
    if not x.dtype.is_float:
        return x
    return Tensor._from_class(g.unary(op, x.cls))


def _bool_reduce(x: Tensor, op: Ops, axis, keepdim: bool, identity: bool) -> Tensor:
    x = x._on_compute().bool()
    axes = _norm_axes(axis, x.ndim)
    if any(x.shape[a] == 0 for a in axes):
        shape = tuple(1 if i in axes else s for i, s in enumerate(x.shape))
        out = Tensor.full(shape, identity, dtypes.bool_, x.device)
    else:
        out = Tensor._from_class(g.reduce(op, x.cls, axes))
    if not keepdim:
        out = out.reshape(tuple(s for i, s in enumerate(x.shape) if i not in axes))
    return out


def where(cond, x, y) -> Tensor:
    """Elements of ``x`` where ``cond`` is true, else of ``y`` (NumPy broadcasting and promotion)."""
    devs = [t.device for t in (cond, x, y) if isinstance(t, Tensor)]
    dev = _device(devs[0] if devs else None)
    c = cond if isinstance(cond, Tensor) else Tensor(cond, dtype=dtypes.bool_, device=dev)
    c = c._on_compute()
    if isinstance(x, Tensor) or isinstance(y, Tensor):
        tx = x._on_compute() if isinstance(x, Tensor) else None
        ty = y._on_compute() if isinstance(y, Tensor) else None
        base = tx if tx is not None else ty
        if tx is None:
            tx = Tensor._from_class(g.const(x, base.shape, dtypes.scalar_dtype(x, base.dtype), base.device))
        if ty is None:
            ty = Tensor._from_class(g.const(y, base.shape, dtypes.scalar_dtype(y, base.dtype), base.device))
    else:
        d = dtypes.promote_types(_scalar_default(x), _scalar_default(y))
        tx = Tensor._from_class(g.const(x, c.shape, d, c.device))
        ty = Tensor._from_class(g.const(y, c.shape, d, c.device))
    a, b = tx._operand(ty)
    shape = broadcast_shapes(c.shape, a.shape)
    c, a, b = c.bool()._broadcast_to(shape), a._broadcast_to(shape), b._broadcast_to(shape)
    if c.device != a.device:
        raise ValueError(f"expected all tensors on the same device, got {c.device} and {a.device}")
    return F.Where.apply(c, a, b)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """NumPy matmul: 1-D operands gain (and lose) an axis, batch axes broadcast."""
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        raise TypeError("matmul needs two tensors")
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul: operands must have at least 1 dimension, got shapes {a.shape} and {b.shape}")
    a, b = a._on_compute(), b._on_compute()
    if a.device != b.device:
        raise ValueError(f"expected all tensors on the same device, got {a.device} and {b.device}")
    d = dtypes.promote_types(a.dtype, b.dtype)
    a1, b1 = a.ndim == 1, b.ndim == 1
    x = a.reshape(1, a.shape[0]) if a1 else a
    y = b.reshape(b.shape[0], 1) if b1 else b
    if x.shape[-1] != y.shape[-2]:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align (inner sizes {x.shape[-1]} and "
                         f"{y.shape[-2]})")
    batch = broadcast_shapes(x.shape[:-2], y.shape[:-2])
    m, k, n = x.shape[-2], x.shape[-1], y.shape[-1]
    acc = dtypes.float32 if d in (dtypes.float16, dtypes.bfloat16) else (dtypes.int64 if d.kind == "b" else d)
    if acc.is_float and x.dtype is acc and y.dtype is acc and y.shape[:-2] == batch:
        # the same graph as below, as one autograd node. A left operand broadcast over the batch (a convolution's
        # weight) is expanded first: the right operand's gradient is then x^T @ grad in its own layout (k, n), not
        # the (n, k) transpose the composite path reduces into (a convolution's col2im read it 288 floats apart)
        if x.shape[:-2] != batch:
            x = x._broadcast_to(batch + (m, k))
        out = F.MatMul.apply(x, y)
    else:
        x = x.cast(acc)._broadcast_to(batch + (m, k)) if x.shape[:-2] != batch else x.cast(acc)
        y = y.cast(acc)._broadcast_to(batch + (k, n)) if y.shape[:-2] != batch else y.cast(acc)
        prod = x.reshape(batch + (m, 1, k)) * y.transpose(-1, -2).reshape(batch + (1, n, k))
        out = prod.sum(-1).cast(d)
    if a1 and b1:
        return out.reshape(())
    if a1:
        return out.reshape(batch + (n,))
    if b1:
        return out.reshape(batch + (m,))
    return out


def _index_tensor(idx, x: Tensor, axis: int) -> Tensor:
    if isinstance(idx, (list, tuple)) and len(idx) == 0:
        idx = np.zeros(0, np.int64)  # an empty list selects nothing (NumPy reads it as integers, not floats)
    t = idx if isinstance(idx, Tensor) else Tensor(np.asarray(idx), device=x.device)
    if t.dtype.kind == "b":
        raise IndexError("boolean mask indexing is not supported (its result shape depends on the data); "
                         "use where() instead")
    if not t.dtype.is_int:
        raise IndexError(f"tensors used as indices must be integers, got {t.dtype.name}")
    n = x.shape[axis]
    if t.cls.realized and t.device == "host" and capture.active is None:  # captured: computed, as replays see it
        vals = t.numpy()
        if vals.size and (vals.min() < -n or vals.max() >= n):
            bad = vals[(vals < -n) | (vals >= n)].reshape(-1)[0]
            raise IndexError(f"index {bad} is out of bounds for axis {axis} with size {n}")
    return t


def _index_operand(index, x: Tensor, axis: int | None, name: str) -> Tensor:
    """``index`` as an integer tensor on ``x``'s device, range-checked against ``axis`` (None: ``x`` flattened)
    when its values are at hand (``_index_tensor``)."""
    t = _index_tensor(index, x if axis is not None else x.reshape(-1), axis or 0)
    if t.device != x.device:
        raise ValueError(f"{name}: the index is on {t.device} and the tensor on {x.device}; move one with "
                         f".to(device)")
    return t


def _expand_index(x: Tensor, index) -> list:
    """``index`` as a list with one entry per axis of ``x`` (the ellipsis, or the missing trailing axes, become
    full slices), ``None`` entries kept in place."""
    if not isinstance(index, tuple):
        index = (index,)
    is_tensor = [isinstance(ix, (Tensor, list, np.ndarray)) for ix in index]
    if sum(is_tensor) > 1:
        raise IndexError("indexing with more than one integer tensor is not supported; index one axis at a time")
    n_real = sum(1 for ix in index if ix is not None and ix is not Ellipsis)
    if sum(1 for ix in index if ix is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if n_real > x.ndim:
        raise IndexError(f"too many indices for a tensor of dimension {x.ndim} (got {n_real})")
    full: list = []
    for ix in index:
        full.extend([slice(None)] * (x.ndim - n_real) if ix is Ellipsis else [ix])
    if not any(ix is Ellipsis for ix in index):
        full.extend([slice(None)] * (x.ndim - n_real))
    return full


def _advanced_first(full: list) -> bool:
    """NumPy's placement rule: advanced indices (ints count when a tensor index is present) that are not adjacent
    put their result dimensions first."""
    adv = [i for i, ix in enumerate(full) if isinstance(ix, (int, np.integer, Tensor, list, np.ndarray))]
    return adv[-1] - adv[0] + 1 != len(adv)


def _getitem(x: Tensor, index) -> Tensor:
    """NumPy basic indexing (ints, slices, None, Ellipsis) plus one integer tensor on one axis."""
    full = _expand_index(x, index)
    spec, gather_axis, gather_index, axis = [], None, None, 0
    for ix in full:
        if ix is None:
            continue
        size = x.shape[axis]
        if isinstance(ix, slice):
            spec.append(ix.indices(size))
        elif isinstance(ix, (bool, np.bool_)):
            raise IndexError("boolean scalar indices are not supported")
        elif isinstance(ix, (int, np.integer)):
            i = int(ix)
            if not -size <= i < size:
                raise IndexError(f"index {i} is out of bounds for axis {axis} with size {size}")
            i %= size
            spec.append((i, i + 1, 1))
        elif isinstance(ix, (Tensor, list, np.ndarray)):
            spec.append((0, size, 1))
            gather_axis, gather_index = axis, _index_tensor(ix, x, axis)
        else:
            raise IndexError(f"unsupported index {ix!r} of type {type(ix).__name__}")
        axis += 1
    y = x._shrink(spec)
    if gather_index is not None:
        y = F.Gather.apply(y, gather_index.detach(), axis=gather_axis)
    shape, p, gather_at = [], 0, 0
    for ix in full:
        if ix is None:
            shape.append(1)
        elif isinstance(ix, slice):
            shape.append(y.shape[p])
            p += 1
        elif isinstance(ix, (int, np.integer)):
            p += 1
        else:
            gather_at = len(shape)
            shape.extend(gather_index.shape)
            p += gather_index.ndim
    y = y.reshape(tuple(shape))
    if gather_index is not None:
        if gather_at and _advanced_first(full):
            nd = gather_index.ndim
            order = list(range(gather_at, gather_at + nd)) + [i for i in range(y.ndim)
                                                              if not gather_at <= i < gather_at + nd]
            y = y.permute(order)
    return y


def _setitem(x: Tensor, index, value) -> Tensor:
    """The value of ``x`` after NumPy's ``x[index] = value``: ``value`` (cast to ``x``'s dtype) broadcast to
    ``x[index]``'s shape, spread over ``x``'s shape by a gather per indexed axis (by position maps built here)
    and put in place by one select. Indices as in ``_getitem``; a tensor index must be 1-D and its values are
    read now (repeated positions: the last write wins, as in NumPy)."""
    full = _expand_index(x, index)
    target = _getitem(x, index).shape  # checks the index; the graph it builds is dropped
    v = value if isinstance(value, Tensor) else Tensor(np.asarray(value), device=x.device)
    if v.device != x.device:
        raise ValueError(f"x[...] = v: the value is on {v.device} and the tensor on {x.device}; move one with "
                         f".to(device)")
    try:
        v = v.cast(x.dtype).broadcast_to(target)
    except ValueError:
        raise ValueError(f"x[...] = v: a value of shape {v.shape} does not broadcast to x[index]'s shape "
                         f"{target}") from None
    block, maps, axis, shape, tensor_at = [], [], 0, [], None
    for ix in full:
        if ix is None:
            shape.append(1)
            continue
        n = x.shape[axis]
        if isinstance(ix, slice):
            positions = np.arange(*ix.indices(n), dtype=np.int64)
            shape.append(len(positions))
        elif isinstance(ix, (int, np.integer)):
            positions = np.array([int(ix) % n], np.int64)
        else:
            # (its dtype was checked by _getitem) a tensor's values: realized now; inside zyx.jit a CaptureError
            positions = (ix.numpy() if isinstance(ix, Tensor) else np.asarray(ix)).astype(np.int64)
            if positions.ndim != 1:
                raise IndexError(f"x[...] = v takes a 1-D integer tensor index, got shape {positions.shape}")
            if positions.size and (positions.min() < -n or positions.max() >= n):
                bad = positions[(positions < -n) | (positions >= n)][0]
                raise IndexError(f"index {bad} is out of bounds for axis {axis} with size {n}")
            positions %= max(n, 1)
            tensor_at = len(shape)
            shape.append(len(positions))
        block.append(len(positions))
        if len(positions) == n and np.array_equal(positions, np.arange(n)):
            maps.append(None)  # the whole axis, in order
        else:
            kmap, mask = np.zeros(n, np.int64), np.zeros(n, np.bool_)
            kmap[positions] = np.arange(len(positions))  # repeated positions keep the last
            mask[positions] = True
            maps.append((kmap, mask))
        axis += 1
    if tensor_at and _advanced_first(full):  # undo NumPy's move of the tensor index's dimension to the front
        v = v.permute(list(range(1, tensor_at + 1)) + [0] + list(range(tensor_at + 1, v.ndim)))
    out, select = v.reshape(tuple(block)), None
    for d, m in enumerate(maps):
        if m is not None:
            out = F.Gather.apply(out, Tensor(m[0], device=x.device), axis=d)  # (0 into an empty block: masked)
            here = Tensor(m[1].reshape([-1 if i == d else 1 for i in range(x.ndim)]), device=x.device)
            select = here if select is None else select & here
    return out if select is None else where(select, out, x)


def realize(*tensors: Tensor) -> None:
    """Realize several tensors in one schedule (shared work is computed once). Realized tensors (including
    tensors on "disk", which are data already) are left as they are."""
    schedule.realize([t.cls for t in tensors if not t.cls.realized])


def cat(tensors: Sequence[Tensor], axis: int = 0, dim=None) -> Tensor:
    axis = _alias(axis, dim)
    ts = [t._on_compute() for t in tensors]
    if not ts:
        raise ValueError("cat: needs at least one tensor")
    nd = ts[0].ndim
    if nd == 0:
        raise ValueError("cat: zero-dimensional tensors cannot be concatenated; use stack")
    ax = _norm_axis(axis, nd)
    for t in ts[1:]:
        if t.ndim != nd or any(a != b for i, (a, b) in enumerate(zip(t.shape, ts[0].shape)) if i != ax):
            raise ValueError(f"cat: shapes {ts[0].shape} and {t.shape} differ outside axis {ax}")
    d = ts[0].dtype
    for t in ts[1:]:
        d = dtypes.promote_types(d, t.dtype)
    ts = [t for t in ts if t.shape[ax]] or ts[:1]
    if len(ts) == 1:
        return ts[0].cast(d)
    # a select chain over the position along the axis: each element is exactly one piece's element (every bit
    # kept, -0.0 and NaN payloads too); the host splits the loop into one segment per piece (O(output) work)
    ends = list(itertools.accumulate(t.shape[ax] for t in ts))
    total = ends[-1]
    pos = Tensor._from_class(g.iota(total, dtypes.int64, ts[0].device)).reshape(
        tuple(total if i == ax else 1 for i in range(nd)))
    out = None
    for t, start, end in reversed(list(zip(ts, [0] + ends[:-1], ends))):
        pads = [(0, 0)] * nd
        pads[ax] = (start, total - end)
        piece = t.cast(d).pad(pads)
        out = piece if out is None else where(pos < end, piece, out)
    return out


def stack(tensors: Sequence[Tensor], axis: int = 0, dim=None) -> Tensor:
    axis = _alias(axis, dim)
    ts = list(tensors)
    if not ts:
        raise ValueError("stack: needs at least one tensor")
    for t in ts[1:]:
        if t.shape != ts[0].shape:
            raise ValueError(f"stack: all tensors need the same shape, got {ts[0].shape} and {t.shape}")
    ax = _norm_axis(axis, ts[0].ndim, "insert")
    return cat([t.unsqueeze(ax) for t in ts], ax)


_seed = [0, 0]  # seed, counter


def manual_seed(seed: int) -> None:
    """Seed the counter-based generator: the same seed gives the same numbers on every device."""
    _seed[0] = int(seed) & ((1 << 64) - 1)
    _seed[1] = 0


def _random_bits(shape, device: str | None) -> Tensor:
    """64 random bits per element: splitmix64 of (seed, counter + linear index), counter advanced."""
    shape = _new_shape(shape)
    n = math.prod(shape)
    dev = _device(device)
    seed = Tensor._from_class(var_class(_seed[0], dtypes.uint64, dev))
    off = Tensor._from_class(var_class(_seed[1], dtypes.uint64, dev))
    _seed[1] += n

    def advance(seed_cls=seed.cls, off_cls=off.cls) -> None:  # a replay draws new numbers, as a call would
        seed_cls.var_value, off_cls.var_value = _seed[0], _seed[1]
        _seed[1] += n

    capture.on_replay(advance)
    i = Tensor._from_class(g.iota(n, dtypes.uint64, dev))
    z = (i + off + 1) * 0x9E3779B97F4A7C15 + seed
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    z = z ^ (z >> 31)
    return z.reshape(shape)


def rand(*shape, dtype=None, device: str | None = None) -> Tensor:
    d = dtypes.to_dtype(dtype) if dtype is not None else dtypes.default_float
    bits = _random_bits(shape, device)
    return ((bits >> 40).cast(dtypes.float32) * (1.0 / (1 << 24))).cast(d)


def randn(*shape, dtype=None, device: str | None = None) -> Tensor:
    d = dtypes.to_dtype(dtype) if dtype is not None else dtypes.default_float
    bits = _random_bits(shape, device)
    u1 = 1.0 - (bits >> 40).cast(dtypes.float32) * (1.0 / (1 << 24))  # (0, 1]
    u2 = (bits & 0xFFFFFF).cast(dtypes.float32) * (1.0 / (1 << 24))
    return ((-2.0 * u1.log()).sqrt() * (u2 * (2 * math.pi)).cos()).cast(d)


def randint(low: int, high: int | None = None, size=(), dtype=None, device: str | None = None) -> Tensor:
    if high is None:
        low, high = 0, low
    if high <= low:
        raise ValueError(f"randint: high ({high}) must be greater than low ({low})")
    d = dtypes.to_dtype(dtype) if dtype is not None else dtypes.int64
    bits = _random_bits(size if isinstance(size, (tuple, list)) else (size,), device)
    return ((bits % (high - low)).cast(dtypes.int64) + low).cast(d)


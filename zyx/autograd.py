"""Differentiable primitives: each ``Function`` builds its forward graph and, for backward, the graph of the
input gradients from the output gradient. Composite ops in ``zyx.tensor`` are made of these, so their
gradients follow.

Invariants:
- ``Function.apply`` records the context only when grad mode is on and an input requires grad.
- Backward methods receive and return graph classes (``zyx.graph.node.Class``), never realize anything;
  the backward pass is lazy and fuses like the forward.
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Sequence

from zyx import dtypes
from zyx.graph import ops as g
from zyx.graph.node import Class
from zyx.ops import Ops

_state = threading.local()


def grad_enabled() -> bool:
    return getattr(_state, "enabled", True)


class no_grad:  # noqa: N801 - PyTorch's name
    """Context manager (and decorator) that turns off gradient recording."""

    def __enter__(self) -> None:
        self.prev = grad_enabled()
        _state.enabled = False

    def __exit__(self, *exc) -> None:
        _state.enabled = self.prev

    def __call__(self, fn):
        def wrapped(*a, **k):
            with no_grad():
                return fn(*a, **k)

        wrapped.__name__ = getattr(fn, "__name__", "wrapped")
        wrapped.__doc__ = getattr(fn, "__doc__", None)
        return wrapped


class enable_grad(no_grad):  # noqa: N801
    def __enter__(self) -> None:
        self.prev = grad_enabled()
        _state.enabled = True


class Function:
    """A differentiable primitive. Subclasses define ``forward(*classes, **kw)`` and ``backward(grad)``."""

    def __init__(self, *parents) -> None:
        self.parents = parents
        self.needs = tuple(p.requires_grad for p in parents)

    def forward(self, *xs: Class, **kw) -> Class:
        raise NotImplementedError

    def backward(self, grad: Class) -> tuple[Class | None, ...]:
        raise NotImplementedError

    tensor_type: type = None  # zyx.Tensor, set when zyx.tensor is imported (avoids an import cycle)
    # ``forward`` without the context, for outputs that record none (no input needs grad, or grad mode off):
    # a function of the input classes (and keywords) building exactly the graph ``forward`` builds; None: none.
    direct = None

    @classmethod
    def apply(cls, *tensors, **kw):
        """Build the forward graph of ``tensors`` (the context's parents); the output records the context only
        when grad mode is on and an input requires grad. (``Function.__init__`` inlined: this is the per-op hot
        path.)"""
        n = len(tensors)
        if n == 2:
            a, b = tensors
            if cls.direct is not None and not ((a.requires_grad or b.requires_grad)
                                               and getattr(_state, "enabled", True)):
                return _from_class(cls.direct(a.cls, b.cls, **kw))  # no context to record
        elif n == 1:
            a = tensors[0]
            if cls.direct is not None and not (a.requires_grad and getattr(_state, "enabled", True)):
                return _from_class(cls.direct(a.cls, **kw))
        ctx = _new(cls)
        ctx.parents = tensors
        if n == 1:
            needs = ctx.needs = (a.requires_grad,)
            c = ctx.forward(a.cls, **kw) if kw else ctx.forward(a.cls)
        elif n == 2:
            needs = ctx.needs = (a.requires_grad, b.requires_grad)
            c = ctx.forward(a.cls, b.cls, **kw) if kw else ctx.forward(a.cls, b.cls)
        else:
            needs = ctx.needs = tuple([t.requires_grad for t in tensors])
            c = ctx.forward(*[t.cls for t in tensors], **kw)
        out = _from_class(c)
        if True in needs and getattr(_state, "enabled", True):
            out.requires_grad = True
            out._ctx = ctx
        return out


_new = object.__new__
_from_class = None  # zyx.Tensor._from_class, set when zyx.tensor is imported (avoids an import cycle)


def _const_like(x: Class, v) -> Class:
    return g.const(v, x.shape, x.dtype, x.device)


def _mul(a: Class, b: Class) -> Class:
    return g.binary(Ops.MUL, a, b)


def _div(a: Class, b: Class) -> Class:
    return g.binary(Ops.DIV, a, b)


def _neg(a: Class) -> Class:
    return g.unary(Ops.NEG, a)


# ---- unary -----------------------------------------------------------------------------------------------------


class Unary(Function):
    op: Ops

    def forward(self, x: Class) -> Class:
        self.x = x
        self.y = g.unary(self.op, x)
        return self.y


class Neg(Unary):
    op = Ops.NEG

    def backward(self, grad):
        return (_neg(grad),)


class Exp(Unary):
    op = Ops.EXP

    def backward(self, grad):
        return (_mul(grad, self.y),)


class Exp2(Unary):
    op = Ops.EXP2

    def backward(self, grad):
        return (_mul(grad, _mul(self.y, _const_like(self.y, math.log(2)))),)


class Log(Unary):
    op = Ops.LOG

    def backward(self, grad):
        return (_div(grad, self.x),)


class Log2(Unary):
    op = Ops.LOG2

    def backward(self, grad):
        return (_div(grad, _mul(self.x, _const_like(self.x, math.log(2)))),)


class Sin(Unary):
    op = Ops.SIN

    def backward(self, grad):
        return (_mul(grad, g.unary(Ops.COS, self.x)),)


class Cos(Unary):
    op = Ops.COS

    def backward(self, grad):
        return (_neg(_mul(grad, g.unary(Ops.SIN, self.x))),)


class Tan(Unary):
    op = Ops.TAN

    def backward(self, grad):
        return (_mul(grad, g.binary(Ops.ADD, _const_like(self.y, 1), _mul(self.y, self.y))),)


class Tanh(Unary):
    op = Ops.TANH

    def backward(self, grad):
        return (_mul(grad, g.binary(Ops.SUB, _const_like(self.y, 1), _mul(self.y, self.y))),)


class Erf(Unary):
    op = Ops.ERF

    def backward(self, grad):
        e = g.unary(Ops.EXP, _neg(_mul(self.x, self.x)))
        return (_mul(grad, _mul(e, _const_like(e, 2 / math.sqrt(math.pi)))),)


class Sqrt(Unary):
    op = Ops.SQRT

    def backward(self, grad):
        return (_div(grad, _mul(self.y, _const_like(self.y, 2))),)


class Recip(Unary):
    op = Ops.RECIP

    def backward(self, grad):
        return (_neg(_mul(grad, _mul(self.y, self.y))),)


class Abs(Unary):
    op = Ops.ABS

    def backward(self, grad):
        x = self.x
        zero = _const_like(x, 0)
        sign = g.binary(Ops.SUB, g.cast(g.binary(Ops.CMPLT, zero, x), x.dtype),
                        g.cast(g.binary(Ops.CMPLT, x, zero), x.dtype))
        return (_mul(grad, sign),)


class Cast(Function):
    def forward(self, x: Class, dtype=None) -> Class:
        self.src = x.dtype
        return g.cast(x, dtype)

    def backward(self, grad):
        return (g.cast(grad, self.src),)


# ---- binary ----------------------------------------------------------------------------------------------------


class Add(Function):
    def forward(self, a, b):
        return g.binary(Ops.ADD, a, b)

    def backward(self, grad):
        return grad, grad


class Sub(Function):
    def forward(self, a, b):
        return g.binary(Ops.SUB, a, b)

    def backward(self, grad):
        return grad, _neg(grad)


class Mul(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return g.binary(Ops.MUL, a, b)

    def backward(self, grad):
        return (_mul(grad, self.b) if self.needs[0] else None, _mul(grad, self.a) if self.needs[1] else None)


def matmul_graph(x: Class, y: Class) -> Class:
    """``x (*batch, m, k) @ y (*batch, k, n)`` (one dtype, equal batch shapes): the classes ``Tensor.matmul``'s
    composite path builds (the operands viewed as (*batch, m, 1, k) and (*batch, 1, n, k), multiplied, summed
    over k), so hash-consing and the matmul matcher see the very same graph."""
    *batch, m, k = x.shape
    batch = tuple(batch)
    nb, n = len(batch), y.shape[-1]
    full = batch + (m, n, k)
    xr = g.expand(g.reshape(x, batch + (m, 1, k)), full)
    yr = g.expand(g.reshape(g.permute(y, tuple(range(nb)) + (nb + 1, nb)), batch + (1, n, k)), full)
    return g.reshape(g.reduce(Ops.ADD, g.binary(Ops.MUL, xr, yr), (nb + 2,)), batch + (m, n))


class MatMul(Function):
    """A float matmul of equal batch shapes as one node: its backward builds the two matmuls ``grad @ y^T`` and
    ``x^T @ grad`` directly (the composite path records a reshape, permute, expand, multiply and sum node each,
    and differentiates every one of them)."""

    def forward(self, x, y):
        self.x, self.y = x, y
        return matmul_graph(x, y)

    def backward(self, grad):
        nb = len(grad.shape) - 2
        swap = tuple(range(nb)) + (nb + 1, nb)
        x, y = self.x, self.y
        dx = dy = None
        # A transposed operand (Linear's weight.T) gets its gradient as the transpose of a matmul in its source's
        # layout: the permute backward then cancels it, and the gradient is contiguous in the weight's shape.
        if self.needs[0]:
            dx = g.permute(matmul_graph(y, g.permute(grad, swap)), swap) if x.op is Ops.PERMUTE else \
                matmul_graph(grad, g.permute(y, swap))
        if self.needs[1]:
            dy = g.permute(matmul_graph(g.permute(grad, swap), x), swap) if y.op is Ops.PERMUTE else \
                matmul_graph(g.permute(x, swap), grad)
        return dx, dy


MatMul.direct = matmul_graph


def log_softmax_graph(x: Class, axis: int) -> Class:
    """``x - logsumexp(x, axis)`` as the composite path builds it: the row max (0 where it is infinite) is
    subtracted before ``exp``, added back after ``log``."""
    m = g.reduce(Ops.MAX, x, (axis,))
    m = g.where(g.unary(Ops.ISINF, m), g.const(0.0, m.shape, m.dtype, m.device), m)
    e = g.unary(Ops.EXP, g.binary(Ops.SUB, x, g.expand(m, x.shape)))
    lse = g.binary(Ops.ADD, g.unary(Ops.LOG, g.reduce(Ops.ADD, e, (axis,))), m)
    return g.binary(Ops.SUB, x, g.expand(lse, x.shape))


class LogSoftmax(Function):
    """``log_softmax`` along one axis as one node: backward is ``grad - softmax * sum(grad)`` (the composite
    path would differentiate its max, where, exp, sum, log and subtractions one by one)."""

    def forward(self, x, axis=-1):
        self.axis = axis
        self.out = log_softmax_graph(x, axis)
        return self.out

    def backward(self, grad):
        total = g.expand(g.reduce(Ops.ADD, grad, (self.axis,)), grad.shape)
        return (g.binary(Ops.SUB, grad, g.binary(Ops.MUL, g.unary(Ops.EXP, self.out), total)),)


LogSoftmax.direct = staticmethod(lambda x, axis=-1: log_softmax_graph(x, axis))


class Div(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        return g.binary(Ops.DIV, a, b)

    def backward(self, grad):
        ga = _div(grad, self.b) if self.needs[0] else None
        gb = _neg(_div(_mul(grad, self.a), _mul(self.b, self.b))) if self.needs[1] else None
        return ga, gb


class Pow(Function):
    def forward(self, a, b):
        self.a, self.b = a, b
        self.y = g.binary(Ops.POW, a, b)
        return self.y

    def backward(self, grad):
        a, b = self.a, self.b
        ga = gb = None
        if self.needs[0]:
            # d/da a^b = b * a^(b-1); written as b * y / a where a != 0
            pm1 = g.binary(Ops.POW, a, g.binary(Ops.SUB, b, _const_like(b, 1)))
            ga = _mul(grad, _mul(b, pm1))
        if self.needs[1]:
            zero = _const_like(a, 0)
            loga = g.where(g.binary(Ops.CMPLT, zero, a), g.unary(Ops.LOG, a), zero)
            gb = _mul(grad, _mul(self.y, loga))
        return ga, gb


class _MaxMin(Function):
    op: Ops

    def forward(self, a, b):
        self.a, self.b = a, b
        self.y = g.binary(self.op, a, b)
        return self.y

    def backward(self, grad):
        a, b = self.a, self.b
        # ties split the gradient evenly (PyTorch's maximum/minimum)
        ea = g.cast(g.binary(Ops.CMPEQ, a, self.y), a.dtype)
        eb = g.cast(g.binary(Ops.CMPEQ, b, self.y), a.dtype)
        total = g.binary(Ops.ADD, ea, eb)
        total = g.where(g.binary(Ops.CMPEQ, total, _const_like(total, 0)), _const_like(total, 1), total)
        return _mul(grad, _div(ea, total)), _mul(grad, _div(eb, total))


class Maximum(_MaxMin):
    op = Ops.MAX


class Minimum(_MaxMin):
    op = Ops.MIN


class Where(Function):
    def forward(self, c, a, b):
        self.c = c
        return g.where(c, a, b)

    def backward(self, grad):
        zero = _const_like(grad, 0)
        return None, g.where(self.c, grad, zero), g.where(self.c, zero, grad)


# ---- reduce ----------------------------------------------------------------------------------------------------


class Sum(Function):
    def forward(self, x, axes=()):
        self.shape = x.shape
        return g.reduce(Ops.ADD, x, axes)

    def backward(self, grad):
        return (g.expand(grad, self.shape),)


class _Extreme(Function):
    kind: Ops

    def forward(self, x, axes=()):
        self.x = x
        self.axes = axes
        self.y = g.reduce(self.kind, x, axes)
        return self.y

    def backward(self, grad):
        x = self.x
        hit = g.cast(g.binary(Ops.CMPEQ, x, g.expand(self.y, x.shape)), x.dtype)
        count = g.expand(g.reduce(Ops.ADD, hit, self.axes), x.shape)
        return (_mul(g.expand(grad, x.shape), _div(hit, count)),)


class Max(_Extreme):
    kind = Ops.MAX


class Min(_Extreme):
    kind = Ops.MIN


def _is_zero(x: Class) -> Class:
    return g.binary(Ops.CMPEQ, x, _const_like(x, 0))


class Prod(Function):
    def forward(self, x, axes=()):
        self.x, self.axes = x, axes
        self.y = g.reduce(Ops.MUL, x, axes)
        return self.y

    def backward(self, grad):
        # the product of the others, without reading the data: y / x_i when no element is 0; with one 0, the
        # product of the nonzero others at the 0 and 0 elsewhere; with more, 0 everywhere (PyTorch's values)
        x, shape = self.x, self.x.shape
        zero = _is_zero(x)
        count = g.expand(g.reduce(Ops.ADD, g.cast(zero, dtypes.int32), self.axes), shape)
        others = g.expand(g.reduce(Ops.MUL, g.where(zero, _const_like(x, 1), x), self.axes), shape)
        one_zero = g.binary(Ops.CMPEQ, count, _const_like(count, 1))
        at_zero = g.where(one_zero, others, _const_like(x, 0))
        return (_mul(g.expand(grad, shape), g.where(zero, at_zero, _div(g.expand(self.y, shape), x))),)


class Scan(Function):
    def forward(self, x, op=Ops.ADD, axis=0):
        self.x, self.op, self.axis = x, op, axis
        self.y = g.scan(op, x, axis)
        return self.y

    def _reverse_cumsum(self, c: Class) -> Class:
        """``c[..., i] + c[..., i+1] + ...`` along the scanned axis."""
        ax, n = self.axis, self.x.shape[self.axis]
        rev = tuple((n - 1, -1, -1) if i == ax else (0, s, 1) for i, s in enumerate(self.x.shape))
        return g.shrink(g.scan(Ops.ADD, g.shrink(c, rev), ax), rev)

    def backward(self, grad):
        # d out_k / d x_i (i <= k) is 1 for a sum: a reverse running sum. For a product it is out_k / x_i, the
        # reverse running sum of grad * out divided by x_i; that holds at every nonzero x_i and gives 0 at every 0
        # after the first (their outputs are all 0). At the first 0 it is the product of the others: the running
        # product with that 0 taken as 1.
        if self.op == Ops.ADD:
            return (self._reverse_cumsum(grad),)
        x, ax = self.x, self.axis
        one = _const_like(x, 1)
        zero = _is_zero(x)
        seen = g.scan(Ops.ADD, g.cast(zero, dtypes.int32), ax)
        first = g.binary(Ops.AND, zero, g.binary(Ops.CMPEQ, seen, _const_like(seen, 1)))
        ratio = _div(self._reverse_cumsum(_mul(grad, self.y)), g.where(zero, one, x))
        at_first = self._reverse_cumsum(_mul(grad, g.scan(Ops.MUL, g.where(first, one, x), ax)))
        return (g.where(first, at_first, ratio),)


# ---- movement --------------------------------------------------------------------------------------------------


class Reshape(Function):
    def forward(self, x, shape=()):
        self.src = x.shape
        return g.reshape(x, shape)

    def backward(self, grad):
        return (g.reshape(grad, self.src),)


class Permute(Function):
    def forward(self, x, order=()):
        self.order = order
        return g.permute(x, order)

    def backward(self, grad):
        inv = [0] * len(self.order)
        for i, o in enumerate(self.order):
            inv[o] = i
        return (g.permute(grad, tuple(inv)),)


class Expand(Function):
    def forward(self, x, shape=()):
        self.src = x.shape
        return g.expand(x, shape)

    def backward(self, grad):
        axes = tuple(i for i, (s, o) in enumerate(zip(self.src, grad.shape)) if s != o)
        return (g.reduce(Ops.ADD, grad, axes),)


class Pad(Function):
    def forward(self, x, pads=(), fill=0):
        self.pads = pads
        self.src = x.shape
        return g.pad(x, pads, fill)

    def backward(self, grad):
        spec = tuple((a, a + s, 1) for (a, _), s in zip(self.pads, self.src))
        return (g.shrink(grad, spec),)


class Shrink(Function):
    def forward(self, x, spec=()):
        self.spec = spec
        self.src = x.shape
        return g.shrink(x, spec)

    def backward(self, grad):
        out = grad
        for axis, ((start, _stop, step), n) in enumerate(zip(self.spec, self.src)):
            out = _unshrink_axis(out, axis, start, step, n)
        return (out,)


def _unshrink_axis(grad: Class, axis: int, start: int, step: int, n: int) -> Class:
    """Place ``grad`` (the slice start::step of an axis of size n) back into zeros of size n."""
    k = grad.shape[axis]
    if (start, step) == (0, 1) and k == n:
        return grad
    if k == 0:
        shape = grad.shape[:axis] + (n,) + grad.shape[axis + 1:]
        return g.const(0, shape, grad.dtype, grad.device)
    if step < 0:
        # the slice visits start, start+step, ...: flip it to ascending order first
        grad = g.shrink(grad, tuple((k - 1, -1, -1) if i == axis else (0, s, 1) for i, s in enumerate(grad.shape)))
        start, step = start + (k - 1) * step, -step
    pads = [(0, 0)] * len(grad.shape)
    if step > 1:
        # interleave zeros: (.., k, ..) -> (.., k, step, ..) -> (.., k*step, ..)
        shape = grad.shape[:axis + 1] + (1,) + grad.shape[axis + 1:]
        x = g.reshape(grad, shape)
        p = [(0, 0)] * len(shape)
        p[axis + 1] = (0, step - 1)
        x = g.pad(x, tuple(p))
        grad = g.reshape(x, grad.shape[:axis] + (k * step,) + grad.shape[axis + 1:])
        length = k * step
    else:
        length = k
    after = n - start - length
    if after < 0:
        grad = g.shrink(grad, tuple((0, n - start, 1) if i == axis else (0, s, 1) for i, s in enumerate(grad.shape)))
        after = 0
    pads[axis] = (start, after)
    return g.pad(grad, tuple(pads))


def windows_graph(x: Class, axis: int, kernel: int, stride: int, dilation: int) -> Class:
    """Sliding windows along ``axis``: ``(..., n, ...) -> (..., o, kernel, ...)``, element ``[i, j]`` being
    ``x[i * stride + j * dilation]`` with ``o = (n - dilation * (kernel - 1) - 1) // stride + 1``: a gather by an
    index built from iotas, which the lowering turns into affine index arithmetic (one load per element)."""
    o = (x.shape[axis] - dilation * (kernel - 1) - 1) // stride + 1
    i64, dev = dtypes.int64, x.device

    def scaled(n: int, step: int, shape: tuple[int, int]) -> Class:
        v = g.binary(Ops.MUL, g.iota(n, i64, dev), g.const(step, (n,), i64, dev))
        return g.expand(g.reshape(v, (n, 1) if shape[0] == n else (1, n)), (o, kernel))

    index = g.binary(Ops.ADD, scaled(o, stride, (o, 1)), scaled(kernel, dilation, (1, kernel)))
    return g.gather(x, index, axis)


class Windows(Function):
    def forward(self, x, axis=0, kernel=1, stride=1, dilation=1):
        self.n, self.axis, self.kernel, self.stride, self.dilation = x.shape[axis], axis, kernel, stride, dilation
        return windows_graph(x, axis, kernel, stride, dilation)

    def backward(self, grad):
        return (overlap_add_graph(grad, self.axis, self.stride, self.dilation, self.n),)


def overlap_add_graph(x: Class, axis: int, stride: int, dilation: int, n: int) -> Class:
    """The adjoint of ``windows_graph``: ``(..., o, kernel, ...) -> (..., n, ...)``, adding element ``[i, j]`` into
    position ``i * stride + j * dilation`` (k strided placements, summed). With ``n = (o - 1) * stride +
    dilation * (kernel - 1) + 1`` the windows of the result have ``o`` positions again."""
    if stride > 1:
        return overlap_add_nd(x, ((axis, axis + 1),), (stride,), (dilation,), (n,))
    shape, total = x.shape, None  # k placements, each a pad
    for j in range(shape[axis + 1]):
        pick = tuple((j, j + 1, 1) if i == axis + 1 else (0, s, 1) for i, s in enumerate(shape))
        xj = g.reshape(g.shrink(x, pick), shape[:axis + 1] + shape[axis + 2:])
        placed = _unshrink_axis(xj, axis, j * dilation, stride, n)
        total = placed if total is None else g.binary(Ops.ADD, total, placed)
    return total


def overlap_add_nd(x: Class, axes: Sequence[tuple[int, int]], strides: Sequence[int], dilations: Sequence[int],
                   sizes: Sequence[int]) -> Class:
    """``overlap_add_graph`` over several axes at once, by phases. ``axes`` pairs a position axis of ``x`` (extent
    ``o``) with its kernel axis (extent ``k``, anywhere in ``x``); the result drops the kernel axes and gives each
    position axis extent ``n``. Along one axis, output ``t = stride * m + r`` receives ``x[m + c, j]`` from exactly
    the taps ``j`` with ``(r - j * dilation) % stride == 0`` (``c = (r - j * dilation) / stride``), so each phase
    (one ``r`` per axis) is a sum of shifted slices (pads, no division), and the phases interleave by one reshape
    per axis. The phases fuse into the interleave: on the host, ``opt.unroll_divmod_loops`` (after
    ``opt.split_ragged_phases`` where the crop leaves an extent the stride does not divide) gives each phase its
    own copy of the stores, which reads only its taps. (Stored apart and read back by the interleave, as before
    that pass, they cost a kernel and a round trip through memory: conv_transpose2d 4x4 stride 2 kernels 3.9-4.0
    -> 3.6-3.7 ms, a stride-2 3x3 convolution's training step 0.86x, a 3x3 stride-2 max pool's 0.75-0.83x.) All
    axes in one pass: a transposed convolution's col2im reads its columns once and stores one interleave, where
    one axis at a time stored and re-read every axis's phases. (A gather by ``(t - j * dilation) / stride`` costs
    a floor division and a remainder per tap; zero-interleaving each tap by reshapes divides by every extent.)"""
    kernel_axes = {k for _, k in axes}
    keep = [i for i in range(len(x.shape)) if i not in kernel_axes]  # x's axes that the result keeps, in order
    out_at = {a: keep.index(a) for a, _ in axes}
    ms = [-(-n // s) for n, s in zip(sizes, strides)]
    phase_shape = list(x.shape[i] for i in keep)
    for (a, _), m in zip(axes, ms):
        phase_shape[out_at[a]] = m
    residues = list(itertools.product(*(range(s) for s in strides)))  # one phase per tuple
    phases = []
    for rs in residues:
        taps_per_axis = [[j for j in range(x.shape[k]) if (r - j * d) % s == 0]
                         for (_, k), r, s, d in zip(axes, rs, strides, dilations)]
        total = None  # the taps keep their kernel axes (size 1) until the phase is summed: one reshape per phase
        for js in itertools.product(*taps_per_axis):
            pick = [(0, sz, 1) for sz in x.shape]
            pads = [(0, 0)] * len(x.shape)
            for (a, k), j, r, s, d, m in zip(axes, js, rs, strides, dilations, ms):
                c = (r - j * d) // s  # phase element mm reads x[mm + c]
                lo, hi = max(0, c), min(x.shape[a], m + c)  # the x rows that land inside [0, m)
                if lo >= hi:
                    break
                pick[k], pick[a] = (j, j + 1, 1), (lo, hi, 1)
                pads[a] = (lo - c, m - (hi - c))
            else:
                placed = g.pad(g.shrink(x, tuple(pick)), tuple(pads))
                total = placed if total is None else g.binary(Ops.ADD, total, placed)
        phases.append(g.const(0, tuple(phase_shape), x.dtype, x.device) if total is None else
                      g.reshape(total, tuple(phase_shape)))
    if len(phases) == 1:
        y = phases[0]
    else:  # each phase axis m gets a unit axis after it, padded to the stride: (..., m, s, ...) -> (..., m * s)
        inter, unit_at = [], {}
        for i, sz in enumerate(phase_shape):
            inter.append(sz)
            if i in out_at.values():
                unit_at[i] = len(inter)
                inter.append(1)
        y = None
        for rs, ph in zip(residues, phases):
            pads = [(0, 0)] * len(inter)
            for (a, _), r, s in zip(axes, rs, strides):
                pads[unit_at[out_at[a]]] = (r, s - 1 - r)
            placed = g.pad(g.reshape(ph, tuple(inter)), tuple(pads))
            y = placed if y is None else g.binary(Ops.ADD, y, placed)
        merged = list(phase_shape)
        for (a, _), m, s in zip(axes, ms, strides):
            merged[out_at[a]] = m * s
        y = g.reshape(y, tuple(merged))
    crop = [(0, sz, 1) for sz in y.shape]
    for (a, _), n in zip(axes, sizes):
        crop[out_at[a]] = (0, n, 1)
    return g.shrink(y, tuple(crop))


class OverlapAdd(Function):
    """Windows' adjoint as a differentiable op (a transposed convolution's col2im) over the (position axis, kernel
    axis) pairs ``axes`` (``overlap_add_nd``); its gradient is the windows of the gradient."""

    def forward(self, x, axes=((0, 1),), strides=(1,), dilations=(1,)):
        self.axes, self.strides, self.dilations = tuple(axes), tuple(strides), tuple(dilations)
        self.x_shape = x.shape
        sizes = tuple((x.shape[a] - 1) * s + d * (x.shape[k] - 1) + 1
                      for (a, k), s, d in zip(axes, strides, dilations))
        return overlap_add_nd(x, self.axes, self.strides, self.dilations, sizes)

    def backward(self, grad):
        kernel_axes = {k for _, k in self.axes}
        labels = [i for i in range(len(self.x_shape)) if i not in kernel_axes]  # x's axis at each grad axis
        for (a, k), s, d in sorted(zip(self.axes, self.strides, self.dilations), key=lambda t: -t[0][0]):
            at = labels.index(a)  # the last position axis first: the earlier ones keep their places
            grad = windows_graph(grad, at, self.x_shape[k], s, d)
            labels.insert(at + 1, k)
        return (g.permute(grad, tuple(labels.index(i) for i in range(len(labels)))),)


class FirstMax(Function):
    """The maximum over the last axis (kept, size 1) whose gradient goes to the first maximal element only (NaN
    counts as maximal, as it propagates): PyTorch's max pooling, which routes by its argmax, where ``Max`` splits
    the gradient among ties."""

    def forward(self, x):
        self.x = x
        self.y = g.reduce(Ops.MAX, x, (len(x.shape) - 1,))
        return self.y

    def backward(self, grad):
        x, k = self.x, self.x.shape[-1]
        i64, dev = dtypes.int64, x.device
        hit = g.binary(Ops.OR, g.binary(Ops.CMPEQ, x, g.expand(self.y, x.shape)), g.unary(Ops.ISNAN, x))
        pos = g.expand(g.reshape(g.iota(k, i64, dev), (1,) * (len(x.shape) - 1) + (k,)), x.shape)
        first = g.reduce(Ops.MIN, g.where(hit, pos, g.const(k, x.shape, i64, dev)), (len(x.shape) - 1,))
        chosen = g.binary(Ops.CMPEQ, pos, g.expand(first, x.shape))
        return (g.where(chosen, g.expand(grad, x.shape), g.const(0, x.shape, grad.dtype, grad.device)),)


class Gather(Function):
    def forward(self, x, index, axis=0):
        self.x_shape, self.index, self.axis = x.shape, index, axis
        return g.gather(x, index, axis)

    def backward(self, grad):
        # grad: pre + index.shape + post; each element adds into x at its index along ``axis``
        axis, idx = self.axis, self.index
        pre, post, ni = self.x_shape[:axis], self.x_shape[axis + 1:], len(idx.shape)
        at = len(pre) + ni
        return _add_at_index(g.reshape(grad, pre + idx.shape + (1,) + post),
                             g.reshape(idx, (1,) * len(pre) + idx.shape + (1,) + (1,) * len(post)),
                             self.x_shape[axis], at, tuple(range(len(pre), at)), self.x_shape), None


class TakeAlong(Function):
    def forward(self, x, index, axis=0):
        self.x_shape, self.index, self.axis = x.shape, index, axis
        return g.take_along(x, index, axis)

    def backward(self, grad):
        # grad has the index's shape; each element adds into x at its index along ``axis``
        axis, shape = self.axis, self.index.shape
        split = shape[:axis + 1] + (1,) + shape[axis + 1:]
        return _add_at_index(g.reshape(grad, split), g.reshape(self.index, split), self.x_shape[axis], axis + 1,
                             (axis,), self.x_shape), None


def _add_at_index(grad: Class, index: Class, n: int, at: int, summed: tuple[int, ...],
                  shape: tuple[int, ...]) -> Class:
    """The sum of ``grad``'s elements into ``n`` slots by ``index`` (both with a size-1 axis ``at`` and
    broadcasting against each other): a one-hot comparison along ``at``, reduced over ``summed``, then
    ``shape``. Negative indices count from the end; out of range ones add nowhere (as the forward reads 0)."""
    ii = g.cast(index, dtypes.int64)
    ii = g.where(g.binary(Ops.CMPLT, ii, g.const(0, ii.shape, dtypes.int64, ii.device)),
                 g.binary(Ops.ADD, ii, g.const(n, ii.shape, dtypes.int64, ii.device)), ii)
    full = tuple(b if a == 1 else a for a, b in zip(grad.shape, ii.shape))
    full = full[:at] + (n,) + full[at + 1:]
    ar = g.reshape(g.iota(n, dtypes.int64, ii.device), (1,) * at + (n,) + (1,) * (len(full) - at - 1))
    hit = g.binary(Ops.CMPEQ, g.expand(ii, full), g.expand(ar, full))
    masked = g.where(hit, g.expand(grad, full), g.const(0, full, grad.dtype, grad.device))
    return g.reshape(g.reduce(Ops.ADD, masked, summed), shape)


class Copy(Function):
    def forward(self, x, device=""):
        self.src = x.device
        return g.copy_to(x, device)

    def backward(self, grad):
        return (g.copy_to(grad, self.src),)


class Contiguous(Function):
    def forward(self, x):
        return g.contiguous(x)

    def backward(self, grad):
        return (grad,)


# ---- context-free forwards (``Function.direct``): each builds exactly the graph of its ``forward`` ------------

for _fn, _op in ((Add, Ops.ADD), (Sub, Ops.SUB), (Mul, Ops.MUL), (Div, Ops.DIV), (Pow, Ops.POW), (Maximum, Ops.MAX),
                 (Minimum, Ops.MIN)):
    _fn.direct = functools.partial(g.binary, _op)
for _fn in Unary.__subclasses__():
    _fn.direct = functools.partial(g.unary, _fn.op)


def _direct(fn):
    return staticmethod(fn)


# graph functions whose parameters carry the keywords' names serve as they are (no Python frame in between)
Max.direct, Min.direct = _direct(functools.partial(g.reduce, Ops.MAX)), _direct(functools.partial(g.reduce, Ops.MIN))
Cast.direct = _direct(g.cast)
Sum.direct = _direct(functools.partial(g.reduce, Ops.ADD))
Prod.direct = _direct(functools.partial(g.reduce, Ops.MUL))
Scan.direct = _direct(lambda x, op=Ops.ADD, axis=0: g.scan(op, x, axis))
Reshape.direct = _direct(g.reshape)
Permute.direct = _direct(g.permute)
Expand.direct = _direct(g.expand)
Pad.direct = _direct(g.pad)
Shrink.direct = _direct(g.shrink)
Gather.direct = _direct(lambda x, index, axis=0: g.gather(x, index, axis))
TakeAlong.direct = _direct(lambda x, index, axis=0: g.take_along(x, index, axis))
Windows.direct = _direct(lambda x, axis=0, kernel=1, stride=1, dilation=1: windows_graph(x, axis, kernel, stride,
                                                                                      dilation))
Copy.direct = _direct(lambda x, device="": g.copy_to(x, device))
Contiguous.direct = _direct(g.contiguous)

"""Pattern matching in the graph: strided views through movement ops, and matmul recognition.

``match_matmul(cls)`` recognises what ``@``/``matmul``/``dot`` lower to: a sum over one axis of a product
of two operands, where each operand is a strided view (reshape/permute/expand/shrink, optionally a float
widening cast) of a base class, one operand varies along "m" axes but not "n" axes, the other along "n"
but not "m", both along the summed "k" axis. It returns shapes, layouts (strides into the bases, so
transposed operands need no copy) and dtypes; devices decide whether and at what cost they can run it.

It does not match: a sum over an axis that is not shared (an operand constant along it, e.g. an expand of
size 1), a product with no sum, a max-reduce, or anything whose operands are not views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zyx.dtypes import DType
from zyx.graph.node import Class, contiguous_strides
from zyx.ops import Ops


@dataclass(frozen=True)
class View:
    """A class read as a strided view of ``base`` (contiguous, in elements) at ``offset``; ``cast``: the float
    dtype the values are widened to on the way (inputs stay in ``base.dtype``), or None."""

    base: Class
    strides: tuple[int, ...]
    offset: int
    cast: DType | None = None


def _reshape_strides(old_shape, old_strides, new_shape) -> tuple[int, ...] | None:
    """Strides viewing the same elements with ``new_shape``, or None when a copy is needed (NumPy's rule)."""
    old = [(s, st) for s, st in zip(old_shape, old_strides) if s != 1]
    new_strides = [0] * len(new_shape)
    oi = ni = 0
    new_nonunit = [i for i, s in enumerate(new_shape) if s != 1]
    while oi < len(old) and ni < len(new_nonunit):
        # grow a group on both sides until the element counts agree
        o_start, n_start = oi, ni
        o_size, n_size = old[oi][0], new_shape[new_nonunit[ni]]
        while o_size != n_size:
            if o_size < n_size:
                oi += 1
                if oi >= len(old):
                    return None
                o_size *= old[oi][0]
            else:
                ni += 1
                if ni >= len(new_nonunit):
                    return None
                n_size *= new_shape[new_nonunit[ni]]
        for j in range(o_start, oi):  # the old group must be contiguous among itself
            if old[j][1] != old[j + 1][0] * old[j + 1][1]:
                return None
        st = old[oi][1]
        for j in range(ni, n_start - 1, -1):
            new_strides[new_nonunit[j]] = st
            st *= new_shape[new_nonunit[j]]
        oi += 1
        ni += 1
    if oi != len(old) or ni != len(new_nonunit):
        return None
    return tuple(new_strides)


_MOVES = (Ops.RESHAPE, Ops.PERMUTE, Ops.EXPAND, Ops.SHRINK)


def _widening(c: Class) -> bool:
    return c.op is Ops.CAST and c.dtype.is_float and c.srcs[0].dtype.is_float and \
        c.srcs[0].dtype.itemsize <= c.dtype.itemsize


def view_of(c: Class) -> View:
    """Peel movement ops (and one float widening cast, which commutes with them) off ``c``; the rest is the
    base, read contiguously. Always succeeds: a reshape that is not a view becomes the base itself."""
    cast_seen = False
    cur = c
    while not cur.realized and (cur.op in _MOVES or (not cast_seen and _widening(cur))):
        cast_seen |= cur.op is Ops.CAST
        cur = cur.srcs[0]
    return _walk(c, cur)


def _walk(c: Class, base: Class) -> View:
    """Strides of ``c`` over ``base`` through the movement ops (and the cast) between them."""
    chain, cast, cur = [], None, c
    while cur is not base:
        if cur.op is Ops.CAST:
            cast = cur.dtype
        else:
            chain.append(cur)
        cur = cur.srcs[0]
    # a constant is one value broadcast: stride 0 on every axis (read as dense, a ones-gradient of shape (m, n, k)
    # made the matmul backward of ``(a @ b).sum()`` a batch of GEMVs over an m * n * k materialized constant)
    strides = (0,) * len(base.shape) if base.op is Ops.CONST else contiguous_strides(base.shape)
    offset, shape = 0, base.shape
    for m in reversed(chain):
        node = m.node
        if node.op is Ops.PERMUTE:
            strides = tuple(strides[o] for o in node.arg)
        elif node.op is Ops.EXPAND:
            strides = tuple(0 if s == 1 and n != 1 else st for s, n, st in zip(shape, m.shape, strides))
        elif node.op is Ops.SHRINK:
            offset += sum(start * st for (start, _), st in zip(node.arg, strides))
            strides = tuple(st * step for (_, step), st in zip(node.arg, strides))
        else:
            new = _reshape_strides(shape, strides, m.shape)
            if new is None:  # not expressible as a view: read that reshape (materialized) as the base
                return _walk(c, m)
            strides = new
        shape = m.shape
    return View(base, strides, offset, cast)


@dataclass(frozen=True)
class Operand:
    view: View
    batch_strides: tuple[int, ...]
    row_stride: int  # along m (for a) or k (for b)
    col_stride: int  # along k (for a) or n (for b)

    @property
    def dtype(self) -> DType:
        return self.view.base.dtype


@dataclass(frozen=True)
class Matmul:
    """C[batch, m, n] = sum_k A[batch, m, k] * B[batch, k, n] computing class ``cls`` (contiguous output)."""

    cls: Class
    batch: tuple[int, ...]
    m: int
    n: int
    k: int
    a: Operand
    b: Operand
    out_batch_strides: tuple[int, ...]
    out_row_stride: int
    out_col_stride: int
    acc_dtype: DType

    @property
    def flops(self) -> int:
        return 2 * math.prod(self.batch) * self.m * self.n * self.k

    def input_dtypes(self) -> tuple[DType, DType]:
        return self.a.dtype, self.b.dtype


def _merge(dims: list[int], shape, *stride_sets) -> tuple[int, list[int]] | None:
    """Merge several axes into one strided axis when every stride set allows it (outer = inner * size)."""
    dims = sorted(dims)
    for strides in stride_sets:
        for a, b in zip(dims, dims[1:]):
            if strides[a] != strides[b] * shape[b]:
                return None
    return math.prod(shape[d] for d in dims), [stride[dims[-1]] for stride in stride_sets]


def match_matmul(c: Class) -> Matmul | None:
    if c.realized or c.op is not Ops.REDUCE:
        return None
    rop, axes = c.node.arg
    if rop != Ops.ADD or len(axes) != 1:
        return None
    prod = c.srcs[0]
    if prod.realized or prod.op is not Ops.MUL or not prod.dtype.is_float:
        return None
    kax = axes[0]
    shape = prod.shape
    va, vb = view_of(prod.srcs[0]), view_of(prod.srcs[1])
    sa, sb = va.strides, vb.strides
    if sa[kax] == 0 or sb[kax] == 0:
        return None  # not a shared axis: one operand is constant along it
    out_strides = contiguous_strides(c.shape)
    m_dims, n_dims, batch_dims = [], [], []
    for d, size in enumerate(shape):
        if d == kax or size == 1:
            continue
        if sa[d] and not sb[d]:
            m_dims.append(d)
        elif sb[d] and not sa[d]:
            n_dims.append(d)
        else:
            batch_dims.append(d)
    # several m (or n) axes: merge them when contiguous in the operand and the output, else batch them
    m_info = _merge(m_dims, shape, sa, out_strides) if m_dims else (1, [0, 0])
    if m_info is None:
        batch_dims += m_dims[:-1]
        m_dims = m_dims[-1:]
        m_info = (shape[m_dims[0]], [sa[m_dims[0]], out_strides[m_dims[0]]])
    n_info = _merge(n_dims, shape, sb, out_strides) if n_dims else (1, [0, 0])
    if n_info is None:
        batch_dims += n_dims[:-1]
        n_dims = n_dims[-1:]
        n_info = (shape[n_dims[0]], [sb[n_dims[0]], out_strides[n_dims[0]]])
    batch_dims.sort()
    m, (a_m, c_m) = m_info
    n, (b_n, c_n) = n_info
    if m == 1 and n == 1 and batch_dims:
        return None  # a batch of dot products (a row-wise sum of a product), not a matmul
    k = shape[kax]
    acc = c.dtype
    if not acc.is_float:
        return None
    a = Operand(va, tuple(sa[d] for d in batch_dims), a_m, sa[kax])
    b = Operand(vb, tuple(sb[d] for d in batch_dims), sb[kax], b_n)
    return Matmul(c, tuple(shape[d] for d in batch_dims), m, n, k, a, b,
                  tuple(out_strides[d] for d in batch_dims), c_m, c_n, acc)


@dataclass(frozen=True)
class BiasAdd:
    """``cls = matmul.cls + bias``: the matmul's result read element for element (its reshape dropping the reduced
    axis), plus ``bias``, a view over ``cls.shape`` that is constant along every axis but the last (stride 1 there):
    ``nn.Linear``'s ``x @ w.T + b``."""

    cls: Class
    matmul: Matmul
    bias: View


def match_bias_add(c: Class, matmul_of: dict[int, Matmul]) -> BiasAdd | None:
    """The bias add ``c`` computes over one of the matmuls of ``matmul_of`` (keyed by ``id`` of their class)."""
    if c.realized or c.op is not Ops.ADD or not c.shape:
        return None
    for x, y in (c.srcs, c.srcs[::-1]):
        xv = view_of(x)
        mm = matmul_of.get(id(xv.base))
        if (mm is None or xv.offset != 0 or xv.cast is not None or x.numel != xv.base.numel
                or any(st != cs for size, st, cs in zip(x.shape, xv.strides, contiguous_strides(x.shape))
                       if size != 1)):
            continue
        yv = view_of(y)
        last = len(c.shape) - 1
        if yv.cast is None and yv.offset >= 0 and all(
                st == (1 if i == last else 0) for i, (size, st) in enumerate(zip(c.shape, yv.strides)) if size != 1):
            return BiasAdd(c, mm, yv)
    return None

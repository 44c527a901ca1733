"""Find the contraction in a kernel: its only reduce is ``sum over one range k of a(m, k) * b(k, n)``.

Target independent (the host's register tiling uses it, ``opt.tile_gemm``; the CUDA mma path's
16-bit variant, ``kernel.gpu.find_contraction``, builds on it). Imports nothing outside ``zyx.kernel``.
"""

from __future__ import annotations

from dataclasses import dataclass

from zyx.kernel import ir
from zyx.kernel.ir import Expr, Kernel
from zyx.ops import Ops


@dataclass(frozen=True)
class Contraction:
    """``red`` = sum over ``k`` of ``a * b``; ``a`` depends on ``m`` and ``k`` (and batch loops), not ``n``; ``b`` on
    ``n`` and ``k`` (and batch loops), not ``m``. ``m`` and ``n`` are output loops, ``m`` the outer of the two.
    ``a`` and ``b`` are any expressions (loads, casts, prologue arithmetic) free of reduces, scans and locals."""

    red: Expr
    m: Expr
    n: Expr
    k: Expr
    a: Expr
    b: Expr


_OPAQUE = (Ops.REDUCE, Ops.SCAN, Ops.STASH, Ops.LOCAL)


def find_contraction(k: Kernel) -> Contraction | None:
    """The contraction that is ``k``'s only reduce, or ``None``. Every store depends on the reduce only through
    values of the output loops, so each output element needs exactly one dot product."""
    if k.scan_ranges() or k.split_reduce or not k.loops:
        return None
    reds = k.reduces()
    if len(reds) != 1:
        return None
    (red,) = reds
    op, ranges = red.arg
    v = red.srcs[0]
    if op is not Ops.ADD or len(ranges) != 1 or v.op is not Ops.MUL or v.dtype is not red.dtype:
        return None
    (kr,) = ranges
    x, y = v.srcs
    if any(e.op in _OPAQUE for e in ir.toposort([x, y])):
        return None
    loops = set(k.loops)
    if kr not in x.ranges or kr not in y.ranges or not (x.ranges | y.ranges) - {kr} <= loops:
        return None
    only_x, only_y = x.ranges - y.ranges - {kr}, y.ranges - x.ranges - {kr}
    if not only_x or not only_y:
        return None
    # several loops of one operand alone (a batch the other is broadcast over): the innermost is m (or n), the
    # others batch loops
    m, n = max(only_x, key=k.loops.index), max(only_y, key=k.loops.index)
    if k.loops.index(m) > k.loops.index(n):
        m, n, x, y = n, m, y, x
    return Contraction(red, m, n, kr, x, y)


__all__ = ["Contraction", "find_contraction"]

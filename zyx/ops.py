"""The op vocabulary of every layer: one enum, ``Ops``, and its category sets.

Graph nodes (``zyx.graph.node``) and kernel expressions (``zyx.kernel.ir``) draw their ops from this enum, so
an elementwise op is the same member in both and lowering passes it through. Some members exist at one
level only, as their comments say: movement, leaves and materialization ops are graph ops, and the lowering
turns them into index arithmetic, loads and kernels; ranges, loads and local arrays are kernel ops. Where a
member's meaning depends on the dtype it is stated here once, for both levels.

This module imports nothing from zyx: every layer may import it.
"""

from __future__ import annotations

import enum


class Ops(enum.IntEnum):
    # leaves
    BUFFER = enum.auto()  # graph: realized; the class holds the Buffer
    CONST = enum.auto()  # arg = Python scalar (graph: shape ())
    VAR = enum.auto()  # scalar whose value is a launch argument, not part of the structure (kernel: arg = index)
    IOTA = enum.auto()  # graph: 0..n-1 along the only axis
    RANGE = enum.auto()  # kernel: a loop variable, arg = (range id, size)
    LOAD = enum.auto()  # kernel: srcs = (index,) or (index, gate); arg = param index
    # elementwise unary
    NEG = enum.auto()
    NOT = enum.auto()  # logical not on bool, bitwise not on integers
    EXP = enum.auto()
    EXP2 = enum.auto()
    LOG = enum.auto()
    LOG2 = enum.auto()
    SIN = enum.auto()
    COS = enum.auto()
    TAN = enum.auto()
    TANH = enum.auto()
    ERF = enum.auto()
    SQRT = enum.auto()
    RECIP = enum.auto()
    ABS = enum.auto()
    FLOOR = enum.auto()
    CEIL = enum.auto()
    ROUND = enum.auto()  # half to even
    TRUNC = enum.auto()
    ISNAN = enum.auto()
    ISINF = enum.auto()
    # elementwise binary
    ADD = enum.auto()
    SUB = enum.auto()
    MUL = enum.auto()
    DIV = enum.auto()  # true division on floats; floor division on integers (NumPy) with x // 0 = 0
    IDIV = enum.auto()  # graph: floor division on every dtype, NumPy semantics
    MOD = enum.auto()  # remainder with the divisor's sign (NumPy), x % 0 = 0 on integers; kernel: integers only
    FMOD = enum.auto()  # kernel, floats: C fmod (the dividend's sign); the lowering builds float MOD from it
    POW = enum.auto()
    MAX = enum.auto()  # NaN-propagating
    MIN = enum.auto()
    CMPLT = enum.auto()
    CMPLE = enum.auto()
    CMPEQ = enum.auto()
    CMPNE = enum.auto()
    AND = enum.auto()
    OR = enum.auto()
    XOR = enum.auto()
    SHL = enum.auto()
    SHR = enum.auto()
    # ternary
    WHERE = enum.auto()
    # conversion (arg = the target dtype in graphs)
    CAST = enum.auto()
    BITCAST = enum.auto()  # kernel
    # loops. graph: arg = (op in REDUCE_OPS, axes) / (op in SCAN_OPS, axis), a scan always its own kernel.
    # kernel: REDUCE srcs = (value,), arg = (op, ranges), dtype = the accumulator's; SCAN srcs = (value, range):
    # the fold of ``value`` over range values <= the current, arg = op
    REDUCE = enum.auto()
    SCAN = enum.auto()
    # kernel: local (stack) arrays, host only (``opt.stash_row_values``)
    STASH = enum.auto()  # srcs = (value, range), arg = slot: ``value``; also written to local array ``slot[range]``
    LOCAL = enum.auto()  # srcs = (index, after), arg = (slot, size): ``slot[index]``, read after the reduce ``after``
    # graph: movement (index arithmetic in the consumer, never a launch)
    RESHAPE = enum.auto()  # arg = new shape
    PERMUTE = enum.auto()  # arg = order
    EXPAND = enum.auto()  # arg = new shape
    PAD = enum.auto()  # arg = (((before, after), ...), fill value)
    SHRINK = enum.auto()  # arg = ((start, step), ...) with the output shape; negative steps flip
    GATHER = enum.auto()  # srcs = (x, index), arg = axis: x[..., index[j...], ...] for every index element
    TAKE_ALONG = enum.auto()  # srcs = (x, index), arg = axis: x at each output position with its ``axis``
    # coordinate replaced by the index value there (index and x agree off ``axis``; the output has the index's shape)
    # GATHER and TAKE_ALONG: a negative index counts from the end, one out of range reads 0
    # graph: materialization
    COPY = enum.auto()  # arg = destination device name
    CONTIGUOUS = enum.auto()
    KERNEL = enum.auto()  # a library alternative (arg: a backends.base.LibraryKernel)


Ops.__hash__ = object.__hash__  # members are singletons: identity hashing is exact and much faster

UNARY = frozenset({Ops.NEG, Ops.NOT, Ops.EXP, Ops.EXP2, Ops.LOG, Ops.LOG2, Ops.SIN, Ops.COS, Ops.TAN, Ops.TANH,
                   Ops.ERF, Ops.SQRT, Ops.RECIP, Ops.ABS, Ops.FLOOR, Ops.CEIL, Ops.ROUND, Ops.TRUNC, Ops.ISNAN,
                   Ops.ISINF})
BINARY = frozenset({Ops.ADD, Ops.SUB, Ops.MUL, Ops.DIV, Ops.IDIV, Ops.MOD, Ops.FMOD, Ops.POW, Ops.MAX, Ops.MIN,
                    Ops.CMPLT, Ops.CMPLE, Ops.CMPEQ, Ops.CMPNE, Ops.AND, Ops.OR, Ops.XOR, Ops.SHL, Ops.SHR})
ELEMENTWISE = UNARY | BINARY | {Ops.WHERE, Ops.CAST}  # one output element from the same element of each input
COMPARE = frozenset({Ops.CMPLT, Ops.CMPLE, Ops.CMPEQ, Ops.CMPNE, Ops.ISNAN, Ops.ISINF})  # bool results
TRANSCENDENTAL = frozenset({Ops.EXP, Ops.EXP2, Ops.LOG, Ops.LOG2, Ops.SIN, Ops.COS, Ops.TAN, Ops.TANH, Ops.ERF,
                            Ops.POW})
MOVEMENT = frozenset({Ops.RESHAPE, Ops.PERMUTE, Ops.EXPAND, Ops.PAD, Ops.SHRINK})
REDUCE_OPS = frozenset({Ops.ADD, Ops.MUL, Ops.MAX, Ops.MIN, Ops.OR, Ops.AND})
SCAN_OPS = frozenset({Ops.ADD, Ops.MUL})
IDEMPOTENT = frozenset({Ops.MAX, Ops.MIN, Ops.OR, Ops.AND})  # reducing copies of one value gives that value

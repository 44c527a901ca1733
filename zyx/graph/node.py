"""The lazy graph: hash-consed nodes grouped in equivalence classes.

Invariants:
- A ``Class`` is one value (shape, dtype, device). ``nodes[0]`` is the node the tensor op built; devices may
  append alternatives (``Op.KERNEL`` library nodes) that compute the same value.
- Node construction is hash-consed: the same op on the same input classes with the same argument returns
  the existing class (free CSE). The cache holds classes weakly, so a class no live tensor reaches is freed
  (and leaves the cache at once).
- A realized class holds a ``Buffer`` and no nodes: its inputs are released, and it leaves the hash-cons
  cache (its key named classes that may be gone).
- Shapes are tuples of non-negative ints; ``REDUCE`` keeps reduced axes as size 1.
"""

from __future__ import annotations

import enum
import math
import weakref
from dataclasses import dataclass

from zyx.backends.base import Pool
from zyx.dtypes import DType
from zyx.utils import STATS


class Op(enum.Enum):
    # leaves
    BUFFER = "buffer"  # realized; the class holds the Buffer
    CONST = "const"  # arg = python scalar; shape ()
    VAR = "var"  # scalar whose value is a launch argument, not part of the structure; shape ()
    IOTA = "iota"  # 0..n-1 along the only axis
    # elementwise unary
    NEG = "neg"
    NOT = "not"
    EXP = "exp"
    EXP2 = "exp2"
    LOG = "log"
    LOG2 = "log2"
    SIN = "sin"
    COS = "cos"
    TAN = "tan"
    TANH = "tanh"
    ERF = "erf"
    SQRT = "sqrt"
    RECIP = "recip"
    ABS = "abs"
    FLOOR = "floor"
    CEIL = "ceil"
    ROUND = "round"
    TRUNC = "trunc"
    ISNAN = "isnan"
    ISINF = "isinf"
    CAST = "cast"
    # elementwise binary
    ADD = "add"
    SUB = "sub"
    MUL = "mul"
    DIV = "div"  # true division (float operands)
    IDIV = "idiv"  # floor division, NumPy semantics
    MOD = "mod"  # remainder with the divisor's sign, NumPy semantics
    POW = "pow"
    MAX = "max"
    MIN = "min"
    CMPLT = "cmplt"
    CMPLE = "cmple"
    CMPEQ = "cmpeq"
    CMPNE = "cmpne"
    AND = "and"
    OR = "or"
    XOR = "xor"
    SHL = "shl"
    SHR = "shr"
    WHERE = "where"
    # reduce: arg = (op name in {"add", "mul", "max", "min", "or", "and"}, axes)
    REDUCE = "reduce"
    # inclusive scan along one axis: arg = (op name in {"add", "mul"}, axis); always stored (its own kernel)
    SCAN = "scan"
    # movement (index arithmetic in the consumer, never a launch)
    RESHAPE = "reshape"  # arg = new shape
    PERMUTE = "permute"  # arg = order
    EXPAND = "expand"  # arg = new shape
    PAD = "pad"  # arg = (((before, after), ...), fill value)
    SHRINK = "shrink"  # arg = ((start, step), ...) with the output shape; negative steps flip
    GATHER = "gather"  # srcs = (x, index), arg = axis
    # materialization
    COPY = "copy"  # arg = destination device name
    CONTIGUOUS = "contiguous"
    KERNEL = "kernel"  # a library alternative (see LibraryKernel)


Op.__hash__ = object.__hash__  # members are singletons: identity hashing is exact and much faster

UNARY = frozenset({Op.NEG, Op.NOT, Op.EXP, Op.EXP2, Op.LOG, Op.LOG2, Op.SIN, Op.COS, Op.TAN, Op.TANH, Op.ERF,
                   Op.SQRT, Op.RECIP, Op.ABS, Op.FLOOR, Op.CEIL, Op.ROUND, Op.TRUNC, Op.ISNAN, Op.ISINF, Op.CAST})
BINARY = frozenset({Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.IDIV, Op.MOD, Op.POW, Op.MAX, Op.MIN, Op.CMPLT, Op.CMPLE,
                    Op.CMPEQ, Op.CMPNE, Op.AND, Op.OR, Op.XOR, Op.SHL, Op.SHR})
ELEMENTWISE = UNARY | BINARY | {Op.WHERE}
MOVEMENT = frozenset({Op.RESHAPE, Op.PERMUTE, Op.EXPAND, Op.PAD, Op.SHRINK})
LEAVES = frozenset({Op.BUFFER, Op.CONST, Op.VAR, Op.IOTA})


class Buffer:
    """A reference to one pool buffer; releases it when the last Python reference goes."""

    __slots__ = ("pool", "id", "nbytes", "device", "__weakref__")

    def __init__(self, pool: Pool, buffer_id: int, nbytes: int, device: str) -> None:
        self.pool, self.id, self.nbytes, self.device = pool, buffer_id, nbytes, device

    def __del__(self) -> None:
        try:
            self.pool.release(self.id)
        except Exception:  # noqa: BLE001 - interpreter shutdown or a dead backend: nothing left to free
            pass


@dataclass(frozen=True, eq=False)
class LibraryKernel:
    """What a device's ``match_graph`` offers for a class: a program on that device and its estimated time.

    ``inputs`` are the classes the program reads, in launch-argument order (the output comes last); each
    input is materialized contiguously before the launch.
    """

    device: object
    program: int
    inputs: tuple
    est_ns: float
    name: str
    layout: object = None  # device-specific data (strides, transposition flags)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of ``shape`` (the last axis 1)."""
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


class Node:
    __slots__ = ("op", "srcs", "arg")

    def __init__(self, op: Op, srcs: tuple[Class, ...], arg) -> None:
        self.op, self.srcs, self.arg = op, srcs, arg

    def __repr__(self) -> str:
        return f"Node({self.op.name}, arg={self.arg!r}, srcs={len(self.srcs)})"


class Class:
    """One value of the graph: its shape, dtype, device, and the nodes (alternatives) that compute it."""

    __slots__ = ("shape", "dtype", "device", "nodes", "buffer", "key", "var_value", "__weakref__")

    def __init__(self, shape: tuple[int, ...], dtype: DType, device: str, node: Node | None) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self.nodes: list[Node] = [node] if node is not None else []
        self.buffer: Buffer | None = None
        self.key = None
        self.var_value = None

    @property
    def node(self) -> Node:
        return self.nodes[0]

    @property
    def op(self) -> Op:
        return Op.BUFFER if self.buffer is not None else self.nodes[0].op

    @property
    def srcs(self) -> tuple[Class, ...]:
        return () if self.buffer is not None else self.nodes[0].srcs

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def realized(self) -> bool:
        return self.buffer is not None

    def set_buffer(self, buffer: Buffer) -> None:
        """Become a leaf holding ``buffer``; forget how the value was computed."""
        self.buffer = buffer
        self.nodes = []
        key = self.key
        if key is not None:
            ref = _cache.get(key)
            if ref is not None and ref() is self:
                del _cache[key]  # the weak reference goes with the entry: its callback never runs
            self.key = None

    def __repr__(self) -> str:
        return f"Class({self.op.name}, {self.shape}, {self.dtype.name}, {self.device})"


# The hash-cons cache: key -> weak reference to the class. The key is ``(head, *srcs)`` with the head
# ``(op, karg, dtype, device, shape)`` (the structure key reuses it); it holds the source classes themselves
# (identity hashing), which the class holds anyway. Each reference (``_Ref``) carries its key and its callback
# pops that key: it can only run while the entry still holds that very reference (replacing or deleting the
# entry frees the reference, and a freed reference never calls back), so it never removes a newer class's entry.
# One Python call per class freed, no allocation besides the reference per class built.
_cache: dict = {}
_pop = _cache.pop
_CONST, _VAR, _PAD = Op.CONST, Op.VAR, Op.PAD


class _Ref(weakref.ref):
    """A weak reference to a class that knows its cache key (one object per class instead of a reference and
    a callback partial: graph building allocates fewer objects for the cyclic GC to scan)."""

    __slots__ = ("key",)


def _forget(ref: _Ref) -> None:
    _pop(ref.key, None)


def _new_ref(c, key) -> _Ref:
    r = _Ref(c, _forget)
    r.key = key
    return r


def _float_key(v):
    """A float as a cache-key part: itself when equality is exact identity of value, else its bit pattern
    (0.0 and -0.0 compare equal, NaN equals nothing)."""
    return v if v and v == v else ("f", v.hex())


def make(op: Op, srcs: tuple[Class, ...], arg, shape: tuple[int, ...], dtype: DType, device: str) -> Class:
    """The class computing ``op(srcs; arg)``: an existing one when the same node was built before.

    Invariant: two live unrealized classes never share a key, so equal keys mean the same value."""
    if op is _VAR:
        STATS["graph_nodes"] += 1
        return Class(shape, dtype, device, Node(op, srcs, arg))
    if op is _CONST:
        karg = _float_key(arg) if type(arg) is float else arg
    elif op is _PAD and type(arg[1]) is float:
        karg = (arg[0], _float_key(arg[1]))
    else:
        karg = arg
    key = ((op, karg, dtype, device, shape), *srcs)
    ref = _cache.get(key)
    if ref is not None:
        c = ref()
        if c is not None:
            return c
    c = Class(shape, dtype, device, Node(op, srcs, arg))
    c.key = key
    _cache[key] = _new_ref(c, key)
    STATS["graph_nodes"] += 1
    return c


def make_const(value, shape: tuple[int, ...], dtype: DType, device: str) -> Class:
    """``make(Op.CONST, (), value, shape, dtype, device)`` (the same key, so the same class), without the branches
    for other ops: constants are built once per scalar operand."""
    karg = (value if value and value == value else ("f", value.hex())) if type(value) is float else value
    key = ((_CONST, karg, dtype, device, shape),)
    ref = _cache.get(key)
    if ref is not None:
        c = ref()
        if c is not None:
            return c
    c = Class(shape, dtype, device, Node(_CONST, (), value))
    c.key = key
    _cache[key] = _new_ref(c, key)
    STATS["graph_nodes"] += 1
    return c


def leaf(buffer: Buffer, shape: tuple[int, ...], dtype: DType) -> Class:
    c = Class(shape, dtype, buffer.device, None)
    c.buffer = buffer
    return c


def var(value, dtype: DType, device: str) -> Class:
    c = make(Op.VAR, (), None, (), dtype, device)
    c.var_value = value
    return c


def live_classes() -> int:
    """Classes held by the hash-cons cache (for memory tests)."""
    return len(_cache)

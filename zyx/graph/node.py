"""The lazy graph: hash-consed nodes grouped in equivalence classes.

Invariants:
- A ``Class`` is one value (shape, dtype, device). ``nodes[0]`` is the node the tensor op built; devices may
  append alternatives (``Ops.KERNEL`` library nodes) that compute the same value.
- Node construction is hash-consed: the same op on the same input classes with the same argument returns
  the existing class (free CSE). The cache holds classes weakly, so a class no live tensor reaches is freed
  (and leaves the cache at once).
- A realized class holds a ``Buffer`` and no nodes: its inputs are released, and it leaves the hash-cons
  cache (its key named classes that may be gone).
- Shapes are tuples of non-negative ints; ``REDUCE`` keeps reduced axes as size 1.
"""

from __future__ import annotations

import math
import weakref

from zyx.backends.base import Pool
from zyx.dtypes import DType
from zyx.ops import Ops
from zyx.utils import STATS


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


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major element strides of ``shape`` (the last axis 1)."""
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


class Node:
    __slots__ = ("op", "srcs", "arg")

    def __init__(self, op: Ops, srcs: tuple[Class, ...], arg) -> None:
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
    def op(self) -> Ops:
        return Ops.BUFFER if self.buffer is not None else self.nodes[0].op

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
_new = object.__new__
_CONST, _VAR, _PAD = Ops.CONST, Ops.VAR, Ops.PAD


class _Ref(weakref.ref):
    """A weak reference to a class that knows its cache key (one object per class instead of a reference and
    a callback partial: graph building allocates fewer objects for the cyclic GC to scan)."""

    __slots__ = ("key",)


def _forget(ref: _Ref) -> None:
    _pop(ref.key, None)


def _float_key(v):
    """A float as a cache-key part: itself when equality is exact identity of value, else its bit pattern
    (0.0 and -0.0 compare equal, NaN equals nothing)."""
    return v if v and v == v else ("f", v.hex())


def make(op: Ops, srcs: tuple[Class, ...], arg, shape: tuple[int, ...], dtype: DType, device: str) -> Class:
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
    return _interned(key, shape, dtype, device, op, srcs, arg)


def _interned(key: tuple, shape: tuple[int, ...], dtype: DType, device: str, op: Ops, srcs: tuple, arg) -> Class:
    """A new class computing ``op(srcs; arg)``, entered in the cache under ``key``. Built slot by slot (every slot
    that ``Class.__init__`` and ``Node.__init__`` set): every graph op passes here, and each constructor's frame
    costs (about 1.5 us apiece when the interpreter's caches are cold)."""
    n = _new(Node)
    n.op, n.srcs, n.arg = op, srcs, arg
    c = _new(Class)
    c.shape, c.dtype, c.device, c.nodes, c.buffer, c.key, c.var_value = shape, dtype, device, [n], None, key, None
    r = _Ref(c, _forget)
    r.key = key
    _cache[key] = r
    STATS["graph_nodes"] += 1
    return c


def make_const(value, shape: tuple[int, ...], dtype: DType, device: str) -> Class:
    """``make(Ops.CONST, (), value, shape, dtype, device)`` (the same key, so the same class), without the branches
    for other ops: constants are built once per scalar operand."""
    karg = (value if value and value == value else ("f", value.hex())) if type(value) is float else value
    key = ((_CONST, karg, dtype, device, shape),)
    ref = _cache.get(key)
    if ref is not None:
        c = ref()
        if c is not None:
            return c
    return _interned(key, shape, dtype, device, _CONST, (), value)


def leaf(buffer: Buffer, shape: tuple[int, ...], dtype: DType) -> Class:
    c = Class(shape, dtype, buffer.device, None)
    c.buffer = buffer
    return c


def var(value, dtype: DType, device: str) -> Class:
    c = make(Ops.VAR, (), None, (), dtype, device)
    c.var_value = value
    return c


def live_classes() -> int:
    """Classes held by the hash-cons cache (for memory tests)."""
    return len(_cache)

"""Measured costs for extraction: with autotuning on, each matmul's alternatives are timed instead of estimated.

For a matmul class (``match_matmul``) that a device offered a library kernel for, both ways of computing it
run with ``Device.launch_timed`` (``autotune.steady_ns``: the statistic the kernel search uses too):
- generated: the kernels of a copy of the matmul's subgraph, planned without library alternatives (exactly what
  extraction's generated choice compiles). The copy reaches down to buffers through what generated code
  computes inside the kernel that reads it (elementwise, movement, gathers: a convolution's im2col columns);
  an operand computed by a kernel of its own (a reduce, a scan) is replaced by a zero-filled scratch buffer.
- library: the library program on scratch buffers, plus the generated kernels that materialize its inputs
  which are not buffers yet (a convolution's columns), timed the same way.
Buffers the copies read are the graph's own (read only); every output and intermediate is fresh. Times are kept
on disk (``<cache>/measured_costs.json``) keyed by the device, the matmul's signature and the alternative (the
library kernel's name; the generated kernels' source hash; a materialization's source hash), so a later process
times nothing it timed before.

What extraction gets: ``{(id(class), id(node)): ns}`` — the library node at its measured time (materializing its
inputs included), the generated ``REDUCE`` node at the generated kernels' time, and the classes both times cover
(the product, the views, the fused producers, the library's materialized inputs) at zero.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from zyx.backends.autotune import steady_ns
from zyx.backends.base import LibraryKernel
from zyx.graph.extract import needed
from zyx.graph.match import Matmul
from zyx.graph.node import Buffer, Class, leaf, make
from zyx.ops import ELEMENTWISE, MOVEMENT, Ops
from zyx.utils import STATS, cache_dir, log, write_atomic

Costs = dict[tuple[int, int], float]


class MeasuredCosts:
    """A JSON file of measured times (ns) by key, read once and rewritten atomically on every new entry."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_dir() / "measured_costs.json"
        self._data: dict[str, float] | None = None

    def _load(self) -> dict[str, float]:
        if self._data is None:
            try:
                self._data = {str(k): float(v) for k, v in json.loads(self.path.read_text()).items()}
            except (OSError, ValueError, AttributeError):
                self._data = {}
        return self._data

    def get(self, key: str) -> float | None:
        return self._load().get(key)

    def put(self, key: str, ns: float) -> None:
        data = self._load()
        data[key] = ns
        write_atomic(self.path, json.dumps(data))

    def clear_memory(self) -> None:
        """Forget what was read (the next ``get`` reads the file again), as a new process would."""
        self._data = None


STORE = MeasuredCosts()


def signature(m: Matmul) -> str:
    """Everything the time of computing ``m`` depends on, apart from the alternative and the device."""
    c = m.cls

    def operand(o) -> str:
        return f"{o.dtype.name}:{o.view.base.shape}:{o.view.strides}:{o.view.offset}:{o.view.cast}"

    return f"mm b{m.batch} m{m.m} n{m.n} k{m.k} a[{operand(m.a)}] b[{operand(m.b)}] -> {c.dtype.name}{c.shape}"


FUSED_PRODUCERS = ELEMENTWISE | MOVEMENT | {Ops.GATHER, Ops.TAKE_ALONG, Ops.IOTA, Ops.CONST, Ops.VAR}


def _fused_into_reader(base: Class) -> bool:
    """Whether generated code computes ``base`` inside the kernel that reads it: nothing between it and buffers
    is a kernel of its own (a reduce, a scan, a copy)."""
    seen: set[int] = set()
    stack = [base]
    while stack:
        c = stack.pop()
        if id(c) in seen or c.realized:
            continue
        seen.add(id(c))
        if not c.nodes or c.nodes[0].op not in FUSED_PRODUCERS:
            return False
        stack.extend(c.nodes[0].srcs)
    return True


def _computed(root: Class, stop: Mapping[int, Class]) -> list[Class]:
    """The unrealized classes ``root`` is computed from (itself last), sources first, not entering ``stop``."""
    return needed([root], {}, stop)


def _clone(inner: list[Class], subst: dict[int, Class]) -> Class:
    """``inner``'s last class rebuilt over ``subst``'s classes (by id of what they replace) and over new leaves
    holding the buffers of realized sources: new classes all (hash-consing would return the originals, which carry
    the library alternatives). Classes without sources (constants, iotas, scalar variables) are kept."""
    new: dict[int, Class] = dict(subst)

    def source(s: Class) -> Class:
        t = new.get(id(s))
        if t is None:
            t = new[id(s)] = leaf(s.buffer, s.shape, s.dtype) if s.realized else s
        return t

    for c in inner:
        n = c.nodes[0]
        new[id(c)] = c if not n.srcs else make(n.op, tuple(map(source, n.srcs)), n.arg, c.shape, c.dtype, c.device)
    return new[id(inner[-1])]


def _scratch(c: Class, pool) -> Buffer:
    """A zero-filled buffer of ``c``'s size in ``pool``."""
    b = Buffer(pool, pool.allocate(c.nbytes), c.nbytes, c.device)
    pool.host_to_pool(memoryview(bytes(c.nbytes)), b.id)
    return b


def _time_library(lib: LibraryKernel, out: Class, pool) -> float:
    bufs = [_scratch(c, pool) for c in (*lib.inputs, out)]
    return steady_ns(lambda: lib.device.launch_timed(lib.program, [b.id for b in bufs]))


def _timed(store: MeasuredCosts, key: str, timer: Callable[[], float]) -> float:
    """``store``'s time for ``key``, measured by ``timer`` (and kept) when it has none."""
    t = store.get(key)
    if t is None:
        STATS["measured_alternatives"] += 1
        t = timer()
        store.put(key, t)
    return t


class _Copies:
    """Copies of one matmul's subgraph for timing its generated kernels: down to buffers through fused producers,
    operands computed by kernels of their own replaced by scratch buffers. ``covered`` collects the classes the
    copied kernels compute."""

    def __init__(self, m: Matmul, pool, plan_generated: Callable[[Class], tuple[str, Callable[[], float]]]):
        bases = (m.a.view.base, m.b.view.base)
        self.stop = {id(b): b for b in bases if not b.realized and not _fused_into_reader(b)}
        self.subst = {i: leaf(_scratch(b, pool), b.shape, b.dtype) for i, b in self.stop.items()}
        self.plan_generated = plan_generated
        self.covered: set[Class] = set()

    def generated(self, x: Class) -> tuple[str, Callable[[], float]]:
        """``plan_generated`` of ``x``'s copy; source "" (and nothing to time) when ``x`` is a buffer."""
        inner = _computed(x, self.stop)
        if not inner:
            return "", lambda: 0.0
        self.covered.update(inner)
        return self.plan_generated(_clone(inner, self.subst))


def matmul_costs(matmuls: Iterable[Matmul], pool_of: Callable[[str], object], device_key: Callable[[str], str],
                 plan_generated: Callable[[Class], tuple[str, Callable[[], float]]],
                 store: MeasuredCosts | None = None) -> Costs:
    """Measured costs of the alternatives of every matmul class with a library alternative (see the module
    docstring). ``plan_generated(clone)`` plans the generated kernels computing ``clone`` from its leaves and
    returns their sources' hash and a function timing them (ns); ``device_key(device)`` names a device for the
    disk keys; ``pool_of(device)`` is its pool. ``store``: ``STORE`` by default."""
    store = store or STORE
    costs: Costs = {}
    for m in matmuls:
        c = m.cls
        libs = [n for n in c.nodes if n.op is Ops.KERNEL]
        if not libs or c.nodes[0].op is not Ops.REDUCE or c.numel == 0:  # an empty product runs nothing
            continue
        pool, dev, sig = pool_of(c.device), device_key(c.device), signature(m)
        copies = _Copies(m, pool, plan_generated)
        source, timer = copies.generated(c)
        t = costs[(id(c), id(c.nodes[0]))] = _timed(store, f"{dev}|{sig}|generated:{source}", timer)
        log("sched", f"measured {sig} generated: {t / 1e3:.1f}us")
        for n in libs:
            lib: LibraryKernel = n.arg
            t_lib = _timed(store, f"{dev}|{sig}|library:{lib.name}", functools.partial(_time_library, lib, c, pool))
            t_in = 0.0
            for x in lib.inputs:
                source, timer = copies.generated(x)
                t_in += _timed(store, f"{dev}|materialize:{source}", timer) if source else 0.0
            costs[(id(c), id(n))] = t_lib + t_in
            inputs = f" + {t_in / 1e3:.1f}us materializing its inputs" if t_in else ""
            log("sched", f"measured {sig} library: {t_lib / 1e3:.1f}us{inputs} (estimated {lib.est_ns / 1e3:.1f}us)")
        for x in copies.covered - {c}:  # inside what the measured times cover
            costs[(id(x), id(x.nodes[0]))] = 0.0
    return costs


def source_hash(sources: Iterable[str]) -> str:
    """A short stable name for a list of kernel sources."""
    h = hashlib.sha256()
    for s in sources:
        h.update(s.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]

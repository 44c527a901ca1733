"""Measured costs for extraction: with autotuning on, each matmul's alternatives are timed instead of estimated.

For a matmul class (``match_matmul``) that a device offered a library kernel for, both ways of computing it
run on scratch inputs of the same shapes, dtypes and strides: the library program alone, and the generated
kernels of a copy of the matmul's subgraph (its operands replaced by fresh leaves), each with
``Device.launch_timed`` (``autotune.steady_ns``: the statistic the kernel search uses too). The copy is
planned without library alternatives, so it is exactly what extraction's generated choice would compile.
Times are kept on disk (``<cache>/measured_costs.json``) keyed by the device, the matmul's signature and the
alternative (the library kernel's name; the generated kernels' source hash), so a later process times nothing
it timed before.

What extraction gets: ``{(id(class), id(node)): ns}`` — the library node at its measured time, the generated
``REDUCE`` node at the generated kernels' time, and the classes between it and its operands (the product and
the views, fused into that kernel) at zero.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from zyx.backends.autotune import steady_ns
from zyx.backends.base import LibraryKernel
from zyx.graph.match import Matmul
from zyx.graph.node import Buffer, Class, leaf, make
from zyx.ops import Ops
from zyx.utils import STATS, cache_dir, log

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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".measured-")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, self.path)

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


def _inner(m: Matmul) -> list[Class]:
    """The classes from ``m.cls`` down to (without) its operands' bases, sources first."""
    bases = {id(m.a.view.base), id(m.b.view.base)}
    out: list[Class] = []
    seen: set[int] = set()

    def visit(c: Class) -> None:
        if id(c) in seen or id(c) in bases or c.realized or not c.nodes:
            return
        seen.add(id(c))
        for s in c.nodes[0].srcs:
            visit(s)
        out.append(c)

    visit(m.cls)
    return out


def _clone(inner: list[Class], subst: dict[int, Class]) -> Class:
    """``inner``'s last class rebuilt over ``subst``'s classes (by id of what they replace)."""
    new: dict[int, Class] = dict(subst)
    for c in inner:
        n = c.nodes[0]
        new[id(c)] = make(n.op, tuple(new.get(id(s), s) for s in n.srcs), n.arg, c.shape, c.dtype, c.device)
    return new[id(inner[-1])]


def _scratch(c: Class, pool) -> Buffer:
    """A zero-filled buffer of ``c``'s size in ``pool``."""
    b = Buffer(pool, pool.allocate(c.nbytes), c.nbytes, c.device)
    pool.host_to_pool(memoryview(bytes(c.nbytes)), b.id)
    return b


def _time_library(lib: LibraryKernel, out: Class, pool) -> float:
    bufs = [_scratch(c, pool) for c in (*lib.inputs, out)]
    return steady_ns(lambda: lib.device.launch_timed(lib.program, [b.id for b in bufs]))


def matmul_costs(matmuls: Iterable[Matmul], pool_of: Callable[[str], object], device_key: Callable[[str], str],
                 plan_generated: Callable[[Class, list[Class]], tuple[str, Callable[[], float]]],
                 store: MeasuredCosts | None = None) -> Costs:
    """Measured costs of the alternatives of every matmul class with a library alternative (see the module
    docstring). ``plan_generated(clone, leaves)`` plans the generated kernels computing ``clone`` from ``leaves``
    (scratch buffers) and returns their sources' hash and a function timing them (ns); ``device_key(device)``
    names a device for the disk keys; ``pool_of(device)`` is its pool. ``store``: ``STORE`` by default."""
    store = store or STORE
    costs: Costs = {}
    for m in matmuls:
        c = m.cls
        libs = [n for n in c.nodes if n.op is Ops.KERNEL]
        if not libs or c.nodes[0].op is not Ops.REDUCE or c.numel == 0:  # an empty product runs nothing
            continue
        pool, dev, sig, inner = pool_of(c.device), device_key(c.device), signature(m), _inner(m)
        bases = {id(m.a.view.base): m.a.view.base, id(m.b.view.base): m.b.view.base}
        leaves = {i: leaf(_scratch(b, pool), b.shape, b.dtype) for i, b in bases.items()}
        source, time_generated = plan_generated(_clone(inner, leaves), list(leaves.values()))
        alternatives = [(c.nodes[0], f"generated:{source}", time_generated, None)]
        for n in libs:
            lib: LibraryKernel = n.arg
            alternatives.append((n, f"library:{lib.name}", functools.partial(_time_library, lib, c, pool), lib.est_ns))
        for n, what, timer, estimate in alternatives:
            key = f"{dev}|{sig}|{what}"
            t = store.get(key)
            if t is None:
                STATS["measured_alternatives"] += 1
                t = timer()
                store.put(key, t)
            costs[(id(c), id(n))] = t
            est = "" if estimate is None else f" (estimated {estimate / 1e3:.1f}us)"
            log("sched", f"measured {sig} {what.split(':')[0]}: {t / 1e3:.1f}us{est}")
        for x in inner[:-1]:  # fused into the generated kernel, whose measured time covers them
            costs[(id(x), id(x.nodes[0]))] = 0.0
    return costs


def source_hash(sources: Iterable[str]) -> str:
    """A short stable name for a list of kernel sources."""
    h = hashlib.sha256()
    for s in sources:
        h.update(s.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]

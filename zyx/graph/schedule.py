"""Realize: turn the classes the outputs need into launches, cache the plan by structure, run it.

Invariants:
- A plan depends only on the graph's structure (ops, args, shapes, dtypes, devices, sharing), never on
  buffer contents or scalar-variable values, so it is cached under that structure: a training loop plans and
  compiles once, then replays.
- Which classes are stored and which kernels compute them is ``zyx.graph.fuse``'s decision; steps run in
  dependency-depth order.
- Outputs receive their buffers only after every launch of the plan was issued without error.
- A plan whose steps are all launches on one device that batches (CUDA) is issued as one ``launch_batch`` under
  the plan's key, so a replayed plan can run as one captured graph.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from zyx.backends import autotune
from zyx.backends.base import BackendError, Device, ErrorStatus, LibraryKernel, Pool
from zyx.backends.registry import registry
from zyx.graph import measure
from zyx.graph.extract import Graph, contraction_flops, default_cost, extract, needed
from zyx.graph.fuse import fuse
from zyx.graph.node import Buffer, Class
from zyx.ops import Ops
from zyx.utils import STATS, debug_on, deep_call, log

SCHEDULE_CACHE_SIZE = 2048


@dataclass
class Step:
    kind: str  # "generated", "library", "copy"
    device: str
    name: str
    args: tuple[int, ...]  # slots
    dev: Device | None = None
    program: int | None = None
    src_pool: Pool | None = None
    dst_pool: Pool | None = None
    source: object = None  # the ir.Kernel (generated) or LibraryKernel
    scalar_args: bool = False  # an argument is a scalar variable's value (else every argument is a buffer)

    def __repr__(self) -> str:
        return f"Step({self.kind}, {self.name!r} on {self.device})"


_plan_keys = itertools.count(1)


@dataclass
class Plan:
    n_leaves: int
    alloc: list[tuple[int, Pool, str, int]]  # (slot, pool, device name, nbytes)
    steps: list[Step]
    release_after: list[list[int]]
    outputs: list[int]
    n_slots: int
    aliases: list[tuple[int, int]] = field(default_factory=list)  # (slot, slot whose buffer it shares)
    key: int = field(default_factory=lambda: next(_plan_keys))  # names the plan's launches as one recurring batch

    @functools.cached_property
    def alloc_before(self) -> tuple[list, list[list]]:
        """``alloc`` split by when a step-by-step run allocates: (the slots no step uses, the slots each step uses
        first). Allocated as they are needed and released after their last use (``release_after``), the
        intermediates of a long plan reuse the pool's freed blocks: a 2048^2 sort's 66 stages had allocated 3.2 GB
        of fresh memory up front, and their first writes page-faulted (1 s of 1.1 s)."""
        first: dict[int, int] = {}
        for i, st in enumerate(self.steps):
            for a in st.args:
                first.setdefault(a, i)
        early: list = []
        per_step: list[list] = [[] for _ in self.steps]
        for entry in self.alloc:
            (per_step[first[entry[0]]] if entry[0] in first else early).append(entry)
        return early, per_step

    @functools.cached_property
    def batch_device(self) -> Device | None:
        """The device running every step, when all are launches (generated or library) on one device."""
        devs = {id(st.dev) for st in self.steps}
        if len(self.steps) < 2 or len(devs) != 1 or any(st.kind == "copy" for st in self.steps):
            return None
        dev = self.steps[0].dev
        # only a device that does something with a batch: the default loop would lose release_after's early frees
        return dev if type(dev).launch_batch is not Device.launch_batch else None


_plans: OrderedDict = OrderedDict()  # _Key -> (that key, Plan), least recently used first


def clear_cache() -> None:
    _plans.clear()


def collect(outputs: list[Class]) -> tuple[list[Class], list[Class]]:
    """Unrealized classes the outputs need (sources first) and the leaves they read (buffers, variables)."""
    order, leaves, _ = walk(outputs)
    return order, leaves


def walk(outputs: list[Class]) -> tuple[list[Class], list[Class], tuple]:
    """One depth-first pass over what ``outputs`` need: the unrealized classes (sources first), the leaves
    (buffers, launch-argument scalars, in first-visit order) and the graph's structure key.

    The key is flat: per visited class, in visit order, a tuple (its hash-cons head: op, arg, dtype, device,
    shape; a leaf's kind, shape, dtype, device) followed by the ints naming its sources (the key positions
    of their tuples); then "out" and the outputs' positions. A tuple starts every entry, so the key is exact,
    not a hash: equal keys mean the same graph up to which buffers and scalar values the leaves hold, and one
    plan serves both. Sources are visited left to right: the order follows the graph's shape, not how it was
    built."""
    order: list[Class] = []
    leaves: list[Class] = []
    parts: list = []
    index: dict[Class, int] = {}  # class (identity) -> key position; -1 while its sources are being visited
    get, at_of = index.get, index.__getitem__
    add, extend = parts.append, parts.extend
    var = Ops.VAR
    for out in outputs:
        if out in index:
            continue
        stack: list = [out]
        pop, push, spread = stack.pop, stack.append, stack.extend
        while stack:
            c = pop()
            at = get(c)
            if at is not None:
                if at < 0:  # every source is finished (a DAG: none can still be open above this class)
                    index[c] = len(parts)
                    add(c.key[0])
                    extend(map(at_of, c.nodes[0].srcs))
                    order.append(c)
                continue
            if c.buffer is not None or c.nodes[0].op is var:
                index[c] = len(parts)
                add(("leaf" if c.buffer is not None else "var", c.shape, c.dtype, c.device))
                leaves.append(c)
                continue
            index[c] = -1
            push(c)
            spread(c.nodes[0].srcs[::-1])  # finished ones are skipped when popped
    add("out")
    extend(map(at_of, outputs))
    return order, leaves, tuple(parts)


def plan(order: list[Class], leaves: list[Class], outputs: list[Class], match: bool = True) -> Plan:
    """The plan computing ``outputs``: devices add library alternatives (unless ``match`` is false: generated
    kernels only), extraction chooses (by measured times where autotuning measured them), fusion cuts kernels."""
    reg = registry()
    graph = Graph(order, outputs)
    measured = {}
    if match:
        for name in sorted({c.device for c in order}):
            for dev in reg.get(name).devices:
                dev.match_graph(graph, outputs)
        if autotune.active():
            measured = measure.matmul_costs(graph.matmuls(), lambda name: reg.get(name).pool,
                                            lambda name: _device_key(reg.get(name).primary), _generated_timer)
    contractions = contraction_flops(graph.matmuls()) if match else None
    chosen = extract(outputs, default_cost(lambda name: reg.get(name).primary.info(), measured, contractions))
    if chosen:
        order = needed(outputs, chosen)
    fusion = fuse(order, outputs, chosen)
    stored, aliases = fusion.materialized, fusion.aliases

    slot: dict[int, int] = {id(c): i for i, c in enumerate(leaves)}
    var_slots = {i for i, c in enumerate(leaves) if c.buffer is None}
    alloc: list[tuple[int, Pool, str, int]] = []
    for c in order:
        if c in stored:
            slot[id(c)] = len(slot)
            # copies allocate their destination themselves (it may import the source without copying), except
            # empty ones, which run no step but still need a (zero-byte) buffer
            if id(c) not in aliases and (c.op is not Ops.COPY or c.numel == 0):
                alloc.append((slot[id(c)], reg.get(c.device).pool, c.device, c.nbytes))
    alias_slots = [(slot[i], slot[id(src)]) for i, src in aliases.items()]

    ordered: list[tuple[int, int, Step]] = []  # (depth, position, step): dependencies always at lower depth
    for pos, c in enumerate(order):
        if c not in stored or c.numel == 0 or id(c) in aliases:
            continue
        node = chosen.get(id(c))
        if c.op is Ops.COPY:
            src = c.srcs[0]
            step = Step("copy", c.device, f"copy {src.device}->{c.device} {c.nbytes}B", (slot[id(src)], slot[id(c)]),
                        src_pool=reg.get(src.device).pool, dst_pool=reg.get(c.device).pool)
        elif node is not None and node.op is Ops.KERNEL:
            lib: LibraryKernel = node.arg
            args = tuple(slot[id(i)] for i in lib.inputs) + (slot[id(c)],)
            step = Step("library", c.device, lib.name, args, dev=lib.device, program=lib.program, source=lib,
                        scalar_args=not var_slots.isdisjoint(args))
        else:
            continue
        ordered.append((fusion.depth[id(c)], pos, step))
    kernels = []
    for group in fusion.groups:
        k = group.builder.kernel()
        kernels.append((type(k)(group.name, k.params, k.loops, k.stores), reg.get(group.roots[0].device).primary))
    programs = _compile_all(kernels)
    for n, (group, (k, dev), program) in enumerate(zip(fusion.groups, kernels, programs)):
        args = tuple(slot[id(p)] for p in group.builder.param_classes)
        step = Step("generated", group.roots[0].device, k.name, args, dev=dev, program=program, source=k,
                    scalar_args=not var_slots.isdisjoint(args))
        ordered.append((group.depth, n - len(fusion.groups), step))
    steps = [st for _, _, st in sorted(ordered, key=lambda t: (t[0], t[1]))]
    empty = {slot[id(c)] for c in order if c in stored and c.numel == 0}
    _check_order(steps, set(range(len(leaves))) | empty, alias_slots)

    out_slots = [slot[id(o)] for o in outputs]
    last_use: dict[int, int] = {}
    for i, st in enumerate(steps):
        for a in st.args:
            last_use[a] = i
    keep = set(out_slots) | set(range(len(leaves)))
    release_after: list[list[int]] = [[] for _ in steps]
    for s_, i in last_use.items():
        if s_ not in keep:
            release_after[i].append(s_)
    if debug_on("sched"):
        for st in steps:
            log("sched", f"{st.kind:9s} {st.device:7s} {st.name}")
    return Plan(len(leaves), alloc, steps, release_after, out_slots, len(slot), alias_slots)


def _check_order(steps: list[Step], ready: set[int], aliases: list[tuple[int, int]]) -> None:
    """Every step reads only ``ready`` slots (leaves, empty values), slots an earlier step wrote, and aliases of
    those: a wrong order would read garbage silently."""
    written = set(ready)
    for st in steps:
        written |= {a for a, src in aliases if src in written}
        if st.kind == "generated":
            kinds = [p.kind for p in st.source.params]
            reads = {a for a, kind in zip(st.args, kinds) if kind == "in"}
            writes = {a for a, kind in zip(st.args, kinds) if kind == "out"}
        else:  # a copy or a library call: its inputs, then its output
            reads, writes = set(st.args[:-1]), {st.args[-1]}
        if not reads <= written:
            raise BackendError(ErrorStatus.COMPILATION, f"the plan runs {st.name} before the steps that write its "
                               "inputs; please report this graph (ZYX_DEBUG=sched shows the steps)")
        written |= writes


def _device_key(dev: Device) -> str:
    """What makes a device's timings comparable: the autotuner's identity of it (compiler, driver, model)."""
    identity = getattr(dev, "tuning_identity", None)
    return identity() if identity is not None else autotune.info_identity(dev.info())


def _compile_all(kernels: list[tuple[object, Device]]) -> list[int]:
    """The program of each (kernel, device), every device compiling its share with one ``compile_many``."""
    by_device: dict[int, list[int]] = {}
    for i, (_, dev) in enumerate(kernels):
        by_device.setdefault(id(dev), []).append(i)
    programs = [0] * len(kernels)
    for idx in by_device.values():
        dev = kernels[idx[0]][1]
        for i, pid in zip(idx, dev.compile_many([kernels[i][0] for i in idx])):
            programs[i] = pid
    return programs


def _generated_timer(out: Class) -> tuple[str, Callable[[], float]]:
    """Plan ``out`` from its leaves (buffers, scalar variables) with generated kernels only; return their sources'
    hash and a function timing those kernels (ns: the sum over launches of ``launch_timed``, intermediates
    allocated once)."""
    order, walked, _ = walk([out])
    p = plan(order, walked, [out], match=False)
    gen = [st for st in p.steps if st.kind == "generated"]
    name = measure.source_hash(st.dev.source(st.program) if hasattr(st.dev, "source") else repr(st.source)
                               for st in gen)
    values = [c.buffer if c.realized else c.var_value for c in walked]

    def time_plan() -> float:
        fixed = _fixed(p, values, gen)  # holds the buffers while the launches run
        return autotune.steady_ns(lambda: sum(dev.launch_timed(program, args) for dev, program, args in fixed.launches))

    return name, time_plan


def get_plan(outputs: list[Class]) -> tuple[Plan | None, list[Class], list[Class]]:
    outs = []
    seen = set()
    for o in outputs:
        if o.buffer is None and id(o) not in seen:
            seen.add(id(o))
            outs.append(o)
    if not outs:
        return None, [], []
    order, leaves, parts = walk(outs)
    key = _Key(parts)
    entry = _plans.get(key)
    if entry is not None:
        stored, p = entry
        _plans.move_to_end(stored)  # the stored key itself: its hash is kept and identity settles equality
        STATS["schedule_cache_hits"] += 1
    else:
        STATS["schedule_cache_misses"] += 1
        p = deep_call(plan, order, leaves, outs)
        _plans[key] = (key, p)
        if len(_plans) > SCHEDULE_CACHE_SIZE:
            _plans.popitem(last=False)
    return p, leaves, outs


class _Key:
    """A structure key (``walk``'s exact tuple) with its hash computed once: equality compares the tuples."""

    __slots__ = ("parts", "hash")

    def __init__(self, parts: tuple) -> None:
        self.parts, self.hash = parts, hash(parts)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _Key) and self.parts == other.parts)


def realize(outputs: list[Class]) -> None:
    """Compute every class in ``outputs`` that is not yet realized; they become buffer leaves."""
    p, leaves, outs = get_plan(outputs)
    if p is None:
        return
    values = []  # a loop, not a comprehension: a few us less when the caches are cold (after a large kernel)
    for c in leaves:
        values.append(c.var_value if c.buffer is None else c.buffer)
    STATS["realizes"] += 1
    buffers = execute(p, values)
    if recording is not None:
        recording.append(Recorded(p, leaves, values, buffers))
    for c, b in zip(outs, buffers):
        c.set_buffer(b)


@dataclass
class Recorded:
    """One realize seen while recording: its plan, its leaf classes and the values they had, its outputs."""

    plan: Plan
    leaves: list[Class]
    values: list  # Buffer or scalar per leaf, as the plan read them
    outputs: list[Buffer]


recording: list[Recorded] | None = None  # set by a capture (zyx.jit): every realize is appended


def execute(p: Plan, values: list) -> list[Buffer]:
    """Run plan ``p`` on leaf ``values`` (a Buffer or scalar per leaf slot); return its output buffers, in order.

    Every launch is issued before any output buffer is returned; intermediate buffers are released after
    their last use."""
    if p.batch_device is not None:  # every step a launch on one device: its buffers allocated first
        table, allocate = _slot_table(p, values), [[] for _ in p.steps]
    else:
        early, allocate = p.alloc_before
        table = _fill_table(p, values, early)
    pending = _resolve_aliases(p.aliases, table) if p.aliases else p.aliases
    if p.batch_device is not None and not pending:  # one batch
        launches = [(st.program, [a.id if isinstance(a, Buffer) else a for a in map(table.__getitem__, st.args)])
                    for st in p.steps]
        p.batch_device.launch_batch(p.key, launches)
        return [table[s] for s in p.outputs]
    for st, rel, new in zip(p.steps, p.release_after, allocate):
        if new:
            _allocate(table, new)
            if pending:
                pending = _resolve_aliases(pending, table)
        if st.kind == "copy":
            table[st.args[1]] = _copy(st, table[st.args[0]])
        else:
            args = map(table.__getitem__, st.args)
            st.dev.launch(st.program, [a.id if isinstance(a, Buffer) else a for a in args] if st.scalar_args
                          else list(map(_buffer_id, args)))
        if pending:
            pending = _resolve_aliases(pending, table)
        for r in rel:
            table[r] = None
    return list(map(table.__getitem__, p.outputs))


_buffer_id = operator.attrgetter("id")


def _slot_table(p: Plan, values: list) -> list:
    """Plan ``p``'s slots: the leaf ``values`` first, then a fresh buffer for every allocated slot."""
    return _fill_table(p, values, p.alloc)


def _fill_table(p: Plan, values: list, alloc: list) -> list:
    """Plan ``p``'s slots: the leaf ``values``, a fresh buffer for each slot of ``alloc``, None elsewhere."""
    table: list = [None] * p.n_slots
    table[:p.n_leaves] = values
    _allocate(table, alloc)
    return table


def _allocate(table: list, alloc: list) -> None:
    for s, pool, device, nbytes in alloc:
        table[s] = Buffer(pool, pool.allocate(nbytes), nbytes, device)


def _resolve_aliases(aliases: list[tuple[int, int]], table: list) -> list[tuple[int, int]]:
    """Point alias slots at their source buffers once those exist; returns the ones still waiting."""
    waiting = []
    for s, src in aliases:
        if table[src] is None:
            waiting.append((s, src))
        else:
            table[s] = table[src]
    return waiting


def _copy(st: Step, src: Buffer) -> Buffer:
    """The destination buffer of a copy step: imported without copying when the pools allow, else copied."""
    dst_pool = st.dst_pool
    importer = getattr(dst_pool, "import_buffer", None)
    bid = importer(st.src_pool, src.id) if importer is not None else None
    if bid is None:
        bid = dst_pool.allocate(src.nbytes)
        try:
            dst_pool.pool_to_pool(st.src_pool, src.id, bid)
        except BaseException:
            dst_pool.release(bid)
            raise
        STATS["copies"] += 1
    else:
        STATS["zero_copy_imports"] += 1
    return Buffer(dst_pool, bid, src.nbytes, st.device)


def scheduled_steps(outputs: list[Class]) -> list[Step]:
    p, _, _ = get_plan(outputs)
    return [] if p is None else list(p.steps)


@dataclass
class FixedLaunches:
    """A plan's launches on buffers chosen once (``fixed_launches``): calling it runs them, nothing else."""

    launches: list[tuple[Device, int, list]]  # (device, program, arguments)
    outputs: list[Buffer]  # the buffers the plan's outputs are written into
    table: list  # every slot's buffer or scalar, kept alive with the launches

    def __call__(self) -> None:
        for dev, program, args in self.launches:
            dev.launch(program, args)


def fixed_launches(outputs: list[Class]) -> FixedLaunches | None:
    """The launches of ``outputs``' plan on the leaves' buffers and fresh ones for the rest, to time the kernels
    apart from what a realize adds (building the graph, finding the plan, allocating, releasing): ``zyx.bench``.
    None when the plan copies between devices or runs nothing. The outputs stay unrealized."""
    p, leaves, _ = get_plan(outputs)
    if p is None or not p.steps or any(st.kind == "copy" for st in p.steps):
        return None
    return _fixed(p, [c.var_value if c.buffer is None else c.buffer for c in leaves], p.steps)


def _fixed(p: Plan, values: list, steps: list[Step]) -> FixedLaunches:
    """``steps`` of plan ``p`` (launches) on leaf ``values`` and a fresh buffer for every allocated slot."""
    table = _slot_table(p, values)
    _resolve_aliases(p.aliases, table)
    launches = [(st.dev, st.program, [a.id if isinstance(a, Buffer) else a for a in map(table.__getitem__, st.args)])
                for st in steps]
    return FixedLaunches(launches, [table[s] for s in p.outputs], table)

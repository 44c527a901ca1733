"""GPU launch geometry: map a kernel's output loops and reductions onto a CUDA grid of thread blocks.

``optimize(kernel, info)`` normalizes the loops (``opt.drop_unit_loops`` + ``opt.merge_loops``), decides a
``Geometry`` and returns the kernel with it attached as ``kernel.meta["gpu"]``; ``render_cuda`` follows it.

Terms (``linearize`` places every statement in the block of the innermost loop it depends on):

- depth ``d`` block: the body of output loop ``d - 1`` (depth 0 = the kernel's root block);
- *top-level reduce*: a ``Reduce`` statement in an output-loop block (not inside another reduce's loops);
  its depth is its block's depth, ``s`` is the smallest such depth (``n = len(loops)`` when there is none).

Strategies (every kernel gets one; each is correct for every kernel it is chosen for):

``thread``  one thread per iteration of all output loops (all but the innermost for a scan, which runs serially
            in the thread), flattened into one index ``gid`` (decoded by
            ``//`` and ``%``); a grid-stride loop covers any size. Chosen when there is no reduce, or when every
            top-level reduce is at the innermost depth (``s == n``), each load in the reduce bodies is the same
            or the next element for adjacent outputs (coalesced across threads), and there are enough outputs to
            fill the GPU. Reduces run serially in the thread.
``segments`` a kernel without reduces whose loop splits into segments (``opt.split_segments``: cat's pieces)
            runs one ``thread`` grid-stride loop per segment, one after another in one launch (``Kernel.then``),
            all with the largest block any of them wants.
``group``   one *group* of ``G`` threads (a warp when ``G == 32``, several warps per block; else one block per
            group) per iteration of output loops ``[0, s)``. The top-level reduces at depth ``s`` are cooperative:
            each thread accumulates a strided slice of the reduce range, then warp shuffles (``__shfl_xor_sync``:
            every lane ends with the same value) and, for ``G > 32``, a shared-memory exchange across warps give
            every thread the result (so a reduce may feed the next one, e.g. softmax, argmax; a butterfly rather
            than ``__shfl_down_sync``, which leaves the result in lane 0 only). Output loops
            ``[s, flat)`` are flattened and strided over the group's threads (the elementwise part of softmax);
            loops ``[flat, n)`` and every deeper reduce run serially in the thread. With ``s == n`` the stores run
            on lane 0. Chosen for every other kernel with a reduce.

Invariants:
- ``1 <= grid[0] <= info.max_global_work[0]``, ``grid[1:] == (1, 1)``: a grid-stride loop over the work items
  makes any grid of at least one block correct, so the grid is ``ceil(items / per_block)``, capped.
- ``block == (group_threads, groups_per_block, 1)`` for ``group`` (``group_threads`` a multiple of the warp size)
  and ``(threads, 1, 1)`` for ``thread``; the block shape is baked into the source, the grid is read at run
  time (``gridDim``), so a launcher may use any grid from 1 to ``grid[0]``.
- Flattening a loop nest recomputes the statements of the flattened bodies per flat index; ``flatten_count``
  stops at the first body holding a ``Reduce`` so that no reduce is ever recomputed.
- Long float32 sums: a reduce whose serial chain (per thread) reaches ``opt.WIDE_ACC_MIN`` elements sets
  ``wide_acc`` (accumulate in double, as the host does); cooperative reduces keep float partials otherwise,
  because each thread's chain is short and the tree across threads adds only ``log2(G)`` roundings.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from zyx import dtypes
from zyx.kernel import ir, opt
from zyx.kernel.ir import Expr, Kernel, Ops
from zyx.kernel.linearize import Block, Loop, Reduce, linearize
from zyx.kernel.target import DeviceInfo

META_KEY = "gpu"
WARP = 32  # threads per warp on every CUDA GPU; the renderer's shuffles assume it
THREADS_PER_BLOCK = 256  # elementwise (thread strategy) block size
WARP_GROUPS_PER_BLOCK = 8  # warps (groups of 32) per block in warp mode
ELEMS_PER_THREAD = 8  # a cooperative group aims at this many reduce/inner elements per thread
MANY_GROUPS_PER_UNIT = 8  # with this many groups per SM, groups stay at most 256 threads
THREAD_OUTPUTS_PER_UNIT = 256  # the thread strategy for reduces needs this many outputs per SM


@dataclass(frozen=True)
class Geometry:
    """How one kernel maps onto the GPU; see the module docstring for the strategies."""

    strategy: str  # "thread" or "group"
    split: int  # output loops [0, split) index the work items (threads or groups)
    flat: int  # output loops [split, flat) are strided over a group's threads (== split for "thread")
    items: int  # work items: threads ("thread") or groups ("group")
    group_threads: int  # threads per group (1 for "thread")
    groups_per_block: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]

    @property
    def block_threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def warp_mode(self) -> bool:
        """Groups are single warps: cooperative reduces need shuffles only (no shared memory, no barrier)."""
        return self.strategy == "group" and self.group_threads == 32


def reference_info(compute_units: int = 132, arch: tuple[int, int] = (9, 0)) -> DeviceInfo:
    """A CUDA DeviceInfo for code generation without a GPU (an H200 by default: 132 SMs, sm_90)."""
    return DeviceInfo(name=f"cuda (reference sm_{arch[0]}{arch[1]})", kind="cuda", compute_units=compute_units,
                      max_global_work=(2**31 - 1, 65535, 65535), max_local_work=(1024, 1024, 64),
                      max_local_threads=1024, local_memory_bytes=48 * 1024, warp_size=32,
                      compute_capability=arch, dtypes=frozenset(d.name for d in dtypes.ALL))


# ---------------------------------------------------------------------------------------------------------------
# structure of a linearized kernel


def output_blocks(root: Block) -> list[Block]:
    """Blocks by depth: ``[root, body of loop 0, body of loop 1, ...]``."""
    out = [root]
    while out[-1].inner is not None:
        out.append(out[-1].inner.body)
    return out


def output_loops(root: Block) -> list[Loop]:
    """The output loops as ``Loop`` objects, outermost first."""
    return [b.inner for b in output_blocks(root)[:-1]]


def has_reduce(block: Block) -> bool:
    return any(isinstance(s, Reduce) for s in block.stmts)


def reduce_depths(root: Block) -> list[int]:
    """Depths of the blocks holding top-level reduces, in increasing order."""
    return [d for d, b in enumerate(output_blocks(root)) if has_reduce(b)]


def flatten_count(loops: Sequence[Loop]) -> int:
    """How many loops of a perfect chain ``loops`` to flatten into one index: up to and including the first
    loop whose body holds a ``Reduce`` (so no reduce is recomputed), else all of them."""
    for i, lp in enumerate(loops):
        if has_reduce(lp.body):
            return i + 1
    return len(loops)


def reduce_chain(red: Reduce) -> list[Loop]:
    """The loops of one reduce, outermost first."""
    out = [red.loop]
    while out[-1].body.inner is not None:
        out.append(out[-1].body.inner)
    return out


def loop_size(loops: Sequence[Loop]) -> int:
    return math.prod(lp.range.arg[1] for lp in loops)


# ---------------------------------------------------------------------------------------------------------------
# heuristics


def _coef(e: Expr, r: Expr) -> int | None:
    """The coefficient of range ``r`` in the index ``e`` when ``e`` is affine in ``r``, else None."""
    if r not in e.ranges:
        return 0
    if e is r:
        return 1
    if e.op is Ops.ADD:
        a, b = _coef(e.srcs[0], r), _coef(e.srcs[1], r)
        return None if a is None or b is None else a + b
    if e.op is Ops.MUL:
        x, y = e.srcs
        if y.op is Ops.CONST:
            x, y = y, x
        if x.op is Ops.CONST and e.dtype.is_int:
            c = _coef(y, r)
            return None if c is None else c * x.arg
    return None


def coalesced_across(values: Sequence[Expr], r: Expr) -> bool:
    """Every load feeding ``values`` reads the same or the next element when ``r`` steps by one."""
    for e in ir.toposort(list(values)):
        if e.op is Ops.LOAD and _coef(e.srcs[0], r) not in (0, 1):
            return False
    return True


def _top_reduces(root: Block, depth: int) -> list[Reduce]:
    return [s for s in output_blocks(root)[depth].stmts if isinstance(s, Reduce)]


def _prefer_thread(k: Kernel, root: Block, info: DeviceInfo) -> bool:
    """Reduces only at the innermost depth: one thread per output when that keeps loads coalesced and the
    GPU busy."""
    if not k.loops or k.size < THREAD_OUTPUTS_PER_UNIT * max(info.compute_units, 1):
        return False
    reds = _top_reduces(root, len(k.loops))
    return coalesced_across([r.expr.srcs[0] for r in reds], k.loops[-1])


def _group_threads(work: int, groups: int, info: DeviceInfo) -> int:
    """Threads per group: a warp, doubled while each thread would get more than ``ELEMS_PER_THREAD`` elements, up
    to the block limit (256 when there are groups enough to fill the GPU anyway)."""
    cap = max(info.max_local_threads, WARP)
    if groups >= MANY_GROUPS_PER_UNIT * max(info.compute_units, 1):
        cap = min(cap, 256)
    g = WARP
    while g < cap and g * ELEMS_PER_THREAD < work:
        g *= 2
    return min(g, cap) // WARP * WARP


def _grid(items: int, per_block: int, info: DeviceInfo) -> tuple[int, int, int]:
    blocks = max(1, -(-items // per_block))
    return (min(blocks, info.max_global_work[0]), 1, 1)


def _thread_geometry(k: Kernel, info: DeviceInfo) -> Geometry:
    n = len(k.loops)
    if k.scan_ranges():
        n -= 1  # the scan's loop (innermost) runs serially in each thread
    items = math.prod(r.arg[1] for r in k.loops[:n])
    threads = min(THREADS_PER_BLOCK, max(WARP, -(-items // WARP) * WARP))
    return Geometry("thread", n, n, items, 1, 1, _grid(items, threads, info), (threads, 1, 1))


def _group_geometry(root: Block, s: int, info: DeviceInfo) -> Geometry:
    loops = output_loops(root)
    n = len(loops)
    flat = s + flatten_count(loops[s:]) if s < n else n
    items = loop_size(loops[:s])
    chains = [reduce_chain(r) for r in _top_reduces(root, s)]
    work = max([loop_size(c[:flatten_count(c)]) for c in chains] + [loop_size(loops[s:flat])])
    g = _group_threads(work, items, info)
    w = max(1, min(WARP_GROUPS_PER_BLOCK, items, max(info.max_local_threads, WARP) // WARP)) if g == WARP else 1
    return Geometry("group", s, flat, items, g, w, _grid(items, w, info), (g, w, 1))


def plan(k: Kernel, info: DeviceInfo) -> Geometry:
    """The geometry of a kernel whose loops are already normalized (see ``optimize``)."""
    if info.warp_size not in (1, WARP):  # 1: a DeviceInfo that did not say
        raise ValueError(f"CUDA code generation assumes {WARP}-thread warps, {info.name} has {info.warp_size}")
    root = linearize(k)
    depths = reduce_depths(root)
    s = depths[0] if depths else len(k.loops)
    if k.scan_ranges():
        if depths:
            raise NotImplementedError(f"kernel {k.name}: a scan kernel holds no reduce (fusion stores it first)")
        return _thread_geometry(k, info)
    if not depths or (s == len(k.loops) and _prefer_thread(k, root, info)):
        return _thread_geometry(k, info)
    return _group_geometry(root, s, info)


# ---------------------------------------------------------------------------------------------------------------
# accumulator width


def serial_lengths(root: Block, geom: Geometry) -> dict[Expr, int]:
    """For each reduce, how many elements one thread accumulates in sequence."""
    out: dict[Expr, int] = {}
    coop = {id(r) for r in _top_reduces(root, geom.split)} if geom.strategy == "group" else set()

    def visit(block: Block) -> None:
        for st in block.stmts:
            if isinstance(st, Reduce):
                chain = reduce_chain(st)
                length = loop_size(chain)
                if id(st) in coop:
                    f = flatten_count(chain)
                    length = -(-loop_size(chain[:f]) // geom.group_threads) * loop_size(chain[f:])
                out[st.expr] = length
                visit(st.loop.body)  # nested reduces (visit follows the chain of inner loops)
        if block.inner is not None:
            visit(block.inner.body)

    visit(root)
    return out


def needs_wide_acc(root: Block, geom: Geometry) -> bool:
    return any(e.arg[0] is Ops.ADD and e.dtype is dtypes.float32 and length >= opt.WIDE_ACC_MIN
               for e, length in serial_lengths(root, geom).items())


# ---------------------------------------------------------------------------------------------------------------
# entry points


def _segments(k: Kernel, info: DeviceInfo) -> Kernel | None:
    """A kernel without reduces or scans whose loop ``opt.split_segments`` splits (cat's pieces, pad's bounds):
    one grid-stride loop per segment in one launch, all with the same block (the largest any segment wants)."""
    if k.reduces() or k.scan_ranges():
        return None
    parts = opt.split_segments(k)
    if len(parts) == 1:
        return None
    parts = [replace(opt.merge_loops(opt.drop_unit_loops(p)), meta={}) for p in parts]
    geoms = [_thread_geometry(p, info) for p in parts]
    block = max(g.block for g in geoms)
    for p, g in zip(parts, geoms):
        p.meta[META_KEY] = replace(g, block=block, grid=_grid(g.items, block[0], info))
    return replace(parts[0], then=tuple(parts[1:]))


def optimize(k: Kernel, info: DeviceInfo) -> Kernel:
    """Normalize loops, choose the geometry, attach it as ``meta["gpu"]`` (and set ``wide_acc`` if needed)."""
    k = opt.drop_unit_loops(k)
    # host annotations (parallel loops, SIMD, split or vector accumulators) do not apply: a fresh meta dict
    k = replace(k, parallel=0, vector=False, split_reduce=False, wide_acc=False, meta={}, then=())
    seg = _segments(k, info)
    if seg is not None:
        return seg
    k = opt.merge_loops(k)
    geom = plan(k, info)
    k.meta[META_KEY] = geom
    if needs_wide_acc(linearize(k), geom):
        k = replace(k, wide_acc=True)  # the meta dict (with the geometry) is shared, which is fine: same loops
    return k


def geometry(k: Kernel) -> Geometry:
    """The geometry ``optimize`` attached; a clear error when the kernel did not go through it."""
    geom = k.meta.get(META_KEY)
    if not isinstance(geom, Geometry):
        raise ValueError(f"kernel {k.name} has no GPU geometry: pass it through zyx.kernel.gpu.optimize first")
    return geom


__all__ = ["Geometry", "META_KEY", "coalesced_across", "flatten_count", "geometry", "optimize", "output_blocks",
           "output_loops", "plan", "reduce_chain", "reduce_depths", "reference_info", "serial_lengths"]

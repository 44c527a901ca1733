"""Kernel IR optimizations: each pass maps a Kernel to an equivalent Kernel and is testable alone.

- ``drop_unit_loops``: loops of size 1 disappear (their range becomes 0).
- ``merge_loops``: adjacent output loops merge when every index stays affine in the merged range
  (no ``//`` or ``%`` of it survives simplification), so contiguous work runs as one long loop.
- ``parallelize`` / ``vectorize``: mark the outer loop(s) parallel and the innermost loop vectorizable,
  from the work size and the device's compute units.
- ``widen_accumulators``: long float32 sums accumulate in float64 on targets where that is cheap.
- ``split_segments``: an output loop compared with constants (cat's select chain, pad bounds) splits into one
  loop nest per segment (``Kernel.then``), each with its comparisons decided.
"""

from __future__ import annotations

import math
from dataclasses import replace

from zyx.kernel import ir
from zyx.kernel.ir import Expr, Kernel, Ops, Store
from zyx.kernel.target import DeviceInfo

PARALLEL_MIN_WORK = 1 << 15
SPLIT_REDUCE_MIN = 1 << 15
WIDE_ACC_MIN = 1 << 11


def _all_roots(k: Kernel) -> list[Expr]:
    return [e for s in k.stores for e in (s.index, s.value)]


def _substitute_kernel(k: Kernel, mapping: dict[Expr, Expr], loops: tuple[Expr, ...]) -> Kernel:
    memo: dict = {}
    stores = tuple(Store(s.param, ir.substitute(s.index, mapping, memo), ir.substitute(s.value, mapping, memo))
                   for s in k.stores)
    return replace(k, loops=loops, stores=stores)


def drop_unit_loops(k: Kernel) -> Kernel:
    zero = ir.const(0, ir.index_dtype)
    units = {r: zero for r in k.loops if r.arg[1] == 1}
    for red in k.reduces():
        units.update({r: zero for r in red.arg[1] if r.arg[1] == 1})
    if not units:
        return k
    return _substitute_kernel(k, units, tuple(r for r in k.loops if r not in units))


def _affine_in(roots: list[Expr], r: Expr) -> bool:
    for e in ir.toposort(roots):
        if e.op in (Ops.DIV, Ops.MOD) and e.dtype.is_int and r in e.srcs[0].ranges:
            return False
    return True


def merge_loops(k: Kernel) -> Kernel:
    loops = list(k.loops)
    i = len(loops) - 2
    next_id = max((r.arg[0] for r in _every_range(k)), default=0) + 1
    scans = k.scan_ranges()
    while i >= 0:
        a, b = loops[i], loops[i + 1]
        if a in scans or b in scans:
            i -= 1
            continue
        nb = b.arg[1]
        merged = ir.range_(next_id, a.arg[1] * nb)
        cand = _substitute_kernel(k, {a: merged // nb, b: merged % nb},
                                  tuple(loops[:i]) + (merged,) + tuple(loops[i + 2:]))
        if _affine_in(_all_roots(cand), merged):
            k = cand
            loops = list(cand.loops)
            next_id += 1
        i -= 1
    return k


def _every_range(k: Kernel) -> list[Expr]:
    out = list(k.loops)
    for red in k.reduces():
        out.extend(red.arg[1])
    return out


def _coefficient(index: Expr, r: Expr) -> int:
    terms, _ = ir._linear(index)
    return sum(v for a, v in terms.items() if a is r)


def interchange_reduce(k: Kernel) -> Kernel:
    """Put the innermost output loop inside a reduce that depends on it, when the reduce's loads walk that
    output axis contiguously but its own axis with a stride (matmul, column sums): the reduce keeps one
    accumulator per output element of a tile (``meta["vector_acc"]``) and the tile loop vectorizes."""
    if not k.loops or k.split_reduce or k.scan_ranges():
        return k
    j = k.loops[-1]
    reds = [e for e in k.reduces() if j in e.ranges]
    if len(reds) != 1:
        return k
    red = reds[0]
    loads = [e for e in ir.toposort([red.srcs[0]]) if e.op is Ops.LOAD]
    gain = any(_coefficient(x.srcs[0], j) == 1 and any(abs(_coefficient(x.srcs[0], r)) > 1 for r in red.arg[1])
               for x in loads)
    if not gain:
        return k
    size = j.arg[1]
    tile = next((t for t in (64, 32, 16, 8) if size % t == 0), size if size <= 64 else None)
    if tile is None:
        return k
    next_id = max(r.arg[0] for r in _every_range(k)) + 1
    jb, jj = ir.range_(next_id, size // tile), ir.range_(next_id + 1, tile)
    k2 = _substitute_kernel(k, {j: jb * tile + jj}, k.loops[:-1] + (jb, jj))
    return replace(drop_unit_loops(k2), vector=True, meta={**k.meta, "vector_acc": jj})


def work(k: Kernel) -> int:
    """Iterations of the innermost statements: output size times the largest reduce."""
    red = max((math.prod(r.arg[1] for r in e.arg[1]) for e in k.reduces()), default=1)
    return k.size * red


def parallelize(k: Kernel, info: DeviceInfo) -> Kernel:
    if info.compute_units <= 1:
        return k
    w = work(k)
    if not k.loops:
        reds = k.reduces()
        root_reds = [e for e in reds if not e.ranges]
        if w >= SPLIT_REDUCE_MIN and len(root_reds) == 1 and len(reds) == 1:
            return replace(k, split_reduce=True)
        return k
    scans = k.scan_ranges()
    if w < PARALLEL_MIN_WORK or k.loops[0] in scans:
        return k
    n = 1
    outer = k.loops[0].arg[1]
    # collapse a short outer loop with the next one so every compute unit gets work
    if outer < 4 * info.compute_units and len(k.loops) > 1 and not _reduce_depends_between(k) and \
            k.loops[1] not in scans:
        n = 2
    return replace(k, parallel=n)


def _reduce_depends_between(k: Kernel) -> bool:
    """True when a reduce is placed between the first two loops (collapse would break that placement)."""
    r0, r1 = k.loops[0], k.loops[1]
    for e in k.reduces():
        if r0 in e.ranges and r1 not in e.ranges:
            return True
    return False


def vectorize(k: Kernel) -> Kernel:
    if not k.loops:
        return k
    inner = k.loops[-1]
    if inner in k.scan_ranges():
        return k  # the scan carries its value from one iteration to the next
    for e in k.reduces():
        if inner in e.ranges:
            return k  # a reduce inside the innermost loop: vectorize the reduce instead
    if k.parallel >= len(k.loops) and k.parallel > 1:
        return k
    return replace(k, vector=True)


def widen_accumulators(k: Kernel) -> Kernel:
    for e in k.reduces():
        if e.arg[0] is Ops.ADD and e.dtype.is_float and math.prod(r.arg[1] for r in e.arg[1]) >= WIDE_ACC_MIN:
            return replace(k, wide_acc=True)
    return k


def _cuts(k: Kernel) -> dict[Expr, set[int]]:
    """Per output loop range ``r``: the positions ``c`` in (0, size) where a comparison of ``r`` with a constant
    changes value (``r < c``)."""
    out: dict[Expr, set[int]] = {r: set() for r in k.loops}
    for e in ir.toposort(_all_roots(k)):
        if e.op not in (Ops.CMPLT, Ops.CMPLE):
            continue
        a, b = e.srcs
        if a in out and b.op is Ops.CONST:
            r, c = a, b.arg + (e.op is Ops.CMPLE)
        elif b in out and a.op is Ops.CONST:
            r, c = b, a.arg + (e.op is Ops.CMPLT)
        else:
            continue
        if 0 < c < r.arg[1]:
            out[r].add(int(c))
    return out


MAX_SEGMENTS = 130  # more pieces than this keep the select chain (code size grows with the segments)


def split_segments(k: Kernel) -> list[Kernel]:
    """Index-set splitting: an output loop whose range is compared with constants (the select chain of ``cat``,
    the bounds of ``pad``) becomes one loop nest per segment between the cut points, where every such
    comparison is decided, so each segment keeps only its own branch (one load per element, no gates)."""
    if k.split_reduce:
        return [k]
    best, best_cuts = None, set()
    scans = k.scan_ranges()  # a scan runs across the segments: its loop is never split
    for r, cuts in _cuts(k).items():
        if r not in scans and len(cuts) > len(best_cuts):
            best, best_cuts = r, cuts
    if best is None or len(best_cuts) >= MAX_SEGMENTS:
        return [k]
    next_id = max(x.arg[0] for x in _every_range(k)) + 1
    bounds = [0, *sorted(best_cuts), best.arg[1]]
    parts = []
    for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        rj = ir.range_(next_id + j, hi - lo)
        loops = tuple(rj if x is best else x for x in k.loops)
        parts.append(_substitute_kernel(k, {best: rj + lo}, loops))
    return parts


def optimize(k: Kernel, info: DeviceInfo) -> Kernel:
    k = drop_unit_loops(k)
    if info.kind != "host":
        return merge_loops(k)
    parts = []
    for part in split_segments(k):
        part = merge_loops(drop_unit_loops(part))
        part = interchange_reduce(part)
        part = parallelize(part, info)
        part = vectorize(part)
        parts.append(widen_accumulators(part))
    return replace(parts[0], then=tuple(parts[1:]))

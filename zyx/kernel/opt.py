"""Kernel IR optimizations: each pass maps a Kernel to an equivalent Kernel and is testable alone.

- ``drop_unit_loops``: loops of size 1 disappear (their range becomes 0).
- ``merge_loops``: adjacent output loops merge when every index stays affine in the merged range
  (no ``//`` or ``%`` of it survives simplification), so contiguous work runs as one long loop.
- ``split_divmod_loops``: an output loop indexed through ``r // c`` and ``r % c`` splits into two loops.
- ``parallelize`` / ``vectorize``: mark the outer loop(s) parallel and the innermost loop vectorizable,
  from the work size and the device's compute units.
- ``widen_accumulators``: long float32 sums accumulate in float64 on targets where that is cheap.
- ``split_segments``: an output loop compared with constants (cat's select chain, pad bounds) splits into one
  loop nest per segment (``Kernel.then``), each with its comparisons decided.
- ``interchange_reduce``: a reduce whose loads walk the innermost output axis runs that axis inside it, one
  accumulator per column of a tile; a column sum takes tiles as wide as the compute units allow.
- ``block_vector_reduce``: such a column sum accumulates blocks of rows in register tiles (``meta["vector_block"]``).
- ``stash_row_values``: a row value that a reduce computes and a later loop over the same row recomputes is
  written to a local array once (``STASH``) and read back (``LOCAL``): softmax's exp, LayerNorm's residual add.

``DISABLED`` switches the optional host passes off by name (tests compare outputs with them on and off).
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


SPLIT_MIN_INNER = 8  # a shorter inner loop would not vectorize: keep the division instead


def split_divmod_loops(k: Kernel) -> Kernel:
    """Split an output loop ``r`` whose index reaches the loads and stores as ``r // c`` and ``r % c`` (a permuted
    reshape, such as attention heads merged back) into loops ``r // c`` and ``r % c`` (substituting
    ``r = a * c + b``): the division disappears and the inner loop walks memory contiguously. The inverse of a
    merge that ``merge_loops`` refused; the same iterations in the same order. Only for ``c`` of at least
    ``SPLIT_MIN_INNER``; scans' loops are never split."""
    scans = k.scan_ranges()
    for _ in range(4):
        done = True
        for r in k.loops:
            if r in scans:
                continue
            cs: dict[int, int] = {}
            for e in ir.toposort(_all_roots(k)):
                if e.op in (Ops.DIV, Ops.MOD) and e.dtype.is_int and e.srcs[0] is r and e.srcs[1].op is Ops.CONST:
                    c = e.srcs[1].arg
                    if SPLIT_MIN_INNER <= c < r.arg[1] and r.arg[1] % c == 0:
                        cs[c] = cs.get(c, 0) + 1
            if not cs:
                continue
            c = max(cs, key=lambda x: (cs[x], x))
            next_id = max(x.arg[0] for x in _every_range(k)) + 1
            a, b = ir.range_(next_id, r.arg[1] // c), ir.range_(next_id + 1, c)
            i = k.loops.index(r)
            k = _substitute_kernel(k, {r: a * c + b}, k.loops[:i] + (a, b) + k.loops[i + 1:])
            done = False
            break
        if done:
            break
    return k


def _every_range(k: Kernel) -> list[Expr]:
    out = list(k.loops)
    for red in k.reduces():
        out.extend(red.arg[1])
    return out


def _coefficient(index: Expr, r: Expr) -> int:
    terms, _ = ir._linear(index)
    return sum(v for a, v in terms.items() if a is r)


COLUMN_BLOCKS = (2048, 1024, 512, 256, 128, 64)  # column-block widths tried for a column reduce, widest first


def _column_block(k: Kernel, red: Expr, j: Expr, units: int) -> int | None:
    """The width of the column blocks of a column reduce (every load of ``red`` walks ``j``): the widest of
    ``COLUMN_BLOCKS`` that divides ``j`` and still leaves a block per compute unit (wide blocks stream whole
    row segments, which the hardware prefetches; narrow ones read a few lines per row, pages apart). ``None``
    when ``red`` reads an operand that ``j`` does not walk (matmul keeps its own tile)."""
    loads = [e for e in ir.toposort([red.srcs[0]]) if e.op is Ops.LOAD]
    if not loads or any(j not in x.ranges for x in loads) or red.arg[0] is not Ops.ADD:
        return None
    size, outer = j.arg[1], math.prod(r.arg[1] for r in k.loops[:-1])
    fits = [b for b in COLUMN_BLOCKS if size % b == 0]
    for b in fits:
        if outer * (size // b) >= units:
            return b
    return fits[-1] if fits else None


def interchange_reduce(k: Kernel, units: int = 1, column_blocks: bool = True) -> Kernel:
    """Put the innermost output loop inside a reduce that depends on it, when the reduce's loads walk that
    output axis contiguously but its own axis with a stride (matmul, column sums): the reduce keeps one
    accumulator per output element of a tile (``meta["vector_acc"]``) and the tile loop vectorizes. A column
    sum (every load walks the output axis) takes column blocks as wide as ``units`` compute units allow
    (``_column_block``), which ``block_vector_reduce`` then cuts into register tiles."""
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
    tile = (column_blocks and _column_block(k, red, j, units)) or \
        next((t for t in (64, 32, 16, 8) if size % t == 0), size if size <= 64 else None)
    if tile is None:
        return k
    next_id = max(r.arg[0] for r in _every_range(k)) + 1
    jb, jj = ir.range_(next_id, size // tile), ir.range_(next_id + 1, tile)
    k2 = _substitute_kernel(k, {j: jb * tile + jj}, k.loops[:-1] + (jb, jj))
    return replace(drop_unit_loops(k2), vector=True, meta={**k.meta, "vector_acc": jj})


VECTOR_TILE = 64  # accumulators of one register tile (4 AVX-512 / 8 AVX registers of float32)
ROW_BLOCK = 8  # reduce iterations accumulated in a register tile before it is added into the block's sums


def block_vector_reduce(k: Kernel) -> Kernel:
    """Register-tile a vectorized column sum (``meta["vector_acc"]``): the reduce loop runs in blocks of
    ``ROW_BLOCK`` iterations; in a block, each ``VECTOR_TILE`` columns accumulate into a tile of partial sums
    (kept in registers), which is then added into the column's accumulator (``meta["vector_block"]`` =
    (row block, tile), rendered by ``CRenderer``). Sums reassociate (blocks of ``ROW_BLOCK`` rows); with wide
    accumulators the partials are float32 and the block sums float64, as in long row sums. Only single-range
    ``ADD`` reduces whose tile divides into ``VECTOR_TILE`` columns are blocked, and only when the tile is wider
    than a register tile or accumulates in float64 (a matmul's float32 tile already is a register tile)."""
    vec = k.meta.get("vector_acc")
    if vec is None or vec.arg[1] % VECTOR_TILE or (vec.arg[1] == VECTOR_TILE and not k.wide_acc):
        return k
    reds = [e for e in k.reduces() if vec in e.ranges]
    if len(reds) != 1 or reds[0].arg[0] is not Ops.ADD or len(reds[0].arg[1]) != 1 or \
            reds[0].arg[1][0].arg[1] < 2 * ROW_BLOCK:
        return k
    return replace(k, meta={**k.meta, "vector_block": (ROW_BLOCK, VECTOR_TILE)})


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
    vec = k.meta.get("vector_acc")  # its reduce runs in the loop above the tile loop: no collapse across it
    if outer < 4 * info.compute_units and len(k.loops) > 1 and not _reduce_depends_between(k) and \
            k.loops[1] not in scans and not (vec is not None and vec is k.loops[1]):
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


STASH_MIN_COST = 3  # loads + ALU ops (a transcendental counts 8) a recomputed row value must cost to be stashed
STASH_MAX_BYTES = 32 << 10  # one local array (a row), on the stack of the thread running the row
STASH_TOTAL_BYTES = 64 << 10


def _cost(e: Expr, r: Expr) -> int:
    """Loads and float/int ALU operations of ``e`` that run per iteration of ``r`` (index arithmetic is free:
    it is hoisted or strength-reduced; what does not depend on ``r`` is computed once outside the loop)."""
    n = 0
    for x in ir.toposort([e]):
        if x.op in (Ops.CONST, Ops.RANGE, Ops.VAR) or x.op is Ops.REDUCE or r not in x.ranges:
            continue
        if x.op is Ops.LOAD or x.op is Ops.LOCAL:
            n += 1
        elif x.op in ir.TRANSCENDENTAL:
            n += 8
        elif not (x.dtype is ir.index_dtype and x.op in (Ops.ADD, Ops.MUL, Ops.DIV, Ops.MOD)):
            n += 1
    return n


def _stash_consumers(k: Kernel, red: Expr) -> list[tuple[Expr, list[Expr]]]:
    """Loops that run after ``red`` over a range of the same size as its single range: the kernel's innermost
    output loop when ``red`` is computed outside it, and every other single-range reduce that ``red`` does not
    depend on (it will: reading the stash orders it after ``red``). Each with the roots of its body."""
    (rr,) = red.arg[1]
    n = rr.arg[1]
    out: list[tuple[Expr, list[Expr]]] = []
    ro = k.loops[-1] if k.loops else None
    if ro is not None and ro.arg[1] == n and ro not in red.ranges and red.ranges <= set(k.loops):
        # (``red`` inside another reduce's loop is out of the output loop's scope)
        out.append((ro, [e for s in k.stores for e in (s.index, s.value)]))
    inside = {id(x) for x in ir.toposort([red.srcs[0]])}
    for r2 in k.reduces():
        if r2 is red or id(r2) in inside or len(r2.arg[1]) != 1 or r2.arg[1][0].arg[1] != n or \
                not red.ranges <= r2.ranges:  # reading the stash must not move r2 into deeper loops
            continue
        out.append((r2.arg[1][0], [r2.srcs[0]]))
    return out


def stash_row_values(k: Kernel) -> Kernel:
    """Compute a row value once: when a single-range reduce (a softmax's max or sum, a LayerNorm's mean) computes
    an expression of its range that a later loop over a range of the same size recomputes (the output loop, or
    the next reduce), the reduce also writes it to a local array (``STASH``) and the later loop reads it there
    (``LOCAL``) instead. Exact: the same operations on the same values, so the same bits. Only expressions
    costing ``STASH_MIN_COST`` or more are stashed, arrays of at most ``STASH_MAX_BYTES``; host kernels without
    split reduces, column tiles or scans."""
    if k.split_reduce or "vector_acc" in k.meta or k.scan_ranges():
        return k
    slot, total = 0, 0
    for i in range(len(k.reduces())):
        reds = k.reduces()  # rebuilt by every stash: take the i-th afresh
        if i >= len(reds) or len(reds[i].arg[1]) != 1:
            continue
        red = reds[i]
        (rr,) = red.arg[1]
        while True:
            consumers = _stash_consumers(k, red)
            if not consumers:
                break
            found = None
            for s in reversed(ir.toposort([red.srcs[0]])):  # largest first
                if rr not in s.ranges or s.op in (Ops.RANGE, Ops.STASH, Ops.REDUCE) or s.dtype is ir.index_dtype \
                        or _cost(s, rr) < STASH_MIN_COST:
                    continue
                nbytes = rr.arg[1] * max(s.dtype.itemsize, 4)
                if nbytes > STASH_MAX_BYTES or total + nbytes > STASH_TOTAL_BYTES:
                    continue
                hits = []
                for c, roots in consumers:
                    s2 = ir.substitute(s, {rr: c})
                    if any(x is s2 for x in ir.toposort(roots)):
                        hits.append((c, s2))
                if hits:
                    found = (s, hits, nbytes)
                    break
            if found is None:
                break
            s, hits, nbytes = found
            new_red = ir.substitute(red, {s: ir.stash(s, rr, slot)})
            mapping = {red: new_red}
            for c, s2 in hits:
                mapping[s2] = ir.local(slot, rr.arg[1], s.dtype, c, new_red, (s.vmin, s.vmax))
            k = _substitute_kernel(k, mapping, k.loops)
            red, slot, total = new_red, slot + 1, total + nbytes
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


DISABLED: set[str] = set()  # names of optional host passes switched off (tests compare outputs with and without)


def optimize(k: Kernel, info: DeviceInfo) -> Kernel:
    """The host pipeline (GPU targets only normalize loops; ``kernel.gpu`` does the rest). Passes named in
    ``DISABLED`` (``"column_block"``, ``"block_vector_reduce"``, ...) are skipped."""
    k = drop_unit_loops(k)
    if info.kind != "host":
        return merge_loops(k)
    parts = []
    units = 1 if "column_block" in DISABLED else info.compute_units
    for part in split_segments(k):
        part = merge_loops(drop_unit_loops(part))
        if "split_divmod_loops" not in DISABLED:
            part = split_divmod_loops(part)
        part = interchange_reduce(part, units, column_blocks="column_block" not in DISABLED)
        part = parallelize(part, info)
        part = vectorize(part)
        part = widen_accumulators(part)
        if "block_vector_reduce" not in DISABLED:
            part = block_vector_reduce(part)
        if "stash_row_values" not in DISABLED:
            part = stash_row_values(part)
        parts.append(part)
    return replace(parts[0], then=tuple(parts[1:]))

"""Kernel IR optimizations: each pass maps a Kernel to an equivalent Kernel and is testable alone.

- ``drop_unit_loops``: loops of size 1 disappear (their range becomes 0).
- ``merge_loops``: adjacent output loops merge when every index stays affine in the merged range
  (no ``//`` or ``%`` of it survives simplification), so contiguous work runs as one long loop.
- ``merge_reduce_ranges``: adjacent ranges of one reduce merge when its value stays affine (a mean over (h, w)).
- ``scatter_one_hot``: a sum of a one-hot selection (a gather's gradient) becomes a zeroing segment and a segment
  adding each term at the row its index picks (``Kernel.scatter``); disabled by name ``"scatter"``.
- ``split_divmod_loops``: an output loop indexed through ``r // c`` and ``r % c`` splits into two loops.
- ``unroll_divmod_loops``: an elementwise loop indexed through ``(r + b) // c`` and ``% c`` for a short ``c`` (phases
  of an interleave) is unrolled by ``c``: one copy of the stores per phase, its divisions folded.
- ``split_ragged_phases``: such a loop whose extent ``c`` does not divide splits into a part it divides and the
  remainder (``Kernel.then``), so the unrolling takes the first.
- ``unroll_compared_loops``: a short middle loop compared with a constant is unrolled whole (comparisons decided).
- ``tile_transpose``: a kernel whose contiguous stores read a load across lines (transpose, permute) runs in
  square blocks of the two loops, so the lines it reads stay cached; disabled by name ``"transpose"``.
- ``parallelize`` / ``vectorize``: mark the outer loop(s) parallel and the innermost loop vectorizable,
  from the work size and the device's compute units.
- ``widen_accumulators``: long float32 sums accumulate in float64 on targets where that is cheap.
- ``split_segments``: an output loop compared with constants (cat's select chain, pad bounds) splits into one
  loop nest per segment (``Kernel.then``), each with its comparisons decided.
- ``interchange_reduce``: a reduce whose loads walk the innermost output axis runs that axis inside it, one
  accumulator per column of a tile; a column sum takes tiles as wide as the compute units allow.
- ``block_vector_reduce``: such a column sum accumulates blocks of rows in register tiles (``Kernel.vector_block``).
- ``tile_gemm``: a contraction (matmul, batched, any operand layout) runs as packed column panels of its right
  operand and MR x NR register tiles of accumulators (``Kernel.gemm``, rendered by ``CRenderer``); disabled by
  name ``"gemm"``.
- ``unroll_reduce``: a long float32 sum keeps several independent partial sums per block (``Kernel.reduce_lanes``).
- ``upcast_rows``: such a row sum computes several consecutive outputs per iteration, their sums in one loop
  (``Kernel.upcast_rows``).
- ``prefetch_blocks``: an input that each iteration of the parallel outer loop reads as several short streams has
  the next iteration's block prefetched (``Kernel.prefetch``).
- ``prefetch_streams``: a long sum with lanes prefetches its contiguous input loads a fixed distance ahead
  (``Kernel.stream_prefetch``).
- ``stash_row_values``: a row value that a reduce computes and a later loop over the same row recomputes is
  written to a local array once (``STASH``) and read back (``LOCAL``): softmax's exp, LayerNorm's residual add.

``DISABLED`` switches the optional host passes off by name (tests compare outputs with them on and off).
``optimize(k, info, params)`` takes the passes' tunable parameters by name (``search_space`` lists them with
their candidate values); a missing name takes the heuristic's choice, so ``params=None`` is the default pipeline
and every candidate computes the same values (only speed differs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from zyx import dtypes
from zyx.kernel import ir
from zyx.kernel.contraction import Contraction, find_contraction
from zyx.kernel.ir import Expr, Kernel, Scatter, Store
from zyx.kernel.target import DeviceInfo
from zyx.ops import TRANSCENDENTAL, Ops

PARALLEL_MIN_WORK = 1 << 15
# a segment of a split loop (``split_segments``) whose kernel has PARALLEL_MIN_WORK in all runs in parallel from
# this much work: the other segments' regions have woken the threads already. The border segments of a 7x7 stride-2
# input gradient's phases (10,752 elements, each adding strided columns) had run on one thread: 0.66 -> 0.47 ms
PARALLEL_SEGMENT_MIN_WORK = 1 << 13
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
    return not _divmods_of(roots, (r,))


def _divmods_of(roots: list[Expr], ranges: tuple[Expr, ...]) -> int:
    """How many integer divisions and remainders under ``roots`` see any of ``ranges``."""
    return sum(e.op in (Ops.DIV, Ops.MOD) and e.dtype.is_int and any(r in e.srcs[0].ranges for r in ranges)
               for e in ir.toposort(roots))


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
        # merged when every division the merge makes folds (a division the two loops reach already may stay:
        # a group's index (c * hw + i) // (hw * c / g) over merged loops is one split_divmod_loops can split)
        if _divmods_of(_all_roots(cand), (merged,)) <= _divmods_of(_all_roots(k), (a, b)):
            k = cand
            loops = list(cand.loops)
            next_id += 1
        i -= 1
    return k


def _rewrite_reduces(k: Kernel, rewrite: Callable[[Expr, Expr], tuple[Expr, list[Expr]] | None]) -> Kernel:
    """``k`` with its reduces rebuilt, inner first: ``rewrite(reduce, source)`` gives a reduce's new (source,
    ranges), or None to keep them; the source handed over already reads the rebuilt inner reduces, so every use of
    a reduce sees the same one (a variance's sum of squares had kept its mean unmerged beside the merged one that
    the kernel's other uses read: the mean ran twice)."""
    mapping: dict[Expr, Expr] = {}
    memo: dict = {}
    for e in k.reduces():
        value = ir.substitute(e.srcs[0], mapping, memo) if mapping else e.srcs[0]
        new = rewrite(e, value)
        if new is not None or value is not e.srcs[0]:
            value, ranges = new if new is not None else (value, e.arg[1])
            mapping[e] = ir.reduce(e.arg[0], value, tuple(ranges), e.dtype)
    return _substitute_kernel(k, mapping, k.loops) if mapping else k


def merge_reduce_ranges(k: Kernel) -> Kernel:
    """Adjacent ranges of one reduce merge (``a = m // nb``, ``b = m % nb``) when its value stays affine in the
    merged range: a mean over (h, w) becomes one long contiguous sum, which the long-sum passes (float partial
    blocks, independent lanes) then speed up; the elements are visited in the same order. (A global average pool
    of 32x32x64x64 summed 64 rows of 64 into one double, one dependent add at a time: 1.2 ms.)"""
    next_id = max((r.arg[0] for r in _every_range(k)), default=0) + 1

    def merge(e: Expr, value: Expr) -> tuple[Expr, list[Expr]] | None:
        nonlocal next_id
        ranges = list(e.arg[1])
        i = len(ranges) - 2
        while i >= 0:
            a, b = ranges[i], ranges[i + 1]
            m = ir.range_(next_id, a.arg[1] * b.arg[1])
            merged = ir.substitute(value, {a: m // b.arg[1], b: m % b.arg[1]})
            if _affine_in([merged], m):
                value, ranges[i:i + 2] = merged, [m]
                next_id += 1
            i -= 1
        return (value, ranges) if len(ranges) < len(e.arg[1]) else None

    return _rewrite_reduces(k, merge)


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
            cs = {c: n for c, n in _divisors_of(_all_roots(k), r).items() if c >= SPLIT_MIN_INNER}
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


def _divisors_of(roots: list[Expr], r: Expr) -> dict[int, int]:
    """Constant divisors ``c`` of the integer divisions and remainders of range ``r`` itself (``r // c``,
    ``r % c``) under ``roots`` that split ``r`` evenly, with how many such nodes each has."""
    cs: dict[int, int] = {}
    for e in ir.toposort(roots):
        if e.op in (Ops.DIV, Ops.MOD) and e.dtype.is_int and e.srcs[0] is r and e.srcs[1].op is Ops.CONST:
            c = e.srcs[1].arg
            if 1 < c < r.arg[1] and r.arg[1] % c == 0:
                cs[c] = cs.get(c, 0) + 1
    return cs


def split_divmod_reduces(k: Kernel) -> Kernel:
    """Split a reduce range ``r`` whose value reads ``r // c`` and ``r % c`` (flattened window taps: a depthwise
    convolution's 3 x 3 taps as one range of 9) into ranges ``r // c`` and ``r % c`` (``r = a * c + b``): the
    same terms in the same order, the divisions fold, and the taps' strides become affine coefficients, which
    ``interchange_reduce`` needs to see that the loads walk the output axis contiguously and the taps with a
    stride. For kernels ``tile_gemm`` left alone (a GEMM's k stays one range)."""
    next_id = max((r.arg[0] for r in _every_range(k)), default=0) + 1

    def split(e: Expr, value: Expr) -> tuple[Expr, list[Expr]] | None:
        nonlocal next_id
        ranges = list(e.arg[1])
        i = 0
        while i < len(ranges):
            cs = _divisors_of([value], ranges[i])
            if not cs:
                i += 1
                continue
            c = max(cs, key=lambda x: (cs[x], x))
            r = ranges[i]
            a, b = ir.range_(next_id, r.arg[1] // c), ir.range_(next_id + 1, c)
            next_id += 2
            value, ranges[i:i + 1] = ir.substitute(value, {r: a * c + b}), [a, b]
        return (value, ranges) if len(ranges) > len(e.arg[1]) else None

    return _rewrite_reduces(k, split)


def ungate_loads(k: Kernel) -> Kernel:
    """A gated load in the innermost loop (its address or its gate walks it) whose index stays inside its buffer
    whatever the gate loads unconditionally, then selects: ``where(gate, p[i], 0)``, the same value. GCC 12 left
    whole loops scalar under such gates: a masked load from a loop-invariant address (a depthwise convolution's input
    gradient: 63 -> 11 ms ungated), and loads walking the loop under gates that are, or include, a condition
    invariant in it ("complicated access pattern": a strided col2im's taps, whose output row decides them; a 7x7
    stride-2 stem's input gradient, 16x3x64x64, 0.85-0.88 -> 0.17-0.20 ms). Loads outside the innermost loop stay
    gated: hoisting the depthwise gradient's nine gated weight loads out of its row loop made GCC spill in the
    vector loop (2.55 -> 3.41 ms)."""
    if not k.loops:
        return k
    inner = k.loops[-1]
    mapping: dict[Expr, Expr] = {}
    for e in ir.toposort(_all_roots(k)):
        if e.op is not Ops.LOAD or len(e.srcs) < 2 or not (inner in e.srcs[0].ranges or inner in e.srcs[1].ranges):
            continue
        index, size = e.srcs[0], k.params[e.arg].size
        if size and 0 <= index.vmin and index.vmax < size:
            zero = ir.const(0.0 if e.dtype.is_float else 0, e.dtype)
            mapping[e] = ir.where(e.srcs[1], ir.load(e.arg, e.dtype, index), zero)
    return _substitute_kernel(k, mapping, k.loops) if mapping else k


def _unrolled(k: Kernel, r: Expr, factor: int) -> tuple[Expr, tuple[Store, ...]]:
    """Output loop ``r`` unrolled by ``factor`` (which divides it): a new range ``a`` of ``r / factor`` iterations
    and ``k``'s stores once per ``u < factor`` with ``r = factor * a + u`` (simplified: constants fold); ``a`` is
    the constant 0 when ``factor`` is the whole loop."""
    a = ir.const(0, ir.index_dtype) if factor == r.arg[1] else \
        ir.range_(max(x.arg[0] for x in _every_range(k)) + 1, r.arg[1] // factor)
    stores: list[Store] = []
    for u in range(factor):
        memo: dict = {}
        at = {r: a * factor + u}
        stores.extend(Store(s.param, ir.substitute(s.index, at, memo), ir.substitute(s.value, at, memo))
                      for s in k.stores)
    return a, tuple(stores)


def _plain_elementwise(k: Kernel, nodes: list[Expr]) -> bool:
    """Whether ``k`` (whose expressions are ``nodes``) is one elementwise loop nest: no segments, GEMM, vector
    accumulators, reduces, scans, stashes or local arrays, so the unrolling passes may copy its stores."""
    return not (k.then or k.gemm is not None or k.vector_acc is not None or k.reduces() or k.scan_ranges() or
                any(e.op in (Ops.STASH, Ops.LOCAL) for e in nodes))


UNROLL_DIVMOD_COPIES = 8  # most copies of an elementwise loop body ``unroll_divmod_loops`` makes (2x2x2: 3-D phases)


def _phase_divisors(k: Kernel, r: Expr) -> dict[int, int]:
    """Constant divisors ``c`` of the integer divisions and remainders that see output loop ``r`` with coefficient
    1 (``(r + b) // c``, ``(r + b) % c``), with how many such nodes each has."""
    cs: dict[int, int] = {}
    for e in ir.toposort(_all_roots(k)):
        if e.op in (Ops.DIV, Ops.MOD) and e.dtype.is_int and e.srcs[1].op is Ops.CONST and \
                r in e.srcs[0].ranges and ir.affine_coefficient(e.srcs[0], r) == 1:
            cs[e.srcs[1].arg] = cs.get(e.srcs[1].arg, 0) + 1
    return cs


def _unroll_factor(k: Kernel, r: Expr, c: int, copies: int) -> int:
    """How many copies ``unroll_divmod_loops`` makes of loop ``r`` of ``k`` for divisor ``c`` (after ``copies``):
    ``c``, or the whole loop when it is the innermost and would keep fewer than ``SPLIT_MIN_INNER`` iterations
    (too short to vectorize), where the budget allows."""
    n = r.arg[1]
    return n if r is k.loops[-1] and n // c < SPLIT_MIN_INNER and n * copies <= UNROLL_DIVMOD_COPIES else c


def unroll_divmod_loops(k: Kernel) -> Kernel:
    """Unroll an output loop ``r`` whose index reaches the loads as ``(r + b) // c`` and ``(r + b) % c`` for a short
    ``c`` (the phases of an interleave: a strided transposed convolution's col2im, pixel shuffle, upsampling):
    ``r = c * a + u`` for each constant ``u``, so the division and the remainder fold, the gates that picked one
    phase per output are decided, and each of the ``c`` copies of the stores loads its own phase, contiguously
    along ``a``. Elementwise kernels only (no reduce, scan or stash), innermost loops first, at most
    ``UNROLL_DIVMOD_COPIES`` copies in all; a loop is left alone unless unrolling removes its divisions by ``c``.
    An innermost loop that would keep fewer than ``SPLIT_MIN_INNER`` iterations is unrolled whole (the vector loop
    becomes the next one out, not a loop of 2)."""
    if not _plain_elementwise(k, ir.toposort(_all_roots(k))):
        return k
    copies = 1
    for r in reversed(k.loops):
        cs = {c: n for c, n in _phase_divisors(k, r).items() if 1 < c <= UNROLL_DIVMOD_COPIES // copies}
        # the most used divisor first; a larger one where the smaller leaves divisions (r // 2 % 2 beside r // 4
        # and r % 2: unrolled by 2, a // 2 and a % 2 remain; by 4, nothing)
        for c in sorted(cs, key=lambda x: (cs[x], x), reverse=True):
            if r.arg[1] % c or r.arg[1] // c < 2:
                continue
            c = _unroll_factor(k, r, c, copies)
            a, stores = _unrolled(k, r, c)
            loops = tuple(a if x is r else x for x in k.loops if x is not r or a.op is Ops.RANGE)
            cand = replace(k, loops=loops, stores=stores)
            if a.op is not Ops.RANGE or c not in _phase_divisors(cand, a):
                k, copies = cand, copies * c
                break
    return k


def split_ragged_phases(k: Kernel) -> list[Kernel]:
    """Index-set splitting for ``unroll_divmod_loops``: an elementwise output loop indexed through ``(r + b) // c``
    and ``% c`` (its most used short divisor ``c``) whose extent ``n`` ``c`` does not divide becomes two loop nests
    (segments): ``r < n - n % c``, which the unrolling takes, and the ``n % c`` last iterations, which keep their
    divisions. Every loop in turn (innermost first) within the unrolling's budget (``UNROLL_DIVMOD_COPIES`` copies
    in all: a loop it would not unroll is not split), so a 3-D interleave cropped on every axis makes up to 8
    segments. (A 1-D transposed convolution, kernel 5, stride 3, 1502 outputs a row: its col2im had divided every
    index by 3 and gathered its taps, 1.6x the time of the phases stored apart and interleaved.)"""
    if k.split_reduce or not _plain_elementwise(k, ir.toposort(_all_roots(k))):
        return [k]
    copies = 1
    for r in reversed(k.loops):
        uses = {c: u for c, u in _phase_divisors(k, r).items() if 1 < c <= UNROLL_DIVMOD_COPIES // copies}
        if not uses:
            continue
        c, n = max(uses, key=lambda x: (uses[x], x)), r.arg[1]
        if n // c < 2:
            continue
        if n % c == 0:  # the unrolling takes this loop as it is
            copies *= _unroll_factor(k, r, c, copies)
            continue
        return [s for part in _split_loop(k, r, (0, n - n % c, n)) for s in split_ragged_phases(drop_unit_loops(part))]
    return [k]


UNROLL_COMPARED_COPIES = 4  # most copies of an elementwise loop body ``unroll_compared_loops`` makes


def unroll_compared_loops(k: Kernel) -> Kernel:
    """Unroll whole the short output loops (``UNROLL_COMPARED_COPIES`` copies in all) that are neither the outer
    (thread) nor the inner (vector) loop and whose range is compared with a constant: a half of a sorting
    network's block (``r == 0``), split off by ``split_divmod_loops``. In each copy the comparison is decided; left
    as a loop-invariant ``_Bool`` beside the vector loop's compares, it made GCC vectorize that loop with 8-byte
    vectors (a 2048^2 sort's stage pair: 18 ms, 2.6 unrolled). Elementwise kernels only."""
    nodes = ir.toposort(_all_roots(k))
    if not _plain_elementwise(k, nodes):
        return k
    compared = {x for e in nodes if e.op in (Ops.CMPLT, Ops.CMPLE, Ops.CMPEQ, Ops.CMPNE)
                and any(y.op is Ops.CONST for y in e.srcs) for x in e.srcs if x.op is Ops.RANGE}
    copies = 1
    for r in k.loops[1:-1]:
        if r in compared and copies * r.arg[1] <= UNROLL_COMPARED_COPIES:
            _, stores = _unrolled(k, r, r.arg[1])
            k = replace(k, loops=tuple(x for x in k.loops if x is not r), stores=stores)
            copies *= r.arg[1]
    return k


# software prefetch of the next outer iteration's input block (``prefetch_blocks``). On the 2-core Zen 4, the
# col2im of a 3x3 convolution's input gradient (9 loads of 256 floats per output row, 9 KiB a channel) ran at 12
# GB/s from memory (1.5-1.7 ms for 19 MB) and at 50 GB/s with the next channel's block prefetched (0.36-0.42 ms);
# two or four channels ahead were slower than one
PREFETCH_MIN_LOADS = 3  # distinct loads of one input: interleaved streams too short for the hardware prefetcher
PREFETCH_MIN_BYTES = 1 << 10  # block of one iteration, at least
PREFETCH_MAX_BYTES = 64 << 10  # ... and at most (the next block waits in L2 beside the current one)
PREFETCH_MIN_INPUT = 4 << 20  # smaller inputs tend to be cached already


def prefetch_blocks(k: Kernel) -> Kernel:
    """Prefetch, at the top of each iteration of the parallel outer loop ``r``, the block of an input that the
    next iteration reads (``Kernel.prefetch``), where the iteration reads that block through at least
    ``PREFETCH_MIN_LOADS`` loads at different offsets (a col2im's taps, a transposed convolution's phases): each
    is a stream of a few lines, which the hardware prefetcher does not follow, so the loads wait on memory. Every
    load of the input must advance by one stride ``s`` per iteration and read within a block of at most ``2 s``
    elements (the blocks tile the input, read once each). Changes no value."""
    if k.parallel != 1 or not k.loops or k.gemm is not None or k.prefetch or k.loops[0].arg[1] < 2:
        return k
    r = k.loops[0]
    loads: dict[int, list[Expr]] = {}
    for e in ir.toposort(_all_roots(k)):
        if e.op is Ops.LOAD:
            loads.setdefault(e.arg, []).append(e)
    zero = ir.const(0, ir.index_dtype)
    out = []
    for p, xs in sorted(loads.items()):
        param, indices = k.params[p], {x.srcs[0] for x in xs}
        size = param.dtype.itemsize
        if param.kind != "in" or param.size * size < PREFETCH_MIN_INPUT or len(indices) < PREFETCH_MIN_LOADS:
            continue
        strides = {ir.affine_coefficient(i, r) for i in indices}
        if len(strides) != 1 or not (s := strides.pop()) or s < 0:
            continue
        rest = [ir.substitute(i, {r: zero}) for i in indices]
        lo, hi = min(e.vmin for e in rest), max(e.vmax for e in rest)
        if hi - lo + 1 <= 2 * s and PREFETCH_MIN_BYTES <= (hi - lo + 1) * size <= PREFETCH_MAX_BYTES:
            out.append(ir.Prefetch(p, r, s, lo, hi - lo + 1))
    return replace(k, prefetch=tuple(out)) if out else k


# software prefetch along a long sum (``prefetch_streams``). On the 2-core Zen 4, 4096^2 float32 row sums from memory
# (in turns, each after 128 MB read elsewhere, 61 runs each, 5 runs): 1 KiB ahead 6-17% faster than none; 512 B and
# 2 KiB within 2% of 1 KiB, all fetched into L1 (locality 3). Fetched into L2 instead (locality 2), the L1 left to the
# hardware prefetcher: the kernel alone, 2 KiB ahead, 5-17% faster than 1 KiB into L1 in 6 runs of 30 rounds in turns
# (1 KiB into L2 within 3% of 2 KiB, 4 KiB 0-6% slower; locality 1 the same as 2); the whole ``x.sum(1)`` 7-11% faster
# in 4 runs, a row variance 5-14% in 2 (2026-12-06, AMD EPYC family 25). Each of those calls followed its own warm-up
# call; right after torch's call (the bench's order), whose OpenMP thread still spins on the second core, the kernel
# is 1-2% faster, and both prefetches level with torch
STREAM_PREFETCH_BYTES = 2 << 10
STREAM_PREFETCH_LOCALITY = 2


def prefetch_streams(k: Kernel, distance: int | None = None, locality: int | None = None) -> Kernel:
    """Prefetch ``distance`` bytes (default ``STREAM_PREFETCH_BYTES``) ahead of each contiguous load of a long sum
    with ``reduce_lanes`` (``Kernel.stream_prefetch``) into the cache level ``locality`` names (default
    ``STREAM_PREFETCH_LOCALITY``), once per block of lanes, for inputs of at least
    ``PREFETCH_MIN_INPUT`` bytes: the hardware prefetcher alone leaves a row sum of a 64 MB matrix short of the
    bandwidth that two cores reach. Loads behind a gate or through a loaded index are left alone. Changes no
    value."""
    distance = STREAM_PREFETCH_BYTES if distance is None else distance
    locality = STREAM_PREFETCH_LOCALITY if locality is None else locality
    if k.reduce_lanes <= 1 or distance <= 0 or k.stream_prefetch is not None:
        return k
    params: set[int] = set()
    for e in k.reduces():
        if len(e.arg[1]) != 1 or e.arg[0] is not Ops.ADD or not e.dtype.is_float:
            continue
        (rr,) = e.arg[1]
        for x in ir.toposort([e.srcs[0]]):
            if x.op is not Ops.LOAD or len(x.srcs) != 1 or ir.affine_coefficient(x.srcs[0], rr) != 1:
                continue
            p = k.params[x.arg]
            if p.kind == "in" and p.size * p.dtype.itemsize >= PREFETCH_MIN_INPUT and \
                    all(i.op not in _INDEX_OPAQUE for i in ir.toposort([x.srcs[0]])):
                params.add(x.arg)
    if not params:
        return k
    size = max(k.params[p].dtype.itemsize for p in params)
    return replace(k, stream_prefetch=ir.StreamPrefetch(tuple(sorted(params)), max(distance // size, 1), locality))


_INDEX_OPAQUE = frozenset({Ops.LOAD, Ops.LOCAL, Ops.STASH, Ops.REDUCE, Ops.SCAN})  # no index the renderer inlines


TRANSPOSE_TILES = (64, 32, 16, 8)  # tile edges (elements) tried for a transposing kernel, the first that divides
TRANSPOSE_MIN_STRIDE = 16  # a load this many elements apart between neighbouring outputs misses a line each time


def _transpose_axes(k: Kernel) -> tuple[Expr, Expr] | None:
    """(i, j) of a transposing kernel: its innermost output loop ``j`` stores contiguously while some load walks
    ``j`` at least ``TRANSPOSE_MIN_STRIDE`` elements apart and another output loop ``i`` contiguously (a
    transpose, a permute that moves the last axis). None for kernels with reduces or scans, a param that is both
    read and written, or no such load."""
    if len(k.loops) < 2 or k.reduces() or k.scan_ranges() or k.split_reduce:
        return None
    j = k.loops[-1]
    if any(ir.affine_coefficient(st.index, j) != 1 for st in k.stores):
        return None
    loads = [e for e in ir.toposort(_all_roots(k)) if e.op is Ops.LOAD]
    if {e.arg for e in loads} & {st.param for st in k.stores}:
        return None
    for e in loads:
        cj = ir.affine_coefficient(e.srcs[0], j)
        if cj is None or abs(cj) < TRANSPOSE_MIN_STRIDE:
            continue
        for i in k.loops[:-1]:
            if ir.affine_coefficient(e.srcs[0], i) == 1:
                return i, j
    return None


def tile_transpose(k: Kernel, tile: int | None = None, blocks: bool = True) -> Kernel:
    """Run a transposing kernel (``_transpose_axes``) in ``T x T`` blocks of its loops ``i`` and ``j``: loops
    ``(..., i_o, j_o, i_t, j_t)`` with ``i = i_o * T + i_t``, ``j = j_o * T + j_t``, the other output loops outside in
    their order. Within a block the strided load touches ``T`` lines that stay cached while ``j`` walks them,
    instead of a new line (and page) per output. ``T``: ``tile`` (0 = off), else the first of ``TRANSPOSE_TILES``
    that divides both loops. Every output element is still computed once from the same values (no reduce, no
    param read and written): bit-identical results, another order.

    With ``blocks``, a tile whose edge is a multiple of ``ir.TRANSPOSE_BLOCK`` also stages its transposed loads
    (``ir.transposed_block_loads``) in register-transposed blocks (``Kernel.transpose_block``, rendered by
    ``CRenderer``): whole-vector loads along the input's rows, shuffles, then the body reads the block along the
    output's rows. Kernels alone, 2-core Zen 4, blocks against elements: float32 square transposes of 512-4096
    0.10-0.63x the time (4096^2: 29-31 -> 7.0 ms, a copy 4.1), 1024x3136 0.67-0.69x, NCHW <-> NHWC of 64 channels
    0.25-0.90x; float64 4096x2048 13.4-14.4 -> 7.1-7.2 ms, 1024^2 1.6 -> 0.3-0.35 ms, int64 2048^2 7.1 -> 3.2-4.7;
    bfloat16 2048^2 5.6 -> 1.7-2.0 ms (``x.T * 2``: 18 -> 3.1-3.6), int16 6.4-7.0 -> 1.5-1.7 ms."""
    axes = _transpose_axes(k)
    if axes is None or tile == 0:
        return k
    i, j = axes
    cands = (tile,) if tile else TRANSPOSE_TILES
    t = next((c for c in cands if i.arg[1] % c == 0 and j.arg[1] % c == 0 and i.arg[1] > c and j.arg[1] > c), None)
    if t is None:
        return k
    nid = max(x.arg[0] for x in _every_range(k)) + 1
    io, jo = ir.range_(nid, i.arg[1] // t), ir.range_(nid + 1, j.arg[1] // t)
    it, jt = ir.range_(nid + 2, t), ir.range_(nid + 3, t)
    loops = tuple(r for r in k.loops if r is not i and r is not j) + (io, jo, it, jt)
    tiled = _substitute_kernel(k, {i: io * t + it, j: jo * t + jt}, loops)
    if blocks and t % ir.TRANSPOSE_BLOCK == 0 and ir.transposed_block_loads(tiled):
        tiled = replace(tiled, transpose_block=ir.TRANSPOSE_BLOCK)
    return tiled


def _every_range(k: Kernel) -> list[Expr]:
    out = list(k.loops)
    for red in k.reduces():
        out.extend(red.arg[1])
    return out


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


def interchange_reduce(k: Kernel, units: int = 1, column_blocks: bool = True, tile: int | None = None,
                       column_block: int | None = None) -> Kernel:
    """Put the innermost output loop inside a reduce that depends on it, when the reduce's loads walk that
    output axis contiguously but its own axis with a stride (matmul, column sums): the reduce keeps one
    accumulator per output element of a tile (``Kernel.vector_acc``) and the tile loop vectorizes. A column
    sum (every load walks the output axis) takes column blocks as wide as ``units`` compute units allow
    (``_column_block``), which ``block_vector_reduce`` then cuts into register tiles. ``tile`` / ``column_block``
    override the heuristic widths when they divide the axis. Several reduces over the axis (side by side: sibling
    column sums; or nested: a column variance's mean inside its sum of squares) are interchanged together when
    each gains, each with its own accumulators per tile: left walking their columns a row apart, a 4096x1024
    variance along axis 0 took 25 ms (0.5 ms)."""
    if not k.loops or k.split_reduce or k.scan_ranges():
        return k
    j = k.loops[-1]
    reds = [e for e in k.reduces() if j in e.ranges]
    if not reds or not all(_interchange_gains(red, j) for red in reds):
        return k
    size = j.arg[1]
    cols = [column_blocks and _column_block(k, red, j, units) for red in reds]
    col = min(cols) if all(cols) else None
    if col and column_block and size % column_block == 0:
        col = column_block
    if tile is None or size % tile:
        tile = _interchange_tile(size)
    tile = col or tile
    if tile is None:
        return k
    next_id = max(r.arg[0] for r in _every_range(k)) + 1
    jb, jj = ir.range_(next_id, size // tile), ir.range_(next_id + 1, tile)
    k2 = _substitute_kernel(_share_sibling_ranges(k, reds), {j: jb * tile + jj}, k.loops[:-1] + (jb, jj))
    return replace(drop_unit_loops(k2), vector=True, vector_acc=jj)


def _share_sibling_ranges(k: Kernel, reds: list[Expr]) -> Kernel:
    """``k`` with each of ``reds`` that runs over ranges of the same sizes as an earlier one rewritten over that one's
    ranges (a renaming: the same terms in the same order), so the linearizer runs them in one loop nest (the data
    read once: a layer norm's weight and bias gradients, 4096x1024, 1.15-1.20 -> 0.74-0.78 ms). Only reduces side by
    side: when one is inside another's loops, each keeps its own."""
    if len(reds) < 2 or any(o in ir.toposort([red.srcs[0]]) for red in reds for o in reds if o is not red):
        return k
    first: dict[tuple[int, ...], Expr] = {}
    mapping: dict[Expr, Expr] = {}
    for red in reds:
        sizes = tuple(r.arg[1] for r in red.arg[1])
        lead = first.setdefault(sizes, red)
        if lead is not red:
            rename = dict(zip(red.arg[1], lead.arg[1]))
            mapping[red] = ir.reduce(red.arg[0], ir.substitute(red.srcs[0], rename), lead.arg[1], red.dtype)
    return _substitute_kernel(k, mapping, k.loops) if mapping else k


def _interchange_gains(red: Expr, j: Expr) -> bool:
    """Whether a load of ``red`` walks output axis ``j`` with a step of 1 (for a sum also 2: a stride-2 depthwise
    convolution, whose strided vector loads beat a 9-tap sum per output, 3.9 -> 2.5 ms; a stride-2 max pooling,
    which tracks NaNs, went from 1.8 to 4.8 ms) and a reduce range of ``red`` with a larger one."""
    coef = ir.affine_coefficient
    steps = (1, 2) if red.arg[0] is Ops.ADD else (1,)
    return any(coef(x.srcs[0], j) in steps and any(abs(coef(x.srcs[0], r) or 0) > 1 for r in red.arg[1])
               for x in ir.toposort([red.srcs[0]]) if x.op is Ops.LOAD)


INTERCHANGE_TILES = (64, 32, 16, 8)  # accumulator tile widths the autotuner tries for an interchanged reduce
INTERCHANGE_TILE_MAX = 64  # accumulators of one tile by default (4 AVX-512 registers of float32)


def _interchange_tile(size: int) -> int | None:
    """The default accumulator tile of an interchanged reduce over an output axis of ``size``: the widest divisor
    of at most ``INTERCHANGE_TILE_MAX`` (at least 8), the whole axis when it is that short. Fewer, wider tiles
    than powers of two: a depthwise 3x3 convolution's rows of 56 in tiles of 8 re-ran the taps' loop 7 times
    per row (12.1 ms for 32x128x56^2; one tile of 56: 3.0 ms), 5x5 rows of 112 in tiles of 16 took 19 ms."""
    if size <= INTERCHANGE_TILE_MAX:
        return size
    return next((t for t in range(INTERCHANGE_TILE_MAX, 7, -1) if size % t == 0), None)


VECTOR_TILE = 64  # accumulators of one register tile (4 AVX-512 / 8 AVX registers of float32)
ROW_BLOCK = 8  # reduce iterations accumulated in a register tile before it is added into the block's sums


def block_vector_reduce(k: Kernel, row_block: int | None = None, vector_tile: int | None = None) -> Kernel:
    """Register-tile a vectorized column sum (``Kernel.vector_acc``): the reduce loop runs in blocks of
    ``ROW_BLOCK`` iterations; in a block, each ``VECTOR_TILE`` columns accumulate into a tile of partial sums
    (kept in registers), which is then added into the column's accumulator (``Kernel.vector_block`` =
    (row block, tile), rendered by ``CRenderer``). Sums reassociate (blocks of ``ROW_BLOCK`` rows); with wide
    accumulators the partials are float32 and the block sums float64, as in long row sums. Only single-range
    ``ADD`` reduces whose tile divides into ``VECTOR_TILE`` columns are blocked, and only when the tile is wider
    than a register tile or accumulates in float64 (a matmul's float32 tile already is a register tile)."""
    rb, vt = row_block or ROW_BLOCK, vector_tile or VECTOR_TILE
    vec = k.vector_acc
    if vec is None or vec.arg[1] % vt or (vec.arg[1] == vt and not k.wide_acc):
        return k
    reds = [e for e in k.reduces() if vec in e.ranges]
    if len(reds) != 1 or reds[0].arg[0] is not Ops.ADD or len(reds[0].arg[1]) != 1 or \
            reds[0].arg[1][0].arg[1] < 2 * rb:
        return k
    return replace(k, vector_block=(rb, vt))


def work(k: Kernel) -> int:
    """Iterations of the innermost statements times the stores each makes: output size times the largest reduce,
    times the stores (a loop unrolled into ``c`` copies of its stores keeps the work it had: an unrolled 3-D
    col2im of 131,072 outputs in 8 copies had counted 16,384 and run on one thread)."""
    red = max((math.prod(r.arg[1] for r in e.arg[1]) for e in k.reduces()), default=1)
    return k.size * red * max(len(k.stores), 1)


def parallelize(k: Kernel, info: DeviceInfo, collapse: int | None = None,
                min_work: int = PARALLEL_MIN_WORK) -> Kernel:
    """Run the outer loop in parallel (``parallel`` = 1), or the outer two collapsed (2) when the outer loop is
    short, for at least ``min_work`` (``work``); ``collapse`` = 1 or 2 overrides that choice where collapsing is
    legal. A lone root reduce of enough work splits across the units instead."""
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
    if w < min_work or k.loops[0] in scans:
        return k
    n = 1
    outer = k.loops[0].arg[1]
    # collapse a short outer loop with the next one so every compute unit gets work
    vec = k.vector_acc  # its reduce runs in the loop above the tile loop: no collapse across it
    legal = len(k.loops) > 1 and not _reduce_depends_between(k) and k.loops[1] not in scans and \
        not (vec is not None and vec is k.loops[1])
    if legal and (collapse == 2 or (collapse is None and outer < 4 * info.compute_units)):
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


# independent float32 partial sums of a long row sum: 0 takes eight vector registers of the target's adds (128
# lanes with AVX-512, 64 with AVX2). On the 2-core Zen 4 (AVX-512), kernels timed in turns with torch: 128 lanes
# were 1-7% faster than 64 (4 registers) on 4096^2 f32 row sums in 9 of 10 runs (0.2% slower in the tenth), 0.7-6.6%
# faster on 8192x2048, 16384x1024 and 1024x16384
REDUCE_LANES = 0
REDUCE_LANE_REGISTERS = 8


def target_lanes(info: DeviceInfo) -> int:
    """The default ``reduce_lanes`` on ``info``: ``REDUCE_LANES``, or ``REDUCE_LANE_REGISTERS`` vector registers of
    float32 lanes (registers taken as at least 16 bytes wide)."""
    return REDUCE_LANES or REDUCE_LANE_REGISTERS * max(info.vector_bytes, 16) // 4


def unroll_reduce(k: Kernel, info: DeviceInfo, lanes: int | None = None) -> Kernel:
    """A long float32 sum accumulated in float64 (``wide_acc``; float32 partials over blocks of the reduce) keeps
    ``lanes`` (default ``target_lanes``) partial sums per block instead of one (``Kernel.reduce_lanes``, rendered
    by ``CRenderer`` where the lanes tile every block; elsewhere one partial), so consecutive adds do not wait on
    each other: a row sum then runs at memory speed. Sums reassociate within a block, as they already do across
    SIMD lanes."""
    lanes = target_lanes(info) if lanes is None else lanes
    if not k.wide_acc or lanes <= 1 or k.split_reduce or k.reduce_lanes:
        return k
    return replace(k, reduce_lanes=lanes)


# outputs of a row sum computed together by default: one. On the 2-core Zen 4 this was tuned on (kernels timed in
# turns with torch, each on its own copy), 4 rows of 16 lanes were 4-28% slower than one row of 64 lanes on 4096^2,
# 4000^2, 4112^2 and 1024x16384 float32, and within 2% on 16384x1024; X.sum(1).realize() on 4096^2 took 3.0-3.6 ms
# with 4 rows, 2.4-2.5 ms with one. The pass stays a candidate of the autotuner's search
UPCAST_ROWS = 1
UPCAST_MIN_LANES = 8


def upcast_rows(k: Kernel, rows: int | None = None) -> Kernel:
    """A row sum with ``reduce_lanes`` (each output a long contiguous float32 sum) computes ``rows`` consecutive
    outputs per iteration of its innermost output loop ``r``: ``r = rows * r' + u`` for each constant ``u``, so
    every reduce depending on ``r`` becomes ``rows`` copies over the same ranges, which ``linearize`` runs in one
    loop nest (``Reduce.siblings``), ``reduce_lanes / rows`` lanes each: the same number of independent partial
    sums, now over ``rows`` memory streams. Off by default (``UPCAST_ROWS``); a candidate of the search. Fewer lanes
    per output reassociate its sum, as the lanes themselves do."""
    rows = UPCAST_ROWS if rows is None else rows
    lanes = k.reduce_lanes
    if rows <= 1 or lanes // rows < UPCAST_MIN_LANES or not k.loops or k.split_reduce or k.then or \
            k.vector_acc is not None or k.gemm is not None:
        return k
    r = k.loops[-1]
    n = r.arg[1]
    if n % rows or n // rows < 2 or r in k.scan_ranges():
        return k
    reds = [e for e in k.reduces() if r in e.ranges]
    if not reds or any(x.op in (Ops.STASH, Ops.LOCAL) for x in ir.toposort(_all_roots(k))):
        return k
    for e in reds:  # long contiguous float sums only: what the lanes render for
        (rr, *more) = e.arg[1]
        if more or e.arg[0] is not Ops.ADD or not e.dtype.is_float or e.dtype is dtypes.float64 or \
                rr.arg[1] % (lanes // rows):
            return k
        if not any(x.op is Ops.LOAD and ir.affine_coefficient(x.srcs[0], rr) == 1
                   for x in ir.toposort([e.srcs[0]])):
            return k
    outer, stores = _unrolled(k, r, rows)
    loops = k.loops[:-1] + ((outer,) if outer.op is Ops.RANGE else ())
    return replace(k, loops=loops, stores=stores, reduce_lanes=lanes // rows, upcast_rows=rows)


UPCAST_TAPS_MAX = 9  # outputs ``upcast_taps`` computes in one reduce nest (a 3x3 filter's taps)
UPCAST_TAPS_MIN_REDUCE = 1 << 12  # iterations of each reduce, at least (shorter passes cost little to repeat)


def upcast_taps(k: Kernel) -> Kernel:
    """Unroll the innermost output loops whole when they have at most ``UPCAST_TAPS_MAX`` iterations in all and
    every reduce depends on them and sums over long ranges (a depthwise convolution's weight gradient: per
    channel and filter tap, a sum over the batch and the positions): the copies' reduces run as siblings in one
    loop nest (``Kernel.upcast_rows``), so one pass over the ranges computes every tap and loads what no tap
    depends on (the output gradient) once, instead of one pass per tap. Each output sums the same terms in the
    same order."""
    if k.then or k.gemm is not None or k.vector_acc is not None or k.split_reduce or k.upcast_rows > 1 or \
            k.scan_ranges() or any(e.op in (Ops.STASH, Ops.LOCAL) for e in ir.toposort(_all_roots(k))):
        return k
    tail: list[Expr] = []
    n = 1
    for r in reversed(k.loops[1:]):  # the outer loop stays (threads split it)
        if n * r.arg[1] > UPCAST_TAPS_MAX:
            break
        tail.append(r)
        n *= r.arg[1]
    reds = k.reduces()
    nested = {id(x) for e in reds for x in ir.toposort([e.srcs[0]]) if x.op is Ops.REDUCE}
    top = [e for e in reds if id(e) not in nested]  # the others run inside these (a sum over the batch of sums)

    def iterations(e: Expr) -> int:
        ranges = {r for x in ir.toposort([e]) if x.op is Ops.REDUCE for r in x.arg[1]}
        return math.prod(r.arg[1] for r in ranges)

    if n < 2 or not top or len({e.arg[1] for e in top}) > 1 or \
            any(iterations(e) < UPCAST_TAPS_MIN_REDUCE or not all(r in e.ranges for r in tail) for e in top):
        return k
    for r in tail:
        _, stores = _unrolled(k, r, r.arg[1])  # unrolled whole: no loop is left
        k = replace(k, loops=tuple(x for x in k.loops if x is not r), stores=stores)
    return replace(k, upcast_rows=n)


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
        elif x.op in TRANSCENDENTAL:
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


class _ConsumerBody:
    """A loop over ``range`` whose body is ``roots``: whether it computes a row value of reduce range ``rr``. The
    body's node ids are listed on the first question, in ``bodies`` (shared by the scans of one kernel: a body that
    no stash changed is the same roots; the entry keeps the roots alive, so that the ids stay theirs); ``memo`` is
    the ``rr`` -> ``range`` substitution memo, which does not depend on the kernel."""

    __slots__ = ("range", "roots", "mapping", "memo", "bodies", "ids")

    def __init__(self, r: Expr, roots: list[Expr], rr: Expr, memo: dict, bodies: dict) -> None:
        self.range, self.roots, self.mapping, self.memo, self.bodies = r, roots, {rr: r}, memo, bodies
        self.ids: set[int] | None = None

    def reads(self, s: Expr) -> Expr | None:
        """``s`` with ``rr`` replaced by this loop's range, if the body computes it; else None."""
        if self.ids is None:
            key = tuple(map(id, self.roots))
            entry = self.bodies.get(key)
            if entry is None:
                entry = self.bodies[key] = (self.roots, set(map(id, ir.toposort(self.roots))))
            self.ids = entry[1]
        s2 = ir.substitute(s, self.mapping, self.memo)
        return s2 if id(s2) in self.ids else None


def stash_row_values(k: Kernel) -> Kernel:
    """Compute a row value once: when a single-range reduce (a softmax's max or sum, a LayerNorm's mean) computes
    an expression of its range that a later loop over a range of the same size recomputes (the output loop, or
    the next reduce), the reduce also writes it to a local array (``STASH``) and the later loop reads it there
    (``LOCAL``) instead. Exact: the same operations on the same values, so the same bits. Only expressions
    costing ``STASH_MIN_COST`` or more are stashed, arrays of at most ``STASH_MAX_BYTES``; host kernels without
    split reduces, column tiles or scans."""
    if k.split_reduce or k.vector_acc is not None or k.scan_ranges():
        return k
    slot, total = 0, 0
    bodies: dict = {}  # ``_ConsumerBody.bodies``
    memos: dict[tuple[Expr, Expr], dict] = {}  # per (reduce range, consumer range)
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
            # per consumer, its body's nodes (listed once per kernel, not once per candidate: a fused sorting
            # network's reduce has thousands of candidates, and that made this pass quadratic) and a memo for
            # substituting its range, which every candidate shares
            seen = [_ConsumerBody(c, roots, rr, memos.setdefault((rr, c), {}), bodies) for c, roots in consumers]
            found = None
            for s in reversed(ir.toposort([red.srcs[0]])):  # largest first
                if rr not in s.ranges or s.op in (Ops.RANGE, Ops.STASH, Ops.REDUCE) or s.dtype is ir.index_dtype \
                        or _cost(s, rr) < STASH_MIN_COST:
                    continue
                nbytes = rr.arg[1] * max(s.dtype.itemsize, 4)
                if nbytes > STASH_MAX_BYTES or total + nbytes > STASH_TOTAL_BYTES:
                    continue
                hits = []
                for body in seen:
                    s2 = body.reads(s)
                    if s2 is not None:
                        hits.append((body.range, s2))
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


SCATTER_MIN_TARGETS = 8  # the one-hot sum's extent from which adding at the hit row beats comparing every row


def one_hot_sum(red: Expr, loops: tuple[Expr, ...]) -> tuple[Expr, Expr, Expr] | None:
    """``(target, index, x)`` when ``red`` is ``sum over its ranges of (index == target ? x : 0)`` in a kernel with
    output ``loops``: ``target`` one of them, of at least ``SCATTER_MIN_TARGETS`` iterations, that ``x`` does not
    read; ``index`` an integer depending on the sum's ranges alone; float32 or float64; nothing nested."""
    if red.op is not Ops.REDUCE or red.arg[0] is not Ops.ADD or red.dtype not in (dtypes.float32, dtypes.float64):
        return None
    sel, ranges = red.srcs[0], red.arg[1]
    if sel.op is not Ops.WHERE or sel.srcs[2].op is not Ops.CONST or sel.srcs[2].arg != 0 or \
            sel.srcs[0].op is not Ops.CMPEQ:
        return None
    a, b = sel.srcs[0].srcs
    target, index = (a, b) if a in loops else (b, a) if b in loops else (None, None)
    x = sel.srcs[1]
    if target is None or target.arg[1] < SCATTER_MIN_TARGETS or not index.dtype.is_int or not index.ranges or \
            not index.ranges <= set(ranges) or target in x.ranges:
        return None
    if any(e.op in (Ops.REDUCE, Ops.SCAN, Ops.STASH, Ops.LOCAL) for e in ir.toposort([index, x])):
        return None
    return target, index, x


def one_hot_store(k: Kernel) -> tuple[Store, tuple[Expr, Expr, Expr]] | None:
    """The one store of a kernel without segments whose value is a one-hot sum (``one_hot_sum``) in the output's
    dtype, the sum's target among the store's index ranges; with the sum's ``(target, index, x)``."""
    if k.then or len(k.stores) != 1:
        return None
    (st,) = k.stores
    found = one_hot_sum(st.value, k.loops)
    if found is None or st.value.dtype is not k.params[st.param].dtype or found[0] not in st.index.ranges:
        return None
    return st, found


def scatter_one_hot(k: Kernel) -> tuple[Kernel, Kernel] | None:
    """A kernel storing a sum of a one-hot selection (``one_hot_sum``: ``out[v, o] = sum_n (index(n) == v ?
    x(n, o) : 0)``, a gather's or an embedding's gradient, ``autograd._add_at_index``) as two segments: one zeroes
    the output, the other adds each ``x(n, o)`` at row ``index(n)`` (``ir.Scatter``): ``n * o`` work instead of
    ``v * n * o`` (an embedding of 30000 rows, 8192 lookups of 256: 1277 ms, torch 3.4-8.8). The sum runs in order
    on one thread, so every output element adds the same terms in the same order as before, in the output's dtype
    instead of a double accumulator. (Fusion stores such sums, ``fuse._one_hot_sums``, so they reach here.)"""
    found = None if k.gemm is not None or k.split_reduce else one_hot_store(k)
    if found is None:
        return None
    st, (target, index, x) = found
    zero = replace(k, stores=(Store(st.param, st.index, ir.const(0.0, st.value.dtype)),))
    loops = tuple(r for r in k.loops if r is not target)
    add = replace(k, loops=loops, stores=(Store(st.param, st.index, x),), parallel=0, vector=False,
                  scatter=Scatter(target, index, tuple(st.value.arg[1])))
    return zero, add


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
    return _split_loop(k, best, (0, *sorted(best_cuts), best.arg[1]))


def _split_loop(k: Kernel, r: Expr, bounds: Sequence[int]) -> list[Kernel]:
    """``k`` once per piece ``[lo, hi)`` of loop ``r`` between consecutive ``bounds`` (0 first, its extent last):
    each with a new range of ``hi - lo`` iterations in ``r``'s place, ``r`` replaced by that range plus ``lo``."""
    next_id = max(x.arg[0] for x in _every_range(k)) + 1
    parts = []
    for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        rj = ir.range_(next_id + j, hi - lo)
        parts.append(_substitute_kernel(k, {r: rj + lo}, tuple(rj if x is r else x for x in k.loops)))
    return parts


# ---- register-tiled contractions (host) ----------------------------------------------------------------------

GEMM_MIN_WORK = 1 << 18  # multiply-adds below which a contraction keeps the interchanged path
GEMM_PANEL_BYTES = 1 << 19  # a packed panel of the right operand (kc x nc): half the 1 MiB L2 of a core
GEMM_KC = 512  # k block of a panel when k is longer than GEMM_KC_MAX (a direct store accumulates the blocks)
GEMM_KC_MAX = 1024
GEMM_PARTIAL = 256  # wide accumulators: float32 partial sums over this many k, added into float64 ones
# k per chunk of a pack along k (``GemmTile.k_chunk``): a chunk of a 64-wide micro-panel is 16 KiB. A weight
# gradient's pack had stored each column along all k, a stride of nr apart, sweeping the whole panel out of the L1
# cache once per column: 3x3 32x32x32^2 input, 64 filters, 5.6 -> 4.35 ms (chunks of 32 or 128 alike)
GEMM_PACK_K_CHUNK = 64
GEMM_SHORT_K = 64  # contractions at most this long take the narrow tile (``_gemm_narrow``)
GEMM_NARROW_ROWS = 8
GEMM_NARROW_K_INNER_ROWS = 64  # weight gradients with at most this many rows take it too
GEMM_MR = (4, 6, 8, 12)  # candidate register-tile rows
GEMM_NR = (1, 2, 3, 4)  # candidate register-tile widths, in vectors
GEMM_NC = (64, 128, 256, 512)
GEMM_KCS = (128, 256, 512, 1024)


@dataclass(frozen=True)
class GemmTile:
    """The host plan of a contraction ``c`` whose output loop ``c.m`` is followed by the loops ``cols`` only the
    right operand depends on (``c.n`` the innermost; the loops before ``c.m`` are batch loops). The columns are
    ``cols`` flattened, ``n`` of them: a convolution's output positions (oh, ow), whose right operand is the
    padded input read through its windows (implicit im2col), tile as one GEMM.

    Per batch index and column panel of ``nc`` columns (``nc`` a multiple of ``nr``), per k block of ``kc``: the
    threads pack ``c.b`` into a shared buffer of ``nr``-wide micro-panels (columns past the end are 0), then
    split the ``mr`` x ``nr`` tiles of the panel (two barriers per panel and k block). With ``per_batch`` each
    thread takes whole batch indices instead and packs into a buffer of its own: no barrier inside (for many
    batch indices, where barriers add up; when the OpenMP runtime sleeps in them they cost more than the
    arithmetic). With ``rows`` (a right operand every batch index shares) the batch loops and ``c.m`` are the
    rows of one GEMM: one pack per panel, row tiles across batch boundaries. A tile accumulates ``c.a``
    (evaluated in place, rows past the end clamped to the last row and discarded) times the micro-panel in a
    local array that the C compiler keeps in vector registers. ``kc`` < k
    only when ``direct`` (the one store writes the reduce itself, in its dtype, not widened): the blocks then add
    into the output. ``partial`` > 0 (wide float32 accumulators): the tile sums ``partial`` k in float32, then
    adds them into a float64 tile. Sums reassociate; products are the same."""

    c: Contraction
    mr: int
    nr: int
    nc: int
    kc: int
    partial: int
    direct: bool
    cols: tuple[Expr, ...]  # the column loops, outer to inner (``c.n`` last)
    per_batch: bool = False  # threads split the batch indices (each its own panel), not each batch's tiles
    pack_k_inner: bool = False  # the pack runs k innermost, not along the columns (``_gemm_pack_k_inner``)
    window: GateWindow | None = None  # the pack's column runs split at the gates of ``c.b`` (``gate_window``)
    k_chunk: int = 0  # with ``pack_k_inner``: the pack stores every column per chunk of this many k (0: all k)
    rows: tuple[Expr, ...] = ()  # the batch loops folded into the rows with ``c.m`` (``gemm_rows``); () : ``c.m``

    @property
    def n(self) -> int:
        """The number of columns (the product of the column loops' sizes)."""
        return math.prod(r.arg[1] for r in self.cols)

    @property
    def m(self) -> int:
        """The number of rows (``c.m``'s size, times the batch loops' folded with it)."""
        return math.prod(r.arg[1] for r in self.rows) if self.rows else self.c.m.arg[1]


def _gemm_dtype_ok(d) -> bool:
    return d in (dtypes.float32, dtypes.float64) or (d.is_int and d.itemsize >= 4)


def gemm_columns(k: Kernel, c: Contraction) -> tuple[Expr, ...] | None:
    """The output loops after ``c.m``, when ``c.n`` is the innermost loop and the left operand depends on none of
    them: the GEMM's columns, flattened (``GemmTile.cols``). None otherwise."""
    cols = k.loops[k.loops.index(c.m) + 1:]
    if not cols or cols[-1] is not c.n or any(r in c.a.ranges for r in cols):
        return None
    return cols


def gemm_rows(k: Kernel, c: Contraction) -> tuple[Expr, ...]:
    """The batch loops and ``c.m``, outer to inner, when ``c.b`` depends on no batch loop (one right operand
    shared by every batch index: a Linear layer over a permuted input): the GEMM's rows, flattened
    (``GemmTile.rows``), so that the right operand is packed once, not once per batch index, and the tiles run
    over every batch's rows. () when there are no batch loops, or ``c.b`` depends on one."""
    batch = k.loops[:k.loops.index(c.m)]
    if not batch or "fold_batch" in DISABLED or any(r in c.b.ranges for r in batch):
        return ()
    return (*batch, c.m)


def gemm_contraction(k: Kernel) -> Contraction | None:
    """The contraction ``tile_gemm`` can tile: its output loop ``m`` is followed by column loops only
    (``gemm_columns``), its dtype is float32, float64 or a 32/64-bit integer, and it is large enough to pay for
    packing."""
    if k.then or len(k.loops) < 2 or k.parallel or k.vector_acc is not None or k.gemm is not None:
        return None
    c = find_contraction(k)
    if c is None or not _gemm_dtype_ok(c.red.dtype):
        return None
    cols = gemm_columns(k, c)
    if cols is None:
        return None
    m, n, kk = c.m.arg[1], math.prod(r.arg[1] for r in cols), c.k.arg[1]
    if m < 2 or n < 8 or kk < 4 or math.prod(r.arg[1] for r in k.loops) * kk < GEMM_MIN_WORK:
        return None
    return c


def _gemm_direct(k: Kernel, c: Contraction) -> bool:
    """One store, whose value is the reduce itself into a param of the reduce's dtype."""
    return len(k.stores) == 1 and k.stores[0].value is c.red and k.params[k.stores[0].param].dtype is c.red.dtype


def _gemm_lanes(c: Contraction, info: DeviceInfo) -> int:
    return max(1, info.vector_bytes // c.red.dtype.itemsize)


def _gemm_shape(n_vectors: int, registers: int) -> tuple[int, int]:
    """The register tile (rows, vectors per row) with the most accumulators that, with one vector of the right
    operand per column and one broadcast, fits in ``registers`` (AVX-512: 6 x 4 of 32; AVX2: 6 x 2 of 16)."""
    best = (0, 0, 0)
    for vecs in (4, 2, 1):
        if vecs > n_vectors and vecs > 1:
            continue
        mr = max(1, min(12, (registers - vecs - 1) // vecs))
        best = max(best, (mr * vecs, vecs, mr))
    return best[2], best[1]


def _gemm_rows(m: int, mr: int, vecs: int) -> int:
    """``mr``, or when its last row tile would compute over ``m / 16`` rows past ``m`` (m = 64 in tiles of 12: 8
    rows, an eighth of the work), the largest smaller height with the fewest such rows that keeps at least 8
    accumulators (enough to hide the FMA latency)."""
    if -(-m // mr) * mr - m <= m // 16:
        return mr
    heights = [h for h in range(mr, 0, -1) if h * vecs >= 8] or [mr]
    return min(heights, key=lambda h: (-(-m // h) * h, -h))


def _gemm_defaults(k: Kernel, c: Contraction, info: DeviceInfo) -> dict[str, int]:
    """The heuristic tile: as many accumulator vectors as the target's registers hold (``_gemm_shape``), or the
    narrow one (``_gemm_narrow``); panels of ``GEMM_PANEL_BYTES``. Over several column loops, micro-panels that
    divide the innermost where one does (each then lies in one row of it: one affine segment to pack and store)."""
    lanes = _gemm_lanes(c, info)
    cols = gemm_columns(k, c)
    n, kk = math.prod(r.arg[1] for r in cols), c.k.arg[1]
    vectors = n // lanes
    if len(cols) > 1:
        vectors = next((v for v in (4, 2, 1) if v <= max(vectors, 1) and c.n.arg[1] % (v * lanes) == 0), vectors)
    mr, vecs = _gemm_shape(vectors, info.vector_registers)
    if _gemm_narrow(c, n, vecs, lanes, info):
        mr, vecs = GEMM_NARROW_ROWS, 1
    batch = _gemm_batch_mode(k, c, info)
    mr = _gemm_rows(math.prod(r.arg[1] for r in gemm_rows(k, c)) if batch == 2 else c.m.arg[1], mr, vecs)
    kc = kk if kk <= GEMM_KC_MAX else GEMM_KC
    depth = kc if _gemm_direct(k, c) and not _gemm_wide(k, c) else kk
    nr = vecs * lanes
    nc = max(nr, GEMM_PANEL_BYTES // (depth * c.red.dtype.itemsize) // nr * nr)
    nc = min(nc, -(-n // nr) * nr)
    return {"gemm_mr": mr, "gemm_nr": nr, "gemm_nc": nc, "gemm_kc": kc, "gemm_batch": batch,
            "gemm_pack_k": int(_gemm_pack_k_inner(c))}


def _gemm_narrow(c: Contraction, n: int, vecs: int, lanes: int, info: DeviceInfo) -> bool:
    """Whether the tile should be ``GEMM_NARROW_ROWS`` rows of one vector instead of ``vecs`` vectors, on a target
    with 32 vector registers: for a weight gradient (``_gemm_columns_gathered``) of at most
    ``GEMM_NARROW_K_INNER_ROWS`` rows; for any other contraction that is short (k <= ``GEMM_SHORT_K``) or whose
    ``n`` columns, rounded up to whole micro-panels of ``vecs`` vectors, would compute over more than ``n / 8``
    columns past the end (196 = 14^2 output positions in panels of 64: 60 more).

    Measured on the 2-core Zen 4 (AVX-512) with ``scripts/gemm_tiles.py`` (candidates in turns on scratch buffers,
    9-11 rounds; two runs where two figures), time against the 6 x 4-vector tile: k <= 64 0.82-0.94 (a 3x3
    convolution's input-gradient columns 0.84/0.90, a 7x7 stem's 0.82/0.89, 2048 x 64 x 2048 0.85/0.92, 1024 x 32 x
    1024 0.88, a Linear weight gradient 784 x 64 x 256 0.94; a 1x1 convolution's forward 1.00/1.01); 3x3 weight
    gradients of 64 filters 0.91-0.93, the stem's of 32 0.84/0.85, of 128-512 filters 0.96-1.07 (512 at 7^2, k = 49:
    1.07, so weight gradients of many rows keep their tile whatever k); columns 14^2 or 7^2 (31% past the end) in
    3x3 forwards and an input gradient 0.84-0.89, 28^2 (6%) 1.01-1.04. Elsewhere (forward convolutions at 32^2 and
    more, long-k matmuls) it ran 1.00-1.31."""
    if info.vector_registers < 32:
        return False
    if _gemm_columns_gathered(c):
        return c.m.arg[1] <= GEMM_NARROW_K_INNER_ROWS
    nr = vecs * lanes
    return c.k.arg[1] <= GEMM_SHORT_K or -(-n // nr) * nr - n > n // 8


def _gemm_batches(k: Kernel, c: Contraction) -> int:
    """The number of batch indices (the product of the loops before ``c.m``)."""
    return math.prod(r.arg[1] for r in k.loops[:k.loops.index(c.m)])


def _gemm_per_batch(k: Kernel, c: Contraction, info: DeviceInfo) -> int:
    """1 when threads should split the batch indices (``GemmTile.per_batch``): they divide evenly among the
    threads, or are many (at least 8 per thread: the last round's imbalance is at most an eighth)."""
    b, t = _gemm_batches(k, c), max(1, info.compute_units)
    return int(t > 1 and b >= t and (b % t == 0 or b >= 8 * t))


def _gemm_batch_mode(k: Kernel, c: Contraction, info: DeviceInfo) -> int:
    """How the threads run the batch indices (``gemm_batch``): 0 they share each batch index's tiles, 1 each takes
    whole batch indices (``_gemm_per_batch``, ``GemmTile.per_batch``), 2 the batch loops fold into the rows
    (``gemm_rows``). 2 wherever the right operand is shared by the batch indices, except short contractions
    (k <= ``GEMM_SHORT_K``) that suit 1: their packs per batch index cost little, and threads of their own
    skip the shared tiles' barriers.

    Measured on the 2-core Zen 4 (kernels alone, fold against per batch index, in turns, 21-31 rounds, two runs
    where two figures), batches x rows x k x columns: 32 x 56 x 384 x 384 (MiniLM's attention output, ``x @ W.T``)
    0.59/0.66, the same with ``W`` 0.77/0.78; 64 x 16 x 128 x 256 0.61-0.68 (``W.T`` 0.41-0.46); 24 x 100 x 384 x
    384 0.94; 8 x 512 x 256 x 256 0.94-0.99; 4 x 256 x 512 x 512 0.98; k = 64: 24 x 100 x 64 x 96 0.97-1.01, 16 x
    200 x 64 x 64 1.08-1.10, 8 x 3 x 100 x 64 x 384 1.03-1.05."""
    per = _gemm_per_batch(k, c, info)
    if gemm_rows(k, c) and not (per and c.k.arg[1] <= GEMM_SHORT_K):
        return 2
    return per


def _gemm_wide(k: Kernel, c: Contraction) -> bool:
    return k.wide_acc and c.red.dtype is dtypes.float32


def _gemm_columns_gathered(c: Contraction) -> bool:
    """Whether some load of ``c.b`` has an index that is not affine in the innermost column loop (a convolution's
    weight gradient: the window's taps as columns)."""
    return any(ir.affine_coefficient(e.srcs[0], c.n) is None for e in ir.toposort([c.b]) if e.op is Ops.LOAD)


def _gemm_pack_k_inner(c: Contraction) -> bool:
    """Whether the pack of ``c.b`` should run k innermost: when some load's index is not affine in the innermost
    column loop (``_gemm_columns_gathered``), the columns vectorize no better than k does (and with several column
    loops their runs are short). A convolution's weight gradient reads the padded input with a window's taps as
    columns (a 3x3 window: runs of at most 9, indexed by tap / 3 and tap % 3) and the output positions as k.
    Measured on 2 cores, k innermost: 3x3, 32x32x32^2 input, 64 filters 11.2 -> 6.6 ms (3.3 without packing); 7x7
    stride 2 stem 2.05 -> 1.4 ms. Also when every load that depends on the columns is contiguous along k and not
    along the columns (``x @ W.T``)."""
    if _gemm_columns_gathered(c):
        return True
    loads = [e for e in ir.toposort([c.b]) if e.op is Ops.LOAD and ir.affine_coefficient(e.srcs[0], c.n)]
    return bool(loads) and all(abs(ir.affine_coefficient(e.srcs[0], c.n)) != 1 and
                               ir.affine_coefficient(e.srcs[0], c.k) == 1 for e in loads)


@dataclass(frozen=True)
class GateWindow:
    """Where along a loop ``r`` every guard of a value (a gated load, or a select on the index) holds
    (``gate_window``). ``bounds`` are the guards' comparisons as ``(lhs, rhs, strict, coef)``: ``lhs < rhs`` (``<=``
    unless strict), ``coef`` the coefficient of ``r`` in ``lhs - rhs``, so that each holds on one interval of ``r``.
    ``inside`` is the value with every guard true (loads unconditional, selects their first branch): equal to the
    value wherever every bound holds. ``outside`` is the value with every guard false, equal to it wherever some
    bound fails, when the guards share one condition (else the value itself)."""

    bounds: tuple[tuple[Expr, Expr, bool, int], ...]
    inside: Expr
    outside: Expr


def _conjuncts(cond: Expr) -> list[Expr] | None:
    """The comparisons of integers whose AND is ``cond``; None when it is of another form."""
    if cond.op is Ops.AND and cond.dtype is dtypes.bool_:
        a, b = _conjuncts(cond.srcs[0]), _conjuncts(cond.srcs[1])
        return None if a is None or b is None else a + b
    if cond.op in (Ops.CMPLT, Ops.CMPLE) and all(x.dtype.is_int for x in cond.srcs):
        return [cond]
    return None


def gate_window(value: Expr, r: Expr) -> GateWindow | None:
    """The window of ``value``'s guards along loop ``r`` (``GateWindow``). A guard is a gated load whose gate is a
    conjunction of integer comparisons affine in ``r`` and whose index is affine in ``r``, or a select whose
    condition is such a conjunction. A padded input read through a window (a convolution's implicit im2col) is
    guarded so: inside the window its loads are contiguous along ``r`` with no select, and only the borders keep
    the padding. None when ``value`` has no guard, or a gated load of another form."""
    inside: dict[Expr, Expr] = {}
    outside: dict[Expr, Expr] = {}
    conds: set[int] = set()  # the guards' conditions (identity: they stay alive in ``value``)
    bounds: dict[tuple, None] = {}
    for e in ir.toposort([value]):
        gated = e.op is Ops.LOAD and len(e.srcs) > 1
        if not gated and e.op is not Ops.WHERE:
            continue
        cond = e.srcs[1] if gated else e.srcs[0]
        terms = _conjuncts(cond)
        coefs = [[ir.affine_coefficient(x, r) for x in t.srcs] for t in terms or ()]
        if terms is None or any(None in cs for cs in coefs):
            if gated:
                return None
            continue
        if gated and ir.affine_coefficient(e.srcs[0], r) is None:
            return None
        conds.add(id(cond))
        for t, (a, b) in zip(terms, coefs):
            bounds[(*t.srcs, t.op is Ops.CMPLT, a - b)] = None
        if gated:
            inside[e] = ir.load(e.arg, e.dtype, ir.substitute(e.srcs[0], inside))
            outside[e] = ir.const(0, e.dtype)
        else:
            inside[e] = ir.substitute(e.srcs[1], inside)
            outside[e] = ir.substitute(e.srcs[2], outside)
    if not inside:
        return None
    return GateWindow(tuple(bounds), ir.substitute(value, inside),
                      ir.substitute(value, outside) if len(conds) == 1 else value)


def gemm_search_space(k: Kernel, info: DeviceInfo) -> dict[str, tuple[int, ...]]:
    """``tile_gemm``'s parameters for ``k`` (heuristic's value first); empty when it does not apply."""
    k = merge_loops(drop_unit_loops(k))
    c = gemm_contraction(k)
    if c is None:
        return {}
    d = _gemm_defaults(widen_accumulators(k), c, info)
    lanes = _gemm_lanes(c, info)

    def first(v: int, cands) -> tuple[int, ...]:
        return (v, *(x for x in cands if x != v))

    space = {"gemm_mr": first(d["gemm_mr"], GEMM_MR), "gemm_nr": first(d["gemm_nr"], [v * lanes for v in GEMM_NR]),
             "gemm_nc": first(d["gemm_nc"], GEMM_NC), "gemm_kc": first(d["gemm_kc"], GEMM_KCS)}
    if gemm_rows(k, c):
        space["gemm_batch"] = first(d["gemm_batch"], (0, 1, 2))
    elif _gemm_batches(k, c) >= max(2, info.compute_units):
        space["gemm_batch"] = first(d["gemm_batch"], (0, 1))
    space["gemm_pack_k"] = first(d["gemm_pack_k"], (0, 1))  # either pack direction is correct for any operand
    return space


def tile_gemm(k: Kernel, info: DeviceInfo, params: Params | None = None) -> Kernel:
    """Mark a contraction (``gemm_contraction``) for register tiling (``Kernel.gemm``); ``params``
    ``gemm_mr`` / ``gemm_nr`` / ``gemm_nc`` / ``gemm_kc`` override the heuristic (any positive values compute the
    same result; ``nc`` is rounded to a multiple of ``nr``), ``gemm_batch`` (``_gemm_batch_mode``) and
    ``gemm_pack_k`` (0 or 1: ``GemmTile.pack_k_inner``).
    Other kernels are returned unchanged. Call it after ``widen_accumulators`` (the plan depends on ``wide_acc``)."""
    c = gemm_contraction(k)
    if c is None:
        return k
    chosen = {x: v for x, v in (params or {}).items()
              if x.startswith("gemm_") and (v or x in ("gemm_batch", "gemm_pack_k"))}
    p = {**_gemm_defaults(k, c, info), **chosen}
    mr, nr = max(1, int(p["gemm_mr"])), max(1, int(p["gemm_nr"]))
    kk, wide = c.k.arg[1], _gemm_wide(k, c)
    kc = max(1, min(int(p["gemm_kc"]), kk))
    direct = _gemm_direct(k, c) and not wide
    partial = min(kc if kc < kk else GEMM_PARTIAL, kk) if wide else 0
    if not direct:
        kc = kk
    cols = gemm_columns(k, c)
    n = math.prod(r.arg[1] for r in cols)
    nc = max(nr, int(p["gemm_nc"]) // nr * nr)
    nc = min(nc, -(-n // nr) * nr)
    rows = gemm_rows(k, c) if p["gemm_batch"] == 2 else ()
    per_batch = p["gemm_batch"] == 1 and _gemm_batches(k, c) > 1
    k_inner = bool(p["gemm_pack_k"])
    window = None if k_inner or "pack_window" in DISABLED else gate_window(c.b, c.n)
    chunk = GEMM_PACK_K_CHUNK if k_inner and kc > GEMM_PACK_K_CHUNK else 0
    return replace(k, parallel=0, vector=False, gemm=GemmTile(c, mr, nr, nc, kc, partial, direct, cols, per_batch,
                                                              k_inner, window, chunk, rows))


# the optional host passes, by the names DISABLED takes
PASS_NAMES = frozenset({"gemm", "column_block", "fold_batch", "pack_window", "block_vector_reduce", "stash_row_values",
                        "split_divmod_loops", "split_divmod_reduces", "ungate_loads", "upcast_taps",
                        "unroll_divmod_loops", "unroll_compared_loops", "unroll_reduce", "upcast_rows", "transpose",
                        "transpose_block", "prefetch", "prefetch_streams", "scatter"})
DISABLED: set[str] = set()  # names of optional host passes switched off (tests compare outputs with and without)


Params = Mapping[str, int]


def search_space(k: Kernel, info: DeviceInfo) -> dict[str, tuple[int, ...]]:
    """The host passes' tunable parameters and the values worth timing for ``k`` (a superset: a value a pass
    cannot use leaves the kernel as the heuristic makes it, and the search skips candidates rendering the same
    source). Empty for non-host targets (``kernel.gpu.search_space`` covers those)."""
    if info.kind != "host":
        return {}
    space = {"interchange_tile": INTERCHANGE_TILES, "column_block": COLUMN_BLOCKS,
             "row_block": (4, 8, 16), "vector_tile": (32, 64, 128), "collapse": (1, 2), "stash": (0, 1),
             "reduce_lanes": tuple(dict.fromkeys((target_lanes(info), 1, 16, 32, 64, 128))),
             "upcast_rows": (UPCAST_ROWS, 2, 4, 8),
             "prefetch_distance": tuple(dict.fromkeys((STREAM_PREFETCH_BYTES, 0, 512, 1024, 4096))),
             "prefetch_locality": tuple(dict.fromkeys((STREAM_PREFETCH_LOCALITY, 3)))}
    if "transpose" not in DISABLED and _transpose_axes(merge_loops(drop_unit_loops(k))) is not None:
        space["transpose_tile"] = (*TRANSPOSE_TILES, 128, 0)
    if "gemm" not in DISABLED:
        space.update(gemm_search_space(k, info))
    return space


def optimize(k: Kernel, info: DeviceInfo, params: Params | None = None) -> Kernel:
    """The host pipeline (GPU targets only normalize loops; ``kernel.gpu`` does the rest). Passes named in
    ``DISABLED`` (``"gemm"``, ``"column_block"``, ``"block_vector_reduce"``, ...) are skipped; ``params`` (names from
    ``search_space``) override the heuristics' choices."""
    p = params or {}
    k = drop_unit_loops(k)
    if info.kind != "host":
        return merge_loops(k)
    parts = []
    units = 1 if "column_block" in DISABLED else info.compute_units
    segments = split_segments(k)
    if "unroll_divmod_loops" not in DISABLED:
        segments = [s for part in segments for s in split_ragged_phases(part)]
    big = len(segments) > 1 and sum(map(work, segments)) >= PARALLEL_MIN_WORK
    min_work = PARALLEL_SEGMENT_MIN_WORK if big else PARALLEL_MIN_WORK
    for part in segments:
        part = merge_reduce_ranges(merge_loops(drop_unit_loops(part)))
        if "scatter" not in DISABLED and (scattered := scatter_one_hot(part)) is not None:
            parts.append(_host_passes(scattered[0], info, p, units, min_work))
            parts.append(scattered[1])
            continue
        parts.append(_host_passes(part, info, p, units, min_work))
    return replace(parts[0], then=tuple(parts[1:]))


def _host_passes(part: Kernel, info: DeviceInfo, p: Params, units: int, min_work: int) -> Kernel:
    """``optimize``'s passes for one segment, after its loops are merged (``min_work``: ``parallelize``'s)."""
    if "split_divmod_loops" not in DISABLED:
        part = split_divmod_loops(part)
    if "unroll_divmod_loops" not in DISABLED:
        part = unroll_divmod_loops(part)
    if "unroll_compared_loops" not in DISABLED:
        part = unroll_compared_loops(part)
    if "gemm" not in DISABLED:
        tiled = tile_gemm(widen_accumulators(part), info, p)
        if tiled.gemm is not None:
            return tiled
    if "split_divmod_reduces" not in DISABLED:
        part = split_divmod_reduces(part)
    if "ungate_loads" not in DISABLED:
        part = ungate_loads(part)
    if "upcast_taps" not in DISABLED:
        part = upcast_taps(part)
    if "transpose" not in DISABLED:
        part = tile_transpose(part, p.get("transpose_tile"), "transpose_block" not in DISABLED)
    part = interchange_reduce(part, units, column_blocks="column_block" not in DISABLED,
                              tile=p.get("interchange_tile"), column_block=p.get("column_block"))
    part = parallelize(part, info, p.get("collapse"), min_work)
    part = vectorize(part)
    part = widen_accumulators(part)
    if "unroll_reduce" not in DISABLED:
        part = unroll_reduce(part, info, p.get("reduce_lanes"))
    if "block_vector_reduce" not in DISABLED:
        part = block_vector_reduce(part, p.get("row_block"), p.get("vector_tile"))
    if "stash_row_values" not in DISABLED and p.get("stash", 1):
        part = stash_row_values(part)
    if "upcast_rows" not in DISABLED:  # it leaves kernels with stashed row values alone
        part = upcast_rows(part, p.get("upcast_rows"))
    if "prefetch" not in DISABLED:
        part = prefetch_blocks(part)
    if "prefetch_streams" not in DISABLED:
        part = prefetch_streams(part, p.get("prefetch_distance"), p.get("prefetch_locality"))
    return part

"""Sorting: ``sort``, ``argsort`` and ``topk``, as a bitonic network of zyx ops (every backend, no host round trip).

The sort axis moves last and is padded to a power of two ``P``; each of the ``log2(P) (log2(P) + 1) / 2`` stages
pairs elements and puts the one the network's order wants first in the lower place: padding after every element;
then values in the asked order, NaN last ascending and first descending (as NumPy and PyTorch place it); then the
original position. Every block is sorted ascending in that order (no block runs the other way): merge ``k`` first
pairs each element of a block of ``k`` with its mirror (``i ^ (k - 1)``), which leaves both halves bitonic and
the lower one all first, then stages ``j = k / 4 .. 1`` pair ``i`` with ``i ^ j``. So equal values keep their
order (the sort is stable, for either direction, as ``torch.sort(stable=True)``) and every result is
deterministic.

Invariants:
- Stages are stored (``contiguous``) in pairs (``_stage_groups``): one kernel computes stages ``j`` and ``j / 2``
  of a merge on a view with both pair axes (no reshape between the two, so its index arithmetic stays affine),
  each element evaluating the first stage at its two partners. On 2 cores a pair of 2048-wide rows costs 1.2-1.8x
  one stage's kernel instead of 2x (the sort of 2048x2048: 133 ms with a stage a kernel and blocks sorted either
  way, 72-92 ms now). Three stages inlined cost more than they save (each element evaluates the first stage 4
  times: 5-30 ms against 3 stages' 6-7).
- The network moves (key, tag) pairs (``_ordered``): NaN keys are infinities, told apart from the infinities by
  their tags, so no compare sees a NaN; tags carry the positions. The sorted values are the input gathered at the
  positions, so they carry gradients as ``gather`` does (the positions carry none).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from zyx import dtypes
from zyx.tensor import Tensor, _norm_axis, cat


class SortResult(NamedTuple):
    """``(values, indices)``, as ``torch.sort`` and ``torch.topk`` return them."""

    values: Tensor
    indices: Tensor


def _ordered(x: Tensor, size: int, descending: bool) -> tuple[Tensor, Tensor, int]:
    """``(keys, tags, bits)`` for sorting ``x`` along its last axis, padded to ``size``: the sort's order is the keys'
    order (descending or ascending), then ascending tags, and ``tags & (2**bits - 1)`` is each element's position.
    NaN becomes an infinite key (no compare sees a NaN) tagged before every position (descending: NaN first) or
    after (ascending: NaN last), so NaN and infinity stay apart; padding gets the last key, tagged after NaN."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    keys = x.detach()
    if keys.dtype is dtypes.bool_:
        keys = keys.cast(dtypes.int8)
    bits = 30 if size <= 1 << 29 else 62
    pos = Tensor.arange(size, dtype=dtypes.int32 if bits == 30 else dtypes.int64, device=x.device)
    tags = pos.reshape((1,) * len(lead) + (size,)).expand(*lead, size)
    shift = 1 << bits  # NaN's tag offset: below (descending) or above (ascending) every position
    if keys.dtype.is_float:
        nan = keys.isnan()
        keys = nan.where(math.inf, keys)
        nan_tag = nan.pad(((0, 0),) * len(lead) + ((0, size - n),)).where(-shift if descending else shift, 0)
        tags = tags + nan_tag.cast(tags.dtype)
        last = -math.inf if descending else math.inf
    else:
        last = dtypes.int_range(keys.dtype)[0 if descending else 1]
    if size > n:
        keys = keys.pad(((0, 0),) * len(lead) + ((0, size - n),), value=last)
        if not descending:
            tags = tags + (pos >= n).where(shift, 0).cast(tags.dtype)
    return keys, tags, bits


def _precedes(ka: Tensor, ta: Tensor, kb: Tensor, tb: Tensor, descending: bool) -> Tensor:
    """Whether (key, tag) ``a`` comes strictly before ``b`` (``_ordered``'s order)."""
    return (ka > kb if descending else ka < kb) | ((ka == kb) & (ta < tb))


def _positions(x: Tensor, descending: bool) -> Tensor:
    """The positions that sort ``x`` along its last axis (int64, ``x``'s shape)."""
    n = x.shape[-1]
    size = 1 << max(0, (n - 1).bit_length())
    keys, tags, bits = _ordered(x, size, descending)
    k = 2
    while k <= size:
        for j, f in _stage_groups(k):
            keys, tags = _merge_stages(keys, tags, k, j, f, descending)
        k *= 2
    positions = (tags & ((1 << bits) - 1)).cast(dtypes.int64)
    return positions[..., :n] if size > n else positions


def _stage_groups(k: int) -> list[tuple[int, int]]:
    """The stages ``j = k / 2, k / 4, ..., 1`` of merge ``k`` as ``(j, f)``: stages ``j .. j / 2**(f - 1)`` stored
    by one kernel. Pairs, except that stage 8 goes alone: paired with stage 4, the kernel's inner run of 4 elements
    is unrolled whole and it vectorizes over 2 iterations only (15 ms against 1.5 + 2.6 on 2048x2048)."""
    out = []
    j = k // 2
    while j >= 1:
        f = 2 if j >= 2 and j != 8 else 1
        out.append((j, f))
        j >>= f
    return out


def _merge_stages(keys: Tensor, tags: Tensor, k: int, j: int, f: int, descending: bool) -> tuple[Tensor, Tensor]:
    """Stages ``j, j / 2, ..., j / 2**(f - 1)`` of merge ``k`` over the last axis, stored, in the view
    ``(blocks, 2, ..., 2, j / 2**(f - 1))`` (one axis of size 2 per stage). A stage pairs each element with the same
    place in the other half of its block of ``2 j`` (a flip along its axis), the merge's first stage (``2 j == k``)
    with its mirror in the block (a flip of that axis and every axis inside it)."""
    *lead, size = keys.shape
    h = j >> (f - 1)
    blocks = size // (2 * j)
    shape = (*lead, blocks) + (2,) * f + (h,)
    v, t = keys.reshape(*shape), tags.reshape(*shape)
    for s in range(f):
        axis = s - f - 1  # the pair axis of stage j / 2**s
        # the merge's first stage pairs each element with its mirror in the block (every axis from the pair axis in
        # flipped), the others with the same place in the other half
        flips = tuple(range(axis, 0)) if s == 0 and 2 * j == k else (axis,)
        vp, tp = v.flip(flips), t.flip(flips)
        lower = (Tensor.arange(2, device=keys.device) == 0).reshape((2,) + (1,) * (-axis - 1))
        # tags differ, so exactly one of a pair comes first; the lower half keeps the first: each element takes
        # its partner's when that is (is not) the first
        take = _precedes(vp, tp, v, t, descending) == lower
        v, t = take.where(vp, v), take.where(tp, t)
    return v.reshape(*lead, size).contiguous(), t.reshape(*lead, size).contiguous()


def _select(keys: Tensor, tags: Tensor, k: int, descending: bool) -> Tensor:
    """The tags of the first ``k`` (key, tag) pairs along the last axis in ``_ordered``'s order (tags unique per
    row), by ``k`` selection passes: each takes the first pair among those after the previous pass's pick (the
    extreme key, then its lowest tag): two reductions and a few compares per element, whatever the pass."""
    taken = []
    after = None  # the elements after the last pick in the order (None: every element)
    for _ in range(k):
        best, first = _first(keys, tags, descending, after)
        taken.append(first)
        after = _precedes(best, first, keys, tags, descending)
    return cat(taken, -1)


def _first(keys: Tensor, tags: Tensor, descending: bool, among: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The first (key, tag) pair along the last axis (kept, of size 1) in ``_ordered``'s order among the elements
    ``among`` marks (None: all): the extreme key, then its lowest tag."""
    if among is None:
        candidates = keys
    else:
        fill = (-math.inf if descending else math.inf) if keys.dtype.is_float else \
            dtypes.int_range(keys.dtype)[0 if descending else 1]
        candidates = among.where(keys, fill)
    best = candidates.max(-1, keepdim=True) if descending else candidates.min(-1, keepdim=True)
    hit = keys == best if among is None else among & (keys == best)
    return best, hit.where(tags, dtypes.int_range(tags.dtype)[1]).min(-1, keepdim=True)


def _selected_positions(x: Tensor, k: int, descending: bool) -> Tensor:
    """The first ``k`` of ``_positions(x, descending)`` (int64, ``x``'s shape with ``k`` last) by ``_select``'s
    passes over the last axis instead of the whole network, while ``k`` is small (``topk``). A row of at least
    ``BLOCK_ROW_FACTOR * k`` elements picks blocks first (``_block_candidates``)."""
    n = x.shape[-1]
    if n >= BLOCK_ROW_FACTOR * k and x.numel() >= BLOCK_MIN_ELEMENTS:
        keys, tags, bits = _block_candidates(x, k, descending)
    else:
        keys, tags, bits = _ordered(x, n, descending)
    return (_select(keys, tags, k, descending) & ((1 << bits) - 1)).cast(dtypes.int64)


# rows at least this many times ``k`` long, of at least this many elements in all, select among the elements of
# ``k`` blocks (``_block_candidates``). The block picks add ``k`` passes, each of which costs about 50-90 us of
# graph building and launches however small; on 2 cores: topk(8) of 2048x2048 6.5 -> 3.4 ms (torch 3.0),
# topk(40) of 32x50257 13.7 -> 11.5, but topk(50) of 8x32000 6.2 -> 9.4 and topk(100) of 1x100000 11.4 -> 27.3
BLOCK_ROW_FACTOR = 16
BLOCK_MIN_ELEMENTS = 1 << 20


def _block_candidates(x: Tensor, k: int, descending: bool) -> tuple[Tensor, Tensor, int]:
    """``_ordered``'s (keys, tags, bits) of the elements of the ``k`` blocks (of ``b``, a power of two near
    ``sqrt(n / k)``) whose first elements come first: every one of the first ``k`` elements lies in one of them
    (a block's first element comes no later than its others, so a block holding one of the first ``k`` has fewer
    than ``k`` blocks' first elements before its own). One pass finds each block's first element, ``k`` passes
    over the ``n / b`` of them pick the blocks, and the ``k`` picks are then made among ``k * b`` candidates:
    about ``k * (n / b + k * b)`` compares instead of ``k * n``, plus one pass."""
    n = x.shape[-1]
    lead = x.shape[:-1]
    b = 1 << max(3, round(math.log2(math.sqrt(n / k))))
    nb = -(-n // b)
    keys, tags, bits = _ordered(x, nb * b, descending)
    kb, tb = keys.reshape(*lead, nb, b), tags.reshape(*lead, nb, b)
    best, first = (t.squeeze(-1).contiguous() for t in _first(kb, tb, descending))  # each block's first element
    blocks = (_select(best, first, k, descending) & ((1 << bits) - 1)) // b
    at = (blocks.unsqueeze(-1) * b + Tensor.arange(b, dtype=blocks.dtype, device=x.device)).reshape(*lead, k * b)
    # stored: inlined into every pass, each candidate would re-evaluate the picks' concatenation (k selects)
    return keys.gather(-1, at).contiguous(), tags.gather(-1, at).contiguous(), bits


# ``topk`` selects (``_selected_positions``) while ``k`` is at most the sorting network's stages: a pass (two
# reductions) costs less than a stage (a full read and write of keys and tags). Float32 on 2 cores: 2048x2048
# k=66 (= its stages) 41 ms selected, 128 sorted; 64x1000 k=55 4.8 against 8.0; 64x1000 k=110 9.9 against 7.9
SELECT_STAGE_FRACTION = 1


def argsort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = True) -> Tensor:
    """The int64 positions that sort ``x`` along ``dim``, stable (equal values keep their order; ``stable`` is
    accepted for PyTorch's signature), NaN last ascending and first descending."""
    if x.ndim == 0:
        return Tensor.zeros((), dtype=dtypes.int64, device=x.device)
    axis = _norm_axis(dim, x.ndim, "dim")
    moved = x.transpose(axis, -1)
    if moved.shape[-1] <= 1:
        out = Tensor.zeros(moved.shape, dtype=dtypes.int64, device=x.device)
    else:
        out = _positions(moved, descending)
    return out.transpose(axis, -1)


def sort(x: Tensor, dim: int = -1, descending: bool = False, stable: bool = True) -> SortResult:
    """``(values, indices)`` of ``x`` sorted along ``dim`` (``argsort``'s order); the values carry gradients."""
    indices = argsort(x, dim, descending, stable)
    if x.ndim == 0:
        return SortResult(x, indices)
    return SortResult(x.gather(dim, indices), indices)


def topk(x: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> SortResult:  # noqa: A002
    """The ``k`` largest (``largest``) or smallest elements along ``dim`` and their positions, in that order (as
    PyTorch, ``sorted`` False is allowed and gives the same order)."""
    axis = _norm_axis(dim, max(x.ndim, 1), "dim")
    n = x.shape[axis] if x.ndim else 1
    if not 0 <= k <= n:
        raise ValueError(f"topk: k = {k} is out of range for a dimension of size {n} (shape {x.shape})")
    levels = max(0, (n - 1).bit_length())
    if x.ndim and 0 < k and n > 1 and k * SELECT_STAGE_FRACTION <= levels * (levels + 1) // 2:
        indices = _selected_positions(x.transpose(axis, -1), k, largest).transpose(axis, -1)
    else:
        indices = argsort(x, axis, descending=largest)
        if x.ndim:
            indices = indices._slice_axis(axis, 0, k)
    return SortResult(x.gather(axis, indices) if x.ndim else x, indices)


__all__ = ["SortResult", "argsort", "sort", "topk"]

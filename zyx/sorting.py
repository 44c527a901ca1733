"""Sorting: ``sort``, ``argsort`` and ``topk``, as a bitonic network of zyx ops (every backend, no host round trip).

The sort axis moves last and is padded to a power of two ``P``; each of the ``log2(P) (log2(P) + 1) / 2`` stages
pairs element ``i`` with element ``i ^ j`` and swaps the pairs the network's order wants, on keys (pad, value,
position): padding after every element; then values in the asked order, NaN last ascending and first descending
(as NumPy and PyTorch place it); then the original position. So equal values keep their order (the sort is
stable, for either direction, as ``torch.sort(stable=True)``) and every result is deterministic.

Invariants:
- Each stage is stored (``contiguous``): inlined, a stage would evaluate both of its input stage's elements per
  element, doubling the work with every stage.
- Only positions travel through the network as results; the sorted values are the input gathered at them, so
  they carry gradients as ``gather`` does (the positions carry none).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from zyx import dtypes
from zyx.tensor import Tensor, _norm_axis, cat, stack


class SortResult(NamedTuple):
    """``(values, indices)``, as ``torch.sort`` and ``torch.topk`` return them."""

    values: Tensor
    indices: Tensor


def _before(va: Tensor, ia: Tensor, vb: Tensor, ib: Tensor, n: int, descending: bool) -> Tensor:
    """Whether key (pad, value, position) ``a`` strictly precedes ``b``: positions ``>= n`` are padding."""
    if va.dtype.is_float:
        na, nb = va.isnan(), vb.isnan()
        first = (va > vb) | (na & ~nb) if descending else (va < vb) | (nb & ~na)
        same = (va == vb) | (na & nb)
    else:
        first = va > vb if descending else va < vb
        same = va == vb
    pa, pb = ia >= n, ib >= n
    return (pb & ~pa) | ((pa == pb) & (first | (same & (ia < ib))))


def _positions(x: Tensor, descending: bool) -> Tensor:
    """The positions that sort ``x`` along its last axis (int64, ``x``'s shape)."""
    n = x.shape[-1]
    size = 1 << max(0, (n - 1).bit_length())
    lead = x.shape[:-1]
    keys = x.detach()
    if keys.dtype is dtypes.bool_:
        keys = keys.cast(dtypes.int8)
    if size > n:
        keys = keys.pad(((0, 0),) * len(lead) + ((0, size - n),))
    pos = Tensor.arange(size, dtype=dtypes.int64, device=x.device).reshape((1,) * len(lead) + (size,))
    pos = pos.expand(*lead, size)
    k = 2
    while k <= size:
        j = k // 2
        while j >= 1:
            blocks = size // (2 * j)
            # the network sorts block a = i // (2 j) up (ascending) where bit k of its first position is clear
            first = Tensor.arange(blocks, dtype=dtypes.int64, device=x.device) * (2 * j)
            up = ((first & k) == 0).reshape(blocks, 1)
            v = keys.reshape(*lead, blocks, 2, j)
            p = pos.reshape(*lead, blocks, 2, j)
            v0, v1, p0, p1 = v[..., 0, :], v[..., 1, :], p[..., 0, :], p[..., 1, :]
            swap = up.where(_before(v1, p1, v0, p0, n, descending), _before(v0, p0, v1, p1, n, descending))
            keys = stack([swap.where(v1, v0), swap.where(v0, v1)], -2).reshape(*lead, size).contiguous()
            pos = stack([swap.where(p1, p0), swap.where(p0, p1)], -2).reshape(*lead, size).contiguous()
            j //= 2
        k *= 2
    return pos[..., :n] if size > n else pos


def _selected_positions(x: Tensor, k: int, descending: bool) -> Tensor:
    """The first ``k`` of ``_positions(x, descending)`` (int64, ``x``'s shape with ``k`` last), by ``k`` selection
    passes over the last axis instead of the whole network: each pass takes the first remaining element in the
    sort's order (the extreme value, NaN before every number descending and after every number ascending, the
    lowest position among equals) and excludes it from the next passes by position. A pass reads the row
    twice (the extreme, then its first position); with ``k`` compares per element at most, cheaper than the
    network's ``log2(P) (log2(P) + 1) / 2`` stored stages while ``k`` is small (``topk``)."""
    n = x.shape[-1]
    keys = x.detach()
    if keys.dtype is dtypes.bool_:
        keys = keys.cast(dtypes.int8)
    # int32 positions where they fit: compared beside 32-bit keys at the keys' vector width
    pos = Tensor.arange(n, dtype=dtypes.int32 if n < 2**31 else dtypes.int64, device=x.device)
    if keys.dtype.is_float:
        nan = keys.isnan()
        low, high = -math.inf, math.inf
    else:
        nan = None
        low, high = dtypes.int_range(keys.dtype)
    free: Tensor | None = None  # the elements not taken yet (None: all)
    taken = []
    for _ in range(k):
        # the candidates: numbers not taken yet (None: every element)
        number = free if nan is None else ~nan if free is None else free & ~nan
        if number is None:
            best = keys.max(-1, keepdim=True) if descending else keys.min(-1, keepdim=True)
            hit = keys == best
        else:
            fill = low if descending else high
            best = (number.where(keys, fill).max(-1, keepdim=True) if descending
                    else number.where(keys, fill).min(-1, keepdim=True))
            hit = number & (keys == best)
            if nan is not None:
                left_nan = nan if free is None else free & nan
                # descending: a NaN left goes first; ascending: NaN only once no number is left
                nan_first = left_nan.any(-1, keepdim=True) if descending else ~number.any(-1, keepdim=True)
                hit = nan_first.where(left_nan, hit)
        first = hit.where(pos, n).min(-1, keepdim=True)
        taken.append(first)
        other = pos != first
        free = other if free is None else free & other
    return cat(taken, -1).cast(dtypes.int64)


# ``topk`` selects (``_selected_positions``) while ``k`` passes cost less than the sorting network's stages: k at
# most a quarter of them (2048 elements: 66 stages, k <= 16). topk(8) of 2048x2048 float32: 785 ms sorted, 23 ms
# selected
SELECT_STAGE_FRACTION = 4


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

"""``interpolate`` (PyTorch's ``F.interpolate`` / ``nn.Upsample``): nearest, nearest-exact, (bi/tri)linear and
bicubic resampling of the spatial axes of (N, C, *spatial), one axis at a time (the last first, as PyTorch's
bicubic blends rows before columns).

Source positions are computed in the graph from an iota with PyTorch's arithmetic (float32 for float32 and 16-bit
inputs, float64 for float64), so nearest modes pick PyTorch's elements exactly and linear modes use its source
positions and weights; each axis is a gather of one or two source rows (``index_select``, differentiable), blended
by its weights (a blend may differ from PyTorch's in the last bit: the order of its operations differs). Bicubic
blends four rows with Keys' cubic convolution (``A = -0.75``), rows past the edges clamped to them, as PyTorch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from zyx import dtypes
from zyx.tensor import Tensor

_MODES = {"nearest": None, "nearest-exact": None, "linear": 1, "bilinear": 2, "trilinear": 3, "bicubic": 2}
CUBIC_A = -0.75  # PyTorch's (and OpenCV's) cubic convolution coefficient


def interpolate(input: Tensor, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None,
                recompute_scale_factor: bool | None = None) -> Tensor:
    """PyTorch's ``interpolate`` for ``mode`` nearest, nearest-exact, linear, bilinear, trilinear, bicubic
    (``antialias`` is not supported)."""
    if mode not in _MODES:
        raise NotImplementedError(f"interpolate: mode {mode!r} is not supported; use one of {sorted(_MODES)}")
    nd = input.ndim - 2
    if nd < 1 or (_MODES[mode] is not None and _MODES[mode] != nd):
        raise ValueError(f"interpolate: mode {mode!r} needs an input of rank {(_MODES[mode] or 1) + 2}"
                         f"{'' if _MODES[mode] else ' or more'}, got shape {input.shape}")
    if _MODES[mode] is None and align_corners is not None:
        raise ValueError("interpolate: align_corners only applies to the linear and cubic modes")
    if (size is None) == (scale_factor is None):
        raise ValueError("interpolate: give exactly one of size and scale_factor")
    spatial = input.shape[2:]
    if size is not None:
        out = _per_axis(size, nd, "size")
        scales: list[float | None] = [None] * nd
    else:
        factors = _per_axis(scale_factor, nd, "scale_factor")
        out = tuple(math.floor(n * f) for n, f in zip(spatial, factors))
        scales = [None if recompute_scale_factor else float(f) for f in factors]
    if any(o < 1 for o in out):
        raise ValueError(f"interpolate: output size {out} from input shape {input.shape} is empty")
    x = input if input.dtype.is_float else input.cast(dtypes.default_float)
    math_dtype = dtypes.float64 if x.dtype is dtypes.float64 else dtypes.float32
    for i in reversed(range(nd)):
        axis, n, o = 2 + i, spatial[i], out[i]
        if mode.startswith("nearest"):
            x = x.index_select(axis, _nearest_index(n, o, scales[i], mode == "nearest-exact", math_dtype, x.device))
        elif mode == "bicubic":
            x = _cubic(x, axis, n, o, scales[i], bool(align_corners), math_dtype)
        else:
            x = _linear(x, axis, n, o, scales[i], bool(align_corners), math_dtype)
    return x


def _per_axis(v, nd: int, name: str) -> tuple:
    t = tuple(v) if isinstance(v, Sequence) else (v,) * nd
    if len(t) != nd:
        raise ValueError(f"interpolate: {name} needs {nd} values for {nd} spatial axes, got {v!r}")
    return t


def _scale(n: int, o: int, scale: float | None, align_corners: bool) -> float:
    """PyTorch's ``area_pixel_compute_scale``: output-to-input position ratio."""
    if align_corners:
        return (n - 1) / (o - 1) if o > 1 else 0.0
    return 1.0 / scale if scale is not None and scale > 0 else n / o


def _positions(o: int, math_dtype, device: str) -> Tensor:
    return Tensor.arange(o, device=device).cast(math_dtype)


def _nearest_index(n: int, o: int, scale: float | None, exact: bool, math_dtype, device: str) -> Tensor:
    s = _scale(n, o, scale, False)
    step = _integer_step(n, o, s, exact, math_dtype.name)
    if step is not None:  # the same indices in integer arithmetic: the kernel indexes the input directly
        every, times, offset = step
        i = Tensor.arange(o, device=device)
        return (i // every if every > 1 else i * times) + offset
    pos = _positions(o, math_dtype, device)
    src = ((pos + 0.5) * s if exact else pos * s).floor().cast(dtypes.int64)
    return src.minimum(n - 1)


@functools.lru_cache(maxsize=256)
def _integer_step(n: int, o: int, s: float, exact: bool, math_dtype: str) -> tuple[int, int, int] | None:
    """``(every, times, offset)`` when the nearest source indices that ``_nearest_index`` computes in ``math_dtype``
    (PyTorch's float arithmetic) are exactly ``i // every + offset`` (an integer upscale) or ``i * times + offset``
    (an integer downscale) for every output position ``i``, checked element by element; else None. Integer
    indices keep the gather affine: a 2x upsampling's kernel then copies each element to its four places (2 ms for
    32x32x64x64) instead of converting a float position per element (13.7 ms)."""
    f = np.dtype(math_dtype).type
    pos = np.arange(o, dtype=math_dtype)
    src = ((pos + f(0.5)) * f(s) if exact else pos * f(s)).astype(math_dtype)
    want = np.minimum(np.floor(src).astype(np.int64), n - 1)
    i, first = np.arange(o, dtype=np.int64), int(want[0])
    every = int(np.count_nonzero(want == first))
    if every > 1 and np.array_equal(want, i // every + first):
        return every, 1, first
    times = int(want[1] - first) if o > 1 else 0
    if np.array_equal(want, i * times + first):
        return 1, times, first
    return None


def _linear(x: Tensor, axis: int, n: int, o: int, scale: float | None, align_corners: bool, math_dtype) -> Tensor:
    s = _scale(n, o, scale, align_corners)
    pos = _positions(o, math_dtype, x.device)
    src = pos * s if align_corners else ((pos + 0.5) * s - 0.5).maximum(0.0)
    floor = _source_floor(n, o, s, align_corners, math_dtype, x.device)
    # truncation (src >= 0); the clamps change no value but bound the index, so its gathers need no range checks
    i0 = floor.maximum(0) if floor is not None else src.cast(dtypes.int64).maximum(0).minimum(n - 1)
    i1 = (i0 + 1).minimum(n - 1)
    lam1 = src - i0.cast(math_dtype)
    lam0 = 1.0 - lam1
    shape = tuple(o if d == axis else 1 for d in range(x.ndim))
    lam0, lam1 = lam0.cast(x.dtype).reshape(shape), lam1.cast(x.dtype).reshape(shape)
    return lam0 * x.index_select(axis, i0) + lam1 * x.index_select(axis, i1)


def _source_floor(n: int, o: int, s: float, align_corners: bool, math_dtype, device: str) -> Tensor | None:
    """The floor of every output position's source position as an integer tensor (``_rational_floor``), or None
    where float rounding makes it differ from the exact fraction's floor."""
    rational = _rational_floor(n, o, s, align_corners, math_dtype.name)
    if rational is None:
        return None
    mul, add, div = rational
    return (Tensor.arange(o, device=device) * mul + add) // div


@functools.lru_cache(maxsize=256)
def _rational_floor(n: int, o: int, s: float, align_corners: bool, math_dtype: str) -> tuple[int, int, int] | None:
    """``(mul, add, div)`` when the floor of every source position that ``_linear`` and ``_cubic`` compute in
    ``math_dtype`` (PyTorch's float arithmetic, before ``_linear`` clamps it at 0) is exactly ``(i * mul + add) //
    div`` for output position ``i`` (the exact fraction's floor), checked element by element; else None. Integer
    indices have known bounds, so their gathers need no range checks and no float-to-int conversion: a 2x bilinear
    upsampling of 8x64x128x128 took 144 ms with float positions converted per element, 24 ms so."""
    f = np.dtype(math_dtype).type
    pos = np.arange(o, dtype=math_dtype)
    if align_corners:
        src = pos * f(s)
        mul, add, div = n - 1, 0, max(o - 1, 1)
    else:
        src = (pos + f(0.5)) * f(s) - f(0.5)
        mul, add, div = 2 * n, n - o, 2 * o  # (i + 1/2) n / o - 1/2 as one fraction
    g = math.gcd(mul, add, div)
    mul, add, div = mul // g, add // g, div // g
    i = np.arange(o, dtype=np.int64)
    if np.array_equal(np.floor(src).astype(np.int64), (i * mul + add) // div):
        return mul, add, div
    return None


def _cubic(x: Tensor, axis: int, n: int, o: int, scale: float | None, align_corners: bool, math_dtype) -> Tensor:
    """One axis of PyTorch's bicubic: source position ``src`` (not clamped at 0, unlike linear), rows
    ``floor(src) - 1 .. floor(src) + 2`` clamped into ``[0, n)``, weighted by the cubic convolution of the
    distances, computed as PyTorch's ``get_cubic_upsample_coefficients``."""
    s = _scale(n, o, scale, align_corners)
    pos = _positions(o, math_dtype, x.device)
    src = pos * s if align_corners else (pos + 0.5) * s - 0.5
    floor = _source_floor(n, o, s, align_corners, math_dtype, x.device)
    if floor is None:
        base = src.floor()
        floor = base.cast(dtypes.int64)
    else:
        base = floor.cast(math_dtype)
    t = src - base
    first = floor - 1
    a = CUBIC_A

    def near(v: Tensor) -> Tensor:  # |v| <= 1
        return ((v * (a + 2) - (a + 3)) * v) * v + 1.0

    def far(v: Tensor) -> Tensor:  # 1 < |v| < 2
        return ((v * a - 5 * a) * v + 8 * a) * v - 4 * a

    rest = 1.0 - t
    weights = (far(t + 1.0), near(t), near(rest), far(rest + 1.0))
    shape = tuple(o if d == axis else 1 for d in range(x.ndim))
    out = None
    for j, w in enumerate(weights):
        term = w.cast(x.dtype).reshape(shape) * x.index_select(axis, (first + j).maximum(0).minimum(n - 1))
        out = term if out is None else out + term
    return out

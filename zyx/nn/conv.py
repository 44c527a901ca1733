"""Convolution and pooling with PyTorch's names, layouts (N, C, *spatial) and semantics, built from tensor ops.

Sliding windows (``windows``) are a gather by an affine index, one load per element, so a pooling fuses into one
kernel; their gradient adds strided placements (pads). A convolution views the windows as columns (im2col, one
per sample) and multiplies the flattened weight by them: a GEMM the matmul matcher hands to BLAS or cuDNN (which
copy the columns out first), or a generated one that packs its panels from the windows themselves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from zyx import autograd as AG
from zyx import dtypes
from zyx.tensor import Tensor


def _tuple(v, n: int, name: str) -> tuple[int, ...]:
    t = (v,) * n if isinstance(v, int) else tuple(v)
    if len(t) != n or not all(isinstance(i, int) and not isinstance(i, bool) for i in t):
        raise ValueError(f"{name} must be an int or {n} ints, got {v!r}")
    return t


def windows(x: Tensor, kernel: Sequence[int], stride: Sequence[int], dilation: Sequence[int]) -> Tensor:
    """The windows of ``x`` over its last ``len(kernel)`` axes: shape ``(..., o_1, ..., o_n, k_1, ..., k_n)`` with
    ``o = (size - dilation * (k - 1) - 1) // stride + 1``; element ``[..., i, ..., j, ...]`` is
    ``x[..., i * stride + j * dilation, ...]`` (``autograd.Windows``: one load per element; the gradient adds
    ``k`` strided placements per axis)."""
    nd = len(kernel)
    lead = x.ndim - nd
    for i, (k, s, d) in enumerate(zip(kernel, stride, dilation)):
        ax, n = lead + 2 * i, x.shape[lead + 2 * i]  # earlier axes are (o, k) pairs by now
        if (n - d * (k - 1) - 1) // s + 1 < 1:
            raise ValueError(f"a window of {k} (dilation {d}) does not fit spatial size {n} (input shape {x.shape})")
        x = AG.Windows.apply(x, axis=ax, kernel=k, stride=s, dilation=d)
    # (lead, o_1, k_1, ..., o_n, k_n) -> (lead, o_1..o_n, k_1..k_n)
    return x.permute(*range(lead), *range(lead, lead + 2 * nd, 2), *range(lead + 1, lead + 2 * nd, 2))


def _spatial_input(x: Tensor, nd: int, name: str) -> tuple[Tensor, bool]:
    """``x`` with a batch axis (PyTorch takes unbatched (C, *spatial) too) and whether one was added."""
    if x.ndim == nd + 1:
        return x.unsqueeze(0), True
    if x.ndim != nd + 2:
        raise ValueError(f"{name}: expected an input of shape (N, C, *spatial) or (C, *spatial) with {nd} spatial "
                         f"dimensions, got shape {x.shape}")
    return x, False


def _padded(x: Tensor, padding: Sequence[int] | Sequence[tuple[int, int]], value) -> Tensor:
    """``x`` padded on its last ``len(padding)`` axes: ``p`` on both sides, or ``(left, right)``."""
    pairs = [(p, p) if isinstance(p, int) else tuple(p) for p in padding]
    if not any(a or b for a, b in pairs):
        return x
    return x.pad(tuple([(0, 0)] * (x.ndim - len(pairs)) + pairs), value=value)


def _conv(x: Tensor, weight: Tensor, bias: Tensor | None, stride, padding, dilation, groups: int, nd: int,
          name: str) -> Tensor:
    x, unbatched = _spatial_input(x, nd, name)
    if weight.ndim != nd + 2:
        raise ValueError(f"{name}: weight must be (out_channels, in_channels / groups, *kernel) with {nd + 2} "
                         f"dimensions, got shape {weight.shape}")
    n, c = x.shape[:2]
    o, cg, kernel = weight.shape[0], weight.shape[1], weight.shape[2:]
    if groups < 1 or c % groups or o % groups or c // groups != cg:
        raise ValueError(f"{name}: input of shape {x.shape} ({c} channels) and weight of shape {weight.shape} do "
                         f"not match with groups={groups}: need in_channels = groups * weight.shape[1] and "
                         f"out_channels divisible by groups")
    stride, dilation = _tuple(stride, nd, "stride"), _tuple(dilation, nd, "dilation")
    if isinstance(padding, str):
        if padding == "valid":
            padding = (0,) * nd
        elif padding == "same":
            if any(s != 1 for s in stride):
                raise ValueError(f"{name}: padding='same' needs stride 1, got stride {stride}")
            total = [d * (k - 1) for d, k in zip(dilation, kernel)]
            x = x.pad(tuple([(0, 0)] * 2 + [(t // 2, t - t // 2) for t in total]))
            padding = (0,) * nd
        else:
            raise ValueError(f"{name}: padding must be an int, {nd} ints, 'valid' or 'same', got {padding!r}")
    padding = _tuple(padding, nd, "padding")
    w = windows(_padded(x, padding, 0), kernel, stride, dilation)  # (n, c, *out, *kernel)
    out_shape = w.shape[2:2 + nd]
    g, k, positions = groups, math.prod(kernel), math.prod(out_shape)
    # per sample and group: the weight (o / g, cg * k) times columns (cg * k, positions), so the product is already
    # the output's layout (n, o, *out). The columns stay a view of the padded input: a library GEMM gets them
    # copied out, the host's generated GEMM packs them from the input (its columns are the output positions,
    # ``opt.GemmTile.cols``); the weight's gradient is a batched GEMM summed over the batch
    order = (0, 1, 2, *range(3 + nd, 3 + 2 * nd), *range(3, 3 + nd))
    cols = w.reshape((n, g, cg) + w.shape[2:]).permute(order).reshape(n, g, cg * k, positions)
    y = (weight.reshape(1, g, o // g, cg * k) @ cols).reshape((n, o) + out_shape)
    if bias is not None:
        if bias.shape != (o,):
            raise ValueError(f"{name}: bias must have shape ({o},), got {bias.shape}")
        y = y + bias.reshape((o,) + (1,) * nd)
    return y[0] if unbatched else y


def conv1d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
    """PyTorch's ``conv1d`` (cross-correlation): input (N, C, L), weight (O, C / groups, k)."""
    return _conv(input, weight, bias, stride, padding, dilation, groups, 1, "conv1d")


def conv2d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
    """PyTorch's ``conv2d`` (cross-correlation): input (N, C, H, W), weight (O, C / groups, kh, kw)."""
    return _conv(input, weight, bias, stride, padding, dilation, groups, 2, "conv2d")


def conv3d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0, dilation=1,
           groups: int = 1) -> Tensor:
    """PyTorch's ``conv3d`` (cross-correlation): input (N, C, D, H, W), weight (O, C / groups, kd, kh, kw)."""
    return _conv(input, weight, bias, stride, padding, dilation, groups, 3, "conv3d")


def _conv_transpose(x: Tensor, weight: Tensor, bias: Tensor | None, stride, padding, output_padding, groups: int,
                    dilation, nd: int, name: str) -> Tensor:
    x, unbatched = _spatial_input(x, nd, name)
    if weight.ndim != nd + 2:
        raise ValueError(f"{name}: weight must be (in_channels, out_channels / groups, *kernel) with {nd + 2} "
                         f"dimensions, got shape {weight.shape}")
    n, c = x.shape[:2]
    og, kernel = weight.shape[1], weight.shape[2:]
    if groups < 1 or c % groups or weight.shape[0] != c:
        raise ValueError(f"{name}: input of shape {x.shape} ({c} channels) and weight of shape {weight.shape} do "
                         f"not match with groups={groups}: need weight.shape[0] = in_channels, divisible by groups")
    stride, padding = _tuple(stride, nd, "stride"), _tuple(padding, nd, "padding")
    output_padding, dilation = _tuple(output_padding, nd, "output_padding"), _tuple(dilation, nd, "dilation")
    if any(op >= s and op >= d for op, s, d in zip(output_padding, stride, dilation)):
        raise ValueError(f"{name}: output_padding {output_padding} must be smaller than the stride {stride} or the "
                         f"dilation {dilation}")
    g, cg, k, spatial = groups, c // groups, math.prod(kernel), x.shape[2:]
    # per sample and group: the weight's transpose (og * k, cg) times the input (cg, positions) gives every input
    # position's contribution to each kernel offset (a GEMM); overlap-adding them (col2im: the adjoint of the
    # windows) places them in the output, as the input gradient of a convolution does
    cols = weight.reshape(1, g, cg, og * k).transpose(-1, -2) @ x.reshape(n, g, cg, math.prod(spatial))
    y = cols.reshape((n, g * og) + kernel + spatial)  # (n, o, k_1, ..., k_nd, l_1, ..., l_nd)
    y = AG.OverlapAdd.apply(y, axes=tuple((2 + nd + i, 2 + i) for i in range(nd)), strides=stride,
                            dilations=dilation)
    full = y.shape[2:]
    out = tuple(f - 2 * p + op for f, p, op in zip(full, padding, output_padding))
    if any(o < 1 for o in out):
        raise ValueError(f"{name}: the output would have spatial size {out} (input {x.shape}, kernel {kernel}, "
                         f"stride {stride}, padding {padding}); lower the padding")
    y = _padded(y, [(0, max(0, op - p)) for p, op in zip(padding, output_padding)], 0)
    y = y[(slice(None),) * 2 + tuple(slice(p, p + o) for p, o in zip(padding, out))]
    if bias is not None:
        if bias.shape != (g * og,):
            raise ValueError(f"{name}: bias must have shape ({g * og},), got {bias.shape}")
        y = y + bias.reshape((g * og,) + (1,) * nd)
    return y[0] if unbatched else y


def output_padding_for(shape: tuple[int, ...], output_size, kernel: Sequence[int], stride, padding, dilation,
                       name: str) -> tuple[int, ...]:
    """The output padding that makes a transposed convolution of an input of ``shape`` produce ``output_size``
    (its last ``len(kernel)`` entries are the spatial sizes, as PyTorch's ``ConvTranspose.forward`` takes them)."""
    nd = len(kernel)
    size = tuple(output_size)[-nd:]
    stride, padding = _tuple(stride, nd, "stride"), _tuple(padding, nd, "padding")
    dilation = _tuple(dilation, nd, "dilation")
    pads = []
    for want, n, k, s, p, d in zip(size, shape[-nd:], kernel, stride, padding, dilation):
        least = (n - 1) * s - 2 * p + d * (k - 1) + 1
        if not least <= want < least + max(s, d):
            raise ValueError(f"{name}: output_size {tuple(output_size)} is not reachable from input shape {shape}: "
                             f"each spatial size must be in [{least}, {least + max(s, d)}) here")
        pads.append(want - least)
    return tuple(pads)


def conv_transpose1d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0,
                     output_padding=0, groups: int = 1, dilation=1) -> Tensor:
    """PyTorch's ``conv_transpose1d`` (the input gradient of ``conv1d``): input (N, C, L), weight
    (C, O / groups, k)."""
    return _conv_transpose(input, weight, bias, stride, padding, output_padding, groups, dilation, 1,
                           "conv_transpose1d")


def conv_transpose2d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0,
                     output_padding=0, groups: int = 1, dilation=1) -> Tensor:
    """PyTorch's ``conv_transpose2d`` (the input gradient of ``conv2d``): input (N, C, H, W), weight
    (C, O / groups, kh, kw)."""
    return _conv_transpose(input, weight, bias, stride, padding, output_padding, groups, dilation, 2,
                           "conv_transpose2d")


def conv_transpose3d(input: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0,
                     output_padding=0, groups: int = 1, dilation=1) -> Tensor:
    """PyTorch's ``conv_transpose3d``: input (N, C, D, H, W), weight (C, O / groups, kd, kh, kw)."""
    return _conv_transpose(input, weight, bias, stride, padding, output_padding, groups, dilation, 3,
                           "conv_transpose3d")


def _pool_args(x: Tensor, kernel_size, stride, padding, dilation, ceil_mode: bool, nd: int, name: str):
    """kernel, stride, dilation and the (left, right) padding per spatial axis: ``padding`` on both sides, plus on
    the right what ``ceil_mode``'s last, partial window reaches past it (PyTorch's rule: a window must start inside
    the input or its left padding)."""
    kernel = _tuple(kernel_size, nd, "kernel_size")
    stride = kernel if stride is None or stride == [] else _tuple(stride, nd, "stride")
    padding, dilation = _tuple(padding, nd, "padding"), _tuple(dilation, nd, "dilation")
    if any(2 * p > k for p, k in zip(padding, kernel)):
        raise ValueError(f"{name}: padding {padding} must be at most half the kernel size {kernel}")
    pads = []
    for size, k, s, p, d in zip(x.shape[-nd:], kernel, stride, padding, dilation):
        span = size + 2 * p - d * (k - 1) - 1
        if span < 0:
            raise ValueError(f"{name}: a window of {k} (dilation {d}) does not fit spatial size {size} with padding "
                             f"{p} (input shape {x.shape})")
        out = (span + (s - 1 if ceil_mode else 0)) // s + 1
        if ceil_mode and (out - 1) * s >= size + p:
            out -= 1
        pads.append((p, p + max(0, (out - 1) * s + d * (k - 1) + 1 - size - 2 * p)))
    return kernel, stride, pads, dilation


def _max_pool(x, kernel_size, stride, padding, dilation, ceil_mode, nd: int, name: str) -> Tensor:
    x, unbatched = _spatial_input(x, nd, name)
    kernel, stride, pads, dilation = _pool_args(x, kernel_size, stride, padding, dilation, ceil_mode, nd, name)
    low = -math.inf if x.dtype.is_float else dtypes.int_range(x.dtype)[0] if x.dtype.kind != "b" else False
    w = windows(_padded(x, pads, low), kernel, stride, dilation)
    out = w.shape[:-nd]
    y = AG.FirstMax.apply(w.reshape(out + (math.prod(kernel),))).reshape(out)
    return y[0] if unbatched else y


def max_pool1d(input: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False) -> Tensor:
    return _max_pool(input, kernel_size, stride, padding, dilation, ceil_mode, 1, "max_pool1d")


def max_pool2d(input: Tensor, kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False) -> Tensor:
    """PyTorch's ``max_pool2d`` (padding counts as -inf; NaN propagates)."""
    return _max_pool(input, kernel_size, stride, padding, dilation, ceil_mode, 2, "max_pool2d")


def _avg_pool(x, kernel_size, stride, padding, ceil_mode, count_include_pad: bool, divisor_override, nd: int,
              name: str) -> Tensor:
    x, unbatched = _spatial_input(x, nd, name)
    kernel, stride, pads, dilation = _pool_args(x, kernel_size, stride, padding, 1, ceil_mode, nd, name)
    if not x.dtype.is_float:
        raise TypeError(f"{name}: needs a float input, got {x.dtype.name}")
    axes = tuple(range(-nd, 0))
    total = windows(_padded(x, pads, 0), kernel, stride, dilation).sum(axes)
    partial = any(b > a for a, b in pads)  # ceil_mode's last windows reach past the padding
    if divisor_override is not None:
        y = total / divisor_override
    elif not partial and (count_include_pad or not any(a for a, _ in pads)):
        y = total / math.prod(kernel)
    else:  # the elements under each window: the input's, with the padding's when count_include_pad
        spatial = x.shape[-nd:]
        if count_include_pad:
            ones = Tensor.ones(tuple(n + 2 * a for n, (a, _) in zip(spatial, pads)), dtype=x.dtype, device=x.device)
            ones = _padded(ones, [(0, b - a) for a, b in pads], 0)
        else:
            ones = _padded(Tensor.ones(spatial, dtype=x.dtype, device=x.device), pads, 0)
        y = total / windows(ones, kernel, stride, dilation).sum(axes)
    return y[0] if unbatched else y


def avg_pool1d(input: Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True) -> Tensor:
    return _avg_pool(input, kernel_size, stride, padding, ceil_mode, count_include_pad, None, 1, "avg_pool1d")


def avg_pool2d(input: Tensor, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
               count_include_pad: bool = True, divisor_override: int | None = None) -> Tensor:
    """PyTorch's ``avg_pool2d``."""
    return _avg_pool(input, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override, 2,
                     "avg_pool2d")


def _adaptive_size(x: Tensor, output_size, nd: int, name: str) -> tuple[int, ...]:
    """PyTorch's ``output_size``: an int, or ``nd`` ints where None keeps the input's size."""
    spatial = x.shape[-nd:]
    if isinstance(output_size, (list, tuple)) and len(output_size) == nd:
        output_size = tuple(s if o is None else o for o, s in zip(output_size, spatial))
    out = _tuple(output_size, nd, "output_size")
    if any(o < 1 for o in out):
        raise ValueError(f"{name}: output sizes must be at least 1, got {out}")
    return out


def _adaptive_windows(n: int, o: int) -> tuple[np.ndarray, np.ndarray, int]:
    """PyTorch's adaptive windows of ``o`` outputs over ``n`` inputs: output ``i`` covers ``[floor(i n / o),
    ceil((i + 1) n / o))``. Returns the ``(o, w)`` input positions (``w`` the longest window; positions past a
    window's end repeat its last one), whether each is inside its window, and ``w``."""
    start = np.arange(o) * n // o
    end = -(-(np.arange(1, o + 1) * n) // o)
    w = int(np.max(end - start))
    pos = start[:, None] + np.arange(w)[None, :]
    inside = pos < end[:, None]
    return np.minimum(pos, end[:, None] - 1), inside, w


def _adaptive_pool(input: Tensor, output_size, nd: int, kind: str, name: str) -> Tensor:
    """Adaptive average or max pooling over the last ``nd`` axes, PyTorch's windows (``_adaptive_windows``).
    Axes whose output size divides the input's are reshaped into windows; the others gather each window's
    positions (one load per element, so it fuses with the reduce) and mask the positions past its end."""
    x, unbatched = _spatial_input(input, nd, name)
    out = _adaptive_size(x, output_size, nd, name)
    lead = x.ndim - nd
    inside = None  # the windows' mask over (o_1, w_1, ..., o_nd, w_nd), where some window is uneven
    counts = None  # elements per window, for the average
    for i, (n, o) in enumerate(zip(x.shape[lead:], out)):
        ax = lead + 2 * i  # earlier axes are (o, w) pairs by now
        if n % o == 0:
            x = x.reshape(x.shape[:ax] + (o, n // o) + x.shape[ax + 1:])
            m, c = np.ones((o, n // o), bool), np.full(o, n // o)
        else:
            pos, m, w = _adaptive_windows(n, o)
            x = x.index_select(ax, Tensor(pos.reshape(-1), device=x.device))
            x = x.reshape(x.shape[:ax] + (o, w) + x.shape[ax + 1:])
            c = m.sum(1)
        inside = m if inside is None else np.multiply.outer(inside, m)
        counts = c if counts is None else np.multiply.outer(counts, c)
    window_axes = tuple(lead + 2 * i + 1 for i in range(nd))
    if not inside.all():
        low = (-math.inf if x.dtype.is_float else dtypes.int_range(x.dtype)[0]) if kind == "max" else 0
        x = Tensor(inside, device=x.device).where(x, low)
    if kind == "max":  # the gradient goes to each window's first maximum, as PyTorch's argmax routes it
        outs = tuple(lead + 2 * i for i in range(nd))
        x = x.permute(*range(lead), *outs, *window_axes)
        y = AG.FirstMax.apply(x.reshape(x.shape[:lead + nd] + (-1,))).reshape(x.shape[:lead + nd])
    else:
        y = x.sum(window_axes) / Tensor(counts.astype(np.float32), device=x.device).cast(x.dtype)
    return y[0] if unbatched else y


def adaptive_avg_pool1d(input: Tensor, output_size) -> Tensor:
    """PyTorch's ``adaptive_avg_pool1d``: windows ``[floor(i n / o), ceil((i + 1) n / o))``, uneven ones too."""
    return _adaptive_pool(input, output_size, 1, "avg", "adaptive_avg_pool1d")


def adaptive_avg_pool2d(input: Tensor, output_size) -> Tensor:
    """PyTorch's ``adaptive_avg_pool2d`` (``adaptive_avg_pool1d``'s windows on each axis; None keeps a size)."""
    return _adaptive_pool(input, output_size, 2, "avg", "adaptive_avg_pool2d")


def adaptive_avg_pool3d(input: Tensor, output_size) -> Tensor:
    return _adaptive_pool(input, output_size, 3, "avg", "adaptive_avg_pool3d")


def _adaptive_max(input: Tensor, output_size, return_indices: bool, nd: int) -> Tensor:
    name = f"adaptive_max_pool{nd}d"
    if return_indices:
        raise NotImplementedError(f"{name}: return_indices=True is not supported; the values are differentiable "
                                  "without them")
    return _adaptive_pool(input, output_size, nd, "max", name)


def adaptive_max_pool1d(input: Tensor, output_size, return_indices: bool = False) -> Tensor:
    """PyTorch's ``adaptive_max_pool1d`` (``adaptive_avg_pool1d``'s windows), values only."""
    return _adaptive_max(input, output_size, return_indices, 1)


def adaptive_max_pool2d(input: Tensor, output_size, return_indices: bool = False) -> Tensor:
    return _adaptive_max(input, output_size, return_indices, 2)


def adaptive_max_pool3d(input: Tensor, output_size, return_indices: bool = False) -> Tensor:
    return _adaptive_max(input, output_size, return_indices, 3)

"""Normalizations with PyTorch's names and semantics, built from tensor ops (re-exported by ``functional``):
layer, group and RMS normalization, ``normalize`` and ``cosine_similarity``."""

from __future__ import annotations

from zyx import dtypes
from zyx.tensor import Tensor


def layer_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[-len(shape):]) != shape:
        raise ValueError(f"layer_norm: input shape {x.shape} does not end with {shape}")
    axes = tuple(range(x.ndim - len(shape), x.ndim))
    mean = x.mean(axes, keepdim=True)
    d = x - mean
    var = (d * d).mean(axes, keepdim=True)
    y = d * (var + eps).rsqrt()
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y



def group_norm(x: Tensor, num_groups: int, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """PyTorch's ``group_norm``: ``x`` (N, C, *) normalized over each group of C / num_groups channels and every
    other axis by its mean and biased variance, then scaled and shifted per channel."""
    if x.ndim < 2 or num_groups < 1 or x.shape[1] % num_groups:
        raise ValueError(f"group_norm: input of shape {x.shape} needs (N, C, *) with C divisible by num_groups "
                         f"{num_groups}")
    n, c = x.shape[:2]
    g = x.reshape(n, num_groups, -1)
    y = layer_norm(g, g.shape[-1:], eps=eps).reshape(x.shape)  # each group: its channels and positions as one row
    per_channel = (c,) + (1,) * (x.ndim - 2)
    for t, name in ((weight, "weight"), (bias, "bias")):
        if t is not None and t.shape != (c,):
            raise ValueError(f"group_norm: {name} must have shape ({c},), got {t.shape}")
    if weight is not None:
        y = y * weight.reshape(per_channel)
    if bias is not None:
        y = y + bias.reshape(per_channel)
    return y


def rms_norm(x: Tensor, normalized_shape, weight: Tensor | None = None, eps: float | None = None) -> Tensor:
    """PyTorch's ``rms_norm``: ``x / sqrt(mean(x**2) + eps)`` over the trailing ``normalized_shape`` axes, times
    ``weight``; ``eps`` None is the machine epsilon of ``x``'s dtype, as PyTorch's."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if tuple(x.shape[-len(shape):]) != shape:
        raise ValueError(f"rms_norm: input shape {x.shape} does not end with {shape}")
    x = x if x.dtype.is_float else x.cast(dtypes.default_float)
    if eps is None:
        eps = _MACHINE_EPS[x.dtype]
    axes = tuple(range(x.ndim - len(shape), x.ndim))
    y = x * ((x * x).mean(axes, keepdim=True) + eps).rsqrt()
    if weight is not None:
        if weight.shape != shape:
            raise ValueError(f"rms_norm: weight must have shape {shape}, got {weight.shape}")
        y = y * weight
    return y


_MACHINE_EPS = {dtypes.float16: 2.0 ** -10, dtypes.bfloat16: 2.0 ** -7, dtypes.float32: 2.0 ** -23,
                dtypes.float64: 2.0 ** -52}  # torch.finfo(dtype).eps


def normalize(x: Tensor, p: float = 2.0, dim: int = 1, eps: float = 1e-12) -> Tensor:
    """PyTorch's ``normalize``: ``x / max(norm_p(x, dim), eps)``."""
    return x / x.norm(p, dim, keepdim=True).maximum(eps)


def cosine_similarity(x1: Tensor, x2: Tensor, dim: int = 1, eps: float = 1e-8) -> Tensor:
    """PyTorch's ``cosine_similarity``: each side divided by its 2-norm over ``dim`` (at least ``eps``), then
    summed products over ``dim``; the operands broadcast."""
    return ((x1 / x1.norm(2, dim, keepdim=True).maximum(eps)) * (x2 / x2.norm(2, dim, keepdim=True).maximum(eps))
            ).sum(dim)


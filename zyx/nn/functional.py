"""Stateless neural-network functions: losses, normalization, dropout, one-hot."""

from __future__ import annotations

from zyx import dtypes
from zyx.tensor import Tensor, rand


def one_hot(idx: Tensor, num_classes: int, dtype=None) -> Tensor:
    if idx.dtype.is_float:
        raise TypeError(f"one_hot needs integer class indices, got {idx.dtype.name}")
    classes = Tensor.arange(num_classes, device=idx.device)
    return (idx.unsqueeze(-1) == classes).cast(dtype or dtypes.default_float)


def cross_entropy(logits: Tensor, target: Tensor, reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """Cross entropy of ``logits`` (N, C) against integer class ``target`` (N,), like PyTorch's."""
    if logits.ndim != 2 or target.ndim != 1 or target.shape[0] != logits.shape[0]:
        raise ValueError(f"cross_entropy: logits must be (N, C) and target (N,), got {logits.shape} and "
                         f"{target.shape}")
    logp = logits.log_softmax(-1)
    c = logits.shape[1]
    oh = one_hot(target, c, logp.dtype)
    if label_smoothing:
        oh = oh * (1 - label_smoothing) + label_smoothing / c
    losses = -(logp * oh).sum(-1)
    return _reduce(losses, reduction, "cross_entropy")


def mse_loss(pred: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    if pred.shape != target.shape:
        raise ValueError(f"mse_loss: shapes {pred.shape} and {target.shape} differ")
    d = pred - target
    return _reduce(d * d, reduction, "mse_loss")


def _reduce(x: Tensor, reduction: str, name: str) -> Tensor:
    if reduction == "mean":
        return x.mean()
    if reduction == "sum":
        return x.sum()
    if reduction == "none":
        return x
    raise ValueError(f"{name}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


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


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    if not training or p == 0:
        return x
    keep = rand(*x.shape, device=x.device) >= p
    return keep.where(x * (1.0 / (1.0 - p)), 0.0)

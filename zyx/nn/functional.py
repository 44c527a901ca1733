"""Stateless neural-network functions with PyTorch's names and semantics: dropout, one-hot, activations, linear,
embedding, scaled dot-product attention, and re-exported from their modules: losses (``losses``), convolution and
pooling (``conv``), layer/group/RMS normalization (``norm``), ``interpolate`` (``resample``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from zyx import dtypes
from zyx.nn.conv import (  # noqa: F401 - re-exported: PyTorch keeps them in functional
    adaptive_avg_pool1d,
    adaptive_avg_pool2d,
    adaptive_avg_pool3d,
    adaptive_max_pool1d,
    adaptive_max_pool2d,
    adaptive_max_pool3d,
    avg_pool1d,
    avg_pool2d,
    conv1d,
    conv2d,
    conv3d,
    conv_transpose1d,
    conv_transpose2d,
    conv_transpose3d,
    max_pool1d,
    max_pool2d,
)
from zyx.nn.losses import (  # noqa: F401 - re-exported: PyTorch keeps them in functional
    binary_cross_entropy,
    binary_cross_entropy_with_logits,
    cross_entropy,
    huber_loss,
    kl_div,
    l1_loss,
    mse_loss,
    nll_loss,
    smooth_l1_loss,
)
from zyx.nn.norm import cosine_similarity, group_norm, layer_norm, normalize, rms_norm  # noqa: F401
from zyx.nn.resample import interpolate  # noqa: F401 - re-exported
from zyx.tensor import Tensor, broadcast_shapes, rand


def one_hot(idx: Tensor, num_classes: int, dtype=None) -> Tensor:
    if idx.dtype.is_float:
        raise TypeError(f"one_hot needs integer class indices, got {idx.dtype.name}")
    classes = Tensor.arange(num_classes, device=idx.device)
    return (idx.unsqueeze(-1) == classes).cast(dtype or dtypes.default_float)


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    if not training or p == 0:
        return x
    keep = rand(*x.shape, device=x.device) >= p
    return keep.where(x * (1.0 / (1.0 - p)), 0.0)


# ---- activations and layers as functions ------------------------------------------------------------------------


def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """GELU, exact (``"none"``: x·Φ(x) through erf) or the ``"tanh"`` approximation, as PyTorch's."""
    return x.gelu(approximate)


def relu(x: Tensor) -> Tensor:
    return x.relu()


def silu(x: Tensor) -> Tensor:
    return x.silu()


def sigmoid(x: Tensor) -> Tensor:
    return x.sigmoid()


def tanh(x: Tensor) -> Tensor:
    return x.tanh()


def leaky_relu(x: Tensor, negative_slope: float = 0.01) -> Tensor:
    return x.leaky_relu(negative_slope)


def softplus(x: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    return x.softplus(beta, threshold)


def pad(x: Tensor, pad: Sequence[int], mode: str = "constant", value: float | None = None) -> Tensor:
    """PyTorch's ``pad``: flat (left, right, top, bottom, ...) pairs from the last axis, constant ``mode`` only
    (negative entries crop)."""
    if mode != "constant":
        raise NotImplementedError(f"pad: mode {mode!r} is not supported; only 'constant'")
    return x.pad(tuple(pad), value=0 if value is None else value)


def softmax(x: Tensor, dim: int = -1, dtype=None) -> Tensor:
    """Softmax over ``dim`` (computed in ``dtype`` when given)."""
    return (x.cast(dtype) if dtype is not None else x).softmax(dim)


def log_softmax(x: Tensor, dim: int = -1, dtype=None) -> Tensor:
    """Log-softmax over ``dim`` (computed in ``dtype`` when given)."""
    return (x.cast(dtype) if dtype is not None else x).log_softmax(dim)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` with ``weight`` of shape (out_features, in_features), as PyTorch's."""
    if weight.ndim != 2:
        raise ValueError(f"linear: weight must be 2-D (out_features, in_features), got shape {weight.shape}")
    if x.ndim == 0 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: input of shape {x.shape} does not end with in_features = {weight.shape[1]} "
                         f"of weight shape {weight.shape}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"linear: bias of shape {bias.shape} does not match weight shape {weight.shape}")
    y = x @ weight.T
    return y + bias if bias is not None else y


def embedding(idx: Tensor, weight: Tensor, padding_idx: int | None = None) -> Tensor:
    """Rows of ``weight`` (num_embeddings, dim) picked by the integer ``idx``: shape idx.shape + (dim,).
    Entries equal to ``padding_idx`` give that row unchanged but send no gradient to it (PyTorch's)."""
    if idx.dtype.is_float or idx.dtype.kind == "b":
        raise TypeError(f"embedding: indices must be integers, got {idx.dtype.name} (shape {idx.shape})")
    if weight.ndim != 2:
        raise ValueError(f"embedding: weight must be 2-D (num_embeddings, dim), got shape {weight.shape}")
    out = weight[idx]
    if padding_idx is not None:
        pad = _padding_index(padding_idx, weight.shape[0])
        if weight.requires_grad:
            out = (idx == pad).unsqueeze(-1).where(out.detach(), out)
    return out


def _padding_index(padding_idx: int, num_embeddings: int) -> int:
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"padding_idx {padding_idx} is out of range for {num_embeddings} embeddings")
    return padding_idx % num_embeddings


# ---- attention ---------------------------------------------------------------------------------------------------


def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                                 dropout_p: float = 0.0, is_causal: bool = False,
                                 scale: float | None = None) -> Tensor:
    """``softmax(query @ key.T * scale + mask) @ value`` over shapes (..., L, E), (..., S, E), (..., S, Ev) with
    broadcasting batch dims, giving (..., L, Ev), as PyTorch's.

    ``attn_mask`` broadcasts to (..., L, S): bool (True = takes part) or float (added to the scores).
    ``is_causal`` lets query i see keys 0..i (not with ``attn_mask``). ``scale`` defaults to 1/sqrt(E).
    ``dropout_p`` > 0 drops attention weights (always, as PyTorch's; pass 0 in evaluation). A query row whose
    keys are all masked out (all False, or all -inf) gives zeros and no gradient, as PyTorch 2.5+.
    """
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale)[0]


def _attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, dropout_p: float, is_causal: bool,
               scale: float | None) -> tuple[Tensor, Tensor]:
    """(output, attention weights) of scaled dot-product attention; the weights' dead rows are zero too."""
    if q.ndim < 2 or k.ndim < 2 or v.ndim < 2:
        raise ValueError(f"scaled_dot_product_attention: query, key and value need at least 2 dimensions, got "
                         f"shapes {q.shape}, {k.shape} and {v.shape}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"scaled_dot_product_attention: query of shape {q.shape} and key of shape {k.shape} "
                         "differ in the last (embedding) axis")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"scaled_dot_product_attention: key of shape {k.shape} and value of shape {v.shape} "
                         "differ in the sequence axis (-2)")
    if not 0 <= dropout_p < 1:
        raise ValueError(f"scaled_dot_product_attention: dropout_p must be in [0, 1), got {dropout_p}")
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: give attn_mask or is_causal=True, not both")
    L, S = q.shape[-2], k.shape[-2]  # noqa: N806 - the papers' names
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    mask, alive = None, None
    if is_causal:
        row = Tensor.arange(L, device=q.device).reshape(L, 1)
        col = Tensor.arange(S, device=q.device).reshape(1, S)
        mask = _additive(col <= row, scores)  # every row keeps key 0
    elif attn_mask is not None:
        if _broadcast_or_none(attn_mask.shape, scores.shape) != scores.shape:
            raise ValueError(f"scaled_dot_product_attention: attn_mask of shape {attn_mask.shape} does not "
                             f"broadcast to the attention shape {scores.shape} (query {q.shape}, key {k.shape})")
        if attn_mask.dtype.kind == "b":
            mask = _additive(attn_mask, scores)
            alive = attn_mask.any(-1, keepdim=True)
        elif attn_mask.dtype.is_float:
            # -inf becomes finite but very negative: no inf - inf = NaN in dead rows (they are zeroed below)
            alive = (attn_mask > -math.inf).any(-1, keepdim=True)
            mask = attn_mask.cast(scores.dtype).maximum(_lowest(scores.dtype))
        else:
            raise TypeError(f"scaled_dot_product_attention: attn_mask must be bool or float, got "
                            f"{attn_mask.dtype.name}")
    weights = (scores + mask if mask is not None else scores).softmax(-1)
    if dropout_p > 0:
        weights = dropout(weights, dropout_p, True)
    out = weights @ v
    if alive is not None:
        out, weights = alive.where(out, 0.0), alive.where(weights, 0.0)
    return out, weights


def _additive(allowed: Tensor, scores: Tensor) -> Tensor:
    """0 where ``allowed``, else very negative, in the dtype of ``scores``."""
    return allowed.where(0.0, Tensor.full((), _lowest(scores.dtype), scores.dtype, scores.device))


def _lowest(d) -> float:
    """Half the lowest finite value of ``d``: exp of it is 0, and adding a score to it cannot overflow."""
    return float(np.finfo(d.np_dtype).min) / 2


def _broadcast_or_none(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return broadcast_shapes(*shapes)
    except ValueError:
        return None

"""Layers with PyTorch's parameter layouts and default initializations."""

from __future__ import annotations

import math

from zyx.nn import functional as F
from zyx.nn.module import Module, Parameter
from zyx.tensor import Tensor, rand, randn


def _uniform(shape, bound: float, device) -> Tensor:
    return rand(*shape, device=device) * (2 * bound) - bound


class Linear(Module):
    """y = x @ weight.T + bias, weight of shape (out_features, in_features)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: str | None = None) -> None:
        bound = 1 / math.sqrt(in_features) if in_features else 0.0
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(_uniform((out_features, in_features), bound, device))
        self.bias = Parameter(_uniform((out_features,), bound, device)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Linear({self.in_features}, {self.out_features}) got input of shape {x.shape}")
        y = x @ self.weight.T
        return y + self.bias if self.bias is not None else y


class LayerNorm(Module):
    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 device: str | None = None) -> None:
        self.normalized_shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.eps = eps
        self.weight = Parameter(Tensor.ones(self.normalized_shape, device=device)) if elementwise_affine else None
        self.bias = Parameter(Tensor.zeros(self.normalized_shape, device=device)) if elementwise_affine else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class Embedding(Module):
    """A lookup table ``weight`` (num_embeddings, embedding_dim), initialized N(0, 1). The row ``padding_idx``
    starts at zero and never receives a gradient (PyTorch's)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 device: str | None = None) -> None:
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = None if padding_idx is None else F._padding_index(padding_idx, num_embeddings)
        w = randn(num_embeddings, embedding_dim, device=device)
        if self.padding_idx is not None:
            rows = Tensor.arange(num_embeddings, device=w.device).reshape(num_embeddings, 1)
            w = (rows == self.padding_idx).where(0.0, w)
        self.weight = Parameter(w)

    def forward(self, idx: Tensor) -> Tensor:
        return F.embedding(idx, self.weight, self.padding_idx)


class Dropout(Module):
    def __init__(self, p: float = 0.5) -> None:
        if not 0 <= p < 1:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return F.dropout(x, self.p, self.training)


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.relu()


class GELU(Module):
    def __init__(self, approximate: str = "none") -> None:
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return x.gelu(self.approximate)


class Sequential(Module):
    def __init__(self, *layers: Module) -> None:
        self._layers = list(layers)

    def forward(self, x):
        for layer in self._layers:
            x = layer(x)
        return x

    def __getitem__(self, i: int) -> Module:
        return self._layers[i]

    def __len__(self) -> int:
        return len(self._layers)


class MultiheadAttention(Module):
    """PyTorch's ``nn.MultiheadAttention`` (kdim = vdim = embed_dim): parameters ``in_proj_weight`` (3E, E),
    ``in_proj_bias`` (3E,) and ``out_proj`` (Linear E -> E), with the same names, layouts and initialization.

    Inputs are (L, N, E) (or (N, L, E) with ``batch_first``) or unbatched (L, E). In the masks, True means
    *not allowed* (the opposite of ``scaled_dot_product_attention``); float masks are added to the scores.
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True,
                 batch_first: bool = False, device: str | None = None) -> None:
        if num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"MultiheadAttention: embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        if not 0 <= dropout < 1:
            raise ValueError(f"MultiheadAttention: dropout must be in [0, 1), got {dropout}")
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, embed_dim // num_heads
        self.dropout, self.batch_first = dropout, batch_first
        # xavier_uniform_ over (3E, E), zero biases: as PyTorch's _reset_parameters
        self.in_proj_weight = Parameter(_uniform((3 * embed_dim, embed_dim), math.sqrt(6 / (4 * embed_dim)),
                                                 device))
        self.in_proj_bias = Parameter(Tensor.zeros(3 * embed_dim, device=device)) if bias else None
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, device=device)
        if bias:
            self.out_proj.bias = Parameter(Tensor.zeros(embed_dim, device=device))

    def forward(self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Tensor | None = None,
                need_weights: bool = True, attn_mask: Tensor | None = None,
                average_attn_weights: bool = True) -> tuple[Tensor, Tensor | None]:
        """(output like ``query``, attention weights (N, L, S) — (N, H, L, S) without averaging — or None)."""
        E, H, hd = self.embed_dim, self.num_heads, self.head_dim  # noqa: N806
        batched = query.ndim == 3
        if query.ndim not in (2, 3) or key.ndim != query.ndim or value.ndim != query.ndim:
            raise ValueError(f"MultiheadAttention: query, key and value must all be 3-D (batched) or 2-D, got "
                             f"shapes {query.shape}, {key.shape} and {value.shape}")
        if query.shape[-1] != E or key.shape[-1] != E or value.shape[-1] != E:
            raise ValueError(f"MultiheadAttention(embed_dim={E}): query, key and value must end with {E}, got "
                             f"shapes {query.shape}, {key.shape} and {value.shape}")
        if key.shape != value.shape:
            raise ValueError(f"MultiheadAttention: key of shape {key.shape} and value of shape {value.shape} differ")

        def to_nle(x: Tensor) -> Tensor:  # (N, L, E)
            if not batched:
                return x.unsqueeze(0)
            return x if self.batch_first else x.transpose(0, 1)

        self_attention = query is key and key is value
        q, k, v = to_nle(query), to_nle(key), to_nle(value)
        if q.shape[0] != k.shape[0]:
            raise ValueError(f"MultiheadAttention: query of shape {query.shape} and key of shape {key.shape} "
                             "have different batch sizes")
        N, L, S = q.shape[0], q.shape[1], k.shape[1]  # noqa: N806
        w, b = self.in_proj_weight, self.in_proj_bias
        if self_attention:
            q, k, v = F.linear(q, w, b).chunk(3, -1)
        else:
            bq, bk, bv = (None, None, None) if b is None else (b[:E], b[E:2 * E], b[2 * E:])
            q, k, v = F.linear(q, w[:E], bq), F.linear(k, w[E:2 * E], bk), F.linear(v, w[2 * E:], bv)

        def heads(x: Tensor, n: int) -> Tensor:  # (N, n, E) -> (N, H, n, hd)
            return x.reshape(N, n, H, hd).transpose(1, 2)

        mask = self._merge_masks(key_padding_mask, attn_mask, batched, (N, L, S))
        p = self.dropout if self.training else 0.0
        out, weights = F._attention(heads(q, L), heads(k, S), heads(v, S), mask, p, False, None)
        out = self.out_proj(out.transpose(1, 2).reshape(N, L, E))
        out = (out if self.batch_first else out.transpose(0, 1)) if batched else out.reshape(L, E)
        if not need_weights:
            return out, None
        if average_attn_weights:
            weights = weights.mean(1)
        return out, (weights if batched else weights.reshape(weights.shape[1:]))

    def _merge_masks(self, key_padding_mask: Tensor | None, attn_mask: Tensor | None, batched: bool,
                     shape: tuple[int, int, int]) -> Tensor | None:
        """One scaled_dot_product_attention mask over (N, H, L, S), ``shape`` = (N, L, S): bool (True = allowed)
        when every mask given is bool, else float (bool masks become -inf / 0, then all are added, as PyTorch
        merges them)."""
        N, L, S = shape  # noqa: N806
        H = self.num_heads  # noqa: N806
        masks = []
        if key_padding_mask is not None:
            want = (N, S) if batched else (S,)
            if tuple(key_padding_mask.shape) != want:
                raise ValueError(f"MultiheadAttention: key_padding_mask must have shape {want}, got "
                                 f"{key_padding_mask.shape}")
            masks.append(key_padding_mask.reshape(N, 1, 1, S))
        if attn_mask is not None:
            if attn_mask.shape == (L, S):
                masks.append(attn_mask.reshape(1, 1, L, S))
            elif attn_mask.shape == (N * H, L, S):
                masks.append(attn_mask.reshape(N, H, L, S))
            else:
                raise ValueError(f"MultiheadAttention: attn_mask must have shape {(L, S)} or {(N * H, L, S)}, "
                                 f"got {attn_mask.shape}")
        for m in masks:
            if not (m.dtype.is_float or m.dtype.kind == "b"):
                raise TypeError(f"MultiheadAttention: masks must be bool or float, got {m.dtype.name}")
        if not masks:
            return None
        if all(m.dtype.kind == "b" for m in masks):
            allowed = masks[0].logical_not()
            for m in masks[1:]:
                allowed = allowed & m.logical_not()
            return allowed
        total = None
        for m in masks:
            m = m.where(-math.inf, 0.0) if m.dtype.kind == "b" else m
            total = m if total is None else total + m
        return total

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
    def __init__(self, num_embeddings: int, embedding_dim: int, device: str | None = None) -> None:
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.weight = Parameter(randn(num_embeddings, embedding_dim, device=device))

    def forward(self, idx: Tensor) -> Tensor:
        return self.weight[idx]


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

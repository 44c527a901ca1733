"""Neural-network building blocks: ``Module`` and layers, losses in ``zyx.nn.functional``."""

from zyx.nn import functional
from zyx.nn.layers import GELU, Dropout, Embedding, LayerNorm, Linear, MultiheadAttention, ReLU, Sequential
from zyx.nn.module import Module, Parameter

__all__ = ["Module", "Parameter", "Linear", "LayerNorm", "Embedding", "MultiheadAttention", "Dropout", "Sequential",
           "ReLU", "GELU", "functional"]

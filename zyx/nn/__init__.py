"""Neural-network building blocks: ``Module`` and layers, losses in ``zyx.nn.functional``."""

from zyx.nn import functional
from zyx.nn.layers import GELU, Dropout, Embedding, LayerNorm, Linear, ReLU, Sequential
from zyx.nn.module import Module, Parameter

__all__ = ["Module", "Parameter", "Linear", "LayerNorm", "Embedding", "Dropout", "Sequential", "ReLU", "GELU",
           "functional"]

"""Neural-network building blocks: ``Module`` and layers, losses in ``zyx.nn.functional``."""

from zyx.nn import functional
from zyx.nn.layers import (
    GELU,
    AdaptiveAvgPool2d,
    AvgPool1d,
    AvgPool2d,
    BatchNorm1d,
    BatchNorm2d,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    Dropout,
    Embedding,
    Flatten,
    LayerNorm,
    Linear,
    MaxPool1d,
    MaxPool2d,
    MultiheadAttention,
    ReLU,
    Sequential,
)
from zyx.nn.module import Module, Parameter

__all__ = ["Module", "Parameter", "Linear", "LayerNorm", "Embedding", "MultiheadAttention", "Dropout", "Sequential",
           "ReLU", "GELU", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
           "ConvTranspose3d", "MaxPool1d", "MaxPool2d", "AvgPool1d", "AvgPool2d", "AdaptiveAvgPool2d", "Flatten",
           "BatchNorm1d", "BatchNorm2d", "functional"]

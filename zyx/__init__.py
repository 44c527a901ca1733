"""zyx: a lazy tensor compiler with pluggable backends.

>>> import zyx
>>> x = zyx.Tensor([[1.0, 2.0], [3.0, 4.0]])
>>> (x * 2 + 1).sum(axis=1).numpy()
array([ 8., 16.], dtype=float32)
"""

from zyx import debug
from zyx import functions as _functions
from zyx.autograd import enable_grad, no_grad
from zyx.backends.base import BackendError
from zyx.backends.registry import ConfigError, registry
from zyx.capture import CaptureError
from zyx.dlpack import from_dlpack
from zyx.dtypes import (
    DType,
    bfloat16,
    float16,
    float32,
    float64,
    int8,
    int16,
    int32,
    int64,
    promote_types,
    uint8,
    uint16,
    uint32,
    uint64,
)
from zyx.dtypes import bool_ as bool  # noqa: A001 - zyx.bool like torch.bool
from zyx.einsum import einsum
from zyx.jit import jit
from zyx.tensor import (
    Tensor,
    broadcast_shapes,
    cat,
    manual_seed,
    matmul,
    rand,
    randint,
    randn,
    realize,
    stack,
    where,
)

globals().update(_functions.FUNCTIONS)  # zyx.exp(x), zyx.maximum(a, b), zyx.sum(x, 1), ... (zyx.functions)

zeros = Tensor.zeros
ones = Tensor.ones
full = Tensor.full
arange = Tensor.arange
linspace = Tensor.linspace
eye = Tensor.eye


def zeros_like(t: Tensor, dtype=None) -> Tensor:
    return t.zeros_like(dtype)


def ones_like(t: Tensor, dtype=None) -> Tensor:
    return t.ones_like(dtype)


def full_like(t: Tensor, value, dtype=None) -> Tensor:
    return t.full_like(value, dtype)


def tensor(data, dtype=None, device=None, requires_grad: bool = False) -> Tensor:
    return Tensor(data, dtype=dtype, device=device, requires_grad=requires_grad)


def set_default_device(name: str) -> None:
    """Make ``name`` ("host", "cuda:0", ...) the device of new tensors."""
    registry().set_default_device(name)


def default_device() -> str:
    return registry().default_device()


def __getattr__(name: str):
    if name in ("load", "save"):
        from zyx import io

        return getattr(io, name)
    if name in ("nn", "optim"):
        import importlib

        return importlib.import_module(f"zyx.{name}")
    raise AttributeError(f"module 'zyx' has no attribute {name!r}")


__all__ = [
    "Tensor", "DType", "BackendError", "ConfigError", "bool", "int8", "int16", "int32", "int64", "uint8", "uint16",
    "uint32", "uint64", "float16", "bfloat16", "float32", "float64", "promote_types", "zeros", "ones", "full",
    "arange", "linspace", "eye", "zeros_like", "ones_like", "full_like", "rand", "randn", "randint", "manual_seed",
    "cat", "stack", "where", "matmul", "realize", "no_grad", "enable_grad", "debug", "tensor", "broadcast_shapes",
    "set_default_device", "default_device", "from_dlpack", "einsum", "jit", "CaptureError", *_functions.FUNCTIONS,
]

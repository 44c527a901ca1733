"""Module-level forms of Tensor methods, as PyTorch (``torch.exp(x)``) and NumPy (``np.maximum(a, b)``) spell them.

Each is ``Tensor.<name>`` with the tensor first (an array-like first argument becomes ``zyx.Tensor(it)``). A binary
function takes its tensor on either side, and a Python scalar on the other side stays weak, as with operators:
``zyx.maximum(2, t)`` and ``zyx.sub(1.0, t)`` keep ``t``'s dtype.
"""

from __future__ import annotations

from collections.abc import Callable

from zyx.tensor import Tensor

UNARY_AND_REDUCE = (
    "abs", "exp", "exp2", "log", "log2", "sqrt", "rsqrt", "sin", "cos", "tan", "tanh", "sigmoid", "relu", "erf",
    "floor", "ceil", "round", "trunc", "sign", "neg", "negative", "reciprocal", "square", "isnan", "isinf",
    "isfinite", "logical_not", "clip", "clamp",
    "sum", "prod", "mean", "max", "min", "amax", "amin", "argmax", "argmin", "var", "std", "logsumexp", "softmax",
    "log_softmax", "cumsum", "cumprod", "all", "any",
    "reshape", "transpose", "permute", "flatten", "squeeze", "unsqueeze", "flip", "broadcast_to", "repeat_interleave",
    "split", "chunk", "pad", "gather", "take_along_dim", "index_select", "roll", "tril", "triu", "norm", "outer",
    "sort", "argsort", "topk",
)
# name -> (the method for a tensor first, the method for a tensor second)
BINARY = {
    "add": ("add", "__radd__"), "sub": ("sub", "__rsub__"), "subtract": ("sub", "__rsub__"),
    "mul": ("mul", "__rmul__"), "multiply": ("mul", "__rmul__"), "div": ("div", "__rtruediv__"),
    "divide": ("div", "__rtruediv__"), "true_divide": ("div", "__rtruediv__"),
    "floor_divide": ("floor_divide", "__rfloordiv__"), "remainder": ("remainder", "__rmod__"),
    "pow": ("pow", "__rpow__"), "maximum": ("maximum", "maximum"), "minimum": ("minimum", "minimum"),
    "eq": ("eq", "eq"), "ne": ("ne", "ne"), "lt": ("lt", "gt"), "le": ("le", "ge"), "gt": ("gt", "lt"),
    "ge": ("ge", "le"), "logical_and": ("logical_and", "logical_and"), "logical_or": ("logical_or", "logical_or"),
    "logical_xor": ("logical_xor", "logical_xor"),
}


def _method(name: str) -> Callable[..., Tensor]:
    def fn(x, *args, **kwargs) -> Tensor:
        return getattr(x if isinstance(x, Tensor) else Tensor(x), name)(*args, **kwargs)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"``x.{name}(...)`` (see ``Tensor.{name}``)."
    return fn


def _binary(name: str, first: str, second: str) -> Callable[..., Tensor]:
    def fn(a, b, **kwargs) -> Tensor:
        if isinstance(a, Tensor) or not isinstance(b, Tensor):
            return getattr(a if isinstance(a, Tensor) else Tensor(a), first)(b, **kwargs)
        if kwargs:
            raise TypeError(f"zyx.{name}: keyword arguments {sorted(kwargs)} need the tensor first")
        return getattr(b, second)(a)

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"``a.{first}(b)``, or ``b.{second}(a)`` when only ``b`` is a tensor."
    return fn


FUNCTIONS: dict[str, Callable[..., Tensor]] = {
    **{name: _method(name) for name in UNARY_AND_REDUCE},
    **{name: _binary(name, *methods) for name, methods in BINARY.items()},
}


def take_along_axis(arr, indices, axis: int | None) -> Tensor:
    """NumPy's ``take_along_axis`` (``Tensor.take_along_dim``)."""
    return FUNCTIONS["take_along_dim"](arr, indices, axis)


FUNCTIONS["take_along_axis"] = take_along_axis

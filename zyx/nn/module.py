"""``Module``: parameters and submodules found by attribute, state dicts, train/eval, safetensors files.

Invariants: ``parameters()`` lists every parameter once, in registration order (submodules depth first);
``state_dict()`` keys are dotted attribute paths (``"0.weight"``, ``"encoder.norm.bias"``), the same names
PyTorch uses for the same structure.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from zyx.tensor import Tensor


def Parameter(data, dtype=None, device: str | None = None) -> Tensor:  # noqa: N802 - PyTorch's name
    """A realized leaf tensor with ``requires_grad=True``."""
    t = data.detach() if isinstance(data, Tensor) else Tensor(data, dtype=dtype, device=device)
    t = t.cast(dtype) if dtype is not None else t
    t = t.to(device) if device is not None else t
    t = Tensor._from_class(t.realize().cls)
    t.requires_grad = True
    return t


class Module:
    training: bool = True

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def _children(self) -> Iterator[tuple[str, object]]:
        for name, value in vars(self).items():
            if isinstance(value, (Module, Tensor)):
                yield name, value
            elif isinstance(value, (list, tuple)) and value and all(isinstance(v, Module) for v in value):
                for i, v in enumerate(value):
                    yield f"{name}.{i}" if name != "_layers" else str(i), v

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        seen: set[int] = set()
        for name, t in self._named_tensors(prefix):
            if t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                yield name, t

    def _named_tensors(self, prefix: str = "") -> Iterator[tuple[str, Tensor]]:
        for name, value in self._children():
            full = f"{prefix}{name}"
            if isinstance(value, Tensor):
                yield full, value
            else:
                yield from value._named_tensors(full + ".")

    def parameters(self) -> list[Tensor]:
        return [t for _, t in self.named_parameters()]

    def modules(self) -> Iterator[Module]:
        yield self
        for _, value in self._children():
            if isinstance(value, Module):
                yield from value.modules()

    def state_dict(self) -> dict[str, Tensor]:
        """Every tensor attribute (parameters and buffers) by dotted name."""
        return dict(self._named_tensors())

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy values into this module's tensors (shapes must match; dtypes are cast to the parameter's)."""
        own = self.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        if strict and (missing or unexpected):
            raise KeyError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for name, value in state.items():
            if name not in own:
                continue
            t = own[name]
            v = value if isinstance(value, Tensor) else Tensor(np.asarray(value))
            if v.shape != t.shape:
                raise ValueError(f"load_state_dict: {name} has shape {v.shape} in the state, {t.shape} in the module")
            t.cls = v.cast(t.dtype).to(t.device).contiguous().realize().cls

    def to(self, device: str) -> Module:
        """Move every tensor (parameters and buffers) to ``device`` in place, as PyTorch's ``Module.to``; the
        tensor objects stay the same, so an optimizer built before keeps working. Returns self."""
        tensors = [t for _, t in self._named_tensors()]
        for t in tensors:
            t.cls = t.to(device).contiguous().realize().cls
        return self

    def train(self, mode: bool = True) -> Module:
        for m in self.modules():
            m.training = mode
        return self

    def eval(self) -> Module:
        return self.train(False)

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None

    def save(self, path: str, metadata: dict[str, str] | None = None) -> None:
        """Write the state dict as safetensors (atomically)."""
        from zyx.io import save

        save(path, self.state_dict(), metadata)

    def load(self, path: str, strict: bool = True) -> Module:
        """Read a safetensors file written by ``save`` (or PyTorch) into this module."""
        from zyx.io import load

        self.load_state_dict(load(path), strict)
        return self

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={type(v).__name__}" for n, v in self._children() if isinstance(v, Module))
        return f"{type(self).__name__}({inner})"

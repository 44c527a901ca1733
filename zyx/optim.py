"""Optimizers. ``step()`` builds every parameter's update lazily, rebinds the parameters and their states,
then realizes them all in one schedule (one fused kernel per parameter and state where shapes allow).

Learning rates and step-dependent factors (Adam's bias corrections) are ``Tensor.variable`` launch
arguments, so changing them or advancing the step never recompiles.
"""

from __future__ import annotations

from collections.abc import Iterable

import zyx
from zyx import capture
from zyx.autograd import no_grad
from zyx.tensor import Tensor


class Optimizer:
    def __init__(self, params: Iterable[Tensor], lr: float) -> None:
        self.params = [p for p in params]
        if not self.params:
            raise ValueError("optimizer got an empty parameter list")
        for p in self.params:
            if not p.requires_grad:
                raise ValueError(f"optimizer parameter {p} does not require grad")
        if lr < 0:
            raise ValueError(f"learning rate must be non-negative, got {lr}")
        self.lr = lr
        self._lr_vars: dict[tuple[str, str], Tensor] = {}  # (name, device) -> launch-argument scalar
        self._values: dict[str, float] = {}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _scalar(self, name: str, device: str) -> Tensor:
        """The launch-argument scalar ``name`` on ``device`` (one per device), holding this step's value."""
        v = self._lr_vars.get((name, device))
        if v is None:
            v = self._lr_vars[(name, device)] = Tensor.variable(float(self._values[name]), zyx.float32, device)
        return v

    def _advance(self) -> None:
        """Count one step and give every launch-argument scalar its value for it. A replay of a jitted step
        runs this too (``capture.on_replay``): no graph is built, the counters still advance."""
        self._count()
        self._values = self._step_values()
        for (name, _), v in self._lr_vars.items():
            v.cls.var_value = float(self._values[name])

    def step(self, *realize_also: Tensor) -> None:
        """Update every parameter with a gradient; ``realize_also`` (e.g. the loss) joins the same schedule.
        Parameters and optimizer state are rebound in place (``Tensor.assign``): the same tensor objects."""
        with no_grad():
            self._advance()
            capture.on_replay(self._advance)
            updated = self._update()
            zyx.realize(*updated, *realize_also)

    def _count(self) -> None:
        raise NotImplementedError

    def _step_values(self) -> dict[str, float]:
        raise NotImplementedError

    def _update(self) -> list[Tensor]:
        raise NotImplementedError


class SGD(Optimizer):
    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        super().__init__(params, lr)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: nesterov needs momentum > 0 and dampening = 0")
        self.momentum, self.dampening, self.weight_decay, self.nesterov = momentum, dampening, weight_decay, nesterov
        self.buffers = [_zeros_like(p) for p in self.params] if momentum else []
        self.steps = 0

    def _count(self) -> None:
        self.steps += 1

    def _step_values(self) -> dict[str, float]:
        # PyTorch: the first step's buffer is the gradient itself, later ones are dampened
        return {"lr": self.lr, "gscale": 1.0 if self.steps == 1 else 1 - self.dampening}

    def _update(self) -> list[Tensor]:
        out = []
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            g = p.grad.cast(p.dtype)
            if self.weight_decay:
                g = g + p.detach() * self.weight_decay
            if self.momentum:
                b = self.buffers[i].assign(self.buffers[i] * self.momentum + g * self._scalar("gscale", p.device))
                out.append(b)
                g = g + b * self.momentum if self.nesterov else b
            p.assign(p.detach() - self._scalar("lr", p.device) * g)
            out.append(p)
        return out


class Adam(Optimizer):
    decoupled = False

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, lr)
        b1, b2 = betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"Adam: betas must be in [0, 1), got {betas}")
        self.b1, self.b2, self.eps, self.weight_decay = b1, b2, eps, weight_decay
        self.t = 0
        # realized zeros, so the first step has the same graph structure as every later one
        self.m = [_zeros_like(p) for p in self.params]
        self.v = [_zeros_like(p) for p in self.params]

    def _count(self) -> None:
        self.t += 1

    def _step_values(self) -> dict[str, float]:
        # lr * sqrt(1 - b2^t) / (1 - b1^t), and eps * sqrt(1 - b2^t): PyTorch's formulation
        c2 = (1 - self.b2 ** self.t) ** 0.5
        return {"step_size": self.lr * c2 / (1 - self.b1 ** self.t), "eps_hat": self.eps * c2,
                "decay": self.lr * self.weight_decay}

    def _update(self) -> list[Tensor]:
        out = []
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            g = p.grad.cast(p.dtype)
            w = p.detach()
            if self.weight_decay and not self.decoupled:
                g = g + w * self.weight_decay
            m = self.m[i].assign(self.m[i] * self.b1 + g * (1 - self.b1))
            v = self.v[i].assign(self.v[i] * self.b2 + (g * g) * (1 - self.b2))
            step, eps = self._scalar("step_size", p.device), self._scalar("eps_hat", p.device)
            if self.weight_decay and self.decoupled:
                w = w - w * self._scalar("decay", p.device)
            p.assign(w - step * m / (v.sqrt() + eps))
            out += [m, v, p]
        return out


class AdamW(Adam):
    """Adam with decoupled weight decay (default 0.01, as PyTorch)."""

    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01) -> None:
        super().__init__(params, lr, betas, eps, weight_decay)


def _zeros_like(p: Tensor) -> Tensor:
    return Tensor.zeros(p.shape, dtype=p.dtype, device=p.device).contiguous().realize().detach()

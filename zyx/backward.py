"""Reverse-mode differentiation over the recorded ``Function`` contexts (lazy: builds gradient graphs)."""

from __future__ import annotations

from zyx.autograd import no_grad
from zyx.graph import ops as g
from zyx.ops import Ops


def _toposort(root):
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        t, done = stack.pop()
        if done:
            order.append(t)
            continue
        if id(t) in seen or t._ctx is None:
            continue
        seen.add(id(t))
        stack.append((t, True))
        for p in t._ctx.parents:
            if p._ctx is not None and id(p) not in seen:
                stack.append((p, False))
    return order


def backward(root, gradient=None) -> None:
    """Accumulate d(root)/d(leaf) into ``leaf.grad`` for every leaf that requires grad."""
    from zyx.tensor import Tensor

    if not root.requires_grad:
        raise RuntimeError("backward(): this tensor does not require grad (no input had requires_grad=True)")
    if gradient is None:
        if root.numel() != 1:
            raise RuntimeError(f"backward(): a gradient argument is needed for a non-scalar output of shape "
                               f"{root.shape}")
        grad = g.const(1, root.shape, root.dtype, root.device)
    else:
        gt = gradient if isinstance(gradient, Tensor) else Tensor(gradient, dtype=root.dtype, device=root.device)
        if gt.shape != root.shape:
            raise ValueError(f"backward(): gradient shape {gt.shape} does not match the output shape {root.shape}")
        grad = gt.cast(root.dtype).cls
    grads = {id(root): grad}
    with no_grad():
        for t in reversed(_toposort(root)):
            gout = grads.pop(id(t), None)
            if gout is None:
                continue
            ctx = t._ctx
            gins = ctx.backward(gout)
            for p, gi, need in zip(ctx.parents, gins, ctx.needs):
                if not need or gi is None:
                    continue
                pd = p.cls.dtype
                if gi.dtype is not pd:
                    gi = g.cast(gi, pd)
                if p._ctx is not None:
                    prev = grads.get(id(p))
                    grads[id(p)] = gi if prev is None else g.binary(Ops.ADD, prev, gi)
                else:
                    p.grad = Tensor._from_class(gi) if p.grad is None else \
                        Tensor._from_class(g.binary(Ops.ADD, p.grad.cls, gi))

"""Loss functions and loss modules with PyTorch's names, arguments and semantics (``zyx.nn.functional`` re-exports
the functions).

Invariants: every loss is a lazy zyx graph, differentiable by zyx's autograd w.r.t. the input and, where PyTorch
differentiates it, the target (probability targets, BCE targets, regression targets). ``reduction`` is one of
``'none'``, ``'mean'``, ``'sum'`` (``kl_div`` also ``'batchmean'``) and is checked before anything is built.
Elementwise losses need input and target of one shape (PyTorch only warns for mse/l1/smooth_l1/huber; here a
``ValueError`` names both shapes); ``kl_div`` broadcasts them, as PyTorch does.
"""

from __future__ import annotations

from zyx import capture
from zyx.autograd import Function
from zyx.nn.module import Module
from zyx.tensor import Tensor, broadcast_shapes

_REDUCTIONS = ("none", "mean", "sum")
_BCE_EPS = 9.999999960041972e-13  # float32(1e-12): PyTorch's BCE gradient bounds x (1 - x) below by this float


# ---- helpers -----------------------------------------------------------------------------------------------------


def _reduce(x: Tensor, reduction: str, name: str) -> Tensor:
    """``x`` averaged (``'mean'``), summed (``'sum'``) or as is (``'none'``)."""
    if reduction == "mean":
        return x.mean()
    if reduction == "sum":
        return x.sum()
    if reduction == "none":
        return x
    raise ValueError(f"{name}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _check_reduction(reduction: str, name: str, allowed: tuple[str, ...] = _REDUCTIONS) -> None:
    if reduction not in allowed:
        names = ", ".join(repr(a) for a in allowed[:-1]) + f" or {allowed[-1]!r}"
        raise ValueError(f"{name}: reduction must be {names}, got {reduction!r}")


def _same_shape(input: Tensor, target: Tensor, name: str) -> None:
    if tuple(input.shape) != tuple(target.shape):
        raise ValueError(f"{name}: input of shape {input.shape} and target of shape {target.shape} differ (the "
                         "shapes must be equal; no broadcasting)")


def _broadcasts_to(t: Tensor, shape: tuple[int, ...], what: str, input: Tensor, name: str) -> None:
    """``t`` must broadcast to ``shape`` (the loss's shape) without growing it."""
    try:
        ok = broadcast_shapes(tuple(t.shape), tuple(shape)) == tuple(shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name}: {what} of shape {t.shape} does not broadcast to the input's shape {input.shape}")


def _float_target(target: Tensor, name: str) -> None:
    if not target.dtype.is_float:
        raise TypeError(f"{name}: target must be a float tensor, got {target.dtype.name} (shape {target.shape})")


def _log1p_value(x: Tensor) -> Tensor:
    """log(1 + x) accurate for small |x| (Kahan's: ``log(u) * x / (u - 1)`` with ``u = 1 + x``); no gradient."""
    u = 1 + x
    d = u - 1
    exact = d == 0
    return exact.where(x, u.log() * (x / exact.where(1.0, d)))


class _Log1p(Function):
    """log(1 + x), accurate for small |x|; gradient ``1 / (1 + x)``."""

    def forward(self, x):
        self.x = x
        return _log1p_value(Tensor._from_class(x)).cls

    def backward(self, grad):
        return ((Tensor._from_class(grad) / (1 + Tensor._from_class(self.x))).cls,)


def _log1p(x: Tensor) -> Tensor:
    return _Log1p.apply(x)


def _log_sigmoid(x: Tensor) -> Tensor:
    """log(sigmoid(x)) = min(x, 0) - log1p(exp(-|x|)): no overflow, no cancellation for large |x|."""
    return x.minimum(0) - _log1p((-x.abs()).exp())


class _BinaryCrossEntropy(Function):
    """Elementwise ``-(t log x + (1 - t) log(1 - x))``, each log clamped at -100, with PyTorch's gradients:
    ``(x - t) / max(x (1 - x), float32(1e-12))`` for ``x`` (finite at x = 0 and 1) and ``-logit(x)`` for ``t``."""

    def forward(self, x, t):
        self.x, self.t = x, t
        xt, tt = Tensor._from_class(x), Tensor._from_class(t)
        return ((tt - 1) * _log1p_value(-xt).maximum(-100) - tt * xt.log().maximum(-100)).cls

    def backward(self, grad):
        x, t, gr = Tensor._from_class(self.x), Tensor._from_class(self.t), Tensor._from_class(grad)
        gx = ((x - t) / ((1 - x) * x).maximum(_BCE_EPS) * gr).cls if self.needs[0] else None
        gt = (-(x / (1 - x)).log() * gr).cls if self.needs[1] else None
        return gx, gt


# ---- classification ----------------------------------------------------------------------------------------------


def _class_layout(input: Tensor, target: Tensor, weight: Tensor | None, name: str) -> tuple[int, int]:
    """(class axis, number of classes) of ``input`` (C,), (N, C) or (N, C, d1, ..., dk) for integer class
    indices ``target`` of shape (), (N,) or (N, d1, ..., dk); checks shapes, dtypes and ``weight`` (C,)."""
    if input.ndim == 0:
        raise ValueError(f"{name}: input must be (C,), (N, C) or (N, C, d1, ...), got a 0-d tensor "
                         f"(target shape {target.shape})")
    cdim = 0 if input.ndim == 1 else 1
    c = input.shape[cdim]
    if weight is not None and tuple(weight.shape) != (c,):
        raise ValueError(f"{name}: weight must have shape ({c},), one entry per class of input shape {input.shape}, "
                         f"got {weight.shape}")
    return cdim, c


def _check_range(target: Tensor, c: int, ignore_index: int, name: str) -> None:
    """Class indices held in host memory are checked when the loss is built (as indexing checks its indices);
    computed or device-resident ones are read only by the kernel, where one outside [0, C) selects no class."""
    t = target.cls
    if not (t.realized and target.device == "host" and capture.active is None) or target.numel() == 0:
        return
    vals = target.numpy()
    bad = vals[(vals != ignore_index) & ((vals < 0) | (vals >= c))]
    if bad.size:
        raise IndexError(f"{name}: target class {bad.reshape(-1)[0]} is outside [0, {c}) for input with {c} classes "
                         f"(and is not ignore_index={ignore_index})")


def _check_indices(input: Tensor, target: Tensor, cdim: int, name: str, what: str) -> None:
    want = tuple(input.shape[:cdim]) + tuple(input.shape[cdim + 1:])
    if tuple(target.shape) != want:
        raise ValueError(f"{name}: {what} must be (C,), (N, C) or (N, C, d1, ...) and target class indices of "
                         f"shape (), (N,) or (N, d1, ...) (the input's shape without C), got {what} {input.shape} "
                         f"and target {target.shape}")
    if target.dtype.is_float or target.dtype.kind == "b":
        raise TypeError(f"{name}: class-index target must be integer, got {target.dtype.name} (shape "
                        f"{target.shape}, input shape {input.shape})")


def _nll(logp: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, reduction: str,
         label_smoothing: float, cdim: int, c: int) -> Tensor:
    """PyTorch's ``nll_loss`` of log-probabilities ``logp`` (plus ``cross_entropy``'s label smoothing): per element
    ``-w[t] logp[t]`` (smoothed: ``(1 - s) * that + s / C * sum_c -w[c] logp[c]``), 0 where ``t == ignore_index``;
    ``'mean'`` divides the sum by the sum of ``w[t]`` over the targets not ignored (NaN when that is 0). Indices
    outside [0, C) (other than ``ignore_index``) raise when they sit in host memory (``_check_range``); computed ones
    select no class, loss 0 (PyTorch raises)."""
    valid = target != ignore_index
    along = (c,) + (1,) * (logp.ndim - cdim - 1)  # a (C,) vector broadcast along the class axis
    # the target's class selected by a one-hot comparison (exact: one value plus zeros; -inf elsewhere is fine)
    hit = target.unsqueeze(cdim) == Tensor.arange(c, device=logp.device).reshape(along)
    loss = -hit.where(logp, 0.0).sum(cdim)
    wt = None
    if weight is not None:
        weight = weight.cast(logp.dtype).reshape(along)
        wt = hit.where(weight, 0.0).sum(cdim)
        loss = loss * wt
    if label_smoothing:
        per_class = logp * weight if weight is not None else logp
        loss = loss * (1 - label_smoothing) + (-per_class.sum(cdim)) * (label_smoothing / c)
    loss = valid.where(loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    total = valid.where(wt, 0.0).sum() if wt is not None else valid.sum().cast(loss.dtype)
    return loss.sum() / total


def cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None, ignore_index: int = -100,
                  reduction: str = "mean", label_smoothing: float = 0.0) -> Tensor:
    """Cross entropy of logits ``input`` (C,), (N, C) or (N, C, d1, ..., dk), classes on axis 1 (0 unbatched), as
    PyTorch's. ``target``: integer class indices (the input's shape without C), or class probabilities (the input's
    shape, float). ``weight`` (C,) scales each class; indices equal to ``ignore_index`` count nowhere; ``'mean'``
    divides by the summed weights of the targets not ignored (indices) or by the number of positions N * d1 * ...
    (probabilities). ``label_smoothing`` s mixes the target with the uniform distribution: (1 - s) target + s / C.
    """
    name = "cross_entropy"
    if isinstance(weight, str):
        raise TypeError(f"{name}: the third argument is weight (PyTorch's order); pass reduction={weight!r} by name")
    _check_reduction(reduction, name)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1], got {label_smoothing}")
    cdim, c = _class_layout(input, target, weight, name)
    logp = input.log_softmax(cdim)
    if tuple(target.shape) == tuple(input.shape):  # class probabilities
        if not target.dtype.is_float:
            raise TypeError(f"{name}: a target of the input's shape {input.shape} holds class probabilities and "
                            f"must be float, got {target.dtype.name}")
        t = target * (1 - label_smoothing) + label_smoothing / c if label_smoothing else target
        prod = logp * t
        if weight is not None:
            prod = prod * weight.cast(logp.dtype).reshape((c,) + (1,) * (input.ndim - cdim - 1))
        if reduction == "none":
            return -prod.sum(cdim)
        total = -prod.sum()
        return total if reduction == "sum" else total / (input.numel() // c)
    _check_indices(input, target, cdim, name, "logits")
    _check_range(target, c, ignore_index, name)
    return _nll(logp, target, weight, ignore_index, reduction, label_smoothing, cdim, c)


def nll_loss(input: Tensor, target: Tensor, weight: Tensor | None = None, ignore_index: int = -100,
             reduction: str = "mean") -> Tensor:
    """Negative log-likelihood of log-probabilities ``input`` (C,), (N, C) or (N, C, d1, ..., dk) at integer class
    indices ``target`` (the input's shape without C), as PyTorch's: ``-weight[t] * input[t]``, 0 where
    ``t == ignore_index``; ``'mean'`` divides by the summed weights of the targets not ignored (NaN if none)."""
    name = "nll_loss"
    if isinstance(weight, str):
        raise TypeError(f"{name}: the third argument is weight (PyTorch's order); pass reduction={weight!r} by name")
    _check_reduction(reduction, name)
    cdim, c = _class_layout(input, target, weight, name)
    _check_indices(input, target, cdim, name, "input")
    _check_range(target, c, ignore_index, name)
    return _nll(input, target, weight, ignore_index, reduction, 0.0, cdim, c)


def binary_cross_entropy(input: Tensor, target: Tensor, weight: Tensor | None = None,
                         reduction: str = "mean") -> Tensor:
    """``-weight * (t log x + (1 - t) log(1 - x))`` of probabilities ``input`` x and ``target`` t of one shape, each
    log clamped at -100, as PyTorch's (its gradients too: finite at x = 0 and 1). ``weight`` broadcasts to the
    input's shape. Inputs outside [0, 1] are not checked (PyTorch raises): they give NaN."""
    name = "binary_cross_entropy"
    _check_reduction(reduction, name)
    _same_shape(input, target, name)
    _float_target(target, name)
    x = input if input.dtype.is_float else input.float()
    loss = _BinaryCrossEntropy.apply(x, target.cast(x.dtype))
    if weight is not None:
        _broadcasts_to(weight, input.shape, "weight", input, name)
        loss = loss * weight
    return _reduce(loss, reduction, name)


def binary_cross_entropy_with_logits(input: Tensor, target: Tensor, weight: Tensor | None = None,
                                     reduction: str = "mean", pos_weight: Tensor | None = None) -> Tensor:
    """Binary cross entropy of ``sigmoid(input)`` against ``target`` (one shape), as PyTorch's, in the stable form
    ``(1 - t) x - (1 + (pos_weight - 1) t) log_sigmoid(x)``, times ``weight``. ``pos_weight`` weighs the positive
    term (e.g. one entry per class, broadcasting along the last axis); both broadcast to the input's shape."""
    name = "binary_cross_entropy_with_logits"
    _check_reduction(reduction, name)
    _same_shape(input, target, name)
    _float_target(target, name)
    x = input if input.dtype.is_float else input.float()
    log_sig = _log_sigmoid(x)
    if pos_weight is not None:
        _broadcasts_to(pos_weight, input.shape, "pos_weight", input, name)
        log_sig = log_sig * ((pos_weight - 1) * target + 1)
    loss = (1 - target) * x - log_sig
    if weight is not None:
        _broadcasts_to(weight, input.shape, "weight", input, name)
        loss = loss * weight
    return _reduce(loss, reduction, name)


# ---- regression --------------------------------------------------------------------------------------------------


def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """Squared error ``(input - target)**2`` of one shape, as PyTorch's."""
    _check_reduction(reduction, "mse_loss")
    if input.shape != target.shape:
        raise ValueError(f"mse_loss: shapes {input.shape} and {target.shape} differ (input and target must have "
                         "one shape; no broadcasting)")
    d = input - target
    return _reduce(d * d, reduction, "mse_loss")


def l1_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:
    """Absolute error ``|input - target|`` of one shape, as PyTorch's (gradient 0 where they are equal)."""
    _check_reduction(reduction, "l1_loss")
    _same_shape(input, target, "l1_loss")
    return _reduce((input - target).abs(), reduction, "l1_loss")


def smooth_l1_loss(input: Tensor, target: Tensor, reduction: str = "mean", beta: float = 1.0) -> Tensor:
    """``0.5 z**2 / beta`` where ``z = |input - target| < beta``, else ``z - 0.5 beta``, as PyTorch's; ``beta``
    0 is the L1 loss."""
    name = "smooth_l1_loss"
    _check_reduction(reduction, name)
    _same_shape(input, target, name)
    if beta < 0:
        raise ValueError(f"{name}: beta must be >= 0, got {beta}")
    z = (input - target).abs()
    if beta == 0:
        return _reduce(z, reduction, name)
    return _reduce((z < beta).where(0.5 * z * z / beta, z - 0.5 * beta), reduction, name)


def huber_loss(input: Tensor, target: Tensor, reduction: str = "mean", delta: float = 1.0) -> Tensor:
    """``0.5 z**2`` where ``z = |input - target| < delta``, else ``delta (z - 0.5 delta)``, as PyTorch's."""
    name = "huber_loss"
    _check_reduction(reduction, name)
    _same_shape(input, target, name)
    if not delta > 0:
        raise ValueError(f"{name}: delta must be > 0, got {delta}")
    z = (input - target).abs()
    return _reduce((z < delta).where(0.5 * z * z, delta * (z - 0.5 * delta)), reduction, name)


def kl_div(input: Tensor, target: Tensor, reduction: str = "mean", log_target: bool = False) -> Tensor:
    """Kullback-Leibler divergence of log-probabilities ``input`` from ``target`` (probabilities, or
    log-probabilities with ``log_target``), pointwise ``t (log t - input)`` (0 where t = 0) or
    ``exp(t) (t - input)``, as PyTorch's; the shapes broadcast. ``'batchmean'`` divides the sum by the batch size
    ``input.shape[0]`` (the KL divergence's value); ``'mean'`` by the number of elements."""
    name = "kl_div"
    _check_reduction(reduction, name, ("none", "batchmean", "mean", "sum"))
    try:
        broadcast_shapes(tuple(input.shape), tuple(target.shape))
    except ValueError:
        raise ValueError(f"{name}: input of shape {input.shape} and target of shape {target.shape} do not "
                         "broadcast") from None
    if log_target:
        out = target.exp() * (target - input)
    else:
        out = (target == 0).where(0.0, target * target.log()) - target * input  # xlogy(t, t) - t input
    if reduction == "batchmean":
        total = out.sum()
        return total / input.shape[0] if input.ndim else total
    return _reduce(out, reduction, name)


# ---- modules -----------------------------------------------------------------------------------------------------


class _Loss(Module):
    """A loss module: ``forward(input, target)`` calls its function with the constructor's options."""

    reductions: tuple[str, ...] = _REDUCTIONS

    def __init__(self, reduction: str = "mean") -> None:
        _check_reduction(reduction, type(self).__name__, self.reductions)
        self.reduction = reduction


class _WeightedLoss(_Loss):
    """Keeps ``weight`` as a plain tensor attribute: in ``state_dict()`` (PyTorch's buffer), not a parameter."""

    def __init__(self, weight: Tensor | None = None, reduction: str = "mean") -> None:
        super().__init__(reduction)
        self.weight = weight


class CrossEntropyLoss(_WeightedLoss):
    """``F.cross_entropy`` with the constructor's ``weight``, ``ignore_index``, ``reduction``, ``label_smoothing``."""

    def __init__(self, weight: Tensor | None = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0) -> None:
        super().__init__(weight, reduction)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"CrossEntropyLoss: label_smoothing must be in [0, 1], got {label_smoothing}")
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(input, target, self.weight, self.ignore_index, self.reduction, self.label_smoothing)


class NLLLoss(_WeightedLoss):
    """``F.nll_loss`` with the constructor's ``weight``, ``ignore_index`` and ``reduction``."""

    def __init__(self, weight: Tensor | None = None, ignore_index: int = -100, reduction: str = "mean") -> None:
        super().__init__(weight, reduction)
        self.ignore_index = ignore_index

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return nll_loss(input, target, self.weight, self.ignore_index, self.reduction)


class MSELoss(_Loss):
    """``F.mse_loss``."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return mse_loss(input, target, self.reduction)


class L1Loss(_Loss):
    """``F.l1_loss``."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return l1_loss(input, target, self.reduction)


class SmoothL1Loss(_Loss):
    """``F.smooth_l1_loss`` with the constructor's ``reduction`` and ``beta``."""

    def __init__(self, reduction: str = "mean", beta: float = 1.0) -> None:
        super().__init__(reduction)
        if beta < 0:
            raise ValueError(f"SmoothL1Loss: beta must be >= 0, got {beta}")
        self.beta = beta

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return smooth_l1_loss(input, target, self.reduction, self.beta)


class HuberLoss(_Loss):
    """``F.huber_loss`` with the constructor's ``reduction`` and ``delta``."""

    def __init__(self, reduction: str = "mean", delta: float = 1.0) -> None:
        super().__init__(reduction)
        if not delta > 0:
            raise ValueError(f"HuberLoss: delta must be > 0, got {delta}")
        self.delta = delta

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return huber_loss(input, target, self.reduction, self.delta)


class BCELoss(_WeightedLoss):
    """``F.binary_cross_entropy`` with the constructor's ``weight`` and ``reduction``."""

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return binary_cross_entropy(input, target, self.weight, self.reduction)


class BCEWithLogitsLoss(_WeightedLoss):
    """``F.binary_cross_entropy_with_logits`` with the constructor's ``weight``, ``reduction`` and ``pos_weight``
    (kept like ``weight``)."""

    def __init__(self, weight: Tensor | None = None, reduction: str = "mean", pos_weight: Tensor | None = None) -> None:
        super().__init__(weight, reduction)
        self.pos_weight = pos_weight

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return binary_cross_entropy_with_logits(input, target, self.weight, self.reduction, self.pos_weight)


class KLDivLoss(_Loss):
    """``F.kl_div`` with the constructor's ``reduction`` (``'batchmean'`` too) and ``log_target``."""

    reductions = ("none", "batchmean", "mean", "sum")

    def __init__(self, reduction: str = "mean", log_target: bool = False) -> None:
        super().__init__(reduction)
        self.log_target = log_target

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return kl_div(input, target, self.reduction, self.log_target)

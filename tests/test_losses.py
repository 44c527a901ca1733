"""Loss functions and modules against PyTorch: float64 values and gradients (input, and target where PyTorch
differentiates it) on every compute device, options, edge cases (all targets ignored, clamped logs) and errors."""

from __future__ import annotations

import numpy as np
import pytest

import zyx
from zyx import nn
from zyx.nn import functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional


def _matches_torch(fz, ft, diff, const, device: str, seed: int = 0) -> None:
    """Values, and the gradients of sum(f(...) * w) w.r.t. every array in ``diff``, float64, against PyTorch;
    ``const`` arrays (class indices, weights) are passed after them without gradients. NaN matches NaN."""
    zs = [zyx.Tensor(a, device=device, requires_grad=True) for a in diff]
    ts = [torch.tensor(a, requires_grad=True) for a in diff]
    zc = [zyx.Tensor(a, device=device) for a in const]
    tc = [torch.tensor(a) for a in const]
    out_z, out_t = fz(*zs, *zc), ft(*ts, *tc)
    assert out_z.shape == tuple(out_t.shape)
    w = np.random.default_rng(seed).standard_normal(tuple(out_t.shape))
    (out_z * zyx.Tensor(w, device=device)).sum().backward()
    (out_t * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(out_z.numpy(), out_t.detach().numpy(), rtol=1e-10, atol=1e-12)
    for i, (z, t) in enumerate(zip(zs, ts)):
        np.testing.assert_allclose(z.grad.numpy(), t.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=f"grad {i}")


_rng = np.random.default_rng(0)


def _probs(shape, axis: int) -> np.ndarray:
    p = _rng.random(shape) + 0.05
    return p / p.sum(axis, keepdims=True)


X2 = _rng.standard_normal((6, 5))
T2 = _rng.integers(0, 5, 6)
T2_IGN = np.array([1, -100, 4, 0, -100, 2])
X4 = _rng.standard_normal((2, 4, 3, 5))
T4 = _rng.integers(0, 4, (2, 3, 5))
T4[0, 1, 2] = T4[1, 0, :2] = -100
W5, W4 = _rng.random(5) + 0.1, _rng.random(4) + 0.1
X1, T1 = _rng.standard_normal(5), np.array(3)
P2, P4 = _probs((6, 5), 1), _probs((2, 4, 3, 5), 1)
ALL_IGN = np.full(6, -100)
X2_INF = X2.copy()
X2_INF[np.arange(6), (T2 + 1) % 5] = -np.inf  # a class that cannot occur: finite loss and gradients, as PyTorch

CE = {
    # name: (zyx kwargs == torch kwargs, diff arrays, const arrays)
    "(N, C)": ({}, (X2,), (T2,)),
    "(N, C) sum": ({"reduction": "sum"}, (X2,), (T2,)),
    "(N, C) none": ({"reduction": "none"}, (X2,), (T2,)),
    "unbatched (C,)": ({}, (X1,), (T1,)),
    "unbatched label smoothing": ({"label_smoothing": 0.3}, (X1,), (T1,)),
    "ignore_index": ({}, (X2,), (T2_IGN,)),
    "ignore_index none": ({"reduction": "none"}, (X2,), (T2_IGN,)),
    "ignore_index in range": ({"ignore_index": 2}, (X2,), (T2,)),
    "weight": ({}, (X2,), (T2, W5)),
    "weight, ignore_index": ({}, (X2,), (T2_IGN, W5)),
    "weight, ignore_index sum": ({"reduction": "sum"}, (X2,), (T2_IGN, W5)),
    "label smoothing": ({"label_smoothing": 0.1}, (X2,), (T2,)),
    "label smoothing, weight, ignore": ({"label_smoothing": 0.25}, (X2,), (T2_IGN, W5)),
    "label smoothing, weight, ignore none": ({"label_smoothing": 0.25, "reduction": "none"}, (X2,), (T2_IGN, W5)),
    "label smoothing, weight, ignore sum": ({"label_smoothing": 0.25, "reduction": "sum"}, (X2,), (T2_IGN, W5)),
    "K-dim": ({}, (X4,), (T4,)),
    "K-dim none": ({"reduction": "none"}, (X4,), (T4,)),
    "K-dim weight, label smoothing": ({"label_smoothing": 0.2}, (X4,), (T4, W4)),
    "K-dim weight, label smoothing none": ({"label_smoothing": 0.2, "reduction": "none"}, (X4,), (T4, W4)),
    "-inf logits off the target": ({"label_smoothing": 0.0}, (X2_INF,), (T2, W5)),
    "all ignored mean (NaN)": ({}, (X2,), (ALL_IGN,)),
    "all ignored, weight, smoothing (NaN)": ({"label_smoothing": 0.1}, (X2,), (ALL_IGN, W5)),
    "all ignored sum": ({"reduction": "sum"}, (X2,), (ALL_IGN,)),
    "all ignored none": ({"reduction": "none"}, (X2,), (ALL_IGN, W5)),
    "probabilities": ({}, (X2, P2), ()),
    "probabilities sum": ({"reduction": "sum"}, (X2, P2), ()),
    "probabilities, weight, smoothing": ({"label_smoothing": 0.15}, (X2, P2), (W5,)),
    "probabilities K-dim, weight none": ({"reduction": "none"}, (X4, P4), (W4,)),
    "probabilities K-dim smoothing": ({"label_smoothing": 0.3}, (X4, P4), ()),
    "probabilities unbatched": ({}, (X1, _probs(5, 0)), ()),
}


def _with_weight(f, kw):
    return lambda x, *rest: f(x, rest[0], *rest[1:], **kw) if len(rest) > 1 else f(x, rest[0], **kw)


@pytest.mark.parametrize("case", CE)
def test_cross_entropy_matches_torch(device, case):
    kw, diff, const = CE[case]
    _matches_torch(_with_weight(F.cross_entropy, kw), _with_weight(TF.cross_entropy, kw), diff, const, device)


LOGP2 = X2 - np.log(np.exp(X2).sum(1, keepdims=True))
LOGP4 = X4 - np.log(np.exp(X4).sum(1, keepdims=True))
NLL = {
    "(N, C)": ({}, (LOGP2,), (T2,)),
    "unbatched": ({}, (X1,), (T1,)),
    "weight, ignore_index": ({}, (LOGP2,), (T2_IGN, W5)),
    "weight, ignore_index none": ({"reduction": "none"}, (LOGP2,), (T2_IGN, W5)),
    "ignore_index in range sum": ({"ignore_index": 0, "reduction": "sum"}, (LOGP2,), (T2, W5)),
    "K-dim weight": ({}, (LOGP4,), (T4, W4)),
    "all ignored mean (NaN)": ({}, (LOGP2,), (ALL_IGN, W5)),
}


@pytest.mark.parametrize("case", NLL)
def test_nll_loss_matches_torch(device, case):
    kw, diff, const = NLL[case]
    _matches_torch(_with_weight(F.nll_loss, kw), _with_weight(TF.nll_loss, kw), diff, const, device)


PX = _rng.random((4, 3)) * 0.9 + 0.05
PT = _rng.random((4, 3))
LX = _rng.standard_normal((4, 3)) * 3
LX_WIDE = np.array([[-40.0, -12.0, -0.3], [0.0, 0.7, 15.0], [38.0, 2.5, -5.0], [1e-3, -1e-3, 30.0]])
BCE = {
    # name: (zyx function, torch function, kwargs, diff arrays, keyword const arrays)
    "bce": (F.binary_cross_entropy, TF.binary_cross_entropy, {}, (PX, PT), {}),
    "bce sum, weight (C,)": (F.binary_cross_entropy, TF.binary_cross_entropy, {"reduction": "sum"}, (PX, PT),
                             {"weight": _rng.random(3)}),
    "bce none, weight (N, C)": (F.binary_cross_entropy, TF.binary_cross_entropy, {"reduction": "none"}, (PX, PT),
                                {"weight": _rng.random((4, 3))}),
    "bce at 0 and 1 (clamped logs)": (F.binary_cross_entropy, TF.binary_cross_entropy, {"reduction": "none"},
                                      (np.array([0.0, 1.0, 0.0, 1.0, 1e-50, 0.5]),
                                       np.array([0.2, 0.3, 0.0, 1.0, 0.6, 0.5])), {}),
    "logits": (F.binary_cross_entropy_with_logits, TF.binary_cross_entropy_with_logits, {}, (LX, PT), {}),
    "logits wide range none": (F.binary_cross_entropy_with_logits, TF.binary_cross_entropy_with_logits,
                               {"reduction": "none"}, (LX_WIDE, PT), {}),
    "logits weight, pos_weight (C,)": (F.binary_cross_entropy_with_logits, TF.binary_cross_entropy_with_logits,
                                       {}, (LX_WIDE, PT), {"weight": _rng.random(3), "pos_weight": _rng.random(3) * 3}),
    "logits pos_weight (N, 1) sum": (F.binary_cross_entropy_with_logits, TF.binary_cross_entropy_with_logits,
                                     {"reduction": "sum"}, (LX, PT), {"pos_weight": _rng.random((4, 1)) * 3}),
    "logits pos_weight none": (F.binary_cross_entropy_with_logits, TF.binary_cross_entropy_with_logits,
                               {"reduction": "none"}, (LX, PT), {"pos_weight": _rng.random(3) * 3}),
}


@pytest.mark.parametrize("case", BCE)
def test_binary_cross_entropy_matches_torch(device, case):
    fz, ft, kw, diff, named = BCE[case]
    names = list(named)

    def call(f):
        return lambda x, t, *rest: f(x, t, **kw, **dict(zip(names, rest)))

    _matches_torch(call(fz), call(ft), diff, tuple(named.values()), device)


RA, RB = _rng.standard_normal((3, 4, 2)), _rng.standard_normal((3, 4, 2))
RB[0, 0, 0] = RA[0, 0, 0]  # a zero difference: l1's gradient there is 0
REG = {
    "mse": (F.mse_loss, TF.mse_loss, {}),
    "mse sum": (F.mse_loss, TF.mse_loss, {"reduction": "sum"}),
    "mse none": (F.mse_loss, TF.mse_loss, {"reduction": "none"}),
    "l1": (F.l1_loss, TF.l1_loss, {}),
    "l1 none": (F.l1_loss, TF.l1_loss, {"reduction": "none"}),
    "smooth_l1": (F.smooth_l1_loss, TF.smooth_l1_loss, {}),
    "smooth_l1 beta 0.4 none": (F.smooth_l1_loss, TF.smooth_l1_loss, {"beta": 0.4, "reduction": "none"}),
    "smooth_l1 beta 0 (l1) sum": (F.smooth_l1_loss, TF.smooth_l1_loss, {"beta": 0.0, "reduction": "sum"}),
    "huber": (F.huber_loss, TF.huber_loss, {}),
    "huber delta 0.6 none": (F.huber_loss, TF.huber_loss, {"delta": 0.6, "reduction": "none"}),
    "huber delta 2.5 sum": (F.huber_loss, TF.huber_loss, {"delta": 2.5, "reduction": "sum"}),
}


@pytest.mark.parametrize("case", REG)
def test_regression_losses_match_torch(device, case):
    fz, ft, kw = REG[case]
    _matches_torch(lambda a, b: fz(a, b, **kw), lambda a, b: ft(a, b, **kw), (RA, RB), (), device)


KQ = _probs((4, 5), 1)
KQ0 = KQ.copy()
KQ0[1, 2] = 0.0  # xlogy(0, 0) = 0; PyTorch's target gradient there is NaN, and so is zyx's
KL = {
    "mean": ({}, (LOGP2[:4], KQ)),
    "batchmean": ({"reduction": "batchmean"}, (LOGP2[:4], KQ)),
    "sum": ({"reduction": "sum"}, (LOGP2[:4], KQ)),
    "none, a zero target": ({"reduction": "none"}, (LOGP2[:4], KQ0)),
    "log_target batchmean": ({"reduction": "batchmean", "log_target": True}, (LOGP2[:4], np.log(KQ))),
    "log_target none": ({"reduction": "none", "log_target": True}, (LOGP2[:4], np.log(KQ))),
    "broadcast target (C,)": ({"reduction": "sum"}, (LOGP2[:4], KQ[0])),
    "batchmean 0-d": ({"reduction": "batchmean"}, (np.array(-0.7), np.array(0.4))),
}


@pytest.mark.parametrize("case", KL)
def test_kl_div_matches_torch(device, case):
    kw, diff = KL[case]
    _matches_torch(lambda a, b: F.kl_div(a, b, **kw), lambda a, b: TF.kl_div(a, b, **kw), diff, (), device)


MODULES = {
    "CrossEntropyLoss": (dict(weight=W5, ignore_index=1, reduction="sum", label_smoothing=0.2), (X2,), (T2,)),
    "NLLLoss": (dict(weight=W5, reduction="none"), (LOGP2,), (T2_IGN,)),
    "MSELoss": (dict(reduction="sum"), (RA, RB), ()),
    "L1Loss": ({}, (RA, RB), ()),
    "SmoothL1Loss": (dict(beta=0.5), (RA, RB), ()),
    "HuberLoss": (dict(delta=0.5, reduction="none"), (RA, RB), ()),
    "BCELoss": (dict(weight=_rng.random(3)), (PX, PT), ()),
    "BCEWithLogitsLoss": (dict(weight=_rng.random(3), pos_weight=_rng.random(3) + 0.5), (LX, PT), ()),
    "KLDivLoss": (dict(reduction="batchmean", log_target=True), (LOGP2, LOGP2[::-1].copy()), ()),
}


@pytest.mark.parametrize("name", MODULES)
def test_loss_modules_match_torch(device, name):
    kw, diff, const = MODULES[name]
    tensors = {"weight", "pos_weight"}
    mz = getattr(nn, name)(**{k: zyx.Tensor(v, device=device) if k in tensors else v for k, v in kw.items()})
    mt = getattr(torch.nn, name)(**{k: torch.tensor(v) if k in tensors else v for k, v in kw.items()})
    assert isinstance(mz, nn.Module) and mz.parameters() == []
    assert sorted(mz.state_dict()) == sorted(k for k in mt.state_dict() if k in tensors)  # the weights, as buffers
    _matches_torch(lambda *a: mz(*a), lambda *a: mt(*a), diff, const, device)


def test_plain_cross_entropy_keeps_its_float32_values():
    """(N, C) class indices, no options: per-sample losses are the old one-hot formula's bits; their sum is a float32
    sum of those values (fused into the loss kernel it adds them in order, a sum of the stored losses may take
    vector lanes: on an AVX2 host the two differ by 2 ulp), within the rounding bound of a 37-term sum; the mean
    divides that sum by the count (as PyTorch), one more rounding."""
    rng = np.random.default_rng(5)
    logits = zyx.Tensor(rng.standard_normal((37, 10)).astype(np.float32))
    target = zyx.Tensor(rng.integers(0, 10, 37))
    old = -(logits.log_softmax(-1) * F.one_hot(target, 10, logits.dtype)).sum(-1)
    losses = old.numpy()
    np.testing.assert_array_equal(F.cross_entropy(logits, target, reduction="none").numpy(), losses)
    exact = losses.astype(np.float64).sum()
    bound = 37 * 2.0**-24 * np.abs(losses).astype(np.float64).sum()
    for total in (F.cross_entropy(logits, target, reduction="sum"), old.sum()):
        assert total.dtype == zyx.float32 and abs(float(total.numpy()) - exact) <= bound
    mean = F.cross_entropy(logits, target)
    assert mean.dtype == zyx.float32
    assert abs(float(mean.numpy()) - exact / 37) <= (bound + 2.0**-24 * exact) / 37


def test_loss_errors_name_the_shapes_and_options():
    x, t = zyx.randn(4, 3), zyx.Tensor(np.array([0, 1, 2, 0]))
    with pytest.raises(ValueError, match=r"logits must be .*\(4, 3\).*\(3,\)"):
        F.cross_entropy(x, t[:3])
    with pytest.raises(ValueError, match=r"input must be .*\(4, 3\).*\(4, 1\)"):
        F.nll_loss(x, t.reshape(4, 1))
    with pytest.raises(TypeError, match="must be integer"):
        F.cross_entropy(x, zyx.randn(4))
    with pytest.raises(TypeError, match="must be float"):
        F.cross_entropy(x, zyx.Tensor(np.zeros((4, 3), np.int64)))
    with pytest.raises(ValueError, match=r"weight must have shape \(3,\).*\(4, 3\).*\(4,\)"):
        F.cross_entropy(x, t, weight=zyx.ones(4))
    with pytest.raises(TypeError, match="reduction='sum' by name"):
        F.cross_entropy(x, t, "sum")
    with pytest.raises(IndexError, match=r"cross_entropy: target class 3 is outside \[0, 3\)"):
        F.cross_entropy(x, zyx.Tensor(np.array([0, 3, -100, 1])))  # host data: checked when built
    with pytest.raises(IndexError, match=r"nll_loss: target class -1 is outside \[0, 3\).*ignore_index=-100"):
        F.nll_loss(x, zyx.Tensor(np.array([0, -1, 2, 1])))
    F.cross_entropy(x, zyx.Tensor(np.array([0, 9, 2, 1])), ignore_index=9).realize()  # ignored: allowed
    with pytest.raises(ValueError, match="label_smoothing"):
        F.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match=r"reduction must be 'none', 'mean' or 'sum', got 'avg'"):
        F.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match=r"'none', 'batchmean', 'mean' or 'sum', got 'max'"):
        F.kl_div(x, x, reduction="max")
    with pytest.raises(ValueError, match=r"reduction must be"):
        nn.MSELoss(reduction="batchmean")
    for f in (F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.binary_cross_entropy, F.binary_cross_entropy_with_logits):
        with pytest.raises(ValueError, match=r"\(4, 3\).*\(3,\)"):
            f(x, x[0])
    with pytest.raises(ValueError, match=r"shapes \(4, 3\) and \(4, 1\) differ"):
        F.mse_loss(x, x[:, :1])
    with pytest.raises(ValueError, match=r"pos_weight of shape \(2,\) does not broadcast to .*\(4, 3\)"):
        F.binary_cross_entropy_with_logits(x, x, pos_weight=zyx.ones(2))
    with pytest.raises(ValueError, match=r"weight of shape \(4, 3, 1\) does not broadcast"):
        F.binary_cross_entropy(x.sigmoid(), x.sigmoid(), weight=zyx.ones(4, 3, 1))
    with pytest.raises(ValueError, match=r"\(4, 3\) and target of shape \(2,\) do not broadcast"):
        F.kl_div(x, zyx.ones(2))
    with pytest.raises(ValueError, match="beta"):
        F.smooth_l1_loss(x, x, beta=-1.0)
    with pytest.raises(ValueError, match="delta"):
        nn.HuberLoss(delta=0.0)


def test_cross_entropy_trains_under_jit_with_ignored_targets():
    """The loss stays one lazy graph: a jitted step with ignore_index and weights replays and matches eager."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 5)).astype(np.float32)
    y = rng.integers(0, 5, 8)
    y[2] = -1
    w = zyx.Tensor(rng.random(5).astype(np.float32))

    @zyx.jit
    def step(a, b):
        return F.cross_entropy(a, b, weight=w, ignore_index=-1, label_smoothing=0.1)

    eager = F.cross_entropy(zyx.Tensor(x), zyx.Tensor(y), weight=w, ignore_index=-1, label_smoothing=0.1).item()
    want = TF.cross_entropy(torch.tensor(x), torch.tensor(y), weight=torch.tensor(w.numpy()), ignore_index=-1,
                            label_smoothing=0.1).item()
    for _ in range(3):
        np.testing.assert_allclose(step(zyx.Tensor(x), zyx.Tensor(y)).item(), eager, rtol=1e-6)
    np.testing.assert_allclose(eager, want, rtol=1e-5)

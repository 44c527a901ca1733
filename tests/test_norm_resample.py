"""Group/RMS normalization, normalize, cosine_similarity, interpolate and the small layers (activations,
containers, Upsample) against PyTorch: values and float64 gradients on every device."""

from __future__ import annotations

import numpy as np
import pytest
from torch_parity import layer_matches_torch, matches_torch

import zyx
from zyx import nn
from zyx.nn import functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional


_rng = np.random.default_rng(0)
X = _rng.standard_normal((2, 6, 5, 7))
X3 = _rng.standard_normal((2, 3, 9))
X5 = _rng.standard_normal((1, 2, 3, 4, 5))
C6 = _rng.standard_normal(6)

CASES = {
    "group_norm affine": (lambda x, w, b: F.group_norm(x, 3, w, b), lambda x, w, b: TF.group_norm(x, 3, w, b),
                          (X, C6, _rng.standard_normal(6))),
    "group_norm one group, eps": (lambda x: F.group_norm(x, 1, eps=1e-3), lambda x: TF.group_norm(x, 1, eps=1e-3),
                                  (X3[:, :2],)),
    "rms_norm weight": (lambda x, w: F.rms_norm(x, (5, 7), w), lambda x, w: TF.rms_norm(x, (5, 7), w),
                        (X, _rng.standard_normal((5, 7)))),
    "rms_norm default eps": (lambda x: F.rms_norm(x, 9), lambda x: TF.rms_norm(x, (9,)), (X3,)),
    "normalize": (lambda x: F.normalize(x), lambda x: TF.normalize(x), (X,)),
    "normalize p 1 dim -1": (lambda x: F.normalize(x, 1, -1), lambda x: TF.normalize(x, 1, -1), (X3,)),
    "cosine_similarity broadcast": (lambda a, b: F.cosine_similarity(a, b), lambda a, b: TF.cosine_similarity(a, b),
                                    (X, _rng.standard_normal((2, 6, 1, 7)))),
    "nearest size": (lambda x: F.interpolate(x, size=(10, 3)), lambda x: TF.interpolate(x, size=(10, 3)), (X,)),
    "nearest scale": (lambda x: F.interpolate(x, scale_factor=1.7), lambda x: TF.interpolate(x, scale_factor=1.7),
                      (X,)),
    "nearest-exact": (lambda x: F.interpolate(x, scale_factor=(0.5, 2.5), mode="nearest-exact"),
                      lambda x: TF.interpolate(x, scale_factor=(0.5, 2.5), mode="nearest-exact"), (X,)),
    "nearest 1d": (lambda x: F.interpolate(x, size=4), lambda x: TF.interpolate(x, size=4), (X3,)),
    "bilinear": (lambda x: F.interpolate(x, size=(10, 13), mode="bilinear"),
                 lambda x: TF.interpolate(x, size=(10, 13), mode="bilinear"), (X,)),
    "bilinear align_corners": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True),
                               lambda x: TF.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True), (X,)),
    "bilinear down, recompute": (
        lambda x: F.interpolate(x, scale_factor=0.6, mode="bilinear", recompute_scale_factor=True),
        lambda x: TF.interpolate(x, scale_factor=0.6, mode="bilinear", recompute_scale_factor=True), (X,)),
    "linear": (lambda x: F.interpolate(x, size=13, mode="linear"),
               lambda x: TF.interpolate(x, size=13, mode="linear"), (X3,)),
    "trilinear": (lambda x: F.interpolate(x, scale_factor=2, mode="trilinear"),
                  lambda x: TF.interpolate(x, scale_factor=2, mode="trilinear"), (X5,)),
    # bicubic: source positions below 0 and rows past both edges (clamped), up and down, both corner rules
    "bicubic": (lambda x: F.interpolate(x, size=(10, 13), mode="bicubic"),
                lambda x: TF.interpolate(x, size=(10, 13), mode="bicubic"), (X,)),
    "bicubic align_corners": (lambda x: F.interpolate(x, scale_factor=2.5, mode="bicubic", align_corners=True),
                              lambda x: TF.interpolate(x, scale_factor=2.5, mode="bicubic", align_corners=True),
                              (X,)),
    "bicubic down": (lambda x: F.interpolate(x, scale_factor=(0.5, 0.7), mode="bicubic"),
                     lambda x: TF.interpolate(x, scale_factor=(0.5, 0.7), mode="bicubic"), (X,)),
    "pad, crop": (lambda x: F.pad(x, (1, 2, -1, 0), value=0.5), lambda x: TF.pad(x, (1, 2, -1, 0), value=0.5), (X,)),
    "activations": (lambda x: F.softplus(F.leaky_relu(F.tanh(F.sigmoid(F.silu(F.relu(x) - 0.3))), 0.2), 2.0),
                    lambda x: TF.softplus(TF.leaky_relu(torch.tanh(torch.sigmoid(TF.silu(TF.relu(x) - 0.3))), 0.2),
                                          2.0), (X,)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_functions_match_torch(device, case):
    fz, ft, arrays = CASES[case]
    matches_torch(fz, ft, arrays, device)


def test_float32_bilinear_is_pytorchs_within_rounding_and_nearest_exactly(device):
    x = X.astype(np.float32)
    got = F.interpolate(zyx.Tensor(x, device=device), scale_factor=1.5, mode="bilinear").numpy()
    np.testing.assert_allclose(got, TF.interpolate(torch.tensor(x), scale_factor=1.5, mode="bilinear").numpy(),
                               rtol=0, atol=1e-6)
    got = F.interpolate(zyx.Tensor(x, device=device), size=(11, 4)).numpy()
    np.testing.assert_array_equal(got, TF.interpolate(torch.tensor(x), size=(11, 4)).numpy())
    got = F.interpolate(zyx.Tensor(x, device=device), scale_factor=1.5, mode="bicubic").numpy()
    np.testing.assert_allclose(got, TF.interpolate(torch.tensor(x), scale_factor=1.5, mode="bicubic").numpy(),
                               rtol=0, atol=2e-6)


@pytest.mark.parametrize("layer, shape", [
    (lambda m: m.GroupNorm(2, 6), (2, 6, 5)),
    (lambda m: m.GroupNorm(3, 6, affine=False), (2, 6, 3, 4)),
    (lambda m: m.RMSNorm(7), (2, 6, 5, 7)),
    (lambda m: m.RMSNorm((5, 7), eps=1e-4, elementwise_affine=False), (2, 6, 5, 7)),
    (lambda m: m.Upsample(scale_factor=2, mode="bilinear"), (2, 6, 5, 7)),
    (lambda m: m.Upsample(size=(3, 9)), (2, 6, 5, 7)),
    (lambda m: m.Sequential(m.Identity(7, unused=True), m.SiLU(), m.Sigmoid(), m.Tanh()), (2, 7)),
    (lambda m: m.Sequential(m.LeakyReLU(0.2), m.Softplus(2.0, 3.0), m.Softmax(1)), (3, 7)),
    (lambda m: m.LogSoftmax(0), (3, 7)),
])
def test_layers_match_torch_with_copied_parameters(device, layer, shape):
    layer_matches_torch(layer(nn), layer(torch.nn).double(), shape, device, perturb=True)


def test_containers_name_parameters_as_pytorch():
    def build(m):
        return m.ModuleDict({"enc": m.ModuleList([m.Linear(2, 3), m.GroupNorm(1, 3)]), "head": m.Linear(3, 1)})

    z, t = build(nn), build(torch.nn)
    assert list(z.state_dict()) == list(t.state_dict())
    assert len(z.parameters()) == 6 and len(z["enc"]) == 2 and "head" in z and list(z) == ["enc", "head"]
    z["enc"].append(nn.Linear(3, 3))
    assert [n for n, _ in z.named_parameters()][4:6] == ["enc.2.weight", "enc.2.bias"]
    assert len(z["enc"][1:]) == 2


def test_errors_name_the_problem():
    x = zyx.Tensor(np.zeros((2, 6, 5, 7)))
    with pytest.raises(ValueError, match=r"group_norm: input of shape \(2, 6, 5, 7\) needs .* divisible by "
                                         r"num_groups 4"):
        F.group_norm(x, 4)
    with pytest.raises(ValueError, match=r"rms_norm: input shape \(2, 6, 5, 7\) does not end with \(5,\)"):
        F.rms_norm(x, 5)
    with pytest.raises(NotImplementedError, match="mode 'area' is not supported"):
        F.interpolate(x, scale_factor=2, mode="area")
    with pytest.raises(ValueError, match="mode 'bicubic' needs an input of rank 4"):
        F.interpolate(zyx.Tensor(np.zeros((2, 3, 4))), scale_factor=2, mode="bicubic")
    with pytest.raises(ValueError, match="mode 'trilinear' needs an input of rank 5"):
        F.interpolate(x, scale_factor=2, mode="trilinear")
    with pytest.raises(ValueError, match="give exactly one of size and scale_factor"):
        F.interpolate(x)
    with pytest.raises(ValueError, match="align_corners only applies to the linear and cubic modes"):
        F.interpolate(x, scale_factor=2, align_corners=True)
    with pytest.raises(NotImplementedError, match="pad: mode 'reflect' is not supported"):
        F.pad(x, (1, 1), mode="reflect")


@pytest.mark.parametrize("mode", ["nearest", "nearest-exact"])
@pytest.mark.parametrize("size,factor", [(7, 2.0), (5, 3.0), (16, 4.0), (12, 0.5), (9, 1 / 3), (10, 0.25),
                                         (6, 1.7), (100, 2.0), (64, 0.5)])
def test_nearest_integer_scales_take_integer_indices(mode, size, factor):
    """Nearest resampling by an integer factor (up or down) computes PyTorch's indices exactly in integer
    arithmetic (``i // f`` or ``i * d + c``, checked against the float formula per output position): the values
    equal torch's, and the gather stays affine (no float position per element); other factors keep the float
    formula."""
    from zyx.nn import resample

    x = np.arange(2 * 3 * size * size, dtype=np.float32).reshape(2, 3, size, size)
    got = F.interpolate(zyx.Tensor(x), scale_factor=factor, mode=mode).numpy()
    want = TF.interpolate(torch.from_numpy(x), scale_factor=factor, mode=mode).numpy()
    np.testing.assert_array_equal(got, want)
    o = int(np.floor(size * factor))
    step = resample._integer_step(size, o, 1.0 / factor, mode == "nearest-exact", "float32")
    assert (step is None) == (factor == 1.7), (size, o, step)


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("size,out,align_corners", [(8, 16, False), (8, 16, True), (7, 21, False), (12, 6, False),
                                                    (10, 17, False), (10, 17, True), (100, 173, True)])
def test_linear_and_cubic_source_rows_in_integer_arithmetic(monkeypatch, mode, size, out, align_corners):
    """Linear and cubic resampling take the floor of each source position as ``(i * mul + add) // div`` (the exact
    fraction's floor, checked against PyTorch's float formula per output position) and give bit for bit the values
    of the float formula's conversion; where float rounding lands below an exact integer (100 -> 173 with corners
    aligned: the last row, 172 * float32(99 / 172), is 98.99999) the formula is refused and the float path runs."""
    from zyx.nn import resample

    x = _rng.standard_normal((1, 2, size, size)).astype(np.float32)

    def run():
        return F.interpolate(zyx.Tensor(x), size=(out, out), mode=mode, align_corners=align_corners).numpy()

    rational = resample._rational_floor(size, out, resample._scale(size, out, None, align_corners), align_corners,
                                        "float32")
    assert (rational is None) == (size == 100), rational
    got = run()
    monkeypatch.setattr(resample, "_rational_floor", lambda *a: None)
    np.testing.assert_array_equal(got, run())
    want = TF.interpolate(torch.from_numpy(x), size=(out, out), mode=mode, align_corners=align_corners).numpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-6)

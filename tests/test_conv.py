"""Convolution, pooling and batch normalization against PyTorch: values and float64 gradients on every device,
layers with copied weights, schedules (im2col into one GEMM, a pooling in one kernel), training under zyx.jit,
and the errors."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from torch_parity import layer_matches_torch, matches_torch

import zyx
from zyx import nn
from zyx.nn import functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional


_rng = np.random.default_rng(0)
X4 = _rng.standard_normal((2, 4, 9, 8))
W4 = _rng.standard_normal((6, 4, 3, 3))
CONV_CASES = {
    "plain, bias": (lambda x, w, b: F.conv2d(x, w, b), lambda x, w, b: TF.conv2d(x, w, b),
                    (X4, W4, _rng.standard_normal(6))),
    "stride 2, padding 1, dilation 2": (lambda x, w: F.conv2d(x, w, stride=2, padding=1, dilation=2),
                                        lambda x, w: TF.conv2d(x, w, stride=2, padding=1, dilation=2), (X4, W4)),
    "groups 2, per-axis stride and padding": (
        lambda x, w: F.conv2d(x, w, stride=(2, 1), padding=(1, 0), groups=2),
        lambda x, w: TF.conv2d(x, w, stride=(2, 1), padding=(1, 0), groups=2),
        (X4, _rng.standard_normal((6, 2, 3, 2)))),
    "padding same, dilation (1, 2)": (lambda x, w: F.conv2d(x, w, padding="same", dilation=(1, 2)),
                                      lambda x, w: TF.conv2d(x, w, padding="same", dilation=(1, 2)), (X4, W4)),
    "depthwise": (lambda x, w: F.conv2d(x, w, groups=4, padding=1), lambda x, w: TF.conv2d(x, w, groups=4, padding=1),
                  (X4, _rng.standard_normal((4, 1, 3, 3)))),
    "unbatched": (lambda x, w: F.conv2d(x, w), lambda x, w: TF.conv2d(x, w), (X4[0], W4)),
    "conv1d": (lambda x, w: F.conv1d(x, w, stride=2, padding=2), lambda x, w: TF.conv1d(x, w, stride=2, padding=2),
               (_rng.standard_normal((3, 4, 11)), _rng.standard_normal((5, 4, 4)))),
    "conv3d": (lambda x, w: F.conv3d(x, w, padding=1), lambda x, w: TF.conv3d(x, w, padding=1),
               (_rng.standard_normal((1, 2, 4, 5, 3)), _rng.standard_normal((3, 2, 2, 3, 2)))),
    "max_pool2d 2": (lambda x: F.max_pool2d(x, 2), lambda x: TF.max_pool2d(x, 2), (X4,)),
    "max_pool2d 3, stride 2, padding 1": (lambda x: F.max_pool2d(x, 3, 2, 1), lambda x: TF.max_pool2d(x, 3, 2, 1),
                                          (X4,)),
    "max_pool2d dilation 2": (lambda x: F.max_pool2d(x, (2, 3), (1, 2), (1, 1), 2),
                              lambda x: TF.max_pool2d(x, (2, 3), (1, 2), (1, 1), 2), (X4,)),
    "max_pool1d": (lambda x: F.max_pool1d(x, 3, 1, 1), lambda x: TF.max_pool1d(x, 3, 1, 1),
                   (_rng.standard_normal((2, 3, 10)),)),
    "avg_pool2d 3, stride 2, padding 1": (lambda x: F.avg_pool2d(x, 3, 2, 1), lambda x: TF.avg_pool2d(x, 3, 2, 1),
                                          (X4,)),
    "avg_pool2d without padding counts": (lambda x: F.avg_pool2d(x, 3, 2, 1, count_include_pad=False),
                                          lambda x: TF.avg_pool2d(x, 3, 2, 1, count_include_pad=False), (X4,)),
    "avg_pool2d divisor_override": (lambda x: F.avg_pool2d(x, 2, divisor_override=3),
                                    lambda x: TF.avg_pool2d(x, 2, divisor_override=3), (X4,)),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 4, 3), lambda x: TF.avg_pool1d(x, 4, 3),
                   (_rng.standard_normal((2, 3, 10)),)),
    "adaptive_avg_pool2d (3, 4)": (lambda x: F.adaptive_avg_pool2d(x, (3, 4)),
                                   lambda x: TF.adaptive_avg_pool2d(x, (3, 4)), (X4,)),
    "adaptive_avg_pool2d 1": (lambda x: F.adaptive_avg_pool2d(x, 1), lambda x: TF.adaptive_avg_pool2d(x, 1),
                              (X4,)),
    # uneven windows (PyTorch's [floor(i n / o), ceil((i + 1) n / o)), overlapping where o does not divide n)
    "adaptive_avg_pool2d uneven (3, None)": (lambda x: F.adaptive_avg_pool2d(x, (3, None)),
                                             lambda x: TF.adaptive_avg_pool2d(x, (3, None)), (X4,)),
    "adaptive_avg_pool2d uneven (5, 7)": (lambda x: F.adaptive_avg_pool2d(x, (5, 7)),
                                          lambda x: TF.adaptive_avg_pool2d(x, (5, 7)), (X4,)),
    "adaptive_avg_pool2d upsampling 12": (lambda x: F.adaptive_avg_pool2d(x, 12),
                                          lambda x: TF.adaptive_avg_pool2d(x, 12), (X4,)),
    "adaptive_max_pool2d uneven (4, 3)": (lambda x: F.adaptive_max_pool2d(x, (4, 3)),
                                          lambda x: TF.adaptive_max_pool2d(x, (4, 3)), (X4,)),
    "adaptive_avg_pool1d 4 of 10": (lambda x: F.adaptive_avg_pool1d(x, 4), lambda x: TF.adaptive_avg_pool1d(x, 4),
                                    (_rng.standard_normal((2, 3, 10)),)),
    "adaptive_max_pool1d 3 of 10, unbatched": (lambda x: F.adaptive_max_pool1d(x, 3),
                                               lambda x: TF.adaptive_max_pool1d(x, 3),
                                               (_rng.standard_normal((3, 10)),)),
    "adaptive_avg_pool3d (2, 3, 4)": (lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4)),
                                      lambda x: TF.adaptive_avg_pool3d(x, (2, 3, 4)),
                                      (_rng.standard_normal((1, 2, 5, 7, 6)),)),
    "adaptive_max_pool3d (3, 2, 5)": (lambda x: F.adaptive_max_pool3d(x, (3, 2, 5)),
                                      lambda x: TF.adaptive_max_pool3d(x, (3, 2, 5)),
                                      (_rng.standard_normal((1, 2, 5, 7, 6)),)),
    # ceil_mode: a last, partial window (9 and 8 by 3, stride 2, padding 1: 5 and 5 windows, not 4 and 4)
    "max_pool2d ceil_mode": (lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True),
                             lambda x: TF.max_pool2d(x, 3, 2, 1, ceil_mode=True), (X4,)),
    "max_pool2d ceil_mode, no padding": (lambda x: F.max_pool2d(x, 2, ceil_mode=True),
                                         lambda x: TF.max_pool2d(x, 2, ceil_mode=True), (X4[:, :, :7, :5],)),
    "avg_pool2d ceil_mode": (lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
                             lambda x: TF.avg_pool2d(x, 3, 2, 1, ceil_mode=True), (X4,)),
    "avg_pool2d ceil_mode without padding counts": (
        lambda x: F.avg_pool2d(x, (3, 2), (2, 3), (1, 0), ceil_mode=True, count_include_pad=False),
        lambda x: TF.avg_pool2d(x, (3, 2), (2, 3), (1, 0), ceil_mode=True, count_include_pad=False), (X4,)),
    "avg_pool1d ceil_mode": (lambda x: F.avg_pool1d(x, 4, 3, 2, ceil_mode=True),
                             lambda x: TF.avg_pool1d(x, 4, 3, 2, ceil_mode=True), (_rng.standard_normal((2, 3, 10)),)),
    # ties: PyTorch routes a window's gradient to its first maximal element (its argmax), not shared among ties
    "max_pool2d of ties": (lambda x: F.max_pool2d(x, 3, 1, 1), lambda x: TF.max_pool2d(x, 3, 1, 1),
                           (np.round(X4),)),
    "max_pool1d of ties, ceil_mode": (lambda x: F.max_pool1d(x, 2, 2, ceil_mode=True),
                                      lambda x: TF.max_pool1d(x, 2, 2, ceil_mode=True),
                                      (np.array([[[1.0, 1.0, 0.0, 2.0, 2.0, -1.0, 3.0]]]),)),
    "adaptive_max_pool2d of ties, overlapping windows": (lambda x: F.adaptive_max_pool2d(x, (4, 3)),
                                                         lambda x: TF.adaptive_max_pool2d(x, (4, 3)), (np.round(X4),)),
    "conv_transpose2d, bias": (lambda x, w, b: F.conv_transpose2d(x, w, b),
                               lambda x, w, b: TF.conv_transpose2d(x, w, b),
                               (X4, _rng.standard_normal((4, 3, 3, 3)), _rng.standard_normal(3))),
    "conv_transpose2d stride 2, padding 1, output_padding 1": (
        lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1),
        lambda x, w: TF.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1),
        (X4, _rng.standard_normal((4, 2, 4, 4)))),
    "conv_transpose2d groups 2, dilation (1, 2), per-axis stride": (
        lambda x, w: F.conv_transpose2d(x, w, stride=(3, 2), padding=(0, 2), groups=2, dilation=(1, 2)),
        lambda x, w: TF.conv_transpose2d(x, w, stride=(3, 2), padding=(0, 2), groups=2, dilation=(1, 2)),
        (X4, _rng.standard_normal((4, 3, 2, 3)))),
    "conv_transpose2d output_padding beyond padding": (
        lambda x, w: F.conv_transpose2d(x, w, stride=3, output_padding=2),
        lambda x, w: TF.conv_transpose2d(x, w, stride=3, output_padding=2),
        (X4[:1], _rng.standard_normal((4, 1, 2, 2)))),
    "conv_transpose2d unbatched": (lambda x, w: F.conv_transpose2d(x, w, stride=2),
                                   lambda x, w: TF.conv_transpose2d(x, w, stride=2),
                                   (X4[0], _rng.standard_normal((4, 2, 3, 3)))),
    "conv_transpose1d": (lambda x, w: F.conv_transpose1d(x, w, stride=3, padding=1),
                         lambda x, w: TF.conv_transpose1d(x, w, stride=3, padding=1),
                         (_rng.standard_normal((2, 3, 7)), _rng.standard_normal((3, 5, 4)))),
    "conv_transpose3d": (lambda x, w: F.conv_transpose3d(x, w, stride=2, padding=(1, 0, 0)),
                         lambda x, w: TF.conv_transpose3d(x, w, stride=2, padding=(1, 0, 0)),
                         (_rng.standard_normal((1, 2, 3, 4, 2)), _rng.standard_normal((2, 3, 2, 3, 2)))),
}


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conv_and_pool_match_torch(device, case):
    fz, ft, arrays = CONV_CASES[case]
    matches_torch(fz, ft, arrays, device)


def test_conv2d_is_one_generated_gemm_and_a_pool_one_kernel():
    """The generated GEMM packs its panels from the padded input itself; BLAS needs the im2col columns copied out
    first (two passes over 9x the input). Extraction counts a generated contraction at the host's
    ``contraction_gflops`` (BLAS's rate) and the library's copy, so a convolution is one generated kernel, with few
    filters or many (32 -> 64 channels, batch 32 of 32^2: 4.6-6.5 ms generated, 8.3-11.9 through BLAS)."""
    x = zyx.Tensor(np.ones((2, 3, 8, 8), np.float32)).realize()
    for filters in (4, 256):
        w = zyx.Tensor(np.ones((filters, 3, 3, 3), np.float32)).realize()
        assert [launch.kind for launch in zyx.debug.schedule(F.conv2d(x, w, padding=1))] == ["generated"], filters
    assert len(zyx.debug.schedule(F.max_pool2d(x, 3, 2, 1))) == 1


def test_conv2d_through_blas_is_the_columns_then_one_gemm(libraries_first):
    x = zyx.Tensor(np.ones((2, 3, 8, 8), np.float32)).realize()
    w = zyx.Tensor(np.ones((4, 3, 3, 3), np.float32)).realize()
    kinds = [launch.kind for launch in zyx.debug.schedule(F.conv2d(x, w, padding=1))]
    assert kinds == ["generated", "library"], kinds  # the columns, then the GEMM writes the output's layout


def test_depthwise_conv2d_reads_its_input_in_place():
    """A depthwise convolution's GEMM has one row per group, so each im2col column element is used once: copying
    the columns out for BLAS (9x the input) costs more than the generated sum of products, which reads the input
    in place. Extraction counts a library input's copy (``extract._copy_ns``); it once chose BLAS here, 31 ms
    for 32x128x56^2 where the generated kernel takes 2-3 ms."""
    x = zyx.Tensor(np.ones((2, 8, 16, 16), np.float32)).realize()
    w = zyx.Tensor(np.ones((8, 1, 3, 3), np.float32)).realize()
    kinds = [launch.kind for launch in zyx.debug.schedule(F.conv2d(x, w, padding=1, groups=8))]
    assert kinds == ["generated"], kinds


def test_weight_gradient_of_a_sum_loss_is_not_a_materialized_product():
    """``conv(x, w).sum().backward()``: the ones-gradient is a broadcast constant, not a dense operand (the
    matcher once read it as an m * n * k buffer and ran a batch of GEMVs over it)."""
    x = zyx.Tensor(np.ones((2, 3, 8, 8), np.float32), requires_grad=True).realize()
    w = zyx.Tensor(np.ones((4, 3, 3, 3), np.float32), requires_grad=True).realize()
    F.conv2d(x, w, padding=1).sum().backward()
    columns = 2 * 27 * 64  # (n, c * k, positions): the largest buffer a sane schedule writes
    for launch in zyx.debug.schedule(x.grad, w.grad):
        dims = [int(d) for d in re.findall(r"_(\d+)(?=_)", launch.name)]  # a kernel's name holds its output shape
        assert math.prod(dims) <= columns and "x1x" not in launch.name, launch  # no (n, positions, k, o) product
    np.testing.assert_allclose(w.grad.numpy()[0, 0], 2 * np.array([[49, 56, 49], [56, 64, 56], [49, 56, 49]]))


@pytest.mark.parametrize("layer, shape", [
    (lambda m: m.Conv2d(3, 4, 3, stride=2, padding=1, groups=1), (2, 3, 7, 6)),
    (lambda m: m.Conv1d(4, 6, 2, dilation=2, groups=2, bias=False), (3, 4, 9)),
    (lambda m: m.MaxPool2d(2), (2, 3, 6, 6)),
    (lambda m: m.AvgPool2d(3, 1, 1), (2, 3, 6, 6)),
    (lambda m: m.AdaptiveAvgPool2d((1, 1)), (2, 3, 6, 6)),
    (lambda m: m.AdaptiveAvgPool2d((4, 5)), (2, 3, 7, 6)),
    (lambda m: m.AdaptiveMaxPool2d(4), (2, 3, 7, 6)),
    (lambda m: m.AdaptiveAvgPool1d(3), (2, 3, 7)),
    (lambda m: m.AdaptiveMaxPool3d((2, 3, 2)), (1, 2, 3, 5, 4)),
    (lambda m: m.Flatten(), (2, 3, 4)),
    (lambda m: m.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2), (2, 4, 5, 6)),
    (lambda m: m.ConvTranspose1d(3, 2, 4, dilation=2, bias=False), (2, 3, 7)),
    (lambda m: m.MaxPool1d(3, 2, 1, ceil_mode=True), (2, 3, 10)),
    (lambda m: m.AvgPool1d(3, 2, 1, ceil_mode=True, count_include_pad=False), (2, 3, 10)),
    (lambda m: m.MaxPool2d(3, 2, ceil_mode=True), (2, 3, 8, 8)),
])
def test_layers_match_torch_with_copied_parameters(device, layer, shape):
    layer_matches_torch(layer(nn), layer(torch.nn).double(), shape, device)


@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (8, 3), (8, 3, 7)])
def test_batch_norm_matches_torch_in_training_and_evaluation(device, shape):
    rng = np.random.default_rng(2)
    z = (nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d)(3)
    t = (torch.nn.BatchNorm2d if len(shape) == 4 else torch.nn.BatchNorm1d)(3).double()
    z.load_state_dict({"weight": rng.standard_normal(3), "bias": rng.standard_normal(3), "running_mean": np.zeros(3),
                       "running_var": np.ones(3), "num_batches_tracked": np.array(0)})
    z.to(device)
    with torch.no_grad():
        t.weight.copy_(torch.tensor(z.weight.numpy()))
        t.bias.copy_(torch.tensor(z.bias.numpy()))
    for _ in range(3):
        x = rng.standard_normal(shape) * 2 + 1
        matches_torch(lambda v: z(v), lambda v: t(v), [x], device)
    # zyx keeps the running statistics in float32 (the default float), PyTorch's .double() in float64
    np.testing.assert_allclose(z.running_mean.numpy(), t.running_mean.numpy(), rtol=1e-6)
    np.testing.assert_allclose(z.running_var.numpy(), t.running_var.numpy(), rtol=1e-6)
    assert int(z.num_batches_tracked.item()) == 3
    z.eval()
    t.eval()
    x = rng.standard_normal(shape)
    np.testing.assert_allclose(z(zyx.Tensor(x, device=device)).numpy(), t(torch.tensor(x)).detach().numpy(),
                               rtol=1e-6, atol=1e-6)


def test_a_small_cnn_trains_under_jit(device):
    """Conv, batch norm, pooling and a linear head learn to tell two stripe orientations apart; the jitted step
    replays (batch norm's running statistics are rebound on every replay)."""
    zyx.manual_seed(0)
    rng = np.random.default_rng(3)
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(4, 2)).to(device)
    opt = zyx.optim.Adam(model.parameters(), lr=0.05)

    def batch():
        labels = rng.integers(0, 2, 16)
        images = rng.standard_normal((16, 1, 8, 8)).astype(np.float32) * 0.3
        stripes = (np.arange(8) % 2).astype(np.float32)
        images += np.where(labels[:, None, None, None] == 0, stripes[None, None, :, None],
                           stripes[None, None, None, :])
        return zyx.Tensor(images, device=device), zyx.Tensor(labels, device=device)

    @zyx.jit
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step(loss)
        return loss

    losses = [step(*batch()).item() for _ in range(40)]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    assert int(model[1].num_batches_tracked.item()) == 40
    model.eval()
    x, y = batch()
    assert (model(x).argmax(-1).numpy() == y.numpy()).mean() >= 0.9


def test_conv_errors_name_the_problem():
    x = zyx.Tensor(np.zeros((2, 4, 5, 5), np.float32))
    with pytest.raises(ValueError, match=r"input of shape \(2, 4, 5, 5\) \(4 channels\) and weight of shape "
                                         r"\(6, 3, 3, 3\) do not match with groups=1"):
        F.conv2d(x, zyx.Tensor(np.zeros((6, 3, 3, 3), np.float32)))
    with pytest.raises(ValueError, match=r"expected an input of shape \(N, C, \*spatial\).*got shape \(5, 5\)"):
        F.conv2d(zyx.Tensor(np.zeros((5, 5), np.float32)), zyx.Tensor(np.zeros((1, 1, 3, 3), np.float32)))
    with pytest.raises(ValueError, match="a window of 7 .* does not fit spatial size 5"):
        F.max_pool2d(x, 7)
    with pytest.raises(ValueError, match="padding='same' needs stride 1"):
        F.conv2d(x, zyx.Tensor(np.zeros((6, 4, 3, 3), np.float32)), stride=2, padding="same")
    with pytest.raises(ValueError, match=r"weight of shape \(3, 2, 3, 3\) do not match with groups=1: need "
                                         r"weight.shape\[0\] = in_channels"):
        F.conv_transpose2d(x, zyx.Tensor(np.zeros((3, 2, 3, 3), np.float32)))
    with pytest.raises(ValueError, match=r"output_padding \(2, 2\) must be smaller than the stride \(2, 2\)"):
        F.conv_transpose2d(x, zyx.Tensor(np.zeros((4, 2, 3, 3), np.float32)), stride=2, output_padding=2)
    with pytest.raises(ValueError, match=r"output_size \(13, 13\) is not reachable from input shape \(2, 4, 5, 5\): "
                                         r"each spatial size must be in \[11, 13\)"):
        nn.ConvTranspose2d(4, 2, 3, stride=2)(x, output_size=(13, 13))
    with pytest.raises(ValueError, match=r"adaptive_max_pool2d: output sizes must be at least 1, got \(0, 2\)"):
        F.adaptive_max_pool2d(x, (0, 2))
    with pytest.raises(NotImplementedError, match="return_indices=True is not supported"):
        nn.AdaptiveMaxPool2d(2, return_indices=True)
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\)"):
        F.conv2d(x, zyx.Tensor(np.zeros((6, 4, 3, 3), np.float32)), zyx.Tensor(np.zeros(4, np.float32)))
    with pytest.raises(ValueError, match="BatchNorm2d\\(3\\): expected an input of rank 4 with 3 channels"):
        nn.BatchNorm2d(3)(x)

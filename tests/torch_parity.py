"""Checks against PyTorch shared by the nn and math tests: a function's values and float64 gradients, a layer's
output with the same parameters."""

from __future__ import annotations

import numpy as np

import zyx


def matches_torch(fz, ft, arrays, device: str, seed: int = 0, rtol: float = 1e-10) -> None:
    """Values and every input's gradient of sum(f(...) * w), float64, against PyTorch (``w`` random of the output's
    shape)."""
    import torch  # the calling test module has skipped already where torch is missing

    zs = [zyx.Tensor(a, device=device, requires_grad=True) for a in arrays]
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    out_z, out_t = fz(*zs), ft(*ts)
    assert out_z.shape == tuple(out_t.shape)
    w = np.random.default_rng(seed).standard_normal(tuple(out_t.shape))
    (out_z * zyx.Tensor(w, device=device)).sum().backward()
    (out_t * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(out_z.numpy(), out_t.detach().numpy(), rtol=rtol, atol=1e-12)
    for z, t in zip(zs, ts):
        np.testing.assert_allclose(z.grad.numpy(), t.grad.numpy(), rtol=rtol, atol=1e-12)


def layer_matches_torch(z, t, shape: tuple[int, ...], device: str, perturb: bool = False) -> None:
    """zyx layer ``z`` given the state of PyTorch layer ``t`` (float64; with ``perturb``, its parameters moved off
    their initial values, kept representable in float32, zyx's parameter dtype) computes ``t``'s output."""
    import torch

    state = {k: v.detach().numpy() for k, v in t.state_dict().items()}
    if perturb:
        noise = np.random.default_rng(2)
        state = {k: (v + noise.standard_normal(v.shape)).astype(np.float32).astype(np.float64) if v.dtype.kind == "f"
                 else v for k, v in state.items()}
        t.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    assert sorted(z.state_dict()) == sorted(state)
    z.load_state_dict(state)
    z.to(device)
    x = np.random.default_rng(1).standard_normal(shape)
    np.testing.assert_allclose(z(zyx.Tensor(x, device=device)).numpy(), t(torch.tensor(x)).detach().numpy(),
                               rtol=1e-12, atol=1e-12)

"""nn layers and losses, optimizers, against PyTorch; state dicts and files; compile-free training steps."""

from __future__ import annotations

import numpy as np
import pytest

import zyx
from zyx import nn, optim
from zyx.nn import functional as F

torch = pytest.importorskip("torch")


def _copy_to_torch(zmod, tmod):
    sd = {k: torch.tensor(v.numpy()) for k, v in zmod.state_dict().items()}
    tmod.load_state_dict(sd)


def test_linear_layernorm_embedding_match_torch(rng):
    x = rng.standard_normal((6, 5)).astype(np.float32)
    lin, tlin = nn.Linear(5, 3), torch.nn.Linear(5, 3)
    _copy_to_torch(lin, tlin)
    np.testing.assert_allclose(lin(zyx.Tensor(x)).numpy(), tlin(torch.tensor(x)).detach().numpy(), rtol=1e-5,
                               atol=1e-6)
    ln, tln = nn.LayerNorm(5), torch.nn.LayerNorm(5)
    ln.weight.assign(rng.standard_normal(5).astype(np.float32))
    _copy_to_torch(ln, tln)
    np.testing.assert_allclose(ln(zyx.Tensor(x)).numpy(), tln(torch.tensor(x)).detach().numpy(), rtol=1e-4,
                               atol=1e-5)
    emb, temb = nn.Embedding(10, 4), torch.nn.Embedding(10, 4)
    _copy_to_torch(emb, temb)
    idx = np.array([[1, 9], [0, 1]])
    np.testing.assert_allclose(emb(zyx.Tensor(idx)).numpy(), temb(torch.tensor(idx)).detach().numpy())


def test_linear_default_init_bounds():
    lin = nn.Linear(100, 50)
    w = lin.weight.numpy()
    assert w.shape == (50, 100) and np.abs(w).max() <= 0.1 and w.std() > 0.04
    assert lin.bias.shape == (50,)


def test_losses_and_their_grads_match_torch(rng):
    logits = rng.standard_normal((7, 5)).astype(np.float32)
    target = rng.integers(0, 5, size=7)
    z = zyx.Tensor(logits, requires_grad=True)
    t = torch.tensor(logits, requires_grad=True)
    for kw in ({}, {"reduction": "sum"}, {"label_smoothing": 0.1}):
        z.grad, t.grad = None, None
        lz = F.cross_entropy(z, zyx.Tensor(target), **kw)
        lt = torch.nn.functional.cross_entropy(t, torch.tensor(target), **kw)
        lz.backward()
        lt.backward()
        np.testing.assert_allclose(lz.item(), lt.item(), rtol=1e-5)
        np.testing.assert_allclose(z.grad.numpy(), t.grad.numpy(), rtol=1e-4, atol=1e-6)
    p, q = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_allclose(F.mse_loss(zyx.Tensor(p), zyx.Tensor(q)).item(),
                               torch.nn.functional.mse_loss(torch.tensor(p), torch.tensor(q)).item(), rtol=1e-5)
    with pytest.raises(ValueError, match="logits must be"):
        F.cross_entropy(z, zyx.Tensor(target[:3]))


def test_dropout_train_and_eval():
    d = nn.Dropout(0.25)
    x = zyx.ones(10000)
    y = d(x).numpy()
    assert set(np.unique(y)) <= {0.0, np.float32(1 / 0.75)}
    assert abs((y == 0).mean() - 0.25) < 0.03
    d.eval()
    np.testing.assert_array_equal(d(x).numpy(), np.ones(10000, np.float32))


def test_module_parameters_state_dict_and_load(tmp_path):
    m = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2))
    names = [n for n, _ in m.named_parameters()]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]
    assert len(m.parameters()) == 6
    m2 = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2))
    m2.load_state_dict(m.state_dict())
    x = zyx.Tensor(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32))
    np.testing.assert_allclose(m(x).numpy(), m2(x).numpy())
    with pytest.raises(KeyError, match="missing keys"):
        m2.load_state_dict({"0.weight": m.state_dict()["0.weight"]})
    with pytest.raises(ValueError, match="has shape"):
        m2.load_state_dict({**m.state_dict(), "0.bias": zyx.zeros(3)})
    assert m.train() is m and m[0].training and not m.eval()[0].training
    # through a safetensors file
    path = tmp_path / "m.safetensors"
    m.save(str(path))
    m3 = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2)).load(str(path))
    np.testing.assert_allclose(m(x).numpy(), m3(x).numpy())
    # PyTorch reads it with the same names
    from safetensors.torch import load_file

    tm = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    tm.load_state_dict(load_file(str(path)))
    np.testing.assert_allclose(tm(torch.tensor(x.numpy())).detach().numpy(), m(x).numpy(), rtol=1e-5, atol=1e-6)


OPTIMIZERS = [
    ("sgd", lambda p: optim.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    ("sgd_momentum", lambda p: optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("sgd_nesterov", lambda p: optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
    ("adam", lambda p: optim.Adam(p, lr=0.01, weight_decay=0.1),
     lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1)),
    ("adamw", lambda p: optim.AdamW(p, lr=0.01, betas=(0.8, 0.95)),
     lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.95))),
]


@pytest.mark.parametrize("name,mk_z,mk_t", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_optimizers_match_torch(rng, name, mk_z, mk_t):
    w0 = rng.standard_normal((3, 4)).astype(np.float32)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    zw = nn.Parameter(w0)
    tw = torch.tensor(w0, requires_grad=True)
    oz, ot = mk_z([zw]), mk_t([tw])
    for _ in range(6):
        oz.zero_grad()
        ot.zero_grad()
        ((zyx.Tensor(x) @ zw.T).tanh() ** 2).sum().backward()
        ((torch.tensor(x) @ tw.T).tanh() ** 2).sum().backward()
        oz.step()
        ot.step()
    np.testing.assert_allclose(zw.numpy(), tw.detach().numpy(), rtol=1e-4, atol=1e-5)


def test_optimizer_step_is_fused_and_compiles_once(rng):
    m = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = optim.Adam(m.parameters(), lr=1e-2)
    x = zyx.Tensor(rng.standard_normal((8, 6)).astype(np.float32))
    y = zyx.Tensor(rng.integers(0, 3, size=8))
    losses = []
    for i in range(5):
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        if i == 1:
            zyx.debug.reset_stats()
        opt.step(loss)
        losses.append(loss.item())
    st = zyx.debug.stats()
    assert st["compiles"] == 0  # from the second step on
    assert losses[-1] < losses[0]
    # every parameter's Adam update (m, v and the parameter) is one kernel
    loss = F.cross_entropy(m(x), y)
    opt.zero_grad()
    loss.backward()
    updated = opt._update()
    names = [s.name for s in zyx.debug.schedule(*updated)]
    assert sum(n.endswith("_x3") for n in names) == 4


def test_module_to_moves_parameters_in_place_and_training_follows(device):
    zyx.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    params = model.parameters()
    before = [p.numpy() for p in params]
    opt = optim.SGD(params, lr=0.1)  # built before the move: the same tensor objects are moved
    assert model.to(device) is model
    assert [p.device for p in model.parameters()] == [zyx.Tensor(0, device=device).device] * len(params)
    for p, b in zip(params, before):
        np.testing.assert_array_equal(p.numpy(), b)
    x = zyx.Tensor(np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32), device=device)
    loss = (model(x) * model(x)).mean()
    opt.zero_grad()
    loss.backward()
    opt.step(loss)
    assert all(p.device == x.device for p in model.parameters())
    assert any(not np.array_equal(p.numpy(), b) for p, b in zip(params, before))

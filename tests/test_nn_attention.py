"""Attention and the BERT-encoder layers against PyTorch: values and gradients (zyx autograd vs torch autograd on
the same inputs) of scaled_dot_product_attention, MultiheadAttention, gelu/softmax/linear/embedding, masked_fill,
Embedding(padding_idx), LayerNorm(eps=1e-12); and how many kernels attention's softmax part launches."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import host_without_blas

import zyx
from zyx import nn
from zyx.nn import functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional

RTOL, ATOL = 1e-5, 1e-5  # values
GRTOL, GATOL = 1e-4, 1e-4  # gradients


def _pair(a: np.ndarray, grad: bool = True):
    return zyx.Tensor(a, requires_grad=grad), torch.tensor(a, requires_grad=grad)


def _close(got, want, rtol=RTOL, atol=ATOL):
    g = got.numpy() if isinstance(got, zyx.Tensor) else np.asarray(got)
    w = want.detach().numpy() if isinstance(want, torch.Tensor) else np.asarray(want)
    assert g.shape == w.shape, f"shape {g.shape} != {w.shape}"
    np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def _check_grads(zout, tout, zins, tins, rng):
    """Backpropagate the same random upstream gradient through both and compare every input's gradient."""
    up = rng.standard_normal(tout.shape).astype(np.float32)
    zout.backward(zyx.Tensor(up))
    tout.backward(torch.tensor(up))
    for i, (z, t) in enumerate(zip(zins, tins)):
        assert z.grad is not None, f"input {i} got no gradient"
        _close(z.grad, t.grad, GRTOL, GATOL)


def _randn(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _bool_mask(rng, shape, dead_rows: bool = False):
    m = rng.random(shape) > 0.4
    m[..., 0] |= ~m.any(-1)  # every row keeps a key ...
    if dead_rows:  # ... unless asked for fully masked rows
        m.reshape(-1, shape[-1])[1] = False
        m.reshape(-1, shape[-1])[-1] = False
    return m


# ---- scaled_dot_product_attention -------------------------------------------------------------------------------

SDPA_CASES = {
    # name: (q shape, k shape, v shape, mask kind, mask shape, kwargs)
    "plain": ((2, 4, 16, 8), (2, 4, 16, 8), (2, 4, 16, 8), None, None, {}),
    "broadcast_batch": ((2, 3, 5, 8), (1, 3, 7, 8), (3, 7, 4), None, None, {}),
    "unbatched": ((5, 8), (7, 8), (7, 6), None, None, {}),
    "scale": ((2, 3, 6, 4), (2, 3, 6, 4), (2, 3, 6, 4), None, None, {"scale": 0.3}),
    "bool_2d": ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 4), "bool", (5, 7), {}),
    "bool_padding": ((2, 4, 6, 8), (2, 4, 6, 8), (2, 4, 6, 8), "bool", (2, 1, 1, 6), {}),
    "bool_dead_rows": ((2, 4, 6, 8), (2, 4, 6, 8), (2, 4, 6, 8), "bool_dead", (2, 1, 6, 6), {}),
    "float": ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8), "float", (2, 3, 5, 7), {}),
    "float_neg_inf": ((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8), "float_inf", (3, 5, 7), {}),
    "causal_square": ((2, 2, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8), None, None, {"is_causal": True}),
    "causal_short_q": ((1, 2, 5, 8), (1, 2, 9, 8), (1, 2, 9, 8), None, None, {"is_causal": True}),
    "causal_long_q": ((1, 2, 9, 8), (1, 2, 5, 8), (1, 2, 5, 8), None, None, {"is_causal": True}),
}


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_values_and_grads_match_torch(rng, case):
    qs, ks, vs, kind, ms, kw = SDPA_CASES[case]
    (zq, tq), (zk, tk), (zv, tv) = _pair(_randn(rng, *qs)), _pair(_randn(rng, *ks)), _pair(_randn(rng, *vs))
    zm = tm = None
    if kind in ("bool", "bool_dead"):
        m = _bool_mask(rng, ms, dead_rows=kind == "bool_dead")
        zm, tm = zyx.Tensor(m), torch.tensor(m)
    elif kind in ("float", "float_inf"):
        m = _randn(rng, *ms)
        if kind == "float_inf":
            m[rng.random(ms) < 0.3] = -np.inf
            m[..., 1] = 0.5  # every row keeps key 1 ...
            m[0, 0] = -np.inf  # ... but this one, fully masked
        zm, tm = zyx.Tensor(m), torch.tensor(m)
    zo = F.scaled_dot_product_attention(zq, zk, zv, attn_mask=zm, **kw)
    to = TF.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, **kw)
    _close(zo, to)
    assert np.isfinite(zo.numpy()).all()
    _check_grads(zo, to, (zq, zk, zv), (tq, tk, tv), rng)


def test_sdpa_fully_masked_rows_are_zero_with_zero_grads(rng):
    """PyTorch (2.5+) gives zeros, not NaN, for a query that may see no key; so does zyx, gradients included."""
    q, k, v = (_randn(rng, 1, 4, 3) for _ in range(3))
    m = np.ones((4, 4), bool)
    m[2] = False
    zq = zyx.Tensor(q, requires_grad=True)
    out = F.scaled_dot_product_attention(zq, zyx.Tensor(k), zyx.Tensor(v), attn_mask=zyx.Tensor(m))
    np.testing.assert_array_equal(out.numpy()[0, 2], np.zeros(3, np.float32))
    out.sum().backward()
    g = zq.grad.numpy()
    assert np.isfinite(g).all() and not g[0, 2].any()


def test_sdpa_p0_is_exact_and_keeps_the_pattern(rng):
    q, k, v = (zyx.Tensor(_randn(rng, 2, 3, 5, 4)) for _ in range(3))
    m = zyx.Tensor(_randn(rng, 5, 5))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=0.0)
    want = F.softmax(q @ k.transpose(-2, -1) * 0.5 + m, -1) @ v
    np.testing.assert_array_equal(out.numpy(), want.numpy())


def test_sdpa_dropout_statistics():
    # zero queries and keys: every weight is 1/S; values of one make each output the kept share of the weights
    n_rows, s, p = 4000, 32, 0.25
    q, k = zyx.zeros(2, n_rows, 4), zyx.zeros(2, s, 4)
    v = zyx.ones(2, s, 1)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
    assert out.shape == (2, n_rows, 1)
    kept = out.numpy().reshape(-1) * s * (1 - p)  # the number of weights kept in each row
    np.testing.assert_allclose(kept, np.round(kept), atol=1e-3)
    assert abs(kept.mean() / s - (1 - p)) < 0.01  # the expectation is kept: mean output is 1
    assert kept.std() > 1  # rows differ: dropout happened per weight
    with pytest.raises(ValueError, match="dropout_p"):
        F.scaled_dot_product_attention(q, k, v, dropout_p=1.0)


def test_sdpa_errors_name_the_shapes():
    q, k, v = zyx.zeros(2, 5, 8), zyx.zeros(2, 7, 8), zyx.zeros(2, 7, 3)
    with pytest.raises(ValueError, match="not both"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=zyx.ones(5, 7).bool(), is_causal=True)
    with pytest.raises(ValueError, match=r"\(2, 5, 8\).*\(2, 7, 6\)"):
        F.scaled_dot_product_attention(q, zyx.zeros(2, 7, 6), v)
    with pytest.raises(ValueError, match=r"\(2, 7, 8\).*\(2, 6, 3\)"):
        F.scaled_dot_product_attention(q, k, zyx.zeros(2, 6, 3))
    with pytest.raises(ValueError, match=r"\(5, 6\).*\(2, 5, 7\)"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=zyx.zeros(5, 6))
    with pytest.raises(ValueError, match=r"\(3, 5, 7\).*\(2, 5, 7\)"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=zyx.zeros(3, 5, 7))
    with pytest.raises(TypeError, match="bool or float"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=zyx.zeros(5, 7, dtype=zyx.int32))
    with pytest.raises(ValueError, match="at least 2"):
        F.scaled_dot_product_attention(zyx.zeros(8), k, v)


def _score_kernels(launches, score_shape):
    tag = "_" + "_".join(map(str, score_shape))
    return [s for s in launches if s.kind == "generated" and tag in s.name]


def _sdpa_case(rng, mask):
    q, k, v = (zyx.Tensor(_randn(rng, 2, 4, 16, 8)) for _ in range(3))
    kw = {}
    if mask == "bool":
        kw["attn_mask"] = zyx.Tensor(rng.random((2, 1, 16, 16)) > 0.3)
    elif mask == "float":
        kw["attn_mask"] = zyx.Tensor(_randn(rng, 2, 1, 16, 16))
    elif mask == "causal":
        kw["is_causal"] = True
    return F.scaled_dot_product_attention(q, k, v, **kw)


@pytest.fixture
def without_blas():
    with host_without_blas():
        yield


@pytest.mark.parametrize("mask", [None, "bool", "float", "causal"])
def test_sdpa_scale_mask_and_softmax_are_one_kernel(rng, mask, without_blas):
    """Generated: the scores are one contraction kernel, the attention weights (scale, mask add, max, exp, sum,
    normalize) one kernel over them, and the weighted sum one contraction over the stored weights (a factor with an
    exp that the GEMM would recompute per use, ``fuse.FACTOR_STORE_COST``: 8x4x256x64 ran 2.1 ms, against 7.7 ms
    with the weights and the scores fused into one loop nest; 2x4x1024x64 7.9 against 29.2 ms); a bool or float
    mask adds at most two small kernels (which rows may see any key, and zeroing the rows that may not)."""
    launches = zyx.debug.schedule(_sdpa_case(rng, mask))
    assert len(_score_kernels(launches, (2, 4, 16, 16))) == 2, launches
    extra = 2 if mask in ("bool", "float") else 0
    assert len(launches) <= 3 + extra, launches


@pytest.mark.parametrize("mask", [None, "bool", "float", "causal"])
def test_sdpa_on_the_host_is_one_fused_attention_launch(rng, mask):
    """With BLAS, the host runs the whole attention as one library launch: no generated kernel over the scores."""
    launches = zyx.debug.schedule(_sdpa_case(rng, mask))
    fused = [s for s in launches if s.kind == "library" and "attention" in s.name]
    assert len(fused) == 1 and not _score_kernels(launches, (2, 4, 16, 16)), launches
    assert len(launches) <= 1 + (3 if mask in ("bool", "float", "causal") else 0), launches


# ---- functional forms ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_values_and_grads(rng, approximate):
    x = _randn(rng, 4, 33) * 3
    zx, tx = _pair(x)
    zo, to = F.gelu(zx, approximate=approximate), TF.gelu(tx, approximate=approximate)
    _close(zo, to)
    _check_grads(zo, to, (zx,), (tx,), rng)
    _close(nn.GELU(approximate)(zyx.Tensor(x)), to)


@pytest.mark.parametrize("fn", ["softmax", "log_softmax"])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_softmax_and_log_softmax_functional(rng, fn, dim):
    x = _randn(rng, 3, 5, 4) * 4
    zx, tx = _pair(x)
    zo, to = getattr(F, fn)(zx, dim=dim), getattr(TF, fn)(tx, dim=dim)
    _close(zo, to)
    _check_grads(zo, to, (zx,), (tx,), rng)


def test_softmax_dtype_argument():
    x = zyx.Tensor(np.array([[1.0, 2.0, 3.0]], np.float16))
    out = F.softmax(x, -1, dtype=zyx.float32)
    assert out.dtype == zyx.float32
    _close(out, TF.softmax(torch.tensor([[1.0, 2.0, 3.0]]), -1))


@pytest.mark.parametrize("bias", [True, False])
def test_linear_values_and_grads(rng, bias):
    (zx, tx), (zw, tw) = _pair(_randn(rng, 2, 3, 5)), _pair(_randn(rng, 4, 5))
    zb, tb = _pair(_randn(rng, 4)) if bias else (None, None)
    zo, to = F.linear(zx, zw, zb), TF.linear(tx, tw, tb)
    _close(zo, to)
    _check_grads(zo, to, (zx, zw) + ((zb,) if bias else ()), (tx, tw) + ((tb,) if bias else ()), rng)


def test_linear_errors_name_the_shapes():
    with pytest.raises(ValueError, match=r"\(2, 6\).*\(4, 5\)"):
        F.linear(zyx.zeros(2, 6), zyx.zeros(4, 5))
    with pytest.raises(ValueError, match=r"\(3,\).*\(4, 5\)"):
        F.linear(zyx.zeros(2, 5), zyx.zeros(4, 5), zyx.zeros(3))
    with pytest.raises(ValueError, match="2-D"):
        F.linear(zyx.zeros(2, 5), zyx.zeros(5))


@pytest.mark.parametrize("padding_idx", [None, 2, -1])
def test_embedding_values_and_grads(rng, padding_idx):
    w = _randn(rng, 6, 4)
    idx = np.array([[0, 2, 5], [2, 2, 1]])
    zw, tw = _pair(w)
    zo = F.embedding(zyx.Tensor(idx), zw, padding_idx=padding_idx)
    to = TF.embedding(torch.tensor(idx), tw, padding_idx=padding_idx)
    _close(zo, to)
    _check_grads(zo, to, (zw,), (tw,), rng)
    if padding_idx is not None:
        assert not zw.grad.numpy()[padding_idx].any()


def test_embedding_errors():
    w = zyx.zeros(6, 4)
    with pytest.raises(TypeError, match="integers"):
        F.embedding(zyx.zeros(3), w)
    with pytest.raises(ValueError, match="padding_idx 6"):
        F.embedding(zyx.Tensor([1]), w, padding_idx=6)
    with pytest.raises(ValueError, match="2-D"):
        F.embedding(zyx.Tensor([1]), zyx.zeros(6))


# ---- masked_fill ------------------------------------------------------------------------------------------------


def test_masked_fill_values_and_grads(rng):
    x = _randn(rng, 3, 4)
    m = rng.random((3, 4)) > 0.5
    zx, tx = _pair(x)
    zo, to = zx.masked_fill(zyx.Tensor(m), -1e9), tx.masked_fill(torch.tensor(m), -1e9)
    _close(zo, to)
    _check_grads(zo, to, (zx,), (tx,), rng)
    # the mask broadcasts (here over rows), and a 0-d tensor value gets the gradient of the filled places
    mrow = np.array([True, False, False, True])
    (zx, tx), (zv, tv) = _pair(x), _pair(np.array(2.5, np.float32))
    zo, to = zx.masked_fill(zyx.Tensor(mrow), zv), tx.masked_fill(torch.tensor(mrow), tv)
    _close(zo, to)
    _check_grads(zo, to, (zx, zv), (tx, tv), rng)


def test_masked_fill_broadcast_dtype_and_errors():
    x = np.arange(3, dtype=np.int64)
    m = np.array([[True, False, True], [False, False, True]])
    got = zyx.Tensor(x).masked_fill(zyx.Tensor(m), 7.9)
    want = torch.tensor(x).masked_fill(torch.tensor(m), 7.9)
    assert got.dtype == zyx.int64
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    with pytest.raises(TypeError, match="mask must be bool"):
        zyx.zeros(3).masked_fill(zyx.Tensor([1, 0, 1]), 1.0)
    with pytest.raises(ValueError, match="cannot be broadcast"):
        zyx.zeros(3).masked_fill(zyx.ones(4).bool(), 1.0)
    with pytest.raises(ValueError, match="0-d"):
        zyx.zeros(3).masked_fill(zyx.ones(3).bool(), zyx.ones(3))


# ---- layers -----------------------------------------------------------------------------------------------------


def test_embedding_layer_padding_idx(rng):
    emb = nn.Embedding(7, 3, padding_idx=4)
    w = emb.weight.numpy()
    assert not w[4].any() and w[np.arange(7) != 4].all()
    idx = zyx.Tensor(np.array([[4, 1, 4], [0, 6, 4]]))
    temb = torch.nn.Embedding(7, 3, padding_idx=4)
    temb.load_state_dict({"weight": torch.tensor(w)})
    zo, to = emb(idx), temb(torch.tensor(idx.numpy()))
    _close(zo, to)
    up = _randn(rng, 2, 3, 3)
    zo.backward(zyx.Tensor(up))
    to.backward(torch.tensor(up))
    _close(emb.weight.grad, temb.weight.grad, GRTOL, GATOL)
    assert not emb.weight.grad.numpy()[4].any()
    assert nn.Embedding(5, 2, padding_idx=-1).padding_idx == 4
    with pytest.raises(ValueError, match="out of range"):
        nn.Embedding(5, 2, padding_idx=5)


def test_layernorm_bert_eps_values_and_grads(rng):
    x = _randn(rng, 2, 5, 16) * 3 + 1
    ln, tln = nn.LayerNorm(16, eps=1e-12), torch.nn.LayerNorm(16, eps=1e-12)
    sd = {"weight": _randn(rng, 16), "bias": _randn(rng, 16)}
    ln.load_state_dict(sd)
    tln.load_state_dict({k: torch.tensor(v) for k, v in sd.items()})
    zx, tx = _pair(x)
    zo, to = ln(zx), tln(tx)
    _close(zo, to, 1e-5, 1e-5)
    _check_grads(zo, to, (zx, ln.weight, ln.bias), (tx, tln.weight, tln.bias), rng)


def _mha_pair(rng, e, h, **kw):
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(e, h, **kw)
    with torch.no_grad():  # non-zero biases, so that they are tested too
        for name, p in tm.named_parameters():
            if "bias" in name:
                p.copy_(torch.tensor(_randn(rng, *p.shape)))
    zm = nn.MultiheadAttention(e, h, **kw)
    assert list(zm.state_dict()) == list(tm.state_dict())
    zm.load_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})
    return zm, tm


MHA_CASES = {
    # name: (L, S, N or None (unbatched), self-attention, kwargs of the module, forward masks)
    "self": (6, 6, 2, True, {}, {}),
    "self_batch_first_padding": (6, 6, 3, True, {"batch_first": True}, {"kpm": "bool"}),
    "self_padding": (6, 6, 3, True, {}, {"kpm": "bool"}),
    "cross_masks": (5, 7, 2, False, {}, {"kpm": "bool", "attn": "bool2d"}),
    "cross_batch_first_float_masks": (5, 7, 2, False, {"batch_first": True}, {"kpm": "float", "attn": "float3d"}),
    "no_bias": (4, 4, 2, True, {"bias": False}, {"attn": "bool2d"}),
    "unbatched": (5, 6, None, False, {}, {"kpm": "bool"}),
}


@pytest.mark.parametrize("need_weights,average", [(True, True), (True, False), (False, True)],
                         ids=["weights", "head_weights", "no_weights"])
@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multihead_attention_matches_torch(rng, case, need_weights, average):
    L, S, N, self_attn, kw, masks = MHA_CASES[case]  # noqa: N806
    E, H = 8, 2  # noqa: N806
    zm, tm = _mha_pair(rng, E, H, **kw)
    batch_first = kw.get("batch_first", False)

    def shape(n):
        return (n, E) if N is None else ((N, n, E) if batch_first else (n, N, E))

    (zq, tq) = _pair(_randn(rng, *shape(L)))
    if self_attn:
        zk, tk, zv, tv = zq, tq, zq, tq
    else:
        (zk, tk), (zv, tv) = _pair(_randn(rng, *shape(S))), _pair(_randn(rng, *shape(S)))
    fw = {}
    if "kpm" in masks:
        pad = np.zeros((N or 1, S), bool)
        pad[-1, -2:] = True  # the last sequence's last two keys are padding
        pad = pad if N is not None else pad[0]
        if masks["kpm"] == "float":
            pad = np.where(pad, -np.inf, 0.0).astype(np.float32)
        fw["key_padding_mask"] = (zyx.Tensor(pad), torch.tensor(pad))
    if "attn" in masks:
        if masks["attn"] == "bool2d":
            am = ~_bool_mask(rng, (L, S))  # True = not allowed
        else:
            am = _randn(rng, (N or 1) * H, L, S)
        fw["attn_mask"] = (zyx.Tensor(am), torch.tensor(am))
    zo, zw = zm(zq, zk, zv, need_weights=need_weights, average_attn_weights=average,
                **{k: v[0] for k, v in fw.items()})
    to, tw = tm(tq, tk, tv, need_weights=need_weights, average_attn_weights=average,
                **{k: v[1] for k, v in fw.items()})
    _close(zo, to)
    if need_weights:
        _close(zw, tw)
    else:
        assert zw is None and tw is None
    zins = [zq] + ([] if self_attn else [zk, zv]) + [zm.in_proj_weight, zm.out_proj.weight]
    tins = [tq] + ([] if self_attn else [tk, tv]) + [tm.in_proj_weight, tm.out_proj.weight]
    if kw.get("bias", True):
        zins, tins = zins + [zm.in_proj_bias], tins + [tm.in_proj_bias]
    _check_grads(zo, to, zins, tins, rng)


def test_multihead_attention_init_and_errors():
    m = nn.MultiheadAttention(16, 4)
    assert m.in_proj_weight.shape == (48, 16) and m.in_proj_bias.shape == (48,)
    assert m.out_proj.weight.shape == (16, 16) and not m.out_proj.bias.numpy().any()
    assert not m.in_proj_bias.numpy().any()
    w = m.in_proj_weight.numpy()
    bound = math.sqrt(6 / (16 + 48))  # xavier uniform
    assert np.abs(w).max() <= bound and w.std() > bound / 3
    assert [n for n, _ in m.named_parameters()] == ["in_proj_weight", "in_proj_bias", "out_proj.weight",
                                                    "out_proj.bias"]
    with pytest.raises(ValueError, match="divisible"):
        nn.MultiheadAttention(10, 4)
    x = zyx.zeros(5, 2, 16)
    with pytest.raises(ValueError, match="must end with 16"):
        m(zyx.zeros(5, 2, 8), x, x)
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(2, 5\)"):
        m(x, x, x, key_padding_mask=zyx.zeros(5, 2).bool())
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(5, 5\) or \(8, 5, 5\)"):
        m(x, x, x, attn_mask=zyx.zeros(2, 5, 5).bool())


def test_multihead_attention_dropout_only_in_training(rng):
    m = nn.MultiheadAttention(8, 2, dropout=0.5)
    x = zyx.Tensor(_randn(rng, 6, 2, 8))
    m.eval()
    a, _ = m(x, x, x)
    b, _ = m(x, x, x)
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    m.train()
    c, w = m(x, x, x, average_attn_weights=False)
    assert not np.allclose(a.numpy(), c.numpy())
    assert (w.numpy() == 0).mean() > 0.3

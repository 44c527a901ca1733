"""The host's fused attention (``zyx/backends/blas/attention.py``): found for the attention patterns, equal to
the generated path (BLAS off) and to a NumPy reference, NaN and masked rows included, and declined where BLAS
cannot read an operand."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, host_without_blas

import zyx
from zyx.nn import functional as F


def _blas_available() -> bool:
    from zyx.backends.registry import registry

    devs = [d for d in registry().get("host").devices if d.info().kind == "blas"]
    return bool(devs) and devs[0].backend == "cblas" and devs[0]._compiler is not None


pytestmark = pytest.mark.skipif(not _blas_available(), reason="no CBLAS or no OpenMP compiler on the host")


def _fused(t: zyx.Tensor) -> list[str]:
    return [s.name for s in zyx.debug.schedule(t) if s.kind == "library" and "attention" in s.name]


def _reference(q, k, v, add, scale):
    s = np.einsum("...le,...se->...ls", q.astype(np.float64), k.astype(np.float64)) * scale
    if add is not None:
        s = s + add
    s = s - s.max(-1, keepdims=True)
    e = np.exp(s)
    return np.einsum("...ls,...sv->...lv", e / e.sum(-1, keepdims=True), v.astype(np.float64))


def _heads(rng, b, n, h, e, dtype=np.float32):
    """(b, h, n, e) read as a strided view of (b, n, h, e): the layout a model's head split makes."""
    x = rng.standard_normal((b, n, h, e)).astype(dtype)
    return x, zyx.Tensor(x).permute(0, 2, 1, 3)


CASES = [  # b, h, L, S, E, Ev
    (2, 3, 17, 29, 16, 8),
    (1, 1, 300, 700, 16, 24),  # one batch index: query rows split into blocks over the threads
    (3, 12, 56, 56, 32, 32),
    (4, 4, 1, 300, 32, 16),  # one query row
    (2, 2, 5, 3, 8, 8),  # three keys: a scores row of 3 padded to a vector (``AttentionPlan.padded_s``)
    (1, 2, 9, 64, 16, 16),  # rows of whole vectors: no padding
]


@pytest.mark.parametrize("b,h,L,S,E,Ev", CASES, ids=[f"{c}" for c in CASES])
@pytest.mark.parametrize("mask", [None, "bool", "float", "causal"])
def test_fused_attention_equals_the_generated_path_and_numpy(rng, b, h, L, S, E, Ev, mask):
    q, Q = _heads(rng, b, L, h, E)
    k, K = _heads(rng, b, S, h, E)
    v, V = _heads(rng, b, S, h, Ev)
    kw, add = {}, None
    if mask == "bool":
        m = rng.random((b, 1, 1, S)) > 0.3
        m[..., 0] = True
        kw["attn_mask"] = zyx.Tensor(m)
        add = np.where(m, 0.0, -np.inf)
    elif mask == "float":
        f = rng.standard_normal((b, 1, L, S)).astype(np.float32)
        kw["attn_mask"] = zyx.Tensor(f)
        add = f.astype(np.float64)
    elif mask == "causal":
        if L != S:
            pytest.skip("causal attention here is square")
        kw["is_causal"] = True
        add = np.where(np.tril(np.ones((L, S), bool)), 0.0, -np.inf)
    out = F.scaled_dot_product_attention(Q, K, V, **kw)
    assert len(_fused(out)) == 1
    got = out.numpy()
    with host_without_blas():
        generated = F.scaled_dot_product_attention(Q, K, V, **kw)
        assert not _fused(generated)
        want = generated.numpy()
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    t = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    assert_close(got, _reference(t(q), t(k), t(v), add, 1 / np.sqrt(E)), rtol=1e-4, atol=1e-5)


def test_float64_attention_is_fused_and_exact_to_float64(rng):
    q, Q = _heads(rng, 2, 40, 3, 16, np.float64)
    k, K = _heads(rng, 2, 48, 3, 16, np.float64)
    v, V = _heads(rng, 2, 48, 3, 8, np.float64)
    out = F.scaled_dot_product_attention(Q, K, V, scale=0.3)
    assert _fused(out) == ["dattention_2x3_40x48x16x8"]
    t = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    assert_close(out, _reference(t(q), t(k), t(v), None, 0.3), rtol=1e-12, atol=1e-12)


def test_nan_logits_and_fully_masked_rows_match_the_generated_path(rng):
    q = rng.standard_normal((1, 4, 32, 16)).astype(np.float32)
    q[0, 1, 2, 3] = np.nan  # one NaN logit row
    k = rng.standard_normal((1, 4, 40, 16)).astype(np.float32)
    v = rng.standard_normal((1, 4, 40, 8)).astype(np.float32)
    f = rng.standard_normal((1, 1, 32, 40)).astype(np.float32)
    f[0, 0, 4, :] = -np.inf  # a row where every key is -inf: NaN in both paths (exp(-inf - -inf))
    b = rng.random((1, 1, 32, 40)) > 0.5
    b[0, 0, 1, :] = False  # a row with no key: zeros, as PyTorch
    for kw in ({"attn_mask": zyx.Tensor(f)}, {"attn_mask": zyx.Tensor(b)}):
        out = F.scaled_dot_product_attention(zyx.Tensor(q), zyx.Tensor(k), zyx.Tensor(v), **kw)
        assert len(_fused(out)) == 1
        got = out.numpy()
        with host_without_blas():
            want = F.scaled_dot_product_attention(zyx.Tensor(q), zyx.Tensor(k), zyx.Tensor(v), **kw).numpy()
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        assert np.isnan(got[0, 1, 2]).all()
        assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not got[0, :, 1].any()  # the bool mask's dead row


def test_training_through_the_fused_forward_gives_the_generated_gradients(rng):
    q, k, v = (rng.standard_normal((2, 3, 40, 16)).astype(np.float32) for _ in range(3))
    grads = []
    for ctx in (None, host_without_blas()):
        ts = [zyx.Tensor(x, requires_grad=True) for x in (q, k, v)]
        if ctx is None:
            loss = (F.scaled_dot_product_attention(*ts) ** 2).sum()
            loss.backward()
        else:
            with ctx:
                loss = (F.scaled_dot_product_attention(*ts) ** 2).sum()
                loss.backward()
        grads.append([t.grad.numpy() for t in ts])
    for a, b in zip(*grads):
        assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_operands_blas_cannot_read_are_not_fused(rng):
    """A value tensor read with no unit stride (every other element of both axes) keeps the unfused path."""
    q, k = (zyx.Tensor(rng.standard_normal((2, 6, 4)).astype(np.float32)) for _ in range(2))
    big = rng.standard_normal((2, 12, 8)).astype(np.float32)
    v = zyx.Tensor(big)[:, ::2, ::2]
    out = F.scaled_dot_product_attention(q, k, v)
    assert not _fused(out)
    assert_close(out, _reference(q.numpy(), k.numpy(), big[:, ::2, ::2], None, 0.5), rtol=1e-4, atol=1e-5)


def test_half_attention_is_not_fused_on_the_host(rng):
    q, k, v = (zyx.Tensor(rng.standard_normal((1, 4, 8)).astype(np.float16)) for _ in range(3))
    assert not _fused(F.scaled_dot_product_attention(q, k, v))

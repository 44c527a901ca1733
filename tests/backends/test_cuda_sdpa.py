"""Attention as a vendor pattern: ``match_attention`` (graph layer) and cuDNN's SDPA on cuda.

- The matcher finds ``softmax(q·kᵀ·scale + mask)·v`` as ``@``, ``*`` and ``Tensor.softmax`` build it (masked or not,
  1 to 16 heads, batched, float16 / bfloat16 / float32, q/k/v as the (B, L, H, D) -> (B, H, L, D) permute views),
  with the views' strides; it finds nothing for the near misses (softmax over the wrong axis, scale after the
  softmax, a non-constant scale, a max- instead of a sum-reduce, the weights read transposed, ...).
- On cuda (the emulated driver without a GPU; skipped when ``cuda:0`` is off) cuDNN's SDPA is offered for float16
  and bfloat16 only: the launch is a "library" step of ``zyx.debug.schedule`` and the values match the host's
  computation of the same expression within the dtype's tolerance; float32 attention is never offered.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import zyx
from zyx.backends.cuda import cudnn_sdpa
from zyx.graph.extract import Graph
from zyx.graph.match_attention import match_attention
from zyx.graph.schedule import collect

B, L, S, E = 2, 16, 24, 8  # graph-only tests: small
NP = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32}
TOL = {"float16": 6e-3, "bfloat16": 4e-2, "float32": 1e-4}


def attentions(t: zyx.Tensor):
    order, _ = collect([t.cls])
    return Graph(order, [t.cls]).attentions()


def the_attention(t: zyx.Tensor):
    """The match for ``t``'s own class (f16/bf16 graphs also match the float32 sum before its cast)."""
    found = [a for a in attentions(t) if a.cls is t.cls]
    assert len(found) == 1, found
    return found[0]


def inputs(dtype: str, heads: int, b: int = B, l_: int = L, s: int = S, e: int = E, seed: int = 0, device="host"):
    """q, k, v as a transformer holds them, (B, L, H, D), permuted to (B, H, L, D); and their arrays."""
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((b, n, heads, e)).astype(NP[dtype]) for n in (l_, s, s)]
    q, k, v = (zyx.Tensor(a, device=device).permute(0, 2, 1, 3) for a in arrays)
    return (q, k, v), arrays


def attention(q, k, v, scale: float, mask=None):
    scores = q @ k.transpose(-2, -1) * scale
    return (scores + mask if mask is not None else scores).softmax(-1) @ v


# ---------------------------------------------------------------------------------------------------------------
# the graph layer: found


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("heads", [1, 2, 12, 16])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_attention_is_found_with_the_views_strides(dtype, heads, masked):
    (q, k, v), _ = inputs(dtype, heads)
    mask = zyx.Tensor(np.zeros((L, S), NP[dtype])) if masked else None
    out = attention(q, k, v, 0.125, mask)
    a = the_attention(out)
    assert match_attention(out.cls) == a
    assert (a.batch, a.heads, a.batch_size, a.L, a.S, a.E, a.Ev) == ((B, heads), heads, B, L, S, E, E)
    assert a.scale == 0.125 and a.dtype.name == dtype and a.out_dtype.name == dtype
    # (B, L, H, E) contiguous, read as (B, H, L, E): strides, not a copy
    h = heads > 1  # a size-1 axis has stride 0
    assert a.q.base.shape == (B, L, heads, E) and a.q.strides == (L * heads * E, E * h, heads * E, 1)
    assert a.k.base.shape == (B, S, heads, E) and a.k.strides == (S * heads * E, E * h, heads * E, 1)
    assert a.v.base.shape == (B, S, heads, E) and a.v.strides == (S * heads * E, E * h, heads * E, 1)
    assert a.q.offset == a.k.offset == a.v.offset == 0
    if masked:
        assert a.mask.base is mask.cls and a.mask.strides == (0, 0, S, 1)
    else:
        assert a.mask is None
    assert a.flops == 2 * B * heads * L * S * (E + E)
    if dtype != "float32":  # the float32 sum before `@`'s cast back is an attention too, in float32
        others = [x for x in attentions(out) if x.cls is not out.cls]
        assert [(x.out_dtype.name, x.q.base) for x in others] == [("float32", a.q.base)]


def test_unbatched_and_three_dimensional_attention_are_found():
    rng = np.random.default_rng(1)
    q, k, v = (zyx.Tensor(rng.standard_normal((n, E)).astype(np.float16)) for n in (L, S, S))
    a = the_attention(attention(q, k, v, 0.5))
    assert (a.batch, a.heads, a.batch_size) == ((), 1, 1)
    assert a.q.strides == (E, 1) and a.k.strides == (E, 1) and a.v.strides == (E, 1)
    q3, k3, v3 = (zyx.Tensor(rng.standard_normal((3, n, E)).astype(np.float16)) for n in (L, S, S))
    a = the_attention(attention(q3, k3, v3, 0.5))
    assert a.batch == (3,) and a.heads == 3 and a.k.strides == (S * E, E, 1)


def test_the_scale_may_be_a_division_a_left_operand_or_absent():
    (q, k, v), _ = inputs("float16", 2)
    assert the_attention((q @ k.transpose(-2, -1) / 4.0).softmax(-1) @ v).scale == 0.25
    assert the_attention((0.5 * (q @ k.transpose(-2, -1))).softmax(-1) @ v).scale == 0.5
    assert the_attention((q @ k.transpose(-2, -1)).softmax(-1) @ v).scale == 1.0


def test_masks_broadcast_per_batch_or_computed_from_booleans():
    (q, k, v), _ = inputs("float16", 4)
    per_batch = zyx.Tensor(np.zeros((B, 1, L, S), np.float16))
    a = the_attention(attention(q, k, v, 0.125, per_batch))
    assert a.mask.base is per_batch.cls and a.mask.strides == (L * S, 0, S, 1)
    keep = zyx.Tensor(np.random.default_rng(2).random((L, S)) > 0.5)
    additive = keep.where(0.0, -1e4).cast("float16")
    a = the_attention(attention(q, k, v, 0.125, additive))
    assert a.mask.base is additive.cls and a.mask.strides == (0, 0, S, 1)  # materialized, then broadcast
    a = the_attention((additive + q @ k.transpose(-2, -1) * 0.125).softmax(-1) @ v)  # mask on the left
    assert a.mask.base is additive.cls


def test_the_functional_scaled_dot_product_attention_is_found():
    F = pytest.importorskip("zyx.nn.functional")  # noqa: N806 - PyTorch's name
    if not hasattr(F, "scaled_dot_product_attention"):
        pytest.skip("zyx.nn.functional.scaled_dot_product_attention is not there yet")
    (q, k, v), _ = inputs("float16", 2)
    a = the_attention(F.scaled_dot_product_attention(q, k, v))
    assert a.mask is None and a.scale == pytest.approx(1 / math.sqrt(E), rel=1e-3)
    causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    found = [x for x in attentions(causal) if x.out_dtype.name == "float16"]
    assert len(found) == 1 and found[0].mask is not None and found[0].mask.strides == (0, 0, S, 1)


# ---------------------------------------------------------------------------------------------------------------
# the graph layer: near misses


def near_misses():
    (q, k, v), _ = inputs("float16", 2, l_=E, s=E)  # L == S == E: wrongly transposed operands still fit
    scores = q @ k.transpose(-2, -1) * 0.125
    e = (scores - scores.max(-1, keepdim=True)).exp()
    scale_tensor = zyx.Tensor(np.float16(0.125), device="host")  # beside q, k, v
    return {
        "softmax over the query axis": scores.softmax(-2) @ v,
        "scale after the softmax": (q @ k.transpose(-2, -1)).softmax(-1) * 0.125 @ v,
        "a non-constant scale": (q @ k.transpose(-2, -1) * scale_tensor).softmax(-1) @ v,
        "a max-reduce instead of the sum": (e / e.max(-1, keepdim=True)) @ v,
        "the max over the query axis": ((s := scores - scores.max(-2, keepdim=True)).exp()
                                        / s.exp().sum(-1, keepdim=True)) @ v,
        "no max subtracted": (scores.exp() / scores.exp().sum(-1, keepdim=True)) @ v,
        "the weights read transposed (contraction over the query axis)": scores.softmax(-1).transpose(-2, -1) @ v,
        "log-softmax weights": scores.log_softmax(-1) @ v,
        "logits that are no matmul": (q * 0.125).softmax(-1) @ v.transpose(-2, -1),
        "a plain matmul": q @ k.transpose(-2, -1),
    }


@pytest.mark.parametrize("case", list(near_misses()))
def test_near_misses_are_not_found(case):
    assert attentions(near_misses()[case]) == []


def test_a_wrongly_transposed_v_is_the_attention_of_its_transpose():
    """``P @ vᵀ`` (S == E) contracts v's head axis: the match reads the value tensor as vᵀ, by strides, so nothing
    computes the wrong value; cuDNN then declines it (no unit head-dim stride)."""
    (q, k, v), _ = inputs("float16", 2, s=E)
    a = the_attention((q @ k.transpose(-2, -1) * 0.125).softmax(-1) @ v.transpose(-2, -1))
    assert a.v.strides == (E * 2 * E, E, 1, 2 * E)  # vᵀ's (S, Ev) = v's (E, S)
    assert "stride" in cudnn_sdpa.sdpa_spec(a)


# ---------------------------------------------------------------------------------------------------------------
# the cuDNN problem (no GPU needed)


def test_sdpa_spec_keeps_the_permuted_layout_and_the_broadcast_mask():
    heads = 12
    (q, k, v), _ = inputs("bfloat16", heads)
    mask = zyx.Tensor(np.zeros((L, S), ml_dtypes.bfloat16))
    spec = cudnn_sdpa.sdpa_spec(the_attention(attention(q, k, v, 0.125, mask)))
    assert spec.dtype == "bfloat16" and spec.scale == 0.125
    assert (spec.q_dims, spec.q_strides) == ((B, heads, L, E), (L * heads * E, E, heads * E, 1))
    assert (spec.k_dims, spec.k_strides) == ((B, heads, S, E), (S * heads * E, E, heads * E, 1))
    assert (spec.o_dims, spec.o_strides) == ((B, heads, L, E), (heads * L * E, L * E, E, 1))
    assert (spec.bias_dims, spec.bias_strides) == ((1, 1, L, S), (L * S, L * S, S, 1))
    assert spec.kinds == ("in", "in", "in", "in", "out") and spec.name == f"cudnn_sdpa_bf16_bias_{B}x12x{L}x{S}x{E}"


def test_keys_and_values_broadcast_over_the_heads_are_multi_query():
    rng = np.random.default_rng(4)
    q = zyx.Tensor(rng.standard_normal((B, 4, L, E)).astype(np.float16))
    k, v = (zyx.Tensor(rng.standard_normal((B, 1, S, E)).astype(np.float16)) for _ in range(2))
    spec = cudnn_sdpa.sdpa_spec(the_attention(attention(q, k, v, 0.125)))
    assert spec.k_dims == (B, 1, S, E) and spec.v_dims == (B, 1, S, E) and "_kv1_" in spec.name


def test_the_estimate_is_tensor_core_flops_or_bandwidth_plus_the_launch():
    from zyx.backends.cuda.cudnn import LAUNCH_OVERHEAD_NS
    from zyx.backends.cuda.device import device_info

    info = device_info("cuda:0", "NVIDIA H200", {"COMPUTE_CAPABILITY_MAJOR": 9, "MULTIPROCESSOR_COUNT": 132})
    (q, k, v), _ = inputs("float16", 16, l_=1024, s=1024, e=128)
    spec = cudnn_sdpa.sdpa_spec(the_attention(attention(q, k, v, 0.125)))
    assert spec.flops == 2 * B * 16 * 1024 * 1024 * 256 and spec.bytes == 4 * B * 16 * 1024 * 128 * 2
    compute = spec.flops / (cudnn_sdpa.EFFICIENCY * 990e3)
    assert cudnn_sdpa.estimate_ns(info, spec) == pytest.approx(max(compute, spec.bytes / 4300) + LAUNCH_OVERHEAD_NS)


def test_float32_attention_is_not_offered_and_says_why():
    (q, k, v), _ = inputs("float32", 2)
    reason = cudnn_sdpa.sdpa_spec(the_attention(attention(q, k, v, 0.125)))
    assert isinstance(reason, str) and "float16 or bfloat16" in reason


def test_the_real_frontend_accepts_the_description_and_refuses_odd_head_dims():
    cudnn = pytest.importorskip("cudnn")
    (q, k, v), _ = inputs("float16", 2)
    spec = cudnn_sdpa.sdpa_spec(the_attention(attention(q, k, v, 0.125, zyx.Tensor(np.zeros((L, S), np.float16)))))
    g, tensors = cudnn_sdpa.describe(spec, cudnn)
    assert len(tensors) == 5 and tensors[-1].get_dim() == list(spec.o_dims)
    g.validate()  # the frontend's own SDPA rules run without a GPU
    (q, k, v), _ = inputs("float16", 2, e=12)
    g, _ = cudnn_sdpa.describe(cudnn_sdpa.sdpa_spec(the_attention(attention(q, k, v, 0.125))), cudnn)
    with pytest.raises(Exception, match="multiple of 8"):
        g.validate()


# ---------------------------------------------------------------------------------------------------------------
# the cuDNN test double


@pytest.fixture
def emulated_cudnn():
    emulator = pytest.importorskip("zyx.backends.cuda.emulator")
    emu = emulator.EmulatedDriver(emulator.EmulatorConfig(delay_us=0))
    yield emu.cudnn_frontend()
    emu.shutdown()


def _double_graph(dnn, io="HALF", e=8, stats=False, **options):
    dt = dnn.data_type
    io = getattr(dt, io)
    g = dnn.pygraph(name="sdpa", io_data_type=io, intermediate_data_type=dt.FLOAT, compute_data_type=dt.FLOAT)
    q = g.tensor(name="Q", dim=[1, 2, 4, e], stride=[8 * e, 4 * e, e, 1], data_type=io)
    k = g.tensor(name="K", dim=[1, 2, 8, e], stride=[16 * e, 8 * e, e, 1], data_type=io)
    v = g.tensor(name="V", dim=[1, 2, 8, e], stride=[16 * e, 8 * e, e, 1], data_type=io)
    o, st = g.sdpa(q, k, v, attn_scale=0.5, generate_stats=stats, name="sdpa", **options)
    assert st is None
    o.set_output(True).set_dim([1, 2, 4, e]).set_stride([8 * e, 4 * e, e, 1]).set_data_type(io)
    return g


def test_the_double_validates_sdpa_like_cudnn(emulated_cudnn):
    from zyx.backends.cuda.emulator.cudnn_double import GraphError

    g = _double_graph(emulated_cudnn)
    g.validate()
    g.check_support()
    with pytest.raises(GraphError, match="multiples of 8"):
        _double_graph(emulated_cudnn, e=12).validate()
    g = _double_graph(emulated_cudnn, io="FLOAT")
    g.validate()
    with pytest.raises(GraphError, match="float16 or bfloat16"):
        g.check_support()
    with pytest.raises(GraphError, match="inference"):
        _double_graph(emulated_cudnn, stats=True)
    with pytest.raises(GraphError, match="use_causal_mask"):
        _double_graph(emulated_cudnn, use_causal_mask=True)


def test_the_double_reference_is_softmax_attention():
    from zyx.backends.cuda.emulator.cudnn_double import reference_attention

    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((1, 2, n, 8)) for n in (3, 5, 5))
    bias = rng.standard_normal((1, 1, 3, 5))
    s = q @ k.transpose(0, 1, 3, 2) * 0.3 + bias
    p = np.exp(s) / np.exp(s).sum(-1, keepdims=True)
    np.testing.assert_allclose(reference_attention(q, k, v, 0.3, bias), p @ v, rtol=1e-12)
    np.testing.assert_allclose(reference_attention(q, k[:, :1], v[:, :1], 0.3),  # one key/value head for all
                               reference_attention(q, k[:, [0, 0]], v[:, [0, 0]], 0.3), rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------------
# on cuda (the emulated driver without a GPU)


@pytest.fixture
def cuda():
    from zyx.backends.cuda import nvrtc

    if nvrtc.available() is not None:
        pytest.skip(f"NVRTC unavailable: {nvrtc.available()}")
    if "cuda:0" not in zyx.registry().placements():
        pytest.skip("cuda:0 is not available (no GPU, and the emulated GPU is off)")
    return "cuda:0"


def sdpa_launches(t: zyx.Tensor) -> list[str]:
    return [x.name for x in zyx.debug.schedule(t) if x.kind == "library" and x.name.startswith("cudnn_sdpa")]


def compare(got: zyx.Tensor, want: zyx.Tensor, dtype: str) -> None:
    g, w = got.numpy().astype(np.float32), want.numpy().astype(np.float32)
    np.testing.assert_allclose(g, w, rtol=TOL[dtype], atol=TOL[dtype])


BIG = dict(b=2, l_=128, s=128, e=64)  # big enough for the cost model to pick cuDNN over the generated kernels


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("heads", [1, 2, 12, 16])
@pytest.mark.parametrize("masked", [False, True], ids=["unmasked", "masked"])
def test_cudnn_sdpa_runs_on_cuda_and_matches_the_host(cuda, dtype, heads, masked):
    results = {}
    for device in (cuda, "host"):
        (q, k, v), _ = inputs(dtype, heads, seed=heads, device=device, **BIG)
        mask = None
        if masked:
            keep = np.random.default_rng(7).random((BIG["b"], 1, BIG["l_"], BIG["s"])) > 0.2
            mask = zyx.Tensor(np.where(keep, 0.0, -1e4).astype(NP[dtype]), device=device)
        results[device] = attention(q, k, v, 1 / math.sqrt(BIG["e"]), mask)
    out = results[cuda]
    launches = sdpa_launches(out)
    assert len(launches) == 1 and launches[0].startswith(f"cudnn_sdpa_{'f16' if dtype == 'float16' else 'bf16'}")
    assert ("_bias_" in launches[0]) == masked
    assert out.dtype.name == dtype and out.shape == (BIG["b"], heads, BIG["l_"], BIG["e"])
    compare(out, results["host"], dtype)


def test_multi_query_and_boolean_masks_run_on_cuda(cuda):
    rng = np.random.default_rng(8)
    arrays = [rng.standard_normal(shape).astype(np.float16) for shape in ((2, 4, 128, 64), (2, 1, 128, 64),
                                                                         (2, 1, 128, 64))]
    keep = rng.random((128, 128)) > 0.3
    results = {}
    for device in (cuda, "host"):
        q, k, v = (zyx.Tensor(a, device=device) for a in arrays)
        mask = zyx.Tensor(keep, device=device).where(0.0, -1e4).cast("float16")
        results[device] = attention(q, k, v, 0.125, mask)
    assert [n for n in sdpa_launches(results[cuda]) if "_kv1_" in n and "_bias_" in n], zyx.debug.schedule(
        results[cuda])
    compare(results[cuda], results["host"], "float16")


def test_fused_qkv_views_of_one_buffer_run_with_offsets(cuda):
    """q, k, v sliced out of one (B, L, 3, H, D) projection: one base, three byte offsets."""
    qkv = np.random.default_rng(9).standard_normal((2, 128, 3, 2, 64)).astype(np.float16)
    results = {}
    for device in (cuda, "host"):
        x = zyx.Tensor(qkv, device=device)
        q, k, v = (x[:, :, i].permute(0, 2, 1, 3) for i in range(3))
        results[device] = attention(q, k, v, 0.125)
    graph_match = the_attention(results[cuda])
    assert graph_match.q.base is graph_match.k.base is graph_match.v.base
    spec = cudnn_sdpa.sdpa_spec(graph_match)
    assert spec.offsets == (0, 2 * 64 * 2, 2 * 2 * 64 * 2, 0)  # bytes: k one (H, D) block in, v two
    assert spec.q_strides == (128 * 3 * 2 * 64, 64, 3 * 2 * 64, 1)
    assert len(sdpa_launches(results[cuda])) == 1
    compare(results[cuda], results["host"], "float16")


def test_float32_attention_on_cuda_takes_the_generated_path(cuda):
    results = {}
    for device in (cuda, "host"):
        (q, k, v), _ = inputs("float32", 2, b=1, l_=16, s=16, e=8, device=device)
        results[device] = attention(q, k, v, 0.125)
    assert sdpa_launches(results[cuda]) == []
    compare(results[cuda], results["host"], "float32")


def test_small_attention_stays_generated_and_a_transposed_v_is_declined(cuda):
    (q, k, v), _ = inputs("float16", 1, b=1, l_=8, s=8, e=8, device=cuda)
    assert sdpa_launches(attention(q, k, v, 0.125)) == []  # the generated kernels are cheaper
    results, square = {}, dict(b=2, l_=64, s=64, e=64)  # S == E, big enough for cuDNN when v is read straight
    (q, k, v), _ = inputs("float16", 2, device=cuda, **square)
    assert sdpa_launches(attention(q, k, v, 0.125)) != []
    for device in (cuda, "host"):
        (q, k, v), _ = inputs("float16", 2, seed=3, device=device, **square)
        results[device] = (q @ k.transpose(-2, -1) * 0.125).softmax(-1) @ v.transpose(-2, -1)
    assert sdpa_launches(results[cuda]) == []  # v's head axis is not unit-stride: cuDNN cannot read it
    compare(results[cuda], results["host"], "float16")

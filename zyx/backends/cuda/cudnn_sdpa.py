"""cuDNN fused attention (the frontend's ``pygraph.sdpa``) as a library alternative of the CUDA device.

``offer_attentions`` adds, for every ``graph.attentions()`` match placed on the device that cuDNN can run, a
``LibraryKernel`` computing the attention's output class with one SDPA plan built for exactly that problem; the
extractor picks it when it is cheaper than the generated softmax and the two matmuls. Invariants:

- float16 and bfloat16 only. cuDNN's SDPA has no float32 engine, and casting float32 attention to half for it would
  silently lower its precision from float32's to half's; float32 attention is not offered at all (it runs as
  generated kernels and cuDNN float32 matmuls, agreeing with the host to float32 rounding). q, k, v, the mask and
  the output all have the attention's dtype (the matmuls' float32 widening is cuDNN's compute type); anything else
  declines.
- The cuDNN tensors are rank 4, ``[B, H, L, E]`` / ``[B, Hk, S, E]`` / ``[B, Hv, S, Ev]`` / ``[B, H, L, Ev]``, with the
  match's strides: the leading axes before the heads are merged into B when their strides allow, a k or v broadcast
  over the heads has Hk = 1 (multi-query), a mask is the ``bias`` ``[1|B, 1|H, L, S]``. Every head-dim (and the
  mask's key-axis) stride is 1, as cuDNN requires; a mask broadcast along L or S, an operand broadcast over the
  batch or a query broadcast over the heads declines. Offsets into the bases are byte offsets added to the
  pointers (16-byte aligned). The output is contiguous, in the output class's layout.
- Inputs are the views' base classes (materialized contiguously by the scheduler), then the output: arguments
  ``q, k, v[, bias], o``. The plan runs on the stream the worker's assignment chose, with that stream's cuDNN
  handle and workspace (``cudnn.stream_handle``, ``worker.workspace``), ordered with generated kernels like a
  launch; plans are cached by ``SdpaSpec`` in the device's ``CudnnMatmul``.
- The estimate is the larger of the two matmuls' flops at ``EFFICIENCY`` of the dtype's tensor-core peak and the
  bytes of q, k, v, mask and output at the device's bandwidth, plus ``cudnn.LAUNCH_OVERHEAD_NS``.
- Whatever cuDNN declines (``validate`` ... ``check_support``: head dims not a multiple of 8, too large, ...) adds no
  alternative; the reason is logged under ``ZYX_DEBUG=sched``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from zyx.backends.base import LibraryKernel
from zyx.backends.cuda.cudnn import (
    ALIGN_BYTES,
    LAUNCH_OVERHEAD_NS,
    SHORT,
    CudnnUnsupported,
    GraphPlan,
    _cudnn,
    _merge_batch,
    finish_plan,
    new_graph,
    stream_handle,
)
from zyx.utils import log

SDPA_DTYPES = ("float16", "bfloat16")
EFFICIENCY = 0.5  # fraction of the dtype's tensor-core peak assumed for cuDNN's fused attention

Dims = tuple[int, int, int, int]


@dataclass(frozen=True)
class SdpaSpec:
    """One cuDNN SDPA problem: dtype, dims and strides (elements) of q, k, v, o and the optional bias, the scale,
    and byte offsets of q, k, v, bias into their buffers."""

    dtype: str
    q_dims: Dims
    q_strides: Dims
    k_dims: Dims
    k_strides: Dims
    v_dims: Dims
    v_strides: Dims
    o_dims: Dims
    o_strides: Dims
    scale: float
    bias_dims: Dims | None = None
    bias_strides: Dims | None = None
    offsets: tuple[int, int, int, int] = (0, 0, 0, 0)

    @property
    def name(self) -> str:
        b, h, L, E = self.q_dims
        S, Ev = self.k_dims[2], self.v_dims[3]
        kv = "" if self.k_dims[1] == h and self.v_dims[1] == h else f"_kv{self.k_dims[1]}"
        ev = "" if Ev == E else f"x{Ev}"
        return f"cudnn_sdpa_{SHORT[self.dtype]}{'_bias' if self.bias_dims else ''}{kv}_{b}x{h}x{L}x{S}x{E}{ev}"

    @property
    def kinds(self) -> tuple[str, ...]:
        return ("in",) * (4 if self.bias_dims else 3) + ("out",)

    @property
    def flops(self) -> int:
        b, h, L, E = self.q_dims
        return 2 * b * h * L * self.k_dims[2] * (E + self.v_dims[3])

    @property
    def bytes(self) -> int:
        dims = [self.q_dims, self.k_dims, self.v_dims, self.o_dims] + ([self.bias_dims] if self.bias_dims else [])
        return sum(math.prod(d) for d in dims) * (2 if self.dtype in SDPA_DTYPES else 4)


def _pack(dims: list[int], strides: list[int]) -> Dims:
    """``strides`` with every extent-1 axis given the packed value (its stride addresses nothing)."""
    out = list(strides)
    for i in range(len(dims) - 1, -1, -1):
        if dims[i] == 1:
            out[i] = max([dims[j] * out[j] for j in range(i + 1, len(dims))] + [1])
    return (out[0], out[1], out[2], out[3])


def _tensor4(what: str, batch: tuple[int, ...], strides: tuple[int, ...], rows: int, cols: int,
             broadcast_b: bool = False, broadcast_h: bool = False) -> tuple[Dims, Dims] | str:
    """``[B, H, rows, cols]`` dims and strides of a view with ``strides`` over ``batch + (rows, cols)`` (heads = the
    last batch axis, B = the others merged), or why cuDNN cannot read it. A broadcast batch or head axis becomes
    extent 1 where ``broadcast_b`` / ``broadcast_h`` allow it."""
    if any(s < 0 for s in strides):
        return f"{what} is read with negative strides {strides}"
    lead = batch[:-1]
    merged = _merge_batch(lead, strides[:len(lead)])
    if merged is None:
        return f"{what}: batch axes {lead} are not expressible as one strided batch"
    b_ext, b_stride = merged
    heads = batch[-1] if batch else 1
    h_stride = strides[len(batch) - 1] if batch else 0
    h_ext = heads if heads > 1 and h_stride != 0 else 1
    if b_ext != math.prod(lead) and not broadcast_b:
        return f"{what} is broadcast over the batch"
    if h_ext != heads and not broadcast_h:
        return f"{what} is broadcast over the heads"
    rs, cs = strides[-2], strides[-1]
    if cols > 1 and cs != 1:
        return f"{what} has stride {cs} along its last axis (cuDNN needs 1)"
    if rows > 1 and rs == 0:
        return f"{what} is broadcast along its axis of {rows}"
    dims = (b_ext, h_ext, rows, cols)
    return dims, _pack(list(dims), [b_stride, h_stride, rs, cs])


def sdpa_spec(att: Any) -> SdpaSpec | str:
    """The cuDNN problem for a ``zyx.graph.match_attention.Attention``, or the reason cuDNN cannot run it."""
    dt = att.dtype
    if dt.name not in SDPA_DTYPES:
        return (f"{dt.name} attention (cuDNN's SDPA takes float16 or bfloat16; float32 attention runs as generated "
                f"kernels and cuDNN matmuls)")
    if att.out_dtype is not dt:
        return f"output dtype {att.out_dtype.name} differs from the attention's {dt.name}"
    views = {"q": att.q, "k": att.k, "v": att.v, **({"mask": att.mask} if att.mask is not None else {})}
    for what, view in views.items():
        if view.base.dtype is not dt:  # (q, k, v widened to float32 by `@`: cuDNN's compute type)
            return f"{what} dtype {view.base.dtype.name} differs from the attention's {dt.name}"
    if min(att.L, att.S, att.E, att.Ev) < 1 or math.prod(att.batch) < 1:
        return "empty attention"
    b = att.batch
    parts = {"q": _tensor4("q", b, att.q.strides, att.L, att.E),
             "k": _tensor4("k", b, att.k.strides, att.S, att.E, broadcast_h=True),
             "v": _tensor4("v", b, att.v.strides, att.S, att.Ev, broadcast_h=True),
             "o": _tensor4("the output", b, att.out_strides, att.L, att.Ev)}
    if att.mask is not None:
        parts["mask"] = _tensor4("the mask", b, att.mask.strides, att.L, att.S, broadcast_b=True, broadcast_h=True)
    for reason in parts.values():
        if isinstance(reason, str):
            return reason
    size = dt.itemsize
    offsets = tuple(views[w].offset * size if w in views else 0 for w in ("q", "k", "v", "mask"))
    if any(o < 0 or o % ALIGN_BYTES for o in offsets):
        return f"operand offsets {offsets} B are not {ALIGN_BYTES}-byte aligned"
    bias = parts.get("mask")
    return SdpaSpec(dt.name, *parts["q"], *parts["k"], *parts["v"], *parts["o"], float(att.scale),
                    bias[0] if bias else None, bias[1] if bias else None, offsets)  # type: ignore[arg-type]


def describe(spec: SdpaSpec, cudnn: Any = None, handle: Any = None) -> tuple[Any, tuple[Any, ...]]:
    """The cudnn-frontend graph of ``spec`` and its tensors (q, k, v[, bias], O), not yet validated (works without a
    GPU). Inference only: no softmax statistics are generated."""
    cudnn, g, io = new_graph(spec.name, spec.dtype, cudnn, handle)
    q = g.tensor(name="Q", dim=list(spec.q_dims), stride=list(spec.q_strides), data_type=io)
    k = g.tensor(name="K", dim=list(spec.k_dims), stride=list(spec.k_strides), data_type=io)
    v = g.tensor(name="V", dim=list(spec.v_dims), stride=list(spec.v_strides), data_type=io)
    bias = None
    if spec.bias_dims is not None:
        bias = g.tensor(name="bias", dim=list(spec.bias_dims), stride=list(spec.bias_strides), data_type=io)
    o, _stats = g.sdpa(q, k, v, attn_scale=spec.scale, bias=bias, generate_stats=False, name="sdpa")
    o.set_output(True).set_dim(list(spec.o_dims)).set_stride(list(spec.o_strides)).set_data_type(io)
    return g, (q, k, v) + ((bias,) if bias is not None else ()) + (o,)


class SdpaPlan(GraphPlan):
    """The plan of one ``SdpaSpec`` (arguments: q, k, v[, bias], O)."""

    def __init__(self, spec: SdpaSpec, graph: Any, tensors: tuple[Any, ...], workspace_bytes: int) -> None:
        super().__init__(spec, graph, tensors, workspace_bytes, spec.offsets[:len(spec.kinds) - 1] + (0,))
        self.kinds = spec.kinds


def build_plan(worker: Any, spec: SdpaSpec) -> SdpaPlan:
    """(worker thread) Describe, validate and build the SDPA plan of ``spec``; ``CudnnUnsupported`` when cuDNN
    declines it (a description the frontend refuses included)."""
    cudnn = _cudnn(worker.drv)
    for si in range(len(worker.streams)):  # every stream's handle now, so that no flush ever creates one
        stream_handle(worker, si)
    try:
        g, tensors = describe(spec, cudnn, stream_handle(worker, 0))
    except Exception as e:  # noqa: BLE001 - the frontend refused the description: not offered
        raise CudnnUnsupported(f"{type(e).__name__}: {e}") from None
    return SdpaPlan(spec, g, tensors, finish_plan(cudnn, g))


def estimate_ns(info: Any, spec: SdpaSpec) -> float:
    """Time of one SDPA launch: tensor-core flops or memory traffic, whichever is slower, plus the launch."""
    tflops = info.extra.get("tensor_tflops", {}).get(spec.dtype, 100.0)
    compute = spec.flops / (EFFICIENCY * tflops * 1e3)
    memory = spec.bytes / max(info.memory_gbps or 0.0, 1.0)
    return max(compute, memory) + LAUNCH_OVERHEAD_NS


def offer_attentions(lib: Any, graph: Any) -> None:
    """Add an SDPA alternative for every attention of ``graph`` on ``lib``'s device that cuDNN runs (``lib``: the
    device's ``cudnn.CudnnMatmul``, whose plan cache and availability the SDPA plans share)."""
    device = lib.device
    for att in graph.attentions():
        if att.cls.device != device.name:
            continue
        spec = sdpa_spec(att)
        if isinstance(spec, str):
            log("sched", f"{device.name}: no cuDNN SDPA for {att.cls.shape} {att.out_dtype.name}: {spec}")
            continue
        pid = lib.library_program(spec, build_plan, spec.kinds)
        if pid is None:
            continue
        inputs = (att.q.base, att.k.base, att.v.base) + ((att.mask.base,) if att.mask is not None else ())
        graph.add_alternative(att.cls, LibraryKernel(device, pid, inputs, estimate_ns(device.info(), spec),
                                                     spec.name, spec))

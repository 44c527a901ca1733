"""cuDNN matmul library node of the CUDA device (nvidia-cudnn-frontend's ``cudnn.pygraph``).

``CudnnMatmul.match_graph`` offers, for every ``graph.matmuls()`` match placed on its device with float32, float16 or
bfloat16 inputs, a ``LibraryKernel`` running a cuDNN graph built for exactly that problem (and, through
``cudnn_sdpa``, cuDNN's fused attention for ``graph.attentions()``; both share its plan cache). Invariants:

- The cuDNN graph has three tensors with the exact dims ``A [B, M, K]``, ``B [B, K, N]``, ``C [B, M, N]`` and the
  strides of the match (transposed operands are expressed by strides, an operand broadcast over the batch has batch
  extent 1); several batch axes are merged into one when their strides allow, otherwise cuDNN is not offered.
  Inputs keep their own dtype (a half input widened to float32 stays half for cuDNN, which computes in float32); the
  output has the class's dtype. Plans are cached by ``MatmulSpec`` (shapes, strides, offsets, dtypes).
- The alternative's inputs are the operands' *base* classes; the launch arguments are their buffers (materialized
  contiguously by the scheduler) and the output buffer. Operand offsets into the bases are byte offsets added to
  the pointers (rejected unless 16-byte aligned).
- Plans are built and run on the GPU's worker thread (the primary context is current there), with one cuDNN handle
  per stream (``cudnn.set_stream``; all created with the first plan, never in the middle of a flush) and a
  per-stream workspace from the worker's allocator; execution runs on the stream the worker's assignment chose, so
  it is ordered with generated kernels like any launch.
- float32 matmuls go to cuDNN only with ``"cuda": {"allow_tf32": true}``: its float32 engines round the products to
  TF32 even with the ``TENSOR_CORE`` numerical note deselected (an H200 with cuDNN 9 gave 3e-4 relative error on a
  256-deep product, 100x FP32's), so by default float32 runs as an exact generated kernel and cuda and host agree
  to float32 rounding, as PyTorch's default (``allow_tf32`` off) promises.
- Whatever cuDNN cannot run (odd strides, unsupported dtype, ``check_support`` failing) adds no alternative: the
  generated kernel runs; the reason is logged under ``ZYX_DEBUG=sched``. When cuDNN cannot run at all (frontend
  or library missing, handle creation failing) the first matmul on the device warns once (``RuntimeWarning``)
  with the reason and the pip command, and the backend's status line (``python -m zyx``) says "cuDNN off".
- ``describe`` builds the graph description only (no ``validate()``), which works without a GPU.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zyx.backends.base import BackendError, ErrorStatus, LibraryKernel
from zyx.utils import log

CUDNN_TYPES = {"float32": "FLOAT", "float16": "HALF", "bfloat16": "BFLOAT16"}
SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
EFFICIENCY = 0.6  # fraction of the dtype's tensor-core peak assumed for cuDNN matmuls
LAUNCH_OVERHEAD_NS = 8_000  # a cuDNN execute through the worker (host side dominates for small problems)
ALIGN_BYTES = 16


class CudnnUnsupported(Exception):
    """cuDNN cannot run this matmul (the generated kernel will)."""


class CudnnUnavailable(Exception):
    """cuDNN cannot be used at all on this device (library missing or failing to start)."""


def _cudnn(drv: Any = None):
    """The cuDNN frontend of ``drv``'s bindings (``import cudnn`` when ``drv`` is None)."""
    try:
        frontend = getattr(drv, "cudnn_frontend", None)
        if frontend is not None:
            return frontend()
        import cudnn
    except ImportError as e:
        msg = str(e)
        if "pip install" not in msg:  # the frontend module itself is missing
            msg = f"nvidia-cudnn-frontend not installed ({e}): pip install 'zyx[cuda]'"
        raise CudnnUnavailable(msg) from None
    return cudnn


@dataclass(frozen=True)
class MatmulSpec:
    """One cuDNN matmul problem: dims and strides (elements) of A, B, C, dtypes, byte offsets of A and B."""

    in_dtype: str
    out_dtype: str
    a_dims: tuple[int, int, int]
    a_strides: tuple[int, int, int]
    b_dims: tuple[int, int, int]
    b_strides: tuple[int, int, int]
    c_dims: tuple[int, int, int]
    c_strides: tuple[int, int, int]
    a_offset: int = 0
    b_offset: int = 0
    tf32: bool = False  # float32 inputs may run on TF32 tensor cores (10-bit mantissa products)

    @property
    def name(self) -> str:
        b, m, n = self.c_dims
        k = self.a_dims[2]
        layout = "".join("N" if s[2] == 1 else "T" for s in (self.a_strides, self.b_strides))
        dt = SHORT[self.in_dtype] + ("" if self.out_dtype == self.in_dtype else "_" + SHORT[self.out_dtype])
        return f"cudnn_matmul_{dt}{'_tf32' if self.tf32 else ''}_{layout}_{b}x{m}x{n}x{k}"

    @property
    def flops(self) -> int:
        b, m, n = self.c_dims
        return 2 * b * m * n * self.a_dims[2]


def _merge_batch(batch: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, int] | None:
    """(extent, stride) of the batch axes merged into one; extent 1 for an operand broadcast over all of them."""
    dims = [(n, s) for n, s in zip(batch, strides) if n != 1]
    if not dims or all(s == 0 for _, s in dims):
        return 1, 0
    if any(s == 0 for _, s in dims):
        return None  # broadcast over some batch axes only
    for (_, s0), (n1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * n1:
            return None
    return math.prod(n for n, _ in dims), dims[-1][1]


def _matrix(rows: int, cols: int, rs: int, cs: int) -> tuple[int, int] | None:
    """Canonical (row stride, col stride) of a rows x cols matrix that is row- or column-major, else None."""
    if rows == 1 and cols == 1:
        return 1, 1
    if rows == 1:
        return (cols, 1) if cs == 1 else ((1, cs) if cs >= 1 else None)
    if cols == 1:
        return (1, rows) if rs == 1 else ((rs, 1) if rs >= 1 else None)
    if cs == 1 and rs >= cols:
        return rs, 1
    if rs == 1 and cs >= rows:
        return 1, cs
    return None


def _packed_batch_stride(rows: int, cols: int, strides: tuple[int, int]) -> int:
    rs, cs = strides
    return rows * rs if cs == 1 else cols * cs


def matmul_spec(mm: Any, allow_tf32: bool = False) -> MatmulSpec | str:
    """The cuDNN problem for a ``zyx.graph.match.Matmul``, or the reason cuDNN cannot run it. float32 runs on TF32
    tensor cores only with ``allow_tf32`` (PyTorch's ``allow_tf32`` default: off)."""
    da, db = mm.a.view.base.dtype, mm.b.view.base.dtype
    out = mm.acc_dtype
    if da is not db:
        return f"input dtypes differ ({da.name} x {db.name})"
    if da.name not in CUDNN_TYPES:
        return f"input dtype {da.name} (cuDNN matmul takes float32, float16, bfloat16)"
    if out.name not in CUDNN_TYPES:
        return f"output dtype {out.name}"
    if da.name == "float32" and not allow_tf32:
        return ("float32 without allow_tf32 (cuDNN's float32 engines round products to TF32): the exact generated "
                "kernel runs; set \"cuda\": {\"allow_tf32\": true} in the config for cuDNN's TF32")
    if min(mm.m, mm.n, mm.k) < 1:
        return "empty matmul"
    batch = math.prod(mm.batch)
    merged = [_merge_batch(mm.batch, s) for s in (mm.a.batch_strides, mm.b.batch_strides, mm.out_batch_strides)]
    if any(x is None for x in merged):
        return f"batch axes {mm.batch} not expressible as one strided batch"
    (ba, sba), (bb, sbb), (bc, sbc) = merged
    if bc != batch:
        return "output broadcast over the batch"
    a = _matrix(mm.m, mm.k, mm.a.row_stride, mm.a.col_stride)
    b = _matrix(mm.k, mm.n, mm.b.row_stride, mm.b.col_stride)
    c = _matrix(mm.m, mm.n, mm.out_row_stride, mm.out_col_stride)
    if a is None or b is None or c is None:
        return "an operand is neither row- nor column-major (odd strides)"
    size = da.itemsize
    offsets = (mm.a.view.offset * size, mm.b.view.offset * size)
    if any(o < 0 or o % ALIGN_BYTES for o in offsets):
        return f"operand offsets {offsets} B are not {ALIGN_BYTES}-byte aligned"
    if ba == 1:
        sba = _packed_batch_stride(mm.m, mm.k, a)
    if bb == 1:
        sbb = _packed_batch_stride(mm.k, mm.n, b)
    if bc == 1:
        sbc = _packed_batch_stride(mm.m, mm.n, c)
    return MatmulSpec(da.name, out.name, (ba, mm.m, mm.k), (sba, *a), (bb, mm.k, mm.n), (sbb, *b),
                      (bc, mm.m, mm.n), (sbc, *c), offsets[0], offsets[1], allow_tf32 and da.name == "float32")


def new_graph(name: str, dtype: str, cudnn: Any = None, handle: Any = None) -> tuple[Any, Any, Any]:
    """(frontend module, an empty cudnn-frontend graph named ``name`` with ``dtype`` I/O and float32 intermediates
    and compute, the I/O data type)."""
    cudnn = cudnn or _cudnn()
    dt = cudnn.data_type
    io = getattr(dt, CUDNN_TYPES[dtype])
    return cudnn, cudnn.pygraph(name=name, io_data_type=io, intermediate_data_type=dt.FLOAT,
                                compute_data_type=dt.FLOAT, handle=handle), io


def describe(spec: MatmulSpec, cudnn: Any = None, handle: Any = None) -> tuple[Any, tuple[Any, Any, Any]]:
    """The cudnn-frontend graph of ``spec`` and its tensors (A, B, C), not yet validated (works without a GPU)."""
    cudnn, g, io = new_graph(spec.name, spec.in_dtype, cudnn, handle)
    dt = cudnn.data_type
    a = g.tensor(name="A", dim=list(spec.a_dims), stride=list(spec.a_strides), data_type=io)
    b = g.tensor(name="B", dim=list(spec.b_dims), stride=list(spec.b_strides), data_type=io)
    c = g.matmul(a, b, compute_data_type=dt.FLOAT, name="matmul")
    c.set_output(True).set_data_type(getattr(dt, CUDNN_TYPES[spec.out_dtype]))
    c.set_dim(list(spec.c_dims)).set_stride(list(spec.c_strides))
    return g, (a, b, c)


def stream_handle(worker: Any, stream_index: int) -> Any:
    """(worker thread) The cuDNN handle bound to stream ``stream_index`` of ``worker``, created on first use."""
    handles = worker.library_state.setdefault("cudnn_handles", {})
    h = handles.get(stream_index)
    if h is None:
        cudnn = _cudnn(worker.drv)
        try:
            h = cudnn.create_handle()
            cudnn.set_stream(h, worker.stream(stream_index))
        except Exception as e:  # noqa: BLE001 - the library is missing or cannot start: cuDNN is off
            raise CudnnUnavailable(f"cuDNN handle creation failed: {type(e).__name__}: {e}") from None
        handles[stream_index] = h
    return h


class GraphPlan:
    """A built cuDNN graph for one spec; a ``worker.LibraryProgram``: ``run`` executes it on the stream's
    handle and workspace with each tensor uid bound to its argument pointer plus ``offsets`` (bytes)."""

    kinds: tuple[str, ...] = ()

    def __init__(self, spec: Any, graph: Any, tensors: tuple[Any, ...], workspace_bytes: int,
                 offsets: tuple[int, ...]) -> None:
        self.spec = spec
        self.name = spec.name
        self.graph = graph
        self.uids = tuple(t.get_uid() for t in tensors)
        self.workspace_bytes = workspace_bytes
        self.offsets = offsets

    def run(self, worker: Any, stream_index: int, pointers: tuple[int, ...]) -> None:
        handle = stream_handle(worker, stream_index)
        ws = worker.workspace(stream_index, self.workspace_bytes)
        pack = {uid: p + off for uid, p, off in zip(self.uids, pointers, self.offsets)}
        self.graph.execute(pack, ws, handle=handle)


class CudnnPlan(GraphPlan):
    """The plan of one ``MatmulSpec`` (arguments: A, B, C buffers)."""

    kinds = ("in", "in", "out")

    def __init__(self, spec: MatmulSpec, graph: Any, tensors: tuple[Any, Any, Any], workspace_bytes: int) -> None:
        super().__init__(spec, graph, tensors, workspace_bytes, (spec.a_offset, spec.b_offset, 0))


def build_plan(worker: Any, spec: MatmulSpec) -> CudnnPlan:
    """(worker thread) Validate and build the cuDNN plan of ``spec``; ``CudnnUnsupported`` when cuDNN declines."""
    cudnn = _cudnn(worker.drv)
    for si in range(len(worker.streams)):  # every stream's handle now, so that no flush ever creates one
        stream_handle(worker, si)
    handle = stream_handle(worker, 0)
    g, tensors = describe(spec, cudnn, handle)
    # no TF32 for float32 unless allowed: engines computing in full float32 only
    ws = finish_plan(cudnn, g, no_tensor_cores=spec.in_dtype == "float32" and not spec.tf32)
    return CudnnPlan(spec, g, tensors, ws)


def finish_plan(cudnn: Any, g: Any, no_tensor_cores: bool = False) -> int:
    """(worker thread) Validate and build the plans of the described graph ``g``; its workspace size in bytes.
    ``CudnnUnsupported`` when cuDNN declines it."""
    try:
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        if no_tensor_cores:
            g.deselect_numeric_notes([cudnn.numerical_note.TENSOR_CORE])
        g.check_support()
        g.build_plans()
        return int(g.get_workspace_size())
    except Exception as e:  # noqa: BLE001 - cudnnGraphNotSupportedError and friends: not offered
        raise CudnnUnsupported(f"{type(e).__name__}: {e}") from None


class CudnnMatmul:
    """The ``match_graph`` half of a ``CudaDevice``: one cuDNN program per distinct ``MatmulSpec``."""

    def __init__(self, device: Any, allow_tf32: bool = False, unavailable: str | None = None) -> None:
        self.device = device
        self.allow_tf32 = allow_tf32
        self._programs: dict[MatmulSpec, int | None] = {}
        self._lock = threading.Lock()
        self.disabled: str | None = unavailable  # why cuDNN cannot run here (warned once, at the first matmul)
        self._warned = False

    def _warn_disabled(self) -> None:
        if self._warned or self.disabled is None:
            return
        self._warned = True
        fix = "" if "pip install" in self.disabled else "; install the libraries with: pip install 'zyx[cuda]'"
        warnings.warn(f"{self.device.name}: cuDNN is unavailable ({self.disabled}){fix}; matmuls on "
                      f"{self.device.name} run as generated kernels", RuntimeWarning, stacklevel=2)

    def estimate_ns(self, spec: MatmulSpec) -> float:
        info = self.device.info()
        if spec.in_dtype == "float32" and not spec.tf32:
            tflops = info.peak_gflops / 1e3  # full float32: the SIMT peak, not TF32 tensor cores
        else:
            tflops = info.extra.get("tensor_tflops", {}).get(spec.in_dtype, 100.0)
        return spec.flops / (EFFICIENCY * tflops * 1e3) + LAUNCH_OVERHEAD_NS

    def program(self, spec: MatmulSpec) -> int | None:
        """The program id of ``spec``'s plan (built on first use), or None when cuDNN declines it."""
        return self.library_program(spec, build_plan, CudnnPlan.kinds)

    def library_program(self, spec: Any, build: Callable[[Any, Any], Any], kinds: tuple[str, ...]) -> int | None:
        """The program id of the plan ``build(worker, spec)`` makes on the worker thread (built once per hashable
        ``spec``, e.g. a ``cudnn_sdpa.SdpaSpec``), or None when cuDNN declines it or is unavailable."""
        with self._lock:
            if spec in self._programs:
                return self._programs[spec]
            if self.disabled is not None:
                return None
            worker = self.device.worker
            try:
                plan = worker.call(build, worker, spec)
                pid = worker.register_library(plan)
            except CudnnUnsupported as e:
                log("sched", f"{self.device.name}: cuDNN declines {spec.name}: {e}; the generated kernel runs")
                pid = None
            except CudnnUnavailable as e:
                self.disabled = str(e)
                log("sched", f"{self.device.name}: cuDNN unavailable: {e}")
                self._warn_disabled()
                return None
            except BackendError as e:
                log("sched", f"{self.device.name}: cuDNN plan for {spec.name} failed: {e.context}")
                pid = None
            if pid is not None:
                self.device.register_library(pid, spec.name, kinds)
            self._programs[spec] = pid
            return pid

    def forget(self, program: int) -> None:
        """Drop a released program from the plan cache (the next match builds the plan again)."""
        with self._lock:
            for spec in [s for s, p in self._programs.items() if p == program]:
                del self._programs[spec]

    def match_graph(self, graph: Any, outputs: Any) -> None:
        if self.disabled is not None:
            if not self._warned and any(mm.cls.device == self.device.name for mm in graph.matmuls()):
                self._warn_disabled()
            return
        for mm in graph.matmuls():
            if mm.cls.device != self.device.name:
                continue
            spec = matmul_spec(mm, self.allow_tf32)
            if isinstance(spec, str):
                log("sched", f"{self.device.name}: no cuDNN matmul for {mm.cls.shape} {mm.acc_dtype.name}: {spec}")
                continue
            pid = self.program(spec)
            if pid is None:
                continue
            inputs = (mm.a.view.base, mm.b.view.base)
            graph.add_alternative(mm.cls, LibraryKernel(self.device, pid, inputs, self.estimate_ns(spec), spec.name,
                                                        spec))
        if getattr(graph, "attentions", None) is not None:  # a Graph; stand-ins may offer matmuls only
            from zyx.backends.cuda.cudnn_sdpa import offer_attentions

            offer_attentions(self, graph)


def ensure_available(drv: Any = None) -> str:
    """What provides cuDNN for ``drv`` (``""`` for the real library, else its note); raise
    ``BackendError(INITIALIZATION)`` when the cuDNN frontend cannot be loaded."""
    try:
        return getattr(_cudnn(drv), "NOTE", "")
    except CudnnUnavailable as e:
        raise BackendError(ErrorStatus.INITIALIZATION, str(e)) from None

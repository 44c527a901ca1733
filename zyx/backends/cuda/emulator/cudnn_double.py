"""A TEST DOUBLE for cuDNN under the emulated driver: the cudnn-frontend calls zyx makes, executed by a reference
matmul and a reference attention written here, not by cuDNN.

Invariants:
- The graph API is the subset ``zyx.backends.cuda.cudnn`` and ``cudnn_sdpa`` use (``pygraph``, ``tensor``,
  ``matmul``, ``sdpa``, ``set_output`` / ``set_data_type`` / ``set_dim`` / ``set_stride``, ``validate`` ...
  ``build_plans``, ``get_workspace_size``, ``execute``; ``create_handle``, ``set_stream``; ``data_type``,
  ``heur_mode``). When nvidia-cudnn-frontend is installed, every description call is mirrored onto a real
  ``cudnn.pygraph`` (no handle), so the real frontend still checks the graph as far as it can without a GPU (for
  SDPA its ``validate`` runs too: it needs no GPU).
- ``validate`` checks what cuDNN would: A ``[B, M, K]``, B ``[B, K, N]``, C ``[B, M, N]`` with batch extents equal
  or 1, positive strides, supported dtypes. For ``sdpa`` (inference only: ``generate_stats=False`` /
  ``is_inference=True``, ``attn_scale`` and an optional additive ``bias``; any other option is refused): rank-4
  q ``[B, H, L, E]``, k ``[B, Hk, S, E]``, v ``[B, Hv, S, Ev]``, O ``[B, H, L, Ev]``, bias ``[1|B, 1|H, L, S]``,
  H a multiple of Hk and Hv, unit stride on the last axis, E and Ev multiples of 8; ``check_support`` then refuses
  what cuDNN's engines do not run: dtypes other than float16 / bfloat16 (one io dtype for every tensor), E or Ev
  over 256.
- ``execute`` queues the matmul on the handle's emulated stream, so it is ordered with kernels exactly as cuDNN's
  would be; it checks every operand range and the workspace against the emulated memory (a fault is an illegal
  address), reads the operands with their strides and dtypes, multiplies in the compute type (float32), rounds to
  the output dtype and writes C with its strides. float32 inputs are rounded to TF32 first unless the
  ``TENSOR_CORE`` numerical note was deselected, as cuDNN's tensor-core engines do. An ``sdpa`` execution likewise
  reads q, k, v (and bias) with their strides, computes ``softmax(scale * q·kᵀ + bias)·v`` in float32 (heads of k
  and v repeated for grouped queries), rounds to O's dtype and writes O with its strides. It is a reference, not
  cuDNN: speed and cuDNN's own rounding order (its flash-attention tiling, half-precision probabilities) are not
  emulated.
"""

from __future__ import annotations

import enum
import itertools
import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from zyx.backends.cuda.emulator.kernels import guarded_copy
from zyx.backends.cuda.emulator.streams import StreamFault
from zyx.utils import log

NOTE = "cuDNN: reference double"
WORKSPACE_BYTES = 64 << 10


class data_type(enum.Enum):  # noqa: N801 - the frontend's name
    FLOAT = "float32"
    HALF = "float16"
    BFLOAT16 = "bfloat16"
    DOUBLE = "float64"


class heur_mode(enum.Enum):  # noqa: N801 - the frontend's name
    A = "A"
    B = "B"
    FALLBACK = "FALLBACK"


class numerical_note(enum.Enum):  # noqa: N801 - the frontend's name
    TENSOR_CORE = "TENSOR_CORE"
    DOWN_CONVERT_INPUTS = "DOWN_CONVERT_INPUTS"
    REDUCED_PRECISION_REDUCTION = "REDUCED_PRECISION_REDUCTION"
    NONDETERMINISTIC = "NONDETERMINISTIC"


def round_to_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 (10 mantissa bits, nearest even), as tensor cores read float32 inputs."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    finite = (bits & 0x7F800000) != 0x7F800000
    rounded = (bits + (0xFFF + ((bits >> 13) & 1))) & 0xFFFFE000
    return np.where(finite, rounded, bits).astype(np.uint32).view(np.float32)


_NUMPY = {data_type.FLOAT: np.dtype(np.float32), data_type.HALF: np.dtype(np.float16),
          data_type.BFLOAT16: np.dtype(ml_dtypes.bfloat16), data_type.DOUBLE: np.dtype(np.float64)}


SDPA_TYPES = (data_type.HALF, data_type.BFLOAT16)
MAX_HEAD_DIM = 256  # cuDNN's SDPA forward engines: head dims up to 256 (Ampere and later)


class GraphError(Exception):
    """What cuDNN would refuse at validate() (or check_support())."""


class Handle:
    def __init__(self) -> None:
        self.stream: int | None = None


class Tensor:
    def __init__(self, graph: Graph, uid: int, name: str, dim: list[int] | None, stride: list[int] | None,
                 dtype: data_type | None, real: Any = None) -> None:
        self.graph, self.uid, self.name = graph, uid, name
        self.dim, self.stride, self.dtype = dim, stride, dtype
        self.output = False
        self.real = real

    def get_uid(self) -> int:
        return self.uid

    def _mirror(self, method: str, *args: Any) -> None:
        if self.real is not None:
            getattr(self.real, method)(*args)

    def set_output(self, flag: bool) -> Tensor:
        self.output = bool(flag)
        self._mirror("set_output", flag)
        return self

    def set_data_type(self, dtype: data_type) -> Tensor:
        self.dtype = dtype
        self._mirror("set_data_type", self.graph.real_type(dtype))
        return self

    def set_dim(self, dim: list[int]) -> Tensor:
        self.dim = list(dim)
        self._mirror("set_dim", list(dim))
        return self

    def set_stride(self, stride: list[int]) -> Tensor:
        self.stride = list(stride)
        self._mirror("set_stride", list(stride))
        return self


@dataclass(frozen=True)
class Attention:
    """The ports of one ``sdpa`` node."""

    q: Tensor
    k: Tensor
    v: Tensor
    bias: Tensor | None
    o: Tensor
    scale: float | None


class Graph:
    """A ``cudnn.pygraph`` of one matmul or one SDPA, bound to the emulated machine that executes it."""

    def __init__(self, emulator: Any, name: str = "", io_data_type: data_type = data_type.FLOAT,
                 intermediate_data_type: data_type = data_type.FLOAT, compute_data_type: data_type = data_type.FLOAT,
                 handle: Handle | None = None) -> None:
        self.emulator = emulator
        self.name = name
        self.io = io_data_type
        self.compute = compute_data_type
        self._uids = itertools.count(1)
        self.tensors: list[Tensor] = []
        self.op: tuple[Tensor, Tensor, Tensor] | None = None
        self.attention: Attention | None = None
        self.validated = False
        self.deselected: set[numerical_note] = set()
        try:
            import cudnn as real  # the real frontend checks the description when it is installed
        except ImportError:
            real = None
        self._real_module = real
        self.real = None
        if real is not None:
            self.real = real.pygraph(name=name, io_data_type=self.real_type(io_data_type),
                                     intermediate_data_type=self.real_type(intermediate_data_type),
                                     compute_data_type=self.real_type(compute_data_type))

    def real_type(self, dt: data_type) -> Any:
        return getattr(self._real_module.data_type, dt.name) if self._real_module is not None else None

    def tensor(self, name: str, dim: list[int], stride: list[int], data_type: data_type) -> Tensor:
        real = None
        if self.real is not None:
            real = self.real.tensor(name=name, dim=list(dim), stride=list(stride), data_type=self.real_type(data_type))
        t = Tensor(self, next(self._uids), name, list(dim), list(stride), data_type, real)
        self.tensors.append(t)
        return t

    def matmul(self, a: Tensor, b: Tensor, compute_data_type: data_type = data_type.FLOAT, name: str = "") -> Tensor:
        real = None
        if self.real is not None:
            real = self.real.matmul(a.real, b.real, compute_data_type=self.real_type(compute_data_type), name=name)
        c = Tensor(self, next(self._uids), name, None, None, self.io, real)
        self.tensors.append(c)
        self.op = (a, b, c)
        self.compute = compute_data_type
        return c

    def sdpa(self, q: Tensor, k: Tensor, v: Tensor, attn_scale: float | None = None, bias: Tensor | None = None,
             is_inference: bool | None = None, generate_stats: bool | None = None, name: str = "",
             compute_data_type: data_type | None = None, **options: Any) -> list[Tensor | None]:
        """``[O, Stats]`` as the frontend returns them; Stats is None (inference only)."""
        if self.op is not None or self.attention is not None:
            raise GraphError(f"{self.name}: the double runs graphs of one operation")
        stats = bool(generate_stats) if generate_stats is not None else is_inference is False  # the frontend's rule
        if stats:
            raise GraphError(f"{self.name}: the double runs inference SDPA only (no softmax statistics)")
        used = {key: val for key, val in options.items() if val not in (None, False)}
        if used:
            raise GraphError(f"{self.name}: the double does not implement the SDPA options {sorted(used)}")
        real = None
        if self.real is not None:
            extra = {"bias": bias.real} if bias is not None else {}
            real, _ = self.real.sdpa(q.real, k.real, v.real, attn_scale=attn_scale, generate_stats=False, name=name,
                                     **extra)
        dim = list(q.dim[:-1]) + [v.dim[-1]] if q.dim and v.dim else None  # inferred as the frontend does
        stride = [math.prod(dim[i + 1:]) for i in range(len(dim))] if dim else None
        o = Tensor(self, next(self._uids), f"{name}::O", dim, stride, self.io, real)
        self.tensors.append(o)
        self.attention = Attention(q, k, v, bias, o, attn_scale)
        if compute_data_type is not None:
            self.compute = compute_data_type
        return [o, None]

    # ---- the build steps -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        if self.attention is not None:
            self._validate_sdpa()
            return
        if self.op is None:
            raise GraphError(f"{self.name}: the graph has no operation")
        a, b, c = self.op
        for t in (a, b, c):
            if t.dim is None or t.stride is None or len(t.dim) != 3 or len(t.stride) != 3:
                raise GraphError(f"{self.name}: tensor {t.name} needs 3 dims and 3 strides, got {t.dim} / {t.stride}")
            if any(d < 1 for d in t.dim) or any(s < 0 for s in t.stride):
                raise GraphError(f"{self.name}: tensor {t.name} has dims {t.dim}, strides {t.stride}")
            if t.dtype not in _NUMPY:
                raise GraphError(f"{self.name}: tensor {t.name} has unsupported dtype {t.dtype}")
        (ba, m, k), (bb, k2, n), (bc, m2, n2) = a.dim, b.dim, c.dim
        if k != k2 or m != m2 or n != n2:
            raise GraphError(f"{self.name}: matmul dims {a.dim} x {b.dim} -> {c.dim} do not agree")
        if any(x not in (1, bc) for x in (ba, bb)):
            raise GraphError(f"{self.name}: batch extents {ba}, {bb} do not broadcast to {bc}")
        if not c.output:
            raise GraphError(f"{self.name}: the matmul result is not marked as an output")
        self.validated = True

    def _validate_sdpa(self) -> None:
        att = self.attention
        ports = {"Q": att.q, "K": att.k, "V": att.v, "O": att.o, **({"bias": att.bias} if att.bias else {})}
        for port, t in ports.items():
            if t.dim is None or t.stride is None or len(t.dim) != 4 or len(t.stride) != 4:
                raise GraphError(f"{self.name}: SDPA tensor {port} needs 4 dims and 4 strides, got {t.dim} / "
                                 f"{t.stride}")
            if any(d < 1 for d in t.dim) or any(s < 0 for s in t.stride):
                raise GraphError(f"{self.name}: SDPA tensor {port} has dims {t.dim}, strides {t.stride}")
            if t.stride[3] != 1:
                raise GraphError(f"{self.name}: SDPA tensor {port} needs stride 1 on its last axis, got {t.stride}")
            if t.dtype not in _NUMPY:
                raise GraphError(f"{self.name}: SDPA tensor {port} has unsupported dtype {t.dtype}")
        (b, h, L, e), (bk, hk, s, ek), (bv, hv, sv, ev) = att.q.dim, att.k.dim, att.v.dim
        if (bk, bv, ek, sv) != (b, b, e, s) or att.o.dim != [b, h, L, ev]:
            raise GraphError(f"{self.name}: SDPA dims q {att.q.dim}, k {att.k.dim}, v {att.v.dim} -> O {att.o.dim} do "
                             f"not agree")
        if h % hk or h % hv:
            raise GraphError(f"{self.name}: {h} query heads are not a multiple of {hk} key / {hv} value heads")
        if e % 8 or ev % 8:
            raise GraphError(f"{self.name}: SDPA head dims {e}, {ev} must be multiples of 8")
        if att.bias is not None:
            bb, bh, bl, bs = att.bias.dim
            if bb not in (1, b) or bh not in (1, h) or (bl, bs) != (L, s):
                raise GraphError(f"{self.name}: SDPA bias dims {att.bias.dim} do not broadcast to {[b, h, L, s]}")
        if att.scale is None or not np.isfinite(att.scale):
            raise GraphError(f"{self.name}: SDPA needs a finite attn_scale, got {att.scale}")
        if not att.o.output:
            raise GraphError(f"{self.name}: the SDPA output is not marked as an output")
        if self.real is not None:  # the real frontend's own SDPA rules (they need no GPU)
            try:
                self.real.validate()
            except Exception as e:  # noqa: BLE001 - its typed errors: refused, as cuDNN would
                raise GraphError(f"{self.name}: the cuDNN frontend refuses the SDPA graph: {type(e).__name__}: "
                                 f"{e}") from None
        self.validated = True

    def build_operation_graph(self) -> None:
        if not self.validated:
            raise GraphError(f"{self.name}: build_operation_graph before validate")

    def create_execution_plans(self, modes: list[heur_mode]) -> None:
        pass

    def deselect_numeric_notes(self, notes: list[numerical_note]) -> None:
        """Engines with these notes are not used: without ``TENSOR_CORE`` float32 runs in full float32."""
        self.deselected.update(notes)

    def check_support(self) -> None:
        """What cuDNN's engines run (checked for SDPA: the matmul double runs every validated matmul)."""
        att = self.attention
        if att is None:
            return
        tensors = [att.q, att.k, att.v, att.o] + ([att.bias] if att.bias is not None else [])
        if self.io not in SDPA_TYPES or any(t.dtype is not self.io for t in tensors):
            raise GraphError(f"{self.name}: cuDNN SDPA runs float16 or bfloat16 with one io dtype, got io {self.io} "
                             f"and tensors {[t.dtype for t in tensors]}")
        if max(att.q.dim[3], att.v.dim[3]) > MAX_HEAD_DIM:
            raise GraphError(f"{self.name}: SDPA head dims over {MAX_HEAD_DIM}")

    def build_plans(self) -> None:
        pass

    def get_workspace_size(self) -> int:
        return WORKSPACE_BYTES

    def execute(self, pack: dict[int, int], workspace: int, handle: Handle | None = None) -> None:
        if not self.validated or (self.op is None and self.attention is None):
            raise GraphError(f"{self.name}: execute before the plan was built")
        if handle is None or handle.stream is None:
            raise GraphError(f"{self.name}: execute needs a handle bound to a stream")
        att = self.attention
        if att is not None:
            a, b, c = att.q, att.k, att.o  # the matmul's names for the ports every run reads and writes
            extra = [t for t in (att.v, att.bias) if t is not None]
        else:
            (a, b, c), extra = self.op, []
        missing = [t.name for t in (a, b, c, *extra) if t.uid not in pack]
        if missing:
            raise GraphError(f"{self.name}: the variant pack lacks tensors {missing}")
        ptrs = {t.uid: int(pack[t.uid]) for t in (a, b, c, *extra)}
        emulator = self.emulator
        stream = emulator.stream_object(handle.stream)
        mem = emulator.memory
        name = self.name
        compute = _NUMPY[self.compute]
        tf32 = a.dtype is data_type.FLOAT and numerical_note.TENSOR_CORE not in self.deselected

        def copy(dst: int, src: int, n: int, what: str) -> None:
            fault = guarded_copy(dst, src, n)  # a block freed meanwhile by another stream faults here
            if fault is not None:
                raise StreamFault("CUDA_ERROR_ILLEGAL_ADDRESS", f"cuDNN double {name!r}: {what}: {fault.detail} "
                                                                f"({mem.describe(fault.address)})")

        def fetch(t: Tensor) -> tuple[np.ndarray, np.ndarray]:
            """A private copy of ``t``'s bytes and the strided view of it."""
            dt = _NUMPY[t.dtype]
            extent = (sum((d - 1) * s for d, s in zip(t.dim, t.stride)) + 1) * dt.itemsize
            bad = mem.check(ptrs[t.uid], extent, "device")
            if bad is not None:
                raise StreamFault("CUDA_ERROR_ILLEGAL_ADDRESS", f"cuDNN double {name!r}: tensor {t.name}: {bad}")
            raw = np.empty(extent, np.uint8)
            copy(raw.ctypes.data, ptrs[t.uid], extent, f"tensor {t.name}")
            view = np.lib.stride_tricks.as_strided(raw.view(dt), t.dim, [s * dt.itemsize for s in t.stride])
            return raw, view

        def run() -> None:
            bad = mem.check(int(workspace), WORKSPACE_BYTES, "device") if workspace else "no workspace given"
            if bad is not None:
                raise StreamFault("CUDA_ERROR_ILLEGAL_ADDRESS", f"cuDNN double {name!r}: workspace: {bad}")
            scribble = np.full(WORKSPACE_BYTES, 0x5A, np.uint8)  # over the scratch area, as cuDNN may
            copy(int(workspace), scribble.ctypes.data, WORKSPACE_BYTES, "workspace")
            _, va = fetch(a)
            _, vb = fetch(b)
            raw, out = fetch(c)  # C's own bytes: a strided C keeps what lies between its elements
            xa, xb = va.astype(compute), vb.astype(compute)
            if att is not None:
                xv = fetch(att.v)[1].astype(compute)
                xbias = fetch(att.bias)[1].astype(compute) if att.bias is not None else None
                out[...] = reference_attention(xa, xb, xv, float(att.scale), xbias).astype(out.dtype)
            else:
                if tf32:  # a TF32 tensor-core engine: float32 products of inputs rounded to 10 mantissa bits
                    xa, xb = round_to_tf32(xa), round_to_tf32(xb)
                out[...] = np.matmul(xa, xb).astype(out.dtype)
            copy(ptrs[c.uid], raw.ctypes.data, raw.size, f"tensor {c.name}")

        stream.submit(run if emulator.config.run_kernels else _nothing)


def reference_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float,
                        bias: np.ndarray | None = None) -> np.ndarray:
    """``softmax(scale * q·kᵀ + bias)·v`` over ``[B, H, L, E]``, ``[B, Hk, S, E]``, ``[B, Hv, S, Ev]`` in the inputs'
    (float) dtype; k and v heads are repeated to H (grouped queries), the bias broadcasts."""
    h = q.shape[1]
    k = np.repeat(k, h // k.shape[1], axis=1)
    v = np.repeat(v, h // v.shape[1], axis=1)
    logits = np.matmul(q, np.swapaxes(k, -1, -2)) * q.dtype.type(scale)
    if bias is not None:
        logits = logits + bias
    logits = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(logits)
    return np.matmul(e / e.sum(axis=-1, keepdims=True), v)


def _nothing() -> None:
    """A skipped execution (the emulator runs no kernels)."""


class ReferenceCudnn:
    """The module object standing in for ``cudnn`` (attribute access as on the real module)."""

    NOTE = NOTE
    data_type = data_type
    heur_mode = heur_mode
    numerical_note = numerical_note

    def __init__(self, emulator: Any) -> None:
        self.emulator = emulator

    def pygraph(self, **kwargs: Any) -> Graph:
        return Graph(self.emulator, **kwargs)

    def create_handle(self) -> Handle:
        log("dev", "cuda emulator: cuDNN handle from the reference double (no cuDNN runs)")
        return Handle()

    def set_stream(self, handle: Handle, stream: int) -> None:
        self.emulator.stream_object(int(stream))  # an unknown stream is an error, as in cuDNN
        handle.stream = int(stream)

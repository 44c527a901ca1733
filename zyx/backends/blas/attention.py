"""Host fused attention: ``softmax(scale * q·kᵀ + mask)·v`` for one ``match_attention`` match in one launch.

A library alternative of the BLAS device, as cuDNN's SDPA is of the CUDA device: compiled C (OpenMP) that,
per batch index and block of query rows, computes the scores tile with one CBLAS GEMM into a per-thread
scratch tile, adds the mask and takes the row softmax there (while the tile is in cache), and multiplies it by
``v`` with a second GEMM straight into the output. The scores and weights are never written to memory as
tensors, and q, k, v and the mask are read in place through their strides (the heads permute is a stride).

Invariants: the arithmetic is the generated path's, step for step: ``(q·k)·scale``, ``+ mask``, ``max`` (NaN if
any logit is NaN), ``e = exp(x - max)``, ``e / sum(e)``, then ``P·v`` (sums may associate differently, as BLAS
does for any matmul). Float32 (``zyx_expf``, vectorized) and float64 (libm ``exp``). Every output element is
written by exactly one task. Offered only where each operand reads as a BLAS matrix (one unit stride) and the
mask has the attention's dtype.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np

from zyx import dtypes
from zyx.backends.blas import threaded
from zyx.kernel.c_math import C_MATH_PRELUDE

SCRATCH_BYTES = 1 << 18  # one thread's scores tile (query rows x S) stays within this (L2)
# a scores row is padded to whole vectors of this many bytes (AVX-512), the padding -inf: the softmax's loops then
# have no scalar tail, which ran 8 exponentials of 56 one by one. 2-core Zen 4, the softmax of 56-wide rows alone:
# 2.3 ns per element unpadded, 0.98 padded to 64 (GCC 12, the kernel's flags)
ROW_ALIGN = 64

_SOURCE = r"""
#include <math.h>
#include <omp.h>
typedef {int} I;
typedef int (*zyx_local_threads)(int);
{prelude}
{kernels}
"""

_KERNEL = r"""
typedef void (*zyx_{t}gemm_fn)(int, int, int, I, I, I, {real}, const {real} *, I, const {real} *, I, {real},
                               {real} *, I);
void zyx_attention_{t}(zyx_{t}gemm_fn fn, zyx_local_threads local, int threads, I batch, I L, I S, I E, I Ev,
                       I rows, I Sp, const {real} *q, int qt, I qld, const {real} *k, int kt, I kld, const {real} *v,
                       int vt, I vld, const {real} *mask, long long ml, long long ms, {real} scale,
                       const long long *offsets, {real} *scratch, {real} *out) {{
    I blocks = (L + rows - 1) / rows;
    I tasks = batch * blocks;
    if (tasks <= 0) return;
    int team = (I)threads < tasks ? threads : (int)tasks;
    /* Sp: a scores row's length in the scratch tile, S padded to whole vectors (AttentionPlan.padded_s) */
    #pragma omp parallel num_threads(team)
    {{
        int previous = local ? local(1) : 0;
        {real} *p = scratch + (long long)omp_get_thread_num() * rows * Sp;
        #pragma omp for schedule(static)
        for (I t = 0; t < tasks; t++) {{
            const long long *o = offsets + 4 * (t / blocks);
            I l0 = (t % blocks) * rows, n = L - l0 < rows ? L - l0 : rows;
            /* p[n, S] = scale * q[l0:l0+n, :] . k^T (rows Sp apart) */
            fn(101, qt ? 112 : 111, kt ? 112 : 111, n, S, E, scale, q + o[0] + (qt ? l0 : l0 * qld), qld,
               k + o[1], kld, 0, p, Sp);
            for (I i = 0; i < n; i++) {{
                {real} *x = p + (long long)i * Sp;
                if (mask) {{
                    const {real} *mr = mask + o[3] + (l0 + i) * ml;
                    #pragma omp simd
                    for (I s = 0; s < S; s++) x[s] += mr[s * ms];
                }}
                /* the padding is -inf: it changes no maximum, its exponentials are 0 (NaN where the real ones
                   are: a row of -inf), and the loops below run over whole vectors, without a scalar tail */
                for (I s = S; s < Sp; s++) x[s] = -INFINITY;
                {real} mx = -INFINITY;
                int nan = 0;
                #pragma omp simd reduction(max:mx) reduction(|:nan)
                for (I s = 0; s < Sp; s++) {{ mx = x[s] > mx ? x[s] : mx; nan |= x[s] != x[s]; }}
                if (nan) mx = NAN;
                {real} sum = 0;
                #pragma omp simd reduction(+:sum)
                for (I s = 0; s < Sp; s++) {{ {real} e = {exp}(x[s] - mx); x[s] = e; sum += e; }}
                #pragma omp simd
                for (I s = 0; s < Sp; s++) x[s] = x[s] / sum;
            }}
            /* out[l0:l0+n, :] = p . v */
            fn(101, 111, vt ? 112 : 111, n, Ev, S, 1, p, Sp, v + o[2], vld, 0,
               out + (long long)(t / blocks) * L * Ev + (long long)l0 * Ev, Ev);
        }}
        if (local) local(previous);
    }}
}}
"""


def source(int_type: type) -> str:
    """C source of ``zyx_attention_s`` / ``zyx_attention_d`` for CBLAS integers of ``int_type``."""
    c_int = "long long" if ctypes.sizeof(int_type) == 8 else "int"
    kernels = "".join(_KERNEL.format(t=t, real=real, exp=exp)
                      for t, real, exp in (("s", "float", "zyx_expf"), ("d", "double", "zyx_exp")))
    return _SOURCE.format(int=c_int, prelude=C_MATH_PRELUDE, kernels=kernels)


@dataclass(frozen=True)
class AttentionPlan:
    """One attention problem as the kernel runs it (all sizes and strides in elements; hashable: the program
    key). ``q``/``k``/``v``: (transposed, leading dimension) of the BLAS matrices q (L×E), kᵀ (E×S), v (S×Ev)."""

    dtype: dtypes.DType
    batch: tuple[int, ...]
    L: int
    S: int
    E: int
    Ev: int
    q: tuple[bool, int]
    k: tuple[bool, int]
    v: tuple[bool, int]
    mask: tuple[int, int] | None  # (row stride, column stride) of the mask, or None
    scale: float
    operands: tuple[tuple[int, tuple[int, ...]], ...]  # (offset, batch strides) of q, k, v, mask

    @property
    def name(self) -> str:
        b = "x".join(map(str, self.batch)) + "_" if self.batch else ""
        m = "_masked" if self.mask is not None else ""
        return f"{'s' if self.dtype is dtypes.float32 else 'd'}attention{m}_{b}{self.L}x{self.S}x{self.E}x{self.Ev}"

    @property
    def flops(self) -> int:
        return 2 * math.prod(self.batch) * self.L * self.S * (self.E + self.Ev)

    @property
    def padded_s(self) -> int:
        """A scores row's length in the scratch tile: ``S`` rounded up to whole ``ROW_ALIGN``-byte vectors."""
        lanes = ROW_ALIGN // self.dtype.itemsize
        return -(-self.S // lanes) * lanes

    def rows(self, threads: int) -> int:
        """Query rows per task: a scores tile within ``SCRATCH_BYTES``, and at least ``threads`` tasks."""
        rows = max(1, min(self.L, SCRATCH_BYTES // (self.padded_s * self.dtype.itemsize)))
        batch = math.prod(self.batch)
        if batch < threads:
            rows = min(rows, -(-self.L // -(-threads // batch)))
        return rows


def plan_attention(att) -> AttentionPlan | str:
    """The host kernel's problem for a ``zyx.graph.match_attention.Attention``, or why it cannot run it."""
    d = att.dtype
    if d not in (dtypes.float32, dtypes.float64):
        return f"{d.name} attention (the host kernel takes float32 or float64)"
    views = [att.q, att.k, att.v] + ([att.mask] if att.mask is not None else [])
    if att.out_dtype is not d or any(w.base.dtype is not d or w.cast is not None for w in views):
        return "operands or output in another dtype than the attention's"
    if min(att.L, att.S, att.E, att.Ev) < 1 or math.prod(att.batch) < 1:
        return "empty attention"
    if any(w.offset < 0 or any(s < 0 for s in w.strides) for w in views):
        return "negative strides"
    nb = len(att.batch)
    (ql, qe), (ks, ke), (vs, ve) = att.q.strides[nb:], att.k.strides[nb:], att.v.strides[nb:]
    layout = threaded.matrix_layout
    lq, lk, lv = layout(att.L, att.E, ql, qe), layout(att.E, att.S, ke, ks), layout(att.S, att.Ev, vs, ve)
    if lq is None or lk is None or lv is None:
        return "an operand has no unit stride"
    mask = tuple(att.mask.strides[nb:]) if att.mask is not None else None
    operands = tuple((w.offset, tuple(w.strides[:nb])) for w in views)
    return AttentionPlan(d, tuple(att.batch), att.L, att.S, att.E, att.Ev, lq, lk, lv, mask, float(att.scale),
                         operands)


class AttentionRunner:
    """The compiled kernels for one CBLAS (its ``sgemm``/``dgemm`` pointers, integers of ``int_type``)."""

    def __init__(self, lib: ctypes.CDLL, sgemm, dgemm, local_threads, int_type: type) -> None:
        self._fns = {4: (lib.zyx_attention_s, ctypes.cast(sgemm, ctypes.c_void_p).value, ctypes.c_float),
                     8: (lib.zyx_attention_d, ctypes.cast(dgemm, ctypes.c_void_p).value, ctypes.c_double)}
        self._local = ctypes.cast(local_threads, ctypes.c_void_p).value if local_threads is not None else None
        i, p, c = int_type, ctypes.c_void_p, ctypes.c_int
        for fn, _, real in self._fns.values():
            fn.argtypes = [p, p, c, i, i, i, i, i, i, i, p, c, i, p, c, i, p, c, i, p, ctypes.c_longlong,
                           ctypes.c_longlong, real, p, p, p]
            fn.restype = None

    def prepare(self, plan: AttentionPlan, threads: int) -> Prepared:
        """What every launch of ``plan`` reuses: batch offsets and the threads' scratch tiles."""
        batch = plan.batch
        ops = list(plan.operands) + [(0, (0,) * len(batch))] * (4 - len(plan.operands))
        offsets = threaded.strided_offsets(batch, ops)
        rows = plan.rows(threads)
        scratch = np.empty(threads * rows * plan.padded_s, plan.dtype.np_dtype)
        return Prepared(threads, rows, offsets, scratch)

    def run(self, plan: AttentionPlan, prep: Prepared, q: int, k: int, v: int, mask: int | None, out: int) -> None:
        fn, blas, _ = self._fns[plan.dtype.itemsize]
        ml, ms = plan.mask if plan.mask is not None else (0, 0)
        fn(blas, self._local, prep.threads, math.prod(plan.batch), plan.L, plan.S, plan.E, plan.Ev, prep.rows,
           plan.padded_s, q, int(plan.q[0]), plan.q[1], k, int(plan.k[0]), plan.k[1], v, int(plan.v[0]), plan.v[1],
           mask, ml, ms, plan.scale, prep.offsets.ctypes.data, prep.scratch.ctypes.data, out)


@dataclass(frozen=True)
class Prepared:
    threads: int
    rows: int
    offsets: np.ndarray  # (batch, 4) int64 element offsets of q, k, v, mask
    scratch: np.ndarray  # threads x rows x padded_s elements

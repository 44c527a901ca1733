"""The GEMMs of one BLAS launch spread over OpenMP threads, each thread calling CBLAS single-threaded.

Why: the generated kernels run on OpenMP threads; OpenBLAS has its own pool, and the two pools busy-wait
for the same cores after every call (on 2 cores a kernel after a GEMM ran ~2x slower). Running every GEMM
on the OpenMP threads leaves one pool. A batched launch also loops over its batch in C instead of Python.

Invariants: task ``t`` computes one block of rows (or of columns, ``along_n``) of batch ``t // blocks``:
every output element is written by exactly one task, so the result equals one CBLAS call per batch (same
kernels, same sums); the calling thread's OpenBLAS thread count is restored on return. With a bias row, a
task first writes the bias into its block of C and the GEMM accumulates into it (beta = 1): the bias add costs
no pass of its own over C.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

_SOURCE = r"""
#include <stddef.h>
typedef {int} I;
typedef int (*zyx_local_threads)(int);
{gemms}
"""

_GEMM = r"""
typedef void (*zyx_{t}gemm_fn)(int, int, int, I, I, I, {real}, const {real} *, I, const {real} *, I, {real},
                               {real} *, I);
void zyx_threaded_{t}gemm(zyx_{t}gemm_fn fn, zyx_local_threads local, int threads, int ta, int tb, I m, I n,
                          I k, const {real} *a, I lda, const {real} *b, I ldb, {real} *c, I ldc, I batch,
                          const long long *offsets, I blocks, int along_n, const {real} *bias) {{
    I tasks = batch * blocks;
    if (tasks <= 0) return;
    I span = ((along_n ? n : m) + blocks - 1) / blocks;
    int team = (I)threads < tasks ? threads : (int)tasks;
    #pragma omp parallel num_threads(team)
    {{
        int previous = local ? local(1) : 0;
        #pragma omp for schedule(static)
        for (I t = 0; t < tasks; t++) {{
            const long long *o = offsets + 3 * (t / blocks);
            I lo = (t % blocks) * span, hi = lo + span < (along_n ? n : m) ? lo + span : (along_n ? n : m);
            if (lo >= hi) continue;
            I r0 = along_n ? 0 : lo, r1 = along_n ? m : hi, c0 = along_n ? lo : 0, c1 = along_n ? hi : n;
            if (bias)  /* C's block starts as the bias row; the GEMM then adds into it (beta = 1) */
                for (I r = r0; r < r1; r++) {{
                    {real} *row = c + o[2] + r * ldc;
                    #pragma omp simd
                    for (I j = c0; j < c1; j++) row[j] = bias[j];
                }}
            if (along_n)  /* columns [lo, hi) of C: columns of op(B) */
                fn(101, ta ? 112 : 111, tb ? 112 : 111, m, hi - lo, k, 1, a + o[0], lda,
                   b + o[1] + (tb ? lo * ldb : lo), ldb, bias ? 1 : 0, c + o[2] + lo, ldc);
            else  /* rows [lo, hi) of C: rows of op(A) */
                fn(101, ta ? 112 : 111, tb ? 112 : 111, hi - lo, n, k, 1, a + o[0] + (ta ? lo : lo * lda), lda,
                   b + o[1], ldb, bias ? 1 : 0, c + o[2] + lo * ldc, ldc);
        }}
        if (local) local(previous);
    }}
}}
"""


def source(int_type: type) -> str:
    """C source of ``zyx_threaded_sgemm`` / ``zyx_threaded_dgemm`` for CBLAS integers of ``int_type``."""
    c_int = "long long" if ctypes.sizeof(int_type) == 8 else "int"
    gemms = "".join(_GEMM.format(t=t, real=real) for t, real in (("s", "float"), ("d", "double")))
    return _SOURCE.format(int=c_int, gemms=gemms)


class ThreadedGemm:
    """The compiled runner for one CBLAS (``sgemm``/``dgemm`` pointers of integer type ``int_type``)."""

    def __init__(self, lib: ctypes.CDLL, sgemm, dgemm, local_threads, int_type: type) -> None:
        self._fns = {4: (lib.zyx_threaded_sgemm, ctypes.cast(sgemm, ctypes.c_void_p).value),
                     8: (lib.zyx_threaded_dgemm, ctypes.cast(dgemm, ctypes.c_void_p).value)}
        self._local = ctypes.cast(local_threads, ctypes.c_void_p).value if local_threads is not None else None
        i, p = int_type, ctypes.c_void_p
        for fn, _ in self._fns.values():
            fn.argtypes = [p, p, ctypes.c_int, ctypes.c_int, ctypes.c_int, i, i, i, p, i, p, i, p, i, i, p, i,
                           ctypes.c_int, p]
            fn.restype = None

    def run(self, itemsize: int, threads: int, ta: bool, tb: bool, m: int, n: int, k: int, a: int, lda: int,
            b: int, ldb: int, c: int, ldc: int, offsets: np.ndarray, blocks: int, along_n: bool,
            bias: int | None = None) -> None:
        """``offsets``: int64 (batch, 3) element offsets of A, B, C per batch index (kept alive by the caller);
        ``bias``: the address of n elements added to every row of C (``C = bias + op(A) @ op(B)``), or None."""
        fn, blas = self._fns[itemsize]
        fn(blas, self._local, threads, int(ta), int(tb), m, n, k, a, lda, b, ldb, c, ldc, len(offsets),
           offsets.ctypes.data, blocks, int(along_n), bias)


def strided_offsets(batch: Sequence[int], operands: Sequence[tuple[int, Sequence[int]]]) -> np.ndarray:
    """(prod(batch), len(operands)) int64 element offsets, in row-major batch order, of operands given as
    (offset, strides over ``batch``)."""
    idx = np.indices(tuple(batch), dtype=np.int64).reshape(len(batch), -1).T if batch else np.zeros((1, 0),
                                                                                                   np.int64)
    out = np.empty((idx.shape[0], len(operands)), np.int64)
    for j, (offset, strides) in enumerate(operands):
        out[:, j] = offset + idx @ np.asarray(strides, np.int64).reshape(-1)
    return np.ascontiguousarray(out)


def batch_offsets(batch: Sequence[int], a_offset: int, b_offset: int, a_batch: Sequence[int],
                  b_batch: Sequence[int], c_batch: Sequence[int]) -> np.ndarray:
    """(prod(batch), 3) int64 element offsets of A, B and C for every batch index, in row-major batch order."""
    return strided_offsets(batch, [(a_offset, a_batch), (b_offset, b_batch), (0, c_batch)])


def matrix_layout(rows: int, cols: int, row_stride: int, col_stride: int) -> tuple[bool, int] | None:
    """(transposed, leading dimension) of a rows x cols matrix for row-major BLAS, or None if not expressible."""
    if cols == 1 or col_stride == 1:
        ld = row_stride if rows > 1 else max(cols, 1)
        if ld >= max(cols, 1):
            return False, ld
    if rows == 1 or row_stride == 1:
        ld = col_stride if cols > 1 else max(rows, 1)
        if ld >= max(rows, 1):
            return True, ld
    return None

"""BlasDevice: mints GEMM programs for matmul matches on the host pool (see the package docstring)."""

from __future__ import annotations

import ctypes
import glob
import itertools
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from zyx import dtypes
from zyx.backends.base import BackendError, Device, DeviceInfo, ErrorStatus, LibraryKernel, ProgramId
from zyx.backends.blas import attention, threaded
from zyx.backends.host.device import cpu_count
from zyx.backends.host.pool import HostPool
from zyx.utils import STATS, log

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112
MKL_THREADING_GNU, MKL_INTERFACE_LP64 = 3, 0  # mkl_service.h
LAUNCH_OVERHEAD_NS = 4_000
SINGLE_THREAD_FLOPS = 1 << 25  # below: one thread (OpenBLAS's own threads wake too slowly to pay off)
# the same for the OpenMP runner. Its team is usually awake, but a parallel region waits for every member: when
# another process holds a core, a member waits for a time slice. Below 2^23 flops (about 0.1-0.2 ms on one
# thread) one thread: the example's un-jitted Adam step with a busy core took 18-21 ms at 2^21, 3.5-4.1 ms here
RUNNER_SINGLE_THREAD_FLOPS = 1 << 23
SOFTMAX_NS_PER_ELEMENT = 0.25  # the fused attention's softmax, on one compute unit, per score


@dataclass(frozen=True)
class Gemm:
    """C[b] = op(A[b]) @ op(B[b]) for every batch index b, all in elements of the operand dtype."""

    dtype: dtypes.DType
    batch: tuple[int, ...]
    m: int
    n: int
    k: int
    trans_a: bool
    trans_b: bool
    lda: int
    ldb: int
    ldc: int
    a_offset: int
    b_offset: int
    a_batch: tuple[int, ...]
    b_batch: tuple[int, ...]
    c_batch: tuple[int, ...]
    bias_offset: int | None = None  # C = bias + op(A) @ op(B), bias: n elements at this offset (third input)

    @property
    def name(self) -> str:
        t = "".join("T" if f else "N" for f in (self.trans_a, self.trans_b))
        b = "x".join(map(str, self.batch)) + "x" if self.batch else ""
        bias = "_bias" if self.bias_offset is not None else ""
        return f"{'s' if self.dtype is dtypes.float32 else 'd'}gemm{bias}_{t}_{b}{self.m}x{self.n}x{self.k}"


def _find_mkl():
    """(sgemm, dgemm, int type, set-local-threads) from Intel MKL's ``libmkl_rt`` as the ``mkl`` wheel installs
    it (``pip install 'zyx[mkl]'``), or None. MKL's threads are GNU OpenMP's, the pool the kernels use."""
    roots = {os.path.join(sys.prefix, "lib"), os.path.join(sys.base_prefix, "lib")}
    for root in sorted(roots):
        for path in sorted(glob.glob(os.path.join(root, "libmkl_rt.so*"))):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            lib.MKL_Set_Threading_Layer.argtypes = [ctypes.c_int]
            lib.MKL_Set_Interface_Layer.argtypes = [ctypes.c_int]
            lib.MKL_Set_Threading_Layer(MKL_THREADING_GNU)
            lib.MKL_Set_Interface_Layer(MKL_INTERFACE_LP64)
            local = lib.MKL_Set_Num_Threads_Local
            local.argtypes, local.restype = [ctypes.c_int], ctypes.c_int
            return lib.cblas_sgemm, lib.cblas_dgemm, ctypes.c_int, local
    return None


def _find_openblas():
    """(sgemm, dgemm, int type, set-local-threads or None) from the OpenBLAS NumPy ships, or None."""
    import numpy

    roots = [os.path.join(os.path.dirname(os.path.dirname(numpy.__file__)), "numpy.libs"),
             os.path.join(os.path.dirname(numpy.__file__), ".dylibs")]
    names = [("scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", ctypes.c_int64),
             ("cblas_sgemm64_", "cblas_dgemm64_", ctypes.c_int64),
             ("scipy_cblas_sgemm", "scipy_cblas_dgemm", ctypes.c_int),
             ("cblas_sgemm", "cblas_dgemm", ctypes.c_int)]
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "*openblas*"))):
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            for s, d, it in names:
                if hasattr(lib, s) and hasattr(lib, d):
                    threads = getattr(lib, "openblas_set_num_threads_local", None)
                    if threads is not None:
                        threads.argtypes, threads.restype = [ctypes.c_int], ctypes.c_int
                    return getattr(lib, s), getattr(lib, d), it, threads
    return None


def _find_cblas(library: str = "auto"):
    """(name, (sgemm, dgemm, int type, set-local-threads or None)) of the CBLAS ``library`` selects ("auto": MKL
    when installed, it runs these GEMMs ~15% faster here; else NumPy's OpenBLAS), or None."""
    finders = {"mkl": [("mkl", _find_mkl)], "openblas": [("openblas", _find_openblas)]}
    for name, find in finders.get(library, finders["mkl"] + finders["openblas"]):
        found = find()
        if found is not None:
            return name, found
    if library == "mkl":
        raise BackendError(ErrorStatus.INITIALIZATION, "blas.library is 'mkl' but libmkl_rt is not installed: "
                           "pip install 'zyx[mkl]'")
    return None


@dataclass(frozen=True)
class _Split:
    """How one GEMM launch is spread: threads, blocks per batch index, along N (else M), batch offsets."""

    threads: int
    blocks: int
    along_n: bool
    offsets: np.ndarray


class BlasDevice(Device):
    """``compiler``: the host's ``CCompiler``; with OpenMP every GEMM runs on the OpenMP threads through the
    threaded runner (``threaded.py``: one thread pool for kernels and GEMMs), else GEMMs loop over their batch
    in Python and OpenBLAS threads itself."""

    def __init__(self, pool: HostPool, compiler=None, library: str = "auto") -> None:
        self._pool = pool
        self._programs: dict[int, Gemm | attention.AttentionPlan] = {}
        self._ids: dict[Gemm | attention.AttentionPlan, int] = {}
        self._splits: dict[int, _Split] = {}  # program -> its split (an int key: hashing a Gemm costs per launch)
        self._prepared: dict[int, attention.Prepared] = {}  # attention program -> its offsets and scratch
        self._compiler = compiler if compiler is not None and compiler.openmp else None
        self._threaded: threaded.ThreadedGemm | None | bool = None  # False: could not be built
        self._attention: attention.AttentionRunner | None | bool = None  # False: could not be built
        self._int_type = ctypes.c_int
        found = _find_cblas(library)
        self.backend = "cblas" if found else "numpy.matmul"
        self.library = found[0] if found else "numpy"  # "mkl", "openblas" or "numpy"
        self._set_threads = None
        if found:
            self._sgemm, self._dgemm, it, self._set_threads = found[1]
            self._int_type = it
            f, d, p = ctypes.c_float, ctypes.c_double, ctypes.c_void_p
            self._sgemm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, it, it, it, f, p, it, p, it, f, p, it]
            self._dgemm.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, it, it, it, d, p, it, p, it, d, p, it]
            self._sgemm.restype = self._dgemm.restype = None
        n = cpu_count()
        self._info = DeviceInfo(name="host", kind="blas", compute_units=n,
                                dtypes=frozenset({"float32", "float64"}), peak_gflops=40.0 * n,
                                launch_overhead_ns=LAUNCH_OVERHEAD_NS,
                                extra={"backend": self.backend, "library": self.library})

    def info(self) -> DeviceInfo:
        return self._info

    def pool(self) -> HostPool:
        return self._pool

    def compile(self, kernel) -> ProgramId:
        raise BackendError(ErrorStatus.UNSUPPORTED, "the BLAS device runs library matmuls only; generated "
                           "kernels go to the host device")

    def release(self, program: ProgramId) -> None:
        gemm = self._programs.pop(program, None)
        if gemm is not None:
            self._ids.pop(gemm, None)
            self._splits.pop(program, None)
            self._prepared.pop(program, None)

    # ---- matching ---------------------------------------------------------------------------------------------
    def match_graph(self, graph, outputs) -> None:
        planned_by_class = {}
        for mm in graph.matmuls():
            if mm.cls.device != "host":
                continue
            planned = plan_gemm(mm, graph)
            if planned is None:
                continue
            gemm, inputs = planned
            est = self._gemm_ns(mm.flops, gemm)
            graph.add_alternative(mm.cls, LibraryKernel(self, self._program(gemm), inputs, est, gemm.name, gemm))
            planned_by_class[id(mm.cls)] = (gemm, inputs)
        if self.backend == "cblas" and self._compiler is not None and self._runner() is not None:
            self._offer_biased_gemms(graph, planned_by_class)
            self._offer_attentions(graph)

    def _gemm_ns(self, flops: int, gemm: Gemm) -> float:
        gflops = self._info.peak_gflops / (2 if gemm.dtype is dtypes.float64 else 1)
        return flops / gflops + LAUNCH_OVERHEAD_NS * max(1, math.prod(gemm.batch) // 8)

    def _offer_biased_gemms(self, graph, planned_by_class: dict) -> None:
        """Every ``graph.bias_adds()`` over a planned GEMM whose rows run along the bias (not transposed to
        column-major output) as one GEMM that starts from the bias (``threaded.py``)."""
        for ba in graph.bias_adds():
            planned = planned_by_class.get(id(ba.matmul.cls))
            if planned is None:
                continue
            gemm, inputs = planned
            mm = ba.matmul
            if (gemm.m != mm.m or mm.out_col_stride != 1 or ba.cls.shape[-1] != gemm.n
                    or ba.bias.base.dtype is not gemm.dtype):
                continue
            biased = replace(gemm, bias_offset=ba.bias.offset)
            graph.add_alternative(ba.cls, LibraryKernel(self, self._program(biased), inputs + (ba.bias.base,),
                                                        self._gemm_ns(mm.flops, biased), biased.name, biased))

    def _program(self, plan: Gemm | attention.AttentionPlan) -> ProgramId:
        pid = self._ids.get(plan)
        if pid is None:
            pid = len(self._programs) + 1
            while pid in self._programs:
                pid += 1
            self._programs[pid] = plan
            self._ids[plan] = pid
        return pid

    def _offer_attentions(self, graph) -> None:
        """A fused attention alternative (``attention.py``) for every host attention the kernel can run."""
        for att in graph.attentions():
            if att.cls.device != "host" or self._attention_runner() is None:
                continue
            plan = attention.plan_attention(att)
            if isinstance(plan, str):
                log("sched", f"host: no fused attention for {att.cls.shape}: {plan}")
                continue
            gflops = self._info.peak_gflops / (2 if plan.dtype is dtypes.float64 else 1)
            softmax_ns = math.prod(plan.batch) * plan.L * plan.S * SOFTMAX_NS_PER_ELEMENT / self._info.compute_units
            est = plan.flops / gflops + softmax_ns + LAUNCH_OVERHEAD_NS * max(1, math.prod(plan.batch) // 8)
            inputs = (att.q.base, att.k.base, att.v.base) + ((att.mask.base,) if att.mask is not None else ())
            graph.add_alternative(att.cls, LibraryKernel(self, self._program(plan), inputs, est, plan.name, plan))

    # ---- running ----------------------------------------------------------------------------------------------
    def launch(self, program: ProgramId, args: Sequence[int]) -> None:
        g = self._programs[program]
        if type(g) is attention.AttentionPlan:
            self._launch_attention(program, g, args)
            return
        STATS["launches"] += 1
        STATS["library_launches"] += 1
        if g.bias_offset is not None:  # offered only with the runner
            a, b, bias, c = (self._pool.address(x) for x in args)
            sp = self._splits.get(program) or self._split(program, g)
            self._threaded.run(g.dtype.itemsize, sp.threads, g.trans_a, g.trans_b, g.m, g.n, g.k, a, g.lda, b,
                               g.ldb, c, g.ldc, sp.offsets, sp.blocks, sp.along_n,
                               bias + g.bias_offset * g.dtype.itemsize)
            return
        a, b, c = (self._pool.address(x) for x in args)
        size = g.dtype.itemsize
        if self.backend != "cblas":
            self._numpy_gemm(g, args)
            return
        runner = self._runner()
        if runner is not None:
            sp = self._splits.get(program) or self._split(program, g)
            runner.run(size, sp.threads, g.trans_a, g.trans_b, g.m, g.n, g.k, a, g.lda, b, g.ldb, c, g.ldc,
                       sp.offsets, sp.blocks, sp.along_n)
            return
        fn = self._sgemm if g.dtype is dtypes.float32 else self._dgemm
        ta, tb = (TRANS if g.trans_a else NO_TRANS), (TRANS if g.trans_b else NO_TRANS)
        # small GEMMs run on this thread: waking BLAS worker threads costs more than it saves, and they
        # fight the generated kernels' OpenMP threads for the cores
        single = self._set_threads is not None and 2 * g.m * g.n * g.k < SINGLE_THREAD_FLOPS
        prev = self._set_threads(1) if single else 0
        try:
            for idx in itertools.product(*(range(s) for s in g.batch)):
                oa = g.a_offset + sum(i * s for i, s in zip(idx, g.a_batch))
                ob = g.b_offset + sum(i * s for i, s in zip(idx, g.b_batch))
                oc = sum(i * s for i, s in zip(idx, g.c_batch))
                fn(ROW_MAJOR, ta, tb, g.m, g.n, g.k, 1.0, a + oa * size, g.lda, b + ob * size, g.ldb, 0.0,
                   c + oc * size, g.ldc)
        finally:
            if single:
                self._set_threads(prev)

    def _runner(self) -> threaded.ThreadedGemm | None:
        """The threaded GEMM runner, compiled on first use; None without OpenMP or when it cannot be built (then
        the BLAS library threads itself)."""
        if self._threaded is None:
            self._threaded = self._build(threaded.source, "zyx_threaded_gemm", threaded.ThreadedGemm)
        return self._threaded or None

    def _build(self, source, name: str, runner_class):
        """``runner_class`` over the library compiled from ``source(int type)``, or False (logged) when the host
        has no OpenMP compiler or the build fails."""
        if self._compiler is None:
            return False
        try:
            lib = self._compiler.compile(source(self._int_type), name)
        except BackendError as e:
            log("dev", f"blas: {name} unavailable ({e.context})")
            return False
        return runner_class(lib, self._sgemm, self._dgemm, self._set_threads, self._int_type)

    def _launch_attention(self, program: ProgramId, plan: attention.AttentionPlan, args: Sequence[int]) -> None:
        STATS["launches"] += 1
        STATS["library_launches"] += 1
        runner = self._attention
        prep = self._prepared.get(program)
        if prep is None:
            threads = 1 if plan.flops < RUNNER_SINGLE_THREAD_FLOPS else self._info.compute_units
            prep = self._prepared[program] = runner.prepare(plan, threads)
        addr = [self._pool.address(x) for x in args]
        mask = addr[3] if plan.mask is not None else None
        runner.run(plan, prep, addr[0], addr[1], addr[2], mask, addr[-1])

    def _attention_runner(self) -> attention.AttentionRunner | None:
        """The fused attention kernel, compiled at the first attention planned; None when it cannot be built
        (then attention is not offered and runs as GEMMs and generated kernels)."""
        if self._attention is None:
            self._attention = self._build(attention.source, "zyx_attention", attention.AttentionRunner)
        return self._attention or None

    def _split(self, program: ProgramId, g: Gemm) -> _Split:
        """How ``program``'s GEMM is spread over the runner's threads (computed once per program)."""
        batch = math.prod(g.batch)
        threads = 1 if 2 * g.m * g.n * g.k * batch < RUNNER_SINGLE_THREAD_FLOPS else self._info.compute_units
        along_n = g.m < 64 * threads < g.n  # rows unless there are too few of them
        span = g.n if along_n else g.m
        blocks = 1 if batch == 0 or batch >= threads else max(1, min(-(-threads // batch), span // 32))
        sp = self._splits[program] = _Split(threads, blocks, along_n, threaded.batch_offsets(
            g.batch, g.a_offset, g.b_offset, g.a_batch, g.b_batch, g.c_batch))
        return sp

    def _numpy_gemm(self, g: Gemm, args: Sequence[int]) -> None:
        views = [self._pool.view(x).view(g.dtype.np_dtype) for x in args]

        def mat(buf, off, batch, rows, cols, ld, trans):
            shape = tuple(g.batch) + ((cols, rows) if trans else (rows, cols))
            st = tuple(s * g.dtype.itemsize for s in batch) + (ld * g.dtype.itemsize, g.dtype.itemsize)
            v = np.lib.stride_tricks.as_strided(buf[off:], shape, st)
            return np.swapaxes(v, -1, -2) if trans else v

        a = mat(views[0], g.a_offset, g.a_batch, g.m, g.k, g.lda, g.trans_a)
        b = mat(views[1], g.b_offset, g.b_batch, g.k, g.n, g.ldb, g.trans_b)
        c = mat(views[2], 0, g.c_batch, g.m, g.n, g.ldc, False)
        np.matmul(a, b, out=c)

    def launch_timed(self, program: ProgramId, args: Sequence[int]) -> int:
        t0 = time.perf_counter_ns()
        self.launch(program, args)
        return time.perf_counter_ns() - t0


def plan_gemm(mm, graph) -> tuple[Gemm, tuple] | None:
    """A row-major GEMM for a matmul match of ``graph``, with its input classes, or None when BLAS cannot run it."""
    d = mm.acc_dtype
    if d not in (dtypes.float32, dtypes.float64):
        return None
    inputs = []
    for op in (mm.a, mm.b):
        src = op.view.base
        if src.dtype is not d:
            if not src.dtype.is_float:
                return None
            src = graph.cast(src, d)  # half inputs: widened by a generated kernel, then BLAS in float32
        if op.view.offset < 0:
            return None
        if any(s < 0 for s in op.batch_strides + (op.row_stride, op.col_stride)):
            return None
        inputs.append(src)
    m, n, k = mm.m, mm.n, mm.k
    a, b = mm.a, mm.b
    a_rows, a_cols, a_rs, a_cs = m, k, a.row_stride, a.col_stride
    b_rows, b_cols, b_rs, b_cs = k, n, b.row_stride, b.col_stride
    c_rs, c_cs = mm.out_row_stride, mm.out_col_stride
    swap = not (n == 1 or c_cs == 1)
    if swap:  # column-major output: compute C^T = B^T A^T
        if not (m == 1 or c_rs == 1):
            return None
        a_rows, a_cols, a_rs, a_cs, b_rows, b_cols, b_rs, b_cs = n, k, b_cs, b_rs, k, m, a_cs, a_rs
        m, n = n, m
        c_rs, c_cs = c_cs, c_rs
    la, lb = threaded.matrix_layout(a_rows, a_cols, a_rs, a_cs), threaded.matrix_layout(b_rows, b_cols, b_rs,
                                                                                        b_cs)
    ldc = c_rs if m > 1 else max(n, 1)
    if la is None or lb is None or ldc < max(n, 1):
        return None
    first, second = (mm.b, mm.a) if swap else (mm.a, mm.b)
    gemm = Gemm(d, mm.batch, m, n, mm.k, la[0], lb[0], la[1], lb[1], ldc, first.view.offset, second.view.offset,
                first.batch_strides, second.batch_strides, mm.out_batch_strides)
    ins = (inputs[1], inputs[0]) if swap else (inputs[0], inputs[1])
    return gemm, ins

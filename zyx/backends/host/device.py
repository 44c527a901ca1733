"""Host device: kernel IR → C (+ OpenMP) → system compiler → ctypes. Launches run synchronously.

With autotuning on (``zyx.backends.autotune``), ``compile`` first asks the tuner for the passes' parameters
(cached, or searched by timing candidates on scratch buffers); off, the heuristics choose."""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import time
from collections.abc import Mapping, Sequence

from zyx import dtypes, utils
from zyx.backends import autotune
from zyx.backends.base import BackendError, Device, DeviceInfo, ErrorStatus, ProgramId
from zyx.backends.host.compiler import CCompiler
from zyx.backends.host.pool import HostPool
from zyx.kernel import opt
from zyx.kernel.ir import Kernel
from zyx.kernel.render import CRenderer
from zyx.utils import STATS, debug_on, log

_CTYPES = {"bool": ctypes.c_bool, "int8": ctypes.c_int8, "uint8": ctypes.c_uint8, "int16": ctypes.c_int16,
           "uint16": ctypes.c_uint16, "int32": ctypes.c_int32, "uint32": ctypes.c_uint32, "int64": ctypes.c_int64,
           "uint64": ctypes.c_uint64, "float32": ctypes.c_float, "float64": ctypes.c_double,
           "float16": ctypes.c_float, "bfloat16": ctypes.c_float}


# Idle OpenMP threads spin before they sleep; with the default spin (300,000 rounds) they take the cores
# from the BLAS threads that usually run next (2.5x slower MLP forward on 2 cores). A short spin keeps
# back-to-back kernels cheap. Set before libgomp starts; a user's own setting wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "100000")


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


@functools.cache
def _cpu_model() -> str:
    """The CPU's model name (timings are only comparable on the same model); "" when unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


class _Program:
    """A compiled kernel and its packed launch arguments.

    ``packed`` holds argument arrays built once (a ``void*`` per parameter; a variable's slot points at its own
    ctypes scalar) that launches refill in place: only buffer addresses and variable values change. An array
    is taken out of the list while a launch uses it (list pop/append are atomic), so two threads launching the
    same program never share one."""

    __slots__ = ("fn", "kinds", "var_types", "name", "lib", "source", "packed")

    def __init__(self, fn, kernel: Kernel, lib, source: str) -> None:
        self.fn, self.lib, self.source, self.name = fn, lib, source, kernel.name
        self.kinds = tuple(p.kind for p in kernel.params)
        self.var_types = tuple(_CTYPES[p.dtype.name] if p.kind == "var" else None for p in kernel.params)
        self.packed: list[tuple] = []

    def new_packed(self) -> tuple:
        """A fresh (array, [(index, scalar or None)]) for this program's parameters."""
        arr = (ctypes.c_void_p * len(self.var_types))()
        slots = []
        for i, t in enumerate(self.var_types):
            v = None if t is None else t()
            if v is not None:
                arr[i] = ctypes.addressof(v)
            slots.append((i, v))
        return arr, slots


# The generated register-tiled GEMM's rate for the cost model (float32; float64 half): the BLAS device's estimate
# (40 per thread). A plain matmul keeps the library (its launch is counted cheaper; the two GEMMs within 10% of each
# other at 1024^3); one whose operand BLAS needs copied out first goes generated, which packs its panels from the
# view itself: every convolution measured (2 cores, medians of 3 processes, forward; im2col + sgemm -> generated):
# 3x3 64 -> 64 at 8x56^2 10.8 -> 7.2 ms, 128 -> 128 at 8x28^2 9.3 -> 6.1, 256 -> 256 at 8x14^2 8.5 -> 6.4, 3x3
# stride 2 64 -> 128 5.1 -> 3.3, 1x1 64 -> 256 at 8x56^2 4.2 -> 2.3 (a 7x7 stride-2 stem, 3 -> 32: 1.38 -> 1.50;
# 1.04 since the windowed packs of 198ab61).
CONTRACTION_GFLOPS_PER_THREAD = 40.0


class HostDevice(Device):
    def __init__(self, pool: HostPool, cc: str = "cc", openmp: bool = True, threads: int | None = None) -> None:
        self._pool = pool
        self.renderer = CRenderer()
        self.compiler = CCompiler(cc, openmp, prelude=self.renderer.prelude())
        self.threads = threads or cpu_count()
        self._programs: dict[int, _Program] = {}
        self._by_source: dict[str, int] = {}
        self._next = 1
        self._info = DeviceInfo(name="host", kind="host", compute_units=self.threads,
                                dtypes=frozenset(d.name for d in dtypes.ALL), vector_bytes=self.compiler.simd[0],
                                vector_registers=self.compiler.simd[1],
                                peak_gflops=8.0 * self.threads * 2, memory_gbps=8.0 * min(self.threads, 4),
                                launch_overhead_ns=5_000,
                                contraction_gflops=CONTRACTION_GFLOPS_PER_THREAD * self.threads)

    def info(self) -> DeviceInfo:
        return self._info

    def pool(self) -> HostPool:
        return self._pool

    def render(self, kernel: Kernel, params: Mapping[str, int] | None = None) -> str:
        """The C source of ``kernel`` under the passes' ``params`` (None: the heuristics)."""
        return self.renderer.render(opt.optimize(kernel, self._info, params))

    def compile(self, kernel: Kernel) -> ProgramId:
        return self.compile_many([kernel])[0]

    def compile_many(self, kernels: Sequence[Kernel]) -> list[ProgramId]:
        """Programs of ``kernels``: rendered in order, the libraries missing from the disk cache built together
        (``CCompiler.build_many``: batches, one compiler process per core), then loaded in order."""
        sources = []
        for k in kernels:
            if utils.KERNEL_LOG is not None:
                utils.KERNEL_LOG.append(k)
            params = autotune.tuned_params(self, k) if autotune.active() else None
            sources.append(self.render(k, params))
        missing = [(src, k.name) for k, src in zip(kernels, sources) if src not in self._by_source]
        if len(missing) > 1:
            t0 = time.perf_counter()
            self.compiler.build_many(missing, self.threads)
            if debug_on("compile"):
                log("compile", f"{len(missing)} kernels built together in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        return [self._program(k, src) for k, src in zip(kernels, sources)]

    # ---- autotuning (``autotune.Tunable``) ---------------------------------------------------------------------------
    def tuning_space(self, kernel: Kernel) -> dict[str, tuple[int, ...]]:
        return opt.search_space(kernel, self._info)

    def tuning_identity(self) -> str:
        return "|".join(("host", autotune.info_identity(self._info), self.compiler.cc, self.compiler.version,
                         " ".join(self.compiler.flags), platform.machine(), _cpu_model(), str(self.threads)))

    def render_candidate(self, kernel: Kernel, params: Mapping[str, int]) -> str:
        return self.render(kernel, params)

    def compile_candidate(self, kernel: Kernel, params: Mapping[str, int] | None) -> tuple[ProgramId, bool]:
        """The program of ``kernel`` under ``params`` (never tuned) and whether this call created it."""
        src = self.render(kernel, params)
        created = src not in self._by_source
        return self._program(kernel, src), created

    def _program(self, kernel: Kernel, src: str) -> ProgramId:
        """The program of ``kernel`` rendered as ``src``: the loaded one, or a new one (compiled when its library
        is not on disk yet)."""
        pid = self._by_source.get(src)
        if pid is not None:
            return pid
        if debug_on("ir"):
            log("ir", f"{kernel.name}: loops={kernel.loops} stores={kernel.stores}")
        if debug_on("asm"):
            log("asm", src)
        t0 = time.perf_counter()
        cached = debug_on("compile") and self.compiler.library_path(src).exists()
        lib = self.compiler.compile(src, kernel.name)
        STATS["compiles"] += 1
        how = "loaded" if cached else "compiled"
        log("compile", f"{kernel.name} {how} in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        if self.compiler.openmp:
            lib.zyx_set_threads(ctypes.c_int(self.threads))
        fn = getattr(lib, kernel.name)
        fn.restype = None  # no argtypes: the packed array passes as its address without a conversion (3 us less cold)
        pid = self._next
        self._next += 1
        self._programs[pid] = _Program(fn, kernel, lib, src)
        self._by_source[src] = pid
        return pid

    def source(self, program: ProgramId) -> str:
        return self._programs[program].source

    def _pack(self, prog: _Program, args: Sequence[int]) -> tuple:
        """A packed argument array of ``prog`` holding ``args`` (taken from ``prog.packed``; give it back)."""
        if len(args) != len(prog.kinds):
            raise BackendError(ErrorStatus.LAUNCH, f"kernel {prog.name} takes {len(prog.kinds)} arguments, "
                               f"got {len(args)}")
        packed = prog.packed.pop() if prog.packed else prog.new_packed()
        arr, slots = packed
        address = self._pool.addresses.__getitem__
        for (i, v), a in zip(slots, args):
            if v is None:
                arr[i] = address(a)
            else:
                v.value = a
        return packed

    def launch(self, program: ProgramId, args: Sequence[int]) -> None:
        prog = self._programs[program]
        packed = self._pack(prog, args)
        STATS["launches"] += 1
        try:
            if utils.DEBUG and debug_on("launch"):
                t0 = time.perf_counter()
                prog.fn(packed[0])
                log("launch", f"{prog.name} {(time.perf_counter() - t0) * 1e6:.1f} us")
            else:
                prog.fn(packed[0])
        finally:
            prog.packed.append(packed)

    def launch_timed(self, program: ProgramId, args: Sequence[int]) -> int:
        prog = self._programs[program]
        packed = self._pack(prog, args)
        try:
            t0 = time.perf_counter_ns()
            prog.fn(packed[0])
            return time.perf_counter_ns() - t0
        finally:
            prog.packed.append(packed)

    def release(self, program: ProgramId) -> None:
        prog = self._programs.pop(program, None)
        if prog is not None:
            self._by_source.pop(prog.source, None)

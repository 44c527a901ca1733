"""``CudaDevice``: generated kernels and cuDNN matmuls on one GPU, on top of its worker thread.

Invariants:
- ``compile`` = ``zyx.kernel.gpu.optimize`` -> ``CUDARenderer().render`` -> NVRTC to a **cubin for the device's exact
  ``sm_XY``** (never PTX: a newer NVRTC's PTX is refused by an older driver) -> ``cuModuleLoadData`` on the worker.
  Programs are cached by rendered source, so identical kernels share one module.
- ``launch`` checks the argument count here (a bug surfaces at the call) and is otherwise asynchronous: it joins the
  worker's window; its errors surface at the next sync point naming the kernel. ``launch_timed`` drains first and
  times the launch alone with timing events. ``release`` unloads the module once its queued launches completed.
- With autotuning on (``zyx.backends.autotune``), ``compile`` takes the geometry's parameters from the tuner (cached, or
  searched with ``launch_timed`` on scratch buffers); off, ``gpu.optimize``'s heuristics choose.
- ``info()`` comes from the device attributes; the bandwidth and tensor-core peaks feed the cost model (measured
  values for the H200 the project targets, estimates from clocks and SM counts elsewhere).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from zyx import dtypes, utils
from zyx.backends import autotune
from zyx.backends.base import BackendError, Device, DeviceInfo, ErrorStatus, ProgramId
from zyx.backends.cuda.args import KernelSpec, scalar_format
from zyx.backends.cuda.pool import CudaPool
from zyx.utils import STATS, debug_on, log

# name fragment -> (device-to-device copy GB/s, dense bf16/f16 tensor-core TFLOP/s, fp32 SIMT TFLOP/s)
KNOWN_GPUS: tuple[tuple[str, float, float, float], ...] = (
    ("H200", 4300.0, 990.0, 67.0),
)

# dense f16/bf16 tensor-core flops per SM per clock, by compute capability (estimates for unknown GPUs)
_TENSOR_FLOPS_PER_CLOCK = {(7, None): 1024, (8, 0): 2048, (8, None): 512, (9, None): 4096, (10, None): 8192}


def _per_clock(cc: tuple[int, int]) -> int:
    return _TENSOR_FLOPS_PER_CLOCK.get(cc, _TENSOR_FLOPS_PER_CLOCK.get((cc[0], None), 1024))


def device_info(name: str, device_name: str, attrs: dict[str, int], total_memory: int = 0,
                allow_tf32: bool = False) -> DeviceInfo:
    """A ``DeviceInfo`` from the driver's device attributes (``driver.DEVICE_ATTRIBUTES`` names); ``allow_tf32``
    (the ``cuda.allow_tf32`` config) is reported only where tf32 tensor cores exist (sm_80+)."""
    cc = (attrs.get("COMPUTE_CAPABILITY_MAJOR", 0), attrs.get("COMPUTE_CAPABILITY_MINOR", 0))
    sms = max(attrs.get("MULTIPROCESSOR_COUNT", 1), 1)
    clock_hz = (attrs.get("CLOCK_RATE", 0) or 1_500_000) * 1e3
    mem_hz = attrs.get("MEMORY_CLOCK_RATE", 0) * 1e3
    bus_bytes = attrs.get("GLOBAL_MEMORY_BUS_WIDTH", 0) / 8
    copy_gbps = 0.85 * 2 * mem_hz * bus_bytes / 1e9 if mem_hz and bus_bytes else 1000.0
    half_tflops = sms * clock_hz * _per_clock(cc) / 1e12
    simt_lanes = 64 if cc[0] < 8 or cc == (8, 0) else 128
    fp32_tflops = sms * clock_hz * simt_lanes * 2 / 1e12
    for fragment, gbps, tensor, simt in KNOWN_GPUS:
        if fragment in device_name:
            copy_gbps, half_tflops, fp32_tflops = gbps, tensor, simt
            break
    tensor_cores = cc[0] >= 7
    tensor_tflops = {"float16": half_tflops, "bfloat16": half_tflops if cc >= (8, 0) else fp32_tflops,
                     "float32": half_tflops / 2 if cc >= (8, 0) else fp32_tflops,  # TF32 from Ampere on
                     "float64": fp32_tflops if cc[0] >= 8 else fp32_tflops / 32}
    if not tensor_cores:
        tensor_tflops = {k: fp32_tflops for k in tensor_tflops}
    names = {d.name for d in dtypes.ALL}
    if cc < (8, 0):
        names.discard("bfloat16")
    if cc < (5, 3):
        names.discard("float16")
    shared = attrs.get("MAX_SHARED_MEMORY_PER_BLOCK", 48 << 10)
    return DeviceInfo(
        name=name, kind="cuda", compute_units=sms,
        max_global_work=(attrs.get("MAX_GRID_DIM_X", 2**31 - 1), attrs.get("MAX_GRID_DIM_Y", 65535),
                         attrs.get("MAX_GRID_DIM_Z", 65535)),
        max_local_work=(attrs.get("MAX_BLOCK_DIM_X", 1024), attrs.get("MAX_BLOCK_DIM_Y", 1024),
                        attrs.get("MAX_BLOCK_DIM_Z", 64)),
        max_local_threads=attrs.get("MAX_THREADS_PER_BLOCK", 1024), local_memory_bytes=shared,
        shared_optin_bytes=attrs.get("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", shared),
        warp_size=attrs.get("WARP_SIZE", 32), compute_capability=cc, dtypes=frozenset(names),
        tensor_cores=tensor_cores, allow_tf32=allow_tf32 and tensor_cores and cc >= (8, 0), vector_bytes=16,
        peak_gflops=fp32_tflops * 1e3, memory_gbps=copy_gbps,
        launch_overhead_ns=4_000,
        extra={"device_name": device_name, "arch": f"sm_{cc[0]}{cc[1]}", "shared_optin_bytes":
               attrs.get("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", shared), "l2_bytes": attrs.get("L2_CACHE_SIZE", 0),
               "registers_per_block": attrs.get("MAX_REGISTERS_PER_BLOCK", 65536), "total_memory": total_memory,
               "tensor_tflops": tensor_tflops})


class CudaDevice(Device):
    def __init__(self, pool: CudaPool, cudnn: bool = True, allow_tf32: bool = False,
                 cudnn_unavailable: str | None = None) -> None:
        self._pool = pool
        self.worker = pool.worker
        self.name = pool.name
        w = self.worker
        self._info = device_info(self.name, w.device_name, w.attrs, w.total_memory, allow_tf32)
        cc = self._info.compute_capability or (0, 0)
        self.arch = f"sm_{cc[0]}{cc[1]}"
        self._optimize = w.drv.executes_machine_code  # NVRTC's full optimization only for code that runs
        self._lock = threading.Lock()
        self._renderer: Any = None
        self._by_source: dict[str, int] = {}
        self._sources: dict[int, str] = {}
        self._kinds: dict[int, tuple[str, ...]] = {}
        self._names: dict[int, str] = {}
        self._library: set[int] = set()
        self._identity: str | None = None
        self._cudnn: Any = None
        if cudnn:
            from zyx.backends.cuda.cudnn import CudnnMatmul

            self._cudnn = CudnnMatmul(self, allow_tf32, cudnn_unavailable)

    def __repr__(self) -> str:
        return f"CudaDevice({self.name}, {self._info.extra.get('device_name', '?')}, {self.arch})"

    def info(self) -> DeviceInfo:
        return self._info

    def pool(self) -> CudaPool:
        return self._pool

    # ---- programs --------------------------------------------------------------------------------------------------
    def _codegen(self):
        try:
            from zyx.backends.cuda import nvrtc
            from zyx.kernel import gpu
            from zyx.kernel.render_cuda import CUDARenderer
        except ImportError as e:
            raise BackendError(ErrorStatus.COMPILATION, f"{self.name}: the CUDA code generator is not available "
                               f"({e})") from None
        if self._renderer is None:
            self._renderer = CUDARenderer()
        return gpu, self._renderer, nvrtc

    def compile(self, kernel: Any) -> ProgramId:
        if utils.KERNEL_LOG is not None:
            utils.KERNEL_LOG.append(kernel)
        params = None
        if autotune.active():
            self._nvrtc_or_raise(kernel)
            params = autotune.tuned_params(self, kernel)
        return self.compile_candidate(kernel, params)[0]

    def compile_many(self, kernels: Sequence[Any]) -> list[ProgramId]:
        """Programs of ``kernels`` (as ``compile``, in order); first the NVRTC runs of the kernels this device has
        not loaded run in parallel threads, and the driver prepares their modules (the emulator builds them in
        parallel). Errors are left to ``compile``, which raises them for their kernel."""
        if len(kernels) > 1 and not autotune.active():
            self._prebuild(kernels)
        return [self.compile(k) for k in kernels]

    def _prebuild(self, kernels: Sequence[Any]) -> None:
        gpu, renderer, nvrtc = self._codegen()
        if nvrtc.available() is not None:
            return
        todo: dict[str, str] = {}
        for k in kernels:
            try:
                src = renderer.render(gpu.optimize(k, self._info, None))
            except Exception:  # noqa: BLE001 - compile() raises it, for this kernel
                continue
            with self._lock:
                if src.source not in self._by_source:
                    todo[src.source] = src.name
        if len(todo) < 2:
            return

        def build(item: tuple[str, str]) -> bytes | None:
            try:
                return nvrtc.compile_cubin(item[0], item[1], self.arch, self._optimize)
            except Exception:  # noqa: BLE001 - compile() raises it, for this kernel
                return None

        with ThreadPoolExecutor(min(len(todo), os.cpu_count() or 1)) as pool:
            cubins = [c for c in pool.map(build, todo.items()) if c is not None]
        self.worker.drv.prepare_modules(cubins)

    def _nvrtc_or_raise(self, kernel: Any) -> Any:
        gpu, renderer, nvrtc = self._codegen()
        reason = nvrtc.available()
        if reason is not None:
            raise BackendError(ErrorStatus.COMPILATION, f"{self.name}: cannot compile {kernel.name}: NVRTC "
                               f"unavailable: {reason}")
        return gpu, renderer, nvrtc

    # ---- autotuning (``autotune.Tunable``) ---------------------------------------------------------------------------
    def tuning_space(self, kernel: Any) -> dict[str, tuple[int, ...]]:
        gpu, _, _ = self._codegen()
        return gpu.search_space(kernel, self._info)

    def tuning_identity(self) -> str:
        """What makes this GPU's timings comparable: its info, exact sm, NVRTC and driver versions."""
        if self._identity is None:
            _, _, nvrtc = self._codegen()
            try:
                driver = self.worker.drv.driver_version()
            except Exception:  # noqa: BLE001 - a driver without the call: the rest still names it
                driver = 0
            self._identity = "|".join(str(x) for x in ("cuda", autotune.info_identity(self._info), self.arch,
                                                        nvrtc.nvrtc_version(), driver,
                                                        getattr(self.worker.drv, "note", "")))
        return self._identity

    def render_candidate(self, kernel: Any, params: Mapping[str, int]) -> str:
        gpu, renderer, _ = self._codegen()
        return renderer.render(gpu.optimize(kernel, self._info, params)).source

    def compile_candidate(self, kernel: Any, params: Mapping[str, int] | None) -> tuple[ProgramId, bool]:
        """The program of ``kernel`` under the geometry's ``params`` (never tuned) and whether this call created
        it."""
        gpu, renderer, nvrtc = self._nvrtc_or_raise(kernel)
        k = gpu.optimize(kernel, self._info, params)
        src = renderer.render(k)
        with self._lock:
            pid = self._by_source.get(src.source)
        if pid is not None:
            return pid, False
        if debug_on("ir"):
            log("ir", f"{self.name} {k.name}: grid={src.grid} block={src.block} shared={src.shared_bytes}")
        if debug_on("asm"):
            log("asm", src.source)
        kinds = tuple(src.param_kinds)
        if len(kinds) != len(k.params):
            raise BackendError(ErrorStatus.COMPILATION, f"{self.name}: kernel {src.name} renders {len(kinds)} "
                               f"parameters for {len(k.params)} kernel params")
        ctypes_ = tuple(getattr(src, "param_types", ()) or ()) or (None,) * len(kinds)
        formats = tuple(scalar_format(p.dtype.name, ct) if kind == "var" else None
                        for p, kind, ct in zip(k.params, kinds, ctypes_))
        t0 = time.perf_counter()
        try:
            cubin = nvrtc.compile_cubin(src.source, src.name, self.arch, self._optimize)
        except BackendError:
            raise
        except Exception as e:  # noqa: BLE001 - NVRTC missing or failing: say which kernel and what to install
            raise BackendError(ErrorStatus.COMPILATION, f"{self.name}: NVRTC could not compile {src.name} for "
                               f"{self.arch}: {type(e).__name__}: {e}") from None
        STATS["compiles"] += 1
        log("compile", f"{self.name} {src.name} ({self.arch}) in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        spec = KernelSpec(src.name, tuple(src.grid), tuple(src.block), int(src.shared_bytes), kinds, formats)
        pid = self.worker.load_module(bytes(cubin), spec)
        with self._lock:
            existing = self._by_source.get(src.source)
            if existing is None:
                self._by_source[src.source] = pid
                self._sources[pid] = src.source
                self._kinds[pid] = kinds
                self._names[pid] = src.name
        if existing is not None:  # another thread compiled the same source meanwhile
            self.worker.release_program(pid)
            return existing, False
        return pid, True

    def compile_source(self, source: str, spec: KernelSpec) -> ProgramId:
        """Compile raw CUDA C (an ``extern "C" __global__`` function named ``spec.name``) for this GPU's exact sm and
        load it; ``spec`` says how to launch it. For hand-written kernels, tests and benchmarks."""
        _, _, nvrtc = self._codegen()
        reason = nvrtc.available()
        if reason is not None:
            raise BackendError(ErrorStatus.COMPILATION, f"{self.name}: cannot compile {spec.name}: NVRTC "
                               f"unavailable: {reason}")
        pid = self.worker.load_module(bytes(nvrtc.compile_cubin(source, spec.name, self.arch, self._optimize)), spec)
        with self._lock:
            self._sources[pid] = source
            self._kinds[pid] = spec.kinds
            self._names[pid] = spec.name
        return pid

    def register_library(self, program: ProgramId, name: str, kinds: tuple[str, ...]) -> None:
        """Record a library program (cuDNN plan) registered with the worker, so launches can be checked."""
        with self._lock:
            self._kinds[program] = kinds
            self._names[program] = name
            self._library.add(program)

    def source(self, program: ProgramId) -> str:
        return self._sources[program]

    def _check_launch(self, program: ProgramId, args: Sequence[int]) -> None:
        """Raise at the call (not at the next sync) for an unknown program or a wrong argument count."""
        kinds = self._kinds.get(program)
        if kinds is None:
            raise BackendError(ErrorStatus.LAUNCH, f"{self.name}: launch of unknown program {program}")
        if len(args) != len(kinds):
            raise BackendError(ErrorStatus.LAUNCH, f"{self.name}: kernel {self._names[program]} takes {len(kinds)} "
                               f"arguments, got {len(args)}")

    def launch(self, program: ProgramId, args: Sequence[int]) -> None:
        kinds = self._kinds.get(program)
        if kinds is None or len(args) != len(kinds):
            self._check_launch(program, args)  # raises
        STATS["launches"] += 1
        if program in self._library:
            STATS["library_launches"] += 1
        self.worker.launch(program, args)

    def launch_batch(self, key: object, launches: Sequence[tuple[ProgramId, Sequence[int]]]) -> None:
        """The batch joins the worker's window; from its second run with the same structure it is one CUDA graph
        launch (``Worker.replay``)."""
        for program, args in launches:
            self._check_launch(program, args)
        STATS["launches"] += len(launches)
        STATS["library_launches"] += sum(1 for program, _ in launches if program in self._library)
        self.worker.replay(key, launches)

    def launch_timed(self, program: ProgramId, args: Sequence[int]) -> int:
        if program not in self._kinds:
            raise BackendError(ErrorStatus.LAUNCH, f"{self.name}: timed launch of unknown program {program}")
        return self.worker.launch_timed(program, args)

    def release(self, program: ProgramId) -> None:
        with self._lock:
            src = self._sources.pop(program, None)
            if src is not None and self._by_source.get(src) == program:
                del self._by_source[src]
            known = self._kinds.pop(program, None) is not None
            self._names.pop(program, None)
            library = program in self._library
            self._library.discard(program)
        if library and self._cudnn is not None:
            self._cudnn.forget(program)
        if known:
            self.worker.release_program(program)

    # ---- graph ---------------------------------------------------------------------------------------------------
    def match_graph(self, graph: Any, outputs: Sequence[Any]) -> None:
        if self._cudnn is not None:
            self._cudnn.match_graph(graph, outputs)

    def sync(self) -> None:
        self.worker.sync()

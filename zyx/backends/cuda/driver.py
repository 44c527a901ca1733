"""A small typed wrapper over the CUDA driver API of cuda-python (``cuda.bindings.driver``).

Invariants:
- ``Driver`` is the only object of the CUDA backend that calls ``cuda.bindings``; its methods take and return plain
  Python ints / floats / bytes (handles and pointers as ints) and raise ``DriverError`` (a ``BackendError``) naming
  the failed call and the driver's error name and description.
- A ``Driver`` holds no GPU state. For one GPU, every call is made by that GPU's worker thread (which made the
  primary context current); only ``load_driver`` / ``device_count`` run before the workers exist.
- The worker uses nothing but the methods below, so a test double with the same methods can replace a ``Driver``
  (``tests/backends/test_cuda_backend.py`` has one that simulates device memory with host memory).
- The bindings are cuda-python's ``cuda.bindings.driver``, or the emulated driver (``zyx.backends.cuda.emulator``,
  chosen by ``load_driver(emulate=True)``) with the same calls; the choice is made once, here. The bindings may
  also provide the cuDNN frontend (``cudnn_frontend()``) and a ``note`` saying what they are.
- Availability is probed without crashing: a missing cuda-python, a missing libcuda (cuda-python raises
  ``cuda.pathfinder.DynamicLibNotFoundError``, a ``RuntimeError``) or a failing ``cuInit`` becomes a
  ``BackendError(INITIALIZATION, reason)`` with a reason a person can act on.
"""

from __future__ import annotations

from typing import Any

from zyx.backends.base import BackendError, ErrorStatus

NO_CUDA_PYTHON = "cuda-python not installed: pip install 'zyx[cuda]'"
NO_LIBCUDA = "libcuda.so not found: no NVIDIA driver on this machine"

# Errors after which the CUDA context is unusable: every later call of the process fails the same way.
STICKY_ERRORS = frozenset({
    "CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ASSERT", "CUDA_ERROR_LAUNCH_TIMEOUT",
    "CUDA_ERROR_ECC_UNCORRECTABLE", "CUDA_ERROR_CONTEXT_IS_DESTROYED", "CUDA_ERROR_TENSOR_MEMORY_LEAK",
})
OUT_OF_MEMORY = "CUDA_ERROR_OUT_OF_MEMORY"
NOT_READY = 600
PEER_ACCESS_ALREADY_ENABLED = 704

# Device attributes the worker reads at start (names without the CU_DEVICE_ATTRIBUTE_ prefix).
DEVICE_ATTRIBUTES = (
    "MULTIPROCESSOR_COUNT", "MAX_THREADS_PER_BLOCK", "MAX_BLOCK_DIM_X", "MAX_BLOCK_DIM_Y", "MAX_BLOCK_DIM_Z",
    "MAX_GRID_DIM_X", "MAX_GRID_DIM_Y", "MAX_GRID_DIM_Z", "MAX_SHARED_MEMORY_PER_BLOCK",
    "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", "WARP_SIZE", "COMPUTE_CAPABILITY_MAJOR", "COMPUTE_CAPABILITY_MINOR",
    "L2_CACHE_SIZE", "MAX_REGISTERS_PER_BLOCK", "MEMORY_POOLS_SUPPORTED", "CLOCK_RATE", "MEMORY_CLOCK_RATE",
    "GLOBAL_MEMORY_BUS_WIDTH",
)


class DriverError(BackendError):
    """A failed driver call: ``code`` is the CUresult value, ``name`` its name (``CUDA_ERROR_OUT_OF_MEMORY``)."""

    def __init__(self, status: ErrorStatus, context: str, code: int, name: str) -> None:
        super().__init__(status, context)
        self.code = code
        self.name = name

    @property
    def sticky(self) -> bool:
        """True when the context is corrupted and the process must restart to use this GPU again."""
        return self.name in STICKY_ERRORS


def _bindings():
    from cuda.bindings import driver as cu  # optional dependency: imported on first use

    return cu


def error_text(code: int, cu: Any = None) -> tuple[str, str]:
    """(name, description) of a CUresult from the bindings ``cu`` (default: cuda-python's); falls back to the enum
    name when libcuda cannot describe it."""
    if cu is None:
        try:
            cu = _bindings()
        except ImportError:
            return f"CUresult {int(code)}", "unknown error"
    try:
        err, name = cu.cuGetErrorName(code)
        err2, desc = cu.cuGetErrorString(code)
        if not err and not err2:
            return name.decode(), desc.decode()
    except (RuntimeError, TypeError, ValueError):  # no libcuda: the enum still knows the name
        pass
    try:
        return cu.CUresult(int(code)).name, "no description (libcuda unavailable)"
    except ValueError:
        return f"CUresult {int(code)}", "unknown error"


def check(result: Any, status: ErrorStatus, context: str, cu: Any = None) -> Any:
    """Unpack a driver call's ``(CUresult, *outputs)``: the outputs (None, one value, or a tuple), or raise.

    The raised ``DriverError`` reads ``"<context>: <CUDA_ERROR_NAME> (<description>)"``.
    """
    if isinstance(result, tuple):
        code, outputs = result[0], result[1:]
    else:
        code, outputs = result, ()
    if code:
        name, desc = error_text(code, cu)
        raise DriverError(status, f"{context}: {name} ({desc})", int(code), name)
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else outputs


class Driver:
    """The driver calls the CUDA backend uses, one method each; all values are plain Python numbers."""

    def __init__(self, bindings: Any = None) -> None:
        self.cu = bindings if bindings is not None else _bindings()
        cu = self.cu
        self.note: str = getattr(cu, "note", "")  # what these bindings are, when not the NVIDIA driver
        # False for bindings that run each kernel from its source (the emulator): no need to optimize machine code
        self.executes_machine_code: bool = getattr(cu, "executes_machine_code", True)
        self._structs: dict[tuple, Any] = {}
        self._attr = cu.CUdevice_attribute
        self._event_timing = int(cu.CUevent_flags.CU_EVENT_DEFAULT)
        self._event_no_timing = int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self._non_blocking = int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)

    def _check(self, result: Any, status: ErrorStatus, context: str) -> Any:
        return check(result, status, context, self.cu)

    def cudnn_frontend(self) -> Any:
        """The cuDNN frontend module for these bindings (``import cudnn`` for the NVIDIA driver, after loading the
        libraries it needs); ImportError naming what is missing."""
        own = getattr(self.cu, "cudnn_frontend", None)
        if own is not None:
            return own()
        preload_cudnn_libraries()
        import cudnn  # optional dependency: nvidia-cudnn-frontend

        return cudnn

    # ---- devices and contexts --------------------------------------------------------------------------------
    def init(self) -> None:
        self._check(self.cu.cuInit(0), ErrorStatus.INITIALIZATION, "cuInit")

    def driver_version(self) -> int:
        return int(self._check(self.cu.cuDriverGetVersion(), ErrorStatus.INITIALIZATION, "cuDriverGetVersion"))

    def device_count(self) -> int:
        return int(self._check(self.cu.cuDeviceGetCount(), ErrorStatus.INITIALIZATION, "cuDeviceGetCount"))

    def device(self, ordinal: int) -> int:
        return int(self._check(self.cu.cuDeviceGet(ordinal), ErrorStatus.INITIALIZATION, f"cuDeviceGet({ordinal})"))

    def device_name(self, dev: int) -> str:
        raw = self._check(self.cu.cuDeviceGetName(256, dev), ErrorStatus.INITIALIZATION, "cuDeviceGetName")
        return bytes(raw).split(b"\0", 1)[0].decode(errors="replace")

    def device_attribute(self, dev: int, name: str) -> int:
        attr = getattr(self._attr, "CU_DEVICE_ATTRIBUTE_" + name)
        return int(self._check(self.cu.cuDeviceGetAttribute(attr, dev), ErrorStatus.INITIALIZATION,
                         f"cuDeviceGetAttribute({name})"))

    def total_memory(self, dev: int) -> int:
        return int(self._check(self.cu.cuDeviceTotalMem(dev), ErrorStatus.INITIALIZATION, "cuDeviceTotalMem"))

    def primary_context(self, dev: int) -> int:
        return int(self._check(self.cu.cuDevicePrimaryCtxRetain(dev), ErrorStatus.INITIALIZATION,
                         "cuDevicePrimaryCtxRetain"))

    def release_primary_context(self, dev: int) -> None:
        self._check(self.cu.cuDevicePrimaryCtxRelease(dev), ErrorStatus.DEALLOCATION, "cuDevicePrimaryCtxRelease")

    def set_current(self, ctx: int) -> None:
        self._check(self.cu.cuCtxSetCurrent(ctx), ErrorStatus.INITIALIZATION, "cuCtxSetCurrent")

    def can_access_peer(self, dev: int, peer: int) -> bool:
        return bool(self._check(self.cu.cuDeviceCanAccessPeer(dev, peer), ErrorStatus.COPY, "cuDeviceCanAccessPeer"))

    def enable_peer_access(self, peer_ctx: int) -> None:
        """Let the current context read ``peer_ctx``'s memory; already enabled counts as success."""
        err = self.cu.cuCtxEnablePeerAccess(peer_ctx, 0)
        code = err[0] if isinstance(err, tuple) else err
        if int(code) == PEER_ACCESS_ALREADY_ENABLED:
            return
        self._check(err, ErrorStatus.COPY, "cuCtxEnablePeerAccess")

    # ---- streams and events ----------------------------------------------------------------------------------
    def stream_create(self) -> int:
        return int(self._check(self.cu.cuStreamCreate(self._non_blocking), ErrorStatus.INITIALIZATION,
                               "cuStreamCreate"))

    def stream_destroy(self, stream: int) -> None:
        self._check(self.cu.cuStreamDestroy(stream), ErrorStatus.DEALLOCATION, "cuStreamDestroy")

    def stream_synchronize(self, stream: int) -> None:
        self._check(self.cu.cuStreamSynchronize(stream), ErrorStatus.SYNC, "cuStreamSynchronize")

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._check(self.cu.cuStreamWaitEvent(stream, event, 0), ErrorStatus.LAUNCH, "cuStreamWaitEvent")

    def event_create(self, timing: bool = False) -> int:
        flags = self._event_timing if timing else self._event_no_timing
        return int(self._check(self.cu.cuEventCreate(flags), ErrorStatus.INITIALIZATION, "cuEventCreate"))

    def event_record(self, event: int, stream: int) -> None:
        self._check(self.cu.cuEventRecord(event, stream), ErrorStatus.LAUNCH, "cuEventRecord")

    def event_query(self, event: int) -> bool:
        """True when the work before the event completed, False while it runs; raises an earlier async error."""
        err = self.cu.cuEventQuery(event)
        code = err[0] if isinstance(err, tuple) else err
        if int(code) == NOT_READY:
            return False
        self._check(err, ErrorStatus.SYNC, "cuEventQuery")
        return True

    def event_synchronize(self, event: int) -> None:
        self._check(self.cu.cuEventSynchronize(event), ErrorStatus.SYNC, "cuEventSynchronize")

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return float(self._check(self.cu.cuEventElapsedTime(start, end), ErrorStatus.SYNC, "cuEventElapsedTime"))

    def event_destroy(self, event: int) -> None:
        self._check(self.cu.cuEventDestroy(event), ErrorStatus.DEALLOCATION, "cuEventDestroy")

    # ---- memory ----------------------------------------------------------------------------------------------
    def default_mem_pool(self, dev: int) -> int:
        return int(self._check(self.cu.cuDeviceGetDefaultMemPool(dev), ErrorStatus.INITIALIZATION,
                         "cuDeviceGetDefaultMemPool"))

    def mem_pool_set_release_threshold(self, pool: int, nbytes: int) -> None:
        attr = self.cu.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD
        self._check(self.cu.cuMemPoolSetAttribute(pool, attr, self.cu.cuuint64_t(nbytes)), ErrorStatus.INITIALIZATION,
              "cuMemPoolSetAttribute(RELEASE_THRESHOLD)")

    def mem_pool_usage(self, pool: int) -> tuple[int, int]:
        """(bytes reserved from the device, bytes in live allocations) of a stream-ordered pool."""
        a = self.cu.CUmemPool_attribute
        out = []
        for attr in (a.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, a.CU_MEMPOOL_ATTR_USED_MEM_CURRENT):
            out.append(int(self._check(self.cu.cuMemPoolGetAttribute(pool, attr), ErrorStatus.SYNC,
                                 "cuMemPoolGetAttribute")))
        return out[0], out[1]

    def mem_pool_trim(self, pool: int, keep_bytes: int = 0) -> None:
        self._check(self.cu.cuMemPoolTrimTo(pool, keep_bytes), ErrorStatus.DEALLOCATION, "cuMemPoolTrimTo")

    def mem_alloc_async(self, nbytes: int, stream: int) -> int:
        return int(self._check(self.cu.cuMemAllocAsync(nbytes, stream), ErrorStatus.ALLOCATION, "cuMemAllocAsync"))

    def mem_free_async(self, ptr: int, stream: int) -> None:
        self._check(self.cu.cuMemFreeAsync(ptr, stream), ErrorStatus.DEALLOCATION, "cuMemFreeAsync")

    def mem_alloc(self, nbytes: int) -> int:
        return int(self._check(self.cu.cuMemAlloc(nbytes), ErrorStatus.ALLOCATION, "cuMemAlloc"))

    def mem_free(self, ptr: int) -> None:
        self._check(self.cu.cuMemFree(ptr), ErrorStatus.DEALLOCATION, "cuMemFree")

    def mem_get_info(self) -> tuple[int, int]:
        free, total = self._check(self.cu.cuMemGetInfo(), ErrorStatus.ALLOCATION, "cuMemGetInfo")
        return int(free), int(total)

    def host_alloc(self, nbytes: int) -> int:
        """Pinned (page-locked) host memory, as an address usable from any thread."""
        return int(self._check(self.cu.cuMemHostAlloc(nbytes, 0), ErrorStatus.ALLOCATION, "cuMemHostAlloc"))

    def host_free(self, ptr: int) -> None:
        self._check(self.cu.cuMemFreeHost(ptr), ErrorStatus.DEALLOCATION, "cuMemFreeHost")

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self.cu.cuMemcpyHtoDAsync(dst, src, nbytes, stream), ErrorStatus.COPY, "cuMemcpyHtoDAsync")

    def memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self.cu.cuMemcpyDtoHAsync(dst, src, nbytes, stream), ErrorStatus.COPY, "cuMemcpyDtoHAsync")

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self.cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream), ErrorStatus.COPY, "cuMemcpyDtoDAsync")

    def memcpy_peer_async(self, dst: int, dst_ctx: int, src: int, src_ctx: int, nbytes: int, stream: int) -> None:
        self._check(self.cu.cuMemcpyPeerAsync(dst, dst_ctx, src, src_ctx, nbytes, stream), ErrorStatus.COPY,
              "cuMemcpyPeerAsync")

    # ---- modules and launches --------------------------------------------------------------------------------
    def prepare_modules(self, images: list[bytes]) -> None:
        """Get ready to load ``images`` (any thread, no CUDA call): the emulated driver builds their modules in
        parallel; the real driver has nothing to do."""
        hook = getattr(self.cu, "zyx_prepare_modules", None)
        if hook is not None:
            hook(images)

    def module_load(self, image: bytes) -> int:
        return int(self._check(self.cu.cuModuleLoadData(image), ErrorStatus.COMPILATION, "cuModuleLoadData"))

    def module_function(self, module: int, name: str) -> int:
        return int(self._check(self.cu.cuModuleGetFunction(module, name.encode()), ErrorStatus.COMPILATION,
                         f"cuModuleGetFunction({name})"))

    def module_unload(self, module: int) -> None:
        self._check(self.cu.cuModuleUnload(module), ErrorStatus.DEALLOCATION, "cuModuleUnload")

    def func_set_max_dynamic_shared(self, function: int, nbytes: int) -> None:
        attr = self.cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._check(self.cu.cuFuncSetAttribute(function, attr, nbytes), ErrorStatus.COMPILATION,
              "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")

    def launch_kernel(self, function: int, grid: tuple[int, int, int], block: tuple[int, int, int],
                      shared_bytes: int, stream: int, params: int) -> None:
        """``params``: the address of a ``void*[]`` with one pointer per kernel parameter (0 for none)."""
        self._check(self.cu.cuLaunchKernel(function, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                     shared_bytes, stream, params, 0), ErrorStatus.LAUNCH, "cuLaunchKernel")

    # ---- graphs ----------------------------------------------------------------------------------------------
    def _node_params(self, function: int, grid: tuple[int, int, int], block: tuple[int, int, int],
                     shared_bytes: int, params: int) -> Any:
        """The node-parameter struct (built once per distinct launch: the values are read through ``params``)."""
        key = (function, grid, block, shared_bytes, params)
        p = self._structs.get(key)
        if p is not None:
            return p
        if len(self._structs) > 65536:
            self._structs.clear()
        p = self._structs[key] = self.cu.CUDA_KERNEL_NODE_PARAMS()
        p.func = self.cu.CUfunction(function)
        p.gridDimX, p.gridDimY, p.gridDimZ = grid
        p.blockDimX, p.blockDimY, p.blockDimZ = block
        p.sharedMemBytes = shared_bytes
        p.kernelParams = params
        p.extra = 0
        return p

    def graph_create(self) -> int:
        return int(self._check(self.cu.cuGraphCreate(0), ErrorStatus.LAUNCH, "cuGraphCreate"))

    def graph_add_kernel(self, graph: int, deps: list[int], function: int, grid: tuple[int, int, int],
                         block: tuple[int, int, int], shared_bytes: int, params: int) -> int:
        """A kernel node after ``deps``; its parameter values are copied from ``params`` now."""
        nodes = [self.cu.CUgraphNode(d) for d in deps]
        return int(self._check(self.cu.cuGraphAddKernelNode(graph, nodes, len(nodes), self._node_params(
            function, grid, block, shared_bytes, params)), ErrorStatus.LAUNCH, "cuGraphAddKernelNode"))

    def graph_instantiate(self, graph: int) -> int:
        return int(self._check(self.cu.cuGraphInstantiate(graph, 0), ErrorStatus.LAUNCH, "cuGraphInstantiate"))

    def graph_exec_set_kernel(self, graph_exec: int, node: int, function: int, grid: tuple[int, int, int],
                              block: tuple[int, int, int], shared_bytes: int, params: int) -> None:
        """New parameter values (copied from ``params`` now) for the next launches of ``graph_exec``."""
        self._check(self.cu.cuGraphExecKernelNodeSetParams(graph_exec, node, self._node_params(
            function, grid, block, shared_bytes, params)), ErrorStatus.LAUNCH, "cuGraphExecKernelNodeSetParams")

    def graph_launch(self, graph_exec: int, stream: int) -> None:
        self._check(self.cu.cuGraphLaunch(graph_exec, stream), ErrorStatus.LAUNCH, "cuGraphLaunch")

    def graph_exec_destroy(self, graph_exec: int) -> None:
        self._check(self.cu.cuGraphExecDestroy(graph_exec), ErrorStatus.DEALLOCATION, "cuGraphExecDestroy")

    def graph_destroy(self, graph: int) -> None:
        self._check(self.cu.cuGraphDestroy(graph), ErrorStatus.DEALLOCATION, "cuGraphDestroy")


CUDNN_LIBRARIES = ("cudart", "cudnn")  # the frontend dlopens these by name; cuDNN's own needs (cuBLASLt) come along


def preload_cudnn_libraries() -> None:
    """Load the CUDA runtime and cuDNN from the pip wheels (or the system) with ``cuda.pathfinder``, so the cuDNN
    frontend finds them whatever the library search path; ImportError naming the missing library otherwise."""
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        return  # an older cuda-python: the frontend searches on its own
    for name in CUDNN_LIBRARIES:
        try:
            load_nvidia_dynamic_lib(name)
        except Exception as e:  # noqa: BLE001 - DynamicLibNotFoundError and friends: say which and how to fix
            raise ImportError(f"lib{name} cannot be loaded ({e}); install the CUDA libraries with: "
                              "pip install 'zyx[cuda]'") from None


def load_driver(emulate: bool = False) -> Driver:
    """An initialized ``Driver`` over cuda-python's bindings, or over the emulated driver when ``emulate``; else
    ``BackendError(INITIALIZATION, reason)`` saying what is missing."""
    try:
        if emulate:
            from zyx.backends.cuda import emulator

            drv = Driver(emulator.EmulatedDriver(emulator.config_from_env()))
        else:
            drv = Driver()
    except ImportError:
        raise BackendError(ErrorStatus.INITIALIZATION, NO_CUDA_PYTHON) from None
    try:
        drv.init()
    except DriverError as e:
        if e.name == "CUDA_ERROR_NO_DEVICE":
            raise BackendError(ErrorStatus.INITIALIZATION, "no CUDA GPU visible (cuInit: CUDA_ERROR_NO_DEVICE); "
                               "check nvidia-smi and CUDA_VISIBLE_DEVICES") from None
        raise BackendError(ErrorStatus.INITIALIZATION, f"{e.context}; check the NVIDIA driver installation "
                           "(nvidia-smi)") from None
    except (RuntimeError, OSError):  # cuda.pathfinder.DynamicLibNotFoundError is a RuntimeError
        raise BackendError(ErrorStatus.INITIALIZATION, NO_LIBCUDA) from None
    return drv


def unavailable_reason() -> str | None:
    """Why the NVIDIA driver cannot be used here, or None when it can (and at least one GPU is visible)."""
    try:
        drv = load_driver()
        if drv.device_count() == 0:
            return "no CUDA GPU visible; check nvidia-smi and CUDA_VISIBLE_DEVICES"
    except BackendError as e:
        return e.context
    return None

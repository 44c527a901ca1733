"""The emulated ``cuda.bindings.driver``: the calls zyx's ``Driver`` makes, same arguments, same return tuples.

Invariants:
- Every call returns a tuple whose first item is a real ``CUresult`` (``cuda.bindings.driver`` enums are reused,
  so codes and names are the driver's); handles and pointers are ints, as zyx passes them back.
- Once a context has a sticky error (an illegal address in a kernel or copy, a kernel deadlock, a trap), every call
  on it returns that error, as the real driver does; the error detail (which kernel, which address, which block)
  is logged under ``ZYX_DEBUG=launch``, since a ``CUresult`` cannot carry it.
- Modules: ``cuModuleLoadData`` accepts only an ELF cubin for the emulated sm (else
  ``CUDA_ERROR_NO_BINARY_FOR_GPU``, as a real GPU refuses a cubin of another architecture) that NVRTC compiled in
  this process; it runs that cubin's CUDA C (``nvrtc.source_of``) with ``kernels.compile_module``.
- Launches snapshot their parameter values at the call, check the geometry against the device limits, and run on
  the stream's thread; copies check both ranges against the emulated memory before moving a byte, and move them
  under the kernels' fault handler (a block freed by another stream during the copy is an illegal address too).
- Graphs: kernel nodes copy their parameter values when added or set (later sets affect later launches only); a
  graph launch is one operation of its stream that runs the nodes in insertion order, a topological order.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

from cuda.bindings import driver as _cu

from zyx.backends.cuda.emulator.kernels import guarded_copy
from zyx.backends.cuda.emulator.memory import Block, Memory, OutOfMemory
from zyx.backends.cuda.emulator.streams import Context, Event, Stream, StreamFault
from zyx.utils import log

R = _cu.CUresult
CUdevice_attribute = _cu.CUdevice_attribute
CUevent_flags = _cu.CUevent_flags
CUstream_flags = _cu.CUstream_flags
CUmemPool_attribute = _cu.CUmemPool_attribute
CUfunction_attribute = _cu.CUfunction_attribute
cuuint64_t = _cu.cuuint64_t
CUDA_KERNEL_NODE_PARAMS = _cu.CUDA_KERNEL_NODE_PARAMS
CUfunction = _cu.CUfunction
CUgraphNode = _cu.CUgraphNode
CUresult = R

# What a real H200 reports (cuDeviceGetAttribute names without the prefix).
H200_ATTRIBUTES: dict[str, int] = {
    "MULTIPROCESSOR_COUNT": 132, "MAX_THREADS_PER_BLOCK": 1024, "MAX_BLOCK_DIM_X": 1024, "MAX_BLOCK_DIM_Y": 1024,
    "MAX_BLOCK_DIM_Z": 64, "MAX_GRID_DIM_X": 2**31 - 1, "MAX_GRID_DIM_Y": 65535, "MAX_GRID_DIM_Z": 65535,
    "MAX_SHARED_MEMORY_PER_BLOCK": 49152, "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448,
    "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 233472, "WARP_SIZE": 32, "COMPUTE_CAPABILITY_MAJOR": 9,
    "COMPUTE_CAPABILITY_MINOR": 0, "L2_CACHE_SIZE": 60 << 20, "MAX_REGISTERS_PER_BLOCK": 65536,
    "MEMORY_POOLS_SUPPORTED": 1, "CLOCK_RATE": 1980000, "MEMORY_CLOCK_RATE": 2619000,
    "GLOBAL_MEMORY_BUS_WIDTH": 6144, "MAX_THREADS_PER_MULTIPROCESSOR": 2048,
}

DESCRIPTIONS = {
    "CUDA_SUCCESS": "no error",
    "CUDA_ERROR_INVALID_VALUE": "invalid argument",
    "CUDA_ERROR_OUT_OF_MEMORY": "out of memory",
    "CUDA_ERROR_NOT_INITIALIZED": "initialization error",
    "CUDA_ERROR_INVALID_DEVICE": "invalid device ordinal",
    "CUDA_ERROR_INVALID_IMAGE": "device kernel image is invalid",
    "CUDA_ERROR_INVALID_CONTEXT": "invalid device context",
    "CUDA_ERROR_NO_BINARY_FOR_GPU": "no kernel image is available for execution on the device",
    "CUDA_ERROR_INVALID_HANDLE": "invalid resource handle",
    "CUDA_ERROR_NOT_FOUND": "named symbol not found",
    "CUDA_ERROR_NOT_READY": "device not ready",
    "CUDA_ERROR_ILLEGAL_ADDRESS": "an illegal memory access was encountered",
    "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES": "too many resources requested for launch",
    "CUDA_ERROR_LAUNCH_TIMEOUT": "the launch timed out and was terminated",
    "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED": "peer access is already enabled",
    "CUDA_ERROR_ASSERT": "device-side assert triggered",
    "CUDA_ERROR_LAUNCH_FAILED": "unspecified launch failure",
    "CUDA_ERROR_NOT_SUPPORTED": "operation not supported",
}

OK = (R.CUDA_SUCCESS,)
_FAULT_RESULTS = {"address": "CUDA_ERROR_ILLEGAL_ADDRESS", "arithmetic": "CUDA_ERROR_LAUNCH_FAILED",
                  "deadlock": "CUDA_ERROR_LAUNCH_TIMEOUT", "trap": "CUDA_ERROR_LAUNCH_FAILED"}


def _err(name: str) -> tuple:
    return (getattr(R, name),)


@dataclass(frozen=True)
class EmulatorConfig:
    """The emulated machine: ``devices`` GPUs named ``name`` with ``attributes``; ``memory`` bytes each (host-backed,
    so far less than the H200's 141 GB); streams pause up to ``delay_us`` before each operation, drawn from
    generators seeded with ``seed``. ``run_kernels=False`` (``ZYX_CUDA_EMULATE=nokernels``) measures host
    overhead alone: launches, copies and library calls are ordered on their streams but do nothing."""

    devices: int = 1
    name: str = "NVIDIA H200"
    attributes: dict[str, int] = field(default_factory=lambda: dict(H200_ATTRIBUTES))
    memory: int = 8 << 30
    seed: int = 0
    delay_us: float = 20.0
    run_kernels: bool = True  # False: every call is accepted and ordered, kernel bodies and copy payloads skipped

    @property
    def sm(self) -> int:
        a = self.attributes
        return 10 * a["COMPUTE_CAPABILITY_MAJOR"] + a["COMPUTE_CAPABILITY_MINOR"]


@dataclass
class _Module:
    emulated: Any  # kernels.EmulatedModule
    functions: dict[str, int] = field(default_factory=dict)


@dataclass
class _Node:
    """A kernel node of a graph: what to launch, with its parameter values copied when it was set."""

    function: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    values: list[bytes]


@dataclass
class _Function:
    module: int
    kernel: Any  # kernels.KernelFunction
    max_dynamic_shared: int = 0
    checked: set = field(default_factory=set)  # launch geometries already found within the limits


def _nothing() -> None:
    """The body of a skipped launch or copy (``run_kernels=False``)."""


@dataclass(frozen=True)
class _SkippedKernel:
    name: str
    param_sizes: tuple[int, ...]


class _Skipped:
    """A module whose kernels are parsed for their parameter sizes but never compiled (``run_kernels=False``)."""

    def __init__(self, source: str) -> None:
        from zyx.backends.cuda.emulator import kernels

        self.functions = {n: _SkippedKernel(n, sizes) for n, sizes in kernels.signatures(source).items()}


def cubin_arch(image: bytes) -> int | None:
    """The sm of an ELF cubin (``90`` for sm_90), or None when ``image`` is no CUDA ELF."""
    if len(image) < 64 or image[:4] != b"\x7fELF" or image[4] != 2:
        return None
    flags = struct.unpack_from("<I", image, 48)[0]
    abi = image[8]
    return (flags >> 8) & 0xFF if abi >= 8 else flags & 0xFF


class EmulatedDriver:
    """One emulated machine with the API of ``cuda.bindings.driver`` (the subset zyx uses)."""

    # Kernels run from the CUDA C their cubin was compiled from (``nvrtc.source_of``); the cubin's machine code never
    # runs, so the device compiles it at NVRTC's lowest optimization effort (only its sm is checked at load).
    executes_machine_code = False

    # enums and small types, as the real module exposes them
    CUresult = R
    CUdevice_attribute = CUdevice_attribute
    CUevent_flags = CUevent_flags
    CUstream_flags = CUstream_flags
    CUmemPool_attribute = CUmemPool_attribute
    CUfunction_attribute = CUfunction_attribute
    cuuint64_t = cuuint64_t
    CUDA_KERNEL_NODE_PARAMS = CUDA_KERNEL_NODE_PARAMS
    CUfunction = CUfunction
    CUgraphNode = CUgraphNode

    def __init__(self, config: EmulatorConfig | None = None) -> None:
        self.config = config or EmulatorConfig()
        self.memory = Memory(self.config.memory)
        self._ids = itertools.count(0x10000)
        self._lock = threading.Lock()
        self._initialized = False
        self._contexts: dict[int, Context] = {}  # handle -> context (one primary context per device)
        self._ctx_refs: dict[int, int] = {}
        self._current = threading.local()
        self._streams: dict[int, Stream] = {}
        self._events: dict[int, Event] = {}
        self._modules: dict[int, _Module] = {}
        self._functions: dict[int, _Function] = {}
        self._pools: dict[int, dict[str, int]] = {}
        self._blocks: dict[int, Block] = {}  # live or pending allocations by pointer
        self._stream_seeds = itertools.count(1)
        self._cudnn: Any = None
        self._graphs: dict[int, dict[int, _Node]] = {}  # graph -> its nodes in insertion (topological) order
        self._execs: dict[int, dict[int, _Node]] = {}  # executable graph -> its own copies of the nodes
        self.graph_launches = 0
        self.faults: list[str] = []  # every sticky error's detail, in order (tests, debug log)

    @property
    def note(self) -> str:
        """What ``python -m zyx`` shows beside the backend: this is not a GPU."""
        short = self.config.name.replace("NVIDIA ", "")
        return f"emulated: {short}, sm_{self.config.sm}"

    # ---- helpers ---------------------------------------------------------------------------------------------------
    def _ctx(self) -> Context | None:
        handle = getattr(self._current, "ctx", None)
        return self._contexts.get(handle) if handle is not None else None

    def _sticky(self, ctx: Context | None = None) -> tuple | None:
        ctx = ctx or self._ctx()
        if ctx is not None and ctx.sticky is not None:
            return _err(ctx.sticky.name)
        return None

    def _fault(self, ctx: Context, f: StreamFault) -> None:
        first = ctx.sticky is None
        ctx.fail(f.name, f.detail)
        if first:
            self.faults.append(f.detail)
            log("launch", f"cuda emulator: device {ctx.device}: {f.name}: {f.detail}")

    def _stream(self, handle: int) -> Stream | None:
        return self._streams.get(int(handle))

    def stream_object(self, handle: int) -> Stream:
        """The emulated stream behind a handle (the cuDNN double queues its work there)."""
        s = self._stream(handle)
        if s is None:
            raise KeyError(f"unknown emulated stream {handle}")
        return s

    # ---- init, devices, contexts -----------------------------------------------------------------------------------
    def cuInit(self, flags: int) -> tuple:
        self._initialized = True
        return OK

    def cuDriverGetVersion(self) -> tuple:
        return R.CUDA_SUCCESS, 13000

    def cuDeviceGetCount(self) -> tuple:
        if not self._initialized:
            return _err("CUDA_ERROR_NOT_INITIALIZED") + (0,)
        return R.CUDA_SUCCESS, self.config.devices

    def cuDeviceGet(self, ordinal: int) -> tuple:
        if not 0 <= int(ordinal) < self.config.devices:
            return _err("CUDA_ERROR_INVALID_DEVICE") + (0,)
        return R.CUDA_SUCCESS, int(ordinal)

    def cuDeviceGetName(self, length: int, dev: int) -> tuple:
        return R.CUDA_SUCCESS, self.config.name.encode()[: int(length) - 1] + b"\0"

    def cuDeviceGetAttribute(self, attr: Any, dev: int) -> tuple:
        # By value, not by the enum's name: some attributes have two names (MAX_SHARED_MEMORY_PER_BLOCK is also
        # SHARED_MEMORY_PER_BLOCK) and the enum reports only its first.
        for name, value in self.config.attributes.items():
            if int(getattr(CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name)) == int(attr):
                return R.CUDA_SUCCESS, int(value)
        return R.CUDA_SUCCESS, 0

    def cuDeviceTotalMem(self, dev: int) -> tuple:
        return R.CUDA_SUCCESS, self.config.memory

    def cuDevicePrimaryCtxRetain(self, dev: int) -> tuple:
        dev = int(dev)
        with self._lock:
            handle = 0x100 + dev
            if handle not in self._contexts:
                self._contexts[handle] = Context(dev)
            self._ctx_refs[handle] = self._ctx_refs.get(handle, 0) + 1
        return R.CUDA_SUCCESS, handle

    def cuDevicePrimaryCtxRelease(self, dev: int) -> tuple:
        handle = 0x100 + int(dev)
        with self._lock:
            self._ctx_refs[handle] = max(self._ctx_refs.get(handle, 0) - 1, 0)
        return OK

    def cuCtxSetCurrent(self, ctx: int) -> tuple:
        if int(ctx) not in self._contexts:
            return _err("CUDA_ERROR_INVALID_CONTEXT")
        self._current.ctx = int(ctx)
        return OK

    def cuDeviceCanAccessPeer(self, dev: int, peer: int) -> tuple:
        return R.CUDA_SUCCESS, int(int(dev) != int(peer))

    def cuCtxEnablePeerAccess(self, peer_ctx: int, flags: int) -> tuple:
        ctx = self._ctx()
        peer = self._contexts.get(int(peer_ctx))
        if ctx is None or peer is None:
            return _err("CUDA_ERROR_INVALID_CONTEXT")
        if peer.device in ctx.peers:
            return _err("CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED")
        ctx.peers.add(peer.device)
        return OK

    # ---- errors ----------------------------------------------------------------------------------------------------
    def cuGetErrorName(self, code: Any) -> tuple:
        try:
            return R.CUDA_SUCCESS, R(int(code)).name.encode()
        except ValueError:
            return _err("CUDA_ERROR_INVALID_VALUE") + (b"",)

    def cuGetErrorString(self, code: Any) -> tuple:
        try:
            name = R(int(code)).name
        except ValueError:
            return _err("CUDA_ERROR_INVALID_VALUE") + (b"",)
        return R.CUDA_SUCCESS, DESCRIPTIONS.get(name, name.lower().replace("_", " ")).encode()

    # ---- streams and events ----------------------------------------------------------------------------------------
    def cuStreamCreate(self, flags: int) -> tuple:
        ctx = self._ctx()
        if ctx is None:
            return _err("CUDA_ERROR_INVALID_CONTEXT") + (0,)
        handle = next(self._ids)
        n = next(self._stream_seeds)
        seed = self.config.seed * 1_000_003 + 7919 * ctx.device + n
        self._streams[handle] = Stream(ctx, f"dev{ctx.device}-stream{n}", seed, self.config.delay_us * 1e-6,
                                       self._fault, inline=not self.config.run_kernels)
        return R.CUDA_SUCCESS, handle

    def cuStreamDestroy(self, stream: int) -> tuple:
        s = self._streams.pop(int(stream), None)
        if s is None:
            return _err("CUDA_ERROR_INVALID_HANDLE")
        s.stop()
        return OK

    def cuStreamSynchronize(self, stream: int) -> tuple:
        s = self._stream(stream)
        if s is None:
            return _err("CUDA_ERROR_INVALID_HANDLE")
        s.synchronize()
        return self._sticky(s.ctx) or OK

    def cuStreamWaitEvent(self, stream: int, event: int, flags: int) -> tuple:
        s, ev = self._stream(stream), self._events.get(int(event))
        if s is None or ev is None:
            return _err("CUDA_ERROR_INVALID_HANDLE")
        if (err := self._sticky(s.ctx)) is not None:
            return err
        if ev.latest is not None:
            s.wait_for(ev.latest)
        return OK

    def cuEventCreate(self, flags: int) -> tuple:
        handle = next(self._ids)
        self._events[handle] = Event(timing=not (int(flags) & int(CUevent_flags.CU_EVENT_DISABLE_TIMING)))
        return R.CUDA_SUCCESS, handle

    def cuEventDestroy(self, event: int) -> tuple:
        return OK if self._events.pop(int(event), None) is not None else _err("CUDA_ERROR_INVALID_HANDLE")

    def cuEventRecord(self, event: int, stream: int) -> tuple:
        s, ev = self._stream(stream), self._events.get(int(event))
        if s is None or ev is None:
            return _err("CUDA_ERROR_INVALID_HANDLE")
        if (err := self._sticky(s.ctx)) is not None:
            return err
        ev.latest = s.mark()
        return OK

    def cuEventQuery(self, event: int) -> tuple:
        ev = self._events.get(int(event))
        if ev is None:
            return _err("CUDA_ERROR_INVALID_HANDLE")
        if (err := self._sticky()) is not None:
            return err
        if ev.latest is not None and not ev.latest.done():
            return _err("CUDA_ERROR_NOT_READY")
        return OK

    def cuEventSynchronize(self, event: int) -> tuple:
        ev = self._events.get(int(event))
        if ev is None:
            return _err("CUDA_ERROR_INVALID_HANDLE")
        if ev.latest is not None:
            ev.latest.wait()
        return self._sticky() or OK

    def cuEventElapsedTime(self, start: int, end: int) -> tuple:
        a, b = self._events.get(int(start)), self._events.get(int(end))
        if a is None or b is None or not (a.timing and b.timing):
            return _err("CUDA_ERROR_INVALID_HANDLE") + (0.0,)
        if a.latest is None or b.latest is None or not (a.latest.done() and b.latest.done()):
            return _err("CUDA_ERROR_NOT_READY") + (0.0,)
        return R.CUDA_SUCCESS, (b.latest.at - a.latest.at) / 1e6

    # ---- memory ----------------------------------------------------------------------------------------------------
    def cuDeviceGetDefaultMemPool(self, dev: int) -> tuple:
        handle = 0x200 + int(dev)
        self._pools.setdefault(handle, {"threshold": 0})
        return R.CUDA_SUCCESS, handle

    def cuMemPoolSetAttribute(self, pool: int, attr: Any, value: Any) -> tuple:
        if int(pool) not in self._pools:
            return _err("CUDA_ERROR_INVALID_VALUE")
        if attr == CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
            self._pools[int(pool)]["threshold"] = int(value)
        return OK

    def cuMemPoolGetAttribute(self, pool: int, attr: Any) -> tuple:
        if int(pool) not in self._pools:
            return _err("CUDA_ERROR_INVALID_VALUE") + (0,)
        used = self.memory.used.get(int(pool) - 0x200, 0)
        if attr in (CUmemPool_attribute.CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                    CUmemPool_attribute.CU_MEMPOOL_ATTR_USED_MEM_CURRENT):
            return R.CUDA_SUCCESS, cuuint64_t(used)
        if attr == CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD:
            return R.CUDA_SUCCESS, cuuint64_t(self._pools[int(pool)]["threshold"])
        return _err("CUDA_ERROR_NOT_SUPPORTED") + (0,)

    def cuMemPoolTrimTo(self, pool: int, keep: int) -> tuple:
        return OK if int(pool) in self._pools else _err("CUDA_ERROR_INVALID_VALUE")

    def _device_alloc(self, nbytes: int, pending: bool) -> tuple[tuple, Block | None]:
        ctx = self._ctx()
        if ctx is None:
            return _err("CUDA_ERROR_INVALID_CONTEXT"), None
        if (err := self._sticky(ctx)) is not None:
            return err, None
        if int(nbytes) <= 0:
            return _err("CUDA_ERROR_INVALID_VALUE"), None
        try:
            blk = self.memory.alloc(int(nbytes), "device", ctx.device, pending=pending)
        except OutOfMemory:
            return _err("CUDA_ERROR_OUT_OF_MEMORY"), None
        with self._lock:
            self._blocks[blk.ptr] = blk
        return OK, blk

    def cuMemAllocAsync(self, nbytes: int, stream: int) -> tuple:
        s = self._stream(stream)
        if s is None:
            return _err("CUDA_ERROR_INVALID_HANDLE") + (0,)
        res, blk = self._device_alloc(nbytes, pending=True)
        if blk is None:
            return res + (0,)
        s.submit(lambda: self.memory.activate(blk))
        return R.CUDA_SUCCESS, blk.ptr

    def _take_block(self, ptr: int, kind: str) -> Block | None:
        with self._lock:
            blk = self._blocks.get(int(ptr))
            if blk is None or blk.kind != kind:
                return None
            del self._blocks[int(ptr)]
        return blk

    def _release(self, blk: Block) -> None:
        damage = self.memory.free(blk)
        if damage is not None:
            raise StreamFault("CUDA_ERROR_ILLEGAL_ADDRESS", damage)

    def cuMemFreeAsync(self, ptr: int, stream: int) -> tuple:
        s = self._stream(stream)
        if s is None:
            return _err("CUDA_ERROR_INVALID_HANDLE")
        if (err := self._sticky(s.ctx)) is not None:
            return err
        blk = self._take_block(ptr, "device")
        if blk is None:
            return _err("CUDA_ERROR_INVALID_VALUE")
        s.submit(lambda: self._release(blk))
        return OK

    def cuMemAlloc(self, nbytes: int) -> tuple:
        res, blk = self._device_alloc(nbytes, pending=False)
        return res + ((blk.ptr,) if blk is not None else (0,))

    def cuMemFree(self, ptr: int) -> tuple:
        blk = self._take_block(ptr, "device")
        if blk is None:
            return _err("CUDA_ERROR_INVALID_VALUE")
        try:
            self._release(blk)
        except StreamFault as f:
            ctx = self._ctx()
            if ctx is not None:
                self._fault(ctx, f)
        return self._sticky() or OK

    def cuMemGetInfo(self) -> tuple:
        ctx = self._ctx()
        if ctx is None:
            return _err("CUDA_ERROR_INVALID_CONTEXT") + (0, 0)
        used = self.memory.used.get(ctx.device, 0)
        return R.CUDA_SUCCESS, self.config.memory - used, self.config.memory

    def cuMemHostAlloc(self, nbytes: int, flags: int) -> tuple:
        try:
            blk = self.memory.alloc(int(nbytes), "pinned")
        except OutOfMemory:
            return _err("CUDA_ERROR_OUT_OF_MEMORY") + (0,)
        with self._lock:
            self._blocks[blk.ptr] = blk
        return R.CUDA_SUCCESS, blk.ptr

    def cuMemFreeHost(self, ptr: int) -> tuple:
        blk = self._take_block(ptr, "pinned")
        if blk is None:
            return _err("CUDA_ERROR_INVALID_VALUE")
        self.memory.free(blk)
        return OK

    def _copy(self, what: str, dst: int, dst_kind: str, src: int, src_kind: str, n: int, stream: int) -> tuple:
        s = self._stream(stream)
        if s is None:
            return _err("CUDA_ERROR_INVALID_HANDLE")
        if (err := self._sticky(s.ctx)) is not None:
            return err
        dst, src, n = int(dst), int(src), int(n)
        mem = self.memory
        if not self.config.run_kernels:
            s.submit(_nothing)
            return OK

        def run() -> None:
            for side, addr, kind in (("destination", dst, dst_kind), ("source", src, src_kind)):
                bad = mem.check(addr, n, kind)
                if bad is not None:
                    raise StreamFault("CUDA_ERROR_ILLEGAL_ADDRESS", f"{what} of {n} B on {s.name}: {side} {bad}")
            fault = guarded_copy(dst, src, n)  # a block freed meanwhile by another stream faults here
            if fault is not None:
                raise StreamFault("CUDA_ERROR_ILLEGAL_ADDRESS", f"{what} of {n} B on {s.name}: {fault.detail} "
                                                                f"({mem.describe(fault.address)})")

        s.submit(run)
        return OK

    def cuMemcpyHtoDAsync(self, dst: int, src: int, nbytes: int, stream: int) -> tuple:
        return self._copy("cuMemcpyHtoDAsync", dst, "device", src, "host", nbytes, stream)

    def cuMemcpyDtoHAsync(self, dst: int, src: int, nbytes: int, stream: int) -> tuple:
        return self._copy("cuMemcpyDtoHAsync", dst, "host", src, "device", nbytes, stream)

    def cuMemcpyDtoDAsync(self, dst: int, src: int, nbytes: int, stream: int) -> tuple:
        return self._copy("cuMemcpyDtoDAsync", dst, "device", src, "device", nbytes, stream)

    def cuMemcpyPeerAsync(self, dst: int, dst_ctx: int, src: int, src_ctx: int, nbytes: int, stream: int) -> tuple:
        if int(dst_ctx) not in self._contexts or int(src_ctx) not in self._contexts:
            return _err("CUDA_ERROR_INVALID_CONTEXT")
        return self._copy("cuMemcpyPeerAsync", dst, "device", src, "device", nbytes, stream)

    # ---- modules and launches --------------------------------------------------------------------------------------
    def zyx_prepare_modules(self, images: list[bytes]) -> None:
        """Not a CUDA call (``Driver.prepare_modules`` looks for it): build the emulated modules of ``images``
        concurrently, ahead of their ``cuModuleLoadData``, which then finds them built. Errors are left for that
        load to report."""
        from concurrent.futures import ThreadPoolExecutor

        from zyx.backends.cuda import nvrtc
        from zyx.backends.cuda.emulator import kernels

        sources = list(dict.fromkeys(s for s in map(nvrtc.source_of, images) if s is not None))
        if not self.config.run_kernels or len(sources) < 2:
            return

        def build(source: str) -> None:
            try:
                kernels.compile_module(source)
            except kernels.EmulatorCompileError:
                pass

        with ThreadPoolExecutor(min(len(sources), os.cpu_count() or 1)) as pool:
            list(pool.map(build, sources))

    def cuModuleLoadData(self, image: Any) -> tuple:
        from zyx.backends.cuda import nvrtc
        from zyx.backends.cuda.emulator import kernels

        data = bytes(image)
        if (err := self._sticky()) is not None:
            return err + (0,)
        arch = cubin_arch(data)
        if arch is None:
            return _err("CUDA_ERROR_INVALID_IMAGE") + (0,)
        if arch != self.config.sm:
            log("dev", f"cuda emulator: cubin for sm_{arch} refused by an sm_{self.config.sm} device")
            return _err("CUDA_ERROR_NO_BINARY_FOR_GPU") + (0,)
        source = nvrtc.source_of(data)
        if source is None:
            log("dev", "cuda emulator: a cubin that NVRTC did not compile in this process cannot be emulated")
            return _err("CUDA_ERROR_INVALID_IMAGE") + (0,)
        try:
            emulated = kernels.compile_module(source) if self.config.run_kernels else _Skipped(source)
        except kernels.EmulatorCompileError as e:
            log("dev", f"cuda emulator: {e}")
            return _err("CUDA_ERROR_INVALID_IMAGE") + (0,)
        handle = next(self._ids)
        self._modules[handle] = _Module(emulated)
        return R.CUDA_SUCCESS, handle

    def cuModuleGetFunction(self, module: int, name: bytes) -> tuple:
        mod = self._modules.get(int(module))
        if mod is None:
            return _err("CUDA_ERROR_INVALID_HANDLE") + (0,)
        key = name.decode() if isinstance(name, bytes) else str(name)
        kernel = mod.emulated.functions.get(key)
        if kernel is None:
            return _err("CUDA_ERROR_NOT_FOUND") + (0,)
        handle = mod.functions.get(key)
        if handle is None:
            handle = mod.functions[key] = next(self._ids)
            self._functions[handle] = _Function(int(module), kernel)
        return R.CUDA_SUCCESS, handle

    def cuModuleUnload(self, module: int) -> tuple:
        mod = self._modules.pop(int(module), None)
        if mod is None:
            return _err("CUDA_ERROR_INVALID_HANDLE")
        for h in mod.functions.values():
            self._functions.pop(h, None)
        return OK

    def cuFuncSetAttribute(self, function: int, attr: Any, value: int) -> tuple:
        fn = self._functions.get(int(function))
        if fn is None:
            return _err("CUDA_ERROR_INVALID_HANDLE")
        if attr == CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
            if int(value) > self.config.attributes["MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"]:
                return _err("CUDA_ERROR_INVALID_VALUE")
            fn.max_dynamic_shared = int(value)
            fn.checked.clear()
        return OK

    def _geometry_error(self, grid: tuple[int, ...], block: tuple[int, ...], shared: int, fn: _Function) -> bool:
        a = self.config.attributes
        limits_g = (a["MAX_GRID_DIM_X"], a["MAX_GRID_DIM_Y"], a["MAX_GRID_DIM_Z"])
        limits_b = (a["MAX_BLOCK_DIM_X"], a["MAX_BLOCK_DIM_Y"], a["MAX_BLOCK_DIM_Z"])
        if any(not 1 <= g <= lim for g, lim in zip(grid, limits_g)):
            return True
        if any(not 1 <= b <= lim for b, lim in zip(block, limits_b)):
            return True
        if block[0] * block[1] * block[2] > a["MAX_THREADS_PER_BLOCK"]:
            return True
        return shared > max(a["MAX_SHARED_MEMORY_PER_BLOCK"], fn.max_dynamic_shared)

    def _launch_checks(self, fn: _Function, grid: tuple[int, int, int], block: tuple[int, int, int],
                       shared: int, params: Any) -> tuple | None:
        """The error of an invalid launch (geometry, missing parameters), or None."""
        key = (grid, block, shared)
        if key not in fn.checked:
            if self._geometry_error(grid, block, shared, fn):
                log("launch", f"cuda emulator: {fn.kernel.name}: launch geometry grid={grid} block={block} "
                              f"shared={shared} exceeds the device limits")
                return _err("CUDA_ERROR_INVALID_VALUE")
            fn.checked.add(key)
        if fn.kernel.param_sizes and not params:
            return _err("CUDA_ERROR_INVALID_VALUE")
        return None

    @staticmethod
    def _snapshot(fn: _Function, params: Any) -> list[bytes]:
        """The parameter values behind a ``void*[]`` (copied now, as the driver does)."""
        sizes = fn.kernel.param_sizes
        if not sizes:
            return []
        slots = (ctypes.c_void_p * len(sizes)).from_address(int(params))
        return [ctypes.string_at(slots[i], n) for i, n in enumerate(sizes)]

    def _kernel_op(self, fn: _Function, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int,
                   values: list[bytes], stream_name: str):
        kernel, mem = fn.kernel, self.memory

        def run() -> None:
            fault = kernel.run(values, grid, block, shared)
            if fault is not None:
                where = f" at {fault.address:#x} ({mem.describe(fault.address)})" if fault.kind == "address" else ""
                raise StreamFault(_FAULT_RESULTS.get(fault.kind, "CUDA_ERROR_LAUNCH_FAILED"),
                                  f"kernel {kernel.name!r} on {stream_name}: {fault.detail}{where}")

        return run

    def cuLaunchKernel(self, function: int, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                       stream: int, params: Any, extra: Any) -> tuple:
        fn, s = self._functions.get(int(function)), self._stream(stream)
        if fn is None or s is None:
            return _err("CUDA_ERROR_INVALID_HANDLE")
        if (err := self._sticky(s.ctx)) is not None:
            return err
        grid, block = (int(gx), int(gy), int(gz)), (int(bx), int(by), int(bz))
        if ((grid, block, int(shared)) not in fn.checked or not params) and \
                (err := self._launch_checks(fn, grid, block, int(shared), params)) is not None:
            return err
        if not self.config.run_kernels:  # host-overhead mode: ordered, never read
            s.submit(_nothing)
            return OK
        s.submit(self._kernel_op(fn, grid, block, int(shared), self._snapshot(fn, params), s.name))
        return OK

    # ---- graphs ----------------------------------------------------------------------------------------------------
    def _node(self, p: Any) -> tuple[tuple | None, _Node | None]:
        fn = self._functions.get(int(p.func))
        if fn is None:
            return _err("CUDA_ERROR_INVALID_HANDLE"), None
        grid = (int(p.gridDimX), int(p.gridDimY), int(p.gridDimZ))
        block = (int(p.blockDimX), int(p.blockDimY), int(p.blockDimZ))
        shared = int(p.sharedMemBytes)
        params = int(p.kernelParams)
        if (err := self._launch_checks(fn, grid, block, shared, params)) is not None:
            return err, None
        values = self._snapshot(fn, params) if self.config.run_kernels else []
        return None, _Node(int(p.func), grid, block, shared, values)

    def cuGraphCreate(self, flags: int) -> tuple:
        handle = next(self._ids)
        self._graphs[handle] = {}
        return R.CUDA_SUCCESS, handle

    def cuGraphAddKernelNode(self, graph: int, deps: Any, n: int, params: Any) -> tuple:
        nodes = self._graphs.get(int(graph))
        if nodes is None:
            return _err("CUDA_ERROR_INVALID_HANDLE") + (0,)
        if any(int(d) not in nodes for d in list(deps or ())[: int(n)]):
            return _err("CUDA_ERROR_INVALID_VALUE") + (0,)  # a dependency must be a node of this graph
        err, node = self._node(params)
        if node is None:
            return err + (0,)
        handle = next(self._ids)
        nodes[handle] = node  # dependencies come first: insertion order is a topological order
        return R.CUDA_SUCCESS, handle

    def cuGraphInstantiate(self, graph: int, flags: int) -> tuple:
        nodes = self._graphs.get(int(graph))
        if nodes is None:
            return _err("CUDA_ERROR_INVALID_HANDLE") + (0,)
        handle = next(self._ids)
        self._execs[handle] = {h: _Node(n.function, n.grid, n.block, n.shared, list(n.values))
                               for h, n in nodes.items()}
        return R.CUDA_SUCCESS, handle

    def cuGraphExecKernelNodeSetParams(self, graph_exec: int, node: int, params: Any) -> tuple:
        nodes = self._execs.get(int(graph_exec))
        if nodes is None or int(node) not in nodes:
            return _err("CUDA_ERROR_INVALID_HANDLE")
        err, new = self._node(params)
        if new is None:
            return err
        nodes[int(node)] = new  # later launches only: a queued launch holds the values it was given
        return OK

    def cuGraphLaunch(self, graph_exec: int, stream: int) -> tuple:
        nodes, s = self._execs.get(int(graph_exec)), self._stream(stream)
        if nodes is None or s is None:
            return _err("CUDA_ERROR_INVALID_HANDLE")
        if (err := self._sticky(s.ctx)) is not None:
            return err
        self.graph_launches += 1
        if not self.config.run_kernels:
            s.submit(_nothing)
            return OK
        ops = [self._kernel_op(self._functions[n.function], n.grid, n.block, n.shared, n.values, s.name)
               for n in nodes.values()]

        def run() -> None:  # one topological order of the graph: every dependency honoured
            for op in ops:
                op()

        s.submit(run)
        return OK

    def cuGraphExecDestroy(self, graph_exec: int) -> tuple:
        return OK if self._execs.pop(int(graph_exec), None) is not None else _err("CUDA_ERROR_INVALID_HANDLE")

    def cuGraphDestroy(self, graph: int) -> tuple:
        return OK if self._graphs.pop(int(graph), None) is not None else _err("CUDA_ERROR_INVALID_HANDLE")

    # ---- libraries -------------------------------------------------------------------------------------------------
    def cudnn_frontend(self) -> Any:
        """The cuDNN frontend of this machine: the reference double (no cuDNN runs on an emulated GPU)."""
        if self._cudnn is None:
            from zyx.backends.cuda.emulator.cudnn_double import ReferenceCudnn

            self._cudnn = ReferenceCudnn(self)
        return self._cudnn

    # ---- lifetime --------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every stream thread (tests that create many emulated machines call this)."""
        for s in list(self._streams.values()):
            s.stop()
        self._streams.clear()

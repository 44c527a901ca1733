"""CUDA backend without a GPU: probing, driver error mapping, argument packing, and the worker's logic (windows,
events, barriers, allocator, errors, poisoning, copies) against a fake driver that records every call and backs
device memory with host memory; cuDNN graph descriptions (construction only, no validate())."""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import struct
import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from test_cuda_streams import vacuous_waits, violations, windowed_programs  # the independent hazard checker

import zyx
from zyx.backends import registry as reg
from zyx.backends.base import BackendError, ErrorStatus
from zyx.backends.cuda import backend, cudnn, driver
from zyx.backends.cuda.args import ArgPack, KernelSpec, scalar_format
from zyx.backends.cuda.device import CudaDevice, device_info
from zyx.backends.cuda.driver import DriverError
from zyx.backends.cuda.memory import human_bytes
from zyx.backends.cuda.pool import CudaPool
from zyx.backends.cuda.worker import Reply, Worker, WorkerConfig
from zyx.backends.disk import DiskPool
from zyx.backends.host.pool import HostPool
from zyx.graph.extract import Graph
from zyx.graph.schedule import collect

H200_ATTRS = {"MULTIPROCESSOR_COUNT": 132, "MAX_THREADS_PER_BLOCK": 1024, "MAX_BLOCK_DIM_X": 1024,
              "MAX_BLOCK_DIM_Y": 1024, "MAX_BLOCK_DIM_Z": 64, "MAX_GRID_DIM_X": 2**31 - 1, "MAX_GRID_DIM_Y": 65535,
              "MAX_GRID_DIM_Z": 65535, "MAX_SHARED_MEMORY_PER_BLOCK": 49152,
              "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": 232448, "WARP_SIZE": 32, "COMPUTE_CAPABILITY_MAJOR": 9,
              "COMPUTE_CAPABILITY_MINOR": 0, "L2_CACHE_SIZE": 60 << 20, "MAX_REGISTERS_PER_BLOCK": 65536,
              "MEMORY_POOLS_SUPPORTED": 1, "CLOCK_RATE": 1980000, "MEMORY_CLOCK_RATE": 2619000,
              "GLOBAL_MEMORY_BUS_WIDTH": 6144}


# ---------------------------------------------------------------------------------------------------------------
# a fake driver: the methods of zyx.backends.cuda.driver.Driver, device memory = host memory
# ---------------------------------------------------------------------------------------------------------------


def _code(name: str) -> int:
    try:
        from cuda.bindings import driver as cu

        return int(getattr(cu.CUresult, name))
    except (ImportError, AttributeError):
        return 999


def fake_error(name: str, call: str = "fake call") -> DriverError:
    status = ErrorStatus.ALLOCATION if name == driver.OUT_OF_MEMORY else ErrorStatus.LAUNCH
    return DriverError(status, f"{call}: {name} (fake description)", _code(name), name)


class FakeDriver:
    """Records calls; events complete at once unless ``hold`` is set; ``async_error`` (a CUDA error name) is then
    reported by every query and synchronize, like a sticky error after a faulting kernel."""

    def __init__(self, devices: int = 1, memory: int = 1 << 30, pools: bool = True, peer: bool = True,
                 attrs: dict | None = None, name: str = "NVIDIA H200") -> None:
        self.devices, self.memory, self.peer, self.name = devices, memory, peer, name
        self.attrs = dict(attrs or H200_ATTRS)
        self.attrs["MEMORY_POOLS_SUPPORTED"] = int(pools)
        self.calls: list[tuple[str, tuple]] = []
        self.ids = itertools.count(0x1000)
        self.blocks: dict[int, ctypes.Array] = {}  # ptr -> backing host memory (device and pinned)
        self.sizes: dict[int, int] = {}
        self.used = 0  # live device allocations
        self.pool_cache: dict[int, list[int]] = {}  # freed stream-ordered blocks by size (the driver's pool)
        self.pool_cached = 0
        self.events: dict[int, tuple[int, bool]] = {}  # event -> (stream, complete)
        self.hold = False
        self.async_error: str | None = None
        self.fail_once: dict[str, str] = {}  # method -> error name raised at its next call
        self.kernels: dict[int, str] = {}  # function -> kernel name
        self.launches: list[tuple[str, tuple, tuple, int, int, int]] = []  # name, grid, block, shared, stream, params
        self.on_launch = None  # fn(name, params) emulating the kernel
        self.elapsed_ms = 1.5
        self.executes_machine_code = True  # as the NVIDIA driver: cubins compiled at full optimization

    # helpers
    def _rec(self, name: str, *args) -> None:
        self.calls.append((name, args))
        err = self.fail_once.pop(name, None)
        if err is not None:
            raise fake_error(err, name)

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.calls if n == name)

    def _mem(self, size: int) -> int:
        buf = (ctypes.c_uint8 * max(size, 1))()
        ptr = ctypes.addressof(buf)
        self.blocks[ptr] = buf
        self.sizes[ptr] = size
        return ptr

    def release_events(self) -> None:
        self.hold = False
        self.events = {e: (s, True) for e, (s, _) in self.events.items()}

    def _sticky(self, call: str) -> None:
        if self.async_error is not None:
            raise fake_error(self.async_error, call)

    # devices and contexts
    def init(self) -> None:
        self._rec("init")

    def device_count(self) -> int:
        return self.devices

    def device(self, ordinal: int) -> int:
        return 100 + ordinal

    def device_name(self, dev: int) -> str:
        return self.name

    def device_attribute(self, dev: int, name: str) -> int:
        return self.attrs.get(name, 0)

    def total_memory(self, dev: int) -> int:
        return self.memory

    def primary_context(self, dev: int) -> int:
        self._rec("primary_context", dev)
        return 200 + dev

    def set_current(self, ctx: int) -> None:
        self._rec("set_current", ctx)

    def can_access_peer(self, dev: int, peer: int) -> bool:
        return self.peer

    def enable_peer_access(self, peer_ctx: int) -> None:
        self._rec("enable_peer_access", peer_ctx)

    # streams and events
    def stream_create(self) -> int:
        return next(self.ids)

    def stream_synchronize(self, stream: int) -> None:
        self._rec("stream_synchronize", stream)
        self._sticky("cuStreamSynchronize")
        self.events = {e: (s, done or s == stream) for e, (s, done) in self.events.items()}

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._rec("stream_wait_event", stream, event)

    def event_create(self, timing: bool = False) -> int:
        ev = next(self.ids)
        self.events[ev] = (0, True)
        return ev

    def event_record(self, event: int, stream: int) -> None:
        self._rec("event_record", event, stream)
        self.events[event] = (stream, not self.hold)

    def event_query(self, event: int) -> bool:
        self._rec("event_query", event)
        self._sticky("cuEventQuery")
        return self.events[event][1]

    def event_synchronize(self, event: int) -> None:
        self._rec("event_synchronize", event)
        self._sticky("cuEventSynchronize")
        self.events[event] = (self.events[event][0], True)

    def event_elapsed_ms(self, start: int, end: int) -> float:
        return self.elapsed_ms

    # memory
    def default_mem_pool(self, dev: int) -> int:
        return 300 + dev

    def mem_pool_set_release_threshold(self, pool: int, nbytes: int) -> None:
        self._rec("mem_pool_set_release_threshold", pool, nbytes)

    def mem_pool_usage(self, pool: int) -> tuple[int, int]:
        return self.used + self.pool_cached, self.used

    def mem_pool_trim(self, pool: int, keep_bytes: int = 0) -> None:
        self._rec("mem_pool_trim", pool, keep_bytes)
        self.pool_cache.clear()
        self.pool_cached = 0

    def mem_alloc_async(self, nbytes: int, stream: int) -> int:
        self._rec("mem_alloc_async", nbytes, stream)
        cached = self.pool_cache.get(nbytes)
        if cached:
            self.pool_cached -= nbytes
            self.used += nbytes
            return cached.pop()
        if self.used + self.pool_cached + nbytes > self.memory:
            raise fake_error(driver.OUT_OF_MEMORY, "cuMemAllocAsync")
        self.used += nbytes
        return self._mem(nbytes)

    def mem_free_async(self, ptr: int, stream: int) -> None:
        self._rec("mem_free_async", ptr, stream)
        size = self.sizes[ptr]
        self.used -= size
        self.pool_cache.setdefault(size, []).append(ptr)
        self.pool_cached += size

    def mem_alloc(self, nbytes: int) -> int:
        self._rec("mem_alloc", nbytes)
        if self.used + nbytes > self.memory:
            raise fake_error(driver.OUT_OF_MEMORY, "cuMemAlloc")
        self.used += nbytes
        return self._mem(nbytes)

    def mem_free(self, ptr: int) -> None:
        self._rec("mem_free", ptr)
        self.used -= self.sizes.pop(ptr)
        del self.blocks[ptr]

    def mem_get_info(self) -> tuple[int, int]:
        return self.memory - self.used - self.pool_cached, self.memory

    def host_alloc(self, nbytes: int) -> int:
        self._rec("host_alloc", nbytes)
        return self._mem(nbytes)

    def host_free(self, ptr: int) -> None:
        self._rec("host_free", ptr)
        del self.blocks[ptr]

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._rec("memcpy_htod_async", dst, src, nbytes, stream)
        ctypes.memmove(dst, src, nbytes)

    def memcpy_dtoh_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._rec("memcpy_dtoh_async", dst, src, nbytes, stream)
        self._sticky("cuMemcpyDtoHAsync")
        ctypes.memmove(dst, src, nbytes)

    def memcpy_dtod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._rec("memcpy_dtod_async", dst, src, nbytes, stream)
        ctypes.memmove(dst, src, nbytes)

    def memcpy_peer_async(self, dst: int, dst_ctx: int, src: int, src_ctx: int, nbytes: int, stream: int) -> None:
        self._rec("memcpy_peer_async", dst, dst_ctx, src, src_ctx, nbytes, stream)
        ctypes.memmove(dst, src, nbytes)

    # modules and launches
    def module_load(self, image: bytes) -> int:
        self._rec("module_load", len(image))
        return next(self.ids)

    def module_function(self, module: int, name: str) -> int:
        fn = next(self.ids)
        self.kernels[fn] = name
        return fn

    def module_unload(self, module: int) -> None:
        self._rec("module_unload", module)

    def func_set_max_dynamic_shared(self, function: int, nbytes: int) -> None:
        self._rec("func_set_max_dynamic_shared", function, nbytes)

    def launch_kernel(self, function, grid, block, shared_bytes, stream, params) -> None:
        self._rec("launch_kernel", function, stream)
        self._sticky("cuLaunchKernel")
        name = self.kernels[function]
        self.launches.append((name, grid, block, shared_bytes, stream, params))
        if self.on_launch is not None:
            self.on_launch(name, params)


def read_args(params: int, formats: tuple) -> list:
    """Decode a kernelParams array: follow each pointer, unpack with the format (None = device pointer)."""
    out = []
    for i, fmt in enumerate(formats):
        slot = ctypes.c_uint64.from_address(params + 8 * i).value
        raw = ctypes.string_at(slot, 8)
        out.append(struct.unpack_from("<Q" if fmt is None else "<" + fmt, raw)[0])
    return out


ADD_ONE = KernelSpec("add_one", (4, 1, 1), (256, 1, 1), 0, ("in", "out", "var"), (None, None, "q"))
COPY = KernelSpec("copy", (1, 1, 1), (32, 1, 1), 0, ("in", "out"), (None, None))


def emulate_add_one(name: str, params: int) -> None:
    """The fake GPU runs ``add_one`` (float32 y = x + 1 over n elements) and ``copy``; others do nothing."""
    if name == "add_one":
        x, y, n = read_args(params, ADD_ONE.formats)
        src = np.ctypeslib.as_array((ctypes.c_float * n).from_address(x))
        np.ctypeslib.as_array((ctypes.c_float * n).from_address(y))[:] = src + 1


@pytest.fixture
def fake():
    return FakeDriver()


@pytest.fixture
def make_worker(fake):
    workers = []

    def make(drv=None, ordinal=0, **cfg):
        cfg.setdefault("idle_flush_s", None)
        w = Worker(drv or fake, ordinal, WorkerConfig(**cfg))
        workers.append(w)
        return w

    yield make
    for w in workers:
        w.close()


def barrier(w: Worker) -> None:
    """Wait until the worker processed everything posted before (the queue is FIFO)."""
    w.call(lambda: None)


def upload(pool: CudaPool, arr: np.ndarray) -> int:
    bid = pool.allocate(arr.nbytes)
    pool.host_to_pool(memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)), bid)
    return bid


def download(pool: CudaPool, bid: int, like: np.ndarray) -> np.ndarray:
    out = np.empty_like(like)
    pool.pool_to_host(bid, memoryview(out.reshape(-1).view(np.uint8)))
    return out


# ---------------------------------------------------------------------------------------------------------------
# probing and the registry
# ---------------------------------------------------------------------------------------------------------------


def _have_driver() -> bool:
    return driver.unavailable_reason() is None


@pytest.mark.skipif(_have_driver(), reason="a CUDA driver is present")
def test_registry_reports_missing_driver(tmp_path, monkeypatch):
    monkeypatch.setenv("ZYX_CUDA_EMULATE", "0")  # the real driver only
    f = tmp_path / "c.json"
    f.write_text("{}")
    status = reg.Registry(f).report()
    assert status["cuda"] == f"unavailable: {driver.NO_LIBCUDA}"
    out = subprocess.run([sys.executable, "-m", "zyx", "--size", "4096"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "ZYX_CONFIG": str(f)})
    assert out.returncode == 0, out.stderr
    assert "cuda  unavailable: libcuda.so not found" in out.stdout


def test_missing_cuda_python_is_a_clear_reason(monkeypatch):
    def no_bindings():
        raise ImportError("No module named 'cuda'")

    monkeypatch.setattr(driver, "_bindings", no_bindings)
    with pytest.raises(BackendError, match=r"cuda-python not installed: pip install 'zyx\[cuda\]'") as e:
        driver.load_driver()
    assert e.value.status is ErrorStatus.INITIALIZATION
    assert driver.unavailable_reason() == driver.NO_CUDA_PYTHON


def test_missing_libcuda_is_a_clear_reason(monkeypatch):
    class NoLib:
        def __getattr__(self, name):
            if name == "cuInit":
                def call(flags):
                    raise RuntimeError('"cuda" is an NVIDIA driver library and can only be found via system search')
                return call
            return type("Enum", (), {"CU_EVENT_DEFAULT": 0, "CU_EVENT_DISABLE_TIMING": 2,
                                     "CU_STREAM_NON_BLOCKING": 1})

    monkeypatch.setattr(driver, "_bindings", lambda: NoLib())
    with pytest.raises(BackendError, match="libcuda.so not found: no NVIDIA driver on this machine"):
        driver.load_driver()


def test_probe_with_fake_driver_names_placements_and_checks_ids(monkeypatch):
    fake = FakeDriver(devices=2)
    ps = backend.probe({"device_ids": None, "cudnn": False, "queues": 3}, driver=fake)
    try:
        assert [p.name for p in ps] == ["cuda:0", "cuda:1"]
        assert isinstance(ps[0].pool, CudaPool) and isinstance(ps[0].primary, CudaDevice)
        assert len(ps[0].pool.worker.streams) == 3
        assert ps[1].primary.info().compute_capability == (9, 0)
    finally:
        for p in ps:
            p.pool.worker.close()
    ps = backend.probe({"device_ids": [1], "cudnn": False, "queues": 1}, driver=fake)
    assert [p.name for p in ps] == ["cuda:1"]
    ps[0].pool.worker.close()
    with pytest.raises(BackendError, match=r"cuda.device_ids lists GPU 5 but only 2 GPU\(s\) are visible"):
        backend.probe({"device_ids": [5]}, driver=fake)
    with pytest.raises(BackendError, match="no CUDA GPU visible"):
        backend.probe({"device_ids": None}, driver=FakeDriver(devices=0))


def test_worker_start_failure_is_a_backend_error():
    fake = FakeDriver()
    fake.fail_once["set_current"] = "CUDA_ERROR_INVALID_CONTEXT"
    with pytest.raises(BackendError, match="CUDA_ERROR_INVALID_CONTEXT"):
        backend.probe({"device_ids": None, "cudnn": False}, driver=fake)


# ---------------------------------------------------------------------------------------------------------------
# driver wrapper and pure helpers
# ---------------------------------------------------------------------------------------------------------------


def test_check_unpacks_outputs_and_names_errors():
    assert driver.check((0,), ErrorStatus.SYNC, "x") is None
    assert driver.check((0, 7), ErrorStatus.SYNC, "x") == 7
    assert driver.check((0, 1, 2), ErrorStatus.SYNC, "x") == (1, 2)
    with pytest.raises(DriverError, match=r"cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY \(") as e:
        driver.check((_code("CUDA_ERROR_OUT_OF_MEMORY"), 0), ErrorStatus.ALLOCATION, "cuMemAlloc")
    assert e.value.name == "CUDA_ERROR_OUT_OF_MEMORY" and e.value.status is ErrorStatus.ALLOCATION
    assert not e.value.sticky
    with pytest.raises(DriverError) as e:
        driver.check(_code("CUDA_ERROR_ILLEGAL_ADDRESS"), ErrorStatus.SYNC, "cuStreamSynchronize")
    assert e.value.sticky and isinstance(e.value, BackendError)


def test_arg_pack_layout():
    pack = ArgPack(6).fill((None, "f", "q", "?", "e", "bf16"), (0xDEADBEEF000, 1.5, -3, 1, 0.5, 2.0))
    base = ctypes.addressof(pack.array)
    assert pack.address == base + 6 * 8
    for i in range(6):  # the pointer array points at the value slots
        assert ctypes.c_uint64.from_address(pack.address + 8 * i).value == base + 8 * i
    assert struct.unpack("<Q", pack.slot(0))[0] == 0xDEADBEEF000
    assert struct.unpack("<f", pack.slot(1)[:4])[0] == 1.5
    assert struct.unpack("<q", pack.slot(2))[0] == -3
    assert pack.slot(3)[0] == 1
    assert struct.unpack("<e", pack.slot(4)[:2])[0] == 0.5
    assert struct.unpack("<H", pack.slot(5)[:2])[0] == int(np.array(2.0, ml_dtypes.bfloat16).view(np.uint16))
    assert ArgPack(0).address == 0


def test_scalar_format_follows_the_renderers_c_type():
    assert scalar_format("float16", "const float") == "f"  # half scalars are passed as float
    assert scalar_format("bfloat16", "const float") == "f"
    assert scalar_format("int64", "const long long") == "q"
    assert scalar_format("bool", "const bool") == "?"
    assert scalar_format("int32") == "i" and scalar_format("float64") == "d"
    with pytest.raises(BackendError, match="no CUDA scalar parameter type"):
        scalar_format("complex64")


def test_human_bytes():
    assert human_bytes(8 << 30) == "8.0 GiB"
    assert human_bytes(int(1.2 * (1 << 30))) == "1.2 GiB"
    assert human_bytes(5 << 20) == "5.0 MiB"


def test_device_info_from_attributes():
    info = device_info("cuda:0", "NVIDIA H200", H200_ATTRS, 141 << 30)
    assert info.kind == "cuda" and info.compute_units == 132 and info.warp_size == 32
    assert info.compute_capability == (9, 0) and info.tensor_cores
    assert {"float16", "bfloat16", "float32", "float64"} <= info.dtypes
    assert info.memory_gbps == 4300.0 and info.extra["tensor_tflops"]["bfloat16"] == 990.0
    assert info.extra["tensor_tflops"]["float32"] == 495.0  # TF32
    assert info.max_local_threads == 1024 and info.local_memory_bytes == 48 << 10
    assert info.extra["shared_optin_bytes"] == 232448 and info.extra["arch"] == "sm_90"
    old = device_info("cuda:1", "Tesla V100", {**H200_ATTRS, "COMPUTE_CAPABILITY_MAJOR": 7})
    assert "bfloat16" not in old.dtypes and old.tensor_cores and 500 < old.memory_gbps < 5000


# ---------------------------------------------------------------------------------------------------------------
# the worker: windows, streams, events
# ---------------------------------------------------------------------------------------------------------------


def _kernel(w: Worker, spec: KernelSpec = ADD_ONE) -> int:
    return w.load_module(b"\x7fELF fake cubin", spec)


def test_worker_owns_the_primary_context(fake, make_worker):
    w = make_worker(queues=4)
    ctx = 300  # the fake's primary context of device 100 (ordinal 0)
    assert ("primary_context", (100,)) in fake.calls and ("set_current", (ctx,)) in fake.calls
    assert len(w.streams) == 4 and w.device_name == "NVIDIA H200"
    assert ("mem_pool_set_release_threshold", (400, (1 << 64) - 1)) in fake.calls  # default pool of device 100


def test_window_is_submitted_when_full_or_at_a_sync_point(fake, make_worker):
    w = make_worker(queues=2, window=4)
    pool = CudaPool(w)
    k = _kernel(w)
    x, y = pool.allocate(64), pool.allocate(64)
    for _ in range(3):
        w.launch(k, (x, y, 16))
    barrier(w)
    assert fake.count("launch_kernel") == 0 and len(w.call(lambda: list(w.pending))) == 3
    w.launch(k, (x, y, 16))
    barrier(w)
    assert fake.count("launch_kernel") == 4
    w.launch(k, (x, y, 16))
    barrier(w)
    assert fake.count("launch_kernel") == 4
    pool.sync()
    assert fake.count("launch_kernel") == 5
    # only the stream the last window ran on is waited for (the first window was seen complete)
    last_stream = fake.launches[-1][4]
    assert [a for n, a in fake.calls if n == "stream_synchronize"] == [(last_stream,)]
    pool.sync()  # nothing in flight: no driver call
    assert fake.count("stream_synchronize") == 1


def test_idle_flush_submits_a_partial_window(fake, make_worker):
    w = make_worker(queues=2, window=100, idle_flush_s=0.001)
    pool = CudaPool(w)
    k = _kernel(w)
    x, y = pool.allocate(64), pool.allocate(64)
    w.launch(k, (x, y, 16))
    for _ in range(200):
        if fake.count("launch_kernel"):
            break
        time.sleep(0.005)
    assert fake.count("launch_kernel") == 1


def stream_waits(fake, w: Worker) -> list[tuple[int, int]]:
    """(waiting stream, stream the awaited event was recorded on) per ``stream_wait_event``, in call order,
    leaving out the waits for stream-ordered allocations (recorded on the allocator's stream)."""
    recorded, out = {}, []
    for name, args in fake.calls:
        if name == "event_record":
            recorded[args[0]] = args[1]
        elif name == "stream_wait_event" and recorded.get(args[1]) != w.allocator.stream:
            out.append((args[0], recorded.get(args[1])))
    return out


def test_independent_chains_spread_over_streams_with_event_waits(fake, make_worker):
    w = make_worker(queues=4, window=100)
    w.call(setattr, w, "trace", [])
    pool = CudaPool(w)
    k = _kernel(w)
    a, b, c, d, e = (pool.allocate(64) for _ in range(5))
    w.launch(k, (a, b, 1))  # chain 1: a -> b
    w.launch(k, (c, d, 1))  # chain 2: c -> d, independent: another stream
    w.launch(k, (b, e, 1))  # reads b: b's stream, no wait
    pool.sync()
    (_, placed), = w.trace
    streams = [s for _, s, _ in placed]
    assert streams[0] != streams[1] and streams[2] == streams[0]
    assert all(waits == () for _, _, waits in placed)
    assert stream_waits(fake, w) == []
    # a consumer of both chains waits for the other chain's stream with one event
    f = pool.allocate(64)
    w.call(w.trace.clear)
    join = _kernel(w, KernelSpec("join", (1, 1, 1), (1, 1, 1), 0, ("in", "in", "out"), (None, None, None)))
    w.launch(join, (e, d, f))
    pool.sync()
    (_, ((_, s, waits),)), = w.trace
    assert s == streams[0] and waits == (streams[1],)
    assert stream_waits(fake, w) == [(w.streams[s], w.streams[streams[1]])]


def test_stream_ordered_allocations_are_awaited_by_their_first_users_stream(fake, make_worker):
    w = make_worker(queues=4, window=100)
    pool = CudaPool(w)
    k = _kernel(w)
    fake.calls.clear()
    x, y = pool.allocate(64), pool.allocate(64)
    w.launch(k, (x, y, 16))
    w.launch(k, (y, x, 16))  # second use: already ordered after the first (no second allocation wait)
    pool.sync()
    calls = fake.calls
    names = [n for n, _ in calls]
    alloc_stream = w.allocator.stream
    allocs = [i for i, n in enumerate(names) if n == "mem_alloc_async"]
    assert len(allocs) == 2 and all(calls[i][1][1] == alloc_stream for i in allocs)
    marks = [i for i, (n, a) in enumerate(calls) if n == "event_record" and a[1] == alloc_stream]
    first_launch = names.index("launch_kernel")
    # one event after both allocations covers them; the first user's stream waits for it once, before it runs
    assert len(marks) == 1 and allocs[-1] < marks[0] < first_launch
    ev = calls[marks[0]][1][0]
    assert [a for n, a in calls if n == "stream_wait_event"] == [(fake.launches[0][4], ev)]
    assert names.index("stream_wait_event") < first_launch
    # a window of fresh buffers: one event for all of them, one wait per stream running their first users
    outs = [pool.allocate(64) for _ in range(6)]
    fake.calls.clear()
    fake.launches.clear()
    for o in outs:
        w.launch(k, (x, o, 16))
    pool.sync()
    marks = [a[0] for n, a in fake.calls if n == "event_record" and a[1] == alloc_stream]
    assert len(marks) == 1
    waits = [a[0] for n, a in fake.calls if n == "stream_wait_event" and a[1] == marks[0]]
    assert sorted(waits) == sorted({launch[4] for launch in fake.launches})
    fresh = pool.allocate(16)  # read back before any command used it: the copy's stream waits too
    fake.calls.clear()
    pool.pool_to_host(fresh, memoryview(np.empty(4, np.float32).view(np.uint8)))
    names = [n for n, _ in fake.calls]
    assert names.index("stream_wait_event") < names.index("memcpy_dtoh_async")


def test_stream_state_persists_across_windows(fake, make_worker):
    w = make_worker(queues=3, window=1)  # every command is its own window
    w.call(setattr, w, "trace", [])
    pool = CudaPool(w)
    k = _kernel(w)
    a, b, c = (pool.allocate(64) for _ in range(3))
    w.launch(k, (a, b, 1))
    w.launch(k, (b, c, 1))
    pool.sync()
    first, second = w.trace
    assert second[1][0][1] == first[1][0][1]  # the reader of b follows b's writer onto its stream


def test_events_are_reused_after_completion(fake, make_worker):
    w = make_worker(queues=2, window=100)
    pool = CudaPool(w)
    k = _kernel(w)
    a, b = pool.allocate(64), pool.allocate(64)
    for _ in range(5):
        w.launch(k, (a, b, 1))
        pool.sync()
    created = len(fake.events)
    for _ in range(20):
        w.launch(k, (a, b, 1))
        pool.sync()
    assert len(fake.events) == created  # completion events come back from the free list


def test_kernel_arguments_are_packed_and_kept_until_completion(fake, make_worker):
    w = make_worker(queues=1)
    pool = CudaPool(w)
    k = _kernel(w)
    seen = []
    fake.on_launch = lambda name, params: seen.append(read_args(params, ADD_ONE.formats))
    x, y = pool.allocate(64), pool.allocate(64)
    fake.hold = True
    w.launch(k, (x, y, 16))
    w.call(w._w_flush)
    ptr_x, ptr_y = w.buffers[x].ptr, w.buffers[y].ptr
    assert seen == [[ptr_x, ptr_y, 16]]
    name, grid, block, shared, _, params = fake.launches[0]
    assert (name, grid, block, shared) == ("add_one", (4, 1, 1), (256, 1, 1), 0)
    window = w.call(lambda: w.inflight[0])
    assert any(isinstance(o, ArgPack) and o.address == params for o in window.keep)
    fake.release_events()
    pool.sync()
    assert w.call(lambda: w.inflight) == []
    assert w.arg_packs[3]  # the block went back to the free list


def test_large_shared_memory_opts_in_and_is_bounded(fake, make_worker):
    w = make_worker()
    _kernel(w, KernelSpec("big", (1, 1, 1), (128, 1, 1), 100 << 10, ("out",), (None,)))
    assert fake.count("func_set_max_dynamic_shared") == 1
    with pytest.raises(BackendError, match="needs 300000 B of shared memory; cuda:0 allows at most 232448 B"):
        _kernel(w, KernelSpec("huge", (1, 1, 1), (128, 1, 1), 300000, ("out",), (None,)))


def test_module_load_failure_names_the_kernel_and_the_architecture(fake, make_worker):
    w = make_worker()
    fake.fail_once["module_load"] = "CUDA_ERROR_NO_BINARY_FOR_GPU"
    with pytest.raises(BackendError, match=r"loading kernel 'add_one' failed: .*NO_BINARY_FOR_GPU.*exact "
                                           r"architecture \(sm_90\)"):
        _kernel(w)


# ---------------------------------------------------------------------------------------------------------------
# buffers: reference counts, barriers, allocator
# ---------------------------------------------------------------------------------------------------------------


def test_reference_counts_free_once(fake, make_worker):
    pool = CudaPool(make_worker())
    b = pool.allocate(100)
    pool.retain(b)
    pool.release(b)
    barrier(pool.worker)
    assert fake.count("mem_free_async") == 0
    pool.release(b)
    barrier(pool.worker)
    assert fake.count("mem_free_async") == 1  # never used on a stream: freed at once
    with pytest.raises(BackendError, match="release of unknown buffer"):
        pool.release(b)


def test_free_waits_for_barriers_on_every_stream_that_used_the_buffer(fake, make_worker):
    w = make_worker(queues=3, window=100)
    w.call(setattr, w, "trace", [])
    pool = CudaPool(w)
    k = _kernel(w)
    src, a, b = pool.allocate(64), pool.allocate(64), pool.allocate(64)
    w.launch(k, (src, a, 1))
    w.launch(k, (src, b, 1))  # both read src; placed on different streams
    pool.sync()
    assert len(w.call(lambda: set(w.buffers[src].streams))) == 2
    fake.hold = True
    w.launch(k, (src, a, 1))
    pool.release(src)  # still named by the unsubmitted window: buried after it is submitted
    barrier(w)
    assert fake.count("mem_free_async") == 0 and src in w.buffers
    w.call(w._w_flush)
    w.call(w._w_sweep)
    assert fake.count("mem_free_async") == 0 and len(w.dead) == 1 and src not in w.buffers
    used = {stream for _, placed in w.trace for _, stream, _ in placed}  # every command read src
    assert {s for s, _ in w.dead[0].barriers} == used
    fake.release_events()
    w.call(w._w_sweep)
    assert fake.count("mem_free_async") == 1 and w.dead == []
    assert src not in w.state.readers_since_write and all(b != src for b, _ in w.state.last_read_at)


def test_a_freed_buffer_waits_for_its_windows_without_events_of_its_own(fake, make_worker):
    w = make_worker(queues=2, window=100)
    pool = CudaPool(w)
    k = _kernel(w)
    x, y, z, v = (pool.allocate(64) for _ in range(4))
    w.launch(k, (x, y, 1))
    pool.sync()  # its window was seen complete: y's stream holds no work
    records = fake.count("event_record")
    pool.release(y)
    barrier(w)
    assert fake.count("mem_free_async") == 1 and fake.count("event_record") == records and w.dead == []
    fake.hold = True  # windows stay in flight from here
    w.launch(k, (x, z, 1))
    w.call(w._w_flush)
    records = fake.count("event_record")
    pool.release(z)
    barrier(w)
    assert fake.count("event_record") == records  # it waits for the window in flight, no event of its own
    w.launch(k, (x, v, 1))
    pool.release(v)  # named by the unsubmitted window: buried when it is submitted, waiting for that window
    barrier(w)
    w.call(w._w_flush)
    assert fake.count("mem_free_async") == 1
    dead = w.call(lambda: list(w.dead))
    assert [d.barriers for d in dead] == [[], []] and [id(d.after) for d in dead] == [id(x) for x in w.inflight]
    w.call(w._w_sweep)
    assert fake.count("mem_free_async") == 1  # the window's events are not complete
    fake.release_events()
    pool.sync()
    assert fake.count("mem_free_async") == 3 and w.dead == []


def test_steady_state_reuses_memory_and_free_bytes_returns(fake, make_worker):
    w = make_worker(queues=4)
    pool = CudaPool(w)
    k = _kernel(w)
    start = pool.free_bytes()
    for _ in range(50):
        x, y = pool.allocate(4096), pool.allocate(4096)
        w.launch(k, (x, y, 1))
        pool.release(x)
        pool.release(y)
        pool.sync()
    assert pool.free_bytes() == start
    assert fake.used == 0 and w.call(lambda: len(w.buffers)) == 0
    # the driver's pool recycles the freed blocks: no fresh device memory after the first round
    assert len([p for p, s in fake.sizes.items() if s == 4096]) == 2


def test_out_of_memory_releases_cache_retries_then_reports(fake, make_worker):
    fake.memory = 64 << 20
    pool = CudaPool(make_worker())
    a = pool.allocate(40 << 20)
    pool.release(a)  # cached by the driver's pool (release threshold raised)
    pool.sync()
    b = pool.allocate(50 << 20)  # does not fit beside the cached block: trim, retry, succeed
    assert fake.count("mem_pool_trim") == 1
    with pytest.raises(BackendError, match=r"out of memory on cuda:0: asked 20\.0 MiB, 14\.0 MiB free of "
                                           r"64\.0 MiB; free tensors you no longer need") as e:
        pool.allocate(20 << 20)
    assert e.value.status is ErrorStatus.ALLOCATION
    assert fake.count("mem_pool_trim") == 2
    pool.release(b)


def test_small_allocations_are_posted_without_a_round_trip(fake, make_worker, monkeypatch):
    w = make_worker()
    pool = CudaPool(w)
    real_call = w.call
    monkeypatch.setattr(w, "call", lambda *a: pytest.fail("allocate waited for the worker thread"))
    ids = [pool.allocate(1024) for _ in range(3)]
    monkeypatch.setattr(w, "call", real_call)
    assert len(set(ids)) == 3
    data = np.arange(256, dtype=np.float32)
    pool.host_to_pool(memoryview(data.view(np.uint8)), ids[0])  # queued after the posted allocation
    out = np.empty_like(data)
    pool.pool_to_host(ids[0], memoryview(out.view(np.uint8)))
    np.testing.assert_array_equal(out, data)
    for b in ids:
        pool.release(b)
    pool.sync()
    assert w.call(lambda: len(w.buffers)) == 0 and w._posted_bytes == 0


def test_a_posted_allocation_that_fails_raises_at_the_next_sync(fake, make_worker, monkeypatch):
    w = make_worker()
    pool = CudaPool(w)
    pool.sync()

    def full(*args):
        raise fake_error(driver.OUT_OF_MEMORY, "cuMemAllocAsync")  # another process took the memory meanwhile

    monkeypatch.setattr(fake, "mem_alloc_async", full)
    monkeypatch.setattr(fake, "mem_alloc", full)
    bid = pool.allocate(1024)  # looks affordable: posted
    with pytest.raises(BackendError, match="out of memory on cuda:0: asked") as e:
        pool.sync()
    assert e.value.status is ErrorStatus.ALLOCATION
    with pytest.raises(BackendError, match=f"buffer {bid} is not a live buffer"):
        pool.pool_to_host(bid, memoryview(np.empty(256, np.float32).view(np.uint8)))
    pool.release(bid)


def test_caching_allocator_without_memory_pools(make_worker):
    fake = FakeDriver(pools=False)
    w = make_worker(drv=fake)
    pool = CudaPool(w)
    for _ in range(10):
        pool.release(pool.allocate(1000))
    pool.sync()
    assert fake.count("mem_alloc") == 1 and fake.count("mem_free") == 0  # reused from the size-keyed cache


# ---------------------------------------------------------------------------------------------------------------
# errors: submission failures, asynchronous faults, poisoned buffers
# ---------------------------------------------------------------------------------------------------------------


def test_submission_failure_poisons_outputs_and_surfaces_at_sync(fake, make_worker):
    w = make_worker(queues=2)
    pool = CudaPool(w)
    k = _kernel(w)
    x = upload(pool, np.arange(16, dtype=np.float32))
    y, z = pool.allocate(64), pool.allocate(64)
    fake.fail_once["launch_kernel"] = "CUDA_ERROR_INVALID_VALUE"
    w.launch(k, (x, y, 16))
    w.launch(k, (y, z, 16))  # reads the poisoned y: skipped, z poisoned too
    with pytest.raises(BackendError, match=r"kernel 'add_one' could not be submitted: .*INVALID_VALUE") as e:
        pool.sync()
    assert e.value.status is ErrorStatus.LAUNCH
    assert len(fake.launches) == 0
    with pytest.raises(BackendError, match=r"buffer \d+ holds no valid data: .*kernel 'add_one' could not be "
                                           r"submitted"):
        download(pool, z, np.empty(16, np.float32))
    np.testing.assert_array_equal(download(pool, x, np.empty(16, np.float32)), np.arange(16))
    pool.host_to_pool(memoryview(np.ones(16, np.float32).view(np.uint8)), y)  # a full overwrite heals it
    np.testing.assert_array_equal(download(pool, y, np.empty(16, np.float32)), np.ones(16))


def test_asynchronous_fault_names_the_kernel_and_poisons(fake, make_worker):
    w = make_worker(queues=2)
    pool = CudaPool(w)
    good = _kernel(w)
    bad = _kernel(w, KernelSpec("oob_writer", (1, 1, 1), (1, 1, 1), 0, ("in", "out"), (None, None)))
    x = upload(pool, np.zeros(4, np.float32))
    y, z = pool.allocate(16), pool.allocate(16)
    w.launch(good, (x, y, 4))
    pool.sync()  # the first window completed: it is not a suspect

    def fault(name, params):
        if name == "oob_writer":
            fake.async_error = "CUDA_ERROR_ILLEGAL_ADDRESS"

    fake.on_launch = fault
    w.launch(bad, (x, z))
    with pytest.raises(BackendError, match=r"cuda:0: kernel 'oob_writer' failed asynchronously: "
                                           r"cuStreamSynchronize: CUDA_ERROR_ILLEGAL_ADDRESS .*restart the process"):
        pool.sync()
    with pytest.raises(BackendError, match="cuda:0 is unusable after an earlier error"):
        download(pool, y, np.empty(4, np.float32))
    with pytest.raises(BackendError, match="unusable"):
        pool.allocate(16)
    calls = len(fake.calls)
    w.launch(good, (x, y, 4))
    pool.release(z)
    w.call(w._w_flush)
    assert len(fake.calls) == calls  # no driver call after a sticky error
    assert "oob_writer" in w.call(lambda: w.buffers[y].poison)  # written after the fault: poisoned too


def test_asynchronous_fault_in_a_window_lists_every_suspect(fake, make_worker):
    w = make_worker(queues=2)
    pool = CudaPool(w)
    k1 = _kernel(w, KernelSpec("first", (1, 1, 1), (1, 1, 1), 0, ("out",), (None,)))
    k2 = _kernel(w, KernelSpec("second", (1, 1, 1), (1, 1, 1), 0, ("out",), (None,)))
    a, b = pool.allocate(16), pool.allocate(16)
    fake.on_launch = lambda name, params: setattr(fake, "async_error", "CUDA_ERROR_ILLEGAL_ADDRESS")
    w.launch(k1, (a,))
    w.launch(k2, (b,))
    with pytest.raises(BackendError, match=r"one of the 2 commands submitted since the last completed work "
                                           r"\('first', 'second'\).*ZYX_DEBUG=launch"):
        pool.sync()


def test_sync_each_names_exactly_one_kernel(fake, make_worker):
    w = make_worker(queues=2, sync_each=True)
    pool = CudaPool(w)
    k1 = _kernel(w, KernelSpec("fine", (1, 1, 1), (1, 1, 1), 0, ("out",), (None,)))
    k2 = _kernel(w, KernelSpec("faulty", (1, 1, 1), (1, 1, 1), 0, ("out",), (None,)))
    a, b = pool.allocate(16), pool.allocate(16)
    fake.on_launch = lambda name, p: setattr(fake, "async_error", "CUDA_ERROR_ILLEGAL_ADDRESS") \
        if name == "faulty" else None
    w.launch(k1, (a,))
    w.launch(k2, (b,))
    with pytest.raises(BackendError, match=r"kernel 'faulty' failed asynchronously"):
        pool.sync()


def test_fire_and_forget_errors_surface_at_next_sync(fake, make_worker):
    w = make_worker()
    pool = CudaPool(w)
    w.launch(12345, (1, 2))
    with pytest.raises(BackendError, match="launch of unknown program 12345"):
        pool.sync()
    pool.sync()  # reported once


def test_worker_thread_crash_fails_pending_and_later_calls_never_hangs(fake, make_worker, monkeypatch):
    import signal

    def stalled(signum, frame):
        raise TimeoutError("a call blocked after the worker thread crashed")

    w = make_worker(queues=2, window=100, idle_flush_s=0.001)
    pool = CudaPool(w)
    bid = upload(pool, np.arange(4, dtype=np.float32))
    k, y = _kernel(w), pool.allocate(64)
    entered = threading.Event()

    def broken_idle():  # injected: a bug in the worker's own machinery (not a BackendError)
        entered.set()
        time.sleep(0.05)  # a call queued now is pending when the thread dies
        raise RuntimeError("injected crash")

    monkeypatch.setattr(w, "_w_idle", broken_idle)
    old = signal.signal(signal.SIGALRM, stalled)
    signal.alarm(20)
    try:
        w.launch(k, (bid, y, 4))  # pending, so the idle flush runs
        assert entered.wait(5)
        with pytest.raises(BackendError, match=r"cuda:0: the CUDA worker thread crashed \(RuntimeError\('injected"):
            pool.pool_to_host(bid, memoryview(np.empty(4, np.float32).view(np.uint8)))  # pending when it died
        with pytest.raises(BackendError, match="worker thread crashed"):
            pool.sync()  # a later call
        with pytest.raises(BackendError, match="worker thread crashed"):
            pool.allocate(16)
        w.free(bid)  # a later post is dropped, not queued forever
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_failed_download_waits_for_its_queued_copies_before_reusing_staging(fake, make_worker):
    w = make_worker(staging_block=64)
    pool = CudaPool(w)
    a = np.arange(64, dtype=np.float32)  # 256 bytes: four 64-byte chunks through two staging blocks
    bid = upload(pool, a)
    fake.calls.clear()
    fake.fail_once["event_synchronize"] = "CUDA_ERROR_INVALID_VALUE"  # landing chunk 0, with chunk 1 queued
    with pytest.raises(BackendError, match=f"reading buffer {bid} back failed"):
        pool.pool_to_host(bid, memoryview(np.empty_like(a).view(np.uint8)))
    names = [n for n, _ in fake.calls]
    failed = names.index("event_synchronize")
    assert names[:failed].count("memcpy_dtoh_async") == 2  # chunk 1 was in flight when landing chunk 0 failed
    assert "stream_synchronize" in names[failed:]  # waited for it before the staging blocks went back
    np.testing.assert_array_equal(download(pool, bid, a), a)  # and the worker still works


def test_reply_wait_gives_up_when_the_thread_is_gone():
    r = Reply()
    with pytest.raises(BackendError, match="died without answering"):
        r.wait(alive=lambda: False, poll_s=0.01)


# ---------------------------------------------------------------------------------------------------------------
# copies
# ---------------------------------------------------------------------------------------------------------------


def test_host_roundtrip_is_exact_through_pinned_staging(fake, make_worker):
    w = make_worker(queues=3, staging_block=64 << 10, staging_limit=256 << 10)
    pool = CudaPool(w)
    rng = np.random.default_rng(0)
    data = rng.standard_normal(300_000).astype(np.float32)  # 1.2 MB: chunked, drains when staging is full
    bid = upload(pool, data)
    np.testing.assert_array_equal(download(pool, bid, data), data)
    assert fake.count("memcpy_htod_async") == -(-data.nbytes // (256 << 10))  # uploads: blocks of the limit
    assert fake.count("memcpy_dtoh_async") == -(-data.nbytes // (64 << 10))  # read-backs: two alternating blocks
    assert w.call(lambda: w.staging.in_use) == 0
    assert max(a[0] for n, a in fake.calls if n == "host_alloc") <= 256 << 10
    small = upload(pool, np.array([1.5, 2.5], np.float32))
    np.testing.assert_array_equal(download(pool, small, np.empty(2, np.float32)), [1.5, 2.5])


def test_kernels_and_copies_compose_in_order(fake, make_worker):
    w = make_worker(queues=4)
    pool = CudaPool(w)
    k = _kernel(w)
    fake.on_launch = emulate_add_one
    x = upload(pool, np.arange(8, dtype=np.float32))
    y, z = pool.allocate(32), pool.allocate(32)
    w.launch(k, (x, y, 8))
    pool.pool_to_pool(pool, y, z)  # device-to-device copy joins the window after the launch
    w.launch(k, (z, y, 8))
    np.testing.assert_array_equal(download(pool, y, np.empty(8, np.float32)), np.arange(8) + 2)
    np.testing.assert_array_equal(download(pool, z, np.empty(8, np.float32)), np.arange(8) + 1)


def test_host_and_disk_sources_copy_exactly(fake, make_worker, tmp_path):
    pool = CudaPool(make_worker())
    host = HostPool()
    data = np.random.default_rng(1).integers(0, 255, 10_000, dtype=np.uint8)
    hb = host.allocate(data.nbytes)
    host.host_to_pool(memoryview(data), hb)
    d1 = pool.allocate(data.nbytes)
    pool.pool_to_pool(host, hb, d1)
    np.testing.assert_array_equal(download(pool, d1, data), data)
    path = tmp_path / "blob.bin"
    path.write_bytes(b"header__" + data.tobytes())
    disk = DiskPool()
    db = disk.buffer(str(path), 8, data.nbytes)
    d2 = pool.allocate(data.nbytes)
    pool.pool_to_pool(disk, db, d2)
    assert disk.bytes_read == data.nbytes
    np.testing.assert_array_equal(download(pool, d2, data), data)
    out = host.allocate(data.nbytes)  # and back to the host pool through the host pool's driver
    host.pool_to_pool(pool, d2, out)
    np.testing.assert_array_equal(host.view(out), data)


@pytest.mark.parametrize("peer", [True, False])
def test_copies_between_gpus(peer, make_worker):
    fake = FakeDriver(devices=2, peer=peer)
    p0, p1 = CudaPool(make_worker(drv=fake, ordinal=0)), CudaPool(make_worker(drv=fake, ordinal=1))
    data = np.arange(1000, dtype=np.int32)
    src = upload(p0, data)
    dst = p1.allocate(data.nbytes)
    p1.pool_to_pool(p0, src, dst)
    np.testing.assert_array_equal(download(p1, dst, data), data)
    assert fake.count("memcpy_peer_async") == (1 if peer else 0)
    assert fake.count("enable_peer_access") == (1 if peer else 0)
    assert p0._refs[src] == 1  # the retain for the copy was given back
    p1.pool_to_pool(p0, src, dst)
    assert fake.count("enable_peer_access") == (1 if peer else 0)  # enabled once


def test_launch_timed_drains_then_times_alone(fake, make_worker):
    w = make_worker(queues=2)
    pool = CudaPool(w)
    k = _kernel(w)
    x, y = pool.allocate(64), pool.allocate(64)
    w.launch(k, (x, y, 1))
    ns = w.launch_timed(k, (x, y, 1))
    assert ns == 1_500_000
    assert fake.count("launch_kernel") == 2
    names = [n for n, _ in fake.calls]
    last_launch = max(i for i, n in enumerate(names) if n == "launch_kernel")
    assert "stream_synchronize" in names[:last_launch]  # drained before the timed launch
    assert names[last_launch - 1] == "event_record" and names[last_launch + 1] == "event_record"


def test_release_program_unloads_after_its_work(fake, make_worker):
    w = make_worker(queues=2)
    pool = CudaPool(w)
    k = _kernel(w)
    x, y = pool.allocate(64), pool.allocate(64)
    fake.hold = True
    w.launch(k, (x, y, 1))
    w.release_program(k)
    barrier(w)
    assert fake.count("launch_kernel") == 1 and fake.count("module_unload") == 0
    fake.release_events()
    w.call(w._w_sweep)
    assert fake.count("module_unload") == 1


# ---------------------------------------------------------------------------------------------------------------
# the device: compile through NVRTC (no GPU needed), launch checks, schedule with cuDNN alternatives
# ---------------------------------------------------------------------------------------------------------------


def _nvrtc_ok() -> bool:
    try:
        from zyx.backends.cuda import nvrtc

        return nvrtc.available() is None
    except ImportError:
        return False


class FakePlan:
    kinds = ("in", "in", "out")

    def __init__(self, spec):
        self.spec, self.name, self.runs = spec, spec.name, []

    def run(self, worker, stream_index, pointers):
        self.runs.append((stream_index, pointers))


def _fake_registry(monkeypatch, tmp_path, config: dict):
    """The global registry with cuda:0 on a fake driver (cuDNN plans faked)."""
    from zyx.graph import schedule

    fake = FakeDriver()
    plans: list[FakePlan] = []

    def build(worker, spec):
        plans.append(FakePlan(spec))
        return plans[-1]

    monkeypatch.setattr(cudnn, "build_plan", build)
    monkeypatch.setattr(cudnn, "ensure_available", lambda drv=None: "")
    monkeypatch.setitem(reg.PROBES, "cuda", lambda cfg: backend.probe(cfg["cuda"], driver=fake))
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"default_device": "host", **config}))
    schedule.clear_cache()
    return reg.reset_registry(f), fake, plans


@pytest.fixture
def fake_cuda_registry(monkeypatch, tmp_path):
    from zyx.graph import schedule

    made = []

    def make(config: dict | None = None):
        made.append(_fake_registry(monkeypatch, tmp_path, config or {}))
        return made[-1]

    yield make
    for r, _, _ in made:
        r.get("cuda:0").pool.worker.close()
    schedule.clear_cache()
    reg.reset_registry()


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC not available")
def test_schedule_on_fake_gpu_uses_cudnn_and_nvrtc_cubins(fake_cuda_registry):
    r, fake, plans = fake_cuda_registry()
    assert r.report()["cuda"] == "ok: cuda:0"
    rng = np.random.default_rng(0)
    a = zyx.Tensor(rng.standard_normal((512, 256)).astype(np.float16), device="cuda")
    b = zyx.Tensor(rng.standard_normal((256, 128)).astype(np.float16), device="cuda")
    c = (a @ b).relu()
    launches = zyx.debug.schedule(c)
    kinds = [(x.kind, x.device, x.name) for x in launches]
    assert ("library", "cuda:0", "cudnn_matmul_f16_f32_NN_1x512x128x256") in kinds
    assert any(k == "generated" and d == "cuda:0" for k, d, _ in kinds)
    assert len(plans) == 1 and plans[0].spec.a_dims == (1, 512, 256)
    assert fake.count("module_load") >= 1  # NVRTC produced cubins that the worker loaded
    zyx.debug.reset_stats()
    zyx.realize(c)
    r.get("cuda:0").primary.sync()
    assert len(plans[0].runs) == 1  # the cuDNN plan ran on the worker, on the stream it chose
    assert zyx.debug.stats()["library_launches"] == 1


@pytest.mark.skipif(not _nvrtc_ok(), reason="NVRTC not available")
def test_cudnn_off_in_config_adds_no_alternative(fake_cuda_registry):
    r, fake, plans = fake_cuda_registry({"cuda": {"cudnn": False}})
    a = zyx.Tensor(np.ones((512, 512), np.float32), device="cuda")
    assert all(x.kind != "library" for x in zyx.debug.schedule(a @ a))
    assert plans == [] and r.get("cuda:0").primary._cudnn is None


def test_device_launch_checks_arguments(make_worker):
    pool = CudaPool(make_worker())
    dev = CudaDevice(pool, cudnn=False)
    with pytest.raises(BackendError, match="launch of unknown program 7"):
        dev.launch(7, [1])
    pid = pool.worker.load_module(b"cubin", ADD_ONE)
    dev.register_library(pid, "add_one", ADD_ONE.kinds)
    with pytest.raises(BackendError, match="kernel add_one takes 3 arguments, got 1"):
        dev.launch(pid, [1])


# ---------------------------------------------------------------------------------------------------------------
# cuDNN: graph descriptions (no GPU), specs, matching
# ---------------------------------------------------------------------------------------------------------------


def _matmuls(t: zyx.Tensor):
    order, _ = collect([t.cls])
    return Graph(order, [t.cls]).matmuls()


def _spec(a: np.ndarray, b: np.ndarray, fa=lambda x: x, fb=lambda x: x):
    (mm,) = _matmuls(fa(zyx.Tensor(a)) @ fb(zyx.Tensor(b)))
    return mm, cudnn.matmul_spec(mm, allow_tf32=True)  # float32 goes to cuDNN only as TF32


@pytest.mark.parametrize("dtype,name,io", [(np.float32, "f32", "FLOAT"), (np.float16, "f16", "HALF"),
                                           (ml_dtypes.bfloat16, "bf16", "BFLOAT16")])
def test_cudnn_description_for_each_dtype(dtype, name, io):
    cd = pytest.importorskip("cudnn")
    mm, spec = _spec(np.ones((64, 32), dtype), np.ones((32, 16), dtype))
    assert spec.in_dtype == mm.a.view.base.dtype.name
    assert spec.out_dtype == mm.acc_dtype.name == "float32"  # half inputs accumulate (and output) in float32
    assert spec.name == f"cudnn_matmul_{name}{'_tf32' if name == 'f32' else '_f32'}_NN_1x64x16x32"
    g, (A, B, C) = cudnn.describe(spec, cd)
    assert (A.get_dim(), A.get_stride()) == ([1, 64, 32], [2048, 32, 1])
    assert (B.get_dim(), B.get_stride()) == ([1, 32, 16], [512, 16, 1])
    assert (C.get_dim(), C.get_stride()) == ([1, 64, 16], [1024, 16, 1])
    assert A.get_data_type() == getattr(cd.data_type, io) == B.get_data_type()
    assert C.get_data_type() == cd.data_type.FLOAT and not C.get_is_virtual()
    info = g.inspect()
    assert info["context"]["compute_data_type"] == "data_type.FLOAT"
    assert [n["type"] for n in info["nodes"]] == ["MATMUL"]


def test_cudnn_description_batched_transposed_and_broadcast():
    cd = pytest.importorskip("cudnn")
    x = np.ones((4, 64, 32), np.float32)
    _, spec = _spec(x, np.ones((4, 32, 16), np.float32))
    assert spec.a_dims == (4, 64, 32) and spec.a_strides == (2048, 32, 1)
    assert spec.b_dims == (4, 32, 16) and spec.c_dims == (4, 64, 16) and spec.c_strides == (1024, 16, 1)
    _, spec = _spec(x, np.ones((16, 32), np.float32), fb=lambda t: t.T)  # B = b.T: column-major, shared
    assert spec.b_dims == (1, 32, 16) and spec.b_strides[1:] == (1, 32)
    assert spec.name.endswith("_NT_1x256x16x32")  # the batch of A merges into M (B is shared)
    a = np.ones((64, 4, 32), np.float32)  # batch axis not mergeable into M: a real batch, B broadcast over it
    _, spec = _spec(a, np.ones((32, 16), np.float32), fa=lambda t: t.permute(1, 0, 2))
    assert spec.a_dims == (4, 64, 32) and spec.a_strides == (32, 128, 1)
    assert spec.b_dims == (1, 32, 16) and spec.c_dims == (4, 64, 16) and spec.c_strides == (1024, 16, 1)
    _, spec = _spec(np.ones((32, 64), np.float32), np.ones((32, 16), np.float32), fa=lambda t: t.T)
    assert spec.a_dims == (1, 64, 32) and spec.a_strides[1:] == (1, 64)
    g, (A, B, C) = cudnn.describe(spec, cd)
    assert A.get_stride() == [64 * 32, 1, 64]
    _, spec = _spec(np.ones((2, 3, 8, 4), np.float32), np.ones((2, 3, 4, 5), np.float32))  # two batch axes
    assert spec.a_dims == (6, 8, 4) and spec.c_dims == (6, 8, 5)


def test_cudnn_spec_declines_what_it_cannot_run():
    mm, _ = _spec(np.ones((8, 4), np.float32), np.ones((4, 8), np.float32))
    spec = cudnn.matmul_spec(mm)  # allow_tf32 off: cuDNN's float32 engines would round products to TF32
    assert isinstance(spec, str) and "allow_tf32" in spec
    _, spec = _spec(np.ones((8, 4), np.float64), np.ones((4, 8), np.float64))
    assert isinstance(spec, str) and "float64" in spec
    _, spec = _spec(np.ones((8, 4), np.float32), np.ones((4, 8), np.float16))
    assert isinstance(spec, str) and "differ" in spec
    big = np.ones((8, 8), np.float32)
    _, spec = _spec(big, big, fa=lambda t: t[:, ::2][:, :4], fb=lambda t: t[:4])  # a strided column slice
    assert isinstance(spec, str) and "odd strides" in spec
    _, spec = _spec(big, big, fa=lambda t: t[1:5, 1:5], fb=lambda t: t[:4])  # offset of 9 floats
    assert isinstance(spec, str) and "aligned" in spec


class _Graph:
    def __init__(self, mms):
        self.mms, self.added = mms, []

    def matmuls(self):
        return self.mms

    def add_alternative(self, cls, kernel):
        self.added.append((cls, kernel))


def test_match_graph_offers_library_kernels_that_beat_generated_ones(make_worker, monkeypatch):
    monkeypatch.setattr(cudnn, "build_plan", lambda worker, spec: FakePlan(spec))
    pool = CudaPool(make_worker())
    dev = CudaDevice(pool, cudnn=True)
    mm, spec = _spec(np.ones((1024, 1024), np.float16), np.ones((1024, 1024), np.float16))
    mm.cls.device = "cuda:0"
    g = _Graph([mm])
    dev.match_graph(g, [mm.cls])
    (cls, kernel), = g.added
    assert cls is mm.cls and kernel.name == spec.name and kernel.layout == spec
    assert kernel.inputs == (mm.a.view.base, mm.b.view.base)
    generated_ns = 1024 ** 3 / dev.info().compute_units  # the extractor's cost of the generated reduce
    assert kernel.est_ns < generated_ns / 100
    assert kernel.est_ns == pytest.approx(spec.flops / (0.6 * 990e3) + cudnn.LAUNCH_OVERHEAD_NS)
    dev.match_graph(g, [mm.cls])  # cached: no second plan
    assert g.added[1][1].program == kernel.program
    pool.worker.launch(kernel.program, (upload(pool, np.ones(4, np.float16)),) * 2 + (pool.allocate(16),))
    pool.sync()
    plan = pool.worker.programs[kernel.program].program
    assert len(plan.runs) == 1


def test_match_graph_skips_other_devices_and_declined_plans(make_worker, monkeypatch):
    def declined(worker, spec):
        raise cudnn.CudnnUnsupported("no engine")

    monkeypatch.setattr(cudnn, "build_plan", declined)
    dev = CudaDevice(CudaPool(make_worker()), cudnn=True)
    mm, _ = _spec(np.ones((64, 64), np.float16), np.ones((64, 64), np.float16))
    g = _Graph([mm])
    dev.match_graph(g, [mm.cls])  # on "host": not ours
    mm.cls.device = "cuda:0"
    dev.match_graph(g, [mm.cls])
    assert g.added == []


def test_cudnn_unavailable_turns_matching_off(make_worker, monkeypatch):
    def unavailable(worker, spec):
        raise cudnn.CudnnUnavailable("cuDNN handle creation failed: no libcudnn")

    monkeypatch.setattr(cudnn, "build_plan", unavailable)
    dev = CudaDevice(CudaPool(make_worker()), cudnn=True)
    mm, _ = _spec(np.ones((64, 64), np.float16), np.ones((64, 64), np.float16))
    mm.cls.device = "cuda:0"
    dev.match_graph(_Graph([mm]), [mm.cls])
    assert dev._cudnn.disabled and "no libcudnn" in dev._cudnn.disabled


class _StubBindings:
    """cuda.bindings.driver with canned results per driver function (the enums stay real)."""

    def __init__(self) -> None:
        from cuda.bindings import driver as cu

        self._cu = cu
        self.results: dict[str, tuple] = {}
        self.args: dict[str, tuple] = {}

    def __getattr__(self, name: str):
        if name.startswith("cu") and name[2:3].isupper() and not name.startswith("cuGetError"):
            def call(*args):
                self.args[name] = args
                return self.results[name]
            return call
        return getattr(self._cu, name)


def test_driver_methods_map_results():
    pytest.importorskip("cuda.bindings")
    stub = _StubBindings()
    cu = stub._cu
    drv = driver.Driver(stub)
    stub.results["cuEventQuery"] = (cu.CUresult.CUDA_ERROR_NOT_READY,)
    assert drv.event_query(5) is False
    stub.results["cuEventQuery"] = (cu.CUresult.CUDA_SUCCESS,)
    assert drv.event_query(5) is True
    stub.results["cuEventQuery"] = (cu.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
    with pytest.raises(DriverError, match="cuEventQuery: CUDA_ERROR_ILLEGAL_ADDRESS") as e:
        drv.event_query(5)
    assert e.value.sticky
    stub.results["cuCtxEnablePeerAccess"] = (cu.CUresult.CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED,)
    drv.enable_peer_access(7)  # already enabled counts as success
    stub.results["cuCtxEnablePeerAccess"] = (cu.CUresult.CUDA_ERROR_INVALID_DEVICE,)
    with pytest.raises(DriverError, match="INVALID_DEVICE"):
        drv.enable_peer_access(7)
    stub.results["cuLaunchKernel"] = (cu.CUresult.CUDA_SUCCESS,)
    drv.launch_kernel(11, (2, 1, 1), (128, 1, 1), 0, 13, 0xABC)
    assert stub.args["cuLaunchKernel"] == (11, 2, 1, 1, 128, 1, 1, 0, 13, 0xABC, 0)  # extra must be the int 0
    stub.results["cuDeviceGetName"] = (cu.CUresult.CUDA_SUCCESS, b"NVIDIA H200\0\0\0")
    assert drv.device_name(0) == "NVIDIA H200"
    stub.results["cuMemGetInfo"] = (cu.CUresult.CUDA_SUCCESS, 10, 20)
    assert drv.mem_get_info() == (10, 20)
    stub.results["cuStreamCreate"] = (cu.CUresult.CUDA_SUCCESS, cu.CUstream(77))
    assert drv.stream_create() == 77
    assert stub.args["cuStreamCreate"] == (int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING),)
    stub.results["cuEventCreate"] = (cu.CUresult.CUDA_SUCCESS, cu.CUevent(3))
    drv.event_create(timing=False)
    assert stub.args["cuEventCreate"] == (int(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING),)
    stub.results["cuMemPoolSetAttribute"] = (cu.CUresult.CUDA_SUCCESS,)
    drv.mem_pool_set_release_threshold(1, (1 << 64) - 1)
    assert int(stub.args["cuMemPoolSetAttribute"][2]) == (1 << 64) - 1


# ---------------------------------------------------------------------------------------------------------------
# stream placement across windows: the least-used streams preferred
# ---------------------------------------------------------------------------------------------------------------


def test_place_window_updates_the_state_in_place_like_assign_streams():
    from zyx.backends.cuda.placement import place_window
    from zyx.backends.cuda.streams import Command as C
    from zyx.backends.cuda.streams import StreamState, assign_streams

    window = [C((), (1,)), C((), (2,)), C((1, 2), (3,)), C((3,), ())]
    want, want_state = assign_streams(window, StreamState(), 3)
    state = StreamState()
    got, same = place_window(window, state, 3)
    assert same is state and state == want_state and got == want  # a fresh state: the tie order is the index


def test_single_command_windows_spread_over_streams():
    from zyx.backends.cuda.placement import place_window
    from zyx.backends.cuda.streams import Command as C
    from zyx.backends.cuda.streams import StreamState

    state = StreamState()
    streams = []
    for b in range(8):  # independent uploads, each its own window (what an idle flush produces)
        (pl,), state = place_window([C((), (b,))], state, 4)
        streams.append(pl.stream)
    assert streams == [0, 1, 2, 3, 0, 1, 2, 3]
    (pl,), state = place_window([C((5,), (9,))], state, 4)
    assert pl.stream == 1  # a consumer still follows the writer of its first input


@settings(max_examples=300, deadline=None)
@given(windowed_programs())
def test_property_place_window_keeps_every_hazard_ordered(case):
    from zyx.backends.cuda.placement import place_window
    from zyx.backends.cuda.streams import StreamState

    windows, n_streams = case
    state, commands, placements = StreamState(), [], []
    for window in windows:
        placed, state = place_window(window, state, n_streams)
        commands += window
        placements += placed
    assert violations(commands, placements, n_streams) == []
    assert vacuous_waits(placements) == []


def test_cudnn_libraries_are_loaded_explicitly_or_named_when_missing(monkeypatch):
    pytest.importorskip("cuda.pathfinder")
    import cuda.pathfinder as pathfinder

    loaded = []

    def found(name):
        loaded.append(name)

    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", found)
    driver.preload_cudnn_libraries()
    assert loaded == list(driver.CUDNN_LIBRARIES)

    def missing(name):
        if name == "cudnn":
            raise RuntimeError('Failure finding "libcublasLt.so.13": No such file')

    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", missing)
    with pytest.raises(ImportError, match=r"libcudnn cannot be loaded .*libcublasLt.*pip install 'zyx\[cuda\]'"):
        driver.preload_cudnn_libraries()
    drv = driver.Driver(_StubBindings())
    with pytest.raises(ImportError, match="libcudnn cannot be loaded"):
        drv.cudnn_frontend()  # the real bindings: the frontend is imported only after its libraries loaded

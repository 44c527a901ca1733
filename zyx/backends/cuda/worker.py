"""One worker thread per GPU: it owns the primary context and makes every driver call for that GPU.

The pool and device API (any thread) talks to the worker through a command queue: ``post`` for fire-and-forget
commands (launches, device copies, frees), ``call`` for commands that reply (allocate, host copies, read-back,
compile, timed launch, sync). Invariants:

- Threads: only the worker thread calls the driver for its GPU; it made the device's primary context current
  first (``cuDevicePrimaryCtxRetain`` + ``cuCtxSetCurrent``). A ``call`` from the worker thread itself runs inline.
- Window: launches and copies join a pending window that is submitted when it holds ``window`` commands, at a sync
  point (read-back, timed launch, export for a peer copy, ``sync``, program release) or, when enabled, after the
  queue stayed empty for ``idle_flush_s``. Submission places the window on ``queues`` streams with
  ``streams.assign_streams`` (streams relabelled least-used first, see ``place_window``); the ``StreamState``
  persists across windows. A wait on stream ``t`` becomes ``cuEventRecord`` on ``t`` + ``cuStreamWaitEvent`` on the
  consumer, with ``CU_EVENT_DISABLE_TIMING`` events taken from a free list and returned to it once the window
  completed.
- Graphs: ``replay(key, launches)`` (a cached schedule) runs one by one the first time, is captured as a CUDA graph
  the second time its structure (programs, which arguments are the same buffer) repeats, and is then one window
  command: a graph launch reading the buffers the batch reads before writing and writing all it writes, so it is
  placed and ordered like any command. Node arguments are updated in place only where they changed, right before
  each graph launch is submitted (the driver copies them at the call, for later launches only; the window may hold
  several launches of one graph). A batch holding a library program runs one by one. Releasing a program drops the
  graphs that use it.
- Poison: a buffer stays poisoned until a copy overwrites all of it (an upload or a device copy of a valid
  buffer); later kernels writing it do not clear it, since a kernel may write only part of a buffer.
- Lifetimes: every window records one completion event per stream it used and keeps what its commands point to
  (packed kernel arguments, pinned staging blocks) until those events completed. A buffer whose count reached zero
  is freed only after all the work submitted on every stream that used it completed (``_when_done``: at once when no
  window not yet seen complete ran there, with the newest window when it ran on all of them, else behind barrier
  events); a buffer still named by the unsubmitted window is buried right after that window is submitted.
  Finished windows and dead buffers are swept on every loop iteration (at most every ``poll_s``) and after every
  drain; a drain (sync) waits only for the streams that may still run work.
- Memory: the stream-ordered allocator on the device's default pool, release threshold raised so freed memory stays
  cached (``cuMemAllocAsync``/``cuMemFreeAsync`` on a stream that gets no other work; a stream waits once for an
  event covering every allocation made before it, ``_wait_allocated``); without memory pools a size-keyed cache
  over ``cuMemAlloc``. Out of memory: drain, free what is dead, trim the caches, retry once, then
  ``BackendError(ALLOCATION, "out of memory on cuda:N: asked X GiB, Y GiB free")``.
- Errors: a command that fails at submission poisons the buffers it writes and is reported at the next sync point.
  An asynchronous error (an event query or synchronize failing) names the launches of every window not yet seen
  complete (windows seen complete cannot hold the fault) and poisons what they wrote; sticky errors make the
  worker refuse further work. Reading a poisoned buffer raises instead of returning garbage. A launch reading a
  poisoned buffer is skipped and poisons its outputs.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from zyx.backends.base import BackendError, ErrorStatus
from zyx.backends.cuda import graphs as capture
from zyx.backends.cuda.args import ArgPack, KernelSpec, LibraryProgram, _Kernel, _Library
from zyx.backends.cuda.driver import DEVICE_ATTRIBUTES, OUT_OF_MEMORY, Driver, DriverError
from zyx.backends.cuda.graphs import GraphRecord
from zyx.backends.cuda.memory import (
    CachingAllocator,
    Staging,
    StagingPool,
    StreamOrderedAllocator,
    alloc_size,
    human_bytes,
)
from zyx.backends.cuda.placement import place_window
from zyx.backends.cuda.streams import StreamState
from zyx.utils import debug_on, log

DEFAULT_SHARED_BYTES = 48 << 10  # dynamic shared memory a kernel may use without opting in
GRAPH_CACHE = 256  # captured graphs kept per GPU (least recently replayed destroyed first)


# ---------------------------------------------------------------------------------------------------------------
# replies


class Reply:
    """The answer to one ``call``: set once by the worker, waited for by the caller."""

    __slots__ = ("_lock", "_value", "_error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any) -> None:
        self._value = value
        self._lock.release()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._lock.release()

    def wait(self, alive: Callable[[], bool] | None = None, poll_s: float = 1.0) -> Any:
        """The value, or the error raised. With ``alive``, a worker thread that died without answering is an
        error too (checked every ``poll_s`` seconds), never an endless wait."""
        while not self._lock.acquire(timeout=poll_s if alive is not None else -1):
            if not alive():
                raise BackendError(ErrorStatus.SYNC, "the CUDA worker thread died without answering")
        if self._error is not None:
            raise self._error
        return self._value


# ---------------------------------------------------------------------------------------------------------------
# the worker's tables


@dataclass
class DeviceBuffer:
    ptr: int
    nbytes: int  # as asked
    size: int  # as reserved
    streams: set[int] = field(default_factory=set)  # every stream that ran a command using it
    pending: int = 0  # uses by commands of the unsubmitted window
    poison: str | None = None  # why its contents are invalid
    ready: int | None = None  # its stream-ordered allocation's number (``Worker._alloc_epoch``): its first user's
    # stream waits for the allocations up to it first (``_first_use``); None once waited for, or when not stream-ordered


@dataclass
class Pending:
    """One command of the unsubmitted window: what it reads and writes (buffer ids) and how to submit it."""

    kind: str  # "launch", "graph", "h2d", "d2d", "peer"
    name: str
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    payload: Any = None


@dataclass
class Window:
    """A submitted window: its completion event per stream and everything that must live until they complete."""

    seq: int
    names: list[str] = field(default_factory=list)
    writes: set[int] = field(default_factory=set)
    streams: set[int] = field(default_factory=set)  # stream indices its commands were submitted to
    done: dict[int, int] = field(default_factory=dict)  # stream index -> completion event
    deps: list[int] = field(default_factory=list)  # dependency events, back to the free list on completion
    keep: list[Any] = field(default_factory=list)  # arg packs (reused) and anything else the GPU reads
    staging: list[Staging] = field(default_factory=list)
    retired: bool = False  # seen complete


@dataclass
class _Dead:
    """Something freed once every (stream, event) barrier completed, or once window ``after`` was seen complete
    (its completion events follow every use): then ``action`` runs."""

    barriers: list[tuple[int, int]]
    action: Callable[[], None]
    nbytes: int = 0
    after: Window | None = None


@dataclass(frozen=True)
class WorkerConfig:
    queues: int = 12  # streams the windows are spread over
    window: int = 100  # commands per submitted window
    staging_block: int = 32 << 20  # pinned block size of read-backs (two, alternating, so copies overlap)
    staging_limit: int = 256 << 20  # pinned bytes in flight before a host copy waits for the GPU; an upload
    # copies into one block of up to this size (one memcpy blocks the caller; larger uploads are chunked to it)
    idle_flush_s: float | None = 0.0005  # submit a partial window when no command came for this long (None: never)
    poll_s: float = 0.001  # how often finished windows and dead buffers are swept while work is in flight
    sync_each: bool = False  # drain after every command: an asynchronous error then names exactly one kernel
    # mutation switches, for tests that prove the emulator catches broken ordering (never set them otherwise):
    # "raw" / "war" drop read-after-write / write-after-read waits, "free" frees dead buffers at once instead of
    # behind barrier events
    unsafe: frozenset[str] = frozenset()
    graphs: bool = True  # a batch of kernels seen twice with the same structure replays as one CUDA graph


_STOP = object()


class Worker:
    """The thread owning one GPU. Public methods may be called from any thread; ``_w_*`` run on the worker."""

    def __init__(self, drv: Driver, ordinal: int, config: WorkerConfig | None = None) -> None:
        self.drv = drv
        self.ordinal = ordinal
        self.name = f"cuda:{ordinal}"
        self.config = config or WorkerConfig()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # orders posts against close (nothing is queued after the stop command); reentrant because a garbage
        # collection inside a post may free a Buffer, whose release posts again
        self._gate = threading.RLock()
        self._closed = False
        # worker-thread state (touched only by the worker thread after start)
        self.buffers: dict[int, DeviceBuffer] = {}
        self.programs: dict[int, _Kernel | _Library] = {}
        self.pending: list[Pending] = []
        self.inflight: list[Window] = []
        self.dead: list[_Dead] = []
        self.doomed: list[int] = []
        self.free_events: list[int] = []
        self.arg_packs: dict[int, list[ArgPack]] = {}
        self.state = StreamState()
        self.streams: list[int] = []
        self.error: BackendError | None = None  # first error since the last sync point
        self.crashed: BackendError | None = None  # the worker thread failed outside any call: it is gone
        self.fatal: BackendError | None = None  # set by a sticky error: the context is unusable
        self.trace: list[tuple[int, list[tuple[str, int, tuple[int, ...]]]]] | None = None
        self.library_state: dict[str, Any] = {}  # per-worker state of library code (cuDNN handles)
        self.graphs: dict[Any, GraphRecord] = {}  # batch key -> its captured graph
        self._batch_seen: dict[Any, tuple] = {}  # batch key -> the signature it had when last launched
        self.workspaces: dict[int, tuple[int, int]] = {}  # stream index -> (ptr, size)
        self.held = 0  # bytes reserved for live and dead buffers and workspaces
        self.base_free = 0
        self._ids = itertools.count(1)  # buffer and program ids (``next`` is atomic: any thread may draw one)
        self._posted_lock = threading.Lock()
        self._posted_bytes = 0  # bytes of posted allocations the worker thread has not made yet
        self._seq = itertools.count(1)
        self._next_sweep = 0.0
        self._timing: tuple[int, int] | None = None
        self._alloc_epoch = 0  # stream-ordered allocations made so far
        self._alloc_mark: tuple[int, int | None] = (0, None)  # (allocations it covers, event on the allocation stream)
        self._stream_epochs: list[int] = []  # per stream: the allocations it already waited for
        # filled by _w_init
        self.device = 0
        self.context = 0
        self.device_name = ""
        self.attrs: dict[str, int] = {}
        self.total_memory = 0
        ready = Reply()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=f"zyx-{self.name}", daemon=True)
        self._thread.start()
        ready.wait()

    # ---- messaging ---------------------------------------------------------------------------------------------
    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the worker thread, fire and forget (errors surface at the next sync point).
        After ``close`` it does nothing (frees arriving at interpreter exit)."""
        item = (fn, args, None)
        with self._gate:
            if not self._closed:
                self._queue.put(item)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the worker thread and return its result (or raise its error)."""
        if threading.get_ident() == self._thread.ident:
            return fn(*args)
        reply = Reply()
        item = (fn, args, reply)
        with self._gate:
            closed = self._closed
            if not closed:
                self._queue.put(item)
        if closed:
            raise self.crashed or BackendError(ErrorStatus.INITIALIZATION,
                                               f"{self.name}: the CUDA worker was shut down")
        return reply.wait(self._thread.is_alive)

    def close(self, timeout: float = 10.0) -> None:
        """Drain the GPU and stop the thread (errors are dropped); later calls raise, later posts are dropped."""
        item = (_STOP, (), None)
        with self._gate:
            if self._closed:
                return
            self._closed = True
            self._queue.put(item)
        if threading.get_ident() != self._thread.ident:
            self._thread.join(timeout)

    # ---- public API (any thread) -------------------------------------------------------------------------------
    def free_bytes(self) -> int:
        """Device memory free at start, less what this worker holds (cached allocator memory counts as free)."""
        return max(self.base_free - self.held, 0)

    def allocate(self, nbytes: int) -> int:
        """A new buffer's id. While the request and the allocations still queued fit in half of the memory this
        worker has not taken (``free_bytes``), the allocation is posted and the id returned at once: the queue
        runs it before any use of the id, and the caller does not wait for the worker thread (a round trip was
        most of a small op's host time). Nearer the limit it runs synchronously, so running out of memory raises
        here, after the allocator's cached memory was released; a posted allocation that still fails (another
        process took the memory) raises at the next sync point, and every use of its id fails."""
        size = alloc_size(nbytes)
        with self._posted_lock:
            posted = self._posted_bytes + size
            if self.fatal is None and not self._closed and 2 * posted <= self.free_bytes():
                self._posted_bytes = posted
                bid = next(self._ids)
            else:
                bid = None
        if bid is None:
            return self.call(self._w_allocate, nbytes)
        self.post(self._w_allocate, nbytes, bid)
        return bid

    def free(self, buffer: int) -> None:
        self.post(self._w_free, buffer)

    def upload(self, address: int, nbytes: int, buffer: int) -> None:
        """Copy ``nbytes`` at host ``address`` into ``buffer``; the host memory may be reused when this returns."""
        if nbytes:
            self.call(self._w_upload, address, nbytes, buffer)

    def pin(self, nbytes: int) -> int:
        """Pinned host memory the caller owns: an upload from inside it is queued with no staging copy."""
        return self.call(self._w_pin, nbytes)

    def unpin(self, address: int) -> None:
        """Free memory from ``pin`` once every copy queued from it is done."""
        self.post(self._w_unpin, address)

    def download(self, buffer: int, address: int, nbytes: int) -> None:
        """Copy the first ``nbytes`` of ``buffer`` to host ``address``; a sync point."""
        self.call(self._w_download, buffer, address, nbytes)

    def copy(self, src: int, dst: int, nbytes: int) -> None:
        """Device-to-device copy within this GPU (joins the window)."""
        self.post(self._w_copy, src, dst, nbytes)

    def can_access_peer(self, other: Worker) -> bool:
        """Whether this GPU can read ``other``'s memory directly; enables peer access on first success."""
        return self.call(self._w_can_peer, other.device, other.context)

    def export(self, buffer: int) -> tuple[int, int, list[int]]:
        """(device pointer, context, barrier events) of ``buffer`` for a peer copy; a sync point."""
        return self.call(self._w_export, buffer)

    def copy_from_peer(self, exported: tuple[int, int, list[int]], dst: int, nbytes: int) -> None:
        """Copy from another GPU's exported buffer into ``dst``; returns when the copy completed."""
        self.call(self._w_copy_peer, exported, dst, nbytes)

    def recycle_events(self, events: list[int]) -> None:
        self.post(self.free_events.extend, list(events))

    def load_module(self, cubin: bytes, spec: KernelSpec) -> int:
        return self.call(self._w_load_module, cubin, spec)

    def register_library(self, program: LibraryProgram) -> int:
        return self.call(self._w_register, _Library(program))

    def launch(self, program: int, args: Sequence[int | float]) -> None:
        self.post(self._w_launch, program, tuple(args))

    def launch_timed(self, program: int, args: Sequence[int | float]) -> int:
        return self.call(self._w_launch_timed, program, tuple(args))

    def replay(self, key: Any, launches: Sequence[tuple[int, Sequence[int | float]]]) -> None:
        """Launch a batch of kernels that may recur under ``key`` (a cached schedule): the second time it comes with
        the same structure it is captured as a CUDA graph, and from then on it is one graph launch with its
        kernel arguments updated in place. Ordered like the same launches one by one."""
        self.post(self._w_batch, key, [(pid, tuple(args)) for pid, args in launches])

    def release_program(self, program: int) -> None:
        self.post(self._w_release_program, program)

    def sync(self) -> None:
        self.call(self._w_sync)

    def memory_info(self) -> dict[str, int]:
        return self.call(self._w_memory_info)

    # ---- the loop ----------------------------------------------------------------------------------------------
    def _run(self, ready: Reply) -> None:
        try:
            self._w_init()
        except BaseException as e:  # noqa: BLE001 - handed to the thread that started us
            ready.fail(e if isinstance(e, BackendError) else BackendError(
                ErrorStatus.INITIALIZATION, f"{self.name}: worker start failed: {e!r}"))
            return
        ready.set(None)
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - a bug in the worker's own machinery: fail everything, loudly
            self._crash(e)

    def _crash(self, e: BaseException) -> None:
        """Close the worker after an exception outside any call: every queued and later call raises."""
        err = BackendError(ErrorStatus.SYNC, f"{self.name}: the CUDA worker thread crashed ({e!r}); work queued "
                                             "on this GPU is lost and it takes no more work until zyx restarts")
        with self._gate:
            self.crashed = err
            self._closed = True
        log("dev", err.context)
        while True:
            try:
                _fn, _args, reply = self._queue.get_nowait()
            except queue.Empty:
                return
            if reply is not None:
                reply.fail(err)

    def _loop(self) -> None:
        q = self._queue
        cfg = self.config
        while True:
            if self.pending and cfg.idle_flush_s is not None:
                timeout: float | None = cfg.idle_flush_s
            elif self.inflight or self.dead:
                timeout = cfg.poll_s
            else:
                timeout = None
            try:
                fn, args, reply = q.get(timeout=timeout) if timeout is not None else q.get()
            except queue.Empty:
                self._guard(self._w_idle)
                continue
            if fn is _STOP:
                self._guard(self._w_drain)
                return
            try:
                value = fn(*args)
            except BaseException as e:  # noqa: BLE001 - delivered to the caller or kept for the next sync point
                if reply is not None:
                    reply.fail(e)
                else:
                    self._note(e if isinstance(e, BackendError) else BackendError(
                        ErrorStatus.LAUNCH, f"{self.name}: {getattr(fn, '__name__', fn)} failed: {e!r}"))
            else:
                if reply is not None:
                    reply.set(value)
            if (self.inflight or self.dead) and time.monotonic() >= self._next_sweep:
                self._guard(self._w_sweep)

    def _guard(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BackendError as e:
            self._note(e)

    def _note(self, e: BackendError) -> None:
        if self.error is None:
            self.error = e
        log("launch", f"{self.name}: {e.context}")

    def _w_idle(self) -> None:
        if self.pending and self.config.idle_flush_s is not None:
            self._w_flush()
        self._w_sweep()

    # ---- start -------------------------------------------------------------------------------------------------
    def _w_init(self) -> None:
        drv = self.drv
        self.device = drv.device(self.ordinal)
        self.context = drv.primary_context(self.device)
        drv.set_current(self.context)
        self.device_name = drv.device_name(self.device)
        for name in DEVICE_ATTRIBUTES:
            try:
                self.attrs[name] = drv.device_attribute(self.device, name)
            except (BackendError, AttributeError):
                self.attrs[name] = 0
        self.total_memory = drv.total_memory(self.device)
        self.streams = [drv.stream_create() for _ in range(self.config.queues)]
        self._stream_epochs = [0] * len(self.streams)
        alloc_stream = drv.stream_create()
        if self.attrs.get("MEMORY_POOLS_SUPPORTED"):
            self.allocator: StreamOrderedAllocator | CachingAllocator = StreamOrderedAllocator(
                drv, self.device, alloc_stream)
        else:
            self.allocator = CachingAllocator(drv)
        self.staging = StagingPool(drv, self.config.staging_block, self.config.staging_limit)
        self.pinned: dict[int, int] = {}  # caller-owned pinned host memory (``pin``): address -> bytes
        self.base_free = drv.mem_get_info()[0]
        log("dev", f"{self.name}: {self.device_name}, sm_{self.attrs['COMPUTE_CAPABILITY_MAJOR']}"
                   f"{self.attrs['COMPUTE_CAPABILITY_MINOR']}, {human_bytes(self.total_memory)}, "
                   f"{len(self.streams)} streams, {self.allocator.kind} allocator")

    # ---- events ------------------------------------------------------------------------------------------------
    def _event(self) -> int:
        return self.free_events.pop() if self.free_events else self.drv.event_create(timing=False)

    def _barriers(self, streams: set[int]) -> list[tuple[int, int]]:
        out = []
        for s in sorted(streams):
            ev = self._event()
            self.drv.event_record(ev, self.streams[s])
            out.append((s, ev))
        return out

    # ---- memory ------------------------------------------------------------------------------------------------
    def _usable(self) -> None:
        if self.fatal is not None:
            raise BackendError(self.fatal.status, f"{self.name} is unusable after an earlier error: "
                               f"{self.fatal.context}")

    def _raise_pending(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise e
        self._usable()

    def _live(self, buffer: int) -> DeviceBuffer:
        buf = self.buffers.get(buffer)
        if buf is None:
            raise BackendError(ErrorStatus.LAUNCH, f"{self.name}: buffer {buffer} is not a live buffer of this "
                               "pool (freed, or from another device)")
        return buf

    def _alloc_raw(self, size: int, may_drain: bool = True) -> int:
        try:
            ptr = self.allocator.alloc(size)
        except DriverError as e:
            if e.name != OUT_OF_MEMORY:
                raise
            log("memory", f"{self.name}: out of memory for {human_bytes(size)}: releasing cached memory, retrying")
            if may_drain:
                self._w_drain()
            self.allocator.release_cached()
            self.staging.trim()
            try:
                ptr = self.allocator.alloc(size)
            except DriverError as e2:
                if e2.name != OUT_OF_MEMORY:
                    raise
                free, total = self.drv.mem_get_info()
                raise BackendError(ErrorStatus.ALLOCATION, f"out of memory on {self.name}: asked {human_bytes(size)}"
                                   f", {human_bytes(free)} free of {human_bytes(total)}; free tensors you no longer "
                                   "need (del t) or use smaller sizes") from None
        self.held += size
        return ptr

    def _allocated(self) -> int | None:
        """The number of the stream-ordered allocation just made (None when allocations are complete at once)."""
        if self.allocator.stream is None:
            return None
        self._alloc_epoch += 1
        return self._alloc_epoch

    def _wait_allocated(self, epoch: int | None, si: int) -> None:
        """Order stream ``si`` after the stream-ordered allocations numbered up to ``epoch``. One event recorded on
        the allocation stream covers every allocation made before it, and a stream that waited for it needs no
        other wait for those: a window of new buffers costs one record and a wait per stream, not two calls per
        buffer. A wait binds the event's record at the time of the call, so a replaced event is free for reuse."""
        if epoch is None or self._stream_epochs[si] >= epoch:
            return
        covered, ev = self._alloc_mark
        if covered < epoch:
            if ev is not None:
                self.free_events.append(ev)
            ev = self._event()
            self.drv.event_record(ev, self.allocator.stream)
            covered = self._alloc_epoch
            self._alloc_mark = (covered, ev)
        self.drv.stream_wait_event(self.streams[si], ev)
        self._stream_epochs[si] = covered

    def _first_use(self, buf: DeviceBuffer, si: int) -> None:
        epoch, buf.ready = buf.ready, None
        self._wait_allocated(epoch, si)

    def _w_allocate(self, nbytes: int, bid: int | None = None) -> int:
        """Allocate buffer ``bid`` (a posted allocation, counted in ``_posted_bytes`` until here) or a new id."""
        size = alloc_size(nbytes)
        if bid is not None:
            with self._posted_lock:
                self._posted_bytes -= size
        self._usable()
        ptr = self._alloc_raw(size)
        bid = next(self._ids) if bid is None else bid
        self.buffers[bid] = DeviceBuffer(ptr, nbytes, size, ready=self._allocated())
        if debug_on("memory"):
            log("memory", f"{self.name}: allocate #{bid} {nbytes} B at {ptr:#x}")
        return bid

    def _w_free(self, buffer: int) -> None:
        buf = self.buffers.get(buffer)
        if buf is None:
            return
        if buf.pending:
            self.doomed.append(buffer)  # named by the unsubmitted window: buried right after it is submitted
            return
        self._bury(buffer)

    def _bury(self, buffer: int) -> None:
        buf = self.buffers.pop(buffer)
        st = self.state
        st.last_writer.pop(buffer, None)
        st.readers_since_write.pop(buffer, None)
        st.last_write_at.pop(buffer, None)
        for s in buf.streams:
            st.last_read_at.pop((buffer, s), None)
        if self.fatal is not None:
            return  # the context is gone: nothing can be freed safely any more

        def free() -> None:
            self.allocator.free(buf.ptr, buf.size)
            self.held -= buf.size
            if debug_on("memory"):
                log("memory", f"{self.name}: freed #{buffer} {buf.nbytes} B")

        if "free" in self.config.unsafe:
            free()
            return
        self._when_done(buf.streams, free, buf.size)

    def _when_done(self, streams: set[int], action: Callable[[], None], nbytes: int = 0) -> None:
        """Run ``action`` once all the work submitted so far on ``streams`` completed: now when no window not yet
        seen complete ran there (commands outside windows complete within their call: all that work is done);
        when the newest window completes if it ran on every one of them (its completion events follow all the work
        submitted there); else behind new barrier events. The first two cost no driver call: a buffer freed after
        a sync, or while the window that last used it is in flight, needs no event of its own."""
        inflight = self.inflight
        if not streams or not any(not streams.isdisjoint(w.streams) for w in inflight):
            action()
        elif streams <= inflight[-1].streams:
            self.dead.append(_Dead([], action, nbytes, after=inflight[-1]))
        else:
            self.dead.append(_Dead(self._barriers(streams), action, nbytes))

    def workspace(self, stream_index: int, nbytes: int) -> int:
        """(worker thread) A device scratch area of at least ``nbytes`` private to one stream (library calls)."""
        if nbytes <= 0:
            return 0
        cur = self.workspaces.get(stream_index)
        if cur is not None and cur[1] >= nbytes:
            return cur[0]
        if cur is not None:
            old_ptr, old_size = cur

            def free() -> None:
                self.allocator.free(old_ptr, old_size)
                self.held -= old_size

            self._when_done({stream_index}, free, old_size)
            del self.workspaces[stream_index]
        size = alloc_size(max(nbytes, 1 << 20))
        ptr = self._alloc_raw(size, may_drain=False)
        self._wait_allocated(self._allocated(), stream_index)
        self.workspaces[stream_index] = (ptr, size)
        return ptr

    def stream(self, stream_index: int) -> int:
        """(worker thread) The driver handle of stream ``stream_index``."""
        return self.streams[stream_index]

    # ---- commands joining the window ---------------------------------------------------------------------------
    def _enqueue(self, p: Pending) -> None:
        buffers = self.buffers
        used = p.reads + p.writes
        for b in used:
            if b not in buffers:
                self._live(b)  # raises, naming the buffer
        for b in used:
            buffers[b].pending += 1
        self.pending.append(p)
        if self.config.sync_each:
            self._w_drain()
        elif len(self.pending) >= self.config.window:
            self._w_flush()

    def _w_launch(self, program: int, args: tuple) -> None:
        prog = self.programs.get(program)
        if prog is None:
            raise BackendError(ErrorStatus.LAUNCH, f"{self.name}: launch of unknown program {program}")
        kinds = prog.kinds
        if len(args) != len(kinds):
            raise BackendError(ErrorStatus.LAUNCH, f"kernel {prog.name} takes {len(kinds)} arguments, got {len(args)}")
        reads = tuple(args[i] for i in prog.ins)
        writes = tuple(args[i] for i in prog.outs)
        self._enqueue(Pending("launch", prog.name, reads, writes, (prog, args)))

    def _w_copy(self, src: int, dst: int, nbytes: int) -> None:
        self._enqueue(Pending("d2d", f"copy {self.name}->{self.name} ({human_bytes(nbytes)})", (src,), (dst,),
                              nbytes))

    def _w_pin(self, nbytes: int) -> int:
        ptr = self.drv.host_alloc(max(nbytes, 1))
        self.pinned[ptr] = max(nbytes, 1)
        return ptr

    def _w_unpin(self, address: int) -> None:
        if self.pinned.pop(address, None) is not None:
            if self.fatal is None:
                self._w_drain()  # copies queued from it finish first
            self.drv.host_free(address)

    def _pinned_region(self, address: int, n: int) -> bool:
        return any(start <= address and address + n <= start + size for start, size in self.pinned.items())

    def _w_upload(self, address: int, nbytes: int, buffer: int) -> None:
        self._usable()
        buf = self._live(buffer)
        n = min(nbytes, buf.nbytes)
        name = f"copy host->{self.name} ({human_bytes(n)})"
        if self._pinned_region(address, n):  # the caller's pinned memory: copied from where it is
            self._enqueue(Pending("h2d", name, (), (buffer,), ([(0, Staging(address, n, borrowed=True), n)],
                                                               n == buf.nbytes)))
            return
        segments: list[tuple[int, Staging, int]] = []
        full = True
        off = 0
        while off < n:
            size = min(n - off, self.config.staging_limit)
            if self.staging.in_use + size > self.config.staging_limit and self.staging.in_use:
                if segments:  # hand what is staged to the GPU, then wait for pinned memory to come back
                    self._enqueue(Pending("h2d", name, (), (buffer,), (segments, False)))
                    segments, full = [], False
                self._w_drain()
            blk = self.staging.acquire(size)
            ctypes.memmove(blk.ptr, address + off, size)
            segments.append((off, blk, size))
            off += size
        if segments:
            self._enqueue(Pending("h2d", name, (), (buffer,), (segments, full and n == buf.nbytes)))

    # ---- graphs ------------------------------------------------------------------------------------------------
    def _w_batch(self, key: Any, launches: list[tuple[int, tuple]]) -> None:
        progs = [self.programs.get(pid) for pid, _ in launches]
        if (not self.config.graphs or self.config.sync_each or self.fatal is not None or len(launches) < 2
                or not all(isinstance(p, _Kernel) and len(a) == len(p.kinds) for p, (_, a) in zip(progs, launches))):
            for pid, args in launches:
                self._w_launch(pid, args)
            return
        sig = capture.signature(launches, progs)
        rec = self.graphs.get(key)
        if rec is not None and rec.signature != sig:
            self._forget_graph(key)
            rec = None
        if rec is None:
            if self._batch_seen.get(key) != sig:  # first sighting of this structure: one by one
                self._batch_seen[key] = sig
                if len(self._batch_seen) > 4 * GRAPH_CACHE:
                    del self._batch_seen[next(iter(self._batch_seen))]
                for pid, args in launches:
                    self._w_launch(pid, args)
                return
            rec = self._capture(key, sig, launches, progs)
            while len(self.graphs) > GRAPH_CACHE:  # the least recently replayed graphs go
                self._forget_graph(next(iter(self.graphs)))
        else:
            self.graphs[key] = self.graphs.pop(key)  # most recently used last
        reads, writes = capture.boundary(launches, progs)
        names = ", ".join(dict.fromkeys(p.name for p in progs))
        # the arguments are set on the graph when the launch is submitted: a set affects later launches only, and
        # the window may already hold a launch of this graph with other buffers
        self._enqueue(Pending("graph", f"graph of {len(launches)} kernels ({names[:200]})", reads, writes,
                              (rec, launches)))

    def _values(self, prog: _Kernel, args: tuple) -> list:
        buffers = self.buffers
        try:
            return [buffers[a].ptr if f is None else a for a, f in zip(args, prog.spec.formats)]
        except KeyError:
            for a, f in zip(args, prog.spec.formats):
                if f is None:
                    self._live(a)  # raises, naming the buffer
            raise

    def _capture(self, key: Any, sig: tuple, launches: list[tuple[int, tuple]], progs: list) -> GraphRecord:
        """The batch as a graph (``capture.dependencies``: independent kernels stay concurrent), instantiated."""
        drv = self.drv
        graph = drv.graph_create()
        nodes: list[int] = []
        packs: list[ArgPack] = []
        values: list[list] = []
        for ((_, args), prog), deps in zip(zip(launches, progs), capture.dependencies(launches, progs)):
            spec = prog.spec
            vals = self._values(prog, args)
            pack = ArgPack(len(spec.formats)).fill(spec.formats, vals)
            nodes.append(drv.graph_add_kernel(graph, [nodes[d] for d in deps], prog.function, spec.grid,
                                              spec.block, spec.shared_bytes, pack.address))
            packs.append(pack)
            values.append(vals)
        rec = GraphRecord(sig, graph, drv.graph_instantiate(graph), nodes, packs, list(progs), values)
        self.graphs[key] = rec
        log("launch", f"{self.name}: captured a graph of {len(nodes)} kernels")
        return rec

    def _update_graph(self, rec: GraphRecord, launches: list[tuple[int, tuple]]) -> None:
        """(at submission) New argument values for the nodes whose values changed (the driver copies them at once)."""
        drv = self.drv
        for i, ((_, args), prog) in enumerate(zip(launches, rec.programs)):
            values = self._values(prog, args)
            if values == rec.values[i]:
                continue
            rec.values[i] = values
            spec = prog.spec
            rec.packs[i].fill(spec.formats, values)
            drv.graph_exec_set_kernel(rec.exec, rec.nodes[i], prog.function, spec.grid, spec.block,
                                      spec.shared_bytes, rec.packs[i].address)

    def _forget_graph(self, key: Any) -> None:
        """Destroy ``key``'s graph once its launches are done (``_when_done``, like a freed buffer)."""
        rec = self.graphs.pop(key, None)
        self._batch_seen.pop(key, None)
        if rec is None:
            return
        if any(p.kind == "graph" and p.payload[0] is rec for p in self.pending):
            self._w_flush()
        if self.fatal is not None:
            return

        def destroy() -> None:
            self.drv.graph_exec_destroy(rec.exec)
            self.drv.graph_destroy(rec.graph)

        self._when_done(rec.streams, destroy)

    # ---- submission --------------------------------------------------------------------------------------------
    def _w_flush(self) -> None:
        """Submit the pending window: place it on the streams, add the event waits, launch, record completion."""
        if not self.pending:
            return
        cmds, self.pending = self.pending, []
        if self.fatal is not None:
            for p in cmds:
                self._release_pending(p)
                self._poison(p.writes, self.fatal.context)
            self._bury_doomed()
            return
        # a Pending has the reads / writes a streams.Command has: placed as it is
        placements, self.state = place_window(cmds, self.state, len(self.streams), self.config.unsafe)
        w = Window(next(self._seq))
        self.inflight.append(w)
        used = w.streams
        drv = self.drv
        buffers = self.buffers
        trace = [] if self.trace is not None else None
        for p, pl in zip(cmds, placements):
            touched = [buffers[b] for b in p.reads + p.writes]
            for buf in touched:
                buf.pending -= 1
            if self.fatal is not None:
                self._poison(p.writes, self.fatal.context)
                continue
            si = pl.stream
            stream = self.streams[si]
            used.add(si)
            w.names.append(p.name)
            w.writes.update(p.writes)
            if trace is not None:
                trace.append((p.name, si, pl.waits))
            for buf in touched:
                buf.streams.add(si)
            try:
                for buf in touched:
                    if buf.ready is not None:
                        self._first_use(buf, si)
                for t in pl.waits:
                    ev = self._event()
                    drv.event_record(ev, self.streams[t])
                    drv.stream_wait_event(stream, ev)
                    w.deps.append(ev)
                self._submit(p, si, stream, w)
            except DriverError as e:
                if e.sticky:
                    self._async_failure(e)
                else:
                    self._command_failed(p, e)
            except BackendError as e:
                self._command_failed(p, e)
            except Exception as e:  # noqa: BLE001 - a library program failing must not kill the worker
                self._command_failed(p, BackendError(ErrorStatus.LAUNCH, f"{type(e).__name__}: {e}"))
        if trace is not None:
            self.trace.append((w.seq, trace))
        if self.fatal is None:
            try:
                for si in sorted(used):
                    ev = self._event()
                    drv.event_record(ev, self.streams[si])
                    w.done[si] = ev
            except DriverError as e:
                self._async_failure(e)
        self._bury_doomed()

    def _release_pending(self, p: Pending) -> None:
        for b in p.reads:
            buf = self.buffers.get(b)
            if buf is not None:
                buf.pending -= 1
        for b in p.writes:
            buf = self.buffers.get(b)
            if buf is not None:
                buf.pending -= 1

    def _bury_doomed(self) -> None:
        doomed, self.doomed = self.doomed, []
        for b in doomed:
            buf = self.buffers.get(b)
            if buf is None:
                continue
            if buf.pending:
                self.doomed.append(b)
            else:
                self._bury(b)

    def _submit(self, p: Pending, si: int, stream: int, w: Window) -> None:
        drv = self.drv
        buffers = self.buffers
        if p.kind == "launch":
            prog, args = p.payload
            for b in p.reads:
                cause = buffers[b].poison
                if cause is not None:
                    self._poison(p.writes, f"{p.name} was skipped because its input holds no valid data: {cause}")
                    return
            prog.streams.add(si)
            if isinstance(prog, _Kernel):
                spec = prog.spec
                values = [buffers[a].ptr if f is None else a for a, f in zip(args, spec.formats)]
                pack = self._pack(spec.formats, values)
                w.keep.append(pack)
                drv.launch_kernel(prog.function, spec.grid, spec.block, spec.shared_bytes, stream, pack.address)
            else:
                pointers = tuple(buffers[a].ptr for a in args)
                prog.program.run(self, si, pointers)
            if debug_on("launch"):
                log("launch", f"{self.name} stream {si}: {p.name}")
        elif p.kind == "graph":
            rec, launches = p.payload
            for b in p.reads:
                cause = buffers[b].poison
                if cause is not None:
                    self._poison(p.writes, f"{p.name} was skipped because its input holds no valid data: {cause}")
                    return
            self._update_graph(rec, launches)
            for prog in rec.programs:
                prog.streams.add(si)
            rec.streams.add(si)
            drv.graph_launch(rec.exec, stream)
        elif p.kind == "h2d":
            segments, full = p.payload
            dst = buffers[p.writes[0]]
            for off, blk, size in segments:
                w.staging.append(blk)
                drv.memcpy_htod_async(dst.ptr + off, blk.ptr, size, stream)
            if full:
                dst.poison = None
        elif p.kind == "d2d":
            src, dst = buffers[p.reads[0]], buffers[p.writes[0]]
            n = min(p.payload, src.nbytes, dst.nbytes)
            if n:
                drv.memcpy_dtod_async(dst.ptr, src.ptr, n, stream)
            dst.poison = src.poison
        elif p.kind == "peer":
            (src_ptr, src_ctx, events), n = p.payload
            dst = buffers[p.writes[0]]
            for ev in events:
                drv.stream_wait_event(stream, ev)
            if n:
                drv.memcpy_peer_async(dst.ptr, self.context, src_ptr, src_ctx, n, stream)
            dst.poison = None
        else:  # pragma: no cover - internal invariant
            raise AssertionError(p.kind)

    def _pack(self, formats: tuple[str | None, ...], values: list) -> ArgPack:
        n = len(formats)
        packs = self.arg_packs.get(n)
        pack = packs.pop() if packs else ArgPack(n)
        return pack.fill(formats, values)

    def _poison(self, buffers: Sequence[int], cause: str) -> None:
        for b in buffers:
            buf = self.buffers.get(b)
            if buf is not None and buf.poison is None:
                buf.poison = cause

    def _command_failed(self, p: Pending, e: BackendError) -> None:
        what = {"launch": "kernel", "graph": "graph"}.get(p.kind, "copy")
        msg = f"{self.name}: {what} {p.name!r} could not be submitted: {e.context}"
        self._poison(p.writes, msg)
        self._note(BackendError(ErrorStatus.LAUNCH if p.kind in ("launch", "graph") else ErrorStatus.COPY, msg))

    def _async_failure(self, e: DriverError) -> None:
        """An event query / synchronize / submission reported an asynchronous error: blame every command of the
        windows not yet seen complete, poison what they wrote, and go fatal on a sticky error."""
        names = [n for w in self.inflight for n in w.names]
        if len(names) == 1:
            what = f"kernel {names[0]!r}"
        elif names:
            shown = ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
            what = f"one of the {len(names)} commands submitted since the last completed work ({shown})"
        else:
            what = "earlier work"
        msg = f"{self.name}: {what} failed asynchronously: {e.context}"
        if e.sticky:
            msg += "; the CUDA context is unusable after this error: restart the process"
        if len(names) > 1:
            msg += "; set ZYX_DEBUG=launch to synchronize after every launch and name the exact kernel"
        err = BackendError(ErrorStatus.LAUNCH, msg)
        for w in self.inflight:
            self._poison(tuple(w.writes), msg)
        self._note(err)
        if e.sticky:
            self.fatal = err
            for p in self.pending:
                self._poison(p.writes, msg)
            self.inflight.clear()
            self.dead.clear()

    # ---- completion --------------------------------------------------------------------------------------------
    def _w_sweep(self, all_done: bool = False) -> None:
        """Retire completed windows and free dead buffers whose barriers completed. ``all_done``: every stream was
        just synchronized, so nothing needs querying."""
        self._next_sweep = time.monotonic() + self.config.poll_s
        if self.fatal is not None:
            return
        drv = self.drv
        incomplete: set[int] = set()  # streams seen unfinished: later events on them are unfinished too

        def done(s: int, ev: int) -> bool:
            if all_done:
                return True
            if s in incomplete:
                return False
            if drv.event_query(ev):
                return True
            incomplete.add(s)
            return False

        unfinished: list[Window] = []
        windows = list(self.inflight)
        try:
            while windows:
                w = windows[0]
                if all(done(s, ev) for s, ev in w.done.items()):
                    self._retire(w)
                else:
                    unfinished.append(w)
                windows.pop(0)
            self.inflight = unfinished
            incomplete.clear()  # barriers may predate the newest windows: query them afresh
            keep_dead = []
            for d in self.dead:
                if d.after.retired if d.after is not None else all(done(s, ev) for s, ev in d.barriers):
                    d.action()
                    self.free_events.extend(ev for _, ev in d.barriers)
                else:
                    keep_dead.append(d)
            self.dead = keep_dead
        except DriverError as e:
            if windows:  # a window query failed: windows seen complete before it are no suspects
                self.inflight = unfinished + windows
            self._async_failure(e)

    def _retire(self, w: Window) -> None:
        w.retired = True
        self.free_events.extend(w.done.values())
        self.free_events.extend(w.deps)
        for obj in w.keep:
            if isinstance(obj, ArgPack):
                self.arg_packs.setdefault(obj.n, []).append(obj)
        for blk in w.staging:
            self.staging.release(blk)

    def _w_drain(self) -> None:
        """Submit the window, wait for the streams that may still run work (``_busy_streams``), retire everything
        (errors are kept in ``self.error``)."""
        self._w_flush()
        if self.fatal is not None:
            return
        try:
            for s in sorted(self._busy_streams()):
                self.drv.stream_synchronize(self.streams[s])
        except DriverError as e:
            self._async_failure(e)
            return
        self._w_sweep(all_done=True)

    def _busy_streams(self) -> set[int]:
        """Stream indices of the windows not seen complete and of the barriers not seen complete: every command
        outside a window (read-back, timed launch, peer copy) completed before its call returned, so no other
        stream can hold work. A sync of an idle GPU then makes no driver call (it made one per stream)."""
        busy: set[int] = set()
        for w in self.inflight:
            busy |= w.streams
        for d in self.dead:
            busy.update(s for s, _ in d.barriers)
        return busy

    def _w_sync(self) -> None:
        self._w_drain()
        self._raise_pending()

    # ---- read-back and peers -----------------------------------------------------------------------------------
    def _w_download(self, buffer: int, address: int, nbytes: int) -> None:
        self._w_flush()  # no drain: the copy queues behind the buffer's last writer and waits for itself only
        self._w_sweep()
        self._raise_pending()
        buf = self._live(buffer)
        if buf.poison is not None:
            raise BackendError(ErrorStatus.LAUNCH, f"{self.name}: buffer {buffer} holds no valid data: {buf.poison}")
        n = min(nbytes, buf.nbytes)
        if n <= 0:
            return
        drv = self.drv
        chunk = min(n, self.config.staging_block)
        blocks = [self.staging.acquire(chunk) for _ in range(1 if n <= chunk else 2)]
        events = [self._event() for _ in blocks]
        si = self.state.last_writer.get(buffer, 0)  # ordered after every write of the buffer
        stream = self.streams[si]
        self._first_use(buf, si)
        landed = False
        try:
            prev: tuple[int, Staging, int, int] | None = None
            for i, off in enumerate(range(0, n, chunk)):
                k = min(chunk, n - off)
                blk, ev = blocks[i % len(blocks)], events[i % len(events)]
                drv.memcpy_dtoh_async(blk.ptr, buf.ptr + off, k, stream)
                drv.event_record(ev, stream)
                if prev is not None:
                    self._land(prev, address)
                prev = (ev, blk, off, k)
            if prev is not None:
                self._land(prev, address)
            landed = True
        except DriverError as e:
            if e.sticky:
                self._async_failure(e)
                self.error = None
            raise BackendError(ErrorStatus.COPY, f"{self.name}: reading buffer {buffer} back failed: "
                               f"{e.context}") from None
        finally:
            if not landed:
                # a copy queued before the failure may still be writing a staging block: wait for it, and
                # never hand out blocks or events that a copy on a broken context may still touch
                try:
                    drv.stream_synchronize(stream)
                except DriverError:
                    blocks, events = [], []
            for blk in blocks:
                self.staging.release(blk)
            self.free_events.extend(events)

    def _land(self, chunk: tuple[int, Staging, int, int], address: int) -> None:
        ev, blk, off, k = chunk
        self.drv.event_synchronize(ev)
        ctypes.memmove(address + off, blk.ptr, k)

    def _w_can_peer(self, peer_device: int, peer_context: int) -> bool:
        self._usable()
        try:
            if not self.drv.can_access_peer(self.device, peer_device):
                return False
            self.drv.enable_peer_access(peer_context)
        except DriverError as e:
            log("dev", f"{self.name}: no peer access to device {peer_device}: {e.context}")
            return False
        return True

    def _w_export(self, buffer: int) -> tuple[int, int, list[int]]:
        self._w_flush()
        self._raise_pending()
        buf = self._live(buffer)
        if buf.poison is not None:
            raise BackendError(ErrorStatus.COPY, f"{self.name}: buffer {buffer} holds no valid data: {buf.poison}")
        return buf.ptr, self.context, [ev for _, ev in self._barriers(buf.streams)]

    def _w_copy_peer(self, exported: tuple[int, int, list[int]], dst: int, nbytes: int) -> None:
        self._usable()
        src_ptr, src_ctx, events = exported
        n = min(nbytes, self._live(dst).nbytes)
        self._enqueue(Pending("peer", f"copy peer->{self.name} ({human_bytes(n)})", (), (dst,),
                              ((src_ptr, src_ctx, events), n)))
        self._w_flush()
        if self.inflight:
            try:
                for ev in self.inflight[-1].done.values():
                    self.drv.event_synchronize(ev)
            except DriverError as e:
                self._async_failure(e)
        self._raise_pending()

    # ---- programs ----------------------------------------------------------------------------------------------
    def _w_load_module(self, cubin: bytes, spec: KernelSpec) -> int:
        self._usable()
        drv = self.drv
        try:
            module = drv.module_load(cubin)
            function = drv.module_function(module, spec.name)
            if spec.shared_bytes > DEFAULT_SHARED_BYTES:
                optin = self.attrs.get("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", 0)
                if spec.shared_bytes > optin:
                    drv.module_unload(module)
                    raise BackendError(ErrorStatus.COMPILATION, f"kernel {spec.name!r} needs {spec.shared_bytes} B of "
                                       f"shared memory; {self.name} allows at most {optin} B per block")
                drv.func_set_max_dynamic_shared(function, spec.shared_bytes)
        except DriverError as e:
            hint = ""
            if e.name in ("CUDA_ERROR_NO_BINARY_FOR_GPU", "CUDA_ERROR_INVALID_IMAGE",
                          "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"):
                hint = (f"; the cubin must be compiled for this GPU's exact architecture (sm_"
                        f"{self.attrs.get('COMPUTE_CAPABILITY_MAJOR')}{self.attrs.get('COMPUTE_CAPABILITY_MINOR')})")
            raise BackendError(ErrorStatus.COMPILATION, f"{self.name}: loading kernel {spec.name!r} failed: "
                               f"{e.context}{hint}") from None
        return self._w_register(_Kernel(spec, module, function))

    def _w_register(self, program: _Kernel | _Library) -> int:
        pid = next(self._ids)
        self.programs[pid] = program
        return pid

    def _w_release_program(self, program: int) -> None:
        prog = self.programs.pop(program, None)
        if prog is None:
            return
        for key in [k for k, rec in self.graphs.items() if any(q is prog for q in rec.programs)]:
            self._forget_graph(key)
        if any(p.kind == "launch" and p.payload[0] is prog for p in self.pending):
            self._w_flush()
        if self.fatal is not None:
            return

        def unload() -> None:
            if isinstance(prog, _Kernel):
                self.drv.module_unload(prog.module)
            else:
                close = getattr(prog.program, "close", None)
                if close is not None:
                    close()

        self._when_done(prog.streams, unload)

    def _w_launch_timed(self, program: int, args: tuple) -> int:
        self._w_drain()
        self._raise_pending()
        prog = self.programs.get(program)
        if prog is None:
            raise BackendError(ErrorStatus.LAUNCH, f"{self.name}: timed launch of unknown program {program}")
        if len(args) != len(prog.kinds):
            raise BackendError(ErrorStatus.LAUNCH, f"kernel {prog.name} takes {len(prog.kinds)} arguments, "
                               f"got {len(args)}")
        p = Pending("launch", prog.name, tuple(a for a, k in zip(args, prog.kinds) if k == "in"),
                    tuple(a for a, k in zip(args, prog.kinds) if k == "out"), (prog, args))
        for b in p.reads + p.writes:
            self._live(b)
        for b in p.reads:
            if self.buffers[b].poison is not None:
                raise BackendError(ErrorStatus.LAUNCH, f"{self.name}: timed launch of {prog.name!r}: its input "
                                   f"holds no valid data: {self.buffers[b].poison}")
        drv = self.drv
        if self._timing is None:
            self._timing = (drv.event_create(timing=True), drv.event_create(timing=True))
        start, end = self._timing
        w = Window(0, [p.name], set(p.writes))
        stream = self.streams[0]
        try:
            for b in set(p.reads + p.writes):  # a buffer never used yet: after its stream-ordered allocation
                buf = self.buffers[b]
                if buf.ready is not None:
                    self._first_use(buf, 0)
            drv.event_record(start, stream)
            self._submit(p, 0, stream, w)
            drv.event_record(end, stream)
            drv.event_synchronize(end)
            ms = drv.event_elapsed_ms(start, end)
        except DriverError as e:
            if e.sticky:
                self.inflight.append(w)
                self._async_failure(e)
                self._raise_pending()
            self._poison(p.writes, e.context)
            raise BackendError(ErrorStatus.LAUNCH, f"{self.name}: timed launch of {prog.name!r} failed: "
                               f"{e.context}") from None
        except BackendError:
            raise
        except Exception as e:  # noqa: BLE001 - a library program's own exception
            raise BackendError(ErrorStatus.LAUNCH, f"{self.name}: timed launch of {prog.name!r} failed: "
                               f"{type(e).__name__}: {e}") from None
        finally:
            self._retire(w)
        for b in p.reads + p.writes:
            self.buffers[b].streams.add(0)
        return int(ms * 1e6)

    # ---- inspection --------------------------------------------------------------------------------------------
    def _w_memory_info(self) -> dict[str, int]:
        self._usable()
        self.allocator.settle()  # frees already handed to the allocator have happened, in its stream order too
        free, total = self.drv.mem_get_info()
        info = {"free": free, "total": total, "held": self.held, "live_buffers": len(self.buffers),
                "dead_buffers": len(self.dead), "pinned_in_use": self.staging.in_use,
                "pinned_cached": self.staging.cached}
        info.update(self.allocator.usage())
        return info

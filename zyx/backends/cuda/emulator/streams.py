"""Streams and events of the emulated GPU: every stream is a thread running its queue in order.

Invariants:
- A stream runs its operations one at a time in submission order and honours event waits and nothing else: two
  operations on different streams are unordered unless a wait orders them. Before every piece of work (kernel,
  copy, allocation, free, library call) the stream sleeps a random delay drawn from its own seeded generator, so
  unordered pairs really race (a seed reproduces a schedule's timing distribution, not its interleaving).
  Markers and waits take no delay, and a marker queued on an idle stream is complete at once.
- ``cuEventRecord`` makes a fresh ``Marker`` the event's latest and queues it; ``cuStreamWaitEvent`` binds the
  event's latest marker *at the call* (a later record does not change what the stream waits for); an event never
  recorded is complete. Markers always complete, even after a fault (the queue is then skipped, not stopped), so
  nothing waits forever on a broken context.
- A fault in an operation becomes the context's sticky error (the first one wins); from then on every stream
  skips its remaining work and every driver call of that context returns the error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from zyx.backends.cuda.emulator import kernels

IDLE_TRIM_S = 0.05  # idle this long, a stream's thread gives back its large fiber-stack block (kernels.trim_thread)
TIMER_SLACK_NS = 1000  # a stream thread's timer slack (Linux): its random delays sleep what they draw


def _precise_sleeps() -> None:
    """Lower this thread's timer slack from Linux's default 50 us, which made every drawn delay of 0-20 us sleep
    60-100 us (emulated CUDA ran three times slower than its delays say). Elsewhere a no-op."""
    prctl = _prctl()
    if prctl is not None:
        prctl(29, TIMER_SLACK_NS, 0, 0, 0)  # PR_SET_TIMERSLACK


@functools.cache
def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or None).prctl
    except (OSError, AttributeError):
        return None


class Marker:
    """One record of an event: set when the stream reached it (``at``: ``perf_counter_ns`` then)."""

    __slots__ = ("_done", "at")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.at = 0

    def complete(self) -> None:
        self.at = time.perf_counter_ns()
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()


@dataclass
class Event:
    timing: bool
    latest: Marker | None = None


@dataclass
class Sticky:
    """The first fault of a context: a ``CUresult`` name and what happened."""

    name: str
    detail: str


@dataclass
class Context:
    device: int
    sticky: Sticky | None = None
    peers: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def fail(self, name: str, detail: str) -> None:
        with self.lock:
            if self.sticky is None:
                self.sticky = Sticky(name, detail)


class StreamFault(Exception):
    """Raised by an operation: ``name`` is the CUresult its fault makes sticky."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(detail)
        self.name = name
        self.detail = detail


_STOP = object()


class Stream:
    """A queue of operations run by one thread; ``delay_s`` bounds the random pause before each operation."""

    def __init__(self, ctx: Context, name: str, seed: int, delay_s: float,
                 on_fault: Callable[[Context, StreamFault], None], inline: bool = False) -> None:
        self.ctx = ctx
        self.name = name
        self.delay_s = delay_s
        self._rng = random.Random(seed)
        self._queue: deque = deque()
        self._unfinished = 0  # queued or running operations
        self._cv = threading.Condition()
        self._on_fault = on_fault
        self._inline = inline
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(target=self._run, name=f"zyx-emu-{name}", daemon=True)
            self._thread.start()

    def submit(self, op: Callable[[], None], work: bool = True) -> None:
        """Queue ``op``; ``work`` operations get the random delay and are skipped once the context faulted.
        An ``inline`` stream runs ``op`` at once on the caller's thread (everything then happens in submission
        order, one valid order of the program: the host-overhead mode, whose operations do nothing)."""
        if self._inline:
            self._execute(op, work)
            return
        with self._cv:
            self._queue.append((op, work))
            self._unfinished += 1
            self._cv.notify()

    def mark(self) -> Marker:
        """Queue a new marker and return it (complete already when nothing is queued or running)."""
        m = Marker()
        with self._cv:
            if self._unfinished == 0:
                m.complete()
                return m
        self.submit(m.complete, work=False)
        return m

    def wait_for(self, marker: Marker) -> None:
        """Queue a wait: later operations of this stream run after ``marker`` completed."""
        if not marker.done():
            self.submit(marker.wait, work=False)

    def synchronize(self) -> None:
        self.mark().wait()

    def stop(self) -> None:
        if self._thread is not None:
            self.submit(_STOP, work=False)
            self._thread.join(timeout=10)

    def _run(self) -> None:
        _precise_sleeps()
        ran = False  # ran work since its fiber stacks were last given back
        while True:
            with self._cv:
                if ran and not self._queue:
                    self._cv.wait(IDLE_TRIM_S)  # a stream that is busy again soon keeps its stacks
                idle = ran and not self._queue
            if idle:
                kernels.trim_thread()
                ran = False
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                op, work = self._queue.popleft()
            if op is _STOP:
                return
            self._execute(op, work)
            ran = True
            with self._cv:
                self._unfinished -= 1

    def _execute(self, op: Callable[[], None], work: bool) -> None:
        try:
            if work and self.ctx.sticky is None:  # a faulted context runs nothing; markers still complete
                if self.delay_s > 0:
                    time.sleep(self._rng.random() * self.delay_s)
                op()
            elif not work:
                op()
        except StreamFault as f:
            self._on_fault(self.ctx, f)
        except Exception as e:  # noqa: BLE001 - a bug in the emulator itself: a launch failure, not a hang
            self._on_fault(self.ctx, StreamFault("CUDA_ERROR_LAUNCH_FAILED",
                                                 f"emulator error in {self.name}: {type(e).__name__}: {e}"))

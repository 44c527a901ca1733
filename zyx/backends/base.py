"""Abstract backend interfaces: a Pool owns memory, a Device runs programs in exactly one pool.

Invariants:
- A buffer is freed only when its reference count reaches zero *and* no queued work still uses it.
- ``launch`` may be asynchronous; its errors surface at the next sync point as ``BackendError``
  naming the kernel. ``pool_to_host`` and ``sync`` are sync points.
- Every failure of a backend is a ``BackendError(status, context)`` whose context a person can act on.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from zyx.kernel.target import DeviceInfo  # what code generation may assume; the kernel layer owns it

BufferId = int
ProgramId = int


class ErrorStatus(enum.Enum):
    INITIALIZATION = "initialization"
    ALLOCATION = "allocation"
    DEALLOCATION = "deallocation"
    COPY = "copy"
    COMPILATION = "compilation"
    LAUNCH = "launch"
    SYNC = "sync"
    UNSUPPORTED = "unsupported"
    CONFIG = "config"


class BackendError(RuntimeError):
    """A backend failure: ``status`` says which kind, ``context`` says what happened and what to do."""

    def __init__(self, status: ErrorStatus, context: str) -> None:
        super().__init__(f"{status.value} error: {context}")
        self.status = status
        self.context = context


class Pool(ABC):
    """Memory of one backend. Buffers are reference counted; ``allocate`` returns a count of one."""

    name: str

    @abstractmethod
    def allocate(self, nbytes: int) -> BufferId: ...

    @abstractmethod
    def retain(self, buffer: BufferId) -> None: ...

    @abstractmethod
    def release(self, buffer: BufferId) -> None: ...

    @abstractmethod
    def nbytes(self, buffer: BufferId) -> int: ...

    @abstractmethod
    def free_bytes(self) -> int: ...

    @abstractmethod
    def pool_to_host(self, buffer: BufferId, out: memoryview) -> None:
        """Copy ``len(out)`` bytes from the start of ``buffer`` into ``out``; a sync point."""

    @abstractmethod
    def host_to_pool(self, src: memoryview, buffer: BufferId) -> None:
        """Copy ``src`` into the start of ``buffer``; ``src`` may be reused once this returns."""

    @abstractmethod
    def pool_to_pool(self, src_pool: Pool, src: BufferId, dst: BufferId) -> None:
        """Copy all of ``dst``'s bytes from ``src`` in ``src_pool``; this (destination) pool drives it."""

    def sync(self) -> None:  # noqa: B027 - optional hook, nothing to do for synchronous pools
        """Wait until all work queued on this pool's buffers completed (default: nothing is queued)."""


@dataclass(frozen=True, eq=False)
class LibraryKernel:
    """What a device's ``match_graph`` offers for a graph class (it becomes an ``Ops.KERNEL`` node there): a
    program on that device and its estimated time.

    ``inputs`` are the graph classes the program reads, in launch-argument order (the output comes last); each
    input is materialized contiguously before the launch.
    """

    device: object
    program: int
    inputs: tuple
    est_ns: float
    name: str
    layout: object = None  # device-specific data (strides, transposition flags)


class Device(ABC):
    """Compute on one pool. Programs come from ``compile`` (generated kernels) or ``match_graph``."""

    @abstractmethod
    def info(self) -> DeviceInfo: ...

    @abstractmethod
    def pool(self) -> Pool: ...

    @abstractmethod
    def compile(self, kernel: Any) -> ProgramId:
        """Compile a ``zyx.kernel.ir.Kernel``; identical kernels may return the same program."""

    def compile_many(self, kernels: Sequence[Any]) -> list[ProgramId]:
        """``[compile(k) for k in kernels]``; a device may build them concurrently (the result is the same)."""
        return [self.compile(k) for k in kernels]

    @abstractmethod
    def launch(self, program: ProgramId, args: Sequence[int]) -> None:
        """Run ``program``: one int per kernel parameter (a BufferId of this pool, or a scalar value)."""

    def launch_batch(self, key: object, launches: Sequence[tuple[ProgramId, Sequence[int]]]) -> None:
        """Run ``launches`` in order, as one batch that may recur under ``key`` (a cached schedule with new
        buffers): a device may replay a recurring batch as one unit (CUDA graphs). Default: one by one."""
        for program, args in launches:
            self.launch(program, args)

    @abstractmethod
    def launch_timed(self, program: ProgramId, args: Sequence[int]) -> int:
        """Drain pending work, then run ``program`` alone and return its time in nanoseconds."""

    @abstractmethod
    def release(self, program: ProgramId) -> None: ...

    def match_graph(self, graph: Any, outputs: Sequence[Any]) -> None:  # noqa: B027 - optional hook
        """Add library alternatives to ``graph``'s classes (see ``zyx.graph.Graph``); default: none."""

    def sync(self) -> None:  # noqa: B027 - optional hook, nothing to do for synchronous devices
        """Wait for every launch queued on this device; raises the first asynchronous error."""

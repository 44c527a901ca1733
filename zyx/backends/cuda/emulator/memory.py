"""Memory of the emulated GPU: device allocations and pinned host blocks backed by guarded host mappings.

Invariants:
- Every allocation is its own anonymous mapping ``[guard page][usable pages][guard page]``; the buffer ends at the
  upper guard page (``ptr = usable_end - round_up(size, 256)``, so pointers are 256-byte aligned as the driver's),
  and the bytes between the lower guard page and ``ptr`` are canary bytes checked when the block is freed. An access
  past the end, or into a guard page, faults at once.
- States: ``pending`` (a stream-ordered allocation whose allocating stream has not reached it yet), ``live``,
  ``freed``. Only ``live`` memory is readable and writable (``mprotect``); pending and freed memory is
  ``PROT_NONE``, so a kernel or copy touching it faults like an illegal address on the GPU. Freed blocks stay
  poisoned in a quarantine of ``QUARANTINE`` blocks before their address space is returned, so a late use of freed
  memory is caught instead of reading a newer allocation.
- New device memory is filled with ``0xff`` bytes (NaN as floats, -1 as integers): a kernel that reads memory
  nobody wrote shows up as a wrong result, as garbage would on a GPU.
- ``check`` is the copy engine's view: a range must lie inside one live block (device ranges) or outside every
  block (pageable host memory); it returns what is wrong, or None.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import mmap
import threading
from collections import deque
from dataclasses import dataclass

PAGE = mmap.PAGESIZE
ALIGN = 256
CANARY = 0xA5
FILL = 0xFF
QUARANTINE = 2048

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
_MADV_DONTNEED = 4

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def _round(n: int, m: int) -> int:
    return (n + m - 1) // m * m


class OutOfMemory(Exception):
    """The emulated device's capacity is exhausted (``CUDA_ERROR_OUT_OF_MEMORY``)."""


@dataclass
class Block:
    """One allocation: ``size`` bytes at ``ptr`` inside the mapping ``[base, base + length)``."""

    base: int
    length: int
    ptr: int
    size: int
    kind: str  # "device" or "pinned"
    device: int
    state: str  # "pending", "live", "freed"
    label: str = ""

    @property
    def end(self) -> int:
        return self.ptr + self.size

    def describe(self, addr: int) -> str:
        if self.ptr <= addr < self.ptr + _round(max(self.size, 1), ALIGN):
            where = f"offset {addr - self.ptr} of"
        elif addr < self.ptr:
            where = f"{self.ptr - addr} B before"
        else:
            where = f"{addr - self.end} B past the end of"
        return f"{where} a {self.state} {self.kind} block of {self.size} B at {self.ptr:#x}"


class Memory:
    """All guarded blocks of one emulated machine (every device and the pinned host memory)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used: dict[int, int] = {}  # device -> bytes in pending and live device blocks
        self._bases: list[int] = []  # sorted mapping starts
        self._by_base: dict[int, Block] = {}  # mapping start -> block (freed ones too, while quarantined)
        self._quarantine: deque[Block] = deque()
        self._lock = threading.Lock()

    # ---- allocation ----------------------------------------------------------------------------------------------
    def alloc(self, size: int, kind: str, device: int = 0, pending: bool = False) -> Block:
        """A new block; ``pending`` blocks stay inaccessible until ``activate``."""
        if size < 0:
            raise ValueError(f"negative allocation size {size}")
        span = _round(max(size, 1), ALIGN)
        usable = _round(span, PAGE)
        length = usable + 2 * PAGE
        with self._lock:
            if kind == "device":
                if self.used.get(device, 0) + span > self.capacity:
                    raise OutOfMemory(f"{size} B asked, {self.capacity - self.used.get(device, 0)} B free")
                self.used[device] = self.used.get(device, 0) + span
        base = _libc.mmap(None, length, _PROT_NONE, _MAP_FLAGS, -1, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            with self._lock:
                if kind == "device":
                    self.used[device] -= span
            raise OutOfMemory(f"mmap of {length} B failed (errno {ctypes.get_errno()})")
        ptr = base + PAGE + usable - span
        blk = Block(base, length, ptr, size, kind, device, "pending")
        self._protect(blk, _PROT_RW)
        if ptr > base + PAGE:
            ctypes.memset(base + PAGE, CANARY, ptr - base - PAGE)
        ctypes.memset(ptr, FILL if kind == "device" else 0, span)
        if pending:
            self._protect(blk, _PROT_NONE)
        else:
            blk.state = "live"
        with self._lock:
            self._by_base[base] = blk
            bisect.insort(self._bases, base)
        return blk

    def activate(self, blk: Block) -> None:
        """A pending block becomes live (its allocating stream reached the allocation)."""
        if blk.state == "pending":
            self._protect(blk, _PROT_RW)
            blk.state = "live"

    def free(self, blk: Block) -> str | None:
        """Poison ``blk`` (``PROT_NONE``) and quarantine it; returns what its guard bytes say was overwritten."""
        damage = None
        if blk.state == "live":
            damage = self._canary_damage(blk)
        elif blk.state == "pending":
            self._protect(blk, _PROT_RW)
            damage = self._canary_damage(blk)
        if blk.state == "freed":
            return None
        blk.state = "freed"
        self._protect(blk, _PROT_NONE)
        _libc.madvise(blk.base + PAGE, blk.length - 2 * PAGE, _MADV_DONTNEED)
        old = []
        with self._lock:
            if blk.kind == "device":
                self.used[blk.device] -= _round(max(blk.size, 1), ALIGN)
            self._quarantine.append(blk)
            while len(self._quarantine) > QUARANTINE:
                old.append(self._quarantine.popleft())
            for o in old:
                del self._by_base[o.base]
                del self._bases[bisect.bisect_left(self._bases, o.base)]
        for o in old:
            _libc.munmap(o.base, o.length)
        return damage

    def release_all(self) -> None:
        """Unmap every block (the emulated machine is gone)."""
        with self._lock:
            blocks = list(self._by_base.values())
            self._by_base, self._bases = {}, []
            self._quarantine.clear()
            self.used.clear()
        for b in blocks:
            _libc.munmap(b.base, b.length)

    # ---- lookup --------------------------------------------------------------------------------------------------
    def containing(self, addr: int) -> Block | None:
        """The block whose mapping (guards included) holds ``addr``."""
        with self._lock:
            i = bisect.bisect_right(self._bases, addr) - 1
            if i < 0:
                return None
            b = self._by_base[self._bases[i]]
        return b if addr < b.base + b.length else None

    def check(self, addr: int, n: int, kind: str) -> str | None:
        """What is wrong with touching ``[addr, addr + n)`` as ``kind`` memory ("device", or "host": pageable or
        pinned), or None when the range is usable."""
        if n <= 0:
            return None
        blk = self.containing(addr)
        if blk is None:
            if kind == "device":
                return f"{addr:#x} is not device memory"
            return None  # pageable host memory
        if kind == "device" and blk.kind != "device":
            return f"{addr:#x} is pinned host memory, not device memory"
        if kind == "host" and blk.kind == "device":
            return f"{addr:#x} is device memory, not host memory"
        if blk.state != "live":
            return f"{n} B at {blk.describe(addr)}"
        if addr < blk.ptr or addr + n > blk.ptr + _round(max(blk.size, 1), ALIGN):
            return f"{n} B at {blk.describe(addr)}"
        return None

    def describe(self, addr: int) -> str:
        blk = self.containing(addr)
        return blk.describe(addr) if blk is not None else "no allocation"

    # ---- internals -----------------------------------------------------------------------------------------------
    def _protect(self, blk: Block, prot: int) -> None:
        if _libc.mprotect(blk.base + PAGE, blk.length - 2 * PAGE, prot) != 0:
            raise OSError(ctypes.get_errno(), f"mprotect of an emulated block at {blk.ptr:#x} failed")

    def _canary_damage(self, blk: Block) -> str | None:
        n = blk.ptr - blk.base - PAGE
        if n <= 0:
            return None
        guard = ctypes.string_at(blk.base + PAGE, n)
        if guard.count(CANARY) == n:
            return None
        first = next(i for i, c in enumerate(guard) if c != CANARY)
        return (f"the {n} guard bytes before the block of {blk.size} B at {blk.ptr:#x} were overwritten "
                f"(from {n - first} B before the block)")

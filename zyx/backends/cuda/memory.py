"""Memory of the CUDA worker: pinned staging blocks and the device allocators (stream-ordered, or a caching
allocator keyed by size where memory pools are missing). Only the worker thread calls these.
"""

from __future__ import annotations

from dataclasses import dataclass

from zyx.backends.cuda.driver import Driver

ALLOC_ALIGN = 256


def round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def human_bytes(n: int) -> str:
    """``8.0 GiB`` for sizes from 0.1 GiB up, ``12.5 MiB`` below."""
    if n >= (1 << 30) // 10:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


@dataclass
class Staging:
    """One pinned host block (``size`` bytes at ``ptr``); ``borrowed``: the caller's pinned memory, never pooled."""

    ptr: int
    size: int
    borrowed: bool = False


class StagingPool:
    """Pinned host blocks in power-of-two size classes from 4 KiB to ``max_block``; ``in_use`` counts blocks handed
    out, freed blocks are cached up to ``cache_limit`` bytes."""

    MIN_BLOCK = 4096

    def __init__(self, drv: Driver, max_block: int, cache_limit: int) -> None:
        self.drv, self.max_block, self.cache_limit = drv, max_block, cache_limit
        self.free: dict[int, list[Staging]] = {}
        self.in_use = 0
        self.cached = 0

    def size_for(self, n: int) -> int:
        size = self.MIN_BLOCK
        while size < n:
            size *= 2
        return min(size, max(self.max_block, n))

    def acquire(self, n: int) -> Staging:
        size = self.size_for(n)
        blocks = self.free.get(size)
        if blocks:
            blk = blocks.pop()
            self.cached -= size
        else:
            blk = Staging(self.drv.host_alloc(size), size)
        self.in_use += size
        return blk

    def release(self, blk: Staging) -> None:
        if blk.borrowed:
            return
        self.in_use -= blk.size
        if self.cached + blk.size <= self.cache_limit:
            self.free.setdefault(blk.size, []).append(blk)
            self.cached += blk.size
        else:
            self.drv.host_free(blk.ptr)

    def trim(self) -> None:
        for blocks in self.free.values():
            for blk in blocks:
                self.drv.host_free(blk.ptr)
        self.free.clear()
        self.cached = 0


class StreamOrderedAllocator:
    """``cuMemAllocAsync`` / ``cuMemFreeAsync`` on the device's default pool, on a stream that runs no work.

    Frees happen only after the buffer's barrier events completed, so memory handed back is idle; the raised
    release threshold keeps it reserved for the next allocation instead of returning it to the driver. An
    allocation is ordered on ``stream`` only: another stream may use it after waiting for an event recorded
    there after the allocation (the worker's ``DeviceBuffer.ready``).
    """

    kind = "stream-ordered"

    def __init__(self, drv: Driver, device: int, stream: int) -> None:
        self.drv, self.stream = drv, stream
        self.pool = drv.default_mem_pool(device)
        drv.mem_pool_set_release_threshold(self.pool, (1 << 64) - 1)

    def alloc(self, size: int) -> int:
        return self.drv.mem_alloc_async(size, self.stream)

    def free(self, ptr: int, size: int) -> None:
        self.drv.mem_free_async(ptr, self.stream)

    def settle(self) -> None:
        """Wait until every allocation and free queued on the allocation stream happened."""
        self.drv.stream_synchronize(self.stream)

    def release_cached(self) -> None:
        self.settle()
        self.drv.mem_pool_trim(self.pool, 0)

    def usage(self) -> dict[str, int]:
        reserved, used = self.drv.mem_pool_usage(self.pool)
        return {"pool_reserved": reserved, "pool_used": used}


class CachingAllocator:
    """``cuMemAlloc`` / ``cuMemFree`` behind a cache of freed blocks keyed by their (rounded) size."""

    kind = "caching"
    stream = None  # allocations are complete when ``alloc`` returns

    def __init__(self, drv: Driver) -> None:
        self.drv = drv
        self.cache: dict[int, list[int]] = {}
        self.cached = 0

    def alloc(self, size: int) -> int:
        blocks = self.cache.get(size)
        if blocks:
            self.cached -= size
            return blocks.pop()
        return self.drv.mem_alloc(size)

    def free(self, ptr: int, size: int) -> None:
        self.cache.setdefault(size, []).append(ptr)
        self.cached += size

    def settle(self) -> None:
        """Allocations and frees are complete when their calls return: nothing to wait for."""

    def release_cached(self) -> None:
        for blocks in self.cache.values():
            for ptr in blocks:
                self.drv.mem_free(ptr)
        self.cache.clear()
        self.cached = 0

    def usage(self) -> dict[str, int]:
        return {"cache_bytes": self.cached}


def alloc_size(nbytes: int) -> int:
    """Bytes actually reserved for a buffer of ``nbytes``: 256-byte multiples (512 KiB multiples above 1 MiB,
    which keeps the caching allocator's size classes few)."""
    n = max(nbytes, 1)
    return round_up(n, ALLOC_ALIGN) if n <= (1 << 20) else round_up(n, 1 << 19)

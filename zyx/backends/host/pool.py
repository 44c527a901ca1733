"""Host memory pool: 64-byte aligned, reference-counted buffers with a bounded cache of freed blocks.

Reusing freed blocks of the same size keeps steady-state loops free of page faults; the cache holds at most
``cache_limit`` bytes and is emptied when an allocation fails.
"""

from __future__ import annotations

import threading

import numpy as np

from zyx.backends.base import BackendError, BufferId, ErrorStatus, Pool

ALIGN = 64


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 34


class _Block:
    """One allocation: the raw array, its ``ALIGN``-aligned view of ``size`` bytes and that view's address."""

    __slots__ = ("raw", "view", "address", "size")

    def __init__(self, raw: np.ndarray, view: np.ndarray, address: int) -> None:
        self.raw, self.view, self.address, self.size = raw, view, address, view.nbytes


class HostPool(Pool):
    name = "host"

    def __init__(self, cache_limit: int = 1 << 30) -> None:
        self._lock = threading.Lock()
        # id -> [block (None: wrapped memory), the buffer's bytes (a uint8 array of nbytes), refcount, on_release]
        self._bufs: dict[int, list] = {}
        self.addresses: dict[int, int] = {}  # id -> address of its first byte (``.ctypes.data`` costs ~1 us)
        self._cache: dict[int, list[_Block]] = {}  # size -> freed blocks of that size
        self._cached_bytes = 0
        self._next = 1
        self.cache_limit = cache_limit

    def allocate(self, nbytes: int) -> BufferId:
        size = max((nbytes + ALIGN - 1) // ALIGN * ALIGN, ALIGN)
        with self._lock:
            blocks = self._cache.get(size)
            if blocks:
                block = blocks.pop()
                self._cached_bytes -= size
            else:
                block = self._fresh(size)
            bid = self._next
            self._next += 1
            self._bufs[bid] = [block, block.view if nbytes == size else block.view[:nbytes], 1]
            self.addresses[bid] = block.address
            return bid

    def _fresh(self, size: int) -> _Block:
        try:
            raw = np.empty(size + ALIGN, np.uint8)
        except MemoryError:
            self._cache.clear()
            self._cached_bytes = 0
            try:
                raw = np.empty(size + ALIGN, np.uint8)
            except MemoryError:
                raise BackendError(ErrorStatus.ALLOCATION, f"out of host memory: asked {size} bytes, "
                                   f"{_available_memory()} available") from None
        off = (-raw.ctypes.data) % ALIGN
        view = raw[off:off + size]
        return _Block(raw, view, view.ctypes.data)

    def wrap(self, memory: np.ndarray, on_release=None) -> BufferId:
        """A buffer over memory this pool does not own (e.g. a mapped file), read-only by contract;
        ``on_release`` runs when the count reaches zero. Never enters the cache."""
        with self._lock:
            bid = self._next
            self._next += 1
            self._bufs[bid] = [None, memory.reshape(-1).view(np.uint8), 1, on_release]
            self.addresses[bid] = memory.ctypes.data
            return bid

    def import_buffer(self, src_pool: Pool, src: BufferId) -> BufferId | None:
        """Zero-copy access to ``src`` when its pool exposes it as host memory (the disk pool's mappings) at an
        ``ALIGN``-byte boundary; None otherwise, and the caller copies it into an aligned buffer. (A tensor in a
        safetensors file starts wherever the header ends: read in place at an 8-byte boundary, MiniLM's weights
        made its GEMMs 7% slower.)"""
        view = getattr(src_pool, "host_view", None)
        if view is None:
            return None
        memory = view(src, ALIGN)
        if memory is None:
            return None
        src_pool.retain(src)
        return self.wrap(memory, lambda: src_pool.release(src))

    def retain(self, buffer: BufferId) -> None:
        with self._lock:
            self._bufs[buffer][2] += 1

    def release(self, buffer: BufferId) -> None:
        """One reference less; at zero the block goes to the cache, or a wrapped buffer's ``on_release`` runs
        (outside the pool's lock, so it may use this pool)."""
        with self._lock:
            b = self._bufs[buffer]
            b[2] -= 1
            if b[2] > 0:
                return
            del self._bufs[buffer]
            del self.addresses[buffer]
            block = b[0]
            if block is None:
                on_release = b[3] if len(b) > 3 else None
            else:  # kept for reuse while the cache has room; no NumPy call and no other frame: a release right
                # after a large kernel runs with cold caches, where every extra object touched costs
                on_release = None
                size = block.size
                if self._cached_bytes + size <= self.cache_limit:
                    blocks = self._cache.get(size)
                    if blocks is None:
                        blocks = self._cache[size] = []
                    blocks.append(block)
                    self._cached_bytes += size
        if on_release is not None:  # wrapped memory: hand it back to its owner
            on_release()

    def nbytes(self, buffer: BufferId) -> int:
        return self._bufs[buffer][1].nbytes

    def address(self, buffer: BufferId) -> int:
        return self.addresses[buffer]

    def view(self, buffer: BufferId) -> np.ndarray:
        """The buffer's bytes as a uint8 array (zero-copy; valid while the buffer is retained)."""
        return self._bufs[buffer][1]

    def live_buffers(self) -> int:
        return len(self._bufs)

    def free_bytes(self) -> int:
        return _available_memory() + self._cached_bytes

    def empty_cache(self) -> None:
        with self._lock:
            self._cache.clear()
            self._cached_bytes = 0

    def pool_to_host(self, buffer: BufferId, out: memoryview) -> None:
        n = out.nbytes
        np.frombuffer(out, np.uint8, n)[:] = self.view(buffer)[:n]

    def host_to_pool(self, src: memoryview, buffer: BufferId) -> None:
        s = np.frombuffer(src, np.uint8)
        self.view(buffer)[:s.size] = s

    def pool_to_pool(self, src_pool: Pool, src: BufferId, dst: BufferId) -> None:
        if isinstance(src_pool, HostPool):
            d = self.view(dst)
            d[:] = src_pool.view(src)[:d.size]
            return
        src_pool.pool_to_host(src, memoryview(self.view(dst)))

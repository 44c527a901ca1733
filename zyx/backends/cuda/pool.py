"""``CudaPool``: the memory of one GPU, on top of its worker thread (``zyx.backends.cuda.worker``).

Invariants:
- Reference counts live here (a lock guards them); ``retain`` costs no round trip to the worker, and the worker
  hears of a buffer only at ``allocate`` and when its count reaches zero (``Worker.free``), after which the memory
  is reused only once every stream that used the buffer passed barrier events recorded behind that use.
- ``host_to_pool`` returns once the source bytes were copied into pinned staging memory, so the caller may reuse
  the source; the device copy itself joins the worker's window. ``pool_to_host`` waits only for the work its buffer
  depends on (the copy is queued behind the buffer's last writer), raises the first error seen since the last
  sync point, and raises rather than returning the contents of a buffer a failed command should have written.
- ``pool_to_pool`` is driven by this (destination) pool: same GPU = an async device copy; another GPU = a peer copy
  when the driver allows peer access (a sync point on both GPUs), else staged through host memory; the host pool
  and a disk file (its memory map) are uploaded straight from their memory (one host copy, into pinned staging);
  any other pool is read into host memory with its ``pool_to_host`` and uploaded from there.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np

from zyx.backends.base import BackendError, BufferId, ErrorStatus, Pool
from zyx.backends.cuda.worker import Worker


class CudaPool(Pool):
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.name = worker.name
        self._lock = threading.RLock()  # reentrant: a garbage collection inside may release a Buffer
        self._refs: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self._peer: dict[int, bool] = {}

    def __repr__(self) -> str:
        return f"CudaPool({self.name})"

    # ---- reference counting --------------------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> BufferId:
        bid = self.worker.allocate(nbytes)
        with self._lock:
            self._refs[bid] = 1
            self._sizes[bid] = nbytes
        return bid

    def retain(self, buffer: BufferId) -> None:
        with self._lock:
            if buffer not in self._refs:
                raise BackendError(ErrorStatus.ALLOCATION, f"{self.name}: retain of unknown buffer {buffer}")
            self._refs[buffer] += 1

    def release(self, buffer: BufferId) -> None:
        with self._lock:
            count = self._refs.get(buffer)
            if count is None:
                raise BackendError(ErrorStatus.DEALLOCATION, f"{self.name}: release of unknown buffer {buffer}")
            if count > 1:
                self._refs[buffer] = count - 1
                return
            del self._refs[buffer]
            del self._sizes[buffer]
        self.worker.free(buffer)

    def nbytes(self, buffer: BufferId) -> int:
        try:
            return self._sizes[buffer]
        except KeyError:
            raise BackendError(ErrorStatus.COPY, f"{self.name}: unknown buffer {buffer}") from None

    def live_buffers(self) -> int:
        return len(self._refs)

    def free_bytes(self) -> int:
        return self.worker.free_bytes()

    def memory_info(self) -> dict[str, int]:
        """Driver view of the memory (free, total, allocator pool usage, pinned staging) after pending frees."""
        return self.worker.memory_info()

    # ---- copies ----------------------------------------------------------------------------------------------------
    def pool_to_host(self, buffer: BufferId, out: memoryview) -> None:
        dst = np.frombuffer(out, np.uint8)
        if dst.size:
            if not dst.flags.writeable:
                raise BackendError(ErrorStatus.COPY, f"{self.name}: pool_to_host needs a writable destination")
            self.worker.download(buffer, dst.ctypes.data, dst.size)

    def pinned(self, nbytes: int) -> np.ndarray:
        """A uint8 array of ``nbytes`` in pinned host memory (freed when the array is collected). ``host_to_pool``
        from it returns once the copy is queued, no staging copy: write to it again only after a sync point
        (``sync``, a read-back), as with PyTorch's non-blocking copies from pinned memory."""
        ptr = self.worker.pin(nbytes)
        raw = (ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr)
        weakref.finalize(raw, self.worker.unpin, ptr)  # every array made from it keeps ``raw`` alive
        return np.frombuffer(raw, np.uint8)[:nbytes]

    def host_to_pool(self, src: memoryview, buffer: BufferId) -> None:
        arr = np.frombuffer(src, np.uint8)
        if arr.size:
            self.worker.upload(arr.ctypes.data, arr.size, buffer)

    def pool_to_pool(self, src_pool: Pool, src: BufferId, dst: BufferId) -> None:
        n = self.nbytes(dst)
        if src_pool is self:
            self.worker.copy(src, dst, n)
            return
        if isinstance(src_pool, CudaPool):
            if self._can_peer(src_pool):
                self._peer_copy(src_pool, src, dst, n)
                return
        else:
            view = getattr(src_pool, "view", None) or getattr(src_pool, "host_view", None)
            if callable(view):  # host memory or a disk file's mapping: one copy, into pinned staging
                self.host_to_pool(memoryview(view(src)[:n]), dst)
                return
        staged = np.empty(n, np.uint8)  # disk, or a GPU without peer access: through host memory
        src_pool.pool_to_host(src, memoryview(staged))
        self.host_to_pool(memoryview(staged), dst)

    def _can_peer(self, other: CudaPool) -> bool:
        key = id(other.worker)
        ok = self._peer.get(key)
        if ok is None:
            ok = self._peer[key] = self.worker.can_access_peer(other.worker)
        return ok

    def _peer_copy(self, src_pool: CudaPool, src: BufferId, dst: BufferId, n: int) -> None:
        src_pool.retain(src)
        try:
            exported = src_pool.worker.export(src)
            try:
                self.worker.copy_from_peer(exported, dst, n)
            finally:
                src_pool.worker.recycle_events(exported[2])
        finally:
            src_pool.release(src)

    def sync(self) -> None:
        self.worker.sync()

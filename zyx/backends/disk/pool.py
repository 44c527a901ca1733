"""Disk pool: read-only buffers over memory-mapped files (the "disk" device of tensors from ``zyx.load``).

A buffer is a byte range ``(file, offset, nbytes)`` of one mapped file. Invariants:

- One mapping per file (``mmap.ACCESS_READ``, the whole file), shared by every buffer and handle over it and
  reference counted: each buffer and each open ``MappedFile`` handle holds one reference, and the mapping is
  unmapped when the last one goes. A file is identified by (device, inode, size) at open time, so a file
  replaced on disk (``zyx.save`` onto the same path) gets a fresh mapping while tensors loaded earlier keep
  reading the old contents. Truncating a mapped file in place is undefined (as for any mmap reader).
- Buffers are read-only: ``allocate``, ``host_to_pool`` and copies *into* a disk buffer raise
  ``BackendError(UNSUPPORTED)``; write files with ``zyx.save``.
- Reads copy straight from the mapping into the caller's memory through NumPy views (never a Python
  ``bytes`` of a whole tensor); nothing is read before a value is needed. ``bytes_read`` and ``reads`` count
  what ``pool_to_host`` copied (for tests and debugging).
- Every method is thread safe (one lock guards the tables; copies run outside it on a view taken under it).
"""

from __future__ import annotations

import mmap
import os
import stat
import threading

import numpy as np

from zyx.backends.base import BackendError, BufferId, ErrorStatus, Pool


class _File:
    """One mapped file: the mapping and how many buffers / handles hold it."""

    __slots__ = ("path", "key", "size", "map", "refs")

    def __init__(self, path: str, key: tuple[int, int, int], size: int, mapping: mmap.mmap | None) -> None:
        self.path, self.key, self.size, self.map, self.refs = path, key, size, mapping, 0

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """A read-only uint8 view of ``[offset, offset + nbytes)`` (zero-copy)."""
        if nbytes == 0 or self.map is None:
            return np.empty(0, np.uint8)
        return np.frombuffer(self.map, np.uint8, nbytes, offset)

    def close(self) -> None:
        m, self.map = self.map, None
        if m is not None:
            try:
                m.close()
            except BufferError:  # a view is still alive somewhere: the mapping goes when the view does
                pass


class MappedFile:
    """An open file of a ``DiskPool``: holds its mapping until ``close()`` (or the end of a ``with`` block).

    ``path`` and ``size`` describe the file as mapped; ``read(offset, nbytes)`` returns a small range as
    ``bytes`` (headers); ``pool.buffer(handle, offset, nbytes)`` makes a buffer over the same mapping.
    """

    def __init__(self, pool: DiskPool, file: _File) -> None:
        self._pool, self._file = pool, file

    @property
    def path(self) -> str:
        return self._file.path

    @property
    def size(self) -> int:
        return self._file.size

    def read(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` bytes at ``offset`` (fewer at the end of the file); for headers, not tensor data."""
        if self._file is None:
            raise ValueError(f"{self.path}: the file handle is closed")
        offset = min(max(offset, 0), self._file.size)
        nbytes = max(min(nbytes, self._file.size - offset), 0)
        return self._file.view(offset, nbytes).tobytes()

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            self._pool._unref(f)

    def __enter__(self) -> MappedFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class DiskPool(Pool):
    """Read-only, memory-mapped file ranges. See the module docstring for the invariants."""

    name = "disk"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[tuple[int, int, int], _File] = {}
        self._bufs: dict[int, list] = {}  # id -> [_File, offset, nbytes, refcount]
        self._next = 1
        self.bytes_read = 0  # bytes copied out by pool_to_host (debugging and tests)
        self.reads = 0  # pool_to_host calls

    # ---- files and buffers -----------------------------------------------------------------------------------
    def open_file(self, path: str | os.PathLike) -> MappedFile:
        """Map ``path`` read-only (or share its existing mapping); close the handle when done with it."""
        p = os.fspath(path)
        # OSError (FileNotFoundError, PermissionError) names the file; O_NONBLOCK: opening a FIFO must not
        # hang (it is refused below as not a regular file), and it changes nothing for regular files
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{p}: not a regular file; zyx.load maps regular files only")
            key = (st.st_dev, st.st_ino, st.st_size)
            with self._lock:
                f = self._files.get(key)
                if f is None:
                    try:
                        mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if st.st_size else None
                    except (OSError, ValueError) as e:
                        raise BackendError(ErrorStatus.ALLOCATION, f"{p}: cannot memory-map the file ({e}); "
                                           "is it a regular file?") from None
                    f = _File(p, key, st.st_size, mapping)
                    self._files[key] = f
                f.refs += 1
        finally:
            os.close(fd)
        return MappedFile(self, f)

    def buffer(self, file: MappedFile | str | os.PathLike, offset: int, nbytes: int) -> BufferId:
        """A buffer over ``nbytes`` bytes at ``offset`` of ``file`` (a handle, or a path to open); count one."""
        if isinstance(file, MappedFile):
            if file._file is None:
                raise ValueError(f"{file.path}: the file handle is closed")
            return self._new_buffer(file._file, offset, nbytes)
        with self.open_file(file) as h:
            return self._new_buffer(h._file, offset, nbytes)

    def _new_buffer(self, f: _File, offset: int, nbytes: int) -> BufferId:
        if offset < 0 or nbytes < 0 or offset + nbytes > f.size:
            raise BackendError(ErrorStatus.ALLOCATION, f"{f.path}: byte range [{offset}, {offset + nbytes}) is "
                               f"outside the file ({f.size} bytes)")
        with self._lock:
            f.refs += 1
            bid = self._next
            self._next += 1
            self._bufs[bid] = [f, offset, nbytes, 1]
            return bid

    def sub_buffer(self, buffer: BufferId, offset: int, nbytes: int) -> BufferId:
        """A new buffer over ``nbytes`` bytes at ``offset`` inside ``buffer`` (same mapping); count one."""
        with self._lock:
            f, off, n, _ = self._entry(buffer)
        if offset < 0 or nbytes < 0 or offset + nbytes > n:
            raise BackendError(ErrorStatus.ALLOCATION, f"{f.path}: sub-range [{offset}, {offset + nbytes}) is "
                               f"outside the {n}-byte buffer")
        return self._new_buffer(f, off + offset, nbytes)

    def location(self, buffer: BufferId) -> tuple[str, int, int]:
        """(path, offset in the file, nbytes) of ``buffer``."""
        with self._lock:
            f, off, n, _ = self._entry(buffer)
            return f.path, off, n

    def _entry(self, buffer: BufferId) -> list:
        try:
            return self._bufs[buffer]
        except KeyError:
            raise BackendError(ErrorStatus.COPY, f"disk buffer {buffer} does not exist (already released)") from None

    def _unref(self, f: _File) -> None:
        with self._lock:
            f.refs -= 1
            if f.refs > 0:
                return
            if self._files.get(f.key) is f:
                del self._files[f.key]
        f.close()

    def retain(self, buffer: BufferId) -> None:
        with self._lock:
            self._entry(buffer)[3] += 1

    def release(self, buffer: BufferId) -> None:
        with self._lock:
            b = self._entry(buffer)
            b[3] -= 1
            if b[3] > 0:
                return
            del self._bufs[buffer]
        self._unref(b[0])

    def nbytes(self, buffer: BufferId) -> int:
        with self._lock:
            return self._entry(buffer)[2]

    def live_buffers(self) -> int:
        return len(self._bufs)

    def mapped_files(self) -> int:
        """Files currently mapped (each once, however many buffers read it)."""
        return len(self._files)

    def free_bytes(self) -> int:
        return 0

    # ---- copies ----------------------------------------------------------------------------------------------
    def pool_to_host(self, buffer: BufferId, out: memoryview) -> None:
        dst = np.frombuffer(out, np.uint8)
        n = dst.size
        with self._lock:
            f, off, size, _ = self._entry(buffer)
            if n > size:
                raise BackendError(ErrorStatus.COPY, f"{f.path}: asked {n} bytes from a {size}-byte disk buffer")
            src = f.view(off, n)  # holds the mapping open until the copy is done
            self.bytes_read += n
            self.reads += 1
        if n:
            dst[:] = src

    def host_view(self, buffer: BufferId, align: int = 1) -> np.ndarray | None:
        """A read-only, zero-copy uint8 view of the buffer's bytes (pages are read when touched); the view
        keeps the mapping alive. Counted in ``bytes_read`` like a copy. None (nothing counted) when the bytes
        do not start at a multiple of ``align``."""
        with self._lock:
            f, off, n, _ = self._entry(buffer)
            view = f.view(off, n)
            if view.ctypes.data % align:
                return None
            self.bytes_read += n
            self.reads += 1
        return view

    def host_to_pool(self, src: memoryview, buffer: BufferId) -> None:
        raise BackendError(ErrorStatus.UNSUPPORTED, "the disk device is read-only: tensors loaded from files "
                           "cannot be written; save a new file with zyx.save(path, tensors)")

    def allocate(self, nbytes: int) -> BufferId:
        raise BackendError(ErrorStatus.UNSUPPORTED, "cannot allocate on the disk device: it only holds tensors "
                           "loaded with zyx.load; compute on 'host' or 'cuda' and save with zyx.save(path, tensors)")

    def pool_to_pool(self, src_pool: Pool, src: BufferId, dst: BufferId) -> None:
        raise BackendError(ErrorStatus.UNSUPPORTED, f"cannot copy from {src_pool.name!r} into the disk device: it "
                           "is read-only; save tensors with zyx.save(path, tensors)")

"""The disk backend: read-only tensors over memory-mapped files (see ``zyx.io`` for load and save)."""

from zyx.backends.disk.pool import DiskPool, MappedFile

__all__ = ["DiskPool", "MappedFile"]

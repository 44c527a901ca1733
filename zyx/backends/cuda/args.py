"""Kernel arguments and program records of the CUDA worker: scalar formats, packed argument blocks.

Invariant: an ``ArgPack`` holds one 8-byte value slot per parameter and the ``void*[]`` array pointing at them;
it must stay alive until the launch that used it completed (the worker keeps it with the window).
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import ml_dtypes
import numpy as np

from zyx.backends.base import BackendError, ErrorStatus

if TYPE_CHECKING:
    from zyx.backends.cuda.worker import Worker


_SCALAR_FORMATS = {"bool": "?", "int8": "b", "uint8": "B", "int16": "h", "uint16": "H", "int32": "i", "uint32": "I",
                   "int64": "q", "uint64": "Q", "float16": "e", "float32": "f", "float64": "d", "bfloat16": "bf16"}


_CTYPE_FORMATS = {"bool": "?", "_Bool": "?", "char": "b", "signed char": "b", "unsigned char": "B", "short": "h",
                  "unsigned short": "H", "int": "i", "unsigned int": "I", "long long": "q", "unsigned long long": "Q",
                  "long": "q", "unsigned long": "Q", "float": "f", "double": "d", "half": "e", "__half": "e",
                  "__nv_bfloat16": "bf16", "bfloat16": "bf16"}


def scalar_format(dtype_name: str, ctype: str | None = None) -> str:
    """The ``struct`` format of a scalar kernel parameter (``bf16``: bfloat16 bits).

    ``ctype`` (the renderer's C type of the parameter, ``const`` allowed) wins over the dtype: the CUDA renderer
    passes float16 / bfloat16 scalars as ``float``.
    """
    if ctype:
        t = ctype.replace("const", " ").replace("__restrict__", " ").strip()
        t = " ".join(t.split())
        if t in _CTYPE_FORMATS:
            return _CTYPE_FORMATS[t]
    try:
        return _SCALAR_FORMATS[dtype_name]
    except KeyError:
        raise BackendError(ErrorStatus.LAUNCH, f"no CUDA scalar parameter type for dtype {dtype_name!r}"
                           + (f" (C type {ctype!r})" if ctype else "")) from None


def _bf16_bits(value: float) -> int:

    return int(np.array(value, ml_dtypes.bfloat16).view(np.uint16))


def _coerce(fmt: str, v: int | float) -> int | float | bool:
    if fmt in ("e", "f", "d"):
        return float(v)
    return bool(v) if fmt == "?" else int(v)


class ArgPack:
    """The ``kernelParams`` block of one launch: ``n`` 8-byte value slots, then ``n`` pointers to them.

    One ctypes array holds both, so one object keeps the whole block alive; ``address`` is the ``void*[]`` to
    pass to ``cuLaunchKernel`` (0 for a kernel without parameters).
    """

    __slots__ = ("array", "n", "address", "_view")

    def __init__(self, n: int) -> None:
        self.n = n
        self.array = (ctypes.c_uint64 * max(2 * n, 1))()
        base = ctypes.addressof(self.array)
        for i in range(n):
            self.array[n + i] = base + 8 * i
        self.address = base + 8 * n if n else 0
        self._view = memoryview(self.array).cast("B")

    def fill(self, formats: Sequence[str | None], values: Sequence[int | float]) -> ArgPack:
        """Write the values: a ``None`` format is a device pointer (uint64), else a scalar of that format."""
        view = self._view
        for i, (fmt, v) in enumerate(zip(formats, values)):
            if fmt is None:
                self.array[i] = v
            elif fmt == "bf16":
                struct.pack_into("<Q", view, 8 * i, _bf16_bits(float(v)))
            else:
                struct.pack_into("<Q", view, 8 * i, 0)
                struct.pack_into("<" + fmt, view, 8 * i, _coerce(fmt, v))
        return self

    def slot(self, i: int) -> bytes:
        """The 8 bytes of value slot ``i`` (tests)."""
        return bytes(self._view[8 * i:8 * i + 8])


@dataclass(frozen=True)
class KernelSpec:
    """What the worker needs to launch a compiled kernel; ``kinds`` is "in"/"out"/"var" per parameter and
    ``formats`` the ``struct`` format of each "var" (None for buffers)."""

    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    kinds: tuple[str, ...]
    formats: tuple[str | None, ...]


class LibraryProgram(Protocol):
    """A library program (cuDNN plan) the worker runs like a kernel: ``kinds`` says which arguments are read
    ("in") and written ("out"); ``run`` enqueues it on stream ``stream_index`` of ``worker``."""

    name: str
    kinds: tuple[str, ...]

    def run(self, worker: Worker, stream_index: int, pointers: tuple[int, ...]) -> None: ...


def roles(kinds: Sequence[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Positions of the read ("in") and written ("out") buffer arguments."""
    return (tuple(i for i, k in enumerate(kinds) if k == "in"), tuple(i for i, k in enumerate(kinds) if k == "out"))


@dataclass
class _Kernel:
    spec: KernelSpec
    module: int
    function: int
    streams: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.ins, self.outs = roles(self.spec.kinds)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.spec.kinds


@dataclass
class _Library:
    program: Any  # LibraryProgram
    streams: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.ins, self.outs = roles(self.program.kinds)

    @property
    def name(self) -> str:
        return self.program.name

    @property
    def kinds(self) -> tuple[str, ...]:
        return self.program.kinds

"""Model files: lazy, memory-mapped loading of ``.safetensors`` and ``.npy``; atomic saving.

``load(path)`` reads only the header. Each tensor is a leaf on the ``"disk"`` device over its byte range of
one shared, read-only mapping of the file (``zyx.backends.disk.DiskPool``); no tensor data is read until a
value is needed. Using a disk tensor in an op realizes it on the default device; ``numpy()`` copies straight
from the mapping. Indexing a disk tensor with ints, slices, ``None`` and ``...`` reads only the smallest
contiguous byte range the selection touches (``disk_getitem``).

Invariants:

- Every file is validated before any tensor is made: a malformed file raises ``ValueError`` naming the file
  and, where one is at fault, the tensor: never a crash, a hang or a silently wrong tensor. The checks follow
  the official safetensors reader: an 8-byte little-endian header length, a JSON object header (at most
  100 MB), known dtypes, non-negative integer shapes, ``data_offsets`` that tile the data section exactly (no
  gap, no overlap, nothing past the end), and ``end - begin == prod(shape) * itemsize`` for every tensor.
- ``save`` writes a temporary file in the destination directory, flushes and fsyncs it, then renames it onto
  the final name (``os.replace``): after a failure the final name still holds its previous content (or does
  not exist) and no temporary file is left. Tensors already loaded from the file being replaced keep reading
  the old contents (their mapping holds the old file).
- Files zyx writes are byte-compatible with the official writer: header padded with spaces to a multiple of
  8 bytes, ``__metadata__`` (str -> str) when given, tensors in sorted-name order, data little-endian.
- ``.npy`` files with ``fortran_order`` are mapped as the reversed shape and returned as a lazy transpose on
  the default device (so, unlike C-order files, they live on the default device once used, not on disk).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import sys
import tempfile
from collections.abc import Callable, Mapping
from typing import BinaryIO

import numpy as np

from zyx import dtypes
from zyx.backends.registry import registry
from zyx.dtypes import DType
from zyx.graph.node import Buffer, leaf
from zyx.tensor import Tensor, _getitem

__all__ = ["load", "load_metadata", "save", "disk_getitem", "SAFETENSORS_DTYPES"]

MAX_HEADER_BYTES = 100_000_000  # the official reader's limit

SAFETENSORS_DTYPES: dict[str, DType] = {
    "BOOL": dtypes.bool_, "U8": dtypes.uint8, "I8": dtypes.int8, "U16": dtypes.uint16, "I16": dtypes.int16,
    "U32": dtypes.uint32, "I32": dtypes.int32, "U64": dtypes.uint64, "I64": dtypes.int64,
    "F16": dtypes.float16, "BF16": dtypes.bfloat16, "F32": dtypes.float32, "F64": dtypes.float64,
}
_ST_NAME: dict[DType, str] = {d: n for n, d in SAFETENSORS_DTYPES.items()}
_ST_ELSEWHERE = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64", "C128")


def _disk_pool():
    return registry().get("disk").pool


def _disk_leaf(pool, buffer_id: int, nbytes: int, shape: tuple[int, ...], dtype: DType) -> Tensor:
    return Tensor._from_class(leaf(Buffer(pool, buffer_id, nbytes, "disk"), shape, dtype))


def _kind(path: str, head: bytes) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext in (".safetensors", ".npy"):
        return ext[1:]
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if len(head) > 8 and head[8:9] == b"{":
        return "safetensors"
    raise ValueError(f"{path}: unknown file type; zyx.load reads .safetensors and .npy files")


# ---------------------------------------------------------------------------------------------------------------
# safetensors


class _Entry:
    __slots__ = ("name", "dtype", "shape", "begin", "end")

    def __init__(self, name: str, dtype: DType, shape: tuple[int, ...], begin: int, end: int) -> None:
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_safetensors(path: str, fh) -> tuple[list[_Entry], dict[str, str], int]:
    """Validate the header of the mapped file ``fh``: (entries, metadata, byte offset of the data section)."""
    size = fh.size
    if size < 8:
        raise ValueError(f"{path}: truncated safetensors file: {size} bytes, but the format starts with an "
                         "8-byte header length")
    (n,) = struct.unpack("<Q", fh.read(0, 8))
    if n > MAX_HEADER_BYTES:
        raise ValueError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit of the format; "
                         "the file is corrupt or not a safetensors file")
    if 8 + n > size:
        raise ValueError(f"{path}: header length {n} runs past the end of the file ({size} bytes); the file is "
                         "truncated or not a safetensors file")
    raw = fh.read(8, n)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: the header is not valid UTF-8 ({e})") from None

    def pairs(items: list) -> dict:
        d: dict = {}
        for k, v in items:
            if k in d:
                raise ValueError(f"{path}: malformed header: key {k!r} appears twice")
            d[k] = v
        return d

    try:
        header = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON header ({e.msg} at byte {e.pos}); the file is corrupt or not "
                         "a safetensors file") from None
    except RecursionError:
        raise ValueError(f"{path}: malformed JSON header (nested too deeply)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header must be a JSON object, got {type(header).__name__}")
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError(f"{path}: '__metadata__' must map strings to strings, got {meta!r:.200}")
    data_start = 8 + n
    data_len = size - data_start
    entries: list[_Entry] = []
    for name, info in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise ValueError(f"{where}: the entry must be an object with dtype, shape and data_offsets, got "
                             f"{info!r:.200}")
        missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
        if missing:
            raise ValueError(f"{where}: the entry lacks {', '.join(missing)}")
        dt = info["dtype"]
        if dt not in SAFETENSORS_DTYPES:
            if dt in _ST_ELSEWHERE:
                raise ValueError(f"{where}: dtype {dt} is not supported by zyx; supported: "
                                 f"{', '.join(SAFETENSORS_DTYPES)}")
            raise ValueError(f"{where}: unknown dtype {dt!r}; safetensors dtypes zyx reads: "
                             f"{', '.join(SAFETENSORS_DTYPES)}")
        dtype = SAFETENSORS_DTYPES[dt]
        shape = info["shape"]
        if not isinstance(shape, list) or not all(_is_int(s) and 0 <= s < 1 << 63 for s in shape):
            raise ValueError(f"{where}: shape must be a list of non-negative integers, got {shape!r:.200}")
        offs = info["data_offsets"]
        if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) and o >= 0 for o in offs):
            raise ValueError(f"{where}: data_offsets must be [begin, end] with non-negative integers, got "
                             f"{offs!r:.200}")
        begin, end = offs
        if end < begin:
            raise ValueError(f"{where}: data_offsets [{begin}, {end}] end before they begin")
        if end > data_len:
            raise ValueError(f"{where}: data_offsets [{begin}, {end}] run past the end of the data section "
                             f"({data_len} bytes); the file is truncated or corrupt")
        want = math.prod(shape) * dtype.itemsize
        if end - begin != want:
            raise ValueError(f"{where}: shape {tuple(shape)} of {dt} needs {want} bytes, but data_offsets "
                             f"[{begin}, {end}] hold {end - begin}")
        entries.append(_Entry(name, dtype, tuple(shape), begin, end))
    pos, prev = 0, None
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin < pos:
            raise ValueError(f"{path}: tensor {e.name!r}: data_offsets [{e.begin}, {e.end}] overlap tensor "
                             f"{prev.name!r} [{prev.begin}, {prev.end}]")
        if e.begin > pos:
            raise ValueError(f"{path}: tensor {e.name!r}: data_offsets [{e.begin}, {e.end}] leave a gap of "
                             f"{e.begin - pos} bytes after byte {pos} of the data section")
        pos, prev = e.end, e
    if pos != data_len:
        raise ValueError(f"{path}: the tensors cover {pos} bytes of data but the data section holds {data_len}; "
                         "the file is corrupt")
    return entries, dict(meta), data_start


def _load_safetensors(path: str, fh) -> dict[str, Tensor]:
    entries, _, data_start = _parse_safetensors(path, fh)
    pool = _disk_pool()
    out: dict[str, Tensor] = {}
    for e in entries:
        nbytes = e.end - e.begin
        out[e.name] = _disk_leaf(pool, pool.buffer(fh, data_start + e.begin, nbytes), nbytes, e.shape, e.dtype)
    return out


# ---------------------------------------------------------------------------------------------------------------
# .npy


class _Reader:
    """A minimal binary file over a mapped file, for numpy.lib.format's header readers."""

    def __init__(self, fh) -> None:
        self.fh, self.pos = fh, 0

    def read(self, n: int = -1) -> bytes:
        n = self.fh.size - self.pos if n is None or n < 0 else n
        b = self.fh.read(self.pos, n)
        self.pos += len(b)
        return b

    def tell(self) -> int:
        return self.pos


def _load_npy(path: str, fh) -> Tensor:
    fmt = np.lib.format
    r = _Reader(fh)
    try:
        version = fmt.read_magic(r)
        if version == (1, 0):
            shape, fortran, dt = fmt.read_array_header_1_0(r)
        elif version == (2, 0):
            shape, fortran, dt = fmt.read_array_header_2_0(r)
        else:  # 3.0: a UTF-8 header, same layout; only numpy's private reader handles it
            impl = getattr(np.lib, "_format_impl", fmt)
            if not hasattr(impl, "_read_array_header"):
                raise ValueError(f"format version {version} is not supported by this NumPy")
            shape, fortran, dt = impl._read_array_header(r, version)
    except Exception as e:  # noqa: BLE001 - untrusted header: any parse failure (ValueError, TokenError...)
        raise ValueError(f"{path}: not a valid .npy file ({type(e).__name__}: {e})") from None
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
        raise ValueError(f"{path}: .npy dtype {dt} is not supported (object, structured and sub-array dtypes "
                         "cannot be memory-mapped as tensors)")
    if dt.itemsize > 1 and not dt.isnative:
        raise ValueError(f"{path}: .npy dtype {dt.str} has non-native byte order; convert it with "
                         "np.save(path, arr.astype(arr.dtype.newbyteorder('=')))")
    try:
        dtype = dtypes.to_dtype(dt)
    except TypeError as e:
        raise ValueError(f"{path}: .npy dtype {dt} is not supported: {e}") from None
    shape = tuple(int(s) for s in shape)
    offset = r.tell()
    nbytes = math.prod(shape) * dtype.itemsize
    if offset + nbytes > fh.size:
        raise ValueError(f"{path}: truncated .npy file: shape {shape} of {dtype.name} needs {nbytes} bytes after "
                         f"the {offset}-byte header, the file holds {fh.size - offset}")
    pool = _disk_pool()
    fortran = fortran and len(shape) > 1
    mapped = tuple(reversed(shape)) if fortran else shape
    t = _disk_leaf(pool, pool.buffer(fh, offset, nbytes), nbytes, mapped, dtype)
    if fortran:
        return t.to(registry().default_device()).permute(tuple(reversed(range(len(shape)))))
    return t


# ---------------------------------------------------------------------------------------------------------------
# load


def load(path: str | os.PathLike) -> dict[str, Tensor] | Tensor:
    """Open a model file lazily: ``.safetensors`` gives a dict name -> Tensor, ``.npy`` one Tensor.

    Tensors live on the ``"disk"`` device until used (see the module docstring); nothing but the header is
    read here. Raises ``ValueError`` naming the file (and the tensor) when the file is malformed.
    """
    p = os.fspath(path)
    with _disk_pool().open_file(p) as fh:
        kind = _kind(p, fh.read(0, 9))
        return _load_safetensors(p, fh) if kind == "safetensors" else _load_npy(p, fh)


def load_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The ``__metadata__`` of a ``.safetensors`` file (an empty dict when it has none)."""
    p = os.fspath(path)
    with _disk_pool().open_file(p) as fh:
        if _kind(p, fh.read(0, 9)) != "safetensors":
            raise ValueError(f"{p}: only .safetensors files carry metadata")
        return _parse_safetensors(p, fh)[1]


# ---------------------------------------------------------------------------------------------------------------
# save


def _host_array(t: Tensor) -> np.ndarray:
    """The tensor's values as a C-contiguous little-endian array (a realized leaf is read directly)."""
    if t.cls.realized:
        out = np.empty(t.shape, t.dtype.np_dtype)
        if out.nbytes:
            buf = t.cls.buffer
            buf.pool.pool_to_host(buf.id, memoryview(out.reshape(-1).view(np.uint8)))
    else:
        out = t.numpy()
    if sys.byteorder != "little" and out.dtype.itemsize > 1:
        out = out.byteswap()
    return out


def _new_file_mode(path: str) -> int:
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        pass
    umask = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    umask = int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    if umask is None:
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def _atomic_write(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Run ``write`` on a temporary file beside ``path``, fsync it, then rename it onto ``path``.

    A symbolic link at ``path`` is followed: its target is replaced and the link kept.
    """
    path = os.path.realpath(path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{path}: cannot save, directory {directory} does not exist")
    mode = _new_file_mode(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), mode)
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass


def _safetensors_header(tensors: Mapping[str, Tensor], names: list[str], metadata: dict[str, str] | None) -> bytes:
    header: dict = {}
    if metadata is not None:  # the official writer keeps an empty dict too
        header["__metadata__"] = dict(metadata)
    pos = 0
    for name in names:
        t = tensors[name]
        n = t.numel() * t.dtype.itemsize
        header[name] = {"dtype": _ST_NAME[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_safetensors(path: str, tensors: Mapping[str, Tensor], metadata: dict[str, str] | None) -> None:
    names = sorted(tensors)
    header = _safetensors_header(tensors, names, metadata)

    def write(f: BinaryIO) -> None:
        f.write(header)
        for name in names:
            t = tensors[name]
            arr = _host_array(t)
            want = t.numel() * t.dtype.itemsize
            if arr.nbytes != want:
                raise RuntimeError(f"{path}: tensor {name!r} produced {arr.nbytes} bytes, expected {want}")
            f.write(memoryview(arr.reshape(-1).view(np.uint8)))

    _atomic_write(path, write)


def _write_npy(path: str, t: Tensor) -> None:
    if t.dtype is dtypes.bfloat16:
        raise TypeError(f"{path}: .npy has no bfloat16 dtype; save a dict as .safetensors, or cast with "
                        ".float() first")
    d = {"descr": np.lib.format.dtype_to_descr(np.dtype(t.dtype.np_dtype).newbyteorder("<")),
         "fortran_order": False, "shape": tuple(t.shape)}

    def write(f: BinaryIO) -> None:
        try:
            np.lib.format.write_array_header_1_0(f, d)
        except ValueError:  # header over 64 KiB
            np.lib.format.write_array_header_2_0(f, d)
        f.write(memoryview(_host_array(t).reshape(-1).view(np.uint8)))

    _atomic_write(path, write)


def save(path: str | os.PathLike, tensors: Mapping[str, Tensor] | Tensor,
         metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` to ``path`` atomically (see the module docstring).

    A dict name -> Tensor is written as safetensors (whatever the suffix), with ``metadata`` (str -> str) as
    its ``__metadata__``; a single Tensor is written as ``.npy`` (the path must end in ``.npy``). Tensors are
    realized and written one at a time, in sorted-name order.
    """
    p = os.fspath(path)
    if isinstance(tensors, Tensor):
        if os.path.splitext(p)[1].lower() != ".npy":
            raise TypeError(f"{p}: a single Tensor is saved as .npy; for safetensors pass a dict name -> Tensor, "
                            "e.g. zyx.save(path, {'weight': t})")
        if metadata is not None:
            raise TypeError(f"{p}: .npy files cannot carry metadata; save a dict as .safetensors instead")
        _write_npy(p, tensors)
        return
    if not isinstance(tensors, Mapping):
        raise TypeError(f"{p}: zyx.save needs a dict name -> Tensor (or one Tensor for .npy), got "
                        f"{type(tensors).__name__}")
    if os.path.splitext(p)[1].lower() == ".npy":
        raise TypeError(f"{p}: a .npy file holds one Tensor, not a dict; use a .safetensors path for a dict")
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"{p}: tensor names must be str, got {name!r} of type {type(name).__name__}")
        if name == "__metadata__":
            raise TypeError(f"{p}: '__metadata__' is reserved by safetensors; pass metadata=... instead")
        if not isinstance(t, Tensor):
            raise TypeError(f"{p}: tensor {name!r} must be a zyx.Tensor, got {type(t).__name__}; wrap arrays "
                            "with zyx.Tensor(...)")
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise TypeError(f"{p}: metadata must be a dict str -> str, got {type(metadata).__name__}")
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"{p}: metadata must map str to str, got {k!r}: {v!r} ({type(k).__name__} -> "
                                f"{type(v).__name__}); convert values with str() or json.dumps()")
        metadata = dict(metadata)
    _write_safetensors(p, dict(tensors), metadata)


# ---------------------------------------------------------------------------------------------------------------
# indexing disk tensors


def _is_int_index(ix) -> bool:
    return isinstance(ix, (int, np.integer)) and not isinstance(ix, (bool, np.bool_))


def disk_getitem(t: Tensor, index) -> Tensor:
    """``t[index]`` for a tensor on the disk device, reading only the bytes the index needs.

    With ints, slices, ``None`` and ``...`` the selection's smallest covering byte range becomes a disk
    sub-buffer. When the selection is exactly that range (in order), the result is a disk tensor over it
    (nothing is read yet); otherwise the range is copied to the default device when used, and the rest of
    the index applies there. Integer-tensor indexes realize the whole tensor on the default device.
    """
    c = t.cls
    idx = index if isinstance(index, tuple) else (index,)
    basic = all(ix is None or ix is Ellipsis or isinstance(ix, slice) or _is_int_index(ix) for ix in idx)
    n_real = sum(1 for ix in idx if ix is not None and ix is not Ellipsis)
    if not c.realized or not basic or sum(ix is Ellipsis for ix in idx) > 1 or n_real > t.ndim:
        return _getitem(t._on_compute(), index)  # the general path (and its errors)
    full: list = []
    for ix in idx:
        full.extend([slice(None)] * (t.ndim - n_real) if ix is Ellipsis else [ix])
    if not any(ix is Ellipsis for ix in idx):
        full.extend([slice(None)] * (t.ndim - n_real))

    shape = t.shape
    sel: list[tuple[int, int, int]] = []  # per axis: (first index, count, step)
    out_shape: list[int] = []
    for ix in full:
        if ix is None:
            out_shape.append(1)
            continue
        size = shape[len(sel)]
        if isinstance(ix, slice):
            start, stop, step = ix.indices(size)
            count = len(range(start, stop, step))
            sel.append((start, count, step))
            out_shape.append(count)
        else:
            i = int(ix)
            if not -size <= i < size:
                return _getitem(t._on_compute(), index)  # raises the usual IndexError
            sel.append((i % size, 1, 1))

    pool, buf, dtype = c.buffer.pool, c.buffer, t.dtype
    isz = dtype.itemsize
    if any(cnt == 0 for _, cnt, _ in sel):
        return _disk_leaf(pool, pool.sub_buffer(buf.id, 0, 0), 0, tuple(out_shape), dtype)
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    lo_i = [s if st > 0 else s + (cnt - 1) * st for s, cnt, st in sel]  # smallest index per axis
    hi_i = [s + (cnt - 1) * st if st > 0 else s for s, cnt, st in sel]  # largest
    p = next((k for k, (_, cnt, _) in enumerate(sel) if cnt != 1), len(sel))  # first axis picking > 1 index
    base = sum(strides[k] * lo_i[k] for k in range(p + 1 if p < len(sel) else p))  # start of row lo_i[p]
    lo = base + sum(strides[k] * lo_i[k] for k in range(p + 1, len(sel)))
    hi = base + sum(strides[k] * (hi_i[k] - lo_i[k] if k == p else hi_i[k]) for k in range(p, len(sel))) + 1
    count = math.prod(cnt for _, cnt, _ in sel)
    sub_id = pool.sub_buffer(buf.id, lo * isz, (hi - lo) * isz)
    if count == hi - lo and all(st > 0 or cnt == 1 for _, cnt, st in sel):
        return _disk_leaf(pool, sub_id, (hi - lo) * isz, tuple(out_shape), dtype)  # exactly that range

    # p < ndim here: rebuild rows lo_i[p]..hi_i[p] around the range (the padding is never read), index them
    sub = _disk_leaf(pool, sub_id, (hi - lo) * isz, (hi - lo,), dtype)
    rows = hi_i[p] - lo_i[p] + 1
    x = sub.to(registry().default_device())
    x = x.pad(((lo - base, base + rows * strides[p] - hi),), False if dtype is dtypes.bool_ else 0)
    x = x.reshape((rows,) + shape[p + 1:])
    new: list = []
    k = 0
    for ix in full:
        if ix is None:
            new.append(None)
            continue
        start, cnt, step = sel[k]
        if k < p:
            if isinstance(ix, slice):
                new.append(None)  # a one-index slice keeps its axis (of size 1)
        else:
            if k == p:
                start -= lo_i[p]
            if isinstance(ix, slice):
                stop = start + (cnt - 1) * step + (1 if step > 0 else -1)
                new.append(slice(start, stop if stop >= 0 else None, step))
            else:
                new.append(start)
        k += 1
    return _getitem(x, tuple(new))

"""DLPack: zero-copy exchange of tensors with NumPy, PyTorch and any other DLPack library.

``Tensor.__dlpack__`` exports, ``zyx.from_dlpack`` imports. The DLPack structs (v1.0 ABI, legacy and versioned
capsules) are declared here with ctypes.

Invariants:
- Export realizes the tensor first; a realized zyx buffer is always contiguous, so exported strides are the
  row-major ones and ``byte_offset`` is 0. Each capsule holds one ``Pool.retain`` of the buffer, released by its
  DLManagedTensor deleter (when the consumer is done) or by the capsule's destructor (when no one consumed it).
  The buffer therefore outlives the zyx Tensor as long as a consumer holds the memory.
- Host memory is exported as kDLCPU, CUDA memory as kDLCUDA with the GPU's ordinal, after every queued command
  on that GPU completed (the consumer's ``stream`` needs no extra wait). Tensors on ``disk`` are not exported:
  their bytes are a read-only memory map; ``t.to("host")`` first. Read-only host memory (a file's map) is
  exported as a copy, or read-only-flagged in a versioned capsule when ``copy=False``.
- Import wraps contiguous host memory (kDLCPU, kDLCUDAHost) in the host pool without a copy
  (``HostPool.wrap``); the producer's deleter runs when the last zyx reference to that buffer goes. A capsule
  zyx produced comes back as the very same pool buffer (host or CUDA). Strided host memory is copied (unless
  ``copy=False``); CUDA memory of other libraries is refused (move it to the host in the producer first).
- The deleter and capsule destructor handed to consumers are tiny C functions (built once with the host C
  compiler) that save and restore a pending Python exception around zyx's Python release code: consumers call
  them while an exception propagates. Without a C compiler, plain ctypes callbacks are used, which are correct
  except in that case.
"""

from __future__ import annotations

import atexit
import ctypes
import math
import threading

import numpy as np

from zyx import dtypes
from zyx.backends.host.pool import HostPool
from zyx.backends.registry import canonical_name, registry
from zyx.dtypes import DType
from zyx.graph.node import Buffer, contiguous_strides, leaf
from zyx.tensor import Tensor
from zyx.utils import log

__all__ = ["from_dlpack", "to_dlpack", "dlpack_device", "DLDevice", "DLDataType", "DLTensor", "DLManagedTensor",
           "DLPackVersion", "DLManagedTensorVersioned"]

VERSION = (1, 0)  # the DLPack ABI version zyx produces (and the major version it reads)
FLAG_READ_ONLY = 1 << 0
FLAG_IS_COPIED = 1 << 1

# DLDeviceType
CPU, CUDA, CUDA_HOST = 1, 2, 3
_DEVICE_NAMES = {1: "CPU", 2: "CUDA", 3: "CUDAHost", 4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 10: "ROCm",
                 11: "ROCmHost", 12: "ExtDev", 13: "CUDAManaged", 14: "OneAPI", 15: "WebGPU", 16: "Hexagon",
                 17: "MAIA", 18: "Trainium"}
_HOST_TYPES = (CPU, CUDA_HOST)

# DLDataTypeCode
INT, UINT, FLOAT, OPAQUE, BFLOAT, COMPLEX, BOOL = 0, 1, 2, 3, 4, 5, 6
_CODE_NAMES = {0: "int", 1: "uint", 2: "float", 3: "opaque handle", 4: "bfloat", 5: "complex", 6: "bool",
               7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz", 10: "float8_e4m3fn",
               11: "float8_e4m3fnuz", 12: "float8_e5m2", 13: "float8_e5m2fnuz", 14: "float8_e8m0fnu",
               15: "float6_e2m3fn", 16: "float6_e3m2fn", 17: "float4_e2m1fn"}
_KIND_CODE = {"b": BOOL, "i": INT, "u": UINT, "f": FLOAT}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32), ("dtype", DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    """The legacy (unversioned) managed tensor; ``deleter`` is a ``void (*)(DLManagedTensor *)`` address."""

    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


# ---- Python C API through ctypes (own function objects: other code may retype ctypes.pythonapi's) -------------
def _capi(name: str, restype, *argtypes):
    return ctypes.PYFUNCTYPE(restype, *argtypes)((name, ctypes.pythonapi))


_vp, _obj = ctypes.c_void_p, ctypes.py_object
_PyCapsule_New = _capi("PyCapsule_New", _obj, _vp, _vp, _vp)
_PyCapsule_GetName = _capi("PyCapsule_GetName", _vp, _obj)
_PyCapsule_GetPointer = _capi("PyCapsule_GetPointer", _vp, _obj, _vp)
_PyCapsule_SetName = _capi("PyCapsule_SetName", ctypes.c_int, _obj, _vp)
# by address, for the fallback destructor: the capsule is being freed, so it must not become a Python reference
_PyCapsule_IsValid_raw = _capi("PyCapsule_IsValid", ctypes.c_int, _vp, _vp)
_PyCapsule_GetPointer_raw = _capi("PyCapsule_GetPointer", _vp, _vp, _vp)

# Capsule names live as long as the process (a capsule may outlive this module at interpreter exit).
_libc = ctypes.CDLL(None)
_libc.strdup.restype = ctypes.c_void_p
_libc.strdup.argtypes = [ctypes.c_char_p]
_NAMES = {n: _libc.strdup(n.encode()) for n in ("dltensor", "used_dltensor", "dltensor_versioned",
                                                 "used_dltensor_versioned")}
_CapsuleType = type(_PyCapsule_New(1, _NAMES["used_dltensor"], None))

_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)  # void (*)(DLManagedTensor *), also PyCapsule_Destructor


# ---- export records and the release path ---------------------------------------------------------------------------
class _Export:
    """One exported capsule: the structs it points at and the pool buffer it holds one reference of."""

    __slots__ = ("managed", "shape", "strides", "pool", "bid", "device", "nbytes")

    def __init__(self, managed, shape, strides, pool, bid: int, device: str, nbytes: int) -> None:
        self.managed, self.shape, self.strides = managed, shape, strides
        self.pool, self.bid, self.device, self.nbytes = pool, bid, device, nbytes


_exports: dict[int, _Export] = {}  # address of the managed struct -> its record
_exports_lock = threading.RLock()  # reentrant: a collection inside may run a deleter
_tls = threading.local()  # .depth > 0 while a producer's deleter runs inside HostPool.release (its lock held)
_exiting = False


def _release_buffer(pool, bid: int) -> None:
    if getattr(_tls, "depth", 0):
        # A foreign deleter called from HostPool.release (which holds the pool's lock) led back to a zyx export:
        # release once that call returned, from another thread, instead of deadlocking on the lock.
        threading.Thread(target=pool.release, args=(bid,), name="zyx-dlpack-release", daemon=True).start()
    else:
        pool.release(bid)


def _on_delete(address: int) -> None:
    """The DLManagedTensor deleter of zyx's capsules: forget the record, release the buffer. Never raises."""
    if _exiting:
        return
    try:
        with _exports_lock:
            rec = _exports.pop(address, None)
        if rec is not None:
            _release_buffer(rec.pool, rec.bid)
    except Exception:  # noqa: BLE001 - called from C: nothing can be raised there; a dead backend frees nothing
        pass


def _on_capsule_death(capsule: int) -> None:
    """Fallback capsule destructor (no C compiler): an unconsumed capsule calls its tensor's deleter."""
    if _exiting:
        return
    try:
        for name in ("dltensor", "dltensor_versioned"):
            if _PyCapsule_IsValid_raw(capsule, _NAMES[name]):
                _on_delete(_PyCapsule_GetPointer_raw(capsule, _NAMES[name]))
                return
    except Exception:  # noqa: BLE001 - called from C
        pass


_PY_DELETER = _DELETER(_on_delete)  # module level: C code holds these addresses for the life of the process
_PY_DESTRUCTOR = _DELETER(_on_capsule_death)


def _stop() -> None:
    global _exiting
    _exiting = True  # at exit a consumer may free its tensors after this module is gone: then do nothing


atexit.register(_stop)

_GLUE_SOURCE = r"""
/* zyx DLPack glue: call zyx's Python release hook with any pending Python exception saved and restored.
   Declared by hand (no Python.h needed); the symbols come from the running interpreter. */
#include <stdint.h>
typedef struct _object PyObject;
extern int Py_IsInitialized(void);
extern int PyGILState_Ensure(void);
extern void PyGILState_Release(int);
extern void PyErr_Fetch(PyObject **, PyObject **, PyObject **);
extern void PyErr_Restore(PyObject *, PyObject *, PyObject *);
extern int PyCapsule_IsValid(PyObject *, const char *);
extern void *PyCapsule_GetPointer(PyObject *, const char *);

typedef struct { void *data; int32_t device_type, device_id, ndim; uint8_t code, bits; uint16_t lanes;
                 int64_t *shape, *strides; uint64_t byte_offset; } zyx_dl_tensor;
typedef struct { zyx_dl_tensor t; void *ctx; void (*deleter)(void *); } zyx_dl_managed;
typedef struct { uint32_t major, minor; void *ctx; void (*deleter)(void *); uint64_t flags;
                 zyx_dl_tensor t; } zyx_dl_versioned;

static void (*zyx_hook)(void *) = 0;

void zyx_dlpack_set_hook(void (*hook)(void *)) { zyx_hook = hook; }

void zyx_dlpack_deleter(void *managed) {
  if (!Py_IsInitialized() || !zyx_hook) return;
  int gil = PyGILState_Ensure();
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  zyx_hook(managed);
  PyErr_Restore(type, value, tb);
  PyGILState_Release(gil);
}

void zyx_dlpack_capsule_destructor(PyObject *capsule) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    zyx_dl_managed *m = (zyx_dl_managed *)PyCapsule_GetPointer(capsule, "dltensor");
    if (m && m->deleter) m->deleter(m);
  } else if (PyCapsule_IsValid(capsule, "dltensor_versioned")) {
    zyx_dl_versioned *m = (zyx_dl_versioned *)PyCapsule_GetPointer(capsule, "dltensor_versioned");
    if (m && m->deleter) m->deleter(m);
  }
  PyErr_Restore(type, value, tb);
}
"""

_glue_lock = threading.Lock()
_glue: list = []  # [(deleter address, destructor address, library or None)] once resolved


def _compiler():
    try:
        dev = registry().get("host").primary
        cc = getattr(dev, "compiler", None)
        if cc is not None:
            return cc
    except Exception:  # noqa: BLE001 - no host backend: try the default compiler
        pass
    from zyx.backends.host.compiler import CCompiler

    return CCompiler()


def _addresses() -> tuple[int, int]:
    """(deleter, capsule destructor) function addresses: the C glue when it builds, else the ctypes callbacks."""
    if not _glue:
        with _glue_lock:
            if not _glue:
                try:
                    lib = _compiler().compile(_GLUE_SOURCE, "zyx_dlpack_glue")
                    lib.zyx_dlpack_set_hook.argtypes = [_DELETER]
                    lib.zyx_dlpack_set_hook(_PY_DELETER)
                    _glue.append((ctypes.cast(lib.zyx_dlpack_deleter, ctypes.c_void_p).value,
                                  ctypes.cast(lib.zyx_dlpack_capsule_destructor, ctypes.c_void_p).value, lib))
                except Exception as e:  # noqa: BLE001 - no compiler, or an interpreter without exported symbols
                    log("dev", f"dlpack: C glue unavailable ({e}); using ctypes callbacks")
                    _glue.append((ctypes.cast(_PY_DELETER, ctypes.c_void_p).value,
                                  ctypes.cast(_PY_DESTRUCTOR, ctypes.c_void_p).value, None))
    return _glue[0][0], _glue[0][1]


def native_glue() -> bool:
    """Whether the exception-safe C deleter is in use (False: plain ctypes callbacks)."""
    _addresses()
    return _glue[0][2] is not None


# ---- dtypes and devices -------------------------------------------------------------------------------------------
def _dl_dtype(d: DType) -> DLDataType:
    code = BFLOAT if d is dtypes.bfloat16 else _KIND_CODE[d.kind]
    return DLDataType(code, d.bits, 1)


_FROM_DL = {(BFLOAT if d is dtypes.bfloat16 else _KIND_CODE[d.kind], d.bits): d for d in dtypes.ALL}
_SUPPORTED = ", ".join(d.name for d in dtypes.ALL)


def _zyx_dtype(t: DLDataType) -> DType:
    code, bits, lanes = int(t.code), int(t.bits), int(t.lanes)
    name = _CODE_NAMES.get(code, f"code {code}")
    if lanes != 1:
        raise BufferError(f"DLPack vector dtype ({name}{bits} x {lanes} lanes) is not supported; zyx imports "
                          "scalar element types only: reshape the vectors into an extra axis in the producer")
    d = _FROM_DL.get((code, bits))
    if d is None:
        raise BufferError(f"DLPack dtype {name} (type code {code}) with {bits} bits has no zyx equivalent; "
                          f"zyx has {_SUPPORTED}: convert in the producer first (e.g. torch: "
                          "t.to(torch.float32); for complex, take .real and .imag separately)")
    return d


def _device_name(kind: int) -> str:
    return f"kDL{_DEVICE_NAMES[kind]}" if kind in _DEVICE_NAMES else f"device type {kind}"


def _cuda_pool_of(name: str):
    pool = registry().get(name).pool
    if getattr(pool, "worker", None) is None:
        raise BufferError(f"device {name!r} is not a CUDA device zyx can export")
    return pool


def _cuda_device_for(ordinal: int) -> str:
    for name, p in registry().placements().items():
        worker = getattr(p.pool, "worker", None)
        if name.startswith("cuda:") and worker is not None and worker.ordinal == ordinal:
            return name
    raise BufferError(f"no zyx CUDA device has ordinal {ordinal} (zyx has "
                      f"{', '.join(n for n in registry().placements() if n.startswith('cuda')) or 'none'})")


def dlpack_device(t: Tensor) -> tuple[int, int]:
    """``(device_type, device_id)`` of ``t`` as DLPack names it: host and disk are kDLCPU, ``cuda:N`` kDLCUDA."""
    if t.device in ("host", "disk"):
        return CPU, 0
    if t.device.startswith("cuda"):
        return CUDA, _cuda_pool_of(t.device).worker.ordinal
    raise BufferError(f"zyx cannot export tensors on {t.device!r} through DLPack; move it with .to('host')")


# ---- export ---------------------------------------------------------------------------------------------------
def _check_args(max_version, copy) -> bool:
    if copy not in (None, True, False):
        raise TypeError(f"copy must be None, True or False, got {copy!r}")
    if max_version is None:
        return False
    if not (isinstance(max_version, tuple) and len(max_version) == 2 and all(isinstance(v, int)
                                                                              for v in max_version)):
        raise TypeError(f"max_version must be a (major, minor) tuple of ints, got {max_version!r}")
    return max_version[0] >= VERSION[0]


def _check_stream(kind: int, stream) -> None:
    if kind == CPU:
        if stream is not None:
            raise ValueError(f"stream must be None for a host tensor (DLPack kDLCPU), got {stream!r}")
        return
    if stream is not None and (not isinstance(stream, int) or isinstance(stream, bool)):
        raise TypeError(f"stream must be None or an int (a CUDA stream handle), got {stream!r}")
    if stream == 0:
        raise ValueError("stream=0 is ambiguous in DLPack; pass 1 for the legacy default stream, 2 for the "
                         "per-thread default stream, or a stream handle")


def _to_target(t: Tensor, dl_device, copy) -> tuple[Tensor, bool]:
    """``t`` on the device ``dl_device`` names, and whether that took a copy."""
    if dl_device is None:
        return t, False
    try:
        kind, index = (int(v) for v in dl_device)
    except (TypeError, ValueError):
        raise TypeError(f"dl_device must be a (device_type, device_id) tuple, got {dl_device!r}") from None
    if (kind, index) == dlpack_device(t):
        return t, False
    if kind == CPU:
        target = "host"
    elif kind == CUDA:
        target = _cuda_device_for(index)
    else:
        raise BufferError(f"zyx cannot export to {_device_name(kind)}:{index}; it exports to kDLCPU and kDLCUDA")
    if target == t.device:
        return t, False
    if copy is False:
        raise BufferError(f"exporting a tensor on {t.device!r} to {_device_name(kind)}:{index} needs a copy, "
                          "but copy=False; pass copy=None or move it first with .to(...)")
    return t.to(target).realize(), True


def _duplicate(pool, bid: int, nbytes: int) -> int:
    new = pool.allocate(nbytes)
    try:
        pool.pool_to_pool(pool, bid, new)
    except BaseException:
        pool.release(new)
        raise
    return new


def to_dlpack(t: Tensor, *, stream=None, max_version: tuple[int, int] | None = None,
              dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> object:
    """A DLPack capsule over ``t``'s realized buffer (``Tensor.__dlpack__``; see the module docstring)."""
    versioned = _check_args(max_version, copy)
    if t.device == "disk":
        raise BufferError("this tensor is on 'disk' (a read-only memory-mapped file) and DLPack exports only "
                          "host or CUDA memory: call t.to('host') first")
    t, copied = _to_target(t, dl_device, copy)
    kind, index = dlpack_device(t)
    _check_stream(kind, stream)
    t.realize()
    buf = t.cls.buffer
    pool, bid, nbytes = buf.pool, buf.id, t.cls.nbytes
    flags = FLAG_IS_COPIED if copied else 0
    if kind == CPU:
        if not isinstance(pool, HostPool):
            raise BufferError(f"host tensor in an unexpected pool {pool!r}; call t.to('host') first")
        if not pool.view(bid).flags.writeable:  # a file's memory map: consumers would write into it
            if copy is False and not versioned:
                raise BufferError("this tensor's memory is read-only (a memory-mapped file) and a legacy DLPack "
                                  "capsule cannot say so; pass copy=None to export a copy, or max_version=(1, 0)")
            if copy is False:
                flags |= FLAG_READ_ONLY
            else:
                copy = True
    if copy is True and not copied:
        bid = _duplicate(pool, bid, nbytes)  # the capsule owns the new buffer's only reference
        flags |= FLAG_IS_COPIED
    else:
        pool.retain(bid)
    try:
        if kind == CPU:
            data = pool.address(bid)
        else:
            pool.sync()  # every queued command is done: the consumer may use any stream without waiting
            data, _ctx, events = pool.worker.export(bid)
            pool.worker.recycle_events(events)
        capsule = _make_capsule(t, data, kind, index, versioned, flags, pool, bid, nbytes)
    except BaseException:
        pool.release(bid)
        raise
    return capsule


def _make_capsule(t: Tensor, data: int, kind: int, index: int, versioned: bool, flags: int, pool, bid: int,
                  nbytes: int) -> object:
    deleter, destructor = _addresses()
    nd = t.ndim
    shape = (ctypes.c_int64 * max(nd, 1))(*t.shape)
    strides = (ctypes.c_int64 * max(nd, 1))(*contiguous_strides(t.shape))
    dl = DLTensor(data, DLDevice(kind, index), nd, _dl_dtype(t.dtype), shape, strides, 0)
    if versioned:
        managed = DLManagedTensorVersioned(DLPackVersion(*VERSION), None, deleter, flags, dl)
        name = _NAMES["dltensor_versioned"]
    else:
        managed = DLManagedTensor(dl, None, deleter)
        name = _NAMES["dltensor"]
    address = ctypes.addressof(managed)
    managed.manager_ctx = address
    rec = _Export(managed, shape, strides, pool, bid, t.device, nbytes)
    with _exports_lock:
        _exports[address] = rec
    try:
        return _PyCapsule_New(address, name, destructor)
    except BaseException:
        with _exports_lock:
            del _exports[address]
        raise


# ---- import ---------------------------------------------------------------------------------------------------
def _capsule_of(x):
    if isinstance(x, _CapsuleType):
        return x
    fn = getattr(x, "__dlpack__", None)
    if fn is None:
        raise TypeError(f"from_dlpack needs an object with __dlpack__ (a NumPy array, a torch tensor, ...) or a "
                        f"DLPack capsule, got {type(x).__name__}")
    try:
        return fn(stream=None, max_version=VERSION)
    except TypeError:  # a producer older than DLPack 1.0 (no max_version)
        return fn(stream=None)


def _capsule_name(capsule) -> str:
    p = _PyCapsule_GetName(capsule)
    return ctypes.string_at(p).decode(errors="replace") if p else ""


def _call_deleter(deleter: int, managed: int) -> None:
    """Hand ``managed`` back to its producer (called from HostPool.release, whose lock is held)."""
    if not deleter:
        return
    _tls.depth = getattr(_tls, "depth", 0) + 1
    try:
        _DELETER(deleter)(managed)
    finally:
        _tls.depth -= 1


def from_dlpack(x, *, device: str | None = None, copy: bool | None = None) -> Tensor:
    """A zyx Tensor sharing the memory of ``x`` (an object with ``__dlpack__``, or a DLPack capsule).

    ``copy=None`` shares when it can (contiguous, element-aligned host memory, or a zyx capsule) and copies
    otherwise; ``copy=True`` always copies, ``copy=False`` raises ``BufferError`` rather than copy. ``device``
    moves the result (a copy). The producer stays alive until the last zyx reference to the memory goes.
    """
    if copy not in (None, True, False):
        raise TypeError(f"copy must be None, True or False, got {copy!r}")
    capsule = _capsule_of(x)
    if not isinstance(capsule, _CapsuleType):
        raise TypeError(f"__dlpack__ of {type(x).__name__} returned {type(capsule).__name__}, not a PyCapsule")
    name = _capsule_name(capsule)
    if name in ("used_dltensor", "used_dltensor_versioned"):
        raise ValueError(f"this DLPack capsule was already consumed (its name is {name!r}); a capsule can be "
                         "imported once: call x.__dlpack__() again, or pass the array itself to from_dlpack")
    if name not in ("dltensor", "dltensor_versioned"):
        raise ValueError(f"not a DLPack capsule: its name is {name!r}, expected 'dltensor' or "
                         "'dltensor_versioned'")
    address = _PyCapsule_GetPointer(capsule, _NAMES[name])
    if not address:
        raise ValueError("DLPack capsule holds a NULL pointer")
    if name == "dltensor_versioned":
        m = DLManagedTensorVersioned.from_address(address)
        if m.version.major != VERSION[0]:
            raise BufferError(f"DLPack version {m.version.major}.{m.version.minor} is not supported; zyx reads "
                              f"version {VERSION[0]}.x: ask the producer for max_version={VERSION}")
        flags = int(m.flags)
    else:
        m = DLManagedTensor.from_address(address)
        flags = 0
    dl = m.dl_tensor
    dtype = _zyx_dtype(dl.dtype)
    if dl.ndim < 0:
        raise BufferError(f"DLPack tensor has ndim {dl.ndim}")
    shape = tuple(int(dl.shape[i]) for i in range(dl.ndim))
    strides = tuple(int(dl.strides[i]) for i in range(dl.ndim)) if dl.strides else None
    kind, index = int(dl.device.device_type), int(dl.device.device_id)
    data = (dl.data or 0) + int(dl.byte_offset)
    deleter = m.deleter or 0
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    with _exports_lock:
        own = _exports.get(address) if deleter == _addresses()[0] else None
    if own is not None:  # a zyx capsule: the same pool buffer
        if nbytes != own.nbytes or (strides is not None and not _is_row_major(shape, strides)):
            raise BufferError("zyx DLPack capsule was altered: its shape, dtype or strides no longer match")
        own.pool.retain(own.bid)
        _consume(capsule, name)
        _on_delete(address)
        t = Tensor._from_class(leaf(Buffer(own.pool, own.bid, nbytes, own.device), shape, dtype))
    elif kind in _HOST_TYPES:
        if numel and not data:
            raise BufferError("DLPack tensor has a NULL data pointer")
        share = numel > 0 and data % dtype.itemsize == 0 and (strides is None or _is_row_major(shape, strides))
        if not share and copy is False and numel:
            raise BufferError(f"DLPack tensor of shape {shape} with strides {strides} (elements) is not "
                              "contiguous, and zyx tensors are; pass copy=None to import a contiguous copy")
        if share:
            mem = np.frombuffer((ctypes.c_uint8 * nbytes).from_address(data), np.uint8)
            if flags & FLAG_READ_ONLY:
                mem.flags.writeable = False
            pool = registry().get("host").pool
            _consume(capsule, name)
            try:
                bid = pool.wrap(mem, lambda: _call_deleter(deleter, address))
            except BaseException:
                _call_deleter(deleter, address)
                raise
            t = Tensor._from_class(leaf(Buffer(pool, bid, nbytes, "host"), shape, dtype))
        else:
            arr = _strided_copy(data, shape, strides, dtype)
            _consume(capsule, name)
            _call_deleter(deleter, address)
            t = Tensor(arr, device="host")
            copy = None  # already a copy
    elif kind == CUDA:
        raise BufferError(f"zyx imports CUDA memory ({_device_name(kind)}:{index}) only from zyx capsules; move "
                          "the tensor to the host in the producer first (torch: t.cpu()), then "
                          "zyx.from_dlpack(...).to('cuda')")
    else:
        raise BufferError(f"zyx cannot import DLPack memory on {_device_name(kind)}:{index}; it imports "
                          "kDLCPU and kDLCUDAHost memory (and kDLCUDA from zyx): copy it to the host first")
    if copy is True:
        src = t.cls.buffer
        t = Tensor._from_class(leaf(Buffer(src.pool, _duplicate(src.pool, src.id, nbytes), nbytes, t.device),
                                    shape, dtype))
    if device is not None and canonical_name(device) != t.device:
        if copy is False:
            raise BufferError(f"moving the imported tensor from {t.device!r} to {device!r} needs a copy, but "
                              "copy=False")
        t = t.to(device)
    return t


def _consume(capsule, name: str) -> None:
    if _PyCapsule_SetName(capsule, _NAMES["used_" + name]) != 0:
        raise ValueError("cannot mark the DLPack capsule as consumed")


def _is_row_major(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether element ``strides`` address ``shape`` densely in row-major order (size-1 axes may have any)."""
    if math.prod(shape) == 0:
        return True
    want = 1
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != want:
            return False
        want *= n
    return True


def _strided_copy(data: int, shape: tuple[int, ...], strides: tuple[int, ...] | None, dtype: DType) -> np.ndarray:
    """A contiguous NumPy copy of the strided (or misaligned) memory at ``data``."""
    if math.prod(shape) == 0:
        return np.empty(shape, dtype.np_dtype)
    item = dtype.itemsize
    el = strides if strides is not None else contiguous_strides(shape)
    lo = sum((n - 1) * s for n, s in zip(shape, el) if s < 0) * item
    hi = sum((n - 1) * s for n, s in zip(shape, el) if s > 0) * item + item
    raw = (ctypes.c_uint8 * (hi - lo)).from_address(data + lo)
    view = np.ndarray(shape, dtype.np_dtype, buffer=raw, offset=-lo, strides=tuple(s * item for s in el))
    return np.array(view, order="C")


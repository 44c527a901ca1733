"""DLPack export (Tensor.__dlpack__) and import (zyx.from_dlpack): memory sharing, lifetimes, errors."""

from __future__ import annotations

import ctypes
import gc
import time

import numpy as np
import pytest

import zyx
from zyx import dlpack
from zyx.backends.base import BackendError
from zyx.backends.registry import registry

torch = pytest.importorskip("torch")


def host_pool():
    return registry().get("host").pool


def alive(pool, bid: int) -> bool:
    """Whether ``bid`` is still allocated in ``pool`` (buffer ids are never reused)."""
    try:
        pool.nbytes(bid)
        return True
    except (KeyError, BackendError):
        return False


def wait_released(pool, bid: int, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        gc.collect()
        if not alive(pool, bid):
            return True
        time.sleep(0.01)
    return False


def capsule_name(capsule) -> str:
    get = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
    return get(capsule).decode()


def managed_of(capsule):
    """The DLManagedTensor(Versioned) struct a capsule points at (to read or alter it in a test)."""
    name = capsule_name(capsule)
    get = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi))
    address = get(capsule, name.encode())
    cls = dlpack.DLManagedTensorVersioned if name.endswith("versioned") else dlpack.DLManagedTensor
    return cls.from_address(address)


def buffer_of(t: zyx.Tensor):
    t.realize()
    return t.cls.buffer.pool, t.cls.buffer.id


# ---- export: host ---------------------------------------------------------------------------------------------


def test_numpy_shares_memory_with_zyx():
    t = zyx.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    a = np.from_dlpack(t)
    assert a.shape == (2, 3) and a.dtype == np.float32
    assert a.ctypes.data == host_pool().address(t.cls.buffer.id)
    a[1, 2] = 42.0
    assert t.numpy()[1, 2] == 42.0
    assert (t + 1).numpy()[1, 2] == 43.0  # kernels read the written memory too


def test_torch_shares_memory_with_zyx():
    t = zyx.Tensor(np.arange(4, dtype=np.int32))
    x = torch.from_dlpack(t)
    assert x.dtype == torch.int32 and x.tolist() == [0, 1, 2, 3]
    x[0] = -7
    assert t.numpy().tolist() == [-7, 1, 2, 3]


def test_exported_buffer_outlives_the_tensor_until_the_consumer_dies():
    t = zyx.Tensor(np.arange(8, dtype=np.float64))
    pool, bid = buffer_of(t)
    a = np.from_dlpack(t)
    x = torch.from_dlpack(t)
    del t
    gc.collect()
    assert alive(pool, bid)
    np.testing.assert_array_equal(pool.view(bid).view(np.float64), np.arange(8.0))
    a[3] = 99.0
    assert x[3].item() == 99.0  # both consumers see the one buffer
    del a
    gc.collect()
    assert alive(pool, bid)  # torch still holds it
    del x
    gc.collect()
    assert not alive(pool, bid)


def test_lazy_and_strided_tensors_are_realized_into_a_contiguous_buffer():
    base = zyx.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    view = base.T
    a = np.from_dlpack(view)
    assert a.shape == (3, 2) and a.flags.c_contiguous
    np.testing.assert_array_equal(a, np.arange(6, dtype=np.float32).reshape(2, 3).T)
    assert view.cls.realized and view.cls.buffer.id != base.cls.buffer.id
    a[0, 1] = -1.0
    assert view.numpy()[0, 1] == -1.0 and base.numpy()[1, 0] == 3.0  # the view owns its buffer now
    lazy = base * 2 + 1
    x = torch.from_dlpack(lazy)
    assert x.stride() == (3, 1)
    np.testing.assert_array_equal(x.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3) * 2 + 1)


@pytest.mark.parametrize("dt", ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
                                "float16", "bfloat16", "float32", "float64"])
def test_every_dtype_round_trips_through_torch(dt):
    d = getattr(zyx, dt)
    ref = (np.arange(5) % 2 == 1) if dt == "bool" else np.arange(5).astype(d.np_dtype)
    t = zyx.Tensor(ref, dtype=d)
    x = torch.from_dlpack(t)
    assert str(x.dtype) == f"torch.{dt}"
    back = zyx.from_dlpack(x)
    assert back.dtype is d
    assert host_pool().address(back.cls.buffer.id) == host_pool().address(t.cls.buffer.id)  # the same memory
    np.testing.assert_array_equal(back.numpy().astype(np.float64), ref.astype(np.float64))


def test_scalar_and_empty_tensors():
    s = zyx.Tensor(3.5)
    assert np.from_dlpack(s).shape == () and float(np.from_dlpack(s)) == 3.5
    e = zyx.zeros(0, 3)
    a = np.from_dlpack(e)
    assert a.shape == (0, 3)
    assert zyx.from_dlpack(np.zeros((2, 0), np.float32)).shape == (2, 0)


def test_unconsumed_capsule_releases_its_buffer():
    t = zyx.Tensor([1.0, 2.0, 3.0])
    pool, bid = buffer_of(t)
    cap = t.__dlpack__()
    assert capsule_name(cap) == "dltensor"
    del t
    gc.collect()
    assert alive(pool, bid)
    del cap
    gc.collect()
    assert not alive(pool, bid)


def test_versioned_capsule():
    t = zyx.Tensor([1.0, 2.0])
    cap = t.__dlpack__(max_version=(1, 3))
    assert capsule_name(cap) == "dltensor_versioned"
    m = managed_of(cap)
    assert (m.version.major, m.version.minor) == (1, 0) and m.flags == 0
    assert m.dl_tensor.device.device_type == 1 and m.dl_tensor.ndim == 1
    assert capsule_name(t.__dlpack__(max_version=(0, 8))) == "dltensor"  # a pre-1.0 consumer: legacy capsule
    z = zyx.from_dlpack(cap)
    assert capsule_name(cap) == "used_dltensor_versioned"
    assert z.cls.buffer.id == t.cls.buffer.id and z.numpy().tolist() == [1.0, 2.0]


def test_copy_true_exports_a_copy():
    t = zyx.Tensor([1.0, 2.0])
    cap = t.__dlpack__(max_version=(1, 0), copy=True)
    assert managed_of(cap).flags & dlpack.FLAG_IS_COPIED
    a = np.from_dlpack(t, copy=True)
    a[0] = 5.0
    assert t.numpy().tolist() == [1.0, 2.0]


def test_consumer_failure_leaves_no_leak_and_keeps_its_error():
    t = zyx.Tensor([1.0, 2.0], dtype=zyx.bfloat16)  # NumPy has no bfloat16 in DLPack
    pool, bid = buffer_of(t)
    with pytest.raises((BufferError, RuntimeError), match="(?i)dtype"):
        np.from_dlpack(t)
    del t
    assert wait_released(pool, bid)


def test_deleter_runs_safely_while_an_exception_propagates():
    if not dlpack.native_glue():
        pytest.skip("no C compiler: the ctypes-callback deleter cannot run while an exception is pending")
    u = zyx.Tensor([1.0, 2.0])
    pool, bid = buffer_of(u)
    with pytest.raises(RuntimeError, match="must match the size"):
        # the temporary torch tensor (the export's only consumer) dies while torch's error propagates
        torch.from_dlpack(u) + torch.zeros(5)
    del u
    gc.collect()
    assert not alive(pool, bid)
    v = zyx.Tensor([3.0])
    pool, bid = buffer_of(v)

    def f(*args):
        return args

    with pytest.raises(ZeroDivisionError):
        f(v.__dlpack__(), 1 / 0)  # an unconsumed capsule freed while the ZeroDivisionError propagates
    del v
    gc.collect()
    assert not alive(pool, bid)


# ---- import: host ---------------------------------------------------------------------------------------------


def test_from_torch_shares_memory():
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    z = zyx.from_dlpack(x)
    assert z.shape == (2, 3) and z.dtype is zyx.float32 and z.device == "host"
    assert host_pool().address(z.cls.buffer.id) == x.data_ptr()
    x[0, 1] = 100.0
    assert z.numpy()[0, 1] == 100.0
    assert z.sum().item() == 100.0 + 15.0 - 1.0


def test_from_numpy_shares_memory_and_keeps_the_producer_alive():
    import weakref

    a = np.arange(5, dtype=np.int16)
    ref = weakref.ref(a)
    z = zyx.from_dlpack(a)
    a[4] = -3
    assert z.numpy().tolist() == [0, 1, 2, 3, -3]
    pool, bid = z.cls.buffer.pool, z.cls.buffer.id
    del a
    gc.collect()
    assert ref() is not None  # the zyx buffer holds the producer
    assert z.numpy().tolist() == [0, 1, 2, 3, -3]
    y = z + 1  # a lazy consumer keeps the buffer (and the producer) too
    del z
    gc.collect()
    assert ref() is not None
    assert y.numpy().tolist() == [1, 2, 3, 4, -2]
    del y
    gc.collect()
    assert ref() is None and not alive(pool, bid)


def test_from_torch_keeps_memory_after_the_torch_tensor_is_gone():
    x = torch.full((1000,), 7.0)
    z = zyx.from_dlpack(x)
    del x
    gc.collect()
    _ = torch.zeros(1000) + 1  # reuse freed memory, if it was freed
    assert (z.numpy() == 7.0).all()


def test_strided_import_copies_unless_copy_false():
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    z = zyx.from_dlpack(x.T)
    np.testing.assert_array_equal(z.numpy(), x.T.numpy())
    x[0, 0] = 50.0
    assert z.numpy()[0, 0] == 0.0  # a copy
    with pytest.raises(BufferError, match="not contiguous.*copy=None"):
        zyx.from_dlpack(x.T, copy=False)
    np.testing.assert_array_equal(zyx.from_dlpack(np.arange(10)[::-3]).numpy(), np.arange(10)[::-3])
    n = np.arange(6.0).reshape(2, 3)[:, 1:]
    np.testing.assert_array_equal(zyx.from_dlpack(n).numpy(), n)


def test_import_copy_true_and_device():
    x = torch.ones(3)
    z = zyx.from_dlpack(x, copy=True)
    x[0] = 2.0
    assert z.numpy().tolist() == [1.0, 1.0, 1.0]
    assert zyx.from_dlpack(np.arange(3), device="cpu").numpy().tolist() == [0, 1, 2]


def test_zyx_numpy_zyx_chain_releases_without_deadlock():
    t = zyx.Tensor(np.arange(4, dtype=np.float32))
    pool, bid = buffer_of(t)
    a = np.from_dlpack(t)
    z = zyx.from_dlpack(a)  # numpy re-exports zyx memory: z wraps it, holding a, which holds the export
    assert pool.address(z.cls.buffer.id) == pool.address(bid)
    a[0] = 8.0
    del t, a
    gc.collect()
    assert alive(pool, bid) and z.numpy().tolist() == [8.0, 1.0, 2.0, 3.0]
    del z  # HostPool.release -> numpy's deleter -> zyx's export deleter (released after the pool's lock)
    assert wait_released(pool, bid)


def test_read_only_memory_is_exported_as_a_copy(tmp_path):
    path = tmp_path / "a.npy"
    zyx.save(path, zyx.Tensor(np.arange(4, dtype=np.float32)))
    d = zyx.load(path)
    assert d.device == "disk"
    with pytest.raises(BufferError, match=r"on 'disk'.*to\('host'\)"):
        np.from_dlpack(d)
    h = d.to("host")
    a = np.from_dlpack(h)
    a[0] = 9.0  # a writable copy: the mapped file is not touched
    assert h.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
    cap = h.__dlpack__(max_version=(1, 0), copy=False)
    assert managed_of(cap).flags & dlpack.FLAG_READ_ONLY
    ro = np.from_dlpack(h, copy=False)
    assert not ro.flags.writeable
    with pytest.raises(BufferError, match="read-only"):
        h.__dlpack__(copy=False)
    back = zyx.from_dlpack(cap)  # read-only memory comes back read-only, and is re-exported as a copy
    assert back.numpy().tolist() == [0.0, 1.0, 2.0, 3.0]
    assert np.from_dlpack(back).flags.writeable


# ---- errors ---------------------------------------------------------------------------------------------------


def test_not_a_capsule():
    with pytest.raises(TypeError, match="__dlpack__.*got int"):
        zyx.from_dlpack(42)


def test_consumed_capsule():
    cap = zyx.Tensor([1.0]).__dlpack__()
    zyx.from_dlpack(cap)
    with pytest.raises(ValueError, match="already consumed.*__dlpack__"):
        zyx.from_dlpack(cap)
    cap = torch.ones(2).__dlpack__()
    torch.from_dlpack(cap)
    with pytest.raises(ValueError, match="already consumed"):
        zyx.from_dlpack(cap)


_OTHER = ctypes.c_char_p(b"not_a_dltensor")  # module level: the capsule keeps a pointer to the name


def test_wrong_capsule_name():
    new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
        ("PyCapsule_New", ctypes.pythonapi))
    cap = new(1, _OTHER, None)
    with pytest.raises(ValueError, match="'not_a_dltensor'.*expected 'dltensor'"):
        zyx.from_dlpack(cap)


def test_unsupported_dtypes():
    with pytest.raises(BufferError, match=r"complex.*no zyx equivalent.*\.real"):
        zyx.from_dlpack(np.ones(3, np.complex64))
    with pytest.raises(BufferError, match="complex"):
        zyx.from_dlpack(torch.ones(3, dtype=torch.complex128))
    t = zyx.Tensor([1.0, 2.0])
    pool, bid = buffer_of(t)
    cap = t.__dlpack__()
    managed_of(cap).dl_tensor.dtype.bits = 8  # float with 8 bits: a DLPack dtype zyx lacks
    with pytest.raises(BufferError, match="float.*8 bits has no zyx equivalent"):
        zyx.from_dlpack(cap)
    assert capsule_name(cap) == "dltensor"  # a failed import leaves the capsule unconsumed
    managed_of(cap).dl_tensor.dtype.bits, managed_of(cap).dl_tensor.dtype.lanes = 32, 4
    with pytest.raises(BufferError, match="4 lanes"):
        zyx.from_dlpack(cap)
    del t, cap
    gc.collect()
    assert not alive(pool, bid)  # the destructor of the unconsumed capsule released it


def test_unsupported_devices():
    cap = np.arange(3.0).__dlpack__()
    managed_of(cap).dl_tensor.device.device_type = 7
    with pytest.raises(BufferError, match="kDLVulkan"):
        zyx.from_dlpack(cap)
    cap = np.arange(3.0).__dlpack__()
    managed_of(cap).dl_tensor.device.device_type = 2  # foreign CUDA memory
    with pytest.raises(BufferError, match=r"CUDA memory .*only from zyx.*t\.cpu\(\)"):
        zyx.from_dlpack(cap)
    t = zyx.Tensor([1.0])
    with pytest.raises(BufferError, match="kDLVulkan"):
        t.__dlpack__(dl_device=(7, 0))


def test_bad_export_arguments():
    t = zyx.Tensor([1.0])
    with pytest.raises(ValueError, match="stream must be None for a host tensor"):
        t.__dlpack__(stream=1)
    with pytest.raises(TypeError, match="max_version"):
        t.__dlpack__(max_version=1)
    with pytest.raises(TypeError, match="copy must be"):
        t.__dlpack__(copy="yes")
    assert t.__dlpack_device__() == (1, 0)


def test_bad_version():
    cap = zyx.Tensor([1.0]).__dlpack__(max_version=(1, 0))
    managed_of(cap).version.major = 2
    with pytest.raises(BufferError, match="version 2.0 is not supported"):
        zyx.from_dlpack(cap)


# ---- CUDA (the emulated driver when there is no GPU) ------------------------------------------------------------


def cuda_or_skip() -> str:
    if "cuda:0" not in registry().placements():
        pytest.skip("no cuda:0 (neither a GPU nor the emulated driver)")
    return "cuda:0"


@pytest.mark.cuda
def test_cuda_round_trip_is_the_same_buffer():
    dev = cuda_or_skip()
    t = zyx.Tensor(np.arange(5, dtype=np.float32), device=dev) * 3
    pool, bid = buffer_of(t)
    ordinal = pool.worker.ordinal
    assert t.__dlpack_device__() == (2, ordinal)
    cap = t.__dlpack__(stream=1)
    m = managed_of(cap)
    ptr, _ctx, events = pool.worker.export(bid)
    pool.worker.recycle_events(events)
    assert m.dl_tensor.data == ptr
    assert (m.dl_tensor.device.device_type, m.dl_tensor.device.device_id) == (2, ordinal)
    assert (m.dl_tensor.dtype.code, m.dl_tensor.dtype.bits) == (2, 32)
    del t
    gc.collect()
    assert alive(pool, bid)
    z = zyx.from_dlpack(cap)
    assert z.device == dev and z.cls.buffer.pool is pool and z.cls.buffer.id == bid
    np.testing.assert_array_equal(z.numpy(), np.arange(5, dtype=np.float32) * 3)
    del cap
    gc.collect()
    assert alive(pool, bid)  # z holds it
    del z
    gc.collect()
    assert not alive(pool, bid)


@pytest.mark.cuda
def test_cuda_export_to_cpu_consumers():
    dev = cuda_or_skip()
    t = zyx.Tensor(np.arange(4, dtype=np.float32), device=dev)
    pool, bid = buffer_of(t)
    with pytest.raises((BufferError, RuntimeError)):
        np.from_dlpack(t)  # NumPy refuses CUDA memory; the capsule is released
    assert wait_released_refs(pool, bid, 1)
    a = np.from_dlpack(t, device="cpu")  # dl_device=(kDLCPU, 0): zyx copies to the host
    np.testing.assert_array_equal(a, np.arange(4, dtype=np.float32))
    with pytest.raises(BufferError, match="needs a copy.*copy=False"):
        t.__dlpack__(dl_device=(1, 0), copy=False)
    with pytest.raises(ValueError, match="stream=0 is ambiguous"):
        t.__dlpack__(stream=0)
    h = zyx.Tensor([1.0, 2.0])
    c = zyx.from_dlpack(h.__dlpack__(dl_device=(2, pool.worker.ordinal)))
    assert c.device == dev and c.numpy().tolist() == [1.0, 2.0]


def wait_released_refs(pool, bid: int, count: int, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        gc.collect()
        if pool._refs.get(bid) == count:
            return True
        time.sleep(0.01)
    return False

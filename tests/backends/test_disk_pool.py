"""DiskPool: read-only buffers over one shared, reference-counted mapping per file."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from zyx.backends.base import BackendError, ErrorStatus
from zyx.backends.disk import DiskPool
from zyx.backends.host.pool import HostPool


@pytest.fixture
def data_file(tmp_path):
    data = np.arange(4096, dtype=np.uint8).astype(np.uint8)
    path = tmp_path / "blob.bin"
    path.write_bytes(data.tobytes())
    return str(path), data


def read(pool: DiskPool, bid: int) -> np.ndarray:
    out = np.empty(pool.nbytes(bid), np.uint8)
    pool.pool_to_host(bid, memoryview(out))
    return out


def test_buffers_share_one_mapping_and_unmap_with_the_last(data_file):
    path, data = data_file
    pool = DiskPool()
    a = pool.buffer(path, 0, 100)
    b = pool.buffer(path, 100, 50)
    assert pool.mapped_files() == 1 and pool.live_buffers() == 2
    np.testing.assert_array_equal(read(pool, a), data[:100])
    np.testing.assert_array_equal(read(pool, b), data[100:150])
    pool.retain(a)
    pool.release(a)
    pool.release(a)
    assert pool.live_buffers() == 1 and pool.mapped_files() == 1
    pool.release(b)
    assert pool.live_buffers() == 0 and pool.mapped_files() == 0
    with pytest.raises(BackendError):
        pool.nbytes(a)


def test_open_file_handle_holds_the_mapping(data_file):
    path, data = data_file
    pool = DiskPool()
    with pool.open_file(path) as fh:
        assert fh.size == data.size and fh.path == path
        assert fh.read(10, 5) == data[10:15].tobytes()
        assert fh.read(4090, 100) == data[4090:].tobytes()  # clipped at the end
        bid = pool.buffer(fh, 8, 16)
        assert pool.mapped_files() == 1
    assert pool.mapped_files() == 1  # the buffer still holds it
    np.testing.assert_array_equal(read(pool, bid), data[8:24])
    pool.release(bid)
    assert pool.mapped_files() == 0


def test_sub_buffer_is_a_narrower_range(data_file):
    path, data = data_file
    pool = DiskPool()
    a = pool.buffer(path, 1000, 1000)
    s = pool.sub_buffer(a, 10, 20)
    assert pool.location(s) == (path, 1010, 20)
    pool.release(a)  # the sub-buffer keeps the mapping
    np.testing.assert_array_equal(read(pool, s), data[1010:1030])
    with pytest.raises(BackendError, match="outside"):
        pool.sub_buffer(s, 10, 11)
    with pytest.raises(BackendError, match="outside"):
        pool.buffer(path, 4000, 97)
    pool.release(s)
    assert pool.mapped_files() == 0


def test_read_only_operations_refuse_with_a_fix(data_file):
    path, _ = data_file
    pool = DiskPool()
    bid = pool.buffer(path, 0, 8)
    for call in (lambda: pool.allocate(8), lambda: pool.host_to_pool(memoryview(bytearray(8)), bid),
                 lambda: pool.pool_to_pool(HostPool(), 1, bid)):
        with pytest.raises(BackendError, match="zyx.save") as e:
            call()
        assert e.value.status is ErrorStatus.UNSUPPORTED
    assert pool.free_bytes() == 0
    with pytest.raises(BackendError, match="asked 9 bytes"):
        pool.pool_to_host(bid, memoryview(bytearray(9)))


def test_copy_into_host_pool_lands_in_the_host_buffer(data_file):
    path, data = data_file
    disk, host = DiskPool(), HostPool()
    src = disk.buffer(path, 64, 256)
    dst = host.allocate(256)
    host.pool_to_pool(disk, src, dst)
    np.testing.assert_array_equal(host.view(dst), data[64:320])
    assert disk.bytes_read == 256 and disk.reads == 1


def test_replaced_file_gets_a_new_mapping(tmp_path):
    path = str(tmp_path / "f.bin")
    with open(path, "wb") as f:
        f.write(b"A" * 64)
    pool = DiskPool()
    old = pool.buffer(path, 0, 64)
    with open(path + ".new", "wb") as f:
        f.write(b"B" * 64)
    os.replace(path + ".new", path)
    new = pool.buffer(path, 0, 64)
    assert pool.mapped_files() == 2
    assert read(pool, old).tobytes() == b"A" * 64  # the old mapping still reads the old file
    assert read(pool, new).tobytes() == b"B" * 64


def test_empty_file_and_missing_file(tmp_path):
    path = tmp_path / "empty.bin"
    path.write_bytes(b"")
    pool = DiskPool()
    bid = pool.buffer(str(path), 0, 0)
    pool.pool_to_host(bid, memoryview(bytearray(0)))
    pool.release(bid)
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        pool.open_file(tmp_path / "nope.bin")


def test_concurrent_reads_and_releases(data_file):
    path, data = data_file
    pool = DiskPool()
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(200):
                off = int(rng.integers(0, 4000))
                n = int(rng.integers(0, 96))
                b = pool.buffer(path, off, n)
                s = pool.sub_buffer(b, 0, n // 2)
                pool.release(b)
                assert read(pool, s).tobytes() == data[off:off + n // 2].tobytes()
                pool.release(s)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert pool.live_buffers() == 0 and pool.mapped_files() == 0

"""Host pool and device: alignment, reference counts, the compiler cache, compile errors, OpenMP off."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from zyx.backends.base import BackendError, ErrorStatus
from zyx.backends.host.compiler import CCompiler, cache_dir
from zyx.backends.host.pool import HostPool


def test_pool_alignment_refcount_and_reuse():
    pool = HostPool()
    ids = [pool.allocate(n) for n in (1, 100, 4096, 0)]
    assert all(pool.address(i) % 64 == 0 for i in ids)
    assert pool.nbytes(ids[1]) == 100
    pool.retain(ids[1])
    pool.release(ids[1])
    assert pool.live_buffers() == 4  # still one reference
    pool.host_to_pool(memoryview(np.arange(25, dtype=np.float32)), ids[1])
    out = np.empty(25, np.float32)
    pool.pool_to_host(ids[1], memoryview(out.view(np.uint8)))
    np.testing.assert_array_equal(out, np.arange(25, dtype=np.float32))
    addr = pool.address(ids[2])
    pool.release(ids[2])
    again = pool.allocate(4096)
    assert pool.address(again) == addr  # the freed block is reused from the cache: no new pages
    for i in (ids[0], ids[1], ids[3], again):
        pool.release(i)
    assert pool.live_buffers() == 0


def test_a_wrapped_buffers_release_callback_may_use_the_pool():
    """``on_release`` runs outside the pool's lock: a callback that allocates or releases does not deadlock."""
    pool = HostPool()
    inner = pool.allocate(64)
    memory = np.zeros(16, np.float32)
    wrapped = pool.wrap(memory, lambda: (pool.release(inner), pool.release(pool.allocate(32))))
    assert pool.address(wrapped) == memory.ctypes.data
    pool.release(wrapped)
    assert pool.live_buffers() == 0


def test_mapped_file_memory_is_imported_in_place_only_when_aligned(tmp_path):
    """A disk buffer whose bytes start on a 64-byte boundary is read in place; one that does not (a
    safetensors tensor after an odd-sized header) is copied into aligned memory."""
    from zyx.backends.disk.pool import DiskPool

    path = tmp_path / "data.bin"
    np.arange(64, dtype=np.float32).tofile(path)
    disk, host = DiskPool(), HostPool()
    aligned, shifted = disk.buffer(path, 0, 64), disk.buffer(path, 24, 64)
    a = host.import_buffer(disk, aligned)
    assert a is not None and host.address(a) % 64 == 0
    assert host.import_buffer(disk, shifted) is None
    host.release(a)
    disk.release(aligned)
    disk.release(shifted)


def test_compile_error_names_log_and_source(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cc = CCompiler("cc")
    with pytest.raises(BackendError) as e:
        cc.compile("void broken(void) { this is not C; }\n", "broken")
    assert e.value.status is ErrorStatus.COMPILATION
    assert "kernel broken" in e.value.context and "error" in e.value.context
    assert str(tmp_path / "zyx" / "host") in e.value.context  # the path of the source to look at


def test_libraries_are_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    src = "int answer(void) { return 42; }\n"
    CCompiler("cc").compile(src, "answer")
    libs = list((cache_dir() / "host").glob("*.so"))
    assert len(libs) == 1
    mtime = libs[0].stat().st_mtime_ns
    assert CCompiler("cc").compile(src, "answer").answer() == 42
    assert libs[0].stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert CCompiler("cc", openmp=False).flags != CCompiler("cc").flags or not CCompiler("cc").openmp


def test_kernels_include_the_prelude_precompiled_once_and_errors_keep_their_line(tmp_path, monkeypatch):
    from zyx.kernel.render import CRenderer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prelude = CRenderer().prelude()
    cc = CCompiler("cc", prelude=prelude)
    lib = cc.compile(prelude + "\nint twice(int x) { return 2 * zyx_f2i_int32((double)x); }\n", "twice")
    assert lib.twice(21) == 42
    (c,) = (tmp_path / "zyx" / "host").glob("*.c")
    assert c.read_text().startswith('#include "zyx_prelude.h"') and prelude not in c.read_text()
    assert (cc._prelude_header.parent / "zyx_prelude.h.gch").exists()  # gcc here: built once, used by each compile
    line = prelude.count("\n") + 2
    with pytest.raises(BackendError, match=f":{line}:"):  # the line of the whole source
        cc.compile(prelude + "\nint broken(void) { this is not C; }\n", "broken")


def test_simd_width_comes_from_the_compilers_target_macros_and_reaches_the_device_info(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    r = subprocess.run(["cc", "-march=native", "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True)
    avx512, avx = "#define __AVX512F__ 1" in r.stdout, "#define __AVX__ 1" in r.stdout
    got = CCompiler("cc").simd
    assert got == CCompiler("cc").simd  # the second answer from the disk marker
    assert len(list((tmp_path / "zyx" / "host").glob("simd-*"))) == 1
    if avx512:
        assert got in ((64, 32), (32, 32))
    elif avx:
        assert got == (32, 16)
    else:
        assert got[0] == 16
    from zyx.backends.registry import registry
    info = registry().get("host").primary.info()
    assert (info.vector_bytes, info.vector_registers) == registry().get("host").primary.compiler.simd


def test_missing_compiler_is_an_initialization_error():
    with pytest.raises(BackendError, match="not found on PATH") as e:
        CCompiler("definitely-not-a-compiler")
    assert e.value.status is ErrorStatus.INITIALIZATION


def _fresh_host(tmp_path, monkeypatch):
    """A host device of its own (empty program table) on an empty compile cache."""
    from zyx.backends.host.device import HostDevice

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return HostDevice(HostPool())


def _three_kernels() -> list:
    from conftest import kernels_of

    import zyx

    x = zyx.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    return [kernels_of(t)[0] for t in (x.sum(0), x.exp().max(1), (x * 3 - 1).abs())]


def test_compile_many_builds_missing_libraries_concurrently_and_equals_compile(tmp_path, monkeypatch):
    import threading
    import time

    kernels = _three_kernels()  # (planning them compiles them in the usual cache)
    dev = _fresh_host(tmp_path, monkeypatch)
    live, most, lock = [0], [0], threading.Lock()
    build = dev.compiler.build

    def slow_build(source, name):
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        time.sleep(0.2)  # long enough for the others to start
        try:
            return build(source, name)
        finally:
            with lock:
                live[0] -= 1

    monkeypatch.setattr(dev.compiler, "build", slow_build)
    dev.threads = 3
    pids = dev.compile_many(kernels)
    assert most[0] == 3 and len(set(pids)) == 3
    assert [dev.compile(k) for k in kernels] == pids  # the same programs, nothing rebuilt
    assert len(list((tmp_path / "zyx" / "host").glob("*.so"))) == 3


def test_compile_many_raises_the_first_failing_kernels_error(tmp_path, monkeypatch):
    kernels = _three_kernels()
    dev = _fresh_host(tmp_path, monkeypatch)
    bad = kernels[1].name
    build = dev.compiler.build

    def failing(source, name):
        if name == bad:
            raise BackendError(ErrorStatus.COMPILATION, f"cc failed on kernel {name}")
        return build(source, name)

    monkeypatch.setattr(dev.compiler, "build", failing)
    with pytest.raises(BackendError, match=f"kernel {bad}"):
        dev.compile_many(kernels)


def test_openmp_off_still_computes(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"host": {"openmp": False}}))
    code = ("import numpy as np, zyx\n"
            "x = zyx.Tensor(np.arange(200000, dtype=np.float32))\n"
            "print(float((x * 2).sum().item()), zyx.registry().get('host').primary.compiler.flags)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={"ZYX_CONFIG": str(cfg), "PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    total, flags = out.stdout.split(" ", 1)
    assert float(total) == pytest.approx(2 * 199999 * 200000 / 2, rel=1e-5)
    assert "-fopenmp" not in flags

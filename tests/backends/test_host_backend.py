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


def _count_compiles(monkeypatch) -> dict[str, int]:
    """Counts of the host compiler's processes: compiles (``-c``; those of generated kernels apart), links by the
    linker alone, links by the driver."""
    from zyx.backends.host import compiler

    counts = {"compile": 0, "kernels compile": 0, "ld": 0, "driver link": 0}
    run = subprocess.run

    def counted(args, **kw):
        if "-c" in args:
            counts["compile"] += 1
            with open(args[args.index("-c") + 1]) as f:
                counts["kernels compile"] += f.readline().startswith('#include "zyx_prelude.h"')
        elif args[0] == compiler.linker_of(compiler.CCompiler("cc").cc):
            counts["ld"] += 1
        elif any(str(a).endswith(".o") for a in args):
            counts["driver link"] += 1
        return run(args, **kw)

    monkeypatch.setattr(compiler.subprocess, "run", counted)
    return counts


def test_one_realize_compiles_its_kernels_in_one_process_per_thread_and_computes_the_same(tmp_path, monkeypatch):
    from conftest import registry_with

    import zyx

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    with registry_with(tmp_path, {"host": {"threads": 1}}):
        t = zyx.Tensor(x)
        outs = [t.sum(0), t.exp().max(1), (t * 3 - 1).abs(), (t - t.mean(1, keepdim=True)).sum(1)]
        counts = _count_compiles(monkeypatch)
        zyx.realize(*outs)
        got = [o.numpy() for o in outs]
    inodes = [lib.stat().st_ino for lib in (tmp_path / "zyx" / "host").glob("*.so")]
    assert max(inodes.count(i) for i in inodes) == 3  # the three kernels: one library, hard-linked per source
    assert counts["kernels compile"] == 1 and counts["driver link"] == 0  # (and the BLAS glue, compiled alone)
    want = [x.sum(0), np.exp(x).max(1), np.abs(x * 3 - 1), (x - x.mean(1, keepdims=True)).sum(1)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-5)


def _disassembly(lib, name: str) -> list[str]:
    """The instructions of function ``name`` in ``lib``, with addresses, rip offsets and trailing padding blanked."""
    import re

    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True).stdout
    body = re.search(rf"^[0-9a-f]+ <{name}>:\n(.*?)(?:\n\n|\Z)", out, re.S | re.M).group(1)
    ins = [line.split(":", 1)[1].split("#")[0].strip() for line in body.splitlines() if ":" in line]
    ins = [re.sub(r"-?0x[0-9a-f]+\(%rip\)|\b[0-9a-f]{3,}\b|<[^>]*>", "A", i) for i in ins]
    while ins and ("nop" in ins[-1] or ins[-1].startswith("xchg   %ax,%ax")):
        ins.pop()
    return ins


@pytest.mark.skipif(subprocess.run(["which", "objdump"], capture_output=True).returncode != 0,
                    reason="needs objdump (binutils)")
def test_a_batched_kernel_is_the_machine_code_of_the_kernel_built_alone(tmp_path, monkeypatch):
    from zyx.backends.host.device import HostDevice

    kernels = _three_kernels()
    dev = _fresh_host(tmp_path, monkeypatch)
    sources = [dev.render(k) for k in kernels]
    dev.compiler.build_many([(s, k.name) for s, k in zip(sources, kernels)], 1)
    batched = [dev.compiler.library_path(s) for s in sources]
    assert len({p.stat().st_ino for p in batched}) == 1
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "alone"))
    alone = HostDevice(HostPool()).compiler
    for s, k, lib in zip(sources, kernels, batched):
        assert _disassembly(alone.build(s, k.name), k.name) == _disassembly(lib, k.name)


def test_a_batch_with_a_broken_kernel_builds_the_others_and_the_broken_one_raises_its_own_error(tmp_path,
                                                                                                  monkeypatch):
    from zyx.kernel.render import CRenderer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    prelude = CRenderer().prelude()
    cc = CCompiler("cc", prelude=prelude)
    good = [(prelude + f"\nint twice{i}(int x) {{ return {i} * x; }}\n", f"twice{i}") for i in (2, 3)]
    broken = (prelude + "\nint broken(void) { this is not C; }\n", "broken")
    counts = _count_compiles(monkeypatch)
    cc.build_many([good[0], broken, good[1]], 1)
    assert counts["compile"] == 4  # the batch, then each alone
    assert [cc.library_path(s).exists() for s, _ in (good[0], broken, good[1])] == [True, False, True]
    assert cc.compile(*good[1]).twice3(7) == 21
    with pytest.raises(BackendError, match=f"(?s)kernel broken .*:{prelude.count(chr(10)) + 2}:"):
        cc.compile(*broken)


def test_batches_are_balanced_and_never_hold_one_name_twice():
    from zyx.backends.host.compiler import _batches

    items = [("x" * n, name) for n, name in [(50, "a"), (40, "k"), (30, "k"), (20, "k"), (10, "b"), (5, "c")]]
    two = _batches(items, 2)
    assert len(two) == 3  # three kernels named k
    assert sorted(it for b in two for it in b) == sorted(items)
    assert all(len({name for _, name in b}) == len(b) for b in two)
    assert [len(b) for b in _batches(items[:2], 4)] == [1, 1]  # never more batches than kernels
    one = _batches([it for it in items if it[1] != "k"], 1)
    assert len(one) == 1 and len(one[0]) == 3


def test_libraries_link_without_the_driver_and_through_it_where_the_linker_alone_fails(tmp_path, monkeypatch):
    from zyx.backends.host import compiler

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    src = ("#include <omp.h>\nint team(void) { int n = 0;\n#pragma omp parallel\n"
           "{\n#pragma omp single\nn = omp_get_num_threads(); }\nreturn n; }\n")
    counts = _count_compiles(monkeypatch)
    assert CCompiler("cc").compile(src, "team").team() >= 1
    assert counts == {"compile": 1, "kernels compile": 0, "ld": 1, "driver link": 0}
    monkeypatch.setattr(compiler, "link_directly", lambda *a: False)
    assert CCompiler("cc").compile(src.replace("team", "team2"), "team2").team2() >= 1
    assert counts == {"compile": 2, "kernels compile": 0, "ld": 1, "driver link": 1}

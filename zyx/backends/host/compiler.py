"""The system C compiler: probe once, compile shared libraries, cache them on disk.

Cache key: the rendered source, the compiler's resolved path and version line, and the flags; the library
lives at ``$XDG_CACHE_HOME/zyx/host/<key>.so`` (or ``~/.cache/zyx``), written atomically.

Prelude: a source that starts with the compiler's ``prelude`` (the renderer's helpers, the same for every kernel)
is compiled as ``#include`` of that prelude, written once as a header beside its precompiled form (``.gch``, built
once per prelude, compiler and flags); the machine code is the same, each compile ~15% faster (59 kernels: 3.05-3.26
vs 3.75 s). Where the compiler cannot use the ``.gch`` (another compiler, other flags) it reads the header.

Linking: a library is compiled to an object (``-c``), then linked by the linker alone against the compiler's
libgomp and libgcc (``link_directly``: no crt files, no collect2, its libc and libm symbols resolved from the
Python process when it loads; ~5 ms against ~24 through the driver). A library the linker alone cannot make, or
that does not load, is linked through the driver instead, and so is every later one of that compiler.

Batches: ``build_many`` compiles several kernels that follow the prelude as one translation unit, one library
(each source's cache path a hard link to it): one compiler start, header load and link for the batch instead of
one per kernel. 40 kernels of the test suite, one process: 1.35-1.48 s against 2.50-2.55 s one by one (2.81-3.04 s
linked through the driver); two processes: 0.69-0.72 s. Each kernel is one external function and compiles as it
does alone: the same instructions for 299 of 300 suite kernels compared (objdump; alignment padding aside), the
other loading its constants, from the batch's shared pool, into other registers.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from pathlib import Path

from zyx.backends.base import BackendError, ErrorStatus
from zyx.utils import cache_dir, write_atomic

# -ffp-contract=off: a * b + c rounds twice, as NumPy computes it (reductions use fma explicitly). -pipe: no
# temporary files between the compiler's stages (about 10% of a small kernel's compile)
BASE_FLAGS = ("-pipe", "-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-fwrapv", "-fno-math-errno",
              "-fno-strict-aliasing", "-ffp-contract=off")
# -Bsymbolic: a library's own symbols bind to themselves, not to a same-named one an earlier library made global
LD_FLAGS = ("-shared", "-Bsymbolic", "--eh-frame-hdr")


class CCompiler:
    """One configured compiler. Raises BackendError(INITIALIZATION) when it cannot be used."""

    def __init__(self, cc: str = "cc", openmp: bool = True, prelude: str = "") -> None:
        self.prelude = prelude
        path = shutil.which(cc)
        if path is None:
            raise BackendError(ErrorStatus.INITIALIZATION,
                               f"C compiler {cc!r} not found on PATH; install gcc or clang, or set host.cc in the "
                               "zyx config file")
        self.cc = os.path.realpath(path)
        self.want_openmp = openmp
        self._link_alone = True  # until the linker alone fails once (``_link``)

    @cached_property
    def version(self) -> str:
        try:
            out = subprocess.run([self.cc, "--version"], capture_output=True, text=True, timeout=30)
        except OSError as e:
            raise BackendError(ErrorStatus.INITIALIZATION, f"cannot run {self.cc}: {e}") from e
        return (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else "unknown"

    @cached_property
    def openmp(self) -> bool:
        """Whether ``-fopenmp`` compiles and links here (probed once, result cached on disk)."""
        if not self.want_openmp:
            return False
        key = hashlib.sha256(f"omp|{self.cc}|{self.version}".encode()).hexdigest()[:20]
        marker = cache_dir() / "host" / f"omp-{key}"
        if marker.exists():
            return marker.read_text() == "1"
        src = "#include <omp.h>\nint f(void){int n=0;\n#pragma omp parallel\n{n=omp_get_num_threads();}\nreturn n;}\n"
        with tempfile.TemporaryDirectory() as d:
            c = Path(d) / "t.c"
            c.write_text(src)
            r = subprocess.run([self.cc, "-fopenmp", "-shared", "-fPIC", str(c), "-o", str(Path(d) / "t.so")],
                               capture_output=True, text=True)
            ok = r.returncode == 0
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text("1" if ok else "0")
        return ok

    @cached_property
    def simd(self) -> tuple[int, int]:
        """(bytes, count) of the vector registers code compiled with ``-march=native`` may use, from the compiler's
        own target macros (probed once, cached on disk): AVX-512 (64, 32; clang (32, 32), as it is not asked for
        512-bit vectors), AVX/AVX2 (32, 16), NEON (16, 32), SSE2 and anything else (16, 16)."""
        key = hashlib.sha256(f"simd|{self.cc}|{self.version}|{platform.machine()}|{_cpu_flags()}".encode())
        marker = cache_dir() / "host" / f"simd-{key.hexdigest()[:20]}"
        if marker.exists():
            try:
                b, n = map(int, marker.read_text().split())
                return b, n
            except ValueError:
                pass
        r = subprocess.run([self.cc, "-march=native", "-dM", "-E", "-x", "c", os.devnull], capture_output=True,
                           text=True)
        macros = set(line.split()[1] for line in r.stdout.splitlines() if line.startswith("#define "))
        if "__AVX512F__" in macros:  # 512-bit only where render's ZYX_GEMM_ATTR can ask for it (gcc)
            out = (32, 32) if "__clang__" in macros else (64, 32)
        elif "__AVX__" in macros:
            out = (32, 16)
        elif "__ARM_NEON" in macros or "__aarch64__" in macros:
            out = (16, 32)
        else:
            out = (16, 16)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{out[0]} {out[1]}")
        return out

    @property
    def flags(self) -> tuple[str, ...]:
        return BASE_FLAGS + (("-fopenmp",) if self.openmp else ())

    def library_path(self, source: str) -> Path:
        """Where the shared library of ``source`` is cached (it may not exist yet)."""
        key = hashlib.sha256("\0".join((source, self.cc, self.version, " ".join(self.flags),
                                        platform.machine())).encode()).hexdigest()[:32]
        return cache_dir() / "host" / f"{key}.so"

    def compile(self, source: str, name: str) -> ctypes.CDLL:
        """Compile ``source`` into a shared library (or take it from the disk cache) and load it."""
        return ctypes.CDLL(str(self.build(source, name)))

    def build(self, source: str, name: str) -> Path:
        """The shared library of ``source`` on disk, compiled when missing (safe to call from several threads and
        processes at once: each writes its own temporary file and renames it into place)."""
        lib = self.library_path(source)
        if not lib.exists():
            body, include = self._translation_unit([source])
            src = lib.with_suffix(".c")
            write_atomic(src, body)  # whole, for a compiler another thread or process runs on the same source
            tmp = self._link(self._object(src, include, f"kernel {name}"), f"kernel {name}", src)
            os.replace(tmp, lib)
        return lib

    def build_many(self, items: Sequence[tuple[str, str]], processes: int) -> None:
        """Build the missing libraries of the ``(source, name)`` items, at most ``processes`` compilers at once.
        Sources that follow the prelude share batches (``_batches``); the rest build alone. Raises nothing: a
        library that fails to build stays missing, and ``build`` raises its error for its own kernel."""
        items = [it for it in dict(items).items() if not self.library_path(it[0]).exists()]
        if not items:
            return
        batched = [it for it in items if self._follows_prelude(it[0])]
        jobs = [[it] for it in items if not self._follows_prelude(it[0])] + _batches(batched, max(1, processes))
        if len(jobs) == 1:
            self._build_batch(jobs[0])
            return
        with ThreadPoolExecutor(min(len(jobs), max(1, processes))) as pool:
            list(pool.map(self._build_batch, jobs))

    def _build_batch(self, items: list[tuple[str, str]]) -> None:
        """One library for all ``items`` (hard-linked at each one's cache path); where the compiler rejects the
        batch, each item built alone. Errors stay unraised (``build_many``)."""
        if len(items) > 1:
            try:
                self._build_together(items)
                return
            except BackendError:
                pass
        for item in items:
            try:
                self.build(*item)
            except BackendError:
                pass

    def _build_together(self, items: list[tuple[str, str]]) -> None:
        """Compile ``items`` as one translation unit and place the library at each one's cache path."""
        body, include = self._translation_unit([source for source, _ in items])
        first = self.library_path(items[0][0])
        first.parent.mkdir(parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(suffix=".c", prefix=f"{first.stem}-batch-", dir=first.parent)
        with os.fdopen(fd, "w") as f:
            f.write(body)
        src = Path(path)
        what = f"kernels {', '.join(name for _, name in items)}"
        try:
            tmp = self._link(self._object(src, include, what), what, src)
        finally:
            src.unlink()
        try:
            for source, _ in items:
                _place_copy(tmp, self.library_path(source))
        finally:
            os.unlink(tmp)

    def _translation_unit(self, sources: Sequence[str]) -> tuple[str, list[str]]:
        """What the compiler reads for ``sources`` (one, or several that follow the prelude) and the include flags:
        the prelude as its header where it leads, each body after it under the line numbers of its own source."""
        if not all(map(self._follows_prelude, sources)):
            assert len(sources) == 1, "only sources that follow the prelude share a translation unit"
            return sources[0], []
        header = self._prelude_header
        lines = self.prelude.count("\n")
        bodies = "\n".join(f"#line {lines + 1}\n{s[len(self.prelude):]}" for s in sources)
        return f'#include "{header.name}"\n{bodies}', ["-I", str(header.parent)]

    def _follows_prelude(self, source: str) -> bool:
        return bool(self.prelude) and source.startswith(self.prelude)

    def _object(self, src: Path, include: Sequence[str], what: str) -> str:
        """Compile ``src`` to an object file beside it (a fresh temporary name); returns its path."""
        fd, obj = tempfile.mkstemp(suffix=".o", dir=src.parent)
        os.close(fd)
        flags = [f for f in self.flags if f != "-shared"]
        r = subprocess.run([self.cc, *flags, *include, "-c", str(src), "-o", obj], capture_output=True, text=True)
        if r.returncode != 0:
            _remove(obj)
            raise BackendError(ErrorStatus.COMPILATION, f"{self.cc} failed on {what} (source: {src}):\n"
                               f"{r.stderr.strip()}")
        return obj

    def _link(self, obj: str, what: str, src: Path) -> str:
        """Link (and remove) the object ``obj`` into a shared library at a fresh temporary path; returns that path."""
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(obj))
        os.close(fd)
        try:
            if not (self._link_alone and link_directly(linker_of(self.cc), obj, tmp, self._libraries)):
                r = subprocess.run([self.cc, *self.flags, "-Wl,-Bsymbolic", obj, "-o", tmp, "-lm"],
                                   capture_output=True, text=True)
                if r.returncode != 0:
                    raise BackendError(ErrorStatus.COMPILATION, f"{self.cc} could not link {what} (source: {src}):"
                                       f"\n{r.stderr.strip()}")
                self._link_alone = False  # the driver links what the linker alone did not: no more tries
        except BaseException:
            _remove(tmp)
            raise
        finally:
            _remove(obj)
        return tmp

    @cached_property
    def _libraries(self) -> tuple[str, ...]:
        """What the linker alone links a library against, as paths: libgomp with OpenMP (which the Python process
        does not have), libgcc (the compiler's helper routines; static). libc and libm are left to the process
        (reading them doubles the link time); those the compiler does not know are left out."""
        found = ([_ask(self.cc, "-print-file-name=libgomp.so")] if self.openmp else []) + \
            [_ask(self.cc, "-print-libgcc-file-name")]
        return tuple(p for p in found if p and os.path.isabs(p) and os.path.exists(p))

    @cached_property
    def _prelude_header(self) -> Path:
        """The prelude as a header on disk, with its precompiled form beside it where the compiler makes one."""
        key = hashlib.sha256("\0".join((self.prelude, self.cc, self.version, " ".join(self.flags),
                                         platform.machine(), _cpu_flags())).encode()).hexdigest()[:24]
        d = cache_dir() / "host" / f"prelude-{key}"
        h = d / "zyx_prelude.h"
        if not h.exists():
            d.mkdir(parents=True, exist_ok=True)
            write_atomic(h, self.prelude)
        precompile_header(self.cc, self.flags, h, "c-header")
        return h


def precompile_header(cc: str, flags: Sequence[str], header: Path, language: str) -> None:
    """Build ``<header>.gch`` beside ``header`` unless it exists (written atomically; left absent when ``cc``
    cannot). gcc uses it for every ``#include`` of the header compiled with matching ``flags``."""
    gch = header.with_name(header.name + ".gch")
    if gch.exists():
        return
    fd, tmp = tempfile.mkstemp(suffix=".gch", dir=header.parent)
    os.close(fd)
    try:
        args = [f for f in flags if f != "-shared"]
        if subprocess.run([cc, *args, "-x", language, str(header), "-o", tmp], capture_output=True).returncode == 0:
            os.replace(tmp, gch)
    finally:
        _remove(tmp)


def _batches(items: list[tuple[str, str]], processes: int) -> list[list[tuple[str, str]]]:
    """``items`` split into as many batches as ``processes`` (more where one kernel name repeats more often: names
    are symbols, unique within a library), longest sources first onto the lightest batch."""
    repeats = max((sum(1 for _, n in items if n == name) for _, name in items), default=1)
    batches: list[list[tuple[str, str]]] = [[] for _ in range(min(len(items), max(processes, repeats)))]
    sizes = [0] * len(batches)
    for item in sorted(items, key=lambda it: -len(it[0])):
        free = [b for b in range(len(batches)) if all(n != item[1] for _, n in batches[b])]
        b = min(free, key=sizes.__getitem__)
        batches[b].append(item)
        sizes[b] += len(item[0])
    return [b for b in batches if b]


def _place_copy(library: str, path: Path) -> None:
    """Put ``library`` at ``path`` atomically: a hard link, or a copy where the file system has none."""
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    os.unlink(tmp)
    try:
        os.link(library, tmp)
    except OSError:
        shutil.copyfile(library, tmp)
    os.replace(tmp, path)


def _remove(path: str) -> None:
    """Delete ``path`` if it is there (a compiler or linker deletes its output when it fails)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _ask(cc: str, option: str) -> str:
    """The compiler's answer to a ``-print-*`` option ("" when it has none)."""
    try:
        r = subprocess.run([cc, option], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


@functools.cache
def linker_of(cc: str) -> str | None:
    """The linker the compiler driver ``cc`` runs, as a path (None: not found)."""
    name = _ask(cc, "-print-prog-name=ld")
    return shutil.which(name) if name else None


def link_directly(ld: str | None, obj: str, out: str, libraries: Sequence[str] = ()) -> bool:
    """Link ``obj`` into the shared library ``out`` with the linker ``ld`` alone (``LD_FLAGS``, then
    ``libraries``); whether that worked and the library loads (RTLD_NOW: every symbol resolves, from
    ``libraries`` or the Python process)."""
    if ld is None or subprocess.run([ld, *LD_FLAGS, obj, "-o", out, *libraries], capture_output=True).returncode:
        return False
    try:
        ctypes.CDLL(out)
    except OSError:
        return False
    return True


def _cpu_flags() -> str:
    """The CPU's feature flags line (Linux), so a cache copied to another machine is probed again."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""

"""The system C compiler: probe once, compile shared libraries, cache them on disk.

Cache key: the rendered source, the compiler's resolved path and version line, and the flags; the library
lives at ``$XDG_CACHE_HOME/zyx/host/<key>.so`` (or ``~/.cache/zyx``), written atomically.

Prelude: a source that starts with the compiler's ``prelude`` (the renderer's helpers, the same for every kernel)
is compiled as ``#include`` of that prelude, written once as a header beside its precompiled form (``.gch``, built
once per prelude, compiler and flags); the machine code is the same, each compile ~15% faster (59 kernels: 3.05-3.26
vs 3.75 s). Where the compiler cannot use the ``.gch`` (another compiler, other flags) it reads the header.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

from zyx.backends.base import BackendError, ErrorStatus
from zyx.utils import cache_dir, write_atomic

# -ffp-contract=off: a * b + c rounds twice, as NumPy computes it (reductions use fma explicitly). -pipe: no
# temporary files between the compiler's stages (about 10% of a small kernel's compile)
BASE_FLAGS = ("-pipe", "-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-fwrapv", "-fno-math-errno",
              "-fno-strict-aliasing", "-ffp-contract=off")


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
        d = lib.parent
        key = lib.stem
        if not lib.exists():
            d.mkdir(parents=True, exist_ok=True)
            src = d / f"{key}.c"
            include: list[str] = []
            if self.prelude and source.startswith(self.prelude):
                header = self._prelude_header
                include = ["-I", str(header.parent)]
                lines = self.prelude.count("\n")
                source = f'#include "{header.name}"\n#line {lines + 1}\n{source[len(self.prelude):]}'
            write_atomic(src, source)  # whole, for a compiler another thread or process runs on the same source
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
            os.close(fd)
            r = subprocess.run([self.cc, *self.flags, *include, str(src), "-o", tmp, "-lm"], capture_output=True,
                               text=True)
            if r.returncode != 0:
                os.unlink(tmp)
                raise BackendError(ErrorStatus.COMPILATION,
                                   f"{self.cc} failed on kernel {name} (source: {src}):\n{r.stderr.strip()}")
            os.replace(tmp, lib)
        return lib

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
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cpu_flags() -> str:
    """The CPU's feature flags line (Linux), so a cache copied to another machine is probed again."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""

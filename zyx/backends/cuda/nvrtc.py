"""NVRTC: CUDA C source → CUBIN for one exact GPU architecture, cached on disk. Needs no GPU and no driver.

Invariants:
- Always a CUBIN (SASS) for the exact ``sm_XY`` of the device, never PTX: PTX from a newer NVRTC is refused by
  an older driver, while SASS from a newer 13.x toolkit loads on a 13.0 driver. ``compute_XY`` targets are
  rejected (NVRTC would produce no cubin).
- cuda-python is imported lazily: importing this module never fails; ``available()`` says what is missing.
- Cache: ``<cache_dir>/cuda/<key>.cubin`` with ``key`` = sha256 of (source, NVRTC version, options, arch),
  written atomically (temporary file + ``os.replace``); only successful compiles are cached.
- Headers: when the source has an ``#include``, NVRTC's bundled headers (``cuda_fp16.h``, ``cuda_bf16.h``, ...)
  are installed once per NVRTC version under ``<cache_dir>/cuda/headers-<major>.<minor>`` and passed with ``-I``.
- Failure: ``BackendError(COMPILATION)`` with the NVRTC log and the path of the source, written next to the
  cache so a person can reproduce it.
- ``source_of(cubin)``: the CUDA C of every cubin ``compile_cubin`` handed out in this process (by content hash),
  for diagnostics and for the emulated driver, which runs the source a cubin was compiled from.
- ``check_batch`` (CI: does every generated kernel compile?) leaves an empty marker per (source, options, arch)
  under ``<cache_dir>/cuda/checked`` and never caches a cubin for the batch; so does every compile at the lowest
  optimization effort (``optimize=False``: for a driver that runs the source, not the cubin's machine code).
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from pathlib import Path

from zyx.backends.base import BackendError, ErrorStatus
from zyx.utils import cache_dir, write_atomic

INSTALL_HINT = "pip install 'zyx[cuda]'"
BASE_OPTIONS = ("--std=c++17", "--fmad=false")  # no contraction: elementwise results round as the host's
_ARCH = re.compile(r"^(?:sm_)?(\d{2,3}[a-z]?)$")
# Where this NVRTC has them (each probed once per architecture on an empty kernel; older ones reject them):
# - LEAN_OPTIONS, for every source without an ``#include``: ``--minimal`` (NVRTC 12.4+) leaves out the declarations
#   of the CUDA runtime API, textures and device-side launches, which generated kernels never use. The cubins are
#   the same (616 of 616 generated kernels, sm_80 and sm_90, NVRTC 13.5), compiled 15% faster (36 vs 42 ms each).
# - FAST_OPTIONS, where the machine code is never executed (``check_batch``; ``compile_cubin(optimize=False)`` for
#   the emulated driver): the whole pipeline (front end, NVVM, ptxas: inline PTX is assembled) at its lowest
#   optimization effort (NVRTC 12.8+), 5x faster for a batch (64 kernels: 0.46 s instead of 2.5 s, NVRTC 13.5),
#   30% faster alone.
LEAN_OPTIONS = ("--minimal",)
FAST_OPTIONS = ("--Ofast-compile=max",)
FRONT_END_OPTIONS = ("-fdevice-syntax-only",)  # ``check_batch(front_end=True)``: NVRTC's front end only
_PROBE = 'extern "C" __global__ void zyx_probe() {}'


def _nvrtc():
    from cuda.bindings import nvrtc  # lazy: optional dependency

    return nvrtc


@functools.cache
def available() -> str | None:
    """None when NVRTC can compile here, else the reason (with how to fix it)."""
    try:
        nvrtc = _nvrtc()
    except ImportError as e:
        return f"cuda-python is not installed ({e}): {INSTALL_HINT}"
    try:
        err, *_ = nvrtc.nvrtcVersion()
    except (OSError, RuntimeError) as e:  # cuda.pathfinder raises a RuntimeError subclass without libnvrtc
        return f"libnvrtc cannot be loaded ({e}): {INSTALL_HINT}"
    if err:
        return f"nvrtcVersion failed ({err!r}): {INSTALL_HINT}"
    return None


def _require() -> None:
    reason = available()
    if reason is not None:
        raise BackendError(ErrorStatus.INITIALIZATION, f"NVRTC unavailable: {reason}")


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the loaded NVRTC."""
    _require()
    err, major, minor = _nvrtc().nvrtcVersion()
    _check(err, "nvrtcVersion")
    return int(major), int(minor)


def normalize_arch(arch: str) -> str:
    """``"sm_90"``, ``"90"`` or ``"sm_90a"`` → ``"sm_90"`` / ``"sm_90a"``; anything else is an error."""
    m = _ARCH.match(arch.strip())
    if m is None:
        raise BackendError(ErrorStatus.COMPILATION, f"bad GPU architecture {arch!r}: expected 'sm_XY' such as "
                           "'sm_90' (a cubin needs an exact sm, compute_XY gives none)")
    return f"sm_{m.group(1)}"


def _check(err, what: str) -> None:
    if err:
        nvrtc = _nvrtc()
        _, msg = nvrtc.nvrtcGetErrorString(err)
        raise BackendError(ErrorStatus.COMPILATION, f"{what} failed: {msg.decode(errors='replace')}")


def _cuda_cache() -> Path:
    return cache_dir() / "cuda"


@functools.cache
def header_dir() -> Path:
    """Directory with ``cuda_fp16.h`` and friends: NVRTC's bundled headers, extracted once per NVRTC version
    (NVRTC skips an up-to-date copy and locks against concurrent installs); the CUDA toolkit's headers
    (``cuda.pathfinder``) when this NVRTC cannot extract its own."""
    major, minor = nvrtc_version()
    d = _cuda_cache() / f"headers-{major}.{minor}"
    nvrtc = _nvrtc()
    install = getattr(nvrtc, "nvrtcInstallBundledHeaders", None)
    if install is not None:
        d.mkdir(parents=True, exist_ok=True)
        (err, *_) = install(str(d).encode(), int(getattr(nvrtc, "NVRTC_INSTALL_HEADERS_SKIP_IF_EXISTS", 0)))
        if not err:
            return d
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudart")
    except (ImportError, RuntimeError):
        found = None
    if found is None:
        raise BackendError(ErrorStatus.COMPILATION, "no CUDA headers for NVRTC: this NVRTC cannot install its "
                           f"bundled headers and no CUDA toolkit was found; {INSTALL_HINT}")
    return Path(found)


def options(source: str, arch: str, optimize: bool = True) -> list[str]:
    """NVRTC options for ``source`` on ``arch`` (include path only when the source includes something; at the
    lowest optimization effort unless ``optimize``)."""
    arch = normalize_arch(arch)
    opts = [f"--gpu-architecture={arch}", *BASE_OPTIONS]
    if "#include" in source:
        hd = header_dir()
        opts += [f"-I{hd}"] + ([f"-I{hd / 'cccl'}"] if (hd / "cccl").is_dir() else [])
    else:
        opts += _supported(LEAN_OPTIONS, arch)
    if not optimize:
        opts += _supported(FAST_OPTIONS, arch)
    return opts


@functools.cache
def _supported(opts: tuple[str, ...], arch: str) -> tuple[str, ...]:
    """``opts`` when this NVRTC compiles an empty kernel for ``arch`` with them, else none of them."""
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(_PROBE.encode(), b"zyx_probe.cu", 0, [], [])
    _check(err, "nvrtcCreateProgram for the option probe")
    try:
        args = [f"--gpu-architecture={arch}", *BASE_OPTIONS, *opts]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(args), [a.encode() for a in args])
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return () if err else opts


def cache_key(source: str, opts: list[str]) -> str:
    major, minor = nvrtc_version()
    headers = any(o.startswith("-I") for o in opts)  # bundled headers: their version is NVRTC's
    stable = [o for o in opts if not o.startswith("-I")] + (["-I<bundled headers>"] if headers else [])
    return hashlib.sha256("\0".join((source, f"nvrtc {major}.{minor}", *stable)).encode()).hexdigest()[:32]


def _log(prog) -> str:
    nvrtc = _nvrtc()
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err or size <= 1:
        return ""
    buf = b" " * size
    nvrtc.nvrtcGetProgramLog(prog, buf)
    return buf.rstrip(b"\0").decode(errors="replace").strip()


def _compile(source: str, name: str, opts: list[str], key: str, cubin: bool = True) -> bytes:
    """The cubin of ``source`` (b"" when ``cubin`` is false: only whether it compiles)."""
    nvrtc = _nvrtc()
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], [])
    _check(err, f"nvrtcCreateProgram for kernel {name}")
    try:
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        if err:
            src_path = _cuda_cache() / f"{key}.cu"
            write_atomic(src_path, source.encode())
            raise BackendError(ErrorStatus.COMPILATION,
                               f"NVRTC failed on kernel {name} ({' '.join(opts)}; source: {src_path}):\n{_log(prog)}")
        if not cubin:
            return b""
        err, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, f"nvrtcGetCUBINSize for kernel {name}")
        if size == 0:
            raise BackendError(ErrorStatus.COMPILATION, f"NVRTC produced no cubin for kernel {name} "
                               f"({' '.join(opts)}): the target must be an exact sm_XY")
        buf = b"\0" * size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, buf)
        _check(err, f"nvrtcGetCUBIN for kernel {name}")
        return buf
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_SOURCES: dict[bytes, str] = {}


def _remember(cubin: bytes, source: str) -> bytes:
    _SOURCES[hashlib.sha256(cubin).digest()] = source
    return cubin


def source_of(cubin: bytes) -> str | None:
    """The source ``compile_cubin`` compiled ``cubin`` from in this process, or None."""
    return _SOURCES.get(hashlib.sha256(bytes(cubin)).digest())


def cache_path(source: str, arch: str) -> Path:
    """Where the cubin of ``source`` for ``arch`` is (or will be) cached."""
    _require()
    return _cuda_cache() / f"{cache_key(source, options(source, arch))}.cubin"


def compile_cubin(source: str, name: str, arch: str, optimize: bool = True) -> bytes:
    """Compile CUDA C ``source`` (kernel ``name``, for error messages) to a cubin for ``arch`` ("sm_90"); at the
    lowest optimization effort unless ``optimize`` (for a driver that never executes the machine code: such a
    compile also marks the source checked, as ``check_batch`` does)."""
    _require()
    opts = options(source, arch, optimize)
    key = cache_key(source, opts)
    path = _cuda_cache() / f"{key}.cubin"
    try:
        return _remember(path.read_bytes(), source)
    except OSError:
        pass
    cubin = _compile(source, name, opts, key)
    write_atomic(path, cubin)
    if not optimize:
        _mark_checked(source, arch)
    return _remember(cubin, source)


def _checked_marker(source: str, arch: str, front_end: bool = False) -> Path:
    key = cache_key(source, options(source, arch))
    return _cuda_cache() / "checked" / f"{key}.{normalize_arch(arch)}{'.front' if front_end else ''}"


def _mark_checked(source: str, arch: str, front_end: bool = False) -> None:
    marker = _checked_marker(source, arch, front_end)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def is_checked(source: str, arch: str, front_end: bool = False) -> bool:
    """Whether ``source`` is known to compile for ``arch`` (checked before, or its cubin is cached); with
    ``front_end``, also when only NVRTC's front end checked it (``check_batch(front_end=True)``)."""
    return (_checked_marker(source, arch).exists() or cache_path(source, arch).exists()
            or (front_end and _checked_marker(source, arch, True).exists()))


def front_end_option(arch: str) -> tuple[str, ...]:
    """``-fdevice-syntax-only`` where this NVRTC has it (it stops after the front end: parsing, types, template
    instantiation; no NVVM optimizer or PTX), else nothing."""
    return _supported(FRONT_END_OPTIONS, normalize_arch(arch))


def check_batch(sources: Sequence[str], arch: str, front_end: bool = False) -> int:
    """Check that every kernel source compiles for ``arch``, faster than one ``compile_cubin`` each.

    Sources not checked before (per-source markers under ``<cache_dir>/cuda/checked``, or a cached cubin) are
    compiled together as one NVRTC program, each in its own namespace (``extern "C"`` dropped, so equal kernel
    names do not clash); NVRTC's fixed cost per program is paid once. A source with an ``#include`` cannot sit
    in a namespace and is compiled alone. When the batch fails, every member is compiled alone so that the
    error names the failing kernels: ``BackendError(COMPILATION)`` with their logs. With ``front_end`` the batch
    stops after NVRTC's front end (``front_end_option``: about 6x faster; what it finds wrong is what a kernel's
    C++ gets wrong, while the PTX back end sees the layouts' code, which their own variant tests compile fully);
    such checks are remembered apart and never stand for a full compile. Returns how many sources were compiled
    (not found checked).
    """
    _require()
    front = front_end_option(arch) if front_end else ()
    todo = [s for s in dict.fromkeys(sources) if not is_checked(s, arch, bool(front))]
    alone = [s for s in todo if "#include" in s]
    together = [s for s in todo if "#include" not in s]
    for s in alone:
        compile_cubin(s, _kernel_name(s), arch, optimize=False)
    if together:
        program = "".join(_in_namespace(f"zyx_batch_{i}", s) for i, s in enumerate(together))
        try:
            _compile(program, f"batch of {len(together)}", options(program, arch, optimize=False) + list(front),
                     cache_key(program, []), cubin=False)
        except BackendError:
            errors = _failures_alone(together, arch)
            if not errors:
                raise  # every kernel compiles alone: the batching itself failed
            raise BackendError(ErrorStatus.COMPILATION, f"{len(errors)} of {len(together)} kernels failed for "
                               f"{normalize_arch(arch)}:\n" + "\n\n".join(errors)) from None
    for s in together:
        _mark_checked(s, arch, bool(front))
    return len(todo)


def _in_namespace(ns: str, source: str) -> str:
    body = source.replace('extern "C" ', "")
    return f"namespace {ns} {{\n{body}\n}}\n"


def _failures_alone(sources: Sequence[str], arch: str) -> list[str]:
    """Compile each source alone; the errors of those that fail."""
    errors = []
    for s in sources:
        try:
            compile_cubin(s, _kernel_name(s), arch, optimize=False)
        except BackendError as e:
            errors.append(e.context)
    return errors


_KERNEL_NAME = re.compile(r"__global__ void (?:__launch_bounds__\(\d+\) )?(\w+)\(")


def _kernel_name(source: str) -> str:
    m = _KERNEL_NAME.search(source)
    return m.group(1) if m else "kernel"


__all__ = ["INSTALL_HINT", "available", "cache_path", "check_batch", "compile_cubin", "front_end_option", "header_dir",
           "is_checked", "normalize_arch", "nvrtc_version", "options", "source_of"]

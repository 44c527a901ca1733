"""Every kernel a test process compiled, rendered as CUDA C and compiled by NVRTC's front end for sm_80 and sm_90.

``tests/conftest.py`` sets ``zyx.utils.KERNEL_LOG`` to a list, so the devices log each kernel IR they compile,
and checks the log when the process's tests are done (a session fixture: under ``pytest -n 2`` each worker
checks its own kernels; a failure is an error in the teardown of that worker's last test). Kernels are
deduplicated by their rendered source and compiled in batches (``nvrtc.check_batch``: one NVRTC program per
batch, each kernel in its own namespace, ~2.5x faster than one program per kernel) over a process pool of two;
sources checked in an earlier run are remembered on disk, so only new sources cost an NVRTC run. No GPU needed.
For sm_90 only the sources that sm_90 preprocesses differently from sm_80 are compiled (``_arch_dependent``): the
same preprocessed text that compiles for sm_80 compiles for sm_90 (a superset).

The batches stop after the front end (``nvrtc.check_batch(front_end=True)``, ``-fdevice-syntax-only``): parsing,
types, overloads and templates of every kernel, about 6x faster than generating PTX (the whole check took ~35 s
of each worker at the end of the suite). What only the PTX back end can reject depends on a layout's code (inline
PTX, intrinsics, shared arrays), not on the ops a kernel mixes: every layout's variants are compiled to PTX by
their own tests (``tests/kernel/test_gpu_*``, ``test_cuda_codegen``).
"""

from __future__ import annotations

import multiprocessing
import operator
import re
import time
from concurrent.futures import ProcessPoolExecutor

from zyx.backends.base import BackendError
from zyx.backends.cuda import nvrtc
from zyx.kernel import gpu
from zyx.kernel.render_cuda import render_cuda

ARCHS = ("sm_80", "sm_90")
BATCH = 128  # kernels per NVRTC program (308 kernels, one process: 8 per program 2.22 s, 32 1.47 s, 128 1.27 s)
POOL_MIN_BATCHES = 4  # below this, a worker pool costs more than it saves


_ARCH_COMPARE = re.compile(r"__CUDA_ARCH__\s*(>=|<=|==|!=|>|<)\s*(\d+)")
_ARCH_DEFINED = re.compile(r"defined\s*\(\s*__CUDA_ARCH__\s*\)|#\s*if(?:n)?def\s+__CUDA_ARCH__")
_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne, ">": operator.gt, "<": operator.lt}


def _arch_dependent(source: str) -> bool:
    """Whether sm_90 may preprocess ``source`` differently from sm_80: it includes a header, or a use of
    ``__CUDA_ARCH__`` is other than ``defined``/``#ifdef`` or a comparison with a constant that 800 and 900 answer
    alike (``>= 800``, ``< 800``)."""
    if "#include" in source:
        return True
    compares = _ARCH_COMPARE.findall(source)
    if any(_OPS[op](800, int(v)) != _OPS[op](900, int(v)) for op, v in compares):
        return True
    return source.count("__CUDA_ARCH__") != len(compares) + len(_ARCH_DEFINED.findall(source))


def _check(job: tuple[tuple[str, ...], str]) -> str | None:
    sources, arch = job
    try:
        nvrtc.check_batch(sources, arch, front_end=True)
    except BackendError as e:
        return f"[{arch}] {e.context}"
    return None


def _render_all(kernels: list) -> tuple[list[str], list[str]]:
    """Distinct rendered sources, and rendering failures (named by kernel)."""
    info = gpu.reference_info()
    sources: dict[str, None] = {}
    failures: list[str] = []
    for k in kernels:
        try:
            sources[render_cuda(k, info).source] = None
        except Exception as e:  # noqa: BLE001 - every failure is reported with its kernel
            failures.append(f"{k.name}: rendering failed: {type(e).__name__}: {e}")
    return list(sources), failures


def _run(jobs: list[tuple[tuple[str, ...], str]]) -> list[str]:
    if len(jobs) < POOL_MIN_BATCHES:
        results = [_check(j) for j in jobs]
    else:
        with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("forkserver")) as ex:
            results = list(ex.map(_check, jobs))
    return [r for r in results if r is not None]


def check_logged_kernels(log: list) -> tuple[str, list[str]]:
    """Render and compile every kernel in ``log``: a one-line summary, and the failures (empty: all compiled)."""
    t0 = time.perf_counter()
    sources, failures = _render_all(list(log))
    t_render = time.perf_counter() - t0
    per_arch = {"sm_80": sources, "sm_90": [s for s in sources if _arch_dependent(s)]}
    jobs: list[tuple[tuple[str, ...], str]] = []
    for arch in ARCHS:
        todo = [s for s in per_arch[arch] if not nvrtc.is_checked(s, arch, front_end=True)]
        jobs += [(tuple(todo[i:i + BATCH]), arch) for i in range(0, len(todo), BATCH)]
    n_new = sum(len(srcs) for srcs, _ in jobs)
    t1 = time.perf_counter()
    failures += _run(jobs)
    n_all = sum(len(per_arch[a]) for a in ARCHS)
    summary = (f"CUDA codegen: {len(log)} logged kernels, {len(sources)} distinct sources, {n_all} compiles (sm_80 "
               f"each, sm_90 the {len(per_arch['sm_90'])} it preprocesses differently; {n_new} run now in "
               f"{len(jobs)} NVRTC programs, {n_all - n_new} checked before); "
               f"render {t_render:.1f} s, NVRTC {time.perf_counter() - t1:.1f} s")
    return summary, failures

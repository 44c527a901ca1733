"""Every kernel a test process compiled, rendered as CUDA C and compiled by NVRTC for sm_80 and sm_90.

``tests/conftest.py`` sets ``zyx.utils.KERNEL_LOG`` to a list, so the devices log each kernel IR they compile,
and checks the log when the process's tests are done (a session fixture: under ``pytest -n 2`` each worker
checks its own kernels; a failure is an error in the teardown of that worker's last test). Kernels are
deduplicated by their rendered source and compiled in batches (``nvrtc.check_batch``: one NVRTC program per
batch, each kernel in its own namespace, ~2.5x faster than one program per kernel) over a process pool of two;
sources checked in an earlier run are remembered on disk, so only new sources cost an NVRTC run. No GPU needed.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

from zyx.backends.base import BackendError
from zyx.backends.cuda import nvrtc
from zyx.kernel import gpu
from zyx.kernel.render_cuda import render_cuda

ARCHS = ("sm_80", "sm_90")
BATCH = 128  # kernels per NVRTC program (308 kernels, one process: 8 per program 2.22 s, 32 1.47 s, 128 1.27 s)
POOL_MIN_BATCHES = 4  # below this, a worker pool costs more than it saves


def _check(job: tuple[tuple[str, ...], str]) -> str | None:
    sources, arch = job
    try:
        nvrtc.check_batch(sources, arch)
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
    jobs: list[tuple[tuple[str, ...], str]] = []
    for arch in ARCHS:
        todo = [s for s in sources if not nvrtc.is_checked(s, arch)]
        jobs += [(tuple(todo[i:i + BATCH]), arch) for i in range(0, len(todo), BATCH)]
    n_new = sum(len(srcs) for srcs, _ in jobs)
    t1 = time.perf_counter()
    failures += _run(jobs)
    n_all = len(sources) * len(ARCHS)
    summary = (f"CUDA codegen: {len(log)} logged kernels, {len(sources)} distinct sources, {n_all} compiles for "
               f"{'/'.join(ARCHS)} ({n_new} run now in {len(jobs)} NVRTC programs, {n_all - n_new} checked "
               f"before); render {t_render:.1f} s, NVRTC {time.perf_counter() - t1:.1f} s")
    return summary, failures

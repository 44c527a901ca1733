"""Entry point of the CUDA backend for the registry: ``probe(cuda_config) -> list[Placement]``.

Invariants:
- Importing this module needs neither cuda-python nor a GPU; ``probe`` raises ``BackendError(INITIALIZATION,
  reason)`` when cuda-python, libcuda or GPUs are missing, and the registry reports that reason.
- One placement per GPU in ``device_ids`` (None = every visible GPU), named ``cuda:<driver ordinal>``, each with a
  ``CudaPool`` and ``[CudaDevice]`` sharing one worker thread. A GPU whose worker cannot start is skipped (logged
  under ``ZYX_DEBUG=dev``); if none starts, the first error is raised.
- Workers are closed (drained, thread stopped) at interpreter exit.
- ``cuda.emulate`` (or ``ZYX_CUDA_EMULATE=1``) loads the emulated driver's bindings instead of cuda-python's; the
  placements' ``note`` then says so (and that cuDNN is its reference double). Nothing else differs.
"""

from __future__ import annotations

import atexit
import os
import weakref

from zyx.backends.base import BackendError, ErrorStatus
from zyx.backends.cuda.driver import Driver, load_driver
from zyx.backends.cuda.worker import Worker, WorkerConfig
from zyx.utils import debug_on, log

_workers: weakref.WeakSet[Worker] = weakref.WeakSet()
_atexit_registered = False


def _close_all() -> None:
    for w in list(_workers):
        try:
            w.close(timeout=5.0)
        except Exception:  # noqa: BLE001 - shutting down: nothing useful to do with an error
            pass


def emulation_requested(cuda_config: dict) -> bool:
    """``ZYX_CUDA_EMULATE`` (when set) or the config's ``emulate``."""
    env = os.environ.get("ZYX_CUDA_EMULATE", "").strip().lower()
    if env:
        return env not in ("0", "false", "no", "off")
    return bool(cuda_config.get("emulate", False))


def worker_config(cuda_config: dict) -> WorkerConfig:
    return WorkerConfig(queues=int(cuda_config.get("queues") or 12), sync_each=debug_on("launch"),
                        graphs=bool(cuda_config.get("graphs", True)))


def probe(cuda_config: dict, driver: Driver | None = None) -> list:
    """One ``Placement`` per selected GPU; ``driver`` replaces the real driver (tests)."""
    from zyx.backends.cuda.device import CudaDevice
    from zyx.backends.cuda.pool import CudaPool
    from zyx.backends.registry import Placement

    global _atexit_registered
    drv = driver if driver is not None else load_driver(emulate=emulation_requested(cuda_config))
    count = drv.device_count()
    if count == 0:
        raise BackendError(ErrorStatus.INITIALIZATION, "no CUDA GPU visible; check nvidia-smi and "
                           "CUDA_VISIBLE_DEVICES")
    ids = cuda_config.get("device_ids")
    ordinals = list(range(count)) if ids is None else list(ids)
    missing = [i for i in ordinals if not 0 <= i < count]
    if missing:
        raise BackendError(ErrorStatus.INITIALIZATION, f"cuda.device_ids lists GPU {missing[0]} but only {count} "
                           f"GPU(s) are visible (ordinals 0..{count - 1}); fix the config file")
    use_cudnn = bool(cuda_config.get("cudnn", True))
    notes = [getattr(drv, "note", "")]
    cudnn_unavailable: str | None = None
    if use_cudnn:
        from zyx.backends.cuda.cudnn import ensure_available

        try:
            notes.append(ensure_available(drv))
        except BackendError as e:
            log("dev", f"cuda: cuDNN off: {e.context}")
            cudnn_unavailable = e.context
            notes.append("cuDNN off: " + e.context)
    cfg = worker_config(cuda_config)
    placements = []
    first_error: BackendError | None = None
    for ordinal in ordinals:
        try:
            worker = Worker(drv, ordinal, cfg)
        except BackendError as e:
            log("dev", f"cuda:{ordinal}: cannot start: {e.context}")
            first_error = first_error or e
            continue
        _workers.add(worker)
        pool = CudaPool(worker)
        device = CudaDevice(pool, cudnn=use_cudnn, allow_tf32=bool(cuda_config.get("allow_tf32", False)),
                            cudnn_unavailable=cudnn_unavailable)
        placements.append(Placement(worker.name, pool, [device],
                                    note="; ".join(n for n in notes if n)))
    if not placements:
        assert first_error is not None
        raise BackendError(ErrorStatus.INITIALIZATION, first_error.context)
    if not _atexit_registered:
        atexit.register(_close_all)
        _atexit_registered = True
    return placements

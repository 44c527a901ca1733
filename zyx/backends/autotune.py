"""Autotuning by measurement: a beam search (``zyx.kernel.search``) over a kernel's pass parameters, timed with
``Device.launch_timed`` on scratch buffers of the kernel's shapes, cached on disk.

Enabling: config ``"autotune": {"enabled": true, "budget_s": 10}``, or the environment: ``ZYX_AUTOTUNE=1`` (``0``
switches it off whatever the config says), ``ZYX_AUTOTUNE_BUDGET=<seconds>`` (overrides ``budget_s``),
``ZYX_AUTOTUNE_KERNEL_S=<seconds>`` (caps one kernel's search too, so that a small budget spreads over many
kernels: the parity suite's run with search on) and ``ZYX_AUTOTUNE_CACHE=<dir>`` (the cache directory);
``configured(...)`` overrides the settings within a block (tests, benchmarks). Off (the default), ``compile``
never calls in here beyond one ``active()`` check: the heuristics choose.

Invariants:
- ``budget_s`` bounds the time this **process** spends searching, over all kernels and devices together. No
  candidate is measured once it is spent (a search in progress overruns it by at most one candidate); kernels met
  after that take the heuristics (or the disk cache, which costs nothing). ``reset_budget()`` starts it afresh.
- Every candidate is a correct kernel (the passes' contract); the search only chooses among them. Scratch buffers
  hold random floats and zero integers (an index operand of zeros stays in bounds), scalars are 0 (integers) or 1
  (floats); all are freed before ``tuned_params`` returns, and so is every candidate program but the winner's.
- Results are cached in memory and on disk (``<cache_dir>/autotune/<key>.json``) under ``key`` = sha256 of (the
  default-rendered source, which names the kernel's structure and shapes; the device's identity: name, model,
  compiler / NVRTC and driver versions; the search space). A hit measures nothing (``STATS["autotune_hits"]``);
  ``STATS["autotune_timed"]`` counts timed launches, ``STATS["autotune_searches"]`` searches.
- A search stopped by the budget is cached too (with ``"complete": false``), so a second run is instant.
- ``ZYX_DEBUG=autotune`` prints every candidate with its time, and each search's outcome.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from zyx.backends.base import BackendError, Pool, ProgramId
from zyx.kernel.ir import Kernel
from zyx.kernel.search import CandidateFailed, SearchResult, Trial, beam_search
from zyx.kernel.target import DeviceInfo
from zyx.utils import STATS, cache_dir, debug_on, log, on_caller_thread, write_atomic

CACHE_VERSION = 2  # 2: winners confirmed in turns (CONFIRM_ROUNDS); earlier entries may hold lucky ones
WARMUP = 1  # untimed launches of each candidate before timing (first-touch pages, module load, caches)
REPEATS = 5  # timed launches of a candidate (median); 3 when one launch takes longer than SLOW_NS
SLOW_NS = 20_000_000
# rounds in turns that confirm a winner other than the heuristic (``beam_search``'s ``confirm``): among the ~50
# candidates of a host search, timed one after another on a noisy 2-core machine, the fastest is partly the luckiest
# (the bench's autotuned softmax had run 0.98x its heuristic)
CONFIRM_ROUNDS = 3


def steady_ns(run: Callable[[], int]) -> float:
    """The time of one launch as every measurement here takes it (candidates, and the extraction's costs of
    alternatives): ``WARMUP`` untimed calls of ``run`` (which returns ns), then the median of ``REPEATS`` (3 when
    a launch takes longer than ``SLOW_NS``). Runs on the thread that launches kernels for real (``on_caller_thread``:
    planning runs on a thread of its own)."""

    def measure() -> float:
        for _ in range(WARMUP):
            run()
        times = [run()]
        times += [run() for _ in range((3 if times[0] > SLOW_NS else REPEATS) - 1)]
        return float(statistics.median(times))

    return on_caller_thread(measure)


class Tunable(Protocol):
    """What the tuner needs of a device (``HostDevice`` and ``CudaDevice`` implement it)."""

    def info(self) -> DeviceInfo: ...

    def pool(self) -> Pool: ...

    def tuning_space(self, kernel: Kernel) -> dict[str, tuple[int, ...]]: ...

    def tuning_identity(self) -> str: ...

    def render_candidate(self, kernel: Kernel, params: Mapping[str, int]) -> str: ...

    def compile_candidate(self, kernel: Kernel, params: Mapping[str, int]) -> tuple[ProgramId, bool]:
        """The program of ``kernel`` under ``params`` (never tuned itself) and whether it was new."""

    def launch_timed(self, program: ProgramId, args: list) -> int: ...

    def release(self, program: ProgramId) -> None: ...


# ---- settings -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    enabled: bool = False
    budget_s: float = 10.0  # per process, all kernels together
    beam: int = 3  # beam width: candidates kept per round
    kernel_s: float = math.inf  # at most this much per kernel's search


_override: Settings | None = None
_OFF = ("0", "false", "no", "off")


def settings() -> Settings:
    """The settings in force: ``configured`` > environment (``ZYX_AUTOTUNE``, ``ZYX_AUTOTUNE_BUDGET``) > config."""
    if _override is not None:
        return _override
    from zyx.backends.registry import registry

    cfg = registry().config.get("autotune", {})
    env = os.environ.get("ZYX_AUTOTUNE", "").strip().lower()
    enabled = env not in _OFF if env else bool(cfg.get("enabled", False))
    budget_s = _seconds("ZYX_AUTOTUNE_BUDGET", float(cfg.get("budget_s", 10)))
    return Settings(enabled, budget_s, kernel_s=_seconds("ZYX_AUTOTUNE_KERNEL_S", math.inf))


def _seconds(var: str, default: float) -> float:
    value = os.environ.get(var, "").strip()
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{var} must be a number of seconds, got {value!r}") from None


def active() -> bool:
    """Whether ``compile`` should tune (cheap: called on every compile)."""
    if _override is not None:
        return _override.enabled
    env = os.environ.get("ZYX_AUTOTUNE", "").strip().lower()
    if env:
        return env not in _OFF
    from zyx.backends.registry import registry

    return bool(registry().config.get("autotune", {}).get("enabled", False))


@contextlib.contextmanager
def configured(enabled: bool = True, budget_s: float = 10.0, beam: int = 3,
               kernel_s: float = math.inf) -> Iterator[Settings]:
    """Within the block, these settings replace the config and the environment."""
    global _override
    saved, _override = _override, Settings(enabled, budget_s, beam, kernel_s)
    try:
        yield _override
    finally:
        _override = saved


# ---- state: budget and caches --------------------------------------------------------------------------------------

_lock = threading.RLock()
_spent_s = 0.0
_memory: dict[str, dict] = {}
CACHE_DIR: Path | None = None  # None: ``<cache_dir()>/autotune``; tests point it elsewhere


def cache_root() -> Path:
    if CACHE_DIR is not None:
        return CACHE_DIR
    if os.environ.get("ZYX_AUTOTUNE_CACHE"):
        return Path(os.environ["ZYX_AUTOTUNE_CACHE"])
    return cache_dir() / "autotune"


def reset_budget() -> None:
    """Forget the time this process has spent searching."""
    global _spent_s
    with _lock:
        _spent_s = 0.0


def spent_s() -> float:
    return _spent_s


def clear_memory() -> None:
    """Forget the in-memory results (the disk cache stays): what a new process would see."""
    with _lock:
        _memory.clear()


def cache_key(device: Tunable, default_source: str, space: Mapping[str, tuple[int, ...]]) -> str:
    blob = json.dumps([CACHE_VERSION, default_source, device.tuning_identity(),
                       sorted((k, list(v)) for k, v in space.items())])
    return hashlib.sha256(blob.encode()).hexdigest()[:40]


def _load(key: str) -> dict | None:
    path = cache_root() / f"{key}.json"
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("params"), dict):
        return None
    return entry


def _store(key: str, entry: dict) -> None:
    d = cache_root()
    try:
        write_atomic(d / f"{key}.json", json.dumps(entry, indent=1))
    except OSError as e:  # a read-only cache costs a search per process, never a failure
        log("autotune", f"cannot write the autotune cache in {d}: {e}")


def _entry(device: Tunable, kernel: Kernel) -> tuple[str | None, dict | None]:
    """The cache key of ``kernel`` on ``device`` and its cached entry (memory, then disk); (None, None) when the
    kernel has nothing to tune."""
    space = device.tuning_space(kernel)
    if not space:
        return None, None
    key = cache_key(device, device.render_candidate(kernel, {}), space)
    with _lock:
        entry = _memory.get(key)
    if entry is None:
        entry = _load(key)
        if entry is not None:
            with _lock:
                _memory[key] = entry
    return key, entry


def measured_ns(device: Tunable, kernel: Kernel) -> float | None:
    """The best time measured for ``kernel`` on ``device`` (its tuned parameters), or None when it was never
    tuned (nothing is measured here)."""
    _, entry = _entry(device, kernel)
    if entry is None:
        return None
    ns = entry.get("ns")
    return float(ns) if isinstance(ns, (int, float)) and math.isfinite(ns) else None


# ---- the search -----------------------------------------------------------------------------------------------------


def _scratch(device: Tunable, kernel: Kernel) -> tuple[list, list[int]]:
    """Launch arguments for ``kernel``: fresh buffers of its params' sizes (inputs random floats or zero integers)
    and scalars; returns (args, buffers to release)."""
    pool = device.pool()
    rng = np.random.default_rng(0)
    args: list = []
    owned: list[int] = []
    try:
        for p in kernel.params:
            if p.kind == "var":
                args.append(1.0 if p.dtype.kind == "f" else 0)
                continue
            n = max(p.size, 1)
            buf = pool.allocate(n * p.dtype.itemsize)
            owned.append(buf)
            if p.kind == "in":
                if p.dtype.kind == "f":
                    data = rng.standard_normal(n, dtype=np.float32).astype(p.dtype.np_dtype)
                else:
                    data = np.zeros(n, p.dtype.np_dtype)
                pool.host_to_pool(memoryview(data.view(np.uint8)), buf)
            args.append(buf)
    except BaseException:
        for b in owned:
            pool.release(b)
        raise
    return args, owned


def _describe(params: Mapping[str, int]) -> str:
    return ", ".join(f"{k}={v}" for k, v in params.items()) or "heuristic"


def _search(device: Tunable, kernel: Kernel, space: dict[str, tuple[int, ...]], budget_s: float,
            beam: int) -> tuple[SearchResult, ProgramId | None]:
    programs: dict[str, tuple[ProgramId, bool]] = {}  # source -> (program, created by the search)
    sources: dict[tuple, str] = {}
    name = device.info().name

    def render(params) -> str:
        key = tuple(sorted(params.items()))
        if key not in sources:
            sources[key] = device.render_candidate(kernel, params)
        return sources[key]

    def measure(params) -> float:
        src = render(params)
        try:
            if src not in programs:
                programs[src] = device.compile_candidate(kernel, params)
            pid = programs[src][0]
            return steady_ns(lambda: timed(pid))
        except BackendError as e:
            log("autotune", f"{name} {kernel.name}: candidate {_describe(params)} failed: {e.context}")
            raise CandidateFailed(str(e)) from e

    def timed(pid: ProgramId) -> int:
        STATS["autotune_timed"] += 1
        return device.launch_timed(pid, args)

    def report(t: Trial) -> None:
        if t.measured and debug_on("autotune"):  # twins (the same source as an earlier candidate) stay quiet
            log("autotune", f"{name} {kernel.name}: {_describe(t.params)}: {t.ns / 1e3:.1f} us")

    args, owned = _scratch(device, kernel)
    winner: ProgramId | None = None
    try:
        result = beam_search(space, measure, render, budget_s=budget_s, width=beam, on_trial=report,
                             confirm=CONFIRM_ROUNDS)
        best_src = render(result.best)
        if best_src in programs:
            winner = programs[best_src][0]
    finally:
        pool = device.pool()
        for b in owned:
            pool.release(b)
        for pid, created in programs.values():
            if created and pid != winner:
                device.release(pid)
    return result, winner


def tuned_params(device: Tunable, kernel: Kernel) -> dict[str, int]:
    """The parameters to compile ``kernel`` with on ``device``: cached, else searched within what is left of the
    budget, else ``{}`` (the heuristics)."""
    global _spent_s
    key, entry = _entry(device, kernel)
    if key is None:
        return {}
    if entry is not None:
        STATS["autotune_hits"] += 1
        return dict(entry["params"])
    s = settings()
    with _lock:
        left = s.budget_s - _spent_s
    if left <= 0:
        STATS["autotune_out_of_budget"] += 1
        log("autotune", f"{device.info().name} {kernel.name}: budget of {s.budget_s:g} s spent; heuristics choose")
        return {}
    space = device.tuning_space(kernel)
    t0 = time.perf_counter()
    STATS["autotune_searches"] += 1
    try:
        result, _ = _search(device, kernel, space, min(left, s.kernel_s), s.beam)
    finally:
        with _lock:
            _spent_s += time.perf_counter() - t0
    took = time.perf_counter() - t0
    entry = {"params": result.best, "ns": result.best_ns if math.isfinite(result.best_ns) else None,
             "default_ns": result.default_ns if math.isfinite(result.default_ns) else None,
             "complete": result.complete, "measured": result.measured, "kernel": kernel.name,
             "device": device.info().name, "search_s": round(took, 3)}
    verdict = (" (confirmed in turns)" if result.confirmed else
               f" ({_describe(result.rejected)} was no faster in turns)" if result.rejected is not None else "")
    log("autotune", f"{device.info().name} {kernel.name}: chose {_describe(result.best)}{verdict} "
        f"({result.best_ns / 1e3:.1f} us, heuristic {result.default_ns / 1e3:.1f} us) after {result.measured} "
        f"measured of {len(result.trials)} candidates in {took:.2f} s{'' if result.complete else ' (budget reached)'}")
    with _lock:
        _memory[key] = entry
    _store(key, entry)
    return dict(result.best)


def info_identity(info: DeviceInfo) -> str:
    """The parts of a ``DeviceInfo`` that make its timings comparable (name, kind, units, capability, model)."""
    extra: dict[str, Any] = info.extra or {}
    return "|".join(str(x) for x in (info.name, info.kind, info.compute_units, info.compute_capability,
                                      extra.get("device_name", ""), extra.get("arch", "")))


__all__ = ["CACHE_DIR", "Settings", "Tunable", "active", "cache_key", "cache_root", "clear_memory", "configured",
           "info_identity", "measured_ns", "reset_budget", "settings", "spent_s", "tuned_params"]

"""Public inspection used by tests and tools: what a realize would launch, and process-wide counters."""

from __future__ import annotations

from dataclasses import dataclass

from zyx.graph import schedule as _schedule
from zyx.utils import STATS, set_debug


@dataclass(frozen=True)
class Launch:
    """One launch of a schedule: ``kind`` is "generated", "library" or "copy"."""

    kind: str
    device: str
    name: str


def schedule(*tensors) -> list[Launch]:
    """The launches realizing ``tensors`` would run now (plans and compiles, runs nothing)."""
    classes = [t._on_compute().cls if t.device == "disk" else t.cls for t in tensors]
    return [Launch(s.kind, s.device, s.name) for s in _schedule.scheduled_steps(classes)]


def kernel_source(*tensors) -> list[str]:
    """Rendered source of every generated kernel realizing ``tensors`` would launch."""
    out = []
    for s in _schedule.scheduled_steps([t.cls for t in tensors]):
        if s.kind == "generated" and hasattr(s.dev, "source"):
            out.append(s.dev.source(s.program))
    return out


def stats() -> dict[str, int]:
    """Counters since start (or ``reset_stats``): compiles, launches, schedule_cache_hits/misses, realizes,
    copies, graph_nodes (graph classes built), jit_captures, jit_replays, jit_stale_captures (captures dropped
    because state was pending from the call before), measured_alternatives (library and generated alternatives
    timed for extraction, autotune on), ..."""
    out = {k: 0 for k in ("compiles", "launches", "schedule_cache_hits", "schedule_cache_misses", "realizes",
                          "copies", "graph_nodes", "jit_captures", "jit_replays", "jit_stale_captures",
                          "measured_alternatives")}
    out.update(STATS)
    return out


def reset_stats() -> None:
    STATS.clear()


__all__ = ["Launch", "schedule", "kernel_source", "stats", "reset_stats", "set_debug"]

"""Beam search over a kernel's pass parameters, by measurement (pure: it knows no device).

``beam_search(space, measure, render)`` starts from the heuristic (``{}``: every pass chooses itself), then, round
after round, varies one parameter at a time of each beam member (the best ``width`` candidates measured so far) and
measures the new candidates; it stops when a round brings no new candidate into the beam, when there is nothing new
to try, or when the time budget is spent.

Invariants:
- Deterministic given the measurements (and the clock): candidates are tried in the order of ``space`` (its names,
  then each name's values); ties keep the earlier candidate, so the heuristic wins a tie.
- A candidate whose rendered source equals an earlier one's is not measured again: it shares that time (``render``
  is the dedupe key; the heuristic's own values therefore cost nothing).
- The budget is checked before every measurement: no measurement starts once ``clock() - start >= budget_s``; the
  heuristic itself is always measured (a search that measures nothing cannot say anything).
- A measurement that raises ``CandidateFailed`` (or returns a non-finite time) is recorded as ``inf`` and never
  chosen; the heuristic is returned when every candidate failed.
- With ``confirm`` > 0, a winner other than the heuristic is measured again beside it, in turns, ``confirm`` times
  each (within the budget): kept only when its median is the lower, else the heuristic is returned (``rejected``
  names the loser). The fastest of many noisy measurements is partly the luckiest: a candidate no faster than the
  heuristic can win a long search. Confirmed times replace the search's.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

Params = dict[str, int]


class CandidateFailed(Exception):
    """Raised by a ``measure`` callable for a candidate that cannot run (it is recorded as ``inf``)."""


@dataclass
class Trial:
    params: Params
    ns: float
    measured: bool  # False: shared the source (and the time) of an earlier candidate


@dataclass
class SearchResult:
    best: Params  # {} = the heuristic
    best_ns: float
    default_ns: float  # the heuristic's time
    trials: list[Trial] = field(default_factory=list)
    complete: bool = True  # False when the budget stopped the search
    confirmed: bool = False  # the winner (not the heuristic) was measured faster again, in turns with the heuristic
    rejected: Params | None = None  # the search's winner that the confirmation found no faster than the heuristic

    @property
    def measured(self) -> int:
        return sum(t.measured for t in self.trials)


def _key(p: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(p.items()))


def neighbours(space: Mapping[str, tuple[int, ...]], params: Mapping[str, int]) -> list[Params]:
    """Every candidate differing from ``params`` in exactly one parameter, in the order of ``space``."""
    out = []
    for name, values in space.items():
        for v in values:
            if params.get(name) != v:
                out.append({**params, name: v})
    return out


def beam_search(space: Mapping[str, tuple[int, ...]], measure: Callable[[Params], float],
                render: Callable[[Params], str] | None = None, budget_s: float = math.inf, width: int = 3,
                max_rounds: int = 8, clock: Callable[[], float] = time.perf_counter,
                on_trial: Callable[[Trial], None] | None = None, confirm: int = 0) -> SearchResult:
    """The best parameters of ``space`` by ``measure`` (nanoseconds, lower is better); see the module docstring."""
    start = clock()
    trials: list[Trial] = []
    by_params: dict[tuple, float] = {}
    by_source: dict[str, float] = {}
    complete = True

    def run(p: Params, force: bool = False) -> bool:
        """Measure ``p`` (or take its twin's time); False when the budget forbids measuring."""
        nonlocal complete
        src = render(p) if render is not None else None
        if src is not None and src in by_source:
            t = Trial(p, by_source[src], False)
        else:
            if not force and clock() - start >= budget_s:
                complete = False
                return False
            ns = _time(measure, p)
            if src is not None:
                by_source[src] = ns
            t = Trial(p, ns, True)
        by_params[_key(p)] = t.ns
        trials.append(t)
        if on_trial is not None:
            on_trial(t)
        return True

    run({}, force=True)
    beam: list[Params] = [{}]
    for _ in range(max_rounds):
        fresh = False
        for member in beam:
            for cand in neighbours(space, member):
                if _key(cand) in by_params:
                    continue
                if not run(cand):
                    break
                fresh = True
            if not complete:
                break
        # the best ``width`` distinct-time candidates (first come first on ties: sorted() is stable)
        ranked = sorted((t for t in trials if math.isfinite(t.ns)), key=lambda t: t.ns)
        new_beam: list[Params] = []
        seen_ns: set[float] = set()
        for t in ranked:
            if t.ns in seen_ns and not t.measured:
                continue  # a twin of a candidate already in the beam
            seen_ns.add(t.ns)
            new_beam.append(t.params)
            if len(new_beam) == width:
                break
        if not complete or not fresh or [_key(p) for p in new_beam] == [_key(p) for p in beam]:
            beam = new_beam or beam
            break
        beam = new_beam
    ok = [t for t in trials if math.isfinite(t.ns)]
    default_ns = trials[0].ns
    if not ok:
        return SearchResult({}, default_ns, default_ns, trials, complete)
    best = min(ok, key=lambda t: t.ns)  # min keeps the first of equal times
    result = SearchResult(dict(best.params), best.ns, default_ns, trials, complete)
    if confirm > 0 and best.params and math.isfinite(default_ns):
        _confirm(result, measure, confirm, lambda: clock() - start < budget_s)
    return result


def _time(measure: Callable[[Params], float], p: Params) -> float:
    """``measure(p)``, ``inf`` for a failed candidate or a non-finite time."""
    try:
        ns = float(measure(p))
    except CandidateFailed:
        return math.inf
    return ns if math.isfinite(ns) else math.inf


def _confirm(result: SearchResult, measure: Callable[[Params], float], rounds: int,
             budget_left: Callable[[], bool]) -> None:
    """Measure ``result.best`` and the heuristic in turns, ``rounds`` times each while the budget lasts; keep the
    winner when its median is the lower, else fall back to the heuristic. Unchanged when the budget ran out first."""
    heuristic: list[float] = []
    winner: list[float] = []
    for _ in range(rounds):
        if not budget_left():
            result.complete = False
            return
        heuristic.append(_time(measure, {}))
        winner.append(_time(measure, result.best))
    h, w = statistics.median(heuristic), statistics.median(winner)
    if w < h:
        result.best_ns, result.default_ns, result.confirmed = w, h, True
    else:
        result.rejected, result.best, result.best_ns, result.default_ns = result.best, {}, h, h


__all__ = ["CandidateFailed", "Params", "SearchResult", "Trial", "beam_search", "neighbours"]

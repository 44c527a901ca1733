"""The beam search over pass parameters (``zyx.kernel.search``) with fake measurements, and the GPU geometry's
search space (``gpu.search_space`` / ``gpu.optimize(params=...)``)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from conftest import kernels_of

import zyx
from zyx.kernel import gpu
from zyx.kernel.search import CandidateFailed, beam_search, neighbours

SPACE = {"a": (4, 1, 2, 8), "b": (0, 1), "c": (16, 32, 64)}
DEFAULT = {"a": 4, "b": 0, "c": 16}  # what the heuristic picks (each name's first value)


def full(p):
    return {**DEFAULT, **p}


def bowl(p) -> float:
    """A separable cost with its minimum at a=2, b=1, c=64."""
    q = full(p)
    return 100 + (q["a"] - 2) ** 2 * 10 + (1 - q["b"]) * 7 + abs(q["c"] - 64)


def render(p) -> str:
    return repr(sorted(full(p).items()))


def test_neighbours_vary_one_parameter_in_space_order():
    got = neighbours({"a": (1, 2), "b": (3, 4)}, {"a": 1})
    assert got == [{"a": 2}, {"a": 1, "b": 3}, {"a": 1, "b": 4}]


def test_finds_the_known_optimum():
    r = beam_search(SPACE, bowl, render)
    assert full(r.best) == {"a": 2, "b": 1, "c": 64}
    assert r.best_ns == 100 and r.default_ns == bowl({}) and r.complete


def test_finds_the_optimum_of_every_separable_cost():
    for opt in itertools.product(*SPACE.values()):
        target = dict(zip(SPACE, opt))

        def cost(p, target=target):
            q = full(p)
            return 1 + sum((SPACE[k].index(q[k]) - SPACE[k].index(target[k])) ** 2 for k in SPACE)

        r = beam_search(SPACE, cost, render)
        assert full(r.best) == target


def test_identical_sources_are_measured_once():
    calls = []

    def measure(p):
        calls.append(render_ignoring_b(p))
        return bowl(p)

    def render_ignoring_b(p):
        q = full(p)
        return f"a={q['a']} c={q['c']}"

    r = beam_search(SPACE, measure, render_ignoring_b)
    assert len(calls) == len(set(calls))  # never the same source twice
    assert r.measured == len(calls) and len(r.trials) > r.measured
    assert all(not t.measured for t in r.trials if t.params == {"a": 4})  # the heuristic's own value is free


def test_heuristic_values_cost_nothing_and_ties_keep_the_heuristic():
    r = beam_search(SPACE, lambda p: 5.0, render)
    assert r.best == {} and r.best_ns == 5.0
    assert r.trials[0].params == {} and r.trials[0].measured


def test_budget_is_respected_with_a_fake_clock():
    now = [0.0]

    def measure(p):
        now[0] += 1.0  # every measurement takes one "second"
        return bowl(p)

    r = beam_search(SPACE, measure, render, budget_s=3.0, clock=lambda: now[0])
    assert r.measured == 3 and not r.complete
    assert r.best_ns == min(t.ns for t in r.trials)


def test_the_heuristic_is_measured_even_without_budget():
    r = beam_search(SPACE, bowl, render, budget_s=0.0)
    assert r.measured == 1 and r.best == {} and not r.complete


def test_deterministic_given_the_measurements():
    a, b = beam_search(SPACE, bowl, render, width=2), beam_search(SPACE, bowl, render, width=2)
    assert [(t.params, t.ns, t.measured) for t in a.trials] == [(t.params, t.ns, t.measured) for t in b.trials]


def test_failed_candidates_are_never_chosen():
    def measure(p):
        if full(p)["b"] == 1:
            raise CandidateFailed("no")
        return bowl(p) if full(p)["a"] != 8 else math.nan

    r = beam_search(SPACE, measure, render)
    assert full(r.best)["b"] == 0 and full(r.best)["a"] != 8
    assert any(math.isinf(t.ns) for t in r.trials)

    def broken(p):
        raise CandidateFailed("all")

    r = beam_search(SPACE, broken, render)
    assert r.best == {} and math.isinf(r.best_ns)


def test_a_winner_is_confirmed_in_turns_with_the_heuristic_or_rejected():
    """``confirm``: a winner measured fast once by luck (then as slow as it is) loses the rounds in turns and the
    heuristic is returned; a winner that is faster keeps winning, with the times of the turns."""
    lucky = {"a": 1}
    seen: list = []

    def measure(p):
        seen.append(dict(p))
        if p == lucky:
            return 50.0 if seen.count(lucky) == 1 else 200.0
        return 100.0

    r = beam_search(SPACE, measure, render, confirm=3)
    assert r.best == {} and r.rejected == lucky and not r.confirmed and r.best_ns == r.default_ns == 100.0
    tail = seen[-6:]
    assert tail == [{}, lucky] * 3  # in turns, after the search
    r = beam_search(SPACE, bowl, render, confirm=3)
    assert full(r.best) == {"a": 2, "b": 1, "c": 64} and r.confirmed and r.rejected is None
    assert r.best_ns == 100 and r.default_ns == bowl({})
    plain = beam_search(SPACE, bowl, render)
    assert not plain.confirmed and plain.rejected is None and r.measured == plain.measured


def test_the_confirmation_stays_within_the_budget():
    now, calls = [0.0], [0]

    def measure(p):
        now[0] += 1.0
        calls[0] += 1
        return bowl(p)

    r = beam_search(SPACE, measure, render, budget_s=3.0, clock=lambda: now[0], confirm=3)
    assert calls[0] == 3 and r.measured == 3 and not r.confirmed and not r.complete and r.best != {}


def test_beam_width_one_is_greedy_coordinate_descent():
    r = beam_search(SPACE, bowl, render, width=1)
    assert full(r.best) == {"a": 2, "b": 1, "c": 64}


# ---- the GPU geometry's parameters ----------------------------------------------------------------------------


def _kernel(shape, axis):
    (k,) = kernels_of(zyx.Tensor(np.zeros(shape, np.float32)).sum(axis=axis))
    return k


@pytest.mark.parametrize("shape,axis", [((64, 256), 0), ((64, 256), 1), ((8, 4096), 1)])
def test_gpu_search_space_lists_legal_strategies_heuristic_first(shape, axis):
    info = gpu.reference_info()
    k = _kernel(shape, axis)
    space = gpu.search_space(k, info)
    heuristic = gpu.geometry(gpu.optimize(k, info)).strategy
    if "strategy" in space:
        assert gpu.STRATEGIES[space["strategy"][0]] == heuristic
        for s in space["strategy"]:
            assert gpu.geometry(gpu.optimize(k, info, {"strategy": s})).strategy == gpu.STRATEGIES[s]
    for params in neighbours(space, {}):
        geom = gpu.geometry(gpu.optimize(k, info, params))
        assert geom.block_threads <= info.max_local_threads and geom.block_threads % gpu.WARP == 0


def test_gpu_params_change_the_geometry_and_illegal_strategies_are_ignored():
    info = gpu.reference_info()
    k = _kernel((64, 256), 0)  # a column sum: every reduce at the innermost depth
    g = gpu.geometry(gpu.optimize(k, info, {"strategy": gpu.STRATEGIES.index("thread"), "threads": 64}))
    assert g.strategy == "thread" and g.block == (64, 1, 1)
    mma = gpu.geometry(gpu.optimize(k, info, {"strategy": gpu.STRATEGIES.index("mma")}))  # float32: no mma
    assert mma.strategy == gpu.geometry(gpu.optimize(k, info)).strategy
    assert gpu.optimize(k, info, {}) == gpu.optimize(k, info)  # the launch is part of the kernel

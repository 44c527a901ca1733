"""Autotuning by measurement (``zyx.backends.autotune``) on the host and the emulated GPU: the search runs within
its budget, picks a candidate, computes what the heuristics compute, and a second "process" (the in-memory cache
cleared) takes the disk cache without timing anything. Assertions are on counts, choices and values, never speed.

The op-parity suite runs with search on through the environment, e.g. under the emulator::

    ZYX_CUDA_EMULATE=1 ZYX_AUTOTUNE=1 ZYX_AUTOTUNE_BUDGET=300 ZYX_AUTOTUNE_KERNEL_S=1 \\
        ZYX_AUTOTUNE_CACHE=/tmp/zyx-autotune pytest -m cuda tests
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import assert_close, host_without_blas, kernels_of

import zyx
from zyx import utils
from zyx.backends import autotune
from zyx.backends.registry import registry
from zyx.graph import schedule
from zyx.kernel.search import neighbours


@pytest.fixture(autouse=True)
def fresh_tuner(tmp_path, monkeypatch):
    for var in ("ZYX_AUTOTUNE", "ZYX_AUTOTUNE_BUDGET", "ZYX_AUTOTUNE_KERNEL_S", "ZYX_AUTOTUNE_CACHE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(autotune, "CACHE_DIR", tmp_path / "autotune")
    autotune.clear_memory()
    autotune.reset_budget()
    schedule.clear_cache()
    zyx.debug.reset_stats()
    yield
    autotune.clear_memory()
    autotune.reset_budget()
    schedule.clear_cache()


def new_process() -> None:
    """What a second process sees: the disk cache, nothing in memory (and no cached schedules)."""
    autotune.clear_memory()
    autotune.reset_budget()
    schedule.clear_cache()
    zyx.debug.reset_stats()


def stat(name: str) -> int:
    return zyx.debug.stats().get(name, 0)


X = np.random.default_rng(7).standard_normal((48, 320)).astype(np.float32)
W = np.random.default_rng(8).standard_normal((320, 40)).astype(np.float32)


def workload(device: str) -> list[np.ndarray]:
    """Kernels with several candidates each: a column sum, a row softmax, a (generated) matmul, elementwise."""
    x = zyx.Tensor(X, device=device)
    outs = [x.sum(axis=0), x.softmax(-1), (x * 2 + 1).relu()]
    with host_without_blas():
        outs.append(x @ zyx.Tensor(W, device=device))
        return [o.numpy() for o in outs]


def reference() -> list[np.ndarray]:
    e = np.exp(X - X.max(1, keepdims=True))
    return [X.sum(0), e / e.sum(1, keepdims=True), np.maximum(X * 2 + 1, 0), X @ W]


def check(got: list[np.ndarray]) -> None:
    for g, w in zip(got, reference()):
        assert_close(g, w, rtol=1e-4, atol=1e-4)


# ---- settings ----------------------------------------------------------------------------------------------------


def test_off_by_default_the_tuner_is_never_called(monkeypatch):
    def boom(*a):
        raise AssertionError("the tuner ran with autotuning off")

    monkeypatch.setattr(autotune, "tuned_params", boom)
    assert not autotune.active()
    check(workload("host"))
    assert stat("autotune_searches") == 0 and stat("autotune_timed") == 0


def test_environment_and_config_switch_it_on(monkeypatch):
    monkeypatch.setenv("ZYX_AUTOTUNE", "1")
    monkeypatch.setenv("ZYX_AUTOTUNE_BUDGET", "3.5")
    assert autotune.active() and autotune.settings() == autotune.Settings(True, 3.5)
    monkeypatch.setenv("ZYX_AUTOTUNE", "0")
    assert not autotune.active()
    monkeypatch.delenv("ZYX_AUTOTUNE")
    monkeypatch.delenv("ZYX_AUTOTUNE_BUDGET")
    monkeypatch.setitem(registry().config, "autotune", {"enabled": True, "budget_s": 2})
    assert autotune.active() and autotune.settings().budget_s == 2.0
    monkeypatch.setenv("ZYX_AUTOTUNE_BUDGET", "soon")
    with pytest.raises(ValueError, match="ZYX_AUTOTUNE_BUDGET"):
        autotune.settings()
    with autotune.configured(False):
        assert not autotune.active()


# ---- host ----------------------------------------------------------------------------------------------------------


def test_host_search_runs_and_matches_the_heuristics():
    check(workload("host"))
    with autotune.configured(True, budget_s=60):
        check(workload("host"))
    assert stat("autotune_searches") >= 4 and stat("autotune_timed") > 0
    assert autotune.spent_s() > 0
    entries = [json.loads(p.read_text()) for p in autotune.CACHE_DIR.glob("*.json")]
    assert len(entries) == stat("autotune_searches")
    assert all(e["measured"] >= 1 and e["ns"] > 0 and e["device"] == "host" for e in entries)


def test_second_process_takes_the_disk_cache_without_timing():
    with autotune.configured(True, budget_s=60):
        check(workload("host"))
        searched = stat("autotune_searches")
        assert searched >= 4
        new_process()
        check(workload("host"))
    assert stat("autotune_timed") == 0 and stat("autotune_searches") == 0
    assert stat("autotune_hits") >= searched


def host_device():
    return registry().get("host").primary


def softmax_kernel():
    (k,) = kernels_of(zyx.Tensor(X).softmax(-1))
    return k


def test_picks_the_fastest_candidate_and_compiles_it(monkeypatch):
    dev = host_device()
    k = softmax_kernel()
    assert dev.render_candidate(k, {"stash": 0}) != dev.render_candidate(k, {})
    fast = dev.render_candidate(k, {"stash": 0})
    monkeypatch.setattr(dev, "launch_timed", lambda pid, args: 1_000 if dev.source(pid) == fast else 5_000)
    with autotune.configured(True, budget_s=60):
        assert autotune.tuned_params(dev, k) == {"stash": 0}
        assert dev.source(dev.compile(k)) == fast
    assert autotune.measured_ns(dev, k) == 1_000
    (other,) = kernels_of(zyx.Tensor(X).sum(axis=1))
    assert autotune.measured_ns(dev, other) is None


def test_candidates_are_timed_on_the_thread_that_realizes(monkeypatch):
    """Planning runs on a thread of its own; timing there measured OpenMP barriers that sleep (libgomp throttles
    its spin-waits beside the caller's idle team): a batched GEMM timed 7 ms ran 3.5 ms when realized."""
    import threading

    dev = host_device()
    timed_on = set()
    real = dev.launch_timed
    monkeypatch.setattr(dev, "launch_timed", lambda pid, args: timed_on.add(threading.get_ident()) or real(pid, args))
    with autotune.configured(True, budget_s=60):
        check(workload("host"))
    assert timed_on == {threading.get_ident()}


def test_on_caller_thread_returns_raises_and_nests():
    import threading

    me = threading.get_ident()

    def planned():
        assert threading.get_ident() != me
        assert utils.on_caller_thread(threading.get_ident) == me
        with pytest.raises(KeyError, match="lost"):
            utils.on_caller_thread(lambda: {}["lost"])
        assert utils.deep_call(lambda: utils.on_caller_thread(threading.get_ident)) == me  # nested: runs inline
        return "planned"

    assert utils.deep_call(planned) == "planned"
    assert utils.on_caller_thread(threading.get_ident) == me  # outside planning: directly
    with pytest.raises(ValueError, match="in plan"):
        utils.deep_call(lambda: (_ for _ in ()).throw(ValueError("in plan")))


def test_debug_output_lists_candidates_and_times(capsys):
    saved = utils.DEBUG
    utils.set_debug("autotune")
    try:
        with autotune.configured(True, budget_s=60):
            check(workload("host"))
    finally:
        utils.set_debug(saved)
    err = capsys.readouterr().err
    assert "[zyx:autotune] host" in err and " us" in err and "heuristic" in err and "chose" in err


def test_budget_is_honoured():
    with autotune.configured(True, budget_s=0.0):
        check(workload("host"))
    assert stat("autotune_searches") == 0 and stat("autotune_out_of_budget") >= 4
    new_process()
    with autotune.configured(True, budget_s=1e-9):  # enough for one kernel's heuristic, nothing else
        check(workload("host"))
    assert stat("autotune_searches") == 1 and stat("autotune_out_of_budget") >= 3
    (entry,) = [json.loads(p.read_text()) for p in autotune.CACHE_DIR.glob("*.json")]
    assert entry["measured"] == 1 and entry["params"] == {} and entry["complete"] is False


def test_cache_key_names_structure_device_and_space():
    class Fake:
        def __init__(self, ident):
            self.ident = ident

        def tuning_identity(self):
            return self.ident

    a, b = Fake("host|gcc 12"), Fake("host|gcc 13")
    space = {"x": (1, 2)}
    assert autotune.cache_key(a, "src", space) == autotune.cache_key(a, "src", dict(space))
    assert len({autotune.cache_key(a, "src", space), autotune.cache_key(b, "src", space),
                autotune.cache_key(a, "src2", space), autotune.cache_key(a, "src", {"x": (1, 2, 4)})}) == 4


def test_a_corrupt_cache_entry_is_searched_again():
    with autotune.configured(True, budget_s=60):
        check(workload("host"))
        for p in autotune.CACHE_DIR.glob("*.json"):
            p.write_text("{not json")
        new_process()
        check(workload("host"))
    assert stat("autotune_searches") >= 4


# ---- emulated (or real) GPU ---------------------------------------------------------------------------------------


@pytest.fixture
def cuda():
    if "cuda:0" not in registry().placements():
        pytest.skip("no cuda:0 (the emulated GPU is off: ZYX_CUDA_EMULATE=0, or NVRTC / g++ missing)")
    return registry().get("cuda:0").primary


def gpu_workload() -> list[np.ndarray]:
    x = zyx.Tensor(X, device="cuda:0")
    return [x.sum(axis=0).numpy(), x.softmax(-1).numpy(), (x * 2 + 1).relu().numpy()]


def test_cuda_kernels_are_tuned_and_correct(cuda):
    with autotune.configured(True, budget_s=120, kernel_s=20):
        got = gpu_workload()
        searched = stat("autotune_searches")
        new_process()
        again = gpu_workload()
    for g, a, w in zip(got, again, reference()):
        assert_close(g, w, rtol=1e-4, atol=1e-4)
        np.testing.assert_array_equal(a, g)  # the cached choice: the same kernels
    assert searched >= 3 and stat("autotune_timed") == 0 and stat("autotune_hits") >= 3
    entries = [json.loads(p.read_text()) for p in autotune.CACHE_DIR.glob("*.json")]
    assert any(e["params"] for e in entries) or all(e["measured"] >= 1 for e in entries)
    assert all(e["device"] == "cuda:0" and e["ns"] > 0 for e in entries)


@pytest.mark.parametrize("which", ["column sum", "row softmax"])
def test_every_gpu_candidate_computes_the_same_values(cuda, monkeypatch, which):
    make = {"column sum": lambda x: x.sum(axis=0), "row softmax": lambda x: x.softmax(-1)}[which]
    want = reference()[0 if which == "column sum" else 1]
    utils_log, utils.KERNEL_LOG = utils.KERNEL_LOG, []
    try:
        schedule.clear_cache()
        make(zyx.Tensor(X, device="cuda:0")).numpy()
        (k,) = [k for k in utils.KERNEL_LOG if k.reduces()]
    finally:
        utils.KERNEL_LOG = utils_log
    space = cuda.tuning_space(k)
    assert space, "a reduce has something to tune"
    candidates = neighbours(space, {})
    sources = {cuda.render_candidate(k, p) for p in candidates}
    assert len(sources) >= 3
    forced: list[dict] = []
    monkeypatch.setattr(autotune, "tuned_params", lambda dev, kernel: dict(forced[-1]))
    with autotune.configured(True):
        for p in candidates:
            forced.append(p)
            schedule.clear_cache()
            assert_close(make(zyx.Tensor(X, device="cuda:0")), want, rtol=1e-4, atol=1e-4)
    assert not math.isnan(float(want.sum()))

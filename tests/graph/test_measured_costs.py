"""Extraction by measured time (autotune on): a matmul's library and generated alternatives are timed on
scratch inputs, kept on disk, and decide the choice; off by default."""

from __future__ import annotations

import json

import numpy as np
import pytest

import zyx
from zyx import utils
from zyx.backends.registry import registry
from zyx.graph import measure, schedule


@pytest.fixture
def autotune(monkeypatch, tmp_path):
    """Autotuning on, a private measurement file, no cached plans; gives the store."""
    if not any(d.info().kind == "blas" for d in registry().get("host").devices):
        pytest.skip("no BLAS library on the host: no library alternative to measure")
    monkeypatch.setitem(registry().config["autotune"], "enabled", True)
    store = measure.MeasuredCosts(tmp_path / "measured.json")
    monkeypatch.setattr(measure, "STORE", store)
    schedule.clear_cache()
    yield store
    schedule.clear_cache()


def _operands(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    a, b = rng.standard_normal((n, n)).astype(np.float32), rng.standard_normal((n, n)).astype(np.float32)
    return a, b, zyx.Tensor(a).realize(), zyx.Tensor(b).realize()


def _kinds(t: zyx.Tensor) -> set[str]:
    return {s.kind for s in zyx.debug.schedule(t)}


def test_off_by_default_nothing_is_timed(monkeypatch):
    monkeypatch.setitem(registry().config["autotune"], "enabled", False)
    monkeypatch.delenv("ZYX_AUTOTUNE", raising=False)
    schedule.clear_cache()
    a, b, A, B = _operands(48)
    zyx.debug.reset_stats()
    np.testing.assert_allclose((A @ B).numpy(), a @ b, rtol=1e-4, atol=1e-4)
    assert zyx.debug.stats()["measured_alternatives"] == 0


def test_both_alternatives_are_timed_once_then_read_from_disk(autotune):
    a, b, A, B = _operands(64)
    zyx.debug.reset_stats()
    np.testing.assert_allclose((A @ B).numpy(), a @ b, rtol=1e-4, atol=1e-4)
    assert zyx.debug.stats()["measured_alternatives"] == 2
    saved = json.loads(autotune.path.read_text())
    assert sorted(k.rsplit("|", 1)[1].split(":")[0] for k in saved) == ["generated", "library"]
    assert all(v > 0 for v in saved.values())
    # a new process: plans and the in-memory table forgotten, the file read again
    schedule.clear_cache()
    autotune.clear_memory()
    zyx.debug.reset_stats()
    np.testing.assert_allclose((A @ B).numpy(), a @ b, rtol=1e-4, atol=1e-4)
    assert zyx.debug.stats()["measured_alternatives"] == 0


@pytest.mark.parametrize("winner", ["generated", "library"])
def test_the_clock_decides(autotune, winner):
    a, b, A, B = _operands(40, seed=1)
    (A @ B).realize()  # fills the table
    data = json.loads(autotune.path.read_text())
    for k in data:
        data[k] = 1.0 if f"|{winner}:" in k else 1e9
    autotune.path.write_text(json.dumps(data))
    autotune.clear_memory()
    schedule.clear_cache()
    out = A @ B
    assert _kinds(out) == {winner if winner == "generated" else "library"}
    np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-4, atol=1e-4)


def test_sched_debug_names_measured_and_estimated(autotune, monkeypatch, capsys):
    monkeypatch.setattr(utils, "DEBUG", utils.FLAGS["sched"])
    a, b, A, B = _operands(32, seed=2)
    (A @ B).realize()
    err = capsys.readouterr().err
    assert "measured mm b() m32 n32 k32" in err and "(estimated " in err
    assert "generated:reduce=" in err and " measured" in err


def test_transposed_and_batched_operands_are_measured_correctly(autotune):
    rng = np.random.default_rng(3)
    a = rng.standard_normal((3, 24, 16)).astype(np.float32)
    b = rng.standard_normal((3, 20, 16)).astype(np.float32)
    A, B = zyx.Tensor(a).realize(), zyx.Tensor(b).realize()
    zyx.debug.reset_stats()
    out = A @ B.transpose(-1, -2)
    np.testing.assert_allclose(out.numpy(), a @ b.transpose(0, 2, 1), rtol=1e-4, atol=1e-4)
    assert zyx.debug.stats()["measured_alternatives"] == 2


@pytest.mark.parametrize("a_shape,b_shape", [((0, 2, 2), (0, 2, 2)), ((3, 0, 4), (4, 5)), ((2, 3, 0), (0, 4))])
def test_empty_matmuls_are_not_timed(autotune, a_shape, b_shape):
    """Found by the fuzzer with search on: a batch of 0 matmuls reached the BLAS device's split, which divided by
    the batch. An empty product runs nothing, so nothing is timed (a product over an empty k is a constant zero).
    """
    a, b = np.ones(a_shape, np.float32), np.ones(b_shape, np.float32)
    zyx.debug.reset_stats()
    got = (zyx.Tensor(a) @ zyx.Tensor(b)).numpy()
    np.testing.assert_array_equal(got, a @ b)
    assert zyx.debug.stats()["measured_alternatives"] == 0


def _conv(seed: int = 4):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 4, 10, 10)).astype(np.float32)
    w = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)
    X, W = zyx.Tensor(x).realize(), zyx.Tensor(w).realize()
    torch = pytest.importorskip("torch")
    want = torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w), padding=1).numpy()
    return X, W, want


def test_a_convolution_is_timed_whole_both_ways(autotune, monkeypatch):
    """The generated alternative is the convolution's fused kernel read from the input itself (not a GEMM over a
    scratch columns buffer); the library's time includes materializing the columns it reads."""
    X, W, want = _conv()
    clones = []
    real = schedule._generated_timer
    monkeypatch.setattr(schedule, "_generated_timer", lambda out, *rest: clones.append(out) or real(out, *rest))
    zyx.debug.reset_stats()
    out = zyx.nn.functional.conv2d(X, W, padding=1)
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)
    assert zyx.debug.stats()["measured_alternatives"] == 3
    kinds = sorted(k.split("|")[-1].split(":")[0] for k in json.loads(autotune.path.read_text()))
    assert kinds == ["generated", "library", "materialize"]
    generated, materialize = clones
    leaves = [schedule.walk([c])[1] for c in clones]
    assert {c.buffer for c in leaves[0]} == {X.cls.buffer, W.cls.buffer}, "the image and weights, no columns"
    assert [c.buffer for c in leaves[1]] == [X.cls.buffer], "the columns are computed from the image"
    assert materialize.numel == 2 * 10 * 10 * 4 * 9, "the columns: 36 taps of 200 output pixels"


@pytest.mark.parametrize("winner", ["generated", "library"])
def test_the_clock_decides_a_convolution(autotune, winner):
    X, W, want = _conv(seed=5)
    zyx.nn.functional.conv2d(X, W, padding=1).realize()
    data = json.loads(autotune.path.read_text())
    for k in data:
        mine = f"|{winner}:" in k or (winner == "library" and "|materialize:" in k)
        data[k] = 1.0 if mine else 1e9
    autotune.path.write_text(json.dumps(data))
    autotune.clear_memory()
    schedule.clear_cache()
    out = zyx.nn.functional.conv2d(X, W, padding=1)
    kinds = [s.kind for s in zyx.debug.schedule(out)]
    assert ("library" in kinds) == (winner == "library")
    if winner == "generated":
        assert kinds == ["generated"], "one fused kernel, the columns never stored"
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-4, atol=1e-4)

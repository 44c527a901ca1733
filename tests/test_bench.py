"""The benchmark's timing helpers (not timings): settled blocks in turns and NumPy timed in a clean process."""

from __future__ import annotations

import numpy as np
import pytest

from zyx import bench


@pytest.fixture(autouse=True)
def no_settle(monkeypatch):
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)


def test_settled_blocks_times_every_function_and_block() -> None:
    calls = {"a": 0, "b": 0}

    def fn(k):
        def run():
            calls[k] += 1
        return run

    seen = []
    ms = bench.settled_blocks({"a": fn("a"), "b": fn("b")}, rounds=2, per_block=3,
                              elsewhere={"c": lambda k: seen.append(k) or [0.001] * k})
    assert set(ms) == {"a", "b", "c"}
    assert calls == {"a": 8, "b": 8}  # per round: one untimed call, then the block
    assert seen == [3, 3] and ms["c"] == pytest.approx(1.0)
    assert all(v >= 0 for v in ms.values())


def test_clean_numpy_times_a_matmul_in_another_process() -> None:
    a, b = bench._matmul_operands(8, 2)
    # the child's operands are this process's: its setup fails (and the child ends) otherwise
    check = f"\nassert a.tobytes().hex() == {a.tobytes().hex()!r} and b.tobytes().hex() == {b.tobytes().hex()!r}"
    with bench.CleanNumpy() as clean:
        times = clean.block(bench._square_operands(8, 2) + check, "a @ b", 4)
        assert len(times) == 4 and all(0 < t < 1 for t in times)
        assert not np.array_equal(a, b)
        with pytest.raises(RuntimeError, match="NumPy timing process ended"):
            clean.block("assert False", "0", 1)


def test_fixed_launches_run_the_plans_kernels_alone() -> None:
    import zyx
    from zyx.graph import schedule
    from zyx.utils import STATS

    x = np.random.default_rng(0).standard_normal((64, 48)).astype(np.float32)
    y = zyx.Tensor(x).realize().sum(axis=1)
    run = schedule.fixed_launches([y.cls])
    before = STATS["launches"]
    run()
    assert STATS["launches"] == before + len(run.launches) >= before + 1
    assert not y.cls.realized  # the launches wrote their own buffers
    out = run.outputs[0]
    np.testing.assert_allclose(out.pool.view(out.id).view(np.float32), x.sum(axis=1), rtol=1e-5, atol=1e-5)


def test_the_sum_rows_note_their_kernel_alone() -> None:
    import argparse

    row = bench.row_sum(argparse.Namespace(scale=8, repeats=1))  # 64x64
    assert row.name == "row sum 64x64 f32" and row.zyx_ms > 0 and set(row.refs) <= {"numpy", "torch"}
    assert row.note.startswith("its kernel alone ") and " ms" in row.note
    assert ("x torch" in row.note) == ("torch" in row.refs)

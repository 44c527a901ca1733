"""zyx.jit: a captured step replays the same values as the function run as usual, builds no graph, and
refuses what it cannot replay."""

from __future__ import annotations

import numpy as np
import pytest

import zyx
from zyx import nn, optim
from zyx.nn import functional as F

RNG = np.random.default_rng(7)
X = RNG.random((16, 20), dtype=np.float32)
Y = RNG.integers(0, 5, 16)


def _setup(opt_name: str, device: str, dropout: float = 0.0):
    zyx.manual_seed(0)
    layers = [nn.Linear(20, 32), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else []) + [nn.Linear(32, 5)]
    model = nn.Sequential(*layers).to(device)
    params = model.parameters()
    opt = {"sgd": lambda: optim.SGD(params, lr=0.05, momentum=0.9),
           "adam": lambda: optim.Adam(params, lr=1e-2),
           "adamw": lambda: optim.AdamW(params, lr=1e-2)}[opt_name]()

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step(loss)
        return loss

    return model, opt, step


def _run(step, device: str, n: int = 20) -> list[float]:
    return [step(zyx.Tensor(X, device=device), zyx.Tensor(Y, device=device)).item() for _ in range(n)]


@pytest.mark.parametrize("opt_name", ["sgd", "adam", "adamw"])
def test_jitted_steps_equal_the_usual_steps(opt_name: str) -> None:
    m1, _, plain = _setup(opt_name, "host")
    m2, o2, step = _setup(opt_name, "host")
    jitted = zyx.jit(step)
    want, got = _run(plain, "host"), _run(jitted, "host")
    assert got == want  # the same kernels on the same values: bit-equal
    for a, b in zip(m1.parameters(), m2.parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert jitted.captures == 1
    assert getattr(o2, "t", getattr(o2, "steps", None)) == 20  # the replays advanced the step counter


def test_dropout_draws_new_numbers_on_every_replay() -> None:
    _, _, plain = _setup("sgd", "host", dropout=0.5)
    want = _run(plain, "host", 6)
    _, _, step = _setup("sgd", "host", dropout=0.5)
    got = _run(zyx.jit(step), "host", 6)
    assert got == want and len(set(got)) == 6


def test_replays_build_no_graph_and_compile_nothing() -> None:
    _, _, step = _setup("adam", "host")
    jitted = zyx.jit(step)
    _run(jitted, "host", 2)  # run, capture
    zyx.debug.reset_stats()
    _run(jitted, "host", 5)
    s = zyx.debug.stats()
    assert s["jit_replays"] == 5 and s["compiles"] == 0 and s["schedule_cache_misses"] == 0
    assert s["graph_nodes"] == 0 and s["schedule_cache_hits"] == 0, s


def test_earlier_outputs_keep_their_values() -> None:
    w = zyx.Tensor(np.ones(4, np.float32))

    @zyx.jit
    def f(x):
        return x * w + 1, (x - 1).sum()

    outs = [f(zyx.Tensor(np.full(4, i, np.float32))) for i in range(5)]
    for i, (a, b) in enumerate(outs):
        np.testing.assert_array_equal(a.numpy(), np.full(4, i + 1, np.float32))
        assert b.item() == 4 * (i - 1)


def test_new_shapes_capture_again_and_the_cache_is_per_signature() -> None:
    @zyx.jit
    def f(x, scale):
        return (x * scale).sum(0)

    zyx.debug.reset_stats()
    for n in (3, 3, 3, 5, 5, 5, 3):
        got = f(zyx.Tensor(np.ones((n, 2), np.float32)), 2.0)
        np.testing.assert_array_equal(got.numpy(), np.full(2, 2.0 * n, np.float32))
    assert f.captures == 2 and zyx.debug.stats()["jit_replays"] == 3
    np.testing.assert_array_equal(f(zyx.Tensor(np.ones((3, 2), np.float32)), 3.0).numpy(), [9.0, 9.0])


def test_one_tensor_passed_twice_is_its_own_signature() -> None:
    """Captured as ``f(x, x)``, the plan has one leaf; a replay for ``f(x, y)`` read ``y`` for both (30 where
    12 was due), and the other way round."""
    x, y = zyx.Tensor(np.ones(4, np.float32)), zyx.Tensor(np.full(4, 10.0, np.float32))
    for first, then, want in (((x, x), (x, y), 12.0), ((x, y), (x, x), 3.0)):
        @zyx.jit
        def f(a, b):
            return a * 2 + b

        f(*first), f(*first)
        for _ in range(3):  # a capture of its own, then replays
            np.testing.assert_array_equal(f(*then).numpy(), np.full(4, want, np.float32))
        assert f.captures == 2


def test_an_argument_assigned_inside_is_the_new_calls_argument() -> None:
    """A replay rebound the tensor the capture was given, not the argument of its own call."""
    @zyx.jit
    def f(x):
        x.assign(x + 1)
        return x * 10

    for k in range(5):
        t = zyx.Tensor(np.full(2, float(k), np.float32))
        np.testing.assert_array_equal(f(t).numpy(), [10.0 * (k + 1)] * 2)
        np.testing.assert_array_equal(t.numpy(), [k + 1.0] * 2)
    assert f.captures == 1


def test_a_tensor_index_inside_is_computed_as_replays_see_it() -> None:
    """Found by the jit fuzzer: ``x[None, i]`` with an argument ``i`` read ``i`` to check its range while capturing
    (a CaptureError); inside a jitted function a tensor index is computed, as a lazily computed one is."""
    @zyx.jit
    def f(x, i):
        return x[None, i] * 2

    x = zyx.Tensor(np.arange(5, dtype=np.float32))
    for k, want in ((1, 2.0), (2, 4.0), (3, 6.0), (-1, 8.0), (7, 0.0)):  # run, capture, replays (7 reads 0)
        np.testing.assert_array_equal(f(x, zyx.Tensor(np.int64(k))).numpy(), [want])
    assert f.captures == 1


def test_reading_a_value_inside_is_an_error_that_says_why() -> None:
    @zyx.jit
    def f(x):
        if (x.sum() > 0).item():
            return x * 2
        return x

    x = zyx.Tensor(np.ones(3, np.float32))
    f(x)  # the first call runs as usual
    with pytest.raises(zyx.CaptureError, match=r"reading a tensor's value .* cannot be replayed"):
        f(x)
    assert zyx.capture.active is None  # the failed capture left nothing behind


def test_learning_rate_changes_reach_the_replay() -> None:
    _, o1, plain = _setup("sgd", "host")
    _, o2, step = _setup("sgd", "host")
    jitted = zyx.jit(step)
    want = _run(plain, "host", 3)
    got = _run(jitted, "host", 3)
    o1.lr = o2.lr = 0.2
    want += _run(plain, "host", 3)
    got += _run(jitted, "host", 3)
    assert got == want


def test_jitted_training_on_each_device_equals_the_host(device: str) -> None:
    """On cuda (the emulated driver without a GPU) the replay runs each captured plan as one CUDA graph."""
    _, _, plain = _setup("adam", "host")
    want = _run(plain, "host")
    _, _, step = _setup("adam", device)
    got = _run(zyx.jit(step), device)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)


def test_state_assigned_lazily_by_the_previous_call_advances_on_every_replay(device):
    """Call 1 leaves ``count`` pending (count + 1, never read); the capture must not record that pending work
    with the buffers it read then (every replay had restarted from the first value: count stayed at 2)."""
    count = zyx.Tensor(np.zeros((), np.int64), device=device).realize()
    total = zyx.Tensor(np.zeros(2, np.float32), device=device).realize()

    @zyx.jit
    def step(x):
        count.assign(count + 1)
        total.assign(total + x.sum(0))
        return x * 2

    stale = zyx.debug.stats()["jit_stale_captures"]
    for _ in range(6):
        step(zyx.Tensor(np.ones((4, 2), np.float32), device=device))
    assert count.item() == 6
    np.testing.assert_array_equal(total.numpy(), [24, 24])
    assert zyx.debug.stats()["jit_stale_captures"] - stale == 1 and step.captures == 1

"""GPU benchmark of zyx beside PyTorch, measured in the same run (``scripts/gpu_check.sh`` runs it on the GPU machine).

Cases (zyx timings are end to end as a user sees them: build the lazy graph, plan (cached after warm-up), run,
synchronize; inputs are realized before timing; medians after warm-up):

- matmul bf16 / f16 at 4096^3 and 8192^3, f32 with TF32 allowed (torch.backends.cuda.matmul.allow_tf32): TFLOP/s
  and the ratio to ``torch.matmul``; the zyx schedule (cuDNN library node or generated kernel) is in the notes.
- ``relu(a*b+c)*0.5 + exp(-abs(a))`` over 2^28 float32: GB/s (3 reads + 1 write) beside the measured
  device-to-device copy bandwidth (zyx pool copy and ``torch.Tensor.copy_``) and torch eager.
- softmax over the last axis of 8192 x 8192 float32: GB/s (1 read + 1 write) and the ratio to ``torch.softmax``.
- column sum ``x.sum(0)`` of 8192 x 8192 float32: GB/s (1 read), beside ``torch.sum(dim=0)`` and the measured copy
  bandwidth (issue 12: at least 80% of it).
- transpose ``x.T.contiguous()`` of 8192 x 8192 float32: GB/s (1 read + 1 write) in the ``tile`` layout (the
  heuristic's) and the ``thread`` layout (forced), beside torch and the measured copy bandwidth.
- ``x.sum((2, 3)).sum(0)`` of 32x256x56x56 float32: GB/s with ``merge_reduces`` on (one reduce, lanes along the
  image) and off (nested, lanes along the batch), beside torch.
- an embedding's weight gradient (30000x256 float32, 64x128 lookups): ms in the ``scatter`` layout and the
  ``group`` layout (forced), beside torch.
- ``x.cumsum(1)`` of 4096x4096 float32: GB/s in the ``scan`` layout and the ``thread`` layout (forced), beside
  torch.
- f16 matmul 4096^3 with cuDNN off (the generated ``mma.sync`` kernel) beside the same matmul on cuDNN (issue 12: at
  least 50% of cuDNN's TFLOP/s) and ``torch.matmul``.
- the generated matmul's pipeline choices, cuDNN off: f16 4096^3 with 1 / 2 shared stages and ldmatrix off / on,
  and f32 on TF32 tensor cores (``allow_tf32``) beside torch's TF32 matmul.
- tiny launches through the batched worker: 10,000 launches of a one-thread kernel, then one sync (launches/s);
  beside it tiny zyx ops end to end (``(x + 1).realize()``) and torch ``add_`` calls per second.

Every case has its own time limit and the run has a total budget; a failing case is recorded and the rest run.
Writes ``OUTDIR/gpu_bench.json`` and prints a summary table last.

    python scripts/gpu_bench.py --out OUTDIR                  # on a GPU machine
    python scripts/gpu_bench.py --out /tmp/b --device host --smoke   # tiny sizes: exercises the code paths anywhere
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import signal
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zyx  # noqa: E402
from zyx.backends.registry import registry  # noqa: E402


@dataclass
class Row:
    case: str
    unit: str
    zyx: float | None = None
    torch: float | None = None
    refs: dict[str, float] = field(default_factory=dict)
    note: str = ""
    error: str = ""
    seconds: float = 0.0

    @property
    def ratio(self) -> float | None:
        """zyx / torch for throughputs (above 1: zyx is faster)."""
        return self.zyx / self.torch if self.zyx and self.torch else None


class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``CaseTimeout`` in the main thread after ``seconds`` (SIGALRM; POSIX)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def handler(signum, frame):
        raise CaseTimeout(f"over its {seconds:.0f} s limit")

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def median_s(fn: Callable[[], object], sync: Callable[[], None], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Env:
    """Where the benchmark runs: the zyx device and, when importable, torch on the matching device."""

    def __init__(self, device: str, smoke: bool) -> None:
        self.device = device
        self.smoke = smoke
        self.placement = registry().get(device)
        self.dev = self.placement.primary
        self.is_cuda = device.startswith("cuda")
        self.torch = None
        self.tdev = None
        try:
            import torch

            if self.is_cuda and torch.cuda.is_available():
                self.torch, self.tdev = torch, "cuda"
            elif not self.is_cuda:
                self.torch, self.tdev = torch, "cpu"
        except ImportError:
            pass

    def sync(self) -> None:
        self.dev.sync()

    def tsync(self) -> None:
        if self.tdev == "cuda":
            self.torch.cuda.synchronize()

    def repeats(self, n: int) -> int:
        return 2 if self.smoke else n

    def tensor(self, arr: np.ndarray) -> zyx.Tensor:
        return zyx.Tensor(arr, device=self.device).realize()

    def ttensor(self, arr: np.ndarray):
        t = self.torch
        if arr.dtype.name == "bfloat16":
            return t.from_numpy(arr.view(np.int16)).view(t.bfloat16).to(self.tdev)
        return t.from_numpy(arr).to(self.tdev)


def _schedule_note(*tensors: zyx.Tensor) -> str:
    launches = zyx.debug.schedule(*tensors)
    lib = [x.name for x in launches if x.kind == "library"]
    gen = sum(1 for x in launches if x.kind == "generated")
    return (f"library {', '.join(lib)}" if lib else "no library node") + f" + {gen} generated"


def _mma_note(*tensors: zyx.Tensor) -> str:
    """The block tile and shared stages of the generated ``mma`` kernel(s), read from the rendered source."""
    import re

    shapes = re.compile(r"unsigned int zsa\[(\d+)\]\[(\d+)\]\[\d+\];\s*__shared__ __align__\(16\) "
                        r"unsigned int zsb\[\d+\]\[(\d+)\]")
    ring = re.compile(r"zsa\)\[(\d+)\]\[(\d+)\] = .*\n.*zsb\)\[(\d+)\]\[(\d+)\] = .*\(zsh \+ (\d+)\)")
    sources = zyx.debug.kernel_source(*tensors)
    found = [f"mma {bm}x{bn} tile, {st} stage(s)" for src in sources for st, bm, bn in
             (m.groups() for m in shapes.finditer(src))]
    found += [f"mma cp.async ring of {int(at) // (int(a0) * int(a1))}, tiles a[{a0}][{a1}] b[{b0}][{b1}]"
              for src in sources for a0, a1, b0, b1, at in (m.groups() for m in ring.finditer(src))]
    return ", ".join(found) or "no mma kernel"


def _random(shape: tuple[int, ...], dtype: str, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    if dtype == "bfloat16":
        import ml_dtypes

        return x.astype(ml_dtypes.bfloat16)
    return x.astype(dtype)


# ---------------------------------------------------------------------------------------------------------------
# cases


def case_matmul(env: Env, dtype: str, n: int) -> Row:
    if env.smoke:
        n = n // 64
    row = Row(f"matmul {dtype} {n}^3" + (" (TF32)" if dtype == "float32" else ""), "TFLOP/s")
    a_np, b_np = _random((n, n), dtype, 0), _random((n, n), dtype, 1)
    a, b = env.tensor(a_np), env.tensor(b_np)
    flops = 2.0 * n**3
    reps = env.repeats(20 if n <= 4096 else 10)
    with _allowed_tf32(env, dtype == "float32"):  # zyx's default is exact FP32, as torch's
        row.note = _schedule_note(a @ b)
        row.zyx = flops / median_s(lambda: (a @ b).realize(), env.sync, reps) / 1e12
        z = (a @ b).numpy().astype(np.float32)
    if env.torch is not None:
        t = env.torch
        if dtype == "float32" and env.tdev == "cuda":
            t.backends.cuda.matmul.allow_tf32 = True
        ta, tb = env.ttensor(a_np), env.ttensor(b_np)
        row.torch = flops / median_s(lambda: ta @ tb, env.tsync, reps) / 1e12
        ref = (ta @ tb).float().cpu().numpy()
        err = float(np.max(np.abs(z - ref)) / max(np.max(np.abs(ref)), 1e-30))
        row.note += f"; max rel diff vs torch {err:.1e}"
    return row


def case_elementwise(env: Env) -> list[Row]:
    n = 1 << (16 if env.smoke else 28)
    x = np.random.default_rng(2).standard_normal(n, dtype=np.float32)
    a = env.tensor(x)
    b = (a * 0.7 + 0.1).realize()
    c = (a * -1.3).realize()

    def f(a, b, c):
        return (a * b + c).relu() * 0.5 + (-a.abs()).exp()

    ew = Row(f"relu(a*b+c)*0.5+exp(-|a|) 2^{n.bit_length() - 1} f32", "GB/s")
    ew.note = _schedule_note(f(a, b, c))
    reps = env.repeats(10)
    ew.zyx = 16.0 * n / median_s(lambda: f(a, b, c).realize(), env.sync, reps) / 1e9
    y = f(a, b, c).numpy()
    k = min(n, 1 << 20)
    xb, xc = x[:k] * np.float32(0.7) + np.float32(0.1), x[:k] * np.float32(-1.3)
    want = np.maximum(x[:k] * xb + xc, 0) * 0.5 + np.exp(-np.abs(x[:k]))
    ew.note += f"; max abs err vs NumPy {float(np.max(np.abs(y[:k] - want))):.1e}"

    copy = Row(f"device copy 2^{n.bit_length() - 1} f32 (read+write)", "GB/s")
    pool = env.placement.pool
    src = a.cls.buffer.id
    dst = pool.allocate(4 * n)
    try:
        copy.zyx = 8.0 * n / median_s(lambda: pool.pool_to_pool(pool, src, dst), env.sync, reps) / 1e9
    finally:
        pool.release(dst)
    if env.torch is not None:
        t = env.torch
        ta, tb, tc = env.ttensor(x), None, None
        tb, tc = ta * 0.7 + 0.1, ta * -1.3
        tout = t.empty_like(ta)
        copy.torch = 8.0 * n / median_s(lambda: tout.copy_(ta), env.tsync, reps) / 1e9
        ew.torch = 16.0 * n / median_s(lambda: t.relu(ta * tb + tc) * 0.5 + t.exp(-t.abs(ta)), env.tsync,
                                       reps) / 1e9
    best_copy = max(v for v in (copy.zyx, copy.torch) if v)
    ew.refs["copy_GBps"] = best_copy
    ew.note += f"; {100 * ew.zyx / best_copy:.0f}% of the measured copy bandwidth"
    return [ew, copy]


def case_elementwise_half(env: Env, dtype: str = "float16") -> Row:
    """``a * b + c`` on 16-bit values: 3 reads and a write of 2 bytes per element (the 16-byte vector accesses of
    8 halves per thread; ``gpu.plan_vector``)."""
    n = 1 << (16 if env.smoke else 28)
    xs = [_random((n,), dtype, seed) for seed in (3, 4, 5)]
    a, b, c = (env.tensor(x) for x in xs)
    row = Row(f"a*b+c 2^{n.bit_length() - 1} {dtype}", "GB/s")
    row.note = _schedule_note(a * b + c)
    reps = env.repeats(10)
    row.zyx = 8.0 * n / median_s(lambda: (a * b + c).realize(), env.sync, reps) / 1e9
    k = min(n, 1 << 20)
    want = (xs[0][:k].astype(np.float32) * xs[1][:k].astype(np.float32)).astype(xs[0].dtype).astype(np.float32)
    want = (want + xs[2][:k].astype(np.float32)).astype(xs[0].dtype).astype(np.float32)
    got = (a * b + c).cast("float32").numpy()[:k]
    row.note += f"; max abs err vs NumPy {float(np.max(np.abs(got - want))):.1e}"
    if env.torch is not None:
        ta, tb, tc = (env.ttensor(x) for x in xs)
        row.torch = 8.0 * n / median_s(lambda: ta * tb + tc, env.tsync, reps) / 1e9
    return row


def case_softmax(env: Env) -> Row:
    n = 256 if env.smoke else 8192
    row = Row(f"softmax {n}x{n} f32 (last axis)", "GB/s")
    x_np = _random((n, n), "float32", 3)
    x = env.tensor(x_np)
    row.note = _schedule_note(x.softmax(-1))
    reps = env.repeats(10)
    nbytes = 2.0 * 4 * n * n
    row.zyx = nbytes / median_s(lambda: x.softmax(-1).realize(), env.sync, reps) / 1e9
    got = x.softmax(-1).numpy()[:64].astype(np.float64)
    e = np.exp(x_np[:64] - x_np[:64].max(-1, keepdims=True))
    row.note += f"; max abs err vs NumPy {float(np.max(np.abs(got - e / e.sum(-1, keepdims=True)))):.1e}"
    if env.torch is not None:
        tx = env.ttensor(x_np)
        row.torch = nbytes / median_s(lambda: env.torch.softmax(tx, -1), env.tsync, reps) / 1e9
    return row


def _copy_gbps(env: Env, x: zyx.Tensor, reps: int) -> float:
    """The device-to-device copy bandwidth of ``x``'s buffer into a scratch one (bytes read and written)."""
    pool = env.placement.pool
    nbytes = x.cls.nbytes
    dst = pool.allocate(nbytes)
    try:
        return 2.0 * nbytes / median_s(lambda: pool.pool_to_pool(pool, x.cls.buffer.id, dst), env.sync, reps) / 1e9
    finally:
        pool.release(dst)


def case_column_sum(env: Env) -> Row:
    n = 256 if env.smoke else 8192
    row = Row(f"column sum {n}x{n} f32 (x.sum(0))", "GB/s")
    x_np = _random((n, n), "float32", 4)
    x = env.tensor(x_np)
    row.note = _schedule_note(x.sum(0))
    reps = env.repeats(10)
    nbytes = 4.0 * n * n
    row.zyx = nbytes / median_s(lambda: x.sum(0).realize(), env.sync, reps) / 1e9
    err = float(np.max(np.abs(x.sum(0).numpy() - x_np.astype(np.float64).sum(0))))
    row.note += f"; max abs err vs float64 NumPy {err:.1e}"
    copy = _copy_gbps(env, x, reps)
    row.refs["copy_GBps"] = copy
    row.note += f"; {100 * row.zyx / copy:.0f}% of the measured copy bandwidth ({copy:.0f} GB/s)"
    if env.torch is not None:
        tx = env.ttensor(x_np)
        row.torch = nbytes / median_s(lambda: tx.sum(0), env.tsync, reps) / 1e9
    return row


def case_transpose(env: Env) -> list[Row]:
    """``x.T.contiguous()`` of 8192^2 float32: the ``tile`` layout (reads staged in shared tiles, the heuristic's
    choice) beside the ``thread`` layout (forced: coalesced writes, reads a row apart from lane to lane), torch
    and the device copy of the same bytes."""
    from zyx.kernel import gpu

    n = 256 if env.smoke else 8192
    x_np = _random((n, n), "float32", 9)
    x = env.tensor(x_np)
    reps = env.repeats(10)
    nbytes = 8.0 * n * n
    rows = []
    for name, params in (("tile layout", {}), ("thread layout", {"strategy": gpu.STRATEGIES.index("thread")})):
        row = Row(f"transpose {n}x{n} f32 (x.T.contiguous()), {name}", "GB/s")
        with _forced_gpu_params(env, **params):
            row.note = _schedule_note(x.T.contiguous())
            row.zyx = nbytes / median_s(lambda: x.T.contiguous().realize(), env.sync, reps) / 1e9
            ok = bool(np.array_equal(x.T.contiguous().numpy(), x_np.T))
        row.note += f"; equal to NumPy: {ok}"
        rows.append(row)
    if env.torch is not None:
        tx = env.ttensor(x_np)
        torch_gbps = nbytes / median_s(lambda: tx.T.contiguous(), env.tsync, reps) / 1e9
        for row in rows:
            row.torch = torch_gbps
    copy = _copy_gbps(env, x, reps)
    for row in rows:
        row.refs["copy_GBps"] = copy
        row.note += f"; {100 * row.zyx / copy:.0f}% of the measured copy bandwidth ({copy:.0f} GB/s)"
    return rows


def case_nested_sum(env: Env) -> list[Row]:
    """``x.sum((2, 3)).sum(0)`` of 32x256x56x56 float32 (a depthwise convolution's weight gradient sums so): one
    kernel, its reduces merged (``merge_reduces``, the default: the lanes walk the image) and nested (the pass off:
    the lanes walk the batch), beside torch. GB/s counts the input read once."""
    shape = (4, 16, 8, 8) if env.smoke else (32, 256, 56, 56)
    x_np = _random(shape, "float32", 10)
    x = env.tensor(x_np)
    reps = env.repeats(10)
    nbytes = 4.0 * x_np.size
    want = x_np.astype(np.float64).sum((2, 3)).sum(0)
    rows = []
    for name, off in (("merged", ()), ("nested (merge_reduces off)", ("merge_reduces",))):
        row = Row(f"sum over the batch of sums over the image {'x'.join(map(str, shape))} f32, {name}", "GB/s")
        with _forced_gpu_params(env, passes_off=off):
            row.note = _schedule_note(x.sum((2, 3)).sum(0))
            row.zyx = nbytes / median_s(lambda: x.sum((2, 3)).sum(0).realize(), env.sync, reps) / 1e9
            err = float(np.max(np.abs(x.sum((2, 3)).sum(0).numpy() - want) / np.max(np.abs(want))))
        row.note += f"; max rel err vs float64 NumPy {err:.1e}"
        rows.append(row)
    if env.torch is not None:
        tx = env.ttensor(x_np)
        torch_gbps = nbytes / median_s(lambda: tx.sum((2, 3)).sum(0), env.tsync, reps) / 1e9
        for row in rows:
            row.torch = torch_gbps
    return rows


def case_embedding_backward(env: Env) -> list[Row]:
    """The weight gradient of an embedding of 30000x256 float32 read at 64x128 indices (the cross-entropy
    models' first layer): the ``scatter`` layout (the heuristic's: bins of rows per thread) beside the ``group``
    layout (forced: every row compares every index), torch, ms per gradient (the forward's lookups included)."""
    from zyx.kernel import gpu
    from zyx.nn import functional as F

    rows, dim, lookups = (300, 16, (4, 8)) if env.smoke else (30000, 256, (64, 128))
    rng = np.random.default_rng(11)
    idx_np = rng.integers(0, rows, lookups)
    g_np = rng.standard_normal((*lookups, dim)).astype(np.float32)
    idx, g = env.tensor(idx_np), env.tensor(g_np)
    w = zyx.Tensor(np.zeros((rows, dim), np.float32), device=env.device, requires_grad=True).realize()
    want = np.zeros((rows, dim), np.float64)
    np.add.at(want, idx_np, g_np.astype(np.float64))
    reps = env.repeats(10)

    def grad():
        w.grad = None
        (F.embedding(idx, w) * g).sum().backward()
        return w.grad.realize()

    out = []
    for name, params in (("scatter layout", {}), ("group layout", {"strategy": gpu.STRATEGIES.index("group")})):
        row = Row(f"embedding {rows}x{dim} backward, {'x'.join(map(str, lookups))} lookups f32, {name}", "ms")
        with _forced_gpu_params(env, **params):
            row.zyx = 1e3 * median_s(grad, env.sync, reps)
            err = float(np.max(np.abs(grad().numpy() - want)))
        row.note = f"max abs err vs float64 NumPy {err:.1e}"
        out.append(row)
    if env.torch is not None:
        t = env.torch
        tw = t.zeros((rows, dim), device=env.tdev, requires_grad=True)
        ti, tg = env.ttensor(idx_np), env.ttensor(g_np)

        def tgrad():
            tw.grad = None
            (t.nn.functional.embedding(ti, tw) * tg).sum().backward()
            return tw.grad

        ms = 1e3 * median_s(tgrad, env.tsync, reps)
        for row in out:
            row.torch = ms
    return out


def case_cumsum(env: Env) -> list[Row]:
    """``x.cumsum(1)`` of 4096x4096 float32 (rows scanned in chunks of 1024, then across the chunks): the ``scan``
    layout (the heuristic's: a group of lanes per row, each a chunk) beside the ``thread`` layout (forced: one
    thread per row, serial) and torch. GB/s counts one read and one write."""
    from zyx.kernel import gpu

    n = 256 if env.smoke else 4096
    x_np = _random((n, n), "float32", 12)
    x = env.tensor(x_np)
    reps = env.repeats(10)
    nbytes = 8.0 * n * n
    want = np.cumsum(x_np[:8].astype(np.float64), 1)
    rows = []
    for name, params in (("scan layout", {}), ("thread layout", {"strategy": gpu.STRATEGIES.index("thread")})):
        row = Row(f"cumsum {n}x{n} f32 along rows, {name}", "GB/s")
        with _forced_gpu_params(env, **params):
            row.note = _schedule_note(x.cumsum(1))
            row.zyx = nbytes / median_s(lambda: x.cumsum(1).realize(), env.sync, reps) / 1e9
            err = float(np.max(np.abs(x.cumsum(1).numpy()[:8] - want)))
        row.note += f"; max abs err vs float64 NumPy (8 rows) {err:.1e}"
        rows.append(row)
    if env.torch is not None:
        tx = env.ttensor(x_np)
        gbps = nbytes / median_s(lambda: env.torch.cumsum(tx, 1), env.tsync, reps) / 1e9
        for row in rows:
            row.torch = gbps
    return rows


def case_matmul_generated(env: Env, dtype: str = "float16", n: int = 4096) -> Row:
    """The generated (tensor-core ``mma.sync``) matmul, cuDNN off, beside cuDNN's on the same device."""
    if env.smoke:
        n = n // 64
    row = Row(f"matmul {dtype} {n}^3, generated (cuDNN off)", "TFLOP/s")
    a_np, b_np = _random((n, n), dtype, 5), _random((n, n), dtype, 6)
    a, b = env.tensor(a_np), env.tensor(b_np)
    flops = 2.0 * n**3
    reps = env.repeats(10)
    cudnn = getattr(env.dev, "_cudnn", None)
    with_lib = flops / median_s(lambda: (a @ b).realize(), env.sync, reps) / 1e12
    from zyx.graph import schedule

    env.dev._cudnn = None  # no library alternative: the matmul is a generated kernel
    schedule.clear_cache()
    try:
        row.note = ("" if env.is_cuda else "(not cuda: the host's BLAS stays on) ") + _schedule_note(a @ b)
        row.note += f" ({_mma_note(a @ b)})"
        row.zyx = flops / median_s(lambda: (a @ b).realize(), env.sync, reps) / 1e12
        z = (a @ b).numpy().astype(np.float32)
    finally:
        env.dev._cudnn = cudnn
        schedule.clear_cache()
    row.refs["library_TFLOPs"] = with_lib
    row.note += f"; {100 * row.zyx / with_lib:.0f}% of the library path ({with_lib:.1f} TFLOP/s)"
    ref = a_np.astype(np.float32)[:64] @ b_np.astype(np.float32)
    row.note += f"; max abs err vs float32 NumPy (64 rows) {float(np.max(np.abs(z[:64] - ref))):.1e}"
    if env.torch is not None:
        ta, tb = env.ttensor(a_np), env.ttensor(b_np)
        row.torch = flops / median_s(lambda: ta @ tb, env.tsync, reps) / 1e12
    return row


@contextlib.contextmanager
def _allowed_tf32(env: Env, on: bool) -> Iterator[None]:
    """Within the block (when ``on``) float32 matmuls may run on TF32 tensor cores: cuDNN's and the generated."""
    import dataclasses

    from zyx.graph import schedule

    cudnn, info = getattr(env.dev, "_cudnn", None), getattr(env.dev, "_info", None)
    if not on or info is None:
        yield
        return
    env.dev._info = dataclasses.replace(info, allow_tf32=info.tensor_cores)
    was = cudnn.allow_tf32 if cudnn is not None else False
    if cudnn is not None:
        cudnn.allow_tf32 = True
    schedule.clear_cache()
    try:
        yield
    finally:
        env.dev._info = info
        if cudnn is not None:
            cudnn.allow_tf32 = was
        schedule.clear_cache()


@contextlib.contextmanager
def _forced_gpu_params(env: Env, allow_tf32: bool | None = None, passes_off: tuple[str, ...] = (),
                       **params: int) -> Iterator[None]:
    """Within the block every generated CUDA kernel takes ``params`` (``kernel.gpu.search_space`` names) over the
    heuristics' choices without the optional GPU passes ``passes_off``, the device reports ``allow_tf32`` when
    given, and cuDNN is off (schedules rebuilt)."""
    import dataclasses

    from zyx.graph import schedule
    from zyx.kernel import gpu

    real, info, cudnn, disabled = gpu.optimize, env.dev._info, getattr(env.dev, "_cudnn", None), set(gpu.DISABLED)
    gpu.optimize = lambda k, inf, p=None: real(k, inf, {**(p or {}), **params})
    gpu.DISABLED.update(passes_off)
    if allow_tf32 is not None:
        env.dev._info = dataclasses.replace(info, allow_tf32=allow_tf32 and info.tensor_cores)
    env.dev._cudnn = None
    schedule.clear_cache()
    try:
        yield
    finally:
        gpu.optimize, env.dev._info, env.dev._cudnn = real, info, cudnn
        gpu.DISABLED.clear()
        gpu.DISABLED.update(disabled)
        schedule.clear_cache()


def _square_matmul(env: Env, n: int) -> tuple[int, float, int]:
    """(size, flops, repeats) of an ``n``-cubed matmul case (``n / 64`` in a smoke run)."""
    n = n // 64 if env.smoke else n
    return n, 2.0 * n**3, env.repeats(10)


def case_matmul_generated_variants(env: Env, n: int = 4096) -> list[Row]:
    """The generated matmul's pipeline choices timed side by side, cuDNN off: shared stages 1 / 2 and ldmatrix
    on / off for float16, the cp.async ring (``mma_async``, off by default until these rows say otherwise) on
    128x128, 128x64 and the 64x64-warp tiles 128x256 and 256x128, then float32 on TF32 tensor cores
    (allow_tf32) beside torch's TF32 matmul. What the heuristics pick (2 stages, ldmatrix, no cp.async) is only
    right if its row beats the others."""
    if not env.is_cuda:
        return []
    n, flops, reps = _square_matmul(env, n)
    rows = []
    a_np, b_np = _random((n, n), "float16", 5), _random((n, n), "float16", 6)
    a, b = env.tensor(a_np), env.tensor(b_np)
    want = a_np.astype(np.float32)[:64] @ b_np.astype(np.float32)
    variants = [(f"{stages} stage(s), ldmatrix {'on' if ldm else 'off'}", {"mma_stages": stages, "mma_ldmatrix": ldm})
                for stages, ldm in ((1, 0), (2, 0), (2, 1))]
    variants += [(f"cp.async ring, tile {tile}", {"mma_async": 1, "mma_tile": tile}) for tile in (0, 1, 6, 7)]
    for name, params in variants:
        row = Row(f"matmul float16 {n}^3 generated, {name}", "TFLOP/s")
        with _forced_gpu_params(env, **params):
            row.note = _mma_note(a @ b)
            row.zyx = flops / median_s(lambda: (a @ b).realize(), env.sync, reps) / 1e12
            z = (a @ b).numpy().astype(np.float32)
        row.note += f"; max abs err vs float32 NumPy (64 rows) {float(np.max(np.abs(z[:64] - want))):.1e}"
        rows.append(row)
    a_np, b_np = _random((n, n), "float32", 7), _random((n, n), "float32", 8)
    a, b = env.tensor(a_np), env.tensor(b_np)
    row = Row(f"matmul float32 {n}^3 generated on TF32 tensor cores (allow_tf32)", "TFLOP/s")
    with _forced_gpu_params(env, allow_tf32=True):
        row.note = _mma_note(a @ b)
        row.zyx = flops / median_s(lambda: (a @ b).realize(), env.sync, reps) / 1e12
        z = (a @ b).numpy()
    ref = a_np[:64].astype(np.float64) @ b_np.astype(np.float64)
    err = float(np.max(np.abs(z[:64] - ref)) / np.max(np.abs(ref)))
    row.note += f"; max rel err vs float64 NumPy (64 rows) {err:.1e}"
    if env.torch is not None:
        t = env.torch
        t.backends.cuda.matmul.allow_tf32 = True
        ta, tb = env.ttensor(a_np), env.ttensor(b_np)
        row.torch = flops / median_s(lambda: ta @ tb, env.tsync, reps) / 1e12
    rows.append(row)
    return rows


def case_matmul_simt(env: Env, n: int = 4096) -> list[Row]:
    """Exact float32 matmul (``allow_tf32`` off, PyTorch's default; cuDNN off): the generated ``simt`` layout (register
    tiles over shared-memory tiles on CUDA cores) for each tiling, beside the ``thread`` layout that float32
    contractions took before it and torch's FP32 matmul (its TF32 off)."""
    if not env.is_cuda:
        return []
    from zyx.kernel import gpu

    n, flops, reps = _square_matmul(env, n)
    a_np, b_np = _random((n, n), "float32", 9), _random((n, n), "float32", 10)
    a, b = env.tensor(a_np), env.tensor(b_np)
    ref = a_np[:64].astype(np.float64) @ b_np.astype(np.float64)
    simt = gpu.STRATEGIES.index("simt")
    variants = [("simt layout (heuristic tile)", {"strategy": simt})]
    variants += [(f"simt tile {gpu.SIMT_TILES[i]}", {"strategy": simt, "simt_tile": i})
                 for i in range(len(gpu.SIMT_TILES))]
    variants += [("simt, 1 stage", {"strategy": simt, "simt_stages": 1}),
                 ("thread layout (before simt)", {"strategy": gpu.STRATEGIES.index("thread")})]
    rows = []
    for name, params in variants:
        row = Row(f"matmul float32 {n}^3 exact, generated, {name}", "TFLOP/s")
        with _forced_gpu_params(env, allow_tf32=False, **params):
            row.note = _schedule_note(a @ b)
            row.zyx = flops / median_s(lambda: (a @ b).realize(), env.sync, reps) / 1e12
            z = (a @ b).numpy()
        err = float(np.max(np.abs(z[:64] - ref)) / np.max(np.abs(ref)))
        row.note += f"; max rel err vs float64 NumPy (64 rows) {err:.1e}"
        rows.append(row)
    if env.torch is not None:
        t = env.torch
        t.backends.cuda.matmul.allow_tf32 = False
        ta, tb = env.ttensor(a_np), env.ttensor(b_np)
        tflops = flops / median_s(lambda: ta @ tb, env.tsync, reps) / 1e12
        for row in rows:
            row.torch = tflops
    return rows


TINY = r"""
extern "C" __global__ void zyx_bench_tiny(float* out) {
  if (threadIdx.x == 0) out[0] += 1.0f;
}
"""


def case_conv2d(env: Env, dtype: str = "float32") -> Row:
    """A 3x3 convolution, padding 1, exact float32 on both sides (zyx on CUDA without TF32: its generated kernel,
    the windows of the padded input read by the GEMM itself; torch's cuDNN with ``allow_tf32`` off)."""
    from zyx.nn import functional as F

    n, c, o, s = (2, 8, 16, 12) if env.smoke else (32, 64, 128, 56)
    row = Row(f"conv2d {dtype} {n}x{c}x{s}x{s} * {o}x{c}x3x3 pad 1", "TFLOP/s")
    x_np, w_np = _random((n, c, s, s), dtype, 7), _random((o, c, 3, 3), dtype, 8) * 0.1
    x, w = env.tensor(x_np), env.tensor(w_np)
    flops = 2.0 * n * o * s * s * c * 9
    reps = env.repeats(10)
    row.note = _schedule_note(F.conv2d(x, w, padding=1))
    row.zyx = flops / median_s(lambda: F.conv2d(x, w, padding=1).realize(), env.sync, reps) / 1e12
    z = F.conv2d(x, w, padding=1).numpy().astype(np.float32)
    if env.torch is not None:
        t = env.torch
        tx, tw = env.ttensor(x_np), env.ttensor(w_np)
        saved = t.backends.cudnn.allow_tf32
        t.backends.cudnn.allow_tf32 = False
        try:
            row.torch = flops / median_s(lambda: t.nn.functional.conv2d(tx, tw, padding=1), env.tsync, reps) / 1e12
            ref = t.nn.functional.conv2d(tx, tw, padding=1).float().cpu().numpy()
        finally:
            t.backends.cudnn.allow_tf32 = saved
        err = float(np.max(np.abs(z - ref)) / max(np.max(np.abs(ref)), 1e-30))
        row.note += f"; max rel diff vs torch {err:.1e}"
    return row


def case_tiny(env: Env) -> list[Row]:
    rows = []
    n = 200 if env.smoke else 10_000
    if env.is_cuda:
        from zyx.backends.cuda.args import KernelSpec

        dev = env.dev
        pid = dev.compile_source(TINY, KernelSpec("zyx_bench_tiny", (1, 1, 1), (32, 1, 1), 0, ("out",), (None,)))
        pool = env.placement.pool
        buf = pool.allocate(4)
        pool.host_to_pool(memoryview(np.zeros(1, np.float32).view(np.uint8)), buf)
        args = [buf]
        dev.launch(pid, args)
        dev.sync()
        t0 = time.perf_counter()
        for _ in range(n):
            dev.launch(pid, args)
        dev.sync()
        row = Row(f"{n} tiny launches, one sync", "launches/s", zyx=n / (time.perf_counter() - t0))
        out = np.empty(1, np.float32)
        pool.pool_to_host(buf, memoryview(out.view(np.uint8)))
        row.note = f"counter {out[0]:.0f} (want {n + 1}): every launch ran in order through the window"
        pool.release(buf)
        dev.release(pid)
        rows.append(row)
    ops = 100 if env.smoke else 2000
    x = env.tensor(np.zeros(16, np.float32))
    row = Row(f"tiny zyx ops end to end ((x+1).realize() x{ops})", "ops/s")

    def many():
        y = x
        for _ in range(ops):
            y = (y + 1).realize()
        return y

    many()
    env.sync()
    t0 = time.perf_counter()
    y = many()
    env.sync()
    row.zyx = ops / (time.perf_counter() - t0)
    row.note = f"result {float(y.numpy()[0]):.0f} (want {ops})"
    if env.torch is not None:
        tx = env.ttensor(np.zeros(16, np.float32))

        def tmany():
            for _ in range(ops):
                tx.add_(1)

        tmany()
        env.tsync()
        t0 = time.perf_counter()
        tmany()
        env.tsync()
        row.torch = ops / (time.perf_counter() - t0)
    rows.append(row)
    return rows


# ---------------------------------------------------------------------------------------------------------------
# driver


def cases(env: Env) -> list[tuple[str, Callable[[], Row | list[Row]], float]]:
    """(name, run, time limit in seconds)."""
    out: list[tuple[str, Callable[[], Row | list[Row]], float]] = []

    def matmul(dtype: str, n: int) -> None:
        out.append((f"matmul {dtype} {n}", lambda: case_matmul(env, dtype, n), 30))

    # one case of every kind first, so a short budget still covers them all
    for dtype in ("bfloat16", "float16", "float32"):
        matmul(dtype, 8192)
    out.append(("elementwise", lambda: case_elementwise(env), 45))
    out.append(("elementwise float16", lambda: case_elementwise_half(env), 30))
    out.append(("softmax", lambda: case_softmax(env), 30))
    out.append(("column sum", lambda: case_column_sum(env), 30))
    out.append(("transpose", lambda: case_transpose(env), 30))
    out.append(("nested sum", lambda: case_nested_sum(env), 30))
    out.append(("embedding backward", lambda: case_embedding_backward(env), 45))
    out.append(("cumsum", lambda: case_cumsum(env), 30))
    out.append(("matmul generated", lambda: case_matmul_generated(env), 60))
    out.append(("matmul generated variants", lambda: case_matmul_generated_variants(env), 90))
    out.append(("matmul float32 exact (simt)", lambda: case_matmul_simt(env), 90))
    out.append(("tiny launches", lambda: case_tiny(env), 30))
    out.append(("conv2d", lambda: case_conv2d(env), 30))
    for dtype in ("bfloat16", "float16", "float32"):
        matmul(dtype, 4096)
    return out


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:,.0f}" if v >= 1000 else f"{v:.3g}" if v < 10 else f"{v:.1f}"


def table(rows: list[Row]) -> str:
    head = ("case", "unit", "zyx", "torch", "zyx/torch", "note")
    body = [(r.case, r.unit, fmt(r.zyx), fmt(r.torch), f"{r.ratio:.2f}" if r.ratio else "-",
             ("ERROR: " + r.error) if r.error else r.note) for r in rows]
    widths = [max(len(x[i]) for x in [head, *body]) for i in range(5)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head[:5], widths)) + "  " + head[5]]
    lines.append("-" * (sum(widths) + 10 + 40))
    for b in body:
        lines.append("  ".join(c.ljust(w) for c, w in zip(b[:5], widths)) + "  " + b[5])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_bench.json")
    ap.add_argument("--device", default="cuda", help="zyx device (default cuda)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, 2 repeats: checks the code paths only")
    ap.add_argument("--budget-s", type=float, default=240.0, help="total time budget; later cases are skipped")
    ap.add_argument("--only", default="", help="comma list of case name prefixes to run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    report: dict = {"device": args.device, "smoke": args.smoke, "python": platform.python_version(),
                    "backends": registry().report(), "rows": []}
    rows: list[Row] = []
    try:
        env = Env(args.device, args.smoke)
    except Exception as e:  # noqa: BLE001 - no GPU here: say so in the JSON and the table
        report["error"] = f"{type(e).__name__}: {e}"
        (out / "gpu_bench.json").write_text(json.dumps(report, indent=2))
        print(f"gpu_bench: {args.device} unavailable: {e}")
        return 2
    info = env.dev.info()
    report["device_info"] = {"name": info.extra.get("device_name", info.name), "compute_units": info.compute_units,
                             "memory_gbps_estimate": info.memory_gbps}
    report["torch"] = getattr(env.torch, "__version__", None)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    for name, run, limit in cases(env):
        if only and not any(name.startswith(p) for p in only):
            continue
        left = args.budget_s - (time.perf_counter() - started)
        if left < 5:
            rows.append(Row(name, "", error="skipped: total budget spent"))
            continue
        t0 = time.perf_counter()
        print(f"[gpu_bench] {name} ...", flush=True)
        stop = False
        try:
            with time_limit(min(limit, left)):
                got = run()
            new = got if isinstance(got, list) else [got]
        except KeyboardInterrupt:  # the caller's time limit (gpu_check.sh sends SIGINT): report what we have
            new, stop = [Row(name, "", error="interrupted")], True
        except Exception as e:  # noqa: BLE001 - record and go on with the next case
            traceback.print_exc()
            new = [Row(name, "", error=f"{type(e).__name__}: {e}"[:300])]
        for r in new:
            r.seconds = round(time.perf_counter() - t0, 2)
        rows.extend(new)
        gc.collect()
        try:
            env.sync()
        except Exception as e:  # noqa: BLE001 - a failed case may leave an error behind
            print(f"[gpu_bench] sync after {name}: {e}", flush=True)
        (out / "gpu_bench.json").write_text(json.dumps({**report, "rows": [asdict(r) | {"ratio": r.ratio}
                                                                             for r in rows]}, indent=2))
        if stop:
            break
    report["rows"] = [asdict(r) | {"ratio": r.ratio} for r in rows]
    report["seconds"] = round(time.perf_counter() - started, 1)
    (out / "gpu_bench.json").write_text(json.dumps(report, indent=2))
    print(f"\nzyx {args.device} ({report['device_info']['name']}) beside torch {report['torch'] or 'n/a'}, "
          f"{report['seconds']} s; JSON: {out / 'gpu_bench.json'}")
    print(table(rows))
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())

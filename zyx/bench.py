"""``python -m zyx.bench``: zyx beside NumPy (and PyTorch eager when importable), medians after warm-up.

Every zyx timing is end to end as a user sees it: building the lazy graph, planning (cached after the
warm-up), and running until the result is realized. Inputs are realized before timing starts. Ratios are
reference time / zyx time (above 1: zyx is faster), measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

import zyx
from zyx.graph import schedule


@dataclass
class Row:
    name: str
    zyx_ms: float
    refs: dict[str, float] = field(default_factory=dict)  # reference name -> ms
    note: str = ""

    def ratio(self, ref: str) -> float | None:
        return self.refs[ref] / self.zyx_ms if ref in self.refs and self.zyx_ms > 0 else None


SETTLE_S = 0.2  # longer than the ~0.1 s OpenBLAS's threads busy-wait after a call here (OpenMP's: a few ms)


def settle() -> None:
    """Let every library's worker threads go idle before a measurement. Idle pools busy-wait after a call (NumPy's
    OpenBLAS for ~0.1 s): on a 2-core machine, zyx's and torch's 1024^3 matmuls right after NumPy's ran 39-40 ms
    instead of 14-16 ms."""
    time.sleep(SETTLE_S)


def median_ms(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median ms of ``repeats`` calls after ``settle`` and ``warmup`` untimed calls."""
    settle()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median ms of each function, timed in turns (one call of each per round), so that drifts of a noisy
    machine (other processes, clock changes) fall on every function alike. For small working sets, and for
    streams far larger than the last-level cache (every call reads from memory either way); not for buffers that
    fit the cache alone but not together (each function would evict the others' data)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def settled_blocks(fns: dict[str, Callable[[], object]], rounds: int, per_block: int = 3,
                   elsewhere: dict[str, Callable[[int], list[float]]] | None = None) -> dict[str, float]:
    """Median ms of each function, timed in blocks of ``per_block`` calls, the blocks in turns (``rounds`` of one
    block each), every block after ``settle`` and one untimed call: each library runs with its own threads awake
    and the others' idle, and drifts of the machine fall on every library alike. For multi-threaded work
    (``interleaved_medians`` would time one library while another's threads still spin). ``elsewhere``: blocks
    timed in another process (``CleanNumpy.block``), given the block size, returning seconds per call."""
    times: dict[str, list[float]] = {k: [] for k in (*fns, *(elsewhere or {}))}
    for _ in range(rounds):
        for k, fn in fns.items():
            settle()
            fn()
            for _ in range(per_block):
                t0 = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t0)
        for k, block in (elsewhere or {}).items():
            times[k] += block(per_block)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


_CLEAN_NUMPY_SERVER = """
import json, sys, time
import numpy as np
spaces = {}
for line in sys.stdin:
    setup, stmt, k, settle_s = json.loads(line)
    ns = spaces.get(setup)
    if ns is None:
        ns = spaces[setup] = {"np": np}
        exec(setup, ns)
    fn = eval("lambda: " + stmt, ns)
    time.sleep(settle_s)
    fn()
    ts = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    print(json.dumps(ts), flush=True)
"""


class CleanNumpy:
    """NumPy code timed in a child process that imports nothing but NumPy. In zyx's process, once zyx's BLAS runner
    has called NumPy's OpenBLAS from its OpenMP threads, NumPy's own two-thread 1024^3 sgemm ran 22-29 ms instead of
    11-14 ms in 4 of 8 runs (its main thread's share took twice the CPU time; OpenBLAS 0.3.31): a reference timed
    there would flatter zyx. The child waits on its pipe between blocks (no thread spins)."""

    def __init__(self) -> None:
        import subprocess
        import sys

        self._proc = subprocess.Popen([sys.executable, "-c", _CLEAN_NUMPY_SERVER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)

    def block(self, setup: str, stmt: str, calls: int) -> list[float]:
        """Seconds of each of ``calls`` evaluations of ``stmt`` after a settle and one untimed evaluation; ``setup``
        (run once per distinct text, with ``np`` imported) defines what ``stmt`` reads."""
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps([setup, stmt, calls, SETTLE_S]) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the NumPy timing process ended (exit {self._proc.wait()})")
        return json.loads(line)

    def median_ms(self, setup: str, stmt: str, calls: int) -> float:
        return statistics.median(self.block(setup, stmt, calls)) * 1e3

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=30)

    def __enter__(self) -> CleanNumpy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _square_operands(n: int, seed: int) -> str:
    """NumPy source making ``a`` and ``b``, the float32 n x n operands ``_matmul_operands`` makes."""
    return (f"rng = np.random.default_rng({seed})\n"
            f"a, b = (rng.standard_normal(({n}, {n})).astype(np.float32) for _ in range(2))")


def _numpy_setup(setup: str) -> dict:
    """The names NumPy source ``setup`` defines, run in this process (``CleanNumpy`` runs the same text there)."""
    ns: dict = {"np": np}
    exec(setup, ns)
    return ns


def _matmul_operands(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The operands ``_square_operands`` describes, made in this process (the same source: the same values)."""
    ns = _numpy_setup(_square_operands(n, seed))
    return ns["a"], ns["b"]


def _torch():
    try:
        import torch

        torch.set_num_threads(os.cpu_count() or 1)
        return torch
    except ImportError:
        return None


CASES: list[Callable[[argparse.Namespace], Row | None]] = []


def case(fn):
    CASES.append(fn)
    return fn


@case
def fused_elementwise(args) -> Row:
    n = 1 << (args.scale + 4)
    rng = np.random.default_rng(0)
    a, b, c = (rng.standard_normal(n).astype(np.float32) for _ in range(3))
    A, B, C = (zyx.Tensor(v).realize() for v in (a, b, c))
    row = Row(f"relu(a*b+c)*0.5+exp(-abs(a)) 2^{args.scale + 4} f32",
              median_ms(lambda: ((A * B + C).relu() * 0.5 + (-A.abs()).exp()).realize(), args.repeats))
    row.refs["numpy"] = median_ms(lambda: np.maximum(a * b + c, 0) * 0.5 + np.exp(-np.abs(a)), args.repeats)
    torch = _torch()
    if torch is not None:
        ta, tb, tc = (torch.from_numpy(v) for v in (a, b, c))
        row.refs["torch"] = median_ms(lambda: (ta * tb + tc).relu() * 0.5 + (-ta.abs()).exp(), args.repeats)
    return row


def _square(args) -> tuple[np.ndarray, zyx.Tensor]:
    n = 1 << (args.scale // 2 + 2)
    x = np.random.default_rng(1).standard_normal((n, n)).astype(np.float32)
    return x, zyx.Tensor(x).realize()


def _streaming_row(name: str, args, fns: dict[str, Callable[[], object]]) -> Row:
    """A row over a 64 MB operand (``_square``), zyx and its peers timed in turns (``interleaved_medians``): the
    machine's drifts over the seconds a block of repeats takes had moved the ratios by 30%. At least 15 rounds
    (a round costs tens of ms): medians of 7 moved the row sum's ratio to torch by 10% from run to run. Each
    library reads its own copy of the operand: the 32 MiB L3 keeps part of a 64 MB stream, so a torch view of
    NumPy's array, read right after NumPy, had been 0.05-0.1 ms faster than torch on its own copy."""
    ms = interleaved_medians(fns, max(args.repeats, 15), warmup=3)
    row = Row(name, ms.pop("zyx"))
    row.refs.update(ms)
    return row


def _sum_row(args, axis: int, what: str) -> Row:
    """The sum's row, noting its kernel alone (``schedule.fixed_launches``, timed in the same turns, on its own copy
    of the operand): what the whole call costs beyond it is zyx's Python path (building the graph, finding the
    plan, allocating, freeing). The kernel's turn follows a NumPy sum (its time dropped), as torch's does: right
    after the whole call, the kernel found zyx's OpenMP thread still spinning instead of asleep, and had timed
    1.01-1.04x torch where it ran 0.99-1.02x torch after NumPy. Every library keeps its predecessor: zyx still
    follows torch, and torch NumPy."""
    x, X = _square(args)
    fns: dict[str, Callable[[], object]] = {"zyx": lambda: X.sum(axis=axis).realize()}
    alone = schedule.fixed_launches([zyx.Tensor(x.copy()).realize().sum(axis=axis).cls])
    if alone is not None:
        fns["numpy before the kernel"] = lambda: x.sum(axis=axis)
        fns["kernel alone"] = alone
    fns["numpy"] = lambda: x.sum(axis=axis)
    torch = _torch()
    if torch is not None:
        t = torch.from_numpy(x.copy())  # its own buffer (``_streaming_row``)
        fns["torch"] = lambda: t.sum(dim=axis)
    row = _streaming_row(f"{what} sum {x.shape[0]}x{x.shape[1]} f32", args, fns)
    row.refs.pop("numpy before the kernel", None)
    kernel = row.refs.pop("kernel alone", None)
    if kernel is not None:
        row.note = f"its kernel alone {kernel:.2f} ms" + (
            f", {row.refs['torch'] / kernel:.2f}x torch" if "torch" in row.refs else "")
    return row


@case
def row_sum(args) -> Row:
    return _sum_row(args, 1, "row")


@case
def col_sum(args) -> Row:
    return _sum_row(args, 0, "column")


@case
def transpose(args) -> Row:
    """A copy into the transposed layout (what ``.T.contiguous()``, permutes and matmul-gradient layouts cost)."""
    x, X = _square(args)
    row = Row(f"transpose {x.shape[0]}x{x.shape[1]} f32 (.T.contiguous())",
              median_ms(lambda: X.T.contiguous().realize(), args.repeats))
    row.refs["numpy"] = median_ms(lambda: np.ascontiguousarray(x.T), args.repeats)
    torch = _torch()
    if torch is not None:
        t = torch.from_numpy(x)
        row.refs["torch"] = median_ms(lambda: t.T.contiguous(), args.repeats)
    return row


@case
def cumsum(args) -> Row:
    n = 1 << args.scale  # 2^20 at the default scale (about the 1,000,000)
    x = np.random.default_rng(0).random((1, n), dtype=np.float32)
    X = zyx.Tensor(x).realize()
    row = Row(f"cumsum (1, {n}) f32", median_ms(lambda: X.cumsum(1).realize(), args.repeats))
    row.refs["numpy"] = median_ms(lambda: np.cumsum(x, 1), args.repeats)
    torch = _torch()
    if torch is not None:
        t = torch.from_numpy(x)
        row.refs["torch"] = median_ms(lambda: t.cumsum(1), args.repeats)
    return row


def _beside_torch(name: str, args, zyx_fn: Callable[[], object], torch_fn: Callable[[], object] | None) -> Row:
    """zyx's call beside torch's (None: torch is not installed) in settled blocks taken in turns
    (``settled_blocks``): both multi-threaded, each block with its own threads awake and the other's idle, and the
    machine's drifts on both alike. One library's block after the other's, the same 3x3 convolution had read
    0.73-0.87x torch and a stride-2 stem's training step 0.78-1.05x in one day's runs, with no change between."""
    fns = {"zyx": zyx_fn} if torch_fn is None else {"zyx": zyx_fn, "torch": torch_fn}
    ms = settled_blocks(fns, max(3, args.repeats // 3))
    row = Row(name, ms.pop("zyx"))
    row.refs.update(ms)
    return row


def _ops_row(name: str, args, zyx_fn: Callable[[], object], torch_fn: Callable[[object], Callable[[], object]],
             arrays: list[np.ndarray]) -> Row:
    """An op beside PyTorch's (when installed): ``torch_fn`` maps the torch tensors of ``arrays`` to a call."""
    torch = _torch()
    fn = None if torch is None else torch_fn(torch, *[torch.from_numpy(a.copy()) for a in arrays])
    return _beside_torch(name, args, zyx_fn, fn)


@case
def cast_half(args) -> Row:
    """float32 -> float16 of a 64 MB operand (mixed precision's casts; F16C conversions on the host)."""
    x, X = _square(args)
    return _ops_row(f"cast {x.shape[0]}x{x.shape[1]} f32 -> f16", args, lambda: X.half().realize(),
                    lambda torch, t: lambda: t.half(), [x])


@case
def sort_rows(args) -> Row:
    """A stable sort along rows (the bitonic network of ``zyx.sorting``)."""
    n = 1 << (args.scale // 2 + 1)  # 2048 at the default scale
    x = np.random.default_rng(2).standard_normal((n, n)).astype(np.float32)
    X = zyx.Tensor(x).realize()
    return _ops_row(f"sort rows {n}x{n} f32", args, lambda: X.sort(-1)[0].realize(),
                    lambda torch, t: lambda: torch.sort(t, dim=-1, stable=True), [x])


@case
def topk_rows(args) -> Row:
    """topk(8) along rows (``zyx.sorting``'s selection passes)."""
    n = 1 << (args.scale // 2 + 1)
    x = np.random.default_rng(3).standard_normal((n, n)).astype(np.float32)
    X = zyx.Tensor(x).realize()
    return _ops_row(f"topk(8) rows {n}x{n} f32", args, lambda: X.topk(8, -1)[0].realize(),
                    lambda torch, t: lambda: torch.topk(t, 8, -1), [x])


@case
def upsample_bilinear(args) -> Row:
    side = 1 << (args.scale // 2 - 3)  # 128 at the default scale
    x = np.random.default_rng(4).standard_normal((8, 64, side, side)).astype(np.float32)
    X = zyx.Tensor(x).realize()
    return _ops_row(f"bilinear 2x upsampling 8x64x{side}x{side} f32", args,
                    lambda: zyx.nn.functional.interpolate(X, scale_factor=2, mode="bilinear").realize(),
                    lambda torch, t: lambda: torch.nn.functional.interpolate(t, scale_factor=2, mode="bilinear"),
                    [x])


@case
def group_norm(args) -> Row:
    side = 7 << max(args.scale // 2 - 7, 0)  # 56 at the default scale
    x = np.random.default_rng(5).standard_normal((16, 64, side, side)).astype(np.float32)
    X = zyx.Tensor(x).realize()
    return _ops_row(f"group_norm 8 groups 16x64x{side}x{side} f32", args,
                    lambda: zyx.nn.functional.group_norm(X, 8).realize(),
                    lambda torch, t: lambda: torch.nn.functional.group_norm(t, 8), [x])


@case
def embedding_backward(args) -> Row:
    """The weight gradient of an embedding lookup (``opt.scatter_one_hot``: added at the looked-up rows)."""
    rng = np.random.default_rng(6)
    v, d = 30000, 256
    w = rng.standard_normal((v, d)).astype(np.float32)
    idx = rng.integers(0, v, (64, 128))
    g = rng.standard_normal((64, 128, d)).astype(np.float32)
    W, I, G = zyx.Tensor(w, requires_grad=True), zyx.Tensor(idx), zyx.Tensor(g).realize()

    def step() -> None:
        W.grad = None
        (zyx.nn.functional.embedding(I, W) * G).sum().backward()
        W.grad.realize()

    def torch_step(torch, wt, it, gt):
        wt.requires_grad_()

        def run() -> None:
            wt.grad = None
            (torch.nn.functional.embedding(it, wt) * gt).sum().backward()
        return run

    return _ops_row(f"embedding {v}x{d} backward, 64x128 lookups f32", args, step, torch_step, [w, idx, g])


def _softmax_fns(x: np.ndarray, X: zyx.Tensor) -> dict[str, Callable[[], object]]:
    """A row softmax of ``x`` by zyx (``X``), NumPy and torch (on its own copy of ``x``, ``_streaming_row``)."""

    def np_softmax():
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    fns: dict[str, Callable[[], object]] = {"zyx": lambda: X.softmax(-1).realize(), "numpy": np_softmax}
    torch = _torch()
    if torch is not None:
        t = torch.from_numpy(x.copy())
        fns["torch"] = lambda: torch.softmax(t, -1)
    return fns


@case
def softmax(args) -> Row:
    x, X = _square(args)
    return _streaming_row(f"softmax rows {x.shape[0]}x{x.shape[1]} f32", args, _softmax_fns(x, X))


@case
def softmax_short_rows(args) -> Row:
    """A softmax over short rows: the attention scores of 32 sentences x 12 heads x 56 tokens (MiniLM's shapes),
    rows of 56 (not a whole number of 16-float vectors: ``CRenderer.tail_bytes``). 4.8 MB per library, all three
    in the cache together: timed in turns as the streaming rows are."""
    x = np.random.default_rng(2).standard_normal((32 * 12 * 56, 56)).astype(np.float32)
    X = zyx.Tensor(x).realize()
    return _streaming_row(f"softmax rows {x.shape[0]}x{x.shape[1]} f32 (attention scores)", args, _softmax_fns(x, X))


class _GeneratedOnly:
    """Within the block, the host has no BLAS device: matmuls take the generated path."""

    def __enter__(self):
        from zyx.backends.registry import registry
        from zyx.graph import schedule

        self.pl = registry().get("host")
        self.saved = list(self.pl.devices)
        self.pl.devices[:] = [d for d in self.saved if d.info().kind != "blas"]
        schedule.clear_cache()

    def __exit__(self, *exc):
        from zyx.graph import schedule

        self.pl.devices[:] = self.saved
        schedule.clear_cache()


def _matmul_row(args, n: int, generated: bool) -> Row:
    """zyx's ``A @ B`` (BLAS, or the generated kernel when ``generated``) beside NumPy's (in a clean process:
    ``CleanNumpy``) and torch's, in settled blocks taken in turns (``settled_blocks``). One block per library, one
    after the other, the same torch 1024^3 matmul had measured 23.4 ms in one row and 14.7 ms in the next of the
    same run; single calls in turns timed zyx and torch while NumPy's OpenBLAS threads still spun (39-40 ms instead
    of 14-16). torch multiplies its own copies (views of NumPy's arrays would be in the cache right after NumPy's
    turn)."""
    a, b = _matmul_operands(n, 2)
    A, B = zyx.Tensor(a).realize(), zyx.Tensor(b).realize()
    fns: dict[str, Callable[[], object]] = {"zyx": lambda: (A @ B).realize()}
    torch = _torch()
    if torch is not None:
        ta, tb = torch.from_numpy(a.copy()), torch.from_numpy(b.copy())
        fns["torch"] = lambda: ta @ tb
    rounds = max(3, args.repeats // 3) if not generated else 3
    with CleanNumpy() as clean, _GeneratedOnly() if generated else contextlib.nullcontext():
        kinds = {s.kind for s in zyx.debug.schedule(A @ B)}
        numpy_block = functools.partial(clean.block, _square_operands(n, 2), "a @ b")
        ms = settled_blocks(fns, rounds, elsewhere={"numpy": numpy_block})
    path = "library" if "library" in kinds else "generated"
    zyx_ms = ms.pop("zyx")
    row = Row(f"matmul {n}^3 f32 [{path}]", zyx_ms,
              note=f"{2 * n**3 / zyx_ms / 1e6:.1f} GFLOP/s; settled blocks in turns")
    row.refs.update(ms)
    return row


@case
def matmul(args) -> Row:
    return _matmul_row(args, 1 << (args.scale // 2), generated=False)


@case
def matmul_large(args) -> Row:
    return _matmul_row(args, 1 << (args.scale // 2 + 1), generated=False)


@case
def matmul_generated(args) -> Row:
    return _matmul_row(args, 1 << (args.scale // 2), generated=True)


@case
def matmul_generated_large(args) -> Row:
    return _matmul_row(args, 1 << (args.scale // 2 + 1), generated=True)


def _tuned(budget_s: float, run: Callable[[], object], rounds: int, peers: dict[str, Callable[[], object]],
           elsewhere: dict[str, Callable[[int], list[float]]] | None = None) -> tuple[dict[str, float], str]:
    """``run`` with autotuning on (``budget_s``) beside the heuristics and ``peers``: (median ms of "tuned",
    "heuristics" and each peer; a note on the first tuned run: its time, the kernels searched or taken from the
    disk cache, the seconds spent searching). After that run all are timed in blocks, in turns (``settled_blocks``;
    a block's untimed first call plans afresh, as cached schedules hold the other setting's programs): timed a few
    seconds apart, the same kernels had differed by up to 40%."""
    from zyx.backends import autotune
    from zyx.graph import schedule

    autotune.reset_budget()
    zyx.debug.reset_stats()
    schedule.clear_cache()
    with autotune.configured(True, budget_s=budget_s):
        t0 = time.perf_counter()
        run()
        first = time.perf_counter() - t0
    st = zyx.debug.stats()
    note = (f"first run {first:.1f} s: {st.get('autotune_searches', 0)} searched, {st.get('autotune_hits', 0)} "
            f"cached, {autotune.spent_s():.1f} s tuning of {budget_s:g} s")
    planned_for = [True]  # the setting the cached schedules were planned with

    def under(tuned: bool) -> Callable[[], None]:
        def call() -> None:
            if planned_for[0] is not tuned:
                schedule.clear_cache()
                planned_for[0] = tuned
            if tuned:
                with autotune.configured(True, budget_s=budget_s):
                    run()
            else:
                run()
        return call

    ms = settled_blocks({"tuned": under(True), "heuristics": under(False), **peers}, rounds, elsewhere=elsewhere)
    schedule.clear_cache()
    return ms, note


@case
def matmul_generated_autotune(args) -> Row:
    """The generated matmul (no BLAS) with autotuning on (budget 30 s, then cached), beside the heuristics' kernel,
    NumPy and torch, in turns."""
    n = 1 << (args.scale // 2)
    a, b = _matmul_operands(n, 2)
    A, B = zyx.Tensor(a).realize(), zyx.Tensor(b).realize()
    peers: dict[str, Callable[[], object]] = {}
    torch = _torch()
    if torch is not None:
        ta, tb = torch.from_numpy(a.copy()), torch.from_numpy(b.copy())
        peers["torch"] = lambda: ta @ tb
    with CleanNumpy() as clean, _GeneratedOnly():
        numpy_block = functools.partial(clean.block, _square_operands(n, 2), "a @ b")
        ms, note = _tuned(30.0, lambda: (A @ B).realize(), 3, peers, {"numpy": numpy_block})
    tuned = ms.pop("tuned")
    row = Row(f"matmul {n}^3 f32 [generated, autotuned]", tuned, note=f"{2 * n**3 / tuned / 1e6:.1f} GFLOP/s; {note}")
    row.refs.update(ms)
    return row


@case
def softmax_autotune(args) -> Row:
    """Row softmax with autotuning on (budget 30 s, then cached), beside the heuristics, PyTorch eager and
    torch.compile (when it compiles here; its first call is reported), in turns."""
    x, X = _square(args)
    peers: dict[str, Callable[[], object]] = {}
    compile_note = ""
    torch = _torch()
    if torch is not None:
        t = torch.from_numpy(x)
        peers["torch"] = lambda: torch.softmax(t, -1)
        try:
            compiled = torch.compile(lambda v: torch.softmax(v, -1))
            t0 = time.perf_counter()
            compiled(t)
            compile_note = f"; torch.compile first call {time.perf_counter() - t0:.1f} s"
            peers["torch.compile"] = lambda: compiled(t)
        except Exception as e:  # noqa: BLE001 - no compiler, no inductor: say so and go on
            compile_note = f"; torch.compile unavailable: {type(e).__name__}"
    ms, note = _tuned(30.0, lambda: X.softmax(-1).realize(), max(3, args.repeats // 2), peers)
    row = Row(f"softmax rows {x.shape[0]}x{x.shape[1]} f32 [autotuned]", ms.pop("tuned"), note=note + compile_note)
    row.refs.update(ms)
    return row


@case
def mlp_forward(args) -> Row:
    ns = _numpy_setup(_MLP_SETUP)
    x, ws, bs = ns["x"], ns["ws"], ns["bs"]
    X = zyx.Tensor(x).realize()
    W = [zyx.Tensor(w).realize() for w in ws]
    Bz = [zyx.Tensor(b).realize() for b in bs]

    def fwd_zyx():
        h = X
        for i, (w, b) in enumerate(zip(W, Bz)):
            h = h @ w + b
            if i < len(W) - 1:
                h = h.relu()
        return h.realize()

    row = Row("MLP forward 256x784-1024-1024-10 f32", median_ms(fwd_zyx, args.repeats))
    with CleanNumpy() as clean:  # NumPy's matmuls in zyx's process may be slowed (``CleanNumpy``)
        row.refs["numpy"] = clean.median_ms(_MLP_SETUP, "fwd()", args.repeats)
    torch = _torch()
    if torch is not None:
        tx = torch.from_numpy(x)
        tw = [torch.from_numpy(w) for w in ws]
        tb = [torch.from_numpy(b) for b in bs]

        def fwd_torch():
            h = tx
            for i, (w, b) in enumerate(zip(tw, tb)):
                h = h @ w + b
                if i < len(tw) - 1:
                    h = torch.relu(h)
            return h

        row.refs["torch"] = median_ms(fwd_torch, args.repeats)
    return row


_MLP_SETUP = """
rng = np.random.default_rng(4)
sizes = [784, 1024, 1024, 10]
x = rng.standard_normal((256, 784)).astype(np.float32)
ws = [(rng.standard_normal((i, o)) / np.sqrt(i)).astype(np.float32) for i, o in zip(sizes, sizes[1:])]
bs = [np.zeros(o, np.float32) for o in sizes[1:]]

def fwd():
    h = x
    for i, (w, b) in enumerate(zip(ws, bs)):
        h = h @ w + b
        if i < len(ws) - 1:
            h = np.maximum(h, 0)
    return h
"""


@case
def tiny_chain(args) -> Row:
    s = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    S = zyx.Tensor(s).realize()

    def chain_zyx():
        y = S
        for i in range(200):
            y = y * 1.001 + 0.001 if i % 2 else (y - 0.5).relu()
        return y.realize()

    def chain_np():
        y = s
        for i in range(200):
            y = y * np.float32(1.001) + np.float32(0.001) if i % 2 else np.maximum(y - np.float32(0.5), 0)
        return y

    row = Row("200 chained tiny ops (64 elems), end to end", median_ms(chain_zyx, max(args.repeats, 20)),
              note="one kernel, schedule cached")
    row.refs["numpy"] = median_ms(chain_np, max(args.repeats, 20))
    torch = _torch()
    if torch is not None:
        t = torch.from_numpy(s)

        def chain_torch():
            y = t
            for i in range(200):
                y = y * 1.001 + 0.001 if i % 2 else (y - 0.5).relu()
            return y

        row.refs["torch"] = median_ms(chain_torch, max(args.repeats, 20))
    return row


def _torch_step(torch, model, opt, x: np.ndarray, y: np.ndarray) -> Callable[[], float]:
    """One PyTorch eager training step (cross-entropy; the loss read with ``.item()``) on the same batch."""

    def step() -> float:
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def _conv_operands(x_shape=(32, 32, 32, 32), w_shape=(64, 32, 3, 3), g_shape=(32, 64, 32, 32), seed: int = 6,
                   w_scale: float = 0.1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float32 input, weight (times ``w_scale``) and output gradient of a convolution; by default a 3x3 one, 32 -> 64
    channels, batch 32 of 32x32."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(x_shape).astype(np.float32),
            (rng.standard_normal(w_shape) * w_scale).astype(np.float32),
            rng.standard_normal(g_shape).astype(np.float32))


@case
def conv2d(args) -> Row:
    """A 3x3 convolution, 32 -> 64 channels, batch 32 of 32x32, padding 1: im2col rows and one GEMM."""
    from zyx.nn import functional as F

    x, w, _ = _conv_operands()
    X, W = zyx.Tensor(x).realize(), zyx.Tensor(w).realize()
    return _ops_row("conv2d 32x32x32x32 * 64x32x3x3 pad 1 f32", args, lambda: F.conv2d(X, W, padding=1).realize(),
                    lambda torch, tx, tw: lambda: torch.nn.functional.conv2d(tx, tw, padding=1), [x, w])


def _conv_step_row(name: str, x: np.ndarray, w: np.ndarray, g: np.ndarray, args, **conv) -> Row:
    """One training step of a convolution: the loss sum(conv(x, w) * g) (g fixed and random), its value and both
    gradients realized (zyx computes lazily: a step that never reads the loss would skip the forward GEMM, which
    torch runs)."""
    from zyx.nn import functional as F

    X, W = zyx.Tensor(x, requires_grad=True).realize(), zyx.Tensor(w, requires_grad=True).realize()
    G = zyx.Tensor(g).realize()

    def step_zyx():
        X.grad = W.grad = None
        loss = (F.conv2d(X, W, **conv) * G).sum()
        loss.backward()
        zyx.realize(loss, X.grad, W.grad)

    torch, step_torch = _torch(), None
    if torch is not None:
        tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
        tg = torch.from_numpy(g)

        def step_torch():
            tx.grad = tw.grad = None
            (torch.nn.functional.conv2d(tx, tw, **conv) * tg).sum().backward()

    return _beside_torch(name, args, step_zyx, step_torch)


@case
def conv2d_backward(args) -> Row:
    """The 3x3 convolution's loss and both gradients."""
    return _conv_step_row("conv2d forward + input and weight gradients", *_conv_operands(), args, padding=1)


@case
def conv2d_stem_backward(args) -> Row:
    """A ResNet stem's 7x7 stride-2 convolution, 3 -> 32 channels, batch 16 of 64x64: loss and both gradients
    (the input gradient overlap-adds phases of the strided windows)."""
    operands = _conv_operands((16, 3, 64, 64), (32, 3, 7, 7), (16, 32, 32, 32), seed=7)
    return _conv_step_row("conv2d 7x7 s2 stem 16x3x64x64, forward + gradients", *operands, args, stride=2,
                          padding=3)


def _depthwise_operands() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A MobileNet block's depthwise 3x3 convolution: batch 16 of 128 channels of 56x56, one filter per channel."""
    return _conv_operands((16, 128, 56, 56), (128, 1, 3, 3), (16, 128, 56, 56), seed=8, w_scale=0.3)


@case
def depthwise_conv2d(args) -> Row:
    """The depthwise convolution's forward: one kernel reading the input in place (no im2col columns)."""
    from zyx.nn import functional as F

    x, w, _ = _depthwise_operands()
    X, W = zyx.Tensor(x).realize(), zyx.Tensor(w).realize()
    return _ops_row("depthwise conv2d 16x128x56x56, 3x3 pad 1 f32", args,
                    lambda: F.conv2d(X, W, padding=1, groups=128).realize(),
                    lambda torch, tx, tw: lambda: torch.nn.functional.conv2d(tx, tw, padding=1, groups=128), [x, w])


@case
def depthwise_conv2d_backward(args) -> Row:
    """The depthwise convolution's loss and both gradients."""
    return _conv_step_row("depthwise conv2d forward + gradients", *_depthwise_operands(), args, padding=1,
                          groups=128)


@case
def conv_transpose2d(args) -> Row:
    """A 4x4 transposed convolution, stride 2, padding 1 (a decoder's 2x upsampling), 64 -> 32 channels, batch 32
    of 16x16: one GEMM and one col2im kernel."""
    from zyx.nn import functional as F

    rng = np.random.default_rng(4)
    x = rng.standard_normal((32, 64, 16, 16), dtype=np.float32)
    w = rng.standard_normal((64, 32, 4, 4), dtype=np.float32)
    X, W = zyx.Tensor(x).realize(), zyx.Tensor(w).realize()
    return _ops_row("conv_transpose2d 32x64x16x16 * 64x32x4x4 s2 p1 f32", args,
                    lambda: F.conv_transpose2d(X, W, stride=2, padding=1).realize(),
                    lambda torch, tx, tw: lambda: torch.nn.functional.conv_transpose2d(tx, tw, stride=2, padding=1),
                    [x, w])


@case
def max_pool2d_backward(args) -> Row:
    """A ResNet stem's 3x3 stride-2 max pooling (padding 1), batch 16 of 64x56x56: the loss sum(pool(x) * g) and
    the input gradient, which goes to each window's first maximum (PyTorch's argmax routing)."""
    from zyx.nn import functional as F

    rng = np.random.default_rng(8)
    x = rng.standard_normal((16, 64, 56, 56), dtype=np.float32)
    g = rng.standard_normal((16, 64, 28, 28), dtype=np.float32)
    X, G = zyx.Tensor(x, requires_grad=True).realize(), zyx.Tensor(g).realize()

    def step_zyx():
        X.grad = None
        loss = (F.max_pool2d(X, 3, 2, 1) * G).sum()
        loss.backward()
        zyx.realize(loss, X.grad)

    torch, step_torch = _torch(), None
    if torch is not None:
        tx, tg = torch.tensor(x, requires_grad=True), torch.from_numpy(g)

        def step_torch():
            tx.grad = None
            (torch.nn.functional.max_pool2d(tx, 3, 2, 1) * tg).sum().backward()

    return _beside_torch("max_pool2d 3x3 s2 16x64x56x56, forward + gradient", args, step_zyx, step_torch)


@case
def train_step(args) -> Row:
    """One Adam training step of the train_mlp example's model and batch (forward, backward, update)."""
    from zyx import nn, optim
    from zyx.examples.train_mlp import make_model

    rng = np.random.default_rng(5)
    x = rng.random((64, 64), dtype=np.float32)
    y = rng.integers(0, 10, size=64)
    zyx.manual_seed(0)
    model = make_model()
    opt = optim.Adam(model.parameters(), lr=1e-3)

    def step_zyx():
        loss = nn.functional.cross_entropy(model(zyx.Tensor(x)), zyx.Tensor(y))
        opt.zero_grad()
        loss.backward()
        opt.step(loss)
        return loss.item()

    row = Row("train step MLP 64-128-128-10, batch 64, Adam", median_ms(step_zyx, max(args.repeats, 20), 3))
    torch = _torch()
    if torch is not None:
        torch.manual_seed(0)
        tm = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                 torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
        topt = torch.optim.Adam(tm.parameters(), lr=1e-3)
        row.refs["torch"] = median_ms(_torch_step(torch, tm, topt, x, y), max(args.repeats, 20), 3)
    return row


def _mlp_step_row(args, opt_name: str) -> Row:
    """One training step of a 784-256-10 MLP, batch 64, cross-entropy, loss read with ``.item()`` each step:
    zyx.jit (replay) beside the same step without jit and PyTorch eager."""
    from zyx import nn, optim

    rng = np.random.default_rng(11)
    x = rng.random((64, 784), dtype=np.float32)
    y = rng.integers(0, 10, size=64)

    def make():
        zyx.manual_seed(0)
        model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
        opt = optim.SGD(model.parameters(), lr=1e-2) if opt_name == "sgd" else optim.Adam(model.parameters())

        def step(xb, yb):
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step(loss)
            return loss

        return step

    jitted, plain = zyx.jit(make()), make()
    fns = {"jit": lambda: jitted(zyx.Tensor(x), zyx.Tensor(y)).item(),
           "no jit": lambda: plain(zyx.Tensor(x), zyx.Tensor(y)).item()}
    torch = _torch()
    if torch is not None:
        torch.manual_seed(0)
        tm = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        topt = torch.optim.SGD(tm.parameters(), lr=1e-2) if opt_name == "sgd" else torch.optim.Adam(tm.parameters())
        fns["torch"] = _torch_step(torch, tm, topt, x, y)
    ms = interleaved_medians(fns, max(args.repeats, 30), warmup=3)
    row = Row(f"train step MLP 784-256-10, batch 64, {opt_name}, zyx.jit", ms.pop("jit"),
              note="replay of the captured step; the three timed in turns")
    row.refs.update(ms)
    return row


@case
def jit_step_sgd(args) -> Row:
    return _mlp_step_row(args, "sgd")


@case
def jit_step_adam(args) -> Row:
    return _mlp_step_row(args, "adam")


@case
def jit_tiny_chain(args) -> Row:
    """200 chained tiny ops (the tiny_chain case) as a jitted function: the replay alone."""
    s = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    S = zyx.Tensor(s).realize()

    @zyx.jit
    def chain(y):
        for i in range(200):
            y = y * 1.001 + 0.001 if i % 2 else (y - 0.5).relu()
        return y

    ms = median_ms(lambda: chain(S).realize(), max(args.repeats, 50), warmup=3)
    row = Row("200 chained tiny ops (64 elems), zyx.jit replay", ms, note="one kernel, no graph built")
    row.refs["no jit"] = median_ms(lambda: chain.fn(S).realize(), max(args.repeats, 20))
    return row


@case
def embed_minilm(args) -> Row | None:
    """all-MiniLM-L6-v2 sentence embeddings, one batch of 32 (3-55 tokens) on the host, beside PyTorch eager
    running the same weights (``_beside_torch``: one block after the other, the ratio read 0.97-1.16 in four runs
    of one hour); the first call (planning and any compiles) is reported apart from warm calls."""
    from zyx.examples import embed

    try:
        path = embed.model_dir()
        enc = embed.Encoder("host", path)
    except (ModuleNotFoundError, FileNotFoundError) as e:
        print(f"  skipped embed_minilm: {e}")
        return None
    batch = embed.SAMPLE_SENTENCES
    zyx.debug.reset_stats()
    t0 = time.perf_counter()
    enc.encode(batch)
    first = (time.perf_counter() - t0) * 1e3
    first_compiles = zyx.debug.stats()["compiles"]
    torch_encode = None
    if _torch() is not None:
        from zyx.examples.embed_torch import TorchMiniLM

        ref = TorchMiniLM(path)
        ids, mask = enc.tokenize(batch)

        def torch_encode():  # tokenizing included, as in zyx's encode
            enc.tokenize(batch)
            return ref.encode(ids, mask)

    zyx.debug.reset_stats()
    row = _beside_torch("MiniLM-L6 embeddings, batch of 32 sentences", args, lambda: enc.encode(batch), torch_encode)
    compiles = zyx.debug.stats()["compiles"]
    from zyx.backends.registry import registry

    blas = [d.info().extra.get("library") for d in registry().get("host").devices if d.info().kind == "blas"]
    row.note = (f"{len(batch) / row.zyx_ms * 1e3:.0f} sentences/s; first call {first:.0f} ms with {first_compiles} "
                f"compiles; {compiles} compiles after warm-up; GEMMs: {blas[0] if blas else 'generated'}; settled "
                f"blocks in turns")
    return row


@case
def load_and_sum(args) -> Row:
    from zyx.bench_load import load_and_sum as run

    return run(args)


# ---- the CUDA worker's host overhead (meaningful under ZYX_CUDA_EMULATE=nokernels, or on a GPU) --------------

_ADD_ONE = r"""
extern "C" __global__ void zyx_bench_add_one(const float* x, float* y) {
  if (threadIdx.x == 0) y[0] = x[0] + 1.0f;
}
"""
LAUNCHES = 10_000


def _cuda_device():
    """The first CUDA device and a one-thread kernel ``y[0] = x[0] + 1`` on it, or None without one."""
    from zyx.backends.registry import registry

    if "cuda:0" not in registry().placements():
        return None
    from zyx.backends.cuda.args import KernelSpec

    dev = registry().get("cuda:0").primary
    spec = KernelSpec("zyx_bench_add_one", (1, 1, 1), (32, 1, 1), 0, ("in", "out"), (None, None))
    return dev, dev.compile_source(_ADD_ONE, spec)


def _launch_rate_row(args, dependent: bool) -> Row | None:
    got = _cuda_device()
    if got is None:
        return None
    dev, prog = got
    pool = dev.pool()
    n = LAUNCHES
    bufs = [pool.allocate(4) for _ in range(2 if dependent else n + 1)]
    try:
        def run():
            if dependent:  # each launch reads what the previous one wrote
                for i in range(n):
                    dev.launch(prog, [bufs[i % 2], bufs[(i + 1) % 2]])
            else:  # every launch reads one buffer and writes its own
                for i in range(n):
                    dev.launch(prog, [bufs[0], bufs[i + 1]])
            dev.sync()

        ms = median_ms(run, max(args.repeats // 2, 3), warmup=1)
    finally:
        for b in bufs:
            pool.release(b)
    kind = "dependent chain" if dependent else "independent"
    return Row(f"cuda: {n:,} {kind} launches + sync", ms, note=f"{n / ms * 1e3:,.0f} launches/s; "
               f"{ms * 1e3 / n:.1f} us each; {dev.worker.name} {dev.info().extra.get('device_name', '')}")


@case
def cuda_launch_chain(args) -> Row | None:
    return _launch_rate_row(args, dependent=True)


@case
def cuda_launch_independent(args) -> Row | None:
    return _launch_rate_row(args, dependent=False)


@case
def cuda_flush_live_buffers(args) -> Row | None:
    """A one-launch window (launch + sync) with no other buffers, and with 10,000 live buffers the streams track."""
    got = _cuda_device()
    if got is None:
        return None
    dev, prog = got
    pool = dev.pool()
    x, y = pool.allocate(4), pool.allocate(4)

    def windows():
        for _ in range(200):
            dev.launch(prog, [x, y])
            dev.sync()

    empty = median_ms(windows, max(args.repeats // 2, 3), warmup=1)
    live = [pool.allocate(4) for _ in range(LAUNCHES)]
    for b in live:  # written once: every one is tracked by the stream state
        dev.launch(prog, [x, b])
    dev.sync()
    full = median_ms(windows, max(args.repeats // 2, 3), warmup=1)
    for b in (x, y, *live):
        pool.release(b)
    row = Row(f"cuda: 200 one-launch windows, {LAUNCHES:,} live buffers", full,
              note=f"{full / empty:.2f}x the cost with none; {full * 5:.0f} us per window")
    row.refs["no live buffers"] = empty
    return row


@case
def cuda_graph_replay(args) -> Row | None:
    """A cached 1,000-kernel batch (a dependent chain) replayed as one CUDA graph, beside the same launches one
    by one."""
    got = _cuda_device()
    if got is None:
        return None
    dev, prog = got
    pool = dev.pool()
    n = 1000
    bufs = [pool.allocate(4) for _ in range(4)]
    sets = [[(prog, [bufs[k + i % 2], bufs[k + (i + 1) % 2]]) for i in range(n)] for k in (0, 2)]
    launches = sets[0]
    key, moving = object(), object()
    turn = [0]

    def replay():
        dev.launch_batch(key, launches)
        dev.sync()

    def replay_new_buffers():  # every kernel's arguments change: each node is updated before the launch
        turn[0] ^= 1
        dev.launch_batch(moving, sets[turn[0]])
        dev.sync()

    def one_by_one():
        for program, a in launches:
            dev.launch(program, a)
        dev.sync()

    try:
        ms = median_ms(replay, max(args.repeats, 10), warmup=3)  # the first two runs launch, then capture
        moved = median_ms(replay_new_buffers, max(args.repeats, 10), warmup=3)
        row = Row(f"cuda: replay of a cached {n:,}-kernel schedule + sync", ms,
                  note=f"{n / ms * 1e3:,.0f} kernels/s equivalent, one graph launch; with new buffers every "
                       f"replay {moved:.2f} ms, {n / moved * 1e3:,.0f} kernels/s")
        row.refs["one by one"] = median_ms(one_by_one, max(args.repeats, 10), warmup=1)
    finally:
        for b in bufs:
            pool.release(b)
    return row


@case
def cuda_upload(args) -> Row | None:
    """How long ``host_to_pool`` of 256 MiB blocks the caller, beside one host memcpy of the same bytes."""
    got = _cuda_device()
    if got is None:
        return None
    dev, _ = got
    pool = dev.pool()
    n = 256 << 20
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    bid = pool.allocate(n)
    try:
        row = Row("cuda: upload 256 MiB, caller blocked", median_ms(lambda: pool.host_to_pool(memoryview(src), bid),
                                                                     max(args.repeats // 2, 3)),
                  note="the device copy continues asynchronously")
        dst = np.empty_like(src)
        row.refs["host memcpy"] = median_ms(lambda: np.copyto(dst, src), max(args.repeats // 2, 3))
        pinned = pool.pinned(n)  # the caller's own pinned buffer: copied from where it is, no staging copy
        pinned[:] = src

        def from_pinned():
            pool.sync()  # the previous copy from it is done before it is queued again (not timed below)
            t0 = time.perf_counter()
            pool.host_to_pool(memoryview(pinned), bid)
            return time.perf_counter() - t0

        from_pinned()
        blocked = statistics.median(from_pinned() for _ in range(max(args.repeats // 2, 3))) * 1e3
        row.note += f"; from a pinned buffer the caller owns (CudaPool.pinned): {blocked:.3f} ms blocked"
        pool.sync()
    finally:
        pool.release(bid)
    return row


def format_table(rows: list[Row]) -> str:
    refs = sorted({r for row in rows for r in row.refs}, key=lambda r: (["numpy", "torch"].index(r)
                  if r in ("numpy", "torch") else 9, r))
    head = f"{'benchmark':52s} {'zyx ms':>9s}" + "".join(f" {r + ' ms':>10s} {'x ' + r:>8s}" for r in refs)
    lines = [head, "-" * len(head)]
    for row in rows:
        line = f"{row.name:52s} {row.zyx_ms:9.2f}"
        for r in refs:
            if r in row.refs:
                line += f" {row.refs[r]:10.2f} {row.ratio(r):8.2f}"
            else:
                line += f" {'-':>10s} {'-':>8s}"
        lines.append(line + (f"  ({row.note})" if row.note else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zyx.bench", description=__doc__)
    ap.add_argument("--repeats", type=int, default=7, help="timed runs per case (median reported)")
    ap.add_argument("--scale", type=int, default=20, help="log2 size: 20 gives 2^24 elements, 4096^2, 1024^3")
    ap.add_argument("--only", default="", help="comma list of case names to run")
    ap.add_argument("--out", default="bench_results.json", help="JSON output path")
    args = ap.parse_args(argv)
    rows = []
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    for fn in CASES:
        if only and fn.__name__ not in only:
            continue
        row = fn(args)
        if row is not None:
            rows.append(row)
            print(f"  done: {row.name}", flush=True)
    print()
    print(format_table(rows))
    info = {"machine": platform.machine(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__, "device": zyx.default_device(), "repeats": args.repeats,
            "ratio": "reference ms / zyx ms (above 1: zyx faster)"}
    with open(args.out, "w") as f:
        json.dump({"info": info, "rows": [asdict(r) | {"ratios": {k: r.ratio(k) for k in r.refs}} for r in rows]},
                  f, indent=2, default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
    print(f"\nJSON written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

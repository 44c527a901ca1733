"""Where the time of ``X.sum(1).realize()`` on a 4096^2 float32 tensor goes, beside PyTorch, in one process.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/row_sum_anatomy.py [--repeats N]

Everything is timed in turns (``bench.interleaved_medians``), each 64 MB stream reading its own copy of the
operand, every timed call right after a NumPy sum of another 64 MB array (untimed): each library starts with its
OpenMP threads asleep and the caches full of foreign data. Prints the medians of:
- the whole call and torch's ``t.sum(1)``;
- the generated kernel alone (``Device.launch_timed`` on the plan's own buffers): the rest of the call is Python;
- the whole call's phases: building ``X.sum(1)``, finding the plan (``schedule.get_plan``: the walk and the cache
  lookup), the rest of ``execute`` up to the launch (allocating, the argument table), the launch (packing the
  arguments, the kernel), what follows it inside ``realize``, and freeing the result;
- a 64x64 row sum, zyx's and torch's, right after a 64 MB stream: the stream evicts the interpreter's code and
  data from the caches (the 32 MiB L3 included), so the Python around the kernel runs several times slower than
  in a warm loop; torch's C++ path pays the same way, less;
- the same small row sums in a warm loop.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import zyx
from zyx.bench import interleaved_medians, median_ms
from zyx.graph import schedule
from zyx.graph.node import Buffer


def kernel_alone(X: zyx.Tensor):
    """A function running the plan of ``X.sum(1)`` (its only step: the row-sum kernel) with ``launch_timed``,
    returning seconds, and the objects it needs kept alive."""
    y = X.sum(1)
    p, leaves, _ = schedule.get_plan([y.cls])
    table = schedule._slot_table(p, [c.buffer for c in leaves])
    (st,) = p.steps
    args = [a.id if isinstance(a, Buffer) else a for a in map(table.__getitem__, st.args)]
    return lambda: st.dev.launch_timed(st.program, args) / 1e9, (y, table)


class Phases:
    """``X.sum(1).realize()`` and the free of its result with timestamps between the phases: ``schedule.get_plan``
    and the host device's ``launch`` are wrapped while ``call`` runs."""

    NAMES = ("build X.sum(1)", "get_plan", "execute up to the launch", "launch (pack, kernel)",
             "after the launch", "free the result")

    def __init__(self, X: zyx.Tensor) -> None:
        self.X, self.rows = X, []
        self.dev = zyx.registry().get("host").primary

    def call(self) -> None:
        marks: dict[str, float] = {}
        get_plan, launch = schedule.get_plan, self.dev.launch

        def timed_get_plan(outputs):
            try:
                return get_plan(outputs)
            finally:
                marks["planned"] = time.perf_counter()

        def timed_launch(program, args):
            marks["launch"] = time.perf_counter()
            try:
                return launch(program, args)
            finally:
                marks["launched"] = time.perf_counter()

        schedule.get_plan, self.dev.launch = timed_get_plan, timed_launch
        try:
            t0 = time.perf_counter()
            y = self.X.sum(1)
            t1 = time.perf_counter()
            y.realize()
            t2 = time.perf_counter()
            del y
            t3 = time.perf_counter()
        finally:
            schedule.get_plan = get_plan
            del self.dev.launch  # the class's method again
        self.rows.append((t1 - t0, marks["planned"] - t1, marks["launch"] - marks["planned"],
                          marks["launched"] - marks["launch"], t2 - marks["launched"], t3 - t2))

    def medians_us(self, last: int) -> dict[str, float]:
        rows = self.rows[-last:]
        return {n: statistics.median(r[i] for r in rows) * 1e6 for i, n in enumerate(self.NAMES)}


def after_stream_us(stream, fn, repeats: int) -> float:
    """Median microseconds of ``fn`` right after ``stream`` (a 64 MB read)."""
    times = []
    for _ in range(repeats):
        stream()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=41)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(zyx.registry().get("host").primary.threads)
    x = np.random.default_rng(1).standard_normal((4096, 4096)).astype(np.float32)
    X, X2 = zyx.Tensor(x).realize(), zyx.Tensor(x.copy()).realize()
    t = torch.from_numpy(x.copy())
    kernel, _keep = kernel_alone(X2)
    launch_s: list[float] = []
    other = np.ones((4096, 4096), np.float32)
    phases = Phases(X)
    fns = {"zyx X.sum(1).realize()": lambda: X.sum(1).realize(), "torch t.sum(1)": lambda: t.sum(1),
           "zyx kernel alone (launch_timed)": lambda: launch_s.append(kernel()),
           "zyx X.sum(1).realize(), in phases": phases.call}
    turns: dict = {}
    for i, (name, fn) in enumerate(fns.items()):
        turns[f"numpy {i}"] = lambda: other.sum(1)  # the stream before each timed call; its time is dropped
        turns[name] = fn
    ms = {k: v for k, v in interleaved_medians(turns, args.repeats, warmup=3).items() if k in fns}
    ms["zyx kernel alone (launch_timed)"] = statistics.median(launch_s[-args.repeats:]) * 1e3
    small = np.ones((64, 64), np.float32)
    S, ts = zyx.Tensor(small).realize(), torch.from_numpy(small.copy())
    S.sum(1).realize()
    rows = {name: v * 1e3 for name, v in ms.items()}
    rows["zyx 64x64 sum after a 64 MB stream"] = after_stream_us(lambda: t.sum(1), lambda: S.sum(1).realize(),
                                                                 args.repeats)
    rows["torch 64x64 sum after a 64 MB stream"] = after_stream_us(lambda: t.sum(1), lambda: ts.sum(1), args.repeats)
    rows["zyx 64x64 sum, warm loop"] = median_ms(lambda: S.sum(1).realize(), 200, warmup=20) * 1e3
    rows["torch 64x64 sum, warm loop"] = median_ms(lambda: ts.sum(1), 200, warmup=20) * 1e3
    for name, us in rows.items():
        extra = f"  {x.nbytes / us / 1e3:5.1f} GB/s" if name in ms else ""
        print(f"{name:40s} {us:9.1f} us{extra}")
    whole, alone = rows["zyx X.sum(1).realize()"], rows["zyx kernel alone (launch_timed)"]
    print(f"{'Python around the kernel':40s} {whole - alone:9.1f} us")
    print("the whole call's phases (medians of the timed turns):")
    for name, us in phases.medians_us(args.repeats).items():
        print(f"  {name:38s} {us:9.1f} us")


if __name__ == "__main__":
    main()

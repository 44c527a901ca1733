"""Where the time of ``X.sum(1).realize()`` on a 4096^2 float32 tensor goes, beside PyTorch, in one process.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/row_sum_anatomy.py [--repeats N]

Everything is timed in turns (``bench.interleaved_medians``), each 64 MB stream reading its own copy of the
operand, as ``python -m zyx.bench`` times the row sum. Prints the medians of:
- the whole call and torch's ``t.sum(1)``;
- the generated kernel alone (``Device.launch_timed`` on the plan's own buffers): the rest of the call is Python;
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
    fns = {"zyx X.sum(1).realize()": lambda: X.sum(1).realize(), "torch t.sum(1)": lambda: t.sum(1),
           "zyx kernel alone (launch_timed)": lambda: launch_s.append(kernel())}
    ms = interleaved_medians(fns, args.repeats, warmup=3)
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


if __name__ == "__main__":
    main()

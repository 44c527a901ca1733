"""Where the time of ``X.sum(1).realize()`` on a 4096^2 float32 tensor goes, beside PyTorch, in one process.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/row_sum_anatomy.py [--repeats N]

Prints the medians of:
- the whole call, as ``python -m zyx.bench`` times it, and torch's ``t.sum(1)``;
- the generated kernel alone (``Device.launch_timed`` on the plan's own buffers): the rest of the call is Python;
- a small realize (64 floats) right after the 64 MB kernel, and after nothing: the interpreter's working set is
  evicted from the cores' private L2 caches by the stream, so the Python around the kernel runs slower than in
  a warm loop;
- the cores' read bandwidth at this size, the kernel's and torch's, from those times.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import zyx
from zyx.bench import median_ms
from zyx.graph import schedule
from zyx.graph.node import Buffer


def median_us(fn, repeats: int) -> float:
    return median_ms(fn, repeats, warmup=5) * 1e3


def kernel_alone_us(X: zyx.Tensor, repeats: int) -> float:
    """The plan of ``X.sum(1)`` run step by step with ``launch_timed`` (its only step: the row-sum kernel)."""
    y = X.sum(1)
    p, leaves, _ = schedule.get_plan([y.cls])
    table = schedule._slot_table(p, [c.buffer for c in leaves])
    (st,) = p.steps

    def run() -> int:
        return st.dev.launch_timed(st.program, [a.id if isinstance(a, Buffer) else a for a in
                                                map(table.__getitem__, st.args)])

    for _ in range(5):
        run()
    return statistics.median(run() for _ in range(repeats)) / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=60)
    args = ap.parse_args()
    x = np.random.default_rng(1).standard_normal((4096, 4096)).astype(np.float32)
    X = zyx.Tensor(x).realize()
    small = zyx.Tensor(np.ones(64, np.float32)).realize()
    rows = {"zyx X.sum(1).realize()": median_us(lambda: X.sum(1).realize(), args.repeats),
            "zyx kernel alone (launch_timed)": kernel_alone_us(X, args.repeats)}
    try:
        import torch

        t = torch.from_numpy(x)
        rows["torch t.sum(1)"] = median_us(lambda: t.sum(1), args.repeats)
    except ImportError:
        pass
    after = []
    for _ in range(args.repeats):
        X.sum(1).realize()
        t0 = time.perf_counter()
        (small + 1).realize()
        after.append(time.perf_counter() - t0)
    rows["small realize after the 64 MB kernel"] = statistics.median(after) * 1e6
    rows["small realize, warm loop"] = median_us(lambda: (small + 1).realize(), args.repeats)
    streams = ("zyx X.sum(1).realize()", "zyx kernel alone (launch_timed)", "torch t.sum(1)")
    for name, us in rows.items():
        extra = f"  {x.nbytes / us / 1e3:5.1f} GB/s" if name in streams else ""
        print(f"{name:40s} {us:9.1f} us{extra}")
    whole, kernel = rows["zyx X.sum(1).realize()"], rows["zyx kernel alone (launch_timed)"]
    print(f"{'Python around the kernel':40s} {whole - kernel:9.1f} us")


if __name__ == "__main__":
    main()

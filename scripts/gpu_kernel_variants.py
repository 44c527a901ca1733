"""Time the generated kernels of memory-bound reductions alone, under each value of a geometry parameter.

For each workload (column sum, row sum, softmax over 8192 x 8192 float32 by default) the script takes the kernel(s)
zyx generates, compiles them under every value of ``--param`` (a ``zyx.kernel.gpu.search_space`` name, default
``unroll``) with the other parameters at the heuristic's choice, and times each with ``Device.launch_timed`` on
scratch buffers (the autotuner's measurement: warm-up, then the median). Beside them: the end-to-end time of the
op as a user calls it (``realize`` then sync, medians), the device-to-device copy bandwidth (the same bytes read
and written) and torch's time when torch sees the GPU. GB/s counts the bytes the op must move (inputs read once,
outputs written once).

    python scripts/gpu_kernel_variants.py                         # cuda:0
    ZYX_CUDA_EMULATE=1 python scripts/gpu_kernel_variants.py --n 256 --values 1,4   # a smoke run without a GPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zyx  # noqa: E402
from zyx import utils  # noqa: E402
from zyx.backends import autotune  # noqa: E402
from zyx.backends.registry import registry  # noqa: E402
from zyx.graph import schedule  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bench import median_s as _median_s  # noqa: E402


def median_s(fn, sync, repeats: int = 20) -> float:
    return _median_s(fn, sync, repeats, warmup=3)


def kernels(t: zyx.Tensor) -> list:
    """The kernel IRs realizing ``t`` (schedule cache cleared, so they compile and are logged)."""
    outer, utils.KERNEL_LOG = utils.KERNEL_LOG, []
    schedule.clear_cache()
    try:
        zyx.debug.schedule(t)
        return list(utils.KERNEL_LOG)
    finally:
        utils.KERNEL_LOG = outer


def kernel_ns(dev, kernel, params: dict[str, int]) -> float:
    pid, created = dev.compile_candidate(kernel, params)
    args, owned = autotune._scratch(dev, kernel)
    try:
        return autotune.steady_ns(lambda: dev.launch_timed(pid, args))
    finally:
        pool = dev.pool()
        for b in owned:
            pool.release(b)
        if created:
            dev.release(pid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--param", default="unroll")
    ap.add_argument("--values", default="1,2,4,8,16")
    args = ap.parse_args()
    values = [int(v) for v in args.values.split(",")]
    placement = registry().get(args.device)
    dev, pool = placement.primary, placement.pool
    n = args.n
    x_np = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    x = zyx.Tensor(x_np, device=args.device).realize()
    dev.sync()
    try:
        import torch

        tx = torch.from_numpy(x_np).cuda() if torch.cuda.is_available() else None
    except ImportError:
        tx = None

    dst = pool.allocate(4 * n * n)
    copy_s = median_s(lambda: pool.pool_to_pool(pool, x.cls.buffer.id, dst), dev.sync)
    pool.release(dst)
    copy = 8.0 * n * n / copy_s / 1e9
    print(f"{dev.info().name}: copy {n}x{n} f32 device to device: {copy:.0f} GB/s (read + write)")
    if tx is not None:
        ty = torch.empty_like(tx)
        t = median_s(lambda: ty.copy_(tx), torch.cuda.synchronize)
        print(f"torch copy_: {8.0 * n * n / t / 1e9:.0f} GB/s")

    cases = {
        "column sum x.sum(0)": (lambda a: a.sum(0), lambda a: a.sum(0), 4.0 * n * n),
        "row sum x.sum(1)": (lambda a: a.sum(1), lambda a: a.sum(1), 4.0 * n * n),
        "softmax(-1)": (lambda a: a.softmax(-1), lambda a: a.softmax(-1), 8.0 * n * n),
    }
    for name, (fz, ft, nbytes) in cases.items():
        ks = kernels(fz(x))
        e2e = median_s(lambda: fz(x).realize(), dev.sync)  # noqa: B023
        line = f"\n{name}: {len(ks)} kernel(s); end to end {e2e * 1e6:.0f} us = {nbytes / e2e / 1e9:.0f} GB/s"
        if tx is not None:
            t = median_s(lambda: ft(tx), torch.cuda.synchronize)  # noqa: B023
            line += f"; torch {t * 1e6:.0f} us = {nbytes / t / 1e9:.0f} GB/s"
        print(line)
        from zyx.kernel import gpu

        for k in ks:
            space = gpu.search_space(k, dev.info())
            heur = gpu.geometry(gpu.optimize(k, dev.info()))
            print(f"  {k.name}: heuristic {heur.strategy} block {heur.block} grid {heur.grid} unroll {heur.unroll};"
                  f" {args.param} in space: {space.get(args.param)}")
            for v in values:
                try:
                    ns = kernel_ns(dev, k, {args.param: v})
                except Exception as e:  # noqa: BLE001 - a failing variant is reported, the others run
                    print(f"    {args.param}={v}: failed: {e}")
                    continue
                print(f"    {args.param}={v}: {ns / 1e3:8.1f} us  {nbytes / ns:7.0f} GB/s  "
                      f"{100 * nbytes / ns / copy:4.0f}% of copy")
    cols = x.sum(0).numpy()
    print(f"\ncolumn sum max abs err vs float64 NumPy: {np.max(np.abs(cols - x_np.astype(np.float64).sum(0))):.1e}")


if __name__ == "__main__":
    main()

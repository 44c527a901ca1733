"""``python -m zyx``: what this machine offers, then one small fused computation with its kernels and time."""

from __future__ import annotations

import argparse
import time

import numpy as np

import zyx
from zyx.backends.registry import registry


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zyx", description=__doc__)
    ap.add_argument("--device", default=None, help="device to run the demo on (default: the default device)")
    ap.add_argument("--size", type=int, default=1 << 22, help="elements in the demo computation")
    args = ap.parse_args(argv)

    reg = registry()
    print(f"zyx {getattr(zyx, '__version__', '0.1.0')}")
    print(f"config file: {reg.config_file or 'none (defaults; see README for the search path)'}")
    print("backends:")
    for name, status in reg.report().items():
        print(f"  {name:5s} {status}")
    device = args.device or reg.default_device()
    print(f"default device: {reg.default_device()}")
    print(f"\ndemo on {device}: relu(a*b+c)*0.5 + exp(-abs(a)) over {args.size:,} float32, then its row sums")
    rng = np.random.default_rng(0)
    a, b, c = (zyx.Tensor(rng.standard_normal(args.size).astype(np.float32), device=device) for _ in range(3))

    def compute():
        y = (a * b + c).relu() * 0.5 + (-a.abs()).exp()
        return y, y.reshape(-1, 1024).sum(axis=1)

    y, s = compute()
    launches = zyx.debug.schedule(y, s)
    print("kernels:")
    for launch in launches:
        print(f"  {launch.kind:9s} {launch.device:7s} {launch.name}")
    t0 = time.perf_counter()
    zyx.realize(y, s)
    first = time.perf_counter() - t0
    times = []
    for _ in range(5):
        y, s = compute()
        t0 = time.perf_counter()
        zyx.realize(y, s)
        times.append(time.perf_counter() - t0)
    an, bn, cn = a.numpy(), b.numpy(), c.numpy()
    want = np.maximum(an * bn + cn, 0) * 0.5 + np.exp(-np.abs(an))
    err = float(np.max(np.abs(y.numpy() - want)))
    print(f"first run (plans and compiles): {first * 1e3:.1f} ms; warm median: {np.median(times) * 1e3:.2f} ms; "
          f"max abs error vs NumPy: {err:.2e}")
    st = zyx.debug.stats()
    print(f"stats: compiles={st['compiles']} launches={st['launches']} "
          f"schedule_cache_hits={st['schedule_cache_hits']}")
    return 0 if err < 1e-4 else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The generated GEMMs of a CNN training step and of plain matmuls under the heuristic tile and fixed alternatives,
timed in turns on the host: the evidence behind ``opt._gemm_defaults``.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/gemm_tiles.py [--rounds N] [WORKLOAD ...]

Each workload (a convolution's forward and both gradients, or a matmul with BLAS off) is planned once with the
kernels recorded (``utils.KERNEL_LOG``); every contraction ``tile_gemm`` tiles is compiled under each candidate
(``gemm_mr`` rows x ``gemm_nr`` columns, named rows x float32 vectors; the panel sizes stay the heuristic's), run
on scratch buffers of its shapes and timed with ``launch_timed``, one launch of each candidate per round,
``--rounds`` rounds. Printed: the heuristic's median in ms and each candidate's ratio to it (below 1: faster),
and whether the pack runs along k (``k-in``: a weight gradient). Timed in turns, the drifts of a noisy machine fall
on every candidate alike.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

import zyx
from zyx import utils
from zyx.backends import autotune
from zyx.backends.registry import registry
from zyx.bench import _GeneratedOnly
from zyx.graph import schedule
from zyx.kernel import opt
from zyx.nn import functional as F

CANDIDATES = {"heuristic": {}, "6x4": {"gemm_mr": 6, "gemm_nr": 64}, "12x2": {"gemm_mr": 12, "gemm_nr": 32},
              "8x2": {"gemm_mr": 8, "gemm_nr": 32}, "12x1": {"gemm_mr": 12, "gemm_nr": 16},
              "4x4": {"gemm_mr": 4, "gemm_nr": 64}, "4x2": {"gemm_mr": 4, "gemm_nr": 32},
              "8x1": {"gemm_mr": 8, "gemm_nr": 16}, "4x1": {"gemm_mr": 4, "gemm_nr": 16}}


def conv_step(xs: tuple, ws: tuple, **conv) -> None:
    rng = np.random.default_rng(0)
    x = zyx.Tensor(rng.standard_normal(xs).astype(np.float32), requires_grad=True).realize()
    w = zyx.Tensor((rng.standard_normal(ws) * 0.1).astype(np.float32), requires_grad=True).realize()
    y = F.conv2d(x, w, **conv)
    g = zyx.Tensor(rng.standard_normal(y.shape).astype(np.float32)).realize()
    loss = (y * g).sum()
    loss.backward()
    zyx.realize(loss, x.grad, w.grad)


def matmul(m: int, k: int, n: int) -> None:
    rng = np.random.default_rng(0)
    a = zyx.Tensor(rng.standard_normal((m, k)).astype(np.float32)).realize()
    b = zyx.Tensor(rng.standard_normal((k, n)).astype(np.float32)).realize()
    with _GeneratedOnly():
        (a @ b).realize()


WORKLOADS = {
    "conv32": lambda: conv_step((32, 32, 32, 32), (64, 32, 3, 3), padding=1),  # zyx.bench's conv2d rows
    "conv56": lambda: conv_step((8, 64, 56, 56), (64, 64, 3, 3), padding=1),  # ResNet stages, batch 8
    "conv28": lambda: conv_step((8, 128, 28, 28), (128, 128, 3, 3), padding=1),
    "conv14": lambda: conv_step((8, 256, 14, 14), (256, 256, 3, 3), padding=1),
    "conv7": lambda: conv_step((8, 512, 7, 7), (512, 512, 3, 3), padding=1),
    "conv14_128": lambda: conv_step((16, 128, 14, 14), (128, 128, 3, 3), padding=1),
    "conv1x1": lambda: conv_step((8, 64, 56, 56), (256, 64, 1, 1)),
    "conv_s2": lambda: conv_step((8, 64, 56, 56), (128, 64, 3, 3), stride=2, padding=1),
    "stem": lambda: conv_step((16, 3, 64, 64), (32, 3, 7, 7), stride=2, padding=3),
    "mm1024": lambda: matmul(1024, 1024, 1024),
    "mm_short_k": lambda: matmul(2048, 64, 2048),
    "mm_mlp": lambda: matmul(256, 784, 1024),
    "mm_tall": lambda: matmul(4096, 256, 256),
    "mm_k32": lambda: matmul(1024, 32, 1024),
    "mlp_dw": lambda: matmul(784, 64, 256),  # a Linear layer's weight gradient: k is the batch
}


def gemm_kernels(workload) -> list:
    """The kernels of ``workload``'s plans that ``tile_gemm`` tiles, in plan order, without duplicates."""
    schedule.clear_cache()
    utils.KERNEL_LOG = log = []
    try:
        with autotune.configured(False):
            workload()
    finally:
        utils.KERNEL_LOG = None
    info, seen, out = registry().get("host").primary.info(), set(), []
    for k in log:
        if opt.optimize(k, info).gemm is not None and k.name not in seen:
            seen.add(k.name)
            out.append(k)
    return out


def time_candidates(dev, kernel, rounds: int) -> dict[str, float]:
    """Median ms of ``kernel`` under each of ``CANDIDATES``, one launch of each per round."""
    args, owned = autotune._scratch(dev, kernel)
    programs, created = {}, set()
    try:
        for name, params in CANDIDATES.items():
            programs[name], new = dev.compile_candidate(kernel, params)
            if new:
                created.add(programs[name])
        times: dict[str, list[float]] = {n: [] for n in programs}
        for pid in programs.values():
            dev.launch_timed(pid, args)  # first touch of the scratch buffers and of each program
        for _ in range(rounds):
            for name, pid in programs.items():
                times[name].append(dev.launch_timed(pid, args) / 1e6)
        return {n: statistics.median(t) for n, t in times.items()}
    finally:
        pool = dev.pool()
        for b in owned:
            pool.release(b)
        for pid in created:
            dev.release(pid)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="*", help=f"of {', '.join(WORKLOADS)} (default: all)")
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    unknown = [w for w in a.workloads if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    dev = registry().get("host").primary
    names = list(CANDIDATES)
    head = f"{'workload:kernel':32s} {'M':>5s} {'N':>6s} {'K':>5s} {'mr x nr':>8s} {'k-in':>4s} "
    print(head + " ".join(f"{n:>9s}" for n in names))
    for w in a.workloads or list(WORKLOADS):
        for k in gemm_kernels(WORKLOADS[w]):
            g = opt.optimize(k, dev.info()).gemm
            ms = time_candidates(dev, k, a.rounds)
            base = ms["heuristic"]
            cells = [f"{ms['heuristic']:8.2f}m"] + [f"{ms[n] / base:9.2f}" for n in names[1:]]
            shape = f"{g.c.m.arg[1]:5d} {g.n:6d} {g.c.k.arg[1]:5d} {g.mr:4d}x{g.nr:<3d}"
            print(f"{w + ':' + k.name:32s} {shape} {'yes' if g.pack_k_inner else '':>4s} " + " ".join(cells),
                  flush=True)


if __name__ == "__main__":
    main()

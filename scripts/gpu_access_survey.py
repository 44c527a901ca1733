"""List the GPU kernels of typical workloads whose memory accesses a warp does not coalesce, without a GPU.

Each workload runs on ``cuda:0`` under the emulated driver with kernel bodies skipped (``ZYX_CUDA_EMULATE=nokernels``:
planning, rendering and NVRTC run, nothing is computed). For every kernel ``gpu.optimize`` plans, the script prints
its layout and, for the loop a warp's lanes walk (the innermost output loop of the ``thread`` and ``tile`` layouts,
the cooperative reduce loop of ``group`` and ``columns``, ``gpu.lane_strides``), every load and store whose index
steps by more than one element from lane to lane (``c=None``: not affine in that loop, e.g. a division or a gather),
and every reduce nested in a reduce of the same op. Staged loads of the ``tile`` layout are left out (they are read
along the other loop). A line is a place to look, not a verdict: a gated window (pooling, padding) or a bitonic
network's partners are uncoalesced by nature.

    ZYX_CUDA_EMULATE=nokernels python scripts/gpu_access_survey.py        # every workload
    ZYX_CUDA_EMULATE=nokernels python scripts/gpu_access_survey.py sort   # names containing "sort"
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import zyx  # noqa: E402
from zyx.graph import schedule  # noqa: E402
from zyx.kernel import gpu, ir  # noqa: E402
from zyx.kernel.ir import Kernel  # noqa: E402
from zyx.nn import functional as F  # noqa: E402
from zyx.ops import Ops  # noqa: E402

DEVICE = "cuda:0"
_rng = np.random.default_rng(0)


def tensor(*shape: int, grad: bool = False) -> zyx.Tensor:
    return zyx.Tensor(_rng.standard_normal(shape).astype(np.float32), device=DEVICE, requires_grad=grad).realize()


def indices(high: int, shape: tuple[int, ...]) -> zyx.Tensor:
    return zyx.Tensor(_rng.integers(0, high, shape), device=DEVICE)


def findings(k: Kernel) -> list[str]:
    """The uncoalesced accesses and nested reduces of one optimized kernel (see the module docstring)."""
    g = gpu.geometry(k)
    out = []
    if g.strategy in ("thread", "tile") and k.loops:
        lane = k.loops[g.split - 1] if g.strategy == "thread" and g.split < len(k.loops) else k.loops[-1]
        if g.split == 0 and g.strategy == "thread":
            return out
        loads = [e for e in ir.toposort([st.value for st in k.stores]) if e.op is Ops.LOAD and e not in g.staged]
        for ld in loads:
            if (c := ir.affine_coefficient(ld.srcs[0], lane)) not in (0, 1, -1):
                out.append(f"load p{ld.arg}{' (gated)' if len(ld.srcs) > 1 else ''} c={c}")
        for st in k.stores:
            if (c := ir.affine_coefficient(st.index, lane)) not in (0, 1, -1):
                out.append(f"store p{st.param} c={c}")
    elif g.strategy in ("group", "columns"):
        out += [f"reduce load p{ld.arg} c={c}" for ld, c in gpu.lane_strides(k).items() if c not in (0, 1, -1)]
    for e in k.reduces():
        if e.srcs[0].op is Ops.REDUCE and e.srcs[0].arg[0] is e.arg[0]:
            out.append(f"nested {e.arg[0].name} reduce")
    return out


def conv_step(x_shape, w_shape, **conv) -> Callable[[], None]:
    def run() -> None:
        x, w = tensor(*x_shape, grad=True), tensor(*w_shape, grad=True)
        loss = F.conv2d(x, w, **conv).sum()
        loss.backward()
        zyx.realize(loss, x.grad, w.grad)
    return run


def embedding_step() -> None:
    w = tensor(3000, 256, grad=True)
    (F.embedding(indices(3000, (16, 64)), w) * tensor(16, 64, 256)).sum().backward()
    w.grad.realize()


def pool_step() -> None:
    x = tensor(4, 64, 56, 56, grad=True)
    loss = F.max_pool2d(x, 3, 2, 1).sum()
    loss.backward()
    zyx.realize(loss, x.grad)


def attention() -> None:
    q = tensor(4, 128, 8, 64).permute(0, 2, 1, 3)
    ((q @ q.transpose(-1, -2)).softmax(-1) @ q).permute(0, 2, 1, 3).reshape(4, 128, 512).realize()


WORKLOADS: dict[str, Callable[[], object]] = {
    "conv2d 3x3 step": conv_step((8, 32, 28, 28), (64, 32, 3, 3), padding=1),
    "conv2d 7x7 s2 stem step": conv_step((4, 3, 64, 64), (16, 3, 7, 7), stride=2, padding=3),
    "depthwise conv2d step": conv_step((4, 64, 28, 28), (64, 1, 3, 3), padding=1, groups=64),
    "conv_transpose2d": lambda: F.conv_transpose2d(tensor(4, 64, 16, 16), tensor(64, 32, 4, 4), stride=2,
                                                   padding=1).realize(),
    "max_pool2d step": pool_step,
    "avg_pool2d": lambda: F.avg_pool2d(tensor(4, 64, 56, 56), 2).realize(),
    "group_norm": lambda: F.group_norm(tensor(8, 64, 28, 28), 8).realize(),
    "layer_norm": lambda: F.layer_norm(tensor(64, 128, 256), (256,)).realize(),
    "softmax": lambda: tensor(512, 1000).softmax(-1).realize(),
    "attention heads": attention,
    "bilinear upsampling": lambda: F.interpolate(tensor(2, 16, 64, 64), scale_factor=2, mode="bilinear").realize(),
    "embedding backward": embedding_step,
    "cumsum rows": lambda: tensor(256, 1024).cumsum(1).realize(),
    "cumsum columns": lambda: tensor(256, 1024).cumsum(0).realize(),
    "sort rows": lambda: tensor(64, 256).sort(-1)[0].realize(),
    "topk rows": lambda: tensor(64, 1024).topk(8)[0].realize(),
    "pad": lambda: tensor(8, 32, 28, 28).pad(((0, 0), (0, 0), (1, 1), (1, 1))).realize(),
    "column sum": lambda: tensor(1024, 1024).sum(0).realize(),
    "sum over batch of image sums": lambda: tensor(16, 64, 28, 28).sum((2, 3)).sum(0).realize(),
    "transpose": lambda: tensor(1024, 512).T.contiguous().realize(),
    "nhwc to nchw": lambda: tensor(8, 28, 28, 64).permute(0, 3, 1, 2).contiguous().realize(),
    "every other column": lambda: tensor(1024, 1024)[:, ::2].contiguous().realize(),
    "gather rows": lambda: tensor(256, 512).gather(1, indices(512, (256, 16))).realize(),
    "argmax columns": lambda: tensor(512, 1000).argmax(0).realize(),
}


def main(argv: list[str]) -> int:
    layouts = "--layouts" in argv  # also list every kernel's layout (strategy, and tiling where there is one)
    argv = [a for a in argv if a != "--layouts"]
    seen: list[Kernel] = []
    planned = gpu.optimize

    def record(k: Kernel, info, params=None) -> Kernel:
        out = planned(k, info, params)
        seen.extend((out, *out.then))
        return out

    gpu.optimize = record
    flagged = 0
    for name, run in WORKLOADS.items():
        if argv and not any(a in name for a in argv):
            continue
        seen.clear()
        schedule.clear_cache()
        run()
        lines = Counter(f"{k.name:40s} {gpu.geometry(k).strategy:8s} "
                        + "; ".join(f"{f} x{n}" if n > 1 else f for f, n in Counter(found).items())
                        for k in seen if (found := findings(k)))
        flagged += len(lines)
        print(f"{name}: {len(seen)} kernels planned" + ("" if lines else ", every access coalesced"))
        for line, times in lines.items():
            print(f"    {line}" + (f"  ({times} times)" if times > 1 else ""))
        if layouts:
            for k in dict.fromkeys(seen):
                g = gpu.geometry(k)
                tiling = g.simt or g.tile or ""
                print(f"    layout {k.name:40s} {g.strategy:8s} block={g.block} grid={g.grid} {tiling}")
    print(f"{flagged} distinct kernels with an access to look at")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

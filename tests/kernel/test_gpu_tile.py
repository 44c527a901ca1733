"""The GPU ``tile`` layout (``gpu.tile_loads``, ``render_cuda``'s ``tile_frame``): a kernel without reduces that
reads some buffer transposed stages that read through ``__shared__`` tiles, so that both its reads and its writes
are coalesced. What is checked:

- the decision, from the IR alone: a transpose, ``x + x.T``, a batched NHWC -> NCHW permute take it, staging only
  the transposed reads; contiguous kernels, short loops, gated reads and segments keep the ``thread`` layout;
- the memory access pattern, from the IR: every staged read steps by one along the loop that phase 1's lanes
  walk, every store and other read along phase 2's;
- the rendered source (tiles, barriers, bounds) compiles with NVRTC for sm_80 and sm_90;
- the values on the emulated ``cuda:0``: odd shapes, batches and eight dtypes equal NumPy bit for bit, with the
  tile layout and with the ``thread`` layout forced.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import compute_devices, gpu_planned, nvrtc_compiles, only_kernel
from conftest import typed_leaf as leaf

import zyx
from zyx.backends.cuda import nvrtc
from zyx.kernel import gpu, ir
from zyx.kernel.ir import Kernel
from zyx.kernel.render_cuda import CUDARenderer

INFO = gpu.reference_info()
THREAD = gpu.STRATEGIES.index("thread")
_NVRTC = nvrtc.available()
needs_nvrtc = pytest.mark.skipif(_NVRTC is not None, reason=f"NVRTC unavailable ({_NVRTC}): {nvrtc.INSTALL_HINT}")
needs_cuda = pytest.mark.skipif("cuda:0" not in compute_devices(), reason="no cuda:0 (GPU or emulator)")

DTYPES = ["float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "bool"]


def optimized(k: Kernel, params: dict[str, int] | None = None) -> Kernel:
    return gpu.optimize(k, INFO, params)


def test_transposed_reads_take_the_tile_layout():
    x = leaf((1024, 512))
    k = optimized(only_kernel(x.T.contiguous()))
    g = gpu.geometry(k)
    assert (g.strategy, g.block, g.items, g.grid) == ("tile", (32, 8, 1), 16 * 32, (512, 1, 1))
    assert len(g.staged) == 1
    # x + x.T: only the transposed read is staged; the other is read in place, coalesced
    s = leaf((256, 256))
    g2 = gpu.geometry(optimized(only_kernel(s + s.T * 2.0)))
    assert g2.strategy == "tile" and len(g2.staged) == 1
    # NHWC -> NCHW of a batch: the batch is an outer loop (one tile of (C, HW) per block and image)
    nhwc = leaf((4, 14, 14, 64))
    k3 = optimized(only_kernel(nhwc.permute(0, 3, 1, 2).contiguous()))
    g3 = gpu.geometry(k3)
    assert g3.strategy == "tile" and [r.arg[1] for r in k3.loops] == [4, 64, 196]
    assert g3.items == 4 * 2 * 7
    for dtype in ("float16", "int8", "bool", "float64"):
        assert gpu.geometry(optimized(only_kernel(leaf((64, 96), dtype).T.contiguous()))).strategy == "tile"


def test_other_kernels_keep_the_thread_layout():
    x = leaf((1024, 1024))
    assert gpu.geometry(optimized(only_kernel(x * 2.0))).strategy == "thread"  # contiguous
    assert gpu.geometry(optimized(only_kernel(leaf((16, 1024)).T.contiguous()))).strategy == "thread"  # short i
    assert gpu.geometry(optimized(only_kernel(leaf((1024, 16)).T.contiguous()))).strategy == "thread"  # short j
    padded = only_kernel(x.T.pad(((1, 1), (0, 0))))  # the transposed read is gated by the padding
    assert gpu.geometry(optimized(padded)).strategy == "thread"
    ko = optimized(only_kernel(zyx.cat([x.T, x]) * 2.0))
    assert all(gpu.geometry(p).strategy == "thread" for p in (ko, *ko.then))  # segments share one block shape
    # forced off: the search's other choice
    k = only_kernel(x.T.contiguous())
    assert gpu.geometry(optimized(k, {"strategy": THREAD})).strategy == "thread"
    space = gpu.search_space(k, INFO)
    assert [gpu.STRATEGIES[s] for s in space["strategy"]] == ["tile", "thread"]


def test_both_phases_read_and_write_along_their_lanes():
    """Phase 1's lanes walk ``i`` (the next-to-innermost loop), phase 2's ``j`` (the innermost): each staged read
    steps by one along ``i``, every store and every read left in place by 0 or 1 along ``j``."""
    a, b = leaf((512, 384)), leaf((384, 512))
    nchw = leaf((2, 64, 28, 28))
    for t in (a.T.contiguous(), a.T + b, a.T * b + a.T.exp(), nchw.permute(0, 2, 3, 1).contiguous() + 1.0):
        k = optimized(only_kernel(t))
        g = gpu.geometry(k)
        assert g.strategy == "tile"
        i, j = k.loops[-2], k.loops[-1]
        loads = [e for e in ir.toposort([st.value for st in k.stores]) if e.op is ir.Ops.LOAD]
        for ld in loads:
            if ld in g.staged:
                assert ir.affine_coefficient(ld.srcs[0], i) == 1
            else:
                assert ir.affine_coefficient(ld.srcs[0], j) in (0, 1)
        assert all(ir.affine_coefficient(st.index, j) == 1 for st in k.stores)


def test_the_source_stages_each_read_once_per_tile():
    a = leaf((100, 70))  # neither a multiple of 32: partial tiles at both edges
    k = optimized(only_kernel(a.T * 3.0 + a.T.contiguous().sqrt()))
    g = gpu.geometry(k)
    src = CUDARenderer().render(k).source
    assert len(g.staged) == 1 and src.count("__shared__ float zt") == 1
    assert "__shared__ float zt0[32][33];" in src and src.count("__syncthreads();") == 2
    assert re.search(r"zt0\[zy \+ zr\]\[zx\] = p\d+\[", src) and "zt0[zx][zy + zr]" in src
    assert src.count("< 70 && ") == 2 and src.count("< 100) {") == 2  # both phases check both bounds


def _variants() -> list[Kernel]:
    out = [only_kernel(leaf((100, 70), d).T.contiguous()) for d in DTYPES]
    out.append(only_kernel(leaf((3, 40, 50)).permute(0, 2, 1) + leaf((3, 50, 40))))
    out.append(only_kernel(leaf((64, 64), "float16").T.cast("float32") * leaf((64, 64))))
    x = leaf((96, 128))
    out.append(only_kernel(x.T + x.T.exp()))
    return out


@needs_nvrtc
def test_every_tile_variant_compiles_for_sm80_and_sm90():
    sources = []
    for k in _variants():
        ko = optimized(k)
        assert gpu.geometry(ko).strategy == "tile", k.name
        sources.append(CUDARenderer().render(ko).source)
    nvrtc_compiles(sources)


def _cases(dtype: str) -> list[tuple[str, object, object, list[tuple[int, ...]]]]:
    """(name, zyx function, NumPy function, input shapes)."""
    if dtype == "bool":
        return [
            ("transpose", lambda m: m.T.contiguous(), lambda m: m.T, [(97, 45)]),
            ("batched compare", lambda a, b: a.permute(0, 2, 1) == b, lambda a, b: a.transpose(0, 2, 1) == b,
             [(3, 40, 33), (3, 33, 40)]),
        ]
    return [
        ("square", lambda m: m.T.contiguous(), lambda m: m.T, [(64, 64)]),
        ("odd edges", lambda m: m.T + 0, lambda m: m.T + 0, [(97, 45)]),
        ("x + x.T * 2", lambda m: m + m.T * 2, lambda m: m + m.T * 2, [(70, 70)]),
        ("batched", lambda a, b: a.permute(0, 2, 1) - b, lambda a, b: a.transpose(0, 2, 1) - b,
         [(3, 40, 33), (3, 33, 40)]),
        ("nhwc to nchw", lambda x: x.permute(0, 3, 1, 2).contiguous(), lambda x: x.transpose(0, 3, 1, 2),
         [(2, 7, 9, 40)]),
        ("two transposed reads", lambda a, b: a.T * 2 + b.T, lambda a, b: a.T * 2 + b.T, [(50, 60), (50, 60)]),
    ]


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_results_equal_numpy(dtype, rng):
    """Small integers (exact in every dtype here), so results compare bit for bit."""
    for params, want_tile in (({}, True), ({"strategy": THREAD}, False)):
        with gpu_planned(params) as seen:
            for name, f, ref, shapes in _cases(dtype):
                xs = [rng.integers(-20, 21, s).astype(np.float32) for s in shapes]
                if dtype == "bool":
                    xs = [x > 0 for x in xs]
                args = [zyx.Tensor(x.astype(np.float32), device="cuda:0").cast(dtype).realize() for x in xs]
                got = f(*args).realize()
                want = ref(*xs)
                g = got.numpy() if got.dtype.name == "bool" else got.cast("float64").numpy()
                np.testing.assert_array_equal(g, want.astype(g.dtype), err_msg=f"{dtype} {name} {params}")
        tiles = [g for g in seen if g.strategy == "tile"]
        assert bool(tiles) == want_tile, (dtype, params)

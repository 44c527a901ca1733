"""The GPU ``scan`` layout (``gpu._scan_geometry``, ``render_cuda``'s ``scan_frame``): a cumulative sum or
product along a row runs on a group of lanes, each folding a contiguous chunk, the group's exclusive prefix of
the chunk totals starting each lane's running value. What is checked:

- the decision, from the IR alone: long rows take it (lanes sized to the row), short rows, scans of scans and
  8-bit types keep the ``thread`` layout; the search keeps ``thread`` as the other choice;
- the rendered source (two passes over the chunk, the shuffles, shared memory only across warps) compiles with
  NVRTC for sm_80 and sm_90;
- the values on the emulated ``cuda:0``: sums and products of six dtypes, rows of 64 to 5000, elementwise work
  before and after the scan, equal NumPy (bit for bit for integers), with the layout and with ``thread`` forced.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import compute_devices, gpu_planned, kernels_of, nvrtc_compiles
from conftest import typed_leaf as leaf

import zyx
from zyx.backends.cuda import nvrtc
from zyx.kernel import gpu, ir
from zyx.kernel.ir import Kernel, Param, Store
from zyx.kernel.render_cuda import CUDARenderer
from zyx.ops import Ops

INFO = gpu.reference_info()
THREAD = gpu.STRATEGIES.index("thread")
_NVRTC = nvrtc.available()
needs_nvrtc = pytest.mark.skipif(_NVRTC is not None, reason=f"NVRTC unavailable ({_NVRTC}): {nvrtc.INSTALL_HINT}")
needs_cuda = pytest.mark.skipif("cuda:0" not in compute_devices(), reason="no cuda:0 (GPU or emulator)")


def scan_kernel(t: zyx.Tensor) -> Kernel:
    """The scan kernel along the longest loop (rows past 1024 scan in chunks of 1024, then across the chunks)."""
    return max((k for k in kernels_of(t) if k.scan_ranges()), key=lambda k: k.loops[-1].arg[1])


def long_scan(rows: int, size: int) -> Kernel:
    """A cumulative sum along rows of ``size``, built as IR (the graph cuts rows past 1024 into chunks)."""
    f32 = zyx.dtypes.float32
    r, i = ir.range_(0, rows), ir.range_(1, size)
    at = r * size + i
    return Kernel("scan_long", (Param("p0", f32, "out", rows * size), Param("p1", f32, "in", rows * size)), (r, i),
                  (Store(0, at, ir.scan(Ops.ADD, ir.load(1, f32, at), i)),))


def geometry_of(k: Kernel, params: dict[str, int] | None = None) -> gpu.Geometry:
    return gpu.geometry(gpu.optimize(k, INFO, params))


def test_long_rows_take_the_scan_layout():
    g = geometry_of(scan_kernel(leaf((4, 1000)).cumsum(1)))
    assert (g.strategy, g.group_threads, g.block, g.items) == ("scan", 64, (64, 1, 1), 4)  # 1000 / 64: 16 per lane
    g2 = geometry_of(scan_kernel(leaf((1000, 100)).cumsum(1)))
    assert (g2.strategy, g2.group_threads, g2.block, g2.items) == ("scan", 32, (32, 8, 1), 1000)  # a warp per row
    g3 = geometry_of(scan_kernel(leaf((2, 20000)).cumsum(1)))  # chunks of 1024 (2 x 20 of them), then across
    assert (g3.strategy, g3.group_threads, g3.items) == ("scan", 64, 40)
    assert geometry_of(long_scan(2, 20000)).group_threads == 1024  # 20000 / 1024: 20 per lane
    assert geometry_of(scan_kernel(leaf((4, 1000)).cumprod(1))).strategy == "scan"
    k = scan_kernel(leaf((4, 1000)).cumsum(1))
    assert geometry_of(k, {"strategy": THREAD}).strategy == "thread"
    assert [gpu.STRATEGIES[s] for s in gpu.search_space(k, INFO)["strategy"]] == ["scan", "thread"]


def test_short_rows_and_narrow_types_keep_the_thread_layout():
    assert geometry_of(scan_kernel(leaf((100, 40)).cumsum(1))).strategy == "thread"
    assert geometry_of(scan_kernel(leaf((4, 1000), "int8").cumsum(1, dtype="int8"))).strategy == "thread"


def test_the_source_folds_each_chunk_twice():
    k = gpu.optimize(scan_kernel(leaf((4, 1000)).cumsum(1)), INFO)
    src = CUDARenderer().render(k).source
    assert src.count("for (int r1 = zlo; r1 < zhi; r1++)") == 2  # the totals, then the running values
    assert "__shfl_up_sync" in src and "__shared__ float zsh" in src  # 2 warps: shared memory between them
    src32 = CUDARenderer().render(gpu.optimize(scan_kernel(leaf((1000, 100)).cumsum(1)), INFO)).source
    assert "__shfl_up_sync" in src32 and "__shared__" not in src32 and "__syncthreads" not in src32


def _variants() -> list[Kernel]:
    out = [scan_kernel(leaf((4, 1000), d).cumsum(1)) for d in ("float32", "float16", "bfloat16", "float64",
                                                                 "int32", "int64")]
    out.append(scan_kernel(leaf((3, 5000)).cumprod(1)))
    out.append(long_scan(2, 20000))
    out.append(scan_kernel(leaf((8, 300)).exp().cumsum(1) * 2.0))
    return out


@needs_nvrtc
def test_every_scan_variant_compiles_for_sm80_and_sm90():
    sources = []
    for k in _variants():
        ko = gpu.optimize(k, INFO)
        assert gpu.geometry(ko).strategy == "scan", k.name
        sources.append(CUDARenderer().render(ko).source)
    nvrtc_compiles(sources)


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64", "int32", "int64"])
def test_emulated_scans_equal_numpy(dtype, rng):
    shapes = [(3, 64), (5, 1000), (2, 3, 700), (1, 5000)]
    for params, layout in (({}, True), ({"strategy": THREAD}, False)):
        with gpu_planned(params) as seen:
            for shape in shapes:
                # 16-bit types: steps of -1, 0, 1 keep every partial sum an integer they hold exactly
                x = rng.integers(-1, 2, shape) if dtype in ("float16", "bfloat16") else rng.integers(-3, 4, shape)
                x = x.astype(np.float64)
                t = zyx.Tensor(x.astype(np.float32), device="cuda:0").cast(dtype)
                got = t.cumsum(-1).cast("float64").numpy()
                np.testing.assert_array_equal(got, np.cumsum(x, -1), err_msg=f"{dtype} {shape} {params}")
            if dtype in ("float32", "float64"):
                p = rng.uniform(0.9, 1.1, (4, 600))
                got = zyx.Tensor(p, device="cuda:0").cast(dtype).cumprod(1).numpy()
                np.testing.assert_allclose(got, np.cumprod(p, 1), rtol=1e-5, err_msg=f"cumprod {params}")
                e = rng.standard_normal((6, 300))
                got = (zyx.Tensor(e, device="cuda:0").cast(dtype).exp().cumsum(1) * 2.0).numpy()
                np.testing.assert_allclose(got, np.cumsum(np.exp(e), 1) * 2, rtol=1e-5, err_msg=f"exp {params}")
        assert any(g.strategy == "scan" for g in seen) == layout, params

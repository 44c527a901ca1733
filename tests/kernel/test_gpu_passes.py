"""GPU launch geometry chosen from the kernel IR (``zyx.kernel.gpu``): coalesced layouts for reductions.

The layout follows from the load indices' coefficients of the loops the lanes of a warp walk, never from a
kernel's name: a reduce over a strided axis (a column sum) puts ``threadIdx.x`` along the contiguous output
axis (``columns``), a reduce over the contiguous axis keeps the lanes along the reduce (``group``). The rendered
source is checked too: a tiny g++ harness runs one thread of the kernel at a time and records the first element
each thread reads, so "adjacent threads read adjacent addresses" is shown on the code the GPU would run.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import gpu_passes_off, host_without_blas, kernels_of, nvrtc_compiles

import zyx
from zyx import dtypes
from zyx.backends.cuda import nvrtc
from zyx.backends.cuda.args import ArgPack
from zyx.backends.cuda.emulator import kernels as emu_kernels
from zyx.kernel import gpu, ir
from zyx.kernel.ir import Kernel, Param, Store
from zyx.kernel.linearize import linearize
from zyx.kernel.render_cuda import CUDARenderer, render_cuda
from zyx.ops import Ops

INFO = gpu.reference_info()
f32 = dtypes.float32
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the source probe needs g++")




def only_kernel(t: zyx.Tensor) -> Kernel:
    (k,) = kernels_of(t)
    return k


def lazy(shape: tuple[int, ...]) -> zyx.Tensor:
    return zyx.Tensor(np.zeros(shape, np.float32))


# ---------------------------------------------------------------------------------------------------------------
# the IR: lane strides


def test_column_sum_puts_adjacent_threads_on_adjacent_elements():
    k = gpu.optimize(only_kernel(lazy((4096, 4096)).sum(0)), INFO)
    g = gpu.geometry(k)
    assert g.strategy == "columns" and g.block[0] == 32 and g.items == 4096
    strides = gpu.lane_strides(k)
    assert strides and set(strides.values()) == {1}  # coefficient of threadIdx.x in the load index: 1
    assert g.grid[0] * g.groups_per_block >= 4096 and g.block_threads <= INFO.max_local_threads


def test_row_sum_keeps_the_lanes_along_the_reduce():
    k = gpu.optimize(only_kernel(lazy((4096, 4096)).sum(1)), INFO)
    g = gpu.geometry(k)
    assert g.strategy == "group" and set(gpu.lane_strides(k).values()) == {1}


def test_the_column_layout_touches_an_eighth_of_the_sectors():
    """The cost the choice is made on: memory sectors per warp access (4 for 32 adjacent floats, 32 when 4096
    floats apart)."""
    k = gpu.optimize(only_kernel(lazy((4096, 4096)).sum(0)), INFO)
    root = linearize(k)
    (red,) = gpu._top_reduces(root, 1)
    loads = gpu.reduce_loads(red)
    assert gpu.access_sectors(loads, gpu._columns_lanes([lp.range for lp in gpu.output_loops(root)], red, 32)) == 4
    assert gpu.access_sectors(loads, gpu._group_lanes(red)) == 32


def test_layout_follows_the_strides_not_the_name():
    """The same name, two index layouts: the geometry differs; the same layout under two names: it does not."""
    j, r = ir.range_(0, 500), ir.range_(1, 800)
    params = (Param("p0", f32, "out", 500), Param("p1", f32, "in", 500 * 800))

    def kern(name: str, index: ir.Expr) -> Kernel:
        return Kernel(name, params, (j,), (Store(0, j, ir.reduce(Ops.ADD, ir.load(1, f32, index), (r,))),))

    strided, contiguous = r * 500 + j, j * 800 + r
    assert gpu.geometry(gpu.optimize(kern("row_sum", strided), INFO)).strategy == "columns"
    assert gpu.geometry(gpu.optimize(kern("col_sum", contiguous), INFO)).strategy == "group"
    assert gpu.geometry(gpu.optimize(kern("col_sum", strided), INFO)).strategy == "columns"


@pytest.mark.parametrize("shape,axis", [((64, 4096), 0), ((8, 300, 40), 1), ((300, 3), 0), ((7, 33, 5), 0),
                                        ((4096, 4096), 1), ((20, 30, 40), (0, 1)), ((20, 30, 40), 2),
                                        ((1000, 9), 0), ((5, 6, 7), (0, 2))])
def test_every_reduce_reads_coalesced_when_some_layout_can(shape, axis):
    """Whenever the reduced axes or the kept innermost axis are contiguous, the chosen layout's lanes step by 0
    or 1 element in every load (a transposed view included)."""
    for t in (lazy(shape).sum(axis), lazy(shape[::-1]).permute(*range(len(shape) - 1, -1, -1)).sum(axis)):
        for k in kernels_of(t):
            ko = gpu.optimize(k, INFO)
            strides = gpu.lane_strides(ko)
            if strides and all(s in (0, 1) for s in strides.values()):
                continue
            # allowed only when no layout is coalesced: the columns lanes (innermost output loop) are not either
            root = linearize(ko)
            loops = gpu.output_loops(root)
            inner = loops[-1].range if loops else None
            assert inner is None or not gpu.coalesced_across([ld for r in gpu._top_reduces(root, len(loops))
                                                              for ld in gpu.reduce_loads(r)], inner), \
                (k.name, gpu.geometry(ko), strides)


def test_nested_reduces_merge_so_that_the_lanes_read_adjacent_elements():
    """A depthwise convolution's weight gradient sums over the batch the sums over the image: merged
    (``merge_nested_reduces``) the group's lanes walk the image's contiguous axis instead of the batch (4 images
    50176 floats apart: 4 of 32 lanes busy). A max of maxes merges too; a sum of maxes does not."""
    from zyx.nn import functional as F

    x, w = zyx.Tensor(np.zeros((4, 64, 28, 28), np.float32), requires_grad=True), \
        zyx.Tensor(np.zeros((64, 1, 3, 3), np.float32), requires_grad=True)
    F.conv2d(x, w, padding=1, groups=64).sum().backward()
    (k,) = [k for k in kernels_of(w.grad) if k.reduces()]

    def nested(k: Kernel) -> bool:
        return any(e.srcs[0].op is Ops.REDUCE for e in k.reduces())

    assert nested(k)
    on = gpu.optimize(k, INFO)
    assert not nested(on) and gpu.geometry(on).strategy == "group" and set(gpu.lane_strides(on).values()) == {1}
    with gpu_passes_off("merge_reduces"):
        off = gpu.optimize(k, INFO)
    assert nested(off) and 64 * 28 * 28 in gpu.lane_strides(off).values()  # one image to the next
    y = lazy((8, 64, 14, 14))
    assert not nested(gpu.optimize(only_kernel(y.max((2, 3)).max(0)), INFO))
    assert nested(gpu.optimize(only_kernel(y.max((2, 3)).sum(0)), INFO))


def test_the_access_survey_flags_strided_lanes_and_nested_reduces():
    """``scripts/gpu_access_survey.py``'s finding per kernel: a stride-2 view's read, a nested reduce with
    ``merge_reduces`` off; nothing for a transpose in shared tiles or a merged sum."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "gpu_access_survey.py"
    spec = importlib.util.spec_from_file_location("gpu_access_survey", path)
    survey = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(survey)
    x = lazy((1024, 1024))
    assert survey.findings(gpu.optimize(only_kernel(x[:, ::2] + 1.0), INFO)) == ["load p1 c=2"]
    assert survey.findings(gpu.optimize(only_kernel(x.T + 1.0), INFO)) == []
    nested = only_kernel(lazy((16, 64, 28, 28)).sum((2, 3)).sum(0))
    assert survey.findings(gpu.optimize(nested, INFO)) == []
    with gpu_passes_off("merge_reduces"):
        assert "nested ADD reduce" in survey.findings(gpu.optimize(nested, INFO))


def test_loop_order_passes_put_the_contiguous_loop_innermost():
    """A transposed view: the output loop (``order_output_loops``) or the reduce loop (``order_reduce_ranges``)
    along which memory is contiguous becomes the lanes' loop; the iterations are the same."""
    x = lazy((40, 300, 8)).permute(2, 1, 0)  # x[i, k, j] at j * 2400 + k * 8 + i: i is contiguous
    k = only_kernel(x.sum(1))
    ordered = gpu.order_output_loops(k)
    assert ordered.loops != k.loops and sorted(r.arg[1] for r in ordered.loops) == sorted(r.arg[1] for r in k.loops)
    assert ordered.loops[-1].arg[1] == 8 and set(gpu.lane_strides(gpu.optimize(k, INFO)).values()) == {1}
    y = lazy((7, 6, 5)).permute(2, 1, 0)  # y[i, j, k] at k * 30 + j * 5 + i: reduce over (i, k), i contiguous
    k0 = only_kernel(y.sum((0, 2)))
    ky = gpu.optimize(k0, INFO)
    ((before,), (after,)) = k0.reduces(), ky.reduces()
    assert [r.arg[1] for r in before.arg[1]] == [5, 7]  # (i, k) as written
    assert [r.arg[1] for r in after.arg[1]] == [7, 5]  # k (30 apart) outer, i (adjacent) inner
    assert gpu.order_reduce_ranges(gpu.order_reduce_ranges(ky)) is ky  # a fixed point


def test_many_columns_still_get_a_thread_each():
    g = gpu.geometry(gpu.optimize(only_kernel(lazy((64, 40_000)).sum(0)), INFO))
    assert g.strategy == "thread" and g.items == 40_000


def test_column_layout_grows_the_reduce_split_until_the_gpu_is_busy():
    short = gpu.geometry(gpu.optimize(only_kernel(lazy((64, 4096)).sum(0)), INFO))
    long = gpu.geometry(gpu.optimize(only_kernel(lazy((8192, 4096)).sum(0)), INFO))
    few = gpu.geometry(gpu.optimize(only_kernel(lazy((5000, 3)).sum(0)), INFO))
    assert short.block == (32, 8, 1)  # 64 rows: 8 per thread
    assert long.block == (32, 32, 1)  # a block of 1024, 256 rows per thread
    assert few.strategy == "columns" and few.block[0] == 4 and few.block_threads % 32 == 0  # 3 columns, 8 rows
    assert not gpu.optimize(only_kernel(lazy((8192, 4096)).sum(0)), INFO).wide_acc  # 256 serial, then a tree


# ---------------------------------------------------------------------------------------------------------------
# the rendered source: which element each thread reads first

_PROBE = r"""
#include <math.h>
#include <string.h>
struct zyx_dim { unsigned x, y, z; };
static zyx_dim threadIdx, blockIdx, gridDim = {1, 1, 1};
static long long zyx_first = -1;
struct zyx_rec {
  const float* p;
  float operator[](long long i) const { if (zyx_first < 0) zyx_first = i; return p[i]; }
};
#define __global__
#define __launch_bounds__(n)
#define __shared__ static
#define __device__
#define __forceinline__ inline
static inline void __syncthreads() {}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int) { return v; }
"""


def first_reads(k: Kernel, threads: list[tuple[int, int]], tmp: Path, in_size: int, out_size: int) -> list[int]:
    """Render ``k`` (one output ``p0``, one input ``p1``, float32) and run it serially as thread ``(x, y)`` of
    block 0 on a grid of one block, for each of ``threads``; the first index of ``p1`` each thread reads."""
    cs = render_cuda(k, INFO)
    src = cs.source.replace('extern "C" ', "")
    src, n = re.subn(r"const float\* __restrict__ p1", "zyx_rec p1", src)
    assert n == 1
    src = src.replace("__restrict__", "")
    probe = (_PROBE + src + f"""
extern "C" long long zyx_probe(unsigned x, unsigned y, const float* in, float* out) {{
  threadIdx.x = x; threadIdx.y = y; threadIdx.z = 0; zyx_first = -1;
  {cs.name}(out, zyx_rec{{in}});
  return zyx_first;
}}
""")
    (tmp / "probe.cpp").write_text(probe)
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", str(tmp / "probe.cpp"), "-o", str(tmp / "p.so")],
                   check=True)
    lib = ctypes.CDLL(str(tmp / "p.so"))
    lib.zyx_probe.restype = ctypes.c_longlong
    lib.zyx_probe.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
    data, out = np.zeros(in_size, np.float32), np.zeros(out_size, np.float32)
    return [lib.zyx_probe(x, y, data.ctypes.data, out.ctypes.data) for x, y in threads]


@needs_gxx
def test_rendered_column_sum_threads_read_adjacent_elements(tmp_path):
    rows, cols = 256, 1000
    k = only_kernel(lazy((rows, cols)).sum(0))
    g = gpu.geometry(gpu.optimize(k, INFO))
    assert g.strategy == "columns"
    lanes = list(range(g.block[0]))
    got = first_reads(k, [(x, 0) for x in lanes] + [(0, 1), (0, 2)], tmp_path, rows * cols, cols)
    assert got[:len(lanes)] == lanes  # threadIdx.x = t reads element t: one 128-byte row segment per warp
    assert got[len(lanes):] == [cols, 2 * cols]  # threadIdx.y = s starts at row s


@needs_gxx
def test_rendered_row_sum_threads_read_adjacent_elements(tmp_path):
    rows, cols = 100, 3000
    k = only_kernel(lazy((rows, cols)).sum(1))
    assert gpu.geometry(gpu.optimize(k, INFO)).strategy == "group"
    assert first_reads(k, [(x, 0) for x in range(32)], tmp_path, rows * cols, rows) == list(range(32))


# ---------------------------------------------------------------------------------------------------------------
# tensor cores: shared-memory tiles of a 16-bit contraction (the ``mma`` strategy)

_NVRTC = nvrtc.available()
needs_nvrtc = pytest.mark.skipif(_NVRTC is not None, reason=f"NVRTC unavailable ({_NVRTC}): {nvrtc.INSTALL_HINT}")
EMU_GRID = 2  # blocks per emulated launch: fewer than the tiles, so the grid-stride loop over tiles wraps


def matmul_kernel(a_shape: tuple[int, ...], b_shape: tuple[int, ...], dtype: str, transpose_a: bool = False
                  ) -> Kernel:
    """The generated (BLAS off) kernel of ``a @ b`` for 16-bit leaves of the given shapes (``a.T @ b`` when
    ``transpose_a``: ``a_shape`` is then the stored shape)."""
    def leaf(shape: tuple[int, ...]) -> zyx.Tensor:
        return zyx.Tensor(np.zeros(shape, np.float32)).cast(dtype).realize()

    with host_without_blas():
        a = leaf(a_shape)
        out = (a.T if transpose_a else a) @ leaf(b_shape)
        (k,) = [k for k in kernels_of(out) if k.reduces()]
    return k


def emulate(k: Kernel, params: dict[str, int], inputs: dict[int, np.ndarray]) -> np.ndarray:
    """Run ``k`` (one output, ``p0``) rendered under ``params`` on the emulated driver's CPU runtime."""
    cs = CUDARenderer().render(gpu.optimize(k, INFO, params))
    fn = emu_kernels.compile_module(cs.source).functions[cs.name]
    out = np.zeros(k.params[0].size, k.params[0].dtype.np_dtype)
    bufs = [out] + [inputs[i] for i in range(1, len(k.params))]
    pack = ArgPack(len(bufs)).fill([None] * len(bufs), [b.ctypes.data for b in bufs])
    fault = fn.run([pack.slot(i)[:n] for i, n in enumerate(fn.param_sizes)], (min(cs.grid[0], EMU_GRID), 1, 1),
                   cs.block)
    assert fault is None, f"{cs.name}: {fault}"
    return out


def check_matmul(k: Kernel, a_shape: tuple[int, ...], b_shape: tuple[int, ...], transpose_a: bool,
                 params: dict[str, int], rng: np.random.Generator) -> None:
    """The emulated kernel equals NumPy's float64 matmul of the same 16-bit inputs (within the output's rounding)."""
    np_dtype = k.params[1].dtype.np_dtype
    a = rng.uniform(-1, 1, a_shape).astype(np.float32).astype(np_dtype)
    b = rng.uniform(-1, 1, b_shape).astype(np.float32).astype(np_dtype)
    by_size = {a.size: a, b.size: b}
    assert len(by_size) == 2 and len(k.params) == 3 and k.params[0].kind == "out"
    inputs = {i: np.ascontiguousarray(by_size[k.params[i].size]).reshape(-1) for i in (1, 2)}
    got = emulate(k, params, inputs).astype(np.float64)
    a64 = a.astype(np.float64)
    want = ((np.swapaxes(a64, -1, -2) if transpose_a else a64) @ b.astype(np.float64)).reshape(-1)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=2e-2)


def test_mma_kernel_stages_its_tiles_in_shared_memory():
    """An f16 256^3 matmul: a block of warps per output tile, operands staged through ``__shared__`` arrays
    between barriers, fragments from shared memory into ``mma.sync``; the tiles fit the device."""
    k = matmul_kernel((256, 256), (256, 256), "float16")
    ko = gpu.optimize(k, INFO)
    g = gpu.geometry(ko)
    assert g.strategy == "mma" and g.tile is not None and g.block == (32, g.tile.warps, 1)
    assert g.tile.shared_bytes <= INFO.local_memory_bytes
    assert g.items == -(-256 // g.tile.bm) * -(-256 // g.tile.bn)
    src = CUDARenderer().render(ko).source
    t = g.tile
    assert g.stages == 2 and g.tile.shared_bytes_of(dtypes.float16, 2) <= INFO.local_memory_bytes
    # two buffers per operand, rows of bk/2 k-pairs + 4 words of pad; b (n contiguous) is swizzled
    assert f"__shared__ __align__(16) unsigned int zsa[2][{t.bm}][{t.bk // 2 + 4}];" in src
    assert f"__shared__ __align__(16) unsigned int zsb[2][{t.bn}][{t.bk // 2 + 4}];" in src
    assert "zsb[zbf ^ 1][8 * zu + 0][(zv) ^ (" in src and f" << 3)) & {t.bk // 2 - 1})] = " in src
    # a prologue barrier and one per k step
    assert src.count("__syncthreads();") == 2 and "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in src
    # fragments from shared memory: a (k-first) by ldmatrix on sm_80+ (its emulation reads the same words), b
    # (swizzled) by words
    assert g.ldmatrix and "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in src and "(unsigned long long)&zsa[zbf][" in src
    assert "zb[zj][0] = zsb[zbf][" in src
    assert "*(uint4*)&zsa[" in src and "= *(const uint4*)(p" in src  # 16-byte loads: 256 is a multiple of 8
    # every tiling in the search space is legal for the device, and the heuristic's is listed first
    space = gpu.search_space(k, INFO)["mma_tile"]
    assert space[0] == gpu.MMA_TILES.index(t) and sorted(space) == list(gpu.mma_tiles(INFO))


def test_mma_tiles_respect_the_device_limits():
    """A tiling whose shared arrays or threads exceed the device is never a candidate nor chosen."""
    k = matmul_kernel((256, 256), (256, 256), "float16")
    small = replace(INFO, local_memory_bytes=8 * 1024, max_local_threads=128, max_local_work=(128, 128, 64))
    fits = gpu.mma_tiles(small)
    assert fits and all(gpu.MMA_TILES[i].shared_bytes <= 8 * 1024 and gpu.MMA_TILES[i].warps <= 4 for i in fits)
    assert len(fits) < len(gpu.MMA_TILES)
    for i in range(len(gpu.MMA_TILES)):  # a tile that does not fit falls back to the heuristic's
        assert gpu.MMA_TILES.index(gpu.geometry(gpu.optimize(k, small, {"mma_tile": i})).tile) in fits
    for t in gpu.MMA_TILES:
        assert t.bm % (16 * t.wm) == 0 and t.bn % (8 * t.wn) == 0 and t.bk % 16 == 0


def test_mma_fill_order_follows_the_contiguous_axis():
    plain = gpu.find_contraction(matmul_kernel((33, 47), (47, 70), "float16"))
    trans = gpu.find_contraction(matmul_kernel((47, 33), (47, 70), "float16", transpose_a=True))
    assert plain is not None and trans is not None
    assert gpu.mma_fill_order(plain) == (True, False)  # a: k contiguous; b: n contiguous
    assert gpu.mma_fill_order(trans) == (False, False)  # a.T: m contiguous
    # 16-byte loads only where every vector is aligned and wholly inside or outside the bounds
    assert gpu.mma_vector_fill(plain) == (False, False)  # k = 47, n = 70: not multiples of 8
    batched = gpu.find_contraction(matmul_kernel((3, 40, 24), (3, 24, 56), "float16"))
    trans8 = gpu.find_contraction(matmul_kernel((48, 40), (48, 56), "float16", transpose_a=True))
    assert batched is not None and gpu.mma_vector_fill(batched) == (True, True)
    assert trans8 is not None and gpu.mma_vector_fill(trans8) == (True, True) and not gpu.mma_fill_order(trans8)[0]


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_mma_tile_compiles_for_sm80_and_sm90(dtype):
    k = matmul_kernel((256, 256), (256, 256), dtype)
    sources = [CUDARenderer().render(gpu.optimize(k, INFO, {"mma_tile": i})).source
               for i in gpu.search_space(k, INFO)["mma_tile"]]
    nvrtc_compiles(sources)


@needs_gxx
def test_every_mma_tile_computes_the_matmul_under_emulation(rng):
    """Ragged sizes (no dimension a multiple of any tile): each tiling of the search space equals NumPy."""
    k = matmul_kernel((33, 47), (47, 70), "float16")
    for i in gpu.search_space(k, INFO)["mma_tile"]:
        assert gpu.geometry(gpu.optimize(k, INFO, {"mma_tile": i})).tile == gpu.MMA_TILES[i]
        check_matmul(k, (33, 47), (47, 70), False, {"mma_tile": i}, rng)


@needs_gxx
@pytest.mark.parametrize("a_shape,b_shape,transpose_a,dtype", [
    ((33, 47), (47, 70), False, "bfloat16"),
    ((3, 40, 24), (3, 24, 56), False, "float16"),
    ((70, 33), (70, 47), True, "bfloat16"),
    ((48, 40), (48, 56), True, "float16"),
    ((3, 40, 24), (3, 24, 56), False, "bfloat16")])
def test_mma_matmuls_under_emulation_equal_numpy(a_shape, b_shape, transpose_a, dtype, rng):
    """Batched, transposed and bfloat16 contractions on the heuristic's tile and on the largest one."""
    k = matmul_kernel(a_shape, b_shape, dtype, transpose_a)
    assert gpu.geometry(gpu.optimize(k, INFO)).strategy == "mma"
    for params in ({}, {"mma_tile": 0}):
        check_matmul(k, a_shape, b_shape, transpose_a, params, rng)

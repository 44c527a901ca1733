"""The GPU ``simt`` layout (``gpu.SimtTile``, ``render_cuda``'s ``simt_frame``): a contraction that tensor cores do
not take (exact float32, PyTorch's default; float64; int64) runs as register tiles over shared-memory tiles on
CUDA cores. What is checked:

- the decision, from the IR alone: large exact float32, float64 and int64 matmuls take it, TF32 and 16-bit ones
  keep ``mma``; thin, short or few-block contractions keep the reduce layouts, where it stays a legal candidate;
  attention's heads merged into the output's columns are split back (``split_contraction_loops``) so either
  tiled layout takes the product;
- the tilings a device may run: shared memory, threads, accumulator registers (fewer with float64 sums);
- the rendered source: operand tiles filled along the operand's contiguous axis, 16-byte shared reads of each
  thread's runs, the epilogue fused;
- every tiling, stage count and dtype compiles with NVRTC for sm_80 and sm_90;
- on the emulator: every tiling equals the ``thread`` layout bit for bit (the same ``fma`` chain in k order) on a
  ragged float32 product, and two variants do on float64, int64, batched and transposed shapes, with prologue and
  epilogue arithmetic; long float32 sums (float64
  accumulators) stay within float32 rounding of the float64 product; end to end on ``cuda:0`` forward and
  backward equal NumPy.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest
from conftest import (
    assert_close,
    compute_devices,
    gpu_passes_off,
    gpu_planned,
    host_without_blas,
    kernels_of,
    nvrtc_compiles,
    run_emulated_matmul,
)

import zyx
from zyx import dtypes
from zyx.backends.cuda import nvrtc
from zyx.kernel import contraction, gpu, opt
from zyx.kernel.ir import Kernel
from zyx.kernel.render_cuda import CUDARenderer

INFO = gpu.reference_info()
TF32 = replace(INFO, allow_tf32=True)
SIMT, THREAD = gpu.STRATEGIES.index("simt"), gpu.STRATEGIES.index("thread")
EMU_GRID = 3  # blocks per emulated launch: fewer than the tiles, so the grid-stride loop over tiles wraps
_NVRTC = nvrtc.available()
needs_nvrtc = pytest.mark.skipif(_NVRTC is not None, reason=f"NVRTC unavailable ({_NVRTC}): {nvrtc.INSTALL_HINT}")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")
needs_cuda = pytest.mark.skipif("cuda:0" not in compute_devices(), reason="no cuda:0 (GPU or emulator)")


def matmul_kernel(a_shape: tuple[int, ...], b_shape: tuple[int, ...], dtype: str = "float32",
                  transpose_a: bool = False, wrap=None) -> Kernel:
    """The generated (BLAS off) kernel of ``a @ b`` (``a.T @ b`` when ``transpose_a``; ``wrap(a, b, product)``
    adds a prologue or epilogue) for leaves of ``dtype``."""
    def leaf(shape: tuple[int, ...]) -> zyx.Tensor:
        return zyx.Tensor(np.zeros(shape, np.float32)).cast(dtype).realize()

    with host_without_blas():
        a, b = leaf(a_shape), leaf(b_shape)
        out = (a.T if transpose_a else a) @ b
        if wrap is not None:
            out = wrap(a, b, out)
        (k,) = [k for k in kernels_of(out) if k.reduces()]
    return k


def planned(k: Kernel, params: dict[str, int] | None = None, info=INFO) -> gpu.Geometry:
    return gpu.geometry(gpu.optimize(k, info, params))


def source(k: Kernel, params: dict[str, int] | None = None) -> str:
    return CUDARenderer().render(gpu.optimize(k, INFO, params)).source


def every_variant(k: Kernel, every: bool = True) -> list[dict[str, int]]:
    """``{strategy: simt, simt_tile, simt_stages}`` for every tiling and stage count ``search_space`` lists, or
    (``every`` false) two: the heuristic's first tiling with its stages, the last tiling with the other count."""
    space = gpu.search_space(k, INFO)
    tiles, stages = space["simt_tile"], space["simt_stages"]
    pairs = [(t, s) for t in tiles for s in stages] if every else [(tiles[0], stages[0]), (tiles[-1], stages[-1])]
    return [{"strategy": SIMT, "simt_tile": t, "simt_stages": s} for t, s in pairs]


# ---------------------------------------------------------------------------------------------------------------
# the decision


@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
def test_large_contractions_off_tensor_cores_take_the_simt_layout(dtype):
    k = matmul_kernel((1024, 512), (512, 1024), dtype)
    g = planned(k)
    assert g.strategy == "simt" and g.simt in gpu.SIMT_TILES and g.block == (g.simt.threads, 1, 1)
    assert g.contraction is not None and g.contraction.dtype is dtypes.to_dtype(dtype)
    assert g.items == (1024 // g.simt.bm) * (1024 // g.simt.bn) and g.stages == 2
    assert g.items >= INFO.compute_units  # the heuristic's first tiling that gives every SM a block
    space = gpu.search_space(k, INFO)
    assert gpu.STRATEGIES[space["strategy"][0]] == "simt"
    assert space["simt_tile"][0] == gpu.SIMT_TILES.index(g.simt) and space["simt_stages"] == (2, 1)
    for t in space["simt_tile"]:  # every listed tiling plans as asked
        assert planned(k, {"simt_tile": t, "simt_stages": 1}).simt == gpu.SIMT_TILES[t]


def test_tensor_core_contractions_keep_mma():
    assert planned(matmul_kernel((1024, 512), (512, 1024)), info=TF32).strategy == "mma"
    k16 = matmul_kernel((1024, 512), (512, 1024), "float16")
    assert planned(k16).strategy == "mma"
    assert "simt" in [gpu.STRATEGIES[s] for s in gpu.search_space(k16, INFO)["strategy"]]  # float accumulators
    # below sm_80 (no mma.sync layout here) a 16-bit matmul runs on CUDA cores
    assert planned(k16, info=replace(INFO, compute_capability=(7, 5))).strategy == "simt"


@pytest.mark.parametrize("a_shape,b_shape", [
    ((1024, 16), (16, 1024)),  # k = 16: short, still worth the tiles
    ((1024, 512), (512, 8)),  # n below SIMT_MIN: a matrix times a few vectors
    ((64, 100_000), (100_000, 64)),  # a weight gradient over a long batch: 4 blocks of 32x32 for 132 SMs
    ((32, 4), (4, 32)),  # k below SIMT_MIN_K
])
def test_thin_short_or_few_block_contractions_keep_the_reduce_layouts(a_shape, b_shape):
    k = matmul_kernel(a_shape, b_shape)
    g = planned(k)
    m, kk, n = a_shape[0], a_shape[1], b_shape[1]
    blocks = max(-(-m // t.bm) * -(-n // t.bn) for t in gpu.SIMT_TILES)
    pays = min(m, n) >= gpu.SIMT_MIN and kk >= gpu.SIMT_MIN_K and 2 * blocks >= INFO.compute_units
    assert (g.strategy == "simt") == pays, (a_shape, b_shape, g.strategy)
    assert "simt" in [gpu.STRATEGIES[s] for s in gpu.search_space(k, INFO)["strategy"]]  # legal all the same


@pytest.mark.parametrize("dtype,tiled", [("float32", "simt"), ("float16", "mma")])
def test_heads_merged_into_the_columns_are_split_back_into_a_batch(dtype, tiled):
    """Attention's ``(probs @ v)`` permuted back to (batch, seq, heads * d): the reshape merges heads with the
    columns, so ``probs`` is read at ``n // d`` and no contraction is seen; ``split_contraction_loops`` splits the
    loop (heads a batch loop) and the tiled layout takes the product."""
    def leaf(*shape: int) -> zyx.Tensor:
        return zyx.Tensor(np.zeros(shape, np.float32)).cast(dtype).realize()

    with host_without_blas():
        out = (leaf(4, 8, 128, 128) @ leaf(4, 8, 128, 64)).permute(0, 2, 1, 3).reshape(4, 128, 512)
        (k,) = [k for k in kernels_of(out) if k.reduces()]
    assert [r.arg[1] for r in k.loops] == [4, 128, 512] and contraction.find_contraction(k) is None
    split = gpu.optimize(k, INFO, until="split_contraction_loops")
    assert [r.arg[1] for r in split.loops] == [4, 128, 8, 64]
    c = contraction.find_contraction(split)
    assert c is not None and (c.m.arg[1], c.n.arg[1], c.k.arg[1]) == (128, 64, 128)
    assert planned(k).strategy == tiled
    with gpu_passes_off("split_contraction_loops"):
        assert planned(k).strategy not in ("mma", "simt")


def test_int32_and_other_kernels_have_no_simt_layout():
    """An int32 matmul sums wrapped int32 products in int64 (``CAST`` under the reduce): not a contraction of one
    dtype. A row sum is no contraction."""
    assert gpu.simt_contraction(matmul_kernel((64, 64), (64, 64), "int32")) is None
    (k,) = kernels_of(zyx.Tensor(np.zeros((64, 256), np.float32)).sum(1))
    assert gpu.simt_contraction(k) is None and "simt" not in [planned(k).strategy]


def test_tilings_fit_the_device_and_the_registers():
    """Every tiling is 256 threads; a device whose shared memory holds fewer is offered fewer; float64 sums of a
    long float32 contraction (``wide_acc``: float32 partials beside float64 totals) leave only the tilings whose
    accumulators fit ``SIMT_ACC_BYTES``."""
    for t in gpu.SIMT_TILES:
        assert t.threads == 256 and t.bm % t.tm == 0 and t.bn % t.tn == 0
        assert t.shared_bytes(4, 2) <= 48 * 1024
    k = matmul_kernel((1024, 64), (64, 1024))
    c = gpu.simt_contraction(k)
    assert c is not None and not gpu.simt_wide(c)
    assert gpu.simt_tiles(INFO, c) == tuple(range(len(gpu.SIMT_TILES)))
    small = replace(INFO, local_memory_bytes=12 * 1024)
    fits = gpu.simt_tiles(small, c, 2)
    assert 0 < len(fits) < len(gpu.SIMT_TILES)
    assert all(gpu.SIMT_TILES[i].shared_bytes(4, 2) <= 12 * 1024 for i in fits)
    long = matmul_kernel((512, opt.WIDE_ACC_MIN), (opt.WIDE_ACC_MIN, 512))
    cw = gpu.simt_contraction(long)
    assert cw is not None and gpu.simt_wide(cw)
    wide = gpu.simt_tiles(INFO, cw)
    assert wide and all(gpu.SIMT_TILES[i].tm * gpu.SIMT_TILES[i].tn * 12 <= gpu.SIMT_ACC_BYTES for i in wide)
    assert set(wide) < set(gpu.simt_tiles(INFO, c))
    ko = gpu.optimize(long, INFO, {"strategy": SIMT})
    assert ko.wide_acc and gpu.SIMT_TILES.index(gpu.geometry(ko).simt) in wide
    d = gpu.simt_contraction(matmul_kernel((1024, 64), (64, 1024), "float64"))
    assert all(gpu.SIMT_TILES[i].tm * gpu.SIMT_TILES[i].tn * 8 <= gpu.SIMT_ACC_BYTES for i in gpu.simt_tiles(INFO, d))


# ---------------------------------------------------------------------------------------------------------------
# the source


@pytest.mark.parametrize("transpose_a", [False, True])
def test_tiles_are_filled_along_the_contiguous_axis(transpose_a):
    """``a`` row-major (k contiguous) is filled k-first; ``a.T`` (m contiguous) row-first; ``b`` (n contiguous)
    row-first: adjacent threads read adjacent addresses either way."""
    k = matmul_kernel((512, 1024) if transpose_a else (1024, 512), (512, 1024), transpose_a=transpose_a)
    g = planned(k)
    assert g.strategy == "simt"
    assert gpu.mma_fill_order(g.contraction) == (not transpose_a, False)
    assert gpu.mma_vector_fill(g.contraction) == (True, True)  # 4 adjacent floats along the fast axis per item
    src = source(k)
    t = g.simt
    a_fill = f"const int zu = zo / {t.bk // 4}, zv = zo % {t.bk // 4};" if not transpose_a else \
        f"const int zu = zo % {t.bm // 4}, zv = zo / {t.bm // 4};"
    assert a_fill in src and f"const int zu = zo % {t.bn // 4}, zv = zo / {t.bn // 4};" in src


def test_the_source_reads_each_thread_run_as_one_vector():
    k = matmul_kernel((1024, 512), (512, 1024), wrap=lambda a, b, out: (out + 1.0).relu())
    g = planned(k, {"simt_tile": 0, "simt_stages": 1})
    t = g.simt
    assert (t.bm, t.bn, t.tm, t.tn) == (128, 128, 8, 8)
    src = source(k, {"simt_tile": 0, "simt_stages": 1})
    pad = gpu.simt_pad(4)
    assert f"__shared__ __align__(16) float zsa[1][{t.bk}][{t.bm + pad}];" in src
    assert f"__shared__ __align__(16) float zsb[1][{t.bk}][{t.bn + pad}];" in src
    # two runs of 4 rows and two of 4 columns per thread: four float4 reads per k
    assert src.count("zyx_vld_float4(&zsa[zbf][zkk]") == 2 and src.count("zyx_vld_float4(&zsb[zbf][zkk]") == 2
    assert "zc[zi][zj] = fmaf(za[zi], zb[zj], zc[zi][zj]);" in src
    # plain, aligned operands: each thread loads 4 adjacent floats per fill item (a along k, b along n) and stores
    # b's into its shared row whole
    assert src.count("= zyx_vld_float4((p") == 2 and "zyx_vst_float4(&zsb[0][zv][4 * zu], zrb[zf]);" in src
    assert "zsa[0][4 * zv + 3][zu] = zra[zf].w;" in src
    assert src.count("__syncthreads();") == 2 and "mma.sync" not in src
    epilogue = src[src.index("const int zm"):]
    assert "(zc[zi][zj] + 1.0f)" in epilogue and "> 0.0f)" in epilogue  # the epilogue is fused
    two = source(k, {"simt_tile": 0, "simt_stages": 2})
    assert two.count("__syncthreads();") == 2 and "zbf ^ 1" in two  # prologue barrier + one per step


def test_long_float32_sums_use_float64_totals_and_float32_partials():
    k = matmul_kernel((256, opt.WIDE_ACC_MIN), (opt.WIDE_ACC_MIN, 256))
    src = source(k, {"strategy": SIMT})
    assert "double zc[" in src and "float zp[" in src
    assert f"% {gpu.SIMT_PARTIAL} == 0" in src and "zc[zi][zj] += (double)zp[zi][zj]" in src
    assert "((float)zc[zi][zj])" in src


def test_operands_that_are_not_aligned_plain_loads_fill_element_by_element():
    """A prologue (``2a - 1``), a k not a multiple of 4, or float16 operands widened to float32: scalar fills."""
    for k in (matmul_kernel((1024, 512), (512, 1024), wrap=lambda a, b, out: (a * 2 - 1) @ b),
              matmul_kernel((1024, 510), (510, 1024)),
              matmul_kernel((1024, 512), (512, 1024), "float16")):
        c = gpu.simt_contraction(k)
        assert c is not None and gpu.mma_vector_fill(c) != (True, True)
    k = matmul_kernel((1024, 512), (512, 1024), wrap=lambda a, b, out: (a * 2 - 1) @ b)
    src = source(k, {"strategy": SIMT})
    assert "zyx_vld_float4((p2" in src and "zyx_vld_float4((p1" not in src  # b still vector, a element-wise


@needs_nvrtc
def test_every_simt_variant_compiles_for_sm80_and_sm90():
    """Every tiling and stage count of a ragged float32 product; two variants of each other dtype and shape."""
    first = matmul_kernel((100, 70), (70, 90))
    kernels = [matmul_kernel((100, 70), (70, 90), d) for d in ("float64", "int64", "float16")]
    kernels += [matmul_kernel((96, 64), (64, 128)),  # 16-byte fills of both tiles
                matmul_kernel((70, 100), (70, 90), transpose_a=True),
                matmul_kernel((2, 40, 33), (2, 33, 50), wrap=lambda a, b, out: out * 2 - 1),
                matmul_kernel((64, opt.WIDE_ACC_MIN), (opt.WIDE_ACC_MIN, 64))]
    sources = [source(first, p) for p in every_variant(first)]
    sources += [source(k, p) for k in kernels for p in every_variant(k, every=False)]
    assert len(sources) == 2 * len(gpu.SIMT_TILES) + 2 * len(kernels)
    nvrtc_compiles(sources)


# ---------------------------------------------------------------------------------------------------------------
# emulated results


def _operands(rng: np.random.Generator, dtype: str, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    npd = np.dtype(dtype)
    if npd.kind == "i":
        return [rng.integers(-50, 51, s).astype(npd) for s in shapes]
    return [rng.standard_normal(s).astype(npd) for s in shapes]


def _emulate(k: Kernel, params: dict[str, int], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return run_emulated_matmul(CUDARenderer().render(gpu.optimize(k, INFO, params)), k, a, b, EMU_GRID)


@needs_gxx
@pytest.mark.parametrize("dtype", ["float32", "float64", "int64"])
@pytest.mark.parametrize("a_shape,b_shape,transpose_a", [
    ((33, 70), (70, 47), False),  # no dimension a multiple of any tile
    ((70, 33), (70, 47), True),  # a transposed: filled row-first
    ((2, 40, 20), (2, 20, 130), False),  # batched
    ((36, 68), (68, 52), False),  # k and n multiples of 4: both tiles filled by 16-byte loads, m ragged
])
def test_every_tiling_equals_the_thread_layout_bit_for_bit(dtype, a_shape, b_shape, transpose_a, rng):
    k = matmul_kernel(a_shape, b_shape, dtype, transpose_a)
    if a_shape == (36, 68):
        assert gpu.mma_vector_fill(gpu.simt_contraction(k)) == (True, True)
    a, b = _operands(rng, dtype, a_shape, b_shape)
    want = _emulate(k, {"strategy": THREAD}, a, b)
    ref = (np.swapaxes(a, -1, -2) if transpose_a else a).astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(want, ref.reshape(-1), rtol=1e-4, atol=1e-4)
    every = dtype == "float32" and not transpose_a and len(a_shape) == 2  # all variants once, two elsewhere
    variants = every_variant(k, every)
    if every:
        assert {p["simt_tile"] for p in variants} == set(gpu.simt_tiles(INFO, gpu.simt_contraction(k)))
    assert {p["simt_stages"] for p in variants} == {1, 2}
    for p in variants:
        np.testing.assert_array_equal(_emulate(k, p, a, b), want, err_msg=str(p))


@needs_gxx
def test_prologue_and_epilogue_arithmetic_under_emulation(rng):
    """``(2a - 1) @ b`` with ``exp`` of the product and a bias: the operand expression is evaluated in the fill,
    the epilogue per output."""
    def wrap(a, b, out):
        return ((a * 2 - 1) @ b).exp() * 0.5

    k = matmul_kernel((45, 37), (37, 66), wrap=wrap)
    a, b = _operands(rng, "float32", (45, 37), (37, 66))
    a, b = a / 4, b / 4
    want = _emulate(k, {"strategy": THREAD}, a, b)
    np.testing.assert_allclose(want, (np.exp((2 * a - 1).astype(np.float64) @ b) * 0.5).reshape(-1), rtol=1e-5)
    for p in every_variant(k, every=False):
        np.testing.assert_array_equal(_emulate(k, p, a, b), want, err_msg=str(p))


@needs_gxx
def test_long_float32_sums_stay_within_float32_rounding(rng):
    kk = opt.WIDE_ACC_MIN + 100
    k = matmul_kernel((20, kk), (kk, 36))
    a, b = _operands(rng, "float32", (20, kk), (kk, 36))
    ref = (a.astype(np.float64) @ b.astype(np.float64)).reshape(-1)
    bound = 64 * 2.0**-24 * (np.abs(a).astype(np.float64) @ np.abs(b)).reshape(-1)  # a float64 sum of float32 sums
    for p in every_variant(k, every=False):
        err = np.abs(_emulate(k, p, a, b) - ref)
        assert np.all(err <= bound), (p, float(np.max(err - bound)))


@needs_cuda
def test_linear_layer_forward_and_backward_on_cuda_equal_numpy(rng):
    """``relu(x @ w + bias)`` and its gradients on ``cuda:0``, exact float32 (the heuristic picks ``simt`` for the
    forward product and both gradient products) against NumPy."""
    xs, ws, bs = rng.standard_normal((288, 96)), rng.standard_normal((96, 320)) / 10, rng.standard_normal(320)
    with gpu_planned({}) as seen:
        x, w, bias = (zyx.Tensor(v.astype(np.float32), device="cuda:0", requires_grad=True) for v in (xs, ws, bs))
        y = (x @ w + bias).relu()
        y.sum().backward()
        got = [t.numpy() for t in (y, x.grad, w.grad)]
    assert sum(g.strategy == "simt" for g in seen) >= 2, [g.strategy for g in seen]
    pre = xs @ ws + bs
    mask = (pre > 0).astype(np.float64)
    for g, want in zip(got, (np.maximum(pre, 0), mask @ ws.T, xs.T @ mask)):
        assert_close(g, want, rtol=1e-4, atol=1e-4)


@needs_cuda
def test_convolution_forward_and_backward_on_cuda_equal_torch(rng):
    """A 3x3 convolution is a contraction over (channel, tap) with the image rows as a batch loop: the forward
    product and the input gradient take ``simt`` (24-wide rows: the 32-column tilings) and equal torch's."""
    torch = pytest.importorskip("torch")
    from zyx.nn import functional as F

    xs = rng.standard_normal((4, 16, 24, 24)).astype(np.float32)
    ws = (rng.standard_normal((32, 16, 3, 3)) / 10).astype(np.float32)
    with gpu_planned({}) as seen:
        x, w = (zyx.Tensor(v, device="cuda:0", requires_grad=True) for v in (xs, ws))
        y = F.conv2d(x, w, padding=1).relu()
        (y * y).sum().backward()
        got = [y.numpy(), x.grad.numpy(), w.grad.numpy()]
    tiles = {g.simt for g in seen if g.strategy == "simt"}
    assert tiles and all(t.bn == 32 for t in tiles), tiles
    tx, tw = (torch.tensor(v, requires_grad=True) for v in (xs, ws))
    ty = torch.nn.functional.conv2d(tx, tw, padding=1).relu()
    (ty * ty).sum().backward()
    for g, want in zip(got, (ty, tx.grad, tw.grad)):
        want = want.detach().numpy()
        assert_close(g, want, rtol=1e-4, atol=1e-5 * float(np.abs(want).max()))

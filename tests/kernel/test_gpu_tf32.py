"""TF32 tensor cores for float32 contractions (``DeviceInfo.allow_tf32``, the ``cuda.allow_tf32`` config).

Off by default: a float32 matmul renders no ``mma`` and stays exact FP32. Allowed on sm_80+: the ``mma`` layout
rounds every operand to tf32 (``cvt.rna``: 10-bit mantissa, nearest, ties away from zero) and issues
``mma.sync.m16n8k8`` tf32 tiles with float32 accumulators. Emulated results are checked against a NumPy
reference of the same tf32-rounded operands accumulated in float64, within the rounding-error bound of a
K-term float32 sum, ``gamma_K * (|a| @ |b|)`` with ``gamma_K = K u / (1 - K u)``, ``u = 2**-24`` (each product
of two tf32 values is exact in float32, so the only errors are the K additions). The same results are shown to
differ from exact FP32 by about tf32's error, so a kernel that did not round (or rounded another way) fails.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest
from conftest import host_without_blas, kernels_of, nvrtc_compiles, registry_with, run_emulated_matmul

import zyx
from zyx import dtypes
from zyx.backends.cuda import nvrtc
from zyx.backends.cuda.device import device_info
from zyx.kernel import gpu
from zyx.kernel.ir import Kernel
from zyx.kernel.render_cuda import CUDARenderer

INFO = gpu.reference_info()
TF32 = replace(INFO, allow_tf32=True)
f32 = dtypes.float32
EMU_GRID = 2  # blocks per emulated launch: fewer than the tiles, so the grid-stride loop over tiles wraps
U = 2.0**-24  # float32 unit roundoff
TF32_ULP = 2.0**-10  # tf32 spacing at 1 (10 stored mantissa bits)

_NVRTC = nvrtc.available()
needs_nvrtc = pytest.mark.skipif(_NVRTC is not None, reason=f"NVRTC unavailable ({_NVRTC}): {nvrtc.INSTALL_HINT}")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")


def tf32(x: np.ndarray) -> np.ndarray:
    """``x`` (float32) rounded to tf32 as ``cvt.rna.tf32.f32``: the significand in [0.5, 1) scaled to 11 bits and
    rounded half away from zero; written with ``frexp``, independently of the kernel's bit trick."""
    m, e = np.frexp(x.astype(np.float64))
    r = np.sign(m) * np.floor(np.abs(m) * 2.0**11 + 0.5)
    with np.errstate(over="ignore"):  # past float32's largest tf32 value: infinity, as cvt.rna
        return np.ldexp(r / 2.0**11, e).astype(np.float32)


def matmul_kernel(a_shape: tuple[int, ...], b_shape: tuple[int, ...], transpose_a: bool = False) -> Kernel:
    """The generated (BLAS off) kernel of ``a @ b`` for float32 leaves (``a.T @ b`` when ``transpose_a``)."""
    def leaf(shape: tuple[int, ...]) -> zyx.Tensor:
        return zyx.Tensor(np.zeros(shape, np.float32)).realize()

    with host_without_blas():
        a = leaf(a_shape)
        out = (a.T if transpose_a else a) @ leaf(b_shape)
        (k,) = [k for k in kernels_of(out) if k.reduces()]
    return k


def emulate(k: Kernel, params: dict[str, int], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Run ``k`` (``p0 = p1 @ p2`` up to layout) optimized for ``TF32`` on the emulated driver's CPU runtime."""
    return run_emulated_matmul(CUDARenderer().render(gpu.optimize(k, TF32, params)), k, a, b, EMU_GRID)


def references(a: np.ndarray, b: np.ndarray, transpose_a: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tf32 reference, its fp32-accumulation error bound, exact reference of the unrounded operands), float64."""
    def mm(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        return (np.swapaxes(x, -1, -2) if transpose_a else x) @ y.astype(np.float64)

    k = a.shape[-2] if transpose_a else a.shape[-1]
    ta, tb = tf32(a), tf32(b)
    gamma = k * U / (1 - k * U)
    return mm(ta, tb), gamma * mm(np.abs(ta), np.abs(tb)), mm(a, b)


def check_tf32(got: np.ndarray, a: np.ndarray, b: np.ndarray, transpose_a: bool) -> None:
    """``got`` is the tf32 product within the fp32 accumulation bound, and measurably not the exact one."""
    want, bound, exact = references(a, b, transpose_a)
    got = got.astype(np.float64).reshape(want.shape)
    err = np.abs(got - want)
    assert np.all(err <= bound), float(np.max(err - bound))
    # tf32 rounds each operand by up to 2^-11 relative: exact FP32 lies outside the bound for most outputs (an
    # unrounded kernel fails the check above), and the result is far closer to tf32 than to exact FP32
    off = np.abs(got - exact)
    assert np.mean(np.abs(exact - want) > bound) > 0.5, np.mean(np.abs(exact - want) > bound)
    assert off.max() > 100 * err.max() and off.max() > TF32_ULP / 8, (off.max(), err.max())


def operands(rng: np.random.Generator, a_shape, b_shape) -> tuple[np.ndarray, np.ndarray]:
    return (rng.uniform(-1, 1, a_shape).astype(np.float32), rng.uniform(-1, 1, b_shape).astype(np.float32))


# ---------------------------------------------------------------------------------------------------------------
# the NumPy rounding itself


def test_numpy_tf32_rounds_to_nearest_ties_away_from_zero():
    one = np.float32(1.0)
    x = np.array([1 + 2.0**-11, -(1 + 2.0**-11), 1 + 3 * 2.0**-11, 1 + 2.0**-12, 0.0, 3.0, 2.0**-130,
                  np.finfo(np.float32).max], np.float32)
    want = np.array([1 + 2.0**-10, -(1 + 2.0**-10), 1 + 2.0**-9, one, 0.0, 3.0, 2.0**-130, np.inf], np.float32)
    np.testing.assert_array_equal(tf32(x), want)


# ---------------------------------------------------------------------------------------------------------------
# planning and rendering


def test_device_reports_tf32_only_when_allowed_and_supported():
    attrs = {"COMPUTE_CAPABILITY_MAJOR": 9, "COMPUTE_CAPABILITY_MINOR": 0, "MULTIPROCESSOR_COUNT": 132}
    assert device_info("cuda:0", "H200", attrs).allow_tf32 is False  # the default
    assert device_info("cuda:0", "H200", attrs, allow_tf32=True).allow_tf32 is True
    turing = {**attrs, "COMPUTE_CAPABILITY_MAJOR": 7, "COMPUTE_CAPABILITY_MINOR": 5}
    assert device_info("cuda:0", "T4", turing, allow_tf32=True).allow_tf32 is False  # no tf32 before sm_80


def test_float32_matmul_uses_tf32_mma_only_when_allowed():
    k = matmul_kernel((256, 256), (256, 256))
    assert gpu.find_contraction(k) is None and gpu.find_contraction(k, tf32=True) is not None
    for info in (INFO, replace(TF32, compute_capability=(7, 5))):  # not allowed / no tf32 tensor cores
        ko = gpu.optimize(k, info)
        assert gpu.geometry(ko).strategy != "mma"
        assert "mma_tile" not in gpu.search_space(k, info)
        src = CUDARenderer().render(ko).source
        assert "mma.sync" not in src and "tf32" not in src
    ko = gpu.optimize(k, TF32)
    g = gpu.geometry(ko)
    assert g.strategy == "mma" and g.contraction is not None and g.contraction.dtype is f32 and g.tile is not None
    assert not ko.wide_acc  # tensor cores accumulate in float32
    src = CUDARenderer().render(ko).source
    t = g.tile
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in src and "m16n8k16" not in src
    assert 'cvt.rna.tf32.f32' in src and src.count("__syncthreads();") == 2
    # one tf32 value per 32-bit word: rows of bk words (+ pad), twice the 16-bit tiles' k-pairs
    st = g.stages
    assert f"unsigned int zsa[{st}][{t.bm}][{t.bk + 4}];" in src
    assert f"unsigned int zsb[{st}][{t.bn}][{t.bk + 4}];" in src
    assert "*(uint4*)&zsa[" in src and "= *(const uint4*)(p" in src  # 16-byte loads of 4 floats: 256 % 4 == 0
    space = gpu.search_space(k, TF32)["mma_tile"]
    assert space[0] == gpu.MMA_TILES.index(t) and sorted(space) == list(gpu.mma_tiles(TF32, f32))


def test_tf32_tiles_respect_the_doubled_shared_memory():
    """A tf32 tile stages 4 bytes per element (twice 16-bit): a device that holds a tiling's 16-bit tiles may
    not hold its tf32 ones, and neither is then a candidate nor chosen for float32."""
    k = matmul_kernel((256, 256), (256, 256))
    small = replace(TF32, local_memory_bytes=24 * 1024)
    fits16, fits32 = gpu.mma_tiles(small), gpu.mma_tiles(small, f32)
    assert set(fits32) < set(fits16) and 0 in fits16 and 0 not in fits32
    for t in gpu.MMA_TILES:
        assert t.shared_bytes_of(f32) == 4 * (t.bk + 4) * (t.bm + t.bn) and t.bk % gpu.mma_k(f32) == 0
    assert sorted(gpu.search_space(k, small)["mma_tile"]) == list(fits32)
    for i in range(len(gpu.MMA_TILES)):
        tile = gpu.geometry(gpu.optimize(k, small, {"mma_tile": i})).tile
        assert gpu.MMA_TILES.index(tile) in fits32
    assert gpu.mma_k(f32) == 8 and gpu.mma_pack(f32) == 1 and gpu.mma_vector(f32) == 4


def test_tf32_needs_one_mma_tile_in_each_dimension():
    assert gpu.geometry(gpu.optimize(matmul_kernel((16, 8), (8, 8)), TF32)).strategy == "mma"  # k = 8 suffices
    assert gpu.geometry(gpu.optimize(matmul_kernel((16, 7), (7, 8)), TF32)).strategy != "mma"


@needs_nvrtc
def test_every_tf32_tile_compiles_for_sm80_and_sm90():
    sources = []
    for shape in ((256, 256), (33, 70)):  # vector fills, and ragged scalar fills
        k = matmul_kernel(shape, (shape[1], 47 if shape[0] == 33 else 256))
        for i in gpu.search_space(k, TF32)["mma_tile"]:
            sources.append(CUDARenderer().render(gpu.optimize(k, TF32, {"mma_tile": i})).source)
    nvrtc_compiles(sources)


# ---------------------------------------------------------------------------------------------------------------
# emulated results


@needs_gxx
def test_every_tf32_tile_computes_the_tf32_matmul_under_emulation(rng):
    """33x47x70 (no dimension a multiple of any tile): each tiling equals the tf32 reference."""
    k = matmul_kernel((33, 70), (70, 47))
    a, b = operands(rng, (33, 70), (70, 47))
    for i in gpu.search_space(k, TF32)["mma_tile"]:
        assert gpu.geometry(gpu.optimize(k, TF32, {"mma_tile": i})).tile == gpu.MMA_TILES[i]
        check_tf32(emulate(k, {"mma_tile": i}, a, b), a, b, False)


@needs_gxx
@pytest.mark.parametrize("a_shape,b_shape,transpose_a", [
    ((3, 40, 24), (3, 24, 56), False),  # batched, vector fills
    ((70, 33), (70, 47), True),  # transposed a, scalar fills along m
    ((48, 40), (48, 56), True),  # transposed a, vector fills along m
    ((2, 33, 47), (2, 47, 70), False)])
def test_tf32_matmuls_under_emulation_equal_the_tf32_reference(a_shape, b_shape, transpose_a, rng):
    k = matmul_kernel(a_shape, b_shape, transpose_a)
    assert gpu.geometry(gpu.optimize(k, TF32)).strategy == "mma"
    a, b = operands(rng, a_shape, b_shape)
    for params in ({}, {"mma_tile": 0}):
        check_tf32(emulate(k, params, a, b), a, b, transpose_a)


@needs_gxx
def test_tf32_ties_round_away_from_zero_under_emulation():
    """Every operand 1 + 2^-11 (halfway between two tf32 values): cvt.rna gives 1 + 2^-10, so each output is
    exactly 8 (1 + 2^-10)^2 (every partial sum is exact in float32); round-to-even or truncation would give 8,
    exact FP32 8 (1 + 2^-11)^2."""
    k = matmul_kernel((32, 8), (8, 16))
    assert gpu.geometry(gpu.optimize(k, TF32)).strategy == "mma"
    a = np.full((32, 8), 1 + 2.0**-11, np.float32)
    b = np.full((8, 16), 1 + 2.0**-11, np.float32)
    got = emulate(k, {}, a, b)
    np.testing.assert_array_equal(got, np.float32(8 * (1 + 2.0**-10) ** 2))


# ---------------------------------------------------------------------------------------------------------------
# end to end: the Tensor API on the emulated cuda:0


@needs_nvrtc
@needs_gxx
@pytest.mark.parametrize("allow_tf32", [True, False])
def test_float32_matmul_on_emulated_cuda_is_tf32_only_when_allowed(tmp_path, monkeypatch, allow_tf32):
    """cuDNN off: the generated kernel runs; with ``allow_tf32`` it is the tf32 product, without it exact FP32."""
    monkeypatch.setenv("ZYX_CUDA_EMULATE", "1")
    rng = np.random.default_rng(7)
    a, b = operands(rng, (40, 72), (72, 48))
    with registry_with(tmp_path, {"cuda": {"allow_tf32": allow_tf32, "cudnn": False, "queues": 2}}) as r:
        assert r.get("cuda:0").primary.info().allow_tf32 is allow_tf32
        z = zyx.Tensor(a, device="cuda") @ zyx.Tensor(b, device="cuda")
        kinds = [launch.kind for launch in zyx.debug.schedule(z)]
        assert "generated" in kinds and "library" not in kinds, kinds
        got = z.numpy()
        sources = list(r.get("cuda:0").primary._sources.values())  # what NVRTC compiled for this device
        assert any("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in x for x in sources) is allow_tf32
        assert not any("mma.sync" in x for x in sources) or allow_tf32
    if allow_tf32:
        check_tf32(got, a, b, False)
    else:
        want = a.astype(np.float64) @ b.astype(np.float64)
        bound = 72 * U / (1 - 72 * U) * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))
        assert np.all(np.abs(got - want) <= bound)

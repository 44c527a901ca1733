"""The software-pipelined mma layout (``gpu.Geometry.stages == 2``) and its shared-memory layout.

With two stages each operand has two shared buffers: the block loads k step 0 into buffer 0 before the k loop;
step ``s`` issues the global loads of step ``s + 1`` into registers, computes on buffer ``s % 2``, stores the
registers into the other buffer and meets the step's only barrier. One stage is the classic loop (fill, barrier,
mma's, barrier). The order of the math is the same, so both give bitwise identical results, checked here under
the emulated driver against NumPy for f16, bf16 and tf32 on ragged, batched and transposed contractions.

The shared rows are ``bk / pack + 4`` words (4 mod 8) and a row-first tile's word columns are XOR-swizzled
(``gpu.mma_swizzle``): the banks of every fragment read are computed here from the rendered index expressions.
"""

from __future__ import annotations

import functools
import re
import shutil
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
from conftest import host_without_blas, kernels_of, nvrtc_compiles, run_emulated_matmul

import zyx
from zyx import dtypes
from zyx.backends.cuda import nvrtc
from zyx.kernel import gpu
from zyx.kernel.ir import Kernel
from zyx.kernel.render_cuda import CUDARenderer

INFO = gpu.reference_info()
TF32 = replace(INFO, allow_tf32=True)
EMU_GRID = 2  # blocks per emulated launch: fewer than the tiles, so the grid-stride loop over tiles wraps
U = 2.0**-24

_NVRTC = nvrtc.available()
needs_nvrtc = pytest.mark.skipif(_NVRTC is not None, reason=f"NVRTC unavailable ({_NVRTC}): {nvrtc.INSTALL_HINT}")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")


def info_for(dtype: str):
    return TF32 if dtype == "float32" else INFO


def matmul_kernel(a_shape: tuple[int, ...], b_shape: tuple[int, ...], dtype: str, ta: bool = False,
                  tb: bool = False) -> Kernel:
    """The generated (BLAS off) kernel of ``op(a) @ op(b)`` for leaves of ``dtype`` with the stored shapes given
    (``op`` transposes the last two axes when ``ta`` / ``tb``)."""
    def leaf(shape: tuple[int, ...]) -> zyx.Tensor:
        t = zyx.Tensor(np.zeros(shape, np.float32))
        return (t if dtype == "float32" else t.cast(dtype)).realize()

    def op(t: zyx.Tensor, flip: bool) -> zyx.Tensor:
        return t.transpose(-1, -2) if flip else t

    with host_without_blas():
        out = op(leaf(a_shape), ta) @ op(leaf(b_shape), tb)
        (k,) = [k for k in kernels_of(out) if k.reduces()]
    return k


def render(k: Kernel, dtype: str, params: dict[str, int]) -> tuple[gpu.Geometry, str, object]:
    ko = gpu.optimize(k, info_for(dtype), params)
    cs = CUDARenderer().render(ko)
    return gpu.geometry(ko), cs.source, cs


def emulate(k: Kernel, dtype: str, params: dict[str, int], a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Run ``k`` (``p0 = op(a) @ op(b)``) rendered under ``params`` on the emulated driver's CPU runtime."""
    return run_emulated_matmul(render(k, dtype, params)[2], k, a, b, EMU_GRID)


def tf32(x: np.ndarray) -> np.ndarray:
    """``x`` rounded to tf32 as ``cvt.rna.tf32.f32`` (nearest, ties away from zero), via ``frexp``."""
    m, e = np.frexp(x.astype(np.float64))
    return np.ldexp(np.sign(m) * np.floor(np.abs(m) * 2.0**11 + 0.5) / 2.0**11, e).astype(np.float32)


def reference(dtype: str, a: np.ndarray, b: np.ndarray, ta: bool, tb: bool) -> tuple[np.ndarray, np.ndarray]:
    """(float64 product of the operands as the tensor cores see them, an error bound per output)."""
    def op(x: np.ndarray, flip: bool) -> np.ndarray:
        x = x.astype(np.float64)
        return np.swapaxes(x, -1, -2) if flip else x

    if dtype == "float32":
        a, b = tf32(a), tf32(b)
    want = op(a, ta) @ op(b, tb)
    size_k = b.shape[-1] if tb else b.shape[-2]
    if dtype == "float32":  # exact tf32 products, K float32 additions
        bound = size_k * U / (1 - size_k * U) * (np.abs(op(a, ta)) @ np.abs(op(b, tb)))
    else:  # plus the output's rounding to 16 bits
        bound = 2e-2 + 1e-2 * np.abs(want)
    return want, bound


CASES = [  # dtype, a stored, b stored, ta, tb
    ("float16", (33, 47), (47, 70), False, False),  # 33x47x70: k not a multiple of bk, 2 steps of 32
    ("bfloat16", (33, 70), (70, 47), False, False),  # k = 70: 3 steps of 32, 5 of 16
    ("float16", (33, 20), (20, 70), False, False),  # k = 20 < bk = 32
    ("bfloat16", (70, 33), (70, 47), True, False),  # a transposed: row-first (swizzled) scalar fill of a
    ("float16", (48, 40), (48, 56), True, False),  # a transposed, vector fills along m
    ("float16", (40, 72), (56, 72), False, True),  # b transposed: k-first fill of b
    ("bfloat16", (2, 33, 47), (2, 47, 70), False, False),  # batched, ragged
    ("float16", (3, 40, 24), (3, 24, 56), False, False),  # batched, vector fills
    ("float32", (33, 47), (47, 70), False, False),
    ("float32", (33, 20), (20, 70), False, False),
    ("float32", (70, 33), (70, 47), True, False),
    ("float32", (48, 40), (48, 56), True, False),
    ("float32", (40, 72), (56, 72), False, True),
    ("float32", (2, 33, 70), (2, 70, 47), False, False),
]


# ---------------------------------------------------------------------------------------------------------------
# planning


def test_stages_are_a_search_parameter_and_the_heuristic_pipelines_where_it_fits():
    f16, f32 = dtypes.float16, dtypes.float32
    k = matmul_kernel((256, 256), (256, 256), "float16")
    space = gpu.search_space(k, INFO)
    assert space["mma_stages"] == (2, 1) and gpu.geometry(gpu.optimize(k, INFO)).stages == 2
    for t in gpu.MMA_TILES:
        assert t.shared_bytes_of(f16, 2) == 2 * t.shared_bytes_of(f16) == 8 * (t.bk // 2 + 4) * (t.bm + t.bn)
        assert t.shared_bytes_of(f32, 2) == 8 * (t.bk + 4) * (t.bm + t.bn)
    big = {gpu.MMA_TILES.index(gpu.MmaTile(128, 256, 32, 2, 4)), gpu.MMA_TILES.index(gpu.MmaTile(256, 128, 32, 4, 2))}
    # every 16-bit tile fits twice in 48 KiB but the two with 64x64 warp tiles, which fit once
    assert gpu.mma_tiles(INFO, f16, 2) == tuple(i for i in gpu.mma_tiles(INFO) if i not in big)
    assert big <= set(gpu.mma_tiles(INFO))
    # tf32's largest tiles do not fit twice: dropped from the 2-stage choices, not broken
    k32 = matmul_kernel((256, 256), (256, 256), "float32")
    two = gpu.mma_tiles(TF32, f32, 2)
    assert 0 not in two and 1 not in two and set(two) < set(gpu.mma_tiles(TF32, f32))
    g = gpu.geometry(gpu.optimize(k32, TF32, {"mma_tile": 0}))
    assert g.tile == gpu.MMA_TILES[0] and g.stages == 1  # the heuristic's stages: 2 only where the tile fits
    g = gpu.geometry(gpu.optimize(k32, TF32, {"mma_tile": 0, "mma_stages": 2}))
    assert g.stages == 2 and gpu.MMA_TILES.index(g.tile) in two
    for kern, info, dtype in ((k, INFO, f16), (k32, TF32, f32)):
        for i in range(len(gpu.MMA_TILES)):
            for s in (None, 1, 2, 3):
                params = {"mma_tile": i} if s is None else {"mma_tile": i, "mma_stages": s}
                g = gpu.geometry(gpu.optimize(kern, info, params))
                assert g.stages in gpu.MMA_STAGES and g.tile.shared_bytes_of(dtype, g.stages) <= 48 * 1024
                assert s not in (1, 2) or g.stages == s


def test_a_device_without_room_for_two_buffers_gets_one():
    k = matmul_kernel((256, 256), (256, 256), "float16")
    tiny = replace(INFO, local_memory_bytes=4096)  # only the 32x16x16 tile, once
    assert gpu.mma_tiles(tiny) == (5,) and gpu.mma_tiles(tiny, dtypes.float16, 2) == ()
    assert gpu.search_space(k, tiny)["mma_stages"] == (1,)
    for s in (1, 2):
        g = gpu.geometry(gpu.optimize(k, tiny, {"mma_stages": s}))
        assert g.stages == 1 and g.tile == gpu.MMA_TILES[5]
    _, src, _ = render(k, "float16", {})
    assert "zsa[2][" in src
    cs = CUDARenderer().render(gpu.optimize(k, tiny))
    assert "zsa[1][" in cs.source and cs.source.count("__syncthreads();") == 2


# ---------------------------------------------------------------------------------------------------------------
# the rendered pipeline


def k_loop(src: str) -> str:
    """The body of the k loop (up to the epilogue)."""
    start = src.index("for (int zk = 0, zbf = 0;")
    end = re.compile(r"\n\s*for \(int zi = 0; zi < \d+; zi\+\+\) for \(int zj").search(src, start)
    return src[start:end.start()]


@pytest.mark.parametrize("dtype,a_shape,b_shape,ta,tb", [CASES[0], CASES[3], CASES[4], CASES[5], CASES[7],
                                                         CASES[8], CASES[11]])
def test_the_next_steps_loads_are_issued_before_this_steps_mma(dtype, a_shape, b_shape, ta, tb):
    """Two stages: in the k loop, the global loads (``p1`` / ``p2``) of step k + bk come before the first
    ``mma`` (both the PTX and the emulation branch), the stores into the other buffer after the last, and the
    step has one barrier (plus one after the prologue). One stage: load, store, barrier, mma, barrier."""
    k = matmul_kernel(a_shape, b_shape, dtype, ta, tb)
    g, src, _ = render(k, dtype, {"mma_stages": 2})
    assert g.strategy == "mma" and g.stages == 2
    body = k_loop(src)
    bk = g.tile.bk
    loads = [m.start() for m in re.finditer(r"\(p[12]\[|\(const uint4\*\)\(p[12] ", body)]
    mmas = [m.start() for m in re.finditer(r"mma\.sync|__shfl_sync", body)]
    stores = [m.start() for m in re.finditer(r"zs[ab]\[zbf \^ 1\]", body)]
    assert loads and mmas and stores
    assert max(loads) < min(mmas) and max(mmas) < min(stores) < body.index("__syncthreads();")
    assert f"zk + {bk} + " in body and "const bool zpf = zk + " in body
    assert body.count("__syncthreads();") == 1 and src.count("__syncthreads();") == 2
    assert body.index("zsa[zbf][") < min(stores)  # fragments read this step's buffer
    a_k, b_k = gpu.mma_fill_order(g.contraction)
    sixteen = dtype != "float32"
    assert g.ldmatrix == (sixteen and (a_k or b_k))
    assert ("ldmatrix.sync.aligned.m8n8.x4.shared.b16" in body) == (sixteen and a_k)  # a's 4 fragment words
    assert ("ldmatrix.sync.aligned.m8n8.x2.shared.b16" in body) == (sixteen and b_k)  # b's 2
    prologue = src[:src.index("for (int zk = 0, zbf = 0;")]
    assert "zsa[0][" in prologue and "zsb[0][" in prologue and prologue.rstrip().endswith("__syncthreads();")
    g1, src1, _ = render(k, dtype, {"mma_tile": gpu.MMA_TILES.index(g.tile), "mma_stages": 1})
    body1 = k_loop(src1)
    assert g1.stages == 1 and body1.count("__syncthreads();") == 2 and "zbf ^ 1" not in src1
    first_mma = re.search(r"mma\.sync|__shfl_sync", body1).start()
    assert "zsa[1][" in src1 and "zsa[0][" in body1[:body1.index("__syncthreads();")]
    assert body1.index("__syncthreads();") < first_mma < body1.rindex("__syncthreads();")


# ---------------------------------------------------------------------------------------------------------------
# shared-memory banks, from the rendered indices

_SHARED = re.compile(r"__shared__ __align__\(16\) unsigned int (zs[ab])\[(\d+)\]\[(\d+)\]\[(\d+)\];")
_FRAG_ROW = re.compile(r"const int (zu|zv) = (zw[mn] \* \d+ \+ z[ij] \* \d+ \+ zr);")
_FRAG_READ = re.compile(r"(z[ab])\[(z[ij])\]\[(\d)\] = (zs[ab])\[zbf\]\[([^\[\]]+)\]\[([^\[\]]+)\];")


@functools.cache
def _compiled(expr: str):
    return compile(expr, "<rendered index>", "eval")


def at(expr: str, env: dict[str, int]) -> int:
    """The value of a rendered C index expression (Python syntax) in ``env``; each expression is compiled once
    (evaluating the source text each time was most of these tests' time)."""
    return eval(_compiled(expr), {}, env)  # noqa: S307 - our own rendered source


def fragment_banks(src: str, g: gpu.Geometry) -> list[list[int]]:
    """For every fragment read of the rendered source (each register, every warp, mma tile and k step): the
    banks of the 32 lanes' words, from the source's own row and column expressions and array shapes."""
    shapes = {m.group(1): (int(m.group(3)), int(m.group(4))) for m in _SHARED.finditer(src)}
    rows = dict(_FRAG_ROW.findall(src))
    reads = _FRAG_READ.findall(src)
    assert len(reads) == 6 and set(rows) == {"zu", "zv"}, (reads, rows)
    t = g.tile
    kw = t.bk // gpu.mma_pack(g.contraction.dtype)
    out = []
    for _, idx, _, arr, row, col in reads:
        rw = shapes[arr][1]
        count = t.tiles_m if idx == "zi" else t.tiles_n
        for w in range(t.warps):
            for i in range(count):
                for zp in range(0, kw, 8):
                    banks = []
                    for zl in range(32):
                        env = {"zr": zl >> 2, "zt": zl & 3, "zwm": w // t.wn, "zwn": w % t.wn, "zi": i, "zj": i,
                               "zp": zp}
                        env[idx.replace("zi", "zu").replace("zj", "zv")] = at(rows["zu" if idx == "zi" else "zv"], env)
                        r, c = at(row, env), at(col, env)
                        assert 0 <= c < kw and 0 <= r < shapes[arr][0]
                        banks.append((r * rw + c) % 32)
                    out.append(banks)
    return out


_LDMATRIX = re.compile(r"ldmatrix\.sync\.aligned\.m8n8\.x(\d)\.shared\.b16.*?#else\s*\{\s*const unsigned long long "
                       r"zad = \(unsigned long long\)&(zs[ab])\[zbf\]\[([^\[\]]+)\]\[([^\[\]]+)\];", re.S)


def ldmatrix_banks(src: str, g: gpu.Geometry) -> list[list[int]]:
    """For every ``ldmatrix`` of the rendered source (every warp, mma tile and k step) and each of its 8-lane
    phases (one 8x8 matrix: lane ``8q + j`` addresses its row ``j``): the banks of the 32 words read, from the
    row address expressions of the source's emulation branch (the same as the PTX branch's)."""
    shapes = {m.group(1): (int(m.group(3)), int(m.group(4))) for m in _SHARED.finditer(src)}
    t = g.tile
    kw = t.bk // 2
    out = []
    found = _LDMATRIX.findall(src)
    assert len(found) == src.count("ldmatrix.sync")
    for count, arr, row, col in found:
        rw = shapes[arr][1]
        tiles = t.tiles_m if arr == "zsa" else t.tiles_n
        for w in range(t.warps):
            for i in range(tiles):
                for zp in range(0, kw, 8):
                    for q in range(int(count)):
                        banks = []
                        for zl in range(8 * q, 8 * q + 8):
                            env = {"zl": zl, "zwm": w // t.wn, "zwn": w % t.wn, "zi": i, "zj": i, "zp": zp}
                            r, c = at(row, env), at(col, env)
                            assert c % 4 == 0 and 0 <= c < kw and 0 <= r < shapes[arr][0]
                            banks += [(r * rw + c + x) % 32 for x in range(4)]
                        out.append(banks)
    return out


def store_ways(src: str, arr: str) -> int:
    """The worst bank conflict (distinct words per bank) of warp 0's first-trip stores into ``arr``'s next
    buffer: one phase of 32 lanes per 4-byte store, 4 phases of 8 lanes per 16-byte one."""
    shapes = {m.group(1): (int(m.group(3)), int(m.group(4))) for m in _SHARED.finditer(src)}
    rw = shapes[arr][1]
    body = k_loop(src)
    tail = body[body.rindex("if (zpf) {"):body.rindex("__syncthreads();")]
    (loop,) = [x for x in tail.split("for (int zf = 0;")[1:] if f"{arr}[zbf ^ 1]" in x]
    total = re.search(r"if \(zo < (\d+)\)", loop)
    lanes = range(min(32, int(total.group(1)))) if total else range(32)
    decode = re.search(r"const int zu = (zo [/%] \d+), zv = (zo [/%] \d+);", loop)
    zu, zv = (x.replace("/", "//") for x in decode.groups())  # C's int division
    worst = 1
    for m in re.finditer(rf"(\*\(uint4\*\)&)?{arr}\[zbf \^ 1\]\[([^\[\]]+)\]\[([^\[\]]+)\]", loop):
        width = 4 if m.group(1) else 1
        phases = [lanes] if width == 1 else [[x for x in lanes if x // 8 == p] for p in range(4)]
        for phase in phases:
            words = set()
            for zl in phase:  # warp 0, trip 0: zo is the lane
                env = {"zo": zl}
                env["zu"], env["zv"] = at(zu, env), at(zv, env)
                w = at(m.group(2), env) * rw + at(m.group(3), env)
                words.update(w + q for q in range(width))
            if words:
                worst = max(worst, max(Counter(w % 32 for w in words).values()))
    return worst


LAYOUTS = [  # dtype, a stored, b stored, ta, tb: every fill order, vector and scalar fills
    ("float16", (256, 256), (256, 256), False, False),
    ("float16", (33, 47), (47, 70), False, False),
    ("bfloat16", (256, 256), (256, 256), True, True),
    ("float16", (70, 33), (47, 70), True, True),
    ("float32", (256, 256), (256, 256), False, False),
    ("float32", (33, 47), (47, 70), False, False),
    ("float32", (256, 256), (256, 256), True, True),
    ("float32", (70, 33), (47, 70), True, True),
]


@pytest.mark.parametrize("dtype,a_shape,b_shape,ta,tb", LAYOUTS)
def test_every_fragment_read_hits_32_distinct_banks(dtype, a_shape, b_shape, ta, tb):
    k = matmul_kernel(a_shape, b_shape, dtype, ta, tb)
    c = gpu.find_contraction(k, tf32=dtype == "float32")
    assert c is not None
    want_order = (not ta, tb)  # (a walks k fastest, b walks k fastest)
    assert gpu.mma_fill_order(c) == want_order
    info = info_for(dtype)
    for i in gpu.mma_tiles(info, c.dtype):
        for s in (1, 2):
            g, src, _ = render(k, dtype, {"mma_tile": i, "mma_stages": s, "mma_ldmatrix": 0})
            if g.tile != gpu.MMA_TILES[i]:
                continue  # does not fit with two stages
            assert not g.ldmatrix and "ldmatrix" not in src
            for banks in fragment_banks(src, g):
                assert len(set(banks)) == 32, (g.tile, s, banks)
            g, src, _ = render(k, dtype, {"mma_tile": i, "mma_stages": s})
            assert g.ldmatrix == (dtype != "float32" and any(want_order))
            for banks in ldmatrix_banks(src, g):  # each 8-lane phase: 8 rows of 16 bytes
                assert len(set(banks)) == 32, (g.tile, s, banks)


@pytest.mark.parametrize("dtype,a_shape,b_shape,ta,tb", LAYOUTS)
def test_row_first_fills_store_with_at_most_two_way_conflicts(dtype, a_shape, b_shape, ta, tb):
    """The swizzle also spreads the fills walking rows (m of a transposed ``a``, n of ``b``): the interleaved
    8-row vector fill stores at most 2 lanes per bank (was 4-way with the old pad of 1), a scalar row fill at most
    2 (1 for tiles of 32+ rows). The k-first fills are unswizzled and keep their pad's 2-way worst case."""
    k = matmul_kernel(a_shape, b_shape, dtype, ta, tb)
    info = info_for(dtype)
    c = gpu.find_contraction(k, tf32=dtype == "float32")
    for i in gpu.mma_tiles(info, c.dtype, 2):
        g, src, _ = render(k, dtype, {"mma_tile": i, "mma_stages": 2})
        for arr in ("zsa", "zsb"):
            assert store_ways(src, arr) <= 2, (g.tile, arr)


# ---------------------------------------------------------------------------------------------------------------
# every (tile, stages) compiles, and computes the same thing


@needs_nvrtc
@pytest.mark.parametrize("dtype,a_shape,b_shape,ta,tb", [
    ("float16", (256, 256), (256, 256), False, False), ("float16", (70, 33), (70, 47), True, False),
    ("bfloat16", (256, 256), (256, 256), True, True), ("bfloat16", (33, 47), (47, 70), False, False),
    ("float32", (256, 256), (256, 256), False, False), ("float32", (70, 33), (47, 70), True, True)])
def test_every_tile_and_stages_compiles_for_sm80_and_sm90(dtype, a_shape, b_shape, ta, tb):
    k = matmul_kernel(a_shape, b_shape, dtype, ta, tb)
    space = gpu.search_space(k, info_for(dtype))
    seen = set()
    for i in space["mma_tile"]:
        for s in gpu.MMA_STAGES:
            for ldm in space.get("mma_ldmatrix", (0,)):
                g, src, cs = render(k, dtype, {"mma_tile": i, "mma_stages": s, "mma_ldmatrix": ldm})
                assert g.stages == s and (g.tile == gpu.MMA_TILES[i] or s == 2) and g.ldmatrix == bool(ldm)
                seen.add(src)
    assert len(seen) >= len(space["mma_tile"]) + 1
    nvrtc_compiles(sorted(seen))


@needs_gxx
@pytest.mark.parametrize("dtype,a_shape,b_shape,ta,tb", CASES)
def test_one_and_two_stages_give_identical_results_equal_to_numpy(dtype, a_shape, b_shape, ta, tb, rng):
    """On the largest and the smallest tile that fit two stages (and the heuristic's): forced stages 1 and 2, and
    ``ldmatrix`` on and off where it applies, give bitwise the same outputs (the math's order is unchanged),
    within rounding of NumPy's float64 product."""
    k = matmul_kernel(a_shape, b_shape, dtype, ta, tb)
    info = info_for(dtype)
    g = gpu.geometry(gpu.optimize(k, info))
    assert g.strategy == "mma" and g.stages == 2
    np_dtype = np.float32 if dtype == "float32" else k.params[1].dtype.np_dtype
    a = rng.uniform(-1, 1, a_shape).astype(np.float32).astype(np_dtype)
    b = rng.uniform(-1, 1, b_shape).astype(np.float32).astype(np_dtype)
    want, bound = reference(dtype, a, b, ta, tb)
    two = gpu.mma_tiles(info, g.contraction.dtype, 2)
    for i in sorted({two[0], two[-1], gpu.MMA_TILES.index(g.tile)}):
        got = {}
        for s in (1, 2):
            for ldm in (0, 1) if g.ldmatrix else (1,):
                params = {"mma_tile": i, "mma_stages": s, "mma_ldmatrix": ldm}
                gi = gpu.geometry(gpu.optimize(k, info, params))
                assert gi.stages == s and gi.ldmatrix == (ldm == 1 and g.ldmatrix)
                got[s, ldm] = emulate(k, dtype, params, a, b)
        for x in got.values():  # stages and ldmatrix change neither the values nor the order of the math
            np.testing.assert_array_equal(x, got[2, 1])
        err = np.abs(got[2, 1].astype(np.float64).reshape(want.shape) - want)
        assert np.all(err <= bound), (i, float(np.max(err - bound)))

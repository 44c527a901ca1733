"""CUDA code generation without a GPU: launch geometry (``zyx.kernel.gpu``), the CUDA C renderer, NVRTC, and
the generated kernels' results under a CPU emulation of CUDA.

The emulation is the emulated driver's CPU runtime (``zyx.backends.cuda.emulator.kernels``): the rendered CUDA C
compiled as C++ (g++), every CUDA thread of a block a fiber, ``__syncthreads`` and warp shuffles barriers; here
the grid is clamped to a few blocks so that grid-stride loops wrap. It checks geometry, indexing, cooperative
reductions, NaN handling and the portable 16-bit conversions (``__CUDA_ARCH__`` is undefined there) against NumPy
and the host renderer; it cannot check CUDA's math library, the inline PTX conversions, or speed, which need a GPU.
"""

from __future__ import annotations

import ctypes
import math
import re
import shutil
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import assert_close, host_without_blas, kernels_of

import zyx
from zyx import dtypes, utils
from zyx.backends.base import BackendError, ErrorStatus
from zyx.backends.cuda import nvrtc
from zyx.backends.cuda.args import ArgPack, scalar_format
from zyx.backends.cuda.emulator import kernels as emu_kernels
from zyx.backends.host.compiler import CCompiler
from zyx.backends.registry import registry
from zyx.graph import schedule
from zyx.kernel import gpu, ir, opt
from zyx.kernel.ir import Kernel, Param, Store
from zyx.kernel.render import CRenderer
from zyx.kernel.render_cuda import (
    BFLOAT16_PRELUDE,
    BITS_PRELUDE,
    CUDA_PRELUDE,
    FLOAT16_PRELUDE,
    CUDARenderer,
    CudaSource,
    render_cuda,
)
from zyx.ops import Ops

INFO = gpu.reference_info()
ARCHS = ("sm_80", "sm_90")
EMU_GRID = 3  # blocks per emulated launch: small, so that grid-stride loops wrap
_NVRTC = nvrtc.available()
needs_nvrtc = pytest.mark.skipif(_NVRTC is not None, reason=f"NVRTC unavailable ({_NVRTC}): {nvrtc.INSTALL_HINT}")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulation needs g++")
f32 = dtypes.float32




# ---------------------------------------------------------------------------------------------------------------
# hand-built kernels (geometry tests need no compiler)


def _ranges(*sizes: int) -> list[ir.Expr]:
    return [ir.range_(100 + i, s) for i, s in enumerate(sizes)]


def ir_elementwise(n: int) -> Kernel:
    (i,) = _ranges(n)
    v = ir.alu(Ops.MUL, ir.load(1, f32, i), ir.const(2.0, f32))
    return Kernel("ew", (Param("p0", f32, "out", n), Param("p1", f32, "in", n)), (i,), (Store(0, i, v),))


def ir_rows(rows: int, cols: int, op: Ops = Ops.ADD) -> Kernel:
    """out[i] = op-reduce over k of x[i, k] (contiguous rows)."""
    i, k = _ranges(rows, cols)
    red = ir.reduce(op, ir.load(1, f32, i * cols + k), (k,))
    return Kernel("rows", (Param("p0", f32, "out", rows), Param("p1", f32, "in", rows * cols)), (i,),
                  (Store(0, i, red),))


def ir_cols(rows: int, cols: int) -> Kernel:
    """out[j] = sum over k of x[k, j] (adjacent outputs read adjacent elements)."""
    j, k = _ranges(cols, rows)
    red = ir.reduce(Ops.ADD, ir.load(1, f32, k * cols + j), (k,))
    return Kernel("cols", (Param("p0", f32, "out", cols), Param("p1", f32, "in", rows * cols)), (j,),
                  (Store(0, j, red),))


def ir_softmax(rows: int, cols: int) -> Kernel:
    i, j, k1, k2 = _ranges(rows, cols, cols, cols)
    x = lambda r: ir.load(1, f32, i * cols + r)  # noqa: E731
    m = ir.reduce(Ops.MAX, x(k1), (k1,))
    s = ir.reduce(Ops.ADD, ir.alu(Ops.EXP, ir.alu(Ops.SUB, x(k2), m)), (k2,))
    out = ir.alu(Ops.DIV, ir.alu(Ops.EXP, ir.alu(Ops.SUB, x(j), m)), s)
    n = rows * cols
    return Kernel("softmax", (Param("p0", f32, "out", n), Param("p1", f32, "in", n)), (i, j),
                  (Store(0, i * cols + j, out),))


def ir_full(n: int) -> Kernel:
    (k,) = _ranges(n)
    red = ir.reduce(Ops.ADD, ir.load(1, f32, k), (k,))
    return Kernel("full", (Param("p0", f32, "out", 1), Param("p1", f32, "in", n)), (),
                  (Store(0, ir.const(0, ir.index_dtype), red),))


def ir_nested(rows: int, inner: int, cols: int) -> Kernel:
    """out[i] = sum_k x[i, k] * max_j y[k, j]: a reduce inside another reduce's body."""
    i, k, j = _ranges(rows, inner, cols)
    mx = ir.reduce(Ops.MAX, ir.load(2, f32, k * cols + j), (j,))
    red = ir.reduce(Ops.ADD, ir.alu(Ops.MUL, ir.load(1, f32, i * inner + k), mx), (k,))
    return Kernel("nested", (Param("p0", f32, "out", rows), Param("p1", f32, "in", rows * inner),
                             Param("p2", f32, "in", inner * cols)), (i,), (Store(0, i, red),))


def ir_two_depths(rows: int, cols: int, red: int) -> Kernel:
    """out[i, j] = (sum_k x[i, k]) * (max_l y[j, l]) + a3: reduces at depths 1 and 2, and a scalar variable."""
    i, j, k, lr = _ranges(rows, cols, red, red)
    a = ir.reduce(Ops.ADD, ir.load(1, f32, i * red + k), (k,))
    b = ir.reduce(Ops.MAX, ir.load(2, f32, j * red + lr), (lr,))
    v = ir.alu(Ops.ADD, ir.alu(Ops.MUL, a, b), ir.var(3, f32))
    return Kernel("two_depths", (Param("p0", f32, "out", rows * cols), Param("p1", f32, "in", rows * red),
                                 Param("p2", f32, "in", cols * red), Param("a3", f32, "var")), (i, j),
                  (Store(0, i * cols + j, v),))


def ir_scalar_store() -> Kernel:
    return Kernel("scalar", (Param("p0", dtypes.int64, "out", 1), Param("a1", dtypes.int64, "var")), (),
                  (Store(0, ir.const(0, ir.index_dtype), ir.alu(Ops.MUL, ir.var(1, dtypes.int64),
                                                                ir.const(3, dtypes.int64))),))


# ---------------------------------------------------------------------------------------------------------------
# (c) geometry


def test_elementwise_covers_every_element_with_256_threads():
    g = gpu.geometry(gpu.optimize(ir_elementwise(10**6), INFO, {"vector": 0}))  # one output per thread
    assert g.strategy == "thread" and g.items == 10**6 and g.block == (256, 1, 1)
    assert g.grid[0] * g.block_threads >= 10**6


def test_long_rows_get_one_block_per_row():
    g = gpu.geometry(gpu.optimize(ir_rows(4096, 4096), INFO))
    assert (g.strategy, g.split, g.items) == ("group", 1, 4096)
    assert g.group_threads == 256 and g.block == (256, 1, 1) and g.grid == (4096, 1, 1)


def test_short_rows_get_one_warp_per_row():
    g = gpu.geometry(gpu.optimize(ir_rows(1000, 100, Ops.MAX), INFO))
    assert g.warp_mode and g.block == (32, 8, 1) and g.grid == (125, 1, 1) and g.items == 1000


def test_softmax_gets_a_block_per_row_with_the_elementwise_loop_inside():
    k = gpu.optimize(ir_softmax(64, 3000), INFO)
    g = gpu.geometry(k)
    assert (g.strategy, g.split, g.flat, g.items) == ("group", 1, 2, 64)
    assert 256 <= g.group_threads <= 1024 and g.groups_per_block == 1
    src = CUDARenderer().render(k).source
    assert src.count("__syncthreads()") == 4 and "for (int zj = zl; zj < 3000;" in src


def test_many_columns_get_a_thread_each_and_long_serial_sums_widen():
    k = gpu.optimize(ir_cols(4096, 50_000), INFO)
    g = gpu.geometry(k)
    assert g.strategy == "thread" and g.items == 50_000 and k.wide_acc
    assert "double acc" in CUDARenderer().render(k).source
    assert not gpu.optimize(ir_rows(4096, 4096), INFO).wide_acc  # 16 elements per thread, then a tree


def test_few_columns_get_the_coalesced_columns_layout():
    g = gpu.geometry(gpu.optimize(ir_cols(2000, 300), INFO))
    assert (g.strategy, g.items, g.groups_per_block) == ("columns", 300, 32) and g.block == (32, g.group_threads, 1)
    assert g.group_threads > 1 and g.grid == (10, 1, 1)  # each column's 2000 rows split over TY threads


def test_full_reduction_uses_one_block_of_1024():
    g = gpu.geometry(gpu.optimize(ir_full(1 << 20), INFO))
    assert (g.strategy, g.split, g.items, g.block, g.grid) == ("group", 0, 1, (1024, 1, 1), (1, 1, 1))


def test_nested_and_two_depth_reduces():
    g = gpu.geometry(gpu.optimize(ir_nested(8, 300, 5), INFO))
    assert (g.strategy, g.split) == ("columns", 1)  # y[k, j] is the same for every output: rows of k per warp
    g2 = gpu.geometry(gpu.optimize(ir_two_depths(6, 70, 9), INFO))
    assert (g2.strategy, g2.split, g2.flat, g2.items) == ("group", 1, 2, 6)


def test_huge_grids_are_capped_and_use_64_bit_indices():
    k = gpu.optimize(ir_elementwise(1 << 40), INFO, {"vector": 0})  # one output per thread
    g = gpu.geometry(k)
    assert g.grid[0] == INFO.max_global_work[0] and g.grid[0] * g.block_threads < g.items
    src = CUDARenderer().render(k).source
    assert "for (long long zi =" in src and "const long long r100" in src


@pytest.mark.parametrize("shape", [(1,), (7,), (33, 5), (5, 33), (1000, 3), (3, 1000), (2, 3, 4), (300, 1, 70)])
def test_geometry_invariants(shape):
    # (reduce ranges of size 1 are left out: the graph never emits them, and opt.drop_unit_loops cannot drop them)
    kernels = [ir_elementwise(math.prod(shape))] + ([ir_full(math.prod(shape))] if math.prod(shape) > 1 else [])
    if len(shape) > 1:
        rows, cols = shape[0], math.prod(shape[1:])
        kernels += [ir_rows(rows, cols), ir_cols(rows, cols), ir_softmax(rows, cols), ir_two_depths(rows, cols, 3)]
    for k in kernels:
        g = gpu.geometry(gpu.optimize(k, INFO))
        assert 1 <= g.grid[0] <= INFO.max_global_work[0] and g.grid[1:] == (1, 1)
        assert g.block_threads <= INFO.max_local_threads and g.block_threads % 32 == 0
        per_block = g.block_threads if g.strategy == "thread" else g.groups_per_block
        assert g.grid[0] * per_block >= g.items  # (unless capped, see test_huge_grids...)
        if g.strategy == "group":
            assert g.block == (g.group_threads, g.groups_per_block, 1) and g.group_threads % 32 == 0
            assert g.groups_per_block == 1 or g.group_threads == 32
        if g.strategy == "columns":
            tx = g.groups_per_block
            assert g.block == (tx, g.group_threads, 1) and tx & (tx - 1) == 0 and (tx == 32 or tx >= g.items)


def test_render_needs_the_geometry():
    with pytest.raises(ValueError, match="gpu.optimize"):
        CUDARenderer().render(ir_elementwise(4))


# ---------------------------------------------------------------------------------------------------------------
# renderer details


def test_signature_and_param_kinds():
    cs = render_cuda(ir_two_depths(2, 3, 4), INFO)
    assert cs.param_kinds == ("out", "in", "in", "var") and cs.shared_bytes == 0
    assert cs.param_types == ("float* __restrict__", "const float* __restrict__", "const float* __restrict__",
                              "const float")
    assert ("two_depths(float* __restrict__ p0, const float* __restrict__ p1, const float* __restrict__ p2, "
            "const float a3)") in cs.source
    assert f'extern "C" __global__ void __launch_bounds__({math.prod(cs.block)}) two_depths(' in cs.source


def test_prelude_holds_only_what_the_kernel_uses():
    plain = render_cuda(ir_elementwise(10), INFO).source
    assert "#include" not in plain and "zyx_float16" not in plain and "zyx_idiv" not in plain
    i = ir.range_(0, 10)
    q = ir.alu(Ops.DIV, ir.load(1, dtypes.int64, i), ir.load(2, dtypes.int64, i))
    h = ir.cast(ir.cast(q, dtypes.float16), dtypes.float32)
    k = Kernel("k", (Param("p0", f32, "out", 10), Param("p1", dtypes.int64, "in", 10),
                     Param("p2", dtypes.int64, "in", 10)), (i,), (Store(0, i, h),))
    src = render_cuda(k, INFO).source
    assert "ZYX_DEV long long zyx_idiv_int64(" in src and "zyx_mod_int64" not in src
    assert "cvt.rn.f16.f32" in src and "zyx_bfloat16" not in src and "#include" not in src


def _as_ternary(expr: str) -> str:
    """The host spells a float select as a bit-mask helper (it vectorizes); CUDA as ``c ? a : b``."""
    m = re.fullmatch(r"zyx__sel(?:32|64)\((.*), ([^,()]+), ([^,()]+)\)", expr)
    return f"({m[1]} ? {m[2]} : {m[3]})" if m else expr


def test_float_expressions_match_the_host_renderer():
    """Same IR, same C expression (names aside) for everything but the math library and how a float select
    is spelled."""
    x = zyx.Tensor(np.ones((4, 5), np.float32))
    y = zyx.Tensor(np.ones((4, 5), np.float16))
    t = ((x * 3 + 1) / (x - 2)).maximum(x).where(x > 0, -x) + (y * y).cast(zyx.float32) + x.exp()
    (k,) = kernels_of(t)
    cuda, host = CUDARenderer(), CRenderer()
    names: dict[ir.Expr, str] = {}
    compared = 0
    for e in ir.toposort([s.value for s in k.stores]):
        if e.op not in (Ops.CONST, Ops.RANGE) and e.dtype.is_float and e.op is not Ops.LOAD:
            a, b = cuda.expr(e, names, k.params), host.expr(e, names, k.params)
            if e.op is Ops.EXP:
                assert a.startswith("expf(") and b.startswith("zyx_expf(") and a[4:] == b[8:]
            else:
                assert a == _as_ternary(b), (e.op, a, b)
                compared += 1
        names[e] = f"x{len(names)}"
    assert compared >= 8


def test_index_math_is_int_when_bounds_allow_and_widens_otherwise():
    r0, r1 = ir.range_(0, 70_000), ir.range_(1, 70_000)
    big = r0 * 70_000 + r1  # up to 4.9e9: 64-bit
    small = (r0 // 7) % 100 + r1  # 32-bit
    v = ir.alu(Ops.ADD, ir.load(1, f32, small), ir.cast(big, f32))
    k = Kernel("k", (Param("p0", f32, "out", 70_000**2), Param("p1", f32, "in", 70_000)), (r0, r1),
               (Store(0, big, v),))
    src = render_cuda(k, INFO).source
    assert re.search(r"const long long v\d+ = \(\(long long\)r0 \* 70000LL\);", src)  # widened before it overflows
    assert re.search(r"const long long v\d+ = \(\(long long\)r1 \+ v\d+\);", src)
    assert re.search(r"const int v\d+ = \(r0 / 7\);", src) and re.search(r"const int v\d+ = \(v\d+ % 100\);", src)
    assert "for (long long zi" in src  # 4.9e9 outputs


def test_cat_runs_one_grid_stride_segment_per_piece_with_one_load_each():
    pieces = [zyx.Tensor(np.ones(1000, np.float32)) for _ in range(64)]
    (k,) = kernels_of(zyx.cat(pieces))
    cs = render_cuda(k, INFO)
    body = cs.source[cs.source.index("extern"):]
    segments = body.split("\n  {\n")[1:]
    assert len(segments) == 64 and cs.block == (256, 1, 1)
    for seg in segments:
        assert len(re.findall(r"= p\d+\[", seg)) == 1 and "?" not in seg and "zi < 1000;" in seg
    for arch in ARCHS if _NVRTC is None else ():
        assert nvrtc.compile_cubin(cs.source, cs.name, arch)[:4] == b"\x7fELF"


def test_float_to_int_casts_are_the_hosts_defined_conversion():
    for d in (dtypes.uint8, dtypes.int32, dtypes.uint32, dtypes.uint64):
        src = CUDARenderer().float_to_int("x", f32, d)
        assert src == CRenderer().float_to_int("x", f32, d) == f"zyx_f2i_{d.name}((double)(x))"
    r0 = ir.range_(0, 8)
    k = Kernel("k", (Param("p0", dtypes.uint32, "out", 8), Param("p1", f32, "in", 8)), (r0,),
               (Store(0, r0, ir.cast(ir.load(1, f32, r0), dtypes.uint32)),))
    src = render_cuda(k, INFO).source
    assert "zyx_f2i_uint32(double x)" in src and "zyx_f2i_int8(" not in src  # only the helper it uses


# ---------------------------------------------------------------------------------------------------------------
# NVRTC


@needs_nvrtc
def test_nvrtc_version_and_arch_names():
    assert nvrtc.nvrtc_version() >= (12, 0)
    assert nvrtc.normalize_arch("90") == "sm_90" and nvrtc.normalize_arch("sm_90a") == "sm_90a"
    with pytest.raises(BackendError, match="exact sm"):
        nvrtc.normalize_arch("compute_90")


@needs_nvrtc
def test_compile_is_a_cached_cubin():
    cs = render_cuda(ir_softmax(4, 100), INFO)
    for arch in ARCHS:
        cubin = nvrtc.compile_cubin(cs.source, cs.name, arch)
        assert cubin[:4] == b"\x7fELF"
        assert nvrtc.cache_path(cs.source, arch).read_bytes() == cubin
        assert nvrtc.compile_cubin(cs.source, cs.name, arch) == cubin
    assert nvrtc.compile_cubin(cs.source, cs.name, "sm_80") != nvrtc.compile_cubin(cs.source, cs.name, "sm_90")


@needs_nvrtc
def test_compile_error_names_the_kernel_the_log_and_the_source():
    src = 'extern "C" __global__ void broken(float* p) { p[0] = undefined_thing; }\n'
    with pytest.raises(BackendError) as ei:
        nvrtc.compile_cubin(src, "broken", "sm_90")
    e = ei.value
    assert e.status is ErrorStatus.COMPILATION and "broken" in e.context and "undefined_thing" in e.context
    path = e.context.split("source: ")[1].split(")")[0]
    assert Path(path).read_text() == src


@needs_nvrtc
def test_bundled_headers_are_found():
    src = '#include <cuda_fp16.h>\nextern "C" __global__ void k(__half* p) { p[0] = __float2half(1.0f); }\n'
    assert nvrtc.compile_cubin(src, "k", "sm_80")[:4] == b"\x7fELF"


@needs_nvrtc
def test_check_batch_names_the_failing_kernel():
    good = render_cuda(ir_rows(3, 5), INFO).source
    bad = 'extern "C" __global__ void __launch_bounds__(32) bad_kernel(float* p) { p[0] = nope; }\n'
    with pytest.raises(BackendError, match="bad_kernel") as ei:
        nvrtc.check_batch([good, bad], "sm_80")
    assert "1 of" in ei.value.context
    nvrtc.check_batch([good], "sm_80")
    assert nvrtc.is_checked(good, "sm_80")


def _fresh_kernel(body: str) -> str:
    """A kernel source no earlier run checked (a random constant in it)."""
    return f'extern "C" __global__ void fresh_{uuid.uuid4().hex}(float* p) {{ p[0] = 1.0f; {body} }}\n'


@needs_nvrtc
def test_check_batch_still_assembles_inline_ptx():
    """The batch check compiles at NVRTC's fastest effort (``FAST_OPTIONS``) but still runs ptxas: an inline
    PTX instruction that does not exist fails the check, as it fails a real compile."""
    bad = _fresh_kernel('asm volatile("mma.sync.no_such_shape.f32 %0;" :: "f"(p[1]));')
    with pytest.raises(BackendError, match="fresh_"):
        nvrtc.check_batch([_fresh_kernel(""), bad], "sm_90")
    with pytest.raises(BackendError):
        nvrtc.compile_cubin(bad, "bad", "sm_90")


@needs_nvrtc
def test_a_front_end_check_catches_cxx_errors_and_never_stands_for_a_compile():
    """``check_batch(front_end=True)`` (the suite's check of every logged kernel): a C++ error fails it and names
    the kernel; invalid inline PTX passes it (only ptxas sees PTX: the layouts' own tests compile fully); its
    markers are its own, so a full check or compile of the same source still runs."""
    if not nvrtc.front_end_option("sm_80"):
        pytest.skip("this NVRTC has no -fdevice-syntax-only: check_batch compiles fully")
    bad = 'extern "C" __global__ void __launch_bounds__(32) bad_front(float* p) { p[0] = nope; }\n'
    with pytest.raises(BackendError, match="bad_front"):
        nvrtc.check_batch([_fresh_kernel(""), bad], "sm_80", front_end=True)
    ptx = _fresh_kernel('asm volatile("mma.sync.no_such_shape.f32 %0;" :: "f"(p[1]));')
    src = _fresh_kernel("p[1] = 3.0f;")
    assert nvrtc.check_batch([src, ptx], "sm_80", front_end=True) == 2
    assert nvrtc.is_checked(src, "sm_80", front_end=True) and not nvrtc.is_checked(src, "sm_80")
    assert nvrtc.check_batch([src], "sm_80", front_end=True) == 0  # remembered
    assert nvrtc.check_batch([src], "sm_80") == 1 and nvrtc.is_checked(src, "sm_80")
    with pytest.raises(BackendError):
        nvrtc.check_batch([ptx], "sm_80")


@needs_nvrtc
def test_options_this_nvrtc_rejects_are_left_out(monkeypatch):
    monkeypatch.setattr(nvrtc, "FAST_OPTIONS", ("--no-such-nvrtc-option",))
    monkeypatch.setattr(nvrtc, "LEAN_OPTIONS", ("--no-such-lean-option",))
    src = _fresh_kernel("")
    assert not any("no-such" in o for o in nvrtc.options(src, "sm_80", optimize=False))
    assert nvrtc.check_batch([src, _fresh_kernel("p[1] = 2.0f;")], "sm_80") == 2
    assert nvrtc.is_checked(src, "sm_80")
    assert nvrtc.compile_cubin(_fresh_kernel("p[2] = 1.0f;"), "k", "sm_80", optimize=False)[:4] == b"\x7fELF"


@needs_nvrtc
@pytest.mark.skipif(nvrtc.available() is None and nvrtc.nvrtc_version() < (12, 8),
                    reason="NVRTC before 12.8 has no --Ofast-compile")
def test_lean_and_fast_options_where_they_apply():
    """``--minimal`` for every source without an include (the same cubin, compiled faster); the lowest effort only
    for code that never runs, and such a compile marks its source checked for that sm."""
    src = _fresh_kernel("")
    assert "--minimal" in nvrtc.options(src, "sm_90") and "--Ofast-compile=max" not in nvrtc.options(src, "sm_90")
    assert "--Ofast-compile=max" in nvrtc.options(src, "sm_90", optimize=False)
    assert "--minimal" not in nvrtc.options("#include <cuda_fp16.h>\n" + src, "sm_90")
    assert nvrtc.compile_cubin(src, "k", "sm_90")[:4] == b"\x7fELF" and not nvrtc.is_checked(src, "sm_80")
    assert nvrtc.compile_cubin(src, "k", "sm_80", optimize=False)[:4] == b"\x7fELF" and nvrtc.is_checked(src, "sm_80")


# ---------------------------------------------------------------------------------------------------------------
# CPU emulation of the generated CUDA C

def emu_run(cs: CudaSource, kernel: Kernel, values: list, address: Callable[[object], int]) -> None:
    """Run a rendered kernel with the emulated driver's CPU runtime, on a clamped grid (grid-stride loops wrap)."""
    fn = emu_kernels.compile_module(cs.source).functions[cs.name]
    formats = [scalar_format(p.dtype.name, ct) if p.kind == "var" else None
               for p, ct in zip(kernel.params, cs.param_types)]
    pack = ArgPack(len(formats)).fill(formats, [v if f is not None else address(v) for v, f in zip(values, formats)])
    fault = fn.run([pack.slot(i)[:n] for i, n in enumerate(fn.param_sizes)], (min(cs.grid[0], EMU_GRID), 1, 1),
                   cs.block)
    assert fault is None, f"{cs.name}: {fault}"


_CTYPES = {"bool": ctypes.c_bool, "int8": ctypes.c_int8, "uint8": ctypes.c_uint8, "int16": ctypes.c_int16,
           "uint16": ctypes.c_uint16, "int32": ctypes.c_int32, "uint32": ctypes.c_uint32, "int64": ctypes.c_int64,
           "uint64": ctypes.c_uint64, "float32": ctypes.c_float, "float64": ctypes.c_double,
           "float16": ctypes.c_float, "bfloat16": ctypes.c_float}


def _host_args(kernel: Kernel, values: list):
    """The ``void*[]`` a host kernel takes (pointers to scalars, buffer addresses) and what keeps it alive."""
    addrs, keep = [], []
    for v, p in zip(values, kernel.params):
        if p.kind == "var":
            c = _CTYPES[p.dtype.name](v)
            keep.append(c)
            addrs.append(ctypes.addressof(c))
        else:
            addrs.append(v.ctypes.data)
    return (ctypes.c_void_p * len(addrs))(*addrs), keep


def run_ir(kernel: Kernel, inputs: dict[int, object], target: str) -> dict[int, np.ndarray]:
    """Run a hand-built kernel on the host ("host") or emulated CUDA ("cuda"); returns its output buffers."""
    bufs: dict[int, object] = {}
    for i, p in enumerate(kernel.params):
        if p.kind == "out":
            bufs[i] = np.zeros(p.size, p.dtype.np_dtype)
        else:
            bufs[i] = inputs[i]
    values = [bufs[i] for i in range(len(kernel.params))]
    if target == "host":
        host = registry().get("host").primary
        lib = CCompiler().compile(CRenderer().render(opt.optimize(kernel, host.info())), kernel.name)
        fn = getattr(lib, kernel.name)
        fn.argtypes, fn.restype = [ctypes.c_void_p], None
        arr, _keep = _host_args(kernel, values)
        fn(arr)
    else:
        emu_run(render_cuda(kernel, INFO), kernel, values, lambda a: a.ctypes.data)
    return {i: b for i, b in bufs.items() if kernel.params[i].kind == "out"}


@pytest.fixture
def emulated(monkeypatch):
    """Route the host device's generated kernels through render_cuda and the emulator."""
    dev = registry().get("host").primary
    programs: dict[int, tuple] = {}

    def compile_(kernel: Kernel) -> int:
        if utils.KERNEL_LOG is not None:
            utils.KERNEL_LOG.append(kernel)
        pid = len(programs) + 1
        programs[pid] = (render_cuda(kernel, INFO), kernel)
        return pid

    def launch(pid: int, args) -> None:
        cs, kernel = programs[pid]
        emu_run(cs, kernel, list(args), dev.pool().address)

    monkeypatch.setattr(dev, "compile", compile_)
    monkeypatch.setattr(dev, "compile_many", lambda kernels: [compile_(k) for k in kernels])
    monkeypatch.setattr(dev, "launch", launch)
    schedule.clear_cache()
    yield programs
    schedule.clear_cache()


# ---------------------------------------------------------------------------------------------------------------
# (a) the corpus: built through the Tensor API, compiled by NVRTC, and run under emulation against NumPy


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable  # rng -> (outputs, NumPy references, tolerances)


CASES: list[Case] = []


def case(fn: Callable) -> Callable:
    CASES.append(Case(fn.__name__, fn))
    return fn


def _np(d: str):
    return ml_dtypes.bfloat16 if d == "bfloat16" else np.dtype(d)


_FLOAT_TOL = {"float32": dict(rtol=2e-5, atol=1e-6), "float64": dict(rtol=1e-10, atol=1e-12),
              "float16": dict(rtol=4e-3, atol=2e-3), "bfloat16": dict(rtol=3e-2, atol=2e-2)}
_UNARY = [
    (lambda x: -x, np.negative), (lambda x: x.exp(), np.exp), (lambda x: x.exp2(), np.exp2),
    (lambda x: x.abs().log(), lambda a: np.log(np.abs(a))), (lambda x: x.abs().log2(), lambda a: np.log2(np.abs(a))),
    (lambda x: x.abs().sqrt(), lambda a: np.sqrt(np.abs(a))), (lambda x: x.sin(), np.sin), (lambda x: x.cos(), np.cos),
    (lambda x: x.tanh(), np.tanh), (lambda x: x.reciprocal(), np.reciprocal), (lambda x: x.floor(), np.floor),
    (lambda x: x.ceil(), np.ceil), (lambda x: x.round(), np.round), (lambda x: x.trunc(), np.trunc),
    (lambda x: x.sigmoid(), lambda a: 1 / (1 + np.exp(-a))), (lambda x: x.relu(), lambda a: np.maximum(a, 0)),
    (lambda x: x.erf(), np.vectorize(math.erf)), (lambda x: x * 3 - x / 2, lambda a: a * 3 - a / 2),
    (lambda x: x.maximum(x * -1.5), lambda a: np.maximum(a, a * -1.5)),
    (lambda x: x % 1.25, lambda a: np.remainder(a, 1.25)),
    (lambda x: (x > 0.5).where(x, x * x), lambda a: np.where(a > 0.5, a, a * a)),
    (lambda x: x.abs() ** 1.5, lambda a: np.abs(a) ** 1.5), (lambda x: (x * 0.4).tan(), lambda a: np.tan(a * 0.4)),
]


def _unary(dtype: str):
    def build(rng):
        a = rng.uniform(-3, 3, size=(9, 37)).astype(np.float32)
        a[0, :4] = [0.5, 1.5, -0.5, 2.5]
        x = zyx.Tensor(a.astype(_np(dtype)))
        a64 = a.astype(_np(dtype)).astype(np.float64)
        with np.errstate(all="ignore"):
            wants = [fn(a64) for _, fn in _UNARY] + [np.isnan(a64), a64 < 0.25]
        outs = [f(x) for f, _ in _UNARY] + [x.isnan(), x < 0.25]
        return outs, wants, _FLOAT_TOL[dtype]

    build.__name__ = f"unary_{dtype}"
    return build


for _d in ("float32", "float64", "float16", "bfloat16"):
    case(_unary(_d))


def _integer(dtype: str):
    def build(rng):
        info = np.iinfo(dtype)
        lo, hi = max(info.min, -100), min(info.max, 100)
        a = rng.integers(lo, hi, size=(6, 11)).astype(dtype)
        b = rng.integers(lo, hi, size=(6, 11)).astype(dtype)
        b[0, :3] = [0, 1, 0]
        s = rng.integers(0, info.bits, size=(6, 11)).astype(dtype)
        x, y, sh = zyx.Tensor(a), zyx.Tensor(b), zyx.Tensor(s)
        with np.errstate(all="ignore"):
            q = np.where(b == 0, 0, np.floor_divide(a, np.where(b == 0, 1, b)))
            r = np.where(b == 0, 0, np.remainder(a, np.where(b == 0, 1, b)))
            wants = [a + b, a - b, a * b, q.astype(dtype), r.astype(dtype), a & b, a | b, a ^ b, ~a, a << s, a >> s,
                     np.maximum(a, b), np.minimum(a, b), a < b, a == b, np.where(a < b, a, b), a**3]
        outs = [x + y, x - y, x * y, x // y, x % y, x & y, x | y, x ^ y, ~x, x << sh, x >> sh, x.maximum(y),
                x.minimum(y), x < y, x == y, (x < y).where(x, y), x**3]
        return outs, wants, {}

    build.__name__ = f"integer_{dtype}"
    return build


for _d in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"):
    case(_integer(_d))


@case
def bool_logic(rng):
    a, b = rng.random((5, 9)) < 0.5, rng.random((5, 9)) < 0.3
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    return ([x & y, x | y, x ^ y, ~x, x.logical_and(y).where(x, y), x.cast(zyx.float32) + y.cast(zyx.int32)],
            [a & b, a | b, a ^ b, ~a, np.where(a & b, a, b), a.astype(np.float32) + b.astype(np.int32)], {})


@case
def casts(rng):
    a = rng.uniform(-300, 300, size=(4, 25)).astype(np.float32)
    x = zyx.Tensor(a)
    names = ["int8", "int16", "int32", "int64", "float16", "bfloat16", "float64", "bool"]
    outs = [x.cast(d) for d in names] + [x.abs().cast("uint8"), x.abs().cast("uint32"), x.abs().cast("uint64")]
    wants = [a.astype(_np(d)) for d in names] + [np.abs(a).astype(d) for d in ("uint8", "uint32", "uint64")]
    with np.errstate(all="ignore"):
        wants[0] = a.astype(np.int32).astype(np.int8)  # wrap like the host (C cast through int)
        wants[1] = a.astype(np.int32).astype(np.int16)
    return outs, wants, dict(rtol=1e-2, atol=1e-2)


@case
def reductions_with_nan(rng):
    a = rng.uniform(0.5, 1.5, size=(6, 7, 8)).astype(np.float32)
    a[1, 2, 3] = np.nan
    x = zyx.Tensor(a)
    outs, wants = [], []
    for axis in (0, 1, 2, (0, 2), None):
        for name in ("sum", "max", "min", "prod"):
            outs.append(getattr(x, name)(axis))
            wants.append(getattr(np, name)(a.astype(np.float64), axis=axis))
    outs += [x.max(1, keepdim=True), x.permute(2, 0, 1).sum((0, 2)), x.mean(2)]
    wants += [a.max(1, keepdims=True), a.transpose(2, 0, 1).sum((0, 2), dtype=np.float64), a.mean(2, dtype=np.float64)]
    return outs, wants, dict(rtol=2e-6, atol=1e-6)


@case
def reductions_integer_and_bool(rng):
    a = rng.integers(-50, 50, size=(9, 70)).astype(np.int32)
    b = a > 10
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    return ([x.sum(1), x.max(0), x.min(1), x.prod(1), y.any(1), y.all(0), y.sum(), x.cast(zyx.int8).sum(0)],
            [a.sum(1), a.max(0), a.min(1), a.prod(1), b.any(1), b.all(0), b.sum(), a.astype(np.int8).sum(0)], {})


@case
def full_reduction_of_2_20(rng):
    a = rng.uniform(0.5, 1.5, 1 << 20).astype(np.float32)
    b = a.copy()
    b[12345] = np.nan
    x, y = zyx.Tensor(a), zyx.Tensor(b)
    return ([x.sum(), x.max(), y.min(), (x * x).mean()],
            [a.sum(dtype=np.float64), a.max(), np.nan, (a.astype(np.float64) ** 2).mean()], dict(rtol=1e-5, atol=1e-4))


@case
def softmax_family(rng):
    a = rng.standard_normal((12, 40, 6)).astype(np.float32)
    x = zyx.Tensor(a)
    a64 = a.astype(np.float64)
    outs, wants = [], []
    for axis in (-1, 1, 0):
        lse = np.log(np.exp(a64 - a64.max(axis, keepdims=True)).sum(axis, keepdims=True)) + a64.max(axis, keepdims=True)
        outs += [x.softmax(axis), x.log_softmax(axis), x.logsumexp(axis)]
        wants += [np.exp(a64 - lse), a64 - lse, lse.squeeze(axis)]
    return outs, wants, dict(rtol=1e-5, atol=1e-6)


@case
def softmax_long_rows(rng):
    a = rng.standard_normal((5, 3000)).astype(np.float32)
    e = np.exp(a - a.max(1, keepdims=True))
    return [zyx.Tensor(a).softmax(1)], [e / e.sum(1, keepdims=True)], dict(rtol=1e-5, atol=1e-8)


@case
def normalize_by_global_sum(rng):
    a = rng.uniform(0.1, 1, size=(50, 70)).astype(np.float32)
    x = zyx.Tensor(a)
    return [x / x.sum(), x - x.max()], [a / a.sum(dtype=np.float64), a - a.max()], dict(rtol=1e-5, atol=1e-7)


@case
def var_std_cumsum_arg(rng):
    a = rng.integers(0, 5, size=(30, 50)).astype(np.float32)
    a[3, 7] = np.nan
    x = zyx.Tensor(a)
    a64 = a.astype(np.float64)
    return ([x.var(1), x.std(0, ddof=1), x.cumsum(1), x.cumsum(0), x.argmax(1), x.argmin(0), x.argmax()],
            [a64.var(1), a64.std(0, ddof=1), np.cumsum(a64, 1), np.cumsum(a64, 0), np.argmax(a, 1), np.argmin(a, 0),
             np.argmax(a)], dict(rtol=1e-5, atol=1e-5))


@case
def many_columns_thread_per_output(rng):
    a = rng.standard_normal((40, 34_000)).astype(np.float32)
    x = zyx.Tensor(a)
    return [x.sum(0), x.max(0)], [a.sum(0, dtype=np.float64), a.max(0)], dict(rtol=1e-5, atol=1e-5)


@case
def column_reductions(rng):
    """Reduces over a strided axis (the ``columns`` layout): few and odd column counts (lanes past the last
    output), NaN flags through shared memory, a reduce feeding another (var, argmax), integers, 16-bit."""
    a = rng.standard_normal((700, 45)).astype(np.float32)
    a[5, 7] = np.nan
    b = rng.standard_normal((300, 3)).astype(np.float32)
    c = rng.integers(-9, 9, size=(6, 257, 40)).astype(np.int32)
    h = rng.uniform(-1, 1, size=(90, 70)).astype(np.float16)
    x, y, z, w = zyx.Tensor(a), zyx.Tensor(b), zyx.Tensor(c), zyx.Tensor(h)
    a64, b64, h64 = a.astype(np.float64), b.astype(np.float64), h.astype(np.float64)
    # transposed views: the loop-order passes move the contiguous output / reduce loop innermost
    p = rng.standard_normal((40, 300, 8)).astype(np.float32)
    q = rng.standard_normal((7, 6, 5)).astype(np.float32)
    pt, qt = zyx.Tensor(p).permute(2, 1, 0), zyx.Tensor(q).permute(2, 1, 0)
    p64, q64 = p.astype(np.float64).transpose(2, 1, 0), q.astype(np.float64).transpose(2, 1, 0)
    return ([x.sum(0), x.max(0), y.sum(0), y.var(0), y.argmax(0), y.min(0), z.sum(1), z.max(1), w.sum(0),
             (y * 2).exp().sum(0) + 1, pt.sum(1), pt.max(1), qt.sum((0, 2)), qt.min((0, 2))],
            [a64.sum(0), a.max(0), b64.sum(0), b64.var(0), b.argmax(0), b.min(0), c.sum(1), c.max(1), h64.sum(0),
             np.exp(b64 * 2).sum(0) + 1, p64.sum(1), p64.max(1), q64.sum((0, 2)), q64.min((0, 2))],
            dict(rtol=2e-3, atol=2e-3))


@case
def movement(rng):
    a = rng.standard_normal((6, 10)).astype(np.float32)
    x = zyx.Tensor(a)
    idx_np = (np.arange(7) * 3) % 6
    idx = (zyx.arange(7) * 3) % 6  # a lazy index
    return ([x.pad(((1, 2), (0, 3)), value=-1.0), x.flip(0) + x.flip(1), x[::-1, ::3] * 2, x[idx], x.T.reshape(5, 12)],
            [np.pad(a, ((1, 2), (0, 3)), constant_values=-1.0), a[::-1] + a[:, ::-1], a[::-1, ::3] * 2, a[idx_np],
             a.T.reshape(5, 12)], dict(rtol=1e-6, atol=1e-6))


@case
def matmul_generated(rng):
    a = rng.integers(-5, 5, size=(3, 17, 33)).astype(np.int32)
    b = rng.integers(-5, 5, size=(33, 9)).astype(np.int32)
    c = rng.integers(-5, 5, size=(64, 48)).astype(np.int64)
    return ([zyx.Tensor(a) @ zyx.Tensor(b), zyx.Tensor(c) @ zyx.Tensor(c.T)], [a @ b, c @ c.T], {})


@case
def multi_output(rng):
    a = rng.standard_normal((20, 30)).astype(np.float32)
    x = zyx.Tensor(a)
    return [x.sum(1), x.max(1), x * 2, (x * 2).exp()], [a.sum(1), a.max(1), a * 2, np.exp(a * 2)], dict(rtol=1e-5)


@case
def scans_and_cat(rng):
    a = rng.standard_normal((5, 3000)).astype(np.float32)  # 3000 > 2 * SCAN_BLOCK: the blocked scan
    b = rng.integers(-100, 100, size=(7, 9)).astype(np.int8)
    c = rng.uniform(0.9, 1.1, size=(4, 6)).astype(np.float64)
    x, y, z = zyx.Tensor(a), zyx.Tensor(b), zyx.Tensor(c)
    pieces = [a[:, :7], a[:, 7:8], a[:, 8:30]]
    return ([x.cumsum(1), y.cumsum(0), z.cumprod(1), zyx.cat([x[:, :7], x[:, 7:8], x[:, 8:30]], 1)],
            [np.cumsum(a.astype(np.float64), 1), np.cumsum(b, 0), np.cumprod(c, 1), np.concatenate(pieces, 1)],
            dict(rtol=1e-4, atol=2e-4))


def _splitmix(n: int, seed: int, offset: int) -> np.ndarray:
    """zyx's counter-based random bits (``zyx.tensor._random_bits``) in NumPy."""
    with np.errstate(over="ignore"):
        z = (np.arange(n, dtype=np.uint64) + np.uint64(offset + 1)) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


@case
def random_numbers(rng):
    zyx.manual_seed(7)
    u, i = zyx.rand(50, 3), zyx.randint(-5, 9, size=(33,))
    want_u = ((_splitmix(150, 7, 0) >> np.uint64(40)).astype(np.float32) * np.float32(2.0**-24)).reshape(50, 3)
    want_i = (_splitmix(33, 7, 150) % np.uint64(14)).astype(np.int64) - 5
    return [u, i], [want_u, want_i], dict(rtol=0, atol=0)


CASE_IDS = [c.name for c in CASES]


@needs_nvrtc
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_corpus_compiles_for_sm80_and_sm90(c, rng):
    """The cubin the H200 would load (sm_90, optimized: the device's own path), and the batch check for sm_80."""
    outs, _, _ = c.build(rng)
    kernels = kernels_of(*outs)
    assert kernels, "the case produced no generated kernel"
    sources = []
    for k in kernels:
        cs = render_cuda(k, INFO)
        assert nvrtc.compile_cubin(cs.source, cs.name, "sm_90")[:4] == b"\x7fELF"
        sources.append(cs.source)
    nvrtc.check_batch(sources, "sm_80")


@needs_gxx
@pytest.mark.parametrize("c", CASES, ids=CASE_IDS)
def test_corpus_results_under_emulation(c, rng, emulated):
    outs, wants, tol = c.build(rng)
    zyx.realize(*outs)
    assert emulated, "nothing ran through the emulated CUDA path"
    for got, want in zip(outs, wants):
        assert_close(got, want, **tol)


HAND_BUILT = [pytest.param(k, id=k.name) for k in (ir_nested(7, 300, 5), ir_two_depths(5, 70, 9), ir_softmax(3, 2000),
                                                    ir_rows(40, 700, Ops.MIN), ir_cols(33, 35_000), ir_scalar_store())]


@needs_gxx
@pytest.mark.parametrize("kernel", HAND_BUILT)
def test_hand_built_kernels_match_the_host(kernel, rng):
    inputs: dict[int, object] = {}
    for i, p in enumerate(kernel.params):
        if p.kind == "in":
            inputs[i] = rng.standard_normal(p.size).astype(p.dtype.np_dtype)
        elif p.kind == "var":
            inputs[i] = 1.25 if p.dtype.is_float else 7
    want = run_ir(kernel, inputs, "host")
    got = run_ir(kernel, inputs, "cuda")
    for i in want:
        np.testing.assert_allclose(got[i], want[i], rtol=1e-5, atol=1e-5)


@needs_gxx
def test_portable_16_bit_conversions_match_numpy(tmp_path):
    """The conversions used off-device and for bf16 below sm_80 round to nearest even, like NumPy/ml_dtypes."""
    src = ("#include <string.h>\n#define __device__\n#define __forceinline__ inline\n" + CUDA_PRELUDE + BITS_PRELUDE
           + FLOAT16_PRELUDE + BFLOAT16_PRELUDE + r"""
extern "C" void from16(const unsigned short* h, float* hf, float* bf, int n) {
  for (int i = 0; i < n; i++) { hf[i] = zyx_float16_to_f32(h[i]); bf[i] = zyx_bfloat16_to_f32(h[i]); }
}
extern "C" void to16(const float* f, unsigned short* fh, unsigned short* fb, int n) {
  for (int i = 0; i < n; i++) { fh[i] = zyx_f32_to_float16(f[i]); fb[i] = zyx_f32_to_bfloat16(f[i]); }
}
""")
    (tmp_path / "c.cpp").write_text(src)
    subprocess.run(["g++", "-std=c++17", "-O1", "-shared", "-fPIC", str(tmp_path / "c.cpp"), "-o",
                    str(tmp_path / "c.so")], check=True)
    lib = ctypes.CDLL(str(tmp_path / "c.so"))
    h = np.arange(1 << 16, dtype=np.uint16)
    rng = np.random.default_rng(0)
    f = np.concatenate([rng.standard_normal(1 << 16).astype(np.float32) * 10.0 ** rng.integers(-9, 6, 1 << 16),
                        np.array([np.inf, -np.inf, np.nan, 65520.0, 65519.0, 6e-8, 3e-8, 0.0, -0.0], np.float32)])
    with np.errstate(all="ignore"):
        f = np.concatenate([f, h.view(np.float16).astype(np.float32)]).astype(np.float32)
        want_h = f.astype(np.float16).astype(np.float32)
    hf, bf = np.zeros(len(h), np.float32), np.zeros(len(h), np.float32)
    fh, fb = np.zeros(len(f), np.uint16), np.zeros(len(f), np.uint16)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731
    lib.from16(p(h), p(hf), p(bf), ctypes.c_int(len(h)))
    lib.to16(p(f), p(fh), p(fb), ctypes.c_int(len(f)))
    np.testing.assert_array_equal(hf, h.view(np.float16).astype(np.float32))
    np.testing.assert_array_equal(bf, h.view(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(fh.view(np.float16).astype(np.float32), want_h)
    np.testing.assert_array_equal(fb.view(ml_dtypes.bfloat16).astype(np.float32),
                                  f.astype(ml_dtypes.bfloat16).astype(np.float32))


# ---------------------------------------------------------------------------------------------------------------
# tensor cores: a 16-bit contraction found in the IR renders mma.sync


def _contractions(dtype: str) -> list[Kernel]:
    """Generated (BLAS off) 16-bit matmul kernels: square-ish, ragged edges, batched, transposed B with an
    epilogue, and operands converted inside the kernel (float16 -> bfloat16)."""
    def t(*shape: int, d: str = dtype) -> zyx.Tensor:
        return zyx.Tensor(np.zeros(shape, np.float32)).cast(d).realize()

    with host_without_blas():
        outs = [t(64, 96) @ t(96, 80), t(37, 50) @ t(50, 29), t(3, 33, 40) @ t(3, 40, 24),
                ((t(48, 32) @ t(24, 32).T) * 2).relu(), t(32, 48, d="float16").cast(dtype) @ t(48, 16)]
        found = []
        for o in outs:
            ks = [k for k in kernels_of(o) if k.reduces()]
            assert len(ks) == 1, [k.name for k in ks]
            found.append(ks[0])
    return found


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_contractions_render_mma_sync(dtype):
    for k in _contractions(dtype):
        c = gpu.find_contraction(k)
        assert c is not None and c.dtype.name == dtype and c.k.arg[1] in (96, 50, 40, 32, 48)
        ko = gpu.optimize(k, INFO)
        g = gpu.geometry(ko)
        assert g.strategy == "mma" and g.block == (32, g.groups_per_block, 1) and not ko.wide_acc
        src = CUDARenderer().render(ko).source
        ty = "f16" if dtype == "float16" else "bf16"
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32" in src
        assert "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800" in src and "__shfl_sync(" in src
    # no tensor cores below sm_80, for float32, or for a reduce that is not a product of two loads
    assert gpu.geometry(gpu.optimize(k, gpu.reference_info(arch=(7, 5)))).strategy != "mma"
    assert gpu.find_contraction(ir_rows(64, 64)) is None


@needs_nvrtc
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_kernels_compile_for_sm80_and_sm90(dtype):
    for k in _contractions(dtype):
        cs = render_cuda(k, INFO)
        for arch in ARCHS:
            assert nvrtc.compile_cubin(cs.source, cs.name, arch)[:4] == b"\x7fELF"


@needs_gxx
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_fragments_under_emulation_equal_the_host(dtype, rng):
    """The portable branch exchanges the same fragment registers as mma.sync: the values equal the host's."""
    for k in _contractions(dtype):
        inputs = {i: rng.uniform(-2, 2, p.size).astype(np.float32).astype(p.dtype.np_dtype)
                  for i, p in enumerate(k.params) if p.kind == "in"}
        want, got = run_ir(k, inputs, "host"), run_ir(k, inputs, "cuda")
        for i in want:
            np.testing.assert_allclose(got[i].astype(np.float64), want[i].astype(np.float64), rtol=1e-2, atol=1e-2)
            assert np.mean(got[i] == want[i]) > 0.95  # the same products summed in the same order: (nearly) equal

"""Vector loads and stores of the GPU ``thread`` layout (``gpu.plan_vector``, ``render_cuda``).

A thread computes ``V`` consecutive outputs of the innermost loop; a load or store whose index steps by one along
that loop and is provably 16-byte (or piece-) aligned becomes one vector access (``float4``, ``uint4`` of 8
halves, ``double2`` ...). What is checked:

- the decision, from the IR alone: contiguous leaves vectorize, an offset view (``x[1:]``), a transposed input and
  a broadcast (stride 0) never do, ``x[4:]`` does (the proof is exact, not "any view is scalar");
- the rendered source: the vector helpers for exactly those accesses, a scalar tail when ``V`` does not divide the
  loop; every variant compiles with NVRTC for sm_80 and sm_90;
- the values: on the emulated ``cuda:0`` (256-byte aligned buffers, like ``cuMemAlloc``), with vectorization
  forced on and off, odd shapes, offsets, broadcasts, six dtypes and random fuzz programs equal NumPy; a
  misaligned vector access traps in the emulator as it faults on a GPU.
"""

from __future__ import annotations

import re
import shutil
import warnings

import numpy as np
import pytest
from conftest import compute_devices, gpu_planned, nvrtc_compiles, only_kernel
from conftest import typed_leaf as leaf

import zyx
from zyx.backends.cuda import nvrtc
from zyx.backends.cuda.args import ArgPack
from zyx.backends.cuda.emulator import kernels as emu_kernels
from zyx.kernel import gpu, ir
from zyx.kernel.ir import Kernel, Param, Store
from zyx.kernel.render_cuda import CUDARenderer
from zyx.ops import Ops

INFO = gpu.reference_info()
BIG = 1 << 20  # outputs enough for the heuristic at any width (128 threads per SM of 132 at 16 per thread)
_NVRTC = nvrtc.available()
needs_nvrtc = pytest.mark.skipif(_NVRTC is not None, reason=f"NVRTC unavailable ({_NVRTC}): {nvrtc.INSTALL_HINT}")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")
needs_cuda = pytest.mark.skipif("cuda:0" not in compute_devices(), reason="no cuda:0 (GPU or emulator)")

DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int8"]
VECTOR_TYPE = {"float32": "float4", "float16": "uint4", "bfloat16": "uint4", "float64": "double2", "int32": "int4",
               "int8": "uint4", "int64": "longlong2", "uint8": "uint4", "bool": "uint4"}


def geometry_of(k: Kernel, params: dict[str, int] | None = None) -> gpu.Geometry:
    return gpu.geometry(gpu.optimize(k, INFO, params))


def source_of(k: Kernel, params: dict[str, int] | None = None) -> str:
    return CUDARenderer().render(gpu.optimize(k, INFO, params)).source


def param_of(k: Kernel, size: int) -> int:
    """The index of the one input param with ``size`` elements."""
    (i,) = [i for i, p in enumerate(k.params) if p.kind == "in" and p.size == size]
    return i


def vector_loads(src: str, param: int) -> list[str]:
    return re.findall(rf"zyx_vld_(\w+)\(p{param} ", src)


def vector_stores(src: str, param: int) -> list[str]:
    return re.findall(rf"zyx_vst_(\w+)\(p{param} ", src)


# ---------------------------------------------------------------------------------------------------------------
# the proof


def test_contiguous_aligned_is_exact():
    r, s = ir.range_(0, 1000), ir.range_(1, 64)
    assert gpu.contiguous_aligned(r, r, 4) and gpu.contiguous_aligned(s * 1000 + r + 8, r, 8)
    assert not gpu.contiguous_aligned(r + 1, r, 4)  # x[1:]
    assert gpu.contiguous_aligned(r + 4, r, 4) and not gpu.contiguous_aligned(r + 4, r, 8)
    assert not gpu.contiguous_aligned(s * 1001 + r, r, 2)  # an odd row stride
    assert not gpu.contiguous_aligned(r * 2, r, 4) and not gpu.contiguous_aligned(s, r, 4)  # strided, broadcast
    assert not gpu.contiguous_aligned(-r + 999, r, 4)  # flipped
    assert not gpu.contiguous_aligned(r + (r // 4) * 4, r, 4)  # another atom depends on r
    g = ir.load(2, ir.index_dtype, s)  # a gathered row index times an aligned stride
    assert gpu.contiguous_aligned(g * 64 + r, r, 16) and not gpu.contiguous_aligned(g * 6 + r, r, 4)


def test_vector_pieces():
    assert [gpu.vector_piece(w, 4) for w in (1, 2, 4, 8)] == [0, 8, 16, 16]
    assert [gpu.vector_piece(w, 2) for w in (1, 2, 4, 8, 16)] == [0, 4, 8, 16, 16]
    assert [gpu.vector_piece(w, 1) for w in (2, 4, 16)] == [0, 4, 16]
    assert [gpu.vector_piece(w, 8) for w in (1, 2, 4)] == [0, 16, 16]


# ---------------------------------------------------------------------------------------------------------------
# the decision and the rendered source


@pytest.mark.parametrize("dtype", DTYPES + ["int64", "uint8", "bool"])
def test_contiguous_elementwise_kernel_loads_and_stores_16_byte_vectors(dtype):
    a, b = leaf((BIG,), dtype), leaf((BIG,), dtype)
    k = only_kernel((a | b) if dtype == "bool" else (a + b))
    g = geometry_of(k)
    width = 16 // zyx.dtypes.to_dtype(dtype).itemsize
    assert g.strategy == "thread" and g.vector == width and g.items == BIG // width
    assert len(g.vector_loads) == 2 and g.vector_stores == frozenset({0})
    src = source_of(k)
    want = VECTOR_TYPE[dtype]
    for i in (1, 2):
        assert vector_loads(src, i) == [want]
    assert vector_stores(src, 0) == [want]
    assert "zj" not in src  # BIG is a multiple of the width: no scalar tail
    off = source_of(k, {"vector": 0})
    assert "zyx_vld_" not in off and "zyx_vst_" not in off and geometry_of(k, {"vector": 0}).items == BIG


def test_mixed_widths_take_the_widest_access_as_one_vector():
    """float16 in, float32 out: 4 outputs per thread, a float4 store and an 8-byte load of 4 halves."""
    k = only_kernel(leaf((BIG,), "float16").cast("float32") * 2)
    src = source_of(k)
    assert geometry_of(k).vector == 4 and vector_loads(src, 1) == ["uint2"] and vector_stores(src, 0) == ["float4"]


def test_offset_view_loads_are_scalar_unless_the_offset_is_aligned():
    x, y = leaf((BIG + 8,)), leaf((BIG,))
    k = only_kernel(x[1:BIG + 1] + y)
    src = source_of(k, {"vector": 1})
    ix, iy = param_of(k, BIG + 8), param_of(k, BIG)
    assert vector_loads(src, ix) == [] and vector_loads(src, iy) == ["float4"] and vector_stores(src, 0) == ["float4"]
    k4 = only_kernel(x[4:BIG + 4] + y)  # 16 bytes in: still aligned
    assert vector_loads(source_of(k4), param_of(k4, BIG + 8)) == ["float4"]
    h, hy = leaf((BIG + 8,), "float16"), leaf((BIG,), "float16")
    k8 = only_kernel(h[4:BIG + 4] + hy)  # 8 bytes in: not a 16-byte boundary for 8 halves
    src8 = source_of(k8)
    assert geometry_of(k8).vector == 8 and vector_loads(src8, param_of(k8, BIG + 8)) == []
    assert vector_loads(src8, param_of(k8, BIG)) == ["uint4"]


def test_transposed_input_is_read_by_scalar_loads():
    """In the ``thread`` layout (the heuristic stages this read in shared tiles, ``tile``)."""
    x = leaf((1024, 1024))
    k = only_kernel(x.T + 1.0)
    src = source_of(k, {"vector": 1, "strategy": gpu.STRATEGIES.index("thread")})
    assert vector_loads(src, 1) == [] and vector_stores(src, 0) == ["float4"]


def test_broadcast_inputs_are_never_vector_loads():
    """Stride 0 along the innermost loop (a column (R, 1) expanded along the rows) is read once per run of
    outputs, never as a vector; a row (C,) broadcast down the rows steps by one along the loop and is one."""
    rows, cols = 1000, 1024
    col, mat, row = leaf((rows, 1)), leaf((rows, cols)), leaf((cols,))
    k = only_kernel(col + mat * row)
    g = geometry_of(k)
    src = source_of(k)
    ic, im, ir_ = param_of(k, rows), param_of(k, rows * cols), param_of(k, cols)
    assert g.vector == 4 and {ld.arg for ld in g.vector_loads} == {im, ir_}
    assert vector_loads(src, ic) == [] and vector_loads(src, im) == vector_loads(src, ir_) == ["float4"]
    assert src.count(f"p{ic}[") == 1  # hoisted out of the lanes; no tail (1024 is a multiple of 4)
    expanded = only_kernel(leaf((rows,)).reshape(rows, 1).expand(rows, cols) + 0.0)
    ge = geometry_of(expanded, {"vector": 1})
    assert not ge.vector_loads and ge.vector_stores == frozenset({0})


def test_odd_sizes_get_a_scalar_tail():
    n = BIG + 3
    k = only_kernel(leaf((n,)) * 3.0)
    src = source_of(k)
    g = geometry_of(k)
    assert g.vector == 4 and g.items == -(-n // 4)
    assert re.search(rf"if \(r\d+ \+ 4 <= {n}\) {{", src) and f"zj < {n}; zj++" in src
    # rows of an odd length: only the row broadcast is aligned; forced on, the runs of each row end in a tail
    rows, cols = 300, 1001
    kb = only_kernel(leaf((rows, cols)) + leaf((cols,)))
    assert geometry_of(kb).vector == 1  # the heuristic: 4 of 12 bytes per output would be vectors
    gb = geometry_of(kb, {"vector": 1})
    assert gb.vector == 4 and {ld.arg for ld in gb.vector_loads} == {param_of(kb, cols)} and not gb.vector_stores
    assert gb.items == rows * -(-cols // 4)


def test_runs_cover_every_output_and_huge_kernels_index_in_64_bits():
    """A work item is a run of ``V`` outputs: ``ceil(n / V)`` of them; the grid is capped and strides over the
    rest; past int32 the run's first index and the lanes' are ``long long``."""
    f32 = zyx.dtypes.float32
    for n in (10**6, 10**6 + 1, 1 << 40):
        i = ir.range_(0, n)
        k = Kernel("ew", (Param("p0", f32, "out", n), Param("p1", f32, "in", n)), (i,),
                   (Store(0, i, ir.alu(Ops.MUL, ir.load(1, f32, i), ir.const(2.0, f32))),))
        g = geometry_of(k)
        assert g.vector == 4 and g.items == -(-n // 4) and g.block == (256, 1, 1)
        assert g.grid[0] == min(-(-g.items // 256), INFO.max_global_work[0])
    src = source_of(k)
    assert "for (long long zi =" in src and re.search(r"const long long r\d+ = \(long long\)\(zi\) \* 4;", src)
    assert "const long long r0 = " in src


def test_heuristic_and_search_space():
    small = only_kernel(leaf((1000,)) + 1.0)
    assert geometry_of(small).vector == 1 and geometry_of(small, {"vector": 1}).vector == 4
    assert gpu.search_space(small, INFO)["vector"] == (0, 1)
    big = only_kernel(leaf((BIG,)) + 1.0)
    assert gpu.search_space(big, INFO)["vector"] == (1, 0)
    unaligned = only_kernel(leaf((301, 1001)).T + 1.0)  # neither the load nor the store can be proven
    assert "vector" not in gpu.search_space(unaligned, INFO) and geometry_of(unaligned, {"vector": 1}).vector == 1
    reduce = only_kernel(leaf((BIG // 64, 64)).sum(1))
    assert "vector" not in gpu.search_space(reduce, INFO) and geometry_of(reduce, {"vector": 1}).vector == 1
    gated = only_kernel(leaf((BIG,))[::-1] + 1.0)  # a flip: coefficient -1
    assert not geometry_of(gated, {"vector": 1}).vector_loads


def test_concatenated_segments_vectorize_each_piece():
    a, b = leaf((BIG,)), leaf((BIG // 2,))
    k = only_kernel(zyx.cat([a, b]) * 2.0)
    ko = gpu.optimize(k, INFO)
    parts = (ko, *ko.then)
    if len(parts) == 1:
        pytest.skip("cat was not split into segments")
    assert all(gpu.geometry(p).vector == 4 for p in parts)
    assert gpu.search_space(k, INFO)["vector"] == (1, 0)
    src = CUDARenderer().render(ko).source
    assert src.count("zyx_vst_float4(p0 ") == len(parts)


# ---------------------------------------------------------------------------------------------------------------
# every variant compiles


def _variants() -> list[Kernel]:
    out = []
    for dtype in DTYPES + ["int64", "uint8"]:
        out.append(only_kernel(leaf((4096,), dtype) + leaf((4096,), dtype)))
        out.append(only_kernel(leaf((64, 36), dtype) + leaf((36,), dtype)))  # rows of 36: 4 but not 8 aligned
        out.append(only_kernel(leaf((1003,), dtype) * leaf((1003,), dtype)))  # a tail
    out.append(only_kernel(leaf((4096,), "float16").cast("float32")))
    out.append(only_kernel(leaf((4096,), "bool") | leaf((4096,), "bool")))
    out.append(only_kernel(leaf((4096,)) < leaf((4096,))))
    return out


@needs_nvrtc
def test_every_vector_variant_compiles_for_sm80_and_sm90():
    sources = [CUDARenderer().render(gpu.optimize(k, INFO, params)).source
               for k in _variants() for params in ({}, {"vector": 1}, {"vector": 0})]
    nvrtc_compiles(sources)


# ---------------------------------------------------------------------------------------------------------------
# the emulator checks alignment


@needs_gxx
def test_a_misaligned_vector_access_traps_under_emulation():
    """The renderer's vector helpers trap off the GPU when an address is not aligned (the GPU faults with
    "misaligned address"): a buffer 4 bytes off a 16-byte boundary is refused, an aligned one runs."""
    n = 1024
    k = only_kernel(leaf((n,)) * 2.0)
    cs = CUDARenderer().render(gpu.optimize(k, INFO, {"vector": 1}))
    assert "zyx_vld_float4" in cs.source
    fn = emu_kernels.compile_module(cs.source).functions[cs.name]
    raw = np.zeros(n + 128, np.float32)  # room for the 0..63-element shift to 256 bytes, plus 16
    start = (-raw.ctypes.data % 256) // 4  # a 256-byte aligned element, as the pool's
    src = raw[start + 16:start + 16 + n]
    src[:] = np.arange(n, dtype=np.float32)
    out_raw = np.zeros(n + 64, np.float32)
    ostart = (-out_raw.ctypes.data % 256) // 4

    def run(src_addr: int) -> object:
        out = out_raw[ostart:ostart + n]
        pack = ArgPack(2).fill([None, None], [out.ctypes.data, src_addr])
        return fn.run([pack.slot(i)[:m] for i, m in enumerate(fn.param_sizes)], (1, 1, 1), cs.block)

    assert run(src.ctypes.data) is None
    np.testing.assert_array_equal(out_raw[ostart:ostart + n], np.arange(n, dtype=np.float32) * 2)
    fault = run(src.ctypes.data + 4)
    assert fault is not None and "trap" in str(fault)


# ---------------------------------------------------------------------------------------------------------------
# values on the emulated cuda:0, vectorization forced on and off


def forced_vector(on: int):
    """Within the block every GPU kernel is planned with ``vector = on``; yields the geometries planned."""
    return gpu_planned({"vector": on})


def _data(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Small integers: exact in every dtype here (bfloat16 included), so results compare bit for bit."""
    return rng.integers(-20, 21, shape).astype(np.float64)


def _on_device(x: np.ndarray, dtype: str) -> zyx.Tensor:
    return zyx.Tensor(x.astype(np.float32), device="cuda:0").cast(dtype).realize()


def _cases(dtype: str) -> list[tuple[str, object, object, list[tuple[int, ...]]]]:
    """(name, zyx function, NumPy function in float64, input shapes)."""
    return [
        ("odd 1-D", lambda a, b: a + b * 2, lambda a, b: a + b * 2, [(1003,), (1003,)]),
        ("offset views", lambda a, b: a[1:1001] + b[4:1004] - a[4:1004],
         lambda a, b: a[1:1001] + b[4:1004] - a[4:1004], [(1010,), (1010,)]),
        ("broadcasts", lambda c, m, r: c + m * 3 + r, lambda c, m, r: c + m * 3 + r, [(37, 1), (37, 36), (36,)]),
        ("odd rows", lambda m, r: m - r, lambda m, r: m - r, [(13, 35), (35,)]),
        ("transposed", lambda m, n: m.T + n, lambda m, n: m.T + n, [(24, 40), (40, 24)]),
        ("expanded", lambda v, m: v.reshape(40, 1).expand(40, 64) + m, lambda v, m: v.reshape(40, 1) + m,
         [(40,), (40, 64)]),
        ("cast out", lambda a: (a * 2).cast("float32"), lambda a: a * 2, [(2050,)]),
        ("cast in", lambda a: a.cast("float32").cast(dtype) + a, lambda a: a + a, [(1000,)]),
        ("compare", lambda a, b: a[4:] < b[:-4], lambda a, b: a[4:] < b[:-4], [(1029,), (1029,)]),
    ]


@needs_cuda
@pytest.mark.parametrize("dtype,on", [(d, 1) for d in DTYPES] + [("float32", 0), ("float16", 0)],
                         ids=lambda v: {1: "on", 0: "off"}.get(v, v) if isinstance(v, int) else v)
def test_emulated_results_equal_numpy(dtype, on, rng):
    """Forced on for every dtype; forced off (the scalar layout the rest of the suite runs by default) for two."""
    with forced_vector(on) as seen:
        for name, f, ref, shapes in _cases(dtype):
            xs = [_data(rng, s) for s in shapes]
            got = f(*[_on_device(x, dtype) for x in xs]).realize()  # its own kernel (a bool result: stored)
            want = ref(*xs)
            if got.dtype.name in ("int8", "bool"):
                g, want = got.numpy(), want.astype(got.dtype.name)
            else:  # read back through a cast kernel: vector loads of the result
                g = got.cast("float64").numpy()
            np.testing.assert_array_equal(g, want, err_msg=f"{dtype} {name} vector={on}")
    widths = {g.vector for g in seen if g.strategy == "thread"}
    if on:
        assert max(widths) > 1
    else:
        assert widths == {1}


@needs_cuda
@pytest.mark.filterwarnings("ignore:The recursion limit will not be reset")
def test_fuzz_programs_with_vectors_forced_on():
    """The differential fuzzer's random programs (views, broadcasts, dtypes) on cuda:0 with every provable
    access vectorized."""
    hypothesis = pytest.importorskip("hypothesis")
    from fuzz_programs import compare, programs, run_zyx

    @hypothesis.settings(max_examples=50, deadline=None, derandomize=True, database=None,
                         phases=(hypothesis.Phase.generate,),
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(prog=programs())
    def check(prog) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = run_zyx(prog, "cuda:0")
        errors = [f"v{i}: {m}" for i, g in zip(prog.outputs, got) if (m := compare(np.asarray(g), prog.vals[i]))]
        assert not errors, prog.source("cuda:0") + "\n" + "\n".join(errors)

    with forced_vector(1) as seen:
        check()
    assert any(g.vector > 1 for g in seen)

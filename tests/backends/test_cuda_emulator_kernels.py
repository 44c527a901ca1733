"""CUDA C kernels on the CPU (``zyx.backends.cuda.emulator.kernels``): geometry, barriers and warp collectives,
parameter passing, concurrency, faults, compile errors. zyx-rendered kernels run on it in the op-parity tests on
the emulated ``cuda:0`` and in ``tests/kernel/test_cuda_codegen.py``."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the CUDA emulator needs g++")

from zyx.backends.cuda.emulator.kernels import (  # noqa: E402
    EmulatedModule,
    EmulatorCompileError,
    Fault,
    compile_module,
)

PAGE = mmap.PAGESIZE


def ptr(a: np.ndarray) -> bytes:
    return struct.pack("<Q", a.ctypes.data)


def i32(v: int) -> bytes:
    return struct.pack("<i", v)


KERNELS = r"""
extern "C" __global__ void __launch_bounds__(128) saxpy(float* __restrict__ y, const float* __restrict__ x,
                                                        float a, int n, int* __restrict__ seen) {
  if (threadIdx.x == 0) seen[blockIdx.x] += 1;  // every block of the grid runs, once
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = a * x[i] + y[i];
}

// one block per row; 1024 threads: strided partial sums, a warp shuffle tree, then the warps via shared memory
extern "C" __global__ void row_sums(double* out, const float* x, int cols) {
  __shared__ double partial[32];
  double acc = 0.0;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) acc += x[(long long)blockIdx.x * cols + j];
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    double s = 0.0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += partial[w];
    out[blockIdx.x] = s;
  }
}

__device__ __forceinline__ long long linear_thread() {
  return threadIdx.x + (long long)blockDim.x * (threadIdx.y + (long long)blockDim.y * threadIdx.z);
}
__device__ long long linear_block() {
  return blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
}
__global__ void where_2d(int4* out) {  // (x, y, z) of the thread and the block
  long long t = linear_thread(), b = linear_block();
  long long n = (long long)blockDim.x * blockDim.y * blockDim.z;
  out[2 * (b * n + t)] = make_int4(threadIdx.x, threadIdx.y, threadIdx.z, blockDim.x * 100 + blockDim.y);
  out[2 * (b * n + t) + 1] = make_int4(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x * 100 + gridDim.y);
}
__global__ void where_2d_synced(int4* out) {  // the same with fibers (a barrier)
  long long t = linear_thread(), b = linear_block();
  long long n = (long long)blockDim.x * blockDim.y * blockDim.z;
  __syncthreads();
  out[2 * (b * n + t)] = make_int4(threadIdx.x, threadIdx.y, threadIdx.z, blockDim.x * 100 + blockDim.y);
  __syncthreads();
  out[2 * (b * n + t) + 1] = make_int4(blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x * 100 + gridDim.y);
}

__global__ void scalars(unsigned char* out, int i, float f, double d, long long ll, bool b, unsigned short us,
                        const char c, size_t z) {
  if (threadIdx.x != 0) return;
  memcpy(out, &i, 4); memcpy(out + 4, &f, 4); memcpy(out + 8, &d, 8); memcpy(out + 16, &ll, 8);
  out[24] = b ? 1 : 0; memcpy(out + 25, &us, 2); out[27] = (unsigned char)c; memcpy(out + 28, &z, 8);
}

__global__ void shared_tag(int* bad, int tag) {  // counts reads of shared memory someone else wrote
  __shared__ int sh[256];
  for (int r = 0; r < 16; r++) {
    int mine = tag * 100000 + blockIdx.x * 100 + r;
    sh[threadIdx.x] = mine;
    __syncthreads();
    if (sh[(threadIdx.x + 1) % blockDim.x] != mine) atomicAdd(bad, 1);
    __syncthreads();
  }
}

__global__ void write_all(float* p, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = 1.0f;
}
__global__ void write_all_synced(float* p, int n) {
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) p[i] = 2.0f;
  __syncthreads();
}
__global__ void divide(int* out, int d) { out[threadIdx.x] = 1000 / (d - (int)threadIdx.x); }
__global__ void divergent(float* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1.0f;
}
__global__ void early_exit_shuffle(float* out) {
  if (threadIdx.x == 3) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}
__global__ void partial_mask(float* out) { out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, 1.0f, 1); }
__global__ void trapping(float* out) {
  out[threadIdx.x] = 1.0f;
  if (blockIdx.x == 1 && threadIdx.x == 7) __trap();
}
__device__ int recurse(volatile char* prev, int depth) {
  volatile char big[4096];
  big[0] = prev ? prev[0] + 1 : 0;
  return depth == 0 ? big[0] : recurse(big, depth - 1);
}
__global__ void stack_overflow(int* out) {
  __syncthreads();
  out[threadIdx.x] = recurse(0, 64);  // 256 KiB of frames on a 64 KiB fiber stack
}
"""

WARP = r"""
__global__ void warp_ops(int* out, const int* x) {
  int t = threadIdx.x, v = x[t];
  int* o = out + 8 * t;
  o[0] = __shfl_down_sync(0xffffffffu, v, 3);
  o[1] = __shfl_up_sync(0xffffffffu, v, 5);
  o[2] = __shfl_sync(0xffffffffu, v, 7);
  o[3] = __shfl_xor_sync(0xffffffffu, v, 5, 8);  // within groups of 8 lanes
  o[4] = (int)__ballot_sync(0xffffffffu, v & 1);
  o[5] = __any_sync(0xffffffffu, v == 77) + 2 * __all_sync(0xffffffffu, v >= 0);
  __syncwarp();
  o[6] = __syncthreads_count(v & 1);
  o[7] = __reduce_add_sync(0xffffffffu, v);
}

extern "C" __global__ void dynamic_shared(float* out) {
  extern __shared__ float buf[];
  buf[threadIdx.x] = (float)threadIdx.x;
  __syncthreads();
  out[blockIdx.x * blockDim.x + threadIdx.x] = buf[blockDim.x - 1 - threadIdx.x] + (float)blockIdx.x;
}

extern __shared__ __align__(16) unsigned char smem[];  // at file scope: the same bytes
extern "C" __global__ void dynamic_shared_bytes(int* out) {
  int* words = (int*)smem;
  if (threadIdx.x == 0) out[blockIdx.x] = words[1];  // zeroed at launch
  __syncthreads();
  words[threadIdx.x] = (int)(threadIdx.x * 3 + blockIdx.x);
}

__global__ void atomics(float* f, int* i, unsigned long long* u, double* d) {
  atomicAdd(f, 0.5f);
  atomicAdd(i, 2);
  atomicAdd(u, 3ull);
  atomicAdd(d, 0.25);
  atomicMax(i + 1, (int)(blockIdx.x * blockDim.x + threadIdx.x));
}
"""

BARRIERS = r"""
__global__ void barrier_rounds(float* out, int rounds) {
  __shared__ float sh[2][1024];  // double-buffered: one barrier a round
  float v = threadIdx.x;
  for (int k = 0; k < rounds; k++) {
    sh[k & 1][threadIdx.x] = v;
    __syncthreads();
    v = sh[k & 1][(threadIdx.x + 1) % blockDim.x];
  }
  out[threadIdx.x] = v;
}
"""


@pytest.fixture(scope="module")
def mod() -> EmulatedModule:
    return compile_module(KERNELS)


@pytest.fixture(scope="module")
def warp_mod() -> EmulatedModule:
    return compile_module(WARP)


def test_module_lists_kernels_and_parameter_sizes(mod):
    assert mod.functions["saxpy"].param_sizes == (8, 8, 4, 4, 8)
    assert mod.functions["scalars"].param_sizes == (8, 4, 4, 8, 8, 1, 2, 1, 8)
    assert mod.functions["where_2d"].param_sizes == (8,)
    assert not mod.functions["saxpy"].uses_fibers and mod.functions["row_sums"].uses_fibers
    assert compile_module(KERNELS) is mod  # the in-process cache


def test_the_block_runners_are_compiled_once_not_per_module_and_each_wrapper_names_its_runner(mod):
    from zyx.backends.cuda.emulator import kernels

    for runner in ("run_fibers", "run_plain", "run_block", "fiber_main"):
        assert runner in kernels._RUNNERS and runner not in kernels._HEADER, runner
    wrappers = mod.path.with_suffix(".cpp").read_text().partition('#line 1 "zyx_emu_wrappers"')[2]
    for i, f in enumerate(mod.functions.values()):
        call = f"zyx_emu::launch({'true' if f.uses_fibers else 'false'}, &zyx_emu::tramp<"
        assert call in wrappers.split(f"zyx_emu_launch_{i}(")[1].split("\n}")[0], f.name


def test_signatures_are_parsed():
    src = r"""
// __global__ void in_a_comment(int x) {}
__global__ void declared_first(float* p, unsigned);
template <int N> __global__ void a_template(float* p) { p[0] = N; }  // not launchable: skipped
extern "C" {
__global__ void __launch_bounds__(128, 4) in_block(const float* const __restrict__ p, long long n, double) {}
}
__global__ void declared_first(float* p, unsigned k) { const char* s = "__global__ void no("; p[0] = k + s[0]; }
static __global__ void vectors(float4 v, int2 w, short s, unsigned char c) {}
__device__ int counter = 5;
"""
    m = compile_module(src)
    assert {k: f.param_sizes for k, f in m.functions.items()} == {
        "in_block": (8, 8, 8), "declared_first": (8, 4), "vectors": (16, 8, 2, 1)}
    out = np.zeros(1, np.float32)
    assert m.functions["declared_first"].run([ptr(out), i32(5)], (1, 1, 1), (1, 1, 1)) is None
    assert out[0] == 5 + ord("_")
    assert ctypes.c_int.from_address(m.global_address("counter")).value == 5
    assert m.global_address("no_such_variable") is None


def test_elementwise_grid_stride_over_every_block(mod, rng):
    n = 10_007  # not a multiple of the block
    x, y0 = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    for blocks in (1, 7, 79, 300):  # fewer threads than items (the loop wraps), and more
        y, seen = y0.copy(), np.zeros(blocks, np.int32)
        assert mod.functions["saxpy"].run([ptr(y), ptr(x), struct.pack("<f", 1.5), i32(n), ptr(seen)],
                                          (blocks, 1, 1), (128, 1, 1)) is None
        np.testing.assert_array_equal(y, np.float32(1.5) * x + y0)
        np.testing.assert_array_equal(seen, 1)


def test_block_reduction_1024_threads(mod, rng):
    rows, cols = 5, 3001
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    out = np.zeros(rows, np.float64)
    assert mod.functions["row_sums"].run([ptr(out), ptr(x), i32(cols)], (rows, 1, 1), (1024, 1, 1)) is None
    np.testing.assert_allclose(out, x.astype(np.float64).sum(1), rtol=1e-12, atol=1e-12)
    small = np.zeros(rows, np.float64)  # 64 threads: two warps
    assert mod.functions["row_sums"].run([ptr(small), ptr(x), i32(cols)], (rows, 1, 1), (64, 1, 1)) is None
    np.testing.assert_allclose(small, out, rtol=1e-12)


@pytest.mark.parametrize("name", ["where_2d", "where_2d_synced"])
def test_2d_and_3d_blocks_and_grids(mod, name):
    grid, block = (3, 5, 2), (16, 4, 2)
    nb, nt = 3 * 5 * 2, 16 * 4 * 2
    out = np.full((nb, nt, 2, 4), -1, np.int32)
    assert mod.functions[name].run([ptr(out)], grid, block) is None
    bz, by, bx, tz, ty, tx = np.meshgrid(*(np.arange(d) for d in (2, 5, 3, 2, 4, 16)), indexing="ij")
    want_t = np.stack([tx, ty, tz, np.full_like(tx, 1604)], -1).reshape(nb, nt, 4)
    want_b = np.stack([bx, by, bz, np.full_like(bx, 305)], -1).reshape(nb, nt, 4)
    np.testing.assert_array_equal(out[:, :, 0], want_t)
    np.testing.assert_array_equal(out[:, :, 1], want_b)


def test_scalar_parameters_arrive_bit_exactly(mod):
    f_bits = 0x7FC01234  # a NaN with a payload
    vals = [i32(-123456789), struct.pack("<I", f_bits), struct.pack("<d", -0.0), struct.pack("<q", -(2**62) - 5),
            b"\x01", struct.pack("<H", 0xBEEF), b"\xfe", struct.pack("<Q", 2**63 + 9)]
    out = np.zeros(64, np.uint8)
    assert mod.functions["scalars"].run([ptr(out), *vals], (1, 1, 1), (32, 1, 1)) is None
    got = out.tobytes()
    assert got[:24] == vals[0] + vals[1] + vals[2] + vals[3]
    assert got[24:28] == b"\x01" + vals[5] + b"\xfe"
    assert got[28:36] == vals[7]


def test_parameter_and_geometry_checks(mod):
    k = mod.functions["write_all"]
    out = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="parameters"):
        k.run([ptr(out)], (1, 1, 1), (1, 1, 1))
    with pytest.raises(ValueError, match="4 bytes"):
        k.run([ptr(out), b"\0\0"], (1, 1, 1), (1, 1, 1))
    for grid, block in (((0, 1, 1), (1, 1, 1)), ((1, 1, 1), (1, 0, 1)), ((1, 1, 1), (1024, 2, 1)),
                        ((1, 1, 1), (1, 1, 65)), ((1, 70000, 1), (1, 1, 1))):
        with pytest.raises(ValueError, match="invalid launch geometry"):
            k.run([ptr(out), i32(4)], grid, block)
    with pytest.raises(ValueError, match="shared memory"):
        k.run([ptr(out), i32(4)], (1, 1, 1), (1, 1, 1), shared_bytes=1 << 30)


def test_concurrent_launches_keep_shared_memory_per_thread(mod, rng):
    rows, cols = 3, 2000
    data = [rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(4)]
    errors: list[str] = []

    def work(k: int) -> None:
        x = data[k]
        want = x.astype(np.float64).sum(1)
        for r in range(6):
            bad = np.zeros(1, np.int32)
            f = mod.functions["shared_tag"].run([ptr(bad), i32(k + 1)], (24, 1, 1), (256, 1, 1))
            if f is not None or bad[0] != 0:
                errors.append(f"thread {k}: {f}, {bad[0]} reads of another launch's shared memory")
            out = np.zeros(rows, np.float64)
            f = mod.functions["row_sums"].run([ptr(out), ptr(x), i32(cols)], (rows, 1, 1), (256, 1, 1))
            if f is not None or not np.allclose(out, want, rtol=1e-12):
                errors.append(f"thread {k}: {f} {out} != {want}")
            if r == 2:  # faults on this thread (plain and fiber kernels) leave it working
                bad = mod.functions["write_all_synced"].run([struct.pack("<Q", 64), i32(8)], (1, 1, 1), (32, 1, 1))
                div = mod.functions["divide"].run([ptr(np.zeros(64, np.int32)), i32(0)], (1, 1, 1), (64, 1, 1))
                if bad is None or bad.kind != "address" or div is None or div.kind != "arithmetic":
                    errors.append(f"thread {k}: {bad} {div}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for _ in range(3):  # threads that ran kernels end cleanly (their stacks and signal stack are released)
        t = threading.Thread(target=work, args=(0,))
        t.start()
        t.join()
    assert not errors, errors


@pytest.fixture
def guarded():
    """Two pages; the second is PROT_NONE. Yields (address, number of floats up to the guard page)."""
    m = mmap.mmap(-1, 2 * PAGE)
    view = ctypes.c_char.from_buffer(m)
    addr = ctypes.addressof(view)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(addr + PAGE, PAGE, 0) == 0
    yield addr
    libc.mprotect(addr + PAGE, PAGE, mmap.PROT_READ | mmap.PROT_WRITE)
    del view
    m.close()


@pytest.mark.parametrize("name", ["write_all", "write_all_synced"])
def test_illegal_address_is_a_fault_and_the_process_goes_on(mod, guarded, name):
    f = mod.functions[name].run([struct.pack("<Q", guarded), i32(2 * PAGE // 4)], (2, 1, 1), (64, 1, 1))
    assert isinstance(f, Fault) and f.kind == "address", f
    assert guarded + PAGE <= f.address < guarded + 2 * PAGE
    assert "block (0, 0, 0)" in f.detail
    ok = np.zeros(PAGE // 4, np.float32)  # the same kernel, and others, still run
    assert mod.functions[name].run([ptr(ok), i32(ok.size)], (2, 1, 1), (64, 1, 1)) is None
    assert (ok > 0).all()
    assert mod.functions["saxpy"].run([ptr(ok), ptr(ok), struct.pack("<f", 1.0), i32(ok.size),
                                       ptr(np.zeros(1, np.int32))], (1, 1, 1), (128, 1, 1)) is None


def test_integer_division_by_zero_is_an_arithmetic_fault(mod):
    out = np.zeros(64, np.int32)
    f = mod.functions["divide"].run([ptr(out), i32(40)], (1, 1, 1), (64, 1, 1))
    assert f is not None and f.kind == "arithmetic" and f.address == 0
    assert "thread (40, 0, 0)" in f.detail
    assert mod.functions["divide"].run([ptr(out), i32(100)], (1, 1, 1), (64, 1, 1)) is None
    np.testing.assert_array_equal(out, 1000 // (100 - np.arange(64)))


@pytest.mark.parametrize("name", ["divergent", "early_exit_shuffle"])
def test_divergent_barrier_is_a_deadlock(mod, name):
    out = np.zeros(64, np.float32)
    f = mod.functions[name].run([ptr(out)], (3, 1, 1), (64, 1, 1))
    assert f is not None and f.kind == "deadlock", f
    assert "block (0, 0, 0)" in f.detail


def test_partial_warp_mask_is_refused(mod):
    f = mod.functions["partial_mask"].run([ptr(np.zeros(32, np.float32))], (1, 1, 1), (32, 1, 1))
    assert f is not None and f.kind == "trap" and "mask" in f.detail


def test_trap_stops_the_launch(mod):
    out = np.zeros(3 * 32, np.float32)
    f = mod.functions["trapping"].run([ptr(out)], (3, 1, 1), (32, 1, 1))
    assert f == Fault("trap", 0, f.detail) and "__trap" in f.detail and "block (1, 0, 0) thread (7, 0, 0)" in f.detail


def test_fiber_stack_overflow_hits_the_guard_page(mod):
    f = mod.functions["stack_overflow"].run([ptr(np.zeros(64, np.int32))], (1, 1, 1), (64, 1, 1))
    assert f is not None and f.kind == "address", f
    out = np.zeros(64, np.float32)
    assert mod.functions["write_all_synced"].run([ptr(out), i32(64)], (1, 1, 1), (64, 1, 1)) is None


def test_warp_collectives(warp_mod, rng):
    x = rng.integers(0, 100, 64).astype(np.int32)
    x[40] = 77
    out = np.zeros((64, 8), np.int32)
    assert warp_mod.functions["warp_ops"].run([ptr(out), ptr(x)], (1, 1, 1), (64, 1, 1)) is None
    lane, base = np.arange(64) % 32, np.arange(64) // 32 * 32
    np.testing.assert_array_equal(out[:, 0], x[np.where(lane + 3 < 32, np.arange(64) + 3, np.arange(64))])
    np.testing.assert_array_equal(out[:, 1], x[np.where(lane >= 5, np.arange(64) - 5, np.arange(64))])
    np.testing.assert_array_equal(out[:, 2], x[base + 7])
    np.testing.assert_array_equal(out[:, 3], x[base + (lane // 8 * 8) + ((lane % 8) ^ 5)])
    bits = (x & 1).reshape(2, 32)
    ballots = (bits.astype(np.int64) << np.arange(32)).sum(1).astype(np.uint32).view(np.int32)
    np.testing.assert_array_equal(out[:, 4], np.repeat(ballots, 32))
    np.testing.assert_array_equal(out[:, 5], np.repeat([0 + 2, 1 + 2], 32))
    np.testing.assert_array_equal(out[:, 6], (x & 1).sum())
    np.testing.assert_array_equal(out[:, 7], np.repeat(x.reshape(2, 32).sum(1), 32))


def test_dynamic_shared_memory(warp_mod):
    out = np.zeros((4, 96), np.float32)
    assert warp_mod.functions["dynamic_shared"].run([ptr(out)], (4, 1, 1), (96, 1, 1), shared_bytes=96 * 4) is None
    np.testing.assert_array_equal(out, np.arange(95, -1, -1, dtype=np.float32)[None, :] + np.arange(4)[:, None])
    for _ in range(2):  # each launch starts from zeroed dynamic shared memory (later blocks: undefined)
        seen = np.full(3, -1, np.int32)
        k = warp_mod.functions["dynamic_shared_bytes"]
        assert k.run([ptr(seen)], (3, 1, 1), (8, 1, 1), shared_bytes=64) is None
        assert seen[0] == 0


def test_atomics(warp_mod):
    f, i, u, d = (np.zeros(1, np.float32), np.zeros(2, np.int32), np.zeros(1, np.uint64), np.zeros(1, np.float64))
    assert warp_mod.functions["atomics"].run([ptr(f), ptr(i), ptr(u), ptr(d)], (5, 1, 1), (40, 1, 1)) is None
    assert (f[0], i[0], u[0], d[0], i[1]) == (100.0, 400, 600, 50.0, 199)


def test_compile_errors_name_the_kernel():
    with pytest.raises(EmulatorCompileError) as ei:
        compile_module('extern "C" __global__ void broken_kernel(float* p) { p[0] = nope; }\n')
    msg = str(ei.value)
    assert "broken_kernel" in msg and "nope" in msg and "error" in msg and ".cpp" in msg
    with pytest.raises(EmulatorCompileError, match="odd_params.*parameter 1"):
        compile_module("struct S { int a; };\n__global__ void odd_params(float* p, S s) {}\n")


MATH = r"""
#include <cuda_fp16.h>
__global__ void overloads(double* out, float x, double d, int i, __half h) {
  int n = 0, e;
  out[n++] = sizeof(sqrt(x)); out[n++] = sqrt(x); out[n++] = sizeof(sqrt(i)); out[n++] = sqrt(i);
  out[n++] = sizeof(pow(x, x)); out[n++] = sizeof(pow(x, d)); out[n++] = sizeof(pow(x, 2)); out[n++] = pow(x, 2);
  out[n++] = sizeof(abs(x)); out[n++] = abs(-x); out[n++] = abs(-i); out[n++] = abs(-3LL); out[n++] = abs(-d);
  out[n++] = isnan(x); out[n++] = isnan(d / 0.0 * 0.0); out[n++] = isinf(1.0f / (x - x)); out[n++] = isfinite(i);
  out[n++] = signbit(-x); out[n++] = ::isnan(x); out[n++] = sizeof(fma(x, x, x)); out[n++] = sizeof(sqrt(h));
  out[n++] = sqrt(h); out[n++] = fmax(x, d); out[n++] = sizeof(fmin(x, 1)); out[n++] = lround(x); out[n++] = ilogb(8);
  out[n++] = frexp(x, &e); out[n++] = e; out[n++] = fpclassify(x) == FP_NORMAL; out[n++] = M_PI;
  out[n++] = sizeof(exp(x)); out[n++] = exp(1);
}
"""


def test_math_overloads_resolve_as_cmath_does():
    """The runtime header takes C's <math.h> (not libstdc++'s <cmath>: ~20 ms less per module) and adds the C++
    overloads itself; each call below gives what it gave with <cmath> (recorded from that header)."""
    out = np.zeros(32)
    args = [ptr(out), struct.pack("f", 2.0), struct.pack("d", 3.0), i32(9), struct.pack("H", 0x4400)]  # h = 4.0
    assert compile_module(MATH).functions["overloads"].run(args, (1, 1, 1), (1, 1, 1)) is None
    want = [4, np.float32(np.sqrt(np.float32(2))), 8, 3, 4, 8, 8, 4, 4, 2, 9, 3, 3, 0, 1, 1, 1, 1, 0, 4, 4, 2, 3, 8, 2,
            3, 0.5, 2, 1, np.pi, 4, np.e]
    assert out.tolist() == [float(w) for w in want]


def test_libraries_link_without_the_driver_unless_they_need_its_crt_files(tmp_path, monkeypatch):
    """``_build`` links with the linker alone (its libc and libm symbols resolve from the process at load); a
    library that then does not load (a thread_local with a destructor needs the crt's ``__dso_handle``) is linked
    through the g++ driver."""
    from zyx.backends.cuda.emulator import kernels

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    direct = []
    real = kernels._link_direct
    monkeypatch.setattr(kernels, "_link_direct", lambda obj, out: direct.append(real(obj, out)) or direct[-1])
    plain = kernels._build('#include <math.h>\nextern "C" double f(double x) { return sin(x) + 1; }', "t", False)
    assert direct == [True]
    f = ctypes.CDLL(str(plain)).f
    f.argtypes, f.restype = [ctypes.c_double], ctypes.c_double
    assert f(0.5) == np.sin(0.5) + 1
    crt = kernels._build('struct D { int v = 7; ~D() { v = 0; } };\nstatic thread_local D d;\n'
                         'extern "C" int g(void) { return d.v; }', "t", False)
    assert direct == [True, False]
    assert ctypes.CDLL(str(crt)).g() == 7


def test_ucontext_fallback(monkeypatch, rng):
    monkeypatch.setenv("ZYX_CUDA_EMULATOR_UCONTEXT", "1")
    m = EmulatedModule(KERNELS)  # not compile_module: the flags differ
    x = rng.standard_normal((2, 700)).astype(np.float32)
    out = np.zeros(2, np.float64)
    assert m.functions["row_sums"].run([ptr(out), ptr(x), i32(700)], (2, 1, 1), (128, 1, 1)) is None
    np.testing.assert_allclose(out, x.astype(np.float64).sum(1), rtol=1e-12)
    assert m.functions["divergent"].run([ptr(np.zeros(64, np.float32))], (1, 1, 1), (64, 1, 1)).kind == "deadlock"


def test_barrier_block_timing():
    k = compile_module(BARRIERS).functions["barrier_rounds"]
    out = np.zeros(1024, np.float32)
    k.run([ptr(out), i32(10)], (1, 1, 1), (1024, 1, 1))  # first use on this thread allocates the fiber stacks
    best = min(_timed(lambda: k.run([ptr(out), i32(10)], (1, 1, 1), (1024, 1, 1))) for _ in range(5))
    np.testing.assert_array_equal(out, (np.arange(1024) + 10) % 1024)
    print(f"\n1024-thread block, 10 barriers: {best * 1e3:.3f} ms")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_a_fault_outside_kernels_still_reaches_faulthandler(tmp_path):
    """The emulator's handler passes a fault it does not own to the handler installed before it."""
    code = ("import ctypes, struct, numpy as np\n"
            "from zyx.backends.cuda.emulator.kernels import compile_module\n"
            "k = compile_module('__global__ void one(int* p) { p[0] = 1; }').functions['one']\n"
            "a = np.zeros(1, np.int32)\n"
            "assert k.run([struct.pack('<Q', a.ctypes.data)], (1, 1, 1), (1, 1, 1)) is None and a[0] == 1\n"
            "assert k.run([struct.pack('<Q', 8)], (1, 1, 1), (1, 1, 1)).kind == 'address'\n"
            "print('kernels ok', flush=True)\n"
            "ctypes.string_at(8)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), *sys.path]))
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                       timeout=120, env=env)
    assert "kernels ok" in r.stdout, r.stderr
    assert r.returncode != 0 and "Segmentation fault" in r.stderr, (r.returncode, r.stderr)


def test_a_kernel_named_like_a_loaded_librarys_symbol_runs_its_own_code(tmp_path):
    """A library loaded into the global scope before the module (as MKL loads its BLAS, which exports ``saxpy``)
    that defines a function named like a kernel does not capture the kernel's launches."""
    src = tmp_path / "clash.c"
    src.write_text("void zyx_test_clash(int* p) { p[0] = 1; }\n")
    lib = tmp_path / "libclash.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(src), "-o", str(lib)], check=True)
    ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    mod = compile_module('extern "C" __global__ void zyx_test_clash(int* p) { p[0] = 2; }\n')
    out = np.zeros(1, np.int32)
    assert mod.functions["zyx_test_clash"].run([ptr(out)], (1, 1, 1), (1, 1, 1)) is None
    assert out[0] == 2

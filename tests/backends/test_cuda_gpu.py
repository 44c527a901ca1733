"""CUDA backend on a GPU (every test is marked ``cuda`` and skipped when no CUDA device is found). Without a GPU
they run on the emulated driver (``zyx.backends.cuda.emulator``), except the ones marked ``real_gpu_only``.

The op parity suite already runs on ``cuda:N`` through the ``device`` fixture; these tests cover what is specific to
the backend: cuDNN matmuls (chosen and correct for float16, bfloat16, batched, transposed; float32 stays exact FP32,
off cuDNN, unless allow_tf32), several streams overlapping, memory returning to where it started, an asynchronous
fault naming its kernel at the next sync point, and exact copies host <-> cuda and disk -> cuda.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import time

import ml_dtypes
import numpy as np
import pytest

import zyx
from zyx.backends import registry as reg
from zyx.backends.base import BackendError


def _cuda_names() -> list[str]:
    try:
        return [n for n in reg.registry().placements() if n.startswith("cuda:")]
    except Exception:  # noqa: BLE001 - a broken config must not break collection of the other tests
        return []


def _emulated() -> bool:
    return bool(CUDA) and "emulated" in reg.registry().status.get("cuda", "")


CUDA = _cuda_names()
real_gpu_only = pytest.mark.skipif(_emulated(), reason="needs a real GPU: the emulated driver runs a block's threads "
                                   "one after another, so kernel times are not a GPU's")
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="no CUDA GPU: "
                                                   f"{reg.registry().status.get('cuda', 'not probed')}")]


def device():
    return reg.registry().get("cuda:0").primary


def spec(name: str, kinds: tuple[str, ...], formats: tuple, block: int = 32):
    from zyx.backends.cuda.args import KernelSpec

    return KernelSpec(name, (1, 1, 1), (block, 1, 1), 0, kinds, formats)


SPIN = r"""
extern "C" __global__ void zyx_test_spin(const float* in, float* out, long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) { }
  if (threadIdx.x == 0) out[0] = in[0] + 1.0f;
}
"""


def _upload(pool, arr: np.ndarray) -> int:
    bid = pool.allocate(arr.nbytes)
    pool.host_to_pool(memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)), bid)
    return bid


# ---------------------------------------------------------------------------------------------------------------
# cuDNN matmuls
# ---------------------------------------------------------------------------------------------------------------

DTYPES = {"float16": (np.float16, 2e-3), "bfloat16": (ml_dtypes.bfloat16, 1e-2)}
LAYOUTS = {
    "plain": (((512, 256), (256, 384)), lambda a, b: a @ b, lambda a, b: a @ b),
    "batched": (((4, 256, 128), (4, 128, 64)), lambda a, b: a @ b, lambda a, b: a @ b),
    "transposed_b": (((512, 256), (384, 256)), lambda a, b: a @ b.T, lambda a, b: a @ b.T),
    "transposed_a": (((256, 512), (256, 384)), lambda a, b: a.T @ b, lambda a, b: a.T @ b),
    "batch_broadcast": (((64, 4, 128), (128, 96)), lambda a, b: a.permute(1, 0, 2) @ b,
                        lambda a, b: a.transpose(1, 0, 2) @ b),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cudnn_matmul_runs_every_layout_correctly(dtype, layout, libraries_first):
    """Every layout through cuDNN (taken whatever its cost: which path is cheaper for these small shapes is the
    cost model's business, below), matching float64 NumPy; float32 to FP32's accuracy."""
    np_dtype, tol = DTYPES[dtype]
    (sa, sb), zyx_fn, np_fn = LAYOUTS[layout]
    rng = np.random.default_rng(0)
    a = rng.standard_normal(sa).astype(np_dtype)
    b = rng.standard_normal(sb).astype(np_dtype)
    c = zyx_fn(zyx.Tensor(a, device="cuda"), zyx.Tensor(b, device="cuda"))
    launches = zyx.debug.schedule(c)
    assert any(x.kind == "library" and x.name.startswith("cudnn_matmul") for x in launches), launches
    want = np_fn(a.astype(np.float64), b.astype(np.float64))
    got = c.numpy().astype(np.float64)
    assert got.shape == want.shape
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < tol, f"relative error {err:.2e} (tolerance {tol:.0e})"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_float32_matmuls_are_exact_fp32_by_default(layout, libraries_first):
    """allow_tf32 off (the default): no cuDNN for float32, whatever the cost (its float32 engines round products
    to TF32 on this GPU: 3e-4 relative error on these layouts, measured), and FP32's accuracy."""
    (sa, sb), zyx_fn, np_fn = LAYOUTS[layout]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
    c = zyx_fn(zyx.Tensor(a, device="cuda"), zyx.Tensor(b, device="cuda"))
    assert not [x for x in zyx.debug.schedule(c) if x.kind == "library"]
    want = np_fn(a.astype(np.float64), b.astype(np.float64))
    err = np.max(np.abs(c.numpy().astype(np.float64) - want)) / np.max(np.abs(want))
    assert err < 1e-5, f"relative error {err:.2e}: not FP32"


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_cudnn_is_chosen_for_a_large_matmul(dtype):
    a = zyx.Tensor(np.ones((2048, 2048), DTYPES[dtype][0]), device="cuda")
    launches = zyx.debug.schedule(a @ a)
    assert any(x.kind == "library" and x.name.startswith("cudnn_matmul") for x in launches), launches


def test_cudnn_off_in_config_uses_generated_kernels(tmp_path):
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"cuda": {"cudnn": False}}))
    from zyx.graph import schedule

    schedule.clear_cache()
    reg.reset_registry(f)
    try:
        rng = np.random.default_rng(1)
        a, b = rng.standard_normal((256, 128)).astype(np.float32), rng.standard_normal((128, 64)).astype(np.float32)
        c = zyx.Tensor(a, device="cuda") @ zyx.Tensor(b, device="cuda")
        assert all(x.kind != "library" for x in zyx.debug.schedule(c))
        np.testing.assert_allclose(c.numpy(), a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)
    finally:
        schedule.clear_cache()
        reg.reset_registry()


# ---------------------------------------------------------------------------------------------------------------
# streams, timing, memory
# ---------------------------------------------------------------------------------------------------------------


def _spin_setup(ms: float):
    dev = device()
    pid = dev.compile_source(SPIN, spec("zyx_test_spin", ("in", "out", "var"), (None, None, "q")))
    clock_khz = dev.worker.attrs.get("CLOCK_RATE") or 1_500_000
    return dev, pid, int(clock_khz * ms)


@real_gpu_only
def test_launch_timed_measures_the_kernel_alone():
    dev, pid, cycles = _spin_setup(10.0)
    pool = dev.pool()
    x, y = _upload(pool, np.zeros(1, np.float32)), pool.allocate(4)
    ns = dev.launch_timed(pid, [x, y, cycles])
    assert 3e6 < ns < 100e6, ns  # ~10 ms of clock64 spinning (the clock may boost or throttle)
    out = np.empty(1, np.float32)
    pool.pool_to_host(y, memoryview(out.view(np.uint8)))
    assert out[0] == 1.0


def test_independent_chains_overlap_on_several_streams():
    dev, pid, cycles = _spin_setup(30.0)
    pool, w = dev.pool(), dev.worker
    bufs = [(_upload(pool, np.zeros(1, np.float32)), pool.allocate(4)) for _ in range(3)]
    one = dev.launch_timed(pid, [*bufs[0], cycles]) / 1e9
    w.call(setattr, w, "trace", [])
    t0 = time.perf_counter()
    for x, y in bufs:
        dev.launch(pid, [x, y, cycles])
    dev.sync()
    both = time.perf_counter() - t0
    trace = w.call(lambda: list(w.trace))
    w.call(setattr, w, "trace", None)
    streams = {s for _, placed in trace for _, s, _ in placed}
    assert len(streams) == 3, trace
    assert both < 2.0 * one, f"3 independent launches took {both * 1e3:.1f} ms, one alone {one * 1e3:.1f} ms"


def test_allocate_compute_free_returns_memory():
    pool = reg.registry().get("cuda:0").pool
    pool.sync()
    gc.collect()
    start_free, start_used = pool.free_bytes(), pool.memory_info()
    rng = np.random.default_rng(2)
    host = rng.standard_normal(1 << 16).astype(np.float32)
    for i in range(1000):
        a = zyx.Tensor(host, device="cuda")
        b = ((a * 2 + 1).exp() - a).sum()
        b.realize()
        if i % 100 == 99:
            assert np.isfinite(b.numpy())
        del a, b
    gc.collect()
    pool.sync()
    end = pool.memory_info()
    assert abs(pool.free_bytes() - start_free) <= 0.01 * start_free
    assert end["held"] <= start_used["held"] * 1.01 + (1 << 20)
    if "pool_used" in end:  # the driver's count of live stream-ordered allocations
        assert end["pool_used"] <= start_used["pool_used"] * 1.01 + (1 << 20)
    assert abs(end["free"] - start_used["free"]) <= 0.01 * start_used["free"]


def test_illegal_address_surfaces_at_the_next_sync_naming_the_kernel():
    # a sticky error ruins the process's CUDA context: run it in a child process
    code = textwrap.dedent("""
        import numpy as np
        import zyx
        from zyx.backends.base import BackendError
        from zyx.backends.cuda.args import KernelSpec
        dev = zyx.registry().get("cuda:0").primary
        pool = dev.pool()
        src = 'extern "C" __global__ void zyx_oob_writer(float* out) { out[(long long)1 << 40] = 1.0f; }'
        pid = dev.compile_source(src, KernelSpec("zyx_oob_writer", (1, 1, 1), (1, 1, 1), 0, ("out",), (None,)))
        out = pool.allocate(4)
        dev.launch(pid, [out])
        print("LAUNCHED", flush=True)
        try:
            dev.sync()
            print("NO ERROR")
        except BackendError as e:
            print("ERROR:", e.status.value, e.context)
        try:
            arr = np.empty(1, np.float32)
            pool.pool_to_host(out, memoryview(arr.view(np.uint8)))
            print("READ", arr)
        except BackendError as e:
            print("AFTER:", e.context)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    lines = out.stdout.splitlines()
    assert "LAUNCHED" in lines, out.stdout + out.stderr
    err = next(line for line in lines if line.startswith(("ERROR:", "NO ERROR")))
    assert err.startswith("ERROR: launch") and "zyx_oob_writer" in err and "ILLEGAL_ADDRESS" in err, err
    after = next(line for line in lines if line.startswith(("AFTER:", "READ")))
    assert after.startswith("AFTER:") and "unusable" in after, after


# ---------------------------------------------------------------------------------------------------------------
# copies
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 3, 1_000_003])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.int64, np.bool_])
def test_host_cuda_copies_are_exact(dtype, n):
    rng = np.random.default_rng(3)
    data = (rng.standard_normal(n) * 100).astype(dtype)
    t = zyx.Tensor(data, device="cuda")
    assert t.device == "cuda:0"
    got = t.numpy()
    assert got.dtype == data.dtype and got.tobytes() == data.tobytes()
    assert t.to("host").numpy().tobytes() == data.tobytes()


def test_large_copies_are_chunked_and_exact():
    data = np.random.default_rng(4).integers(0, 2**31, 96 << 20, dtype=np.int32).view(np.float32)  # 384 MiB
    t = zyx.Tensor(data, device="cuda")
    assert t.numpy().tobytes() == data.tobytes()


def test_disk_to_cuda_is_exact(tmp_path):
    rng = np.random.default_rng(5)
    data = {"w": rng.standard_normal((1000, 257)).astype(np.float32),
            "h": rng.standard_normal((33, 7)).astype(np.float16),
            "b": rng.standard_normal(4097).astype(ml_dtypes.bfloat16),
            "i": rng.integers(-5, 5, 10, dtype=np.int64)}
    path = tmp_path / "m.safetensors"
    zyx.save(path, {k: zyx.Tensor(v) for k, v in data.items()})
    loaded = zyx.load(path)
    for k, v in data.items():
        assert loaded[k].device == "disk"
        on_gpu = loaded[k].to("cuda")
        assert on_gpu.device == "cuda:0"
        assert on_gpu.numpy().tobytes() == v.tobytes(), k


@pytest.mark.skipif(len(CUDA) < 2, reason="needs two GPUs")
def test_copies_between_gpus_are_exact():
    data = np.arange(1 << 20, dtype=np.float32)
    t = zyx.Tensor(data, device=CUDA[0]).to(CUDA[1])
    assert t.numpy().tobytes() == data.tobytes()


def test_main_runs_on_the_gpu():
    out = subprocess.run([sys.executable, "-m", "zyx", "--device", "cuda", "--size", str(1 << 20)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cuda  ok" in out.stdout and "generated cuda:0" in out.stdout


def test_async_errors_do_not_leak_between_syncs():
    dev = device()
    with pytest.raises(BackendError, match="launch of unknown program"):
        dev.launch(10**9, [1])
    dev.sync()  # nothing pending: no stale error


# ---------------------------------------------------------------------------------------------------------------
# generated tensor-core matmuls
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tile", [(128, 128), (128, 256)])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_cp_async_ring_runs_every_layout_correctly(layout, tile, monkeypatch):
    """The generated mma matmul with its tiles filled by cp.async (``mma_async``, off by default until timed on a
    GPU), cuDNN off: on a GPU this runs the PTX (cp.async into dynamic shared memory past 48 KiB, ldmatrix and
    ldmatrix.trans), elsewhere the emulator's stand-ins; both must match float64 NumPy."""
    from zyx.graph import schedule
    from zyx.kernel import gpu

    if _emulated() and tile != (128, 128) and layout not in ("plain", "batch_broadcast"):
        pytest.skip("the emulator runs the 128x256 ring on two layouts (a GPU on all): its test time goes elsewhere")
    index = gpu.MMA_TILES.index(next(t for t in gpu.MMA_TILES if (t.bm, t.bn) == tile))
    real = gpu.optimize
    monkeypatch.setattr(gpu, "optimize", lambda k, info, p=None: real(k, info, {**(p or {}), "mma_async": 1,
                                                                                "mma_tile": index}))
    monkeypatch.setattr(device(), "_cudnn", None)
    schedule.clear_cache()
    try:
        (sa, sb), zyx_fn, np_fn = LAYOUTS[layout]
        rng = np.random.default_rng(0)
        a, b = rng.standard_normal(sa).astype(np.float16), rng.standard_normal(sb).astype(np.float16)
        c = zyx_fn(zyx.Tensor(a, device="cuda"), zyx.Tensor(b, device="cuda"))
        sources = [s for s in zyx.debug.kernel_source(c) if "zyx_cp_async" in s]
        assert len(sources) == 1, "the matmul did not take the cp.async ring"
        got = c.numpy().astype(np.float64)
    finally:
        schedule.clear_cache()
    want = np_fn(a.astype(np.float64), b.astype(np.float64))
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < 2e-3, f"relative error {err:.2e}"

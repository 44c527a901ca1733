"""The ``cp.async`` mma fill (``gpu.Geometry.async_copy``, search parameter ``mma_async``): a ring of up to four
shared buffers filled by 16-byte asynchronous copies, fragments by ``ldmatrix`` (``.trans`` for row-first tiles).

Off the GPU a copy lands only when a ``cp.async.wait_group`` retires its group (the latest the PTX allows), so a
step that read its buffer too early would read stale data here too; one test removes a wait and sees it. The
math and its order are those of the register-filled layout, so both give bitwise identical results, checked
under the emulated driver against NumPy on every fill order, ragged and batched shapes.
"""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest
from conftest import nvrtc_compiles, run_emulated_matmul
from test_gpu_mma_pipeline import EMU_GRID, INFO, TF32, matmul_kernel, reference, render

from zyx.backends.cuda import nvrtc
from zyx.kernel import gpu

_NVRTC = nvrtc.available()
needs_nvrtc = pytest.mark.skipif(_NVRTC is not None, reason=f"NVRTC unavailable ({_NVRTC}): {nvrtc.INSTALL_HINT}")
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")

CASES = [  # dtype, a stored, b stored, ta, tb: every fill order, ragged m / n / k, batched
    ("float16", (128, 256), (256, 192), False, False),  # a k-first, b row-first (ldmatrix.trans)
    ("float16", (33, 48), (48, 72), False, False),  # m ragged: rows past the bounds copy nothing
    ("bfloat16", (48, 40), (48, 56), True, False),  # both row-first: a by ldmatrix.x4.trans
    ("float16", (40, 72), (56, 72), False, True),  # both k-first; k = 72: the last step is partly outside
    ("bfloat16", (3, 40, 24), (3, 24, 56), False, False),  # batched, k = 24 < bk
    ("float16", (24, 72), (40, 24), True, True),  # a row-first, b k-first
]


def test_async_fill_is_listed_where_every_operand_is_a_whole_vector_load():
    k = matmul_kernel((256, 256), (256, 256), "float16")
    space = gpu.search_space(k, INFO)
    assert space["mma_async"] == (0, 1)
    assert not gpu.geometry(gpu.optimize(k, INFO)).async_copy  # off by default until measured on a GPU
    for i in space["mma_tile"]:
        g = gpu.geometry(gpu.optimize(k, INFO, {"mma_tile": i, "mma_async": 1}))
        assert g.async_copy and g.ldmatrix and g.stages in gpu.ASYNC_STAGES and g.tile == gpu.MMA_TILES[i]
        ring = g.tile.async_shared_bytes(gpu.mma_fill_order(g.contraction), g.stages)
        assert ring <= INFO.shared_optin_bytes
        more = next((s for s in gpu.ASYNC_STAGES if s > g.stages), None)  # the most buffers that fit
        assert more is None or g.tile.async_shared_bytes(gpu.mma_fill_order(g.contraction), more) > ring
    ragged = matmul_kernel((33, 47), (47, 70), "float16")  # k = 47: no vector along k, scalar fills
    assert "mma_async" not in gpu.search_space(ragged, INFO)
    assert not gpu.geometry(gpu.optimize(ragged, INFO, {"mma_async": 1})).async_copy
    k32 = matmul_kernel((256, 256), (256, 256), "float32")  # tf32 words are rounded on the way: no plain copy
    assert "mma_async" not in gpu.search_space(k32, TF32)
    small = replace(INFO, local_memory_bytes=4 * 1024, shared_optin_bytes=0)  # no ring fits: register fills
    g = gpu.geometry(gpu.optimize(k, small, {"mma_async": 1}))
    assert g.strategy != "mma" or not g.async_copy


def test_the_ring_is_dynamic_shared_memory_beyond_the_static_48_kib():
    """Four 128x128 buffers (76 KiB) exceed static shared memory: the ring is ``extern __shared__``, the launch
    passes its size (the worker opts the function into it), and a device that allows less gets fewer buffers."""
    k = matmul_kernel((256, 256), (256, 256), "float16")
    g, src, cs = render(k, "float16", {"mma_tile": 0, "mma_async": 1})
    assert g.stages == 4 and "extern __shared__ __align__(16) unsigned short zsh[];" in src
    assert cs.shared_bytes == g.tile.async_shared_bytes(gpu.mma_fill_order(g.contraction), 4) > 48 * 1024
    assert "__shared__ __align__(16) unsigned int" not in src
    g2 = gpu.geometry(gpu.optimize(k, replace(INFO, shared_optin_bytes=48 * 1024), {"mma_tile": 0, "mma_async": 1}))
    assert g2.async_copy and g2.stages == 2


def test_the_ring_waits_then_meets_a_barrier_before_each_step():
    k = matmul_kernel((256, 256), (256, 256), "float16")
    g, src, _ = render(k, "float16", {"mma_tile": 0, "mma_async": 1})
    s = g.stages
    loop = src[src.index("for (int zk = 0"):]
    assert loop.index(f"zyx_cp_wait(zq, {s - 2});") < loop.index("__syncthreads();") < loop.index("zyx_cp_async")
    assert loop.index("zyx_cp_commit(zq);") < loop.index("mma.sync")
    assert "ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16" in src  # b is row-first
    assert "ldmatrix.sync.aligned.m8n8.x4.shared.b16" in src  # a is k-first
    assert "zyx_cp_wait(zq, 0);" in src and "unsigned short (* const zsa)" in src


@needs_nvrtc
def test_every_async_layout_compiles_for_sm80_and_sm90():
    seen = set()
    for dtype, a_shape, b_shape, ta, tb in CASES:
        k = matmul_kernel(a_shape, b_shape, dtype, ta, tb)
        for i in gpu.search_space(k, INFO)["mma_tile"]:
            g, src, _ = render(k, dtype, {"mma_tile": i, "mma_async": 1})
            assert g.async_copy
            seen.add(src)
    nvrtc_compiles(sorted(seen))


@needs_gxx
@pytest.mark.parametrize("dtype,a_shape,b_shape,ta,tb", CASES)
def test_async_fill_gives_the_register_fills_results(dtype, a_shape, b_shape, ta, tb, rng):
    k = matmul_kernel(a_shape, b_shape, dtype, ta, tb)
    np_dtype = k.params[1].dtype.np_dtype
    a = rng.uniform(-1, 1, a_shape).astype(np.float32).astype(np_dtype)
    b = rng.uniform(-1, 1, b_shape).astype(np.float32).astype(np_dtype)
    want, bound = reference(dtype, a, b, ta, tb)
    space = gpu.search_space(k, INFO)
    assert space["mma_async"] == (0, 1)
    tiles = space["mma_tile"]
    for i in sorted({tiles[0], max(tiles), min(tiles)}):
        base = {"mma_tile": i, "mma_stages": 2}
        reg = run_emulated_matmul(render(k, dtype, base)[2], k, a, b, EMU_GRID)
        g, _, cs = render(k, dtype, {**base, "mma_async": 1})
        assert g.async_copy
        got = run_emulated_matmul(cs, k, a, b, EMU_GRID)
        np.testing.assert_array_equal(got, reg)
        err = np.abs(got.astype(np.float64).reshape(want.shape) - want)
        assert np.all(err <= bound), (i, float(np.max(err - bound)))


@needs_gxx
def test_a_step_that_does_not_wait_reads_stale_tiles_in_the_emulator(rng):
    """The emulated copies are deferred to their wait: with the in-loop wait gone, steps read buffers whose copies
    have not landed, and the product is wrong (on the device it would be a race)."""
    k = matmul_kernel((64, 128), (128, 96), "float16")
    a = rng.uniform(-1, 1, (64, 128)).astype(np.float16)
    b = rng.uniform(-1, 1, (128, 96)).astype(np.float16)
    g, src, cs = render(k, "float16", {"mma_tile": gpu.MMA_TILES.index(gpu.MmaTile(64, 64, 32, 2, 2)), "mma_async": 1})
    assert g.async_copy and g.stages == 4
    good = run_emulated_matmul(cs, k, a, b, EMU_GRID).reshape(64, 96)
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(good - want)) < 0.1
    broken = src.replace(f"zyx_cp_wait(zq, {g.stages - 2});", "", 1)
    assert broken != src
    bad = run_emulated_matmul(_Source(broken, cs), k, a, b, EMU_GRID).reshape(64, 96)
    assert np.max(np.abs(bad - want)) > 1.0


class _Source:
    """A rendered source with its text replaced (the name, grid and block of the original)."""

    def __init__(self, source: str, cs) -> None:
        self.source, self.name, self.grid, self.block = source, cs.name, cs.grid, cs.block


@needs_gxx
def test_an_async_matmul_runs_through_the_emulated_device(monkeypatch):
    """The whole path on ``cuda:0`` (emulated when there is no GPU): the 76 KiB ring's launch opts into dynamic
    shared memory in the worker; the product matches NumPy's."""
    import zyx
    from zyx.backends.registry import registry
    from zyx.graph import schedule

    try:
        dev = registry().get("cuda:0").primary
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no cuda:0: {e}")
    real = gpu.optimize
    monkeypatch.setattr(gpu, "optimize", lambda k, info, p=None: real(k, info, {**(p or {}), "mma_async": 1,
                                                                                "mma_tile": 0}))
    monkeypatch.setattr(dev, "_cudnn", None)  # the generated kernel, not a library node
    schedule.clear_cache()
    try:
        rng = np.random.default_rng(3)
        a, b = (rng.uniform(-1, 1, s).astype(np.float16) for s in ((256, 160), (160, 192)))
        out = zyx.Tensor(a, device="cuda:0") @ zyx.Tensor(b, device="cuda:0")
        (src,) = [s for s in zyx.debug.kernel_source(out) if "zyx_cp_async" in s]
        assert "extern __shared__" in src
        got = out.numpy().astype(np.float64)
    finally:
        schedule.clear_cache()
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(got - want)) < 2e-2 + 1e-2 * np.max(np.abs(want))

"""The GPU ``scatter`` layout (``gpu._scatter_geometry``, ``render_cuda``'s ``scatter_frame``): a one-hot sum
(``out[v, o] = sum_n (index(n) == v ? x(n, o) : 0)``, an embedding's or a gather's gradient) runs as bins of rows
per thread, each thread zeroing its rows and adding the hits at them in the sum's order. What is checked:

- the decision, from the IR alone: an embedding's gradient takes it, with enough bins for the GPU and every row
  in exactly one bin; plain sums do not; the search keeps the reduce layouts as the other choices;
- the rendered source (zeroing, the guarded add, no accumulator) compiles with NVRTC for sm_80 and sm_90;
- the values on the emulated ``cuda:0``: embedding and gather gradients with repeated, negative and unused
  indices equal NumPy's ``np.add.at``, with the layout and with the ``group`` layout forced.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import compute_devices, gpu_planned, kernels_of, nvrtc_compiles

import zyx
from zyx.backends.cuda import nvrtc
from zyx.kernel import gpu
from zyx.kernel.ir import Kernel
from zyx.kernel.render_cuda import CUDARenderer
from zyx.nn import functional as F

INFO = gpu.reference_info()
SCATTER, GROUP = gpu.STRATEGIES.index("scatter"), gpu.STRATEGIES.index("group")
_NVRTC = nvrtc.available()
needs_nvrtc = pytest.mark.skipif(_NVRTC is not None, reason=f"NVRTC unavailable ({_NVRTC}): {nvrtc.INSTALL_HINT}")
needs_cuda = pytest.mark.skipif("cuda:0" not in compute_devices(), reason="no cuda:0 (GPU or emulator)")


def embedding_grad_kernel(rows: int, dim: int, lookups: tuple[int, ...], dtype: str = "float32") -> Kernel:
    w = zyx.Tensor(np.zeros((rows, dim), np.float32), requires_grad=True)
    if dtype != "float32":
        w = zyx.Tensor(np.zeros((rows, dim), dtype), requires_grad=True)
    idx = zyx.Tensor(np.zeros(lookups, np.int64))
    (F.embedding(idx, w) * zyx.Tensor(np.ones((*lookups, dim), dtype))).sum().backward()
    (k,) = [k for k in kernels_of(w.grad) if k.reduces()]
    return k


def test_an_embedding_gradient_takes_the_scatter_layout():
    k = gpu.optimize(embedding_grad_kernel(3000, 256, (16, 64)), INFO)
    g = gpu.geometry(k)
    target, _, per = g.scatter
    assert g.strategy == "scatter" and target.arg[1] == 3000 and g.block == (256, 1, 1)
    bins = -(-3000 // per)
    assert (bins - 1) * per < 3000 <= bins * per and g.items == bins * 256  # every row in one bin
    assert g.items >= gpu.SCATTER_THREADS * 3 // 4  # enough threads for the GPU, not one per output
    # few other axes: more bins, never more than the rows
    g1 = gpu.geometry(gpu.optimize(embedding_grad_kernel(50, 1, (100,)), INFO))
    assert g1.strategy == "scatter" and g1.scatter[2] == 1 and g1.items == 50
    space = gpu.search_space(embedding_grad_kernel(3000, 256, (16, 64)), INFO)
    assert space["strategy"][0] == SCATTER and GROUP in space["strategy"]


def test_plain_sums_keep_their_layouts():
    x = zyx.Tensor(np.zeros((3000, 256), np.float32))
    for t in (x.sum(0), x.sum(1), (x * x).sum()):
        for k in kernels_of(t):
            assert gpu.geometry(gpu.optimize(k, INFO)).strategy != "scatter"


def test_the_source_zeroes_the_bin_then_adds_the_hits():
    k = gpu.optimize(embedding_grad_kernel(3000, 256, (16, 64)), INFO)
    src = CUDARenderer().render(k).source
    assert "= 0.0f;" in src and "acc" not in src  # no accumulator: the sum runs in memory, one thread per element
    assert ">= zlo &&" in src and "< zhi) {" in src


def _variants() -> list[Kernel]:
    return [embedding_grad_kernel(3000, 256, (16, 64)), embedding_grad_kernel(37, 5, (7, 3), "float64"),
            embedding_grad_kernel(100000, 8, (1000,))]


@needs_nvrtc
def test_every_scatter_variant_compiles_for_sm80_and_sm90():
    sources = []
    for k in _variants():
        ko = gpu.optimize(k, INFO)
        assert gpu.geometry(ko).strategy == "scatter", k.name
        sources.append(CUDARenderer().render(ko).source)
    nvrtc_compiles(sources)


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_emulated_gradients_equal_numpy(dtype, rng):
    rows, dim = 40, 24
    idx = rng.integers(-rows, rows // 2, (6, 9))  # repeated, negative (from the end) and unused rows
    g = rng.standard_normal((6, 9, dim)).astype(dtype)
    want = np.zeros((rows, dim), np.float64)
    np.add.at(want, idx % rows, g.astype(np.float64))
    x = rng.standard_normal((30, 50)).astype(dtype)
    gidx = rng.integers(0, 50, (30, 12))
    gg = rng.standard_normal((30, 12)).astype(dtype)
    gwant = np.zeros((30, 50), np.float64)
    np.add.at(gwant, (np.arange(30)[:, None], gidx), gg.astype(np.float64))
    for params, layout in (({}, True), ({"strategy": GROUP}, False)):
        with gpu_planned(params) as seen:
            w = zyx.Tensor(np.zeros((rows, dim), dtype), device="cuda:0", requires_grad=True)
            (F.embedding(zyx.Tensor(idx, device="cuda:0"), w) * zyx.Tensor(g, device="cuda:0")).sum().backward()
            np.testing.assert_allclose(w.grad.numpy(), want, rtol=1e-5, atol=1e-5, err_msg=f"embedding {params}")
            xt = zyx.Tensor(x, device="cuda:0", requires_grad=True)
            (xt.gather(1, zyx.Tensor(gidx, device="cuda:0")) * zyx.Tensor(gg, device="cuda:0")).sum().backward()
            np.testing.assert_allclose(xt.grad.numpy(), gwant, rtol=1e-5, atol=1e-5, err_msg=f"gather {params}")
        assert any(s.strategy == "scatter" for s in seen) == layout, params

"""What a realize launches (zyx.debug.schedule), caching of schedules, and graph memory."""

from __future__ import annotations

import gc
import resource

import numpy as np
import pytest
from conftest import assert_close

import zyx
from zyx.backends import registry
from zyx.graph import node, schedule


def generated(*tensors) -> list:
    return [s for s in zyx.debug.schedule(*tensors) if s.kind == "generated"]


def computed(*tensors) -> list:
    """The schedule without the uploads of inputs made from NumPy arrays on a non-host device."""
    return [s for s in zyx.debug.schedule(*tensors) if s.kind != "copy"]


@pytest.fixture
def abc(rng, device):
    return [zyx.Tensor(rng.standard_normal((64, 32)).astype(np.float32), device=device) for _ in range(3)]


def test_elementwise_chain_is_one_kernel(abc):
    a, b, c = abc
    out = (a * b + c).relu() * 0.5 + (-a.abs()).exp()
    sched = computed(out)
    assert [s.kind for s in sched] == ["generated"]
    an, bn, cn = (t.numpy() for t in abc)
    assert_close(out, np.maximum(an * bn + cn, 0) * 0.5 + np.exp(-np.abs(an)), rtol=1e-6)


@pytest.mark.parametrize("permuted", [False, True])
def test_row_sum_is_one_kernel(device, rng, permuted):
    a = rng.standard_normal((48, 40)).astype(np.float32)
    x = zyx.Tensor(a.T.copy() if permuted else a, device=device)
    x = x.T if permuted else x
    assert len(generated(x.sum(axis=1))) == 1
    assert_close(x.sum(axis=1), a.sum(axis=1), rtol=1e-5, atol=1e-5)


def test_softmax_at_most_two_kernels(device, rng):
    x = zyx.Tensor(rng.standard_normal((16, 100)).astype(np.float32), device=device)
    assert len(generated(x.softmax(-1))) <= 2
    assert len(generated(x.log_softmax(-1))) <= 2


def test_movement_chain_then_elementwise_is_one_kernel(device, rng):
    a = rng.standard_normal((4, 6, 8)).astype(np.float32)
    x = zyx.Tensor(a, device=device)
    y = x.permute(2, 0, 1)[1:, ::-1].reshape(7, 2, 12).pad(((0, 0), (1, 1), (0, 0))).flip(0).expand(2, 7, 4, 12)
    out = y * 2 + 1
    assert len(computed(out)) == 1
    want = np.broadcast_to(np.flip(np.pad(a.transpose(2, 0, 1)[1:, ::-1].reshape(7, 2, 12),
                                          ((0, 0), (1, 1), (0, 0))), 0), (2, 7, 4, 12)) * 2 + 1
    assert_close(out, want)


def test_realized_tensor_is_not_recomputed(device, rng):
    x = zyx.Tensor(rng.standard_normal((8, 8)).astype(np.float32), device=device)
    y = (x.exp() * 3).sum(1).realize()
    zyx.debug.reset_stats()
    (y + 1).numpy()
    (y * 2).numpy()
    assert zyx.debug.stats()["launches"] == 2  # one kernel each; y's reduce is not run again
    assert all("r_" not in s.name for s in zyx.debug.schedule(y - 5))


def test_shared_reduce_is_computed_once(device, rng):
    x = zyx.Tensor(rng.standard_normal((8, 8)).astype(np.float32), device=device)
    s = x.sum(1, keepdim=True)
    a, b = x * s, x - s.T
    kinds = computed(a, b)
    # s feeds both outputs: stored once instead of recomputed; a and b (same shape) share one kernel
    assert [k.name for k in kinds] == ["r_8_1_float32", "e_8_8_float32_x2"]
    xn = x.numpy()
    sn = xn.sum(1, keepdims=True)
    zyx.realize(a, b)
    assert_close(a, xn * sn, rtol=1e-5)
    assert_close(b, xn - sn.T, rtol=1e-5, atol=1e-5)


def test_reduce_recomputed_in_inner_loop_is_materialized(device, rng):
    x = zyx.Tensor(rng.standard_normal((16, 16)).astype(np.float32), device=device)
    s = x.sum(0)  # indexed by the inner loop of the consumer below: storing it beats 16x recomputation
    out = x + s  # out[i, j] = x[i, j] + s[j]
    assert len(generated(out)) == 2
    xn = x.numpy()
    assert_close(out, xn + xn.sum(0), rtol=1e-5, atol=1e-5)
    per_row = x + s.reshape(16, 1)  # s[i] in the outer loop: computed once per row, fused
    assert len(generated(per_row)) == 1
    assert_close(per_row, xn + xn.sum(0)[:, None], rtol=1e-5, atol=1e-5)


def test_reduce_read_by_several_reduces_is_materialized(device, rng):
    """Attention's shape without a matmul: ``d`` (pairwise distances, a reduce) is read by the softmax's max, its sum
    and the output, each placement its own loop over ``j``: fused, every distance would be computed three times."""
    xn = rng.standard_normal((8, 16)).astype(np.float32)
    x = zyx.Tensor(xn, device=device)
    d = (x.reshape(8, 1, 16) - x.reshape(1, 8, 16)).abs().sum(-1)
    y = (-d).softmax(-1)
    assert len(generated(y)) == 2
    dn = np.abs(xn[:, None, :] - xn[None, :, :]).sum(-1)
    e = np.exp(-dn - (-dn).max(-1, keepdims=True))
    assert_close(y, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)


def test_dot_products_share_one_kernel_with_sibling_reduces(device, rng):
    """Sums of products without reuse (a row's ``(x * y).sum(-1)``, a sum of squares) are no GEMM: they join the other
    reduces reading the same operands in one kernel, which reads them once (a dot product and two norms of 8192x1024
    rows: 2.5 -> 1.5 ms on 2 cores). Contractions that reuse both factors (matmuls) keep a kernel each."""
    xn, yn = (rng.standard_normal((16, 32)).astype(np.float32) for _ in range(2))
    x, y = zyx.Tensor(xn, device=device), zyx.Tensor(yn, device=device)
    outs = (x * y).sum(-1), (x * x).sum(-1), (y * y).sum(-1), x.sum(-1)
    assert [k.name for k in generated(*outs)] == ["r_16_float32_x4"]
    zyx.realize(*outs)
    for got, want in zip(outs, ((xn * yn).sum(-1), (xn * xn).sum(-1), (yn * yn).sum(-1), xn.sum(-1))):
        assert_close(got, want, rtol=1e-5, atol=1e-5)
    if device != "host":
        return
    from conftest import host_without_blas

    with host_without_blas():
        w1, w2 = (zyx.Tensor(rng.standard_normal((32, 8)).astype(np.float32)) for _ in range(2))
        a, b = x @ w1, x @ w2
        assert len(generated(a, b)) == 2  # one loop nest beside another reduce ran 100-300x slower than a GEMM
        zyx.realize(a, b)
        assert_close(a, xn @ w1.numpy(), rtol=1e-4, atol=1e-4)
        assert_close(b, xn @ w2.numpy(), rtol=1e-4, atol=1e-4)


def test_a_normalizations_weight_and_bias_gradients_share_one_kernel(device, rng):
    """The bias gradient (a column sum of the output gradient) waits for nothing the weight gradient (which waits
    for the normalized input) does not: it moves to the weight gradient's depth and joins its kernel, which reads the
    output gradient once (layer norm of 4096x1024 forward and backward: 3.19 -> 2.57 ms on 2 cores)."""
    from zyx.nn import functional as F

    xn, gn = (rng.standard_normal((64, 32)).astype(np.float32) for _ in range(2))
    wn, bn = rng.standard_normal(32).astype(np.float32), rng.standard_normal(32).astype(np.float32)
    x = zyx.Tensor(xn, device=device, requires_grad=True)
    w = zyx.Tensor(wn, device=device, requires_grad=True)
    b = zyx.Tensor(bn, device=device, requires_grad=True)
    (F.layer_norm(x, (32,), w, b) * zyx.Tensor(gn, device=device)).sum().backward()
    names = [k.name for k in generated(x.grad, w.grad, b.grad)]
    assert "r_32_float32_x2" in names and "r_32_float32" not in names, names
    zyx.realize(x.grad, w.grad, b.grad)
    xhat = (xn - xn.mean(1, keepdims=True)) / np.sqrt(xn.var(1, keepdims=True) + 1e-5)
    assert_close(w.grad, (gn * xhat).sum(0), rtol=1e-4, atol=1e-4)
    assert_close(b.grad, gn.sum(0), rtol=1e-5, atol=1e-5)


def test_a_large_cheap_value_over_shared_reduces_stores_the_reduces(device, rng):
    """A layer norm's ``x - mean`` is needed by the variance, the output and the backward kernels. Large
    (``SHARED_REDUCE_FIRST_MIN`` elements), the mean is stored and each kernel recomputes ``x - mean`` instead of
    writing it and reading it back (4096x1024 forward + backward: 3.30 -> 2.42 ms; BatchNorm2d 32x64x56^2: 11.0 ->
    9.5 ms, in turns on 2 cores); small, the value is stored as before (one kernel fewer)."""
    from zyx.graph import fuse
    from zyx.nn import functional as F

    def grads(rows: int, cols: int):
        xn, gn = (rng.standard_normal((rows, cols)).astype(np.float32) for _ in range(2))
        wn, bn = rng.standard_normal(cols).astype(np.float32), rng.standard_normal(cols).astype(np.float32)
        x, w, b = (zyx.Tensor(v, device=device, requires_grad=True) for v in (xn, wn, bn))
        (F.layer_norm(x, (cols,), w, b) * zyx.Tensor(gn, device=device)).sum().backward()
        names = [k.name for k in generated(x.grad, w.grad, b.grad)]
        xhat = (xn - xn.mean(1, keepdims=True)) / np.sqrt(xn.var(1, keepdims=True) + 1e-5)
        d = gn * wn
        dx = (d - d.mean(1, keepdims=True) - xhat * (d * xhat).mean(1, keepdims=True)) / np.sqrt(
            xn.var(1, keepdims=True) + 1e-5)
        zyx.realize(x.grad, w.grad, b.grad)
        assert_close(x.grad, dx, rtol=1e-4, atol=1e-4)
        assert_close(w.grad, (gn * xhat).sum(0), rtol=1e-4, atol=1e-3)
        assert_close(b.grad, gn.sum(0), rtol=1e-4, atol=1e-4)
        return names

    assert 256 * 256 >= fuse.SHARED_REDUCE_FIRST_MIN > 64 * 32
    # the mean's sum, the standard deviation and its reciprocal in one kernel (the test just below)
    assert grads(256, 256) == ["r_256_1_float32_x3", "r_256_256_float32", "r_256_float32_x2"]
    assert grads(64, 32) == ["r_64_32_float32", "r_64_1_float32_x2", "r_64_32_float32", "r_32_float32_x2"]


def test_a_variance_and_its_stored_mean_share_one_kernel(device, rng):
    """A reduce that reads another stored reduce of its shape only broadcast back along the axes it reduces (a
    variance its mean, a softmax's sum its maximum) shares that reduce's kernel, which computes it once per row and
    stores both: the rows are read from memory once (group norm of 16x64x56x56: 0.48 -> 0.45 ms; BatchNorm2d
    forward + backward of 32x64x56^2: 5.4 -> 4.6 ms; on 2 cores). A whole tensor's mean and variance keep a kernel
    each: without output loops only a lone reduce splits across threads; so do short reduces (a pooling window)."""
    xn = rng.standard_normal((16, 300)).astype(np.float32) * 2 + 3
    x = zyx.Tensor(xn, device=device)
    mean, var = x.mean(1, keepdim=True), x.var(1, keepdim=True)  # as the normalizations keep them
    top = x.max(1, keepdim=True)
    total = (x - top).exp().sum(1, keepdim=True)
    for outs in ((mean, var), (top, total)):
        steps = [s for s in schedule.scheduled_steps([t.cls for t in outs]) if s.kind == "generated"]
        assert [s.name for s in steps] == ["r_16_1_float32_x2"], steps
        assert len(steps[0].source.reduces()) == 2  # the stored reduce once, and the one reading it
    zyx.realize(mean, var, top, total)
    assert_close(mean, xn.mean(1, keepdims=True), rtol=1e-5, atol=1e-5)
    assert_close(var, xn.var(1, keepdims=True), rtol=1e-4, atol=1e-4)
    assert_close(top, xn.max(1, keepdims=True), rtol=0, atol=0)
    assert_close(total, np.exp(xn - xn.max(1, keepdims=True)).sum(1, keepdims=True), rtol=1e-5, atol=1e-5)
    whole = x.mean(), x.var()
    assert len(generated(*whole)) == 2
    zyx.realize(*whole)
    assert_close(whole[0], xn.mean(), rtol=1e-5, atol=1e-5)
    assert_close(whole[1], xn.var(), rtol=1e-4, atol=1e-4)
    # a pooling window (9 terms, under fuse.SHARED_ROW_MIN): its maximum and its first index keep a kernel each
    from zyx.nn import functional as F

    pn = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    p = zyx.Tensor(pn, device=device, requires_grad=True)
    F.max_pool2d(p, 3, 2, 1).sum().backward()
    assert [k.name for k in generated(p.grad)][:2] == ["r_2_4_4_4_1_float32", "r_2_4_4_4_1_int64"]
    torch = pytest.importorskip("torch")
    tp = torch.tensor(pn, requires_grad=True)
    torch.nn.functional.max_pool2d(tp, 3, 2, 1).sum().backward()
    assert_close(p.grad, tp.grad.numpy(), rtol=0, atol=0)


def test_a_transposed_convolutions_phases_share_one_kernel_after_its_gemm_is_stored():
    """Without BLAS the phases of a stride-2 col2im first inline the GEMM (a tiled contraction each: kept apart),
    then read it once it is stored, and share one kernel with their interleave. Whether a unit is a tiled
    contraction is remembered per members and what they read: remembered per members alone, the first round's
    answer had split the phases into four kernels."""
    from conftest import host_without_blas

    from zyx.nn import functional as F

    xn = np.random.default_rng(0).standard_normal((2, 4, 5, 5)).astype(np.float32)
    wn = np.random.default_rng(1).standard_normal((4, 3, 4, 4)).astype(np.float32)
    with host_without_blas():
        y = F.conv_transpose2d(zyx.Tensor(xn), zyx.Tensor(wn), stride=2, padding=1)
        assert [k.name for k in generated(y)] == ["r_2_1_48_25_1_float32", "e_2_3_10_10_float32"]
        torch = pytest.importorskip("torch")
        want = torch.nn.functional.conv_transpose2d(torch.from_numpy(xn), torch.from_numpy(wn), stride=2,
                                                    padding=1)
        assert_close(y, want.numpy(), rtol=1e-5, atol=1e-5)


def test_schedule_cache_hit_compiles_nothing(device, rng):
    def step(a, b):
        return ((a @ b).relu() + a.sum()).softmax(-1)

    step(zyx.Tensor(rng.random((6, 6), np.float32), device=device),
         zyx.Tensor(rng.random((6, 6), np.float32), device=device)).numpy()
    zyx.debug.reset_stats()
    for _ in range(3):
        out = step(zyx.Tensor(rng.random((6, 6), np.float32), device=device),
                   zyx.Tensor(rng.random((6, 6), np.float32), device=device))
        out.numpy()
    st = zyx.debug.stats()
    assert st["compiles"] == 0
    assert st["schedule_cache_hits"] == 3 and st["schedule_cache_misses"] == 0


def test_random_numbers_do_not_recompile(device):
    zyx.rand(4, 4, device=device).numpy()
    zyx.debug.reset_stats()
    a = zyx.rand(4, 4, device=device).numpy()
    b = zyx.rand(4, 4, device=device).numpy()
    assert not np.array_equal(a, b)
    assert zyx.debug.stats()["compiles"] == 0


def test_hash_consing_shares_nodes(device, rng):
    x = zyx.Tensor(rng.random((3, 3), np.float32), device=device)
    assert (x * 2 + 1).cls is (x * 2 + 1).cls
    assert (x.exp()).cls is not (x.log()).cls


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_memory_flat_over_many_rounds(device, rng):
    """Many rounds of realize + read-back leave no graph class, no pool buffer and no RSS behind. The emulated GPU
    runs fewer rounds (a round there costs 2-12 ms of thread hand-offs): the class and buffer counts are exact."""
    x = zyx.Tensor(rng.random((32, 32), np.float32), device=device)
    pool = registry.registry().get(device).pool

    def rounds(n: int) -> None:
        for i in range(n):
            y = ((x * (i % 7) + 1).exp() * x).sum(1)
            y.realize()
            z = (y[::2] - 1).relu()
            z.numpy()

    rounds(300)
    gc.collect()
    before_rss, before_nodes, before_buffers = _rss_mb(), node.live_classes(), pool.live_buffers()
    rounds(10_000 if device == "host" else 1_500)
    gc.collect()
    assert node.live_classes() <= before_nodes + 5
    assert pool.live_buffers() == before_buffers
    assert _rss_mb() - before_rss < 20, (before_rss, _rss_mb())


def test_reshapes_of_one_value_share_one_kernel(device, rng):
    """Outputs that are reshapes of one unstored value (a transpose here) are computed by one kernel into one
    buffer, which both read."""
    a = rng.standard_normal((12, 10)).astype(np.float32)
    x = zyx.Tensor(a, device=device)
    t = x.T * 2
    y1, y2 = t.reshape(120), t.reshape(5, 2, 12)
    assert len(computed(y1, y2)) == 1
    zyx.realize(y1, y2)
    assert_close(y1, (a.T * 2).reshape(120))
    assert_close(y2, (a.T * 2).reshape(5, 2, 12))


def test_convolution_columns_are_stored_once(rng, libraries_first):
    """A convolution's im2col columns feed the forward GEMM and the weight gradient's as two reshapes of one
    permuted gather: when BLAS takes both GEMMs, one kernel stores them (there were two, 0.5-0.8 ms each at
    32x64x16x16). (By the estimates the host's generated GEMMs take them, reading the input in place.)"""
    x = zyx.Tensor(rng.standard_normal((2, 4, 8, 8)).astype(np.float32), requires_grad=True)
    w = zyx.Tensor(rng.standard_normal((6, 4, 3, 3)).astype(np.float32), requires_grad=True)
    g = zyx.Tensor(rng.standard_normal((2, 6, 8, 8)).astype(np.float32))
    y = zyx.nn.functional.conv2d(x, w, padding=1)
    (y * g).sum().backward()
    steps = zyx.debug.schedule(y, x.grad, w.grad)
    if not any(s.kind == "library" for s in steps):
        pytest.skip("no BLAS library here: the GEMMs are generated and read the image directly")
    assert sum(s.kind == "generated" and "_36_64_" in s.name for s in steps) == 1, [s.name for s in steps]
    torch = pytest.importorskip("torch")
    tx, tw = (torch.tensor(t.numpy(), requires_grad=True) for t in (x, w))
    ty = torch.nn.functional.conv2d(tx, tw, padding=1)
    (ty * torch.tensor(g.numpy())).sum().backward()
    assert_close(y, ty.detach().numpy(), rtol=1e-4, atol=1e-4)
    assert_close(x.grad, tx.grad.numpy(), rtol=1e-4, atol=1e-4)
    assert_close(w.grad, tw.grad.numpy(), rtol=1e-4, atol=1e-4)


def test_intermediates_reuse_freed_blocks_within_one_realize(monkeypatch):
    """A plan allocates each intermediate when a step first uses it and releases it after its last use, so a long
    chain of stored stages (a sort: 45 stages of keys and positions here) reuses the pool's freed blocks instead
    of allocating every stage's buffers up front (3.2 GB of fresh, page-faulting memory for a 2048^2 sort). Here
    the sort's 45 stages are 29 kernels (``zyx.sorting`` stores them in pairs)."""
    from zyx.backends.host.pool import HostPool

    pool = zyx.registry().get("host").pool
    x = zyx.Tensor(np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)).realize()
    x.sort(-1).values.realize()  # compiled; the pool's cache then holds some blocks
    pool._cache.clear()
    pool._cached_bytes = 0
    fresh = []
    real = HostPool._fresh
    monkeypatch.setattr(HostPool, "_fresh", lambda self, size: fresh.append(size) or real(self, size))
    values = x.sort(-1).values
    stages = sum(s.kind == "generated" for s in zyx.debug.schedule(values))
    values.realize()
    assert stages >= 29 and len(fresh) <= 8, (stages, len(fresh))
    np.testing.assert_array_equal(values.numpy(), np.sort(x.numpy(), -1))

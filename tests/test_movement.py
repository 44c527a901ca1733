"""Movement, indexing, joining and creation ops against NumPy."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close

import zyx


@pytest.fixture
def a(rng):
    return rng.standard_normal((3, 4, 5)).astype(np.float32)


def test_reshape_views(device, a):
    x = zyx.Tensor(a, device=device)
    assert_close(x.reshape(12, 5), a.reshape(12, 5))
    assert_close(x.reshape(-1), a.reshape(-1))
    assert_close(x.reshape(5, -1, 2), a.reshape(5, -1, 2))
    assert_close(x.view(60), a.reshape(60))
    assert_close(x.permute(2, 0, 1).reshape(10, 6), a.transpose(2, 0, 1).reshape(10, 6))
    assert_close(x[:, 1:3].reshape(3, 10), a[:, 1:3].reshape(3, 10))


def test_permute_transpose(device, a):
    x = zyx.Tensor(a, device=device)
    assert_close(x.permute(1, 2, 0), a.transpose(1, 2, 0))
    assert_close(x.permute((2, 1, 0)), a.transpose(2, 1, 0))
    assert_close(x.transpose(0, 2), a.swapaxes(0, 2))
    assert_close(x.T, a.T)
    assert_close(x.mT, np.swapaxes(a, -1, -2))


def test_expand_broadcast_squeeze(device, rng):
    b = rng.standard_normal((3, 1, 5)).astype(np.float32)
    x = zyx.Tensor(b, device=device)
    assert_close(x.expand(3, 4, 5), np.broadcast_to(b, (3, 4, 5)))
    assert_close(x.expand(2, -1, 4, -1), np.broadcast_to(b, (2, 3, 4, 5)))
    assert_close(x.broadcast_to((2, 3, 4, 5)), np.broadcast_to(b, (2, 3, 4, 5)))
    assert_close(x.squeeze(), b.squeeze())
    assert_close(x.squeeze(1), b.squeeze(1))
    assert_close(x.unsqueeze(0), b[None])
    assert_close(x.unsqueeze(-1), b[..., None])
    assert_close(x.flatten(), b.reshape(-1))
    assert_close(x.flatten(1), b.reshape(3, 5))


@pytest.mark.parametrize("pads", [((1, 2), (0, 0), (3, 1)), ((0, 0), (2, 2), (0, 0)), ((1, 1),) * 3])
def test_pad_numpy_style(device, a, pads):
    x = zyx.Tensor(a, device=device)
    assert_close(x.pad(pads), np.pad(a, pads))
    assert_close(x.pad(pads, value=-2.5), np.pad(a, pads, constant_values=-2.5))


def test_pad_torch_style_and_negative(device, a):
    x = zyx.Tensor(a, device=device)
    assert_close(x.pad((1, 2)), np.pad(a, ((0, 0), (0, 0), (1, 2))))
    assert_close(x.pad((1, 0, 0, 3)), np.pad(a, ((0, 0), (0, 3), (1, 0))))
    assert_close(x.pad(((0, 0), (-1, 2), (0, -2))), np.pad(a[:, 1:, :-2], ((0, 0), (0, 2), (0, 0))))


def test_pad_numpy_shorthands(device, a):
    x = zyx.Tensor(a, device=device)
    assert_close(x.pad(2), np.pad(a, 2))
    assert_close(x.pad(((1,),)), np.pad(a, ((1,),)))
    assert_close(x.pad(((1, 2),)), np.pad(a, ((1, 2),)))
    assert_close(x.pad(((1,), (0, 2), (3,))), np.pad(a, ((1, 1), (0, 2), (3, 3))))  # mixed: NumPy refuses


@pytest.mark.parametrize("bad, message", [(((1, 2, 3),) * 3, r"axis 0 needs \(before, after\) or \(both,\)"),
                                          (((1, 2),) * 2, "2 \\(before, after\\) pairs for a tensor with 3"),
                                          ((1, 2, 3), "even count up to 6"), (1.5, "expected an int"),
                                          (((0.5, 1),) * 3, "axis 0's padding must be an int")])
def test_pad_bad_widths_name_the_problem(bad, message):
    x = zyx.Tensor(np.zeros((2, 3, 4), np.float32))
    with pytest.raises((ValueError, TypeError), match=message):
        x.pad(bad)


def test_flip(device, a):
    x = zyx.Tensor(a, device=device)
    assert_close(x.flip(0), np.flip(a, 0))
    assert_close(x.flip((1, 2)), np.flip(a, (1, 2)))
    assert_close(x.flip(), np.flip(a))


INDICES = [
    (1,), (-1,), (slice(None),), (slice(1, 3),), (slice(None, None, 2),), (slice(None, None, -1),),
    (slice(3, 0, -2),), (1, 2), (1, slice(None), 3), (Ellipsis, 2), (None, 1), (slice(None), None, 2),
    (Ellipsis,), (Ellipsis, None), (0, Ellipsis, slice(1, -1)), (-2, -3, -4), (slice(10, 20),),
    (slice(-100, 100),), (slice(None), slice(4, None, -3)),
]


@pytest.mark.parametrize("index", INDICES, ids=[str(i) for i in INDICES])
def test_basic_indexing(device, a, index):
    assert_close(zyx.Tensor(a, device=device)[index], a[index])


@pytest.mark.parametrize("index", [
    ([0, 2, 2],), (slice(None), [3, 0, -1]), (Ellipsis, [4, 4]), (1, slice(None), [0, 1]),
    (np.array([[0, 1], [2, 0]]),), (slice(None), np.array([[1], [3]]), 2),
])
def test_integer_tensor_indexing(device, a, index):
    x = zyx.Tensor(a, device=device)
    assert_close(x[index], a[index])
    # the index as a zyx tensor too (computed lazily)
    conv = tuple(zyx.Tensor(np.asarray(i), device=device) if isinstance(i, (list, np.ndarray)) else i
                 for i in index)
    assert_close(x[conv], a[index])


def test_an_empty_list_index_selects_nothing_as_numpy(device, a):
    x = zyx.Tensor(a, device=device)
    assert_close(x[[]], a[[]])  # shape (0, 4, 5): NumPy reads [] as integers (a float array index raises)
    assert_close(x[:, []], a[:, []])
    x[[]] = 7.0
    assert_close(x, a)


def test_lazy_index_tensor(device, a):
    x = zyx.Tensor(a, device=device)
    idx = zyx.arange(3, device=device) * 2 - 1  # [-1, 1, 3]: negative wraps
    assert_close(x[:, idx], a[:, np.array([-1, 1, 3])])


def test_cat_stack_split_chunk(device, rng):
    p = rng.standard_normal((2, 3)).astype(np.float32)
    q = rng.standard_normal((2, 5)).astype(np.float32)
    r = rng.standard_normal((4, 3)).astype(np.float64)
    P, Q, R = (zyx.Tensor(v, device=device) for v in (p, q, r))
    assert_close(zyx.cat([P, Q], 1), np.concatenate([p, q], 1))
    assert_close(zyx.cat([P, R], 0), np.concatenate([p, r], 0), dtype=np.float64)
    assert_close(zyx.cat([P, P, P], -1), np.concatenate([p, p, p], -1))
    assert_close(zyx.stack([P, P * 2], 0), np.stack([p, p * 2], 0))
    assert_close(zyx.stack([P, P * 2], -1), np.stack([p, p * 2], -1))
    parts = Q.split(2, 1)
    for got, want in zip(parts, np.split(q, [2, 4], 1)):
        assert_close(got, want)
    parts = Q.split([1, 4], 1)
    assert [t.shape for t in parts] == [(2, 1), (2, 4)]
    for got, want in zip(R.chunk(2), np.split(r, 2)):
        assert_close(got, want)
    assert_close(zyx.cat([zyx.Tensor(np.zeros((0, 3), np.float32), device=device), P]), p)
    b = np.array([True, False])
    assert_close(zyx.cat([zyx.Tensor(b, device=device), zyx.Tensor(~b, device=device)]), np.concatenate([b, ~b]))


def test_repeat_tile(device, rng):
    p = rng.standard_normal((2, 3)).astype(np.float32)
    x = zyx.Tensor(p, device=device)
    assert_close(x.repeat(2, 3), np.tile(p, (2, 3)))
    assert_close(x.repeat(2, 1, 2), np.tile(p, (2, 1, 2)))
    assert_close(x.repeat_interleave(2, 1), np.repeat(p, 2, 1))
    assert_close(x.repeat_interleave(3), np.repeat(p, 3))


def test_contiguous_and_chains(device, a):
    x = zyx.Tensor(a, device=device)
    y = x.permute(2, 0, 1)[1:, ::-1].reshape(4, 3, 4).contiguous()
    want = a.transpose(2, 0, 1)[1:, ::-1].reshape(4, 3, 4)
    assert_close(y, want)
    assert_close(y.exp(), np.exp(want), rtol=1e-6)


def test_creation(device):
    assert_close(zyx.zeros(2, 3, device=device), np.zeros((2, 3), np.float32))
    assert_close(zyx.ones((2, 3), dtype=zyx.int32, device=device), np.ones((2, 3), np.int32))
    assert_close(zyx.full((2,), 7, device=device), np.full((2,), 7), dtype=np.int64)
    assert_close(zyx.full((2,), 7.5, device=device), np.full((2,), 7.5, np.float32), dtype=np.float32)
    assert_close(zyx.arange(5, device=device), np.arange(5))
    assert_close(zyx.arange(2, 11, 3, device=device), np.arange(2, 11, 3))
    assert_close(zyx.arange(5, 0, -2, device=device), np.arange(5, 0, -2))
    assert_close(zyx.arange(0.0, 1.0, 0.25, device=device), np.arange(0, 1, 0.25).astype(np.float32))
    assert_close(zyx.arange(0, device=device), np.arange(0))
    assert_close(zyx.linspace(-1, 1, 5, device=device), np.linspace(-1, 1, 5).astype(np.float32))
    assert_close(zyx.linspace(0, 1, 1, device=device), np.linspace(0, 1, 1).astype(np.float32))
    assert_close(zyx.eye(3, device=device), np.eye(3, dtype=np.float32))
    assert_close(zyx.eye(2, 4, dtype=zyx.int8, device=device), np.eye(2, 4, dtype=np.int8))
    t = zyx.Tensor(np.ones((2, 2), np.float16), device=device)
    assert_close(zyx.zeros_like(t), np.zeros((2, 2), np.float16), dtype=np.float16)
    assert_close(zyx.ones_like(t), np.ones((2, 2), np.float16))
    assert_close(zyx.full_like(t, 3), np.full((2, 2), 3, np.float16))


def test_tensor_from_python_data(device):
    assert zyx.Tensor([1.0, 2.0], device=device).dtype is zyx.float32
    assert zyx.Tensor([1, 2], device=device).dtype is zyx.int64
    assert zyx.Tensor([True, False], device=device).dtype is zyx.bool
    assert zyx.Tensor(np.arange(3, dtype=np.uint16), device=device).dtype is zyx.uint16
    assert zyx.Tensor([[1, 2]], dtype=zyx.float64, device=device).numpy().dtype == np.float64
    t = zyx.Tensor([[1.5, 2.5], [3.5, 4.5]], device=device)
    assert t.tolist() == [[1.5, 2.5], [3.5, 4.5]]
    assert len(t) == 2 and t.numel() == 4 and t.ndim == 2 and t.shape == (2, 2)
    assert t[1, 0].item() == 3.5
    assert np.asarray(t).shape == (2, 2)
    non_contig = np.arange(12.0).reshape(3, 4)[:, ::2]
    assert_close(zyx.Tensor(non_contig, device=device), non_contig)


def test_random_is_seeded_and_sane(device):
    zyx.manual_seed(42)
    a = zyx.rand(10000, device=device).numpy()
    b = zyx.randn(10000, device=device).numpy()
    c = zyx.randint(3, 9, (10000,), device=device).numpy()
    zyx.manual_seed(42)
    np.testing.assert_array_equal(a, zyx.rand(10000, device=device).numpy())
    np.testing.assert_array_equal(b, zyx.randn(10000, device=device).numpy())
    assert a.dtype == np.float32 and 0 <= a.min() and a.max() < 1 and abs(a.mean() - 0.5) < 0.02
    assert abs(b.mean()) < 0.05 and abs(b.std() - 1) < 0.05
    assert c.dtype == np.int64 and c.min() == 3 and c.max() == 8
    zyx.manual_seed(42)
    again = zyx.rand(5, 2000, device=device).numpy().reshape(-1)
    np.testing.assert_array_equal(again, a)  # counter-based: the shape does not change the stream
    assert not np.array_equal(zyx.rand(100, device=device).numpy(), zyx.rand(100, device=device).numpy())


def test_random_same_on_every_device():
    from conftest import compute_devices

    outs = []
    for d in compute_devices():
        zyx.manual_seed(7)
        outs.append(zyx.randn(1000, device=d).numpy())
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=1e-5, atol=1e-6)

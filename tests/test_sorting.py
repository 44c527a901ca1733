"""``sort``, ``argsort`` and ``topk`` (``zyx.sorting``) on every device: the positions of a stable sort (ties keep
their order, NaN last ascending and first descending) against an exact Python reference, values and gradients
against PyTorch, and the edge cases (a size-1 or empty axis, a 0-d tensor, k out of range)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from torch_parity import matches_torch

import zyx


def reference_order(row: np.ndarray, descending: bool) -> list[int]:
    """Positions of a stable sort of ``row``: NaN after every number ascending, before every number descending."""
    def key(i: int):
        v = float(row[i])
        nan = math.isnan(v)
        if descending:
            return (not nan, 0.0 if nan else -v, i)
        return (nan, 0.0 if nan else v, i)
    return sorted(range(len(row)), key=key)


def data(shape: tuple[int, ...], dtype: str, seed: int) -> np.ndarray:
    """Values with many ties (and NaN, both infinities and -0.0 beside 0.0 for floats, the dtype's extremes for
    integers), so that the stable order matters."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, shape)
    if dtype == "bool":
        return x > 0
    if dtype in ("float16", "bfloat16", "float32", "float64"):
        x = x.astype(np.float64) + (rng.random(shape) < 0.3) * 0.5
        x[rng.random(shape) < 0.1] = np.nan
        x[rng.random(shape) < 0.05] = -np.inf
        x[rng.random(shape) < 0.05] = np.inf
        x[(x == 0) & (rng.random(shape) < 0.5)] = -0.0
        return x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    info = np.iinfo(dtype)
    x = x.astype(dtype)
    x[rng.random(shape) < 0.05] = info.min
    x[rng.random(shape) < 0.05] = info.max
    return x


@pytest.mark.parametrize("dtype,n,descending", [  # both directions where NaN or ties decide; one elsewhere
    ("float32", 13, False), ("float32", 13, True), ("int64", 16, False), ("int64", 16, True), ("float16", 5, True),
    ("bool", 7, False), ("float64", 2, True), ("bfloat16", 9, False), ("int32", 1, True)])
def test_sort_is_stable_and_places_nan_as_numpy(device, dtype, n, descending):
    x = data((3, n), dtype, n)
    t = zyx.Tensor(x, device=device)
    values, indices = t.sort(-1, descending=descending)
    assert indices.dtype is zyx.int64 and values.dtype is t.dtype and values.shape == indices.shape == x.shape
    want = np.array([reference_order(row, descending) for row in x.astype(np.float64)]).reshape(x.shape)
    np.testing.assert_array_equal(indices.numpy(), want)
    np.testing.assert_array_equal(values.numpy(), np.take_along_axis(x, want, -1))
    np.testing.assert_array_equal(zyx.argsort(t, descending=descending).numpy(), want)


def test_sort_along_an_inner_axis_and_module_functions(device):
    x = data((4, 6, 3), "float32", 1)
    t = zyx.Tensor(x, device=device)
    values, indices = zyx.sort(t, dim=1)
    want = np.argsort(x, axis=1, kind="stable")  # NumPy's stable sort: NaN last, ties in order
    np.testing.assert_array_equal(indices.numpy(), want)
    np.testing.assert_array_equal(values.numpy(), np.sort(x, axis=1, kind="stable"))
    top = zyx.topk(t, 2, dim=0, largest=False)
    np.testing.assert_array_equal(top.indices.numpy(), np.argsort(x, axis=0, kind="stable")[:2])


def test_matches_torch_sort_and_topk(device):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(3).standard_normal((5, 37)).astype(np.float32)
    x[:, ::4] = x[:, :1]  # ties
    t, tt = zyx.Tensor(x, device=device), torch.from_numpy(x)
    for descending in (False, True):
        got, want = t.sort(1, descending=descending), torch.sort(tt, dim=1, descending=descending, stable=True)
        np.testing.assert_array_equal(got.values.numpy(), want.values.numpy())
        np.testing.assert_array_equal(got.indices.numpy(), want.indices.numpy())
    for largest in (True, False):
        got, want = t.topk(6, largest=largest), torch.topk(tt, 6, largest=largest)
        np.testing.assert_array_equal(got.values.numpy(), want.values.numpy())  # torch breaks ties its own way
        np.testing.assert_array_equal(np.take_along_axis(x, got.indices.numpy(), 1), want.values.numpy())


def test_sorted_values_carry_gradients_as_torch(device):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(4).standard_normal((3, 10))
    matches_torch(lambda a: a.sort(-1, descending=True).values, lambda a: torch.sort(a, -1, descending=True).values,
                  [x], device)
    matches_torch(lambda a: a.topk(3, dim=1).values * 2, lambda a: torch.topk(a, 3, dim=1).values * 2, [x], device)


def test_edge_cases(device):
    t = zyx.Tensor(np.float32(2.5), device=device)
    v, i = t.sort()
    assert v.shape == i.shape == () and float(v.numpy()) == 2.5 and int(i.numpy()) == 0
    empty = zyx.Tensor(np.zeros((3, 0), np.float32), device=device)
    v, i = empty.sort(-1)
    assert v.shape == i.shape == (3, 0)
    one = zyx.Tensor(np.array([[4.0], [1.0]], np.float32), device=device)
    np.testing.assert_array_equal(one.argsort(-1).numpy(), [[0], [0]])
    np.testing.assert_array_equal(one.topk(2, dim=0).indices.numpy(), [[0], [1]])
    with pytest.raises(ValueError, match=r"topk: k = 3 is out of range for a dimension of size 2 \(shape \(2, 1\)\)"):
        one.topk(3, dim=0)


def test_stages_are_stored_in_pairs_by_one_kernel_each():
    from conftest import kernels_of

    from zyx.sorting import _stage_groups

    t = zyx.Tensor(np.random.default_rng(5).standard_normal((2, 16)).astype(np.float32))
    ks = kernels_of(t.argsort(-1))
    groups = [g for k in (2, 4, 8, 16) for g in _stage_groups(k)]
    assert sum(f for _, f in groups) == 4 * 5 // 2  # log2(16) (log2(16) + 1) / 2 stages
    assert len(ks) == len(groups) == 7  # keys and positions stored by one kernel per group of stages


def assert_topk_is_the_sorts_first(x: np.ndarray, k: int, largest: bool, device: str) -> None:
    """``topk`` of the rows of ``x`` (and of its transpose along dim 0): the positions of the stable sort's first
    ``k`` and the values there."""
    values, indices = zyx.Tensor(x, device=device).topk(k, largest=largest)
    want = np.array([reference_order(row, largest)[:k] for row in x.astype(np.float64)])
    np.testing.assert_array_equal(indices.numpy(), want)
    np.testing.assert_array_equal(values.numpy(), np.take_along_axis(x, want, -1))
    inner = zyx.Tensor(np.ascontiguousarray(x.T), device=device).topk(k, dim=0, largest=largest)
    np.testing.assert_array_equal(inner.indices.numpy(), want.T)


@pytest.mark.parametrize("dtype,n,k", [("float32", 100, 5), ("float64", 1000, 8), ("int32", 64, 4),
                                       ("bool", 300, 3), ("float16", 200, 6), ("bfloat16", 64, 4),
                                       ("int64", 128, 5), ("uint8", 64, 4)])
@pytest.mark.parametrize("largest", [True, False])
def test_small_topk_selects_in_sort_order(device, dtype, n, k, largest):
    """A topk with few elements (``k`` at most the network's stages) takes ``k`` selection passes instead of the
    sort: the same positions as the stable sort's first ``k`` (ties by position, -0.0 equal to 0.0,
    NaN first for the largest and last for the smallest; the integer extremes, which the passes also use as fill),
    along an inner axis too."""
    from zyx import sorting

    levels = (n - 1).bit_length()
    assert k * sorting.SELECT_STAGE_FRACTION <= levels * (levels + 1) // 2  # the selection path
    assert_topk_is_the_sorts_first(data((3, n), dtype, n + k), k, largest, device)


@pytest.mark.parametrize("dtype,n,k", [("float32", 300, 5), ("float64", 1000, 8), ("int32", 512, 4),
                                       ("bool", 300, 3), ("float16", 200, 6), ("uint8", 640, 7)])
@pytest.mark.parametrize("largest", [True, False])
def test_long_rows_topk_picks_blocks_first(device, monkeypatch, dtype, n, k, largest):
    """Rows of at least 16 k elements (here of any total size) select among the elements of the k blocks whose
    first elements come first: the same positions as the stable sort's first k (ties, NaN, -0.0, the integer
    extremes), along an inner axis too."""
    from zyx import sorting

    calls = []
    blocks = sorting._block_candidates
    monkeypatch.setattr(sorting, "BLOCK_MIN_ELEMENTS", 0)
    monkeypatch.setattr(sorting, "_block_candidates", lambda *a: calls.append(a) or blocks(*a))
    assert_topk_is_the_sorts_first(data((3, n), dtype, n + k), k, largest, device)
    assert len(calls) == 2  # the block path, both times


@pytest.mark.parametrize("dtype", ["float32", "int64"])
@pytest.mark.parametrize("largest", [True, False])
def test_large_topk_sorts(device, dtype, largest):
    """A topk with more elements than the network has stages (12 of 16: 10 stages) takes the sort's first ``k``."""
    from zyx import sorting

    n, k = 16, 12
    levels = (n - 1).bit_length()
    assert k * sorting.SELECT_STAGE_FRACTION > levels * (levels + 1) // 2  # the network path
    x = data((3, n), dtype, 11)
    values, indices = zyx.Tensor(x, device=device).topk(k, largest=largest)
    want = np.array([reference_order(row, largest)[:k] for row in x.astype(np.float64)])
    np.testing.assert_array_equal(indices.numpy(), want)
    np.testing.assert_array_equal(values.numpy(), np.take_along_axis(x, want, -1))


def test_selected_topk_carries_gradients_as_torch(device):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(5).standard_normal((4, 200))
    matches_torch(lambda a: a.topk(5, dim=1).values * 3, lambda a: torch.topk(a, 5, dim=1).values * 3, [x], device)

"""einsum, tril/triu, roll, norm and outer: values and float64 gradients against PyTorch on every device."""

from __future__ import annotations

import math

import numpy as np
import pytest
from torch_parity import matches_torch

import zyx

torch = pytest.importorskip("torch")


_rng = np.random.default_rng(0)


def _r(*shape: int) -> np.ndarray:
    return _rng.standard_normal(shape)


EINSUM_CASES = [
    ("ij,jk->ik", _r(3, 4), _r(4, 5)), ("ij,jk", _r(3, 4), _r(4, 5)), ("bij,bjk->bik", _r(2, 3, 4), _r(2, 4, 5)),
    ("bhqd,bhkd->bhqk", _r(2, 3, 4, 5), _r(2, 3, 6, 5)), ("ij,kj->ki", _r(3, 4), _r(5, 4)),
    ("ii->i", _r(4, 4)), ("ii", _r(4, 4)), ("iij->ij", _r(3, 3, 2)), ("ij->ji", _r(3, 4)), ("ji", _r(2, 3)),
    ("ij->", _r(3, 4)), ("i,i->", _r(5), _r(5)), ("i,j->ij", _r(3), _r(4)), ("ij,ij->ij", _r(3, 4), _r(3, 4)),
    ("ab,cd->", _r(2, 3), _r(4, 5)), ("ba,ab", _r(2, 3), _r(3, 2)),
    ("...ij,...jk->...ik", _r(2, 3, 4), _r(4, 5)), ("...i,...i->...", _r(2, 3, 4), _r(3, 4)),
    ("ijk,ikl,ilm->ijm", _r(2, 3, 4), _r(2, 4, 5), _r(2, 5, 6)), ("i,i,i->", _r(4), _r(4), _r(4)),
    ("bij,jk->bik", _r(1, 3, 4), _r(4, 5)), ("ij,kj->ik", _r(3, 1), _r(4, 5)),
]


@pytest.mark.parametrize("case", EINSUM_CASES, ids=[c[0] for c in EINSUM_CASES])
def test_einsummatches_torch(device, case):
    eq, *arrays = case
    matches_torch(lambda *xs: zyx.einsum(eq, *xs), lambda *ts: torch.einsum(eq, *ts), arrays, device)


def test_einsum_contractions_are_library_gemms():
    q = zyx.Tensor(np.ones((2, 3, 64, 32), np.float32)).realize()
    k = zyx.Tensor(np.ones((2, 3, 48, 32), np.float32)).realize()
    kinds = [launch.kind for launch in zyx.debug.schedule(zyx.einsum("bhqd,bhkd->bhqk", q, k))]
    assert kinds == ["library"], kinds
    assert zyx.einsum("ij,jk", [q[0, 0], k[0, 0].T]).shape == (64, 48)  # operands as one list


def test_einsum_errors_name_the_problem():
    a, b = zyx.Tensor(np.ones((3, 4))), zyx.Tensor(np.ones((5, 6)))
    with pytest.raises(ValueError, match=r"subscript 'j' has size 4 and 5 in 'ij,jk->ik'"):
        zyx.einsum("ij,jk->ik", a, b)
    with pytest.raises(ValueError, match=r"subscripts 'ijk' do not fit an operand of shape \(3, 4\)"):
        zyx.einsum("ijk->i", a)
    with pytest.raises(ValueError, match="has 2 operand subscripts for 1 operands"):
        zyx.einsum("ij,jk", a)
    with pytest.raises(ValueError, match="output subscripts 'iz' must be distinct and appear in an input"):
        zyx.einsum("ij->iz", a)
    with pytest.raises(ValueError, match="unknown characters"):
        zyx.einsum("i1->i", a)


X = _r(3, 4, 5)


@pytest.mark.parametrize("name, fz, ft", [
    ("tril", lambda x: x.tril(), lambda x: x.tril()),
    ("tril -1", lambda x: zyx.tril(x, -1), lambda x: torch.tril(x, -1)),
    ("triu 2", lambda x: x.triu(2), lambda x: x.triu(2)),
    ("triu -9", lambda x: x.triu(-9), lambda x: x.triu(-9)),
    ("roll", lambda x: x.roll(2, 1), lambda x: x.roll(2, 1)),
    ("roll several", lambda x: zyx.roll(x, (1, -7), (2, 0)), lambda x: torch.roll(x, (1, -7), (2, 0))),
    ("roll flat", lambda x: x.roll(-13), lambda x: x.roll(-13)),
    ("norm", lambda x: x.norm(), lambda x: x.norm()),
    ("norm dim", lambda x: x.norm(dim=1), lambda x: x.norm(dim=1)),
    ("norm 1", lambda x: x.norm(1, (0, 2)), lambda x: x.norm(1, (0, 2))),
    ("norm inf keepdim", lambda x: x.norm(math.inf, 2, True), lambda x: x.norm(math.inf, 2, True)),
    ("norm -inf", lambda x: x.norm(-math.inf, 0), lambda x: x.norm(-math.inf, 0)),
    ("norm 3", lambda x: zyx.norm(x, 3, -1), lambda x: torch.norm(x, 3, -1)),
    ("norm 0.5", lambda x: x.norm(0.5), lambda x: x.norm(0.5)),
])
def test_matrix_helpers_match_torch(device, name, fz, ft):
    matches_torch(fz, ft, [X], device)


def test_norm_of_zero_vectors_has_a_zero_gradient_and_counts_nonzeros(device):
    x = zyx.Tensor(np.array([[0.0, 0.0], [3.0, 4.0]]), device=device, requires_grad=True)
    x.norm(dim=1).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [[0, 0], [0.6, 0.8]], rtol=1e-15)  # PyTorch's subgradient at 0
    np.testing.assert_array_equal(x.norm(0, 1).numpy(), [0, 2])


def test_outer_and_the_errors(device):
    a, b = _r(3), _r(4)
    matches_torch(lambda x, y: x.outer(y), lambda x, y: torch.outer(x, y), [a, b], device)
    with pytest.raises(ValueError, match=r"outer: needs two 1-D tensors, got shapes \(3, 4, 5\) and \(4,\)"):
        zyx.Tensor(X).outer(zyx.Tensor(b))
    with pytest.raises(ValueError, match=r"tril: needs at least 2 dimensions, got shape \(3,\)"):
        zyx.Tensor(a).tril()
    with pytest.raises(ValueError, match=r"roll: shifts \(1, 2\) and dims \(0,\) differ in length"):
        zyx.Tensor(X).roll((1, 2), (0,))

"""Gradients against PyTorch (CPU) for every differentiable op; backward mechanics; fusion of backward."""

from __future__ import annotations

import numpy as np
import pytest

import zyx

torch = pytest.importorskip("torch")

RTOL, ATOL = 1e-4, 1e-5  # float32 gradients: both sides round differently along long chains


def _check(fz, ft, *arrays, device="host", rtol=RTOL, atol=ATOL, seed=0):
    """loss = sum(f(x...) * w) with a random w; compare every input's gradient with PyTorch's."""
    zs = [zyx.Tensor(a, device=device, requires_grad=a.dtype.kind == "f") for a in arrays]
    ts = [torch.tensor(a, requires_grad=a.dtype.kind == "f") for a in arrays]
    out_z, out_t = fz(*zs), ft(*ts)
    w = np.random.default_rng(seed).standard_normal(tuple(out_t.shape)).astype(np.float32)
    (out_z * zyx.Tensor(w, device=device)).sum().backward()
    (out_t * torch.tensor(w)).sum().backward()
    np.testing.assert_allclose(out_z.numpy(), out_t.detach().numpy(), rtol=rtol, atol=atol)
    for z, t in zip(zs, ts):
        if t.grad is not None:
            assert z.grad is not None
            np.testing.assert_allclose(z.grad.numpy(), t.grad.numpy(), rtol=rtol, atol=atol)


def _r(shape, lo=-2.0, hi=2.0, seed=1):
    return np.random.default_rng(seed).uniform(lo, hi, size=shape).astype(np.float32)


UNARY = [
    ("neg", lambda x: -x, lambda x: -x, (-2, 2)),
    ("exp", lambda x: x.exp(), torch.exp, (-2, 2)),
    ("exp2", lambda x: x.exp2(), torch.exp2, (-2, 2)),
    ("log", lambda x: x.log(), torch.log, (0.2, 3)),
    ("log2", lambda x: x.log2(), torch.log2, (0.2, 3)),
    ("sqrt", lambda x: x.sqrt(), torch.sqrt, (0.2, 3)),
    ("rsqrt", lambda x: x.rsqrt(), torch.rsqrt, (0.2, 3)),
    ("reciprocal", lambda x: x.reciprocal(), torch.reciprocal, (0.5, 3)),
    ("sin", lambda x: x.sin(), torch.sin, (-3, 3)),
    ("cos", lambda x: x.cos(), torch.cos, (-3, 3)),
    ("tan", lambda x: x.tan(), torch.tan, (-1, 1)),
    ("tanh", lambda x: x.tanh(), torch.tanh, (-3, 3)),
    ("sigmoid", lambda x: x.sigmoid(), torch.sigmoid, (-5, 5)),
    ("relu", lambda x: x.relu(), torch.relu, (-2, 2)),
    ("leaky_relu", lambda x: x.leaky_relu(0.1), lambda x: torch.nn.functional.leaky_relu(x, 0.1), (-2, 2)),
    ("gelu", lambda x: x.gelu(), torch.nn.functional.gelu, (-3, 3)),
    ("gelu_tanh", lambda x: x.gelu("tanh"), lambda x: torch.nn.functional.gelu(x, approximate="tanh"), (-3, 3)),
    ("silu", lambda x: x.silu(), torch.nn.functional.silu, (-3, 3)),
    ("softplus", lambda x: x.softplus(), torch.nn.functional.softplus, (-5, 5)),
    ("abs", lambda x: x.abs(), torch.abs, (-2, 2)),
    ("erf", lambda x: x.erf(), torch.erf, (-2, 2)),
    ("clip", lambda x: x.clip(-0.5, 0.7), lambda x: x.clamp(-0.5, 0.7), (-2, 2)),
    ("square", lambda x: x**2, lambda x: x**2, (-2, 2)),
    ("pow3", lambda x: x**3.0, lambda x: x**3.0, (0.2, 2)),
]


@pytest.mark.parametrize("name,fz,ft,domain", UNARY, ids=[u[0] for u in UNARY])
def test_unary_grads(name, fz, ft, domain):
    _check(fz, ft, _r((5, 6), *domain))


BINARY = [
    ("add", lambda a, b: a + b, lambda a, b: a + b),
    ("sub", lambda a, b: a - b, lambda a, b: a - b),
    ("mul", lambda a, b: a * b, lambda a, b: a * b),
    ("div", lambda a, b: a / b, lambda a, b: a / b),
    ("pow", lambda a, b: a.abs() ** b, lambda a, b: a.abs() ** b),
    ("maximum", lambda a, b: a.maximum(b), torch.maximum),
    ("minimum", lambda a, b: a.minimum(b), torch.minimum),
    ("where", lambda a, b: zyx.where(a > b, a * 2, b), lambda a, b: torch.where(a > b, a * 2, b)),
]


@pytest.mark.parametrize("name,fz,ft", BINARY, ids=[b[0] for b in BINARY])
def test_binary_grads_with_broadcasting(name, fz, ft):
    a = _r((4, 5), 0.5, 2, seed=2)
    b = _r((5,), 0.5, 2, seed=3)
    _check(fz, ft, a, b)


def test_max_min_ties_split_like_pytorch():
    a = np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]], np.float32)
    _check(lambda x: x.max(1), lambda x: x.amax(1), a)
    _check(lambda x: x.min(), lambda x: x.amin(), a)
    b = np.array([[1.0, 3.0, 0.0], [2.0, 1.0, 2.0]], np.float32)
    _check(lambda x, y: x.maximum(y), torch.maximum, a, b)


def test_prod_and_cumprod_grads_with_zeros_like_pytorch():
    """Found by the gradient fuzzer: the product of the others was y / x, NaN at every 0 (where PyTorch gives the
    product of the nonzero others for a single 0, and 0 for two or more)."""
    x = np.array([[0.0, 2.0, 3.0, 1.5], [1.0, 0.0, 0.0, 2.0], [2.0, 0.5, 3.0, -1.0], [0.0, 0.0, 0.0, 0.0]],
                 np.float32)
    _check(lambda t: t.prod(1), lambda t: t.prod(1), x)
    _check(lambda t: t.prod(), lambda t: t.prod(), x[:1])
    for row in ([2.0, 0.0, 3.0, 0.0, 5.0], [0.0, 2.0, 0.5, 3.0, 1.0], [1.5, 2.0, 3.0, 0.0, 0.0]):
        _check(lambda t: t.cumprod(0), lambda t: t.cumprod(0), np.array(row, np.float32))
    _check(lambda t: t.cumprod(1), lambda t: t.cumprod(1), x)


REDUCE = [
    ("sum", lambda x: x.sum(1), lambda x: x.sum(1)),
    ("sum_all", lambda x: x.sum(), lambda x: x.sum()),
    ("sum_keep", lambda x: x.sum((0, 2), keepdim=True), lambda x: x.sum((0, 2), keepdim=True)),
    ("mean", lambda x: x.mean(-1), lambda x: x.mean(-1)),
    ("max", lambda x: x.max(2), lambda x: x.amax(2)),
    ("min", lambda x: x.min(0), lambda x: x.amin(0)),
    ("prod", lambda x: x.prod(1), lambda x: x.prod(1)),
    ("var", lambda x: x.var(1), lambda x: x.var(1, correction=0)),
    ("std", lambda x: x.std(1, correction=1), lambda x: x.std(1)),
    ("logsumexp", lambda x: x.logsumexp(2), lambda x: torch.logsumexp(x, 2)),
    ("softmax", lambda x: x.softmax(-1), lambda x: torch.softmax(x, -1)),
    ("log_softmax", lambda x: x.log_softmax(1), lambda x: torch.log_softmax(x, 1)),
    ("cumsum", lambda x: x.cumsum(1), lambda x: x.cumsum(1)),
]


@pytest.mark.parametrize("name,fz,ft", REDUCE, ids=[r[0] for r in REDUCE])
def test_reduce_grads(name, fz, ft):
    _check(fz, ft, _r((3, 4, 5), 0.5, 1.5))


MOVEMENT = [
    ("reshape", lambda x: x.reshape(6, 10), lambda x: x.reshape(6, 10)),
    ("permute", lambda x: x.permute(2, 0, 1), lambda x: x.permute(2, 0, 1)),
    ("transpose", lambda x: x.transpose(0, 2), lambda x: x.transpose(0, 2)),
    ("expand", lambda x: x[:, :1].expand(3, 4, 5), lambda x: x[:, :1].expand(3, 4, 5)),
    ("pad", lambda x: x.pad(((1, 0), (0, 2), (1, 1))), lambda x: torch.nn.functional.pad(x, (1, 1, 0, 2, 1, 0))),
    ("slice", lambda x: x[1:, ::2, 1:4], lambda x: x[1:, ::2, 1:4]),
    ("neg_step", lambda x: x[::-1, 3:0:-2], lambda x: x.flip(0)[:, [3, 1]]),
    ("flip", lambda x: x.flip((0, 2)), lambda x: x.flip((0, 2))),
    ("index", lambda x: x[1, :, 2], lambda x: x[1, :, 2]),
    ("gather", lambda x: x[:, [0, 2, 2, 3]], lambda x: x[:, [0, 2, 2, 3]]),
    ("gather_nd", lambda x: x[np.array([[0, 1], [2, 2]])], lambda x: x[torch.tensor([[0, 1], [2, 2]])]),
    ("cat", lambda x: zyx.cat([x, x * 2], 1), lambda x: torch.cat([x, x * 2], 1)),
    ("stack", lambda x: zyx.stack([x, x.exp()], -1), lambda x: torch.stack([x, x.exp()], -1)),
    ("split", lambda x: x.split([1, 3], 1)[1], lambda x: x.split([1, 3], 1)[1]),
    ("repeat", lambda x: x.repeat(2, 1, 1), lambda x: x.repeat(2, 1, 1)),
    ("squeeze", lambda x: x[:, :1].squeeze(1), lambda x: x[:, :1].squeeze(1)),
    ("contiguous", lambda x: x.T.contiguous(), lambda x: x.permute(2, 1, 0).contiguous()),
]


@pytest.mark.parametrize("name,fz,ft", MOVEMENT, ids=[m[0] for m in MOVEMENT])
def test_movement_grads(name, fz, ft):
    _check(fz, ft, _r((3, 4, 5)))


@pytest.mark.parametrize("sa,sb", [((4, 3), (3, 5)), ((3,), (3, 2)), ((2, 4, 3), (3, 5)), ((2, 4, 3), (2, 3, 5)),
                                   ((5,), (5,)), ((1, 4, 3), (6, 3, 2))])
def test_matmul_grads(sa, sb):
    _check(lambda a, b: a @ b, lambda a, b: a @ b, _r(sa, seed=4), _r(sb, seed=5))


def test_cast_grad():
    _check(lambda x: (x.cast(zyx.float64) * 3).cast(zyx.float32), lambda x: (x.double() * 3).float(), _r((3, 3)))


def test_accumulation_and_gradient_argument():
    x = zyx.Tensor(_r((3,)), requires_grad=True)
    (x * 2).sum().backward()
    (x * 3).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, 5.0, np.float32))
    y = zyx.Tensor(_r((2, 2)), requires_grad=True)
    (y * y).backward(zyx.Tensor(np.ones((2, 2), np.float32)))
    np.testing.assert_allclose(y.grad.numpy(), 2 * y.numpy(), rtol=1e-6)


def test_no_grad_detach_and_errors():
    x = zyx.Tensor(_r((3,)), requires_grad=True)
    with zyx.no_grad():
        y = x * 2
    assert not y.requires_grad and y._ctx is None
    assert not x.detach().requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        y.sum().backward()
    with pytest.raises(RuntimeError, match="non-scalar output"):
        (x * 2).backward()
    z = x * 2
    z.sum().backward()
    assert x.grad is not None


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.bool_])
def test_only_float_tensors_can_require_grad(dtype):
    """PyTorch's rule: an integer or boolean tensor carries no gradient, and asking for one is an error that names
    the dtype and the fix (not a flag silently set)."""
    data = np.ones(3, dtype)
    with pytest.raises(TypeError, match="only floating-point tensors can require gradients.*t.float()"):
        zyx.Tensor(data, requires_grad=True)
    t = zyx.Tensor(data)
    with pytest.raises(TypeError, match="only floating-point"):
        t.requires_grad_()
    assert not t.requires_grad
    assert not t.requires_grad_(False).requires_grad
    assert zyx.Tensor(data, dtype="float32", requires_grad=True).requires_grad


def test_shared_subexpression_gradient():
    _check(lambda x: (x.exp() * x.exp().sum(1, keepdim=True)).log(),
           lambda x: (x.exp() * x.exp().sum(1, keepdim=True)).log(), _r((3, 4)))


def test_backward_fuses():
    x = zyx.Tensor(_r((64, 32)), requires_grad=True)
    y = zyx.Tensor(_r((64, 32)), requires_grad=True)
    ((x.exp() * y).relu().sum()).backward()
    steps = zyx.debug.schedule(x.grad, y.grad)
    assert [s.kind for s in steps] == ["generated"]  # both gradients in one elementwise kernel
    assert len(zyx.debug.schedule(zyx.Tensor(_r((8, 8)), requires_grad=True).softmax(-1).sum())) <= 2


# ---- matmul as one autograd node ----------------------------------------------------------------------------------

@pytest.mark.parametrize("shapes,transpose", [(((5, 7), (7, 3)), (False, False)), (((5, 7), (3, 7)), (False, True)),
                                              (((7, 5), (7, 3)), (True, False)), (((7, 5), (3, 7)), (True, True)),
                                              (((2, 4, 6), (2, 6, 3)), (False, False)),
                                              (((2, 6, 4), (2, 3, 6)), (True, True))])
def test_matmul_node_gradients_match_torch(shapes, transpose):
    def f(lib):
        def g(a, b):
            a = a.transpose(-1, -2) if transpose[0] else a
            b = b.transpose(-1, -2) if transpose[1] else b
            return a @ b
        return g

    _check(f("zyx"), f("torch"), _r(shapes[0]), _r(shapes[1], seed=2))


def test_matmul_node_builds_the_composite_graph_and_a_contiguous_weight_gradient():
    """``MatMul`` builds the classes of the composite path (so the same kernels); Linear's weight (read as
    ``weight.T``) gets its gradient in its own layout, not as a transposed view."""
    from zyx import autograd as F
    from zyx.ops import Ops

    x = zyx.Tensor(_r((4, 6)), requires_grad=True)
    w = zyx.Tensor(_r((3, 6), seed=3), requires_grad=True)
    fused = x @ w.T
    with zyx.no_grad():
        xr, wt = x.reshape(4, 1, 6), w.T.transpose(-1, -2).reshape(1, 3, 6)  # Tensor.matmul's composite
        composite = (xr * wt).sum(-1)
    assert fused.cls is composite.cls
    assert isinstance(fused._ctx, F.MatMul)
    fused.sum().backward()
    assert w.grad.cls.op is not Ops.PERMUTE or w.grad.cls.realized
    np.testing.assert_allclose(w.grad.numpy(), np.ones((4, 3), np.float32).T @ x.numpy(), rtol=1e-5)


@pytest.mark.parametrize("shape,axis", [((5, 7), -1), ((5, 7), 0), ((2, 3, 4), 1), ((6,), 0)])
def test_log_softmax_node_gradients_match_torch(shape, axis):
    _check(lambda x: x.log_softmax(axis), lambda x: x.log_softmax(axis), _r(shape, -4, 4))


def test_log_softmax_node_keeps_infinite_entries_finite_elsewhere():
    from zyx import autograd as F

    x = np.array([[-np.inf, 0.0, 1.0], [2.0, -np.inf, -np.inf]], np.float32)
    z = zyx.Tensor(x, requires_grad=True)
    out = z.log_softmax(-1)
    assert isinstance(out._ctx, F.LogSoftmax)
    ref = torch.tensor(x).log_softmax(-1).numpy()
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-6)
    (out * zyx.Tensor(np.where(np.isinf(x), 0, 1).astype(np.float32))).sum().backward()
    assert np.isfinite(z.grad.numpy()).all()


def test_sum_over_an_empty_axis_keeps_the_gradient_path(device):
    """PyTorch: the sum of an empty tensor is 0 and backward gives the (empty) zero gradient."""
    x = zyx.Tensor(np.zeros((0, 3), np.float32), device=device, requires_grad=True)
    y = x.sum(0) * 2 + x.prod(0)
    np.testing.assert_array_equal(y.numpy(), [1.0, 1.0, 1.0])
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 3)
    with zyx.no_grad():
        assert not x.sum().requires_grad

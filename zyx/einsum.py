"""``einsum``: Einstein summation as NumPy and PyTorch spell it, lowered to tensor ops.

Operands are contracted left to right, two at a time. Each pairwise step sums out the subscripts only one side
uses and nothing later needs, then is one (batched) ``matmul``: batch subscripts (both sides, needed later) lead,
the contracted ones (both sides, not needed) meet in the inner axis. So every contraction reaches the matmul
matcher (BLAS or cuDNN, or a generated GEMM) and its gradient is matmul's. A subscript repeated within one operand
takes its diagonal. Size-1 axes broadcast against their partners, as PyTorch allows.
"""

from __future__ import annotations

import math
import string

from zyx.tensor import Tensor

_LETTERS = set(string.ascii_letters)


def einsum(equation: str, *operands) -> Tensor:
    """``einsum("ij,jk->ik", a, b)``: the sum over every subscript missing from the output of the product of the
    operands' elements; implicit output (no ``->``): the subscripts used once, in alphabetical order. ``...``
    stands for the broadcast leading axes. The operands may also be given as one list."""
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if not operands:
        raise ValueError("einsum: needs at least one operand")
    xs = [x if isinstance(x, Tensor) else Tensor(x) for x in operands]
    inputs, output = _parse(equation.replace(" ", ""), xs)
    sizes: dict[str, int] = {}
    for x, subs in zip(xs, inputs):
        for s, n in zip(subs, x.shape):
            if sizes.get(s, 1) != 1 and n not in (1, sizes[s]):
                raise ValueError(f"einsum: subscript {s!r} has size {sizes[s]} and {n} in {equation!r} (operand "
                                 f"shapes {[x.shape for x in xs]})")
            sizes[s] = n if sizes.get(s, 1) == 1 else sizes[s]
    terms = [_diagonal(x, subs) for x, subs in zip(xs, inputs)]
    x, subs = terms[0]
    for i, (y, ysubs) in enumerate(terms[1:], 1):
        later = set(output).union(*(t[1] for t in terms[i + 1:]))
        x, subs = _contract(x, subs, y, ysubs, later)
    x, subs = _sum_out(x, subs, set(output))
    x = x.permute(*[subs.index(s) for s in output]) if subs != output else x
    return x.expand(*[sizes[s] for s in output]) if x.shape != tuple(sizes[s] for s in output) else x


def _parse(eq: str, xs: list[Tensor]) -> tuple[list[str], str]:
    """Each operand's subscripts (``...`` replaced by fresh upper-case letters, right-aligned) and the output's."""
    lhs, arrow, rhs = eq.partition("->")
    parts = lhs.split(",")
    if len(parts) != len(xs):
        raise ValueError(f"einsum: {eq!r} has {len(parts)} operand subscripts for {len(xs)} operands")
    used = set(eq)
    fresh = [c for c in string.ascii_uppercase[::-1] + string.ascii_lowercase[::-1] if c not in used]
    ell_n = 0
    for p, x in zip(parts, xs):
        if "..." in p:
            ell_n = max(ell_n, x.ndim - len(p.replace("...", "")))
    ell = "".join(fresh[:ell_n][::-1])
    inputs = []
    for p, x in zip(parts, xs):
        if "..." in p:
            k = x.ndim - len(p.replace("...", ""))
            p = p.replace("...", ell[ell_n - k:] if k > 0 else "")
        bad = set(p) - _LETTERS
        if bad or len(p) != x.ndim:
            raise ValueError(f"einsum: subscripts {p!r} do not fit an operand of shape {x.shape}"
                             + (f" (unknown characters {sorted(bad)})" if bad else ""))
        inputs.append(p)
    if arrow:
        out = rhs.replace("...", ell)
        unknown = set(out) - set("".join(inputs))
        if unknown or len(set(out)) != len(out):
            raise ValueError(f"einsum: output subscripts {rhs!r} must be distinct and appear in an input: {eq!r}")
    else:
        counts = "".join(inputs)
        out = ell + "".join(sorted(s for s in set(counts) if counts.count(s) == 1 and s not in ell))
    return inputs, out


def _diagonal(x: Tensor, subs: str) -> tuple[Tensor, str]:
    """``x`` with each repeated subscript reduced to one axis holding the diagonal."""
    while len(set(subs)) != len(subs):
        s = next(c for c in subs if subs.count(c) > 1)
        a, b = subs.index(s), subs.index(s, subs.index(s) + 1)
        n = x.shape[a]
        if x.shape[b] != n:
            raise ValueError(f"einsum: repeated subscript {s!r} has sizes {n} and {x.shape[b]}")
        eye = Tensor.eye(n, dtype=x.dtype, device=x._on_compute().device)
        eye = eye.reshape(*[n if i in (a, b) else 1 for i in range(x.ndim)])
        x, subs = (x * eye).sum(b), subs[:b] + subs[b + 1:]
    return x, subs


def _sum_out(x: Tensor, subs: str, keep: set[str]) -> tuple[Tensor, str]:
    gone = tuple(i for i, s in enumerate(subs) if s not in keep)
    if not gone:
        return x, subs
    return x.sum(gone), "".join(s for s in subs if s in keep)


def _contract(x: Tensor, xs: str, y: Tensor, ys: str, later: set[str]) -> tuple[Tensor, str]:
    """The product of two terms with every subscript outside ``later`` summed, as one batched matmul."""
    x, xs = _sum_out(x, xs, later | set(ys))
    y, ys = _sum_out(y, ys, later | set(xs))
    batch = [s for s in xs if s in ys and s in later]
    inner = [s for s in xs if s in ys and s not in later]
    left = [s for s in xs if s not in ys]
    right = [s for s in ys if s not in xs]
    xd, yd = dict(zip(xs, x.shape)), dict(zip(ys, y.shape))
    a = x.permute(*[xs.index(s) for s in batch + left + inner])
    b = y.permute(*[ys.index(s) for s in batch + inner + right])
    k = math.prod(max(xd[s], yd[s]) for s in inner)
    if any(xd[s] != yd[s] for s in inner):  # a size-1 contracted axis on one side: broadcast it first
        a = a.expand(*[xd[s] for s in batch + left] + [max(xd[s], yd[s]) for s in inner])
        b = b.expand(*[yd[s] for s in batch] + [max(xd[s], yd[s]) for s in inner] + [yd[s] for s in right])
    a = a.reshape(*[xd[s] for s in batch], math.prod(xd[s] for s in left), k)
    b = b.reshape(*[yd[s] for s in batch], k, math.prod(yd[s] for s in right))
    out = a @ b
    shape = [max(xd[s], yd[s]) for s in batch] + [xd[s] for s in left] + [yd[s] for s in right]
    return out.reshape(*shape), "".join(batch + left + right)

"""The host's blocked transposes (``opt.tile_transpose``): which kernels it applies to, the loops it makes, and
that every tile (and the pass off) gives NumPy's values bit for bit: transposes, permutes, batched, mixed with
elementwise work, every dtype, sizes the tiles divide and sizes they do not."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import kernels_of, passes_off

import zyx
from zyx import dtypes
from zyx.backends.base import DeviceInfo
from zyx.graph import schedule
from zyx.kernel import ir, opt
from zyx.kernel.render import CRenderer

HOST2 = DeviceInfo("host", "host", compute_units=2)


def _kernel(t: zyx.Tensor):
    (k,) = kernels_of(t)
    return k


def _rand(shape, dtype="float32", seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype in ("int8", "int32", "int64"):
        return rng.integers(-100, 100, shape).astype(dtype)
    x = rng.standard_normal(shape).astype(np.float32)
    return x.astype(np.dtype(dtype)) if dtype != "bfloat16" else x


def test_a_transpose_runs_in_64_square_blocks():
    """Tiles of 64 x 64, each in 8 x 8 blocks transposed through registers (``Kernel.transpose_block``): two block
    loops around the tile's loops, which run a constant 8 times each; one staged block per transposed load, read in
    the innermost loop. With ``transpose_block`` off, the plain tile loops."""
    k = opt.optimize(_kernel(zyx.Tensor(_rand((256, 192))).T.contiguous()), HOST2)
    assert [r.arg[1] for r in k.loops] == [192 // 64, 256 // 64, 64, 64] and k.parallel >= 1 and k.vector
    assert k.transpose_block == 8
    src = CRenderer().render(k)
    assert src.count("for (long long") == 4 and src.count("for (int r") == 2 and src.count("__builtin_shuffle") == 6
    assert re.search(r"p0\[v\d+\] = zt\d+\[r\d+_l \* 8 \+ r\d+_l\];", src)
    with passes_off("transpose_block"):
        k = opt.optimize(_kernel(zyx.Tensor(_rand((256, 192))).T.contiguous()), HOST2)
    assert k.transpose_block == 0 and CRenderer().render(k).count("for (long long") == 4


def test_which_loads_are_staged_in_register_blocks():
    """``ir.transposed_block_loads``: in ``x + x.T`` only the transposed read; float64 and int64 ones too (blocks of
    64-byte vectors); a float16 or 1-byte one leaves the tile loops plain, as does a segment with no load (a padded
    transpose's zeros; its data is staged)."""
    x = zyx.Tensor(_rand((128, 128)))
    k = opt.optimize(_kernel(x + x.T), HOST2)
    assert k.transpose_block == 8 and len(ir.transposed_block_loads(k)) == 1
    for dtype, block in (("float64", 8), ("int64", 8), ("float16", 0), ("int8", 0)):
        t = zyx.Tensor(_rand((128, 128), dtype))
        assert opt.optimize(_kernel(t.T.contiguous()), HOST2).transpose_block == block, dtype
    padded = opt.optimize(_kernel(zyx.Tensor(_rand((120, 128))).pad(((0, 8), (0, 0))).T.contiguous()), HOST2)
    assert padded.transpose_block == 8 and len(padded.then) == 1 and padded.then[0].transpose_block == 0


def test_which_kernels_are_tiled():
    x = zyx.Tensor(_rand((128, 96)))
    axes = opt._transpose_axes
    assert axes(opt.merge_loops(_kernel(x.T.contiguous()))) is not None
    assert axes(opt.merge_loops(_kernel(x * 2 + 1))) is None  # contiguous: nothing to block
    assert axes(opt.merge_loops(_kernel(x.T.sum(0)))) is None  # a reduce: the interchange pass's business
    y = zyx.Tensor(_rand((4, 32, 8, 16)))
    assert axes(opt.merge_loops(_kernel(y.permute(0, 2, 1, 3).contiguous()))) is None  # rows stay contiguous
    assert axes(opt.merge_loops(_kernel(y.permute(3, 1, 2, 0).contiguous()))) is not None
    assert "transpose_tile" in opt.search_space(_kernel(x.T.contiguous()), HOST2)
    assert "transpose_tile" not in opt.search_space(_kernel(x * 2), HOST2)


def test_sizes_no_tile_divides_keep_the_plain_loops():
    k = opt.optimize(_kernel(zyx.Tensor(_rand((33, 47))).T.contiguous()), HOST2)
    assert len(k.loops) == 2


CASES = {
    "transpose": (lambda x: x.T.contiguous(), lambda x: np.ascontiguousarray(x.T), (256, 192)),
    "plus_own_transpose_scaled": (lambda x: x + x.T * 2, lambda x: x + x.T * 2, (192, 192)),
    "flipped_transpose": (lambda x: x.flip(0).T.contiguous(), lambda x: np.ascontiguousarray(x[::-1].T), (128, 64)),
    "odd": (lambda x: x.T.contiguous(), lambda x: np.ascontiguousarray(x.T), (33, 47)),
    "plus_own_transpose": (lambda x: x + x.T, lambda x: x + x.T, (128, 128)),
    "transpose_affine": (lambda x: x.T * 3 - 1, lambda x: x.T * 3 - 1, (64, 320)),
    "batched": (lambda x: x.transpose(1, 2).contiguous(), lambda x: np.ascontiguousarray(x.transpose(0, 2, 1)),
                (3, 96, 64)),
    "permute_last_first": (lambda x: x.permute(2, 0, 1).contiguous(),
                           lambda x: np.ascontiguousarray(x.transpose(2, 0, 1)), (64, 32, 48)),
    "permute_4d": (lambda x: x.permute(3, 1, 2, 0).contiguous(),
                   lambda x: np.ascontiguousarray(x.transpose(3, 1, 2, 0)), (16, 8, 4, 32)),
}


@pytest.mark.parametrize("blocks", [True, False])
@pytest.mark.parametrize("tile", [None, 0, 8, 16, 32, 64, 128])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_tile_gives_numpys_bits(case, tile, blocks, monkeypatch):
    """Every tile, with the register-transposed blocks and without (``transpose_block``)."""
    build, ref, shape = CASES[case]
    x = _rand(shape)
    if tile is not None:
        real = opt.optimize
        monkeypatch.setattr(opt, "optimize", lambda k, info, params=None: real(k, info, {"transpose_tile": tile}))
    schedule.clear_cache()
    try:
        with passes_off(*(() if blocks else ("transpose_block",))):
            got = build(zyx.Tensor(x)).numpy()
    finally:
        schedule.clear_cache()
    np.testing.assert_array_equal(got, ref(x))


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16", "int8", "int32", "int64", "bool"])
def test_every_dtype(dtype):
    x = _rand((96, 64), "float32" if dtype in ("bfloat16", "bool") else dtype)
    t = zyx.Tensor(x, dtype=dtypes.to_dtype(dtype)) if dtype == "bfloat16" else zyx.Tensor(x > 0 if dtype == "bool"
                                                                                             else x)
    want = t.numpy().T
    k = opt.optimize(_kernel(t.T.contiguous()), HOST2)
    assert len(k.loops) == 4
    assert k.transpose_block == (0 if dtype in ("float16", "int8", "bool") else 8)
    np.testing.assert_array_equal(t.T.contiguous().numpy(), want)
    for off in ("transpose", "transpose_block"):
        with passes_off(off):
            np.testing.assert_array_equal(t.T.contiguous().numpy(), want)

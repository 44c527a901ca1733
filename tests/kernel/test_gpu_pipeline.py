"""The GPU launch as the result of IR passes (``zyx.kernel.gpu.GPU_PASSES``): each pass maps a kernel to a
kernel, the launch is the kernel's ``launch`` field (part of its identity, never a side table), and every pass
that only changes speed (``OPTIONAL_PASSES``) keeps the fuzzer's random programs equal to NumPy on ``cuda:0``
(the emulated driver without a GPU) when it is switched off, as they are with it on (``tests/test_fuzz.py``)."""

from __future__ import annotations

import dataclasses
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from conftest import compute_devices, gpu_passes_off, host_without_blas, kernels_of

import zyx
from zyx import utils
from zyx.kernel import gpu
from zyx.kernel.ir import Kernel
from zyx.kernel.render_cuda import CUDARenderer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fuzz_programs import compare, programs, run_zyx  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

INFO = gpu.reference_info()
needs_cuda = pytest.mark.skipif("cuda:0" not in compute_devices(), reason="no cuda:0 (GPU or emulator)")


def leaf(*shape: int, dtype: str = "float32") -> zyx.Tensor:
    return zyx.Tensor(np.zeros(shape, np.float32)).cast(dtype).realize()


# (input shapes, the program, the same in NumPy): one per layout and the segment path (column sum, row sum,
# softmax, an elementwise kernel that vectorizes, a concatenation: segments, a cumulative sum: scan) and one that
# each optional pass changes
PROGRAMS = {
    "col_sum": ([(4096, 512)], lambda x: x.sum(0), lambda x: x.sum(0)),
    "row_sum": ([(512, 4096)], lambda x: x.sum(1), lambda x: x.sum(1)),
    "softmax": ([(256, 1000)], lambda x: x.softmax(-1),
                lambda x: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1,
                                                                                                 keepdims=True)),
    "elementwise": ([(1 << 20,)], lambda x: x * 2 + 1, lambda x: x * 2 + 1),
    "cat": ([(1000,), (1004,), (17,)], lambda a, b, c: zyx.cat([a, b, c]) + 1,
            lambda a, b, c: np.concatenate([a, b, c]) + 1),
    "cumsum": ([(64, 37)], lambda x: x.cumsum(1), lambda x: x.cumsum(1)),
    "elementwise_2d": ([(64, 1024)], lambda x: x * 2, lambda x: x * 2),
    # sum over a transposed view's two axes: the reduce loop its loads step through by 40 goes inside
    "transposed_sum": ([(64, 300, 40)], lambda x: x.permute(2, 1, 0).sum((1, 2)),
                       lambda x: x.transpose(2, 1, 0).sum((1, 2))),
    # out[i, j] = sum_r x[r, j, i]: output loop i (stride 1) goes inside, so a warp's lanes read a row
    "transposed_columns": ([(300, 8, 64)], lambda x: x.permute(2, 1, 0).sum(2), lambda x: x.transpose(2, 1, 0).sum(2)),
    # a sum over the batch of sums over the image: one reduce over both
    "nested_sum": ([(8, 64, 14, 14)], lambda x: x.sum((2, 3)).sum(0), lambda x: x.sum((2, 3)).sum(0)),
    # exact float32 (no TF32): register tiles over shared tiles on CUDA cores, the bias and relu in the epilogue
    "matmul": ([(288, 64), (64, 320), (320,)], lambda a, b, c: (a @ b + c).relu(),
               lambda a, b, c: np.maximum(a @ b + c, 0)),
    # attention's output product, heads merged with the columns by the reshape: split back into a batch loop
    "heads_product": ([(2, 4, 64, 32), (2, 4, 32, 16)],
                      lambda p, v: (p @ v).permute(0, 2, 1, 3).reshape(2, 64, 64),
                      lambda p, v: (p @ v).transpose(0, 2, 1, 3).reshape(2, 64, 64)),
}
# the sample each optional pass changes (``test_an_optional_pass_changes_some_kernel``)
CHANGED_BY = {"split_segments": "cat", "merge_loops": "elementwise_2d", "merge_reduces": "nested_sum",
              "split_contraction_loops": "heads_product",
              "order_reduce_ranges": "transposed_sum",
              "order_output_loops": "transposed_columns", "vectorize": "elementwise"}


def sample_kernels() -> dict[str, Kernel]:
    """The kernel of each program (the one with a reduce, else the largest) and an f16 matmul's (mma), BLAS off."""
    def one(t: zyx.Tensor) -> Kernel:
        ks = kernels_of(t)
        return max(ks, key=lambda k: (bool(k.reduces()), k.size))

    with host_without_blas():  # the matmuls' products are generated kernels, as on cuda
        out = {name: one(f(*(leaf(*s) for s in shapes))) for name, (shapes, f, _) in PROGRAMS.items()}
        out["mma"] = one(leaf(256, 128, dtype="float16") @ leaf(128, 64, dtype="float16"))
    return out


KERNELS = sample_kernels()


def test_pass_names_are_unique_and_the_optional_ones_exist():
    assert len(set(gpu.PASS_NAMES)) == len(gpu.PASS_NAMES)
    assert gpu.OPTIONAL_PASSES < set(gpu.PASS_NAMES)
    assert gpu.PASS_NAMES[0] == "normalize" and "choose_layout" in gpu.PASS_NAMES
    assert gpu.PASS_NAMES.index("choose_layout") < gpu.PASS_NAMES.index("vectorize") < gpu.PASS_NAMES.index(
        "size_grid")


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_the_launch_is_built_pass_by_pass(name):
    """Before ``choose_layout`` no launch; after it a strategy and block but no grid (``geometry`` refuses the
    partial launch with a message naming the fix); ``size_grid`` completes it; running the passes one by one
    gives what ``optimize`` gives."""
    k = KERNELS[name]
    assert k.launch is None
    staged = k
    for pass_name, fn in gpu.GPU_PASSES:
        staged = fn(staged, INFO, {})
        partial = gpu.optimize(k, INFO, until=pass_name)
        assert partial == staged, pass_name
        parts = (staged, *staged.then)
        if gpu.PASS_NAMES.index(pass_name) < gpu.PASS_NAMES.index("choose_layout"):
            assert all(p.launch is None for p in parts), pass_name
        elif gpu.PASS_NAMES.index(pass_name) < gpu.PASS_NAMES.index("size_grid"):
            assert all(p.launch is not None and p.launch.grid is None for p in parts), pass_name
            with pytest.raises(ValueError, match="gpu.optimize"):
                gpu.geometry(staged)
        else:
            assert all(1 <= gpu.geometry(p).grid[0] <= INFO.max_global_work[0] for p in parts), pass_name
    assert staged == gpu.optimize(k, INFO)
    # no host decision rides along on a GPU kernel
    assert (staged.reduce_lanes, staged.upcast_rows, staged.vector_acc, staged.vector_block, staged.gemm) == \
        (0, 1, None, None, None)


def test_the_layouts_the_samples_were_picked_for():
    got = {name: gpu.geometry(gpu.optimize(k, INFO)) for name, k in KERNELS.items()}
    assert got["col_sum"].strategy == "columns" and got["row_sum"].strategy == "group"
    assert got["softmax"].strategy == "group" and got["mma"].strategy == "mma" and got["matmul"].strategy == "simt"
    assert got["elementwise"].strategy == "thread" and got["elementwise"].vector == 4
    assert got["cumsum"].strategy == "thread" and got["cumsum"].split == 1
    cat = gpu.optimize(KERNELS["cat"], INFO)
    assert len(cat.then) == 2 and len({gpu.geometry(p).block for p in (cat, *cat.then)}) == 1


def test_the_launch_is_part_of_the_kernels_identity():
    """Kernels with different launches differ (equality and hash): caches keyed by the kernel never confuse
    them; the same parameters give equal kernels."""
    k = KERNELS["elementwise"]
    a, b = gpu.optimize(k, INFO, {"threads": 64}), gpu.optimize(k, INFO, {"threads": 256})
    assert a.loops == b.loops and a.stores == b.stores and a.launch.block != b.launch.block
    assert a != b and hash(a) != hash(b)
    again = gpu.optimize(k, INFO, {"threads": 64})
    assert again == a and hash(again) == hash(a) and again is not a


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_passes_leave_their_input_alone(name):
    """Every pass returns a new kernel; the one it was given (every field) is unchanged, so a
    partial pipeline can be resumed or rerun (the autotuner runs it once per candidate)."""
    k = KERNELS[name]
    for _, fn in gpu.GPU_PASSES:
        before = [getattr(k, f.name) for f in dataclasses.fields(k)]
        out = fn(k, INFO, {})
        assert [getattr(k, f.name) for f in dataclasses.fields(k)] == before
        k = out


def test_reoptimizing_an_optimized_kernel_starts_afresh():
    """``normalize`` drops an earlier launch: a kernel optimized for one device and re-optimized for another
    gets the second device's launch (here: no tensor cores before sm_80)."""
    ko = gpu.optimize(KERNELS["mma"], INFO)
    old = gpu.reference_info(arch=(7, 5))
    assert gpu.geometry(gpu.optimize(ko, old)).strategy != "mma"
    assert gpu.optimize(ko, INFO) == ko


@pytest.mark.parametrize("name", sorted(gpu.OPTIONAL_PASSES))
def test_an_optional_pass_changes_some_kernel(name):
    """Each optional pass has an effect on the samples (so switching it off below tests something)."""
    def launch_of(k: Kernel) -> tuple:
        out = gpu.optimize(k, INFO)
        return out, CUDARenderer().render(out).source

    changed = []
    for sample, k in KERNELS.items():
        on = launch_of(k)
        with gpu_passes_off(name):
            off = launch_of(k)
        if on[1] != off[1]:
            changed.append(sample)
    assert CHANGED_BY[name] in changed, changed


@needs_cuda
@pytest.mark.parametrize("name", sorted(gpu.OPTIONAL_PASSES))
def test_programs_on_cuda_with_a_pass_on_and_off_equal_numpy(name, rng):
    """Every sample program (the one the pass changes among them) on ``cuda:0``, the pass on and off."""
    for sample, (shapes, f, ref) in PROGRAMS.items():
        xs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        want = ref(*(x.astype(np.float64) for x in xs))
        for off in ((), (name,)):
            with gpu_passes_off(*off):
                got = f(*(zyx.Tensor(x, device="cuda:0") for x in xs)).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=f"{sample}, {name} off: {bool(off)}")


@needs_cuda
@pytest.mark.parametrize("name", sorted(gpu.OPTIONAL_PASSES))
@pytest.mark.filterwarnings("ignore:The recursion limit will not be reset")
def test_fuzz_programs_with_a_pass_off_equal_numpy(name):
    """The differential fuzzer's random programs on ``cuda:0`` with the pass switched off: the results equal
    NumPy's as they do with it on (the default fuzz run), so the pass changes only speed."""
    @settings(max_examples=50, deadline=None, derandomize=True, database=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(prog=programs())
    def check(prog) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            got = run_zyx(prog, "cuda:0")
        errors = [f"v{i}: {m}" for i, g in zip(prog.outputs, got) if (m := compare(np.asarray(g), prog.vals[i]))]
        assert not errors, f"{name} off:\n" + prog.source("cuda:0") + "\n" + "\n".join(errors)

    outer, utils.KERNEL_LOG = utils.KERNEL_LOG, []
    try:
        with gpu_passes_off(name):
            check()
        logged = list(utils.KERNEL_LOG)
    finally:
        utils.KERNEL_LOG = outer
    assert logged
    if name in ("split_segments", "merge_loops"):  # the others change no kernel of these small programs (the
        with gpu_passes_off(name):  # heuristic vectorizes big ones, forced on in test_gpu_vector.py) and are
            off = [gpu.optimize(k, INFO) for k in logged]  # reached by the samples above
        assert any(gpu.optimize(k, INFO) != o for k, o in zip(logged, off)), f"no kernel is changed by {name}"


def test_debug_ir_logs_each_pass_that_changes_the_kernel(monkeypatch, capsys):
    monkeypatch.setattr(utils, "DEBUG", utils.FLAGS["ir"])
    gpu.optimize(KERNELS["elementwise_2d"], INFO)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "gpu pass" in ln]
    passes = [ln.split("gpu pass ")[1].split(":")[0] for ln in lines]
    assert passes == ["merge_loops", "choose_layout", "vectorize", "size_grid"], lines
    assert "thread items=32768 block=(256, 1, 1) grid=(128, 1, 1) vector=2" in lines[-1]

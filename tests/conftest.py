"""Shared fixtures: every op test runs on each compute device the registry finds (cross-backend parity)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil

import numpy as np
import pytest

import zyx
from zyx.backends.registry import registry


def _use_the_cuda_emulator() -> None:
    """Without a GPU, the op-parity tests run on ``cuda:0`` under the emulated driver when NVRTC and g++ are there
    (``ZYX_CUDA_EMULATE=0`` turns that off; a machine with a GPU tests the GPU). Tests that do not take a
    ``device`` keep running on the host, the default device they were written for."""
    if "ZYX_CUDA_EMULATE" not in os.environ:
        from zyx.backends.cuda import driver, nvrtc

        if driver.unavailable_reason() is not None and nvrtc.available() is None and shutil.which("g++"):
            os.environ["ZYX_CUDA_EMULATE"] = "1"
    if os.environ.get("ZYX_CUDA_EMULATE") == "1":
        os.environ.setdefault("ZYX_DEFAULT_DEVICE", "host")


_use_the_cuda_emulator()


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto`` (pyproject's addopts): two test processes at most, since each compiles kernels and runs OpenMP
    ones on every core; one where a real GPU is present (the memory tests read the device's free memory, which
    workers would share)."""
    from zyx.backends.cuda import driver

    return 1 if driver.unavailable_reason() is None else min(2, os.cpu_count() or 1)


def compute_devices() -> list[str]:
    return [name for name, p in registry().placements().items() if p.devices]


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        devs = compute_devices()
        marks = {d: [pytest.mark.cuda] if d.startswith("cuda") else [] for d in devs}
        metafunc.parametrize("device", [pytest.param(d, marks=marks[d], id=d) for d in devs])


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@contextlib.contextmanager
def host_without_blas():
    """Within the block the host has no BLAS device: matmuls and attention take the generated path."""
    from zyx.backends.registry import registry
    from zyx.graph import schedule

    pl = registry().get("host")
    saved = list(pl.devices)
    pl.devices[:] = [d for d in saved if d.info().kind != "blas"]
    schedule.clear_cache()
    try:
        yield
    finally:
        pl.devices[:] = saved
        schedule.clear_cache()


@contextlib.contextmanager
def _switched_off(disabled: set, known, names: tuple[str, ...], what: str):
    """Within the block ``names`` are in ``disabled`` (a pass pipeline's set of skipped passes); fresh schedules on
    both sides (cached plans hold the programs compiled with the passes on)."""
    from zyx.graph import schedule

    assert set(names) <= set(known), f"unknown {what}: {set(names) - set(known)}"
    old = set(disabled)
    disabled.update(names)
    schedule.clear_cache()
    try:
        yield
    finally:
        disabled.clear()
        disabled.update(old)
        schedule.clear_cache()


def passes_off(*names: str):
    """Within the block the named host passes (``zyx.kernel.opt.DISABLED``) are off."""
    from zyx.kernel import opt

    return _switched_off(opt.DISABLED, opt.PASS_NAMES, names, "host pass names")


def gpu_passes_off(*names: str):
    """Within the block the named optional GPU passes (``zyx.kernel.gpu.DISABLED``) are off."""
    from zyx.kernel import gpu

    return _switched_off(gpu.DISABLED, gpu.OPTIONAL_PASSES, names, "optional GPU passes")


@contextlib.contextmanager
def gpu_planned(params: dict[str, int]):
    """Within the block every GPU kernel is planned with ``params`` (``zyx.kernel.gpu.search_space`` names) over
    the heuristics' choices, schedules rebuilt; yields the geometries planned (of every segment)."""
    from zyx.graph import schedule
    from zyx.kernel import gpu

    orig = gpu.optimize
    seen: list = []

    def optimize(k, info, p=None):
        out = orig(k, info, {**(p or {}), **params})
        seen.extend(gpu.geometry(x) for x in (out, *out.then))
        return out

    gpu.optimize = optimize
    schedule.clear_cache()
    try:
        yield seen
    finally:
        gpu.optimize = orig
        schedule.clear_cache()


def typed_leaf(shape: tuple[int, ...], dtype: str = "float32") -> zyx.Tensor:
    """Zeros of ``shape`` as a host tensor of ``dtype`` (realized when cast: kernels load it as stored)."""
    t = zyx.Tensor(np.zeros(shape, np.float32))
    return t.cast(dtype).realize() if dtype != "float32" else t


def only_kernel(t: zyx.Tensor):
    """The one kernel realizing ``t`` (``kernels_of``)."""
    (k,) = kernels_of(t)
    return k


def kernels_of(*tensors: zyx.Tensor) -> list:
    """The kernel IRs the host compiles to realize ``tensors`` (with the schedule cache cleared first)."""
    from zyx import utils
    from zyx.graph import schedule

    outer = utils.KERNEL_LOG
    utils.KERNEL_LOG = []
    schedule.clear_cache()
    try:
        zyx.debug.schedule(*tensors)
        return list(utils.KERNEL_LOG)
    finally:
        if outer is not None:
            outer.extend(utils.KERNEL_LOG)
        utils.KERNEL_LOG = outer


def assert_close(got, want, rtol: float = 1e-5, atol: float = 1e-6, dtype=None) -> None:
    """Compare a zyx result with a NumPy reference: shape, optionally dtype, values (NaN == NaN)."""
    g = got.numpy() if isinstance(got, zyx.Tensor) else np.asarray(got)
    w = np.asarray(want)
    assert g.shape == w.shape, f"shape {g.shape} != {w.shape}"
    if dtype is not None:
        assert g.dtype == np.dtype(dtype), f"dtype {g.dtype} != {np.dtype(dtype)}"
    if g.dtype.kind in "biu" and w.dtype.kind in "biu":
        np.testing.assert_array_equal(g, w)
    else:
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol, equal_nan=True)


@contextlib.contextmanager
def registry_with(tmp_path, config: dict):
    """The global registry made from ``config`` (a JSON config file in ``tmp_path``), and the default one back
    afterwards; the CUDA workers it started are closed."""
    from zyx.backends import registry as reg
    from zyx.graph import schedule

    f = tmp_path / "c.json"
    f.write_text(json.dumps(config))
    r = reg.reset_registry(f)
    schedule.clear_cache()  # plans name the programs of the registry they were made with
    try:
        yield r
    finally:
        for p in r.placements().values():
            if p.name.startswith("cuda"):
                p.pool.worker.close()
        reg.reset_registry()
        schedule.clear_cache()


def nvrtc_compiles(sources) -> None:
    """NVRTC compiles (PTX and ptxas: ``nvrtc.check_batch``) every source for sm_80, and for sm_90 those that sm_90
    preprocesses differently (``cuda_codegen_check._arch_dependent``); the others are the same text, and code that
    compiles for sm_80 compiles for sm_90. A failure names the kernels."""
    from cuda_codegen_check import _arch_dependent

    from zyx.backends.cuda import nvrtc

    sources = list(sources)
    nvrtc.check_batch(sources, "sm_80")
    nvrtc.check_batch([s for s in sources if _arch_dependent(s)], "sm_90")


def run_emulated_matmul(cs, k, a: np.ndarray, b: np.ndarray, max_blocks: int) -> np.ndarray:
    """Run the rendered CUDA source ``cs`` of ``k`` (``p0 = p1 @ p2`` up to layout; ``a`` and ``b`` are told apart
    by size) on the emulator's CPU runtime with at most ``max_blocks`` blocks; returns ``p0``."""
    from zyx.backends.cuda.args import ArgPack
    from zyx.backends.cuda.emulator import kernels as emu_kernels

    fn = emu_kernels.compile_module(cs.source).functions[cs.name]
    by_size = {a.size: a, b.size: b}
    assert len(by_size) == 2 and len(k.params) == 3 and k.params[0].kind == "out"
    out = np.zeros(k.params[0].size, k.params[0].dtype.np_dtype)
    bufs = [out] + [np.ascontiguousarray(by_size[k.params[i].size]).reshape(-1) for i in (1, 2)]
    pack = ArgPack(len(bufs)).fill([None] * len(bufs), [x.ctypes.data for x in bufs])
    fault = fn.run([pack.slot(i)[:n] for i, n in enumerate(fn.param_sizes)], (min(cs.grid[0], max_blocks), 1, 1),
                   cs.block)
    assert fault is None, f"{cs.name}: {fault}"
    return out


# ---- CUDA codegen coverage (keep this block last) ----
# Log every kernel IR the devices compile in this process; when its tests are done, render each one as CUDA C and
# compile it with NVRTC for sm_80 and sm_90 (no GPU needed; tests/cuda_codegen_check.py). A failure is an error in
# the teardown of the process's last test.
from zyx import utils as _zyx_utils  # noqa: E402

_zyx_utils.KERNEL_LOG = []


@pytest.fixture(scope="session", autouse=True)
def every_logged_kernel_compiles_for_cuda(request):
    yield
    log = _zyx_utils.KERNEL_LOG
    if not log:
        return
    from cuda_codegen_check import check_logged_kernels

    from zyx.backends.cuda import nvrtc

    def say(line: str) -> None:  # past the output capture (under pytest -n a worker's lines go nowhere)
        plugins = request.config.pluginmanager
        reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
        if reporter is not None and capture is not None:
            with capture.global_and_fixture_disabled():
                reporter.write("\n")
                reporter.write_line(line)

    reason = nvrtc.available()
    if reason is not None:
        say(f"CUDA codegen not checked: NVRTC unavailable ({reason}); {nvrtc.INSTALL_HINT}")
        return
    summary, failures = check_logged_kernels(log)
    say(summary)
    assert not failures, f"{len(failures)} CUDA compile batches failed:\n" + "\n\n".join(failures[:5])
# ---- end of the CUDA codegen block ----


@pytest.fixture
def libraries_first(monkeypatch):
    """Extraction takes every library alternative a device matched (BLAS matmuls and attention on the host,
    cuDNN on a GPU) however small the work, so that the fuzzer's small programs run the library kernels too."""
    from zyx.graph import schedule
    from zyx.ops import Ops

    estimate = schedule.default_cost

    def cost_fn(*args, **kwargs):
        cost = estimate(*args, **kwargs)

        def libraries_free(c, n):
            return 0.0 if n.op is Ops.KERNEL else cost(c, n)

        libraries_free.measured = cost.measured
        return libraries_free

    monkeypatch.setattr(schedule, "default_cost", cost_fn)
    schedule.clear_cache()
    yield
    schedule.clear_cache()

"""The C math prelude (zyx/kernel/c_math.py): accuracy, NumPy's special values, and GCC vectorization.

One shared library holds the prelude plus one ``#pragma omp simd`` loop per (op, dtype), compiled with the
flags the host backend uses.  float32 results are compared with NumPy's float64 result (``math.erf`` for
erf) rounded to float32, in whole ulps; the bound is 2 ulp (the implementation achieves 1; the exhaustive
check over all 2**32 inputs, ``scripts/check_c_math_exhaustive.py``, takes minutes and is reported in c_math.py's
docstring; the suite runs it on every 65537th input).
sin/cos/tan are accurate for |x| < 2**44 where the compiler has FMA (``__FP_FAST_FMA``), else for
|x| < 2**27 * pi/2; beyond, their value is only bounded (checked separately).
"""

from __future__ import annotations

import ctypes
import math
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from zyx.backends.host.compiler import BASE_FLAGS
from zyx.kernel.c_math import C_MATH_FUNCTIONS, C_MATH_PRELUDE

CC = shutil.which("cc")
if CC is None:
    pytest.skip("no C compiler (cc) on PATH", allow_module_level=True)

CFLAGS = [*BASE_FLAGS, "-fopenmp"]  # the host backend's (with -ffp-contract=off: no FMA but the explicit ones)
OPS = ("exp", "exp2", "log", "log2", "sin", "cos", "tan", "tanh", "erf", "sqrt")
MAX_ULP = 2
F32_MAX = float(np.finfo(np.float32).max)
INF, NAN = math.inf, math.nan


@dataclass
class Built:
    lib: ctypes.CDLL
    loop_line: dict[tuple[str, str], int]  # line of each loop's `for` in the C source
    compiler_output: str
    is_gcc: bool
    trig_limit: float  # sin/cos/tan are accurate for |x| below this


def build(tmp: Path, cflags: list[str]) -> Built:
    lines = C_MATH_PRELUDE.splitlines()
    lines += [
        "int probe_fast_fma(void) {",
        "#if defined(__FP_FAST_FMA)",
        "    return 1;",
        "#else",
        "    return 0;",
        "#endif",
        "}",
    ]
    loop_line = {}
    for (op, dtype), fn in sorted(C_MATH_FUNCTIONS.items()):
        ctype = "float" if dtype == "float32" else "double"
        lines += [
            f"void loop_{op}_{dtype}(const {ctype} *restrict x, {ctype} *restrict y, long n) {{",
            "#pragma omp simd",
            f"    for (long i = 0; i < n; ++i) y[i] = {fn}(x[i]);",
            "}",
        ]
        loop_line[(op, dtype)] = len(lines) - 1
    src, so = tmp / "c_math_test.c", tmp / "c_math_test.so"
    src.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(
        [CC, *cflags, "-fopt-info-vec-optimized", str(src), "-o", str(so)], capture_output=True, text=True
    )
    if proc.returncode != 0 and "fopt-info" in proc.stderr:  # not GCC: build without the report
        proc = subprocess.run([CC, *cflags, str(src), "-o", str(so)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    version = subprocess.run([CC, "--version"], capture_output=True, text=True).stdout
    is_gcc = "Free Software Foundation" in version and "clang" not in version.lower()
    lib = ctypes.CDLL(str(so))
    for op, dtype in C_MATH_FUNCTIONS:
        getattr(lib, f"loop_{op}_{dtype}").argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    trig_limit = 2.0**44 if lib.probe_fast_fma() else 2.0**27 * math.pi / 2
    return Built(lib, loop_line, proc.stdout + proc.stderr, is_gcc, trig_limit)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The prelude as the host backend compiles it."""
    return build(tmp_path_factory.mktemp("c_math"), CFLAGS)


@pytest.fixture(scope="module")
def built_without_fma(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """x86-64-v2 has no FMA: compiles the prelude's fallbacks (double log2/sqrt steps, shorter trig range)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the no-FMA build uses an x86-64 -march")
    lib = build(
        tmp_path_factory.mktemp("c_math_nofma"), [f if f != "-march=native" else "-march=x86-64-v2" for f in CFLAGS]
    )
    assert not lib.lib.probe_fast_fma()
    return lib


def run(built: Built, op: str, x, dtype: str = "float32") -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=dtype)
    y = np.empty_like(x)
    getattr(built.lib, f"loop_{op}_{dtype}")(x.ctypes.data, y.ctypes.data, x.size)
    return y


_erf64 = np.vectorize(math.erf, otypes=[np.float64])


def reference(op: str, x: np.ndarray) -> np.ndarray:
    """float64 reference for float32 (or float64) inputs."""
    xd = np.asarray(x, dtype=np.float64)
    with np.errstate(all="ignore"):
        return _erf64(xd) if op == "erf" else getattr(np, op)(xd)


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Number of float32 values between a and b (+0 and -0 count as one value)."""

    def ordered(v: np.ndarray) -> np.ndarray:
        bits = np.asarray(v, dtype=np.float32).view(np.int32).astype(np.int64)
        return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    return np.abs(ordered(a) - ordered(b))


def max_ulp_error(built: Built, op: str, x: np.ndarray) -> int:
    """Checks NaN/inf agreement with the float64 reference rounded to float32; returns the max ulp distance."""
    x = np.asarray(x, dtype=np.float32)
    got = run(built, op, x)
    with np.errstate(all="ignore"):
        want = reference(op, x).astype(np.float32)
    nan_want, nan_got = np.isnan(want), np.isnan(got)
    assert np.array_equal(nan_want, nan_got), f"{op}: nan mismatch at x={x[nan_want != nan_got][:5]}"
    inf_want = np.isinf(want)
    bad = inf_want & (got != want)
    assert not bad.any(), f"{op}: expected {want[bad][:5]} at x={x[bad][:5]}, got {got[bad][:5]}"
    finite = ~nan_want & ~inf_want
    dist = ulp_distance(got[finite], want[finite])
    if dist.size == 0:
        return 0
    worst = int(np.argmax(dist))
    assert dist[worst] <= MAX_ULP, (
        f"{op}: {dist[worst]} ulp at x={x[finite][worst]!r}: got {got[finite][worst]!r}, want {want[finite][worst]!r}"
    )
    return int(dist[worst])


# ---------------------------------------------------------------------------------------------- samples


def neighbours(v, k: int = 3) -> np.ndarray:
    """The float32 values v and its k nearest floats on each side (finite ones only)."""
    bits = np.asarray(v, dtype=np.float32).reshape(-1, 1).view(np.int32).astype(np.int64)
    around = (bits + np.arange(-k, k + 1)).reshape(-1)
    around = around[(around >= np.iinfo(np.int32).min) & (around <= np.iinfo(np.int32).max)]
    out = around.astype(np.int32).view(np.float32)
    return out[np.isfinite(out)]


def common_samples(rng: np.random.Generator, n_random: int) -> np.ndarray:
    random_bits = rng.integers(0, 2**32, n_random, dtype=np.uint64).astype(np.uint32).view(np.float32)
    denormals = rng.integers(1, 2**23, 20_000, dtype=np.uint32).view(np.float32)
    mags = np.logspace(-45, 38.5, 20_000).astype(np.float32)
    parts = [
        random_bits,  # every exponent, both signs
        denormals,
        -denormals,
        mags,
        -mags,
        np.linspace(-4, 4, 80_001, dtype=np.float32),  # dense around 0
        neighbours([0.0, np.finfo(np.float32).tiny, 1.0, -1.0, F32_MAX, -F32_MAX], 50),
    ]
    x = np.concatenate([np.asarray(p, dtype=np.float32) for p in parts])
    return x[np.isfinite(x)]


def op_samples(op: str, rng: np.random.Generator) -> np.ndarray:
    """Inputs around the range-reduction boundaries and thresholds of each implementation."""
    if op in ("exp", "exp2"):
        scale = math.log(2.0) if op == "exp" else 1.0
        k = np.arange(-160, 131)
        top = math.log(F32_MAX) if op == "exp" else 128.0
        lo = -104.0 if op == "exp" else -150.0
        return np.concatenate(
            [
                neighbours((k + 0.5) * scale),
                neighbours(k * scale),
                neighbours([top, lo], 200),
                np.linspace(lo - 5, lo + 25, 100_001, dtype=np.float32),  # denormal results and underflow
                np.linspace(top - 2, top + 1, 20_001, dtype=np.float32),  # overflow boundary
            ]
        )
    if op in ("log", "log2"):
        k = np.arange(-149, 128, dtype=np.float64)
        return np.concatenate(
            [
                neighbours(np.sqrt(0.5) * 2.0**k),
                neighbours(2.0**k),
                neighbours([1.0], 3000),  # log(x) near 0
                rng.uniform(0.5, 2.0, 100_000).astype(np.float32),
            ]
        )
    if op in ("sin", "cos", "tan"):
        k = np.concatenate([np.arange(-2000, 2001), rng.integers(-(2**26), 2**26, 20_000)]).astype(np.float64)
        return np.concatenate(
            [
                neighbours(k * (math.pi / 2)),  # near the zeros / poles / extrema
                neighbours((k + 0.5) * (math.pi / 2)),  # quadrant boundaries of the reduction
                neighbours([0.5, math.pi / 4, 1e5, 1e7, 2.0**24, 2.0**27], 100),
                rng.uniform(-1e5, 1e5, 100_000).astype(np.float32),
                rng.uniform(-1e7, 1e7, 50_000).astype(np.float32),
            ]
        )
    if op == "tanh":
        return np.concatenate(
            [
                neighbours([0.0625, -0.0625, 9.0, -9.0], 1000),
                np.linspace(-12, 12, 100_001, dtype=np.float32),
            ]
        )
    if op == "erf":
        return np.concatenate(
            [
                neighbours([1.0, -1.0, 3.8, 4.0, -4.0], 500),
                np.linspace(-6, 6, 60_001, dtype=np.float32),
            ]
        )
    assert op == "sqrt"
    squares = np.arange(1, 4097, dtype=np.float32) ** 2
    return np.concatenate([neighbours(squares), neighbours(2.0 ** np.arange(-149, 128, dtype=np.float64))])


# ---------------------------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("op", OPS)
def test_float32_accuracy(built: Built, op: str) -> None:
    rng = np.random.default_rng(1234 + OPS.index(op))
    n_random = 200_000 if op == "erf" else 1_000_000  # math.erf is a Python call per element
    x = np.concatenate([common_samples(rng, n_random), op_samples(op, rng).astype(np.float32)])
    if op == "erf":  # thin out the dense parts too, math.erf is slow
        x = x[rng.random(x.size) < 0.5]
    if op in ("sin", "cos", "tan"):
        x = x[np.abs(x) < built.trig_limit]
    assert max_ulp_error(built, op, x) <= MAX_ULP


@pytest.mark.parametrize("op", OPS)
def test_float32_accuracy_without_fma(built_without_fma: Built, op: str) -> None:
    rng = np.random.default_rng(4321 + OPS.index(op))
    x = np.concatenate([common_samples(rng, 100_000), op_samples(op, rng).astype(np.float32)])
    x = x[rng.random(x.size) < (0.1 if op == "erf" else 0.3)]
    if op in ("sin", "cos", "tan"):
        x = x[np.abs(x) < built_without_fma.trig_limit]
    assert max_ulp_error(built_without_fma, op, x) <= MAX_ULP
    if built_without_fma.is_gcc:  # and the fallbacks vectorize too
        vectorized = {
            int(m) for m in re.findall(r":(\d+):\d+: optimized: loop vectorized", built_without_fma.compiler_output)
        }
        assert built_without_fma.loop_line[(op, "float32")] in vectorized


@pytest.mark.parametrize("op", ["sin", "cos", "tan"])
def test_trig_large_arguments(built: Built, op: str) -> None:
    """The error bound holds far beyond the 1e5 of a float Cody-Waite reduction: up to built.trig_limit."""
    rng = np.random.default_rng(7)
    mags = np.exp(rng.uniform(math.log(1e5), math.log(built.trig_limit), 200_000)).astype(np.float32)
    x = np.concatenate([mags, -mags, neighbours(2.0 ** np.arange(17, 44, dtype=np.float64), 20)])
    assert max_ulp_error(built, op, x[np.abs(x) < built.trig_limit]) <= MAX_ULP


@pytest.mark.parametrize("op", ["sin", "cos", "tan"])
def test_trig_beyond_the_limit_is_bounded(built: Built, op: str) -> None:
    """Above the limit (float spacing >= 2**21 there) the value is meaningless, but never nan or out of range."""
    rng = np.random.default_rng(8)
    mags = np.exp(rng.uniform(math.log(built.trig_limit), math.log(F32_MAX), 100_000)).astype(np.float32)
    x = np.concatenate([mags, -mags, [F32_MAX, -F32_MAX]])
    got = run(built, op, x[np.isfinite(x)])
    assert not np.isnan(got).any()
    if op != "tan":
        assert (np.abs(got) <= 1.0).all()


def test_exp_denormal_results_are_not_flushed(built: Built) -> None:
    x = np.linspace(-103.9, -87.4, 10_001, dtype=np.float32)
    got = run(built, "exp", x)
    want = np.exp(x.astype(np.float64)).astype(np.float32)
    assert (got[x < -88] < np.finfo(np.float32).tiny).all() and (got > 0).all()
    assert ulp_distance(got, want).max() <= 1
    assert run(built, "exp2", np.array([-149.0, -140.5, -126.0], dtype=np.float32)).tolist() == [
        2.0**-149,
        np.float32(2.0**-140.5),
        2.0**-126,
    ]


# ---------------------------------------------------------------------------------------------- special values

SPECIAL = {
    "exp": [-INF, INF, NAN, 0.0, -0.0, 88.72, 88.73, 89.0, 1e30, -103.0, -104.0, -110.0, -1e30],
    "exp2": [-INF, INF, NAN, 0.0, -0.0, 127.99, 128.0, 1e30, -149.0, -149.5, -150.0, -151.0, -1e30],
    "log": [0.0, -0.0, -1.0, -1e-45, -INF, INF, NAN, 1.0, 1e-45, 1e-40, F32_MAX],
    "log2": [0.0, -0.0, -1.0, -1e-45, -INF, INF, NAN, 1.0, 1e-45, 2.0**-149, 2.0**-130, 2.0**127, F32_MAX],
    "sin": [INF, -INF, NAN, 0.0, -0.0, 1e-45, -1e-45, 1e-30, -1e-30, 1e8, -1e8],
    "cos": [INF, -INF, NAN, 0.0, -0.0, 1e-45, -1e-45, 1e8, -1e8],
    "tan": [INF, -INF, NAN, 0.0, -0.0, 1e-45, -1e-45, 1e-30, 1e8, -1e8],
    "tanh": [INF, -INF, NAN, 0.0, -0.0, 1e-45, -1e-45, 10.0, -10.0, 100.0, -100.0, F32_MAX, -F32_MAX],
    "erf": [INF, -INF, NAN, 0.0, -0.0, 1e-45, -1e-45, 4.0, -4.0, 10.0, -10.0, F32_MAX, -F32_MAX],
    "sqrt": [-1.0, -1e-45, -INF, INF, NAN, 0.0, -0.0, 1e-45, 4.0, F32_MAX],
}


def numpy_float32(op: str, v: float) -> np.float32:
    with np.errstate(all="ignore"):
        if op == "erf":
            return np.float32(math.erf(v)) if not math.isnan(v) else np.float32(NAN)
        return getattr(np, op)(np.float32(v))


@pytest.mark.parametrize("op", OPS)
def test_float32_special_values(built: Built, op: str) -> None:
    values = np.array(SPECIAL[op], dtype=np.float32)
    got = run(built, op, values)
    for v, g in zip(values, got):
        want = numpy_float32(op, float(v))
        if np.isnan(want):
            assert np.isnan(g), f"{op}({v!r}) = {g!r}, NumPy gives nan"
        elif np.isinf(want) or want in (1.0, -1.0) or v == 0.0:  # exactly, including the sign of zero
            assert g == want and np.signbit(g) == np.signbit(want), f"{op}({v!r}) = {g!r}, NumPy gives {want!r}"
        else:  # NumPy's float32 kernels are not correctly rounded (np.exp2(-149.5) gives 0, not 2**-149)
            assert ulp_distance(g, want) <= MAX_ULP, f"{op}({v!r}) = {g!r}, NumPy gives {want!r}"


def test_float32_named_special_cases(built: Built) -> None:
    def f(op: str, v: float) -> float:
        return float(run(built, op, np.array([v], dtype=np.float32))[0])

    assert f("exp", -INF) == 0.0 and f("exp", INF) == INF and math.isnan(f("exp", NAN))
    assert f("exp", 100.0) == INF and f("exp", -200.0) == 0.0
    assert f("log", 0.0) == -INF and math.isnan(f("log", -1.0)) and f("log", INF) == INF
    assert f("log", 1e-45) == pytest.approx(math.log(1.401298464324817e-45), rel=1e-7)
    assert all(math.isnan(f(op, v)) for op in ("sin", "cos", "tan") for v in (INF, -INF, NAN))
    assert f("tanh", 50.0) == 1.0 and f("tanh", -50.0) == -1.0 and math.isnan(f("tanh", NAN))
    assert f("tanh", 1e-20) == np.float32(1e-20)  # no cancellation near 0
    assert f("erf", INF) == 1.0 and f("erf", -INF) == -1.0 and math.isnan(f("erf", NAN))
    assert math.isnan(f("sqrt", -2.0)) and f("sqrt", INF) == INF
    assert math.copysign(1.0, f("sin", -0.0)) == -1.0 and math.copysign(1.0, f("sqrt", -0.0)) == -1.0


# ---------------------------------------------------------------------------------------------- float64


@pytest.mark.parametrize("op", OPS)
def test_float64_matches_numpy(built: Built, op: str) -> None:
    rng = np.random.default_rng(99)
    x = np.concatenate([rng.uniform(-50, 50, 20_000), np.array([0.0, -0.0, INF, -INF, NAN, 1e-300, 700.0, -745.0])])
    if op in ("log", "log2", "sqrt"):
        x = np.concatenate([x, np.abs(x)])
    got = run(built, op, x, "float64")
    want = reference(op, x)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(np.isinf(got[ok]), np.isinf(want[ok]))
    ok &= np.isfinite(want)
    # libm against NumPy's own float64 kernels (np.tanh differs from glibc's tanh by up to 2 ulp)
    assert (np.abs(got[ok] - want[ok]) <= 4 * np.spacing(np.abs(want[ok]))).all()


# ---------------------------------------------------------------------------------------------- vectorization


@pytest.mark.parametrize("op", OPS)
def test_float32_loops_vectorize(built: Built, op: str) -> None:
    """GCC reports each float32 loop as vectorized (-fopt-info-vec-optimized, no -ffast-math).

    Checked on GCC 12; the selects are bit masks precisely so that GCC's if-conversion cannot balk.
    """
    if not built.is_gcc:
        pytest.skip("-fopt-info-vec-optimized is GCC's report")
    vectorized = {int(m) for m in re.findall(r":(\d+):\d+: optimized: loop vectorized", built.compiler_output)}
    assert built.loop_line[(op, "float32")] in vectorized, built.compiler_output


@pytest.mark.parametrize("op", ["exp", "exp2", "erf", "tanh", "log"])
def test_float32_polynomials_use_fma_under_the_backend_flags(built: Built, tmp_path: Path, op: str) -> None:
    """Where the target has FMA, every Horner step is one (``ZYX__FMAF``), although the host backend compiles
    with -ffp-contract=off: the vectorized loop holds at least as many FMA instructions as the function's
    polynomials have steps."""
    if not built.lib.probe_fast_fma() or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("needs an x86-64 target with FMA")
    steps = {"exp": 5, "exp2": 6, "erf": 17, "tanh": 5, "log": 8}[op]
    src = tmp_path / "loop.c"
    src.write_text(C_MATH_PRELUDE + "void loop(const float *restrict x, float *restrict y, long n) {\n"
                   f"#pragma omp simd\n    for (long i = 0; i < n; ++i) y[i] = zyx_{op}f(x[i]);\n}}\n")
    flags = [f for f in CFLAGS if f not in ("-shared", "-fPIC")]
    asm = subprocess.run([CC, *flags, "-S", "-o", "-", str(src)], capture_output=True, text=True, check=True).stdout
    fmas = re.findall(r"^\s*vfn?m(?:add|sub)\d+[ps]s\b", asm, re.MULTILINE)
    assert len(fmas) >= steps, f"{op}: {len(fmas)} FMA instructions, want >= {steps}"


def test_mapping_covers_ops_and_dtypes() -> None:
    assert set(C_MATH_FUNCTIONS) == {(op, dt) for op in OPS for dt in ("float32", "float64")}
    for (_op, _dtype), name in C_MATH_FUNCTIONS.items():
        assert re.search(rf"\b{name}\(", C_MATH_PRELUDE), name


def test_the_exhaustive_checker_passes_a_sample_and_catches_an_ulp_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``scripts/check_c_math_exhaustive.py`` on every 65537th input (all of them take minutes): every function
    within 1 ulp; an exp made 4 ulp off fails it."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "check_c_math_exhaustive.py"
    spec = importlib.util.spec_from_file_location("check_c_math_exhaustive", path)
    checker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checker)
    assert checker.main(["--stride", "65537"]) == 0
    exact = "    return zyx__scalef(p, m);"  # zyx__expf_kernel's last line
    assert checker.C_MATH_PRELUDE.count(exact) == 1
    monkeypatch.setattr(checker, "C_MATH_PRELUDE", checker.C_MATH_PRELUDE.replace(
        exact, "    return zyx__scalef(p * 1.0000005f, m);"))
    assert checker.main(["--only", "exp", "--stride", "65537"]) == 1

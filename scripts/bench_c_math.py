"""Throughput of the float32 functions of the C math prelude (zyx/kernel/c_math.py) beside NumPy.

For 2**24 float32 elements: ns/element, median of 7 runs after a warm-up, single thread (the loops are
``#pragma omp simd`` only, no ``parallel for``), compiled with the host backend's flags
``-O3 -march=native -fopenmp -shared -fPIC``.  ``copy`` (y[i] = x[i]) is the memory-bandwidth floor.

    python scripts/bench_c_math.py
"""

from __future__ import annotations

import ctypes
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zyx.kernel.c_math import C_MATH_FUNCTIONS, C_MATH_PRELUDE  # noqa: E402

N = 1 << 24
RUNS = 7
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]

# op -> (low, high) of the uniform input sample
DOMAINS = {
    "copy": (-10.0, 10.0),
    "exp": (-20.0, 20.0),
    "exp2": (-20.0, 20.0),
    "log": (1e-3, 1e3),
    "log2": (1e-3, 1e3),
    "sin": (-100.0, 100.0),
    "cos": (-100.0, 100.0),
    "tan": (-100.0, 100.0),
    "tanh": (-5.0, 5.0),
    "erf": (-3.0, 3.0),
    "sqrt": (0.0, 1e4),
}


def numpy_function(op: str):
    if op == "copy":
        return lambda x, out: np.copyto(out, x)
    if op == "erf":
        try:
            from scipy.special import erf
        except ImportError:
            return None
        return lambda x, out: erf(x, out=out)
    return getattr(np, op)


def build(tmp: Path) -> ctypes.CDLL:
    parts = [C_MATH_PRELUDE]
    for op in DOMAINS:
        body = "x[i]" if op == "copy" else f"{C_MATH_FUNCTIONS[(op, 'float32')]}(x[i])"
        parts.append(
            f"void bench_{op}(const float *restrict x, float *restrict y, long n) {{\n"
            f"#pragma omp simd\n    for (long i = 0; i < n; ++i) y[i] = {body};\n}}\n"
        )
    src, so = tmp / "bench_c_math.c", tmp / "bench_c_math.so"
    src.write_text("\n".join(parts))
    cc = shutil.which("cc") or "gcc"
    subprocess.run([cc, *CFLAGS, str(src), "-o", str(so)], check=True)
    lib = ctypes.CDLL(str(so))
    for op in DOMAINS:
        getattr(lib, f"bench_{op}").argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    return lib


def median_ns_per_element(fn) -> float:
    fn()  # warm-up (page faults, caches, lazy binding)
    times = []
    for _ in range(RUNS):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / N * 1e9


def main() -> None:
    rng = np.random.default_rng(0)
    y = np.empty(N, dtype=np.float32)
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        print(f"float32, n = 2**24, single thread, median of {RUNS} runs, ns/element")
        print(f"{'op':<6} {'zyx C':>8} {'NumPy':>8} {'NumPy/zyx':>10}")
        for op, (lo, hi) in DOMAINS.items():
            x = rng.uniform(lo, hi, N).astype(np.float32)
            c_fn = getattr(lib, f"bench_{op}")
            ours = median_ns_per_element(lambda c_fn=c_fn, x=x: c_fn(x.ctypes.data, y.ctypes.data, N))
            np_fn = numpy_function(op)
            if np_fn is None:
                print(f"{op:<6} {ours:8.3f} {'n/a':>8} {'':>10}")
                continue
            theirs = median_ns_per_element(lambda np_fn=np_fn, x=x: np_fn(x, out=y))
            print(f"{op:<6} {ours:8.3f} {theirs:8.3f} {theirs / ours:10.2f}")
        print("(erf: scipy.special.erf, NumPy has none; copy: y[i] = x[i] / np.copyto, the bandwidth floor)")


if __name__ == "__main__":
    main()

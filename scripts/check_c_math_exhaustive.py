"""Exhaustive accuracy check of the C math prelude's float32 functions (zyx/kernel/c_math.py): every one of the
2**32 float32 inputs against glibc's float64 function (the same reference the sampled tests use).

Per function it prints the largest distance in ulps from the float64 result rounded to float32 (the sampled tests
bound it by 2; the prelude's docstring quotes the exhaustive result), the largest error against the unrounded
float64 result in float32 ulps, and how many inputs disagree on NaN or infinity. sin, cos and tan are checked
for |x| < 2**44 (their accurate range with FMA, 2**27 * pi/2 without). Compiled with the host backend's flags;
``--no-fma`` compiles for a target without FMA (``-mno-fma``), the prelude's other branch; ``--stride N`` checks
every N-th input only (the test suite's quick run). Exits 1 when a function is more than 1 ulp from the rounded
reference or disagrees on a NaN or an infinity. All inputs take minutes (about 6 on 2 cores).

    python scripts/check_c_math_exhaustive.py [--no-fma] [--only exp,erf] [--stride N]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from zyx.backends.host.compiler import BASE_FLAGS  # noqa: E402
from zyx.kernel.c_math import C_MATH_PRELUDE  # noqa: E402

# op -> (the float64 reference, |x| below which the function must be accurate)
REFERENCES = {"exp": ("exp", "INFINITY"), "exp2": ("exp2", "INFINITY"), "log": ("log", "INFINITY"),
              "log2": ("log2", "INFINITY"), "sin": ("sin", "0x1p44"), "cos": ("cos", "0x1p44"),
              "tan": ("tan", "0x1p44"), "tanh": ("tanh", "INFINITY"), "erf": ("erf", "INFINITY"),
              "sqrt": ("sqrt", "INFINITY")}

_MAIN = r"""
#include <stdio.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
/* float32 bits in an order where adjacent floats are adjacent integers (-0 and +0 both 0) */
static long long ordered(float f) { int32_t i; memcpy(&i, &f, 4); return i < 0 ? -(long long)(i & 0x7fffffff) : i; }
/* the float32 ulp at |d| (denormal spacing below 2**-126) */
static double ulp32(double d) { int e; frexp(d, &e); return ldexp(1.0, (e - 1 < -126 ? -126 : e - 1) - 23); }
static int failed = 0; /* a function more than 1 ulp off, or a NaN/inf mismatch */
%(checks)s
int main(void) {
%(calls)s
  return failed;
}
"""

_CHECK = r"""
static void check_%(op)s(void) {
  long long worst = 0, mismatch = 0; double worst_raw = 0; uint32_t at = 0;
  #pragma omp parallel
  {
    long long w = 0, mm = 0; double wr = 0; uint32_t a = 0;
    float x[1024], y[1024];
    uint32_t in[1024];
    #pragma omp for schedule(dynamic, 64)
    for (long long b = 0; b < (1LL << 32) / %(stride)d; b += 1024) {
      for (int i = 0; i < 1024; i++) { in[i] = (uint32_t)((uint64_t)(b + i) * %(stride)du); memcpy(&x[i], &in[i], 4); }
      #pragma omp simd
      for (int i = 0; i < 1024; i++) y[i] = zyx_%(op)sf(x[i]);
      for (int i = 0; i < 1024; i++) {
        if (!(fabsf(x[i]) < %(limit)s) && !isnan(x[i]) && !isinf(x[i])) continue;
        double r = %(ref)s((double)x[i]);
        float rf = (float)r;
        if (isnan(rf) || isnan(y[i]) || isinf(rf) || isinf(y[i])) {
          int same = (isnan(rf) && isnan(y[i])) || (isinf(rf) && y[i] == rf);
          if (!same) { mm++; a = in[i]; }
          continue;
        }
        long long d = ordered(y[i]) - ordered(rf);
        if (d < 0) d = -d;
        if (d > w) { w = d; a = in[i]; }
        double e = fabs((double)y[i] - r) / ulp32(r);
        if (e > wr) wr = e;
      }
    }
    #pragma omp critical
    { if (w > worst) { worst = w; at = a; } if (wr > worst_raw) worst_raw = wr; mismatch += mm; }
  }
  if (worst > 1 || mismatch) failed = 1;
  float xa; memcpy(&xa, &at, 4);
  printf("%%-5s max %%lld ulp from the rounded reference, %%.2f ulp from the unrounded one, %%lld NaN/inf "
         "mismatches (worst at x = %%a)\n", "%(op)s", worst, worst_raw, mismatch, (double)xa);
  fflush(stdout);
}
"""


def source(ops: list[str], stride: int = 1) -> str:
    """The checking program for ``ops``, over every ``stride``-th float32 bit pattern."""
    checks = "".join(_CHECK % {"op": op, "ref": REFERENCES[op][0], "limit": REFERENCES[op][1], "stride": stride}
                     for op in ops)
    calls = "".join(f"  check_{op}();\n" for op in ops)
    return C_MATH_PRELUDE + _MAIN % {"checks": checks, "calls": calls}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-fma", action="store_true", help="compile for a target without FMA (-mno-fma)")
    ap.add_argument("--only", default=",".join(REFERENCES), help="comma-separated functions (default: all)")
    ap.add_argument("--stride", type=int, default=1, help="check every N-th input only (default 1: all)")
    args = ap.parse_args(argv)
    if args.stride < 1:
        ap.error("--stride must be at least 1")
    ops = args.only.split(",")
    unknown = [op for op in ops if op not in REFERENCES]
    if unknown:
        ap.error(f"unknown functions {unknown}; choose from {sorted(REFERENCES)}")
    cc = shutil.which("cc")
    if cc is None:
        print("no C compiler (cc) on PATH", file=sys.stderr)
        return 2
    flags = [f for f in BASE_FLAGS if f not in ("-shared", "-fPIC")] + ["-fopenmp"]
    if args.no_fma:
        flags.append("-mno-fma")
    with tempfile.TemporaryDirectory() as d:
        c, exe = Path(d) / "check.c", Path(d) / "check"
        c.write_text(source(ops, args.stride))
        subprocess.run([cc, *flags, str(c), "-o", str(exe), "-lm"], check=True)
        return subprocess.run([str(exe)]).returncode


if __name__ == "__main__":
    sys.exit(main())

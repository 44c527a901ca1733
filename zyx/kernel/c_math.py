"""Elementary functions for the generated host C kernels (the "math prelude").

``C_MATH_PRELUDE`` is C11 source to paste in front of a generated kernel; ``C_MATH_FUNCTIONS`` maps
``(op, dtype)`` to the name of the C function that computes it, e.g. ``("exp", "float32") -> "zyx_expf"``.

float32 (``zyx_expf zyx_exp2f zyx_logf zyx_log2f zyx_sinf zyx_cosf zyx_tanf zyx_tanhf zyx_erff zyx_sqrtf``,
all ``float f(float)``):

* Vectorization.  Written so that GCC auto-vectorizes a ``#pragma omp simd`` loop that calls them, compiled
  with ``-O3 -march=native`` and *without* ``-ffast-math`` (so glibc's libmvec is not an option): the
  functions are ``static inline`` and always inlined, make no calls (no libm, no errno), keep no mutable
  state, and have no branches on data.  Every data-dependent choice is a select done with bit masks
  (``zyx__sel64``/``zyx__sel32``): GCC 12 turns plain ``c ? k : v`` ternaries with a constant arm into
  control flow that its if-conversion then refuses (the FP operations it sinks into the arms "could trap"
  under the default ``-ftrapping-math``), which would silently stop the whole loop from vectorizing.
  Bit casts go through ``memcpy``.  The only memory read is ``zyx_sinf``/``zyx_cosf``/``zyx_tanf``'s
  read-only table of 2/pi (a gather in the vector loop).  ``zyx_sqrtf`` cannot be ``__builtin_sqrtf``:
  with ``-fmath-errno`` (the default) GCC keeps a call to ``sqrtf`` for the errno path and the loop does
  not vectorize, not even under ``optimize("no-math-errno")``; it is therefore a Newton iteration.
  ``tests/kernel/test_c_math.py`` checks with ``-fopt-info-vec-optimized`` that every float32 loop
  vectorizes.  Verified with GCC 12 for ``-march=native`` (AVX-512 here), ``x86-64-v2``, ``x86-64-v3``,
  ``haswell``, ``znver2``, ``znver3``, at ``-O2`` and ``-O3``, ``-std=c99/c11/gnu11`` (no warnings under
  ``-Wall -Wextra -pedantic``); the table index is 64-bit so that GCC emulates the gather where its
  tuning forbids a gather instruction.  Baseline ``-march=x86-64`` (SSE2) leaves exp/exp2/tanh/erf scalar.
  The double-precision arithmetic inside runs at half the float32 vector width.

* Accuracy.  Each function works in double precision internally (range reductions exact or with errors
  far below 2**-40 relative, polynomial approximations with relative error below 5e-12, constant term
  exact) and rounds once to float at the end.  Checked exhaustively over all 2**32 float32 inputs
  against NumPy's float64 result (scipy's erf) rounded to float32: every function is within 1 ulp
  (max error 0.5001 ulp against the unrounded float64 value) and differs from the rounded reference on
  at most 1556 of the 4.3e9 inputs (sqrt: none), denormal inputs and outputs included.
  ``zyx_sinf``/``zyx_cosf``/``zyx_tanf`` reduce the argument Payne-Hanek style (x*2/pi mod 4 from a
  per-exponent table of 2/pi, exact in double), so the bound holds for every finite float up to 3.4e38,
  not only for |x| <= 1e5.

* Special values follow NumPy's float32 functions: exp(-inf)=0, exp(inf)=inf, overflow -> inf,
  underflow -> the correctly rounded denormal or 0 (no flush to zero); log(0)=-inf, log(x<0)=nan,
  log(inf)=inf; sin/cos/tan(+-inf)=nan; tanh(+-inf)=+-1; erf(+-inf)=+-1; sqrt(x<0)=nan,
  sqrt(inf)=inf, sqrt(-0)=-0; nan in -> nan out everywhere; odd functions keep the sign of zero.

float64 (``zyx_exp zyx_exp2 zyx_log zyx_log2 zyx_sin zyx_cos zyx_tan zyx_tanh zyx_erf zyx_sqrt``,
all ``double f(double)``) call glibc's libm (correctly rounded or within 1 ulp, libm's special values);
loops over them do not vectorize.  libm is already loaded in every Python process, so a kernel
``.so`` needs no ``-lm`` to load; link with ``-lm`` anyway when building a stand-alone binary.

The prelude refuses ``-ffast-math`` (``#error``): the rounding trick ``(t + 1.5*2**52) - 1.5*2**52``
and the NaN tests need IEEE semantics.  It is correct with and without FMA contraction.
"""

from __future__ import annotations

__all__ = ["C_MATH_FUNCTIONS", "C_MATH_PRELUDE"]


def _two_over_pi_fixed(bits: int) -> int:
    """floor(2/pi * 2**bits) (to within one unit), from Machin's formula in integer arithmetic."""
    guard = 64
    one = 1 << (bits + guard)

    def arctan_inv(n: int) -> int:  # arctan(1/n) * one
        power = one // n
        total = power
        n2 = n * n
        k = 1
        while power:
            power //= n2
            term = power // (2 * k + 1)
            total += -term if k % 2 else term
            k += 1
        return total

    pi = 16 * arctan_inv(5) - 4 * arctan_inv(239)
    return (2 * one << bits) // pi


# Table for the argument reduction of sin/cos/tan.  A float |x| >= 0.5 is M * 2**E with M an integer,
# |M| < 2**24, E = (biased exponent) - 150 in [-24, 104].  Then x*2/pi mod 4 = M * (2**E*2/pi mod 4);
# the table holds c_E = 2**E*2/pi mod 4 split as hi + mid + lo: hi a multiple of 2**-27 (29 bits, so M*hi
# is exact in double), mid a multiple of 2**-53 below 2**-27 (26 bits, so M*mid and the sum of the
# reduced parts are exact), lo the remainder rounded to double.
_TABLE_E_MIN, _TABLE_E_MAX = -24, 104


def _reduction_table() -> list[float]:
    p = 400
    two_over_pi = _two_over_pi_fixed(p)
    out: list[float] = []
    for e in range(_TABLE_E_MIN, _TABLE_E_MAX + 1):
        v = (two_over_pi << e) % (4 << p) if e >= 0 else two_over_pi >> -e  # c_E * 2**p
        hi = v >> (p - 27)
        rest = v - (hi << (p - 27))
        mid = rest >> (p - 53)
        lo = rest - (mid << (p - 53))
        out += [hi / (1 << 27), mid / (1 << 53), lo / (1 << p)]  # int / int is correctly rounded
    return out


def _hex(values: list[float]) -> str:
    return ", ".join(float.hex(v) for v in values)


def _table_source() -> str:
    vals = _reduction_table()
    rows = [_hex(vals[i : i + 3]) for i in range(0, len(vals), 3)]
    return ",\n        ".join(rows)


def _horner(var: str, coeffs: list[str]) -> str:
    """C expression c0 + var*(c1 + var*(c2 + ...)) for coefficient literals in ascending order."""
    expr = coeffs[-1]
    for c in reversed(coeffs[:-1]):
        expr = f"({c} + {var} * {expr})"
    return expr


# Polynomial coefficients: near-minimax fits (Chebyshev interpolation, mpmath.chebyfit at 50 digits,
# rounded to double) or Taylor coefficients where those are short enough.  The relative errors quoted
# are those of the double-precision approximation before the final rounding to float.
# 2**r = 1 + r*Q(r) on [-1/2, 1/2], Q of degree 7 (the constant term is exactly 1, so results near 1 round
# correctly): 2.2e-12.
_EXP2 = (
    "0x1.62e42fef9cc69p-1 0x1.ebfbdff82a734p-3 0x1.c6b08da70cce3p-5 0x1.3b2ab70ad2565p-7 "
    "0x1.5d877598350dep-10 0x1.4308c7183d6a2p-13 0x1.00c0e4e15189cp-16 0x1.63b2d7971923fp-20"
).split()
# log(m) = 2 atanh(s) = s * (2 + z*(2/3 + z*(2/5 + ...))), s = (m-1)/(m+1), z = s*s <= 0.0295 (Taylor): 1.3e-12.
_LOG = [float.hex(2.0 / (2 * j + 1)) for j in range(7)]
# sin(r) = r * (1 + z*S(z)), z = r*r <= (pi/4)**2, degree 4: 1.9e-14.
_SIN = (
    "-0x1.555555555516bp-3 0x1.1111110fd3d43p-7 -0x1.a019fd9b35ee5p-13 0x1.71d9a9f41c5a9p-19 -0x1.aa285788aaa42p-26"
).split()
# cos(r) = 1 + z*C(z), degree 4: 3.1e-13.
_COS = (
    "-0x1.fffffffffe697p-2 0x1.555555514f774p-5 -0x1.6c16bae5ef6d4p-10 0x1.a01298d866458p-16 -0x1.2474e1a97d143p-22"
).split()
# tanh(x) = x * (1 + z*T(z)) for |x| < 1/16, degree 2: 1.6e-13.
_TANH = "-0x1.55555554a29a7p-2 0x1.1110f7ee36effp-3 -0x1.b90f6097b8487p-5".split()
# erf(x) = x * (2/sqrt(pi) + z*R(z)), z = x*x, for |x| < 1, R of degree 7: 3.8e-12.
_ERF_SMALL = (
    "0x1.20dd750429b6dp+0 -0x1.812746b02839bp-2 0x1.ce2f2181773c0p-4 -0x1.b82cd8ee4fb48p-6 0x1.565a8630ca618p-8 "
    "-0x1.c0051681c2df2p-11 0x1.f6e000d7a6e08p-14 -0x1.d9c522c83956fp-17 0x1.2acbb5e9f79e8p-20"
).split()
# erfc(a) * exp(a*a) = G(u), u = 1/(1 + a/2) - 1/2, for 1 <= a <= 4, degree 9: 3.3e-12.
_ERFCX = (
    "0x1.058671b52feeep-2 0x1.b57034efd7e9cp-1 0x1.eeea7dbc73a8ap-1 0x1.437f0b4cfdf26p-1 0x1.e947f2a1a448ep-5 "
    "-0x1.ca95704f47c12p-3 -0x1.bc7de4beb4d06p-5 0x1.013a0f41438a4p-3 0x1.a7ddfaab054e5p-7 -0x1.5dc271b0644a7p-4"
).split()

_PRELUDE_TEMPLATE = r"""
/* ---- zyx math prelude (zyx/kernel/c_math.py) ---- */
#ifndef ZYX_MATH_PRELUDE
#define ZYX_MATH_PRELUDE 1
#if defined(__FAST_MATH__)
#error "the zyx math prelude needs IEEE semantics: do not compile it with -ffast-math"
#endif
#include <math.h>
#include <stdint.h>
#include <string.h>

#define ZYX_MATH_FN static inline __attribute__((always_inline, unused))

ZYX_MATH_FN double zyx__as_f64(uint64_t u) { double d; memcpy(&d, &u, sizeof d); return d; }
ZYX_MATH_FN uint64_t zyx__as_u64(double d) { uint64_t u; memcpy(&u, &d, sizeof u); return u; }
ZYX_MATH_FN float zyx__as_f32(uint32_t u) { float f; memcpy(&f, &u, sizeof f); return f; }
ZYX_MATH_FN uint32_t zyx__as_u32(float f) { uint32_t u; memcpy(&u, &f, sizeof u); return u; }

/* c ? a : b as bit masks.  Plain ternaries with a constant arm become control flow that GCC's
   if-conversion rejects (under -ftrapping-math), which stops the whole loop from vectorizing. */
ZYX_MATH_FN double zyx__sel64(int c, double a, double b) {
    uint64_t m = (uint64_t)0 - (uint64_t)(c != 0);
    return zyx__as_f64((zyx__as_u64(a) & m) | (zyx__as_u64(b) & ~m));
}
ZYX_MATH_FN float zyx__sel32(int c, float a, float b) {
    uint32_t m = (uint32_t)0 - (uint32_t)(c != 0);
    return zyx__as_f32((zyx__as_u32(a) & m) | (zyx__as_u32(b) & ~m));
}
/* |d| with the sign bit of s */
ZYX_MATH_FN double zyx__with_sign(double d, double s) {
    return zyx__as_f64((zyx__as_u64(d) & 0x7fffffffffffffffull) | (zyx__as_u64(s) & 0x8000000000000000ull));
}

/* (t + ZYX__RND) - ZYX__RND rounds |t| < 2**51 to an integer k, and the low bits of t + ZYX__RND
   are k in two's complement. */
#define ZYX__RND 0x1.8p52

/* 2**t for -1022 <= t <= 1023 (nan -> nan), relative error < 3e-12. */
ZYX_MATH_FN double zyx__exp2_kernel(double t) {
    double m = t + ZYX__RND;
    double k = m - ZYX__RND;
    double r = t - k; /* exact, |r| <= 1/2 */
    double p = 1.0 + r * @EXP2_POLY@;
    return p * zyx__as_f64((zyx__as_u64(m) + 1023u) << 52);
}

/* For a positive normal double x: returns log(m) and sets *k, with x = 2**k * m, m in [sqrt(1/2), sqrt(2)). */
ZYX_MATH_FN double zyx__log_kernel(double x, double *k) {
    uint64_t u = zyx__as_u64(x);
    uint64_t d = u - 0x3fe6a09e667f3bcdull; /* bits of sqrt(1/2) */
    /* floor(d / 2**52) + 2048 without a 64-bit arithmetic shift, converted exactly through 2**52 */
    uint64_t kb = (d + 0x8000000000000000ull) >> 52;
    *k = zyx__as_f64(0x4330000000000000ull | kb) - (0x1p52 + 2048.0);
    double m = zyx__as_f64(u - (d & 0xfff0000000000000ull));
    double f = m - 1.0; /* exact */
    double s = f / (2.0 + f);
    double z = s * s;
    return s * @LOG_POLY@;
}

/* x (finite float) = n*pi/2 + r, |r| <= pi/4; returns r, *n gets n mod 4 in its low two bits. */
ZYX_MATH_FN double zyx__reduce_pio2(float x, uint64_t *n) {
    static const double c[3 * @TABLE_LEN@] = {
        @TABLE@
    };
    int be = (int)((zyx__as_u32(x) >> 23) & 0xffu);
    int e = be < 126 ? 126 : be;
    e = e > 254 ? 254 : e;
    int64_t i = 3 * (int64_t)(e - 126); /* 64-bit: lets GCC emulate the gather where it will not use one */
    double xd = (double)x;
    double mi = xd * zyx__as_f64((uint64_t)(1023 + 150 - e) << 52); /* x / 2**E: an integer, |mi| < 2**24 */
    double p1 = mi * c[i]; /* exact */
    double m1 = p1 + ZYX__RND;
    double f1 = p1 - (m1 - ZYX__RND); /* exact, |f1| <= 1/2 */
    double p2 = f1 + mi * c[i + 1];       /* exact */
    double m2 = p2 + ZYX__RND;
    double f2 = p2 - (m2 - ZYX__RND);
    double p3 = f2 + mi * c[i + 2];
    double m3 = p3 + ZYX__RND;
    double f3 = p3 - (m3 - ZYX__RND); /* x*2/pi minus an integer, |f3| <= 1/2 */
    uint64_t big = (uint64_t)0 - (uint64_t)(be >= 126); /* |x| >= 0.5; below, r = x and n = 0 */
    *n = (zyx__as_u64(m1) + zyx__as_u64(m2) + zyx__as_u64(m3)) & big;
    return zyx__sel64(be >= 126, f3 * 0x1.921fb54442d18p+0, xd);
}

ZYX_MATH_FN double zyx__sin_poly(double r, double z) { return r * (1.0 + z * @SIN_POLY@); } /* sin(-0) = -0 */
ZYX_MATH_FN double zyx__cos_poly(double z) { return 1.0 + z * @COS_POLY@; }

/* sin(x + q*pi/2) */
ZYX_MATH_FN float zyx__sin_quadrant(float x, uint64_t q) {
    uint64_t n;
    double r = zyx__reduce_pio2(x, &n);
    n += q;
    double z = r * r;
    double v = zyx__sel64((int)(n & 1u), zyx__cos_poly(z), zyx__sin_poly(r, z));
    v = zyx__as_f64(zyx__as_u64(v) ^ ((n & 2u) << 62));
    return zyx__sel32(!(__builtin_fabsf(x) <= 0x1.fffffep127f), __builtin_nanf(""), (float)v);
}

ZYX_MATH_FN float zyx_sinf(float x) { return zyx__sin_quadrant(x, 0); }
ZYX_MATH_FN float zyx_cosf(float x) { return zyx__sin_quadrant(x, 1); }

ZYX_MATH_FN float zyx_tanf(float x) {
    uint64_t n;
    double r = zyx__reduce_pio2(x, &n);
    double z = r * r;
    double s = zyx__sin_poly(r, z), c = zyx__cos_poly(z);
    int odd = (int)(n & 1u);
    double v = zyx__sel64(odd, -c, s) / zyx__sel64(odd, s, c);
    return zyx__sel32(!(__builtin_fabsf(x) <= 0x1.fffffep127f), __builtin_nanf(""), (float)v);
}

ZYX_MATH_FN float zyx_exp2f(float x) {
    double t = (double)x;
    t = zyx__sel64(t > 130.0, 130.0, t); /* 2**130 rounds to inf, 2**-160 to 0; nan stays */
    t = zyx__sel64(t < -160.0, -160.0, t);
    return (float)zyx__exp2_kernel(t);
}

ZYX_MATH_FN float zyx_expf(float x) {
    double t = (double)x * 0x1.71547652b82fep+0; /* log2(e) */
    t = zyx__sel64(t > 130.0, 130.0, t);
    t = zyx__sel64(t < -160.0, -160.0, t);
    return (float)zyx__exp2_kernel(t);
}

ZYX_MATH_FN float zyx__log_special(float x, float v) {
    v = zyx__sel32(x == 0.0f, -__builtin_inff(), v);
    v = zyx__sel32(x == __builtin_inff(), __builtin_inff(), v);
    return zyx__sel32(!(x >= 0.0f), __builtin_nanf(""), v); /* x < 0 or nan */
}

ZYX_MATH_FN float zyx_logf(float x) {
    double k;
    double lm = zyx__log_kernel((double)x, &k); /* float denormals are normal doubles */
    return zyx__log_special(x, (float)(k * 0x1.62e42fefa39efp-1 + lm));
}

ZYX_MATH_FN float zyx_log2f(float x) {
    double k;
    double lm = zyx__log_kernel((double)x, &k);
    return zyx__log_special(x, (float)(k + lm * 0x1.71547652b82fep+0));
}

ZYX_MATH_FN float zyx_tanhf(float x) {
    double xd = (double)x;
    double a = __builtin_fabs(xd);
    double z = xd * xd;
    double small = xd * (1.0 + z * @TANH_POLY@); /* x * (...) keeps the sign of -0 */
    double t = a * 0x1.71547652b82fep+1; /* 2*log2(e)*|x| */
    t = zyx__sel64(t > 64.0, 64.0, t);
    double big = 1.0 - 2.0 / (zyx__exp2_kernel(t) + 1.0);
    return (float)zyx__sel64(a < 0.0625, small, zyx__with_sign(big, xd));
}

ZYX_MATH_FN float zyx_erff(float x) {
    double xd = (double)x;
    double a = __builtin_fabs(xd);
    double z = xd * xd;
    double small = xd * @ERF_SMALL_POLY@;
    double ac = zyx__sel64(a > 4.0, 4.0, a); /* erf(4) rounds to 1.0f */
    double u = 1.0 / (1.0 + 0.5 * ac) - 0.5;
    double g = @ERFCX_POLY@;
    double big = 1.0 - g * zyx__exp2_kernel(-(ac * ac) * 0x1.71547652b82fep+0);
    return (float)zyx__sel64(a < 1.0, small, zyx__with_sign(big, xd));
}

ZYX_MATH_FN float zyx_sqrtf(float x) {
    double d = (double)x;
    double h = 0.5 * d;
    double y = zyx__as_f64(0x5fe6ec85d4e40000ull - (zyx__as_u64(d) >> 1)); /* 1/sqrt(d) within 3.5% */
    y = y * (1.5 - h * y * y);
    y = y * (1.5 - h * y * y);
    y = y * (1.5 - h * y * y);
    y = y * (1.5 - h * y * y);
    float v = (float)(d * y);
    v = zyx__sel32(x == __builtin_inff(), __builtin_inff(), v);
    return zyx__sel32(x < 0.0f, __builtin_nanf(""), v);
}

ZYX_MATH_FN double zyx_exp(double x) { return exp(x); }
ZYX_MATH_FN double zyx_exp2(double x) { return exp2(x); }
ZYX_MATH_FN double zyx_log(double x) { return log(x); }
ZYX_MATH_FN double zyx_log2(double x) { return log2(x); }
ZYX_MATH_FN double zyx_sin(double x) { return sin(x); }
ZYX_MATH_FN double zyx_cos(double x) { return cos(x); }
ZYX_MATH_FN double zyx_tan(double x) { return tan(x); }
ZYX_MATH_FN double zyx_tanh(double x) { return tanh(x); }
ZYX_MATH_FN double zyx_erf(double x) { return erf(x); }
ZYX_MATH_FN double zyx_sqrt(double x) { return sqrt(x); }

#endif /* ZYX_MATH_PRELUDE */
/* ---- end of zyx math prelude ---- */
"""


def _build_prelude() -> str:
    subs = {
        "@EXP2_POLY@": _horner("r", _EXP2),
        "@LOG_POLY@": _horner("z", _LOG),
        "@SIN_POLY@": _horner("z", _SIN),
        "@COS_POLY@": _horner("z", _COS),
        "@TANH_POLY@": _horner("z", _TANH),
        "@ERF_SMALL_POLY@": _horner("z", _ERF_SMALL),
        "@ERFCX_POLY@": _horner("u", _ERFCX),
        "@TABLE_LEN@": str(_TABLE_E_MAX - _TABLE_E_MIN + 1),
        "@TABLE@": _table_source(),
    }
    src = _PRELUDE_TEMPLATE
    for key, value in subs.items():
        src = src.replace(key, value)
    return src


C_MATH_PRELUDE: str = _build_prelude()

_OPS = ("exp", "exp2", "log", "log2", "sin", "cos", "tan", "tanh", "erf", "sqrt")

C_MATH_FUNCTIONS: dict[tuple[str, str], str] = {}
for _op in _OPS:
    C_MATH_FUNCTIONS[(_op, "float32")] = f"zyx_{_op}f"
    C_MATH_FUNCTIONS[(_op, "float64")] = f"zyx_{_op}"
del _op

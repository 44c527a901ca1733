"""Elementary functions for the generated host C kernels (the "math prelude").

``C_MATH_PRELUDE`` is C11 source to paste in front of a generated kernel; ``C_MATH_FUNCTIONS`` maps
``(op, dtype)`` to the name of the C function that computes it, e.g. ``("exp", "float32") -> "zyx_expf"``.

float32 (``zyx_expf zyx_exp2f zyx_logf zyx_log2f zyx_sinf zyx_cosf zyx_tanf zyx_tanhf zyx_erff zyx_sqrtf``,
all ``float f(float)``):

* Vectorization.  Written so that GCC auto-vectorizes a ``#pragma omp simd`` loop that calls them, compiled
  with ``-O3 -march=native`` and *without* ``-ffast-math`` (so glibc's libmvec is not an option): the
  functions are ``static inline`` and always inlined, make no calls (no libm, no errno), read no memory,
  keep no state, and have no branches on data.  Every data-dependent choice is a select done with bit
  masks (``zyx__sel64``/``zyx__sel32``): GCC 12 turns plain ``c ? k : v`` ternaries with a constant arm
  into control flow that its if-conversion then refuses (the FP operations it sinks into the arms "could
  trap" under the default ``-ftrapping-math``), which silently stops the whole loop from vectorizing.
  Bit casts go through ``memcpy``.  ``zyx_sqrtf`` cannot be ``__builtin_sqrtf``: with ``-fmath-errno``
  (the default) GCC keeps a call to ``sqrtf`` for the errno path and the loop does not vectorize, not even
  under ``optimize("no-math-errno")``; it is a Newton iteration instead.
  ``tests/kernel/test_c_math.py`` checks with ``-fopt-info-vec-optimized`` that every float32 loop
  vectorizes.  Verified with GCC 12 for ``-march=native`` (AVX-512 here), ``x86-64-v2``, ``x86-64-v3``,
  ``haswell``, ``skylake-avx512``, ``znver2``, ``znver3``, at ``-O2`` and ``-O3`` and with
  ``-std=c99/c11/gnu11`` (no warnings under ``-Wall -Wextra -pedantic``).  Baseline ``-march=x86-64``
  (SSE2, no 64-bit lane compares) leaves sin/cos/tan scalar.

* Arithmetic.  exp, exp2, log, log2, tanh, erf, sqrt and the polynomials of sin/cos run in float (full
  vector width).  The sin/cos/tan argument reduction, log2's last step without FMA and tan run in double
  (half width) where float cannot reach 1 ulp cheaply.  Where the target has FMA (``__FP_FAST_FMA``,
  ``__FP_FAST_FMAF``: every x86-64-v3 / AVX2-era CPU and aarch64) it is used explicitly via
  ``__builtin_fma[f]`` (every Horner step of every polynomial: ``ZYX__FMAF``, ``ZYX__FMA``), so results do not
  depend on ``-ffp-contract``, and the host backend's ``-ffp-contract=off`` (elementwise code rounds as NumPy)
  does not cost the polynomials their FMAs: with separate multiplies and adds, a softmax over rows of 56 ran
  15% slower.  Without FMA a slower or shorter-range variant is compiled (see below).

* Accuracy, checked exhaustively over all 2**32 float32 inputs (``scripts/check_c_math_exhaustive.py``: GCC 12,
  the host backend's flags, -march=native with FMA) against glibc's float64 functions rounded to float32:
  every function is within 1 ulp of the rounded reference, denormal inputs and outputs included, and agrees
  on every NaN and infinity; sqrt is correctly rounded.  Max error against the unrounded float64 value, in
  ulp: exp 1.08, exp2 0.91, log 0.92, log2 1.15, sin 1.38, cos 1.39 (for |x| < 2**44), tan 0.50, tanh 1.33,
  erf 1.36 (1.48 without FMA), sqrt 0.50.  (erf in float arithmetic is odd by construction.)
  sin/cos/tan use a Cody-Waite reduction in double with pi/2 in 25+26+53 bits.  With FMA it is accurate for
  |x| < 2**44 (1.8e13), so the bound holds there (float32 spacing is 2**21 at 2**44); without FMA it holds
  for |x| < 2**27*pi/2 (2.1e8), and the absolute error grows like |x|*1e-16 above.  Beyond the limit the
  result is meaningless but bounded (|sin|, |cos| <= 1, never nan).  (A Payne-Hanek table reduction
  exact up to 3.4e38 was tried: its three gathers per element made sin 3x slower.)

* Special values follow NumPy's float32 functions: exp(-inf)=0, exp(inf)=inf, overflow -> inf,
  underflow -> the rounded denormal or 0 (no flush to zero); log(0)=-inf, log(x<0)=nan, log(inf)=inf;
  sin/cos/tan(+-inf)=nan; tanh(+-inf)=+-1; erf(+-inf)=+-1; sqrt(x<0)=nan, sqrt(inf)=inf, sqrt(-0)=-0;
  nan in -> nan out everywhere; odd functions keep the sign of zero.

float64 (``zyx_exp zyx_exp2 zyx_log zyx_log2 zyx_sin zyx_cos zyx_tan zyx_tanh zyx_erf zyx_sqrt``,
all ``double f(double)``) call glibc's libm (correctly rounded or within 1 ulp, libm's special values);
loops over them do not vectorize.  libm is already loaded in every Python process, so a kernel
``.so`` needs no ``-lm`` to load; link with ``-lm`` anyway when building a stand-alone binary.

The prelude refuses ``-ffast-math`` (``#error``): the rounding trick ``(t + 1.5*2**23) - 1.5*2**23``
and the NaN tests need IEEE semantics.
"""

from __future__ import annotations

__all__ = ["C_MATH_FUNCTIONS", "C_MATH_PRELUDE"]


def _horner(var: str, coeffs: list[str], fma: str = "ZYX__FMAF") -> str:
    """C expression c0 + var*(c1 + var*(c2 + ...)) for coefficient literals in ascending order, each step a
    ``fma`` (``ZYX__FMAF`` for float, ``ZYX__FMA`` for double): one fused multiply-add where the target has FMA."""
    expr = coeffs[-1]
    for c in reversed(coeffs[:-1]):
        expr = f"{fma}({var}, {expr}, {c})"
    return expr


# Polynomial coefficients: near-minimax fits (Chebyshev interpolation with mpmath.chebyfit at 40-50 digits,
# rounded to float or double) or Taylor coefficients.  The relative errors quoted are those of the whole
# approximation with the rounded coefficients, before the rounding errors of its evaluation.
#
# float32 arithmetic (16 lanes per AVX-512 vector):
# exp(r) = 1 + (r + r*r*Q(r)), |r| <= ln(2)/2, Q of degree 4: 9.6e-9.
_EXPF = "0x1p-1 0x1.5554dep-3 0x1.55551ap-5 0x1.120b62p-7 0x1.6d10fcp-10".split()
# 2**r = 1 + r*Q(r), |r| <= 1/2, Q of degree 5: 9.2e-9.
_EXP2F = "0x1.62e430p-1 0x1.ebfbe0p-3 0x1.c6af6cp-5 0x1.3b2a54p-7 0x1.5f0890p-10 0x1.44138ap-13".split()
# log1p(f) = f + f*f*(f*R(f) - 1/2), f in [sqrt(1/2) - 1, sqrt(2) - 1], R of degree 8: 3.4e-9.
_LOGF = (
    "0x1.555554p-2 -0x1.fffffcp-3 0x1.999d5ap-3 -0x1.555b4ap-3 0x1.23d21ap-3 -0x1.fcf4c6p-4 0x1.dea282p-4 "
    "-0x1.d635bcp-4 0x1.1d8ea6p-4"
).split()
# sin(r) = r + r*z*S(z), z = r*r <= (pi/4)**2, S of degree 2: 1.3e-8.
_SINF = "-0x1.555552p-3 0x1.110c28p-7 -0x1.9ac9b0p-13".split()
# cos(r) = 1 + z*(-1/2 + z*C(z)), C of degree 2: 8.4e-10.
_COSF = "0x1.555554p-5 -0x1.6c12d2p-10 0x1.9bd89cp-16".split()
# tanh(x) = x + x*z*T(z), z = x*x, |x| < 0.625, T of degree 5: 4.2e-9.
_TANHF = "-0x1.555556p-2 0x1.1110eap-3 -0x1.ba08c4p-5 0x1.64a976p-6 -0x1.116a16p-7 0x1.2c83c0p-9".split()
#
# double arithmetic (tan), and erf's polynomials (fitted in double, evaluated in float):
# sin(r) = r * (1 + z*S(z)), z = r*r <= (pi/4)**2, degree 4: 1.9e-14.
_SIN = (
    "-0x1.555555555516bp-3 0x1.1111110fd3d43p-7 -0x1.a019fd9b35ee5p-13 0x1.71d9a9f41c5a9p-19 -0x1.aa285788aaa42p-26"
).split()
# cos(r) = 1 + z*C(z), degree 4: 3.1e-13.
_COS = (
    "-0x1.fffffffffe697p-2 0x1.555555514f774p-5 -0x1.6c16bae5ef6d4p-10 0x1.a01298d866458p-16 -0x1.2474e1a97d143p-22"
).split()
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


def _f(coeffs: list[str]) -> list[str]:
    """float literals"""
    return [c + "f" for c in coeffs]


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

/* a*b + c: one rounding where the target has FMA (the polynomials' Horner steps, sin/cos's reduction), two
   otherwise */
#if defined(__FP_FAST_FMAF)
#define ZYX__FMAF(a, b, c) __builtin_fmaf((a), (b), (c))
#else
#define ZYX__FMAF(a, b, c) ((a) * (b) + (c))
#endif
#if defined(__FP_FAST_FMA)
#define ZYX__FMA(a, b, c) __builtin_fma((a), (b), (c))
#else
#define ZYX__FMA(a, b, c) ((a) * (b) + (c))
#endif

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
/* The same for 64- and 32-bit integers: GCC compiles an integer ternary fed by an unpredictable compare into a
   branch (the first index of a window's maximum, taken at random taps, mispredicted once per window). */
ZYX_MATH_FN long long zyx__seli64(int c, long long a, long long b) {
    uint64_t m = (uint64_t)0 - (uint64_t)(c != 0);
    return (long long)(((uint64_t)a & m) | ((uint64_t)b & ~m));
}
ZYX_MATH_FN int zyx__seli32(int c, int a, int b) {
    uint32_t m = (uint32_t)0 - (uint32_t)(c != 0);
    return (int)(((uint32_t)a & m) | ((uint32_t)b & ~m));
}
/* 2**k for integer -126 <= k <= 127 */
ZYX_MATH_FN float zyx__pow2i(int32_t k) { return zyx__as_f32((uint32_t)(k + 127) << 23); }

/* (t + ZYX__RND) - ZYX__RND rounds |t| < 2**51 to an integer k, and the low bits of t + ZYX__RND
   are k in two's complement; ZYX__RNDF does the same in float for |t| < 2**22. */
#define ZYX__RND 0x1.8p52
#define ZYX__RNDF 0x1.8p23f
#define ZYX__FLT_MAX 0x1.fffffep127f

/* ---- exp, exp2: float arithmetic ---- */

/* p * 2**k for float k in [-160, 145] (integer valued, m = k + ZYX__RNDF): two exact-power scalings, so
   the only rounding is the last product, which overflows to inf or rounds into the denormals. */
ZYX_MATH_FN float zyx__scalef(float p, float m) {
    int32_t k = (int32_t)(zyx__as_u32(m) - zyx__as_u32(ZYX__RNDF));
    int32_t k1 = k >> 1;
    return p * zyx__pow2i(k1) * zyx__pow2i(k - k1);
}

/* e**x for -110 <= x <= 100 (nan -> nan) */
ZYX_MATH_FN float zyx__expf_kernel(float x) {
    float m = x * 0x1.715476p+0f + ZYX__RNDF; /* log2(e) */
    float k = m - ZYX__RNDF;
    float r = x - k * 0x1.62ep-1f; /* exact: 13-bit high part of ln 2, |k| < 2**8 */
    r = r - k * 0x1.0bfbe8p-15f;  /* ln 2 - 0x1.62ep-1 */
    float p = 1.0f + ZYX__FMAF(r * r, @EXPF_POLY@, r);
    return zyx__scalef(p, m);
}

/* Inputs whose result rounds to +0 (x < -104, e**x < 2**-150) are computed as 0: the lanes computing them
   would otherwise produce denormal intermediates, which cost a microcode assist each on x86 (a masked
   softmax, exp(-inf), ran 4x slower). */
ZYX_MATH_FN float zyx_expf(float x) {
    int zero = x < -104.0f;
    x = zyx__sel32(x > 100.0f, 100.0f, x); /* e**100 overflows; nan stays */
    return zyx__sel32(zero, 0.0f, zyx__expf_kernel(zyx__sel32(zero, 0.0f, x)));
}

ZYX_MATH_FN float zyx_exp2f(float x) {
    int zero = x < -151.0f; /* rounds to +0, computed as 0 (see zyx_expf) */
    x = zyx__sel32(x > 130.0f, 130.0f, x);
    x = zyx__sel32(zero, 0.0f, x);
    float m = x + ZYX__RNDF;
    float r = x - (m - ZYX__RNDF); /* exact, |r| <= 1/2 */
    float p = ZYX__FMAF(r, @EXP2F_POLY@, 1.0f);
    return zyx__sel32(zero, 0.0f, zyx__scalef(p, m));
}

/* ---- log, log2: float arithmetic ---- */

/* For finite x > 0 (denormals included): x = 2**k * (1 + f) with 1 + f in [sqrt(1/2), sqrt(2)).
   Returns f; *k = k and *p = log1p(f) - f. */
ZYX_MATH_FN float zyx__logf_parts(float x, float *k, float *p) {
    int den = x < 0x1p-126f;
    float xs = zyx__sel32(den, x * 0x1p23f, x); /* exact */
    uint32_t ix = zyx__as_u32(xs) - 0x3f3504f3u; /* bits of sqrt(1/2) */
    *k = (float)((int32_t)ix >> 23) - zyx__sel32(den, 23.0f, 0.0f);
    float f = zyx__as_f32((ix & 0x007fffffu) + 0x3f3504f3u) - 1.0f; /* exact */
    *p = f * f * (f * @LOGF_POLY@ - 0.5f);
    return f;
}

ZYX_MATH_FN float zyx__logf_special(float x, float v) {
    v = zyx__sel32(x == 0.0f, -__builtin_inff(), v);
    v = zyx__sel32(x == __builtin_inff(), __builtin_inff(), v);
    return zyx__sel32(!(x >= 0.0f), __builtin_nanf(""), v); /* x < 0 or nan */
}

ZYX_MATH_FN float zyx_logf(float x) {
    float k, p;
    float f = zyx__logf_parts(x, &k, &p);
    /* k * ln 2 as an exact high part (13 bits times |k| < 2**8) plus a correction */
    return zyx__logf_special(x, k * 0x1.62ep-1f + (f + (p + k * 0x1.0bfbe8p-15f)));
}

ZYX_MATH_FN float zyx_log2f(float x) {
    float k, p;
    float f = zyx__logf_parts(x, &k, &p);
#if defined(__FP_FAST_FMAF)
    /* log2(e) * f as hi + lo exactly (FMA), then the small terms */
    float hi = f * 0x1.715476p+0f;
    float lo = __builtin_fmaf(f, 0x1.715476p+0f, -hi);
    float v = k + (hi + (lo + (f * 0x1.4ae0c0p-26f + p * 0x1.715476p+0f))); /* log2(e) - 0x1.715476p+0 */
#else
    float v = (float)((double)k + ((double)f + (double)p) * 0x1.71547652b82fep+0);
#endif
    return zyx__logf_special(x, v);
}

/* ---- sin, cos, tan ---- */

/* x = n*pi/2 + r, |r| <= pi/4 (up to rounding), n mod 4 in the low bits of *n.  Cody-Waite in double with
   pi/2 split into 25 + 26 + 53 bits.  Without FMA it is exact for |x| < 2**27 * pi/2 (2.1e8), where k*P1
   and k*P2 are exact products and the first two subtractions are exact.  With FMA (__FP_FAST_FMA) the
   first two steps are exact for any |k| < 2**53 and the limit is the rounding of k = rint(x*2/pi): fine
   for |x| < 2**44 (1.8e13).  Beyond that r is meaningless and only kept bounded. */
ZYX_MATH_FN double zyx__reduce_pio2(float x, uint32_t *n) {
    double xd = (double)x;
    double m = ZYX__FMA(xd, 0x1.45f306dc9c883p-1, ZYX__RND); /* 2/pi */
    double k = m - ZYX__RND;
    double r = ZYX__FMA(-k, 0x1.921fb5p+0, xd);
    r = ZYX__FMA(-k, 0x1.110b46p-26, r);
    r = ZYX__FMA(-k, 0x1.1a62633145c07p-54, r);
    *n = (uint32_t)zyx__as_u64(m);
    return zyx__sel64(__builtin_fabs(r) <= 1.0, r, 0.5);
}

/* sin(x + q*pi/2): the reduced argument is split into floats r = rf + rl, the polynomials run in float */
ZYX_MATH_FN float zyx__sinf_quadrant(float x, uint32_t q) {
    uint32_t n;
    double r = zyx__reduce_pio2(x, &n);
    float rf = (float)r;
    float rl = (float)(r - (double)rf);
    float z = rf * rf;
    float s = rf + (rf * z * @SINF_POLY@ + rl);
    float c = 1.0f + (z * (-0.5f + z * @COSF_POLY@) - rf * rl);
    n += q;
    float v = zyx__sel32((int)(n & 1u), c, s);
    v = zyx__as_f32(zyx__as_u32(v) ^ ((n & 2u) << 30)); /* negate in quadrants 2 and 3 */
    return zyx__sel32(!(__builtin_fabsf(x) <= ZYX__FLT_MAX), __builtin_nanf(""), v);
}

ZYX_MATH_FN float zyx_sinf(float x) {
    return zyx__sel32(__builtin_fabsf(x) < 0x1p-12f, x, zyx__sinf_quadrant(x, 0u)); /* keeps -0 */
}
ZYX_MATH_FN float zyx_cosf(float x) { return zyx__sinf_quadrant(x, 1u); }

ZYX_MATH_FN double zyx__sin_poly(double r, double z) { return r * (1.0 + z * @SIN_POLY@); }
ZYX_MATH_FN double zyx__cos_poly(double z) { return 1.0 + z * @COS_POLY@; }

ZYX_MATH_FN float zyx_tanf(float x) {
    uint32_t n;
    double r = zyx__reduce_pio2(x, &n);
    double z = r * r;
    double s = zyx__sin_poly(r, z), c = zyx__cos_poly(z);
    int odd = (int)(n & 1u);
    double v = zyx__sel64(odd, -c, s) / zyx__sel64(odd, s, c); /* -cot in odd quadrants */
    return zyx__sel32(!(__builtin_fabsf(x) <= ZYX__FLT_MAX), __builtin_nanf(""), (float)v);
}

/* ---- tanh, erf: float arithmetic ---- */

ZYX_MATH_FN float zyx_tanhf(float x) {
    float a = __builtin_fabsf(x);
    float z = x * x;
    float small = x + x * z * @TANHF_POLY@;
    small = zyx__sel32(a < 0x1p-12f, x, small); /* tanh(x) rounds to x; keeps -0 */
    float e = zyx__expf_kernel(zyx__sel32(a > 10.0f, 20.0f, a + a)); /* tanh(10) rounds to 1; nan stays */
    float big = 1.0f - 2.0f / (e + 1.0f);
    big = zyx__as_f32(zyx__as_u32(big) | (zyx__as_u32(x) & 0x80000000u));
    return zyx__sel32(a < 0.625f, small, big);
}

ZYX_MATH_FN float zyx_erff(float x) {
    float a = __builtin_fabsf(x);
    float z = x * x;
    float small = x + x * @ERF_SMALL_POLYF@; /* x + x*(2/sqrt(pi) - 1 + ...): the leading x is exact */
    float ac = zyx__sel32(a > 4.0f, 4.0f, a); /* erf(4) rounds to 1.0f; nan stays */
    float u = 1.0f / (1.0f + 0.5f * ac) - 0.5f;
    float g = @ERFCX_POLYF@;
    float big = 1.0f - g * zyx_exp2f(-(ac * ac) * 0x1.715476p+0f);
    big = zyx__as_f32(zyx__as_u32(big) | (zyx__as_u32(x) & 0x80000000u));
    return zyx__sel32(a < 1.0f, small, big);
}

/* ---- sqrt: Newton iteration (__builtin_sqrtf keeps an errno call and does not vectorize) ---- */

#if defined(__FP_FAST_FMAF)
/* float: rsqrt by Newton, then one correction with the exact residual x - s*s (FMA) */
ZYX_MATH_FN float zyx_sqrtf(float x) {
    int tiny = x < 0x1p-100f; /* denormals and tiny normals: scale by 2**100, exact */
    float xs = zyx__sel32(tiny, x * 0x1p100f, x);
    float h = 0.5f * xs;
    float y = zyx__as_f32(0x5f37642eu - (zyx__as_u32(xs) >> 1)); /* 1/sqrt(xs) within 3.5% */
    y = y * (1.5f - h * y * y);
    y = y * (1.5f - h * y * y);
    y = y * (1.5f - h * y * y);
    float s = xs * y;
    s = __builtin_fmaf(__builtin_fmaf(-s, s, xs), 0.5f * y, s);
    float v = s * zyx__sel32(tiny, 0x1p-50f, 1.0f); /* exact */
    v = zyx__sel32(x == __builtin_inff(), __builtin_inff(), v);
    return zyx__sel32(x < 0.0f, __builtin_nanf(""), v);
}
#else
/* double: four Newton steps for 1/sqrt, then (float)(d * y) */
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
#endif

/* ---- float64: libm ---- */

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
        "@EXPF_POLY@": _horner("r", _f(_EXPF)),
        "@EXP2F_POLY@": _horner("r", _f(_EXP2F)),
        "@LOGF_POLY@": _horner("f", _f(_LOGF)),
        "@SINF_POLY@": _horner("z", _f(_SINF)),
        "@COSF_POLY@": _horner("z", _f(_COSF)),
        "@SIN_POLY@": _horner("z", _SIN, "ZYX__FMA"),
        "@COS_POLY@": _horner("z", _COS, "ZYX__FMA"),
        "@TANHF_POLY@": _horner("z", _f(_TANHF)),
        "@ERF_SMALL_POLYF@": _horner("z", _f([(float.fromhex(_ERF_SMALL[0]) - 1).hex()] + _ERF_SMALL[1:])),
        "@ERFCX_POLYF@": _horner("u", _f(_ERFCX)),
    }
    src = _PRELUDE_TEMPLATE
    for key, value in subs.items():
        assert key in src, key
        src = src.replace(key, value)
    return src


C_MATH_PRELUDE: str = _build_prelude()

_OPS = ("exp", "exp2", "log", "log2", "sin", "cos", "tan", "tanh", "erf", "sqrt")

C_MATH_FUNCTIONS: dict[tuple[str, str], str] = {}
for _op in _OPS:
    C_MATH_FUNCTIONS[(_op, "float32")] = f"zyx_{_op}f"
    C_MATH_FUNCTIONS[(_op, "float64")] = f"zyx_{_op}"
del _op

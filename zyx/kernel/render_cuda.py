"""CUDA C renderer: a kernel annotated by ``zyx.kernel.gpu.optimize`` → one ``extern "C" __global__`` function.

Shares the C-like base (``CStyleRenderer``): expressions, literals, per-op rounding, NaN-propagating max/min,
reduce identities and updates are the host's, so both targets compute the same thing. What differs:

- Frame: ``extern "C" __global__ void __launch_bounds__(threads) name(args)``, one argument per ``ir.Param``
  in order: buffers as ``T* __restrict__`` (``const`` for inputs), scalar variables by value with their
  register type. The launch geometry (``gpu.Geometry``) decides the loop structure; the renderer follows it:
  ``thread`` / ``segments`` grid-stride loops, ``group`` (shuffles, a shared exchange across warps), ``columns``
  (``threadIdx.x`` along the outputs, ``threadIdx.y`` splitting the reduce, partials combined in
  ``__shared__ acc_sh[TY][TX]``) and ``mma`` (operand tiles staged in ``__shared__ zsa`` / ``zsb`` by the whole
  block, fragments read from them, ``mma.sync.m16n8k16`` (``m16n8k8`` tf32 for float32) as inline PTX under
  ``__CUDA_ARCH__ >= 800``, with a portable branch that exchanges the same fragment registers by ``__shfl_sync``,
  so the emulator checks the shared layout, the fragment layout and the indexing), ``simt`` (operand tiles in
  ``__shared__ zsa`` / ``zsb`` as for ``mma``, each thread's runs of rows and columns read as 16-byte vectors into
  registers, ``fma`` into a register tile of accumulators). A vectorized ``thread`` layout
  (``Geometry.vector``) reads and writes its proven-aligned accesses through ``zyx_vld_T`` / ``zyx_vst_T``
  (``float4``, ``uint4``, ``double2``, ...; 1- and 2-byte elements packed little-endian in 32-bit words), which
  trap on a misaligned address when compiled for anything but a GPU (the emulator), as the GPU faults.
- float16 / bfloat16: stored as 16-bit patterns (``unsigned short``), computed in ``float`` registers and rounded
  back after every op, exactly as on the host. The conversions are the hardware ``cvt.rn`` instructions via
  inline PTX (what ``cuda_fp16.h`` / ``cuda_bf16.h`` emit) instead of including those headers, which would add
  ~130 ms of NVRTC parsing to every kernel; bf16 rounding falls back to integer code below sm_80. Outside
  device compilation (``__CUDA_ARCH__`` undefined) portable C++ versions are used.
- Math: CUDA's accurate functions (``expf``, ``sinf``, ``erff``, ..., double versions for float64; never the
  ``__expf`` intrinsics); NVRTC compiles without ``-use_fast_math`` (denormals kept, IEEE division and sqrt).
  ``INFINITY`` / ``NAN`` are defined from bit patterns (NVRTC has no ``math.h``).
- Index arithmetic: the IR computes indices in int64. An int64 value whose proven bounds (``vmin``/``vmax``) fit
  in int32 (ranges, ``//``, ``%``, affine index math) is computed as ``int`` (32-bit division is far cheaper on
  a GPU); it is widened with ``(long long)`` wherever it meets a wider operand, so no intermediate overflows.
- Integer helpers (floor division, remainder, shifts, integer powers) are the host's, as
  ``static __device__ __forceinline__`` functions, emitted only when used.
- Float → integer casts of 8/16/32-bit and unsigned targets go through a wider signed integer so out-of-range
  values wrap as on x86 (CUDA's ``cvt`` would saturate); int32/int64 targets of NaN or out-of-range values are
  still the hardware's (saturating) result.

Invariants: the rendered source depends only on the kernel and its geometry; ``__shared__`` arrays (for cross-warp
reduces, mma and simt tiles) are declared at the top of the kernel, static but for the ``cp.async`` ring of an mma
kernel, which is dynamic (it may exceed the 48 KiB of static shared memory), sized by ``CudaSource.shared_bytes``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from zyx import dtypes
from zyx.dtypes import DType
from zyx.kernel import gpu, ir
from zyx.kernel.gpu import Geometry
from zyx.kernel.ir import Expr, Kernel, Store
from zyx.kernel.linearize import Block, Loop, Reduce, ScanInit, linearize
from zyx.kernel.render import CStyleRenderer, _int_helpers
from zyx.kernel.target import DeviceInfo
from zyx.ops import Ops

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
FULL_MASK = "0xffffffffu"
_WIDE_OPS = frozenset({Ops.LOAD, Ops.VAR, Ops.BITCAST, Ops.REDUCE})
_NO_ARITH = frozenset({Ops.LOAD, Ops.CAST, Ops.BITCAST, Ops.VAR})
_SHUFFLE_TYPES = frozenset({"float", "double", "int", "unsigned int", "long long", "unsigned long long"})


@dataclass(frozen=True)
class CudaSource:
    """A rendered kernel and how to launch it.

    ``param_kinds``: "in" / "out" / "var" per kernel argument, in order. ``param_types``: each argument's C type
    (buffers are pointers; a "var" is passed by value: ``float`` for float16/bfloat16, ``bool`` is one byte).
    ``shared_bytes`` is the dynamic shared memory to pass to ``cuLaunchKernel`` (static arrays live in the cubin).
    The kernel is correct for any grid ``(x, 1, 1)`` with ``1 <= x <= grid[0]``; ``block`` is fixed.
    """

    name: str
    source: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    param_kinds: tuple[str, ...]
    param_types: tuple[str, ...] = ()


CUDA_PRELUDE = r"""#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif
#define ZYX_DEV static __device__ __forceinline__
"""

BITS_PRELUDE = r"""ZYX_DEV unsigned int zyx_f2u(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  unsigned int u; memcpy(&u, &f, 4); return u;
#endif
}
ZYX_DEV float zyx_u2f(unsigned int u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f; memcpy(&f, &u, 4); return f;
#endif
}
"""

FLOAT16_PRELUDE = r"""ZYX_DEV float zyx_float16_to_f32(unsigned short h) {
#ifdef __CUDA_ARCH__
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
#else
  unsigned int s = (unsigned int)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
  if (e == 0x1fu) u = s | 0x7f800000u | (m << 13);
  else if (e != 0) u = s | ((e + 112u) << 23) | (m << 13);
  else u = zyx_f2u((float)m * 5.9604644775390625e-08f) | s;
  return zyx_u2f(u);
#endif
}
ZYX_DEV unsigned short zyx_f32_to_float16(float f) {
#ifdef __CUDA_ARCH__
  unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
#else
  unsigned int u = zyx_f2u(f), s = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (unsigned short)(s | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return (unsigned short)(s | 0x7c00u);
  if (a < 0x38800000u) { float v = zyx_u2f(a) * 16777216.0f; unsigned int q = (unsigned int)v;
    float rem = v - (float)q; if (rem > 0.5f || (rem == 0.5f && (q & 1u))) q++; return (unsigned short)(s | q); }
  unsigned int r = a - 0x38000000u; r += 0xfffu + ((r >> 13) & 1u); return (unsigned short)(s | (r >> 13));
#endif
}
ZYX_DEV float zyx_round_float16(float f) { return zyx_float16_to_f32(zyx_f32_to_float16(f)); }
"""

BFLOAT16_PRELUDE = r"""ZYX_DEV float zyx_bfloat16_to_f32(unsigned short h) { return zyx_u2f((unsigned int)h << 16); }
ZYX_DEV unsigned short zyx_f32_to_bfloat16(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
#else
  unsigned int u = zyx_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u); return (unsigned short)(u >> 16);
#endif
}
ZYX_DEV float zyx_round_bfloat16(float f) { return zyx_bfloat16_to_f32(zyx_f32_to_bfloat16(f)); }
"""

F64_ODD_PRELUDE = r"""ZYX_DEV float zyx_f64_to_f32_odd(double d) {
#ifdef __CUDA_ARCH__
  float t = __double2float_rz(d); unsigned int u = zyx_f2u(t);
  if ((double)t != d && d == d) u |= 1u;
#else
  float t = (float)d; unsigned int u = zyx_f2u(t);
  if ((double)t != d && d == d) { if (fabs((double)t) > fabs(d)) u -= 1u; u |= 1u; }
#endif
  return zyx_u2f(u);
}
"""

ASYNC_PRELUDE = r"""#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
struct zyx_cp_queue {};
ZYX_DEV void zyx_cp_async(zyx_cp_queue&, void* dst, const void* src, bool ok) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
      :: "r"((unsigned int)__cvta_generic_to_shared(dst)), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
ZYX_DEV void zyx_cp_commit(zyx_cp_queue&) { asm volatile("cp.async.commit_group;" ::: "memory"); }
ZYX_DEV void zyx_cp_wait(zyx_cp_queue&, int pending) {
  if (pending <= 0) asm volatile("cp.async.wait_group 0;" ::: "memory");
  else if (pending == 1) asm volatile("cp.async.wait_group 1;" ::: "memory");
  else asm volatile("cp.async.wait_group 2;" ::: "memory");
}
#else
/* Off the GPU a copy lands when a wait retires its group, the latest the PTX allows: a step that reads a buffer
   before waiting for it reads stale data, as on the device. */
struct zyx_cp_queue { void* dst[64]; const void* src[64]; int group[64]; int n = 0, groups = 0; };
ZYX_DEV void zyx_cp_async(zyx_cp_queue& q, void* dst, const void* src, bool ok) {
  if (q.n == 64) __builtin_trap();
  q.dst[q.n] = dst; q.src[q.n] = ok ? src : nullptr; q.group[q.n++] = q.groups;
}
ZYX_DEV void zyx_cp_commit(zyx_cp_queue& q) { q.groups++; }
ZYX_DEV void zyx_cp_wait(zyx_cp_queue& q, int pending) {
  int kept = 0;
  for (int i = 0; i < q.n; i++) {
    if (q.group[i] < q.groups - pending) {
      if (q.src[i]) memcpy(q.dst[i], q.src[i], 16); else memset(q.dst[i], 0, 16);
    } else {
      q.dst[kept] = q.dst[i]; q.src[kept] = q.src[i]; q.group[kept++] = q.group[i];
    }
  }
  q.n = kept;
}
#endif
"""

TF32_PRELUDE = r"""ZYX_DEV unsigned int zyx_f32_to_tf32(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  unsigned int u; asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(f)); return u;
#else
  unsigned int u = zyx_f2u(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return u | 0x00400000u;
  return (u + 0x1000u) & 0xffffe000u;
#endif
}
"""
# zyx_f32_to_tf32: the bits of f rounded to tf32 (10-bit mantissa, nearest, ties away from zero, as
# cvt.rna.tf32.f32; overflow to infinity; a NaN stays a quiet NaN), low 13 bits zero off the GPU.

_HELPER_NAME = re.compile(r"\b(zyx_\w+)\(")

# vector accesses: 4- and 8-byte elements as CUDA vector types of them; 1- and 2-byte elements in 32-bit words
_NATIVE_VECTOR = {dtypes.float32: "float", dtypes.int32: "int", dtypes.uint32: "uint", dtypes.float64: "double",
                  dtypes.int64: "longlong", dtypes.uint64: "ulonglong"}
_WORDS = {16: ("uint4", "xyzw"), 8: ("uint2", "xy"), 4: ("unsigned int", "")}


def vector_type(d: DType, piece: int) -> tuple[str, str]:
    """The CUDA type of one ``piece``-byte vector access of ``d`` elements and its fields in element (native
    4- and 8-byte types) or 32-bit word (1- and 2-byte types) order."""
    if d.itemsize >= 4:
        n = piece // d.itemsize
        return f"{_NATIVE_VECTOR[d]}{n}", "xyzw"[:n]
    return _WORDS[piece]


def _vector_suffix(t: str) -> str:
    return t.replace("unsigned int", "u32")


def _vector_helpers() -> dict[str, str]:
    """``zyx_vld_T(p)`` / ``zyx_vst_T(p, v)``: one aligned vector access of type ``T``. Compiled for anything but a
    GPU (the emulator), a misaligned address traps, as the GPU faults on it (``misaligned address``)."""
    types = {vector_type(d, b)[0] for d in (*_NATIVE_VECTOR, dtypes.uint16) for b in (4, 8, 16)
             if (d.itemsize < 4 or b // d.itemsize >= 2)}
    out = {}
    for t in sorted(types):
        suffix = _vector_suffix(t)
        check = ("#ifndef __CUDA_ARCH__\n"
                 f"  if ((unsigned long long)p & (sizeof({t}) - 1)) __trap();\n"
                 "#endif\n")
        out[f"zyx_vld_{suffix}"] = (f"ZYX_DEV {t} zyx_vld_{suffix}(const void* p) {{\n{check}"
                                    f"  return *(const {t}*)p;\n}}\n")
        out[f"zyx_vst_{suffix}"] = (f"ZYX_DEV void zyx_vst_{suffix}(void* p, {t} v) {{\n{check}"
                                    f"  *({t}*)p = v;\n}}\n")
    return out


_VECTOR_HELPERS = _vector_helpers()


def _device_int_helpers() -> dict[str, str]:
    """The host's integer helpers as device functions, by name."""
    out = {}
    for line in _int_helpers().splitlines():
        m = _HELPER_NAME.search(line)
        if m:
            out[m.group(1)] = line.replace("static inline ", "ZYX_DEV ", 1)
    return out


_INT_HELPERS = _device_int_helpers()


def index_type(limit: int) -> str:
    """C type for a non-negative index that stays at most ``limit``."""
    return "int" if limit <= INT32_MAX else "long long"


def range_name(r: Expr) -> str:
    return f"r{r.arg[0]}"


class CUDARenderer(CStyleRenderer):
    """CUDA C for NVRTC; ``render`` takes a kernel that went through ``gpu.optimize``."""

    restrict = "__restrict__"
    math_fns: dict[tuple[str, str], str] = {}

    # ---- types -----------------------------------------------------------------------------------------------
    def reg_type(self, d: DType) -> str:
        return "bool" if d is dtypes.bool_ else super().reg_type(d)

    def is_narrow(self, e: Expr) -> bool:
        """An int64 value provably within int32 (computed as ``int``)."""
        return (e.dtype is ir.index_dtype and e.op not in _WIDE_OPS
                and INT32_MIN <= e.vmin and e.vmax <= INT32_MAX)

    def value_type(self, e: Expr) -> str:
        return "int" if self.is_narrow(e) else self.reg_type(e.dtype)

    def int_context(self, e: Expr) -> bool:
        """Whether ``e`` may combine its narrow int64 operands in 32-bit arithmetic."""
        if e.op in _NO_ARITH:
            return True
        wide = [s for s in e.srcs if s.dtype is ir.index_dtype]
        return all(self.is_narrow(s) for s in wide) and (e.dtype is not ir.index_dtype or self.is_narrow(e))

    # ---- expressions -----------------------------------------------------------------------------------------
    def operand(self, x: Expr, name: dict[Expr, str], int_ctx: bool) -> str:
        if x.op is Ops.CONST:
            narrow_lit = int_ctx and x.dtype is ir.index_dtype and self.is_narrow(x)
            return self.literal(x.arg, dtypes.int32 if narrow_lit else x.dtype)
        s = range_name(x) if x.op is Ops.RANGE else name[x]
        if not int_ctx and self.is_narrow(x):
            s = f"(long long){s}"
        return s

    def operand_namer(self, e: Expr, name: dict[Expr, str]):
        # int32-aware operands (see ``is_narrow``); the expression itself is the base's
        ctx = self.int_context(e)
        return lambda x: self.operand(x, name, ctx)

    def cast(self, e: Expr, a: str) -> str:
        if self.is_narrow(e):
            return f"(int)({a})"
        return super().cast(e, a)

    # ---- reductions ------------------------------------------------------------------------------------------
    def combine(self, op: Ops, acc: str, other: str, d: DType) -> str:
        """Fold a partial accumulator of reduce dtype ``d`` into ``acc`` (NaN flags are combined separately)."""
        if op in (Ops.MAX, Ops.MIN):
            c = ">" if op is Ops.MAX else "<"
            return f"{acc} = ({other} {c} {acc}) ? {other} : {acc};"
        return self.update(op, acc, other, d)

    def shuffle_xor(self, t: str, x: str, offset: str) -> str:
        if t in _SHUFFLE_TYPES:
            return f"__shfl_xor_sync({FULL_MASK}, {x}, {offset})"
        return f"({t})__shfl_xor_sync({FULL_MASK}, (int)({x}), {offset})"

    # ---- kernel ----------------------------------------------------------------------------------------------
    def param_decls(self, k: Kernel) -> list[tuple[str, str]]:
        """(C type, name) per kernel argument."""
        out = []
        for i, p in enumerate(k.params):
            if p.kind == "var":
                out.append((f"const {self.reg_type(p.dtype)}", f"a{i}"))
            else:
                c = "const " if p.kind == "in" else ""
                out.append((f"{c}{self.storage_type(p.dtype)}* {self.restrict}", f"p{i}"))
        return out

    def prelude(self, body: str) -> str:
        parts = [CUDA_PRELUDE]
        names = set(_HELPER_NAME.findall(body))
        uses16 = bool(names & {"zyx_float16_to_f32", "zyx_f32_to_float16", "zyx_round_float16"})
        usesbf = bool(names & {"zyx_bfloat16_to_f32", "zyx_f32_to_bfloat16", "zyx_round_bfloat16"})
        uses_tf32 = "zyx_f32_to_tf32" in names
        if uses16 or usesbf or uses_tf32 or names & {"zyx_f2u", "zyx_u2f"}:
            parts.append(BITS_PRELUDE)
        if "zyx_cp_async" in names:  # the cp.async mma fill (``gpu.Geometry.async_copy``)
            parts.append(ASYNC_PRELUDE)
        if "zyx_f64_to_f32_odd" in names:  # double -> float rounded to odd (a 16-bit cast rounds once)
            parts.append(F64_ODD_PRELUDE)
        if uses_tf32:
            parts.append(TF32_PRELUDE)
        if uses16:
            parts.append(FLOAT16_PRELUDE)
        if usesbf:
            parts.append(BFLOAT16_PRELUDE)
        used = sorted(names & _INT_HELPERS.keys())
        parts.extend(_INT_HELPERS[h] + "\n" for h in used)
        parts.extend(_VECTOR_HELPERS[h] for h in sorted(names & _VECTOR_HELPERS.keys()))
        return "".join(parts)

    def render(self, k: Kernel) -> CudaSource:
        parts = (k, *k.then)
        geoms = [gpu.geometry(p) for p in parts]
        bodies = []
        dynamic = 0
        for part, geom in zip(parts, geoms):
            w = _Writer(self, part, geom)
            w.kernel(linearize(part))
            bodies.append("\n".join(w.shared + w.lines))
            dynamic = max(dynamic, w.dynamic_shared)
        # segments (``then``) each get a scope: their names never meet
        body = bodies[0] if len(parts) == 1 else "\n".join("  {\n" + b + "\n  }" for b in bodies)
        geom = geoms[0]
        grid = max(g.grid for g in geoms)
        decls = self.param_decls(k)
        sig = ", ".join(f"{t} {n}" for t, n in decls)
        src = (f"{self.prelude(body)}\nextern \"C\" __global__ void __launch_bounds__({geom.block_threads}) "
               f"{k.name}({sig}) {{\n{body}\n}}\n")
        return CudaSource(k.name, src, grid, geom.block, dynamic, tuple(p.kind for p in k.params),
                          tuple(t for t, _ in decls))


class _Writer:
    """Emits the body of one kernel: the geometry's outer structure, then blocks, loops, reduces, stores."""

    def __init__(self, r: CUDARenderer, k: Kernel, geom: Geometry) -> None:
        self.r, self.k, self.g = r, k, geom
        self.lines: list[str] = []
        self.shared: list[str] = []
        self.dynamic_shared = 0  # bytes of ``extern __shared__`` memory the launch must pass
        self.name: dict[Expr, str] = {}
        self.acc: dict[Expr, str] = {}
        self.count = 0

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def emit(self, ind: str, text: str) -> None:
        self.lines.append(ind + text)

    def value(self, x: Expr) -> str:
        """A defined value, range or constant as a C operand (no narrowing context needed)."""
        if x.op is Ops.CONST:
            return self.r.literal(x.arg, x.dtype)
        return range_name(x) if x.op is Ops.RANGE else self.name[x]

    # ---- geometry frames -------------------------------------------------------------------------------------
    def kernel(self, root: Block) -> None:
        if self.g.strategy == "thread":
            self.thread_frame(root)
        elif self.g.strategy == "tile":
            self.tile_frame(root)
        elif self.g.strategy == "scatter":
            self.scatter_frame(root)
        elif self.g.strategy == "scan":
            self.scan_frame(root)
        elif self.g.strategy == "columns":
            self.columns_frame(root)
        elif self.g.strategy == "mma":
            self.mma_frame(root)
        elif self.g.strategy == "simt":
            self.simt_frame(root)
        else:
            self.group_frame(root)

    def mma_frame(self, root: Block) -> None:
        """One block of ``wm x wn`` warps per ``bm x bn`` output tile (``gpu.MmaTile``), stepping k by ``bk``: the
        block's threads fill ``zsa[S][bm][bk/2 + 4]`` (word ``[m][p]`` holds ``a(m, 2p)``, ``a(m, 2p + 1)``) and
        ``zsb[S][bn][bk/2 + 4]`` (``b(2p, n)``, ``b(2p + 1, n)``), zero outside the bounds (a row-first tile keeps
        word ``p`` of row ``i`` at column ``p ^ gpu.mma_swizzled(i >> 3, mask)``), then each warp reads its
        fragments from them in the PTX ``m16n8k16`` layout: lane ``zl`` holds A words (rows ``zr``, ``zr + 8``;
        k-pairs ``zt``, ``zt + 4``), B words (k-pairs as A's, column ``zr``) and accumulators (rows ``zr``,
        ``zr + 8``; columns ``2 zt``, ``2 zt + 1``). A float32 contraction (tf32, ``m16n8k8``) keeps one tf32 value
        per word (word ``[m][p]`` holds ``a(m, p)``, rounded by ``zyx_f32_to_tf32``), and the same word indices
        are the PTX ``m16n8k8`` tf32 fragments (A: rows ``zr``, ``zr + 8``, k ``zt``, ``zt + 4``; B: k as A's,
        column ``zr``), so the fragment loads are shared. On the device ``mma.sync`` multiplies the fragments; elsewhere
        (``__CUDA_ARCH__`` undefined or below 800) the lanes exchange the same fragment registers with
        ``__shfl_sync`` and compute the same products. Every thread reaches every ``__syncthreads`` (the loops
        over block tiles and k steps are uniform). ``S = g.stages``: with 1 a step loads into registers and
        stores them into buffer 0, barrier, mma's, barrier; with 2 the prologue fills buffer 0 and a barrier,
        then step ``zk`` (buffer ``zbf``) loads step ``zk + bk``'s registers, runs the mma's on ``zbf``, stores
        into ``zbf ^ 1`` (last read in the previous step, before its barrier) and meets its one barrier, which
        also orders this tile's last reads before the next tile's prologue. With ``g.ldmatrix`` the 16-bit
        fragments of an unswizzled (k-first) tile come from ``ldmatrix`` (``x4`` for A, ``x2`` for B), the same
        words as the word reads, exactly emulated off the GPU."""
        g, c, t = self.g, self.g.contraction, self.g.tile
        assert c is not None and t is not None
        tm, tn = t.tiles_m, t.tiles_n
        stages = g.stages
        a_k, b_k = gpu.mma_fill_order(c)
        rw = t.row_words(True, gpu.mma_pack(c.dtype))
        if g.async_copy:  # dynamic shared 16-bit elements: k-first [rows][bk + pad], row-first [bk][rows + pad]
            self.shared.append("  extern __shared__ __align__(16) unsigned short zsh[];")
            at = 0
            for arr, rows, kf in (("zsa", t.bm, a_k), ("zsb", t.bn, b_k)):
                d0, d1 = (rows, t.bk + gpu.ASYNC_PAD) if kf else (t.bk, rows + gpu.ASYNC_PAD)
                self.shared.append(f"  unsigned short (* const {arr})[{d0}][{d1}] = "
                                   f"(unsigned short (*)[{d0}][{d1}])(zsh + {at});")
                at += stages * d0 * d1
            self.dynamic_shared = t.async_shared_bytes((a_k, b_k), stages)
            assert self.dynamic_shared == 2 * at, "the ring's layout and gpu.MmaTile.async_shared_bytes disagree"
        else:
            self.shared.append(f"  __shared__ __align__(16) unsigned int zsa[{stages}][{t.bm}][{rw}];")
            self.shared.append(f"  __shared__ __align__(16) unsigned int zsb[{stages}][{t.bn}][{rw}];")
        self.emit("  ", "const int zl = threadIdx.x, zw = threadIdx.y, zr = zl >> 2, zt = zl & 3;")
        self.emit("  ", f"const int zid = zw * {gpu.WARP} + zl, zwm = zw / {t.wn}, zwn = zw % {t.wn};")
        if g.async_copy:
            self.emit("  ", "zyx_cp_queue zq;")
        ind = self.block_tiles(root, t.bm, t.bn)
        self.emit(ind, f"float zc[{tm}][{tn}][4];")
        self.emit(ind, f"for (int zi = 0; zi < {tm}; zi++) for (int zj = 0; zj < {tn}; zj++) "
                       "for (int zq = 0; zq < 4; zq++) zc[zi][zj][zq] = 0.0f;")
        if g.async_copy:
            self.mma_async_steps(ind)
        else:
            self.mma_register_steps(ind)
        self.mma_epilogue(root, ind)
        self.emit("  ", "}")

    def block_tiles(self, root: Block, bm: int, bn: int) -> str:
        """Open the grid-stride loop over the contraction's ``bm x bn`` output tiles (``zg``; batch loops
        decoded, the tile's first row ``zbm`` and column ``zbn``); the body's indent."""
        g, c = self.g, self.g.contraction
        assert c is not None and g.grid is not None
        blocks_m, blocks_n = -(-c.m.arg[1] // bm), -(-c.n.arg[1] // bn)
        batch = [lp for lp in gpu.output_loops(root) if lp.range is not c.m and lp.range is not c.n]
        it = index_type(g.items + g.grid[0])
        self.emit("  ", f"for ({it} zg = ({it})blockIdx.x; zg < {g.items}; zg += ({it})gridDim.x) {{")
        ind = "    "
        if batch:
            self.emit(ind, f"const {it} zbt = zg / {blocks_m * blocks_n};")
            self.decode(batch, "zbt", ind)
        self.emit(ind, f"const int zbm = (int)((zg / {blocks_n}) % {blocks_m}) * {bm}, "
                       f"zbn = (int)(zg % {blocks_n}) * {bn};")
        return ind

    def staged_steps(self, step: int, declare: Callable[[str], None], fill: Callable[[str, str], None],
                     store: Callable[[str, str], None], compute: Callable[[str], None], ind: str) -> None:
        """The k loop (``zk`` by ``step``) of a tiled contraction whose threads fill shared tiles through registers
        (``S = g.stages`` buffers, ``zbf`` the one computed on): ``declare(ind)`` declares the registers,
        ``fill(k, ind)`` loads step ``k``'s into them, ``store(buf, ind)`` stores them into buffer ``buf``,
        ``compute(ind)`` reads buffer ``zbf``. With 1 stage a step fills, stores, barrier, computes, barrier; with
        2 the prologue fills buffer 0 and a barrier, then step ``zk`` loads step ``zk + step``'s registers,
        computes, stores into ``zbf ^ 1`` (last read in the previous step, before its barrier) and meets its one
        barrier, which also orders this tile's last reads before the next tile's prologue."""
        size_k = self.g.contraction.k.arg[1]  # type: ignore[union-attr]
        two = self.g.stages == 2
        if two:  # prologue: step 0 into buffer 0
            self.emit(ind, "{")
            declare(ind + "  ")
            fill("0", ind + "  ")
            store("0", ind + "  ")
            self.emit(ind, "}")
            self.emit(ind, "__syncthreads();")
            self.emit(ind, f"for (int zk = 0, zbf = 0; zk < {size_k}; zk += {step}, zbf ^= 1) {{")
        else:
            self.emit(ind, f"for (int zk = 0, zbf = 0; zk < {size_k}; zk += {step}) {{")
        i2 = ind + "  "
        if two:  # the next step's global loads, in flight during this step's products
            self.emit(i2, f"const bool zpf = zk + {step} < {size_k};")
            declare(i2)
            self.emit(i2, "if (zpf) {")
            fill(f"zk + {step}", i2 + "  ")
            self.emit(i2, "}")
        else:
            declare(i2)
            fill("zk", i2)
            store("0", i2)
            self.emit(i2, "__syncthreads();")
        compute(i2)
        if two:  # the other buffer was last read in the previous step, before its barrier
            self.emit(i2, "if (zpf) {")
            store("zbf ^ 1", i2 + "  ")
            self.emit(i2, "}")
        self.emit(i2, "__syncthreads();")
        self.emit(ind, "}")

    def mma_register_steps(self, ind: str) -> None:
        """The k loop of ``mma_frame`` whose threads fill the tiles through registers (``staged_steps``)."""
        g, c, t = self.g, self.g.contraction, self.g.tile
        assert c is not None and t is not None
        size_m, size_n, size_k = c.m.arg[1], c.n.arg[1], c.k.arg[1]
        pack = gpu.mma_pack(c.dtype)
        tm, tn, kw = t.tiles_m, t.tiles_n, t.bk // pack
        wtm, wtn = t.bm // t.wm, t.bn // t.wn
        threads = t.warps * gpu.WARP
        a_k, b_k = gpu.mma_fill_order(c)
        a_v, b_v = gpu.mma_vector_fill(c)
        a_s, b_s = gpu.mma_swizzle(a_k, kw), gpu.mma_swizzle(b_k, kw)
        fill = self.fill_tile if pack == 2 else self.fill_tile_tf32
        ops = ((c.a, "zsa", "zra", c.m, "zbm", size_m, t.bm, a_k, a_v, a_s),
               (c.b, "zsb", "zrb", c.n, "zbn", size_n, t.bn, b_k, b_v, b_s))

        def fill_all(kb: str, ind: str) -> None:
            for u, _, reg, r, base, size, rows, kf, vec, _ in ops:
                fill(u, reg, r, base, size, rows, kf, vec, c.k, kb, size_k, kw, threads, ind, None)

        def store_all(buf: str, ind: str) -> None:
            for u, arr, reg, r, base, size, rows, kf, vec, swz in ops:
                fill(u, reg, r, base, size, rows, kf, vec, c.k, "", size_k, kw, threads, ind, (arr, buf, swz))

        def compute(i2: str) -> None:
            self.emit(i2, "#pragma unroll")
            self.emit(i2, f"for (int zp = 0; zp < {kw}; zp += 8) {{")
            i3 = i2 + "  "
            col = swizzled
            self.emit(i3, f"unsigned int za[{tm}][4], zb[{tn}][2];")
            self.emit(i3, "#pragma unroll")
            self.emit(i3, f"for (int zi = 0; zi < {tm}; zi++) {{")
            if g.ldmatrix and not a_s:  # lane l: row l & 15 of the 16-row tile, k-pairs zp (l < 16) or zp + 4
                self.ldmatrix("za[zi]", 4,
                              f"zsa[zbf][zwm * {wtm} + zi * {gpu.MMA_M} + (zl & 15)][zp + ((zl >> 4) << 2)]", i3 + "  ")
            else:
                self.emit(i3, f"  const int zu = zwm * {wtm} + zi * {gpu.MMA_M} + zr;")
                self.emit(i3, f"  za[zi][0] = zsa[zbf][zu][{col('zp + zt', 'zu', a_s)}]; "
                              f"za[zi][1] = zsa[zbf][zu + 8][{col('zp + zt', 'zu + 8', a_s)}];")
                self.emit(i3, f"  za[zi][2] = zsa[zbf][zu][{col('zp + zt + 4', 'zu', a_s)}]; "
                              f"za[zi][3] = zsa[zbf][zu + 8][{col('zp + zt + 4', 'zu + 8', a_s)}];")
            self.emit(i3, "}")
            self.emit(i3, "#pragma unroll")
            self.emit(i3, f"for (int zj = 0; zj < {tn}; zj++) {{")
            if g.ldmatrix and not b_s:  # lane l: column l & 7 of the 8-column tile, k-pairs zp or zp + 4
                row = f"zwn * {wtn} + zj * {gpu.MMA_N} + (zl & 7)"
                self.ldmatrix("zb[zj]", 2, f"zsb[zbf][{row}][zp + (((zl >> 3) & 1) << 2)]", i3 + "  ")
            else:
                self.emit(i3, f"  const int zv = zwn * {wtn} + zj * {gpu.MMA_N} + zr;")
                self.emit(i3, f"  zb[zj][0] = zsb[zbf][zv][{col('zp + zt', 'zv', b_s)}]; "
                              f"zb[zj][1] = zsb[zbf][zv][{col('zp + zt + 4', 'zv', b_s)}];")
            self.emit(i3, "}")
            self.mma_products(i3)
            self.emit(i2, "}")

        self.staged_steps(t.bk, lambda i: self.declare_regs(ops, pack, kw, threads, i), fill_all, store_all,
                          compute, ind)

    def mma_products(self, ind: str) -> None:
        """Every warp's ``zc[zi][zj] += za[zi] x zb[zj]`` of one k16 (k8 tf32) step."""
        c, t = self.g.contraction, self.g.tile
        assert c is not None and t is not None
        self.emit(ind, "#pragma unroll")
        self.emit(ind, f"for (int zi = 0; zi < {t.tiles_m}; zi++) {{")
        self.emit(ind, "#pragma unroll")
        self.emit(ind, f"for (int zj = 0; zj < {t.tiles_n}; zj++) {{")
        self.mma_step(c.dtype, "zc[zi][zj]", "za[zi]", "zb[zj]", ind + "  ")
        self.emit(ind, "}")
        self.emit(ind, "}")

    def mma_async_steps(self, ind: str) -> None:
        """The k loop of ``mma_frame`` with ``g.async_copy``: a ring of ``S = g.stages`` buffers filled by 16-byte
        ``cp.async`` copies (``zyx_cp_async``; a vector outside the bounds copies nothing and leaves zeros), one
        commit group per k step. The prologue issues steps ``0 .. S - 2``; step ``zk`` (buffer ``zbf``) waits until
        at most ``S - 2`` groups are pending (its own has landed), meets a barrier (every thread's copies are
        visible, and every warp is done with the buffer of step ``zk - bk``), issues step ``zk + (S - 1) bk`` into
        that buffer and runs its mma's. A k-first tile is ``[rows][bk + pad]`` (fragments by ``ldmatrix``), a
        row-first one ``[bk][rows + pad]`` (``ldmatrix.trans``): every copy is one row segment of 8 elements.
        After the last step all copies are waited for and a barrier orders the last reads before the next tile."""
        g, c, t = self.g, self.g.contraction, self.g.tile
        assert c is not None and t is not None
        S, bk, size_k = g.stages, t.bk, c.k.arg[1]
        a_k, b_k = gpu.mma_fill_order(c)
        wtm, wtn = t.bm // t.wm, t.bn // t.wn
        v = gpu.VECTOR
        ops = ((c.a, "zsa", c.m, "zbm", t.bm, a_k), (c.b, "zsb", c.n, "zbn", t.bn, b_k))

        def fill(kb: str, buf: str, ind: str) -> None:
            for u, arr, r, base, rows, kf in ops:
                per = (bk // v, rows) if kf else (rows // v, bk)
                i2, guard = self.fill_loop(per, kf, t.warps * gpu.WARP, ind)
                if kf:  # zu: row, zv: 8-element k segment
                    at = {r: (f"{base} + zu", r.arg[1]), c.k: (f"{kb} + {v} * zv", size_k)}
                    dst = f"&{arr}[{buf}][zu][{v} * zv]"
                else:  # zu: 8-row segment, zv: k
                    at = {r: (f"{base} + {v} * zu", r.arg[1]), c.k: (f"{kb} + zv", size_k)}
                    dst = f"&{arr}[{buf}][zv][{v} * zu]"
                self.async_copy(u, at, dst, i2)
                self.close_loop(guard, ind)

        def issue(kb: str, buf: str, ind: str) -> None:
            """Copy k step ``kb`` into buffer ``buf`` when it exists, then commit a group (always one per step,
            so the wait counts stay uniform)."""
            self.emit(ind, f"if ({kb} < {size_k}) {{")
            fill(kb, buf, ind + "  ")
            self.emit(ind, "}")
            self.emit(ind, "zyx_cp_commit(zq);")

        self.emit(ind, "#pragma unroll")
        self.emit(ind, f"for (int zs = 0; zs < {S - 1}; zs++) {{")
        issue(f"zs * {bk}", "zs", ind + "  ")
        self.emit(ind, "}")
        self.emit(ind, f"for (int zk = 0, zbf = 0; zk < {size_k}; zk += {bk}, zbf = zbf == {S - 1} ? 0 : zbf + 1) {{")
        i2 = ind + "  "
        self.emit(i2, f"zyx_cp_wait(zq, {S - 2});")
        self.emit(i2, "__syncthreads();")
        issue(f"zk + {(S - 1) * bk}", f"(zbf == 0 ? {S - 1} : zbf - 1)", i2)
        self.emit(i2, "#pragma unroll")
        self.emit(i2, f"for (int zp = 0; zp < {bk}; zp += {gpu.MMA_K}) {{")
        i3 = i2 + "  "
        self.emit(i3, f"unsigned int za[{t.tiles_m}][4], zb[{t.tiles_n}][2];")
        self.emit(i3, "#pragma unroll")
        self.emit(i3, f"for (int zi = 0; zi < {t.tiles_m}; zi++) {{")
        if a_k:  # lanes 0-15: rows 0-15 at k zp, lanes 16-31: at k zp + 8 (matrices a0a1, a2a3, a4a5, a6a7)
            self.ldmatrix("za[zi]", 4, f"zsa[zbf][zwm * {wtm} + zi * {gpu.MMA_M} + (zl & 15)][zp + ((zl >> 4) << 3)]",
                          i3 + "  ")
        else:  # lane 8q + j: k row zp + j (+ 8 for q >= 2), columns m (+ 8 for odd q)
            self.ldmatrix("za[zi]", 4, f"zsa[zbf][zp + (zl & 7) + ((zl >> 4) << 3)]"
                                       f"[zwm * {wtm} + zi * {gpu.MMA_M} + (((zl >> 3) & 1) << 3)]", i3 + "  ", True)
        self.emit(i3, "}")
        self.emit(i3, "#pragma unroll")
        self.emit(i3, f"for (int zj = 0; zj < {t.tiles_n}; zj++) {{")
        if b_k:  # lanes 0-7: columns n at k zp, lanes 8-15: at k zp + 8
            self.ldmatrix("zb[zj]", 2, f"zsb[zbf][zwn * {wtn} + zj * {gpu.MMA_N} + (zl & 7)]"
                                       "[zp + (((zl >> 3) & 1) << 3)]", i3 + "  ")
        else:  # lane j < 16: k row zp + j, the tile's 8 columns
            self.ldmatrix("zb[zj]", 2, f"zsb[zbf][zp + (zl & 15)][zwn * {wtn} + zj * {gpu.MMA_N}]", i3 + "  ", True)
        self.emit(i3, "}")
        self.mma_products(i3)
        self.emit(i2, "}")
        self.emit(ind, "}")
        self.emit(ind, "zyx_cp_wait(zq, 0);")
        self.emit(ind, "__syncthreads();")

    def mma_epilogue(self, root: Block, ind: str) -> None:
        """Per accumulator element inside the bounds: the output block's statements and stores."""
        t = self.g.tile
        assert t is not None
        wtm, wtn = t.bm // t.wm, t.bn // t.wn
        self.emit(ind, f"for (int zi = 0; zi < {t.tiles_m}; zi++) for (int zj = 0; zj < {t.tiles_n}; zj++) "
                       "for (int zq = 0; zq < 4; zq++) {")
        self.emit(ind + "  ", f"const int zm = zbm + zwm * {wtm} + zi * {gpu.MMA_M} + zr + 8 * (zq >> 1), "
                              f"zn = zbn + zwn * {wtn} + zj * {gpu.MMA_N} + zt * 2 + (zq & 1);")
        self.contraction_outputs(root, "zc[zi][zj][zq]", ind + "  ")
        self.emit(ind, "}")

    def contraction_outputs(self, root: Block, value: str, ind: str) -> None:
        """With the output row ``zm`` and column ``zn`` defined and the contraction's value spelled ``value``:
        when inside the bounds, the output block's statements and stores."""
        c = self.g.contraction
        assert c is not None
        self.emit(ind, f"if (zm < {c.m.arg[1]} && zn < {c.n.arg[1]}) {{")
        i2 = ind + "  "
        blocks = gpu.output_blocks(root)
        saved = dict(self.name)
        self.emit(i2, f"const int {range_name(c.m)} = zm, {range_name(c.n)} = zn;")
        self.name[c.reduce] = value
        for blk in blocks:
            for st in blk.stmts:
                if not isinstance(st, Reduce):
                    self.define(st, i2)
        for blk in reversed(blocks):
            self.tail(blk, i2)
        self.name = saved
        self.emit(ind, "}")

    def simt_frame(self, root: Block) -> None:
        """One block of ``bm/tm x bn/tn`` threads per ``bm x bn`` output tile (``gpu.SimtTile``), stepping k by
        ``bk`` (``staged_steps``): the threads evaluate ``a`` into ``zsa[S][bk][bm + pad]`` and ``b`` into
        ``zsb[S][bk][bn + pad]`` (zero outside the bounds; adjacent threads along the operand's contiguous axis,
        ``gpu.mma_fill_order``; 16-byte loads where ``gpu.mma_vector_fill``), then thread ``(zty, ztx)`` reads
        ``a`` at its rows and ``b`` at its columns per k (``simt_offset``: runs of up to 16 bytes, one vector read
        each, ``simt_runs``) and updates accumulator ``zc[zi][zj]`` as the serial reduce would
        (``accumulate``: ``fma`` for floats, wrapping integers). With ``wide_acc`` the updates go to float32
        partials ``zp`` that are added into the float64 ``zc`` every ``gpu.SIMT_PARTIAL`` k and at the end."""
        g, c, t = self.g, self.g.contraction, self.g.simt
        assert c is not None and t is not None
        size_k = c.k.arg[1]
        ty = self.r.reg_type(c.dtype)
        pad, stages = gpu.simt_pad(c.dtype.itemsize), g.stages
        vm, vn = t.vector(c.dtype.itemsize)
        at = self.r.acc_type(c.reduce, self.k)
        wide = at != ty
        self.shared.append(f"  __shared__ __align__(16) {ty} zsa[{stages}][{t.bk}][{t.bm + pad}];")
        self.shared.append(f"  __shared__ __align__(16) {ty} zsb[{stages}][{t.bk}][{t.bn + pad}];")
        self.emit("  ", f"const int zid = threadIdx.x, zty = zid / {t.threads_n}, ztx = zid % {t.threads_n};")
        ind = self.block_tiles(root, t.bm, t.bn)
        ident = self.r.identity(Ops.ADD, c.reduce, at)
        self.emit(ind, f"{at} zc[{t.tm}][{t.tn}];")
        self.emit(ind, f"for (int zi = 0; zi < {t.tm}; zi++) for (int zj = 0; zj < {t.tn}; zj++) zc[zi][zj] = {ident};")
        if wide:
            self.emit(ind, f"{ty} zp[{t.tm}][{t.tn}];")
            self.emit(ind, f"for (int zi = 0; zi < {t.tm}; zi++) for (int zj = 0; zj < {t.tn}; zj++) "
                           "zp[zi][zj] = 0.0f;")
        a_k, b_k = gpu.mma_fill_order(c)
        a_v, b_v = gpu.mma_vector_fill(c)
        v = gpu.mma_vector(c.dtype)
        vt, fields = vector_type(c.dtype, v * c.dtype.itemsize)
        ops = ((c.a, "zsa", "zra", c.m, "zbm", t.bm, a_k, a_v), (c.b, "zsb", "zrb", c.n, "zbn", t.bn, b_k, b_v))

        def items(rows: int, kf: bool, vec: bool) -> tuple[int, int]:  # (fast, slow) fill items, as fill_loop takes
            w = v if vec else 1
            return (t.bk // w, rows) if kf else (rows // w, t.bk)

        def declare(ind: str) -> None:
            for _, _, reg, _, _, rows, kf, vec in ops:
                fast, slow = items(rows, kf, vec)
                self.emit(ind, f"{vt if vec else ty} {reg}[{-(-fast * slow // t.threads)}];")

        def fill(kb: str, ind: str) -> None:
            zero = self.r.literal(0, c.dtype)
            for u, _, reg, r, base, rows, kf, vec in ops:
                i2, guard = self.fill_loop(items(rows, kf, vec), kf, t.threads, ind)
                if vec:  # v adjacent elements along the fast axis, in or out of bounds as a whole
                    where = ({r: (f"{base} + zu", r.arg[1]), c.k: (f"{kb} + {v} * zv", size_k)} if kf
                             else {r: (f"{base} + {v} * zu", r.arg[1]), c.k: (f"{kb} + zv", size_k)})
                    self.emit(i2, f"{reg}[zf] = {vt}{{}};")
                    self.vector_access(u, where, lambda src, inb, reg=reg: f"if ({inb}) {reg}[zf] = "
                                       f"zyx_vld_{_vector_suffix(vt)}({src});", i2)
                else:
                    where = {r: (f"{base} + zu", r.arg[1]), c.k: (f"{kb} + zv", size_k)}
                    self.at_ranges(where, [u], lambda inb, reg=reg, u=u: f"{reg}[zf] = ({inb}) ? {self.value(u)} : "
                                   f"{zero};", i2)
                self.close_loop(guard, ind)

        def store(buf: str, ind: str) -> None:
            for _, arr, reg, _, _, rows, kf, vec in ops:
                i2, guard = self.fill_loop(items(rows, kf, vec), kf, t.threads, ind)
                if vec and kf:  # v consecutive k of row zu
                    self.emit(i2, " ".join(f"{arr}[{buf}][{v} * zv + {j}][zu] = {reg}[zf].{f};"
                                           for j, f in enumerate(fields)))
                elif vec:  # v consecutive rows at k zv: one vector store
                    self.emit(i2, f"zyx_vst_{_vector_suffix(vt)}(&{arr}[{buf}][zv][{v} * zu], {reg}[zf]);")
                else:
                    self.emit(i2, f"{arr}[{buf}][zv][zu] = {reg}[zf];")
                self.close_loop(guard, ind)

        def compute(i2: str) -> None:
            acc = "zp[zi][zj]" if wide else "zc[zi][zj]"
            names = {c.a: "za[zi]", c.b: "zb[zj]"}

            def spell(x: Expr) -> str:  # the operands by register, the product (integers) as an expression
                return names[x] if x in names else self.r.expr(x, names, self.k.params)

            self.emit(i2, "#pragma unroll")
            self.emit(i2, f"for (int zkk = 0; zkk < {t.bk}; zkk++) {{")
            i3 = i2 + "  "
            self.emit(i3, f"{ty} za[{t.tm}], zb[{t.tn}];")
            self.simt_runs("za", "zsa", "zty", t.tm, vm, t.threads_m, c.dtype, i3)
            self.simt_runs("zb", "zsb", "ztx", t.tn, vn, t.threads_n, c.dtype, i3)
            self.emit(i3, "#pragma unroll")
            self.emit(i3, f"for (int zi = 0; zi < {t.tm}; zi++)")
            self.emit(i3, "#pragma unroll")
            self.emit(i3, f"for (int zj = 0; zj < {t.tn}; zj++) "
                          f"{self.r.accumulate(c.reduce, acc, ty if wide else at, spell)}")
            self.emit(i2, "}")
            if wide:  # fold the float32 partials into the float64 sums every SIMT_PARTIAL k and after the last
                self.emit(i2, f"if ((zk + {t.bk}) % {gpu.SIMT_PARTIAL} == 0 || zk + {t.bk} >= {size_k}) {{")
                self.emit(i2 + "  ", f"for (int zi = 0; zi < {t.tm}; zi++) for (int zj = 0; zj < {t.tn}; zj++) "
                                     "{ zc[zi][zj] += (double)zp[zi][zj]; zp[zi][zj] = 0.0f; }")
                self.emit(i2, "}")

        self.staged_steps(t.bk, declare, fill, store, compute, ind)
        rt = self.r.reg_type(c.reduce.dtype)
        self.emit(ind, "#pragma unroll")
        self.emit(ind, f"for (int zi = 0; zi < {t.tm}; zi++)")
        self.emit(ind, "#pragma unroll")
        self.emit(ind, f"for (int zj = 0; zj < {t.tn}; zj++) {{")
        self.emit(ind + "  ", f"const int zm = zbm + {simt_offset('zi', 'zty', vm, t.threads_m)}, "
                              f"zn = zbn + {simt_offset('zj', 'ztx', vn, t.threads_n)};")
        self.contraction_outputs(root, f"(({rt})zc[zi][zj])" if wide else "zc[zi][zj]", ind + "  ")
        self.emit(ind, "}")
        self.emit("  ", "}")

    def simt_runs(self, regs: str, arr: str, thread: str, count: int, v: int, threads: int, d: DType,
                  ind: str) -> None:
        """``regs[0..count)`` = the thread's elements of row ``zkk`` of shared tile ``arr`` (``gpu.SimtTile``): runs
        of ``v`` read as one vector each (``zyx_vld``: checked aligned under emulation), or one by one."""
        if v == 1:
            self.emit(ind, f"for (int zi = 0; zi < {count}; zi++) {regs}[zi] = "
                           f"{arr}[zbf][zkk][{simt_offset('zi', thread, 1, threads)}];")
            return
        vt, fields = vector_type(d, v * d.itemsize)
        for run in range(count // v):
            x = f"{regs}_v{run}"
            self.emit(ind, f"const {vt} {x} = zyx_vld_{_vector_suffix(vt)}(&{arr}[zbf][zkk][{run * threads * v} + "
                           f"{thread} * {v}]);")
            self.emit(ind, " ".join(f"{regs}[{run * v + i}] = {x}.{f};" for i, f in enumerate(fields)))

    @staticmethod
    def fill_shape(pack: int, k_first: bool, vector: bool, rows: int, kw: int) -> tuple[tuple[int, int], str]:
        """``(per, reg)`` of one operand's tile fill: ``per[0] x per[1]`` work items (``per[0]`` the fast one)
        and the C type of the registers one item stages (``[2]``: two uint4 per item)."""
        if not vector:
            return ((kw, rows) if k_first else (rows, kw)), "unsigned int"
        v = gpu.VECTOR if pack == 2 else gpu.mma_vector(dtypes.float32)
        w = v // 2 if pack == 2 else v
        per = (kw // w, rows) if k_first else (rows // v, kw)
        return per, ("uint4" if k_first or pack == 1 else "uint4[2]")

    def declare_regs(self, ops: tuple, pack: int, kw: int, threads: int, ind: str) -> None:
        """Declare each operand's staging registers (``fill_shape``): one item per fill trip; a trip past the
        tile's items neither loads nor stores its registers."""
        for _, _, reg, _, _, _, rows, kf, vec, _ in ops:
            per, ty = self.fill_shape(pack, kf, vec, rows, kw)
            trips = -(-(per[0] * per[1]) // threads)
            base, dims = (ty[:-3], f"[{trips}][2]") if ty.endswith("[2]") else (ty, f"[{trips}]")
            self.emit(ind, f"{base} {reg}{dims};")

    def fill_loop(self, per: tuple[int, int], k_first: bool, threads: int, ind: str) -> tuple[str, bool]:
        """Open the unrolled loop over a fill's trips (``zf``; item ``zo``, row ``zu`` and k item ``zv``); the body
        indent and whether a bound check was opened."""
        total = per[0] * per[1]
        trips = -(-total // threads)
        self.emit(ind, "#pragma unroll")
        self.emit(ind, f"for (int zf = 0; zf < {trips}; zf++) {{")
        i2 = ind + "  "
        self.emit(i2, f"const int zo = zid + zf * {threads};")
        guard = bool(total % threads)
        if guard:
            self.emit(i2, f"if (zo < {total}) {{")
            i2 += "  "
        if k_first:  # zu: row, zv: k item
            self.emit(i2, f"const int zu = zo / {per[0]}, zv = zo % {per[0]};")
        else:  # zu: row (or row octet / quad), zv: k item
            self.emit(i2, f"const int zu = zo % {per[0]}, zv = zo / {per[0]};")
        return i2, guard

    def close_loop(self, guard: bool, ind: str) -> None:
        if guard:
            self.emit(ind + "  ", "}")
        self.emit(ind, "}")

    @staticmethod
    def word(to: tuple[str, str, int], row: str, w: str) -> str:
        """The shared word ``arr[buf][row][w]`` of ``to = (arr, buf, swizzle mask)`` (``gpu.mma_swizzle``)."""
        arr, buf, swz = to
        return f"{arr}[{buf}][{row}][{swizzled(w, row, swz)}]"

    def fill_tile(self, u: Expr, reg: str, r: Expr, base: str, size: int, rows: int, k_first: bool, vector: bool,
                  kr: Expr, kb: str, size_k: int, kw: int, threads: int, ind: str,
                  to: tuple[str, str, int] | None) -> None:
        """One half of filling the shared tile ``arr[buf][rows][kw + pad]`` from the step at k ``kb``: with ``to``
        None, load into the registers ``reg`` (one item per trip); with ``to = (arr, buf, swizzle)``, store them.
        Word ``[i][p]`` = ``u`` at (``r = base + i``, ``k = kb + 2p``) in its low half and ``k + 1`` in its high
        half (zero outside the bounds). Adjacent threads take adjacent k-pairs (``k_first``) or adjacent rows.
        With ``vector`` (``gpu.mma_vector_fill``) a thread reads 8 adjacent elements along that axis with one
        16-byte load: 4 words of a row (``k_first``), or 8 rows at ``k`` and at ``k + 1``, interleaved into one
        word per row."""
        v = gpu.VECTOR
        per, _ = self.fill_shape(2, k_first, vector, rows, kw)
        i2, guard = self.fill_loop(per, k_first, threads, ind)
        x = f"{reg}[zf]"
        if to is not None:
            if not vector:
                self.emit(i2, f"{self.word(to, 'zu', 'zv')} = {x};")
            elif k_first:
                self.emit(i2, f"*(uint4*)&{self.word(to, 'zu', f'{v // 2} * zv')} = {x};")
            else:
                for j, f in enumerate("xyzw"):
                    lo, hi = f"{x}[0].{f}", f"{x}[1].{f}"
                    self.emit(i2, f"{self.word(to, f'{v} * zu + {2 * j}', 'zv')} = ({lo} & 0xffffu) | ({hi} << 16); "
                                  f"{self.word(to, f'{v} * zu + {2 * j + 1}', 'zv')} = "
                                  f"({lo} >> 16) | ({hi} & 0xffff0000u);")
        elif not vector:
            self.emit(i2, f"{x} = 0u;")
            for h in range(2):
                self.fragment_bits(u, {r: (f"{base} + zu", size), kr: (f"{kb} + 2 * zv + {h}", size_k)}, x,
                                   16 * h, i2)
        elif k_first:
            self.emit(i2, f"{x} = make_uint4(0u, 0u, 0u, 0u);")
            self.vector_load(u, {r: (f"{base} + zu", size), kr: (f"{kb} + {v} * zv", size_k)}, x, i2)
        else:
            for h in range(2):
                self.emit(i2, f"{x}[{h}] = make_uint4(0u, 0u, 0u, 0u);")
                self.vector_load(u, {r: (f"{base} + {v} * zu", size), kr: (f"{kb} + 2 * zv + {h}", size_k)},
                                 f"{x}[{h}]", i2)
        self.close_loop(guard, ind)

    def fill_tile_tf32(self, u: Expr, reg: str, r: Expr, base: str, size: int, rows: int, k_first: bool,
                       vector: bool, kr: Expr, kb: str, size_k: int, kw: int, threads: int, ind: str,
                       to: tuple[str, str, int] | None) -> None:
        """``fill_tile`` for float32 operands: word ``[i][p]`` = ``u`` at (``r = base + i``, ``k = kb + p``)
        rounded to tf32 (zero outside the bounds; rounded when loaded). With ``vector`` a thread reads 4 adjacent
        floats along its fast axis with one 16-byte load: 4 words of a row (``k_first``), or one word of 4 rows."""
        v = gpu.mma_vector(dtypes.float32)
        per, _ = self.fill_shape(1, k_first, vector, rows, kw)
        i2, guard = self.fill_loop(per, k_first, threads, ind)
        x = f"{reg}[zf]"
        if to is not None:
            if not vector:
                self.emit(i2, f"{self.word(to, 'zu', 'zv')} = {x};")
            elif k_first:
                self.emit(i2, f"*(uint4*)&{self.word(to, 'zu', f'{v} * zv')} = {x};")
            else:
                self.emit(i2, " ".join(f"{self.word(to, f'{v} * zu + {j}', 'zv')} = {x}.{f};"
                                       for j, f in enumerate("xyzw")))
        elif not vector:
            self.emit(i2, f"{x} = 0u;")
            self.fragment_bits(u, {r: (f"{base} + zu", size), kr: (f"{kb} + zv", size_k)}, x, 0, i2)
        else:
            self.emit(i2, f"{x} = make_uint4(0u, 0u, 0u, 0u);")
            at = ({r: (f"{base} + zu", size), kr: (f"{kb} + {v} * zv", size_k)} if k_first
                  else {r: (f"{base} + {v} * zu", size), kr: (f"{kb} + zv", size_k)})
            self.vector_load(u, at, x, i2)
            for f in "xyzw":
                self.emit(i2, f"{x}.{f} = zyx_f32_to_tf32(zyx_u2f({x}.{f}));")
        self.close_loop(guard, ind)

    def vector_load(self, u: Expr, at: dict[Expr, tuple[str, int]], reg: str, ind: str) -> None:
        """``reg = `` the 16 bytes of the plain load ``u``'s buffer from its index at the range values ``at``
        (C expression, size per range; left as is when one is out of bounds)."""
        self.vector_access(u, at, lambda src, inb: f"if ({inb}) {reg} = *(const uint4*){src};", ind)

    def async_copy(self, u: Expr, at: dict[Expr, tuple[str, int]], dst: str, ind: str) -> None:
        """``zyx_cp_async`` of the 16 bytes of the plain load ``u`` at the range values ``at`` to ``dst``: a copy
        of nothing (zeros) when one is out of bounds, from a clamped address."""
        self.vector_access(u, at, lambda src, inb: f"zyx_cp_async(zq, {dst}, {src}, {inb});", ind)

    def vector_access(self, u: Expr, at: dict[Expr, tuple[str, int]], stmt: Callable[[str, str], str],
                      ind: str) -> None:
        """``stmt(address, in-bounds condition)`` for the plain load ``u`` at the range values ``at``
        (``at_ranges``)."""
        self.at_ranges(at, [u.srcs[0]], lambda inb: stmt(f"(p{u.arg} + {self.value(u.srcs[0])})", inb), ind)

    def at_ranges(self, at: dict[Expr, tuple[str, int]], roots: list[Expr], stmt: Callable[[str], str],
                  ind: str) -> None:
        """A scope defining the ranges of ``at`` (C expression, size per range) clamped into the bounds (so every
        load stays inside its buffer) and the values of ``roots``, then the line ``stmt(in-bounds condition)``
        (called while those names are defined; they are forgotten after the scope)."""
        self.emit(ind, "{")
        i2 = ind + "  "
        inb = " && ".join(f"({x}) < {n}" for x, n in at.values())
        for rr, (x, n) in at.items():
            self.emit(i2, f"const int {range_name(rr)} = ({x}) < {n} ? ({x}) : {n - 1};")
        saved = dict(self.name)
        for e in ir.toposort(roots):
            if e.op not in (Ops.CONST, Ops.RANGE):
                self.define(e, i2)
        self.emit(i2, stmt(inb))
        self.name = saved
        self.emit(ind, "}")

    def ldmatrix(self, regs: str, count: int, word: str, ind: str, trans: bool = False) -> None:
        """``regs[0..count)`` = ``ldmatrix.sync.aligned.m8n8.x{count}.shared.b16`` of the 8x8 matrices of 16-bit
        elements whose rows start at ``&word`` (lane ``8q + j`` gives row ``j`` of matrix ``q``): lane ``l``
        receives elements ``2 (l & 3)`` and ``2 (l & 3) + 1`` of row ``l >> 2`` of matrix ``q`` in ``regs[q]``;
        with ``trans`` (``.trans``) element ``l >> 2`` of rows ``2 (l & 3)`` and ``2 (l & 3) + 1`` (low half
        first). Off the GPU (or below sm_80) the same: each lane takes the row addresses of those lanes by
        ``__shfl_sync`` and reads the elements."""
        outs = ", ".join(f"%{q}" for q in range(count))
        dsts = ", ".join(f'"=r"({regs}[{q}])' for q in range(count))
        if trans:
            emulated = [
                f"{ind}  for (int zq = 0; zq < {count}; zq++) {{",
                f"{ind}    const unsigned short* zlo = (const unsigned short*)__shfl_sync({FULL_MASK}, zad, "
                "zq * 8 + 2 * zt);",
                f"{ind}    const unsigned short* zhi = (const unsigned short*)__shfl_sync({FULL_MASK}, zad, "
                "zq * 8 + 2 * zt + 1);",
                f"{ind}    {regs}[zq] = (unsigned int)zlo[zr] | ((unsigned int)zhi[zr] << 16);",
                f"{ind}  }}",
            ]
        else:
            emulated = [
                f"{ind}  for (int zq = 0; zq < {count}; zq++)",
                f"{ind}    {regs}[zq] = ((const unsigned int*)__shfl_sync({FULL_MASK}, zad, zq * 8 + zr))[zt];",
            ]
        self.lines.extend([
            "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800",
            f"{ind}{{",
            f"{ind}  const unsigned int zad = (unsigned int)__cvta_generic_to_shared(&{word});",
            f'{ind}  asm volatile("ldmatrix.sync.aligned.m8n8.x{count}{".trans" if trans else ""}.shared.b16 '
            f'{{{outs}}}, [%{count}];"',
            f'{ind}      : {dsts} : "r"(zad) : "memory");',
            f"{ind}}}",
            "#else",
            f"{ind}{{",
            f"{ind}  const unsigned long long zad = (unsigned long long)&{word};",
            *emulated,
            f"{ind}}}",
            "#endif",
        ])

    def mma_step(self, dtype: DType, acc: str, a: str, b: str, ind: str) -> None:
        """``acc[0..3] += a-fragment x b-fragment`` for one ``m16n8k16`` tile (``m16n8k8`` tf32 for float32):
        ``mma.sync`` on sm_80+, else the same products from the fragment registers exchanged by ``__shfl_sync``
        (uniform across the warp), accumulated by ``fmaf`` in k order."""
        if dtype is dtypes.float32:
            self.mma_step_tf32(acc, a, b, ind)
            return
        ty = "f16" if dtype is dtypes.float16 else "bf16"
        cvt = f"zyx_{dtype.name}_to_f32"
        self.lines.extend([
            "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800",
            f'{ind}asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{%0, %1, %2, %3}}, '
            '{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"',
            f'{ind}    : "+f"({acc}[0]), "+f"({acc}[1]), "+f"({acc}[2]), "+f"({acc}[3])',
            f'{ind}    : "r"({a}[0]), "r"({a}[1]), "r"({a}[2]), "r"({a}[3]), "r"({b}[0]), "r"({b}[1]));',
            "#else",
            f"{ind}for (int zq = 0; zq < 16; zq++) {{",
            f"{ind}  const int zh = zq >> 3, zs = (zq & 7) >> 1, zsh = (zq & 1) * 16;",
            f"{ind}  const unsigned int zal = __shfl_sync({FULL_MASK}, {a}[2 * zh], zr * 4 + zs);",
            f"{ind}  const unsigned int zah = __shfl_sync({FULL_MASK}, {a}[2 * zh + 1], zr * 4 + zs);",
            f"{ind}  const unsigned int zb0 = __shfl_sync({FULL_MASK}, {b}[zh], zt * 8 + zs);",
            f"{ind}  const unsigned int zb1 = __shfl_sync({FULL_MASK}, {b}[zh], zt * 8 + 4 + zs);",
            f"{ind}  const float zx0 = {cvt}((unsigned short)(zal >> zsh)), zx1 = {cvt}((unsigned short)(zah >> zsh));",
            f"{ind}  const float zy0 = {cvt}((unsigned short)(zb0 >> zsh)), zy1 = {cvt}((unsigned short)(zb1 >> zsh));",
            f"{ind}  {acc}[0] = fmaf(zx0, zy0, {acc}[0]); {acc}[1] = fmaf(zx0, zy1, {acc}[1]);",
            f"{ind}  {acc}[2] = fmaf(zx1, zy0, {acc}[2]); {acc}[3] = fmaf(zx1, zy1, {acc}[3]);",
            f"{ind}}}",
            "#endif",
        ])

    def mma_step_tf32(self, acc: str, a: str, b: str, ind: str) -> None:
        """``acc[0..3] += a x b`` for one ``m16n8k8`` tile of tf32 words (one element per register: A ``a[0..3]``
        rows ``zr``, ``zr + 8`` / k ``zt``, ``zt + 4``; B ``b[0..1]`` k ``zt``, ``zt + 4``, column ``zr``). Off
        the GPU each product of two tf32 values is exact in float32, so ``fmaf`` in k order gives what the tensor
        core's float32 accumulation gives up to the order within one mma."""
        self.lines.extend([
            "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800",
            f'{ind}asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {{%0, %1, %2, %3}}, '
            '{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"',
            f'{ind}    : "+f"({acc}[0]), "+f"({acc}[1]), "+f"({acc}[2]), "+f"({acc}[3])',
            f'{ind}    : "r"({a}[0]), "r"({a}[1]), "r"({a}[2]), "r"({a}[3]), "r"({b}[0]), "r"({b}[1]));',
            "#else",
            f"{ind}for (int zq = 0; zq < 8; zq++) {{",
            f"{ind}  const int zh = zq >> 2, zs = zq & 3;",
            f"{ind}  const float zx0 = zyx_u2f(__shfl_sync({FULL_MASK}, {a}[2 * zh], zr * 4 + zs));",
            f"{ind}  const float zx1 = zyx_u2f(__shfl_sync({FULL_MASK}, {a}[2 * zh + 1], zr * 4 + zs));",
            f"{ind}  const float zy0 = zyx_u2f(__shfl_sync({FULL_MASK}, {b}[zh], zt * 8 + zs));",
            f"{ind}  const float zy1 = zyx_u2f(__shfl_sync({FULL_MASK}, {b}[zh], zt * 8 + 4 + zs));",
            f"{ind}  {acc}[0] = fmaf(zx0, zy0, {acc}[0]); {acc}[1] = fmaf(zx0, zy1, {acc}[1]);",
            f"{ind}  {acc}[2] = fmaf(zx1, zy0, {acc}[2]); {acc}[3] = fmaf(zx1, zy1, {acc}[3]);",
            f"{ind}}}",
            "#endif",
        ])

    def fragment_bits(self, u: Expr, at: dict[Expr, tuple[str, int]], reg: str, shift: int, ind: str) -> None:
        """OR the 16-bit pattern of ``u`` at the range values ``at`` (C expression, size per range; zero when one
        is out of bounds) into ``reg`` at bit ``shift``. A plain load reads its stored bits; a float32 ``u`` gives
        its 32 tf32 bits (``zyx_f32_to_tf32``)."""
        plain = u.op is Ops.LOAD and len(u.srcs) == 1

        def stmt(inb: str) -> str:
            if u.dtype is dtypes.float32:  # a tf32 operand: its value rounded to tf32
                bits = f"zyx_f32_to_tf32({f'p{u.arg}[{self.value(u.srcs[0])}]' if plain else self.name[u]})"
            elif plain:
                bits = f"p{u.arg}[{self.value(u.srcs[0])}]"
            else:
                bits = f"zyx_f32_to_{u.dtype.name}({self.name[u]})"
            return f"if ({inb}) {reg} |= (unsigned int)({bits}) << {shift};"

        self.at_ranges(at, [u.srcs[0]] if plain else [u], stmt, ind)

    def columns_frame(self, root: Block) -> None:
        """``threadIdx.x`` along the flattened outputs, ``threadIdx.y`` splitting the reduces (see ``gpu``). The
        grid-stride loop steps whole blocks so that every thread reaches each ``__syncthreads``; a lane past the
        last output computes the last one again (its loads stay in bounds) and stores nothing."""
        g = self.g
        blocks, loops = gpu.output_blocks(root), gpu.output_loops(root)
        tx, ty = g.groups_per_block, g.group_threads
        it = index_type(g.items + g.grid[0] * tx)
        self.emit("  ", "const int zx = threadIdx.x, zy = threadIdx.y;")
        self.emit("  ", f"for ({it} zb = ({it})blockIdx.x * {tx}; zb < {g.items}; zb += ({it})gridDim.x * {tx}) {{")
        ind = "    "
        self.emit(ind, f"const {it} zo = zb + zx;")
        self.emit(ind, f"const {it} zg = zo < {g.items} ? zo : {g.items - 1};")
        self.decode(loops, "zg", ind)
        for d, blk in enumerate(blocks):
            self.stmts(blk, ind, coop=d == len(loops))
        cond = f"zo < {g.items}" + (" && zy == 0" if ty > 1 else "")
        self.emit(ind, f"if ({cond}) {{")
        for blk in reversed(blocks):
            self.tail(blk, ind + "  ")
        self.emit(ind, "}")
        self.emit("  ", "}")

    def thread_frame(self, root: Block) -> None:
        """One thread per iteration of output loops [0, split) (grid-stride); deeper loops (a scan's) run
        serially in the thread."""
        g = self.g
        if g.vector > 1:
            self.vector_thread_frame(root)
            return
        blocks, loops = gpu.output_blocks(root), gpu.output_loops(root)
        s = g.split
        b = g.block_threads
        it = index_type(g.items + g.grid[0] * b)
        self.emit("  ", f"for ({it} zi = ({it})blockIdx.x * {b} + threadIdx.x; zi < {g.items}; "
                        f"zi += ({it})gridDim.x * {b}) {{")
        ind = "    "
        self.decode(loops[:s], "zi", ind)
        for blk in blocks[:s + 1]:
            self.stmts(blk, ind)
        if s < len(loops):
            self.serial_loop(loops[s], ind)
        for blk in reversed(blocks[:s + 1]):
            self.tail(blk, ind)
        self.emit("  ", "}")

    def tile_frame(self, root: Block) -> None:
        """One ``TILE x TILE`` tile of the last two loops ``(i, j)`` per block and grid-stride step (see ``gpu``):
        thread ``(zx, zy)`` first reads each staged load at ``(i0 + zx, j0 + zy + 8q)`` into ``zt[zy + 8q][zx]``,
        then computes output ``(i0 + zy + 8q, j0 + zx)`` reading ``zt[zx][zy + 8q]``. Statements of the outer
        loops run once per tile, those of ``i`` and ``j`` per output."""
        g, r, params = self.g, self.r, self.k.params
        blocks, loops = gpu.output_blocks(root), gpu.output_loops(root)
        n = len(loops)
        ri, rj = loops[-2].range, loops[-1].range
        si, sj = ri.arg[1], rj.arg[1]
        edge, rows = gpu.TILE, gpu.TILE_ROWS
        ti, tj = -(-si // edge), -(-sj // edge)
        tiles: dict[Expr, str] = {}
        for m, ld in enumerate(g.staged):
            tiles[ld] = f"zt{m}"
            self.shared.append(f"  __shared__ {r.storage_type(params[ld.arg].dtype)} zt{m}[{edge}][{edge + 1}];")
        it = index_type(g.items + g.grid[0])
        ii, ij = index_type(si + edge), index_type(sj + edge)
        self.emit("  ", "const int zx = threadIdx.x, zy = threadIdx.y;")
        self.emit("  ", f"for ({it} zb = ({it})blockIdx.x; zb < {g.items}; zb += ({it})gridDim.x) {{")
        ind = "    "
        if n > 2:
            self.emit(ind, f"const {it} zq = zb / {ti * tj};")
            self.decode(loops[:-2], "zq", ind)
        self.emit(ind, f"const {ii} zi0 = ({ii})((zb % {ti * tj}) / {tj}) * {edge};")
        self.emit(ind, f"const {ij} zj0 = ({ij})(zb % {tj}) * {edge};")
        for blk in blocks[:n - 1]:
            self.stmts(blk, ind)
        i2, i3 = ind + "  ", ind + "    "
        # phase 1: lanes along i (each staged load is contiguous there)
        self.emit(ind, f"for (int zr = 0; zr < {edge}; zr += {rows}) {{")
        self.emit(i2, f"const {ii} {range_name(ri)} = zi0 + zx;")
        self.emit(i2, f"const {ij} {range_name(rj)} = zj0 + zy + zr;")
        self.emit(i2, f"if ({range_name(ri)} < {si} && {range_name(rj)} < {sj}) {{")
        saved = dict(self.name)
        for ld in g.staged:
            self.emit(i3, f"{tiles[ld]}[zy + zr][zx] = p{ld.arg}[{self.defined(ld.srcs[0], i3)}];")
        self.name = saved
        self.emit(i2, "}")
        self.emit(ind, "}")
        self.emit(ind, "__syncthreads();")
        # phase 2: lanes along j (the stores are contiguous there)
        self.emit(ind, f"for (int zr = 0; zr < {edge}; zr += {rows}) {{")
        self.emit(i2, f"const {ii} {range_name(ri)} = zi0 + zy + zr;")
        self.emit(i2, f"const {ij} {range_name(rj)} = zj0 + zx;")
        self.emit(i2, f"if ({range_name(ri)} < {si} && {range_name(rj)} < {sj}) {{")
        saved = dict(self.name)
        self.stmts(blocks[n - 1], i3)
        for st in blocks[n].stmts:
            if isinstance(st, Expr) and st in tiles:
                v = self.fresh("v")
                value = r.from_storage(f"{tiles[st]}[zx][zy + zr]", params[st.arg].dtype)
                self.emit(i3, f"const {r.value_type(st)} {v} = {value};")
                self.name[st] = v
            else:
                self.stmts(Block(stmts=[st]), i3)
        self.tail(blocks[n], i3)
        self.tail(blocks[n - 1], i3)
        self.name = saved
        self.emit(i2, "}")
        self.emit(ind, "}")
        self.emit(ind, "__syncthreads();")
        for blk in reversed(blocks[:n - 1]):
            self.tail(blk, ind)
        self.emit("  ", "}")

    def scatter_frame(self, root: Block) -> None:
        """One thread per bin of target rows and iteration of the other output loops (those fastest, so a warp's
        lanes walk them): zero the bin's rows, then add ``x`` at row ``index`` for each iteration of the sum's
        ranges in order, when that row is in the bin (see ``gpu._scatter_geometry``). Every output element is
        written by one thread only, in the sum's order."""
        g, r, k = self.g, self.r, self.k
        target, index, per = g.scatter
        (st,) = k.stores
        red = st.value
        x = red.srcs[0].srcs[1]
        p = k.params[st.param]
        others = [lp for lp in gpu.output_loops(root) if lp.range is not target]
        rows = target.arg[1]
        count = math.prod(lp.range.arg[1] for lp in others)
        b = g.block_threads
        it = index_type(g.items + g.grid[0] * b)
        tt = index_type(rows + per)
        t = range_name(target)
        self.emit("  ", f"for ({it} zi = ({it})blockIdx.x * {b} + threadIdx.x; zi < {g.items}; "
                        f"zi += ({it})gridDim.x * {b}) {{")
        ind, i2 = "    ", "      "
        if others:
            self.emit(ind, f"const {it} zo = zi % {count};")
            self.decode(others, "zo", ind)
        self.emit(ind, f"const {tt} zlo = ({tt})(zi / {count}) * {per};")
        self.emit(ind, f"const {tt} zhi = zlo + {per} < {rows} ? zlo + {per} : {rows};")
        self.emit(ind, f"for ({tt} {t} = zlo; {t} < zhi; {t}++) {{")
        saved = dict(self.name)
        at = self.defined(st.index, i2)
        self.emit(i2, f"p{st.param}[{at}] = {r.to_storage(r.literal(0, p.dtype), p.dtype)};")
        self.name = saved
        self.emit(ind, "}")
        depth = ind
        for rr in red.arg[1]:
            self.emit(depth, f"for ({index_type(rr.arg[1])} {range_name(rr)} = 0; {range_name(rr)} < {rr.arg[1]}; "
                             f"{range_name(rr)}++) {{")
            depth += "  "
        saved = dict(self.name)
        row = self.defined(index, depth)
        self.emit(depth, f"if ({row} >= zlo && {row} < zhi) {{")
        inner = depth + "  "
        self.emit(inner, f"const {tt} {t} = ({tt})({row});")
        value = self.defined(x, inner)
        at = self.defined(st.index, inner)
        total = r.to_storage(f"{r.from_storage(f'p{st.param}[{at}]', p.dtype)} + {value}", p.dtype)
        self.emit(inner, f"p{st.param}[{at}] = {total};")
        self.emit(depth, "}")
        self.name = saved
        for _ in red.arg[1]:
            depth = depth[:-2]
            self.emit(depth, "}")
        self.emit("  ", "}")

    def scan_frame(self, root: Block) -> None:
        """One group of ``G`` lanes per iteration of the outer loops (see ``gpu._scan_geometry``): lane ``zl`` folds
        the inputs of its chunk ``[zlo, zhi)`` of the scan loop into totals, the group's exclusive prefix of those
        totals (``scan_prefix``) starts each scan's running value, and the lane runs its chunk."""
        g, r = self.g, self.r
        blocks, loops = gpu.output_blocks(root), gpu.output_loops(root)
        s, gt, w = g.split, g.group_threads, g.groups_per_block
        lp = loops[s]
        size = lp.range.arg[1]
        chunk = -(-size // gt)
        it = index_type(g.items + g.grid[0] * w)
        first = f"({it})blockIdx.x * {w} + threadIdx.y" if w > 1 else f"({it})blockIdx.x"
        step = f"({it})gridDim.x * {w}" if w > 1 else f"({it})gridDim.x"
        t = index_type(size + chunk * 2)
        self.emit("  ", "const int zl = threadIdx.x;")
        self.emit("  ", f"for ({it} zg = {first}; zg < {g.items}; zg += {step}) {{")
        ind = "    "
        self.decode(loops[:s], "zg", ind)
        for blk in blocks[:s + 1]:
            self.stmts(blk, ind)
        scans = [st.expr for st in blocks[s].stmts if isinstance(st, ScanInit)]
        self.emit(ind, f"const {t} zlo = ({t})zl * {chunk};")
        self.emit(ind, f"const {t} zhi = zlo + {chunk} < {size} ? zlo + {chunk} : {size};")
        totals = {e: self.fresh("ztot") for e in scans}
        for e in scans:
            self.emit(ind, r.scan_init(e, totals[e]))
        rn = range_name(lp.range)
        self.emit(ind, f"for ({t} {rn} = zlo; {rn} < zhi; {rn}++) {{")
        saved = dict(self.name)
        for e in scans:
            self.emit(ind + "  ", r.scan_step(e, totals[e], self.defined(e.srcs[0], ind + "  ")))
        self.name = saved
        self.emit(ind, "}")
        for e in scans:
            self.scan_prefix(e, totals[e], ind)
            self.emit(ind, f"{self.acc[e]} = {totals[e]};")
        self.emit(ind, f"for ({t} {rn} = zlo; {rn} < zhi; {rn}++) {{")
        saved = dict(self.name)
        self.block(lp.body, ind + "  ")
        self.name = saved
        self.emit(ind, "}")
        for blk in reversed(blocks[:s + 1]):
            self.tail(blk, ind)
        self.emit("  ", "}")

    def scan_prefix(self, e: Expr, total: str, ind: str) -> None:
        """Replace each lane's ``total`` by the fold of the totals of the lanes before it in its group (the
        scan's identity on lane 0): an inclusive scan across the warp by ``__shfl_up_sync``, shifted by one
        lane, then across warps through shared memory (every lane adds the earlier warps' totals in one order)."""
        r = self.r
        rt = r.reg_type(e.dtype)
        op = "+" if e.arg is Ops.ADD else "*"
        one = r.literal(0 if e.arg is Ops.ADD else 1, dtypes.float32 if e.dtype in (dtypes.float16,
                                                                                   dtypes.bfloat16) else e.dtype)
        self.emit(ind, "for (int zo = 1; zo < 32; zo <<= 1) {")
        self.emit(ind, f"  const {rt} zu = __shfl_up_sync({FULL_MASK}, {total}, zo);")
        self.emit(ind, f"  if ((zl & 31) >= zo) {total} = zu {op} {total};")
        self.emit(ind, "}")
        warps = self.g.group_threads // 32
        if warps > 1:
            sh = self.fresh("zsh")
            self.shared.append(f"  __shared__ {rt} {sh}[{warps}];")
            self.emit(ind, f"if ((zl & 31) == 31) {sh}[zl >> 5] = {total};")
            self.emit(ind, "__syncthreads();")
        self.emit(ind, f"{total} = __shfl_up_sync({FULL_MASK}, {total}, 1);")
        self.emit(ind, f"if ((zl & 31) == 0) {total} = {one};")
        if warps > 1:
            self.emit(ind, f"for (int zw = (zl >> 5) - 1; zw >= 0; zw--) {total} = {sh}[zw] {op} {total};")
            self.emit(ind, "__syncthreads();")

    def defined(self, e: Expr, ind: str) -> str:
        """``e`` as a C operand, defining each of its parts not yet named (constants and ranges are operands)."""
        for x in ir.toposort([e]):
            if x.op not in (Ops.CONST, Ops.RANGE) and x not in self.name:
                self.define(x, ind)
        return self.value(e)

    def vector_thread_frame(self, root: Block) -> None:
        """The ``thread`` layout with ``V = g.vector`` consecutive iterations of the innermost loop per thread
        (``gpu.plan_vector``): work item ``zi`` is the run starting at ``rB = (zi % chunks) * V`` of that loop.
        A run wholly inside the loop reads each of ``g.vector_loads`` with vector loads at ``rB`` (the element
        offset is proven aligned), computes the ``V`` outputs (one scope per lane, the loop's range bound to
        ``rB + j``) and writes each of ``g.vector_stores`` with vector stores after the last lane; the other
        loads and stores stay scalar, in lane order. A run crossing the loop's end (only when ``V`` does not divide
        the loop's size) runs its lanes in a scalar loop. Values of the outer loops are computed once per run."""
        g = self.g
        blocks, loops = gpu.output_blocks(root), gpu.output_loops(root)
        n, width = len(loops), g.vector
        inner = loops[-1].range
        size = inner.arg[1]
        chunks = -(-size // width)
        b = g.block_threads
        it = index_type(g.items + g.grid[0] * b)
        every = ir.toposort([x for st in self.k.stores for x in (st.index, st.value)] + list(self.k.loops))
        fresh = 1 + max((e.arg[0] for e in every if e.op is Ops.RANGE), default=0)
        base = ir.range_(fresh, size)  # bound to the run's first iteration of the innermost loop
        self.emit("  ", f"for ({it} zi = ({it})blockIdx.x * {b} + threadIdx.x; zi < {g.items}; "
                        f"zi += ({it})gridDim.x * {b}) {{")
        ind = "    "
        if n > 1:
            self.emit(ind, f"const {it} zq = zi / {chunks};")
            self.decode(loops[:-1], "zq", ind)
        t = index_type(size + width)
        run = f"zi % {chunks}" if n > 1 else "zi"  # zi < items == chunks without outer loops
        self.emit(ind, f"const {t} {range_name(base)} = ({t})({run}) * {width};")
        for blk in blocks[:n]:
            self.stmts(blk, ind)
        if size % width:
            self.emit(ind, f"if ({range_name(base)} + {width} <= {size}) {{")
            self.vector_run(blocks[n], inner, base, ind + "  ")
            self.emit(ind, "} else {")
            i2 = ind + "  "
            self.emit(i2, f"for ({t} zj = {range_name(base)}; zj < {size}; zj++) {{")
            saved = dict(self.name)
            self.emit(i2 + "  ", f"const {t} {range_name(inner)} = zj;")
            self.block(blocks[n], i2 + "  ")
            self.name = saved
            self.emit(i2, "}")
            self.emit(ind, "}")
        else:
            self.vector_run(blocks[n], inner, base, ind)
        for blk in reversed(blocks[:n]):
            self.tail(blk, ind)
        self.emit("  ", "}")

    def at_base(self, index: Expr, inner: Expr, base: Expr, ind: str) -> str:
        """Define ``index`` with the innermost range replaced by the run's first iteration; its C operand."""
        return self.defined(ir.substitute(index, {inner: base}), ind)

    def vector_run(self, blk: Block, inner: Expr, base: Expr, ind: str) -> None:
        """One whole run of ``g.vector`` lanes of the innermost block ``blk`` (see ``vector_thread_frame``)."""
        g, r, params = self.g, self.r, self.k.params
        width = g.vector
        saved = dict(self.name)
        lanes: dict[Expr, list[str]] = {}
        for st in blk.stmts:  # the vector loads, in program order
            if isinstance(st, Expr) and st in g.vector_loads:
                d = params[st.arg].dtype
                at = self.at_base(st.srcs[0], inner, base, ind)
                regs = []
                for off, vt in self.pieces(d, width):
                    v = self.fresh("zv")
                    addr = f"p{st.arg} + {at}" + (f" + {off}" if off else "")
                    self.emit(ind, f"const {vt} {v} = zyx_vld_{_vector_suffix(vt)}({addr});")
                    regs.append(v)
                lanes[st] = [r.from_storage(x, d) for x in self.lane_parts(d, width, regs)]
        outs: dict[int, list[str]] = {}
        stores = {self.k.stores[i]: i for i in g.vector_stores}
        for st in blk.tail:
            if isinstance(st, Store) and st in stores:
                st_type = r.storage_type(params[st.param].dtype)
                names = [self.fresh("zs") for _ in range(width)]
                self.emit(ind, f"{st_type} {', '.join(names)};")
                outs[stores[st]] = names
        for j in range(width):
            self.emit(ind, "{")
            i2 = ind + "  "
            lane_saved = dict(self.name)
            t = index_type(inner.arg[1] + width)
            self.emit(i2, f"const {t} {range_name(inner)} = {range_name(base)} + {j};")
            for st in blk.stmts:
                if isinstance(st, Expr) and st in lanes:
                    v = self.fresh("v")
                    self.emit(i2, f"const {r.value_type(st)} {v} = {lanes[st][j]};")
                    self.name[st] = v
                else:
                    self.stmts(Block(stmts=[st]), i2)
            for st in blk.tail:
                if isinstance(st, Store) and st in stores:
                    p = params[st.param]
                    if st.value.dtype is not p.dtype:
                        raise AssertionError(f"store of {st.value.dtype} into {p.dtype} param")
                    self.emit(i2, f"{outs[stores[st]][j]} = {r.to_storage(self.value(st.value), p.dtype)};")
                else:
                    self.tail(Block(tail=[st]), i2)
            self.name = lane_saved
            self.emit(ind, "}")
        for st in blk.tail:
            if isinstance(st, Store) and st in stores:
                d = params[st.param].dtype
                at = self.at_base(st.index, inner, base, ind)
                for (off, vt), val in zip(self.pieces(d, width), self.pack(d, width, outs[stores[st]])):
                    addr = f"p{st.param} + {at}" + (f" + {off}" if off else "")
                    self.emit(ind, f"zyx_vst_{_vector_suffix(vt)}({addr}, {val});")
        self.name = saved

    @staticmethod
    def pieces(d: DType, width: int) -> list[tuple[int, str]]:
        """(element offset, C type) of each vector access covering ``width`` elements of ``d``."""
        piece = gpu.vector_piece(width, d.itemsize)
        per = piece // d.itemsize
        return [(i * per, vector_type(d, piece)[0]) for i in range(width // per)]

    def lane_parts(self, d: DType, width: int, regs: list[str]) -> list[str]:
        """The stored bits of each of the ``width`` elements in the vector registers ``regs``, as ``d``'s
        storage type (1- and 2-byte elements: little-endian within the 32-bit words)."""
        piece = gpu.vector_piece(width, d.itemsize)
        _, fields = vector_type(d, piece)
        per = piece // d.itemsize
        out = []
        for j in range(width):
            reg = regs[j // per]
            if d.itemsize >= 4:
                out.append(f"{reg}.{fields[j % per]}")
                continue
            byte = (j % per) * d.itemsize
            word = f"{reg}.{fields[byte // 4]}" if fields else reg
            shift = (byte % 4) * 8
            bits = f"({word} >> {shift})" if shift else word
            out.append(f"({self.r.storage_type(d)})({bits})")
        return out

    def pack(self, d: DType, width: int, names: list[str]) -> list[str]:
        """The vector value of each piece from the ``width`` storage-typed lane variables ``names``."""
        piece = gpu.vector_piece(width, d.itemsize)
        vt, fields = vector_type(d, piece)
        per = piece // d.itemsize
        out = []
        for i in range(width // per):
            lane = names[i * per:(i + 1) * per]
            if d.itemsize >= 4:
                out.append(f"make_{vt}({', '.join(lane)})")
                continue
            u = "unsigned short" if d.itemsize == 2 else "unsigned char"
            per_word = 4 // d.itemsize
            words = []
            for w in range(piece // 4):
                bits = [f"((unsigned int)({u}){x} << {8 * d.itemsize * q})" if q else f"(unsigned int)({u}){x}"
                        for q, x in enumerate(lane[w * per_word:(w + 1) * per_word])]
                words.append(" | ".join(bits))
            out.append(f"make_{vt}({', '.join(words)})" if fields else words[0])
        return out

    def group_frame(self, root: Block) -> None:
        """One group of threads per iteration of output loops [0, split); see ``gpu``."""
        g = self.g
        blocks, loops = gpu.output_blocks(root), gpu.output_loops(root)
        s, flat, n = g.split, g.flat, len(loops)
        w = g.groups_per_block
        it = index_type(g.items + g.grid[0] * w)
        first = f"({it})blockIdx.x * {w} + threadIdx.y" if w > 1 else f"({it})blockIdx.x"
        step = f"({it})gridDim.x * {w}" if w > 1 else f"({it})gridDim.x"
        self.emit("  ", "const int zl = threadIdx.x;")
        self.emit("  ", f"for ({it} zg = {first}; zg < {g.items}; zg += {step}) {{")
        ind = "    "
        self.decode(loops[:s], "zg", ind)
        for d in range(s + 1):
            self.stmts(blocks[d], ind, coop=d == s)
        if s < n:
            self.strided(loops[s:flat], loops[flat] if flat < n else None, "zj", ind)
        elif blocks[n].tail:
            self.emit(ind, "if (zl == 0) {")
            self.tail(blocks[n], ind + "  ")
            self.emit(ind, "}")
        self.emit("  ", "}")

    def strided(self, flat: list[Loop], rest: Loop | None, var: str, ind: str, lane: str = "zl") -> None:
        """Loops ``flat`` flattened and strided over the group's lanes (thread ``lane`` of ``group_threads``);
        ``rest`` (the next loop) runs serially."""
        total = gpu.loop_size(flat)
        gt = self.g.group_threads
        it = index_type(total + gt)
        if self.g.unroll > 1 and total > gt:  # independent loads of several iterations in flight per thread
            self.emit(ind, f"#pragma unroll {self.g.unroll}")
        self.emit(ind, f"for ({it} {var} = {lane}; {var} < {total}; {var} += {gt}) {{")
        i2 = ind + "  "
        self.decode(flat, var, i2)
        for lp in flat:
            self.stmts(lp.body, i2)
        if rest is not None:
            self.serial_loop(rest, i2)
        for lp in reversed(flat):
            self.tail(lp.body, i2)
        self.emit(ind, "}")

    def decode(self, loops: list[Loop], var: str, ind: str) -> None:
        """Define each loop's range variable from the flat index ``var`` (outermost loop slowest)."""
        sizes = [lp.range.arg[1] for lp in loops]
        for i, lp in enumerate(loops):
            stride = math.prod(sizes[i + 1:])
            x = var if stride == 1 else f"{var} / {stride}"
            if i > 0:
                x = f"({x}) % {sizes[i]}"
            t = index_type(sizes[i] - 1)
            self.emit(ind, f"const {t} {range_name(lp.range)} = ({t})({x});")

    # ---- blocks and loops ------------------------------------------------------------------------------------
    def stmts(self, b: Block, ind: str, coop: bool = False) -> None:
        for st in b.stmts:
            if isinstance(st, Reduce):
                if coop:
                    self.coop_reduce(st, ind)
                else:
                    self.serial_reduce(st, ind)
            elif isinstance(st, ScanInit):
                self.acc[st.expr] = self.fresh("scan")
                self.emit(ind, self.r.scan_init(st.expr, self.acc[st.expr]))
            elif st.op is Ops.SCAN:
                self.emit(ind, self.r.scan_step(st, self.acc[st], self.value(st.srcs[0])))
                self.name[st] = self.r.round_half(self.acc[st], st.dtype)
            else:
                self.define(st, ind)

    def tail(self, b: Block, ind: str) -> None:
        for st in b.tail:
            if isinstance(st, Store):
                self.store(st, ind)
            else:  # the accumulate statement at the end of the innermost reduce loop
                self.emit(ind, self.r.accumulate(st, self.acc[st], self.r.acc_type(st, self.k), self.value))

    def block(self, b: Block, ind: str) -> None:
        self.stmts(b, ind)
        if b.inner is not None:
            self.serial_loop(b.inner, ind)
        self.tail(b, ind)

    def serial_loop(self, lp: Loop, ind: str) -> None:
        r, size = range_name(lp.range), lp.range.arg[1]
        t = index_type(size)
        self.emit(ind, f"for ({t} {r} = 0; {r} < {size}; {r}++) {{")
        self.block(lp.body, ind + "  ")
        self.emit(ind, "}")

    def define(self, e: Expr, ind: str) -> None:
        v = self.fresh("v")
        self.emit(ind, f"const {self.r.value_type(e)} {v} = {self.r.expr(e, self.name, self.k.params)};")
        self.name[e] = v

    def store(self, st: Store, ind: str) -> None:
        p = self.k.params[st.param]
        if st.value.dtype is not p.dtype:
            raise AssertionError(f"store of {st.value.dtype} into {p.dtype} param")
        self.emit(ind, f"p{st.param}[{self.value(st.index)}] = {self.r.to_storage(self.value(st.value), p.dtype)};")

    # ---- reductions ------------------------------------------------------------------------------------------
    def open_acc(self, e: Expr, ind: str) -> tuple[str, str, bool]:
        acc = self.fresh("acc")
        at = self.r.acc_type(e, self.k)
        nan = self.r.tracks_nan(e)
        self.emit(ind, f"{at} {acc} = {self.r.identity(e.arg[0], e, at)};")
        if nan:
            self.emit(ind, f"int {acc}_nan = 0;")
        self.acc[e] = acc
        return acc, at, nan

    def close_acc(self, e: Expr, acc: str, at: str, nan: bool, ind: str) -> None:
        fin = self.r.nan_result(acc, at) if nan else acc
        v = self.fresh("v")
        rt = self.r.reg_type(e.dtype)
        self.emit(ind, f"const {rt} {v} = ({rt})({fin});")
        self.name[e] = v

    def serial_reduce(self, red: Reduce, ind: str) -> None:
        _check_plain(red)
        acc, at, nan = self.open_acc(red.expr, ind)
        self.serial_loop(red.loop, ind)
        self.close_acc(red.expr, acc, at, nan, ind)

    def coop_reduce(self, red: Reduce, ind: str) -> None:
        """All lanes of the group accumulate strided slices, then combine; every lane gets the result."""
        _check_plain(red)
        e = red.expr
        acc, at, nan = self.open_acc(e, ind)
        chain = gpu.reduce_chain(red)
        f = gpu.flatten_count(chain)
        op = e.arg[0]
        if self.g.strategy == "columns":
            self.strided(chain[:f], chain[f] if f < len(chain) else None, f"{acc}_i", ind, lane="zy")
            if self.g.group_threads > 1:
                self.cross_rows(op, acc, at, nan, ind, e.dtype)
            self.close_acc(e, acc, at, nan, ind)
            return
        self.strided(chain[:f], chain[f] if f < len(chain) else None, f"{acc}_i", ind)
        self.emit(ind, "for (int zo = 16; zo > 0; zo >>= 1) {")
        self.emit(ind, f"  const {at} zt = {self.r.shuffle_xor(at, acc, 'zo')};")
        self.emit(ind, "  " + self.r.combine(op, acc, "zt", e.dtype))
        if nan:
            self.emit(ind, f"  {acc}_nan |= __shfl_xor_sync({FULL_MASK}, {acc}_nan, zo);")
        self.emit(ind, "}")
        if self.g.group_threads > 32:
            self.cross_warp(op, acc, at, nan, ind, e.dtype)
        self.close_acc(e, acc, at, nan, ind)

    def cross_rows(self, op: Ops, acc: str, at: str, nan: bool, ind: str, d: DType) -> None:
        """Columns layout: combine the ``TY`` partials of each output (column ``zx``) through shared memory; every
        thread of the column reads them in one order, so all get the same result."""
        tx, ty = self.g.groups_per_block, self.g.group_threads
        self.shared.append(f"  __shared__ {at} {acc}_sh[{ty}][{tx}];")
        if nan:
            self.shared.append(f"  __shared__ int {acc}_shn[{ty}][{tx}];")
        self.emit(ind, f"{acc}_sh[zy][zx] = {acc};" + (f" {acc}_shn[zy][zx] = {acc}_nan;" if nan else ""))
        self.emit(ind, "__syncthreads();")
        self.emit(ind, f"{acc} = {acc}_sh[0][zx];" + (f" {acc}_nan = {acc}_shn[0][zx];" if nan else ""))
        self.emit(ind, f"for (int zw = 1; zw < {ty}; zw++) {{ {self.r.combine(op, acc, f'{acc}_sh[zw][zx]', d)}"
                       + (f" {acc}_nan |= {acc}_shn[zw][zx];" if nan else "") + " }")
        self.emit(ind, "__syncthreads();")

    def cross_warp(self, op: Ops, acc: str, at: str, nan: bool, ind: str, d: DType) -> None:
        """Combine the warps' (uniform) partials through shared memory; every thread reads them in one order."""
        warps = self.g.group_threads // 32
        self.shared.append(f"  __shared__ {at} {acc}_sh[{warps}];")
        if nan:
            self.shared.append(f"  __shared__ int {acc}_shn[{warps}];")
        self.emit(ind, f"if ((zl & 31) == 0) {{ {acc}_sh[zl >> 5] = {acc};"
                       + (f" {acc}_shn[zl >> 5] = {acc}_nan;" if nan else "") + " }")
        self.emit(ind, "__syncthreads();")
        self.emit(ind, f"{acc} = {acc}_sh[0];" + (f" {acc}_nan = {acc}_shn[0];" if nan else ""))
        self.emit(ind, f"for (int zw = 1; zw < {warps}; zw++) {{ {self.r.combine(op, acc, f'{acc}_sh[zw]', d)}"
                       + (f" {acc}_nan |= {acc}_shn[zw];" if nan else "") + " }")
        self.emit(ind, "__syncthreads();")


def simt_offset(i: str, thread: str, v: int, threads: int) -> str:
    """The tile row (column) of a thread's ``i``-th row (column) in the ``simt`` layout (``gpu.SimtTile``): runs of
    ``v`` consecutive ones, ``threads x v`` apart."""
    if v == 1:
        return f"{thread} + {threads} * {i}"
    return f"({i} / {v}) * {threads * v} + {thread} * {v} + {i} % {v}"


def swizzled(w: str, row: str, mask: int) -> str:
    """The C column of word ``w`` of shared-tile row ``row`` under the XOR mask ``mask`` (``gpu.mma_swizzle``;
    0: ``w``): ``w ^ gpu.mma_swizzled(row >> 3, mask)``."""
    if not mask:
        return w
    q = f"(({row}) >> 3)"
    return f"({w}) ^ (({q} ^ ({q} << 1) ^ ({q} << 3)) & {mask})"


def _check_plain(red: Reduce) -> None:
    if getattr(red, "vec", None) is not None or red.split:
        raise NotImplementedError(f"reduce {red.expr.arg[0].name} placed for the host (vector or split "
                                  "accumulator): GPU kernels must come from gpu.optimize")


def render_cuda(k: Kernel, info: DeviceInfo) -> CudaSource:
    """Optimize ``k`` for the GPU described by ``info`` and render it."""
    return CUDARenderer().render(gpu.optimize(k, info))


__all__ = ["CUDARenderer", "CudaSource", "render_cuda"]

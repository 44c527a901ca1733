"""CUDA C kernels run on the CPU: the kernel half of the emulated CUDA driver.

A module's CUDA C source is compiled as C++ by g++ together with a small runtime header, once (disk cache under
``cache_dir()/"cuda_emulator"`` keyed by the sha256 of the generated C++, the compiler and its flags; an in-process
cache by source text in ``compile_module``). ``KernelFunction.run`` then runs every block of the grid, one after the
other, on the calling OS thread (ctypes releases the GIL), and every thread of each block. The block runners are
compiled once per set of flags into a library of their own, not into each module (they were 20-50% of a module's
compile); a module's launch wrapper packs the parameters and the addresses of its per-thread builtins, and each
CUDA thread is one indirect call of the kernel:

- kernels without ``__syncthreads`` / warp shuffles / ``__syncwarp`` / votes run each CUDA thread as a plain call;
- kernels with them run each CUDA thread of a block as a fiber (a hand-written x86-64 context switch, ucontext
  elsewhere; 64 KiB stacks with a guard page, allocated once per OS thread and reused). A barrier is a count of
  arrivals; a waiting fiber passes control to the next ready one. ``__syncthreads`` waits for *every* thread of the
  block, a warp collective for every existing lane of the warp (the mask must cover them, else a "trap" fault);
  when no fiber is ready and some have not finished the launch stops with a "deadlock" fault;
- ``threadIdx``/``blockIdx``/``blockDim``/``gridDim`` are per OS thread; ``__shared__`` is ``static thread_local``
  (a block's fibers share one OS thread, blocks run in turn), so launches run concurrently from several threads;
  ``extern __shared__`` is a per-OS-thread buffer of ``DYNAMIC_SHARED_CAPACITY`` bytes, zeroed for each launch;
- parameter values are copied out of the caller's bytes at launch (sizes: 8 per pointer, the scalar's size);
- faults: one SIGSEGV/SIGBUS/SIGFPE handler per process (a separately compiled runtime library, on an alternate
  signal stack per OS thread) turns an illegal address, an integer division trap, a deadlock or ``__trap()`` inside
  a kernel into a ``Fault``; the process keeps working. A fault outside an emulated kernel goes to the handler that
  was installed before (e.g. Python's faulthandler), or the default action.

Not emulated: CUDA's math library precision (glibc's functions are used), inline PTX (``__CUDA_ARCH__`` is left
undefined, so sources take their portable branches), warp-synchronous behaviour other than the intrinsics above
(lanes do not run in lock step between them), partial-mask collectives, memory-model races between blocks, texture
and cooperative-group APIs, memory checking of in-bounds-but-wrong accesses, and speed. Integer division by zero
faults here ("arithmetic"), while a GPU returns an unspecified value. A kernel that loops forever hangs its thread.
Kernels must be spelled out (not produced by a macro); templates are skipped; parameters are pointers or the scalar
and vector types of ``_SCALAR_SIZES`` (else ``EmulatorCompileError``). ``ZYX_CUDA_EMULATOR_UCONTEXT=1`` selects the
portable ucontext switch on x86-64 too (for testing it).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zyx.backends.host.compiler import LD_FLAGS, cache_dir, link_directly, linker_of, precompile_header
from zyx.utils import write_atomic

__all__ = ["DYNAMIC_SHARED_CAPACITY", "EmulatedModule", "EmulatorCompileError", "Fault", "KernelFunction",
           "compile_module", "guarded_copy", "signatures"]

MAX_BLOCK = (1024, 1024, 64)
MAX_THREADS_PER_BLOCK = 1024
MAX_GRID = (2**31 - 1, 65535, 65535)
DYNAMIC_SHARED_CAPACITY = 256 * 1024  # bytes of ``extern __shared__`` memory a launch may use
ABI_VERSION = 2

FLAGS = ("-std=c++17", "-O1", "-shared", "-fPIC", "-w", "-fno-strict-aliasing", "-ffp-contract=off",
         "-fno-math-errno", "-fstack-clash-protection", "-U_FORTIFY_SOURCE", "-D_FORTIFY_SOURCE=0")
# -Bsymbolic: a module's calls to its own kernels bind to them, not to a same-named symbol some library loaded
# earlier put in the global scope (a test kernel `saxpy` ran MKL's Fortran saxpy once MKL was loaded). Link only:
# the precompiled header must be built with FLAGS alone, or g++ cannot use it (modules compile ~40% slower).
# -pipe (driver only): no temporary files between the compiler's stages.
# No -fwrapv: NVRTC has none, so signed overflow must be defined by the rendered code itself (``ir.may_wrap``); g++
# folds undefined overflow as NVRTC does, so the emulator catches kernels that rely on wrapping.
LINK_FLAGS = ("-Wl,-Bsymbolic", "-pipe")
# Libraries are compiled (g++ -c) and then linked by the linker itself, not through the g++ driver (which reads
# libstdc++, libm and libc and adds the crt files: ~24 ms a module, against ~4): their few libc and libm symbols
# resolve when ctypes loads them (RTLD_NOW), from the Python process, which has both. A library that does not
# load so (it needs the crt's ``__dso_handle``: a thread_local with a destructor, as in the runtime library) is
# linked through the driver instead. (``LD_FLAGS``: the host compiler's, which links its libraries the same way.)
# no shadow stack / IBT marking: the fiber switch changes stacks by hand
_ARCH_FLAGS = ("-fcf-protection=none",) if platform.machine() in ("x86_64", "AMD64") else ()


class EmulatorCompileError(Exception):
    """A CUDA source the emulator cannot compile (g++ rejected it, or a kernel signature is not understood)."""


@dataclass(frozen=True)
class Fault:
    """Why a launch stopped: "address" (illegal address: SIGSEGV/SIGBUS; ``address`` is the faulting address),
    "arithmetic" (SIGFPE: integer division by zero or overflow), "deadlock" (a block's threads cannot make
    progress: a divergent ``__syncthreads`` or warp collective), "trap" (``__trap()``, or an unsupported use of a
    collective)."""

    kind: str
    address: int
    detail: str


_KINDS = {1: "address", 2: "arithmetic", 3: "deadlock", 4: "trap"}


class _Result(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("sig", ctypes.c_int), ("code", ctypes.c_int), ("thread", ctypes.c_int),
                ("block", ctypes.c_longlong), ("addr", ctypes.c_ulonglong), ("detail", ctypes.c_char * 200)]


# ---------------------------------------------------------------------------------------------------------------
# C++ sources

_ABI = r"""
#include <setjmp.h>
struct zyx_emu_result {  /* mirrored by kernels._Result */
  int kind, sig, code, thread;
  long long block;
  unsigned long long addr;
  char detail[200];
};
struct zyx_emu_ctx { sigjmp_buf jb; zyx_emu_result* res; };
namespace zyx_emu { struct Sched; }
struct zyx_emu_launch {  /* one launch: the kernel as body(arg) per CUDA thread, and the module's builtins */
  void (*body)(void*);
  void* arg;
  unsigned g[6];  /* grid x, y, z, block x, y, z */
  unsigned long long shared;
  zyx_emu_result* res;
  bool fibers, flush;
  unsigned *thread_idx, *block_idx, *block_dim, *grid_dim;  /* x, y, z of the module's, on this OS thread */
  zyx_emu::Sched** sched;
  zyx_emu_ctx** ctx;
};
struct zyx_emu_rt {  /* the runtime library: the one signal handler, per-OS-thread stacks and buffers */
  int abi;
  int (*enter)(zyx_emu_ctx*);
  void (*leave)(void);
  char* (*stacks)(int n, unsigned long stride);
  void* (*scratch)(unsigned long bytes);
  unsigned char* (*dyn_shared)(void);
  unsigned long dyn_shared_cap;
};
struct zyx_emu_runner {  /* the block runners (one library per set of compiler flags), bound to the runtime */
  const zyx_emu_rt* rt;
  int (*launch)(const zyx_emu_launch*);
};
"""

# The fiber scheduler's state and the parts of it both sides run: the runtime library starts and resumes fibers, a
# module's collectives (__syncthreads, shuffles) wait at barriers. One text, compiled into both.
_SCHED = r"""
#include <stdio.h>
#include <string.h>
#if !defined(__x86_64__) || defined(ZYX_EMU_UCONTEXT)
#include <ucontext.h>
#define ZYX_EMU_UC 1
#endif
namespace zyx_emu {
enum { OK = 0, ADDRESS = 1, ARITHMETIC = 2, DEADLOCK = 3, TRAP = 4 };
enum { RUN = 0, WAIT_BLOCK = 1, WAIT_WARP = 2, DONE = 3 };
static const unsigned long STACK = 64UL << 10, GUARD = 4096, STRIDE = STACK + GUARD;

struct Bar { int count, expected, head, tail; unsigned gen; };
struct Fiber {
  void* sp;
  int next, state;
  unsigned x, y, z;
#ifdef ZYX_EMU_UC
  ucontext_t uc;
#endif
};
struct Sched {
  int n, cur, rhead, rtail, ndone, nwarps;
  void (*body)(void*);
  void* arg;
  void* main_sp;
  char* stacks;
  unsigned* tid;     /* the launching module's threadIdx on this OS thread */
  zyx_emu_ctx* ctx;  /* the launch */
#ifdef ZYX_EMU_UC
  ucontext_t main_uc;
#endif
  long long acc[2];
  Bar block, warp[32];
  unsigned lanes[32];
  Fiber f[1024];
  unsigned long long slots[2][1024];
};

__attribute__((noreturn, noinline)) static void fail_in(zyx_emu_ctx* c, int kind, const char* detail) {
  c->res->kind = kind;
  strncpy(c->res->detail, detail, sizeof c->res->detail - 1);
  siglongjmp(c->jb, 1);
}

#ifndef ZYX_EMU_UC
extern "C" void zyx_emu_swap(void** save, void* to) __attribute__((visibility("hidden")));
extern "C" void zyx_emu_start(void) __attribute__((visibility("hidden")));
asm(".text\n.p2align 4\n.globl zyx_emu_swap\n.hidden zyx_emu_swap\n.type zyx_emu_swap,@function\n"
    "zyx_emu_swap:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
    ".size zyx_emu_swap, .-zyx_emu_swap\n"
    ".globl zyx_emu_start\n.hidden zyx_emu_start\n.type zyx_emu_start,@function\n"
    "zyx_emu_start:\n  movq %rbx, %rdi\n  callq *%r12\n  ud2\n.size zyx_emu_start, .-zyx_emu_start\n");
#endif

static inline __attribute__((always_inline)) void enter_thread(Sched* s, int t) {
  s->cur = t;
  Fiber& f = s->f[t];
  f.state = RUN;
  s->tid[0] = f.x; s->tid[1] = f.y; s->tid[2] = f.z;
  s->ctx->res->thread = t;
}

static inline void swap_to(Sched* s, Fiber* from, int t) {
#ifdef ZYX_EMU_UC
  swapcontext(&from->uc, &s->f[t].uc);
#else
  zyx_emu_swap(&from->sp, s->f[t].sp);
#endif
}

__attribute__((noreturn, noinline)) static void deadlock(Sched* s) {
  int blk = 0, warp = 0;
  for (int t = 0; t < s->n; t++) { blk += s->f[t].state == WAIT_BLOCK; warp += s->f[t].state == WAIT_WARP; }
  char msg[200];
  snprintf(msg, sizeof msg, "no thread of the block can proceed: %d of %d wait at __syncthreads, %d at a warp "
           "collective, %d exited", blk, s->n, warp, s->ndone);
  fail_in(s->ctx, DEADLOCK, msg);
}

/* The current fiber stops (waits or has finished): run the next ready one, or go back to the launch. */
static inline __attribute__((always_inline)) void run_next(Sched* s, Fiber* self) {
  int t = s->rhead;
  if (t < 0) {
    if (s->ndone != s->n) deadlock(s);
#ifdef ZYX_EMU_UC
    swapcontext(&self->uc, &s->main_uc);
#else
    zyx_emu_swap(&self->sp, s->main_sp);
#endif
    return;
  }
  s->rhead = s->f[t].next;
  if (s->rhead < 0) s->rtail = -1;
  enter_thread(s, t);
  swap_to(s, self, t);
}

/* Arrive at barrier b; return once every thread it counts has arrived. */
static inline __attribute__((always_inline)) void bar_wait(Sched* s, Bar* b, int state) {
  if (++b->count == b->expected) {
    b->count = 0;
    b->gen++;
    if (b->head >= 0) {
      if (s->rtail >= 0) s->f[s->rtail].next = b->head; else s->rhead = b->head;
      s->rtail = b->tail;
      b->head = b->tail = -1;
    }
    return;
  }
  int t = s->cur;
  Fiber* self = &s->f[t];
  self->next = -1;
  self->state = state;
  if (b->tail >= 0) s->f[b->tail].next = t; else b->head = t;
  b->tail = t;
  run_next(s, self);
}
}  // namespace zyx_emu
"""

_RUNTIME = r"""
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
""" + _ABI + r"""
#define ZYX_DYN_CAP @DYN_CAP@UL
#define ZYX_ALT_BYTES (64UL << 10)
static const int zyx_sigs[3] = {SIGSEGV, SIGBUS, SIGFPE};
static struct sigaction zyx_prev[3];
static volatile sig_atomic_t zyx_passed[3];
static pthread_mutex_t zyx_mu = PTHREAD_MUTEX_INITIALIZER;
/* the launch running on this OS thread; initial-exec: readable in a signal handler without allocating */
static __thread zyx_emu_ctx* zyx_cur __attribute__((tls_model("initial-exec")));

static void zyx_handler(int sig, siginfo_t* si, void* uc) {
  zyx_emu_ctx* c = zyx_cur;
  if (c) {
    zyx_cur = 0;
    c->res->kind = sig == SIGFPE ? 2 : 1;
    c->res->sig = sig;
    c->res->code = si->si_code;
    c->res->addr = (unsigned long long)(uintptr_t)si->si_addr;
    siglongjmp(c->jb, 1);
  }
  /* not an emulated kernel: behave as if this handler had never been installed */
  int i = sig == SIGSEGV ? 0 : sig == SIGBUS ? 1 : 2;
  if (!zyx_passed[i]) {
    zyx_passed[i] = 1;
    sigaction(sig, &zyx_prev[i], 0);
  } else {  /* passed on once already and came back: take the default action */
    struct sigaction d;
    memset(&d, 0, sizeof d);
    d.sa_handler = SIG_DFL;
    sigaction(sig, &d, 0);
  }
  if (si->si_code <= 0) raise(sig);  /* sent, not raised by an instruction: it would not repeat */
}

static void zyx_install(void) {
  for (int i = 0; i < 3; i++) {
    struct sigaction now;
    sigaction(zyx_sigs[i], 0, &now);
    if ((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == zyx_handler) continue;
    pthread_mutex_lock(&zyx_mu);
    sigaction(zyx_sigs[i], 0, &now);
    if (!((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == zyx_handler)) {
      struct sigaction sa;
      memset(&sa, 0, sizeof sa);
      sa.sa_sigaction = zyx_handler;
      sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
      sigemptyset(&sa.sa_mask);
      sigaction(zyx_sigs[i], &sa, &zyx_prev[i]);
      zyx_passed[i] = 0;
    }
    pthread_mutex_unlock(&zyx_mu);
  }
}

struct ZyxThread {  /* per OS thread resources, released when the thread ends */
  char* stacks = 0; unsigned long stacks_len = 0; int nstacks = 0; unsigned long stride = 0;
  void* scratch = 0; unsigned long scratch_len = 0;
  unsigned char* dyn = 0;
  void* alt = 0;
  ~ZyxThread() {
    if (alt) {
      stack_t ss;
      if (sigaltstack(0, &ss) == 0 && ss.ss_sp == alt) {
        stack_t off; memset(&off, 0, sizeof off); off.ss_flags = SS_DISABLE; sigaltstack(&off, 0);
        free(alt);
      }  /* else someone replaced it: leak rather than free a live stack */
    }
    if (stacks) munmap(stacks, stacks_len);
    free(scratch);
    free(dyn);
  }
};
static thread_local ZyxThread zyx_t;

static int zyx_enter(zyx_emu_ctx* c) {
  zyx_install();
  stack_t ss;
  if (sigaltstack(0, &ss) != 0) return errno ? errno : -1;
  if (ss.ss_flags & SS_DISABLE) {
    if (!zyx_t.alt && !(zyx_t.alt = malloc(ZYX_ALT_BYTES))) return ENOMEM;
    stack_t mine; memset(&mine, 0, sizeof mine);
    mine.ss_sp = zyx_t.alt; mine.ss_size = ZYX_ALT_BYTES; mine.ss_flags = 0;
    if (sigaltstack(&mine, 0) != 0) return errno ? errno : -1;
  }
  zyx_cur = c;
  return 0;
}

static void zyx_leave(void) { zyx_cur = 0; }

static char* zyx_stacks(int n, unsigned long stride) {
  ZyxThread& t = zyx_t;
  if (t.stacks && t.nstacks >= n && t.stride == stride) return t.stacks;
  int want = 32;
  while (want < n) want *= 2;
  if (t.stacks) { munmap(t.stacks, t.stacks_len); t.stacks = 0; t.nstacks = 0; }
  unsigned long len = (unsigned long)want * stride;
  void* p = mmap(0, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return 0;
  long page = sysconf(_SC_PAGESIZE);
  for (int i = 0; i < want; i++) mprotect((char*)p + (unsigned long)i * stride, page, PROT_NONE);
  t.stacks = (char*)p; t.stacks_len = len; t.nstacks = want; t.stride = stride;
  return t.stacks;
}

static void* zyx_scratch(unsigned long bytes) {
  ZyxThread& t = zyx_t;
  if (t.scratch_len < bytes) {
    free(t.scratch);
    t.scratch = malloc(bytes);
    t.scratch_len = t.scratch ? bytes : 0;
  }
  return t.scratch;
}

static unsigned char* zyx_dyn_shared(void) {
  if (!zyx_t.dyn) zyx_t.dyn = (unsigned char*)aligned_alloc(256, ZYX_DYN_CAP);
  return zyx_t.dyn;
}

/* A thread's stacks for more than 32 fibers go back to the system when its stream idles (zyx_emu_trim): each
   stack's guard page is a mapping of its own, and a process may hold only vm.max_map_count (65530) of them. */
extern "C" void zyx_emu_trim(void) {
  ZyxThread& t = zyx_t;
  if (t.stacks && t.nstacks > 32) { munmap(t.stacks, t.stacks_len); t.stacks = 0; t.nstacks = 0; t.stacks_len = 0; }
}

static const zyx_emu_rt zyx_table = {@ABI@, zyx_enter, zyx_leave, zyx_stacks, zyx_scratch, zyx_dyn_shared,
                                     ZYX_DYN_CAP};
extern "C" const zyx_emu_rt* zyx_emu_runtime(void) { return &zyx_table; }

/* memcpy that turns an illegal address into a result (the copy engine: a block may be poisoned between the
   emulator's range check and the copy by another stream's free) */
extern "C" int zyx_emu_guarded_copy(void* dst, const void* src, unsigned long n, zyx_emu_result* res) {
  zyx_emu_ctx c;
  c.res = res;
  if (sigsetjmp(c.jb, 1)) return res->kind;
  int e = zyx_enter(&c);
  if (e) return -e;
  memcpy(dst, src, n);
  zyx_leave();
  return 0;
}
""".replace("@DYN_CAP@", str(DYNAMIC_SHARED_CAPACITY)).replace("@ABI@", str(ABI_VERSION))


# The block runners: every launch of every module runs here, compiled once per set of flags (the fiber state's
# layout depends on them), not once per kernel; a module's wrapper only packs its parameters and the addresses of its
# per-thread builtins (zyx_emu_launch). Bound to the runtime library, whose services it uses.
_RUNNERS = r"""
#include <stdlib.h>
""" + _ABI + _SCHED + r"""
namespace zyx_emu {
static const zyx_emu_rt* rt;
static thread_local Sched* S_uc;  /* the scheduler a ucontext fiber starts with */

static void fiber_main(void* p) {
  Sched* s = (Sched*)p;
  s->body(s->arg);
  Fiber* self = &s->f[s->cur];
  self->state = DONE;
  s->ndone++;
  run_next(s, self);
  __builtin_trap();  /* a finished fiber is never resumed */
}

#ifdef ZYX_EMU_UC
static void fiber_main_uc(void) { fiber_main(S_uc); }
#endif

static void run_block(Sched* s) {
  for (int t = 0; t < s->n; t++) {
    Fiber& f = s->f[t];
    char* top = s->stacks + (unsigned long)(t + 1) * STRIDE;
#ifdef ZYX_EMU_UC
    getcontext(&f.uc);
    f.uc.uc_stack.ss_sp = top - STACK;
    f.uc.uc_stack.ss_size = STACK;
    f.uc.uc_link = 0;
    makecontext(&f.uc, fiber_main_uc, 0);
#else
    void** sp = (void**)top;
    *--sp = (void*)zyx_emu_start;  /* return address of the first switch */
    *--sp = 0;                     /* rbp */
    *--sp = (void*)s;              /* rbx: fiber_main's argument */
    *--sp = (void*)fiber_main;     /* r12 */
    *--sp = 0; *--sp = 0; *--sp = 0;
    f.sp = sp;
#endif
    f.next = t + 1 < s->n ? t + 1 : -1;
    f.state = RUN;
  }
  s->rhead = s->n > 1 ? 1 : -1;
  s->rtail = s->n > 1 ? s->n - 1 : -1;
  s->ndone = 0;
  s->block = Bar{0, s->n, -1, -1, 0};
  for (int w = 0; w < s->nwarps; w++) {
    int lanes = s->n - 32 * w < 32 ? s->n - 32 * w : 32;
    s->warp[w] = Bar{0, lanes, -1, -1, 0};
  }
  enter_thread(s, 0);
#ifdef ZYX_EMU_UC
  swapcontext(&s->main_uc, &s->f[0].uc);
#else
  zyx_emu_swap(&s->main_sp, s->f[0].sp);
#endif
}

static void run_fibers(const zyx_emu_launch* l, zyx_emu_ctx* c) {
  const unsigned* g = l->g;
  int n = (int)(g[3] * g[4] * g[5]);
  Sched* s = (Sched*)rt->scratch(sizeof(Sched));
  char* stacks = s ? rt->stacks(n, STRIDE) : 0;
  if (!s || !stacks) fail_in(c, TRAP, "cuda emulator: out of memory for the fibers of a block");
  s->n = n;
  s->nwarps = (n + 31) / 32;
  s->body = l->body;
  s->arg = l->arg;
  s->stacks = stacks;
  s->tid = l->thread_idx;
  s->ctx = c;
  for (int t = 0; t < n; t++) {
    s->f[t].x = t % g[3]; s->f[t].y = (t / g[3]) % g[4]; s->f[t].z = t / (g[3] * g[4]);
  }
  for (int w = 0; w < s->nwarps; w++) {
    int lanes = n - 32 * w < 32 ? n - 32 * w : 32;
    s->lanes[w] = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1u;
  }
  *l->sched = s;
  S_uc = s;
  unsigned* bi = l->block_idx;
  long long lin = 0;
  for (unsigned bz = 0; bz < g[2]; bz++)
    for (unsigned by = 0; by < g[1]; by++)
      for (unsigned bx = 0; bx < g[0]; bx++) {
        bi[0] = bx; bi[1] = by; bi[2] = bz;
        c->res->block = lin++;
        run_block(s);
      }
}

static void run_plain(const zyx_emu_launch* l, zyx_emu_result* r) {
  const unsigned* g = l->g;
  unsigned *bi = l->block_idx, *ti = l->thread_idx;
  void (*body)(void*) = l->body;
  void* arg = l->arg;
  long long lin = 0;
  for (unsigned bz = 0; bz < g[2]; bz++)
    for (unsigned by = 0; by < g[1]; by++)
      for (unsigned bx = 0; bx < g[0]; bx++) {
        bi[0] = bx; bi[1] = by; bi[2] = bz;
        r->block = lin++;
        int t = 0;
        for (unsigned tz = 0; tz < g[5]; tz++)
          for (unsigned ty = 0; ty < g[4]; ty++)
            for (unsigned tx = 0; tx < g[3]; tx++) {
              ti[0] = tx; ti[1] = ty; ti[2] = tz;
              r->thread = t++;
              body(arg);
            }
      }
}

static int launch(const zyx_emu_launch* l) {
  zyx_emu_ctx ctx;
  zyx_emu_result* res = l->res;
  ctx.res = res;
  res->kind = OK; res->block = -1; res->thread = -1;
  *l->ctx = &ctx;
  *l->sched = 0;
  if (sigsetjmp(ctx.jb, 1) == 0) {
    if (rt->enter(&ctx) != 0) {  /* from here on a fault comes back to the sigsetjmp */
      res->kind = TRAP;
      strcpy(res->detail, "cuda emulator: cannot set up the signal stack");
      *l->ctx = 0;
      return res->kind;
    }
    if (l->shared) memset(rt->dyn_shared(), 0, l->shared);
    for (int i = 0; i < 3; i++) { l->grid_dim[i] = l->g[i]; l->block_dim[i] = l->g[3 + i]; }
    if (l->fibers) run_fibers(l, &ctx); else run_plain(l, res);
  }
  rt->leave();
  *l->sched = 0;
  *l->ctx = 0;
  if (l->flush) fflush(stdout);
  return res->kind;
}
}  // namespace zyx_emu

static zyx_emu_runner zyx_runner = {0, zyx_emu::launch};
extern "C" const zyx_emu_runner* zyx_emu_runner_bind(const zyx_emu_rt* r) {
  zyx_emu::rt = r;
  zyx_runner.rt = r;
  return &zyx_runner;
}
"""


def _vector_types() -> str:
    """CUDA's vector types (``float4``, ``int2``, ...) and their ``make_*`` functions."""
    base = [("char", "signed char", 1), ("uchar", "unsigned char", 1), ("short", "short", 2),
            ("ushort", "unsigned short", 2), ("int", "int", 4), ("uint", "unsigned int", 4), ("long", "long", 8),
            ("ulong", "unsigned long", 8), ("longlong", "long long", 8), ("ulonglong", "unsigned long long", 8),
            ("float", "float", 4), ("double", "double", 8)]
    out = []
    for name, t, size in base:
        for n in (1, 2, 3, 4):
            align = size * (n if n in (1, 2, 4) else 1)
            align = min(align, 16)
            fields = "xyzw"[:n]
            out.append(f"struct __attribute__((aligned({align}))) {name}{n} {{ {t} {', '.join(fields)}; }};")
            args = ", ".join(f"{t} {f}" for f in fields)
            out.append(f"static inline {name}{n} make_{name}{n}({args}) {{ {name}{n} r = {{{', '.join(fields)}}}; "
                       "return r; }")
    return "\n".join(out) + "\n"


def _math() -> str:
    """C's ``<math.h>`` and ``<stdlib.h>`` without libstdc++'s C++ wrappers, plus the overloads those wrappers (and
    CUDA) give: float versions of the math functions, integer arguments as double, mixed arguments promoted to
    double, ``abs`` of every arithmetic type, and the classification functions (not C's macros). The C++ wrappers
    pull in ``<cmath>``: 14 MB of precompiled header, ~20 ms of every module's compile."""
    unary = ("acos asin atan cos sin tan cosh sinh tanh exp log log10 sqrt ceil fabs floor acosh asinh atanh cbrt erf "
             "erfc exp2 expm1 lgamma log1p log2 logb nearbyint rint round tgamma trunc").split()
    to_int = {"ilogb": "int", "lrint": "long", "llrint": "long long", "lround": "long", "llround": "long long"}
    binary = "atan2 pow fmod copysign fdim fmax fmin hypot nextafter remainder".split()
    classify = {"isnan": "bool", "isinf": "bool", "isfinite": "bool", "signbit": "bool", "isnormal": "bool",
                "fpclassify": "int"}
    out = ["#define _GLIBCXX_INCLUDE_NEXT_C_HEADERS", "#include <math.h>", "#include <stdlib.h>",
           "#undef _GLIBCXX_INCLUDE_NEXT_C_HEADERS",
           "namespace zyx_emu {",
           "template <class T> struct is_int { enum { v = 0 }; };",
           *(f"template <> struct is_int<{t}> {{ enum {{ v = 1 }}; }};" for t in (
               "bool", "char", "signed char", "unsigned char", "short", "unsigned short", "int", "unsigned", "long",
               "unsigned long", "long long", "unsigned long long")),
           "template <class T> struct is_num { enum { v = is_int<T>::v }; };",
           "template <> struct is_num<float> { enum { v = 1 }; };",
           "template <> struct is_num<double> { enum { v = 1 }; };",
           "template <bool B, class T> struct when {};",
           "template <class T> struct when<true, T> { typedef T type; };",
           "}  // namespace zyx_emu",
           "#define ZYX_EMU_INT(T, R) \\\n"
           "  template <class T> static inline typename zyx_emu::when<zyx_emu::is_int<T>::v, R>::type",
           "#define ZYX_EMU_NUM2(A, B) template <class A, class B> static inline typename zyx_emu::when<"
           "zyx_emu::is_num<A>::v && zyx_emu::is_num<B>::v, double>::type"]
    for f in unary:
        out.append(f"static inline float {f}(float x) {{ return {f}f(x); }} "
                   f"ZYX_EMU_INT(T, double) {f}(T x) {{ return {f}((double)x); }}")
    for f, r in to_int.items():
        out.append(f"static inline {r} {f}(float x) {{ return {f}f(x); }} "
                   f"ZYX_EMU_INT(T, {r}) {f}(T x) {{ return {f}((double)x); }}")
    for f in binary:
        out.append(f"static inline float {f}(float x, float y) {{ return {f}f(x, y); }} "
                   f"ZYX_EMU_NUM2(A, B) {f}(A x, B y) {{ return {f}((double)x, (double)y); }}")
    out += ["static inline float fma(float x, float y, float z) { return fmaf(x, y, z); }",
            "static inline float frexp(float x, int* e) { return frexpf(x, e); }",
            "static inline float ldexp(float x, int e) { return ldexpf(x, e); }",
            "static inline float scalbn(float x, int e) { return scalbnf(x, e); }",
            "static inline float scalbln(float x, long e) { return scalblnf(x, e); }",
            "static inline float modf(float x, float* i) { return modff(x, i); }",
            "static inline float remquo(float x, float y, int* q) { return remquof(x, y, q); }",
            "static inline float abs(float x) { return fabsf(x); }",
            "static inline double abs(double x) { return fabs(x); }",
            "static inline long abs(long x) { return labs(x); }",
            "static inline long long abs(long long x) { return llabs(x); }"]
    for f, r in classify.items():
        args = "FP_NAN, FP_INFINITE, FP_NORMAL, FP_SUBNORMAL, FP_ZERO, x" if f == "fpclassify" else "x"
        out += [f"#undef {f}", *(f"static inline {r} {f}({t} x) {{ return __builtin_{f}({args}); }}"
                                 for t in ("float", "double")),
                f"ZYX_EMU_INT(T, {r}) {f}(T x) {{ return {f}((double)x); }}"]
    return "\n".join(out) + "\n"


_HEADER = r"""
#include <stdint.h>
#include <stdio.h>
#include <string.h>
""" + _math() + _ABI + r"""
""" + _vector_types() + r"""struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int a = 1, unsigned int b = 1, unsigned int c = 1) : x(a), y(b), z(c) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};
static thread_local uint3 threadIdx, blockIdx;
static thread_local dim3 blockDim, gridDim;
static constexpr int warpSize = 32;

#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __grid_constant__
#define __noinline__ __attribute__((noinline))
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __maxnreg__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static thread_local

""" + _SCHED + r"""

namespace zyx_emu {
static const zyx_emu_runner* runner;  /* set by zyx_emu_bind when the module is loaded */
static const zyx_emu_rt* rt;
static thread_local Sched* S;        /* the fiber scheduler of this thread's launch (null: plain calls) */
static thread_local zyx_emu_ctx* C;  /* this thread's launch */

__attribute__((noreturn)) static inline void fail(int kind, const char* detail) { fail_in(C, kind, detail); }

template <class F> static void tramp(void* p) { (*(F*)p)(); }

/* Run body (one CUDA thread) over the grid g (grid x, y, z, block x, y, z) in the runtime library. */
static int launch(bool fibers, void (*body)(void*), void* arg, const unsigned* g, unsigned long long shared,
                  zyx_emu_result* res, bool flush) {
  if (runner == 0) {
    res->kind = TRAP; res->block = -1; res->thread = -1;
    strcpy(res->detail, "cuda emulator: module not bound to the runtime");
    return res->kind;
  }
  zyx_emu_launch l = {body, arg, {g[0], g[1], g[2], g[3], g[4], g[5]}, shared, res, fibers, flush,
                      &threadIdx.x, &blockIdx.x, &blockDim.x, &gridDim.x, &S, &C};
  return runner->launch(&l);
}

template <int I, class... A> struct Nth;
template <class H, class... T> struct Nth<0, H, T...> { typedef H type; };
template <int I, class H, class... T> struct Nth<I, H, T...> { typedef typename Nth<I - 1, T...>::type type; };
template <class K, int I> struct Param;
template <class... A, int I> struct Param<void (*)(A...), I> { typedef typename Nth<I, A...>::type type; };

template <class T> static inline unsigned long long bits_of(T v) {
  static_assert(sizeof(T) <= 8, "warp collectives exchange values of at most 8 bytes");
  unsigned long long b = 0; memcpy(&b, &v, sizeof(T)); return b;
}

static inline Sched* sched(const char* what) {
  Sched* s = S;
  if (!s) fail(TRAP, what);
  return s;
}

/* Publish v for this lane, wait for the warp; returns the warp's row of published values. */
static inline unsigned long long* warp_exchange(unsigned mask, unsigned long long v, int* lane, int* base) {
  Sched* s = sched("cuda emulator: warp collective in a kernel run without fibers");
  int t = s->cur, w = t >> 5;
  if ((mask & s->lanes[w]) != s->lanes[w]) {
    char msg[120];
    snprintf(msg, sizeof msg, "warp collective with mask %#x: the emulator needs every lane of the warp (%#x)",
             mask, s->lanes[w]);
    fail(TRAP, msg);
  }
  Bar* b = &s->warp[w];
  unsigned p = b->gen & 1u;
  s->slots[p][t] = v;
  bar_wait(s, b, WAIT_WARP);
  *lane = t & 31;
  *base = w << 5;
  return s->slots[p];
}

template <class T> static inline T shuffle_from(unsigned mask, T v, int mode, int arg, int width) {
  int lane, base;
  unsigned long long* row = warp_exchange(mask, bits_of(v), &lane, &base);
  int seg = lane & ~(width - 1), src;
  if (mode == 0) src = lane ^ arg, src = src >= seg + width ? lane : src;           /* xor */
  else if (mode == 1) src = (lane & (width - 1)) + arg >= width ? lane : lane + arg;  /* down */
  else if (mode == 2) src = (lane & (width - 1)) < arg ? lane : lane - arg;          /* up */
  else src = seg + (arg & (width - 1));                                               /* indexed */
  int st = base + src;
  if (src < 0 || src > 31 || st >= S->n) st = base + lane;
  T r; memcpy(&r, &row[st], sizeof(T));
  return r;
}

static inline unsigned ballot(unsigned mask, int pred) {
  int lane, base;
  unsigned long long* row = warp_exchange(mask, pred != 0, &lane, &base);
  unsigned r = 0;
  int n = S->n - base < 32 ? S->n - base : 32;
  for (int i = 0; i < n; i++) r |= (unsigned)row[base + i] << i;
  return r;
}

template <class T> static inline T warp_reduce(unsigned mask, T v, int op) {
  int lane, base;
  unsigned long long* row = warp_exchange(mask, bits_of(v), &lane, &base);
  int n = S->n - base < 32 ? S->n - base : 32;
  T r; memcpy(&r, &row[base], sizeof(T));
  for (int i = 1; i < n; i++) {
    T x; memcpy(&x, &row[base + i], sizeof(T));
    r = op == 0 ? (T)(r + x) : op == 1 ? (x < r ? x : r) : op == 2 ? (x > r ? x : r)
      : op == 3 ? (T)(r & x) : op == 4 ? (T)(r | x) : (T)(r ^ x);
  }
  return r;
}

static inline int block_count(int pred) {
  Sched* s = sched("cuda emulator: __syncthreads in a kernel run without fibers");
  unsigned p = s->block.gen & 1u;
  if (s->block.count == 0) s->acc[p] = 0;
  s->acc[p] += pred != 0;
  bar_wait(s, &s->block, WAIT_BLOCK);
  return (int)s->acc[p];
}

template <class T> struct id { typedef T type; };
template <class T, class F> static inline T atomic_rmw(T* a, F f) {
  T old;
  memcpy(&old, a, sizeof(T));
  for (;;) {
    T nv = f(old);
    if (__atomic_compare_exchange(a, &old, &nv, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return old;
  }
}

static inline unsigned short f2h(float f) {
  unsigned int u; memcpy(&u, &f, 4);
  unsigned int sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return (unsigned short)(sign | (a > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);
  if (a < 0x38800000u) {
    int e = (int)(a >> 23);
    if (e < 102) return (unsigned short)sign;
    unsigned int m = (a & 0x7fffffu) | 0x800000u, shift = (unsigned)(126 - e);
    unsigned int q = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (unsigned short)(sign | q);
  }
  unsigned int r = a - 0x38000000u;
  r += 0xfffu + ((r >> 13) & 1u);
  return (unsigned short)(sign | (r >> 13));
}
static inline float h2f(unsigned short h) {
  unsigned int s = (unsigned int)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
  if (e == 0x1fu) u = s | 0x7f800000u | (m << 13);
  else if (e) u = s | ((e + 112u) << 23) | (m << 13);
  else { float f = (float)m * 5.9604644775390625e-08f; memcpy(&u, &f, 4); u |= s; }
  float f; memcpy(&f, &u, 4); return f;
}
static inline unsigned short f2bf(float f) {
  unsigned int u; memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)(u >> 16);
}
static inline float bf2f(unsigned short h) {
  unsigned int u = (unsigned int)h << 16; float f; memcpy(&f, &u, 4); return f;
}
}  // namespace zyx_emu

/* ---- CUDA builtins ---- */
struct __half {
  unsigned short __x;
  __half() = default;
  __half(float f) : __x(zyx_emu::f2h(f)) {}
  __half(double f) : __x(zyx_emu::f2h((float)f)) {}
  __half(int i) : __x(zyx_emu::f2h((float)i)) {}
  operator float() const { return zyx_emu::h2f(__x); }
};
typedef __half half;
struct __nv_bfloat16 {
  unsigned short __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) : __x(zyx_emu::f2bf(f)) {}
  __nv_bfloat16(double f) : __x(zyx_emu::f2bf((float)f)) {}
  __nv_bfloat16(int i) : __x(zyx_emu::f2bf((float)i)) {}
  operator float() const { return zyx_emu::bf2f(__x); }
};
typedef __nv_bfloat16 nv_bfloat16;
static inline float __half2float(__half h) { return (float)h; }
static inline __half __float2half(float f) { return __half(f); }
static inline __half __float2half_rn(float f) { return __half(f); }
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }
static inline __half __ushort_as_half(unsigned short u) { __half h; h.__x = u; return h; }
static inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
static inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }

static inline void __syncthreads() {
  zyx_emu::Sched* s = zyx_emu::sched("cuda emulator: __syncthreads in a kernel run without fibers");
  zyx_emu::bar_wait(s, &s->block, zyx_emu::WAIT_BLOCK);
}
static inline int __syncthreads_count(int p) { return zyx_emu::block_count(p); }
static inline int __syncthreads_and(int p) { return zyx_emu::block_count(p) == zyx_emu::S->n; }
static inline int __syncthreads_or(int p) { return zyx_emu::block_count(p) != 0; }
static inline void __syncwarp(unsigned mask = 0xffffffffu) { int l, b; zyx_emu::warp_exchange(mask, 0, &l, &b); }
template <class T> static inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return zyx_emu::shuffle_from(mask, v, 0, lane_mask, width);
}
template <class T> static inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return zyx_emu::shuffle_from(mask, v, 1, (int)delta, width);
}
template <class T> static inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return zyx_emu::shuffle_from(mask, v, 2, (int)delta, width);
}
template <class T> static inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
  return zyx_emu::shuffle_from(mask, v, 3, src, width);
}
static inline unsigned __ballot_sync(unsigned mask, int pred) { return zyx_emu::ballot(mask, pred); }
static inline int __any_sync(unsigned mask, int pred) { return zyx_emu::ballot(mask, pred) != 0; }
static inline int __all_sync(unsigned mask, int pred) {
  unsigned b = zyx_emu::ballot(mask, pred);
  return b == zyx_emu::S->lanes[zyx_emu::S->cur >> 5];
}
static inline unsigned __activemask() {
  zyx_emu::Sched* s = zyx_emu::S;
  return s ? s->lanes[s->cur >> 5] : 0xffffffffu;
}
#define ZYX_EMU_WARP_REDUCE(name, op) \
  static inline int name(unsigned m, int v) { return zyx_emu::warp_reduce(m, v, op); } \
  static inline unsigned name(unsigned m, unsigned v) { return zyx_emu::warp_reduce(m, v, op); }
ZYX_EMU_WARP_REDUCE(__reduce_add_sync, 0)
ZYX_EMU_WARP_REDUCE(__reduce_min_sync, 1)
ZYX_EMU_WARP_REDUCE(__reduce_max_sync, 2)
ZYX_EMU_WARP_REDUCE(__reduce_and_sync, 3)
ZYX_EMU_WARP_REDUCE(__reduce_or_sync, 4)
ZYX_EMU_WARP_REDUCE(__reduce_xor_sync, 5)
__attribute__((noreturn)) static inline void __trap() { zyx_emu::fail(zyx_emu::TRAP, "__trap() called"); }
__attribute__((noreturn)) static inline void __brkpt() { zyx_emu::fail(zyx_emu::TRAP, "__brkpt() called"); }
#define assert(e) ((e) ? (void)0 : zyx_emu::fail(zyx_emu::TRAP, "device assert failed: " #e))
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __nanosleep(unsigned) {}
#if defined(__x86_64__)
static inline long long clock64() { return (long long)__builtin_ia32_rdtsc(); }
#endif
template <class T> static inline T __ldg(const T* p) { return *p; }

template <class T> static inline T atomicAdd(T* a, typename zyx_emu::id<T>::type v) {
  return zyx_emu::atomic_rmw(a, [v](T o) { return (T)(o + v); });
}
template <class T> static inline T atomicSub(T* a, typename zyx_emu::id<T>::type v) {
  return zyx_emu::atomic_rmw(a, [v](T o) { return (T)(o - v); });
}
template <class T> static inline T atomicExch(T* a, typename zyx_emu::id<T>::type v) {
  return zyx_emu::atomic_rmw(a, [v](T o) { return v; });
}
template <class T> static inline T atomicMin(T* a, typename zyx_emu::id<T>::type v) {
  return zyx_emu::atomic_rmw(a, [v](T o) { return v < o ? v : o; });
}
template <class T> static inline T atomicMax(T* a, typename zyx_emu::id<T>::type v) {
  return zyx_emu::atomic_rmw(a, [v](T o) { return o < v ? v : o; });
}
template <class T> static inline T atomicAnd(T* a, typename zyx_emu::id<T>::type v) {
  return zyx_emu::atomic_rmw(a, [v](T o) { return (T)(o & v); });
}
template <class T> static inline T atomicOr(T* a, typename zyx_emu::id<T>::type v) {
  return zyx_emu::atomic_rmw(a, [v](T o) { return (T)(o | v); });
}
template <class T> static inline T atomicXor(T* a, typename zyx_emu::id<T>::type v) {
  return zyx_emu::atomic_rmw(a, [v](T o) { return (T)(o ^ v); });
}
template <class T> static inline T atomicCAS(T* a, typename zyx_emu::id<T>::type cmp, typename zyx_emu::id<T>::type v) {
  __atomic_compare_exchange(a, &cmp, &v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return cmp;
}
static inline unsigned atomicInc(unsigned* a, unsigned v) {
  unsigned old = *a, nv;
  do { nv = old >= v ? 0u : old + 1u; } while (!__atomic_compare_exchange(a, &old, &nv, false, __ATOMIC_RELAXED,
                                                                            __ATOMIC_RELAXED));
  return old;
}
static inline unsigned atomicDec(unsigned* a, unsigned v) {
  unsigned old = *a, nv;
  do { nv = (old == 0u || old > v) ? v : old - 1u; } while (!__atomic_compare_exchange(a, &old, &nv, false,
                                                                                        __ATOMIC_RELAXED,
                                                                                        __ATOMIC_RELAXED));
  return old;
}

namespace zyx_emu {
template <class T> static inline T mn(T a, T b) { return b < a ? b : a; }
template <class T> static inline T mx(T a, T b) { return a < b ? b : a; }
static inline float mn(float a, float b) { return fminf(a, b); }
static inline float mx(float a, float b) { return fmaxf(a, b); }
static inline double mn(double a, double b) { return fmin(a, b); }
static inline double mx(double a, double b) { return fmax(a, b); }
}  // namespace zyx_emu
template <class A, class B> static inline auto min(A a, B b) -> decltype(a + b) {
  return zyx_emu::mn((decltype(a + b))a, (decltype(a + b))b);
}
template <class A, class B> static inline auto max(A a, B b) -> decltype(a + b) {
  return zyx_emu::mx((decltype(a + b))a, (decltype(a + b))b);
}
static inline unsigned umin(unsigned a, unsigned b) { return a < b ? a : b; }
static inline unsigned umax(unsigned a, unsigned b) { return a < b ? b : a; }
static inline long long llmin(long long a, long long b) { return a < b ? a : b; }
static inline long long llmax(long long a, long long b) { return a < b ? b : a; }
static inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
static inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return a < b ? b : a; }

#define ZYX_EMU_BITCAST(name, From, To) \
  static inline To name(From v) { To r; memcpy(&r, &v, sizeof r); return r; }
ZYX_EMU_BITCAST(__int_as_float, int, float)
ZYX_EMU_BITCAST(__float_as_int, float, int)
ZYX_EMU_BITCAST(__uint_as_float, unsigned int, float)
ZYX_EMU_BITCAST(__float_as_uint, float, unsigned int)
ZYX_EMU_BITCAST(__longlong_as_double, long long, double)
ZYX_EMU_BITCAST(__double_as_longlong, double, long long)
static inline int __double2hiint(double d) { return (int)(__double_as_longlong(d) >> 32); }
static inline int __double2loint(double d) { return (int)__double_as_longlong(d); }
static inline double __hiloint2double(int hi, int lo) {
  return __longlong_as_double((long long)(((unsigned long long)(unsigned)hi << 32) | (unsigned)lo));
}

static inline int __popc(unsigned x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
static inline int __clzll(long long x) { return x ? __builtin_clzll((unsigned long long)x) : 64; }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned __brev(unsigned x) {
  unsigned r = 0; for (int i = 0; i < 32; i++) { r = (r << 1) | (x & 1u); x >>= 1; } return r;
}
static inline unsigned long long __brevll(unsigned long long x) {
  unsigned long long r = 0; for (int i = 0; i < 64; i++) { r = (r << 1) | (x & 1u); x >>= 1; } return r;
}
static inline int __mulhi(int a, int b) { return (int)(((long long)a * b) >> 32); }
static inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
static inline long long __mul64hi(long long a, long long b) { return (long long)(((__int128)a * b) >> 64); }
static inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
static inline int __mul24(int a, int b) { return (int)((a << 8) >> 8) * (int)((b << 8) >> 8); }
static inline unsigned __umul24(unsigned a, unsigned b) { return (a & 0xffffffu) * (b & 0xffffffu); }

static inline float zyx_emu_rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double zyx_emu_rsqrt(double x) { return 1.0 / sqrt(x); }
static inline float zyx_emu_rcbrtf(float x) { return 1.0f / cbrtf(x); }
static inline double zyx_emu_rcbrt(double x) { return 1.0 / cbrt(x); }
static inline float zyx_emu_sinpif(float x) { return sinf((float)M_PI * x); }
static inline float zyx_emu_cospif(float x) { return cosf((float)M_PI * x); }
static inline double zyx_emu_sinpi(double x) { return sin(M_PI * x); }
static inline double zyx_emu_cospi(double x) { return cos(M_PI * x); }
static inline float zyx_emu_normcdff(float x) { return 0.5f * erfcf(-x * (float)M_SQRT1_2); }
static inline double zyx_emu_normcdf(double x) { return 0.5 * erfc(-x * M_SQRT1_2); }
static inline float zyx_emu___saturatef(float x) { return x != x ? 0.0f : x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
static inline float zyx_emu___expf(float x) { return expf(x); }
static inline float zyx_emu___exp10f(float x) { return powf(10.0f, x); }
static inline float zyx_emu___logf(float x) { return logf(x); }
static inline float zyx_emu___log2f(float x) { return log2f(x); }
static inline float zyx_emu___log10f(float x) { return log10f(x); }
static inline float zyx_emu___sinf(float x) { return sinf(x); }
static inline float zyx_emu___cosf(float x) { return cosf(x); }
static inline float zyx_emu___tanf(float x) { return tanf(x); }
static inline float zyx_emu___powf(float x, float y) { return powf(x, y); }
static inline void zyx_emu___sincosf(float x, float* s, float* c) { *s = sinf(x); *c = cosf(x); }
#define rsqrtf zyx_emu_rsqrtf
#define rsqrt zyx_emu_rsqrt
#define rcbrtf zyx_emu_rcbrtf
#define rcbrt zyx_emu_rcbrt
#define sinpif zyx_emu_sinpif
#define cospif zyx_emu_cospif
#define sinpi zyx_emu_sinpi
#define cospi zyx_emu_cospi
#define normcdff zyx_emu_normcdff
#define normcdf zyx_emu_normcdf
#define __saturatef zyx_emu___saturatef
#define __expf zyx_emu___expf
#define __exp10f zyx_emu___exp10f
#define __logf zyx_emu___logf
#define __log2f zyx_emu___log2f
#define __log10f zyx_emu___log10f
#define __sinf zyx_emu___sinf
#define __cosf zyx_emu___cosf
#define __tanf zyx_emu___tanf
#define __powf zyx_emu___powf
#define __sincosf zyx_emu___sincosf
static inline float __fdividef(float x, float y) { return x / y; }
static inline float fdividef(float x, float y) { return x / y; }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline float __fsqrt_rn(float x) { return sqrtf(x); }
static inline float __frsqrt_rn(float x) { return 1.0f / sqrtf(x); }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline double __dadd_rn(double a, double b) { return a + b; }
static inline double __dsub_rn(double a, double b) { return a - b; }
static inline double __dmul_rn(double a, double b) { return a * b; }
static inline double __ddiv_rn(double a, double b) { return a / b; }
static inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
static inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
static inline int __float2int_rz(float x) { return (int)x; }
static inline int __float2int_rd(float x) { return (int)floorf(x); }
static inline int __float2int_ru(float x) { return (int)ceilf(x); }
static inline unsigned __float2uint_rn(float x) { return (unsigned)nearbyintf(x); }
static inline unsigned __float2uint_rz(float x) { return (unsigned)x; }
static inline long long __float2ll_rn(float x) { return (long long)nearbyintf(x); }
static inline long long __float2ll_rz(float x) { return (long long)x; }
static inline int __double2int_rn(double x) { return (int)nearbyint(x); }
static inline int __double2int_rz(double x) { return (int)x; }
static inline long long __double2ll_rn(double x) { return (long long)nearbyint(x); }
static inline long long __double2ll_rz(double x) { return (long long)x; }
static inline float __int2float_rn(int x) { return (float)x; }
static inline float __uint2float_rn(unsigned x) { return (float)x; }
static inline double __int2double_rn(int x) { return (double)x; }
static inline float __double2float_rn(double x) { return (float)x; }

extern "C" void zyx_emu_bind(const zyx_emu_runner* r) { zyx_emu::runner = r; zyx_emu::rt = r->rt; }
"""

_STUB_HEADERS = ("cuda.h", "cuda_runtime.h", "cuda_runtime_api.h", "device_launch_parameters.h", "cuda_fp16.h",
                 "cuda_bf16.h", "device_functions.h", "math_constants.h", "cooperative_groups.h")

# ---------------------------------------------------------------------------------------------------------------
# parsing kernel signatures

_SCALAR_SIZES: dict[str, int] = {}
for _size, _names in {
    1: ("bool", "char", "signed char", "unsigned char", "int8_t", "uint8_t"),
    2: ("short", "short int", "signed short", "signed short int", "unsigned short", "unsigned short int", "half",
        "__half", "__nv_bfloat16", "nv_bfloat16", "int16_t", "uint16_t"),
    4: ("int", "signed", "signed int", "unsigned", "unsigned int", "float", "int32_t", "uint32_t"),
    8: ("long", "long int", "signed long", "unsigned long", "unsigned long int", "long long", "long long int",
        "signed long long", "signed long long int", "unsigned long long", "unsigned long long int", "double",
        "size_t", "ssize_t", "ptrdiff_t", "int64_t", "uint64_t", "intptr_t", "uintptr_t"),
}.items():
    for _n in _names:
        _SCALAR_SIZES[_n] = _size
for _name, _size in (("char", 1), ("uchar", 1), ("short", 2), ("ushort", 2), ("int", 4), ("uint", 4), ("long", 8),
                     ("ulong", 8), ("longlong", 8), ("ulonglong", 8), ("float", 4), ("double", 8)):
    for _n in (1, 2, 3, 4):
        _align = min(_size * (_n if _n in (1, 2, 4) else 1), 16)
        _SCALAR_SIZES[f"{_name}{_n}"] = -(-_size * _n // _align) * _align

_QUALIFIERS = frozenset({"const", "volatile", "__restrict__", "__restrict", "restrict", "register",
                         "__grid_constant__"})
_TYPE_WORDS = frozenset(w for n in _SCALAR_SIZES for w in n.split())
_ATTRIBUTE_CALLS = frozenset({"__launch_bounds__", "__cluster_dims__", "__maxnreg__", "__attribute__", "alignas",
                              "__align__", "__declspec"})
_COLLECTIVES = re.compile(r"\b(?:__syncthreads\w*|__syncwarp|__shfl\w*|__ballot_sync|__any_sync|__all_sync"
                          r"|__reduce_\w+_sync)\b")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_EXTERN_SHARED = re.compile(r"\bextern\s+__shared__\s+((?:__align__\s*\(\s*\d+\s*\)|alignas\s*\(\s*\d+\s*\)"
                            r"|[^;\[\]{}()])*?)\b([A-Za-z_]\w*)\s*\[\s*\]\s*;")


def _strip_comments(src: str) -> str:
    """``src`` with comments, string and character literals blanked (same length, newlines kept)."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if c == "/" and src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif c == "/" and src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(ch if ch == "\n" else " " for ch in src[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and src[j] != c and src[j] != "\n":
                j += 2 if src[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + " " * (j - i - 2) + c if j - i >= 2 else " " * (j - i))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _match(code: str, i: int, open_: str, close: str) -> int:
    """Index just past the bracket closing the one at ``code[i]``; -1 if unbalanced."""
    depth = 0
    for j in range(i, len(code)):
        if code[j] == open_:
            depth += 1
        elif code[j] == close:
            depth -= 1
            if depth == 0:
                return j + 1
    return -1


def _split_params(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "(<[":
            depth += 1
        elif ch in ")>]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur).strip())
    if parts == [""] or parts == ["void"]:
        return []
    return parts


def _param_size(decl: str, kernel: str, index: int) -> int:
    if "*" in decl or "[" in decl:
        return 8
    words = [w for w in re.findall(r"[A-Za-z_]\w*|\S", decl) if w not in _QUALIFIERS]
    if len(words) > 1 and _IDENT.fullmatch(words[-1]) and words[-1] not in _TYPE_WORDS:
        words = words[:-1]  # the parameter's name
    t = " ".join(words)
    if "&" in decl or t not in _SCALAR_SIZES:
        raise EmulatorCompileError(f"kernel {kernel}: parameter {index} ({decl.strip()!r}) has a type the CUDA "
                                   "emulator does not know (pointers and scalar types only)")
    return _SCALAR_SIZES[t]


@dataclass(frozen=True)
class _Signature:
    name: str
    param_sizes: tuple[int, ...]
    body: tuple[int, int]  # span of the body in the comment-stripped source


def _parse(code: str) -> list[_Signature]:
    """Every ``__global__`` function definition of the (comment-stripped) source, in order."""
    sigs: list[_Signature] = []
    for m in re.finditer(r"\b__global__\b", code):
        line = code[code.rfind("\n", 0, m.start()) + 1:m.start()]
        if line.lstrip().startswith("#"):
            continue  # inside a macro definition: kernels spelled through macros are not found
        start = max(code.rfind(";", 0, m.start()), code.rfind("}", 0, m.start()), code.rfind("{", 0, m.start()),
                    code.rfind("\n#", 0, m.start()))
        if re.search(r"\btemplate\b", code[start + 1:m.start()]):
            continue  # a template is launchable only once instantiated: not supported
        i, words, name = m.end(), [], None
        while True:
            w = _IDENT.match(code, i) or re.compile(r"\s+").match(code, i)
            if w is None:
                break
            tok = w.group(0)
            i = w.end()
            if tok.isspace():
                continue
            j = i
            while j < len(code) and code[j].isspace():
                j += 1
            if j < len(code) and code[j] == "(":
                if tok in _ATTRIBUTE_CALLS:
                    i = _match(code, j, "(", ")")
                    if i < 0:
                        break
                    continue
                name, i = tok, j
                break
            words.append(tok)
        if name is None:
            raise EmulatorCompileError(f"cannot parse the __global__ function at offset {m.start()}")
        if "void" not in words:
            raise EmulatorCompileError(f"kernel {name}: a __global__ function must return void")
        end = _match(code, i, "(", ")")
        if end < 0:
            raise EmulatorCompileError(f"kernel {name}: unbalanced parentheses in its parameter list")
        rest = code[end:].lstrip()
        if not rest.startswith("{"):
            continue  # a declaration; the definition comes elsewhere
        body_start = end + (len(code) - end - len(rest))
        body_end = _match(code, body_start, "{", "}")
        if body_end < 0:
            raise EmulatorCompileError(f"kernel {name}: unbalanced braces in its body")
        params = _split_params(code[i + 1:end - 1])
        sizes = tuple(_param_size(p, name, k) for k, p in enumerate(params))
        if any(s.name == name for s in sigs):
            raise EmulatorCompileError(f"kernel {name}: defined twice (overloaded kernels are not supported)")
        sigs.append(_Signature(name, sizes, (body_start, body_end)))
    return sigs


def _rewrite_extern_shared(src: str) -> str:
    def repl(m: re.Match) -> str:
        t = re.sub(r"\b(?:__align__|alignas)\s*\(\s*\d+\s*\)", " ", m.group(1)).strip()
        return f"static thread_local {t}* const {m.group(2)} = ({t}*)zyx_emu::rt->dyn_shared();"

    out = _EXTERN_SHARED.sub(repl, src)
    if re.search(r"\bextern\s+__shared__\b", _strip_comments(out)):
        raise EmulatorCompileError("an extern __shared__ declaration the CUDA emulator does not support "
                                   "(only `extern __shared__ T name[];`)")
    return out


# ---------------------------------------------------------------------------------------------------------------
# compiling


@functools.lru_cache(maxsize=1)
def _compiler() -> tuple[str, str]:
    path = shutil.which("g++")
    if path is None:
        raise EmulatorCompileError("the CUDA emulator needs g++ (not found on PATH)")
    path = os.path.realpath(path)
    try:
        r = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
        version = (r.stdout or r.stderr).splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError) as e:
        raise EmulatorCompileError(f"cannot run g++ ({path}): {e}") from e
    return path, version


def _flags() -> tuple[str, ...]:
    extra = ("-DZYX_EMU_UCONTEXT",) if os.environ.get("ZYX_CUDA_EMULATOR_UCONTEXT") == "1" else ()
    return FLAGS + _ARCH_FLAGS + extra


def _emu_dir() -> Path:
    return cache_dir() / "cuda_emulator"


def _link_direct(obj: str, out: str) -> bool:
    """Link ``obj`` into the shared library ``out`` with g++'s linker alone; whether that library loads."""
    return link_directly(linker_of(_compiler()[0]), obj, out)


def _compile(args: list[str], what: str, src: Path) -> None:
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        log = (r.stderr or r.stdout).strip()
        raise EmulatorCompileError(f"g++ rejected {what} (emulator source {src}):\n{log[:4000]}")


@functools.cache
def _header(flags: tuple[str, ...]) -> Path:
    """The runtime header on disk (stub CUDA headers beside it) and, when g++ manages, its precompiled form
    (``zyx_emu.h.gch``, which g++ uses whenever it matches the flags: ~40% off each module's compile time)."""
    gxx, version = _compiler()
    key = hashlib.sha256("\0".join((_HEADER, gxx, version, " ".join(flags), platform.machine())).encode())
    d = _emu_dir() / f"include-{key.hexdigest()[:24]}"
    h = d / "zyx_emu.h"
    if not h.exists():
        d.mkdir(parents=True, exist_ok=True)
        for stub in _STUB_HEADERS:
            write_atomic(d / stub, "/* zyx CUDA emulator: the runtime header defines what it supports */\n")
        write_atomic(h, _HEADER)
    precompile_header(gxx, flags, h, "c++-header")
    return h


def _build(body: str, what: str, with_header: bool = True) -> Path:
    """Compile the C++ ``body`` (after the runtime header when ``with_header``) into a shared library, or take it
    from the disk cache (key: sha256 of the whole C++, the compiler and its flags); returns its path."""
    gxx, version = _compiler()
    flags = _flags()
    full = (_HEADER if with_header else "") + body
    key = hashlib.sha256("\0".join((full, gxx, version, " ".join(flags + LINK_FLAGS + LD_FLAGS),
                                    platform.machine())).encode()).hexdigest()
    d = _emu_dir()
    so = d / f"{key[:32]}.so"
    if so.exists():
        return so
    d.mkdir(parents=True, exist_ok=True)
    src = d / f"{key[:32]}.cpp"
    args = [gxx, *flags]
    if with_header:
        h = _header(flags)
        args += ["-I", str(h.parent)]
        write_atomic(src, f'#include "{h}"\n' + body)
    else:
        write_atomic(src, body)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=d)
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        _compile([*args, "-pipe", "-c", str(src), "-o", obj], what, src)
        if not _link_direct(obj, tmp):
            _compile([gxx, *flags, obj, *LINK_FLAGS, "-o", tmp], what, src)
        os.replace(tmp, so)
    finally:
        for f in (tmp, obj):
            if os.path.exists(f):
                os.unlink(f)
    return so


_RT_LOCK = threading.Lock()
_RT: list = []  # [CDLL, table pointer] once loaded


def _runtime() -> int:
    """Address of the process's runtime table (the one signal handler, per-thread stacks and buffers)."""
    with _RT_LOCK:
        if not _RT:
            lib = ctypes.CDLL(str(_build(_RUNTIME, "the CUDA emulator runtime", with_header=False)))
            fn = lib.zyx_emu_runtime
            fn.argtypes, fn.restype = [], ctypes.c_void_p
            copy = lib.zyx_emu_guarded_copy
            copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulong, ctypes.POINTER(_Result)]
            copy.restype = ctypes.c_int
            trim = lib.zyx_emu_trim
            trim.argtypes, trim.restype = [], None
            _RT.extend([lib, fn(), copy, trim])
        return _RT[1]


_RUNNER_LIBS: dict[tuple[str, ...], tuple[ctypes.CDLL, int]] = {}  # flags -> (library, its bound runner table)


def _runner() -> int:
    """Address of the block runners' table for the current flags, bound to the process's runtime."""
    rt = _runtime()
    flags = _flags()
    with _RT_LOCK:
        if flags not in _RUNNER_LIBS:
            lib = ctypes.CDLL(str(_build(_RUNNERS, "the CUDA emulator's block runners", with_header=False)))
            bind = lib.zyx_emu_runner_bind
            bind.argtypes, bind.restype = [ctypes.c_void_p], ctypes.c_void_p
            _RUNNER_LIBS[flags] = (lib, bind(rt))
        return _RUNNER_LIBS[flags][1]


def trim_thread() -> None:
    """Give back this OS thread's large fiber-stack block (kept between launches; a stream calls this when it
    runs out of work, so idle threads hold no more than 32 stacks' mappings)."""
    if _RT:
        _RT[3]()


def guarded_copy(dst: int, src: int, nbytes: int) -> Fault | None:
    """``memcpy(dst, src, nbytes)`` on this OS thread; an illegal address is a ``Fault`` (the process goes on)."""
    _runtime()
    res = _Result()
    kind = _RT[2](dst, src, nbytes, ctypes.byref(res))
    if kind == 0:
        return None
    if kind < 0:
        raise OSError(-kind, "the CUDA emulator could not arm its fault handler for a copy")
    return Fault(_KINDS.get(kind, "address"), int(res.addr), f"illegal address {res.addr:#x} in a copy")


# ---------------------------------------------------------------------------------------------------------------
# modules and kernels


def _unravel(i: int, dims: tuple[int, int, int]) -> tuple[int, int, int]:
    return i % dims[0], (i // dims[0]) % dims[1], i // (dims[0] * dims[1])


class KernelFunction:
    """One ``__global__`` function of an ``EmulatedModule``; ``run`` launches it."""

    def __init__(self, module: EmulatedModule, name: str, param_sizes: tuple[int, ...], fibers: bool,
                 fn: Any) -> None:
        self.module = module
        self.name = name
        self.param_sizes = param_sizes
        self.uses_fibers = fibers
        self._fn = fn

    def __repr__(self) -> str:
        return f"KernelFunction({self.name!r}, param_sizes={self.param_sizes}, fibers={self.uses_fibers})"

    def run(self, params: Sequence[bytes], grid: tuple[int, int, int], block: tuple[int, int, int],
            shared_bytes: int = 0) -> Fault | None:
        """Run every block of ``grid`` (each of ``block`` threads) on this OS thread; None, or the Fault that
        stopped the launch. ``params[i]`` holds the bytes of parameter i. Raises ValueError for a launch CUDA
        would reject (geometry, parameter sizes, shared memory)."""
        if len(params) != len(self.param_sizes):
            raise ValueError(f"kernel {self.name} takes {len(self.param_sizes)} parameters, got {len(params)}")
        for i, (p, n) in enumerate(zip(params, self.param_sizes)):
            if len(p) != n:
                raise ValueError(f"kernel {self.name}: parameter {i} must be {n} bytes, got {len(p)}")
        g = tuple(int(x) for x in grid)
        b = tuple(int(x) for x in block)
        if (len(g) != 3 or len(b) != 3 or any(not 1 <= x <= lim for x, lim in zip(g, MAX_GRID))
                or any(not 1 <= x <= lim for x, lim in zip(b, MAX_BLOCK))
                or b[0] * b[1] * b[2] > MAX_THREADS_PER_BLOCK):
            raise ValueError(f"invalid launch geometry for kernel {self.name}: grid={grid} block={block}")
        shared = int(shared_bytes)
        if not 0 <= shared <= DYNAMIC_SHARED_CAPACITY:
            raise ValueError(f"kernel {self.name}: {shared} bytes of dynamic shared memory (the emulator has "
                             f"{DYNAMIC_SHARED_CAPACITY})")
        res = _Result()
        kind = self._fn(b"".join(params), *g, *b, shared, ctypes.byref(res))
        if kind == 0:
            return None
        return self._fault(kind, res, g, b)

    def _fault(self, kind: int, res: _Result, g: tuple[int, ...], b: tuple[int, ...]) -> Fault:
        where = ""
        if res.block >= 0:
            where = f" in block {_unravel(res.block, g)}"  # type: ignore[arg-type]
            if res.thread >= 0 and kind != 3:
                where += f" thread {_unravel(res.thread, b)}"  # type: ignore[arg-type]
        name = _KINDS.get(kind, "trap")
        if name == "address":
            sig = "SIGSEGV" if res.sig == signal.SIGSEGV else "SIGBUS"
            return Fault(name, int(res.addr), f"illegal address {res.addr:#x} ({sig}){where}")
        if name == "arithmetic":
            what = {1: "integer division by zero", 2: "integer overflow"}.get(res.code, "arithmetic exception")
            return Fault(name, 0, f"{what} (SIGFPE){where}")
        return Fault(name, 0, res.detail.decode(errors="replace") + where)


class EmulatedModule:
    """The ``__global__`` functions of one CUDA C source, compiled for the CPU (``functions`` by name)."""

    def __init__(self, source: str) -> None:
        self.source = source
        code = _strip_comments(source)
        sigs = _parse(code)
        names = ", ".join(s.name for s in sigs) or "<none>"
        bodies = [code[s.body[0]:s.body[1]] for s in sigs]
        outside = code
        for s in sorted(sigs, key=lambda s: -s.body[0]):
            outside = outside[:s.body[0]] + outside[s.body[1]:]
        helpers_sync = bool(_COLLECTIVES.search(outside))
        fibers = [helpers_sync or bool(_COLLECTIVES.search(b)) for b in bodies]
        body_src = _rewrite_extern_shared(source)
        file = sigs[0].name if sigs else "module"
        wrappers = []
        for i, (s, fib) in enumerate(zip(sigs, fibers)):
            lines = [f'extern "C" int zyx_emu_launch_{i}(const unsigned char* args, unsigned gx, unsigned gy, '
                     "unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned long long shared, "
                     "zyx_emu_result* res) {",
                     f"  typedef decltype(&{s.name}) K;"]
            off = 0
            for j, n in enumerate(s.param_sizes):
                lines.append(f"  zyx_emu::Param<K, {j}>::type a{j}; static_assert(sizeof(a{j}) == {n}, "
                             f'"zyx cuda emulator: parameter {j} of {s.name} is not {n} bytes"); '
                             f"memcpy((void*)&a{j}, args + {off}, {n});")
                off += n
            call = ", ".join(f"a{j}" for j in range(len(s.param_sizes)))
            lines += [f"  auto body = [&]() {{ {s.name}({call}); }};",
                      "  const unsigned g[6] = {gx, gy, gz, bx, by, bz};",
                      f"  return zyx_emu::launch({'true' if fib else 'false'}, &zyx_emu::tramp<decltype(body)>, "
                      f"&body, g, shared, res, {'true' if 'printf' in code else 'false'});",
                      "}"]
            wrappers.append("\n".join(lines))
        cpp = f'#line 1 "{file}.cu"\n' + body_src + '\n#line 1 "zyx_emu_wrappers"\n' + "\n".join(wrappers) + "\n"
        self.path = _build(cpp, f"CUDA kernel(s) {names}")
        lib = ctypes.CDLL(str(self.path))
        bind = lib.zyx_emu_bind
        bind.argtypes, bind.restype = [ctypes.c_void_p], None
        bind(_runner())
        self._lib = lib
        self.functions: dict[str, KernelFunction] = {}
        for i, (s, fib) in enumerate(zip(sigs, fibers)):
            fn = getattr(lib, f"zyx_emu_launch_{i}")
            fn.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 6 + [ctypes.c_ulonglong, ctypes.POINTER(_Result)]
            fn.restype = ctypes.c_int
            self.functions[s.name] = KernelFunction(self, s.name, s.param_sizes, fib, fn)

    def global_address(self, name: str) -> int | None:
        """Address of a namespace-scope ``__device__`` / ``__constant__`` variable (None if not exported)."""
        try:
            return ctypes.addressof(ctypes.c_char.in_dll(self._lib, name))
        except ValueError:
            return None


def signatures(source: str) -> dict[str, tuple[int, ...]]:
    """The parameter sizes of every ``__global__`` function of ``source``, without compiling it."""
    return {s.name: s.param_sizes for s in _parse(_strip_comments(source))}


_CACHE: dict[str, EmulatedModule] = {}
_CACHE_LOCK = threading.Lock()
_SOURCE_LOCKS: dict[str, threading.Lock] = {}


def compile_module(source: str) -> EmulatedModule:
    """The ``EmulatedModule`` of ``source``, compiled once per process (and cached on disk across processes)."""
    with _CACHE_LOCK:
        mod = _CACHE.get(source)
        if mod is not None:
            return mod
        lock = _SOURCE_LOCKS.setdefault(source, threading.Lock())
    with lock:
        with _CACHE_LOCK:
            mod = _CACHE.get(source)
        if mod is not None:
            return mod
        try:
            mod = EmulatedModule(source)
        finally:
            with _CACHE_LOCK:
                if mod is not None:
                    _CACHE[source] = mod
                _SOURCE_LOCKS.pop(source, None)
        return mod

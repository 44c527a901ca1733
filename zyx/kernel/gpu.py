"""GPU launch geometry: map a kernel's output loops and reductions onto a CUDA grid of thread blocks.

``optimize(kernel, info)`` runs the GPU passes (``GPU_PASSES``), each a function from kernel to kernel: ``normalize``
(unit loops dropped, host annotations cleared), ``split_segments`` (cat's pieces as ``Kernel.then``), ``merge_loops``,
``merge_reduces`` (a reduce of a reduce of the same op as one), ``split_contraction_loops`` (a loop split where
that reveals a contraction), ``order_reduce_ranges``, ``order_output_loops``
(loop order, below), ``choose_layout`` (the strategy, the split of the loops between work items, group lanes and
serial loops, the block), ``vectorize`` (outputs per thread of the ``thread`` layout), ``size_grid`` (the grid;
one block for all segments) and ``widen_accumulators``. The launch is
the kernel's ``launch`` field (a ``Geometry``, part of the kernel's identity), not a side table; ``render_cuda``
follows it. The passes in ``OPTIONAL_PASSES`` change only speed, and tests run with each switched off
(``DISABLED``).

Terms (``linearize`` places every statement in the block of the innermost loop it depends on):

- depth ``d`` block: the body of output loop ``d - 1`` (depth 0 = the kernel's root block);
- *top-level reduce*: a ``Reduce`` statement in an output-loop block (not inside another reduce's loops);
  its depth is its block's depth, ``s`` is the smallest such depth (``n = len(loops)`` when there is none).

Strategies (every kernel gets one; each is correct for every kernel it is chosen for):

``thread``  one thread per iteration of all output loops (all but the innermost for a scan, which runs serially
            in the thread), flattened into one index ``gid`` (decoded by
            ``//`` and ``%``); a grid-stride loop covers any size. Chosen when there is no reduce, or when every
            top-level reduce is at the innermost depth (``s == n``), each load in the reduce bodies is the same
            or the next element for adjacent outputs (coalesced across threads), and there are enough outputs to
            fill the GPU. Reduces run serially in the thread. A kernel without reduces or scans may compute
            ``vector`` consecutive outputs of the innermost loop per thread (``plan_vector``): then each load
            and store whose index steps by one along that loop and is provably aligned is one 16-byte (or
            narrower) vector access (``float4``, ``uint4`` of 8 halves, ``double2``), the others stay scalar.
``tile``    a kernel without reduces or scans that reads some buffer transposed (``tile_loads``: contiguous along
            the next-to-innermost output loop ``i``, a stride apart along the innermost ``j``, which the stores
            step along by one; both loops at least ``TILE`` long): one block of ``TILE x TILE_ROWS`` threads per
            ``TILE x TILE`` tile of ``(i, j)`` (and iteration of the outer loops; grid-stride). Each staged load
            is read with lanes along ``i`` into a ``__shared__ [TILE][TILE + 1]`` array (the extra column keeps
            the column reads on distinct banks), ``__syncthreads``; then lanes along ``j`` compute the outputs,
            reading the staged loads from the tile and writing coalesced; ``__syncthreads`` again before the
            next tile. Both phases check the bounds. Chosen over ``thread`` whenever it applies.
``scatter`` a one-hot sum (``opt.one_hot_sum``: ``out[v, o] = sum_n (index(n) == v ? x(n, o) : 0)``, an
            embedding's or a gather's gradient), turned around as the host's ``opt.scatter_one_hot``: one thread per
            bin of rows ``v`` and iteration of the other output loops (those fastest: a warp's lanes walk ``o``)
            zeroes its rows, then runs the sum's iterations in order and adds ``x(n, o)`` at row ``index(n)``
            when that row is in its bin. Each output element has one writer, so no atomics and no barrier; the
            work is bins times the sum instead of every row times it (``SCATTER_THREADS`` sets the bins). Chosen
            whenever it applies (before every reduce layout, after ``mma``).
``scan``    a kernel whose scans (cumulative sums and products) all run along its innermost loop, at least
            ``SCAN_MIN`` long (``_scan_geometry``): one group of ``G`` lanes (32 to 1024, about ``SCAN_CHUNK``
            elements each) per iteration of the outer loops. Lane ``l`` folds the inputs of its contiguous chunk
            into a total; an inclusive ``__shfl_up_sync`` scan of the totals across the warp, shifted by one lane,
            plus the earlier warps' totals (shared memory) give its exclusive prefix, which starts the running
            value; then the lane runs its chunk as ``thread`` runs the whole loop (elementwise work before and
            after the scan, the stores). Chosen over ``thread`` whenever it applies.
``segments`` a kernel without reduces whose loop splits into segments (``opt.split_segments``: cat's pieces)
            runs one ``thread`` grid-stride loop per segment, one after another in one launch (``Kernel.then``),
            all with the largest block any of them wants.
``columns`` a reduce over a strided axis (every top-level reduce at the innermost depth, ``s == n``): threads
            along the flattened output index, so that adjacent threads (``threadIdx.x``) read adjacent addresses
            when the loads step by one along the innermost output loop (a column sum reads rows). A block is
            ``(TX, TY)``: ``TX`` outputs (a warp's width, fewer for fewer outputs; then one warp spans several
            ``TY`` rows), each accumulated by ``TY`` threads over strided slices of the reduce range; the
            ``TY`` partials are combined through shared memory (``acc_sh[TY][TX]``, read by every thread in one
            order, so a reduce may feed the next) and ``threadIdx.y == 0`` stores. Chosen over ``group`` when its
            loads touch fewer memory sectors per warp (``access_sectors``: the load indices' coefficients of the
            loops that the lanes of one warp walk), and when there are too few outputs for ``thread`` (which is
            this layout with ``TY == 1``, serial per thread). The grid-stride loop steps whole blocks
            (``__syncthreads`` stays uniform); lanes past the last output compute a clamped copy and do not store.
``mma``     a 16-bit contraction (``find_contraction``: the only reduce is ``sum_k a(m, k) * b(k, n)`` of two
            float16 / bfloat16 values cast to float32) on a device with tensor cores of sm_80+: one block of
            ``WM x WN`` warps per ``BM x BN`` output tile (an ``MmaTile``; and batch index), each warp a
            ``BM/WM x BN/WN`` sub-tile of 16x8 ``mma.sync.m16n8k16`` tiles (f32 accumulators in registers). The
            block steps k by ``BK``: its threads evaluate the ``BM x BK`` tile of ``a`` and the ``BK x BN`` tile of
            ``b`` (any expression of the ranges, zero outside the bounds; two adjacent k per 32-bit word) into
            ``__shared__`` arrays ``[S][BM][BK/2 + 4]`` / ``[S][BN][BK/2 + 4]`` (k-pairs innermost: a fragment
            register is one word; ``MmaTile.row_words``; the word columns of a tile filled row-first are
            XOR-swizzled by row, ``mma_swizzle``, so fragment reads and fills spread over the banks), adjacent
            threads along the operand's contiguous axis (``mma_fill_order``), with 16-byte loads of 8 elements
            where provably aligned and in or out of bounds as a whole (``mma_vector_fill``). With ``S = 1`` stage
            a k step fills, ``__syncthreads``, builds fragments from shared memory and issues the mma's,
            ``__syncthreads`` again. With ``S = 2`` (software pipelining, ``Geometry.stages``) the block fills
            buffer 0 before the k loop; step ``s`` issues step ``s + 1``'s global loads into registers, computes
            on buffer ``s % 2``, stores the registers into the other buffer and meets one ``__syncthreads``; the
            math and its order are the same. With ``async_copy`` (16-bit plain-load operands read as whole
            16-byte vectors, ``mma_async_applies``) the tiles are ``cp.async`` copies into a ring of up to 4
            buffers, ``[rows][BK + 8]`` k-first or ``[BK][rows + 8]`` row-first, read by ``ldmatrix`` (``.trans``
            for row-first tiles); no registers stage them. The epilogue (the output
            block's statements and stores) runs per accumulator element inside the bounds. Chosen before every
            other strategy when it applies. A float32 contraction takes this layout only when the device allows
            TF32 (``DeviceInfo.allow_tf32``, sm_80+): the fill rounds each operand to tf32 (``cvt.rna``) into one
            word, ``[BM][BK + pad]`` / ``[BN][BK + pad]``, and the warps issue ``mma.sync.m16n8k8`` tf32 tiles;
            otherwise float32 stays exact FP32 and takes ``simt``.
``simt``    a contraction that tensor cores do not take (``simt_contraction``: float32 without ``allow_tf32``,
            float64, 32- and 64-bit integers; any expressions ``a``, ``b`` of the reduce's dtype): one block of
            256 threads per ``BM x BN`` output tile (a ``SimtTile``; and batch index), each thread ``TM x TN``
            outputs in registers, strided by the block's thread grid (``SimtTile``). The block steps k by ``BK``:
            its threads evaluate the tiles of ``a`` and ``b`` (zero outside the bounds) in the order of the
            operand's contiguous axis (``mma_fill_order``) into ``__shared__`` arrays ``[S][BK][BM + 1]`` /
            ``[S][BK][BN + 1]``, then each thread reads ``TM`` values of ``a`` and ``TN`` of ``b`` per k and
            updates its ``TM x TN`` accumulators (``fma`` in k order: the serial reduce's order and rounding, the
            ``thread`` layout's result). ``S`` stages as ``mma``'s register fill. With ``wide_acc`` the sums are
            float32 partials over ``SIMT_PARTIAL`` k added into float64 accumulators (the host GEMM's scheme).
            Every element of ``a`` is read from global memory ``BN`` times fewer than by one thread per output.
            Chosen after ``mma`` and ``scatter`` when m and n are at least ``SIMT_MIN``, k at least
            ``SIMT_MIN_K``, and its blocks fill at least half the SMs.
``group``   one *group* of ``G`` threads (a warp when ``G == 32``, several warps per block; else one block per
            group) per iteration of output loops ``[0, s)``. The top-level reduces at depth ``s`` are cooperative:
            each thread accumulates a strided slice of the reduce range, then warp shuffles (``__shfl_xor_sync``:
            every lane ends with the same value) and, for ``G > 32``, a shared-memory exchange across warps give
            every thread the result (so a reduce may feed the next one, e.g. softmax, argmax; a butterfly rather
            than ``__shfl_down_sync``, which leaves the result in lane 0 only). Output loops
            ``[s, flat)`` are flattened and strided over the group's threads (the elementwise part of softmax);
            loops ``[flat, n)`` and every deeper reduce run serially in the thread. With ``s == n`` the stores run
            on lane 0. Chosen for every other kernel with a reduce.

Tunable parameters (``search_space`` lists them per kernel, ``optimize(k, info, params)`` takes them; the autotuner
times them): ``strategy`` (an index into ``STRATEGIES``) among the strategies legal for the kernel — ``group``
always when there is a reduce; ``thread`` and ``columns`` when every top-level reduce is at the innermost depth;
``mma`` for a contraction on tensor cores, ``simt`` for one on CUDA cores; ``thread`` and ``tile`` for a kernel
whose reads ``tile_loads``
stages; ``scatter`` for a one-hot sum; ``thread`` and ``scan`` for a long scan — and the sizes ``threads``
(``THREADS_PER_BLOCK``),
``elems_per_thread`` (``ELEMS_PER_THREAD``), ``warps_per_block`` (``WARP_GROUPS_PER_BLOCK``), ``mma_tile``
(an index into ``MMA_TILES``: block tile, k step and warp grid; only those whose shared arrays fit
``info.local_memory_bytes`` and whose block fits the thread limit), ``mma_stages`` (``MMA_STAGES``: 2 double
buffers the tiles; 2 is listed only when some tile fits twice, and the heuristic takes it when its tile does),
``mma_ldmatrix`` (1 / 0: 16-bit fragments of k-first tiles by ``ldmatrix``; listed where it applies),
``mma_async`` (0 / 1: the ``cp.async`` ring; listed where it applies, off by default until measured),
``simt_tile`` (an index into ``SIMT_TILES``, those that fit, ``simt_tiles``), ``simt_stages`` (``SIMT_STAGES``) and
``vector`` (1 / 0: vector accesses of the ``thread`` layout on / off; listed only when some access can be
proven aligned) and ``unroll`` (``UNROLL_CHOICES``: ``#pragma unroll`` of the ``group`` and ``columns`` layouts'
lane-strided loops). No parameter changes what a
kernel computes (up to the order of a reduce's terms).

Invariants:
- ``1 <= grid[0] <= info.max_global_work[0]``, ``grid[1:] == (1, 1)``: a grid-stride loop over the work items
  makes any grid of at least one block correct, so the grid is ``ceil(items / per_block)``, capped.
- ``block == (group_threads, groups_per_block, 1)`` for ``group`` (``group_threads`` a multiple of the warp size),
  ``(groups_per_block, group_threads, 1)`` for ``columns`` (``TX`` outputs by ``TY`` threads per output; ``TX``
  a power of two, ``TX * TY`` a multiple of the warp size) and ``(threads, 1, 1)`` for ``thread``; the block
  shape is baked into the source, the grid is read at run time (``gridDim``), so a launcher may use any grid
  from 1 to ``grid[0]``.
- Loop order is an IR decision before the geometry: ``order_reduce_ranges`` puts each reduce's most finely
  stepped loop innermost, ``order_output_loops`` the output loop along which the reduce loads are contiguous
  (both only reorder iterations, so a kernel computes the same values, up to the order of a reduce's terms).
- Flattening a loop nest recomputes the statements of the flattened bodies per flat index; ``flatten_count``
  stops at the first body holding a ``Reduce`` so that no reduce is ever recomputed.
- Long float32 sums: a reduce whose serial chain (per thread) reaches ``opt.WIDE_ACC_MIN`` elements sets
  ``wide_acc`` (accumulate in double, as the host does); cooperative reduces keep float partials otherwise,
  because each thread's chain is short and the tree across threads adds only ``log2(G)`` roundings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from zyx import dtypes, utils
from zyx.kernel import contraction, ir, opt
from zyx.kernel.ir import Expr, Kernel, Store
from zyx.kernel.linearize import Block, Loop, Reduce, linearize
from zyx.kernel.target import DeviceInfo
from zyx.ops import Ops

WARP = 32  # threads per warp on every CUDA GPU; the renderer's shuffles assume it
THREADS_PER_BLOCK = 256  # elementwise (thread strategy) block size
WARP_GROUPS_PER_BLOCK = 8  # warps (groups of 32) per block in warp mode
ELEMS_PER_THREAD = 8  # a cooperative group aims at this many reduce/inner elements per thread
MANY_GROUPS_PER_UNIT = 8  # with this many groups per SM, groups stay at most 256 threads
THREAD_OUTPUTS_PER_UNIT = 256  # the thread strategy for reduces needs this many outputs per SM
# Unroll of the cooperative layouts' lane-strided loops (a search parameter). NVRTC's own scheduling already keeps
# loads in flight: on an H200 (8192^2 float32, kernel alone) unroll 1 / 4 / 8 took 73.6 / 77.1 / 86.0 us for a
# column sum, 72.7 / 73.4 / 70.9 us for a row sum and 201.8 / 223.6 / 202.4 us for softmax, so the default is 1.
UNROLL = 1


MMA_M, MMA_N, MMA_K = 16, 8, 16  # the mma.sync.m16n8k16 tile (f16 / bf16 inputs, f32 accumulators)
MMA_K_TF32 = 8  # the mma.sync.m16n8k8 tile of float32 inputs rounded to tf32 (``DeviceInfo.allow_tf32``)


def mma_pack(dtype: dtypes.DType) -> int:
    """Operand elements per 32-bit word of a shared tile and a fragment register: 2 for f16 / bf16, 1 for tf32."""
    return 1 if dtype is dtypes.float32 else 2


def mma_k(dtype: dtypes.DType) -> int:
    """The k extent of one ``mma.sync`` of ``dtype`` operands: 16 (m16n8k16) or 8 for tf32 (m16n8k8). Either way
    one k step of the fragment loop is 8 words of a shared row."""
    return MMA_K_TF32 if dtype is dtypes.float32 else MMA_K


@dataclass(frozen=True)
class MmaTile:
    """The mma layout's blocking: a block of ``wm x wn`` warps computes a ``bm x bn`` output tile, stepping k by
    ``bk``; each warp owns a ``bm/wm x bn/wn`` sub-tile of 16x8 mma tiles. Invariants: ``bm % (16 wm) == 0``,
    ``bn % (8 wn) == 0``, ``bk % 16 == 0`` (so ``bk`` is also a multiple of tf32's k step, 8)."""

    bm: int
    bn: int
    bk: int
    wm: int
    wn: int

    @property
    def warps(self) -> int:
        return self.wm * self.wn

    @property
    def tiles_m(self) -> int:
        """16-row mma tiles per warp along m."""
        return self.bm // (MMA_M * self.wm)

    @property
    def tiles_n(self) -> int:
        """8-column mma tiles per warp along n."""
        return self.bn // (MMA_N * self.wn)

    def row_words(self, k_first: bool = True, pack: int = 2) -> int:
        """32-bit words per row of a shared tile: ``bk / pack`` words (``mma_pack``: k-pairs of 16-bit operands,
        single tf32 values) and a pad of 4, for either fill order (``k_first`` is kept for callers; rows stay
        16-byte aligned for vector stores). ``bk / pack`` is a multiple of 8, so a row is 4 words mod 8: the 8 rows
        x 4 words of one fragment read fall in 32 distinct banks (``mma_swizzle`` keeps that for row-first
        tiles)."""
        return self.bk // pack + 4

    def shared_bytes_of(self, dtype: dtypes.DType, stages: int = 1) -> int:
        """Bytes of both shared tiles for ``dtype`` operands, ``stages`` buffers of each (``MMA_STAGES``)."""
        return 4 * self.row_words(True, mma_pack(dtype)) * (self.bm + self.bn) * stages

    @property
    def shared_bytes(self) -> int:
        """``shared_bytes_of`` 16-bit operands, one stage."""
        return self.shared_bytes_of(dtypes.float16)

    def async_shared_bytes(self, k_first: tuple[bool, bool], stages: int) -> int:
        """Bytes of the ``cp.async`` layout's tiles (16-bit elements, ``stages`` buffers): a k-first operand as
        ``[rows][bk + 8]``, a row-first one as ``[bk][rows + 8]`` (``ASYNC_PAD``; the renderer's ``mma_frame``)."""
        per = sum((rows * (self.bk + ASYNC_PAD) if kf else self.bk * (rows + ASYNC_PAD))
                  for rows, kf in ((self.bm, k_first[0]), (self.bn, k_first[1])))
        return 2 * per * stages


def mma_swizzle(k_first: bool, words: int) -> int:
    """The XOR mask of a shared tile's word columns (0: none). A tile filled row-first (not ``k_first``) with
    ``words`` (a power of two) words of k per row keeps word ``(row, p)`` at column ``p ^ swizzle(row >> 3) &
    mask`` (``mma_swizzled``), a k-first one (16-byte stores of 4 words) at ``p``. The XOR is uniform over the 8
    rows of a fragment read (which stay in 32 banks: rows are 4 words mod 8) and spreads a row-first fill's
    stores: 32 rows at one k (scalar fill) or rows ``8u + i`` of several ``u`` (the interleaved vector fill)."""
    return 0 if k_first else words - 1


def mma_swizzled(group: int, mask: int) -> int:
    """The XOR of the word columns of rows ``8 group .. 8 group + 7`` of a swizzled tile: ``g ^ 2g ^ 8g``
    masked, a bijection of ``group``'s low bits (triangular over GF(2)); the renderer emits this expression."""
    return (group ^ (group << 1) ^ (group << 3)) & mask


ASYNC_PAD = 8  # 16-bit elements padding each row of a cp.async tile: every row length is then an odd multiple of 16
# bytes mod 128, so the 8 rows that one ldmatrix matrix reads fall in 8 distinct 16-byte bank groups
ASYNC_STAGES = (4, 3, 2)  # cp.async ring buffers: the most whose tiles fit the shared memory
MMA_STAGES = (2, 1)  # shared buffers per operand: 2 overlaps the next k step's global loads with the mma's
# the ``mma_tile`` parameter's values index this tuple; the heuristic takes the first that gives every SM a block
# (the last two, 64x64 warp tiles, are candidates for the search only: the heuristic's order reaches them only when
# no other tile fits; they fit the cp.async ring's dynamic shared memory, or one register-filled stage)
MMA_TILES = (MmaTile(128, 128, 32, 2, 4), MmaTile(128, 64, 32, 2, 2), MmaTile(64, 64, 32, 2, 2),
             MmaTile(64, 32, 32, 2, 1), MmaTile(32, 32, 32, 1, 1), MmaTile(32, 16, 16, 1, 1),
             MmaTile(128, 256, 32, 2, 4), MmaTile(256, 128, 32, 4, 2))


@dataclass(frozen=True)
class SimtTile:
    """The ``simt`` layout's blocking: a block of ``bm/tm x bn/tn`` threads computes a ``bm x bn`` output tile,
    stepping k by ``bk``; thread ``(y, x)`` owns ``tm`` rows in runs of ``v`` (``vector``): row ``i`` is
    ``(i / v) (bm/tm) v + y v + i % v``, and likewise ``tn`` columns. A run is one 16-byte (or narrower) shared
    read, and the lanes of a warp read consecutive runs of the ``b`` tile and store consecutive columns.
    Invariants: ``bm % tm == bn % tn == 0``; ``tm``, ``tn`` powers of two."""

    bm: int
    bn: int
    bk: int
    tm: int
    tn: int

    @property
    def threads_m(self) -> int:
        return self.bm // self.tm

    @property
    def threads_n(self) -> int:
        return self.bn // self.tn

    @property
    def threads(self) -> int:
        return self.threads_m * self.threads_n

    def shared_bytes(self, itemsize: int, stages: int = 1) -> int:
        """Bytes of both shared tiles, ``[stages][bk][bm + pad]`` and ``[stages][bk][bn + pad]`` (``simt_pad``)."""
        return itemsize * self.bk * (self.bm + self.bn + 2 * simt_pad(itemsize)) * stages

    def vector(self, itemsize: int) -> tuple[int, int]:
        """Elements per run of a thread's rows and of its columns: 16 bytes' worth, at most ``tm`` / ``tn``."""
        return min(self.tm, VECTOR_BYTES // itemsize), min(self.tn, VECTOR_BYTES // itemsize)

    def acc_bytes(self, itemsize: int, wide: bool) -> int:
        """Accumulator bytes per thread: ``tm x tn`` of ``itemsize``, plus float32 partials when ``wide``."""
        return self.tm * self.tn * (itemsize + (4 if wide else 0))




def simt_pad(itemsize: int) -> int:
    """Elements padding each shared row of the ``simt`` tiles: 16 bytes, so that rows stay 16-byte aligned for the
    runs' vector reads while a k-first fill's stores (adjacent threads a row apart) spread over the banks."""
    return VECTOR_BYTES // itemsize


# the ``simt_tile`` parameter's values index this tuple: 256 threads each, 16 along n; the heuristic's choice among
# those whose accumulators fit SIMT_ACC_BYTES is ``_simt_geometry``'s
SIMT_TILES = (SimtTile(128, 128, 8, 8, 8), SimtTile(128, 64, 8, 8, 4), SimtTile(64, 64, 16, 4, 4),
              SimtTile(64, 32, 16, 4, 2), SimtTile(32, 32, 16, 2, 2))
SIMT_STAGES = (2, 1)  # as MMA_STAGES: 2 loads step k + bk into registers while step k multiplies
SIMT_ACC_BYTES = 256  # accumulator bytes per thread (64 floats, 32 doubles): more would spill registers
SIMT_MIN = 16  # the heuristic takes the layout when m and n are at least this long ...
SIMT_MIN_K = 8  # ... and k at least this long, and its tiles give at least half the SMs a block
SIMT_MIN_USED = 0.75  # ... and among the tilings keeps those within this factor of the best share of outputs used
SIMT_PARTIAL = 256  # wide accumulators: float32 partial sums over this many k, added into float64 ones
SIMT_DTYPES = (dtypes.float32, dtypes.float64, dtypes.int32, dtypes.uint32, dtypes.int64, dtypes.uint64)


@dataclass(frozen=True)
class Contraction:
    """A kernel's reduce ``sum_k a(m, k) * b(k, n)`` (``find_contraction``): ``a`` and ``b`` are 16-bit values
    (``dtype``) cast to float32 in the reduce, or float32 values (``dtype`` float32: tf32 tensor cores), or for the
    ``simt`` layout values of the reduce's dtype (``simt_contraction``); ``m`` and ``n`` are output loops, ``k``
    the reduce's range; other output loops (batch) may index either operand."""

    reduce: Expr
    m: Expr
    n: Expr
    k: Expr
    a: Expr
    b: Expr
    dtype: dtypes.DType


@dataclass(frozen=True)
class Geometry:
    """How one kernel maps onto the GPU; see the module docstring for the strategies."""

    strategy: str  # "thread", "tile", "scatter", "scan", "columns", "mma", "simt" or "group"
    split: int  # output loops [0, split) index the work items (threads or groups)
    flat: int  # output loops [split, flat) are strided over a group's threads (== split for "thread")
    items: int  # work items: threads ("thread"), outputs ("columns"), block tiles ("mma", "simt"), groups ("group")
    group_threads: int  # threads per group (1 for "thread"; TY, the threads sharing one output, for "columns")
    groups_per_block: int
    block: tuple[int, int, int]
    contraction: Contraction | None = None  # for "mma" and "simt": the matched reduce
    tile: MmaTile | None = None  # for "mma": the block / warp tiling
    stages: int = 1  # for "mma" / "simt": shared buffers per operand (``MMA_STAGES``; 2: software pipelined)
    ldmatrix: bool = False  # for "mma": 16-bit fragments of unswizzled (k-first) tiles by ldmatrix on sm_80+
    async_copy: bool = False  # for "mma": tiles filled by cp.async into a ring of ``stages`` buffers (no registers)
    vector: int = 1  # for "thread": consecutive outputs per thread along the innermost loop (``plan_vector``)
    unroll: int = 1  # for "group" / "columns": the lane-strided loops unrolled this many times (loads in flight)
    vector_loads: frozenset[Expr] = frozenset()  # loads read as 16-byte (or narrower) vectors when ``vector > 1``
    vector_stores: frozenset[int] = frozenset()  # indices into ``kernel.stores`` written as vectors
    staged: tuple[Expr, ...] = ()  # for "tile": the loads read through shared tiles (``tile_loads``)
    scatter: tuple[Expr, Expr, int] | None = None  # for "scatter": target loop, row index, rows per thread
    simt: SimtTile | None = None  # for "simt": the block and thread tiling (``contraction`` holds the reduce)
    grid: tuple[int, int, int] | None = None  # blocks to launch; None until the ``size_grid`` pass

    @property
    def per_block(self) -> int:
        """Work items per block: the grid is ``ceil(items / per_block)`` blocks, capped."""
        if self.strategy in ("mma", "simt", "tile"):
            return 1
        return self.block[1] if self.strategy in ("group", "scan") else self.block[0]

    @property
    def block_threads(self) -> int:
        return self.block[0] * self.block[1] * self.block[2]

    @property
    def warp_mode(self) -> bool:
        """Groups are single warps: cooperative reduces need shuffles only (no shared memory, no barrier)."""
        return self.strategy == "group" and self.group_threads == 32


def reference_info(compute_units: int = 132, arch: tuple[int, int] = (9, 0)) -> DeviceInfo:
    """A CUDA DeviceInfo for code generation without a GPU (an H200 by default: 132 SMs, sm_90). By default it is
    what the CUDA device reports on an H200 (and on the emulated one), name aside, so kernels rendered with it are
    the kernels that device compiles."""
    return DeviceInfo(name=f"cuda (reference sm_{arch[0]}{arch[1]})", kind="cuda", compute_units=compute_units,
                      max_global_work=(2**31 - 1, 65535, 65535), max_local_work=(1024, 1024, 64),
                      max_local_threads=1024, local_memory_bytes=48 * 1024, shared_optin_bytes=227 * 1024,
                      warp_size=32,
                      compute_capability=arch, dtypes=frozenset(d.name for d in dtypes.ALL),
                      tensor_cores=arch[0] >= 7, vector_bytes=16, peak_gflops=67_000.0, memory_gbps=4_300.0,
                      launch_overhead_ns=4_000)


# ---------------------------------------------------------------------------------------------------------------
# structure of a linearized kernel


def output_blocks(root: Block) -> list[Block]:
    """Blocks by depth: ``[root, body of loop 0, body of loop 1, ...]``."""
    out = [root]
    while out[-1].inner is not None:
        out.append(out[-1].inner.body)
    return out


def output_loops(root: Block) -> list[Loop]:
    """The output loops as ``Loop`` objects, outermost first."""
    return [b.inner for b in output_blocks(root)[:-1]]


def has_reduce(block: Block) -> bool:
    return any(isinstance(s, Reduce) for s in block.stmts)


def reduce_depths(root: Block) -> list[int]:
    """Depths of the blocks holding top-level reduces, in increasing order."""
    return [d for d, b in enumerate(output_blocks(root)) if has_reduce(b)]


def flatten_count(loops: Sequence[Loop]) -> int:
    """How many loops of a perfect chain ``loops`` to flatten into one index: up to and including the first
    loop whose body holds a ``Reduce`` (so no reduce is recomputed), else all of them."""
    for i, lp in enumerate(loops):
        if has_reduce(lp.body):
            return i + 1
    return len(loops)


def reduce_chain(red: Reduce) -> list[Loop]:
    """The loops of one reduce, outermost first."""
    out = [red.loop]
    while out[-1].body.inner is not None:
        out.append(out[-1].body.inner)
    return out


def loop_size(loops: Sequence[Loop]) -> int:
    return math.prod(lp.range.arg[1] for lp in loops)


# ---------------------------------------------------------------------------------------------------------------
# heuristics


def coalesced_across(values: Sequence[Expr], r: Expr) -> bool:
    """Every load feeding ``values`` reads the same or the next element when ``r`` steps by one."""
    for e in ir.toposort(list(values)):
        if e.op is Ops.LOAD and ir.affine_coefficient(e.srcs[0], r) not in (0, 1):
            return False
    return True


def _top_reduces(root: Block, depth: int) -> list[Reduce]:
    return [s for s in output_blocks(root)[depth].stmts if isinstance(s, Reduce)]


SECTOR_BYTES = 32  # the unit of a global memory transaction: a warp's access costs one per distinct sector
RESIDENT_THREADS_PER_UNIT = 2048  # threads an SM keeps resident: the columns layout grows TY toward this


def _digits(ranges: Sequence[Expr], flat: int) -> dict[Expr, int]:
    """The values of ``ranges`` (outermost slowest) at flat index ``flat``."""
    out: dict[Expr, int] = {}
    for r in reversed(ranges):
        out[r] = flat % r.arg[1]
        flat //= r.arg[1]
    return out


def reduce_loads(red: Reduce) -> list[Expr]:
    """The loads a reduce runs in its loop (those whose index or gate depends on one of its ranges)."""
    own = set(red.expr.arg[1])
    return [e for e in ir.toposort([red.expr.srcs[0]]) if e.op is Ops.LOAD and own & e.ranges]


def access_sectors(loads: Sequence[Expr], lanes: Sequence[dict[Expr, int]]) -> int:
    """Memory sectors one warp touches when lane ``i`` runs ``loads`` at the range values ``lanes[i]`` (ranges
    not named are 0), summed over the loads. A load whose index is not affine in those ranges counts one
    sector per lane (the worst case)."""
    total = 0
    for ld in loads:
        index, size = ld.srcs[0], ld.dtype.itemsize
        coefs = {r: ir.affine_coefficient(index, r) for r in set().union(*(p.keys() for p in lanes))}
        if any(c is None for c in coefs.values()):
            total += len(lanes)
            continue
        total += len({sum(c * p.get(r, 0) for r, c in coefs.items()) * size // SECTOR_BYTES for p in lanes})
    return total


def _coop_ranges(red: Reduce) -> list[Expr]:
    """The reduce loops that a cooperative reduce flattens and strides over its threads."""
    chain = reduce_chain(red)
    return [lp.range for lp in chain[:flatten_count(chain)]]


def _group_lanes(red: Reduce) -> list[dict[Expr, int]]:
    """One warp of a ``group`` layout: 32 consecutive iterations of the reduce's flattened loops."""
    flat = _coop_ranges(red)
    return [_digits(flat, i) for i in range(min(WARP, math.prod(r.arg[1] for r in flat)))]


def _columns_lanes(outputs: Sequence[Expr], red: Reduce, tx: int) -> list[dict[Expr, int]]:
    """One warp of a ``columns`` layout: ``tx`` consecutive outputs of the loops ``outputs`` (clamped to the last)
    by ``32 / tx`` consecutive slices of the reduce's flattened loops."""
    flat = _coop_ranges(red)
    items, work = math.prod(r.arg[1] for r in outputs), math.prod(r.arg[1] for r in flat)
    return [{**_digits(outputs, min(i % tx, items - 1)), **_digits(flat, min(i // tx, work - 1))}
            for i in range(WARP)]


def _prefer_thread(k: Kernel, root: Block, info: DeviceInfo) -> bool:
    """Reduces only at the innermost depth: one thread per output when that keeps loads coalesced and the
    GPU busy."""
    if not k.loops or k.size < THREAD_OUTPUTS_PER_UNIT * max(info.compute_units, 1):
        return False
    reds = _top_reduces(root, len(k.loops))
    return coalesced_across([r.expr.srcs[0] for r in reds], k.loops[-1])


def _group_threads(work: int, groups: int, info: DeviceInfo, elems: int = ELEMS_PER_THREAD) -> int:
    """Threads per group: a warp, doubled while each thread would get more than ``elems`` elements, up
    to the block limit (256 when there are groups enough to fill the GPU anyway)."""
    cap = max(info.max_local_threads, WARP)
    if groups >= MANY_GROUPS_PER_UNIT * max(info.compute_units, 1):
        cap = min(cap, 256)
    g = WARP
    while g < cap and g * elems < work:
        g *= 2
    return min(g, cap) // WARP * WARP


def _grid(items: int, per_block: int, info: DeviceInfo) -> tuple[int, int, int]:
    blocks = max(1, -(-items // per_block))
    return (min(blocks, info.max_global_work[0]), 1, 1)


def _thread_block(items: int, per_block: int, info: DeviceInfo) -> tuple[int, int, int]:
    """The ``thread`` layout's block: ``per_block`` (the ``threads`` parameter) rounded down to whole warps and to
    the device's limit, fewer (whole warps) for fewer work items."""
    per_block = max(WARP, min(per_block, max(info.max_local_threads, WARP)) // WARP * WARP)
    return (min(per_block, max(WARP, -(-items // WARP) * WARP)), 1, 1)


def _thread_geometry(k: Kernel, info: DeviceInfo, per_block: int = THREADS_PER_BLOCK) -> Geometry:
    """One thread per iteration of the output loops (but a scan's, which runs serially in each thread); the
    ``vectorize`` pass may then give each thread several consecutive iterations of the innermost one."""
    n = len(k.loops)
    if k.scan_ranges():
        n -= 1  # the scan's loop (innermost) runs serially in each thread
    items = math.prod(r.arg[1] for r in k.loops[:n])
    return Geometry("thread", n, n, items, 1, 1, _thread_block(items, per_block, info))


# ---------------------------------------------------------------------------------------------------------------
# shared-memory tiles of transposed reads (a kernel without reduces)

TILE = 32  # a tile's edge: a warp's width, so that each phase's warp reads or writes 32 consecutive elements
TILE_ROWS = 8  # the block is TILE x TILE_ROWS threads; each thread handles TILE / TILE_ROWS elements per phase
TILE_MAX_LOADS = 4  # staged loads per kernel: 4 tiles of 8-byte elements take 33 KiB of the 48 KiB a block has


def tile_loads(k: Kernel) -> list[Expr]:
    """The loads of a kernel without reduces or scans that the ``tile`` layout stages (at most
    ``TILE_MAX_LOADS``): those of ``ir.transposed_block_loads`` (any dtype), when the last two loops ``(i, j)`` are
    both at least ``TILE`` long and every store steps by one along ``j`` (the ``thread`` layout then writes
    coalesced but reads such a load a stride apart from lane to lane)."""
    if len(k.loops) < 2 or k.then or k.reduces() or k.scan_ranges():
        return []
    i, j = k.loops[-2], k.loops[-1]
    if min(i.arg[1], j.arg[1]) < TILE or any(ir.affine_coefficient(st.index, j) != 1 for st in k.stores):
        return []
    return ir.transposed_block_loads(k, None)[:TILE_MAX_LOADS]


def _tile_geometry(k: Kernel, info: DeviceInfo) -> Geometry | None:
    """One block of ``TILE x TILE_ROWS`` threads per ``TILE x TILE`` tile of the last two loops (and iteration of
    the others), when ``tile_loads`` finds loads to stage."""
    loads = tile_loads(k)
    if not loads or info.max_local_threads < TILE * TILE_ROWS:
        return None
    n = len(k.loops)
    items = math.prod(r.arg[1] for r in k.loops[:-2]) * math.prod(-(-r.arg[1] // TILE) for r in k.loops[-2:])
    return Geometry("tile", n, n, items, 1, 1, (TILE, TILE_ROWS, 1), staged=tuple(loads))


# ---------------------------------------------------------------------------------------------------------------
# scans split across a group's lanes

SCAN_MIN = 64  # a scan loop at least this long takes the scan layout
SCAN_CHUNK = 16  # the scan layout aims at this many elements per lane (groups of 32 to 1024 lanes)
SCAN_DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "uint32", "int64", "uint64")  # shuffled as such


def _scan_geometry(k: Kernel, info: DeviceInfo) -> Geometry | None:
    """One group of ``G`` lanes per iteration of the outer loops of a kernel whose scans all run along its
    innermost loop (at least ``SCAN_MIN`` long): lane ``l`` takes the ``l``-th of ``G`` contiguous chunks of that
    loop, folds its chunk's inputs into a total, the group's exclusive prefix of the totals (warp shuffles, shared
    memory across warps) starts its running value, and the lane runs its chunk as the ``thread`` layout runs the
    whole loop. The inputs are read twice; the loop's ``L`` steps become ``2L / G`` per lane. Not for scans whose
    input reads another scan, nor for stores outside the scan loop."""
    scans = [e for e in ir.toposort([st.value for st in k.stores]) if e.op is Ops.SCAN]
    if not scans or not k.loops or k.then or k.reduces() or k.scan_ranges() != {k.loops[-1]}:
        return None
    size = k.loops[-1].arg[1]
    if size < SCAN_MIN or any(e.dtype.name not in SCAN_DTYPES for e in scans) or \
            any(k.loops[-1] not in st.index.ranges for st in k.stores) or \
            any(x.op is Ops.SCAN for e in scans for x in ir.toposort([e.srcs[0]])):
        return None
    lanes = min(1024, max(WARP, 1 << (-(-size // SCAN_CHUNK) - 1).bit_length()), info.max_local_threads)
    per_block = THREADS_PER_BLOCK // WARP if lanes == WARP else 1  # wider groups meet barriers: one per block
    n = len(k.loops) - 1
    items = math.prod(r.arg[1] for r in k.loops[:n])
    return Geometry("scan", n, n, items, lanes, per_block, (lanes, per_block, 1))


# ---------------------------------------------------------------------------------------------------------------
# one-hot sums turned around (an embedding's or a gather's gradient)

SCATTER_THREADS = 32768  # the scatter layout splits the target rows into bins until it has this many threads


def _scatter_geometry(k: Kernel, info: DeviceInfo, threads: int = THREADS_PER_BLOCK) -> Geometry | None:
    """``out[v, o] = sum_n (index(n) == v ? x(n, o) : 0)`` (``opt.one_hot_sum``) as a scatter that keeps every
    output element on one thread: thread ``(bin, o)`` zeroes the rows ``v`` of its bin at ``o``, then runs the
    sum's iterations in order and adds ``x(n, o)`` at row ``index(n)`` when that row is in its bin. Work: bins
    times the sum's iterations times the other axes ``o``, instead of every row times them; no atomics, and each
    element adds its terms in the sum's order (in the output's dtype, as the host's ``opt.scatter_one_hot``)."""
    found = opt.one_hot_store(k)
    if found is None:
        return None
    _, (target, index, _) = found
    rows = target.arg[1]
    others = math.prod(r.arg[1] for r in k.loops if r is not target)
    per = -(-rows // max(1, min(rows, SCATTER_THREADS // others)))  # rows per bin
    items = -(-rows // per) * others
    return Geometry("scatter", len(k.loops), len(k.loops), items, 1, 1, _thread_block(items, threads, info),
                    scatter=(target, index, per))


# ---------------------------------------------------------------------------------------------------------------
# vector loads and stores (the thread layout of a kernel without reduces)

VECTOR_BYTES = 16  # the widest access one thread issues (``ld.global.v4.b32``: float4, uint4, double2)
VECTOR_MIN_THREADS_PER_UNIT = 128  # the heuristic vectorizes only while every SM keeps at least this many threads
VECTOR_WIDTHS = (16, 8, 4, 2)  # outputs per thread worth trying, widest first
VECTOR_MAX_UNROLLED = 4096  # the heuristic keeps width x (innermost statements) below this (source / registers)


def vector_piece(width: int, itemsize: int) -> int:
    """Bytes per vector access when a thread reads ``width`` consecutive elements of ``itemsize`` bytes:
    ``min(16, width * itemsize)``, or 0 (scalar accesses) when that is one element or less than 4 bytes. A wider
    run is several such pieces; a piece always holds a whole number of elements."""
    b = min(VECTOR_BYTES, width * itemsize)
    return b if b >= 4 and b > itemsize else 0


def contiguous_aligned(index: Expr, r: Expr, elems: int) -> bool:
    """``index`` steps by exactly one element per step of range ``r`` and is a multiple of ``elems`` whenever
    ``r`` is: it is affine, ``r + sum(c_i * a_i) + c0``, every other atom ``a_i`` (any integer expression, a
    gathered index included) is independent of ``r`` and every ``c_i`` and ``c0`` is a multiple of ``elems``.
    A broadcast (``r``'s coefficient 0), a reversed or strided axis and an offset view (``x[1:]``) fail."""
    terms, offset = ir._linear(index)
    if terms.get(r) != 1 or offset % elems:
        return False
    return all(a is r or (r not in a.ranges and c % elems == 0) for a, c in terms.items())


def _vector_candidates(k: Kernel, inner: Expr) -> tuple[list[Expr], list[int], int]:
    """The loads (ungated, of ``in`` buffers) and stores (of a buffer stored once and never loaded) whose index
    steps by one along ``inner``, and the bytes per output of every access that depends on ``inner``."""
    every = [e for e in ir.toposort([x for st in k.stores for x in (st.index, st.value)]) if e.op is Ops.LOAD]
    loaded = {e.arg for e in every}
    loads = [e for e in every if inner in e.ranges]
    stored = [st.param for st in k.stores]
    dependent = sum(k.params[e.arg].dtype.itemsize for e in loads)
    lds = [e for e in loads if len(e.srcs) == 1 and k.params[e.arg].kind == "in"
           and ir.affine_coefficient(e.srcs[0], inner) == 1]
    sts = []
    for i, st in enumerate(k.stores):
        if inner not in st.index.ranges:
            continue
        dependent += k.params[st.param].dtype.itemsize
        if stored.count(st.param) == 1 and st.param not in loaded and ir.affine_coefficient(st.index, inner) == 1:
            sts.append(i)
    return lds, sts, dependent


def plan_vector(k: Kernel, info: DeviceInfo, want: int | None = None
                ) -> tuple[int, frozenset[Expr], frozenset[int]]:
    """How many consecutive outputs of the innermost output loop one thread of the ``thread`` layout computes,
    and which loads and stores (indices into ``k.stores``) it then reads and writes as vectors.

    Legal only for a kernel without reduces or scans. A load or store is vectorized at width ``V`` when its
    index steps by one along the innermost loop and is provably aligned to its piece (``vector_piece``,
    ``contiguous_aligned``): a thread's run starts at a multiple of ``V`` of that loop, and a kernel's buffers are
    whole pool allocations, 256-byte aligned on CUDA (``cuMemAlloc``) and in the emulator, so the element offset
    proves the address. Runs that would cross the loop's end (a size that is not a multiple of ``V``) take a
    scalar path in the renderer. ``V`` is the widest power of two that is at most the loop's size and at which
    the widest contiguous access is at most 16 bytes and some access vectorizes (16 outputs of int8, 8 of
    float16, 4 of float32, 2 of float64 for a plain elementwise kernel). ``want``: 0 = off (1 output per thread),
    1 = on whenever provable, None = the heuristic: the widest such ``V`` at which the vectorized bytes are at
    least half of the bytes moved along the loop, every SM keeps ``VECTOR_MIN_THREADS_PER_UNIT`` threads and the
    unrolled lanes stay under ``VECTOR_MAX_UNROLLED`` statements."""
    off = (1, frozenset(), frozenset())
    if want == 0 or not k.loops or k.reduces() or k.scan_ranges():
        return off
    inner = k.loops[-1]
    size = inner.arg[1]
    lds, sts, dependent = _vector_candidates(k, inner)
    sizes = [k.params[e.arg].dtype.itemsize for e in lds] + [k.params[k.stores[i].param].dtype.itemsize for i in sts]
    if not sizes:
        return off
    body = sum(1 for e in ir.toposort([x for st in k.stores for x in (st.index, st.value)]) if inner in e.ranges)
    for width in VECTOR_WIDTHS:
        if width > size or width * max(sizes) > VECTOR_BYTES:
            continue
        if want is None and width * body > VECTOR_MAX_UNROLLED:
            continue  # every lane repeats the innermost statements

        def aligned(index: Expr, itemsize: int) -> bool:
            piece = vector_piece(width, itemsize)  # noqa: B023 (called in this iteration only)
            return piece > 0 and contiguous_aligned(index, inner, piece // itemsize)

        vl = frozenset(e for e in lds if aligned(e.srcs[0], k.params[e.arg].dtype.itemsize))
        vs = frozenset(i for i in sts if aligned(k.stores[i].index, k.params[k.stores[i].param].dtype.itemsize))
        if not vl and not vs:
            continue
        if want is None:
            moved = sum(k.params[e.arg].dtype.itemsize for e in vl)
            moved += sum(k.params[k.stores[i].param].dtype.itemsize for i in vs)
            threads = k.size // size * -(-size // width)
            if 2 * moved < dependent or threads < VECTOR_MIN_THREADS_PER_UNIT * max(info.compute_units, 1):
                continue  # a narrower run may align more accesses, and leaves more threads
        return width, vl, vs
    return off


def _group_geometry(root: Block, s: int, info: DeviceInfo, elems: int = ELEMS_PER_THREAD,
                    warps: int = WARP_GROUPS_PER_BLOCK) -> Geometry:
    loops = output_loops(root)
    n = len(loops)
    flat = s + flatten_count(loops[s:]) if s < n else n
    items = loop_size(loops[:s])
    chains = [reduce_chain(r) for r in _top_reduces(root, s)]
    work = max([loop_size(c[:flatten_count(c)]) for c in chains] + [loop_size(loops[s:flat])])
    g = _group_threads(work, items, info, elems)
    w = max(1, min(warps, items, max(info.max_local_threads, WARP) // WARP)) if g == WARP else 1
    return Geometry("group", s, flat, items, g, w, (g, w, 1))


def _columns_tx(items: int) -> int:
    """Outputs per block along ``threadIdx.x``: a warp's width, or the next power of two above fewer outputs."""
    return WARP if items >= WARP else 1 << max(0, items - 1).bit_length()


def _columns_geometry(root: Block, info: DeviceInfo, elems: int = ELEMS_PER_THREAD) -> Geometry | None:
    """The ``columns`` layout of a kernel whose top-level reduces are all at the innermost depth, or None when it
    would not fit (shared memory)."""
    loops = output_loops(root)
    n = len(loops)
    items = loop_size(loops)
    reds = _top_reduces(root, n)
    tx = _columns_tx(items)
    blocks = -(-items // tx)
    work = max(loop_size(c[:flatten_count(c)]) for c in map(reduce_chain, reds))
    cap = max(info.max_local_threads, WARP) // tx
    ty = max(1, WARP // tx)
    target = RESIDENT_THREADS_PER_UNIT * max(info.compute_units, 1)
    while ty * 2 <= cap and work >= ty * 2 * elems and blocks * tx * ty < target:
        ty *= 2
    per_thread_cell = 12  # bytes of shared memory per thread and reduce: a double partial and a NaN flag at most
    while ty > max(1, WARP // tx) and len(reds) * tx * ty * per_thread_cell > info.local_memory_bytes:
        ty //= 2
    if len(reds) * tx * ty * per_thread_cell > info.local_memory_bytes:
        return None
    return Geometry("columns", n, n, items, ty, tx, (tx, ty, 1))


def _columns_pay(root: Block, cols: Geometry) -> bool:
    """Whether the columns layout's warps touch fewer memory sectors than the group layout's, over the loads of
    the top-level reduces (each runs once per reduce iteration in either layout)."""
    loops = output_loops(root)
    reds = _top_reduces(root, len(loops))
    outputs = [lp.range for lp in loops]
    by_cols = sum(access_sectors(reduce_loads(r), _columns_lanes(outputs, r, cols.groups_per_block)) for r in reds)
    by_group = sum(access_sectors(reduce_loads(r), _group_lanes(r)) for r in reds)
    return by_cols < by_group


_MMA_DTYPES = (dtypes.float16, dtypes.bfloat16)


def _operand(x: Expr, tf32: bool) -> Expr | None:
    """The 16-bit value under a float32 operand ``CAST(u)``; with ``tf32``, else the float32 operand itself."""
    if x.op is Ops.CAST and x.dtype is dtypes.float32 and x.srcs[0].dtype in _MMA_DTYPES:
        return x.srcs[0]
    return x if tf32 and x.dtype is dtypes.float32 else None


def find_contraction(k: Kernel, tf32: bool = False) -> Contraction | None:
    """The kernel's contraction (``kernel.contraction``) when it is ``sum over one range k of a(m, k) * b(k, n)``
    of two 16-bit operands of one dtype (each any expression of its ranges, cast to float32; accumulated in
    float32), or with ``tf32`` of two float32 operands (``dtype`` float32), depending on every output loop. ``n``
    is the innermost of ``m`` and ``n`` (adjacent outputs are adjacent columns of the tile)."""
    if k.then:
        return None
    c = contraction.find_contraction(k)
    if c is None or c.red.dtype is not dtypes.float32 or set(c.red.ranges) != set(k.loops):
        return None
    a, b = _operand(c.a, tf32), _operand(c.b, tf32)
    if a is None or b is None or a.dtype is not b.dtype:
        return None
    return Contraction(c.red, c.m, c.n, c.k, a, b, a.dtype)


def _tf32(info: DeviceInfo) -> bool:
    """Whether float32 contractions may run on tf32 tensor cores: the user allows it and the device has them."""
    return info.allow_tf32 and info.tensor_cores and (info.compute_capability or (0, 0)) >= (8, 0)


def mma_tiles(info: DeviceInfo, dtype: dtypes.DType = dtypes.float16, stages: int = 1) -> tuple[int, ...]:
    """Indices into ``MMA_TILES`` of the tilings that fit ``info`` (shared memory for ``stages`` buffers of
    ``dtype`` operands, threads per block)."""
    limit = max(info.max_local_threads, WARP)
    shared = info.local_memory_bytes or 48 * 1024
    return tuple(i for i, t in enumerate(MMA_TILES)
                 if t.warps * WARP <= limit and t.shared_bytes_of(dtype, stages) <= shared)


def mma_ldmatrix_applies(c: Contraction) -> bool:
    """Whether ``ldmatrix`` can load some fragment of ``c``: 16-bit operands (``.b16``) and a tile filled k-first
    (unswizzled: ``ldmatrix`` reads each row's 4 words of k-pairs in order, 16-byte aligned)."""
    return c.dtype is not dtypes.float32 and any(mma_fill_order(c))


def mma_async_applies(c: Contraction) -> bool:
    """Whether both tiles of ``c`` can be filled by 16-byte ``cp.async`` copies (sm_80+): 16-bit operands that are
    plain loads read as whole vectors (``mma_vector_fill``), copied as they are (no expression between the load
    and the tile)."""
    return c.dtype is not dtypes.float32 and all(mma_vector_fill(c))


def mma_async_stages(c: Contraction, t: MmaTile, info: DeviceInfo) -> int:
    """The most ``ASYNC_STAGES`` buffers of ``t``'s ``cp.async`` tiles that fit the shared memory a block may opt
    into (``info.shared_optin_bytes``; the ring is dynamic shared memory), 0: none."""
    shared = max(info.local_memory_bytes or 48 * 1024, info.shared_optin_bytes)
    order = mma_fill_order(c)
    return next((s for s in ASYNC_STAGES if t.async_shared_bytes(order, s) <= shared), 0)


def _mma_geometry(k: Kernel, info: DeviceInfo, tile: int | None = None, stages: int | None = None,
                  ldmatrix: int | None = None, async_copy: int | None = None) -> Geometry | None:
    """Tensor cores for a 16-bit contraction (sm_80+: ``mma.sync.m16n8k16``), or a float32 one when
    ``info.allow_tf32`` (``m16n8k8`` on tf32-rounded operands), one block per ``MmaTile`` of the output, when the
    contraction is at least one mma tile in each dimension. ``tile`` indexes ``MMA_TILES`` and ``stages`` is one
    of ``MMA_STAGES``; a tile that does not fit ``info`` with those stages is replaced by the heuristic's among
    those that do, and stages that no tile fits (or not in ``MMA_STAGES``) by the heuristic's; ``ldmatrix`` 0
    turns ``ldmatrix`` fragment loads off (on by default where ``mma_ldmatrix_applies``). ``async_copy`` 1 fills
    the tiles by ``cp.async`` where ``mma_async_applies``, into the most ``ASYNC_STAGES`` buffers of the tile that
    fit (``stages`` is then that count; fragments by ``ldmatrix``, ``.trans`` for row-first tiles); off by default
    until measured on a GPU. The heuristic takes the largest tiling (single-buffered) that gives every SM a block,
    else the one with the most blocks, then 2 stages when that tile fits them, else 1."""
    cap = info.compute_capability or (0, 0)
    if not info.tensor_cores or cap < (8, 0):
        return None
    c = find_contraction(k, _tf32(info))
    if c is None or c.m.arg[1] < MMA_M or c.n.arg[1] < MMA_N or c.k.arg[1] < mma_k(c.dtype):
        return None
    if stages not in MMA_STAGES or not mma_tiles(info, c.dtype, stages):
        stages = None
    fits = mma_tiles(info, c.dtype, stages or 1)
    if not fits:
        return None
    batch = math.prod(r.arg[1] for r in k.loops if r is not c.m and r is not c.n)

    def blocks(t: MmaTile) -> int:
        return batch * -(-c.m.arg[1] // t.bm) * -(-c.n.arg[1] // t.bn)

    if tile not in fits:
        full = [i for i in fits if blocks(MMA_TILES[i]) >= max(info.compute_units, 1)]
        tile = full[0] if full else max(fits, key=lambda i: (blocks(MMA_TILES[i]), -i))
    if stages is None:
        stages = next(s for s in MMA_STAGES if tile in mma_tiles(info, c.dtype, s))
    t = MMA_TILES[tile]
    items = blocks(t)
    n = len(k.loops)
    ring = mma_async_stages(c, t, info) if async_copy == 1 and mma_async_applies(c) else 0
    if ring:
        return Geometry("mma", n, n, items, WARP, t.warps, (WARP, t.warps, 1), c, t, stages=ring, ldmatrix=True,
                        async_copy=True)
    return Geometry("mma", n, n, items, WARP, t.warps, (WARP, t.warps, 1), c, t,
                    stages=stages, ldmatrix=ldmatrix != 0 and mma_ldmatrix_applies(c))


def mma_fill_order(c: Contraction) -> tuple[bool, bool]:
    """Whether the threads filling the shared tiles of ``a`` and ``b`` should walk k-pairs fastest (adjacent
    threads on adjacent k) rather than m (``a``) or n (``b``): the axis along which the operand's loads step least
    (the contiguous one of a plain or transposed operand). Only the order of the fill changes, not the tiles."""
    def k_first(x: Expr, other: Expr) -> bool:
        loads = [e for e in ir.toposort([x]) if e.op is Ops.LOAD]
        return _step_cost(loads, c.k) <= _step_cost(loads, other)

    return k_first(c.a, c.m), k_first(c.b, c.n)


VECTOR = 8  # 16-bit elements per 16-byte vector load of an mma tile fill


def mma_vector(dtype: dtypes.DType) -> int:
    """Elements per 16-byte vector load of a tile fill (mma, simt): ``VECTOR`` 16-bit ones, 4 float32, 2 float64."""
    return 16 // dtype.itemsize


def mma_vector_fill(c: Contraction) -> tuple[bool, bool]:
    """Whether the tile fill of ``a`` / ``b`` (``mma``, or ``simt``, whose operands are of ``c.dtype``) may read
    ``v = mma_vector(c.dtype)`` adjacent elements along its fast axis (see ``mma_fill_order``) with one 16-byte
    load: the operand is a plain load (no gate) whose index is
    affine in the ranges with coefficient 1 along that axis and every other coefficient and the offset multiples of
    ``v``, and the axis' size is a multiple of ``v`` (a vector starting at a multiple of it is wholly inside or
    wholly outside the bounds; tiles start at multiples of it). Buffers are whole pool allocations (256-byte
    aligned on CUDA and in the emulator), so such a vector is 16-byte aligned."""
    v = mma_vector(c.dtype)

    def ok(u: Expr, fast: Expr) -> bool:
        if u.op is not Ops.LOAD or len(u.srcs) != 1 or fast.arg[1] % v:
            return False
        terms, offset = ir._linear(u.srcs[0])
        if offset % v or any(r.op is not Ops.RANGE for r in terms) or terms.get(fast) != 1:
            return False
        return all(x % v == 0 for r, x in terms.items() if r is not fast)

    a_k, b_k = mma_fill_order(c)
    return ok(c.a, c.k if a_k else c.m), ok(c.b, c.k if b_k else c.n)


def simt_contraction(k: Kernel) -> Contraction | None:
    """``k``'s contraction for the ``simt`` layout: ``contraction.find_contraction``'s, of a dtype in
    ``SIMT_DTYPES`` (the operands are values of it), depending on every output loop; ``dtype`` is the reduce's."""
    if k.then:
        return None
    c = contraction.find_contraction(k)
    if c is None or c.red.dtype not in SIMT_DTYPES or set(c.red.ranges) != set(k.loops):
        return None
    return Contraction(c.red, c.m, c.n, c.k, c.a, c.b, c.red.dtype)


def simt_wide(c: Contraction) -> bool:
    """Whether ``widen_accumulators`` will accumulate ``c`` in float64: a float32 sum of ``opt.WIDE_ACC_MIN`` or
    more terms, which each thread of the ``simt`` layout adds in sequence."""
    return c.dtype is dtypes.float32 and c.k.arg[1] >= opt.WIDE_ACC_MIN


def simt_tiles(info: DeviceInfo, c: Contraction, stages: int = 1) -> tuple[int, ...]:
    """Indices into ``SIMT_TILES`` of the tilings that fit ``info`` (shared memory for ``stages`` buffers, threads
    per block) and whose accumulators fit ``SIMT_ACC_BYTES``."""
    limit = max(info.max_local_threads, WARP)
    shared = info.local_memory_bytes or 48 * 1024
    size, wide = c.dtype.itemsize, simt_wide(c)
    return tuple(i for i, t in enumerate(SIMT_TILES)
                 if t.threads <= limit and t.shared_bytes(size, stages) <= shared
                 and t.acc_bytes(8 if wide else size, wide) <= SIMT_ACC_BYTES)


def _simt_geometry(k: Kernel, info: DeviceInfo, tile: int | None = None,
                   stages: int | None = None) -> tuple[Geometry, bool] | None:
    """A contraction on CUDA cores (``simt_contraction``: tensor cores do not take its dtype, or float32 without
    ``allow_tf32``): one block per ``SimtTile`` of the output (and batch index), and whether the heuristic would
    take it (``SIMT_MIN``, ``SIMT_MIN_K``, blocks for half the SMs). ``tile`` and ``stages`` as ``_mma_geometry``'s:
    the heuristic takes, among the tilings that waste little on the edges (``SIMT_MIN_USED``), the first that gives
    every SM a block, else the one with the most blocks, and 2 stages when that tile fits them."""
    c = simt_contraction(k)
    if c is None:
        return None
    if stages not in SIMT_STAGES or not simt_tiles(info, c, stages):
        stages = None
    fits = simt_tiles(info, c, stages or 1)
    if not fits:
        return None
    batch = math.prod(r.arg[1] for r in k.loops if r is not c.m and r is not c.n)

    def blocks(t: SimtTile) -> int:
        return batch * -(-c.m.arg[1] // t.bm) * -(-c.n.arg[1] // t.bn)

    def used(t: SimtTile) -> float:  # the share of the tiles' outputs inside the bounds
        m, n = c.m.arg[1], c.n.arg[1]
        return m * n / (-(-m // t.bm) * t.bm * -(-n // t.bn) * t.bn)

    units = max(info.compute_units, 1)
    if tile not in fits:
        best = max(used(SIMT_TILES[i]) for i in fits)
        snug = [i for i in fits if used(SIMT_TILES[i]) >= SIMT_MIN_USED * best]
        full = [i for i in snug if blocks(SIMT_TILES[i]) >= units]
        tile = full[0] if full else max(snug, key=lambda i: (blocks(SIMT_TILES[i]), -i))
    if stages is None:
        stages = next(s for s in SIMT_STAGES if tile in simt_tiles(info, c, s))
    t = SIMT_TILES[tile]
    n = len(k.loops)
    pays = (min(c.m.arg[1], c.n.arg[1]) >= SIMT_MIN and c.k.arg[1] >= SIMT_MIN_K
            and 2 * max(blocks(SIMT_TILES[i]) for i in fits) >= units)
    return Geometry("simt", n, n, blocks(t), 1, 1, (t.threads, 1, 1), c, stages=stages, simt=t), pays


# the ``strategy`` parameter's values index this tuple
STRATEGIES = ("thread", "group", "columns", "mma", "tile", "scatter", "scan", "simt")

Params = Mapping[str, int]


def _choices(k: Kernel, info: DeviceInfo, root: Block, params: Params) -> tuple[str, dict[str, Geometry]]:
    """The heuristic's strategy and every legal geometry of ``k`` (by strategy name) under ``params``' sizes."""
    if info.warp_size not in (1, WARP):  # 1: a DeviceInfo that did not say
        raise ValueError(f"CUDA code generation assumes {WARP}-thread warps, {info.name} has {info.warp_size}")
    threads = params.get("threads", THREADS_PER_BLOCK)
    elems = params.get("elems_per_thread", ELEMS_PER_THREAD)
    depths = reduce_depths(root)
    s = depths[0] if depths else len(k.loops)
    if k.scan_ranges() and depths:
        raise NotImplementedError(f"kernel {k.name}: a scan kernel holds no reduce (fusion stores it first)")
    if not depths:  # elementwise or a scan: one thread per output, or the layout that applies instead
        thread = _thread_geometry(k, info, threads)
        alt = _scan_geometry(k, info) if k.scan_ranges() else _tile_geometry(k, info)
        return ("thread", {"thread": thread}) if alt is None else (alt.strategy, {"thread": thread, alt.strategy: alt})
    legal: dict[str, Geometry] = {}
    mma = _mma_geometry(k, info, params.get("mma_tile"), params.get("mma_stages"), params.get("mma_ldmatrix"),
                        params.get("mma_async"))
    if mma is not None:
        legal["mma"] = mma
    legal["group"] = _group_geometry(root, s, info, elems, params.get("warps_per_block", WARP_GROUPS_PER_BLOCK))
    cols = None
    if s == len(k.loops) and s > 0:  # reduces only at the innermost depth: one output per thread (or TY) is legal
        legal["thread"] = _thread_geometry(k, info, threads)
        cols = _columns_geometry(root, info, elems)
        if cols is not None:
            legal["columns"] = cols
    scatter = _scatter_geometry(k, info, threads)
    if scatter is not None:
        legal["scatter"] = scatter
    simt = _simt_geometry(k, info, params.get("simt_tile"), params.get("simt_stages"))
    if simt is not None:
        legal["simt"] = simt[0]
    if mma is not None:
        return "mma", legal
    if scatter is not None:
        return "scatter", legal
    if simt is not None and simt[1]:
        return "simt", legal
    if s == len(k.loops) and _prefer_thread(k, root, info):
        return "thread", legal
    if cols is not None and _columns_pay(root, cols):
        return "columns", legal
    return "group", legal


def plan(k: Kernel, info: DeviceInfo, params: Params | None = None) -> Geometry:
    """The geometry of a kernel whose loops are already normalized (see ``optimize``). ``params`` (names from
    ``search_space``) override the heuristic: ``strategy`` (an index into ``STRATEGIES``; ignored when that
    strategy is not legal for ``k``) and the sizes; every choice is correct, only speed differs."""
    p = params or {}
    root = linearize(k)
    chosen, legal = _choices(k, info, root, p)
    want = p.get("strategy")
    if want is not None and 0 <= want < len(STRATEGIES) and STRATEGIES[want] in legal:
        chosen = STRATEGIES[want]
    if chosen in ("group", "columns"):
        return replace(legal[chosen], unroll=max(1, p.get("unroll", UNROLL)))
    return legal[chosen]


def lane_strides(k: Kernel) -> dict[Expr, int | None]:
    """For each load that a top-level reduce runs in its loop: how many elements apart adjacent threads
    (``threadIdx.x``) read it under ``k``'s geometry (None: the index is not affine in the lanes' range). 0 or 1
    everywhere means coalesced. ``k`` went through ``optimize``."""
    geom, root = geometry(k), linearize(k)
    loops = output_loops(root)
    out: dict[Expr, int | None] = {}
    if geom.strategy in ("mma", "simt"):
        return out  # the block fills shared tiles along the contiguous axes (mma_fill_order; see render_cuda)
    for red in _top_reduces(root, geom.split):
        if geom.strategy == "group":
            chain = reduce_chain(red)
            lane = chain[flatten_count(chain) - 1].range
        else:
            lane = loops[geom.split - 1].range
        for ld in reduce_loads(red):
            out[ld] = ir.affine_coefficient(ld.srcs[0], lane)
    return out


# ---------------------------------------------------------------------------------------------------------------
# loop-order passes (IR to IR; the same iterations, so the same values up to the order of a reduce's terms)


def _substitute_stores(k: Kernel, mapping: dict[Expr, Expr]) -> tuple[Store, ...]:
    memo: dict = {}
    return tuple(Store(st.param, ir.substitute(st.index, mapping, memo), ir.substitute(st.value, mapping, memo))
                 for st in k.stores)


def _step_cost(loads: Sequence[Expr], r: Expr) -> int:
    """How far the loads that depend on ``r`` jump per step of ``r``, summed (a non-affine index: far)."""
    far = 1 << 40
    return sum(far if (c := ir.affine_coefficient(ld.srcs[0], r)) is None else abs(c) for ld in loads if r in ld.ranges)


def merge_nested_reduces(k: Kernel) -> Kernel:
    """A reduce whose body is a reduce of the same op and dtype becomes one reduce over both's ranges (the outer
    ones first): the same terms in another order (exact for max, min and integers; a float sum rounds as under
    any reordering), so that a cooperative layout spreads its lanes over all of them. A depthwise convolution's
    weight gradient, a sum over a batch of 4 of sums over the image, had its group's 32 lanes on the 4 images,
    each lane a 50176-float stride from the next."""
    mapping: dict[Expr, Expr] = {}
    for e in ir.toposort([st.value for st in k.stores] + [st.index for st in k.stores]):
        if e.op is not Ops.REDUCE:
            continue
        value = ir.substitute(e.srcs[0], mapping) if mapping else e.srcs[0]
        if value.op is Ops.REDUCE and value.arg[0] is e.arg[0] and value.dtype is e.dtype:
            mapping[e] = ir.reduce(e.arg[0], value.srcs[0], e.arg[1] + value.arg[1], e.dtype)
        elif value is not e.srcs[0]:
            mapping[e] = ir.reduce(e.arg[0], value, e.arg[1], e.dtype)
    return replace(k, stores=_substitute_stores(k, mapping)) if mapping else k


def order_reduce_ranges(k: Kernel) -> Kernel:
    """Reorder each multi-range reduce's loops so that the one its loads step through most finely is innermost
    (stable: ties keep their order). A cooperative reduce strides its threads along the innermost flattened loop,
    so this makes adjacent lanes read adjacent elements (a reduce over a transposed view's axes)."""
    mapping: dict[Expr, Expr] = {}
    for e in ir.toposort([st.value for st in k.stores] + [st.index for st in k.stores]):
        if e.op is not Ops.REDUCE:
            continue
        value = ir.substitute(e.srcs[0], mapping) if mapping else e.srcs[0]
        loads = [x for x in ir.toposort([value]) if x.op is Ops.LOAD]
        rs = e.arg[1]
        order = tuple(sorted(rs, key=lambda r: -_step_cost(loads, r))) if len(rs) > 1 else rs
        if order != rs or value is not e.srcs[0]:
            mapping[e] = ir.reduce(e.arg[0], value, order, e.dtype)
    return replace(k, stores=_substitute_stores(k, mapping)) if mapping else k


def order_output_loops(k: Kernel) -> Kernel:
    """For a kernel whose top-level reduces all sit in the innermost output loop (the ``columns`` / ``thread``
    layouts, whose lanes walk the output loops innermost first): move innermost the output loop along which a
    warp's reduce loads touch the fewest memory sectors (a column sum of a transposed view reads rows), when
    strictly better and every such reduce still depends on it (so none is hoisted). Scan kernels are left alone."""
    if len(k.loops) < 2 or k.scan_ranges():
        return k
    root = linearize(k)
    if reduce_depths(root)[:1] != [len(k.loops)]:
        return k
    reds = _top_reduces(root, len(k.loops))

    def cost(order: Sequence[Expr]) -> int:
        tx = _columns_tx(k.size)
        return sum(access_sectors(reduce_loads(r), _columns_lanes(order, r, tx)) for r in reds)

    best, best_cost = k.loops, cost(k.loops)
    for lane in k.loops[:-1]:
        if not all(lane in r.expr.ranges for r in reds):
            continue
        order = tuple(r for r in k.loops if r is not lane) + (lane,)
        c = cost(order)
        if c < best_cost:
            best, best_cost = order, c
    return k if best is k.loops else replace(k, loops=best)


# ---------------------------------------------------------------------------------------------------------------
# accumulator width


def serial_lengths(root: Block, geom: Geometry) -> dict[Expr, int]:
    """For each reduce, how many elements one thread accumulates in sequence."""
    out: dict[Expr, int] = {}
    coop = {id(r) for r in _top_reduces(root, geom.split)} if geom.strategy in ("group", "columns") else set()

    def visit(block: Block) -> None:
        for st in block.stmts:
            if isinstance(st, Reduce):
                chain = reduce_chain(st)
                length = loop_size(chain)
                if id(st) in coop:
                    f = flatten_count(chain)
                    length = -(-loop_size(chain[:f]) // geom.group_threads) * loop_size(chain[f:])
                out[st.expr] = length
                visit(st.loop.body)  # nested reduces (visit follows the chain of inner loops)
        if block.inner is not None:
            visit(block.inner.body)

    visit(root)
    return out


def needs_wide_acc(root: Block, geom: Geometry) -> bool:
    return any(e.arg[0] is Ops.ADD and e.dtype is dtypes.float32 and length >= opt.WIDE_ACC_MIN
               for e, length in serial_lengths(root, geom).items())


# ---------------------------------------------------------------------------------------------------------------
# the pass pipeline: each pass maps a kernel to a kernel; the launch is the ``Kernel.launch`` they build


Pass = Callable[[Kernel, DeviceInfo, Params], Kernel]


def _each_part(fn: Callable[[Kernel], Kernel]) -> Callable[[Kernel], Kernel]:
    """Apply ``fn`` to a kernel and to each of its ``then`` segments."""
    def apply(k: Kernel) -> Kernel:
        before = (k, *k.then)
        parts = [fn(x) for x in before]
        if all(a is b for a, b in zip(parts, before)):
            return k
        return replace(parts[0], then=tuple(parts[1:]))
    return apply


def normalize(k: Kernel, info: DeviceInfo, p: Params) -> Kernel:
    """Drop unit loops; host annotations (parallel loops, SIMD, split or vector accumulators, lanes, tiles,
    segments) and any earlier launch do not apply: a fresh kernel (every such field at its default) for the GPU
    passes."""
    k = opt.drop_unit_loops(k)
    return Kernel(k.name, k.params, k.loops, k.stores)


def split_segments(k: Kernel, info: DeviceInfo, p: Params) -> Kernel:
    """A kernel without reduces or scans whose loop ``opt.split_segments`` splits (cat's pieces, pad's bounds)
    becomes one loop nest per segment (``Kernel.then``), each normalized: one grid-stride loop per segment in
    one launch, each vectorized on its own."""
    if k.reduces() or k.scan_ranges():
        return k
    parts = opt.split_segments(k)
    if len(parts) == 1:
        return k
    parts = [opt.merge_loops(opt.drop_unit_loops(x)) for x in parts]
    return replace(parts[0], then=tuple(parts[1:]))


def merge_loops(k: Kernel, info: DeviceInfo, p: Params) -> Kernel:
    """``opt.merge_loops`` on each segment: adjacent output loops that index every buffer as one become one."""
    return _each_part(opt.merge_loops)(k)


def merge_reduces(k: Kernel, info: DeviceInfo, p: Params) -> Kernel:
    """``merge_nested_reduces`` on each segment."""
    return _each_part(merge_nested_reduces)(k)


def split_contraction_loops(k: Kernel, info: DeviceInfo, p: Params) -> Kernel:
    """``opt.split_divmod_loops`` on a kernel whose only reduce it turns into a contraction: attention's heads,
    merged with the columns of ``probs @ v`` by the output's reshape, reach ``probs`` as ``n // d``; split, the
    heads are a batch loop and the tiled layouts (``mma``, ``simt``) take the product. Other kernels unchanged."""
    if k.then or len(k.reduces()) != 1 or contraction.find_contraction(k) is not None:
        return k
    out = opt.split_divmod_loops(k)
    return out if out is not k and contraction.find_contraction(out) is not None else k


def order_reduce_ranges_pass(k: Kernel, info: DeviceInfo, p: Params) -> Kernel:
    """``order_reduce_ranges`` on each segment."""
    return _each_part(order_reduce_ranges)(k)


def order_output_loops_pass(k: Kernel, info: DeviceInfo, p: Params) -> Kernel:
    """``order_output_loops`` on each segment."""
    return _each_part(order_output_loops)(k)


def choose_layout(k: Kernel, info: DeviceInfo, p: Params) -> Kernel:
    """Attach ``Kernel.launch``: the strategy (``plan``) with its split of the loops, work items and block (the
    ``thread`` layout scalar, the grid not yet sized). Segments all take the ``thread`` layout (one block shape
    serves them all)."""
    if k.then:
        p = {**p, "strategy": STRATEGIES.index("thread")}
    return _each_part(lambda x: replace(x, launch=plan(x, info, p)))(k)


def vectorize(k: Kernel, info: DeviceInfo, p: Params) -> Kernel:
    """In the ``thread`` layout of a kernel without reduces or scans, ``vector`` consecutive outputs of the
    innermost loop per thread (``plan_vector``; the ``vector`` parameter): fewer work items, a block resized to
    them, the provably aligned loads and stores marked as vector accesses."""
    threads = p.get("threads", THREADS_PER_BLOCK)

    def apply(x: Kernel) -> Kernel:
        g = geometry(x, sized=False)
        if g.strategy != "thread":
            return x
        width, loads, stores = plan_vector(x, info, p.get("vector"))
        if width == 1:
            return x
        size = x.loops[-1].arg[1]
        items = g.items // size * -(-size // width)
        return replace(x, launch=replace(g, items=items, block=_thread_block(items, threads, info), vector=width,
                                         vector_loads=loads, vector_stores=stores))
    return _each_part(apply)(k)


def size_grid(k: Kernel, info: DeviceInfo, p: Params) -> Kernel:
    """The grid: ``ceil(items / per_block)`` blocks, capped at the device's limit (a grid-stride loop covers the
    rest). Segments share one block, the largest any of them wants (the block is baked into the source)."""
    parts = (k, *k.then)
    geoms = [geometry(x, sized=False) for x in parts]
    if len(parts) > 1:
        block = max(g.block for g in geoms)
        geoms = [replace(g, block=block) for g in geoms]
    sized = [replace(x, launch=replace(g, grid=_grid(g.items, g.per_block, info))) for x, g in zip(parts, geoms)]
    return replace(sized[0], then=tuple(sized[1:]))


def widen_accumulators(k: Kernel, info: DeviceInfo, p: Params) -> Kernel:
    """``wide_acc`` (float32 sums accumulated in double) when some thread adds ``opt.WIDE_ACC_MIN`` or more
    float32 terms in sequence under the launch; tensor cores (``mma``) accumulate in float32 as they are."""
    g = geometry(k)
    if g.strategy == "mma" or not needs_wide_acc(linearize(k), g):
        return k
    return replace(k, wide_acc=True)


GPU_PASSES: tuple[tuple[str, Pass], ...] = (
    ("normalize", normalize), ("split_segments", split_segments), ("merge_loops", merge_loops),
    ("merge_reduces", merge_reduces), ("split_contraction_loops", split_contraction_loops),
    ("order_reduce_ranges", order_reduce_ranges_pass),
    ("order_output_loops", order_output_loops_pass),
    ("choose_layout", choose_layout), ("vectorize", vectorize), ("size_grid", size_grid),
    ("widen_accumulators", widen_accumulators))
PASS_NAMES = tuple(name for name, _ in GPU_PASSES)
# passes that only change speed: tests switch them off (``DISABLED``) and compare results
OPTIONAL_PASSES = frozenset({"split_segments", "merge_loops", "merge_reduces", "split_contraction_loops",
                             "order_reduce_ranges", "order_output_loops", "vectorize"})
DISABLED: set[str] = set()


def optimize(k: Kernel, info: DeviceInfo, params: Params | None = None, until: str | None = None) -> Kernel:
    """Run ``GPU_PASSES`` in order (those in ``DISABLED`` skipped): the result carries its complete launch in
    ``Kernel.launch`` (and ``wide_acc`` if needed). ``params`` (names from ``search_space``; a missing name takes
    the heuristic's choice) override the heuristics; every candidate computes the same values up to the order
    of a reduce's terms. ``until`` stops after the named pass (a partial launch). ``ZYX_DEBUG=ir`` logs each
    pass that changes the kernel."""
    assert DISABLED <= OPTIONAL_PASSES, f"only {sorted(OPTIONAL_PASSES)} may be disabled, not {sorted(DISABLED)}"
    p = params or {}
    for name, fn in GPU_PASSES:
        if name not in DISABLED:
            out = fn(k, info, p)
            if utils.debug_on("ir") and out != k:
                g = out.launch
                launch = "none" if g is None else (f"{g.strategy} items={g.items} block={g.block} grid={g.grid} "
                                                    f"vector={g.vector}")
                utils.log("ir", f"gpu pass {name}: {k.name} loops={[r.arg[1] for r in out.loops]} "
                                f"segments={len(out.then) + 1} launch: {launch} wide_acc={out.wide_acc}")
            k = out
        if name == until:
            break
    return k


THREADS_CHOICES = (256, 128, 512, 64, 1024)  # thread-strategy block sizes worth timing
ELEMS_CHOICES = (8, 4, 16, 32)  # reduce elements per thread of a cooperative layout (group, columns)
WARPS_CHOICES = (8, 2, 4, 16)  # warps per block of a warp-mode group layout
UNROLL_CHOICES = (UNROLL, 4, 8)  # unroll of the cooperative layouts' lane-strided loops, the heuristic's first


def search_space(k: Kernel, info: DeviceInfo) -> dict[str, tuple[int, ...]]:
    """The geometry's tunable parameters for ``k`` and the values worth timing, the heuristic's first: the strategy
    (indices into ``STRATEGIES``, only the legal ones, listed only when there is a choice) and the sizes that the
    kernel's possible strategies read. Values past the device's block limit are left out; every candidate is a
    correct kernel (a value a strategy cannot use leaves it as the heuristic makes it, which renders the same)."""
    p: dict[str, tuple[int, ...]] = {}
    limit = max(info.max_local_threads, WARP)
    threads = tuple(t for t in THREADS_CHOICES if t <= limit)
    k = optimize(k, info, {}, until="order_output_loops")
    if k.then:
        p["threads"] = threads
        parts = (k, *k.then)
        if any(plan_vector(x, info, 1)[0] > 1 for x in parts):
            p["vector"] = (1, 0) if any(plan_vector(x, info)[0] > 1 for x in parts) else (0, 1)
        return p
    chosen, legal = _choices(k, info, linearize(k), {})
    if len(legal) > 1:
        order = [chosen] + [s for s in STRATEGIES if s in legal and s != chosen]
        p["strategy"] = tuple(STRATEGIES.index(s) for s in order)
    if "thread" in legal:
        p["threads"] = threads
        if plan_vector(k, info, 1)[0] > 1:  # vectorization is provable: on / off, the heuristic's first
            p["vector"] = (1, 0) if plan_vector(k, info)[0] > 1 else (0, 1)
    if "group" in legal or "columns" in legal:
        p["elems_per_thread"] = ELEMS_CHOICES
        p["unroll"] = UNROLL_CHOICES
    if "group" in legal:
        p["warps_per_block"] = tuple(w for w in WARPS_CHOICES if w * WARP <= limit)
    if "mma" in legal:
        first = MMA_TILES.index(legal["mma"].tile)
        dtype = legal["mma"].contraction.dtype  # type: ignore[union-attr]
        p["mma_tile"] = (first,) + tuple(i for i in mma_tiles(info, dtype) if i != first)
        stages = legal["mma"].stages
        p["mma_stages"] = (stages,) + tuple(s for s in MMA_STAGES if s != stages and mma_tiles(info, dtype, s))
        if legal["mma"].ldmatrix:
            p["mma_ldmatrix"] = (1, 0)
        if mma_async_applies(legal["mma"].contraction):  # type: ignore[arg-type]
            p["mma_async"] = (0, 1)
    if "simt" in legal:
        g = legal["simt"]
        c = g.contraction
        assert c is not None and g.simt is not None
        first = SIMT_TILES.index(g.simt)
        p["simt_tile"] = (first,) + tuple(i for i in simt_tiles(info, c) if i != first)
        p["simt_stages"] = (g.stages,) + tuple(s for s in SIMT_STAGES if s != g.stages and simt_tiles(info, c, s))
    return p


def geometry(k: Kernel, sized: bool = True) -> Geometry:
    """The launch ``optimize`` built (``Kernel.launch``); a clear error when the kernel did not go through it (or,
    with ``sized``, stopped before ``size_grid``)."""
    geom = k.launch
    if not isinstance(geom, Geometry) or (sized and geom.grid is None):
        raise ValueError(f"kernel {k.name} has no {'sized ' if sized else ''}GPU launch: pass it through "
                         "zyx.kernel.gpu.optimize first")
    return geom


__all__ = ["Contraction", "GPU_PASSES", "Geometry", "MMA_TILES", "MmaTile", "access_sectors", "coalesced_across",
           "find_contraction", "flatten_count", "geometry", "lane_strides", "mma_fill_order", "mma_k", "mma_pack",
           "MMA_STAGES", "mma_async_applies", "mma_async_stages", "mma_ldmatrix_applies",
           "mma_swizzle", "mma_swizzled", "mma_tiles", "mma_vector",
           "mma_vector_fill", "merge_nested_reduces",
           "optimize", "order_output_loops", "order_reduce_ranges", "output_blocks", "output_loops", "plan",
           "plan_vector", "tile_loads", "vector_piece", "contiguous_aligned",
           "reduce_chain", "reduce_depths", "reduce_loads", "reference_info", "search_space", "serial_lengths",
           "SIMT_TILES", "SimtTile", "simt_contraction", "simt_tiles", "simt_wide", "STRATEGIES"]

"""Fusion: which classes are stored, and which generated kernels compute them.

Invariants:
- A class is stored (a kernel boundary) when it is an output, the input or output of a copy or library
  node, a reduce needed by more than one kernel, a reduce whose placements would recompute it
  (``recompute_factors``, summed over the places its kernel runs it), a one-hot sum (a gather's gradient, which
  the host scatters in a kernel of its own), a large reduce nested in another in a kernel without output loops
  (it would run on one thread), or a costly elementwise value needed by several kernels (a large value that is
  cheap work over such reduces stores the reduces instead: a layer norm's ``x - mean``). Everything else is
  inlined into each kernel that needs it; movement ops are index arithmetic.
- A stored class whose own computation is cheap elementwise work ("inlinable") is still stored, but other
  kernels recompute it instead of loading it, so they do not have to wait for it.
- Kernels are grouped: stored classes of the same shape and device at the same dependency depth that read a
  common stored class become one kernel with several stores (the optimizer's parameter and state updates,
  the gradients of one shape). Depth strictly increases along every load, so groups never depend on each
  other in a cycle. A stored class read by another of its shape only at that one's own elements joins its kernel
  (``_contract``), a reduce read inside the body of a reduce of at least ``SHARED_ROW_MIN`` terms per output,
  broadcast back along the reduced axes, included (a variance and its mean: the kernel computes the mean once
  per row, stores it, and sums the squares).
- The planning fixpoint terminates by construction: each round either stores at least one class that was not
  stored before or returns, so it runs at most once per class (a reduce that its own kernel stores is never
  a reason for another round, even when the kernel evaluates it per element of an expanded output).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass

from zyx.backends.base import BackendError, ErrorStatus
from zyx.graph.lower import KernelBuilder, recompute_factors
from zyx.graph.node import Class, Node
from zyx.kernel import ir
from zyx.kernel.opt import SPLIT_REDUCE_MIN, one_hot_sum
from zyx.ops import ELEMENTWISE, MOVEMENT, TRANSCENDENTAL, Ops
from zyx.utils import log

SHARED_ELEMENTWISE_COST = 12
SHARED_REDUCE_FIRST_MIN = 1 << 16  # elements from which a cheap value over shared reduces stores the reduces
INLINE_STORED_COST = 16
# the cone cost (``_cone_cost``) from which a broadcast factor of a contraction is stored: a transcendental. The
# generated GEMM reads its left factor once per column panel: MiniLM's FFN down-projection with gelu(h + b1)
# inlined ran 101 ms per call (erf per element, three panels), against 4.2 ms on the stored activation
FACTOR_STORE_COST = 4


@dataclass
class KernelGroup:
    roots: list[Class]
    builder: KernelBuilder
    depth: int

    @property
    def name(self) -> str:
        c = self.roots[0]
        kind = "r" if any(e.op is Ops.REDUCE for e in self.builder.reduce_class) else "e"
        shape = "_".join(str(s) for s in c.shape) or "s"
        extra = f"_x{len(self.roots)}" if len(self.roots) > 1 else ""
        return f"{kind}_{shape}_{c.dtype.name}{extra}"


@dataclass
class Fusion:
    materialized: set[Class]
    aliases: dict[int, Class]  # id(output) -> stored class whose buffer it shares
    groups: list[KernelGroup]
    depth: dict[int, int]  # id(stored class) -> dependency depth (leaves 0)


def _cone_cost(c: Class, stop: set[Class], memo: dict[int, int]) -> int:
    """Cost of inlining ``c``: element ops (transcendentals 4), a reduce counts as unbounded."""
    if id(c) in memo:
        return memo[id(c)]
    if c.realized or c in stop or c.op is Ops.VAR:
        return 0
    n = c.node
    own = 4 if n.op in TRANSCENDENTAL else (1 if n.op in ELEMENTWISE else (1 << 20 if n.op is Ops.REDUCE else 0))
    memo[id(c)] = own + sum(_cone_cost(s, stop, memo) for s in n.srcs)
    return memo[id(c)]


def _reaches(c: Class, target: Class, stop: set[Class]) -> bool:
    """Whether ``c``'s inlined cone (not through ``stop``, realized classes or variables) holds ``target``."""
    stack, seen = [c], set()
    while stack:
        x = stack.pop()
        if x is target:
            return True
        if id(x) in seen or x.realized or x.op is Ops.VAR or (x in stop and x is not c):
            continue
        seen.add(id(x))
        stack.extend(x.node.srcs)
    return False


def _kernel_users(order: list[Class], stored: set[Class]) -> dict[int, set[int]]:
    """For each inlined class: the kernel roots (by id) that inline it."""
    out: dict[int, set[int]] = {}
    for root in order:
        if root not in stored:
            continue
        stack, seen = list(root.srcs), set()
        while stack:
            c = stack.pop()
            if id(c) in seen or c.realized or c in stored or c.op is Ops.VAR:
                continue
            seen.add(id(c))
            out.setdefault(id(c), set()).add(id(root))
            stack.extend(c.srcs)
    return out


def _aliases(classes: list[Class], stored: set[Class]) -> dict[int, Class]:
    """Stored classes (``classes`` in graph order) that are a reshape (or contiguous) of a stored or realized class
    share its buffer, and stored reshapes of one value that is not stored share the first one's (the same elements
    in the same order: a convolution's columns feed the forward GEMM and the weight gradient's in two shapes):
    no copy, no second kernel."""
    out: dict[int, Class] = {}
    first: dict[int, Class] = {}  # id(unstored value) -> the first stored reshape of it
    for c in classes:
        src = c
        while not src.realized and src.op in (Ops.RESHAPE, Ops.CONTIGUOUS):
            src = src.srcs[0]
        if src is c or src.device != c.device:
            continue
        if src.realized or (src in stored and id(src) not in out):
            out[id(c)] = src
        elif src not in stored:
            holder = first.setdefault(id(src), c)
            if holder is not c:
                out[id(c)] = holder
    return out


def _loads(c: Class, node: Node, loaded: set[Class], inline: set[Class]) -> list[Class]:
    """Stored classes and leaves a kernel computing ``node`` reads (looking through inlinable stored classes)."""
    out, seen, stack = [], set(), list(node.srcs)
    while stack:
        s = stack.pop()
        if id(s) in seen:
            continue
        seen.add(id(s))
        if s.op is Ops.VAR and not s.realized:
            continue
        if s.realized or (s in loaded and s not in inline):
            out.append(s)
            continue
        stack.extend(s.srcs)
    return out


KEEPS_INDEX = ELEMENTWISE | {Ops.CONTIGUOUS, Ops.RESHAPE}  # element i of the result reads flat element i of each input


def _moved_reads(c: Class, node: Node, loaded: set[Class], inline: set[Class]) -> set[int]:
    """Ids of the stored classes and leaves (``_loads``' classes) that ``node`` (computing ``c``) reads somewhere at
    another element than its own: through an op outside ``KEEPS_INDEX`` (a movement op, a reduce). A kernel
    computing ``node`` beside such a class would recompute it there instead of sharing it. One exception: inside a
    reduce's body, a value broadcast back along exactly the reduced axes (an expand from the reduce's shape to its
    body's) is read at the reduce's own element, once per output, as a variance reads its mean."""
    out: set[int] = set()
    seen: set[tuple] = set()
    first = _read_state(node.op, c.shape, node.srcs, False)
    stack = [(x, first) for x in node.srcs]
    while stack:
        s, state = stack.pop()
        if (id(s), state) in seen:
            continue
        seen.add((id(s), state))
        if s.op is Ops.VAR and not s.realized:
            continue
        if s.realized or (s in loaded and s not in inline):
            if state is True:
                out.add(id(s))
            continue
        state = _read_state(s.op, s.shape, s.srcs, state)
        stack.extend((x, state) for x in s.srcs)
    return out


# terms per output from which a reduce reading a stored reduce of its shape (broadcast back) may share its kernel:
# shorter ones (a pooling window) re-read what is cached anyway. A 3x3 stride-2 max pooling's maximum and first
# index (16x64x56^2) took 2.1 + 6.4 ms as two kernels, 12.7 ms as one (whose window loads lost if-conversion)
SHARED_ROW_MIN = 64


def _read_state(op: Ops, shape: tuple[int, ...], srcs: tuple[Class, ...], state: bool | tuple) -> bool | tuple:
    """Where the sources of an ``op`` of ``shape`` are read, given where it is read (``_moved_reads``): True (at
    other elements), False (at the root's own element) or, inside the body of a reduce over at least
    ``SHARED_ROW_MIN`` terms per output at the root's own element, (that reduce's shape, its body's shape). A
    reduce without output loops stays apart (alone, it splits across threads)."""
    if state is True or op in KEEPS_INDEX:
        return state
    if state is False and op is Ops.REDUCE and 1 < math.prod(shape) <= math.prod(srcs[0].shape) // SHARED_ROW_MIN:
        return shape, srcs[0].shape
    if state is not False and op is Ops.EXPAND and (srcs[0].shape, shape) == state:
        return False
    return True


def fuse(order: list[Class], outputs: list[Class], chosen: dict[int, Node]) -> Fusion:
    def computed_by(c: Class) -> Node:
        return chosen.get(id(c), c.nodes[0])

    stored: set[Class] = set(outputs)
    for c in order:
        if c.op in (Ops.COPY, Ops.CONTIGUOUS, Ops.SCAN):
            stored.add(c)
            if c.op is Ops.COPY:
                stored.add(c.srcs[0])
        n = chosen.get(id(c))
        if n is not None and n.op is Ops.KERNEL:
            stored.add(c)
            stored.update(n.arg.inputs)

    factors: set[Class] = set()  # stored and never inlined: a contraction would recompute them per use
    for c in order:
        for x in _reused_factors(computed_by(c)):
            if x not in stored and _cone_cost(x, stored, {}) >= FACTOR_STORE_COST:
                log("sched", f"store {x!r}: a contraction would recompute it per use")
                stored.add(x)
                factors.add(x)
    for c in order:  # a scan kernel holds no reduce: a reduce feeding it is stored first
        if c.op is Ops.SCAN and _cone_cost(c.srcs[0], stored, {}) >= 1 << 20:
            stored.add(c.srcs[0])
    position = {id(c): i for i, c in enumerate(order)}
    by_id = {id(c): c for c in order}
    tiled_units: dict[tuple, bool] = {}  # (member ids, ids of what they read) -> whether the kernel is a tiled GEMM
    for _round in range(len(order) + 2):
        # a value inlined by roots of different shapes (which cannot share a kernel) is stored once; the
        # latest such value first, since storing it hides everything upstream of it from those roots
        users = _kernel_users(order, stored)
        memo: dict[int, int] = {}
        shared = [c for c in order if c not in stored and
                  len({(by_id[r].device, by_id[r].shape) for r in users.get(id(c), ())}) > 1 and
                  (c.op is Ops.REDUCE or
                   (c.op in ELEMENTWISE and _cone_cost(c, stored, memo) >= SHARED_ELEMENTWISE_COST))]
        if shared:
            c = max(shared, key=lambda x: position[id(x)])
            if c.op is not Ops.REDUCE and c.numel >= SHARED_REDUCE_FIRST_MIN:
                # cheap elementwise work over shared reduces (a layer norm's x - mean), large: the reduces are
                # stored and each kernel recomputes the rest, instead of writing the value and reading it back
                below = [r for r in shared if r.op is Ops.REDUCE and _reaches(c, r, stored)]
                if below and _cone_cost(c, stored | set(below), {}) < SHARED_ELEMENTWISE_COST:
                    c = max(below, key=lambda x: position[id(x)])
            log("sched", f"store {c!r}: needed by kernels of {len(users[id(c)])} roots")
            stored.add(c)
            continue
        aliases = _aliases([c for c in order if c in stored], stored)
        roots = [c for c in order if c in stored and c.numel and id(c) not in aliases and c.op is not Ops.COPY and
                 computed_by(c).op is not Ops.KERNEL]
        # stored, but cheap enough that other kernels recompute them rather than wait for them
        inline = {c for c in roots if c.op in ELEMENTWISE and c not in factors and
                  _cone_cost(c, stored - {c}, {}) < INLINE_STORED_COST}
        units = [c for c in order if c in stored and id(c) not in aliases]
        deps: dict[int, list[Class]] = {}  # stored classes computed in this plan that c waits for
        reads: dict[int, list[Class]] = {}  # everything c's kernel loads (leaves too)
        moved: dict[int, set[int]] = {}  # of those, what c reads at other elements than its own
        for c in units:
            n = computed_by(c)
            if c.op is Ops.COPY:
                ds = [c.srcs[0]]
            elif n.op is Ops.KERNEL:
                ds = list(n.arg.inputs)
            else:
                ds = _loads(c, n, stored, inline)
                moved[id(c)] = {id(aliases[i]) if i in aliases else i for i in _moved_reads(c, n, stored, inline)}
            reads[id(c)] = ds
            deps[id(c)] = [a for a in (aliases.get(id(d), d) for d in ds) if not a.realized]
        root_ids = {id(c) for c in roots}
        unit_of = _contract(units, deps, root_ids, moved)
        members: dict[int, list[Class]] = {}
        for c in units:
            members.setdefault(unit_of[id(c)], []).append(c)
        depth = _unit_depths(units, deps, unit_of)

        def tiled(ms: list[Class], inline: set[Class] = inline, reads: dict[int, list[Class]] = reads) -> bool:
            """Whether unit ``ms``'s kernel holds a contraction that reuses both factors (``_reuses_both``). It
            builds that kernel (6 ms for a convolution's), so the answer is kept from round to round for the same
            members reading the same stored classes (``tiled_units``): once a contraction they inlined is stored,
            they read it instead, and the answer changes (a col2im's phases with their GEMM, then without)."""
            key = (tuple(id(c) for c in ms), tuple(id(d) for c in ms for d in reads[id(c)]))
            if key not in tiled_units:
                tiled_units[key] = _sums_products(ms, computed_by, stored, inline) and _tiled(
                    ms, KernelBuilder("k", stored - inline - set(ms), stored), position)
            return tiled_units[key]

        _delay_to_siblings(members, depth, deps, reads, unit_of, root_ids, tiled)
        class_depth = {id(c): depth[unit_of[id(c)]] for c in units}
        for i, src in aliases.items():
            class_depth[i] = class_depth.get(id(src), 0)
        buckets: dict[tuple, list[list[Class]]] = {}
        for u, ms in members.items():
            if id(ms[0]) in root_ids:
                alone = id(ms[0]) if ms[0].op is Ops.SCAN else None  # a scan's loop order is its own
                buckets.setdefault((depth[u], ms[0].device, ms[0].shape, alone), []).append(ms)
        groups = [(key[0], g) for key, units_ in buckets.items() for g in _share_groups(units_, reads, tiled)]
        result: list[KernelGroup] = []
        grew = False
        for d, group in groups:
            # the group computes its members: it reads neither them nor outputs sharing their buffers (a merged
            # unit that loaded such an alias read its own kernel's output before writing it)
            in_group = set(group)
            own_aliases = {by_id[i] for i, src in aliases.items() if src in in_group}
            b = KernelBuilder("k", stored - inline - in_group - own_aliases, stored)
            for c in sorted(group, key=lambda x: position[id(x)]):
                b.add_output(c)
            # a class's reduce placed in the loops of several other reduces (attention's scores, read by the
            # softmax's max, its sum and the weighted sum) is one reduce per place, each with its own ranges
            runs: dict[Class, int] = {}
            values = {e: rc.numel for e, rc in b.reduce_class.items()}
            for e, factor in recompute_factors(b.kernel(), values).items():
                rc = b.reduce_class[e]
                runs[rc] = runs.get(rc, 0) + factor
            for rc, factor in b.recomputed.items():  # found while lowering: the draft loads them already
                runs[rc] = max(runs.get(rc, 0), factor)
            why = [(rc, f"its kernel would recompute it {factor}x") for rc, factor in runs.items() if factor > 1]
            why += [(rc, "a contraction beside other reduces in one kernel is not tiled")
                    for rc in _side_by_side_contractions(b, computed_by)]
            why += [(rc, "a one-hot sum of its own kernel adds at its rows instead") for rc in _one_hot_sums(b)]
            why += [(rc, "a kernel without output loops splits only a lone reduce") for rc in _nested_full_reduces(b)]
            why += [(rc, "a contraction inside another reduce's loops is not tiled")
                    for rc in _nested_contractions(b, computed_by)]
            for rc, reason in why:
                if rc not in stored:
                    stored.add(rc)
                    grew = True
                    log("sched", f"store {rc!r}: {reason}")
            result.append(KernelGroup(group, b, d))
        if not grew:
            return Fusion(stored, aliases, sorted(result, key=lambda g: g.depth), class_depth)
    names = ", ".join(g.name for g in result[:4])
    raise BackendError(ErrorStatus.COMPILATION, f"fusion planning did not converge after {len(order) + 2} rounds "
                       f"(kernels {names}); please report this graph (ZYX_DEBUG=sched shows the rounds)")


class UnionFind:
    """Disjoint sets of hashable items (path halving); ``union(a, b)`` puts ``b``'s set under ``a``'s root."""

    def __init__(self, items: Iterable[Hashable]) -> None:
        self.parent = {x: x for x in items}

    def find(self, x: Hashable) -> Hashable:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: Hashable, b: Hashable) -> None:
        self.parent[self.find(b)] = self.find(a)


def _contract(units: list[Class], deps: dict[int, list[Class]], root_ids: set[int],
              moved: dict[int, set[int]]) -> dict[int, int]:
    """Union generated roots of one shape and device where one loads the other, only at its own elements
    (``moved``: where it reads the other elsewhere, the merged kernel would recompute the other there, and along
    a chain of such reads the recomputation multiplies), and no other path joins them (so the merged kernel
    computes both, sharing the work). Returns id(class) -> unit id."""
    sets = UnionFind(id(c) for c in units)
    parent, find = sets.parent, sets.find

    def users() -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for c in units:
            for d in deps[id(c)]:
                if id(d) in parent:
                    a, b = find(id(d)), find(id(c))
                    if a != b:
                        out.setdefault(a, set()).add(b)
        return out

    for c in units:
        if id(c) not in root_ids:
            continue
        for d in deps[id(c)]:
            if (id(d) not in root_ids or d.shape != c.shape or d.device != c.device or Ops.SCAN in (c.op, d.op)
                    or id(d) in moved.get(id(c), ())):
                continue
            a, b = find(id(d)), find(id(c))
            if a == b:
                continue
            fwd = users()
            # another path a -> ... -> b (through a third unit) would become a cycle once a and b merge
            stack = [u for u in fwd.get(a, ()) if u != b]
            seen: set[int] = set()
            cyclic = False
            while stack:
                u = stack.pop()
                if u == b:
                    cyclic = True
                    break
                if u in seen:
                    continue
                seen.add(u)
                stack.extend(fwd.get(u, ()))
            if not cyclic:
                sets.union(a, b)
    return {i: find(i) for i in parent}


def _delay_to_siblings(members: dict[int, list[Class]], depth: dict[int, int], deps: dict[int, list[Class]],
                       reads: dict[int, list[Class]], unit_of: dict[int, int], root_ids: set[int],
                       tiled: Callable[[list[Class]], bool]) -> None:
    """Move each generated unit that no other unit waits for, and that shares no read with a unit of its device and
    shape at its own depth, to the nearest later depth holding such a unit (neither a tiled contraction nor a scan),
    where ``_share_groups`` merges them: a normalization's bias gradient (a column sum of the output gradient) joins
    its weight gradient (which waits for the normalized input), and the gradient is read once. Depth still
    increases along every load: the moved unit waits for the same units as before, and none waits for it."""
    waited = {unit_of[id(x)] for c_id, ds in deps.items() if c_id in unit_of for x in ds
              if id(x) in unit_of and unit_of[id(x)] != unit_of[c_id]}

    def generated(ms: list[Class]) -> bool:
        return id(ms[0]) in root_ids and ms[0].op is not Ops.SCAN

    read_ids = {u: {id(d) for c in ms for d in reads[id(c)]} for u, ms in members.items()}
    # the deepest first, so that a unit moving next to one that moved itself finds it at its new depth
    for u in sorted((u for u, ms in members.items() if u not in waited and generated(ms)), key=lambda u: -depth[u]):
        ms = members[u]
        sharing = [v for v, vs in members.items() if v != u and depth[v] >= depth[u] and generated(vs) and
                   vs[0].device == ms[0].device and vs[0].shape == ms[0].shape and read_ids[u] & read_ids[v]]
        if any(depth[v] == depth[u] for v in sharing):
            continue  # it shares a kernel where it is (a col2im's phases): moving it would split that kernel
        later = [depth[v] for v in sharing if not tiled(members[v])]  # ``tiled`` builds kernels: asked last
        if later and not tiled(ms):
            depth[u] = min(later)


def _unit_depths(units: list[Class], deps: dict[int, list[Class]], unit_of: dict[int, int]) -> dict[int, int]:
    """Per unit: 1 + the longest chain of units it waits for (1 when it waits for none). Units are visited in
    dependency order over the merged graph: a merged unit's members may sit on both sides of a class that depends
    on one of them, so the order of ``units`` alone is not topological for units."""
    waits: dict[int, set[int]] = {unit_of[id(c)]: set() for c in units}
    for c in units:
        u = unit_of[id(c)]
        waits[u].update(unit_of[id(x)] for x in deps[id(c)] if id(x) in unit_of and unit_of[id(x)] != u)
    users: dict[int, list[int]] = {u: [] for u in waits}
    for u, ws in waits.items():
        for w in ws:
            users[w].append(u)
    pending = {u: len(ws) for u, ws in waits.items()}
    ready = [u for u, n in pending.items() if n == 0]
    depth: dict[int, int] = {}
    while ready:
        u = ready.pop()
        depth[u] = 1 + max((depth[w] for w in waits[u]), default=0)
        for v in users[u]:
            pending[v] -= 1
            if pending[v] == 0:
                ready.append(v)
    if len(depth) != len(waits):  # _contract never merges into a cycle; refuse rather than order it wrongly
        raise BackendError(ErrorStatus.COMPILATION, f"fusion made a cycle of {len(waits) - len(depth)} kernels; "
                           "please report this graph (ZYX_DEBUG=sched shows the stored classes)")
    return depth


def _product_sum(n: Node) -> bool:
    """A sum over products (through casts): a matmul's or a convolution's contraction."""
    if n.op is not Ops.REDUCE or n.arg[0] is not Ops.ADD:
        return False
    src = n.srcs[0]
    while not src.realized and src.op is Ops.CAST:
        src = src.srcs[0]
    return not src.realized and src.op is Ops.MUL


def _reduce_nesting(b: KernelBuilder) -> tuple[tuple[ir.Expr, ...], set[int]]:
    """The reduces of ``b``'s kernel and the ids of those inside another's loops (none when there is one)."""
    reds = b.kernel().reduces()
    if len(reds) < 2:
        return reds, set()
    return reds, {id(e) for e in ir.toposort([x for r in reds for x in r.srcs]) if e.op is Ops.REDUCE}


def _one_hot_sums(b: KernelBuilder) -> list[Class]:
    """The one-hot sums (``opt.one_hot_sum``: a gather's or an embedding's gradient) of ``b``'s kernel that its
    stores do not store directly: stored, each is a kernel of its own, which the host runs as adds at the rows the
    indices pick (``opt.scatter_one_hot``) instead of a compare per row: an SGD step of a 30000-row embedding, its
    gradient inlined into the update, took 1.29 s."""
    k = b.kernel()
    direct = {s.value for s in k.stores}
    return [b.reduce_class[r] for r in k.reduces() if r not in direct and r in b.reduce_class and
            one_hot_sum(r, k.loops) is not None]


def _nested_full_reduces(b: KernelBuilder) -> list[Class]:
    """The reduces nested in another reduce of a kernel without output loops (a whole tensor's variance: its mean
    inside the sum of squares; a mean cross-entropy: each row's log-sum-exp inside the mean over rows), when they
    run at least ``SPLIT_REDUCE_MIN`` iterations in all: such a kernel runs on one thread (only a lone reduce splits
    across threads), 10.6 ms for the std of 4096^2 (torch 5.4). Stored, each is a kernel of its own that runs in
    parallel (split, or over its rows)."""
    if b.kernel().loops:
        return []
    reds, inner = _reduce_nesting(b)
    if not inner:
        return []
    size = {id(r): math.prod(x.arg[1] for x in r.arg[1]) for r in reds}
    around = {id(r): max((size[id(o)] for o in reds if o is not r and r in ir.toposort([o.srcs[0]])), default=1)
              for r in reds if id(r) in inner}
    return [b.reduce_class[r] for r in reds if id(r) in inner and r in b.reduce_class and
            size[id(r)] * around[id(r)] >= SPLIT_REDUCE_MIN]


def _side_by_side_contractions(b: KernelBuilder, computed_by: Callable[[Class], Node]) -> list[Class]:
    """The contraction classes of ``b``'s kernel when it runs several reduces side by side (none inside another's
    loops), one of them a contraction reusing both factors (``_reuses_both``): ``x @ w1 + (x @ w2).relu()`` or a
    recurrent cell's ``x @ wx + h @ wh`` as one loop nest ran 100x slower than a tiled GEMM each. Stored, each is a
    kernel of its own. A dot product without reuse (``(x * y).sum(-1)``) is untiled either way and stays. (A
    contraction inside another reduce's loops: ``_nested_contractions``.)"""
    reds, inner = _reduce_nesting(b)
    top = [r for r in reds if id(r) not in inner and r in b.reduce_class]
    picked = [b.reduce_class[r] for r in top if _reuses_both(r) and _product_sum(computed_by(b.reduce_class[r]))]
    return picked if len(top) > 1 and picked else []


def _reused_factors(n: Node) -> list[Class]:
    """The factors of the contraction ``n`` (a sum of products) that it reads broadcast, so uses each element for
    several outputs: the class under each factor's movement ops (and casts) when an expand is among them."""
    if not _product_sum(n):
        return []
    src = n.srcs[0]
    while src.op is Ops.CAST:
        src = src.srcs[0]
    out = []
    for x in src.srcs:
        expanded = False
        while not x.realized and (x.op in MOVEMENT or x.op is Ops.CAST):
            expanded = expanded or x.op is Ops.EXPAND
            x = x.srcs[0]
        if expanded and not x.realized and x.op in ELEMENTWISE:
            out.append(x)
    return out


def _nested_contractions(b: KernelBuilder, computed_by: Callable[[Class], Node]) -> list[Class]:
    """The contraction classes of ``b``'s kernel that run inside another reduce's loops and reuse both operands
    (``_reuses_both``: a matmul's or a convolution's shape): nested, each of their outputs is a dot product of its
    own, untiled. The loss ``sum(conv2d(x, w) * g)`` of a 3x3 convolution (32x32x32x32 to 64 channels) ran 1 s as
    one loop nest, 3 ms with the convolution stored (a GEMM) and summed after. A dot product without reuse (a row's
    ``(a * b).sum(-1)`` inside a mean) stays nested: that kernel reads its operands once either way."""
    reds, inner = _reduce_nesting(b)
    return [b.reduce_class[r] for r in reds if id(r) in inner and r in b.reduce_class and _reuses_both(r) and
            _product_sum(computed_by(b.reduce_class[r]))]


def _tiled(ms: list[Class], b: KernelBuilder, position: dict[int, int]) -> bool:
    """Whether the kernel ``b`` builds for unit ``ms`` holds a contraction that reuses both factors."""
    for c in sorted(ms, key=lambda x: position[id(x)]):
        b.add_output(c)
    return any(_reuses_both(r) for r in b.kernel().reduces())


def _reuses_both(r: ir.Expr) -> bool:
    """Whether reduce ``r`` sums products whose two factors each miss a loop the other depends on (outside ``r``'s
    own ranges): every element of either factor is used for several outputs, as in a GEMM."""
    v = r.srcs[0]
    while v.op is Ops.CAST:
        v = v.srcs[0]
    if v.op is not Ops.MUL:
        return False
    own = set(r.arg[1])
    a, b = (x.ranges - own for x in v.srcs)
    return bool(a - b) and bool(b - a)


def _sums_products(members: list[Class], computed_by: Callable[[Class], Node], stored: set[Class],
                   inline: set[Class]) -> bool:
    """Whether the kernel of ``members`` computes a sum of products (what a matmul or a convolution lowers to),
    looking through the classes it inlines."""
    stack, seen = list(members), set()
    while stack:
        c = stack.pop()
        if id(c) in seen or c.realized or c.op is Ops.VAR:
            continue
        seen.add(id(c))
        n = computed_by(c)
        if _product_sum(n):
            return True
        stack.extend(x for x in n.srcs if x not in stored or x in inline)
    return False


def _share_groups(units: list[list[Class]], reads: dict[int, list[Class]],
                  tiled: Callable[[list[Class]], bool]) -> list[list[Class]]:
    """Merge units (of one depth, device and shape) that read a common stored class: one kernel then loads it
    once. Units sharing nothing stay apart (merging them saves a launch but costs parallelism, e.g. one
    kernel computing many unrelated full reductions one after another), and so does a unit whose kernel is a
    contraction the device tiles as a GEMM (``tiled``): beside another reduce it would be one loop nest per output
    (x @ wq, x @ wk and x @ wv in one kernel ran 300x slower). Dot products without reuse (a row's
    ``(x * y).sum(-1)``, a sum of squares) share: a dot product and two norms of 8192x1024 rows, 2.5 -> 1.5 ms."""
    readers: dict[int, int] = {}  # id(stored class) -> how many units read it
    for ms in units:
        for d in {id(d) for c in ms for d in reads[id(c)]}:
            readers[d] = readers.get(d, 0) + 1
    sets = UnionFind(range(len(units)))
    first_reader: dict[int, int] = {}
    for i, ms in enumerate(units):
        # a unit sharing no read stays alone whatever it computes: ``tiled`` (which builds its kernel) is not asked
        # (asking it of every unit had made planning a convolution's forward and backward 40% slower)
        if not any(readers[id(d)] > 1 for c in ms for d in reads[id(c)]) or tiled(ms):
            continue
        for c in ms:
            for d in reads[id(c)]:
                sets.union(first_reader.setdefault(id(d), i), i)
    out: dict[int, list[Class]] = {}
    for i, ms in enumerate(units):
        out.setdefault(sets.find(i), []).extend(ms)
    return list(out.values())

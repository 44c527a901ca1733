"""Place a kernel's expression DAG into a loop nest (loop-invariant code motion by construction).

Every expression is defined once, in the block of the innermost loop among the ranges it depends on, so a
value that depends only on outer loops (a broadcast reduce result, an expanded load) is computed once per
outer iteration. A reduce becomes an accumulator initialized in its home block, its own loops, and an
update in its innermost loop body. Stores go into the innermost output loop.

Invariant: the ranges one expression depends on always lie on one chain of nested loops, so "innermost"
is well defined.

In a kernel of ``opt.upcast_rows`` (``Kernel.upcast_rows``), reduces over the same range tuple (copies of one
reduce for several outputs, none depending on another) share one loop nest: one ``Reduce`` statement, the first
as ``expr`` and the others in ``siblings``, each with its accumulate statement in the innermost body. The values
outside the loops that a later sibling needs are placed before the shared statement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zyx.kernel import ir
from zyx.kernel.ir import Expr, Kernel, Store
from zyx.ops import Ops


@dataclass(eq=False)
class Block:
    stmts: list = field(default_factory=list)  # Expr (define it), Reduce, Store
    inner: Loop | None = None  # the nested loop, rendered after stmts
    tail: list = field(default_factory=list)  # statements after the nested loop


@dataclass(eq=False)
class Loop:
    range: Expr
    body: Block
    kind: str = "serial"  # "serial", "parallel", "simd"
    collapse: int = 1


@dataclass(eq=False)
class ScanInit:
    """Declare the accumulator of scan ``expr`` before the loop it runs along; ``expr`` itself is then a
    statement of that loop's body that folds in its value and names the running result."""

    expr: Expr


@dataclass(eq=False)
class Reduce:
    """Accumulate ``expr.srcs[0]`` over ``loop`` (a nest of the reduce's ranges) into ``expr``'s variable."""

    expr: Expr
    loop: Loop
    split: bool = False  # split across threads (root reduce of a kernel with no output loops)
    vec: Expr | None = None  # accumulate one value per iteration of this (output) range, innermost
    block: tuple[int, int] | None = None  # (reduce iterations, tile of ``vec``) of a register-tiled ``vec``
    siblings: list[Expr] = field(default_factory=list)  # further reduces over the same ranges, in these loops

    @property
    def exprs(self) -> list[Expr]:
        return [self.expr, *self.siblings]


def linearize(k: Kernel) -> Block:
    root = Block()
    block_of: dict[Expr, Block] = {}
    parent_of: dict[Expr, Block] = {}
    depth: dict[Expr, int] = {}
    cur = root
    for i, r in enumerate(k.loops):
        parent_of[r] = cur
        kind = "parallel" if i < k.parallel else "serial"
        if i == len(k.loops) - 1 and k.vector:
            kind = "simd" if kind == "serial" else "parallel_simd"
        loop = Loop(r, Block(), kind)
        if i == 0 and k.parallel > 1:
            loop.collapse = k.parallel
        cur.inner = loop
        cur = loop.body
        block_of[r] = cur
        depth[r] = i + 1
    innermost = cur
    done: set[int] = set()
    emitted: list[Expr] = []
    vec = k.vector_acc

    def home(e: Expr) -> Block:
        rs = e.ranges
        if not rs:
            return root
        return block_of[max(rs, key=lambda r: depth[r])]

    def emit(e: Expr) -> None:
        if id(e) in done or e.op in (Ops.CONST, Ops.RANGE):
            return
        done.add(id(e))
        if e.op is Ops.REDUCE:
            vectorized = vec is not None and vec in e.ranges
            shared = groups.get(e.arg[1]) if upcast and not vectorized else None
            if shared is not None:
                join(e, *shared)
                return
            if vectorized and e.arg[1] in vector_groups:
                join_vector(e, *vector_groups[e.arg[1]])
                return
            deps = e.ranges - {vec} if vectorized else e.ranges
            outer = block_of[max(deps, key=lambda r: depth[r])] if deps else root
            base = max((depth[r] for r in deps), default=0)
            loops = []
            for j, r in enumerate(e.arg[1] + ((vec,) if vectorized else ())):
                loops.append(Loop(r, Block(), "serial"))
                depth[r] = base + j + 1
            for a, b in zip(loops, loops[1:]):
                a.body.inner = b
            saved = (block_of.get(vec), depth.get(vec)) if vectorized else None
            for loop in loops:
                block_of[loop.range] = loop.body
            if vectorized:
                depth[vec] = base + len(loops)
            start = len(emitted)
            # values of the vectorized range defined outside (in the output loop, rendered after the reduce)
            # are not visible inside it: the reduce defines its own
            hidden = [x for x in emitted if vec in x.ranges and id(x) in done] if vectorized else []
            for x in hidden:
                done.discard(id(x))
            emit(e.srcs[0])
            body = loops[-1].body
            body.tail.append(e)  # the accumulate statement
            if body.inner is None and not any(isinstance(x, Reduce) for x in body.stmts):
                # simd on the innermost loop only: over a loop nesting a reduce, GCC's lanes kept the inner
                # sums from vectorizing (a depthwise convolution's weight gradient sums each sample's positions
                # inside the sum over the batch)
                loops[-1].kind = "simd"
            inside: list[Expr] = []
            if vectorized:
                # and the reduce's own are out of scope after it
                block_of[vec], depth[vec] = saved
                inside = [x for x in emitted[start:] if vec in x.ranges]
                for x in inside:
                    done.discard(id(x))
                done.update(id(x) for x in hidden)
            red = Reduce(e, loops[0], split=k.split_reduce and outer is root, vec=vec if vectorized else None,
                         block=k.vector_block if vectorized and len(loops) == 2 else None)
            outer.stmts.append(red)
            if vectorized:
                vector_groups[e.arg[1]] = (red, loops[-1], base + len(loops), inside)
            else:
                groups[e.arg[1]] = (red, loops[-1])
            return
        for s in e.srcs:
            emit(s)
        if e.op is Ops.SCAN:
            r = e.srcs[1]
            assert home(e) is block_of[r], "a scan's loop must be the innermost loop its value depends on"
            parent_of[r].stmts.append(ScanInit(e))
        home(e).stmts.append(e)
        emitted.append(e)

    groups: dict[tuple[Expr, ...], tuple[Reduce, Loop]] = {}  # reduce ranges -> their statement
    # vectorized reduces (``vec``) by their ranges -> (statement, the tile loop, its depth, the values of the tile
    # range defined in its loops): side-by-side reduces over the same ranges (``opt.interchange_reduce``) accumulate
    # in one loop nest
    vector_groups: dict[tuple[Expr, ...], tuple[Reduce, Loop, int, list[Expr]]] = {}
    upcast = k.upcast_rows > 1

    def join_vector(e: Expr, red: Reduce, inner: Loop, vec_depth: int, inside: list[Expr]) -> None:
        """Sibling ``e`` accumulates in the loops of vectorized ``red``, ``inner`` its tile loop: the values of the
        tile range it needs are defined in there, where those ``red``'s loops define (``inside``) are in scope
        again (the scope ``emit`` gives a vectorized reduce's own)."""
        assert not red.block, "register-tiled column sums are a kernel's only reduce"
        saved = block_of[vec], depth[vec]
        block_of[vec], depth[vec] = inner.body, vec_depth
        hidden = [x for x in emitted if vec in x.ranges and id(x) in done]
        for x in hidden:
            done.discard(id(x))
        done.update(id(x) for x in inside)
        start = len(emitted)
        join(e, red, inner)
        block_of[vec], depth[vec] = saved
        new = [x for x in emitted[start:] if vec in x.ranges]
        inside.extend(new)
        for x in inside:
            done.discard(id(x))
        done.update(id(x) for x in hidden)

    def join(e: Expr, red: Reduce, inner: Loop) -> None:
        """Sibling ``e`` accumulates in ``red``'s loops (``_order_blocks`` then places what it needs first)."""
        inside = {id(x) for x in ir.toposort([e.srcs[0]])}
        assert not any(id(m) in inside for m in red.exprs), "a reduce sharing loops reads another of them"
        emit(e.srcs[0])
        inner.body.tail.append(e)
        red.siblings.append(e)

    for st in k.stores:
        emit(st.index)
        emit(st.value)
    innermost.tail.extend(k.stores)
    if root.inner is not None and root.inner.collapse > 1 and root.inner.body.stmts:
        root.inner.collapse = 1  # collapse needs perfectly nested loops
    if any(red.siblings for red, *_ in (*groups.values(), *vector_groups.values())):
        _order_blocks(root)
    return root


def _order_blocks(block: Block) -> None:
    """Reorder every block's statements (stably) so each follows the statements defining what it reads: a
    sibling's values outside the shared loops were emitted after the shared ``Reduce`` statement."""
    defined: dict[int, int] = {}  # id(expr) -> position of its defining statement in this block
    for i, s in enumerate(block.stmts):
        for e in (s.exprs if isinstance(s, Reduce) else [] if isinstance(s, ScanInit) else [s]):
            defined[id(e)] = i
    needs: list[set[int]] = []
    for i, s in enumerate(block.stmts):
        if isinstance(s, Reduce):
            reads = ir.toposort([e.srcs[0] for e in s.exprs])
        elif isinstance(s, ScanInit):
            reads = []
        else:
            reads = list(s.srcs)
        needs.append({defined[id(x)] for x in reads if id(x) in defined and defined[id(x)] != i})
    order: list[int] = []
    placed: set[int] = set()
    while len(order) < len(block.stmts):
        i = next(i for i in range(len(block.stmts)) if i not in placed and needs[i] <= placed)
        order.append(i)
        placed.add(i)
    block.stmts[:] = [block.stmts[i] for i in order]
    for s in block.stmts:
        if isinstance(s, Reduce):
            _order_blocks(s.loop.body)
    if block.inner is not None:
        _order_blocks(block.inner.body)


def walk(block: Block):
    """Yield every statement (Expr, Reduce, Store) in program order."""
    for s in block.stmts:
        yield s
        if isinstance(s, Reduce):
            yield from walk(s.loop.body)
    if block.inner is not None:
        yield from walk(block.inner.body)
    for s in block.tail:
        yield s


__all__ = ["Block", "Loop", "Reduce", "ScanInit", "Store", "linearize", "walk"]

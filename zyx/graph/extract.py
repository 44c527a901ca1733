"""Extraction: choose one node per needed class so that the total estimated time is least.

A class's alternatives are its own node (fused generated code) and the ``Ops.KERNEL`` library nodes devices
added in ``match_graph``. The total time of a choice counts every class reachable from the outputs through
the chosen nodes once (shared inputs are paid once), which is why choosing per class greedily is not
optimal in general. Small choice spaces are searched exhaustively; larger ones start from a greedy choice
improved by single flips, then branch and bound (lower bound: classes needed whatever the remaining
choices, each unchosen class at its cheapest own cost) searches for better within a budget. Both searches
are bounded in class visits (``SEARCH_VISITS``), so planning a large graph stays fast.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping

from zyx.backends.base import LibraryKernel
from zyx.dtypes import DType
from zyx.graph import ops as g
from zyx.graph.match import BiasAdd, Matmul, match_bias_add, match_matmul
from zyx.graph.match_attention import Attention, match_attention
from zyx.graph.node import Class, Node
from zyx.kernel.target import DeviceInfo
from zyx.ops import ELEMENTWISE, MOVEMENT, Ops
from zyx.utils import debug_on, log

CostFn = Callable[[Class, Node], float]
EXHAUSTIVE_LIMIT = 4096
SEARCH_VISITS = 300_000  # class visits a search may spend: every combination or partial choice walks the graph
MIN_SEARCH_BUDGET = 64  # partial choices the branch and bound may examine however large the graph
GENERATED_NS_PER_ELEMENT = 1.0  # one fused element operation on one compute unit
_VIEWS = MOVEMENT | {Ops.GATHER, Ops.TAKE_ALONG}  # graph ops that generated code reads in place (index arithmetic)


class Graph:
    """What ``Device.match_graph`` sees: the classes a realize needs, matmul and attention matchers, a way to add
    library alternatives."""

    def __init__(self, classes: list[Class], outputs: list[Class]) -> None:
        self.classes = classes
        self.outputs = outputs
        self._matmuls: list[Matmul] | None = None
        self._attentions: list[Attention] | None = None
        self._bias_adds: list[BiasAdd] | None = None

    def matmuls(self) -> list[Matmul]:
        if self._matmuls is None:
            self._matmuls = [m for m in map(match_matmul, self.classes) if m is not None]
        return self._matmuls

    def match_matmul(self, c: Class) -> Matmul | None:
        return match_matmul(c)

    def attentions(self) -> list[Attention]:
        """``match_attention`` over the classes (computed once)."""
        if self._attentions is None:
            self._attentions = [a for a in map(match_attention, self.classes) if a is not None]
        return self._attentions

    def bias_adds(self) -> list[BiasAdd]:
        """``match_bias_add`` over the classes: a matmul's result plus a row broadcast over it (computed once)."""
        if self._bias_adds is None:
            by_class = {id(m.cls): m for m in self.matmuls()}
            self._bias_adds = [b for c in self.classes if (b := match_bias_add(c, by_class)) is not None]
        return self._bias_adds

    def cast(self, c: Class, dtype: DType) -> Class:
        """``c`` converted to ``dtype`` (a new class a library alternative may read; generated code computes it)."""
        return g.cast(c, dtype)

    def add_alternative(self, c: Class, kernel: LibraryKernel) -> None:
        for n in c.nodes[1:]:
            if n.arg.device is kernel.device and n.arg.name == kernel.name and n.srcs == tuple(kernel.inputs):
                return  # planned before (same class, same device): keep one copy
        c.nodes.append(Node(Ops.KERNEL, tuple(kernel.inputs), kernel))


def default_cost(info: Callable[[str], DeviceInfo], measured: Mapping[tuple[int, int], float] | None = None,
                 contractions: Mapping[int, int] | None = None) -> CostFn:
    """Time (ns) of computing one node: measured (``measured[(id(class), id(node))]``, from autotuning) where
    known, else estimated: library kernels carry their own estimate; generated work is counted per element and
    operation, spread over the device's compute units, except a matmul (``contractions``: ``contraction_flops``)
    where the device has a register-tiled GEMM (``contraction_gflops``): a launch and its flops at that rate."""
    measured = measured or {}
    contractions = contractions or {}

    def units(device: str) -> int:
        return info(device).compute_units

    def cost(c: Class, n: Node) -> float:
        if measured:
            t = measured.get((id(c), id(n)))
            if t is not None:
                return t
        if n.op is Ops.KERNEL:
            return n.arg.est_ns + sum(_copy_ns(x, units) for x in n.arg.inputs)
        flops = contractions.get(id(c))
        if flops is not None:
            dev = info(c.device)
            if dev.contraction_gflops > 0:  # a kernel of its own; the product is inside it (0 flops)
                if not flops:
                    return 0.0
                return dev.launch_overhead_ns + flops * c.dtype.itemsize / (4 * dev.contraction_gflops)
        if n.op in ELEMENTWISE:
            return c.numel * GENERATED_NS_PER_ELEMENT / units(c.device)
        if n.op is Ops.REDUCE:
            return n.srcs[0].numel * GENERATED_NS_PER_ELEMENT / units(c.device)
        return 0.0

    cost.measured = measured
    return cost


def contraction_flops(matmuls: Iterable[Matmul]) -> dict[int, int]:
    """``default_cost``'s ``contractions``: the id of each matmul's class -> its flops, and of the product it sums
    (a generated contraction multiplies as it accumulates) -> 0."""
    out: dict[int, int] = {}
    for m in matmuls:
        out[id(m.cls)] = m.flops
        out[id(m.cls.srcs[0])] = 0
    return out


def _copy_ns(x: Class, compute_units: Callable[[str], int]) -> float:
    """Time of materializing library input ``x`` (inputs are read contiguously): nothing for a buffer or a reshape
    of a value computed anyway (the buffer is shared); for a view or gather, which generated code reads in place
    (index arithmetic, no cost), two passes over its elements: the copy writes them, the library reads them back.
    A convolution's im2col columns are 9x its input; a depthwise one's GEMM (one row per group) reads each column
    element once, so its library alternative costs more than the generated sum of products by the GEMM itself."""
    src = x
    while not src.realized and src.op in (Ops.RESHAPE, Ops.CONTIGUOUS):
        src = src.srcs[0]
    if src.realized or src.op not in _VIEWS:
        return 0.0
    return 2 * x.numel * GENERATED_NS_PER_ELEMENT / compute_units(x.device)


def _srcs(c: Class, choice: dict[int, Node]) -> tuple[Class, ...]:
    if c.realized:
        return ()
    n = choice.get(id(c))
    return (n if n is not None else c.nodes[0]).srcs


def needed(outputs: list[Class], choice: dict[int, Node], stop: Mapping[int, Class] | None = None) -> list[Class]:
    """Classes reachable from ``outputs`` through the chosen nodes, sources first (leaves excluded), not entering
    the classes ``stop`` holds (by id)."""
    stop = stop or {}
    order: list[Class] = []
    seen: set[int] = set()
    for out in outputs:
        stack: list[tuple[Class, bool]] = [(out, False)]
        while stack:
            c, done = stack.pop()
            if done:
                order.append(c)
                continue
            if id(c) in seen or c.realized or c.op is Ops.VAR or id(c) in stop:
                continue
            seen.add(id(c))
            stack.append((c, True))
            stack.extend((s, False) for s in reversed(_srcs(c, choice)))
    return order


def total_cost(outputs: list[Class], choice: dict[int, Node], cost: CostFn) -> float:
    total = 0.0
    for c in needed(outputs, choice):
        n = choice.get(id(c))
        total += cost(c, n if n is not None else c.nodes[0])
    return total


def extract(outputs: list[Class], cost: CostFn, exhaustive_limit: int = EXHAUSTIVE_LIMIT) -> dict[int, Node]:
    """Map id(class) → chosen node for every reachable class that has alternatives."""
    base: dict[int, Node] = {}
    # classes with alternatives reachable under *some* choice: grow until stable
    choosable: list[Class] = []
    seen: set[int] = set()
    frontier = list(outputs)
    while frontier:
        c = frontier.pop()
        if id(c) in seen or c.realized or c.op is Ops.VAR:
            continue
        seen.add(id(c))
        if len(c.nodes) > 1:
            choosable.append(c)
        for n in c.nodes:
            frontier.extend(n.srcs)
    if not choosable:
        return base
    raw_cost, cost = cost, _memoized(cost)
    space = math.prod(len(c.nodes) for c in choosable)
    if space <= exhaustive_limit and space * len(seen) <= SEARCH_VISITS:
        best, best_cost = None, math.inf
        for combo in itertools.product(*(c.nodes for c in choosable)):
            choice = {id(c): n for c, n in zip(choosable, combo)}
            t = total_cost(outputs, choice, cost)
            if t < best_cost:
                best, best_cost = choice, t
        result = best
    else:
        result = _branch_and_bound(outputs, choosable, cost, _greedy_then_improve(outputs, choosable, cost),
                                   max(MIN_SEARCH_BUDGET, SEARCH_VISITS // len(seen)))
    if debug_on("sched"):
        for c in choosable:
            known = getattr(raw_cost, "measured", {})
            alts = ", ".join(f"{_label(n)}={cost(c, n) / 1e3:.1f}us "
                             f"{'measured' if (id(c), id(n)) in known else 'estimated'}" for n in c.nodes)
            log("sched", f"{c!r}: chose {_label(result[id(c)])} among [{alts}]")
    return result


def _memoized(cost: CostFn) -> CostFn:
    """``cost`` computed once per (class, node) during one extraction (the searches ask again and again)."""
    memo: dict[tuple[int, int], float] = {}

    def cached(c: Class, n: Node) -> float:
        key = (id(c), id(n))
        t = memo.get(key)
        if t is None:
            t = memo[key] = cost(c, n)
        return t

    return cached


def _label(n: Node) -> str:
    return f"library:{n.arg.name}" if n.op is Ops.KERNEL else f"generated:{n.op.name.lower()}"


def _greedy_then_improve(outputs: list[Class], choosable: list[Class], cost: CostFn) -> dict[int, Node]:
    # greedy: per class, the node whose own cost plus the (tree) cost of its inputs is least
    memo: dict[int, float] = {}

    def tree(c: Class) -> float:
        if c.realized or c.op is Ops.VAR:
            return 0.0
        if id(c) not in memo:
            memo[id(c)] = math.inf  # cycle guard
            memo[id(c)] = min(cost(c, n) + sum(tree(s) for s in n.srcs) for n in c.nodes)
        return memo[id(c)]

    choice = {id(c): min(c.nodes, key=lambda n, c=c: cost(c, n) + sum(tree(s) for s in n.srcs)) for c in choosable}
    current = total_cost(outputs, choice, cost)
    improved = True
    while improved:
        improved = False
        for c in choosable:
            for n in c.nodes:
                if n is choice[id(c)]:
                    continue
                trial = dict(choice)
                trial[id(c)] = n
                t = total_cost(outputs, trial, cost)
                if t < current:
                    choice, current, improved = trial, t, True
    return choice


def _lower_bound(outputs: list[Class], partial: dict[int, Node], open_ids: set[int], cost: CostFn) -> float:
    """A cost every completion of ``partial`` pays: undecided classes count at their cheapest own cost and
    their inputs are not counted (some alternative might not need them)."""
    total, seen, stack = 0.0, set(), list(outputs)
    while stack:
        c = stack.pop()
        if id(c) in seen or c.realized or c.op is Ops.VAR:
            continue
        seen.add(id(c))
        if id(c) in open_ids and id(c) not in partial:
            total += min(cost(c, n) for n in c.nodes)
            continue
        n = partial.get(id(c), c.nodes[0])
        total += cost(c, n)
        stack.extend(n.srcs)
    return total


def _branch_and_bound(outputs: list[Class], choosable: list[Class], cost: CostFn,
                      incumbent: dict[int, Node], budget_choices: int) -> dict[int, Node]:
    best, best_cost = dict(incumbent), total_cost(outputs, incumbent, cost)
    open_ids = {id(c) for c in choosable}
    budget = [budget_choices]
    partial: dict[int, Node] = {}

    def search(i: int) -> None:
        nonlocal best, best_cost
        if budget[0] <= 0:
            return
        budget[0] -= 1
        if _lower_bound(outputs, partial, open_ids, cost) >= best_cost:
            return
        if i == len(choosable):
            t = total_cost(outputs, partial, cost)
            if t < best_cost:
                best, best_cost = dict(partial), t
            return
        c = choosable[i]
        for n in sorted(c.nodes, key=lambda n: cost(c, n)):
            partial[id(c)] = n
            search(i + 1)
            del partial[id(c)]

    search(0)
    return best

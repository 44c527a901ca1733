"""CUDA-graph capture of a batch of kernel launches (pure, no GPU needed): structure, buffers, dependencies.

Invariants:
- ``signature`` is equal for two batches exactly when they launch the same programs in the same order and the
  same argument positions name the same buffer; scalar values may differ (a replay updates them in place).
- ``dependencies``: node ``j`` depends on every earlier node it conflicts with on a buffer (read-after-write,
  write-after-write, write-after-read): every conflicting pair is ordered, and nodes that share nothing stay
  concurrent (what several streams gave the one-by-one launches).
- ``boundary``: the batch as one command: the buffers it reads before writing them, and every buffer it writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Launch = tuple[int, tuple]  # (program id, arguments)


class Program(Protocol):
    ins: tuple[int, ...]  # argument positions read
    outs: tuple[int, ...]  # argument positions written
    spec: Any  # args.KernelSpec: ``formats`` None for a buffer argument


@dataclass
class GraphRecord:
    """A captured batch: its executable graph, one node and one argument block per kernel, in batch order."""

    signature: tuple
    graph: int
    exec: int
    nodes: list[int]
    packs: list[Any]  # args.ArgPack per node, refilled when its arguments change
    programs: list[Any]
    values: list[list]  # the argument values each node holds now
    streams: set[int] = field(default_factory=set)  # streams it was launched on (barriers before destroying it)


def signature(launches: Sequence[Launch], programs: Sequence[Program]) -> tuple:
    first: dict[int, int] = {}
    out = []
    for (pid, args), prog in zip(launches, programs):
        pattern = tuple(None if f is not None else first.setdefault(a, len(first))
                        for a, f in zip(args, prog.spec.formats))
        out.append((pid, pattern))
    return tuple(out)


def boundary(launches: Sequence[Launch], programs: Sequence[Program]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    reads: dict[int, None] = {}
    writes: dict[int, None] = {}
    for (_, args), prog in zip(launches, programs):
        for i in prog.ins:
            if args[i] not in writes:
                reads[args[i]] = None
        for i in prog.outs:
            writes[args[i]] = None
    return tuple(reads), tuple(writes)


def dependencies(launches: Sequence[Launch], programs: Sequence[Program]) -> list[list[int]]:
    last_writer: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    out: list[list[int]] = []
    for i, ((_, args), prog) in enumerate(zip(launches, programs)):
        deps: set[int] = set()
        for j in prog.ins:
            if args[j] in last_writer:
                deps.add(last_writer[args[j]])
        for j in prog.outs:
            b = args[j]
            if b in last_writer:
                deps.add(last_writer[b])
            deps.update(readers.get(b, ()))
        for j in prog.ins:
            readers.setdefault(args[j], []).append(i)
        for j in prog.outs:
            last_writer[args[j]] = i
            readers[args[j]] = []
        deps.discard(i)
        out.append(sorted(deps))
    return out

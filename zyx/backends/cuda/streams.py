"""Stream assignment for one submission window of the CUDA backend (pure, no GPU needed).

Model: commands are submitted in program order. Each stream is a FIFO. A wait on stream ``t`` emitted for a
command is an event recorded on ``t``'s *tail at submission time*, so it covers every command already placed on
``t`` (and, transitively, everything those commands waited for).

Invariants of :func:`assign_streams`:

* Placement: a command goes to the stream that last wrote its first read buffer; otherwise (no reads, or that
  buffer was never written) to the stream with the fewest commands in this window, ties to the lowest index.
* Safety: for every pair of commands ``i < j`` (across windows too, since the state is threaded through) that
  conflict on a buffer -- read-after-write, write-after-read or write-after-write -- ``i`` happens before ``j``:
  either both are on the same stream, or ``j``'s waits reach ``i`` through stream order and earlier waits.
  Write-after-read waits for *every* stream that read the buffer since its last write, not only the last one.
* ``Placement.waits`` is sorted, distinct, never contains the command's own stream, and omits a stream whose
  relevant commands the chosen stream is already known to be ordered after (vector clocks in the state).
* ``assign_streams`` never mutates its input state (it returns an updated copy); ``place`` is the same placement
  updating the state in place, so its cost is the window's, not the number of buffers the state tracks.
* ``ignore`` is a mutation switch for tests only: ``"raw"`` / ``"war"`` leave out read-after-write /
  write-after-read requirements, which breaks the safety invariant on purpose (the emulator's stress tests must
  then fail).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = ["Command", "Placement", "StreamState", "assign_streams", "place"]


@dataclass(frozen=True)
class Command:
    """One launch or copy: the buffer ids it reads and writes."""

    reads: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()
    name: str = ""


class Placement(NamedTuple):
    """Where a command runs and which other streams' current tails it must wait for first (a tuple: one is made
    per launch)."""

    stream: int
    waits: tuple[int, ...] = ()


@dataclass
class StreamState:
    """Hazard tracking that persists across windows.

    Positions are 1-based indices of a command on its stream, counted over the state's whole lifetime. Only
    ``last_writer`` and ``readers_since_write`` are needed for safety; the other fields only prune redundant
    waits, and a missing position makes the stream always waited on.
    """

    last_writer: dict[int, int] = field(default_factory=dict)
    """buffer -> stream of its last write."""
    readers_since_write: dict[int, set[int]] = field(default_factory=dict)
    """buffer -> every stream that read it since its last write."""
    last_write_at: dict[int, int] = field(default_factory=dict)
    """buffer -> position of its last write on ``last_writer[buffer]``."""
    last_read_at: dict[tuple[int, int], int] = field(default_factory=dict)
    """(buffer, stream) -> position of the latest read of buffer on stream since the buffer's last write."""
    placed: dict[int, int] = field(default_factory=dict)
    """stream -> number of commands placed on it so far."""
    synced: dict[int, dict[int, int]] = field(default_factory=dict)
    """stream s -> {t: n}: the next command on s happens after the first n commands on stream t."""

    def copy(self) -> StreamState:
        return StreamState(
            last_writer=dict(self.last_writer),
            readers_since_write={b: set(r) for b, r in self.readers_since_write.items()},
            last_write_at=dict(self.last_write_at),
            last_read_at=dict(self.last_read_at),
            placed=dict(self.placed),
            synced={s: dict(c) for s, c in self.synced.items()},
        )


def _requirements(cmd: Command, state: StreamState, ignore: frozenset[str] = frozenset()) -> dict[int, float]:
    """stream -> highest position on it that ``cmd`` must happen after (RAW, WAR, WAW).

    A position the state does not know (a hand-built state) is infinite: that stream is always waited on.
    """
    need: dict[int, float] = {}
    writer, write_at = state.last_writer, state.last_write_at
    after_writes = cmd.writes if "raw" in ignore else cmd.reads + cmd.writes  # RAW (reads) and WAW (writes)
    for b in after_writes:
        s = writer.get(b)
        if s is not None:
            p = write_at.get(b, math.inf)
            if p > need.get(s, 0):
                need[s] = p
    if "war" not in ignore:
        readers, read_at = state.readers_since_write, state.last_read_at
        for b in cmd.writes:  # write-after-read: every reader since the last write
            for r in readers.get(b, ()):
                p = read_at.get((b, r), math.inf)
                if p > need.get(r, 0):
                    need[r] = p
    return need


def _covers(state: StreamState, t: int, pending: dict[int, float]) -> int:
    """How many outstanding requirements a wait on stream ``t``'s current tail would satisfy."""
    reach = state.synced.get(t, {})
    return sum(u == t or reach.get(u, 0) >= p for u, p in pending.items())


def assign_streams(
    commands: Sequence[Command], state: StreamState, n_streams: int, ignore: frozenset[str] = frozenset()
) -> tuple[list[Placement], StreamState]:
    """Place one window of ``commands`` on ``n_streams`` streams; return the placements and the new state."""
    if n_streams < 1:
        raise ValueError(f"n_streams must be >= 1, got {n_streams}")
    used = {*state.placed, *state.last_writer.values(), *(s for r in state.readers_since_write.values() for s in r)}
    if any(not 0 <= s < n_streams for s in used):
        raise ValueError(f"state uses streams {sorted(used)} but n_streams is {n_streams}")
    st = state.copy()
    return place(commands, st, n_streams, ignore), st


def place(commands: Sequence[Command], st: StreamState, n_streams: int, ignore: frozenset[str] = frozenset(),
          rank: Sequence[int] | None = None) -> list[Placement]:
    """``assign_streams`` updating ``st`` in place: the cost is the window's, whatever the state tracks.

    ``rank`` orders the streams for ties (lower first; default: by index); any order keeps every invariant."""
    order = rank if rank is not None else range(n_streams)
    by_rank = sorted(range(n_streams), key=order.__getitem__)
    load = [0] * n_streams
    placements: list[Placement] = []
    writer, write_at, readers, read_at = st.last_writer, st.last_write_at, st.readers_since_write, st.last_read_at
    placed, synced = st.placed, st.synced
    for cmd in commands:
        reads = cmd.reads
        chosen = writer.get(reads[0]) if reads else None
        if chosen is None:
            chosen = min(by_rank, key=load.__getitem__)  # least loaded, ties to the lowest rank

        clock = synced.setdefault(chosen, {})
        need = _requirements(cmd, st, ignore)
        pending = {t: p for t, p in need.items() if t != chosen and clock.get(t, 0) < p} if need else need
        waits: list[int] = []
        while pending:
            # Greedy cover: wait on the stream whose tail settles the most outstanding requirements.
            score = {u: _covers(st, u, pending) for u in pending}
            t = max(sorted(pending, key=order.__getitem__), key=score.__getitem__)
            waits.append(t)
            for u, n in st.synced.get(t, {}).items():
                if u != chosen:
                    clock[u] = max(clock.get(u, 0), n)
            clock[t] = st.placed.get(t, 0)
            pending = {u: p for u, p in pending.items() if u != t and clock.get(u, 0) < p}
        placements.append(Placement(chosen, tuple(sorted(waits)) if len(waits) > 1 else tuple(waits)))

        pos = placed.get(chosen, 0) + 1
        placed[chosen] = pos
        load[chosen] += 1
        for b in reads:
            r = readers.get(b)
            if r is None:
                readers[b] = {chosen}
            else:
                r.add(chosen)
            read_at[(b, chosen)] = pos
        for b in cmd.writes:
            for r in readers.pop(b, ()):
                read_at.pop((b, r), None)
            readers[b] = set()
            writer[b] = chosen
            write_at[b] = pos
    return placements

"""Stream placement of one submission window: ``streams.assign_streams`` over streams relabelled least-used first.
"""

from __future__ import annotations

from collections.abc import Sequence

from zyx.backends.cuda.streams import Command as StreamCommand
from zyx.backends.cuda.streams import Placement as StreamPlacement
from zyx.backends.cuda.streams import StreamState, assign_streams


def relabel(state: StreamState, mapping: Sequence[int]) -> StreamState:
    """``state`` with every stream index ``s`` replaced by ``mapping[s]`` (a permutation)."""
    m = mapping
    return StreamState(
        last_writer={b: m[s] for b, s in state.last_writer.items()},
        readers_since_write={b: {m[s] for s in r} for b, r in state.readers_since_write.items()},
        last_write_at=dict(state.last_write_at),
        last_read_at={(b, m[s]): p for (b, s), p in state.last_read_at.items()},
        placed={m[s]: n for s, n in state.placed.items()},
        synced={m[s]: {m[t]: n for t, n in c.items()} for s, c in state.synced.items()},
    )


def place_window(commands: Sequence[StreamCommand], state: StreamState, n_streams: int,
                 ignore: frozenset[str] = frozenset()) -> tuple[list[StreamPlacement], StreamState]:
    """``streams.assign_streams`` over streams relabelled so that the ones that ran the fewest commands so far come
    first: its per-window "least loaded, ties to the lowest index" choice then spreads independent work over all
    streams across windows too (a window of one command would otherwise always pick stream 0). Relabelling is a
    renaming, so every safety property of ``assign_streams`` holds unchanged."""
    order = sorted(range(n_streams), key=lambda s: (state.placed.get(s, 0), s))  # logical -> physical
    if order == list(range(n_streams)):
        return assign_streams(commands, state, n_streams, ignore)
    to_logical = [0] * n_streams
    for logical, physical in enumerate(order):
        to_logical[physical] = logical
    placements, logical_state = assign_streams(commands, relabel(state, to_logical), n_streams, ignore)
    physical = [StreamPlacement(order[p.stream], tuple(sorted(order[t] for t in p.waits))) for p in placements]
    return physical, relabel(logical_state, order)

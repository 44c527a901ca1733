"""Stream placement of one submission window: ``streams.place`` with the least-used streams preferred.
"""

from __future__ import annotations

from collections.abc import Sequence

from zyx.backends.cuda.streams import Command as StreamCommand
from zyx.backends.cuda.streams import Placement as StreamPlacement
from zyx.backends.cuda.streams import StreamState, place


def place_window(commands: Sequence[StreamCommand], state: StreamState, n_streams: int,
                 ignore: frozenset[str] = frozenset()) -> tuple[list[StreamPlacement], StreamState]:
    """Place a window, updating ``state`` in place (returned for convenience). Ties between equally loaded streams
    go to the stream that ran the fewest commands so far, so independent work spreads over all streams across
    windows too (a window of one command would otherwise always pick stream 0). The tie order is a preference
    only: every safety property of ``streams.assign_streams`` holds for any order. Cost: O(window × streams)."""
    rank = [0] * n_streams
    for i, s in enumerate(sorted(range(n_streams), key=lambda s: (state.placed.get(s, 0), s))):
        rank[s] = i
    return place(commands, state, n_streams, ignore, rank), state

"""Stream assignment of the CUDA backend: a pure function, checked against an independent happens-before model."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zyx.backends.cuda.streams import Command, Placement, StreamState, assign_streams

# ---------------------------------------------------------------------------------------------------------------
# Independent checker: each stream is a FIFO; a wait on stream s at the submission of command j orders j after
# every command placed on s before j. Happens-before is the transitive closure of stream order and waits.
# ---------------------------------------------------------------------------------------------------------------


def happens_before(placements: Sequence[Placement]) -> list[int]:
    """hb[j] is a bitmask of the commands that happen before command j."""
    tail: dict[int, int] = {}  # stream -> index of the last command placed on it so far
    hb: list[int] = []
    for j, pl in enumerate(placements):
        mask = 0
        for s in (pl.stream, *pl.waits):  # own stream: FIFO order; others: event on the tail at submission
            if s in tail:
                i = tail[s]
                mask |= hb[i] | (1 << i)
        hb.append(mask)
        tail[pl.stream] = j
    return hb


def conflict(a: Command, b: Command) -> str | None:
    """The hazard kind if a (earlier) and b (later) must be ordered, else None."""
    if set(a.writes) & set(b.reads):
        return "RAW"
    if set(a.reads) & set(b.writes):
        return "WAR"
    if set(a.writes) & set(b.writes):
        return "WAW"
    return None


def violations(commands: Sequence[Command], placements: Sequence[Placement], n_streams: int) -> list[str]:
    """Everything wrong with a placement of ``commands`` (in program order), as readable strings."""
    problems: list[str] = []
    if len(commands) != len(placements):
        return [f"{len(commands)} commands but {len(placements)} placements"]
    for j, pl in enumerate(placements):
        if not 0 <= pl.stream < n_streams:
            problems.append(f"command {j} on stream {pl.stream} out of range")
        if pl.stream in pl.waits:
            problems.append(f"command {j} waits on its own stream {pl.stream}")
        if list(pl.waits) != sorted(set(pl.waits)):
            problems.append(f"command {j} waits {pl.waits} not sorted and distinct")
        if any(not 0 <= s < n_streams for s in pl.waits):
            problems.append(f"command {j} waits {pl.waits} out of range")
    hb = happens_before(placements)
    for j in range(len(commands)):
        for i in range(j):
            kind = conflict(commands[i], commands[j])
            if kind and not hb[j] >> i & 1:
                problems.append(f"{kind} {i}->{j} unordered ({placements[i]} vs {placements[j]})")
    return problems


def vacuous_waits(placements: Sequence[Placement]) -> list[str]:
    """Waits that cannot order anything: on an empty stream, or on a tail already ordered before the command."""
    problems: list[str] = []
    tail: dict[int, int] = {}
    hb = happens_before(placements)
    for j, pl in enumerate(placements):
        before = 0
        if pl.stream in tail:
            before = hb[tail[pl.stream]] | (1 << tail[pl.stream])
        for s in pl.waits:
            if s not in tail:
                problems.append(f"command {j} waits on empty stream {s}")
            elif before >> tail[s] & 1:
                problems.append(f"command {j} waits on stream {s} whose tail is already ordered before it")
        tail[pl.stream] = j
    return problems


def run_windows(
    windows: Sequence[Sequence[Command]], n_streams: int, state: StreamState | None = None
) -> tuple[list[Command], list[Placement], StreamState]:
    state = StreamState() if state is None else state
    commands: list[Command] = []
    placements: list[Placement] = []
    for window in windows:
        before = copy.deepcopy(state)
        placed, new_state = assign_streams(window, state, n_streams)
        assert state == before, "assign_streams mutated its input state"
        assert new_state is not state
        commands += window
        placements += placed
        state = new_state
    return commands, placements, state


def W(*buffers: int, reads: Sequence[int] = (), name: str = "") -> Command:
    return Command(reads=tuple(reads), writes=tuple(buffers), name=name)


def R(*buffers: int, writes: Sequence[int] = (), name: str = "") -> Command:
    return Command(reads=tuple(buffers), writes=tuple(writes), name=name)


# ---------------------------------------------------------------------------------------------------------------
# The checker itself must reject bad placements, so the property test cannot pass vacuously.
# ---------------------------------------------------------------------------------------------------------------

# A writes 0 (s0); X writes 1 (s1); C reads 1 then 0 (s1, RAW wait on s0); B reads 0 (s0); D writes 0.
TWO_READERS = [W(0, name="A"), W(1, name="X"), R(1, 0, name="C"), R(0, name="B"), W(0, name="D")]


def test_checker_accepts_correct_and_rejects_missing_waits():
    good = [Placement(0), Placement(1), Placement(1, (0,)), Placement(0), Placement(2, (0, 1))]
    assert violations(TWO_READERS, good, 3) == []
    # The Rust reference's bug: only the last user (B on s0) is waited on, C on s1 is missed.
    last_user_only = good[:4] + [Placement(2, (0,))]
    assert violations(TWO_READERS, last_user_only, 3) == [
        "WAR 2->4 unordered (Placement(stream=1, waits=(0,)) vs Placement(stream=2, waits=(0,)))"
    ]
    missing_raw = [Placement(0), Placement(1), Placement(1), Placement(0), Placement(2, (0, 1))]
    assert any(v.startswith("RAW 0->2") for v in violations(TWO_READERS, missing_raw, 3))
    waw = [W(0), W(0)]
    assert violations(waw, [Placement(0), Placement(1)], 2) == [
        "WAW 0->1 unordered (Placement(stream=0, waits=()) vs Placement(stream=1, waits=()))"
    ]
    assert violations(waw, [Placement(0), Placement(0)], 2) == []


def test_checker_is_transitive_and_rejects_malformed_waits():
    # 0 -> 1 by a wait, 1 -> 2 by stream order: 0 happens before 2 with no direct wait.
    cmds = [W(0), R(0, writes=(1,)), R(0)]
    assert violations(cmds, [Placement(0), Placement(1, (0,)), Placement(1)], 2) == []
    # A wait recorded before the producer was submitted does not order it.
    assert violations([R(5), W(0), R(0)], [Placement(1), Placement(0), Placement(2, (1,))], 3) != []
    assert "command 1 waits on its own stream 1" in violations(
        cmds, [Placement(0), Placement(1, (0, 1)), Placement(1)], 2
    )
    assert any(
        "not sorted" in v for v in violations([W(0), W(1), W(0)], [Placement(0), Placement(1), Placement(2, (1, 0))], 3)
    )
    assert any("out of range" in v for v in violations([W(0)], [Placement(3)], 2))
    assert vacuous_waits([Placement(0, (1,))]) == ["command 0 waits on empty stream 1"]


# ---------------------------------------------------------------------------------------------------------------
# Unit tests of the placement rules.
# ---------------------------------------------------------------------------------------------------------------


def test_war_waits_for_every_reader_stream():
    placements, state = assign_streams(TWO_READERS, StreamState(), 3)
    assert placements == [Placement(0), Placement(1), Placement(1, (0,)), Placement(0), Placement(2, (0, 1))]
    assert violations(TWO_READERS, placements, 3) == []
    assert state.last_writer[0] == 2 and state.readers_since_write[0] == set()


def test_war_writer_on_a_reader_stream_waits_for_the_other_reader():
    cmds = TWO_READERS[:4] + [R(0, writes=(0,), name="D")]  # D goes to s0, the writer of its first read
    placements, _ = assign_streams(cmds, StreamState(), 3)
    assert placements[4] == Placement(0, (1,))
    assert violations(cmds, placements, 3) == []


def test_war_across_windows_waits_for_every_reader_stream():
    windows = [TWO_READERS[:2], TWO_READERS[2:4], TWO_READERS[4:]]
    cmds, placements, _ = run_windows(windows, 3)
    # Last window: D has no reads, so the least-loaded stream of *this* window (s0); it waits for C on s1.
    assert placements == [Placement(0), Placement(1), Placement(1, (0,)), Placement(0), Placement(0, (1,))]
    assert violations(cmds, placements, 3) == []


def test_raw_across_windows_produces_a_wait():
    cmds, placements, state = run_windows([[W(0), W(1)], [R(1, 0)]], 2)
    assert placements == [Placement(0), Placement(1), Placement(1, (0,))]
    assert state.readers_since_write == {0: {1}, 1: {1}}
    assert violations(cmds, placements, 2) == []


def test_prefers_last_writer_of_first_input():
    cmds = [W(0), W(1), R(0, writes=(2,)), R(1, writes=(3,)), R(3, 2)]
    placements, _ = assign_streams(cmds, StreamState(), 4)
    # C and D would go to s2/s3 by load; they follow their first input's writer instead, with no wait.
    assert placements[:4] == [Placement(0), Placement(1), Placement(0), Placement(1)]
    assert placements[4] == Placement(1, (0,))


def test_independent_commands_spread_over_streams():
    cmds = [W(b) for b in range(8)]
    placements, _ = assign_streams(cmds, StreamState(), 3)
    assert [p.stream for p in placements] == [0, 1, 2, 0, 1, 2, 0, 1]
    assert all(p.waits == () for p in placements)
    # Reads of never-written buffers also go to the least-loaded stream.
    placements, _ = assign_streams([R(b) for b in range(4)], StreamState(), 2)
    assert [p.stream for p in placements] == [0, 1, 0, 1]


def test_load_counts_only_the_current_window():
    _, placements, _ = run_windows([[W(0), W(1), W(2)], [W(3)]], 2)
    assert [p.stream for p in placements] == [0, 1, 0, 0]


def test_redundant_waits_are_pruned():
    cmds = [W(0), W(1), R(1, 0), R(1, 0), R(1, 0, writes=(4,))]
    placements, _ = assign_streams(cmds, StreamState(), 2)
    assert placements == [Placement(0), Placement(1), Placement(1, (0,)), Placement(1), Placement(1)]
    # Waiting on s1 covers s0 transitively (s1 already waited on s0 after the write of 0).
    cmds = [W(0), W(1), R(1, 0), W(0, reads=(5,))]
    placements, _ = assign_streams(cmds, StreamState(), 3)
    assert placements[3] == Placement(2, (1,))
    assert violations(cmds, placements, 3) == []


def test_read_and_write_same_buffer():
    cmds = [W(0), R(0, writes=(0,)), R(0), W(0)]
    placements, state = assign_streams(cmds, StreamState(), 2)
    assert placements == [Placement(0), Placement(0), Placement(0), Placement(1, (0,))]
    assert violations(cmds, placements, 2) == []
    assert state.last_writer == {0: 1}


def test_input_state_is_not_mutated():
    _, state = assign_streams([W(0), W(1), R(1, 0)], StreamState(), 3)
    snapshot = copy.deepcopy(state)
    _, new_state = assign_streams([W(0), R(1, writes=(2,)), W(1)], state, 3)
    assert state == snapshot
    assert new_state != state
    cloned = state.copy()
    assert cloned == state
    cloned.readers_since_write[0].add(2)
    cloned.synced.setdefault(0, {})[1] = 99
    assert state == snapshot


def test_hand_built_state_without_positions_waits_conservatively():
    state = StreamState(last_writer={0: 1}, readers_since_write={0: {2}})
    placements, new_state = assign_streams([W(0)], state, 4)
    assert placements == [Placement(0, (1, 2))]
    assert new_state.last_writer == {0: 0}


def test_invalid_stream_counts():
    with pytest.raises(ValueError):
        assign_streams([W(0)], StreamState(), 0)
    with pytest.raises(ValueError):
        assign_streams([], StreamState(), -1)
    _, state = assign_streams([W(0), W(1), W(2)], StreamState(), 3)
    with pytest.raises(ValueError):
        assign_streams([R(2)], state, 2)


def test_empty_window():
    placements, state = assign_streams([], StreamState(), 4)
    assert placements == [] and state == StreamState()


# ---------------------------------------------------------------------------------------------------------------
# Property test: random programs, split into windows with the state threaded through.
# ---------------------------------------------------------------------------------------------------------------

buffers = st.integers(min_value=0, max_value=7)
commands = st.builds(
    Command,
    reads=st.lists(buffers, max_size=3).map(tuple),
    writes=st.lists(buffers, max_size=2).map(tuple),
)


@st.composite
def windowed_programs(draw: st.DrawFn) -> tuple[list[list[Command]], int]:
    program = draw(st.lists(commands, max_size=60))
    cuts = sorted(draw(st.lists(st.integers(min_value=0, max_value=len(program)), max_size=6)))
    bounds = [0, *cuts, len(program)]
    windows = [program[a:b] for a, b in zip(bounds, bounds[1:])]
    return windows, draw(st.integers(min_value=1, max_value=12))


@settings(max_examples=400, deadline=None)
@given(windowed_programs())
def test_property_every_hazard_is_ordered(case: tuple[list[list[Command]], int]):
    windows, n_streams = case
    cmds, placements, _ = run_windows(windows, n_streams)
    assert violations(cmds, placements, n_streams) == []
    assert vacuous_waits(placements) == []

    # Placement rule, re-derived independently: writer of the first read, else least loaded in the window.
    writer: dict[int, int] = {}
    k = 0
    for window in windows:
        load = [0] * n_streams
        for cmd in window:
            pl = placements[k]
            if cmd.reads and cmd.reads[0] in writer:
                assert pl.stream == writer[cmd.reads[0]]
            else:
                assert load[pl.stream] == min(load) and pl.stream == load.index(min(load))
            load[pl.stream] += 1
            writer.update(dict.fromkeys(cmd.writes, pl.stream))
            k += 1


@settings(max_examples=200, deadline=None)
@given(windowed_programs())
def test_property_windows_do_not_change_safety_with_one_big_window(case: tuple[list[list[Command]], int]):
    windows, n_streams = case
    program = [c for w in windows for c in w]
    placements, _ = assign_streams(program, StreamState(), n_streams)
    assert violations(program, placements, n_streams) == []
    if n_streams == 1:
        assert all(p == Placement(0) for p in placements)


def test_graph_dependencies_order_every_conflict_and_nothing_else():
    from types import SimpleNamespace

    from zyx.backends.cuda import graphs

    k = SimpleNamespace(ins=(0, 1), outs=(2,), spec=SimpleNamespace(formats=(None, None, None)))
    # 0: c = f(a, b); 1: d = f(c, a) (RAW on c); 2: a = f(b, b) (WAR on a after 0 and 1); 3: e = f(b, b) (free);
    # 4: c = f(b, b) (WAW on c after 0, WAR after 1)
    a, b, c, d, e = 1, 2, 3, 4, 5
    batch = [(9, (a, b, c)), (9, (c, a, d)), (9, (b, b, a)), (9, (b, b, e)), (9, (b, b, c))]
    progs = [k] * len(batch)
    assert graphs.dependencies(batch, progs) == [[], [0], [0, 1], [], [0, 1]]
    assert graphs.boundary(batch, progs) == ((a, b), (c, d, a, e))
    same = [(9, (10 + x, 10 + y, 10 + z)) for _, (x, y, z) in batch]
    assert graphs.signature(batch, progs) == graphs.signature(same, progs)
    assert graphs.signature(batch, progs) != graphs.signature([(9, (a, b, d))] + batch[1:], progs)

"""What a capture (``zyx.jit``) needs to hear from the rest of the tensor layer while it records a call.

Invariants: ``active`` is the capture recording now (None almost always: every hook is then one attribute
test). Code whose effect lives outside the graph registers it: ``on_replay(fn)`` for Python state a replay
must advance (optimizer step counters and their launch-argument scalars, the random generator's counter),
``note_assign`` for a tensor rebound in place (parameters, optimizer state), ``forbid`` for what cannot be
captured (reading a value back). This module imports nothing of zyx, so every layer above the graph may
use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class CaptureError(RuntimeError):
    """Something a jitted function did cannot be replayed without running its Python."""


class Capture:
    def __init__(self, name: str, pending: set[int] | None = None) -> None:
        self.name = name
        self.hooks: list[Callable[[], None]] = []
        self.assigned: dict[int, tuple[Any, Any]] = {}  # id(tensor) -> (tensor, its class before the call)
        self.pending = pending or set()  # ids of the unrealized classes that existed when the capture began
        # a rebound tensor held such a class: its old value is work from before the call, which the recording
        # would bake into every replay (the capture is then dropped; the next call captures again)
        self.stale = False

    def forbid(self, what: str) -> None:
        raise CaptureError(f"zyx.jit({self.name}): {what} inside a jitted function cannot be replayed (the value "
                           "would be the first call's); return the tensor and read it after the call")


active: Capture | None = None


def on_replay(fn: Callable[[], None]) -> None:
    """While capturing: run ``fn`` before every replay, in capture order (no effect otherwise)."""
    if active is not None:
        active.hooks.append(fn)


def note_assign(tensor: Any, old_class: Any) -> None:
    """While capturing: ``tensor`` is rebound in place; ``old_class`` is what it held before."""
    if active is not None and id(tensor) not in active.assigned:
        active.assigned[id(tensor)] = (tensor, old_class)
        if id(old_class) in active.pending and not old_class.realized:
            active.stale = True


def forbid(what: str) -> None:
    """While capturing: raise ``CaptureError`` naming ``what``."""
    if active is not None:
        active.forbid(what)

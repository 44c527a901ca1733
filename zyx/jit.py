"""``zyx.jit``: capture the schedule of a function of tensors once, then replay it without building a graph.

    @zyx.jit
    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step(loss)
        return loss

    for xb, yb in batches:
        loss = step(zyx.Tensor(xb), zyx.Tensor(yb))  # call 1 runs as usual, call 2 captures, then replays
        print(loss.item())

Tensor arguments are realized first. Per input signature (shapes, dtypes, devices of the tensor arguments, which of
them hold the same buffer, the values of the other arguments) the first call runs the function as usual, the second
runs it while recording every realize (the plans and the buffers they read), and later calls replay the recorded
plans: no graph is built, nothing is planned or compiled; on CUDA each plan is one captured CUDA graph.

What a replay binds, by where each buffer a recorded plan read came from:
- an argument tensor's buffer: that argument's buffer in the new call;
- a buffer an earlier recorded plan produced: the one it produced in this replay (fresh buffers every call,
  so tensors returned by an earlier call keep their values);
- the buffer a tensor held before the function rebound it with ``Tensor.assign`` (parameters, optimizer
  state): what that tensor holds now, and the tensor is rebound to its new value after the replay (a tensor
  argument rebound inside: the new call's argument);
- anything else (weights only read, constants): the buffer it was at capture, kept alive.
A rebound tensor whose old value was still pending when the capture began (assigned lazily by the previous call,
and not read since: batch norm's running statistics) would have that old computation recorded with the buffers
it read then, so such a capture is dropped (``jit_stale_captures``) and the next call, its state realized by now,
captures again.
Launch-argument scalars that code outside the graph advances (optimizer step counters and their scalars,
the random generator's counter) are advanced by hooks the capture recorded (``zyx.capture.on_replay``).

Not captured (documented limits): Python control flow that depends on values (reading ``.item()`` or
``.numpy()`` inside raises ``CaptureError``); a tensor read but not passed in that the caller rebinds
between calls without ``assign`` (a replay still reads the captured buffer); a tensor the function reads
directly that the capture call also passed as an argument (``f(w)`` where ``f`` reads ``w`` too: one leaf, bound to
the argument, so a replay ``f(x)`` reads ``x`` for both); ``.grad`` attributes are not refreshed by a replay.
Python scalar arguments are part of the signature (a new value captures again).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zyx import capture
from zyx.graph import node as graph_node
from zyx.graph import schedule
from zyx.graph.node import leaf
from zyx.tensor import Tensor, realize
from zyx.utils import STATS

CACHE_SIZE = 16  # captured signatures per jitted function (least recently used dropped)

# where a recorded plan's leaf comes from: ("arg", i) | ("made", record, output) | ("state", k) | ("var", class)
# | ("const", buffer)
Binding = tuple


@dataclass
class _Program:
    """One captured call: the recorded plans with their leaf bindings, what the outputs and state become."""

    steps: list[tuple[schedule.Plan, list[Binding]]]
    hooks: list[Callable[[], None]]
    state: list[Tensor | int]  # what the call rebinds (new values: ``finals``): a tensor, or an argument's index
    finals: list[Binding]
    structure: Any  # the returned value with a _Slot in place of every tensor
    outputs: list[Binding]  # per returned tensor, in flattening order
    out_meta: list[tuple]  # (shape, dtype) per returned tensor


def _flatten(obj: Any, out: list[Tensor]) -> Any:
    """``obj`` with every Tensor replaced by its index in ``out`` (tuples, lists, dicts; other values kept)."""
    if isinstance(obj, Tensor):
        out.append(obj)
        return _Slot(len(out) - 1)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_flatten(o, out) for o in obj)
    if isinstance(obj, dict):
        return {k: _flatten(v, out) for k, v in obj.items()}
    return obj


def _unflatten(obj: Any, values: list) -> Any:
    if isinstance(obj, _Slot):
        return values[obj.i]
    if isinstance(obj, (tuple, list)):
        return type(obj)(_unflatten(o, values) for o in obj)
    if isinstance(obj, dict):
        return {k: _unflatten(v, values) for k, v in obj.items()}
    return obj


@dataclass(frozen=True)
class _Slot:
    i: int


class Jitted:
    """A jitted function: ``__call__`` runs, captures or replays; ``captures`` counts the captures made."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = getattr(fn, "__qualname__", repr(fn))
        self._seen: set = set()
        self._programs: OrderedDict = OrderedDict()
        self.captures = 0

    def __get__(self, obj: Any, objtype: Any = None) -> Any:  # a jitted method binds like a function
        return self if obj is None else functools.partial(self.__call__, obj)

    def reset(self) -> None:
        """Forget every capture (the next calls run and capture again)."""
        self._seen.clear()
        self._programs.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        tensors: list[Tensor] = []
        shape = _flatten((args, kwargs), tensors)
        realize(*tensors)
        key = (_signature(shape), tuple((t.shape, t.dtype, t.device) for t in tensors), _aliasing(tensors))
        program = self._programs.get(key)
        if program is not None:
            self._programs.move_to_end(key)
            return self._replay(program, tensors)
        if key not in self._seen:  # first call of this signature: as usual (warm-up, compiles)
            self._seen.add(key)
            return self.fn(*args, **kwargs)
        out, program = self._capture(args, kwargs, tensors)
        if program is None:  # state was pending from before the call: it is realized now, capture next time
            return out
        self._programs[key] = program
        if len(self._programs) > CACHE_SIZE:
            self._programs.popitem(last=False)
        self.captures += 1
        STATS["jit_captures"] += 1
        return out

    # ---- capture ---------------------------------------------------------------------------------------------
    def _capture(self, args: tuple, kwargs: dict, tensors: list[Tensor]) -> tuple[Any, _Program | None]:
        if capture.active is not None or schedule.recording is not None:
            raise capture.CaptureError(f"zyx.jit({self.name}) was called inside another jitted function")
        arg_buffers = {id(t.cls.buffer): i for i, t in enumerate(tensors)}
        pending = {id(c) for r in graph_node._cache.values() if (c := r()) is not None}
        cap = capture.Capture(self.name, pending)
        records: list[schedule.Recorded] = []
        capture.active, schedule.recording = cap, records
        try:
            out = self.fn(*args, **kwargs)
            returned: list[Tensor] = []
            structure = _flatten(out, returned)
            state = [t for t, _ in cap.assigned.values()]
            realize(*returned, *state)
        finally:
            capture.active, schedule.recording = None, None
        if cap.stale:
            STATS["jit_stale_captures"] += 1
            return out, None
        made: dict[int, tuple[int, int]] = {}
        before = {id(old.buffer): k for k, (_, old) in enumerate(cap.assigned.values()) if old.realized}
        steps = []
        for r, rec in enumerate(records):
            steps.append((rec.plan, [_bind(c, v, arg_buffers, made, before) for c, v in zip(rec.leaves, rec.values)]))
            for o, b in enumerate(rec.outputs):
                made.setdefault(id(b), (r, o))
        finals = [_bind(t.cls, t.cls.buffer, arg_buffers, made, before) for t in state]
        arg_index = {id(t): i for i, t in enumerate(tensors)}  # an argument rebound is the new call's argument
        state = [arg_index.get(id(t), t) for t in state]
        outputs = [_bind(t.cls, t.cls.buffer, arg_buffers, made, before) for t in returned]
        program = _Program(steps, list(cap.hooks), state, finals, structure, outputs,
                           [(t.shape, t.dtype) for t in returned])
        return out, program

    # ---- replay ----------------------------------------------------------------------------------------------
    def _replay(self, program: _Program, tensors: list[Tensor]) -> Any:
        targets = [tensors[s] if isinstance(s, int) else s for s in program.state]
        if not all(t.cls.realized for t in targets):
            realize(*targets)
        args = [t.cls.buffer for t in tensors]
        state = [t.cls.buffer for t in targets]
        for hook in program.hooks:
            hook()
        produced: list[list] = []
        for plan, bindings in program.steps:
            produced.append(schedule.execute(plan, [_value(b, args, produced, state) for b in bindings]))
        for t, b in zip(targets, program.finals):
            t.cls = leaf(_value(b, args, produced, state), t.shape, t.dtype)
        STATS["jit_replays"] += 1
        outs = [Tensor._from_class(leaf(_value(b, args, produced, state), shape, dtype))
                for b, (shape, dtype) in zip(program.outputs, program.out_meta)]
        return _unflatten(program.structure, outs)


def _aliasing(tensors: list[Tensor]) -> tuple[int, ...]:
    """Per (realized) tensor argument, the first argument holding the same buffer: a capture with ``f(x, x)`` saw one
    leaf where ``f(x, y)`` has two, so the two calls have different signatures."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t.cls.buffer), i) for i, t in enumerate(tensors))


def _signature(obj: Any) -> Any:
    """A hashable description of the non-tensor arguments (tensors appear as their slot)."""
    if isinstance(obj, (tuple, list)):
        return (type(obj).__name__, tuple(_signature(o) for o in obj))
    if isinstance(obj, dict):
        return ("dict", tuple(sorted((k, _signature(v)) for k, v in obj.items())))
    try:
        hash(obj)
    except TypeError:
        return ("id", id(obj))
    return obj


def _bind(cls: Any, value: Any, arg_buffers: dict, made: dict, before: dict) -> Binding:
    if cls.buffer is None:  # a launch-argument scalar: read at replay (hooks may have changed it)
        return ("var", cls)
    key = id(value)
    if key in arg_buffers:
        return ("arg", arg_buffers[key])
    if key in made:
        return ("made", *made[key])
    if key in before:
        return ("state", before[key])
    return ("const", value)


def _value(b: Binding, args: list, produced: list, state: list) -> Any:
    kind = b[0]
    if kind == "made":
        return produced[b[1]][b[2]]
    if kind == "arg":
        return args[b[1]]
    if kind == "state":
        return state[b[1]]
    if kind == "var":
        return b[1].var_value
    return b[1]


def jit(fn: Callable[..., Any]) -> Jitted:
    """Capture ``fn`` (a function of tensors) on its second call per input signature and replay it after."""
    return Jitted(fn)

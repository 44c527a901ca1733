"""Process-wide debug flags and counters, shared by every layer (imports nothing from zyx).

``ZYX_DEBUG`` is a bitmask or a comma list of names: dev(1) graph(2) sched(4) ir(8) asm(16) launch(32)
memory(64) compile(128) autotune(256). A malformed value is an error naming the accepted names.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

FLAGS = {"dev": 1, "graph": 2, "sched": 4, "ir": 8, "asm": 16, "launch": 32, "memory": 64, "compile": 128,
         "autotune": 256}


def parse_debug(value: str | None) -> int:
    if not value:
        return 0
    value = value.strip()
    if value.isdigit():
        return int(value)
    mask = 0
    for part in value.split(","):
        part = part.strip().lower()
        if not part:
            continue
        if part not in FLAGS:
            raise ValueError(f"ZYX_DEBUG: unknown flag {part!r}; use a bitmask or names from "
                             f"{', '.join(f'{k}({v})' for k, v in FLAGS.items())}")
        mask |= FLAGS[part]
    return mask


DEBUG = parse_debug(os.environ.get("ZYX_DEBUG"))

STATS: Counter = Counter()

# When a list, every kernel IR a device compiles is appended to it (tests compile them for other targets).
KERNEL_LOG: list | None = None


def cache_dir() -> Path:
    """Where zyx keeps what it compiled and measured: ``$XDG_CACHE_HOME/zyx``, else ``~/.cache/zyx``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zyx"


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` (its folder made if missing) through a temporary file beside it: readers, in this
    process or another, see the old file or all of the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=path.suffix + ".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def debug_on(flag: str) -> bool:
    return bool(DEBUG & FLAGS[flag])


def log(flag: str, msg: str) -> None:
    if DEBUG & FLAGS[flag]:
        print(f"[zyx:{flag}] {msg}", file=sys.stderr)


def set_debug(value: str | int) -> None:
    """Change the debug mask at run time (tests, notebooks)."""
    global DEBUG
    DEBUG = value if isinstance(value, int) else parse_debug(value)


_DEEP_STACK_BYTES = 512 << 20
_deep_local = __import__("threading").local()


def deep_call(fn, *args, **kwargs):
    """Run ``fn`` on a thread with a large stack and recursion limit (graph passes recurse per op depth).

    Calls made from inside such a thread run directly. While ``fn`` runs, the calling thread serves
    ``on_caller_thread`` requests from it (see there).
    """
    import queue
    import threading
    from concurrent.futures import Future

    if getattr(_deep_local, "inside", False):
        return fn(*args, **kwargs)
    requests: queue.SimpleQueue = queue.SimpleQueue()  # (call, its future); call None: fn's own outcome
    outcome: Future = Future()

    def target() -> None:
        _deep_local.inside, _deep_local.caller = True, requests
        _settle(outcome, lambda: fn(*args, **kwargs))
        requests.put((None, outcome))

    if sys.getrecursionlimit() < 1_000_000:
        sys.setrecursionlimit(1_000_000)
    old = threading.stack_size()
    threading.stack_size(_DEEP_STACK_BYTES)
    try:
        t = threading.Thread(target=target, name="zyx-plan")
        t.start()
    finally:
        threading.stack_size(old)
    while True:
        call, future = requests.get()
        if call is None:
            break
        _settle(future, call)
    t.join()
    return outcome.result()


def _settle(future, call) -> None:
    """``future`` holds what ``call()`` returned or raised."""
    try:
        future.set_result(call())
    except BaseException as e:  # noqa: BLE001 - re-raised by whoever waits on the future
        future.set_exception(e)


def on_caller_thread(fn):
    """``fn()`` run on the thread that called ``deep_call`` (directly when not inside one). Measurements use it:
    an OpenMP kernel timed on a second thread runs beside the caller's idle thread team, and libgomp then
    throttles its spin-waits (more threads than cores), so barriers sleep: a batched GEMM timed 7 ms there ran
    3.5 ms where kernels really launch."""
    from concurrent.futures import Future

    requests = getattr(_deep_local, "caller", None)
    if requests is None:
        return fn()
    future: Future = Future()
    requests.put((fn, future))
    return future.result()

"""Backend registry and the JSON config file.

Config file: ``$ZYX_CONFIG`` if set, else ``$XDG_CONFIG_HOME/zyx/config.json``, else
``~/.config/zyx/config.json``; a missing file means defaults. A malformed file raises ``ConfigError`` naming
the file, the line and the key. Backends start lazily on first use; one that cannot start is recorded with
its reason (``report()``, ``ZYX_DEBUG=dev``) and skipped, never a crash at import. ``ZYX_DEFAULT_DEVICE``
overrides the config's ``default_device``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from zyx.backends.base import BackendError, Device, ErrorStatus, Pool
from zyx.utils import log

DEFAULTS: dict = {
    "host": {"enabled": True, "cc": "cc", "openmp": True, "threads": None},
    "blas": {"enabled": True, "library": "auto"},
    "cuda": {"device_ids": None, "cudnn": True, "queues": 12, "emulate": False, "allow_tf32": False,
             "graphs": True},
    "disk": {},
    "autotune": {"enabled": False, "budget_s": 10},
    "default_device": None,
}

_TYPES: dict[str, dict[str, tuple]] = {
    "host": {"enabled": (bool,), "cc": (str,), "openmp": (bool,), "threads": (int, type(None))},
    "blas": {"enabled": (bool,), "library": (str,)},
    "cuda": {"device_ids": (list, type(None)), "cudnn": (bool,), "queues": (int,), "emulate": (bool,),
             "allow_tf32": (bool,), "graphs": (bool,)},
    "disk": {},
    "autotune": {"enabled": (bool,), "budget_s": (int, float)},
}


BLAS_LIBRARIES = ("auto", "mkl", "openblas")  # auto: MKL when installed (pip install 'zyx[mkl]'), else OpenBLAS


class ConfigError(ValueError):
    """The config file is malformed: the message names the file, the line and the key."""


def config_path() -> Path:
    if os.environ.get("ZYX_CONFIG"):
        return Path(os.environ["ZYX_CONFIG"])
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "zyx" / "config.json"


def _line_of(text: str, key: str) -> int:
    m = re.search(r'"' + re.escape(key) + r'"\s*:', text)
    return text.count("\n", 0, m.start()) + 1 if m else 0


def load_config(path: Path | None = None) -> tuple[dict, Path | None]:
    """Defaults merged with the file at ``path`` (or the standard location); returns (config, file used)."""
    path = path or config_path()
    cfg = copy.deepcopy(DEFAULTS)
    if not path.exists():
        if os.environ.get("ZYX_CONFIG"):
            raise ConfigError(f"{path}: ZYX_CONFIG names a file that does not exist")
        return cfg, None
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: the top level must be a JSON object")
    for key, value in data.items():
        line = _line_of(text, key)
        if key == "default_device":
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{path}:{line}: key 'default_device' must be a device name or null, "
                                  f"got {value!r}")
            cfg[key] = value
            continue
        if key not in _TYPES:
            raise ConfigError(f"{path}:{line}: unknown key {key!r}; known keys: {', '.join(DEFAULTS)}")
        if not isinstance(value, dict):
            raise ConfigError(f"{path}:{line}: key {key!r} must be an object, got {value!r}")
        for sub, v in value.items():
            sline = _line_of(text, sub)
            if sub not in _TYPES[key]:
                raise ConfigError(f"{path}:{sline}: unknown key '{key}.{sub}'; known: "
                                  f"{', '.join(_TYPES[key]) or 'none'}")
            types = _TYPES[key][sub]
            if not isinstance(v, types) or (isinstance(v, bool) and bool not in types):
                names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
                raise ConfigError(f"{path}:{sline}: key '{key}.{sub}' must be {names}, got {v!r}")
            if key == "cuda" and sub == "device_ids" and v is not None and \
                    not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v):
                raise ConfigError(f"{path}:{sline}: key 'cuda.device_ids' must list GPU ordinals, got {v!r}")
            if key == "blas" and sub == "library" and v not in BLAS_LIBRARIES:
                raise ConfigError(f"{path}:{sline}: key 'blas.library' must be one of "
                                  f"{', '.join(map(repr, BLAS_LIBRARIES))}, got {v!r}")
            if key == "cuda" and sub == "queues" and v < 1:
                raise ConfigError(f"{path}:{sline}: key 'cuda.queues' must be at least 1, got {v!r}")
            cfg[key][sub] = v
    return cfg, path


@dataclass
class Placement:
    """A user-facing device: one pool and the devices computing on it (first = generated kernels)."""

    name: str
    pool: Pool
    devices: list[Device] = field(default_factory=list)
    note: str = ""  # shown beside the backend's status (e.g. "emulated: H200, sm_90")

    @property
    def primary(self) -> Device:
        if not self.devices:
            raise BackendError(ErrorStatus.UNSUPPORTED, f"{self.name!r} holds data but cannot compute; move the "
                               "tensor to a compute device with .to('host') or .to('cuda')")
        return self.devices[0]


Probe = Callable[[dict], list[Placement]]


def _probe_host(cfg: dict) -> list[Placement]:
    from zyx.backends.host.device import HostDevice
    from zyx.backends.host.pool import HostPool

    h = cfg["host"]
    if not h["enabled"]:
        raise BackendError(ErrorStatus.INITIALIZATION, "disabled in the config (host.enabled: false)")
    pool = HostPool()
    devices: list[Device] = [HostDevice(pool, h["cc"], h["openmp"], h["threads"])]
    if cfg["blas"]["enabled"]:
        try:
            from zyx.backends.blas import BlasDevice
            devices.append(BlasDevice(pool, devices[0].compiler, cfg["blas"]["library"]))
        except ImportError:
            pass
        except BackendError as e:
            log("dev", f"blas: unavailable: {e.context}")
    return [Placement("host", pool, devices)]


def _probe_disk(cfg: dict) -> list[Placement]:
    try:
        from zyx.backends.disk import DiskPool
    except ImportError as e:
        raise BackendError(ErrorStatus.INITIALIZATION, f"disk backend not available: {e}") from None
    return [Placement("disk", DiskPool(), [])]


def _probe_cuda(cfg: dict) -> list[Placement]:
    c = cfg["cuda"]
    if c["device_ids"] == []:
        raise BackendError(ErrorStatus.INITIALIZATION, "disabled in the config (cuda.device_ids: [])")
    try:
        from zyx.backends.cuda.backend import probe
    except ImportError as e:
        raise BackendError(ErrorStatus.INITIALIZATION,
                           f"CUDA backend not importable ({e}); install it with: pip install 'zyx[cuda]'") from None
    return probe(c)


PROBES: dict[str, Probe] = {"cuda": _probe_cuda, "host": _probe_host, "disk": _probe_disk}


class Registry:
    def __init__(self, path: Path | None = None) -> None:
        self.config, self.config_file = load_config(path)
        self._placements: dict[str, Placement] | None = None
        self.status: dict[str, str] = {}
        self._lock = threading.RLock()
        self._default: str | None = os.environ.get("ZYX_DEFAULT_DEVICE") or self.config["default_device"]

    def placements(self) -> dict[str, Placement]:
        with self._lock:
            if self._placements is None:
                found: dict[str, Placement] = {}
                for name, probe in PROBES.items():
                    try:
                        ps = probe(self.config)
                    except BackendError as e:
                        self.status[name] = f"unavailable: {e.context}"
                        log("dev", f"{name}: unavailable: {e.context}")
                        continue
                    for p in ps:
                        found[p.name] = p
                    notes = "; ".join(dict.fromkeys(p.note for p in ps if p.note))
                    ok = f"ok ({notes})" if notes else "ok"
                    self.status[name] = f"{ok}: " + ", ".join(p.name for p in ps) if ps else "no devices"
                    log("dev", f"{name}: {self.status[name]}")
                self._placements = found
            return self._placements

    def get(self, name: str) -> Placement:
        name = canonical_name(name)
        ps = self.placements()
        if name not in ps:
            reason = self.status.get(name.split(":")[0], "not a known device")
            raise BackendError(ErrorStatus.INITIALIZATION,
                               f"device {name!r} is not available ({reason}); available: {', '.join(ps) or 'none'}")
        return ps[name]

    def default_device(self) -> str:
        if self._default is not None:
            return canonical_name(self._default)
        ps = self.placements()
        for name in ps:
            if name.startswith("cuda:"):
                return name
        if "host" in ps:
            return "host"
        raise BackendError(ErrorStatus.INITIALIZATION, "no compute device is available: " +
                           "; ".join(f"{k}: {v}" for k, v in self.status.items()))

    def set_default_device(self, name: str) -> None:
        self.get(name)
        self._default = canonical_name(name)

    def report(self) -> dict[str, str]:
        self.placements()
        return dict(self.status)


_CANONICAL = {"host": "host", "cpu": "host", "cuda": "cuda:0", "disk": "disk", "cuda:0": "cuda:0"}  # spelling -> name


def canonical_name(name: str) -> str:
    n = _CANONICAL.get(name) if type(name) is str else None  # the spellings met on every op, as written
    if n is not None:
        return n
    if not isinstance(name, str):
        raise TypeError(f"device must be a name like 'host' or 'cuda:0', got {name!r}")
    n = name.strip().lower()
    if n in _CANONICAL:
        return _CANONICAL[n]
    if re.fullmatch(r"cuda:\d+", n):
        return n
    raise ValueError(f"unknown device name {name!r}; use 'host' (or 'cpu'), 'cuda', 'cuda:N' or 'disk'")


_registry: Registry | None = None
_registry_lock = threading.Lock()


def registry() -> Registry:
    global _registry
    r = _registry  # once made, read without the lock (every tensor op asks): a reference read is atomic
    if r is not None:
        return r
    with _registry_lock:
        if _registry is None:
            _registry = Registry()
        return _registry


def reset_registry(path: Path | None = None) -> Registry:
    """Re-read the config (tests); existing tensors keep their old backends alive."""
    global _registry
    with _registry_lock:
        _registry = Registry(path)
        return _registry

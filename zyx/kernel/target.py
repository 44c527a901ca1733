"""What code generation may assume about a target device: the kernel layer's own description, filled in by
each backend (``Device.info()``), so that ``zyx/kernel`` never imports ``zyx/backends``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DeviceInfo:
    """What the kernel optimizer and the cost model may assume about a device."""

    name: str
    kind: str  # "host", "blas", "cuda"
    compute_units: int = 1
    max_global_work: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    max_local_work: tuple[int, int, int] = (1, 1, 1)
    max_local_threads: int = 1
    local_memory_bytes: int = 0
    shared_optin_bytes: int = 0  # shared memory per block a kernel may opt into dynamically (CUDA; 0: none beyond)
    warp_size: int = 1
    compute_capability: tuple[int, int] | None = None
    dtypes: frozenset[str] = frozenset()
    tensor_cores: bool = False
    allow_tf32: bool = False  # float32 contractions may round their operands to tf32 on tensor cores (opt-in)
    vector_bytes: int = 32  # widest SIMD register the generated code may use
    vector_registers: int = 16  # how many of them (register tiles are sized to fit)
    # Rough peaks for the cost model (extraction); measured time replaces them when autotuning.
    peak_gflops: float = 10.0
    contraction_gflops: float = 0.0  # the generated register-tiled GEMM's rate; 0: its reduces cost per element
    memory_gbps: float = 10.0
    launch_overhead_ns: int = 2_000
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


__all__ = ["DeviceInfo"]

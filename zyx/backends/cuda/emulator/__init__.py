"""An emulated CUDA driver: the whole CUDA backend (worker, streams, events, pools, frees, NVRTC cubins, kernels,
cuDNN calls) runs on the CPU, asynchronously, without a GPU.

It stands in for ``cuda.bindings.driver`` below zyx's ``Driver`` wrapper; everything above that wrapper is the
production code path. Chosen by ``ZYX_CUDA_EMULATE=1`` or the config's ``"cuda": {"emulate": true}``; nothing in
the backend asks whether it is emulated, it only loads these bindings instead of cuda-python's. Modules:

- ``driver``: the ``cu*`` calls (an H200 by default: sm_90, 132 SMs, 228 KiB shared memory per SM, warp 32);
- ``memory``: guarded host mappings standing in for device memory (poisoned when freed, inaccessible while a
  stream-ordered allocation is pending);
- ``streams``: one thread per stream, seeded random delays, events;
- ``kernels``: the CUDA C a cubin came from, compiled for the CPU (threads as fibers);
- ``cudnn_double``: reference matmul and attention (SDPA) standing in for cuDNN (a test double, named so in
  ``python -m zyx``).

Environment (read when the driver is created): ``ZYX_CUDA_EMULATE=nokernels`` (every call accepted and ordered,
kernel bodies and copy payloads skipped: host overhead alone), ``ZYX_CUDA_EMULATE_SEED`` (stream delays, default 0),
``ZYX_CUDA_EMULATE_DELAY_US`` (largest delay before a stream operation, default 20), ``ZYX_CUDA_EMULATE_DEVICES``
(default 1), ``ZYX_CUDA_EMULATE_MEMORY_GB`` (per device, default 8).
"""

from __future__ import annotations

import os

from zyx.backends.cuda.emulator.driver import EmulatedDriver, EmulatorConfig

__all__ = ["EmulatedDriver", "EmulatorConfig", "config_from_env"]


def config_from_env() -> EmulatorConfig:
    """``ZYX_CUDA_EMULATE=nokernels`` skips kernel bodies and copy payloads, without delays unless asked for."""
    env = os.environ
    nokernels = env.get("ZYX_CUDA_EMULATE", "").strip().lower() == "nokernels"
    return EmulatorConfig(
        devices=int(env.get("ZYX_CUDA_EMULATE_DEVICES", "1")),
        memory=int(float(env.get("ZYX_CUDA_EMULATE_MEMORY_GB", "8")) * (1 << 30)),
        seed=int(env.get("ZYX_CUDA_EMULATE_SEED", "0")),
        delay_us=float(env.get("ZYX_CUDA_EMULATE_DELAY_US", "0" if nokernels else "20")),
        run_kernels=not nokernels,
    )

"""Benchmark case: lazily load a 1 GiB safetensors file and sum every tensor, beside safetensors + NumPy.

The file (64 float32 tensors of 16 MiB, random values) is built once and cached in the temp directory. After
the first run its pages sit in the OS page cache, so the timings are warm reads (memory bandwidth plus
mapping costs), not disk reads.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from zyx.bench import Row

N_TENSORS = 64
TENSOR_ELEMS = (16 << 20) // 4  # 16 MiB of float32


def bench_file() -> str:
    """Path of the cached 1 GiB file; written (atomically, with zyx.save) when missing or of the wrong size."""
    import zyx
    from zyx.io import _safetensors_header

    directory = os.path.join(tempfile.gettempdir(), "zyx-bench")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"load_and_sum_{N_TENSORS}x16MiB_f32.safetensors")
    names = [f"layer{i:02d}.weight" for i in range(N_TENSORS)]
    shape = (TENSOR_ELEMS // 1024, 1024)
    probe = {n: zyx.zeros(shape) for n in names}  # lazy: only shapes and dtypes are used
    want = len(_safetensors_header(probe, sorted(names), None)) + N_TENSORS * TENSOR_ELEMS * 4
    if os.path.exists(path) and os.path.getsize(path) == want:
        return path
    rng = np.random.default_rng(0)
    tensors = {n: zyx.Tensor(rng.standard_normal(shape, dtype=np.float32)) for n in names}
    zyx.save(path, tensors)
    return path


def load_and_sum(args) -> Row:
    import zyx
    from zyx.bench import Row, median_ms

    path = bench_file()

    def run_zyx() -> list[float]:
        sums = [t.sum() for t in zyx.load(path).values()]
        zyx.realize(*sums)
        return [s.item() for s in sums]

    def run_ref() -> list[float]:
        from safetensors.numpy import load_file

        return [float(np.sum(v)) for v in load_file(path).values()]

    row = Row(f"load {N_TENSORS}x16 MiB f32 safetensors (1 GiB) + sum each", median_ms(run_zyx, args.repeats),
              note="warm page cache: the file is read from memory after the first run")
    try:
        import safetensors.numpy  # noqa: F401

        row.refs["numpy"] = median_ms(run_ref, args.repeats)
    except ImportError:
        row.note += "; safetensors not installed (no reference)"
    return row

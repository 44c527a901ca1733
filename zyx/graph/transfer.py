"""Host data in and out of the graph: leaves holding a copy of a NumPy array, and a realized class's values
copied back to host memory. The tensor layer moves data only through these (it never touches a pool).

Invariants: an upload is staged through the host pool (a leaf on another device is a lazy copy of the host
leaf); a read needs a realized class and is a sync point of the class's pool.
"""

from __future__ import annotations

import numpy as np

from zyx import dtypes
from zyx.backends.registry import registry
from zyx.graph import ops as g
from zyx.graph.node import Buffer, Class, leaf


def upload(arr: np.ndarray, device: str) -> Class:
    """A leaf on ``device`` holding a copy of the C-contiguous ``arr``."""
    if device == "disk":
        raise ValueError("tensors cannot be created on 'disk'; save them with zyx.save(path, tensors)")
    registry().get(device)  # an unknown or unavailable device fails here, before any memory is taken
    host = registry().get("host")
    pool = host.pool
    bid = pool.allocate(arr.nbytes)
    pool.host_to_pool(memoryview(arr.reshape(-1).view(np.uint8)), bid)
    c = leaf(Buffer(pool, bid, arr.nbytes, host.name), arr.shape, dtypes.to_dtype(arr.dtype))
    return c if device == host.name else g.copy_to(c, device)


def read_into(c: Class, out: np.ndarray) -> None:
    """Copy realized ``c``'s values into the C-contiguous ``out`` (its shape and dtype)."""
    if out.nbytes:
        buf = c.buffer
        buf.pool.pool_to_host(buf.id, memoryview(out.reshape(-1).view(np.uint8)))

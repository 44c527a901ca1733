"""Host BLAS library device: float32/float64 matmul nodes on host-pool buffers, no copies.

GEMMs run through a CBLAS called with ctypes: Intel MKL when its wheel is installed (``pip install 'zyx[mkl]'``;
config ``blas.library``: "auto", "mkl" or "openblas"), else the OpenBLAS NumPy ships; where neither can be found,
through ``numpy.matmul`` on zero-copy strided views of the same buffers.
Operands are read in place through their strides: a transposed operand is a transposed GEMM, a broadcast
batch operand has batch stride 0. With the host's OpenMP compiler, GEMMs run on the OpenMP threads
(``threaded.py``), ``matmul + bias row`` (``nn.Linear``) is one GEMM starting from the bias, and every matched
attention ``softmax(scale·q·kᵀ + mask)·v`` is one fused launch (``attention.py``).
"""

from zyx.backends.blas.device import BlasDevice

__all__ = ["BlasDevice"]

"""The suite's NVRTC check (``tests/cuda_codegen_check.py``) skips for sm_90 only what sm_90 preprocesses as sm_80."""

from __future__ import annotations

import pytest
from cuda_codegen_check import _arch_dependent


@pytest.mark.parametrize("source", [
    "__global__ void k(float* p) { p[0] = 1.0f; }",
    "#ifdef __CUDA_ARCH__\nint a;\n#endif\n#ifndef __CUDA_ARCH__\nint b;\n#endif",
    "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800\nint a;\n#else\nint b;\n#endif",
    "#if !defined( __CUDA_ARCH__ ) || __CUDA_ARCH__ < 800\nint b;\n#endif",
    "#if __CUDA_ARCH__ > 700\nint a;\n#endif",
])
def test_sources_sm90_preprocesses_as_sm80(source):
    assert not _arch_dependent(source)


@pytest.mark.parametrize("source", [
    '#include <cuda_fp16.h>\n__global__ void k(__half* p) {}',
    "#if __CUDA_ARCH__ >= 900\nint a;\n#endif",
    "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 800\nint a;\n#endif",
    "#if __CUDA_ARCH__ < 850\nint a;\n#endif",
    "__global__ void k(int* p) { p[0] = __CUDA_ARCH__ / 100; }",
])
def test_sources_sm90_may_preprocess_differently(source):
    assert _arch_dependent(source)

"""For the tests of the engine's C++ kernels: take a kernel or skip where no compiler builds it."""

from __future__ import annotations

import pytest


def built(getter, fallback: str):
    """A C++ kernel (getter() from kvwall's *_kernel modules), or skip: without a compiler the engine uses `fallback`."""
    kernel = getter()
    if kernel is None:
        pytest.skip(f"no C++ toolchain to build the kernel; the engine uses {fallback}")
    return kernel

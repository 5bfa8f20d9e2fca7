"""For the tests of the engine's C++ kernels: take a kernel, or skip saying why it did not build.

Under KVWALL_REQUIRE_KERNELS=1 (CI) a kernel that does not build fails its tests instead: the
build itself raises, and a kernel missing for any other reason fails here.
"""

from __future__ import annotations

import os

import pytest

from kvwall.engine import native


def built(getter, name: str):
    """getter() (a kernel from kvwall's *_kernel modules; its source is kernels/<name>.cpp), or skip/fail."""
    kernel = getter()
    if kernel is None:
        why = native.ERRORS.get(name, "no build was attempted")
        if os.environ.get(native.REQUIRE) == "1":
            pytest.fail(f"the C++ kernel {name} did not build ({why}) and {native.REQUIRE}=1")
        pytest.skip(f"the C++ kernel {name} did not build: {why}")
    return kernel

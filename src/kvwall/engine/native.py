"""Build the engine's C++ CPU kernels on first use (torch.utils.cpp_extension, needs a C++ compiler and ninja).

Each kernel module (layers/scan_kernel.py, caches/quant_kernel.py) hands its source here; the result
is cached by torch under ~/.cache/torch_extensions. When no build works the caller gets None and
keeps its torch path: correct, only slower.
"""

from __future__ import annotations


def simd_flags(openmp: bool) -> list[str]:
    """Vectorise (exp included, through ATen's Vectorized) where torch itself runs AVX2 or better.

    openmp: at::parallel_for is a header template that runs serially unless _OPENMP is defined at
    compile time (torch's own backend is OpenMP); without -fopenmp a kernel uses one core."""
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    common = ["-O3"] + (["-fopenmp"] if openmp else [])
    if cap == "AVX512":
        return common + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
                         "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
    if cap == "AVX2":
        return common + ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return common


def simd_width(flags: list[str]) -> int:
    """Floats per SIMD vector that a build with these flags uses."""
    return 16 if "-mavx512f" in flags else 8 if "-mavx2" in flags else 1


def build(name: str, source: str):
    """(module, flags): built with OpenMP if the compiler has it, else single-threaded; None if no build works."""
    try:
        from torch.utils.cpp_extension import load_inline
    except ImportError:
        return None
    for openmp in (True, False):
        flags = simd_flags(openmp)
        try:
            mod = load_inline(name, cpp_sources=source, extra_cflags=flags,
                              extra_ldflags=["-fopenmp"] if openmp else [], verbose=False)
            return mod, flags
        except Exception:  # no compiler, no ninja, no OpenMP, a failed build: try the next, then give up
            continue
    return None

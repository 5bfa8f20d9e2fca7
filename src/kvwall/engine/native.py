"""Build the engine's C++ CPU kernels on first use (torch.utils.cpp_extension, needs a C++ compiler and ninja).

The sources are package files, ``kernels/<name>.cpp`` with the headers it includes from ``kernels/*.h`` (common.h:
includes, the SIMD vector type, the multiply-accumulate loops; packed.h: the packed matmul). Each kernel module
(layers/scan_kernel.py, caches/quant_kernel.py, layers/latent_kernel.py) asks for its kernel by
name; the build is cached under ~/.cache/torch_extensions/kvwall (TORCH_EXTENSIONS_DIR), in a folder named by
a hash of the sources, the flags and torch's version: two checkouts with the same sources share one build, and a
changed source never overwrites another checkout's (torch's own per-name folder made them rebuild in turn).
Builds of one folder take an OS lock (released when a process dies), so the lock file torch leaves behind
when a build is killed can no longer hang every later run (torch waits on it for ever).

When no build works the caller gets None and keeps its torch path: correct, only slower. That
is said once, as a warning naming the kernel, the compiler's error and the fallback, so that a
compile error never passes as a silent slowdown. With KVWALL_REQUIRE_KERNELS=1 (CI sets it) a
failed build is an error instead.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from contextlib import contextmanager
from pathlib import Path

KERNELS = Path(__file__).parent / "kernels"  # the .cpp files and the headers they include, shipped as package data
REQUIRE = "KVWALL_REQUIRE_KERNELS"  # "1": a kernel that does not build raises instead of falling back
ERRORS: dict[str, str] = {}  # kernel name -> why its build failed (the compiler's first error line)


class KernelBuildWarning(UserWarning):
    """A C++ kernel did not build; the engine runs its torch fallback."""


def source(name: str) -> Path:
    """The .cpp file of kernel `name` (e.g. "selective_scan")."""
    return KERNELS / f"{name}.cpp"


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
        return common + ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return common


def simd_width(flags: list[str]) -> int:
    """Floats per SIMD vector that a build with these flags uses."""
    return 16 if "-mavx512f" in flags else 8 if "-mavx2" in flags else 1


def build_dir(name: str, flags: list[str]) -> Path:
    """Where kernel `name` built with `flags` lives: named by a hash of its sources, flags and torch version."""
    import torch

    h = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(KERNELS.glob("*.h"))]  # any a source may include
    for part in (source(name).read_bytes(), *headers, " ".join(flags).encode(), torch.__version__.encode()):
        h.update(part)
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / "kvwall"
    return root / f"{name}-{h.hexdigest()[:16]}"


@contextmanager
def build_lock(where: Path):
    """Hold an OS lock on build folder `where` (the kernel frees it if this process dies); holding it, any lock file
    torch left there is stale (its build was killed) and is removed."""
    where.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: torch's own lock file only
        yield where
        return
    with open(where / "kvwall.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (where / "lock").unlink(missing_ok=True)  # torch's FileBaton of a killed build
        yield where


def first_error(exc: BaseException) -> str:
    """The line of a failed build that says why: the compiler's first "error:" line (file:line:col: error: ...),
    else the message's first line (no compiler, no ninja), cut to 300 characters."""
    lines = [l.strip() for l in str(exc).splitlines() if l.strip()]
    errors = [l for l in lines if "error:" in l]
    line = (errors or lines or [type(exc).__name__])[0]
    return line.replace(str(KERNELS) + os.sep, "")[:300]  # kernels/x.cpp:3:1: error: ... -> x.cpp:3:1: ...


def build(name: str, fallback: str):
    """(module, flags) of kernel `name`: built with OpenMP if the compiler has it, else single-threaded.
    None if no build works (after one warning naming `fallback`, the torch path the engine then uses)."""
    try:
        from torch.utils.cpp_extension import load
    except ImportError as exc:  # a torch without its build tools
        return failed(name, fallback, exc, "")
    detail = ""
    for openmp in (True, False):  # no OpenMP in the compiler: try again without it
        flags = simd_flags(openmp)
        try:
            with build_lock(build_dir(name, flags)) as where:
                mod = load(f"kvwall_{name}", sources=[str(source(name))], extra_cflags=flags,
                           extra_include_paths=[str(KERNELS)], extra_ldflags=["-fopenmp"] if openmp else [],
                           build_directory=str(where), verbose=False)
            return mod, flags
        except Exception as exc:  # no compiler, no ninja, no OpenMP, a compile error
            error, detail = exc, str(exc)
    return failed(name, fallback, error, detail)


def failed(name: str, fallback: str, exc: BaseException, detail: str) -> None:
    """Record why kernel `name` did not build and say so once: a warning, or an error under KVWALL_REQUIRE_KERNELS=1."""
    from kvwall.errors import KvwallError

    why = ERRORS[name] = first_error(exc)
    if os.environ.get(REQUIRE) == "1":
        raise KvwallError(f"the C++ kernel {name} did not build ({why}) and {REQUIRE}=1 requires it; "
                          "fix the compiler error (or install a C++ compiler and ninja) or unset " + REQUIRE)
    tail = "\n".join(detail.strip().splitlines()[-20:])  # the compiler's own words, for whoever fixes it
    warnings.warn(f"kvwall: the C++ kernel {name} did not build ({why}); using {fallback} instead, "
                  f"correct but slower. Set {REQUIRE}=1 to make this an error.\n{tail}".rstrip(),
                  KernelBuildWarning, stacklevel=3)
    return None


def compiled(name: str, function: str, fallback: str):
    """One function of kernel `name`'s module, or None when no build works."""
    built = build(name, fallback)
    return None if built is None else getattr(built[0], function)

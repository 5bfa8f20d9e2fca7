"""Build the engine's C++ CPU kernels on first use (torch.utils.cpp_extension, needs a C++ compiler and ninja).

The sources are package files, ``kernels/<name>.cpp`` with the headers it includes from ``kernels/*.h`` (common.h:
includes, the SIMD vector type, the multiply-accumulate loops; packed.h: the packed matmul). Each kernel module
(layers/scan_kernel.py, caches/quant_kernel.py, layers/latent_kernel.py) asks for its kernel by
name; the build is cached under ~/.cache/torch_extensions/kvwall (TORCH_EXTENSIONS_DIR), in a folder named by
a hash of the sources, the flags, torch's version and the checkout's kernel folder: a changed source never
overwrites another checkout's (torch's own per-name folder made them rebuild in turn), and two checkouts never
share a folder (its build.ninja names one checkout's .cpp path, so they compiled again in turn; up_to_date checks it).
Builds of one folder take an OS lock (released when a process dies), so the lock file torch leaves behind
when a build is killed can no longer hang every later run (torch waits on it for ever).

A build takes 25-35 s of one core per kernel (BUILD_S), minutes for them all, so a real compile is never silent:
it says on stderr when it starts ("building C++ kernel 3 of 7: packed_linear (first use; cached under ...)") and
when it ends (stdout may be JSON). The total is the number of kernels/*.cpp (names(), the one list); k counts the
kernels ready or started, this one included. A cached build says nothing. build_all() builds every missing kernel
at once, as many at a time as there are cores (each build is one compile then one link, a chain ninja cannot run
in parallel, so the cores are used by building kernels side by side); the commands that need several kernels
(calibrate, bench, report's measured section) call it first, so that the builds happen together, up front, and
not one by one inside a measurement (or silently, in a bench worker whose stderr is a pipe). build_note() is
the phrase their "about N s" estimates add when something is to be built.

When no build works the caller gets None and keeps its torch path: correct, only slower. That
is said once, as a warning naming the kernel, the compiler's error and the fallback, so that a
compile error never passes as a silent slowdown. With KVWALL_REQUIRE_KERNELS=1 (CI sets it) a
failed build is an error instead.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

KERNELS = Path(__file__).parent / "kernels"  # the .cpp files and the headers they include, shipped as package data
REQUIRE = "KVWALL_REQUIRE_KERNELS"  # "1": a kernel that does not build raises instead of falling back
ERRORS: dict[str, str] = {}  # kernel name -> why its build failed (the compiler's first error line)
ANY_FALLBACK = "its torch path"  # what build_all's warnings name: the kernel's callers each keep their own

# Seconds of one core that building each kernel takes: the CPU time of its compile and link (ninja, g++, ld), what
# a build costs on an idle core. Measured 2026-12-05 on the dev box (AMD EPYC, 2 cores, AVX-512 flags, g++ 12.2, torch
# 2.13.0+cpu, other jobs keeping the load average at 3-5), each kernel built alone into an empty
# TORCH_EXTENSIONS_DIR, one after another: 199.5 s of CPU in all, 303 s of wall time on that busy machine. The same
# seven built 2 at a time (build_all's way on 2 cores): 197 s of wall time, 214 s of CPU (two compilers side by
# side are 7% slower each), so 1.54x sooner. A kernel not listed here counts as BUILD_S_ANY.
BUILD_S = {"decode_stack": 35.1, "fused_ops": 31.7, "mla_decode": 26.5, "packed_linear": 25.6, "paged_decode": 24.4,
           "quantized_decode": 28.5, "selective_scan": 27.7, "delta_rule": 34.5}  # delta_rule: one build, 2026-12-06
BUILD_S_ANY = max(BUILD_S.values())
PARALLEL_SLOWDOWN = 1.1  # builds side by side: each 7% slower (214 s of CPU against 199.5), and a little uneven

_lock = threading.Lock()  # the progress counter and the loaded modules, shared by build_all's threads
_started: set[str] = set()  # kernels whose real build this process started
_loaded: dict[tuple[str, Path], tuple | None] = {}  # (name, build root) -> build()'s answer, once per process


class KernelBuildWarning(UserWarning):
    """A C++ kernel did not build; the engine runs its torch fallback."""


def source(name: str) -> Path:
    """The .cpp file of kernel `name` (e.g. "selective_scan")."""
    return KERNELS / f"{name}.cpp"


def names() -> list[str]:
    """Every kernel: the .cpp files in kernels/, by name (the one list of them)."""
    return sorted(p.stem for p in KERNELS.glob("*.cpp"))


def simd_flags(openmp: bool) -> list[str]:
    """Vectorise (exp included, through ATen's Vectorized) where torch itself runs AVX2 or better.

    openmp: at::parallel_for is a header template that runs serially unless _OPENMP is defined at
    compile time (torch's own backend is OpenMP); without -fopenmp a kernel uses one core."""
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    common = ["-O3"] + (["-fopenmp"] if openmp else [])
    if cap == "AVX512":
        vnni = ["-mavx512vnni"] if has_vnni() else []  # int8 activations' integer kernel (packed.h, x8)
        return common + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", *vnni,
                         "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"]
    if cap == "AVX2":
        return common + ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
    return common


def has_vnni() -> bool:
    """Whether this CPU has AVX-512 VNNI (vpdpbusd), from the kernel's cpu flags (False where they cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " avx512_vnni" in line for line in f)
    except OSError:
        return False


def simd_width(flags: list[str]) -> int:
    """Floats per SIMD vector that a build with these flags uses."""
    return 16 if "-mavx512f" in flags else 8 if "-mavx2" in flags else 1


def build_dir(name: str, flags: list[str]) -> Path:
    """Where kernel `name` built with `flags` lives: named by a hash of its sources, flags, torch version and the
    checkout's kernel folder (torch rewrites build.ninja with the .cpp path, so two checkouts sharing one folder
    rebuilt each other's kernel on every first use: a CI clone beside a working tree compiled for minutes)."""
    import torch

    h = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(KERNELS.glob("*.h"))]  # any a source may include
    for part in (source(name).read_bytes(), *headers, " ".join(flags).encode(), torch.__version__.encode(),
                 os.path.abspath(KERNELS).encode()):
        h.update(part)
    return build_root() / f"{name}-{h.hexdigest()[:16]}"


def build_root() -> Path:
    """The folder of every kernel's build folder."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / "kvwall"


def library(name: str, where: Path) -> Path:
    """The module file a build of kernel `name` in folder `where` makes (torch's naming)."""
    return where / f"kvwall_{name}{'.pyd' if sys.platform == 'win32' else '.so'}"


def up_to_date(name: str, where: Path) -> bool:
    """Whether loading kernel `name` from folder `where` compiles nothing: its module is there, newer than its
    sources (ninja's test), and built from this very .cpp path (torch rewrites build.ninja for another checkout's
    path, and ninja then builds again)."""
    try:
        built = library(name, where).stat().st_mtime
        ninja = (where / "build.ninja").read_text(errors="replace")
        newest = max(p.stat().st_mtime for p in [source(name), *KERNELS.glob("*.h")])
    except (OSError, ValueError):
        return False
    return built >= newest and os.path.abspath(source(name)) in ninja


def _variants(name: str) -> list[bool]:
    """The builds to try, OpenMP or not: with OpenMP first, unless only the build without it is up to date (the
    compiler has no OpenMP: do not fail at it again on every run)."""
    done = [openmp for openmp in (True, False) if up_to_date(name, build_dir(name, simd_flags(openmp)))]
    return [False, True] if done == [False] else [True, False]


def cached(name: str) -> bool:
    """Whether kernel `name` loads without compiling (or this process already has it)."""
    return (name, build_root()) in _loaded or any(
        up_to_date(name, build_dir(name, simd_flags(openmp))) for openmp in (True, False))


def missing() -> list[str]:
    """The kernels a first use would compile now: neither built in the cache nor tried by this process."""
    try:
        import torch  # noqa: F401
    except ImportError:  # no engine: nothing will be built
        return []
    return [n for n in names() if not cached(n)]


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
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    line = (errors or lines or [type(exc).__name__])[0]
    return line.replace(str(KERNELS) + os.sep, "")[:300]  # kernels/x.cpp:3:1: error: ... -> x.cpp:3:1: ...


def build(name: str, fallback: str):
    """(module, flags) of kernel `name`: built with OpenMP if the compiler has it, else single-threaded.
    None if no build works (after one warning naming `fallback`, the torch path the engine then uses).
    A real compile says so on stderr (started, k of n; ended, in how long); the answer is kept for the process."""
    key = (name, build_root())
    if key in _loaded:
        return _loaded[key]
    try:
        from torch.utils.cpp_extension import load
    except ImportError as exc:  # a torch without its build tools
        return failed(name, fallback, exc, "")
    detail, began = "", None
    for openmp in _variants(name):  # no OpenMP in the compiler: try again without it
        flags = simd_flags(openmp)
        try:
            with build_lock(build_dir(name, flags)) as where:
                if began is None and not up_to_date(name, where):
                    began = _starting(name)
                mod = load(f"kvwall_{name}", sources=[str(source(name))], extra_cflags=flags,
                           extra_include_paths=[str(KERNELS)], extra_ldflags=["-fopenmp"] if openmp else [],
                           build_directory=str(where), verbose=False)
        except Exception as exc:  # no compiler, no ninja, no OpenMP, a compile error
            error, detail = exc, str(exc)
            continue
        _ended(name, began, built=True)
        _loaded[key] = (mod, flags)
        return mod, flags
    _ended(name, began, built=False)
    answer = failed(name, fallback, error, detail)  # raises under KVWALL_REQUIRE_KERNELS=1: tried again next time
    _loaded[key] = answer  # said once: not built again (nor warned again) in this process
    return answer


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


def say(line: str) -> None:
    """A progress line: on stderr (stdout may be a command's JSON), at once."""
    print(line, file=sys.stderr, flush=True)


def _shown(path: Path) -> str:
    home = str(Path.home())
    return "~" + str(path)[len(home):] if str(path).startswith(home + os.sep) else str(path)


def _starting(name: str) -> tuple[str, float]:
    """Say that kernel `name` starts compiling, as the k-th of all kernels ready or started; its label and start."""
    with _lock:
        _started.add(name)
        ready = {n for n in names() if n in _started or cached(n)} | {name}
        label = f"C++ kernel {len(ready)} of {len(names())}: {name}"
    say(f"building {label} (first use; cached under {_shown(build_root())})")
    return label, time.perf_counter()


def _ended(name: str, began: tuple[str, float] | None, built: bool) -> None:
    """Say that the compile `began` (None: there was none) ended, and how long it took."""
    if began is None:
        return
    label, t0 = began
    took = f"{time.perf_counter() - t0:.0f} s"
    say(f"{label} built in {took}" if built else f"{label} did not build ({took}; the warning below says why)")


def build_all(jobs: int | None = None) -> dict[str, bool]:
    """Build every kernel that is missing (missing()), up to `jobs` at once (default: one per core), longest first;
    each says when it starts and ends. {name: whether it built}, empty when nothing was missing."""
    todo = sorted(missing(), key=lambda n: -BUILD_S.get(n, BUILD_S_ANY))  # longest first: the shortest makespan
    if not todo:
        return {}
    jobs = max(1, min(jobs or usable_cores(), len(todo)))
    say(f"building {_count(todo)}, {jobs} at a time ({_about(build_seconds(todo, jobs))}, once): "
        f"{', '.join(todo)}")

    def one(name: str) -> bool:
        return build(name, ANY_FALLBACK) is not None

    if jobs == 1:
        return {n: one(n) for n in todo}
    with ThreadPoolExecutor(jobs, thread_name_prefix="kvwall-build") as pool:  # each waits on its compiler
        return dict(zip(todo, pool.map(one, todo)))


def build_seconds(todo: list[str], cores: int | None = None) -> float:
    """About how long building the kernels `todo` takes with `cores` (default: this machine's) builds at once:
    longest first, each onto the build slot free first (BUILD_S: one core's seconds per kernel)."""
    slots = [0.0] * max(1, min(cores or usable_cores(), len(todo) or 1))
    for s in sorted((BUILD_S.get(n, BUILD_S_ANY) for n in todo), reverse=True):
        slots[slots.index(min(slots))] += s
    return max(slots) * (PARALLEL_SLOWDOWN if len(slots) > 1 else 1.0)


def build_note(todo: list[str] | None = None, cores: int | None = None) -> str:
    """What an "about N s" estimate adds for the kernels to build first ("building 7 C++ kernels first (about 4 min
    on 2 cores, once)"), or "" when none is missing. todo: missing() unless given; cores: this machine's."""
    todo = missing() if todo is None else todo
    if not todo:
        return ""
    cores = max(1, cores or usable_cores())
    return f"building {_count(todo)} first ({_about(build_seconds(todo, cores))} on {cores} " \
           f"core{'s' if cores > 1 else ''}, once)"


def usable_cores() -> int:
    """The CPUs this process may run on: how many builds run at once."""
    from kvwall.measure.machine import cpu_count

    return cpu_count()


def _count(todo: list[str]) -> str:
    return "1 C++ kernel" if len(todo) == 1 else f"{len(todo)} C++ kernels"


def _about(seconds: float) -> str:
    return f"about {seconds:.0f} s" if seconds < 90 else f"about {seconds / 60:.0f} min"

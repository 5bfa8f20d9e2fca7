"""What this machine is, read from the OS: CPU model, cores, memory, last-level cache, BLAS and library versions."""

from __future__ import annotations

import ctypes
import glob
import os
import platform
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

# Environment variables that change which BLAS kernels run (and so the GEMM/GEMV numbers).
BLAS_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cpu_count() -> int:
    """CPUs this process may run on (the affinity mask, not the host's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_model() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.lower().startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_vendor() -> str:
    for line in _read("/proc/cpuinfo").splitlines():
        if line.lower().startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return ""


def cpu_facts() -> dict:
    """The CPU a timing ran on, as a benchmark's results file records it: the model name, the CPUs this process may
    use and the vector ISA torch dispatches to (the one kvwall's kernels compile for: engine/native.py's
    simd_flags). The machine behind this project's runs changed under the same name: until 2026-12-07 it had
    AVX-512, that day's had AVX2 only, and a packed matmul's speed depends on which."""
    try:
        import torch

        simd = torch.backends.cpu.get_cpu_capability()
    except ImportError:
        simd = None
    return {"cpu_model": cpu_model(), "cpus": cpu_count(), "simd": simd}


def memory_bytes() -> int:
    """Installed memory: MemTotal from /proc/meminfo, else sysconf pages x page size."""
    kib = _meminfo().get("MemTotal")
    if kib:
        return kib * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_bytes() -> int:
    kib = _meminfo().get("MemAvailable")
    return kib * 1024 if kib else memory_bytes() // 2


def llc_bytes() -> int | None:
    """Size of the last-level cache as the OS reports it (sysfs, else lscpu); None when unknown."""
    best = (0, 0)
    for d in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*"):
        level, size = _read(f"{d}/level").strip(), _parse_size(_read(f"{d}/size"))
        if level.isdigit() and size:
            best = max(best, (int(level), size))
    if best[1]:
        return best[1]
    return _lscpu_llc()


def blas_info() -> dict:
    """numpy's BLAS library, and for OpenBLAS the kernel it picked at run time (e.g. 'SkylakeX' or 'Haswell')."""
    import numpy as np

    info: dict = {"env": {k: os.environ[k] for k in BLAS_ENV if k in os.environ}}
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        info |= {"name": blas.get("name"), "version": blas.get("version")}
    except Exception:  # show_config's layout differs across numpy versions
        pass
    core = _openblas_core(Path(np.__file__).parent)
    if core:
        info["openblas_core"] = core
    return info


def versions() -> dict:
    import numpy as np

    out = {"python": platform.python_version(), "numpy": np.__version__, "torch": None}
    try:
        import torch

        out["torch"] = torch.__version__
    except ImportError:
        pass
    return out


def cpu_seconds() -> tuple[float, float]:
    """(CPU-seconds all processes have run, CPU-seconds this process has run) since boot / start.

    The difference between two readings, minus this process's share, is what *other* processes took
    while we measured: on a shared 2-core machine that is the main reason a calibration comes out low.
    """
    fields = _read("/proc/stat").split("\n", 1)[0].split()[1:]
    # user nice system idle iowait irq softirq steal ...: busy = all but idle and iowait; steal counts too
    busy = sum(int(v) for i, v in enumerate(fields[:8]) if i not in (3, 4)) * clock_tick() if fields else 0.0
    return busy, time.process_time()


def clock_tick() -> float:
    """Seconds per /proc/stat tick (usually 0.01 s): the resolution of what cpu_seconds() says of others."""
    return 1 / os.sysconf("SC_CLK_TCK")


class OthersWatch:
    """The share of `cpus` CPUs that other processes used since it was made (cpu_seconds: all processes'
    CPU time less ours). `children`: our exited child processes count as ours too (kvwall bench's workers;
    a child still running is not yet counted, so read it after they exit)."""

    def __init__(self, children: bool = False):
        self.children = children
        self._start = self._reading()

    def _reading(self) -> tuple[float, float, float]:
        import resource

        busy, own = cpu_seconds()
        if self.children:
            usage = resource.getrusage(resource.RUSAGE_CHILDREN)
            own += usage.ru_utime + usage.ru_stime
        return busy, own, time.perf_counter()

    def share(self, cpus: float) -> float:
        (busy0, own0, t0), (busy1, own1, t1) = self._start, self._reading()
        others = (busy1 - busy0) - (own1 - own0) - 2 * clock_tick()  # less the readings' resolution
        return min(1.0, max(0.0, others / (max(t1 - t0, 1e-9) * cpus)))


def load_average() -> float | None:
    """The 1-minute load average (runnable and waiting processes, ours included); None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def hostname() -> str:
    return socket.gethostname()


# -- helpers -------------------------------------------------------------------

def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _meminfo() -> dict[str, int]:
    out = {}
    for line in _read("/proc/meminfo").splitlines():
        m = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if m:
            out[m.group(1)] = int(m.group(2))
    return out


def _parse_size(text: str) -> int:
    """'491520K', '2 MiB', '32768 KB' -> bytes (binary multiples, as the kernel and lscpu mean them)."""
    m = re.match(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)", text or "", re.I)
    if not m:
        return 0
    return int(float(m.group(1)) * 1024 ** " KMG".index(m.group(2).upper() or " "))


def _lscpu_llc() -> int | None:
    if not shutil.which("lscpu"):
        return None
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = {}
    for line in text.splitlines():
        m = re.match(r"\s*L(\d)\w* cache:\s*(.+)", line)
        if m:
            sizes[int(m.group(1))] = _parse_size(m.group(2))  # the total over instances for that level
    return sizes[max(sizes)] if sizes else None


def _openblas_core(numpy_dir: Path) -> str | None:
    """Ask numpy's bundled OpenBLAS which kernel it chose (the library is already loaded; this reopens it)."""
    for lib in glob.glob(str(numpy_dir.parent / "numpy.libs" / "*openblas*")):
        try:
            handle = ctypes.CDLL(lib)
        except OSError:
            continue
        for sym in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename", "openblas_get_corename"):
            fn = getattr(handle, sym, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return fn().decode()
    return None

"""Timed kernels for calibration: streaming read, copy, matrix-vector (GEMV) and matrix-matrix (GEMM).

Each function runs its kernel once untimed (warm-up: page faults, thread start, kernel selection), then
``runs`` times, and returns a Measurement holding every run's seconds and the work one run does.
Bytes are counted the STREAM way: a read counts its buffer once; a copy counts read + write (2 x size),
not the extra write-allocate traffic the hardware may add.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Measurement:
    kind: str  # read | copy | gemv | gemm
    method: str  # in words: library, kernel, threads
    dtype: str
    size: str  # buffer size or matrix shape, in words
    runs_s: list[float] = field(default_factory=list)
    bytes_per_run: int = 0
    flops_per_run: int = 0
    others_cpu: float = 0.0  # share of all CPUs that other processes used during this measurement (0..1)
    attempts: int = 1  # measured again when others were busy; this is the quietest attempt

    @property
    def median_s(self) -> float:
        return statistics.median(self.runs_s)

    @property
    def bandwidth(self) -> float | None:
        """Bytes/s at the median run."""
        return self.bytes_per_run / self.median_s if self.bytes_per_run else None

    @property
    def flops(self) -> float | None:
        """FLOP/s at the median run."""
        return self.flops_per_run / self.median_s if self.flops_per_run else None

    def as_dict(self) -> dict:
        per_run = [self.bytes_per_run / t for t in self.runs_s] if self.bytes_per_run else None
        per_run_f = [self.flops_per_run / t for t in self.runs_s] if self.flops_per_run else None
        return {
            "kind": self.kind, "method": self.method, "dtype": self.dtype, "size": self.size,
            "bytes_per_run": self.bytes_per_run, "flops_per_run": self.flops_per_run,
            "median_s": self.median_s, "bandwidth_Bps": self.bandwidth, "flops": self.flops,
            "runs_s": self.runs_s, "runs_bandwidth_Bps": per_run, "runs_flops": per_run_f,
            "others_cpu_share": round(self.others_cpu, 3), "attempts": self.attempts,
        }


def time_runs(fn, runs: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def dtype_name(dtype) -> str:
    """numpy's 'float32' -> kvwall's 'fp32' (the names the device catalog uses)."""
    return {"float32": "fp32", "float64": "fp64", "float16": "fp16"}.get(str(dtype), str(dtype))


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


# -- streaming read --------------------------------------------------------------

def read_numpy(buf: np.ndarray, runs: int) -> Measurement:
    """numpy's SIMD sum over the buffer on one core."""
    return Measurement("read", "numpy sum, 1 thread", dtype_name(buf.dtype), gib(buf.nbytes),
                       time_runs(lambda: np.add.reduce(buf), runs), bytes_per_run=buf.nbytes)


def read_numpy_threads(buf: np.ndarray, threads: int, runs: int) -> Measurement:
    """numpy max over one slice per thread (numpy releases the GIL in float reductions)."""
    parts = np.array_split(buf, threads)
    with ThreadPoolExecutor(threads) as pool:
        runs_s = time_runs(lambda: list(pool.map(np.maximum.reduce, parts)), runs)
    return Measurement("read", f"numpy max, {threads} threads", dtype_name(buf.dtype), gib(buf.nbytes), runs_s,
                       bytes_per_run=buf.nbytes)


def read_torch(buf: np.ndarray, threads: int, runs: int) -> Measurement:
    import torch

    t = torch.from_numpy(buf)  # the same memory, no copy
    with torch_threads(threads):
        runs_s = time_runs(lambda: torch.amax(t), runs)
    return Measurement("read", f"torch amax, {threads} threads", dtype_name(buf.dtype), gib(buf.nbytes), runs_s,
                       bytes_per_run=buf.nbytes)


# -- copy ------------------------------------------------------------------------

def copy_numpy(src: np.ndarray, dst: np.ndarray, runs: int) -> Measurement:
    return Measurement("copy", "numpy copyto, 1 thread", dtype_name(src.dtype), gib(src.nbytes),
                       time_runs(lambda: np.copyto(dst, src), runs), bytes_per_run=2 * src.nbytes)


def copy_numpy_threads(src: np.ndarray, dst: np.ndarray, threads: int, runs: int) -> Measurement:
    pairs = list(zip(np.array_split(dst, threads), np.array_split(src, threads)))
    with ThreadPoolExecutor(threads) as pool:
        runs_s = time_runs(lambda: list(pool.map(lambda p: np.copyto(*p), pairs)), runs)
    return Measurement("copy", f"numpy copyto, {threads} threads", dtype_name(src.dtype), gib(src.nbytes), runs_s,
                       bytes_per_run=2 * src.nbytes)


def copy_torch(src: np.ndarray, dst: np.ndarray, threads: int, runs: int) -> Measurement:
    import torch

    s, d = torch.from_numpy(src), torch.from_numpy(dst)
    with torch_threads(threads):
        runs_s = time_runs(lambda: d.copy_(s), runs)
    return Measurement("copy", f"torch copy_, {threads} threads", dtype_name(src.dtype), gib(src.nbytes), runs_s,
                       bytes_per_run=2 * src.nbytes)


# -- GEMV: y = A x, the shape of decode ----------------------------------------------

def gemv_numpy(a: np.ndarray, runs: int) -> Measurement:
    rows, cols = a.shape
    x = np.ones(cols, dtype=a.dtype)
    return Measurement("gemv", "numpy A @ x (BLAS)", dtype_name(a.dtype), f"{rows}x{cols}",
                       time_runs(lambda: a @ x, runs), bytes_per_run=a.nbytes, flops_per_run=2 * rows * cols)


def gemv_torch(a: np.ndarray, dtype: str, threads: int, runs: int) -> Measurement:
    """torch.mv on a (rows, cols) matrix; bf16 is converted from the fp32 buffer first (not timed)."""
    import torch

    t = torch.from_numpy(a)
    if dtype != "fp32":
        t = t.to(torch_dtype(dtype))  # (rows, cols)
    x = torch.ones(t.shape[1], dtype=t.dtype)  # (cols,)
    nbytes = t.numel() * t.element_size()
    with torch_threads(threads):
        runs_s = time_runs(lambda: torch.mv(t, x), runs)
    return Measurement("gemv", f"torch mv, {threads} threads", dtype, f"{t.shape[0]}x{t.shape[1]}", runs_s,
                       bytes_per_run=nbytes, flops_per_run=2 * t.numel())


# -- GEMM: C = A B, the shape of prefill ----------------------------------------------

GEMM_BUDGET_S = 3.0  # one GEMM step's timed runs; bf16 on a CPU without AVX-512 runs at 0.3 GFLOP/s (measured),
# where 8 runs of 2048^3 took 8 minutes


def budget_n(n: int, runs: int, matmul_of, budget_s: float = GEMM_BUDGET_S, floor: int = 256) -> int:
    """The largest n (n, n/2, ... down to floor) whose warm-up and runs fit budget_s, from one timed floor^3 probe.

    matmul_of(m) returns a callable doing one m x m x m product."""
    probe = matmul_of(floor)
    probe()  # warm-up: kernel selection, thread start
    start = time.perf_counter()
    probe()
    rate = 2 * floor**3 / max(time.perf_counter() - start, 1e-9)  # FLOP/s at the probe size
    while n > floor and 2 * n**3 / rate * (runs + 1) > budget_s:
        n //= 2
    return n


def gemm_numpy(n: int, dtype: str, runs: int) -> Measurement:
    rng = np.random.default_rng(0)
    np_dtype = {"fp32": np.float32, "fp64": np.float64}[dtype]

    def matmul_of(m):
        a = rng.standard_normal((m, m), dtype=np_dtype)
        b = rng.standard_normal((m, m), dtype=np_dtype)
        return lambda: a @ b

    n = budget_n(n, runs, matmul_of)
    return Measurement("gemm", "numpy A @ B (BLAS)", dtype, f"{n}x{n}x{n}", time_runs(matmul_of(n), runs),
                       flops_per_run=2 * n**3)


def gemm_torch(n: int, dtype: str, threads: int, runs: int) -> Measurement:
    import torch

    g = torch.Generator().manual_seed(0)

    def matmul_of(m):
        a = torch.randn(m, m, generator=g).to(torch_dtype(dtype))
        b = torch.randn(m, m, generator=g).to(torch_dtype(dtype))
        return lambda: a @ b

    with torch_threads(threads):
        n = budget_n(n, runs, matmul_of)
        runs_s = time_runs(matmul_of(n), runs)
    return Measurement("gemm", f"torch A @ B, {threads} threads", dtype, f"{n}x{n}x{n}", runs_s,
                       flops_per_run=2 * n**3)


# -- torch helpers ----------------------------------------------------------------

def torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}[name]


@contextmanager
def torch_threads(n: int):
    """Run with n intra-op threads, then put back what was there."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)

"""Shared by the benchmark scripts: the median of timed runs after warm-up."""

from __future__ import annotations

import statistics
import time


def median_ms(step, n: int, warmup: int = 2) -> float:
    """Median milliseconds of `n` calls of step() after `warmup` untimed ones."""
    times = []
    for i in range(n + warmup):
        t0 = time.perf_counter()
        step()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)

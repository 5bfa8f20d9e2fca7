"""How many threads each decode step runs on, chosen by timing the steps (issue #43: robust under a neighbour).

Why: a decode step is ~150 parallel regions, each ending at a barrier (torch's OpenMP and the native kernels'). Beside
another busy process one of our threads waits on the run queue while the other spins at the barrier for it, so the
step runs at the pace of the slices the scheduler gives the slower one. On the dev box's 2 cores Gemma 3 at 16k
tokens (+a8, int4 cache) kept 0.33x of its quiet speed on 2 threads beside a one-thread neighbour, and 0.49x with
this governor, which settled on 1 thread (llama.cpp: 0.36x; benchmarks/results/long_race_gemma16k_auto_threads_t2.json).

The governor reads how long our threads waited to run (Linux's per-thread run-queue delay,
``/proc/self/task/*/schedstat``). When they wait, it runs a few steps on one thread fewer and keeps that count if
those steps were faster; below the count it was given, it tries one more now and then (after 32 steps, then 64, ...
up to 1024) and keeps it if faster, so the threads come back when the neighbour leaves. A quiet machine is never
probed: its steps only pay the read, ~25 us every 8 steps. Off Linux (no schedstat) it never changes the count.

    gov = ThreadGovernor()                 # at most torch.get_num_threads()
    for ...:
        with gov.step(key=rows):           # key: the step's shape; times only compare within one shape
            logits = model(tokens, pos, cache)
    gov.close()                            # the count it was given, back

The thread count changes how decode attention cuts a long cache into pieces (``kernels/common.h`` ``cut_jobs``), so
sums past 256 tokens a job may round differently from a fixed count's: equal within fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch

CHECK_EVERY = 8  # steps between reads of the run-queue delay
PROBE_STEPS = 4  # steps a trial count runs, and the recent steps it is compared with (medians)
GAIN = 0.10  # a trial count is kept when its median step is this much shorter
CROWDED = 0.10  # our threads' run-queue delay per second of wall time that counts as a crowded machine
UP_FIRST, BACKOFF_MOST = 32, 1024  # steps before the first retry of a count, doubling up to this


def run_queue_s(task_dir: str = "/proc/self/task") -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU, summed (schedstat's second field),
    or None where the kernel does not report it."""
    total = 0
    try:
        for tid in os.listdir(task_dir):
            try:
                with open(f"{task_dir}/{tid}/schedstat") as f:
                    total += int(f.read().split()[1])
            except (FileNotFoundError, ProcessLookupError):  # a thread that ended between listdir and open
                continue
    except (OSError, IndexError, ValueError):
        return None
    return total / 1e9


class ThreadGovernor:
    """Picks each decode step's thread count, at most `most` (default: torch's count when made)."""

    def __init__(self, most: int | None = None, *, clock: Callable[[], float] | None = None,
                 waited: Callable[[], float | None] | None = None, set_threads: Callable[[int], None] | None = None):
        self.most = most or torch.get_num_threads()
        self.n = self.most  # the count steps run on, outside trials
        self.clock = clock or time.perf_counter
        self.waited = waited or run_queue_s
        self._set_threads = set_threads or torch.set_num_threads
        self.recent: deque[float] = deque(maxlen=PROBE_STEPS)  # seconds of the latest steps on n threads
        self.trial: tuple[int, list[float]] | None = None  # (count, seconds of its steps so far)
        self.key = None
        self.steps = 0  # every step timed, trials included
        self.next_check = CHECK_EVERY
        self.down_at, self.down_wait = 0, UP_FIRST  # no trial of n - 1 before step down_at
        self.up_at, self.up_wait = UP_FIRST, UP_FIRST  # no trial of n + 1 before step up_at
        self.mark = (self.clock(), self.waited())
        self.trials: list[tuple[int, int, int, bool]] = []  # (step, from, to, kept): every trial, when it ended
        self.current = self.most  # the count last set
        self._set_threads(self.most)

    @property
    def changes(self) -> list[tuple[int, int, int]]:
        """(step, from, to) of every count kept."""
        return [(step, a, b) for step, a, b, kept in self.trials if kept]

    @contextmanager
    def step(self, key=None):
        """Run one step (the with-block) on the count chosen for it and time it. `key`: the step's shape (rows,
        tokens); a new one drops the times of the last shape."""
        if key != self.key:
            self.key, self.trial = key, None
            self.recent.clear()
        count = self.trial[0] if self.trial else self.n
        if count != self.current:
            self._set_threads(count)
            self.current = count
        t0 = self.clock()
        yield
        self._record(self.clock() - t0)

    def close(self) -> None:
        """Give back the count the governor was made with."""
        if self.current != self.most:
            self._set_threads(self.most)
            self.current = self.most

    def _record(self, seconds: float) -> None:
        self.steps += 1
        if self.trial:
            count, times = self.trial
            times.append(seconds)
            if len(times) == PROBE_STEPS:
                self.trial = None
                self._decide(count, times)
            return
        self.recent.append(seconds)
        if self.steps < self.next_check or len(self.recent) < PROBE_STEPS:
            return
        self.next_check = self.steps + CHECK_EVERY
        if self.n > 1 and self.steps >= self.down_at and self._crowded():
            self.trial = (self.n - 1, [])
        elif self.n < self.most and self.steps >= self.up_at:
            self.trial = (self.n + 1, [])

    def _crowded(self) -> bool:
        now, waited = self.clock(), self.waited()
        (then, before), self.mark = self.mark, (now, waited)
        if waited is None or before is None or now <= then:
            return False
        return (waited - before) / (now - then) > CROWDED

    def _decide(self, count: int, times: list[float]) -> None:
        kept = statistics.median(times) < statistics.median(self.recent) * (1 - GAIN)
        self.trials.append((self.steps, self.n, count, kept))
        if kept:
            self.n = count
            self.recent = deque(times, maxlen=PROBE_STEPS)
            self.down_at, self.down_wait = self.steps, UP_FIRST  # crowded still: the next one down may pay too
            self.up_at, self.up_wait = self.steps + UP_FIRST, UP_FIRST
            self.mark = (self.clock(), self.waited())  # the delay of the new count's steps only
        elif count < self.n:
            self.down_at, self.down_wait = self.steps + self.down_wait, min(2 * self.down_wait, BACKOFF_MOST)
        else:
            self.up_at, self.up_wait = self.steps + self.up_wait, min(2 * self.up_wait, BACKOFF_MOST)


def step_on(governor: ThreadGovernor | None, key=None):
    """governor.step(key), or a plain block where there is no governor (a fixed thread count)."""
    return governor.step(key) if governor else nullcontext()

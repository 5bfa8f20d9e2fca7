"""What makes a peer comparison fair, shared by the scripts that time kvwall against another engine: every engine
gets the same compute threads (and each results row records how many it was given and how many it used), and the
engines take turns run by run, so that a machine that slows down for a while slows them alike.

Plain Python, no kvwall import: profile_vllm_step.py's worker imports it inside vLLM's own venv.

How each engine is given N threads (and what it reports back):
  * kvwall and transformers (torch): torch.set_num_threads(N) in process, OMP_NUM_THREADS=N in a child's
    environment (torch sizes its intra-op pool from it at start); torch.get_num_threads() says what it got.
  * vLLM's CPU build (0.32): VLLM_CPU_OMP_THREADS_BIND="0-(N-1)" gives its model worker N OpenMP threads bound
    to cores 0..N-1 (vllm/utils/ompmultiprocessing.py sets the worker's OMP_NUM_THREADS, OMP_PLACES and
    OMP_PROC_BIND from it), and OMP_NUM_THREADS=N for its other processes. Its default, "auto", keeps
    local_world_size cores back for the scheduler process (VLLM_CPU_NUM_OF_RESERVED_CPU), which on this 2-core
    machine left the model ONE thread while kvwall had two (2026-12-02's serve_peers.json). It logs "OpenMP thread
    binding info:" with a "local_rank=0, core ids=[0, 1]" line per worker: that count is what it used.
  * llama.cpp (llama-cpp-python): n_threads and n_threads_batch (its server: --n_threads, --n_threads_batch).

Under load, every engine gets the same competing job (Neighbour: one thread of fixed matmuls in another process).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

THREADS = 2  # this machine's cores: the default of every script's --threads
BUSY = 0.25  # a thread that ran at least this share of the wall time of a run counts as busy in it


def torch_env(threads: int) -> dict[str, str]:
    """A torch child's environment for `threads` intra-op threads."""
    return {"OMP_NUM_THREADS": str(threads)}


def vllm_env(threads: int) -> dict[str, str]:
    """vLLM CPU's environment for `threads` OpenMP threads bound to cores 0 .. threads - 1."""
    cores = "0" if threads == 1 else f"0-{threads - 1}"
    return {"VLLM_CPU_OMP_THREADS_BIND": cores, "OMP_NUM_THREADS": str(threads)}


def llama_flags(threads: int) -> list[str]:
    """llama-cpp-python server flags for `threads` threads in decode and in prompt processing."""
    return ["--n_threads", str(threads), "--n_threads_batch", str(threads)]


def vllm_bound_threads(log: str) -> int | None:
    """OpenMP threads vLLM's CPU worker was bound to, from its log (the last binding it printed): 0.32's "core
    ids=[0, 1]" of local rank 0, or an older build's "OMP tid: T, core C" lines; None: no binding printed (its
    "nobind" setting, or a log cut short)."""
    ranks = re.findall(r"local_rank=0, core ids=\[([^\]]*)\]", log)
    if ranks:
        return len([c for c in ranks[-1].split(",") if c.strip()])
    start = log.rfind("OMP threads binding of Process")
    if start < 0:
        return None
    return len(re.findall(r"OMP tid: \d+, core \d+", log[start:]))


def turns(keys: list[str], runs: int) -> list[tuple[int, str]]:
    """(run number from 1, engine key) in the order to run them: every engine once per round, the order reversed
    every other round (a, b, c, c, b, a, ...), so that no engine always runs first after a pause or last in a
    round."""
    out = []
    for r in range(runs):
        out += [(r + 1, k) for k in (keys if r % 2 == 0 else keys[::-1])]
    return out


def median(values: list[float | None]) -> float | None:
    """The median of the values that are there (None where none is)."""
    have = [v for v in values if v is not None]
    return statistics.median(have) if have else None


# -- the same competing job for every engine (issue 43: "robust under a neighbour") ------------------------------

NEIGHBOUR = "one other process: a single-thread 512x512 fp32 matmul loop (torch, OMP_NUM_THREADS=1)"
NEIGHBOUR_CODE = """
import torch
torch.set_num_threads(1)
a = torch.randn(512, 512)
while True:
    a = torch.tanh(a @ a)  # tanh keeps the values bounded; the work per iteration is fixed
"""


class Neighbour:
    """The competing job (NEIGHBOUR): started before the runs it crowds, stopped after them; every engine of a
    comparison is measured under the same one."""

    def __init__(self, python: str = sys.executable):
        self.proc = subprocess.Popen([python, "-c", NEIGHBOUR_CODE], env={**os.environ, **torch_env(1)})
        time.sleep(2)  # its torch import done: it is computing when the first run starts

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


# -- the threads a process tree actually kept busy ------------------------------------------------------------

def stat_fields(path: Path) -> list[str] | None:
    """A /proc stat file's fields after the command name (which may hold spaces); None if it is gone."""
    try:
        return path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def tree_pids(pid: int) -> list[int]:
    """`pid` and its live descendants (vLLM's API server runs its engine in a child process)."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = stat_fields(stat)
        if fields is not None:
            kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))  # fields[1]: the parent's pid
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def thread_cpu_s(pid: int) -> dict[tuple[int, int], float]:
    """CPU seconds (user + system) of every thread of `pid`'s process tree, by (pid, thread id)."""
    tick = 1 / os.sysconf("SC_CLK_TCK")
    out = {}
    for p in tree_pids(pid):
        for task in Path(f"/proc/{p}/task").glob("[0-9]*"):
            fields = stat_fields(task / "stat")
            if fields is not None:
                out[p, int(task.name)] = (int(fields[11]) + int(fields[12])) * tick  # utime, stime
    return out


def busy_threads(before: dict, after: dict, wall_s: float) -> int:
    """Threads that ran at least BUSY of `wall_s` between two thread_cpu_s readings: the compute threads, and any
    front-end thread that kept busy too. A cross-check of the thread count an engine was given, not a count of its
    pool (an idle pool thread does not show)."""
    return sum(1 for k, s in after.items() if s - before.get(k, 0.0) >= BUSY * wall_s)

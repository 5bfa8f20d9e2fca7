"""benchmarks/bench_serve_peers.py's pure helpers: the prefix-hit counter read from Prometheus text, the
merge of a rerun into the results file, and the CPU time of a process tree. No server, no peer engine."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import bench_serve_peers as peers  # noqa: E402


def test_hits_in_reads_kvwall_and_vllm_counters():
    kvwall = "# HELP kvwall_prefix_cache_hits_total x\n# TYPE kvwall_prefix_cache_hits_total counter\n" \
             "kvwall_prefix_cache_hits_total 7\nkvwall_steps_total 99\n"
    assert peers.hits_in(kvwall) == 7
    # vLLM: one sample per engine label, and a _created sample that is a timestamp, not hits
    vllm = 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 32.0\n' \
           'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 16.0\n' \
           'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n' \
           'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4096.0\n'
    assert peers.hits_in(vllm) == 48
    assert peers.hits_in("kvwall_steps_total 3\n") is None


def test_merge_replaces_only_the_rerun_rows():
    old = [{"engine": "a", "concurrency": 1, "v": 0}, {"engine": "a", "concurrency": 4, "v": 0},
           {"engine": "b", "concurrency": 4, "v": 0}]
    new = [{"engine": "a", "concurrency": 4, "v": 1}]
    out = peers.merge(old, new)
    assert sorted((r["engine"], r["concurrency"], r["v"]) for r in out) == [("a", 1, 0), ("a", 4, 1), ("b", 4, 0)]


def test_tree_cpu_counts_a_busy_child():
    pid = os.fork()
    if pid == 0:  # the child spins for 0.3 s of CPU, then exits
        t0 = time.process_time()
        while time.process_time() - t0 < 0.3:
            pass
        os._exit(0)
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # it has exited, unreaped: /proc still has its times
        tree = peers.tree_cpu_s(os.getpid())
        own = os.times()  # this process alone (an unreaped child is in no field of ours)
        assert tree - own.user - own.system >= 0.25  # the child's 0.3 s, less /proc's 10 ms ticks
    finally:
        os.waitpid(pid, 0)

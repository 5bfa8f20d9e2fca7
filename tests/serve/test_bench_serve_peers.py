"""benchmarks/bench_serve_peers.py's pure helpers and benchmarks/fair.py's: the prefix-hit counter read from
Prometheus text, runs numbered and their medians, every engine given the same threads, vLLM's bound threads read
from its log, the turns engines take, and the CPU time of a process tree and of its threads. No server, no peer
engine."""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import bench_serve_peers as peers
import fair


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


def _row(engine="a", clients=1, threads=2, run=None, req_s=1.0, ttft=0.1, errors=0, busy=2):
    r = {"engine": engine, "concurrency": clients, "threads": threads, "others_share": 0.01 * (run or 1),
         "want_tokens": 64, "busy_threads": busy, "threads_reported": threads, "date": "d",
         "result": {"requests": 16, "errors": errors, "output_tokens": 64, "request_throughput": req_s,
                    "output_token_throughput": 64 * req_s, "ttft_s": {"p50": ttft, "p99": 2 * ttft},
                    "tpot_s": {"p50": 0.05, "p99": 0.06}}}
    return r if run is None else {**r, "run": run}


def test_a_run_is_numbered_after_the_earlier_runs_of_its_engine_clients_and_threads():
    rows = [_row(run=1), _row(run=2), _row(threads=1, run=1), _row(clients=4, run=1)]
    assert peers.number(rows, _row())["run"] == 3
    assert peers.number(rows, _row(threads=1))["run"] == 2
    assert peers.number(rows, _row(clients=16))["run"] == 1
    old = [{k: v for k, v in _row().items() if k != "threads"}]  # a file from before threads were recorded
    assert peers.number(old, _row())["run"] == 1 and peers.number(old, {**old[0]})["run"] == 2


def test_medians_over_runs_by_hand():
    """Three runs at 1.0, 3.0 and 2.0 req/s and TTFT p50 100, 500, 300 ms: the medians are 2.0 req/s (128 tokens/s)
    and 300 ms; errors add up (0 + 1 + 0); the other processes' share is the largest (3 %); the same engine at
    other threads is another line."""
    rows = [_row(run=1, req_s=1.0, ttft=0.1), _row(run=2, req_s=3.0, ttft=0.5, errors=1, busy=3),
            _row(run=3, req_s=2.0, ttft=0.3), _row(threads=1, run=1, req_s=9.0)]
    two, one = peers.medians(rows)
    assert (two["threads"], two["runs"], one["threads"], one["runs"]) == (2, 3, 1, 1)
    assert two["result"]["request_throughput"] == 2.0 and two["result"]["output_token_throughput"] == 128.0
    assert two["result"]["ttft_s"] == {"p50": 0.3, "p99": 0.6} and two["result"]["errors"] == 1
    assert two["others_share"] == 0.03 and two["busy_threads"] == [2, 3, 2] and two["threads_reported"] == [2]
    assert one["result"]["request_throughput"] == 9.0


def test_results_file_keeps_runs_and_medians_and_reads_old_lists(tmp_path):
    path = tmp_path / "peers.json"
    assert peers.load(path) == []
    rows = [_row(run=1, req_s=1.0), _row(run=2, req_s=2.0)]
    peers.save(path, rows)
    data = json.loads(path.read_text())
    assert data["runs"] == rows and data["medians"][0]["result"]["request_throughput"] == 1.5
    assert peers.load(path) == rows
    path.write_text(json.dumps(rows))  # a file from before: a list of rows
    assert peers.load(path) == rows


def test_every_engine_is_given_the_same_threads():
    """--threads 3: kvwall (each weight format) through OMP_NUM_THREADS, vLLM through its OpenMP binding to cores
    0-2 and OMP_NUM_THREADS, llama.cpp through --n_threads and --n_threads_batch; no engine keeps a fixed 2."""
    args = argparse.Namespace(threads=3, kv_memory="1GiB", max_batch=32, model="m", vllm_python="/v/python",
                              llama_python="/l/python")
    known = peers.servers(args, Path("/m.gguf"))
    assert set(known) == {"kvwall", "kvwall-native", "kvwall-a8", "vllm", "llama"}
    setting = {k: peers.thread_setting(env, argv) for k, (_, argv, env) in known.items()}
    assert setting["kvwall"] == setting["kvwall-native"] == setting["kvwall-a8"] == {"env": {"OMP_NUM_THREADS": "3"},
                                                                                     "flags": []}
    weights = {k: argv[argv.index("--weights") + 1] if "--weights" in argv else None
               for k, (_, argv, _) in known.items() if k.startswith("kvwall")}
    assert weights == {"kvwall": None, "kvwall-native": "native", "kvwall-a8": "native+a8"}
    assert setting["vllm"]["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0-2", "OMP_NUM_THREADS": "3"}
    assert setting["llama"]["flags"] == ["--n_threads 3", "--n_threads_batch 3"]
    assert known["vllm"][2]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert fair.vllm_env(1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"


# vLLM 0.32's log (vllm/utils/ompmultiprocessing.py), with --threads 2, and an older build's binding lines
VLLM_LOG = """INFO 12-05 10:00:01 [ompmultiprocessing.py:180] OpenMP thread binding info:
\tVLLM_CPU_OMP_THREADS_BIND='auto', auto_setup=True, skip_setup=False
\tlocal_world_size=1, reserve_cpu_num=1
\tlocal_rank=0, core ids=[0]
\treserved_cpus=[1]
INFO 12-05 10:05:01 [ompmultiprocessing.py:180] OpenMP thread binding info:
\tVLLM_CPU_OMP_THREADS_BIND='0-1', auto_setup=False, skip_setup=False
\tlocal_world_size=1, reserve_cpu_num=1
\tlocal_rank=0, core ids=[0, 1]
\treserved_cpus=[]
INFO 12-05 10:05:03 [gpu_model_runner.py:2000] Model loading took 0.5 GiB
"""
OLD_VLLM_LOG = """INFO 09-24 10:50:13 cpu_worker.py:211] OMP threads binding of Process 1563:
INFO 09-24 10:50:13 cpu_worker.py:211] \tOMP tid: 1563, core 0
INFO 09-24 10:50:13 cpu_worker.py:211] \tOMP tid: 1754, core 1
"""


def test_vllm_bound_threads_from_its_log():
    """The last binding vLLM printed counts: "auto" on 2 cores bound one (the other reserved), "0-1" two; an older
    build's per-thread lines count too; a log without a binding ("nobind") says nothing."""
    assert fair.vllm_bound_threads(VLLM_LOG) == 2
    assert fair.vllm_bound_threads(VLLM_LOG.split("INFO 12-05 10:05:01")[0]) == 1
    assert fair.vllm_bound_threads(OLD_VLLM_LOG) == 2
    assert fair.vllm_bound_threads("INFO starting\n") is None


def test_engines_take_turns_the_order_reversed_every_other_round():
    assert fair.turns(["a", "b", "c"], 3) == [(1, "a"), (1, "b"), (1, "c"), (2, "c"), (2, "b"), (2, "a"),
                                               (3, "a"), (3, "b"), (3, "c")]
    assert fair.median([3.0, None, 1.0, 2.0]) == 2.0 and fair.median([None]) is None


def test_busy_threads_by_hand():
    """Over a 10 s run a thread counts as busy from 2.5 s of CPU (fair.BUSY = 1/4): 9 s and 2.5 s count, 2.4 s and
    a thread idle throughout do not; a thread born during the run counts from 0."""
    before = {(1, 1): 100.0, (1, 2): 50.0, (1, 3): 7.0, (2, 9): 0.0}
    after = {(1, 1): 109.0, (1, 2): 52.4, (1, 3): 7.0, (2, 9): 2.5, (2, 10): 3.0}
    assert fair.busy_threads(before, after, 10.0) == 3


@pytest.mark.slow
def test_thread_cpu_reads_a_spinning_thread_under_its_id():
    """A thread of this process spins 0.3 s of CPU, then idles: thread_cpu_s has its 0.3 s under (pid, its id),
    within /proc's 10 ms ticks."""
    spun, done, tid = threading.Event(), threading.Event(), []

    def spin():
        tid.append(threading.get_native_id())
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.3:
            pass
        spun.set()
        done.wait(30)  # alive (idle) until read: an ended thread leaves /proc

    t = threading.Thread(target=spin)
    t.start()
    try:
        assert spun.wait(30)
        cpu = fair.thread_cpu_s(os.getpid())[os.getpid(), tid[0]]
        assert 0.28 <= cpu <= 0.33, cpu
    finally:
        done.set()
        t.join()


@pytest.mark.slow
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


def test_step_comparison_medians_by_hand():
    """profile_vllm_step.py: steps of 30, 50 and 40 ms at batch 16 have the median 40 ms, 400 tok/s; each engine and
    batch apart, with the threads it was given and reported."""
    import profile_vllm_step as step

    rows = [{"engine": e, "batch": 16, "threads": 2, "threads_reported": r, "step_s": s}
            for e, r, s in (("kvwall", 2, 0.030), ("vllm", 2, 0.090), ("kvwall", 2, 0.050), ("kvwall", 2, 0.040))]
    kvwall, vllm = step.medians(rows)
    assert (kvwall["engine"], kvwall["runs"], kvwall["step_s"]) == ("kvwall", 3, 0.040)
    assert kvwall["tok_s"] == pytest.approx(400.0) and kvwall["threads"] == 2
    assert (vllm["runs"], vllm["step_s"]) == (1, 0.090)
    assert "time to steps + 1 tokens - time to 1 token" in step.WINDOW

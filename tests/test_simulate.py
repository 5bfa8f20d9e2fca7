"""The serving simulator: its step clock equals the roofline's mixed step; with a constant step time it
reproduces hand-computed queueing; the CLI's errors are one line."""

import json
from dataclasses import replace

import pytest

from kvwall import simulate as sim
from kvwall.cli import main
from kvwall.errors import KvwallError
from kvwall.predict.devices import get_device
from kvwall.predict.memory import Formats, Parallel
from kvwall.predict.roofline import Roof, run_mix
from kvwall.predict.step import Step
from kvwall.simulate import Pool, StepClock, kv_pool, report, simulate
from kvwall.spec.resolve import load_spec
from kvwall.workload import Lengths, Request, stream, summarize


@pytest.mark.parametrize("model,par", [("llama-3-8b", Parallel()), ("llama-3-70b", Parallel(8)),
                                       ("gemma-3-27b", Parallel(2)), ("deepseek-v3", Parallel(8)),
                                       ("deepseek-v3", Parallel(ep=8)), ("mixtral-8x7b", Parallel(ep=4, pp=2)),
                                       ("jamba-v0.1", Parallel(2)), ("mamba2-2.7b", Parallel())])
def test_clock_equals_the_mixed_roofline(model, par):
    spec = load_spec(model)
    fm, roof = Formats.for_spec(spec), Roof(get_device("h100"))
    clock = StepClock(spec, fm, roof, par)
    for rows in ([(99, 1), (5000, 1), (0, 300), (7, 1)], [(4095, 1)] * 3, [(0, 512)], [(128, 64), (3, 1)]):
        want = run_mix(spec, [Step(1, p, n) for p, n in rows], fm, roof, par).time_s
        assert clock.time(rows) == pytest.approx(want, rel=1e-12)


class Constant:
    """A fake clock: every step takes `dt` seconds (on one stage; `pp` stages take dt / pp each), plus
    `per_request` for each request's first chunk in it (counted in `firsts`)."""

    def __init__(self, dt, pp=1, ep=1, per_request=0.0):
        self.dt, self.par, self.per_request, self.firsts = dt, Parallel(1, pp, ep), per_request, 0

    def request_time(self, first):
        self.firsts += first
        return self.per_request * first

    def stages(self, total, rows):
        return [total / self.par.pp] * self.par.pp

    def time(self, rows):
        return self.dt

    def runner_time(self, rows, forward_s=0.0):
        return 0.0


POOL = Pool(block_size=16, block_bytes=1, n_blocks=10_000, available_bytes=10_000)


def test_single_server_deterministic_service():
    """One seat (max_batch 1), each request 8 prompt + 4 output tokens at c = 0.1 s a step: the prefill step gives
    the first token, three decode steps the rest, so service takes 0.4 s. Arrivals every 1 s: no queue; every
    0.25 s: request k starts at 0.4 k, waits 0.4 k - 0.25 k."""
    c, service = 0.1, 0.4
    calm = [Request(k, 1.0 * k, 8, 4) for k in range(5)]
    recs = simulate(calm, Constant(c), POOL, max_batch=1)["records"]
    assert [r.ttft for r in recs] == pytest.approx([c] * 5)
    assert [r.e2e for r in recs] == pytest.approx([service] * 5)
    busy = [Request(k, 0.25 * k, 8, 4) for k in range(6)]
    recs = simulate(busy, Constant(c), POOL, max_batch=1)["records"]
    assert [r.ttft for r in recs] == pytest.approx([service * k + c - 0.25 * k for k in range(6)])
    assert [r.tpot for r in recs] == pytest.approx([c] * 6)


def test_closed_loop_clients_back_to_back():
    """One client, three requests of 4 output tokens at 0.1 s a step: 1.2 s in all, each arriving as the last ends."""
    reqs = [Request(k, 0.0, 8, 4) for k in range(3)]
    run = simulate(reqs, Constant(0.1), POOL, concurrency=1)
    assert [r.request.arrival_s for r in run["records"]] == pytest.approx([0.0, 0.4, 0.8])
    assert summarize(run["records"])["duration_s"] == pytest.approx(1.2)


def test_littles_law_on_the_trace():
    """Time-averaged requests in the system = throughput x mean time in the system (L = lambda W)."""
    reqs = stream(400, Lengths("uniform", 4, 64), Lengths("uniform", 2, 20), rate=20.0, seed=3)
    dt = 0.002  # short steps: a request waits under one step between its arrival and the step that counts it
    run = simulate(reqs, Constant(dt), POOL, chunk=64, max_batch=8)
    s = report(run)
    area = sum(dt * (running + waiting) for _, running, waiting, *_ in run["trace"])
    assert area / s["duration_s"] == pytest.approx(s["request_throughput"] * s["e2e_s"]["mean"], rel=0.03)


def test_a_small_pool_preempts_and_still_finishes_everything():
    reqs = [Request(k, 0.0, 40, 40) for k in range(8)]
    pool = Pool(block_size=16, block_bytes=1, n_blocks=12, available_bytes=12)  # 6 blocks per request at the end
    clock = Constant(0.01)
    run = simulate(reqs, clock, pool, chunk=64, max_batch=8)
    assert run["preemptions"] > 0
    assert all(len(r.token_times) == 40 for r in run["records"])
    assert clock.firsts == 8  # each request's fixed cost once: a recompute after preemption pays none


def test_pipeline_keeps_two_micro_batches_in_flight():
    """pp = 2, a step of 0.2 s = two stages of 0.1 s; two requests of 8 prompt + 4 output tokens at time 0 go to
    the two schedulers. Micro-batch A (request 0) leaves stage 1 at 0.2 s, B (request 1) enters stage 0 at 0.1 s
    and leaves at 0.3 s; A's next enters stage 0 at 0.2 s (free since 0.2), stage 1 at 0.3 s, leaves at 0.4 s;
    so request 0's tokens come at 0.2, 0.4, 0.6, 0.8 s and request 1's at 0.3, 0.5, 0.7, 0.9 s. Stage time
    worked: 8 steps x 0.2 s = 1.6 of 2 x 0.9 s, idle 1/9 (stage 1 before 0.1 s, stage 0 after 0.8 s)."""
    run = simulate([Request(k, 0.0, 8, 4) for k in range(2)], Constant(0.2, pp=2), POOL)
    times = {r.request.id: r.token_times for r in run["records"]}
    assert times[0] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert times[1] == pytest.approx([0.3, 0.5, 0.7, 0.9])
    assert run["pipeline_idle"] == pytest.approx(1 / 9)
    assert report(run)["pipeline_idle"] == pytest.approx(1 / 9)


def test_pipeline_with_one_request_is_the_whole_step():
    """One request alone fills one micro-batch: each step takes the stages' sum, as with no pipeline, and the
    other stage idles half the time."""
    one = [Request(0, 0.0, 8, 4)]
    piped, flat = simulate(one, Constant(0.2, pp=2), POOL), simulate(one, Constant(0.2), POOL)
    assert piped["records"][0].token_times == pytest.approx(flat["records"][0].token_times)
    assert piped["pipeline_idle"] == pytest.approx(0.5) and "pipeline_idle" not in flat


def test_expert_parallel_adds_up_the_gpus_seats_and_pools():
    """ep = 2 data-parallel GPUs of one seat each (max_batch 1) serve two requests side by side: both finish in
    the 0.4 s one takes alone (prefill step + 3 decode steps of 0.1 s). The pool is both GPUs': Mixtral's
    token costs 32 layers x 8 KV heads x 128 x (K+V) x 2 B = 131,072 B, so a 16-token block is 2 MiB and 1 GiB
    holds 512 blocks per GPU."""
    run = simulate([Request(k, 0.0, 8, 4) for k in range(2)], Constant(0.1, ep=2), POOL, max_batch=1)
    assert [r.e2e for r in run["records"]] == pytest.approx([0.4, 0.4])
    spec = load_spec("mixtral-8x7b")
    pool = kv_pool(spec, Formats.for_spec(spec), Parallel(ep=4), 80 * 2**30, 0, kv_memory=2**30)
    assert (pool.block_bytes, pool.n_blocks) == (2 * 2**20, 4 * 512)


def test_a_shared_prefix_is_computed_once():
    """Two requests of 32 shared + 8 own prompt tokens, one seat: the first computes all 40 (blocks of 16: two full
    blocks of the prefix are sealed); the second takes those two from the prefix cache and computes tokens 32..39
    only: its first chunk is (past 32, 8 new)."""
    class Recording(Constant):
        def __init__(self, dt):
            super().__init__(dt)
            self.rows = []

        def time(self, rows):
            self.rows.append(rows)
            return self.dt

    from kvwall.workload import with_shared_prefix

    clock = Recording(0.1)
    reqs = with_shared_prefix([Request(k, 0.0, 8, 2) for k in range(2)], 32)
    run = simulate(reqs, clock, POOL, max_batch=1)
    assert [rows[0] for rows in clock.rows] == [(0, 40), (40, 1), (32, 8), (40, 1)]
    # a fixed cost of 0.05 s per request: the second pays it on its first chunk although it starts at token 32,
    # so its first token comes at 0.1 + 0.05 (first request's prefill) + 0.1 (its decode) + 0.1 + 0.05
    recs = simulate(reqs, Constant(0.1, per_request=0.05), POOL, max_batch=1)["records"]
    assert [r.ttft for r in recs] == pytest.approx([0.15, 0.4])
    assert run["prefix_cached_tokens"] == 32 and report(run)["prefix_cached_tokens"] == 32
    alone = simulate([Request(k, 0.0, 40, 2) for k in range(2)], Constant(0.1), POOL, max_batch=1)
    assert alone["prefix_cached_tokens"] == 0  # equal lengths, nothing declared shared: nothing taken


def test_pipeline_shares_one_small_pool_and_finishes_everything():
    """Four schedulers over one 12-block pool: they preempt each other's growth and still finish every token."""
    reqs = [Request(k, 0.01 * k, 40, 40) for k in range(8)]
    pool = Pool(block_size=16, block_bytes=1, n_blocks=12, available_bytes=12)
    run = simulate(reqs, Constant(0.04, pp=4), pool, chunk=64, max_batch=8)
    assert run["preemptions"] > 0
    assert all(len(r.token_times) == 40 for r in run["records"])


def test_clock_stages_against_the_pipelined_roofline():
    """StepClock.stages splits a decode step as the roofline's `pipelined` does (per layer, per stage), within
    the fixed step cost it spreads over the stages; the parts add up to the step."""
    from kvwall.predict.roofline import pipelined

    spec = load_spec("llama-2-7b")
    fm, roof, par = Formats.for_spec(spec), Roof(get_device("h100")), Parallel(1, 2)
    clock = StepClock(spec, fm, roof, par)
    rows = [(1000, 1)] * 8
    total = clock.time(rows)
    mine = clock.stages(total, rows)
    ref = pipelined(spec, Step(8, 1000, 1), fm, roof, par, micro_batches=1)
    assert sum(mine) == pytest.approx(total, rel=1e-12)
    assert mine[0] == pytest.approx(ref["stage_s"][0] + ref["send_s"], rel=0.02)
    assert mine[1] == pytest.approx(ref["stage_s"][1], rel=0.02)


def test_nothing_to_serve_divides_nothing():
    run = simulate([], Constant(0.1), POOL)
    assert run["records"] == [] and report(run)["completed"] == 0


def test_pool_by_hand():
    """Llama-3-8B bf16 on one H100 (80 GB): 32 layers x 8 KV heads x (128 + 128) x 2 B = 128 KiB a token."""
    spec = load_spec("llama-3-8b")
    fm = Formats.for_spec(spec)
    pool = kv_pool(spec, fm, Parallel(1), 80 * 10**9, 8 * 10**9, block_size=16)
    assert pool.block_bytes == 16 * 32 * 8 * 256 * 2
    assert pool.n_blocks == (72 * 10**9 - 8_030_261_248 * 2) // pool.block_bytes  # weights: 8.03 B params in bf16
    with pytest.raises(KvwallError, match="no room for the KV cache"):
        kv_pool(load_spec("llama-3-70b"), Formats.for_spec(load_spec("llama-3-70b")), Parallel(1), 80 * 10**9, 0)


@pytest.mark.slow
def test_cli_json_and_find_rate(capsys):
    assert main(["simulate", "llama-3-8b", "--device", "h100", "--rate", "2", "--requests", "50", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["points"][0]
    assert p["completed"] == 50 and p["ttft_s"]["p50"] > 0 and p["tpot_s"]["p50"] > 0
    assert main(["simulate", "llama-3-8b", "--device", "h100", "--requests", "200", "--find-rate",
                 "--slo-ttft", "200ms", "--output-tokens", "64", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["points"][0]
    assert p["rate"] and p["ttft_s"]["p90"] <= 0.2
    assert any(not ok and rate > p["rate"] for rate, ok in p["tried"])  # a faster rate failed


def test_find_rate_never_counts_a_burst():
    """A fake server whose p90 TTFT always meets the SLO and whose requests take 2 s end to end: 50 requests
    at more than 25/s all arrive within one latency (50 / 25 = 2 s), a burst that says nothing about a rate,
    so the search stops below 25/s and says the request count limited it; with 5,000 requests it goes to 2,500/s."""
    def fake(n):
        return lambda rate: {"requests": n, "completed": n, "ttft_s": {"p90": 0.1}, "e2e_s": {"p50": 2.0}}

    small = sim.find_rate(fake(50), 1.0, None, 0.01, 10_000.0)
    assert 25 / 1.5 < small["rate"] <= 25 and small["limited_by_requests"]
    big = sim.find_rate(fake(5000), 1.0, None, 0.01, 10_000.0)
    assert 2500 / 1.5 < big["rate"] <= 2500


@pytest.mark.slow
def test_cli_sweep(capsys, tmp_path):
    assert main(["simulate", "llama-3-70b", "--device", "h100", "--rate", "2", "--requests", "40", "--sweep",
                 "tp=4,8", "kv-format=bf16,fp8", "--json", "--plot", str(tmp_path / "p.png")]) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [p["label"] for p in points] == ["tp=4 kv-format=bf16", "tp=4 kv-format=fp8", "tp=8 kv-format=bf16",
                                            "tp=8 kv-format=fp8"]
    assert points[1]["pool"]["n_blocks"] > points[0]["pool"]["n_blocks"]  # fp8 KV: more blocks in the same bytes
    assert (tmp_path / "p.png").stat().st_size > 0


def test_cli_shared_prefix_sweep(capsys):
    """40 requests sharing a 64-token prefix: each after the first takes its 4 full blocks (64 tokens) from the
    cache, so 39 x 64 tokens are not computed; --shared-prefix 0 takes none."""
    assert main(["simulate", "llama-3-8b", "--device", "h100", "--rate", "1", "--requests", "40", "--prompt-tokens",
                 "100", "--sweep", "shared-prefix=0,64", "--json"]) == 0
    zero, shared = json.loads(capsys.readouterr().out)["points"]
    assert (zero["prefix_cached_tokens"], shared["prefix_cached_tokens"]) == (0, 39 * 64)
    assert shared["shared_prefix"] == 64 and shared["completed"] == 40


@pytest.mark.parametrize("argv,msg", [
    (["--rate", "1", "--shared-prefix", "-5"], "--shared-prefix"), (["--rate", "-1"], "--rate"),
    (["--rate", "1", "--requests", "0"], "--requests"),
    (["--find-rate"], "needs an SLO"), ([], "say how requests come"),
    (["--rate", "1", "--sweep", "banana=1"], "bad --sweep"), (["--rate", "1", "--sweep", "tp=x"], "bad --sweep value"),
    (["--rate", "1", "--prompt-tokens", "lognormal:mean=1"], "bad --prompt-tokens"),
    (["--rate", "1", "--sweep", "tp=1", "tp=2"], "names tp twice"),
    (["--find-rate", "--slo-ttft", "1s", "--rate", "3"], "--find-rate searches the rate itself"),
    (["--find-rate", "--slo-ttft", "1s", "--concurrency", "3"], "--find-rate searches the rate itself"),
    (["--rate", "1", "--ep", "2"], "no routed experts"),
    (["--rate", "1", "--kv-memory", "1MB"], "give a larger --kv-memory"),
    # Llama-3-8B's config says 8,192 positions: 8,000 + 200 tokens is past it, as kvwall serve would say
    (["--rate", "1", "--requests", "4", "--prompt-tokens", "8000", "--output-tokens", "200"],
     "8,200 tokens is past llama-3-8b's maximum context of 8,192; 4 of 4 requests"),
])
def test_cli_errors_are_one_line(argv, msg, capsys):
    assert main(["simulate", "llama-3-8b", "--device", "h100", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert msg in err[-1] and "Traceback" not in "".join(err)


def test_cli_bad_dataset(tmp_path, capsys):
    bad = tmp_path / "d.jsonl"
    bad.write_text('{"prompt_tokens": 5, "output_tokens": 2}\n{"prompt_tokens": 5}\n')
    assert main(["simulate", "llama-3-8b", "--device", "h100", "--rate", "1", "--dataset", str(bad)]) == 2
    assert "line 2" in capsys.readouterr().err


def test_expected_roof_request_cost_beside_the_forward():
    """The clock times the forward alone (= run_mix); the expected roof's fixed cost per request is
    request_time(first requests), the busiest expert-parallel GPU's share, and not the tensor-parallel TTFT term."""
    from kvwall.catalog import efficiency
    from kvwall.predict.expected import expected_roof

    spec = load_spec("llama-3-8b")
    fm = Formats.for_spec(spec)
    roof = expected_roof(get_device("h100"), "bf16", fm, spec)
    request_s = efficiency()["params"]["request_s"]
    assert roof.request_overhead_s == request_s > 0
    clock = StepClock(spec, fm, roof)
    rows = [(0, 64), (0, 32), (100, 1), (50, 16)]
    assert clock.time(rows) == pytest.approx(run_mix(spec, [Step(1, p, n) for p, n in rows], fm, roof).time_s,
                                             rel=1e-12)
    assert clock.request_time(2) == pytest.approx(2 * request_s) and clock.request_time(0) == 0
    assert StepClock(spec, fm, roof, Parallel(1, 1, 2)).request_time(3) == pytest.approx(2 * request_s)  # 3 over 2
    # the tensor-parallel TTFT term is a batch-1 benchmark's latency, not a cost the serving step pays
    tp4 = expected_roof(get_device("h100"), "bf16", fm, spec, tp=4)
    assert tp4.tp_ttft_s > 0 and StepClock(spec, fm, tp4, Parallel(4)).request_time(1) == pytest.approx(request_s)


def test_clock_with_pipeline_stages():
    spec = load_spec("llama-2-7b")
    fm, roof, par = Formats.for_spec(spec), Roof(get_device("h100")), Parallel(2, 2)
    rows = [(99, 1), (0, 128), (1000, 1)]
    want = run_mix(spec, [Step(1, p, n) for p, n in rows], fm, roof, par).time_s
    assert StepClock(spec, fm, roof, par).time(rows) == pytest.approx(want, rel=1e-12)


def test_clock_equals_the_mixed_roofline_on_a_measured_cpu():
    """The local profile's rates (FLOPs paid on top of bytes, matmul rows, fixed costs) in the clock as in run_mix."""
    dev = replace(get_device("h100"), op_bandwidth={"matmul": 20e9, "attention": 25e9, "latent": 25e9},
                  op_flops={"attention": 30e9, "attention:prefill": 90e9, "latent": 60e9},
                  op_fixed_s={"attention": 5e-5, "attention:prefill": 2e-5},
                  matmul_rows={1: 20e9, 4: 9e9, 16: 7e9, 256: 1.2e9}, layer_overhead_s=3e-4)
    for model in ("llama-3-8b", "deepseek-v3", "jamba-v0.1"):
        spec = load_spec(model)
        fm, roof = Formats.for_spec(spec), Roof(dev)
        clock = StepClock(spec, fm, roof)
        for rows in ([(99, 1), (5000, 1), (0, 300), (7, 1)], [(4095, 1)] * 3, [(128, 64), (3, 1)], [(0, 300)],
                     [(0, 16), (0, 40)]):
            want = run_mix(spec, [Step(1, p, n) for p, n in rows], fm, roof).time_s
            assert clock.time(rows) == pytest.approx(want, rel=1e-12)


POOL_COST = {"fixed_s": 1e-4, "s_per_byte": 1e-9}


def test_paged_pool_cost_by_hand():
    """Llama-3-8B, bf16 KV: 32 attention layers, 8 KV heads x 128 x (K, V) x 2 bytes = 4,096 bytes a token per
    layer. Rows (99, 1), (5000, 1), (0, 300) in blocks of 16 hold 100, 5,001 and 300 tokens: the widest is 313
    blocks, so every row gathers 313 x 16 = 5,008 tokens: 3 x 5,008 x 4,096 = 61,538,304 bytes a layer.
    Per layer 1e-4 + 61,538,304 x 1e-9 = 0.061638304 s; 32 layers: 1.972425728 s, on top of the roofline."""
    spec = load_spec("llama-3-8b")
    fm = Formats.for_spec(spec)
    roof = Roof(replace(get_device("h100"), paged_pool=POOL_COST))
    clock = StepClock(spec, fm, roof, block_size=16)
    rows = [(99, 1), (5000, 1), (0, 300)]
    assert clock.pool_time(rows) == pytest.approx(1.972425728, rel=1e-12)
    want = run_mix(spec, [Step(1, p, n) for p, n in rows], fm, roof).time_s + 1.972425728
    assert clock.time(rows) == pytest.approx(want, rel=1e-12)
    # block size 32: widths 4, 157, 10 blocks -> 157 x 32 = 5,024 tokens a row
    by_32 = StepClock(spec, fm, roof, block_size=32).pool_time(rows)
    assert by_32 == pytest.approx(32 * (1e-4 + 3 * 5024 * 4096 * 1e-9), rel=1e-12)


def test_pool_cost_skips_layers_without_a_cache():
    """Jamba keeps K/V in 4 of its 32 layers (1 attention : 7 Mamba), 8 KV heads x 128, bf16: only those pay."""
    spec = load_spec("jamba-v0.1")
    fm = Formats.for_spec(spec)
    roof = Roof(replace(get_device("h100"), paged_pool=POOL_COST))
    assert StepClock(spec, fm, roof).pool_time([(15, 1)]) == pytest.approx(4 * (1e-4 + 16 * 4096 * 1e-9))


def test_a_profile_without_the_pool_cost_is_todays_clock(tmp_path, monkeypatch, capsys):
    """An older `local` profile (no "paged_pool" key) loads, charges no pool cost, and `simulate` runs on it;
    with the key, `roofline` (a contiguous cache) is unchanged and `simulate` is slower."""
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    old = {"memory_bytes": 64 * 2**30, "memory_bandwidth_Bps": 20e9, "peak_flops": {"fp32": 5e11, "bf16": 5e11},
           "layer_overhead_s": 1e-5, "step_overhead_s": 2e-5, "op_bandwidth_Bps": {"matmul": 18e9}}
    profile = tmp_path / "local-device.json"
    argv = ["simulate", "llama-3.2-1b", "--device", "local", "--rate", "4", "--requests", "20", "--json"]
    outputs = {}
    for name, entry in (("old", old), ("new", {**old, "paged_pool": POOL_COST})):
        profile.write_text(json.dumps(entry))
        dev = get_device("local")
        assert dev.paged_pool == ({} if name == "old" else POOL_COST)
        spec = load_spec("llama-3.2-1b")
        clock = StepClock(spec, Formats.for_spec(spec), Roof(dev))
        assert (clock.pool_time([(99, 1)]) == 0.0) == (name == "old")
        assert main(argv) == 0
        sim = json.loads(capsys.readouterr().out)["points"][0]
        assert main(["roofline", "llama-3.2-1b", "--device", "local", "--json"]) == 0
        outputs[name] = sim["tpot_s"]["p50"], capsys.readouterr().out
    assert outputs["new"][0] > outputs["old"][0]
    assert outputs["new"][1] == outputs["old"][1]


def test_runner_cost_once_per_step_by_hand():
    """1 ms + 0.2 ms a row, once per scheduler step even when decode rows and chunks run as two forwards:
    3 rows -> 1.6 ms on top of the forwards."""
    from kvwall.simulate import _step_time

    spec = load_spec("llama-3-8b")
    fm = Formats.for_spec(spec)
    clock = StepClock(spec, fm, Roof(replace(get_device("h100"), runner_step={"fixed_s": 1e-3, "per_row_s": 2e-4})))
    rows = [(5, 1), (0, 10), (7, 1)]
    assert clock.runner_time(rows) == pytest.approx(1.6e-3, rel=1e-12)
    split = clock.time([(5, 1), (7, 1)]) + clock.time([(0, 10)]) + 1.6e-3
    assert _step_time(clock, rows, True) == pytest.approx(split, rel=1e-12)
    assert _step_time(clock, rows, False) == pytest.approx(clock.time(rows) + 1.6e-3, rel=1e-12)
    assert StepClock(spec, fm, Roof(get_device("h100"))).runner_time(rows) == 0.0  # not measured: not charged


def test_runner_slowdown_scales_the_step_forwards_by_hand():
    """A runner that slows the forwards beside it by 10 %: 1 ms + 0.2 ms a row + 0.1 x the forwards' time, the
    split forwards' sum when kvwall serve runs them apart."""
    from kvwall.simulate import _step_time

    spec = load_spec("llama-3-8b")
    fm = Formats.for_spec(spec)
    cost = {"fixed_s": 1e-3, "per_row_s": 2e-4, "slowdown": 0.1}
    clock = StepClock(spec, fm, Roof(replace(get_device("h100"), runner_step=cost)))
    rows = [(5, 1), (0, 10), (7, 1)]
    split = clock.time([(5, 1), (7, 1)]) + clock.time([(0, 10)])
    assert _step_time(clock, rows, True) == pytest.approx(1.1 * split + 1.6e-3, rel=1e-12)
    assert _step_time(clock, rows, False) == pytest.approx(1.1 * clock.time(rows) + 1.6e-3, rel=1e-12)


def test_split_prefill_runs_one_forward_per_chunk_length():
    """As kvwall serve runs a step: with split_prefill, two prompts of 8 and 5 tokens admitted together take two
    forwards (0.2 s at 0.1 s a forward), and their decode rows one; without it, every step is one forward."""
    reqs = [Request(0, 0.0, 8, 3), Request(1, 0.0, 5, 3)]
    split = simulate(reqs, Constant(0.1), POOL, split_prefill=True)["records"]
    assert [r.token_times for r in split] == [pytest.approx([0.2, 0.3, 0.4])] * 2
    one = simulate(reqs, Constant(0.1), POOL)["records"]
    assert [r.token_times for r in one] == [pytest.approx([0.1, 0.2, 0.3])] * 2

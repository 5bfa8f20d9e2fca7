"""The runner on tiny random models: for random request streams (arrival steps, prompt lengths, shared prefixes,
pools small enough to preempt, chunk sizes, batch limits) every request's greedy tokens equal that request
generated alone with engine/generate.py, and blocks are conserved after every step."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import (  # noqa: E402
    HealthCheck,
    given,
    settings,
    strategies as st,
)

from kvwall.engine.caches.registry import predicted_bytes  # noqa: E402
from kvwall.engine.generate import Sampling, generate  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402
from kvwall.serve.runner import Runner  # noqa: E402
from kvwall.serve.scheduler import Request  # noqa: E402

VOCAB = 160
PREFIX = [(7 * i + 3) % VOCAB for i in range(24)]  # a common system prompt, cut at various lengths
_solo: dict = {}


def solo(model, prompt: list[int], n: int) -> list[int]:
    key = (id(model), tuple(prompt), n)
    if key not in _solo:
        _solo[key] = generate(model, [prompt], n).tokens[0]
    return _solo[key]


def serve(runner: Runner, arrivals: list[tuple[int, Request]], limit: int = 2000) -> None:
    """Feed arrivals at their steps, step until done, checking conservation after every step."""
    pending = sorted(arrivals, key=lambda a: a[0])
    for step_no in range(limit):
        while pending and pending[0][0] <= step_no:
            runner.add(pending.pop(0)[1])
        if not pending and not runner.sched.has_work():
            assert runner.sched.used_blocks() == 0
            return
        runner.step()
        runner.sched.check()
    raise AssertionError("the stream did not finish")


request_st = st.tuples(st.integers(0, 8), st.integers(0, 24), st.lists(st.integers(0, VOCAB - 1), max_size=9),
                       st.integers(1, 8))


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(request_st, min_size=1, max_size=6), block_size=st.sampled_from([1, 4, 16]),
       chunk=st.integers(1, 24), max_batch=st.integers(1, 6), spare=st.integers(0, 4))
def test_every_request_equals_its_solo_run(tiny_model, reqs, block_size, chunk, max_batch, spare):
    _, model = tiny_model("llama")
    made = []
    for i, (at, cut, tail, n) in enumerate(reqs):
        prompt = PREFIX[:cut] + tail or [1]
        made.append((at, Request(i, prompt, n)))
    need = max(-(-(len(r.prompt) + r.max_tokens) // block_size) for _, r in made)
    runner = Runner(model, n_blocks=need + spare, block_size=block_size, chunk=chunk, max_batch=max_batch)
    serve(runner, made)
    for _, r in made:
        assert r.out == solo(model, r.prompt, r.max_tokens), f"request {r.id} ({r.preemptions} preemptions)"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "deepseek_v2", "gemma2"])
def test_other_attention_kinds_equal_solo_runs(tiny_model, family):
    """Sliding window (mistral, contexts past its 16), MLA's latent cache (deepseek_v2), soft-capping (gemma2):
    a fixed stream with a shared prefix, chunking and a pool small enough to preempt."""
    _, model = tiny_model(family)
    prompts = [PREFIX[:20] + [5, 6], PREFIX[:20] + [9], PREFIX[:8], [3] * 30]
    runner = Runner(model, n_blocks=7, block_size=8, chunk=12, max_batch=3)
    made = [(i, Request(i, p, 10)) for i, p in enumerate(prompts)]
    serve(runner, made)
    assert runner.sched.preemptions > 0 and runner.sched.pool.hits > 0
    for _, r in made:
        assert r.out == solo(model, r.prompt, 10)


def test_kv_memory_is_whole_blocks_of_the_predicted_size(tiny_model):
    """llama tiny: 3 layers x 2 KV heads x (16 + 16) x 4 B = 768 B per token, 12,288 B per block of 16."""
    _, model = tiny_model("llama")
    assert predicted_bytes("paged", model.spec, 1, 16) == 3 * 2 * 32 * 4 * 16 == 12288
    runner = Runner(model, kv_memory=100_000)
    assert runner.sched.pool.n_blocks == 8 and runner.cache.pool_bytes() == 8 * 12288
    half = Runner(model, kv_memory=100_000, kv_dtype=torch.bfloat16)
    assert half.sched.pool.n_blocks == 16  # bf16 blocks are half the bytes: twice as many fit
    with pytest.raises(KvwallError, match="holds no block"):
        Runner(model, kv_memory=1000)


def test_bf16_pool_serves_close_to_fp32(tiny_model):
    """A bf16 pool under an fp32 model: same greedy tokens on this peaked tiny model for a short stream."""
    _, model = tiny_model("llama")
    runner = Runner(model, n_blocks=20, block_size=4, chunk=8, kv_dtype=torch.bfloat16)
    r = Request(0, PREFIX[:10], 6)
    serve(runner, [(0, r)])
    assert r.out == solo(model, r.prompt, 6)


def test_seeded_sampling_repeats_and_bad_requests_are_refused(tiny_model):
    _, model = tiny_model("llama")
    outs = []
    for _ in range(2):
        runner = Runner(model, n_blocks=20, block_size=4)
        r = Request(0, [1, 2, 3], 8)
        runner.add(r, Sampling(temperature=1.0, top_p=0.9, seed=7))
        runner.run_all()
        outs.append(r.out)
    assert outs[0] == outs[1] and len(outs[0]) == 8
    with pytest.raises(KvwallError, match="outside the vocabulary"):
        runner.add(Request(1, [VOCAB], 2))
    with pytest.raises(KvwallError, match="maximum context of 512"):
        Runner(model, n_blocks=100, block_size=16).add(Request(2, [1] * 500, 20))


def test_an_fp8_pool_holds_four_times_the_blocks_and_serves(tiny_model):
    """fp8 K/V are one byte: 3,072 B per block of 16 on the tiny llama, 32 blocks in 100,000 B. Decoding over the
    rounded K/V stays close: the first tokens of a short prompt match the fp32 run on this peaked model."""
    _, model = tiny_model("llama")
    runner = Runner(model, kv_memory=100_000, kv_dtype=torch.float8_e4m3fn)
    assert runner.block_bytes == 3072 and runner.sched.pool.n_blocks == 32
    r = Request(0, PREFIX[:10], 3)
    serve(runner, [(0, r)])
    assert r.out[:2] == solo(model, r.prompt, 3)[:2]


def test_integer_pools_hold_the_predicted_bytes_and_decode_close(tiny_model):
    """Tiny llama (3 layers x 2 KV heads, head_dim 16), blocks of 16 tokens. int8 (one group of 16 per head
    vector, fp16 scale and zero): 16 + 4 = 20 B a vector, x 2 (K, V) x 2 heads x 3 layers x 16 tokens = 3,840 B.
    int4:g8: 8 B of codes + 2 groups x 4 B = 16 B a vector -> 3,072 B. Their logits stay near the fp32 pool's."""
    from kvwall.serve.runner import QuantizedPages

    _, model = tiny_model("llama")
    prompt = PREFIX[:20]
    logits = {}
    for kv, per_block in [(torch.float32, 12288), ("int8", 3840), ("int4:g8", 3072)]:
        runner = Runner(model, kv_memory=100_000, kv_dtype=kv)
        assert runner.block_bytes == per_block and runner.sched.pool.n_blocks == 100_000 // per_block
        assert runner.cache.block_bytes() == per_block
        assert isinstance(runner.cache, QuantizedPages) == (kv != torch.float32)
        seen, forward = [], runner.forward
        runner.forward = lambda chunks, seen=seen, forward=forward: seen.append(forward(chunks)) or seen[-1]
        runner.add(Request(0, prompt, 1))
        runner.step()
        logits[str(kv)] = seen[0]  # the prefill's attention reads its K/V back from the pool
    exact = logits[str(torch.float32)]
    assert (logits["int8"] - exact).abs().max() < 0.05 * exact.abs().max()
    assert (logits["int4:g8"] - exact).abs().max() > (logits["int8"] - exact).abs().max()  # fewer bits, more error
    with pytest.raises(KvwallError, match="paged pool stores"):
        Runner(model, kv_memory=100_000, kv_dtype="nvfp4")


def test_an_int8_pool_serves_like_solo(tiny_model):
    _, model = tiny_model("llama")
    runner = Runner(model, n_blocks=40, block_size=4, chunk=8, kv_dtype="int8")
    reqs = [Request(i, PREFIX[:6 + 3 * i], 5) for i in range(3)]
    serve(runner, [(i, r) for i, r in enumerate(reqs)])
    assert all(r.out[:2] == solo(model, r.prompt, 5)[:2] for r in reqs)


def test_warm_up_runs_a_request_and_leaves_nothing_behind(tiny_model):
    """serve warms the model up before saying it is up (first-use kernel builds); afterwards every block is
    free, the counters read zero, and a request still equals its solo run."""
    _, model = tiny_model("llama")
    runner = Runner(model, n_blocks=8, block_size=4)
    runner.warm_up()
    assert runner.sched.pool.n_free() == 8
    assert (runner.generated, runner.computed, runner.steps) == (0, 0, 0)
    r = Request(1, [3, 5, 7], 4)
    serve(runner, [(0, r)])
    assert r.out == solo(model, [3, 5, 7], 4)


def test_a_step_runs_one_forward_per_chunk_length(tiny_model):
    """A decoding row, a 5-token prompt and a 3-token prompt in one step: three forwards of one length each
    (rows are right-padded to the longest: one forward would compute 4 + 2 padding tokens), and every
    request still equals its solo run."""
    _, model = tiny_model("llama")
    runner = Runner(model, n_blocks=64, block_size=4, chunk=32, max_batch=8)
    first = Request(0, [3, 1, 4, 1], 6)
    runner.add(first)
    runner.step()  # its prefill: it decodes from the next step
    later = [Request(1, [5, 9, 2, 6, 5], 4), Request(2, [3, 5, 8], 4)]
    for r in later:
        runner.add(r)
    seen, forward = [], runner.forward
    runner.forward = lambda chunks: (seen.append(sorted(c.n for c in chunks)), forward(chunks))[1]
    runner.step()
    assert seen == [[1], [3], [5]]
    runner.run_all()
    for r in [first, *later]:
        assert r.out == solo(model, r.prompt, r.max_tokens)


def test_adapt_threads_serves_the_same_tokens_and_tries_fewer_threads(tiny_model, monkeypatch):
    """--threads auto on a machine whose threads always wait to run (1 s more at every read): the governor tries 1
    thread once 4 decode steps of one shape are timed, and every request still equals its solo run."""
    from kvwall.engine import threads

    _, model = tiny_model("llama")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    waits = iter(range(10**6))
    monkeypatch.setattr(threads, "run_queue_s", lambda: float(next(waits)))
    seen, real = [], torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
    try:
        runner = Runner(model, n_blocks=40, block_size=4, chunk=8, max_batch=2, adapt_threads=True)
        made = [(0, Request(i, PREFIX[:10] + [i], 20)) for i in range(2)]
        serve(runner, made)
        assert 1 in seen and torch.get_num_threads() in (1, 2)
        for _, r in made:
            assert r.out == solo(model, r.prompt, 20)
    finally:
        real(before)

"""Issue #44, the runner's part: logprobs taken from the step's own forwards stay equal to transformers'
log-softmax when prompts are prefilled in chunks beside other rows and requests are preempted and recomputed, and
n > 1 siblings wait for the first one's prompt, then take its blocks from the prefix cache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvwall.engine.generate import Sampling  # noqa: E402
from kvwall.serve.logits import Rules  # noqa: E402
from kvwall.serve.runner import Runner  # noqa: E402
from kvwall.serve.scheduler import Request  # noqa: E402


def run(runner: Runner) -> tuple[dict, dict]:
    """Step until done; -> (prompt logprobs per request, generated tokens' logprobs per request)."""
    prompts, tokens = {}, {}
    for _ in range(2000):
        if not runner.sched.has_work():
            return prompts, tokens
        step, _ = runner.step()
        for r, entries in runner.scored.items():
            assert r not in prompts, "a prompt's logprobs were delivered twice"
            prompts[r] = entries
        for r in step.sampled:
            tokens.setdefault(r, []).append(runner.token_logprobs[r])
    raise AssertionError("requests still unfinished")


@pytest.mark.slow
def test_logprobs_through_chunks_and_preemption_equal_transformers(tiny_model):
    path, model = tiny_model("llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # 14 blocks of 4 = 56 tokens for three requests of 21-30 tokens each: the newest are preempted and recomputed
    runner = Runner(model, n_blocks=14, block_size=4, chunk=8, max_batch=3)
    rules = Rules(logprobs=2, prompt_logprobs=2)
    reqs = [Request(i, [(7 * i + 3 * j + 1) % 160 for j in range(n)], 9) for i, n in enumerate((13, 21, 17))]
    for r in reqs:
        runner.add(r, Sampling(), rules)
    prompts, tokens = run(runner)
    assert runner.sched.preemptions > 0
    for r in reqs:
        with torch.no_grad():
            ref = hf(torch.tensor([r.prompt + r.out])).logits[0].float().log_softmax(-1)  # (T, V)
        seq = r.prompt + r.out
        assert prompts[r][0] is None
        for t in range(1, len(r.prompt)):
            lp, top = prompts[r][t]
            assert lp == pytest.approx(float(ref[t - 1, seq[t]]), abs=2e-5)
            assert [i for i, _ in top] == ref[t - 1].topk(2).indices.tolist()
        got = [lp for lp, _ in tokens[r]]
        want = [float(ref[len(r.prompt) - 1 + j, t]) for j, t in enumerate(r.out)]
        assert got == pytest.approx(want, abs=2e-5)
        assert r.out == [int(ref[len(r.prompt) - 1 + j].argmax()) for j in range(len(r.out))]  # greedy


def test_a_sibling_waits_for_the_prompt_then_shares_its_blocks(tiny_model):
    _, model = tiny_model("llama")
    runner = Runner(model, n_blocks=40, block_size=4, chunk=8, max_batch=4)
    prompt = list(range(1, 19))  # 18 tokens: 3 chunks of 8, 4 full blocks
    lead = Request("a", prompt, 3)
    sib = Request("b", prompt, 3, after=lead)
    runner.add(lead)
    runner.add(sib)
    steps = 0
    while sib.computed == 0 and steps < 10:
        runner.step()
        steps += 1
        assert sib.computed == 0 or lead.computed >= len(prompt)
    assert steps == 4  # 3 steps compute the lead's prompt; the sibling is admitted in the 4th
    assert sib.cached_tokens == 16 and runner.sched.pool.hits == 4
    runner.run_all()
    assert sib.out == lead.out  # greedy: the same tokens from the shared blocks

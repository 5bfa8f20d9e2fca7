"""vLLM's CPU decode step, timed from outside: the peer's side of profile_serve_step.py.

    /work/venvs/vllm/bin/python benchmarks/profile_vllm_step.py CHECKPOINT [--batch 1,16] [--prompt 128]
        [--steps 64]

CHECKPOINT: the fp32 Hugging Face export bench_serve_peers.py writes (~/.cache/kvwall/peers/*-fp32). Runs
in vLLM's own venv (it imports nothing of kvwall). For each batch B, vLLM's offline engine generates B
random `--prompt`-token prompts twice, greedy with ignore_eos: once to 1 token (the prefill) and once to
`--steps` + 1 tokens; (second - first) / steps is its decode step at batch B (context prompt .. prompt +
steps), median of 3 pairs. Prefix caching is off so the repeats recompute. The same engine settings as
bench_serve_peers.py's server (fp32, max_num_seqs 32, VLLM_CPU_KVCACHE_SPACE from the environment).
Under the bench lock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def timed(llm, prompts, tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def main() -> None:
    import random

    from vllm import LLM, TokensPrompt

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--batch", default="1,16")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    llm = LLM(args.checkpoint, dtype="float32", max_model_len=2048, max_num_seqs=32, enable_prefix_caching=False)
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    print(f"vLLM CPU, torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}; prompt {args.prompt} tokens")
    for b in (int(x) for x in args.batch.split(",")):
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(args.prompt)])
                   for _ in range(b)]
        timed(llm, prompts, 2)  # warm-up: this batch's shapes
        steps = []
        for _ in range(3):
            steps.append((timed(llm, prompts, args.steps + 1) - timed(llm, prompts, 1)) / args.steps)
        print(f"batch {b}: decode step {statistics.median(steps) * 1e3:.1f} ms "
              f"(runs {', '.join(f'{s * 1e3:.1f}' for s in steps)} ms), prefill of the batch "
              f"{timed(llm, prompts, 1) * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
    main()

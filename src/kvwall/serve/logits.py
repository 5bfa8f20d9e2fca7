"""What a request asks of its next-token logits beyond temperature and top-p: penalties, biases, a minimum length,
and the log-probabilities it wants back. One row at a time, on the logits of the step's own forward.

Order and semantics: vLLM's V1 sampler (vllm/v1/sample/sampler.py, its docstring's steps 5-6), which serves the
OpenAI fields and its own extensions:

1. min_tokens:          logit[s] = -inf for every stop id s (the model's EOS unless ignore_eos, and
                        stop_token_ids) while fewer than min_tokens tokens were generated
2. logit_bias:          logit[t] += bias[t]                                 (OpenAI: -100..100 per token id)
3. repetition_penalty:  for t in prompt + output: logit /= p where logit > 0, else logit *= p
                        (transformers' RepetitionPenaltyLogitsProcessor; 1 changes nothing)
4. frequency_penalty:   logit[t] -= f * count of t in the output (generated tokens only)
   presence_penalty:    logit[t] -= p * (t occurs in the output)

Log-probabilities are those of the model (log-softmax of its raw logits, before the rules above and the
temperature), as vLLM returns by default (logprobs_mode "raw_logprobs"): a score of the model, not of the
sampler's settings.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20  # top alternatives per token at most (OpenAI's chat top_logprobs limit; vLLM's default cap)


@dataclass(frozen=True)
class Rules:
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias)
    min_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()  # what min_tokens holds back (EOS unless ignore_eos, stop_token_ids)
    logprobs: int | None = None  # top-N alternatives per generated token (0: the token's own only); None: none
    prompt_logprobs: int | None = None  # the same for every prompt token (echo); None: none

    @property
    def shapes(self) -> bool:
        """Whether any rule changes the logits (else the row samples from the model's own)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


NONE = Rules()


def apply(rules: Rules, logits: torch.Tensor, prompt: list[int], out: list[int]) -> torch.Tensor:
    """logits (V,) of one row -> the logits its sampler sees (V,), float32."""
    logits = logits.float().clone()  # (V,)
    if len(out) < rules.min_tokens and rules.stop_ids:
        logits[sorted(rules.stop_ids)] = float("-inf")
    if rules.logit_bias:
        ids, bias = zip(*rules.logit_bias)
        logits[list(ids)] += torch.tensor(bias)
    if rules.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(out)), dtype=torch.long)  # (S,)
        x = logits[seen]
        logits[seen] = torch.where(x > 0, x / rules.repetition_penalty, x * rules.repetition_penalty)
    if out and (rules.frequency_penalty or rules.presence_penalty):
        counts = torch.bincount(torch.tensor(out), minlength=logits.shape[0]).float()  # (V,)
        logits -= rules.frequency_penalty * counts + rules.presence_penalty * (counts > 0).float()
    return logits


def top(logprobs: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """logprobs (V,) -> (the token's logprob, the k most likely (id, logprob), best first). Both read the same
    tensor, so a token that is the most likely has exactly the top logprob (lm-evaluation-harness's is_greedy
    compares them with ==)."""
    best = logprobs.topk(k) if k else None
    pairs = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
    return float(logprobs[token]), pairs

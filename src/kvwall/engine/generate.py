"""Prefill, then a decode loop: greedy or sampled, stop tokens, a batch of prompts, a streaming callback.

Batching: prompts of different lengths are right-padded into one (B, T) prefill; each row
keeps its own positions (padding is -1, never written to a cache nor attended to), and
each decode step feeds one token per row at that row's next position. A row that hits a
stop token or its budget stops: its position becomes -1 (no cache writes) and the cache
may release its memory (paged).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvwall.engine.caches import CacheChoice, KVCache, make_cache
from kvwall.engine.threads import ThreadGovernor, step_on
from kvwall.errors import KvwallError

# A temperature below float32's smallest normal number (2**-126, 1.2e-38) samples greedily: the logits are float32,
# so a smaller one is subnormal there and one below 2**-149 (1.4e-45) rounds to 0, where the top logit's
# 0 / t is NaN (temperature 1e-300 failed the server's whole step: "probability tensor contains either inf, nan
# or element < 0"). Above it, (logit - max) / t is finite or -inf, and softmax of it never NaN.
MIN_TEMPERATURE = 2.0 ** -126


@dataclass(frozen=True)
class Sampling:
    """temperature 0 (or below MIN_TEMPERATURE) is greedy; top_k / top_p filter before sampling; seed makes it
    repeatable."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def check(self) -> None:
        if not 0 <= self.temperature < float("inf"):  # NaN too: it would sample from NaN probabilities
            raise KvwallError(f"temperature must be a finite number >= 0 (got {self.temperature})")
        if self.top_k is not None and self.top_k < 1:
            raise KvwallError(f"top-k must be >= 1 (got {self.top_k})")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise KvwallError(f"top-p must be in (0, 1] (got {self.top_p})")


@dataclass
class Generation:
    tokens: list[list[int]]  # new tokens per prompt (stop token included when hit)
    prefill_s: float
    decode_s: float
    decode_steps: int
    cache_bytes: int  # the most the cache held at any step (before finished rows were released)
    cache: KVCache = field(repr=False)
    thread_trials: list[tuple[int, int, int, bool]] | None = None  # adapt_threads: (step, from, to, kept) each

    @property
    def decode_tok_s(self) -> float:
        n = sum(max(len(t) - 1, 0) for t in self.tokens)  # the first token comes from the prefill
        return n / self.decode_s if self.decode_s > 0 else float("nan")


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) -> the index of each row's largest (...,) int64: torch.argmax's answer (the first of equal
    maxima; a NaN counts as the largest), through numpy's argmax for float32 on the CPU. Why: torch's took 225 us
    over Gemma 3's 262,144 logits on the dev box's 2 threads and numpy's 19 us (2026-12-06), 1.5 % of a decode step
    that took 15 ms."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad or logits.dim() == 0:
        return logits.argmax(-1)
    return torch.from_numpy(np.asarray(logits.numpy().argmax(-1), dtype=np.int64))


def pick(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """logits (B, V) -> next token (B,)."""
    if s.greedy:
        return greedy(logits)
    logits = logits.float()
    # less the top logit first: logits / t overflowed float32 once |logit| / t passed 3.4e38 (a logit of 30 at
    # t = 1e-37), and softmax's inf - inf is NaN; (logit - max) / t is at most 0, and -inf at worst
    logits = (logits - logits.max(-1, keepdim=True).values) / s.temperature
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p is not None and s.top_p < 1:
        srt, idx = logits.sort(-1, descending=True)  # (B, V)
        before = srt.softmax(-1).cumsum(-1) - srt.softmax(-1)  # probability mass ranked above each token
        drop = before >= s.top_p  # keep the smallest prefix reaching top_p (at least one token)
        logits = logits.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]


def check_logits(logits: torch.Tensor, when: str = "after the prefill") -> None:
    """NaN or inf logits come from damaged weights or a config value such as a negative rope_theta: an error,
    not garbage tokens."""
    if not torch.isfinite(logits).all():
        raise KvwallError(f"non-finite logits {when} (NaN or inf): check the weights and config.json "
                          "values such as rope_theta")


def right_pad(prompts: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts -> tokens (B, T), pos (B, T) with -1 on padding."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise KvwallError("every prompt needs at least one token")
    T = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), T), pad, dtype=torch.long)
    pos = torch.full((len(prompts), T), -1, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p, dtype=torch.long)
        pos[b, :len(p)] = torch.arange(len(p))
    return tokens, pos


@torch.inference_mode()
def generate(model, prompts: list[list[int]], max_new_tokens: int = 32,
             cache: str | CacheChoice | KVCache = "contiguous", sampling: Sampling = Sampling(),
             stop: tuple[int, ...] | None = None, on_token: Callable[[int, int], None] | None = None,
             adapt_threads: bool = False, **cache_opts) -> Generation:
    """Generate up to max_new_tokens per prompt. on_token(row, token) streams each new token. adapt_threads: each
    decode step runs on the thread count a ThreadGovernor picks (fewer beside a busy neighbour; kvwall.engine.threads),
    at most torch's count, which it gets back at the end."""
    sampling.check()
    if max_new_tokens < 1:
        raise KvwallError(f"max new tokens must be at least 1 (got {max_new_tokens})")
    vocab = model.spec.vocab
    if any(not 0 <= t < vocab for p in prompts for t in p):
        raise KvwallError(f"a prompt token id is outside the vocabulary [0, {vocab})")
    max_len = max(len(p) for p in prompts) + max_new_tokens
    model.check_context(max_len)
    device = next(model.parameters()).device
    if isinstance(cache, (str, CacheChoice)):  # a registry name (parse_cache), else a cache made by the caller
        dtype = next(model.parameters()).dtype
        cache = make_cache(cache, model.spec, len(prompts), max_len, dtype, device, **cache_opts)
    stop = tuple(model.spec.eos_token_ids) if stop is None else tuple(stop)
    gen = torch.Generator(device=device).manual_seed(sampling.seed) if sampling.seed is not None else None
    return _loop(model, prompts, max_new_tokens, cache, sampling, stop, on_token, gen, device, adapt_threads)


def _loop(model, prompts, max_new, cache, sampling, stop, on_token, gen, device, adapt_threads) -> Generation:
    tokens, pos = right_pad(prompts)
    t0 = time.perf_counter()
    logits = model(tokens.to(device), pos.to(device), cache, last_only=True)[:, 0]  # (B, V)
    check_logits(logits)
    nxt = pick(logits, sampling, gen)  # (B,)
    t1 = time.perf_counter()
    out: list[list[int]] = [[] for _ in prompts]
    length = [len(p) for p in prompts]
    live = [True] * len(prompts)
    steps, held = 0, cache.nbytes()
    governor = ThreadGovernor() if adapt_threads else None
    try:
        while True:
            for b, t in enumerate(nxt.tolist()):
                if live[b]:
                    out[b].append(t)
                    if on_token:
                        on_token(b, t)
                    live[b] = t not in stop and len(out[b]) < max_new
            held = max(held, cache.nbytes())
            for b in range(len(prompts)):
                if not live[b] and length[b] >= 0:
                    cache.release(b)
                    length[b] = -1
            if not any(live):
                break
            step_pos = torch.tensor([[length[b]] if live[b] else [-1] for b in range(len(prompts))], device=device)
            with step_on(governor, key=sum(live)):  # key: rows still decoding
                logits = model(nxt[:, None], step_pos, cache)[:, -1]  # (B, V)
                check_logits(logits, f"at decode step {steps + 1}")  # pick() waits for the logits anyway
            nxt = pick(logits, sampling, gen)
            steps += 1
            length = [n + 1 if n >= 0 else n for n in length]
    finally:
        if governor:
            governor.close()
    return Generation(out, t1 - t0, time.perf_counter() - t1, steps, held, cache,
                      governor.trials if governor else None)

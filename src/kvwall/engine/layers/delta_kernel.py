"""The decode step of a linear-attention state in one C++ pass (kernels/delta_rule.cpp, built on first use).

One new token per row updates each head's state S (dk, dv) in place and reads it out:

    Gated DeltaNet, Kimi Delta Attention (delta_step):      lightning attention (linear_step):
        S_a   = Diag(a) S,  a = exp(g)                          S' = Diag(a) S + k vᵀ
        δ     = β (v - S_aᵀ k)                                  o  = S'ᵀ q
        S'    = S_a + k δᵀ,  o = S'ᵀ q

with the decay a one number per head (Gated DeltaNet, lightning: g (B, H, 1)) or one per key channel (Kimi Delta
Attention: g (B, H, dk)). Why C++: the step is bandwidth-bound (about 2 FLOPs per state byte moved), and its torch
form (gated_deltanet.gated_delta_step_) passes over S six times (decay, read k, update: read and write, read q),
reaching 0.21-0.38 of one bare in-place pass over the same states. The kernel runs one (row, head) job per thread
and walks a head in column blocks (a column of S needs only itself): δ needs the whole decayed read S_aᵀ k before
any row is written, so the block is read once from memory and rewritten from L1; o = Sᵀ(a∘q) + (k·q) δ comes out
of the same reads. Lightning's update waits on nothing: one pass. Fallback when it cannot be built, for float64
states and for tensors off the CPU: the torch in-place steps, which are also the reference the tests hold it to.

Measured at one thread against one bare in-place pass over the same states in the same run (2 busy cores, load
9-20, 2026-12-06): Qwen3-Next's 36 Gated DeltaNet layers 0.94 (torch 0.30; benchmarks/results/delta_rule_step.json),
Kimi-Linear's 20 KDA layers 0.92 (torch 0.37), MiniMax-Text-01's 70 lightning layers 0.95 (torch 0.40;
benchmarks/results/kda_lightning_step.json).
"""

from __future__ import annotations

import functools

import torch

from kvwall.engine.native import compiled


@functools.lru_cache(maxsize=2)
def delta_rule(function: str = "delta_step"):
    """The compiled ``delta_step`` or ``linear_step`` of kernels/delta_rule.cpp, or None if it cannot be built."""
    return compiled("delta_rule", function, "the torch in-place step")


def applies(S: torch.Tensor) -> bool:
    """Whether the kernel can take state S: fp32 on the CPU, with dense rows (every state cache's is)."""
    return S.device.type == "cpu" and S.dtype == torch.float32 and S.dim() == 4 and S.stride(3) == 1


def delta_step_(q, k, v, g, beta, S):
    """The delta rule's step through the kernel: q, k (B, H, dk), v (B, H, dv), g (B, H) or (B, H, dk), beta (B, H),
    S (B, H, dk, dv) updated in place -> o (B, H, dv); None where the kernel does not apply or does not build."""
    kernel = delta_rule("delta_step") if applies(S) else None
    if kernel is None:
        return None
    B, H = beta.shape
    return kernel(*(t.float().contiguous() for t in (q, k, v, g.reshape(B, H, -1), beta)), S)  # (B, H, dv)


def linear_step_(q, k, v, g, S):
    """Lightning attention's step through the kernel: q, k, v (B, H, d), g (B, H), S (B, H, d, d) updated in
    place -> o (B, H, d); None where the kernel does not apply or does not build."""
    kernel = delta_rule("linear_step") if applies(S) else None
    if kernel is None:
        return None
    return kernel(*(t.float().contiguous() for t in (q, k, v, g.reshape(*g.shape[:2], 1))), S)  # (B, H, d)

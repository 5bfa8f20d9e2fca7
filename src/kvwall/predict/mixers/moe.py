"""Mixture of experts: a step reads the weights of the experts its tokens touch.

For T routed tokens each picking k of E experts uniformly, the expected number of distinct experts
is ``E (1 - (1 - k/E)^T)``; shared experts always run. Tensor parallel splits every expert's d_ff.
"""

from __future__ import annotations

from kvwall.predict.mixers import mlp
from kvwall.predict.step import Op, Step, matmul
from kvwall.spec.model import MLP, MoE


def expected_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts touched when `tokens` tokens each route to top_k of n_experts uniformly."""
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def shard_params(f: MoE, hidden: int, tp: int) -> float:
    return f.params(hidden) / tp


def ops(i: int, f: MoE, spec, st: Step, fm, tp: int) -> list[Op]:
    T, h = st.tokens, spec.hidden
    router = matmul("router", i, T, h, f.n_experts, fm.weights)
    one = mlp.ops(i, MLP(f.d_expert, f.gated), spec, Step(1, 0, 1), fm, tp)[0]
    touched = expected_experts(f.n_experts, f.top_k, T)
    experts = Op("experts", i, flops=T * f.top_k * one.flops, weight_bytes=touched * one.weight_bytes,
                 act_bytes=T * f.top_k * one.act_bytes, detail=f"{touched:.1f} of {f.n_experts} touched",
                 rows=T * f.top_k / touched)  # the tokens each touched expert multiplies, on average
    out = [router, experts]
    if f.n_shared:
        shared = MLP((f.d_shared or f.d_expert) * f.n_shared, f.gated)
        out += mlp.ops(i, shared, spec, st, fm, tp, name="shared experts")
    return out

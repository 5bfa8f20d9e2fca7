"""Mixture of experts: a step reads the weights of the experts its tokens touch.

For T routed tokens each picking k of E experts uniformly, the expected number of distinct experts
is ``E (1 - (1 - k/E)^T)``; shared experts always run. Tensor parallel splits every expert's d_ff.
Expert parallel (ep GPUs, each with its own T tokens: memory.Parallel) gives each GPU E/ep whole experts;
routing stays uniform, so each GPU receives T k token-expert pairs from all ep x T tokens and touches 1/ep of
the experts they touch. Every token goes to its k experts and back (all-to-all dispatch and combine): the
(ep - 1)/ep of them that live on other GPUs cross the link, 16-bit, once per expert (no de-duplication
of a token's experts on one GPU, as DeepEP does within a node).
"""

from __future__ import annotations

from kvwall.predict.mixers import mlp
from kvwall.predict.step import ACT_BYTES, LINK, Op, Step, matmul, split
from kvwall.spec.formats import tensor_format
from kvwall.spec.model import MLP, MoE


def expected_experts(n_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts touched when `tokens` tokens each route to top_k of n_experts uniformly."""
    return n_experts * (1 - (1 - top_k / n_experts) ** tokens)


def shard_params(f: MoE, hidden: int, tp: int, ep: int = 1) -> float:
    if ep == 1:
        return f.params(hidden) / tp
    routed = split(f.n_experts, ep, "routed experts", "ep") * f.expert_params(hidden)
    return f.params(hidden) - f.n_experts * f.expert_params(hidden) + routed  # router and shared experts whole


def ops(i: int, f: MoE, spec, st: Step, fm, tp: int, ep: int = 1) -> list[Op]:
    T, h = st.tokens, spec.hidden  # this GPU's tokens
    router = matmul("router", i, T, h, f.n_experts, tensor_format(fm.weights, "router"))
    one = mlp.ops(i, MLP(f.d_expert, f.gated), spec, Step(1, 0, 1), fm, tp, kind="expert", module="mlp.experts")[0]
    mine = split(f.n_experts, ep, "routed experts", "ep")  # this GPU's experts
    touched = expected_experts(f.n_experts, f.top_k, T * ep) / ep  # of this GPU's experts, by every GPU's tokens
    pairs = T * f.top_k  # token-expert pairs this GPU computes: its own count, routing being uniform
    experts = Op("experts", i, flops=pairs * one.flops, weight_bytes=touched * one.weight_bytes,
                 act_bytes=pairs * one.act_bytes, detail=f"{touched:.1f} of {mine} touched",
                 rows=pairs / touched)  # the tokens each touched expert multiplies, on average
    out = [router, experts]
    if ep > 1:
        sent = pairs * (ep - 1) / ep * h * ACT_BYTES
        out = [router, Op("all-to-all dispatch", i, link_bytes=sent, kind=LINK), experts,
               Op("all-to-all combine", i, link_bytes=sent, kind=LINK)]
    if f.n_shared:
        shared = MLP((f.d_shared or f.d_expert) * f.n_shared, f.gated)
        out += mlp.ops(i, shared, spec, st, fm, tp, name="shared experts", module="mlp.shared_experts")
    return out


def matrices(m, hidden: int) -> list[tuple[str, str, int, int, int]]:
    """(tensor kind, module name, out, in, how many): the matrices a checkpoint stores in its weight format."""
    return (mlp.gated_matrices("expert", "mlp.experts", m.d_expert, m.gated, hidden, m.n_experts)
            + mlp.gated_matrices("linear", "mlp.shared_experts", m.d_shared or m.d_expert, m.gated, hidden, m.n_shared)
            + [("router", "mlp.gate", m.n_experts, hidden, 1)])

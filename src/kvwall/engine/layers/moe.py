"""Mixture of experts: a router picks top_k of E experts per token; shared experts always run.

    s = score(W_r x)                       softmax (Mixtral, Qwen, Jamba, DeepSeek-V2) or sigmoid (DeepSeek-V3)
    choose top_k of s (+ bias)             V3 adds e_score_correction_bias to choose, never to weigh;
                                           group-limited: only the topk_group best of n_group groups compete
    g = s[chosen] (/ sum) * scale          renormalise (Mixtral; norm_topk_prob), routed_scaling_factor
    y = sum_k g_k E_k(x) + shared(x)       E_k, shared: gated MLPs down(silu(gate x) * up x)
                                           (Qwen2-MoE, Qwen3-Next: shared(x) * sigmoid(w_s · x), a gate per token)
                                           (Nemotron-H: plain MLPs down(relu(up x)^2))

Each forward records `touched`: how many distinct experts its tokens used (the experts whose
weights the step had to read), the number predict.mixers.moe.expected_experts estimates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvwall.engine.layers.mlp import make_mlp
from kvwall.errors import KvwallError
from kvwall.spec.model import MLP, MoE as MoESpec


class Router(nn.Module):
    """x (N, D) -> weights (N, k), experts (N, k), computed in fp32 (float64 for a float64 model)."""

    def __init__(self, spec: MoESpec, hidden: int):
        super().__init__()
        r = spec.routing
        if r.score not in ("softmax", "sigmoid") or r.group_score not in ("max", "top2"):
            raise KvwallError(f"routing {r.score}/{r.group_score} is not one the engine runs (softmax or sigmoid, "
                              "groups by max or top2)")
        if spec.n_experts % r.n_group:
            raise KvwallError(f"{spec.n_experts} experts do not split into {r.n_group} groups; fix n_group")
        self.routing, self.k, self.E = r, spec.top_k, spec.n_experts
        self.weight = nn.Parameter(torch.empty(spec.n_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(spec.n_experts)) if r.bias else None  # V3 e_score_correction_bias
        self.logit_bias = nn.Parameter(torch.zeros(spec.n_experts)) if spec.bias else None  # gpt-oss: on the logits

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # fp32 at least (a bf16 model's router too); a float64 model's in float64, whose decode and full forward
        # then agree to 1e-12: in fp32 one row against forty rounded differently on a Xeon's sgemm (2.7e-6 at a
        # lightning mixer after one MoE layer, 2026-12-07), though not on the hosts before it
        dt = torch.promote_types(x.dtype, torch.float32)
        b = None if self.logit_bias is None else self.logit_bias.to(dt)
        logits = F.linear(x.to(dt), self.weight.to(dt), b)  # (N, E)
        scores = logits.softmax(-1) if self.routing.score == "softmax" else logits.sigmoid()  # (N, E)
        choice = scores if self.bias is None else scores + self.bias.to(dt)  # (N, E)
        if self.routing.n_group > 1:
            choice = self.keep_best_groups(choice)
        experts = choice.topk(self.k, dim=-1).indices  # (N, k)
        weights = scores.gather(1, experts)  # (N, k)
        if self.routing.normalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routing.scale, experts

    def keep_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Group-limited routing: experts outside the topk_group best groups get -inf."""
        r = self.routing
        grouped = choice.view(choice.shape[0], r.n_group, self.E // r.n_group)  # (N, G, E/G)
        if r.group_score == "max":
            group_scores = grouped.max(-1).values  # (N, G)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G)
        best = group_scores.topk(r.topk_group, dim=-1).indices  # (N, topk_group)
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)  # (N, G)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)


class MoE(nn.Module):
    def __init__(self, spec: MoESpec, hidden: int):
        super().__init__()
        self.router = Router(spec, hidden)
        expert = MLP(spec.d_expert, spec.gated, spec.bias, activation=spec.activation)  # gpt-oss: biases
        self.experts = nn.ModuleList(make_mlp(expert, hidden, spec.swiglu) for _ in range(spec.n_experts))
        self.on_input = spec.routing.on_input  # Llama 4: expert(w x), not w expert(x)
        width = spec.n_shared * (spec.d_shared or spec.d_expert)
        shared = MLP(width, spec.gated, activation=spec.activation)
        self.shared = make_mlp(shared, hidden) if spec.n_shared else None  # n_shared experts side by side
        self.shared_gate = nn.Linear(hidden, 1, bias=False) if spec.shared_gate and spec.n_shared else None
        self.touched = 0  # distinct experts used by the last forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, D)
        weights, experts = self.router(x)  # (N, k), (N, k)
        y = torch.zeros_like(x)  # (N, D)
        used = experts.unique().tolist()
        for e in used:
            token, slot = (experts == e).nonzero(as_tuple=True)  # (n,), (n,): tokens routed to e
            w = weights[token, slot, None].to(x.dtype)  # (n, 1)
            out = self.experts[e](x[token] * w) if self.on_input else self.experts[e](x[token]) * w  # (n, D)
            y.index_add_(0, token, out)
        self.touched = len(used)
        if self.shared is not None:
            s = self.shared(x)  # (N, D)
            y = y + (s if self.shared_gate is None else torch.sigmoid(self.shared_gate(x)) * s)  # (N, D)
        return y.view(shape)  # (B, T, D)


def touched_experts(model: nn.Module) -> list[int]:
    """Distinct experts each MoE layer used in the model's last forward pass, in layer order."""
    return [m.touched for m in model.modules() if isinstance(m, MoE)]


MIXER = MoE  # kvwall.engine.mixers finds it by the spec's kind

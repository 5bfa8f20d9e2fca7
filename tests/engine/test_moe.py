"""MoE routing against transformers' routers, and the experts a step touches against the predictor.

test_models.py runs mixtral, qwen3_moe and the DeepSeek families end to end against transformers.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_checkpoints import MLA, VOCAB  # noqa: E402

from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.layers.moe import MoE, Router, touched_experts  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402
from kvwall.predict.mixers.moe import expected_experts  # noqa: E402
from kvwall.spec.hf import spec_from_config  # noqa: E402
from kvwall.spec.model import MoE as MoESpec, Routing  # noqa: E402

SMALL = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128)


def _routers():
    t = transformers
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.jamba.modeling_jamba import JambaTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    qwen = dict(SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
    v2 = dict(MLA, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=3, routed_scaling_factor=1.5)
    return {
        "mixtral": (t.MixtralConfig(**SMALL, num_local_experts=8, num_experts_per_tok=2), MixtralTopKRouter),
        "qwen3_moe": (t.Qwen3MoeConfig(**qwen), Qwen3MoeTopKRouter),
        "qwen3_moe_norm": (t.Qwen3MoeConfig(**qwen, norm_topk_prob=True), Qwen3MoeTopKRouter),
        "deepseek_v2_greedy": (t.DeepseekV2Config(**v2, topk_method="greedy"), DeepseekV2TopkRouter),
        "deepseek_v2_grouped": (t.DeepseekV2Config(**v2, topk_method="group_limited_greedy"), DeepseekV2TopkRouter),
        "deepseek_v3": (t.DeepseekV3Config(**dict(v2, routed_scaling_factor=2.5)), DeepseekV3TopkRouter),
        "jamba": (t.JambaConfig(**SMALL, num_experts=8, num_experts_per_tok=2, expert_layer_period=1,
                                expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1), JambaTopKRouter),
    }


def moe_spec_of(cfg) -> MoESpec:
    return next(layer.ffn for layer in spec_from_config(cfg.to_dict()).layers if isinstance(layer.ffn, MoESpec))


@pytest.mark.parametrize("case", list(_routers()))
def test_router_picks_and_weighs_as_transformers(case):
    cfg, hf_class = _routers()[case]
    g = torch.Generator().manual_seed(0)
    hf = hf_class(cfg)
    ours = Router(moe_spec_of(cfg), 64)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(hf.weight.shape, generator=g) * 0.3)
        ours.weight.copy_(hf.weight)
        if ours.bias is not None:  # V3: the correction bias moves choices, never weights
            hf.e_score_correction_bias.copy_(torch.randn(ours.bias.shape, generator=g) * 0.2)
            ours.bias.copy_(hf.e_score_correction_bias)
        x = torch.randn(512, 64, generator=g)
        _, hf_w, hf_idx = hf(x)
        w, idx = ours(x)
    hf_idx, order = hf_idx.sort(-1)
    idx, mine = idx.sort(-1)
    assert torch.equal(idx, hf_idx)
    assert torch.allclose(w.gather(1, mine), hf_w.float().gather(1, order), atol=1e-6)


def test_group_limited_routing_stays_in_the_best_groups():
    """V2-style: 16 experts, 4 groups, experts only from the 2 groups whose best expert scores highest."""
    spec = MoESpec(16, 3, 8, routing=Routing(n_group=4, topk_group=2))
    router = Router(spec, 32)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g))
        x = torch.randn(256, 32, generator=g)
        _, experts = router(x)
        best_groups = (x @ router.weight.T).view(256, 4, 4).max(-1).values.topk(2, -1).indices  # (N, 2)
    in_best = (experts[:, :, None] // 4 == best_groups[:, None, :]).any(-1)  # (N, k)
    assert bool(in_best.all())
    plain = Router(MoESpec(16, 3, 8), 32)
    plain.load_state_dict(router.state_dict())
    with torch.no_grad():
        assert not torch.equal(plain(x)[1].sort(-1).values, experts.sort(-1).values)  # the limit did bind


def _uniform_moe(routing: Routing, n_experts=16, top_k=2, hidden=32) -> MoE:
    """Router rows orthonormal and equal-norm: for x ~ N(0, I) every expert's logit is iid, so each token
    picks a uniformly random top_k subset -- the assumption behind predict.mixers.moe.expected_experts."""
    moe = MoE(MoESpec(n_experts, top_k, 4, routing=routing), hidden)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        q, _ = torch.linalg.qr(torch.randn(hidden, n_experts, generator=g))  # (hidden, E) orthonormal columns
        moe.router.weight.copy_(3.0 * q.T)
        for p in moe.experts.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return moe


@pytest.mark.slow
@pytest.mark.parametrize("routing", [Routing(), Routing("sigmoid", n_group=4, topk_group=2, group_score="top2")],
                         ids=["mixtral-softmax", "v3-grouped-sigmoid"])
def test_touched_experts_match_the_predictors_expectation(routing):
    moe = _uniform_moe(routing)
    g = torch.Generator().manual_seed(3)
    report = {}
    for tokens in (1, 4, 16, 48):
        counts = []
        with torch.no_grad():
            for _ in range(150):
                moe(torch.randn(1, tokens, 32, generator=g))
                counts.append(moe.touched)
        measured, expected = sum(counts) / len(counts), expected_experts(16, 2, tokens)
        report[tokens] = (measured, expected)
        assert abs(measured - expected) < 0.05 * expected + 0.1, report
    assert report[1][0] == 2.0  # one token touches exactly top_k experts


def test_a_decode_step_touches_top_k_experts_per_token(checkpoint):
    model = load_model(checkpoint("mixtral")[0])
    generate(model, [[1, 2, 3]], max_new_tokens=2)
    assert touched_experts(model) == [2, 2, 2]  # last step: one token, top-2, every layer
    generate(model, [[1, 2, 3], [4, 5], [6]], max_new_tokens=2)
    assert all(2 <= n <= 6 for n in touched_experts(model))


def test_ungated_experts_are_plain_mlps_and_a_shared_gate_is_one_weight_row():
    moe = MoE(MoESpec(4, 2, 8, gated=False, activation="relu2"), 16)  # Nemotron-H: down(relu(up x)^2)
    assert set(dict(moe.experts[0].named_parameters())) == {"w1.weight", "w2.weight"}
    gated = MoE(MoESpec(4, 2, 8, n_shared=1, shared_gate=True), 16)  # Qwen2-MoE: sigmoid(w . x) * shared(x)
    assert gated.shared_gate.weight.shape == (1, 16) and moe.shared_gate is None


def test_experts_that_do_not_split_into_groups_are_refused():
    with pytest.raises(KvwallError, match="10 experts do not split into 4 groups"):
        Router(MoESpec(10, 2, 8, routing=Routing(n_group=4, topk_group=2)), 16)

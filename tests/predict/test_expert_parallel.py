"""Expert parallel (--ep): weights, cache and one step's ops per GPU counted by hand on a tiny MoE, and the
all-to-all's link time."""

import math
from dataclasses import replace

import pytest

from kvwall.cli import main
from kvwall.errors import KvwallError
from kvwall.predict.devices import get_device
from kvwall.predict.fit import fit
from kvwall.predict.memory import Formats, Parallel, memory
from kvwall.predict.ops import mixed_ops, step_ops
from kvwall.predict.roofline import Roof, decode
from kvwall.predict.step import Step
from kvwall.spec.formats import get_format
from kvwall.spec.model import MLP, Attention, Layer, ModelSpec, MoE

FP16 = get_format("fp16")
F16 = Formats(FP16, FP16, FP16)
H = 64
# 8 experts of width 32 (gated: 3 x 64 x 32 = 6,144 parameters each), top 2, one shared expert of width 32
MOE = MoE(n_experts=8, top_k=2, d_expert=32, n_shared=1)
TINY = ModelSpec("tiny-moe", "test", hidden=H, vocab=100,
                 layers=(Layer(Attention(4, 2, 16, 16), MLP(128), 128), Layer(Attention(4, 2, 16, 16), MOE, 128)))
EXPERT = 3 * H * 32  # parameters of one routed expert


def test_weights_per_gpu_by_hand():
    whole = memory(TINY, formats=F16).layers[1].weight_bytes
    ep4 = memory(TINY, formats=F16, parallel=Parallel(ep=4)).layers[1].weight_bytes
    assert whole - ep4 == (8 - 2) * EXPERT * 2  # 6 of 8 routed experts live on other GPUs, 2 bytes each
    # the dense layer and the embeddings stay whole on every GPU
    assert memory(TINY, formats=F16, parallel=Parallel(ep=4)).layers[0].weight_bytes == \
        memory(TINY, formats=F16).layers[0].weight_bytes


def test_cache_per_gpu_is_its_share_of_the_batch():
    per_seq = 2 * (2 * 2 * 16 * 2) * 10  # 2 layers x (K+V) 2 KV heads x 16 x 2 B x 10 tokens = 2,560 B
    rep = memory(TINY, batch=10, context=10, formats=F16, parallel=Parallel(ep=4))
    assert rep.per_gpu()[1] == 3 * per_seq  # 10 sequences over 4 GPUs: the busiest holds 3
    assert rep.cache_bytes == 10 * per_seq  # all GPUs together: the batch, once
    assert rep.as_dict()["ep"] == 4 and rep.as_dict()["gpus"] == 4


def test_decode_step_ops_by_hand():
    """Batch 8 over ep=4: each GPU decodes 2 sequences; its 2 experts see all 8 tokens' routing."""
    ops = step_ops(TINY, Step(8, 9, 1), F16, ep=4)
    by = {(o.name, o.layer): o for o in ops}
    assert by["embedding", None].act_bytes == 2 * H * 2  # 2 local tokens
    assert by["lm_head", None].flops == 2 * 2 * H * 100
    experts = by["experts", 1]
    touched = 8 * (1 - (1 - 2 / 8) ** 8) / 4  # of this GPU's 2 experts, by all 8 tokens
    assert experts.weight_bytes == pytest.approx(touched * EXPERT * 2)
    assert experts.flops == 2 * 2 * 2 * EXPERT  # 2 tokens x top 2, 2 FLOPs per weight: balanced routing
    assert experts.detail == f"{touched:.1f} of 2 touched"
    sent = 2 * 2 * 3 / 4 * H * 2  # 2 tokens x 2 experts, 3/4 of them elsewhere, 64 values of 2 B
    assert by["all-to-all dispatch", 1].link_bytes == sent == by["all-to-all combine", 1].link_bytes
    assert ("all-to-all dispatch", 0) not in by  # a dense layer sends nothing
    assert by["attention", 0].cache_read == 2 * 10 * 2 * 32 * 2  # 2 sequences' caches


def test_ep_1_is_unchanged_and_all_to_all_time():
    assert step_ops(TINY, Step(8, 9, 1), F16) == step_ops(TINY, Step(8, 9, 1), F16, ep=1)
    dev = replace(get_device("h100-sxm"), interconnect_bw=100e9)
    roof = Roof(dev, link_latency_s=5e-6)
    r = decode(TINY, 10, 8, F16, roof, Parallel(ep=4))
    links = [o for o in r.per_op if o["kind"] == "link"]
    assert [o["group"] for o in links] == ["all-to-all dispatch", "all-to-all combine"]
    assert links[0]["time_s"] == pytest.approx(5e-6 + (2 * 2 * 3 / 4 * H * 2) / 100e9)


def test_mixed_step_splits_tokens_and_work():
    groups = [Step(1, 99, 1)] * 6 + [Step(1, 0, 30)]
    ops = mixed_ops(TINY, groups, F16, ep=4)
    whole = mixed_ops(TINY, groups, F16)
    att = [o for o in ops if o.name == "attention" and o.layer == 0]
    att1 = [o for o in whole if o.name == "attention" and o.layer == 0]
    assert sum(o.flops for o in att) == pytest.approx(sum(o.flops for o in att1) / 4)
    emb = next(o for o in ops if o.name == "embedding")
    assert emb.act_bytes == math.ceil(36 / 4) * H * 2  # 36 tokens over 4 GPUs: 9 on the busiest


def test_fit_counts_every_gpus_sequences():
    """Each GPU holds its own sequences' cache, so the batch that fits grows ep-fold (less the expert shards'
    room): here 4 GPUs of the memory one needs for the weights plus 5 sequences."""
    per_seq = 2 * (2 * 2 * 16 * 2) * 10
    one = fit(TINY, 10**6, context=10, formats=F16, reserve_bytes=0)
    ep4 = fit(TINY, 10**6, context=10, formats=F16, reserve_bytes=0, parallel=Parallel(ep=4))
    assert one.max_batch == (10**6 - one.weight_bytes) // per_seq
    assert ep4.max_batch == 4 * ((10**6 - ep4.weight_bytes) // per_seq)


def test_bad_ep():
    with pytest.raises(KvwallError, match="--tp or --ep"):
        Parallel(tp=2, ep=2)
    with pytest.raises(KvwallError, match="ep=3 does not divide the 8 routed experts"):
        step_ops(TINY, Step(3, 0, 1), F16, ep=3)
    with pytest.raises(KvwallError, match="at least 1"):
        Parallel(ep=0)


def test_cli_ep(capsys):
    assert main(["roofline", "mixtral-8x7b", "--device", "h100", "--ep", "4", "--batch", "8", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert (data["tp"], data["ep"], data["gpus"]) == (1, 4, 4)
    names = [o["group"] for o in data["phases"][0]["decode"]["ops"]]
    assert "all-to-all dispatch" in names and "all-reduce" not in names
    assert main(["roofline", "mixtral-8x7b", "--tp", "2", "--ep", "2"]) == 2
    assert "use --tp or --ep" in capsys.readouterr().err

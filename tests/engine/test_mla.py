"""MLA (DeepSeek-V2/V3) in the engine: both decode paths, the latent cache's bytes, YaRN rope against transformers.

test_models.py also runs these families through the shared checks (full forward, cached decode with
every exact cache, greedy generation against transformers); here is what is particular to MLA.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_checkpoints import MLA, YARN, ids, transformers_greedy  # noqa: E402

from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.layers.latent import LatentAttention, set_path  # noqa: E402
from kvwall.engine.layers.latent_kernel import mla_decode  # noqa: E402
from kvwall.engine.layers.rope import attention_factor, inv_frequencies  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402
from kvwall.predict.memory import Formats, memory  # noqa: E402
from kvwall.spec.formats import get_format  # noqa: E402
from kvwall.spec.hf import spec_from_config  # noqa: E402

FAMILIES = ["deepseek_v2", "deepseek_v3"]  # v2: plain q_proj, biases, group-limited softmax; v3: q LoRA, YaRN
FP32 = Formats(get_format("fp32"), get_format("fp32"), get_format("fp32"))


def decode_token_by_token(model, x, cache):
    B, T = x.shape
    steps = [model(x[:, :5], None, cache)]
    steps += [model(x[:, t:t + 1], torch.full((B, 1), t), cache) for t in range(5, T)]
    return torch.cat(steps, 1)  # (B, T, V)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("path", ["naive", "absorbed"])
@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_each_decode_path_equals_transformers_full_forward(family, path, cache, checkpoint):
    ckpt, ref = checkpoint(family)
    model = load_model(ckpt)
    set_path(model, path)
    x = ids()
    with torch.no_grad():
        expected = ref(x).logits
        got = decode_token_by_token(model, x, make_cache(cache, model.spec, *x.shape, block_size=4))
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_absorbed_prefill_equals_naive_prefill(family, checkpoint):
    """The two paths are the same function of the same weights, for many query tokens too."""
    model = load_model(checkpoint(family)[0])
    x = ids(length=24)
    with torch.no_grad():
        set_path(model, "naive")
        naive = model(x)
        set_path(model, "absorbed")
        absorbed = model(x)
    assert (naive - absorbed).abs().max().item() < 1e-5
    assert naive.std().item() > 0.1  # logits that carry signal, not a trivially equal constant


@pytest.mark.slow
def test_auto_path_absorbs_for_decode_and_up_projects_for_prefill(checkpoint, monkeypatch):
    model = load_model(checkpoint("deepseek_v3")[0])
    calls = []
    for name in ("naive", "absorbed", "absorbed_decode"):
        original = getattr(LatentAttention, name)
        monkeypatch.setattr(LatentAttention, name,
                            lambda self, *a, _n=name, _f=original: calls.append(_n) or _f(self, *a))
    cache = make_cache("contiguous", model.spec, 1, 8)
    with torch.no_grad():
        model(ids(1, 4), None, cache)
        prefill, calls[:] = list(calls), []
        model(ids(1, 1), torch.tensor([[4]]), cache)
    decode = "absorbed_decode" if mla_decode() is not None else "absorbed"  # the C++ kernel, where it builds
    assert prefill == ["naive"] * 3 and calls == [decode] * 3


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_naive_path_equals_transformers_generate(family, checkpoint):
    """test_models.py checks the default (absorbed) decode; this is the naive one."""
    ckpt, ref = checkpoint(family)
    model = load_model(ckpt)
    set_path(model, "naive")
    prompt = ids(batch=1, length=12, seed=1)
    expected = transformers_greedy(ref, prompt)
    assert generate(model, [prompt[0].tolist()], max_new_tokens=32).tokens[0] == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_latent_cache_bytes_equal_formula_and_predictor(family, checkpoint):
    """(kv_lora_rank + qk_rope_head_dim) x layers x element size x tokens x batch, to the byte."""
    model = load_model(checkpoint(family)[0])
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (7, 12)]
    gen = generate(model, prompts, max_new_tokens=20)
    max_len = 12 + 20
    formula = (32 + 8) * 3 * 4 * max_len * 2  # latent 32 + rope key 8, 3 layers, fp32, 2 rows
    assert gen.cache.nbytes() == formula == gen.cache_bytes
    assert memory(model.spec, batch=2, context=max_len, formats=FP32).cache_bytes == formula
    per_head_kv = 4 * (16 + 8 + 16) * 3 * 4 * max_len * 2  # what caching the expanded K and V would take
    assert per_head_kv / formula == 4.0


@pytest.mark.slow
def test_paged_latent_cache_bytes_equal_predictor(checkpoint):
    model = load_model(checkpoint("deepseek_v3")[0])
    cache = make_cache("paged", model.spec, 1, 64, block_size=16)
    with torch.no_grad():
        model(ids(1, 21), None, cache)
    assert cache.nbytes() == memory(model.spec, context=21, formats=FP32, block_size=16).cache_bytes == 40 * 3 * 4 * 32


def test_yarn_rope_and_softmax_scale_equal_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    cfg = transformers.DeepseekV3Config(**MLA, q_lora_rank=24, rope_parameters=dict(YARN))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    mla = spec_from_config(cfg.to_dict()).layers[0].mixer
    assert mla.rope.kind == "yarn" and mla.rope.interleaved
    ours = inv_frequencies(mla.rope, mla.qk_rope_head_dim)
    assert torch.allclose(ours, inv_freq, rtol=1e-6, atol=0)
    assert not torch.allclose(ours, inv_frequencies(type(mla.rope)(), mla.qk_rope_head_dim))  # scaling did act
    assert attention_factor(mla.rope) == pytest.approx(factor, rel=1e-12) and abs(factor - 1) > 0.01
    assert mla.scale == pytest.approx(DeepseekV3Attention(cfg, 0).scaling, rel=1e-12)
    assert mla.scale != pytest.approx(24 ** -0.5)  # mscale_all_dim changed it


@pytest.mark.slow
def test_quantized_cache_refuses_the_latent(checkpoint):
    model = load_model(checkpoint("deepseek_v2")[0])
    with pytest.raises(KvwallError, match="MLA's latent cache"):
        make_cache("int8", model.spec, 1, 64)


@pytest.mark.slow
def test_unknown_path_is_an_error(checkpoint):
    model = load_model(checkpoint("deepseek_v2")[0])
    with pytest.raises(KvwallError, match="auto, naive, absorbed"):
        set_path(model, "fused")

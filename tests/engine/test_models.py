"""kvwall's engine against transformers on tiny random checkpoints of every family it runs."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_checkpoints import FAMILIES, WINDOW, ids, make_checkpoint, transformers_greedy  # noqa: E402

from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.layers.attention import attend, attend_reference, visible  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402

EXACT_CACHES = ["contiguous", "sliding", "paged"]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_full_forward_equals_transformers(family, checkpoint):
    path, ref = checkpoint(family)
    model = load_model(path)
    x = ids(length=3 * WINDOW)  # past the sliding window of mistral / gemma3
    with torch.no_grad():
        expected = ref(x).logits
        got = model(x)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", EXACT_CACHES)
def test_decode_with_cache_equals_full_forward(family, cache, checkpoint):
    """Prefill 5 tokens, then one token at a time past the window: every step's logits equal the full pass."""
    path, _ = checkpoint(family)
    model = load_model(path)
    x = ids(length=2 * WINDOW + 8)
    B, T = x.shape
    with torch.no_grad():
        full = model(x)  # (B, T, V)
        c = make_cache(cache, model.spec, B, T, block_size=4)
        steps = [model(x[:, :5], None, c)]
        for t in range(5, T):
            steps.append(model(x[:, t:t + 1], torch.full((B, 1), t), c))
    got = torch.cat(steps, 1)
    assert (got - full).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_32_tokens_equals_transformers_generate(family, checkpoint):
    path, ref = checkpoint(family)
    model = load_model(path)
    prompt = ids(batch=1, length=12, seed=1)
    expected = transformers_greedy(ref, prompt)
    got = generate(model, [prompt[0].tolist()], max_new_tokens=32).tokens[0]
    assert len(set(expected)) > 1, "a degenerate reference would prove little"
    assert got == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt2"])
@pytest.mark.parametrize("cache", EXACT_CACHES)
def test_batch_of_different_lengths_equals_one_by_one(family, cache, checkpoint):
    path, _ = checkpoint(family)
    model = load_model(path)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 21, 9)]
    batch = generate(model, prompts, max_new_tokens=20, cache=cache).tokens
    alone = [generate(model, [p], max_new_tokens=20, cache=cache).tokens[0] for p in prompts]
    assert batch == alone


def test_sdpa_path_equals_reference_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 16, generator=g) for h, n in ((8, 5), (2, 11), (2, 11)))
    q_pos = torch.tensor([[6, 7, 8, 9, 10], [0, 1, 2, -1, -1]])
    k_pos = torch.tensor([list(range(11)), [0, 1, 2] + [-1] * 8])
    for window in (None, 4):
        mask = visible(q_pos, k_pos, window)
        fast, ref = attend(q, k, v, mask, 0.25, None), attend_reference(q, k, v, mask, 0.25, None)
        assert (fast - ref).abs().max().item() < 1e-5
        one = (q[:, :, -1:], mask[:, :, -1:])  # decode shape: grouped-heads path
        fast, ref = attend(one[0], k, v, one[1], 0.25, None), attend_reference(one[0], k, v, one[1], 0.25, None)
        assert (fast - ref).abs().max().item() < 1e-5
    assert not visible(q_pos, k_pos, 4)[0, 0, 0, 2]  # 6 - 2 = 4: outside a 4-token window
    assert visible(q_pos, k_pos, 4)[0, 0, 0, 3]


def test_sharded_checkpoint_and_16_bit_load(tmp_path):
    ref = make_checkpoint("qwen2", tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    x = ids()
    with torch.no_grad():
        expected = ref(x).logits
        assert (load_model(tmp_path)(x) - expected).abs().max().item() < 1e-4
        bf16 = load_model(tmp_path, "bfloat16")
        assert next(bf16.parameters()).dtype == torch.bfloat16
        assert (bf16(x).float() - expected).abs().max().item() < 0.25  # bf16 keeps ~3 significant digits


def test_missing_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    make_checkpoint("llama", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KvwallError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_model(tmp_path)


def test_mismatched_shape_is_named(tmp_path):
    make_checkpoint("llama", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KvwallError, match=r"gate_proj\.weight \+ .*up_proj\.weight has shape \(256, 64\).*\(192, 64\)"):
        load_model(tmp_path)


def test_unsupported_family_lists_what_runs(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 64, "n_layer": 2, "vocab_size": 100}))  # mamba_ssm
    with pytest.raises(KvwallError, match=r"does not run model_type 'mamba_ssm'.*llama.*gemma3_text"):
        load_model(tmp_path)


def test_context_past_the_cache_is_an_error(checkpoint):
    path, _ = checkpoint("llama")
    model = load_model(path)
    cache = make_cache("contiguous", model.spec, 1, 8)
    with pytest.raises(KvwallError, match="past the contiguous cache's maximum of 8"):
        model(ids(1, 9), None, cache)
    with pytest.raises(KvwallError, match="maximum context of 512"):
        generate(model, [[1] * 500], max_new_tokens=20)

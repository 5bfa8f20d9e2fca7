"""DeepSeek Sparse Attention (deepseek_v32) in the engine, against transformers 5.25 on a tiny random checkpoint.

index_topk is 4 and the prompts run to 40 tokens, so each query past the fourth attends to 4 of its keys and the
lightning indexer's choice decides the logits (test_selection_matters shows by how much).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from engine_equivalence import (  # noqa: E402
    FP32,
    decode_logits,
    greedy_batch_alone_transformers,
    greedy_pair,
    made as made_checkpoint,
    save,
    verify_and_generate,
)
from tiny_checkpoints import MLA, YARN, ids  # noqa: E402

from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.caches.registry import as_stored, predicted_bytes  # noqa: E402
from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.layers.latent import set_path  # noqa: E402
from kvwall.engine.layers.sparse_latent import SparseLatentAttention, top_slots  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402
from kvwall.predict.memory import memory  # noqa: E402

TOPK = 4
# MLA as deepseek_v3's tiny checkpoint (latent 32, rope key 8, q LoRA 24, YaRN; dense layer 0, MoE after) plus
# the indexer: 32 index heads of 16 dims (8 of them rotated), top-4; 32 heads make a tie (every head's ReLU 0 for
# two keys, which top_slots breaks toward the later one, transformers by torch.topk's order) improbable
DSA = dict(MLA, q_lora_rank=24, rope_parameters=YARN, index_topk=TOPK, index_n_heads=32, index_head_dim=16)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(path, transformers model, engine model) of one random deepseek_v32 checkpoint, built once."""
    return made_checkpoint(tmp_path_factory, "deepseek_v32", transformers.DeepseekV32Config(**DSA))


def set_ref_topk(ref, k: int) -> None:
    for layer in ref.model.layers:
        layer.self_attn.indexer.index_topk = k


# -- the indexer alone -------------------------------------------------------------------------------------------

def test_indexer_picks_the_keys_transformers_picks(made):
    """Layer 1's indexer on random inputs: transformers' DeepseekV32Indexer (same weights) and ours pick the same
    4 keys per query, and not simply the 4 latest ones."""
    _, ref, model = made
    hf, me = ref.model.layers[1].self_attn.indexer, model.layers[1].mixer
    g = torch.Generator().manual_seed(5)
    B, T = 2, 30
    x, q_lat = torch.randn(B, T, 64, generator=g), torch.randn(B, T, 24, generator=g)
    pos = torch.arange(T).expand(B, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T)  # (B, T, S)
    with torch.no_grad():
        expected = hf(x, q_lat, ref.model.rotary_emb(x, pos), causal, pos)  # (B, T, 4)
        tables = model.rotary[model.rope_of_layer[1]](pos, x.dtype)
        iq, ik = me.indexer.project(x, q_lat)
        from kvwall.engine.layers.rope import rotate

        got = me.indexer.select(x, rotate(iq, tables), rotate(ik, tables)[:, :, 0], causal)  # (B, T, 4)
    seen = lambda top: [{s for s in row.tolist() if s <= t} for t, row in enumerate(top)]  # noqa: E731
    for b in range(B):  # transformers' first 3 queries also "pick" unseen keys (-inf), which attention masks out
        assert seen(got[b]) == seen(expected[b])
    latest = torch.arange(T)[:, None] - torch.arange(TOPK)  # (T, 4): t, t-1, t-2, t-3
    assert not torch.equal(got[:, TOPK:].sort(-1).values, latest[TOPK:].sort(-1).values.expand(B, -1, -1))


def test_top_slots_break_ties_toward_the_later_slot_whatever_the_padding():
    """Scores 0.5, 0.2 and three exact zeros (slots 1, 3, 5): the top 3 are slots 0, 2 and the latest zero, 5; 10 more
    unseen slots (-inf, a padded batch's longer S) change nothing; without ties the set is torch.topk's."""
    index = torch.tensor([[[0.5, 0.0, 0.2, 0.0, -0.1, 0.0]]])  # (1, 1, 6)
    assert top_slots(index, 3).tolist() == [[[0, 2, 5]]]
    padded = torch.cat([index, torch.full((1, 1, 10), float("-inf"))], -1)  # (1, 1, 16)
    assert top_slots(padded, 3).tolist() == [[[0, 2, 5]]]
    assert top_slots(index, 10).shape == (1, 1, 6)
    scores = torch.randn(2, 5, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(top_slots(scores, 7).sort(-1).values, scores.topk(7).indices.sort(-1).values)


# -- the model against transformers -------------------------------------------------------------------------------

def test_full_forward_equals_transformers(made):
    _, ref, model = made
    assert all(isinstance(block.mixer, SparseLatentAttention) for block in model.layers)
    x = ids(length=40)
    with torch.no_grad():
        expected, got = ref(x).logits, model(x)
    assert got.shape == expected.shape and (got - expected).abs().max().item() < 1e-4


def test_selection_matters_and_a_prompt_within_top_k_is_dense_mla(made):
    """transformers' deepseek_v3 (dense MLA) on the same weights (the indexer's left out): at 40 tokens the top-4
    logits differ from it by far more than the tolerance; at 4 tokens (every key picked) they equal it."""
    _, ref, model = made
    dense = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV3Config(
        **MLA, q_lora_rank=24, rope_parameters=YARN)).eval()
    missing, unexpected = dense.load_state_dict(ref.state_dict(), strict=False)
    assert not missing and unexpected and all(".indexer." in k for k in unexpected)
    long, short = ids(length=40), ids(length=TOPK)
    with torch.no_grad():
        assert (model(long) - dense(long).logits).abs().max().item() > 0.1
        assert (model(short) - dense(short).logits).abs().max().item() < 1e-4


def test_a_few_decode_steps_equal_transformers_full_forward(made):
    """The fast tier's decode check: prefill 5 (all picked), then 7 steps on the gathered top-4 latents."""
    _, ref, model = made
    x = ids(length=12)
    B, T = x.shape
    with torch.no_grad():
        expected = ref(x).logits
        c = make_cache("contiguous", model.spec, B, T)
        steps = [model(x[:, :5], None, c)] + [model(x[:, t:t + 1], torch.full((B, 1), t), c) for t in range(5, T)]
    assert (torch.cat(steps, 1) - expected).abs().max().item() < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("path", ["auto", "naive", "absorbed"])
@pytest.mark.parametrize("cache", ["contiguous", "sliding", "paged"])
def test_decode_step_by_step_equals_transformers_full_forward(made, cache, path):
    """Prefill 5, a chunk of 7, then one token a step: every step's logits equal transformers' one full pass.
    auto/absorbed decode gathers the 4 picked latents; naive masks the others out of the full attention."""
    ckpt, ref, _ = made
    model = load_model(ckpt)
    set_path(model, path)
    x = ids(length=40)
    with torch.no_grad():
        expected = ref(x).logits
    assert (decode_logits(model, x, cache) - expected).abs().max().item() < 1e-4


@pytest.mark.slow
def test_greedy_20_tokens_equal_transformers_generate(made):
    _, ref, model = made
    got, expected = greedy_pair(model, ref)
    assert len(set(expected)) > 1, "a degenerate reference would prove little"
    assert got == expected


@pytest.mark.slow
def test_batch_of_3_different_lengths_equals_one_by_one_and_transformers(made):
    """Right-padded rows (the engine's batches) pick and attend exactly as each prompt alone, and as transformers."""
    _, ref, model = made
    batch, alone, expected = greedy_batch_alone_transformers(model, ref)
    assert batch == alone
    assert alone == expected


@pytest.mark.slow
def test_a_padded_batch_picks_as_its_rows_alone_when_scores_tie(tmp_path):
    """With 8 index heads exact-zero scores are common (every head's ReLU 0: 2 of 9 keys for one query of this
    checkpoint); torch.topk alone broke such a tie one way at S = 9 (the row alone) and the other at S = 24 (in the
    batch), and row 0's 7th token differed. top_slots gives the later slot either way."""
    save(transformers.DeepseekV32Config(**dict(DSA, index_n_heads=8)), tmp_path)
    model = load_model(tmp_path)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 21, 9)]
    batch = generate(model, prompts, max_new_tokens=20).tokens
    assert batch == [generate(model, [p], max_new_tokens=20).tokens[0] for p in prompts]


# -- the cache: its bytes, the caches it cannot use, the fused decode stack --------------------------------------

def test_cache_bytes_equal_the_predictor_and_the_hand_count(made):
    """Per token and layer in fp32: latent 32 + rope key 8 + indexer key 16 = 56 values, 224 B; 3 layers. The
    predictor's default counts the indexer key as DeepSeek stores it, fp8 + one fp32 scale: 16 + 4 = 20 B."""
    _, _, model = made
    B, T = 2, 40
    c = make_cache("contiguous", model.spec, B, T)
    x = ids(B, T)
    with torch.no_grad():
        model(x[:, :30], None, c)
        for t in range(30, T):
            model(x[:, t:t + 1], torch.full((B, 1), t), c)
    assert c.nbytes() == B * T * 3 * (32 + 8 + 16) * 4
    assert c.nbytes() == memory(as_stored(model.spec, FP32.kv), batch=B, context=T, formats=FP32).cache_bytes
    assert c.nbytes() == predicted_bytes("contiguous", model.spec, B, T)
    assert memory(model.spec, batch=B, context=T, formats=FP32).cache_bytes == B * T * 3 * ((32 + 8) * 4 + 16 + 4)
    fp8 = make_cache("fp8", model.spec, B, T)
    assert fp8.nbytes() == B * T * 3 * (32 + 8 + 16) == predicted_bytes("fp8", model.spec, B, T)


def test_quantized_caches_refuse_it_in_one_line(made):
    spec = made[2].spec
    with pytest.raises(KvwallError, match="MLA's latent cache \\(use contiguous or paged\\)"):
        make_cache("int4", spec, 1, 16)


def test_fused_decode_stack_steps_aside(made):
    """The C++ decode stack runs attention + MLP layers only: DSA decodes layer by layer (the step tested above)."""
    from kvwall.engine.decode_stack import DecodeStack

    assert DecodeStack.build(made[2]) is None


def test_the_spec_is_dsa_on_every_layer(made):
    spec = made[2].spec
    kinds = {(layer.mixer.kind, layer.mixer.index_topk, layer.mixer.index_head_dim) for layer in spec.layers}
    assert kinds == {("sparse_latent", TOPK, 16)}
    assert [layer.ffn.kind for layer in spec.layers] == ["mlp", "moe", "moe"]
    assert replace(spec.layers[0].mixer, index_keys=FP32.kv).cache_elems_per_token() == 32 + 8 + 16
    ref, model = made[1], made[2]
    count = lambda mods: sum(p.numel() for m in mods for p in m.parameters())  # noqa: E731
    assert count(b.mixer for b in model.layers) == count(layer.self_attn for layer in ref.model.layers) \
        == sum(layer.mixer.params(spec.hidden) for layer in spec.layers)


# -- the CLI --------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_verify_and_generate_on_deepseek_v32(made, capsys):
    path, _, model = made
    verify_and_generate(path, model.spec, capsys, prompt=12,
                        context_bytes=lambda n: predicted_bytes("contiguous", model.spec, 1, n))

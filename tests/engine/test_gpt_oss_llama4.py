"""gpt-oss (attention sinks, alternating sliding / full layers, biased MoE with a clamped SwiGLU, YaRN, MXFP4 experts)
and Llama 4 text (chunked local attention, NoPE global layers with temperature tuning, weightless q/k norm, MoE
with a shared expert weighing the experts' input, dense layers between) in the engine, against transformers 5.25 on
tiny random checkpoints that transformers makes here."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_checkpoints import COMMON, ids, randomize, transformers_greedy  # noqa: E402

from kvwall.cli import main  # noqa: E402
from kvwall.engine.caches import make_cache  # noqa: E402
from kvwall.engine.caches.registry import predicted_bytes  # noqa: E402
from kvwall.engine.generate import generate, right_pad  # noqa: E402
from kvwall.engine.load import load_model  # noqa: E402
from kvwall.engine.mxfp4 import dequantize  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402

SPAN = 8  # gpt-oss's sliding window and Llama 4's attention chunk here: every test runs past it (128 / 8192 real)
BASE = dict(COMMON, num_hidden_layers=4, head_dim=16, intermediate_size=32, tie_word_embeddings=False)
# gpt-oss: layers sliding, full, sliding, full (its default layer_types); 4 experts, top-2; YaRN x4 over 128
# positions without truncation as gpt-oss's own (x32 over 4,096); swiglu_limit 1.0 (7.0 real) so the clamp bites
# on these small activations
GPT_OSS = dict(BASE, num_local_experts=4, num_experts_per_tok=2, sliding_window=SPAN, swiglu_limit=1.0,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 10000.0})
# Llama 4: layers chunked, chunked, chunked, NoPE full (no_rope_layer_interval 4); MoE on layers 1 and 3
# (interleave_moe_layer_step 2), dense MLPs of 48 on 0 and 2; top-2 of 4 experts; temperature tuning with
# floor_scale 4 (8192 real) and attn_scale 0.5 (0.1 real) so it changes q within 40 tokens
LLAMA4 = dict(BASE, intermediate_size_mlp=48, num_local_experts=4, num_experts_per_tok=2, attention_chunk_size=SPAN,
              interleave_moe_layer_step=2, floor_scale=4, attn_scale=0.5)
FAMILIES = ["gpt_oss", "llama4_text"]
CACHES = ["contiguous", "sliding", "paged"]


def config(family: str):
    return {"gpt_oss": lambda: transformers.GptOssConfig(**GPT_OSS),
            "llama4_text": lambda: transformers.Llama4TextConfig(**LLAMA4)}[family]()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """made(family) -> (path, transformers model, engine model), built once per module."""
    out = {}

    def get(family):
        if family not in out:
            path = tmp_path_factory.mktemp(family)
            cfg = config(family)
            cfg._attn_implementation = "eager"
            torch.manual_seed(0)
            ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
            randomize(ref)
            with torch.no_grad():  # sinks of order 1 (randomize gives 1-D tensors 0.1 N(0, 1)): they matter
                for name, p in ref.named_parameters():
                    if name.endswith("sinks"):
                        p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
            ref.save_pretrained(path)
            out[family] = (path, ref, load_model(path))
        return out[family]

    return get


def close(got, expected, rel: float = 1e-5) -> bool:
    """Within rel of the largest logit (the tolerance `kvwall verify` uses), as fp32 in another order allows."""
    return (got - expected).abs().max().item() < rel * max(1.0, expected.abs().max().item())


# -- the fast tier: one equivalence test per family ---------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_full_forward_equals_transformers(family, made):
    _, ref, model = made(family)
    x = ids(length=5 * SPAN)  # five windows / chunks
    with torch.no_grad():
        expected, got = ref(x).logits, model(x)
    assert got.shape == expected.shape and close(got, expected)


def _off(model, family, what):
    """Switch one mechanism off in the engine model (each test below must then fail)."""
    for block in model.layers:
        a, f = block.mixer, block.ffn
        if what == "sinks":
            a.sinks = None
        elif what == "window":
            a.window = None
        elif what == "chunk":
            a.chunk = None
        elif what == "temperature":
            a.temperature = None
        elif what == "l2 norm":
            a.l2_eps = None
        elif what == "clamp" and hasattr(f, "experts"):
            for e in f.experts:
                e.swiglu = (e.swiglu[0], 1e9)
        elif what == "weights on the input" and hasattr(f, "on_input"):
            f.on_input = False


@pytest.mark.slow
@pytest.mark.parametrize("family,what", [("gpt_oss", "sinks"), ("gpt_oss", "window"), ("gpt_oss", "clamp"),
                                         ("llama4_text", "chunk"), ("llama4_text", "temperature"),
                                         ("llama4_text", "l2 norm"), ("llama4_text", "weights on the input")])
def test_each_mechanism_matters_here(family, what, made):
    """Without it the engine is far from transformers: the equivalence tests exercise every one of them."""
    path, ref, _ = made(family)
    model = load_model(path)
    _off(model, family, what)
    x = ids(length=5 * SPAN)
    with torch.no_grad():
        expected, got = ref(x).logits, model(x)
    assert (got - expected).abs().max().item() > 1e-3


# -- decode, generation and batches --------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", CACHES)
def test_decode_step_by_step_equals_one_full_forward(family, cache, made):
    """Prefill 5, a chunk of 7 across the first window / chunk boundary (8), then one token at a time to 40: every
    step's logits equal the full pass's; the cache's bytes are the predictor's figure."""
    _, _, model = made(family)
    x = ids(length=5 * SPAN)
    B, T = x.shape
    with torch.no_grad():
        full = model(x)
        c = make_cache(cache, model.spec, B, T, block_size=4)
        steps = [model(x[:, :5], None, c), model(x[:, 5:12], torch.arange(5, 12).expand(B, 7), c)]
        steps += [model(x[:, t:t + 1], torch.full((B, 1), t), c) for t in range(12, T)]
    assert close(torch.cat(steps, 1), full)
    assert c.nbytes() == predicted_bytes(cache, model.spec, B, T, block_size=4)


@pytest.mark.parametrize("family", FAMILIES)
def test_sliding_cache_keeps_a_window_or_a_chunk_by_hand(family, made):
    """Both tiny models: 2 KV heads x 16 x (K + V) x 4 B = 256 B per token per layer. gpt-oss: 2 sliding layers keep
    8 tokens, 2 full ones all 40; Llama 4: 3 chunked layers keep one chunk of 8, the NoPE layer all 40."""
    _, _, model = made(family)
    per_token, B, T = 2 * 16 * 2 * 4, 2, 5 * SPAN
    kept = {"gpt_oss": 2 * SPAN + 2 * T, "llama4_text": 3 * SPAN + T}[family]
    assert make_cache("sliding", model.spec, B, T).nbytes() == B * kept * per_token
    assert predicted_bytes("sliding", model.spec, B, T) == B * kept * per_token


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", ["contiguous", "sliding"])
def test_greedy_20_tokens_equal_transformers_generate(family, cache, made):
    """A 12-token prompt and 20 new tokens: past the window / chunk of 8 and across two chunk boundaries."""
    _, ref, model = made(family)
    prompt = ids(batch=1, length=12, seed=1)
    expected = transformers_greedy(ref, prompt, new_tokens=20)
    got = generate(model, [prompt[0].tolist()], max_new_tokens=20, cache=cache).tokens[0]
    assert len(set(expected)) > 1, "a degenerate reference would prove little"
    assert got == expected


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", CACHES)
def test_batch_of_3_different_lengths(family, cache, made):
    """Prompts of 3, 21 and 13 tokens right-padded in one batch: each row's logits equal transformers' on that
    prompt alone, and 20 greedy tokens of the batch equal each prompt's own."""
    _, ref, model = made(family)
    prompts = [ids(1, n, seed=n)[0].tolist() for n in (3, 21, 13)]
    tokens, pos = right_pad(prompts)
    with torch.no_grad():
        got = model(tokens, pos)  # (3, 21, V)
        for b, p in enumerate(prompts):
            assert close(got[b, :len(p)], ref(torch.tensor([p])).logits[0])
    batch = generate(model, prompts, max_new_tokens=20, cache=cache).tokens
    alone = [generate(model, [p], max_new_tokens=20, cache=cache).tokens[0] for p in prompts]
    assert batch == alone


@pytest.mark.slow
def test_what_if_window_replaces_the_chunk(made):
    """sliding:4 on Llama 4: the chunked layers become 4-token windows (registry.sliding_spec), decode through the
    ring equals a full pass of the model so re-windowed (every chunk dropped for the window)."""
    from dataclasses import replace

    from kvwall.engine.caches.base import NoCache

    _, _, model = made("llama4_text")
    x = ids(length=3 * SPAN)
    B, T = x.shape
    with torch.no_grad():
        c = make_cache("sliding:4", model.spec, B, T)
        steps = [model(x[:, :5], None, c)] + [model(x[:, t:t + 1], torch.full((B, 1), t), c) for t in range(5, T)]
        for block in model.layers:  # the same model with 4-token windows where its chunks were
            block.mixer.chunk, block.mixer.window = None, 4 if block.mixer.chunk else None
        try:
            full = model(x, None, NoCache())
        finally:
            for block, layer in zip(model.layers, model.spec.layers):
                block.mixer.chunk, block.mixer.window = layer.mixer.chunk, layer.mixer.window
    assert close(torch.cat(steps, 1), full)
    rewindowed = replace(model.spec, layers=tuple(replace(layer, mixer=replace(layer.mixer, chunk=None, window=4))
                                                  if layer.mixer.chunk else layer for layer in model.spec.layers))
    assert c.nbytes() == predicted_bytes("sliding", rewindowed, B, T)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_what_if_window_with_streaming_sinks(family, made):
    """sliding:4:sink2: every local layer (gpt-oss's sliding ones, Llama 4's chunked ones) sees the last 4 positions
    and the first 2; decode through the cache equals a full pass whose mask is written out here (j <= i and
    (i - j < 4 or j < 2) on those layers, j <= i on the others), gpt-oss's learned sinks joining the softmax."""
    from kvwall.engine.caches.base import NoCache
    from kvwall.engine.layers.attention import attend_reference

    local = [bool(layer.mixer.window or layer.mixer.chunk) for layer in made(family)[2].spec.layers]

    class Written(NoCache):
        def attend_masked(self, layer, q, k, v, pos, scale, window, chunk, sinks, sink=0):
            i, j = torch.arange(q.shape[2])[:, None], torch.arange(q.shape[2])[None]
            mask = (j <= i) & (((i - j) < 4) | (j < 2) | (not local[layer]))  # (T, T)
            return attend_reference(q, k, v, mask, scale, None, sinks)

    _, _, model = made(family)
    x = ids(length=3 * SPAN)
    B, T = x.shape
    with torch.no_grad():
        c = make_cache("sliding:4:sink2", model.spec, B, T)
        steps = [model(x[:, :5], None, c)] + [model(x[:, t:t + 1], torch.full((B, 1), t), c) for t in range(5, T)]
        saved = [(b.mixer.window, b.mixer.chunk) for b in model.layers]
        for b in model.layers:  # every layer through attend_masked
            b.mixer.window, b.mixer.chunk = None, 10 ** 9
        try:
            full = model(x, None, Written())
        finally:
            for b, (w, ch) in zip(model.layers, saved):
                b.mixer.window, b.mixer.chunk = w, ch
    assert close(torch.cat(steps, 1), full)
    plain = make_cache("sliding:4", model.spec, B, T)
    with torch.no_grad():
        alone = [model(x[:, :5], None, plain)] + [model(x[:, t:t + 1], torch.full((B, 1), t), plain)
                                                   for t in range(5, T)]
    assert (torch.cat(alone, 1) - full).abs().max().item() > 1e-3  # the two sink slots are seen


# -- MXFP4 experts ---------------------------------------------------------------------------------------------------

def test_mxfp4_dequantizes_a_hand_made_block():
    """One row of 32 values: byte i holds value 2i (low nibble) and 2i + 1 (high nibble); e2m1 codes 1 = 0.5,
    2 = 1.0, 9 = -0.5, 15 = -6.0; exponent byte 128 = x 2^(128 - 127) = x 2. Out transposed: (32, 1)."""
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)  # (rows 1, groups 1, 16 bytes)
    blocks[0, 0, 0], blocks[0, 0, 1], blocks[0, 0, 15] = 0x21, 0xF9, 0x70
    w = dequantize(blocks, torch.tensor([[128]], dtype=torch.uint8))
    expected = torch.zeros(32)
    expected[[0, 1, 2, 3, 31]] = torch.tensor([0.5, 1.0, -0.5, -6.0, 6.0]) * 2  # 0x70: low 0 (0.0), high 7 (6.0)
    assert w.shape == (32, 1) and torch.equal(w[:, 0], expected)
    assert torch.equal(dequantize(blocks, torch.tensor([[125]], dtype=torch.uint8))[:, 0], expected / 8)


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A test-side MXFP4 quantizer (round to nearest e2m1 after a power-of-two scale making the block's largest
    |value| at most 6): w (E, in, out) -> blocks (E, out, in/32, 16), scales (E, out, in/32), gpt-oss's layout."""
    rows = w.transpose(1, 2).contiguous()  # (E, out, in)
    E, R, C = rows.shape
    g = rows.view(E, R, C // 32, 32)
    exp = torch.ceil(torch.log2(g.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)  # (E, R, C/32)
    x = g / torch.exp2(exp)[..., None]
    magnitude = (x.abs()[..., None] - torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6])).abs().argmin(-1)
    code = (magnitude | ((x < 0).long() << 3)).to(torch.uint8)  # (E, R, C/32, 32)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8), (exp + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(made, tmp_path_factory):
    """The tiny gpt-oss with its experts' gate_up_proj and down_proj as MXFP4 blocks + scales, and config.json's
    quantization_config as gpt-oss's (quant_method mxfp4)."""
    from safetensors.torch import load_file, save_file

    src, _, _ = made("gpt_oss")
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    shutil.copytree(src, path, dirs_exist_ok=True)
    state = load_file(src / "model.safetensors")
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        state[name + "_blocks"], state[name + "_scales"] = mxfp4(state.pop(name))
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.slow
def test_mxfp4_experts_load_equal_to_transformers(mxfp4_checkpoint, made):
    """transformers 5.25 dequantizes the same checkpoint itself on a CPU (no Triton): kvwall's logits equal its
    logits, and differ from the unquantized model's (the 4-bit rounding is there to see)."""
    _, _, unquantized = made("gpt_oss")
    ref = transformers.AutoModelForCausalLM.from_pretrained(mxfp4_checkpoint, dtype=torch.float32).eval()
    model = load_model(mxfp4_checkpoint)
    x = ids(length=3 * SPAN)
    with torch.no_grad():
        expected, got = ref(x).logits, model(x)
        assert close(got, expected)
        assert (got - unquantized(x)).abs().max().item() > 1e-2


def test_mxfp4_blocks_and_scales_that_do_not_pair_are_named(mxfp4_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    shutil.copytree(mxfp4_checkpoint, tmp_path, dirs_exist_ok=True)
    state = load_file(mxfp4_checkpoint / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj_scales"
    state[name] = state[name][:, :, :0]  # no scales at all
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(KvwallError, match="down_proj: blocks .* are not MXFP4"):
        load_model(tmp_path)


# -- the CLI ---------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_kvwall_verify_passes(family, made, capsys):
    path, _, _ = made(family)
    assert main(["verify", str(path), "--json", "--prompt-ids", ",".join(map(str, range(1, 3 * SPAN)))]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pass"] and out["tokens"] == 3 * SPAN - 1


# -- the two rules by hand -------------------------------------------------------------------------------------------

def test_a_sink_takes_its_share_of_the_softmax():
    """One head, two keys both scoring 0, a sink logit ln 2: the softmax over (0, 0, ln 2) is (1/4, 1/4, 1/2) and the
    sink's half is dropped, so the output is (v1 + v2) / 4, not the plain softmax's (v1 + v2) / 2."""
    from kvwall.engine.layers.attention import attend_reference

    q, k = torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 2, 2)  # (B, H, T, D), (B, H, S, D)
    v = torch.tensor([[[[4.0, 0.0], [0.0, 8.0]]]])  # (B, H, S, Dv)
    y = attend_reference(q, k, v, None, 1.0, None, torch.tensor([0.6931471805599453]))
    assert torch.allclose(y, torch.tensor([[[[1.0, 2.0]]]]))


@pytest.mark.parametrize("T,S", [(1, 37), (6, 6), (5, 40)])
def test_grouped_sinks_path_equals_the_reference(T, S):
    """attend_sinks (K/V not repeated per query head) against attend_reference's repeat and concatenation: 8 query
    heads on 2 KV heads, a mask with a window, random sinks; both in fp32 (the reference always is), within 1e-5."""
    from kvwall.engine.layers.attention import attend_reference, attend_sinks, visible

    g = torch.Generator().manual_seed(T)
    q = torch.randn(3, 8, T, 16, generator=g)  # (B, Hq, T, D)
    k, v = (torch.randn(3, 2, S, 16, generator=g) for _ in range(2))  # (B, Hkv, S, D)
    sinks = torch.randn(8, generator=g)
    mask = visible(torch.arange(S - T, S).expand(3, T), torch.arange(S)[None], 5)  # (B, 1, T, S)
    got, expected = attend_sinks(q, k, v, mask, 0.25, sinks), attend_reference(q, k, v, mask, 0.25, None, sinks)
    assert got.shape == expected.shape and (got - expected).abs().max().item() < 1e-5


def test_a_chunked_query_sees_only_its_own_chunk():
    """Chunks of 4: the query at 5 sees 4 and 5 (not 0-3, not 6); at 3 it sees 0-3. With a window of 2 as well,
    the query at 5 still sees 4 and 5, the one at 4 only itself (its chunk starts there, 3 is in the window)."""
    from kvwall.engine.layers.attention import visible

    pos = torch.arange(8)[None]  # (1, 8)
    m = visible(pos, pos, None, 0, 4)[0, 0]  # (T, S)
    assert m[5].nonzero().flatten().tolist() == [4, 5] and m[3].nonzero().flatten().tolist() == [0, 1, 2, 3]
    assert visible(pos, pos, 2, 0, 4)[0, 0, 5].nonzero().flatten().tolist() == [4, 5]
    assert visible(pos, pos, 2, 0, 4)[0, 0, 4].nonzero().flatten().tolist() == [4]


# -- Llama 4 as its multimodal checkpoint: the text decoder under language_model.* -------------------------------------

@pytest.mark.slow
def test_multimodal_llama4_runs_its_text_decoder(tmp_path, capsys):
    """A Llama4ForConditionalGeneration checkpoint (a one-layer vision tower beside the tiny text model): kvwall
    runs its text decoder, equal to transformers on text-only input, and `kvwall verify` passes on it."""
    vision = transformers.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=64, image_size=28, patch_size=14, vision_output_dim=32,
                                             projector_input_dim=32, projector_output_dim=32)
    cfg = transformers.Llama4Config(text_config=config("llama4_text").to_dict(), vision_config=vision.to_dict())
    cfg._attn_implementation = cfg.text_config._attn_implementation = "eager"
    torch.manual_seed(0)
    ref = transformers.Llama4ForConditionalGeneration(cfg).eval()
    randomize(ref)
    ref.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    x = ids(length=3 * SPAN)
    with torch.no_grad():
        assert close(model(x), ref(input_ids=x).logits)
    assert main(["verify", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["pass"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b", "llama-4-scout-17b-16e", "llama-4-maverick-17b-128e"])
def test_real_configs_build_with_every_tensor_named(name):
    """The catalog's real configs built on the meta device: the checkpoint layout names every engine parameter, and
    the engine holds the predictor's parameter count (held to transformers' own meta-device count by
    tests/spec/test_params.py), less Llama 4's vision tower, which the engine does not build."""
    from kvwall.engine.load import LAYOUTS
    from kvwall.engine.model import Transformer
    from kvwall.spec.families import family
    from kvwall.spec.resolve import load_spec

    spec = load_spec(name)
    with torch.device("meta"):
        model = Transformer(spec)
    assert set(LAYOUTS[family(spec.model_type).layout](spec)) == set(dict(model.named_parameters()))
    assert sum(p.numel() for p in model.parameters()) == spec.params() - spec.extra_params

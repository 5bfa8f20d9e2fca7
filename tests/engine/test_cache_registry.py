"""The cache registry: one entry per strategy drives the CLI's names, make_cache and the predicted bytes."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources

import pytest

from kvwall.engine import CACHE_NAMES
from kvwall.engine.caches.registry import CACHES, CacheChoice, parse_cache, predicted_bytes
from kvwall.errors import KvwallError
from kvwall.spec.model import (
    MLP,
    Attention,
    GatedDeltaNet,
    LatentAttention,
    Layer,
    Mamba,
    Mamba2,
    ModelSpec,
    ParallelHybrid,
    ShortConv,
)


@pytest.mark.parametrize("text,name,options", [
    ("contiguous", "contiguous", ()), ("paged", "paged", ()), ("int8:g32", "int8", ("g32",)),
    ("int4:sym", "int4", ("sym",)), ("int4:g64:sym", "int4", ("g64", "sym")), ("int2", "int2", ()),
])
def test_parse_cache_accepts_names_and_format_options(text, name, options):
    choice = parse_cache(text)
    assert choice == CacheChoice(name, options) and choice.text == text


@pytest.mark.parametrize("text,message", [
    ("contiguous:junk", "contiguous takes no options"), ("paged:xyz", "paged takes no options"),
    ("int4:g0", "option 'g0' not understood"), ("int8:gx", "option 'gx' not understood"),
    ("int9", "unknown cache 'int9'; caches: contiguous, sliding, fp8, int8, int4, int2, paged"),
    ("int4:g32:g64", "given twice"), ("", "unknown cache ''"),
])
def test_parse_cache_rejects_what_it_does_not_know(text, message):
    with pytest.raises(KvwallError, match=message):
        parse_cache(text)


def test_quantized_choices_name_their_storage_format():
    assert parse_cache("int4:g64:sym").format == "int4:g64:sym"
    assert parse_cache("paged").format is None


def test_cache_names_are_the_registry_and_import_without_torch():
    assert CACHE_NAMES == tuple(CACHES) == ("contiguous", "sliding", "fp8", "int8", "int4", "int2", "paged")
    code = "import sys, kvwall.engine.caches.registry, kvwall.engine; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_kernel_sources_are_package_files():
    kernels = resources.files("kvwall.engine") / "kernels"
    names = {p.name for p in kernels.iterdir()}
    assert {"common.h", "selective_scan.cpp", "quantized_decode.cpp", "mla_decode.cpp", "paged_decode.cpp",
            "fused_ops.cpp"} <= names
    for name, function in [("selective_scan", "selective_scan"), ("quantized_decode", "quantized_decode"),
                           ("mla_decode", "mla_decode"), ("paged_decode", "paged_decode"),
                           ("fused_ops", "add_rms_norm"), ("fused_ops", "silu_mul")]:
        text = (kernels / f"{name}.cpp").read_text()
        assert includes_common(kernels, f"{name}.cpp") and f'm.def("{function}"' in text


def includes_common(kernels, name: str) -> bool:
    """Whether kernels/<name> includes common.h, itself or through the package's own headers (quant_unpack.h ...)."""
    seen, todo = set(), [name]
    while todo:
        text = (kernels / todo.pop()).read_text()
        for line in text.splitlines():
            if line.startswith('#include "'):
                header = line.split('"')[1]
                if header == "common.h":
                    return True
                if header not in seen:
                    seen.add(header)
                    todo.append(header)
    return False


# -- every entry builds through make_cache, and its bytes are the registry's predicted figure ----------------

def attention_spec():
    """GQA with a local layer (window 8) between two global ones: 4 query heads, 2 KV heads of 16."""
    return ModelSpec("t", "llama", 32, 50, tuple(Layer(Attention(4, 2, 16, 16, w), MLP(32)) for w in (None, 8, None)))


def latent_spec():
    """Two MLA layers: latent 24 wide, rope key 8 wide."""
    return ModelSpec("t", "deepseek_v2", 32, 50, tuple(Layer(LatentAttention(4, 24, None, 16, 8, 16), MLP(32))
                                                     for _ in range(2)))


def hybrid_spec():
    """Mamba (d_inner 64, d_state 8, d_conv 4), attention, Mamba."""
    mamba = Mamba(64, 8, 4, 4)
    layers = (Layer(mamba, MLP(32)), Layer(Attention(4, 2, 16, 16), MLP(32)), Layer(mamba, MLP(32)))
    return ModelSpec("t", "jamba", 32, 50, layers)


def fill(cache, spec, batch: int, tokens: int, chunk: int = 5):
    """Write `tokens` random tokens per row, `chunk` at a time, into every layer's KV cache."""
    import torch

    from kvwall.engine.caches.base import attention_specs

    g = torch.Generator().manual_seed(0)
    layouts = attention_specs(spec)
    for start in range(0, tokens, chunk):
        pos = torch.arange(start, min(tokens, start + chunk)).expand(batch, -1)  # (B, T)
        cache.step(pos)
        for i, a in enumerate(layouts):
            if a is not None:
                k = torch.randn(batch, a.n_kv_heads, pos.shape[1], a.head_dim, generator=g)  # (B, Hkv, T, D)
                v = torch.randn(batch, a.n_kv_heads, pos.shape[1], a.v_head_dim, generator=g)  # (B, Hkv, T, Dv)
                cache.update(i, k, v, pos)


def gated_deltanet_spec():
    """Gated DeltaNet (2 key heads x 8, 4 value heads x 12, conv 4), gated attention, Gated DeltaNet (Qwen3-Next)."""
    gdn = GatedDeltaNet(2, 4, 8, 12, 4)
    layers = (Layer(gdn, MLP(32)), Layer(Attention(4, 2, 16, 16, output_gate=True), MLP(32)), Layer(gdn, MLP(32)))
    return ModelSpec("t", "qwen3_next", 32, 50, layers)


def chunked_spec():
    """Llama 4 and gpt-oss alike: a chunked layer (chunk 8), a global one, a sliding one (window 8) with sinks."""
    layers = (Layer(Attention(4, 2, 16, 16, chunk=8), MLP(32)), Layer(Attention(4, 2, 16, 16), MLP(32)),
              Layer(Attention(4, 2, 16, 16, 8, sinks=True), MLP(32)))
    return ModelSpec("t", "llama4_text", 32, 50, layers)


CASES = [(name, spec, tokens) for name in CACHE_NAMES
         for spec in (attention_spec, hybrid_spec, gated_deltanet_spec, chunked_spec) for tokens in (5, 41, 100)]
CASES += [(name, latent_spec, 41) for name in ("contiguous", "sliding", "paged")]  # quantized: not for MLA


def sparse_latent_spec():
    """Two DSA layers (DeepSeek-V3.2): MLA's latent 24 + rope key 8, and the indexer's key of 16 per token."""
    from kvwall.spec.model import SparseLatentAttention

    dsa = SparseLatentAttention(LatentAttention(4, 24, 12, 16, 8, 16), 4, 16, 4)
    return ModelSpec("t", "deepseek_v32", 32, 50, tuple(Layer(dsa, MLP(32)) for _ in range(2)))


CASES += [(name, sparse_latent_spec, 41) for name in ("contiguous", "sliding", "fp8", "paged")]  # quantized: refused


def kimi_linear_spec():
    """Kimi Linear: KDA (4 heads x 8, conv 4), NoPE MLA (latent 24, unrotated shared key 8), KDA."""
    from kvwall.spec.model import KimiDeltaAttention

    kda = KimiDeltaAttention(4, 8, 4)
    layers = (Layer(kda, MLP(32)), Layer(LatentAttention(4, 24, None, 16, 8, 16), MLP(32)), Layer(kda, MLP(32)))
    return ModelSpec("t", "kimi_linear", 32, 50, layers)


def minimax_spec():
    """MiniMax: softmax GQA (4 q / 2 kv heads of 16), lightning attention (4 heads x 16), softmax GQA."""
    from kvwall.spec.model import LightningAttention

    attn = Attention(4, 2, 16, 16)
    layers = (Layer(attn, MLP(32)), Layer(LightningAttention(4, 16), MLP(32)), Layer(attn, MLP(32)))
    return ModelSpec("t", "minimax", 32, 50, layers)


CASES += [(name, kimi_linear_spec, 41) for name in ("contiguous", "sliding", "paged")]  # quantized: not for MLA
CASES += [(name, minimax_spec, tokens) for name in CACHE_NAMES for tokens in (5, 100)]
CASES += [("int4:g8:sym", attention_spec, 100), ("int8:g16", hybrid_spec, 41)]


def short_conv_spec():
    """LFM2: short convolution (32 channels x 3 taps), attention, short convolution."""
    conv = ShortConv(32, 3)
    layers = (Layer(conv, MLP(32)), Layer(Attention(4, 2, 16, 16), MLP(32)), Layer(conv, MLP(32)))
    return ModelSpec("t", "lfm2", 32, 50, layers)


def mamba2_hybrid_spec():
    """Granite 4.0-H: Mamba-2 (4 heads x 8, 2 groups of state 8, conv 4), attention, Mamba-2."""
    m2 = Mamba2(4, 8, 8, 2, 4)
    layers = (Layer(m2, MLP(32)), Layer(Attention(4, 2, 16, 16), MLP(32)), Layer(m2, MLP(32)))
    return ModelSpec("t", "granitemoehybrid", 32, 50, layers)


def parallel_hybrid_spec():
    """Falcon-H1: each of 2 layers attention (4 query, 2 KV heads of 16) || Mamba-2 (4 heads x 8, state 8, conv 4)."""
    both = ParallelHybrid(Attention(4, 2, 16, 16), Mamba2(4, 8, 8, 1, 4))
    return ModelSpec("t", "falcon_h1", 32, 50, (Layer(both, MLP(32)),) * 2)


# issue #42's mixers: a state beside the K/V (short conv, Mamba-2), and both in one layer (parallel hybrid)
CASES += [(name, spec, tokens) for name in CACHE_NAMES
          for spec in (short_conv_spec, mamba2_hybrid_spec, parallel_hybrid_spec) for tokens in (5, 41)]
CASES += [(name, spec, 41) for name in ("sliding:8", "sliding:8:sink2")  # what-if windows reach a parallel layer
          for spec in (short_conv_spec, parallel_hybrid_spec)]


@pytest.mark.slow
@pytest.mark.parametrize("name,make_spec,tokens", CASES)
def test_every_registry_entry_builds_and_its_bytes_are_the_predicted_figure(name, make_spec, tokens):
    pytest.importorskip("torch")
    from kvwall.engine.caches import make_cache

    spec, batch = make_spec(), 2
    cache = make_cache(name, spec, batch, tokens, block_size=4, residual=8)
    fill(cache, spec, batch, tokens)
    assert cache.nbytes() == predicted_bytes(name, spec, batch, tokens, block_size=4, residual=8) > 0


def test_predicted_figures_by_hand():
    """Contiguous: 2 rows x 100 tokens x 3 layers x (K + V) x 2 heads x 16 x 4 B; sliding: the local layer
    keeps 8; paged (blocks of 16): 41 tokens take 3 blocks = 48 slots; int8:g32 (residual 8): 32 tokens
    quantized (keys: 2 heads x 16 channels x one 32-byte chunk + fp16 scale and zero; values: 32 tokens x
    2 heads x (16 B + 4 B)), 9 in fp32."""
    spec = attention_spec()
    per_token = 2 * 2 * 16 * 4  # K and V of one layer, one token, fp32
    assert predicted_bytes("contiguous", spec, 2, 100) == 2 * 100 * 3 * per_token
    assert predicted_bytes("sliding", spec, 2, 100) == 2 * (100 + 8 + 100) * per_token
    assert predicted_bytes("paged", spec, 2, 41, block_size=16) == 2 * 48 * 3 * per_token
    quantized = 2 * 16 * (32 + 4) + 32 * 2 * (16 + 4)
    assert predicted_bytes("int8:g32", spec, 2, 41, residual=8) == 2 * 3 * (quantized + 9 * per_token)

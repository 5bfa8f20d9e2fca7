"""Mamba decode ms/token at several contexts (flat: a fixed state) against transformers' torch path,
and the prefill scan's tokens/s against the plain sequential loop.

    .venv/bin/python benchmarks/bench_mamba.py [--steps 8] [--contexts 128,2048,8192] [--threads 1]

Model: MambaConfig hidden 1024, 24 layers, d_state 16, expand 2 (d_inner 2048), vocab 32000, tied
embeddings, fp32, random weights (~190M parameters), saved once with transformers and loaded by each.

Decode: kvwall prefills `context` tokens with its fast scan (in pieces of 2048; the prefill rate is
reported too); transformers' cache gets a copy of that very state (conv + SSM state per layer), so
both decode from the same point; their next-token logits are compared before timing. Each step is
timed alone; the table reports medians. Bytes per step: all weights + the state (read and written).

Scan: the first layer's real inputs for 2048 tokens (u, Δ, B, C from its in_proj, conv and x_proj),
run through scan_reference (one token at a time), scan_chunked (kvwall's prefill path) and
transformers' torch fallback (mamba_selective_scan, no CUDA kernels); medians of --scan-runs.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import transformers
from transformers import DynamicCache
from transformers.models.mamba import modeling_mamba

from kvwall.engine.caches import make_cache
from kvwall.engine.layers.mamba import causal_conv, scan_chunked, scan_reference
from kvwall.engine.layers.scan_kernel import fused_scan
from kvwall.engine.load import load_model

from timing import median_ms  # benchmarks/timing.py (the script folder is on sys.path)

CONFIG = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=24, state_size=16, expand=2, conv_kernel=4,
              tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
PIECE = 2048


@torch.inference_mode()
def prefill(model, tokens: torch.Tensor, cache) -> tuple[torch.Tensor, float]:
    """tokens (1, T) through kvwall in pieces -> last logits (1, V), seconds."""
    t0 = time.perf_counter()
    for s in range(0, tokens.shape[1], PIECE):
        piece = tokens[:, s:s + PIECE]
        logits = model(piece, torch.arange(s, s + piece.shape[1])[None], cache, last_only=True)
    return logits[:, -1], time.perf_counter() - t0


@torch.inference_mode()
def transformers_cache_from(ref, cache, tok: torch.Tensor):
    """A transformers cache holding kvwall's state: initialise it with one step, then overwrite the state."""
    hf = DynamicCache(config=ref.config)
    ref(tok, cache=hf, use_cache=True)
    for i, layer in enumerate(hf.layers):
        ours = cache.ssm(i)
        assert layer.conv_states[0].shape == ours.conv.shape and layer.recurrent_states[0].shape == ours.ssm.shape
        layer.conv_states[0].copy_(ours.conv)
        layer.recurrent_states[0].copy_(ours.ssm)
    return hf


@torch.inference_mode()
def bench_decode(mine, ref, context: int, steps: int, g) -> tuple[float, float, float, float]:
    """-> (kvwall ms, transformers ms, prefill tok/s, max |logit difference| on the first step)."""
    tokens = torch.randint(0, CONFIG["vocab_size"], (1, context + 1), generator=g)
    cache = make_cache("contiguous", mine.spec, 1, context + steps + 8)
    _, seconds = prefill(mine, tokens[:, :context], cache)
    hf = transformers_cache_from(ref, cache, tokens[:, :1])
    tok = tokens[:, context:]
    expected = ref(tok, cache=hf, use_cache=True).logits[:, -1]
    got = mine(tok, torch.tensor([[context]]), cache)[:, -1]
    pos = {"p": context + 1}

    def step_mine():
        mine(tok, torch.tensor([[pos["p"]]]), cache)
        pos["p"] += 1

    ms_k = median_ms(step_mine, steps)
    ms_t = median_ms(lambda: ref(tok, cache=hf, use_cache=True), steps)
    return ms_k, ms_t, context / seconds, (got - expected).abs().max().item()


@torch.inference_mode()
def scan_inputs(mine, T: int, g):
    """The first layer's real scan inputs for T random tokens."""
    block = mine.layers[0]
    x = block.mixer_norm(mine.embed(torch.randint(0, CONFIG["vocab_size"], (1, T), generator=g)))  # (1, T, D)
    m = block.mixer
    state = make_cache("contiguous", mine.spec, 1, T).ssm(0)
    u, _ = m.in_proj(x).chunk(2, dim=-1)  # (1, T, E)
    u = torch.nn.functional.silu(causal_conv(u, state.conv, m.conv1d, torch.tensor([T])))
    dt, Bm, Cm = m.selection(u, torch.ones(1, T, dtype=torch.bool))
    return u.float(), dt, -torch.exp(m.A_log.float()), Bm, Cm, torch.zeros(1, u.shape[-1], Bm.shape[-1])


@torch.inference_mode()
def bench_scan(mine, T: int, runs: int, g) -> dict[str, float]:
    """tokens/s of each scan at T tokens, and the fast scan's largest difference from the reference (relative)."""
    u, dt, A, Bm, Cm, h0 = scan_inputs(mine, T, g)
    hf_scan = lambda: modeling_mamba.mamba_selective_scan(  # noqa: E731
        u.transpose(1, 2), dt.transpose(1, 2), A, Bm.transpose(1, 2), Cm.transpose(1, 2), use_associative_scan=False)
    fused = fused_scan()
    assert fused is not None, "the fused scan did not build (no C++ compiler or ninja?)"
    out = {}
    for name, fn in [("reference", lambda: scan_reference(u, dt, A, Bm, Cm, h0)),
                     ("chunked", lambda: scan_chunked(u, dt, A, Bm, Cm, h0)),
                     ("fused", lambda: fused(u, dt, A, Bm, Cm, h0)), ("transformers", hf_scan)]:
        out[name] = T / (median_ms(fn, runs, warmup=1) / 1e3)
    y_ref = scan_reference(u, dt, A, Bm, Cm, h0)[0]  # (1, T, E)
    err = (fused(u, dt, A, Bm, Cm, h0)[0] - y_ref).abs().max().item() / y_ref.abs().max().item()
    return out | {"max_diff": err}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--contexts", default="128,2048,8192")
    ap.add_argument("--scan-tokens", type=int, default=2048)
    ap.add_argument("--scan-runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as d:
        transformers.MambaForCausalLM(transformers.MambaConfig(**CONFIG)).save_pretrained(d)
        ref = transformers.MambaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        mine = load_model(d)
    params = sum(p.numel() for p in mine.parameters())
    state = make_cache("contiguous", mine.spec, 1, 8).nbytes()
    print(f"model: {params / 1e6:.1f}M parameters, fp32 ({params * 4 / 2**20:.0f} MiB), state {state / 2**10:.0f} KiB "
          f"per sequence; torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads; "
          f"median of {args.steps} steps")
    print("| context | kvwall ms/tok | transformers ms/tok | speedup | kvwall GB/s | kvwall prefill tok/s | "
          "max logit diff |")
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    prefill(mine, torch.ones(1, 64, dtype=torch.long), make_cache("contiguous", mine.spec, 1, 64))  # warm-up
    for context in map(int, args.contexts.split(",")):
        ms_k, ms_t, tok_s, diff = bench_decode(mine, ref, context, args.steps, g)
        gbs = (params * 4 + 2 * state) / (ms_k / 1e3) / 1e9
        print(f"| {context} | {ms_k:.1f} | {ms_t:.1f} | {ms_t / ms_k:.2f}x | {gbs:.1f} | {tok_s:.0f} | {diff:.1e} |",
              flush=True)
    s = bench_scan(mine, args.scan_tokens, args.scan_runs, g)
    print(f"\nselective scan of one layer (d_inner 2048, d_state 16), {args.scan_tokens} tokens, tokens/s:")
    print("| sequential reference | kvwall chunked (torch) | kvwall fused (C++, the prefill path) | "
          "transformers torch path | fused / reference | fused max diff / max abs y |")
    print("|---|---|---|---|---|---|")
    print(f"| {s['reference']:.0f} | {s['chunked']:.0f} | {s['fused']:.0f} | {s['transformers']:.0f} | "
          f"{s['fused'] / s['reference']:.2f}x | {s['max_diff']:.1e} |")


if __name__ == "__main__":
    main()

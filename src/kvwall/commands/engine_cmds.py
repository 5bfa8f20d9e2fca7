"""`kvwall verify | generate`: run a checkpoint with kvwall's engine (torch is imported only here, lazily)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvwall.commands import common
from kvwall.engine import CACHE_NAMES as CACHES
from kvwall.engine.caches.registry import parse_cache
from kvwall.errors import KvwallError
from kvwall.spec.gguf_meta import INSTALL_HINT, PACKAGED
from kvwall.units import fmt_bytes, ids_arg, real, whole

CHECKPOINT_HELP = ("directory with config.json and safetensors weights, a .gguf file, or "
                   f"{' / '.join(PACKAGED)} ({INSTALL_HINT})")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="load a checkpoint with kvwall and transformers; compare their logits")
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    p.add_argument("--prompt-ids", type=ids_arg, metavar="IDS",
                   help="comma-separated token ids (default: 32 seeded random ids)")
    p.add_argument("--tolerance", type=real(0), default=1e-5,
                   help="largest logit difference that passes, relative to the largest |logit| of transformers' "
                        "(at least 1; default 1e-5: fp32 sums in another order differ by a few 1e-6 of the "
                        "logits' scale)")
    common.add_json(p)
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("generate", help="generate text (or ids) with kvwall's engine; report tok/s and cache bytes")
    p.add_argument("checkpoint", help=CHECKPOINT_HELP)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text (needs the checkpoint's tokenizer.json or a .gguf's tokenizer)")
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as one user message through the model's chat template (a .gguf's)")
    src.add_argument("--prompt-ids", type=ids_arg, metavar="IDS", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=whole(1, 1 << 24), default=32, metavar="N", help="default 32")
    p.add_argument("--cache", default="contiguous", help=f"KV cache: {', '.join(CACHES)} (default contiguous)")
    p.add_argument("--block-size", type=whole(1, 1 << 20), default=16, help="paged cache block size (default 16)")
    p.add_argument("--residual", type=whole(0, 1 << 24), default=32,
                   help="quantized caches: newest tokens kept in full precision")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    common.add_weights(p)
    p.add_argument("--temperature", type=real(0), default=0.0, help="0 is greedy (default)")
    p.add_argument("--top-k", type=whole(1))
    p.add_argument("--top-p", type=real(0, 1, lo_open=True))
    p.add_argument("--seed", type=whole(0, 2**63 - 1))
    common.add_threads(p)
    common.add_json(p)
    p.set_defaults(func=cmd_generate)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise KvwallError(f"--prompt-ids {text!r}: give comma-separated integers, e.g. 1,2,3") from None
    if not ids:
        raise KvwallError("--prompt-ids is empty; give at least one token id")
    return ids


def _checkpoint(arg: str) -> Path:
    """A checkpoint directory, a .gguf file, or a short name of a packaged model (smollm2-135m)."""
    from kvwall.spec.gguf_meta import PACKAGED, gguf_file

    gguf = gguf_file(arg)
    if gguf is not None:
        if not gguf.is_file():
            raise KvwallError(f"{arg} does not exist; give a .gguf file, a checkpoint directory or "
                              f"{' / '.join(PACKAGED)}")
        return gguf
    path = Path(arg).expanduser()
    if not (path / "config.json").is_file():
        raise KvwallError(f"{arg} is not a checkpoint directory (no config.json), a .gguf file or "
                          f"{' / '.join(PACKAGED)}; point at a saved model")
    return path


def _reference(path: Path, torch):
    """transformers' model of the same checkpoint (a .gguf through its gguf_file loader)."""
    import transformers

    auto = transformers.AutoModelForCausalLM
    if path.suffix.lower() == ".gguf":
        return auto.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return auto.from_pretrained(path, dtype=torch.float32).eval()


# -- verify --------------------------------------------------------------------

def cmd_verify(args) -> int:
    common.need_torch("the engine needs torch")
    import torch

    from kvwall.engine.generate import check_logits
    from kvwall.engine.load import load_model

    path = _checkpoint(args.checkpoint)
    model = load_model(path)
    try:
        import transformers
    except ImportError:
        raise KvwallError("verify compares against transformers: pip install transformers") from None
    if args.prompt_ids:
        ids = parse_ids(args.prompt_ids)
    else:
        ids = torch.randint(0, model.spec.vocab, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    if max(ids) >= model.spec.vocab or min(ids) < 0:
        raise KvwallError(f"a prompt id is outside the vocabulary [0, {model.spec.vocab})")
    x = torch.tensor([ids])
    with torch.no_grad():
        ours = model(x)  # (1, T, V)
    check_logits(ours)
    ref = _reference(path, torch)
    with torch.no_grad():
        want = ref(x).logits.float()  # (1, T, V)
    diff = (ours - want).abs().max().item()
    # A real checkpoint's logits reach 30-120 (SmolLM2 33, Gemma 3 270M 115): fp32 sums in another order
    # differ there by 8e-5 and 5.6e-4 (2.4e-6 and 4.8e-6 of the scale), so the bound scales with the logits.
    scale = max(1.0, want.abs().max().item())
    ok = diff <= args.tolerance * scale
    result = {"checkpoint": str(path), "model_type": model.spec.model_type, "tokens": len(ids),
              "max_abs_logit_diff": diff, "logit_scale": scale, "rel_tolerance": args.tolerance,
              "tolerance": args.tolerance * scale, "pass": ok, "transformers": transformers.__version__}
    common.emit(args, result, _print_verify)
    return 0 if ok else 1


def _print_verify(r: dict) -> None:
    print(f"{Path(r['checkpoint']).name} ({r['model_type']}), {r['tokens']} tokens: max |logit diff| "
          f"{r['max_abs_logit_diff']:.3g} vs transformers {r['transformers']} -> {'PASS' if r['pass'] else 'FAIL'} "
          f"(tolerance {r['rel_tolerance']:g} x max |logit| {r['logit_scale']:.3g} = {r['tolerance']:.3g})")


# -- generate ------------------------------------------------------------------

def cmd_generate(args) -> int:
    cache = parse_cache(args.cache).text  # a one-line error for a name or option it does not know
    path = _checkpoint(args.checkpoint)
    common.need_torch("the engine needs torch")
    import torch

    from kvwall.engine.generate import Sampling, generate
    from kvwall.engine.load import load_model
    from kvwall.engine.tokenizer import load_tokenizer

    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    sampling.check()
    tok = load_tokenizer(path) if args.prompt is not None else None
    if args.prompt is not None and tok is None:
        raise KvwallError(f"{path} has no tokenizer.json (or `tokenizers` is not installed); use --prompt-ids")
    ids = _prompt_ids(args, tok)
    model = load_model(path, args.dtype, weights=args.weights)
    if args.prompt is None:
        tok = _output_tokenizer(path, load_tokenizer)
    auto = common.use_threads(args)
    t0 = time.perf_counter()  # each cache takes the keywords its registry entry lists
    out = generate(model, [ids], args.max_new_tokens, cache, sampling, block_size=args.block_size,
                   residual=args.residual, adapt_threads=auto)
    wall = time.perf_counter() - t0
    new = out.tokens[0]
    text = tok.decode(new) if tok is not None else None
    result = {"checkpoint": str(path), "cache": args.cache, "weights": args.weights, "prompt_ids": ids, "ids": new,
              "text": text, "prefill_s": out.prefill_s, "decode_s": out.decode_s, "decode_steps": out.decode_steps,
              "decode_tokens_per_s": out.decode_tok_s, "total_s": wall, "cache_bytes": out.cache_bytes,
              "threads": args.threads or torch.get_num_threads()}
    if out.thread_trials is not None:  # --threads auto: each trial of another count, [step, from, to, kept]
        result["thread_trials"] = [list(t) for t in out.thread_trials]
    return common.emit(args, result, _print_generate)


def _output_tokenizer(path, load_tokenizer):
    """With --prompt-ids the tokenizer only turns the new ids into text: a broken one is a warning, and they print
    as ids (the model loaded first, so a broken file is its one error)."""
    try:
        return load_tokenizer(path)
    except KvwallError as e:
        print(f"kvwall: warning: {e}; printing token ids instead of text", file=sys.stderr)
        return None


def _prompt_ids(args, tok) -> list[int]:
    """--prompt-ids as given; --prompt through the tokenizer, or with --chat as one user message of its template."""
    if args.prompt is None:
        if args.chat:
            raise KvwallError("--chat needs --prompt (text to send as the user's message), not --prompt-ids")
        return parse_ids(args.prompt_ids)
    if not args.chat:
        return tok.encode(args.prompt)
    if not hasattr(tok, "encode_chat"):
        raise KvwallError("--chat needs a chat template; this checkpoint's tokenizer has none (a .gguf carries one)")
    return tok.encode_chat([{"role": "user", "content": args.prompt}])


def _print_generate(r: dict) -> None:
    """The text (or ids) on stdout; the speed and cache size on stderr, so that stdout pipes cleanly."""
    new = r["ids"]
    sys.stdout.write((r["text"] if r["text"] is not None else ",".join(map(str, new))) + "\n")
    print(f"[{len(new)} tokens, prefill {r['prefill_s'] * 1e3:.1f} ms, decode {r['decode_tokens_per_s']:.1f} tok/s, "
          f"{r['cache']} cache {fmt_bytes(r['cache_bytes'])}]", file=sys.stderr)

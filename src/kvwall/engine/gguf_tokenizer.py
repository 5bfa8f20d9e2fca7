"""The tokenizer a .gguf file carries (`tokenizer.ggml.*`), rebuilt as a `tokenizers.Tokenizer`.

Two kinds are supported, as llama.cpp runs them:
- "gpt2": byte-level BPE from the stored vocabulary and merges; the pre-tokenizer regex is GPT-2's, with
  digits split one by one first where llama.cpp's pre-tokenizer type does so (SmolLM's "smollm").
- "llama": SentencePiece-style BPE (Llama 2, Gemma): no merges are stored, each token has a score, and
  llama.cpp merges the adjacent pair whose concatenation scores highest; ranking merges by that score
  makes BPE do the same. Spaces are the "▁" character and unknown characters fall back to <0xNN> bytes.
Control tokens (<bos>, <|im_start|>, ...) and user-defined ones are matched whole before BPE. BOS is
prepended when the file's add_bos_token says so (llama.cpp's default for "llama" is yes, "gpt2" no).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvwall.engine.tokenizer import Text
from kvwall.errors import KvwallError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type
SPACE = "\u2581"  # SentencePiece's visible space
DIGITS_FIRST = {"smollm", "deepseek-llm", "deepseek-coder"}  # llama.cpp pre-types that isolate each digit


def _strings(reader, key: str) -> list[str]:
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]


def _numbers(reader, key: str) -> np.ndarray:
    """A numeric array field as one numpy view (its elements lie back to back in the file)."""
    f = reader.fields[key]
    first = f.parts[f.data[0]]
    out = np.lib.stride_tricks.as_strided(first, shape=(len(f.data),), strides=(first.itemsize,))
    assert out[-1] == f.parts[f.data[-1]][0], key
    return np.array(out)


def _scalar(reader, key: str, default=None):
    return reader.fields[key].contents() if key in reader.fields else default


class GGUFText(Text):
    """engine.tokenizer.Text over a tokenizer rebuilt from GGUF metadata, plus its chat template."""

    def __init__(self, tok, chat_template: str | None, bos: str | None, eos: str | None):
        self.tok, self.chat_template, self.bos_token, self.eos_token = tok, chat_template, bos, eos

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The file's chat template rendered with jinja2 (as transformers renders it)."""
        if not self.chat_template:
            raise KvwallError("this model's file has no chat template (tokenizer.chat_template); drop --chat")
        try:
            import jinja2
        except ImportError:
            raise KvwallError("rendering the chat template needs jinja2: pip install jinja2") from None
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=self.bos_token or "",
            eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Ids of the rendered template; no BOS added on top (the template writes its own)."""
        return self.tok.encode(self.chat(messages), add_special_tokens=False).ids


def _raise(message: str):
    raise KvwallError(f"the chat template refused the messages: {message}")


def gguf_tokenizer(path: str | Path, reader=None) -> GGUFText:
    """The file's tokenizer (needs the `tokenizers` package)."""
    from kvwall.spec.gguf_meta import open_reader

    reader = reader if reader is not None else open_reader(path)
    kind = _scalar(reader, "tokenizer.ggml.model")
    if kind not in _BUILDERS:
        raise KvwallError(f"{path}: tokenizer type {kind!r} is not supported (gpt2, llama); use --prompt-ids")
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    types = _numbers(reader, "tokenizer.ggml.token_type") if "tokenizer.ggml.token_type" in reader.fields \
        else np.full(len(tokens), NORMAL)
    tok = _BUILDERS[kind](reader, tokens, types)
    _add_specials(tok, tokens, types)
    bos = _special(reader, tokens, "bos")
    if _scalar(reader, "tokenizer.ggml.add_bos_token", kind == "llama") and bos is not None:
        from tokenizers.processors import TemplateProcessing

        bos_id = int(_scalar(reader, "tokenizer.ggml.bos_token_id"))
        tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)])
    return GGUFText(tok, _scalar(reader, "tokenizer.chat_template"), bos, _special(reader, tokens, "eos"))


def _special(reader, tokens: list[str], which: str) -> str | None:
    i = _scalar(reader, f"tokenizer.ggml.{which}_token_id")
    return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None


def _add_specials(tok, tokens: list[str], types: np.ndarray) -> None:
    """Control tokens are special (skipped when decoding); user-defined ones are plain text matched whole."""
    from tokenizers import AddedToken

    added = [AddedToken(tokens[i], special=bool(types[i] == CONTROL), normalized=False)
             for i in np.flatnonzero((types == CONTROL) | (types == USER_DEFINED))]
    tok.add_tokens(added)


def _gpt2(reader, tokens: list[str], types: np.ndarray):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    merges = [tuple(m.split(" ", 1)) for m in _strings(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _scalar(reader, "tokenizer.ggml.pre") in DIGITS_FIRST:
        byte_level = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def _llama(reader, tokens: list[str], types: np.ndarray):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = _numbers(reader, "tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = _special(reader, tokens, "unknown")
    tok = Tokenizer(models.BPE(vocab, _score_merges(tokens, types, scores, vocab), unk_token=unk, fuse_unk=True,
                               byte_fallback=True, ignore_merges=False))
    prefix = bool(_scalar(reader, "tokenizer.ggml.add_space_prefix", True))
    spaces = [normalizers.Replace(" ", SPACE)]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend(SPACE)] if prefix else []) + spaces)
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _score_merges(tokens: list[str], types: np.ndarray, scores: np.ndarray, vocab: dict[str, int]):
    """Every (left, right) whose concatenation is a normal token, highest-scoring concatenation first
    (ties: lower token id first), which is the order llama.cpp's SentencePiece tokenizer merges in."""
    found = []
    for i in np.flatnonzero(types == NORMAL):
        t = tokens[i]
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                found.append((-float(scores[i]), int(i), vocab[t[:k]], vocab[t[k:]]))
    found.sort()
    return [(tokens[a], tokens[b]) for _, _, a, b in found]


_BUILDERS = {"gpt2": _gpt2, "llama": _llama}

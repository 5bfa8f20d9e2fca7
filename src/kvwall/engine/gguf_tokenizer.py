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

import functools
import json
import re
from datetime import datetime
from pathlib import Path

import numpy as np

from kvwall.engine.tokenizer import Text
from kvwall.errors import KvwallError, first_line

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type
SPACE = "\u2581"  # SentencePiece's visible space
DIGITS_FIRST = {"smollm", "deepseek-llm", "deepseek-coder"}  # llama.cpp pre-types that isolate each digit


def _strings(reader, path, key: str) -> list[str]:
    """A string array field (each must be UTF-8, as llama.cpp's vocabularies are)."""
    f = _array(reader, path, key, _STRING)
    out = []
    for n, i in enumerate(f.data):
        try:
            out.append(bytes(f.parts[i]).decode("utf-8"))
        except UnicodeDecodeError:
            raise KvwallError(f"{path}: {key}[{n}] is not valid UTF-8 text; the file's tokenizer is damaged: "
                              "re-download or re-convert it, or use --prompt-ids") from None
    return out


def _numbers(reader, path, key: str) -> np.ndarray:
    """A numeric array field as one numpy view (its elements lie back to back in the file)."""
    f = _array(reader, path, key, _NUMERIC)
    first = f.parts[f.data[0]]
    out = np.lib.stride_tricks.as_strided(first, shape=(len(f.data),), strides=(first.itemsize,))
    assert out[-1] == f.parts[f.data[-1]][0], key
    return np.array(out)


def _array(reader, path, key: str, kinds: tuple):
    """The field `key`, which must be a non-empty array of one of `kinds` (gguf.GGUFValueType names)."""
    f = reader.fields.get(key)
    if f is None:
        raise KvwallError(f"{path}: the tokenizer field {key} is missing; the file's tokenizer is incomplete: "
                          "re-download or re-convert it, or use --prompt-ids")
    names = [t.name.lower() for t in f.types]
    if len(names) != 2 or names[0] != "array" or names[1].upper() not in kinds:
        one = f"{'an' if names[0][0] in 'aei' else 'a'} {names[0]}"  # an int32, a uint32, a string
        got = {1: one, 2: f"an array of {names[-1]} values"}.get(len(names), "an array of arrays")
        got = "an empty array" if names == ["array"] else got
        want = "strings" if kinds == _STRING else "numbers"
        raise KvwallError(f"{path}: {key} is {got}, not an array of {want}; the file's tokenizer is damaged: "
                          "re-download or re-convert it, or use --prompt-ids")
    return f


_STRING = ("STRING",)
_NUMERIC = ("UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64", "FLOAT32", "FLOAT64")


def _scalar(reader, path, key: str, kind: type, default=None):
    """A scalar field of Python type `kind` (int: any integer type, bool: BOOL or 0 / 1), or default when absent."""
    if key not in reader.fields:
        return default
    try:
        value = reader.fields[key].contents()
    except UnicodeDecodeError:
        value = _NOT_UTF8
    if kind is bool and isinstance(value, int) and value in (0, 1):
        return bool(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)) or value is _NOT_UTF8:
        got = "not valid UTF-8 text" if value is _NOT_UTF8 else f"{value!r:.40}, not {_KINDS[kind]}"
        raise KvwallError(f"{path}: {key} is {got}; the file's tokenizer is damaged: re-download or re-convert it, "
                          "or use --prompt-ids")
    return value


_KINDS = {int: "an integer", str: "a string", bool: "true or false"}
_NOT_UTF8 = object()


class GGUFText(Text):
    """engine.tokenizer.Text over a tokenizer rebuilt from GGUF metadata, plus its chat template."""

    def __init__(self, tok, chat_template: str | None, bos: str | None, eos: str | None, path=None):
        self.tok, self.chat_template, self.bos_token, self.eos_token = tok, chat_template, bos, eos
        self.path = path
        self._compiled = None  # the template, compiled on first use (a broken one matters only to --chat)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The file's chat template rendered as transformers renders it: in jinja2's sandbox, since the template
        is code that came with the file (a plain Environment lets it reach os.system through any global)."""
        if not self.chat_template:
            raise KvwallError("this model's file has no chat template (tokenizer.chat_template); "
                              "send a plain prompt instead of chat messages")
        template = self._template()
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except _Refused as e:
            raise KvwallError(f"{self.path}: tokenizer.chat_template refused the messages: {first_line(e)}") from None
        except Exception as e:  # the file's code failed: jinja2's errors, or a TypeError of its own making
            import jinja2

            if isinstance(e, jinja2.exceptions.SecurityError):
                raise KvwallError(f"{self.path}: tokenizer.chat_template tried to reach outside its sandbox "
                                  f"({first_line(e)}); the file is not safe to chat with: send plain prompts "
                                  "(not chat messages) or use a model file from a trusted source") from None
            raise KvwallError(f"{self.path}: tokenizer.chat_template failed on these messages ({type(e).__name__}: "
                              f"{first_line(e)}); fix the file's template or send plain prompts "
                              "(not chat messages)") from None

    def _template(self):
        if self._compiled is None:
            try:
                import jinja2
            except ImportError:
                raise KvwallError("rendering the chat template needs jinja2: pip install jinja2") from None
            if _version(jinja2.__version__) < (3, 1, 6):  # transformers' floor too: older sandboxes have escapes
                raise KvwallError(f"rendering a model file's chat template safely needs jinja2 3.1.6 or later (this is "
                                  f"{jinja2.__version__}, whose sandbox has known escapes): pip install -U jinja2")
            try:
                self._compiled = _sandbox().from_string(self.chat_template)
            except jinja2.exceptions.TemplateSyntaxError as e:
                raise KvwallError(f"{self.path}: tokenizer.chat_template has a syntax error on line {e.lineno} "
                                  f"({first_line(e)}); fix the file's template or send plain prompts "
                                  "(not chat messages)") from None
        return self._compiled

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Ids of the rendered template; no BOS added on top (the template writes its own)."""
        return self.tok.encode(self.chat(messages), add_special_tokens=False).ids


@functools.cache
def _sandbox():
    """jinja2's ImmutableSandboxedEnvironment with what transformers 5.25 gives chat templates
    (utils/chat_template_utils.py): trimmed blocks, loop controls, a no-op {% generation %} block,
    raise_exception, strftime_now, a JSON tojson that keeps non-ASCII and HTML as is, and dict and namespace
    that refuse underscore names. Undefined names render empty as there (templates test `tools` and the like);
    calling one, or reading an attribute of one, fails."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}  # transformers marks assistant text with it; rendering keeps the body

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):  # jinja2's signature trick, so that namespace(self=...) works
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")

    class Dict:  # dict(...) and dict.fromkeys(...) without handing the template the type itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt), dict=Dict(),
                       namespace=Namespace)
    return env


def _version(text: str) -> tuple[int, ...]:
    """"3.1.6" -> (3, 1, 6); "3.2.0rc1" -> (3, 2, 0)."""
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in text.split(".")[:3])


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Refused(Exception):
    """raise_exception(message) in a template: the template refuses these messages."""


def _raise(message):
    raise _Refused(message)


def gguf_tokenizer(path: str | Path, reader=None) -> GGUFText:
    """The file's tokenizer (needs the `tokenizers` package); every field it reads is checked, each problem one
    line naming the file and the field."""
    from kvwall.spec.gguf_meta import open_reader

    reader = reader if reader is not None else open_reader(path)
    kind = _scalar(reader, path, "tokenizer.ggml.model", str)
    if kind not in _BUILDERS:
        raise KvwallError(f"{path}: tokenizer type {kind!r} is not supported (gpt2, llama); use --prompt-ids")
    tokens = _strings(reader, path, "tokenizer.ggml.tokens")
    _check_rows(reader, path, tokens)
    types = _per_token(reader, path, "tokenizer.ggml.token_type", len(tokens)) \
        if "tokenizer.ggml.token_type" in reader.fields else np.full(len(tokens), NORMAL)
    try:
        tok = _BUILDERS[kind](reader, path, tokens, types)
        _add_specials(tok, tokens, types)
    except KvwallError:
        raise
    except Exception as e:  # the tokenizers package's own (it raises plain Exception)
        raise KvwallError(f"{path}: the tokenizer (tokenizer.ggml.*) cannot be built ({first_line(e)}); "
                          "re-download or re-convert the file, or use --prompt-ids") from None
    bos = _special(reader, path, tokens, "bos")
    if _scalar(reader, path, "tokenizer.ggml.add_bos_token", bool, kind == "llama") and bos is not None:
        from tokenizers.processors import TemplateProcessing

        bos_id = _scalar(reader, path, "tokenizer.ggml.bos_token_id", int)
        tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, bos_id)])
    return GGUFText(tok, _scalar(reader, path, "tokenizer.chat_template", str), bos,
                    _special(reader, path, tokens, "eos"), path)


def _check_rows(reader, path, tokens: list[str]) -> None:
    """One token per row of the embedding table, as llama.cpp requires (an id past the table has no row, a
    row past the tokens no text)."""
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    rows = None if embed is None else int(embed.shape.tolist()[-1])  # GGUF lists the row count last
    if rows is not None and rows != len(tokens):
        raise KvwallError(f"{path}: tokenizer.ggml.tokens holds {len(tokens):,} tokens, tensor token_embd.weight "
                          f"has {rows:,} rows; they must match: re-convert the model")


def _per_token(reader, path, key: str, n: int) -> np.ndarray:
    """A numeric array with one value per token."""
    out = _numbers(reader, path, key)
    if len(out) != n:
        raise KvwallError(f"{path}: {key} holds {len(out):,} values for {n:,} tokens (tokenizer.ggml.tokens); "
                          "the file's tokenizer is damaged: re-download or re-convert it, or use --prompt-ids")
    return out


def _special(reader, path, tokens: list[str], which: str) -> str | None:
    i = _scalar(reader, path, f"tokenizer.ggml.{which}_token_id", int)
    return tokens[i] if i is not None and 0 <= i < len(tokens) else None


def _add_specials(tok, tokens: list[str], types: np.ndarray) -> None:
    """Control tokens are special (skipped when decoding); user-defined ones are plain text matched whole."""
    from tokenizers import AddedToken

    added = [AddedToken(tokens[i], special=bool(types[i] == CONTROL), normalized=False)
             for i in np.flatnonzero((types == CONTROL) | (types == USER_DEFINED))]
    tok.add_tokens(added)


def _gpt2(reader, path, tokens: list[str], types: np.ndarray):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    merges = [_merge(path, n, m) for n, m in enumerate(_strings(reader, path, "tokenizer.ggml.merges"))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _scalar(reader, path, "tokenizer.ggml.pre", str) in DIGITS_FIRST:
        byte_level = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    return tok


def _merge(path, n: int, merge: str) -> tuple[str, str]:
    """One `left right` merge rule as its two parts."""
    left, space, right = merge.partition(" ")
    if not (left and space and right):
        raise KvwallError(f"{path}: tokenizer.ggml.merges[{n}] is {merge!r:.40}, not two tokens joined by a space; "
                          "the file's tokenizer is damaged: re-download or re-convert it, or use --prompt-ids")
    return left, right


def _llama(reader, path, tokens: list[str], types: np.ndarray):
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = _per_token(reader, path, "tokenizer.ggml.scores", len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    unk = _special(reader, path, tokens, "unknown")
    tok = Tokenizer(models.BPE(vocab, _score_merges(tokens, types, scores, vocab), unk_token=unk, fuse_unk=True,
                               byte_fallback=True, ignore_merges=False))
    prefix = _scalar(reader, path, "tokenizer.ggml.add_space_prefix", bool, True)
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

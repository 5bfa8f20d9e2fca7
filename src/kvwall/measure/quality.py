"""What each cache strategy costs in quality on a trained model: perplexity, KL, top-1 agreement and pass-key recall.

Perplexity (teacher forced). The text's first `tokens` tokens are cut into R rows of L = tokens / R, decoded
as one batch: a prefill of P tokens per row, then one token per step, every strategy in lockstep. The step
that feeds token t (P <= t <= L - 2) predicts token t + 1 and reads the cache through the decode path, so
R (L - 1 - P) predictions are scored per strategy (the prefill's own prediction is not: it never reads the
cache at decode). Against the exact cache (contiguous), at every scored position:
    ppl    exp(mean -log p(x_{t+1}))          Δ ppl = ppl - ppl(exact)
    KL     mean sum_v p_exact(v) (log p_exact(v) - log p(v))   (nats; 0 for the exact cache)
    top-1  share of positions where argmax p = argmax p_exact
Cache bytes per token = the cache's nbytes() once each row holds L - 1 tokens, over R (L - 1); the registry's
predicted_bytes for the same point is reported beside it (they are equal).

Bands by context. The prediction of token j (its context: the j tokens before it) falls in the band
[a, b) with a <= j < b; the edges are BAND_EDGES (1k, 4k, 16k) cut at the row's length, so one pass over
long rows gives ppl, Δ ppl, KL and top-1 at every context at once: a saving's cost at context c is its loss
on the tokens that had about c tokens before them. Δ% = 100 Δ ppl / ppl(exact) in the same band.

Chunked scoring (--chunk C > 1, for long rows). Feeding one token per step costs L - 1 - P forward passes per
strategy; feeding C tokens at once and scoring every one of their logits gives the same predictions when
each query sees the cache as its own decode step would. Exact, fp8 and sliding caches hold the same values
however many tokens a pass adds (a pass attends over what the cache returns, masked by position). A KIVI
cache (group G, residual R) holding n tokens has q(n) = G floor((n - R) / G) of them quantized (0 for
n < R + G), which steps at n = R + kG; a chunk of positions a .. b - 1 holds n = a + 1 .. b for its
queries, so cutting the row at every a = R - 1 (mod C), with C dividing every G, keeps q the same for all
queries of a chunk as at their own decode step (chunk_cuts). C = 1 is the decode path itself; a test
holds C = 32 to it.

Pass-key retrieval (after Mohtashami & Jaggi 2023, "Landmark attention"). A prompt of `length` tokens: an
instruction, filler prose with one sentence stating a random 5-digit key after `depth` of the filler, then a
question. The context is prefilled through the strategy's cache; the question's tokens are fed one per step
(the decode path); the answer is greedy. Correct when the first number in the answer is the key.

The default text is the prose of the Python Language Reference that ships with CPython (pydoc_data.topics,
PSF licence): its paragraphs without grammar productions, indented code or tables. Nothing is copied here.
"""

from __future__ import annotations

import random
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvwall.errors import KvwallError
from kvwall.files import read_user_text

EXACT = "contiguous"  # the reference every strategy is held against
DEPTHS = (0.1, 0.5, 0.9)
SINKS = 4  # StreamingLLM's attention sinks: the first four tokens
BAND_EDGES = (1024, 4096, 16384)  # context bands: the issue asks for each saving's cost at 1k, 4k and the longest
ANSWER_ROOM = 16  # tokens kept free past a pass-key prompt for the answer (a 5-digit key is 2-6 tokens + 3)
INTRO = ("There is a pass key hidden inside a lot of unrelated text. Find it and remember it; you will be asked "
         "for it at the end.\n\n")
NEEDLE = "\n\nThe pass key is {key}. Remember it. {key} is the pass key.\n\n"
QUESTION = "\n\nWhat is the pass key? The pass key is"


# -- the text ------------------------------------------------------------------------------------------------

def prose_paragraphs(raw: str) -> list[str]:
    """reST-like text -> its prose paragraphs, each on one line: no headings, grammar (::=), indented code or
    tables, and nothing shorter than eight words."""
    out = []
    for block in re.split(r"\n\s*\n", raw):
        lines = block.split("\n")
        if not lines[0] or lines[0][0].isspace() or "::=" in block or re.search(r"^[*=~^+|-]{3,}", block, re.M):
            continue
        if any(line.startswith((" ", "\t")) and not line.startswith("  ") for line in lines[1:]):
            continue  # a block whose later lines are odd-indented is a table or a literal
        text = " ".join(line.strip() for line in lines)
        if len(text.split()) >= 8 and text[-1] in ".:)":
            out.append(text)
    return out


def reference_prose() -> tuple[str, str]:
    """(text, source): the Python Language Reference's prose paragraphs, from the running CPython."""
    try:
        from pydoc_data.topics import topics
    except ImportError:
        raise KvwallError("this Python has no pydoc_data (the Language Reference text); give --text FILE") from None
    paragraphs = [p for name in sorted(topics) for p in prose_paragraphs(topics[name])]
    source = (f"the Python {sys.version.split()[0]} Language Reference (pydoc_data.topics, PSF licence), "
              f"{len(paragraphs)} prose paragraphs")
    return "\n\n".join(paragraphs), source


def read_text(path: str | Path | None) -> tuple[str, str]:
    """--text FILE (UTF-8) or the reference prose -> (text, source)."""
    if path is None:
        return reference_prose()
    return read_user_text(path, "--text", "a UTF-8 text file"), str(Path(path).expanduser())


class Tokens:
    """A tokenizer seen as (prefix, plain ids): `prefix` is what it puts before every text (BOS, or nothing)."""

    def __init__(self, tok):
        self.tok = tok
        plain = self.plain("a")
        self.prefix = tok.encode("a")[:-len(plain)] if plain else []

    def plain(self, text: str) -> list[int]:
        return self.tok.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


# -- strategies ----------------------------------------------------------------------------------------------

def native_window(spec) -> int | None:
    """The model's own sliding window (Gemma 3's local layers), or None."""
    return max((layer.mixer.window for layer in spec.layers
                if layer.mixer is not None and getattr(layer.mixer, "window", None)), default=None)


def default_strategies(spec, row_tokens: int) -> list[str]:
    """contiguous, fp8, int8/4/2, a window of a quarter of a row with and without sinks; with a native window
    also the native one and what-if windows of half and double it."""
    w = max(1, row_tokens // 4)
    out = [EXACT, "fp8", "int8", "int4", "int2", f"sliding:{w}", f"sliding:{w}:sink{SINKS}"]
    native = native_window(spec)
    if native:
        out += ["sliding", f"sliding:{native // 2}", f"sliding:{native * 2}"]
    return list(dict.fromkeys(out))


def with_exact_first(caches: list[str]) -> list[str]:
    from kvwall.engine.caches.registry import parse_cache

    texts = [parse_cache(c).text for c in caches]
    return list(dict.fromkeys([EXACT, *texts]))


# -- perplexity, KL, top-1 -----------------------------------------------------------------------------------

@dataclass
class Score:
    """Running sums over scored positions for one strategy, per context band."""

    bands: list[tuple[int, int]]  # [a, b): targets j with a <= j < b
    nll: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    agree: list[int] = field(default_factory=list)
    n: list[int] = field(default_factory=list)

    def __post_init__(self):
        k = len(self.bands)
        self.nll, self.kl, self.agree, self.n = [0.0] * k, [0.0] * k, [0] * k, [0] * k

    def add(self, logp, exact, target, first: int) -> None:
        """logp, exact: (R, T, V) log-probabilities; target (R, T) the next tokens, target[:, i] at position
        first + i of the row (its context: first + i tokens)."""
        nll = -logp.gather(2, target[..., None])[..., 0]  # (R, T)
        kl = (exact.exp() * (exact - logp)).sum(-1)  # (R, T)
        agree = logp.argmax(-1) == exact.argmax(-1)  # (R, T)
        T = target.shape[1]
        for i, (a, b) in enumerate(self.bands):
            lo, hi = max(a - first, 0), min(b - first, T)
            if lo < hi:
                self.nll[i] += float(nll[:, lo:hi].sum())
                self.kl[i] += float(kl[:, lo:hi].sum())
                self.agree[i] += int(agree[:, lo:hi].sum())
                self.n[i] += target.shape[0] * (hi - lo)

    @staticmethod
    def _stats(nll: float, kl: float, agree: int, n: int, exact_ppl: float | None) -> dict:
        import math

        ppl = math.exp(nll / n)
        base = ppl if exact_ppl is None else exact_ppl
        return {"ppl": ppl, "delta_ppl": ppl - base, "delta_pct": 100 * (ppl - base) / base,
                "kl": max(0.0, kl / n), "top1": agree / n, "predictions": n}

    def result(self, exact: dict | None) -> dict:
        """The whole row's figures and one per band; Δ against `exact` (the exact cache's result, same bands)."""
        out = self._stats(sum(self.nll), sum(self.kl), sum(self.agree), sum(self.n), exact and exact["ppl"])
        out["bands"] = [{"start": a, "end": b, **self._stats(*sums, exact and exact["bands"][i]["ppl"])}
                        for i, ((a, b), *sums) in enumerate(zip(self.bands, self.nll, self.kl, self.agree, self.n))]
        return out


def bands(row_tokens: int, prefill: int, edges=BAND_EDGES) -> list[tuple[int, int]]:
    """Context bands [a, b) over the scored targets j = prefill + 1 .. row_tokens - 1: the edges below the row's
    length, the last band ending at the row's end; bands with no scored target are left out."""
    cuts = [0, *sorted(e for e in set(edges) if 0 < e < row_tokens), row_tokens]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > prefill + 1]


def chunk_cuts(row_tokens: int, prefill: int, chunk: int, residual: int) -> list[int]:
    """Where the tokens 0 .. L - 2 are cut into passes: the prefill, then chunks that start at a = R - 1 (mod
    chunk) (the module docstring's rule), the last one ending at L - 1. chunk 1: one token per pass (decode)."""
    first = prefill + (residual - 1 - prefill) % chunk  # the first cut past the prefill on the R - 1 grid
    inner = range(first if first > prefill else first + chunk, row_tokens - 1, chunk)
    return [0, prefill, *inner, row_tokens - 1]


def chunk_for(caches: list[str], wanted: int) -> int:
    """The largest chunk <= wanted that divides the key group of every quantized strategy (int8: 128, int4 and
    int2: 32, :gN its N), so chunked scoring keeps each query's cache as at decode."""
    from math import gcd

    from kvwall.engine.caches.registry import parse_cache
    from kvwall.spec.formats import get_format

    groups = [get_format(c.format).group for c in map(parse_cache, caches) if c.format]
    g = 0
    for group in groups:
        g = gcd(g, group)
    return max(c for c in range(1, wanted + 1) if not g or g % c == 0)


def split_rows(ids: list[int], tokens: int, rows: int, prefix: list[int]):
    """The first `tokens` ids as `rows` rows (R, L) of L = tokens // rows, each led by the tokenizer's prefix
    (BOS) when it has one (the prefix takes the row's first slot)."""
    import torch

    L = tokens // rows
    body = L - len(prefix)
    if body < 1 or len(ids) < rows * body:
        raise KvwallError(f"the text has {len(ids):,} tokens; {rows} row(s) of {L:,} tokens need "
                          f"{rows * max(body, 1):,}: give a longer --text FILE, fewer --rows or shorter rows "
                          "(--tokens / --row-tokens)")
    return torch.tensor([prefix + ids[r * body:(r + 1) * body] for r in range(rows)])  # (R, L)


def perplexity(model, rows, prefill: int, caches: list[str], residual: int,
               on_step: Callable[[int], None] | None = None, chunk: int = 1, edges=BAND_EDGES) -> list[dict]:
    """Every strategy in lockstep over rows (R, L); caches[0] is the exact one. -> one dict per strategy, with
    its figures per context band. chunk: tokens per pass after the prefill (1: the decode path; more: chunked
    scoring, chunk_for(caches, chunk) of them). on_step(n): n more tokens scored by one strategy."""
    import torch

    from kvwall.engine.caches import make_cache
    from kvwall.engine.caches.registry import predicted_bytes

    R, L = rows.shape
    held, w = L - 1, next(model.parameters())
    made = [make_cache(c, model.spec, R, held, w.dtype, w.device, residual=residual) for c in caches]
    band = bands(L, prefill, edges)
    scores = [Score(band) for _ in caches]
    cuts = chunk_cuts(L, prefill, chunk_for(caches, chunk), residual)
    with torch.inference_mode():
        for cache in made:
            model(rows[:, :prefill], cache=cache, last_only=True)  # its prediction is not scored
        for a, b in zip(cuts[1:], cuts[2:]):
            pos, target = torch.arange(a, b).expand(R, -1), rows[:, a + 1:b + 1]  # (R, T), (R, T)
            exact = None
            for cache, score in zip(made, scores):
                logp = model(rows[:, a:b], pos, cache).float().log_softmax(-1)  # (R, T, V)
                exact = logp if exact is None else exact
                score.add(logp, exact, target, a + 1)
                if on_step:
                    on_step(b - a)
    element = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[w.dtype]
    out, base = [], None
    for name, cache, score in zip(caches, made, scores):
        r = {"cache": name, **score.result(base)}
        base = r if base is None else base
        r.update(cache_bytes=cache.nbytes(), bytes_per_token=cache.nbytes() / (R * held),
                 predicted_bytes_per_token=predicted_bytes(name, model.spec, R, held, element, residual=residual)
                 / (R * held))
        out.append(r)
    return out


# -- pass-key retrieval --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # length tokens: context then question
    question: int  # the last `question` ids are the question (fed one per step)
    needle_at: int  # index of the needle sentence's first token
    filler_before: int  # filler tokens before the needle
    filler: int  # filler tokens in all
    key: str


def passkey_prompt(tok: Tokens, filler: list[int], length: int, depth: float, key: str) -> Prompt:
    """prefix + intro + filler[:a] + needle(key) + filler[a:n] + question, exactly `length` tokens, with
    a = round(depth * n) of the n filler tokens before the needle."""
    intro, needle, question = tok.plain(INTRO), tok.plain(NEEDLE.format(key=key)), tok.plain(QUESTION)
    n = length - len(tok.prefix) - len(intro) - len(needle) - len(question)
    if n < 1:
        raise KvwallError(f"--passkey-lengths {length}: too short for the instruction, key and question "
                          f"({length - n + 1} tokens at least)")
    if n > len(filler):
        raise KvwallError(f"--passkey-lengths {length}: the text has {len(filler):,} tokens of filler, "
                          f"{n:,} needed; give a longer --text or shorter lengths")
    a = round(depth * n)
    head = tok.prefix + intro + filler[:a]
    ids = head + needle + filler[a:n] + question
    return Prompt(ids, len(question), len(head), a, n, key)


def keys(count: int, seed: int) -> list[str]:
    """`count` random 5-digit keys (10000-99999), repeatable by seed."""
    rng = random.Random(seed)
    return [str(rng.randrange(10000, 100000)) for _ in range(count)]


def answer_ok(text: str, key: str) -> bool:
    """The first number in the answer is the key."""
    m = re.search(r"\d+", text)
    return bool(m) and m.group(0) == key


def retrieve(model, tok: Tokens, prompts: list[Prompt], cache_name: str, residual: int) -> list[bool]:
    """One batch: prefill the contexts, feed the question one token per step, answer greedily."""
    import torch

    from kvwall.engine.caches import make_cache

    B, T, Q = len(prompts), len(prompts[0].ids), prompts[0].question
    answer = len(tok.plain(" " + prompts[0].key)) + 3
    x = torch.tensor([p.ids for p in prompts])  # (B, T)
    w = next(model.parameters())
    cache = make_cache(cache_name, model.spec, B, T + answer, w.dtype, w.device, residual=residual)
    out = []
    with torch.inference_mode():
        model(x[:, :T - Q], cache=cache, last_only=True)
        for t in range(T - Q, T + answer - 1):
            nxt = x[:, t] if t < T else out[-1]  # the question, then the model's own greedy tokens
            logits = model(nxt[:, None], torch.full((B, 1), t), cache)[:, -1]  # (B, V)
            if t >= T - 1:
                out.append(logits.argmax(-1))
    answers = torch.stack(out, 1).tolist()  # (B, answer)
    return [answer_ok(tok.decode(a), p.key) for a, p in zip(answers, prompts)]


@dataclass
class PasskeyPlan:
    lengths: list[int]
    keys: int = 20
    depths: tuple[float, ...] = DEPTHS
    seed: int = 0
    batch_bytes: int = 1 << 30  # contiguous-cache bytes one batch may hold

    def cells(self) -> list[tuple[int, float]]:
        return [(n, d) for n in self.lengths for d in self.depths]


def passkey_prompts(tok: Tokens, filler: list[int], plan: PasskeyPlan) -> dict[tuple[int, float], list[Prompt]]:
    """Every cell's prompts (the same keys in every cell), made before any work: a bad length fails at once."""
    return {(n, d): [passkey_prompt(tok, filler, n, d, k) for k in keys(plan.keys, plan.seed)] for n, d in plan.cells()}


def passkey(model, tok: Tokens, prompts: dict, caches: list[str], plan: PasskeyPlan, residual: int,
            on_cell: Callable[[], None] | None = None) -> list[dict]:
    """Accuracy per strategy, length and depth over the cell's prompts (passkey_prompts)."""
    out = []
    for name in caches:
        for (length, depth), cell in prompts.items():
            ok = [hit for batch in _batches(model.spec, cell, plan.batch_bytes)
                  for hit in retrieve(model, tok, batch, name, residual)]
            out.append({"cache": name, "length": length, "depth": depth, "correct": sum(ok), "keys": len(ok),
                        "accuracy": sum(ok) / len(ok)})
            if on_cell:
                on_cell()
    return out


def _batches(spec, prompts: list[Prompt], budget: int) -> list[list[Prompt]]:
    """Prompts in batches whose exact (contiguous, fp32) cache stays within `budget` bytes."""
    from kvwall.engine.caches.registry import predicted_bytes

    per_row = predicted_bytes(EXACT, spec, 1, len(prompts[0].ids) + 8)
    step = max(1, budget // per_row)
    return [prompts[i:i + step] for i in range(0, len(prompts), step)]


# -- the whole measurement -----------------------------------------------------------------------------------

@dataclass
class Plan:
    caches: list[str]  # exact first
    tokens: int = 4096
    rows: int = 8
    prefill: int = 16
    residual: int = 32
    passkey: PasskeyPlan | None = field(default_factory=lambda: PasskeyPlan([1024, 2048, 4096]))
    chunk: int = 1  # tokens per pass after the prefill: 1 is the decode path (perplexity's docstring)
    edges: tuple[int, ...] = BAND_EDGES

    def check(self, spec) -> None:
        """Everything that can be wrong before minutes of work: one line each."""
        from kvwall.engine.caches.registry import predicted_bytes

        L = self.tokens // self.rows
        if self.rows < 1 or L - 1 - self.prefill < 1:
            raise KvwallError(f"--tokens {self.tokens} in --rows {self.rows} gives rows of {L} tokens: too short for "
                              f"--prefill {self.prefill} and one prediction; give more --tokens or fewer --rows")
        if self.prefill < 1:
            raise KvwallError("--prefill must be at least 1")
        if self.chunk < 1:
            raise KvwallError("--chunk must be at least 1 (1: every prediction by a decode step)")
        limit = spec.max_context
        if limit and L > limit:
            raise KvwallError(f"rows of {L:,} tokens are past {spec.name}'s context of {limit:,}; shorten the rows "
                              "(--row-tokens, or --tokens / --rows)")
        longest = max(self.passkey.lengths) if self.passkey else 0
        if limit and longest + ANSWER_ROOM > limit:
            raise KvwallError(f"pass key at {longest:,} tokens is past {spec.name}'s context of {limit:,} less "
                              f"{ANSWER_ROOM} for the answer; the longest is {limit - ANSWER_ROOM:,} "
                              "(--passkey-lengths max)")
        for c in self.caches:
            predicted_bytes(c, spec, 1, L, residual=self.residual)  # one line for a strategy the model cannot run


def steps(plan: Plan) -> int:
    """Units of progress: tokens scored (decode steps at chunk 1) times strategies, plus one per pass-key cell and
    strategy."""
    L = plan.tokens // plan.rows
    cells = len(plan.passkey.cells()) if plan.passkey else 0
    return len(plan.caches) * ((L - 1 - plan.prefill) + cells)


def passkey_lengths(lengths: list[int | str], spec) -> list[int]:
    """--passkey-lengths with "max" as the model's context less the answer's room (SmolLM2: 8,192 - 16)."""
    limit = spec.max_context
    if "max" in lengths and not limit:
        raise KvwallError(f"--passkey-lengths max: {spec.name} declares no maximum context; give lengths in tokens")
    return sorted({limit - ANSWER_ROOM if n == "max" else n for n in lengths})


def passkey_grid(pk: dict) -> tuple[list[str], list[list[str]]]:
    """Pass-key cells as a grid: the column heads ("1k @ 10%" ...) and one row per strategy ("7/10" ...)."""
    from kvwall.units import fmt_tokens

    heads = [f"{fmt_tokens(n)} @ {round(d * 100)}%" for n in pk["lengths"] for d in pk["depths"]]
    by_cache: dict[str, list[str]] = {}
    for cell in pk["cells"]:
        by_cache.setdefault(cell["cache"], []).append(f"{cell['correct']}/{cell['keys']}")
    return heads, [[name, *cells] for name, cells in by_cache.items()]


def band_label(band: dict) -> str:
    """A band's context range, e.g. "1k-4k"."""
    from kvwall.units import fmt_tokens

    return f"{fmt_tokens(band['start']) if band['start'] else 0}-{fmt_tokens(band['end'])}"


def band_grid(quality: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Bands as a grid: column heads ("0-1k" ...) and one row per strategy (Δ% of perplexity in each band; the
    exact cache's row gives its perplexity)."""
    heads = [band_label(b) for b in quality[0]["bands"]]
    rows = [[quality[0]["cache"], *(f"ppl {b['ppl']:.2f}" for b in quality[0]["bands"])]]
    rows += [[r["cache"], *(f"{b['delta_pct']:+.2f}%" for b in r["bands"])] for r in quality[1:]]
    return heads, rows


def load(path, weights: str | None = None):
    """(model, tokenizer) of a checkpoint or .gguf, its projections held as `weights` (load_model); quality
    needs the tokenizer to read text."""
    from kvwall.engine.load import load_model
    from kvwall.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    if tok is None:
        raise KvwallError(f"{path} has no tokenizer (tokenizer.json, or a .gguf's); quality needs one to read text")
    return load_model(path, weights=weights), tok


def merge_weights(runs: list[tuple[str, dict]]) -> dict:
    """One result from a run per weight format: every row and pass-key cell named "<cache> @ <weights>", and
    Δ ppl taken against the first run's first (exact) row, so a row says what its weights and cache cost
    together; KL and top-1 stay against the same weights' exact cache (the logits of two runs never meet)."""
    first = runs[0][1]
    base = first["quality"][0]
    against = lambda r, b: {"delta_ppl": r["ppl"] - b["ppl"], "delta_pct": 100 * (r["ppl"] - b["ppl"]) / b["ppl"]}  # noqa: E731
    out = {**first, "quality": [], "weights": [w for w, _ in runs]}
    for w, data in runs:
        for r in data["quality"]:
            out["quality"].append({**r, "cache": f"{r['cache']} @ {w}", "weights": w, **against(r, base),
                                   "bands": [{**x, **against(x, y)} for x, y in zip(r["bands"], base["bands"])]})
    if first.get("passkey"):
        out["passkey"] = {**first["passkey"], "cells": [{**c, "cache": f"{c['cache']} @ {w}"} for w, data in runs
                                                        for c in data["passkey"]["cells"]]}
    return out


def measure(model, tok, plan: Plan, text: str, source: str, on_step: Callable[[], None] | None = None) -> dict:
    """The table's data: perplexity rows per strategy, pass-key cells, the text's source."""
    tokens = Tokens(tok)
    plan.check(model.spec)
    ids = tokens.plain(text)
    rows = split_rows(ids, plan.tokens, plan.rows, tokens.prefix)
    prompts = passkey_prompts(tokens, ids, plan.passkey) if plan.passkey else None
    chunk = chunk_for(plan.caches, plan.chunk)
    out = {"model": model.spec.name, "text": {"source": source, "tokens": len(ids), "used": int(rows.numel()),
                                              "rows": plan.rows, "row_tokens": rows.shape[1], "prefill": plan.prefill},
           "residual": plan.residual, "chunk": chunk, "max_context": model.spec.max_context,
           "quality": perplexity(model, rows, plan.prefill, plan.caches, plan.residual, on_step, chunk, plan.edges)}
    if plan.passkey:
        pk = plan.passkey
        out["passkey"] = {"lengths": pk.lengths, "depths": list(pk.depths), "keys": pk.keys, "seed": pk.seed,
                          "cells": passkey(model, tokens, prompts, plan.caches, pk, plan.residual,
                                           on_step and (lambda: on_step(1)))}
    return out

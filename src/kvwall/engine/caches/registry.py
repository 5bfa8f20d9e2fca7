"""The KV cache strategies the engine runs: one entry each, the one place their names and options live.

Torch-free (the CLI parses --cache without importing torch). Each entry names
    cls       the KVCache class, "module:Class", imported when a cache is made
    options   what may follow the name after colons ("int4:g64:sym", "sliding:1024:sink4"): the patterns of
              OPTIONS ("gN" group size, "sym", "W" a what-if window, "sinkN" attention-sink slots)
    knobs     make_cache keywords the strategy takes (block_size, residual)
    figure    which kvwall.predict figure its nbytes() equals, and `predict`, a function computing it
A new strategy is one new module (a KVCache subclass) plus one line in CACHES.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module

from kvwall.errors import KvwallError

BLOCK_SIZE = 16  # the paged cache's default tokens per block
RESIDUAL = 32  # the quantized caches keep the newest RESIDUAL .. RESIDUAL + group - 1 tokens in full precision


@dataclass(frozen=True)
class CacheChoice:
    """A parsed cache name: the registry entry and its options, e.g. "int4:g64:sym" -> int4, (g64, sym)."""

    name: str
    options: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        return ":".join((self.name, *self.options))

    @property
    def entry(self) -> CacheEntry:
        return CACHES[self.name]

    @property
    def format(self) -> str | None:
        """The KV storage format it names (kvwall.spec.formats text) for a quantized strategy, else None."""
        return self.text if self.entry.quantized else None

    @property
    def window(self) -> int | None:
        """sliding:W: the what-if window W (None: the model's own)."""
        from kvwall.units import parse_tokens

        return next((parse_tokens(o, "window") for o in self.options if option_kind(o) == "W"), None)

    @property
    def sink(self) -> int:
        """sliding:...:sinkS: the first S positions a windowed layer keeps (0: none)."""
        return next((int(o[4:]) for o in self.options if option_kind(o) == "sinkN"), 0)


@dataclass(frozen=True)
class CacheEntry:
    name: str
    cls: str  # "module:Class"
    about: str
    figure: str
    predict: Callable[..., int]  # (spec, batch, tokens, choice, element, **knobs) -> bytes
    options: tuple[str, ...] = ()
    knobs: tuple[str, ...] = ()
    quantized: bool = False  # its name and options are a kvwall storage format (int8:g32)

    def take(self, **given) -> dict:
        """The keywords of `given` (block_size=..., residual=...) that this strategy takes."""
        return {k: given[k] for k in self.knobs}

    def load(self) -> type:
        module, name = self.cls.split(":")
        return getattr(import_module(module), name)


# -- the predictor's figures (kvwall.predict is imported on use) ------------------------------------------

def _formats(element):
    from kvwall.predict.memory import Formats

    return Formats(element, element, element)


def as_stored(spec, kv):
    """The spec as the engine's caches hold it: a DSA layer's indexer key sits beside MLA's rope key in the K/V
    storage (engine/layers/sparse_latent.py kv_layout), so in the cache's K/V format `kv`, not in the format the
    predictor counts by default (SparseLatentAttention.index_keys: DeepSeek's fp8 + a scale per 128)."""
    from dataclasses import replace

    def stored(layer):
        m = layer.mixer
        return replace(layer, mixer=replace(m, index_keys=kv)) if m is not None and m.kind == "sparse_latent" \
            else layer

    return replace(spec, layers=tuple(stored(layer) for layer in spec.layers))


def whole_bytes(spec, batch, tokens, choice, element) -> int:
    """Every layer preallocated for every token, windows ignored."""
    from kvwall.predict.memory import memory

    spec = as_stored(spec, element)
    return memory(spec.with_window(None), batch=batch, context=tokens, formats=_formats(element)).cache_bytes


def sliding_spec(spec, choice: CacheChoice):
    """The model as a sliding cache runs it: its :W replaces the model's own window (spec.with_local_window:
    the windowed layers, or every attention layer of a model without one). -> (spec, sink)."""
    from kvwall.spec.model import softmax_attention  # a parallel hybrid's attention part counts (Falcon-H1)

    attention = [a for a in (softmax_attention(layer.mixer) for layer in spec.layers) if a is not None]
    if choice.window is not None:
        if not attention:
            raise KvwallError(f"cache {choice.text!r}: {spec.name} has no softmax attention layers to give a window")
        spec = spec.with_local_window(choice.window)
        attention = [a for a in (softmax_attention(layer.mixer) for layer in spec.layers) if a is not None]
    if choice.sink and not any(a.window for a in attention):
        raise KvwallError(f"cache {choice.text!r}: {spec.name} has no sliding window for sinks to go with; give one, "
                          f"e.g. sliding:1024:sink{choice.sink}")
    return spec, choice.sink


def windowed_bytes(spec, batch, tokens, choice, element) -> int:
    """Local layers hold their window (the what-if one of sliding:W), global ones every token. S sink slots
    beside a ring of W slots hold what a window of W + S holds: min(tokens, W + S) tokens per windowed layer."""
    from kvwall.predict.memory import memory

    spec, sink = sliding_spec(as_stored(spec, element), choice)
    return memory(_widened(spec, sink), batch=batch, context=tokens, formats=_formats(element)).cache_bytes


def _widened(spec, extra: int):
    """The spec with `extra` more tokens in every attention window (a ring of W slots plus S sinks)."""
    from dataclasses import replace

    from kvwall.spec.model import softmax_attention, with_attention  # a parallel hybrid's attention part too

    def wider(layer):
        a = softmax_attention(layer.mixer)
        if extra and a is not None and a.window:
            return replace(layer, mixer=with_attention(layer.mixer, window=a.window + extra))
        return layer

    return replace(spec, layers=tuple(wider(layer) for layer in spec.layers))


def fp8_bytes(spec, batch, tokens, choice, element) -> int:
    """Every layer preallocated for every token, K/V one byte each (fp8), any SSM state in the cache dtype."""
    from kvwall.predict.memory import Formats, memory
    from kvwall.spec.formats import get_format

    fm = Formats(element, get_format("fp8"), element)
    return memory(as_stored(spec, fm.kv).with_window(None), batch=batch, context=tokens, formats=fm).cache_bytes


def paged_bytes(spec, batch, tokens, choice, element, block_size: int = BLOCK_SIZE) -> int:
    """Whole blocks per row, every layer keeps every token."""
    from kvwall.predict.memory import memory

    return memory(as_stored(spec, element).with_window(None), batch=batch, context=tokens,
                  formats=_formats(element), block_size=block_size).cache_bytes


def kivi_bytes(spec, batch, tokens, choice, element, residual: int = RESIDUAL) -> int:
    """KIVI-style quantized K/V with a full-precision residual (every token kept), plus any SSM state."""
    from kvwall.predict.memory import kivi_cache_bytes, state_bytes
    from kvwall.spec.formats import get_format

    kv = kivi_cache_bytes(spec.with_window(None), batch=batch, context=tokens, kv=get_format(choice.format),
                          residual=residual, residual_format=element)
    return kv + batch * state_bytes(spec, element)


_QUANT = dict(cls="kvwall.engine.caches.quantized:QuantizedCache", options=("gN", "sym"), knobs=("residual",),
              quantized=True, predict=kivi_bytes, figure="predict.memory.kivi_cache_bytes(spec.with_window(None), "
              "context=tokens held, kv=the format, residual, residual_format=the cache dtype) + SSM state bytes")
CACHES: dict[str, CacheEntry] = {e.name: e for e in [
    CacheEntry("contiguous", "kvwall.engine.caches.contiguous:ContiguousCache",
               "preallocated to max_len for every layer", "memory(spec.with_window(None), context=max_len).cache_bytes",
               whole_bytes),
    CacheEntry("sliding", "kvwall.engine.caches.sliding:SlidingCache",
               "a ring of `window` slots on local layers, contiguous on global ones; sliding:W a what-if window W, "
               "sliding:W:sinkS also keeps the first S tokens (attention sinks)",
               "memory(spec with window W + S on its windowed layers, context=max_len).cache_bytes", windowed_bytes,
               options=("W", "sinkN")),
    CacheEntry("fp8", "kvwall.engine.caches.fp8:Fp8Cache", "contiguous, K/V stored as 8-bit floats (e4m3)",
               "memory(spec.with_window(None), context=max_len, kv=fp8).cache_bytes", fp8_bytes),
    CacheEntry("int8", about="KIVI-style int8 (keys per channel, values per token, fp residual)", **_QUANT),
    CacheEntry("int4", about="KIVI-style int4", **_QUANT),
    CacheEntry("int2", about="KIVI-style int2", **_QUANT),
    CacheEntry("paged", "kvwall.engine.caches.paged:PagedCache",
               "blocks from a pool, per-row block tables, freed when a sequence finishes",
               "memory(spec.with_window(None), context=tokens held, block_size=...).cache_bytes", paged_bytes,
               knobs=("block_size",)),
]}
CACHE_NAMES = tuple(CACHES)
EXAMPLES = {name: "int4:g64:sym" if e.quantized else "sliding:1024:sink4" for name, e in CACHES.items() if e.options}


# -- parsing ------------------------------------------------------------------------------------------------

OPTIONS = {  # pattern -> (regular expression, what it means): one place for every option's spelling
    "gN": (r"g[1-9]\d*", ":gN (group size, N > 0)"),
    "sym": (r"sym", ":sym (symmetric, no zero point)"),
    "W": (r"[1-9]\d*[kK]?", ":W (a what-if window of W tokens, e.g. 1024 or 1k)"),
    "sinkN": (r"sink[1-9]\d*", ":sinkS (also keep the first S tokens, S > 0)"),
}


def option_kind(opt: str) -> str | None:
    """The OPTIONS pattern one option matches ("g64" -> "gN", "sink4" -> "sinkN"), or None."""
    return next((kind for kind, (rx, _) in OPTIONS.items() if re.fullmatch(rx, opt)), None)


def parse_cache(text: str | CacheChoice) -> CacheChoice:
    """"int4:g64:sym" -> CacheChoice("int4", ("g64", "sym")); a one-line error for what it does not know."""
    if isinstance(text, CacheChoice):
        return text
    name, *options = str(text).strip().split(":")
    if name not in CACHES:
        raise KvwallError(f"unknown cache {text!r}; caches: {', '.join(CACHE_NAMES)}")
    allowed = CACHES[name].options
    takes = " and ".join(OPTIONS[a][1] for a in allowed)
    for opt in options:
        if not allowed:
            raise KvwallError(f"cache {text!r}: {name} takes no options; write just {name!r}")
        if option_kind(opt) not in allowed:
            raise KvwallError(f"cache {text!r}: option {opt!r} not understood; {name} takes {takes}, "
                              f"e.g. {EXAMPLES[name]}")
    kinds = [option_kind(opt) for opt in options]
    if len(set(kinds)) < len(kinds):
        raise KvwallError(f"cache {text!r}: an option is given twice; give each of {takes} at most once")
    return CacheChoice(name, tuple(options))


def predicted_bytes(cache: str | CacheChoice, spec, batch: int, tokens: int, element: str = "fp32",
                    block_size: int = BLOCK_SIZE, residual: int = RESIDUAL) -> int:
    """What kvwall.predict says the cache's nbytes() is once each of `batch` rows holds `tokens` tokens of a
    cache made for max_len = tokens, its K/V (and any SSM state) stored as `element` (the cache's dtype)."""
    from kvwall.spec.formats import get_format

    choice = parse_cache(cache)
    knobs = choice.entry.take(block_size=block_size, residual=residual)
    return choice.entry.predict(spec, batch, tokens, choice, get_format(element), **knobs)

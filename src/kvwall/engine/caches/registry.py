"""The KV cache strategies the engine runs: one entry each, the one place their names and options live.

Torch-free (the CLI parses --cache without importing torch). Each entry names
    cls       the KVCache class, "module:Class", imported when a cache is made
    options   what may follow the name after colons ("int4:g64:sym"): "gN" (group size) and "sym"
    knobs     make_cache keywords the strategy takes (block_size, residual)
    figure    which kvwall.predict figure its nbytes() equals, and `predict`, a function computing it
A new strategy is one new module (a KVCache subclass) plus one line in CACHES.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Callable

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
    def entry(self) -> "CacheEntry":
        return CACHES[self.name]

    @property
    def format(self) -> str | None:
        """The KV storage format it names (kvwall.spec.formats text) for a quantized strategy, else None."""
        return self.text if self.entry.quantized else None


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


def whole_bytes(spec, batch, tokens, choice, element) -> int:
    """Every layer preallocated for every token, windows ignored."""
    from kvwall.predict.memory import memory

    return memory(spec.with_window(None), batch=batch, context=tokens, formats=_formats(element)).cache_bytes


def windowed_bytes(spec, batch, tokens, choice, element) -> int:
    """Local layers hold their window, global ones every token."""
    from kvwall.predict.memory import memory

    return memory(spec, batch=batch, context=tokens, formats=_formats(element)).cache_bytes


def fp8_bytes(spec, batch, tokens, choice, element) -> int:
    """Every layer preallocated for every token, K/V one byte each (fp8), any SSM state in the cache dtype."""
    from kvwall.predict.memory import Formats, memory
    from kvwall.spec.formats import get_format

    fm = Formats(element, get_format("fp8"), element)
    return memory(spec.with_window(None), batch=batch, context=tokens, formats=fm).cache_bytes


def paged_bytes(spec, batch, tokens, choice, element, block_size: int = BLOCK_SIZE) -> int:
    """Whole blocks per row, every layer keeps every token."""
    from kvwall.predict.memory import memory

    return memory(spec.with_window(None), batch=batch, context=tokens, formats=_formats(element),
                  block_size=block_size).cache_bytes


def kivi_bytes(spec, batch, tokens, choice, element, residual: int = RESIDUAL) -> int:
    """KIVI-style quantized K/V with a full-precision residual (every token kept), plus any SSM state."""
    from kvwall.spec.formats import get_format
    from kvwall.predict.memory import kivi_cache_bytes, state_bytes

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
               "a ring of `window` slots on local layers, contiguous on global ones",
               "memory(spec, context=max_len).cache_bytes", windowed_bytes),
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


# -- parsing ------------------------------------------------------------------------------------------------

def _option_ok(opt: str, allowed: tuple[str, ...]) -> bool:
    """Whether one option matches one of the entry's patterns ("gN": g and a positive integer)."""
    if opt in allowed:
        return True
    return "gN" in allowed and opt[:1] == "g" and opt[1:].isdigit() and int(opt[1:]) > 0


def parse_cache(text: str | CacheChoice) -> CacheChoice:
    """"int4:g64:sym" -> CacheChoice("int4", ("g64", "sym")); a one-line error for what it does not know."""
    if isinstance(text, CacheChoice):
        return text
    name, *options = str(text).strip().split(":")
    if name not in CACHES:
        raise KvwallError(f"unknown cache {text!r}; caches: {', '.join(CACHE_NAMES)}")
    allowed = CACHES[name].options
    for opt in options:
        if not allowed:
            raise KvwallError(f"cache {text!r}: {name} takes no options; write just {name!r}")
        if not _option_ok(opt, allowed):
            raise KvwallError(f"cache {text!r}: option {opt!r} not understood; {name} takes :gN (group size, "
                              "N > 0) and :sym, e.g. int4:g64:sym")
    kinds = [opt[0] for opt in options]
    if len(set(kinds)) < len(kinds):
        raise KvwallError(f"cache {text!r}: an option is given twice; give each of :gN and :sym at most once")
    return CacheChoice(name, tuple(options))


def predicted_bytes(cache: str | CacheChoice, spec, batch: int, tokens: int, element: str = "fp32",
                    block_size: int = BLOCK_SIZE, residual: int = RESIDUAL) -> int:
    """What kvwall.predict says the cache's nbytes() is once each of `batch` rows holds `tokens` tokens of a
    cache made for max_len = tokens, its K/V (and any SSM state) stored as `element` (the cache's dtype)."""
    from kvwall.spec.formats import get_format

    choice = parse_cache(cache)
    knobs = choice.entry.take(block_size=block_size, residual=residual)
    return choice.entry.predict(spec, batch, tokens, choice, get_format(element), **knobs)

"""What fits: the longest context for a batch, the largest batch for a context.

A GPU's memory holds its share of the weights, its share of the cache, and a
reserve (activations, CUDA context, allocator slack: 10 % of memory by
default). With pipeline parallelism the busiest stage decides.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwall.errors import KvwallError
from kvwall.predict.memory import (
    NEVER,
    Formats,
    Parallel,
    cache_bytes_per_token,
    growth_bytes_per_token,
    memory,
    state_bytes,
)
from kvwall.spec.model import ModelSpec


def default_reserve(memory_bytes: int) -> int:
    """Memory kept free per GPU unless told otherwise (activations, CUDA context, allocator slack): 10 %."""
    return memory_bytes // 10


@dataclass
class Headroom:
    """Whether a given use of memory fits one GPU next to the reserve."""
    memory_bytes: int
    reserve_bytes: int
    free_bytes: int  # negative: short by that much

    @property
    def fits(self) -> bool:
        return self.free_bytes >= 0


def headroom(memory_bytes: int, used_bytes: int, reserve_bytes: int | None = None) -> Headroom:
    reserve = default_reserve(memory_bytes) if reserve_bytes is None else reserve_bytes
    return Headroom(memory_bytes, reserve, memory_bytes - reserve - used_bytes)


@dataclass
class FitResult:
    memory_bytes: int  # per GPU
    reserve_bytes: int
    weight_bytes: int  # per GPU (busiest stage)
    batch: int | None
    context: int | None
    max_context: int | None = None  # None with unbounded: the cache stops growing
    max_batch: int | None = None
    unbounded: bool = False
    weights_fit: bool = True

    @property
    def available_bytes(self) -> int:
        return self.memory_bytes - self.reserve_bytes - self.weight_bytes

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["available_bytes"] = self.available_bytes
        return d


def parse_reserve(text: str | None, memory_bytes: int) -> int:
    from kvwall.units import parse_bytes

    if text is None:
        return default_reserve(memory_bytes)
    text = str(text).strip()
    if text.endswith("%"):
        try:
            frac = float(text[:-1]) / 100
        except ValueError:
            raise KvwallError(f"bad reserve {text!r}: write a percentage such as 10% or a size such as 4GB") from None
        if not 0 <= frac < 1:
            raise KvwallError(f"bad reserve {text!r}: a percentage must be from 0% to below 100%")
        return int(memory_bytes * frac)
    return 0 if text == "0" else parse_bytes(text, "reserve")


def _need(spec, batch, context, formats, parallel, block) -> tuple[int, int]:
    """(per-GPU weights, per-GPU weights + cache) on the busiest stage."""
    rep = memory(spec, batch=batch, context=context, formats=formats, parallel=parallel, block_size=block)
    totals = [rep.stage_bytes(s) for s in range(len(rep.stages))]
    return max(w for w, _ in totals), max(w + c for w, c in totals)


def _largest(ok, lo: int, hi: int) -> int:
    """Largest n in [lo, hi] with ok(n), given ok(lo) and ok monotone decreasing."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def fit(spec: ModelSpec, memory_bytes: int, *, batch: int | None = None, context: int | None = None,
        formats: Formats | None = None, parallel: Parallel | None = None, reserve_bytes: int | None = None,
        block_size: int | None = None) -> FitResult:
    """Give a batch to get the longest context, or a context to get the largest batch."""
    formats = formats or Formats.for_spec(spec)
    parallel = parallel or Parallel()
    reserve = default_reserve(memory_bytes) if reserve_bytes is None else reserve_bytes
    budget = memory_bytes - reserve
    if budget <= 0:
        raise KvwallError("the reserve takes all of the memory; lower --reserve")
    weights, _ = _need(spec, 1, 1, formats, parallel, block_size)
    res = FitResult(memory_bytes, reserve, weights, batch, context)
    if weights > budget:
        res.weights_fit = False
        return res

    def fits(b: int, ctx: int) -> bool:
        return _need(spec, b, ctx, formats, parallel, block_size)[1] <= budget

    if context is None:
        b = batch or 1
        if fits(b, NEVER):
            res.unbounded = True
        elif fits(b, 1):
            res.max_context = _largest(lambda n: fits(b, n), 1, NEVER)
        else:
            res.max_context = 0
    else:
        if not fits(1, context):
            res.max_batch = 0
        else:
            hi = 1
            while fits(hi * 2, context) and hi < NEVER:
                hi *= 2
            res.max_batch = _largest(lambda n: fits(n, context), hi, hi * 2)
    return res


# -- placement: the smallest tensor-parallel group a deployment fits on -------------------------------------

TP_DEGREES = (1, 2, 4, 8)  # one node's worth of GPUs


@dataclass(frozen=True)
class Placement:
    """Where `batch` sequences of `context` tokens fit: the smallest tp (None: not on 8 GPUs of this device);
    `widest`: the largest degree the model's heads split into, the group a what-if that fits nowhere runs on."""

    tp: int | None
    batch: int
    context: int
    widest: int = TP_DEGREES[-1]

    @property
    def group(self) -> int:
        """The tp to time this placement on: where it fits, else the widest split (a what-if)."""
        return self.tp or self.widest

    @property
    def fits(self) -> bool:
        return self.tp is not None

    @property
    def gpus(self) -> int | None:
        return self.tp

    def label(self) -> str:
        return f"tp {self.tp}" if self.fits else f"does not fit {TP_DEGREES[-1]} GPUs"

    def as_dict(self) -> dict:
        return {"fits": self.fits, "tp": self.tp, "gpus": self.gpus}


def fits_on(spec: ModelSpec, memory_bytes: int, parallel: Parallel, *, batch: int = 1, context: int = 4096,
            formats: Formats | None = None, reserve_bytes: int | None = None) -> bool:
    """Whether the busiest GPU of `parallel` holds its weights and `batch` x `context` of cache, with the reserve."""
    reserve = default_reserve(memory_bytes) if reserve_bytes is None else reserve_bytes
    need = _need(spec, batch, context, formats or Formats.for_spec(spec), parallel, None)[1]
    return need <= memory_bytes - reserve


FIT_FIX = "more GPUs: --tp or --ep, a smaller --kv-format or --weight-format, or a smaller batch"


def fit_warning(spec: ModelSpec, memory_bytes: int, parallel: Parallel, *, batch: int, context: int,
                formats: Formats, device: str, beside: tuple[str, int] | None = None,
                fix: str = FIT_FIX) -> str | None:
    """None when the busiest GPU holds its weights and `batch` x `context` of cache (10 % reserve), and the
    bytes of `beside` (what, bytes: another model's weights on the same GPU); else why not, in one line."""
    from kvwall.units import fmt_bytes

    weights, need = _need(spec, batch, context, formats, parallel, None)
    budget, extra = memory_bytes - default_reserve(memory_bytes), beside[1] if beside else 0
    if need + extra <= budget:
        return None
    where = f"one {device}" if parallel.gpus == 1 else f"each of {parallel.gpus} {device} ({parallel.label()})"
    also = f" + {fmt_bytes(extra)} of {beside[0]}" if beside else ""
    return (f"batch {batch} x context {context:,} does not fit: {fmt_bytes(weights)} of weights + "
            f"{fmt_bytes(need - weights)} of cache per GPU{also}, {fmt_bytes(budget)} on {where} after the 10 % "
            f"reserve; its times are what-ifs ({fix})")


def placement(spec: ModelSpec, memory_bytes: int, *, batch: int = 1, context: int = 4096,
              formats: Formats | None = None, reserve_bytes: int | None = None) -> Placement:
    """The smallest tensor-parallel degree in TP_DEGREES whose busiest GPU holds its weights and cache
    (with the reserve); degrees the model's heads cannot be split into are skipped (SmolLM2's 9 heads: tp 1 only)."""
    widest = 1
    for tp in TP_DEGREES:
        try:
            if fits_on(spec, memory_bytes, Parallel(tp), batch=batch, context=context, formats=formats,
                       reserve_bytes=reserve_bytes):
                return Placement(tp, batch, context, tp)
        except KvwallError:  # tp does not divide the heads: try the next degree
            continue
        widest = tp
    return Placement(None, batch, context, widest)


def longest_on_group(spec: ModelSpec, memory_bytes: int, batch: int = 1,
                     formats: Formats | None = None) -> tuple[Placement, FitResult]:
    """The smallest tensor-parallel group that holds the weights, and the longest context `batch` gets on it."""
    p = placement(spec, memory_bytes, batch=batch, context=1, formats=formats)
    return p, fit(spec, memory_bytes, batch=batch, formats=formats, parallel=Parallel(p.group))


def compare_entry(spec: ModelSpec, formats: Formats, contexts: list[int], batch: int, memory_bytes: int) -> dict:
    """One model's row of `kvwall compare`: cache per token and at each context, and the longest context that fits
    on the smallest tensor-parallel group (1, 2, 4 or 8 GPUs of this memory) that holds the weights."""
    p, f = longest_on_group(spec, memory_bytes, batch, formats)
    return {
        "model": spec.name, "family": spec.family(), "params": spec.params(), "formats": formats.as_dict(),
        "cache_bytes_per_token": cache_bytes_per_token(spec, formats.kv),
        "growth_bytes_per_token": growth_bytes_per_token(spec, formats.kv),
        "state_bytes_per_sequence": state_bytes(spec, formats.state),
        "cache_bytes": {str(c): memory(spec, batch=batch, context=c, formats=formats).cache_bytes for c in contexts},
        "weight_bytes": f.weight_bytes, "weights_fit": p.fits, **p.as_dict(),
        "max_context": None if f.unbounded else f.max_context, "max_context_unbounded": f.unbounded,
        "model_max_context": spec.max_context,
    }

"""What one forward step is, and one op of it: FLOPs and bytes (the units ops.py and the mixers count in).

A *step* feeds ``new`` tokens to each of ``batch`` sequences whose cache already holds ``past``
tokens: prefill is ``past=0, new=P``; one decode step at context L is ``past=L-1, new=1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwall.spec.formats import Format

ACT_BYTES = 2  # activations in 16-bit

# What an op streams, for the roofline and the reports (not matched by name anywhere):
MATMUL = "matmul"  # a projection: reads its weights once per step
CACHE = "cache"  # work over the held tokens of the cache (attention; MLA's naive up-projection)
SCAN = "scan"  # an SSM's state update
GATHER = "gather"  # the embedding lookup
LINK = "link"  # bytes over the interconnect (tensor / pipeline parallel)
PREFILL_ATTENTION = "attention:prefill"  # the causal kernel over a step's fresh tokens (a calibrated kernel name)


@dataclass
class Op:
    name: str
    layer: int | None
    flops: float = 0.0
    weight_bytes: float = 0.0
    cache_read: float = 0.0
    cache_write: float = 0.0
    state_bytes: float = 0.0
    act_bytes: float = 0.0
    link_bytes: float = 0.0  # bytes over the interconnect (tensor/pipeline parallel)
    kernel: str = ""  # which calibrated kernel streams this op's cache ("attention", "attention:int8", ...)
    kind: str = MATMUL
    detail: str = ""  # printed after the name, e.g. "1.9 of 8 touched"
    rows: float = 0  # a matmul's rows (tokens multiplied by each weight; 0: not a matmul): on a CPU the rate
    # its weights stream at depends on it (torch's fp32 matmul here: 21 GB/s at 1 row, 6.6 GB/s at 16); a
    # prefill attention's query tokens per sequence, which its FLOP rate depends on (36 GFLOP/s at 128, 75 at 2k)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.detail})" if self.detail else self.name

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.cache_read + self.cache_write + self.state_bytes + self.act_bytes

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else float("inf")

    def as_dict(self) -> dict:
        # null, not Infinity, for an op that moves no memory (a collective): --json stays valid JSON
        out = {**self.__dict__, "bytes": self.bytes, "intensity": self.intensity if self.bytes else None}
        out["group"], out["name"] = self.name, self.label
        return out


@dataclass(frozen=True)
class Step:
    batch: int
    past: int  # tokens already in each sequence's cache
    new: int  # tokens fed per sequence this step

    @property
    def tokens(self) -> int:
        return self.batch * self.new

    def pairs(self, window: int | None) -> int:
        """Query-key pairs per sequence, causal, each query seeing at most `window` keys."""
        total = 0
        lo, hi = self.past + 1, self.past + self.new  # positions (1-based) of the new queries
        if window is None or hi <= window:
            return (lo + hi) * self.new // 2
        if lo <= window:
            total += (lo + window) * (window - lo + 1) // 2
            lo = window + 1
        return total + (hi - lo + 1) * window

    def held(self, window: int | None) -> int:
        ctx = self.past + self.new
        return min(ctx, window) if window else ctx

    def chunk_pairs(self, chunk: int) -> int:
        """Query-key pairs per sequence under chunked attention: the query at position q (1-based) sees the
        ((q - 1) mod chunk) + 1 tokens of its own chunk up to itself."""
        def upto(n: int) -> int:  # pairs of positions 1..n: whole chunks of chunk(chunk+1)/2, then the rest
            full, rest = divmod(n, chunk)
            return full * chunk * (chunk + 1) // 2 + rest * (rest + 1) // 2
        return upto(self.past + self.new) - upto(self.past)

    def chunk_held(self, chunk: int) -> int:
        """Tokens a chunked layer reads this step: from the start of the first new query's chunk to the last new
        token (a decode step at position q: ((q - 1) mod chunk) + 1, from 1 up to chunk)."""
        start = self.past // chunk * chunk  # tokens before the first new query's chunk
        return self.past + self.new - start


def matmul(name: str, layer: int | None, tokens: int, n_in: int, n_out: float, wfmt: Format) -> Op:
    return Op(name, layer, flops=2 * tokens * n_in * n_out, weight_bytes=n_in * n_out * wfmt.bytes_per_element(),
              act_bytes=tokens * (n_in + n_out) * ACT_BYTES, rows=tokens, kernel=matmul_kernel(wfmt))


def fixed_key(op: Op) -> str:
    """The key of an op's fixed cost per call in a profile's op_fixed_s: its kernel; a float matrix's (kernel "")
    is MATMUL, the key its streaming rate has in op_bandwidth too."""
    return op.kernel or (MATMUL if op.kind == MATMUL else "")


def matmul_kernel(wfmt: Format) -> str:
    """The calibrated kernel a matmul's weights stream through: a float matrix (F.linear) or the engine's
    packed kernel for integer codes of up to 4 or 8 bits ("matmul:int4", "matmul:int8"; `local` only)."""
    if wfmt.is_float() or wfmt.bits > 8:
        return ""
    return "matmul:int4" if wfmt.bits <= 4 else "matmul:int8"


def per_head(name: str, layer: int, tokens: int, heads: int, n_in: int, n_out: int, wfmt: Format) -> Op:
    """A batched per-head matmul (MLA's absorbed projections): heads x (n_in -> n_out)."""
    return Op(name, layer, flops=2 * tokens * heads * n_in * n_out,
              weight_bytes=heads * n_in * n_out * wfmt.bytes_per_element(),
              act_bytes=tokens * heads * (n_in + n_out) * ACT_BYTES, rows=tokens)


def split(n: int, tp: int, what: str, by: str = "tp") -> int:
    """n split tp ways, or a one-line error naming what does not divide (`by`: the option that splits it)."""
    from kvwall.errors import KvwallError

    if n % tp:
        raise KvwallError(f"{by}={tp} does not divide the {n} {what}; pick a divisor")
    return n // tp

"""Request streams and what serving them cost: the one place `kvwall simulate` and `kvwall loadtest` share.

Torch-free. A stream is a list of Requests (arrival time, prompt and output tokens), made from
token-length specs ("512", "lognormal:mean=512,sd=0.5", "uniform:min=64,max=512") and Poisson
arrivals, or read from a JSONL dataset. Each served request leaves a Record (when it arrived, got its
first token, and each later token); `summarize` turns records into latency percentiles, throughput and
goodput under an SLO.

Conventions (the same as vLLM's benchmark_serving and llm-perf's, so numbers compare):
* TTFT = first token - arrival (queueing included);
* TPOT = (last token - first token) / (output tokens - 1), per request (undefined for 1 token);
* ITL = every gap between consecutive tokens of a request;
* goodput = requests per second that meet every SLO given (TTFT and TPOT at or under the limits).
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvwall.errors import KvwallError
from kvwall.files import read_user_text
from kvwall.units import ascii_digits

MAX_REQUESTS = 1_000_000
MAX_TOKENS = 2**31  # a request's prompt or output: far past any model's context, keeps every sum an exact float
PERCENTILES = (50, 90, 99)


# -- token lengths ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Lengths:
    """A token-length distribution: fixed, lognormal (mean of the lengths, sd of their log) or uniform."""

    kind: str
    a: float
    b: float = 0.0

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        mu = math.log(self.a) - self.b**2 / 2  # so that the lengths' mean is `a`
        return max(1, round(rng.lognormvariate(mu, self.b)))


_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)"  # 512, 0.5, .5 or 5.: what float() reads, never '.' or '1.2.3'
_SPEC = re.compile(rf"(lognormal|uniform):(\w+)={_NUMBER},(\w+)={_NUMBER}", re.ASCII)
_KEYS = {"lognormal": ("mean", "sd"), "uniform": ("min", "max")}


def parse_lengths(text: str, what: str = "token length") -> Lengths:
    """'512' | 'lognormal:mean=512,sd=0.5' | 'uniform:min=64,max=512' -> Lengths; one-line errors."""
    text = str(text).strip()
    if ascii_digits(text):
        if len(text.lstrip("0")) > 10 or not 1 <= int(text) <= MAX_TOKENS:  # (10 digits: MAX_TOKENS has them)
            raise KvwallError(f"bad {what} {text!r}: a length must be from 1 to {MAX_TOKENS:,} tokens")
        return Lengths("fixed", int(text))
    m = _SPEC.fullmatch(text)
    hint = f"bad {what} {text!r}: write 512, lognormal:mean=512,sd=0.5 or uniform:min=64,max=512"
    if not m or (m.group(2), m.group(4)) != _KEYS[m.group(1)]:
        raise KvwallError(hint)
    kind, a, b = m.group(1), float(m.group(3)), float(m.group(5))
    if kind == "lognormal" and not (1 <= a <= MAX_TOKENS and 0 <= b <= 3):
        raise KvwallError(f"bad {what} {text!r}: the mean must be from 1 to {MAX_TOKENS:,} and sd from 0 to 3")
    if kind == "uniform" and not (1 <= a <= b <= MAX_TOKENS and a == int(a) and b == int(b)):
        raise KvwallError(f"bad {what} {text!r}: min and max must be whole numbers with 1 <= min <= max <= "
                          f"{MAX_TOKENS:,}")
    return Lengths(kind, a, b)


# -- request streams --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Request:
    id: int
    arrival_s: float  # 0 for every request of a closed-loop (fixed concurrency) run
    prompt_tokens: int
    output_tokens: int
    prompt: str | None = None  # the text, when a dataset gives one
    shared_tokens: int = 0  # leading prompt tokens every request has in common (a system prompt), in prompt_tokens


def stream(n: int, prompt: Lengths, output: Lengths, rate: float | None = None, seed: int = 0) -> list[Request]:
    """n requests with lengths drawn from the specs; Poisson arrivals at `rate` per second (None: all at 0)."""
    _check_count(n)
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise KvwallError(f"bad request rate {rate!r}: give a positive number of requests per second")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if rate is not None:
            t += rng.expovariate(rate)
        out.append(Request(i, t, prompt.draw(rng), output.draw(rng)))
    return out


def with_shared_prefix(requests: list[Request], tokens: int) -> list[Request]:
    """Every prompt begins with the same `tokens` tokens (a system prompt), put before its own: vLLM's
    benchmark convention (its random dataset's prefix length is added to the input length)."""
    if not (isinstance(tokens, int) and 0 <= tokens <= MAX_TOKENS):
        raise KvwallError(f"bad shared prefix {tokens!r}: give a whole number of tokens >= 0")
    return [replace(r, prompt_tokens=r.prompt_tokens + tokens, shared_tokens=r.shared_tokens + tokens)
            for r in requests] if tokens else requests


def load_dataset(path: str | Path, n: int | None = None, rate: float | None = None, seed: int = 0) -> list[Request]:
    """Requests from a JSONL file, one object a line: {"prompt": text} or {"prompt_tokens": N}, and
    {"output_tokens": M}, optionally {"arrival_s": T} (a recorded trace: replayed as recorded, `rate` ignored)
    and {"shared_tokens": S} (its first S prompt tokens are the same as every other request's first S).
    A malformed line is a one-line error naming it. Without recorded arrivals: as in `stream`."""
    path = Path(path)
    lines = read_user_text(path, "--dataset", "a UTF-8 JSONL file, one request a line").splitlines()
    rows = [_row(path, k + 1, line) for k, line in enumerate(lines) if line.strip()]
    if not rows:
        raise KvwallError(f"dataset {path} has no requests; write one JSON object per line")
    rows = rows[:n] if n else rows
    recorded = [t for _, _, _, t, _ in rows if t is not None]
    if recorded and len(recorded) < len(rows):
        raise KvwallError(f"dataset {path}: some lines have arrival_s and some do not; give it on every line or none")
    if not recorded:
        recorded = [r.arrival_s for r in stream(len(rows), Lengths("fixed", 1), Lengths("fixed", 1), rate, seed)]
    return [Request(i, t, p, o, text, shared) for i, (t, (p, o, text, _, shared)) in enumerate(zip(recorded, rows))]


def _row(path: Path, k: int, line: str) -> tuple[int, int, str | None, float | None, int]:
    where = f"dataset {path} line {k}"
    try:
        obj = json.loads(line)
    except ValueError:
        raise KvwallError(f"{where} is not JSON; write one object per line") from None
    if not isinstance(obj, dict):
        raise KvwallError(f"{where} is not a JSON object")
    text = obj.get("prompt")
    if text is not None and not (isinstance(text, str) and text):  # kvwall serve and loadtest refuse "" too
        raise KvwallError(f"{where}: prompt must be a non-empty string, got {text!r}; give its text, "
                          "or prompt_tokens instead")
    tokens = obj.get("prompt_tokens", max(1, len(text) // 4) if isinstance(text, str) else None)  # ~4 chars a token
    out = obj.get("output_tokens")
    for name, v in (("prompt_tokens (or a prompt text)", tokens), ("output_tokens", out)):
        if not (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_TOKENS):
            raise KvwallError(f"{where}: {name} must be a whole number from 1, got {v!r}")
    at = obj.get("arrival_s")
    if at is not None and not (isinstance(at, (int, float)) and not isinstance(at, bool) and 0 <= at < 1e9):
        raise KvwallError(f"{where}: arrival_s must be a time in seconds >= 0, got {at!r}")
    shared = obj.get("shared_tokens", 0)
    if not (isinstance(shared, int) and not isinstance(shared, bool) and 0 <= shared <= tokens):
        raise KvwallError(f"{where}: shared_tokens must be a whole number from 0 to prompt_tokens, got {shared!r}")
    return tokens, out, text if isinstance(text, str) else None, None if at is None else float(at), shared


def _check_count(n: int) -> None:
    if not (isinstance(n, int) and 1 <= n <= MAX_REQUESTS):
        raise KvwallError(f"bad request count {n!r}: give 1 to {MAX_REQUESTS:,} requests")


# -- what serving them cost -------------------------------------------------------------------------

@dataclass
class Record:
    """One request as served: its arrival and the time of every token it got (seconds, one clock)."""

    request: Request
    token_times: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.request.arrival_s if self.token_times else None

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.request.arrival_s if self.token_times else None

    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    def meets(self, slo_ttft: float | None, slo_tpot: float | None) -> bool:
        return not self.error and bool(self.token_times) and meets(self.ttft, self.tpot, slo_ttft, slo_tpot)


def meets(ttft: float, tpot: float | None, slo_ttft: float | None, slo_tpot: float | None) -> bool:
    """Whether a served request met the SLO given (a one-token answer has no TPOT to miss)."""
    ok_ttft = slo_ttft is None or ttft <= slo_ttft
    return ok_ttft and (slo_tpot is None or tpot is None or tpot <= slo_tpot)


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile, linear between the closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def distribution(values: list[float]) -> dict:
    """Mean and the PERCENTILES of the values (None each when there are none)."""
    out = {f"p{p}": percentile(values, p) for p in PERCENTILES}
    out["mean"] = sum(values) / len(values) if values else None
    return out


def summarize(records: list[Record], slo_ttft: float | None = None, slo_tpot: float | None = None) -> dict:
    """Latency percentiles, throughput and goodput over the span from the first arrival to the last token."""
    done = [r for r in records if not r.error and r.token_times]
    if not done:
        return {"requests": len(records), "completed": 0, "errors": len(records) - len(done), "duration_s": 0.0}
    start = min(r.request.arrival_s for r in records)
    span = max(r.token_times[-1] for r in done) - start
    rate = (lambda n: n / span) if span > 0 else (lambda n: None)
    tokens = sum(len(r.token_times) for r in done)
    return {"requests": len(records), "completed": len(done), "errors": len(records) - len(done), "duration_s": span,
            "request_throughput": rate(len(done)), "output_token_throughput": rate(tokens),
            "goodput": rate(sum(r.meets(slo_ttft, slo_tpot) for r in done)),
            "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
            "ttft_s": distribution([r.ttft for r in done]),
            "tpot_s": distribution([r.tpot for r in done if r.tpot is not None]),
            "itl_s": distribution([g for r in done for g in r.itl()]), "e2e_s": distribution([r.e2e for r in done])}

"""Drive any OpenAI-compatible server (kvwall serve, vLLM, llama.cpp's server) with a stream of requests.

Arrivals are Poisson at `rate` requests/s (exponential gaps, seeded) or a fixed number of clients
(`concurrency`) each sending its next request when the last one ends. Every request streams
/v1/completions (server-sent events) and is timed on the client:

    TTFT   time to the first text chunk            e2e    time to the end of the stream
    ITL    gaps between text chunks                TPOT   (e2e - TTFT) / (output tokens - 1)

Output tokens come from the server's usage (stream_options.include_usage), else one per text chunk.
Prompts are `prompt_tokens` words drawn from a fixed list (about one token each; the usage gives the
true count), or (`token_ids`) exactly that many random token ids, which OpenAI's completions API takes as a
prompt (a long prompt sized to the model's whole context needs the exact count: a word can be two tokens), or a
dataset's prompts in turn (JSON lines, {"prompt": ...}); ignore_eos (vLLM, kvwall) and
min_tokens (vLLM, llama-cpp-python, which has no ignore_eos) ask the server to run to `output_tokens`.
Every loop is bounded: N requests, each with a timeout.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field

from kvwall.errors import KvwallError
from kvwall.files import read_user_text
from kvwall.workload import distribution, meets

WORDS = ("the of and to in is was for on that with as by at from his her are this have one had not but what all "
         "were when we there can an your which their said if do will each about how up out them then she many "
         "some so these would other into has more two like him see time could no make than first been its who "
         "now people my made over did down only way find use may water long little very after words called just "
         "where most know get through back much before go good new write our used me man too any day same right "
         "look think also around another came come work three word must because does part even place well").split()


@dataclass
class Load:
    url: str
    model: str
    requests: int
    rate: float | None = None  # requests per second (Poisson); None: fixed concurrency
    concurrency: int | None = None
    prompt_tokens: int = 128
    output_tokens: int = 64
    seed: int = 0
    timeout: float = 120.0  # seconds, per request
    api_key: str | None = None
    dataset: list[str] | None = None  # prompts to send in turn instead of random words
    shared_prefix: int = 0  # words every prompt begins with (a system prompt), before its own
    token_ids: int = 0  # > 0: prompts (and the shared prefix) as token ids drawn from [0, token_ids); 0: words


@dataclass
class Sample:
    start: float  # seconds since the run began
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, from the server's prefix cache (its usage.prompt_tokens_details)
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    refused: bool = False  # the server turned it down (Refused, or no connection) rather than failing to serve it

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def prompts(load: Load) -> list[str] | list[list[int]]:
    """The dataset's prompts in turn (repeated as needed), else `prompt_tokens` seeded random words each (token
    ids, with `token_ids`); after the same `shared_prefix` seeded words or ids, when asked (as `kvwall simulate
    --shared-prefix`)."""
    rng = random.Random(load.seed)
    if load.token_ids:
        prefix = [rng.randrange(load.token_ids) for _ in range(load.shared_prefix)]
        return [prefix + [rng.randrange(load.token_ids) for _ in range(load.prompt_tokens)]
                for _ in range(load.requests)]
    prefix = [rng.choice(WORDS) for _ in range(load.shared_prefix)]
    if load.dataset:
        own = [load.dataset[i % len(load.dataset)] for i in range(load.requests)]
    else:
        own = [" ".join(rng.choice(WORDS) for _ in range(load.prompt_tokens)) for _ in range(load.requests)]
    return [" ".join(prefix + [p]) for p in own] if prefix else own


def read_dataset(path) -> list[str]:
    """A JSON-lines file, one {"prompt": "..."} per line (blank lines skipped) -> the prompts."""
    lines = read_user_text(path, "--dataset", 'a UTF-8 JSONL file, one {"prompt": "..."} a line').splitlines()
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            prompt = None
        if not isinstance(prompt, str) or not prompt:
            raise KvwallError(f"{path} line {n}: expected a JSON object with a non-empty \"prompt\" string")
        out.append(prompt)
    if not out:
        raise KvwallError(f"{path} holds no prompts; write one {{\"prompt\": \"...\"}} per line")
    return out


def check_rate(rate: float, timeout: float, requests: int, option: str = "--rate") -> None:
    """Refuse a Poisson rate whose mean gap 1 / rate is longer than the per-request `timeout`: no two requests would
    overlap (it loads nothing), and the arrivals alone would take (requests - 1) / rate seconds (32 at 1e-6/s: a
    year). At the limit a run lasts about requests x timeout at most, as one client (--concurrency 1) would."""
    if requests > 1 and 1 / rate > timeout:
        raise KvwallError(f"{option} {rate:g}: requests would arrive {1 / rate:,.0f} s apart on average, longer than "
                          f"--timeout ({timeout:g} s), so none would overlap and the {requests} arrivals alone would "
                          f"take about {(requests - 1) / rate:,.0f} s; give a rate of at least {1 / timeout:.3g}/s "
                          "or a longer --timeout")


class Refused(RuntimeError):
    """The server turned a request down: HTTP 4xx but 408 and 429 (those are load). A wrong --model (kvwall serve
    answers 400, vLLM 404), --api-key (401) or URL path: every request would be."""


def refused(exc: BaseException) -> bool:
    """Whether an error of `one` is a refusal (Refused, or no connection: nothing listens there)."""
    import httpx

    return isinstance(exc, (Refused, httpx.ConnectError))


def base_url(url: str) -> str:
    """http://host:port or .../v1 -> http://host:port/v1."""
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise KvwallError(f"{url!r} is not an http(s) URL; give e.g. http://127.0.0.1:8000")
    return url if url.endswith("/v1") else url + "/v1"


async def one(client, load: Load, prompt: str | list[int], t0: float) -> Sample:
    """One streamed completion, timed; an HTTP or stream error becomes the sample's error."""
    s = Sample(time.perf_counter() - t0)
    body = {"model": load.model, "prompt": prompt, "max_tokens": load.output_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
            "min_tokens": load.output_tokens}
    try:
        await asyncio.wait_for(_stream(client, load, body, s), load.timeout)
    except asyncio.TimeoutError:
        s.error = f"timed out after {load.timeout:g} s"
    except Exception as e:  # a refused connection, a reset, a malformed event: counted (the first refusal: _Gate)
        s.error = f"{type(e).__name__}: {e}"
        s.refused = refused(e)
    return s


async def _stream(client, load: Load, body: dict, s: Sample) -> None:
    start, last, chunks = time.perf_counter(), None, 0
    async with client.stream("POST", base_url(load.url) + "/completions", json=body) as resp:
        if resp.status_code != 200:
            text = " ".join((await resp.aread()).decode(errors="replace").split())[:200]  # one line, for the error
            load_error = resp.status_code in (408, 429) or resp.status_code >= 500
            raise (RuntimeError if load_error else Refused)(f"HTTP {resp.status_code}: {text}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(str(event["error"].get("message", event["error"])))
            now = time.perf_counter()
            if event.get("choices") and event["choices"][0].get("text"):
                chunks += 1
                if last is None:
                    s.ttft = now - start
                else:
                    s.itl.append(now - last)
                last = now
            if event.get("usage"):
                s.prompt_tokens = event["usage"].get("prompt_tokens", 0)
                s.output_tokens = event["usage"].get("completion_tokens", 0)
                s.cached_tokens = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    s.e2e = time.perf_counter() - start
    s.output_tokens = s.output_tokens or chunks
    s.ok = s.ttft is not None
    if not s.ok:
        s.error = "the stream carried no text"


async def run(load: Load, progress=None) -> tuple[list[Sample], float]:
    """All requests, Poisson or fixed concurrency -> (samples, wall seconds)."""
    import httpx

    texts, rng = prompts(load), random.Random(load.seed + 1)
    headers = {"Authorization": f"Bearer {load.api_key}"} if load.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=load.timeout, headers=headers, limits=limits) as client:
        t0 = time.perf_counter()
        gate = _Gate()

        async def send(i: int) -> Sample:
            gate.sent += 1
            s = await one(client, load, texts[i], t0)
            gate.saw(s)
            if progress:
                progress(s)
            return s

        schedule = asyncio.create_task(_poisson(send, load, rng) if load.rate else _clients(send, load))
        gate.stop = schedule.cancel
        try:
            samples = await schedule
        except asyncio.CancelledError:
            if gate.refusal is None:  # not the gate's: an interrupt
                raise
            raise KvwallError(gate.why(load)) from None
        return samples, time.perf_counter() - t0


class _Gate:
    """Ends a run at the first request the server refuses before any has completed: it is down, or turns every
    request away (a wrong --model or --api-key), and the rest of the schedule would only wait (32 requests at
    0.01/s: about 50 minutes). Once some were served, a refusal is counted among the errors."""

    def __init__(self):
        self.sent, self.served, self.refusal = 0, False, None
        self.stop = lambda: None  # cancels the schedule (run sets it)

    def saw(self, s: Sample) -> None:
        self.served = self.served or s.ok
        if s.refused and not self.served and self.refusal is None:
            self.refusal = s
            self.stop()

    def why(self, load: Load) -> str:
        return (f"{load.url} refused a request before any completed ({self.refusal.error}); stopped after sending "
                f"{self.sent} of {load.requests}: is the server up and serving {load.model!r}, and the --api-key "
                "right?")


async def _poisson(send, load: Load, rng: random.Random) -> list[Sample]:
    tasks = []
    try:
        for i in range(load.requests):
            tasks.append(asyncio.create_task(send(i)))
            if i + 1 < load.requests:
                await asyncio.sleep(rng.expovariate(load.rate))
        return list(await asyncio.gather(*tasks))
    finally:  # cancelled (_Gate): the requests still in flight go too
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _clients(send, load: Load) -> list[Sample]:
    todo = iter(range(load.requests))
    samples: list[Sample] = []

    async def client_loop():
        for i in todo:  # the clients share one iterator: each request is sent once
            samples.append(await send(i))

    await asyncio.gather(*(client_loop() for _ in range(min(load.concurrency, load.requests))))
    return samples


# -- the summary --------------------------------------------------------------------------------------------

def percentiles(values: list[float]) -> dict | None:
    """workload.distribution (the simulator's too), or None for no values."""
    return distribution(values) if values else None


def summarize(load: Load, samples: list[Sample], wall: float, slo_ttft: float | None = None,
              slo_tpot: float | None = None) -> dict:
    ok = [s for s in samples if s.ok]
    tpots = [s.tpot for s in ok if s.tpot is not None]
    good = [s for s in ok if meets(s.ttft, s.tpot, slo_ttft, slo_tpot)]
    out_tokens = sum(s.output_tokens for s in ok)
    errors = [s.error for s in samples if not s.ok]
    return {"url": load.url, "model": load.model, "requests": len(samples), "completed": len(ok),
            "errors": len(errors), "first_errors": errors[:3], "wall_s": wall,
            "mode": f"poisson {load.rate:g}/s" if load.rate else f"concurrency {load.concurrency}",
            "request_throughput": len(ok) / wall, "output_token_throughput": out_tokens / wall,
            "prompt_tokens": sum(s.prompt_tokens for s in ok), "output_tokens": out_tokens,
            "cached_prompt_tokens": sum(s.cached_tokens for s in ok),
            "prompts": (f"token ids below {load.token_ids}" if load.token_ids else "dataset" if load.dataset
                        else "words"),  # in prompts()'s order: token ids before a dataset
            "goodput": len(good) / wall, "slo_ttft_s": slo_ttft, "slo_tpot_s": slo_tpot,
            "ttft_s": percentiles([s.ttft for s in ok]), "tpot_s": percentiles(tpots),
            "itl_s": percentiles([g for s in ok for g in s.itl]), "e2e_s": percentiles([s.e2e for s in ok]),
            "samples": [asdict(s) for s in samples]}

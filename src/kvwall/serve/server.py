"""The OpenAI HTTP API over the engine worker (Starlette + uvicorn): a thin layer that parses, submits, streams.

    POST /v1/completions        prompt (text, token ids, or a list of one text), max_tokens (default 16)
    POST /v1/chat/completions   messages through the model's chat template (a plain "role: text" one without)
        both: temperature (default 1), top_p, seed, stop (a string or up to 4), stream (server-sent events,
        stream_options.include_usage), n = 1 only, ignore_eos (vLLM's extension); the answer carries usage
    GET  /v1/models, /health, /metrics (Prometheus text: requests, KV blocks, preemptions, prefix hits, tok/s)

A bad request gets OpenAI's error object with status 400 (413 for a body past max_body_bytes, 401 on a
/v1/ route without the --api-key when one is set; /health and /metrics stay open) and never reaches the
engine. The body is parsed and tokenized off the event loop. A client that disconnects aborts its request:
its blocks are free before the next step. Stop strings are found in the decoded text; the text stops before
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvwall.engine.generate import Sampling
from kvwall.errors import KvwallError
from kvwall.serve.scheduler import Request
from kvwall.serve.worker import Handle, Worker

CHAT_MAX_TOKENS = 256  # chat's default max_tokens (OpenAI's is "up to the context")
# Request body bytes per token of the longest sequence the server can hold: a token id in a JSON list takes at most
# 8 bytes ("128255, "), English text about 4 a token, and JSON's \uXXXX escapes 12 for an emoji (1-2 tokens): 64
# leaves 5x room over the worst of those, and a 128k-token context allows 8 MiB (a 20 MB prompt was read and
# tokenized for 10 s before the context check refused it).
BODY_BYTES_PER_TOKEN = 64
MIN_BODY_BYTES = 1 << 20  # chat templates, role names and JSON around a small model's short context


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status


def error_response(e: BadRequest) -> JSONResponse:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    body = {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status)


def max_body_bytes(runner) -> int:
    """The request body cap: BODY_BYTES_PER_TOKEN for each token of the longest sequence the server can run (the
    model's context, or the whole pool where that is smaller or the context unknown), at least MIN_BODY_BYTES."""
    pool = runner.sched.pool
    tokens = min(filter(None, (runner.model.spec.context_limit, pool.n_blocks * pool.block_size)))
    return max(BODY_BYTES_PER_TOKEN * tokens, MIN_BODY_BYTES)


class KeyCheck:
    """ASGI middleware: every /v1/ route needs `Authorization: Bearer KEY`, compared in constant time (a plain ==
    returns sooner the earlier a guess differs); /health and /metrics stay open for probes and scrapers."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == "/v1" or path.startswith("/v1/")):
            sent = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(sent, self.expected):
                e = BadRequest("missing or wrong API key (send Authorization: Bearer KEY)", code="invalid_api_key",
                               status=401)
                return await error_response(e)(scope, receive, send)
        await self.app(scope, receive, send)


class Disconnected(Exception):
    """The client of a whole (non-streamed) answer went away."""


class IdText:
    """What a model without a tokenizer speaks: prompts as token ids, text out as space-separated ids."""

    def encode(self, text: str) -> list[int]:
        raise BadRequest("this model has no tokenizer; send the prompt as a list of token ids", "prompt")

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


# -- parsing a request body ------------------------------------------------------------------------------

@dataclass
class Job:
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stops: list[str]
    stream: bool
    usage_in_stream: bool
    ignore_eos: bool = False  # vLLM's and llama.cpp's extension: run to max_tokens (load tests)


def _shown(value, most: int = 40) -> str:
    """A client's value in an error message: its repr, cut (a 4,000-digit max_tokens is not echoed whole)."""
    text = repr(value)
    return text if len(text) <= most else text[:most] + "..."


def _number(body: dict, key: str, default, lo: float, hi: float, whole: bool = False):
    value = body.get(key, default)
    if value is None:
        return default
    ok = isinstance(value, int) if whole else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not lo <= value <= hi:
        kind = "an integer" if whole else "a number"
        raise BadRequest(f"{key} must be {kind} in [{lo}, {hi}] (got {_shown(value)})", key)
    return value


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a non-empty string or a list of up to 4 of them", "stop")
    return stops


def _prompt_ids(prompt, tok) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tok.encode(prompt) if prompt else []
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = prompt
    else:
        raise BadRequest("prompt must be a string, a list of one string, or a list of token ids", "prompt")
    if not ids:
        raise BadRequest("the prompt is empty; give at least one token", "prompt")
    return ids


def _chat_ids(messages, tok) -> list[int]:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise BadRequest("messages must be a non-empty list of {role, content} objects with string content",
                         "messages")
    if hasattr(tok, "encode_chat"):
        return tok.encode_chat(messages)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return tok.encode(text)


def _no_constant(name: str):
    raise BadRequest(f"the request body is not valid JSON: {name} is not a JSON number")


def parse_body(raw: bytes) -> dict:
    """The request body's bytes -> its JSON object; BadRequest for anything else, naming the field at fault."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)  # NaN, Infinity: Python's extension, not JSON
    except RecursionError:
        raise BadRequest("the request body is nested too deep to read") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON ({e})") from None
    except ValueError:  # int(): more digits than sys.get_int_max_str_digits() (4,300)
        raise BadRequest("a number in the request body has too many digits to read") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    for key, value in body.items():
        if _lone_surrogate(key) or _lone_surrogate(value):  # the tokenizer takes only encodable text
            name = ascii(key) if _lone_surrogate(key) else key
            raise BadRequest(f"{name} holds a lone UTF-16 surrogate (\\ud800-\\udfff without its pair); "
                             "send valid Unicode text", name)
    return body


def _lone_surrogate(value) -> bool:
    """Whether a string anywhere in `value` holds half a UTF-16 pair (JSON's "\\ud800" alone), which no UTF-8
    text can; a loop, not recursion, over a body nested as deep as json.loads allows."""
    todo = [value]
    while todo:
        v = todo.pop()
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(v, list):
            todo += v
        elif isinstance(v, dict):
            todo += v.keys()
            todo += v.values()
    return False


def parse_job(body: dict, tok, chat: bool) -> Job:
    """The request body -> what the engine runs; BadRequest names the field at fault."""
    if body.get("n", 1) != 1:
        raise BadRequest("only n = 1 is served", "n")
    prompt = _chat_ids(body.get("messages"), tok) if chat else _prompt_ids(body.get("prompt"), tok)
    limit = body.get("max_completion_tokens", body.get("max_tokens")) if chat else body.get("max_tokens")
    max_tokens = _number({"max_tokens": limit}, "max_tokens", CHAT_MAX_TOKENS if chat else 16, 1, 1 << 24, True)
    sampling = Sampling(temperature=_number(body, "temperature", 1.0, 0, 2),
                        top_p=_number(body, "top_p", None, 1e-9, 1),
                        seed=_number(body, "seed", None, 0, (1 << 63) - 1, whole=True))
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    return Job(prompt, max_tokens, sampling, _stops(body), stream,
               bool(isinstance(options, dict) and options.get("include_usage")), body.get("ignore_eos") is True)


# -- text out --------------------------------------------------------------------------------------------

class TextStream:
    """Token ids -> text deltas: waits for a whole character, holds back a possible start of a stop string,
    and ends the text before the first stop string."""

    def __init__(self, tok, stops: list[str]):
        self.tok, self.stops, self.ids, self.sent = tok, stops, [], 0

    def add(self, token: int) -> tuple[str, bool]:
        """-> (new text, whether a stop string was hit)."""
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):  # half a UTF-8 character: wait for the rest
            return "", False
        cut = min((i for i in (text.find(s, max(0, self.sent - len(s))) for s in self.stops) if i >= 0),
                  default=None)
        if cut is not None:
            return self._take(text, max(cut, self.sent)), True
        safe = len(text) - max((self._partial(text, s) for s in self.stops), default=0)
        return self._take(text, max(safe, self.sent)), False

    @staticmethod
    def _partial(text: str, stop: str) -> int:
        """Length of the longest end of `text` that begins `stop`."""
        return next((k for k in range(min(len(stop) - 1, len(text)), 0, -1) if text.endswith(stop[:k])), 0)

    def _take(self, text: str, end: int) -> str:
        delta, self.sent = text[self.sent:end], end
        return delta

    def flush(self) -> str:
        """The rest of the text at the end (held-back characters that turned out not to start a stop)."""
        return self._take(self.tok.decode(self.ids), len(self.tok.decode(self.ids)))


# -- the app ---------------------------------------------------------------------------------------------

class Api:
    def __init__(self, worker: Worker, tok, name: str, api_key: str | None = None, max_body: int | None = None):
        if api_key is not None and not api_key.strip():  # "" would serve with no key at all
            raise KvwallError("the API key is empty: give a key, or None to serve without one")
        self.worker, self.tok, self.name, self.api_key = worker, tok or IdText(), name, api_key
        self.max_body = max_body or max_body_bytes(worker.runner)
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"]),
                  Route("/v1/models", self.models), Route("/health", self.health), Route("/metrics", self.metrics)]
        keyed = [Middleware(KeyCheck, key=self.api_key)] if self.api_key else []
        return Starlette(routes=routes, middleware=keyed, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        """The engine thread runs while the server does; uvicorn drains open requests before this ends."""
        self.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(self.worker.stop)

    async def completions(self, request: HttpRequest):
        return await self._serve(request, chat=False)

    async def chat(self, request: HttpRequest):
        return await self._serve(request, chat=True)

    async def _serve(self, request: HttpRequest, chat: bool):
        try:
            raw = await self._read(request)
            job = await run_in_threadpool(self._job, raw, chat)  # tokenizing a long prompt blocked /health 9 s
        except BadRequest as e:
            return error_response(e)
        except ClientDisconnect:  # it went away mid-body: nobody reads an answer
            return Response(status_code=499)
        eos = () if job.ignore_eos else self.worker.runner.model.spec.eos_token_ids
        r = Request(uuid.uuid4().hex, job.prompt, job.max_tokens, frozenset(eos))
        h = Handle(r, job.sampling, asyncio.get_running_loop())
        self.worker.submit(h)
        reply = Reply(self, h, job, chat)
        if job.stream:
            return StreamingResponse(reply.stream(), media_type="text/event-stream")
        return await reply.whole(request)

    async def _read(self, request: HttpRequest) -> bytes:
        """The body's bytes, refused (413) past max_body as soon as its Content-Length or the bytes streamed so far
        (a chunked body has no length) say so, never read whole first."""
        length = request.headers.get("content-length", "")
        if length.isdigit() and (len(length) > 18 or int(length) > self.max_body):
            raise self._too_large()
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body:
                raise self._too_large()
            parts.append(part)
        return b"".join(parts)

    def _too_large(self) -> BadRequest:
        return BadRequest(f"the request body is over this server's limit of {self.max_body:,} bytes "
                          f"({BODY_BYTES_PER_TOKEN} a token of the longest sequence it runs); shorten the prompt "
                          "or messages", code="request_too_large", status=413)

    def _job(self, raw: bytes, chat: bool) -> Job:
        """The body's bytes -> the job (in a worker thread: parsing and tokenizing take long for a long prompt)."""
        body = parse_body(raw)
        if body.get("model") != self.name:
            raise BadRequest(f"model {_shown(body.get('model'))} is not served here; this server serves "
                             f"{self.name!r}", "model", "model_not_found")
        field = "messages" if chat else "prompt"
        try:
            job = parse_job(body, self.tok, chat)
        except KvwallError as e:  # the tokenizer's: no chat template, a text that encodes to nothing
            raise BadRequest(str(e), field) from None
        try:
            self.worker.runner.check(Request("check", job.prompt, job.max_tokens), job.sampling,
                                     fix=f"shorten {field} or max_tokens")
        except KvwallError as e:
            raise BadRequest(str(e), field, "context_length_exceeded"
                             if "context" in str(e) or "KV blocks" in str(e) else None) from None
        return job

    async def models(self, request: HttpRequest):
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model",
                                                         "created": self.created, "owned_by": "kvwall"}]})

    async def health(self, request: HttpRequest):
        alive = self.worker.thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    async def metrics(self, request: HttpRequest):
        return PlainTextResponse(prometheus(self.worker.runner), media_type="text/plain; version=0.0.4")


class Reply:
    """One request's answer: the engine's events -> OpenAI objects, whole or as server-sent events."""

    def __init__(self, api: Api, h: Handle, job: Job, chat: bool):
        self.api, self.h, self.job, self.chat = api, h, job, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + h.request.id
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.text = TextStream(api.tok, job.stops)
        self.next_check = time.monotonic() + 1.0  # when to ask again whether the client is still there

    async def next_event(self, disconnected=None) -> tuple:
        """The engine's next event; with `disconnected` (a whole answer: nothing is written until the end), at
        most every second whether the client went away (Disconnected). A stream learns it from its writes."""
        while True:
            try:
                event = await asyncio.wait_for(self.h.events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                event = None
            if disconnected is not None and time.monotonic() >= self.next_check:
                self.next_check = time.monotonic() + 1.0
                if await disconnected():
                    raise Disconnected
            if event is not None:
                return event

    async def events(self, disconnected=None):
        """(text delta, finish reason or None) until the request ends; BadRequest(500) on an engine error."""
        while True:
            kind, value = await self.next_event(disconnected)
            if kind == "error":
                self.h.finished = True
                raise BadRequest(value, status=400 if "context" in value or "KV" in value else 500)
            if kind == "done":
                self.h.finished = True
                yield self.text.flush(), value
                return
            delta, stopped = self.text.add(value)
            if stopped:
                self.api.worker.abort(self.h)
                yield delta, "stop"
                return
            if delta:
                yield delta, None

    def usage(self) -> dict:
        """OpenAI's usage, with the prompt tokens the prefix cache gave (prompt_tokens_details, as vLLM reports)."""
        r = self.h.request
        p, c = len(r.prompt), len(r.out)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": r.cached_tokens}}

    def choice(self, text: str | None, finish: str | None, delta: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        key = "delta" if delta else "message"
        body = {"role": "assistant", "content": text} if not delta else ({"content": text} if text else {})
        return {"index": 0, key: body, "logprobs": None, "finish_reason": finish}

    def envelope(self, choices: list, streaming: bool) -> dict:
        kind = self.object + (".chunk" if streaming and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.api.name, "choices": choices}

    async def whole(self, request: HttpRequest):
        parts, finish = [], None
        try:
            async for delta, finish in self.events(request.is_disconnected):  # noqa: B007  (finish: read after it)
                parts.append(delta)
        except BadRequest as e:
            return error_response(e)
        except Disconnected:  # the client went away: free its blocks (nobody reads this answer)
            self.api.worker.abort(self.h)
            return JSONResponse({}, status_code=499)
        body = self.envelope([self.choice("".join(parts), finish, False)], False)
        return JSONResponse(dict(body, usage=self.usage()))

    async def stream(self):
        try:
            if self.chat:
                yield sse(self.envelope([dict(self.choice(None, None, True), delta={"role": "assistant"})], True))
            async for delta, finish in self.events():
                yield sse(self.envelope([self.choice(delta, finish, True)], True))
            if self.job.usage_in_stream:
                yield sse(dict(self.envelope([], True), usage=self.usage()))
        except BadRequest as e:
            yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        finally:
            if not self.h.finished:  # the client went away mid-stream: free its blocks now
                self.api.worker.abort(self.h)
        yield "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def prometheus(runner) -> str:
    """The gauges and counters of /metrics in Prometheus' text format."""
    s = runner.sched
    rate = runner.generated / runner.busy_s if runner.busy_s > 0 else 0.0
    rows = [("requests_running", "gauge", "requests holding KV blocks", len(s.running)),
            ("requests_waiting", "gauge", "requests queued", len(s.waiting)),
            ("kv_blocks_used", "gauge", "KV blocks held by requests", s.used_blocks()),
            ("kv_blocks_free", "gauge", "KV blocks free", s.pool.n_free()),
            ("kv_block_bytes", "gauge", "bytes of one KV block", runner.block_bytes),
            ("preemptions_total", "counter", "requests preempted (recomputed later)", s.preemptions),
            ("prefix_cache_hits_total", "counter", "KV blocks taken from the prefix cache", s.pool.hits),
            ("computed_tokens_total", "counter", "tokens run through the model (prefill and decode)", runner.computed),
            ("generation_tokens_total", "counter", "tokens generated", runner.generated),
            ("steps_total", "counter", "engine steps", runner.steps),
            ("generation_tokens_per_second", "gauge", "tokens generated per busy second", rate)]
    out = []
    for name, kind, about, value in rows:
        out += [f"# HELP kvwall_{name} {about}", f"# TYPE kvwall_{name} {kind}", f"kvwall_{name} {value}"]
    return "\n".join(out) + "\n"

"""The OpenAI HTTP API over the engine worker (Starlette + uvicorn): a thin layer that parses, submits, streams.

    POST /v1/completions        prompt (text, token ids, or a list of either: one choice group per prompt),
                                max_tokens (default 16; 0 with echo scores the prompt), echo, logprobs, best_of
    POST /v1/chat/completions   messages through the model's chat template (a plain "role: text" one without;
                                content as text parts, null on an assistant turn), max_completion_tokens,
                                logprobs + top_logprobs
        both: temperature (default 1), top_p, top_k, seed, stop (a string or up to 4), n, stream (server-sent
        events, stream_options.include_usage), frequency/presence/repetition penalties, logit_bias, min_tokens,
        stop_token_ids, ignore_eos (serve/logits.py: their semantics); the answer carries usage
    GET  /v1/models, /health, /metrics (Prometheus text: requests, KV blocks, preemptions, prefix hits, tok/s)

A bad request gets OpenAI's error object with status 400 naming the field (`param`), a field this server does
not serve (tools, response_format beyond text, image parts, suffix ...) included; 404 for an unknown model or
route, 405 for a wrong method, 413 for a body past max_body_bytes, 401 on a /v1/ route without the --api-key
when one is set (/health and /metrics stay open); it never reaches the engine. The body is parsed and tokenized
off the event loop. A client that disconnects aborts its request:
its blocks are free before the next step. Stop strings are found in the decoded text; the text stops before
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvwall.engine.generate import Sampling
from kvwall.errors import KvwallError
from kvwall.serve.logits import MAX_LOGPROBS, Rules
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


def error_response(e: BadRequest, headers: dict | None = None) -> JSONResponse:
    kind = "invalid_request_error" if e.status < 500 else "server_error"
    body = {"error": {"message": str(e), "type": kind, "param": e.param, "code": e.code}}
    return JSONResponse(body, status_code=e.status, headers=headers)


async def http_error(request: HttpRequest, exc: HTTPException) -> JSONResponse:
    """Starlette's own refusals (404 no such route, 405 wrong method) in the error shape clients parse."""
    what = {404: f"no route {request.url.path}; this server serves /v1/completions, /v1/chat/completions, "
                 "/v1/models, /health and /metrics",
            405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
    e = BadRequest(what, code={404: "not_found", 405: "method_not_allowed"}.get(exc.status_code),
                   status=exc.status_code)
    return error_response(e, exc.headers)


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

# The request fields served; any other one is refused with a 400 naming it (a 200 that ignored it would look like
# an answer to what was asked). A field sent as null counts as not sent.
SAMPLING_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                   "stream_options", "n", "ignore_eos", "frequency_penalty", "presence_penalty",
                   "repetition_penalty", "logit_bias", "min_tokens", "stop_token_ids", "logprobs",
                   "user"}  # user: an end-user id for the provider's abuse monitoring; nothing to do here
COMPLETION_FIELDS = SAMPLING_FIELDS | {"prompt", "echo", "best_of"}
CHAT_FIELDS = SAMPLING_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "tools",
                                 "tool_choice", "parallel_tool_calls"}  # the last four: only as "nothing asked"
MAX_N = 128  # choices per prompt (n, best_of): each is a running request
# choices per HTTP request (prompts x n): a 1 MiB body holds 250,000 one-token prompts, and each choice is a request
# object queued in the engine; lm-evaluation-harness batches 1-64 prompts a request
MAX_CHOICES = 4096


@dataclass
class Job:
    prompts: list[list[int]]  # one or more (a list prompt): each gets n choices
    max_tokens: int  # 0: score the prompt only (echo)
    sampling: Sampling
    stops: list[str]
    stream: bool
    usage_in_stream: bool
    ignore_eos: bool = False  # vLLM's and llama.cpp's extension: run to max_tokens (load tests)
    n: int = 1
    best_of: int | None = None  # sample this many per prompt, answer the n of the highest total logprob
    echo: bool = False  # completions: the prompt's text (and its tokens' logprobs) before the choice's
    logprobs: int | None = None  # top-N alternatives per token (completions: logprobs; chat: top_logprobs)
    rules: Rules = Rules()  # penalties, logit_bias, min_tokens (stop_ids set by the server: the model's EOS)
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids
    texts: list[str | None] | None = None  # the prompts as sent, where text (echo returns them as they came)


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


def _flag(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false (got {_shown(value)})", key)
    return bool(value)


def _stops(body: dict) -> list[str]:
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop must be a non-empty string or a list of up to 4 of them", "stop")
    return stops


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                             for t in value)


def _prompts(prompt, tok) -> tuple[list[list[int]], list[str | None]]:
    """A prompt as OpenAI takes it (a string, a list of token ids, a list of strings, a list of token-id lists) ->
    (token ids of each prompt, its text where it came as text)."""
    if isinstance(prompt, str) or _is_ids(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
        items = prompt
    else:
        raise BadRequest("prompt must be a string, a list of token ids, or a non-empty list of strings or of token-id "
                         "lists", "prompt")
    ids = [(tok.encode(p) if p else []) if isinstance(p, str) else p for p in items]
    if not all(ids):
        raise BadRequest("the prompt is empty; give at least one token", "prompt")
    return ids, [p if isinstance(p, str) else None for p in items]


def _content(m: dict, i: int) -> str:
    """A message's content as text: a string, text parts (joined with newlines, as vLLM joins them), or null on
    an assistant turn; any other part (an image, audio) is refused, naming it."""
    content = m.get("content")
    if isinstance(content, str):
        return content
    if content is None and m.get("role") == "assistant":
        return ""
    if not isinstance(content, list):
        raise BadRequest(f"messages[{i}].content must be a string or a list of text parts (null only on an "
                         "assistant turn)", f"messages[{i}].content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise BadRequest(f"messages[{i}].content[{j}] is a {_shown(kind)} part; this server reads text parts "
                             "only ({\"type\": \"text\", \"text\": ...})", f"messages[{i}].content[{j}].type")
        texts.append(part["text"])
    return "\n".join(texts)


def _chat_ids(messages, tok) -> list[int]:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise BadRequest("messages must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        for key in ("tool_calls", "function_call", "audio"):
            if m.get(key) is not None:
                raise BadRequest(f"messages[{i}].{key} is not served (no tool calls or audio here)",
                                 f"messages[{i}].{key}")
    messages = [dict(m, content=_content(m, i)) for i, m in enumerate(messages)]
    if hasattr(tok, "encode_chat"):
        return tok.encode_chat(messages)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return tok.encode(text)


def _refuse_unserved(body: dict, chat: bool) -> None:
    """A 400 naming the first field this server does not serve (sent as anything but null or "nothing asked")."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for key, value in body.items():
        if value is None:
            continue
        if key not in known:
            raise BadRequest(f"{key} is not served by kvwall serve; leave it out", key, "unsupported_parameter")
    if body.get("tools") or body.get("tool_choice") not in (None, "none", "auto"):
        raise BadRequest("tools are not served by kvwall serve (no tool calls); leave tools and tool_choice out",
                         "tools" if body.get("tools") else "tool_choice", "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise BadRequest(f"response_format {_shown(fmt)} is not served: only {{\"type\": \"text\"}} (no JSON mode "
                         "or schema)", "response_format", "unsupported_parameter")


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise BadRequest("logit_bias must be an object of token id -> bias in [-100, 100]", "logit_bias")
    out = []
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) < 10) or isinstance(value, bool) or \
                not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise BadRequest(f"logit_bias must map token ids to numbers in [-100, 100] (got {_shown(key)}: "
                             f"{_shown(value)})", "logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def _token_ids(body: dict, key: str) -> frozenset[int]:
    value = body.get(key) or []
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                              for t in value):
        raise BadRequest(f"{key} must be a list of token ids", key)
    return frozenset(value)

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
    _refuse_unserved(body, chat)
    n = _number(body, "n", 1, 1, MAX_N, whole=True)
    best_of = None if chat else _number(body, "best_of", None, n, MAX_N, whole=True)
    echo = False if chat else _flag(body, "echo")
    if chat:
        prompts, texts = [_chat_ids(body.get("messages"), tok)], [None]
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _number(body, key, CHAT_MAX_TOKENS, 1, 1 << 24, True)
        want = _flag(body, "logprobs")
        top = _number(body, "top_logprobs", None, 0, MAX_LOGPROBS, True)
        if top is not None and not want:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (top or 0) if want else None
    else:
        prompts, texts = _prompts(body.get("prompt"), tok)
        max_tokens = _number(body, "max_tokens", 16, 0 if echo else 1, 1 << 24, True)
        logprobs = _number(body, "logprobs", None, 0, MAX_LOGPROBS, True)
    off = body.get("top_k") in (-1, 0) and not isinstance(body.get("top_k"), bool)  # vLLM's "no top-k" values
    sampling = Sampling(temperature=_number(body, "temperature", 1.0, 0, 2),
                        top_k=None if off else _number(body, "top_k", None, 1, 1 << 30, True),
                        top_p=_number(body, "top_p", None, 1e-9, 1),
                        seed=_number(body, "seed", None, 0, (1 << 63) - 1, whole=True))
    rules = Rules(frequency_penalty=_number(body, "frequency_penalty", 0.0, -2, 2),
                  presence_penalty=_number(body, "presence_penalty", 0.0, -2, 2),
                  repetition_penalty=_number(body, "repetition_penalty", 1.0, 1e-3, 100),
                  logit_bias=_logit_bias(body), min_tokens=_number(body, "min_tokens", 0, 0, 1 << 24, True))
    if rules.min_tokens > max(max_tokens, 1):
        raise BadRequest(f"min_tokens ({rules.min_tokens}) is more than max_tokens ({max_tokens})", "min_tokens")
    if len(prompts) * (best_of or n) > MAX_CHOICES:
        raise BadRequest(f"{len(prompts):,} prompts x {best_of or n} choices is over this server's {MAX_CHOICES:,} "
                         "choices a request; send fewer prompts per request", "n" if chat else "prompt")
    stream = _flag(body, "stream")
    if stream and best_of is not None and best_of > n:
        raise BadRequest("best_of > n cannot stream (the best are known only at the end)", "best_of")
    if max_tokens == 0 and stream:
        raise BadRequest("max_tokens 0 (prompt scoring) does not stream; send stream: false", "max_tokens")
    options = body.get("stream_options") or {}
    return Job(prompts, max_tokens, sampling, _stops(body), stream,
               bool(isinstance(options, dict) and options.get("include_usage")), _flag(body, "ignore_eos"),
               n=n, best_of=best_of, echo=echo, logprobs=logprobs, rules=rules,
               stop_ids=_token_ids(body, "stop_token_ids"), texts=texts)


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
        return Starlette(routes=routes, middleware=keyed, lifespan=self._lifespan,
                         exception_handlers={HTTPException: http_error})

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
        reply = Reply(self, self._submit(job), job, chat)
        if job.stream:
            return StreamingResponse(reply.stream(), media_type="text/event-stream")
        return await reply.whole(request)

    def _submit(self, job: Job) -> list[list[Handle]]:
        """One engine request per choice: best_of (else n) per prompt. The first choice of a prompt computes it;
        the others wait for that (Request.after) and take its blocks from the prefix cache, where nothing asks
        for the prompt's logprobs (each scoring request computes its prompt itself). Choice j samples with
        seed + j: one seed for all would give n equal choices."""
        eos = frozenset(() if job.ignore_eos else self.worker.runner.model.spec.eos_token_ids)
        stop = eos | job.stop_ids
        ranked = job.best_of is not None and job.best_of > job.n  # best_of ranks by the choices' total logprob
        rules = dataclasses.replace(job.rules, stop_ids=stop, prompt_logprobs=job.logprobs if job.echo else None,
                                    logprobs=0 if ranked and job.logprobs is None else job.logprobs)
        loop, out = asyncio.get_running_loop(), []
        for prompt in job.prompts:
            handles = []
            for j in range(job.best_of or job.n):
                s = job.sampling
                sampling = dataclasses.replace(s, seed=(s.seed + j) % (1 << 63)) if s.seed is not None else s
                r = Request(uuid.uuid4().hex, prompt, max(job.max_tokens, 1), stop)
                if handles and rules.prompt_logprobs is None:
                    r.after = handles[0].request
                handles.append(Handle(r, sampling, loop, rules))
                self.worker.submit(handles[-1])
            out.append(handles)
        return out

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
                             f"{self.name!r}", "model", "model_not_found", status=404)
        field = "messages" if chat else "prompt"
        try:
            job = parse_job(body, self.tok, chat)
        except KvwallError as e:  # the tokenizer's: no chat template, a text that encodes to nothing
            raise BadRequest(str(e), field) from None
        limit_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else \
            "max_tokens"
        for prompt in job.prompts:
            self._check_context(len(prompt), job.max_tokens, field, limit_key)
            try:
                self.worker.runner.check(Request("check", prompt, max(job.max_tokens, 1)), job.sampling,
                                         fix=f"shorten {field} or {limit_key}")
            except KvwallError as e:
                raise BadRequest(str(e), limit_key if "KV blocks" in str(e) else field,
                                 "context_length_exceeded" if "context" in str(e) or "KV blocks" in str(e)
                                 else None) from None
        vocab = self.worker.runner.model.spec.vocab
        for key, ids in (("logit_bias", [t for t, _ in job.rules.logit_bias]), ("stop_token_ids", job.stop_ids)):
            if any(t >= vocab for t in ids):
                raise BadRequest(f"{key} names a token id outside the vocabulary [0, {vocab})", key)
        return job

    def _check_context(self, prompt: int, max_tokens: int, field: str, key: str) -> None:
        """Past the model's context: the request field to change, and by how much (a prompt to be scored,
        max_tokens 0, still runs one position past its last token)."""
        limit = self.worker.runner.model.spec.context_limit
        if not limit:
            return
        if prompt >= limit:
            raise BadRequest(f"this model's maximum context length is {limit:,} tokens and the {field} has "
                             f"{prompt:,}; shorten {field} to under {limit:,} tokens", field,
                             "context_length_exceeded")
        if prompt + max_tokens > limit:
            raise BadRequest(f"this model's maximum context length is {limit:,} tokens: {prompt:,} in the {field} + "
                             f"{key} {max_tokens:,} = {prompt + max_tokens:,}; give {key} at most "
                             f"{limit - prompt:,}", key, "context_length_exceeded")

    async def models(self, request: HttpRequest):
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model",
                                                         "created": self.created, "owned_by": "kvwall"}]})

    async def health(self, request: HttpRequest):
        alive = self.worker.thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    async def metrics(self, request: HttpRequest):
        return PlainTextResponse(prometheus(self.worker.runner), media_type="text/plain; version=0.0.4")


class Choice:
    """One choice of an answer: its engine request, its text so far, the logprobs of its tokens."""

    def __init__(self, reply: Reply, h: Handle, prompt: int):
        self.reply, self.h, self.prompt, self.index = reply, h, prompt, 0
        self.text = TextStream(reply.api.tok, reply.job.stops)
        self.parts: list[str] = []
        self.finish: str | None = None
        self.prompt_logprobs: list | None = None  # (token, logprob entry or None) per prompt token (echo)
        self.logprobs: list = []  # (token, (logprob, top)) per generated token

    def total(self) -> float:
        """The choice's total logprob (best_of ranks by it)."""
        return sum(entry[0] for _, entry in self.logprobs)

    async def events(self, disconnected=None):
        """(text delta, finish reason or None, new (token, logprob) entries) until the request ends; BadRequest
        (500) on an engine error. Prompt scoring (max_tokens 0) drops the one token its request generated."""
        scoring = self.reply.job.max_tokens == 0
        while True:
            event = await self.reply.next_event(self.h, disconnected)
            kind, value = event[0], event[1]
            if kind == "error":
                self.h.finished = True
                raise BadRequest(value, status=400 if "context" in value or "KV" in value else 500)
            if kind == "prompt":
                self.prompt_logprobs = list(zip(self.h.request.prompt, value))
                continue
            if kind == "done":
                self.h.finished = True
                yield self.text.flush(), value, []
                return
            if scoring:
                continue
            entries = [(value, event[2])] if event[2] is not None else []
            self.logprobs += entries
            delta, stopped = self.text.add(value)
            if stopped:
                self.reply.api.worker.abort(self.h)
                yield delta, "stop", entries
                return
            if delta or entries:
                yield delta, None, entries


class Reply:
    """One request's answer: the engine's events -> OpenAI objects, whole or as server-sent events."""

    def __init__(self, api: Api, handles: list[list[Handle]], job: Job, chat: bool):
        self.api, self.job, self.chat = api, job, chat
        self.groups = [[Choice(self, h, i) for h in hs] for i, hs in enumerate(handles)]
        self.choices = [c for g in self.groups for c in g]
        for k, c in enumerate(self.choices):
            c.index = k  # prompt i's choices are i * n .. i * n + n - 1 (best_of: renumbered once ranked)
        self.id = ("chatcmpl-" if chat else "cmpl-") + handles[0][0].request.id
        self.object = "chat.completion" if chat else "text_completion"
        self.created = int(time.time())
        self.next_check = time.monotonic() + 1.0  # when to ask again whether the client is still there

    async def next_event(self, h: Handle, disconnected=None) -> tuple:
        """h's next engine event; with `disconnected` (a whole answer: nothing is written until the end), at
        most every second whether the client went away (Disconnected). A stream learns it from its writes."""
        while True:
            try:
                event = await asyncio.wait_for(h.events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                event = None
            if disconnected is not None and time.monotonic() >= self.next_check:
                self.next_check = time.monotonic() + 1.0
                if await disconnected():
                    raise Disconnected
            if event is not None:
                return event

    def abort_all(self) -> None:
        for c in self.choices:
            if not c.h.finished:
                self.api.worker.abort(c.h)

    def usage(self) -> dict:
        """OpenAI's usage, with the prompt tokens the prefix cache gave (prompt_tokens_details, as vLLM reports):
        each prompt counted once, every choice's tokens (best_of's unreturned ones too: they were computed)."""
        p = sum(len(g[0].h.request.prompt) for g in self.groups)
        c = 0 if self.job.max_tokens == 0 else sum(len(ch.h.request.out) for ch in self.choices)
        cached = sum(ch.h.request.cached_tokens for ch in self.choices)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def piece(self, token: int) -> str:
        return self.api.tok.decode([token])

    def completion_logprobs(self, entries: list, offset: int) -> dict:
        """OpenAI's completions logprobs: per token its text, logprob, top alternatives (with the token itself,
        as vLLM lists it) and character offset; null logprob and alternatives for the prompt's first token."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in entries:
            text = self.piece(token)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            logprob, top = entry
            alternatives = {self.piece(t): v for t, v in top}
            alternatives.setdefault(text, logprob)
            out["token_logprobs"].append(logprob)
            out["top_logprobs"].append(alternatives)
        return out

    def chat_logprobs(self, entries: list) -> dict:
        def one(token: int, logprob: float) -> dict:
            text = self.piece(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [dict(one(token, lp), top_logprobs=[one(t, v) for t, v in top])
                            for token, (lp, top) in entries]}

    def prompt_text(self, c: Choice) -> str:
        given = self.job.texts[c.prompt] if self.job.texts else None
        return given if given is not None else self.api.tok.decode(c.h.request.prompt)

    def choice(self, c: Choice, text: str | None, finish: str | None, delta: bool, entries: list,
               first: bool = False) -> dict:
        """One choice object; `entries` its (token, logprob) entries in this object; `first`: a stream's first
        chunk of the choice (echo sends the prompt there)."""
        if not self.chat:
            logprobs = None
            if self.job.echo and (first or not delta):
                text = self.prompt_text(c) + (text or "")
                if self.job.logprobs is not None:
                    entries = (c.prompt_logprobs or []) + entries
            if self.job.logprobs is not None:
                logprobs = self.completion_logprobs(entries, 0)
            return {"index": c.index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        key = "delta" if delta else "message"
        body = {"role": "assistant", "content": text} if not delta else ({"content": text} if text else {})
        logprobs = self.chat_logprobs(entries) if self.job.logprobs is not None else None
        return {"index": c.index, key: body, "logprobs": logprobs, "finish_reason": finish}

    def envelope(self, choices: list, streaming: bool) -> dict:
        kind = self.object + (".chunk" if streaming and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.api.name, "choices": choices}

    async def _collect(self, c: Choice, disconnected) -> None:
        async for delta, finish, _ in c.events(disconnected):
            c.parts.append(delta)
            c.finish = finish

    async def whole(self, request: HttpRequest):
        tasks = [asyncio.ensure_future(self._collect(c, request.is_disconnected)) for c in self.choices]
        try:
            await asyncio.gather(*tasks)
        except BadRequest as e:
            self.abort_all()
            return error_response(e)
        except Disconnected:  # the client went away: free its blocks (nobody reads this answer)
            self.abort_all()
            return JSONResponse({}, status_code=499)
        finally:
            for t in tasks:
                t.cancel()
        shown = []
        for g in self.groups:
            if len(g) > self.job.n:  # best_of: the n of the highest total logprob, best first
                g = sorted(g, key=Choice.total, reverse=True)[:self.job.n]
            shown += g
        choices = []
        for k, c in enumerate(shown):
            c.index = k
            choices.append(self.choice(c, "".join(c.parts), c.finish, False, c.logprobs))
        body = self.envelope(choices, False)
        return JSONResponse(dict(body, usage=self.usage()))

    async def stream(self):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(c: Choice):
            try:
                async for item in c.events():
                    await queue.put((c, *item))
            except BadRequest as e:
                await queue.put((c, e, None, None))
            await queue.put((c, None, "end", None))

        tasks = [asyncio.ensure_future(pump(c)) for c in self.choices]
        try:
            if self.chat:
                for c in self.choices:
                    first = dict(self.choice(c, None, None, True, []), delta={"role": "assistant"})
                    yield sse(self.envelope([first], True))
            started, ended = set(), 0
            while ended < len(self.choices):
                c, delta, finish, entries = await queue.get()
                if finish == "end":
                    ended += 1
                    continue
                if isinstance(delta, BadRequest):
                    raise delta
                first = c.index not in started
                started.add(c.index)
                yield sse(self.envelope([self.choice(c, delta, finish, True, entries, first)], True))
            if self.job.usage_in_stream:
                yield sse(dict(self.envelope([], True), usage=self.usage()))
        except BadRequest as e:
            yield sse({"error": {"message": str(e), "type": "server_error", "param": None, "code": None}})
        finally:
            for t in tasks:
                t.cancel()
            self.abort_all()  # the client went away mid-stream (or a choice failed): free the blocks now
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

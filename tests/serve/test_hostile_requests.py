"""Issue #38, the server's part: hostile and careless requests and options. Each gets a one-line refusal (an error
object naming the request field, or `kvwall: error:` naming the option), nothing crashes the engine for the other
requests, nothing reaches the log as a traceback. A tiny random llama (context 512) with a word-level tokenizer
("w0".."w159"); expected answers come from engine/generate.py run alone."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from kvwall.cli import main  # noqa: E402
from kvwall.engine.generate import Sampling, generate, pick  # noqa: E402
from kvwall.engine.tokenizer import Text  # noqa: E402
from kvwall.errors import KvwallError  # noqa: E402
from kvwall.serve import free_port, serving_in_thread  # noqa: E402
from kvwall.serve.blocks import BlockManager  # noqa: E402
from kvwall.serve.runner import Runner  # noqa: E402
from kvwall.serve.scheduler import Request  # noqa: E402
from kvwall.serve.server import Api, max_body_bytes  # noqa: E402
from kvwall.serve.worker import Worker  # noqa: E402

NAME, VOCAB, KEY = "tiny", 160, "s3cret-key"
CAP = 1 << 20  # the tiny model's body cap: 64 B x its 512-token context is 32 KiB, under the 1 MiB floor


def word_tokenizer(path) -> Text:
    """w0..w159 <-> ids 0..159, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return Text(path)


class Records(logging.Handler):
    """Every log record of the server thread (uvicorn's loggers do not propagate to the root)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def tracebacks(self) -> list[str]:
        return [self.format(r) for r in self.records if r.exc_info or r.levelno >= logging.ERROR]


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    _, model = tiny_model("llama")
    tok = word_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    runner = Runner(model, n_blocks=200, block_size=4, chunk=32, max_batch=8)
    api = Api(Worker(runner), tok, NAME)
    with serving_in_thread(api.app()) as url:
        yield SimpleNamespace(url=url, runner=runner, model=model, tok=tok)


@pytest.fixture
def server(served, monkeypatch):
    """The module's server, with a fresh record of what it logs (attached after uvicorn configured its loggers)."""
    log = Records()
    for name in ("uvicorn", ""):
        monkeypatch.setattr(logging.getLogger(name), "handlers", [*logging.getLogger(name).handlers, log])
    served.log = log
    yield served


def solo(model, tok, ids: list[int], n: int) -> str:
    return tok.decode(generate(model, [ids], n).tokens[0])


def complete(base: str, **fields) -> httpx.Response:
    return httpx.post(base + "/v1/completions", json={"model": NAME, **fields}, timeout=30)


def assert_error(r, status: int, param, fragment: str) -> dict:
    """OpenAI's error object: the status, the field at fault, the message."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and fragment in err["message"], err
    assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
    return err


def assert_still_serving(s) -> None:
    r = complete(s.url, prompt="w1 w2 w3", max_tokens=3, temperature=0).json()
    assert r["choices"][0]["text"] == solo(s.model, s.tok, [1, 2, 3], 3)
    assert not s.log.tracebacks()


def slow_forward(runner, monkeypatch, pause: float = 0.01) -> None:
    fast = runner.forward
    monkeypatch.setattr(runner, "forward", lambda rows: (time.sleep(pause), fast(rows))[1])


async def stream_text(client, base: str, body: dict, started: asyncio.Event) -> tuple[str, str, int]:
    """(text, last finish reason, text events) of a streamed completion; `started` once its first token came."""
    text, finish, n = "", None, 0
    async with client.stream("POST", base + "/v1/completions", json={**body, "stream": True}) as resp:
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            finish = event["choices"][0]["finish_reason"] or finish
            n += bool(event["choices"][0]["text"])  # one a token (words); the last event carries only the finish
            started.set()
    return text, finish, n


# -- 1. the API key ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, fragment", [
    (["--api-key", ""], "--api-key is empty"),
    (["--api-key", "  "], "--api-key is empty"),
    (["--name", ""], "--name is empty"),
    (["--name", " "], "--name is empty"),
])
def test_serve_refuses_an_empty_key_or_name(tiny_model, capsys, args, fragment):
    path, _ = tiny_model("llama")
    capsys.readouterr()
    assert main(["serve", str(path), "--port", str(free_port()), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwall: error: ") and fragment in err and err.count("\n") == 1


@pytest.mark.slow
def test_every_v1_route_needs_the_key_and_health_stays_open(tiny_model, tmp_path, monkeypatch):
    import hmac

    _, model = tiny_model("llama")
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: (compared.append(1), real(a, b))[1])
    api = Api(Worker(Runner(model, n_blocks=50, block_size=4)), word_tokenizer(tmp_path / "t.json"), NAME, KEY)
    body = {"model": NAME, "prompt": "w1 w2", "max_tokens": 2, "temperature": 0}
    with serving_in_thread(api.app()) as base:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer " + "x" * len(KEY)},
                        {"Authorization": KEY}):
            assert_error(httpx.get(base + "/v1/models", headers=headers), 401, None, "API key")
            assert_error(httpx.post(base + "/v1/completions", json=body, headers=headers), 401, None, "API key")
            assert_error(httpx.post(base + "/v1/chat/completions", json=body, headers=headers), 401, None, "API key")
        assert httpx.get(base + "/health").json() == {"status": "ok"}  # probes need no key
        assert httpx.get(base + "/metrics").status_code == 200
        good = {"Authorization": f"Bearer {KEY}"}
        assert [m["id"] for m in httpx.get(base + "/v1/models", headers=good).json()["data"]] == [NAME]
        assert httpx.post(base + "/v1/completions", json=body, headers=good).status_code == 200
    assert compared  # the key was compared in constant time


# -- 2. sampling ----------------------------------------------------------------------------------------------

def test_tiny_temperatures_sample_greedily_and_large_logits_do_not_overflow():
    logits = torch.tensor([[1000.0, 999.0, -1000.0, 998.5]])  # / 1e-36: 1e39, past float32's 3.4e38
    for t in (1e-300, 5e-324, 1e-36, 1e-30):
        assert pick(logits, Sampling(temperature=t, seed=0), torch.Generator().manual_seed(0)).tolist() == [0]
    assert Sampling(temperature=1e-300).greedy and not Sampling(temperature=1e-30).greedy
    for bad in (float("nan"), float("inf"), -1e-300):
        with pytest.raises(KvwallError, match="temperature must be a finite number >= 0"):
            Sampling(temperature=bad).check()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1e-300, 5e-324])
def test_a_tiny_temperature_is_greedy_beside_a_stream(server, monkeypatch, temperature):
    """The stream (30 tokens, 10 ms a step) is in flight when the tiny-temperature request arrives."""
    slow_forward(server.runner, monkeypatch)

    async def both():
        started = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as client:
            stream = asyncio.create_task(stream_text(
                client, server.url, {"model": NAME, "prompt": "w7 w8", "max_tokens": 30, "temperature": 0}, started))
            await asyncio.wait_for(started.wait(), 30)
            tiny = await client.post(server.url + "/v1/completions", json={
                "model": NAME, "prompt": "w3 w4 w5", "max_tokens": 3, "temperature": temperature})
            return await stream, tiny

    (text, finish, events), tiny = asyncio.run(both())
    assert (text, finish, events) == (solo(server.model, server.tok, [7, 8], 30), "length", 30)
    assert tiny.status_code == 200, tiny.text
    greedy = complete(server.url, prompt="w3 w4 w5", max_tokens=3, temperature=0).json()["choices"][0]["text"]
    assert tiny.json()["choices"][0]["text"] == greedy == solo(server.model, server.tok, [3, 4, 5], 3)
    assert not server.log.tracebacks()


@pytest.mark.slow
def test_a_failing_sampler_fails_its_request_alone(server, monkeypatch):
    """Sampling that raises for one request (seed 4242) fails that request with a 500; the stream beside it gets
    every token, its blocks and the failed one's go back to the pool."""
    import kvwall.serve.runner as runner_mod

    real = runner_mod.pick

    def pick_or_fail(logits, s, gen):
        if s.seed == 4242:
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return real(logits, s, gen)

    monkeypatch.setattr(runner_mod, "pick", pick_or_fail)
    slow_forward(server.runner, monkeypatch)

    async def both():
        started = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as client:
            stream = asyncio.create_task(stream_text(
                client, server.url, {"model": NAME, "prompt": "w9 w1", "max_tokens": 30, "temperature": 0}, started))
            await asyncio.wait_for(started.wait(), 30)
            bad = await client.post(server.url + "/v1/completions", json={
                "model": NAME, "prompt": "w2 w2", "max_tokens": 5, "temperature": 1, "seed": 4242})
            return await stream, bad

    (text, finish, events), bad = asyncio.run(both())
    assert (text, finish, events) == (solo(server.model, server.tok, [9, 1], 30), "length", 30)
    assert_error(bad, 500, None, "sampling failed")
    deadline = time.monotonic() + 10
    while (server.runner.sched.used_blocks() or server.runner.sched.has_work()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.runner.sched.used_blocks() == 0 and not server.runner.sampling
    assert_still_serving(server)


# -- 3. bodies that raised in the server ----------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("raw, path, param, fragment", [
    ('{"model": "tiny", "prompt": "w1", "max_tokens": ' + "9" * 5000 + "}", "completions", None, "too many digits"),
    ('{"model": "tiny", "prompt": "w1", "max_tokens": ' + "9" * 4000 + "}", "completions", "max_tokens", "..."),
    ('{"model": "tiny", "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "completions", None, "nested too deep"),
    ('{"model": "tiny", "prompt": "w1 \\ud800 w2"}', "completions", "prompt", "lone UTF-16 surrogate"),
    ('{"model": "tiny", "prompt": "w1", "stop": ["\\udc00"]}', "completions", "stop", "lone UTF-16 surrogate"),
    ('{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}', "chat/completions", "messages",
     "lone UTF-16 surrogate"),
    ('{"model": "tiny", "prompt": "w1", "temperature": NaN}', "completions", None, "NaN is not a JSON number"),
    ('{"model": "tiny", "prompt": "w1", "top_p": -Infinity}', "completions", None, "not a JSON number"),
])
def test_hostile_bodies_get_a_400_without_a_traceback(server, raw, path, param, fragment):
    r = httpx.post(f"{server.url}/v1/{path}", content=raw.encode(), timeout=30)
    err = assert_error(r, 400, param, fragment)
    assert len(err["message"]) < 300  # nothing of the client's echoed whole
    assert_still_serving(server)


def raw_request(base: str, head: str, parts=(), close_after: bool = False, timeout: float = 10.0) -> bytes:
    """Send `head` (request line and headers) and `parts` on a plain socket; return what the server answers
    within `timeout` (b"" for a close). With close_after, hang up right after sending."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(head.encode())
        for part in parts:
            s.sendall(part)
        if close_after:
            return b""
        got = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                more = s.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                break
            if not more:
                break
            got += more
            if b"\r\n\r\n" in got:
                headers, _, body = got.partition(b"\r\n\r\n")
                length = [int(x.split(b":")[1]) for x in headers.lower().split(b"\r\n")
                          if x.startswith(b"content-length:")]
                if length and len(body) >= length[0]:
                    break
        return got


def parse_response(got: bytes) -> tuple[int, dict]:
    headers, _, body = got.partition(b"\r\n\r\n")
    return int(headers.split()[1]), json.loads(body)


@pytest.mark.slow
def test_a_client_that_sends_less_than_its_content_length_is_closed_quietly(server):
    body = b'{"model": "tiny", "prompt": "w1"'
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body) + 100}\r\n\r\n")
    raw_request(server.url, head, [body], close_after=True)
    time.sleep(0.5)  # the server sees the hang-up
    assert_still_serving(server)


# -- 4. body size and the event loop ---------------------------------------------------------------------------

def test_the_body_cap_by_hand(server):
    assert max_body_bytes(server.runner) == CAP  # 64 x 512 = 32 KiB: the floor
    runner = SimpleNamespace(model=SimpleNamespace(spec=SimpleNamespace(context_limit=131_072)),
                             sched=SimpleNamespace(pool=SimpleNamespace(n_blocks=10_000, block_size=16)))
    assert max_body_bytes(runner) == 64 * 131_072 == 8 * 2**20  # the context (pool: 160,000 tokens): 8 MiB
    runner.sched.pool.n_blocks = 4_000  # 64,000 tokens: the pool is the shorter
    assert max_body_bytes(runner) == 64 * 64_000
    runner.model.spec.context_limit, runner.sched.pool.n_blocks = None, 80_000  # unknown context: the pool's
    assert max_body_bytes(runner) == 64 * 1_280_000


@pytest.mark.slow
def test_a_body_over_the_cap_is_refused_before_it_is_read(server):
    """Content-Length past the cap: 413 with no body sent at all. Chunked: 413 once the bytes streamed pass it,
    without the body's end ever being sent (a server reading it whole would never answer)."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {CAP + 1}\r\n\r\n")
    status, body = parse_response(raw_request(server.url, head))
    assert status == 413 and "1,048,576 bytes" in body["error"]["message"]
    assert body["error"]["code"] == "request_too_large"
    head = ("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    piece = b" " * 65536
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * (CAP // len(piece) + 2)  # 1 MiB + 128 KiB, no last chunk
    status, body = parse_response(raw_request(server.url, head, chunks))
    assert status == 413 and "1,048,576 bytes" in body["error"]["message"]
    ok = complete(server.url, prompt="w1 " * 400 + " " * (CAP - 2000), max_tokens=2, temperature=0)  # under the cap
    assert ok.status_code == 200, ok.text
    assert_still_serving(server)


@pytest.mark.slow
def test_tokenizing_a_long_prompt_leaves_health_answering(server, monkeypatch):
    """The tokenizer takes 2 s on a 400-word prompt; /health answers within 1 s meanwhile (it waited 9 s when
    tokenizing ran on the event loop)."""
    started = threading.Event()
    encode = server.tok.encode

    def slow_encode(text):
        started.set()
        time.sleep(2.0)
        return encode(text)

    monkeypatch.setattr(server.tok, "encode", slow_encode)
    got = {}
    worker = threading.Thread(target=lambda: got.update(r=complete(
        server.url, prompt="w5 " * 400, max_tokens=2, temperature=0)))
    worker.start()
    try:
        assert started.wait(10)
        t0 = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
        assert time.perf_counter() - t0 < 1.0  # blocked, it waited out the 2 s
    finally:
        worker.join(30)
    assert got["r"].status_code == 200
    assert got["r"].json()["choices"][0]["text"] == solo(server.model, server.tok, [5] * 400, 2)


# -- 5. API errors name request fields ------------------------------------------------------------------------

def test_api_errors_name_request_fields_not_options(server):
    # issue #44: the prompt fits the 512-token context, so the field to change is max_tokens: 512 - 500 = 12
    err = assert_error(complete(server.url, prompt="w1 " * 500, max_tokens=20), 400, "max_tokens",
                       "give max_tokens at most 12")
    assert "--" not in err["message"] and err["code"] == "context_length_exceeded"
    r = httpx.post(server.url + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "w1 " * 100}], "max_completion_tokens": 500})
    err = assert_error(r, 400, "max_completion_tokens", "max_completion_tokens")
    assert "--" not in err["message"]
    err = assert_error(complete(server.url, prompt="w1 " * 600, max_tokens=1), 400, "prompt", "shorten prompt")


def test_the_runner_names_the_callers_fields_for_a_request_past_the_pool(tiny_model):
    _, model = tiny_model("llama")
    runner = Runner(model, n_blocks=10, block_size=4)  # 40 tokens
    with pytest.raises(KvwallError, match=r"30 prompt \+ 20 new tokens need 13 KV blocks; the pool has 10: "
                                          r"shorten messages or max_tokens$"):
        runner.check(Request("r", [1] * 30, 20), fix="shorten messages or max_tokens")
    with pytest.raises(KvwallError, match=r"the pool has 10: shorten the prompt or max_tokens$"):
        runner.check(Request("r", [1] * 30, 20))


# -- 6. pool sizes --------------------------------------------------------------------------------------------

def test_serve_refuses_a_pool_past_the_machines_memory_at_once(tiny_model, capsys):
    path, _ = tiny_model("llama")
    capsys.readouterr()
    t0 = time.perf_counter()
    assert main(["serve", str(path), "--port", str(free_port()), "--kv-memory", "1000TB"]) == 2
    assert time.perf_counter() - t0 < 1.0
    err = capsys.readouterr().err
    assert err.startswith("kvwall: error: --kv-memory 1000TB (") and "more than this machine's memory" in err
    assert err.count("\n") == 1


def test_simulate_with_a_1000tb_pool_answers_at_once_like_a_big_enough_one(capsys):
    """1000 TB of 2 MiB blocks (16 tokens x 32 layers x 8 KV heads x 128 x K and V x 2 bytes) is 476,837,158
    blocks; 20 requests never fill 40 GB either, so both runs serve them alike."""
    args = ["simulate", "llama-3.1-8b", "--device", "h100", "--requests", "20", "--rate", "5", "--json"]
    assert main([*args, "--kv-memory", "40GB"]) == 0
    want = json.loads(capsys.readouterr().out)["points"][0]
    t0 = time.perf_counter()
    assert main([*args, "--kv-memory", "1000TB"]) == 0
    assert time.perf_counter() - t0 < 1.0
    got = json.loads(capsys.readouterr().out)["points"][0]
    assert got["pool"]["n_blocks"] == 10**15 // (16 * 32 * 8 * 128 * 2 * 2) == 476_837_158
    assert got["completed"] == 20 and got["preemptions"] == want["preemptions"] == 0
    assert (got["ttft_s"], got["tpot_s"]) == (want["ttft_s"], want["tpot_s"])


def test_the_block_manager_builds_blocks_as_they_are_used():
    """Never-used blocks go first in id order, then freed ones oldest first (as when all blocks started on the free
    list); a pool of 1e12 blocks holds only those handed out."""
    bm = BlockManager(4, 2)
    assert [bm.allocate() for _ in range(3)] == [0, 1, 2] and bm.n_free() == 1
    bm.release([0, 1])  # the last blocks first: 1, then 0
    assert bm.n_free() == 3 and [bm.allocate() for _ in range(3)] == [3, 1, 0] and bm.n_free() == 0
    bm.check([[2], [3], [1], [0]])
    huge = BlockManager(10**12, 16)
    assert huge.n_free() == 10**12 and [huge.allocate() for _ in range(2)] == [0, 1] and len(huge.blocks) == 2
    huge.release([0])
    assert huge.n_free() == 10**12 - 1
    huge.check([[1]])

"""`kvwall serve`'s HTTP API on a free loopback port with a tiny random llama and a word-level tokenizer
("w0".."w159"), driven by raw httpx and the openai client: every answer is checked against the same prompt
generated alone with engine/generate.py."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from kvwall.engine.generate import generate  # noqa: E402
from kvwall.engine.tokenizer import Text  # noqa: E402
from kvwall.serve import free_port, serving_in_thread  # noqa: E402
from kvwall.serve.runner import Runner  # noqa: E402
from kvwall.serve.server import Api  # noqa: E402
from kvwall.serve.worker import Worker  # noqa: E402

NAME, VOCAB = "tiny", 160


def word_tokenizer(path) -> Text:
    """w0..w159 <-> ids 0..159, split on whitespace; decode joins with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return Text(path)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """(base URL, runner, model, tokenizer) of a server running in a thread; stopped after the module."""
    _, model = tiny_model("llama")
    tok = word_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    runner = Runner(model, n_blocks=200, block_size=4, chunk=32, max_batch=8)
    with serving_in_thread(Api(Worker(runner), tok, NAME).app()) as url:
        yield url, runner, model, tok


def solo_text(model, tok, prompt_ids: list[int], n: int) -> str:
    return tok.decode(generate(model, [prompt_ids], n).tokens[0])


def chat_ids(tok, text: str) -> list[int]:
    return tok.encode(f"user: {text}\nassistant:")  # the plain template of a tokenizer without one


def metric(base: str, name: str) -> float:
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line.startswith(f"kvwall_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def sse_events(lines) -> list:
    out = []
    for line in lines:
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


def test_health_models_and_metrics(server):
    base, runner, _, _ = server
    assert httpx.get(base + "/health").json() == {"status": "ok"}
    models = httpx.get(base + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [NAME]
    text = httpx.get(base + "/metrics").text
    assert "# TYPE kvwall_kv_blocks_free gauge" in text and metric(base, "kv_blocks_free") == 200
    assert metric(base, "kv_block_bytes") == runner.block_bytes == 3 * 2 * 32 * 4 * 4  # 3 layers, 2 heads, k+v


def test_completion_equals_a_solo_run_with_usage(server):
    base, _, model, tok = server
    r = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": "w1 w2 w3", "max_tokens": 6,
                                                   "temperature": 0}).json()
    assert r["object"] == "text_completion"
    assert r["choices"][0]["text"] == solo_text(model, tok, [1, 2, 3], 6)
    assert r["choices"][0]["finish_reason"] == "length"
    assert r["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9,
                          "prompt_tokens_details": {"cached_tokens": 0}}  # 3 tokens fill no block of 4
    ids = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": [1, 2, 3], "max_tokens": 6,
                                                     "temperature": 0}).json()
    assert ids["choices"][0]["text"] == r["choices"][0]["text"]


def test_streamed_completion_equals_the_whole_one(server):
    base, _, model, tok = server
    body = {"model": NAME, "prompt": "w9 w8 w7 w6", "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", base + "/v1/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 8
    chunks = events[:-2]
    assert "".join(e["choices"][0]["text"] for e in chunks) == solo_text(model, tok, [9, 8, 7, 6], 8)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_chat_through_the_openai_client(server):
    openai = pytest.importorskip("openai")
    base, _, model, tok = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=30, max_retries=0)
    want = solo_text(model, tok, chat_ids(tok, "w5 w6"), 7)
    msg = [{"role": "user", "content": "w5 w6"}]
    r = client.chat.completions.create(model=NAME, messages=msg, max_tokens=7, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 7
    parts = [c.choices[0].delta.content or "" for c in
             client.chat.completions.create(model=NAME, messages=msg, max_tokens=7, temperature=0, stream=True)
             if c.choices]
    assert "".join(parts) == want
    c = client.completions.create(model=NAME, prompt="w1 w2 w3", max_tokens=4, temperature=0)
    assert c.choices[0].text == solo_text(model, tok, [1, 2, 3], 4)


def test_a_stop_string_ends_the_text_before_it(server):
    base, runner, model, tok = server
    words = solo_text(model, tok, [4, 4, 4], 10).split()
    stop = " " + words[3]  # the text ends before the 4th word's first appearance
    want = " ".join(words[:words.index(words[3])])
    for stream in (False, True):
        body = {"model": NAME, "prompt": "w4 w4 w4", "max_tokens": 10, "temperature": 0, "stop": [stop],
                "stream": stream}
        if stream:
            with httpx.stream("POST", base + "/v1/completions", json=body) as resp:
                events = sse_events(resp.iter_lines())[:-1]
            text, finish = "".join(e["choices"][0]["text"] for e in events), events[-1]["choices"][0]["finish_reason"]
        else:
            choice = httpx.post(base + "/v1/completions", json=body).json()["choices"][0]
            text, finish = choice["text"], choice["finish_reason"]
        assert (text, finish) == (want, "stop")
    wait_idle(base)


def wait_idle(base: str) -> None:
    for _ in range(200):  # bounded: 10 s
        if metric(base, "kv_blocks_used") == 0 and metric(base, "requests_running") == 0:
            return
        time.sleep(0.05)
    raise AssertionError("blocks still held")


@pytest.mark.slow
def test_concurrent_requests_equal_solo_runs(server):
    base, _, model, tok = server
    prompts = [[(5 * i + j) % VOCAB for j in range(3 + i % 5)] for i in range(12)]

    async def one(client, ids, n):
        r = await client.post(base + "/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": n,
                                                              "temperature": 0})
        return r.json()["choices"][0]["text"]

    async def all_at_once():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, p, 4 + i % 6) for i, p in enumerate(prompts)))

    got = asyncio.run(all_at_once())
    assert got == [solo_text(model, tok, p, 4 + i % 6) for i, p in enumerate(prompts)]
    wait_idle(base)


def test_a_disconnect_mid_stream_frees_its_blocks(server, monkeypatch):
    base, runner, _, _ = server
    slow = runner.forward
    monkeypatch.setattr(runner, "forward", lambda rows: (time.sleep(0.01), slow(rows))[1])  # 400 tokens: 4 s
    before = metric(base, "generation_tokens_total")
    body = {"model": NAME, "prompt": "w1 w2", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", base + "/v1/completions", json=body) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i >= 4:
                break  # leaving the block closes the connection mid-stream
    assert metric(base, "kv_blocks_used") > 0 or metric(base, "generation_tokens_total") - before < 400
    wait_idle(base)
    assert metric(base, "generation_tokens_total") - before < 400  # aborted long before its 400 tokens


@pytest.mark.slow
@pytest.mark.parametrize("body, status, fragment", [
    (b"{not json", 400, "not valid JSON"),
    ({"model": "gpt-4", "prompt": "w1"}, 404, "not served here"),
    ({"model": NAME, "prompt": "w1", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": NAME, "prompt": "w1 " * 600}, 400, "maximum context"),
    ({"model": NAME, "prompt": "w1", "temperature": 5}, 400, "temperature"),
    ({"model": NAME, "prompt": "w1", "n": 0}, 400, "n must be"),
    ({"model": NAME, "prompt": [1, 999]}, 400, "vocabulary"),
    ({"model": NAME, "prompt": ""}, 400, "empty"),
    ({"model": NAME, "prompt": "w1", "stop": [1]}, 400, "stop"),
    ({"model": NAME, "messages": "hi"}, 400, "messages"),
    ({"model": NAME, "prompt": "   "}, 400, "encodes to no tokens"),
    ({"model": NAME, "prompt": "w1", "seed": -1}, 400, "seed"),
    ({"model": NAME, "prompt": "w1", "max_tokens": 10_000}, 400, "maximum context"),
])
def test_bad_requests_get_a_400_and_the_server_keeps_serving(server, body, status, fragment):
    base, _, model, tok = server
    url = base + ("/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions")
    r = httpx.post(url, content=body) if isinstance(body, bytes) else httpx.post(url, json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error"
    ok = httpx.post(base + "/v1/completions", json={"model": NAME, "prompt": "w1 w2 w3", "max_tokens": 3,
                                                    "temperature": 0}).json()
    assert ok["choices"][0]["text"] == solo_text(model, tok, [1, 2, 3], 3)


@pytest.mark.slow
def test_kvwall_serve_command_serves_and_stops_on_ctrl_c(tiny_model, tmp_path):
    """The CLI end to end: `kvwall serve DIR --port P` answers, then SIGINT drains and exits with status 0."""
    import shutil
    import signal
    import subprocess
    import sys

    src, model = tiny_model("llama")
    ckpt = tmp_path / "tiny"
    shutil.copytree(src, ckpt)
    tok = word_tokenizer(ckpt / "tokenizer.json")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvwall", "serve", str(ckpt), "--port", str(port),
                             "--kv-memory", "1MiB", "--block-size", "8", "--api-key", "k"],
                            stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        # bounded by time: torch's import and the model load took over 60 s on a loaded 2-core host (2026-12-03)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(base + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert proc.poll() is None, "kvwall serve exited before it answered"
        body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 5, "temperature": 0}
        assert httpx.post(base + "/v1/completions", json=body).status_code == 401  # no key
        r = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer k"}).json()
        assert r["choices"][0]["text"] == solo_text(model, tok, [1, 2, 3], 5)
        assert metric(base, "kv_blocks_free") == 1024 * 1024 // (3 * 2 * 32 * 4 * 8)  # 170 blocks of 6 KiB
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "KV pool 170 blocks of 8 tokens" in err


@pytest.mark.parametrize("args, fragment", [
    (["--kv-memory", "lots"], "bad --kv-memory 'lots'"),
    (["--cache", "nvfp4"], "--cache 'nvfp4': the paged pool stores fp32, bf16, fp16, fp8, int8 or int4"),
    (["--kv-memory", "1KiB"], "holds no block"),
])
def test_kvwall_serve_refuses_bad_options_in_one_line(tiny_model, capsys, args, fragment):
    from kvwall.cli import main

    path, _ = tiny_model("llama")
    capsys.readouterr()  # what building the checkpoint printed
    assert main(["serve", str(path), "--port", str(free_port()), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwall: error: ") and fragment in err and err.count("\n") == 1


def test_kvwall_serve_refuses_a_port_in_use(tiny_model, capsys):
    from kvwall.cli import main

    path, _ = tiny_model("llama")
    capsys.readouterr()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert main(["serve", str(path), "--port", str(s.getsockname()[1])]) == 2
    assert "cannot listen on 127.0.0.1:" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("mode", [["--concurrency", "4"], ["--rate", "50"]])
def test_loadtest_against_the_server(server, capsys, mode):
    """8 streamed requests of 5 prompt words (unknown words: one token each) and 6 output tokens each."""
    from kvwall.cli import main

    base, _, _, _ = server
    args = ["loadtest", base, "--model", NAME, *mode, "--requests", "8", "--prompt-tokens", "5",
            "--output-tokens", "6", "--slo-ttft", "30s", "--json"]
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["completed"], d["errors"], d["output_tokens"], d["prompt_tokens"]) == (8, 0, 48, 40)
    assert all(len(s["itl"]) == 5 for s in d["samples"])  # one text chunk per token: 5 gaps after the first
    assert 0 < d["ttft_s"]["p50"] <= d["e2e_s"]["p50"] and d["goodput"] == d["request_throughput"]
    assert main(["loadtest", base, "--model", "nope", "--concurrency", "1", "--requests", "1"]) == 2
    assert "HTTP 404" in capsys.readouterr().err  # an unknown model: OpenAI's 404


def test_loadtest_token_ids_send_exact_prompt_lengths(server, capsys):
    """--token-ids VOCAB: 3 prompts of exactly 37 token ids each; the server's usage counts 37 a prompt (words
    would count whatever the tokenizer makes of them), and a --dataset beside it is refused."""
    from kvwall.cli import main

    base, _, _, _ = server
    args = ["loadtest", base, "--model", NAME, "--concurrency", "2", "--requests", "3", "--prompt-tokens", "37",
            "--output-tokens", "2", "--token-ids", str(VOCAB), "--json"]
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["completed"], d["prompts"]) == (3, f"token ids below {VOCAB}")
    assert [s["prompt_tokens"] for s in d["samples"]] == [37, 37, 37]
    assert main([*args, "--dataset", "d.jsonl"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_loadtest_shared_prefix_hits_the_prefix_cache(server, tmp_path, capsys):
    """4 requests one after another, each its own 3 known words (distinct: nothing to share), then the same with 8
    shared words before them (unknown words: one token each, w0; blocks of 4 tokens): the later requests take the
    prefix's two blocks from the cache (usage's cached_tokens 8; the first may find them from earlier tests)."""
    from kvwall.cli import main

    base, _, _, _ = server
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"w{40 + 3 * i} w{41 + 3 * i} w{42 + 3 * i}"}) + "\n"
                            for i in range(4)))
    args = ["loadtest", base, "--model", NAME, "--concurrency", "1", "--requests", "4", "--dataset", str(data),
            "--output-tokens", "2", "--json"]
    assert main(args) == 0
    assert [s["cached_tokens"] for s in json.loads(capsys.readouterr().out)["samples"]] == [0, 0, 0, 0]
    assert main([*args, "--shared-prefix", "8"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [s["cached_tokens"] for s in d["samples"]][1:] == [8, 8, 8] and d["prompt_tokens"] == 4 * 11


def test_percentiles_interpolate_like_numpy_docs():
    from kvwall.measure.loadtest import percentiles

    p = percentiles([1.0, 2.0, 3.0, 4.0])
    assert (p["p50"], p["p90"], p["mean"]) == (2.5, pytest.approx(3.7), 2.5)  # 1 + 0.9 * 3 = 3.7


@pytest.mark.slow
def test_loadtest_sends_a_dataset_and_plots(server, tmp_path, capsys):
    from kvwall.cli import main

    base, _, _, _ = server
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "w1 w2 w3"}\n\n{"prompt": "w4 w5"}\n')
    png = tmp_path / "cdf.png"
    args = ["loadtest", base, "--model", NAME, "--concurrency", "2", "--requests", "3", "--output-tokens", "4",
            "--dataset", str(data), "--plot", str(png), "--json"]
    assert main(args) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["prompt_tokens"] == 3 + 2 + 3 and d["output_tokens"] == 12  # prompts in turn: 3, 2, 3 tokens
    assert png.stat().st_size > 0
    data.write_text('{"text": "w1"}\n')
    assert main(args) == 2
    assert 'line 1: expected a JSON object with a non-empty "prompt" string' in capsys.readouterr().err


@pytest.mark.slow
def test_loadtest_sweep_runs_each_load_and_plots(server, tmp_path, capsys):
    from kvwall.cli import main

    base, _, _, _ = server
    png = tmp_path / "sweep.png"
    assert main(["loadtest", base, "--model", NAME, "--sweep", "concurrency=1,3", "--requests", "3",
                 "--prompt-tokens", "4", "--output-tokens", "3", "--plot", str(png), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [p["load"] for p in d["points"]] == [1, 3] and [p["mode"] for p in d["points"]] == [
        "concurrency 1", "concurrency 3"]
    assert all(p["completed"] == 3 and p["output_tokens"] == 9 for p in d["points"]) and png.stat().st_size > 0
    for bad in ("speed=1", "concurrency=1.5", "rate=", "rate=-1"):
        assert main(["loadtest", base, "--model", NAME, "--sweep", bad]) == 2
        assert "--sweep must be rate=R1,R2,... or concurrency=C1,C2,..." in capsys.readouterr().err


@pytest.mark.slow
def test_a_client_that_gives_up_on_a_whole_answer_frees_its_blocks(server, monkeypatch):
    """Not streamed: the server notices the closed connection while it waits (polled each second) and aborts."""
    base, runner, _, _ = server
    slow = runner.forward
    monkeypatch.setattr(runner, "forward", lambda rows: (time.sleep(0.01), slow(rows))[1])  # 400 tokens: 4 s
    before = metric(base, "generation_tokens_total")
    body = {"model": NAME, "prompt": "w3 w4", "max_tokens": 400, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + "/v1/completions", json=body, timeout=0.5)
    wait_idle(base)
    assert metric(base, "generation_tokens_total") - before < 400

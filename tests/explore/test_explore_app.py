"""`kvwall explore`'s server without a browser: its JSON is kvwall.api's, its errors are one line, it serves
plotly.js itself, and it reads no local path and fetches nothing for a model name.

Hand figures: Llama-3-70B (80 layers, 8 KV heads of 128, config.json of meta-llama/Meta-Llama-3-70B) keeps
2 x 80 x 8 x 128 = 163,840 fp8 bytes of KV per token.
"""

from __future__ import annotations

import json
import socket
import time

import numpy as np
import pytest

from kvwall import api, cli

starlette = pytest.importorskip("starlette")
pytest.importorskip("plotly", reason="kvwall explore's charts need plotly: pip install 'kvwall[explore]'")

from starlette.testclient import TestClient  # noqa: E402

from kvwall.explore import app as explore_app  # noqa: E402

THE_ISSUE = "model=llama-3-70b&device=h100-sxm&tp=4&kv-format=fp8&batch=8&context=128k"


@pytest.fixture(scope="module")
def client():
    return TestClient(explore_app.make_app())


def post(client, query: str = "", config: str | None = None):
    return client.post("/api/explore", json={"query": query, "config": config})


def test_the_page_and_plotly_come_from_kvwall(client):
    page = client.get("/")
    assert page.status_code == 200 and "<script src=\"/static/plotly.min.js\"></script>" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from elsewhere
    js = client.get("/static/plotly.min.js")
    assert js.status_code == 200 and js.content == explore_app.plotly_js().read_bytes()
    assert client.get("/static/explore.js").status_code == 200
    assert client.get("/static/../app.py").status_code == 404
    assert client.get("/static/app.py").status_code == 404


def test_every_option_has_its_field_on_the_page(client, tmp_path, monkeypatch):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))  # no `kvwall calibrate` profile: no `local` device
    page = client.get("/").text
    options = client.get("/api/options").json()
    assert options["options"] == list(explore_app.OPTIONS)
    for key in explore_app.OPTIONS:  # the form's field for each query key carries the key as its id
        assert f'id="{key}" data-opt="{key}"' in page, key
    assert "h100-sxm" in options["devices"] and "local" not in options["devices"]


def test_the_json_is_kvwall_apis(client):
    r = post(client, THE_ISSUE)
    assert r.status_code == 200, r.text
    got = r.json()
    opts = dict(device="h100-sxm", tp=4, kv_format="fp8", batch=8)
    mem = api.memory("llama-3-70b", context="128k", **opts)
    assert got["models"][0]["memory"] == mem.to_dict()
    assert got["models"][0]["memory"]["cache_bytes_per_token"] == 2 * 80 * 8 * 128
    assert got["models"][0]["fit"] == api.fit("llama-3-70b", **opts).to_dict()
    assert got["speed"] == api.speed("llama-3-70b", context="128k", prompt_tokens="2k", **opts).to_dict()
    assert got["speed_ideal"] == api.speed("llama-3-70b", context="128k", prompt_tokens="2k", ideal=True,
                                           **opts).to_dict()
    assert got["roofline"] == api.roofline("llama-3-70b", context="128k", prompt_tokens="2k", **opts).to_dict()
    assert got["simulate"] is None  # no rate asked for
    assert got["query"] == THE_ISSUE
    assert got["commands"][:3] == [
        "kvwall memory llama-3-70b --device h100-sxm --tp 4 --kv-format fp8 --batch 8 --context 128k",
        "kvwall fit llama-3-70b --device h100-sxm --tp 4 --kv-format fp8 --batch 8",
        "kvwall speed llama-3-70b --device h100-sxm --tp 4 --kv-format fp8 --batch 8 --context 128k --prompt 2k"]
    curve = got["models"][0]["curve"]
    assert [p["context"] for p in curve] == [1 << k for k in range(10, 20)]  # 1k .. 4 x 128k
    at = next(p for p in curve if p["context"] == 131_072)
    assert at["per_gpu_bytes"] == mem.per_gpu_bytes
    # the cache is linear in context: 2k - 1k tokens add 1,024 x 8 sequences x 40,960 B per GPU (tp 4)
    assert curve[1]["per_gpu_bytes"] - curve[0]["per_gpu_bytes"] == 1024 * 8 * 163_840 // 4


def test_commands_print_what_the_page_shows(client, capsys):
    got = post(client, THE_ISSUE).json()
    for line, key in ((got["commands"][0], "memory"), (got["commands"][2], "speed")):
        assert cli.main(line.split()[1:] + ["--json"]) == 0
        printed = json.loads(capsys.readouterr().out)
        assert printed == (got["models"][0]["memory"] if key == "memory" else got["speed"])


@pytest.mark.slow  # two simulations of 50 requests: ~3 s on 2 busy cores
def test_a_rate_adds_the_simulate_summary(client):
    got = post(client, THE_ISSUE + "&rate=1&requests=50&output-tokens=64").json()
    sim = api.simulate("llama-3-70b", rate=1, requests=50, prompt_tokens=2048, output_tokens=64, device="h100-sxm",
                       tp=4, kv_format="fp8")
    assert got["simulate"] == sim.to_dict()
    assert got["commands"][-1] == ("kvwall simulate llama-3-70b --device h100-sxm --tp 4 --kv-format fp8 --rate 1 "
                                   "--requests 50 --prompt-tokens 2048 --output-tokens 64")


def test_compare_takes_two_to_six_models(client):
    got = post(client, "model=llama-3-8b&model=mistral-7b&model=gemma-3-27b&context=32k").json()
    assert [m["memory"]["model"] for m in got["models"]] == ["llama-3-8b", "mistral-7b-v0.1", "gemma-3-27b"]
    assert [m["model"] for m in got["speed"]["models"]] == ["llama-3-8b", "mistral-7b-v0.1", "gemma-3-27b"]
    assert got["models"][0]["memory"]["cache_bytes_per_token"] == 2 * 32 * 8 * 128 * 2  # Llama 3 8B: 128 KiB
    seven = "&".join(f"model={m}" for m in ["llama-3-8b"] * 7)
    assert post(client, seven).json() == {"error": "7 models: compare at most 6"}


def test_a_pasted_config(client):
    cfg = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
           "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1000,
           "max_position_embeddings": 4096}
    got = post(client, "kv-format=fp8&batch=2&context=4k", json.dumps(cfg)).json()
    mem = got["models"][0]["memory"]
    assert mem["cache_bytes_per_token"] == 2 * 4 * 2 * 32  # K and V, 4 layers, 2 KV heads of 32, 1 byte
    assert mem["cache_bytes"] == 2 * 4096 * 512
    assert got["commands"][0] == "kvwall memory config.json --device h100-sxm --tp 1 --kv-format fp8 --batch 2 " \
                                 "--context 4k"
    assert "model=" not in got["query"]  # a pasted config is not in the URL


@pytest.mark.parametrize(("query", "config", "message"), [
    ("model=nope", None, "unknown model 'nope': pick a catalog name (see `kvwall models`) or paste its config.json"),
    # a hub id or a path is not fetched or read: the page only takes catalog names and pasted configs
    ("model=someone/some-model", None, "unknown model 'someone/some-model'"),
    ("model=/etc/hostname", None, "unknown model '/etc/hostname'"),
    ("", None, "no model: pick one from the catalog"),
    ("model=llama-3-8b&batch=0", None, "batch must be at least 1 (got 0)"),
    ("model=llama-3-8b&kv-format=fp9", None, "unknown format 'fp9'"),
    ("model=llama-3-8b&device=tpu9", None, "unknown device 'tpu9'"),
    ("model=llama-3-8b&colour=red", None, "unknown option 'colour' in the page's query"),
    ("model=llama-3-8b&batch=1&batch=2", None, "batch is given 2 times"),
    ("", '{"model_type": "llama",', "the pasted config.json is not valid JSON (line 1, column 24"),
    ("", '{"model_type": "llama"}', "the pasted config.json has no 'hidden_size'"),
    ("", "[1, 2]", "the pasted config.json is not a JSON object"),
    ("model=llama-3-8b&rate=1&requests=2001", None, "requests 2,001: the page simulates at most 2,000 per update"),
])
def test_errors_are_one_line(client, query, config, message):
    r = post(client, query, config)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error.startswith(message) and "\n" not in error


def test_a_gguf_upload_gives_its_config(client, tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for add, v in ((w.add_context_length, 2048), (w.add_embedding_length, 64), (w.add_block_count, 3),
                   (w.add_feed_forward_length, 128), (w.add_head_count, 4), (w.add_head_count_kv, 2),
                   (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_dimension_count, 16), (w.add_vocab_size, 32)):
        add(v)
    w.add_tensor("token_embd.weight", np.zeros((32, 64), np.float16))  # the metadata's witnesses: vocab x hidden
    for i in range(3):  # and 3 blocks
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = client.post("/api/gguf", content=path.read_bytes())
    assert r.status_code == 200, r.text
    got = post(client, "kv-format=fp8", json.dumps(r.json()["config"])).json()
    assert got["models"][0]["memory"]["cache_bytes_per_token"] == 2 * 3 * 2 * 16  # K and V, 3 layers, 2 x 16
    bad = client.post("/api/gguf", content=b"{}")
    assert bad.status_code == 400 and bad.json()["error"].startswith("the uploaded file is not a GGUF file")


def test_cli_port_errors_are_one_line(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert cli.main(["explore", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvwall: error: cannot listen on 127.0.0.1:{port} (") and err.count("\n") == 1
    assert cli.main(["explore", "--port", "70000"]) == 2
    assert "--port must be at most 65,535" in capsys.readouterr().err


def test_kvwall_explore_prints_its_url_and_serves_the_page():
    import re
    import subprocess
    import sys
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-m", "kvwall", "explore", "--port", "0"], stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stderr.readline()
        m = re.fullmatch(r"kvwall explore: (http://127\.0\.0\.1:(\d+)/) \(Ctrl-C stops\)\n", line)
        assert m, line
        for _ in range(100):  # the URL is printed just before uvicorn starts accepting
            try:
                with urllib.request.urlopen(m.group(1) + "api/options", timeout=5) as r:
                    assert "llama-3-70b" in json.load(r)["models"]
                break
            except OSError:
                time.sleep(0.1)
        else:
            raise AssertionError(f"nothing answered at {m.group(1)}")
        with urllib.request.urlopen(m.group(1), timeout=5) as r:
            assert b"<title>kvwall explore" in r.read()
    finally:
        proc.terminate()
        proc.wait(10)

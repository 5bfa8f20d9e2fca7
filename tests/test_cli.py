"""The command line: numbers in JSON, one-line errors, and a light import."""

import json
import subprocess
import sys

import pytest

from kvwall.cli import main


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_compare_default_lineup(capsys):
    data = run_json(capsys, "compare")
    names = [m["model"] for m in data["models"]]
    assert names == ["gpt2-xl", "llama-3-8b", "llama-3-70b", "deepseek-v3", "gemma-3-27b", "mamba-2.8b-hf",
                     "jamba-v0.1"]
    by = {m["model"]: m for m in data["models"]}
    assert by["llama-3-8b"]["cache_bytes"]["131072"] == 131_072 * 131_072
    # 141 GB of bf16 weights do not fit one 80 GB GPU (72 GB after the reserve): two do
    assert (by["llama-3-70b"]["tp"], by["llama-3-70b"]["weights_fit"], by["llama-3-8b"]["tp"]) \
        == (2, True, 1)
    assert by["mamba-2.8b-hf"]["max_context_unbounded"] is True
    assert data["contexts"] == [4096, 32768, 131072, 1048576]


def test_memory_with_reshape_and_fp8(capsys):
    data = run_json(capsys, "memory", "llama-3-70b", "--context", "128k", "--batch", "8", "--kv-format", "fp8",
                    "--tp", "4", "--device", "h100-sxm")
    assert data["cache_bytes"] == 8 * 131_072 * 80 * 2 * 8 * 128  # fp8: 1 byte per element
    assert data["per_gpu"]["cache_bytes"] == data["cache_bytes"] // 4
    # 4 x H100: 35.3 GB weights + 42.9 GB cache per GPU leaves 1.8 GB, less than the 8 GB (10 %) reserve
    assert data["device"]["free_bytes"] == 80 * 10**9 - 8 * 10**9 - data["per_gpu"]["total_bytes"]
    assert data["device"]["fits"] is False
    data = run_json(capsys, "memory", "llama-3-70b", "--kv-heads", "64")
    assert data["cache_bytes_per_token"] == 2_621_440
    assert any("64 KV heads" in n for n in data["notes"])


def test_fit_json(capsys):
    data = run_json(capsys, "fit", "llama-3-8b", "--memory", "80GB", "--batch", "8")
    assert data["max_context"] == (80 * 10**9 - 8 * 10**9 - 2 * 8_030_261_248) // (8 * 131_072)


def test_show_and_models_and_devices(capsys):
    show = run_json(capsys, "show", "deepseek-v3")
    assert show["cache_bytes_per_token"] == 70_272 and show["params"] > show["active_params"]
    models = run_json(capsys, "models")
    assert len(models) >= 20
    devices = run_json(capsys, "devices")
    h100 = next(d for d in devices["devices"] if d["name"] == "h100-sxm")
    assert h100["balance_bf16"] == pytest.approx(989e12 / 3.35e12)  # ~295 FLOP/byte


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["show", "no-such-model"], "unknown model"),
    (["memory", "gpt2", "--context", "-5"], "bad context"),
    (["memory", "gpt2", "--kv-format", "fp7"], "unknown format"),
    (["fit", "gpt2", "--device", "tpu-v99"], "unknown device"),
    (["memory", "gpt2", "--batch", "0"], "--batch must be at least 1"),
    (["memory", "llama-3-8b", "--window", "9000"], "never slides"),
    (["memory", "llama-3-8b", "--context", "1M", "--window", "2M"], "the longest --context asked for (1048576)"),
    (["memory", "llama-3-8b", "--kv-heads", "5"], "must divide"),
])
def test_user_errors_are_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "kvwall", *argv], capture_output=True, text=True)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert proc.stdout == ""


def test_a_window_past_the_models_maximum_slides_in_a_longer_what_if(capsys):
    """Llama-3-8B was trained to 8,192 tokens; at a 1M-token what-if a 16k window slides: 32 layers x 8 KV heads x
    128 x 2 (K, V) x 2 B = 131,072 B a token x 16,384 tokens = 2 GiB, however long the context."""
    from kvwall.cli import main

    assert main(["memory", "llama-3-8b", "--context", "1M", "--window", "16k", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cache_bytes"] == 32 * 8 * 128 * 2 * 2 * 16384 == 2 * 2**30


@pytest.mark.slow
def test_config_errors_from_files(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    proc = subprocess.run([sys.executable, "-m", "kvwall", "show", str(bad)], capture_output=True, text=True)
    assert proc.returncode == 2 and "not valid JSON" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_predictor_does_not_import_torch():
    code = ("import sys; from kvwall.cli import main; main(['compare']); "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'heavy import'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_unknown_hub_id_offline_is_one_line(monkeypatch):
    env = {"HF_ENDPOINT": "https://no-such-host.invalid", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "kvwall", "show", "someorg/somemodel"], capture_output=True,
                          text=True, env=env, timeout=60)
    assert proc.returncode == 2
    assert "not in the catalog" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_checkpoint_directory_and_config_path(write_config, capsys):
    cfg = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 1, "intermediate_size": 128, "vocab_size": 100, "torch_dtype": "float16"}
    d = write_config(cfg, "tiny-llama")
    by_dir = run_json(capsys, "show", str(d))
    by_file = run_json(capsys, "show", str(d / "config.json"))
    # 2 layers x 1 KV head x (16 + 16) x 2 B (fp16 from torch_dtype)
    assert by_dir["cache_bytes_per_token"] == by_file["cache_bytes_per_token"] == 2 * 1 * 32 * 2
    assert by_dir["name"] == "tiny-llama"

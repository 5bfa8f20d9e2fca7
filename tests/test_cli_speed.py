"""roofline / speed / speculate on the command line: JSON numbers, plots, errors."""

import json
import subprocess
import sys

import pytest

from kvwall.cli import main


def run_json(capsys, *argv):
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_roofline_json_states_assumptions(capsys):
    data = run_json(capsys, "roofline", "llama-3-8b", "--device", "h100-sxm", "--batch", "1,8", "--context", "4k",
                    "--prompt", "2k", "--ideal")
    assert data["mode"] == "ideal" and data["assumptions"]["mode"] == "ideal"
    a = data["assumptions"]
    assert a["machine_balance"] == pytest.approx(989e12 / 3.35e12)
    assert a["compute_eff"] == 1.0 and a["mem_eff"] == 1.0 and "counted" in a
    b1, b8 = data["phases"]
    assert b1["decode"]["bound"] == "memory" and b1["prefill"]["bound"] == "compute"
    assert b8["tokens_per_s_total"] > b1["tokens_per_s_total"]
    assert b1["tokens_per_s_total"] == pytest.approx(1 / b1["tpot_s"])
    assert b1["energy_per_token"]["estimate"] is True


@pytest.mark.slow
def test_roofline_kv_format_and_tp(capsys):
    base = run_json(capsys, "roofline", "llama-3-70b", "--tp", "4", "--context", "32k")
    fp8 = run_json(capsys, "roofline", "llama-3-70b", "--tp", "4", "--context", "32k", "--kv-format", "fp8")

    def cache(d):
        return sum(o["cache_read"] for o in d["phases"][0]["decode"]["ops"])

    assert cache(fp8) == pytest.approx(cache(base) / 2)
    assert base["weights_fit"] is True


@pytest.mark.slow
def test_roofline_and_speed_plots(tmp_path, capsys):
    png = tmp_path / "roof.png"
    assert main(["roofline", "gpt2", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "roofline chart written" in capsys.readouterr().out
    png2 = tmp_path / "speed.png"
    data = run_json(capsys, "speed", "llama-3-8b", "mamba-2.8b", "--context", "1k,64k", "--plot", str(png2))
    assert png2.read_bytes()[:4] == b"\x89PNG"
    llama, mamba = data["models"]
    assert llama["decode"][1]["tpot_s"] > llama["decode"][0]["tpot_s"]
    assert mamba["decode"][1]["tpot_s"] == mamba["decode"][0]["tpot_s"]


def test_speculate_json(capsys):
    data = run_json(capsys, "speculate", "llama-3-70b", "--draft", "llama-3-8b", "--acceptance", "0.8",
                    "--k", "1,4", "--device", "h200")
    assert [r["k"] for r in data["rows"]] == [1, 4]
    assert data["rows"][0]["expected_tokens"] == pytest.approx(1.8)


def test_speculate_takes_a_draft_whose_vocabulary_is_padded_apart(capsys):
    """Qwen3-8B's embedding has 151,936 rows and Qwen2.5-7B's 152,064 (public configs): one tokenizer, padded
    apart by 0.08 %, a pairing that runs; GPT-2's 50,257 beside Llama 3's 128,256 is refused (test_bad_inputs)."""
    data = run_json(capsys, "speculate", "qwen2.5-7b", "--draft", "qwen3-8b", "--k", "2")
    assert data["draft"] == "qwen3-8b" and data["rows"][0]["k"] == 2


def test_speculate_says_when_the_pair_does_not_fit_and_what_the_ks_show(capsys):
    """Llama-3-70B (141 GB of bf16 weights) beside Llama-3-8B's 16 GB on one 80 GB H100 (72 GB after the
    reserve) does not fit: one warning naming both; Llama-3-8B (16.1 GB) beside Llama-3.2-1B (2.5 GB) and a 4k
    cache (0.5 GiB) does. With acceptance 0 every draft is wasted (E[tokens] = 1 at any k): no k pays. With only
    k = 1, 2 tried and k = 2 the best, nothing is known past it."""
    from kvwall.cli import main

    assert main(["speculate", "llama-3-70b", "--draft", "llama-3-8b", "--device", "h100", "--json"]) == 0
    warning = json.loads(capsys.readouterr().out)["fit_warning"]
    assert "does not fit" in warning and "llama-3-8b's weights" in warning
    assert main(["speculate", "llama-3-8b", "--draft", "llama-3.2-1b", "--device", "h100", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fit_warning"] is None
    assert main(["speculate", "llama-3-8b", "--draft", "llama-3.2-1b", "--acceptance", "0"]) == 0
    assert "no k tried pays" in capsys.readouterr().out
    assert main(["speculate", "llama-3-8b", "--draft", "llama-3.2-1b", "--acceptance", "0.8", "--k", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "best k = 2" in out and "the largest k tried" in out and "cost more than they add" not in out


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["roofline", "gpt2", "--mem-eff", "1.5"], "--mem-eff"),
    (["roofline", "gpt2", "--batch", "0"], "bad batch"),
    (["roofline", "gpt2", "--device", "nope"], "unknown device"),
    (["speculate", "gpt2", "--draft", "gpt2", "--acceptance", "2"], "acceptance"),
    (["roofline", "gpt2", "--plot", "/no/such/dir/x.png"], "does not exist"),
])
def test_errors(argv, message):
    proc = subprocess.run([sys.executable, "-m", "kvwall", *argv], capture_output=True, text=True)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_speed_runs_each_point_on_the_smallest_group_that_fits(capsys):
    """H100: 80 GB, 72 GB after the reserve. Llama-3-70B's 141 GB of bf16 weights need 2 GPUs; at 512k tokens its
    320 KiB x 524288 = 171.8 GB of cache needs 8 (tp 4: 42.9 + 35.3 GB per GPU is over 72). Llama-3-8B: 16 GB of
    weights + 128 KiB x 524288 = 68.7 GB of cache is over 72 on one GPU, 42 GB per GPU on two."""
    from kvwall.cli import main

    assert main(["speed", "llama-3-70b", "llama-3-8b", "--device", "h100", "--context", "4k,512k", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    big, small = data["models"]
    assert [(r["tp"], r["fits"]) for r in big["decode"]] == [(2, True), (8, True)]
    assert [(r["tp"], r["gpus"]) for r in small["decode"]] == [(1, 1), (2, 2)]
    assert main(["speed", "llama-3-70b", "--device", "h100", "--tp", "1", "--context", "4k", "--json"]) == 0
    fixed = json.loads(capsys.readouterr().out)["models"][0]
    assert fixed["decode"][0]["fits"] is False and "(!)" in fixed["fit_warning"]


def test_a_point_that_fits_nowhere_runs_on_the_widest_split_the_heads_allow(capsys):
    """SmolLM2-135M has 9 query heads and 3 KV heads: tp 2, 4 and 8 do not split them, so its only group is one
    GPU. Batch 64 x 64k tokens of bf16 cache is 30 layers x 3 heads x 64 x 2 (K, V) x 2 B = 23,040 B a token x
    4,194,304 tokens = 96.6 GB, over an H100's 72 GB after the reserve: a what-if on that one GPU, with one
    warning line (it used to fail with "tp=8 does not divide the 9 query heads" for a --tp nobody passed)."""
    from kvwall.cli import main

    assert 30 * 3 * 64 * 2 * 2 * 64 * 65536 == 96_636_764_160
    argv = ["speed", "smollm2-135m", "--device", "h100", "--batch", "64", "--context", "1k,64k"]
    assert main([*argv, "--json"]) == 0
    m = json.loads(capsys.readouterr().out)["models"][0]
    assert [(r["tp"], r["fits"]) for r in m["decode"]] == [(1, True), (1, False)]
    assert m["decode"][1]["tpot_s"] > m["decode"][0]["tpot_s"] > 0 and "(!)" in m["fit_warning"]
    assert "the widest split its heads allow (tp 1)" in m["fit_warning"] and "8 GPUs" not in m["fit_warning"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("do not fit") == 1 and "warning: smollm2-135m: points marked (!)" in out


def test_compare_names_the_group_that_holds_the_weights(capsys):
    from kvwall.cli import main

    assert main(["compare", "llama-3-70b", "deepseek-v3", "--json"]) == 0
    rows = {r["model"]: r for r in json.loads(capsys.readouterr().out)["models"]}
    assert (rows["llama-3-70b"]["tp"], rows["llama-3-70b"]["fits"]) == (2, True)
    assert rows["deepseek-v3"]["fits"] is False and rows["deepseek-v3"]["tp"] is None


@pytest.mark.slow
def test_roofline_pipeline_micro_batches(capsys):
    import json

    from kvwall.cli import main

    assert main(["roofline", "llama-3-70b", "--device", "h100", "--tp", "4", "--pp", "2", "--batch", "1,8",
                 "--micro-batches", "4", "--json"]) == 0
    one, eight = (p["pipelined_decode"] for p in json.loads(capsys.readouterr().out)["phases"])
    assert "skipped" in one  # 4 micro-batches do not divide a batch of 1
    assert eight["micro_batch"] == 2 and eight["bubble"] == 1 / 5 and eight["steady_idle"] == 0
    assert main(["roofline", "llama-3-8b", "--micro-batches", "2"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("argv", [["roofline", "llama-3-8b", "--tp", "2"], ["roofline", "mixtral-8x7b", "--ep", "8"],
                                  ["roofline", "jamba-v0.1", "--tp", "2", "--pp", "4"],
                                  ["speed", "llama-3-70b", "--context", "4k,128k"]])
def test_json_is_strict_json(argv, capsys):
    """--json parses under RFC 8259 (no bare Infinity / NaN, which JavaScript's JSON.parse and serde reject): a
    collective moves no memory, so its intensity is null, not Infinity (64 of them at --tp 2, 2026-12-04)."""
    from kvwall.cli import main

    def refuse(name):
        raise AssertionError(f"{name} in --json output")
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out, parse_constant=refuse)
    if argv[0] == "roofline":
        link = [o for ph in data["phases"] for o in ph["decode"]["ops"] if o["kind"] == "link"]
        assert link and all(o["intensity"] is None and o["bytes"] == 0 for o in link)


def test_a_cpu_roof_is_printed_in_gflops():
    """A CPU's bf16 GEMM here ran at 1.2 GFLOP/s: printed as such, not as "0 TFLOP/s"; an H100's 989 TFLOP/s
    stays in TFLOP/s."""
    from kvwall.commands.speed_cmds import _flop_rate

    assert _flop_rate(1.2e9) == "1.2 GFLOP/s" and _flop_rate(180.3e9) == "180 GFLOP/s"
    assert _flop_rate(989e12) == "989 TFLOP/s"

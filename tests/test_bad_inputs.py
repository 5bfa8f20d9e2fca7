"""Bad input, predictor side: every case exits 2 with one line (two at most) naming the field, file or
option, never a traceback. Broken configs and profiles are built here from the catalog's public configs.
A hypothesis test then throws random values at the main config fields: a clean error, or sizes and times
that are all finite and >= 0."""

import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvwall import catalog
from kvwall.cli import main
from kvwall.errors import KvwallError
from kvwall.predict.devices import get_device
from kvwall.predict.memory import memory
from kvwall.predict.roofline import Roof, decode, prefill
from kvwall.spec.hf import spec_from_config

BASES = {"llama": "llama-3.2-1b", "mixtral": "mixtral-8x7b", "qwen_moe": "qwen3-30b-a3b", "mamba": "mamba-130m-hf",
         "mamba2": "mamba-codestral-7b", "deepseek": "deepseek-v2-lite", "jamba": "jamba-v0.1", "gemma3": "gemma-3-1b",
         "gpt2": "gpt2", "nemotron": "nemotron-h-8b", "mamba_ssm": "mamba2-2.7b"}


def base(family: str) -> dict:
    return json.loads(json.dumps(catalog.load_model_config(BASES[family])))  # a deep copy to break


def run(argv, capsys):
    """kvwall in-process: (exit status, stderr)."""
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def assert_one_clean_line(rc, err, *names):
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert 1 <= len(lines) <= 2, err
    for name in names:
        assert name in err, (name, err)


# -- config.json values ----------------------------------------------------------------------------

NAN = float("nan")
CONFIG_CASES = [  # (family, field, value, what the message must name)
    ("llama", "head_dim", -128, "head_dim"), ("llama", "head_dim", 0, "head_dim"),
    ("llama", "head_dim", 64.5, "head_dim"), ("llama", "head_dim", "64", "head_dim"),
    ("llama", "head_dim", True, "head_dim"), ("llama", "head_dim", [64], "head_dim"),
    ("llama", "num_key_value_heads", 0, "num_key_value_heads"),
    ("llama", "num_key_value_heads", -8, "num_key_value_heads"),
    ("llama", "num_key_value_heads", 5, "num_key_value_heads"),
    ("llama", "num_key_value_heads", "8", "num_key_value_heads"),
    ("llama", "num_attention_heads", 0, "num_attention_heads"),
    ("llama", "num_attention_heads", -32, "num_attention_heads"),
    ("llama", "hidden_size", 0, "hidden_size"), ("llama", "hidden_size", -1, "hidden_size"),
    ("llama", "hidden_size", "2048", "hidden_size"), ("llama", "hidden_size", 2048.5, "hidden_size"),
    ("llama", "hidden_size", 2**41, "hidden_size"), ("llama", "num_hidden_layers", 0, "num_hidden_layers"),
    ("llama", "num_hidden_layers", -1, "num_hidden_layers"),
    ("llama", "num_hidden_layers", 50_000_000, "num_hidden_layers"),
    ("llama", "num_hidden_layers", 1.5, "num_hidden_layers"), ("llama", "num_hidden_layers", "16", "num_hidden_layers"),
    ("llama", "num_hidden_layers", None, "num_hidden_layers"), ("llama", "intermediate_size", 0, "intermediate_size"),
    ("llama", "intermediate_size", -1, "intermediate_size"), ("llama", "vocab_size", 0, "vocab_size"),
    ("llama", "vocab_size", "x", "vocab_size"), ("llama", "vocab_size", 10**30, "vocab_size"),
    ("llama", "rope_theta", -1, "rope_theta"), ("llama", "rope_theta", 0, "rope_theta"),
    ("llama", "rope_theta", "x", "rope_theta"), ("llama", "rope_theta", NAN, "rope_theta"),
    ("llama", "rope_theta", float("inf"), "rope_theta"), ("llama", "rope_theta", 10**400, "rope_theta"),
    ("llama", "sliding_window", -5, "sliding_window"),
    ("llama", "sliding_window", 0, "sliding_window"), ("llama", "model_type", ["llama"], "model_type"),
    ("llama", "model_type", 5, "model_type"), ("llama", "model_type", "llama9", "model_type"),
    ("llama", "max_position_embeddings", 0, "max_position_embeddings"), ("llama", "rms_norm_eps", -1, "rms_norm_eps"),
    ("llama", "rope_scaling", "x", "rope_scaling"), ("llama", "eos_token_id", -2, "eos_token_id"),
    ("llama", "eos_token_id", "x", "eos_token_id"), ("llama", "bos_token_id", -2, "bos_token_id"),
    ("mixtral", "num_experts_per_tok", 9, "num_experts_per_tok"),
    ("mixtral", "num_experts_per_tok", 0, "num_experts_per_tok"),
    ("mixtral", "num_local_experts", 0, "num_local_experts"), ("mixtral", "num_attention_heads", 33, "hidden_size"),
    ("qwen_moe", "decoder_sparse_step", 0, "decoder_sparse_step"),
    ("qwen_moe", "num_experts_per_tok", 200, "num_experts_per_tok"),
    ("qwen_moe", "mlp_only_layers", "x", "mlp_only_layers"),
    ("qwen_moe", "moe_intermediate_size", -768, "moe_intermediate_size"),
    ("mamba", "state_size", 0, "state_size"), ("mamba", "conv_kernel", -4, "conv_kernel"),
    ("mamba", "hidden_size", "768", "hidden_size"), ("mamba", "time_step_rank", 0, "time_step_rank"),
    ("mamba", "time_step_rank", "big", "time_step_rank"), ("mamba", "expand", 0, "expand"),
    ("mamba", "intermediate_size", -1, "intermediate_size"), ("mamba2", "n_groups", 0, "n_groups"),
    ("mamba2", "n_groups", 3, "n_groups"), ("mamba2", "num_heads", 0, "num_heads"),
    ("mamba2", "head_dim", -64, "head_dim"),
    ("mamba2", "time_step_limit", "x", "time_step_limit"), ("mamba2", "state_size", 0, "state_size"),
    ("deepseek", "kv_lora_rank", 0, "kv_lora_rank"), ("deepseek", "qk_rope_head_dim", -64, "qk_rope_head_dim"),
    ("deepseek", "num_experts_per_tok", 100, "num_experts_per_tok"), ("deepseek", "n_group", 0, "n_group"),
    ("deepseek", "v_head_dim", "128", "v_head_dim"), ("deepseek", "n_routed_experts", -1, "n_routed_experts"),
    ("jamba", "attn_layer_period", 0, "attn_layer_period"), ("jamba", "expert_layer_period", 0, "expert_layer_period"),
    ("jamba", "mamba_d_state", 0, "mamba_d_state"), ("jamba", "num_experts_per_tok", 17, "num_experts_per_tok"),
    ("jamba", "mamba_dt_rank", 0, "mamba_dt_rank"), ("jamba", "attn_layer_offset", -1, "attn_layer_offset"),
    ("gemma3", "sliding_window_pattern", 0, "sliding_window_pattern"),
    ("gemma3", "query_pre_attn_scalar", -1, "query_pre_attn_scalar"),
    ("gemma3", "sliding_window", -1, "sliding_window"),
    ("gemma3", "layer_types", "x", "layer_types"), ("gpt2", "n_head", 7, "n_embd"), ("gpt2", "n_embd", 0, "n_embd"),
    ("gpt2", "n_layer", 200_000, "n_layer"), ("nemotron", "n_groups", 0, "n_groups"),
    ("nemotron", "hybrid_override_pattern", 5, "hybrid_override_pattern"),
    ("nemotron", "mamba_num_heads", 0, "mamba_num_heads"),
    ("nemotron", "num_key_value_heads", 0, "num_key_value_heads"),
    ("nemotron", "time_step_limit", [0.5, 0.1], "time_step_limit"),
    ("nemotron", "time_step_limit", [-1, 1], "time_step_limit"),
    ("mamba2", "time_step_limit", [0, "x"], "time_step_limit"),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, field, value, names", CONFIG_CASES,
                         ids=[f"{f}-{k}-{v!r}"[:60] for f, k, v, _ in CONFIG_CASES])
def test_bad_config_value(family, field, value, names, tmp_path, capsys):
    cfg = base(family)
    cfg[field] = value
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    rc, err = run(["memory", path, "--context", "4k"], capsys)
    assert_one_clean_line(rc, err, names, str(path))


def test_bad_nested_values(tmp_path, capsys):
    """Sections inside the config are checked too: rope scaling, mamba_ssm's ssm_cfg."""
    cfg = base("llama") | {"rope_scaling": {"rope_type": "llama3", "factor": -8.0}}
    (tmp_path / "a.json").write_text(json.dumps(cfg))
    assert_one_clean_line(*run(["memory", tmp_path / "a.json"], capsys), "factor")
    cfg = base("mamba_ssm")
    cfg["ssm_cfg"] = dict(cfg.get("ssm_cfg") or {}, ngroups=0)
    (tmp_path / "b.json").write_text(json.dumps(cfg))
    assert_one_clean_line(*run(["memory", tmp_path / "b.json"], capsys), "ngroups")


# -- config files that are not JSON, or not files --------------------------------------------------

def _fifo(tmp_path):
    path = tmp_path / "fifo.json"
    os.mkfifo(path)
    return path


def _loop(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    return tmp_path / "a"


def _dir_with_fifo_config(tmp_path):
    os.mkfifo(tmp_path / "config.json")
    return tmp_path


def _config_is_a_dir(tmp_path):
    (tmp_path / "config.json").mkdir()
    return tmp_path


def _file(content: bytes):
    def make(tmp_path):
        path = tmp_path / "config.json"
        path.write_bytes(content)
        return path
    return make


FILE_CASES = [  # (builder, what the message must say)
    (_file(b"[" * 100_000 + b"]" * 100_000), "nests too deeply"),
    (_file(b'{"model_type": "llama", "hidden_size": ' + b"9" * 5000 + b"}"), "cannot be read"),
    (_file(os.urandom(10 << 20)), "not UTF-8"),
    (_file(b" " * (17 << 20)), "MiB"),
    (_file(b""), "not valid JSON"),
    (_file(b"[1, 2]"), "not a JSON object"),
    (_file(b'"llama"'), "not a JSON object"),
    (_file(b"\xef\xbb\xbf{}"), "not valid JSON"),
    (_file(b'{"hidden_size": 1}'), "model_type"),
    (_fifo, "not a regular file"),
    (_loop, "symbolic links"),
    (_dir_with_fifo_config, "not a regular file"),
    (_config_is_a_dir, "is a directory"),
]


@pytest.mark.slow
@pytest.mark.parametrize("build, message", FILE_CASES, ids=[f"file{i}" for i in range(len(FILE_CASES))])
def test_bad_config_file(build, message, tmp_path, capsys):
    path = build(tmp_path)
    rc, err = run(["memory", path], capsys)
    assert_one_clean_line(rc, err, message, str(path))


# -- options ---------------------------------------------------------------------------------------

M = "llama-3.2-1b"
OPTION_CASES = [  # (argv, what the message must name)
    (["roofline", M, "--compute-dtype", "banana"], "--compute-dtype"),
    (["roofline", M, "--compute-dtype", "fp4", "--device", "v100"], "fp4"),
    (["roofline", M, "--compute-dtype", "fp8", "--device", "a100"], "fp8"),
    (["roofline", M, "--tp", "8", "--link-latency", "nan"], "--link-latency"),
    (["roofline", M, "--link-latency", "inf"], "--link-latency"),
    (["roofline", M, "--link-latency", "-1"], "--link-latency"),
    (["roofline", M, "--compute-eff", "nan"], "--compute-eff"),
    (["roofline", M, "--compute-eff", "0"], "--compute-eff"),
    (["roofline", M, "--compute-eff", "1.5"], "--compute-eff"),
    (["roofline", M, "--mem-eff", "nan"], "--mem-eff"),
    (["roofline", M, "--mem-eff", "-1"], "--mem-eff"),
    (["roofline", M, "--batch", "0"], "batch"),
    (["roofline", M, "--batch", "-1"], "batch"),
    (["roofline", M, "--batch", "nan"], "batch"),
    (["roofline", M, "--tp", "0"], "--tp"),
    (["roofline", M, "--tp", "-1"], "--tp"),
    (["roofline", M, "--tp", "x"], "--tp"),
    (["roofline", M, "--ep", "2"], "no routed experts"),
    (["roofline", M, "--mla", "naive"], "no MLA"),
    (["fit", M, "--memory", "0.5"], "a bare number is bytes"),
    (["fit", M, "--memory", "80"], "give a unit, e.g. 80GB or 80GiB"),
    (["simulate", M, "--kv-memory", "4096", "--rate", "1", "--requests", "4"], "a bare number is bytes (4,096 B)"),
    (["roofline", M, "--pp", "0"], "--pp"),
    (["roofline", M, "--context", "0"], "context"),
    (["roofline", M, "--prompt", "-3"], "prompt"),
    (["roofline", M, "--kv-heads", "0"], "--kv-heads"),
    (["roofline", M, "--window", "0"], "--window"),
    (["roofline", M, "--window", "-1"], "--window"),
    (["roofline", M, "--device", "banana"], "banana"),
    (["roofline", M, "--tp", "2", "--device", "cpu"], "interconnect"),
    (["memory", M, "--batch", "0"], "--batch"),
    (["memory", M, "--batch", "-1"], "--batch"),
    (["memory", M, "--batch", "nan"], "--batch"),
    (["memory", M, "--block-size", "0"], "--block-size"),
    (["memory", M, "--block-size", "-4"], "--block-size"),
    (["memory", M, "--kv-heads", "0"], "--kv-heads"),
    (["memory", M, "--kv-heads", "-2"], "--kv-heads"),
    (["memory", M, "--window", "0"], "--window"),
    (["memory", M, "--context", "1.5"], "context"),
    (["memory", M, "--tp", "0"], "--tp"),
    (["memory", M, "--kv-format", "fp7"], "fp7"),
    (["compare", M, "--memory", "80GB", "--device", "h200"], "--memory"),
    (["compare", M, "--memory", "0GB"], "memory"),
    (["compare", M, "--memory", "banana"], "memory"),
    (["compare", M, "--batch", "0"], "--batch"),
    (["fit", M, "--reserve", "150%"], "reserve"),
    (["fit", M, "--reserve", "-3%"], "reserve"),
    (["fit", M, "--reserve", "banana"], "reserve"),
    (["fit", M, "--memory", "80GB", "--device", "h200"], "--memory"),
    (["fit", M, "--batch", "0"], "--batch"),
    (["fit", M, "--block-size", "0"], "--block-size"),
    (["speed", M, "--batch", "0"], "--batch"),
    (["speed", M, "--link-latency", "inf"], "--link-latency"),
    (["speed", M, "--compute-eff", "0"], "--compute-eff"),
    (["speculate", M, "--draft", M, "--acceptance", "2"], "--acceptance"),
    (["speculate", M, "--draft", M, "--acceptance", "-0.1"], "--acceptance"),
    (["speculate", M, "--draft", M, "--acceptance", "nan"], "--acceptance"),
    (["speculate", M, "--draft", M, "--batch", "0"], "--batch"),
    (["speculate", M, "--draft", "no-such-model"], "no-such-model"),
    # GPT-2 (50,257 tokens) cannot draft for Llama 3 (128,256): its ids are not the target's
    (["speculate", "llama-3-8b", "--draft", "gpt2"], "vocabulary"),
    (["generate", "ckpt", "--prompt-ids", "1", "--temperature", "nan"], "--temperature"),
    (["generate", "ckpt", "--prompt-ids", "1", "--temperature", "-1"], "--temperature"),
    (["generate", "ckpt", "--prompt-ids", "1", "--top-p", "0"], "--top-p"),
    (["generate", "ckpt", "--prompt-ids", "1", "--top-p", "2"], "--top-p"),
    (["generate", "ckpt", "--prompt-ids", "1", "--top-p", "nan"], "--top-p"),
    (["generate", "ckpt", "--prompt-ids", "1", "--top-k", "0"], "--top-k"),
    (["generate", "ckpt", "--prompt-ids", "1", "--seed", "1" * 23], "--seed"),
    (["generate", "ckpt", "--prompt-ids", "1", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["generate", "ckpt", "--prompt-ids", "1", "--block-size", "0"], "--block-size"),
    (["generate", "ckpt", "--prompt-ids", "1", "--block-size", "-4"], "--block-size"),
    (["generate", "ckpt", "--prompt-ids", "1", "--residual", "-3"], "--residual"),
    (["generate", "ckpt", "--prompt-ids", ""], "--prompt-ids"),
    (["generate", "ckpt", "--prompt-ids", "a,b"], "--prompt-ids"),
    (["generate", "ckpt", "--prompt-ids", "-1"], "--prompt-ids"),
    (["verify", "ckpt", "--prompt-ids", ""], "--prompt-ids"),
    (["verify", "ckpt", "--tolerance", "nan"], "--tolerance"),
    (["verify", "ckpt", "--tolerance", "-1"], "--tolerance"),
    (["bench", "--steps", "0"], "--steps"),
    (["bench", "--threads", "0"], "--threads"),
]


@pytest.mark.slow
@pytest.mark.parametrize("argv, name", OPTION_CASES,
                         ids=[" ".join(a[2:] if len(a) > 2 else a) for a, _ in OPTION_CASES])
def test_bad_option(argv, name, capsys):
    assert_one_clean_line(*run(argv, capsys), name)


# -- the local device profile ----------------------------------------------------------------------

GOOD_PROFILE = {"memory_bytes": 64 * 2**30, "memory_bandwidth_Bps": 20e9, "peak_flops": {"fp32": 5e11},
                "layer_overhead_s": 1e-5, "step_overhead_s": 2e-5, "op_bandwidth_Bps": {"matmul": 18e9},
                "mixer_overhead_s": {"attention": 2e-5}}
PROFILE_CASES = [  # (file content, what the message must name)
    ([GOOD_PROFILE], "list"), ("nope", "str"),
    ({**GOOD_PROFILE, "memory_bandwidth_Bps": 0}, "memory_bandwidth_Bps"),
    ({**GOOD_PROFILE, "memory_bandwidth_Bps": -1e9}, "memory_bandwidth_Bps"),
    ({**GOOD_PROFILE, "memory_bandwidth_Bps": NAN}, "memory_bandwidth_Bps"),
    ({**GOOD_PROFILE, "memory_bandwidth_Bps": "fast"}, "memory_bandwidth_Bps"),
    ({k: v for k, v in GOOD_PROFILE.items() if k != "memory_bandwidth_Bps"}, "memory_bandwidth_Bps"),
    ({**GOOD_PROFILE, "memory_bytes": "lots"}, "memory_bytes"),
    ({**GOOD_PROFILE, "peak_flops": {"fp32": "fast"}}, "peak_flops"),
    ({**GOOD_PROFILE, "peak_flops": {"fp32": -5e11}}, "peak_flops"),
    ({**GOOD_PROFILE, "peak_flops": [5e11]}, "peak_flops"),
    ({**GOOD_PROFILE, "peak_flops": {}}, "peak_flops"),
    ({**GOOD_PROFILE, "layer_overhead_s": -1e-3}, "layer_overhead_s"),
    ({**GOOD_PROFILE, "step_overhead_s": -1}, "step_overhead_s"),
    ({**GOOD_PROFILE, "mixer_overhead_s": {"attention": -1}}, "mixer_overhead_s"),
    ({**GOOD_PROFILE, "op_bandwidth_Bps": {"matmul": 0}}, "op_bandwidth_Bps"),
    ({**GOOD_PROFILE, "op_bandwidth_Bps": {"matmul": float("inf")}}, "op_bandwidth_Bps"),
    ({**GOOD_PROFILE, "op_flops": {"attention": -3e10}}, "op_flops"),
    ({**GOOD_PROFILE, "matmul_rows_Bps": {"16": float("nan")}}, "matmul_rows_Bps"),
    ({**GOOD_PROFILE, "matmul_rows_Bps": {"sixteen": 7e9}}, "matmul_rows_Bps"),
    ({**GOOD_PROFILE, "prefill_attention_flops": {"128": 0}}, "prefill_attention_flops"),
    ({**GOOD_PROFILE, "prefill_attention_flops": {"many": 4e10}}, "prefill_attention_flops"),
    ({**GOOD_PROFILE, "prefill_attention_flops": [4e10]}, "prefill_attention_flops"),
    ({**GOOD_PROFILE, "op_fixed_s": {"attention:int8": -1e-4}}, "op_fixed_s"),
    ({**GOOD_PROFILE, "paged_pool": {"s_per_byte": -1e-9}}, "paged_pool"),
    ({**GOOD_PROFILE, "paged_pool": [1e-4]}, "paged_pool"),
    ({**GOOD_PROFILE, "runner_step": {"per_row_s": float("nan")}}, "runner_step"),
]


@pytest.mark.slow
@pytest.mark.parametrize("content, name", PROFILE_CASES, ids=[f"profile{i}" for i in range(len(PROFILE_CASES))])
def test_bad_profile(content, name, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    (tmp_path / "local-device.json").write_text(json.dumps(content))
    rc, err = run(["roofline", M, "--device", "local"], capsys)
    assert_one_clean_line(rc, err, name, "local profile", "kvwall calibrate")


@pytest.mark.parametrize("content", [b"{not json", os.urandom(4096)])
def test_unreadable_profile(content, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    (tmp_path / "local-device.json").write_bytes(content)
    assert_one_clean_line(*run(["memory", M, "--device", "local"], capsys), "local profile", "kvwall calibrate")


def test_good_profile_still_works(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVWALL_HOME", str(tmp_path))
    (tmp_path / "local-device.json").write_text(json.dumps(GOOD_PROFILE))
    rc, _ = run(["roofline", M, "--device", "local", "--json"], capsys)
    assert rc == 0


# -- the hostile cases of shared/hooks/before-stop, as a user runs them ----------------------------

NEG_HEAD_DIM = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": -128, "intermediate_size": 14336, "vocab_size": 128256}


@pytest.mark.slow
@pytest.mark.parametrize("args", ["memory no-such-model", "memory llama-3-8b --context -5",
                                  "memory neg.json --context 4k", "roofline llama-3-8b --compute-dtype banana",
                                  "roofline llama-3-8b --tp 8 --link-latency nan"])
def test_hostile_cases_in_a_subprocess(args, tmp_path):
    (tmp_path / "neg.json").write_text(json.dumps(NEG_HEAD_DIM))
    proc = subprocess.run([sys.executable, "-m", "kvwall", *args.split()], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert_one_clean_line(proc.returncode, proc.stderr)
    assert proc.stdout == ""


# -- random values in the main config fields -------------------------------------------------------

FIELDS = {
    "llama": ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size", "rope_theta", "sliding_window", "max_position_embeddings"],
    "mamba": ["hidden_size", "num_hidden_layers", "state_size", "conv_kernel", "expand", "intermediate_size",
              "time_step_rank", "vocab_size"],
    "mamba2": ["hidden_size", "num_hidden_layers", "num_heads", "head_dim", "n_groups", "state_size", "conv_kernel",
               "expand", "vocab_size"],
    "deepseek": ["hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "qk_rope_head_dim",
                 "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_group",
                 "first_k_dense_replace", "moe_intermediate_size"],
    "jamba": ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "attn_layer_period",
              "attn_layer_offset", "expert_layer_period", "num_experts", "num_experts_per_tok", "mamba_d_state",
              "mamba_expand", "mamba_dt_rank"],
}
VALUES = st.one_of(
    st.integers(-3, 300), st.sampled_from([0, -1, -128, 2**31, 2**40, 2**41, 10**30, 10**400]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5), st.none(), st.booleans(),
    st.lists(st.integers(-2, 64), max_size=3),
)
H200 = Roof(get_device("h200"))


def _finite_sizes_and_times(spec):
    rep = memory(spec, batch=2, context=4096)
    for lm in rep.layers:
        assert lm.weight_bytes >= 0 and lm.cache_bytes >= 0 and lm.fixed_bytes >= 0 and lm.token_bytes >= 0
    assert rep.weight_bytes >= 0 and rep.cache_bytes >= 0
    for phase in (decode(spec, 4096, 2, rep.formats, H200), prefill(spec, 64, 1, rep.formats, H200)):
        for value in (phase.time_s, phase.flops, phase.bytes, phase.compute_s, phase.memory_s):
            assert math.isfinite(value) and value >= 0, (phase.name, value)


@pytest.mark.slow
@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(sorted(FIELDS)), data=st.data())
def test_random_field_values_give_a_clean_error_or_sane_numbers(family, data):
    cfg = base(family)
    for _ in range(data.draw(st.integers(1, 3))):
        cfg[data.draw(st.sampled_from(FIELDS[family]))] = data.draw(VALUES)
    try:
        spec = spec_from_config(cfg, where="random.json")
    except KvwallError as exc:
        assert "\n" not in str(exc)
        return
    try:
        _finite_sizes_and_times(spec)
    except KvwallError as exc:  # the predictor's own guard is a clean error too
        assert "\n" not in str(exc)


def _numbers(node, key=""):
    """(key, value) for every number in a JSON document."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _numbers(v, k)
    elif isinstance(node, list):
        for v in node:
            yield from _numbers(v, key)
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield key, node


@pytest.mark.slow
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(sorted(FIELDS)), data=st.data())
def test_random_field_values_through_the_cli(family, data, tmp_path_factory, capsys):
    cfg = base(family)
    cfg[data.draw(st.sampled_from(FIELDS[family]))] = data.draw(VALUES)
    path = tmp_path_factory.mktemp("cfg") / "config.json"
    path.write_text(json.dumps(cfg))
    for command in ("memory", "roofline"):
        capsys.readouterr()
        rc = main([command, str(path), "--json"])
        out, err = capsys.readouterr()
        if rc == 2:
            assert_one_clean_line(rc, err)
            continue
        assert rc == 0, err
        for key, value in _numbers(json.loads(out)):
            if key.endswith(("_bytes", "_s", "bytes", "flops")):
                assert math.isfinite(value) and value >= 0, (command, key, value)


# -- what stays accepted ---------------------------------------------------------------------------

def test_compute_dtype_peaks_follow_the_datasheets():
    """H100 SXM dense fp8 is 1,979 TFLOP/s; TPU v5e lists only bf16 (197 TFLOP/s), which fp16 shares;
    an M2 Ultra lists only fp32 (27.2 TFLOP/s), which 16-bit math falls back to; no dtype borrows a
    wider one's peak."""
    assert get_device("h100-sxm").flops("fp8") == 1979e12
    assert get_device("tpu-v5e").flops("fp16") == 197e12
    assert get_device("apple-m2-ultra").flops("bf16") == 27.2e12
    with pytest.raises(KvwallError, match="lists no fp4"):
        get_device("h100-sxm").flops("fp4")


@pytest.mark.parametrize("argv", [["roofline", M, "--compute-dtype", "FP8", "--json"],
                                  ["memory", M, "--window", "2k", "--kv-heads", "1", "--json"],
                                  ["generate", "--help"]])
def test_good_options_still_pass_the_parser(argv, capsys):
    assert main(argv) == 0


def test_every_catalog_config_passes_validation():
    for name in catalog.model_names():
        spec_from_config(catalog.load_model_config(name), name=name)


def test_a_bare_number_is_bytes_from_one_mebibyte_up():
    """16777216 is 16 MiB, written in bytes: accepted. 80 (80 B, a forgotten GB) is an error naming the fix."""
    from kvwall.errors import KvwallError
    from kvwall.units import parse_bytes

    assert parse_bytes("16777216") == 16 * 2**20 and parse_bytes("1048576") == 2**20
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("512KiB") == 512 * 1024  # a unit: any size
    with pytest.raises(KvwallError, match="give a unit, e.g. 80GB or 80GiB"):
        parse_bytes("80")

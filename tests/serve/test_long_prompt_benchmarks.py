"""The long-prompt options of the serving benchmarks and the race's batch and quality helpers (issue 43), without a
server or a model run: expected numbers by hand from SmolLM2-135M's public config (30 layers, 3 KV heads of 64)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))

import bench_long_race as race

import bench_serve_peers as peers
import validate_serving as validate


def test_servers_are_started_with_a_context_that_holds_the_longest_request():
    """8192 + 64 tokens and a quarter more: 10,320 for vLLM's --max-model-len and llama.cpp's --n_ctx; the short
    default keeps the 2048 the earlier runs used."""
    args = argparse.Namespace(
        threads=2,
        kv_memory="2GiB",
        max_batch=8,
        model="m",
        vllm_python="/v/python",
        llama_python="/l/python",
        prompt_tokens="2048,8192",
        output_tokens=64,
    )
    known = peers.servers(args, Path("/m.gguf"))
    vllm, llama = known["vllm"][1], known["llama"][1]
    assert vllm[vllm.index("--max-model-len") + 1] == "10320"
    assert llama[llama.index("--n_ctx") + 1] == "10320"
    assert peers.context_len(argparse.Namespace(prompt_tokens="128", output_tokens=64)) == 2048


def test_each_prompt_length_gets_seeds_of_its_own():
    """Seeded random words: a longer prompt with the same seed begins with the shorter one's words."""
    seeds = {peers.seed_for(c, p, w) for c in (16, 32) for p in (128, 2048, 4096) for w in (False, True)}
    assert len(seeds) == 12
    assert peers.seed_for(16, 128) == 1016  # the default prompt keeps the seeds earlier results files used


def test_validate_serving_sizes_vllm_and_its_probe():
    args = argparse.Namespace(prompt_tokens="128", output_tokens=32)
    assert validate.max_len(args) == 128 + 32 + 64  # what the 128-word runs used
    args = argparse.Namespace(prompt_tokens="2048,4096", output_tokens=32)
    assert validate.max_len(args) == 4128 + 1032
    assert validate.probe_context(128) == validate.PROBE_CONTEXT
    assert validate.probe_context(4096, 32) == 4128


def test_the_largest_batch_that_fits_a_budget():
    """SmolLM2's fp32 K and V: 2 x 30 x 3 x 64 x 4 B = 46,080 B a token; 4 GiB / (46,080 x 2,081) = 44.8 rows."""
    per_row = 46_080 * 2_081
    assert race.fitting(lambda b: b * per_row, 4 * 2**30) == 44
    assert race.fitting(lambda b: b * per_row, per_row - 1) == 0
    assert race.fitting(lambda b: 1000 + b * 10, 1000 + 95) == 9  # not proportional: an offset per cache


def test_quality_is_read_by_band_then_whole_row_and_pass_key_by_length():
    long = {
        "text": {"row_tokens": 8192},
        "quality": [
            {"cache": "contiguous", "ppl": 10.0, "bands": [{"start": 4096, "end": 8192, "ppl": 8.0, "delta_ppl": 0.0}]},
            {"cache": "int4", "ppl": 10.1, "bands": [{"start": 4096, "end": 8192, "ppl": 8.16, "delta_ppl": 0.16}]},
        ],
    }
    short = {
        "text": {"row_tokens": 256},
        "quality": [{"cache": "contiguous", "ppl": 20.0}, {"cache": "int2", "ppl": 22.8, "delta_ppl": 2.8}],
        "passkey": {
            "cells": [
                {"cache": "int2", "length": 256, "correct": 3, "keys": 5},
                {"cache": "int2", "length": 256, "correct": 5, "keys": 5},
                {"cache": "int2", "length": 1024, "correct": 0, "keys": 5},
            ]
        },
    }
    q = [long, short]
    assert race.quality_of(q, "int4", 8192)["delta_ppl_pct"] == pytest.approx(2.0)  # 0.16 / 8.0
    assert race.quality_of(q, "int2", 256)["delta_ppl_pct"] == pytest.approx(14.0)  # 2.8 / 20
    assert race.quality_of(q, "int2", 256)["passkey"] == "8/10"
    assert race.quality_of(q, "int8", 8192) == "not measured"


def test_cache_names_match_the_quality_files():
    assert race.cache_text("sliding:1k:sink4") == "sliding:1024:sink4"
    assert race.cache_text("int4:g64") == "int4:g64"


def test_requality_gives_an_earlier_race_the_quality_measured_since(tmp_path):
    """--requality: the kvwall row takes its band's figures (0.1 / 10 = +1 %), the peer's row stays as it was, the
    speeds are untouched and the file says which quality files it read."""
    import json

    quality = tmp_path / "q.json"
    quality.write_text(json.dumps({"text": {"row_tokens": 8192}, "quality": [
        {"cache": "contiguous", "ppl": 10.0, "bands": [{"start": 4096, "end": 8192, "ppl": 10.0, "delta_ppl": 0.0}]},
        {"cache": "int4", "ppl": 10.2, "bands": [{"start": 4096, "end": 8192, "ppl": 10.1, "delta_ppl": 0.1}]}]}))
    results = tmp_path / "race.json"
    rows = [{"engine": "kvwall native, int4 cache", "engine_kind": "kvwall", "setting": "int4", "batch": 1,
             "budget_batch": None, "context": 8064, "neighbour": None, "quality": "not measured",
             "decode_tok_s": 59.0, "ttft_s": 28.0, "vs_best_llama_cpp": 1.9},
            {"engine": "llama.cpp, f16 KV, flash attn", "engine_kind": "llama.cpp", "setting": "f16", "batch": 1,
             "budget_batch": None, "context": 8064, "neighbour": None, "quality": None, "decode_tok_s": 31.0,
             "ttft_s": 63.0, "vs_best_llama_cpp": 1.0}]
    results.write_text(json.dumps({"rows": rows}))
    race.requality(results, argparse.Namespace(quality=str(quality), model="smollm2"))
    data = json.loads(results.read_text())
    kv, peer = data["rows"]
    assert kv["quality"]["delta_ppl_pct"] == pytest.approx(1.0) and kv["quality"]["from"].startswith("band 4096-8192")
    assert kv["decode_tok_s"] == 59.0 and peer == rows[1]
    assert data["quality_files"] == str(quality) and "quality_read" in data


def test_timed_reports_the_trials_of_a_governor():
    from types import SimpleNamespace

    class Governed:
        governor = SimpleNamespace(trials=[(12, 2, 1, True)])

        def step(self):
            pass

    class Plain:
        def step(self):
            pass

    assert race.timed(Governed, 3)[2] == [[12, 2, 1, True]]
    assert race.timed(Plain, 3)[2] is None

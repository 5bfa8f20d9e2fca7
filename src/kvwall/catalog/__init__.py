"""Shipped data: real models' config.json files, the accelerator table and published measurements.

Each ``models/<name>.json`` is a Hugging Face config.json as published, plus
keys starting with ``_`` that say where the copy was seen (``_hub_id``,
``_source``, ``_unconfirmed``, ``_notes``); parsers ignore those.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

HERE = Path(__file__).parent
MODELS_DIR = HERE / "models"
DEVICES_FILE = HERE / "devices.json"
ENERGY_FILE = HERE / "energy.json"
MEASUREMENTS_FILE = HERE / "measurements.json"
EFFICIENCY_FILE = HERE / "efficiency.json"  # expected mode's fitted figures (kvwall validate --fit)

# The source documents' lineup, one model per idea: MHA, GQA, GQA at scale, MLA, local/global, SSM, hybrid.
LINEUP = ["gpt2-xl", "llama-3-8b", "llama-3-70b", "deepseek-v3", "gemma-3-27b", "mamba-2.8b", "jamba-v0.1"]


def model_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


@lru_cache(maxsize=None)
def load_model_config(name: str) -> dict:
    return json.loads((MODELS_DIR / f"{name}.json").read_text())


def find_model(query: str) -> str | None:
    """A catalog name for a short name or hub id (case-insensitive), or None."""
    q = query.strip().lower()
    names = model_names()
    if q in names:
        return q
    aliases = {"mamba-130m": "mamba-130m-hf", "mamba-2.8b": "mamba-2.8b-hf", "mistral-7b": "mistral-7b-v0.1"}
    if q in aliases and aliases[q] in names:
        return aliases[q]
    for name in names:
        hub = load_model_config(name).get("_hub_id", "")
        if hub.lower() == q or hub.lower().split("/")[-1] == q:
            return name
    return None


@lru_cache(maxsize=None)
def devices_table() -> dict:
    data = json.loads(DEVICES_FILE.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


@lru_cache(maxsize=None)
def energy_table() -> dict:
    return json.loads(ENERGY_FILE.read_text())


@lru_cache(maxsize=None)
def measurements() -> tuple[dict, ...]:
    """Published inference measurements (measurements.json rows), each with its source; see the file's _about."""
    return tuple(json.loads(MEASUREMENTS_FILE.read_text())["rows"])


def measurements_version() -> str:
    """The table's identity for the fitted figures: the first 12 hex digits of measurements.json's sha256."""
    import hashlib

    return hashlib.sha256(MEASUREMENTS_FILE.read_bytes()).hexdigest()[:12]


@lru_cache(maxsize=None)
def efficiency() -> dict:
    """Expected mode's fitted parameters (efficiency.json), or {} before the first `kvwall validate --fit`."""
    if not EFFICIENCY_FILE.is_file():
        return {}
    return json.loads(EFFICIENCY_FILE.read_text())

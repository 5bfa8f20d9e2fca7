"""Shipped data: real models' config.json files, the accelerator table and published measurements.

Each ``models/<name>.json`` is a Hugging Face config.json as published, plus
keys starting with ``_`` that say where the copy was seen (``_hub_id``,
``_source``, ``_unconfirmed``, ``_notes``); parsers ignore those.
"""

from __future__ import annotations

import json
from functools import cache, lru_cache
from pathlib import Path

from kvwall.errors import KvwallError

HERE = Path(__file__).parent
MODELS_DIR = HERE / "models"
DEVICES_FILE = HERE / "devices.json"
ENERGY_FILE = HERE / "energy.json"
MEASUREMENTS_FILE = HERE / "measurements.json"
EFFICIENCY_FILE = HERE / "efficiency.json"  # expected mode's fitted figures (kvwall validate --fit)

# The source documents' lineup, one model per idea: MHA, GQA, GQA at scale, MLA, local/global, SSM, hybrid.
LINEUP = ["gpt2-xl", "llama-3-8b", "llama-3-70b", "deepseek-v3", "gemma-3-27b", "mamba-2.8b", "jamba-v0.1"]
# The 2025-26 lineup, one model per new mechanism: gated DeltaNet, attention sinks + 128-token windows, sparse (top-k)
# MLA, Kimi Delta Attention, chunked attention, lightning attention, parallel attention + Mamba-2, short
# convolutions, Mamba-2 + MoE.
LINEUP_2025 = ["qwen3-next-80b-a3b", "gpt-oss-120b", "deepseek-v3.2", "kimi-linear-48b-a3b", "llama-4-scout-17b-16e",
               "minimax-text-01", "falcon-h1-34b", "lfm2-1.2b", "granite-4.0-h-small"]


def model_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


@cache
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


@cache
def devices_table() -> dict:
    data = json.loads(DEVICES_FILE.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


@cache
def energy_table() -> dict:
    return json.loads(ENERGY_FILE.read_text())


@cache
def measurements() -> tuple[dict, ...]:
    """Published inference measurements (measurements.json rows), each with its source; see the file's _about."""
    return tuple(json.loads(MEASUREMENTS_FILE.read_text())["rows"])


def measurements_version() -> str:
    """The table's identity for the fitted figures: the first 12 hex digits of measurements.json's sha256."""
    import hashlib

    return hashlib.sha256(MEASUREMENTS_FILE.read_bytes()).hexdigest()[:12]


USER_EFFICIENCY_NAME = "efficiency.json"  # in kvwall's home: where `kvwall validate --fit` writes by default


def user_efficiency_file() -> Path:
    """The user's fitted table: `kvwall validate --fit` writes it here unless told --out (never into the package)."""
    from kvwall.files import home

    return home() / USER_EFFICIENCY_NAME


def efficiency_file() -> Path:
    """The fitted table expected mode reads: the user's (user_efficiency_file) when it was fitted to this
    measurements.json, else the packaged one. A user's fit of an older table (kvwall upgraded since, with a new
    packaged fit) is passed over: efficiency_source says so."""
    user = user_efficiency_file()
    if user.is_file() and _read_efficiency(user).get("table_version") == measurements_version():
        return user
    return EFFICIENCY_FILE


def efficiency_source() -> str:
    """Which fitted table expected mode reads, in words, for outputs to name."""
    path, user = efficiency_file(), user_efficiency_file()
    if path != EFFICIENCY_FILE:
        return f"{path}, your `kvwall validate --fit`"
    passed = f"; your fit {user} is of an older measurements table, not used" if user.is_file() else ""
    return f"catalog/efficiency.json, packaged{passed}"


def efficiency() -> dict:
    """Expected mode's fitted parameters (efficiency_file), or {} when there is none."""
    return _read_efficiency(efficiency_file())


def _read_efficiency(path: Path) -> dict:
    """The table at ``path``, read again only when the file changes (it is read once per prediction)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise KvwallError(f"cannot read the fitted table {path} ({exc.strerror}); fix its permissions or delete "
                          "it and run `kvwall validate --fit`") from None
    return _parse_efficiency(path, st.st_ino, st.st_mtime_ns, st.st_size)  # a rewrite (os.replace): a new inode


@lru_cache(maxsize=8)
def _parse_efficiency(path: Path, inode: int, mtime_ns: int, size: int) -> dict:
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        data = exc
    if not isinstance(data, dict):
        what = (f"is not readable JSON ({type(data).__name__})" if isinstance(data, Exception)
                else f"holds a JSON {type(data).__name__}, not an object")
        raise KvwallError(f"the fitted table {path} {what}; run `kvwall validate --fit` to write it again")
    return data

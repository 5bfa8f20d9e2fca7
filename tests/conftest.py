import json
from pathlib import Path

import pytest

REFERENCE = Path(__file__).resolve().parents[1] / "src" / "kvwall" / "catalog" / "models"


@pytest.fixture
def write_config(tmp_path):
    """Write a config dict to tmp_path/<name>/config.json and return the directory."""

    def write(cfg: dict, name: str = "model") -> Path:
        d = tmp_path / name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(cfg))
        return d

    return write

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test modules import cli_checks (any --import-mode)

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

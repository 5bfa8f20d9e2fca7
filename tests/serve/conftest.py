"""Fixtures for the serving tests: tiny random checkpoints (tests/engine/tiny_checkpoints.py), loaded once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "engine"))  # tiny_checkpoints (any --import-mode)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """tiny_model(family) -> (checkpoint path, kvwall model), built once per session."""
    from tiny_checkpoints import make_checkpoint  # torch + transformers: only when a test asks

    from kvwall.engine.load import load_model

    made: dict[str, tuple] = {}

    def get(family: str = "llama"):
        if family not in made:
            path = tmp_path_factory.mktemp(family)
            make_checkpoint(family, path)
            made[family] = (path, load_model(path))
        return made[family]

    return get

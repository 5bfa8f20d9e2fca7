"""Fixtures for the engine tests; the checkpoint factory itself is tiny_checkpoints.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # test modules import tiny_checkpoints (any --import-mode)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(family) -> (path, transformers model), built once per session."""
    from tiny_checkpoints import make_checkpoint  # torch + transformers: only when a test asks

    made: dict[str, tuple] = {}

    def get(family: str):
        if family not in made:
            path = tmp_path_factory.mktemp(family)
            made[family] = (path, make_checkpoint(family, path))
        return made[family]

    return get


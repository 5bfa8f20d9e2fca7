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


# The fused decode step's tests (test_decode_stack.py, test_stack_quantized.py)

@pytest.fixture(scope="module")
def kernel():
    """The fused decode step's compiled module (engine/decode_stack.py), built or failed."""
    from native_kernels import built

    from kvwall.engine import decode_stack

    return built(decode_stack.kernel_module, "decode_stack")


@pytest.fixture
def two_threads():
    """torch on 2 threads, as CI has, for the test: the fused step and ContiguousCache.decode_kernel want a (row, KV
    head) attention job per thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def stacked(monkeypatch):
    """Counts the steps the stack took (returned x rather than None)."""
    from kvwall.engine import decode_stack

    calls = []
    inner = decode_stack.DecodeStack.__call__

    def counting(self, x, tables, cache):
        out = inner(self, x, tables, cache)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(decode_stack.DecodeStack, "__call__", counting)
    return calls

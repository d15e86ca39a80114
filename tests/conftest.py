"""Session-scoped fixtures shared by the test suites (add new ones additively).

Checkpoints come from :func:`glm5serve.cache.cached_checkpoint`: built once into ``$GLM5SERVE_CACHE`` (or
``~/.cache/glm5serve``), keyed by a digest of the code that writes them, so a run builds each at most once.
"""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    """The embedded default model: tiny preset, ud-q4_k_xl mix, one file."""
    from glm5serve.cache import cached_checkpoint

    return cached_checkpoint("tiny", "ud-q4_k_xl")


@pytest.fixture(scope="session")
def tiny_f32_checkpoint() -> Path:
    """The tiny preset with every tensor F32 (the llama.cpp oracle's input: no quantization error anywhere)."""
    from glm5serve.cache import cached_checkpoint

    return cached_checkpoint("tiny", "f32")

"""Fixtures shared by the GPU tests."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory) -> Path:
    """Where GPU tests leave engine logs, records and summaries: ``$GLM5SERVE_GPU_RESULTS`` (``.ci/gpu`` packs it
    into its tarball) or a pytest tmp dir."""
    d = os.environ.get("GLM5SERVE_GPU_RESULTS")
    p = Path(d) if d else tmp_path_factory.mktemp("gpu-results")
    p.mkdir(parents=True, exist_ok=True)
    return p


@pytest.fixture(scope="session")
def narrow() -> Path:
    """Shard 1 of the narrow ud-q4_k_xl checkpoint split in 2: ``$GLM5SERVE_NARROW``, or built once into the cache
    (``glm5serve.cache.cached_checkpoint``). Skips without a CUDA GPU or vLLM."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM")
    if p := os.environ.get("GLM5SERVE_NARROW"):
        return Path(p)
    from glm5serve.cache import cached_checkpoint

    return cached_checkpoint("narrow", "ud-q4_k_xl", split=2)

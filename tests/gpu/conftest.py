"""Fixtures shared by the GPU tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory) -> Path:
    """Where GPU tests leave engine logs, records and summaries: ``$GLM5SERVE_GPU_RESULTS`` (``.ci/gpu`` packs it
    into its tarball) or a pytest tmp dir."""
    d = os.environ.get("GLM5SERVE_GPU_RESULTS")
    p = Path(d) if d else tmp_path_factory.mktemp("gpu-results")
    p.mkdir(parents=True, exist_ok=True)
    return p

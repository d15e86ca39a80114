"""Launch configs of the GGUF kernels (``pick_config``): the measured tables shipped in ``kernels/tuned/`` are
well-formed and win over the heuristic for their shapes, and L2 prefetch (inline PTX) is never chosen for the
Triton interpreter."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from glm5serve.kernels import GemvConfig, pick_config
from glm5serve.kernels.gguf_gemv import BLOCK_SIZES, PREFETCH_MIN_BYTES, SUPPORTED_QTYPES, TUNED_DIR, tuned_configs

TABLES = sorted(TUNED_DIR.glob("*.json"))


def test_a_tuned_table_ships_with_the_package():
    assert TABLES, f"no tuned tables in {TUNED_DIR}"


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.stem)
def test_tuned_table_is_well_formed(path):
    raw = json.loads(path.read_text())
    table = tuned_configs(path.stem)
    assert len(table) == len(raw["configs"]) > 0
    for (qtype, M, N, K), cfg in table.items():
        qk = BLOCK_SIZES.get(qtype, (0, 0))[0]
        assert qtype in SUPPORTED_QTYPES and M >= 1 and N >= 1 and qk and K % qk == 0, (qtype, M, N, K)
        assert isinstance(cfg, GemvConfig)
        for v in (cfg.block_n, cfg.kbs, cfg.num_warps, cfg.block_m):
            assert v >= 1 and v & (v - 1) == 0, cfg  # Triton block sizes are powers of two
        assert 1 <= cfg.split_k <= K // qk and 0 <= cfg.prefetch <= 8, cfg
        key = f"{qtype},{M},{N},{K}"
        # a table entry is there because it measured faster than the heuristic in the same run
        assert raw["timings_us"][key] < raw["heuristic_us"][key], key


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.stem)
def test_pick_config_uses_the_table_on_its_device_only(path):
    for (qtype, M, N, K), cfg in tuned_configs(path.stem).items():
        assert pick_config(qtype, M, N, K, 132, torch.bfloat16, path.stem) == cfg
        assert pick_config(qtype, M, N, K, 132, torch.bfloat16, "another_GPU") != cfg


@given(qtype=st.sampled_from(sorted(SUPPORTED_QTYPES)), M=st.integers(1, 256), N=st.integers(1, 40000),
       blocks=st.integers(1, 64))
def test_prefetch_only_on_large_weights_and_never_in_the_interpreter(qtype, M, N, blocks):
    qk, qb = BLOCK_SIZES[qtype]
    K = blocks * qk
    assert pick_config(qtype, M, N, K, 1, torch.bfloat16, "cpu").prefetch == 0
    gpu = pick_config(qtype, M, N, K, 132, torch.bfloat16, "")
    assert (gpu.prefetch > 0) == (N * blocks * qb >= PREFETCH_MIN_BYTES)
    # prefetch is the only difference the device name makes (no table for either name)
    assert dataclasses.replace(gpu, prefetch=0) == pick_config(qtype, M, N, K, 132, torch.bfloat16, "cpu")

"""Speed of glm5serve's quantizers and dequantizers, against baselines measured in the same run (pytest-benchmark
groups them; compare the rows of a group). Target: make-checkpoint quantizes ~250 MB of weights on 2 cores, so the
K-quantizers should run at tens of MB/s of fp32 input -- the same order as gguf-py's Q8_0, the cheapest quantizer.

Run: ``pytest tests/unit/test_bench_dequant.py --benchmark-only``; ``extra_info`` holds MB/s of fp32 input/output.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from glm5serve.dequant import dequantize
from glm5serve.quantize import OWN_TYPES, quantize

ROWS, COLS = 64, 4096  # 1 MiB of fp32 weights


@pytest.fixture(scope="module")
def weights() -> np.ndarray:
    return (np.random.default_rng(0).standard_normal((ROWS, COLS)) * 0.02).astype(np.float32)


def _run(benchmark, fn, nbytes: int):
    result = benchmark.pedantic(fn, rounds=3, iterations=1, warmup_rounds=1)
    if benchmark.stats is not None:  # None under --benchmark-disable
        benchmark.extra_info["MB/s"] = round(nbytes / 1e6 / benchmark.stats.stats.mean, 1)
    return result


@pytest.mark.benchmark(group="quantize 1 MiB fp32")
def test_bench_gguf_py_q8_0_baseline(benchmark, weights):
    q = _run(benchmark, lambda: gguf_quants.quantize(weights, Q.Q8_0), weights.nbytes)
    assert q.shape == (ROWS, COLS // 32 * 34)


@pytest.mark.benchmark(group="quantize 1 MiB fp32")
@pytest.mark.parametrize("qtype", OWN_TYPES, ids=lambda t: t.name)
def test_bench_quantize_k(benchmark, weights, qtype):
    q = _run(benchmark, lambda: quantize(weights, qtype), weights.nbytes)
    assert q.shape[0] == ROWS and q.dtype == np.uint8


@pytest.mark.benchmark(group="dequantize 16M values to fp32")
@pytest.mark.parametrize("impl", ["glm5serve", "gguf-py"])
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_bench_dequantize(benchmark, impl, qtype):
    x = (np.random.default_rng(1).standard_normal((4096, 4096)) * 0.02).astype(np.float32)
    raw = gguf_quants.quantize(x, qtype) if qtype == Q.Q8_0 else quantize(x, qtype)
    fn = (lambda: dequantize(raw, qtype)) if impl == "glm5serve" else (lambda: gguf_quants.dequantize(raw, qtype))
    out = _run(benchmark, fn, x.nbytes)
    assert tuple(out.shape) == x.shape


@pytest.mark.benchmark(group="dequantize 16M values to bf16")
def test_bench_dequantize_bf16(benchmark):
    x = (np.random.default_rng(2).standard_normal((4096, 4096)) * 0.02).astype(np.float32)
    raw = quantize(x, Q.Q4_K)
    out = _run(benchmark, lambda: dequantize(raw, Q.Q4_K, dtype=torch.bfloat16), x.nbytes // 2)
    assert out.dtype == torch.bfloat16

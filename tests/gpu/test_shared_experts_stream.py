"""GPU: an engine's first request is exact while Triton still compiles and other processes load the GPU.

With vLLM's shared-experts aux stream on (vllm#26440), the first request of engines that compiled their Triton
kernels during it, next to a matmul load, came back with wrong logits (5 of 5 engines on an H200, vLLM 0.25; see
``glm5serve.vllm_plugin.serialize_shared_experts``, which turns the stream off by default). This reproduces those
conditions: ``ENGINES`` eager engines start at once, each with an empty Triton cache, while a matmul loop loads the
GPU; every request of each must be bit-identical (tokens and top-5 logprobs) to the same requests on one engine
started afterwards, alone, with a warm cache. Logs go to ``results_dir``.
"""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glm5serve.testing.logprobs import bit_identical

pytestmark = pytest.mark.gpu

ENGINES = 3
#: the matmul load: seconds, long enough to cover the engines' starts and first requests
LOAD_S = 120
_LOAD = """
import sys, time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); t = time.time()
while time.time() - t < float(sys.argv[1]):
    for _ in range(20):
        a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
"""


def _prompts(narrow: Path) -> list[list[list[int]]]:
    """Three batch-1 requests of 5, 17 and 40 ordinary tokens."""
    from glm5serve.gguf_file import GGUFModel

    types = GGUFModel(narrow).metadata["tokenizer.ggml.token_type"]
    normal = torch.tensor([i for i, t in enumerate(types) if int(t) == 1])
    g = torch.Generator().manual_seed(5)
    return [[normal[torch.randint(len(normal), (n,), generator=g)].tolist()] for n in (5, 17, 40)]


def test_first_request_exact_under_cold_compiles_and_gpu_load(narrow, results_dir, tmp_path):
    from glm5serve.testing.vllm_runner import KV_CACHE_ENV, run_in_subprocess

    batches = _prompts(narrow)
    env = {KV_CACHE_ENV: os.environ.get(KV_CACHE_ENV, "4")}  # several engines on one GPU: no memory profiling

    def engine(name: str, cache: Path) -> dict:
        return run_in_subprocess(str(narrow), batches, str(results_dir), mode="eager", max_tokens=8, timeout=600,
                                 name=name, env=dict(env, TRITON_CACHE_DIR=str(cache)))

    load = subprocess.Popen([sys.executable, "-c", _LOAD, str(LOAD_S)])
    try:
        with concurrent.futures.ThreadPoolExecutor(ENGINES) as pool:
            cold = list(pool.map(lambda i: engine(f"stream-cold-{i}", tmp_path / f"triton-{i}"), range(ENGINES)))
    finally:
        load.kill()
    warm = engine("stream-warm", tmp_path / "triton-0")
    failures = []
    for i, rec in enumerate(cold):
        for (a,), (b,) in zip(rec["batches"], warm["batches"], strict=True):
            r = bit_identical(a["tokens"], a["logprobs"], b["tokens"], b["logprobs"])
            if not r.ok:
                failures.append(f"engine {i}, prompt of {a['prompt_len']}: {r.why}")
    assert not failures, "\n".join(failures)  # a list would be cut to 240 characters

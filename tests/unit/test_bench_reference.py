"""Speed and memory of the reference engine (issue 3, item 7), with baselines measured in the same run.

Targets: the tiny checkpoint generates 32 greedy tokens in under 10 s on 2 CPU cores (compare with transformers'
``generate`` on the same weights, the group's baseline); the narrow checkpoint (GLM-5's attention and indexer
dimensions) loads and runs a forward pass on the CPU within 24 GiB, in fp32 over a prompt longer than
``index_topk`` (2048, so the DSA selection is live) and in bf16. The narrow runs happen in a subprocess so that
``peak_rss_gib`` is theirs alone.

Run: ``pytest tests/unit/test_bench_reference.py --benchmark-only``; ``extra_info`` holds the numbers.
"""
from __future__ import annotations

import pytest
import torch

from glm5serve.reference import ReferenceModel
from glm5serve.testing.compare import hf_model

N_NEW = 32
TINY_TARGET_S = 10.0
MEMORY_LIMIT_GIB = 24.0


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return ReferenceModel.from_gguf(tiny_checkpoint)


PROMPT = [476, 296, 64, 79, 276, 307, 305, 290, 81, 314, 363, 401]  # "The capital of France is"


@pytest.mark.benchmark(group="tiny: 32 greedy tokens")
def test_bench_tiny_generate(benchmark, tiny):
    out = benchmark.pedantic(lambda: tiny.generate(PROMPT, N_NEW), rounds=3, iterations=1, warmup_rounds=1)
    if benchmark.stats is not None:
        benchmark.extra_info.update(target_s=TINY_TARGET_S, threads=torch.get_num_threads())
    assert len(out) == N_NEW


@pytest.mark.benchmark(group="tiny: 32 greedy tokens")
def test_bench_tiny_generate_transformers_baseline(benchmark, tiny):
    hf = hf_model(tiny.cfg, tiny.w)
    ids = torch.tensor([PROMPT])
    out = benchmark.pedantic(lambda: hf.generate(ids, max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                                                 pad_token_id=0), rounds=3, iterations=1, warmup_rounds=1)
    assert out.shape[1] == len(PROMPT) + N_NEW


NARROW = r"""
import json, resource, sys, time
import torch
from glm5serve.reference import ReferenceModel
args = json.load(sys.stdin)
t0 = time.perf_counter()
model = ReferenceModel.from_gguf(args["model"], dtype=getattr(torch, args["dtype"]))
t1 = time.perf_counter()
ids = torch.randint(0, model.cfg.vocab_size, (args["tokens"],), generator=torch.Generator().manual_seed(0))
logits = model.forward(ids)
t2 = time.perf_counter()
print(json.dumps(dict(load_s=t1 - t0, forward_s=t2 - t1, index_topk=model.index_topk,
                      peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                      shape=list(logits.shape), finite=bool(torch.isfinite(logits).all()))))
"""


@pytest.mark.slow
@pytest.mark.benchmark(group="narrow: load + forward (subprocess)")
@pytest.mark.parametrize("dtype, tokens", [("float32", 2112), ("bfloat16", 256)])
def test_bench_narrow_forward(benchmark, narrow_checkpoint, subprocess_json, dtype, tokens):
    payload = dict(model=str(narrow_checkpoint), dtype=dtype, tokens=tokens)
    result = benchmark.pedantic(lambda: subprocess_json(NARROW, payload, timeout=1800), rounds=1, iterations=1)
    if benchmark.stats is not None:
        benchmark.extra_info.update({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()})
    assert result["finite"] and result["shape"][0] == tokens
    assert result["peak_rss_gib"] < MEMORY_LIMIT_GIB
    if dtype == "float32":
        assert tokens > result["index_topk"]  # the sparse path ran

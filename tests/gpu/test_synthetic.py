"""GPU: full-size GLM-5 layer slices served by vLLM from a synthetic header (``--load-format glm5-synthetic``, issue 9).

The correctness tests write a 5-layer slice header of the real GLM-5 (3 dense + 2 MoE layers, 256 experts, hidden
6144, vocab 154880, ud-q4_k_xl types; ~14 GB of weights made on the GPU) and serve it with vLLM at TP=1 (and TP=2
with two GPUs), eager and with CUDA graphs (no torch.compile), each engine in its own process: every request
must return its tokens with finite logprobs. Logs and ``synthetic-*.json`` go to ``$GLM5SERVE_GPU_RESULTS``::

    .ci/gpu tests/gpu/test_synthetic.py -k "not bench"

The slice benchmarks (``glm5serve bench``, README "Benchmark without the weights") are one command per layer
count and TP size (each a few minutes on an H200; two layer counts make the projection to 78 layers, TP=1 and
TP=2 the projection to TP=8)::

    G="python3 -m glm5serve.cli"
    $G synthetic-gguf /tmp/g5-4.gguf --preset glm5 --layers 4
    $G synthetic-gguf /tmp/g5-8.gguf --preset glm5 --layers 8
    $G bench /tmp/g5-8.gguf --load-format glm5-synthetic --tp 1 --graphs-mode nocompile --profile \\
        --json $OUT/bench-l8-tp1.json
    $G bench /tmp/g5-4.gguf --load-format glm5-synthetic --tp 1 --graphs-mode nocompile --profile \\
        --json $OUT/bench-l4-tp1.json
    $G bench /tmp/g5-8.gguf --load-format glm5-synthetic --tp 2 --graphs-mode nocompile --profile \\
        --json $OUT/bench-l8-tp2.json      # two GPUs; likewise -l4-tp2
    $G bench --projection $OUT/bench-l*-tp*.json --json $OUT/projection.json

or, in the pytest harness, ``GLM5SERVE_SYNTHETIC_BENCH=1 .ci/gpu tests/gpu/test_synthetic.py -k bench_slice_8``
(the 8-layer slice at every TP size the host has GPUs for, records into ``$GLM5SERVE_BENCH_OUT``; ``bench_slice_4``
for the second layer count). Without ``GLM5SERVE_SYNTHETIC_BENCH`` they skip: each takes minutes.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glm5serve.testing.vllm_runner import kv_cache_bytes_from_env

pytestmark = pytest.mark.gpu

LAYERS = 5
MAX_TOKENS = 16

#: one engine: LLM(load_format="glm5-synthetic") on the header, 4 prompts of 40 random tokens, greedy with logprobs
ENGINE = r"""
import json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # every batch scheduled in one step
spec = json.load(open(sys.argv[1]))
from vllm import LLM, SamplingParams
t = time.time()
llm = LLM(model=spec["model"], load_format="glm5-synthetic", tensor_parallel_size=spec["tp"], dtype="bfloat16",
          seed=0, max_model_len=512, gpu_memory_utilization=0.8, max_num_seqs=8, **spec["mode"], **spec["kv"])
init_s = time.time() - t
import random
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(spec["vocab"]) for _ in range(40)]} for _ in range(4)]
sp = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], logprobs=5, ignore_eos=True)
outs = llm.generate(prompts, sp, use_tqdm=False)
json.dump({"init_s": init_s, "tokens": [list(o.outputs[0].token_ids) for o in outs],
           "logprobs": [[lp.logprob for step in o.outputs[0].logprobs for lp in step.values()] for o in outs]},
          open(sys.argv[2], "w"))
"""

MODES = {"eager": {"enforce_eager": True},
         "graphs": {"enforce_eager": False,
                    "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                                           "cudagraph_capture_sizes": [1, 2, 4, 8]}}}


def _need_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPU(s)")
    pytest.importorskip("vllm")


@pytest.fixture(scope="session")
def slice_header(tmp_path_factory) -> Path:
    _need_gpus(1)
    from glm5serve.synthetic import write_header

    return write_header(tmp_path_factory.mktemp("synthetic") / f"g5-{LAYERS}.gguf", "glm5", layers=LAYERS)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_synthetic_slice_generates_finite_logprobs(slice_header, results_dir, tp, mode):
    _need_gpus(tp)
    name = f"synthetic-{mode}-tp{tp}"
    spec_file, out, log = (results_dir / f"{name}.{ext}" for ext in ("spec.json", "json", "log"))
    kv = kv_cache_bytes_from_env()  # a fixed cache lets this engine share the GPU with others (vllm_runner)
    spec_file.write_text(json.dumps({"model": str(slice_header), "tp": tp, "mode": MODES[mode], "vocab": 154880,
                                     "max_tokens": MAX_TOKENS,
                                     "kv": {} if kv is None else {"kv_cache_memory_bytes": kv}}))
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-c", ENGINE, str(spec_file), str(out)], stdout=f,
                            stderr=subprocess.STDOUT, env=env, timeout=900).returncode
    assert rc == 0, f"vLLM failed, log {log}: " + " | ".join(log.read_text().strip().splitlines()[-5:])
    rec = json.loads(out.read_text())
    assert [len(t) for t in rec["tokens"]] == [MAX_TOKENS] * 4
    flat = [x for lps in rec["logprobs"] for x in lps]
    assert len(flat) >= 4 * MAX_TOKENS and all(math.isfinite(x) for x in flat)
    print(f"{name}: engine start {rec['init_s']:.0f} s, {len(flat)} finite logprobs")


def _bench(layers: int, tmp_path_factory) -> None:
    if not os.environ.get("GLM5SERVE_SYNTHETIC_BENCH"):
        pytest.skip("set GLM5SERVE_SYNTHETIC_BENCH=1 to run the slice benchmark (minutes per TP size)")
    _need_gpus(1)
    out = os.environ.get("GLM5SERVE_BENCH_OUT") or str(tmp_path_factory.mktemp("bench-out"))
    from glm5serve.bench import bench, format_record
    from glm5serve.synthetic import write_header

    header = write_header(tmp_path_factory.mktemp("bench") / f"g5-{layers}.gguf", "glm5", layers=layers)
    for tp in [t for t in (1, 2) if t <= torch.cuda.device_count()]:
        rec = bench(str(header), tp=tp, load_format="glm5-synthetic", graphs_mode="nocompile", profile=True,
                    workdir=Path(out) / f"bench-l{layers}-tp{tp}")
        Path(out, f"bench-l{layers}-tp{tp}.json").write_text(json.dumps(rec, indent=1))
        print(format_record(rec))
        assert all("error" not in r for r in rec["runs"]), [r.get("error") for r in rec["runs"]]
        for run in rec["runs"]:
            for r in run["results"]:
                assert r["step_ms"] and r["step_ms"] > 0 and not r["short"], r
                assert "groups" in r["profile"], r["profile"]


def test_bench_slice_8(tmp_path_factory):
    _bench(8, tmp_path_factory)


def test_bench_slice_4(tmp_path_factory):
    _bench(4, tmp_path_factory)

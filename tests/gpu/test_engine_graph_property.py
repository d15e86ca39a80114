"""Engine-level eager vs CUDA-graph equality as a property (issue 6, item 2; bug classes 16, 18): Hypothesis draws
batch compositions inside two live vLLM engines on the narrow checkpoint, one eager and one with CUDA graphs
without torch.compile (``graphs``: FULL_DECODE_ONLY), and every request's greedy tokens and top-5 logprobs must be
bit-identical.

Each batch is one ``LLM.generate`` call: 1..24 requests, prompts of 1..700 tokens from the ordinary vocabulary,
1..12 new tokens per request, so the running batch shrinks as requests finish and the graph engine replays decode
steps padded to several captured sizes. Every prompt stays within ``index_topk`` (DSA selects every key; past it
vLLM's FP8 indexer keys are not reproducible even eager to eager, see ``test_vllm_e2e.py``). The fixed batches of
``test_vllm_e2e.py`` cover batch 1, 3 and 16; this file lets Hypothesis pick (few examples: each is two engine calls).

The engines are :class:`glm5serve.testing.vllm_runner.EngineSession` processes started once per session: on two
GPUs one each, in parallel; on one GPU both at ``gpu_memory_utilization`` 0.4, the second started once the first is
ready (vLLM sizes its KV cache from the memory it sees free while it profiles). Logs, the drawn batches and
``summary-engine-graph-property.json`` go to ``results_dir``. ``GLM5SERVE_NARROW`` may point at a narrow checkpoint.

Run on a GPU host: ``python -m pytest tests/gpu/test_engine_graph_property.py -m gpu -q`` (``HYPOTHESIS_PROFILE=ci``
for the derandomized draw).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from glm5serve.testing import strategies as gst
from glm5serve.testing.logprobs import bit_identical

pytestmark = pytest.mark.gpu

MAX_REQUESTS, MAX_PROMPT_LEN, MAX_NEW_TOKENS = 24, 700, 12
MODES = ("eager", "graphs")
_ROWS: list[dict] = []      # one per example, for the summary
_BATCHES: list[dict] = []   # the drawn batches themselves


@pytest.fixture(scope="session")
def vocab(narrow) -> list[int]:
    """Ids of the checkpoint's ordinary tokens (``token_type`` 1); checks every drawn sequence fits index_topk."""
    from glm5serve.config import config_from_metadata
    from glm5serve.gguf_file import GGUFModel

    m = GGUFModel(narrow)
    topk = config_from_metadata(m).index_topk
    assert MAX_PROMPT_LEN + MAX_NEW_TOKENS <= topk, f"sequences up to {MAX_PROMPT_LEN + MAX_NEW_TOKENS} > {topk}"
    return [i for i, t in enumerate(m.metadata["tokenizer.ggml.token_type"]) if int(t) == 1]


@pytest.fixture(scope="session")
def engines(narrow, results_dir):
    """``{"eager": EngineSession, "graphs": EngineSession}`` on the narrow checkpoint, ready."""
    from glm5serve.testing.vllm_runner import EngineSession

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = ([d.strip() for d in visible.split(",") if d.strip()] if visible else
               [str(i) for i in range(torch.cuda.device_count())])[:torch.cuda.device_count()]
    spread = len(devices) >= 2
    sessions = {}
    try:
        for i, mode in enumerate(MODES):
            sessions[mode] = EngineSession(
                str(narrow), mode, env={"CUDA_VISIBLE_DEVICES": devices[i if spread else 0]},
                log_path=results_dir / f"engine-graph-property-{mode}.log", gpu_memory_utilization=0.4,
                start_timeout=900, timeout=300)
            if not spread:
                sessions[mode].ready()
        for s in sessions.values():
            s.ready()
        yield sessions
    finally:
        for s in sessions.values():
            s.close()


def _write(results_dir: Path, engines: dict) -> None:
    (results_dir / "engine-graph-property.batches.json").write_text(json.dumps(_BATCHES))
    summary = {"examples": len(_ROWS), "requests": sum(r["batch_size"] for r in _ROWS),
               "identical_requests": sum(r["identical"] for r in _ROWS),
               "engines": {m: s.info for m, s in engines.items()}, "rows": _ROWS}
    (results_dir / "summary-engine-graph-property.json").write_text(json.dumps(summary, indent=1))


def test_graphs_engine_captured_cuda_graphs(engines):
    """The property below means something only if the graphs engine captured graphs and the eager one did not."""
    logs = {m: Path(s.log_path).read_text(errors="replace") for m, s in engines.items()}
    assert "Graph capturing finished" in logs["graphs"], f"no CUDA graph capture in {engines['graphs'].log_path}"
    assert "Graph capturing finished" not in logs["eager"], f"eager captured graphs: {engines['eager'].log_path}"


@settings(max_examples=6, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_graphs_bit_identical_to_eager_on_drawn_batches(engines, vocab, results_dir, data):
    """For a drawn batch, sent as one ``LLM.generate`` call to both engines, every request gets the same tokens
    and exactly the same top-5 logprobs at every step from CUDA-graph replay as from eager execution. (No
    shrinking: each example costs two engine calls; the failure message names the whole batch instead.)"""
    prompts, max_tokens = data.draw(gst.engine_batches(vocab, max_requests=MAX_REQUESTS,
                                                       max_prompt_len=MAX_PROMPT_LEN, max_new_tokens=MAX_NEW_TOKENS))
    lens = [len(p) for p in prompts]
    t0 = time.time()
    for s in engines.values():  # both engines work at once (on two GPUs, in parallel)
        s.submit(prompts, max_tokens)
    replies, errors = {}, []
    for m in MODES:  # collect both, so neither session keeps a stale reply for the next example
        try:
            replies[m] = engines[m].result()
        except RuntimeError as e:
            errors.append(e)
    if errors:
        raise errors[0]
    eager, graphs = replies["eager"], replies["graphs"]
    wall = time.time() - t0
    failures = []
    for b, (e, g, n) in enumerate(zip(eager, graphs, max_tokens, strict=True)):
        assert e["prompt_len"] == g["prompt_len"] == lens[b], f"request {b}: replies out of order"
        assert len(e["tokens"]) == len(g["tokens"]) == n, f"request {b}: ignore_eos run ended before {n} tokens"
        a = bit_identical(g["tokens"], g["logprobs"], e["tokens"], e["logprobs"])
        if not a.ok:
            failures.append(f"request {b} (prompt {lens[b]} tokens, max_tokens {n}): {a.why}")
    _BATCHES.append({"prompts": prompts, "max_tokens": max_tokens})
    _ROWS.append({"batch_size": len(prompts), "prompt_lens": lens, "max_tokens": max_tokens,
                  "identical": len(prompts) - len(failures), "failures": failures, "wall_s": round(wall, 2)})
    _write(results_dir, engines)
    assert not failures, (f"graphs != eager for {len(failures)} of {len(prompts)} requests in a batch of "
                          f"{len(prompts)} (prompt lengths {lens}, max_tokens {max_tokens}): " + "; ".join(failures))

"""``glm5serve verify MODEL --engine vllm [--tp N]``: the dynamic half of the harness, after the static checks.

1. vLLM eager against the reference engine (greedy tokens; at the first difference each side's token must be in
   the other's top-5, vLLM's ``check_logprobs_close`` rule);
2. vLLM with CUDA graphs (no torch.compile) against vLLM eager: bit-identical logprobs.
Prompts are drawn deterministically from the GGUF's ordinary tokens and stay within ``index_topk``, where DSA
selects every key (past it vLLM's FP8 indexer keys make runs differ; ``tests/gpu/test_vllm_e2e.py`` measures that).
"""
from __future__ import annotations

import tempfile
import time
from typing import Callable

import torch

from glm5serve.testing.logprobs import bit_identical, top_k_rule
from glm5serve.verify import Check

PROMPT_LENS = (5, 40, 300)
MAX_TOKENS = 16

#: ``run(model, batches, workdir, mode=..., tp=..., max_tokens=...) -> record`` as
#: :func:`glm5serve.testing.vllm_runner.run_in_subprocess` returns it; tests pass a stand-in
Runner = Callable[..., dict]


def prompts_for(model) -> list[list[int]]:
    """Deterministic prompts of :data:`PROMPT_LENS` tokens (capped below ``index_topk``) from NORMAL tokens."""
    from glm5serve.config import config_from_metadata

    cfg = config_from_metadata(model)
    normal = torch.tensor([i for i, t in enumerate(model.metadata["tokenizer.ggml.token_type"]) if int(t) == 1])
    g = torch.Generator().manual_seed(5)
    return [normal[torch.randint(len(normal), (min(n, cfg.index_topk),), generator=g)].tolist() for n in PROMPT_LENS]


def reference_generations(path, prompts, device: str) -> list[dict]:
    """Greedy :data:`MAX_TOKENS` tokens per prompt from the reference engine (fp32, q_a/kv_a norm eps = rms_norm_eps
    as vLLM computes them), with the chosen token's and the top-5 logprobs per step."""
    from glm5serve.reference import ReferenceModel

    model = ReferenceModel.from_gguf(path, device=device, qa_kv_norm_eps="rms_norm_eps")
    return [greedy_with_top5(model, p, MAX_TOKENS) for p in prompts]


def greedy_with_top5(model, prompt: list[int], max_tokens: int) -> dict:
    """``{"tokens": [...], "logprobs": [{token_id: logprob}, ...]}``: greedy tokens of a
    :class:`~glm5serve.reference.ReferenceModel` with each step's top-5 and chosen-token logprobs (nats), in the
    shape :mod:`glm5serve.testing.vllm_runner` records vLLM's."""
    toks, lps = [], []
    for t, lp in model.stream(prompt, max_tokens):
        top = torch.topk(lp, 5)
        step = {int(i): float(v) for i, v in zip(top.indices, top.values)}
        step[t] = float(lp[t])
        toks.append(t)
        lps.append(step)
    return {"tokens": toks, "logprobs": lps}


def engine_checks(path: str, tp: int = 1, *, run: Runner | None = None, device: str | None = None,
                  progress: Callable[[str], None] | None = None) -> list[Check]:
    """The checks above as :class:`~glm5serve.verify.Check` lines. ``run`` defaults to vLLM in a subprocess;
    ``progress`` gets one line as each of the three stages (each up to minutes) starts, with seconds elapsed."""
    from glm5serve.gguf_file import GGUFModel

    t0 = time.monotonic()

    def stage(what: str) -> None:
        if progress is not None:
            progress(f"verify: {what} (+{time.monotonic() - t0:.0f} s)")

    if run is None:
        from glm5serve.testing.vllm_runner import run_in_subprocess as run
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    prompts = prompts_for(GGUFModel(path))
    batches = [[p] for p in prompts]
    checks = []
    with tempfile.TemporaryDirectory(prefix="glm5serve-engine-") as work:
        try:
            stage(f"1/3 vLLM eager, TP={tp}: {len(prompts)} prompts")
            eager = run(path, batches, work, mode="eager", tp=tp, max_tokens=MAX_TOKENS)
            stage(f"2/3 the reference engine on {device}")
            ref = reference_generations(path, prompts, device)
            rules = [top_k_rule(b[0]["tokens"], b[0]["logprobs"], r["tokens"], r["logprobs"])
                     for b, r in zip(eager["batches"], ref, strict=True)]
            bad = [f"prompt {len(p)}: {a.why}" for p, a in zip(prompts, rules) if not a.ok]
            exact = sum(a.first_diff is None for a in rules)
            gap = max(a.max_gap for a in rules)
            backends = ",".join(eager.get("backends", [])) or "?"
            checks.append(Check("vllm-ref", not bad, "; ".join(bad) or
                                f"vLLM {eager.get('vllm', '?')} eager TP={tp} ({backends}, GGUF kernels "
                                f"{eager.get('gguf_kernels', '?')}) vs reference: {exact}/{len(rules)} prompts "
                                f"identical for {MAX_TOKENS} tokens, others within the top-5 rule; max gap {gap:.3f}"))
            stage("3/3 vLLM with CUDA graphs")
            graphs = run(path, batches, work, mode="graphs", tp=tp, max_tokens=MAX_TOKENS)
            same = [bit_identical(g[0]["tokens"], g[0]["logprobs"], e[0]["tokens"], e[0]["logprobs"])
                    for g, e in zip(graphs["batches"], eager["batches"], strict=True)]
            bad = [f"prompt {len(p)}: {a.why}" for p, a in zip(prompts, same) if not a.ok]
            checks.append(Check("graphs", not bad, "; ".join(bad) or
                                f"CUDA graphs (no torch.compile) bit-identical to eager on {len(same)} prompts"))
        except (RuntimeError, OSError) as e:
            checks.append(Check("engine", False, str(e)))
    return checks

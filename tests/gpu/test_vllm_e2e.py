"""GPU end to end: vLLM serves the narrow GLM-5 checkpoint (ud-q4_k_xl, split in 2) through glm5serve, and the
output is checked against the reference engine and against itself across execution modes.

Each vLLM configuration (:data:`CONFIGS`) runs once per session in its own process
(``glm5serve.testing.vllm_runner``). The configurations the selected tests need start together before the first
test, one engine per GPU at a time (TP=2 ones once the TP=1 ones are done), so a two-GPU host runs the file in
about half the time. Results and logs go to ``$GLM5SERVE_GPU_RESULTS`` (default: a pytest tmp dir) together with
``summary-*.json`` files holding the measured numbers. ``GLM5SERVE_NARROW`` may point at an existing narrow
checkpoint (shard 1).

Besides vLLM's own choices (attention backend, glm5serve's GGUF decode kernels as installed by the plugin, which
read Q4_0/Q5_0/Q8_0 linears as split rows), two configurations swap one part: ``CUSTOM`` (glm5serve's Triton MLA
backend, issue "portable Triton MLA") and ``GLM5SERVE_GGUF_KERNELS=plugin`` (vllm-gguf-plugin's own kernels instead
of glm5serve's).
"""
from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

from glm5serve.testing.activation_rounding import BLOCKS as ACTIVATION_BLOCKS, rounded_in_prefill
from glm5serve.testing.logprobs import bit_identical, tolerance_rule, top_k_rule
from glm5serve.testing.router_ties import logprobs, near_ties, settles, topk_margins

pytestmark = pytest.mark.gpu

MAX_TOKENS = 32
#: chosen-token logprob tolerance between two bf16 vLLM engines that round differently (torch.compile, TP=2),
#: while the expert choice is unambiguous: logits of this checkpoint reach |40|, where bf16's spacing is 0.25
TOL_TIGHT = 0.25
#: the stated tolerance over whole generations: router near-ties (a few % of token-layers) let one engine pick
#: another of the top-4 experts; measured on the H200 (vLLM 0.25, narrow ud-q4_k_xl): up to 0.68 nat with
#: torch.compile, 0.48 at TP=2, token flips where the baseline's top-1 margin was up to 1.5
TOL = 1.0
#: a router top-k margin below this (sigmoid-score units) is a near-tie that bf16 router logits can flip; every
#: divergence measured on the H200 (vLLM 0.25, narrow ud-q4_k_xl) sat at a margin <= 0.0048
ROUTER_TAU = 0.005
# Not re-fit to the H100, where the compile-vs-eager and CUSTOM-vs-vLLM-MLA comparisons failed (three runs on two
# machines, bit-identical records): divergences began at margins 0.0058-0.0070, and after a near-tie flip tokens
# flipped at baseline margins up to 2.5. Raising the constants to that card's data would loosen the test. Instead
# the fp32 reference settles a broken step where it can (``_close``). Two H100 runs of that rule: token flips at
# baseline margins 2.0-2.5 (three prompts, both runs) were each settled by one router flip at a margin of
# 0.002-0.007, a gap of 0.2507 (one run) by the reference with no flip. Left unsettled: in compile-vs-eager, gaps
# of 0.29 and 0.27 in the tight tier, where one engine sits 0.34-0.39 from the fp32 reference (in one run of two:
# the torch.compile engine differed between runs, the other engines did not); in CUSTOM-vs-vLLM-MLA (both runs),
# batch3's 40-token prompt at step 2, a flip at baseline margin 0.75 that no single router flip reproduces
# (q 0.77 -> 0.53 at best, 0.50 wanted; two flips, at margins 0.020 and 0.017, give 0.33). Session 37 (H100):
# * the decode kernels round most linears' inputs to int8 at decode batch sizes (per 32 or 256, by type and batch
#   size). Emulated in the fp32 reference (``testing.activation_rounding``, which rounds more than any engine),
#   that rounding moves such steps by tenths of a nat, at times by nats (q -1.26 -> 2.77 at batch16 prompt 189
#   step 2, on the GPU), where bf16 moves them by 0.02-0.08; the reference now tries it. With it, an H100 run
#   passed (compile-vs-eager: 4 steps settled; CUSTOM: 2); the eager gap at prompt 700 step 11 was settled at the
#   edge (a flip at margin 0.061 plus rounding per 32: -0.65 for eager's -0.90, 0.25 wanted). The rounded
#   reference is itself a sample: on the CPU that candidate gives -0.54, and per 256 at batch3 prompt 40 step 2,
#   q -0.14 on the CPU against 0.45 on the GPU (a code boundary turns fp32 summation order into an int8 step), so
#   that step may fail on another run;
# * the torch.compile engine is not deterministic on the H100: over three runs, 4-5 steps of two runs are more
#   than TOL_TIGHT apart and tokens differ in 11-17 of 27 prompts, so TOL_TIGHT cannot hold against eager there
#   without the reference; eager, graphs and CUSTOM were bit-identical across the runs;
# * the price: a step-0 logprob of the eager engine shifted by 0.3 (24 prompts <= 400 tokens, CPU) passes as
#   settled in 11 (+0.3) / 15 (-0.3) of 24 prompts, against 6 / 12 with flips alone; by 1.0: 1 / 8 against 0 / 2.
#   A systematic shift still fails, at the prompts whose steps rounding does not move (about half).
# Session 38: the reference rounds only where an engine may (the generated positions; in the prompt what a step of the
# batch's prompt tokens rounds: ``rounded_in_prefill``). Price at step 0 now 7 / 13 (0.3), 0 / 3 (1.0); at step 4,
# where the generated positions are rounded as before, 15 / 15 (0.3) against session 37's 14 / 16 and 12 / 13 with
# flips alone, 0 / 3 (1.0) against 0 / 2 and 0 / 1. An H100 run passed (8 passed): compile-vs-eager 2 settled (a gap
# of 0.2507 by the reference as it is, a token flip by a router flip at margin 0.0070), and the compile engine (a
# fourth distinct set of records) came to 0.247 of eager at prompt 700 step 11, which the reference still does not
# settle on the CPU (nearest -0.43 for eager's -0.90); CUSTOM: batch3 prompt 40 step 2 settled at the edge again (a
# flip at margin 0.018 and rounding per 32: q 0.48, <= 0.50 wanted), batch16 prompt 189 step 2 by a router flip at
# margin 0.0020. Session 40 (H100) captured eager's residual stream at every decode step of prompt 700: after each of
# the 3 layers it is 0.006 / 0.010 / 0.014 from the fp32 reference at step 11, like the other steps (at most 0.009 /
# 0.014 / 0.026), within the CPU harness's bounds (``layer_capture.LAYER_REL_TOL``). The step is sensitive: the
# reference's fp32 head on the GPU's last-layer stream gives -0.79 (FlashAttention MLA) / -0.72 (CUSTOM) for the
# reference's -0.57, random errors of that size move it with sd 0.08 (the GPU's error is about 3 sd, not random), and
# the engine's own final norm and lm_head add 0.11 / 0.03 more (the engines said -0.90 / -0.75; scored through the
# prefill path, -0.73 both).
SHORT = [5, 17, 40, 130, 300, 700, 1500, 2000]   # <= index_topk (2048): DSA selects every key
LONG = [2100, 2600]                                 # > index_topk: the indexer's top-k matters


def _need_gpus(n: int) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPU(s)")


@pytest.fixture(scope="session")
def prompts(narrow) -> dict[str, list[list[int]]]:
    """Deterministic token-id prompts drawn from the ordinary (non-special) part of the vocabulary."""
    from glm5serve.gguf_file import GGUFModel

    m = GGUFModel(narrow)
    types = list(m.metadata["tokenizer.ggml.token_type"])
    normal = torch.tensor([i for i, t in enumerate(types) if int(t) == 1])
    g = torch.Generator().manual_seed(5)

    def draw(n):
        return normal[torch.randint(len(normal), (n,), generator=g)].tolist()

    return {"short": [draw(n) for n in SHORT], "long": [draw(n) for n in LONG],
            "batch16": [draw(int(n)) for n in torch.randint(8, 400, (16,), generator=g)]}


def _batches(prompts) -> dict[str, list[list[list[int]]]]:
    """Named groups of batches every configuration runs, in one process: singles (batch 1), a batch of 3 (padded
    into a larger captured graph), a batch of 16."""
    return {"single": [[p] for p in prompts["short"] + prompts["long"]],
            "batch3": [prompts["short"][:3]],
            "batch16": [prompts["batch16"]]}


#: engine configuration name -> (mode, tp, attention backend or None, extra environment)
CONFIGS: dict[str, tuple[str, int, str | None, dict[str, str]]] = {
    "eager-tp1": ("eager", 1, None, {}),
    "eager-tp1-rerun": ("eager", 1, None, {}),
    "graphs-tp1": ("graphs", 1, None, {}),
    "default-tp1": ("default", 1, None, {}),
    "eager-tp2": ("eager", 2, None, {}),
    "eager-tp1-custom": ("eager", 1, "CUSTOM", {}),
    "graphs-tp1-custom": ("graphs", 1, "CUSTOM", {}),
    "eager-tp1-pluginkernels": ("eager", 1, None, {"GLM5SERVE_GGUF_KERNELS": "plugin"}),
}
#: configurations an unparametrized test reads (parametrized tests name theirs in their parameters)
NEEDS = {"test_default_compile_close_to_eager": ["eager-tp1", "default-tp1"],
         "test_tp2_close_to_tp1": ["eager-tp1", "eager-tp2"],
         "test_past_index_topk_determinism_and_gap": ["eager-tp1", "eager-tp1-rerun"],
         "test_custom_mla_close_to_vllm_backend": ["eager-tp1", "eager-tp1-custom"],
         "test_glm5serve_kernels_as_close_to_reference_as_plugin_kernels": ["eager-tp1", "eager-tp1-pluginkernels"]}
_RUNS: dict[str, dict] = {}


def _run_config(name: str, narrow: Path, groups: dict, results_dir: Path, devices: str | None = None) -> dict:
    mode, tp, backend, env = CONFIGS[name]
    flat, index = [], {}
    for g, bs in groups.items():
        index[g] = (len(flat), len(flat) + len(bs))
        flat += bs
    from glm5serve.testing.vllm_runner import run_in_subprocess

    env = dict(env, **({"CUDA_VISIBLE_DEVICES": devices} if devices is not None else {}))
    rec = run_in_subprocess(str(narrow), flat, str(results_dir), mode=mode, tp=tp, max_tokens=MAX_TOKENS,
                            timeout=900, name=name, attention_backend=backend, env=env)
    rec["groups"] = {g: rec["batches"][a:b] for g, (a, b) in index.items()}
    rec["prompt_groups"] = groups
    return rec


@pytest.fixture(scope="session")
def engines(request, narrow, prompts, results_dir) -> dict[str, dict | Exception]:
    """Run every configuration the selected tests of this file need, before the first of them: TP=1 ones in
    parallel, ``$GLM5SERVE_ENGINES_PER_GPU`` (default 1) per visible GPU at a time, then the TP=2 ones on GPUs 0,1.
    More than one engine per GPU needs a fixed KV cache size (``$GLM5SERVE_KV_CACHE_GIB``, see
    ``vllm_runner.kv_cache_bytes_from_env``): vLLM's memory profiling fails when another process on the GPU frees
    memory meanwhile. Returns {name: record or error}."""
    from glm5serve.testing.vllm_runner import KV_CACHE_ENV, kv_cache_bytes_from_env

    per_gpu = int(os.environ.get("GLM5SERVE_ENGINES_PER_GPU", "1"))
    if per_gpu > 1 and kv_cache_bytes_from_env() is None:
        pytest.fail(f"GLM5SERVE_ENGINES_PER_GPU={per_gpu} needs {KV_CACHE_ENV} (a fixed KV cache size per engine)")
    needed: set[str] = set()
    for item in request.session.items:
        if item.module.__name__ == __name__:
            params = getattr(getattr(item, "callspec", None), "params", {})
            needed |= {v for v in params.values() if v in CONFIGS} | set(NEEDS.get(item.originalname, ()))
    n_gpus = torch.cuda.device_count()
    needed = {n for n in needed if CONFIGS[n][1] <= n_gpus}
    groups = _batches(prompts)
    queue = sorted(n for n in needed if CONFIGS[n][1] == 1)
    lock = threading.Lock()

    def worker(gpu: int) -> None:
        while True:
            with lock:
                if not queue:
                    return
                name = queue.pop(0)
            try:
                _RUNS[name] = _run_config(name, narrow, groups, results_dir, str(gpu))
            except Exception as e:  # noqa: BLE001 - reported by the test that reads it
                _RUNS[name] = e

    threads = [threading.Thread(target=worker, args=(lane % max(1, n_gpus),))
               for lane in range(max(1, n_gpus) * max(1, per_gpu))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in sorted(n for n in needed if CONFIGS[n][1] > 1):
        try:
            _RUNS[name] = _run_config(name, narrow, groups, results_dir,
                                      ",".join(str(g) for g in range(CONFIGS[name][1])))
        except Exception as e:  # noqa: BLE001
            _RUNS[name] = e
    return _RUNS


def vllm_run(engines: dict, name: str) -> dict:
    """The record of configuration ``name`` (see :data:`CONFIGS`); fails the test if that engine failed."""
    _need_gpus(CONFIGS[name][1])
    rec = engines.get(name)
    if rec is None:
        pytest.fail(f"configuration {name} was not run (add it to NEEDS or the test's parameters)")
    if isinstance(rec, Exception):
        pytest.fail(f"vLLM {name} failed: {rec}")
    return rec


@pytest.fixture(scope="session")
def ref_model(narrow, engines):  # after the engines: vLLM sizes its KV cache from the GPU memory it finds free
    """The reference engine in fp32 on the GPU, with q_a/kv_a norms at rms_norm_eps as vLLM computes them."""
    from glm5serve.reference import ReferenceModel

    return ReferenceModel.from_gguf(narrow, dtype=torch.float32, device="cuda", qa_kv_norm_eps="rms_norm_eps")


@pytest.fixture(scope="session")
def reference(ref_model, prompts, results_dir) -> list[dict]:
    """Greedy tokens with top-5 logprobs per step from the reference engine, for the single prompts."""
    from glm5serve.engine_check import greedy_with_top5

    out = [{"prompt_len": len(p), **greedy_with_top5(ref_model, p, MAX_TOKENS)}
           for p in prompts["short"] + prompts["long"]]
    (results_dir / "reference.json").write_text(json.dumps(out))
    return out


@pytest.fixture(scope="session")
def flip_range(narrow, ref_model, reference, prompts) -> float:
    """How far bf16 rounding reaches into router margins on this checkpoint, measured: the largest fp32 top-k margin
    at which the reference computing in bf16 routes a token to another expert set than in fp32, over the single
    prompts within index_topk and the reference's own tokens (``router_ties.bf16_flip_range``); at least
    ROUTER_TAU. On the H100 it was 0.096; on the CPU, over the prompts of <= 700 tokens teacher-forced on the H100
    eager engine's tokens, 0.032, with 3 % of token-layers routed to another set: bf16 reaches far beyond the
    margins (<= 0.007) at which the engines were seen to diverge."""
    from glm5serve.reference import ReferenceModel
    from glm5serve.testing.router_ties import bf16_flip_range

    bf16 = ReferenceModel.from_gguf(narrow, dtype=torch.bfloat16, device="cuda", qa_kv_norm_eps="rms_norm_eps")
    seqs = [p + r["tokens"][:-1] for p, r in zip(prompts["short"] + prompts["long"], reference, strict=True)
            if len(p) <= 2048]
    measured = bf16_flip_range(ref_model, bf16, seqs)
    del bf16
    torch.cuda.empty_cache()
    return max(ROUTER_TAU, measured)


def router_margins(model, ids: list[int]) -> torch.Tensor:
    """(T,) smallest top-k selection margin over the MoE layers at each position of ``ids`` (teacher forced):
    ``choice[k-1] - choice[k]`` of the sorted ``sigmoid(router logits) + e_score_correction_bias``. A margin
    below bf16 router resolution means the expert choice may flip under any rounding change."""
    return topk_margins(model, ids).min(0).values


def prompt_tie_sensitivity(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """(len(tokens),) how far the reference's chosen-token logprob at each generated step can move (nats, teacher
    forced on ``tokens``) when one router near-tie among the *prompt* positions (top-k margin < ROUTER_TAU) goes the
    other way: the max over the prompt's near-ties, flipped one at a time (the k-th expert swapped for the
    runner-up, weights renormalised as the router does). A prompt near-tie reaches later positions through
    attention: on a 5-token prompt (H200, vLLM 0.25) one flip in layer 1 at position 2 moved step 0 by 0.67 nat, and
    the eager TP=1 engine took exactly that flip. Flips are taken one at a time because together they can cancel,
    and the near-tie set comes from the unperturbed pass (a flip moves the later layers' margins). Only the
    MAX_PROMPT_FLIPS near-ties closest to the end of the prompt are tried (one reference forward each): an earlier
    one shares attention with every position after it. Results are cached per (prompt, tokens): every comparison
    uses eager TP=1 as its baseline. Single-group routers only (``n_group == 1``)."""
    ids, n = list(prompt) + list(tokens[:-1]), len(prompt)
    key = (tuple(prompt), tuple(tokens))
    if key in _TIE_CACHE:
        return _TIE_CACHE[key]
    rows, targets = torch.arange(n - 1, len(ids)), torch.tensor(tokens)
    base = logprobs(model, ids)[rows, targets]
    moved = torch.zeros(len(tokens))
    for flip in [f for f in near_ties(model, ids, ROUTER_TAU) if f.pos < n][-MAX_PROMPT_FLIPS:]:
        moved = torch.maximum(moved, (logprobs(model, ids, flip)[rows, targets] - base).abs())
    _TIE_CACHE[key] = moved
    return moved


MAX_PROMPT_FLIPS = 32
_TIE_CACHE: dict[tuple, torch.Tensor] = {}


def _summary(results_dir: Path, name: str, data: dict) -> None:
    (results_dir / f"summary-{name}.json").write_text(json.dumps(data, indent=1, default=str))
    print(f"\n[{name}] {json.dumps(data, default=str)}")


@pytest.mark.parametrize("config", ["eager-tp1", "eager-tp1-custom", "eager-tp2"])
def test_eager_matches_reference(config, engines, prompts, results_dir, reference, ref_model):
    """Greedy tokens of vLLM eager equal the reference engine's; where they first differ each side's token is in
    the other's top-5 (vLLM's check_logprobs_close rule). A first difference at a step where the reference,
    teacher-forced on vLLM's tokens, has a router near-tie (top-k margin < ROUTER_TAU: bf16 router logits can
    choose another expert) is measured and reported instead: an unrelated random expert moves logits by a nat.
    Past index_topk the indexer keeps FP8 keys in vLLM; the same rules apply. ``eager-tp1-custom``: the same
    with glm5serve's Triton MLA backend (``--attention-backend CUSTOM``); ``eager-tp2``: the same at TP=2 (two
    GPUs), held to the independent reference rather than only to TP=1 (:func:`test_tp2_close_to_tp1`)."""
    run = vllm_run(engines, config)
    if CONFIGS[config][2]:
        assert CONFIGS[config][2] in run["backends"], f"vLLM did not use {CONFIGS[config][2]}: {run['backends']}"
    singles = [b[0] for b in run["groups"]["single"]]
    rows, failures = [], []
    for p, v, r in zip(prompts["short"] + prompts["long"], singles, reference, strict=True):
        a = top_k_rule(v["tokens"], v["logprobs"], r["tokens"], r["logprobs"])
        row = {"prompt_len": r["prompt_len"], "first_diff": a.first_diff, "max_gap": round(a.max_gap, 4),
               "exact": a.first_diff is None, "top5_ok": a.ok}
        if a.first_diff is not None:
            m = router_margins(ref_model, p + v["tokens"][:a.first_diff])
            row["router_margin_at_diff"] = round(float(m[-1]), 5)
            row["router_near_tie"] = bool(m[-1] < ROUTER_TAU)  # at the step itself
        rows.append(row)
        if not a.ok and not row.get("router_near_tie"):
            failures.append(f"prompt of {r['prompt_len']} tokens: {a.why}")
    _summary(results_dir, f"{config}-vs-reference", {"backends": run["backends"], "gguf_kernels": run["gguf_kernels"],
             "split_weights": run["split_weights"], "vllm": run["vllm"], "exact": sum(x["exact"] for x in rows),
             "top5_ok": sum(x["top5_ok"] for x in rows), "prompts": len(rows), "rows": rows})
    assert not failures, "\n".join(failures)  # a list would be cut to 240 characters
    short = [x for x in rows if x["prompt_len"] <= 2048]
    assert sum(x["top5_ok"] for x in short) >= len(short) - 2, f"top-5 rule broken on too many prompts: {rows}"


@pytest.mark.parametrize("eager_config,graphs_config", [("eager-tp1", "graphs-tp1"),
                                                        ("eager-tp1-custom", "graphs-tp1-custom")])
def test_graphs_bit_identical_to_eager(eager_config, graphs_config, engines, results_dir):
    """CUDA graphs without torch.compile replay exactly what eager computes, at batch 1, 3 (padded) and 16; with
    vLLM's attention backend and with glm5serve's Triton MLA (CUSTOM)."""
    eager = vllm_run(engines, eager_config)
    graphs = vllm_run(engines, graphs_config)
    report, failures = {}, []
    for g in ("single", "batch3", "batch16"):
        for bi, (be, bg) in enumerate(zip(eager["groups"][g], graphs["groups"][g], strict=True)):
            for e, c in zip(be, bg, strict=True):
                if e["prompt_len"] > 2048:
                    continue  # FP8 indexer keys: not reproducible even eager-to-eager (test below)
                a = bit_identical(c["tokens"], c["logprobs"], e["tokens"], e["logprobs"])
                report.setdefault(g, []).append(a.ok)
                if not a.ok:
                    failures.append(f"{g}[{bi}] prompt {e['prompt_len']}: {a.why}")
    _summary(results_dir, f"{graphs_config}-vs-eager", {"backends": graphs["backends"], "identical": report})
    assert not failures, "\n".join(failures)  # a list would be cut to 240 characters


def test_default_compile_close_to_eager(engines, results_dir, ref_model, flip_range):
    """vLLM's default mode (torch.compile + CUDA graphs) against eager: see :func:`_close`."""
    _close(vllm_run(engines, "eager-tp1"), vllm_run(engines, "default-tp1"), results_dir, "default-vs-eager", ref_model,
           flip_range)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tp2_close_to_tp1(engines, results_dir, ref_model, flip_range):
    """TP=2 against TP=1 (eager): the all-reduce changes summation order; see :func:`_close`."""
    _close(vllm_run(engines, "eager-tp1"), vllm_run(engines, "eager-tp2"), results_dir, "tp2-vs-tp1", ref_model,
           flip_range)


def test_custom_mla_close_to_vllm_backend(engines, results_dir, ref_model, flip_range):
    """glm5serve's Triton MLA (CUSTOM) against vLLM's own sparse MLA backend, both eager: attention kernels that
    round differently; see :func:`_close`."""
    _close(vllm_run(engines, "eager-tp1"), vllm_run(engines, "eager-tp1-custom"), results_dir, "custom-vs-vllm-mla",
           ref_model, flip_range)


def _chosen(gen: dict, step: int) -> float:
    """Chosen-token logprob at ``step`` (vLLM records key token ids as str, the reference engine as int)."""
    lp, tok = gen["logprobs"][step], gen["tokens"][step]
    return lp[str(tok)] if str(tok) in lp else lp[tok]


def test_glm5serve_kernels_as_close_to_reference_as_plugin_kernels(engines, results_dir, reference):
    """glm5serve's GGUF decode kernels (installed by the plugin) against vllm-gguf-plugin's own, both eager, each
    measured against the fp32 reference over the steps before its first token difference: the new kernels must be
    at least as accurate (mean chosen-token logprob gap no more than 10 % above the plugin's) and both must keep the
    top-5 rule. The two engines are not compared with each other under TOL_TIGHT: the plugin's kernels alone are
    0.41 nat from the reference before any router near-tie (H200, vLLM 0.25), ours 0.27."""
    ours, plugin = vllm_run(engines, "eager-tp1"), vllm_run(engines, "eager-tp1-pluginkernels")
    assert ours["gguf_kernels"].startswith("glm5serve-triton") and not plugin["gguf_kernels"].startswith("glm5serve")
    # the checkpoint's Q8_0 linears (indexer wq_b/wk, shared experts...) are served as split rows by ours only
    assert min(ours["split_weights"]) > 0 and max(plugin["split_weights"]) == 0, (ours["split_weights"],
                                                                                 plugin["split_weights"])
    stats, failures = {}, []
    for name, run in (("glm5serve", ours), ("plugin", plugin)):
        gaps, agree = [], []
        for (v,), r in zip(run["groups"]["single"], reference, strict=True):
            a = top_k_rule(v["tokens"], v["logprobs"], r["tokens"], r["logprobs"])
            if not a.ok:
                failures.append(f"{name} kernels, prompt {r['prompt_len']}: {a.why}")
            n = len(v["tokens"]) if a.first_diff is None else a.first_diff
            agree.append(n)
            gaps += [abs(_chosen(v, i) - _chosen(r, i)) for i in range(n)]
        stats[name] = {"mean_gap": round(sum(gaps) / len(gaps), 4), "max_gap": round(max(gaps), 4),
                       "steps_before_first_diff": agree}
    _summary(results_dir, "glm5serve-vs-plugin-kernels", {"gguf_kernels": ours["gguf_kernels"],
                                                          "split_weights": ours["split_weights"], **stats})
    assert not failures, "\n".join(failures)  # a list would be cut to 240 characters
    assert stats["glm5serve"]["mean_gap"] <= 1.1 * stats["plugin"]["mean_gap"], stats


def _close(base: dict, other: dict, results_dir: Path, name: str, ref_model, flip_range: float) -> None:
    """Two bf16 engines that round differently, compared in two tiers:

    * up to the first generated position whose expert choice is a router near-tie (reference margin < ROUTER_TAU,
      teacher-forced on the baseline's tokens), or whose logprob one near-tie in the prompt can move by more than
      TOL_TIGHT / 2 (:func:`prompt_tie_sensitivity`): chosen-token logprobs within TOL_TIGHT, and the same greedy
      tokens wherever the baseline's top-1 margin exceeds 2·TOL_TIGHT;
    * over the whole generation: the same rule with the stated tolerance TOL (a flipped expert moves logits).

    A step that breaks a tier's rule still passes when the fp32 reference settles it (:func:`_reference_settles`):
    teacher forced on the history both engines share, with no router flip or with one flip of a near-tie within
    ``flip_range`` (bf16's measured reach), and its linears' inputs as they are or rounded to int8 where the decode
    kernels may round them (the generated positions; in the prefill what a step of the batch's prompt tokens
    rounds), it reproduces each engine within the tier's tolerance; the tier then goes on from the next
    step while the tokens agree (:func:`_tier`).
    """
    failures, rows, n_settled = [], [], 0
    for g in ("single", "batch3", "batch16"):
        for bb, bo, pp in zip(base["groups"][g], other["groups"][g], base["prompt_groups"][g], strict=True):
            for b, o, p in zip(bb, bo, pp, strict=True):
                if b["prompt_len"] > 2048:
                    continue
                m = router_margins(ref_model, p + b["tokens"][:-1])[len(p) - 1:]
                tie = [i for i, x in enumerate(m.tolist()) if x < ROUTER_TAU]
                moved = prompt_tie_sensitivity(ref_model, p, b["tokens"])
                sensitive = [i for i, x in enumerate(moved.tolist()) if x > TOL_TIGHT / 2]
                cut = min(tie[:1] + sensitive[:1] + [len(b["tokens"])])
                prefill = sum(map(len, pp))  # the batch's prompts share one engine step (one chunk)
                tight_gap, _, tight = _tier(ref_model, p, b, o, cut, TOL_TIGHT, flip_range, prefill)
                gap, first_diff, loose = _tier(ref_model, p, b, o, len(b["tokens"]), TOL, flip_range, prefill)
                rows.append({"group": g, "prompt_len": b["prompt_len"], "tight_steps": cut,
                             "first_near_tie": tie[0] if tie else None,
                             "first_prompt_tie_sensitive": sensitive[0] if sensitive else None,
                             "tight_gap": round(tight_gap, 4), "gap": round(gap, 4),
                             "first_diff": first_diff, "identical": o["tokens"] == b["tokens"]})
                for broken, tier in ((tight, "before the first router near-tie"), (loose, "whole generation")):
                    for why, settled, how in broken:
                        rows[-1].setdefault("reference", []).append(f"{tier}: {why}: {how}")
                        n_settled += settled
                        if not settled:
                            seen = _reference_view(ref_model, p, b["tokens"], o["tokens"], why, m, moved)
                            failures.append(f"{g} prompt {b['prompt_len']} ({tier}): {why} [{how}; {seen}]")
    _summary(results_dir, name, {"backends": other["backends"], "gguf_kernels": other["gguf_kernels"],
                                 "tol_tight": TOL_TIGHT, "tol": TOL, "router_tau": ROUTER_TAU,
                                 "flip_range": round(flip_range, 5),
                                 "settled_by_reference": n_settled, "unsettled": len(failures),
                                 "max_tight_gap": max(r["tight_gap"] for r in rows),
                                 "max_gap": max(r["gap"] for r in rows), "identical": sum(r["identical"] for r in rows),
                                 "prompts": len(rows), "rows": rows})
    assert not failures, "\n".join(failures)  # a list would be cut to 240 characters


def _tier(ref_model, prompt: list[int], base: dict, other: dict, end: int, tol: float, flip_range: float,
          prefill: int) -> tuple[float, int | None, list[tuple[str, bool, str]]]:
    """One tier of :func:`_close` over steps ``[0, end)``: ``tolerance_rule`` at ``tol``, every step that breaks it
    put to the reference (:func:`_reference_settles`; ``prefill``: the prompt tokens of the engine's batch). After
    a settled logprob gap the rule goes on from the next step (the tokens still agree); a token flip, settled or
    not, ends the comparison, as does an unsettled step.
    Returns (largest chosen-token gap seen, first step whose tokens differ or None, [(why, settled, how)])."""
    gap, start, broken = 0.0, 0, []
    while True:
        a = tolerance_rule(other["tokens"][start:end], other["logprobs"][start:end], base["tokens"][start:end],
                           base["logprobs"][start:end], tol)
        gap = max(gap, a.max_gap)
        first_diff = None if a.first_diff is None else start + a.first_diff
        if a.ok:
            return gap, first_diff, broken
        rel, rest = a.why.split(":", 1)
        step = start + int(rel.split()[1])
        why = f"step {step}:{rest}"
        settled, how = _reference_settles(ref_model, prompt, base, other, why, tol, flip_range, prefill)
        broken.append((why, settled, how))
        if not settled or first_diff is not None:
            return gap, first_diff, broken
        start = step + 1


def _reference_settles(ref_model, prompt: list[int], base: dict, other: dict, why: str, tol: float,
                       flip_range: float, prefill: int) -> tuple[bool, str]:
    """:func:`router_ties.settles` at the step where a tolerance rule broke (``why`` starts "step N:"): teacher
    forced on the tokens both engines share before N, the MAX_PROMPT_FLIPS near-ties below ``flip_range`` closest
    to step N tried one at a time, with the linears' inputs as they are and rounded to int8 per 32 and per 256 as
    the decode kernels may round them (a sample of that rounding: ``testing.activation_rounding``): at the generated
    positions, and in the prompt what an engine step of ``prefill`` tokens (the batch's prompts) rounds
    (``rounded_in_prefill``: the output head; the experts too up to 128 tokens; everything up to 16). Returns
    (settled, what the reference gave)."""
    step = int(why.split(":")[0].split()[1])
    return settles(ref_model, list(prompt) + list(base["tokens"][:step]), base["logprobs"][step],
                   base["tokens"][step], other["logprobs"][step], other["tokens"][step], tol, flip_range,
                   MAX_PROMPT_FLIPS, roundings=(None, *ACTIVATION_BLOCKS), rounded_from=len(prompt),
                   prefill_rounded=rounded_in_prefill(prefill))


def _reference_view(ref_model, prompt: list[int], base: list[int], other: list[int], why: str,
                    margins: torch.Tensor, moved: torch.Tensor) -> str:
    """What the fp32 reference says at the step a comparison rule broke (``why`` starts "step N:"), for the failure
    message: its logprobs of the baseline's and the other engine's tokens there (teacher forced on the baseline's
    tokens before N), the smallest router top-k margin over the generated steps up to N and where, and how far one
    prompt near-tie flip can move step N.  Reports, never decides: the rules above decide."""
    step = int(why.split(":")[0].split()[1])
    with torch.inference_mode():
        lp = torch.log_softmax(ref_model.forward(list(prompt) + list(base[:step]))[-1].float(), -1).cpu()
    k = int(margins[:step + 1].argmin())
    return (f"reference at step {step}: baseline's token {base[step]} {lp[base[step]]:.2f}, other's {other[step]} "
            f"{lp[other[step]]:.2f}, its top {int(lp.argmax())} {lp.max():.2f}; smallest router margin up to here "
            f"{float(margins[k]):.4f} at step {k}; a prompt near-tie moves this step by <= {float(moved[step]):.2f}")


def test_past_index_topk_determinism_and_gap(engines, results_dir, reference):
    """Eager run-to-run determinism at batch 1, 3 and 16 (bit-identical up to index_topk: the runner schedules
    every batch in one engine step, see ``vllm_runner``), and past index_topk the measured rerun gap and the gap
    to the fp32 reference, held to the top-5 rule (vLLM's indexer caches keys in FP8, so its top-k boundary can
    move between runs)."""
    first = vllm_run(engines, "eager-tp1")
    second = vllm_run(engines, "eager-tp1-rerun")
    rows, failures = [], []
    refs = iter(reference)
    for g in ("single", "batch3", "batch16"):
        for bi, (b1, b2) in enumerate(zip(first["groups"][g], second["groups"][g], strict=True)):
            for a1, a2 in zip(b1, b2, strict=True):
                rerun = top_k_rule(a2["tokens"], a2["logprobs"], a1["tokens"], a1["logprobs"])
                same = bit_identical(a2["tokens"], a2["logprobs"], a1["tokens"], a1["logprobs"])
                ident = same.ok
                row = {"group": g, "prompt_len": a1["prompt_len"], "rerun_identical": ident,
                       "rerun_first_diff": rerun.first_diff, "rerun_max_gap": round(rerun.max_gap, 4)}
                if g == "single":
                    r = next(refs)
                    ref = top_k_rule(a1["tokens"], a1["logprobs"], r["tokens"], r["logprobs"])
                    row.update(ref_first_diff=ref.first_diff, ref_max_gap=round(ref.max_gap, 4))
                rows.append(row)
                if a1["prompt_len"] <= 2048 and not ident:
                    failures.append(f"{g}[{bi}] prompt {a1['prompt_len']} (<= index_topk) is not reproducible "
                                    f"eager-to-eager: {same.why}")
                if not rerun.ok:  # the gap to the reference is reported here, asserted in test_eager_matches_reference
                    failures.append(f"{g}[{bi}] prompt {a1['prompt_len']}: eager rerun: {rerun.why}")
    _summary(results_dir, "determinism", {"rows": rows})
    assert not failures, "\n".join(failures)  # a list would be cut to 240 characters

"""``glm5serve bench MODEL``: decode speed and time to first token of vLLM serving a GLM-5 GGUF.

``MODEL`` is a GGUF or a header from ``glm5serve synthetic-gguf`` (with ``--load-format glm5-synthetic``: random
valid weights, real shapes and kernels). The workload is the original deployment's: ``--input-len`` 40 random
prompt tokens, ``--output-len`` 128 generated tokens (``ignore_eos``), at each ``--concurrency`` (one
``LLM.generate`` batch of that many requests; prefix caching off, so every prompt is prefilled). Per execution
mode (``eager``; ``graphs``: vLLM's default compilation, or CUDA graphs without torch.compile with
``--graphs-mode nocompile``; capture sizes are the concurrencies) one engine runs in its own process, since vLLM
does not free GPU memory when an engine goes away, with vLLM's engine core inside that process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set), so a batch's prefill is one step and every decode step holds
exactly ``concurrency`` requests. After a warm-up batch per concurrency:

- ``ttft_s``: wall time of a batch with ``max_tokens=1`` (prefill of all its prompts plus one sampled token), the
  median of ``--repeats``;
- ``e2e_s``: wall time of the full batch (median of ``--repeats``); the decode steps take ``e2e_s - ttft_s``, so
  ``step_ms = (e2e_s - ttft_s) / (output_len - 1)``, ``tok_s_per_request = 1000 / step_ms`` and
  ``tok_s_total = concurrency * tok_s_per_request`` (:func:`decode_stats`).

``--profile``: vLLM's torch profiler (``profiler_config`` and ``LLM.start_profile``/``stop_profile``, the same in
vLLM 0.25 and 0.33) over ``--profile-steps`` decode steps of each concurrency (started a few steps after the
prefill); TP rank 0's CUDA kernel time is grouped by kernel name (:func:`kernel_group`) into attention (MLA,
indexer, KV-cache writes, rotary), MoE (routed experts and routing), GEMM (every other linear layer: the shared
expert, dense MLPs, projections, MLA's absorbed ``bmm``), all-reduce and other, as µs per decode step and fractions.

``--projection RESULT.json ...`` (without MODEL): a linear projection (:func:`project`), printed and stored as a
projection, never as a measurement: step time to 78 layers from runs at two or more layer counts, and to TP=8 from TP=1
and TP=2.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from glm5serve.errors import GGUFModelError

DEFAULT_CONCURRENCY = (1, 8, 64, 256)
#: bench's --max-model-len unless the GGUF's context length is shorter (the tiny preset's is 512)
DEFAULT_MAX_MODEL_LEN = 1024
MODES = ("eager", "graphs")
#: worker steps between ``start_profile`` and the first profiled step: the prefill step and two decode steps
PROFILE_DELAY = 3

# -- arithmetic ------------------------------------------------------------------------------------------------


def decode_stats(concurrency: int, output_len: int, ttft_s: float, e2e_s: float) -> dict:
    """Decode speed of one batch from its two wall times (seconds): ``step_ms`` per decode step (ms),
    ``tok_s_per_request`` and ``tok_s_total`` (tokens/s). The first token comes with the prefill (``ttft_s``); the
    other ``output_len - 1`` tokens take one decode step each."""
    decode_s = e2e_s - ttft_s
    if output_len < 2 or decode_s <= 0:
        return {"step_ms": None, "tok_s_per_request": None, "tok_s_total": None}
    step_s = decode_s / (output_len - 1)
    return {"step_ms": 1000 * step_s, "tok_s_per_request": 1 / step_s, "tok_s_total": concurrency / step_s}


#: kernel-name patterns per group, first match wins (vLLM 0.25/0.33, vllm-gguf-plugin, glm5serve kernels)
KERNEL_GROUPS: tuple[tuple[str, re.Pattern], ...] = tuple((g, re.compile(p, re.I)) for g, p in (
    ("allreduce", r"nccl|all_?reduce|all_?gather|reduce_?scatter|cross_device|one_?shot|two_?shot|multimem|"
                  r"custom_?ar"),
    ("moe", r"moe|expert|grouped_(gate_up|down)|grouped_?topk|topk_?gating|topk_?sigmoid|topk_?softmax|noaux|"
            r"align_block|count_and_sort"),
    ("attention", r"mla|attn|attention|flash|fmha|sparse|indexer|mqa|top_?k_per_row|cache|rotary|rope"),
    ("gemm", r"gemm|gemv|matmul|mul_mat|cutlass|xmma|cublas|nvjet|wgmma|splitk|dequant"),
))


def kernel_group(name: str) -> str:
    """``attention``, ``moe``, ``gemm``, ``allreduce`` or ``other`` for a CUDA kernel name (:data:`KERNEL_GROUPS`)."""
    return next((g for g, pattern in KERNEL_GROUPS if pattern.search(name)), "other")


def kernel_breakdown(events: list[dict], n_steps: int | None = None, top: int = 12) -> dict:
    """Group a Chrome-trace (torch profiler) event list's GPU time by :func:`kernel_group`.

    The steps are counted from vLLM's per-step ``execute_context_N(..)_generation_M(..)`` annotations (else
    ``n_steps``); ``decode_only`` says whether every profiled step had no prefill (N = 0). Returns ``steps``,
    ``gpu_us_per_step``, per group ``us_per_step``, ``calls_per_step`` and ``fraction`` of the GPU time, and the
    ``top`` kernels by time. Raises ValueError when the trace holds no GPU kernel or no step count is known.
    """
    steps = [e["name"] for e in events if e.get("cat") == "user_annotation"
             and str(e.get("name", "")).startswith("execute_context_")]
    n = len(steps) or n_steps
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels or not n:
        raise ValueError(f"profile holds {len(kernels)} GPU kernels over {n} steps")
    total = sum(float(e.get("dur", 0)) for e in kernels)
    groups = {g: {"us": 0.0, "calls": 0} for g in ("attention", "moe", "gemm", "allreduce", "other")}
    by_name: dict[str, float] = {}
    for e in kernels:
        name, dur = str(e.get("name", "")), float(e.get("dur", 0))
        g = groups[kernel_group(name) if e["cat"] == "kernel" else "other"]
        g["us"] += dur
        g["calls"] += 1
        by_name[name] = by_name.get(name, 0.0) + dur
    return {
        "steps": n, "decode_only": bool(steps) and all(s.startswith("execute_context_0(") for s in steps),
        "gpu_us_per_step": total / n,
        "groups": {g: {"us_per_step": v["us"] / n, "calls_per_step": v["calls"] / n,
                       "fraction": v["us"] / total if total else 0.0} for g, v in groups.items()},
        "top": [{"name": k[:160], "group": kernel_group(k), "us_per_step": v / n}
                for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]],
    }


def load_trace(path) -> list[dict]:
    """The events of a torch profiler Chrome trace (``.json`` or ``.json.gz``)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


# -- projection -------------------------------------------------------------------------------------------------

def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(slope, intercept)`` of ``y = slope * x + intercept`` through >= 2 points with distinct x."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if len(points) < 2 or sxx == 0:
        raise ValueError("a line needs two different layer counts")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return slope, my - slope * mx


def _speed(step_ms: float, c: int) -> dict:
    return {"step_ms": step_ms, "tok_s_per_request": 1000 / step_ms if step_ms > 0 else None,
            "tok_s_total": 1000 * c / step_ms if step_ms > 0 else None}


def _step_value(r: dict, basis: str) -> float | None:
    """One result's step time in ms on ``basis``: ``step`` the measured wall time, ``gpu`` rank 0's profiled
    kernel time per decode step (``None`` where the run has no profile or its profile holds a prefill step)."""
    if basis == "step":
        return r.get("step_ms")
    profile = r.get("profile") or {}
    gpu = profile.get("gpu_us_per_step")
    return gpu / 1000 if gpu and profile.get("decode_only", True) else None


def project(records: list[dict], target_layers: int = 78, target_tp: int = 8, basis: str = "step") -> dict:
    """A linear projection of the decode step time from bench records (the JSON ``glm5serve bench`` writes).

    ``basis`` ``step`` fits the measured wall step times; ``gpu`` fits rank 0's profiled GPU kernel time per step
    (``profile.gpu_us_per_step``), which leaves out the host's share of a step (scheduling, the multiprocess
    executor's broadcast to the TP workers) and so its run-to-run noise: two engines of the same 4-layer slice at
    TP=2 on an H200 took 3.46 and 2.58 ms per batch-1 step, with 1.320 ms of GPU time in both (issue 9); the
    8-layer slice took 2.89 ms. It is not a bound either way: where the host keeps up it is within a few % of the
    wall step (above it at TP=1 on those slices: the profiler's own cost), and kernels that overlap on two streams
    are both counted, and a TP rank's all-reduce kernels include its wait for the other ranks (TP=2 at c=64: 9.16
    ms of GPU time in a 7.95 ms step). Use ``step`` where it projects; ``gpu`` where wall times are dominated by
    host noise (TP >= 2 at small batches), read as the GPU part of the step. Results without a decode-only profile
    are left out on this basis, and an entry that lacks points because of that says so.

    Layers: for each TP size, mode and concurrency, a least-squares line through (layers, step_ms) over the records'
    layer counts (>= 2 needed): the slope is the cost of one more MoE layer, the intercept the per-step cost of
    embedding, lm_head, sampling and the dense layers' difference; evaluated at ``target_layers``.
    TP: from the TP=1 and TP=2 projections ``t1``, ``t2`` at ``target_layers`` and the all-reduce time per call
    ``r`` (the mean over every TP=2 profile of that mode and concurrency) and calls per step ``n`` (the deepest
    profiled TP=2 slice's, plus 2 per further layer): the step time is split as
    ``t = a + w / tp + n r`` (``w``: the part that divides by TP, weight reads above all; ``a``: the part that does
    not, kernel launch latency and replicated work), so ``w = 2 (t1 - t2 + n r)``, ``a = t1 - w``, and
    ``t(target_tp) = a + w / target_tp + n r``, assuming an all-reduce over ``target_tp`` GPUs costs what one over
    2 cost and ``n`` grows by 2 per layer. Returns a dict labelled ``"projection"``; entries that lack data say why.
    Where the data give a negative per-layer time, a negative ``a`` or ``w`` (TP=2 more than twice as fast as TP=1,
    as the MoE is at 64+ tokens on an H200, or noise) or a projected step time <= 0, that entry is not projected and
    says why, like an entry that lacks data. The result does not depend on the order of ``records``.
    """
    if basis not in ("step", "gpu"):
        raise ValueError(f"basis is 'step' or 'gpu', not {basis!r}")
    out = {"label": "projection (not a measurement)", "basis": basis, "target_layers": target_layers,
           "target_tp": target_tp, "layers": {}, "tp": {}}
    series: dict[tuple[int, str, int], list[tuple[int, float]]] = {}
    unprofiled: dict[tuple[int, str, int], list[int]] = {}  # gpu basis: results with a step time but no profile
    # (mode, c) -> [(us per call, calls per step, layers)] over every TP=2 profile, combined below independently of
    # the order of the records
    ar: dict[tuple[str, int], list[tuple[float, float, int]]] = {}
    for rec in records:
        for run in rec["runs"]:
            for r in run["results"]:
                key = (rec["tp"], run["mode"], r["concurrency"])
                if step := _step_value(r, basis):
                    series.setdefault(key, []).append((rec["layers"], step))
                elif r.get("step_ms"):
                    unprofiled.setdefault(key, []).append(rec["layers"])
                g = ((r.get("profile") or {}).get("groups") or {}).get("allreduce")
                if rec["tp"] == 2 and g and g["calls_per_step"]:
                    ar.setdefault((run["mode"], r["concurrency"]), []).append(
                        (g["us_per_step"] / g["calls_per_step"], g["calls_per_step"], rec["layers"]))
    at_target: dict[tuple[int, str, int], float] = {}
    for (tp, mode, c) in sorted(series.keys() | unprofiled.keys()):
        pts = series.get((tp, mode, c), [])
        entry = out["layers"].setdefault(f"tp{tp}", {}).setdefault(mode, {})
        layer_counts = sorted({x for x, _ in pts})
        if len(layer_counts) < 2:
            left = unprofiled.get((tp, mode, c))
            entry[str(c)] = {"points": pts, "missing": "needs runs at two or more layer counts" + (
                f" (left out on the gpu basis, without a decode-only profile: layers {sorted(left)})" if left else "")}
            continue
        slope, intercept = fit_line(pts)
        step = slope * target_layers + intercept
        if slope < 0 or step <= 0:
            entry[str(c)] = {"points": pts, "missing": f"not projected: the line through (layers, step ms) "
                             f"{sorted(pts)} gives {slope:.3f} ms/layer and {step:.2f} ms at {target_layers} layers "
                             "(step times must grow with the layers)"}
            continue
        at_target[(tp, mode, c)] = step
        entry[str(c)] = {"points": pts, "ms_per_layer": slope, "intercept_ms": intercept, **_speed(step, c)}
    for mode, c in sorted({(m, c) for (tp, m, c) in series.keys() | unprofiled.keys() if tp in (1, 2)}):
        entry = out["tp"].setdefault(mode, {})
        t1, t2 = at_target.get((1, mode, c)), at_target.get((2, mode, c))
        lacking = [f"TP={tp} at {target_layers} layers (see its line)" for tp, t in ((1, t1), (2, t2)) if t is None]
        if (mode, c) not in ar:
            lacking.append("a TP=2 profile (the all-reduce cost)")
        if lacking:
            entry[str(c)] = {"missing": "needs " + " and ".join(lacking)}
            continue
        # the per-call cost averaged over the TP=2 profiles; the calls per step from the deepest slice's
        deepest = max(x[2] for x in ar[(mode, c)])
        per_call_us = statistics.fmean(x[0] for x in ar[(mode, c)])
        n = statistics.fmean(x[1] for x in ar[(mode, c)] if x[2] == deepest) + 2 * (target_layers - deepest)
        r_ms = n * per_call_us / 1000
        w = 2 * (t1 - t2 + r_ms)
        a = t1 - w
        step = a + w / target_tp + r_ms
        if a < 0 or w < 0 or step <= 0:
            why = ("TP=2 is more than twice as fast as TP=1, which the split cannot represent" if a < 0 else
                   "TP=2 is slower than TP=1 plus its all-reduces" if w < 0 else f"{step:.2f} ms at TP={target_tp}")
            entry[str(c)] = {"missing": f"not projected: TP=1 {t1:.2f} ms and TP=2 {t2:.2f} ms per step at "
                             f"{target_layers} layers give a {a:.2f} ms (not divided by TP) and w {w:.2f} ms "
                             f"(divided): {why}"}
            continue
        entry[str(c)] = {"tp1_ms": t1, "tp2_ms": t2, "allreduce_us_per_call": per_call_us, "allreduce_calls": n,
                         "a_ms": a, "w_ms": w, **_speed(step, c)}
    return out


# -- running vLLM -------------------------------------------------------------------------------------------------

def engine_args(model: str, mode: str, concurrency: list[int], *, tp: int = 1, load_format: str = "auto",
                graphs_mode: str = "default", max_model_len: int = 1024, input_len: int = 40,
                gpu_memory_utilization: float = 0.85, attention_backend: str | None = None,
                profile_dir: str | None = None, profile_steps: int = 8) -> dict:
    """``vllm.LLM`` keyword arguments for one mode: bf16, prefix caching off, ``max_num_seqs`` the largest
    concurrency and a token budget that prefills the largest batch in one step; ``graphs`` captures exactly the
    concurrencies (``graphs_mode`` ``default``: vLLM's default compilation; ``nocompile``: ``{"mode": 0,
    "cudagraph_mode": "FULL_DECODE_ONLY"}``); ``profile_dir`` enables vLLM's torch profiler for
    ``profile_steps`` steps starting :data:`PROFILE_DELAY` steps after ``start_profile``."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r} (expected one of {', '.join(MODES)})")
    kw: dict = {"model": model, "tensor_parallel_size": tp, "dtype": "bfloat16", "seed": 0,
                "max_model_len": max_model_len, "gpu_memory_utilization": gpu_memory_utilization,
                "max_num_seqs": max(concurrency), "enable_prefix_caching": False,
                "max_num_batched_tokens": max(max_model_len, 2048, max(concurrency) * input_len)}
    if load_format != "auto":
        kw["load_format"] = load_format
    if attention_backend:
        kw["attention_backend"] = attention_backend
    if mode == "eager":
        kw["enforce_eager"] = True
    else:
        cc: dict = {"cudagraph_capture_sizes": sorted(set(concurrency))}
        if graphs_mode == "nocompile":
            cc.update({"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})
        kw.update(enforce_eager=False, compilation_config=cc)
    if profile_dir:
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": str(profile_dir),
                                 "torch_profiler_with_stack": False, "torch_profiler_dump_cuda_time_total": False,
                                 "ignore_frontend": True, "delay_iterations": PROFILE_DELAY,
                                 "max_iterations": profile_steps}
    return kw


def run_engine(spec: dict, progress: Callable[[dict], None] | None = None) -> dict:
    """One engine (``spec["engine"]``: :func:`engine_args`) through the whole workload; the worker process's job.

    Returns ``init_s``, ``vllm``, ``gpu`` and per concurrency the raw ``ttft_s``/``e2e_s`` (median of
    ``spec["repeats"]``), ``short`` (requests that returned fewer than ``output_len`` tokens) and ``profile``.
    ``progress`` gets the record so far after every concurrency and every profile (the worker writes it out, so a
    run cut short by a timeout keeps what it measured).
    """
    import numpy as np
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**spec["engine"])
    init_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    input_len, output_len, vocab = spec["input_len"], spec["output_len"], spec["vocab_size"]

    def batch(c: int, max_tokens: int) -> tuple[float, list]:
        prompts = [{"prompt_token_ids": rng.integers(0, vocab, input_len).tolist()} for _ in range(c)]
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t, outs

    results = []
    record = {"vllm": vllm.__version__,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "engine_core_process": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0", "init_s": init_s,
              "results": results}
    report = progress or (lambda rec: None)
    for c in spec["concurrency"]:
        batch(c, 8)  # warm-up: Triton JIT, allocator, graphs of this size
        ttft = statistics.median(batch(c, 1)[0] for _ in range(spec["repeats"]))
        runs = [batch(c, output_len) for _ in range(spec["repeats"])]
        short = sum(len(o.outputs[0].token_ids) < output_len for _, outs in runs for o in outs)
        results.append({"concurrency": c, "ttft_s": ttft, "e2e_s": statistics.median(t for t, _ in runs),
                        "short": short})
        report(record)
    trace_dir = (spec["engine"].get("profiler_config") or {}).get("torch_profiler_dir")
    if trace_dir:
        for r in results:
            before = set(Path(trace_dir).glob("*.json*"))
            llm.start_profile()
            batch(r["concurrency"], PROFILE_DELAY + spec["profile_steps"] + 4)
            llm.stop_profile()
            new = sorted(set(Path(trace_dir).glob("*.json*")) - before)
            rank0 = [p for p in new if "tp0" in p.name] or new
            try:
                if not rank0:
                    raise ValueError(f"no new trace file in {trace_dir}")
                r["profile"] = {"trace": rank0[0].name, **kernel_breakdown(load_trace(rank0[0]))}
            except (ValueError, KeyError, OSError) as e:
                r["profile"] = {"error": str(e)}
            report(record)
    return record


def run_in_subprocess(spec: dict, workdir: Path, name: str, timeout: float) -> dict:
    """:func:`run_engine` in a fresh ``python -m glm5serve.bench --worker`` process; its log is ``{name}.log`` in
    ``workdir``. A worker that fails or runs out of ``timeout`` after measuring some concurrencies gives those, with
    ``error`` saying why the rest is missing; one that measured nothing raises RuntimeError with the log's tail."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec_file, out, log = (workdir / f"{name}.{ext}" for ext in ("spec.json", "out.json", "log"))
    spec_file.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    out.unlink(missing_ok=True)
    with open(log, "w") as f:
        try:
            rc = subprocess.run([sys.executable, "-m", "glm5serve.bench", "--worker", str(spec_file), str(out)],
                                stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
            why = f"exit status {rc}"
        except subprocess.TimeoutExpired:
            rc, why = -1, f"timed out after {timeout:g} s"
    partial = json.loads(out.read_text()) if out.is_file() else None
    if rc != 0:
        if partial and partial.get("results"):
            return {**partial, "error": f"vLLM ({name}) {why}; measured up to concurrency "
                                        f"{partial['results'][-1]['concurrency']}, log {log}"}
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-6:])
        raise RuntimeError(f"vLLM ({name}) failed with {why}, log {log}: {tail}")
    return partial


def model_info(model: str) -> dict:
    """What the record says about the model: layers, vocabulary, TP-relevant dims, synthetic or not."""
    from glm5serve.config import config_from_metadata
    from glm5serve.gguf_file import GGUFModel
    from glm5serve.synthetic import is_synthetic

    gguf = GGUFModel(model)
    cfg = config_from_metadata(gguf)
    return {"layers": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "n_routed_experts": cfg.n_routed_experts, "synthetic": is_synthetic(gguf),
            "gguf_gb": sum(t.n_bytes for t in gguf) / 1e9}


#: the largest --target-layers a projection takes (GLM-5 has 78; a count past float's range overflowed)
MAX_TARGET_LAYERS = 100_000


def _kernels() -> str:
    """``$GLM5SERVE_GGUF_KERNELS`` as the plugin reads it (GGUFModelError for a value it does not take)."""
    from glm5serve.vllm_plugin import gguf_kernels

    try:
        return gguf_kernels()
    except ValueError as e:
        raise GGUFModelError(str(e)) from None


def bench(model: str, *, modes=MODES, concurrency=DEFAULT_CONCURRENCY, tp: int = 1, load_format: str = "auto",
          graphs_mode: str = "default", input_len: int = 40, output_len: int = 128, max_model_len: int = 1024,
          repeats: int = 2, gpu_memory_utilization: float = 0.85, attention_backend: str | None = None,
          profile: bool = False, profile_steps: int = 8, workdir=None, timeout: float = 1800,
          runner: Callable[[dict, Path, str, float], dict] = run_in_subprocess, info: dict | None = None,
          progress: Callable[[dict], None] | None = None) -> dict:
    """Run the workload for every mode (one engine process each, through ``runner``) and return the record
    (also handed to ``progress`` after each mode).

    Record: the settings, ``model_info`` (``info`` overrides it), and ``runs``: per mode ``init_s``, ``vllm``, ``gpu``
    and ``results`` per concurrency (raw times, :func:`decode_stats`, ``profile``). A mode whose engine fails is
    recorded with its ``error``; the others still run.
    """
    import tempfile

    info = info or model_info(model)
    concurrency = sorted(set(concurrency))
    workdir = Path(workdir or tempfile.mkdtemp(prefix="glm5serve-bench-"))
    record = {"model": str(model), "load_format": load_format, "tp": tp, "graphs_mode": graphs_mode,
              "input_len": input_len, "output_len": output_len, "max_model_len": max_model_len, "repeats": repeats,
              "attention_backend": attention_backend, "kernels": _kernels(),
              **info, "runs": []}
    for mode in modes:
        profile_dir = workdir / f"traces-{mode}" if profile else None
        spec = {"engine": engine_args(str(model), mode, concurrency, tp=tp, load_format=load_format,
                                      graphs_mode=graphs_mode, max_model_len=max_model_len, input_len=input_len,
                                      gpu_memory_utilization=gpu_memory_utilization,
                                      attention_backend=attention_backend,
                                      profile_dir=str(profile_dir) if profile_dir else None,
                                      profile_steps=profile_steps),
                "concurrency": concurrency, "input_len": input_len, "output_len": output_len,
                "vocab_size": info["vocab_size"], "repeats": repeats, "profile_steps": profile_steps}
        try:
            run = runner(spec, workdir, f"{mode}-tp{tp}", timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            record["runs"].append({"mode": mode, "error": str(e), "results": []})
            continue
        for r in run["results"]:
            r.update(decode_stats(r["concurrency"], output_len, r["ttft_s"], r["e2e_s"]))
        record["runs"].append({"mode": mode, **run})
        if progress:
            progress(record)
    return record


# -- output -------------------------------------------------------------------------------------------------------

def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_record(rec: dict) -> str:
    """The measurement table (and profile breakdowns) of a bench record, as text."""
    lines = [f"{rec['model']} ({rec['layers']} layers{', synthetic weights' if rec.get('synthetic') else ''}), "
             f"load format {rec['load_format']}, TP={rec['tp']}, input {rec['input_len']} / output "
             f"{rec['output_len']} tokens"]
    for run in rec["runs"]:
        if "error" in run:
            lines.append(f"  {run['mode']}: FAILED: {run['error']}")
            continue
        lines.append(f"  {run['mode']} (vLLM {run.get('vllm')}, {run.get('gpu')}, engine start "
                     f"{_f(run.get('init_s'), '.0f')} s)")
        lines.append(f"    {'conc':>5} {'TTFT ms':>9} {'step ms':>8} {'tok/s/req':>10} {'tok/s total':>12}")
        for r in run["results"]:
            lines.append(f"    {r['concurrency']:>5} {_f(1000 * r['ttft_s'], '9.1f')} {_f(r['step_ms'], '8.2f')} "
                         f"{_f(r['tok_s_per_request'], '10.1f')} {_f(r['tok_s_total'], '12.1f')}"
                         + (f"  ({r['short']} requests short)" if r.get("short") else ""))
        for r in run["results"]:
            p = r.get("profile")
            if not p:
                continue
            if "error" in p:
                lines.append(f"    profile c={r['concurrency']}: {p['error']}")
                continue
            parts = ", ".join(f"{g} {v['us_per_step']:.0f} µs ({100 * v['fraction']:.0f}%)"
                              for g, v in p["groups"].items())
            lines.append(f"    profile c={r['concurrency']}: GPU {p['gpu_us_per_step']:.0f} µs/step over "
                         f"{p['steps']} steps{'' if p['decode_only'] else ' (not all decode)'}: {parts}")
    return "\n".join(lines)


def format_projection(proj: dict) -> str:
    """The projection as text, every line marked as a projection."""
    what = {"step": "wall step time",
            "gpu": "rank 0's GPU kernel time per step (no host overhead; not a bound on the wall step)"}
    lines = [f"PROJECTION (not a measurement) to {proj['target_layers']} layers and TP={proj['target_tp']}, "
             f"from {what[proj.get('basis', 'step')]}:"]
    for tp, modes in proj["layers"].items():
        for mode, cs in modes.items():
            for c, e in cs.items():
                lines.append(f"  projection {tp} {mode} c={c}: " + (e["missing"] if "missing" in e else
                             f"{e['ms_per_layer']:.3f} ms/layer {e['intercept_ms']:+.2f} ms -> "
                             f"{e['step_ms']:.2f} ms/step, {e['tok_s_per_request']:.1f} tok/s/req, "
                             f"{e['tok_s_total']:.0f} tok/s total"))
    for mode, cs in proj["tp"].items():
        for c, e in cs.items():
            lines.append(f"  projection tp{proj['target_tp']} {mode} c={c}: " + (e["missing"] if "missing" in e else
                         f"{e['step_ms']:.2f} ms/step, {e['tok_s_per_request']:.1f} tok/s/req, "
                         f"{e['tok_s_total']:.0f} tok/s total (a {e['a_ms']:.2f} ms + w {e['w_ms']:.2f} ms / "
                         f"{proj['target_tp']} + {e['allreduce_calls']:.0f} all-reduces x "
                         f"{e['allreduce_us_per_call']:.1f} µs)"))
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:  # an empty entry ("1,,2") too: a typo, not a request for fewer values
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}") from None
    if min(values) < 1 or len(set(values)) < len(values):
        raise argparse.ArgumentTypeError(f"expected distinct positive integers, not {text!r}")
    return values


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",")]
    if set(modes) - set(MODES) or len(set(modes)) < len(modes):
        raise argparse.ArgumentTypeError(f"modes are {', '.join(MODES)}, each at most once, not {text!r}")
    return modes


def add_parser(subparsers) -> None:
    """Register ``bench`` with the ``glm5serve`` argparse sub-commands."""
    p = subparsers.add_parser("bench", help="decode tok/s and TTFT of vLLM serving a GLM-5 GGUF (or a synthetic "
                              "header with --load-format glm5-synthetic); --projection to 78 layers / TP=8",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="GGUF file (shard 1 of a split set), or a synthetic-gguf header")
    p.add_argument("--load-format", default="auto", choices=("auto", "gguf", "glm5-synthetic"),
                   help="vLLM load format: auto or gguf (the GGUF's data; default auto) or glm5-synthetic (random "
                        "valid weights made on the GPUs)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--concurrency", type=_ints, default=list(DEFAULT_CONCURRENCY),
                   help="concurrent requests per measurement, comma-separated (default 1,8,64,256)")
    p.add_argument("--input-len", type=int, default=40, help="prompt tokens per request (default 40)")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request (default 128)")
    p.add_argument("--modes", type=_modes, default=list(MODES), help="eager,graphs (default both)")
    p.add_argument("--graphs-mode", choices=("default", "nocompile"), default="default",
                   help="graphs: vLLM's default compilation, or CUDA graphs without torch.compile")
    p.add_argument("--max-model-len", type=int, help=f"vLLM --max-model-len (default {DEFAULT_MAX_MODEL_LEN}, or "
                   "the GGUF's context_length if shorter)")
    p.add_argument("--repeats", type=int, default=2, help="timed batches per measurement, median taken (default 2)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                   help="vLLM --gpu-memory-utilization (default 0.85)")
    p.add_argument("--attention-backend", help="vLLM --attention-backend (e.g. CUSTOM: glm5serve's Triton MLA)")
    p.add_argument("--profile", action="store_true", help="per-step kernel-time breakdown (torch profiler)")
    p.add_argument("--profile-steps", type=int, default=8, help="decode steps in each --profile trace (default 8)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per engine process (default 1800)")
    p.add_argument("--workdir", help="engine logs, specs and traces (default: a temporary folder)")
    p.add_argument("--json", help="write the record (or the projection) here")
    p.add_argument("--projection", nargs="+", metavar="RESULT.json",
                   help="instead of running (no MODEL): project bench records to --target-layers at --target-tp")
    p.add_argument("--target-layers", type=int, default=78, help="layers to project to (default 78: GLM-5)")
    p.add_argument("--target-tp", type=int, default=8, help="TP size to project to, >= 3 (default 8)")
    p.add_argument("--basis", choices=("step", "gpu"), default="step",
                   help="project the wall step time (default) or the profiled GPU kernel time per step (--profile "
                        "runs; leaves out host overhead and its noise)")
    p.set_defaults(func=_run)


def _read_record(path) -> dict:
    """A bench record from ``path`` (what ``glm5serve bench --json`` writes), with every field the projection reads
    checked for its type (counts are integers >= 1, not booleans; times are finite: ``json`` reads NaN and
    Infinity); GGUFModelError naming the file and the field otherwise."""
    try:
        rec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise GGUFModelError(f"cannot read a bench record: {e}", file=str(path)) from None

    def need(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise GGUFModelError(f"not a glm5serve bench record: {field} must be {what}", file=str(path))

    def count(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    need(isinstance(rec, dict), "the top level", "an object")
    for key in ("tp", "layers"):
        need(count(rec.get(key)), key, "an integer >= 1")
    need(isinstance(rec.get("runs"), list), "runs", "a list")
    for i, run in enumerate(rec["runs"]):
        need(isinstance(run, dict), f"runs[{i}]", "an object")
        need(isinstance(run.get("mode"), str), f"runs[{i}].mode", "a string")
        need(isinstance(run.get("results"), list), f"runs[{i}].results", "a list")
        for j, r in enumerate(run["results"]):
            at = f"runs[{i}].results[{j}]"
            need(isinstance(r, dict), at, "an object")
            need(count(r.get("concurrency")), f"{at}.concurrency", "an integer >= 1")
            # bounded (a step of 1e9 ms is 11 days): 1e300 ms passed and overflowed the projection's fits
            need(r.get("step_ms") is None or (number(r["step_ms"]) and 0 < r["step_ms"] <= 1e9), f"{at}.step_ms",
                 "a number in (0, 1e9] ms or null")
            profile = r.get("profile")
            need(profile is None or isinstance(profile, dict), f"{at}.profile", "an object or null")
            gpu = (profile or {}).get("gpu_us_per_step")
            need(gpu is None or (number(gpu) and 0 < gpu <= 1e12), f"{at}.profile.gpu_us_per_step",
                 "a number in (0, 1e12] us or null")
            decode_only = (profile or {}).get("decode_only")
            need(decode_only is None or isinstance(decode_only, bool), f"{at}.profile.decode_only", "true or false")
            groups = (profile or {}).get("groups")
            need(groups is None or isinstance(groups, dict), f"{at}.profile.groups", "an object")
            ar = (groups or {}).get("allreduce")
            need(ar is None or isinstance(ar, dict), f"{at}.profile.groups.allreduce", "an object")
            for key in ("us_per_step", "calls_per_step") if ar is not None else ():
                need(number(ar.get(key)), f"{at}.profile.groups.allreduce.{key}", "a finite number >= 0")
    return rec


#: settings and model facts that every record of one projection must share (where both records state them)
_SHARED = ("input_len", "output_len", "max_model_len", "graphs_mode", "load_format", "attention_backend", "kernels",
           "hidden_size", "n_routed_experts", "vocab_size", "synthetic")


def _check_together(paths: list, records: list[dict]) -> None:
    """Refuse, in one line naming the file, a projection's records that do not belong together: a record listed
    twice (it would count twice in the fits; by any name: a link or a copy holds the same record), records of
    another workload, model or GPU (a field of :data:`_SHARED` or a run's ``gpu`` that differs from the first record
    stating it), or records that together hold no step time (one without results beside others that have them is
    taken: it adds no point to the fits)."""
    seen: dict[str, str] = {}
    for path, rec in zip(paths, records):
        same = json.dumps(rec, sort_keys=True)  # the record, not the path: a link or a copy is the same file here
        if same in seen:
            raise GGUFModelError(f"listed twice (also as {seen[same]}): it would count twice in the fits",
                                 file=str(path))
        seen[same] = str(path)
    first: dict[str, tuple] = {}
    for path, rec in zip(paths, records):
        facts = {k: rec[k] for k in _SHARED if k in rec}
        facts |= {"gpu": run["gpu"] for run in rec["runs"] if run.get("gpu")}
        for key, value in facts.items():
            other, where = first.setdefault(key, (value, path))
            if value != other:
                raise GGUFModelError(f"{key} {value!r} differs from {other!r} in {where}: records of another "
                                     "workload, model or GPU do not belong in one projection", file=str(path))
    if not any(r.get("step_ms") for rec in records for run in rec["runs"] for r in run["results"]):
        raise GGUFModelError("no step time in any of the records: nothing to project", file=str(paths[0]))


def _check_runnable(args) -> int:
    """Refuse up front what would only fail inside vLLM: what ``serve`` refuses before it starts vLLM (a file
    ``verify --tp`` rejects, a synthetic header without ``--load-format glm5-synthetic``, real weights with it, a
    ``--max-model-len`` above the GGUF's context length: :func:`glm5serve.vllm_plugin.serve.preflight`), a default
    max model length too short for ``--input-len + --output-len``, and no CUDA GPU (or fewer than ``--tp``).

    Returns the max model length to run: ``--max-model-len``, else :data:`DEFAULT_MAX_MODEL_LEN` or the GGUF's
    context length if shorter."""
    from glm5serve.vllm_plugin import require_gpus
    from glm5serve.vllm_plugin.serve import preflight

    # bench sends token ids, no chat
    _, cfg = preflight(args.model, args.tp, args.load_format, chat_template=False, max_model_len=args.max_model_len)
    max_model_len = args.max_model_len or min(DEFAULT_MAX_MODEL_LEN, cfg.max_position_embeddings)
    if args.input_len + args.output_len > max_model_len:  # a given --max-model-len was checked already
        raise GGUFModelError(f"--input-len + --output-len ({args.input_len + args.output_len}) must be <= "
                             f"{max_model_len}, the default --max-model-len (the smaller of {DEFAULT_MAX_MODEL_LEN} "
                             f"and the GGUF's context_length {cfg.max_position_embeddings})", file=str(args.model))
    require_gpus(args.tp)
    return max_model_len


def _write_json(path, rec: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(rec, indent=1))


def _same_file(a, b) -> bool:
    """Whether paths ``a`` and ``b`` name one file: the same inode (a hard link or a symlink to it, as
    ``os.path.samefile``), or, where one does not exist yet, the same resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return Path(a).resolve() == Path(b).resolve()


def _check_json(path, model) -> None:
    """Refuse, before any engine starts, a ``--json`` the record is written to only after the first engine's minutes:
    one that names ``model`` or one of its shards (by any name: the record overwrote the GGUF), a folder, or a path
    below a file (GGUFModelError naming it)."""
    from glm5serve.gguf_file import split_paths

    p = Path(path)
    if any(_same_file(p, f) for f in split_paths(model)):
        raise GGUFModelError("--json names the model being measured: the record would overwrite it", file=str(p))
    if p.is_dir():
        raise GGUFModelError("--json names a folder: the record is written to a file", file=str(p))
    if above := next((q for q in p.parents if q.exists() and not q.is_dir()), None):
        raise GGUFModelError(f"--json: {above} is not a folder, so the record cannot be written there", file=str(p))


def _run(args) -> int:
    if args.projection:
        if args.model is not None:  # it was ignored without a word: the projection printed as if MODEL were measured
            raise GGUFModelError("--projection runs nothing, so this MODEL would not be measured: leave it out to "
                                 "project the records, or leave out --projection to measure it", file=str(args.model))
        if args.target_layers < 1:
            raise GGUFModelError("--target-layers must be >= 1")
        if args.target_layers > MAX_TARGET_LAYERS:  # a count past float's range overflowed in the projection
            raise GGUFModelError(f"--target-layers must be <= {MAX_TARGET_LAYERS}, not {args.target_layers}")
        if args.target_tp < 3:  # TP=1 and TP=2 are what the projection is made from: their lines are printed anyway
            raise GGUFModelError(f"--target-tp must be >= 3 (TP=1 and TP=2 are measured, not projected), "
                                 f"not {args.target_tp}")
        if args.json and any(_same_file(args.json, f) for f in args.projection):
            raise GGUFModelError(f"--json {args.json} is one of the records to project: it would be overwritten")
        records = [_read_record(f) for f in args.projection]
        _check_together(args.projection, records)
        out = project(records, args.target_layers, args.target_tp, args.basis)
        print(format_projection(out))
    else:
        if args.model is None:
            raise GGUFModelError("bench needs a MODEL (or --projection RESULT.json ...)")
        for name, value, least in (("--output-len", args.output_len, 2), ("--input-len", args.input_len, 1),
                                   ("--tp", args.tp, 1), ("--repeats", args.repeats, 1),
                                   ("--profile-steps", args.profile_steps, 1),
                                   ("--max-model-len", args.max_model_len, args.input_len + args.output_len)):
            if value is not None and value < least:  # --max-model-len None: the default, checked once the GGUF is read
                raise GGUFModelError(f"{name} must be >= {least}, not {value}"
                                     + (" (--input-len + --output-len)" if name == "--max-model-len" else ""))
        if not 0 < args.gpu_memory_utilization <= 1:
            raise GGUFModelError(f"--gpu-memory-utilization must be in (0, 1], not {args.gpu_memory_utilization}")
        if not 0 < args.timeout < math.inf:
            raise GGUFModelError(f"--timeout must be a positive number of seconds, not {args.timeout}")
        args.max_model_len = _check_runnable(args)
        if args.json:
            _check_json(args.json, args.model)
        out = bench(args.model, modes=args.modes, concurrency=args.concurrency, tp=args.tp,
                    load_format=args.load_format, graphs_mode=args.graphs_mode, input_len=args.input_len,
                    output_len=args.output_len, max_model_len=args.max_model_len, repeats=args.repeats,
                    gpu_memory_utilization=args.gpu_memory_utilization, attention_backend=args.attention_backend,
                    profile=args.profile, profile_steps=args.profile_steps, workdir=args.workdir,
                    timeout=args.timeout, progress=lambda rec: _write_json(args.json, rec) if args.json else None)
        print(format_record(out))
    if args.json:
        _write_json(args.json, out)
    return 0 if args.projection or all("error" not in r for r in out["runs"]) else 1


def main(argv: list[str] | None = None) -> int:
    """``python -m glm5serve.bench --worker SPEC.json OUT.json``: one engine (:func:`run_engine`)."""
    ap = argparse.ArgumentParser(prog="python -m glm5serve.bench")
    ap.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), required=True)
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # the engine core in this process: LLM.generate adds a whole batch before the first step, so the prefill is one
    # step and every decode step holds exactly `concurrency` requests (with the core in its own process, vLLM's
    # default, it starts stepping when the first request arrives; =1 restores that)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    out = Path(a.worker[1])

    def write(rec: dict) -> None:  # whole file each time, renamed into place: never half-written
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        tmp.replace(out)

    write(run_engine(json.loads(Path(a.worker[0]).read_text()), progress=write))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run one vLLM engine configuration on a GGUF and record greedy tokens with their top-k logprobs.

vLLM does not free all GPU memory when an ``LLM`` goes away, so every configuration runs in its own process::

    python -m glm5serve.testing.vllm_runner --model M.gguf --batches B.json --out R.json --mode eager --tp 1

``B.json`` is a list of batches, each a list of prompts (token-id lists); every batch is one ``LLM.generate`` call,
so its size is the decode batch size. ``R.json`` mirrors it: per prompt the generated ``tokens`` and, per step,
``logprobs`` as ``{token_id: logprob}`` (the chosen token plus the top-k). Works with vLLM 0.25 and 0.33.

``--capture-layers N`` also records, for every prompt of ``B.json``, the residual stream after decoder layers
``0..N-1`` of its prefill (:mod:`glm5serve.testing.layer_capture`), saved as ``R.layers.pt`` next to ``R.json``: a
list, in prompt order, of (N, prompt_len, hidden_size) fp32 tensors.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

#: engine settings per mode. ``graphs``: CUDA graphs for uniform decode batches without torch.compile, so
#: capture/replay is tested apart from compilation; ``default``: vLLM's default (torch.compile + graphs).
MODES: dict[str, dict] = {
    "eager": {"enforce_eager": True},
    "graphs": {"enforce_eager": False, "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}},
    "default": {"enforce_eager": False},
}


def run(model: str, batches: list[list[list[int]]], *, mode: str = "eager", tp: int = 1, max_tokens: int = 32,
        logprobs: int = 5, max_model_len: int = 4096, gpu_memory_utilization: float = 0.4,
        score: list[tuple[list[int], list[int]]] = (), attention_backend: str | None = None,
        capture_layers: int = 0) -> dict:
    """Generate greedily (``ignore_eos``) for every batch; returns the JSON-able record described above.

    ``attention_backend``: vLLM's ``--attention-backend`` (e.g. ``CUSTOM``: glm5serve's Triton MLA); None lets
    vLLM (and glm5serve's automatic choice) pick.

    ``score`` holds ``(prompt, continuation)`` token-id pairs: for each, ``scores`` gets the logprob (nats) vLLM
    gives every continuation token after the prompt (``prompt_logprobs=0`` over prompt + continuation).

    ``capture_layers`` N > 0: afterwards every prompt of ``batches`` is prefilled once more on its own and the
    residual stream after its first N decoder layers recorded (:func:`capture_prefill_states`); the record gets
    ``layer_states``, a list of (N, T, H) fp32 CPU tensors in prompt order (not JSON: :func:`main` saves it apart).
    """
    # The engine core in this process: ``LLM.generate`` then adds every request of a batch before the first step,
    # so a batch is scheduled the same way in every run. With the core in its own process (vLLM's default) it
    # starts stepping as soon as the first request arrives, the first steps' batch composition depends on timing,
    # and vLLM is not batch-invariant: measured on the H200, eager reruns differed on 8 of 16 prompts at batch 16.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if capture_layers:  # apply_model ships the capture functions to TP worker processes pickled
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(model=model, tensor_parallel_size=tp, dtype="bfloat16", seed=0, max_model_len=max_model_len,
              gpu_memory_utilization=gpu_memory_utilization, **MODES[mode],
              **({"attention_backend": attention_backend} if attention_backend else {}))
    t_init = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)
    out_batches = []
    t0 = time.time()
    for batch in batches:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in batch], sp, use_tqdm=False)
        out_batches.append([{
            "prompt_len": len(o.prompt_token_ids),
            "tokens": list(o.outputs[0].token_ids),
            "logprobs": [{str(t): float(lp.logprob) for t, lp in step.items()} for step in o.outputs[0].logprobs],
        } for o in outs])
    t_gen = time.time() - t0
    scores = []
    if score:
        sp1 = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": list(p) + list(c)} for p, c in score], sp1, use_tqdm=False)
        for (p, c), o in zip(score, outs):
            full = list(p) + list(c)
            scores.append([float(o.prompt_logprobs[i][full[i]].logprob) for i in range(len(p), len(full))])
    import vllm

    gguf_kernels = gguf_kernels_in_use()
    rec = {"vllm": vllm.__version__, "mode": mode, "tp": tp, "attention_backend": attention_backend or "auto",
           "gguf_kernels": gguf_kernels,
           "init_s": round(t_init, 1), "generate_s": round(t_gen, 2), "batches": out_batches, "scores": scores}
    if capture_layers:
        rec["capture_layers"] = capture_layers
        rec["layer_states"] = capture_prefill_states(llm, [p for b in batches for p in b], capture_layers)
    return rec


def capture_prefill_states(llm, prompts: list[list[int]], num_layers: int) -> list:
    """For each prompt (token ids), the (num_layers, T, H) fp32 CPU residual stream after vLLM's decoder layers
    ``0..num_layers-1`` in its prefill, as rank 0 saw it (:mod:`glm5serve.testing.layer_capture`).

    Each prompt runs alone (one token generated) with an empty prefix cache, so its prefill computes every
    position; hooks are installed in every worker through ``llm.apply_model`` and removed after each prompt.
    Raises RuntimeError if a prefill records fewer positions than the prompt has.
    """
    import functools

    from vllm import SamplingParams

    from glm5serve.testing.layer_capture import collect_capture, prefill_states, start_capture

    sp = SamplingParams(temperature=0.0, max_tokens=1)
    states = []
    for p in prompts:
        llm.reset_prefix_cache()
        llm.apply_model(functools.partial(start_capture, num_layers=num_layers))
        try:
            llm.generate([{"prompt_token_ids": list(p)}], sp, use_tqdm=False)
        finally:
            calls = llm.apply_model(collect_capture)[0]
        states.append(prefill_states(calls, len(p)))
    return states


def gguf_kernels_in_use() -> str:
    """Which GGUF matmul kernels this process routes to: ``glm5serve-triton+plugin-<kind>`` when glm5serve's decode
    kernels are installed (decode batches run them, the rest the plugin's), else ``plugin-<kind>``; ``<kind>`` is
    ``cuda-extension`` or ``triton`` (the plugin's CUDA extension does not load with every torch)."""
    try:
        from vllm_gguf_plugin import ops as gguf_ops
        from vllm_gguf_plugin import quantization

        from glm5serve.kernels.vllm_ops import _MARK
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        return f"unknown ({type(e).__name__})"
    plugin = "plugin-" + ("cuda-extension" if getattr(gguf_ops, "_CUDA_ENABLED", False) else "triton")
    return f"glm5serve-triton+{plugin}" if getattr(quantization.fused_mul_mat_gguf, _MARK, False) else plugin


def run_in_subprocess(model: str, batches: list[list[list[int]]], workdir: str, *, mode: str = "eager", tp: int = 1,
                      max_tokens: int = 32, timeout: float = 1800, name: str | None = None,
                      attention_backend: str | None = None, env: dict[str, str] | None = None,
                      capture_layers: int = 0) -> dict:
    """:func:`run` in a fresh ``python -m glm5serve.testing.vllm_runner`` process (vLLM keeps GPU memory until its
    process ends). Files ``{name}.{batches.json,json,log}`` (default name ``{mode}-tp{tp}``) go to ``workdir``;
    ``env`` is added to the child's environment (e.g. ``CUDA_VISIBLE_DEVICES``). The record gets ``backends``
    (the attention backends vLLM's log names) and, with ``capture_layers``, ``layer_states`` (see :func:`run`).
    Raises RuntimeError with the log's tail on failure."""
    import re
    import subprocess
    from pathlib import Path

    d = Path(workdir)
    d.mkdir(parents=True, exist_ok=True)
    name = name or f"{mode}-tp{tp}"
    bfile, out, log = (d / f"{name}.{ext}" for ext in ("batches.json", "json", "log"))
    bfile.write_text(json.dumps(batches))
    env = dict(os.environ, VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(env or {}))
    cmd = [sys.executable, "-m", "glm5serve.testing.vllm_runner", "--model", str(model), "--batches", str(bfile),
           "--out", str(out), "--mode", mode, "--tp", str(tp), "--max-tokens", str(max_tokens)]
    if attention_backend:
        cmd += ["--attention-backend", attention_backend]
    if capture_layers:
        cmd += ["--capture-layers", str(capture_layers)]
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    text = log.read_text()
    if r.returncode != 0:
        raise RuntimeError(f"vLLM ({name}) failed, log {log}: " + " | ".join(text.strip().splitlines()[-5:]))
    rec = json.loads(out.read_text())
    rec["backends"] = sorted(set(re.findall(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend", text)))
    if capture_layers:
        rec["layer_states"] = load_layer_states(out)
    return rec


def layers_file(out) -> str:
    """Where :func:`main` saves the captured layer states for the record at ``out``: ``R.json`` → ``R.layers.pt``."""
    out = str(out)
    return (out[:-len(".json")] if out.endswith(".json") else out) + ".layers.pt"


def load_layer_states(out) -> list:
    """The ``layer_states`` list saved beside the record at ``out`` (see :func:`layers_file`)."""
    import torch

    return torch.load(layers_file(out), weights_only=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m glm5serve.testing.vllm_runner", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", required=True, help="JSON file: list of batches of prompts (token ids)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=sorted(MODES), default="eager")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--logprobs", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--attention-backend", help="vLLM's --attention-backend (CUSTOM: glm5serve's Triton MLA)")
    ap.add_argument("--score", help="JSON file: list of [prompt, continuation] token-id pairs to score")
    ap.add_argument("--capture-layers", type=int, default=0, metavar="N",
                    help="also record each prompt's residual stream after decoder layers 0..N-1 (R.layers.pt)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="fraction of each GPU vLLM may use")
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with open(a.batches) as f:
        batches = json.load(f)
    score = json.load(open(a.score)) if a.score else ()
    rec = run(a.model, batches, mode=a.mode, tp=a.tp, max_tokens=a.max_tokens, logprobs=a.logprobs,
              max_model_len=a.max_model_len, score=score, attention_backend=a.attention_backend,
              capture_layers=a.capture_layers, gpu_memory_utilization=a.gpu_memory_utilization)
    if "layer_states" in rec:
        import torch

        torch.save(rec.pop("layer_states"), layers_file(a.out))
        rec["layers_file"] = os.path.basename(layers_file(a.out))
    with open(a.out, "w") as f:
        json.dump(rec, f)
    print(f"vllm_runner: {a.mode} tp={a.tp}: init {rec['init_s']} s, generate {rec['generate_s']} s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run one vLLM engine configuration on a GGUF and record greedy tokens with their top-k logprobs.

vLLM does not free all GPU memory when an ``LLM`` goes away, so every configuration runs in its own process::

    python -m glm5serve.testing.vllm_runner --model M.gguf --batches B.json --out R.json --mode eager --tp 1

``B.json`` is a list of batches, each a list of prompts (token-id lists); every batch is one ``LLM.generate`` call,
so its size is the decode batch size. ``R.json`` mirrors it: per prompt the generated ``tokens`` and, per step,
``logprobs`` as ``{token_id: logprob}`` (the chosen token plus the top-k). Works with vLLM 0.25 and 0.33.
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
        score: list[tuple[list[int], list[int]]] = (), attention_backend: str | None = None) -> dict:
    """Generate greedily (``ignore_eos``) for every batch; returns the JSON-able record described above.

    ``attention_backend``: vLLM's ``--attention-backend`` (e.g. ``CUSTOM``: glm5serve's Triton MLA); None lets
    vLLM (and glm5serve's automatic choice) pick.

    ``score`` holds ``(prompt, continuation)`` token-id pairs: for each, ``scores`` gets the logprob (nats) vLLM
    gives every continuation token after the prompt (``prompt_logprobs=0`` over prompt + continuation).
    """
    # The engine core in this process: ``LLM.generate`` then adds every request of a batch before the first step,
    # so a batch is scheduled the same way in every run. With the core in its own process (vLLM's default) it
    # starts stepping as soon as the first request arrives, the first steps' batch composition depends on timing,
    # and vLLM is not batch-invariant: measured on the H200, eager reruns differed on 8 of 16 prompts at batch 16.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
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
    return {"vllm": vllm.__version__, "mode": mode, "tp": tp, "attention_backend": attention_backend or "auto",
            "gguf_kernels": gguf_kernels,
            "init_s": round(t_init, 1), "generate_s": round(t_gen, 2), "batches": out_batches, "scores": scores}


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
                      attention_backend: str | None = None, env: dict[str, str] | None = None) -> dict:
    """:func:`run` in a fresh ``python -m glm5serve.testing.vllm_runner`` process (vLLM keeps GPU memory until its
    process ends). Files ``{name}.{batches.json,json,log}`` (default name ``{mode}-tp{tp}``) go to ``workdir``;
    ``env`` is added to the child's environment (e.g. ``CUDA_VISIBLE_DEVICES``). The record gets ``backends``
    (the attention backends vLLM's log names). Raises RuntimeError with the log's tail on failure."""
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
    with open(log, "w") as f:
        r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    text = log.read_text()
    if r.returncode != 0:
        raise RuntimeError(f"vLLM ({name}) failed, log {log}: " + " | ".join(text.strip().splitlines()[-5:]))
    rec = json.loads(out.read_text())
    rec["backends"] = sorted(set(re.findall(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend", text)))
    return rec


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
    a = ap.parse_args(argv)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with open(a.batches) as f:
        batches = json.load(f)
    score = json.load(open(a.score)) if a.score else ()
    rec = run(a.model, batches, mode=a.mode, tp=a.tp, max_tokens=a.max_tokens, logprobs=a.logprobs,
              max_model_len=a.max_model_len, score=score, attention_backend=a.attention_backend)
    with open(a.out, "w") as f:
        json.dump(rec, f)
    print(f"vllm_runner: {a.mode} tp={a.tp}: init {rec['init_s']} s, generate {rec['generate_s']} s -> {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Run one vLLM engine configuration on a GGUF and record greedy tokens with their top-k logprobs.

vLLM does not free all GPU memory when an ``LLM`` goes away, so every configuration runs in its own process::

    python -m glm5serve.testing.vllm_runner --model M.gguf --batches B.json --out R.json --mode eager --tp 1

``B.json`` is a list of batches, each a list of prompts (token-id lists); every batch is one ``LLM.generate`` call,
so its size is the decode batch size. ``R.json`` mirrors it: per prompt the generated ``tokens`` and, per step,
``logprobs`` as ``{token_id: logprob}`` (the chosen token plus the top-k). Works with vLLM 0.25 and 0.33.

``--capture-layers N`` also records, for every prompt of ``B.json``, the residual stream after decoder layers
``0..N-1`` of its prefill (:mod:`glm5serve.testing.layer_capture`), saved as ``R.layers.pt`` next to ``R.json``: a
list, in prompt order, of (N, prompt_len, hidden_size) fp32 tensors.

``--serve-stdin`` keeps one engine for many batches instead (:class:`EngineSession` drives it): after one ready
line it answers JSON requests ``{"prompts": [[ids...], ...], "max_tokens": [n, ...]}`` read from stdin, one a line,
each with one ``LLM.generate`` call, by a line ``{"outputs": [record, ...]}`` in the format above; reply lines start
with :data:`MARKER`. EOF on stdin ends it (exit 0).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from typing import Callable, Iterable, Sequence, TextIO

#: engine settings per mode. ``graphs``: CUDA graphs for uniform decode batches without torch.compile, so
#: capture/replay is tested apart from compilation; ``default``: vLLM's default (torch.compile + graphs).
MODES: dict[str, dict] = {
    "eager": {"enforce_eager": True},
    "graphs": {"enforce_eager": False, "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}},
    "default": {"enforce_eager": False},
}


def engine_core_in_process() -> None:
    """Make vLLM run its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless already set).

    ``LLM.generate`` then adds every request of a batch before the first step, so a batch is scheduled the same way
    in every run. With the core in its own process (vLLM's default) it starts stepping as soon as the first request
    arrives, the first steps' batch composition depends on timing, and vLLM is not batch-invariant: measured on the
    H200, eager reruns differed on 8 of 16 prompts at batch 16.
    """
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


#: environment variable: a fixed KV cache size per GPU in GiB (vLLM's ``kv_cache_memory_bytes``)
KV_CACHE_ENV = "GLM5SERVE_KV_CACHE_GIB"


def kv_cache_bytes_from_env() -> int | None:
    """``$GLM5SERVE_KV_CACHE_GIB`` (GiB, > 0) in bytes, or None when unset.

    vLLM sizes its KV cache by profiling: it measures the GPU's free memory before and after a dummy forward pass and
    asserts that it did not grow (vllm/v1/worker/gpu_worker.py, ``determine_available_memory``). Another process
    that frees or takes memory meanwhile (a second engine on the same GPU ending or starting) fails that assertion
    or shrinks the cache to nothing. With ``kv_cache_memory_bytes`` set vLLM skips the measurement, so several
    engines can share one GPU. Empty counts as unset. Raises ValueError for a value that is not a positive finite
    number, or one below a byte."""
    raw = os.environ.get(KV_CACHE_ENV)
    if raw is None or not raw.strip():  # empty is unset, as for the other GLM5SERVE_* variables
        return None
    try:
        gib = float(raw)
    except ValueError:
        gib = float("nan")
    if not 0 < gib < float("inf") or int(gib * 2**30) < 1:  # 1e-12 GiB was a cache of 0 bytes
        raise ValueError(f"{KV_CACHE_ENV}={raw!r}: expected a positive number of GiB")
    return int(gib * 2**30)


def engine_kwargs(model: str, *, mode: str = "eager", tp: int = 1, max_model_len: int = 4096,
                  gpu_memory_utilization: float = 0.4, attention_backend: str | None = None) -> dict:
    """Keyword arguments of ``vllm.LLM`` for one engine configuration: bf16, seed 0, the :data:`MODES` settings of
    ``mode``, ``tp`` as ``tensor_parallel_size``, ``gpu_memory_utilization`` a fraction of each GPU's memory, and
    ``kv_cache_memory_bytes`` when ``$GLM5SERVE_KV_CACHE_GIB`` is set (:func:`kv_cache_bytes_from_env`).
    Raises KeyError for an unknown mode, ValueError for a bad ``$GLM5SERVE_KV_CACHE_GIB``."""
    kv = kv_cache_bytes_from_env()
    return dict(model=model, tensor_parallel_size=tp, dtype="bfloat16", seed=0, max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization, **MODES[mode],
                **({"attention_backend": attention_backend} if attention_backend else {}),
                **({"kv_cache_memory_bytes": kv} if kv is not None else {}))


def generation_record(output) -> dict:
    """One vLLM ``RequestOutput`` as JSON: ``prompt_len``, the generated ``tokens`` and per step ``logprobs`` as
    ``{str(token_id): logprob}`` (nats; the chosen token plus the top-k)."""
    return {
        "prompt_len": len(output.prompt_token_ids),
        "tokens": list(output.outputs[0].token_ids),
        "logprobs": [{str(t): float(lp.logprob) for t, lp in step.items()} for step in output.outputs[0].logprobs],
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
    engine_core_in_process()
    # apply_model ships functions (split-weight count, layer capture) to TP worker processes pickled
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(**engine_kwargs(model, mode=mode, tp=tp, max_model_len=max_model_len,
                              gpu_memory_utilization=gpu_memory_utilization, attention_backend=attention_backend))
    t_init = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True)
    out_batches = []
    t0 = time.time()
    for batch in batches:
        outs = llm.generate([{"prompt_token_ids": list(p)} for p in batch], sp, use_tqdm=False)
        out_batches.append([generation_record(o) for o in outs])
    t_gen = time.time() - t0
    scores = []
    if score:
        sp1 = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        outs = llm.generate([{"prompt_token_ids": list(p) + list(c)} for p, c in score], sp1, use_tqdm=False)
        for (p, c), o in zip(score, outs):
            full = list(p) + list(c)
            scores.append([float(o.prompt_logprobs[i][full[i]].logprob) for i in range(len(p), len(full))])
    import vllm

    from glm5serve.kernels.vllm_ops import split_weight_count

    gguf_kernels = gguf_kernels_in_use()
    rec = {"vllm": vllm.__version__, "mode": mode, "tp": tp, "attention_backend": attention_backend or "auto",
           "gguf_kernels": gguf_kernels, "split_weights": llm.apply_model(split_weight_count),
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


# --- interactive session: one engine kept alive across many generate calls -------------------------------------

#: prefix of every line a ``--serve-stdin`` process writes for its parent (vLLM prints to stdout as well)
MARKER = "@@glm5serve@@ "


def serve(llm, lines: Iterable[str], reply: Callable[[dict], None], *, logprobs: int = 5,
          sampling_params=None) -> int:
    """Answer generate requests, one JSON object per line of ``lines``, until they end; returns how many were served.

    A request is ``{"prompts": [[token ids], ...], "max_tokens": [n, ...]}`` (one ``max_tokens`` per prompt):
    one ``llm.generate`` call, greedy (temperature 0, ``ignore_eos``) with top-``logprobs`` logprobs per step,
    answered by ``reply({"outputs": [record, ...]})`` with one :func:`generation_record` per prompt, in order.
    A malformed request is answered ``{"error": reason}`` and the loop goes on; an engine error propagates.
    ``sampling_params`` (default ``vllm.SamplingParams``) is called with those keywords per prompt.
    """
    if sampling_params is None:
        from vllm import SamplingParams as sampling_params
    served = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            prompts = [[int(t) for t in p] for p in request["prompts"]]
            max_tokens = [int(n) for n in request["max_tokens"]]
            if not prompts or len(prompts) != len(max_tokens) or min(map(len, prompts)) == 0 or min(max_tokens) < 1:
                raise ValueError(f"{len(prompts)} prompts (each non-empty) need as many max_tokens >= 1, "
                                 f"got {max_tokens}")
        except (ValueError, KeyError, TypeError) as e:
            reply({"error": f"bad request: {type(e).__name__}: {e}"})
            continue
        params = [sampling_params(temperature=0.0, max_tokens=n, logprobs=logprobs, ignore_eos=True)
                  for n in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        reply({"outputs": [generation_record(o) for o in outs]})
        served += 1
    return served


def parse_message(line: str) -> dict | None:
    """The message a ``--serve-stdin`` line carries (JSON after :data:`MARKER`), or None for any other line."""
    return json.loads(line[len(MARKER):]) if line.startswith(MARKER) else None


def pump(stream: Iterable[str], messages: queue.Queue, log: TextIO) -> None:
    """Move a ``--serve-stdin`` process's output into ``messages`` (one dict per marked line) and ``log`` (every
    other line, flushed); puts None when ``stream`` ends (the process closed its output: it ended)."""
    try:
        for line in stream:
            msg = parse_message(line)
            if msg is None:
                log.write(line)
                log.flush()
            else:
                messages.put(msg)
    finally:
        messages.put(None)


def _serve_stdin(a: argparse.Namespace) -> int:
    """``--serve-stdin``: build the engine, say ready, :func:`serve` stdin; replies go to the original stdout,
    everything else printed to stdout (vLLM's logs, from Python or C) to stderr."""
    sys.stdout.flush()
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def say(msg: dict) -> None:
        proto.write(MARKER + json.dumps(msg) + "\n")
        proto.flush()

    engine_core_in_process()
    kwargs = engine_kwargs(a.model, mode=a.mode, tp=a.tp, max_model_len=a.max_model_len,
                           gpu_memory_utilization=a.gpu_memory_utilization, attention_backend=a.attention_backend)
    t0 = time.time()
    if a.engine_factory:  # a stand-in engine (tests): MODULE:NAME, and MODULE.SamplingParams if it has one
        import importlib

        module_name, _, name = a.engine_factory.partition(":")
        module = importlib.import_module(module_name)
        llm, params, info = getattr(module, name)(**kwargs), getattr(module, "SamplingParams", None), {}
    else:
        import vllm

        llm, params = vllm.LLM(**kwargs), None
        info = {"vllm": vllm.__version__, "gguf_kernels": gguf_kernels_in_use()}
    say({"ready": True, "mode": a.mode, "tp": a.tp, "init_s": round(time.time() - t0, 1), **info})
    n = serve(llm, sys.stdin, say, logprobs=a.logprobs, sampling_params=params)
    print(f"vllm_runner: {a.mode} tp={a.tp}: served {n} requests", file=sys.stderr)
    return 0


class EngineSession:
    """One vLLM engine in its own ``python -m glm5serve.testing.vllm_runner --serve-stdin`` process, kept alive
    across :meth:`generate` calls (engine start-up costs tens of seconds; vLLM frees its GPU memory only when its
    process ends). The process starts at once; :meth:`ready` waits for the engine. Use it as a context manager or
    call :meth:`close`.

    ``env`` is added to the child's environment (e.g. ``CUDA_VISIBLE_DEVICES``); its stderr and every stdout line
    that is not a reply go to ``log_path`` (default: a temporary file). ``start_timeout`` bounds the engine start,
    ``timeout`` each request (seconds). ``engine_factory`` (``MODULE:NAME``) replaces ``vllm.LLM`` in the child
    (tests). Every failure (the child ended, a timeout, a malformed request) raises RuntimeError naming the log
    and its last lines; after a timeout the child is killed.
    """

    def __init__(self, model: str, mode: str = "eager", tp: int = 1, *, env: dict[str, str] | None = None,
                 log_path=None, timeout: float = 600.0, start_timeout: float = 900.0,
                 gpu_memory_utilization: float = 0.4, max_model_len: int = 4096, attention_backend: str | None = None,
                 logprobs: int = 5, engine_factory: str | None = None, name: str | None = None):
        import subprocess
        import tempfile
        import threading

        self.name = name or f"{mode}-tp{tp}"
        self.timeout, self.start_timeout = timeout, start_timeout
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"vllm-{self.name}-", suffix=".log")
            os.close(fd)
        self.log_path = str(log_path)
        self.info: dict | None = None
        self._ended = False  # the child's output has ended (or it was killed): nothing more will come
        cmd = [sys.executable, "-m", "glm5serve.testing.vllm_runner", "--serve-stdin", "--model", str(model),
               "--mode", mode, "--tp", str(tp), "--max-model-len", str(max_model_len), "--logprobs", str(logprobs),
               "--gpu-memory-utilization", str(gpu_memory_utilization)]
        cmd += ["--attention-backend", attention_backend] if attention_backend else []
        cmd += ["--engine-factory", engine_factory] if engine_factory else []
        self._log = open(self.log_path, "a")
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1,
            start_new_session=True,  # its own process group: a kill also ends TP workers
            env=dict(os.environ, VLLM_NO_USAGE_STATS="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(env or {})))
        self._messages: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=pump, args=(self._proc.stdout, self._messages, self._log), daemon=True)
        self._reader.start()

    def __enter__(self) -> "EngineSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def ready(self) -> dict:
        """Wait for the engine; returns the child's ready message (``mode``, ``tp``, ``init_s`` seconds, and for
        vLLM its version and ``gguf_kernels``)."""
        if self.info is None:
            self.info = self._receive(self.start_timeout, "start")
        return self.info

    def submit(self, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int]) -> None:
        """Send one generate request (see :meth:`generate`) without waiting for it; :meth:`result` collects it."""
        self.ready()
        if isinstance(max_tokens, int):
            max_tokens = [max_tokens] * len(prompts)
        line = json.dumps({"prompts": [[int(t) for t in p] for p in prompts],
                           "max_tokens": [int(n) for n in max_tokens]})
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
        except OSError as e:  # BrokenPipeError: the child is gone
            raise self._failure(f"cannot send a request ({e})") from None

    def result(self) -> list[dict]:
        """The reply to the oldest request sent: one record per prompt, in order (see :func:`generation_record`)."""
        reply = self._receive(self.timeout, "a request")
        if "error" in reply:
            raise self._failure(reply["error"])
        return reply["outputs"]

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int | Sequence[int]) -> list[dict]:
        """Greedy generation (``ignore_eos``) for ``prompts`` (token-id lists) in one ``LLM.generate`` call, so one
        batch; ``max_tokens`` per prompt or one for all. Returns per prompt ``{"prompt_len", "tokens",
        "logprobs"}`` with ``logprobs[i]`` the ``{str(token_id): logprob}`` top-k of step i (nats)."""
        self.submit(prompts, max_tokens)
        return self.result()

    def close(self) -> int | None:
        """End the child (EOF on its stdin; killed if it has not exited 60 s later); returns its exit status."""
        import subprocess

        if self._proc.poll() is None:
            try:
                self._proc.stdin.close()
            except OSError:
                pass
            try:
                self._proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self._kill()
        self._reader.join(timeout=10)
        if not self._log.closed:
            self._log.close()
        return self._proc.returncode

    def log_tail(self, n: int = 8) -> str:
        """The last ``n`` lines of the child's log, joined by `` | ``."""
        with open(self.log_path, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-n:])

    def _receive(self, timeout: float, what: str) -> dict:
        if self._ended:
            raise self._failure(f"has ended (exit status {self._proc.wait()})")
        try:
            msg = self._messages.get(timeout=timeout)
        except queue.Empty:
            self._ended = True
            self._kill()
            raise self._failure(f"no answer to {what} within {timeout:g} s (killed)") from None
        if msg is None:
            self._ended = True
            raise self._failure(f"ended with exit status {self._proc.wait()} while waiting for {what}")
        return msg

    def _kill(self) -> None:
        import signal

        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._proc.wait()

    def _failure(self, what: str) -> RuntimeError:
        if not self._log.closed:
            self._log.flush()
        return RuntimeError(f"vLLM session {self.name}: {what}; log {self.log_path}: {self.log_tail()}")


def main(argv: list[str] | None = None) -> int:
    """Command line of this module (see the module docstring); returns the process exit status."""
    ap = argparse.ArgumentParser(prog="python -m glm5serve.testing.vllm_runner", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--batches", help="JSON file: list of batches of prompts (token ids)")
    ap.add_argument("--out")
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
    ap.add_argument("--serve-stdin", action="store_true",
                    help="keep the engine: answer JSON generate requests from stdin, one a line (EngineSession)")
    ap.add_argument("--engine-factory", metavar="MODULE:NAME", help="with --serve-stdin: a stand-in for vllm.LLM")
    a = ap.parse_args(argv)
    if not a.serve_stdin and not (a.batches and a.out):
        ap.error("--batches and --out are required (unless --serve-stdin)")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.serve_stdin:
        return _serve_stdin(a)
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

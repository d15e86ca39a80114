"""The ``--serve-stdin`` protocol of ``glm5serve.testing.vllm_runner`` and its parent, :class:`EngineSession`, on the
CPU: the request loop against a recording stand-in for ``vllm.LLM``, the reply/noise split, and whole sessions whose
child builds a stand-in engine (``--engine-factory``) that prints noise, dies, hangs or fails to start."""
from __future__ import annotations

import io
import json
import os
import queue
import re
import signal
from types import SimpleNamespace

import pytest
from hypothesis import find, given, settings

from glm5serve.testing import strategies as gst
from glm5serve.testing.vllm_runner import KV_CACHE_ENV, MARKER, EngineSession, engine_kwargs, main, pump, serve


def fake_tokens(prompt: list[int], n: int) -> list[int]:
    """What the stand-in engines below generate for ``prompt``: a formula the tests can recompute."""
    return [(sum(prompt) + i) % 1000 for i in range(n)]


def fake_output(prompt: list[int], n: int) -> SimpleNamespace:
    """A ``RequestOutput``-shaped object: per step the chosen token at -0.25·i and a runner-up at -1 - i."""
    toks = fake_tokens(prompt, n)
    lps = [{t: SimpleNamespace(logprob=-0.25 * i), t + 1000: SimpleNamespace(logprob=-1.0 - i)}
           for i, t in enumerate(toks)]
    return SimpleNamespace(prompt_token_ids=list(prompt), outputs=[SimpleNamespace(token_ids=toks, logprobs=lps)])


def expected_record(prompt: list[int], n: int) -> dict:
    toks = fake_tokens(prompt, n)
    return {"prompt_len": len(prompt), "tokens": toks,
            "logprobs": [{str(t): -0.25 * i, str(t + 1000): -1.0 - i} for i, t in enumerate(toks)]}


class RecordingLLM:
    """``vllm.LLM.generate`` stand-in that records each call's prompts and sampling params."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((prompts, params, use_tqdm))
        return [fake_output(p["prompt_token_ids"], sp["max_tokens"] if isinstance(sp, dict) else sp.max_tokens)
                for p, sp in zip(prompts, params, strict=True)]


def test_serve_one_generate_call_per_request_with_per_prompt_params():
    llm, replies = RecordingLLM(), []
    lines = [json.dumps({"prompts": [[1, 2, 3], [7], [4, 4]], "max_tokens": [1, 5, 2]}), "\n",
             json.dumps({"prompts": [[9] * 30], "max_tokens": [3]})]
    assert serve(llm, lines, replies.append, logprobs=3, sampling_params=dict) == 2
    assert len(llm.calls) == 2
    prompts, params, use_tqdm = llm.calls[0]
    assert prompts == [{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [7]}, {"prompt_token_ids": [4, 4]}]
    assert [p["max_tokens"] for p in params] == [1, 5, 2] and not use_tqdm
    assert all(p["temperature"] == 0.0 and p["logprobs"] == 3 and p["ignore_eos"] for p in params)
    first = [expected_record([1, 2, 3], 1), expected_record([7], 5), expected_record([4, 4], 2)]
    assert replies == [{"outputs": first}, {"outputs": [expected_record([9] * 30, 3)]}]


def test_serve_builds_real_vllm_sampling_params():
    pytest.importorskip("vllm")
    llm, replies = RecordingLLM(), []
    serve(llm, [json.dumps({"prompts": [[5], [6, 7]], "max_tokens": [2, 1]})], replies.append)
    (_, params, _), = llm.calls
    assert [(sp.temperature, sp.max_tokens, sp.logprobs, sp.ignore_eos) for sp in params] == [(0.0, 2, 5, True),
                                                                                                (0.0, 1, 5, True)]
    assert replies == [{"outputs": [expected_record([5], 2), expected_record([6, 7], 1)]}]


@pytest.mark.parametrize("bad", ["not json", '{"prompts": [[1]], "max_tokens": [1, 2]}', '{"prompts": [], '
                                 '"max_tokens": []}', '{"prompts": [[]], "max_tokens": [1]}',
                                 '{"prompts": [[1]], "max_tokens": [0]}', '{"prompts": [[1]]}', '[1, 2]',
                                 '{"prompts": [["a"]], "max_tokens": [1]}'])
def test_serve_answers_a_bad_request_with_an_error_and_goes_on(bad):
    llm, replies = RecordingLLM(), []
    good = json.dumps({"prompts": [[2]], "max_tokens": [1]})
    assert serve(llm, [bad, good], replies.append, sampling_params=dict) == 1
    assert len(llm.calls) == 1 and replies[0]["error"].startswith("bad request") and "outputs" not in replies[0]
    assert replies[1] == {"outputs": [expected_record([2], 1)]}


def test_pump_splits_replies_from_noise():
    noise = ["INFO 11-30 vLLM is starting\n", f"x{MARKER}{{}}\n", "Capturing CUDA graphs: 100%\n"]
    stream = io.StringIO(noise[0] + MARKER + '{"ready": true}\n' + noise[1] + MARKER + '{"outputs": []}\n' + noise[2])
    messages, log = queue.Queue(), io.StringIO()
    pump(stream, messages, log)
    assert [messages.get_nowait() for _ in range(3)] == [{"ready": True}, {"outputs": []}, None]
    assert log.getvalue() == "".join(noise)


def test_cli_still_needs_batches_and_out_without_serve_stdin():
    with pytest.raises(SystemExit) as e:
        main(["--model", "m.gguf", "--out", "r.json"])
    assert e.value.code == 2


# --- whole sessions: a child process speaking the protocol with a stand-in engine -------------------------------

FAKE_ENGINE = '''
import json, os, sys, time
from types import SimpleNamespace


class SamplingParams:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class Engine:
    def __init__(self, **kwargs):
        self.model = kwargs["model"]
        print("KWARGS " + json.dumps(kwargs), flush=True)  # on stdout, like vLLM's logs: must reach the log only
        print("ENV " + os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "unset"), flush=True)
        os.write(1, b"C-level noise\\n")
        if self.model == "fail-start":
            raise RuntimeError("engine refused to start")

    def generate(self, prompts, params, use_tqdm=True):
        print("INFO generating %d" % len(prompts), flush=True)
        os.write(1, b"progress 50%|")  # a progress bar frame, no line end: must not glue onto a reply
        if self.model == "die":
            os._exit(3)
        if self.model == "hang":
            time.sleep(3600)
        outs = []
        for p, sp in zip(prompts, params):
            assert sp.temperature == 0.0 and sp.ignore_eos and sp.logprobs == 5, sp.__dict__
            ids = p["prompt_token_ids"]
            toks = [(sum(ids) + i) % 1000 for i in range(sp.max_tokens)]
            lps = [{t: SimpleNamespace(logprob=-0.25 * i), t + 1000: SimpleNamespace(logprob=-1.0 - i)}
                   for i, t in enumerate(toks)]
            outs.append(SimpleNamespace(prompt_token_ids=ids, outputs=[SimpleNamespace(token_ids=toks, logprobs=lps)]))
        return outs
'''


@pytest.fixture
def fake_session(tmp_path):
    (tmp_path / "fake_engine.py").write_text(FAKE_ENGINE)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    sessions = []

    def make(model, mode="graphs", env_extra=None, **kw):
        s = EngineSession(model, mode, engine_factory="fake_engine:Engine",
                          env={"PYTHONPATH": path, **(env_extra or {})},
                          log_path=tmp_path / f"{model}.log", start_timeout=300, **kw)
        sessions.append(s)
        return s

    yield make
    for s in sessions:
        s.close()


def _log_lines(session, prefix):
    with open(session.log_path) as f:
        return [line[len(prefix):].strip() for line in f if line.startswith(prefix)]


def test_session_serves_many_batches_from_one_engine(fake_session):
    with fake_session("ok", "graphs", timeout=60) as s:
        info = s.ready()
        assert info["ready"] and info["mode"] == "graphs" and info["tp"] == 1
        a, b = [[1, 2, 3], [7]], [[5] * 40, [8, 9], [1]]
        assert s.generate(a, [4, 2]) == [expected_record(a[0], 4), expected_record(a[1], 2)]
        with pytest.raises(RuntimeError, match="bad request"):
            s.generate([[1]], [1, 2])
        assert s.generate(b, 3) == [expected_record(p, 3) for p in b]  # the session survives a bad request
        assert s.close() == 0
    kwargs = [json.loads(x) for x in _log_lines(s, "KWARGS ")]
    assert len(kwargs) == 1, "one engine for all requests"
    assert kwargs[0]["model"] == "ok" and kwargs[0]["enforce_eager"] is False
    assert kwargs[0]["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    assert kwargs[0]["gpu_memory_utilization"] == 0.4 and kwargs[0]["tensor_parallel_size"] == 1
    assert _log_lines(s, "ENV ") == ["0"]
    log = open(s.log_path).read()
    assert re.findall(r"INFO generating (\d+)", log) == ["2", "3"] and log.count("progress 50%|") == 2
    assert _log_lines(s, "C-level noise") == [""] and MARKER not in log


def test_session_child_death_raises_with_the_log_tail(fake_session):
    s = fake_session("die", "eager", timeout=120)
    with pytest.raises(RuntimeError, match=r"exit status 3 .*INFO generating 1"):
        s.generate([[1, 2]], 2)
    assert s.close() == 3


def test_session_timeout_kills_the_child(fake_session):
    s = fake_session("hang", "eager", timeout=1)
    s.ready()
    with pytest.raises(RuntimeError, match=r"no answer to a request within 1 s \(killed\).*INFO generating 1"):
        s.generate([[1]], 1)
    assert s.close() == -signal.SIGKILL


def test_session_start_failure_raises_with_the_error(fake_session):
    s = fake_session("fail-start", "eager")
    with pytest.raises(RuntimeError, match=r"exit status 1 while waiting for start.*engine refused to start"):
        s.ready()
    with pytest.raises(RuntimeError, match="has ended"):  # later calls fail at once instead of waiting
        s.generate([[1]], 1)


# --- the batch strategy ---------------------------------------------------------------------------------------

VOCAB = [3, 17, 40000, 151000]


@settings(max_examples=30)
@given(gst.engine_batches(VOCAB, max_requests=5, max_prompt_len=9, max_new_tokens=4))
def test_engine_batches_stay_in_bounds(batch):
    prompts, max_tokens = batch
    assert 1 <= len(prompts) <= 5 and len(max_tokens) == len(prompts)
    assert all(1 <= len(p) <= 9 and set(p) <= set(VOCAB) for p in prompts)
    assert all(isinstance(t, int) for p in prompts for t in p) and all(1 <= n <= 4 for n in max_tokens)


def test_engine_batches_reach_their_bounds():
    s = gst.engine_batches(VOCAB, max_requests=5, max_prompt_len=9, max_new_tokens=4)
    prompts, max_tokens = find(s, lambda b: len(b[0]) == 5 and max(map(len, b[0])) == 9 and 4 in b[1] and 1 in b[1])
    assert len(prompts) == 5
    prompts, _ = find(s, lambda b: len(set(t for p in b[0] for t in p)) == len(VOCAB))
    assert sorted(set(t for p in prompts for t in p)) == VOCAB


def test_fixed_kv_cache_size_reaches_the_engine_from_the_environment(fake_session, monkeypatch):
    """$GLM5SERVE_KV_CACHE_GIB becomes vLLM's kv_cache_memory_bytes in the child (so engines can share a GPU
    without vLLM's memory profiling); unset, the key is absent and vLLM profiles as usual."""
    monkeypatch.delenv(KV_CACHE_ENV, raising=False)
    with fake_session("ok", "eager", timeout=60, env_extra={KV_CACHE_ENV: "2.5"}) as s:
        s.ready()
    with fake_session("ok2", "eager", timeout=60) as s2:
        s2.ready()
    (fixed,) = [json.loads(x) for x in _log_lines(s, "KWARGS ")]
    (profiled,) = [json.loads(x) for x in _log_lines(s2, "KWARGS ")]
    assert fixed["kv_cache_memory_bytes"] == int(2.5 * 2**30)
    assert "kv_cache_memory_bytes" not in profiled


@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "four", "1e-12"])  # 1e-12: 0 bytes (fresh-user finding)
def test_bad_kv_cache_size_is_refused(monkeypatch, bad):
    monkeypatch.setenv(KV_CACHE_ENV, bad)
    with pytest.raises(ValueError, match=f"{KV_CACHE_ENV}='{bad}': expected a positive number of GiB"):
        engine_kwargs("m.gguf")


@pytest.mark.parametrize("empty", ["", " "])
def test_an_empty_kv_cache_size_is_unset(monkeypatch, empty):
    monkeypatch.setenv(KV_CACHE_ENV, empty)  # was an error, where the other GLM5SERVE_* variables read it as unset
    assert "kv_cache_memory_bytes" not in engine_kwargs("m.gguf")

"""``verify --engine vllm`` orchestration and rules, on the CPU with a stand-in for the vLLM runner (the real runs
are GPU tests: tests/gpu/test_vllm_e2e.py)."""
import copy

import pytest

from glm5serve import engine_check
from glm5serve.cli import main


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    from glm5serve.gguf_file import GGUFModel

    prompts = engine_check.prompts_for(GGUFModel(tiny_checkpoint))
    return prompts, engine_check.reference_generations(tiny_checkpoint, prompts, "cpu")


def fake_runner(gens_by_mode, calls):
    def run(model, batches, workdir, *, mode, tp, max_tokens):
        calls.append((mode, tp, [len(b[0]) for b in batches], max_tokens))
        return {"vllm": "fake", "backends": ["FAKE"], "gguf_kernels": "none",
                "batches": [[g] for g in gens_by_mode[mode]]}
    return run


def test_prompts_are_deterministic_and_within_index_topk(tiny_checkpoint):
    from glm5serve.gguf_file import GGUFModel

    a, b = (engine_check.prompts_for(GGUFModel(tiny_checkpoint)) for _ in range(2))
    assert a == b and all(0 < len(p) <= 8 for p in a)  # tiny's index_topk is 8


def test_engine_agreeing_with_reference_passes(tiny_checkpoint, reference):
    _, ref = reference
    calls = []
    checks = engine_check.engine_checks(str(tiny_checkpoint), 2, device="cpu",
                                        run=fake_runner({"eager": ref, "graphs": copy.deepcopy(ref)}, calls))
    assert [c.name for c in checks] == ["vllm-ref", "graphs"] and all(c.ok for c in checks), checks
    assert [c[0] for c in calls] == ["eager", "graphs"] and all(c[1] == 2 for c in calls)
    assert "3/3 prompts identical" in checks[0].detail


def test_garbage_engine_and_inexact_graphs_fail(tiny_checkpoint, reference):
    _, ref = reference
    garbage = copy.deepcopy(ref)
    g = garbage[1]
    bad = next(t for t in range(512) if t not in ref[1]["logprobs"][0])  # outside the reference's top-5
    g["tokens"][0] = bad
    g["logprobs"][0] = {bad: -0.01, **{t: -9.0 for t in range(500, 505)}}
    graphs = copy.deepcopy(garbage)
    first = next(iter(graphs[0]["logprobs"][3]))
    graphs[0]["logprobs"][3][first] += 1e-3  # one logprob off by 0.001: not bit-identical
    checks = engine_check.engine_checks(str(tiny_checkpoint), 1, device="cpu",
                                        run=fake_runner({"eager": garbage, "graphs": graphs}, []))
    assert [c.ok for c in checks] == [False, False]
    assert "top-5" in checks[0].detail and "step 3" in checks[1].detail


def test_cli_flag_runs_engine_checks_after_static_ones(tiny_checkpoint, reference, monkeypatch, capsys):
    _, ref = reference
    real = engine_check.engine_checks
    monkeypatch.setattr(engine_check, "engine_checks", lambda path, tp, **kw: real(
        path, tp, device="cpu", run=fake_runner({"eager": ref, "graphs": ref}, []), **kw))
    gpus = []  # the fake engine needs no GPU: stand in for the check that vLLM and the GPUs are there
    monkeypatch.setattr("glm5serve.vllm_plugin.require_gpus", gpus.append)
    assert main(["verify", str(tiny_checkpoint), "--engine", "vllm"]) == 0
    assert gpus == [1]
    captured = capsys.readouterr()
    out = captured.out
    assert "PASS  vllm-ref" in out and "PASS  graphs" in out and "verify: OK" in out
    # each engine stage announces itself on stderr, in order, before it runs
    stages = [line for line in captured.err.splitlines() if line.startswith("verify: ") and "/3 " in line]
    assert [s.split()[1] for s in stages] == ["1/3", "2/3", "3/3"], captured.err
    assert all(s.endswith(" s)") for s in stages), stages

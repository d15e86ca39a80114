"""``glm5serve bench``'s arithmetic, engine settings, profile grouping and projection, with a stand-in for vLLM
(the GPU runs are tests/gpu/test_synthetic.py's). Expected numbers are worked out here by hand or from a stated
model, not by the code under test."""
from __future__ import annotations

import copy
import gzip
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from glm5serve import bench
from glm5serve.cli import main

INFO = {"layers": 8, "vocab_size": 154880, "hidden_size": 6144, "n_routed_experts": 256, "synthetic": True,
        "gguf_gb": 44.0}


def test_decode_stats_by_hand():
    # 8 requests, 128 tokens: 0.1 s to the first token, 127 decode steps in 1.27 s -> 10 ms per step
    s = bench.decode_stats(8, 128, ttft_s=0.1, e2e_s=1.37)
    assert s["step_ms"] == pytest.approx(10.0)
    assert s["tok_s_per_request"] == pytest.approx(100.0)
    assert s["tok_s_total"] == pytest.approx(800.0)
    assert bench.decode_stats(8, 128, ttft_s=0.5, e2e_s=0.4)["step_ms"] is None  # no decode time: not a number


class StandIn:
    """Records the specs it is given and answers with fixed timings: TTFT 20 ms + 1 ms per request, decode steps of
    (5 + 0.01 c) ms, so ``e2e = ttft + 127 step``."""

    def __init__(self, fail_mode=None):
        self.specs, self.fail_mode = [], fail_mode

    def __call__(self, spec, workdir, name, timeout):
        self.specs.append((name, spec))
        if spec["engine"].get("enforce_eager") and self.fail_mode == "eager":
            raise RuntimeError("vLLM (eager) failed")
        results = []
        for c in spec["concurrency"]:
            ttft = 0.020 + 0.001 * c
            results.append({"concurrency": c, "ttft_s": ttft, "e2e_s": ttft + (spec["output_len"] - 1) *
                            (0.005 + 0.00001 * c), "short": 0})
        return {"vllm": "0.25.0", "gpu": "stand-in", "init_s": 12.0, "results": results}


def test_bench_record_from_a_stand_in_runner(tmp_path):
    runner = StandIn()
    rec = bench.bench("g5-8.gguf", concurrency=[64, 1, 8, 256], load_format="glm5-synthetic", graphs_mode="nocompile",
                      workdir=tmp_path, runner=runner, info=INFO)
    assert [r["mode"] for r in rec["runs"]] == ["eager", "graphs"]
    assert rec["layers"] == 8 and rec["load_format"] == "glm5-synthetic"
    for run in rec["runs"]:
        assert [r["concurrency"] for r in run["results"]] == [1, 8, 64, 256]
        for r in run["results"]:
            c = r["concurrency"]
            assert r["step_ms"] == pytest.approx(5 + 0.01 * c)
            assert r["tok_s_per_request"] == pytest.approx(1000 / (5 + 0.01 * c))
            assert r["tok_s_total"] == pytest.approx(1000 * c / (5 + 0.01 * c))
    (eager_name, eager), (graphs_name, graphs) = runner.specs
    assert (eager_name, graphs_name) == ("eager-tp1", "graphs-tp1")
    assert eager["engine"]["enforce_eager"] is True and "compilation_config" not in eager["engine"]
    assert graphs["engine"]["compilation_config"] == {"cudagraph_capture_sizes": [1, 8, 64, 256], "mode": 0,
                                                      "cudagraph_mode": "FULL_DECODE_ONLY"}
    for _, spec in runner.specs:
        e = spec["engine"]
        assert e["load_format"] == "glm5-synthetic" and e["max_num_seqs"] == 256 and not e["enable_prefix_caching"]
        assert e["max_num_batched_tokens"] >= 256 * 40  # the largest batch prefills in one step
        assert "profiler_config" not in e
    text = bench.format_record(rec)
    assert "7.56" in text and "33862.4" in text  # c=256: 5 + 2.56 ms per step, 256 / 7.56 ms tokens/s


def test_default_graphs_mode_compiles_and_profile_sets_vllms_profiler(tmp_path):
    runner = StandIn()
    bench.bench("m.gguf", modes=["graphs"], concurrency=[1, 8], profile=True, profile_steps=6, workdir=tmp_path,
                runner=runner, info=INFO)
    (_, spec), = runner.specs
    assert spec["engine"]["compilation_config"] == {"cudagraph_capture_sizes": [1, 8]}
    assert "load_format" not in spec["engine"]  # auto: the GGUF's own data
    pc = spec["engine"]["profiler_config"]
    assert pc["profiler"] == "torch" and pc["max_iterations"] == 6 and pc["delay_iterations"] == bench.PROFILE_DELAY
    assert pc["torch_profiler_dir"].startswith(str(tmp_path))


def test_a_failing_engine_is_recorded_and_the_other_mode_still_runs(tmp_path):
    rec = bench.bench("m.gguf", concurrency=[1], workdir=tmp_path, runner=StandIn(fail_mode="eager"), info=INFO)
    eager, graphs = rec["runs"]
    assert "failed" in eager["error"] and not eager["results"]
    assert graphs["results"][0]["step_ms"] == pytest.approx(5.01)


# -- profile grouping -----------------------------------------------------------------------------------------------

KERNELS = {  # kernel names as they appear in CUDA traces of vLLM 0.25 on an H200, the plugin and glm5serve
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "allreduce",
    "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*, vllm::RankSignals, int)": "allreduce",
    "_moe_gate_up_kernel": "moe",
    "_grouped_gate_up_kernel": "moe",  # the H200 profile of session 3 filed these two under "other"
    "_grouped_down_kernel": "moe",
    "_dequant_kernel": "gemm",
    "q4_k_moe_kernel": "moe",
    "void vllm::moe::grouped_topk_kernel<__nv_bfloat16, float>(...)": "moe",
    "void vllm::moe::topkGatingSigmoid<__nv_bfloat16, 8, 256, 4, 32, int, 0>(...)": "moe",
    "_mla_decode_kernel": "attention",
    "void flash::flash_fwd_splitkv_mla_kernel<Flash_fwd_kernel_traits_mla<576, 64, 64, 8>, true>(...)": "attention",
    "void vllm::top_k_per_row_decode<1024>(float const*, int const*, int*, long, long, int, int)": "attention",
    "void deep_gemm::sm90_fp8_paged_mqa_logits<64u, 128u, 4u>(...)": "attention",
    "void vllm::concat_and_cache_mla_kernel<__nv_bfloat16, __nv_bfloat16>(...)": "attention",
    "void vllm::rotary_embedding_kernel<c10::BFloat16, false>(...)": "attention",
    "_gemv_kernel": "gemm",
    "q5_k_gemm_kernel": "gemm",
    "nvjet_tst_128x64_64x6_1x1_h_bz_TNT": "gemm",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off": "gemm",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(...)": "gemm",
    "void vllm::rms_norm_kernel<c10::BFloat16, 8>(...)": "other",
    "void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel<c10::BFloat16>, true>(...)": "other",
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, std::array<char*, 1>>": "other",
}


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_groups(name):
    assert bench.kernel_group(name) == KERNELS[name]


def _trace(steps: int, prefill: bool = False) -> list[dict]:
    ev = []
    for s in range(steps):
        ctx = "execute_context_1(40)_generation_7(7)" if prefill and s == 0 else "execute_context_0(0)_generation_8(8)"
        ev.append({"ph": "X", "cat": "user_annotation", "name": ctx, "ts": 1000 * s, "dur": 900})
        ev += [{"ph": "X", "cat": "kernel", "name": "_mla_decode_kernel", "ts": 0, "dur": 30.0},
               {"ph": "X", "cat": "kernel", "name": "q4_k_moe_kernel", "ts": 0, "dur": 50.0},
               {"ph": "X", "cat": "kernel", "name": "q4_k_moe_kernel", "ts": 0, "dur": 50.0},
               {"ph": "X", "cat": "kernel", "name": "_gemv_kernel", "ts": 0, "dur": 40.0},
               {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "ts": 0, "dur": 10.0},
               {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 0, "dur": 5.0},
               {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 999.0}]
    return ev


def test_kernel_breakdown_per_step_and_fractions(tmp_path):
    path = tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.123.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": _trace(4)}, f)
    b = bench.kernel_breakdown(bench.load_trace(path))
    assert b["steps"] == 4 and b["decode_only"] and b["gpu_us_per_step"] == pytest.approx(185.0)
    g = b["groups"]
    assert (g["moe"]["us_per_step"], g["moe"]["calls_per_step"]) == (pytest.approx(100.0), pytest.approx(2.0))
    assert g["attention"]["us_per_step"] == pytest.approx(30.0) and g["gemm"]["us_per_step"] == pytest.approx(40.0)
    assert g["allreduce"]["us_per_step"] == pytest.approx(10.0) and g["other"]["us_per_step"] == pytest.approx(5.0)
    assert sum(v["fraction"] for v in g.values()) == pytest.approx(1.0)
    assert b["top"][0] == {"name": "q4_k_moe_kernel", "group": "moe", "us_per_step": pytest.approx(100.0)}


def test_kernel_breakdown_flags_prefill_and_needs_kernels():
    assert not bench.kernel_breakdown(_trace(3, prefill=True))["decode_only"]
    with pytest.raises(ValueError, match="0 GPU kernels"):
        bench.kernel_breakdown([{"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_x"}])


# -- projection -----------------------------------------------------------------------------------------------------

# a stated world: per step a(L) = 3 + 0.05 L ms that does not divide by TP, w(L) = 1 + 0.6 L ms that does, and
# n(L) = 2 L + 1 all-reduces of 25 µs each when TP > 1
def _world_ms(layers: int, tp: int) -> float:
    a, w = 3 + 0.05 * layers, 1 + 0.6 * layers
    return a + w / tp + ((2 * layers + 1) * 0.025 if tp > 1 else 0.0)


def _record(layers: int, tp: int, profile: bool = False) -> dict:
    results = []
    for c in (1, 64):
        r = {"concurrency": c, "step_ms": _world_ms(layers, tp)}
        if profile:
            n = 2 * layers + 1
            r["profile"] = {"groups": {"allreduce": {"us_per_step": 25.0 * n, "calls_per_step": n}}}
        results.append(r)
    return {"tp": tp, "layers": layers, "runs": [{"mode": "graphs", "results": results}]}


def test_projection_recovers_the_stated_world():
    recs = [_record(4, 1), _record(8, 1), _record(4, 2), _record(8, 2, profile=True)]
    p = bench.project(recs, target_layers=78, target_tp=8)
    assert p["label"] == "projection (not a measurement)"
    tp1 = p["layers"]["tp1"]["graphs"]["1"]
    assert tp1["step_ms"] == pytest.approx(_world_ms(78, 1)) and tp1["ms_per_layer"] == pytest.approx(0.65)
    assert p["layers"]["tp2"]["graphs"]["64"]["step_ms"] == pytest.approx(_world_ms(78, 2))
    tp8 = p["tp"]["graphs"]["64"]
    assert tp8["step_ms"] == pytest.approx(_world_ms(78, 8))
    assert tp8["tok_s_total"] == pytest.approx(64 * 1000 / _world_ms(78, 8))
    assert (tp8["a_ms"], tp8["w_ms"], tp8["allreduce_calls"]) == (pytest.approx(3 + 0.05 * 78),
                                                                   pytest.approx(1 + 0.6 * 78), 157)


def test_projection_says_what_is_missing():
    p = bench.project([_record(8, 1), _record(8, 2, profile=True)])
    assert "two or more layer counts" in p["layers"]["tp1"]["graphs"]["1"]["missing"]
    assert "needs TP=1 at 78 layers (see its line) and TP=2 at 78 layers" in p["tp"]["graphs"]["1"]["missing"]
    p = bench.project([_record(4, 1), _record(8, 1)])
    assert p["tp"]["graphs"]["1"]["missing"] == ("needs TP=2 at 78 layers (see its line) and a TP=2 profile "
                                                 "(the all-reduce cost)")
    p = bench.project([_record(4, 2), _record(8, 2, profile=True)])  # no TP=1 records: said, not silent
    assert p["tp"]["graphs"]["64"]["missing"] == "needs TP=1 at 78 layers (see its line)"
    p = bench.project([_record(4, 1), _record(8, 1), _record(4, 2), _record(8, 2)])
    assert p["tp"]["graphs"]["1"]["missing"] == "needs a TP=2 profile (the all-reduce cost)"


def test_projection_does_not_depend_on_the_order_of_the_records():
    """Two TP=2 profiles with different all-reduce costs (30 and 20 µs per call): their mean is used whatever the
    order, and the calls per step come from the deepest slice."""
    recs = [_record(4, 1), _record(8, 1), _record(4, 2, profile=True), _record(8, 2, profile=True)]
    for r in recs[2]["runs"][0]["results"]:
        r["profile"]["groups"]["allreduce"]["us_per_step"] *= 30 / 25
    for r in recs[3]["runs"][0]["results"]:
        r["profile"]["groups"]["allreduce"]["us_per_step"] *= 20 / 25
    first, second = bench.project(recs), bench.project(recs[::-1])
    assert first["tp"] == second["tp"]
    assert first["tp"]["graphs"]["1"]["allreduce_us_per_call"] == pytest.approx(25.0)
    assert first["tp"]["graphs"]["1"]["allreduce_calls"] == pytest.approx(2 * 8 + 1 + 2 * 70)


def test_projection_refuses_step_times_that_contradict_it(tmp_path, capsys):
    """Step times that fall as layers grow, or a line or TP split that projects to <= 0 ms, are not projected: the
    entry says why (as one that lacks data does), not a negative speed or a crash in the report."""
    def rec(layers, tp, ms, profile=False):
        r = _record(layers, tp, profile)
        for x in r["runs"][0]["results"]:
            x["step_ms"] = ms
        return r

    p = bench.project([rec(4, 1, 10.0), rec(8, 1, 5.0)])
    assert "-1.250 ms/layer" in p["layers"]["tp1"]["graphs"]["1"]["missing"]
    p = bench.project([rec(4, 1, 1.0), rec(8, 1, 10.0)], target_layers=1)  # 2.25 ms/layer, but 1 layer is < 0
    assert "-5.75 ms at 1 layers" in p["layers"]["tp1"]["graphs"]["1"]["missing"]
    # TP=1 19.5 ms, TP=2 3.9 ms at 78 layers: w = 2 (19.5 - 3.9 + 157 x 0.025) = 39.05, a = -19.55
    p = bench.project([rec(4, 1, 1.0), rec(8, 1, 2.0), rec(4, 2, 0.2), rec(8, 2, 0.4, profile=True)])
    assert "a -19.55 ms" in p["tp"]["graphs"]["1"]["missing"] and "more than twice" in p["tp"]["graphs"]["1"]["missing"]
    assert p["layers"]["tp1"]["graphs"]["1"]["step_ms"] == pytest.approx(19.5)  # the lines themselves stand
    # a TP=2 a bit more than twice as fast (super-linear, as the MoE at 64+ tokens): a < 0 but the step would be
    # > 0; still not projected rather than printed with a warning
    p = bench.project([rec(4, 1, 4.0), rec(8, 1, 8.0), rec(4, 2, 1.9), rec(8, 2, 3.8, profile=True)])
    assert "tok_s_total" not in p["tp"]["graphs"]["64"] and "more than twice" in p["tp"]["graphs"]["64"]["missing"]
    files = [tmp_path / "a.json", tmp_path / "b.json"]
    for f, r in zip(files, (rec(4, 1, 10.0), rec(8, 1, 5.0))):
        f.write_text(json.dumps(r))
    assert main(["bench", "--projection", *map(str, files)]) == 0
    out = capsys.readouterr().out
    assert "projection tp1 graphs c=1: not projected: the line through" in out and "tok/s" not in out


def test_projection_on_gpu_time_ignores_host_noise(tmp_path, capsys):
    """``basis="gpu"`` fits the profiled kernel time per step: host overhead added to the wall step times (here
    2 ms at 4 layers, none at 8, as seen at TP=2 on the H200) bends the wall-time lines but not the GPU ones."""
    recs = [_record(4, 1, profile=True), _record(8, 1, profile=True), _record(4, 2, profile=True),
            _record(8, 2, profile=True)]
    for rec in recs:
        for r in rec["runs"][0]["results"]:
            r["profile"]["gpu_us_per_step"] = 1000 * r["step_ms"]
            r["step_ms"] += 2.0 if rec["layers"] == 4 else 0.0
    gpu = bench.project(recs, basis="gpu")
    assert gpu["basis"] == "gpu" and gpu["label"] == "projection (not a measurement)"
    assert gpu["layers"]["tp1"]["graphs"]["1"]["ms_per_layer"] == pytest.approx(0.65)
    assert gpu["tp"]["graphs"]["64"]["step_ms"] == pytest.approx(_world_ms(78, 8))
    wall = bench.project(recs)
    assert wall["basis"] == "step" and wall["layers"]["tp1"]["graphs"]["1"]["ms_per_layer"] == pytest.approx(0.15)
    # results without a (decode-only) profile are left out on the GPU basis, and the entry says so
    plain = bench.project([_record(4, 1), _record(8, 1)], basis="gpu")["layers"]["tp1"]["graphs"]["1"]["missing"]
    assert "without a decode-only profile: layers [4, 8]" in plain
    prefill = copy.deepcopy(recs[:2])
    prefill[1]["runs"][0]["results"][0]["profile"]["decode_only"] = False
    mixed = bench.project(prefill, basis="gpu")["layers"]["tp1"]["graphs"]
    assert "layers [8]" in mixed["1"]["missing"] and mixed["64"]["ms_per_layer"] == pytest.approx(0.65)
    with pytest.raises(ValueError, match="basis"):
        bench.project(recs, basis="wall")
    files = []
    for i, rec in enumerate(recs):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(rec))
    assert main(["bench", "--projection", *map(str, files), "--basis", "gpu"]) == 0
    out = capsys.readouterr().out
    assert "GPU kernel time" in out and "no host overhead" in out.splitlines()[0]
    bad = recs[0]
    bad["runs"][0]["results"][0]["profile"]["gpu_us_per_step"] = "fast"
    files[0].write_text(json.dumps(bad))
    assert main(["bench", "--projection", *map(str, files), "--basis", "gpu"]) == 2
    assert "profile.gpu_us_per_step" in capsys.readouterr().err


# -- the commands ---------------------------------------------------------------------------------------------------

def test_projection_command_prints_and_writes_a_labelled_projection(tmp_path, capsys):
    files = []
    for i, rec in enumerate([_record(4, 1), _record(8, 1), _record(4, 2), _record(8, 2, profile=True)]):
        files.append(tmp_path / f"r{i}.json")
        files[-1].write_text(json.dumps(rec))
    out = tmp_path / "proj.json"
    assert main(["bench", "--projection", *map(str, files), "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("PROJECTION (not a measurement)") and all("projection" in x for x in lines[1:])
    assert json.loads(out.read_text())["label"] == "projection (not a measurement)"


def test_an_os_error_naming_a_path_with_a_newline_stays_on_the_one_line(tmp_path, capsys):
    """The CLI's OSError line escapes a control character in the file name, as GGUFModelError's does (a mutant
    printing ``e.filename`` raw was missed): here the projection's --json lies below a file named with a newline."""
    f = tmp_path / "r.json"
    f.write_text(json.dumps(_record(4, 1)))
    (tmp_path / "new\nline").write_text("")
    assert main(["bench", "--projection", str(f), "--json", str(tmp_path / "new\nline" / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"glm5serve bench: {tmp_path}/new\\nline: ") and err.count("\n") == 1, err


def test_projection_refuses_a_model_it_would_not_measure(tmp_path, capsys, tiny_checkpoint):
    """Fresh-user finding: ``bench MODEL --projection R.json ... --json OUT`` printed (and wrote to OUT) the
    projection of the records alone, exit 0, as if MODEL had been measured and counted in it."""
    f = tmp_path / "r.json"
    f.write_text(json.dumps(_record(4, 1)))
    out = tmp_path / "out.json"
    assert main(["bench", str(tiny_checkpoint), "--projection", str(f), "--json", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (f"glm5serve bench: {tiny_checkpoint}: --projection runs nothing, so this MODEL "
                                    "would not be measured: leave it out to project the records, or leave out "
                                    "--projection to measure it") and not captured.out
    assert not out.exists()
    # without --json too: the projection was printed as MODEL's (a mutant refusing only with --json was missed)
    assert main(["bench", str(tiny_checkpoint), "--projection", str(f)]) == 2
    captured = capsys.readouterr()
    assert "--projection runs nothing, so this MODEL would not be measured" in captured.err and not captured.out
    assert main(["bench", "--projection", str(f), "--json", str(out)]) == 0  # without MODEL: projected as before
    assert out.exists()


def test_bench_refuses_a_json_it_could_not_write_before_any_engine_starts(tiny_split_checkpoint, tmp_path,
                                                                         monkeypatch, capsys):
    """Fresh-user finding: ``bench MODEL --json MODEL`` (or a shard of it, or a link to it) overwrote the GGUF with
    the record once the first engine had run; a --json that is a folder or lies below a file failed only then,
    after minutes of GPU time. Each is refused in one line naming it, before any engine starts."""
    import shutil

    import glm5serve.vllm_plugin as plugin

    ran = []
    monkeypatch.setattr(plugin, "require_gpus", lambda tp: None)  # as on a GPU host
    monkeypatch.setattr(bench, "bench", lambda model, **kw: ran.append(model) or {"runs": []})
    monkeypatch.setattr(bench, "format_record", lambda rec: "")
    model = Path(shutil.copytree(tiny_split_checkpoint.parent, tmp_path / "set")) / tiny_split_checkpoint.name
    shard2 = model.with_name(model.name.replace("00001-of", "00002-of"))
    (tmp_path / "link.gguf").symlink_to(shard2)
    (tmp_path / "file").write_text("")
    before = shard2.read_bytes()
    for target, why in ((model, "--json names the model being measured"),
                        (shard2, "--json names the model being measured"),
                        (tmp_path / "link.gguf", "--json names the model being measured"),
                        (tmp_path, "--json names a folder"),
                        (tmp_path / "file" / "r.json", f"--json: {tmp_path / 'file'} is not a folder"),
                        # a file further up, not the parent (a mutant looking at the parent alone was missed)
                        (tmp_path / "file" / "sub" / "r.json", f"--json: {tmp_path / 'file'} is not a folder")):
        assert main(["bench", str(model), "--json", str(target)]) == 2
        captured = capsys.readouterr()
        assert captured.err.strip().startswith(f"glm5serve bench: {target}: {why}"), captured.err
        assert captured.err.count("\n") == 1 and not ran
    assert shard2.read_bytes() == before
    assert main(["bench", str(model), "--json", str(tmp_path / "new" / "r.json")]) == 0
    assert ran == [str(model)] and (tmp_path / "new" / "r.json").is_file()


def test_bench_max_model_len_defaults_to_what_the_gguf_holds(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """Tester finding: the default --max-model-len 1024 passed the checks on the tiny checkpoint (context_length
    512) and would only fail inside vLLM ("User-specified max_model_len (1024) is greater than the derived
    max_model_len"). The default is 1024 or the GGUF's context length if shorter; a longer one given is refused
    naming both numbers, as serve refuses it (unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1, as vLLM allows)."""
    import glm5serve.vllm_plugin as plugin
    from glm5serve.synthetic import write_header

    ran = []
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.setattr(plugin, "require_gpus", lambda tp: None)  # as on a GPU host
    monkeypatch.setattr(bench, "bench", lambda model, **kw: ran.append(kw["max_model_len"]) or {"runs": []})
    monkeypatch.setattr(bench, "format_record", lambda rec: "")
    tiny_header, narrow_header = write_header(tmp_path / "t.gguf", "tiny"), write_header(tmp_path / "n.gguf", "narrow")
    synthetic = ["--load-format", "glm5-synthetic"]
    # input + output may fill the default length, as they may fill a given one (--max-model-len >= their sum)
    for args, runs in (([tiny_checkpoint], 512), ([tiny_header, *synthetic], 512), ([narrow_header, *synthetic], 1024),
                       ([tiny_header, *synthetic, "--input-len", "400", "--output-len", "112"], 512),
                       ([tiny_checkpoint, "--max-model-len", "400"], 400),
                       ([narrow_header, *synthetic, "--max-model-len", "8192"], 8192)):
        assert main(["bench", *map(str, args)]) == 0, capsys.readouterr().err
        assert ran.pop() == runs, args
    for args, want in (([tiny_checkpoint, "--max-model-len", "1024"], f"{tiny_checkpoint}: --max-model-len 1024 is "
                        "above the GGUF's context_length 512 (vLLM's max_position_embeddings; vLLM refuses it unless "
                        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)"),
                       ([tiny_header, *synthetic, "--input-len", "400", "--output-len", "200"],
                        f"{tiny_header}: --input-len + --output-len (600) must be <= 512, the default --max-model-len "
                        "(the smaller of 1024 and the GGUF's context_length 512)")):
        assert main(["bench", *map(str, args)]) == 2
        assert capsys.readouterr().err.strip() == f"glm5serve bench: {want}"
    assert not ran
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert main(["bench", str(tiny_checkpoint), "--max-model-len", "1024"]) == 0
    assert ran == [1024]


def test_bench_command_errors_are_one_line(tmp_path, capsys):
    assert main(["bench"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert main(["bench", "--projection", str(tmp_path / "missing.json")]) == 2
    assert "cannot read a bench record" in capsys.readouterr().err


def test_synthetic_gguf_command(tmp_path, capsys):
    out = tmp_path / "t.gguf"
    assert main(["synthetic-gguf", str(out), "--preset", "tiny"]) == 0
    assert out.is_file() and "--load-format glm5-synthetic" in capsys.readouterr().out
    assert main(["synthetic-gguf", str(tmp_path / "g.gguf"), "--layers", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at least 4 layers" in err


# -- the worker, with a stand-in for vllm.LLM -----------------------------------------------------------------------

class FakeLLM:
    """Answers ``generate`` with ``max_tokens`` tokens per prompt (one short request when asked) and writes one
    trace file per profiled session into the profiler dir, as vLLM's rank-0 worker does."""

    calls: list = []

    def __init__(self, **kw):
        self.kw, self.profiling = kw, False
        FakeLLM.calls = [("init", kw)]

    def generate(self, prompts, sp, use_tqdm=True):
        FakeLLM.calls.append(("generate", len(prompts), sp.max_tokens, [len(p["prompt_token_ids"]) for p in prompts]))
        n = sp.max_tokens
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(n - (i == 0 and n == 128))))])
                for i in range(len(prompts))]

    def start_profile(self):
        self.profiling = True

    def stop_profile(self):
        d = self.kw["profiler_config"]["torch_profiler_dir"]
        os.makedirs(d, exist_ok=True)
        with gzip.open(os.path.join(d, f"dp0_pp0_tp0_dcp0_ep0_rank0.{len(FakeLLM.calls)}.pt.trace.json.gz"),
                       "wt") as f:
            json.dump({"traceEvents": _trace(3)}, f)


def test_worker_runs_the_workload_and_reads_its_profiles(tmp_path, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    engine = bench.engine_args("m.gguf", "eager", [1, 4], profile_dir=str(tmp_path / "traces"), profile_steps=3)
    rec = bench.run_engine({"engine": engine, "concurrency": [1, 4], "input_len": 40, "output_len": 128,
                            "vocab_size": 1000, "repeats": 2, "profile_steps": 3})
    gens = [c[1:3] for c in FakeLLM.calls if c[0] == "generate"]
    # per concurrency: warm-up, 2 x TTFT (1 token), 2 x full; then one profiled batch per concurrency
    assert gens == [(1, 8), (1, 1), (1, 1), (1, 128), (1, 128), (4, 8), (4, 1), (4, 1), (4, 128), (4, 128),
                    (1, bench.PROFILE_DELAY + 3 + 4), (4, bench.PROFILE_DELAY + 3 + 4)]
    assert {n for c in FakeLLM.calls if c[0] == "generate" for n in c[3]} == {40}  # prompt lengths
    assert [r["short"] for r in rec["results"]] == [2, 2]  # one short request in each of the two full batches
    for r in rec["results"]:
        assert r["ttft_s"] >= 0 and r["e2e_s"] >= 0
        assert r["profile"]["steps"] == 3 and r["profile"]["groups"]["moe"]["us_per_step"] == pytest.approx(100.0)


def test_worker_reports_progress_after_each_concurrency_and_profile(tmp_path, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    engine = bench.engine_args("m.gguf", "eager", [1, 4], profile_dir=str(tmp_path / "traces"), profile_steps=3)
    seen = []

    def progress(r):
        seen.append((len(r["results"]), sum("profile" in x for x in r["results"])))

    rec = bench.run_engine({"engine": engine, "concurrency": [1, 4], "input_len": 40, "output_len": 128,
                            "vocab_size": 1000, "repeats": 1, "profile_steps": 3}, progress=progress)
    assert seen == [(1, 0), (2, 0), (2, 1), (2, 2)]
    assert rec["results"][1]["concurrency"] == 4


def test_a_worker_cut_short_keeps_what_it_measured(tmp_path, monkeypatch):
    """A worker killed by the timeout after writing partial results: they come back with ``error``; a worker that
    wrote nothing is a RuntimeError."""
    import subprocess

    def fake_run(cmd, stdout, stderr, env, timeout):
        out = Path(cmd[-1])
        if "partial" in out.name:
            out.write_text(json.dumps({"vllm": "x", "init_s": 1.0, "results": [{"concurrency": 1, "ttft_s": 0.1,
                                                                                 "e2e_s": 1.0, "short": 0}]}))
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    rec = bench.run_in_subprocess({"engine": {}}, tmp_path, "partial", 5)
    assert rec["results"][0]["concurrency"] == 1 and "timed out after 5 s" in rec["error"]
    with pytest.raises(RuntimeError, match="timed out"):
        bench.run_in_subprocess({"engine": {}}, tmp_path, "empty", 5)


@pytest.mark.parametrize("content", ["{}", "[1, 2]", '{"tp": 1, "layers": 4, "runs": [{"mode": "graphs", '
                                     '"results": [{"concurrency": 1, "step_ms": "fast"}]}]}'])
def test_projection_refuses_what_is_not_a_bench_record(tmp_path, capsys, content):
    f = tmp_path / "r.json"
    f.write_text(content)
    assert main(["bench", "--projection", str(f)]) == 2
    err = capsys.readouterr().err
    assert str(f) in err and "not a glm5serve bench record" in err and err.strip().count("\n") == 0


def _set(rec: dict, path: str, value) -> dict:
    """``rec`` with the field at the dotted ``path`` (list indices as numbers) set to ``value`` (``...``: removed)."""
    *keys, last = [int(k) if k.isdigit() else k for k in path.split(".")]
    node = rec
    for k in keys:
        node = node[k]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return rec


@pytest.mark.parametrize("path, value, field", [
    ("runs", {"graphs": []}, "runs must be a list"), ("runs", "graphs", "runs must be a list"),
    ("runs", [5], "runs[0] must be an object"), ("runs.0.mode", ..., "runs[0].mode must be a string"),
    ("runs.0.mode", ["graphs"], "runs[0].mode must be a string"),
    ("runs.0.results", ..., "runs[0].results must be a list"),
    ("runs.0.results.1.concurrency", True, "runs[0].results[1].concurrency must be an integer"),
    ("runs.0.results.0.step_ms", float("nan"), "runs[0].results[0].step_ms must be a number in (0, 1e9] ms"),
    ("runs.0.results.0.step_ms", float("inf"), "runs[0].results[0].step_ms must be a number in (0, 1e9] ms"),
    # huge but finite: overflowed the fits into a TypeError traceback (fresh-user finding)
    ("runs.0.results.0.step_ms", 1e300, "runs[0].results[0].step_ms must be a number in (0, 1e9] ms"),
    ("runs.0.results.0.profile.gpu_us_per_step", 1e300, "profile.gpu_us_per_step must be a number in (0, 1e12] us"),
    ("runs.0.results.0.profile", "none", "runs[0].results[0].profile must be an object"),
    ("runs.0.results.0.profile.groups.allreduce.us_per_step", "25", "allreduce.us_per_step must be a finite number"),
    ("runs.0.results.0.profile.groups.allreduce.us_per_step", ..., "allreduce.us_per_step must be a finite number"),
    ("runs.0.results.0.step_ms", 0, "runs[0].results[0].step_ms must be a number in (0, 1e9] ms"),
    ("runs.0.results.0.profile.gpu_us_per_step", 0.0, "profile.gpu_us_per_step must be a number in (0, 1e12] us"),
    ("runs.0.results.0.profile.decode_only", "false", "profile.decode_only must be true or false"),
    ("tp", True, "tp must be an integer >= 1"), ("layers", False, "layers must be an integer >= 1")])
def test_projection_names_the_bad_field_of_a_record(tmp_path, capsys, path, value, field):
    f = tmp_path / "r.json"
    f.write_text(json.dumps(_set(_record(8, 2, profile=True), path, value)))  # NaN and Infinity as json writes them
    assert main(["bench", "--projection", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"glm5serve bench: {f}: not a glm5serve bench record: ") and field in err
    assert err.strip().count("\n") == 0


def test_projection_refuses_records_that_do_not_belong_together(tmp_path, capsys):
    """A file listed twice, another workload or GPU, or no step time at all: one line naming the file, exit 2."""
    def write(name, rec):
        (tmp_path / name).write_text(json.dumps(rec))
        return str(tmp_path / name)

    def base(layers, tp):
        rec = _record(layers, tp, profile=tp == 2)
        rec.update(input_len=40, output_len=128, hidden_size=6144)
        for run in rec["runs"]:
            run["gpu"] = "NVIDIA H200"
        return rec

    a, b = write("a.json", base(4, 1)), write("b.json", base(8, 1))
    cases = [([a, b, a], f"{a}: listed twice (also as {a})"),
             ([a, write("c.json", {**base(8, 1), "output_len": 64})], "output_len 64 differs from 128 in " + a),
             ([a, write("d.json", _set(base(8, 2), "runs.0.gpu", "NVIDIA B200"))],
              "gpu 'NVIDIA B200' differs from 'NVIDIA H200'"),
             ([write("e.json", _set(base(8, 1), "runs", [])), write("f.json", _set(base(4, 1), "runs.0.results", []))],
              "no step time in any of the records: nothing to project")]
    # the same file under another name (fresh-user finding: a hard link passed, counted twice in the fits)
    hard, copy = tmp_path / "a_hard.json", tmp_path / "a_copy.json"
    os.link(a, hard)
    copy.write_text(Path(a).read_text())
    # and a copy written again with its keys in another order and indented (jq, an editor): the same record
    rewritten = tmp_path / "a_rewritten.json"
    rewritten.write_text(json.dumps(dict(reversed(json.loads(Path(a).read_text()).items())), indent=2))
    cases += [([a, str(hard), b], f"{hard}: listed twice (also as {a})"),
              ([str(copy), b, a], f"{a}: listed twice (also as {copy})"),
              ([a, b, str(rewritten)], f"{rewritten}: listed twice (also as {a})")]
    for files, message in cases:
        assert main(["bench", "--projection", *files]) == 2, files
        err = capsys.readouterr().err
        assert message in err and err.strip().count("\n") == 0, err
    assert main(["bench", "--projection", a, b]) == 0  # the same records, each once: fine


def test_projection_targets_and_run_preconditions_are_checked(tmp_path, capsys, tiny_checkpoint):
    from glm5serve.synthetic import write_header

    f = tmp_path / "r.json"
    f.write_text(json.dumps({"tp": 1, "layers": 4, "runs": []}))
    for bad, why in ((["--target-tp", "0"], "--target-tp must be >= 3"), (["--target-tp", "2"], "measured, not"),
                     (["--target-layers", "-5"], "--target-layers must be >= 1"),
                     (["--target-layers", "1" + "0" * 400], "--target-layers must be <= 100000")):  # was OverflowError
        assert main(["bench", "--projection", str(f), *bad]) == 2
        assert why in capsys.readouterr().err
    assert main(["bench", str(tiny_checkpoint)]) == 2  # no GPU here
    assert "CUDA GPU" in capsys.readouterr().err
    # what serve refuses before vLLM starts, bench refuses too (it started a TP=3 engine: fresh-user finding)
    assert main(["bench", str(tiny_checkpoint), "--tp", "3"]) == 2
    assert "does not divide by TP=3" in capsys.readouterr().err
    header = write_header(tmp_path / "h.gguf", "tiny")
    assert main(["bench", str(header)]) == 2
    assert "add --load-format glm5-synthetic" in capsys.readouterr().err
    assert main(["bench", str(tiny_checkpoint), "--load-format", "glm5-synthetic"]) == 2
    assert "needs a header" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", str(tiny_checkpoint), "--load-format", "bogus"])
    capsys.readouterr()
    for bad, want in ((["--tp", "0"], "--tp must be >= 1, not 0"),
                      (["--output-len", "1"], "--output-len must be >= 2, not 1"),
                      (["--input-len", "-3"], "--input-len must be >= 1, not -3"),
                      # fresh-user findings: these reached vLLM, or failed after the engine had loaded
                      (["--repeats", "0"], "--repeats must be >= 1, not 0"),
                      (["--profile-steps", "-1"], "--profile-steps must be >= 1, not -1"),
                      (["--max-model-len", "100"], "--max-model-len must be >= 168, not 100 (--input-len + "
                                                   "--output-len)"),
                      (["--gpu-memory-utilization", "5"], "--gpu-memory-utilization must be in (0, 1], not 5.0"),
                      (["--timeout", "-5"], "--timeout must be a positive number of seconds, not -5.0")):
        assert main(["bench", str(tiny_checkpoint), *bad]) == 2
        assert capsys.readouterr().err.strip() == f"glm5serve bench: {want}"
    # an empty or repeated entry is a typo: "1,,2" ran as [1, 2] (fresh-user finding), "1,1" measured 1 twice
    for bad, want in ((["--concurrency", "1,,2"], "expected comma-separated integers, not '1,,2'"),
                      (["--concurrency", "4,1,4"], "expected distinct positive integers, not '4,1,4'"),
                      (["--concurrency", "0"], "expected distinct positive integers, not '0'"),
                      (["--modes", "eager,"], "modes are eager, graphs, each at most once, not 'eager,'"),
                      (["--modes", "graphs,graphs"], "each at most once, not 'graphs,graphs'")):
        with pytest.raises(SystemExit):
            main(["bench", str(tiny_checkpoint), *bad])
        assert want in capsys.readouterr().err
    # the projection's --json must not overwrite one of its inputs (it did, exit 0)
    before = f.read_text()
    assert main(["bench", "--projection", str(f), "--json", str(tmp_path / "." / "r.json")]) == 2
    assert "is one of the records to project: it would be overwritten" in capsys.readouterr().err
    assert f.read_text() == before
    # nor through a hard link to it (fresh-user finding: the record was overwritten with the projection, exit 0)
    os.link(f, tmp_path / "r_hard.json")
    assert main(["bench", "--projection", str(f), "--json", str(tmp_path / "r_hard.json")]) == 2
    assert "is one of the records to project: it would be overwritten" in capsys.readouterr().err
    assert f.read_text() == before

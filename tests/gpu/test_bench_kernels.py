"""Benchmark of the GGUF decode kernels on GLM-5's shapes (issue 8): glm5serve's Triton GEMV and MoE against
vllm-gguf-plugin's kernels and bf16 cuBLAS, with the device's copy bandwidth measured in the same run.

Method: each implementation runs ``CALLS`` times inside one CUDA graph (launch gaps are those vLLM's graphs
pay; Python and launch overhead are not measured), call i on weight copy i mod n, the copies together >= 256 MB
(4x the 60 MB L2) so every call streams its weight from HBM.  Time per call = median over ``REPLAYS`` replays
(CUDA events) / CALLS.  Copy bandwidth counts bytes read + written by a 1 GiB device-to-device copy; a GEMV's
bandwidth counts the weight bytes it reads.  Weights are random codes with sane fp16 scales (speed does not
depend on the values); each case first checks glm5serve's output against dequantize + fp32 matmul.  glm5serve
reads each weight as it serves it: Q4_0/Q5_0/Q8_0 regrouped into split rows (``kernels.gguf_split.as_served``, what
the model loader does for linear layers; Q6_K too, unless ``$GLM5SERVE_SPLIT_Q6_K=0``); the plugin and cuBLAS
columns read the GGUF rows and bf16 weights.  An expert shape here is timed as a linear of that shape: the MoE's 3-D
expert tensors are never split (``test_bench_moe`` times them).  glm5serve's GEMVs are launched with programmatic
dependent launch (``gguf_gemv.PDL_MODE``); the ``no PDL`` column times the same calls without it.  Back to back in
one graph, each call's launch and first weight fetches then overlap the end of the call before; in a model the kernel
before is another op (a norm, the activation quantizer), so the column shows how much of a row's speed is PDL.

Run on a GPU host (one command, about 5 minutes on an H200)::

    GLM5SERVE_BENCH_OUT=bench python -m pytest tests/gpu/test_bench_kernels.py -m gpu -q -s -k "not sweep"

It writes ``bench_kernels.md`` / ``.json`` into ``$GLM5SERVE_BENCH_OUT`` (and prints the table).  The opt-in
sweep (``GLM5SERVE_BENCH_SWEEP=1 ... -k sweep``; types from ``GLM5SERVE_BENCH_SWEEP_TYPES``, default Q4_K, batches from
``GLM5SERVE_BENCH_SWEEP_BATCHES``, default 1,4,16; the int8-activation path included for its types) times
a grid of launch configs per shape and batch and writes ``tuned/<device>.json``; copied to
``src/glm5serve/kernels/tuned/`` it makes ``pick_config`` use the measured best.  For the swept types with a split
layout (Q4_0/Q5_0/Q8_0/Q6_K) it also times split-row tiles and writes ``split_sweep.json`` (the best five against
``pick_split_config``'s, for ``gguf_split._SPLIT_TILE``).  The same switch runs ``test_sweep_mma_tiles``: the int8
tensor-core tiles of the (type, shape, batch) cases in ``$GLM5SERVE_BENCH_SWEEP_MMA`` (default Q6_K lm_head/8 at 16
rows) against the production config, written to ``mma_sweep.json``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import statistics
import time
from pathlib import Path

import pytest
import torch
import triton
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from glm5serve.kernels import GemvConfig, gguf_linear, gguf_moe, pick_config
from glm5serve.kernels import gguf_gemv
from glm5serve.kernels.gguf_gemv import PREFETCH_MIN_BYTES, Q8_MAX_M, SPLIT_QTYPES, _device_info, _q8_applies
from glm5serve.kernels.gguf_split import SPLITTABLE, as_served, can_split, pick_split_config, split_rows, split_type
from glm5serve.kernels.testing import random_qweight_torch
from glm5serve.testing.gpu_timing import copy_bandwidth, graph_us

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = "cuda"
ROTATE_BYTES = 256 << 20
CALLS = 48
REPLAYS = 15
BATCHES = (1, 4, 16)
SHAPES = {  # name: (N, K, layout)
    "expert gate/up": (2048, 6144, "EP"), "expert down": (6144, 2048, "EP"),
    "lm_head/8": (19360, 6144, "TP8"), "q_a": (2048, 6144, "all"), "q_b/8": (2048, 2048, "TP8"),
    "o_proj/8": (6144, 2048, "TP8"), "expert gate+up/8": (512, 6144, "TP8"), "expert down/8": (6144, 256, "TP8"),
}
GEMV_CASES = ([(Q.Q4_K, s) for s in SHAPES]
              + [(q, "expert gate/up") for q in (Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q5_0)]
              + [(q, "expert down") for q in (Q.Q5_K, Q.Q6_K)] + [(Q.Q6_K, "lm_head/8")])
#: past decode's 16 rows (issue 8's follow-up: concurrency 64-256 ran the plugin's kernels): tensor-core tiles of
#: up to 64 rows per dequantized weight tile, and the MoE grouped by expert
LARGE_BATCHES = (64, 256)
LARGE_GEMV_CASES = [(Q.Q4_K, "q_a"), (Q.Q4_K, "o_proj/8"), (Q.Q6_K, "lm_head/8"), (Q.Q5_K, "expert gate+up/8")]
GEMV_PARAMS = ([(q, s, m) for q, s in GEMV_CASES for m in BATCHES]
               + [(q, s, m) for q, s in LARGE_GEMV_CASES for m in LARGE_BATCHES])
MOE_LAYOUTS = {"EP": 2048, "TP8": 256}  # intermediate size per expert on one GPU
MOE_E, MOE_H, MOE_TOPK = 256, 6144, 8


@contextlib.contextmanager
def _pdl(mode: str | None = None, steps: int | None = None):
    """``gguf_gemv.PDL_MODE`` (and PDL_MAX_STEPS) while a graph is captured: launch options are fixed at capture."""
    old = gguf_gemv.PDL_MODE, gguf_gemv.PDL_MAX_STEPS
    gguf_gemv.PDL_MODE, gguf_gemv.PDL_MAX_STEPS = mode or old[0], steps or old[1]
    try:
        yield
    finally:
        gguf_gemv.PDL_MODE, gguf_gemv.PDL_MAX_STEPS = old


def _graph_us(fns, calls: int = CALLS, pdl: str | None = None) -> tuple[float, torch.cuda.CUDAGraph]:
    """``graph_us``; ``pdl``: ``gguf_gemv.PDL_MODE`` while capturing (``off``: glm5serve's kernels launched without
    programmatic dependent launch, the ``no PDL`` column)."""
    with _pdl(pdl):
        return graph_us(fns, calls, REPLAYS)


def _copies(make, nbytes: int) -> list:
    return [make() for _ in range(max(2, math.ceil(ROTATE_BYTES / nbytes)))]


def _qbytes(qtype, n, k) -> int:
    qk, qb = GGML_QUANT_SIZES[qtype]
    return n * (k // qk) * qb


@pytest.fixture(scope="module")
def copy_bw() -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    return copy_bandwidth(DEV)


class Results(list):
    """Benchmark rows; the report files are rewritten after every row, so a run cut short keeps what it measured."""

    def __init__(self, copy_bw: float):
        super().__init__()
        self.copy_bw = copy_bw

    def add(self, row: dict) -> None:
        self.append(row)
        _write_report(self, self.copy_bw, echo=False)


@pytest.fixture(scope="module")
def results(copy_bw):
    rows = Results(copy_bw)
    yield rows
    _write_report(rows, copy_bw)


def _plugin_gemv():
    """vllm-gguf-plugin's decode GEMV (its CUDA extension when it loads, else its Triton kernel) and its name."""
    try:
        from vllm_gguf_plugin import ops
    except Exception as e:  # noqa: BLE001 - the plugin needs vLLM; record why it is missing
        return None, f"not importable: {type(e).__name__}: {e}"[:120]
    backend = "CUDA ext" if getattr(ops, "_CUDA_ENABLED", False) else "Triton"
    return (lambda w, x, q, n: ops.ggml_mul_mat_vec_a8(w, x, int(q), n) if x.shape[0] <= 6
            else ops.ggml_mul_mat_a8(w, x, int(q), n)), backend


def _plugin_moe():
    """The plugin's fused MoE with glm5serve's fix for its int32 expert offsets (whole GLM-5 experts span 3.6 GB;
    unfixed, the call faults with an illegal memory access: ``fixes._expert_groups``)."""
    try:
        from vllm_gguf_plugin.quantization.fused_moe import _fused_moe_gguf

        from glm5serve.vllm_plugin.fixes import _expert_groups
    except Exception as e:  # noqa: BLE001
        return None, f"not importable: {type(e).__name__}: {e}"[:120]
    return _expert_groups(_fused_moe_gguf), "plugin"


def _try_time(make_fns):
    try:
        return _graph_us(make_fns())[0], None
    except Exception as e:  # noqa: BLE001 - a failing baseline is reported, not fatal
        torch.cuda.synchronize()
        return None, f"{type(e).__name__}: {e}"[:160]


@pytest.mark.parametrize("qtype,shape,M", GEMV_PARAMS, ids=[f"{q.name}-{s}-{m}" for q, s, m in GEMV_PARAMS])
def test_bench_gemv(benchmark, results, copy_bw, qtype, shape, M):
    from glm5serve.dequant import dequantize

    N, K, layout = SHAPES[shape]
    gen = torch.Generator(DEV).manual_seed(N * 7 + K + int(qtype))
    qbytes = _qbytes(qtype, N, K)
    ws = _copies(lambda: random_qweight_torch(qtype, (N, K), DEV, gen), qbytes)
    x = torch.randn(M, K, device=DEV, generator=gen).to(torch.bfloat16)
    W = dequantize(ws[0], qtype, dtype=torch.float32)
    ref = x.float() @ W.T
    served = [as_served(w, qtype, K) for w in ws]  # as the model loader leaves them (Q4_0/Q5_0/Q8_0: split rows)
    got = gguf_linear(x, served[0][0], served[0][1], N).float()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, f"glm5serve GEMV relative error {rel:.3g}"

    ours = [functools.partial(gguf_linear, x, w, t, N) for w, t in served]
    ours_us, graph = _graph_us(ours)
    no_pdl_us = _graph_us(ours, pdl="off")[0]
    plugin, backend = _plugin_gemv()
    plugin_us, plugin_err = (None, backend) if plugin is None else _try_time(
        lambda: [functools.partial(plugin, w, x, qtype, N) for w in ws])
    Wb = W.to(torch.bfloat16)
    del W
    wbs = [Wb] + _copies(Wb.clone, 2 * N * K)[1:]
    cublas_us, _ = _graph_us([functools.partial(torch.matmul, x, w.T) for w in wbs])
    sms, _ = _device_info(x.device)
    row = dict(kind="gemv", shape=shape, layout=layout, N=N, K=K, type=qtype.name, batch=M,
               weight_MB=qbytes / 1e6, ours_us=ours_us, no_pdl_us=no_pdl_us, plugin_us=plugin_us,
               cublas_bf16_us=cublas_us,
               ours_GBps=qbytes / ours_us / 1e3, copy_fraction=qbytes / (ours_us * 1e-6) / copy_bw,
               x_plugin=plugin_us / ours_us if plugin_us else None, x_cublas=cublas_us / ours_us,
               plugin=backend if plugin_err is None else plugin_err, rel_err=rel,
               config=str(pick_split_config(served[0][1], M, N, K, sms) if served[0][1] in SPLIT_QTYPES
                          else pick_config(qtype, M, N, K, sms, x.dtype, _device_info(x.device)[1])))
    results.add(row)
    benchmark.extra_info.update(row)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=5, iterations=1)
    del ws, wbs, graph, served
    torch.cuda.empty_cache()


@pytest.mark.parametrize("T", BATCHES + LARGE_BATCHES)
@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_bench_moe(benchmark, results, copy_bw, layout, T):
    """GLM-5's routed experts (256, top-8, Q4_K) on one GPU: whole experts (EP) or TP=8 slices; T <= 16 runs the
    per-(token, expert) kernels, larger T the grouped-by-expert ones."""
    inter = MOE_LAYOUTS[layout]
    q = Q.Q4_K
    gen = torch.Generator(DEV).manual_seed(T + inter)
    w13 = random_qweight_torch(q, (MOE_E, 2 * inter, MOE_H), DEV, gen)
    w2 = random_qweight_torch(q, (MOE_E, MOE_H, inter), DEV, gen)
    x = torch.randn(T, MOE_H, device=DEV, generator=gen).to(torch.bfloat16)
    routes = []
    for _ in range(CALLS):  # a fresh routing per call: consecutive calls read different experts
        ids = torch.stack([torch.randperm(MOE_E, device=DEV, generator=gen)[:MOE_TOPK] for _ in range(T)])
        wts = torch.softmax(torch.randn(T, MOE_TOPK, device=DEV, generator=gen), -1)
        routes.append((ids.to(torch.int32), wts))
    expert_bytes = _qbytes(q, 2 * inter, MOE_H) + _qbytes(q, MOE_H, inter)
    mean_bytes = statistics.mean(len(torch.unique(ids)) * expert_bytes for ids, _ in routes)

    ours = [functools.partial(gguf_moe, x, w13, w2, wts, ids, q, q) for ids, wts in routes]
    y = ours[0]()
    plugin, status = _plugin_moe()
    plugin_us, plugin_err = None, status if plugin is None else None
    rel = None
    if plugin is not None:
        try:
            y_plugin = plugin(x, w13, w2, routes[0][1], routes[0][0], int(q), int(q), "silu")
            rel = ((y.float() - y_plugin.float()).norm() / y_plugin.float().norm()).item()
            assert rel < 2e-2, f"glm5serve MoE differs from the plugin's by {rel:.3g}"
        except AssertionError:
            raise
        except Exception as e:  # noqa: BLE001
            plugin_err = f"{type(e).__name__}: {e}"[:160]
        if plugin_err is None:
            plugin_us, plugin_err = _try_time(lambda: [functools.partial(plugin, x, w13, w2, wts, ids, int(q), int(q),
                                                                         "silu") for ids, wts in routes])
    ours_us, graph = _graph_us(ours)
    row = dict(kind="moe", shape=f"MoE 256 experts top-8, I={inter}", layout=layout, N=MOE_H, K=inter,
               type=q.name, batch=T, weight_MB=mean_bytes / 1e6, ours_us=ours_us, plugin_us=plugin_us,
               cublas_bf16_us=None, ours_GBps=mean_bytes / ours_us / 1e3,
               copy_fraction=mean_bytes / (ours_us * 1e-6) / copy_bw,
               x_plugin=plugin_us / ours_us if plugin_us else None, x_cublas=None,
               plugin="plugin fused MoE" if plugin_err is None else plugin_err, rel_err=rel, config="")
    results.add(row)
    benchmark.extra_info.update(row)
    benchmark.pedantic(lambda: (graph.replay(), torch.cuda.synchronize()), rounds=5, iterations=1)
    del w13, w2, graph
    torch.cuda.empty_cache()


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def _write_report(rows: list[dict], copy_bw: float, echo: bool = True) -> None:
    if not rows:
        return
    name = torch.cuda.get_device_name()
    lines = [f"# GGUF decode kernels on {name}", "",
             f"Copy bandwidth (read + write, 1 GiB, same run): {copy_bw / 1e12:.2f} TB/s. "
             f"Times per call under CUDA graphs, weights rotated over >= {ROTATE_BYTES >> 20} MB.", "",
             "| shape | layout | N x K | type | batch | weight MB | glm5serve us | no PDL us | plugin us "
             "| bf16 cuBLAS us | GB/s | % copy BW | x plugin | x cuBLAS |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['layout']} | {r['N']}x{r['K']} | {r['type']} | {r['batch']} "
                     f"| {r['weight_MB']:.1f} | {r['ours_us']:.1f} | {_fmt(r.get('no_pdl_us'), '.1f')} "
                     f"| {_fmt(r['plugin_us'], '.1f')} "
                     f"| {_fmt(r['cublas_bf16_us'], '.1f')} | {r['ours_GBps']:.0f} | {100 * r['copy_fraction']:.0f} "
                     f"| {_fmt(r['x_plugin'], '.1f')} | {_fmt(r['x_cublas'], '.2f')} |")
    gemv = [r for r in rows if r["kind"] == "gemv"]
    big = [r for r in gemv if r["batch"] == 1 and r["weight_MB"] >= 8]
    moe_big = [r for r in rows if r["kind"] == "moe" and r["batch"] == 1 and r["weight_MB"] >= 8]
    small_batch = [r for r in gemv if r["batch"] <= 4]
    vs_plugin = [r for r in rows if r["x_plugin"] and r["batch"] <= 16]
    large = [r for r in rows if r["x_plugin"] and r["batch"] > 16]
    lines += ["", "Targets (issue 8):",
              f"- >= 50 % of copy bandwidth at batch 1 for weights >= 8 MB: "
              f"{sum(r['copy_fraction'] >= 0.5 for r in big)}/{len(big)} "
              f"(min {min((100 * r['copy_fraction'] for r in big), default=0):.0f} %); the MoE at batch 1 (the "
              f"experts one token reads): {sum(r['copy_fraction'] >= 0.5 for r in moe_big)}/{len(moe_big)} "
              f"(min {min((100 * r['copy_fraction'] for r in moe_big), default=0):.0f} %)",
              f"- faster than bf16 cuBLAS at batch <= 4: {sum(r['x_cublas'] > 1 for r in small_batch)}/"
              f"{len(small_batch)} (min {min((r['x_cublas'] for r in small_batch), default=0):.2f}x)",
              f"- >= 10x the plugin's kernels: {sum(r['x_plugin'] >= 10 for r in vs_plugin)}/{len(vs_plugin)} "
              f"(min {min((r['x_plugin'] for r in vs_plugin), default=0):.1f}x)",
              f"- past decode (batch {'/'.join(map(str, LARGE_BATCHES))}), faster than the plugin: "
              f"{sum(r['x_plugin'] > 1 for r in large)}/{len(large)} "
              f"(min {min((r['x_plugin'] for r in large), default=0):.2f}x)",
              "", "Plugin backend / errors: " + "; ".join(sorted({str(r['plugin']) for r in rows}))]
    text = "\n".join(lines)
    if echo:
        print("\n" + text)
    out = os.environ.get("GLM5SERVE_BENCH_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "bench_kernels.md").write_text(text + "\n")
        (Path(out) / "bench_kernels.json").write_text(json.dumps(
            dict(device=name, copy_bw_Bps=copy_bw, rows=rows), indent=1))


# ---------------------------------------------------------------------------------------------------------------
# Opt-in sweep of launch configs -> tuned/<device>.json
# ---------------------------------------------------------------------------------------------------------------

def _sweep_grid(qtype, M, N, K, sms):
    qk = GGML_QUANT_SIZES[qtype][0]
    nb = K // qk
    kbs_set = (1, 2, 4) if qk == 256 else (4, 8, 16)
    grid = []
    for use_dot in ((False, True) if M == 1 else (True,)):  # FMA path: one activation row
        for block_n in ((32, 64) if use_dot else (8, 16, 32)):
            for kbs in kbs_set:
                if kbs > nb or (use_dot and kbs * qk < 64):
                    continue
                steps = math.ceil(nb / kbs)
                for per_sm in (1, 4, 16):
                    split = max(1, min(steps, math.ceil(per_sm * sms / math.ceil(N / block_n))))
                    for warps in (4, 8):
                        grid.append(GemvConfig(block_n=block_n, kbs=kbs, split_k=split, num_warps=warps,
                                               use_dot=use_dot))
    if M <= Q8_MAX_M and _q8_applies(int(qtype), nb):  # int8 activations (session 14 found 8-row, 2-warp tiles here)
        big = _qbytes(qtype, N, K) >= PREFETCH_MIN_BYTES
        for block_n in (4, 8, 16, 32, 64):
            for kbs in (2, 4, 8):
                if kbs > nb:
                    continue
                steps = math.ceil(nb / kbs)
                for per_sm in (2, 8, 24):
                    split = max(1, min(steps, math.ceil(per_sm * sms / math.ceil(N / block_n))))
                    for warps in (2, 4):
                        for prefetch in ((0, 1) if big else (0,)):
                            for ahead in ((False, True) if qtype in (Q.Q4_K, Q.Q5_K) and M > 1 else (False,)):
                                grid.append(GemvConfig(block_n=block_n, kbs=kbs, split_k=split, num_warps=warps,
                                                       prefetch=prefetch, q8=True, ahead=ahead))
    return list(dict.fromkeys(grid))


SWEEP_TYPES = [Q[t] for t in os.environ.get("GLM5SERVE_BENCH_SWEEP_TYPES", "Q4_K").split(",")]
SWEEP_BATCHES = [int(m) for m in os.environ.get("GLM5SERVE_BENCH_SWEEP_BATCHES", "1,4,16").split(",")]


def _table_to_json(name, payload):
    """A module fixture: a dict the tests fill, written at the end to ``$GLM5SERVE_BENCH_OUT/name()`` as
    ``{"device": ..., **payload(the dict)}``."""
    @pytest.fixture(scope="module")
    def fixture():
        table: dict[str, dict] = {}
        yield table
        out = os.environ.get("GLM5SERVE_BENCH_OUT")
        if table and out:
            path = Path(out) / name()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"device": torch.cuda.get_device_name(), **payload(table)}, indent=1))
    return fixture


sweep_table = _table_to_json(lambda: f"tuned/{_device_info(torch.device(DEV))[1]}.json", lambda table: dict(
    configs={k: v["config"] for k, v in table.items()}, timings_us={k: v["us"] for k, v in table.items()},
    heuristic_us={k: v["heuristic_us"] for k, v in table.items()}))


@pytest.mark.skipif(os.environ.get("GLM5SERVE_BENCH_SWEEP") != "1", reason="opt-in: GLM5SERVE_BENCH_SWEEP=1")
@pytest.mark.parametrize("M", SWEEP_BATCHES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("qtype", SWEEP_TYPES, ids=lambda q: q.name)
def test_sweep_gemv_configs(sweep_table, qtype, shape, M):
    N, K, _ = SHAPES[shape]
    sms, device = _device_info(torch.device(DEV))
    gen = torch.Generator(DEV).manual_seed(1)
    ws = _copies(lambda: random_qweight_torch(qtype, (N, K), DEV, gen), _qbytes(qtype, N, K))
    x = torch.randn(M, K, device=DEV, generator=gen).to(torch.bfloat16)
    ref = gguf_linear(x, ws[0], qtype, N, GemvConfig(split_k=1)).float()
    timings = {}
    for cfg in _sweep_grid(qtype, M, N, K, sms):
        y = gguf_linear(x, ws[0], qtype, N, cfg).float()
        assert ((y - ref).norm() / ref.norm()).item() < 1e-2, cfg
        timings[cfg] = _graph_us([functools.partial(gguf_linear, x, w, qtype, N, cfg) for w in ws])[0]
    best = min(timings, key=timings.get)
    default = pick_config.__wrapped__(qtype, M, N, K, sms, x.dtype)  # the heuristic, ignoring tuned files
    default_us = timings.get(default) or _graph_us([functools.partial(gguf_linear, x, w, qtype, N, default)
                                                    for w in ws])[0]
    sweep_table[f"{int(qtype)},{M},{N},{K}"] = dict(config=dataclasses.asdict(best), us=timings[best],
                                                   heuristic_us=default_us)
    print(f"\n{qtype.name} {shape} M={M}: best {timings[best]:.1f} us {best}; heuristic {default_us:.1f} us")
    del ws
    torch.cuda.empty_cache()


#: split-row tiles swept: (rows, kbs, programs per SM aimed at, warps), as ``gguf_split._SPLIT_TILE`` holds them
SPLIT_SWEEP_TILES = [(bn, kbs, per_sm, warps) for bn in (4, 8, 16, 32, 64) for kbs in (4, 8, 16, 32, 64, 128)
                     for per_sm in (2, 8, 24) for warps in (2, 4, 8)]


split_sweep_table = _table_to_json(lambda: "split_sweep.json", lambda table: {"cases": table})


@pytest.mark.skipif(os.environ.get("GLM5SERVE_BENCH_SWEEP") != "1", reason="opt-in: GLM5SERVE_BENCH_SWEEP=1")
@pytest.mark.parametrize("M", [m for m in SWEEP_BATCHES if m <= 16])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("qtype", [q for q in SWEEP_TYPES if int(q) in SPLITTABLE], ids=lambda q: q.name)
def test_sweep_split_tiles(split_sweep_table, qtype, shape, M):
    N, K, _ = SHAPES[shape]
    if not can_split(qtype, K):
        pytest.skip(f"{qtype.name} rows of K={K} have no split layout")
    sms, _ = _device_info(torch.device(DEV))
    gen = torch.Generator(DEV).manual_seed(3)
    stype = split_type(qtype)
    ws = _copies(lambda: split_rows(random_qweight_torch(qtype, (N, K), DEV, gen), qtype, K), _qbytes(qtype, N, K))
    x = torch.randn(M, K, device=DEV, generator=gen).to(torch.bfloat16)
    prod = pick_split_config(stype, M, N, K, sms)
    ref = gguf_linear(x, ws[0], stype, N, prod).float()
    timings = {}
    for tile in SPLIT_SWEEP_TILES:
        cfg = pick_split_config(stype, M, N, K, sms, tile)
        if cfg not in timings:  # tiles that differ only in a split-K aim the row tiles make moot
            y = gguf_linear(x, ws[0], stype, N, cfg).float()
            assert ((y - ref).norm() / ref.norm()).item() < 1e-3, cfg  # only the fp32 summation order differs
            timings[cfg] = (tile, _graph_us([functools.partial(gguf_linear, x, w, stype, N, cfg) for w in ws])[0])
    prod_us = timings[prod][1] if prod in timings else _graph_us(
        [functools.partial(gguf_linear, x, w, stype, N, prod) for w in ws])[0]
    best = sorted(timings.values(), key=lambda v: v[1])[:5]
    split_sweep_table[f"{qtype.name} {shape} M={M}"] = dict(production_us=prod_us, best=[
        dict(tile=list(t), split_k=c.split_k, us=u) for c, (t, u) in timings.items() if (t, u) in best])
    print(f"\n{qtype.name}/split {shape} M={M}: production {prod_us:.1f} us; best "
          + "; ".join(f"{u:.1f} us {t}" for t, u in best))
    del ws
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# Opt-in comparison of programmatic dependent launch modes -> pdl_modes.json
# ---------------------------------------------------------------------------------------------------------------

#: a row of each kernel path at batches 1 and 4 (FMA decode, int8 activations, split rows, tensor cores)
PDL_ROWS = [(Q.Q4_K, "expert gate/up", 1), (Q.Q4_K, "expert gate/up", 4), (Q.Q4_K, "lm_head/8", 1),
            (Q.Q4_K, "lm_head/8", 4), (Q.Q4_K, "q_b/8", 1), (Q.Q4_K, "expert gate/up", 16),
            (Q.Q6_K, "expert gate/up", 1), (Q.Q6_K, "expert gate/up", 4), (Q.Q6_K, "expert down", 4),
            (Q.Q6_K, "lm_head/8", 4), (Q.Q5_0, "expert gate/up", 1), (Q.Q5_0, "expert gate/up", 4),
            (Q.Q8_0, "expert gate/up", 4)]
#: name: (PDL_MODE, PDL_MAX_STEPS, a small torch op before each GEMV, as a norm precedes it in a model)
PDL_VARIANTS = {"off": ("off", 4, False), "wait": ("wait", 4, False), "prefetch 1": ("prefetch", 1, False),
                "prefetch 4": ("prefetch", 4, False), "off after op": ("off", 4, True),
                "wait after op": ("wait", 4, True), "prefetch 4 after op": ("prefetch", 4, True),
                "off again": ("off", 4, False)}


pdl_table = _table_to_json(lambda: "pdl_modes.json", lambda table: {"us": table})


@pytest.mark.skipif(os.environ.get("GLM5SERVE_BENCH_PDL") != "1", reason="opt-in: GLM5SERVE_BENCH_PDL=1")
@pytest.mark.parametrize("qtype,shape,M", PDL_ROWS, ids=[f"{q.name}-{s}-{m}" for q, s, m in PDL_ROWS])
def test_bench_pdl_modes(pdl_table, qtype, shape, M):
    """Microseconds per call of one row under each ``PDL_VARIANTS`` entry, same run ("off again" last: drift)."""
    N, K, _ = SHAPES[shape]
    gen = torch.Generator(DEV).manual_seed(N + K + int(qtype))
    ws = _copies(lambda: random_qweight_torch(qtype, (N, K), DEV, gen), _qbytes(qtype, N, K))
    served = [as_served(w, qtype, K) for w in ws]
    x = torch.randn(M, K, device=DEV, generator=gen).to(torch.bfloat16)
    scratch = torch.zeros(M, 64, device=DEV)
    times = {}
    for name, (mode, steps, op) in PDL_VARIANTS.items():
        fns = [functools.partial(lambda w, t, op: (scratch.add_(1.0) if op else None, gguf_linear(x, w, t, N))[1],
                                 w, t, op) for w, t in served]
        with _pdl(mode, steps):
            times[name] = graph_us(fns, CALLS, REPLAYS)[0]
    pdl_table[f"{qtype.name} {shape} M={M}"] = times
    print(f"\n{qtype.name} {shape} M={M}: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    del ws, served
    torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# Opt-in sweep of int8 tensor-core tiles (``gguf_mma``) -> mma_sweep.json
# ---------------------------------------------------------------------------------------------------------------

#: (type, shape, batch) swept: ``$GLM5SERVE_BENCH_SWEEP_MMA`` as "Q6_K:lm_head/8:16,Q4_K:expert down:16"; the
#: default is the tensor-core row furthest from 10x the plugin (H100, session 33: 36 % of copy bandwidth, 66 % needed)
MMA_SWEEP_CASES = [(Q[t.strip()], s.strip(), int(m)) for t, s, m in (c.split(":") for c in os.environ.get(
    "GLM5SERVE_BENCH_SWEEP_MMA", "Q6_K:lm_head/8:16").split(","))]
#: seconds of timing per case before the rest of the grid is skipped (each new tile also compiles a kernel)
MMA_SWEEP_BUDGET_S = float(os.environ.get("GLM5SERVE_BENCH_SWEEP_MMA_S", "200"))


def _mma_grid(qtype, M, N, K, sms, split: bool):
    """Tensor-core launch configs: rows per program x warps x pipelining stages x super-blocks per step (GGUF rows;
    split rows take whole 256-element steps) x split-K 1/2/4/8 (deduplicated by the split they end up with)."""
    nb = K // 256
    grid = []
    for block_n, warps in ((64, 2), (32, 2), (64, 4), (128, 4), (32, 1), (16, 1), (128, 8)):  # 64 on 1 spills
        for stages in (1, 2, 3):
            for kbs in ((8,) if split else (1, 2)):
                for split_k in (1, 2, 4, 8):
                    steps = nb if split else math.ceil(nb / kbs)
                    per = math.ceil(steps / split_k) * (1 if split else kbs)
                    grid.append(GemvConfig(block_n=block_n, kbs=kbs, split_k=math.ceil(nb / per), num_warps=warps,
                                           block_m=16 if M > 8 else 8, q8=split, mma=True, stages=stages))
    return list(dict.fromkeys(grid))


mma_sweep_table = _table_to_json(lambda: "mma_sweep.json", lambda table: {"cases": table})


@pytest.mark.skipif(os.environ.get("GLM5SERVE_BENCH_SWEEP") != "1", reason="opt-in: GLM5SERVE_BENCH_SWEEP=1")
@pytest.mark.parametrize("qtype,shape,M", MMA_SWEEP_CASES, ids=[f"{q.name}-{s}-{m}" for q, s, m in MMA_SWEEP_CASES])
def test_sweep_mma_tiles(mma_sweep_table, qtype, shape, M):
    """Times the tensor-core tiles of ``_mma_grid`` on weights as served against the production config, same run;
    each tile's output must match the production one up to fp32 summation order."""
    N, K, _ = SHAPES[shape]
    sms, device = _device_info(torch.device(DEV))
    gen = torch.Generator(DEV).manual_seed(5)
    served = [as_served(w, qtype, K) for w in _copies(lambda: random_qweight_torch(qtype, (N, K), DEV, gen),
                                                      _qbytes(qtype, N, K))]
    stype = served[0][1]
    x = torch.randn(M, K, device=DEV, generator=gen).to(torch.bfloat16)
    prod = (pick_split_config(stype, M, N, K, sms) if stype in SPLIT_QTYPES
            else pick_config(qtype, M, N, K, sms, x.dtype, device))
    assert prod.mma, f"{qtype.name} {shape} M={M} does not run on the tensor cores ({prod})"
    ref = gguf_linear(x, served[0][0], stype, N, prod).float()
    timings = {prod: _graph_us([functools.partial(gguf_linear, x, w, t, N, prod) for w, t in served])[0]}
    start, skipped, failed = time.monotonic(), 0, []
    for cfg in _mma_grid(qtype, M, N, K, sms, stype in SPLIT_QTYPES):
        if cfg in timings:
            continue
        if time.monotonic() - start > MMA_SWEEP_BUDGET_S:
            skipped += 1
            continue
        try:
            y = gguf_linear(x, served[0][0], stype, N, cfg).float()
        except triton.runtime.errors.OutOfResources as e:  # shared memory or registers: not a candidate
            failed.append(f"{cfg}: {e}"[:200])
            continue
        assert ((y - ref).norm() / ref.norm()).item() < 1e-3, cfg  # only the fp32 summation order differs
        timings[cfg] = _graph_us([functools.partial(gguf_linear, x, w, t, N, cfg) for w, t in served])[0]
    prod_again = _graph_us([functools.partial(gguf_linear, x, w, t, N, prod) for w, t in served])[0]  # drift
    best = sorted(timings, key=timings.get)[:8]
    mma_sweep_table[f"{qtype.name} {shape} M={M}"] = dict(
        production=dataclasses.asdict(prod), production_us=[timings[prod], prod_again], timed=len(timings),
        skipped=skipped, failed=failed, best=[dict(config=dataclasses.asdict(c), us=timings[c]) for c in best])
    print(f"\n{qtype.name} {shape} M={M}: production {timings[prod]:.1f} / {prod_again:.1f} us {prod}; "
          f"{len(timings)} timed, {skipped} skipped, {len(failed)} out of resources; best "
          + "; ".join(f"{timings[c]:.1f} us {c}" for c in best[:4]))
    del served
    torch.cuda.empty_cache()

"""Per-layer capture inside vLLM (:mod:`glm5serve.testing.layer_capture`, what ``vllm_runner --capture-layers``
records) on vLLM's own GLM-5 model on the CPU, against the reference engine's first layers.

vLLM's model (``deepseek_v2.py``, the class vLLM 0.25 runs on GPUs) is built and loaded from the tiny GGUF by
:func:`glm5serve.vllm_plugin.cpu.build_and_load`; its layers run as written, with these CPU stand-ins only: the
plugin's GGUF GEMMs (:mod:`vllm_layers`: exact dequantized values, fp64 sums), vLLM's custom ops in their
``forward_native`` PyTorch form (their CPU forms need ``vllm._C``, not built here), and the attention core
(``MLAAttention.forward``, kernels only) by :func:`dense_mla`, dense causal MLA — what DSA computes for prompts of at
most ``index_topk`` (8) tokens, where it keeps every causal key; the indexer is skipped accordingly. Optionally
(:func:`q8_activations`) the GEMM stand-ins first round their input as the GPU's GGUF kernels do (``ggml_mul_mat_a8``
and friends quantize activations to 8 bits, Q8_1), which is how ``LAYER_REL_TOL`` was chosen.
"""
from __future__ import annotations

import contextlib
import pickle

import pytest
import torch

from glm5serve.reference import ReferenceModel
from glm5serve.testing.layer_capture import (
    LAYER_REL_TOL, ROUTER_NEAR_TIE, collect_capture, layer_errors, prefill_states, router_near_ties, start_capture)
from vllm_layers import _simulated, running_rank, tiny_vllm_model, vllm_layers  # noqa: F401

N_LAYERS = 3  # all of tiny's: one dense layer, two MoE
LENGTHS = (1, 2, 3, 4, 5, 6, 7, 8) * 2  # at most index_topk
#: router near-tie margin for the runs with exact GEMMs: flips measured at margins up to 0.011 (tiny and narrow,
#: bf16); layer_capture.ROUTER_NEAR_TIE (0.05) also covers 8-bit activations (flips up to 0.025)
EXACT_GEMM_NEAR_TIE = 0.02


def dense_mla(self, q, kv_c_normed, k_pe, output_shape=None, **kwargs):
    """Stand-in for ``MLAAttention.forward`` (one prefill, no cache): causal softmax attention of ``q`` (T, nh,
    nope+rope) over keys ``[W_UK c; k_pe]`` and values ``W_UV c`` from ``kv_b_proj`` (expanded MLA, DeepSeek-V2
    sec. 2.1), fp32 inside, output (T, nh·v) in ``q``'s dtype like vLLM's kernels."""
    T, nh, nope, v = q.shape[0], self.num_heads, self.qk_nope_head_dim, self.v_head_dim
    kv = self.kv_b_proj(kv_c_normed)[0].view(T, nh, nope + v).float()
    k = torch.cat([kv[..., :nope], k_pe.float().expand(T, nh, k_pe.shape[-1])], dim=-1)
    scores = torch.einsum("thd,shd->hts", q.float(), k) * self.scale
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", probs, kv[..., nope:]).reshape(T, nh * v).to(q.dtype)


@contextlib.contextmanager
def cpu_forward(model):
    """Within the block ``model.model(ids, positions, None)`` runs on the CPU (see the module docstring)."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.models.deepseek_v2 import Indexer

    from glm5serve.vllm_plugin.cpu import StubSparseMLAImpl

    ops = [m for m in model.modules() if isinstance(m, CustomOp)]
    saved = [m._forward_method for m in ops]
    with pytest.MonkeyPatch.context() as mp, running_rank(model), torch._dynamo.config.patch(disable=True):
        mp.setattr(MLAAttention, "forward", dense_mla)
        mp.setattr(Indexer, "forward", lambda self, *args, **kwargs: None)
        mp.setattr(StubSparseMLAImpl, "record_logical_topk_ready", lambda self: None, raising=False)
        for m in ops:
            m._forward_method = m.forward_native
        try:
            yield
        finally:
            for m, f in zip(ops, saved):
                m._forward_method = f


def q8(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded as ggml's Q8_1 stores it: blocks of 32 along the last dim, scale ``amax/127`` in fp16, int8
    values (llama.cpp ``quantize_row_q8_1``), returned dequantized in ``x``'s dtype."""
    blocks = x.float().view(*x.shape[:-1], -1, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    return (torch.round(blocks / d.clamp_min(1e-30)).clamp(-127, 127) * d).view(x.shape).to(x.dtype)


@contextlib.contextmanager
def q8_activations():
    """Within the block the CPU GEMM stand-ins quantize their activations like the GPU's GGUF kernels: the input of
    every matmul with a quantized weight, and both MoE GEMMs' inputs (``ggml_moe_a8``)."""
    import vllm_layers

    mul_mat = vllm_layers.cpu_fused_mul_mat_gguf

    def mul_mat_q8(x, qweight, qweight_type):
        return mul_mat(x if vllm_layers.Q(int(qweight_type)) in vllm_layers.FLOAT_TYPES else q8(x), qweight,
                       qweight_type)

    def moe_q8(x, w1, w2, topk_weights, topk_ids, qweight_type, qweight_type2, activation):
        out = torch.zeros(x.shape, dtype=torch.float64)
        w13, w2_values = vllm_layers._values(w1, qweight_type), vllm_layers._values(w2, qweight_type2)
        xq = q8(x)
        for e in topk_ids.unique().tolist():
            tok, slot = (topk_ids == e).nonzero(as_tuple=True)
            g, u = (xq[tok].double() @ w13[e].T).chunk(2, dim=-1)
            y = q8((torch.nn.functional.silu(g) * u).to(x.dtype)).double() @ w2_values[e].T
            out.index_add_(0, tok, y * topk_weights[tok, slot, None].double())
        return out.to(x.dtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_layers, "cpu_fused_mul_mat_gguf", mul_mat_q8)
        mp.setattr(vllm_layers, "cpu_fused_moe_gguf", moe_q8)
        yield


def run_prefill(model, ids: list[int]) -> None:
    with cpu_forward(model), torch.inference_mode():
        model.model(torch.tensor(ids), torch.arange(len(ids)), None)


def captured(model, ids: list[int], n: int = N_LAYERS) -> torch.Tensor:
    assert start_capture(model, n) == min(n, N_LAYERS)
    run_prefill(model, ids)
    return prefill_states(collect_capture(model), len(ids))


_BF16: dict = {}


def tiny_bf16_model(path):
    """vLLM's GLM-5 on tiny in bf16 (the GPU runs' dtype), as :func:`vllm_layers.tiny_vllm_model` builds fp32."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from glm5serve.vllm_plugin.cpu import build_and_load

    if str(path) not in _BF16:
        model, _ = build_and_load(path, dtype=torch.bfloat16)
        with _simulated(1, 0):
            for m in model.modules():
                if isinstance(m, (LinearBase, VocabParallelEmbedding)) or hasattr(m, "w13_qweight"):
                    m.quant_method.process_weights_after_loading(m)
        _BF16[str(path)] = model
    return _BF16[str(path)]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    return ReferenceModel.from_gguf(tiny_checkpoint, qa_kv_norm_eps="rms_norm_eps", num_layers=N_LAYERS)


@pytest.fixture(scope="module")
def prompts(reference):
    g = torch.Generator().manual_seed(0)
    assert max(LENGTHS) <= reference.index_topk, "dense_mla is DSA only up to index_topk tokens"
    return [torch.randint(0, reference.cfg.vocab_size, (n,), generator=g).tolist() for n in LENGTHS]


def test_fp32_capture_is_the_residual_stream_after_each_layer(vllm_layers, tiny_checkpoint, reference,  # noqa: F811
                                                              prompts):
    """In fp32 vLLM's captured states equal the reference's layer outputs to float rounding (measured ≤ 9e-7): the
    hooks sit on the right layers, in order, and ``hidden_states + residual`` is the stream."""
    model = tiny_vllm_model(tiny_checkpoint)
    for ids in prompts[:4]:
        states = captured(model, ids)
        assert states.shape == (N_LAYERS, len(ids), reference.cfg.hidden_size) and states.dtype == torch.float32
        _, hidden = reference.forward(ids, capture=True)
        errs = layer_errors(states, hidden[1:])
        assert errs.max() <= 1e-5, f"{len(ids)} tokens: per-layer max {errs.amax(1).tolist()}"
        assert layer_errors(states[:1], hidden[2:3]).max() > 0.1, "layers are told apart"
    start_capture(model, 99)
    collect_capture(model)
    run_prefill(model, prompts[0])
    assert collect_capture(model) == [], "hooks are gone after collect_capture"


@pytest.mark.parametrize("activations,tau,share", [("exact", EXACT_GEMM_NEAR_TIE, 0.25),
                                                   ("q8", ROUTER_NEAR_TIE, 0.05)])
def test_bf16_layer_outputs_within_the_stated_bound(vllm_layers, tiny_checkpoint, reference, prompts,  # noqa: F811
                                                    activations, tau, share):
    """vLLM in bf16 (the GPU dtype) vs the fp32 reference: every position of every layer within LAYER_REL_TOL,
    except after a router near-tie (margin < ``tau``; tiny's experts are unrelated random matrices: a flipped
    expert moves a token's stream by up to ~80%, measured), with exact GEMMs and with 8-bit activations as the GPU
    kernels round them (measured worst per layer: 0.0088/0.0152/0.0155 and 0.0204/0.0260/0.0277)."""
    model = tiny_bf16_model(tiny_checkpoint)
    worst, checked = torch.zeros(N_LAYERS, dtype=torch.float64), torch.zeros(N_LAYERS, dtype=torch.long)
    for ids in prompts:
        _, hidden = reference.forward(ids, capture=True)
        with q8_activations() if activations == "q8" else contextlib.nullcontext():
            states = captured(model, ids)
        errs = layer_errors(states, hidden[1:])
        near = router_near_ties(reference, ids, N_LAYERS, tau)
        assert not near[0].any(), "layer 0 is dense"
        ok = errs[~near]
        assert (ok <= LAYER_REL_TOL).all(), f"{len(ids)} tokens: errors {errs.tolist()}, near-ties {near.tolist()}"
        worst = torch.maximum(worst, errs.masked_fill(near, 0).amax(1))
        checked += (~near).sum(1)
    print(f"\nbf16 ({activations} GEMM inputs) vs fp32 reference, worst per layer away from near-ties: "
          f"{worst.tolist()}; positions checked per layer {checked.tolist()} of {sum(LENGTHS)}")
    assert (checked >= share * sum(LENGTHS)).all(), "a fair share of positions is away from router near-ties"
    assert worst[0] > 1e-3, "bf16 differs from fp32 (the comparison is not vacuous)"


class InProcessLLM:
    """What :func:`vllm_runner.capture_prefill_states` uses of ``vllm.LLM``, over the CPU model: ``apply_model``
    pickles the function as vLLM does for TP worker processes."""

    def __init__(self, model):
        self.model, self.prefills = model, 0

    def reset_prefix_cache(self):
        return True

    def apply_model(self, func):
        return [pickle.loads(pickle.dumps(func))(self.model)]

    def generate(self, requests, sampling_params, use_tqdm=False):
        for r in requests:
            run_prefill(self.model, r["prompt_token_ids"])
            self.prefills += 1


def test_runner_captures_every_prompt_through_apply_model(vllm_layers, tiny_checkpoint, prompts):  # noqa: F811
    from glm5serve.testing.vllm_runner import capture_prefill_states

    model = tiny_vllm_model(tiny_checkpoint)
    llm = InProcessLLM(model)
    states = capture_prefill_states(llm, prompts[:3], 2)
    assert llm.prefills == 3 and len(states) == 3
    for ids, s in zip(prompts[:3], states):
        assert torch.equal(s, captured(model, ids, 2)), "the runner records what the hooks see"


class DeepseekV32DecoderLayer(torch.nn.Module):
    """Named like vLLM 0.33's CUDA layer, which returns its MLP output before the all-reduce."""

    def forward(self, positions, hidden_states, residual):
        return hidden_states, residual


def test_unreduced_layer_output_is_all_reduced_before_the_sum(monkeypatch):
    import vllm.distributed as dist

    holder = torch.nn.Module()
    holder.model = torch.nn.Module()
    holder.model.layers = torch.nn.ModuleList([DeepseekV32DecoderLayer()])
    h, r = torch.randn(4, 8), torch.randn(4, 8)
    monkeypatch.setattr(dist, "get_tensor_model_parallel_world_size", lambda: 2)
    monkeypatch.setattr(dist, "tensor_model_parallel_all_reduce", lambda t: 2 * t)  # the other rank holds as much
    start_capture(holder, 1)
    holder.model.layers[0](torch.arange(4), h, r)
    (got,) = prefill_states(collect_capture(holder), 4)
    assert torch.equal(got, 2 * h + r)


def test_prefill_states_refuses_missing_or_short_captures():
    with pytest.raises(RuntimeError, match="no layer output"):
        prefill_states([], 3)
    with pytest.raises(RuntimeError, match="prefix-cache hit"):
        prefill_states([[torch.zeros(2, 4)]], 3)
    padded = [[torch.arange(20.0).view(5, 4)], [torch.zeros(1, 4)]]
    assert torch.equal(prefill_states(padded, 3), torch.arange(12.0).view(1, 3, 4)), "first pass, padding dropped"


def test_start_capture_refuses_a_model_without_decoder_layers():
    with pytest.raises(TypeError, match="model.layers"):
        start_capture(torch.nn.Linear(2, 2), 1)


def test_runner_saves_the_layer_states_beside_the_record(tmp_path, monkeypatch):
    import json

    from glm5serve.testing import vllm_runner

    states = [torch.randn(2, 3, 4), torch.randn(2, 5, 4)]
    seen = {}

    def fake_run(model, batches, **kwargs):
        seen.update(kwargs)
        return {"init_s": 0, "generate_s": 0, "batches": [], "scores": [], "layer_states": list(states)}

    monkeypatch.setattr(vllm_runner, "run", fake_run)
    (tmp_path / "b.json").write_text(json.dumps([[[1, 2, 3]], [[4, 5, 6, 7, 8]]]))
    out = tmp_path / "r.json"
    assert vllm_runner.main(["--model", "m.gguf", "--batches", str(tmp_path / "b.json"), "--out", str(out),
                             "--capture-layers", "2"]) == 0
    assert seen["capture_layers"] == 2
    assert json.loads(out.read_text())["layers_file"] == "r.layers.pt"
    assert all(torch.equal(a, b) for a, b in zip(vllm_runner.load_layer_states(out), states, strict=True))

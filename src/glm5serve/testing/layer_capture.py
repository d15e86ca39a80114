"""The residual stream after vLLM's first decoder layers, recorded inside the engine (for per-layer comparisons
with the reference engine's ``forward(..., capture=True)``).

Used through ``LLM.apply_model``, which runs a function on the model in every worker (TP ranks are separate
processes: the function is pickled, so it must be a module-level function here or a ``functools.partial`` of one)::

    llm.apply_model(functools.partial(start_capture, num_layers=3))
    llm.generate(...)                          # every forward pass appends one entry per hooked layer
    calls = llm.apply_model(collect_capture)[0]  # rank 0's: calls[c][i] is layer i's (T, H) fp32 CPU tensor

vLLM's DeepSeek-V2/V3.2 decoder layers (``model_executor/models/deepseek_v2.py`` ``DeepseekV2DecoderLayer``, 0.25 and
0.33) return ``(hidden_states, residual)`` for the next layer's fused add + RMSNorm, so the residual stream after
layer ``i`` is their sum. That layer all-reduces its MLP/MoE output, so under TP every rank holds the same stream.
vLLM 0.33's CUDA class (``models/deepseek_v32/nvidia/model.py`` ``DeepseekV32DecoderLayer``) leaves the MLP/MoE
output un-reduced and fuses the all-reduce into the next layer's norm: there the hook all-reduces a copy itself
(every rank runs the hook at the same point, so the collective is matched).

Hooks fire only where the module runs eagerly (eager mode, or the eager prefill of a graphs-without-compile
engine); a torch.compile'd or graph-replayed forward records nothing.
"""
from __future__ import annotations

import functools

import torch

#: per-position bound on ``‖vLLM − reference‖ / ‖reference‖`` of the residual stream after each compared layer
#: (vLLM bf16, reference fp32 from the same GGUF). Measured through the CPU harness (vLLM's own layers in bf16,
#: ``tests/properties/test_layer_capture.py``) on tiny and narrow, prompts of 1-200 tokens, away from router
#: near-ties: with exact GEMMs worst 0.0093 after the dense layer and 0.0155 after an MoE layer (median 0.007);
#: with activations rounded to 8 bits first, as the GPU's GGUF kernels do (``ggml_mul_mat_a8``, ``ggml_moe_a8``:
#: Q8_1), worst 0.020 dense and 0.028 MoE (median 0.011). 1.8x that. Faults it catches (narrow, measured): two
#: query heads swapped in layer 0, or RoPE on the wrong pairs, give 0.14-0.24 median, up to 0.46.
LAYER_REL_TOL = 5e-2
#: a router top-k margin (sigmoid-score units) below this is a near-tie: vLLM's bf16 router weights and ~1%
#: different inputs can pick another expert, which moves that token's stream by far more than rounding. Flips were
#: measured through the CPU harness at margins up to 0.011 (bf16) and 0.025 (with emulated 8-bit activations).
#: (Looser than the generation tests' 0.005, which is about token flips, not per-layer states.)
ROUTER_NEAR_TIE = 0.05

#: decoder layer classes whose returned ``hidden_states`` is this rank's partial sum (all-reduce deferred)
UNREDUCED_OUTPUT_LAYERS = ("DeepseekV32DecoderLayer",)

_hooks: list = []
_calls: list[list[torch.Tensor]] = []  # per forward pass, per hooked layer


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layers of vLLM's GLM-5 / DeepSeek model (``model.model.layers``), unwrapping a CUDA-graph
    wrapper if the model comes wrapped. Raises TypeError for a model without them."""
    while not hasattr(model, "model") and hasattr(model, "unwrap"):
        model = model.unwrap()
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no model.layers: not a vLLM DeepSeek-style model")
    return layers


def start_capture(model: torch.nn.Module, num_layers: int) -> int:
    """Hook decoder layers ``0..num_layers-1`` of ``model`` (fewer if it has fewer) and clear earlier captures;
    returns how many layers are hooked. Every later forward pass appends, per hooked layer, the residual stream
    after it: ``hidden_states + residual`` in fp32 on the CPU, (num_tokens, hidden_size)."""
    stop_capture(model)
    layers = decoder_layers(model)
    n = min(num_layers, len(layers))
    for i in range(n):
        _hooks.append(layers[i].register_forward_hook(functools.partial(_record, i)))
    return n


def stop_capture(model: torch.nn.Module | None = None) -> None:
    """Remove the hooks and drop what was captured."""
    for h in _hooks:
        h.remove()
    _hooks.clear()
    _calls.clear()


def collect_capture(model: torch.nn.Module | None = None) -> list[list[torch.Tensor]]:
    """What was captured since :func:`start_capture` (``[forward pass][layer]`` → (num_tokens, H) fp32 CPU
    tensor), then the hooks are removed."""
    calls = [list(c) for c in _calls]
    stop_capture(model)
    return calls


def _record(i: int, layer: torch.nn.Module, args, output) -> None:
    hidden, residual = output
    if type(layer).__name__ in UNREDUCED_OUTPUT_LAYERS and not getattr(layer, "use_sequence_parallel", False):
        from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

        if get_tensor_model_parallel_world_size() > 1:
            hidden = tensor_model_parallel_all_reduce(hidden.clone())
    if i == 0:
        _calls.append([])
    _calls[-1].append((hidden.float() + residual.float()).cpu())


def prefill_states(calls: list[list[torch.Tensor]], prompt_len: int) -> torch.Tensor:
    """The (num_layers, prompt_len, H) residual streams of a one-prompt prefill from :func:`collect_capture`'s
    output: the first forward pass, whose rows are the prompt's tokens (padding rows after them are dropped).
    Raises RuntimeError if nothing was captured or the pass holds fewer rows than the prompt (a prefix-cache hit,
    or sequence-parallel layers whose outputs are sharded over ranks)."""
    if not calls or not calls[0]:
        raise RuntimeError("no layer output was captured: the forward pass did not run the hooked layers eagerly")
    first = calls[0]
    if first[0].shape[0] < prompt_len:
        raise RuntimeError(f"the first forward pass holds {first[0].shape[0]} tokens, the prompt {prompt_len}: "
                           "prefix-cache hit or sequence-parallel (sharded) layer outputs")
    return torch.stack([h[:prompt_len] for h in first])


def layer_errors(states: torch.Tensor, reference: list[torch.Tensor]) -> torch.Tensor:
    """(L, T) float64 relative errors ``‖v[i, t] − r[i, t]‖ / ‖r[i, t]‖`` of vLLM's residual streams ``states``
    (L, T, H) against the reference's per-layer (T, H) tensors ``reference`` (the layers' outputs: its captured
    hidden states without the embeddings)."""
    if len(reference) != states.shape[0]:
        raise ValueError(f"{states.shape[0]} captured layers, {len(reference)} reference layers")
    r = torch.stack([x.detach().double().cpu() for x in reference])
    if r.shape != states.shape:
        raise ValueError(f"shapes differ: {tuple(states.shape)} vs reference {tuple(r.shape)}")
    return (states.double() - r).norm(dim=-1) / r.norm(dim=-1)


def router_near_ties(model, input_ids, num_layers: int, tau: float = ROUTER_NEAR_TIE) -> torch.Tensor:
    """(num_layers, T) bool: where the residual stream after a layer may legitimately differ between bf16 and fp32
    engines because an expert choice is a near-tie. ``model`` is a :class:`~glm5serve.reference.ReferenceModel`
    run on ``input_ids``; a top-k margin ``choice[k-1] − choice[k]`` of the sorted choice scores
    (:meth:`~glm5serve.reference.ReferenceModel.router_scores`) below ``tau`` at MoE layer ``j``, position ``s``
    marks ``(j, s)`` and, since later layers' attention reads position ``s``, ``(i, t)`` for every ``i > j``,
    ``t ≥ s``."""
    margins: dict[int, torch.Tensor] = {}
    router = model.router

    def spy(i, x):
        choice = model.router_scores(i, x)[1].sort(-1, descending=True).values
        margins[i] = (choice[:, model.top_k - 1] - choice[:, model.top_k]).cpu()
        return router(i, x)

    model.router = spy
    try:
        model.forward(input_ids, capture=True)
    finally:
        del model.router
    T = len(input_ids)
    near = torch.zeros(num_layers, T, dtype=torch.bool)
    carried = torch.zeros(T, dtype=torch.bool)
    for i in range(num_layers):
        near[i] = carried | (margins[i] < tau if i in margins else False)
        carried = near[i].cumsum(0) > 0
    return near

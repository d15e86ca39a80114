"""Differential-testing helpers for the reference engine: the relative error every comparison uses, transformers'
``GlmMoeDsaForCausalLM`` built from the same HF-named weights, and per-layer hidden states read with forward hooks.
"""
from __future__ import annotations

import copy
from typing import Sequence

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``‖a − b‖_F / ‖b‖_F`` computed in float64 (``b`` is the reference); shapes must match."""
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm())


def hf_model(cfg, weights: dict[str, torch.Tensor], *, qa_kv_norm_eps: float | None = None):
    """transformers ``GlmMoeDsaForCausalLM`` (eager attention, eval mode) holding ``weights`` (strict load).

    ``cfg`` is copied, not changed. ``qa_kv_norm_eps`` overrides the eps transformers hard-codes (1e-6) in every
    ``q_a_layernorm`` and ``kv_a_layernorm``. The dtype is that of ``model.embed_tokens.weight``.
    """
    from transformers import GlmMoeDsaForCausalLM

    cfg = copy.deepcopy(cfg)
    cfg._attn_implementation = "eager"
    dtype = weights["model.embed_tokens.weight"].dtype
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(cfg)
    model.load_state_dict(weights, strict=True, assign=True)
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)  # its inv_freq buffers are not in the state dict
    model = model.to(dtype).eval()
    if qa_kv_norm_eps is not None:
        for layer in model.model.layers:
            layer.self_attn.q_a_layernorm.variance_epsilon = qa_kv_norm_eps
            layer.self_attn.kv_a_layernorm.variance_epsilon = qa_kv_norm_eps
    return model


@torch.inference_mode()
def hf_hidden_states(model, input_ids: Sequence[int] | torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits (T, vocab) fp32 and the residual stream of a transformers model: the embeddings, then the output of
    each decoder layer (fp32 (T, H) each), read with forward hooks."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    hidden: list[torch.Tensor] = []
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, i, o: hidden.append(o[0].float()))]
    for layer in model.model.layers:
        hooks.append(layer.register_forward_hook(
            lambda m, i, o: hidden.append((o[0] if isinstance(o, tuple) else o)[0].float())))
    try:
        logits = model(ids).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return logits, hidden


def first_divergence(actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], tol: float
                     ) -> tuple[int, float] | None:
    """``(index, rel_err)`` of the first pair whose relative error exceeds ``tol`` or is NaN (a NaN or inf in
    either tensor), or None if all agree. Equal finite tensors agree (all-zero ones too, whose rel_err is 0/0)."""
    for i, (a, b) in enumerate(zip(actual, expected, strict=True)):
        if a.shape == b.shape and torch.equal(a.cpu(), b.cpu()) and bool(torch.isfinite(b).all()):
            continue
        if not (e := rel_err(a, b)) <= tol:  # NaN compares false both ways: it must not read as agreement
            return i, e
    return None

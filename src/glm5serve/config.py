"""A transformers ``GlmMoeDsaConfig`` built from ``glm-dsa.*`` GGUF metadata alone (no config.json, no HF repo).

Key names follow gguf-py ``constants.Keys`` and what llama.cpp's converter writes (``GlmMoeDsaModel`` /
``DeepseekV2Model.set_gguf_parameters`` in ``convert_hf_to_gguf.py``).
"""
from __future__ import annotations

from typing import Any

from transformers import GlmMoeDsaConfig

from glm5serve.errors import GGUFModelError

ARCH = "glm-dsa"
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # gguf-py ExpertGatingFuncType


def _md(model) -> tuple[dict[str, Any], str]:
    md = model.metadata if hasattr(model, "metadata") else dict(model)
    return md, str(getattr(model, "path", "<metadata>"))


def config_from_metadata(model) -> GlmMoeDsaConfig:
    """Build a ``GlmMoeDsaConfig`` from a :class:`~glm5serve.gguf_file.GGUFModel` (or a plain metadata dict).

    ``num_hidden_layers`` excludes the MTP layers (``block_count - nextn_predict_layers``); the MTP count is kept
    as ``num_nextn_predict_layers``. Extra attributes vLLM's DeepSeek-V3.2/GLM-5 code reads are set:
    ``topk_method="noaux_tc"`` (it creates ``e_score_correction_bias`` only then), ``scoring_func``,
    ``rope_interleave`` and ``indexer_rope_interleave`` (GLM-5 rotates adjacent pairs: ggml ROPE_TYPE_NORM).

    Raises GGUFModelError naming the file when the architecture is not ``glm-dsa`` or a required key is missing.
    """
    md, path = _md(model)
    arch = md.get("general.architecture")
    if arch != ARCH:
        raise GGUFModelError(f"architecture is {arch!r}, not {ARCH!r}: not a GLM-5 GGUF", file=path)

    def req(key: str):
        v = md.get(f"{ARCH}.{key}")
        if v is None:
            raise GGUFModelError(f"metadata key {ARCH}.{key} is missing", file=path)
        return v

    def opt(key: str, default):
        v = md.get(f"{ARCH}.{key}")
        return default if v is None else v

    n_blocks = int(req("block_count"))
    n_mtp = int(opt("nextn_predict_layers", 0))
    n_layers = n_blocks - n_mtp
    rope_dim = int(req("rope.dimension_count"))
    key_mla = int(req("attention.key_length_mla"))
    gating = int(opt("expert_gating_func", GATING_SIGMOID))  # absent means sigmoid (llama.cpp glm-dsa loader)
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID):
        raise GGUFModelError(f"{ARCH}.expert_gating_func={gating} is neither softmax (1) nor sigmoid (2)", file=path)
    tokens = md.get("tokenizer.ggml.tokens")
    vocab = int(opt("vocab_size", len(tokens) if tokens is not None else 0))
    if vocab <= 0:
        raise GGUFModelError(f"neither {ARCH}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size", file=path)
    indexer_types = md.get(f"{ARCH}.attention.indexer.types")
    kwargs: dict[str, Any] = {}
    if indexer_types is not None:
        # the converter writes booleans (true = "full", GlmMoeDsaModel.set_gguf_parameters); accept names too
        kwargs["indexer_types"] = [t if isinstance(t, str) else ("full" if t else "shared")
                                   for t in indexer_types][:n_layers]

    eos = md.get("tokenizer.ggml.eos_token_id")
    return GlmMoeDsaConfig(
        architectures=["GlmMoeDsaForCausalLM"],
        vocab_size=vocab,
        hidden_size=int(req("embedding_length")),
        intermediate_size=int(req("feed_forward_length")),
        moe_intermediate_size=int(req("expert_feed_forward_length")),
        num_hidden_layers=n_layers,
        num_nextn_predict_layers=n_mtp,
        num_attention_heads=int(req("attention.head_count")),
        num_key_value_heads=int(req("attention.head_count")),
        n_shared_experts=int(opt("expert_shared_count", 1)),
        n_routed_experts=int(req("expert_count")),
        num_experts_per_tok=int(req("expert_used_count")),
        routed_scaling_factor=float(opt("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(opt("expert_weights_norm", True)),
        n_group=int(opt("expert_group_count", 1)) or 1,
        topk_group=int(opt("expert_group_used_count", 1)) or 1,
        scoring_func="sigmoid" if gating == GATING_SIGMOID else "softmax",
        topk_method="noaux_tc",
        kv_lora_rank=int(req("attention.kv_lora_rank")),
        q_lora_rank=int(req("attention.q_lora_rank")),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=key_mla - rope_dim,
        v_head_dim=int(req("attention.value_length_mla")),
        max_position_embeddings=int(req("context_length")),
        rms_norm_eps=float(req("attention.layer_norm_rms_epsilon")),
        rope_parameters={"rope_type": "default", "rope_theta": float(opt("rope.freq_base", 10000.0))},
        rope_interleave=True,
        indexer_rope_interleave=True,
        index_topk=int(req("attention.indexer.top_k")),
        index_head_dim=int(req("attention.indexer.key_length")),
        index_n_heads=int(req("attention.indexer.head_count")),
        first_k_dense_replace=int(opt("leading_dense_block_count", 0)),
        bos_token_id=md.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=None if eos is None else int(eos),
        pad_token_id=md.get("tokenizer.ggml.padding_token_id"),
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **kwargs,
    )

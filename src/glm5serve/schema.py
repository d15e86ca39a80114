"""The GLM-5 (``glm-dsa``) GGUF schema: every expected tensor, its shape, allowed types, HF parameter and TP split.

Sources: gguf-py ``constants.py`` (``MODEL_TENSORS[MODEL_ARCH.GLM_DSA]``, tensor name templates), llama.cpp
``convert_hf_to_gguf.py`` (``DeepseekV2Model.modify_tensors``: the ``kv_b_proj`` split; ``GlmMoeDsaModel``) and
transformers ``models/glm_moe_dsa/modeling_glm_moe_dsa.py`` (HF parameter names, transformers-5 fused experts).
Shapes are numpy order (GGUF ``ne`` reversed).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

#: quant types glm5serve can dequantize (and therefore load)
SUPPORTED_TYPES: frozenset[Q] = frozenset({
    Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
FLOAT_TYPES: frozenset[Q] = frozenset({Q.F32, Q.F16, Q.BF16})


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the GGUF must (``required``) or may hold.

    ``hf_name`` is the transformers parameter it feeds; ``hf_part`` says which part of it when several GGUF tensors
    feed one parameter: ``"gate"``/``"up"`` halves of ``experts.gate_up_proj`` (dim 1), ``"k_b"``/``"v_b"`` of
    ``kv_b_proj`` (see :func:`merge_kv_b`). ``kind`` is ``global``, ``attention``, ``indexer``, ``dense``, ``moe``
    or ``mtp``. ``tp_split`` is how vLLM shards it: ``"col"`` (output rows, dim -2), ``"row"`` (input, dim -1,
    sliced by bytes, so quant blocks must not straddle ranks) or None (replicated, vocab-parallel, or dequantized).
    """

    gguf_name: str
    shape: tuple[int, ...]
    kind: str
    block: int | None
    hf_name: str | None
    hf_part: str | None = None
    required: bool = True
    allowed: frozenset[Q] = field(default=SUPPORTED_TYPES)
    tp_split: str | None = None

    def check_type(self, qtype: Q) -> str | None:
        """None if ``qtype`` may store this tensor, else the reason it may not."""
        if qtype not in SUPPORTED_TYPES:
            return f"unsupported quant type {qtype.name}"
        if qtype not in self.allowed:
            return f"type {qtype.name} not allowed (allowed: {', '.join(sorted(t.name for t in self.allowed))})"
        bs = GGML_QUANT_SIZES[qtype][0]
        if self.shape[-1] % bs:
            return f"row length {self.shape[-1]} is not a multiple of the {qtype.name} block size {bs}"
        return None


def _quant_ok_for_row(row: int, no_k_quants: bool = False) -> frozenset[Q]:
    out = {t for t in SUPPORTED_TYPES if row % GGML_QUANT_SIZES[t][0] == 0}
    if no_k_quants:
        out = {t for t in out if GGML_QUANT_SIZES[t][0] != 256}
    return frozenset(out)


def expected_tensors(cfg) -> list[TensorSpec]:
    """The full tensor inventory of a GLM-5 GGUF for ``cfg`` (a ``GlmMoeDsaConfig``), in converter order.

    Blocks ``0..num_hidden_layers-1`` are the model; blocks after that are MTP (``num_nextn_predict_layers``),
    which hold a full MoE decoder layer plus ``nextn.*`` tensors. Optional tensors (``required=False``):
    ``nextn.embed_tokens`` and ``nextn.shared_head_head`` (llama.cpp loads them with TENSOR_NOT_REQUIRED), and
    indexer tensors of layers whose ``indexer_types`` entry is ``"shared"``.
    """
    H, V = cfg.hidden_size, cfg.vocab_size
    nh, nope, rope, vd = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    ql, kvl = cfg.q_lora_rank, cfg.kv_lora_rank
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    E, mI, I = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.intermediate_size
    sI = mI * cfg.n_shared_experts
    n_layers = cfg.num_hidden_layers
    n_mtp = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    F32 = frozenset({Q.F32})
    router = FLOAT_TYPES
    indexer_types = list(getattr(cfg, "indexer_types", None) or ["full"] * n_layers)

    def mat(name, shape, kind, bid, hf, part=None, tp=None, required=True, allowed=None):
        return TensorSpec(name, shape, kind, bid, hf, part, required,
                          allowed if allowed is not None else _quant_ok_for_row(shape[-1]), tp)

    def vec(name, n, kind, bid, hf, required=True):
        return TensorSpec(name, (n,), kind, bid, hf, None, required, F32, None)

    specs = [
        mat("token_embd.weight", (V, H), "global", None, "model.embed_tokens.weight"),
        vec("output_norm.weight", H, "global", None, "model.norm.weight"),
        mat("output.weight", (V, H), "global", None, "lm_head.weight"),
    ]
    for b in range(n_layers + n_mtp):
        mtp = b >= n_layers
        p, hp = f"blk.{b}.", f"model.layers.{b}."
        a = hp + "self_attn."
        specs += [
            vec(p + "attn_norm.weight", H, "attention", b, hp + "input_layernorm.weight"),
            mat(p + "attn_q_a.weight", (ql, H), "attention", b, a + "q_a_proj.weight", tp=None),
            vec(p + "attn_q_a_norm.weight", ql, "attention", b, a + "q_a_layernorm.weight"),
            mat(p + "attn_q_b.weight", (nh * (nope + rope), ql), "attention", b, a + "q_b_proj.weight", tp="col"),
            mat(p + "attn_kv_a_mqa.weight", (kvl + rope, H), "attention", b, a + "kv_a_proj_with_mqa.weight"),
            vec(p + "attn_kv_a_norm.weight", kvl, "attention", b, a + "kv_a_layernorm.weight"),
            # k part is transposed before quantization: blocks run along nope (192), so no 256-element K-quants
            mat(p + "attn_k_b.weight", (nh, kvl, nope), "attention", b, a + "kv_b_proj.weight", "k_b",
                allowed=_quant_ok_for_row(nope, no_k_quants=True)),
            mat(p + "attn_v_b.weight", (nh, vd, kvl), "attention", b, a + "kv_b_proj.weight", "v_b"),
            mat(p + "attn_output.weight", (H, nh * vd), "attention", b, a + "o_proj.weight", tp="row"),
        ]
        idx_req = indexer_types[b] == "full" if b < len(indexer_types) else True
        ia = a + "indexer."
        specs += [
            mat(p + "indexer.attn_q_b.weight", (ih * idim, ql), "indexer", b, ia + "wq_b.weight", required=idx_req),
            mat(p + "indexer.attn_k.weight", (idim, H), "indexer", b, ia + "wk.weight", required=idx_req),
            vec(p + "indexer.k_norm.weight", idim, "indexer", b, ia + "k_norm.weight", required=idx_req),
            vec(p + "indexer.k_norm.bias", idim, "indexer", b, ia + "k_norm.bias", required=idx_req),
            mat(p + "indexer.proj.weight", (ih, H), "indexer", b, ia + "weights_proj.weight", required=idx_req),
        ]
        specs.append(vec(p + "ffn_norm.weight", H, "attention", b, hp + "post_attention_layernorm.weight"))
        m = hp + "mlp."
        if b < cfg.first_k_dense_replace:
            specs += [
                mat(p + "ffn_gate.weight", (I, H), "dense", b, m + "gate_proj.weight", tp="col"),
                mat(p + "ffn_up.weight", (I, H), "dense", b, m + "up_proj.weight", tp="col"),
                mat(p + "ffn_down.weight", (H, I), "dense", b, m + "down_proj.weight", tp="row"),
            ]
        else:
            specs += [
                mat(p + "ffn_gate_inp.weight", (E, H), "moe", b, m + "gate.weight", allowed=router),
                vec(p + "exp_probs_b.bias", E, "moe", b, m + "gate.e_score_correction_bias"),
                mat(p + "ffn_gate_exps.weight", (E, mI, H), "moe", b, m + "experts.gate_up_proj", "gate", tp="col"),
                mat(p + "ffn_up_exps.weight", (E, mI, H), "moe", b, m + "experts.gate_up_proj", "up", tp="col"),
                mat(p + "ffn_down_exps.weight", (E, H, mI), "moe", b, m + "experts.down_proj", tp="row"),
                mat(p + "ffn_gate_shexp.weight", (sI, H), "moe", b, m + "shared_experts.gate_proj.weight", tp="col"),
                mat(p + "ffn_up_shexp.weight", (sI, H), "moe", b, m + "shared_experts.up_proj.weight", tp="col"),
                mat(p + "ffn_down_shexp.weight", (H, sI), "moe", b, m + "shared_experts.down_proj.weight", tp="row"),
            ]
        if mtp:
            n = p + "nextn."
            specs += [
                mat(n + "eh_proj.weight", (H, 2 * H), "mtp", b, hp + "eh_proj.weight"),
                mat(n + "embed_tokens.weight", (V, H), "mtp", b, hp + "embed_tokens.weight", required=False),
                vec(n + "enorm.weight", H, "mtp", b, hp + "enorm.weight"),
                vec(n + "hnorm.weight", H, "mtp", b, hp + "hnorm.weight"),
                mat(n + "shared_head_head.weight", (V, H), "mtp", b, hp + "shared_head.head.weight", required=False),
                vec(n + "shared_head_norm.weight", H, "mtp", b, hp + "shared_head.norm.weight"),
            ]
    if n_mtp:  # the MTP layer's attention/MoE tensors are MTP too: outside the main model's bijection
        specs = [s if s.block is None or s.block < n_layers else
                 TensorSpec(s.gguf_name, s.shape, "mtp", s.block, s.hf_name, s.hf_part, s.required, s.allowed, s.tp_split)
                 for s in specs]
    return specs


def gguf_to_hf(cfg) -> dict[str, tuple[str, str | None]]:
    """GGUF tensor name → (HF parameter name, part) for the main model (MTP block excluded).

    The map is a bijection between GGUF tensors and (parameter, part) pairs; ``hf_to_gguf`` is its inverse.
    """
    return {s.gguf_name: (s.hf_name, s.hf_part) for s in expected_tensors(cfg) if s.kind != "mtp"}


def hf_to_gguf(cfg) -> dict[str, list[str]]:
    """HF parameter name → the GGUF tensors that make it, in the order they are concatenated
    (``[attn_k_b, attn_v_b]`` for ``kv_b_proj``; ``[ffn_gate_exps, ffn_up_exps]`` for ``experts.gate_up_proj``)."""
    order = {None: 0, "k_b": 0, "gate": 0, "v_b": 1, "up": 1}
    out: dict[str, list[tuple[int, str]]] = {}
    for g, (h, part) in gguf_to_hf(cfg).items():
        out.setdefault(h, []).append((order[part], g))
    return {h: [g for _, g in sorted(v)] for h, v in out.items()}


def merge_kv_b(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """Re-fuse dequantized ``attn_k_b`` (H, kv_lora, nope) and ``attn_v_b`` (H, v, kv_lora) into HF
    ``kv_b_proj.weight`` (H·(nope+v), kv_lora), any float dtype.

    Exact inverse of the converter's split (llama.cpp ``convert_hf_to_gguf.py``, ``DeepseekV2Model.modify_tensors``):
    view kv_b as (H, nope+v, kv_lora), k part transposed to (H, kv_lora, nope). The transpose must happen after
    dequantization, because the quant blocks of ``attn_k_b`` run along ``nope``. Raises ValueError on shape mismatch.
    """
    if k_b.dim() != 3 or v_b.dim() != 3 or k_b.shape[0] != v_b.shape[0] or k_b.shape[1] != v_b.shape[2]:
        raise ValueError(f"attn_k_b {tuple(k_b.shape)} and attn_v_b {tuple(v_b.shape)} do not fit together")
    h, kvl, nope = k_b.shape
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(h * (nope + v_b.shape[1]), kvl).contiguous()


def split_kv_b(kv_b: torch.Tensor, n_heads: int, nope: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split HF ``kv_b_proj.weight`` (H·(nope+v), kv_lora) into ``attn_k_b`` (H, kv_lora, nope) and ``attn_v_b``
    (H, v, kv_lora), as the converter does (see :func:`merge_kv_b`). Raises ValueError on shape mismatch."""
    if kv_b.dim() != 2 or kv_b.shape[0] != n_heads * (nope + v):
        raise ValueError(f"kv_b_proj {tuple(kv_b.shape)} is not ({n_heads}*({nope}+{v}), kv_lora)")
    w = kv_b.view(n_heads, nope + v, kv_b.shape[1])
    return w[:, :nope].transpose(1, 2).contiguous(), w[:, nope:].contiguous()


def merge_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``ffn_gate_exps`` and ``ffn_up_exps`` (E, I, H) → transformers-5 ``experts.gate_up_proj`` (E, 2I, H)."""
    return torch.cat([gate, up], dim=1)

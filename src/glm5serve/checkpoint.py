"""Deterministic synthetic GLM-5 (``glm-dsa``) GGUF checkpoints in the exact layout llama.cpp's converter writes.

``make_checkpoint`` draws HF-named fp32 weights (transformers ``GlmMoeDsaForCausalLM`` parameter names, fused
``experts.gate_up_proj``) from a seed, then emulates ``convert_hf_to_gguf.py`` (``GlmMoeDsaModel`` ->
``DeepseekV2Model`` -> ``TextModel``): the same metadata keys in the same order, tensors in the order the converter
emits them from a safetensors file (names in lexicographic order; per-block experts merged as down, gate, up;
``kv_b_proj`` split into ``attn_k_b`` (transposed) and ``attn_v_b`` by :func:`glm5serve.schema.split_kv_b`), F32
for 1-D tensors, norms, the router and biases. Each tensor is then stored in the type the chosen mix gives it.

Weights are drawn with numpy's frozen ``RandomState`` stream (seeded per tensor from the seed and the name), so a
checkpoint is byte-identical on every machine and numpy version, and scaled so that greedy decoding is robust:
``lm_head`` gives logits of standard deviation ~10 nats (clear top-1 margins), attention and MoE outputs are of the
same size as the residual stream (the context matters), and the indexer has enough heads that its ReLU scores are
almost never all zero (no top-k ties).
"""
from __future__ import annotations

import contextlib
import glob
import math
import os
import re
import shutil
import socket
import stat
import tempfile
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter, LlamaFileType

from glm5serve import schema
from glm5serve.config import ARCH, config_from_metadata
from glm5serve.errors import GGUFModelError
from glm5serve.tokenizer import CHAT_TEMPLATE, build_vocab

MIXES = ("ud-q4_k_xl", "bf16", "f32", "llama-q4_k_m")


@dataclass(frozen=True)
class Preset:
    """Model dimensions (HF config names). ``max_tp`` is the largest tensor-parallel size the preset must load at:
    the ud-q4_k_xl mix only gives a row-parallel tensor a block type whose blocks do not straddle ranks there."""

    hidden_size: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    first_k_dense_replace: int
    n_moe_layers: int
    num_nextn_predict_layers: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    max_tp: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-5
    routed_scaling_factor: float = 2.5
    #: output RMS of each routed expert per unit input RMS (see ``narrow``)
    routed_expert_gain: float = 1.0


PRESETS: dict[str, Preset] = {
    # every dimension small: a CPU forward pass takes milliseconds; index_topk 8 makes any prompt > 8 tokens sparse.
    # 16 experts, not 8 (llama.cpp's quantizer has Mixtral-specific rules for exactly 8); indexer key length 64
    # (llama.cpp's Hadamard rotation needs a multiple of 64) = 2 x rope (llama.cpp's indexer views assume that).
    "tiny": Preset(
        hidden_size=256, num_attention_heads=4, q_lora_rank=256, kv_lora_rank=128, qk_rope_head_dim=32,
        qk_nope_head_dim=64, v_head_dim=64, index_n_heads=8, index_head_dim=64, index_topk=8,
        first_k_dense_replace=1, n_moe_layers=2, num_nextn_predict_layers=1, n_routed_experts=16,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=256, intermediate_size=512,
        vocab_size=512, max_position_embeddings=512, max_tp=4),
    # GLM-5's attention and indexer dimensions exactly; the rest shrunk so that K-quant blocks survive TP=8.
    "narrow": Preset(
        hidden_size=1024, num_attention_heads=16, q_lora_rank=512, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=192, v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048,
        first_k_dense_replace=1, n_moe_layers=2, num_nextn_predict_layers=1, n_routed_experts=16,
        num_experts_per_tok=4, n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=2048,
        vocab_size=4096, max_position_embeddings=8192, max_tp=8,
        # Router near-ties cannot be avoided with continuous scores: a few % of token-layers have a top-k margin
        # below bf16 router resolution, so bf16 engines (vLLM) pick another expert there, and random experts are
        # unrelated to each other. A small routed-expert share of the residual stream makes such a flip move the
        # logits by a fraction of a nat (as in a trained model, whose experts agree far more), not several nats.
        routed_expert_gain=0.25),
}

#: GLM-5 itself (glm5-gguf.md; vocab 154880 unconfirmed), 78 layers + the MTP block, ~420 GB in ud-q4_k_xl. Never
#: written with data: :mod:`glm5serve.synthetic` writes it as a header whose tensor data is a hole.
FULL_PRESETS: dict[str, Preset] = {
    "glm5": Preset(
        hidden_size=6144, num_attention_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=192, v_head_dim=256, index_n_heads=32, index_head_dim=128, index_topk=2048,
        first_k_dense_replace=3, n_moe_layers=75, num_nextn_predict_layers=1, n_routed_experts=256,
        num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=2048, intermediate_size=12288,
        vocab_size=154880, max_position_embeddings=202752, max_tp=8),
}


def layer_slice(preset: Preset, n_layers: int) -> Preset:
    """``preset`` with ``n_layers`` main layers: its ``first_k_dense_replace`` dense layers, the rest MoE, every
    dimension unchanged, and **no MTP block** (vLLM only loads it as a speculative-decoding draft model, so a slice
    for speed measurements leaves it out). Raises ValueError unless there is at least one MoE layer."""
    n_moe = n_layers - preset.first_k_dense_replace
    if n_moe < 1:
        raise ValueError(f"a slice needs more than the {preset.first_k_dense_replace} dense layers "
                         f"(at least {preset.first_k_dense_replace + 1} layers), not {n_layers}")
    return replace(preset, n_moe_layers=n_moe, num_nextn_predict_layers=0)


# ----------------------------------------------------------------------------------------------------------------
# metadata (converter order: TextModel, DeepseekV2Model, GlmMoeDsaModel.set_gguf_parameters, then _set_vocab_glm)

def gguf_metadata(preset: Preset, name: str, file_type: int,
                  indexer_types: list[str] | None = None) -> list[tuple[str, object, str]]:
    """The key/value pairs the converter writes for a GLM-5 of these dimensions, in its order.

    Returns ``(key, value, kind)`` with ``kind`` a GGUFWriter ``add_*`` suffix (``uint32``, ``float32``, ``bool``,
    ``string``, ``array``). ``indexer_types`` (``"full"``/``"shared"`` per main layer) adds
    ``glm-dsa.attention.indexer.types`` as the converter does for GLM-5.2 (booleans, true = full).
    """
    p = preset
    n_layers = p.first_k_dense_replace + p.n_moe_layers
    vocab = build_vocab(p.vocab_size)
    a = f"{ARCH}."
    kv: list[tuple[str, object, str]] = [
        ("general.architecture", ARCH, "string"),
        ("general.type", "model", "string"),
        ("general.name", name, "string"),
        # TextModel.set_gguf_parameters
        (a + "block_count", n_layers + p.num_nextn_predict_layers, "uint32"),
        (a + "context_length", p.max_position_embeddings, "uint32"),
        (a + "embedding_length", p.hidden_size, "uint32"),
        (a + "feed_forward_length", p.intermediate_size, "uint32"),
        (a + "attention.head_count", p.num_attention_heads, "uint32"),
        (a + "attention.head_count_kv", 1, "uint32"),  # MLA is stored as MQA (DeepseekV2Model)
        (a + "rope.freq_base", p.rope_theta, "float32"),
        (a + "attention.layer_norm_rms_epsilon", p.rms_norm_eps, "float32"),
        (a + "expert_count", p.n_routed_experts, "uint32"),
        (a + "expert_used_count", p.num_experts_per_tok, "uint32"),
        (a + "expert_group_count", 1, "uint32"),
        (a + "expert_group_used_count", 1, "uint32"),
        (a + "expert_gating_func", 2, "uint32"),  # sigmoid (gguf ExpertGatingFuncType.SIGMOID)
        ("general.file_type", file_type, "uint32"),
        # DeepseekV2Model.set_gguf_parameters
        (a + "leading_dense_block_count", p.first_k_dense_replace, "uint32"),
        (a + "vocab_size", p.vocab_size, "uint32"),
        (a + "attention.q_lora_rank", p.q_lora_rank, "uint32"),
        (a + "attention.kv_lora_rank", p.kv_lora_rank, "uint32"),
        (a + "attention.key_length", p.kv_lora_rank + p.qk_rope_head_dim, "uint32"),
        (a + "attention.value_length", p.kv_lora_rank, "uint32"),
        (a + "attention.key_length_mla", p.qk_nope_head_dim + p.qk_rope_head_dim, "uint32"),
        (a + "attention.value_length_mla", p.v_head_dim, "uint32"),
        (a + "expert_feed_forward_length", p.moe_intermediate_size, "uint32"),
        (a + "expert_shared_count", p.n_shared_experts, "uint32"),
        (a + "expert_weights_scale", p.routed_scaling_factor, "float32"),
        (a + "expert_weights_norm", True, "bool"),
        (a + "rope.dimension_count", p.qk_rope_head_dim, "uint32"),
        # GlmMoeDsaModel.set_gguf_parameters
        (a + "nextn_predict_layers", p.num_nextn_predict_layers, "uint32"),
        (a + "attention.indexer.head_count", p.index_n_heads, "uint32"),
        (a + "attention.indexer.key_length", p.index_head_dim, "uint32"),
        (a + "attention.indexer.top_k", p.index_topk, "uint32"),
    ]
    if indexer_types is not None:
        kv.append((a + "attention.indexer.types", [t == "full" for t in indexer_types], "array"))
    kv += [  # _set_vocab_glm
        ("tokenizer.ggml.model", "gpt2", "string"),
        ("tokenizer.ggml.pre", "glm4", "string"),
        ("tokenizer.ggml.tokens", vocab.tokens, "array"),
        ("tokenizer.ggml.token_type", vocab.token_types, "array"),
        ("tokenizer.ggml.merges", vocab.merges, "array"),
        *((f"tokenizer.ggml.{role}_token_id", i, "uint32") for role, i in vocab.special_ids.items()),
        ("tokenizer.chat_template", CHAT_TEMPLATE, "string"),
        ("general.quantization_version", 2, "uint32"),
    ]
    return kv


def preset_config(preset: str | Preset, indexer_types: list[str] | None = None):
    """The transformers ``GlmMoeDsaConfig`` of a preset, built the way every reader builds it: from the metadata."""
    p = PRESETS[preset] if isinstance(preset, str) else preset
    md = {k: v for k, v, _ in gguf_metadata(p, "config", 0, indexer_types)}
    return config_from_metadata(md)


# ----------------------------------------------------------------------------------------------------------------
# weights

def _rng(seed: int, name: str) -> np.random.RandomState:
    # frozen legacy stream: identical numbers on every numpy version and machine
    return np.random.RandomState((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**32)


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> torch.Tensor:
    a = _rng(seed, name).standard_normal(size=shape).astype(np.float32)
    return torch.from_numpy(a * np.float32(std) + np.float32(mean))


def _gain(hf_name: str, expert_gain: float = 1.0) -> float:
    """Output RMS per unit input RMS of a projection (weights ~ N(0, gain^2 / fan_in))."""
    if hf_name.endswith("lm_head.weight") or hf_name.endswith("shared_head.head.weight"):
        return 10.0  # logits std ~10: top-1 margins well above rounding noise
    if "q_b_proj" in hf_name:
        return 2.0  # sharper attention, so which keys are attended (the sparse top-k) matters
    if hf_name.endswith("mlp.gate.weight"):
        return 3.0  # spread router scores: few near-ties between experts
    if hf_name.endswith("mlp.experts.down_proj"):
        return expert_gain  # Preset.routed_expert_gain
    return 1.0


def _wanted(s: schema.TensorSpec, mtp_shared_tensors: bool) -> bool:
    # optional tensors: the indexer of "shared" layers (absent) and the MTP block's embed/head copies
    return s.required or (mtp_shared_tensors and ".nextn." in s.gguf_name)


class HFWeights(Mapping[str, torch.Tensor]):
    """Deterministic fp32 weights under their transformers names, for every tensor of ``schema.expected_tensors``,
    drawn on access (the last one kept), so a large checkpoint is written without holding all its fp32 weights.

    Main-model names load into ``GlmMoeDsaForCausalLM(cfg)``; the MTP layers are ``model.layers.{n}.*`` with
    ``n >= num_hidden_layers``, as in GLM-5's safetensors (not transformers parameters: leave them out of
    ``load_state_dict``). ``kv_b_proj`` is (H*(nope+v), kv_lora); experts are transformers-5 fused
    ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I). Norm weights ~ N(1, 0.1^2), biases ~ N(0, 0.1^2),
    matrices ~ N(0, gain^2/fan_in), embeddings ~ N(0, 1). Optional MTP tensors (``embed_tokens``,
    ``shared_head.head``) only with ``mtp_shared_tensors``.
    """

    def __init__(self, cfg, seed: int = 0, mtp_shared_tensors: bool = False, expert_gain: float = 1.0):
        nh, nope, vd, kvl = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        E, mI, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.seed, self.expert_gain, self.shapes, self._last = seed, expert_gain, {}, (None, None)
        for s in schema.expected_tensors(cfg):
            if s.hf_name in self.shapes or not _wanted(s, mtp_shared_tensors):
                continue
            if s.hf_part in ("k_b", "v_b"):
                self.shapes[s.hf_name] = (nh * (nope + vd), kvl)
            elif s.hf_part in ("gate", "up"):
                self.shapes[s.hf_name] = (E, 2 * mI, H)
            else:
                self.shapes[s.hf_name] = s.shape

    def __getitem__(self, n: str) -> torch.Tensor:
        if self._last[0] == n:
            return self._last[1]
        shape = self.shapes[n]
        if len(shape) == 1:
            bias = n.endswith(".bias") or n.endswith("e_score_correction_bias")
            w = _normal(self.seed, n, shape, 0.1, 0.0 if bias else 1.0)
        elif "embed_tokens" in n:
            w = _normal(self.seed, n, shape, 1.0)
        else:
            w = _normal(self.seed, n, shape, _gain(n, self.expert_gain) / math.sqrt(shape[-1]))
        self._last = (n, w)
        return w

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def hf_state_dict(cfg, seed: int = 0, mtp_shared_tensors: bool = False, expert_gain: float = 1.0
                  ) -> dict[str, torch.Tensor]:
    """All of :class:`HFWeights` as a dict (e.g. for ``GlmMoeDsaForCausalLM.load_state_dict``)."""
    return dict(HFWeights(cfg, seed, mtp_shared_tensors, expert_gain))


def gguf_tensors(cfg, state: Mapping[str, torch.Tensor]) -> Iterator[tuple[schema.TensorSpec, np.ndarray]]:
    """The converter's output tensors as fp32 numpy arrays (GGUF numpy shape), in the converter's order.

    Order: the HF checkpoint names (per-expert ``experts.{e}.{gate,up,down}_proj``, unfused) sorted as safetensors
    stores them; a block's merged experts are emitted (down, gate, up) at its last expert tensor and ``kv_b_proj``
    as (``attn_k_b``, ``attn_v_b``), as ``DeepseekV2Model.modify_tensors`` does.
    """
    specs = [s for s in schema.expected_tensors(cfg) if s.hf_name in state and (s.required or ".nextn." in s.gguf_name)]
    E = cfg.n_routed_experts

    def key(s: schema.TensorSpec) -> tuple[str, int]:
        if ".mlp.experts." in s.hf_name:
            prefix = s.hf_name.rsplit(".experts.", 1)[0] + ".experts."
            last = max(f"{prefix}{e}.{w}_proj.weight" for e in range(E) for w in ("down", "gate", "up"))
            return last, {"down_proj": 0, "gate": 1, "up": 2}[s.hf_part or s.hf_name.rsplit(".", 1)[-1]]
        return s.hf_name, 1 if s.hf_part == "v_b" else 0

    for s in sorted(specs, key=key):
        w = state[s.hf_name]
        if s.hf_part in ("k_b", "v_b"):
            k_b, v_b = schema.split_kv_b(w, cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim)
            w = k_b if s.hf_part == "k_b" else v_b
        elif s.hf_part in ("gate", "up"):
            mI = cfg.moe_intermediate_size
            w = w[:, :mI] if s.hf_part == "gate" else w[:, mI:]
        a = np.ascontiguousarray(w.numpy(), dtype=np.float32)
        assert a.shape == s.shape, (s.gguf_name, a.shape, s.shape)
        yield s, a


# ----------------------------------------------------------------------------------------------------------------
# quant mixes

def _is_f32_by_rule(s: schema.TensorSpec) -> bool:
    """The converter's F32 rule: 1-D tensors, norms, the router, and anything not ending in ``.weight``."""
    n = s.gguf_name
    return len(s.shape) == 1 or n.endswith("_norm.weight") or ".ffn_gate_inp." in n or not n.endswith(".weight")


# llama.cpp llama-quant.cpp fallbacks when a row is not a multiple of 256 (IQ4_NL -> Q4_0: we only use common types)
_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def _fits(s: schema.TensorSpec, qtype: Q, max_tp: int) -> bool:
    block = GGML_QUANT_SIZES[qtype][0]
    row = s.shape[-1] // (max_tp if s.tp_split == "row" else 1)
    return s.shape[-1] % block == 0 and row % block == 0


def ud_q4_k_xl_type(s: schema.TensorSpec, first_moe: int, max_tp: int) -> Q:
    """UD-Q4_K_XL-like type for one tensor (glm5-gguf.md): routed experts Q4_K (the first MoE block's
    ``ffn_down_exps`` Q5_K), attention and shared expert Q5_K-Q8_0, ``attn_k_b`` Q8_0,
    ``token_embd`` Q4_K, ``output`` Q6_K, F32 by the converter's rule. A K-type whose 256-blocks do not fit the
    row (or a row-parallel shard at ``max_tp``) falls back as llama.cpp does (Q6_K->Q8_0, Q5_K->Q5_1, Q4_K->Q5_0)."""
    n = s.gguf_name
    if _is_f32_by_rule(s):
        return Q.F32
    part = n.split(".", 2)[-1] if n.startswith("blk.") else n
    table = {
        "token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K,
        "attn_q_a.weight": Q.Q6_K, "attn_q_b.weight": Q.Q5_K, "attn_kv_a_mqa.weight": Q.Q6_K,
        "attn_k_b.weight": Q.Q8_0, "attn_v_b.weight": Q.Q6_K, "attn_output.weight": Q.Q5_K,
        "indexer.attn_q_b.weight": Q.Q8_0, "indexer.attn_k.weight": Q.Q8_0, "indexer.proj.weight": Q.Q8_0,
        "ffn_gate.weight": Q.Q5_K, "ffn_up.weight": Q.Q5_K, "ffn_down.weight": Q.Q6_K,
        "ffn_gate_shexp.weight": Q.Q5_K, "ffn_up_shexp.weight": Q.Q5_K, "ffn_down_shexp.weight": Q.Q6_K,
        "ffn_gate_exps.weight": Q.Q4_K, "ffn_up_exps.weight": Q.Q4_K,
        "ffn_down_exps.weight": Q.Q5_K if s.block == first_moe else Q.Q4_K,
        "nextn.eh_proj.weight": Q.Q6_K, "nextn.embed_tokens.weight": Q.Q4_K,
        "nextn.shared_head_head.weight": Q.Q6_K,
    }
    t = table[part]
    while not _fits(s, t, max_tp):
        t = _FALLBACK.get(t) or (Q.F16 if t != Q.F16 else None)
        if t is None:
            return Q.F32
    return t


def tensor_type(s: schema.TensorSpec, mix: str, preset: Preset) -> Q:
    """The ggml type ``mix`` stores tensor ``s`` in (``llama-q4_k_m`` writes bf16 first)."""
    if mix == "f32":
        return Q.F32
    if mix in ("bf16", "llama-q4_k_m"):
        return Q.F32 if _is_f32_by_rule(s) else Q.BF16
    if mix == "ud-q4_k_xl":
        return ud_q4_k_xl_type(s, preset.first_k_dense_replace, preset.max_tp)
    raise ValueError(f"unknown mix {mix!r} (expected one of {', '.join(MIXES)})")


_FILE_TYPES = {"f32": LlamaFileType.ALL_F32, "bf16": LlamaFileType.MOSTLY_BF16,
               "llama-q4_k_m": LlamaFileType.MOSTLY_BF16, "ud-q4_k_xl": LlamaFileType.MOSTLY_Q4_K_M}


def quantizer() -> Callable[[np.ndarray, Q], np.ndarray]:
    """The quantizer in use: ``glm5serve.quantize.quantize`` (K-quants from llama.cpp's reference algorithm),
    else gguf-py's (no K-quants)."""
    try:
        from glm5serve.quantize import quantize
    except ImportError:
        from gguf.quants import quantize
    return quantize


def encode(a: np.ndarray, qtype: Q) -> np.ndarray:
    """fp32 array -> the array GGUFWriter stores for ``qtype`` (F32/F16 typed, other types raw uint8 bytes)."""
    if qtype == Q.F32:
        return a.astype(np.float32)
    if qtype == Q.F16:
        return a.astype(np.float16)
    try:
        return quantizer()(a, qtype)
    except NotImplementedError:
        raise RuntimeError(f"no quantizer for {qtype.name} here (glm5serve.quantize is missing or lacks it)") from None


# ----------------------------------------------------------------------------------------------------------------
# writing

def checkpoint_name(preset: str, mix: str, seed: int = 0) -> str:
    """File stem: ``glm5-{preset}-{mix}`` (``-s{seed}`` for a non-zero seed)."""
    return f"glm5-{preset}-{mix}" + (f"-s{seed}" if seed else "")


def checkpoint_files(out_dir, stem: str, split: int = 1) -> list[Path]:
    """The files a checkpoint named ``stem`` occupies in ``out_dir``: ``{stem}.gguf``, or for ``split`` > 1 gguf-py's
    ``{stem}-0000k-of-0000N.gguf`` shards, in order (gguf-py ``GGUFWriter`` with ``split_max_tensors``)."""
    out_dir = Path(out_dir)
    if split > 1:
        return [out_dir / f"{stem}-{i:05d}-of-{split:05d}.gguf" for i in range(1, split + 1)]
    return [out_dir / f"{stem}.gguf"]


def refuse_existing(path: Path, force: bool) -> None:
    """Raise GGUFModelError if an output ``path`` exists and may not be replaced: anything without ``force``; with
    it, anything but a regular file or a symbolic link (which :func:`replacing` replaces, never its target), so a
    folder, a device or a FIFO of that name is never replaced."""
    if not os.path.lexists(path):
        return
    if not (path.is_symlink() or stat.S_ISREG(path.lstat().st_mode)):
        raise GGUFModelError("exists and is not a regular file (--force replaces only files and links)", file=str(path))
    if not force:
        raise GGUFModelError("exists (--force overwrites it)", file=str(path))


def _tmp_prefix() -> str:
    """``.glm5serve-HOST_NS-``: :func:`replacing`'s folders are ``.glm5serve-HOST_NS-PID-XXXXXXXX`` beside the
    output. ``NS`` (the PID namespace's inode, where Linux shows one) tells the PIDs of two containers apart that
    share a host name (``--network host``) and a folder: a PID is only looked up in the namespace it belongs to."""
    try:
        ns = f"_{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        ns = ""
    return f".glm5serve-{socket.gethostname().replace('-', '_')}{ns}-"


#: what follows :func:`_tmp_prefix` in a :func:`replacing` folder's name: the PID, then mkdtemp's 8 characters
_TMP_REST = re.compile(r"([0-9]+)-[a-z0-9_]{8}")


def _remove_orphans(folder: Path) -> None:
    """Delete the :func:`replacing` folders in ``folder`` that a process of this host made and no longer runs
    (SIGKILL, an OOM kill, a power cut end a run before its cleanup: nothing else would ever remove them). A folder
    of another host, or of a process still alive (or a PID reused since), is left alone, and so is anything not
    named exactly as :func:`replacing` names its folders, not a folder (a symbolic link), or not owned by this user."""
    prefix = _tmp_prefix()
    for d in folder.glob(f"{glob.escape(prefix)}*-*"):
        m = _TMP_REST.fullmatch(d.name[len(prefix):])
        if m is None or int(m[1]) == os.getpid():
            continue
        try:
            st = d.lstat()
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue
        try:
            os.kill(int(m[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (OverflowError, OSError):  # another user's live process (EPERM), or a number no PID has
            pass


def _keep_mode_and_owner(old: Path, new: Path) -> None:
    """Give ``new`` the permission bits and (best effort: only root may give a file away, and a user may give it
    to a group of theirs) owner and group of the regular file ``old``, as ``cp -p`` does; nothing when ``old`` is
    missing or a symbolic link (the link is replaced, not its target)."""
    try:
        st = old.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        return
    os.chmod(new, stat.S_IMODE(st.st_mode))
    for uid in (st.st_uid, -1):  # the owner too if allowed, else the group alone
        try:
            os.chown(new, uid, st.st_gid)
            return
        except PermissionError:
            pass


@contextlib.contextmanager
def replacing(paths: list[Path]) -> Iterator[list[Path]]:
    """Paths to write instead of ``paths`` (same names, in a hidden folder beside them). When the block ends without
    an error each is renamed over its path (``os.replace``: a symbolic link at that name is replaced, never written
    through, and no reader sees half a file), taking the permission bits and, where allowed, the owner of a regular
    file it replaces (as ``sed -i`` does); otherwise they are deleted and whatever ``paths`` held is kept. Folders a
    killed run left there are removed first (:func:`_remove_orphans`)."""
    _remove_orphans(paths[0].parent)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f"{_tmp_prefix()}{os.getpid()}-", dir=paths[0].parent))
    except OSError as e:  # name the folder asked for, not the temporary one
        raise OSError(e.errno, f"cannot write here ({e.strerror or e})", str(paths[0].parent)) from None
    try:
        yield [tmp / p.name for p in paths]
        for t, p in zip((tmp / p.name for p in paths), paths):
            _keep_mode_and_owner(p, t)
            os.replace(t, p)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def make_checkpoint(out_dir, preset: str = "tiny", mix: str = "ud-q4_k_xl", split: int = 1, seed: int = 0, *,
                    indexer_types: list[str] | None = None, mtp_shared_tensors: bool = False,
                    progress: bool = False) -> Path:
    """Write a deterministic GLM-5 GGUF (``glm-dsa``) and return its path (shard 1 of a split set).

    ``preset``: ``tiny`` or ``narrow`` (:data:`PRESETS`). ``mix``: ``ud-q4_k_xl``, ``bf16``, ``f32``, or
    ``llama-q4_k_m`` (bf16 re-quantized by llama.cpp's own ``llama_model_quantize`` as Q4_K_M; needs the
    ``oracle`` extra). ``split``: number of files (``NAME-0000k-of-0000N.gguf``, equal tensor counts, as gguf-py's
    ``split_max_tensors`` writes them). ``indexer_types``: per-layer ``full``/``shared`` (GLM-5.2 style; the
    indexer tensors of shared layers are left out). ``mtp_shared_tensors``: also write the optional
    ``nextn.embed_tokens`` / ``nextn.shared_head_head``. Same arguments -> same bytes.

    Raises ValueError before any work for an unknown preset/mix, a seed outside 0..2**32-1, an ``indexer_types``
    entry other than ``full``/``shared``, or an impossible split (``llama-q4_k_m`` too: its
    split count is checked against the bf16 tensor count, not after llama.cpp's quantize), RuntimeError when a
    needed quantizer (or llama.cpp for ``llama-q4_k_m``) is missing, OSError naming the file when the files cannot
    be written (a full disk, a size limit; none of them is left behind).
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (expected one of {', '.join(PRESETS)})")
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r} (expected one of {', '.join(MIXES)})")
    if not 0 <= seed < 2**32:  # _rng reduces modulo 2**32: larger seeds would repeat smaller ones' weights
        raise ValueError(f"--seed must be in 0..2**32-1, not {seed}")
    if indexer_types is not None and (bad := [t for t in indexer_types if t not in ("full", "shared")]):
        raise ValueError(f"indexer_types entries must be 'full' or 'shared', not {bad[0]!r}")
    p = PRESETS[preset]
    cfg = preset_config(p, indexer_types)
    n_tensors = sum(1 for s in schema.expected_tensors(cfg) if _wanted(s, mtp_shared_tensors))
    per_file = _per_file(n_tensors, split)  # before any work: llama-q4_k_m quantizes the same tensors
    if mix == "llama-q4_k_m":
        return _llama_quantized(Path(out_dir), preset, split, seed, indexer_types, mtp_shared_tensors, progress)
    state = HFWeights(cfg, seed, mtp_shared_tensors, p.routed_expert_gain)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = checkpoint_name(preset, mix, seed)
    files = checkpoint_files(out_dir, stem, split)
    with replacing(files) as tmp_files:  # an existing checkpoint of that name is kept until this one is whole
        writer = GGUFWriter(tmp_files[0].parent / f"{stem}.gguf", ARCH, split_max_tensors=per_file)
        for key, value, kind in gguf_metadata(p, f"GLM-5 glm5serve {preset} {mix} seed {seed}",
                                              int(_FILE_TYPES[mix]), indexer_types):
            if key == "general.architecture":
                continue  # GGUFWriter writes it
            getattr(writer, f"add_{kind}")(key, value)

        tensors = gguf_tensors(cfg, state)
        if progress:
            from tqdm import tqdm
            tensors = tqdm(tensors, total=n_tensors, desc=f"{stem}", unit="tensor")
        for s, a in tensors:
            qtype = tensor_type(s, mix, p)
            data = encode(a, qtype)
            writer.add_tensor(s.gguf_name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
        try:
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file(progress=False)
            writer.close()
        except OSError as e:  # a full disk or a file size limit: no half-written model left behind, the path named
            what = f"the {split}-file checkpoint" if split > 1 else "the checkpoint"
            raise OSError(e.errno, f"cannot write {what} ({e.strerror or e}); nothing was kept",
                          str(files[0])) from None
    return files[0]


def _per_file(n_tensors: int, split: int) -> int:
    """Tensors per file when ``n_tensors`` are written as ``split`` files (0 for one file: GGUFWriter's no split);
    ValueError when ``split`` is < 1 or cannot come out of gguf-split's rule."""
    if split < 1:
        raise ValueError(f"--split must be >= 1, not {split}")
    if split == 1:
        return 0
    per_file = math.ceil(n_tensors / split)
    if math.ceil(n_tensors / per_file) != split:
        raise ValueError(f"cannot split {n_tensors} tensors into {split} files: {per_file} per file (every file but "
                         f"the last full, as gguf-split writes them) fills {math.ceil(n_tensors / per_file)}")
    return per_file


def _llama_quantized(out_dir: Path, preset: str, split: int, seed: int, indexer_types, mtp_shared_tensors,
                     progress: bool) -> Path:
    """bf16 checkpoint -> llama.cpp ``llama_model_quantize`` (LLAMA_FTYPE_MOSTLY_Q4_K_M) -> optional gguf split."""
    try:
        import llama_cpp
    except ImportError:
        raise RuntimeError("mix llama-q4_k_m needs llama.cpp: pip install 'glm5serve[oracle]' "
                           "(llama-cpp-python)") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = checkpoint_name(preset, "llama-q4_k_m", seed)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        src = make_checkpoint(tmp, preset, "bf16", 1, seed, indexer_types=indexer_types,
                              mtp_shared_tensors=mtp_shared_tensors, progress=progress)
        dst = Path(tmp) / f"{stem}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = max(1, min(4, os.cpu_count() or 1))
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
        if rc != 0 or not dst.is_file():
            raise RuntimeError(f"llama_model_quantize failed (return code {rc}) on {src}")
        if split == 1:
            final = out_dir / f"{stem}.gguf"
            os.replace(dst, final)  # same folder: a rename, over a symbolic link too (never through it)
            return final
        return _resplit(dst, out_dir, stem, split)


def _resplit(src: Path, out_dir: Path, stem: str, split: int) -> Path:
    """Rewrite a single-file GGUF as ``split`` files with gguf-py (metadata and tensor bytes unchanged)."""
    from gguf import GGUFReader, GGUFValueType

    r = GGUFReader(src)
    files = checkpoint_files(out_dir, stem, split)
    with replacing(files) as tmp_files:
        w = GGUFWriter(tmp_files[0].parent / f"{stem}.gguf", ARCH, split_max_tensors=_per_file(len(r.tensors), split))
        for key, f in r.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            value = f.contents()
            vtype = f.types[0]
            if vtype == GGUFValueType.ARRAY:
                w.add_key_value(key, value, vtype, sub_type=f.types[-1])
            else:
                w.add_key_value(key, value, vtype)
        for t in r.tensors:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # byte shape for block types
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return files[0]


def default_checkpoint() -> Path:
    """The embedded default model (tiny, ud-q4_k_xl), built once into the user cache: see :mod:`glm5serve.cache`."""
    from glm5serve.cache import default_checkpoint as build

    return build()


def add_parser(subparsers) -> None:
    """Register ``make-checkpoint`` with the ``glm5serve`` argparse sub-commands."""
    p = subparsers.add_parser("make-checkpoint", help="write a deterministic synthetic GLM-5 GGUF",
                              description=make_checkpoint.__doc__.split("\n\n")[0])
    p.add_argument("out_dir", help="directory to write the GGUF file(s) into")
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                   help="tiny: every dimension small (the CPU tests' model); narrow: GLM-5's attention and indexer "
                        "dimensions, 3 layers, 16 experts (default tiny)")
    p.add_argument("--mix", choices=MIXES, default="ud-q4_k_xl",
                   help="tensor types: unsloth's UD-Q4_K_XL mix, all bf16, all f32, or bf16 re-quantized by llama.cpp "
                        "as Q4_K_M (needs the oracle extra; default ud-q4_k_xl)")
    p.add_argument("--split", type=int, default=1, help="number of files (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights, 0 to 2**32-1 (default 0)")
    p.add_argument("--force", action="store_true",
                   help="replace the checkpoint's file(s) if they exist, once the new ones are written whole (by "
                        "default an existing file is refused)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    if not args.out_dir:  # Path("") is the current directory: the files would land there unasked
        raise GGUFModelError("empty path: name the directory to write into")
    out_dir = Path(args.out_dir)
    if os.path.lexists(out_dir) and not out_dir.is_dir():  # mkdir said only "File exists"
        raise GGUFModelError("not a directory", file=str(out_dir))
    # as synthetic-gguf: a checkpoint already there (perhaps with other weights, made by another version) is kept
    # unless asked; --force replaces the name (a symbolic link itself, not its target), never a directory
    for f in checkpoint_files(out_dir, checkpoint_name(args.preset, args.mix, args.seed), max(args.split, 1)):
        refuse_existing(f, args.force)
    try:
        path = make_checkpoint(args.out_dir, args.preset, args.mix, args.split, args.seed, progress=True)
    except (ValueError, RuntimeError) as e:
        raise GGUFModelError(str(e)) from None
    print(path)
    return 0

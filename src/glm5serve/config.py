"""A transformers ``GlmMoeDsaConfig`` built from ``glm-dsa.*`` GGUF metadata alone (no config.json, no HF repo).

Key names follow gguf-py ``constants.Keys`` and what llama.cpp's converter writes (``GlmMoeDsaModel`` /
``DeepseekV2Model.set_gguf_parameters`` in ``convert_hf_to_gguf.py``).
"""
from __future__ import annotations

import math
import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from glm5serve.errors import GGUFModelError
from glm5serve.gguf_file import GGUFModel, _short, metadata_value

if TYPE_CHECKING:
    from transformers import GlmMoeDsaConfig

ARCH = "glm-dsa"
GATING_SOFTMAX, GATING_SIGMOID = 1, 2  # gguf-py ExpertGatingFuncType
#: llama.cpp's glm-dsa loader (src/models/glm-dsa.cpp): a file without ``attention.indexer.types`` whose
#: ``context_length`` is at least this is GLM-5.2, and gets GLM-5.2's indexer layout; below it, GLM-5/5.1 (all full)
GLM52_MIN_CONTEXT = 1048576


def glm52_indexer_types(n_layers: int) -> list[str]:
    """llama.cpp's ``GLM_5_2_DEFAULT_INDEXER_TYPES`` for ``n_layers`` layers: layers 0 and 1 full, then every fourth
    from layer 2 (2, 6, 10, ... 74) full, the rest (and every layer from 78 on, past the table) shared."""
    return ["full" if i < 2 or (i < 78 and (i - 2) % 4 == 0) else "shared" for i in range(n_layers)]


def _md(model) -> tuple[dict[str, Any], str]:
    md = model.metadata if hasattr(model, "metadata") else dict(model)
    return md, str(getattr(model, "path", "<metadata>"))


def metadata_problems(md: dict, cfg, path: str = "<metadata>") -> list[str]:
    """Keys that contradict each other or the config, or that vLLM or the reference engine cannot run with
    (llama.cpp ``llama_model_glm_dsa::load_arch_hparams``; vLLM's ``ModelConfig`` check of ``max_model_len``;
    grouped routing as vLLM's ``grouped_topk`` and the reference run it: the groups divide the experts, the chosen
    groups number 1..``expert_group_count`` and hold ``expert_used_count`` experts or more, a group of several holds
    two or more, as it is scored by its top 2). Each problem is one phrase naming its key."""
    a = ARCH + "."
    out = []

    def eq(key: str, want, source: str) -> None:
        v = md.get(a + key)
        if v is not None and metadata_value(a + key, v, int, path) != int(want):
            out.append(f"{a}{key}={int(v)} but {source} give{'s' * (' + ' not in source)} {int(want)}")

    eq("attention.key_length", cfg.kv_lora_rank + cfg.qk_rope_head_dim,
       f"{a}attention.kv_lora_rank + {a}rope.dimension_count ({cfg.kv_lora_rank} + {cfg.qk_rope_head_dim})")
    eq("attention.value_length", cfg.kv_lora_rank, f"{a}attention.kv_lora_rank")
    eq("attention.head_count_kv", 1, "MLA (one latent KV head)")
    if cfg.max_position_embeddings <= 0:
        out.append(f"{a}context_length={cfg.max_position_embeddings} is not positive")
    if not 0 < cfg.num_experts_per_tok <= cfg.n_routed_experts:
        out.append(f"{a}expert_used_count={cfg.num_experts_per_tok} not in 1..expert_count={cfg.n_routed_experts}")
    if cfg.first_k_dense_replace > cfg.num_hidden_layers:
        out.append(f"{a}leading_dense_block_count={cfg.first_k_dense_replace} exceeds the "
                   f"{cfg.num_hidden_layers} main layers")
    if cfg.qk_nope_head_dim <= 0:
        out.append(f"{a}attention.key_length_mla={cfg.qk_nope_head_dim + cfg.qk_rope_head_dim} is not above "
                   f"rope.dimension_count={cfg.qk_rope_head_dim}")
    if cfg.index_head_dim < cfg.qk_rope_head_dim:
        out.append(f"{a}attention.indexer.key_length={cfg.index_head_dim} is below the rope dimension "
                   f"{cfg.qk_rope_head_dim}")
    for key, value in (("attention.head_count", cfg.num_attention_heads),
                       ("attention.indexer.head_count", cfg.index_n_heads),
                       ("attention.indexer.top_k", cfg.index_topk)):
        if value <= 0:
            out.append(f"{a}{key}={value} is not positive")
    for key, v in (("attention.layer_norm_rms_epsilon", cfg.rms_norm_eps),  # NaN or <= 0: NaN logits, no error
                   ("rope.freq_base", cfg.rope_parameters["rope_theta"]),
                   ("expert_weights_scale", cfg.routed_scaling_factor)):
        if not (math.isfinite(v) and v > 0):
            out.append(f"{a}{key}={v} is not a positive finite number")
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) != cfg.vocab_size:
        out.append(f"{a}vocab_size={cfg.vocab_size} but tokenizer.ggml.tokens holds {len(tokens)}")
    experts, groups, used = cfg.n_routed_experts, cfg.n_group, cfg.topk_group
    if groups < 1 or experts % groups:
        out.append(f"{a}expert_group_count={groups} does not divide expert_count={experts}")
    elif not 1 <= used <= groups:
        out.append(f"{a}expert_group_used_count={used} not in 1..expert_group_count={groups}")
    elif groups > 1 and experts // groups < 2:  # a group scores as the sum of its top 2 (DeepSeek-V3 noaux_tc)
        out.append(f"{a}expert_group_count={groups} leaves {experts // groups} expert per group, and a group is "
                   "scored by its top 2")
    elif used * (experts // groups) < cfg.num_experts_per_tok:
        out.append(f"{a}expert_group_used_count={used} groups of {experts // groups} experts hold fewer than "
                   f"expert_used_count={cfg.num_experts_per_tok}")
    types = md.get(a + "attention.indexer.types")
    if types is not None:
        # an array has one entry per main layer (llama.cpp's get_key_or_arr: "has wrong array length")
        if hasattr(types, "__len__") and len(types) != cfg.num_hidden_layers:
            out.append(f"{a}attention.indexer.types has {len(types)} entries for {cfg.num_hidden_layers} layers")
        elif cfg.indexer_types[0] == "shared":  # a boolean false or the name
            out.append(f"{a}attention.indexer.types: layer 0 is 'shared' but no earlier layer has an indexer")
    return out


def eog_token_ids(model) -> list[int]:
    """The end-of-generation token ids of a GLM-5 GGUF (GGUFModel or metadata dict): ``tokenizer.ggml.eos_token_id``,
    ``eot_token_id`` (``<|user|>``: the assistant's turn is over) and ``eom_token_id`` (``<|observation|>``: a tool
    call waits for its result), those present, in that order, without repeats. llama.cpp stops on all of them
    (``llama_vocab::impl::load``: ``special_eog_ids``), and GLM-4.x's HF ``generation_config.json`` lists the same
    three tokens as ``eos_token_id``; a chat that stopped on ``eos`` alone would run on into the user's next turn.
    Raises GGUFModelError for an id that is not an integer."""
    md, path = _md(model)
    ids: list[int] = []
    for role in ("eos", "eot", "eom"):
        v = md.get(f"tokenizer.ggml.{role}_token_id")
        if v is not None and (i := metadata_value(f"tokenizer.ggml.{role}_token_id", v, int, path)) not in ids:
            ids.append(i)
    return ids


#: llama.cpp's RoPE scaling types (``LLAMA_ROPE_SCALING_TYPES``); another name fails its assertion
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")


def _refuse_rope_scaling(md: dict, path: str) -> None:
    """Raise GGUFModelError for a file whose RoPE is scaled: ``rope.scaling.factor`` (or, where that key is missing, the
    older ``rope.scale_linear``) other than 1 (0 or absent means 1, as in llama.cpp's ``load_hparams``: ``freq_scale
    = 1 / factor``, the older key read only without the newer) unless ``rope.scaling.type`` is ``none`` (llama.cpp's
    ``llama_context`` then sets ``freq_scale = 1``: "never scale if scaling type is none"), a ``rope.scaling.type``
    llama.cpp does not know, or a ``rope.scaling.attn_factor`` other than 1 (llama.cpp multiplies its
    ``yarn_attn_factor`` by it whatever the type: the rotated parts of queries and keys and the glm-dsa ``kq_scale``
    grow with it). GLM-5 has none, and neither the reference nor the config given to vLLM applies one: such a file
    would run with plain RoPE, silently."""
    kind = md.get(f"{ARCH}.rope.scaling.type")
    if kind is not None and (not isinstance(kind, str) or kind not in ROPE_SCALING_TYPES):
        raise GGUFModelError(f"{ARCH}.rope.scaling.type is {_short(kind)}, not one of "
                             f"{', '.join(ROPE_SCALING_TYPES)}", file=path)
    key = f"{ARCH}.rope.scaling.factor"
    if md.get(key) is None:  # llama.cpp reads the older key only where the newer one is missing
        key = f"{ARCH}.rope.scale_linear"
    v = md.get(key)  # read (and type-checked) whatever the type, as llama.cpp reads it
    if v is not None and metadata_value(key, v, float, path) not in (0.0, 1.0) and kind != "none":
        raise GGUFModelError(f"{key}={float(v):g}: RoPE scaling ({kind or 'linear'}) is not supported; GLM-5 "
                             "has none, and the engines here would run plain RoPE", file=path)
    key = f"{ARCH}.rope.scaling.attn_factor"
    v = md.get(key)
    if v is not None and metadata_value(key, v, float, path) != 1.0:
        raise GGUFModelError(f"{key}={float(v):g}: llama.cpp scales the rotated queries and keys by it; GLM-5 has "
                             "none, and the engines here would ignore it", file=path)


def config_from_metadata(model) -> GlmMoeDsaConfig:
    """Build a ``GlmMoeDsaConfig`` from a :class:`~glm5serve.gguf_file.GGUFModel`, a GGUF path, or a plain metadata
    dict.

    ``num_hidden_layers`` excludes the MTP layers (``block_count - nextn_predict_layers``); the MTP count is kept
    as ``num_nextn_predict_layers``. Optional keys default as llama.cpp's glm-dsa loader reads them: no
    ``expert_gating_func`` (or 0) is sigmoid, no ``expert_weights_norm`` is false (routing weights not renormalized), no
    ``expert_weights_scale`` is 1, no ``attention.indexer.types`` is every layer ``full`` unless ``context_length``
    is 1M or more (GLM-5.2: :func:`glm52_indexer_types`), and one integer there (not an array) applies to every
    layer, as llama.cpp's ``get_key_or_arr`` reads a UINT32 (a boolean too, which llama.cpp refuses as a scalar:
    its meaning is plain); ``expert_shared_count`` is required, as there.
    Extra attributes vLLM's DeepSeek-V3.2/GLM-5 code reads are set: ``topk_method="noaux_tc"`` (it creates
    ``e_score_correction_bias`` only then), ``scoring_func``, ``rope_interleave`` and ``indexer_rope_interleave``
    (GLM-5 rotates adjacent pairs: ggml ROPE_TYPE_NORM).

    Raises GGUFModelError naming the file when the architecture is not ``glm-dsa``, a required key is missing, a key
    holds a value of the wrong type (naming the key and the type expected: ``tokenizer.ggml.tokens`` must be an
    array, ``attention.indexer.types`` an array or one boolean), ``block_count`` names more blocks than the model's
    ``blk.N`` tensors hold, or the keys contradict each other or cannot be run (:func:`metadata_problems`, e.g.
    ``expert_used_count`` above ``expert_count``, a norm epsilon that is not a positive finite number; before the
    config is built: an odd ``rope.dimension_count``, a negative value in any integer key (llama.cpp reads them as
    u32), a special token id outside the vocabulary, an ``attention.indexer.types`` name other than
    ``full``/``shared``, a RoPE scaling: :func:`_refuse_rope_scaling`), or when transformers' ``GlmMoeDsaConfig``
    rejects the values (its own message, one line).
    """
    if isinstance(model, (str, os.PathLike)):
        model = GGUFModel(model)
    md, path = _md(model)
    arch = md.get("general.architecture")
    if arch != ARCH:
        raise GGUFModelError(f"architecture is {arch!r}, not {ARCH!r}: not a GLM-5 GGUF", file=path)

    def req(key: str, kind=int):
        v = md.get(f"{ARCH}.{key}")
        if v is None:
            raise GGUFModelError(f"metadata key {ARCH}.{key} is missing", file=path)
        return checked(key, metadata_value(f"{ARCH}.{key}", v, kind, path))

    def opt(key: str, default, kind=int):
        v = md.get(f"{ARCH}.{key}")
        return default if v is None else checked(key, metadata_value(f"{ARCH}.{key}", v, kind, path))

    def checked(key: str, v):  # every integer key of glm-dsa is a u32 in llama.cpp: a negative one is no size
        if isinstance(v, int) and not isinstance(v, bool) and v < 0:
            raise GGUFModelError(f"{ARCH}.{key}={v} is negative (llama.cpp reads it as an unsigned integer)",
                                 file=path)
        return v

    def token_id(role: str) -> int | None:
        v = md.get(f"tokenizer.ggml.{role}_token_id")
        return None if v is None else metadata_value(f"tokenizer.ggml.{role}_token_id", v, int, path)

    n_blocks = req("block_count")
    if hasattr(model, "tensors"):  # a GGUFModel: a block_count past the tensors would size everything after it
        last = max((int(m[1]) for n in model.tensors if (m := re.match(r"blk\.(\d+)\.", n))), default=-1)
        if n_blocks > last + 1:
            where = f"stop at blk.{last}" if last >= 0 else "hold no blk.N tensor"
            raise GGUFModelError(f"{ARCH}.block_count={n_blocks} but the file's tensors {where}", file=path)
        if n_blocks < last + 1:  # llama.cpp refuses tensors it did not load ("wrong number of tensors")
            raise GGUFModelError(f"{ARCH}.block_count={n_blocks} but the file holds tensors up to blk.{last}",
                                 file=path)
    n_mtp = opt("nextn_predict_layers", 0)
    n_layers = n_blocks - n_mtp
    if n_layers < 1:  # before transformers' own validation, which names neither key nor file
        raise GGUFModelError(f"{ARCH}.block_count={n_blocks} with nextn_predict_layers={n_mtp} leaves {n_layers} "
                             "main layers", file=path)
    rope_dim = req("rope.dimension_count")
    if rope_dim % 2:  # RoPE rotates pairs (llama.cpp asserts n_rot % 2 == 0 in ggml_rope)
        raise GGUFModelError(f"{ARCH}.rope.dimension_count={rope_dim} is odd: RoPE rotates pairs", file=path)
    n_dense = opt("leading_dense_block_count", 0)
    key_mla = req("attention.key_length_mla")
    # absent or 0 (gguf-py has no name for it; llama.cpp's NONE) means sigmoid, as llama.cpp's glm-dsa loader reads it
    gating = opt("expert_gating_func", GATING_SIGMOID) or GATING_SIGMOID
    if gating not in (GATING_SOFTMAX, GATING_SIGMOID):
        # 3: llama.cpp's SOFTMAX_WEIGHT (llama-hparams.h): softmax over the selected experts' logits (build_moe_ffn)
        what = ("llama.cpp's SOFTMAX_WEIGHT (softmax over the selected experts' logits), which vLLM's GLM-5 router "
                "does not run; glm5serve runs softmax (1) and" if gating == 3 else "neither softmax (1) nor")
        raise GGUFModelError(f"{ARCH}.expert_gating_func={gating} is {what} sigmoid (2, or 0)", file=path)
    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None and (isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__")):
        raise GGUFModelError(f"metadata key tokenizer.ggml.tokens is {_short(tokens)}, expected an array of strings",
                             file=path)
    vocab = opt("vocab_size", len(tokens) if tokens is not None else 0)
    if vocab <= 0:
        raise GGUFModelError(f"neither {ARCH}.vocab_size nor tokenizer.ggml.tokens gives the vocabulary size",
                             file=path)
    # before transformers, which only warns about an id past the vocabulary; vLLM refuses one, and eot/eom are stop ids
    ids = {role: token_id(role) for role in ("bos", "eos", "padding", "unknown", "eot", "eom")}
    bad = [f"tokenizer.ggml.{role}_token_id={i} is not a token id (vocabulary of {vocab})"
           for role, i in ids.items() if i is not None and not 0 <= i < vocab]
    if bad:
        raise GGUFModelError("; ".join(bad), file=path)
    _refuse_rope_scaling(md, path)
    indexer_types = md.get(f"{ARCH}.attention.indexer.types")
    kwargs: dict[str, Any] = {}
    if isinstance(indexer_types, (bool, int, np.bool_, np.integer)):  # one value for every layer (get_key_or_arr)
        indexer_types = [indexer_types] * n_layers
    if indexer_types is not None:
        if isinstance(indexer_types, (str, bytes)) or not hasattr(indexer_types, "__len__"):
            raise GGUFModelError(f"metadata key {ARCH}.attention.indexer.types is {_short(indexer_types)}, "
                                 "expected an array of booleans or one boolean", file=path)
        # the converter writes booleans (true = "full", GlmMoeDsaModel.set_gguf_parameters); llama.cpp also reads
        # integers (non-zero = full) and refuses floats; accept names too
        for i, t in enumerate(indexer_types):
            if not isinstance(t, (str, bool, int, np.bool_, np.integer)):
                raise GGUFModelError(f"{ARCH}.attention.indexer.types[{i}] is {_short(t)}, expected a boolean "
                                     "(true = full)", file=path)
        names = [t if isinstance(t, str) else ("full" if t else "shared") for t in indexer_types]
        if (bad := next((i for i, t in enumerate(names) if t not in ("full", "shared")), None)) is not None:
            raise GGUFModelError(f"{ARCH}.attention.indexer.types[{bad}] is {names[bad]!r}, not 'full' or 'shared'",
                                 file=path)
        kwargs["indexer_types"] = names[:n_layers]
    elif req("context_length") >= GLM52_MIN_CONTEXT:  # no key: llama.cpp reads a >= 1M context as GLM-5.2
        kwargs["indexer_types"] = glm52_indexer_types(n_layers)

    fields = dict(
        architectures=["GlmMoeDsaForCausalLM"],
        vocab_size=vocab,
        hidden_size=req("embedding_length"),
        intermediate_size=req("feed_forward_length"),
        moe_intermediate_size=req("expert_feed_forward_length"),
        num_hidden_layers=n_layers,
        num_nextn_predict_layers=n_mtp,
        num_attention_heads=req("attention.head_count"),
        num_key_value_heads=req("attention.head_count"),
        n_shared_experts=req("expert_shared_count"),  # required by llama.cpp's glm-dsa loader
        n_routed_experts=req("expert_count"),
        num_experts_per_tok=req("expert_used_count"),
        routed_scaling_factor=opt("expert_weights_scale", 1.0, float),
        norm_topk_prob=opt("expert_weights_norm", False, bool),  # absent: false, as llama.cpp's hparams default
        n_group=opt("expert_group_count", 1) or 1,
        topk_group=opt("expert_group_used_count", 1) or 1,
        scoring_func="sigmoid" if gating == GATING_SIGMOID else "softmax",
        topk_method="noaux_tc",
        kv_lora_rank=req("attention.kv_lora_rank"),
        q_lora_rank=req("attention.q_lora_rank"),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=key_mla - rope_dim,
        v_head_dim=req("attention.value_length_mla"),
        max_position_embeddings=req("context_length"),
        rms_norm_eps=req("attention.layer_norm_rms_epsilon", float),
        rope_parameters={"rope_type": "default", "rope_theta": opt("rope.freq_base", 10000.0, float)},
        rope_interleave=True,
        indexer_rope_interleave=True,
        index_topk=req("attention.indexer.top_k"),
        index_head_dim=req("attention.indexer.key_length"),
        index_n_heads=req("attention.indexer.head_count"),
        first_k_dense_replace=n_dense,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["padding"],
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        **kwargs,
    )
    from transformers import GlmMoeDsaConfig  # here, not at import: it costs seconds (inspect never needs it)

    try:
        cfg = GlmMoeDsaConfig(**fields)
    except Exception as e:  # transformers' own validation (a strict-dataclass error, not a ValueError)
        raise GGUFModelError(f"transformers' GlmMoeDsaConfig rejects this metadata: {e}", file=path) from None
    problems = metadata_problems(md, cfg, path)
    if problems:
        raise GGUFModelError("; ".join(problems), file=path)
    return cfg

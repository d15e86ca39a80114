"""Config from GGUF metadata, the GGUF <-> HF name map, and the kv_b_proj split/merge."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from glm5serve import schema
from glm5serve.checkpoint import PRESETS, gguf_metadata, preset_config
from glm5serve.config import config_from_metadata
from glm5serve.errors import GGUFModelError


def _md(preset="tiny", **override):
    md = {k: v for k, v, _ in gguf_metadata(PRESETS[preset], "test", 0)}
    md.update(override)
    return {k: v for k, v in md.items() if v is not None}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_from_metadata_gives_the_preset_dimensions(name):
    p = PRESETS[name]
    cfg = config_from_metadata(_md(name))
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == \
        (p.hidden_size, p.num_attention_heads, p.q_lora_rank, p.kv_lora_rank)
    assert (cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == \
        (p.qk_rope_head_dim, p.qk_nope_head_dim, p.v_head_dim)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (p.index_n_heads, p.index_head_dim, p.index_topk)
    assert cfg.num_hidden_layers == p.first_k_dense_replace + p.n_moe_layers  # block_count minus the MTP layer
    assert cfg.num_nextn_predict_layers == p.num_nextn_predict_layers
    assert cfg.mlp_layer_types == ["dense"] * p.first_k_dense_replace + ["sparse"] * p.n_moe_layers
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == \
        (p.n_routed_experts, p.num_experts_per_tok, p.n_shared_experts)
    assert (cfg.moe_intermediate_size, cfg.intermediate_size, cfg.vocab_size) == \
        (p.moe_intermediate_size, p.intermediate_size, p.vocab_size)
    assert cfg.max_position_embeddings == p.max_position_embeddings
    assert cfg.routed_scaling_factor == pytest.approx(2.5) and cfg.norm_topk_prob is True
    assert cfg.scoring_func == "sigmoid" and cfg.topk_method == "noaux_tc"
    assert cfg.rope_parameters["rope_theta"] == pytest.approx(1e6)
    assert cfg.indexer_types == ["full"] * cfg.num_hidden_layers


def test_indexer_types_booleans_become_full_and_shared():
    cfg = config_from_metadata(_md(**{"glm-dsa.attention.indexer.types": [True, False, True]}))
    assert cfg.indexer_types == ["full", "shared", "full"]


@pytest.mark.parametrize("n", [2, 4])
def test_indexer_types_of_another_length_than_the_layers_are_refused(n):
    """One entry per main layer, as llama.cpp's get_key_or_arr insists ("wrong array length"); a longer array was
    cut short silently (review finding)."""
    with pytest.raises(GGUFModelError, match=f"attention.indexer.types has {n} entries for 3 layers"):
        config_from_metadata(_md(**{"glm-dsa.attention.indexer.types": [True] * n}))


def test_indexer_types_names_are_checked_as_the_booleans_are():
    """Names are accepted as well as booleans: a name other than full/shared is refused (it read as "shared": no
    indexer on that layer, silently), and a first layer named "shared" is refused as a first ``false`` is (vLLM's
    ``index_topk_pattern`` "S..." would reuse the top-k of a layer before layer 0)."""
    cfg = config_from_metadata(_md(**{"glm-dsa.attention.indexer.types": ["full", "shared", "full"]}))
    assert cfg.indexer_types == ["full", "shared", "full"]
    with pytest.raises(GGUFModelError, match=r"indexer\.types\[1\] is 'Full', not 'full' or 'shared'"):
        config_from_metadata(_md(**{"glm-dsa.attention.indexer.types": ["full", "Full", "full"]}))
    with pytest.raises(GGUFModelError, match="layer 0 is 'shared' but no earlier layer has an indexer"):
        config_from_metadata(_md(**{"glm-dsa.attention.indexer.types": ["shared", "full", "full"]}))


@pytest.mark.parametrize("value", [True, 1, np.uint32(2)])
def test_one_indexer_type_applies_to_every_layer(value):
    """A single value instead of an array is every layer's, as llama.cpp's ``get_key_or_arr`` reads a UINT32 (its
    ``result[i] = value`` for each layer; a scalar BOOL it refuses, glm5serve reads as the boolean it is); it was
    refused as "not an array"."""
    assert config_from_metadata(_md(**{"glm-dsa.attention.indexer.types": value})).indexer_types == ["full"] * 3


@pytest.mark.parametrize("value,why", [(False, "layer 0 is 'shared'"), (0, "layer 0 is 'shared'"),
                                       ("full", "expected an array of booleans or one boolean"),
                                       (0.5, "expected an array of booleans or one boolean")])
def test_one_indexer_type_that_cannot_run_is_refused(value, why):
    """Every layer shared leaves layer 0 no top-k to reuse; a string or float is no boolean (llama.cpp reads a
    UINT32 there and refuses other types)."""
    with pytest.raises(GGUFModelError, match=why):
        config_from_metadata(_md(**{"glm-dsa.attention.indexer.types": value}))


def test_missing_expert_shared_count_is_refused_as_in_llama_cpp():
    """llama.cpp's glm-dsa loader requires ``expert_shared_count`` ("key not found in model"); it was read as 1."""
    with pytest.raises(GGUFModelError, match=r"metadata key glm-dsa\.expert_shared_count is missing"):
        config_from_metadata(_md(**{"glm-dsa.expert_shared_count": None}))


@pytest.mark.parametrize("value,norm", [(True, True), (False, False), (0, False), (1, True)])
def test_expert_weights_norm_reads_booleans_and_0_or_1(value, norm):
    assert config_from_metadata(_md(**{"glm-dsa.expert_weights_norm": value})).norm_topk_prob is norm


def test_missing_expert_weights_norm_is_false_as_in_llama_cpp():
    """llama.cpp's glm-dsa loader reads expert_weights_norm as optional with hparams' default false; reading it as
    true renormalized the top-k weights where llama.cpp does not (tiny F32 checkpoint without the key: logits up to
    15.7 apart)."""
    cfg = config_from_metadata(_md(**{"glm-dsa.expert_weights_norm": None}))
    assert cfg.norm_topk_prob is False


@pytest.mark.parametrize("value", [float("nan"), 0.5, 2])
def test_expert_weights_norm_that_is_no_truth_value_is_refused(value):
    """NaN, 0.5 and 2 all read as true (``norm_topk_prob``), silently; llama.cpp wants a GGUF bool there."""
    with pytest.raises(GGUFModelError, match=r"glm-dsa\.expert_weights_norm is .*, expected a boolean"):
        config_from_metadata(_md(**{"glm-dsa.expert_weights_norm": value}))


@pytest.mark.parametrize("context,types", [(1048575, ["full"] * 7),
                                           (1048576, ["full"] * 3 + ["shared"] * 3 + ["full"])])
def test_missing_indexer_types_follow_llama_cpp(context, types):
    """llama.cpp's glm-dsa loader: without attention.indexer.types, a context of 1M or more is GLM-5.2 (its
    GLM_5_2_DEFAULT_INDEXER_TYPES 1,1,1,0,0,0,1,...), less is GLM-5/5.1 (every layer full)."""
    cfg = config_from_metadata(_md(**{"glm-dsa.block_count": 8, "glm-dsa.context_length": context}))
    assert cfg.indexer_types == types


def test_glm52_indexer_table_is_llama_cpps():
    from glm5serve.config import glm52_indexer_types

    table = [1, 1] + [1, 0, 0, 0] * 19  # llama.cpp src/models/glm-dsa.cpp, 78 entries; zeros after them
    assert glm52_indexer_types(80) == ["full" if t else "shared" for t in table] + ["shared"] * 2


@pytest.mark.parametrize("value,shown", [(0.5, "0.5"), (float("nan"), "nan"), ([True], r"\[True\]")])
def test_indexer_types_that_are_not_booleans_are_refused(value, shown):
    """A FLOAT32 array (llama.cpp: "wrong array element type") read 0.5 or NaN as 'full' and 0.0 as 'shared';
    integers are read as llama.cpp reads them (non-zero = full)."""
    with pytest.raises(GGUFModelError, match=rf"indexer\.types\[1\] is {shown}, expected a boolean \(true = full\)"):
        config_from_metadata(_md(**{"glm-dsa.attention.indexer.types": [True, value, True]}))
    assert config_from_metadata(_md(**{"glm-dsa.attention.indexer.types": [1, 0, 2]})).indexer_types == \
        ["full", "shared", "full"]


@pytest.mark.parametrize("keys,words", [
    ({"glm-dsa.rope.scaling.type": "linear", "glm-dsa.rope.scaling.factor": 8.0},
     r"glm-dsa\.rope\.scaling\.factor=8: RoPE scaling \(linear\) is not supported"),
    ({"glm-dsa.rope.scaling.type": "yarn", "glm-dsa.rope.scaling.factor": 4.0}, r"factor=4: RoPE scaling \(yarn\)"),
    ({"glm-dsa.rope.scale_linear": 2.0}, r"glm-dsa\.rope\.scale_linear=2: RoPE scaling \(linear\)"),
    ({"glm-dsa.rope.scaling.type": "dynamic"}, r"rope\.scaling\.type is 'dynamic', not one of none, linear, yarn"),
    ({"glm-dsa.rope.scaling.type": "longrope", "glm-dsa.rope.scaling.factor": 4.0},
     r"factor=4: RoPE scaling \(longrope\)"),
])
def test_rope_scaling_is_refused_not_ignored(keys, words):
    """llama.cpp scales RoPE by these keys (freq_scale = 1 / factor; fresh-user finding: the reference's logits were
    up to 42 away from llama.cpp's on a linear x8 file); the config dropped them, so every engine here ran plain
    RoPE. Refused, naming the key."""
    with pytest.raises(GGUFModelError, match=words):
        config_from_metadata(_md(**keys))


@pytest.mark.parametrize("keys", [{"glm-dsa.rope.scaling.type": "none"},
                                  {"glm-dsa.rope.scaling.type": "linear", "glm-dsa.rope.scaling.factor": 1.0},
                                  {"glm-dsa.rope.scaling.type": "yarn", "glm-dsa.rope.scaling.factor": 0.0},
                                  {"glm-dsa.rope.scaling.type": "longrope"}])
def test_rope_scaling_by_one_is_plain_rope(keys):
    """A factor of 1 (or 0, llama.cpp's "unset") scales nothing, whatever the type llama.cpp knows
    (``LLAMA_ROPE_SCALING_TYPES``: none, linear, yarn, longrope; dropping longrope from the list refused such a file
    as an unknown type, and passed the suite): accepted."""
    assert config_from_metadata(_md(**keys)).rope_parameters["rope_type"] == "default"


@pytest.mark.parametrize("keys", [{"glm-dsa.rope.scaling.attn_factor": 2.0},
                                  {"glm-dsa.rope.scaling.type": "none", "glm-dsa.rope.scaling.attn_factor": 0.5},
                                  {"glm-dsa.rope.scaling.type": "yarn", "glm-dsa.rope.scaling.factor": 1.0,
                                   "glm-dsa.rope.scaling.attn_factor": 0.0}])
def test_rope_attn_factor_is_refused_not_ignored(keys):
    """llama.cpp multiplies its ``yarn_attn_factor`` by ``rope.scaling.attn_factor`` whatever the scaling type (the
    rotated queries and keys and glm-dsa's ``kq_scale`` grow with it: logits up to 48 apart at 2.0 on the tiny
    file); the config dropped it, so it passed verify and every engine here ran without it. Refused, naming it."""
    with pytest.raises(GGUFModelError, match=r"glm-dsa\.rope\.scaling\.attn_factor=[0-9.]+: llama\.cpp scales"):
        config_from_metadata(_md(**keys))


@pytest.mark.parametrize("keys", [{"glm-dsa.rope.scaling.attn_factor": 1.0},
                                  {"glm-dsa.rope.scaling.type": "none", "glm-dsa.rope.scaling.factor": 8.0},
                                  {"glm-dsa.rope.scaling.type": "none", "glm-dsa.rope.scale_linear": 4.0},
                                  {"glm-dsa.rope.scaling.factor": 1.0, "glm-dsa.rope.scale_linear": 2.0},
                                  {"glm-dsa.rope.scaling.factor": 0.0, "glm-dsa.rope.scale_linear": 2.0}])
def test_rope_scaling_llama_cpp_does_not_apply_is_accepted(keys):
    """An attn_factor of 1 scales nothing; with ``rope.scaling.type`` ``none`` llama.cpp sets ``freq_scale = 1``
    whatever the factor ("never scale if scaling type is none"): plain RoPE, as the engines here run it. It was
    refused as 'RoPE scaling (none) is not supported ... would run plain RoPE'. The older ``rope.scale_linear`` is
    read only where ``rope.scaling.factor`` is missing (``load_hparams``); beside a factor of 1 (or 0) it was
    refused."""
    assert config_from_metadata(_md(**keys)).rope_parameters["rope_type"] == "default"


def test_rope_factor_of_the_wrong_type_is_refused_even_without_scaling():
    """llama.cpp reads ``rope.scaling.factor`` as a float whatever the type (``none`` included)."""
    with pytest.raises(GGUFModelError, match=r"rope\.scaling\.factor is 'x', expected a number"):
        config_from_metadata(_md(**{"glm-dsa.rope.scaling.type": "none", "glm-dsa.rope.scaling.factor": "x"}))


def test_missing_gating_func_means_sigmoid():
    cfg = config_from_metadata(_md(**{"glm-dsa.expert_gating_func": None}))
    assert cfg.scoring_func == "sigmoid"


def test_gating_func_0_means_sigmoid_and_other_values_are_refused():
    """llama.cpp's glm-dsa loader reads expert_gating_func 0 (LLAMA_EXPERT_GATING_FUNC_TYPE_NONE) as sigmoid, as it
    reads an absent key; glm5serve refused such a file that llama.cpp runs (fresh-user finding)."""
    assert config_from_metadata(_md(**{"glm-dsa.expert_gating_func": 0})).scoring_func == "sigmoid"
    assert config_from_metadata(_md(**{"glm-dsa.expert_gating_func": 1})).scoring_func == "softmax"
    # 3 is llama.cpp's SOFTMAX_WEIGHT: named as such, not as a value no gating function has
    with pytest.raises(GGUFModelError, match=r"expert_gating_func=3 is llama.cpp's SOFTMAX_WEIGHT \(softmax over the "
                                             r"selected experts' logits\), which vLLM's GLM-5 router does not run; "
                                             r"glm5serve runs softmax \(1\) and sigmoid \(2, or 0\)$"):
        config_from_metadata(_md(**{"glm-dsa.expert_gating_func": 3}))
    with pytest.raises(GGUFModelError, match=r"expert_gating_func=5 is neither softmax \(1\) nor sigmoid \(2, or 0\)"):
        config_from_metadata(_md(**{"glm-dsa.expert_gating_func": 5}))
    with pytest.raises(GGUFModelError, match=r"expert_gating_func=-1 is negative"):  # a u32 key stored signed
        config_from_metadata(_md(**{"glm-dsa.expert_gating_func": -1}))


def test_missing_key_and_foreign_arch_are_one_line_errors():
    with pytest.raises(GGUFModelError, match=r"glm-dsa\.attention\.kv_lora_rank is missing"):
        config_from_metadata(_md(**{"glm-dsa.attention.kv_lora_rank": None}))
    with pytest.raises(GGUFModelError, match="not a GLM-5 GGUF"):
        config_from_metadata(_md(**{"general.architecture": "llama"}))


@pytest.mark.parametrize("tokens", [5, "abc"])
def test_tokens_that_are_not_an_array_name_the_key(tokens):
    """A scalar ``tokenizer.ggml.tokens`` (llama.cpp asserts on gguf_get_arr_n): one line naming the key, not
    verify's "inconsistent metadata: object of type 'int' has no len()" (or a string's length read as a vocab)."""
    with pytest.raises(GGUFModelError, match=r"tokenizer\.ggml\.tokens is .*, expected an array of strings"):
        config_from_metadata(_md(**{"tokenizer.ggml.tokens": tokens}))


# ---- schema ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_cfg():
    return preset_config("tiny")


def test_gguf_to_hf_is_a_bijection_onto_the_transformers_parameters(tiny_cfg):
    from transformers import GlmMoeDsaForCausalLM

    fwd = schema.gguf_to_hf(tiny_cfg)
    assert len(set(fwd.values())) == len(fwd), "two GGUF tensors map to the same (parameter, part)"
    inverse = schema.hf_to_gguf(tiny_cfg)
    assert sorted(g for gs in inverse.values() for g in gs) == sorted(fwd)
    for h, gs in inverse.items():
        assert all(fwd[g][0] == h for g in gs)
    with torch.device("meta"):
        model = GlmMoeDsaForCausalLM(tiny_cfg)
    # parameters and persistent buffers (e_score_correction_bias) of the real transformers model
    assert set(inverse) == set(model.state_dict())
    assert inverse[f"model.layers.0.self_attn.kv_b_proj.weight"] == ["blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight"]
    assert inverse["model.layers.1.mlp.experts.gate_up_proj"] == ["blk.1.ffn_gate_exps.weight",
                                                                  "blk.1.ffn_up_exps.weight"]


def _converter_hf_name(hf: str, part: str | None) -> str:
    """The name llama.cpp's converter maps through gguf-py's TensorNameMap (after its own renames)."""
    hf = hf.removesuffix(".weight").removesuffix(".bias")
    if part in ("k_b", "v_b"):
        return hf.replace("kv_b_proj", f"{part[0]}_b_proj")
    if hf.endswith("experts.gate_up_proj"):
        return hf.replace("gate_up_proj", f"{part}_proj")
    if hf.endswith("e_score_correction_bias"):
        return hf.replace("e_score_correction_bias", "e_score_correction")
    return hf


def test_schema_names_agree_with_gguf_py_tensor_map(tiny_cfg):
    n_blocks = tiny_cfg.num_hidden_layers + tiny_cfg.num_nextn_predict_layers
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM_DSA, n_blocks)
    specs = schema.expected_tensors(tiny_cfg)
    for s in specs:
        mapped = tmap.get_name(_converter_hf_name(s.hf_name, s.hf_part))
        assert mapped is not None, s.hf_name
        suffix = "." + s.gguf_name.rsplit(".", 1)[-1]
        assert mapped + suffix == s.gguf_name, (s.hf_name, mapped, s.gguf_name)
    # every tensor kind gguf-py lists for glm-dsa that current converters write appears in the schema
    kinds = {gguf.TENSOR_NAMES[t].split(".", 2)[-1] for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GLM_DSA]}
    legacy = {"attn_q", "attn_kv_b", "rope_freqs", "attn_rot_embd"}  # not written for GLM-5
    present = {s.gguf_name.removeprefix("blk.").split(".", 1)[-1].rsplit(".", 1)[0]
               if s.gguf_name.startswith("blk.") else s.gguf_name.rsplit(".", 1)[0] for s in specs}
    assert kinds - legacy <= present


def test_schema_shapes_for_the_real_glm5():
    md = _md("narrow", **{"glm-dsa.embedding_length": 6144, "glm-dsa.attention.head_count": 64,
                          "glm-dsa.attention.q_lora_rank": 2048, "glm-dsa.block_count": 79,
                          "glm-dsa.leading_dense_block_count": 3, "glm-dsa.expert_count": 256,
                          "glm-dsa.feed_forward_length": 12288, "glm-dsa.vocab_size": 154880,
                          "tokenizer.ggml.tokens": None})
    specs = {s.gguf_name: s for s in schema.expected_tensors(config_from_metadata(md))}
    # glm5-gguf.md's table (numpy order)
    assert specs["blk.5.attn_q_b.weight"].shape == (16384, 2048)
    assert specs["blk.5.attn_kv_a_mqa.weight"].shape == (576, 6144)
    assert specs["blk.5.attn_k_b.weight"].shape == (64, 512, 192)
    assert specs["blk.5.attn_v_b.weight"].shape == (64, 256, 512)
    assert specs["blk.5.attn_output.weight"].shape == (6144, 16384)
    assert specs["blk.5.indexer.attn_q_b.weight"].shape == (4096, 2048)
    assert specs["blk.5.ffn_gate_exps.weight"].shape == (256, 2048, 6144)
    assert specs["blk.2.ffn_down.weight"].shape == (6144, 12288)
    assert specs["blk.78.nextn.eh_proj.weight"].shape == (6144, 12288)
    assert "blk.79.attn_norm.weight" not in specs


# ---- kv_b_proj split / merge ------------------------------------------------------------------------------------

def _split_by_definition(kv_b: np.ndarray, h: int, nope: int, v: int):
    """Element-wise: k_b[i, c, j] = kv_b[i*(nope+v) + j, c] and v_b[i, r, c] = kv_b[i*(nope+v) + nope + r, c]
    (llama.cpp convert_hf_to_gguf.py DeepseekV2Model.modify_tensors: view, split, transpose k)."""
    kvl = kv_b.shape[1]
    k_b = np.empty((h, kvl, nope), kv_b.dtype)
    v_b = np.empty((h, v, kvl), kv_b.dtype)
    for i in range(h):
        for j in range(nope):
            k_b[i, :, j] = kv_b[i * (nope + v) + j]
        for r in range(v):
            v_b[i, r] = kv_b[i * (nope + v) + nope + r]
    return k_b, v_b


dims = st.tuples(st.integers(1, 4), st.integers(1, 6), st.integers(1, 6), st.integers(1, 8))


@given(dims, st.integers(0, 2**32 - 1))
def test_split_kv_b_matches_the_converter_and_merge_inverts_it(d, seed):
    h, nope, v, kvl = d
    kv_b = np.random.default_rng(seed).standard_normal((h * (nope + v), kvl)).astype(np.float32)
    k_b, v_b = schema.split_kv_b(torch.from_numpy(kv_b), h, nope, v)
    want_k, want_v = _split_by_definition(kv_b, h, nope, v)
    np.testing.assert_array_equal(k_b.numpy(), want_k)
    np.testing.assert_array_equal(v_b.numpy(), want_v)
    np.testing.assert_array_equal(schema.merge_kv_b(k_b, v_b).numpy(), kv_b)
    k2, v2 = schema.split_kv_b(schema.merge_kv_b(torch.from_numpy(want_k), torch.from_numpy(want_v)), h, nope, v)
    np.testing.assert_array_equal(k2.numpy(), want_k)
    np.testing.assert_array_equal(v2.numpy(), want_v)


@given(dims)
def test_merge_kv_b_rejects_mismatched_parts(d):
    h, nope, v, kvl = d
    with pytest.raises(ValueError):
        schema.merge_kv_b(torch.zeros(h, kvl, nope), torch.zeros(h, v, kvl + 1))
    with pytest.raises(ValueError):
        schema.split_kv_b(torch.zeros(h * (nope + v) + 1, kvl), h, nope, v)


def test_config_from_a_path_and_block_counts_that_leave_no_layer(tiny_checkpoint, tmp_path):
    """``config_from_metadata`` takes a path as the tokenizer builder does; a block_count that leaves no main
    layer is one GGUFModelError naming both keys, not transformers' validation error; a negative count (a u32 key
    stored signed) is named by its own key."""
    from glm5serve.config import config_from_metadata
    from glm5serve.errors import GGUFModelError
    from glm5serve.gguf_file import GGUFModel

    model = GGUFModel(tiny_checkpoint)
    assert config_from_metadata(str(tiny_checkpoint)).to_dict() == config_from_metadata(model).to_dict()
    md = dict(model.metadata)
    for blocks, mtp, words in ((-1, 1, "block_count=-1 is negative"), (4, -1, "nextn_predict_layers=-1 is negative"),
                               (1, 1, "block_count=1 with nextn_predict_layers=1 leaves 0 main layers")):
        md.update({"glm-dsa.block_count": blocks, "glm-dsa.nextn_predict_layers": mtp})
        with pytest.raises(GGUFModelError, match=words):
            config_from_metadata(md)


def test_make_checkpoint_refuses_seeds_and_indexer_types_it_cannot_honour(tmp_path):
    """Seeds are reduced modulo 2**32 per tensor, so a larger one would silently repeat a smaller one's weights under
    another file name; an indexer type other than full/shared was written as 'shared'."""
    from glm5serve.checkpoint import make_checkpoint

    for seed in (-1, 2**32):
        with pytest.raises(ValueError, match=r"--seed must be in 0\.\.2\*\*32-1"):
            make_checkpoint(tmp_path, "tiny", "f32", seed=seed)
    with pytest.raises(ValueError, match="not 'bogus'"):
        make_checkpoint(tmp_path, "tiny", "f32", indexer_types=["full", "bogus", "FULL"])
    assert list(tmp_path.iterdir()) == []

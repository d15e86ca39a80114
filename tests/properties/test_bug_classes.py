"""One property or targeted test per remaining failure class of ``docs/bug-classes.md`` (issue 6, item 3).

Classes already covered elsewhere are not repeated here (see the report of issue 6): kv_b split/merge inverse
(``tests/unit/test_config_schema.py``), shared indexer layers in vLLM (``tests/unit/test_vllm_load.py``), routed
scaling linearity of the reference (``tests/unit/test_reference.py``), sparse = dense for T <= index_topk in the
reference (same file). vLLM's side runs its own GLM-5 layers on the CPU (:mod:`vllm_layers`: the plugin's kernel
ops replaced by dequantize + float64 matmul), compared with glm5serve's reference engine on the tiny checkpoint.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from glm5serve import schema
from glm5serve.reference import ReferenceModel, apply_rope_interleaved, layer_norm, rms_norm, rope_cos_sin
from glm5serve.testing import assert_bitwise_equal
from glm5serve.testing import strategies as gst
from vllm_layers import running_rank, tiny_vllm_model, vllm_layers  # noqa: F401

K_QUANTS = tuple(t for t in schema.SUPPORTED_TYPES if GGML_QUANT_SIZES[t][0] == 256)
MOE_LAYER = 1  # the tiny preset: layer 0 dense, layers 1-2 MoE


def gguf_metadata(path, key: str):
    """One ``glm-dsa.*`` metadata value read by gguf-py (independently of glm5serve's config)."""
    from gguf import GGUFReader

    return GGUFReader(path).fields[f"glm-dsa.{key}"].contents()


@pytest.fixture(scope="module")
def reference(tiny_checkpoint) -> ReferenceModel:
    """glm5serve's reference engine on the tiny checkpoint, fp32, q_a/kv_a norms at ``rms_norm_eps`` (llama.cpp's
    and vLLM's choice; ``tests/unit/test_llamacpp_oracle.py`` pins it)."""
    return ReferenceModel.from_gguf(tiny_checkpoint, qa_kv_norm_eps="rms_norm_eps")


# -- class 5: a K-quant attn_k_b is invalid ------------------------------------------------------------------------

@given(n_heads=st.integers(1, 8), nope_blocks=st.integers(1, 4), kvl_blocks=st.integers(1, 4),
       qtype=gst.quant_types(schema.SUPPORTED_TYPES))
def test_class5_k_quant_attn_k_b_is_refused(n_heads, nope_blocks, kvl_blocks, qtype):
    """Class 5 (llama.cpp#12801, ktransformers#1333): ``attn_k_b`` is stored transposed (rows run along
    qk_nope_head_dim, 192 in GLM-5), so a 256-element K-quant block would cut across heads' k and v parts:
    refused for every K-quant even where the row length happens to be a multiple of 256, while ``attn_v_b`` of
    the same size accepts it. Other types are refused exactly when their block does not divide the row."""
    from transformers import GlmMoeDsaConfig

    nope, kvl = 64 * nope_blocks, 256 * kvl_blocks
    cfg = GlmMoeDsaConfig(hidden_size=256, num_attention_heads=n_heads, qk_nope_head_dim=nope, v_head_dim=nope,
                          kv_lora_rank=kvl, qk_rope_head_dim=64, q_lora_rank=256, num_hidden_layers=1,
                          first_k_dense_replace=1, num_nextn_predict_layers=0, vocab_size=64)
    specs = {s.gguf_name: s for s in schema.expected_tensors(cfg)}
    k_b, v_b = specs["blk.0.attn_k_b.weight"], specs["blk.0.attn_v_b.weight"]
    why = k_b.check_type(qtype)
    block = GGML_QUANT_SIZES[qtype][0]
    if qtype in K_QUANTS:
        assert why is not None and qtype.name in why, f"{qtype.name} attn_k_b (row {nope}) accepted"
        assert v_b.check_type(qtype) is None, f"{qtype.name} attn_v_b (row {kvl}) refused: {v_b.check_type(qtype)}"
    else:
        assert (why is None) == (nope % block == 0), f"{qtype.name} attn_k_b row {nope}: {why!r}"


def test_class5_real_glm5_attn_k_b_refuses_every_k_quant():
    """The real GLM-5 shapes (``attn_k_b`` (64, 512, 192)): every K-quant is refused with a one-line reason, Q8_0
    (the type Unsloth's UD quants use there) is accepted."""
    from transformers import GlmMoeDsaConfig

    cfg = GlmMoeDsaConfig(num_hidden_layers=1, first_k_dense_replace=1, num_nextn_predict_layers=0)
    spec = next(s for s in schema.expected_tensors(cfg) if s.gguf_name == "blk.0.attn_k_b.weight")
    assert spec.shape == (64, 512, 192)
    for q in K_QUANTS:
        why = spec.check_type(q)
        assert why is not None and q.name in why and "\n" not in why
    assert spec.check_type(Q.Q8_0) is None


# -- classes 6, 7, 8: the name map is a bijection for every layer layout ------------------------------------------

@st.composite
def glm5_layouts(draw):
    """A GLM-5-shaped config: 1-4 layers, any number of leading dense layers, 0-2 MTP layers, and (GLM-5.2) the
    indexer of any layer but the first possibly shared with the previous one."""
    from transformers import GlmMoeDsaConfig

    n = draw(st.integers(1, 4))
    shared = [False] + [draw(st.booleans()) for _ in range(n - 1)]
    return GlmMoeDsaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=n,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12,
        qk_rope_head_dim=4, v_head_dim=10, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=draw(st.integers(0, n)), index_n_heads=2, index_head_dim=8, index_topk=4,
        num_nextn_predict_layers=draw(st.integers(0, 2)),
        indexer_types=["shared" if s else "full" for s in shared])


@given(cfg=glm5_layouts())
def test_class6_7_8_gguf_names_biject_onto_transformers_parameters(cfg):
    """Classes 6, 7, 8: for any layer layout, every GGUF tensor of the main model maps to exactly one (parameter,
    part) of transformers-5's ``GlmMoeDsaForCausalLM`` (fused ``experts.gate_up_proj``, class 7), every parameter
    is reached, the MTP block maps to nothing, and a layer with a shared indexer neither requires nor maps indexer
    tensors (class 8: per-layer optional tensors)."""
    from transformers import GlmMoeDsaForCausalLM

    specs = {s.gguf_name: s for s in schema.expected_tensors(cfg)}
    fwd = schema.gguf_to_hf(cfg)
    written = {g: hf for g, hf in fwd.items() if specs[g].required}  # what a converter writes for this layout
    assert len(set(written.values())) == len(written), "two GGUF tensors map to one (parameter, part)"
    with torch.device("meta"):
        params = set(GlmMoeDsaForCausalLM(cfg).state_dict())
    assert {h for h, _ in written.values()} == params
    assert not any(s.kind == "mtp" for g, s in specs.items() if g in fwd), "the MTP block maps to a parameter"
    assert sum(s.kind == "mtp" for s in specs.values()) > 0 or cfg.num_nextn_predict_layers == 0
    for i, kind in enumerate(cfg.indexer_types):
        indexer = [s for s in specs.values() if s.block == i and s.kind == "indexer"]
        assert indexer and all(s.required == (kind == "full") for s in indexer), f"layer {i} ({kind})"
    moe = [h for h, _ in fwd.values() if ".mlp.experts." in h]
    assert all(h.endswith(("experts.gate_up_proj", "experts.down_proj")) for h in moe)


@given(parts=st.lists(st.sampled_from(["weight", "weights_proj", "weightless", "qweight", "x_weight_y", "layers",
                                       "0", "indexer"]), min_size=1, max_size=4),
       which=st.sampled_from(["blk.1.indexer.proj.weight", "blk.1.attn_q_b.weight", "output_norm.weight"]))
def test_class6_plugin_renames_only_the_weight_suffix(vllm_layers, tiny_checkpoint, parts, which):  # noqa: F811
    """Class 6 (vllm-gguf-plugin PR#131): the plugin's GGUF iterator, as glm5serve patches it, turns
    ``<module>.weight`` into ``<module>.qweight`` / ``<module>.qweight_type`` for a quantized tensor and leaves a
    float one alone, whatever ``weight`` substrings the module path holds (``indexer.weights_proj``)."""
    from glm5serve.gguf_file import GGUFModel
    from glm5serve.vllm_plugin.weights import qweight_names
    from vllm_gguf_plugin.weight_utils import gguf_quant_weights_iterator_multi

    module = "model." + ".".join(parts)
    names = [n for n, _ in gguf_quant_weights_iterator_multi([str(tiny_checkpoint)], {which: module + ".weight"})]
    if GGUFModel(tiny_checkpoint)[which].qtype in schema.FLOAT_TYPES:
        assert names == [module + ".weight"]
    else:
        qweight, qweight_type = qweight_names(module + ".weight")
        assert names == [qweight_type, qweight] == [module + ".qweight_type", module + ".qweight"]


# -- classes 11 and 14: vLLM's MoE layer (sigmoid router, bias for choice only, scaling once) = the reference -----

def _moe_inputs(reference: ReferenceModel, tokens: int, seed: int, scale: float,
                softmax: bool = False) -> tuple[torch.Tensor, bool]:
    """(x, clear): ``clear`` is False when some token's k-th and (k+1)-th expert choices (sigmoid scores, or softmax
    ones) are within 1e-4, where two correct implementations may legitimately choose differently."""
    x = torch.randn(tokens, reference.cfg.hidden_size, generator=torch.Generator().manual_seed(seed)) * scale
    logits = x.double() @ reference._p(MOE_LAYER, "mlp.gate.weight").double().T
    scores = logits.softmax(-1) if softmax else logits.sigmoid()
    choice = scores + reference._p(MOE_LAYER, "mlp.gate.e_score_correction_bias").double()
    top = choice.topk(reference.top_k + 1, dim=-1).values
    return x, bool((top[:, -2] - top[:, -1]).min() > 1e-4)


@given(tokens=st.integers(1, 6), seed=st.integers(0, 2**16), scale=st.sampled_from([0.5, 1.0, 4.0]))
def test_class11_14_vllm_moe_layer_equals_reference(vllm_layers, tiny_checkpoint, reference, tokens, seed,  # noqa
                                                    scale):
    """Classes 11 and 14 at layer level: vLLM's ``DeepseekV2MoE`` with glm5serve's config and weights (sigmoid
    scoring, ``e_score_correction_bias`` for the choice only, renormalised top-k weights, ``routed_scaling_factor``
    applied once, shared expert added) equals the reference's ``ffn`` (transformers' ``GlmMoeDsaMoE``). Softmax
    gating, the bias in the weights, or a scaling applied twice or never move the output by far more than fp32
    rounding."""
    # the reference follows the config's scoring_func: check it against the GGUF key read by gguf-py (2 = sigmoid)
    assert {1: "softmax", 2: "sigmoid"}[gguf_metadata(tiny_checkpoint, "expert_gating_func")] == \
        reference.scoring_func == "sigmoid"
    x, clear = _moe_inputs(reference, tokens, seed, scale)
    assume(clear)
    model = tiny_vllm_model(tiny_checkpoint)
    with running_rank(model):
        got = model.model.layers[MOE_LAYER].mlp(x)
    want = reference.ffn(MOE_LAYER, x)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * float(want.abs().max()))


@settings(max_examples=10)
@given(tokens=st.integers(1, 6), seed=st.integers(0, 2**16), scale=st.sampled_from([1.0, 4.0, 16.0]))
def test_class14_vllm_softmax_gated_moe_layer_equals_reference(vllm_layers, tiny_checkpoint, reference, tokens,  # noqa
                                                               seed, scale):
    """``expert_gating_func`` 1 (config ``scoring_func="softmax"``): vLLM's MoE layer and the reference's (softmax
    over the experts, bias for the choice only; llama.cpp's ``build_moe_ffn``, checked against llama.cpp in
    ``test_llamacpp_oracle.py``) agree as for sigmoid gating."""
    import copy

    x, clear = _moe_inputs(reference, tokens, seed, scale, softmax=True)
    assume(clear)
    cfg = copy.deepcopy(reference.cfg)
    cfg.scoring_func = "softmax"
    soft = ReferenceModel(cfg, reference.w, qa_kv_norm_eps="rms_norm_eps")
    model = tiny_vllm_model(tiny_checkpoint, scoring_func="softmax")
    with running_rank(model):
        got = model.model.layers[MOE_LAYER].mlp(x)
    want = soft.ffn(MOE_LAYER, x)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * float(want.abs().max()))
    assert (want - reference.ffn(MOE_LAYER, x)).abs().max() > 1e-3 * float(want.abs().max())  # the gating matters


def test_class11_vllm_routed_output_scales_linearly_with_routed_scaling_factor(vllm_layers, tiny_checkpoint,  # noqa
                                                                               reference):
    """Class 11 (never or twice): vLLM's MoE layer scales by the GGUF's ``expert_weights_scale`` (read by gguf-py),
    and doubling ``routed_scaling_factor`` doubles exactly the routed part of its output (the shared expert is
    unchanged)."""
    x, clear = _moe_inputs(reference, 5, 7, 1.0)
    assert clear
    rsf = reference.routed_scaling_factor
    runner = tiny_vllm_model(tiny_checkpoint).model.layers[MOE_LAYER].mlp.experts
    assert runner.routed_scaling_factor == pytest.approx(gguf_metadata(tiny_checkpoint, "expert_weights_scale"))
    outs = []
    for factor in (1.0, 2.0):
        model = tiny_vllm_model(tiny_checkpoint) if factor == 1 else \
            tiny_vllm_model(tiny_checkpoint, routed_scaling_factor=rsf * factor)
        mlp = model.model.layers[MOE_LAYER].mlp
        with running_rank(model):
            outs.append((mlp(x).double(), mlp.shared_experts(x).double()))
    (y1, s1), (y2, s2) = outs
    assert torch.equal(s1, s2)
    torch.testing.assert_close(y2 - s2, 2 * (y1 - s1), rtol=1e-5, atol=1e-5 * float((y1 - s1).abs().max()))


# -- class 12: the indexer's RoPE is interleaved -------------------------------------------------------------------

@given(tokens=st.integers(1, 6), start=st.integers(0, 500), seed=st.integers(0, 2**16))
def test_class12_vllm_indexer_and_mla_rope_are_interleaved(vllm_layers, tiny_checkpoint, tokens, start,  # noqa
                                                           seed):
    """Class 12 (ik_llama.cpp#2083/#2099): the rotary embeddings vLLM builds for GLM-5 from glm5serve's config --
    the DSA indexer's (``indexer_rope_interleave``) and MLA's -- rotate adjacent pairs, as the reference (ggml
    ROPE_TYPE_NORM, transformers' interleave) does; a NEOX (half-split) rotation of the same input differs."""
    model = tiny_vllm_model(tiny_checkpoint)
    cfg = model.config
    attn = model.model.layers[0].self_attn
    r = cfg.qk_rope_head_dim
    g = torch.Generator().manual_seed(seed)
    positions = torch.arange(start, start + tokens)
    cos, sin = rope_cos_sin(positions, r, cfg.rope_parameters["rope_theta"])
    for name, rope, heads in (("indexer", attn.indexer_rope_emb, cfg.index_n_heads),
                              ("mla", attn.rotary_emb, cfg.num_attention_heads)):
        q, k = torch.randn(tokens, heads, r, generator=g), torch.randn(tokens, 1, r, generator=g)
        got_q, got_k = rope.forward_native(positions, q.clone(), k.clone())
        want_q, want_k = apply_rope_interleaved(q, cos, sin), apply_rope_interleaved(k, cos, sin)
        torch.testing.assert_close(got_q.view_as(q), want_q, rtol=1e-4, atol=1e-4, msg=f"{name} rope (q)")
        torch.testing.assert_close(got_k.view_as(k), want_k, rtol=1e-4, atol=1e-4, msg=f"{name} rope (k)")
        if start > 0:  # the check is sharp: the half-split layout gives other numbers
            halves = torch.cat([q[..., 0::2], q[..., 1::2]], -1)
            neox = torch.cat([halves[..., :r // 2] * cos[:, None] - halves[..., r // 2:] * sin[:, None],
                              halves[..., r // 2:] * cos[:, None] + halves[..., :r // 2] * sin[:, None]], -1)
            assert not torch.allclose(neox, want_q, atol=1e-3)


# -- class 13: sparse = dense whenever the top-k covers every key --------------------------------------------------

@settings(max_examples=max(4, settings().max_examples // 4))  # three full forward passes per example
@given(n=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_class13_sparse_equals_dense_when_index_topk_covers_the_sequence(reference, n, seed):
    """Class 13 (mlx-lm#1453): on the tiny checkpoint (index_topk 8), a prompt of any length -- shorter or longer
    than index_topk -- gives bit-identical logits with the DSA selection on and ``index_topk >= len`` as with dense
    attention. (That longer prompts are really sparse: ``tests/unit/test_reference_gguf.py``.)"""
    ids = torch.randint(0, reference.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
    topk = reference.index_topk
    try:
        reference.sparse = False
        dense = reference.forward(ids)
        reference.sparse, reference.index_topk = True, max(topk, n)
        covered = reference.forward(ids)  # for n <= topk: the real index_topk
    finally:
        reference.sparse, reference.index_topk = True, topk
    assert torch.equal(covered, dense)


# -- class 14: norm epsilons --------------------------------------------------------------------------------------

@given(seed=st.integers(0, 2**16), magnitude=st.sampled_from([1e-4, 1e-3, 1.0]))
def test_class14_vllm_norms_use_the_gguf_epsilons(vllm_layers, tiny_checkpoint, reference, seed,  # noqa: F811
                                                  magnitude):
    """Class 14: every RMSNorm vLLM builds for GLM-5 (input, post-attention, q_a, kv_a, final) computes the
    reference's ``rms_norm`` at the GGUF's ``layer_norm_rms_epsilon`` (1e-5, as llama.cpp), and the indexer's
    ``k_norm`` the reference's LayerNorm at 1e-6; at the magnitudes drawn (down to 1e-4, where 1e-5 vs 1e-6 moves
    the output by percents) a wrong epsilon fails."""
    model = tiny_vllm_model(tiny_checkpoint)
    eps = gguf_metadata(tiny_checkpoint, "attention.layer_norm_rms_epsilon")
    g = torch.Generator().manual_seed(seed)
    layer = model.model.layers[1]
    norms = {"input_layernorm": layer.input_layernorm, "post_attention_layernorm": layer.post_attention_layernorm,
             "q_a_layernorm": layer.self_attn.q_a_layernorm, "kv_a_layernorm": layer.self_attn.kv_a_layernorm,
             "norm": model.model.norm}
    for name, norm in norms.items():
        x = torch.randn(3, norm.weight.shape[0], generator=g) * magnitude
        want = rms_norm(x, norm.weight.data, eps)
        torch.testing.assert_close(norm.forward_native(x), want, rtol=1e-5, atol=1e-6, msg=name)
    k_norm = layer.self_attn.indexer.k_norm
    x = torch.randn(3, k_norm.weight.shape[0], generator=g) * magnitude
    want = layer_norm(x, k_norm.weight.data, k_norm.bias.data, 1e-6)
    torch.testing.assert_close(k_norm(x), want, rtol=1e-5, atol=1e-6, msg="indexer.k_norm")

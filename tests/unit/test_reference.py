"""The reference engine against transformers' GlmMoeDsaForCausalLM on random weights, plus metamorphic checks.

Random weights (not the tiny checkpoint) so these run in seconds and cover options the checkpoint does not:
shared indexer layers, grouped routing, both q_a/kv_a norm epsilons. The checkpoint-based comparisons live in
``test_reference_gguf.py``.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st
from transformers import GlmMoeDsaConfig

from glm5serve.reference import ReferenceModel, apply_rope_interleaved, rope_cos_sin
from glm5serve.testing.compare import first_divergence, hf_hidden_states, hf_model, rel_err

TOPK = 5  # index_topk of the test config: prompts of 3 tokens are dense, 12 and 20 tokens sparse
VOCAB = 96


def small_config(**overrides) -> GlmMoeDsaConfig:
    """A GLM-5-shaped config small enough for milliseconds per forward (every dimension distinct)."""
    kw = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=12,
        qk_rope_head_dim=4, v_head_dim=10, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=1, index_n_heads=8, index_head_dim=8, index_topk=TOPK, routed_scaling_factor=2.5,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(overrides)
    return GlmMoeDsaConfig(**kw)


def random_weights(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every parameter of transformers' model for ``cfg``, drawn so activations stay O(1): matrices N(0, 1/fan_in),
    norm weights 1 + N(0, 0.2²), biases (``k_norm.bias``, ``e_score_correction_bias``) N(0, 0.2²)."""
    from transformers import GlmMoeDsaForCausalLM

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in GlmMoeDsaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            mean = 1.0 if "norm.weight" in name or "layernorm" in name else 0.0
            out[name] = mean + 0.2 * torch.randn(shape, generator=g)
        else:
            out[name] = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
    return out


def prompt(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def pair():
    cfg = small_config()
    w = random_weights(cfg)
    return ReferenceModel(cfg, w), hf_model(cfg, w)


@pytest.mark.parametrize("mla", ["expanded", "absorbed"])
@pytest.mark.parametrize("n", [3, 12, 20])
def test_logits_match_transformers(pair, mla, n):
    ref, hf = pair
    ref.mla = mla
    ids = prompt(n)
    expected, _ = hf_hidden_states(hf, ids)
    assert rel_err(ref.forward(ids), expected) <= 1e-5
    ref.mla = "expanded"


def test_hidden_states_match_transformers_layer_by_layer(pair):
    ref, hf = pair
    ids = prompt(20)
    expected_logits, expected = hf_hidden_states(hf, ids)
    logits, hidden = ref.forward(ids, capture=True)
    assert len(hidden) == len(expected) == ref.n_layers + 1
    bad = first_divergence(hidden, expected, 1e-5)
    assert bad is None, f"hidden state diverges first at {'embeddings' if bad[0] == 0 else f'layer {bad[0] - 1}'}" \
                        f" (rel err {bad[1]:.2e})"
    assert rel_err(logits, expected_logits) <= 1e-5


def test_sparse_path_is_exercised(pair, monkeypatch):
    """The DSA selection changes the result once the prompt is longer than index_topk (else the tests above would
    pass with a broken indexer), and the first index_topk queries see every causal key.

    That is checked bit for bit on the key masks the attention used; the logits of those queries are held to fp32
    rounding, not bits: CPU GEMMs are not batch-invariant (on an AMD EPYC, MKL's sgemm gives rows of a 3-row
    product that differ in the last bit from the same rows of a 20-row one), and past index_topk the two runs send
    different token batches to each routed expert (measured: 1.5e-7 relative)."""
    ref, _ = pair
    masks = []
    attention = ref.attention

    def recording(*args, **kwargs):
        out, mask = attention(*args, **kwargs)
        masks.append(mask)
        return out, mask

    monkeypatch.setattr(ref, "attention", recording)
    ids = prompt(20)
    sparse = ref.forward(ids)
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    assert len(masks) == ref.n_layers
    for mask in masks:
        assert torch.equal(mask[:TOPK], causal[:TOPK])
        assert not torch.equal(mask, causal) and torch.equal(mask & causal, mask)  # keys dropped past index_topk
    ref.sparse = False
    dense = ref.forward(ids)
    ref.sparse = True
    assert rel_err(sparse[:TOPK], dense[:TOPK]) < 1e-5
    assert rel_err(sparse, dense) > 1e-3


def test_greedy_generation_matches_transformers(pair):
    ref, hf = pair
    for seed in (1, 2):
        ids = prompt(4 + 5 * seed, seed)
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(ids):].tolist()
        assert ref.generate(ids, 32) == expected


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_sampling_draws_from_softmax_of_logits_over_temperature(pair, monkeypatch, temperature):
    """Sampling draws token i with probability softmax(logits / temperature)_i, each ``seed`` its own draw. Every
    other test generates greedily, so a temperature applied upside down (``logits * temperature``) or a seed that
    is ignored passed the suite. The model's logits are replaced by fixed ones (the sampler alone is under test),
    and 2,000 seeded draws must match the distribution: total variation below 0.06 (its sampling noise is ~0.02;
    the upside-down temperature gives ~0.45, an ignored seed 0.2 to 0.8). Deterministic: the seeds are fixed."""
    ref, _ = pair
    logits = torch.arange(8, dtype=torch.float32) * 0.8 - 3.0
    monkeypatch.setattr(ref, "forward", lambda ids, cache=None: logits[None].expand(len(ids), -1))
    draws = torch.tensor([ref.generate([1, 2], 1, greedy=False, temperature=temperature, seed=s)[0]
                          for s in range(2000)])
    freq = torch.bincount(draws, minlength=8).float() / len(draws)
    want = torch.softmax(logits / temperature, dim=-1)
    assert (freq - want).abs().sum() / 2 < 0.06, (freq, want)
    again = [ref.generate([1, 2], 3, greedy=False, temperature=temperature, seed=7) for _ in range(2)]
    assert again[0] == again[1]


@pytest.mark.parametrize("overrides", [
    dict(indexer_types=["full", "shared", "full"]),
    dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3),
    dict(first_k_dense_replace=0, norm_topk_prob=False),
], ids=["shared-indexer", "grouped-router", "no-dense-no-norm"])
def test_config_variants_match_transformers(overrides):
    cfg = small_config(**overrides)
    w = random_weights(cfg, seed=3)
    ids = prompt(16, 3)
    expected, _ = hf_hidden_states(hf_model(cfg, w), ids)
    assert rel_err(ReferenceModel(cfg, w).forward(ids), expected) <= 1e-5


def test_qa_kv_norm_eps_option():
    """1e-6 (transformers) is the default; "rms_norm_eps" (1e-5, llama.cpp/vLLM) matches transformers with the
    same eps patched into its two norms, and the two settings give measurably different logits."""
    cfg = small_config()
    w = random_weights(cfg, seed=4)
    for k, v in w.items():  # small latent norms make the eps matter
        if k.endswith(("q_a_proj.weight", "kv_a_proj_with_mqa.weight")):
            w[k] = v * 1e-3
    ids = prompt(12, 4)
    default, llama = ReferenceModel(cfg, w), ReferenceModel(cfg, w, qa_kv_norm_eps="rms_norm_eps")
    assert default.qa_kv_norm_eps == 1e-6 and llama.qa_kv_norm_eps == cfg.rms_norm_eps == 1e-5
    expected_hf, _ = hf_hidden_states(hf_model(cfg, w), ids)
    expected_15, _ = hf_hidden_states(hf_model(cfg, w, qa_kv_norm_eps=1e-5), ids)
    assert rel_err(default.forward(ids), expected_hf) <= 1e-5
    assert rel_err(llama.forward(ids), expected_15) <= 1e-5
    assert rel_err(expected_15, expected_hf) > 1e-4


# ---------------------------------------------------------------- metamorphic
# In fp64, so that a logic error (a wrong cache offset, mask or scale) cannot hide under rounding: fp32 rounding
# alone differs by up to ~2e-6 between incremental and full passes on these random weights (about 30 units in the
# last place), fp64 by ~2e-15. The fp32 versions (bound 1e-6) run on the tiny checkpoint in test_reference_gguf.py.
FP64_TOL = 1e-12


@pytest.fixture(scope="module")
def model():
    cfg = small_config()
    return ReferenceModel(cfg, {k: v.double() for k, v in random_weights(cfg, seed=5).items()})


def test_rope_is_complex_rotation_of_adjacent_pairs():
    """Interleaved RoPE = multiplying each adjacent pair (x[2i] + i·x[2i+1]) by exp(i·pos·θ^(-2i/d))."""
    T, d, theta = 7, 8, 10000.0
    x = torch.randn(T, 3, d, dtype=torch.float64)
    pos = torch.arange(100, 100 + T)
    cos, sin = rope_cos_sin(pos, d, theta)
    got = apply_rope_interleaved(x, cos.double(), sin.double())
    angle = pos[:, None].double() * theta ** (-torch.arange(0, d, 2).double() / d)
    rotation = torch.polar(torch.ones_like(angle), angle)[:, None]  # (T, 1, d/2)
    z = torch.view_as_complex(x.reshape(T, 3, d // 2, 2).contiguous()) * rotation
    # angles are fp32 (as transformers computes them): ~1e-5 absolute at positions ~100
    assert torch.allclose(got, torch.view_as_real(z).reshape(T, 3, d), atol=1e-4)
    assert not torch.allclose(got, x, atol=1e-2)


@given(n=st.integers(1, TOPK), seed=st.integers(0, 2**16))
def test_sparse_with_topk_at_least_length_equals_dense(model, n, seed):
    ids = prompt(n, seed)
    sparse = model.forward(ids)
    model.sparse = False
    try:
        dense = model.forward(ids)
    finally:
        model.sparse = True
    assert torch.equal(sparse, dense)  # same ops on the same mask: bit-identical


@given(n=st.integers(1, 16), seed=st.integers(0, 2**16))
def test_absorbed_equals_expanded(model, n, seed):
    ids = prompt(n, seed)
    expanded = model.forward(ids)
    model.mla = "absorbed"
    try:
        absorbed = model.forward(ids)
    finally:
        model.mla = "expanded"
    assert rel_err(absorbed, expanded) <= FP64_TOL


@given(factor=st.floats(0.125, 8.0), seed=st.integers(0, 2**16))
def test_routed_output_is_linear_in_routed_scaling_factor(model, factor, seed):
    x = torch.randn(9, model.cfg.hidden_size, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    layer = model.mlp_types.index("sparse")
    base = model.routed_experts(layer, x)
    rsf = model.routed_scaling_factor
    try:
        model.routed_scaling_factor = rsf * factor
        scaled = model.routed_experts(layer, x)
        model.routed_scaling_factor = rsf * 2  # a power of two scales every rounding step exactly
        doubled = model.routed_experts(layer, x)
    finally:
        model.routed_scaling_factor = rsf
    assert rel_err(scaled, factor * base) <= FP64_TOL
    assert torch.equal(doubled, 2 * base)


@pytest.mark.parametrize("mla", ["expanded", "absorbed"])
@given(n_prompt=st.integers(1, 8), n_new=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_incremental_decoding_equals_full_forward(model, mla, n_prompt, n_new, seed):
    """Prefill, then one token at a time through the cache, crossing index_topk: same logits as one full pass."""
    ids = prompt(n_prompt + n_new, seed)
    model.mla = mla
    try:
        full = model.forward(ids)
        cache = model.new_cache()
        steps = [model.forward(ids[:n_prompt], cache)] + [model.forward([t], cache) for t in ids[n_prompt:]]
    finally:
        model.mla = "expanded"
    assert cache.length == len(ids)
    assert rel_err(torch.cat(steps), full) <= FP64_TOL

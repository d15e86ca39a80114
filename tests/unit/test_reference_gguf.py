"""The reference engine on the tiny GGUF checkpoint (ud-q4_k_xl mix) against transformers' GlmMoeDsaForCausalLM
holding the same dequantized weights, plus loading checks and fp64 metamorphic checks on the real layout."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFWriter

from glm5serve.errors import GGUFModelError
from glm5serve.reference import ReferenceModel
from glm5serve.testing.compare import first_divergence, hf_hidden_states, hf_model, rel_err
from glm5serve.tokenizer import tokenizer_from_gguf

SHORT = ["Hello", "The cat", "1 2 3"]  # at most index_topk (8) tokens: dense in effect
LONG = ["The capital of France is", "Once upon a time, in a land far away, there lived a curious fox who",
        "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return ReferenceModel.from_gguf(tiny_checkpoint)


@pytest.fixture(scope="module")
def twin(tiny):
    return hf_model(tiny.cfg, tiny.w)


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return tokenizer_from_gguf(tiny_checkpoint)


def test_prompt_lengths_straddle_index_topk(tiny, tok):
    topk = tiny.cfg.index_topk
    assert all(len(tok.encode(p)) <= topk for p in SHORT)
    assert all(len(tok.encode(p)) > topk for p in LONG)


@pytest.mark.parametrize("text", SHORT + LONG)
def test_logits_match_transformers(tiny, twin, tok, text):
    ids = tok.encode(text)
    expected, _ = hf_hidden_states(twin, ids)
    for mla in ("expanded", "absorbed"):
        tiny.mla = mla
        try:
            assert rel_err(tiny.forward(ids), expected) <= 1e-5, mla
        finally:
            tiny.mla = "expanded"


@pytest.mark.parametrize("text", LONG)
def test_hidden_states_match_transformers_layer_by_layer(tiny, twin, tok, text):
    ids = tok.encode(text)
    _, expected = hf_hidden_states(twin, ids)
    _, hidden = tiny.forward(ids, capture=True)
    bad = first_divergence(hidden, expected, 1e-5)
    assert bad is None, f"first diverging: {'embeddings' if bad[0] == 0 else f'layer {bad[0] - 1}'} " \
                        f"(rel err {bad[1]:.2e})"


def test_greedy_generation_matches_transformers(tiny, twin, tok):
    for text in SHORT[:1] + LONG[:2]:
        ids = tok.encode(text)
        expected = twin.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)[0, len(ids):].tolist()
        assert tiny.generate(ids, 32) == expected, text


def test_sparse_selection_changes_long_prompts(tiny, tok):
    ids = tok.encode(LONG[1])
    sparse = tiny.forward(ids)
    tiny.sparse = False
    try:
        dense = tiny.forward(ids)
    finally:
        tiny.sparse = True
    assert rel_err(sparse, dense) > 1e-2


# ---------------------------------------------------------------- loading
def test_split_set_loads_the_same_weights(tiny_split_checkpoint, tiny, tok):
    split = ReferenceModel.from_gguf(tiny_split_checkpoint)
    assert split.w.keys() == tiny.w.keys() and all(torch.equal(split.w[k], tiny.w[k]) for k in tiny.w)


def test_shared_indexer_checkpoint_matches_transformers(tok):
    from glm5serve.cache import cached_checkpoint

    model = ReferenceModel.from_gguf(cached_checkpoint("tiny", "ud-q4_k_xl", indexer_types=["full", "shared", "full"]))
    assert model.indexer_types == ["full", "shared", "full"]
    assert not any(".layers.1.self_attn.indexer." in k for k in model.w)
    ids = tok.encode(LONG[1])
    expected, _ = hf_hidden_states(hf_model(model.cfg, model.w), ids)
    assert rel_err(model.forward(ids), expected) <= 1e-5


def test_mtp_block_is_checked_but_not_loaded(tiny):
    n = tiny.cfg.num_hidden_layers
    assert tiny.cfg.num_nextn_predict_layers == 1
    assert not any(k.startswith(f"model.layers.{n}.") for k in tiny.w)
    assert any(k.startswith(f"model.layers.{n - 1}.") for k in tiny.w)


def test_bf16_load_is_close_to_fp32(tiny_checkpoint, tiny, tok):
    bf16 = ReferenceModel.from_gguf(tiny_checkpoint, dtype=torch.bfloat16)
    assert bf16.w["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    assert bf16.w["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # router stays fp32
    # and whatever transformers keeps in fp32 in a bf16 model: the indexer head weights and the router bias feed
    # top-k choices (rounding weights_proj to bf16 went through the suite: only the router was checked)
    from transformers import GlmMoeDsaForCausalLM

    keep = [*GlmMoeDsaForCausalLM._keep_in_fp32_modules, *(GlmMoeDsaForCausalLM._keep_in_fp32_modules_strict or [])]
    kept = {n: bf16.w[n].dtype for n in bf16.w if any(k in n for k in keep)}
    assert {k for k in keep if any(k in n for n in kept)} == set(keep), (keep, kept)
    assert set(kept.values()) == {torch.float32}, kept
    ids = tok.encode(SHORT[1])
    logits = bf16.forward(ids)
    assert logits.dtype == torch.float32
    assert rel_err(logits, tiny.forward(ids)) < 5e-2


def _copy_without(src, dst, drop: str):
    """Rewrite GGUF ``src`` to ``dst`` with tensor ``drop`` left out (metadata and other tensors as they are)."""
    r = GGUFReader(src)
    w = GGUFWriter(dst, arch=str(r.fields["general.architecture"].contents()))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for t in r.tensors:
        if t.name != drop:
            w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # quantized data: (rows, row_bytes) uint8
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("drop", ["blk.1.attn_k_b.weight", "blk.3.nextn.eh_proj.weight"])
def test_missing_tensor_is_one_line_error(tiny_checkpoint, tmp_path, drop):
    bad = tmp_path / "bad.gguf"
    _copy_without(tiny_checkpoint, bad, drop)
    with pytest.raises(GGUFModelError) as e:
        ReferenceModel.from_gguf(bad)
    assert str(e.value) == f"{bad}: {drop}: required tensor is missing"


@pytest.mark.parametrize("fixture", ["tiny_checkpoint", "tiny_bf16_checkpoint"])
def test_ne_padded_with_trailing_ones_loads_the_same_model(fixture, request, padded_copy, tok):
    """Tensors stored with ne [K, N, 1] for [K, N] (a quantized matrix, a norm, routed experts, attn_k_b, the
    embedding as [K, N, 1, 1]), as llama.cpp accepts them: the same weights and logits, bit for bit."""
    path = request.getfixturevalue(fixture)
    original, padded = ReferenceModel.from_gguf(path), ReferenceModel.from_gguf(padded_copy(path))
    assert padded.w.keys() == original.w.keys() and all(torch.equal(padded.w[k], original.w[k]) for k in original.w)
    for text in (SHORT[1], LONG[1]):
        ids = tok.encode(text)
        assert torch.equal(padded.forward(ids), original.forward(ids)), text


@pytest.mark.parametrize("shape", [(384, 1, 256), (384, 256, 1)])
def test_a_size_one_dimension_elsewhere_is_a_one_line_error(shape, tiny_checkpoint, tmp_path, gguf_rewrite):
    """Only outer size-1 dimensions (ne padded at the end) are the same tensor to llama.cpp; any other stays a
    shape error naming file and tensor."""
    name = "blk.1.attn_q_b.weight"
    bad = gguf_rewrite(tiny_checkpoint, tmp_path / "bad.gguf", replace={name: (
        np.zeros((384, 256), np.float32), Q.F32)}, reshape={name: shape})
    with pytest.raises(GGUFModelError) as e:
        ReferenceModel.from_gguf(bad)
    assert str(e.value) == f"{bad}: {name}: shape {shape} (numpy order), expected (384, 256)"


def test_a_zero_bias_loads_and_a_zero_matrix_is_refused(tiny_checkpoint, tmp_path, gguf_rewrite, tok):
    """As verify holds it (test_verify.py): only weight matrices are refused for being all zeros (an unfilled
    download); an all-zero ``e_score_correction_bias`` (DeepSeek-V3 starts it at zero) loads, and its logits are
    transformers' on the same weights. Refusing every all-zero tensor passed the suite: no test loaded one."""
    from glm5serve.gguf_file import GGUFModel

    m = GGUFModel(tiny_checkpoint)
    bias, gate = m["blk.1.exp_probs_b.bias"], m["blk.1.ffn_gate_inp.weight"]
    ok = gguf_rewrite(tiny_checkpoint, tmp_path / "bias.gguf",
                      replace={bias.name: (np.zeros(bias.shape, np.float32), Q.F32)})
    model = ReferenceModel.from_gguf(ok)
    assert not model._p(1, "mlp.gate.e_score_correction_bias").any()
    ids = tok.encode(LONG[0])
    expected, _ = hf_hidden_states(hf_model(model.cfg, model.w), ids)
    assert rel_err(model.forward(ids), expected) <= 1e-5
    bad = gguf_rewrite(tiny_checkpoint, tmp_path / "gate.gguf",
                       replace={gate.name: (np.zeros(gate.shape, np.float32), Q.F32)})
    with pytest.raises(GGUFModelError) as e:
        ReferenceModel.from_gguf(bad)
    assert str(e.value).startswith(f"{bad}: {gate.name}: every value is zero, which no trained weight matrix is")


# ---------------------------------------------------------------- metamorphic, fp64 (see test_reference.py)
@pytest.fixture(scope="module")
def tiny64(tiny_checkpoint):
    return ReferenceModel.from_gguf(tiny_checkpoint, dtype=torch.float64)


def test_fp64_metamorphic_relations_on_checkpoint(tiny64, tok):
    ids = tok.encode(LONG[1])[:20]
    full = tiny64.forward(ids)
    tiny64.mla = "absorbed"
    absorbed = tiny64.forward(ids)
    cache = tiny64.new_cache()
    steps = torch.cat([tiny64.forward(ids[:5], cache)] + [tiny64.forward([t], cache) for t in ids[5:]])
    tiny64.mla = "expanded"
    assert rel_err(absorbed, full) <= 1e-12
    assert rel_err(steps, full) <= 1e-12
    short = ids[: tiny64.index_topk]
    tiny64.sparse = False
    dense = tiny64.forward(short)
    tiny64.sparse = True
    assert torch.equal(tiny64.forward(short), dense)


def test_bad_arguments_are_errors_not_garbage(tiny, tiny_checkpoint):
    """What a new-user trial got silently: a batch flattened into one sequence, float ids truncated, an id outside the
    vocabulary as torch's bare IndexError, NaN logits from a NaN epsilon, sampling at a negative temperature from
    the inverted distribution."""
    vocab = tiny.cfg.vocab_size
    for ids, words in (([[1, 2], [3, 4]], "shape (T,), not (2, 2)"), (torch.tensor([1.7, 2.2]), "torch.float32"),
                       ([1, vocab], f"token id {vocab} is outside the vocabulary (0..{vocab - 1})"),
                       ([-1, 2], "token id -1 is outside")):
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
            tiny.forward(ids)
    assert tiny.forward(torch.tensor([1, 2], dtype=torch.int32)).shape == (2, vocab)  # any integer dtype will do
    for ids in ([], torch.tensor([], dtype=torch.long)):  # [] used to be named "(0,) torch.float32"
        with pytest.raises(ValueError, match="input_ids holds no token"):
            tiny.forward(ids)
    n_ctx = tiny.cfg.max_position_embeddings  # as vLLM refuses a request past max_model_len (the CLI did already)
    with pytest.raises(ValueError, match=rf"a prompt of 2 tokens \+ max_new_tokens {n_ctx - 1} exceeds the context "
                                         f"length of {n_ctx} tokens"):
        tiny.generate([1, 2], n_ctx - 1)
    assert len(tiny.generate([1] * (n_ctx - 2), 2)) == 2  # exactly the context length is fine
    for eps in (float("nan"), -1.0):
        with pytest.raises(ValueError, match="qa_kv_norm_eps must be a positive finite number"):
            ReferenceModel.from_gguf(tiny_checkpoint, qa_kv_norm_eps=eps)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        tiny.generate([1, 2], -1)
    for t in (-1.0, 0.0, float("inf")):
        with pytest.raises(ValueError, match="finite temperature > 0"):
            tiny.generate([1, 2], 3, greedy=False, temperature=t)
    # a temperature so small that logits / temperature overflows (NaN probabilities) is greedy, as in vLLM
    assert tiny.generate([1, 2], 3, greedy=False, temperature=1e-45) == tiny.generate([1, 2], 3)
    with pytest.raises(ValueError, match="dtype must be torch.float32, float64, bfloat16 or float16, not torch.int32"):
        ReferenceModel.from_gguf(tiny_checkpoint, dtype=torch.int32)  # loaded, then failed in the first matmul
    for n in (2.5, True):
        with pytest.raises(ValueError, match="num_layers must be in"):
            ReferenceModel.from_gguf(tiny_checkpoint, num_layers=n)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, "float32"], ids=str)
def test_a_dtype_the_model_cannot_compute_in_is_refused_at_load(tiny_checkpoint, dtype):
    """float8 passed the floating-point guard and loaded; the first forward failed with torch's 'Promotion for Float8
    Types is not supported' (fresh-user finding). A dtype's name gave an AttributeError."""
    with pytest.raises(ValueError, match=f"^dtype must be torch.float32, float64, bfloat16 or float16, not {dtype!r}$"):
        ReferenceModel.from_gguf(tiny_checkpoint, dtype=dtype)


def test_fp16_load_computes(tiny_checkpoint, tiny, tok):
    """float16 is one of the dtypes the model computes in (on CPU too), as close to fp32 as bf16 is."""
    fp16 = ReferenceModel.from_gguf(tiny_checkpoint, dtype=torch.float16)
    assert fp16.w["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.float16
    ids = tok.encode(SHORT[1])
    logits = fp16.forward(ids)
    assert logits.dtype == torch.float32 and rel_err(logits, tiny.forward(ids)) < 5e-2

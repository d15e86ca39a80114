"""The synthetic load path (issue 9): GLM-5 GGUF headers without tensor data, the synthetic byte source, and the
``glm5-synthetic`` vLLM load format on the CPU harness."""
from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFReader

from glm5serve import verify
from glm5serve.checkpoint import FULL_PRESETS, PRESETS, layer_slice, preset_config, tensor_type
from glm5serve.config import config_from_metadata
from glm5serve.dequant import dequantize
from glm5serve.errors import GGUFModelError
from glm5serve.gguf_file import GGUFModel
from glm5serve.schema import expected_tensors
from glm5serve.synthetic import BIAS_STD, NORM_STD, SYNTHETIC_KEY, SyntheticSource, write_header

GLM5 = FULL_PRESETS["glm5"]
REFUSAL = "synthetic header without tensor data: serve it with --load-format glm5-synthetic"


@pytest.fixture(scope="module")
def glm5_header(tmp_path_factory) -> GGUFModel:
    """The full 78-layer GLM-5 header (~420 GB apparent), opened once (parsing the 154880-token vocabulary takes
    seconds)."""
    return GGUFModel(write_header(tmp_path_factory.mktemp("glm5") / "glm5.gguf", "glm5"))


@pytest.fixture(scope="module")
def tiny_header(tmp_path_factory) -> Path:
    return write_header(tmp_path_factory.mktemp("tiny") / "tiny.gguf", "tiny")


# -- the header file ----------------------------------------------------------------------------------------------

def test_glm5_header_is_a_sparse_gguf_of_the_full_size(glm5_header):
    st = os.stat(glm5_header.path)
    last = max(glm5_header, key=lambda t: t.data_offset)
    assert st.st_size >= last.data_offset + last.n_bytes  # every tensor's data lies inside the file ...
    assert st.st_blocks * 512 < 32 << 20  # ... but only the header occupies disk
    assert 380e9 < sum(t.n_bytes for t in glm5_header) < 460e9  # UD-Q4_K_XL GLM-5 is ~430 GB
    assert glm5_header.metadata[SYNTHETIC_KEY] is True


def test_glm5_header_has_glm5_dims(glm5_header):
    """Against glm5-gguf.md's numbers, written out here (not read from the preset)."""
    cfg = config_from_metadata(glm5_header)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_nextn_predict_layers, cfg.num_attention_heads) == \
        (6144, 78, 1, 64)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
        (2048, 512, 192, 64, 256)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (256, 8, 1)
    assert (cfg.moe_intermediate_size, cfg.intermediate_size, cfg.first_k_dense_replace) == (2048, 12288, 3)
    assert (cfg.vocab_size, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (154880, 32, 128, 2048)
    assert glm5_header["blk.77.ffn_gate_exps.weight"].shape == (256, 2048, 6144)
    assert glm5_header["blk.78.nextn.eh_proj.weight"].shape == (6144, 12288)  # the MTP block is kept
    assert len(glm5_header.metadata["tokenizer.ggml.tokens"]) == 154880


def test_glm5_header_types_are_the_ud_q4_k_xl_mix(glm5_header):
    """The types glm5-gguf.md gives UD-Q4_K_XL-like checkpoints."""
    want = {"token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K, "output_norm.weight": Q.F32,
            "blk.3.ffn_down_exps.weight": Q.Q5_K, "blk.4.ffn_down_exps.weight": Q.Q4_K,
            "blk.40.ffn_gate_exps.weight": Q.Q4_K, "blk.40.ffn_up_exps.weight": Q.Q4_K,
            "blk.40.attn_k_b.weight": Q.Q8_0, "blk.40.ffn_gate_inp.weight": Q.F32, "blk.40.exp_probs_b.bias": Q.F32}
    assert {n: glm5_header[n].qtype for n in want} == want
    types = {t.qtype for t in glm5_header}
    assert types <= {Q.F32, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0}


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_glm5_header_passes_verifys_static_checks(glm5_header, tp):
    """Every check but ``check_finite`` (which would read the hole)."""
    ctx = verify.Context(str(glm5_header.path), tp, model=glm5_header)
    results = [c for check in (verify.check_metadata, verify.check_tokenizer, verify.check_tensors,
                               verify.check_types, verify.check_tp) for c in check(ctx)]
    assert results and all(c.ok for c in results), [c.line() for c in results if not c.ok]


def test_layer_slice_header_is_the_full_models_first_layers(glm5_header, tmp_path):
    sliced = GGUFModel(write_header(tmp_path / "g5-5.gguf", "glm5", layers=5))
    cfg = config_from_metadata(sliced)
    assert cfg.num_hidden_layers == 5 and cfg.num_nextn_predict_layers == 0
    assert cfg.mlp_layer_types == ["dense"] * 3 + ["sparse"] * 2
    assert set(sliced.tensors) == {n for n in glm5_header.tensors if not n.startswith("blk.") or
                                   int(n.split(".")[1]) < 5}
    for t in sliced:
        full = glm5_header[t.name]
        assert (t.qtype, t.shape) == (full.qtype, full.shape), t.name


def test_layer_slice_needs_a_moe_layer():
    assert layer_slice(GLM5, 4).n_moe_layers == 1
    with pytest.raises(ValueError, match="at least 4 layers"):
        layer_slice(GLM5, 3)


def test_tiny_header_reads_like_the_checkpoint(tiny_header, tiny_checkpoint):
    """gguf-py reads the header; names, types and shapes are those ``make-checkpoint`` writes."""
    r = GGUFReader(tiny_header)
    assert bool(r.fields[SYNTHETIC_KEY].contents()) is True
    real = {t.name: (t.tensor_type, tuple(t.shape)) for t in GGUFReader(tiny_checkpoint).tensors}
    assert {t.name: (t.tensor_type, tuple(t.shape)) for t in r.tensors} == real


def test_normal_load_of_a_header_is_refused_in_one_line(tiny_header):
    from glm5serve.vllm_plugin.cpu import build_and_load

    pytest.importorskip("vllm")
    with pytest.raises(GGUFModelError) as e:
        build_and_load(tiny_header)
    assert str(e.value) == f"{tiny_header}: {REFUSAL}"


def test_reference_engine_refuses_a_header_in_one_line(tiny_header):
    from glm5serve.reference import ReferenceModel

    with pytest.raises(GGUFModelError) as e:
        ReferenceModel.from_gguf(tiny_header)
    assert str(e.value) == f"{tiny_header}: {REFUSAL}"


# -- the byte source ----------------------------------------------------------------------------------------------

def _layouts() -> list[tuple[Q, int, int]]:
    """Every (type, row length, ndim) the tiny and full-size presets store in the ud-q4_k_xl and bf16 mixes."""
    out = set()
    for p in (PRESETS["tiny"], layer_slice(GLM5, 4)):
        for mix in ("ud-q4_k_xl", "bf16"):
            out |= {(tensor_type(s, mix, p), s.shape[-1], len(s.shape)) for s in expected_tensors(preset_config(p))
                    if s.required and len(s.shape) > 1}
    return sorted(out) + [(Q.F16, 512, 2)]


def _info(name: str, qtype: Q, shape) -> SimpleNamespace:
    return SimpleNamespace(name=name, qtype=qtype, shape=tuple(shape))


@pytest.mark.parametrize("qtype,row,ndim", _layouts(), ids=lambda v: getattr(v, "name", str(v)))
def test_source_gives_the_file_layout_and_unit_variance_outputs(qtype, row, ndim):
    shape = (2, 4, row) if ndim == 3 else (8, row)
    data = SyntheticSource(seed=1).read(_info("blk.0.w.weight", qtype, shape))
    block, type_size = GGML_QUANT_SIZES[qtype]
    if qtype in (Q.F32, Q.F16, Q.BF16):
        assert data.dtype == {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
        assert tuple(data.shape) == shape
    else:
        assert data.dtype == torch.uint8 and tuple(data.shape) == (*shape[:-1], row // block * type_size)
    w = dequantize(data, qtype, shape).double()
    assert w.isfinite().all()
    n, sigma = w.numel(), 1 / math.sqrt(row)
    assert abs(float(w.mean())) < 5 * sigma / math.sqrt(n)
    assert float(w.std()) == pytest.approx(sigma, rel=0.06)


@pytest.mark.parametrize("name,mean,std", [("blk.0.attn_norm.weight", 1.0, NORM_STD),
                                           ("blk.3.exp_probs_b.bias", 0.0, BIAS_STD),
                                           ("blk.0.indexer.k_norm.bias", 0.0, BIAS_STD)])
def test_source_vectors_are_norms_near_one_and_biases_near_zero(name, mean, std):
    v = SyntheticSource().read(_info(name, Q.F32, (4096,))).double()
    assert v.dtype == torch.float64 and float(v.mean()) == pytest.approx(mean, abs=4 * std / 64)
    assert float(v.std()) == pytest.approx(std, rel=0.06)


def test_source_is_deterministic_per_seed_and_name():
    info = _info("blk.3.ffn_gate_exps.weight", Q.Q4_K, (4, 8, 512))
    a = SyntheticSource(seed=7).read(info)
    assert torch.equal(a, SyntheticSource(seed=7).read(info))
    assert not torch.equal(a, SyntheticSource(seed=8).read(info))
    assert not torch.equal(a, SyntheticSource(seed=7).read(_info("blk.4.ffn_gate_exps.weight", Q.Q4_K, (4, 8, 512))))


def test_source_blocks_are_quantizer_output():
    """Every block of a tensor is one of the pool the quantizer wrote (no byte is made up here)."""
    src = SyntheticSource(seed=3, pool_blocks=64)
    data = src.read(_info("blk.0.attn_output.weight", Q.Q5_K, (16, 1024)))
    pool = {bytes(b) for b in src._pool(Q.Q5_K, 1024).numpy()}
    blocks = data.reshape(-1, GGML_QUANT_SIZES[Q.Q5_K][1]).numpy()
    assert all(bytes(b) in pool for b in blocks) and len({bytes(b) for b in blocks}) > 32


# -- the glm5-synthetic load format on the CPU harness --------------------------------------------------------------

def test_glm5_synthetic_load_format_fills_every_parameter_from_the_source(tiny_header):
    """``EngineArgs(model=HEADER, load_format="glm5-synthetic")`` -> ModelConfig -> the registered loader -> vLLM's
    model at TP=2, rank 1 -> checked load (the adapter's both-ways check) -> ``process_weights_after_loading``.
    The embedding must hold rank 1's rows of what the source gives for ``token_embd``, dense parameters must be
    finite."""
    pytest.importorskip("vllm")
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader

    from glm5serve.vllm_plugin import register
    from glm5serve.vllm_plugin.cpu import init_single_process, simulated_tp, use_stub_platform
    from glm5serve.vllm_plugin.loader import GLM5SyntheticModelLoader

    use_stub_platform()
    register()
    mc = EngineArgs(model=str(tiny_header), enforce_eager=True, load_format="glm5-synthetic").create_model_config()
    assert mc.quantization == "gguf" and mc.model_weights == str(tiny_header)
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"),
                    load_config=LoadConfig(load_format="glm5-synthetic"))
    init_single_process(vc)
    loader = get_model_loader(vc.load_config)
    assert isinstance(loader, GLM5SyntheticModelLoader)
    with simulated_tp(2, 1):
        model = loader.load_model(vllm_config=vc, model_config=mc)
    params = dict(model.named_parameters())
    emb = GGUFModel(tiny_header)["token_embd.weight"]
    rows = emb.shape[0] // 2
    expected = SyntheticSource(GLM5SyntheticModelLoader.seed).read(emb)[rows:]
    assert torch.equal(params["model.embed_tokens.qweight"][:rows], expected)
    dense = {n: p for n, p in params.items()
             if not isinstance(p, torch.nn.parameter.UninitializedParameter) and p.dtype.is_floating_point}
    assert len(dense) > 20 and all(p.isfinite().all() for p in dense.values())


def test_every_tensor_the_adapter_hands_vllm_is_finite(tiny_header):
    """The adapter's stream with the synthetic source: each ``qweight`` dequantizes (with the ``qweight_type``
    yielded just before it) to finite values, each float tensor is finite; the stream covers every non-MTP
    tensor of the header."""
    pytest.importorskip("vllm")
    from glm5serve.vllm_plugin.config_parser import glm5_config
    from glm5serve.vllm_plugin.weights import SOURCE_ATTR, GlmDsaWeightsAdapter

    cfg = glm5_config(tiny_header)
    adapter = GlmDsaWeightsAdapter(cfg)
    adapter.source = SyntheticSource()
    adapter.prepare_loading(str(tiny_header), SimpleNamespace(hf_config=cfg, dtype=torch.bfloat16), tp_size=1)
    seen, qtype = set(), None
    for name, t in adapter.prepare_weights():
        seen.update(getattr(t, SOURCE_ATTR))
        if name.endswith("qweight_type"):
            qtype = Q(int(t))
            continue
        values = dequantize(t, qtype) if name.endswith("qweight") and qtype not in (Q.F32, Q.F16, Q.BF16) else t
        assert values.float().isfinite().all(), name
    assert seen == adapter.sources


def test_reference_forward_on_synthetic_weights_is_finite(tiny_header):
    """GLM-5's forward (the reference engine) over the source's weights gives finite logits of sane size."""
    from glm5serve.reference import ReferenceModel
    from glm5serve.schema import hf_to_gguf, merge_gate_up, merge_kv_b

    gguf, src = GGUFModel(tiny_header), SyntheticSource()
    cfg = config_from_metadata(gguf)
    weights = {}
    for hf, parts in hf_to_gguf(cfg).items():
        ts = [dequantize(src.read(gguf[p]), gguf[p].qtype, gguf[p].shape) for p in parts]
        merge = merge_kv_b if hf.endswith("kv_b_proj.weight") else merge_gate_up
        weights[hf] = merge(*ts) if len(ts) == 2 else ts[0]
    logits = ReferenceModel(cfg, weights)(torch.arange(0, 300, 7))
    assert logits.isfinite().all() and 0.1 < float(logits.std()) < 100

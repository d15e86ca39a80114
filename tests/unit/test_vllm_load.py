"""GLM-5 GGUF checkpoints loaded into vLLM's own GLM-5 model classes on a CPU, at simulated TP sizes (issue 4, item 5).

Each test builds the model for every rank of a TP size with :func:`glm5serve.vllm_plugin.cpu.build_and_load`
(vLLM's model class, ``create_weights``, weight loaders and ``load_weights``; only the platform, the attention
backend selection and the TP group are stubbed) and compares every parameter, before
``process_weights_after_loading``, with a reference computed here from the GGUF alone by gguf-py:
raw bytes where vLLM keeps the weight quantized, gguf-py-dequantized values where it keeps it dense, rank ``r``
holding rows (column-parallel, vocab) or row bytes (row-parallel) ``[r·N/tp, (r+1)·N/tp)`` of each shard. The ranks'
pieces must also recombine to the TP=1 parameter exactly. TP sizes that ``glm5serve verify --tp`` rejects must fail
to load with verify's message.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q, GGUFReader
from gguf.quants import dequantize

pytest.importorskip("vllm")
pytest.importorskip("vllm_gguf_plugin")

from glm5serve.gguf_file import split_paths  # noqa: E402
from glm5serve.testing import assert_bitwise_equal  # noqa: E402

FLOAT = {Q.F32, Q.F16, Q.BF16}
DTYPE = torch.bfloat16
QTYPE_OF_DTYPE = {torch.bfloat16: Q.BF16, torch.float16: Q.F16, torch.float32: Q.F32}


# -- where each GGUF tensor goes in vLLM (written from vLLM's deepseek_v2/deepseek_v32 model code) ----------------

def destination(name: str, n_layers: int) -> tuple[str, object, str] | None:
    """GGUF tensor -> (vLLM module, shard, split). ``shard``: an int for a stacked parameter, ``w1``/``w3``/``w2``
    for experts, ``k_b``/``v_b`` for kv_b_proj, a parameter name for vectors. ``split``: ``rep`` (whole on every
    rank), ``col`` (rows), ``row`` (last dim), ``vocab``, ``experts``, ``kv_b`` or ``vec``. None for MTP."""
    glob = {"token_embd.weight": ("model.embed_tokens", None, "vocab"),
            "output.weight": ("lm_head", None, "vocab"),
            "output_norm.weight": ("model.norm", "weight", "vec")}
    if name in glob:
        return glob[name]
    _, b, rest = name.split(".", 2)
    if int(b) >= n_layers:
        return None
    L, A = f"model.layers.{b}", f"model.layers.{b}.self_attn"
    table = {
        "attn_norm.weight": (f"{L}.input_layernorm", "weight", "vec"),
        "ffn_norm.weight": (f"{L}.post_attention_layernorm", "weight", "vec"),
        "attn_q_a.weight": (f"{A}.fused_qkv_a_proj", 0, "rep"),
        "attn_kv_a_mqa.weight": (f"{A}.fused_qkv_a_proj", 1, "rep"),
        "attn_q_a_norm.weight": (f"{A}.q_a_layernorm", "weight", "vec"),
        "attn_kv_a_norm.weight": (f"{A}.kv_a_layernorm", "weight", "vec"),
        "attn_q_b.weight": (f"{A}.q_b_proj", None, "col"),
        "attn_k_b.weight": (f"{A}.kv_b_proj", "k_b", "kv_b"),
        "attn_v_b.weight": (f"{A}.kv_b_proj", "v_b", "kv_b"),
        "attn_output.weight": (f"{A}.o_proj", None, "row"),
        "indexer.attn_q_b.weight": (f"{A}.indexer.wq_b", None, "rep"),
        "indexer.attn_k.weight": (f"{A}.indexer.wk_weights_proj", 0, "rep"),
        "indexer.proj.weight": (f"{A}.indexer.wk_weights_proj", 1, "rep"),
        "indexer.k_norm.weight": (f"{A}.indexer.k_norm", "weight", "vec"),
        "indexer.k_norm.bias": (f"{A}.indexer.k_norm", "bias", "vec"),
        "ffn_gate.weight": (f"{L}.mlp.gate_up_proj", 0, "col"),
        "ffn_up.weight": (f"{L}.mlp.gate_up_proj", 1, "col"),
        "ffn_down.weight": (f"{L}.mlp.down_proj", None, "row"),
        "ffn_gate_inp.weight": (f"{L}.mlp.gate", "weight", "vec"),
        "exp_probs_b.bias": (f"{L}.mlp.gate", "e_score_correction_bias", "vec"),
        "ffn_gate_exps.weight": (f"{L}.mlp.experts", "w1", "experts"),
        "ffn_up_exps.weight": (f"{L}.mlp.experts", "w3", "experts"),
        "ffn_down_exps.weight": (f"{L}.mlp.experts", "w2", "experts"),
        "ffn_gate_shexp.weight": (f"{L}.mlp.shared_experts.gate_up_proj", 0, "col"),
        "ffn_up_shexp.weight": (f"{L}.mlp.shared_experts.gate_up_proj", 1, "col"),
        "ffn_down_shexp.weight": (f"{L}.mlp.shared_experts.down_proj", None, "row"),
    }
    return table[rest]


def _piece(a: torch.Tensor, split: str, tp: int, rank: int, dim: int) -> torch.Tensor:
    if split in ("col", "vocab") or (split == "experts" and dim == -2):
        n = a.shape[-2] // tp
        return a.narrow(a.dim() - 2, rank * n, n)
    if split in ("row", "experts"):
        n = a.shape[-1] // tp
        return a.narrow(a.dim() - 1, rank * n, n)
    return a


def _stored(t, dense: bool) -> torch.Tensor:
    """The GGUF tensor as vLLM should hold it: dequantized (dense) or raw bytes (GGUF), floats in the model dtype."""
    shape = tuple(reversed([int(x) for x in t.shape]))
    if dense or t.tensor_type in FLOAT:
        return torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(shape).copy())
    return torch.from_numpy(t.data.copy())


def expected(path, n_layers: int, tp: int, rank: int, vocab_padded: int) -> dict[tuple[str, object], tuple]:
    """(vLLM parameter name, shard) -> (expected tensor, ggml type or None) for rank ``rank`` of ``tp``."""
    tensors = {t.name: t for shard in split_paths(path) for t in GGUFReader(shard).tensors}
    dest = {n: destination(n, n_layers) for n in tensors}
    dest = {n: d for n, d in dest.items() if d is not None}
    float_modules = {d[0] for n, d in dest.items() if tensors[n].tensor_type in FLOAT}
    always_dense = (".kv_b_proj", ".wk_weights_proj", ".mlp.gate")
    out: dict[tuple[str, object], tuple] = {}
    for name, (module, shard, split) in dest.items():
        t = tensors[name]
        if split == "vec":
            out[(f"{module}.{shard}", None)] = (_stored(t, True), None)
            continue
        if split == "kv_b":
            continue  # below, from both halves
        if split == "experts":
            w = _stored(t, False)
            if t.tensor_type in FLOAT:
                w = w.to(DTYPE)
            param = "w2_qweight" if shard == "w2" else "w13_qweight"
            qtype = QTYPE_OF_DTYPE[DTYPE] if t.tensor_type in FLOAT else t.tensor_type
            out[(f"{module}.{param}", shard)] = (_piece(w, split, tp, rank, -1 if shard == "w2" else -2), qtype)
            continue
        dense = module.endswith(always_dense) or module in float_modules
        w = _stored(t, dense)
        if dense or t.tensor_type in FLOAT:
            w = w.to(DTYPE)
        if split == "vocab":  # vLLM pads the vocabulary to a multiple of 64 and gives rank r rows [r·Vp/tp, ...)
            pad = torch.zeros((vocab_padded - w.shape[0], *w.shape[1:]), dtype=w.dtype)
            w = torch.cat([w, pad])
        qtype = None if dense else (QTYPE_OF_DTYPE[DTYPE] if t.tensor_type in FLOAT else t.tensor_type)
        out[(f"{module}.{'weight' if dense else 'qweight'}", shard)] = (_piece(w, split, tp, rank, -2), qtype)
    for name, (module, shard, split) in dest.items():
        if shard == "k_b":  # kv_b_proj = per head [k_b^T | v_b] (the converter's split, inverted), dense
            k_b = _stored(tensors[name], True)
            v_b = _stored(tensors[name.replace("attn_k_b", "attn_v_b")], True)
            h, kvl, nope = k_b.shape
            kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, kvl).to(DTYPE)
            out[(f"{module}.weight", None)] = (_piece(kv_b, "col", tp, rank, -2), None)
    return out


def actual(model) -> dict[tuple[str, object], tuple]:
    """(parameter name, shard) -> (what the parameter holds, its ggml type or None) for every loaded parameter."""
    params, modules = dict(model.named_parameters()), dict(model.named_modules())
    out: dict[tuple[str, object], tuple] = {}
    for name, p in params.items():
        if name.endswith("qweight_type"):
            continue
        if name.endswith("qweight"):
            ptype = params[name + "_type"]
            if ".experts." in name:  # RoutedExperts: one 3-D tensor, gate rows then up rows for w13
                module = name.rsplit(".experts.", 1)[0] + ".experts"
                kind = name.rsplit(".", 1)[-1]
                if kind == "w2_qweight":
                    out[(f"{module}.w2_qweight", "w2")] = (p.data, ptype.shard_weight_type["w2"])
                else:
                    half = p.data.shape[1] // 2
                    out[(f"{module}.w13_qweight", "w1")] = (p.data[:, :half], ptype.shard_weight_type["w1"])
                    out[(f"{module}.w13_qweight", "w3")] = (p.data[:, half:], ptype.shard_weight_type["w3"])
            elif p.data_container:  # stacked GGUF parameter: one stored tensor per shard
                for shard, i in p.shard_id_map.items():
                    out[(name, shard)] = (p.data_container[i], ptype.shard_weight_type[shard])
            else:
                out[(name, None)] = (p.data, ptype.weight_type)
        elif len(getattr(modules[name.rsplit(".", 1)[0]], "output_sizes", ())) > 1:
            # dense stacked parameter (MergedColumnParallelLinear): this rank's rows of each shard, in shard order
            layer = modules[name.rsplit(".", 1)[0]]
            sizes = [n // layer.tp_size for n in layer.output_sizes]
            for shard, rows in enumerate(p.data.split(sizes)):
                out[(name, shard)] = (rows, None)
        else:
            out[(name, None)] = (p.data, None)
    return out


def check_rank(model, path, cfg, tp: int, rank: int) -> dict:
    got = actual(model)
    vocab_padded = -(-cfg.vocab_size // 64) * 64
    want = expected(path, cfg.num_hidden_layers, tp, rank, vocab_padded)
    assert sorted(got, key=str) == sorted(want, key=str), "vLLM parameters != GGUF destinations"
    for key, (w, qtype) in want.items():
        g, gtype = got[key]
        assert gtype == (None if qtype is None else int(qtype)), f"{key}: qweight_type {gtype} != {qtype}"
        assert_bitwise_equal(g, w.to(g.dtype) if g.dtype.is_floating_point else w, err_msg=f"{key} rank {rank}/{tp}")
    return got


def check_recombines(pieces: list[dict], full: dict) -> None:
    """Per-rank pieces of every parameter, concatenated in rank order along its split dimension, equal the TP=1
    parameter; a replicated parameter is the TP=1 parameter on every rank."""
    for key, (whole, _) in full.items():
        parts = [p[key][0] for p in pieces]
        if torch.equal(parts[0], whole):
            assert all(torch.equal(q, whole) for q in parts), f"{key}: replicated, but ranks differ"
            continue
        cats = [torch.cat(parts, dim=d) for d in (-2, -1)] if whole.dim() >= 2 else []
        assert any(c.shape == whole.shape and torch.equal(c, whole) for c in cats), (
            f"{key}: rank pieces {[tuple(q.shape) for q in parts]} do not recombine to the TP=1 parameter "
            f"{tuple(whole.shape)}")


_FULL: dict = {}


def load_and_check(path, kind: str, tp: int):
    from glm5serve.vllm_plugin.cpu import build_and_load

    pieces = []
    for rank in range(tp):
        model, adapter = build_and_load(path, tp=tp, rank=rank, kind=kind)
        cfg = model.config
        pieces.append(check_rank(model, path, cfg, tp, rank))
        del model
    if tp > 1:
        if (path, kind) not in _FULL:
            model, _ = build_and_load(path, tp=1, rank=0, kind=kind)
            _FULL[(path, kind)] = actual(model)
        check_recombines(pieces, _FULL[(path, kind)])
    else:
        _FULL[(path, kind)] = pieces[0]


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", ["generic", "cuda"])
def test_tiny_ud_q4_k_xl_every_parameter_every_rank(tiny_checkpoint, kind, tp):
    load_and_check(str(tiny_checkpoint), kind, tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_bf16_every_parameter_every_rank(tiny_bf16_checkpoint, tp):
    load_and_check(str(tiny_bf16_checkpoint), "generic", tp)


@pytest.mark.parametrize("tp", [1, 2])
def test_tiny_f32_every_parameter_every_rank(tiny_f32_checkpoint, tp):
    load_and_check(str(tiny_f32_checkpoint), "cuda", tp)


def test_tiny_split_set_loads_from_shard_1(tiny_split_checkpoint):
    load_and_check(str(tiny_split_checkpoint), "generic", 2)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_narrow_every_parameter_every_rank(narrow_checkpoint, tp):
    load_and_check(str(narrow_checkpoint), "cuda" if tp == 8 else "generic", tp)


@pytest.mark.parametrize("tp", [3, 8])
def test_tp_that_verify_rejects_fails_to_load_with_its_message(tiny_checkpoint, tp):
    from glm5serve.errors import GGUFModelError
    from glm5serve.verify import verify
    from glm5serve.vllm_plugin.cpu import build_and_load

    failed = [c for c in verify(tiny_checkpoint, tp) if not c.ok]
    assert failed, f"verify accepts TP={tp} for the tiny checkpoint"
    with pytest.raises(GGUFModelError) as e:
        build_and_load(tiny_checkpoint, tp=tp, rank=0)
    assert str(e.value) == failed[0].detail


def test_a_config_that_disagrees_with_the_gguf_on_a_tensor_shape_is_refused(tiny_checkpoint):
    """vLLM builds the model from its config, the adapter reads the GGUF: ``check_file`` refuses a config that
    differs from the metadata on any field that some loaded tensor's shape depends on (found here by changing the
    field and asking the schema, MTP block excluded), naming the field."""
    import copy

    from glm5serve import schema
    from glm5serve.config import config_from_metadata
    from glm5serve.errors import GGUFModelError
    from glm5serve.gguf_file import GGUFModel
    from glm5serve.vllm_plugin.weights import check_file

    def shapes(c):
        return {s.gguf_name: s.shape for s in schema.expected_tensors(c) if s.kind != "mtp"}

    cfg = config_from_metadata(GGUFModel(tiny_checkpoint))
    check_file(tiny_checkpoint, cfg, 1)
    shaping = []
    for field, value in sorted(vars(cfg).items()):
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        other = copy.deepcopy(cfg)
        setattr(other, field, value + 1)
        if shapes(other) == shapes(cfg):
            continue
        shaping.append(field)
        with pytest.raises(GGUFModelError, match=f"{field}={value + 1} \\(GGUF: {value}\\)"):
            check_file(tiny_checkpoint, other, 1)
    assert {"hidden_size", "index_head_dim", "index_n_heads", "first_k_dense_replace", "vocab_size"} <= set(shaping)


@pytest.mark.parametrize("kind", ["generic", "cuda"])
def test_the_stream_stores_every_tensor_as_the_built_model_holds_it(tiny_checkpoint, kind):
    """``prepare_weights`` (the plugin's stream API) decides dense or GGUF storage from ``unquantized_modules``
    alone, without the model; it must hand over every tensor under the names ``load_into`` gives it from the
    parameters of the model vLLM built (e.g. the indexer's ``wk``/``weights_proj``: ``wk_weights_proj`` is built
    without a quant config, so dense)."""
    from glm5serve.vllm_plugin.cpu import build_and_load

    model, adapter = build_and_load(tiny_checkpoint, tp=1, kind=kind)
    built = [name for name, _ in adapter.weights_for(dict(model.named_parameters()))]
    assert "model.layers.0.self_attn.indexer.wk.weight" in built
    assert [name for name, _ in adapter.prepare_weights()] == built


def test_vllm_engine_path_loads_on_cpu_and_mla_gets_k_b_and_v_b(tiny_split_checkpoint):
    """The path ``vllm serve MODEL.gguf`` takes, short of the GPU: engine arguments with nothing but the GGUF ->
    ModelConfig (config and tokenizer from the GGUF) -> the registered ``gguf`` loader -> vLLM's model class from its
    registry -> load -> ``process_weights_after_loading``; at TP=2, rank 1. MLA's absorbed weights must then be the
    file's ``attn_k_b``/``attn_v_b`` of rank 1's heads: ``W_UK_T[h] = k_b[h]^T``, ``W_UV[h] = v_b[h]^T``."""
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader

    from glm5serve.vllm_plugin import register
    from glm5serve.vllm_plugin.cpu import init_single_process, simulated_tp, use_stub_platform
    from glm5serve.vllm_plugin.loader import GLM5GGUFModelLoader

    use_stub_platform()
    register()
    path = str(tiny_split_checkpoint)
    mc = EngineArgs(model=path, enforce_eager=True).create_model_config()
    assert mc.quantization == "gguf" and mc.model_weights == path and mc.architectures == ["GlmMoeDsaForCausalLM"]
    vc = VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"),
                    load_config=LoadConfig(load_format="gguf"))
    init_single_process(vc)
    loader = get_model_loader(vc.load_config)
    assert isinstance(loader, GLM5GGUFModelLoader)
    with simulated_tp(2, 1):
        model = loader.load_model(vllm_config=vc, model_config=mc)
    tensors = {t.name: t for shard in split_paths(path) for t in GGUFReader(shard).tensors}
    mla = [m for m in model.modules() if hasattr(m, "W_UK_T")]
    assert len(mla) == model.config.num_hidden_layers
    heads = model.config.num_attention_heads // 2
    for layer, attn in enumerate(mla):
        k_b = _stored(tensors[f"blk.{layer}.attn_k_b.weight"], True)[heads:]  # rank 1: the second half of the heads
        v_b = _stored(tensors[f"blk.{layer}.attn_v_b.weight"], True)[heads:]
        assert_bitwise_equal(attn.W_UK_T, k_b.transpose(1, 2).to(DTYPE), f"layer {layer} W_UK_T")
        assert_bitwise_equal(attn.W_UV, v_b.transpose(1, 2).to(DTYPE), f"layer {layer} W_UV")


@pytest.fixture(scope="module")
def glm52_checkpoint(tmp_path_factory):
    """tiny with GLM-5.2's per-layer indexers: layer 1 ``shared`` (no indexer tensors; reuses layer 0's top-k)."""
    from glm5serve.checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("glm52"), "tiny", "ud-q4_k_xl",
                           indexer_types=["full", "shared", "full"])


@pytest.mark.parametrize("kind", ["generic", "cuda"])
def test_glm52_shared_indexer_layers_load(glm52_checkpoint, kind):
    load_and_check(str(glm52_checkpoint), kind, 2)


@pytest.mark.parametrize("kind", ["generic", "cuda"])
def test_gguf_tensor_without_a_vllm_parameter_is_a_load_error(tiny_checkpoint, kind):
    """A config that makes vLLM build no indexer on layer 1 while the file has one: the generic class would drop
    those tensors without a word ("this layer has no indexer; drop its checkpoint weights"), the CUDA class would
    fail with a KeyError; the load must fail naming the tensor."""
    from glm5serve.errors import GGUFModelError
    from glm5serve.vllm_plugin.cpu import build_and_load

    with pytest.raises(GGUFModelError, match=r"blk\.1\.indexer\..*: vLLM's model has no parameter model\.layers\.1"):
        build_and_load(tiny_checkpoint, kind=kind, config_overrides={"index_topk_pattern": "FSF"})


def test_shared_layer_indexer_kept_in_the_file_is_not_handed_to_vllm(tmp_path, gguf_rewrite):
    """A file whose ``indexer.types`` makes layer 1 ``shared`` but that keeps its indexer tensors (verify counts them
    as optional; llama.cpp loads them and reuses layer 0's top-k): vLLM builds no indexer there and loads the rest
    (a >= 1M-context file without the key is such a file: GLM-5.2's default layout). The load named the tensor."""
    from glm5serve.checkpoint import make_checkpoint
    from glm5serve.gguf_file import GGUFModel
    from glm5serve.vllm_plugin.cpu import build_and_load

    full = make_checkpoint(tmp_path / "full", "tiny", "ud-q4_k_xl", indexer_types=["full"] * 3)
    path = gguf_rewrite(full, tmp_path / "kept.gguf", set_keys={"glm-dsa.attention.indexer.types": [True, False, True]})
    assert "blk.1.indexer.proj.weight" in GGUFModel(path)
    model, _ = build_and_load(str(path))
    names = [n for n, _ in model.named_parameters()]
    assert not [n for n in names if n.startswith("model.layers.1.self_attn.indexer.")]
    assert [n for n in names if n.startswith("model.layers.2.self_attn.indexer.")]


def test_vllm_parameter_left_unloaded_is_a_load_error(glm52_checkpoint):
    """The reverse: vLLM builds layer 1's indexer but the file has none for it."""
    from glm5serve.errors import GGUFModelError
    from glm5serve.vllm_plugin.cpu import build_and_load

    with pytest.raises(GGUFModelError, match=r"vLLM parameter\(s\) not loaded: model\.layers\.1\.self_attn\.indexer\."):
        build_and_load(glm52_checkpoint, config_overrides={"index_topk_pattern": "FFF"})


def test_mtp_block_is_skipped_not_missing(tiny_checkpoint):
    from glm5serve.gguf_file import GGUFModel
    from glm5serve.vllm_plugin.cpu import build_and_load

    model, adapter = build_and_load(tiny_checkpoint)
    n = model.config.num_hidden_layers
    mtp = {t for t in GGUFModel(tiny_checkpoint).tensors if t.startswith(f"blk.{n}.")}
    assert mtp and not mtp & {s for ld in adapter.plan for s in ld.sources}
    assert not any(f"layers.{n}." in name for name, _ in model.named_parameters())


@pytest.mark.parametrize("fixture,kind,tp", [("tiny_checkpoint", "generic", 2), ("tiny_checkpoint", "cuda", 1),
                                             ("tiny_bf16_checkpoint", "generic", 1)])
def test_ne_padded_with_trailing_ones_loads_the_same_parameters(fixture, kind, tp, request, padded_copy):
    """Tensors stored with ne [K, N, 1] for [K, N] (a quantized matrix, a norm, routed experts, attn_k_b, the
    embedding as [K, N, 1, 1]), as llama.cpp accepts them, load into vLLM's model exactly as the unpadded file's:
    the same parameters, bit for bit, on every rank."""
    from glm5serve.vllm_plugin.cpu import build_and_load

    path = request.getfixturevalue(fixture)
    for rank in range(tp):
        want, got = (actual(build_and_load(p, tp=tp, rank=rank, kind=kind)[0]) for p in (path, padded_copy(path)))
        assert sorted(got, key=str) == sorted(want, key=str)
        for key, (w, wtype) in want.items():
            g, gtype = got[key]
            assert gtype == wtype, key
            assert_bitwise_equal(g, w, err_msg=f"{key} rank {rank}/{tp}")


#: in each kind of stacked module one shard stored unquantized, its sibling quantized (a mix may keep a small tensor
#: in BF16/F16/F32): the plugin cannot mix float and GGUF shards in one fused parameter, so vLLM must build the whole
#: module dense (``weights._unquantized_modules``). The checkpoints quantize every shard alike, so building the module
#: dense only when *all* its shards are float went through the whole suite.
_MIXED_SHARDS = {"blk.0.attn_kv_a_mqa.weight": Q.BF16, "blk.0.ffn_up.weight": Q.F16, "blk.1.ffn_up_shexp.weight": Q.F32}


@pytest.fixture(scope="module")
def mixed_shards_checkpoint(tiny_checkpoint, tmp_path_factory):
    from vllm_gguf import rewrite

    return rewrite(tiny_checkpoint, tmp_path_factory.mktemp("mixed") / "tiny-mixed-shards.gguf", _MIXED_SHARDS)


@pytest.mark.parametrize("kind,tp", [("generic", 1), ("cuda", 2)])
def test_stacked_module_with_one_float_shard_loads_dense(mixed_shards_checkpoint, kind, tp):
    load_and_check(str(mixed_shards_checkpoint), kind, tp)

"""The vllm-gguf-plugin 0.0.5 faults that bite GLM-5 (docs/vllm-integration.md, "read, not run"), each reproduced.

Every test here fails against the unpatched plugin / without the glm5serve fix it names (see
``glm5serve.vllm_plugin.fixes``), on the smallest input that shows it: one vLLM layer where the fault is in a
layer's loader, the tiny checkpoint rewritten where the fault needs a file layout. vLLM 0.33 (installed here) does
not pass ``tp_rank`` to the merged/QKV loaders; vLLM 0.25 (the GPU host) does: both call conventions are tested.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

pytest.importorskip("vllm")
pytest.importorskip("vllm_gguf_plugin")

from glm5serve.errors import GGUFModelError  # noqa: E402
from glm5serve.testing import assert_bitwise_equal  # noqa: E402
from vllm_gguf import rewrite, tensor_values  # noqa: E402


@pytest.fixture(scope="module")
def vllm_ctx(tiny_checkpoint):
    """A registered glm5serve plugin, the stub CPU platform and a current VllmConfig (for building single layers)."""
    from vllm.config import set_current_vllm_config

    from glm5serve.vllm_plugin import register
    from glm5serve.vllm_plugin.config_parser import hf_folder
    from glm5serve.vllm_plugin.cpu import init_single_process, use_stub_platform, vllm_config_for

    use_stub_platform()
    register()
    vc = vllm_config_for(hf_folder(tiny_checkpoint))
    init_single_process(vc)
    with set_current_vllm_config(vc):
        yield vc


def q8_rows(n_rows: int, n_cols: int = 64, seed: int = 0) -> torch.Tensor:
    """Q8_0 bytes of an (n_rows, n_cols) matrix whose row i is all close to i (rows are told apart by value)."""
    rng = np.random.default_rng(seed)
    values = np.arange(n_rows, dtype=np.float32)[:, None] + rng.uniform(-0.25, 0.25, (n_rows, n_cols))
    return torch.from_numpy(quantize(values.astype(np.float32), Q.Q8_0))


@contextlib.contextmanager
def vllm_025_call_convention():
    """vLLM 0.25's ``MergedColumnParallelLinear``/``QKVParallelLinear.weight_loader_v2`` pass ``tp_rank=self.tp_rank``
    to the parameter's ``load_merged_column_weight``/``load_qkv_weight`` (vllm 0.25.0 linear.py); 0.33 does not."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    saved = {}

    def with_rank(cls, method):
        orig = cls.weight_loader_v2
        saved[cls] = orig

        def weight_loader_v2(self, param, loaded_weight, loaded_shard_id=None):
            unbound = getattr(type(param), method)

            def load(loaded_weight, **kw):
                if "shard_size" in kw:  # the sharded branch, where 0.25 adds the rank
                    kw.setdefault("tp_rank", self.tp_rank)
                return unbound(param, loaded_weight, **kw)
            setattr(param, method, load)
            try:
                return orig(self, param, loaded_weight, loaded_shard_id)
            finally:
                delattr(param, method)
        cls.weight_loader_v2 = weight_loader_v2

    with_rank(MergedColumnParallelLinear, "load_merged_column_weight")
    with_rank(QKVParallelLinear, "load_qkv_weight")
    try:
        yield
    finally:
        for cls, orig in saved.items():
            cls.weight_loader_v2 = orig


CONVENTIONS = {"vllm-0.33": contextlib.nullcontext, "vllm-0.25": vllm_025_call_convention}


# -- vllm-gguf-plugin#103: merged/QKV loaders take TP rank 0 ---------------------------------------------------

@pytest.mark.parametrize("convention", CONVENTIONS)
def test_merged_column_gguf_weight_holds_this_ranks_rows(vllm_ctx, convention):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm_gguf_plugin import GGUFConfig

    from glm5serve.vllm_plugin.cpu import simulated_tp

    gate, up = q8_rows(8, seed=1), q8_rows(8, seed=2)
    for rank in range(2):
        with simulated_tp(2, rank), CONVENTIONS[convention]():
            layer = MergedColumnParallelLinear(64, [8, 8], bias=False, quant_config=GGUFConfig(),
                                               prefix="model.layers.0.mlp.gate_up_proj")
            layer.qweight.weight_loader(layer.qweight, gate, 0)
            layer.qweight.weight_loader(layer.qweight, up, 1)
        q = layer.qweight
        assert_bitwise_equal(q.data_container[q.shard_id_map[0]], gate[4 * rank:4 * rank + 4], f"gate rank {rank}")
        assert_bitwise_equal(q.data_container[q.shard_id_map[1]], up[4 * rank:4 * rank + 4], f"up rank {rank}")


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_qkv_gguf_weight_holds_this_ranks_rows(vllm_ctx, convention):
    from vllm.model_executor.layers.linear import QKVParallelLinear
    from vllm_gguf_plugin import GGUFConfig

    from glm5serve.vllm_plugin.cpu import simulated_tp

    # 4 query heads, 2 kv heads of size 2: each of 2 ranks holds 2 q heads (4 rows) and 1 kv head (2 rows)
    shards = {"q": q8_rows(8, seed=3), "k": q8_rows(4, seed=4), "v": q8_rows(4, seed=5)}
    rows = {"q": 4, "k": 2, "v": 2}
    for rank in range(2):
        with simulated_tp(2, rank), CONVENTIONS[convention]():
            layer = QKVParallelLinear(64, 2, 4, 2, bias=False, quant_config=GGUFConfig(),
                                      prefix="model.layers.0.self_attn.qkv_proj")
            for shard, data in shards.items():
                layer.qweight.weight_loader(layer.qweight, data, shard)
        q = layer.qweight
        for shard, data in shards.items():
            n = rows[shard]
            assert_bitwise_equal(q.data_container[q.shard_id_map[shard]], data[n * rank:n * rank + n],
                                 f"{shard} rank {rank}")


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_tiny_model_at_tp2_under_both_call_conventions(tiny_checkpoint, convention):
    from test_vllm_load import load_and_check

    with CONVENTIONS[convention]():
        load_and_check(str(tiny_checkpoint), "generic", 2)


# -- vllm-gguf-plugin PR#131: "weight" -> "qweight" by substring ---------------------------------------------------

def test_plugin_iterator_renames_only_the_suffix(vllm_ctx, tiny_checkpoint):
    from vllm_gguf_plugin.weight_utils import gguf_quant_weights_iterator_multi

    gguf_name = "blk.1.indexer.proj.weight"  # Q8_0 in the ud-q4_k_xl mix
    hf = "model.layers.1.self_attn.indexer.weights_proj.weight"
    names = [n for n, _ in gguf_quant_weights_iterator_multi([str(tiny_checkpoint)], {gguf_name: hf})]
    assert names == ["model.layers.1.self_attn.indexer.weights_proj.qweight_type",
                     "model.layers.1.self_attn.indexer.weights_proj.qweight"]


# -- ReplicatedLinear (the indexer's wq_b) with GGUF parameters -----------------------------------------------------

def test_replicated_linear_loads_gguf_weight(vllm_ctx):
    from vllm.model_executor.layers.linear import ReplicatedLinear
    from vllm_gguf_plugin import GGUFConfig

    data = q8_rows(16, seed=6)
    layer = ReplicatedLinear(64, 16, bias=False, quant_config=GGUFConfig(),
                             prefix="model.layers.0.self_attn.indexer.wq_b")
    layer.qweight_type.weight_loader(layer.qweight_type, torch.tensor(int(Q.Q8_0)))
    layer.qweight.weight_loader(layer.qweight, data)
    assert_bitwise_equal(layer.qweight.data, data, "wq_b qweight")
    assert layer.qweight_type.weight_type == int(Q.Q8_0)


# -- fused-shard order (vllm#35019 / vllm#41057): attn_kv_a_mqa stored first, another quant type ----------------

def _reference_gguf_matmul(x, qweight, qweight_type):
    """CPU stand-in for the plugin's CUDA/Triton ``_fused_mul_mat_gguf``: dequantize with gguf-py, then x @ W.T."""
    if Q(int(qweight_type)) in (Q.F32, Q.F16, Q.BF16):
        return x @ qweight.T
    w = dequantize(qweight.cpu().numpy(), Q(int(qweight_type)))
    return x @ torch.from_numpy(np.ascontiguousarray(w)).to(x.dtype).T


@pytest.fixture(scope="module")
def kv_a_first(tiny_checkpoint, tmp_path_factory):
    """tiny, every block's attn_kv_a_mqa stored before its attn_q_a, q_a in Q8_0 and kv_a_mqa in Q6_K."""
    def order(names):
        out = []
        for n in names:
            if n.endswith("attn_q_a.weight"):
                continue
            out.append(n)
            if n.endswith("attn_kv_a_mqa.weight"):
                out.append(n.replace("attn_kv_a_mqa", "attn_q_a"))
        return out
    types = lambda n, t: Q.Q8_0 if n.endswith("attn_q_a.weight") else t  # noqa: E731
    return rewrite(tiny_checkpoint, tmp_path_factory.mktemp("kv_a_first") / "tiny-kv-a-first.gguf", types, order)


def _fused_qkv_a_output(path, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(fused_qkv_a_proj(x) through the plugin's GGUF linear method, x @ cat(W_q_a, W_kv_a_mqa).T by gguf-py)."""
    import vllm_gguf_plugin.quantization as quantization

    from glm5serve.vllm_plugin.cpu import build_and_load

    model, _ = build_and_load(path, kind="generic")
    layer = model.model.layers[1].self_attn.fused_qkv_a_proj
    types = layer.qweight_type.shard_weight_type
    assert types == {1: int(Q.Q6_K), 0: int(Q.Q8_0)} and list(types) == [1, 0], "kv_a_mqa must arrive first"
    layer.quant_method.process_weights_after_loading(layer)
    monkeypatch.setattr(quantization, "fused_mul_mat_gguf", _reference_gguf_matmul)
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    out = layer.quant_method.apply(layer, x)
    w = torch.cat([torch.from_numpy(tensor_values(path, f"blk.1.{n}.weight")) for n in ("attn_q_a", "attn_kv_a_mqa")])
    return out, x @ w.to(torch.bfloat16).T


def test_fused_qkv_a_is_in_declared_order_whatever_the_storage_order(kv_a_first, monkeypatch):
    out, want = _fused_qkv_a_output(kv_a_first, monkeypatch)
    assert_bitwise_equal(out, want, "fused_qkv_a_proj(x)")


def test_fused_order_check_catches_an_arrival_order_loop(kv_a_first, monkeypatch):
    """The check above is sharp: with the plugin's shard loop planted back to arrival order, it fails."""
    from vllm_gguf_plugin.quantization import linear

    monkeypatch.setattr(linear, "_gguf_ordered_shard_ids", lambda ids: list(ids))
    out, want = _fused_qkv_a_output(kv_a_first, monkeypatch)
    assert out.shape == want.shape and not torch.equal(out, want)


# -- row-parallel / expert down weights sliced by bytes across a quant block ------------------------------------

@pytest.fixture(scope="module")
def down_exps_one_q4_k_block(tiny_checkpoint, tmp_path_factory):
    """tiny with ffn_down_exps in Q4_K: rows of 256 = one block, which TP=2 would cut in half."""
    types = lambda n, t: Q.Q4_K if n.endswith("ffn_down_exps.weight") else t  # noqa: E731
    return rewrite(tiny_checkpoint, tmp_path_factory.mktemp("down") / "tiny-down-q4k.gguf", types)


def test_tp_that_cuts_a_quant_block_is_refused_with_verifys_message(down_exps_one_q4_k_block):
    from glm5serve.verify import verify
    from glm5serve.vllm_plugin.cpu import build_and_load

    failed = [c for c in verify(down_exps_one_q4_k_block, 2) if not c.ok]
    assert [c.name for c in failed] == ["tp"] and "ffn_down_exps" in failed[0].detail
    with pytest.raises(GGUFModelError) as e:
        build_and_load(down_exps_one_q4_k_block, tp=2, rank=0)
    assert str(e.value) == failed[0].detail
    build_and_load(down_exps_one_q4_k_block, tp=1, rank=0)  # the file itself is fine


# -- an unquantized token_embd (seen on vLLM 0.25: "no module or parameter named 'embed_tokens.weight'") ----------

@pytest.fixture(scope="module", params=["F16", "BF16", "F32"])
def float_token_embd(request, tiny_checkpoint, tmp_path_factory):
    qtype = Q[request.param]
    types = lambda n, t: qtype if n == "token_embd.weight" else t  # noqa: E731
    return rewrite(tiny_checkpoint, tmp_path_factory.mktemp("embd") / f"tiny-embd-{request.param}.gguf", types)


def _check_embedding(model, path):
    ids = torch.tensor([0, 5, 511, 42])
    want = torch.from_numpy(tensor_values(path, "token_embd.weight"))[ids].to(torch.bfloat16)
    assert_bitwise_equal(model.model.embed_tokens(ids), want, "embed_tokens(ids)")


@pytest.mark.parametrize("kind", ["generic", "cuda"])
def test_unquantized_token_embd_loads(float_token_embd, kind):
    from glm5serve.vllm_plugin.cpu import build_and_load

    model, _ = build_and_load(float_token_embd, kind=kind)
    assert hasattr(model.model.embed_tokens, "weight"), "an F16/BF16/F32 table loads as a plain embedding"
    _check_embedding(model, float_token_embd)


def test_unquantized_token_embd_loads_into_an_embedding_built_without_prefix(float_token_embd, monkeypatch):
    """vLLM 0.25's Llama builds ``VocabParallelEmbedding`` without ``prefix``: the plugin's prefix match then marks
    it quantized (``qweight``) although the file's table is unquantized -- the fault seen on the H200."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from glm5serve.vllm_plugin.cpu import build_and_load

    init = VocabParallelEmbedding.__init__

    def without_prefix(self, *args, **kwargs):
        if type(self) is VocabParallelEmbedding:  # the input embedding, not ParallelLMHead
            kwargs["prefix"] = ""
        init(self, *args, **kwargs)
    monkeypatch.setattr(VocabParallelEmbedding, "__init__", without_prefix)
    model, _ = build_and_load(float_token_embd)
    assert hasattr(model.model.embed_tokens, "qweight"), "the fault's precondition: a GGUF-built embedding"
    _check_embedding(model, float_token_embd)


# -- glm_moe_dsa unknown to the plugin's name map; kv_b_proj never loaded -------------------------------------------

def test_plugin_default_adapter_cannot_map_glm5(vllm_ctx):
    """Upstream behaviour this project exists for: the plugin's own adapter has no glm_moe_dsa map."""
    from vllm_gguf_plugin.weights_adapter import GGUFWeightsAdapter

    adapter = GGUFWeightsAdapter(vllm_ctx.model_config.hf_config)
    with pytest.raises(RuntimeError, match="Unknown gguf model_type: glm_moe_dsa"):
        adapter.build_name_map(vllm_ctx.model_config)


def test_glm5_gets_the_glm_dsa_adapter(vllm_ctx):
    from vllm_gguf_plugin.weights_adapter import get_weights_adapter

    from glm5serve.vllm_plugin.weights import GlmDsaWeightsAdapter

    assert isinstance(get_weights_adapter(vllm_ctx.model_config.hf_config), GlmDsaWeightsAdapter)


def test_kv_b_proj_not_loaded_is_a_load_error(tiny_checkpoint, monkeypatch):
    """Without the re-fused kv_b_proj (what the plugin's map gives a split-kv_b file), the load must fail and say so."""
    from glm5serve.vllm_plugin import weights
    from glm5serve.vllm_plugin.cpu import build_and_load

    plan = weights._plan
    monkeypatch.setattr(weights, "_plan", lambda g, c: [ld for ld in plan(g, c) if ld.kind != "kv_b"])
    with pytest.raises(GGUFModelError) as e:
        build_and_load(tiny_checkpoint)
    msg = str(e.value)
    assert "GGUF tensor(s) not loaded by vLLM: blk.0.attn_k_b.weight, blk.0.attn_v_b.weight" in msg
    assert "vLLM parameter(s) not loaded: model.layers.0.self_attn.kv_b_proj." in msg


def test_moe_experts_run_in_groups_below_the_int32_limit():
    """vllm-gguf-plugin#127 class (int32 expert offsets in the fused MoE kernels) and plugin PR#130 (expert id -1
    for padding): the fix splits the experts into groups whose tensors stay below the limit, shifts the ids, gives
    slots routed elsewhere (and -1) expert 0 with weight 0, and sums the groups' outputs. With a small limit on
    float experts the grouped result equals one call over all experts, and a -1 slot contributes nothing."""
    from glm5serve.vllm_plugin.fixes import _expert_groups

    g = torch.Generator().manual_seed(0)
    E, H, inter, T, k = 8, 16, 8, 5, 3
    w1, w2 = torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    wts = torch.rand(T, k, generator=g)
    seen = []

    def moe(x, w1, w2, wts, ids, t1, t2, act):  # a stand-in kernel with the op's signature, on float experts
        seen.append(w1.shape[0])
        assert int(ids.min()) >= 0 and int(ids.max()) < w1.shape[0]
        h = torch.einsum("eoh,th->teo", w1, x)[torch.arange(T)[:, None], ids.long()]
        h = torch.nn.functional.silu(h[..., :inter]) * h[..., inter:]
        y = torch.einsum("tsi,tshi->tsh", h, w2[ids.long()])
        return (wts[..., None] * y).sum(1)

    fixed = _expert_groups(moe, limit=3 * 2 * inter * H)
    got = fixed(x, w1, w2, wts, ids, 0, 0, "silu")
    assert seen == [3, 3, 2]
    seen.clear()
    whole = _expert_groups(moe, limit=E * 2 * inter * H)(x, w1, w2, wts, ids, 0, 0, "silu")
    assert seen == [E]
    torch.testing.assert_close(got, whole, rtol=1e-5, atol=1e-5)
    padded = ids.clone()
    padded[1, 0] = padded[3, 2] = -1  # vLLM 0.33's padding slots
    zeroed = wts.clone()
    zeroed[1, 0] = zeroed[3, 2] = 0
    torch.testing.assert_close(fixed(x, w1, w2, wts, padded, 0, 0, "silu"),
                               moe(x, w1, w2, zeroed, ids, 0, 0, "silu"), rtol=1e-5, atol=1e-5)


def test_moe_expert_groups_are_sized_by_the_wider_expert_tensor():
    """The groups are sized by whichever of w13 and w2 spans more elements an expert. A low-bit w13 with a
    high-bit w2 (Q2_K gate/up, Q8_0 down: 0.33 vs 1.06 bytes a value) makes w2 the wider; the test above has w13
    the wider, so sizing the groups by w13 alone passed the suite while w2's offsets could pass the kernels' limit."""
    from glm5serve.vllm_plugin.fixes import _expert_groups

    g = torch.Generator().manual_seed(1)
    E, H, inter, T, k = 8, 16, 8, 5, 3
    w1 = torch.randn(E, 2 * inter, H, generator=g)  # 256 elements an expert
    w2 = torch.randn(E, H, 4 * inter, generator=g)[..., :inter]  # a view spanning 512 elements an expert
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(torch.int32)
    spans = []

    def moe(x, w1, w2, wts, ids, t1, t2, act):  # records the largest element span a kernel call addresses
        spans.append(max(w.shape[0] * w.stride(0) for w in (w1, w2)))
        return torch.zeros_like(x)

    limit = 3 * w2.stride(0)
    _expert_groups(moe, limit=limit)(x, w1, w2, torch.rand(T, k, generator=g), ids, 0, 0, "silu")
    assert len(spans) == 3 and max(spans) <= limit, (spans, limit)

"""Fused-shard order invariance (issue 6, item 2; bug classes 1 and 2).

For any arrival order of the shards of a merged layer -- sizes and quant types drawn independently per shard, the
same type for all shards sometimes (the plugin's one-GEMM path) -- vllm-gguf-plugin's ``GGUFLinearMethod``, as
glm5serve patches it, gives ``x @ cat(W_0..W_n)ᵀ`` in declared order; at TP > 1 each rank gives its own rows of
every shard, still in declared order. Real: vLLM's layer classes and weight loaders, the plugin's parameters,
``process_weights_after_loading`` and ``apply``, glm5serve's fixes. Substituted: the CUDA/Triton matmul op, by
glm5serve's dequantizer + a float64 matmul (:mod:`vllm_layers`). The expected output comes from gguf-py's dequantizer.
"""
from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from glm5serve.testing import assert_bitwise_equal
from glm5serve.testing import strategies as gst
from vllm_layers import as_loaded, cpu_kernels, finish, gguf_py_values, load_gguf, vllm_layers  # noqa: F401

DTYPES = (torch.float32, torch.bfloat16)


def _expected(x: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
    return (x.double() @ torch.cat(parts).T).to(x.dtype)


def _draw_shards(data, n_shards, rows_multiple: int, max_rows: int = 3):
    cols, shards = data.draw(gst.shard_sets(n_shards=n_shards, rows_multiple=rows_multiple, max_rows=max_rows))
    if data.draw(st.booleans(), label="one type for all shards"):
        shards = [(rows, shards[0][1]) for rows, _ in shards]
        block = gst.block_geometry(shards[0][1])[0]
        cols = -(-cols // block) * block
    raws = [data.draw(gst.finite_gguf_rows(q, rows, cols)) for rows, q in shards]
    return cols, shards, raws


def _x(data, cols: int, dtype: torch.dtype) -> torch.Tensor:
    m = data.draw(st.integers(1, 4), label="tokens")
    seed = data.draw(st.integers(0, 2**16), label="x seed")
    return torch.randn(m, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


@given(data=st.data())
def test_merged_column_output_is_in_declared_order(vllm_layers, data):  # noqa: F811
    """``MergedColumnParallelLinear`` (``gate_up_proj``-like, 2-4 shards) at TP 1/2/4, any rank, any arrival order."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_gguf_plugin import GGUFConfig

    from glm5serve.vllm_plugin.cpu import simulated_tp

    tp = data.draw(gst.tp_sizes(4), label="tp")
    rank = data.draw(st.integers(0, tp - 1), label="rank")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    cols, shards, raws = _draw_shards(data, st.integers(2, 4), rows_multiple=tp)
    order = data.draw(gst.arrival_orders(len(shards)), label="arrival order")
    with simulated_tp(tp, rank), set_default_torch_dtype(dtype):
        layer = MergedColumnParallelLinear(cols, [r for r, _ in shards], bias=False, quant_config=GGUFConfig(),
                                           prefix="model.layers.0.mlp.gate_up_proj")
        for i in order:
            load_gguf(layer, as_loaded(raws[i], shards[i][1], cols, dtype), shards[i][1], i)
    finish(layer)
    x = _x(data, cols, dtype)
    with cpu_kernels():
        out, _ = layer(x)
    parts = [gguf_py_values(raw, q, (rows, cols)).narrow(0, rank * rows // tp, rows // tp)
             for raw, (rows, q) in zip(raws, shards)]
    assert_bitwise_equal(out, _expected(x, parts), f"order {order}, tp {tp} rank {rank}")


@given(data=st.data())
def test_fused_qkv_a_proj_is_in_declared_order_on_every_rank(vllm_layers, data):  # noqa: F811
    """vLLM's own ``fused_qkv_a_proj`` class (``DeepSeekV2FusedQkvAProjLinear``: [q_a, kv_a_mqa], replicated): with
    ``attn_kv_a_mqa`` arriving first or second, of another quant type and size, every rank of any TP holds both
    shards whole and computes ``x @ cat(W_q_a, W_kv_a_mqa)ᵀ`` (bug class 1: vllm#35019, vllm#41057)."""
    from vllm.model_executor.models.deepseek_v2 import DeepSeekV2FusedQkvAProjLinear
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_gguf_plugin import GGUFConfig

    from glm5serve.vllm_plugin.cpu import simulated_tp

    tp = data.draw(gst.tp_sizes(8), label="tp")
    rank = data.draw(st.integers(0, tp - 1), label="rank")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    cols, shards, raws = _draw_shards(data, 2, rows_multiple=1, max_rows=6)
    order = data.draw(gst.arrival_orders(2), label="arrival order")
    with simulated_tp(tp, rank), set_default_torch_dtype(dtype):
        layer = DeepSeekV2FusedQkvAProjLinear(cols, [r for r, _ in shards], quant_config=GGUFConfig(),
                                              prefix="model.layers.1.self_attn.fused_qkv_a_proj")
        for i in order:
            load_gguf(layer, as_loaded(raws[i], shards[i][1], cols, dtype), shards[i][1], i)
    finish(layer)
    x = _x(data, cols, dtype)
    with cpu_kernels():
        out, _ = layer(x)
    parts = [gguf_py_values(raw, q, (rows, cols)) for raw, (rows, q) in zip(raws, shards)]
    assert_bitwise_equal(out, _expected(x, parts), f"order {order}, tp {tp} rank {rank}")


@given(data=st.data())
def test_qkv_output_is_in_declared_order(vllm_layers, data):  # noqa: F811
    """``QKVParallelLinear`` with ``q``/``k``/``v`` arriving in any order, kv heads split or replicated across
    ranks: rank r computes ``x @ cat(W_q[r], W_k[r], W_v[r])ᵀ`` with its own heads of each."""
    from vllm.model_executor.layers.linear import QKVParallelLinear
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_gguf_plugin import GGUFConfig

    from glm5serve.vllm_plugin.cpu import simulated_tp

    tp = data.draw(gst.tp_sizes(4), label="tp")
    rank = data.draw(st.integers(0, tp - 1), label="rank")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    head = data.draw(st.integers(1, 3), label="head size")
    kv_heads = data.draw(st.sampled_from([h for h in (1, 2, 4) if h % tp == 0 or tp % h == 0]), label="kv heads")
    q_heads = kv_heads * data.draw(st.integers(1, 2), label="group") * max(1, tp // kv_heads)
    sizes = {"q": q_heads * head, "k": kv_heads * head, "v": kv_heads * head}
    cols, drawn = data.draw(gst.shard_sets(n_shards=3), label="types")
    shards = [(sizes[s], q) for s, (_, q) in zip("qkv", drawn)]
    raws = [data.draw(gst.finite_gguf_rows(q, rows, cols)) for rows, q in shards]
    order = data.draw(gst.arrival_orders(3), label="arrival order")
    with simulated_tp(tp, rank), set_default_torch_dtype(dtype):
        layer = QKVParallelLinear(cols, head, q_heads, kv_heads, bias=False, quant_config=GGUFConfig(),
                                  prefix="model.layers.0.self_attn.qkv_proj")
        for i in order:
            load_gguf(layer, as_loaded(raws[i], shards[i][1], cols, dtype), shards[i][1], "qkv"[i])
    finish(layer)
    x = _x(data, cols, dtype)
    with cpu_kernels():
        out, _ = layer(x)
    q_rows = q_heads * head // tp
    kv_rank = rank // max(1, tp // kv_heads)  # a kv head serves tp / kv_heads ranks when there are fewer than tp
    kv_rows = max(1, kv_heads // tp) * head
    starts = (rank * q_rows, kv_rank * kv_rows, kv_rank * kv_rows)
    parts = [gguf_py_values(raw, q, (rows, cols)).narrow(0, start, n)
             for raw, (rows, q), start, n in zip(raws, shards, starts, (q_rows, kv_rows, kv_rows))]
    assert_bitwise_equal(out, _expected(x, parts), f"order {[('qkv')[i] for i in order]}, tp {tp} rank {rank}")

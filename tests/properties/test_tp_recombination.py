"""TP slice recombination (issue 6, item 2; bug classes 2, 3 and 4).

For every parameter kind and every TP size that divides it, each rank's slice -- loaded by vLLM's own layer and
weight loaders with vllm-gguf-plugin's GGUF parameters, as glm5serve patches them, the rank taken from the TP group
(:func:`glm5serve.vllm_plugin.cpu.simulated_tp`) -- recombines exactly into the unsplit tensor, and the per-rank
computation recombines into the unsplit one: concatenation for column-parallel kinds (bit-exact), a sum for
row-parallel ones (within float rounding). A TP size that would cut a quant block of a row-parallel weight is
refused by glm5serve's TP check (what ``glm5serve verify --tp`` and the vLLM loader apply) with a message naming the
tensor. Kinds: column (``q_b_proj``), merged column (``gate_up_proj``), replicated fused (``fused_qkv_a_proj``),
vocab embedding and ``lm_head`` (vocab padded to 64), row (``o_proj``/``down_proj``), and on the tiny checkpoint
built with vLLM's GLM-5 class: MoE ``w13``/``w2`` and ``kv_b_proj``. The QKV kind is in ``test_fused_shard_order``.
Matmuls run on the CPU stand-in for the plugin's op (:mod:`vllm_layers`); expected values come from gguf-py.
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from hypothesis import given
from hypothesis import strategies as st

from glm5serve.testing import assert_bitwise_equal
from glm5serve.testing import strategies as gst
from vllm_layers import (  # noqa: F401
    FLOAT_TYPES, as_loaded, cpu_kernels, finish, gguf_py_values, load_gguf, running_rank, tiny_vllm_model, vllm_layers)

ALL_TYPES = tuple(gst.SUPPORTED_TYPES)


def _x(data, cols: int, dtype=torch.float32, rows=None) -> torch.Tensor:
    m = rows or data.draw(st.integers(1, 3), label="tokens")
    seed = data.draw(st.integers(0, 2**16), label="x seed")
    return torch.randn(m, cols, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _stored(layer) -> torch.Tensor:
    """What the layer holds for its one (unstacked) GGUF weight."""
    return layer.qweight.data


@contextlib.contextmanager
def _rank(tp: int, rank: int):
    from vllm.utils.torch_utils import set_default_torch_dtype

    from glm5serve.vllm_plugin.cpu import simulated_tp

    with simulated_tp(tp, rank), set_default_torch_dtype(torch.float32):
        yield


def _per_rank(tp: int, build):
    """``build()`` run as every rank of ``tp`` (then as TP 1): ([rank results], unsplit result)."""
    pieces = []
    for r in range(tp):
        with _rank(tp, r):
            pieces.append(build())
    with _rank(1, 0):
        return pieces, build()


# -- column-parallel kinds --------------------------------------------------------------------------------------

@given(data=st.data())
def test_column_parallel_rows_recombine(vllm_layers, data):  # noqa: F811
    """``ColumnParallelLinear`` (``q_b_proj``): rank r holds rows [r·N/tp, (r+1)·N/tp) byte for byte; the ranks'
    outputs concatenated are the unsplit output, bit for bit (class 2)."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm_gguf_plugin import GGUFConfig

    qtype = data.draw(gst.quant_types(ALL_TYPES), label="qtype")
    rows, cols = data.draw(gst.weight_shapes(qtype, max_rows=8, max_blocks_per_row=2), label="shape")
    tp = data.draw(gst.tp_sizes_dividing(rows), label="tp")
    raw = data.draw(gst.finite_gguf_rows(qtype, rows, cols), label="weight")
    x = _x(data, cols)

    def build():
        layer = ColumnParallelLinear(cols, rows, bias=False, quant_config=GGUFConfig(),
                                     prefix="model.layers.0.self_attn.q_b_proj")
        load_gguf(layer, as_loaded(raw, qtype, cols, torch.float32), qtype)
        finish(layer)
        with cpu_kernels():
            return _stored(layer).clone(), layer(x)[0]

    pieces, (whole, out) = _per_rank(tp, build)
    assert_bitwise_equal(torch.cat([p for p, _ in pieces]), whole, f"{qtype.name} rows recombined, tp {tp}")
    assert_bitwise_equal(torch.cat([o for _, o in pieces], dim=1), out, f"{qtype.name} outputs, tp {tp}")
    assert_bitwise_equal(out, (x.double() @ gguf_py_values(raw, qtype, (rows, cols)).T).float(), "vs gguf-py")


@given(data=st.data())
def test_merged_column_rows_of_every_shard_recombine(vllm_layers, data):  # noqa: F811
    """``MergedColumnParallelLinear`` (``gate_up_proj``): rank r holds rows [r·N_i/tp, ...) of *each* shard i
    (not rank 0's, vllm-gguf-plugin#103); per shard, the ranks' rows and outputs concatenate to the unsplit ones."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear
    from vllm_gguf_plugin import GGUFConfig

    tp = data.draw(gst.tp_sizes(4), label="tp")
    cols, shards = data.draw(gst.shard_sets(n_shards=2, rows_multiple=tp), label="shards")
    raws = [data.draw(gst.finite_gguf_rows(q, rows, cols)) for rows, q in shards]
    x = _x(data, cols)

    def build():
        layer = MergedColumnParallelLinear(cols, [r for r, _ in shards], bias=False, quant_config=GGUFConfig(),
                                           prefix="model.layers.0.mlp.gate_up_proj")
        for i, (raw, (_, q)) in enumerate(zip(raws, shards)):
            load_gguf(layer, torch.from_numpy(raw.copy()), q, i)
        finish(layer)
        qw = layer.qweight
        held = [qw.data[start:end, :size].clone() for start, end, size in (qw.shard_offset_map[i] for i in (0, 1))]
        with cpu_kernels():
            return held, layer(x)[0]

    pieces, (whole, out) = _per_rank(tp, build)
    for i, (raw, (rows, q)) in enumerate(zip(raws, shards)):
        assert_bitwise_equal(torch.cat([p[i] for p, _ in pieces]), torch.from_numpy(raw), f"shard {i} rows, tp {tp}")
        assert_bitwise_equal(whole[i], torch.from_numpy(raw), f"shard {i} at TP 1")
    # each rank's output is [shard 0 rows | shard 1 rows]; regroup per shard, then per rank
    n0 = shards[0][0] // tp
    regrouped = torch.cat([o[:, :n0] for _, o in pieces] + [o[:, n0:] for _, o in pieces], dim=1)
    assert_bitwise_equal(regrouped, out, f"outputs recombined, tp {tp}")


@given(data=st.data())
def test_replicated_fused_qkv_a_is_whole_on_every_rank(vllm_layers, data):  # noqa: F811
    """``fused_qkv_a_proj`` is built with ``disable_tp``: every rank of every TP holds both shards whole (a rank
    that sliced them would hold fewer rows), so every rank's output is the TP=1 output."""
    from vllm.model_executor.models.deepseek_v2 import DeepSeekV2FusedQkvAProjLinear
    from vllm_gguf_plugin import GGUFConfig

    tp = data.draw(gst.tp_sizes(8), label="tp")
    cols, shards = data.draw(gst.shard_sets(n_shards=2, rows_multiple=8), label="shards")
    raws = [data.draw(gst.finite_gguf_rows(q, rows, cols)) for rows, q in shards]
    x = _x(data, cols)

    def build():
        layer = DeepSeekV2FusedQkvAProjLinear(cols, [r for r, _ in shards], quant_config=GGUFConfig(),
                                              prefix="model.layers.0.self_attn.fused_qkv_a_proj")
        for i, (raw, (_, q)) in enumerate(zip(raws, shards)):
            load_gguf(layer, torch.from_numpy(raw.copy()), q, i)
        finish(layer)
        with cpu_kernels():
            return layer(x)[0]

    pieces, out = _per_rank(tp, build)
    for r, o in enumerate(pieces):
        assert_bitwise_equal(o, out, f"rank {r} of {tp}")


@given(data=st.data())
def test_vocab_embedding_and_lm_head_rows_recombine(vllm_layers, data):  # noqa: F811
    """``VocabParallelEmbedding``/``ParallelLMHead``: the vocabulary is padded to a multiple of 64 and rank r holds
    padded rows [r·Vp/tp, (r+1)·Vp/tp) (class 4); the real rows recombine to the GGUF table, padding rows are zero,
    the ranks' logits concatenate to the unsplit logits and the ranks' masked lookups sum to the unsplit lookup."""
    import torch._dynamo
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm_gguf_plugin import GGUFConfig

    qtype = data.draw(gst.quant_types(ALL_TYPES), label="qtype")
    vocab = data.draw(st.integers(1, 200), label="vocab")
    cols = data.draw(st.integers(1, 2), label="blocks") * GGML_QUANT_SIZES[qtype][0]
    tp = data.draw(gst.tp_sizes(4), label="tp")
    raw = data.draw(gst.finite_gguf_rows(qtype, vocab, cols), label="table")
    ids = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6), label="ids"))
    x = _x(data, cols)
    padded = -(-vocab // 64) * 64

    def build():
        emb = VocabParallelEmbedding(vocab, cols, quant_config=GGUFConfig(), prefix="model.embed_tokens",
                                     reduce_results=False)
        head = ParallelLMHead(vocab, cols, quant_config=GGUFConfig(), prefix="lm_head")
        for layer in (emb, head):
            load_gguf(layer, as_loaded(raw, qtype, cols, torch.float32), qtype)
            finish(layer)
        # vLLM compiles its vocab masking with inductor; run it eagerly (same code, no compiler in the loop)
        with cpu_kernels(), torch._dynamo.config.patch(disable=True):
            return emb.qweight.data.clone(), emb(ids), head.quant_method.apply(head, x)

    pieces, (table, lookup, logits) = _per_rank(tp, build)
    rows = padded // tp
    assert all(p[0].shape[0] == rows for p in pieces), "each rank holds Vp/tp rows"
    held = torch.cat([p[0] for p in pieces])
    assert_bitwise_equal(held[:vocab], table[:vocab], f"{qtype.name} table rows recombined, tp {tp}")
    assert not held[vocab:].any(), "padding rows are zero"
    assert_bitwise_equal(table[:vocab], as_loaded(raw, qtype, cols, torch.float32), "TP=1 table is the GGUF's")
    # the all-reduce adds other ranks' +0.0 to each row: -0.0 may become +0.0, any other value is kept exactly
    torch.testing.assert_close(torch.stack([p[1] for p in pieces]).sum(0), lookup, rtol=0, atol=0)
    assert_bitwise_equal(lookup, gguf_py_values(raw, qtype, (vocab, cols))[ids].float(), "lookup vs gguf-py")
    assert_bitwise_equal(torch.cat([p[2] for p in pieces], dim=1)[:, :vocab], logits[:, :vocab], "logits")


# -- row-parallel kinds and the quant-block rule -------------------------------------------------------------------

def _tp_refusal(qtype: Q, rows: int, cols: int, tp: int, name: str = "blk.0.attn_output.weight") -> str | None:
    """glm5serve's TP check (:func:`glm5serve.verify.tp_problems`, which the vLLM loader runs too) on one
    row-parallel GGUF tensor: the refusal message, or None."""
    from types import SimpleNamespace

    from glm5serve import schema
    from glm5serve.gguf_file import TensorInfo

    block, size = GGML_QUANT_SIZES[qtype]
    info = TensorInfo(name, qtype, (cols, rows), (rows, cols), rows * cols // block * size, "model.gguf", 0,
                      np.zeros((rows, cols // block * size), np.uint8))
    spec = schema.TensorSpec(name, (rows, cols), "attention", 0, "x.weight", tp_split="row")
    cfg = SimpleNamespace(num_attention_heads=48, moe_intermediate_size=48, intermediate_size=48)  # any TP <= 16
    from glm5serve.verify import tp_problems

    problems = tp_problems(cfg, [info], {name: spec}, tp)
    return problems[0][1] if problems else None


@given(qtype=gst.quant_types(ALL_TYPES), blocks=st.integers(1, 16), tp=st.sampled_from((1, 2, 3, 4, 8, 16)))
def test_tp_that_cuts_a_quant_block_is_refused(qtype, blocks, tp):
    """Class 3: vLLM slices row-parallel GGUF weights by bytes, so TP is refused exactly when a rank's share of the
    row is not a whole number of quant blocks, with a message naming the type and block size."""
    block = GGML_QUANT_SIZES[qtype][0]
    cols = blocks * block
    why = _tp_refusal(qtype, 4, cols, tp)
    cuts = cols % tp != 0 or (cols // tp) % block != 0
    assert (why is not None) == cuts, f"{qtype.name} row {cols} at TP {tp}: refusal {why!r}"
    if why:
        assert f"split {tp} ways" in why and f"{qtype.name} blocks of {block}" in why


@given(data=st.data())
def test_row_parallel_bytes_recombine_and_partial_sums_add_up(vllm_layers, data):  # noqa: F811
    """``RowParallelLinear`` (``o_proj``/``down_proj``) at every TP that glm5serve accepts for the drawn type: rank
    r holds the bytes of columns [r·K/tp, (r+1)·K/tp), which are whole blocks dequantizing to exactly those
    columns; the ranks' partial products sum to the unsplit product (within float rounding)."""
    from vllm.model_executor.layers.linear import RowParallelLinear
    from vllm_gguf_plugin import GGUFConfig

    qtype = data.draw(gst.quant_types(ALL_TYPES), label="qtype")
    rows, cols = data.draw(gst.weight_shapes(qtype, max_rows=6, max_blocks_per_row=8), label="shape")
    tp = data.draw(st.sampled_from([t for t in gst.TP_SIZES if _tp_refusal(qtype, rows, cols, t) is None]), label="tp")
    raw = data.draw(gst.finite_gguf_rows(qtype, rows, cols), label="weight")
    x = _x(data, cols)
    k = cols // tp

    def build():
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        layer = RowParallelLinear(cols, rows, bias=False, reduce_results=False, quant_config=GGUFConfig(),
                                  prefix="model.layers.0.self_attn.o_proj")
        load_gguf(layer, as_loaded(raw, qtype, cols, torch.float32), qtype)
        finish(layer)
        r, share = get_tensor_model_parallel_rank(), cols // get_tensor_model_parallel_world_size()
        with cpu_kernels():  # RowParallelLinear's input is already split (input_is_parallel)
            return _stored(layer).clone(), layer(x[:, r * share:(r + 1) * share].contiguous())[0]

    pieces, (whole, out) = _per_rank(tp, build)
    assert_bitwise_equal(torch.cat([p for p, _ in pieces], dim=1), whole, f"{qtype.name} bytes recombined, tp {tp}")
    values = gguf_py_values(raw, qtype, (rows, cols))
    for r, (p, _) in enumerate(pieces):
        held = p.double() if qtype in FLOAT_TYPES else gguf_py_values(p.numpy(), qtype, (rows, k))
        assert_bitwise_equal(held, values[:, r * k:(r + 1) * k], f"{qtype.name} rank {r} of {tp}: its columns")
    total = sum(o.double() for _, o in pieces)
    bound = x.double().abs() @ values.abs().T
    assert torch.all((total - out.double()).abs() <= 2e-6 * bound + 1e-30), f"partial sums, tp {tp}"


# -- MoE w13/w2 (with the shared experts) and kv_b_proj, in vLLM's GLM-5 model on the tiny checkpoint -------------

TINY_TPS = (2, 4)  # the tiny preset's max_tp is 4


def _ranks(path, tp: int) -> list:
    return [tiny_vllm_model(path, tp, r) for r in range(tp)]


@pytest.mark.parametrize("tp", TINY_TPS)
def test_routed_expert_slices_recombine(vllm_layers, tiny_checkpoint, tp):  # noqa: F811
    """``w13`` of rank r holds rows [r·I/tp, ...) of every expert's gate and of its up (in that order), ``w2`` the
    bytes of columns [r·I/tp, ...) of every expert's down; concatenated over ranks they are the TP=1 tensors."""
    full = tiny_vllm_model(tiny_checkpoint).model.layers[1].mlp.experts.routed_experts
    ranks = [m.model.layers[1].mlp.experts.routed_experts for m in _ranks(tiny_checkpoint, tp)]
    half = full.w13_qweight.shape[1] // 2
    for part, rows in (("gate", slice(0, half)), ("up", slice(half, 2 * half))):
        pieces = [e.w13_qweight.data.view(e.w13_qweight.shape[0], 2, half // tp, -1)[:, 0 if part == "gate" else 1]
                  for e in ranks]
        assert_bitwise_equal(torch.cat(pieces, dim=1), full.w13_qweight.data[:, rows], f"w13 {part}, tp {tp}")
    assert_bitwise_equal(torch.cat([e.w2_qweight.data for e in ranks], dim=-1), full.w2_qweight.data, f"w2, tp {tp}")


@pytest.mark.parametrize("tp", TINY_TPS)
@given(tokens=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_moe_layer_rank_outputs_sum_to_unsplit(vllm_layers, tiny_checkpoint, tp, tokens, seed):  # noqa: F811
    """vLLM's ``DeepseekV2MoE`` forward (router, routed experts ``w13``/``w2`` through the plugin's MoE method,
    shared experts through its linear method) run as each rank of ``tp``: the ranks' partial outputs (what the
    all-reduce adds) sum to the TP=1 output."""
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(seed))
    full = tiny_vllm_model(tiny_checkpoint)
    with running_rank(full):
        want = full.model.layers[1].mlp(x).double()
    total = torch.zeros_like(want)
    for r, model in enumerate(_ranks(tiny_checkpoint, tp)):
        with running_rank(model, tp, r):
            total += model.model.layers[1].mlp(x).double()
    scale = want.abs().max()
    assert (total - want).abs().max() <= 1e-5 * scale, f"tp {tp}: {(total - want).abs().max()} vs |y| {scale}"


@pytest.mark.parametrize("tp", TINY_TPS)
def test_kv_b_proj_rank_outputs_concatenate(vllm_layers, tiny_checkpoint, tp):  # noqa: F811
    """``kv_b_proj`` (re-fused from ``attn_k_b``/``attn_v_b``, dense, column-parallel by heads): rank r holds the
    rows of heads [r·H/tp, ...); the ranks' outputs concatenated are the TP=1 output."""
    full = tiny_vllm_model(tiny_checkpoint).model.layers[0].self_attn.kv_b_proj
    latent = torch.randn(3, full.weight.shape[1], generator=torch.Generator().manual_seed(tp))
    ranks = [m.model.layers[0].self_attn.kv_b_proj for m in _ranks(tiny_checkpoint, tp)]
    assert_bitwise_equal(torch.cat([k.weight.data for k in ranks]), full.weight.data, f"kv_b rows, tp {tp}")
    with running_rank(tiny_vllm_model(tiny_checkpoint)):
        want = full(latent)[0]
    outs = []
    for r, k in enumerate(ranks):
        with running_rank(tiny_vllm_model(tiny_checkpoint, tp, r), tp, r):
            outs.append(k(latent)[0])
    torch.testing.assert_close(torch.cat(outs, dim=1), want, rtol=1e-6, atol=1e-6)

"""Split rows (``glm5serve.kernels.gguf_split``) on the CPU: the regrouping is a lossless permutation of each row's
bytes with the documented field layout, bad input is refused in one line, the launch heuristic keeps its measured
tiles, and ``vllm_ops.split_linear_weights`` regroups exactly the GGUF linear weights (and fused shards) it should.
The kernels themselves run in ``test_kernels_interpret.py`` (interpreter) and ``tests/gpu/test_kernels_gpu.py``."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from glm5serve.kernels.gguf_gemv import supports
from glm5serve.kernels.gguf_split import (
    SPLIT_Q6_K_ENV,
    SPLIT_QTYPES,
    as_served,
    base_type,
    can_split,
    join_rows,
    pick_split_config,
    served_split,
    split_rows,
    split_type,
)

TYPES = (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q6_K)
FIELDS = {Q.Q8_0: [("d", 0, 2), ("qs", 2, 34)], Q.Q4_0: [("d", 0, 2), ("qs", 2, 18)],
          Q.Q5_0: [("d", 0, 2), ("qh", 2, 6), ("qs", 6, 22)]}  # (name, start, end) in a GGUF block (ggml-common.h)


@settings(max_examples=30, deadline=None)
@given(qtype=st.sampled_from(TYPES[:3]), lead=st.sampled_from(((3,), (2, 5))), blocks=st.sampled_from((2, 4, 8)),
       pad=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_split_rows_regroup_fields_losslessly(qtype, lead, blocks, pad, seed):
    """Every row's bytes become qs of all blocks | qh of all blocks | d of all blocks, each in block order; padding
    stays; ``join_rows`` undoes it.  The expected row is built field by field from the GGUF block layout."""
    bb = GGML_QUANT_SIZES[qtype][1]
    raw = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (*lead, blocks * bb + pad), dtype=np.uint8))
    split = split_rows(raw, qtype, 32 * blocks)
    assert split.shape == raw.shape and split.dtype == torch.uint8
    blk = raw[..., :blocks * bb].reshape(*lead, blocks, bb)
    fields = {name: blk[..., a:b].reshape(*lead, -1) for name, a, b in FIELDS[qtype]}
    expect = torch.cat([fields[n] for n in ("qs", "qh", "d") if n in fields] + [raw[..., blocks * bb:]], dim=-1)
    assert torch.equal(split, expect)
    assert torch.equal(join_rows(split, split_type(qtype), 32 * blocks), raw)


def _q6_k_split_weights(row: np.ndarray, nb: int) -> np.ndarray:
    """The weights of one Q6_K split row (nb 256-element blocks) read as ``gguf_split._step_split`` documents the
    layout, element by element: qs[16] | qh[8] per 32-element group, int8 scale pairs, fp16 d per block."""
    g = 8 * nb
    qs, qh = row[:16 * g].reshape(g, 16), row[16 * g:24 * g].reshape(g, 8)
    sc = row[24 * g:26 * g].view(np.int8).reshape(g, 2).astype(np.float64)
    d = row[26 * g:26 * g + 2 * nb].view(np.float16).astype(np.float64)
    w = np.empty((g, 32))
    for grp in range(g):
        for i in range(32):
            half, j = divmod(i, 16)
            p, r = divmod(j // 4, 2)
            low = (int(qs[grp, j]) >> (4 * half)) & 0xF
            top = (int(qh[grp, 4 * p + j % 4]) >> (4 * r + 2 * half)) & 3
            w[grp, i] = d[grp // 8] * sc[grp, half] * ((low | top << 4) - 32)
    return w.reshape(-1)


@settings(max_examples=8, deadline=None)
@given(nb=st.sampled_from((2, 4)), pad=st.integers(0, 5), seed=st.integers(0, 2**16))
def test_q6_k_split_rows_hold_the_same_weights(nb, pad, seed):
    """Q6_K split rows re-lay each block's bits per 32-element group: read back by the documented layout they give
    gguf-py's dequantization of the GGUF rows, the padding stays, and ``join_rows`` restores the bytes."""
    from gguf import quants

    raw = np.random.default_rng(seed).integers(0, 256, (3, 210 * nb + pad), dtype=np.uint8)
    raw[:, 209:210 * nb:210] &= 0x3F  # the fp16 d of each block kept finite (high byte), other bytes random
    split = split_rows(torch.from_numpy(raw), Q.Q6_K, 256 * nb)
    ref = quants.dequantize(raw[:, :210 * nb], Q.Q6_K).astype(np.float64)
    for n in range(3):
        np.testing.assert_array_equal(_q6_k_split_weights(split[n].numpy(), nb), ref[n])
    assert torch.equal(split[:, 210 * nb:], torch.from_numpy(raw[:, 210 * nb:]))
    assert torch.equal(join_rows(split, split_type(Q.Q6_K), 256 * nb), torch.from_numpy(raw))


def test_type_ids_and_layout_conditions(monkeypatch):
    assert {split_type(q) for q in TYPES} == SPLIT_QTYPES and all(base_type(split_type(q)) == q for q in TYPES)
    assert base_type(Q.Q4_K) == Q.Q4_K
    assert can_split(Q.Q8_0, 64) and not can_split(Q.Q8_0, 96) and not can_split(Q.Q4_K, 512)
    assert can_split(Q.Q6_K, 512) and not can_split(Q.Q6_K, 256) and not can_split(Q.Q6_K, 768)
    w = torch.zeros(4, 3 * 34, dtype=torch.uint8)
    assert as_served(w, Q.Q8_0, 96) == (w, int(Q.Q8_0))  # 3 blocks per row: stays GGUF
    got, t = as_served(torch.zeros(4, 68, dtype=torch.uint8), Q.Q8_0, 64)
    assert t == split_type(Q.Q8_0) and got.shape == (4, 68)
    q6 = torch.zeros(4, 420, dtype=torch.uint8)
    monkeypatch.setenv(SPLIT_Q6_K_ENV, "0")
    assert as_served(q6, Q.Q6_K, 512) == (q6, int(Q.Q6_K))  # Q6_K is served as GGUF rows when asked
    monkeypatch.delenv(SPLIT_Q6_K_ENV, raising=False)
    assert as_served(q6, Q.Q6_K, 512)[1] == split_type(Q.Q6_K)  # and as split rows by default
    # a bool for type ids of any integer kind (a torch integer gave a tensor)
    for q in (torch.tensor(int(Q.Q6_K)), np.int64(Q.Q6_K), Q.Q6_K, torch.tensor(int(Q.Q8_0))):
        assert served_split(q, 512) is True
    assert served_split(torch.tensor(int(Q.Q4_K)), 512) is False and served_split("Q8_0", 64) is False
    monkeypatch.setenv(SPLIT_Q6_K_ENV, "0")
    assert served_split(torch.tensor(int(Q.Q6_K)), 512) is False and served_split(Q.Q8_0, 64) is True
    monkeypatch.setenv(SPLIT_Q6_K_ENV, "false")  # not a value it takes: refused, not read as "split"
    with pytest.raises(ValueError, match=r"\$GLM5SERVE_SPLIT_Q6_K='false': expected one of 1, 0"):
        served_split(Q.Q6_K, 512)
    monkeypatch.delenv(SPLIT_Q6_K_ENV, raising=False)
    # split rows are only read by glm5serve: every batch size, K of an even number of blocks
    assert supports(split_type(Q.Q5_0), 4096, 7, 64) and not supports(split_type(Q.Q5_0), 1, 7, 96)
    assert supports(split_type(Q.Q6_K), 3, 7, 1024) and not supports(split_type(Q.Q6_K), 3, 7, 768)


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(ValueError, match="^split_type: no split layout for Q4_K$"):
        split_type(Q.Q4_K)
    # each function names itself (both said "split rows:"; join_rows blamed base_type for its own argument)
    with pytest.raises(ValueError, match="^join_rows: qtype='Q8_0' is not a GGML type id"):
        join_rows(torch.zeros(2, 68, dtype=torch.uint8), "Q8_0", 64)
    with pytest.raises(ValueError, match="^join_rows: Q8_0 rows of K=96 have no split layout"):
        join_rows(torch.zeros(2, 102, dtype=torch.uint8), split_type(Q.Q8_0), 96)
    with pytest.raises(ValueError, match="^split_rows: K=64.0 must be an int >= 0$"):
        split_rows(torch.zeros(2, 68, dtype=torch.uint8), Q.Q8_0, 64.0)
    w = torch.arange(2 * 68, dtype=torch.uint8).view(2, 68)  # K of any integer kind (a tensor K was "no layout")
    assert torch.equal(split_rows(w, Q.Q8_0, torch.tensor(64)), split_rows(w, Q.Q8_0, np.int64(64)))
    with pytest.raises(ValueError, match="Q8_0 rows of K=96 have no split layout"):
        split_rows(torch.zeros(2, 102, dtype=torch.uint8), Q.Q8_0, 96)
    with pytest.raises(ValueError, match=r"Q5_0 weight \(2, 40\) torch.uint8 does not hold uint8 rows of 44 bytes"):
        split_rows(torch.zeros(2, 40, dtype=torch.uint8), Q.Q5_0, 64)
    from glm5serve.kernels import gguf_linear

    with pytest.raises(ValueError, match="Q4_0/split weight"):
        gguf_linear(torch.zeros(1, 64), torch.zeros(2, 36, dtype=torch.uint8), split_type(Q.Q4_0), 3)
    # K short of a block: no "0 bytes per row"
    with pytest.raises(ValueError, match=r"^gguf_linear: Q4_K weight \(2, 144\) does not hold 2 rows of K=100 \(K "
                                         r"must be a multiple of 256\)$"):
        gguf_linear(torch.zeros(1, 100), torch.zeros(2, 144, dtype=torch.uint8), Q.Q4_K, 2)


@pytest.mark.parametrize("qtype,M,N,K,expect", [
    # (block_n, kbs, split_k, num_warps, block_m)
    (Q.Q8_0, 1, 2048, 6144, (4, 64, 1, 4, 1)),     # 512 row tiles of 4 rows: no split-K, steps of 64 blocks
    (Q.Q8_0, 1, 6144, 2048, (4, 32, 1, 4, 1)),     # 64 blocks per row: 2 steps of 32
    (Q.Q4_0, 1, 2048, 16384, (4, 64, 1, 4, 1)),    # 512 blocks per row: steps of at most 64
    (Q.Q4_0, 3, 2048, 6144, (64, 16, 12, 4, 4)),   # 128 row tiles of 16 rows: 32 of 64 rows, split-K over 12 steps
    (Q.Q4_0, 4, 6144, 2048, (16, 32, 1, 4, 4)),    # 384 row tiles of 16 rows
    (Q.Q8_0, 8, 2048, 6144, (16, 16, 3, 4, 8)),    # 2 programs per SM aimed at from 5 rows
    (Q.Q5_0, 16, 2048, 6144, (32, 8, 5, 4, 16)),   # no tensor-core kernel for Q5_0: dp4a at 9..16 rows too
    (Q.Q5_0, 4, 512, 6144, (64, 4, 48, 4, 4)),
    (Q.Q5_0, 8, 6144, 2048, (32, 8, 2, 4, 8)),
    (Q.Q4_0, 1, 7, 64, (8, 2, 1, 4, 1)),           # kbs capped to the row's 2 blocks
    (Q.Q6_K, 1, 19360, 6144, (8, 32, 1, 2, 1)),    # lm_head/8: 2420 row tiles, >= 8 per SM
    (Q.Q6_K, 1, 6144, 2048, (8, 32, 1, 4, 1)),     # 768 row tiles of 8 rows
    (Q.Q6_K, 1, 2048, 6144, (4, 64, 1, 4, 1)),     # 256 of 8 rows are too few, 512 of 4 are not
    (Q.Q6_K, 4, 6144, 2048, (8, 32, 1, 2, 4)),     # 768 row tiles fill the GPU
    (Q.Q6_K, 4, 19360, 6144, (8, 32, 1, 2, 4)),    # 2420 row tiles of 8 rows: >= 8 per SM
    (Q.Q5_0, 1, 512, 6144, (64, 8, 24, 4, 1)),     # 8 row tiles: split-K over all 24 K steps
    (Q.Q6_K, 8, 2048, 6144, (64, 4, 8, 4, 8)),
])
def test_pick_split_config_examples(qtype, M, N, K, expect):
    c = pick_split_config(split_type(qtype), M, N, K, 132)
    assert c.q8 and not c.mma and (c.block_n, c.kbs, c.split_k, c.num_warps, c.block_m) == expect, c
    # loads one step ahead on the row tiles of 4 (and legacy types' 16) rows at 1..4 activation rows (measured
    # slower with split-K and on Q6_K's 8-row tiles)
    assert c.ahead == (M <= 4 and c.split_k == 1 and (c.block_n == 4 or (c.block_n == 16 and qtype != Q.Q6_K))), c
    # a tile given explicitly (the GPU sweep's) takes the same split-K and block_m rules
    bn, kbs, _, warps, _ = expect
    for per_sm in (2, 8):
        t = pick_split_config(split_type(qtype), M, N, K, 132, (bn, kbs, per_sm, warps))
        assert (t.block_n, t.kbs, t.num_warps, t.block_m) == expect[:2] + expect[3:] and t.q8
    assert pick_split_config(split_type(qtype), M, N, K, 132, (bn, kbs, 8, warps)).split_k >= \
        pick_split_config(split_type(qtype), M, N, K, 132, (bn, kbs, 2, warps)).split_k


@pytest.mark.parametrize("qtype,M,N,K,expect", [
    # (block_n, kbs = groups per step, split_k, num_warps, stages)
    (Q.Q6_K, 16, 2048, 6144, (64, 8, 12, 4, 2)),   # 32 row tiles, 24 steps: ~4 programs per SM -> 12 splits of 2
    (Q.Q8_0, 9, 6144, 2048, (64, 8, 4, 4, 2)),     # 96 row tiles, 8 steps: 6 splits wanted, 2 steps each: 4
    (Q.Q4_0, 12, 512, 6144, (64, 8, 24, 4, 2)),    # 8 row tiles: a split per step
    (Q.Q6_K, 16, 19360, 6144, (64, 8, 4, 4, 2)),   # 303 row tiles >= 2 per SM: still 4-way split (SPLIT_MMA_MIN_SPLIT)
    (Q.Q8_0, 9, 19360, 2048, (64, 8, 4, 4, 2)),    # 8 steps: 4 splits of 2
    (Q.Q6_K, 16, 19360, 512, (64, 8, 2, 4, 2)),    # 2 steps: split capped at 2
    (Q.Q6_K, 16, 12288, 6144, (64, 8, 3, 4, 2)),   # 192 row tiles < 2 per SM: ~4 programs per SM -> 3 splits
    (Q.Q4_0, 16, 2048, 64, (64, 8, 1, 4, 2)),      # 2 groups: one step
])
def test_pick_split_config_takes_the_tensor_cores_from_9_rows(qtype, M, N, K, expect):
    """Q8_0 / Q4_0 / Q6_K split rows at 9..16 rows: the int8 tensor-core launch (``gguf_split._split_mma_config``);
    8 rows and an explicit tile stay on dp4a."""
    c = pick_split_config(split_type(qtype), M, N, K, 132)
    assert c.mma and c.q8 and c.block_m == 16 and (c.block_n, c.kbs, c.split_k, c.num_warps, c.stages) == expect, c
    assert not pick_split_config(split_type(qtype), 8, N, K, 132).mma
    assert not pick_split_config(split_type(qtype), M, N, K, 132, (16, 16, 2, 4)).mma


class _Types:
    def __init__(self, weight_type, shard_weight_type):
        self.weight_type, self.shard_weight_type = weight_type, dict(shard_weight_type)


def _layer(method_cls, rows_types, K, pad=0, seed=0, module_cls=torch.nn.Module):
    """A module shaped as vllm-gguf-plugin leaves a GGUF linear after loading: ``qweight`` (fused shards stacked,
    padded to the widest row, with ``shard_id``/``shard_offset_map``), ``qweight_type``, ``input_size_per_partition``."""
    rng = np.random.default_rng(seed)
    width = max(K // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1] for _, t in rows_types) + pad
    layer = module_cls.__new__(module_cls)
    torch.nn.Module.__init__(layer)
    layer.quant_method = method_cls.__new__(method_cls)
    data = torch.from_numpy(rng.integers(0, 256, (sum(r for r, _ in rows_types), width), dtype=np.uint8))
    layer.qweight = torch.nn.Parameter(data, requires_grad=False)
    layer.input_size_per_partition = layer.embedding_dim = K
    if len(rows_types) > 1:
        layer.qweight.shard_id = list(range(len(rows_types)))
        offsets, start = {}, 0
        for i, (rows, t) in enumerate(rows_types):
            offsets[i] = (start, start + rows, K // GGML_QUANT_SIZES[t][0] * GGML_QUANT_SIZES[t][1])
            start += rows
        layer.qweight.shard_offset_map = offsets
        layer.qweight_type = _Types(int(rows_types[0][1]), {i: int(t) for i, (_, t) in enumerate(rows_types)})
    else:
        layer.qweight_type = _Types(int(rows_types[0][1]), {})
    return layer


def test_split_linear_weights_regroups_gguf_linears_and_their_shards(monkeypatch):
    pytest.importorskip("vllm_gguf_plugin", reason="vllm / vllm-gguf-plugin not installed")
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
    from vllm_gguf_plugin.quantization.linear import GGUFLinearMethod
    from vllm_gguf_plugin.quantization.vocal_embeds import GGUFEmbeddingMethod

    from glm5serve.kernels.vllm_ops import split_linear_weights, split_weight_count

    class OtherMethod(GGUFLinearMethod):  # e.g. the plugin's embedding/diffusion subclasses: not touched
        pass

    K = 64
    plain = _layer(GGUFLinearMethod, [(5, Q.Q8_0)], K, seed=1)
    fused = _layer(GGUFLinearMethod, [(3, Q.Q5_0), (4, Q.Q5_0)], K, seed=2)
    mixed = _layer(GGUFLinearMethod, [(3, Q.Q6_K), (4, Q.Q4_0)], 256, seed=3)  # one Q6_K block a row: stays GGUF
    kquant = _layer(GGUFLinearMethod, [(2, Q.Q4_K)], 256, seed=4)
    odd = _layer(GGUFLinearMethod, [(2, Q.Q8_0)], 96, seed=5)  # 3 blocks per row
    other = _layer(OtherMethod, [(2, Q.Q8_0)], K, seed=6)
    head = _layer(GGUFEmbeddingMethod, [(6, Q.Q6_K)], 512, seed=7, module_cls=ParallelLMHead)  # untied lm_head
    q6 = _layer(GGUFLinearMethod, [(3, Q.Q6_K)], 512, seed=9)
    embed = _layer(GGUFEmbeddingMethod, [(6, Q.Q8_0)], K, seed=8, module_cls=VocabParallelEmbedding)  # looked up
    model = torch.nn.ModuleList([plain, fused, mixed, kquant, odd, other, head, embed, q6])
    before = {id(m): m.qweight.detach().clone() for m in model}
    monkeypatch.setenv(SPLIT_Q6_K_ENV, "0")
    assert split_linear_weights(model, devices=("cuda",)) == 0  # CPU weights are not the kernels' (default)
    assert split_weight_count(model) == 0
    assert split_linear_weights(model, devices=("cpu",)) == 3  # Q6_K kept GGUF on request
    assert split_weight_count(model) == 3 and q6.qweight_type.weight_type == Q.Q6_K
    monkeypatch.delenv(SPLIT_Q6_K_ENV, raising=False)
    assert split_linear_weights(model, devices=("cpu",)) == 2  # the Q6_K lm_head and linear; split ids are left
    assert split_weight_count(model) == 5

    assert plain.qweight_type.weight_type == split_type(Q.Q8_0)
    assert torch.equal(plain.qweight.data, split_rows(before[id(plain)], Q.Q8_0, K))
    assert fused.qweight_type.weight_type == split_type(Q.Q5_0)
    assert fused.qweight_type.shard_weight_type == {0: split_type(Q.Q5_0), 1: split_type(Q.Q5_0)}
    assert torch.equal(fused.qweight.data, split_rows(before[id(fused)], Q.Q5_0, K))
    assert mixed.qweight_type.shard_weight_type == {0: int(Q.Q6_K), 1: split_type(Q.Q4_0)}
    old = before[id(mixed)]
    assert torch.equal(mixed.qweight.data[:3], old[:3])
    assert torch.equal(mixed.qweight.data[3:7, :144], split_rows(old[3:7, :144], Q.Q4_0, 256))
    assert torch.equal(mixed.qweight.data[3:7, 144:], old[3:7, 144:])  # the padding of the narrower shard
    for m in (head, q6):
        assert m.qweight_type.weight_type == split_type(Q.Q6_K)
        assert torch.equal(m.qweight.data, split_rows(before[id(m)], Q.Q6_K, 512))
    for m in (kquant, odd, other, embed):
        assert torch.equal(m.qweight.data, before[id(m)]) and m.qweight_type.weight_type < 0x100


def test_split_linear_weights_uses_the_rows_this_rank_holds():
    """A row-parallel layer at TP=2 holds half of each row (``input_size_per_partition``; vLLM's ``input_size`` is
    the whole row): its rows are regrouped as rows of that half. A ``ReplicatedLinear`` has no per-partition size
    and holds whole rows of ``input_size``."""
    pytest.importorskip("vllm_gguf_plugin", reason="vllm / vllm-gguf-plugin not installed")
    from vllm_gguf_plugin.quantization.linear import GGUFLinearMethod

    from glm5serve.kernels.vllm_ops import split_linear_weights

    K = 64
    rank = _layer(GGUFLinearMethod, [(4, Q.Q8_0)], K, seed=11)
    rank.input_size = 2 * K
    replicated = _layer(GGUFLinearMethod, [(4, Q.Q4_0)], K, seed=12)
    del replicated.input_size_per_partition
    replicated.input_size = K
    before = {id(m): m.qweight.detach().clone() for m in (rank, replicated)}
    assert split_linear_weights(torch.nn.ModuleList([rank, replicated]), devices=("cpu",)) == 2
    assert torch.equal(rank.qweight.data, split_rows(before[id(rank)], Q.Q8_0, K))
    assert torch.equal(replicated.qweight.data, split_rows(before[id(replicated)], Q.Q4_0, K))
    assert (rank.qweight_type.weight_type, replicated.qweight_type.weight_type) == (split_type(Q.Q8_0),
                                                                                    split_type(Q.Q4_0))

"""Triton MLA attention over a paged latent cache, dense or DSA-sparse, any head count and any MLA dims.

Absorbed ("MQA") form of multi-head latent attention (DeepSeek-V2 paper, sec. 2.1.2; vLLM
``model_executor/layers/attention/mla_attention.py``, "Data-Movement Friendly Approach"): the caller has already
folded ``W_UK`` into the query, so every head attends over the shared cache rows ``[c_kv (L) | k_pe (R)]``::

    score[t, h, j] = scale * (q_nope[t, h] . c_kv[j] + q_pe[t, h] . k_pe[j])
    out[t, h]      = sum_j softmax_j(score[t, h, :]) * c_kv[j]          # latent space, (T, H, L)
    lse[t, h]      = log sum_j exp(score[t, h, j])                      # natural log, fp32

``W_UV`` is applied by the caller. The cache is vLLM's MLA layout ``(num_blocks, block_size, L + R)`` with a block
table per request; GLM-5 has L = kv_lora_rank = 512 and R = qk_rope_head_dim = 64.

Which keys a query token sees:

* dense: positions ``0 .. kv_len - 1`` of its request (decode: ``kv_len = seq_len``; prefill: causal);
* sparse: the positions of its row of the DSA indexer's top-k list ``(T, topk)`` int32 (``-1`` = unused), read
  through the block table ("logical" indices, as vLLM's indexer writes them), or flat cache rows
  ``block * block_stride_rows + offset`` ("physical" indices, as vLLM 0.33's sparse backends receive them).

Kernels:

* :func:`mla_decode` - one program per (token, tile of ``BLOCK_H`` heads, split of the key list), online softmax in
  fp32 (FlashAttention-2 recurrence), partial results merged by a second kernel (split-K, as vLLM's
  ``triton_decode_attention.py`` does). Serves decode and every sparse token (each token has its own key list).
* :func:`mla_prefill` - dense causal prefill/extend: one program per (request, tile of query tokens, head tile),
  query tokens x heads stacked as the rows of one tile so that each cache tile is loaded once for all of them.
  With a top-k list it hands the tokens to :func:`mla_decode`.

Heads are tiled inside the kernels with masking (no padded copies of the query), head dims are constexpr and
padded to powers of two with masks. Masked loads never read unused cache slots, so NaN or garbage there cannot
reach a real row. A token with no visible key gets ``out = 0`` and ``lse = -inf`` (the identity of the merge).
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from glm5serve import triton_interpreter

triton_interpreter.apply()  # bf16 tl.dot on the CPU interpreter (see there)

#: rows of one head tile: the smallest M of a tensor-core ``tl.dot``
BLOCK_H = 16
#: latent columns per merge program (spreads the split-K partials of a token over many SMs)
_MERGE_COLUMNS = 32
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _key_rows(pos, valid, req, BT, stride_bt, stride_kv_blk, stride_kv_tok, num_blocks,
              PAGE: tl.constexpr, PHYSICAL: tl.constexpr):
    """(element offsets (int64) of the cache rows holding key positions ``pos``, ``valid`` less the positions
    whose block-table entry is no block of the cache). Rows where ``~valid`` are not to be read."""
    if PHYSICAL:
        return pos.to(tl.int64) * stride_kv_tok, valid
    blk = tl.load(BT + req.to(tl.int64) * stride_bt + pos // PAGE, mask=valid, other=0)
    valid = valid & (blk >= 0) & (blk < num_blocks)
    return blk.to(tl.int64) * stride_kv_blk + (pos % PAGE).to(tl.int64) * stride_kv_tok, valid


@triton.jit
def _mla_decode_kernel(
    QN, QP, KV, BT, REQ, KVLEN, TOPK, OUT, LSE,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
    stride_kv_blk, stride_kv_tok, stride_bt, stride_topk,
    stride_o_t, stride_o_h, stride_o_s, stride_l_t, stride_l_h, stride_l_s,
    qk_scale, num_heads, num_topk, max_pos, num_reqs, num_blocks,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PAGE: tl.constexpr,
    SPARSE: tl.constexpr, PHYSICAL: tl.constexpr, HAS_REQ: tl.constexpr, HAS_KVLEN: tl.constexpr,
):
    # Head tiles of one token are neighbours in launch order, so they meet the same cache rows in L2.
    num_hb = tl.cdiv(num_heads, BLOCK_H)
    t = tl.program_id(0) // num_hb
    hb = tl.program_id(0) % num_hb
    split = tl.program_id(1)
    t64 = t.to(tl.int64)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = heads < num_heads
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    mask_l = offs_l < L
    mask_r = offs_r < R

    if HAS_REQ:
        req = tl.load(REQ + t)
    else:
        req = t
    kv_len = 0
    if HAS_KVLEN:
        kv_len = tl.load(KVLEN + t)
    # Index values past their tensors are dropped, never read: a token whose row is outside the block table sees
    # no key, and dense positions stop at the end of the block table (as stale top-k positions do below).
    if SPARSE:
        n_keys = num_topk
    else:
        n_keys = tl.maximum(tl.minimum(kv_len, max_pos), 0)
    if not PHYSICAL:
        n_keys = tl.where((req >= 0) & (req < num_reqs), n_keys, 0)

    # This split's slice of the key list, in whole BLOCK_N tiles.
    per_split = tl.cdiv(tl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, n_keys)

    qn = tl.load(QN + t64 * stride_qn_t + heads[:, None] * stride_qn_h + offs_l[None, :],
                 mask=mask_h[:, None] & mask_l[None, :], other=0.0)
    qp = tl.load(QP + t64 * stride_qp_t + heads[:, None] * stride_qp_h + offs_r[None, :],
                 mask=mask_h[:, None] & mask_r[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        if SPARSE:
            pos = tl.load(TOPK + t64 * stride_topk + offs_n, mask=valid, other=-1)
            # stale lists of CUDA-graph padding rows must stay inside the block table (or the cache)
            valid = valid & (pos >= 0) & (pos < max_pos)
            if HAS_KVLEN:
                valid = valid & (pos < kv_len)
        else:
            pos = offs_n
        rows, valid = _key_rows(pos, valid, req, BT, stride_bt, stride_kv_blk, stride_kv_tok, num_blocks, PAGE,
                                PHYSICAL)
        # (BLOCK_N, BLOCK_L) tiles of whole cache rows (16-byte async copies); the latent tile is K and V
        kv = tl.load(KV + rows[:, None] + offs_l[None, :], mask=valid[:, None] & mask_l[None, :], other=0.0)
        kp = tl.load(KV + rows[:, None] + L + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0)
        s = tl.dot(qn, tl.trans(kv)) + tl.dot(qp, tl.trans(kp))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # log2 units
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: keep exp2 finite
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        m_i = m_new

    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / safe_l[:, None]
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(safe_l)) * 0.6931471805599453, float("-inf"))
    tl.store(OUT + t64 * stride_o_t + split * stride_o_s + heads[:, None] * stride_o_h + offs_l[None, :],
             out.to(OUT.dtype.element_ty), mask=mask_h[:, None] & mask_l[None, :])
    tl.store(LSE + t64 * stride_l_t + split * stride_l_s + heads * stride_l_h, lse, mask=mask_h)


@triton.jit
def _mla_merge_kernel(
    PART, PLSE, OUT, LSE,
    stride_p_t, stride_p_h, stride_p_s, stride_pl_t, stride_pl_h, stride_pl_s,
    stride_o_t, stride_o_h, stride_l_t, stride_l_h,
    num_heads,
    L: tl.constexpr, BLOCK_LM: tl.constexpr, BLOCK_H: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """out = sum_s w_s out_s / sum_s w_s with w_s = exp(lse_s - max lse); lse = max + log(sum w).

    One program per (token, head tile, ``BLOCK_LM`` latent columns): at batch 1 the partials of one token are
    spread over many SMs instead of being read by one."""
    num_hb = tl.cdiv(num_heads, BLOCK_H)
    t = (tl.program_id(0) // num_hb).to(tl.int64)
    heads = (tl.program_id(0) % num_hb) * BLOCK_H + tl.arange(0, BLOCK_H)
    chunk = tl.program_id(1)
    mask_h = heads < num_heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_l = chunk * BLOCK_LM + tl.arange(0, BLOCK_LM)
    mask_l = offs_l < L
    lse_s = tl.load(PLSE + t * stride_pl_t + heads[:, None] * stride_pl_h + offs_s[None, :] * stride_pl_s,
                    mask=mask_h[:, None] & (offs_s[None, :] < NUM_SPLITS), other=float("-inf"))
    m = tl.max(lse_s, 1)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse_s - m_use[:, None])  # 0 for empty splits
    w_sum = tl.sum(w, 1)
    acc = tl.zeros([BLOCK_H, BLOCK_LM], tl.float32)
    for s in range(NUM_SPLITS):
        w_s = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), 1)
        part = tl.load(PART + t * stride_p_t + s * stride_p_s + heads[:, None] * stride_p_h + offs_l[None, :],
                       mask=mask_h[:, None] & mask_l[None, :] & (w_s[:, None] > 0.0), other=0.0)
        acc += w_s[:, None] * part
    safe = tl.where(w_sum > 0.0, w_sum, 1.0)
    tl.store(OUT + t * stride_o_t + heads[:, None] * stride_o_h + offs_l[None, :],
             (acc / safe[:, None]).to(OUT.dtype.element_ty), mask=mask_h[:, None] & mask_l[None, :])
    tl.store(LSE + t * stride_l_t + heads * stride_l_h,
             tl.where(w_sum > 0.0, m_use + tl.log(safe), float("-inf")), mask=mask_h & (chunk == 0))


@triton.jit
def _mla_prefill_kernel(
    QN, QP, KV, BT, QSL, SEQ, OUT, LSE,
    stride_qn_t, stride_qn_h, stride_qp_t, stride_qp_h,
    stride_kv_blk, stride_kv_tok, stride_bt,
    stride_o_t, stride_o_h, stride_l_t, stride_l_h,
    qk_scale, num_heads, num_tokens, max_pos, num_blocks,
    L: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
):
    """Dense causal prefill: rows of the tile are (query token, head) pairs of one request."""
    r = tl.program_id(0)
    # Bad values are clamped first so that no int32 sum below wraps; no valid value changes (0 <= qsl <= T,
    # seq_len <= max_pos, the block table's span).
    q_start = tl.minimum(tl.maximum(tl.load(QSL + r), -1), num_tokens)
    q_len = tl.minimum(tl.maximum(tl.load(QSL + r + 1), -1), num_tokens) - q_start
    t0 = tl.program_id(1) * BLOCK_T
    if t0 >= q_len:
        return
    seq_len = tl.minimum(tl.maximum(tl.load(SEQ + r), -1), max_pos + num_tokens)
    ctx_len = seq_len - q_len
    kv_end = tl.maximum(tl.minimum(tl.minimum(seq_len, ctx_len + t0 + BLOCK_T), max_pos), 0)

    BLOCK_M: tl.constexpr = BLOCK_T * BLOCK_H
    offs_m = tl.arange(0, BLOCK_M)
    tok = t0 + offs_m // BLOCK_H
    heads = tl.program_id(2) * BLOCK_H + offs_m % BLOCK_H
    # query rows outside the T tokens (a bad query_start_loc) are neither read nor written
    mask_m = (tok < q_len) & (heads < num_heads) & (q_start >= 0)
    limit = ctx_len + tok + 1  # keys < limit are visible (causal)
    tok64 = (q_start + tok).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    mask_l = offs_l < L
    mask_r = offs_r < R

    qn = tl.load(QN + tok64[:, None] * stride_qn_t + heads[:, None] * stride_qn_h + offs_l[None, :],
                 mask=mask_m[:, None] & mask_l[None, :], other=0.0)
    qp = tl.load(QP + tok64[:, None] * stride_qp_t + heads[:, None] * stride_qp_h + offs_r[None, :],
                 mask=mask_m[:, None] & mask_r[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_L], tl.float32)
    for start_n in range(0, kv_end, BLOCK_N):
        pos = start_n + tl.arange(0, BLOCK_N)
        valid = pos < kv_end
        rows, valid = _key_rows(pos, valid, r, BT, stride_bt, stride_kv_blk, stride_kv_tok, num_blocks, PAGE, False)
        kv = tl.load(KV + rows[:, None] + offs_l[None, :], mask=valid[:, None] & mask_l[None, :], other=0.0)
        kp = tl.load(KV + rows[:, None] + L + offs_r[None, :], mask=valid[:, None] & mask_r[None, :], other=0.0)
        s = tl.dot(qn, tl.trans(kv)) + tl.dot(qp, tl.trans(kp))
        visible = (pos[None, :] < limit[:, None]) & mask_m[:, None] & valid[None, :]
        s = tl.where(visible, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        m_i = m_new

    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    tl.store(OUT + tok64[:, None] * stride_o_t + heads[:, None] * stride_o_h + offs_l[None, :],
             (acc / safe_l[:, None]).to(OUT.dtype.element_ty), mask=mask_m[:, None] & mask_l[None, :])
    tl.store(LSE + tok64 * stride_l_t + heads * stride_l_h,
             tl.where(l_i > 0.0, (m_i + tl.log2(safe_l)) * 0.6931471805599453, float("-inf")), mask=mask_m)


# ---------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    """Padded extent of a head dim: a power of two, at least 16 (the smallest K of ``tl.dot``)."""
    return max(16, triton.next_power_of_2(n))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def prefill_rows(major: int) -> int:
    """Rows (query tokens x heads) of a prefill tile: 64 on Hopper/Blackwell datacenter parts (warpgroup MMA tiles),
    32 elsewhere (mma.sync: 64 rows would spill registers)."""
    return 64 if major in (9, 10) else 32


def default_num_splits(num_tokens: int, num_heads: int, num_keys: int, device: torch.device,
                       block_n: int = 32, block_h: int = BLOCK_H) -> int:
    """Key-list splits per (token, head tile) so that about two programs per SM stream the cache.

    Depends only on launch-time constants (tokens, heads, the top-k width or a bound on the context), so a CUDA
    graph captured for a batch shape stays valid. Each split gets at least two ``block_n`` tiles.
    """
    programs = max(1, num_tokens * triton.cdiv(num_heads, block_h))
    by_occupancy = max(1, 2 * _sm_count(device) // programs)
    by_work = max(1, triton.cdiv(max(num_keys, 1), 2 * block_n))
    return int(min(by_occupancy, by_work, 64))


def flat_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """(num_rows, L + R) view of every row of the paged cache, the rows between blocks (a block stride wider than
    ``block_size`` rows) included: the rows physical top-k indices address."""
    n = (kv_cache.shape[0] - 1) * (kv_cache.stride(0) // kv_cache.stride(1)) + kv_cache.shape[1]
    return kv_cache.as_strided((n, kv_cache.shape[2]), (kv_cache.stride(1), 1))


def split_workspace_numel(num_tokens: int, num_heads: int, num_splits: int, kv_lora_rank: int) -> int:
    """fp32 elements of the split-K scratch :func:`mla_decode` needs (0 when ``num_splits == 1``)."""
    if num_splits <= 1:
        return 0
    return num_tokens * num_heads * num_splits * (kv_lora_rank + 1)


def _check_inputs(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_nope.shape[:2] != q_pe.shape[:2]:
        raise ValueError(f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} must be (T, H, L) and (T, H, R)")
    T, H, L = q_nope.shape
    R = q_pe.shape[2]
    if kv_cache.dim() != 3 or kv_cache.shape[2] != L + R:
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} must be (num_blocks, block_size, {L} + {R})")
    if q_nope.dtype != kv_cache.dtype or q_pe.dtype != kv_cache.dtype:
        raise ValueError(f"query ({q_nope.dtype}, {q_pe.dtype}) and cache ({kv_cache.dtype}) dtypes differ")
    if kv_cache.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported cache dtype {kv_cache.dtype}")
    for name, x in (("q_nope", q_nope), ("q_pe", q_pe), ("kv_cache", kv_cache)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")
    return T, H, L, R


def _check_operands(T: int, H: int, L: int, dtype: torch.dtype, *, out=None, lse=None, int32=()) -> None:
    """Host-side checks (shapes, dtypes; no values: that would cost a device sync) of the outputs and the int32
    index operands ``int32`` = ((name, tensor or None, dims, least rows), ...); ValueError naming the operand."""
    if out is not None and (tuple(out.shape) != (T, H, L) or out.dtype != dtype or out.stride(-1) != 1):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be ({T}, {H}, {L}) {dtype}, last dim contiguous")
    if lse is not None and (tuple(lse.shape) != (T, H) or lse.dtype != torch.float32):
        raise ValueError(f"lse {tuple(lse.shape)} {lse.dtype} must be ({T}, {H}) torch.float32")
    for name, x, dims, rows in int32:
        if x is None:
            continue
        if x.dim() != dims or x.dtype != torch.int32 or x.shape[0] < rows:
            raise ValueError(f"{name} {tuple(x.shape)} {x.dtype} must be a {dims}-D int32 tensor of >= {rows} rows")
        if x.numel() and x.stride(-1) != 1:  # the kernels index the last dim as contiguous
            raise ValueError(f"{name} {tuple(x.shape)} must be contiguous in its last dim, not stride {x.stride(-1)}")


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, scale: float, *,
               block_table: torch.Tensor | None = None, kv_lens: torch.Tensor | None = None,
               req_ids: torch.Tensor | None = None, topk_indices: torch.Tensor | None = None,
               num_splits: int | None = None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
               workspace: torch.Tensor | None = None, block_n: int = 32, block_h: int = BLOCK_H,
               num_warps: int = 4, num_stages: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA attention of single query tokens over the paged latent cache (decode, or any sparse token).

    Args:
        q_nope: (T, H, L) fp16/bf16, ``q_nope . W_UK`` (latent-space query); any token/head strides.
        q_pe: (T, H, R) same dtype, the rotary part.
        kv_cache: (num_blocks, block_size, L + R) same dtype, rows ``[c_kv | k_pe]``; any block stride.
        scale: softmax scale (``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` times any mscale).
        block_table: (num_reqs, max_blocks) int32. ``None`` with ``topk_indices`` means physical indices:
            ``topk_indices`` are flat cache rows ``block * (stride(0) / stride(1)) + offset``.
        kv_lens: (T,) int32, keys visible to each token: dense keys are positions ``0 .. kv_lens[t] - 1``
            (required when dense); sparse positions ``>= kv_lens[t]`` are dropped (optional, logical only).
        req_ids: (T,) int32 row of ``block_table`` for each token; ``None`` means token t is request t.
        topk_indices: (T, topk) int32 key positions within the sequence (or physical rows), ``-1`` = unused;
            logical positions past the block table (``>= block_table.shape[1] * block_size``) count as unused
            too, so stale lists in CUDA-graph padding rows cannot read outside the cache.
        num_splits: split-K factor; default :func:`default_num_splits`. ``out``/``lse``/``workspace``:
            preallocated outputs and fp32 scratch of :func:`split_workspace_numel` elements (CUDA graphs).
        block_n, block_h, num_warps, num_stages: keys and heads per tile (powers of two >= 16) and launch options.

    Returns:
        out (T, H, L) in the query dtype and lse (T, H) fp32 (natural log; ``-inf`` and 0 for no key).

    Raises:
        ValueError: inconsistent shapes or dtypes (queries, cache, ``out``, ``lse``, the int32 index tensors), or
        ``num_splits`` < 1. Index values are not checked on the host (that would sync with the device); the kernel
        never reads outside its operands instead: a token whose ``req_ids`` row is outside ``block_table`` sees
        no key, dense positions past the block table and block-table entries outside the cache are dropped.
    """
    T, H, L, R = _check_inputs(q_nope, q_pe, kv_cache)
    sparse = topk_indices is not None
    physical = sparse and block_table is None
    if not sparse and (block_table is None or kv_lens is None):
        raise ValueError("dense MLA decode needs block_table and kv_lens")
    if physical and kv_lens is not None:
        raise ValueError("kv_lens masking needs logical top-k indices (and a block_table)")
    if sparse and (topk_indices.shape[0] < T or topk_indices.stride(-1) != 1):
        raise ValueError(f"topk_indices {tuple(topk_indices.shape)} must be (>= {T}, topk), last dim contiguous")
    _check_operands(T, H, L, q_nope.dtype, out=out, lse=lse, int32=(
        ("block_table", block_table, 2, 1 if T else 0), ("kv_lens", kv_lens, 1, T),
        # no row count for req_ids: the backend hands the real tokens' view of a buffer whose zeroed tail serves
        # the CUDA-graph padding tokens (``backend.TritonMLASparseMetadataBuilder``); its storage must hold T
        ("req_ids", req_ids, 1, 0), ("topk_indices", topk_indices, 2, T)))
    if req_ids is not None and req_ids.untyped_storage().nbytes() < (req_ids.storage_offset() + T) * 4:
        raise ValueError(f"req_ids {tuple(req_ids.shape)}: its storage holds fewer than the {T} rows read")
    num_topk = topk_indices.shape[1] if sparse else 0
    if num_splits is None:
        num_splits = default_num_splits(T, H, num_topk if sparse else 8192, q_nope.device, block_n, block_h)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive integer, not {num_splits!r}")
    out = torch.empty((T, H, L), dtype=q_nope.dtype, device=q_nope.device) if out is None else out
    lse = torch.empty((T, H), dtype=torch.float32, device=q_nope.device) if lse is None else lse
    if T == 0:
        return out, lse
    if num_splits > 1:
        n = split_workspace_numel(T, H, num_splits, L)
        if workspace is None:
            workspace = torch.empty(n, dtype=torch.float32, device=q_nope.device)
        elif workspace.numel() < n or workspace.dtype != torch.float32:
            raise ValueError(f"workspace needs {n} fp32 elements, got {workspace.numel()} {workspace.dtype}")
        part = workspace[:T * H * num_splits * L].view(T, H, num_splits, L)
        part_lse = workspace[T * H * num_splits * L:n].view(T, H, num_splits)
        o_t, o_h, o_s = part.stride(0), part.stride(1), part.stride(2)
        l_t, l_h, l_s = part_lse.stride(0), part_lse.stride(1), part_lse.stride(2)
        dst, dst_lse = part, part_lse
    else:
        o_t, o_h, o_s = out.stride(0), out.stride(1), 0
        l_t, l_h, l_s = lse.stride(0), lse.stride(1), 0
        dst, dst_lse = out, lse
    # Positions below max_pos exist: the block table's span, or (physical indices) the cache's flat rows.
    max_pos = block_table.shape[1] * kv_cache.shape[1] if block_table is not None else flat_rows(kv_cache).shape[0]
    # Absent int32 operands are never read (constexpr flags); any int32 tensor at hand stands in for them.
    dummy = block_table if block_table is not None else topk_indices
    bt = dummy
    grid = (T * triton.cdiv(H, block_h), num_splits)
    _mla_decode_kernel[grid](
        q_nope, q_pe, kv_cache, bt, req_ids if req_ids is not None else dummy,
        kv_lens if kv_lens is not None else dummy, topk_indices if sparse else dummy, dst, dst_lse,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), bt.stride(0) if block_table is not None else 0,
        topk_indices.stride(0) if sparse else 0,
        o_t, o_h, o_s, l_t, l_h, l_s,
        scale * _LOG2E, H, num_topk, max_pos, block_table.shape[0] if block_table is not None else 0,
        kv_cache.shape[0],
        L=L, R=R, BLOCK_L=_pow2(L), BLOCK_R=_pow2(R),
        BLOCK_H=block_h, BLOCK_N=block_n, NUM_SPLITS=num_splits, PAGE=kv_cache.shape[1],
        SPARSE=sparse, PHYSICAL=physical, HAS_REQ=req_ids is not None, HAS_KVLEN=kv_lens is not None,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        block_lm = min(_MERGE_COLUMNS, _pow2(L))
        _mla_merge_kernel[(T * triton.cdiv(H, BLOCK_H), triton.cdiv(L, block_lm))](
            part, part_lse, out, lse,
            part.stride(0), part.stride(1), part.stride(2), part_lse.stride(0), part_lse.stride(1),
            part_lse.stride(2), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
            H, L=L, BLOCK_LM=block_lm, BLOCK_H=BLOCK_H, NUM_SPLITS=num_splits,
            BLOCK_S=max(triton.next_power_of_2(num_splits), 2), num_warps=2,
        )
    return out, lse


def mla_prefill(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, scale: float, *,
                block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                max_query_len: int, topk_indices: torch.Tensor | None = None, out: torch.Tensor | None = None,
                lse: torch.Tensor | None = None, block_t: int | None = None, block_n: int = 32,
                num_warps: int = 8, num_stages: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal MLA prefill/extend of a varlen batch whose new tokens' latents are already in the cache.

    Args:
        q_nope, q_pe, kv_cache, scale: as :func:`mla_decode`; T = ``query_start_loc[-1]`` tokens.
        block_table: (B, max_blocks) int32. query_start_loc: (B + 1,) int32 token offsets of each request.
        seq_lens: (B,) int32 total length (context + new tokens); new token i of request b sits at position
            ``seq_lens[b] - q_len[b] + i`` and sees positions up to and including its own.
        max_query_len: longest ``q_len`` (host int; sizes the grid).
        topk_indices: (T, topk) int32 positions, ``-1`` unused: sparse, each token's list bounds its keys
            (causality is the indexer's; positions past the token's own are dropped as well).

    Returns:
        out (T, H, L) in the query dtype, lse (T, H) fp32.

    Raises:
        ValueError: as :func:`mla_decode`, tokens without a request (B = 0 < T), and a ``max_query_len`` outside
        1..T (rows past it would be left unwritten; one below the longest ``q_len`` is not detected, as that would
        sync with the device). As in :func:`mla_decode`, bad index values are never read outside the operands:
        ``query_start_loc`` values are clamped to -1..T (a request from -1 is skipped), ``seq_lens`` past the
        block table and block-table entries outside the cache are dropped, and a token that ``query_start_loc``
        gives to no request is not attended for: dense, its rows of ``out``/``lse`` are left as they were;
        sparse, it gets ``out = 0``, ``lse = -inf``.
    """
    T, H, L, R = _check_inputs(q_nope, q_pe, kv_cache)
    B = seq_lens.shape[0]
    _check_operands(T, H, L, q_nope.dtype, out=out, lse=lse, int32=(
        ("block_table", block_table, 2, B), ("query_start_loc", query_start_loc, 1, B + 1),
        ("seq_lens", seq_lens, 1, B), ("topk_indices", topk_indices, 2, T)))
    if T and not 1 <= max_query_len <= T:  # too small leaves rows unwritten; the true maximum would need a sync
        raise ValueError(f"max_query_len must be in 1..{T} (the tokens), not {max_query_len}")
    if T and not B:
        raise ValueError(f"{T} query tokens but no request (seq_lens is empty)")
    if topk_indices is not None:
        # token t belongs to request b where qsl[b] <= t < qsl[b + 1]; a token of no request (a bad
        # query_start_loc) gets row -1, which mla_decode gives no key. (B, T) compares: exact for any qsl.
        tokens = torch.arange(T, device=q_nope.device, dtype=torch.int64)
        qsl = query_start_loc[:B + 1].long().clamp(-1, T)  # as the dense kernel clamps it
        inside = (qsl[:B, None] <= tokens) & (tokens < qsl[1:, None]) & (qsl[:B, None] >= 0)
        req = inside.int().argmax(0)
        req_ids = torch.where(inside.any(0), req, -1).to(torch.int32)
        # int64, then clamped: int32 sums of bad lengths would wrap
        kv_lens = (seq_lens.long()[req] - (qsl[req + 1] - qsl[req]) + tokens - qsl[req] + 1).clamp(0, 2**31 - 1)
        return mla_decode(q_nope, q_pe, kv_cache, scale, block_table=block_table[:B], kv_lens=kv_lens.to(torch.int32),
                          req_ids=req_ids, topk_indices=topk_indices, num_splits=1, out=out, lse=lse,
                          block_n=block_n)
    out = torch.empty((T, H, L), dtype=q_nope.dtype, device=q_nope.device) if out is None else out
    lse = torch.empty((T, H), dtype=torch.float32, device=q_nope.device) if lse is None else lse
    if T == 0 or B == 0:
        return out, lse
    block_h = min(BLOCK_H, triton.next_power_of_2(H))
    if block_t is None:
        major = torch.cuda.get_device_capability(q_nope.device)[0] if q_nope.is_cuda else 0
        block_t = max(1, (16 if triton_interpreter.interpreting() else prefill_rows(major)) // block_h)
    grid = (B, triton.cdiv(max_query_len, block_t), triton.cdiv(H, block_h))
    _mla_prefill_kernel[grid](
        q_nope, q_pe, kv_cache, block_table, query_start_loc, seq_lens, out, lse,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        scale * _LOG2E, H, T, block_table.shape[1] * kv_cache.shape[1], kv_cache.shape[0],
        L=L, R=R, BLOCK_L=_pow2(L), BLOCK_R=_pow2(R),
        BLOCK_H=block_h, BLOCK_T=block_t, BLOCK_N=block_n, PAGE=kv_cache.shape[1],
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, lse


# ---------------------------------------------------------------------------------------------------------------
# Torch reference (plain and slow: per token, gather the visible rows, softmax and matmul in fp32)
# ---------------------------------------------------------------------------------------------------------------

def reference_key_rows(kv_cache: torch.Tensor, t: int, *, block_table=None, kv_lens=None, req_ids=None,
                       topk_indices=None) -> torch.Tensor:
    """The flat cache row index (int64) of every key token ``t`` attends to, in key-list order."""
    if topk_indices is None:
        pos = torch.arange(int(kv_lens[t]))
    else:
        pos = topk_indices[t].long().cpu()
        pos = pos[pos >= 0]
        if block_table is not None:
            pos = pos[pos < block_table.shape[1] * kv_cache.shape[1]]
        if kv_lens is not None:
            pos = pos[pos < int(kv_lens[t])]
    if topk_indices is not None and block_table is None:
        return pos  # physical rows
    req = int(req_ids[t]) if req_ids is not None else t
    rows_per_block = kv_cache.stride(0) // kv_cache.stride(1)
    blocks = block_table[req].long().cpu()[pos // kv_cache.shape[1]]
    return blocks * rows_per_block + pos % kv_cache.shape[1]


def mla_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, scale: float, *,
                  block_table=None, kv_lens=None, req_ids=None, topk_indices=None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`mla_decode` (same arguments): (out (T, H, L) fp32, lse (T, H) fp32)."""
    T, H, L = q_nope.shape
    flat = flat_rows(kv_cache).float()
    out = torch.zeros(T, H, L, dtype=torch.float32, device=q_nope.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q_nope.device)
    for t in range(T):
        rows = reference_key_rows(kv_cache, t, block_table=block_table, kv_lens=kv_lens, req_ids=req_ids,
                                  topk_indices=topk_indices).to(flat.device)
        if rows.numel() == 0:
            continue
        keys = flat[rows]  # (S, L + R)
        scores = (q_nope[t].float() @ keys[:, :L].T + q_pe[t].float() @ keys[:, L:].T) * scale  # (H, S)
        out[t] = torch.softmax(scores, dim=-1) @ keys[:, :L]
        lse[t] = torch.logsumexp(scores, dim=-1)
    return out, lse


def prefill_kv_lens(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(req_ids, kv_lens) per token of a causal varlen batch: token i of request b sees ``seq_lens[b] - q_len + i
    + 1`` keys. Turns :func:`mla_prefill`'s arguments into :func:`mla_reference`'s."""
    qsl, sl = query_start_loc.long().cpu(), seq_lens.long().cpu()
    req_ids, kv_lens = [], []
    for b in range(sl.shape[0]):
        q_len = int(qsl[b + 1] - qsl[b])
        req_ids += [b] * q_len
        kv_lens += [int(sl[b]) - q_len + i + 1 for i in range(q_len)]
    return torch.tensor(req_ids, dtype=torch.int32), torch.tensor(kv_lens, dtype=torch.int32)


def softmax_scale(qk_nope_head_dim: int, qk_rope_head_dim: int) -> float:
    """``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)`` (DeepSeek-V2 / GLM-5 without YaRN mscale)."""
    return 1.0 / math.sqrt(qk_nope_head_dim + qk_rope_head_dim)

"""Test batches for the MLA kernels: a paged latent cache with poisoned unused slots, queries, block tables and
DSA top-k lists, built vectorised on any device (used by the interpreter tests, the GPU tests and the benchmark)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch


@dataclasses.dataclass
class MLABatch:
    """One batch of query tokens over a paged cache (shapes as :func:`glm5serve.mla.triton_mla.mla_decode`).

    ``num_real`` leading tokens are real; the rest are padding rows (poisoned queries, no keys), as CUDA-graph
    padding leaves them. ``written`` (num_rows,) bool marks the flat cache rows that hold a real key.
    """
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    req_ids: torch.Tensor
    kv_lens: torch.Tensor
    topk: torch.Tensor | None
    scale: float
    num_real: int
    written: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def decode_kwargs(self, physical: bool = False) -> dict:
        """Keyword arguments of ``mla_decode``/``mla_reference`` (logical indices, or flat rows if ``physical``)."""
        if self.topk is None:
            return dict(block_table=self.block_table, kv_lens=self.kv_lens, req_ids=self.req_ids)
        if physical:
            return dict(topk_indices=self.physical_topk())
        return dict(block_table=self.block_table, req_ids=self.req_ids, topk_indices=self.topk)

    def physical_topk(self) -> torch.Tensor:
        """The top-k list as flat cache rows ``block * rows_per_block + offset`` (vLLM 0.33's form), ``-1`` kept."""
        bs = self.kv_cache.shape[1]
        rows_per_block = self.kv_cache.stride(0) // self.kv_cache.stride(1)
        pos = self.topk.long()
        safe = pos.clamp(min=0)
        blocks = torch.gather(self.block_table[self.req_ids.long()].long(), 1, safe // bs)
        return torch.where(pos >= 0, blocks * rows_per_block + safe % bs, -1).to(torch.int32)

    def flat_rows(self) -> torch.Tensor:
        """(num_rows, L + R) view of every cache row, padding rows between blocks included."""
        from glm5serve.mla.triton_mla import flat_rows  # Triton only where the kernels run

        return flat_rows(self.kv_cache)


def make_batch(seq_lens: Sequence[int], q_lens: Sequence[int], num_heads: int, kv_lora_rank: int, rope_dim: int,
               block_size: int, dtype: torch.dtype, *, topk: int | None = None, pad_tokens: int = 0,
               block_pad: int = 0, spare_blocks: int = 1, poison: float = float("nan"), scatter_pad: bool = False,
               topk_fill: float = 1.0, scale: float | None = None, seed: int = 0,
               device: str | torch.device = "cpu") -> MLABatch:
    """A batch of ``len(seq_lens)`` requests; request b's last ``q_lens[b]`` positions are its query tokens.

    The cache has ``block_pad`` extra rows after every block (vLLM 0.33's cross-layer layout: block stride larger
    than ``block_size`` rows), ``spare_blocks`` unused blocks, and ``poison`` in every row no request wrote; block
    table entries past a request's end point at a spare (poisoned) block. With ``topk``, token t's list holds
    ``round(topk_fill * min(topk, kv_len))`` distinct random visible positions in random order, padded with ``-1``
    at the end or, with ``scatter_pad``, at random slots. Values are N(0, 1); the scale defaults to
    ``1 / sqrt(kv_lora_rank + rope_dim)``.
    """
    dev = torch.device(device)
    g = torch.Generator(device=dev).manual_seed(seed)
    B = len(seq_lens)
    D = kv_lora_rank + rope_dim
    n_blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(n_blocks) + spare_blocks
    spare = num_blocks - 1 if spare_blocks else 0
    stride_rows = block_size + block_pad
    storage = torch.full((num_blocks, stride_rows, D), poison, dtype=dtype, device=dev)
    perm = torch.randperm(num_blocks - spare_blocks, generator=g, device=dev)
    block_table = torch.full((B, max(max(n_blocks, default=1), 1)), spare, dtype=torch.int32, device=dev)
    written = torch.zeros(num_blocks * stride_rows - block_pad, dtype=torch.bool, device=dev)
    start = 0
    for b, (s, nb) in enumerate(zip(seq_lens, n_blocks)):
        blocks = perm[start:start + nb]
        start += nb
        block_table[b, :nb] = blocks.to(torch.int32)
        pos = torch.arange(s, device=dev)
        written[blocks[pos // block_size].long() * stride_rows + pos % block_size] = True
    flat = storage.view(-1, D)[:written.shape[0]]
    flat[written] = torch.randn(int(written.sum()), D, generator=g, device=dev, dtype=dtype)

    req_ids, kv_lens = [], []
    for b, (s, q) in enumerate(zip(seq_lens, q_lens)):
        req_ids += [b] * q
        kv_lens += [s - q + i + 1 for i in range(q)]
    num_real = len(req_ids)
    req_ids += [0] * pad_tokens
    kv_lens += [0] * pad_tokens
    T = num_real + pad_tokens
    q_nope = torch.randn(T, num_heads, kv_lora_rank, generator=g, device=dev, dtype=dtype)
    q_pe = torch.randn(T, num_heads, rope_dim, generator=g, device=dev, dtype=dtype)
    q_nope[num_real:] = poison
    q_pe[num_real:] = poison

    topk_t = None
    if topk is not None:
        topk_t = torch.full((T, topk), -1, dtype=torch.int32, device=dev)
        for t in range(num_real):
            n = round(topk_fill * min(topk, kv_lens[t]))
            chosen = torch.randperm(kv_lens[t], generator=g, device=dev)[:n].to(torch.int32)
            slots = torch.randperm(topk, generator=g, device=dev)[:n] if scatter_pad else torch.arange(n, device=dev)
            topk_t[t, slots] = chosen
    qsl = torch.tensor([0] + list(q_lens), dtype=torch.int32).cumsum(0).to(torch.int32)
    return MLABatch(
        q_nope=q_nope, q_pe=q_pe, kv_cache=storage[:, :block_size],
        block_table=block_table, req_ids=torch.tensor(req_ids, dtype=torch.int32, device=dev),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=dev),
        topk=topk_t, scale=scale if scale is not None else D ** -0.5, num_real=num_real, written=written,
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=dev), query_start_loc=qsl.to(dev))


def batch_params(heads=(1, 3, 8, 16, 19), dims=((16, 16), (32, 16), (48, 8), (24, 0)), block_sizes=(4, 8, 16),
                 topks=(4, 8, 20), max_reqs: int = 3):
    """Hypothesis strategy of :func:`make_batch` arguments (plus ``num_splits``): lengths on both sides of the
    block size and the top-k width, 1-2 query tokens per request, padding rows, wide block strides, -1 padding
    at the end or scattered, partly filled top-k lists, bf16 and fp16."""
    from hypothesis import strategies as st

    @st.composite
    def params(draw):
        block_size = draw(st.sampled_from(block_sizes))
        topk = draw(st.none() | st.sampled_from(topks))
        edge = topk or block_size
        seq_lens = [max(1, draw(st.sampled_from([edge - 1, edge, edge + 1, 2 * block_size + 1, 1])))
                    for _ in range(draw(st.integers(1, max_reqs)))]
        L, R = draw(st.sampled_from(dims))
        return dict(seq_lens=seq_lens, q_lens=[draw(st.integers(1, min(2, s))) for s in seq_lens],
                    num_heads=draw(st.sampled_from(heads)), kv_lora_rank=L, rope_dim=R, block_size=block_size,
                    dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])), topk=topk,
                    pad_tokens=draw(st.integers(0, 2)), block_pad=draw(st.sampled_from([0, 3])),
                    scatter_pad=draw(st.booleans()), topk_fill=draw(st.sampled_from([1.0, 0.5])),
                    seed=draw(st.integers(0, 2**16)), num_splits=draw(st.sampled_from([1, 2, 5])))

    return params()


# ---------------------------------------------------------------------------------------------------------------
# vLLM's sparse MLA kernels on the same inputs (H100/H200/B200 only), as vLLM's backends call them
# ---------------------------------------------------------------------------------------------------------------

def padded_query(q_nope: torch.Tensor, q_pe: torch.Tensor, multiple: int = 64) -> torch.Tensor:
    """[q_nope | q_pe] with the head count zero-padded to a multiple of ``multiple`` (FlashMLA sparse needs 64/128
    heads; vLLM's FLASHMLA_SPARSE pads the same way)."""
    T, H, L = q_nope.shape
    Hp = -(-H // multiple) * multiple
    q = q_nope.new_zeros(T, Hp, L + q_pe.shape[2])
    q[:, :H, :L] = q_nope
    q[:, :H, L:] = q_pe
    return q


def flashmla_sparse(q_padded: torch.Tensor, kv_cache: torch.Tensor, topk_rows: torch.Tensor, scale: float,
                    num_heads: int, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's FLASHMLA_SPARSE kernel (``flash_mla_sparse_fwd``) on physical top-k rows: (out (T, H, L), lse (T, H)
    natural log, +inf for a token without keys). Raises RuntimeError where FlashMLA is not built or supported."""
    from vllm.v1.attention.ops.flashmla import flash_mla_sparse_fwd, is_flashmla_sparse_supported

    ok, why = is_flashmla_sparse_supported()
    if not ok:
        raise RuntimeError(f"FlashMLA sparse unavailable: {why}")
    kv = kv_cache.reshape(-1, 1, kv_cache.shape[-1])
    out, _, lse = flash_mla_sparse_fwd(q_padded, kv, topk_rows.unsqueeze(1), scale, d_v=kv_lora_rank)
    return out[:, :num_heads], lse[:, :num_heads]


def fa3_sparse(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, topk_rows: torch.Tensor,
               scale: float, cu_seqlens_q: torch.Tensor | None = None, valid_counts: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's FLASH_ATTN_MLA_SPARSE call (FA3 with ``q_v``, pages of one token, the top-k rows as block table;
    vLLM 0.25 ``flashattn_mla_sparse.py``): (out (T, H, L), lse (T, H)). Valid rows must come first in each
    top-k row (``seqused_k`` = their count)."""
    from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func

    T, H, L = q_nope.shape
    rows = kv_cache.reshape(-1, kv_cache.shape[-1])
    if cu_seqlens_q is None:
        cu_seqlens_q = torch.arange(T + 1, dtype=torch.int32, device=q_nope.device)
    if valid_counts is None:
        valid_counts = (topk_rows >= 0).sum(1).to(torch.int32)
    out, lse = flash_attn_varlen_func(
        q=q_pe, k=rows[:, L:].unsqueeze(1).unsqueeze(1), v=rows[:, :L].unsqueeze(1).unsqueeze(1), q_v=q_nope,
        max_seqlen_q=1, cu_seqlens_q=cu_seqlens_q, max_seqlen_k=topk_rows.shape[1], seqused_k=valid_counts,
        block_table=topk_rows, softmax_scale=scale, causal=True, fa_version=3, return_softmax_lse=True)
    return out, (lse.transpose(0, 1) if lse.shape == (H, T) else lse)

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
        kv = self.kv_cache
        n = (kv.shape[0] - 1) * (kv.stride(0) // kv.stride(1)) + kv.shape[1]
        return kv.as_strided((n, kv.shape[2]), (kv.stride(1), 1))


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

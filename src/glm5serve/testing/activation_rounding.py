"""The int8 activation rounding of glm5serve's GGUF decode kernels, emulated in the reference engine.

At decode batch sizes the kernels round each linear's input to int8 before the integer dot products, as llama.cpp's
MMVQ does: blocks of 32 values (``gguf_gemv_q8``, the split-row dp4a path; llama.cpp ``quantize_row_q8_1``) or of
256 (``gguf_mma``, Q6_K rows; llama.cpp ``Q8_K``), code ``floor(x / d + 0.5)`` with ``d = max|x| / 127``. Which
block a layer gets depends on its type and on how many rows are in the batch, so two bf16 engines running the same
kernels see different roundings, and a value near a code boundary turns a bf16-sized difference upstream into a
whole int8 step. At the steps where two engines of the H100 e2e run (session 37, narrow ud-q4_k_xl) were furthest
apart, this rounding moved the fp32 reference's logprobs by tenths of a nat, where computing in bf16 moved them by
0.02-0.04.

:func:`int8_activations` lets a test ask the fp32 reference what that rounding does at a step, as
:mod:`~glm5serve.testing.router_ties` asks what a router near-tie flip does. It is a sample of the rounding, not a
replica of one engine: it rounds the whole input of every linear the kernels run (the Q4_K/Q5_K kernels keep the
exact block sums for the min term), with one block size for all of them.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

#: activation block sizes the kernels round with (elements per int8 scale)
BLOCKS = (32, 256)
#: reference weights whose linears are left unrounded: the router (F32 in the GGUF, no decode kernel runs it),
#: kv_b_proj (vLLM splits it into bf16 W_UK / W_UV for MLA) and the indexer head (which the reference computes in
#: fp32 as transformers does; up to index_topk keys its choice does not matter: every key is selected)
UNROUNDED_SUFFIXES = ("mlp.gate.weight", "indexer.weights_proj.weight", "kv_b_proj.weight")


def round_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (..., K) rounded as the kernels' ``quantize_activations`` rounds it, returned dequantized in x's dtype:
    per ``block`` consecutive values along the last dim, ``d = max|x| / 127`` (fp32) and codes ``floor(x / d +
    0.5)`` (llama.cpp ``quantize_row_q8_1`` in ggml-quants.c; 0 where the block is all zero). So ``|x - result| <=
    d / 2`` per value, plus x's own rounding of the result. Raises ValueError if K is not a multiple of ``block``."""
    K = x.shape[-1]
    if block < 1 or K % block:
        raise ValueError(f"round_activations: K={K} is not a multiple of block={block}")
    b = x.float().reshape(*x.shape[:-1], K // block, block)
    amax = b.abs().amax(-1, keepdim=True)
    codes = torch.floor(b * torch.where(amax > 0, 127.0 / torch.where(amax > 0, amax, 1.0), 0.0) + 0.5)
    return (codes * (amax / 127.0)).reshape(x.shape).to(x.dtype)


class _RoundingFunctional:
    """``torch.nn.functional`` whose ``linear`` rounds its input first (except for the weights in ``skip``)."""

    def __init__(self, block: int, skip: set[int]):
        self.block, self.skip = block, skip

    def __getattr__(self, name: str):
        return getattr(F, name)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.data_ptr() not in self.skip and x.shape[-1] % self.block == 0:
            x = round_activations(x, self.block)
        return F.linear(x, weight, bias)


@contextmanager
def int8_activations(model, block: int | None) -> Iterator[None]:
    """Within the block, every linear of the reference engine ``model`` (:class:`glm5serve.reference.ReferenceModel`)
    whose weight a GGUF decode kernel would run takes its input through :func:`round_activations` at ``block``
    values per scale; the router, the indexer head and kv_b_proj (:data:`UNROUNDED_SUFFIXES`) do not. ``block``
    None: no change. Swaps ``glm5serve.reference.F`` for the duration, so not for concurrent use of the reference."""
    if block is None:
        yield
        return
    from glm5serve import reference

    skip = {t.data_ptr() for name, t in model.w.items() if name.endswith(UNROUNDED_SUFFIXES)}
    saved = reference.F
    reference.F = _RoundingFunctional(int(block), skip)
    try:
        yield
    finally:
        reference.F = saved

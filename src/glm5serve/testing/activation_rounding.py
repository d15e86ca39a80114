"""The int8 activation rounding of glm5serve's GGUF decode kernels, emulated in the reference engine.

At decode batch sizes some of the kernels round a linear's input to int8 before the integer dot products, in the
manner of llama.cpp's MMVQ: blocks of 32 values (``gguf_gemv_q8`` for Q4_K/Q5_K/Q6_K at 2-8 rows and for Q4_K/Q5_K
weights of >= 4 MiB at one row, the split-row dp4a path) or of 256 (``gguf_mma`` at 3-16 rows, Q6_K rows), with
``d = max|x| / 127`` in fp32 and codes ``floor(x / d + 0.5)`` (the kernels' ``quantize_activations``; llama.cpp's
``quantize_row_q8_1`` rounds half away from zero and keeps d in fp16). Which rounding a layer gets depends on its
type and on how many rows are in the batch, so two bf16 engines running the same kernels round differently, and a
value near a code boundary turns a bf16-sized difference upstream into a whole int8 step. At the steps where two
engines of the H100 e2e run (session 37, narrow ud-q4_k_xl) were furthest apart, this rounding moved the fp32
reference's logprobs by tenths of a nat, where computing in bf16 moved them by 0.02-0.08.

:func:`int8_activations` lets a test ask the fp32 reference what that rounding does at a step, as
:mod:`~glm5serve.testing.router_ties` asks what a router near-tie flip does; :func:`rounded_in_prefill` says which
linears a prefill step of a given size may round (the rest of a prefill runs unrounded, and
``router_ties.logprobs(rounded_from=)`` runs it apart from the decode positions). It is a sample of the rounding's
effect, not a replica of one engine, and it rounds more than an engine does: every linear a kernel may run,
whatever the type and batch size (at one row only some kernels round), and the whole input (the Q4_K/Q5_K kernels
keep the exact block sums for the min term). A tiny change upstream (fp32 summation order: CPU against GPU) can
move a rounded result by a code step, so two runs of it differ at sensitive steps.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator
from unittest import mock

import torch
import torch.nn.functional as F

#: activation block sizes the kernels round with (elements per int8 scale)
BLOCKS = (32, 256)
#: reference weights whose linears are left unrounded: the router (F32 in the GGUF, no decode kernel runs it),
#: kv_b_proj (vLLM splits it into bf16 W_UK / W_UV for MLA) and the indexer head (which the reference computes in
#: fp32 as transformers does; up to index_topk keys its choice does not matter: every key is selected)
UNROUNDED_SUFFIXES = ("mlp.gate.weight", "indexer.weights_proj.weight", "kv_b_proj.weight")
#: the routed experts' weights in the reference (3-D, (E, 2I, H) and (E, H, I))
EXPERT_SUFFIXES = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
#: what any prefill rounds: the rows sampled from it reach the output head at a decode batch size (one per request)
PREFILL_ROUNDED = ("lm_head.weight",)


def rounded_in_prefill(tokens: int) -> tuple[str, ...] | None:
    """The weights (name suffixes) whose linears the kernels may run with int8 activations in an engine step of
    ``tokens`` rows (every request's prompt tokens of a prefill together): all of them (None) up to
    ``gguf_gemv.MAX_FAST_M`` rows; the routed experts up to ``gguf_topk_moe.MOE_Q8_MAX_M`` (the per-pair MoE path); and
    beyond, the output head (:data:`PREFILL_ROUNDED`), which sees one row per request, the sampled one."""
    from glm5serve.kernels.gguf_gemv import MAX_FAST_M
    from glm5serve.kernels.gguf_topk_moe import MOE_Q8_MAX_M

    if tokens <= MAX_FAST_M:
        return None
    return PREFILL_ROUNDED + (EXPERT_SUFFIXES if tokens <= MOE_Q8_MAX_M else ())


def round_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` (..., K) rounded as the kernels' ``quantize_activations`` rounds it, returned dequantized in x's dtype:
    per ``block`` consecutive values along the last dim, in fp32, ``codes = floor(x * (127 / max|x|) + 0.5)`` and
    ``d = max|x| / 127`` (0 where the block is all zero; ``gguf_gemv_q8._int8_codes``). So ``|x - result| <= d / 2``
    per value, plus x's own rounding of the result. Bit for bit the kernel's under Triton's interpreter (IEEE
    division); compiled, Triton divides fp32 with ``div.full.f32``, which is not always correctly rounded, so a code
    at a tie may differ there. Raises ValueError if ``block`` is not a positive int or K not a multiple of it."""
    K = x.shape[-1]
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"round_activations: block={block!r} must be a positive int")
    if K % block:
        raise ValueError(f"round_activations: K={K} is not a multiple of block={block}")
    b = x.float().reshape(*x.shape[:-1], K // block, block)
    amax = b.abs().amax(-1, keepdim=True)
    # a true fp32 division, as the kernel's: torch computes ``127.0 / t`` as 127 * (1 / t), an ulp off at times
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, 1.0), 0.0)
    codes = torch.floor(b * inv + 0.5)
    return (codes * (amax / 127.0)).reshape(x.shape).to(x.dtype)


class _RoundingFunctional:
    """``torch.nn.functional`` whose ``linear`` rounds its input first: for every weight but those in ``skip``
    (data_ptrs), or, when ``only`` is given, for the weights lying within one of its [start, end) byte ranges (the
    experts reach ``linear`` as slices of the 3-D tensors)."""

    def __init__(self, block: int, skip: set[int], only: list[tuple[int, int]] | None):
        self.block, self.skip, self.only = block, skip, only

    def _rounds(self, weight: torch.Tensor) -> bool:
        ptr = weight.data_ptr()
        return ptr not in self.skip if self.only is None else any(lo <= ptr < hi for lo, hi in self.only)

    def __getattr__(self, name: str):
        return getattr(F, name)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._rounds(weight) and x.shape[-1] % self.block == 0:
            x = round_activations(x, self.block)
        return F.linear(x, weight, bias)


@contextmanager
def int8_activations(model, block: int | None, only: tuple[str, ...] | None = None) -> Iterator[None]:
    """Within the block, every linear of the reference engine ``model`` (:class:`glm5serve.reference.ReferenceModel`)
    whose weight a GGUF decode kernel may run takes its input through :func:`round_activations` at ``block`` values
    per scale (a linear whose input length is not a multiple of ``block`` is left as it is); the router, the indexer
    head and kv_b_proj (:data:`UNROUNDED_SUFFIXES`) are not rounded. ``only``: round just the weights whose names end
    with one of these (what a prefill rounds: :func:`rounded_in_prefill`). ``block`` None: no change. Swaps
    ``glm5serve.reference.F`` for the duration, so not for concurrent use of the reference.

    Raises ValueError for a ``block`` not in :data:`BLOCKS`, for an ``only`` that names an unrounded weight or no
    weight of the model, or where one of the unrounded weights is narrower than fp32: weights are told apart by
    storage, and the reference passes ``upcast(w)`` (a copy for a narrower w) to ``F.linear``;
    :meth:`ReferenceModel.from_gguf` keeps them in fp32 whatever the dtype."""
    if block is None:
        yield
        return
    if block not in BLOCKS:
        raise ValueError(f"int8_activations: block={block!r}, expected one of {BLOCKS} or None")
    if only is not None and any(name.endswith(UNROUNDED_SUFFIXES) for name in only):
        raise ValueError(f"int8_activations: only={only!r} names a weight left unrounded ({UNROUNDED_SUFFIXES})")
    from glm5serve import reference

    kept = {name: t for name, t in model.w.items() if name.endswith(UNROUNDED_SUFFIXES)}
    narrow = [name for name, t in kept.items() if reference.upcast(t).data_ptr() != t.data_ptr()]
    if narrow:
        raise ValueError(f"int8_activations: {narrow[0]} is {kept[narrow[0]].dtype}; the unrounded weights must be "
                         "fp32 or wider (as from_gguf loads them)")
    picked = None if only is None else [(t.data_ptr(), t.data_ptr() + t.nbytes) for name, t in model.w.items()
                                         if name.endswith(only)]
    if picked == []:
        raise ValueError(f"int8_activations: only={only!r} names no weight of the model")
    with mock.patch.object(reference, "F", _RoundingFunctional(block, {t.data_ptr() for t in kept.values()}, picked)):
        yield

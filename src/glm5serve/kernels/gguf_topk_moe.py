"""Triton top-k MoE for GGUF-quantized experts at decode batch sizes (no per-expert Python loop).

Up to 16 tokens (``MAX_FAST_M``; 128, ``MOE_Q8_MAX_M``, where both projections run with int8 activations), two
GEMV launches, one program per (token, slot):
1. gate+up: one program per (token, slot, BLOCK_N rows of the intermediate) reads expert ``topk_ids[t, s]``'s
   gate and up rows from the 3-D byte tensor ``w13`` (E, 2I, row_bytes) -- gate rows 0..I-1, up rows I..2I-1,
   vLLM's ``w13`` order -- and writes h = silu(gate) * up in fp32.
2. down: one program per (token, BLOCK_N rows of the hidden size) sums ``topk_weights[t, s] * W2[e_s] @ h[t, s]``
   over the token's slots and stores the result in x's dtype: the weighted sum needs no atomics or extra kernel.

Q4_K projections (GLM-5's routed experts) run with int8 activations for bf16/fp16 x on a GPU, as llama.cpp's
MMVQ does (``gguf_gemv_q8``: x quantized once per token, h once per pair; ``q8`` below); then gate and up rows
are interleaved in one K loop, the down kernel takes the token's slots side by side where w2 rows are short (TP
slices: ``MOE_Q8_SLOTS_MAX_BLOCKS``), and on Hopper all four launches (two quantizers, two GEMVs) use
programmatic dependent launch (``gguf_gemv.pdl_value``).  H200, session 26, same run, us, this / the session-25
kernels (two gate+up loops, slot after slot, no PDL), 256 experts top-8, 1 / 4 / 16 tokens: TP=8 slices 16.5 /
24.5, 45.5 / 51.1, 148.2 / 166.2; TP=4 25.9 / 35.2, 83.9 / 90.9, 290.3 / 309.4; whole experts 78.5 / 79.0,
301.7 / 311.0, 1,118.6 / 1,149.0 (without PDL: TP=8 18.0, 47.4, 149.9; whole experts 80.1, 303.9, 1,120.3).
Rounding h to int8 inside the gate+up kernel (the last program of each 32-value block quantizes it: three
launches, not four) was slower at every batch size: H100, session 31, same run, us, in-kernel / own launch, 1 / 4 /
16 / 64 tokens: TP=8 17.7 / 17.6, 46.9 / 45.1, 158.0 / 150.3, 579.0 / 559.1; whole experts 85.5 / 81.2, 326.6 /
306.0, 1,198.4 / 1,127.9, 4,644.5 / 4,485.7; so h keeps its own quantizer launch.  Rounding h in the down
kernel instead (each slots-side-by-side program rounds its token's SLOTS h rows, then broadcasts them over its tile
rows: 198 registers against 112, 164 shuffles in the SASS against 15) was slower too: H100, session 33, same run,
us, in-kernel / own launch, 1 / 4 / 16 / 64 tokens: TP=8 17.9 / 16.5, 53.3 / 46.2, 185.4 / 149.8, 712.3 / 558.2;
TP=4 33.9 / 26.8, 104.7 / 86.0, 379.0 / 293.4, 1,491.9 / 1,126.8.

Each (token, slot) pair reads its expert's weights itself, so a batch with repeated experts re-reads them
(from L2 when concurrent); for decode batches (<= 16 tokens; <= 128 with int8 activations) that costs less than
sorting tokens by expert.

From there to ``MAX_GEMM_M`` tokens, grouped by expert (the layout of vLLM's ``fused_moe`` with
``moe_align_block_size``, built here from torch ops so it needs no host synchronisation and no vLLM op):
the (token, slot) pairs are sorted by expert and each expert's run padded to ``GROUP_M`` rows; one program per
(group, rows) dequantizes its expert's weight tile once and multiplies it with the group's gathered
activation rows on the tensor cores.  gate+up writes h = silu(gate) * up in x's dtype, down writes each pair's
routing-weighted output in fp32, and the k slots of a token are summed in slot order (deterministic).
Dequantization and the decode order are those of ``gguf_gemv``.
"""
from __future__ import annotations

import operator

import torch
import triton
import triton.language as tl

from glm5serve.kernels.gguf_gemv import (
    _DOT_TILE,
    BLOCK_SIZES,
    MAX_FAST_M,
    MAX_GEMM_M,
    SUPPORTED_QTYPES,
    _NAMES,
    _as_words,
    _check_tensors,
    _device_sms,
    _index,
    _gdc_wait,
    _ints,
    _pow2_at_least,
    _pow2_at_most,
    _reduce_acc,
    _rows_dot,
    _zero_acc,
    Q4_K,
    pdl_launch,
    pdl_value,
    tile_shape,
    type_id,
)
from glm5serve.kernels.gguf_gemv_q8 import (
    _dot_q4_k_q8,
    _kquant_words,
    _math_q4_k_q8,
    quantize_activations,
)


@triton.jit
def _expert(ids, E):
    """Expert ids as int64, ids of E or more mapped to -1 (negative ids stay negative): every kernel below treats
    e < 0 as "not on this rank" (no weight read, no contribution), as ``expert_groups`` drops them for the grouped
    path."""
    e = ids.to(tl.int64)
    return tl.where(e < E, e, -1)


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, ids_ptr, h_ptr, inter, nb, topk, E,
                        stride_xm, stride_we, stride_wn, stride_hm,
                        QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, KBS: tl.constexpr,
                        G: tl.constexpr, T: tl.constexpr, PREFETCH: tl.constexpr = 0):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = _expert(tl.load(ids_ptr + pair), E)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = (rows < inter) & (e >= 0)  # e < 0: expert not on this rank (expert parallelism)
    base = w_ptr + tl.maximum(e, 0) * stride_we
    x_row = x_ptr + (pair // topk).to(tl.int64) * stride_xm
    gate = _zero_acc(1, BLOCK_N, G, T, False)
    gate = _rows_dot(gate, base + rows.to(tl.int64) * stride_wn, rmask, 0, nb, nb, x_row, 0, True, 1.0,
                     QTYPE, KBS, 1, False, PREFETCH)
    up = _zero_acc(1, BLOCK_N, G, T, False)
    up = _rows_dot(up, base + (rows + inter).to(tl.int64) * stride_wn, rmask, 0, nb, nb, x_row, 0, True,
                   1.0, QTYPE, KBS, 1, False, PREFETCH)
    g = _reduce_acc(gate, False)
    h = g * tl.sigmoid(g) * _reduce_acc(up, False)
    tl.store(h_ptr + pair.to(tl.int64) * stride_hm + rows[None, :], h, mask=(rows < inter)[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, w_ptr, ids_ptr, wts_ptr, y_ptr, hidden, nb, topk, E,
                     stride_hm, stride_we, stride_wn, stride_ym,
                     QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, KBS: tl.constexpr,
                     G: tl.constexpr, T: tl.constexpr, PREFETCH: tl.constexpr = 0):
    tok = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < hidden
    acc = _zero_acc(1, BLOCK_N, G, T, False)
    for s in range(topk):
        pair = tok * topk + s
        e = _expert(tl.load(ids_ptr + pair), E)
        wt = tl.where(e >= 0, tl.load(wts_ptr + pair).to(tl.float32), 0.0)  # a dropped slot's inf/NaN weight: 0
        row_ptr = w_ptr + tl.maximum(e, 0) * stride_we + rows.to(tl.int64) * stride_wn
        # the routing weight scales this slot's activations: sum_s wt_s * (W_s @ h_s) in one accumulator
        acc = _rows_dot(acc, row_ptr, rmask & (e >= 0), 0, nb, nb, h_ptr + pair.to(tl.int64) * stride_hm,
                        0, True, wt, QTYPE, KBS, 1, False, PREFETCH)
    y = _reduce_acc(acc, False)
    tl.store(y_ptr + tok.to(tl.int64) * stride_ym + rows[None, :], y.to(y_ptr.dtype.element_ty),
             mask=rmask[None, :])


@triton.jit
def _moe_gate_up_q8_kernel(xw_ptr, xd_ptr, xs_ptr, w_ptr, ids_ptr, h_ptr, inter, nb, topk, E, stride_we, stride_wn,
                           stride_hm, BLOCK_N: tl.constexpr, KBS: tl.constexpr, EMULATE: tl.constexpr,
                           PDL: tl.constexpr = False):
    """``_moe_gate_up_kernel`` for Q4_K ``w13`` (int32 words) with int8 activations (``quantize_activations`` of x,
    one row per token): the one-row step of ``gguf_gemv_q8`` over 2 BLOCK_N rows, gate row n and up row n
    interleaved, so that one K loop issues the loads of both (the session-25 kernel ran a gate loop, then an up
    loop; the module docstring has the two compared, with the other changes of session 26).  PDL: launched with
    programmatic dependent launch, it waits (``gguf_gemv._gdc_wait``) for the kernel before it ahead of any load."""
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    if PDL:
        _gdc_wait()
    e = _expert(tl.load(ids_ptr + pair), E)
    r = tl.arange(0, 2 * BLOCK_N)
    n = pid_n * BLOCK_N + r // 2
    rows = n + (r % 2) * inter  # gate row n, up row n, gate row n + 1, ...
    base = w_ptr + tl.maximum(e, 0) * stride_we
    tok = (pair // topk).to(tl.int64)
    xw, xd, xs = xw_ptr + tok * nb * 64, xd_ptr + tok * nb * 8, xs_ptr + tok * nb * 8
    gu = _dot_q4_k_q8(base + rows.to(tl.int64) * stride_wn, (n < inter) & (e >= 0), 0, nb, nb, xw, xd, xs,
                      2 * BLOCK_N, KBS, 0, EMULATE, SHAPED=False)
    g, u = tl.split(tl.reshape(gu, (BLOCK_N, 2)))
    out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(h_ptr + pair.to(tl.int64) * stride_hm + out, g * tl.sigmoid(g) * u, mask=out < inter)


@triton.jit
def _moe_down_q8_kernel(hw_ptr, hd_ptr, hs_ptr, w_ptr, ids_ptr, wts_ptr, y_ptr, hidden, nb, topk, E, stride_we,
                        stride_wn, stride_ym, BLOCK_N: tl.constexpr, KBS: tl.constexpr, EMULATE: tl.constexpr,
                        PDL: tl.constexpr = False):
    """``_moe_down_kernel`` for Q4_K ``w2`` with h quantized to int8 blocks (one row per (token, slot) pair); each
    slot's dot product is scaled by its routing weight; slot after slot.  PDL as ``_moe_gate_up_q8_kernel``."""
    tok = tl.program_id(0)
    pid_n = tl.program_id(1)
    if PDL:
        _gdc_wait()
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < hidden
    y = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in range(topk):
        pair = (tok * topk + s).to(tl.int64)
        e = _expert(tl.load(ids_ptr + pair), E)
        wt = tl.where(e >= 0, tl.load(wts_ptr + pair).to(tl.float32), 0.0)
        row_ptr = w_ptr + tl.maximum(e, 0) * stride_we + rows.to(tl.int64) * stride_wn
        y += wt * _dot_q4_k_q8(row_ptr, rmask & (e >= 0), 0, nb, nb, hw_ptr + pair * nb * 64,
                               hd_ptr + pair * nb * 8, hs_ptr + pair * nb * 8, BLOCK_N, KBS, 0, EMULATE, SHAPED=False)
    tl.store(y_ptr + tok.to(tl.int64) * stride_ym + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _moe_down_q8_slots_kernel(hw_ptr, hd_ptr, hs_ptr, w_ptr, ids_ptr, wts_ptr, y_ptr, hidden, nb, topk, E, stride_we,
                              stride_wn, stride_ym, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, KBS: tl.constexpr,
                              EMULATE: tl.constexpr, PDL: tl.constexpr = False):
    """``_moe_down_q8_kernel`` with the token's slots side by side: one tile of SLOTS x BLOCK_N rows (SLOTS: topk
    rounded up to a power of two; slot s of row r = s BLOCK_N + i is expert ``topk_ids[tok, s]``'s row i, against
    pair (tok, s)'s int8 h), so the loads of all slots are in flight at once; for short rows (TP slices of the
    experts, ``MOE_Q8_SLOTS_MAX_BLOCKS``).  The weighted slot outputs are summed as a tree
    (the slot loop sums them in slot order: the results differ by fp32 rounding)."""
    tok = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    if PDL:
        _gdc_wait()
    r = tl.arange(0, SLOTS * BLOCK_N)
    slot = r // BLOCK_N
    n = pid_n * BLOCK_N + r % BLOCK_N
    pair = tok * topk + slot
    e = _expert(tl.load(ids_ptr + pair, mask=slot < topk, other=-1), E)
    live = e >= 0
    wt = tl.load(wts_ptr + pair, mask=live, other=0.0).to(tl.float32)  # padding and dropped slots: 0
    row_ptr = w_ptr + tl.maximum(e, 0) * stride_we + n.to(tl.int64) * stride_wn
    acc = tl.zeros([SLOTS * BLOCK_N, 4 * KBS], dtype=tl.float32)
    for b0 in range(0, nb, KBS):
        kb, j, t, bmask, h0, h1, h2, h3, q, qh = _kquant_words(row_ptr, (n < hidden) & live, b0, nb, KBS)
        xo = (pair * nb * 64)[:, None, None] + ((kb * 64 + j * 16)[:, None] + t[None, :])[None, :, :]
        xmask = live[:, None, None] & bmask[None, :, None]
        xlo = tl.load(hw_ptr + xo, mask=xmask, other=0)
        xhi = tl.load(hw_ptr + xo + 8, mask=xmask, other=0)
        sb = (pair * nb * 8)[:, None] + (kb * 8 + 2 * j)[None, :]  # sub-block 2j of the pair's h blocks
        smask = live[:, None] & bmask[None, :]
        dx_lo = tl.load(hd_ptr + sb, mask=smask, other=0.0)
        dx_hi = tl.load(hd_ptr + sb + 1, mask=smask, other=0.0)
        sx_lo = tl.load(hs_ptr + sb, mask=smask, other=0.0)
        sx_hi = tl.load(hs_ptr + sb + 1, mask=smask, other=0.0)
        acc = _math_q4_k_q8(acc, j, h0, h1, h2, h3, q, qh, xlo, xhi, dx_lo, dx_hi, sx_lo, sx_hi, False, EMULATE)
    y = tl.sum(tl.reshape(tl.sum(acc, axis=1) * wt, (SLOTS, BLOCK_N)), axis=0)
    out = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + tok * stride_ym + out, y.to(y_ptr.dtype.element_ty), mask=out < hidden)


_ID_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)  # topk_ids; -1 marks an expert on another rank
GROUP_M = 16  # rows per expert group on the grouped path: at 256 experts a decode batch gives each a few pairs
GROUPED_WARPS = 8  # with 4, the gate+up tile spills registers (tests/unit/test_kernels_compile.py)


def grouped_tile(qtype: int, gate_up: bool) -> tuple[int, int]:
    """(BLOCK_N, KBS) of the grouped kernels: the tensor-core GEMV tile, with gate+up's rows split between the two
    (each program holds BLOCK_N gate rows and the BLOCK_N matching up rows)."""
    bn, kbs = _DOT_TILE[qtype]
    return (bn // 2 if gate_up else bn), kbs


@triton.jit
def _grouped_gate_up_kernel(x_ptr, w_ptr, sorted_ptr, gexp_ptr, h_ptr, inter, nb, topk, n_pairs,
                            stride_xm, stride_we, stride_wn, stride_hm,
                            QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KBS: tl.constexpr,
                            PREFETCH: tl.constexpr = 0):
    grp = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(gexp_ptr + grp).to(tl.int64)
    if e < 0:  # a group slot past the last expert's run
        return
    pair = tl.load(sorted_ptr + grp * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pair < n_pairs  # padding rows of the group
    xoff = (pair // topk).to(tl.int64) * stride_xm
    # one tile of 2 * BLOCK_N weight rows, BLOCK_N gate rows then the matching up rows: x is read once for both
    r2 = tl.arange(0, 2 * BLOCK_N)
    rows = pid_n * BLOCK_N + r2 % BLOCK_N
    wrows = rows + (r2 // BLOCK_N) * inter
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    acc = _rows_dot(acc, w_ptr + e * stride_we + wrows.to(tl.int64) * stride_wn, rows < inter, 0, nb, nb, x_ptr,
                    xoff, pmask, 1.0, QTYPE, KBS, BLOCK_M, True, PREFETCH)
    gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), (0, 2, 1)))
    h = gate * tl.sigmoid(gate) * up
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < inter
    tl.store(h_ptr + pair[:, None].to(tl.int64) * stride_hm + rows[None, :], h.to(h_ptr.dtype.element_ty),
             mask=pmask[:, None] & rmask[None, :])


@triton.jit
def _grouped_down_kernel(h_ptr, w_ptr, sorted_ptr, gexp_ptr, wts_ptr, out_ptr, hidden, nb, n_pairs,
                         stride_hm, stride_we, stride_wn, stride_om,
                         QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KBS: tl.constexpr,
                         PREFETCH: tl.constexpr = 0):
    grp = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(gexp_ptr + grp).to(tl.int64)
    if e < 0:
        return
    pair = tl.load(sorted_ptr + grp * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pair < n_pairs
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < hidden
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _rows_dot(acc, w_ptr + e * stride_we + rows.to(tl.int64) * stride_wn, rmask, 0, nb, nb, h_ptr,
                    pair.to(tl.int64) * stride_hm, pmask, 1.0, QTYPE, KBS, BLOCK_M, True, PREFETCH)
    wt = tl.load(wts_ptr + pair, mask=pmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pair[:, None].to(tl.int64) * stride_om + rows[None, :], acc * wt[:, None],
             mask=pmask[:, None] & rmask[None, :])


def expert_groups(topk_ids: torch.Tensor, num_experts: int, group_m: int = GROUP_M
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the (token, slot) pairs by expert and pad each expert's run to a multiple of ``group_m``.

    Args:
        topk_ids: (T, k) int expert ids; ids outside [0, num_experts) (e.g. -1: not on this rank) are dropped.
    Returns:
        ``sorted_pairs`` (G * group_m,) int32: pair index ``t * k + s`` per group row, ``T * k`` on padding rows;
        ``group_expert`` (G,) int32: each group's expert, -1 for the unused groups at the end.  G =
        cdiv(T k, group_m) + min(E, T k) is the most groups any routing can need, so shapes depend on T only
        (capture-safe: no host synchronisation).  Within an expert, pairs keep ascending order.
    Same layout as vLLM's ``moe_align_block_size`` (``fused_moe/moe_align_block_size.py``).
    Raises:
        ValueError: topk_ids not a 2-D integer tensor, num_experts not an int in [0, 2**31) (``group_expert`` is
            int32), group_m not an int >= 1.
    """
    num_experts = _index(num_experts, "num_experts", "expert_groups")
    if num_experts >= 2**31:
        raise ValueError(f"expert_groups: num_experts={num_experts} does not fit int32 expert ids")
    try:
        gm = operator.index(group_m)  # numpy and torch integers too, as num_experts
    except TypeError:
        gm = 0
    if isinstance(group_m, bool) or gm < 1:
        raise ValueError(f"expert_groups: group_m={group_m!r} must be an int >= 1")
    group_m = gm
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.is_floating_point() or topk_ids.is_complex() \
            or topk_ids.dtype == torch.bool:
        raise ValueError(f"expert_groups: topk_ids must be an integer tensor, got "
                         f"{getattr(topk_ids, 'dtype', type(topk_ids).__name__)}")
    if topk_ids.dim() != 2:
        raise ValueError(f"expert_groups: topk_ids must be (T, k), got shape {tuple(topk_ids.shape)}")
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)  # dropped pairs: last bucket
    order = torch.argsort(bucket, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=dev).scatter_add_(0, bucket, torch.ones_like(bucket))
    # runs padded to whole groups; the dropped pairs' bucket gets none (a mask, not an indexed store: capture-safe)
    padded = (counts + group_m - 1) // group_m * group_m * (torch.arange(num_experts + 1, device=dev) < num_experts)
    pend = padded.cumsum(0)
    sb = bucket[order]
    pos = (pend - padded)[sb] + torch.arange(P, device=dev) - (counts.cumsum(0) - counts)[sb]
    G = triton.cdiv(P, group_m) + min(num_experts, P)
    trash = G * group_m  # dropped pairs are written past the end and cut off
    sorted_pairs = torch.full((trash + 1,), P, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, torch.where(sb < num_experts, pos, trash), order.to(torch.int32))
    starts = torch.arange(G, device=dev) * group_m
    group_expert = torch.searchsorted(pend[:num_experts].contiguous(), starts, right=True)
    group_expert = torch.where(group_expert < num_experts, group_expert, -1).to(torch.int32)
    return sorted_pairs[:trash], group_expert


def supports_moe(qtype_w13: int, qtype_w2: int, num_tokens: int, hidden: int, inter: int) -> bool:
    """True where ``gguf_moe`` is meant to be used: supported types, 1..MAX_GEMM_M tokens (per-pair kernels up to
    16 or 128 tokens, ``per_pair``; grouped by expert beyond), whole quant blocks."""
    ints = _ints(qtype_w13, qtype_w2, num_tokens, hidden, inter)
    if ints is None:
        return False
    q13, q2, num_tokens, hidden, inter = ints
    return (q13 in SUPPORTED_QTYPES and q2 in SUPPORTED_QTYPES and 1 <= num_tokens <= MAX_GEMM_M
            and hidden % BLOCK_SIZES[q13][0] == 0 and inter % BLOCK_SIZES[q2][0] == 0)


def _block_n(row_tiles_of_16: int, items: int, sms: int) -> int:
    """Rows per program: 16, or fewer when that leaves fewer than 4 programs per SM."""
    for bn in (16, 8, 4):
        if items * row_tiles_of_16 * (16 // bn) >= 4 * sms:
            return bn
    return 4


#: steps of L2 prefetch ahead of the decode loop (``_rows_dot``) in the per-pair fp32-decode kernels and the
#: grouped ones.  H200, session 6, 256 experts top-8 Q4_K, 2 steps vs none in the same run: whole experts
#: (I = 2048) 143 vs 145 us at 1 token, 2,033 vs 2,221 us at 16; TP=8 slices (I = 256) 30.1 vs 31.3 us at 1,
#: 270 vs 279 us at 16.  The grouped path at 256 tokens: 1,523 vs 1,520 us (no gain, left off).
MOE_PREFETCH = 2
GROUPED_PREFETCH = 0
#: super-blocks per step of the int8-activation per-pair kernels (no L2 prefetch there).  H200, session 8, 256
#: experts top-8, Q4_K gate/up and down, us per call at 1 / 4 / 16 tokens: whole experts 94 / 339 / 1,280 (4
#: super-blocks, no prefetch), 123 / 380 / 1,366 (2, prefetch 2), fp32 decode 143 / 534 / 2,036; TP=8 slices
#: 24.4 / 51.9 / 192 (4, none), 29.1 / 70.2 / 221 (2, prefetch 2), fp32 decode 30.3 / 79.4 / 271.
MOE_Q8_KBS = 4
#: gate (and as many up) rows per int8 gate+up program (``_gate_up_tile``): 4 on 2 warps, or 2 on 4 warps where
#: programs of 4 would be fewer than MOE_Q8_GATE_UP_MIN_PER_SM per SM.  H200, session 26, one run, that kernel alone
#: (gate and up rows interleaved in one K loop), best of 24 tiles (2/4/8 rows, 2/4 super-blocks per step, 2/4 warps,
#: loads ahead or not) / this rule, us: TP=8 slices, 1 token 8.54 / 8.54, 4 tokens 25.27 / 26.68, 16 tokens
#: 89.15 / 89.15; whole experts 1 token 48.12 / 48.12, 4 tokens 168.74 / 168.74.  (Session 8, two loops: at most 8
#: rows, 79.4 / 296 / 1,146 us for whole experts against 94.1 / 338 / 1,281 with 16.)
MOE_Q8_GATE_UP_MIN_PER_SM = 16
#: w2 rows of at most this many super-blocks (TP slices of the experts: 1 at TP=8, 2 at TP=4) take the down kernel
#: with the token's slots side by side (``_moe_down_q8_slots_kernel``, 8 rows x 8 slots, one super-block per step,
#: 4 warps), longer rows the slot loop.  H200, session 26: that kernel alone at TP=8 slices, best of 9 tiles (4/8/16
#: rows, 2/4/8 warps) / this tile, us: 1 token 5.80 / 5.88, 4 tokens 18.07 / 18.15, 16 tokens 58.43 / 58.43.  The
#: whole MoE (another run, same-run pairs) with this rule / the other down kernel: TP=8 16.5 / 20.1, 45.5 / 49.9,
#: 148.2 / 159.7 at 1 / 4 / 16 tokens; TP=4 25.9 / 33.1, 83.9 / 88.4, 290.3 / 298.5; whole experts (8 super-blocks,
#: slot loop) 78.5 / 89.9, 301.7 / 335.1, 1,118.6 / 1,221.6.
MOE_Q8_SLOTS_MAX_BLOCKS = 2
MOE_Q8_SLOTS_TILE = (8, 1, 4)  # (rows, super-blocks per step, warps)
#: rows of that kernel's tile (slots x rows per slot) for top-k above 8: the rows per slot shrink to keep it at the
#: timed tile's 64 (compiled for sm_90: 111-112 registers from 8 to 64 slots, no spills; with 8 rows per slot, 16
#: slots took 190 registers and 32 slots 255 with 232 bytes spilled); past 64 slots the slot loop.  Only top-8
#: (GLM-5's) was timed.
MOE_Q8_SLOTS_MAX_ROWS = 64
#: tokens up to which the per-pair path with int8 gate+up and down beats the grouped one (each pair re-reads its
#: expert).  Same run (session 8), per-pair int8 / grouped, us: TP=8 slices 64 tokens
#: 614 / 1,119, 128 tokens 1,203 / 1,327; whole experts 64 tokens 4,631 / 8,919, 128 tokens 9,164 / 10,629; at 256
#: tokens the grouped path takes 1,516 and 12,003 (the per-pair one grows linearly: ~2,400 and ~18,300).
MOE_Q8_MAX_M = 128


def _prefetch(device: torch.device, grouped: bool = False) -> int:
    """The kernels' PREFETCH: 0 under the Triton interpreter (no inline PTX there)."""
    return 0 if device.type != "cuda" else GROUPED_PREFETCH if grouped else MOE_PREFETCH


def per_pair(qtype_w13: int, qtype_w2: int, num_tokens: int, q8: bool) -> bool:
    """True where ``gguf_moe`` (grouped=None) runs the per-pair kernels: up to MAX_FAST_M tokens, or up to
    MOE_Q8_MAX_M when both projections run with int8 activations (``q8`` and Q4_K ``w13`` and ``w2``: the case
    measured); the grouped path beyond."""
    both = q8 and int(qtype_w13) == Q4_K and int(qtype_w2) == Q4_K
    return num_tokens <= (MOE_Q8_MAX_M if both else MAX_FAST_M)


def _gate_up_tile(pairs: int, inter: int, sms: int) -> tuple[int, int]:
    """(gate rows per program, num_warps) of ``_moe_gate_up_q8_kernel`` for ``pairs`` (token, slot) pairs
    (MOE_Q8_GATE_UP_MIN_PER_SM)."""
    if pairs * triton.cdiv(inter, 4) < MOE_Q8_GATE_UP_MIN_PER_SM * sms:
        return 2, 4
    return 4, 2


def _slots_tile(topk: int) -> tuple[int, int, int, int] | None:
    """(SLOTS, BLOCK_N, KBS, num_warps) of ``_moe_down_q8_slots_kernel`` for ``topk`` slots: ``MOE_Q8_SLOTS_TILE``
    with the rows per slot cut so that the tile has at most MOE_Q8_SLOTS_MAX_ROWS rows; None past that many slots."""
    slots = _pow2_at_least(topk)
    bn, kbs, warps = MOE_Q8_SLOTS_TILE
    bn = min(bn, MOE_Q8_SLOTS_MAX_ROWS // slots)
    return (slots, bn, kbs, warps) if bn >= 1 else None


def _kbs(qtype: int, nb: int) -> int:
    return min(2 if BLOCK_SIZES[qtype][0] == 256 else 8, _pow2_at_most(nb))


def gguf_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, qtype_w13: int, qtype_w2: int, activation: str = "silu",
             grouped: bool | None = None, q8: bool | None = None, dp4a: bool = True) -> torch.Tensor:
    """Routed-expert MLP: y[t] = sum_s topk_weights[t, s] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, s].

    Args:
        x: (T, H) bf16/fp16 hidden states (fp32 accepted on the per-pair path: up to MAX_FAST_M tokens).
        w13: (E, 2I, >= row_bytes(H)) uint8 raw GGUF rows; rows 0..I-1 are ``ffn_gate_exps``, I..2I-1
            ``ffn_up_exps`` (vLLM's w13), both of type ``qtype_w13``.
        w2: (E, H, >= row_bytes(I)) uint8 raw GGUF rows of ``ffn_down_exps``, type ``qtype_w2``.
        topk_weights: (T, k) float routing weights (applied to the expert outputs).
        topk_ids: (T, k) signed integer (vLLM: int32) expert indices into E; an id outside [0, E) contributes nothing (-1: an
            expert on another rank, expert parallelism; ``expert_groups`` drops them the same way).  Ids are not
            checked on the host (that would synchronise with the GPU), so a routing bug shows as missing terms.
        qtype_w13, qtype_w2: GGML type ids (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K).
        activation: only "silu" (SwiGLU, GLM-5's ``hidden_act``).
        grouped: None picks the path by T (``per_pair``: per-pair kernels up to MAX_FAST_M tokens, or
            MOE_Q8_MAX_M when both projections run with int8 activations; grouped by expert beyond); True/False
            forces one (tests).
        q8: on the per-pair path, run each Q4_K projection with int8 activations (``gguf_gemv_q8``'s numerics: x
            quantized once per token for gate+up, h once per pair for down; other types keep the fp32 decode).
            None: on for bf16/fp16 x on a GPU (1.2-1.8x faster: ``MOE_Q8_KBS``; launched with PDL on Hopper);
            False: the fp32 decode.
        dp4a: False computes the int8 path's integer dot products with shifts and multiplies (always so under the
            Triton interpreter, which has no inline PTX); the results are bit-identical.
    Returns:
        (T, H) in x's dtype; the intermediate h is kept in fp32 on the per-pair path (then rounded to int8 blocks
        for a Q4_K down projection with ``q8``), in x's dtype on the grouped (tensor-core) path, where fp32
        activations are not supported.  With int8 activations each output moves by at most
        ``kernels.testing.q8_moe_bound`` more (``kernels.testing.q8_moe_model`` gives their exact arithmetic).
    Raises:
        ValueError: unsupported type or activation, inconsistent shapes, dtypes (x not bf16/fp16/fp32, topk_ids
            not a signed integer type, topk_weights not floating) or devices; fp32 x on the grouped path.
    Capture-safe under CUDA graphs (no host synchronisation, allocations through torch).
    """
    q13, q2 = type_id(qtype_w13, "gguf_moe", "qtype_w13"), type_id(qtype_w2, "gguf_moe", "qtype_w2")
    if activation != "silu":
        raise ValueError(f"gguf_moe: activation {activation!r} is not supported (only 'silu')")
    for name, q in (("qtype_w13", q13), ("qtype_w2", q2)):
        if q not in SUPPORTED_QTYPES:
            raise ValueError(f"gguf_moe: {name}={q} is not a supported GGML type (supported: "
                             f"{', '.join(_NAMES[t] for t in sorted(SUPPORTED_QTYPES))})")
    _check_tensors("gguf_moe", x=x, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids)
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise ValueError(f"gguf_moe: expected x (T, H) and uint8 w13/w2 (E, N, row_bytes), got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)} {w13.dtype}, {tuple(w2.shape)} {w2.dtype}")
    T_, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T_:
        raise ValueError(f"gguf_moe: topk_ids {tuple(topk_ids.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} must both be (T={T_}, k)")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) \
            or topk_ids.dtype not in _ID_DTYPES or not topk_weights.is_floating_point():
        raise ValueError(f"gguf_moe: expected bf16/fp16/fp32 x, signed integer topk_ids and float topk_weights, got "
                         f"{x.dtype}, {topk_ids.dtype}, {topk_weights.dtype}")
    devices = {t.device for t in (x, w13, w2, topk_weights, topk_ids)}
    if len(devices) > 1:
        raise ValueError(f"gguf_moe: x, w13, w2, topk_weights and topk_ids must be on one device, got "
                         f"{sorted(map(str, devices))}")
    for name, w, q, K, N in (("w13", w13, q13, H, two_i), ("w2", w2, q2, inter, H)):
        qk, qb = BLOCK_SIZES[q]
        if two_i % 2 or K % qk or K // qk * qb > w.shape[2] or w.shape[1] != N or w.shape[0] != E:
            per_row = "" if K % qk else f", {K // qk * qb} bytes per row"
            raise ValueError(f"gguf_moe: {name} {tuple(w.shape)} does not hold (E={E}, {N}, K={K}) of "
                             f"{_NAMES[q]} (K a multiple of {qk}{per_row})")
        if w.stride(2) != 1:
            raise ValueError(f"gguf_moe: {name} must have contiguous rows (last stride 1), got strides "
                             f"{w.stride()}")
    k = topk_ids.shape[1]
    if T_ == 0:
        return x.new_empty((0, H))
    x = x.contiguous()
    ids = topk_ids.contiguous()
    wts = topk_weights.contiguous()
    w13w, w2w = _as_words(w13, q13), _as_words(w2, q2)
    if q8 is None:
        q8 = x.device.type == "cuda" and x.dtype in (torch.bfloat16, torch.float16)
    if grouped if grouped is not None else not per_pair(q13, q2, T_, q8):
        if x.dtype == torch.float32:
            raise ValueError("gguf_moe: the grouped path runs on the tensor cores and needs bf16/fp16 x")
        return _grouped_moe(x, w13w, w2w, wts, ids, q13, q2, inter)
    sms = _device_sms(x.device)
    emulate = x.device.type != "cuda" or not dp4a  # the interpreter has no inline PTX (dp4a)

    h = torch.empty((T_ * k, inter), dtype=torch.float32, device=x.device)
    nb13 = H // BLOCK_SIZES[q13][0]
    pdl = bool(q8 and pdl_value(x.device, 0))
    if q8 and q13 == Q4_K:
        xq, xd, xs = quantize_activations(x, pdl=pdl)
        bn, warps = _gate_up_tile(T_ * k, inter, sms)
        _moe_gate_up_q8_kernel[(T_ * k, triton.cdiv(inter, bn))](
            xq.view(torch.int32), xd, xs, w13w, ids, h, inter, nb13, k, E, w13w.stride(0), w13w.stride(1), h.stride(0),
            BLOCK_N=bn, KBS=min(MOE_Q8_KBS, _pow2_at_most(nb13)), EMULATE=emulate, PDL=pdl, num_warps=warps,
            **pdl_launch(pdl))
    else:
        kbs = _kbs(q13, nb13)
        G, T = tile_shape(q13, kbs)
        bn = _block_n(triton.cdiv(inter, 16), T_ * k, sms)
        _moe_gate_up_kernel[(T_ * k, triton.cdiv(inter, bn))](
            x, w13w, ids, h, inter, nb13, k, E, x.stride(0), w13w.stride(0), w13w.stride(1), h.stride(0),
            QTYPE=q13, BLOCK_N=bn, KBS=kbs, G=G, T=T, PREFETCH=_prefetch(x.device), num_warps=4)

    y = x.new_empty((T_, H))
    nb2 = inter // BLOCK_SIZES[q2][0]
    bn = _block_n(triton.cdiv(H, 16), T_, sms)
    if q8 and q2 == Q4_K:
        hq, hd, hs = quantize_activations(h, pdl=pdl)
        args = (hq.view(torch.int32), hd, hs, w2w, ids, wts, y, H, nb2, k, E, w2w.stride(0), w2w.stride(1), y.stride(0))
        tile = _slots_tile(k) if nb2 <= MOE_Q8_SLOTS_MAX_BLOCKS else None
        if tile is not None:
            slots, bn, kbs, warps = tile
            _moe_down_q8_slots_kernel[(T_, triton.cdiv(H, bn))](
                *args, SLOTS=slots, BLOCK_N=bn, KBS=kbs, EMULATE=emulate, PDL=pdl, num_warps=warps,
                **pdl_launch(pdl))
        else:
            _moe_down_q8_kernel[(T_, triton.cdiv(H, bn))](*args, BLOCK_N=bn, KBS=min(MOE_Q8_KBS, _pow2_at_most(nb2)),
                                                           EMULATE=emulate, PDL=pdl, num_warps=4, **pdl_launch(pdl))
    else:
        kbs = _kbs(q2, nb2)
        G, T = tile_shape(q2, kbs)
        _moe_down_kernel[(T_, triton.cdiv(H, bn))](
            h, w2w, ids, wts, y, H, nb2, k, E, h.stride(0), w2w.stride(0), w2w.stride(1), y.stride(0),
            QTYPE=q2, BLOCK_N=bn, KBS=kbs, G=G, T=T, PREFETCH=_prefetch(x.device), num_warps=4)
    return y


def _grouped_moe(x, w13w, w2w, wts, ids, q13, q2, inter):
    """The grouped-by-expert path of :func:`gguf_moe` (weights already as words where the type wants it)."""
    T_, H = x.shape
    E, k = w13w.shape[0], ids.shape[1]
    P = T_ * k
    sorted_pairs, group_expert = expert_groups(ids, E, GROUP_M)
    G = group_expert.shape[0]
    h = x.new_empty((P, inter))
    nb13 = H // BLOCK_SIZES[q13][0]
    bn, kbs = grouped_tile(q13, gate_up=True)
    _grouped_gate_up_kernel[(G, triton.cdiv(inter, bn))](
        x, w13w, sorted_pairs, group_expert, h, inter, nb13, k, P, x.stride(0), w13w.stride(0), w13w.stride(1),
        h.stride(0), QTYPE=q13, BLOCK_M=GROUP_M, BLOCK_N=bn, KBS=min(kbs, _pow2_at_most(nb13)),
        PREFETCH=_prefetch(x.device, grouped=True), num_warps=GROUPED_WARPS)
    out = torch.zeros((P, H), dtype=torch.float32, device=x.device)  # pairs of dropped experts stay 0
    nb2 = inter // BLOCK_SIZES[q2][0]
    bn, kbs = grouped_tile(q2, gate_up=False)
    _grouped_down_kernel[(G, triton.cdiv(H, bn))](
        h, w2w, sorted_pairs, group_expert, wts, out, H, nb2, P, h.stride(0), w2w.stride(0), w2w.stride(1),
        out.stride(0), QTYPE=q2, BLOCK_M=GROUP_M, BLOCK_N=bn, KBS=min(kbs, _pow2_at_most(nb2)),
        PREFETCH=_prefetch(x.device, grouped=True), num_warps=GROUPED_WARPS)
    return out.view(T_, k, H).sum(1).to(x.dtype)

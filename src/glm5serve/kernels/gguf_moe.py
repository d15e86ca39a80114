"""Triton top-k MoE for GGUF-quantized experts at decode batch sizes (no per-expert Python loop).

Two launches:
1. gate+up: one program per (token, slot, BLOCK_N rows of the intermediate) reads expert ``topk_ids[t, s]``'s
   gate and up rows from the 3-D byte tensor ``w13`` (E, 2I, row_bytes) -- gate rows 0..I-1, up rows I..2I-1,
   vLLM's ``w13`` order -- and writes h = silu(gate) * up in fp32.
2. down: one program per (token, BLOCK_N rows of the hidden size) sums ``topk_weights[t, s] * W2[e_s] @ h[t, s]``
   over the token's slots and stores the result in x's dtype: the weighted sum needs no atomics or extra kernel.

Each (token, slot) pair reads its expert's weights itself, so a batch with repeated experts re-reads them
(from L2 when concurrent); for decode batches (<= 16 tokens) that costs less than sorting tokens by expert.
Dequantization and the decode order are those of ``gguf_gemv``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm5serve.kernels.gguf_gemv import (
    BLOCK_SIZES,
    MAX_FAST_M,
    SUPPORTED_QTYPES,
    _as_words,
    _device_sms,
    _pow2_at_most,
    _reduce_acc,
    _rows_dot,
    _zero_acc,
    tile_shape,
)


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, ids_ptr, h_ptr, inter, nb, topk,
                        stride_xm, stride_we, stride_wn, stride_hm,
                        QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, KBS: tl.constexpr,
                        G: tl.constexpr, T: tl.constexpr):
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = (rows < inter) & (e >= 0)  # e < 0: expert not on this rank (expert parallelism)
    base = w_ptr + tl.maximum(e, 0) * stride_we
    x_row = x_ptr + (pair // topk).to(tl.int64) * stride_xm
    gate = _zero_acc(1, BLOCK_N, G, T, False)
    gate = _rows_dot(gate, base + rows.to(tl.int64) * stride_wn, rmask, 0, nb, nb, x_row, stride_xm, 1, 1.0,
                     QTYPE, KBS, 1, False)
    up = _zero_acc(1, BLOCK_N, G, T, False)
    up = _rows_dot(up, base + (rows + inter).to(tl.int64) * stride_wn, rmask, 0, nb, nb, x_row, stride_xm, 1,
                   1.0, QTYPE, KBS, 1, False)
    g = _reduce_acc(gate, False)
    h = g * tl.sigmoid(g) * _reduce_acc(up, False)
    tl.store(h_ptr + pair.to(tl.int64) * stride_hm + rows[None, :], h, mask=(rows < inter)[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, w_ptr, ids_ptr, wts_ptr, y_ptr, hidden, nb, topk,
                     stride_hm, stride_we, stride_wn, stride_ym,
                     QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, KBS: tl.constexpr,
                     G: tl.constexpr, T: tl.constexpr):
    tok = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < hidden
    acc = _zero_acc(1, BLOCK_N, G, T, False)
    for s in range(topk):
        pair = tok * topk + s
        e = tl.load(ids_ptr + pair).to(tl.int64)
        wt = tl.load(wts_ptr + pair).to(tl.float32)
        row_ptr = w_ptr + tl.maximum(e, 0) * stride_we + rows.to(tl.int64) * stride_wn
        # the routing weight scales this slot's activations: sum_s wt_s * (W_s @ h_s) in one accumulator
        acc = _rows_dot(acc, row_ptr, rmask & (e >= 0), 0, nb, nb, h_ptr + pair.to(tl.int64) * stride_hm,
                        stride_hm, 1, wt, QTYPE, KBS, 1, False)
    y = _reduce_acc(acc, False)
    tl.store(y_ptr + tok.to(tl.int64) * stride_ym + rows[None, :], y.to(y_ptr.dtype.element_ty),
             mask=rmask[None, :])


def supports_moe(qtype_w13: int, qtype_w2: int, num_tokens: int, hidden: int, inter: int) -> bool:
    """True where ``gguf_moe`` is meant to be used: supported types, 1..16 tokens, whole quant blocks."""
    q13, q2 = int(qtype_w13), int(qtype_w2)
    return (q13 in SUPPORTED_QTYPES and q2 in SUPPORTED_QTYPES and 1 <= num_tokens <= MAX_FAST_M
            and hidden % BLOCK_SIZES[q13][0] == 0 and inter % BLOCK_SIZES[q2][0] == 0)


def _block_n(row_tiles_of_16: int, items: int, sms: int) -> int:
    """Rows per program: 16, or fewer when that leaves fewer than 4 programs per SM."""
    for bn in (16, 8, 4):
        if items * row_tiles_of_16 * (16 // bn) >= 4 * sms:
            return bn
    return 4


def _kbs(qtype: int, nb: int) -> int:
    return min(2 if BLOCK_SIZES[qtype][0] == 256 else 8, _pow2_at_most(nb))


def gguf_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, qtype_w13: int, qtype_w2: int, activation: str = "silu") -> torch.Tensor:
    """Routed-expert MLP: y[t] = sum_s topk_weights[t, s] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e = topk_ids[t, s].

    Args:
        x: (T, H) bf16/fp16 (fp32 accepted) hidden states.
        w13: (E, 2I, >= row_bytes(H)) uint8 raw GGUF rows; rows 0..I-1 are ``ffn_gate_exps``, I..2I-1
            ``ffn_up_exps`` (vLLM's w13), both of type ``qtype_w13``.
        w2: (E, H, >= row_bytes(I)) uint8 raw GGUF rows of ``ffn_down_exps``, type ``qtype_w2``.
        topk_weights: (T, k) float routing weights (applied to the expert outputs).
        topk_ids: (T, k) int32/int64 expert indices into E; a negative id contributes nothing (expert parallelism).
        qtype_w13, qtype_w2: GGML type ids (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K).
        activation: only "silu" (SwiGLU, GLM-5's ``hidden_act``).
    Returns:
        (T, H) in x's dtype; the intermediate h is kept in fp32.
    Raises:
        ValueError: unsupported type or activation, inconsistent shapes.
    Capture-safe under CUDA graphs (no host synchronisation, allocations through torch).
    """
    q13, q2 = int(qtype_w13), int(qtype_w2)
    if activation != "silu":
        raise ValueError(f"gguf_moe: activation {activation!r} is not supported (only 'silu')")
    for q in (q13, q2):
        if q not in SUPPORTED_QTYPES:
            raise ValueError(f"gguf_moe: unsupported GGML type {q}")
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3 or w13.dtype != torch.uint8 or w2.dtype != torch.uint8:
        raise ValueError(f"gguf_moe: expected x (T, H) and uint8 w13/w2 (E, N, row_bytes), got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)} {w13.dtype}, {tuple(w2.shape)} {w2.dtype}")
    T_, H = x.shape
    E, two_i, _ = w13.shape
    inter = two_i // 2
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != T_:
        raise ValueError(f"gguf_moe: topk_ids {tuple(topk_ids.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} must both be (T={T_}, k)")
    for name, w, q, K, N in (("w13", w13, q13, H, two_i), ("w2", w2, q2, inter, H)):
        qk, qb = BLOCK_SIZES[q]
        if two_i % 2 or K % qk or K // qk * qb > w.shape[2] or w.shape[1] != N or w.shape[0] != E \
                or w.stride(2) != 1:
            raise ValueError(f"gguf_moe: {name} {tuple(w.shape)} does not hold (E={E}, {N}, K={K}) of type {q}")
    k = topk_ids.shape[1]
    if T_ == 0:
        return x.new_empty((0, H))
    x = x.contiguous()
    ids = topk_ids.contiguous()
    wts = topk_weights.contiguous()
    sms = _device_sms(x.device)

    w13w, w2w = _as_words(w13, q13), _as_words(w2, q2)
    h = torch.empty((T_ * k, inter), dtype=torch.float32, device=x.device)
    nb13 = H // BLOCK_SIZES[q13][0]
    bn = _block_n(triton.cdiv(inter, 16), T_ * k, sms)
    kbs = _kbs(q13, nb13)
    G, T = tile_shape(q13, kbs)
    _moe_gate_up_kernel[(T_ * k, triton.cdiv(inter, bn))](
        x, w13w, ids, h, inter, nb13, k, x.stride(0), w13w.stride(0), w13w.stride(1), h.stride(0),
        QTYPE=q13, BLOCK_N=bn, KBS=kbs, G=G, T=T, num_warps=4)

    y = x.new_empty((T_, H))
    nb2 = inter // BLOCK_SIZES[q2][0]
    bn = _block_n(triton.cdiv(H, 16), T_, sms)
    kbs = _kbs(q2, nb2)
    G, T = tile_shape(q2, kbs)
    _moe_down_kernel[(T_, triton.cdiv(H, bn))](
        h, w2w, ids, wts, y, H, nb2, k, h.stride(0), w2w.stride(0), w2w.stride(1), y.stride(0),
        QTYPE=q2, BLOCK_N=bn, KBS=kbs, G=G, T=T, num_warps=4)
    return y

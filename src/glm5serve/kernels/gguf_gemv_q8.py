"""GGUF GEMV with the activations quantized to 8-bit blocks, as llama.cpp's CUDA backend does it (MMVQ:
``quantize_q8_1`` then ``vec_dot_q4_K_q8_1`` / ``vec_dot_q5_K_q8_1`` / ``vec_dot_q6_K_q8_1``,
ggml/src/ggml-cuda/quantize.cu and vecdotq.cuh; vllm-gguf-plugin's ``ggml_mul_mat_vec_a8`` is the same), for Q4_K,
Q5_K and Q6_K; ``pick_config`` chooses it (measured on an H200, see ``gguf_gemv``).  The per-pair MoE
(``gguf_moe``) runs its Q4_K experts on the same one-row step (``quantize_activations``, ``_dot_q4_k_q8``).

Why: the fp32 decode of ``gguf_gemv`` spends ~6-11 SASS instructions per weight, which caps a batch-1 GEMV on an
H200 below half of its memory bandwidth, and its tensor-core path for batches 2-16 pays a layout conversion per
weight tile.  Here the codes stay packed: ``q & 0x0F0F0F0F`` is four Q4_K codes as bytes, and one ``dp4a``
multiplies them with four int8 activations and adds the products (exact integer arithmetic), so the K loop costs
~3 SASS instructions per weight (2.7 measured for sm_90 with 16 weight rows per program, 3.3 with batch 1's 4 rows
and loads one step ahead, ``tests/unit/test_kernels_compile.py``).  The float work
is per (row, 16- or 32-weight sub-block).  From batch 2 a program takes several activation rows (``block_m``, as
MMVQ's ``ncols_y``) and unpacks each weight word once for all of them; a further row then costs ~0.5 instructions
per weight (two dp4a per word), so batch 4 runs in about the time of batch 1.5 (H200, session 7: expert gate/up
11.5 us at batch 4, 8.5 at batch 1, where a program per row took 22.8; session 13, with 8-row tiles at batch 1 and
loads one step ahead at batch 4: 7.6 and 10.5).

Q5_K adds its fifth bit from qh to each code byte.  Q6_K's 210-byte blocks are only 2-byte aligned, so they are
read in pairs (105 int32 words; rows of an even number of blocks): the second block's words are shifted into place
with one PRMT each.  Its codes are unsigned (u = 0..63); the ``- 32`` of each weight enters as the starting value
of each 16-weight dp4a chain, -32 times the integer sum of those 16 activation codes (``quantize_activations(...,
sums16=True)``), so the integer result is llama.cpp's signed-code sum exactly.

Q8_0 was tried with the same pairing (1.1 instructions per weight) and is not used: each thread read the 17 words of
its own block pair, so a warp's loads touched a cache line per lane, and it ran 1.9-2.4x slower than the fp32 decode
(H200, session 11, same run: expert gate/up batch 1 21.9 against 11.7 us, lm_head/8 170 against 72).  A second
layout (session 12) split each pair into 4 groups of 4 consecutive words (plus word 8), one group per thread and
neighbouring groups in neighbouring lanes (the Q6_K scheme), with the activations laid out like the weight bytes
they meet (zero at the scale bytes).  It needs 2.5 / 3.6 SASS instructions per weight at batch 2 / 4, and on the GPU
every config's error stayed below 0.07 times its bound, yet it ran slower than the fp32 path at 11 of 12 points
(same run, best of 4-6 tiles x up to 3 split-K choices / that path, us, batches 1, 2, 4, 8: gate/up 18.0 / 11.5, 18.8 /
17.7, 21.0 / 18.3, 24.3 / 19.8; down 16.7 / 11.6, 17.1 / 17.8, 20.3 / 18.7, 22.9 / 20.2; lm_head/8 124 / 72, 129 /
126, 149 / 133, 175 / 149): each 4-byte load of a warp still spans ~5 cache lines at 16-20 byte strides, and 6 loads
meet each line.  A third layout (session 13) had lanes take consecutive int32 words (128 contiguous bytes per warp
load; word w belongs to block 4w // 34) with the activations quantized into a Q8_0-row layout and one fp32
accumulator per word: 3.6 / 5.0 / 7.0 SASS per weight at batch 1 / 2 / 4 (each row pays its own scale load and
multiply per word), and slower still at all 12 points (best of 5-12 tiles / the fp32 path, us: gate/up 14.6 / 11.5,
22.4 / 17.9, 23.8 / 18.5, 27.5 / 19.9; down 15.1 / 11.9, 22.0 / 18.2, 23.4 / 18.8, 26.9 / 20.1; lm_head/8 98.3 /
72.1, 176.9 / 126.6, 182.5 / 133.5, 207.7 / 150.2).  An earlier Q6_K/Q8_0 version with uint16 code loads and one
program per activation row was slower too (session 7).

The quantizer is a second launch (H200, session 13: 1.4 us of Q4_K gate/up's 8.5 at batch 1, 11.3 at batch 4).
Launching the GEMV with programmatic dependent launch (its programs start during the quantizer, prefetch their
first weights and wait in ``griddepcontrol.wait``) was bit-identical but slower at 9 of 11 shapes (Q4_K gate/up
batch 1 9.7 against 8.5 us, batch 4 11.8 against 11.3).  Quantizing in the GEMV itself would save the launch, but
each program then reduces its x blocks across lanes, x being replicated over the weight rows: 8.7 / 16.1 / 32.8
SASS per weight at batch 2 / 4 / 8 against 3.3 / 4.6 / 6.2 (not timed).

Numerics (llama.cpp's, except the min term): each 32 activations x_i become q_i = round(x_i / d_x), d_x = max|x_i|
/ 127, so |x_i - d_x q_i| <= d_x / 2.  A Q4_K/Q5_K weight is w_i = s_i - m_i with s_i = d * sc * u_i (scaled code)
and m_i = dmin * mn (min term); the min term is multiplied by the exact sum of its 32 activations (llama.cpp uses
d_x * sum q_i), so only the scaled codes see the rounding; a Q6_K weight meets the rounded activations whole.  One
output's error is at most ``sum_i |s_i| * d_x(i) / 2`` plus fp32 rounding (``kernels.testing.q8_activation_bound``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm5serve.kernels.gguf_gemv import (
    BLOCK_SIZES,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_TYPES,
    _NAMES,
    GemvConfig,
    _as_words,
    _check,
    _check_tensors,
    _f16_hi,
    _f16_lo,
    _gdc_launch_dependents,
    _gdc_wait,
    _kquant_scale_min,
    _pdl_prologue,
    _pow2_at_least,
    _prefetch_l2,
    _split_outputs,
    _write_tile,
    pdl_launch,
    pdl_value,
    type_id,
)

QK8 = 32  # activations per int8 block (llama.cpp QK8_1)
Q8_KERNEL_TYPES = Q8_TYPES  # types with an int8-activation step: the set gguf_gemv's pick_config uses
_PAIRED = frozenset({Q6_K})  # 2-byte aligned blocks, read as int32 words two blocks at a time
MAX_BLOCK_M = 8  # activation rows per program; 16 (4 blocks per step spill, 2 do not) tied with the tensor cores


@triton.jit
def _int8_codes(x, amax):
    """Codes floor(x * (127 / amax) + 0.5) as int32 (round half up; llama.cpp's ``quantize_row_q8_1`` in
    ggml-quants.c rounds half away from zero, with an fp16 scale), with |codes| <= 127 (x * 127 / amax rounds to at
    most 127.00001); 0 where amax == 0.  amax broadcasts against x."""
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    return tl.floor(x * inv + 0.5).to(tl.int32)


@triton.jit
def _round_blocks(x):
    """x: fp32 [R, 32], R blocks of 32 values -> (codes int32 [R, 32], d fp32 [R]): d = max|x| / 127, or NaN where
    the block holds a NaN (max|x| skips it, its code is 0: the scale carries it, so that every product with the block
    is NaN, as in the fp32 paths).  A block holding +-inf gets d = inf and codes 0, so its products are NaN where the
    fp32 paths give +-inf: llama.cpp's ``quantize_row_q8_1`` does the same."""
    amax = tl.max(tl.abs(x), axis=1)
    nan = tl.max((x != x).to(tl.int32), axis=1)  # not the sum's NaN: finite +-3e38 can sum to inf - inf
    return _int8_codes(x, amax[:, None]), tl.where(nan > 0, float("nan"), amax / 127.0)


@triton.jit
def _quantize_x_kernel(x_ptr, xq_ptr, xd_ptr, xs_ptr, xi_ptr, K, stride_xm, BLOCKS: tl.constexpr,
                       SUMS16: tl.constexpr = False, PDL: tl.constexpr = False, WHOLE: tl.constexpr = False):
    """Grid (M, column chunks of BLOCKS * 32).  Row m's 32-value block b: codes round(x / d) (int8) at
    xq_ptr[m, 32b:32b+32], d = max|x| / 127 at xd_ptr[m, b] (fp32; NaN where the block holds a NaN, so that every
    product with it is NaN, as in the fp32 paths), the sum of the 32 values at xs_ptr[m, b] (fp32);
    WHOLE: one d per chunk (the maximum over its BLOCKS * 32 values, at xd_ptr[m, chunk]; chunks must be whole);
    SUMS16: also the int32 sums of the codes of each 16 values at xi_ptr[m, 2b], xi_ptr[m, 2b + 1].  PDL (launched
    with programmatic dependent launch): the GEMV behind may start at once; this kernel waits for the one before."""
    if PDL:
        _gdc_launch_dependents()
        _gdc_wait()
    m = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    bmask = b < K // 32
    cols = b[:, None] * 32 + tl.arange(0, 32)[None, :]
    x = tl.load(x_ptr + m * stride_xm + cols, mask=bmask[:, None], other=0.0).to(tl.float32)
    xsum = tl.sum(x, axis=1)
    if WHOLE:  # one d for the whole chunk
        amax = tl.max(tl.max(tl.abs(x), axis=1), axis=0)
        nan = tl.max(tl.max((x != x).to(tl.int32), axis=1), axis=0)
        q = _int8_codes(x, amax)
        tl.store(xd_ptr + m * (K // (32 * BLOCKS)) + tl.program_id(1), tl.where(nan > 0, float("nan"), amax / 127.0))
    else:
        q, d = _round_blocks(x)
        tl.store(xd_ptr + m * (K // 32) + b, d, mask=bmask)
    tl.store(xq_ptr + m * K + cols, q.to(tl.int8), mask=bmask[:, None])
    tl.store(xs_ptr + m * (K // 32) + b, xsum, mask=bmask)
    if SUMS16:
        halves = tl.sum(tl.reshape(q, (BLOCKS * 2, 16)), axis=1)
        h = tl.program_id(1) * BLOCKS * 2 + tl.arange(0, BLOCKS * 2)
        tl.store(xi_ptr + m * (K // 16) + h, halves, mask=h < K // 16)


@triton.jit
def _dp4a(a, b, c, EMULATE: tl.constexpr):
    """c + the sum of the four signed-byte products of int32 words a and b (PTX ``dp4a.s32.s32``); EMULATE: the
    same with shifts, for the Triton interpreter (no inline PTX there)."""
    if EMULATE:
        for i in tl.static_range(4):
            c += ((a << (24 - 8 * i)) >> 24) * ((b << (24 - 8 * i)) >> 24)
        return c
    else:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _kquant_words(row_ptr, rmask, b0, end, KBS: tl.constexpr, FIVE: tl.constexpr = False):
    """The words of KBS Q4_K (36 int32 each) or, FIVE, Q5_K (44) super-blocks from b0 of BLOCK_N rows: with g < 4 KBS
    (super-block kb = b0 + g // 4, qs chunk j = g % 4) and t < 8, header words h0..h3 [BLOCK_N, 4 KBS] (d|dmin, 12
    scale bytes) and qs words q [BLOCK_N, 4 KBS, 8] = word 8j + t of the 32 (``_step_q4_k_q8`` gives their layout);
    for Q5_K also qh = qh word t >> 2j, whose bits 8b and 8b + 1 are the fifth bits of the codes in byte b of q
    (low and high nibble), else qh = q.  Super-blocks from ``end`` (the row's or a split-K range's end) are masked
    off, and bmask [4 KBS] says which are not."""
    WORDS: tl.constexpr = 44 if FIVE else 36
    QS: tl.constexpr = 12 if FIVE else 4
    g = tl.arange(0, 4 * KBS)
    t = tl.arange(0, 8)
    kb = b0 + g // 4
    j = g % 4
    bmask = kb < end
    wmask = rmask[:, None] & bmask[None, :]
    blk = row_ptr[:, None] + kb[None, :] * WORDS
    h0 = tl.load(blk, mask=wmask, other=0)
    h1 = tl.load(blk + 1, mask=wmask, other=0)
    h2 = tl.load(blk + 2, mask=wmask, other=0)
    h3 = tl.load(blk + 3, mask=wmask, other=0)
    q = tl.load(blk[:, :, None] + QS + (j * 8)[None, :, None] + t[None, None, :], mask=wmask[:, :, None], other=0,
                eviction_policy="evict_first")
    qh = q
    if FIVE:
        qh = tl.load(blk[:, :, None] + 4 + t[None, None, :], mask=wmask[:, :, None], other=0,
                     eviction_policy="evict_first") >> (2 * j)[None, :, None]
    return kb, j, t, bmask, h0, h1, h2, h3, q, qh


@triton.jit
def _step_q4_k_q8(acc, row_ptr, rmask, b0, nb, xw_ptr, xd_ptr, xs_ptr, KBS: tl.constexpr, EMULATE: tl.constexpr,
                  FIVE: tl.constexpr = False, SHAPED: tl.constexpr = True):
    """KBS Q4_K (FIVE: Q5_K) super-blocks of BLOCK_N rows against one row of int8 activations; acc: [BLOCK_N,
    4 KBS] fp32; SHAPED as ``_load_q4_k_q8``.

    Word layout as ``gguf_gemv._step_kquant45``: qs word 8j+t holds, in byte b, element 64j + 4t + b (low
    nibble, sub-block 2j) and 64j + 32 + 4t + b (high nibble, sub-block 2j+1), so the codes of a word line up with
    activation word 16j + t (low) / 16j + 8 + t (high) of the super-block's 64 int8-activation words.
    """
    j, h0, h1, h2, h3, q, qh, xlo, xhi, dxl, dxh, sxl, sxh = _load_q4_k_q8(row_ptr, rmask, b0, nb, xw_ptr, xd_ptr,
                                                                          xs_ptr, KBS, FIVE, SHAPED)
    return _math_q4_k_q8(acc, j, h0, h1, h2, h3, q, qh, xlo, xhi, dxl, dxh, sxl, sxh, FIVE, EMULATE)


@triton.jit
def _load_q4_k_q8(row_ptr, rmask, b0, end, xw_ptr, xd_ptr, xs_ptr, KBS: tl.constexpr, FIVE: tl.constexpr = False,
                  SHAPED: tl.constexpr = True):
    """The loads of ``_step_q4_k_q8`` (super-blocks b0 .. b0 + KBS - 1, those from ``end`` masked off): qs chunk
    index j, header words, qs words q [BN, 4 KBS, 8], qh (``_kquant_words``), activation words (low, high), scales
    and block sums.  SHAPED: each of these shaped like q or its word sums [BN, 4 KBS], the activations repeated
    over the rows (each lane loads the words its own codes meet, from L1); else loaded once, [1, 4 KBS, 8] and
    [1, 4 KBS], and broadcast.  Why: Triton gives a load the layout of its shape, and broadcast activations were
    converted, with the scales, through shared memory on every K step (Triton 3.8 at one row: Q4_K 12 BAR.SYNC in
    the loop, Q5_K 20-24; shaped: 4).  The MoE keeps the broadcast (H200, session 22, same run, us, broadcast /
    shaped: TP=8 slices, 1 token 23.9 / 26.9, 4 tokens 57.0 / 53.6; whole experts 83.3 / 81.6, 305 / 310)."""
    kb, j, t, bmask, h0, h1, h2, h3, q, qh = _kquant_words(row_ptr, rmask, b0, end, KBS, FIVE)
    if SHAPED:
        rep = tl.zeros([row_ptr.shape[0], 1, 1], dtype=tl.int32)
        xo = rep + (kb * 64 + j * 16)[None, :, None] + t[None, None, :]
        xlo = tl.load(xw_ptr + xo, mask=bmask[None, :, None], other=0)
        xhi = tl.load(xw_ptr + xo + 8, mask=bmask[None, :, None], other=0)
        sb = tl.sum(rep, axis=2) + (kb * 8 + 2 * j)[None, :]  # sub-block 2j of the row's activation blocks
        smask = bmask[None, :]
    else:
        xo = (kb * 64 + j * 16)[:, None] + t[None, :]
        xlo = tl.load(xw_ptr + xo, mask=bmask[:, None], other=0)[None, :, :]
        xhi = tl.load(xw_ptr + xo + 8, mask=bmask[:, None], other=0)[None, :, :]
        sb = kb * 8 + 2 * j
        smask = bmask
    dx_lo = tl.load(xd_ptr + sb, mask=smask, other=0.0)
    dx_hi = tl.load(xd_ptr + sb + 1, mask=smask, other=0.0)
    sx_lo = tl.load(xs_ptr + sb, mask=smask, other=0.0)
    sx_hi = tl.load(xs_ptr + sb + 1, mask=smask, other=0.0)
    if not SHAPED:
        dx_lo, dx_hi, sx_lo, sx_hi = dx_lo[None, :], dx_hi[None, :], sx_lo[None, :], sx_hi[None, :]
    return j, h0, h1, h2, h3, q, qh, xlo, xhi, dx_lo, dx_hi, sx_lo, sx_hi


@triton.jit
def _math_q4_k_q8(acc, j, h0, h1, h2, h3, q, qh, xlo, xhi, dx_lo, dx_hi, sx_lo, sx_hi, FIVE: tl.constexpr,
                  EMULATE: tl.constexpr):
    """The arithmetic of ``_step_q4_k_q8`` on the values ``_load_q4_k_q8`` returns (FIVE: Q5_K, its fifth code bit
    from qh to bit 4 of each code byte, as ``_math_kquant_q8_rows``)."""
    zero = tl.zeros(q.shape, dtype=tl.int32)
    clo = q & 0x0F0F0F0F
    chi = (q >> 4) & 0x0F0F0F0F
    if FIVE:
        clo = clo | ((qh << 4) & 0x10101010)
        chi = chi | ((qh << 3) & 0x10101010)
    dlo = tl.sum(_dp4a(clo, tl.broadcast_to(xlo, q.shape), zero, EMULATE), axis=2)
    dhi = tl.sum(_dp4a(chi, tl.broadcast_to(xhi, q.shape), zero, EMULATE), axis=2)
    sc0, mn0 = _kquant_scale_min(h1, h2, h3, 2 * j)
    sc1, mn1 = _kquant_scale_min(h1, h2, h3, 2 * j + 1)
    # weight = d * sc * u - dmin * mn (gguf-py Q4_K.dequantize_blocks); sum_i w_i x_i per sub-block
    return acc + _f16_lo(h0) * (sc0 * dx_lo * dlo.to(tl.float32) + sc1 * dx_hi * dhi.to(tl.float32)
                                ) - _f16_hi(h0) * (mn0 * sx_lo + mn1 * sx_hi)


@triton.jit
def _dot_q4_k_q8(row_ptr, rmask, blk_begin, blk_end, nb, xw_ptr, xd_ptr, xs_ptr, BLOCK_N: tl.constexpr,
                 KBS: tl.constexpr, PREFETCH: tl.constexpr, EMULATE: tl.constexpr, AHEAD: tl.constexpr = False,
                 FIVE: tl.constexpr = False, SHAPED: tl.constexpr = True):
    """Super-blocks blk_begin..blk_end-1 of BLOCK_N Q4_K (FIVE: Q5_K) rows (``row_ptr``: int32 word pointers, nb
    super-blocks per row) dotted with one row of int8 activations (``xw_ptr``/``xd_ptr``/``xs_ptr``: that row's
    codes as words, scales, block sums) -> [BLOCK_N] fp32; PREFETCH steps of L2 prefetch ahead (0: none).  AHEAD:
    each step's loads are issued one step ahead, into registers (two steps of weights in flight per program).
    SHAPED: activations loaded in the code words' shape (``_load_q4_k_q8``)."""
    QT: tl.constexpr = 13 if FIVE else 12
    for d in tl.static_range(1, PREFETCH):
        _prefetch_l2(row_ptr, rmask, blk_begin + d * KBS, blk_end, QT, KBS)
    acc = tl.zeros([BLOCK_N, 4 * KBS], dtype=tl.float32)
    if AHEAD:
        j, h0, h1, h2, h3, q, qh, xl, xh, dl, dh, sl, sh = _load_q4_k_q8(row_ptr, rmask, blk_begin, blk_end, xw_ptr,
                                                                         xd_ptr, xs_ptr, KBS, FIVE, SHAPED)
        for b0 in range(blk_begin, blk_end, KBS):
            if PREFETCH > 0:
                _prefetch_l2(row_ptr, rmask, b0 + PREFETCH * KBS, blk_end, QT, KBS)
            nj, n0, n1, n2, n3, nq, nqh, nxl, nxh, ndl, ndh, nsl, nsh = _load_q4_k_q8(
                row_ptr, rmask, b0 + KBS, blk_end, xw_ptr, xd_ptr, xs_ptr, KBS, FIVE, SHAPED)
            acc = _math_q4_k_q8(acc, j, h0, h1, h2, h3, q, qh, xl, xh, dl, dh, sl, sh, FIVE, EMULATE)
            j, h0, h1, h2, h3, q, qh, xl, xh, dl, dh, sl, sh = nj, n0, n1, n2, n3, nq, nqh, nxl, nxh, ndl, ndh, nsl, nsh
        return tl.sum(acc, axis=1)
    for b0 in range(blk_begin, blk_end, KBS):
        if PREFETCH > 0:
            _prefetch_l2(row_ptr, rmask, b0 + PREFETCH * KBS, blk_end, QT, KBS)
        acc = _step_q4_k_q8(acc, row_ptr, rmask, b0, nb, xw_ptr, xd_ptr, xs_ptr, KBS, EMULATE, FIVE, SHAPED)
    return tl.sum(acc, axis=1)


@triton.jit
def _split8(v, A: tl.constexpr, B: tl.constexpr):
    """The 8 slices [A, B] of v [A, B, 8] along its last axis, in the order t = 0, 4, 2, 6, 1, 5, 3, 7 (tl.split
    keeps each in the thread that holds it: no shuffles)."""
    e, o = tl.split(tl.reshape(v, (A, B, 4, 2)))
    ee, eo = tl.split(tl.reshape(e, (A, B, 2, 2)))
    oe, oo = tl.split(tl.reshape(o, (A, B, 2, 2)))
    a0, a1 = tl.split(ee)
    b0, b1 = tl.split(eo)
    c0, c1 = tl.split(oe)
    d0, d1 = tl.split(oo)
    return a0, a1, b0, b1, c0, c1, d0, d1


@triton.jit
def _step_kquant_q8_rows(acc, row_ptr, rmask, b0, nb, xw_ptr, xd_ptr, xs_ptr, mrow, mmask, KBS: tl.constexpr,
                         FIVE: tl.constexpr, EMULATE: tl.constexpr):
    """``_step_q4_k_q8`` for BLOCK_M activation rows ``mrow`` at once (FIVE: Q5_K, whose fifth code bit from qh
    goes to bit 4 of each code byte); acc: [BLOCK_M, BLOCK_N, 4 KBS] fp32.  Each weight word is loaded and unpacked
    once for all rows; per row it costs two dp4a, chained over the 8 words of a sub-block (llama.cpp's MMVQ handles
    several columns of x the same way, ``ncols_y``).  Integer sums are exact, so per output this is the one-row
    step's arithmetic up to the order of the final fp32 sum over sub-blocks."""
    j, h0, h1, h2, h3, q, qh, xl, xh, dl, dh, sl, sh = _load_kquant_q8_rows(row_ptr, rmask, b0, nb, nb, xw_ptr, xd_ptr,
                                                                            xs_ptr, mrow, mmask, KBS, FIVE)
    return _math_kquant_q8_rows(acc, j, h0, h1, h2, h3, q, qh, xl, xh, dl, dh, sl, sh, FIVE, EMULATE)


@triton.jit
def _load_kquant_q8_rows(row_ptr, rmask, b0, end, nb, xw_ptr, xd_ptr, xs_ptr, mrow, mmask, KBS: tl.constexpr,
                         FIVE: tl.constexpr):
    """The loads of ``_step_kquant_q8_rows`` (super-blocks from ``end`` masked off)."""
    kb, j, t, bmask, h0, h1, h2, h3, q, qh = _kquant_words(row_ptr, rmask, b0, end, KBS, FIVE)
    xo = (mrow * nb * 64)[:, None, None] + ((kb * 64 + j * 16)[:, None] + t[None, :])[None, :, :]
    xmask = mmask[:, None, None] & bmask[None, :, None]
    xlw = tl.load(xw_ptr + xo, mask=xmask, other=0)
    xhw = tl.load(xw_ptr + xo + 8, mask=xmask, other=0)
    sb = (mrow * nb * 8)[:, None] + (kb * 8 + 2 * j)[None, :]  # [BM, G]: sub-block 2j of each row
    smask = mmask[:, None] & bmask[None, :]
    dx_lo = tl.load(xd_ptr + sb, mask=smask, other=0.0)
    dx_hi = tl.load(xd_ptr + sb + 1, mask=smask, other=0.0)
    sx_lo = tl.load(xs_ptr + sb, mask=smask, other=0.0)
    sx_hi = tl.load(xs_ptr + sb + 1, mask=smask, other=0.0)
    return j, h0, h1, h2, h3, q, qh, xlw, xhw, dx_lo, dx_hi, sx_lo, sx_hi


@triton.jit
def _math_kquant_q8_rows(acc, j, h0, h1, h2, h3, q, qh, xlw, xhw, dx_lo, dx_hi, sx_lo, sx_hi, FIVE: tl.constexpr,
                         EMULATE: tl.constexpr):
    """The arithmetic of ``_step_kquant_q8_rows`` on the values ``_load_kquant_q8_rows`` returns."""
    BM: tl.constexpr = xlw.shape[0]
    BN: tl.constexpr = q.shape[0]
    G: tl.constexpr = q.shape[1]
    qw = _split8(q, BN, G)
    hw = _split8(qh, BN, G)
    xl = _split8(xlw, BM, G)
    xh = _split8(xhw, BM, G)
    dlo = tl.zeros((BM, BN, G), dtype=tl.int32)
    dhi = tl.zeros((BM, BN, G), dtype=tl.int32)
    for i in tl.static_range(8):
        clo = qw[i] & 0x0F0F0F0F
        chi = (qw[i] >> 4) & 0x0F0F0F0F
        if FIVE:
            clo = clo | ((hw[i] << 4) & 0x10101010)
            chi = chi | ((hw[i] << 3) & 0x10101010)
        lo = tl.broadcast_to(clo[None, :, :], (BM, BN, G))
        hi = tl.broadcast_to(chi[None, :, :], (BM, BN, G))
        dlo = _dp4a(lo, tl.broadcast_to(xl[i][:, None, :], (BM, BN, G)), dlo, EMULATE)
        dhi = _dp4a(hi, tl.broadcast_to(xh[i][:, None, :], (BM, BN, G)), dhi, EMULATE)
    dx_lo, dx_hi = dx_lo[:, None, :], dx_hi[:, None, :]
    sx_lo, sx_hi = sx_lo[:, None, :], sx_hi[:, None, :]
    sc0, mn0 = _kquant_scale_min(h1, h2, h3, 2 * j)
    sc1, mn1 = _kquant_scale_min(h1, h2, h3, 2 * j + 1)
    return acc + _f16_lo(h0)[None, :, :] * (sc0[None, :, :] * dx_lo * dlo.to(tl.float32)
                                            + sc1[None, :, :] * dx_hi * dhi.to(tl.float32)) - _f16_hi(h0)[None, :, :] * (
        mn0[None, :, :] * sx_lo + mn1[None, :, :] * sx_hi)


@triton.jit
def _word_at2(a, b, EMULATE: tl.constexpr):
    """The int32 word that starts 2 bytes into word a (bytes 2, 3 of a, then 0, 1 of b): one PRMT."""
    if EMULATE:
        return ((a >> 16) & 0xFFFF) | (b << 16)
    else:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, 0x5432;", "=r,r,r", [a, b], dtype=tl.int32,
                                         is_pure=True, pack=1)


@triton.jit
def _words4(ptr, MIS: tl.constexpr, EMULATE: tl.constexpr):
    """Four consecutive int32 words from ``ptr`` (int32 pointers, in bounds: no mask), or with MIS from 2 bytes past
    it (read as five aligned words and shifted together)."""
    w0 = tl.load(ptr)
    w1 = tl.load(ptr + 1)
    w2 = tl.load(ptr + 2)
    w3 = tl.load(ptr + 3)
    if MIS:
        w4 = tl.load(ptr + 4)
        return (_word_at2(w0, w1, EMULATE), _word_at2(w1, w2, EMULATE), _word_at2(w2, w3, EMULATE),
                _word_at2(w3, w4, EMULATE))
    else:
        return w0, w1, w2, w3


@triton.jit
def _dp4a_rows(w, xw_ptr, xo, xmask, acc, EMULATE: tl.constexpr):
    """acc [BM, BN, G] + dp4a of the code words w [BN, G] with the activation words at xw_ptr + xo ([BM, 1, G])."""
    shape: tl.constexpr = acc.shape
    return _dp4a(tl.broadcast_to(w[None, :, :], shape),
                 tl.broadcast_to(tl.load(xw_ptr + xo, mask=xmask, other=0), shape), acc, EMULATE)


@triton.jit
def _q6_k_word_q8(ql, qh, xw_ptr, xo, xmask, dot0, dot1, EMULATE: tl.constexpr):
    """Code words of sub-blocks c2 (low nibbles, qh bits 0-1 of each byte) and c2 + 2 (high nibbles, qh bits 4-5)
    dotted into their chains; qh already shifted right by 2 c2."""
    code0 = (ql & 0x0F0F0F0F) | ((qh << 4) & 0x30303030)
    code1 = ((ql >> 4) & 0x0F0F0F0F) | (qh & 0x30303030)
    return (_dp4a_rows(code0, xw_ptr, xo, xmask, dot0, EMULATE),
            _dp4a_rows(code1, xw_ptr, xo + 16, xmask, dot1, EMULATE))


@triton.jit
def _q6_k_block_q8(acc, pw, h, c2, s, xw_ptr, xd_ptr, xi_ptr, xo, so, do, xmask, MIS: tl.constexpr,
                   EMULATE: tl.constexpr):
    """One Q6_K block of a pair (``_step_q6_k_q8_rows``): pw its int32 word pointers ([BN, G]; the block starts MIS
    (0 or 2) bytes into the word at pw), h, c2, s its groups' indices ([1, G]), xo / so / do
    ([BM, 1, G]) its activation word, 16-value code sum and activation block offsets."""
    shape: tl.constexpr = acc.shape
    dot0 = tl.broadcast_to(-32 * tl.load(xi_ptr + so, mask=xmask, other=0), shape)  # sub-block c = c2
    dot1 = tl.broadcast_to(-32 * tl.load(xi_ptr + so + 4, mask=xmask, other=0), shape)  # c = c2 + 2
    ql0, ql1, ql2, ql3 = _words4(pw + (16 * h + 8 * c2 + 4 * s), MIS, EMULATE)
    qh0, qh1, qh2, qh3 = _words4(pw + (32 + 8 * h + 4 * s), MIS, EMULATE)
    sh = 2 * c2
    dot0, dot1 = _q6_k_word_q8(ql0, qh0 >> sh, xw_ptr, xo, xmask, dot0, dot1, EMULATE)
    dot0, dot1 = _q6_k_word_q8(ql1, qh1 >> sh, xw_ptr, xo + 1, xmask, dot0, dot1, EMULATE)
    dot0, dot1 = _q6_k_word_q8(ql2, qh2 >> sh, xw_ptr, xo + 2, xmask, dot0, dot1, EMULATE)
    dot0, dot1 = _q6_k_word_q8(ql3, qh3 >> sh, xw_ptr, xo + 3, xmask, dot0, dot1, EMULATE)
    # d: bytes 208-209, the low (MIS: high) half of word 52; int8 scales[8h + 2c + s]: word 48 + 2h (+ 1 for
    # c2 + 2), byte 2 c2 + s (MIS: 2 bytes further, the next word for 2 c2 + s >= 2)
    dw = tl.load(pw + 52)
    if MIS:
        d = _f16_hi(dw)
    else:
        d = _f16_lo(dw)
    sb = 2 * c2 + s + MIS
    scw = pw + 48 + 2 * h + sb // 4
    byte = 24 - 8 * (sb % 4)
    a0 = d * ((tl.load(scw) << byte) >> 24).to(tl.float32)
    a1 = d * ((tl.load(scw + 1) << byte) >> 24).to(tl.float32)
    dx0 = tl.load(xd_ptr + do, mask=xmask, other=0.0)
    dx1 = tl.load(xd_ptr + do + 2, mask=xmask, other=0.0)
    return acc + a0[None, :, :] * dx0 * dot0.to(tl.float32) + a1[None, :, :] * dx1 * dot1.to(tl.float32)


@triton.jit
def _step_q6_k_q8_rows(acc, row_ptr, b0, nb, xw_ptr, xd_ptr, xi_ptr, mrow, mmask, KBS: tl.constexpr,
                       EMULATE: tl.constexpr):
    """KBS Q6_K super-blocks (210 bytes, layout in ``gguf_gemv._step_q6_k``) of BLOCK_N rows against BLOCK_M rows of
    int8 activations; acc: [BLOCK_M, BLOCK_N, 4 KBS] fp32.  ``row_ptr``: int32 word pointers; b0 and nb even.

    Blocks are taken in pairs (105 words): the first is word aligned, the second starts 2 bytes into word 52, so
    its words are formed with one PRMT each (``_words4``).  Group g = (pair, h, c2, s) holds, in each block, the
    elements 128h + 32c + 16s + i (i < 16) of sub-blocks c = c2 and c2 + 2, which share their ql bytes (low and high
    nibble) and qh bytes (bits 2c): code word t (i = 4t..4t+3) is ``ql & 0x0F0F0F0F | qh << 4 & 0x30303030`` with
    qh shifted by 2 c2, the unsigned 6-bit codes u.  The weight is d * scale * (u - 32): each chain of 4 dp4a starts
    at -32 times the sum of its 16 activation codes (``xi_ptr``, ``quantize_activations(..., sums16=True)``), so
    the integer sum is exactly sum (u - 32) q_x, as llama.cpp's ``vec_dot_q6_K_q8_1`` computes it."""
    G: tl.constexpr = 4 * KBS
    g = tl.arange(0, G)
    pair = b0 // 2 + g // 8
    h = ((g // 4) % 2)[None, :]
    c2 = ((g // 2) % 2)[None, :]
    s = (g % 2)[None, :]
    bmask = 2 * pair < nb
    pw = row_ptr[:, None] + tl.minimum(pair, nb // 2 - 1)[None, :].to(tl.int64) * 105  # clamped (``_gemv_q8_kernel``)
    xmask = mmask[:, None, None] & bmask[None, None, :]
    kb = 2 * pair[None, None, :]
    xo = (mrow * nb * 64)[:, None, None] + kb * 64 + (32 * h + 8 * c2 + 4 * s)[None, :, :]  # activation words
    so = (mrow * nb * 16)[:, None, None] + kb * 16 + (8 * h + 2 * c2 + s)[None, :, :]  # 16-value code sums
    do = (mrow * nb * 8)[:, None, None] + kb * 8 + (4 * h + c2)[None, :, :]  # activation blocks
    acc = _q6_k_block_q8(acc, pw, h, c2, s, xw_ptr, xd_ptr, xi_ptr, xo, so, do, xmask, 0, EMULATE)
    return _q6_k_block_q8(acc, pw + 52, h, c2, s, xw_ptr, xd_ptr, xi_ptr, xo + 64, so + 16, do + 8,
                          xmask, 2, EMULATE)


@triton.jit
def _step_q8_rows(acc, row_ptr, rmask, b0, nb, xw_ptr, xd_ptr, xs_ptr, xi_ptr, mrow, mmask, QTYPE: tl.constexpr,
                  KBS: tl.constexpr, EMULATE: tl.constexpr):
    """One K step of the int8-activation kernel for any of its types (Q4_K 12, Q5_K 13, Q6_K 14)."""
    if QTYPE == 14:
        acc = _step_q6_k_q8_rows(acc, row_ptr, b0, nb, xw_ptr, xd_ptr, xi_ptr, mrow, mmask, KBS, EMULATE)
    else:
        acc = _step_kquant_q8_rows(acc, row_ptr, rmask, b0, nb, xw_ptr, xd_ptr, xs_ptr, mrow, mmask, KBS,
                                   QTYPE == 13, EMULATE)
    return acc


@triton.jit
def _gemv_q8_kernel(xw_ptr, xd_ptr, xs_ptr, xi_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, nb, blocks_per_split,
                    stride_wn, stride_ym, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    KBS: tl.constexpr, SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr, EMULATE: tl.constexpr,
                    AHEAD: tl.constexpr = False, PDL: tl.constexpr = 0):
    """Grid (N tiles, SPLIT_K, M tiles of BLOCK_M activation rows); split-K as ``gguf_gemv._gemv_kernel``.  w_ptr:
    int32 words (Q6_K: rows of an even number of blocks); nb blocks per row.  Q4_K and Q5_K at BLOCK_M = 1 take the
    one-row step (faster there: H200 Q4_K lm_head/8 37.4 against 46.5 us for the rows step at one row; session 22,
    same run, Q5_K at pick_config's tiles, us: expert gate/up 6.15 against 7.81, down 6.63 against 8.07, lm_head/8
    37.0 against 50.7).  AHEAD (Q4_K, Q5_K): each step's loads are issued one step ahead, into registers.  PDL:
    ``gguf_gemv._pdl_prologue``."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    if QTYPE == 14:
        # the paired step loads without masks (a masked load costs a zero fill): rows past N read row N - 1 and
        # blocks past nb the last pair; their products meet activation scales loaded as 0 or are not stored
        row_ptr = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * stride_wn
    else:
        row_ptr = w_ptr + rows.to(tl.int64) * stride_wn
    blk_begin = pid_k * blocks_per_split
    blk_end = tl.minimum(blk_begin + blocks_per_split, nb)
    _pdl_prologue(row_ptr, rmask, blk_begin, blk_end, QTYPE, KBS, PDL)
    if BLOCK_M == 1 and QTYPE != 14:
        m = pid_m.to(tl.int64)
        y = _dot_q4_k_q8(row_ptr, rmask, blk_begin, blk_end, nb, xw_ptr + m * nb * 64, xd_ptr + m * nb * 8,
                         xs_ptr + m * nb * 8, BLOCK_N, KBS, PREFETCH, EMULATE, AHEAD, QTYPE == 13)[None, :]
    elif AHEAD and QTYPE != 14:
        for d in tl.static_range(1, PREFETCH):
            _prefetch_l2(row_ptr, rmask, blk_begin + d * KBS, blk_end, QTYPE, KBS)
        mrow = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mmask = mrow < M
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, 4 * KBS], dtype=tl.float32)
        j, h0, h1, h2, h3, q, qh, xl, xh, dl, dh, sl, sh = _load_kquant_q8_rows(
            row_ptr, rmask, blk_begin, blk_end, nb, xw_ptr, xd_ptr, xs_ptr, mrow, mmask, KBS, QTYPE == 13)
        for b0 in range(blk_begin, blk_end, KBS):
            if PREFETCH > 0:
                _prefetch_l2(row_ptr, rmask, b0 + PREFETCH * KBS, blk_end, QTYPE, KBS)
            nj, n0, n1, n2, n3, nq, nqh, nxl, nxh, ndl, ndh, nsl, nsh = _load_kquant_q8_rows(
                row_ptr, rmask, b0 + KBS, blk_end, nb, xw_ptr, xd_ptr, xs_ptr, mrow, mmask, KBS, QTYPE == 13)
            acc3 = _math_kquant_q8_rows(acc3, j, h0, h1, h2, h3, q, qh, xl, xh, dl, dh, sl, sh, QTYPE == 13, EMULATE)
            j, h0, h1, h2, h3, q, qh, xl, xh, dl, dh, sl, sh = nj, n0, n1, n2, n3, nq, nqh, nxl, nxh, ndl, ndh, nsl, nsh
        y = tl.sum(acc3, axis=2)
    else:
        for d in tl.static_range(1, PREFETCH):
            _prefetch_l2(row_ptr, rmask, blk_begin + d * KBS, blk_end, QTYPE, KBS)
        mrow = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = mrow < M
        G: tl.constexpr = 4 * KBS
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, G], dtype=tl.float32)
        for b0 in range(blk_begin, blk_end, KBS):
            if PREFETCH > 0:
                _prefetch_l2(row_ptr, rmask, b0 + PREFETCH * KBS, blk_end, QTYPE, KBS)
            acc3 = _step_q8_rows(acc3, row_ptr, rmask, b0, nb, xw_ptr, xd_ptr, xs_ptr, xi_ptr, mrow.to(tl.int64),
                                 mmask, QTYPE, KBS, EMULATE)
        y = tl.sum(acc3, axis=2)
    _write_tile(y, y_ptr, part_ptr, count_ptr, M, N, rows, rmask, stride_ym, pid_n, pid_k, pid_m, BLOCK_M, SPLIT_K)


def quantize_activations(x: torch.Tensor, sums16: bool = False, pdl: bool = False, scale_block: int = QK8):
    """x (M, K) bf16/fp16/fp32, K a multiple of 32 -> (int8 codes (M, K), fp32 scales d (M, K/32), fp32 exact block
    sums (M, K/32)); x[m, 32b + i] ~= d[m, b] * codes[m, 32b + i] with error <= d[m, b] / 2 (llama.cpp's
    ``quantize_q8_1`` blocks, rounding half up).  ``scale_block=256``: one scale per 256 values, d (M, K/256) (llama.cpp's
    ``Q8_K`` blocks; K a multiple of 256), the sums still per 32.  ``sums16``: a fourth tensor, int32 (M, K/16), the
    sum of the codes of each 16 consecutive values (Q6_K's ``- 32`` offset per 16-weight sub-block).  ``pdl``:
    launched with programmatic dependent launch (where ``pdl_value`` allows it), for a GEMV that itself waits in
    ``_gdc_wait``.  x's row stride is free; other column strides are copied to unit stride first.

    Raises:
        ValueError: x not 2-D or not bf16/fp16/fp32; scale_block not 32 or 256; K not a multiple of it.
    """
    _check_tensors("quantize_activations", x=x)
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"quantize_activations: expected x (M, K) bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    M, K = x.shape
    if x.stride(1) != 1:  # the kernel reads each row's values side by side
        x = x.contiguous()
    if scale_block not in (QK8, 8 * QK8):
        raise ValueError(f"quantize_activations: scale_block={scale_block!r} must be 32 or 256")
    if K % scale_block:
        raise ValueError(f"quantize_activations: K={K} is not a multiple of scale_block={scale_block}")
    xq = torch.empty((M, K), dtype=torch.int8, device=x.device)
    xd = torch.empty((M, K // scale_block), dtype=torch.float32, device=x.device)
    xs = torch.empty((M, K // QK8), dtype=torch.float32, device=x.device)
    xi = torch.empty((M, K // 16), dtype=torch.int32, device=x.device) if sums16 else xd
    blocks = 8
    if M and K:
        pdl = bool(pdl and pdl_value(x.device, 0))
        _quantize_x_kernel[(M, triton.cdiv(K // QK8, blocks))](x, xq, xd, xs, xi, K, x.stride(0), BLOCKS=blocks,
                                                                 SUMS16=sums16, PDL=pdl, WHOLE=scale_block != QK8,
                                                                 num_warps=4, **pdl_launch(pdl))
    return (xq, xd, xs, xi) if sums16 else (xq, xd, xs)


def gguf_linear_q8(x: torch.Tensor, qweight: torch.Tensor, qtype: int, N: int, block_n: int = 16, kbs: int = 2,
                   split_k: int = 1, num_warps: int = 4, prefetch: int = 0, dp4a: bool = True,
                   block_m: int | None = None, ahead: bool = False) -> torch.Tensor:
    """y = x @ dequantize(qweight)[:N].T with x quantized to int8 blocks of 32 (see the module docstring).

    Args:
        x: (M, K) bf16/fp16/fp32 activations (row stride free, unit column stride).
        qweight: (>= N, >= row_bytes) uint8 raw GGUF rows of a type in ``Q8_KERNEL_TYPES`` (row_bytes = K / block
            elements * block bytes).
        qtype: GGML type id: Q4_K, Q5_K or Q6_K.
        N: output features; block_n, kbs, split_k, num_warps, prefetch: launch parameters as ``GemvConfig``.
        block_m: activation rows per program, a power of two up to ``MAX_BLOCK_M`` (None: the next power of two
            >= M, at most ``MAX_BLOCK_M``): each program unpacks its weight tile once for that many rows.
        dp4a: False computes the same integer dot products with shifts and multiplies (always so under the
            Triton interpreter, which has no inline PTX); the results are bit-identical.
        ahead: Q4_K and Q5_K: issue each K step's loads one step ahead, into registers; bit-identical results.
    Returns:
        (M, N) in x's dtype, accumulated in fp32.
    Raises:
        ValueError: another type, x or qweight not as above (``gguf_gemv._check``), launch parameters that
            ``GemvConfig`` refuses, a block_m that is not a power of two up to 8, or for Q6_K an odd number of
            blocks per row or an odd kbs.
    Capture-safe under CUDA graphs (two launches, no host synchronisation).
    """
    qtype = type_id(qtype, "gguf_linear_q8")
    if qtype not in Q8_KERNEL_TYPES:
        raise ValueError(f"gguf_linear_q8: {_NAMES.get(qtype, f'type {qtype}')} has no int8-activation kernel "
                         f"(supported: {', '.join(_NAMES[q] for q in sorted(Q8_KERNEL_TYPES))})")
    K, N = _check(x, qweight, qtype, N, "gguf_linear_q8"), int(N)
    M = x.shape[0]
    qk = BLOCK_SIZES[qtype][0]
    GemvConfig(block_n=block_n, kbs=kbs, split_k=split_k, num_warps=num_warps, prefetch=prefetch)  # checks them
    if qtype in _PAIRED and (K // qk % 2 or kbs % 2):
        raise ValueError(f"gguf_linear_q8: {_NAMES[qtype]} is read in pairs of blocks: K={K} must hold an even number "
                         f"of blocks and kbs={kbs} be even")
    if block_m is None:
        block_m = min(MAX_BLOCK_M, _pow2_at_least(M))
    if type(block_m) is not int or block_m & (block_m - 1) or not 1 <= block_m <= MAX_BLOCK_M:
        raise ValueError(f"gguf_linear_q8: block_m={block_m!r} must be an int, a power of two up to {MAX_BLOCK_M}")
    if M == 0 or N == 0 or K == 0:
        return x.new_zeros((M, N))
    if x.stride(1) != 1:
        x = x.contiguous()
    nb = K // qk
    blocks_per_split = triton.cdiv(triton.cdiv(nb, split_k), kbs) * kbs
    pdl = pdl_value(x.device, blocks_per_split // kbs)
    # before the quantizer, so that a copy of a misaligned weight does not sit between it and the GEMV (PDL)
    w = _as_words(qweight, qtype, unit=4)
    xq, xd, xs, *xi = quantize_activations(x, sums16=qtype == Q6_K, pdl=bool(pdl))
    split = triton.cdiv(nb, blocks_per_split)
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, block_m))
    y, part, counters = _split_outputs(x, N, grid, block_m)
    emulate = x.device.type != "cuda" or not dp4a
    _gemv_q8_kernel[grid](xq.view(torch.int32), xd, xs, xi[0] if xi else xd, w, y, part, counters, M, N, nb,
                          blocks_per_split, w.stride(0), y.stride(0), QTYPE=qtype, BLOCK_M=block_m,
                          BLOCK_N=block_n, KBS=kbs, SPLIT_K=split, PREFETCH=prefetch if x.device.type == "cuda" else 0,
                          EMULATE=emulate, AHEAD=ahead and qtype in (Q4_K, Q5_K), PDL=pdl, num_warps=num_warps,
                          **pdl_launch(pdl))
    return y

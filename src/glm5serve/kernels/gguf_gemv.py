"""Triton GEMV for GGUF-quantized weights: y = x @ dequant(W).T for decode batches (M = 1..256).

The weight stays the raw GGUF byte tensor, ``(N, row_bytes)`` uint8, as vllm-gguf-plugin stores ``qweight``;
each program dequantizes a tile of ``BLOCK_N`` rows in registers and multiplies it with the activations.
Block layouts follow gguf-py ``gguf/quants.py`` (``dequantize_blocks``), which is bit-exact with llama.cpp's
``dequantize_row_*`` in ``ggml/src/ggml-quants.c``.

Speed comes from four choices (a decode GEMV is bound by HBM bandwidth, and on Hopper a naive dequantizer is
bound by its instruction count before it reaches that bandwidth):
- Enough programs: ``BLOCK_N`` rows per program and split-K over a second grid axis so that every SM has
  several programs streaming weight bytes, whatever the shape.  Split-K stays one launch (no memset, no cast
  kernel: under CUDA graphs each extra node costs about as much as a small GEMV): each program writes its fp32
  partial tile, bumps a per-tile counter, and the last to arrive sums the partials in split order
  (deterministic), writes the output and resets the counter for the next call.
- Cheap decode: quant codes become floats by OR-ing them into the mantissa of 1.0 (no int->float conversion,
  which runs at a quarter of the FMA rate): ``bits(1.0) | (u << p)`` is ``1 + u * 2**(p - 23)``, and one FMA
  with a per-sub-block scale and offset turns it into the weight.  The per-sub-block scales are decoded once
  per (row, sub-block) and amortised over 16-32 weights.
- Wide loads: Q4_K/Q5_K are read as int32 words (16-byte vectors), the other types (2-byte aligned blocks) as
  uint16 pairs whose two byte lanes are joined into consecutive columns; each slice of decoded weights covers
  16-32 consecutive columns, so the activations are read as contiguous vectors, once per ``BLOCK_N`` rows.
- For one activation row the products run on the FMA units (one FMA per weight into per-weight accumulators,
  reduced after the K loop); for 2..16 rows the dequantized tile goes to ``tl.dot`` (tensor cores) with x
  padded to 16 rows.  Past 16 rows (``gguf_linear`` without a config) the weight is dequantized to bf16 by the
  same decoder (``dequantize_rows``, the kernels' STORE path) and multiplied by cuBLAS: measured on the H200, the
  fused tensor-core path with 64-row tiles was 4-20x slower than that at 64-256 rows.

Two later additions: for Q4_K and Q5_K at batches 1-4 and Q6_K at batches 2-8 (``GemvConfig.q8``, chosen by
``pick_config``) the activations are rounded to int8 blocks and the codes multiplied with ``dp4a``
(``gguf_gemv_q8``: ~2.7 instead of ~6.3 instructions per weight for Q4_K); and for weights of 32 MB or more each K
step first asks L2 for the blocks one or two steps ahead (``GemvConfig.prefetch``).

Session 23 added a third: for Q4_K and Q5_K at 5-16 rows (3-4 on large weights) the codes go to the int8 tensor
cores as they are, with the activations rounded to int8 blocks of 256 (``gguf_mma``: 1.4-2.8x faster than the bf16
tensor-core path at 16 rows, ~1.5x faster than dp4a at 8 for Q5_K).

On sm_90 the GEMVs are launched with programmatic dependent launch (``PDL_MODE``): a GEMV's launch overlaps the end
of the kernel before it (the int8 paths' activation quantizer lets it start at once), and it waits in
``griddepcontrol.wait`` before it reads anything (0.1-1 us per call, ``PDL_MODE``'s measurements).

Triton's software pipelining of the K loop (``tl.range(..., num_stages=2 or 4)``: each step's loads become
``cp.async`` copies into shared memory, a few steps ahead) was never faster: more than 3 % slower in 36 of 60 cases,
within 3 % in the rest (H200, session 15, same run, the production tiles of 15 shapes and types at batches 1 and 4,
2 and 4 stages; stages 1 / 2 / 4, us: Q4_K lm_head/8 batch 1 32.8 / 74.3 / 77.9, Q6_K lm_head/8 batch 4 88.5 /
167.7 / 195.4, Q8_0 expert gate/up batch 1 11.5 / 11.8 / 11.7, whose uint16 code loads it does not pipeline).  The
shared-memory round trip and its barriers cost more than the deeper queue of loads gains.

``tests/unit/test_kernels_compile.py`` compiles these kernels for sm_90 without a GPU and keeps the SASS
instruction count per weight in the K loop within a budget (~6-8 for Q4_K: the H200 issues enough instructions
for ~4 per weight at full bandwidth).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import operator
import os
import re
from pathlib import Path

import torch
import triton
import triton.language as tl

from glm5serve import triton_interpreter

triton_interpreter.apply()  # bf16 tl.dot on the CPU interpreter (see there)

# GGML type ids (gguf-py ``GGMLQuantizationType``).
Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K = 2, 6, 8, 12, 13, 14
# (elements per block, bytes per block), as gguf-py ``GGML_QUANT_SIZES``.
BLOCK_SIZES = {Q4_0: (32, 18), Q5_0: (32, 22), Q8_0: (32, 34), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210)}
SUPPORTED_QTYPES = frozenset(BLOCK_SIZES)
_NAMES = {Q4_0: "Q4_0", Q5_0: "Q5_0", Q8_0: "Q8_0", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
# Types whose blocks are a whole number of 32-bit words: loaded as int32 words.
_WORD_TYPES = frozenset({Q4_K, Q5_K})
# Q4_0/Q5_0/Q8_0/Q6_K weights regrouped into split rows at load time (``gguf_split``) carry type id SPLIT_BASE + GGML
# id.
SPLIT_BASE = 0x100
SPLIT_QTYPES = frozenset(SPLIT_BASE + q for q in (Q4_0, Q5_0, Q8_0, Q6_K))
MAX_FAST_M = 16   # decode kernels (GEMV FMA / int8 / tensor-core paths; per-(token, expert) MoE, see gguf_moe)
MAX_GEMM_M = 256  # up to 256 rows: dequantize to bf16 + cuBLAS (grouped by expert for MoE); beyond: the plugin's

_ONE: tl.constexpr = tl.constexpr(0x3F800000)  # bits of 1.0f
STORE: tl.constexpr = tl.constexpr(2)  # USE_DOT value of the dequantize kernel: write the weights, no product


@dataclasses.dataclass(frozen=True)
class GemvConfig:
    """Launch parameters: ``block_n`` rows per program, ``kbs`` quant blocks per row and loop step,
    ``split_k`` programs along K (fp32 partials; the last program of a tile sums them), ``use_dot`` for the
    tensor cores with x padded to ``block_m`` rows (ignored where the MMA cannot run: fp32 activations,
    ``block_n < 16``); without it each program takes one activation row.  ``block_m`` (16, 32 or 64): activation
    rows per program on the tensor-core path; each program dequantizes its weight tile once for that many rows.
    ``prefetch``: steps of L2 prefetch ahead of the decode (0: none; CUDA only, not under the interpreter).
    ``q8`` (Q8_TYPES, bf16/fp16 x): activations quantized to int8 blocks and integer dot products, as llama.cpp's
    MMVQ (``gguf_gemv_q8``), with min(``block_m``, 8, the next power of two >= M) activation rows per program;
    ``use_dot`` unused.  ``ahead`` (with ``q8``, Q4_K and Q5_K, and split rows): each K step's loads are issued one
    step ahead, into registers.  ``mma`` (Q4_K and Q5_K, bf16/fp16 x): activations rounded to int8 blocks of 256
    and the codes multiplied on the int8 tensor cores (``gguf_mma``; ignored for fp32 x or ``block_n < 16``), 8
    activation rows per program for ``block_m`` <= 8, else 16, ``stages`` steps of Triton's software pipelining (1:
    none), min(``kbs``, 2) super-blocks per step (so the default ``kbs`` takes two).  Split rows (Q8_0, Q4_0, Q6_K;
    ``gguf_split.gguf_linear_split``): the same tensor cores for any x dtype, activation blocks of 32 (Q6_K 256),
    ``kbs`` groups of 32 per step (2..8; Q6_K 8), 8 activation rows per program for M <= 8, else 16."""
    block_n: int = 16
    kbs: int = 2
    split_k: int = 1
    num_warps: int = 4
    use_dot: bool = False
    block_m: int = 16
    prefetch: int = 0
    q8: bool = False
    ahead: bool = False
    mma: bool = False
    stages: int = 1

    def __post_init__(self):
        # Triton block sizes and warp counts are powers of two; catch a bad value here, not in a kernel launch
        for name in ("block_n", "kbs", "num_warps", "block_m"):
            v = getattr(self, name)
            if type(v) is not int or v < 1 or v & (v - 1):
                raise ValueError(f"GemvConfig: {name}={v!r} is not a power of two")
        if self.block_m > 64 or self.num_warps > 32:  # 32 warps: Triton's (and CUDA's) most per program
            raise ValueError(f"GemvConfig: block_m={self.block_m} must be <= 64 and num_warps={self.num_warps} <= 32")
        if type(self.split_k) is not int or self.split_k < 1 or type(self.prefetch) is not int or self.prefetch < 0:
            raise ValueError(f"GemvConfig: split_k={self.split_k!r} must be >= 1 and prefetch={self.prefetch!r} >= 0")
        if type(self.stages) is not int or self.stages < 1:
            raise ValueError(f"GemvConfig: stages={self.stages!r} must be an int >= 1")


def tile_shape(qtype: int, kbs: int) -> tuple[int, int]:
    """(G, T) of the register tile one decode slice produces per row: G groups of T weights each."""
    return {Q4_K: (4 * kbs, 32), Q5_K: (4 * kbs, 32), Q6_K: (4 * kbs, 16),
            Q8_0: (kbs, 32), Q4_0: (kbs, 16), Q5_0: (kbs, 16)}[qtype]


# ---------------------------------------------------------------------------------------------------------------
# Decode helpers (run inside kernels)
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _f16_lo(word):
    """Low half of an int32 word read as fp16, returned as fp32."""
    return (word & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_hi(word):
    return (word >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_bytes(ptr, mask):
    """Little-endian fp16 at a (possibly 2-byte aligned) uint8 pointer, as fp32."""
    lo = tl.load(ptr, mask=mask, other=0).to(tl.int32)
    hi = tl.load(ptr + 1, mask=mask, other=0).to(tl.int32)
    return _f16_lo(lo | (hi << 8))


@triton.jit
def _shift(x, S: tl.constexpr):
    """x << S for S >= 0, else x >> -S (the bits that matter are masked afterwards)."""
    if S >= 0:
        return x << S
    else:
        return x >> -S


@triton.jit
def _weights(bits, a, b, P: tl.constexpr, EXACT: tl.constexpr = False):
    """Weights a * u + b from ``bits = bits(1.0) | (u << P)``; a, b are per group ([BN, G]), bits [BN, G, T].

    ``bits`` read as fp32 is v = 1 + u * 2**(P-23), so a * u + b = a' * v + (b - a') with a' = a * 2**(23-P):
    one FMA per weight.  The code's top bit must sit at bit 22 (P = 23 - code bits): then a' is at most
    256 a and rounding b - a' costs < 2**-15 of a, far below bf16 precision.  EXACT (the STORE path,
    ``dequantize_rows``): u is unpacked and a * u + b computed as gguf-py does, each weight rounded once (a * u is
    exact in fp32: fp16 d's 11 significant bits, times a sub-scale and a code, take at most 24 bits, Q6_K's
    11 + 7 + 6 the most).  Equal in value to gguf-py's (a zero weight may come out +0 where gguf-py has -0).
    """
    if EXACT:
        u = (bits >> P) & ((1 << (23 - P)) - 1)
        return u.to(tl.float32) * a[:, :, None] + b[:, :, None]
    v = bits.to(tl.float32, bitcast=True)
    a2 = a * (1 << (23 - P))
    return v * a2[:, :, None] + (b - a2)[:, :, None]


@triton.jit
def _accumulate(acc, w, x_ptr, xoff, xmask, xscale, kidx, kmask,
                BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    """acc += x[:, kidx] (*) w.  w: [BN, G, T] fp32 weights; kidx/kmask: [G, T] column of each weight.

    FMA path (USE_DOT False, one activation row at x_ptr): acc is [BN, G, T] fp32, one FMA per weight, reduced
    after the K loop; xoff/xmask are unused.  Dot path (True): acc is [BLOCK_M, BN]; activation row m starts at
    x_ptr + xoff[m] (int64 element offsets, so rows may be gathered, as the grouped MoE does), rows with xmask[m]
    False read as zeros.  Store "path" (USE_DOT == STORE): no product; the weights are written in x_ptr's dtype
    to x_ptr + xoff[n] + column for each of the BN rows (xmask: [BN] rows to write), and acc is returned as is.
    """
    if USE_DOT == STORE:
        tl.store(x_ptr + xoff[:, None, None] + kidx[None, :, :], w.to(x_ptr.dtype.element_ty),
                 mask=xmask[:, None, None] & kmask[None, :, :])
    elif USE_DOT:
        BN: tl.constexpr = w.shape[0]
        GT: tl.constexpr = w.shape[1] * w.shape[2]
        k2 = tl.reshape(kidx, [GT])
        km2 = tl.reshape(kmask, [GT])
        xs = tl.load(x_ptr + xoff[:, None] + k2[None, :], mask=xmask[:, None] & km2[None, :],
                     other=0.0, eviction_policy="evict_last")
        wd = tl.reshape(w, [BN, GT]).to(xs.dtype)
        acc = tl.dot(xs, tl.trans(wd), acc)
    else:
        xm = tl.load(x_ptr + kidx, mask=kmask, other=0.0, eviction_policy="evict_last").to(tl.float32)
        acc += w * (xm * xscale)[None, :, :]
    return acc


@triton.jit
def _one_bits(nb):
    """bits(1.0f) as a run-time value (nb >= 0): held in a register, ptxas fuses mask and OR into one LOP3."""
    return (nb >> 31) | _ONE


@triton.jit
def _kquant_scale_min(h1, h2, h3, sb):
    """6-bit scale and min of sub-block ``sb`` (0..7) from the 12 packed bytes in words h1..h3 ([BN, G]).

    llama.cpp ``get_scale_min_k4`` / gguf-py ``Q4_K.get_scale_min``.
    """
    sh = ((sb % 4) * 8)[None, :]
    a1 = (h1 >> sh) & 0xFF
    a2 = (h2 >> sh) & 0xFF
    a3 = (h3 >> sh) & 0xFF
    low = (sb < 4)[None, :]
    sc = tl.where(low, a1 & 63, (a3 & 0xF) | ((a1 >> 6) << 4))
    mn = tl.where(low, a2 & 63, (a3 >> 4) | ((a2 >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _kquant_code(q, qh, BYTE: tl.constexpr, HI: tl.constexpr, P: tl.constexpr, FIVE: tl.constexpr):
    """Code bits of byte BYTE, nibble HI of each qs word, moved to bits P.. (Q5_K: plus its qh bit on top)."""
    bits = _shift(q, P - 8 * BYTE - 4 * HI) & (0xF << P)
    if FIVE:
        bits = bits | (_shift(qh, P + 4 - 8 * BYTE - HI) & (0x10 << P))
    return bits


@triton.jit
def _step_kquant45(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale,
                   FIVE: tl.constexpr, KBS: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    """Q4_K (FIVE=False, 36 words/block) or Q5_K (FIVE=True, 44 words/block), KBS super-blocks per row.

    Word layout: [d|dmin] [scales x3] ([qh x8] for Q5_K) [qs x32].  qs word 8j+t, byte b, nibble hi holds
    element 64j + 32hi + 4t + b (sub-block 2j+hi); Q5_K's 5th bit is bit 2j+hi of qh byte 4t+b.
    weight = d * scale * u - dmin * min (gguf-py ``Q4_K.dequantize_blocks``).
    """
    WORDS: tl.constexpr = 44 if FIVE else 36
    QS: tl.constexpr = 12 if FIVE else 4
    g = tl.arange(0, 4 * KBS)
    t = tl.arange(0, 8)
    kb = b0 + g // 4
    j = g % 4
    bmask = kb < nb
    one = _one_bits(nb)
    wmask = rmask[:, None] & bmask[None, :]
    blk = row_ptr[:, None] + kb[None, :] * WORDS
    h0 = tl.load(blk, mask=wmask, other=0)
    h1 = tl.load(blk + 1, mask=wmask, other=0)
    h2 = tl.load(blk + 2, mask=wmask, other=0)
    h3 = tl.load(blk + 3, mask=wmask, other=0)
    q = tl.load(blk[:, :, None] + QS + (j * 8)[None, :, None] + t[None, None, :], mask=wmask[:, :, None], other=0,
                eviction_policy="evict_first")
    if FIVE:
        qh = tl.load(blk[:, :, None] + 4 + t[None, None, :], mask=wmask[:, :, None], other=0,
                     eviction_policy="evict_first")
        qh = qh >> (2 * j)[None, :, None]  # bit 8b + hi is now the high bit of sub-block 2j+hi, byte b
    else:
        qh = q
    d = _f16_lo(h0)
    dmin = _f16_hi(h0)
    l = tl.arange(0, 32)
    kmask = tl.broadcast_to(bmask[:, None], [4 * KBS, 32])
    kbase = (kb * 256 + j * 64)[:, None] + l[None, :]
    P: tl.constexpr = 18 if FIVE else 19  # code bits P..22
    for hi in tl.static_range(2):
        sc, mn = _kquant_scale_min(h1, h2, h3, 2 * j + hi)
        # byte b of word t is column 4t + b: interleave the four byte lanes into 32 consecutive columns
        bits = tl.join(tl.join(_kquant_code(q, qh, 0, hi, P, FIVE), _kquant_code(q, qh, 2, hi, P, FIVE)),
                       tl.join(_kquant_code(q, qh, 1, hi, P, FIVE), _kquant_code(q, qh, 3, hi, P, FIVE)))
        bits = tl.reshape(bits, [q.shape[0], q.shape[1], 32])
        w = _weights(bits | one, d * sc, -(dmin * mn), P, USE_DOT == STORE)
        acc = _accumulate(acc, w, x_ptr, xoff, xmask, xscale, kbase + 32 * hi, kmask, BLOCK_M, USE_DOT)
    return acc


@triton.jit
def _q6_k_code(ql, qs, NIB: tl.constexpr, B: tl.constexpr):
    """6-bit code of byte B, nibble NIB of the ql pairs (its two high bits from qs, see _step_q6_k) at bits 17..22."""
    code = (ql & (0xF << (4 * NIB + 8 * B))) | (qs & ~(0xF << (4 * NIB + 8 * B)))  # one LOP3
    return _shift(code, 17 - 4 * NIB - 8 * B) & (0x3F << 17)


@triton.jit
def _step_q6_k(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale,
               KBS: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    """Q6_K, 210 bytes: ql[128] qh[64] scales[16] (int8) d (fp16).  Element 128h + 32c + i (i < 32) has its low
    nibble in ql[64h + 32(c%2) + i] (nibble c//2), its two high bits at bits 2c of qh[32h + i], and scale
    scales[8h + 2c + i//16]; weight = d * scale * (q - 32).

    The FMA and STORE paths' decoder (``_step_q6_k_dot`` for the tensor cores).  Blocks are 2-byte aligned, so
    codes are read as uint16 pairs: group (kb, h, s) covers i = 16s .. 16s+15, pair j holds i = 16s + 2j + b in
    byte b."""
    g = tl.arange(0, 4 * KBS)
    j = tl.arange(0, 8)
    kb = b0 + g // 4
    h = (g // 2) % 2
    s = g % 2
    bmask = kb < nb
    one = _one_bits(nb)
    wmask = rmask[:, None] & bmask[None, :]
    blk = row_ptr[:, None] + kb[None, :].to(tl.int64) * 210
    blk16 = blk.to(tl.pointer_type(tl.uint16))
    d64 = _f16_lo(tl.load(blk16 + 104, mask=wmask, other=0).to(tl.int32)) * 64.0
    kmask = tl.broadcast_to(bmask[:, None], [4 * KBS, 16])
    i16 = tl.arange(0, 16)
    hj = (16 * h + 8 * s)[None, :, None] + j[None, None, :]
    qh = tl.load(blk16[:, :, None] + 64 + hj, mask=wmask[:, :, None], other=0,
                 eviction_policy="evict_first").to(tl.int32)
    for c2 in tl.static_range(2):
        ql = tl.load(blk16[:, :, None] + (16 * c2) + (32 * h + 8 * s)[None, :, None] + j[None, None, :],
                     mask=wmask[:, :, None], other=0, eviction_policy="evict_first").to(tl.int32)
        # the two high bits of sub-block c = c2 + 2 nib sit at bits 2c + 8b of qh: shifted by 4 - 2 c2 they lie
        # just above the nibble (bits 4 nib + 8b), for both nibbles; a bit select then forms the 6-bit code
        qs = _shift(qh, 4 - 2 * c2)
        for nib in tl.static_range(2):
            c = c2 + 2 * nib
            sc = tl.load(blk + (192 + 2 * c) + (8 * h + s)[None, :], mask=wmask, other=0)
            a = d64 * sc.to(tl.int8, bitcast=True).to(tl.float32)
            w_a = -1.5 * a
            # byte b of pair j is column 2j + b: join the two byte lanes into 16 consecutive columns
            bits = tl.join(_q6_k_code(ql, qs, nib, 0), _q6_k_code(ql, qs, nib, 1))
            bits = tl.reshape(bits, [ql.shape[0], ql.shape[1], 16])
            if USE_DOT == STORE:  # d scale u - 32 d scale, rounded once (the FMA form rounds a * v near 1.5 a)
                w = _weights(bits, a * 0.015625, -0.5 * a, 17, True)
            else:
                # u at bit 17: v = 1 + u / 64, weight = a * v - 1.5 a with a = 64 d scale
                w = (bits | one).to(tl.float32, bitcast=True) * a[:, :, None] + w_a[:, :, None]
            kidx = (kb * 256 + h * 128 + 32 * c + 16 * s)[:, None] + i16[None, :]
            acc = _accumulate(acc, w, x_ptr, xoff, xmask, xscale, kidx, kmask, BLOCK_M, USE_DOT)
    return acc


@triton.jit
def _step_q8_0(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale,
               KBS: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    """Q8_0, 34 bytes: d (fp16), qs[32] int8; weight = d * q.  The FMA and STORE paths' decoder (``_step_q8_0_dot``
    for the tensor cores).  Blocks are 2-byte aligned: the codes are read as 16 uint16 pairs, pair j holding
    columns 2j (low byte) and 2j + 1."""
    g = tl.arange(0, KBS)
    j = tl.arange(0, 16)
    kb = b0 + g
    bmask = kb < nb
    one = _one_bits(nb)
    wmask = rmask[:, None] & bmask[None, :]
    blk16 = (row_ptr[:, None] + kb[None, :] * 34).to(tl.pointer_type(tl.uint16))
    d = _f16_lo(tl.load(blk16, mask=wmask, other=0).to(tl.int32))
    q = tl.load(blk16[:, :, None] + 1 + j[None, None, :], mask=wmask[:, :, None], other=0,
                eviction_policy="evict_first").to(tl.int32)
    # u = code + 128 (flip the sign bit) at bit 15: v = 1 + u / 256, weight = d * (u - 128); byte b of pair j is
    # column 2j + b: the two byte lanes are joined into 32 consecutive columns
    bits = tl.join(_shift(q, 15) & (0xFF << 15), _shift(q, 7) & (0xFF << 15))
    bits = tl.reshape(bits, [q.shape[0], q.shape[1], 32]) ^ (one | 0x400000)
    w = _weights(bits, d, -128.0 * d, 15, USE_DOT == STORE)
    kidx = (kb * 32)[:, None] + tl.arange(0, 32)[None, :]
    kmask = tl.broadcast_to(bmask[:, None], [KBS, 32])
    return _accumulate(acc, w, x_ptr, xoff, xmask, xscale, kidx, kmask, BLOCK_M, USE_DOT)


@triton.jit
def _step_q6_k_dot(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale,
                   KBS: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    """Q6_K, 210 bytes: ql[128] qh[64] scales[16] (int8) d (fp16).  Element 128h + 32c + i (i < 32) has its low
    nibble in ql[64h + 32(c%2) + i] (nibble c//2), its two high bits at bits 2c of qh[32h + i], and scale
    scales[8h + 2c + i//16]; weight = d * scale * (q - 32).

    The tensor-core path's decoder: byte loads, 16 columns per slice.  There it measured faster than the pair
    decoder ``_step_q6_k`` (H200, session 10, same run: gate/up batch 2 18.8 against 22.9 us, lm_head/8 140 against
    203), which wins on the FMA path (batch 1: 11.7 against 12.5 us)."""
    g = tl.arange(0, 2 * KBS)
    i0 = tl.arange(0, 16)
    kb = b0 + g // 2
    h = g % 2
    bmask = kb < nb
    one = _one_bits(nb)
    wmask = rmask[:, None] & bmask[None, :]
    blk = row_ptr[:, None] + kb[None, :].to(tl.int64) * 210
    d = _f16_bytes(blk + 208, wmask)
    kmask = tl.broadcast_to(bmask[:, None], [2 * KBS, 16])
    for i1 in tl.static_range(2):
        qh = tl.load(blk[:, :, None] + (128 + 16 * i1) + (32 * h)[None, :, None] + i0[None, None, :],
                     mask=wmask[:, :, None], other=0, eviction_policy="evict_first").to(tl.int32)
        for half in tl.static_range(2):
            ql = tl.load(blk[:, :, None] + (32 * half + 16 * i1) + (64 * h)[None, :, None] + i0[None, None, :],
                         mask=wmask[:, :, None], other=0, eviction_policy="evict_first").to(tl.int32)
            for nib in tl.static_range(2):
                sc = tl.load(blk + (192 + 2 * (2 * nib + half) + i1) + (8 * h)[None, :], mask=wmask, other=0)
                a = d * sc.to(tl.int8, bitcast=True).to(tl.float32)
                # u = low4 | high2 << 4 placed at bit 17: v = 1 + u / 64
                bits = ((ql << (17 - 4 * nib)) & (0xF << 17)) | ((qh << (21 - 2 * (2 * nib + half))) & (0x3 << 21))
                w = _weights(bits | one, a, -32.0 * a, 17)
                kidx = (kb * 256 + h * 128)[:, None] + (32 * (2 * nib + half) + 16 * i1) + i0[None, :]
                acc = _accumulate(acc, w, x_ptr, xoff, xmask, xscale, kidx, kmask, BLOCK_M, USE_DOT)
    return acc


@triton.jit
def _step_q8_0_dot(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale,
                   KBS: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    """Q8_0, 34 bytes: d (fp16), qs[32] int8; weight = d * q.  The tensor-core path's decoder (byte loads): there it
    measured 2-8 % faster than the pair decoder ``_step_q8_0`` (H200, session 10: lm_head/8 batch 2 125 against
    136 us), which wins on the FMA path (batch 1 lm_head/8 72 against 88 us)."""
    g = tl.arange(0, KBS)
    i = tl.arange(0, 32)
    kb = b0 + g
    bmask = kb < nb
    wmask = rmask[:, None] & bmask[None, :]
    blk = row_ptr[:, None] + kb[None, :].to(tl.int64) * 34
    d = _f16_bytes(blk, wmask)
    q = tl.load(blk[:, :, None] + 2 + i[None, None, :], mask=wmask[:, :, None], other=0,
                eviction_policy="evict_first").to(tl.int32)
    # u = q + 128 (flip the sign bit) at bit 15: v = 1 + u / 256, weight = d * (u - 128)
    bits = (q << 15) ^ (_ONE | 0x400000)
    w = _weights(bits, d, -128.0 * d, 15, USE_DOT == STORE)
    kidx = (kb * 32)[:, None] + i[None, :]
    kmask = tl.broadcast_to(bmask[:, None], [KBS, 32])
    return _accumulate(acc, w, x_ptr, xoff, xmask, xscale, kidx, kmask, BLOCK_M, USE_DOT)


@triton.jit
def _q5_0_code(qs, qhj, HI: tl.constexpr, B: tl.constexpr, P: tl.constexpr, FIVE: tl.constexpr):
    """Code of byte B, nibble HI of the qs pairs at bits P.. (Q5_0: plus its high bit, bit 16 HI + B of qhj)."""
    if FIVE:
        # move the qh bit just above the nibble, then one bit select forms the 5-bit code
        code = (qs & (0xF << (4 * HI + 8 * B))) | (_shift(qhj, 4 + 7 * B - 12 * HI) & (0x10 << (4 * HI + 8 * B)))
        return _shift(code, P - 4 * HI - 8 * B) & (0x1F << P)
    else:
        return _shift(qs, P - 4 * HI - 8 * B) & (0xF << P)


@triton.jit
def _step_q45_0(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale,
                FIVE: tl.constexpr, KBS: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    """Q4_0 (18 bytes: d, qs[16]) or Q5_0 (22 bytes: d, qh u32, qs[16]).  Element 16hi + l is nibble hi of
    qs[l] (Q5_0: plus bit 16hi+l of qh as bit 4); weight = d * (u - 8) (Q5_0: d * (u - 16)).

    Blocks are 2-byte aligned, so qs is read as 8 uint16 pairs: pair j, byte b holds l = 2j + b."""
    BYTES: tl.constexpr = 22 if FIVE else 18
    QS: tl.constexpr = 3 if FIVE else 1  # in uint16 units
    g = tl.arange(0, KBS)
    j = tl.arange(0, 8)
    kb = b0 + g
    bmask = kb < nb
    one = _one_bits(nb)
    wmask = rmask[:, None] & bmask[None, :]
    blk16 = (row_ptr[:, None] + kb[None, :].to(tl.int64) * BYTES).to(tl.pointer_type(tl.uint16))
    d = _f16_lo(tl.load(blk16, mask=wmask, other=0).to(tl.int32))
    qs = tl.load(blk16[:, :, None] + QS + j[None, None, :], mask=wmask[:, :, None], other=0,
                 eviction_policy="evict_first").to(tl.int32)
    qhj = qs
    if FIVE:
        qh = (tl.load(blk16 + 1, mask=wmask, other=0).to(tl.int32)
              | (tl.load(blk16 + 2, mask=wmask, other=0).to(tl.int32) << 16))
        qhj = qh[:, :, None] >> (2 * j)[None, None, :]  # bit 16hi + b is now the high bit of element 16hi + 2j + b
    kmask = tl.broadcast_to(bmask[:, None], [KBS, 16])
    P: tl.constexpr = 18 if FIVE else 19  # code bits P..22
    for hi in tl.static_range(2):
        bits = tl.join(_q5_0_code(qs, qhj, hi, 0, P, FIVE), _q5_0_code(qs, qhj, hi, 1, P, FIVE))
        bits = tl.reshape(bits, [qs.shape[0], qs.shape[1], 16])
        w = _weights(bits | one, d, (-16.0 if FIVE else -8.0) * d, P, USE_DOT == STORE)
        kidx = (kb * 32)[:, None] + 16 * hi + tl.arange(0, 16)[None, :]
        acc = _accumulate(acc, w, x_ptr, xoff, xmask, xscale, kidx, kmask, BLOCK_M, USE_DOT)
    return acc


@triton.jit
def _step(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale,
          QTYPE: tl.constexpr, KBS: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    """One K step (KBS quant blocks of BLOCK_N rows) of any supported type."""
    if QTYPE == 12:
        acc = _step_kquant45(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale, False, KBS, BLOCK_M,
                             USE_DOT)
    elif QTYPE == 13:
        acc = _step_kquant45(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale, True, KBS, BLOCK_M,
                             USE_DOT)
    elif QTYPE == 14 and USE_DOT == 1:  # the tensor-core path (USE_DOT True, not STORE)
        acc = _step_q6_k_dot(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale, KBS, BLOCK_M, USE_DOT)
    elif QTYPE == 14:
        acc = _step_q6_k(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale, KBS, BLOCK_M, USE_DOT)
    elif QTYPE == 8 and USE_DOT == 1:
        acc = _step_q8_0_dot(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale, KBS, BLOCK_M, USE_DOT)
    elif QTYPE == 8:
        acc = _step_q8_0(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale, KBS, BLOCK_M, USE_DOT)
    elif QTYPE == 2:
        acc = _step_q45_0(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale, False, KBS, BLOCK_M,
                          USE_DOT)
    else:
        acc = _step_q45_0(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale, True, KBS, BLOCK_M,
                          USE_DOT)
    return acc


@triton.jit
def _zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, T: tl.constexpr,
              USE_DOT: tl.constexpr):
    if USE_DOT:
        return tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        return tl.zeros([BLOCK_N, G, T], dtype=tl.float32)


@triton.jit
def _reduce_acc(acc, USE_DOT: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32 sums (BLOCK_M = 1 on the FMA path)."""
    if USE_DOT:
        return acc
    else:
        return tl.sum(tl.sum(acc, axis=2), axis=1)[None, :]


@triton.jit
def _prefetch_lines(base, on, start, COUNT: tl.constexpr):
    """Ask L2 for every 128-byte line of elements [start, start + COUNT) past each pointer of ``base`` ([BN]) where
    ``on`` ([BN] bool) holds: one ``prefetch.global.L2`` per line, not waited for."""
    EB: tl.constexpr = base.dtype.element_ty.primitive_bitwidth // 8  # bytes per pointer element: 1, 2 or 4
    LINE: tl.constexpr = 128 // EB  # pointer elements per 128-byte line
    NL: tl.constexpr = triton.next_power_of_2((COUNT + LINE - 1) // LINE + 1)
    # line starts, the last clamped to the span's last element: every line the span touches gets one prefetch
    off = tl.minimum(start + tl.arange(0, NL) * LINE, start + COUNT - 1)
    ptrs = base[:, None] + off[None, :]
    flag = on[:, None].to(tl.int32) + tl.zeros([1, NL], dtype=tl.int32)
    tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                              "=r,l,r", [ptrs, flag], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_l2(row_ptr, rmask, b0, blk_end, QTYPE: tl.constexpr, KBS: tl.constexpr):
    """Ask L2 for GGUF blocks [b0, b0 + KBS) of each row (predicated on rmask and b0 < blk_end).  The data is not
    waited for: the lines are on their way while this step decodes."""
    EB: tl.constexpr = row_ptr.dtype.element_ty.primitive_bitwidth // 8
    BYTES: tl.constexpr = (144 if QTYPE == 12 else 176 if QTYPE == 13 else 210 if QTYPE == 14 else 34 if QTYPE == 8
                           else 18 if QTYPE == 2 else 22)
    # pointer elements per step (KBS even where a block is not whole units)
    _prefetch_lines(row_ptr, rmask & (b0 < blk_end), b0 * BYTES // EB, KBS * BYTES // EB)


@triton.jit
def _gdc_wait():
    """Block until the kernel this one was launched behind has finished and its writes are visible (PTX
    ``griddepcontrol.wait``, sm_90+); returns at once in a kernel launched without PDL.  Triton's
    ``tl.extra.cuda.gdc_wait``, written out so that it does not depend on where a Triton version keeps it."""
    tl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _gdc_launch_dependents():
    """Let the kernel launched behind this one with PDL start its programs now (PTX
    ``griddepcontrol.launch_dependents``); they still wait in ``_gdc_wait`` for this kernel's writes."""
    tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _pdl_prologue(row_ptr, rmask, blk_begin, blk_end, QTYPE: tl.constexpr, KBS: tl.constexpr, PDL: tl.constexpr):
    """PDL > 0 (the kernel is launched with programmatic dependent launch, ``pdl_value``): ask L2 for this
    program's first PDL - 1 steps of GGUF weight blocks, which no kernel writes, then wait for the kernel before
    (it may have written x, and it may still read memory that this kernel's outputs reuse)."""
    if PDL > 0:
        for d in tl.static_range(0, PDL - 1):
            _prefetch_l2(row_ptr, rmask, blk_begin + d * KBS, blk_end, QTYPE, KBS)
        _gdc_wait()


@triton.jit
def _rows_dot(acc, row_ptr, rmask, blk_begin, blk_end, nb, x_ptr, xoff, xmask, xscale,
              QTYPE: tl.constexpr, KBS: tl.constexpr, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr,
              PREFETCH: tl.constexpr = 0):
    """Accumulate blocks [blk_begin, blk_end) of BLOCK_N rows against BLOCK_M activation rows.  PREFETCH > 0:
    each step first asks L2 for the blocks PREFETCH steps ahead (more bytes in flight than the registers hold)."""
    for d in tl.static_range(1, PREFETCH):
        _prefetch_l2(row_ptr, rmask, blk_begin + d * KBS, blk_end, QTYPE, KBS)
    for b0 in range(blk_begin, blk_end, KBS):
        if PREFETCH > 0:
            _prefetch_l2(row_ptr, rmask, b0 + PREFETCH * KBS, blk_end, QTYPE, KBS)
        acc = _step(acc, row_ptr, rmask, b0, nb, x_ptr, xoff, xmask, xscale, QTYPE, KBS, BLOCK_M, USE_DOT)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, nb, blocks_per_split,
                 stride_xm, stride_wn, stride_ym,
                 QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KBS: tl.constexpr,
                 G: tl.constexpr, T: tl.constexpr, USE_DOT: tl.constexpr, SPLIT_K: tl.constexpr,
                 PREFETCH: tl.constexpr = 0, PDL: tl.constexpr = 0):
    """Grid (N tiles, SPLIT_K, M tiles).  With SPLIT_K > 1, part_ptr is fp32 [SPLIT_K, M tiles * BLOCK_M, N]
    scratch and count_ptr int32 [M tiles * N tiles] counters that are zero on entry and left zero on exit.
    PDL: ``_pdl_prologue`` (launched with programmatic dependent launch)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    row_ptr = w_ptr + rows.to(tl.int64) * stride_wn
    m0 = pid_m * BLOCK_M
    blk_begin = pid_k * blocks_per_split
    blk_end = tl.minimum(blk_begin + blocks_per_split, nb)
    _pdl_prologue(row_ptr, rmask, blk_begin, blk_end, QTYPE, KBS, PDL)
    acc = _zero_acc(BLOCK_M, BLOCK_N, G, T, USE_DOT)
    mi = tl.arange(0, BLOCK_M)
    acc = _rows_dot(acc, row_ptr, rmask, blk_begin, blk_end, nb, x_ptr + m0.to(tl.int64) * stride_xm,
                    mi.to(tl.int64) * stride_xm, mi < M - m0, 1.0, QTYPE, KBS, BLOCK_M, USE_DOT, PREFETCH)
    y = _reduce_acc(acc, USE_DOT)
    _write_tile(y, y_ptr, part_ptr, count_ptr, M, N, rows, rmask, stride_ym, pid_n, pid_k, pid_m, BLOCK_M, SPLIT_K)


@triton.jit
def _write_tile(y, y_ptr, part_ptr, count_ptr, M, N, rows, rmask, stride_ym, pid_n, pid_k, pid_m,
                BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """Store the [BLOCK_M, BLOCK_N] fp32 tile y of program (pid_n, pid_k, pid_m) (activation rows from
    pid_m * BLOCK_M, output rows ``rows``) in y_ptr's dtype.  With SPLIT_K > 1 y is this program's partial: it goes
    to part_ptr (fp32 [SPLIT_K, M tiles * BLOCK_M, N]), the tile's counter in count_ptr is bumped, and the last of
    the tile's SPLIT_K programs sums the partials in split order (deterministic), stores the output and resets the
    counter."""
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ymask = (m < M)[:, None] & rmask[None, :]
    if SPLIT_K > 1:
        m_pad = tl.num_programs(2) * BLOCK_M
        tile = m[:, None].to(tl.int64) * N + rows[None, :]
        tl.store(part_ptr + pid_k * m_pad * N + tile, y, mask=ymask)
        # release our partial, acquire the others'; the last of the SPLIT_K programs of this tile reduces
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        tl.debug_barrier()  # all threads' partial stores precede the (single-thread) release
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:
            y = tl.zeros(y.shape, dtype=tl.float32)
            # fixed order, not arrival order; four partials per iteration, so that their loads overlap
            R: tl.constexpr = min(4, SPLIT_K)
            for k0 in range(0, SPLIT_K, R):
                for i in tl.static_range(R):
                    y += tl.load(part_ptr + (k0 + i) * m_pad * N + tile, mask=ymask & (k0 + i < SPLIT_K), other=0.0,
                                 cache_modifier=".cg")
            tl.store(y_ptr + m[:, None].to(tl.int64) * stride_ym + rows[None, :], y.to(y_ptr.dtype.element_ty),
                     mask=ymask)
            tl.atomic_xchg(counter, 0, sem="relaxed")
    else:
        tl.store(y_ptr + m[:, None].to(tl.int64) * stride_ym + rows[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=ymask)


@triton.jit
def _dequant_kernel(w_ptr, out_ptr, N, nb, stride_wn, stride_on,
                    QTYPE: tl.constexpr, BLOCK_N: tl.constexpr, KBS: tl.constexpr):
    """Grid (N tiles, K steps): one program decodes KBS blocks of BLOCK_N rows and stores them (STORE path)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    _step(0.0, w_ptr + rows.to(tl.int64) * stride_wn, rmask, tl.program_id(1) * KBS, nb, out_ptr,
          rows.to(tl.int64) * stride_on, rmask, 1.0, QTYPE, KBS, 1, STORE)


# ---------------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------------

TUNED_DIR = Path(__file__).with_name("tuned")


@functools.lru_cache(maxsize=None)
def _device_props(device_index: int) -> tuple[int, str]:
    p = torch.cuda.get_device_properties(device_index)
    return p.multi_processor_count, re.sub(r"[^A-Za-z0-9]+", "_", p.name).strip("_")


def _device_sms(device: torch.device) -> int:
    return _device_info(device)[0]


def _device_info(device: torch.device) -> tuple[int, str]:
    """(SM count, device name as in ``tuned/<name>.json``)."""
    if device.type == "cuda":
        return _device_props(device.index if device.index is not None else torch.cuda.current_device())
    return 1, "cpu"  # Triton interpreter: few, large programs interpret fastest


#: Programmatic dependent launch (PDL; sm_90+, CUDA C++ Programming Guide, "Programmatic Dependent Launch and
#: Synchronization"): a GEMV launched with it may start while the kernel before it finishes and waits in
#: ``_gdc_wait`` before it reads anything; the activation quantizer of the int8 paths lets its GEMV start at once
#: (``_gdc_launch_dependents``), so the GEMV's launch overlaps the quantizer and the gap between them.
#: ``$GLM5SERVE_PDL``: ``wait`` (the default), ``prefetch`` (also asks L2 for the first PDL_MAX_STEPS K steps of
#: weights before the wait) or ``off``.  Kernels after ours are launched as their owners launch them.  H200, session
#: 18, same run, us, off / wait / prefetch 1 step / prefetch 4 steps, back to back under CUDA graphs: Q4_K expert
#: gate/up batch 1 7.3 / 6.7 / 7.7 / 8.2, batch 4 10.6 / 9.7 / 10.3 / 10.8, lm_head/8 batch 1 32.9 / 31.9 / 32.1 /
#: 34.8; Q6_K gate/up batch 1 10.6 / 10.4 / 11.0 / 13.3, batch 4 14.9 / 14.3 / 13.7 / 13.8, down batch 4 14.0 / 13.0 /
#: 12.8 / 13.0; Q5_0 (split rows) gate/up batch 1 10.3 / 9.4 / 10.5 / 11.9, batch 4 11.3 / 10.4 / 11.3 / 12.8; Q8_0
#: batch 4 11.0 / 10.3 / 10.9 / 12.2.  With a small torch op before each GEMV (as a norm precedes it in a model), off
#: / wait: Q4_K gate/up batch 1 8.8 / 8.2, lm_head/8 33.9 / 33.6, q_b/8 batch 1 6.4 / 6.6, Q6_K gate/up batch 1 11.8
#: / 12.1, batch 4 16.5 / 16.2, Q5_0 batch 1 11.6 / 11.3 (``test_bench_pdl_modes``).
def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """``$name`` stripped and lower-cased, ``default`` when unset or empty; raises ValueError naming the variable
    and the choices for any other value (a typo must not silently keep the default)."""
    value = os.environ.get(name, "").strip().lower() or default
    if value not in choices:
        raise ValueError(f"${name}={os.environ[name]!r}: expected one of {', '.join(choices)}")
    return value


PDL_ENV = "GLM5SERVE_PDL"
PDL_MODES = ("off", "wait", "prefetch")
PDL_MODE = os.environ.get(PDL_ENV, "").strip().lower() or "wait"  # checked at launch (pdl_value), not at import


def pdl_mode() -> str:
    """``$GLM5SERVE_PDL`` as ``PDL_MODE`` reads it; ValueError for a value not in PDL_MODES."""
    return env_choice(PDL_ENV, PDL_MODES, "wait")
PDL_MAX_STEPS = 1


@functools.lru_cache(maxsize=None)
def _pdl_capable(device_index: int) -> bool:
    """sm_90 or later on CUDA (not ROCm, whose devices torch also calls ``cuda``; not the Triton interpreter, which
    has no PTX), and a Triton whose launcher knows ``launch_pdl`` (a compile option since Triton 3.4)."""
    if torch.version.hip or triton_interpreter.interpreting():
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - Triton without the NVIDIA backend
        return False
    fields = getattr(CUDAOptions, "__dataclass_fields__", {})
    return "launch_pdl" in fields and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_value(device: torch.device, steps: int) -> int:
    """The ``PDL`` constexpr of a GEMV on ``device`` whose programs take ``steps`` K steps: 0 to launch it without
    PDL (``$GLM5SERVE_PDL=off``, not CUDA, before sm_90, an older Triton), else 1 + the steps it prefetches into
    L2 before it waits (none with ``wait``, the default; with ``prefetch``, min(steps, PDL_MAX_STEPS)).
    Raises ValueError on another ``$GLM5SERVE_PDL``."""
    if PDL_MODE not in PDL_MODES:
        raise ValueError(f"${PDL_ENV}={PDL_MODE!r}: expected one of {', '.join(PDL_MODES)}")
    if PDL_MODE == "off" or device.type != "cuda":
        return 0
    if not _pdl_capable(device.index if device.index is not None else torch.cuda.current_device()):
        return 0
    return 1 + (min(steps, PDL_MAX_STEPS) if PDL_MODE == "prefetch" else 0)


def pdl_launch(pdl: int) -> dict:
    """Launch keyword arguments for a kernel whose ``PDL`` constexpr is ``pdl`` (none without PDL, so that the
    Triton interpreter never sees the option)."""
    return {"launch_pdl": True} if pdl else {}


@functools.lru_cache(maxsize=None)
def tuned_configs(device_name: str) -> dict[tuple[int, int, int, int], GemvConfig]:
    """Measured best configs ``{(qtype, M, N, K): GemvConfig}`` from ``tuned/<device_name>.json`` (written by the
    benchmark's sweep, ``tests/gpu/test_bench_kernels.py``); empty when there is none."""
    path = TUNED_DIR / f"{device_name}.json"
    if not path.is_file():
        return {}
    table = {}
    for key, cfg in json.loads(path.read_text())["configs"].items():
        qtype, m, n, k = (int(v) for v in key.split(","))
        table[(qtype, m, n, k)] = GemvConfig(**cfg)
    return table


_COUNTER_POOL = 1 << 20
_counters: dict[torch.device, list] = {}  # device -> [int32 zeros, next free offset]


def _tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """``n`` zeroed int32 split-K counters (the kernel leaves them zero again).

    Consecutive calls get consecutive slices of one pool, so GEMVs that overlap on different streams (vLLM's
    shared-expert stream) never share a counter.  The pool is made outside CUDA-graph capture; a call captured
    before any eager call gets its own zeroed counters (one memset node in the graph).
    """
    if n > _COUNTER_POOL:
        raise ValueError(f"gguf kernels: {n} split-K tiles exceed the counter pool")
    entry = _counters.get(device)
    if entry is None:
        if torch.cuda.is_available() and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return torch.zeros(n, dtype=torch.int32, device=device)
        entry = _counters[device] = [torch.zeros(_COUNTER_POOL, dtype=torch.int32, device=device), 0]
    pool, offset = entry
    if offset + n > _COUNTER_POOL:
        offset = 0
    entry[1] = offset + n
    return pool[offset:offset + n]


def _split_outputs(x: torch.Tensor, N: int, grid: tuple[int, int, int], block_m: int):
    """(y, part, counters) of a launch over ``grid`` = (N tiles, split-K programs, M tiles of block_m rows): y (M, N)
    in x's dtype; with split-K, fp32 partials [split, M tiles * block_m, N] and zeroed tile counters
    (``_tile_counters``), else y in their place (the kernels do not touch them)."""
    y = x.new_empty((x.shape[0], N))
    if grid[1] == 1:
        return y, y, y
    part = torch.empty((grid[1], grid[2] * block_m, N), dtype=torch.float32, device=x.device)
    return y, part, _tile_counters(x.device, grid[0] * grid[2])


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _pow2_at_most(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


# (block_n, kbs) per type: the fewest SASS instructions per weight without spills, at <= ~190 registers
# (tests/unit/test_kernels_compile.py); the dot path amortises its x operand over 64 rows where that fits.
_FMA_TILE = {Q4_K: (16, 2), Q5_K: (16, 2), Q6_K: (16, 2), Q8_0: (16, 8), Q4_0: (16, 8), Q5_0: (16, 8)}
_DOT_TILE = {Q4_K: (64, 1), Q5_K: (64, 1), Q6_K: (32, 1), Q8_0: (64, 2), Q4_0: (64, 2), Q5_0: (64, 2)}
# the STORE path (dequantize_rows): Q6_K's 16 x 2 tile takes an 8-byte stack frame there, 16 x 4 none
_DEQUANT_TILE = {**_FMA_TILE, Q6_K: (16, 4)}


#: int8 activations (``GemvConfig.q8``) for Q4_K: H200, session 6, same run, microseconds (q8 / fp32 decode /
#: bf16 cuBLAS): batch 1 lm_head/8 37.4 / 48.6 / 64.3, expert gate/up 8.4 / 9.1 / 11.4, down 7.6 / 11.0 / 9.3.
#: From batch 2 each program takes ``block_m`` = the next power of two >= M rows (weights unpacked once for all):
#: session 7, same run, q8 with rows / one row per program (the old path) or tensor cores at 8 / cuBLAS: gate/up
#: batch 2 10.2 / 13.6 / 11.2, batch 4 11.5 / 22.8 / 11.3, batch 8 13.8 / 19.4 (tensor cores) / 11.3; lm_head/8
#: batch 4 66.8 / 131.8 / 59.8, batch 8 102.8 / 145.5 / 60.5; down batch 8 12.2 / 19.0 / 8.8.  block_m follows
#: vLLM's CUDA-graph sizes (1, 2, 4, 8): a decode batch of 3 padded to 4 takes the launch of 4, so eager and graphs
#: agree bit for bit.  At batch 1 its second launch (quantizing x) costs more than it saves below ~4 MB of weight
#: (q_b/8 5.9 / 5.3).  16 rows per program (batches 9..16) tied with the tensor cores (same run: gate/up 23.1 /
#: 22.9, down 21.3 / 22.6, q_b/8 at 12 rows 11.0 / 10.1), so batches past 8 stay on them.
Q8_MAX_M = 8
Q8_MIN_BYTES_M1 = 4 << 20
#: types with an int8-activation kernel (``gguf_gemv_q8``); ``GemvConfig.q8`` is ignored for the others, and for Q6_K
#: rows of an odd number of blocks (it reads blocks in pairs).  Q5_K and Q6_K took it at batches 2..Q8_MAX_M, where
#: their fp32 decode runs on the tensor cores (Q5_K also at batch 1 from Q8_MIN_BYTES_M1, below; since session 23
#: Q5_K only up to 4 rows, ``_mma_applies``).  H200, session 11,
#: same run, microseconds, q8 at the tile below / that path / bf16 cuBLAS: Q5_K expert gate/up batch 2 11.9 / 20.4 /
#: 11.5, batch 4 12.9 / 21.1 / 11.6, batch 8 17.9 / 22.8; down batch 4 11.7 / 20.8 / 9.7; Q6_K gate/up batch 2 12.9 /
#: 18.8 / 11.8, batch 4 15.2 / 20.1 / 11.8; down batch 4 15.0 / 21.2 / 9.7; lm_head/8 batch 4 (kbs 4, tuned) 107 / 153 /
#: 60 (session 14: 89 with ``_Q8_MANY_ROWS_TILE``, below).  At batch 1 their FMA-path decode was as fast or faster (Q6_K
#: gate/up 13.2 / 10.7, Q5_K gate/up 11.3 / 10.8), except Q5_K down (9.7 / 11.1, then a tuned q8 entry of 16 rows).
#: Session 13, same run, q8 with 8 rows per program / the production config of the time: Q5_K batch 1 gate/up 10.0 /
#: 10.7 (fp32 decode), down 8.8 / 9.5 (that tuned entry, now dropped; 9.4 in the tile sweep of the same run), lm_head/8
#: 51.9 / 70.0 (fp32 decode), so Q5_K takes it at batch 1 as Q4_K does (from Q8_MIN_BYTES_M1: q_b/8 6.4 / 5.9).  Q8_0
#: has none (measured slower, ``gguf_gemv_q8``).
Q8_TYPES = frozenset({Q4_K, Q5_K, Q6_K})
#: (block_n, kbs, programs per SM aimed at, num_warps) of the int8-activation kernel per type at 2..4 and (Q6_K)
#: 5..8 rows (batch 1: ``_q8_row_tile``; Q4_K and Q5_K take ``gguf_mma`` from 5 rows, ``_mma_applies``).
#: Measured best of 16/32/64 rows, kbs 2/4, 2/8 programs per SM (session 11).  Q6_K at 2..4 rows: 64 rows per program
#: read each activation word once for 4 rows of weights (SASS per weight at batch 4: 4.4 with 64 rows, 5.8 with 32).
#: Q6_K at 5..8 rows: 8 rows, kbs 4, 2 warps (session 15, same run, against the 64-row tile with 2 programs per SM it
#: replaced, us, batch 5 / 8): expert gate/up 16.8 / 19.0 against 21.1 / 21.5, down 15.4 / 16.9 against 21.0 / 21.5,
#: lm_head/8 128.5 / 146.9 against 178.8 / 182.8, q_b/8 9.6 / 10.1 against 11.0 / 11.2, expert gate+up/8 9.1 / 9.4
#: against 11.0 / 11.1 (the batch-8 sweep of that session found the same tile for gate/up and down; for lm_head/8 it
#: found 64 rows with 4-way split-K and L2 prefetch, 125.5 us, which spills 8 bytes with Triton 3.8).  Q5_K at 5..8
#: rows: kbs 4 takes a stack frame, kbs 2 none; kbs 2 / 4 took gate/up 17.9 / 20.8 us, down 16.7 / 13.5 (a tie
#: overall; since session 23 those rows take ``gguf_mma``).
#: Batch 1, session 13, same run, 8 / 16 rows per program: Q4_K gate/up 7.6 / 8.2, down 6.4 / 7.4, lm_head/8 32.6 /
#: 36.3; Q5_K gate/up 10.0 / 10.6, down 8.8 / 9.4, lm_head/8 51.9 / 58.1 (at 2..4 rows 16 stayed best: Q4_K lm_head/8
#: batch 4 62.0 against 63.6; session 22 replaced those batch-1 tiles).  Q6_K at 2..4 rows on weights of many rows:
#: ``_Q8_MANY_ROWS_TILE`` instead.  Session 24 (H200, one run, batch 4: 8/16/32 rows, kbs 2/4, 1/2/4 warps, split-K to
#: 2/4/8 programs per SM, with and without ``ahead``; 14-46 launches per shape), best / this tile / bf16 cuBLAS, us:
#: Q5_K expert down 10.03 (this tile, the production launch measured 9.85 in the same run) / 9.85 / 9.34, gate/up
#: 11.08 (8 rows, 2 warps, ahead) / 10.86 (``gguf_mma``) / 11.80; Q4_K down 8.09 (8 rows, 1 warp) / 8.24 / 9.34,
#: gate/up 9.50 (8 rows, 2 warps, 2-way split, ahead) / 9.69 / 11.80: within 2 %, so the tiles stay.
_Q8_TILE = {Q4_K: ((16, 4, 2, 4),), Q5_K: ((16, 4, 2, 4),), Q6_K: ((64, 2, 8, 4), (8, 4, 8, 2))}
#: (block_n, kbs, num_warps) of the int8-activation kernel at 2..4 rows where cdiv(N, block_n) row tiles alone give
#: >= 2 programs per SM (so no split-K).  H200, session 14, same run, Q6_K at batch 4 (8 rows, kbs 4, 2 warps / the
#: 64-row tile above, us): lm_head/8 88.4 (89.0 with the L2 prefetch it keeps there) / 107.9 (that shape's tuned
#: entry, now dropped), expert down 13.8 / 14.9; expert gate/up (2048 rows: 256 tiles, 3-way split-K) 15.8 / 15.1,
#: so it keeps the 64-row tile.  At batch 2 (second run of the session): down 12.5 / 12.9, lm_head/8 79.3 / 78.7
#: (the 64-row heuristic; the sweep's best, 73.1 with 64 rows, kbs 4 and 3-way split-K, is a tuned entry).  At 5..8
#: rows Q6_K takes the same tile on every shape (``_Q8_TILE``).
_Q8_MANY_ROWS_TILE = {Q6_K: (8, 4, 2)}
#: programs per SM below which the int8-activation kernel's batch-1 tiles issue their loads one step ahead
#: (``_q8_row_tile``)
Q8_M1_AHEAD_PER_SM = 16


def _q8_row_tile(N: int, nb: int, sms: int) -> tuple[int, int, int, bool]:
    """(block_n, kbs, num_warps, ahead) of the int8-activation kernel at batch 1 (Q4_K and Q5_K, the one-row step
    ``gguf_gemv_q8._dot_q4_k_q8``): 4 weight rows per program, K steps of 8 super-blocks on 4 warps (4 on 2 warps
    where a row holds fewer than 16, so that GLM-5's 8-block rows take two steps; fewer than 4 where the row is
    shorter), loads one step ahead while the row tiles give fewer than ``Q8_M1_AHEAD_PER_SM`` programs per SM.

    Measured on an H200, session 22, one run, after the one-row step's loads were shaped like the code words (17
    tiles: 4/8/16 rows, kbs 4/8, 2/4 warps, with and without ``ahead``, split-K to 8 programs per SM), us, best /
    this tile / the session-20 heuristic (8 rows, kbs 4; 4 x 8 ahead where 8-row tiles needed split-K): Q4_K expert
    gate/up 2048 x 6144 (3.9 programs per SM) 5.18 / 5.18 / 5.18, expert down 6144 x 2048 (11.6) 5.22 / 5.22 / 6.02,
    lm_head/8 19360 x 6144 (36.7; without ``ahead``) 27.97 / 27.97 / 29.93; Q5_K 6.18 / 6.18 / 6.18, 6.29 / 6.29 /
    6.58, 33.22 / 33.22 / 37.32.  With ``ahead`` on lm_head/8: Q4_K 29.05, Q5_K 35.38; without it on gate/up: 7.09,
    7.13.  The same configuration measured twice in that run differed by up to 7 %."""
    kbs = min(8 if nb >= 16 else 4, _pow2_at_most(nb))
    return 4, kbs, 4 if kbs == 8 else 2, triton.cdiv(N, 4) < Q8_M1_AHEAD_PER_SM * sms


#: loads one step ahead (``GemvConfig.ahead``): Q4_K at 2..4 rows.  H200, session 13, same run, with / without, us:
#: Q4_K batch 4 gate/up 10.5 / 11.1, down 9.2 / 9.6, lm_head/8 58.9 / 62.0, q_b/8 6.6 / 6.6, expert down/8 3.7 /
#: 3.8; batch 2 gate/up 9.2 / 9.4 (best tile of each).  Not at 8 rows (gate/up 14.1 / 12.8; 15.4 at the production
#: tile, 231 registers), nor for Q5_K (batch 4 gate/up 12.7 / 12.3, down 11.7 / 11.0).  Batch 1 has its own rule
#: (``_q8_row_tile``; with the 8-row tile of session 13 it was a tie: gate/up 7.7 / 7.6, lm_head/8 32.0 / 32.6).
Q8_AHEAD = frozenset({Q4_K})

#: the int8 tensor-core GEMM (``GemvConfig.mma``, ``gguf_mma``) for Q4_K and Q5_K at 5..16 rows, and at 3..4 rows on
#: weights of at least MMA_MIN_BYTES_M4 whose rows hold MMA_MIN_BLOCKS_M4 super-blocks or more.  H200, session 23,
#: same run, us, best of 8-24 launches of it (the tile ``_mma_tile`` picks: its docstring) / the path before (dp4a
#: at 2..8 rows, bf16 tensor cores at 16) / bf16 cuBLAS, Q4_K: expert gate/up batch 4 9.96 / 9.79 /
#: 11.79, 8 10.57 / 11.98 / 11.52, 16 12.30 / 22.76 / 11.85; expert down 9.23 / 8.17 / 9.49, 9.77 / 10.70 / 9.38,
#: 11.54 / 22.52 / 9.44; lm_head/8 48.9 / 58.2 / 67.0, 52.3 / 81.6 / 66.4, 66.1 / 179.2 / 66.7; q_b/8 (batch 8, 16)
#: 6.20 / 6.78, 7.47 / 10.84; expert down/8 3.46 / 3.32, 4.23 / 5.80.  Q5_K: expert gate/up 10.29 / 11.25, 10.83 /
#: 15.96, 13.35 / 26.51; down 10.18 / 10.12, 10.62 / 15.13, 12.53 / 25.58; lm_head/8 48.2 / 74.6, 51.0 / 122.0,
#: 71.4 / 200.5; at batch 4 q_b/8 6.43 / 6.21, expert down/8 3.26 / 3.11; at batch 2 (another run, no pipelining)
#: the path before won on every shape but Q4_K lm_head/8 (47.0 / 48.0).  The benchmark run after it had Q5_K expert
#: down at batch 4 on this kernel at 10.4 us (dp4a: 10.1 in session 22), hence the row length rule.
MMA_MIN_BYTES_M4 = {Q4_K: 32 << 20, Q5_K: 8 << 20}
MMA_MIN_BLOCKS_M4 = 16


def _mma_applies(qtype: int, M: int, nb: int, weight_bytes: int) -> bool:
    """Whether ``pick_config`` takes the int8 tensor-core GEMM (``gguf_mma``) for this type, batch, row length (nb
    super-blocks) and weight size."""
    if qtype not in MMA_MIN_BYTES_M4:
        return False
    return 5 <= M <= MAX_FAST_M or 3 <= M <= 4 and weight_bytes >= MMA_MIN_BYTES_M4[qtype] and nb >= MMA_MIN_BLOCKS_M4


def _mma_tile(M: int, N: int, nb: int, sms: int) -> tuple[int, int, int, int, int]:
    """(block_n, num_warps, split_k, stages, kbs) of the int8 tensor-core GEMM: 64 rows on 2 warps, software-pipelined
    two deep, split-K to ~4 programs per SM (the fewest splits that reach it, evened out so that none is empty); where
    such tiles with one super-block per program give fewer than 4 programs per SM, 16 rows on 1 warp, no pipelining, ~8
    programs per SM at up to 8 rows, and 32 rows on 2 warps, two stages, two super-blocks per step (rows of >= 2),
    ~4 per SM above; no split-K above 8 rows where the row tiles alone give >= 2 programs per SM.

    The session-23 sweep (H200, 16/32/64/128 rows, split-K to 2/4/8 programs per SM, 1 or 2 stages): best / this
    tile, us, Q4_K batch 16: expert gate/up 12.30 / 12.30, down 11.54 / 11.54; batch 8: gate/up 10.57 / 10.60, down
    9.77 / 10.44, q_b/8 6.20 / 6.20, gate+up/8 6.43 / 6.43, down/8 3.46 / 3.46.  Session 24 (H200, one run, 16/32/64
    rows x 2 or 3 stages or two super-blocks per step x split-K to 4/8 programs per SM), best / this tile / the
    session-23 tile, us, Q4_K batch 16: q_b/8 7.80 / 7.80 / 8.04, expert gate+up/8 7.87 / 7.87 / 8.71, down/8 4.21 /
    4.27 / 4.27, expert gate/up 12.52 / 12.52, down 11.82 / 11.82; Q5_K gate/up 13.52 / 13.69, down 12.52 / 12.52.
    lm_head/8 (19360 x 6144, 303 row tiles), second run of that session, launched without PDL (``gguf_mma``
    MMA_PDL_MAX_BLOCKS), 64 rows, split-K 2 / 1 / 4, us: Q4_K batch 4 44.2 / 56.6 / 49.3, batch 8 47.3 / 59.2 / 52.7,
    batch 16 77.2 / 66.1 / 67.7 (32 rows, 3 stages, no split: 66.3); Q5_K batch 4 49.4 / 57.5 / 53.5, batch 16
    84.8 / 75.6 / 74.4 (32 rows, 3 stages: 68.6)."""
    small = triton.cdiv(N, 64) * nb < 4 * sms
    block_n, num_warps = (16, 1) if small and M <= 8 else (32, 2) if small else (64, 2)
    kbs = 2 if block_n == 32 and nb >= 2 else 1
    tiles, steps = triton.cdiv(N, block_n), triton.cdiv(nb, kbs)
    if M > 8 and tiles >= 2 * sms:
        split = 1
    else:
        split = min(steps, triton.cdiv((8 if block_n == 16 else 4) * sms, tiles))
    return block_n, num_warps, triton.cdiv(steps, triton.cdiv(steps, split)), 1 if block_n == 16 else 2, kbs


#: L2 prefetch (``GemvConfig.prefetch``) pays only on large weights.  H200, session 6, same run: lm_head/8
#: (19360 x 6144, 67 MB Q4_K) 2 steps ahead on the tensor-core path took 128 us at 4 rows (152 without), 180 at 16
#: (214); 1 step on the FMA path 50.0 us at 1 row (51.2); 7-13 MB weights were 1-5 % slower with it.
PREFETCH_MIN_BYTES = 32 << 20


@functools.lru_cache(maxsize=4096)
def pick_config(qtype: int, M: int, N: int, K: int, sms: int = 132, dtype: torch.dtype = torch.bfloat16,
                device_name: str = "") -> GemvConfig:
    """Launch parameters for an (M, K) x (N, K)^T product: the measured best for this device, shape and the smallest
    tuned batch >= M (for M = 1: batch 1) where ``tuned/<device_name>.json`` has one, else a heuristic aiming at >=
    4 programs per SM, with L2 prefetch for weights of PREFETCH_MIN_BYTES or more, and int8 activations (``q8``) for
    Q4_K, Q5_K and Q6_K at batches 2..Q8_MAX_M and for Q4_K and Q5_K at batch 1 from Q8_MIN_BYTES_M1 of weight
    (``ahead`` for Q8_AHEAD types at 2..4 rows; at batch 1 ``_q8_row_tile``; Q6_K takes
    tiles of 8 rows, kbs 4 and 2 warps at 5..8 rows, and at 2..4 rows where cdiv(N, 8) row tiles give >= 2 programs
    per SM).  Q4_K and Q5_K take the int8 tensor-core GEMM instead (``mma``, ``_mma_applies``, ``_mma_tile``) at
    5..16 rows, and at 3..4 rows on weights of MMA_MIN_BYTES_M4 with rows of MMA_MIN_BLOCKS_M4.  Neither prefetch nor q8
    nor mma for ``device_name`` "cpu" (the Triton interpreter has no inline PTX; it runs ``q8`` and ``mma`` only when
    asked).  Raises ValueError for a ``qtype`` other than the six GGUF types above, or M, N, K that are not
    positive integers with K a whole number of ``qtype`` blocks."""
    if qtype not in BLOCK_SIZES:
        raise ValueError(f"pick_config: qtype {qtype!r} is not one of {', '.join(_NAMES.values())} (a GGML type id)")
    for name, v in (("M", M), ("N", N), ("K", K)):
        if isinstance(v, bool) or not hasattr(v, "__index__") or v < 1:  # numpy and torch integers too
            raise ValueError(f"pick_config: {name} must be a positive integer, not {v!r}")
    if K % BLOCK_SIZES[qtype][0]:
        raise ValueError(f"pick_config: K={K} is not a whole number of {_NAMES[qtype]} blocks "
                         f"({BLOCK_SIZES[qtype][0]} values)")
    tuned = tuned_configs(device_name) if device_name else {}
    # batch 1 takes only a batch-1 entry: it runs one-row paths, and a multi-row entry there is slow (H200, session
    # 12, one machine: Q8_0 expert gate/up at batch 1 on a batch-2 tensor-core entry 17.5 us, on the heuristic 11.5)
    for m in sorted({key[1] for key in tuned if key[1] >= M and (M > 1 or key[1] == 1)}):
        cfg = tuned.get((qtype, m, N, K))
        if cfg is not None and (not cfg.use_dot or dtype in (torch.bfloat16, torch.float16)):
            return cfg
    nb = K // BLOCK_SIZES[qtype][0]
    weight_bytes = N * nb * BLOCK_SIZES[qtype][1]
    if _mma_applies(qtype, M, nb, weight_bytes) and dtype in (torch.bfloat16, torch.float16) and device_name != "cpu":
        block_n, num_warps, split, stages, kbs = _mma_tile(M, N, nb, sms)
        return GemvConfig(block_n=block_n, kbs=kbs, split_k=split, num_warps=num_warps, block_m=8 if M <= 8 else 16,
                          mma=True, stages=stages)
    if _q8_applies(qtype, nb) and dtype in (torch.bfloat16, torch.float16) and device_name != "cpu" and (
            1 < M <= Q8_MAX_M or (M == 1 and qtype in (Q4_K, Q5_K) and weight_bytes >= Q8_MIN_BYTES_M1)):
        if M == 1:
            (block_n, kbs, num_warps, ahead), per_sm = _q8_row_tile(N, nb, sms), 8
        else:
            block_n, kbs, per_sm, num_warps = _Q8_TILE[qtype][0 if M <= 4 else -1]
            many = _Q8_MANY_ROWS_TILE.get(qtype) if M <= 4 else None
            if many and triton.cdiv(N, many[0]) >= 2 * sms:
                block_n, kbs, num_warps = many
            ahead = qtype in Q8_AHEAD and M <= 4
            kbs = min(kbs, _pow2_at_most(nb))
        steps, tiles = triton.cdiv(nb, kbs), triton.cdiv(N, block_n)
        split = 1 if tiles >= 2 * sms else min(steps, triton.cdiv(per_sm * sms, tiles))
        split = triton.cdiv(steps, triton.cdiv(steps, split))  # no empty splits
        # L2 prefetch as on the fp32 path, not for Q4_K nor at batch 1 (measured without) nor at 5..8 rows (Q6_K's
        # tile then spills)
        prefetch = int(qtype != Q4_K and 1 < M <= 4 and weight_bytes >= PREFETCH_MIN_BYTES)
        return GemvConfig(block_n=block_n, kbs=kbs, split_k=split, num_warps=num_warps, block_m=_pow2_at_least(M),
                          prefetch=prefetch, q8=True, ahead=ahead)
    use_dot = M > 1 and dtype in (torch.bfloat16, torch.float16)
    block_n, kbs = (_DOT_TILE if use_dot else _FMA_TILE)[qtype]
    kbs = min(kbs, _pow2_at_most(nb))
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    m_tiles = triton.cdiv(M, block_m) if use_dot else M
    programs = triton.cdiv(N, block_n) * m_tiles
    steps = triton.cdiv(nb, kbs)
    split = max(1, min(steps, triton.cdiv(4 * sms, programs)))
    split = triton.cdiv(steps, triton.cdiv(steps, split))  # no empty splits
    prefetch = 0
    if device_name != "cpu" and weight_bytes >= PREFETCH_MIN_BYTES:
        prefetch = 2 if use_dot else 1
    return GemvConfig(block_n=block_n, kbs=kbs, split_k=split, num_warps=4 if block_m <= 32 else 8,
                      use_dot=use_dot, block_m=block_m if use_dot else 16, prefetch=prefetch)


def _q8_applies(qtype: int, nb: int) -> bool:
    """Whether the int8-activation kernel can take a ``qtype`` weight of ``nb`` blocks per row (Q6_K: in pairs)."""
    return qtype in Q8_TYPES and (qtype != Q6_K or nb % 2 == 0)


def supports(qtype: int, M: int, N: int, K: int) -> bool:
    """True where ``gguf_linear`` is meant to be used: a supported type, 1 <= M <= MAX_GEMM_M (decode batches up
    to 256 requests; longer prefills stay with the plugin's kernels), K whole blocks; for a split type
    (``gguf_split``) any M >= 1 and K of an even number of blocks."""
    ints = _ints(qtype, M, N, K)
    if ints is None:
        return False
    qtype, M, N, K = ints
    if qtype in SPLIT_QTYPES:  # only glm5serve reads split rows: every batch size
        return M >= 1 and N >= 1 and K > 0 and K % (2 * BLOCK_SIZES[qtype - SPLIT_BASE][0]) == 0
    return qtype in SUPPORTED_QTYPES and 1 <= M <= MAX_GEMM_M and N >= 1 and K > 0 and K % BLOCK_SIZES[qtype][0] == 0


def _index(v, name: str, fn: str) -> int:
    """``v`` as a Python int (numpy and torch integers too: Triton's launcher takes only int); raises ValueError
    naming ``fn`` unless it is an integer (``operator.index``) >= 0, bool excluded."""
    try:
        i = operator.index(v)
    except TypeError:
        i = -1
    if isinstance(v, bool) or i < 0:
        raise ValueError(f"{fn}: {name}={v!r} must be an int >= 0")
    return i


def _ints(*vals) -> tuple[int, ...] | None:
    """``vals`` as Python ints (``operator.index``: numpy and torch integers too), or None where one is not an
    integer or is a bool: the predicates (``supports``, ``supports_moe``) answer False for those."""
    try:
        out = tuple(operator.index(v) for v in vals)
    except TypeError:
        return None
    return None if any(isinstance(v, bool) for v in vals) else out


def _check_tensors(fn: str, **tensors) -> None:
    """Raise ValueError naming ``fn`` and the argument unless each value is a torch.Tensor."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")


def type_id(v, fn: str, name: str = "qtype") -> int:
    """``v`` as a GGML or split type id: an integer (``gguf.GGMLQuantizationType``, numpy and torch integers too),
    bool excluded.  Raises ValueError naming ``fn`` for anything else (``int()`` would read 12.7 as Q4_K and fail
    on "Q4_K" or None with a message that names neither the function nor the argument)."""
    ints = _ints(v)
    if ints is None:
        raise ValueError(f"{fn}: {name}={v!r} is not a GGML type id (an int, e.g. gguf.GGMLQuantizationType.Q4_K)")
    return ints[0]


def _check_config(config, fn: str) -> None:
    """Raise ValueError unless ``config`` is None or a ``GemvConfig``."""
    if config is not None and not isinstance(config, GemvConfig):
        raise ValueError(f"{fn}: config must be a GemvConfig or None, got {type(config).__name__}")


def _check(x: torch.Tensor, qweight: torch.Tensor, qtype: int, N: int, fn: str = "gguf kernels") -> int:
    """Validate a GEMV's arguments (x (M, K), qweight (>= N, >= row_bytes) uint8 with contiguous rows, on x's
    device, N an integer >= 0: callers pass int(N) on); returns K.  Raises ValueError naming what does not fit."""
    if qtype not in SUPPORTED_QTYPES:
        raise ValueError(f"{fn}: unsupported GGML type {qtype} (supported: {sorted(_NAMES.values())})")
    _check_tensors(fn, x=x, qweight=qweight)
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{fn}: x must be (M, K) bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    if qweight.dim() != 2 or qweight.dtype != torch.uint8 or qweight.stride(-1) != 1:
        raise ValueError(f"{fn}: qweight must be (rows, bytes) uint8 with contiguous rows, got "
                         f"{tuple(qweight.shape)} {qweight.dtype} strides {qweight.stride()}")
    if qweight.device != x.device:
        raise ValueError(f"{fn}: x is on {x.device}, qweight on {qweight.device}")
    N = _index(N, "N", fn)
    qk, qb = BLOCK_SIZES[qtype]
    K = x.shape[1]
    if K % qk or K // qk * qb > qweight.shape[-1] or qweight.shape[0] < N:
        per_row = "" if K % qk else f", {K // qk * qb} bytes per row"
        raise ValueError(f"{fn}: {_NAMES[qtype]} weight {tuple(qweight.shape)} does not hold {N} rows of "
                         f"K={K} (K must be a multiple of {qk}{per_row})")
    return K


def _check_out(out: torch.Tensor, N: int, K: int, dtype: torch.dtype, device: torch.device, fn: str) -> None:
    """Raise ValueError unless ``out`` is an (N, K) ``dtype`` tensor on ``device`` with contiguous, disjoint rows
    (the dequantizers store row n at out + n * stride(0))."""
    if out.shape != (N, K) or out.dtype != dtype or out.device != device or (K > 1 and out.stride(1) != 1) \
            or (N > 1 and out.stride(0) < K):
        raise ValueError(f"{fn}: out must be ({N}, {K}) {dtype} on {device} with contiguous rows, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}, strides {out.stride()}")


def _as_words(qweight: torch.Tensor, qtype: int, unit: int | None = None) -> torch.Tensor:
    """The weight as the decoders read it: Q4_K/Q5_K as int32 words (16-byte vector loads), the other types as the
    uint8 tensor whose blocks (18, 22, 34, 210 bytes) they read as uint16 pairs.  Blocks are whole units (4 or 2
    bytes), so trailing row padding is cut to whole units, and a view whose start or row stride is not a whole
    unit (odd padding) is copied: a misaligned vector load is a CUDA fault.  ``unit=4`` asks for int32 words of any
    type (rows of an even number of Q6_K blocks, ``gguf_gemv_q8``)."""
    unit = unit or (4 if qtype in _WORD_TYPES else 2)
    qweight = qweight[..., :qweight.shape[-1] // unit * unit]
    if qweight.data_ptr() % unit or any(s % unit for s in qweight.stride()[:-1]):
        # not .contiguous(): it keeps the odd stride of a size-1 dimension, which torch's view then refuses
        qweight = torch.empty_like(qweight, memory_format=torch.contiguous_format).copy_(qweight)
    return qweight.view(torch.int32) if unit == 4 else qweight


def dequantize_rows(qweight: torch.Tensor, qtype: int, K: int, N: int | None = None,
                    dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize the first N rows of a raw GGUF weight on the GPU with the GEMV's decoder (weights rounded once
    to ``dtype``).

    Args:
        qweight: (>= N, >= row_bytes) uint8 raw GGUF rows (row_bytes = K / block_elems * block_bytes).
        qtype: GGML type id (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K), or a split type id (``gguf_split``).
        K: elements per row; N: rows (default: all).
        dtype: output dtype (bf16, fp16 or fp32); ``out``: optional (N, K) destination with contiguous rows.
    Returns:
        (N, K) tensor, numpy layout (row n = output feature n), as gguf-py ``dequantize`` gives it.
    Raises:
        ValueError: unsupported type or inconsistent shapes.
    """
    qtype = type_id(qtype, "dequantize_rows")
    _check_tensors("dequantize_rows", qweight=qweight)
    if qtype in SPLIT_QTYPES:
        from glm5serve.kernels.gguf_split import dequantize_split_rows

        return dequantize_split_rows(qweight, qtype, K, N, dtype, out)
    N = _index((qweight.shape[0] if qweight.dim() else 0) if N is None else N, "N", "dequantize_rows")
    K = _index(K, "K", "dequantize_rows")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dequantize_rows: dtype {dtype} is not bf16/fp16/fp32")
    _check(torch.empty((0, K), dtype=dtype, device=qweight.device), qweight, qtype, N, "dequantize_rows")
    if out is None:
        out = torch.empty((N, K), dtype=dtype, device=qweight.device)
    _check_out(out, N, K, dtype, qweight.device, "dequantize_rows")
    if N == 0:
        return out
    nb = K // BLOCK_SIZES[qtype][0]
    bn, kbs = _DEQUANT_TILE[qtype]
    kbs = min(kbs, _pow2_at_most(nb))
    w = _as_words(qweight, qtype)
    _dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(nb, kbs))](w, out, N, nb, w.stride(0), out.stride(0),
                                                                 QTYPE=qtype, BLOCK_N=bn, KBS=kbs, num_warps=4)
    return out


#: bf16 scratch per dequantize + cuBLAS chunk (rows are dequantized this many bytes at a time)
DEQUANT_CHUNK_BYTES = 64 << 20


def _dequant_matmul(x: torch.Tensor, qweight: torch.Tensor, qtype: int, N: int, K: int) -> torch.Tensor:
    """y = x @ W.T for batches past MAX_FAST_M rows: W dequantized to x's dtype in chunks of rows, then cuBLAS."""
    rows = max(64, DEQUANT_CHUNK_BYTES // (2 * K) // 64 * 64)
    if rows >= N:
        return x @ dequantize_rows(qweight, qtype, K, N, x.dtype).T
    y = x.new_empty((x.shape[0], N))
    scratch = torch.empty((rows, K), dtype=x.dtype, device=x.device)
    for n0 in range(0, N, rows):
        n = min(rows, N - n0)
        w = dequantize_rows(qweight[n0:n0 + n], qtype, K, n, x.dtype, out=scratch[:n])
        y[:, n0:n0 + n] = x @ w.T
    return y


def gguf_linear(x: torch.Tensor, qweight: torch.Tensor, qtype: int, N: int,
                config: GemvConfig | None = None) -> torch.Tensor:
    """y = x @ dequantize(qweight)[:N].T for a GGUF-quantized weight.

    Args:
        x: (M, K) bf16/fp16 (fp32 accepted) activations, any M (meant for M <= MAX_GEMM_M, see ``supports``).
        qweight: (>= N, >= row_bytes) uint8 raw GGUF rows, ``row_bytes = K / block_elems * block_bytes``;
            extra columns (padding, as the plugin's merged weights have) are ignored.  Rows must be contiguous.
        qtype: GGML type id, one of Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K; or a split type id: split rows of
            Q4_0/Q5_0/Q8_0/Q6_K (``gguf_split.gguf_linear_split``, any M).
        N: output features (rows of the weight used).
        config: launch parameters (default: ``pick_config``; ``q8`` applies to Q8_TYPES with bf16/fp16 x and
            is ignored otherwise; for bf16/fp16 x of more than MAX_FAST_M rows the
            default is no fused kernel: W is dequantized to x's dtype, DEQUANT_CHUNK_BYTES at a time, and
            multiplied by cuBLAS, which past decode batches beats dequantizing in every program).
    Returns:
        (M, N) in x's dtype; accumulation in fp32.  On the ``q8`` path x is first rounded to int8 blocks of 32
        (error bound in ``gguf_gemv_q8``), as llama.cpp's CUDA backend and the plugin's ``*_a8`` kernels do; on the
        ``mma`` path of Q4_K / Q5_K / Q6_K split rows to int8 blocks of 256 (llama.cpp's ``Q8_K``, error bound in
        ``gguf_mma``), of Q8_0 / Q4_0 split rows to blocks of 32.
    Raises:
        ValueError: unsupported type (or a qtype that is not an integer), inconsistent shapes, a config that is not
            a ``GemvConfig``.
    Capture-safe under CUDA graphs: no host synchronisation; buffers come from torch's caching allocator.
    """
    qtype = type_id(qtype, "gguf_linear")
    _check_config(config, "gguf_linear")
    if qtype in SPLIT_QTYPES:
        from glm5serve.kernels.gguf_split import gguf_linear_split

        return gguf_linear_split(x, qweight, qtype, N, config)
    K, N = _check(x, qweight, qtype, N, "gguf_linear"), int(N)  # N: numpy or torch ints too (checked)
    M = x.shape[0]
    if M == 0 or N == 0 or K == 0:
        return x.new_zeros((M, N))
    if x.stride(1) != 1:
        x = x.contiguous()
    qk, _ = BLOCK_SIZES[qtype]
    nb = K // qk
    if config is None and M > MAX_FAST_M and x.dtype in (torch.bfloat16, torch.float16):
        return _dequant_matmul(x, qweight, qtype, N, K)
    if config is None:
        sms, device_name = _device_info(x.device)
        config = pick_config(qtype, M, N, K, sms, x.dtype, device_name)
    if config.mma and qtype in MMA_MIN_BYTES_M4 and x.dtype != torch.float32 and config.block_n >= 16:
        from glm5serve.kernels.gguf_mma import gguf_linear_mma

        return gguf_linear_mma(x, qweight, qtype, N, config.block_n, config.split_k, config.num_warps,
                               8 if config.block_m <= 8 else 16, config.stages, kbs=min(config.kbs, 2))
    if config.q8 and _q8_applies(qtype, nb) and x.dtype != torch.float32:
        from glm5serve.kernels.gguf_gemv_q8 import gguf_linear_q8

        kbs = max(config.kbs, 2) if qtype == Q6_K else config.kbs  # Q6_K blocks are read in pairs
        return gguf_linear_q8(x, qweight, qtype, N, config.block_n, kbs, config.split_k, config.num_warps,
                              config.prefetch, block_m=min(config.block_m, Q8_MAX_M, _pow2_at_least(M)),
                              ahead=config.ahead)
    G, T = tile_shape(qtype, config.kbs)
    use_dot = config.use_dot and x.dtype != torch.float32 and config.block_n >= 16 and G * T >= 16
    block_m = config.block_m if use_dot else 1
    w = _as_words(qweight, qtype)
    blocks_per_split = triton.cdiv(triton.cdiv(nb, config.split_k), config.kbs) * config.kbs
    split = triton.cdiv(nb, blocks_per_split)
    grid = (triton.cdiv(N, config.block_n), split, triton.cdiv(M, block_m))
    y, part, counters = _split_outputs(x, N, grid, block_m)
    pdl = pdl_value(x.device, blocks_per_split // config.kbs)
    prefetch = config.prefetch if x.device.type == "cuda" else 0  # inline PTX: not under the interpreter
    _gemv_kernel[grid](x, w, y, part, counters, M, N, nb, blocks_per_split, x.stride(0), w.stride(0), y.stride(0),
                       QTYPE=qtype, BLOCK_M=block_m, BLOCK_N=config.block_n, KBS=config.kbs, G=G, T=T,
                       USE_DOT=use_dot, SPLIT_K=split, PREFETCH=prefetch, PDL=pdl, num_warps=config.num_warps,
                       **pdl_launch(pdl))
    return y

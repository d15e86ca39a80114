"""Q4_0, Q5_0, Q8_0 and Q6_K weights regrouped at load time into split rows, and their int8-activation GEMV.

GGUF's legacy blocks (gguf-py ``gguf/quants.py``; llama.cpp ``block_q4_0`` / ``block_q5_0`` / ``block_q8_0`` in
ggml/src/ggml-common.h) start with an fp16 scale d, so their 18-, 22- and 34-byte blocks are only 2-byte aligned:
read in place, the codes come as uint16 pairs, and three in-place layouts of an int8-activation kernel for Q8_0 ran
slower than the fp32 decode (``gguf_gemv_q8``).  A split row holds the same bytes of the row, regrouped by field::

    Q8_0: qs[32 nb] | d[2 nb]        Q4_0: qs[16 nb] | d[2 nb]        Q5_0: qs[16 nb] | qh[4 nb] | d[2 nb]

(nb blocks per row, each field in block order), so a weight keeps its shape, its byte count and its row slices
(tensor-parallel shards, fused shards), and the codes of consecutive blocks are consecutive int32 words: 16-byte
loads, contiguous across a warp's lanes, multiplied with ``dp4a`` against int8 activations with llama.cpp's
arithmetic (``vec_dot_q8_0_q8_1`` / ``vec_dot_q4_0_q8_1`` / ``vec_dot_q5_0_q8_1``, ggml/src/ggml-cuda/vecdotq.cuh),
except that the ``- 8`` / ``- 16`` code offset of Q4_0/Q5_0 is applied to the codes themselves (signed codes,
``_step_split``), not to the float sum of the block's activations: the whole weight then meets the rounded
activations, whose error scales with |d (u - 8)| instead of |d u|, about half (H200, a 2048 x 6144 Q4_0 weight:
relative error 0.0105 with float sums).

Q6_K's 210-byte blocks (``block_q6_K``: ql[128] | qh[64] | int8 scales[16] | d) are 2-byte aligned as well, and
their codes are spread over ql and qh so that one 32-element activation block needs bytes from both halves of ql.
Its split row re-lays the same bits per 32-element group (the layout in ``_step_split``)::

    Q6_K: qs[16 nb] | qh[8 nb] | scales[2 nb] | d[2 nb / 8]        (nb 32-element groups per row)

so each group reads like a Q4_0 block plus two qh words and two scales (llama.cpp's ``vec_dot_q6_K_q8_1`` takes
the same products in another order).  Regrouping quantized weights at load for the kernel that reads them is
what llama.cpp's CPU backend does for Q4_0 (ggml-cpu/repack.cpp) and vLLM does for GPTQ (``gptq_marlin_repack``).

A split weight carries its own type id, ``SPLIT_BASE`` + the GGML id (``split_type``), so it can never be read as
GGUF bytes by mistake: ``gguf_linear`` and ``dequantize_rows`` take it at any batch size, and ``kernels.vllm_ops``
sends every call of a split type here (the plugin's kernels cannot read it).  Rows of an odd number of blocks stay
GGUF (a row must be whole int32 words; ``can_split``).
"""
from __future__ import annotations

import math
import numbers
import operator

import torch
import triton
import triton.language as tl

from glm5serve.kernels.gguf_gemv import (
    BLOCK_SIZES,
    MAX_FAST_M,
    Q4_0,
    Q5_0,
    Q6_K,
    Q8_0,
    SPLIT_BASE,
    SPLIT_QTYPES,
    _NAMES,
    GemvConfig,
    _as_words,
    _check_config,
    _check_out,
    _check_tensors,
    _index,
    _gdc_wait,
    _ints,
    _pow2_at_least,
    _pow2_at_most,
    _prefetch_lines,
    _split_outputs,
    _write_tile,
    env_choice,
    pdl_launch,
    pdl_value,
    type_id,
)
from glm5serve.kernels.gguf_gemv_q8 import _dp4a, _split8, quantize_activations
from glm5serve.kernels.gguf_mma import SPLIT_MMA_TYPES, gguf_linear_split_mma

SPLITTABLE = frozenset({Q4_0, Q5_0, Q8_0, Q6_K})  # split type id: SPLIT_BASE (0x100) + GGML type id
MAX_BLOCK_M = 16  # activation rows per program of the split-row GEMV
#: (bytes of codes, bytes of qh) per block; the fp16 d of every block follows them
_FIELDS = {Q8_0: (32, 0), Q4_0: (16, 0), Q5_0: (16, 4)}
# int32 words 0x88888888 and 0xF0F0F0F0 (as signed values, so Triton keeps them int32)
_MINUS_8 = tl.constexpr(0x88888888 - (1 << 32))
_TOP_NIBBLES = tl.constexpr(0xF0F0F0F0 - (1 << 32))
_TOP_2BITS = tl.constexpr(0xC0C0C0C0 - (1 << 32))
_SIGN_BITS = tl.constexpr(0x80808080 - (1 << 32))


def split_type(qtype: int) -> int:
    """The split-row type id of GGML type ``qtype`` (Q4_0, Q5_0, Q8_0 or Q6_K)."""
    qtype = type_id(qtype, "split_type")
    if qtype not in SPLITTABLE:
        raise ValueError(f"split_type: no split layout for {_NAMES.get(qtype, f'GGML type {qtype}')}")
    return SPLIT_BASE + qtype


def base_type(stype: int) -> int:
    """The GGML type id of split type ``stype`` (``stype`` itself when it is not a split type)."""
    stype = type_id(stype, "base_type", "stype")
    return stype - SPLIT_BASE if stype in SPLIT_QTYPES else stype


def type_name(qtype: int) -> str:
    """``Q8_0`` for a GGML id, ``Q8_0/split`` for its split id."""
    q = base_type(qtype)
    return _NAMES.get(q, f"GGML type {q}") + ("/split" if q != qtype else "")


def can_split(qtype: int, K: int) -> bool:
    """Whether rows of K elements of ``qtype`` have a split layout: a splittable type and an even number of
    blocks (the codes are read as int32 words; rows of 34 nb or 210 nb bytes are whole words only for even nb)."""
    ints = _ints(qtype)
    if ints is None:
        return False
    qtype = ints[0]
    return (qtype in SPLITTABLE and isinstance(K, numbers.Integral) and K > 0
            and K % (2 * BLOCK_SIZES[qtype][0]) == 0)


def _q6_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q6_K blocks (..., 210) uint8 -> their 256 six-bit codes q (..., 256) uint8, in element order: element
    128 n + 64 h + 32 c + l is nibble h of ``ql[64 n + 32 c + l]`` with bits 2 c + 4 h of ``qh[32 n + l]`` above it
    (llama.cpp ``dequantize_row_q6_K``, ggml/src/ggml-quants.c)."""
    ql = blocks[..., :128].reshape(*blocks.shape[:-1], 2, 1, 2, 32)  # (n, h, c, l)
    qh = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 1, 1, 32)
    h = torch.arange(2, device=blocks.device).view(2, 1, 1)
    c = torch.arange(2, device=blocks.device).view(1, 2, 1)
    q = ((ql >> (4 * h)) & 0xF) | (((qh >> (2 * c + 4 * h)) & 3) << 4)
    return q.reshape(*blocks.shape[:-1], 256).to(torch.uint8)


def _q6_k_blocks(q: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_q6_k_codes``: codes (..., 256) and the blocks' scales | d bytes (..., 18) -> blocks."""
    q = q.to(torch.int32).reshape(*q.shape[:-1], 2, 2, 2, 32)  # (n, h, c, l)
    ql = (q[..., 0, :, :] & 0xF) | ((q[..., 1, :, :] & 0xF) << 4)
    h = torch.arange(2, device=q.device).view(2, 1, 1)
    c = torch.arange(2, device=q.device).view(1, 2, 1)
    qh = ((q >> 4) << (2 * c + 4 * h)).sum(dim=(-3, -2))
    lead = q.shape[:-4]
    return torch.cat([ql.reshape(*lead, 128).to(torch.uint8), qh.reshape(*lead, 64).to(torch.uint8), tail], dim=-1)


def _q6_k_split(blocks: torch.Tensor) -> torch.Tensor:
    """(rows, nb, 210) GGUF Q6_K blocks -> (rows, 210 nb) split rows: for each 32-element group g (8 per block,
    row-wide index 8 kb + g), qs[16] | qh[8] of all groups, then the int8 scales and the fp16 d of all blocks
    (layout in ``_step_split``)."""
    n, nb = blocks.shape[:2]
    q = _q6_k_codes(blocks).to(torch.int32).reshape(n, nb * 8, 2, 16)  # (group, half, j): element 32 g + 16 half + j
    low, high = q & 0xF, q >> 4
    qs = low[..., 0, :] | (low[..., 1, :] << 4)
    hb = high.reshape(n, nb * 8, 2, 2, 2, 4)  # (group, half, p, r, b): j = 4 (2 p + r) + b
    ar = torch.arange(2, device=q.device)
    qh = (hb << (2 * ar.view(2, 1, 1, 1) + 4 * ar.view(1, 1, 2, 1))).sum(dim=(2, 4))  # byte 4 p + b of the group
    return torch.cat([qs.reshape(n, -1).to(torch.uint8), qh.reshape(n, -1).to(torch.uint8),
                      blocks[..., 192:208].reshape(n, -1), blocks[..., 208:].reshape(n, -1)], dim=-1)


def _q6_k_join(rows: torch.Tensor, nb: int) -> torch.Tensor:
    """The inverse of ``_q6_k_split``: (rows, 210 nb) split rows -> (rows, nb, 210) GGUF blocks."""
    n, g = rows.shape[0], nb * 8
    qs = rows[:, :16 * g].to(torch.int32).reshape(n, g, 1, 16)
    qh = rows[:, 16 * g:24 * g].to(torch.int32).reshape(n, g, 1, 2, 1, 4)
    ar = torch.arange(2, device=rows.device)
    low = (qs >> (4 * ar.view(2, 1))) & 0xF  # (group, half, j)
    high = (qh >> (2 * ar.view(2, 1, 1, 1) + 4 * ar.view(1, 1, 2, 1))) & 3  # (group, half, p, r, b)
    q = (low | (high.reshape(n, g, 2, 16) << 4)).reshape(n, nb, 256)
    tail = torch.cat([rows[:, 24 * g:26 * g].reshape(n, nb, 16), rows[:, 26 * g:].reshape(n, nb, 2)], dim=-1)
    return _q6_k_blocks(q, tail)


def _regroup(qweight: torch.Tensor, qtype: int, K: int, to_split: bool, fn: str) -> torch.Tensor:
    qtype = type_id(qtype, fn)
    _check_tensors(fn, qweight=qweight)
    if qtype not in SPLITTABLE:
        raise ValueError(f"{fn}: no split layout for {type_name(qtype)}")
    K = _index(K, "K", fn)
    if not can_split(qtype, K):
        raise ValueError(f"{fn}: {type_name(qtype)} rows of K={K} have no split layout (need an even number "
                         f"of {BLOCK_SIZES[qtype][0]}-element blocks)")
    qk, bb = BLOCK_SIZES[qtype]
    nb = K // qk
    rb = nb * bb
    if qweight.dtype != torch.uint8 or qweight.shape[-1] < rb:
        raise ValueError(f"{fn}: {type_name(qtype)} weight {tuple(qweight.shape)} {qweight.dtype} does not "
                         f"hold uint8 rows of {rb} bytes (K={K})")
    out = qweight.clone()
    n = math.prod(qweight.shape[:-1])
    if n == 0:
        return out
    rows = qweight[..., :rb].reshape(n, rb)
    if qtype == Q6_K:
        new = _q6_k_split(rows.reshape(n, nb, bb)) if to_split else _q6_k_join(rows, nb).reshape(n, rb)
    elif to_split:  # GGUF block: d | (qh) | qs
        qh = _FIELDS[qtype][1]
        blocks = rows.reshape(n, nb, bb)
        parts = (blocks[..., 2 + qh:], blocks[..., 2:2 + qh], blocks[..., :2])
        new = torch.cat([p.reshape(n, -1) for p in parts], dim=-1)
    else:
        qs, qh = _FIELDS[qtype]
        codes = rows[:, :nb * qs].reshape(n, nb, qs)
        hbits = rows[:, nb * qs:nb * (qs + qh)].reshape(n, nb, qh)
        d = rows[:, nb * (qs + qh):].reshape(n, nb, 2)
        new = torch.cat([d, hbits, codes], dim=-1).reshape(n, rb)
    out[..., :rb] = new.reshape(*qweight.shape[:-1], rb)
    return out


def split_rows(qweight: torch.Tensor, qtype: int, K: int) -> torch.Tensor:
    """Raw GGUF rows -> split rows (module docstring), on the tensor's device.

    Args:
        qweight: (..., >= row_bytes) uint8 GGUF rows of ``qtype`` (Q4_0, Q5_0, Q8_0 or Q6_K), row_bytes = K / block
            elements * block bytes; columns past row_bytes (padding) are copied unchanged.
        K: elements per row, an even number of blocks (``can_split``: 32 elements, Q6_K 256).
    Returns:
        A new tensor of the same shape and dtype whose first row_bytes of every row are the split row; its type id
        is ``split_type(qtype)``.
    Raises:
        ValueError: another type, K of an odd number of blocks, or rows shorter than row_bytes.
    """
    return _regroup(qweight, qtype, K, True, "split_rows")


def join_rows(split: torch.Tensor, qtype: int, K: int) -> torch.Tensor:
    """The inverse of ``split_rows``: split rows of GGML type ``qtype`` (the base id, or its split id) back to GGUF
    rows; raises ValueError as ``split_rows``."""
    return _regroup(split, base_type(type_id(qtype, "join_rows")), K, False, "join_rows")


# ---------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _split4(v, A: tl.constexpr, B: tl.constexpr):
    """The 4 slices [A, B] of v [A, B, 4] along its last axis, in the order t = 0, 2, 1, 3 (no shuffles)."""
    e, o = tl.split(tl.reshape(v, (A, B, 2, 2)))
    a0, a1 = tl.split(e)
    b0, b1 = tl.split(o)
    return a0, a1, b0, b1


@triton.jit
def _dp4a_bcast(w, x, acc, EMULATE: tl.constexpr):
    """acc [BM, BN, G] + dp4a of weight words w [BN, G] with activation words x [BM, G]."""
    shape: tl.constexpr = acc.shape
    return _dp4a(tl.broadcast_to(w[None, :, :], shape), tl.broadcast_to(x[:, None, :], shape), acc, EMULATE)


@triton.jit
def _fifth_bits(qh, t: tl.constexpr):
    """Bits 4t..4t+3 of the qh words [BN, G] moved to bit 4 of bytes 0..3: one multiply spreads the 4 bits 7 apart
    (bit b lands on 4 + 8b; the four shifted copies do not overlap, so nothing carries)."""
    return (((qh >> (4 * t)) & 0xF) * 0x02040810) & 0x10101010


@triton.jit
def _step_split(acc, row_ptr, d_ptr, qh_ptr, sc_ptr, b0, end, nb, xw_ptr, xd_ptr, mrow, mmask,
                QTYPE: tl.constexpr, KBS: tl.constexpr, EMULATE: tl.constexpr):
    """Blocks b0 .. b0 + KBS - 1 (those from ``end`` masked off) of BLOCK_N split rows against BLOCK_M rows of int8
    activations (xw_ptr: codes as int32 words, xd_ptr: fp32 block scales); acc [BLOCK_M, BLOCK_N, KBS] fp32.
    row_ptr: int32 word pointers to the rows' codes ([BLOCK_N]), d_ptr: uint16 pointers to their scales, qh_ptr:
    int32 pointers to their qh words (Q5_0, Q6_K), sc_ptr: int16 pointers to their scale pairs (Q6_K).

    Q8_0: word t of block kb is codes 4t..4t+3 (int8), against activation word 8 kb + t.  Q4_0/Q5_0: word t holds
    in byte b element 4t + b (low nibble) and 16 + 4t + b (high nibble), against activation words 8 kb + t and
    8 kb + 4 + t; Q5_0's fifth bit of element i is bit i of the block's qh word.  Weight d * q (Q8_0), d * (u - 8)
    (Q4_0), d * (u - 16) (Q5_0), gguf-py ``Q8_0`` / ``Q4_0`` / ``Q5_0.dequantize_blocks``.  The offset is folded
    into the codes: u ^ 8 read as a 4-bit two's complement number is u - 8 (u ^ 16 as a 5-bit one is u - 16), so
    moved to the top of its byte it is the signed byte 16 (u - 8) (Q4_0) or 8 (u - 16) (Q5_0), and dp4a sums
    (u - OFFSET) q_x exactly, times that power of two.

    Q6_K (nb counts 32-element groups, 8 per 256-element block): group g's codes are laid out as Q4_0's (word t,
    byte b: the low 4 bits of elements 4t + b and 16 + 4t + b), and the top 2 bits of each code are in its 2 qh
    words: word p, byte b holds at bits 4r and 4r + 2 those of elements 4t + b and 16 + 4t + b, t = 2p + r.  Both
    halves of a group have an int8 scale (elements 0-15 and 16-31: the block's scales 2g' and 2g' + 1); the
    block's fp16 d covers 8 groups.  u - 32 is the 6-bit two's complement number u ^ 32, so the top-aligned byte
    ((low << 2) | (top << 6)) ^ 0x80 is 4 (u - 32).  Weight d * scale * (u - 32) (gguf-py ``Q6_K``)."""
    q, xa, xb, qh, sc = _load_codes(row_ptr, qh_ptr, sc_ptr, b0, end, nb, xw_ptr, mrow, mmask, QTYPE, KBS)
    dot = _dot_split(q, xa, xb, qh, sc, mrow.shape[0], QTYPE, EMULATE)
    # scales loaded after the integer products: loaded with the codes, Q5_0 at 16 rows spills 8 bytes (Triton 3.8)
    dw, dx = _load_scales(d_ptr, xd_ptr, b0, end, nb, mrow, mmask, QTYPE, KBS)
    return _scale_split(acc, dot, dw, dx, QTYPE)


@triton.jit
def _load_codes(row_ptr, qh_ptr, sc_ptr, b0, end, nb, xw_ptr, mrow, mmask, QTYPE: tl.constexpr, KBS: tl.constexpr):
    """The integer loads of ``_step_split``: code words q ([BN, KBS, 8] Q8_0, else [BN, KBS, 4]), activation words
    xa / xb ([BM, KBS, 8] both Q8_0's; else those of the low / high half of each block, [BM, KBS, 4]), qh words ([BN,
    KBS, 2] Q6_K, [BN, KBS] Q5_0, else q) and Q6_K's int16 scale pairs sc ([BN, KBS], else q)."""
    kb = b0 + tl.arange(0, KBS)
    bmask = kb < end
    xmask = mmask[:, None, None] & bmask[None, :, None]
    xrow = (mrow * nb * 8)[:, None, None] + (kb * 8)[None, :, None]  # activation words of each block
    if QTYPE == 8:
        t = tl.arange(0, 8)
        q = tl.load(row_ptr[:, None, None] + (kb * 8)[None, :, None] + t[None, None, :], mask=bmask[None, :, None],
                    other=0, eviction_policy="evict_first")
        xa = tl.load(xw_ptr + xrow + t[None, None, :], mask=xmask, other=0)
        xb = xa
    else:  # Q4_0, Q5_0, Q6_K: 4 code words of 8 codes per 32 elements
        t = tl.arange(0, 4)
        q = tl.load(row_ptr[:, None, None] + (kb * 4)[None, :, None] + t[None, None, :], mask=bmask[None, :, None],
                    other=0, eviction_policy="evict_first")
        xa = tl.load(xw_ptr + xrow + t[None, None, :], mask=xmask, other=0)
        xb = tl.load(xw_ptr + xrow + 4 + t[None, None, :], mask=xmask, other=0)
    qh = q
    sc = q
    if QTYPE == 14:
        p = tl.arange(0, 2)
        qh = tl.load(qh_ptr[:, None, None] + (kb * 2)[None, :, None] + p[None, None, :], mask=bmask[None, :, None],
                     other=0, eviction_policy="evict_first")
        sc = tl.load(sc_ptr[:, None] + kb[None, :], mask=bmask[None, :], other=0)
    elif QTYPE == 6:
        qh = tl.load(qh_ptr[:, None] + kb[None, :], mask=bmask[None, :], other=0)
    return q, xa, xb, qh, sc


@triton.jit
def _load_scales(d_ptr, xd_ptr, b0, end, nb, mrow, mmask, QTYPE: tl.constexpr, KBS: tl.constexpr):
    """The float loads of ``_step_split``: the weights' raw fp16 d (uint16 [BN, KBS]; Q6_K: one per 8 groups) and
    the activation scales dx ([BM, KBS] fp32)."""
    kb = b0 + tl.arange(0, KBS)
    bmask = kb < end
    dw = tl.load(d_ptr[:, None] + (kb // 8 if QTYPE == 14 else kb)[None, :], mask=bmask[None, :], other=0)
    dx = tl.load(xd_ptr + (mrow * nb)[:, None] + kb[None, :], mask=mmask[:, None] & bmask[None, :], other=0.0)
    return dw, dx


@triton.jit
def _dot_split(q, xa, xb, qh, sc, BM: tl.constexpr, QTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """The integer products of ``_step_split`` on what ``_load_codes`` returns: [BM, BN, KBS] int32, the blocks' dot
    products (Q4_0 / Q5_0 / Q6_K: 16 / 8 / 4 times them; Q6_K's with its int8 scales applied)."""
    BN: tl.constexpr = q.shape[0]
    KBS: tl.constexpr = q.shape[1]
    if QTYPE == 8:
        dot = tl.zeros((BM, BN, KBS), dtype=tl.int32)
        qw = _split8(q, BN, KBS)
        xv = _split8(xa, BM, KBS)
        for i in tl.static_range(8):
            dot = _dp4a_bcast(qw[i], xv[i], dot, EMULATE)
    else:
        xlo = _split4(xa, BM, KBS)
        xhi = _split4(xb, BM, KBS)
        qw = _split4(q, BN, KBS)
        if QTYPE == 14:
            qh0, qh1 = tl.split(qh)
            dlo = tl.zeros((BM, BN, KBS), dtype=tl.int32)
            dhi = tl.zeros((BM, BN, KBS), dtype=tl.int32)
            for i in tl.static_range(4):
                # slice i is word t = (i % 2) * 2 + i // 2 (``_split4`` order): qh word p = i % 2, r = i // 2
                if i % 2 == 0:
                    qhw = qh0
                else:
                    qhw = qh1
                lo = (((qw[i] << 2) & 0x3C3C3C3C) | ((qhw << (6 - 4 * (i // 2))) & _TOP_2BITS)) ^ _SIGN_BITS
                hi = (((qw[i] >> 2) & 0x3C3C3C3C) | ((qhw << (4 - 4 * (i // 2))) & _TOP_2BITS)) ^ _SIGN_BITS
                dlo = _dp4a_bcast(lo, xlo[i], dlo, EMULATE)
                dhi = _dp4a_bcast(hi, xhi[i], dhi, EMULATE)
            sc = sc.to(tl.int32)
            dot = dlo * ((sc << 24) >> 24)[None, :, :] + dhi * (sc >> 8)[None, :, :]
        else:
            dot = tl.zeros((BM, BN, KBS), dtype=tl.int32)
            if QTYPE == 6:
                qh = ~qh  # inverted fifth bits: the codes become u ^ 16 (see ``_step_split``)
            for i in tl.static_range(4):
                if QTYPE == 6:
                    # slice i is word (i % 2) * 2 + i // 2 (``_split4`` order)
                    lo = ((qw[i] & 0x0F0F0F0F) | _fifth_bits(qh, (i % 2) * 2 + i // 2)) << 3
                    hi = (((qw[i] >> 4) & 0x0F0F0F0F) | _fifth_bits(qh, (i % 2) * 2 + i // 2 + 4)) << 3
                else:
                    w = qw[i] ^ _MINUS_8  # every nibble u -> u ^ 8
                    lo = (w << 4) & _TOP_NIBBLES
                    hi = w & _TOP_NIBBLES
                dot = _dp4a_bcast(lo, xlo[i], dot, EMULATE)
                dot = _dp4a_bcast(hi, xhi[i], dot, EMULATE)
    return dot


@triton.jit
def _scale_split(acc, dot, dw, dx, QTYPE: tl.constexpr):
    """acc + each block's dot product ``_dot_split`` times its weight scale d (raw fp16 ``dw``) and activation
    scale ``dx`` (``_load_scales``)."""
    d = dw.to(tl.float16, bitcast=True).to(tl.float32)[None, :, :]
    if QTYPE == 8:
        return acc + d * dx[:, None, :] * dot.to(tl.float32)
    # dot is 16 (Q4_0), 8 (Q5_0) or 4 (Q6_K) times the integer sum; |dot| < 2^27, so the power-of-two scale is exact
    UNSCALE: tl.constexpr = 0.25 if QTYPE == 14 else 0.125 if QTYPE == 6 else 0.0625
    return acc + d * dx[:, None, :] * dot.to(tl.float32) * UNSCALE


@triton.jit
def _load_row(row_ptr, qh_ptr, d_ptr, xw_ptr, xd_ptr, b0, end, QTYPE: tl.constexpr, KBS: tl.constexpr):
    """The loads of a K step of ``_step_split`` at one activation row for Q4_0, Q5_0 and Q8_0 (``xw_ptr`` /
    ``xd_ptr``: that row's words and block scales), every one shaped like the code words q ([BN, KBS, 8] Q8_0, else
    [BN, KBS, 4]) or their block sums ([BN, KBS]): xa / xb as ``_load_codes`` returns them but repeated over the
    rows (each lane loads the words its own codes meet, from L1), qh ([BN, KBS] Q5_0, else q), dw and dx ([BN,
    KBS]).  Why: Triton gives a load the layout of its shape, so with activations shaped [KBS, 4] and
    broadcast over the rows it converted 13 tensors per K step through shared memory, with a barrier each (Triton
    3.6, 4 x 64 tiles: 24 BAR.SYNC in the Q4_0 loop, 3.1 SASS per weight; this way none and 2.1; Q5_0's qh words
    and the accumulator are still converted, 2 barriers)."""
    BN: tl.constexpr = row_ptr.shape[0]
    kb = b0 + tl.arange(0, KBS)
    bmask = kb < end
    W: tl.constexpr = 8 if QTYPE == 8 else 4
    t = tl.arange(0, W)
    m3 = bmask[None, :, None]
    zero = tl.zeros([BN, 1, 1], dtype=tl.int32)
    zero2 = tl.zeros([BN, 1], dtype=tl.int32)
    q = tl.load(row_ptr[:, None, None] + (kb * W)[None, :, None] + t[None, None, :], mask=m3, other=0,
                eviction_policy="evict_first")
    xo = zero + (kb * 8)[None, :, None] + t[None, None, :]
    xa = tl.load(xw_ptr + xo, mask=m3, other=0)
    xb = xa
    if QTYPE != 8:
        xb = tl.load(xw_ptr + xo + 4, mask=m3, other=0)
    qh = q
    if QTYPE == 6:
        qh = tl.load(qh_ptr[:, None] + kb[None, :], mask=bmask[None, :], other=0)
    dw = tl.load(d_ptr[:, None] + kb[None, :], mask=bmask[None, :], other=0)
    dx = tl.load(xd_ptr + zero2 + kb[None, :], mask=bmask[None, :], other=0.0)
    return q, xa, xb, qh, dw, dx


@triton.jit
def _dot_row(q, xa, xb, qh, QTYPE: tl.constexpr, EMULATE: tl.constexpr):
    """``_dot_split`` on what ``_load_row`` returns: [BN, KBS] int32, elementwise on the code words and summed over
    each block's words in the thread that holds them (no ``tl.split``)."""
    zero = tl.zeros(q.shape, dtype=tl.int32)
    if QTYPE == 8:
        return tl.sum(_dp4a(q, xa, zero, EMULATE), axis=2)
    t = tl.arange(0, 4)[None, None, :]
    if QTYPE == 6:
        nqh = ~qh[:, :, None]  # inverted fifth bits: the codes become u ^ 16 (see ``_step_split``)
        lo = ((q & 0x0F0F0F0F) | _fifth_bits(nqh, t)) << 3
        hi = (((q >> 4) & 0x0F0F0F0F) | _fifth_bits(nqh, t + 4)) << 3
    else:
        w = q ^ _MINUS_8  # every nibble u -> u ^ 8
        lo = (w << 4) & _TOP_NIBBLES
        hi = w & _TOP_NIBBLES
    return tl.sum(_dp4a(hi, xb, _dp4a(lo, xa, zero, EMULATE), EMULATE), axis=2)


@triton.jit
def _scale_row(acc, dot, dw, dx, QTYPE: tl.constexpr):
    """``_scale_split`` at one activation row: acc [BN, KBS] fp32."""
    d = dw.to(tl.float16, bitcast=True).to(tl.float32)
    if QTYPE == 8:
        return acc + d * dx * dot.to(tl.float32)
    UNSCALE: tl.constexpr = 0.125 if QTYPE == 6 else 0.0625  # as ``_scale_split``
    return acc + d * dx * dot.to(tl.float32) * UNSCALE


@triton.jit
def _prefetch_split_step(row_ptr, qh_ptr, sc_ptr, d_ptr, on, b0, QTYPE: tl.constexpr, KBS: tl.constexpr):
    """Ask L2 for the code words, qh words, scales and d of blocks [b0, b0 + KBS) of each split row where on
    ([BLOCK_N] bool) holds (pointers as in ``_step_split``)."""
    CODE_WORDS: tl.constexpr = 8 if QTYPE == 8 else 4
    _prefetch_lines(row_ptr, on, b0 * CODE_WORDS, KBS * CODE_WORDS)
    if QTYPE == 14:
        _prefetch_lines(qh_ptr, on, b0 * 2, KBS * 2)
        _prefetch_lines(sc_ptr, on, b0, KBS)
        _prefetch_lines(d_ptr, on, b0 // 8, KBS // 8 + 1)
    else:
        if QTYPE == 6:
            _prefetch_lines(qh_ptr, on, b0, KBS)
        _prefetch_lines(d_ptr, on, b0, KBS)


@triton.jit
def _gemv_split_kernel(xw_ptr, xd_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, nb, blocks_per_split,
                       stride_wn, stride_ym, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       KBS: tl.constexpr, SPLIT_K: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr = 0,
                       AHEAD: tl.constexpr = False):
    """Grid (N tiles, SPLIT_K, M tiles of BLOCK_M activation rows); split-K as ``gguf_gemv._gemv_kernel``.  w_ptr:
    int32 words of split rows (stride_wn words apart), nb blocks per row.  Rows past N read row N - 1 (unmasked
    loads; those outputs are not stored).  PDL > 0 (launched with programmatic dependent launch, behind the
    activation quantizer): the program's first PDL - 1 steps of weights are asked of L2 before it waits for x.
    AHEAD: each K step's loads are issued one step ahead, into registers (two steps in flight per program)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    row_ptr = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * stride_wn
    CODE_WORDS: tl.constexpr = 8 if QTYPE == 8 else 4  # per 32-element block
    QH_WORDS: tl.constexpr = 2 if QTYPE == 14 else 1 if QTYPE == 6 else 0
    qh_ptr = row_ptr + CODE_WORDS * nb
    sc_ptr = (qh_ptr + QH_WORDS * nb).to(tl.pointer_type(tl.int16))  # Q6_K: 2 int8 scales per 32 elements
    SC_WORDS: tl.constexpr = 1 if QTYPE == 14 else 0  # per 2 blocks
    d_ptr = (qh_ptr + QH_WORDS * nb + SC_WORDS * (nb // 2)).to(tl.pointer_type(tl.uint16))
    blk_begin = pid_k * blocks_per_split
    blk_end = tl.minimum(blk_begin + blocks_per_split, nb)
    if PDL > 0:
        for d in tl.static_range(0, PDL - 1):
            b = blk_begin + d * KBS
            _prefetch_split_step(row_ptr, qh_ptr, sc_ptr, d_ptr, rmask & (b < blk_end), b, QTYPE, KBS)
        _gdc_wait()
    # one activation row, Q4_0/Q5_0/Q8_0: every tensor of the K loop shaped like the code words (``_load_row``).  H200,
    # same run, us, against the [BLOCK_M, BLOCK_N, KBS] step: expert gate/up Q4_0 / Q5_0 / Q8_0 4.98 / 5.78 / 6.06 against
    # 5.53 / 7.57 / 6.84, down 5.00 / 5.80 / 5.98 against 6.56 / 6.86 / 7.29, lm_head/8 20.7 / 27.6 / 33.7 against
    # 31.7 / 43.7 / 38.8; Q6_K (its qh words and scale pairs still converted) took longer: 6.86 / 7.59 / 42.4 against
    # 6.83 / 7.01 / 35.9, and keeps that step
    if BLOCK_M == 1 and QTYPE != 14:
        xw_row = xw_ptr + pid_m.to(tl.int64) * nb * 8
        xd_row = xd_ptr + pid_m.to(tl.int64) * nb
        acc1 = tl.zeros([BLOCK_N, KBS], dtype=tl.float32)
        if AHEAD:
            q, xa, xb, qh, dw, dx = _load_row(row_ptr, qh_ptr, d_ptr, xw_row, xd_row, blk_begin, blk_end, QTYPE, KBS)
            for b0 in range(blk_begin, blk_end, KBS):
                nq, nxa, nxb, nqh, ndw, ndx = _load_row(row_ptr, qh_ptr, d_ptr, xw_row, xd_row, b0 + KBS, blk_end,
                                                        QTYPE, KBS)
                acc1 = _scale_row(acc1, _dot_row(q, xa, xb, qh, QTYPE, EMULATE), dw, dx, QTYPE)
                q, xa, xb, qh, dw, dx = nq, nxa, nxb, nqh, ndw, ndx
        else:
            for b0 in range(blk_begin, blk_end, KBS):
                q, xa, xb, qh, dw, dx = _load_row(row_ptr, qh_ptr, d_ptr, xw_row, xd_row, b0, blk_end, QTYPE, KBS)
                acc1 = _scale_row(acc1, _dot_row(q, xa, xb, qh, QTYPE, EMULATE), dw, dx, QTYPE)
        _write_tile(tl.sum(acc1, axis=1)[None, :], y_ptr, part_ptr, count_ptr, M, N, rows, rmask, stride_ym, pid_n,
                    pid_k, pid_m, BLOCK_M, SPLIT_K)
        return
    mrow = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    mmask = mrow < M
    acc = tl.zeros([BLOCK_M, BLOCK_N, KBS], dtype=tl.float32)
    if AHEAD:
        q, xa, xb, qh, sc = _load_codes(row_ptr, qh_ptr, sc_ptr, blk_begin, blk_end, nb, xw_ptr, mrow, mmask, QTYPE,
                                        KBS)
        dw, dx = _load_scales(d_ptr, xd_ptr, blk_begin, blk_end, nb, mrow, mmask, QTYPE, KBS)
        for b0 in range(blk_begin, blk_end, KBS):
            nq, nxa, nxb, nqh, nsc = _load_codes(row_ptr, qh_ptr, sc_ptr, b0 + KBS, blk_end, nb, xw_ptr, mrow, mmask,
                                                 QTYPE, KBS)
            ndw, ndx = _load_scales(d_ptr, xd_ptr, b0 + KBS, blk_end, nb, mrow, mmask, QTYPE, KBS)
            acc = _scale_split(acc, _dot_split(q, xa, xb, qh, sc, BLOCK_M, QTYPE, EMULATE), dw, dx, QTYPE)
            q, xa, xb, qh, sc, dw, dx = nq, nxa, nxb, nqh, nsc, ndw, ndx
    else:
        for b0 in range(blk_begin, blk_end, KBS):
            acc = _step_split(acc, row_ptr, d_ptr, qh_ptr, sc_ptr, b0, blk_end, nb, xw_ptr, xd_ptr, mrow, mmask,
                              QTYPE, KBS, EMULATE)
    y = tl.sum(acc, axis=2)
    _write_tile(y, y_ptr, part_ptr, count_ptr, M, N, rows, rmask, stride_ym, pid_n, pid_k, pid_m, BLOCK_M, SPLIT_K)


@triton.jit
def _dequant_q6_k_split(row, out_row, d, kb, nb, mask):
    """Store the weights of groups kb ([KBS]) of Q6_K split rows (uint8 pointers ``row`` [BLOCK_N]) at
    ``out_row`` [BLOCK_N, 1] + 32 kb + i, from whole words as ``_step_split`` reads them: code word t and qh word
    t // 2 give, top-aligned in byte b, 4 (u - 32) of element 4t + b (low half) and 16 + 4t + b (high half), so
    every element costs a shift pair instead of three byte loads, and the weights of a group leave as 16-byte
    stores; d: [BLOCK_N, KBS] fp32 block scales, mask [BLOCK_N, KBS].  Weight (d * scale) * (u - 32), rounded as
    gguf-py ``Q6_K`` rounds it."""
    t = tl.arange(0, 4)
    m3 = mask[:, :, None]
    q = tl.load(row.to(tl.pointer_type(tl.int32))[:, None, None] + (4 * kb)[None, :, None] + t[None, None, :],
                mask=m3, other=0)
    qh = tl.load(row.to(tl.pointer_type(tl.int32))[:, None, None] + (4 * nb + 2 * kb)[None, :, None]
                 + (t // 2)[None, None, :], mask=m3, other=0) >> (4 * (t % 2))[None, None, :]
    lo = (((q << 2) & 0x3C3C3C3C) | ((qh << 6) & _TOP_2BITS)) ^ _SIGN_BITS
    hi = (((q >> 2) & 0x3C3C3C3C) | ((qh << 4) & _TOP_2BITS)) ^ _SIGN_BITS
    h = tl.arange(0, 2)
    b = tl.arange(0, 4)
    words = tl.permute(tl.join(lo, hi), (0, 1, 3, 2))  # [BN, KBS, 2 (half), 4 (t)]
    code = (words[:, :, :, :, None] << (24 - 8 * b)[None, None, None, None, :]) >> 24  # 4 (u - 32), [.., 4 (b)]
    sc = tl.load((row + 24 * nb).to(tl.pointer_type(tl.int8))[:, None, None] + (2 * kb)[None, :, None]
                 + h[None, None, :], mask=m3, other=0).to(tl.float32)  # [BN, KBS, 2 (half)]
    # (d * scale) / 4 is exact, so one multiply by the code 4 (u - 32) rounds as (d * scale) * (u - 32) does
    scale = (d[:, :, None] * sc * 0.25)[:, :, :, None, None]
    w = tl.reshape(scale * code.to(tl.float32), (code.shape[0], code.shape[1], 32))  # element 16 half + 4 t + b
    col = (32 * kb)[None, :, None] + tl.arange(0, 32)[None, None, :]
    tl.store(out_row[:, :, None] + col, w.to(out_row.dtype.element_ty), mask=m3)


@triton.jit
def _dequant_split_kernel(w_ptr, out_ptr, N, nb, stride_wn, stride_on, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                          KBS: tl.constexpr):
    """Grid (N tiles, K steps of KBS blocks): split rows (uint8, stride_wn bytes apart) -> weights in out_ptr's
    dtype (row n at out_ptr + n * stride_on), with the layout of ``_step_split``."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    kb = tl.program_id(1) * KBS + tl.arange(0, KBS)
    mask = rmask[:, None] & (kb < nb)[None, :]
    row = w_ptr + rows.to(tl.int64) * stride_wn
    CODE_BYTES: tl.constexpr = 32 if QTYPE == 8 else 16
    QH_BYTES: tl.constexpr = 8 if QTYPE == 14 else 4 if QTYPE == 6 else 0
    SC_BYTES: tl.constexpr = 2 if QTYPE == 14 else 0
    d16 = (row + (CODE_BYTES + QH_BYTES + SC_BYTES) * nb).to(tl.pointer_type(tl.uint16))
    d = tl.load(d16[:, None] + (kb // 8 if QTYPE == 14 else kb)[None, :], mask=mask,
                other=0).to(tl.float16, bitcast=True).to(tl.float32)
    if QTYPE == 14:
        _dequant_q6_k_split(row, out_ptr + (rows.to(tl.int64) * stride_on)[:, None], d, kb, nb, mask)
        return
    i = tl.arange(0, 32)
    m3 = mask[:, :, None]
    if QTYPE == 8:
        code = tl.load(row[:, None, None] + (kb * 32)[None, :, None] + i[None, None, :], mask=m3, other=0)
        w = d[:, :, None] * code.to(tl.int8, bitcast=True).to(tl.float32)
    else:
        byte = tl.load(row[:, None, None] + (kb * 16)[None, :, None] + (i % 16)[None, None, :], mask=m3,
                       other=0).to(tl.int32)
        u = (byte >> (4 * (i // 16))[None, None, :]) & 0xF
        if QTYPE == 6:
            hb = tl.load(row[:, None, None] + (16 * nb + 4 * kb)[None, :, None] + (i // 8)[None, None, :], mask=m3,
                         other=0).to(tl.int32)
            u = u | (((hb >> (i % 8)[None, None, :]) & 1) << 4)
        OFFSET: tl.constexpr = 16.0 if QTYPE == 6 else 8.0
        w = d[:, :, None] * (u.to(tl.float32) - OFFSET)
    cols = (kb * 32)[:, None] + i[None, :]
    tl.store(out_ptr + (rows.to(tl.int64) * stride_on)[:, None, None] + cols[None, :, :],
             w.to(out_ptr.dtype.element_ty), mask=m3)


# ---------------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------------

def _check_split(qweight: torch.Tensor, stype: int, K: int | None, N: int, x: torch.Tensor | None = None,
                 fn: str = "split rows") -> int:
    """Validate a split weight, and x (M, K) bf16/fp16/fp32 on the weight's device where given (K None: x's);
    returns the GGML base type.  Raises ValueError naming what does not fit."""
    _check_tensors(fn, qweight=qweight, **({} if x is None else {"x": x}))
    if x is not None:
        if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{fn}: x must be (M, K) bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
        if x.device != qweight.device:
            raise ValueError(f"{fn}: x is on {x.device}, qweight on {qweight.device}")
        K = x.shape[1] if K is None else K
    if type_id(stype, fn, "stype") not in SPLIT_QTYPES:
        raise ValueError(f"{fn}: type id {stype} is not a split type ({sorted(SPLIT_QTYPES)})")
    N = _index(N, "N", fn)
    qtype = base_type(stype)
    if not can_split(qtype, K):
        raise ValueError(f"{fn}: {type_name(stype)} rows of K={K} do not exist (need an even number of "
                         f"{BLOCK_SIZES[qtype][0]}-element blocks)")
    rb = K // BLOCK_SIZES[qtype][0] * BLOCK_SIZES[qtype][1]
    if qweight.dtype != torch.uint8 or qweight.dim() != 2 or qweight.stride(-1) != 1 or qweight.shape[-1] < rb \
            or qweight.shape[0] < N:
        raise ValueError(f"{fn}: {type_name(stype)} weight {tuple(qweight.shape)} {qweight.dtype} does not "
                         f"hold {N} uint8 rows of {rb} bytes (K={K})")
    return qtype


#: (block_n, kbs, num_warps) of ``_dequant_split_kernel`` per base type.  H200, session 20, same run, us, lm_head/8
#: 19360 x 6144 / expert gate/up 2048 x 6144 to bf16, this tile / the 16 x 8 tile of before / the best of 14 (rows
#: 4-32, kbs 4-32, 4 or 8 warps): Q6_K 100.7 / 114.7 / 100.6, 13.1 / 12.7 / 12.5; Q8_0 100.0 / 104.5 /
#: 100.0, 12.9 / 12.7 / 12.2; Q4_0 86.0 / 89.5 / 85.6, 9.6 / 11.2 / 9.6; Q5_0 (4 rows, 8 warps; it reads a qh byte per
#: weight, and took 2-4x as long with 16 or 32 rows per program) 135.9 / 306.9 / 135.9, 17.5 / 38.6 / 17.5.
_DEQUANT_TILE = {Q8_0: (8, 32, 4), Q4_0: (8, 32, 4), Q6_K: (8, 32, 4), Q5_0: (4, 32, 8)}


def dequantize_split_rows(qweight: torch.Tensor, stype: int, K: int, N: int | None = None,
                          dtype: torch.dtype = torch.bfloat16, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gguf_gemv.dequantize_rows`` for split rows: (N, K) weights in ``dtype`` (bf16, fp16 or fp32), each rounded
    once from its exact value d * code; ``out``: optional (N, K) destination with contiguous rows.
    Raises ValueError on a type or shape that does not fit (``_check_split``)."""
    N = int(qweight.shape[0] if qweight.dim() else 0) if N is None else N
    K = _index(K, "K", "dequantize_rows")
    qtype = _check_split(qweight, stype, K, N, fn="dequantize_rows")
    N = int(N)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dequantize_rows: dtype {dtype} is not bf16/fp16/fp32")
    if out is None:
        out = torch.empty((N, K), dtype=dtype, device=qweight.device)
    _check_out(out, N, K, dtype, qweight.device, "dequantize_rows")
    if N == 0:
        return out
    nb = K // 32
    bn, kbs, num_warps = _DEQUANT_TILE[qtype]
    kbs = min(kbs, _pow2_at_most(nb))
    # rows must start aligned: the scales are read as uint16, Q6_K's codes as int32 words
    qweight = _as_words(qweight, qtype, unit=4 if qtype == Q6_K else 2).view(torch.uint8)
    _dequant_split_kernel[(triton.cdiv(N, bn), triton.cdiv(nb, kbs))](
        qweight, out, N, nb, qweight.stride(0), out.stride(0), QTYPE=qtype, BLOCK_N=bn, KBS=kbs, num_warps=num_warps)
    return out


#: (block_n, kbs, programs per SM aimed at, num_warps) of the split-row GEMV per base type, at 1, 2..4 and 5..16
#: activation rows (block_m: the next power of two >= M).  H200, session 16, best of 9 tiles x 2 split-K aims (8 or
#: 16 rows with kbs 8 or 16 for Q8_0/Q4_0; 64 rows with kbs 4 for Q5_0, whose fifth bits cost registers), same run,
#: us, against the fp32 decode / tensor-core path on GGUF rows it replaces and bf16 cuBLAS:
#: Q8_0 expert gate/up (2048 x 6144) batch 1 9.6 / 11.1 / 11.7, batch 4 11.0 / 18.2 / 11.5, batch 16 17.0 / 23.4 /
#: 11.9; down (6144 x 2048) batch 1 9.3 / 11.7 / 9.3, batch 4 11.1 / 18.5 / 9.2; q_b/8 (2048 x 2048) batch 4 7.2 /
#: 9.0 / 6.1.  Q4_0 gate/up batch 1 9.5 / 10.5 / 11.8, batch 4 10.4 / 15.4 / 11.6; down batch 1 8.6 / 10.3 / 9.7.
#: Q5_0 gate/up batch 1 10.0 / 12.8 / 11.5, batch 4 11.2 / 20.3 / 11.6; down batch 1 10.0 / 12.3 / 9.4, batch 8 15.4 /
#: 21.0 / 9.3.  Tiles within 3 % of the best on the four swept shapes (expert gate/up and down, q_b/8, expert
#: gate+up/8) were preferred shared across types.  Session 17 (codes made signed, ``_step_split``; 48 tiles x 2 aims
#: at 2 and 4 rows, expert gate/up and down): Q4_0 at 2..4 rows takes 64 rows, kbs 16 (gate/up batch 4 10.0 against
#: 10.6 us with the 16-row tile, down 9.8 against 10.7; batch 2 9.2 / 9.1 against 9.8 / 10.1); Q5_0 keeps its tile
#: (within 1 % of the best at 4 rows; 64 rows, kbs 8, 2 warps would take 9.8 / 9.4 against 10.3 / 10.3 at 2 rows but
#: more than 11.7 at 4).  Benchmark, same session, batch 1 / 4 / 16: Q4_0 gate/up 9.6 / 9.9 / 18.3, Q5_0 10.0 / 11.1 /
#: 19.0, Q8_0 9.7 / 11.1 / 16.9 (bf16 cuBLAS 11.5 / 11.6 / 11.8).
#: Session 19 (H200, same run, 30-96 tiles per case: rows 8-64, kbs 4-32, 2 / 8 / 24 programs per SM aimed at, 2 or
#: 4 warps): one row took kbs 32 everywhere (a K step's loads are what a program has in flight: at kbs 16 and below
#: the weight streamed at ~1 TB/s whatever the split-K), us, new tile / the tile before / bf16 cuBLAS: Q4_0 gate/up
#: 8.0 (best 7.6) / 8.9 / 11.7, down 6.9 / 8.0 / 9.7; Q8_0 gate/up 8.5 / 9.1 / 11.5, down 7.5 / 8.4 / 9.3; Q5_0 (64
#: rows, kbs 8, 24 per SM) gate/up 8.6 / 9.2 / 11.4, down 8.5 / 8.9 / 9.3; Q6_K gate/up 8.6 / 10.3 (GGUF rows 10.4) /
#: 11.7, down 7.1 / 10.0 (10.6) / 9.4; at 4 rows 10.3 / 13.5 (14.0) / 11.7 and 8.8 / 13.5 (12.8) / 9.4; at 16 rows
#: (64 rows, kbs 4, 8-way split-K) gate/up 18.8 / 24.1 (28.2); the two faster tiles there (32 rows, kbs 16: 18.1; 64
#: rows, kbs 8: 18.2) spill at 16 rows.  At 1..4 rows on weights of many rows: ``_SPLIT_ROW_TILES``.
_SPLIT_TILE = {Q8_0: ((8, 32, 8, 4), (16, 16, 8, 4), (16, 16, 2, 4)),
               Q4_0: ((8, 32, 8, 4), (64, 16, 8, 4), (16, 16, 2, 4)),
               Q5_0: ((64, 8, 24, 4), (64, 4, 8, 4), (32, 8, 2, 4)),
               Q6_K: ((8, 32, 8, 4), (8, 32, 8, 2), (64, 4, 2, 4))}
#: Tiles without split-K at 1 and 2..4 rows: (programs per SM, block_n, kbs, num_warps, ahead), the first whose
#: cdiv(N, block_n) row tiles alone give at least that many programs per SM; kbs 0: the power of two >= half a row's
#: blocks, at most 64 (a row in 2 or more K steps); ahead: each step's loads issued one step ahead (``GemvConfig``).
#: Else ``_SPLIT_TILE`` and split-K (loads ahead were slower there: Q4_0 expert gate/up at batch 4 11.70 against 9.00
#: us).  H200, session 20, same run, us, this tile / the 4-row, kbs-up-to-128 tiles without loads ahead of the first
#: run / session 19's tile (``_SPLIT_TILE``, split-K where its row tiles are few):
#: batch 1 (Q4_0 / Q5_0 / Q8_0 / Q6_K): expert gate/up 2048 x 6144 (4 rows, kbs 64) 5.72 / 7.50 / 6.64 / 6.40 against
#: 6.18 / 8.51 / 7.62 / 6.94 and 8.27 / 8.67 / 8.18 / 7.77; expert down 6144 x 2048 (kbs 32) 6.38 / 6.85 / 6.94 /
#: 6.35 (Q6_K: 8 rows, no loads ahead; with them 7.60) against 6.58 / 6.96 / 7.00 / 6.35 and 6.85 / 8.42 / 7.11 /
#: 6.35; q_b/8 2048 x 2048 3.61 / 4.31 / 4.00 / 3.78 against 4.62 / 5.22 / 4.62 / 4.08 and 5.49 / 5.97 / 5.36 / 5.22;
#: lm_head/8 19360 x 6144 31.44 / 43.65 / 38.40 against 31.28 / 45.62 / 45.45 and 38.56 / 64.89 / 40.65.
#: Batch 4, 16 rows, kbs 32 (legacy types): expert down 7.59 / 9.02 / 7.98 against 8.06 / 9.78 / 8.42 and 8.91 /
#: 10.04 / 9.91; lm_head/8 48.25 / 60.54 / 48.23 against 51.18 / 63.22 / 51.23 and 49.69 / 93.37 / 59.88.
#: Q6_K lm_head/8 (8 rows, kbs 32, 2 warps, >= 8 programs per SM): batch 1 34.44, batch 4 51.78 (the 16-row, kbs-8
#: tile of session 19: 69.37; GGUF rows and bf16 cuBLAS, session 19: 68.7 / 65.7 and 88.0 / 66.1).
_LEGACY_ROW_TILES = (((2, 4, 0, 4, True),), ((2, 16, 32, 4, True),))
_SPLIT_ROW_TILES = {Q8_0: _LEGACY_ROW_TILES, Q4_0: _LEGACY_ROW_TILES, Q5_0: _LEGACY_ROW_TILES,
                    Q6_K: (((8, 8, 32, 2, False), (2, 8, 0, 4, False), (2, 4, 0, 4, True)), ((8, 8, 32, 2, False),))}


#: From this many rows (to MAX_BLOCK_M), Q8_0 / Q4_0 / Q6_K split rows go to the int8 tensor cores
#: (``gguf_mma.gguf_linear_split_mma``): 64 rows and 8 groups per step, 4 warps, 2 stages and split-K to ~4 programs
#: per SM, or SPLIT_MMA_MIN_SPLIT ways where the row tiles alone give 2 per SM (at most the K steps in either case;
#: ``_split_mma_config``).  H200, session 25, one
#: run, us, at 16 / 8 rows, dp4a split rows (this module's tiles) against the best tensor-core tile of 8-16 and bf16
#: cuBLAS: Q6_K expert gate/up 2048 x 6144 17.2 / 13.1 against 15.1 / 13.1 and 11.7; down 6144 x 2048 20.3 / 13.8
#: against 14.8 / 13.0 and 9.4; lm_head/8 19360 x 6144 171.6 / 85.4 against 111.2 / 91.9 and 66.0 (4 rows: 52.1
#: against 88.5); Q4_0 gate/up 17.3 / 13.0 against 13.2 / 11.3; Q8_0 gate/up 15.7 / 12.1 against 15.0 / 12.7.  At 8
#: rows the tensor cores win on some shapes and lose on others, so they start past 8.
SPLIT_MMA_MIN_M = 9
#: split-K of the split-row tensor-core GEMM where its row tiles alone give >= 2 per SM: until session 34, tiles
#: of >= 2 per SM (lm_head/8) ran 2 warps, no pipelining, no split, 2.3 programs of 2 warps per SM, too few to hide
#: the loads.  H100, session 34, one run, interleaved twice, us, that launch / this one (64 rows, 4 warps, 2 stages,
#: 4-way split) / 32 rows on 2 warps without split, lm_head/8 19360 x 6144 at 16 rows: Q6_K 113.3, 111.1 / 94.8,
#: 93.0 / 89.3, 87.1; Q8_0 140.0, 128.0 / 92.2, 90.0 / 109.8, 105.8; Q4_0 131.7, 130.7 / 89.1, 86.6 / 100.6, 100.0;
#: Q6_K at 9 rows 112.2, 112.4 / 89.7, 88.3 / 92.1, 86.2 (the session's tile sweep, Q6_K at 16 rows, 60 tiles: best
#: 89.0 with 32 rows on 2 warps, then 94.7 / 95.0 with this tile and 8- / 4-way split).  Not measured on an H200.
SPLIT_MMA_MIN_SPLIT = 4


def _split_mma_config(N: int, K: int, sms: int) -> GemvConfig:
    """``pick_split_config`` from SPLIT_MMA_MIN_M rows: the tensor-core launch (``kbs``: groups per step)."""
    tiles = triton.cdiv(N, 64)
    steps = triton.cdiv(K // 32, 8)
    split = min(steps, SPLIT_MMA_MIN_SPLIT if tiles >= 2 * sms else triton.cdiv(4 * sms, tiles))
    split = triton.cdiv(steps, triton.cdiv(steps, split))  # no empty splits
    return GemvConfig(block_n=64, kbs=8, split_k=split, num_warps=4, block_m=MAX_BLOCK_M, q8=True, mma=True, stages=2)


def pick_split_config(stype: int, M: int, N: int, K: int, sms: int = 132,
                      tile: tuple[int, int, int, int] | None = None) -> GemvConfig:
    """Launch parameters of the split-row GEMV (``q8`` set): at 1..4 rows the first of ``_SPLIT_ROW_TILES`` whose
    row tiles alone give enough programs per SM (no split-K, loads ahead as the entry says); else the tile
    ``_SPLIT_TILE`` gives for the base type and M (or ``tile``: rows, kbs, programs per SM aimed at, warps), with
    split-K up to the tile's programs per SM while the row tiles alone give fewer than 2 per SM.  ``block_m`` = the
    next power of two >= M (at most MAX_BLOCK_M).  Without ``tile``, Q8_0 / Q4_0 / Q6_K at SPLIT_MMA_MIN_M..16 rows
    take the int8 tensor cores (``mma`` set, ``_split_mma_config``)."""
    if tile is None and SPLIT_MMA_MIN_M <= M <= MAX_BLOCK_M and base_type(stype) in SPLIT_MMA_TYPES:
        return _split_mma_config(N, K, sms)
    bucket = 0 if M <= 1 else 1 if M <= 4 else 2
    nb = K // 32
    block_m = min(MAX_BLOCK_M, _pow2_at_least(M))
    for per_sm, block_n, kbs, num_warps, ahead in (_SPLIT_ROW_TILES[base_type(stype)][bucket] if tile is None
                                                   and bucket < 2 else ()):
        if triton.cdiv(N, block_n) >= per_sm * sms:
            kbs = kbs or min(64, _pow2_at_least(triton.cdiv(nb, 2)))
            return GemvConfig(block_n=block_n, kbs=min(kbs, _pow2_at_most(nb)), split_k=1, num_warps=num_warps,
                              block_m=block_m, q8=True, ahead=ahead)
    block_n, kbs, per_sm, num_warps = tile or _SPLIT_TILE[base_type(stype)][bucket]
    kbs = min(kbs, _pow2_at_most(nb))
    steps, tiles = triton.cdiv(nb, kbs), triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    split = 1 if tiles >= 2 * sms else min(steps, triton.cdiv(per_sm * sms, tiles))
    split = triton.cdiv(steps, triton.cdiv(steps, split))  # no empty splits
    return GemvConfig(block_n=block_n, kbs=kbs, split_k=split, num_warps=num_warps, block_m=block_m, q8=True)


#: Q6_K rows were split only on request until session 19's tiles (``_SPLIT_TILE``); ``$GLM5SERVE_SPLIT_Q6_K=0`` keeps
#: them GGUF (the fp32 / int8 / tensor-core decoders of ``gguf_gemv``).  Measured on the H200 (session 17, the untuned
#: tiles of then), split rows took, against GGUF rows, us, batch 1 / 4 / 16: expert gate/up 11.0 / 14.4 / 25.0
#: against 10.7 / 15.0 / 28.3, lm_head/8 95.2 / 97.6 / 191.6 against 69.3 / 88.6 / 261.6; past 16 rows (dequantize +
#: cuBLAS) lm_head/8 batch 64 / 256 369.5 / 411.3 against 245.2 / 283.8, with a split dequantizer of byte loads that
#: ``_dequant_q6_k_split`` replaced (SASS per weight 23 -> 8.75, 16-byte stores).  Session 19, same run, lm_head/8:
#: dequantizing the split rows took 115.8 us (byte loads: 272.5; GGUF rows, ``gguf_gemv._dequant_kernel``: 162.7), and
#: the whole product at 64 / 256 rows 196.6 / 234.1 us against 245.7 / 287.1 on GGUF rows.  The session's benchmark
#: (batch 1 / 4 / 16, us, against GGUF rows in session 18 and bf16 cuBLAS): expert gate/up 8.6 / 10.1 / 18.8 against
#: 10.3 / 14.1 / 27.7 and 11.7, down 7.1 / 8.7 / 23.0 against 10.7 / 12.9 / 33.2 and 9.5, lm_head/8 39.2 / 57.9 /
#: 227.4 against 68.7 / 87.7 / 259.5 and 66-68.
SPLIT_Q6_K_ENV = "GLM5SERVE_SPLIT_Q6_K"


def split_q6_k() -> bool:
    """Whether Q6_K linear weights are served as split rows: ``$GLM5SERVE_SPLIT_Q6_K`` 1 (the default) or 0;
    ValueError for another value."""
    return env_choice(SPLIT_Q6_K_ENV, ("1", "0"), "1") == "1"


def served_split(qtype: int, K: int) -> bool:
    """Whether glm5serve serves rows of K elements of ``qtype`` as split rows: ``can_split``, and for Q6_K unless
    ``$GLM5SERVE_SPLIT_Q6_K=0`` (see above).  A bool for any qtype (a torch integer too); ValueError for a
    ``$GLM5SERVE_SPLIT_Q6_K`` other than 0 or 1."""
    if not can_split(qtype, K):
        return False
    return operator.index(qtype) != Q6_K or split_q6_k()


def as_served(qweight: torch.Tensor, qtype: int, K: int) -> tuple[torch.Tensor, int]:
    """A GGUF weight as glm5serve serves it: (split rows, split type id) where ``served_split``, else (the weight,
    ``qtype``) unchanged (``kernels.vllm_ops.split_linear_weights`` does the same in place)."""
    if served_split(qtype, K):
        return split_rows(qweight, qtype, K), split_type(qtype)
    return qweight, type_id(qtype, "as_served")


def gguf_linear_split(x: torch.Tensor, qweight: torch.Tensor, stype: int, N: int,
                      config: GemvConfig | None = None, dp4a: bool = True) -> torch.Tensor:
    """y = x @ W[:N].T for a weight of split rows (``split_rows``).

    Args:
        x: (M, K) bf16/fp16/fp32 activations, any M.  K must be the K the rows were split with: a split row's
            fields sit at offsets that depend on K, so, unlike GGUF rows, it cannot be read as a shorter row (the
            bytes past row_bytes may be padding, so a narrower x is not detected).
        qweight: (>= N, >= row_bytes) uint8 split rows (row_bytes as the GGUF row); rows must be contiguous.
        stype: split type id (``split_type(Q8_0)`` etc.).
        N: output features.
        config: launch parameters (``block_n``, ``kbs``, ``split_k``, ``num_warps``, ``block_m`` up to
            MAX_BLOCK_M; default ``pick_split_config``).  Without one, x of more than MAX_FAST_M rows or fp32 x
            takes W dequantized to x's dtype (``dequantize_split_rows``, in chunks) and a cuBLAS matmul.  ``mma``
            (Q8_0, Q4_0, Q6_K; ``block_n`` >= 16): the int8 tensor cores (``gguf_mma.gguf_linear_split_mma``, ``kbs``
            groups per step, at least 2, Q6_K 8; ``stages``; 8 or 16 activation rows per program).
        dp4a: False computes the same integer products with shifts (always so off CUDA); bit-identical.
    Returns:
        (M, N) in x's dtype, fp32 accumulation; on the int8 path x is first rounded to int8 blocks of 32 as in
        ``gguf_gemv_q8`` (error bound ``kernels.testing.q8_activation_bound``; Q6_K on the tensor cores: blocks
        of 256, ``block=256``).
    Raises:
        ValueError: not a split type, or shapes that do not fit.
    Capture-safe under CUDA graphs (two launches, no host synchronisation).
    """
    qtype = _check_split(qweight, stype, None, N, x, "gguf_linear_split")
    _check_config(config, "gguf_linear_split")
    (M, K), N = x.shape, int(N)
    if M == 0 or N == 0:
        return x.new_zeros((M, N))
    if config is None and (M > MAX_FAST_M or x.dtype == torch.float32):
        from glm5serve.kernels.gguf_gemv import _dequant_matmul

        return _dequant_matmul(x, qweight, stype, N, K)
    if config is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.device.type == "cuda" else 1
        config = pick_split_config(stype, M, N, K, sms)
    if config.mma and qtype in SPLIT_MMA_TYPES and config.block_n >= 16:
        groups = 8 if qtype == Q6_K else min(max(config.kbs, 2), 8)
        return gguf_linear_split_mma(x, qweight, stype, N, block_n=config.block_n, split_k=config.split_k,
                                     num_warps=config.num_warps, block_m=8 if M <= 8 else 16,
                                     num_stages=config.stages, groups=groups, asm=dp4a)
    if x.stride(1) != 1:
        x = x.contiguous()
    nb = K // 32
    block_m = min(config.block_m, MAX_BLOCK_M, _pow2_at_least(M))
    kbs = config.kbs
    blocks_per_split = triton.cdiv(triton.cdiv(nb, config.split_k), kbs) * kbs
    pdl = pdl_value(x.device, blocks_per_split // kbs)
    # before the quantizer, so that a copy of a misaligned weight does not sit between it and the GEMV (PDL)
    w = _as_words(qweight, qtype, unit=4)
    xq, xd, _ = quantize_activations(x, pdl=bool(pdl))
    split = triton.cdiv(nb, blocks_per_split)
    grid = (triton.cdiv(N, config.block_n), split, triton.cdiv(M, block_m))
    y, part, counters = _split_outputs(x, N, grid, block_m)
    _gemv_split_kernel[grid](xq.view(torch.int32), xd, w, y, part, counters, M, N, nb, blocks_per_split, w.stride(0),
                             y.stride(0), QTYPE=qtype, BLOCK_M=block_m, BLOCK_N=config.block_n, KBS=kbs,
                             SPLIT_K=split, EMULATE=x.device.type != "cuda" or not dp4a, PDL=pdl,
                             AHEAD=config.ahead, num_warps=config.num_warps, **pdl_launch(pdl))
    return y

"""GGUF Q4_K / Q5_K GEMM for decode batches of 5-16 rows (3-4 on large weights, ``gguf_gemv._mma_applies``) on the
int8 tensor cores (``mma.sync`` / ``wgmma`` with s8 operands, s32 accumulators).

Why: the dp4a kernel (``gguf_gemv_q8``) pays two dp4a per code word and activation row, so its K loop grows with the
batch (~4.6 SASS instructions per weight at 4 rows, ~6.2 at 8), and the bf16 tensor-core path of ``gguf_gemv``
dequantizes every weight to a float first (~8 per weight, 22.8 us for Q4_K expert gate/up at batch 16 on an H200, 0.5x
bf16 cuBLAS; 12.3 us here).  Here the codes go to the tensor cores as they are: a Q4_K qs byte holds the codes of two
sub-blocks (low nibble: sub-block 2j, high: 2j + 1, both at element l of their 32), so ``q & 0x0F0F0F0F`` on four bytes
in one register is four int8 codes of sub-block 2j, and one ``tl.dot`` of [BLOCK_N, 32] codes with [32, BLOCK_M] int8
activations is that sub-block's exact integer dot product for every (row, activation row) pair.

Activations are rounded to int8 with one scale per 256 values (llama.cpp's CPU ``Q8_K``, ``quantize_row_q8_K`` in
ggml/src/ggml-quants.c, which its ``ggml_vec_dot_q4_K_q8_K`` pairs with Q4_K), so a super-block's eight sub-block
products combine in integers, ``isum = sum_s sc_s * dot_s``, and take one float scale ``d * d_x`` per super-block.
The min term uses the exact fp32 sums of each 32 activations (as ``gguf_gemv_q8``):

    y[n, m] += d_n d_x[m] sum_s sc_ns dot_s[n, m]  -  dmin_n sum_s mn_ns sum_x[m, s]

(gguf-py ``Q4_K.dequantize_blocks``: w = d sc u - dmin mn.)  The error of one output is at most ``sum_i |s_i| d_x /
2`` plus fp32 rounding, s_i = d sc u_i the scaled code and d_x = max |x| over x's 256-block / 127
(``kernels.testing.q8_activation_bound(..., block=256)``).

The K loop costs ~2.6 (8 activation rows) / ~3.6 (16) SASS instructions per weight for Q4_K on sm_90, about the
same at 2 rows as at 8: padded activation rows cost tensor-core cycles, not instructions
(``tests/unit/test_kernels_compile.py``).

Split rows (``gguf_split``: Q8_0, Q4_0 and Q6_K regrouped at load) take the same tensor cores at 9-16 rows
(``gguf_linear_split_mma``), where their dp4a GEMV pays ~0.5 instruction per weight and activation row.  Their
weight scales are per 32 elements (Q6_K: an int8 scale per 16, so integer sums per 256 as above), and an int8 MMA
takes K >= 32, so a Q4_0 / Q6_K code tile holds the low nibbles of two groups (32 qs bytes) and meets activation
tiles with the other group's half zeroed (``_step_split_mma``): no byte shuffles, twice the MMAs.  The activations
are rounded per 32 (Q6_K: per 256) as ``gguf_split``'s dp4a path rounds them (Q6_K: as above).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from glm5serve.kernels.gguf_gemv import (
    Q4_0,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    _NAMES,
    _as_words,
    _check,
    _check_tensors,
    _f16_hi,
    _f16_lo,
    _gdc_wait,
    _pdl_prologue,
    _split_outputs,
    _write_tile,
    pdl_launch,
    pdl_value,
    type_id,
)

MMA_TYPES = frozenset({Q4_K, Q5_K})
SPLIT_MMA_TYPES = frozenset({Q8_0, Q4_0, Q6_K})  # split-row types (base ids) of ``gguf_linear_split_mma``
QK_K = 256  # activations per int8 scale (llama.cpp QK_K)
#: programs of this many super-blocks or more launch without PDL (the quantizer before them too).  H200, session 24,
#: one run, us, PDL wait / off, 64-row tiles, 2 stages: Q4_K lm_head/8 (19360 x 6144) at batch 4 with 12 / 24 / 6
#: super-blocks per program (split-K 2 / 1 / 4) 56.4 / 44.2, 70.9 / 56.6, 48.7 / 49.3; batch 8 57.7 / 47.3, 90.8 /
#: 59.2, 53.0 / 52.7; batch 16 79.9 / 77.2, 74.2 / 66.1, 66.6 / 67.7; Q5_K batch 4 60.0 / 49.4, 75.2 / 57.5, 51.9 /
#: 53.5; without pipelining (12 per program) a tie, 62.1 / 63.1.  At 2 per program PDL still pays: expert gate/up
#: 2048 x 6144 Q5_K batch 4 10.9 / 11.8, Q4_K batch 16 12.4 / 13.4.
MMA_PDL_MAX_BLOCKS = 8


@triton.jit
def _codes4(q, HI: tl.constexpr, EMULATE: tl.constexpr):
    """The 4-bit codes in the low (HI: high) nibbles of int8 bytes q, as int8 0..15: four bytes per 32-bit
    register, so one LOP3 (HI: a shift and a LOP3) per four codes.  EMULATE: per byte, for the interpreter."""
    if EMULATE:
        if HI:
            return (q >> 4) & 15
        else:
            return q & 15
    if HI:
        return tl.inline_asm_elementwise("{ .reg .b32 t; shr.b32 t, $1, 4; and.b32 $0, t, 0x0F0F0F0F; }", "=r,r",
                                         [q], dtype=tl.int8, is_pure=True, pack=4)
    return tl.inline_asm_elementwise("and.b32 $0, $1, 0x0F0F0F0F;", "=r,r", [q], dtype=tl.int8, is_pure=True,
                                     pack=4)


@triton.jit
def _codes5(q, qh, HI: tl.constexpr, EMULATE: tl.constexpr):
    """Q5_K codes 0..31: ``_codes4`` plus bit 0 (HI: bit 1) of each qh byte as the fifth bit."""
    if EMULATE:
        if HI:
            return ((q >> 4) & 15) | ((qh & 2) << 3)
        else:
            return (q & 15) | ((qh & 1) << 4)
    if HI:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, u; shr.b32 u, $1, 4; and.b32 u, u, 0x0F0F0F0F; shl.b32 t, $2, 3; "
            "and.b32 t, t, 0x10101010; or.b32 $0, u, t; }", "=r,r,r", [q, qh], dtype=tl.int8, is_pure=True, pack=4)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, u; and.b32 u, $1, 0x0F0F0F0F; shl.b32 t, $2, 4; and.b32 t, t, 0x10101010; or.b32 $0, u, t; }",
        "=r,r,r", [q, qh], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _next_qh(qh, EMULATE: tl.constexpr):
    """qh bytes shifted right by 2 (bits 0-1 then hold the fifth bits of the next qs chunk): one shift per four
    bytes; the neighbour byte's bits that enter from above are masked off by ``_codes5``."""
    if EMULATE:
        return (qh >> 2) & 63
    return tl.inline_asm_elementwise("shr.b32 $0, $1, 2;", "=r,r", [qh], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _scale_min(h1, h2, h3, SB: tl.constexpr):
    """6-bit scale (int32) and min (fp32) of sub-block SB (0..7) from the 12 scale bytes in words h1..h3 ([BN]):
    llama.cpp ``get_scale_min_k4`` / gguf-py ``Q4_K.get_scale_min``."""
    SH: tl.constexpr = (SB % 4) * 8
    a1 = (h1 >> SH) & 0xFF
    a2 = (h2 >> SH) & 0xFF
    if SB < 4:
        return a1 & 63, (a2 & 63).to(tl.float32)
    a3 = (h3 >> SH) & 0xFF
    return (a3 & 0xF) | ((a1 >> 6) << 4), ((a3 >> 4) | ((a2 >> 6) << 4)).to(tl.float32)


@triton.jit
def _load_mma(w8_ptr, w32_ptr, rmask, kb, FIVE: tl.constexpr):
    """The bytes of super-block kb of BLOCK_N Q4_K (FIVE: Q5_K) rows (``w8_ptr`` / ``w32_ptr``: [BN] byte / int32
    word pointers to the rows): the words h0..h3 (d, dmin, 12 scale bytes) [BN] int32, qh [BN, 32] int8 (Q5_K; else
    0) and the four 32-byte qs chunks [BN, 32] int8."""
    BB: tl.constexpr = 176 if FIVE else 144
    QS: tl.constexpr = 48 if FIVE else 16
    wp = w32_ptr + kb * (BB // 4)
    h0 = tl.load(wp, mask=rmask, other=0)
    h1 = tl.load(wp + 1, mask=rmask, other=0)
    h2 = tl.load(wp + 2, mask=rmask, other=0)
    h3 = tl.load(wp + 3, mask=rmask, other=0)
    bp = w8_ptr[:, None] + kb * BB + tl.arange(0, 32)[None, :]
    qh = tl.load(bp + 16, mask=rmask[:, None], other=0) if FIVE else 0
    q0 = tl.load(bp + QS, mask=rmask[:, None], other=0, eviction_policy="evict_first")
    q1 = tl.load(bp + QS + 32, mask=rmask[:, None], other=0, eviction_policy="evict_first")
    q2 = tl.load(bp + QS + 64, mask=rmask[:, None], other=0, eviction_policy="evict_first")
    q3 = tl.load(bp + QS + 96, mask=rmask[:, None], other=0, eviction_policy="evict_first")
    return h0, h1, h2, h3, qh, q0, q1, q2, q3


@triton.jit
def _math_mma(acc, h0, h1, h2, h3, qh, q0, q1, q2, q3, xq_ptr, xo, xs_ptr, xd_ptr, so, mmask, FIVE: tl.constexpr,
              EMULATE: tl.constexpr):
    """acc [BN, BM] fp32 plus one super-block (``_load_mma``'s words) against BLOCK_M activation rows: ``xo`` [32, BM]
    int8 offsets of element l of each activation row's super-block; ``so`` [BM] offsets of its first 32-block sum,
    its 256-scale at ``xd_ptr + so // 8``."""
    isum = tl.zeros(acc.shape, dtype=tl.int32)
    msum = tl.zeros(acc.shape, dtype=tl.float32)
    for j in tl.static_range(4):
        q = q0 if j == 0 else q1 if j == 1 else q2 if j == 2 else q3
        if FIVE:
            lo = _codes5(q, qh, False, EMULATE)
            hi = _codes5(q, qh, True, EMULATE)
            qh = _next_qh(qh, EMULATE)
        else:
            lo = _codes4(q, False, EMULATE)
            hi = _codes4(q, True, EMULATE)
        xlo = tl.load(xq_ptr + xo + 64 * j, mask=mmask[None, :], other=0)
        xhi = tl.load(xq_ptr + xo + 64 * j + 32, mask=mmask[None, :], other=0)
        sc0, mn0 = _scale_min(h1, h2, h3, 2 * j)
        sc1, mn1 = _scale_min(h1, h2, h3, 2 * j + 1)
        isum += sc0[:, None] * tl.dot(lo, xlo, out_dtype=tl.int32) + sc1[:, None] * tl.dot(hi, xhi, out_dtype=tl.int32)
        sx0 = tl.load(xs_ptr + so + 2 * j, mask=mmask, other=0.0)
        sx1 = tl.load(xs_ptr + so + 2 * j + 1, mask=mmask, other=0.0)
        msum += mn0[:, None] * sx0[None, :] + mn1[:, None] * sx1[None, :]
    dx = tl.load(xd_ptr + so // 8, mask=mmask, other=0.0)
    return acc + _f16_lo(h0)[:, None] * (isum.to(tl.float32) * dx[None, :]) - _f16_hi(h0)[:, None] * msum


@triton.jit
def _gemm_mma_kernel(xq_ptr, xd_ptr, xs_ptr, w8_ptr, w32_ptr, y_ptr, part_ptr, count_ptr, M, N, nb,
                     blocks_per_split, stride_wn, stride_ym, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr = 0,
                     KBS: tl.constexpr = 1):
    """Grid (N tiles, SPLIT_K, M tiles); split-K and the PDL protocol as ``gguf_gemv._gemv_kernel`` (whether it is
    launched with PDL: ``gguf_linear_mma``); KBS (1 or 2) super-blocks per K step.  w8_ptr / w32_ptr: the weight as
    int8 / int32 (stride_wn in int32 words); xq (M, K) int8, xd (M, K/256), xs (M, K/32) fp32."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    row_words = rows.to(tl.int64) * stride_wn
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = ms < M
    blk_begin = pid_k * blocks_per_split
    blk_end = tl.minimum(blk_begin + blocks_per_split, nb)
    _pdl_prologue(w32_ptr + row_words, rmask, blk_begin, blk_end, QTYPE, 1, PDL)
    xo = ms[None, :].to(tl.int64) * (nb * 256) + tl.arange(0, 32)[:, None]
    so = ms.to(tl.int64) * (nb * 8)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    w8 = w8_ptr + row_words * 4
    w32 = w32_ptr + row_words
    FIVE: tl.constexpr = QTYPE == 13
    for kb in range(blk_begin, blk_end, KBS):
        # KBS = 2: both super-blocks' loads are issued before either's math (the layout conversions of the math
        # hold barriers, which loads do not cross)
        h0, h1, h2, h3, qh, q0, q1, q2, q3 = _load_mma(w8, w32, rmask, kb, FIVE)
        if KBS == 2:
            ok = kb + 1 < blk_end
            g0, g1, g2, g3, gh, p0, p1, p2, p3 = _load_mma(w8, w32, rmask & ok, kb + 1, FIVE)
        acc = _math_mma(acc, h0, h1, h2, h3, qh, q0, q1, q2, q3, xq_ptr, xo + kb * 256, xs_ptr, xd_ptr, so + kb * 8,
                        mmask, FIVE, EMULATE)
        if KBS == 2:
            acc = _math_mma(acc, g0, g1, g2, g3, gh, p0, p1, p2, p3, xq_ptr, xo + (kb + 1) * 256, xs_ptr, xd_ptr,
                            so + (kb + 1) * 8, mmask & ok, FIVE, EMULATE)
    _write_tile(tl.trans(acc), y_ptr, part_ptr, count_ptr, M, N, rows, rmask, stride_ym, pid_n, pid_k, pid_m,
                BLOCK_M, SPLIT_K)


def _tile_args(fn: str, M: int, block_m: int | None, block_n: int, split_k: int, num_warps: int,
               num_stages: int) -> int:
    """Check the launch arguments of ``fn`` (Python ints: Triton's launcher takes no numpy ints or floats); returns
    block_m (None: 8 for M <= 8, else 16).  Raises ValueError."""
    block_m = 8 if block_m is None and M <= 8 else 16 if block_m is None else block_m
    if type(block_m) is not int or block_m not in (8, 16):
        raise ValueError(f"{fn}: block_m={block_m!r} must be 8 or 16")
    if type(num_warps) is not int or num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"{fn}: num_warps={num_warps!r} must be a power of two up to 32")
    if type(num_stages) is not int or num_stages < 1:
        raise ValueError(f"{fn}: num_stages={num_stages!r} must be an int >= 1")
    if type(block_n) is not int or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{fn}: block_n={block_n!r} must be a power of two >= 16")
    if type(split_k) is not int or split_k < 1:
        raise ValueError(f"{fn}: split_k={split_k!r} must be an int >= 1")
    return block_m


def gguf_linear_mma(x: torch.Tensor, qweight: torch.Tensor, qtype: int, N: int, block_n: int = 64, split_k: int = 1,
                    num_warps: int = 2, block_m: int | None = None, num_stages: int = 1, asm: bool = True,
                    kbs: int = 1) -> torch.Tensor:
    """y = x @ dequantize(qweight)[:N].T on the int8 tensor cores, x rounded to int8 blocks of 256 (module
    docstring).

    Args:
        x: (M, K) bf16/fp16/fp32 activations, M >= 0 (meant for 3..16; any M runs, BLOCK_M rows per program).
        qweight: (>= N, >= row_bytes) uint8 raw Q4_K or Q5_K rows (row_bytes = K / 256 * 144 or 176).
        qtype: GGML type id, Q4_K or Q5_K.
        N: output features.  block_n (>= 16), split_k, num_warps: launch parameters as ``GemvConfig``.
        block_m: activation rows per program, 8 or 16 (None: 8 for M <= 8, else 16).
        num_stages: Triton's software pipelining of the K loop (1: none).
        kbs: super-blocks per K step, 1 or 2 (2: both blocks' weight loads are in flight together); a split takes
            a multiple of kbs super-blocks.
        asm: False unpacks the codes byte by byte instead of four per PTX instruction (always so under the Triton
            interpreter); the results are bit-identical.
    Returns:
        (M, N) in x's dtype, accumulated in fp32.
    Raises:
        ValueError: another type, x not (M, K) bf16/fp16/fp32, K not a multiple of 256, a qweight that is not
            2-D uint8 or holds too few rows or bytes, bad block_m / block_n / split_k / kbs.
    Capture-safe under CUDA graphs (two launches, no host synchronisation), with programmatic dependent launch
    (``gguf_gemv.pdl_value``) where a program takes fewer than MMA_PDL_MAX_BLOCKS super-blocks.
    """
    from glm5serve.kernels.gguf_gemv_q8 import quantize_activations

    qtype = type_id(qtype, "gguf_linear_mma")
    if qtype not in MMA_TYPES:
        raise ValueError(f"gguf_linear_mma: {_NAMES.get(qtype, f'type {qtype}')} has no tensor-core int8 kernel "
                         f"(supported: Q4_K, Q5_K)")
    _check_tensors("gguf_linear_mma", x=x, qweight=qweight)
    if qweight.dim() != 2:
        raise ValueError(f"gguf_linear_mma: qweight must be (rows, bytes), got shape {tuple(qweight.shape)}")
    K, N = _check(x, qweight, qtype, N, "gguf_linear_mma"), int(N)
    M = x.shape[0]
    block_m = _tile_args("gguf_linear_mma", M, block_m, block_n, split_k, num_warps, num_stages)
    if type(kbs) is not int or kbs not in (1, 2):
        raise ValueError(f"gguf_linear_mma: kbs={kbs!r} must be 1 or 2")
    if M == 0 or N == 0 or K == 0:
        return x.new_zeros((M, N))
    if x.stride(1) != 1:
        x = x.contiguous()
    nb = K // QK_K
    blocks_per_split = triton.cdiv(triton.cdiv(nb, split_k), kbs) * kbs
    split = triton.cdiv(nb, blocks_per_split)
    pdl = pdl_value(x.device, blocks_per_split) if blocks_per_split < MMA_PDL_MAX_BLOCKS else 0
    w = _as_words(qweight, qtype, unit=4)
    xq, xd, xs = quantize_activations(x, pdl=bool(pdl), scale_block=QK_K)
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, block_m))
    y, part, counters = _split_outputs(x, N, grid, block_m)
    _gemm_mma_kernel[grid](xq, xd, xs, w.view(torch.int8), w, y, part, counters, M, N, nb, blocks_per_split,
                           w.stride(0), y.stride(0), QTYPE=qtype, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split,
                           EMULATE=x.device.type != "cuda" or not asm, PDL=pdl, KBS=kbs, num_warps=num_warps,
                           num_stages=num_stages, **pdl_launch(pdl))
    return y


# ---------------------------------------------------------------------------------------------------------------
# Split rows (``gguf_split``) on the int8 tensor cores
# ---------------------------------------------------------------------------------------------------------------

@triton.jit
def _codes_q4_0(q, HI: tl.constexpr, EMULATE: tl.constexpr):
    """16 (u - 8) as int8 for the low (HI: high) nibbles u of split-row Q4_0 bytes q: u ^ 8 read as a 4-bit two's
    complement number is u - 8 (``gguf_split._step_split``), moved to the top of its byte.  Four codes per LOP3
    (plus a shift for the low nibbles).  EMULATE: per byte, for the interpreter."""
    if EMULATE:
        u = (q.to(tl.int32) >> 4) & 15 if HI else q.to(tl.int32) & 15
        return ((u ^ 8) << 4).to(tl.int8)
    if HI:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, 0xF0F0F0F0, 0x80808080, 0x6a;", "=r,r", [q],
                                         dtype=tl.int8, is_pure=True, pack=4)
    return tl.inline_asm_elementwise("{ .reg .b32 t; shl.b32 t, $1, 4; lop3.b32 $0, t, 0xF0F0F0F0, 0x80808080, 0x6a; }",
                                     "=r,r", [q], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _codes_q6_split(qs, qh, sh, HI: tl.constexpr, EMULATE: tl.constexpr):
    """4 (u - 32) as int8 for Q6_K split-row codes: the low (HI: high) nibbles of qs bytes, with their top two bits
    from the qh bytes shifted left by sh (int8, the same in the four bytes of a word) to bits 6-7 (``gguf_split``'s
    layout, ``_step_split``); u ^ 32 as a 6-bit two's complement number is u - 32, top-aligned in its byte."""
    if EMULATE:
        nib = (qs.to(tl.int32) >> 2) & 0x3C if HI else (qs.to(tl.int32) << 2) & 0x3C
        return ((nib | ((qh.to(tl.int32) << sh.to(tl.int32)) & 0xC0)) ^ 0x80).to(tl.int8)
    # u: the nibbles at bits 2-5; t: the qh bit pair at bits 6-7; then (u & 0x3C) | (t & 0xC0), ^ 0x80
    if HI:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 t, u, s; and.b32 s, $3, 0xFF; shr.b32 u, $1, 2; shl.b32 t, $2, s; "
            "and.b32 u, u, 0x3C3C3C3C; lop3.b32 u, u, t, 0xC0C0C0C0, 0xf8; xor.b32 $0, u, 0x80808080; }",
            "=r,r,r,r", [qs, qh, sh], dtype=tl.int8, is_pure=True, pack=4)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, u, s; and.b32 s, $3, 0xFF; shl.b32 u, $1, 2; shl.b32 t, $2, s; "
        "and.b32 u, u, 0x3C3C3C3C; lop3.b32 u, u, t, 0xC0C0C0C0, 0xf8; xor.b32 $0, u, 0x80808080; }",
        "=r,r,r,r", [qs, qh, sh], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _step_split_mma(acc, row, row16, ng, g0, g_end, xq_ptr, xd_ptr, xrow, mmask, QTYPE: tl.constexpr,
                    GROUPS: tl.constexpr, EMULATE: tl.constexpr):
    """acc [BN, BM] fp32 plus 32-element groups g0 .. g0 + GROUPS - 1 (those from g_end masked off) of BLOCK_N split
    rows (``row`` / ``row16``: [BN] int8 / int16 pointers to the rows, ng groups per row) against BLOCK_M rows of
    int8 activations (``xrow`` [BM] their offsets in xq_ptr; scales xd per 32, Q6_K per 256).  Int8 MMAs take K
    >= 32.

    Q8_0: one MMA of a group's 32 codes, times d dx.  Q4_0 and Q6_K take groups in pairs (g even): qs byte j of the
    pair holds the codes of element j (low nibble) and 16 + j (high nibble) of its group g + j // 16 (j modulo 16),
    so the low nibbles of the 32 bytes are elements 0-15 of both groups and the high ones 16-31.  Each of the four
    (group, half) products is one MMA of those 32 codes with an activation tile that is zero at the other group's
    16 positions; the tiles are 32 consecutive activations, so two of them are one load masked two ways.  Q4_0:
    codes 16 (u - 8), times d dx / 16.  Q6_K: codes 4 (u - 32), the top bits of qs byte j at bits 4 ((j // 4) % 2)
    (+ 2 for the high nibble) of qh byte 4 (j // 8) + j % 4 of the pair; each half group has an int8 scale, the
    scaled sums of a 256-block's 8 groups add up in integers and take d dx / 4."""
    j = tl.arange(0, 32)
    if QTYPE == 8:
        for i in tl.static_range(GROUPS):
            g = g0 + i
            ok = g < g_end
            q = tl.load(row[:, None] + 32 * g + j[None, :], mask=ok, other=0, eviction_policy="evict_first")
            xt = tl.load(xq_ptr + xrow[None, :] + 32 * g + j[:, None], mask=mmask[None, :] & ok, other=0)
            d = tl.load(row16 + 16 * ng + g, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            dx = tl.load(xd_ptr + xrow // 32 + g, mask=mmask & ok, other=0.0)
            acc += d[:, None] * (tl.dot(q, xt, out_dtype=tl.int32).to(tl.float32) * dx[None, :])
        return acc
    first = (j < 16)[:, None]
    if QTYPE == 14:
        isum = tl.zeros(acc.shape, dtype=tl.int32)
        qh_at = 4 * (j // 8) + j % 4  # qh byte of qs byte j within the pair
        sh_lo = (6 - 4 * ((j // 4) % 2)).to(tl.int8)[None, :]  # moves its bit pair to bits 6-7
        sh_hi = sh_lo - 2
    for i in tl.static_range(0, GROUPS, 2):
        g = g0 + i
        ok = g < g_end  # the pair is whole: splits and ng are even
        q = tl.load(row[:, None] + 16 * g + j[None, :], mask=ok, other=0, eviction_policy="evict_first")
        xb = xq_ptr + xrow[None, :] + 32 * g + j[:, None]
        mm = mmask[None, :] & ok
        x0 = tl.load(xb, mask=mm & first, other=0)  # group g, elements 0-15
        x1 = tl.load(xb + 16, mask=mm & first, other=0)  # g, 16-31
        x2 = tl.load(xb + 16, mask=mm & ~first, other=0)  # g + 1, 0-15
        x3 = tl.load(xb + 32, mask=mm & ~first, other=0)  # g + 1, 16-31
        if QTYPE == 14:
            qh = tl.load(row[:, None] + 16 * ng + 8 * g + qh_at[None, :], mask=ok, other=0,
                         eviction_policy="evict_first")
            lo = _codes_q6_split(q, qh, sh_lo, False, EMULATE)
            hi = _codes_q6_split(q, qh, sh_hi, True, EMULATE)
            sc = tl.load((row16 + 12 * ng + g).to(tl.pointer_type(tl.int32)), mask=ok, other=0)  # 4 int8 scales
            isum += (((sc << 24) >> 24)[:, None] * tl.dot(lo, x0, out_dtype=tl.int32)
                     + ((sc << 16) >> 24)[:, None] * tl.dot(hi, x1, out_dtype=tl.int32)
                     + ((sc << 8) >> 24)[:, None] * tl.dot(lo, x2, out_dtype=tl.int32)
                     + (sc >> 24)[:, None] * tl.dot(hi, x3, out_dtype=tl.int32))
        else:
            lo = _codes_q4_0(q, False, EMULATE)
            hi = _codes_q4_0(q, True, EMULATE)
            dot0 = tl.dot(hi, x1, tl.dot(lo, x0, out_dtype=tl.int32), out_dtype=tl.int32)
            dot1 = tl.dot(hi, x3, tl.dot(lo, x2, out_dtype=tl.int32), out_dtype=tl.int32)
            d0 = tl.load(row16 + 8 * ng + g, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            d1 = tl.load(row16 + 8 * ng + g + 1, mask=ok, other=0).to(tl.float16, bitcast=True).to(tl.float32)
            dx0 = tl.load(xd_ptr + xrow // 32 + g, mask=mmask & ok, other=0.0)
            dx1 = tl.load(xd_ptr + xrow // 32 + g + 1, mask=mmask & ok, other=0.0)
            acc += ((d0 * 0.0625)[:, None] * (dot0.to(tl.float32) * dx0[None, :])
                    + (d1 * 0.0625)[:, None] * (dot1.to(tl.float32) * dx1[None, :]))
    if QTYPE == 14:
        d = tl.load(row16 + 13 * ng + g0 // 8).to(tl.float16, bitcast=True).to(tl.float32) * 0.25
        dx = tl.load(xd_ptr + xrow // 256 + g0 // 8, mask=mmask, other=0.0)
        acc += d[:, None] * (isum.to(tl.float32) * dx[None, :])
    return acc


@triton.jit
def _gemm_split_mma_kernel(xq_ptr, xd_ptr, w_ptr, y_ptr, part_ptr, count_ptr, M, N, ng, groups_per_split,
                           stride_wn, stride_ym, QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           SPLIT_K: tl.constexpr, EMULATE: tl.constexpr, PDL: tl.constexpr = 0,
                           GROUPS: tl.constexpr = 8):
    """Grid (N tiles, SPLIT_K, M tiles); split-K and PDL as ``gguf_gemv._gemv_kernel``.  w_ptr: split rows as int8,
    stride_wn bytes apart, ng 32-element groups per row, GROUPS per K step; xq (M, 32 ng) int8, xd (M, ng) fp32
    (Q6_K: (M, ng / 8)).  Rows past N read row N - 1 (their outputs are not stored)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    row = w_ptr + tl.minimum(rows, N - 1).to(tl.int64) * stride_wn
    row16 = row.to(tl.pointer_type(tl.int16))
    g_begin = pid_k * groups_per_split
    g_end = tl.minimum(g_begin + groups_per_split, ng)
    if PDL > 0:
        _gdc_wait()
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = ms < M
    xrow = ms.to(tl.int64) * (ng * 32)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for g0 in range(g_begin, g_end, GROUPS):
        acc = _step_split_mma(acc, row, row16, ng, g0, g_end, xq_ptr, xd_ptr, xrow, mmask, QTYPE, GROUPS, EMULATE)
    _write_tile(tl.trans(acc), y_ptr, part_ptr, count_ptr, M, N, rows, rmask, stride_ym, pid_n, pid_k, pid_m,
                BLOCK_M, SPLIT_K)


def gguf_linear_split_mma(x: torch.Tensor, qweight: torch.Tensor, stype: int, N: int, block_n: int = 64,
                          split_k: int = 1, num_warps: int = 2, block_m: int | None = None, num_stages: int = 1,
                          groups: int = 8, asm: bool = True) -> torch.Tensor:
    """y = x @ W[:N].T for a weight of split rows (``gguf_split.split_rows``) of Q8_0, Q4_0 or Q6_K on the int8
    tensor cores, x rounded to int8 blocks of 32 (Q6_K: 256; ``quantize_activations``).

    Args:
        x: (M, K) bf16/fp16/fp32 activations (meant for 9..16 rows; any M runs, block_m rows per program).
        qweight: (>= N, >= row_bytes) uint8 split rows, row_bytes as the GGUF row.
        stype: split type id (``gguf_split.split_type``).
        N: output features.  block_n (a power of two >= 16), split_k, num_warps, num_stages: launch parameters as
            ``gguf_linear_mma``; block_m: 8 or 16 (None: 8 for M <= 8, else 16).
        groups: 32-element groups per K step (Q6_K: 8, one 256-block); a split takes whole steps.
        asm: False unpacks the codes byte by byte (always so under the Triton interpreter); bit-identical.
    Returns:
        (M, N) in x's dtype, accumulated in fp32.  Error bound ``kernels.testing.q8_activation_bound`` (Q6_K with
        ``block=256``).
    Raises:
        ValueError: another type, shapes that do not fit, bad launch parameters.
    Capture-safe under CUDA graphs (two launches, no host synchronisation).
    """
    from glm5serve.kernels.gguf_gemv_q8 import quantize_activations
    from glm5serve.kernels.gguf_split import _check_split, base_type

    stype = type_id(stype, "gguf_linear_split_mma", "stype")
    qtype = base_type(stype)
    if stype == qtype and qtype in SPLIT_MMA_TYPES:  # GGUF rows, or a forgotten split_type()
        raise ValueError(f"gguf_linear_split_mma: stype={stype} is the plain GGML type {_NAMES[qtype]}, not a "
                         f"split type id (convert with gguf_split.split_rows and pass gguf_split.split_type)")
    if stype == qtype or qtype not in SPLIT_MMA_TYPES:
        name = _NAMES.get(qtype, f"type id {stype}") + ("/split" if stype != qtype else "")
        raise ValueError(f"gguf_linear_split_mma: {name} has no split-row tensor-core kernel (supported: Q8_0, "
                         f"Q4_0 and Q6_K split rows)")
    _check_split(qweight, stype, None, N, x, "gguf_linear_split_mma")
    (M, K), N = x.shape, int(N)
    block_m = _tile_args("gguf_linear_split_mma", M, block_m, block_n, split_k, num_warps, num_stages)
    if type(groups) is not int or groups not in ((1, 2, 4, 8) if qtype == Q8_0 else (2, 4, 8) if qtype == Q4_0 else (8,)):
        raise ValueError(f"gguf_linear_split_mma: groups={groups!r} must be 1, 2, 4 or 8 (Q4_0: 2, 4 or 8; Q6_K: 8)")
    if M == 0 or N == 0:
        return x.new_zeros((M, N))
    if x.stride(1) != 1:
        x = x.contiguous()
    ng = K // 32
    per_split = triton.cdiv(triton.cdiv(ng, split_k), groups) * groups
    split = triton.cdiv(ng, per_split)
    pdl = pdl_value(x.device, 0)
    w = _as_words(qweight, qtype, unit=4).view(torch.int8)
    xq, xd, _ = quantize_activations(x, pdl=bool(pdl), scale_block=QK_K if qtype == Q6_K else 32)
    grid = (triton.cdiv(N, block_n), split, triton.cdiv(M, block_m))
    y, part, counters = _split_outputs(x, N, grid, block_m)
    _gemm_split_mma_kernel[grid](xq, xd, w, y, part, counters, M, N, ng, per_split, w.stride(0), y.stride(0),
                                 QTYPE=qtype, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT_K=split,
                                 EMULATE=x.device.type != "cuda" or not asm, PDL=pdl, GROUPS=groups,
                                 num_warps=num_warps, num_stages=num_stages, **pdl_launch(pdl))
    return y

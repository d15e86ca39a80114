"""Quantize float32 weights to GGUF block types, in numpy (no llama.cpp needed).

Q4_K, Q5_K and Q6_K are llama.cpp's reference quantizers (``quantize_row_q4_K_ref``, ``quantize_row_q5_K_ref``,
``quantize_row_q6_K_ref`` with their helpers ``make_qkx2_quants`` and ``make_qx_quants``, ggml/src/ggml-quants.c) --
what ``llama-quantize`` runs without an importance matrix. They are vectorised over all sub-blocks: the C loops
over blocks become array axes, while the loops over candidate scales stay loops and keep their order, and every
sum is taken in the C loop's order in fp32, so the bytes match ggml's nearly always (a different libm or FMA
contraction in a ggml build can flip a rounding). Every other type is delegated to gguf-py's ``quants.quantize``.

Working layout: sub-block values lie along axis 0 and sub-blocks along axis 1 (``(32, S)``), so that
``np.add.reduce(axis=0)`` adds rows one after another exactly like the C ``for`` loop.
"""
from __future__ import annotations

import operator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from glm5serve.errors import GGUFModelError

Q = GGMLQuantizationType
QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)
CHUNK_BLOCKS = 256  # 256-value blocks quantized per step: keeps the (32, S) temporaries in cache
f32 = np.float32


def _seq_sum(a: np.ndarray) -> np.ndarray:
    """Sum over axis 0 in index order (numpy reduces a leading axis row by row, like ``s += a[i]`` in C)."""
    return np.add.reduce(a, axis=0)


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: round half to even in fp32 (its ``fval + 12582912.f`` trick), as int32."""
    return np.rint(v).astype(np.int32)


def _to_f16(v: np.ndarray) -> np.ndarray:
    """``GGML_FP32_TO_FP16`` (round to nearest even) -> the fp16 value back in fp32, plus its two bytes."""
    h = v.astype(np.float16)
    return h.astype(np.float32), h.view(np.uint8).reshape(*v.shape, 2)


def _codes(x: np.ndarray, offset: np.ndarray | None, iscale: np.ndarray, lo: float, hi: float,
           out: np.ndarray) -> np.ndarray:
    """``clip(nearest_int(iscale * (x - offset)), lo, hi)`` as fp32 into ``out`` (rounding stays in fp32, exact)."""
    if offset is None:
        np.multiply(x, iscale, out=out)
    else:
        np.multiply(np.subtract(x, offset, out=out), iscale, out=out)
    np.rint(out, out=out)
    np.maximum(out, f32(lo), out=out)
    return np.minimum(out, f32(hi), out=out)


def make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric (scale, min) fit of each column of ``x`` (``(n, S)`` fp32) with weights ``w``, codes 0..nmax.

    Tries ``nstep + 1`` scales ``(rmin + rdelta*is + nmax) / (max - min)`` and keeps the least weighted squared
    error (``use_mad=false``). Returns ``scale (S,)``, ``the_min (S,)`` (= -min >= 0) and codes ``L (n, S)`` uint8.
    Source: ``make_qkx2_quants`` in ggml/src/ggml-quants.c.
    """
    mn = np.minimum(x.min(axis=0), f32(0))
    mx = x.max(axis=0)
    sum_w = _seq_sum(w)
    sum_x = _seq_sum(w * x)
    flat = mx == mn
    laux, tmp, tmp2 = np.empty_like(x), np.empty_like(x), np.empty_like(x)

    def weighted_sq_error(scale, the_min, codes):  # sum of w * (scale*l + min - x)^2, in the C loop's order
        np.multiply(codes, scale, out=tmp)
        np.add(tmp, the_min, out=tmp)
        np.subtract(tmp, x, out=tmp)
        np.multiply(tmp, tmp, out=tmp)
        return _seq_sum(np.multiply(w, tmp, out=tmp))

    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = f32(nmax) / (mx - mn)
        scale = f32(1) / iscale
        # The codes are a function of (iscale, min) at the step that won: remember those, rebuild L once at the end
        # (the same float ops, so the same codes) instead of copying masked lanes every step.
        best_iscale, best_offset = iscale, mn
        best_error = weighted_sq_error(scale, mn, _codes(x, mn, iscale, 0, nmax, laux))
        for step in range(nstep + 1):
            iscale = (f32(rmin) + f32(rdelta) * f32(step) + f32(nmax)) / (mx - mn)
            _codes(x, mn, iscale, 0, nmax, laux)
            wl = np.multiply(w, laux, out=tmp)
            sum_l, sum_l2 = _seq_sum(wl), _seq_sum(np.multiply(wl, laux, out=tmp2))
            sum_xl = _seq_sum(np.multiply(wl, x, out=tmp))
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            this_min = np.where(pos, f32(0), this_min)
            cur_error = weighted_sq_error(this_scale, this_min, laux)
            better = (D > 0) & (cur_error < best_error) & ~flat
            if better.any():
                best_iscale = np.where(better, iscale, best_iscale)
                best_offset = np.where(better, mn, best_offset)
                best_error = np.where(better, cur_error, best_error)
                scale = np.where(better, this_scale, scale)
                mn = np.where(better, this_min, mn)  # C updates `min`, which the next candidates use
        L = _codes(x, best_offset, best_iscale, 0, nmax, laux)
    L[:, flat] = 0
    return np.where(flat, f32(0), scale).astype(np.float32), (-mn).astype(np.float32), L.astype(np.uint8)


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric scale fit of each column of ``x`` (``(n, S)`` fp32), codes ``l + nmax`` in 0..2*nmax-1, weighted by
    ``x²`` (``rmse_type=1``, no importance weights), trying 19 scales ``-(nmax + 0.1*is) / max``.

    Returns ``scale (S,)`` (negative when the largest-magnitude value is positive) and codes ``L (n, S)`` uint8.
    Source: ``make_qx_quants`` in ggml/src/ggml-quants.c.
    """
    S = x.shape[1]
    ax = np.abs(x)
    imax = ax.argmax(axis=0)  # first index of the largest |x|, as the C loop's strict '>'
    amax = ax[imax, np.arange(S)]
    xmax = x[imax, np.arange(S)]
    zero = amax < GROUP_MAX_EPS
    w = x * x
    wx = w * x
    lf, tmp = np.empty_like(x), np.empty_like(x)

    def fit(iscale):  # codes l (fp32, in lf) and the C loop's sums of w*x*l and w*l*l
        _codes(x, None, iscale, -nmax, nmax - 1, lf)
        sumlx = _seq_sum(np.multiply(wx, lf, out=tmp))
        np.multiply(w, lf, out=tmp)
        return sumlx, _seq_sum(np.multiply(tmp, lf, out=tmp))

    with np.errstate(divide="ignore", invalid="ignore"):
        best_iscale = iscale = f32(-nmax) / xmax
        sumlx, suml2 = fit(iscale)
        scale = np.where(suml2 != 0, sumlx / suml2, f32(0))
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            iscale = -(f32(nmax) + f32(0.1) * f32(step)) / xmax
            sumlx, suml2 = fit(iscale)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            if better.any():
                best_iscale = np.where(better, iscale, best_iscale)  # codes are rebuilt from it at the end
                scale = np.where(better, sumlx / suml2, scale)
                best = np.where(better, scale * sumlx, best)
        L = _codes(x, None, best_iscale, -nmax, nmax - 1, lf) + f32(nmax)
    L[:, zero] = 0
    return np.where(zero, f32(0), scale).astype(np.float32), L.astype(np.uint8)


def _subblocks(x: np.ndarray, n: int) -> np.ndarray:
    """``(nb, 256)`` -> ``(n, nb*256/n)``: sub-block values along axis 0 (see module docstring)."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


def _q45_k_scales(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Shared front half of ``quantize_row_q4_K_ref`` / ``quantize_row_q5_K_ref`` for ``x (nb, 256)``:
    per-32 (scale, min) fits, their 6-bit codes and fp16 super-scales, then the requantized codes ``(nb, 256)``."""
    nb = x.shape[0]
    xs = _subblocks(x, 32)
    av_x = np.sqrt(_seq_sum(xs * xs) / f32(32))
    weights = av_x + np.abs(xs)
    scales, mins, L = make_qkx2_quants(xs, weights, nmax, rmin, rdelta, nstep)
    scales, mins = scales.reshape(nb, 8), mins.reshape(nb, 8)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    # C starts at +0 and takes only larger values: an all-zero block keeps +0, never -0 (mins are -0 there)
    max_scale = np.where(max_scale > 0, max_scale, f32(0))
    max_min = np.where(max_min > 0, max_min, f32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, f32(63) / max_scale, f32(0)).astype(np.float32)
        inv_min = np.where(max_min > 0, f32(63) / max_min, f32(0)).astype(np.float32)
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63).astype(np.uint8)  # uint8_t, then MIN(63)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63).astype(np.uint8)
    packed = np.concatenate([ls[:, :4] | ((ls[:, 4:] >> 4) << 6), lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
                             (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)], axis=1)
    d, d_bytes = _to_f16(max_scale / f32(63))
    dmin, dmin_bytes = _to_f16(max_min / f32(63))
    # requantize every value against the rounded scales (get_scale_min_k4 gives back ls, lm)
    dl = (d[:, None] * ls.astype(np.float32)).reshape(-1)
    ml = (dmin[:, None] * lm.astype(np.float32)).reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest_int((xs + ml) / dl), 0, nmax)
    L = np.where(dl != 0, requant, L).astype(np.uint8)  # a zero scale keeps the fit's codes (C's `continue`)
    return d_bytes, dmin_bytes, packed, L.T.reshape(nb, QK_K)


def _q4_k_blocks(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q4_K_ref``: ``(nb, 256)`` fp32 -> ``(nb, 144)`` bytes ``d, dmin, scales[12], qs[128]``."""
    nb = x.shape[0]
    d, dmin, scales, L = _q45_k_scales(x, 15, -1.0, 0.1, 20)
    L = L.reshape(nb, 4, 2, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(nb, 128)
    return np.concatenate([d, dmin, scales, qs], axis=1)


def _q5_k_blocks(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q5_K_ref``: ``(nb, 256)`` -> ``(nb, 176)`` bytes ``d, dmin, scales[12], qh[32], qs[128]``."""
    nb = x.shape[0]
    d, dmin, scales, L = _q45_k_scales(x, 31, -0.5, 0.1, 15)
    lo, hi = (L & 0x0F).reshape(nb, 4, 2, 32), (L >> 4).reshape(nb, 8, 32)
    qs = (lo[:, :, 0] | (lo[:, :, 1] << 4)).reshape(nb, 128)
    qh = np.bitwise_or.reduce(hi << np.arange(8, dtype=np.uint8)[None, :, None], axis=1).astype(np.uint8)
    return np.concatenate([d, dmin, scales, qh, qs], axis=1)


def _q6_k_blocks(x: np.ndarray) -> np.ndarray:
    """``quantize_row_q6_K_ref``: ``(nb, 256)`` -> ``(nb, 210)`` bytes ``ql[128], qh[64], scales[16] (int8), d``."""
    nb = x.shape[0]
    xs = _subblocks(x, 16)
    scales, L = make_qx_quants(xs, 32)
    scales = scales.reshape(nb, 16)
    imax = np.abs(scales).argmax(axis=1)
    max_scale = scales[np.arange(nb), imax]
    zero = np.abs(max_scale) < GROUP_MAX_EPS  # the whole block is stored as zeros
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, f32(0), f32(-128) / max_scale).astype(np.float32)
        d, d_bytes = _to_f16(np.where(zero, f32(0), f32(1) / iscale).astype(np.float32))
        sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
        dl = (d[:, None] * sc.astype(np.float32)).reshape(-1)
        requant = np.clip(_nearest_int(xs / dl), -32, 31) + 32
    L = np.where(dl != 0, requant, L).astype(np.uint8).T.reshape(nb, 2, 4, 32)
    lo, hi = L & 0x0F, L >> 4
    ql = (lo[:, :, 0:2] | (lo[:, :, 2:4] << 4)).reshape(nb, 128)
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(nb, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)
    out[zero] = 0
    return out


_K_QUANTIZERS = {Q.Q4_K: _q4_k_blocks, Q.Q5_K: _q5_k_blocks, Q.Q6_K: _q6_k_blocks}
OWN_TYPES: tuple[Q, ...] = tuple(_K_QUANTIZERS)
# Types quantize() writes: ours plus those gguf-py quantizes that glm5serve.dequant reads back.
GGUF_PY_TYPES: tuple[Q, ...] = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)
QUANTIZE_TYPES: tuple[Q, ...] = GGUF_PY_TYPES + OWN_TYPES
#: byte range of each block's fp16 fields (scale d, and min m / dmin), from ggml-common.h's block_* structs
_HALF_FIELDS = {Q.Q4_0: (0, 2), Q.Q4_1: (0, 4), Q.Q5_0: (0, 2), Q.Q5_1: (0, 4), Q.Q8_0: (0, 2),
                Q.Q4_K: (0, 4), Q.Q5_K: (0, 4), Q.Q6_K: (208, 210)}
F16_MAX = 65504.0
BF16_MAX = float(np.array(0x7F7F0000, np.uint32).view(np.float32))  # 3.3895e38
F32_MAX = float(np.finfo(np.float32).max)


def quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Quantize ``data`` (``float32 (..., row)``) to ``qtype``; same contract as ``gguf.quants.quantize``.

    Returns ``uint8 (..., row_bytes)`` for block types and BF16 (``row_bytes = row / block_size * type_size``, the
    shape of gguf-py's ``quant_shape_to_byte_shape``), ``float32`` / ``float16`` arrays of ``data``'s shape for F32 /
    F16; other input dtypes are converted to float32 first. An empty input (no rows, or rows of 0 values) gives the
    empty result of that shape for every type. Q4_K/Q5_K/Q6_K use llama.cpp's reference algorithm (this module);
    the other :data:`QUANTIZE_TYPES` use gguf-py.

    Raises GGUFModelError naming the type when it is not in ``QUANTIZE_TYPES`` (a float or a bool is no type), when
    the row is not a whole number of blocks, when a value is NaN/inf, or when a value is too large for the type:
    beyond float32's 3.4028e38 (say, in a float64 input), beyond fp16's 65504 for F16, rounding past bf16's largest
    3.3895e38 to inf for BF16 (to nearest even, as gguf-py and ggml round), and for block types, a block scale that
    overflows its fp16 field, which would dequantize to inf.
    """
    supported = f"(supported: {', '.join(t.name for t in QUANTIZE_TYPES)})"
    try:  # as dequantize: 12.7 is not truncated to Q4_K; a bool is refused, not taken as F16 / F32
        if isinstance(qtype, bool):
            raise TypeError
        qtype = Q(operator.index(qtype))
    except (TypeError, ValueError):  # a number ggml does not define, a type's name, None
        raise GGUFModelError(f"quantization to unknown ggml type {qtype!r} is not supported {supported}") from None
    if qtype not in QUANTIZE_TYPES:
        raise GGUFModelError(f"quantization to {qtype.name} is not supported {supported}")
    raw = np.asarray(data)
    with np.errstate(over="ignore"):  # a float64 value past float32's range: named below
        x = raw if raw.dtype == np.float32 else raw.astype(np.float32)
    if not (finite := np.isfinite(x)).all():
        if raw.dtype.kind == "f" and np.isfinite(raw[~finite]).all():
            raise GGUFModelError(f"cannot quantize |values| up to {np.abs(raw).max():.3g} to {qtype.name}: too large "
                                 f"for float32, which quantize converts to first (largest: {F32_MAX:.5g})")
        raise GGUFModelError(f"cannot quantize non-finite values (NaN/inf) to {qtype.name}")
    if qtype == Q.F16 and x.size and np.abs(x).max() > F16_MAX:
        raise GGUFModelError(f"cannot quantize |values| up to {np.abs(x).max():.3g} to F16 (largest: {F16_MAX:g})")
    if qtype in (Q.F32, Q.F16):
        return gguf_quants.quantize(x, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    if x.ndim == 0 or x.shape[-1] % block_size:
        raise GGUFModelError(f"cannot quantize rows of {x.shape[-1] if x.ndim else 0} values to {qtype.name}: "
                             f"not a whole number of {block_size}-value blocks")
    out_shape = (*x.shape[:-1], x.shape[-1] // block_size * type_size)
    if x.size == 0:  # gguf-py's block quantizers fail to reshape an empty array
        return np.zeros(out_shape, dtype=np.uint8)
    fn = _K_QUANTIZERS.get(qtype)
    with np.errstate(over="ignore", invalid="ignore"):  # huge values: the scale check below names the fault
        if fn is None:
            out = gguf_quants.quantize(x, qtype)
        else:
            blocks = x.reshape(-1, block_size)
            out = np.empty((blocks.shape[0], type_size), dtype=np.uint8)
            for start in range(0, blocks.shape[0], CHUNK_BLOCKS):  # chunks of whole blocks, each fully vectorised
                out[start:start + CHUNK_BLOCKS] = fn(blocks[start:start + CHUNK_BLOCKS])
            out = out.reshape(out_shape)
    if qtype == Q.BF16 and ((out.view(np.uint16) & 0x7FFF) == 0x7F80).any():  # finite input rounded to inf
        raise GGUFModelError(f"cannot quantize |values| up to {np.abs(x).max():.5g} to BF16: rounds past bf16's "
                             f"largest {BF16_MAX:.5g} to inf")
    if qtype in _HALF_FIELDS:
        a, b = _HALF_FIELDS[qtype]
        if not np.isfinite(out.reshape(-1, type_size)[:, a:b].copy().view(np.float16)).all():
            raise GGUFModelError(f"cannot quantize |values| up to {np.abs(x).max():.3g} to {qtype.name}: a block "
                                 "scale overflows its fp16 field")
    return out

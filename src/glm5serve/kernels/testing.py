"""Test data and independent references for the GGUF kernels (used by the CPU-interpreter and GPU tests and the
benchmark): quantized weights with sane scales, and gguf-py's dequantizer followed by an fp64 matmul."""
from __future__ import annotations

import functools

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

# Byte offsets of the fp16 super-block scales (ggml-common.h ``block_q4_K`` etc.).
_KQUANT_F16 = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
_F16_FIELDS = {**_KQUANT_F16, Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q8_0: (0,)}


def random_qweight(qtype: int, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.05) -> np.ndarray:
    """Raw GGUF bytes ``uint8 (rows, row_bytes)`` of a ``qtype`` weight of numpy shape ``(rows, cols)``.

    Q4_0/Q5_0/Q8_0: gguf-py's quantizer applied to N(0, scale) weights.  K-quants: random bytes (every code and
    6-bit/int8 sub-scale pattern) with the fp16 super-block scales overwritten by finite values of either sign,
    sized so that weights are about ``scale``.
    """
    qtype = Q(qtype)
    qk, qb = gguf.GGML_QUANT_SIZES[qtype]
    if qtype not in _KQUANT_F16:
        w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        return gguf.quants.quantize(w, qtype)
    blocks = rng.integers(0, 256, (rows, cols // qk, qb), dtype=np.uint8)
    unit = scale / (32 * 8 if qtype == Q.Q6_K else 32 * 15)  # typical |sub-scale * code|
    for off in _KQUANT_F16[qtype]:
        d = (rng.uniform(-2, 2, blocks.shape[:2]) * unit).astype(np.float16)
        blocks[..., off:off + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def random_qweight_torch(qtype: int, shape: tuple[int, ...], device, generator: torch.Generator | None = None,
                         scale: float = 0.02) -> torch.Tensor:
    """Random raw bytes ``uint8 (*shape[:-1], row_bytes)`` of a ``qtype`` weight of numpy ``shape``, made on
    ``device`` (fast for gigabytes of benchmark experts): random codes and sub-scales, every fp16 block scale set
    to a finite value of either sign of order ``scale / 256``."""
    qtype = Q(qtype)
    qk, qb = gguf.GGML_QUANT_SIZES[qtype]
    blocks = torch.randint(0, 256, (*shape[:-1], shape[-1] // qk, qb), dtype=torch.uint8, device=device,
                           generator=generator)
    for off in _F16_FIELDS[qtype]:
        d = (torch.rand(blocks.shape[:-1], device=device, generator=generator) * 2 - 1) * (scale / 256)
        blocks[..., off:off + 2] = d.to(torch.float16).view(torch.uint8).reshape(*blocks.shape[:-1], 2)
    return blocks.reshape(*shape[:-1], -1)


def dequant(qweight, qtype: int) -> torch.Tensor:
    """gguf-py's dequantizer (the oracle) as a float64 tensor; ``qweight`` may be (..., rows, row_bytes)."""
    if isinstance(qweight, torch.Tensor):
        qweight = qweight.cpu().numpy()
    return torch.from_numpy(gguf.quants.dequantize(np.ascontiguousarray(qweight), Q(qtype))).double()


def reference_linear(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W.T, |x| @ |W|.T) in float64 on the CPU; the second bounds how rounding errors can add up."""
    x64, w64 = x.detach().cpu().double(), weight.cpu().double()
    return x64 @ w64.T, x64.abs() @ w64.abs().T


def _routed_pairs(topk_ids: torch.Tensor):
    """(token, slot, expert) for every routed pair of ``topk_ids`` (T, k), in token then slot order; negative ids
    (experts on other ranks) are skipped."""
    for t, row in enumerate(topk_ids.tolist()):
        for s, e in enumerate(row):
            if e >= 0:
                yield t, s, e


def reference_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed-expert SwiGLU MLP in float64 from dequantized ``w13`` (E, 2I, H) and ``w2`` (E, H, I), one token and
    slot at a time (negative ids skipped); returns (y, bound) for error budgets: bound = sum_s |w_s| |W2| (|h| + dh)
    with dh = 1.1 |W1||x| |up| + |silu(gate)| |W3||x|, the first-order spread of relative errors in gate and up
    into h (|silu'| <= 1.1)."""
    x64 = x.detach().cpu().double()
    ids, wts = topk_ids.cpu(), topk_weights.cpu().double()
    inter = w13.shape[1] // 2
    y = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    bound = torch.zeros_like(y)
    for t, s, e in _routed_pairs(ids):
        gate_up = w13[e] @ x64[t]
        h = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
        g_bound = w13[e].abs() @ x64[t].abs()
        gate, up = gate_up[:inter], gate_up[inter:]
        h_bound = 1.1 * g_bound[:inter] * up.abs() + torch.nn.functional.silu(gate).abs() * g_bound[inter:]
        y[t] += wts[t, s] * (w2[e] @ h)
        bound[t] += wts[t, s].abs() * (w2[e].abs() @ (h.abs() + h_bound))
    return y, bound


def q8_moe_bound(x: torch.Tensor, w13_raw, w2_raw, qtype_w13: int, qtype_w2: int, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
    """How far ``gguf_moe(..., q8=True)`` may move from the exact routed-expert MLP beyond fp32 rounding: a float64
    (T, H) bound on the CPU.  Per (token t, slot s, expert e), with ``q8_activation_bound`` bounds eg / eu on the
    gate / up rows (zero where ``qtype_w13`` is not Q4_K, whose projection then keeps the fp32 decode):
    dh = 1.1 eg (|up| + eu) + |silu(gate)| eu (silu is 1.1-Lipschitz, so this holds beyond first order); then
    |w_s| (|W2| @ dh + the bound of rounding h' = h + dh to int8 blocks, whose scales are at most
    max(|h| + dh) / 127 per 32-block; that term only for a Q4_K ``w2``).

    ``w13_raw``: (E, 2I, row_bytes) uint8 numpy/torch; ``w2_raw``: (E, H, row_bytes), rows without padding (row_bytes
    = K / 256 * 144 for Q4_K); ids < 0 are skipped."""
    w13_raw, w2_raw = torch.as_tensor(w13_raw).cpu(), torch.as_tensor(w2_raw).cpu()
    x64 = x.detach().cpu().double()
    ids, wts = topk_ids.cpu(), topk_weights.cpu().double()
    inter = w13_raw.shape[1] // 2
    q13, q2 = Q(qtype_w13) == Q.Q4_K, Q(qtype_w2) == Q.Q4_K

    @functools.lru_cache(maxsize=None)
    def expert(e):  # dequantized weights and the parts that meet rounded activations, once per expert
        return (dequant(w13_raw[e], qtype_w13), dequant(w2_raw[e], qtype_w2),
                _q8_part(w13_raw[e], qtype_w13).abs() if q13 else None,
                _q8_part(w2_raw[e], qtype_w2).abs() if q2 else None)

    out = torch.zeros(x.shape[0], w2_raw.shape[1], dtype=torch.float64)
    for t, s, e in _routed_pairs(ids):
        W1, W2, S1, S2 = expert(e)
        gate_up = W1 @ x64[t]
        gate, up = gate_up[:inter], gate_up[inter:]
        e13 = S1 @ _half_step(x64[t]) if q13 else torch.zeros_like(gate_up)
        eg, eu = e13[:inter], e13[inter:]
        dh = 1.1 * eg * (up.abs() + eu) + torch.nn.functional.silu(gate).abs() * eu
        b = W2.abs() @ dh
        if q2:
            b = b + S2 @ _half_step((torch.nn.functional.silu(gate) * up).abs() + dh)
        out[t] += wts[t, s].abs() * b
    return out


def q8_moe_model(x: torch.Tensor, xq: torch.Tensor, xd: torch.Tensor, w13_raw, w2_raw, qtype_w13: int, qtype_w2: int,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, fp32_rel: float = 2.0 ** -18
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 value of what ``gguf_moe(..., q8=True)`` computes on the per-pair path, for a sharp check: its
    int8 arithmetic without the fp32 rounding.  Returns (y, tie), float64 (T, H) on the CPU.

    x: (T, H) activations; xq (T, H) int8 / xd (T, H/32) fp32: ``quantize_activations(x)``, the kernel's own
    rounding of x (tested on its own).  A Q4_K projection meets the rounded values with the scaled codes and the
    exact ones with the min term (``gguf_gemv_q8``): gate/up = S1 x_q + (W1 - S1) x; other types see x.  For a Q4_K
    ``w2``, h is rounded the same way (blocks of 32, d = max|h| / 127, floor(h / d + 0.5)); where the kernel's fp32
    h (within ``fp32_rel`` of the gate/up sums' scale; 2^-14 for a non-Q4_K ``w13``) could round to the other
    code, ``tie`` adds that code's step times |w_s| |S2|.  Raw stacks as in ``q8_moe_bound`` (rows without
    padding); ids < 0 are skipped."""
    w13_raw, w2_raw = torch.as_tensor(w13_raw).cpu(), torch.as_tensor(w2_raw).cpu()
    x64 = x.detach().cpu().double()
    xr = (xq.cpu().double().view(x.shape[0], -1, 32) * xd.cpu().double()[..., None]).view(x64.shape)
    ids, wts = topk_ids.cpu(), topk_weights.cpu().double()
    inter = w13_raw.shape[1] // 2
    q13, q2 = Q(qtype_w13) == Q.Q4_K, Q(qtype_w2) == Q.Q4_K
    silu = torch.nn.functional.silu

    @functools.lru_cache(maxsize=None)
    def expert(e):  # (W1, S1, W2, S2): weights and the parts that meet rounded activations (S = W where none)
        W1, W2 = dequant(w13_raw[e], qtype_w13), dequant(w2_raw[e], qtype_w2)
        return W1, _q8_part(w13_raw[e], qtype_w13) if q13 else W1, W2, _q8_part(w2_raw[e], qtype_w2) if q2 else W2

    y = torch.zeros(x.shape[0], w2_raw.shape[1], dtype=torch.float64)
    tie = torch.zeros_like(y)
    for t, s, e in _routed_pairs(ids):
        W1, S1, W2, S2 = expert(e)
        xs = xr[t] if q13 else x64[t]
        gu = S1 @ xs + (W1 - S1) @ x64[t]
        scale = S1.abs() @ xs.abs() + (W1 - S1).abs() @ x64[t].abs()
        g, u = gu[:inter], gu[inter:]
        h = silu(g) * u
        if not q2:
            y[t] += wts[t, s] * (W2 @ h)
            continue
        # fp32 error of the kernel's h; the fp32 decode of a non-Q4_K w13 also rounds each weight by up to 2^-15
        # of its sub-block scale (``gguf_gemv._weights``), hence the wider margin there
        rel = fp32_rel if q13 else max(fp32_rel, 2.0 ** -14)
        dh = rel * (1.1 * scale[:inter] * u.abs() + silu(g).abs() * scale[inter:] + h.abs())
        b = h.reshape(-1, 32)
        d = b.abs().amax(-1, keepdim=True) / 127
        r = b / torch.where(d > 0, d, 1) + 0.5
        hr = (torch.where(d > 0, torch.floor(r), 0) * d).reshape(h.shape)
        # the kernel's h_i and the block's max may each be off by dh, which moves h_i / d by at most
        # (dh_i + |h_i| / max|h| dh_max) / d: a code within (twice) that of a tie may flip
        dhb = dh.reshape(b.shape)
        slack = 2 * (dhb + b.abs() / torch.where(d > 0, 127 * d, 1) * dhb.amax(-1, keepdim=True)) + 2.0 ** -20 * d
        flip = torch.where((r - torch.round(r)).abs() * d <= slack, d, 0).reshape(h.shape)
        y[t] += wts[t, s] * (S2 @ hr + (W2 - S2) @ h)
        tie[t] += wts[t, s].abs() * (S2.abs() @ flip)
    return y, tie


def _half_step(v: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Per value of v (..., K) float64, half the int8 step of its ``block`` (max |v| / 127 / 2): the most rounding
    to ``quantize_activations``' blocks moves it."""
    d = v.abs().reshape(*v.shape[:-1], -1, block).amax(-1) / 127
    return (d / 2).repeat_interleave(block, dim=-1)


def _q8_part(raw: torch.Tensor, qtype: int, dequant_fn=None) -> torch.Tensor:
    """The part of each weight that multiplies int8-rounded activations, float64 (N, K): for Q4_K and Q5_K the scaled
    code (W minus the same blocks dequantized with every code zeroed: the min term meets exact activation sums), for
    Q8_0, Q6_K, Q4_0 and Q5_0 the whole weight (the - 32 / - 8 / - 16 code offsets meet the rounded activations:
    integer code sums in ``gguf_gemv_q8``, signed codes in ``gguf_split``)."""
    dequant_fn = dequant_fn or dequant
    S = dequant_fn(raw, qtype)
    if Q(qtype) in (Q.Q4_K, Q.Q5_K):  # codes (Q5_K: qh, then qs) follow the 4 + 12 header bytes of ``block_q4_K``
        codes0 = raw.clone().view(raw.shape[0], -1, gguf.GGML_QUANT_SIZES[Q(qtype)][1])
        codes0[:, :, 16:] = 0
        S = S - dequant_fn(codes0.view(raw.shape), qtype)
    return S


def q8_activation_bound(x: torch.Tensor, raw, qtype: int, dequant_fn=None, block: int = 32) -> torch.Tensor:
    """Worst-case effect of rounding x to int8 blocks of ``block`` values (32: ``gguf_gemv_q8``; 256: ``gguf_mma``)
    on x @ W.T: ``sum_i |s_ni| d_mi / 2`` as a float64 (M, N) tensor, d_mi = max |x| over the block of column i /
    127.  s is the part of each weight that multiplies the rounded activations: for Q4_K and Q5_K its scaled code
    (the min term is computed from exact activation sums), i.e. W minus the same blocks dequantized with every code
    zeroed; for Q8_0, Q6_K, Q4_0 and Q5_0 (split rows, ``gguf_split``) the whole weight.
    ``raw``: (N, row_bytes) uint8 numpy or torch; ``dequant_fn(raw, qtype)`` -> float64 (default: gguf-py, CPU)."""
    if Q(qtype) not in (Q.Q4_K, Q.Q5_K, Q.Q8_0, Q.Q6_K, Q.Q4_0, Q.Q5_0):
        raise ValueError(f"q8_activation_bound: no int8-activation kernel for {Q(qtype).name}")
    S = _q8_part(torch.as_tensor(raw), qtype, dequant_fn)
    return _half_step(x.detach().to(S.device).double(), block) @ S.abs().T

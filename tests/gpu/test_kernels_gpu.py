"""GGUF Triton kernels on the GPU: drawn shapes, types and batches against gguf-py's dequantizer + fp64 matmul
(the oracle), the GLM-5 shapes with the production launch configs, CUDA-graph replay, and agreement with
vllm-gguf-plugin's own Triton kernels when the plugin can be imported.

Error budget (far tighter than upstream's atol 1 / rtol 0.1): ``|y - ref| <= 2**-8 |ref| + eps * (|x| @ |W|.T)``,
i.e. one rounding of the output to bf16/fp16 plus accumulated rounding: eps = 2**-16 on the FMA path (fp32 sums
of exact products) and 2**-8 on the tensor-core path (weights rounded to bf16 before the MMA).

Run on a GPU host: ``python -m pytest tests/gpu/test_kernels_gpu.py -m gpu -q``.
"""
from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm5serve.kernels import GemvConfig, gguf_linear, gguf_moe, pick_config
from glm5serve.kernels.gguf_gemv_q8 import quantize_activations
from glm5serve.kernels.gguf_topk_moe import per_pair
from glm5serve.kernels.gguf_gemv import BLOCK_SIZES, _device_info, _mma_tile, _q8_applies
from glm5serve.kernels.gguf_split import gguf_linear_split, pick_split_config, split_rows, split_type
from glm5serve.kernels.testing import (
    dequant,
    q8_activation_bound,
    q8_moe_bound,
    q8_moe_model,
    random_qweight,
    random_qweight_torch,
    reference_linear,
    reference_moe,
)
from glm5serve.testing.gpu_timing import capture

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TYPES = (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
DTYPES = (torch.bfloat16, torch.float16)
# Row counts at and around the row tiles (4/8/16/32) and the GLM-5 sizes' remainders.
BOUNDARY_N = (1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 257)
DEV = "cuda"
OUT_ROUNDING = 2.0 ** -8  # one round-to-nearest to bf16 (fp16: 2**-11)


def _eps_sum(M: int, dtype: torch.dtype, cfg: GemvConfig | None) -> float:
    use_dot = cfg.use_dot if cfg is not None else M > 1
    return 2.0 ** -8 if use_dot else 2.0 ** -16


def _assert_close(y, ref, bound, eps_sum, what="", extra=0.0):
    assert torch.isfinite(y).all(), f"{what}: non-finite output"
    err = (y.double().cpu() - ref).abs()
    tol = OUT_ROUNDING * ref.abs() + eps_sum * bound + extra + 1e-30
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"{what}: max error {err.max().item():.3g} is {worst:.3g}x the budget"
    # upstream's criterion, for the record (implied by the budget above)
    torch.testing.assert_close(y.double().cpu(), ref, atol=1.0, rtol=0.1)


def _linear_case(qtype, M, N, K, dtype, seed):
    rng = np.random.default_rng(seed)
    raw = random_qweight(qtype, N, K, rng)
    x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32)).to(dtype)
    ref, bound = reference_linear(x.float(), dequant(raw, qtype))
    return x.to(DEV), torch.from_numpy(raw).to(DEV), ref, bound



def _moe_weights(q13, q2, E, H, inter, rng):
    """(w13, w2) raw GGUF expert stacks on the GPU: (E, 2 inter, row bytes of H) and (E, H, row bytes of inter)."""
    w13 = np.stack([random_qweight(q13, 2 * inter, H, rng) for _ in range(E)])
    w2 = np.stack([random_qweight(q2, H, inter, rng) for _ in range(E)])
    return torch.from_numpy(w13).to(DEV), torch.from_numpy(w2).to(DEV)


def _routing(T, E, k):
    """Random (topk_ids int32, topk_weights) of T tokens, k experts each, on the GPU."""
    return torch.randint(0, E, (T, k), device=DEV, dtype=torch.int32), torch.rand(T, k, device=DEV)

@st.composite
def linear_cases(draw):
    qtype = draw(st.sampled_from(TYPES))
    qk = BLOCK_SIZES[int(qtype)][0]
    blocks = draw(st.one_of(st.integers(1, 6), st.sampled_from((7, 8, 9, 24 * 256 // qk))))
    N = draw(st.one_of(st.sampled_from(BOUNDARY_N), st.integers(1, 700)))
    M = draw(st.one_of(st.sampled_from((1, 2, 3, 4, 5, 15, 16, 17, 32, 33, 64, 65, 256)), st.integers(1, 16),
                       st.integers(17, 256)))
    cfg = draw(st.one_of(st.none(), st.builds(
        GemvConfig, block_n=st.sampled_from((4, 8, 16, 32)), kbs=st.sampled_from((1, 2, 4)),
        split_k=st.integers(1, 5), num_warps=st.sampled_from((2, 4, 8)), use_dot=st.booleans(),
        block_m=st.sampled_from((8, 16, 32, 64)), q8=st.booleans(), mma=st.booleans(),
        stages=st.sampled_from((1, 2)))))
    if cfg is not None and cfg.use_dot:  # the bf16 MMA needs 16 along M, N and K per slice
        cfg = dataclasses.replace(cfg, block_n=max(cfg.block_n, 16), kbs=max(cfg.kbs, 2), block_m=max(cfg.block_m, 16))
    return qtype, M, N, blocks * qk, draw(st.sampled_from(DTYPES)), cfg, draw(st.integers(0, 2**31))


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(linear_cases())
def test_gemv_matches_gguf_py(case):
    qtype, M, N, K, dtype, cfg, seed = case
    x, w, ref, bound = _linear_case(qtype, M, N, K, dtype, seed)
    y = gguf_linear(x, w, qtype, N, cfg)
    assert y.shape == (M, N) and y.dtype == dtype
    what = f"{qtype.name} M={M} N={N} K={K} {dtype} {cfg}"
    block = _int8_block(qtype, M, N, K, dtype, cfg)
    if block:
        _assert_close(y, ref, bound, 2.0 ** -16, what + f" int8/{block}",
                      extra=q8_activation_bound(x, w, qtype, block=block))
    else:
        _assert_close(y, ref, bound, _eps_sum(M, dtype, cfg), what)


def _int8_block(qtype, M, N, K, dtype, cfg) -> int:
    """The activation block gguf_linear rounds x to int8 in for this call: 256 on the tensor-core int8 path
    (``gguf_mma``), 32 on the dp4a path (``gguf_gemv_q8``), 0 where x is not rounded."""
    if cfg is None:
        if M > 16:
            return 0
        cfg = pick_config(qtype, M, N, K, torch.cuda.get_device_properties(0).multi_processor_count, dtype,
                          _device_info(torch.device(DEV))[1])
    if dtype == torch.float32:
        return 0
    if cfg.mma and qtype in (Q.Q4_K, Q.Q5_K) and cfg.block_n >= 16:
        return 256
    return 32 if cfg.q8 and _q8_applies(qtype, K // BLOCK_SIZES[int(qtype)][0]) else 0


GLM5_SHAPES = {  # (N, K) per GEMV, whole experts (expert parallelism) and TP=8 slices
    "expert_gate_up": (2048, 6144), "expert_down": (6144, 2048), "lm_head/8": (19360, 6144),
    "q_a": (2048, 6144), "q_b/8": (2048, 2048), "o_proj/8": (6144, 2048),
    "expert_gate_up/8": (512, 6144), "expert_down/8": (6144, 256),
}


@pytest.mark.parametrize("M", (1, 2, 3, 4, 8, 16))  # 2: tuned entries of batch 2 (Q6_K lm_head/8)
@pytest.mark.parametrize("shape", list(GLM5_SHAPES), ids=str)
@pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0), ids=lambda q: q.name)
def test_gemv_glm5_shapes_production_config(qtype, shape, M):
    """The launch parameters pick_config chooses on this GPU, on every GLM-5 shape of the benchmark (weights made
    and dequantized on the GPU with glm5serve.dequant, which is bit-exact with gguf-py, to keep this fast)."""
    from glm5serve.dequant import dequantize

    N, K = GLM5_SHAPES[shape]
    gen = torch.Generator(DEV).manual_seed(M * 1000 + N)
    w = random_qweight_torch(qtype, (N, K), DEV, gen)
    x = torch.randn(M, K, device=DEV, generator=gen).to(torch.bfloat16)
    W = dequantize(w, qtype, dtype=torch.float32).double()
    ref, bound = (x.double() @ W.T).cpu(), (x.double().abs() @ W.abs().T).cpu()
    y = gguf_linear(x, w, qtype, N)
    block = _int8_block(qtype, M, N, K, x.dtype, None)
    if block:  # activations rounded to int8 blocks: their bound + fp32 sums
        q8 = q8_activation_bound(x, w, qtype, lambda r, q: dequantize(r, q, dtype=torch.float32).double(),
                                 block=block).cpu()
        _assert_close(y, ref, bound, 2.0 ** -16, f"{qtype.name} {shape} M={M} int8/{block}", extra=q8)
    else:
        _assert_close(y, ref, bound, _eps_sum(M, torch.bfloat16, None), f"{qtype.name} {shape} M={M}")


SPLIT_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q6_K)


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(qtype=st.sampled_from(SPLIT_TYPES), blocks=st.one_of(st.sampled_from((2, 4, 6, 8, 64, 192)),
                                                              st.integers(1, 40).map(lambda b: 2 * b)),
       N=st.one_of(st.sampled_from(BOUNDARY_N), st.integers(1, 700)),
       M=st.one_of(st.sampled_from((1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 64, 300)), st.integers(1, 16)),
       dtype=st.sampled_from(DTYPES), tile=st.one_of(st.none(), st.tuples(
           st.sampled_from((4, 8, 16, 32, 64)), st.sampled_from((1, 2, 4, 8, 16, 32, 64, 128)), st.integers(1, 5),
           st.sampled_from((2, 4, 8)), st.booleans())), seed=st.integers(0, 2**31))
def test_split_rows_gemv_matches_gguf_py(qtype, blocks, N, M, dtype, tile, seed):
    """gguf_linear on split rows (``gguf_split``: Q8_0/Q4_0/Q5_0/Q6_K regrouped at load) against gguf-py's dequantizer
    of the GGUF rows + fp64 matmul: within the int8 activation bound + fp32 sums up to 16 rows (drawn tiles, split-K,
    loads one step ahead, block boundaries, odd batches), and the tensor-core budget past them (dequantize + cuBLAS;
    any M: the plugin cannot read split rows).  Q6_K rows take 512 elements per 16 drawn blocks (at least 512)."""
    K = 32 * blocks if qtype != Q.Q6_K else 512 * max(1, blocks // 16)
    x, w, ref, bound = _linear_case(qtype, M, N, K, dtype, seed)
    cfg = None
    if tile is not None and M <= 16:
        bn, kbs, split, warps, ahead = tile
        cfg = GemvConfig(block_n=bn, kbs=kbs, split_k=split, num_warps=warps,
                         block_m=min(16, 1 << (M - 1).bit_length()), q8=True, ahead=ahead)
    y = gguf_linear(x, split_rows(w, qtype, K), split_type(qtype), N, cfg)
    assert y.shape == (M, N) and y.dtype == dtype
    what = f"{qtype.name}/split M={M} N={N} K={K} {dtype} {cfg}"
    if M <= 16:
        _assert_close(y, ref, bound, 2.0 ** -16, what, extra=q8_activation_bound(x, w, qtype))
    else:
        _assert_close(y, ref, bound, 2.0 ** -8, what)


@pytest.mark.parametrize("M", (1, 2, 3, 4, 8, 16))
@pytest.mark.parametrize("shape", list(GLM5_SHAPES), ids=str)
@pytest.mark.parametrize("qtype", SPLIT_TYPES, ids=lambda q: q.name)
def test_split_rows_glm5_shapes_production_config(qtype, shape, M):
    """Q8_0/Q4_0/Q5_0/Q6_K split rows (as ``gguf_split.as_served`` serves them) with
    pick_split_config's launch, on every GLM-5 shape of the benchmark whose rows have a split layout, within the
    int8 activation bound."""
    from glm5serve.dequant import dequantize
    from glm5serve.kernels.gguf_split import can_split

    N, K = GLM5_SHAPES[shape]
    if not can_split(qtype, K):
        pytest.skip(f"{qtype.name} rows of K={K} stay GGUF (one block): the GGUF-row tests cover them")
    gen = torch.Generator(DEV).manual_seed(M * 1000 + N + int(qtype))
    w = random_qweight_torch(qtype, (N, K), DEV, gen)
    x = torch.randn(M, K, device=DEV, generator=gen).to(torch.bfloat16)
    W = dequantize(w, qtype, dtype=torch.float32).double()
    ref, bound = (x.double() @ W.T).cpu(), (x.double().abs() @ W.abs().T).cpu()
    served, stype = split_rows(w, qtype, K), split_type(qtype)
    # Q6_K on the tensor cores (9..16 rows) rounds x in blocks of 256
    blk = 256 if qtype == Q.Q6_K and pick_split_config(stype, M, N, K).mma else 32
    q8 = q8_activation_bound(x, w, qtype, lambda r, q: dequantize(r, q, dtype=torch.float32).double(),
                             block=blk).cpu()
    _assert_close(gguf_linear(x, served, stype, N), ref, bound, 2.0 ** -16, f"{qtype.name}/split {shape} M={M}",
                  extra=q8)


@pytest.mark.parametrize("M", (1, 3, 8, 16))
@pytest.mark.parametrize("qtype", SPLIT_TYPES, ids=lambda q: q.name)
def test_split_rows_dp4a_equals_its_emulation_and_graphs_replay(qtype, M):
    """The split-row GEMV's dp4a (PTX) and its shift-and-multiply emulation (the interpreter tests') give
    bit-identical outputs on the GPU (production tile, split-K, a partial row tile), as do loads one step ahead, and
    a CUDA-graph replay equals the eager call on fresh inputs.  At 16 rows production is the tensor-core GEMM
    (Q8_0/Q4_0/Q6_K, ``gguf_mma.gguf_linear_split_mma``): its packed code unpacking against its per-byte emulation,
    also on a second tile with pipelining and split-K."""
    N, K = 301, 64 * 32
    x, w, _, _ = _linear_case(qtype, M, N, K, torch.bfloat16, seed=120 + M)
    s, stype = split_rows(w, qtype, K), split_type(qtype)
    tiles = [GemvConfig(block_n=32, kbs=4, split_k=3, block_m=M if M in (1, 8, 16) else 4, q8=True)]
    if pick_split_config(stype, M, N, K).mma:
        tiles.append(GemvConfig(block_n=32, kbs=2, split_k=5, num_warps=2, q8=True, mma=True, stages=2))
    for cfg in (pick_split_config(stype, M, N, K), *tiles):
        y = gguf_linear_split(x, s, stype, N, cfg)
        assert torch.equal(y, gguf_linear_split(x, s, stype, N, cfg, dp4a=False))
        assert torch.equal(y, gguf_linear_split(x, s, stype, N, dataclasses.replace(cfg, ahead=not cfg.ahead)))
    static_x = x.clone()
    g, out = capture(lambda: gguf_linear(static_x, s, stype, N))
    fresh = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16).to(DEV)
    static_x.copy_(fresh)
    g.replay()
    assert torch.equal(out, gguf_linear(fresh, s, stype, N))


@pytest.mark.parametrize("M", (3, 8, 9, 16))
@pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q5_K), ids=lambda q: q.name)
def test_mma_nibbles_equal_their_emulation_and_graphs_replay(qtype, M):
    """The tensor-core int8 GEMM's packed nibble/qh unpacking (PTX, four codes per instruction) and its per-byte
    emulation (the interpreter tests') give bit-identical outputs on the GPU, with and without software pipelining,
    split-K and two super-blocks per step (production tile and drawn ones; K = 12 super-blocks, so some launches
    take programs of MMA_PDL_MAX_BLOCKS or more, launched without PDL), and a CUDA-graph replay equals the eager
    call on fresh inputs."""
    from glm5serve.kernels.gguf_mma import gguf_linear_mma

    N, K = 301, 12 * 256
    x, w, _, _ = _linear_case(qtype, M, N, K, torch.bfloat16, seed=140 + M)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for block_n, num_warps, split_k, stages, kbs in (_mma_tile(M, N, K // 256, sms), (32, 2, 5, 2, 1), (64, 4, 1, 1, 2),
                                                     (32, 2, 2, 2, 2)):
        kw = dict(block_n=block_n, split_k=split_k, num_warps=num_warps, num_stages=stages, kbs=kbs)
        y = gguf_linear_mma(x, w, qtype, N, **kw)
        assert torch.equal(y, gguf_linear_mma(x, w, qtype, N, asm=False, **kw)), kw
        assert torch.equal(y, gguf_linear_mma(x, w, qtype, N, **{**kw, "num_stages": 3 - stages})), kw
        if -(-12 // split_k) % 2 == 0:  # the same splits with either kbs (a split takes a multiple of kbs blocks);
            # fp32 outputs, so that no bf16 rounding hides another summation order
            assert torch.equal(gguf_linear_mma(x.float(), w, qtype, N, **kw),
                               gguf_linear_mma(x.float(), w, qtype, N, **{**kw, "kbs": 3 - kbs})), kw
    cfg = GemvConfig(block_n=32, split_k=5, num_warps=2, mma=True, block_m=8 if M <= 8 else 16, stages=2)
    static_x = x.clone()
    g, out = capture(lambda: gguf_linear(static_x, w, qtype, N, cfg))
    fresh = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16).to(DEV)
    static_x.copy_(fresh)
    g.replay()
    assert torch.equal(out, gguf_linear(fresh, w, qtype, N, cfg))


@st.composite
def moe_cases(draw):
    q13, q2 = draw(st.sampled_from(TYPES)), draw(st.sampled_from(TYPES))
    H = BLOCK_SIZES[int(q13)][0] * draw(st.integers(1, 3))
    inter = BLOCK_SIZES[int(q2)][0] * draw(st.integers(1, 3))
    E = draw(st.integers(1, 9))
    T = draw(st.one_of(st.sampled_from((1, 4, 16, 17, 64, 129, 160)), st.integers(1, 16), st.integers(17, 80)))
    k = draw(st.integers(1, min(E, 8)))
    return q13, q2, H, inter, E, T, k, draw(st.sampled_from(DTYPES)), draw(st.integers(0, 2**31))


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(moe_cases())
def test_moe_matches_reference(case):
    q13, q2, H, inter, E, T, k, dtype, seed = case
    rng = np.random.default_rng(seed)
    w13 = np.stack([random_qweight(q13, 2 * inter, H, rng) for _ in range(E)])
    w2 = np.stack([random_qweight(q2, H, inter, rng) for _ in range(E)])
    x = torch.from_numpy(rng.standard_normal((T, H)).astype(np.float32)).to(dtype)
    ids = torch.from_numpy(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    ids[torch.from_numpy(rng.random((T, k)) < 0.1)] = -1  # experts on other ranks
    wts = torch.from_numpy(rng.uniform(0.05, 1, (T, k)).astype(np.float32))
    y = gguf_moe(x.to(DEV), torch.from_numpy(w13).to(DEV), torch.from_numpy(w2).to(DEV), wts.to(DEV),
                 ids.to(DEV), q13, q2)
    ref, bound = reference_moe(x.float(), dequant(w13, q13), dequant(w2, q2), wts, ids)
    assert y.shape == (T, H) and y.dtype == dtype
    # per-pair path (T <= 16, <= 128 with Q4_K experts): fp32 weights and h, int8 activations for Q4_K projections
    # (bf16/fp16 x on a GPU); grouped path: weights and h rounded to x's dtype for the MMA
    what = f"{q13.name}/{q2.name} E={E} T={T} k={k}"
    pairs = per_pair(q13, q2, T, q8=True)
    eps = 2.0 ** -14 if pairs else 2.0 ** -6
    if not (pairs and Q.Q4_K in (q13, q2)):
        _assert_close(y, ref, bound, eps, what)
        return
    # the int8 path: within its (loose) rounding bound of the exact MLP, and sharp against the float64 value of its
    # own int8 arithmetic (from the kernel's own rounding of x, tested in test_q8_activation_blocks)
    _assert_close(y, ref, bound, eps, what, extra=q8_moe_bound(x.float(), w13, w2, q13, q2, wts, ids))
    xq, xd, _ = quantize_activations(x.to(DEV))
    model, tie = q8_moe_model(x.float(), xq, xd, w13, w2, q13, q2, wts, ids)
    _assert_close(y, model, bound, 2.0 ** -16, what + " (int8 model)", extra=tie)


@pytest.mark.parametrize("cfg", (GemvConfig(split_k=1), GemvConfig(split_k=4), None,
                                 GemvConfig(kbs=4, split_k=3, q8=True)), ids=("plain", "split", "auto", "q8"))
def test_gemv_cuda_graph_replay(cfg):
    """Replays compute on the inputs present at replay time, bit-identical to eager calls (split-K reduces in a
    fixed order, so it is deterministic too)."""
    qtype, M, N, K = Q.Q4_K, 4, 2048, 6144
    x, w, _, _ = _linear_case(qtype, M, N, K, torch.bfloat16, seed=7)
    static_x = x.clone()
    g, out = capture(lambda: gguf_linear(static_x, w, qtype, N, cfg))
    for seed in (1, 2):
        fresh = torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).to(DEV)
        static_x.copy_(fresh)
        g.replay()
        assert torch.equal(out, gguf_linear(fresh, w, qtype, N, cfg))


def test_split_k_on_concurrent_streams():
    """Split-K GEMVs overlapping on two streams (as with vLLM's shared-expert stream) do not share counters."""
    qtype, N, K = Q.Q6_K, 512, 6144
    cfg = GemvConfig(block_n=8, kbs=1, split_k=8)
    cases = [_linear_case(qtype, 1, N, K, torch.bfloat16, seed=s) for s in range(4)]
    expected = [gguf_linear(x, w, qtype, N, cfg) for x, w, _, _ in cases]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    outs = []
    for rep in range(50):
        for i, (x, w, _, _) in enumerate(cases):
            with torch.cuda.stream(streams[i % 2]):
                outs.append((i, gguf_linear(x, w, qtype, N, cfg)))
    torch.cuda.synchronize()
    for i, y in outs:
        assert torch.equal(y, expected[i])


@pytest.mark.parametrize("q2", (Q.Q6_K, Q.Q4_K), ids=lambda q: q.name)
@pytest.mark.parametrize("T", (4, 40, 160), ids=("per-pair", "per-pair-past-16", "grouped"))
def test_moe_cuda_graph_replay(T, q2):
    """Per-pair (up to 128 tokens here): Q4_K gate+up with int8 activations, down fp32 (Q6_K) or int8 (Q4_K)."""
    rng = np.random.default_rng(3)
    E, H, inter, k = 16, 512, 256, 4
    w13, w2 = _moe_weights(Q.Q4_K, q2, E, H, inter, rng)
    x = torch.randn(T, H, device=DEV).bfloat16()
    ids, wts = _routing(T, E, k)
    g, out = capture(lambda: gguf_moe(x, w13, w2, wts, ids, Q.Q4_K, q2))
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        ids.copy_(torch.randint(0, E, (T, k), device=DEV, dtype=torch.int32))
        wts.copy_(torch.rand_like(wts))
        g.replay()
        assert torch.equal(out, gguf_moe(x, w13, w2, wts, ids, Q.Q4_K, q2))


@pytest.mark.parametrize("M", (1, 4))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_l2_prefetch_changes_no_bit(qtype, M):
    """GemvConfig.prefetch only moves bytes into L2 early: outputs are bit-identical to prefetch 0, on both paths,
    with split-K, and for prefetch distances past the end of the row."""
    N, K = 300, 6 * BLOCK_SIZES[int(qtype)][0]
    x, w, _, _ = _linear_case(qtype, M, N, K, torch.bfloat16, seed=60 + int(qtype) + M)
    for split in (1, 3):
        base = GemvConfig(block_n=16, kbs=1, split_k=split, use_dot=M > 1)
        want = gguf_linear(x, w, qtype, N, base)
        for prefetch in (1, 2, 8):
            assert torch.equal(gguf_linear(x, w, qtype, N, dataclasses.replace(base, prefetch=prefetch)), want)


#: (type, batch, split rows) covering every kernel launched with PDL: split rows (Q4_0, Q6_K), the int8-activation
#: GEMV (Q4_K/Q5_K/Q6_K at these sizes), the FMA decode (Q6_K at one row, Q4_K below Q8_MIN_BYTES_M1) and the tensor
#: cores (Q4_K at 16 rows)
PDL_CHAINS = [(Q.Q4_0, 1, True), (Q.Q6_K, 4, True), (Q.Q4_K, 1, False), (Q.Q4_K, 3, False), (Q.Q5_K, 8, False),
              (Q.Q6_K, 1, False), (Q.Q6_K, 4, False), (Q.Q4_K, 16, False)]


@pytest.mark.parametrize("qtype,M,split", PDL_CHAINS, ids=[f"{q.name}-M{m}{'-split' if s else ''}"
                                                          for q, m, s in PDL_CHAINS])
def test_pdl_chains_change_no_bit(monkeypatch, qtype, M, split):
    """Programmatic dependent launch only moves a GEMV's launch and first weight fetches ahead: a chain of GEMVs in
    which each input was written by the kernel just before (the int8 quantizer, torch's normalisation of the last
    output) gives bit-identical outputs with ``$GLM5SERVE_PDL`` off, wait and prefetch, eager and replayed from a
    CUDA graph on fresh inputs.  A GEMV that read x (or reused memory) before its wait would see stale values."""
    gg = importlib.import_module("glm5serve.kernels.gguf_gemv")
    if not gg._pdl_capable(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs sm_90+ and a Triton with launch_pdl")
    N = K = 2048
    gen = torch.Generator(DEV).manual_seed(int(qtype) * 31 + M)
    ws = [random_qweight_torch(qtype, (N, K), DEV, gen) for _ in range(4)]
    t = int(qtype)
    if split:
        ws, t = [split_rows(w, qtype, K) for w in ws], split_type(qtype)

    def chain(h):
        for w in ws:
            y = gguf_linear(h, w, t, N).float()
            h = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
        return h

    x = torch.randn(M, K, device=DEV, generator=gen).to(torch.bfloat16)
    fresh = torch.randn(M, K, device=DEV, generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(gg, "PDL_MODE", "off")
    want, want_fresh = chain(x), chain(fresh)
    for mode, value in (("wait", 1), ("prefetch", 1 + gg.PDL_MAX_STEPS)):
        monkeypatch.setattr(gg, "PDL_MODE", mode)
        assert gg.pdl_value(x.device, 100) == value  # PDL is really on: sm_90 and a Triton with launch_pdl
        assert torch.equal(chain(x), want), mode
        static_x = x.clone()
        g, out = capture(lambda: chain(static_x))
        static_x.copy_(fresh)
        g.replay()
        assert torch.equal(out, want_fresh), mode


@pytest.mark.parametrize("M", (1, 3, 8))
@pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q5_K, Q.Q6_K), ids=lambda q: q.name)
def test_q8_dp4a_equals_its_emulation(qtype, M):
    """The int8-activation GEMV's dp4a and PRMT (PTX) and their shift-and-multiply emulation (the interpreter's)
    give the same integers, hence bit-identical outputs, on the GPU; with split-K, a partial row tile, and one or
    several activation rows per program."""
    from glm5serve.kernels.gguf_gemv_q8 import gguf_linear_q8

    x, w, _, _ = _linear_case(qtype, M, 301, 8 * 256, torch.bfloat16, seed=90 + M)
    for kw in (dict(), dict(block_n=32, kbs=4, split_k=2), dict(block_m=1, split_k=3), dict(block_m=2),
               dict(block_n=64, kbs=2, split_k=2)):
        assert torch.equal(gguf_linear_q8(x, w, qtype, 301, **kw), gguf_linear_q8(x, w, qtype, 301, dp4a=False, **kw))


@pytest.mark.parametrize("M", (1, 4, 8))
@pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q5_K), ids=lambda q: q.name)
def test_q8_loads_ahead_change_no_bit(qtype, M):
    """``ahead`` (K-step loads issued one step ahead into registers) compiled for the GPU: bit-identical to the plain
    loop, with split-K ranges of 2 to 4 steps, a last step past the row and a partial row tile."""
    from glm5serve.kernels.gguf_gemv_q8 import gguf_linear_q8

    x, w, _, _ = _linear_case(qtype, M, 301, 7 * 256, torch.bfloat16, seed=95 + M)
    for kw in (dict(block_n=16, kbs=4), dict(block_n=8, kbs=2, split_k=3), dict(block_n=16, kbs=1, split_k=2),
               dict(block_n=4, kbs=8), dict(block_n=4, kbs=4, num_warps=2)):  # the last two: batch 1's tiles
        assert torch.equal(gguf_linear_q8(x, w, qtype, 301, ahead=True, **kw), gguf_linear_q8(x, w, qtype, 301, **kw))


@pytest.mark.parametrize("T", (3, 40))
def test_moe_q8_dp4a_equals_its_emulation(T):
    """The int8 per-pair MoE's dp4a (PTX) and its shift-and-multiply emulation (what the interpreter tests check
    against the float64 model) give bit-identical outputs on the GPU; Q4_K gate+up and down (and a Q6_K down: gate+up
    only); 40 tokens is past 16 (per-pair up to MOE_Q8_MAX_M)."""
    rng = np.random.default_rng(8)
    E, H, inter, k = 8, 768, 512, 4
    for q2 in (Q.Q4_K, Q.Q6_K):
        w13, w2 = _moe_weights(Q.Q4_K, q2, E, H, inter, rng)
        x = torch.randn(T, H, device=DEV).bfloat16()
        ids, wts = _routing(T, E, k)
        ids[0, 0] = -1  # an expert on another rank
        y = gguf_moe(x, w13, w2, wts, ids, Q.Q4_K, q2, grouped=False)
        assert torch.equal(y, gguf_moe(x, w13, w2, wts, ids, Q.Q4_K, q2, grouped=False, dp4a=False)), q2.name


def test_moe_prefetch_changes_no_bit(monkeypatch):
    gm = importlib.import_module("glm5serve.kernels.gguf_topk_moe")
    rng = np.random.default_rng(5)
    E, H, inter, k = 8, 512, 256, 4
    w13, w2 = _moe_weights(Q.Q5_K, Q.Q8_0, E, H, inter, rng)
    for T in (3, 40):
        x = torch.randn(T, H, device=DEV).bfloat16()
        ids, wts = _routing(T, E, k)
        outs = []
        for prefetch in (0, 2):
            monkeypatch.setattr(gm, "MOE_PREFETCH", prefetch)
            monkeypatch.setattr(gm, "GROUPED_PREFETCH", prefetch)
            outs.append(gguf_moe(x, w13, w2, wts, ids, Q.Q5_K, Q.Q8_0))
        assert torch.equal(outs[0], outs[1]), T


def _plugin_linear():
    try:
        from vllm_gguf_plugin.triton.gemm.interface import ggml_mul_mat_a8_triton
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        pytest.skip(f"vllm_gguf_plugin Triton kernels not importable: {e}")
    return ggml_mul_mat_a8_triton


@pytest.mark.parametrize("M", (1, 4, 16))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_gemv_agrees_with_plugin_triton_kernel(qtype, M):
    """Same product as vllm-gguf-plugin's Triton kernel (which dequantizes to the activation dtype) within both
    kernels' rounding budgets, and each within budget of the oracle."""
    plugin = _plugin_linear()
    N, K = 300, 6 * BLOCK_SIZES[int(qtype)][0]
    x, w, ref, bound = _linear_case(qtype, M, N, K, torch.bfloat16, seed=int(qtype) + M)
    ours = gguf_linear(x, w, qtype, N)
    theirs = plugin(w, x, int(qtype), N)
    _assert_close(theirs, ref, bound, 2.0 ** -7, f"plugin {qtype.name} M={M}")
    err = (ours.double() - theirs.double()).abs().cpu()
    assert (err <= 2.0 ** -7 * ref.abs() + 2.0 ** -7 * bound + 1e-30).all(), f"max diff {err.max().item():.3g}"


def test_pick_config_fills_the_gpu():
    """Every production config launches at least 2 programs per SM on the GLM-5 shapes at batch 1."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for qtype in TYPES:
        for N, K in GLM5_SHAPES.values():
            if K % BLOCK_SIZES[int(qtype)][0]:
                continue
            cfg = pick_config(qtype, 1, N, K, sms)
            programs = -(-N // cfg.block_n) * cfg.split_k
            assert programs >= 2 * sms or cfg.split_k * cfg.kbs * BLOCK_SIZES[int(qtype)][0] >= K, (qtype, N, K, cfg)


def test_vllm_ops_route_decode_batches_to_glm5serve():
    """After vllm_ops.install(), the plugin's linear/MoE op lookups run glm5serve's kernels for <= 256 rows and the
    plugin's own kernels for larger batches (prefill)."""
    pytest.importorskip("vllm_gguf_plugin", reason="vllm-gguf-plugin not importable")
    from vllm_gguf_plugin import quantization

    from glm5serve.kernels import vllm_ops

    plugin_mul_mat = quantization.fused_mul_mat_gguf
    assert vllm_ops.install()
    qtype, N, K = Q.Q4_K, 512, 1024
    for M in (1, 16, 40, 300):
        x, w, ref, bound = _linear_case(qtype, M, N, K, torch.bfloat16, seed=M)
        y = quantization.fused_mul_mat_gguf(x, w, int(qtype))
        if M <= 256:
            assert torch.equal(y, gguf_linear(x, w, qtype, N))
        elif not getattr(plugin_mul_mat, vllm_ops._MARK, False):
            assert torch.equal(y, plugin_mul_mat(x, w, int(qtype)))
        _assert_close(y, ref, bound, 2.0 ** -7, f"vllm op M={M}")
    rng = np.random.default_rng(5)
    E, H, inter, k = 8, 512, 256, 2
    w13, w2 = _moe_weights(Q.Q4_K, Q.Q4_K, E, H, inter, rng)
    for T in (4, 40):
        x = torch.randn(T, H, device=DEV).bfloat16()
        ids, wts = _routing(T, E, k)
        y = quantization.fused_moe_gguf(x, w13, w2, wts, ids, int(Q.Q4_K), int(Q.Q4_K), "silu")
        assert torch.equal(y, gguf_moe(x, w13, w2, wts, ids, Q.Q4_K, Q.Q4_K))
    # split rows (regrouped at load by vllm_ops.split_linear_weights): glm5serve at every batch size, 3-D x too
    for M in (1, 300):
        x, w, ref, bound = _linear_case(Q.Q5_0, M, N, K, torch.bfloat16, seed=M)
        s = split_rows(w, Q.Q5_0, K)
        y = quantization.fused_mul_mat_gguf(x, s, split_type(Q.Q5_0))
        assert torch.equal(y, gguf_linear(x, s, split_type(Q.Q5_0), N))
        y3 = quantization.fused_mul_mat_gguf(x[None], s, split_type(Q.Q5_0))
        assert y3.shape == (1, M, N) and torch.equal(y3[0], y)


#: GLM-5's whole routed experts at TP=1 through the plugin's MoE op as glm5serve's plugin fixes leave it; experts
#: 160 and up start past 2**31 bytes of w13 (14.2 MB each)
_MOE_OVER_2GIB = r"""
import torch
from gguf import GGMLQuantizationType as Q
from glm5serve.vllm_plugin import fixes
from glm5serve.kernels.testing import random_qweight_torch, dequant, reference_moe
from vllm_gguf_plugin import quantization
fixes.apply()
E, H, I, T, used = 256, 6144, 2048, 24, torch.tensor([1, 160, 200, 255])
g = torch.Generator("cuda").manual_seed(0)
w13 = random_qweight_torch(Q.Q4_K, (E, 2 * I, H), "cuda", g)
w2 = random_qweight_torch(Q.Q4_K, (E, H, I), "cuda", g)
x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
slots = torch.stack([torch.randperm(4, generator=torch.Generator().manual_seed(t)) for t in range(T)])
wts = torch.softmax(torch.randn(T, 4, generator=torch.Generator().manual_seed(1)), -1)
y = quantization.fused_moe_gguf(x, w13, w2, wts.cuda(), used[slots].to(torch.int32).cuda(), int(Q.Q4_K),
                                int(Q.Q4_K), "silu")
ref, _ = reference_moe(x.float(), dequant(w13[used.cuda()], Q.Q4_K), dequant(w2[used.cuda()], Q.Q4_K), wts, slots)
rel = ((y.double().cpu() - ref).norm() / ref.norm()).item()
print("relative error", rel)
assert torch.isfinite(y).all() and rel < 2e-2, rel
from glm5serve.kernels import gguf_moe
y2 = gguf_moe(x, w13, w2, wts.cuda(), used[slots].to(torch.int32).cuda(), Q.Q4_K, Q.Q4_K)  # 24 tokens: grouped
rel2 = ((y2.double().cpu() - ref).norm() / ref.norm()).item()
print("glm5serve grouped relative error", rel2)
assert torch.isfinite(y2).all() and rel2 < 2e-2, rel2
"""


def test_plugin_moe_over_2gib_of_experts():
    """vllm-gguf-plugin's fused MoE (prefill batches, > 16 tokens, run the plugin's kernels) on GLM-5's whole
    3.6 GB ``w13`` with experts past 2**31 bytes: equal to the float64 reference (relative error < 2e-2). Without
    ``fixes._expert_groups`` the plugin's int32 expert offsets fault with an illegal memory access, which
    poisons the CUDA context: hence a subprocess."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _MOE_OVER_2GIB], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "relative error" in r.stdout

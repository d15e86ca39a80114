"""Launch configs of the GGUF kernels (``pick_config``): the measured tables shipped in ``kernels/tuned/`` are
well-formed and win over the heuristic for their shapes, L2 prefetch (inline PTX) is never chosen for the
Triton interpreter, and the weight views handed to the kernels are aligned for their vector loads."""
from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import example, given
from hypothesis import strategies as st

from glm5serve.kernels import GemvConfig, gguf_gemv, gguf_linear, pick_config
from glm5serve.kernels.gguf_gemv import (
    BLOCK_SIZES,
    PREFETCH_MIN_BYTES,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_0,
    Q8_MAX_M,
    Q8_MIN_BYTES_M1,
    SUPPORTED_QTYPES,
    TUNED_DIR,
    _as_words,
    _WORD_TYPES,
    tuned_configs,
)

TABLES = sorted(TUNED_DIR.glob("*.json"))


def test_a_tuned_table_ships_with_the_package():
    assert TABLES, f"no tuned tables in {TUNED_DIR}"


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.stem)
def test_tuned_table_is_well_formed(path):
    raw = json.loads(path.read_text())
    table = tuned_configs(path.stem)
    assert len(table) == len(raw["configs"]) > 0
    for (qtype, M, N, K), cfg in table.items():
        qk = BLOCK_SIZES.get(qtype, (0, 0))[0]
        assert qtype in SUPPORTED_QTYPES and M >= 1 and N >= 1 and qk and K % qk == 0, (qtype, M, N, K)
        assert isinstance(cfg, GemvConfig)
        for v in (cfg.block_n, cfg.kbs, cfg.num_warps, cfg.block_m):
            assert v >= 1 and v & (v - 1) == 0, cfg  # Triton block sizes are powers of two
        assert 1 <= cfg.split_k <= K // qk and 0 <= cfg.prefetch <= 8, cfg
        key = f"{qtype},{M},{N},{K}"
        # a table entry is there because it measured faster than the heuristic in the same run
        assert raw["timings_us"][key] < raw["heuristic_us"][key], key


@pytest.mark.parametrize("path", TABLES, ids=lambda p: p.stem)
def test_pick_config_uses_the_table_on_its_device_only(path):
    for (qtype, M, N, K), cfg in tuned_configs(path.stem).items():
        assert pick_config(qtype, M, N, K, 132, torch.bfloat16, path.stem) == cfg
        assert pick_config(qtype, M, N, K, 132, torch.bfloat16, "another_GPU") != cfg


@given(qtype=st.sampled_from(sorted(SUPPORTED_QTYPES)), M=st.integers(1, 256), N=st.integers(1, 40000),
       blocks=st.integers(1, 64))
def test_prefetch_only_on_large_weights_and_never_in_the_interpreter(qtype, M, N, blocks):
    qk, qb = BLOCK_SIZES[qtype]
    K = blocks * qk
    assert pick_config(qtype, M, N, K, 1, torch.bfloat16, "cpu").prefetch == 0
    gpu = pick_config(qtype, M, N, K, 132, torch.bfloat16, "")
    if gpu.q8 or gpu.mma:
        return  # the int8-activation paths have their own rules (below)
    assert (gpu.prefetch > 0) == (N * blocks * qb >= PREFETCH_MIN_BYTES)
    # prefetch is the only difference the device name makes (no table for either name)
    assert dataclasses.replace(gpu, prefetch=0) == pick_config(qtype, M, N, K, 132, torch.bfloat16, "cpu")


@given(qtype=st.sampled_from(sorted(SUPPORTED_QTYPES)), M=st.integers(1, 256), N=st.integers(1, 40000),
       blocks=st.integers(1, 64), dtype=st.sampled_from((torch.bfloat16, torch.float16, torch.float32)))
@example(qtype=Q4_K, M=3, N=2048, blocks=24, dtype=torch.bfloat16).via("GLM-5 expert gate/up, decode batch of 3")
@example(qtype=Q6_K, M=2, N=2048, blocks=3, dtype=torch.bfloat16).via("Q6_K rows of an odd number of blocks")
@example(qtype=Q5_K, M=2, N=2048, blocks=24, dtype=torch.bfloat16).via("Q5_K at a decode batch of 2")
@example(qtype=Q5_K, M=1, N=6144, blocks=8, dtype=torch.bfloat16).via("Q5_K expert down at batch 1 (8.7 MB)")
@example(qtype=Q5_K, M=1, N=2048, blocks=8, dtype=torch.bfloat16).via("Q5_K q_b/8 at batch 1 (2.9 MB)")
@example(qtype=Q4_K, M=4, N=6144, blocks=8, dtype=torch.bfloat16).via("Q4_K expert down at batch 4: loads ahead")
@example(qtype=Q4_K, M=1, N=6144, blocks=8, dtype=torch.bfloat16).via("Q4_K expert down at batch 1: kbs 4, 2 warps")
@example(qtype=Q5_K, M=1, N=19360, blocks=24, dtype=torch.bfloat16).via("Q5_K lm_head/8 at batch 1: no loads ahead")
@example(qtype=Q4_K, M=1, N=8444, blocks=24, dtype=torch.bfloat16).via("Q4_K: 2111 tiles of 4 rows, loads ahead")
@example(qtype=Q4_K, M=1, N=8448, blocks=24, dtype=torch.bfloat16).via("Q4_K: 2112 tiles of 4 rows, none ahead")
@example(qtype=Q4_K, M=1, N=2048, blocks=24, dtype=torch.bfloat16).via("Q4_K expert gate/up at batch 1: 4-row tiles")
@example(qtype=Q5_K, M=1, N=2048, blocks=24, dtype=torch.bfloat16).via("Q5_K expert gate/up at batch 1: 4-row tiles")
@example(qtype=Q4_K, M=1, N=1052, blocks=24, dtype=torch.bfloat16).via("Q4_K: 263 tiles of 4 rows, split-K")
@example(qtype=Q4_K, M=8, N=2048, blocks=24, dtype=torch.bfloat16).via("Q4_K at 8 rows: no loads ahead")
@example(qtype=Q6_K, M=4, N=19360, blocks=24, dtype=torch.bfloat16).via("Q6_K lm_head/8 at batch 4: 8-row tiles")
@example(qtype=Q6_K, M=2, N=6144, blocks=8, dtype=torch.bfloat16).via("Q6_K expert down at batch 2: 8-row tiles")
@example(qtype=Q6_K, M=4, N=2048, blocks=24, dtype=torch.bfloat16).via("Q6_K expert gate/up at batch 4: 64 rows")
@example(qtype=Q6_K, M=8, N=19360, blocks=24, dtype=torch.bfloat16).via("Q6_K lm_head/8 at 8 rows: 8-row tiles")
@example(qtype=Q6_K, M=5, N=2048, blocks=24, dtype=torch.bfloat16).via("Q6_K expert gate/up at 5 rows: 8-row tiles")
@example(qtype=Q6_K, M=3, N=2112, blocks=8, dtype=torch.bfloat16).via("Q6_K: exactly 2 tiles of 8 rows per SM")
@example(qtype=Q6_K, M=3, N=2104, blocks=8, dtype=torch.bfloat16).via("Q6_K: one tile of 8 rows short of 2 per SM")
@example(qtype=Q6_K, M=4, N=6144, blocks=2, dtype=torch.float16).via("Q6_K 8-row tiles on rows of 2 blocks: kbs 2")
def test_int8_activations_only_for_k_quant_decode_batches_on_a_gpu(qtype, M, N, blocks, dtype):
    """q8 (``gguf_gemv_q8``): Q4_K, Q5_K and Q6_K (rows of an even number of blocks), bf16/fp16 activations, batches
    2..Q8_MAX_M, and for Q4_K and Q5_K batch 1 from Q8_MIN_BYTES_M1 of weight, with M rounded up to a power of two
    rows per program; never chosen for the interpreter; L2 prefetch only for the other types' weights of
    PREFETCH_MIN_BYTES or more at 2..4 rows; loads one step ahead for Q4_K at 2..4 rows; for Q6_K tiles of 8 rows
    (kbs 4, 2 warps) at 5..8 rows and at 2..4 rows where they alone give >= 2 programs per SM; at batch 1 tiles of 4
    rows, kbs 8 on 4 warps (kbs 4 on 2 warps for rows of fewer than 16 super-blocks), loads ahead while the row
    tiles give fewer than 16 programs per SM; split-K only while the programs do not fill the GPU (>= 2 per SM)."""
    qk, qb = BLOCK_SIZES[qtype]
    K = blocks * qk
    gpu = pick_config(qtype, M, N, K, 132, dtype, "")
    weight_bytes = N * blocks * qb
    want = (qtype in (Q4_K, Q5_K, Q6_K) and (qtype != Q6_K or blocks % 2 == 0) and dtype != torch.float32
            and (1 < M <= Q8_MAX_M or (M == 1 and qtype in (Q4_K, Q5_K) and weight_bytes >= Q8_MIN_BYTES_M1))
            and not _wants_mma(qtype, M, weight_bytes, dtype, blocks))
    assert gpu.q8 == want
    assert not pick_config(qtype, M, N, K, 1, dtype, "cpu").q8
    if gpu.q8:
        assert gpu.block_m == next(b for b in (1, 2, 4, 8) if b >= M)  # rows per program: the CUDA-graph size
        assert gpu.prefetch == int(qtype != Q4_K and 1 < M <= 4 and weight_bytes >= PREFETCH_MIN_BYTES)
        assert gpu.ahead == (qtype == Q4_K and 1 < M <= 4 or M == 1 and -(-N // 4) < 16 * 132)
        # 8-row tiles: Q6_K at 5..8 rows, and at 2..4 rows where they still fill the GPU
        many = qtype == Q6_K and 1 < M and (M > 4 or -(-N // 8) >= 2 * 132)
        assert gpu.block_n == (4 if M == 1 else 8 if many else 64 if qtype == Q6_K else 16)
        if M == 1:
            assert (gpu.kbs, gpu.num_warps) == ((8, 4) if blocks >= 16 else (min(4, 1 << blocks.bit_length() - 1), 2))
        else:
            assert (gpu.num_warps, gpu.kbs if many else None) == ((2, min(4, 1 << blocks.bit_length() - 1)) if many
                                                                 else (4, None))
        assert 1 <= gpu.split_k * gpu.kbs <= blocks + gpu.kbs - 1 and (qtype != Q6_K or gpu.kbs % 2 == 0)
        if -(-N // gpu.block_n) >= 2 * 132:  # enough row tiles: no split-K
            assert gpu.split_k == 1, gpu


def _wants_mma(qtype, M, weight_bytes, dtype, blocks) -> bool:
    """The tensor-core int8 rule, restated: Q4_K/Q5_K, bf16/fp16, 5..16 rows, or 3..4 rows on 32 MB (Q4_K) / 8 MB
    (Q5_K) of weight in rows of 16 super-blocks or more."""
    big = weight_bytes >= {Q4_K: 32 << 20, Q5_K: 8 << 20}.get(qtype, 1 << 62) and blocks >= 16
    return qtype in (Q4_K, Q5_K) and dtype != torch.float32 and (5 <= M <= 16 or 3 <= M <= 4 and big)


@given(qtype=st.sampled_from(sorted(SUPPORTED_QTYPES)), M=st.integers(1, 256), N=st.integers(1, 40000),
       blocks=st.integers(1, 64), dtype=st.sampled_from((torch.bfloat16, torch.float16, torch.float32)))
@example(qtype=Q4_K, M=16, N=2048, blocks=24, dtype=torch.bfloat16).via("expert gate/up at 16 rows: 64-row tiles")
@example(qtype=Q4_K, M=8, N=2048, blocks=8, dtype=torch.bfloat16).via("q_b/8 at 8 rows: 16-row tiles on 1 warp")
@example(qtype=Q4_K, M=16, N=2048, blocks=8, dtype=torch.bfloat16).via("q_b/8 at 16 rows: 32-row tiles")
@example(qtype=Q4_K, M=4, N=19360, blocks=24, dtype=torch.bfloat16).via("Q4_K lm_head/8 at 4 rows (67 MB)")
@example(qtype=Q4_K, M=16, N=19360, blocks=24, dtype=torch.bfloat16).via("Q4_K lm_head/8 at 16 rows: no split-K")
@example(qtype=Q4_K, M=4, N=2048, blocks=24, dtype=torch.bfloat16).via("Q4_K expert gate/up at 4 rows: dp4a")
@example(qtype=Q5_K, M=3, N=6144, blocks=8, dtype=torch.bfloat16).via("Q5_K expert down at 3 rows: dp4a (8 blocks)")
@example(qtype=Q5_K, M=4, N=2048, blocks=24, dtype=torch.bfloat16).via("Q5_K expert gate/up at 4 rows (8.7 MB)")
@example(qtype=Q5_K, M=2, N=19360, blocks=24, dtype=torch.bfloat16).via("Q5_K lm_head/8 at 2 rows: dp4a")
@example(qtype=Q4_K, M=17, N=2048, blocks=24, dtype=torch.bfloat16).via("past the decode kernels")
def test_int8_tensor_cores_for_k_quant_batches_of_3_to_16(qtype, M, N, blocks, dtype):
    """mma (``gguf_mma``): Q4_K and Q5_K, bf16/fp16 activations, on a GPU only, at 5..16 rows and at 3..4 on large
    weights; 8 activation rows per program up to 8, else 16; 64-row tiles on 2 warps, two pipeline stages, split-K to
    ~4 programs per SM, unless such tiles with one super-block per program give fewer than 4 programs per SM: then
    16 rows on 1 warp, one stage and ~8 programs per SM up to 8 rows, 32 rows on 2 warps and two super-blocks per
    step above; above 8 rows no split-K where the row tiles alone give >= 2 programs per SM."""
    qk, qb = BLOCK_SIZES[qtype]
    K = blocks * qk
    gpu = pick_config(qtype, M, N, K, 132, dtype, "")
    want = _wants_mma(qtype, M, N * blocks * qb, dtype, blocks)
    assert gpu.mma == want and not gpu.q8 if want else not gpu.mma
    assert not pick_config(qtype, M, N, K, 132, dtype, "cpu").mma
    if want:
        small = -(-N // 64) * blocks < 4 * 132
        assert (gpu.block_n, gpu.num_warps, gpu.stages) == ((16, 1, 1) if small and M <= 8 else (32, 2, 2) if small
                                                            else (64, 2, 2))
        assert gpu.block_m == (8 if M <= 8 else 16) and gpu.prefetch == 0
        assert gpu.kbs == (2 if gpu.block_n == 32 and blocks >= 2 else 1)
        tiles, target = -(-N // gpu.block_n), (8 if gpu.block_n == 16 else 4) * 132
        split, steps = gpu.split_k, -(-blocks // gpu.kbs)
        assert 1 <= split <= steps and -(-steps // -(-steps // split)) == split  # no split left empty
        if M > 8 and tiles >= 2 * 132:
            assert split == 1, gpu
        # no more splits than reach the target number of programs, and evening them out costs at most half of it
        assert (split - 1) * tiles < target, gpu
        assert split == steps or 2 * split * tiles >= target or M > 8 and tiles >= 2 * 132, gpu


def test_q6_k_tiles_of_8_rows_follow_the_sm_count():
    """Q6_K at 2..4 rows takes 8-row tiles where cdiv(N, 8) >= 2 programs per SM of *this* GPU: the 2048 rows of
    expert gate/up fill a 66-SM GPU that way but not a 132-SM one."""
    assert [pick_config(Q6_K, 4, 2048, 6144, sms, torch.bfloat16, "").block_n for sms in (66, 128, 129, 132)] == [
        8, 8, 64, 64]


@given(N=st.integers(1, 40000), blocks=st.integers(1, 64))
@example(N=512, blocks=24).via("GLM-5 TP=8 expert gate+up, 512 x 6144")
@example(N=1024, blocks=24).via("few row tiles, many K steps")
def test_a_batch_and_its_cuda_graph_size_get_the_same_launch(N, blocks):
    """vLLM replays a decode batch of M in the CUDA graph captured for the next size of 1, 2, 4, 8, 16 (padded
    rows); eager and graphs compute bit-identical rows only if both sizes take the same kernel and launch."""
    for qtype in SUPPORTED_QTYPES:
        K = blocks * BLOCK_SIZES[qtype][0]
        for M in range(1, 17):
            padded = next(size for size in (1, 2, 4, 8, 16) if size >= M)
            for dtype in (torch.bfloat16, torch.float16):
                want = pick_config(qtype, padded, N, K, 132, dtype, "")
                assert pick_config(qtype, M, N, K, 132, dtype, "") == want, (qtype, M, N, K)


@pytest.mark.parametrize("bad", [dict(block_m=3), dict(block_n=0), dict(kbs=6), dict(num_warps=True), dict(block_m=2.0),
                                 dict(split_k=0), dict(prefetch=-1)], ids=str)
def test_a_bad_config_is_refused_when_made(bad):
    """Block sizes and warp counts must be powers of two (ints), split_k >= 1, prefetch >= 0: a bad GemvConfig is
    a clear ValueError naming the field, whatever batch it would later meet (``gguf_linear`` clips q8's block_m to
    the batch, so a bad one used to fail only for some batches)."""
    field = next(iter(bad))
    with pytest.raises(ValueError, match=f"{field}="):
        GemvConfig(**bad)


def test_moe_path_by_batch():
    """gguf_moe runs the per-pair kernels up to 16 tokens, or up to MOE_Q8_MAX_M (128) where both projections run
    with int8 activations (Q4_K w13 and w2, and q8, i.e. bf16/fp16 x on a GPU: measured faster than the grouped
    path there), and the grouped tensor-core kernels beyond."""
    from glm5serve.kernels.gguf_topk_moe import MOE_Q8_MAX_M, per_pair

    assert MOE_Q8_MAX_M == 128
    for q13 in SUPPORTED_QTYPES:
        for q2 in SUPPORTED_QTYPES:
            for q8 in (False, True):
                limit = 128 if q8 and q13 == q2 == Q4_K else 16
                assert [per_pair(q13, q2, t, q8) for t in (1, 16, 17, limit, limit + 1)] == [
                    True, True, limit > 16, True, False], (q13, q2, q8)


@given(qtype=st.sampled_from(sorted(SUPPORTED_QTYPES)), rows=st.integers(1, 5), blocks=st.integers(1, 3),
       pad=st.integers(0, 5), start=st.integers(0, 2), experts=st.integers(0, 3))
def test_kernel_view_of_a_weight_is_aligned_and_keeps_its_blocks(qtype, rows, blocks, pad, start, experts):
    """``_as_words`` on padded, row-sliced raw weights, 2-D or (``experts`` > 0) 3-D expert stacks sliced from the
    second expert on: the view's start and strides are whole 4-byte words (Q4_K/Q5_K, read as int32) or 2-byte
    pairs (the other types, read as uint16 in the kernels), so no load is misaligned, and every row still holds
    its block bytes in order.  (Triton's interpreter does not fault on misaligned loads, so this is the check.)"""
    row_bytes = BLOCK_SIZES[qtype][1] * blocks
    lead = (experts + 1,) if experts else ()
    raw = torch.randint(0, 256, (*lead, rows + start, row_bytes + pad), dtype=torch.uint8)
    src = raw[1:, start:] if experts else raw[start:]
    w = _as_words(src, qtype)
    unit = 4 if qtype in _WORD_TYPES else 2
    assert w.data_ptr() % unit == 0 and all(s * w.element_size() % unit == 0 for s in w.stride()[:-1])
    assert torch.equal(w.view(torch.uint8)[..., :row_bytes] if unit == 4 else w[..., :row_bytes],
                       src[..., :row_bytes])


def test_a_tuned_entry_covers_smaller_batches_but_not_batch_one(tmp_path, monkeypatch):
    """``pick_config`` takes a shape's entry for the smallest tuned batch >= M, but batch 1 only from a batch-1
    entry: a tensor-core entry tuned at batch 2 made Q8_0 expert gate/up at batch 1 take 17.5 us against 11.5 for
    the heuristic (H200, session 12, a table written on the device)."""
    cfg = GemvConfig(block_n=32, kbs=4, split_k=3, use_dot=True)  # no heuristic's choice
    name = "Test_GPU_batch_classes"
    (tmp_path / f"{name}.json").write_text(json.dumps({"configs": {"8,4,2048,6144": dataclasses.asdict(cfg)}}))
    monkeypatch.setattr(gguf_gemv, "TUNED_DIR", tmp_path)
    tuned_configs.cache_clear()
    pick_config.cache_clear()
    try:
        assert [pick_config(Q8_0, m, 2048, 6144, 132, torch.bfloat16, name) == cfg for m in (1, 2, 3, 4, 5)] == [
            False, True, True, True, False]
        assert pick_config(Q8_0, 1, 2048, 6144, 132, torch.bfloat16, name) == pick_config(
            Q8_0, 1, 2048, 6144, 132, torch.bfloat16, "")
    finally:
        tuned_configs.cache_clear()
        pick_config.cache_clear()


def test_pdl_value_follows_the_environment_and_the_device(monkeypatch):
    """Programmatic dependent launch (``$GLM5SERVE_PDL``): never off CUDA nor under the interpreter (no PTX there, and
    no ``launch_pdl`` option), never with ``off``; on an sm_90 device with a Triton that knows ``launch_pdl``, 1 for
    ``wait`` and 1 + min(steps, PDL_MAX_STEPS) for ``prefetch``; ``wait`` is the default; another value is a clear
    error."""
    assert gguf_gemv.PDL_MODE == "wait" or gguf_gemv.PDL_ENV in os.environ
    cpu = torch.device("cpu")
    for mode in gguf_gemv.PDL_MODES:
        monkeypatch.setattr(gguf_gemv, "PDL_MODE", mode)
        assert gguf_gemv.pdl_value(cpu, 3) == 0
        assert gguf_gemv.pdl_launch(gguf_gemv.pdl_value(cpu, 3)) == {}
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CUDA tensors under the interpreter: no PTX, so no PDL
    assert gguf_gemv._pdl_capable.__wrapped__(0) is False
    monkeypatch.setattr(gguf_gemv, "_pdl_capable", lambda index: True)
    cuda = torch.device("cuda", 0)
    most = gguf_gemv.PDL_MAX_STEPS
    expected = {"off": [0, 0, 0], "wait": [1, 1, 1], "prefetch": [1, 1 + min(2, most), 1 + most]}
    for mode, want in expected.items():
        monkeypatch.setattr(gguf_gemv, "PDL_MODE", mode)
        assert [gguf_gemv.pdl_value(cuda, s) for s in (0, 2, 100)] == want
    assert gguf_gemv.pdl_launch(3) == {"launch_pdl": True}
    monkeypatch.setattr(gguf_gemv, "PDL_MODE", "yes")
    with pytest.raises(ValueError, match="GLM5SERVE_PDL='yes'"):
        gguf_gemv.pdl_value(cpu, 1)


class _Launches:
    """Stands in for a Triton kernel: records each launch's keyword arguments and runs nothing."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.name, {**kwargs, "args": args}))


def test_every_launch_site_pairs_launch_pdl_with_the_wait(monkeypatch):
    """Each GEMV launch site passes ``launch_pdl`` exactly when it compiles the kernel with PDL > 0 (launched with PDL
    but compiled without ``griddepcontrol.wait``, a GEMV would read x before the kernel writing it finished), and the
    int8 paths launch their activation quantizer with PDL exactly when they launch their GEMV with it."""
    from glm5serve.kernels import gguf_gemv_q8, gguf_mma, gguf_split

    log: list = []
    for mod, name in ((gguf_gemv, "_gemv_kernel"), (gguf_gemv_q8, "_quantize_x_kernel"),
                      (gguf_gemv_q8, "_gemv_q8_kernel"), (gguf_split, "_gemv_split_kernel"),
                      (gguf_mma, "_gemm_mma_kernel"), (gguf_mma, "_gemm_split_mma_kernel")):
        monkeypatch.setattr(mod, name, _Launches(name, log))
    N, K = 32, 512
    x = torch.randn(2, K).to(torch.bfloat16)
    q4k = torch.zeros(N, K // 256 * 144, dtype=torch.uint8)
    q40 = gguf_split.split_rows(torch.zeros(N, K // 32 * 18, dtype=torch.uint8), gguf_gemv.Q4_0, K)
    calls = [lambda: gguf_linear(x, q4k, Q4_K, N, GemvConfig(split_k=2)),  # one kernel (FMA / tensor cores)
             lambda: gguf_linear(x, q4k, Q4_K, N, GemvConfig(kbs=1, split_k=2, q8=True)),  # quantizer + int8 GEMV
             lambda: gguf_linear(x, q40, gguf_split.split_type(gguf_gemv.Q4_0), N,
                                 GemvConfig(block_n=16, kbs=4, split_k=2, q8=True)),  # quantizer + split rows
             lambda: gguf_linear(x, q4k, Q4_K, N, GemvConfig(block_n=16, kbs=1, split_k=2, mma=True)),  # + int8 MMA
             lambda: gguf_linear(x, q40, gguf_split.split_type(gguf_gemv.Q4_0), N,
                                 GemvConfig(block_n=16, kbs=4, split_k=2, q8=True, mma=True))]  # split rows, MMA
    long_k = 2 * gguf_mma.MMA_PDL_MAX_BLOCKS * 256  # split in 2: programs of MMA_PDL_MAX_BLOCKS super-blocks
    x_long, q4k_long = torch.randn(2, long_k).to(torch.bfloat16), torch.zeros(N, long_k // 256 * 144, dtype=torch.uint8)
    long_programs = [lambda: gguf_linear(x_long, q4k_long, Q4_K, N, GemvConfig(block_n=16, split_k=1, mma=True)),
                     lambda: gguf_linear(x_long, q4k_long, Q4_K, N, GemvConfig(block_n=16, kbs=2, split_k=2,
                                                                              mma=True))]
    for mode in gguf_gemv.PDL_MODES:
        def value(device, steps, mode=mode):  # pdl_value on a capable GPU (these tensors are on the CPU)
            return {"off": 0, "wait": 1, "prefetch": 1 + min(steps, gguf_gemv.PDL_MAX_STEPS)}[mode]
        for mod in (gguf_gemv, gguf_gemv_q8, gguf_split, gguf_mma):
            monkeypatch.setattr(mod, "pdl_value", value)
        for call in calls + long_programs:
            log.clear()
            call()
            assert [n for n, _ in log] in (["_gemv_kernel"], ["_quantize_x_kernel", "_gemv_q8_kernel"],
                                           ["_quantize_x_kernel", "_gemv_split_kernel"],
                                           ["_quantize_x_kernel", "_gemm_mma_kernel"],
                                           ["_quantize_x_kernel", "_gemm_split_mma_kernel"])
            # the tensor-core GEMM's programs of MMA_PDL_MAX_BLOCKS super-blocks or more launch without PDL
            pdl = mode != "off" and call not in long_programs
            for name, kw in log:
                assert bool(kw.get("launch_pdl")) == (int(kw["PDL"]) > 0) == pdl, (mode, name, kw)
    # the tensor-core GEMM runs pick_config's kbs, splits of whole K steps, as many as pick_config asked for
    for M, n, k in ((16, 2048, 2048), (16, 512, 6144), (8, 2048, 6144), (16, 19360, 6144), (16, 6144, 256)):
        cfg = gguf_gemv.pick_config(Q4_K, M, n, k, 132, torch.bfloat16, "")
        log.clear()
        gguf_linear(torch.randn(M, k).to(torch.bfloat16), torch.zeros(n, k // 256 * 144, dtype=torch.uint8), Q4_K,
                    n, cfg)
        (_, kw), = [e for e in log if e[0] == "_gemm_mma_kernel"]
        nb, blocks_per_split = kw["args"][10:12]
        assert cfg.mma and kw["KBS"] == cfg.kbs and blocks_per_split % cfg.kbs == 0, (cfg, kw)
        assert kw["SPLIT_K"] == -(-nb // blocks_per_split) == cfg.split_k, (cfg, nb, blocks_per_split)
    # split rows at 9..16 rows run pick_split_config's tensor-core launch: its groups per step and split count
    for qtype, M, n, k in ((gguf_gemv.Q6_K, 16, 2048, 6144), (gguf_gemv.Q4_0, 9, 6144, 2048),
                           (gguf_gemv.Q8_0, 12, 512, 6144)):
        stype = gguf_split.split_type(qtype)
        cfg = gguf_split.pick_split_config(stype, M, n, k, 132)
        rows = gguf_split.split_rows(torch.zeros(n, k // gguf_gemv.BLOCK_SIZES[qtype][0] *
                                                 gguf_gemv.BLOCK_SIZES[qtype][1], dtype=torch.uint8), qtype, k)
        log.clear()
        gguf_linear(torch.randn(M, k).to(torch.bfloat16), rows, stype, n, cfg)
        (_, kw), = [e for e in log if e[0] == "_gemm_split_mma_kernel"]
        ng, per_split = kw["args"][8:10]
        assert cfg.mma and kw["GROUPS"] == cfg.kbs and per_split % cfg.kbs == 0 and kw["BLOCK_M"] == 16, (cfg, kw)
        assert kw["SPLIT_K"] == -(-ng // per_split) == cfg.split_k and kw["num_warps"] == cfg.num_warps, (cfg, kw)
        assert kw["num_stages"] == cfg.stages and kw["QTYPE"] == qtype, (cfg, kw)


def test_moe_launches_pair_launch_pdl_with_the_wait_and_take_their_tiles(monkeypatch):
    """The int8 per-pair MoE launches quantizer, gate+up, quantizer, down, each with ``launch_pdl`` exactly when it
    is compiled with PDL (never under ``off``); an fp32-decode projection launches plainly.  Down takes the slots
    side by side (``_slots_tile``: SLOTS = top-k rounded up to a power of two, up to MOE_Q8_SLOTS_MAX_ROWS) for w2
    rows of up to MOE_Q8_SLOTS_MAX_BLOCKS super-blocks, else the slot loop; gate+up takes ``_gate_up_tile``."""
    from glm5serve.kernels import gguf_gemv_q8, gguf_moe, gguf_topk_moe as gm

    log: list = []
    monkeypatch.setattr(gguf_gemv_q8, "_quantize_x_kernel", _Launches("quantize", log))
    for name in ("_moe_gate_up_q8_kernel", "_moe_down_q8_kernel", "_moe_down_q8_slots_kernel", "_moe_down_kernel"):
        monkeypatch.setattr(gm, name, _Launches(name, log))
    E, H, T, k = 4, 512, 3, 3
    x = torch.randn(T, H).to(torch.bfloat16)
    ids, wts = torch.tensor([[0, 1, 2]] * T, dtype=torch.int32), torch.ones(T, k)
    for mode in gguf_gemv.PDL_MODES:
        value = {"off": 0, "wait": 1, "prefetch": 1 + gguf_gemv.PDL_MAX_STEPS}[mode]  # pdl_value on a capable GPU
        for mod in (gguf_gemv_q8, gm):
            monkeypatch.setattr(mod, "pdl_value", lambda device, steps, value=value: value)
        for blocks, q2 in ((1, Q4_K), (gm.MOE_Q8_SLOTS_MAX_BLOCKS, Q4_K), (gm.MOE_Q8_SLOTS_MAX_BLOCKS + 1, Q4_K),
                           (1, gguf_gemv.Q6_K)):
            inter = 256 * blocks
            w13 = torch.zeros(E, 2 * inter, H // 256 * 144, dtype=torch.uint8)
            w2 = torch.zeros(E, H, blocks * gguf_gemv.BLOCK_SIZES[q2][1], dtype=torch.uint8)
            log.clear()
            gguf_moe(x, w13, w2, wts, ids, Q4_K, q2, q8=True)
            down = ("_moe_down_kernel" if q2 != Q4_K else "_moe_down_q8_slots_kernel"
                    if blocks <= gm.MOE_Q8_SLOTS_MAX_BLOCKS else "_moe_down_q8_kernel")
            names = [n for n, _ in log]
            assert names == ["quantize", "_moe_gate_up_q8_kernel"] + (["quantize"] if q2 == Q4_K else []) + [down]
            for name, kw in log:
                pdl = mode != "off" and name != "_moe_down_kernel"
                assert bool(kw.get("launch_pdl")) == bool(kw.get("PDL")) == pdl, (mode, name, kw)
            gate_up = dict(log)["_moe_gate_up_q8_kernel"]
            sms = gm._device_sms(x.device)
            assert (gate_up["BLOCK_N"], gate_up["num_warps"]) == gm._gate_up_tile(T * k, inter, sms), gate_up
            if down == "_moe_down_q8_slots_kernel":
                kw = dict(log)[down]
                assert (kw["SLOTS"], kw["BLOCK_N"], kw["KBS"], kw["num_warps"]) == (4, *gm.MOE_Q8_SLOTS_TILE)
    # past MOE_Q8_SLOTS_MAX_ROWS slots the slot loop takes short w2 rows too
    inter, k = 256, gm.MOE_Q8_SLOTS_MAX_ROWS + 1
    log.clear()
    gguf_moe(x[:1], torch.zeros(E, 2 * inter, H // 256 * 144, dtype=torch.uint8),
             torch.zeros(E, H, 144, dtype=torch.uint8), torch.ones(1, k), torch.zeros(1, k, dtype=torch.int32),
             Q4_K, Q4_K, q8=True)
    assert [n for n, _ in log][-1] == "_moe_down_q8_kernel"
    # the slots tile keeps 8 rows per slot up to top-8, then at most MOE_Q8_SLOTS_MAX_ROWS rows in all
    tiles = {k: gm._slots_tile(k) for k in (1, 3, 8, 9, 16, 32, 64, 65)}
    assert tiles == {1: (1, 8, 1, 4), 3: (4, 8, 1, 4), 8: (8, 8, 1, 4), 9: (16, 4, 1, 4), 16: (16, 4, 1, 4),
                     32: (32, 2, 1, 4), 64: (64, 1, 1, 4), 65: None}, tiles
    # the measured rule (H200, 132 SMs, top-8): 2 rows on 4 warps below 16 programs of 4 rows per SM, else 4 on 2
    for tokens, inter, tile in ((1, 256, (2, 4)), (4, 256, (2, 4)), (16, 256, (4, 2)), (1, 2048, (4, 2)),
                                (4, 2048, (4, 2))):
        assert gm._gate_up_tile(8 * tokens, inter, 132) == tile, (tokens, inter)


@pytest.mark.parametrize("args,words", [
    ((Q.F32, 1, 32, 256), "qtype <GGMLQuantizationType.F32: 0> is not one of"),
    (("Q4_K", 1, 32, 256), "qtype 'Q4_K' is not one of"),
    ((Q.Q4_K, 0, 32, 256), "M must be a positive integer, not 0"),
    ((Q.Q4_K, 1.5, 32, 256), "M must be a positive integer, not 1.5"),
    ((Q.Q4_K, -5, 32, 256), "M must be a positive integer, not -5"),
    ((Q.Q4_K, 1, 0, 256), "N must be a positive integer, not 0"),
    ((Q.Q4_K, 1, 32, 100), "K=100 is not a whole number of Q4_K blocks (256 values)"),
])
def test_pick_config_refuses_what_no_kernel_runs(args, words):
    """Fresh-user finding: ZeroDivisionError, KeyError or AttributeError from deep inside, or (M=-5) a config."""
    with pytest.raises(ValueError, match=re.escape(words)):
        pick_config(*args)

"""The GGUF Triton kernels compiled ahead of time for Hopper (sm_90) on a machine without a GPU, with the ptxas and
cuobjdump that ship inside Triton: every type on both paths compiles, nothing spills to local memory, and the
main loop stays within an instruction budget per weight.

Why a budget: a decode GEMV on an H200 must consume ~30 weights per SM clock to stream Q4_K at full bandwidth,
and an SM issues 128 thread-instructions per clock, so instructions per weight in the K loop (counted in the SASS)
bound the bandwidth a kernel can reach: ~4 for 100 % and ~8 for 50 % with Q4_K (more for wider types).  The
budgets below are the counts measured when the kernels were written plus ~25 %: exceeding one is a performance
regression (a layout conversion or a per-weight scale recomputation crept into the loop), not a failure to run.
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("compiles real kernels; not under the interpreter", allow_module_level=True)

import importlib  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

g = importlib.import_module("glm5serve.kernels.gguf_gemv")
gm = importlib.import_module("glm5serve.kernels.gguf_topk_moe")

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
if not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists():
    pytest.skip("Triton's bundled ptxas/cuobjdump not found", allow_module_level=True)
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - other Triton layouts
    pytest.skip("this Triton has no ASTSource/GPUTarget", allow_module_level=True)

SM90 = GPUTarget("cuda", 90, 32)
# Max SASS instructions per weight in the K loop: (FMA path at M = 1, tensor-core path), production tiles.
# Measured, FMA path then dot path (triton 3.8 here / 3.6 on the GPU host where known): Q4_K 6.3 / 7.6, 7.3 / 8.4;
# Q5_K 9.5 / 10.9, 10.8 / 11.6; Q6_K 11.2, 17.3 / 18.6; Q8_0 9.3, 14.7 / 14.5; Q4_0 8.2, 8.8; Q5_0 11.4, 13.0.
# Q6_K and Q8_0 decode uint16 pairs on the FMA path (15.8 and 12.3 with the byte decoder) and bytes on the dot
# path; Q4_0 and Q5_0 pairs on both (with bytes: 8.8, 12.3 and 12.7, 19.5).  Budgets: the larger plus ~15 %.
BUDGET = {g.Q4_K: (8.8, 9.7), g.Q5_K: (12.5, 13.5), g.Q6_K: (13.0, 21.5), g.Q8_0: (10.7, 17.0),
          g.Q4_0: (9.5, 10.2), g.Q5_0: (13.1, 15.0)}


def _compile(kernel, signature: dict, constexprs: dict, aligned: tuple[str, ...], num_warps: int = 4,
             num_stages: int | None = None):
    # Triton's launcher marks pointers and ints divisible by 16 with tt.divisibility; do the same here
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    # constexpr parameters with a default (PREFETCH) take it unless given
    constexprs = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constexprs}
    sig = {n: ("constexpr" if n in constexprs else signature[n]) for n in kernel.arg_names}
    options = dict(num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}))
    return triton.compile(ASTSource(kernel, sig, constexprs, attrs), target=SM90, options=options)


def _sass(compiled) -> tuple[str, str]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = [subprocess.run([str(BIN / "cuobjdump"), flag, f.name], capture_output=True, text=True, check=True).stdout
               for flag in ("--dump-sass", "--dump-resource-usage")]
    return out[0], out[1]


def _loop_body(sass: str) -> list[str]:
    """Opcodes of the largest loop (a backward branch and its target) in a SASS dump."""
    lines = [(int(a, 16), ins) for a, ins in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    best: list[str] = []
    for addr, ins in lines:
        m = re.search(r"BRA .*?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            body = [re.sub(r"^@!?U?P\w+\s+", "", i).split()[0] for a, i in lines if int(m.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    return best


def _gemv_sig(qtype: int) -> dict:
    return dict(x_ptr="*bf16", w_ptr="*i32" if qtype in g._WORD_TYPES else "*u8", y_ptr="*bf16", part_ptr="*fp32",
                count_ptr="*i32", M="i32", N="i32", nb="i32", blocks_per_split="i32", stride_xm="i32",
                stride_wn="i32", stride_ym="i32")


def _production_config(qtype: int, use_dot: bool) -> g.GemvConfig:
    """pick_config's tile for a 2048 x 6144 weight: at 16 bf16 rows (tensor cores; Q4_K and Q5_K take the int8
    tensor-core kernel there, so their bf16 tile is the one an explicit ``use_dot`` config gets), or at 1 fp32 row
    (the FMA path, which bf16 Q4_K and Q5_K at batch 1 leave to the int8-activation kernel for weights this
    large)."""
    if use_dot and qtype in g.MMA_MIN_BYTES_M4:
        block_n, kbs = g._DOT_TILE[qtype]
        return g.GemvConfig(block_n=block_n, kbs=kbs, num_warps=4, use_dot=True)
    return g.pick_config(qtype, 16 if use_dot else 1, 2048, 6144, 132, torch.bfloat16 if use_dot else torch.float32)


def _gemv(qtype: int, use_dot: bool):
    cfg = _production_config(qtype, use_dot)
    G, T = g.tile_shape(qtype, cfg.kbs)
    sig = _gemv_sig(qtype)
    const = dict(QTYPE=qtype, BLOCK_M=16 if use_dot else 1, BLOCK_N=cfg.block_n, KBS=cfg.kbs, G=G, T=T,
                 USE_DOT=use_dot, SPLIT_K=4)
    k = _compile(g._gemv_kernel, sig, const, ("x_ptr", "w_ptr", "y_ptr", "part_ptr", "count_ptr", "N",
                                              "stride_xm", "stride_wn", "stride_ym"), cfg.num_warps)
    per_thread = cfg.block_n * cfg.kbs * g.BLOCK_SIZES[qtype][0] / (32 * cfg.num_warps)
    return k, per_thread


@pytest.mark.parametrize("use_dot", (False, True), ids=("fma", "dot"))
@pytest.mark.parametrize("qtype", sorted(BUDGET), ids=lambda q: g._NAMES[q])
def test_gemv_compiles_for_sm90_within_budget(qtype, use_dot):
    k, weights_per_thread = _gemv(qtype, use_dot)
    sass, usage = _sass(k)
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    ops = collections.Counter(_loop_body(sass))
    assert stack == 0 and not any(o.startswith(("LDL", "STL")) for o in ops), f"spills: {usage.strip()}"
    if use_dot:
        assert any(o.startswith("HMMA") for o in ops), "the dot path must use the tensor cores"
    per_weight = sum(ops.values()) / weights_per_thread
    budget = BUDGET[qtype][use_dot]
    assert per_weight <= budget, (f"{g._NAMES[qtype]} {'dot' if use_dot else 'fma'}: {per_weight:.2f} SASS "
                                  f"instructions per weight > {budget}; top: {ops.most_common(8)}")


@pytest.mark.parametrize("qtype", (g.Q4_K, g.Q6_K), ids=lambda q: g._NAMES[q])
def test_moe_kernels_compile_for_sm90(qtype):
    kbs = gm._kbs(qtype, 8)
    G, T = g.tile_shape(qtype, kbs)
    wt = "*i32" if qtype in g._WORD_TYPES else "*u8"
    const = dict(QTYPE=qtype, BLOCK_N=16, KBS=kbs, G=G, T=T)
    up = _compile(gm._moe_gate_up_kernel, dict(x_ptr="*bf16", w_ptr=wt, ids_ptr="*i32", h_ptr="*fp32", inter="i32",
                                               nb="i32", topk="i32", E="i32", stride_xm="i32", stride_we="i32",
                                               stride_wn="i32", stride_hm="i32"), const, ("x_ptr", "w_ptr", "h_ptr"))
    down = _compile(gm._moe_down_kernel, dict(h_ptr="*fp32", w_ptr=wt, ids_ptr="*i32", wts_ptr="*fp32",
                                              y_ptr="*bf16", hidden="i32", nb="i32", topk="i32", E="i32",
                                              stride_hm="i32", stride_we="i32", stride_wn="i32", stride_ym="i32"), const,
                    ("h_ptr", "w_ptr", "y_ptr"))
    for k in (up, down):
        usage = _sass(k)[1]
        assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage


@pytest.mark.parametrize("qtype", sorted(BUDGET), ids=lambda q: g._NAMES[q])
def test_gemm_tiles_past_decode_compile_without_spills(qtype):
    """The 17..MAX_GEMM_M row tiles (block_m 64, as pick_config chooses for a 256-request decode batch)."""
    cfg = g.pick_config(qtype, 256, 2048, 6144, 132)
    assert cfg.use_dot and cfg.block_m == 64
    G, T = g.tile_shape(qtype, cfg.kbs)
    sig = _gemv_sig(qtype)
    const = dict(QTYPE=qtype, BLOCK_M=64, BLOCK_N=cfg.block_n, KBS=cfg.kbs, G=G, T=T, USE_DOT=True,
                 SPLIT_K=cfg.split_k)
    sass, usage = _sass(_compile(g._gemv_kernel, sig, const, ("x_ptr", "w_ptr", "y_ptr", "stride_xm", "stride_wn",
                                                              "stride_ym"), cfg.num_warps))
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert "HMMA" in sass or "HGMMA" in sass


@pytest.mark.parametrize("q13,q2", ((g.Q4_K, g.Q6_K), (g.Q5_K, g.Q8_0), (g.Q6_K, g.Q5_K), (g.Q4_0, g.Q5_0)),
                         ids=lambda q: g._NAMES[q])
def test_grouped_moe_kernels_compile_without_spills(q13, q2):
    def wt(q):
        return "*i32" if q in g._WORD_TYPES else "*u8"

    up = _compile(gm._grouped_gate_up_kernel,
                  dict(x_ptr="*bf16", w_ptr=wt(q13), sorted_ptr="*i32", gexp_ptr="*i32", h_ptr="*bf16", inter="i32",
                       nb="i32", topk="i32", n_pairs="i32", stride_xm="i32", stride_we="i32", stride_wn="i32",
                       stride_hm="i32"),
                  dict(QTYPE=q13, BLOCK_M=gm.GROUP_M, **dict(zip(("BLOCK_N", "KBS"), gm.grouped_tile(q13, True)))),
                  ("x_ptr", "w_ptr", "h_ptr", "sorted_ptr"), gm.GROUPED_WARPS)
    down = _compile(gm._grouped_down_kernel,
                    dict(h_ptr="*bf16", w_ptr=wt(q2), sorted_ptr="*i32", gexp_ptr="*i32", wts_ptr="*fp32",
                         out_ptr="*fp32", hidden="i32", nb="i32", n_pairs="i32", stride_hm="i32", stride_we="i32",
                         stride_wn="i32", stride_om="i32"),
                    dict(QTYPE=q2, BLOCK_M=gm.GROUP_M, **dict(zip(("BLOCK_N", "KBS"), gm.grouped_tile(q2, False)))),
                    ("h_ptr", "w_ptr", "out_ptr", "sorted_ptr"), gm.GROUPED_WARPS)
    for k in (up, down):
        sass, usage = _sass(k)
        assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
        assert "HMMA" in sass or "HGMMA" in sass


@pytest.mark.parametrize("qtype", sorted(BUDGET), ids=lambda q: g._NAMES[q])
def test_dequant_kernel_compiles_without_spills(qtype):
    """The STORE path behind dequantize_rows (batches past 16 rows: dequantize, then cuBLAS)."""
    bn, kbs = g._DEQUANT_TILE[qtype]
    k = _compile(g._dequant_kernel, dict(w_ptr="*i32" if qtype in g._WORD_TYPES else "*u8", out_ptr="*bf16",
                                         N="i32", nb="i32", stride_wn="i32", stride_on="i32"),
                 dict(QTYPE=qtype, BLOCK_N=bn, KBS=kbs), ("w_ptr", "out_ptr", "stride_wn", "stride_on"))
    sass, usage = _sass(k)
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    assert "STG" in sass


@pytest.mark.parametrize("use_dot", (False, True), ids=("fma", "dot"))
@pytest.mark.parametrize("qtype", (g.Q4_K, g.Q6_K, g.Q5_0), ids=lambda q: g._NAMES[q])
def test_prefetch_issues_l2_prefetches_in_the_loop(qtype, use_dot):
    """GemvConfig.prefetch > 0 puts ``prefetch.global.L2`` (SASS ``CCTL.E.PF2``) into the K loop, without spills;
    prefetch 0 leaves none."""
    counts = []
    for prefetch in (0, 2):
        cfg = _production_config(qtype, use_dot)
        G, T = g.tile_shape(qtype, cfg.kbs)
        sig = _gemv_sig(qtype)
        const = dict(QTYPE=qtype, BLOCK_M=16 if use_dot else 1, BLOCK_N=cfg.block_n, KBS=cfg.kbs, G=G, T=T,
                     USE_DOT=use_dot, SPLIT_K=4, PREFETCH=prefetch)
        sass, usage = _sass(_compile(g._gemv_kernel, sig, const, ("x_ptr", "w_ptr", "y_ptr", "stride_wn"),
                                     cfg.num_warps))
        assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
        counts.append(sum(o.startswith("CCTL.E.PF2") for o in _loop_body(sass)))
    assert counts[0] == 0 and counts[1] >= 1, counts


@pytest.mark.parametrize("key", sorted(g.tuned_configs("NVIDIA_H200")), ids=str)
def test_tuned_configs_compile_without_spills(key):
    qtype, M, N, K = key
    cfg = g.tuned_configs("NVIDIA_H200")[key]
    if cfg.q8:  # the int8-activation kernel, with the rows per program gguf_linear gives it at batch M
        k = _q8_kernel(qtype, min(cfg.block_m, g.Q8_MAX_M, g._pow2_at_least(M)), cfg.block_n, cfg.kbs, cfg.split_k,
                       cfg.prefetch, cfg.ahead, cfg.num_warps)
        assert int(re.search(r"STACK:(\d+)", _sass(k)[1]).group(1)) == 0
        return
    G, T = g.tile_shape(qtype, cfg.kbs)
    use_dot = cfg.use_dot and M > 1
    sig = _gemv_sig(qtype)
    const = dict(QTYPE=qtype, BLOCK_M=cfg.block_m if use_dot else 1, BLOCK_N=cfg.block_n, KBS=cfg.kbs, G=G, T=T,
                 USE_DOT=use_dot, SPLIT_K=cfg.split_k, PREFETCH=cfg.prefetch)
    _, usage = _sass(_compile(g._gemv_kernel, sig, const, ("x_ptr", "w_ptr", "y_ptr", "stride_wn"), cfg.num_warps))
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage


#: max SASS instructions per weight of the int8-activation kernel at its production tile per (type, batch) (block_m
#: rows per program), measured (triton 3.8): Q4_K 3.3 (8 weight rows per program; 2.7 with 16; 3.27 with session 22's
#: 4-row tile, loads one step ahead and the shape-matched one-row loads), 3.4 and 4.6 (loads
#: one step ahead), 6.2: rows after the first cost ~0.5 per weight each (two dp4a per word of 8 weights), against 2.7
#: for a program per row (each decoding the weights again); Q5_K 4.4 (8 weight rows on the rows step; 4.0 on the
#: one-row step with the 4-row tile), 4.3, 5.4 and, with kbs 2
#: (kbs 4: 7.3 with a stack frame), 9.5 at 8 rows; Q6_K (64 rows per program) 3.4, 4.4, and at 8 rows (8 rows per
#: program, kbs 4, 2 warps, 3-way split-K) 7.5 (7.2 with the 64-row tile it replaced).  Budgets: ~+15 %
#: (Q4_K's: +15-30 %).  Since session 23 Q4_K and Q5_K take the int8 tensor-core kernel at 5..16 rows (and Q5_K at
#: 3..4 rows on weights of 8 MB or more in long rows: its batch-4 case here is a 512 x 6144 weight), MMA_BUDGET
#: below.
Q8_BUDGET = {(g.Q4_K, 1): 3.8, (g.Q4_K, 2): 4.0, (g.Q4_K, 4): 5.5, (g.Q5_K, 1): 4.6, (g.Q5_K, 2): 4.9,
             (g.Q5_K, 4): 6.5, (g.Q6_K, 2): 3.9, (g.Q6_K, 4): 5.1, (g.Q6_K, 8): 8.3}
#: the same for Q6_K's tile of 8 rows, kbs 4 and 2 warps at 2..4 rows where N / 8 fills the GPU (lm_head/8,
#: 19360 x 6144; no split-K, L2 prefetch): 4.0 and 5.4 measured, 80 registers
Q8_MANY_ROWS_BUDGET = {(g.Q6_K, 2): 4.3, (g.Q6_K, 4): 5.8}
Q8_CASES = ([(q, m, 512 if (q, m) == (g.Q5_K, 4) else 2048) for q, m in sorted(Q8_BUDGET)]
            + [(q, m, 19360) for q, m in sorted(Q8_MANY_ROWS_BUDGET)])


def _q8_kernel(qtype: int, block_m: int, block_n: int, kbs: int, split_k: int, prefetch: int, ahead: bool = False,
               num_warps: int = 4):
    q8 = importlib.import_module("glm5serve.kernels.gguf_gemv_q8")
    sig = dict(xw_ptr="*i32", xd_ptr="*fp32", xs_ptr="*fp32", xi_ptr="*i32", w_ptr="*i32", y_ptr="*bf16",
               part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", nb="i32", blocks_per_split="i32",
               stride_wn="i32", stride_ym="i32")
    return _compile(q8._gemv_q8_kernel, sig, dict(QTYPE=qtype, BLOCK_M=block_m, BLOCK_N=block_n, KBS=kbs,
                                                   SPLIT_K=split_k, PREFETCH=prefetch, EMULATE=False,
                                                   AHEAD=ahead),
                    ("xw_ptr", "w_ptr", "y_ptr", "stride_wn"), num_warps)


@pytest.mark.parametrize("qtype,M,N", Q8_CASES, ids=[f"{g._NAMES[q]}-M{m}-N{n}" for q, m, n in Q8_CASES])
def test_q8_kernel_uses_dp4a_within_budget(qtype, M, N):
    """The int8-activation GEMV (``gguf_gemv_q8``) at its production tile for an N x 6144 weight and a decode
    batch of M: one IDP.4A per 4 weights and row in the K loop, no spills, no cross-lane shuffles when several rows
    share a program, and the budgets above (the fp32 decode needs 6.3-11 per weight and row, and its tensor-core
    path ~8-17 per weight for 16 rows)."""
    cfg = g.pick_config(qtype, M, N, 6144, 132)
    many = N == 19360
    assert cfg.q8 and cfg.block_m == M and cfg.num_warps == (2 if many or (qtype == g.Q6_K and M > 4) else 4), cfg
    split_k, prefetch = (cfg.split_k, cfg.prefetch) if many else (4, 0)  # many: the production launch (no split-K)
    sass, usage = _sass(_q8_kernel(qtype, cfg.block_m, cfg.block_n, cfg.kbs, split_k, prefetch, cfg.ahead,
                                   cfg.num_warps))
    ops = collections.Counter(_loop_body(sass))
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    weights = cfg.block_n * cfg.kbs * 256 / (32 * cfg.num_warps)  # per thread and K step
    assert ops["IDP.4A.S8.S8"] == M * weights / 4, ops.most_common(8)
    per_weight = sum(ops.values()) / weights
    assert per_weight <= (Q8_MANY_ROWS_BUDGET if many else Q8_BUDGET)[(qtype, M)], (per_weight, ops.most_common(8))
    if M > 1:
        assert not any(o.startswith("SHFL") for o in ops), ops.most_common(12)
    else:
        # one activation row: activations, scales and sums loaded in the code words' shape (``_load_q4_k_q8``), so
        # the loop keeps only the accumulator's conversion (Triton 3.8: 4 barriers; 12 for Q4_K and 20-24 for Q5_K
        # with the activations broadcast over the rows)
        assert ops["BAR.SYNC.DEFER_BLOCKING"] <= 4, ops.most_common(12)


#: max SASS instructions per weight in the K loop of the int8 tensor-core GEMM (``gguf_mma``) at its production tiles:
#: measured (Triton 3.8) Q4_K 2.61 (64 rows, 8 activation rows) - 4.44 (32 rows, 16, two super-blocks per step), Q5_K
#: 3.24 - 5.03, plus ~10-15 %
#: (the dp4a kernel needs 6.2 per weight at 8 rows, the bf16 tensor-core path ~8 at 16)
MMA_BUDGET = {g.Q4_K: 5.3, g.Q5_K: 5.6}
MMA_CASES = [(q, m, n, k) for q in (g.Q4_K, g.Q5_K) for m, n, k in ((4, 19360, 6144), (8, 2048, 6144), (8, 2048, 2048),
                                                                      (16, 2048, 6144), (16, 2048, 2048))]


@pytest.mark.parametrize("qtype,M,N,K", MMA_CASES, ids=[f"{g._NAMES[q]}-M{m}-{n}x{k}" for q, m, n, k in MMA_CASES])
def test_mma_kernel_uses_int8_tensor_cores_within_budget(qtype, M, N, K):
    """The int8 tensor-core GEMM at pick_config's launch (tile, split-K, pipelining, PDL): s8 x s8 MMAs in the K loop,
    one per 16 x 8 x 32 product, no spills, and MMA_BUDGET instructions per weight at most."""
    import triton

    from glm5serve.kernels import gguf_mma

    cfg = g.pick_config(qtype, M, N, K, 132)
    assert cfg.mma, cfg
    kernel = gguf_mma._gemm_mma_kernel
    sig = dict(xq_ptr="*i8", xd_ptr="*fp32", xs_ptr="*fp32", w8_ptr="*i8", w32_ptr="*i32", y_ptr="*bf16",
               part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", nb="i32", blocks_per_split="i32",
               stride_wn="i32", stride_ym="i32")
    # PDL as gguf_linear_mma launches it: not for programs of MMA_PDL_MAX_BLOCKS super-blocks or more
    nb = K // 256
    blocks_per_split = triton.cdiv(triton.cdiv(nb, cfg.split_k), cfg.kbs) * cfg.kbs
    pdl = int(blocks_per_split < gguf_mma.MMA_PDL_MAX_BLOCKS)
    const = dict(QTYPE=qtype, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT_K=cfg.split_k, EMULATE=False, PDL=pdl,
                 KBS=cfg.kbs)
    sass, usage = _sass(_compile(kernel, sig, const, ("xq_ptr", "w8_ptr", "w32_ptr", "y_ptr", "stride_wn"),
                                 cfg.num_warps, cfg.stages))
    ops = collections.Counter(_loop_body(sass))
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    # one m16n8k32 IMMA per 16 weight rows, 8 activation rows and 32 K per warp (or warpgroup MMAs)
    imma = cfg.kbs * cfg.block_n * cfg.block_m * 256 // (16 * 8 * 32 * cfg.num_warps)
    assert ops["IMMA.16832.S8.S8.SAT"] == imma or any(o.startswith("IGMMA") for o in ops), ops.most_common(12)
    weights = cfg.kbs * cfg.block_n * 256 / (32 * cfg.num_warps)  # per thread and K step (kbs super-blocks)
    per_weight = sum(ops.values()) / weights
    assert per_weight <= MMA_BUDGET[qtype], (per_weight, ops.most_common(10))



#: Max SASS instructions per weight in the K loop of the split-row tensor-core GEMM at 16 rows: measured (Triton 3.8)
#: Q8_0 3.38 (lm_head's 64 rows on 2 warps, the launch until session 34) / 5.11 (gate/up's 4 warps, 2 stages, now
#: lm_head's too), Q4_0 3.92 / 6.09, Q6_K 4.60 / 5.67,
#: plus ~15 % (dp4a split rows at 16 rows: ``SPLIT_BUDGET``)
SPLIT_MMA_BUDGET = {g.Q8_0: 5.9, g.Q4_0: 7.0, g.Q6_K: 6.6}


@pytest.mark.parametrize("N", (2048, 19360))
@pytest.mark.parametrize("qtype", sorted(SPLIT_MMA_BUDGET), ids=lambda q: g._NAMES[q])
def test_split_rows_mma_kernel_uses_int8_tensor_cores_within_budget(qtype, N):
    """The split-row tensor-core GEMM at pick_split_config's 16-row launch (expert gate/up and lm_head/8): s8 x s8
    MMAs in the K loop (Q8_0 one per 16 x 8 x 32 product, Q4_0 / Q6_K two: each code tile meets two half-masked
    activation tiles), no spills, and SPLIT_MMA_BUDGET instructions per weight at most."""
    sp = importlib.import_module("glm5serve.kernels.gguf_split")
    from glm5serve.kernels import gguf_mma

    cfg = sp.pick_split_config(sp.split_type(qtype), 16, N, 6144, 132)
    assert cfg.mma, cfg
    sig = dict(xq_ptr="*i8", xd_ptr="*fp32", w_ptr="*i8", y_ptr="*bf16", part_ptr="*fp32", count_ptr="*i32",
               M="i32", N="i32", ng="i32", groups_per_split="i32", stride_wn="i32", stride_ym="i32")
    kernel = gguf_mma._gemm_split_mma_kernel
    const = dict(QTYPE=qtype, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT_K=cfg.split_k, EMULATE=False, PDL=1,
                 GROUPS=cfg.kbs)
    sass, usage = _sass(_compile(kernel, sig, const, ("xq_ptr", "w_ptr", "y_ptr", "stride_wn", "ng"), cfg.num_warps,
                                 cfg.stages))
    ops = collections.Counter(_loop_body(sass))
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    imma = cfg.kbs * cfg.block_n * cfg.block_m // (16 * 8 * cfg.num_warps) * (1 if qtype == g.Q8_0 else 2)
    assert ops["IMMA.16832.S8.S8.SAT"] == imma or any(o.startswith("IGMMA") for o in ops), ops.most_common(12)
    weights = cfg.kbs * cfg.block_n * 32 / (32 * cfg.num_warps)  # per thread and K step
    per_weight = sum(ops.values()) / weights
    assert per_weight <= SPLIT_MMA_BUDGET[qtype], (per_weight, ops.most_common(10))

def test_moe_q8_kernels_use_dp4a_without_spills():
    """The per-pair MoE's int8-activation kernels at their production tiles (Q4_K gate+up: gate and up rows
    interleaved in one K loop, ``_gate_up_tile``'s two tiles; down: the slot loop with 16 rows and the slots side by
    side, ``_slots_tile`` at top-8, 32 and 64), compiled for PDL: two IDP.4A per weight code word of a K step, over the
    program's threads, no spills, and ``griddepcontrol.wait`` before the first global load (in the PTX).  They
    use the one-row step, whose sum over words shuffles: measured faster here than the
    shuffle-free rows step at one row (H200, whole experts, 1 token: 123 against 132 us)."""
    kbs = gm.MOE_Q8_KBS
    common = dict(w_ptr="*i32", ids_ptr="*i32", nb="i32", topk="i32", E="i32", stride_we="i32", stride_wn="i32")
    down_sig = dict(hw_ptr="*i32", hd_ptr="*fp32", hs_ptr="*fp32", wts_ptr="*fp32", y_ptr="*bf16", hidden="i32",
                    stride_ym="i32", **common)
    kernels = []  # (compiled, rows of a K step, super-blocks per step, warps)
    for bn, warps in {gm._gate_up_tile(8, 256, 132), gm._gate_up_tile(8, 2048, 132)}:
        up = _compile(gm._moe_gate_up_q8_kernel, dict(xw_ptr="*i32", xd_ptr="*fp32", xs_ptr="*fp32", h_ptr="*fp32",
                                                      inter="i32", stride_hm="i32", **common),
                      dict(BLOCK_N=bn, KBS=kbs, EMULATE=False, PDL=True), ("xw_ptr", "w_ptr", "h_ptr"),
                      num_warps=warps)
        kernels.append((up, 2 * bn, kbs, warps))
    kernels.append((_compile(gm._moe_down_q8_kernel, down_sig, dict(BLOCK_N=16, KBS=kbs, EMULATE=False, PDL=True),
                             ("hw_ptr", "w_ptr", "y_ptr")), 16, kbs, 4))
    for topk in (8, 32, 64):  # GLM-5's top-8, and wider ones, whose rows per slot shrink (8 x 32 spilled)
        slots, bn, skbs, warps = gm._slots_tile(topk)
        kernels.append((_compile(gm._moe_down_q8_slots_kernel, down_sig, dict(SLOTS=slots, BLOCK_N=bn, KBS=skbs,
                                                                               EMULATE=False, PDL=True),
                                 ("hw_ptr", "w_ptr", "y_ptr"), num_warps=warps), slots * bn, skbs, warps))
    for k, rows, step_kbs, warps in kernels:
        sass, usage = _sass(k)
        assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
        # per K step of `rows` rows x step_kbs super-blocks (36 words, 32 of codes): 2 dp4a per code word
        assert sass.count("IDP.4A.S8.S8") == 2 * rows * step_kbs * 32 // (32 * warps), (rows, warps, usage)
        # launched with PDL, a kernel must wait for the one before ahead of its first global load (ids, x, h)
        ptx = k.asm["ptx"]
        assert -1 < ptx.find("griddepcontrol.wait") < ptx.find("ld.global"), k.name


def test_activation_quantizer_compiles_without_spills():
    q8 = importlib.import_module("glm5serve.kernels.gguf_gemv_q8")
    for sums16 in (False, True):
        quant = _compile(q8._quantize_x_kernel, dict(x_ptr="*bf16", xq_ptr="*i8", xd_ptr="*fp32", xs_ptr="*fp32",
                                                      xi_ptr="*i32", K="i32", stride_xm="i32"),
                         dict(BLOCKS=8, SUMS16=sums16), ("x_ptr", "xq_ptr"))
        assert int(re.search(r"STACK:(\d+)", _sass(quant)[1]).group(1)) == 0


#: split-row GEMV (``gguf_split``) at its production tile for a 2048 x 6144 weight, SASS instructions per weight in
#: the K loop, measured (triton 3.8) at M = 1, 2, 4, 8, 16: Q8_0 2.0, 2.6, 3.8, 5.1, 8.3; Q4_0 1.8, 1.7, 2.6, 4.9,
#: 8.5; Q5_0 2.8, 3.4, 4.6, 6.5, 9.3 (2.55 at one row from session 19's tile); Q6_K 2.8, 3.6, 4.8, 9.1, 11.8, and
#: with session 19's tiles 3.05, 3.25, 4.3, 7.05, 11.2 (the fp32 decode of GGUF rows it replaces: 8.2-11.4 at one
#: row).  At one row with session 20's tile (4 rows, kbs 64, loads one step ahead, which add register moves and
#: took less time: ``gguf_split._SPLIT_ROW_TILES``): Q8_0 2.23, Q4_0 2.12, Q5_0 3.33, Q6_K 3.42; session 21's one-row
#: step (``gguf_split._load_row``, no layout conversions of the codes' operands): Q8_0 1.75, Q4_0 1.66, Q5_0 2.94 (Triton
#: 3.6: 2.50, 2.09, 3.66, against 2.80, 3.12, 4.34).  Budgets: +15 %, or the earlier budget where that is tighter.
SPLIT_BUDGET = {g.Q8_0: (2.6, 3.0, 4.4, 5.9, 9.5), g.Q4_0: (2.45, 2.0, 3.0, 5.6, 9.7),
                g.Q5_0: (3.85, 3.9, 5.3, 7.5, 10.4), g.Q6_K: (3.95, 3.7, 4.9, 8.1, 12.9)}


def _split_dp4a_config(sp, qtype: int, M: int):
    """pick_split_config's dp4a launch at M rows; from SPLIT_MMA_MIN_M rows, where Q8_0 / Q4_0 / Q6_K go to the
    tensor cores, the same tile given explicitly (the dp4a kernel still runs it, and Q5_0 there)."""
    tile = sp._SPLIT_TILE[qtype][2] if M >= sp.SPLIT_MMA_MIN_M else None
    return sp.pick_split_config(sp.split_type(qtype), M, 2048, 6144, 132, tile)


@pytest.mark.parametrize("M", (1, 2, 4, 8, 16))
@pytest.mark.parametrize("qtype", sorted(SPLIT_BUDGET), ids=lambda q: g._NAMES[q])
def test_split_rows_kernel_uses_dp4a_within_budget(qtype, M):
    """The split-row GEMV at pick_split_config's launch: one IDP.4A per 4 weights and activation row in the K loop
    (the codes are consecutive int32 words), 16-byte weight loads, no spills, no shuffles, and the budget above."""
    sp = importlib.import_module("glm5serve.kernels.gguf_split")
    c = _split_dp4a_config(sp, qtype, M)
    sig = dict(xw_ptr="*i32", xd_ptr="*fp32", w_ptr="*i32", y_ptr="*bf16", part_ptr="*fp32",
               count_ptr="*i32", M="i32", N="i32", nb="i32", blocks_per_split="i32", stride_wn="i32", stride_ym="i32")
    k = _compile(sp._gemv_split_kernel, sig, dict(QTYPE=qtype, BLOCK_M=c.block_m, BLOCK_N=c.block_n, KBS=c.kbs,
                                                  SPLIT_K=c.split_k, EMULATE=False, AHEAD=c.ahead),
                 ("xw_ptr", "w_ptr", "y_ptr", "stride_wn", "nb"), c.num_warps)
    sass, usage = _sass(k)
    ops = collections.Counter(_loop_body(sass))
    assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0, usage
    weights = c.block_n * c.kbs * 32 / (32 * c.num_warps)  # per thread and K step
    assert ops["IDP.4A.S8.S8"] == M * weights / 4, ops.most_common(8)
    assert any(o.startswith("LDG.E") and o.endswith(".128") for o in ops), ops.most_common(12)
    if M == 1 and qtype != g.Q8_0 or M > 1:
        assert not any(o.startswith("SHFL") for o in ops), ops.most_common(12)
    else:  # a Q8_0 block's 8 code words span 2 lanes at one row (``_dot_row``): one butterfly per block sum
        assert ops["SHFL.BFLY"] <= c.block_n * c.kbs / (32 * c.num_warps) * 2, ops.most_common(12)
    if M == 1 and qtype != g.Q6_K:
        # one activation row: loads shaped like the code words, so at most Q5_0's qh words and the accumulator go
        # through shared memory (``gguf_split._load_row``; the [BM, BN, KBS] step had 8-24 barriers per K step)
        assert ops["BAR.SYNC.DEFER_BLOCKING"] <= (4 if qtype == g.Q5_0 else 2), ops.most_common(12)
    per_weight = sum(ops.values()) / weights
    assert per_weight <= SPLIT_BUDGET[qtype][(1, 2, 4, 8, 16).index(M)], (per_weight, ops.most_common(8))


def test_split_rows_dequant_kernel_compiles_without_spills():
    """The split rows' STORE kernel (batches past 16 rows) without spills; Q6_K's stores the weights 16 bytes at a
    time (H200, session 19, lm_head/8: 115.8 us; 360 with the 8-byte stores of weights left in code-word order)."""
    sp = importlib.import_module("glm5serve.kernels.gguf_split")
    for qtype in sorted(SPLIT_BUDGET):
        bn, kbs, warps = sp._DEQUANT_TILE[qtype]
        k = _compile(sp._dequant_split_kernel, dict(w_ptr="*u8", out_ptr="*bf16", N="i32", nb="i32", stride_wn="i32",
                                                    stride_on="i32"),
                     dict(QTYPE=qtype, BLOCK_N=bn, KBS=kbs), ("w_ptr", "out_ptr", "stride_wn", "stride_on"), warps)
        sass, usage = _sass(k)
        assert int(re.search(r"STACK:(\d+)", usage).group(1)) == 0
        if qtype == g.Q6_K:
            stores = [o for o in _opcodes(sass) if o.startswith("STG")]
            assert stores and all(o == "STG.E.128" for o in stores), stores


def _split_kernel(qtype: int, M: int, pdl: int = 0):
    sp = importlib.import_module("glm5serve.kernels.gguf_split")
    c = _split_dp4a_config(sp, qtype, M)
    sig = dict(xw_ptr="*i32", xd_ptr="*fp32", w_ptr="*i32", y_ptr="*bf16", part_ptr="*fp32",
               count_ptr="*i32", M="i32", N="i32", nb="i32", blocks_per_split="i32", stride_wn="i32", stride_ym="i32")
    return _compile(sp._gemv_split_kernel, sig, dict(QTYPE=qtype, BLOCK_M=c.block_m, BLOCK_N=c.block_n, KBS=c.kbs,
                                                     SPLIT_K=c.split_k, EMULATE=False, PDL=pdl, AHEAD=c.ahead),
                    ("xw_ptr", "w_ptr", "y_ptr", "stride_wn", "nb"), c.num_warps)


def _opcodes(sass: str) -> list[str]:
    return [re.sub(r"^@!?U?P\w+\s+", "", i).split()[0] for i in re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", sass)]


def _pdl_kernels(pdl: int):
    """(name, compiled kernel) of every GEMV launched with programmatic dependent launch, with PDL = ``pdl``."""
    q8 = importlib.import_module("glm5serve.kernels.gguf_gemv_q8")
    fma = g.pick_config(g.Q4_K, 1, 2048, 2048, 132)  # below Q8_MIN_BYTES_M1: the one-kernel FMA path
    G, T = g.tile_shape(g.Q4_K, fma.kbs)
    const = dict(QTYPE=g.Q4_K, BLOCK_M=1, BLOCK_N=fma.block_n, KBS=fma.kbs, G=G, T=T, USE_DOT=False, SPLIT_K=4, PDL=pdl)
    out = [("fma Q4_K", _compile(g._gemv_kernel, _gemv_sig(g.Q4_K), const, ("x_ptr", "w_ptr", "y_ptr", "stride_wn"),
                                 fma.num_warps))]
    for qtype in (g.Q6_K, g.Q8_0):  # the tensor cores, with the in-loop L2 prefetch of large weights
        dot = g.pick_config(qtype, 16, 19360, 6144, 132)
        assert dot.use_dot and dot.prefetch, dot
        G, T = g.tile_shape(qtype, dot.kbs)
        out.append((f"dot {g._NAMES[qtype]}", _compile(
            g._gemv_kernel, _gemv_sig(qtype), dict(QTYPE=qtype, BLOCK_M=16, BLOCK_N=dot.block_n, KBS=dot.kbs, G=G, T=T,
                                                   USE_DOT=True, SPLIT_K=dot.split_k, PREFETCH=dot.prefetch, PDL=pdl),
            ("x_ptr", "w_ptr", "y_ptr", "stride_wn"), dot.num_warps)))
    q8sig = dict(xw_ptr="*i32", xd_ptr="*fp32", xs_ptr="*fp32", xi_ptr="*i32", w_ptr="*i32", y_ptr="*bf16",
                 part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", nb="i32", blocks_per_split="i32",
                 stride_wn="i32", stride_ym="i32")
    for qtype, M in ((g.Q4_K, 1), (g.Q5_K, 4), (g.Q6_K, 4)):
        c = g.pick_config(qtype, M, 512 if qtype == g.Q5_K else 2048, 6144, 132)  # Q5_K's 2048 rows: gguf_mma
        assert c.q8, c
        out.append((f"q8 {g._NAMES[qtype]} M{M}", _compile(
            q8._gemv_q8_kernel, q8sig, dict(QTYPE=qtype, BLOCK_M=c.block_m, BLOCK_N=c.block_n, KBS=c.kbs, SPLIT_K=3,
                                            PREFETCH=0, EMULATE=False, AHEAD=c.ahead, PDL=pdl),
            ("xw_ptr", "w_ptr", "y_ptr", "stride_wn"), c.num_warps)))
    out += [(f"split {g._NAMES[q]} M{m}", _split_kernel(q, m, pdl)) for q in sorted(SPLIT_BUDGET) for m in (1, 4)]
    mma = importlib.import_module("glm5serve.kernels.gguf_mma")
    msig = dict(xq_ptr="*i8", xd_ptr="*fp32", xs_ptr="*fp32", w8_ptr="*i8", w32_ptr="*i32", y_ptr="*bf16",
                part_ptr="*fp32", count_ptr="*i32", M="i32", N="i32", nb="i32", blocks_per_split="i32",
                stride_wn="i32", stride_ym="i32")
    for qtype, M, K in ((g.Q4_K, 16, 6144), (g.Q5_K, 8, 6144), (g.Q4_K, 16, 2048)):  # the last: 2 blocks per step
        c = g.pick_config(qtype, M, 2048, K, 132)
        out.append((f"mma {g._NAMES[qtype]} M{M} K{K}", _compile(
            mma._gemm_mma_kernel, msig, dict(QTYPE=qtype, BLOCK_M=c.block_m, BLOCK_N=c.block_n, SPLIT_K=c.split_k,
                                             EMULATE=False, PDL=pdl, KBS=c.kbs),
            ("xq_ptr", "w8_ptr", "w32_ptr", "y_ptr", "stride_wn"), c.num_warps)))
    return out


@pytest.mark.parametrize("pdl", (1, 2), ids=("wait", "prefetch"))
def test_pdl_kernels_read_nothing_before_the_wait(pdl):
    """A GEMV launched with programmatic dependent launch may run while the kernel before it still writes x (and
    still reads memory that this GEMV's outputs reuse): before its one ``griddepcontrol.wait`` (SASS ``ACQBULK``) it
    loads and stores nothing, and with prefetch steps (PDL > 1) it only asks L2 for weight lines (``CCTL.E.PF2``).
    The activation quantizer lets the GEMV start (``PREEXIT``) before it waits for its own x; PDL = 0 emits
    neither instruction."""
    q8 = importlib.import_module("glm5serve.kernels.gguf_gemv_q8")
    qsig = dict(x_ptr="*bf16", xq_ptr="*i8", xd_ptr="*fp32", xs_ptr="*fp32", xi_ptr="*i32", K="i32",
                stride_xm="i32")
    memory = ("LD", "ST", "ATOM", "RED", "UTMA", "UBLKCP")  # LDG, STG, LDS, LDC is a constant, not memory
    for sums16 in (False, True):
        quant = _opcodes(_sass(_compile(q8._quantize_x_kernel, qsig, dict(BLOCKS=8, SUMS16=sums16, PDL=True),
                                        ("x_ptr", "xq_ptr")))[0])
        assert quant.count("ACQBULK") == 1 and "PREEXIT" in quant[:quant.index("ACQBULK")]
        assert not any(o.startswith(memory) and not o.startswith("LDC") for o in quant[:quant.index("ACQBULK")])
        plain = _opcodes(_sass(_compile(q8._quantize_x_kernel, qsig, dict(BLOCKS=8, SUMS16=sums16),
                                        ("x_ptr", "xq_ptr")))[0])
        assert "ACQBULK" not in plain and "PREEXIT" not in plain
    for name, k in _pdl_kernels(pdl):
        ops = _opcodes(_sass(k)[0])
        assert ops.count("ACQBULK") == 1, name
        before = ops[:ops.index("ACQBULK")]
        # the prologue has no branch, so SASS text order is issue order up to the wait
        assert not any(o.startswith("BRA") for o in before), (name, before)
        assert not any(o.startswith(memory) and not o.startswith("LDC") for o in before), (name, before)
        prefetches = sum(o.startswith("CCTL.E.PF2") for o in before)
        assert (prefetches > 0) == (pdl > 1), (name, prefetches)
    for name, k in _pdl_kernels(0):
        ops = _opcodes(_sass(k)[0])
        assert "ACQBULK" not in ops and "PREEXIT" not in ops, name

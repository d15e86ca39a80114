"""The GGUF Triton kernels run on the CPU through Triton's interpreter, against gguf-py's dequantizer + fp64 matmul.

``TRITON_INTERPRET=1`` must be set before triton is imported, so outside the interpreter this file holds one test
that re-runs the file in a fresh interpreter process.  Shapes are tiny (the interpreter runs programs one by one)
but cover partial row tiles, partial K steps, split-K, several M tiles, padded and sliced weights, both the FMA
and the tensor-core (``tl.dot``) paths, and every supported type.  Every load and store is bounds-checked
(``testing.triton_interpret.check_bounds``): a read past a tensor's view whose value no output keeps (a row clamp or
an activation-row mask removed) fails here, where on a GPU only a memory checker would see it.

The interpreter's ``tl.dot`` multiplies bf16 operands as raw 16-bit integers (triton 3.8
``InterpreterBuilder.create_dot``): below, bf16 operands are widened to fp32 first, which is what the GPU's bf16 MMA
computes (exact products, fp32 sums).  Its fp32->bf16 conversion truncates, hence a one-ulp budget for bf16 outputs.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":
    import atexit
    import tempfile

    _run: tuple[subprocess.Popen, object] | None = None

    def start_in_background() -> None:
        """Start the interpreted run now (tests/conftest.py calls this once collection has selected the test below).

        It is one single-threaded process for ~15 minutes on a 2-core CI machine; started at collection, it runs
        beside the rest of the suite instead of after it. Output goes to a temporary file (a pipe could fill and
        stall the child). A run still going when pytest exits is killed."""
        global _run
        if _run is not None:
            return
        log = tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-x",
                                 "-p", "no:cacheprovider"], cwd=Path(__file__).resolve().parents[2],
                                env={**os.environ, "TRITON_INTERPRET": "1"}, stdout=log, stderr=subprocess.STDOUT,
                                text=True)
        atexit.register(proc.kill)
        _run = (proc, log)

    def test_kernels_under_triton_interpreter():
        start_in_background()  # no-op when conftest.py already started it
        proc, log = _run
        try:
            rc = proc.wait(timeout=2400)  # a hang guard: the file takes about 1,050 s alone on a 2-core CI-like machine
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout (2400 s)"
        log.seek(0)
        out = log.read()
        assert rc == 0, f"interpreted kernel tests failed ({rc}):\n{out[-15000:]}"

    def test_bf16_is_exact_under_the_interpreter_without_test_setup():
        """A user running the kernels on CPU tensors under the interpreter gets the GPU's numbers in bf16 too: the
        kernel modules widen bf16 ``tl.dot`` operands on import (triton-lang/triton#11584). Fresh-user finding: the
        tensor-core paths returned values around 1e11, with no error. No test helper is called here."""
        code = """
import torch
from gguf import GGMLQuantizationType as Q
from glm5serve.dequant import dequantize
from glm5serve.kernels import gguf_linear
from glm5serve.mla.testing import make_batch
from glm5serve.mla.triton_mla import mla_decode, mla_reference
from glm5serve.quantize import quantize
g = torch.Generator().manual_seed(0)
w = quantize(torch.randn(32, 256, generator=g).numpy(), Q.Q4_K)
x = torch.randn(4, 256, generator=g).bfloat16()
ref = x.float() @ dequantize(w, Q.Q4_K).T
got = gguf_linear(x, torch.from_numpy(w), Q.Q4_K, 32).float()
assert (got - ref).abs().max() <= 0.05 * ref.abs().max(), ((got - ref).abs().max(), ref.abs().max())
b = make_batch([20, 9], [1, 1], 4, 32, 16, 8, torch.bfloat16)
out, _ = mla_decode(b.q_nope, b.q_pe, b.kv_cache, b.scale, **b.decode_kwargs())
want, _ = mla_reference(b.q_nope, b.q_pe, b.kv_cache, b.scale, **b.decode_kwargs())
assert (out.float() - want.float()).abs().max() < 0.05, (out.float() - want.float()).abs().max()
print("ok")
"""
        r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRITON_INTERPRET": "1"},
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout[-3000:] + r.stderr[-3000:]

else:
    import dataclasses

    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as Q
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from glm5serve.kernels import GemvConfig, gguf_linear, gguf_moe, pick_config, supports, supports_moe
    from glm5serve.kernels.gguf_gemv import BLOCK_SIZES, _counters
    from glm5serve.kernels.testing import dequant, random_qweight, reference_linear, reference_moe
    from glm5serve.quantize import quantize

    from glm5serve.testing.triton_interpret import check_bounds
    from glm5serve.triton_interpreter import patch_bf16_dot

    patch_bf16_dot()
    check_bounds()  # every load and store of every kernel below stays inside its launch's tensors

    TYPES = (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
    FP32_EPS = 2.0 ** -20  # fp32 accumulation over <= 1024 terms, with margin

    def _check(y, ref, bound, rel_out=0.0, rel_sum=FP32_EPS, what=""):
        """|y - ref| <= rel_out * |ref| + rel_sum * (|x| @ |W|.T): output rounding plus accumulated rounding.

        With fp32 inputs rel_sum is ~1e-6, far below the 1/K share of any single weight, so one wrongly decoded
        code anywhere in a row fails the test."""
        err = (y.detach().cpu().double() - ref).abs()
        tol = rel_out * ref.abs() + rel_sum * bound + 1e-30
        worst = (err / tol).max().item()
        assert worst <= 1.0, f"{what}: error {err.max().item():.3g} is {worst:.3g}x the budget"

    def _case(qtype, M, N, K, seed, dtype=torch.float32, pad=0):
        rng = np.random.default_rng(seed)
        raw = random_qweight(qtype, N, K, rng)
        if pad:
            raw = np.concatenate([raw, rng.integers(0, 256, (N, pad), dtype=np.uint8)], axis=1)
        x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32)).to(dtype)
        ref, bound = reference_linear(x, dequant(raw[:, :raw.shape[1] - pad], qtype))
        return x, torch.from_numpy(raw), ref, bound

    def _k(qtype, blocks):
        return BLOCK_SIZES[int(qtype)][0] * blocks

    @pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
    def test_gemv_matches_gguf_py_fp32(qtype):
        """Default config, plus split-K over 2 programs with one block per step; 19 rows (a partial row tile) and
        3 blocks per row (a partial K step)."""
        x, w, ref, bound = _case(qtype, M=3, N=19, K=_k(qtype, 3), seed=int(qtype))
        _check(gguf_linear(x, w, qtype, 19), ref, bound, what="default")
        split = GemvConfig(block_n=8, kbs=1, split_k=3)
        for _ in range(2):  # the split-K tile counters must be left at zero for the next call
            _check(gguf_linear(x, w, qtype, 19, split), ref, bound, what="split-K")
        assert not _counters[torch.device("cpu")][0].any()

    @pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
    def test_gemv_bf16_activations(qtype):
        """M = 1 (FMA path, fp32 sums of exact products) and M = 3 (tensor cores, weights rounded to bf16)."""
        for M, rel_sum in ((1, FP32_EPS), (3, 2.0 ** -8)):
            x, w, ref, bound = _case(qtype, M=M, N=5, K=_k(qtype, 2), seed=10 + int(qtype), dtype=torch.bfloat16)
            y = gguf_linear(x, w, qtype, 5)
            assert y.dtype == torch.bfloat16 and y.shape == (M, 5)
            _check(y, ref, bound, rel_out=2.0 ** -7, rel_sum=rel_sum, what=f"bf16 M={M}")

    @pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=str)
    @pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
    def test_gemv_tensor_core_path(qtype, dtype):
        """M = 9 takes the tl.dot path (x padded to 16 rows) past the int8 path's batches (Q8_MAX_M), on a GPU for
        every type but Q4_K and Q5_K (the int8 tensor cores, ``gguf_mma``) and for all of them under the
        interpreter; weights are rounded to x's dtype before the dot."""
        x, w, ref, bound = _case(qtype, M=9, N=17, K=_k(qtype, 2), seed=20 + int(qtype), dtype=dtype)
        assert pick_config(qtype, 9, 17, x.shape[1], dtype=dtype, device_name="cpu").use_dot
        gpu = pick_config(qtype, 9, 17, x.shape[1], dtype=dtype)
        assert (gpu.mma, gpu.use_dot) == ((True, False) if qtype in (Q.Q4_K, Q.Q5_K) else (False, True))
        eps = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
        _check(gguf_linear(x, w, qtype, 17), ref, bound, rel_out=eps, rel_sum=eps, what="dot")

    @pytest.mark.parametrize("pad", (16, 2, 1))
    @pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q6_K, Q.Q5_0, Q.Q8_0), ids=lambda q: q.name)
    def test_gemv_padded_sliced_weight_and_m_tiles(qtype, pad):
        """Rows with trailing padding bytes (the plugin's merged weights; 2 bytes leave Q4_K rows that are not
        whole int32 words, 1 byte leaves rows of the other types that are not whole uint16 pairs), a row slice
        (storage offset), and M = 7 on the FMA path (two M tiles of 4) and, for Q4_K and Q6_K (whose int32 view of
        rows padded by 1 or 2 bytes is a copy), on the int8-activation path."""
        x, w, ref, bound = _case(qtype, M=7, N=12, K=_k(qtype, 2), seed=30 + int(qtype), pad=pad)
        sliced = w[3:11]
        y = gguf_linear(x, sliced, qtype, 8, GemvConfig(block_n=4, kbs=1, split_k=2, use_dot=False))
        _check(y, ref[:, 3:11], bound[:, 3:11], what="sliced")
        if qtype in (Q.Q4_K, Q.Q6_K):
            from glm5serve.kernels.testing import q8_activation_bound

            xb, rows = x.to(torch.bfloat16), sliced[:, :sliced.shape[1] - pad]
            ref8, bound8 = reference_linear(xb.float(), dequant(rows.numpy(), qtype))
            y8 = gguf_linear(xb, sliced, qtype, 8, GemvConfig(block_n=4, kbs=2, split_k=2, q8=True))
            err = (y8.double() - ref8).abs()
            assert (err <= q8_activation_bound(xb, rows, qtype) + 2.0 ** -7 * ref8.abs() + FP32_EPS * bound8).all()

    @settings(max_examples=12, deadline=None)
    @given(qtype=st.sampled_from(TYPES), M=st.integers(1, 6), N=st.integers(1, 33), blocks=st.integers(1, 3),
           block_n=st.sampled_from((4, 8, 16)), kbs=st.sampled_from((1, 2, 4)), split_k=st.integers(1, 3),
           seed=st.integers(0, 2**16))
    def test_gemv_drawn_shapes_and_configs(qtype, M, N, blocks, block_n, kbs, split_k, seed):
        x, w, ref, bound = _case(qtype, M, N, _k(qtype, blocks), seed)
        y = gguf_linear(x, w, qtype, N, GemvConfig(block_n=block_n, kbs=kbs, split_k=split_k))
        _check(y, ref, bound, what=f"{qtype.name} M={M} N={N} blocks={blocks}")

    def _moe_case(q13, q2, H, inter, seed):
        """3 tokens, top-2 of 3 experts, a repeated expert and a negative id (expert not on this rank): fp32 x,
        (w13, w2) raw numpy expert stacks, routing ids and weights."""
        rng = np.random.default_rng(seed)
        w13 = np.stack([random_qweight(q13, 2 * inter, H, rng) for _ in range(3)])
        w2 = np.stack([random_qweight(q2, H, inter, rng) for _ in range(3)])
        x = torch.from_numpy(rng.standard_normal((3, H)).astype(np.float32))
        ids = torch.tensor([[0, 2], [1, -1], [2, 2]], dtype=torch.int32)
        wts = torch.from_numpy(rng.uniform(0.1, 1, (3, 2)).astype(np.float32))
        return x, w13, w2, ids, wts

    @pytest.mark.parametrize("q13,q2", [(Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q5_0)], ids=lambda q: q.name)
    def test_moe_matches_reference(q13, q2):
        """The per-pair path with the fp32 decode (fp32 x) on ``_moe_case``."""
        x, w13, w2, ids, wts = _moe_case(q13, q2, _k(q13, 1), _k(q2, 1), int(q13) * 16 + int(q2))
        y = gguf_moe(x, torch.from_numpy(w13), torch.from_numpy(w2), wts, ids, q13, q2)
        ref, bound = reference_moe(x, dequant(w13, q13), dequant(w2, q2), wts, ids)
        _check(y, ref, bound, rel_sum=2.0 ** -18, what="moe")

    @pytest.mark.parametrize("q2,slots_max,topk", [(Q.Q4_K, None, 3), (Q.Q4_K, 0, 3), (Q.Q6_K, None, 3),
                                                   (Q.Q4_K, None, 16)],
                             ids=["Q4_K-slots-side-by-side", "Q4_K-slot-loop", "Q6_K", "Q4_K-top-16"])
    def test_moe_q8_computes_its_int8_model(q2, slots_max, topk, monkeypatch):
        """The int8-activation per-pair MoE (Q4_K gate+up; down too when w2 is Q4_K, else the fp32 decode), dp4a
        emulated, on ``_moe_case`` with a third slot (top-3: the down kernel with slots side by side pads them to
        4) and 3 super-blocks of hidden size (steps of 2: a partial last step); w2 rows of 2 super-blocks take
        the slots side by side (``MOE_Q8_SLOTS_MAX_BLOCKS``), or with ``slots_max`` 0 the slot loop; and one token
        routed top-16 (1 super-block each way: the slots side by side with 4 rows per slot, ``_slots_tile``):
        - within ``q8_moe_bound`` (+ fp32 sums) of the exact MLP, and not bit-equal to q8=False (the path ran);
        - sharp: within fp32 rounding (2^-18 of ``reference_moe``'s bound) plus codes of h at a tie
          (``q8_moe_model``'s ``tie``) of the float64 value of its own int8 arithmetic.  That budget is < 10 % of
          the mean |y|; a wrong token, pair, slot weight, gate/up order or a skipped super-block fails it."""
        from glm5serve.kernels.gguf_gemv_q8 import quantize_activations
        from glm5serve.kernels.testing import q8_moe_bound, q8_moe_model

        if slots_max is not None:
            monkeypatch.setattr("glm5serve.kernels.gguf_topk_moe.MOE_Q8_SLOTS_MAX_BLOCKS", slots_max)
        q13 = Q.Q4_K
        blocks = (3, 2) if topk == 3 else (1, 1)  # super-blocks of H and of the intermediate
        x, w13, w2, ids, wts = _moe_case(q13, q2, _k(q13, blocks[0]), _k(q2, blocks[1]), 100 + int(q2) + topk % 3)
        if topk == 3:
            ids = torch.cat([ids, torch.tensor([[1], [0], [1]], dtype=torch.int32)], dim=1)
            wts = torch.cat([wts, torch.tensor([[0.7], [0.2], [0.4]])], dim=1)
        else:  # repeated experts and two dropped slots, distinct weights
            x, ids = x[:1], torch.tensor([[2, 0, 1, 1, -1, 2, 0, 0, 1, 2, -1, 1, 0, 2, 2, 1]], dtype=torch.int32)
            order = torch.randperm(topk, generator=torch.Generator().manual_seed(3))
            wts = torch.linspace(0.05, 1.0, topk)[order][None]
        args = (x, torch.from_numpy(w13), torch.from_numpy(w2), wts, ids, q13, q2)
        y = gguf_moe(*args, q8=True).double()
        assert not torch.equal(y, gguf_moe(*args, q8=False).double())
        ref, bound = reference_moe(x, dequant(w13, q13), dequant(w2, q2), wts, ids)
        assert ((y - ref).abs() <= q8_moe_bound(x, w13, w2, q13, q2, wts, ids) + 2.0 ** -18 * bound).all()
        model, tie = q8_moe_model(x, *quantize_activations(x)[:2], w13, w2, q13, q2, wts, ids)
        tol = 2.0 ** -18 * bound + tie
        assert ((y - model).abs() <= tol).all(), ((y - model).abs() / tol).max()
        assert tol.max() < 0.1 * ref.abs().mean()

    @pytest.mark.parametrize("q8,slots_max", [(False, None), (True, None), (True, 0)],
                             ids=["fp32-decode", "q8-slots-side-by-side", "q8-slot-loop"])
    def test_moe_dropped_slot_weight_is_ignored(q8, slots_max, monkeypatch):
        """A dropped slot (id -1: its expert on another rank; or >= E) contributes nothing whatever its routing
        weight: inf or NaN there gives the output bit-identical to weight 0 on every per-pair down kernel (it used
        to enter as wt * 0 = NaN)."""
        if slots_max is not None:
            monkeypatch.setattr("glm5serve.kernels.gguf_topk_moe.MOE_Q8_SLOTS_MAX_BLOCKS", slots_max)
        x, w13, w2, ids, wts = _moe_case(Q.Q4_K, Q.Q4_K, _k(Q.Q4_K, 1), _k(Q.Q4_K, 1), 120)
        ids[2, 0] = 3  # >= E: dropped too
        outs = []
        for bad in (0.0, float("inf"), float("nan")):
            w = wts.clone()
            w[1, 1] = w[2, 0] = bad
            outs.append(gguf_moe(x, torch.from_numpy(w13), torch.from_numpy(w2), w, ids, Q.Q4_K, Q.Q4_K, q8=q8))
        assert outs[0].isfinite().all() and outs[0].abs().amax() > 0
        assert torch.equal(outs[1], outs[0]) and torch.equal(outs[2], outs[0])

    def test_moe_q8_is_ignored_for_other_types():
        """q8=True with no Q4_K projection runs the fp32 decode: bit-identical to q8=False."""
        rng = np.random.default_rng(110)
        w13 = np.stack([random_qweight(Q.Q5_K, 2 * 32, 256, rng) for _ in range(2)])
        w2 = np.stack([random_qweight(Q.Q8_0, 256, 32, rng) for _ in range(2)])
        x = torch.from_numpy(rng.standard_normal((2, 256)).astype(np.float32)).to(torch.bfloat16)
        args = (x, torch.from_numpy(w13), torch.from_numpy(w2), torch.ones(2, 2), torch.tensor([[0, 1], [1, 0]]),
                Q.Q5_K, Q.Q8_0)
        assert torch.equal(gguf_moe(*args, q8=True), gguf_moe(*args, q8=False))

    @pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q6_K, Q.Q8_0), ids=lambda q: q.name)
    def test_gemm_past_decode_rows(qtype):
        """M = 40 (17..MAX_GEMM_M: tensor-core tiles of block_m = 64 rows, one partial) and M = 20 with block_m 32
        and split-K: decode batches past 16 requests."""
        for M, cfg in ((40, None), (20, GemvConfig(block_n=32, kbs=1, split_k=2, use_dot=True, block_m=32))):
            x, w, ref, bound = _case(qtype, M=M, N=33, K=_k(qtype, 2), seed=40 + M + int(qtype),
                                     dtype=torch.bfloat16)
            if cfg is None:
                assert pick_config(qtype, M, 33, x.shape[1]).block_m == 64
            _check(gguf_linear(x, w, qtype, 33, cfg), ref, bound, rel_out=2.0 ** -7, rel_sum=2.0 ** -7,
                   what=f"M={M}")

    @pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
    def test_dequantize_rows_and_the_cublas_path(qtype):
        """dequantize_rows (the decoder's STORE path) equals gguf-py's dequantizer in fp32 (torch.equal: each
        weight rounded once, in gguf-py's arithmetic; +0 and -0 count as equal) and within one bf16 ulp; gguf_linear past 16 rows (dequantize +
        matmul, in chunks) matches the reference."""
        from glm5serve.kernels import gguf_gemv
        from glm5serve.kernels.gguf_gemv import dequantize_rows

        rng = np.random.default_rng(50 + int(qtype))
        K = _k(qtype, 3)
        raw = random_qweight(qtype, 21, K, rng)
        ref = dequant(raw, qtype)
        w32 = dequantize_rows(torch.from_numpy(raw), qtype, K, dtype=torch.float32)
        assert w32.shape == (21, K)
        assert torch.equal(w32.double(), ref), (w32.double() - ref).abs().max()
        w16 = dequantize_rows(torch.from_numpy(raw), qtype, K, 19, torch.bfloat16)
        assert w16.shape == (19, K) and ((w16.double() - ref[:19]).abs() <= 2.0 ** -7 * ref[:19].abs() + 1e-30).all()
        x, w, ref_y, bound = _case(qtype, M=20, N=150, K=K, seed=60 + int(qtype), dtype=torch.bfloat16)
        chunk = gguf_gemv.DEQUANT_CHUNK_BYTES
        try:
            gguf_gemv.DEQUANT_CHUNK_BYTES = 64 * 2 * K  # chunks of 64, 64 and 22 rows
            _check(gguf_linear(x, w, qtype, 150), ref_y, bound, rel_out=2.0 ** -7, rel_sum=2.0 ** -7, what="cuBLAS")
        finally:
            gguf_gemv.DEQUANT_CHUNK_BYTES = chunk

    @pytest.mark.parametrize("q13,q2", [(Q.Q4_K, Q.Q6_K), (Q.Q5_0, Q.Q8_0)], ids=lambda q: q.name)
    def test_moe_grouped_by_expert(q13, q2):
        """20 tokens (past the per-pair path), top-3 of 5 experts with repeats, negative ids and one expert nobody
        picks: the grouped kernels against the float64 reference, bf16 activations (h is rounded to bf16).
        Weights and activations are positive, so no sum cancels and the error budget (a few bf16 ulps of the
        output) is sharp: a wrong expert, token, slot weight or gate/up order is far outside it."""
        rng = np.random.default_rng(int(q13) * 16 + int(q2) + 1)
        E, T, k, H, inter = 5, 20, 3, _k(q13, 1), _k(q2, 1)

        def positive(qtype, rows, cols, hi=0.02):
            return quantize(rng.uniform(hi / 10, hi, (rows, cols)).astype(np.float32), qtype)

        # gate ~2 and up ~0.3 (silu is far from linear at both, so swapping them shows); expert e's down weights
        # scaled by e + 1 and token t's activations by 1 + t / 4: a wrong expert or token shows
        w13 = np.stack([np.concatenate([positive(q13, inter, H, 8 / H), positive(q13, inter, H, 1 / H)])
                        for _ in range(E)])
        w2 = np.stack([positive(q2, H, inter, 0.01 * (e + 1)) for e in range(E)])
        x = rng.uniform(0.1, 1, (T, H)) * (1 + np.arange(T)[:, None] / 4)
        x = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
        ids = torch.from_numpy(rng.choice([0, 1, 2, 4, -1], size=(T, k), p=[.3, .3, .2, .15, .05])).to(torch.int32)
        wts = torch.from_numpy(rng.uniform(0.1, 1, (T, k)).astype(np.float32))
        assert supports_moe(q13, q2, T, H, inter)
        y = gguf_moe(x, torch.from_numpy(w13), torch.from_numpy(w2), wts, ids, q13, q2)
        assert y.dtype == torch.bfloat16 and y.shape == (T, H)
        ref, bound = reference_moe(x, dequant(w13, q13), dequant(w2, q2), wts, ids)
        _check(y, ref, bound, rel_out=2.0 ** -7, rel_sum=2.0 ** -6, what="grouped moe")

    def test_q8_activation_blocks():
        """quantize_activations: |x - d q| <= d / 2 per value, |q| <= 127, the block maximum maps to +-127, exact
        block sums, and an all-zero block gives d = 0 and zero codes (no division by zero)."""
        from glm5serve.kernels.gguf_gemv_q8 import quantize_activations

        rng = np.random.default_rng(70)
        x = torch.from_numpy(rng.standard_normal((3, 320)).astype(np.float32))
        x[1, 32:64] = 0
        xq, xd, xs = quantize_activations(x.to(torch.bfloat16))
        xq2, xd2, xs2, xi = quantize_activations(x.to(torch.bfloat16), sums16=True)
        assert torch.equal(xq2, xq) and torch.equal(xd2, xd) and torch.equal(xs2, xs)
        assert xi.dtype == torch.int32 and torch.equal(xi, xq.view(3, 20, 16).sum(-1, dtype=torch.int32))
        xb = x.to(torch.bfloat16).double().view(3, 10, 32)
        q = xq.double().view(3, 10, 32)
        assert xq.dtype == torch.int8 and q.abs().max() <= 127
        assert torch.allclose(xd.double(), xb.abs().amax(-1) / 127, rtol=1e-6, atol=0)
        assert ((xb - q * xd.double()[..., None]).abs() <= xd.double()[..., None] / 2 * (1 + 1e-5)).all()
        assert (q.abs().amax(-1)[xd > 0] == 127).all() and xd[1, 1] == 0 and not xq[1, 32:64].any()
        assert torch.allclose(xs.double(), xb.sum(-1), rtol=1e-6, atol=1e-6)

    def test_reference_rounding_emulation_is_the_kernels_rounding():
        """``testing.activation_rounding.round_activations`` (the e2e test's emulation in the reference engine) is
        bit for bit d * q of quantize_activations, per 32 and per 256: on bf16 and fp32 x of many scales (a scale
        1 / amax an ulp off, as torch's ``127.0 / t`` computes it, moves ~4e-4 of bf16 codes), with an all-zero
        block, and on integers whose block maximum is 254, where every odd value is a tie (half up, not to even)."""
        from glm5serve.kernels.gguf_gemv_q8 import quantize_activations
        from glm5serve.testing.activation_rounding import round_activations

        def kernel(x, block):
            xq, xd, _ = quantize_activations(x, scale_block=block)
            return (xq.float().view(x.shape[0], -1, block) * xd[..., None]).view(x.shape)

        rng = np.random.default_rng(71)
        x = torch.from_numpy((rng.standard_normal((64, 512)) * rng.uniform(0.01, 10, (64, 1))).astype(np.float32))
        x[1, 256:] = 0
        ties = torch.from_numpy(rng.integers(-253, 254, (8, 512)).astype(np.float32))
        ties[:, ::32] = 254.0
        for data in (x.to(torch.bfloat16), x, ties):
            for block in (32, 256):
                assert torch.equal(round_activations(data.float(), block), kernel(data, block)), (data.dtype, block)

    def test_q8_activations_take_any_column_stride_and_reject_other_dtypes():
        """quantize_activations of a transposed view or a column slice is bit-identical to that of the same values
        made contiguous (the kernel reads rows side by side: such x is copied first); non-float or 1-D x raises."""
        from glm5serve.kernels.gguf_gemv_q8 import quantize_activations

        rng = np.random.default_rng(71)
        base = torch.from_numpy(rng.standard_normal((64, 6)).astype(np.float32)).to(torch.bfloat16)
        wide = torch.from_numpy(rng.standard_normal((6, 128)).astype(np.float32)).to(torch.bfloat16)
        for x in (base.T, wide[:, ::2]):  # column strides 6 and 2
            assert x.stride(1) != 1
            for a, b in zip(quantize_activations(x), quantize_activations(x.contiguous())):
                assert torch.equal(a, b)
        for bad in (base.T.to(torch.int32), base.T.double(), base[:, 0]):
            with pytest.raises(ValueError, match="quantize_activations: expected x"):
                quantize_activations(bad)

    @pytest.mark.parametrize("M,N,blocks,cfg", [(1, 19, 3, {}), (3, 16, 2, dict(block_n=4, kbs=1, split_k=2)),
                                                (2, 33, 5, dict(block_n=8, kbs=2, split_k=2)),
                                                (5, 17, 2, dict(block_m=4, kbs=1, split_k=2)),
                                                (3, 9, 1, dict(block_m=1)),
                                                (4, 70, 3, dict(block_n=64, kbs=4, split_k=2))], ids=str)
    @pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q5_K, Q.Q6_K), ids=lambda q: q.name)
    def test_q8_path_within_its_rounding_bound(qtype, M, N, blocks, cfg):
        """Q4_K / Q5_K / Q6_K x int8 activation blocks (dp4a emulated): |y - x @ W.T| <= the activation-rounding
        bound (``q8_activation_bound``) + output rounding + fp32 sums, with partial row tiles, partial K steps,
        split-K, and one or several activation rows per program (a partial last one); the error must also be far
        above zero (the activations really are rounded).  Q6_K reads blocks in pairs: twice the blocks, an even
        kbs.  ``GemvConfig(q8=True)`` through gguf_linear is the same call."""
        from glm5serve.kernels.gguf_gemv_q8 import gguf_linear_q8
        from glm5serve.kernels.testing import _q8_part, q8_activation_bound

        if qtype == Q.Q6_K:
            blocks, cfg = 2 * blocks, {**cfg, "kbs": max(2, cfg.get("kbs", 2))}
        x, w, ref, bound = _case(qtype, M=M, N=N, K=_k(qtype, blocks), seed=80 + N, dtype=torch.bfloat16)
        y = gguf_linear_q8(x, w, qtype, N, **cfg)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        q8 = q8_activation_bound(x, w, qtype)
        err = (y.double() - ref).abs()
        assert (err <= 2.0 ** -7 * ref.abs() + q8 + FP32_EPS * bound).all(), (err / q8).max()
        assert (q8 > 1e-3 * bound).all()
        # tight: the float64 value of what the kernel computes, from its own activation blocks (tested above)
        from glm5serve.kernels.gguf_gemv_q8 import quantize_activations

        xq, xd, _ = quantize_activations(x)
        xr = (xq.double().view(M, -1, 32) * xd.double()[..., None]).view(M, -1)
        W = dequant(w, qtype)
        S = _q8_part(w, qtype)  # the part that meets rounded activations (Q4_K/Q5_K: all but the min term)
        sem = xr @ S.T + x.double() @ (W - S).T
        scale = xr.abs() @ S.abs().T + x.double().abs() @ (W - S).abs().T
        assert ((y.double() - sem).abs() <= 2.0 ** -7 * sem.abs() + FP32_EPS * scale).all()
        via = gguf_linear(x, w, qtype, N, GemvConfig(**{"block_n": 16, "kbs": 2, "split_k": 1, **cfg}, q8=True))
        assert torch.equal(via, y)

    @pytest.mark.parametrize("M,block_m", [(3, 2), (3, 4), (8, 8), (6, 4)])
    @pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q5_K), ids=lambda q: q.name)
    def test_q8_rows_per_program_compute_what_one_row_per_program_does(qtype, M, block_m):
        """Several activation rows per program (``_step_kquant_q8_rows``: dp4a chains over each sub-block's words)
        and one row per program (``_step_q4_k_q8``: dp4a then a sum over the words, Q5_K's fifth bit added the
        same way) do the same integer and fp32 arithmetic per output, so under the interpreter (numpy sums in one
        order) they agree bit for bit; with split-K, with and without loads one step ahead, a partial row tile and
        a partial last activation tile.  A wrong activation row, sub-block offset or qh shift in either breaks
        this."""
        from glm5serve.kernels.gguf_gemv_q8 import gguf_linear_q8

        x, w, _, _ = _case(qtype, M=M, N=21, K=_k(qtype, 3), seed=90 + M * block_m, dtype=torch.bfloat16)
        for cfg in (dict(), dict(kbs=1, split_k=2), dict(kbs=2, split_k=2, ahead=True)):
            one = gguf_linear_q8(x, w, qtype, 21, block_m=1, **cfg)
            assert torch.equal(gguf_linear_q8(x, w, qtype, 21, block_m=block_m, **cfg), one), cfg
        assert one.abs().amax(1).min() > 0  # every row was computed
        for bad in (3, 2.0, True, 16):  # a float or bool is not a row count (review finding, session 7)
            with pytest.raises(ValueError, match=f"block_m={bad}"):
                gguf_linear_q8(x, w, qtype, 21, block_m=bad)

    @pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q6_K), ids=lambda q: q.name)
    def test_q8_config_is_ignored_for_other_types(qtype):
        """Q8_0 has no int8-activation kernel (slower than its fp32 decode, see ``gguf_gemv_q8``) and Q6_K's reads
        blocks in pairs (here 3 per row): ``GemvConfig(q8=True)`` runs the normal path, bit-identical to q8=False
        and within the fp32-sum budget, far below what rounding the activations would cost."""
        x, w, ref, bound = _case(qtype, M=2, N=19, K=_k(qtype, 3), seed=85 + int(qtype), dtype=torch.bfloat16)
        cfg = GemvConfig(block_n=8, kbs=1, split_k=2)
        y = gguf_linear(x, w, qtype, 19, dataclasses.replace(cfg, q8=True))
        assert torch.equal(y, gguf_linear(x, w, qtype, 19, cfg))
        _check(y, ref, bound, rel_out=2.0 ** -7, what=f"{qtype.name} q8=True")

    @pytest.mark.parametrize("M,N,blocks,cfg", [(1, 19, 5, dict(block_n=8, kbs=2, split_k=2)),
                                                (3, 17, 7, dict(block_n=8, kbs=2, split_k=3)),
                                                (5, 9, 3, dict(block_n=16, kbs=4, split_k=1, block_m=4)),
                                                (2, 12, 4, dict(block_n=4, kbs=1, split_k=4)),
                                                (1, 11, 7, dict(block_n=8, kbs=1, split_k=2)),
                                                (3, 10, 9, dict(block_n=8, kbs=2, split_k=1)),
                                                (1, 10, 17, dict(block_n=4, kbs=8, split_k=1)),  # batch 1's tiles
                                                (1, 6, 9, dict(block_n=4, kbs=4, split_k=1, num_warps=2))], ids=str)
    @pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q5_K), ids=lambda q: q.name)
    def test_q8_loads_ahead_change_no_bit(qtype, M, N, blocks, cfg):
        """``ahead`` (each K step's loads issued one step ahead) only moves loads: bit-identical to the plain loop,
        with split-K ranges of 1 to 5 steps, a last step past the row (blocks not a multiple of kbs), partial row tiles
        and one or several activation rows per program; ``GemvConfig(ahead=True)`` through gguf_linear is the same
        call."""
        from glm5serve.kernels.gguf_gemv_q8 import gguf_linear_q8

        x, w, ref, bound = _case(qtype, M=M, N=N, K=_k(qtype, blocks), seed=90 + N, dtype=torch.bfloat16)
        y = gguf_linear_q8(x, w, qtype, N, ahead=True, **cfg)
        assert torch.equal(y, gguf_linear_q8(x, w, qtype, N, **cfg))
        gcfg = GemvConfig(q8=True, ahead=True, **{"block_m": 16, **cfg})
        assert torch.equal(gguf_linear(x, w, qtype, N, gcfg), gguf_linear_q8(x, w, qtype, N, **{"block_m": None,
                                                                                                 **cfg}))
        assert (y.double() - ref).abs().max() > 0  # the activations really were rounded

    def test_q8_ahead_reaches_the_kernel(monkeypatch):
        """``ahead`` is passed on to the kernel (the equality test above cannot see it ignored): through
        ``gguf_linear_q8`` and ``GemvConfig.ahead``, for Q4_K and Q5_K only."""
        import glm5serve.kernels.gguf_gemv_q8 as q8m

        real, seen = q8m._gemv_q8_kernel, []

        class Spy:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    seen.append(kw["AHEAD"])
                    return real[grid](*args, **kw)
                return launch

        monkeypatch.setattr(q8m, "_gemv_q8_kernel", Spy())
        x, w, _, _ = _case(Q.Q4_K, M=2, N=8, K=_k(Q.Q4_K, 2), seed=7, dtype=torch.bfloat16)
        gguf_linear(x, w, Q.Q4_K, 8, GemvConfig(block_n=8, kbs=1, q8=True, ahead=True))
        q8m.gguf_linear_q8(x, w, Q.Q4_K, 8, block_n=8, kbs=1, ahead=True)
        gguf_linear(x, w, Q.Q4_K, 8, GemvConfig(block_n=8, kbs=1, q8=True))
        x6, w6, _, _ = _case(Q.Q6_K, M=2, N=8, K=_k(Q.Q6_K, 2), seed=8, dtype=torch.bfloat16)
        q8m.gguf_linear_q8(x6, w6, Q.Q6_K, 8, block_n=8, kbs=2, ahead=True)
        assert seen == [True, True, False, False]

    def test_q8_config_with_odd_kbs_reads_q6_k_in_pairs():
        """gguf_linear gives the Q6_K int8-activation kernel at least 2 blocks per step (it reads them in pairs):
        ``GemvConfig(q8=True, kbs=1)`` is the kernel with kbs=2, not the fp32 decode."""
        from glm5serve.kernels.gguf_gemv_q8 import gguf_linear_q8

        x, w, _, _ = _case(Q.Q6_K, M=3, N=11, K=_k(Q.Q6_K, 4), seed=87, dtype=torch.bfloat16)
        y = gguf_linear(x, w, Q.Q6_K, 11, GemvConfig(block_n=8, kbs=1, split_k=2, q8=True))
        assert torch.equal(y, gguf_linear_q8(x, w, Q.Q6_K, 11, block_n=8, kbs=2, split_k=2))
        assert not torch.equal(y, gguf_linear(x, w, Q.Q6_K, 11, GemvConfig(block_n=8, kbs=2, split_k=2)))

    def test_q6_k_q8_steps_past_the_row_read_no_other_bytes():
        """The Q6_K int8-activation step loads without masks: a last K step that runs past the row (6 blocks, 4 per
        step) must re-read the row's last pair, not the bytes after it.  Here the rows after the 5 used ones are
        0xFF (NaN scales), so a read past a row turns its output NaN (review mutation, session 11)."""
        from glm5serve.kernels.gguf_gemv_q8 import gguf_linear_q8

        x, w, ref, bound = _case(Q.Q6_K, M=2, N=5, K=_k(Q.Q6_K, 6), seed=88, dtype=torch.bfloat16)
        buf = torch.cat([w, torch.full((3, w.shape[1]), 0xFF, dtype=torch.uint8)])
        y = gguf_linear_q8(x, buf, Q.Q6_K, 5, block_n=8, kbs=4, split_k=1)
        assert torch.isfinite(y).all()
        assert torch.equal(y, gguf_linear_q8(x, w, Q.Q6_K, 5, block_n=8, kbs=4, split_k=1))

    def test_q8_path_types_and_shapes_are_checked():
        from glm5serve.kernels.gguf_gemv_q8 import gguf_linear_q8

        for qtype, row in ((Q.Q8_0, 34 * 8), (Q.Q5_0, 22 * 8)):
            with pytest.raises(ValueError, match=f"{qtype.name} has no int8-activation kernel"):
                gguf_linear_q8(torch.zeros(1, 256), torch.zeros(4, row, dtype=torch.uint8), qtype, 4)
        with pytest.raises(ValueError, match="K=256 must hold an even number of blocks"):
            gguf_linear_q8(torch.zeros(1, 256), torch.zeros(4, 210, dtype=torch.uint8), Q.Q6_K, 4)
        with pytest.raises(ValueError, match="kbs=1 be even"):
            gguf_linear_q8(torch.zeros(1, 512), torch.zeros(4, 420, dtype=torch.uint8), Q.Q6_K, 4, kbs=1)
        with pytest.raises(ValueError, match="does not hold 5 rows"):
            gguf_linear_q8(torch.zeros(1, 256), torch.zeros(4, 144, dtype=torch.uint8), Q.Q4_K, 5)

    def test_q8_k_activation_blocks():
        """quantize_activations(scale_block=256): one d per 256 values (llama.cpp's Q8_K), |x - d q| <= d / 2, the
        block maximum maps to +-127, the codes are round(x / d) of that d, the sums still exact per 32; K not a
        multiple of 256 is refused."""
        from glm5serve.kernels.gguf_gemv_q8 import quantize_activations

        rng = np.random.default_rng(71)
        x = torch.from_numpy(rng.standard_normal((2, 768)).astype(np.float32) * rng.uniform(0.1, 9, 768))
        x[1, 256:512] = 0
        xq, xd, xs = quantize_activations(x.to(torch.bfloat16), scale_block=256)
        assert xq.shape == (2, 768) and xd.shape == (2, 3) and xs.shape == (2, 24)
        xb = x.to(torch.bfloat16).double().view(2, 3, 256)
        q = xq.double().view(2, 3, 256)
        assert torch.allclose(xd.double(), xb.abs().amax(-1) / 127, rtol=1e-6, atol=0)
        assert ((xb - q * xd.double()[..., None]).abs() <= xd.double()[..., None] / 2 * (1 + 1e-5)).all()
        assert (q.abs().amax(-1)[xd > 0] == 127).all() and xd[1, 1] == 0 and not xq[1, 256:512].any()
        assert torch.allclose(xs.double(), xb.view(2, 24, 32).sum(-1), rtol=1e-6, atol=1e-6)
        with pytest.raises(ValueError, match="scale_block=256"):  # x is fp64 (numpy promotion): refused since d40ff88
            quantize_activations(x[:, :320].float(), scale_block=256)

    @pytest.mark.parametrize("M,N,blocks,cfg", [(2, 19, 3, dict(block_n=16)), (9, 40, 2, dict(block_n=32, split_k=2)),
                                                (5, 33, 5, dict(block_n=16, split_k=3, block_m=8)),
                                                (17, 16, 1, dict(block_n=16, block_m=16)),
                                                (3, 70, 2, dict(block_n=64, split_k=2, num_stages=2)),
                                                (4, 24, 5, dict(block_n=16, split_k=2, kbs=2)),
                                                (8, 48, 3, dict(block_n=32, num_stages=2, kbs=2)),
                                                (6, 40, 4, dict(block_n=32, kbs=2))], ids=str)
    @pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q5_K), ids=lambda q: q.name)
    def test_mma_path_within_its_rounding_bound(qtype, M, N, blocks, cfg):
        """Q4_K / Q5_K codes x int8 activations on the tensor cores (``gguf_mma``, nibble masks emulated per byte):
        |y - x @ W.T| <= the rounding bound of 256-value activation blocks (``q8_activation_bound(block=256)``) +
        output rounding + fp32 sums, far above zero; and, tight, within fp32 rounding of the float64 value of what
        the kernel computes from its own activation codes (scaled codes meet the rounded activations, the min term
        the exact ones), so one wrong nibble, qh bit, scale or sub-block offset fails.  Partial row tiles, split-K,
        partial activation tiles, one or two super-blocks per K step (the last step of a split half empty);
        ``GemvConfig(mma=True)`` through gguf_linear with the other ``kbs`` gives the same bits."""
        from glm5serve.kernels.gguf_gemv_q8 import quantize_activations
        from glm5serve.kernels.gguf_mma import gguf_linear_mma
        from glm5serve.kernels.testing import _q8_part, q8_activation_bound

        x, w, ref, bound = _case(qtype, M=M, N=N, K=_k(qtype, blocks), seed=60 + N, dtype=torch.bfloat16)
        # the weight at the start of a buffer whose next rows are 0xFF (fp16 NaN scales): a read past its last row or
        # block (a lost mask of a half-empty two-block step) shows as NaN
        w = torch.cat([w, torch.full_like(w, 0xFF)])[:N]
        y = gguf_linear_mma(x, w, qtype, N, **cfg)
        assert y.dtype == torch.bfloat16 and y.shape == (M, N)
        q8 = q8_activation_bound(x, w, qtype, block=256)
        err = (y.double() - ref).abs()
        assert (err <= 2.0 ** -7 * ref.abs() + q8 + FP32_EPS * bound).all(), (err / q8).max()
        assert (q8 > 1e-3 * bound).all()
        xq, xd, _ = quantize_activations(x, scale_block=256)
        xr = (xq.double().view(M, -1, 256) * xd.double()[..., None]).view(M, -1)
        W = dequant(w, qtype)
        S = _q8_part(w, qtype)
        sem = xr @ S.T + x.double() @ (W - S).T
        scale = xr.abs() @ S.abs().T + x.double().abs() @ (W - S).abs().T
        assert ((y.double() - sem).abs() <= 2.0 ** -7 * sem.abs() + FP32_EPS * scale).all()
        # one or two super-blocks per step sum the same products in the same order, bit-identical where the splits
        # are the same (a split takes a multiple of kbs blocks)
        kbs = cfg.get("kbs", 1)
        same_splits = -(-blocks // cfg.get("split_k", 1)) % 2 == 0
        config = GemvConfig(block_n=cfg["block_n"], split_k=cfg.get("split_k", 1), mma=True,
                            block_m=cfg.get("block_m", 8 if M <= 8 else 16), stages=cfg.get("num_stages", 1),
                            kbs=3 - kbs if same_splits else kbs)
        assert torch.equal(gguf_linear(x, w, qtype, N, config), y)
        if same_splits:  # fp32 outputs, so that no bf16 rounding hides another summation order
            other = {**cfg, "kbs": 3 - kbs}
            assert torch.equal(gguf_linear_mma(x.float(), w, qtype, N, **cfg),
                               gguf_linear_mma(x.float(), w, qtype, N, **other))

    def test_mma_path_types_and_shapes_are_checked():
        """The tensor-core int8 kernel takes Q4_K and Q5_K only, whole super-blocks, enough rows, block_m 8 or 16; an
        ``mma`` config for another type runs that type's own path."""
        from glm5serve.kernels.gguf_mma import gguf_linear_mma

        with pytest.raises(ValueError, match="Q6_K has no tensor-core int8 kernel"):
            gguf_linear_mma(torch.zeros(2, 256), torch.zeros(4, 210, dtype=torch.uint8), Q.Q6_K, 4)
        with pytest.raises(ValueError, match="does not hold 5 rows"):
            gguf_linear_mma(torch.zeros(2, 256), torch.zeros(4, 144, dtype=torch.uint8), Q.Q4_K, 5)
        w4 = torch.zeros(4, 144, dtype=torch.uint8)
        for kw, msg in ((dict(block_m=4), "block_m=4 must be 8 or 16"), (dict(block_n=8), "block_n=8 must be"),
                        (dict(split_k=0), "split_k=0 must be"), (dict(kbs=4), "kbs=4 must be 1 or 2")):
            with pytest.raises(ValueError, match=msg):
                gguf_linear_mma(torch.zeros(2, 256), w4, Q.Q4_K, 4, **kw)
        with pytest.raises(ValueError, match="multiple of 256"):
            gguf_linear_mma(torch.zeros(2, 300), w4, Q.Q4_K, 4)
        with pytest.raises(ValueError, match="must be .rows, bytes."):
            gguf_linear_mma(torch.zeros(2, 256), w4.reshape(-1), Q.Q4_K, 2)
        with pytest.raises(ValueError, match="x must be"):
            gguf_linear_mma(torch.zeros(2, 256, dtype=torch.int8), w4, Q.Q4_K, 4)
        with pytest.raises(ValueError, match="scale_block=64 must be 32 or 256"):
            from glm5serve.kernels.gguf_gemv_q8 import quantize_activations

            quantize_activations(torch.zeros(1, 256), scale_block=64)
        # bf16 x, so that only the type keeps Q8_0 off the int8 tensor cores: its own path, within its own budget
        x, w, ref, bound = _case(Q.Q8_0, M=3, N=5, K=_k(Q.Q8_0, 2), seed=61, dtype=torch.bfloat16)
        _check(gguf_linear(x, w, Q.Q8_0, 5, GemvConfig(mma=True)), ref, bound, rel_out=2.0 ** -7, rel_sum=2.0 ** -7,
               what="Q8_0 with mma=True")

    @pytest.mark.parametrize("M,N,ng,cfg", [(3, 19, 6, dict(block_n=16, groups=4)),
                                            (9, 40, 32, dict(block_n=32, split_k=2, num_stages=2)),
                                            (17, 16, 48, dict(block_n=16, split_k=3, groups=2)),
                                            (12, 70, 10, dict(block_n=64, split_k=2, groups=4)),
                                            (5, 33, 16, dict(block_n=16, block_m=8))], ids=str)
    @pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q4_0, Q.Q6_K), ids=lambda q: q.name)
    def test_split_rows_mma_within_its_rounding_bound(qtype, M, N, ng, cfg):
        """Split rows on the int8 tensor cores (``gguf_mma.gguf_linear_split_mma``, code unpacking emulated per
        byte): within the activation rounding bound (blocks of 32; Q6_K 256) and, tight, within fp32 rounding of the
        float64 value of what the kernel computes from its own activation codes (fp32 x and output), so one wrong
        nibble, qh bit, scale, gathered activation or masked half fails.  Partial row and activation tiles, split-K,
        steps of 2..8 groups whose last one is part empty (Q8_0/Q4_0, ng 6 and 10), the weight followed by 0xFF rows
        (NaN scales if a read escapes its masks); ``gguf_linear`` with an ``mma`` config is the same call."""
        from glm5serve.kernels.gguf_gemv_q8 import quantize_activations
        from glm5serve.kernels.gguf_mma import gguf_linear_split_mma
        from glm5serve.kernels.gguf_split import split_rows, split_type
        from glm5serve.kernels.testing import q8_activation_bound

        if qtype == Q.Q6_K:  # 8 groups per step, rows of an even number of 256-blocks
            K, cfg = 512 * -(-ng // 16), {k: v for k, v in cfg.items() if k != "groups"}
        else:
            K = 32 * ng
        x, w, ref, bound = _case(qtype, M=M, N=N, K=K, seed=70 + N, dtype=torch.float32)
        s = split_rows(torch.cat([w, torch.full_like(w, 0xFF)]), qtype, K)[:N]
        stype = split_type(qtype)
        y = gguf_linear_split_mma(x, s, stype, N, **cfg)
        blk = 256 if qtype == Q.Q6_K else 32
        q8 = q8_activation_bound(x, w, qtype, block=blk)
        err = (y.double() - ref).abs()
        assert (err <= q8 + FP32_EPS * bound).all(), (err / q8).max()
        assert (q8 > 1e-3 * bound).all()
        xq, xd, _ = quantize_activations(x, scale_block=blk)
        xr = (xq.double().view(M, -1, blk) * xd.double()[..., None]).view(M, -1)
        W = dequant(w, qtype)
        sem = xr @ W.T
        assert ((y.double() - sem).abs() <= FP32_EPS * (xr.abs() @ W.abs().T)).all()
        config = GemvConfig(block_n=cfg["block_n"], kbs=cfg.get("groups", 8), split_k=cfg.get("split_k", 1),
                            num_warps=4, q8=True, mma=True, stages=cfg.get("num_stages", 1))
        assert torch.equal(gguf_linear(x, s, stype, N, config),
                           gguf_linear_split_mma(x, s, stype, N, **{**cfg, "num_warps": 4}))

    def test_split_rows_mma_refuses_what_it_cannot_run():
        from glm5serve.kernels.gguf_mma import gguf_linear_split_mma
        from glm5serve.kernels.gguf_split import split_type

        x = torch.zeros(2, 512)
        with pytest.raises(ValueError, match="Q5_0/split has no split-row tensor-core kernel"):
            gguf_linear_split_mma(x, torch.zeros(4, 16 * 22, dtype=torch.uint8), split_type(Q.Q5_0), 4)
        with pytest.raises(ValueError, match="stype=2 is the plain GGML type Q4_0, not a split type id"):
            gguf_linear_split_mma(x, torch.zeros(4, 16 * 18, dtype=torch.uint8), Q.Q4_0, 4)
        q40 = torch.zeros(4, 16 * 18, dtype=torch.uint8)
        for kw, msg in ((dict(groups=1), "groups=1 must be"), (dict(block_m=4), "block_m=4 must be 8 or 16"),
                        (dict(block_n=8), "block_n=8 must be"), (dict(split_k=0), "split_k=0 must be")):
            with pytest.raises(ValueError, match=msg):
                gguf_linear_split_mma(x, q40, split_type(Q.Q4_0), 4, **kw)
        with pytest.raises(ValueError, match="groups=4 must be"):
            gguf_linear_split_mma(x, torch.zeros(4, 420, dtype=torch.uint8), split_type(Q.Q6_K), 4, groups=4)
        with pytest.raises(ValueError, match="does not hold 5 uint8 rows"):
            gguf_linear_split_mma(x, q40, split_type(Q.Q4_0), 5)
        with pytest.raises(ValueError, match="x must be .M, K. bf16/fp16/fp32"):
            gguf_linear_split_mma(x.to(torch.int8), q40, split_type(Q.Q4_0), 4)

    def test_bounds_check_catches_reads_and_writes_past_a_view():
        """``check_bounds`` (on for this file): a kernel that reads one element past the view it was given (into the
        rest of the storage, as a clamp or mask removed from a GEMV would) or writes past it fails with the kernel's
        name; the same accesses masked off, or inside the view, pass.  Also int32 words read from a uint8 tensor (the
        element size is the pointer's), atomics, and a launch nested in another's pre-run hook."""
        import triton
        import triton.language as tl

        @triton.jit
        def _copy(src_ptr, dst_ptr, n, extra, MASKED: tl.constexpr):
            i = tl.arange(0, 8)
            m = i < n + extra
            v = tl.load(src_ptr + i, mask=m if not MASKED else i < n, other=0.0)
            tl.store(dst_ptr + i, v, mask=m if not MASKED else i < n)

        buf, out = torch.arange(16.0), torch.zeros(16)
        src, dst = buf[:5], out[:6]  # views of larger storages
        _copy[(1,)](src, dst, 5, 0, MASKED=False)
        assert torch.equal(dst[:5], src) and out[5:].eq(0).all()
        _copy[(1,)](src, dst, 5, 3, MASKED=True)  # the lanes past n are masked off: not checked
        with pytest.raises(Exception, match=r"_copy: create_masked_load of 1 lane\(s\) out of bounds \(first at "
                                            r"\+20 bytes from the nearest tensor argument, of 20 bytes\)"):
            _copy[(1,)](src, dst, 5, 1, MASKED=False)  # reads src[5], inside buf but past the view
        with pytest.raises(Exception, match=r"_copy: create_masked_store of 2 lane\(s\) out of bounds"):
            _copy[(1,)](buf[:8], dst, 8, 0, MASKED=False)  # reads 8, writes 8 into a view of 6
        assert out[6:].eq(0).all()  # the checked store was refused before it wrote
        # a read that runs from one tensor into the next one in memory: each lane is in some tensor, not all in one
        with pytest.raises(Exception, match=r"_copy: create_masked_load: its lanes lie in more than one tensor"):
            _copy[(1,)](buf[:4], buf[4:12], 8, 0, MASKED=False)

        @triton.jit
        def _words(src_ptr, dst_ptr, at, n):  # int32 words of a uint8 tensor, from byte `at`, as the GGUF kernels
            i = tl.arange(0, 4)
            w = (src_ptr + at).to(tl.pointer_type(tl.int32))
            tl.atomic_add(dst_ptr + i, tl.load(w + i, mask=i < n, other=0), mask=i < n)

        u8, acc = torch.arange(16, dtype=torch.uint8), torch.zeros(8, dtype=torch.int32)
        _words[(1,)](u8, acc[:4], 0, 4)  # the last whole word of the tensor is in bounds
        with pytest.raises(Exception, match=r"_words: create_masked_load of 1 lane\(s\) out of bounds"):
            _words[(1,)](u8, acc[:4], 1, 4)  # the fourth word straddles the end by one byte
        assert torch.equal(acc[:4], u8.view(torch.int32)) and acc[4:].eq(0).all()
        before = acc.clone()
        with pytest.raises(Exception, match=r"_words: create_atomic_rmw of 1 lane\(s\) out of bounds"):
            _words[(1,)](u8, acc[:3], 0, 4)  # the atomic's fourth lane is past a view of 3
        assert torch.equal(acc, before)  # refused before it added anything
        # a launch from inside another (a pre-run hook) checks against its own tensors, then the outer's again
        _words.add_pre_run_hook(lambda *a, **k: _copy[(1,)](buf, out, 8, 0, MASKED=False))
        try:
            with pytest.raises(Exception, match=r"_words: create_masked_load of 1 lane\(s\) out of bounds"):
                _words[(1,)](u8, acc[:4], 1, 4)
        finally:
            _words.pre_run_hooks.clear()

    def test_bad_input_is_rejected():
        w = torch.zeros(4, 144, dtype=torch.uint8)
        with pytest.raises(ValueError, match="unsupported GGML type"):
            gguf_linear(torch.zeros(1, 256), w, int(Q.Q2_K), 4)
        with pytest.raises(ValueError, match="multiple of 256"):
            gguf_linear(torch.zeros(1, 128), w, int(Q.Q4_K), 4)
        with pytest.raises(ValueError, match="does not hold 5 rows"):
            gguf_linear(torch.zeros(1, 256), w, int(Q.Q4_K), 5)
        with pytest.raises(ValueError, match="activation"):
            gguf_moe(torch.zeros(1, 256), w[None], w[None], torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32),
                     Q.Q4_K, Q.Q4_K, activation="gelu")

    def test_bad_arguments_get_one_line_errors():
        """Each entry point refuses what its kernels would read wrongly (found by a review that called them as a
        new user would): a weight that is not (rows, bytes) (read as garbage or past its end), a bad N, a
        ``dequantize_rows`` destination of the wrong shape, stride or dtype (stored past its end or scrambled),
        launch parameters that would fail inside Triton, tensors on two devices, an integer x or float ids for the
        MoE; K = 0 gives the empty sums, zeros."""
        from glm5serve.kernels.gguf_gemv import dequantize_rows
        from glm5serve.kernels.gguf_gemv_q8 import gguf_linear_q8
        from glm5serve.kernels.gguf_split import can_split, split_rows, split_type

        w, x = torch.zeros(4, 144, dtype=torch.uint8), torch.zeros(1, 256)
        for bad in (w.reshape(-1), w[None]):
            for call in (lambda: gguf_linear(x, bad, Q.Q4_K, 1), lambda: gguf_linear_q8(x, bad, Q.Q4_K, 1),
                         lambda: dequantize_rows(bad, Q.Q4_K, 256, 1)):
                with pytest.raises(ValueError, match=r"qweight must be \(rows, bytes\) uint8"):
                    call()
        for n in (-1, 2.0):
            with pytest.raises(ValueError, match=f"gguf_linear: N={n} must be an int >= 0"):
                gguf_linear(x, w, Q.Q4_K, n)
        with pytest.raises(ValueError, match="dequantize_rows: K=256.0 must be an int >= 0"):
            dequantize_rows(w, Q.Q4_K, 256.0)
        with pytest.raises(ValueError, match=r"dequantize_rows: qweight must be \(rows, bytes\)"):
            dequantize_rows(torch.zeros((), dtype=torch.uint8), Q.Q4_K, 256)
        # numpy and torch integers are ints (Triton's launcher takes only int)
        assert gguf_linear(x, w, Q.Q4_K, np.int64(3)).shape == gguf_linear_q8(x, w, Q.Q4_K, torch.tensor(3)).shape
        assert dequantize_rows(w, Q.Q4_K, np.int64(256), np.int32(2)).shape == (2, 256)
        s8 = split_rows(torch.zeros(4, 68, dtype=torch.uint8), Q.Q8_0, 64)
        for qw, qtype, K in ((w, Q.Q4_K, 256), (s8, split_type(Q.Q8_0), 64)):
            for out in (torch.empty(3, K), torch.empty(K, 4).t(), torch.empty(4, K, dtype=torch.int32)):
                with pytest.raises(ValueError, match=rf"out must be \(4, {K}\) torch.float32"):
                    dequantize_rows(qw, qtype, K, dtype=torch.float32, out=out)
            with pytest.raises(ValueError, match="dtype torch.int32 is not bf16/fp16/fp32"):
                dequantize_rows(qw, qtype, K, dtype=torch.int32)
        for launch in (dict(split_k=0), dict(block_n=24), dict(kbs=3), dict(num_warps=64)):
            with pytest.raises(ValueError, match="GemvConfig"):
                gguf_linear_q8(x, w, Q.Q4_K, 4, **launch)
        with pytest.raises(ValueError, match="x is on meta, qweight on cpu"):
            gguf_linear(x.to("meta"), w, Q.Q4_K, 4)
        with pytest.raises(ValueError, match="x is on meta, qweight on cpu"):
            gguf_linear(x[:, :64].to("meta"), s8, split_type(Q.Q8_0), 4)
        for call in (gguf_linear, gguf_linear_q8):
            assert torch.equal(call(torch.zeros(2, 0), w, Q.Q4_K, 4), torch.zeros(2, 4))
        assert split_rows(w[:0, :68], Q.Q8_0, 64).shape == (0, 68) and not can_split(Q.Q8_0, 64.0)
        ids, wts = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
        for args in ((x.int(), ids, wts), (x, ids.float(), wts), (x, ids, wts.int())):
            with pytest.raises(ValueError, match="bf16/fp16/fp32 x, signed integer topk_ids and float topk_weights"):
                gguf_moe(args[0], w[None], w[None], args[2], args[1], Q.Q4_K, Q.Q4_K)
        with pytest.raises(ValueError, match="must be on one device"):
            gguf_moe(x, w[None], w[None], wts.to("meta"), ids, Q.Q4_K, Q.Q4_K)

    def test_type_ids_and_configs_get_one_line_errors():
        """A qtype that is not an integer (a name, None, a float, a bool) is refused by every entry point with a
        ValueError naming the function and the argument; before, int() truncated 12.7 to Q4_K and ran, and
        "Q4_K" / None gave int()'s own error.  Predicates answer False.  A config that is not a GemvConfig, a MoE
        weight whose rows are not contiguous, expert_groups' num_experts / group_m / non-integer ids, the tensor-core
        paths' launch arguments that are not Python ints get the same kind of message (before: AttributeError,
        "does not hold" with the type as a number, raw torch errors, errors from inside the Triton launch)."""
        from glm5serve.kernels.gguf_gemv import dequantize_rows
        from glm5serve.kernels.gguf_gemv_q8 import gguf_linear_q8
        from glm5serve.kernels.gguf_mma import gguf_linear_mma, gguf_linear_split_mma
        from glm5serve.kernels.gguf_topk_moe import expert_groups
        from glm5serve.kernels.gguf_split import (base_type, can_split, dequantize_split_rows, gguf_linear_split,
                                                  join_rows, split_rows, split_type)

        w, x = torch.zeros(4, 144, dtype=torch.uint8), torch.zeros(1, 256)
        ids, wts = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 1)
        calls = {"gguf_linear": lambda q: gguf_linear(x, w, q, 4),
                 "dequantize_rows": lambda q: dequantize_rows(w, q, 256),
                 "gguf_linear_q8": lambda q: gguf_linear_q8(x, w, q, 4),
                 "gguf_linear_mma": lambda q: gguf_linear_mma(x, w, q, 4),
                 "gguf_linear_split_mma: stype": lambda q: gguf_linear_split_mma(x, w, q, 4),
                 "gguf_linear_split: stype": lambda q: gguf_linear_split(x, w, q, 4),
                 "dequantize_rows: stype": lambda q: dequantize_split_rows(w, q, 256),
                 "split_type": split_type, "base_type: stype": base_type,
                 "split_rows": lambda q: split_rows(w, q, 256), "join_rows": lambda q: join_rows(w, q, 256),
                 "gguf_moe: qtype_w13": lambda q: gguf_moe(x, w[None], w[None], wts, ids, q, Q.Q4_K),
                 "gguf_moe: qtype_w2": lambda q: gguf_moe(x, w[None], w[None], wts, ids, Q.Q4_K, q)}
        for bad in ("Q4_K", None, 12.7, float(Q.Q4_K), True):
            for fn, call in calls.items():
                name = fn if ":" in fn else f"{fn}: qtype"
                with pytest.raises(ValueError, match=f"^{name}={bad!r} is not a GGML type id"):
                    call(bad)
            assert not supports(bad, 1, 4, 256) and not supports_moe(bad, Q.Q4_K, 1, 256, 256)
            assert not can_split(bad, 256)
        # GGMLQuantizationType, numpy and torch integers are type ids
        y = gguf_linear(x, w, Q.Q4_K, 4)
        for q in (np.int64(12), torch.tensor(12), 12):
            assert torch.equal(gguf_linear(x, w, q, 4), y)
        for config in ({"block_n": 16}, "auto"):
            with pytest.raises(ValueError, match="gguf_linear: config must be a GemvConfig or None, got"):
                gguf_linear(x, w, Q.Q4_K, 4, config)
            with pytest.raises(ValueError, match="gguf_linear_split: config must be a GemvConfig or None, got"):
                gguf_linear_split(x[:, :64], split_rows(torch.zeros(4, 68, dtype=torch.uint8), Q.Q8_0, 64),
                                  split_type(Q.Q8_0), 4, config)
        wide = torch.zeros(1, 4, 288, dtype=torch.uint8)
        with pytest.raises(ValueError, match=r"gguf_moe: w13 must have contiguous rows \(last stride 1\), got "
                                             r"strides \(1152, 288, 2\)"):
            gguf_moe(x, wide[..., ::2], w[None], wts, ids, Q.Q4_K, Q.Q4_K)
        with pytest.raises(ValueError, match=r"gguf_moe: w2 \(1, 4, 144\) does not hold \(E=1, 256, K=2\) of "
                                             r"Q4_K \(K a multiple of 256"):
            gguf_moe(x, w[None], w[None], wts, ids, Q.Q4_K, Q.Q4_K)
        for E, gm, msg in ((-1, 16, "num_experts=-1 must be an int >= 0"), (2.0, 16, "num_experts=2.0 must be"),
                           (2, 0, "group_m=0 must be an int >= 1"), (2, None, "group_m=None must be")):
            with pytest.raises(ValueError, match=f"^expert_groups: {msg}"):
                expert_groups(ids, E, gm)
        for E, gm, msg in ((2, -1, "group_m=-1 must be an int >= 1"), (2, 4.0, "group_m=4.0 must be an int >= 1")):
            with pytest.raises(ValueError, match=f"^expert_groups: {msg}"):
                expert_groups(ids, E, gm)
        two = torch.tensor([[1, 0], [1, 1]], dtype=torch.int32)
        for gm in (np.int64(4), torch.tensor(4)):  # integers of any kind, as num_experts
            assert all(map(torch.equal, expert_groups(two, 2, gm), expert_groups(two, np.int32(2), 4)))
        for bad, got in ((ids.float(), "torch.float32"), ([[0, 1]], "list")):
            with pytest.raises(ValueError, match=f"expert_groups: topk_ids must be an integer tensor, got {got}"):
                expert_groups(bad, 2)
        with pytest.raises(ValueError, match=r"^gguf_moe: qtype_w2=99 is not a supported GGML type \(supported: "):
            gguf_moe(x, w[None], w[None], wts, ids, Q.Q4_K, 99)
        # the int8 tensor-core entry points: launch arguments are Python ints (Triton takes no numpy ints or
        # floats: they failed inside the launch), and a type id that is neither plain nor split is said as such
        s8 = split_rows(torch.zeros(4, 272, dtype=torch.uint8), Q.Q8_0, 256)
        for kw, msg in ((dict(block_m=np.int64(8)), "block_m=np.int64.8. must be 8 or 16"),
                        (dict(num_warps=3), "num_warps=3 must be a power of two up to 32"),
                        (dict(num_stages=0), "num_stages=0 must be an int >= 1"),
                        (dict(block_m=8.0), "block_m=8.0 must be 8 or 16")):
            for fn, call in (("gguf_linear_mma", lambda: gguf_linear_mma(x, w, Q.Q4_K, 4, **kw)),
                             ("gguf_linear_split_mma", lambda: gguf_linear_split_mma(x, s8, split_type(Q.Q8_0), 4,
                                                                                     **kw))):
                with pytest.raises(ValueError, match=f"^{fn}: {msg}"):
                    call()
        with pytest.raises(ValueError, match=r"^gguf_linear_mma: kbs=np.int64\(2\) must be 1 or 2"):
            gguf_linear_mma(x, w, Q.Q4_K, 4, kbs=np.int64(2))
        with pytest.raises(ValueError, match=r"^gguf_linear_split_mma: groups=np.int64\(8\) must be"):
            gguf_linear_split_mma(x, s8, split_type(Q.Q8_0), 4, groups=np.int64(8))
        for stype, name in ((268, "type id 268"), (-1, "type id -1"), (Q.Q4_K, "Q4_K"), (Q.Q5_0, "Q5_0"),
                            (split_type(Q.Q5_0), "Q5_0/split")):
            with pytest.raises(ValueError, match=f"^gguf_linear_split_mma: {name} has no split-row tensor-core"):
                gguf_linear_split_mma(x, s8, stype, 4)
        with pytest.raises(ValueError, match=r"^gguf_linear_q8: block_m=np.int64\(8\) must be an int"):
            gguf_linear_q8(x, w, Q.Q4_K, 4, block_m=np.int64(8))
        # sizes that are not integers: the predicates answer False (were a raw TypeError, or True for a float K)
        for args in (("1", 4, 256), (1, 4, None), (1, 4.0, 256)):
            assert not supports(Q.Q4_K, *args) and not supports(split_type(Q.Q8_0), *args)
        assert not supports(split_type(Q.Q8_0), 1, 4, 256.0) and not supports_moe(Q.Q4_K, Q.Q4_K, 1, 256, None)
        assert supports(Q.Q4_K, np.int64(1), torch.tensor(4), 256) and supports_moe(Q.Q4_K, 12, 1, 256, np.int32(256))
        # arguments that are not tensors (were AttributeError: 'list' object has no attribute 'dim')
        from glm5serve.kernels.gguf_gemv_q8 import quantize_activations

        wn, xl = w.numpy(), x.tolist()
        for fn, name, got, call in (
                ("gguf_linear", "x", "list", lambda: gguf_linear(xl, w, Q.Q4_K, 4)),
                ("gguf_linear", "qweight", "ndarray", lambda: gguf_linear(x, wn, Q.Q4_K, 4)),
                ("gguf_linear_split", "qweight", "ndarray", lambda: gguf_linear(x, s8.numpy(), split_type(Q.Q8_0), 4)),
                ("gguf_linear_q8", "x", "list", lambda: gguf_linear_q8(xl, w, Q.Q4_K, 4)),
                ("gguf_linear_mma", "qweight", "ndarray", lambda: gguf_linear_mma(x, wn, Q.Q4_K, 4)),
                ("gguf_linear_split_mma", "x", "list", lambda: gguf_linear_split_mma(xl, s8, split_type(Q.Q8_0), 4)),
                ("dequantize_rows", "qweight", "ndarray", lambda: dequantize_rows(wn, Q.Q4_K, 256)),
                ("dequantize_rows", "qweight", "ndarray", lambda: dequantize_rows(s8.numpy(), split_type(Q.Q8_0), 256)),
                ("split_rows", "qweight", "ndarray", lambda: split_rows(s8.numpy(), Q.Q8_0, 256)),
                ("quantize_activations", "x", "list", lambda: quantize_activations(xl)),
                ("gguf_moe", "topk_ids", "list", lambda: gguf_moe(x, w[None], w[None], wts, [[0]], Q.Q4_K, Q.Q4_K)),
                ("gguf_moe", "w13", "ndarray", lambda: gguf_moe(x, wn[None], w[None], wts, ids, Q.Q4_K, Q.Q4_K))):
            with pytest.raises(ValueError, match=f"^{fn}: {name} must be a torch.Tensor, got {got}$"):
                call()

    @pytest.mark.parametrize("path", ["fp32", "q8-slots", "q8-slot-loop", "grouped"])
    def test_moe_ids_outside_the_experts_contribute_nothing(path, monkeypatch):
        """topk_ids of E or more (a routing bug, or ids of another rank's numbering) contribute nothing, as -1
        does, on every path: y equals the run with those ids set to -1, bit for bit, and no kernel reads past w13
        or w2 (bounds-checked; before, the per-pair kernels read expert E's rows: NaN, or a crash)."""
        x, w13, w2, ids, wts = _moe_case(Q.Q4_K, Q.Q4_K, 256, 256, 7)
        bad = torch.tensor([[0, 3], [1, -1], [1000, 2]], dtype=torch.int32)  # E = 3
        if path == "q8-slot-loop":
            monkeypatch.setattr("glm5serve.kernels.gguf_topk_moe.MOE_Q8_SLOTS_MAX_BLOCKS", 0)
        kw = dict(grouped=True) if path == "grouped" else dict(q8=path != "fp32", grouped=False)
        if path == "grouped":
            x = x.to(torch.bfloat16)
        y_bad, y_minus = (gguf_moe(x, torch.from_numpy(w13), torch.from_numpy(w2), wts, i, Q.Q4_K, Q.Q4_K, **kw)
                          for i in (bad, torch.where(bad >= 3, -1, bad)))
        assert torch.isfinite(y_bad).all() and y_bad.abs().sum() > 0 and torch.equal(y_bad, y_minus)

    def test_nan_activations_propagate_on_the_int8_paths():
        """A NaN in x makes its row of y NaN on every int8 path, as on the fp32 decode; the other row stays finite.
        The activation quantizer's block maximum skips a NaN, which then became code 0: before, it vanished where
        no exact block sum carries it (split rows on dp4a and tensor cores, Q6_K's int8 GEMV)."""
        from glm5serve.kernels.gguf_gemv_q8 import gguf_linear_q8
        from glm5serve.kernels.gguf_mma import gguf_linear_mma, gguf_linear_split_mma
        from glm5serve.kernels.gguf_split import split_rows, split_type

        runs = []
        for qtype in (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q6_K, Q.Q4_K, Q.Q5_K):
            x, w, _, _ = _case(qtype, 2, 8, 512, 400 + int(qtype), dtype=torch.bfloat16)
            x[0, 37] = float("nan")
            if qtype in SPLIT_TYPES:
                s = split_rows(w, qtype, 512)
                runs.append((f"{qtype.name}/split", gguf_linear(x, s, split_type(qtype), 8)))
                if qtype != Q.Q5_0:
                    runs.append((f"{qtype.name}/split mma", gguf_linear_split_mma(
                        x, s, split_type(qtype), 8, block_n=16, groups=8 if qtype == Q.Q6_K else 2)))
            if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
                runs.append((f"{qtype.name} q8", gguf_linear_q8(x, w, qtype, 8, kbs=2)))
            if qtype in (Q.Q4_K, Q.Q5_K):
                runs.append((f"{qtype.name} mma", gguf_linear_mma(x, w, qtype, 8, block_n=16)))
        for name, y in runs:
            assert torch.isnan(y[0]).all() and torch.isfinite(y[1]).all(), name
        # finite +-3e38 whose block sum overflows to inf - inf = NaN: no NaN in x, so none in y (the NaN test looks
        # at x itself; Q8_0 split rows do not use the block sums)
        x, w, _, _ = _case(Q.Q8_0, 2, 4, 128, 3, dtype=torch.float32)
        x[0, 64] = x[0, 72] = 3e38
        x[0, 65] = x[0, 73] = -3e38
        y = gguf_linear(x.bfloat16(), split_rows(w, Q.Q8_0, 128), split_type(Q.Q8_0), 4,
                        GemvConfig(block_n=4, kbs=4, block_m=2, q8=True)).float()
        ref = gguf_linear(x, w, Q.Q8_0, 4)
        assert torch.isfinite(y).all() and torch.isfinite(ref).all()
        torch.testing.assert_close(y, ref, rtol=0.02, atol=0)

    def test_supports():
        assert supports(Q.Q4_K, 1, 2048, 6144) and supports(Q.Q8_0, 16, 7, 32)
        assert supports(Q.Q4_K, 256, 2048, 6144) and not supports(Q.Q4_K, 257, 2048, 6144)  # prefill: the plugin's
        assert not supports(Q.Q4_K, 1, 2048, 6144 + 32)  # not whole super-blocks
        assert not supports(Q.IQ4_XS, 1, 2048, 6144) and not supports(Q.F16, 1, 8, 8)
        assert supports_moe(Q.Q4_K, Q.Q6_K, 256, 6144, 2048) and not supports_moe(Q.Q4_K, Q.Q2_K, 1, 6144, 2048)
        assert not supports_moe(Q.Q4_K, Q.Q6_K, 257, 6144, 2048)

    SPLIT_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q6_K)

    @pytest.mark.parametrize("qtype", SPLIT_TYPES, ids=lambda q: q.name)
    def test_split_rows_dequantize_exactly(qtype):
        """Split rows (``gguf_split``) decoded by their STORE kernel equal gguf-py's dequantizer of the GGUF rows they
        came from, equal in fp32 (d * code is exact; torch.equal, so +0 and -0 count as equal), on 13 rows (a partial row tile) of 10 blocks (a partial
        K step of 8; Q6_K: 2 blocks), from a row slice of a padded weight."""
        from glm5serve.kernels.gguf_gemv import dequantize_rows
        from glm5serve.kernels.gguf_split import split_rows, split_type

        rng = np.random.default_rng(200 + int(qtype))
        K = 512 if qtype == Q.Q6_K else 320
        raw = random_qweight(qtype, 16, K, rng)
        padded = torch.from_numpy(np.concatenate([raw, rng.integers(0, 256, (16, 6), dtype=np.uint8)], axis=1))
        split = split_rows(padded, qtype, K)
        got = dequantize_rows(split[2:15], split_type(qtype), K, dtype=torch.float32)
        assert torch.equal(got.double(), torch.as_tensor(dequant(raw[2:15], qtype)).double())

    @pytest.mark.parametrize("qtype", SPLIT_TYPES, ids=lambda q: q.name)
    def test_split_rows_loads_ahead_bit_identical(qtype):
        """The split-row GEMV with each K step's loads issued one step ahead (``GemvConfig.ahead``) gives the same
        bits as without: 3 activation rows, 13 rows (a partial row tile), 2-3 K steps per program, with a partial
        last step, with and without split-K.  One activation row takes its own loop (``_load_row``, Q4_0/Q5_0/Q8_0):
        the same with x[:1], whose output is also row 0 of the 3-row run's (the same int8 products and scales); the
        bounds check sees that loop's partial and look-ahead steps (no other test gives it one)."""
        from glm5serve.kernels.gguf_split import split_rows, split_type

        K = 256 * 6 if qtype == Q.Q6_K else 32 * 14  # 48 / 14 blocks of 32
        x, w, _, _ = _case(qtype, 3, 13, K, 300 + int(qtype), dtype=torch.bfloat16)
        split = split_rows(w, qtype, K)
        for kbs, split_k in ((32, 1), (8, 2)) if qtype == Q.Q6_K else ((8, 1), (4, 2)):
            cfg = dict(block_n=8, kbs=kbs, split_k=split_k, block_m=4, q8=True)
            runs = {(m, a): gguf_linear(x[:m], split, split_type(qtype), 13, GemvConfig(**cfg, ahead=a))
                    for m in (3, 1) for a in (False, True)}
            assert runs[3, False].abs().sum() > 0 and torch.equal(runs[3, False], runs[3, True]), (kbs, split_k)
            assert torch.equal(runs[1, False], runs[1, True]), (kbs, split_k)
            assert torch.equal(runs[1, False], runs[3, False][:1]), (kbs, split_k)

    @settings(max_examples=12, deadline=None)
    @given(qtype=st.sampled_from(SPLIT_TYPES), M=st.integers(1, 20), N=st.integers(1, 33),
           blocks=st.sampled_from((2, 4, 6)), block_n=st.sampled_from((4, 8, 16)), kbs=st.sampled_from((1, 2, 4)),
           split_k=st.integers(1, 3), default=st.booleans(), ahead=st.booleans(), seed=st.integers(0, 2**16))
    def test_split_rows_gemv_within_the_int8_bound(qtype, M, N, blocks, block_n, kbs, split_k, default, ahead, seed):
        """gguf_linear on split rows (int8 activations, dp4a emulated) against gguf-py + fp64 on the GGUF rows:
        within the int8-rounding bound of the activations (``q8_activation_bound``: for Q4_0/Q5_0 only d * u meets
        rounded activations) plus output rounding and fp32 sums, for drawn shapes, tiles and split-K; default
        configs past 16 rows take the dequantize + matmul path.  A wrong code, fifth bit, scale or offset exceeds
        the bound (it is ~1/250 of the weights' share of the output)."""
        from glm5serve.kernels.gguf_split import split_rows, split_type
        from glm5serve.kernels.testing import q8_activation_bound

        K = 256 * blocks if qtype == Q.Q6_K else 32 * blocks
        x, w, ref, bound = _case(qtype, M, N, K, seed, dtype=torch.bfloat16)
        block_m = min(16, 1 << (M - 1).bit_length())
        cfg = None if default else GemvConfig(block_n=block_n, kbs=kbs, split_k=split_k, block_m=block_m, q8=True,
                                              ahead=ahead)
        y = gguf_linear(x, split_rows(w, qtype, K), split_type(qtype), N, cfg)
        assert y.shape == (M, N) and y.dtype == torch.bfloat16
        err = (y.double() - ref).abs()
        tol = q8_activation_bound(x, w, qtype) + 2.0 ** -7 * ref.abs() + 2.0 ** -7 * bound * (cfg is None and M > 16)
        assert (err <= tol + FP32_EPS * bound + 1e-30).all(), ((err - tol) / bound).max()

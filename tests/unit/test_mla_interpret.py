"""The Triton MLA kernels on the CPU through Triton's interpreter, against the plain torch reference and against the
expanded (non-absorbed) MLA on random weights.

``TRITON_INTERPRET=1`` must be set before triton is imported, so outside the interpreter this file holds one test that
re-runs it in a fresh process. Shapes are tiny (the interpreter runs programs one by one) but cover head counts that
are not a multiple of the head tile, head dims that are not powers of two, partial blocks, lengths around the block
size and the top-k width, split-K with empty splits, block strides wider than a block, physical and logical top-k
indices, -1 padding at the end or scattered, and NaN in every cache row and query row no real token may read.

The interpreter's ``tl.dot`` multiplies bf16 operands as raw 16-bit integers (triton 3.8 ``InterpreterBuilder
.create_dot``); below, bf16 operands are widened to fp32 first, which is what the GPU's bf16 MMA computes (exact
products, fp32 sums).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("TRITON_INTERPRET") != "1":

    def test_mla_kernels_under_triton_interpreter():
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        r = subprocess.run([sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-x",
                            "-p", "no:cacheprovider"], cwd=root, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"interpreted MLA tests failed:\n{r.stdout[-12000:]}\n{r.stderr[-3000:]}"

else:
    import numpy as np
    import torch
    import triton.language as tl
    from hypothesis import given, settings
    from hypothesis import strategies as st
    from triton.runtime import interpreter as _interp

    from glm5serve.mla.testing import make_batch
    from glm5serve.mla.triton_mla import mla_decode, mla_prefill, mla_reference, prefill_kv_lens
    from glm5serve.schema import split_kv_b

    _create_dot = _interp.InterpreterBuilder.create_dot

    def _widen_bf16(h):
        if not h.dtype.is_bf16():
            return h
        return _interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    _interp.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: _create_dot(
        self, _widen_bf16(a), _widen_bf16(b), d, *rest)

    # Output error of one bf16/fp16 rounding of p and of the output, on O(1) values; LSE is fp32 throughout.
    # (vLLM's MLA backend tests allow rtol 1e-2 / atol 5e-1; these are far tighter.)
    TOL = {torch.bfloat16: dict(atol=3e-2, rtol=1e-2), torch.float16: dict(atol=4e-3, rtol=4e-3)}
    LSE_TOL = dict(atol=2e-3, rtol=1e-3)

    def _assert_matches(out, lse, ref_out, ref_lse, n, dtype, what=""):
        torch.testing.assert_close(out[:n].float(), ref_out[:n], **TOL[dtype], msg=lambda m: f"{what} out: {m}")
        torch.testing.assert_close(lse[:n], ref_lse[:n], **LSE_TOL, msg=lambda m: f"{what} lse: {m}")

    dims = st.sampled_from([(16, 16), (32, 16), (48, 8), (24, 0)])  # (kv_lora, rope): non-pow2 and NoPE too

    @st.composite
    def decode_batches(draw):
        block_size = draw(st.sampled_from([4, 8, 16]))
        topk = draw(st.none() | st.sampled_from([4, 8, 20]))
        edge = topk or block_size
        B = draw(st.integers(1, 3))
        seq_lens = [max(1, draw(st.sampled_from([edge - 1, edge, edge + 1, 2 * block_size + 1, 1])))
                    for _ in range(B)]
        q_lens = [draw(st.integers(1, min(2, s))) for s in seq_lens]
        return dict(seq_lens=seq_lens, q_lens=q_lens, block_size=block_size, topk=topk,
                    num_heads=draw(st.sampled_from([1, 3, 8, 16, 19])), dims=draw(dims),
                    dtype=draw(st.sampled_from([torch.bfloat16, torch.float16])),
                    pad_tokens=draw(st.integers(0, 2)), block_pad=draw(st.sampled_from([0, 3])),
                    scatter_pad=draw(st.booleans()), topk_fill=draw(st.sampled_from([1.0, 0.5])),
                    num_splits=draw(st.sampled_from([1, 2, 5])), seed=draw(st.integers(0, 2**16)))

    def _build(p):
        L, R = p["dims"]
        return make_batch(p["seq_lens"], p["q_lens"], p["num_heads"], L, R, p["block_size"], p["dtype"],
                          topk=p["topk"], pad_tokens=p["pad_tokens"], block_pad=p["block_pad"],
                          scatter_pad=p["scatter_pad"], topk_fill=p["topk_fill"], seed=p["seed"])

    @settings(max_examples=20)
    @given(decode_batches())
    def test_decode_matches_reference(p):
        """Dense and sparse (logical and physical indices) decode == reference; padding rows give (0, -inf)."""
        b = _build(p)
        variants = [False] if b.topk is None else [False, True]
        for physical in variants:
            kw = b.decode_kwargs(physical)
            out, lse = mla_decode(b.q_nope, b.q_pe, b.kv_cache, b.scale, num_splits=p["num_splits"], **kw)
            ref_out, ref_lse = mla_reference(b.q_nope, b.q_pe, b.kv_cache, b.scale, **kw)
            _assert_matches(out, lse, ref_out, ref_lse, b.num_real, p["dtype"], f"physical={physical}")
            assert torch.equal(out[b.num_real:], torch.zeros_like(out[b.num_real:]))
            assert torch.isneginf(lse[b.num_real:]).all()
            if physical:  # the same keys in the same order: bit-identical to the logical run
                assert torch.equal(out, logical[0]) and torch.equal(lse, logical[1])
            logical = (out, lse)
        if p["pad_tokens"]:  # padding rows change nothing in the real rows, bit for bit
            n = b.num_real
            kw = {k: (v[:n] if k in ("req_ids", "kv_lens", "topk_indices") else v) for k, v in kw.items()}
            out_n, lse_n = mla_decode(b.q_nope[:n], b.q_pe[:n], b.kv_cache, b.scale, num_splits=p["num_splits"],
                                      **kw)
            assert torch.equal(out_n, out[:n]) and torch.equal(lse_n, lse[:n])

    @settings(max_examples=10)
    @given(st.data())
    def test_prefill_matches_reference(data):
        """Causal varlen prefill/extend (tiled dense kernel; sparse through the per-token kernel) == reference."""
        block_size = data.draw(st.sampled_from([4, 16]))
        B = data.draw(st.integers(1, 3))
        q_lens = [data.draw(st.integers(1, 6)) for _ in range(B)]
        seq_lens = [q + data.draw(st.sampled_from([0, 1, block_size - 1, block_size, 2 * block_size + 3]))
                    for q in q_lens]
        topk = data.draw(st.none() | st.sampled_from([4, 9]))
        dtype = data.draw(st.sampled_from([torch.bfloat16, torch.float16]))
        L, R = data.draw(dims)
        H = data.draw(st.sampled_from([1, 3, 8, 16]))
        b = make_batch(seq_lens, q_lens, H, L, R, block_size, dtype, topk=topk, seed=data.draw(st.integers(0, 99)))
        out, lse = mla_prefill(b.q_nope, b.q_pe, b.kv_cache, b.scale, block_table=b.block_table,
                               query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, max_query_len=max(q_lens),
                               topk_indices=b.topk)
        req_ids, kv_lens = prefill_kv_lens(b.query_start_loc, b.seq_lens)
        assert torch.equal(req_ids, b.req_ids) and torch.equal(kv_lens, b.kv_lens)
        ref_out, ref_lse = mla_reference(b.q_nope, b.q_pe, b.kv_cache, b.scale, block_table=b.block_table,
                                         req_ids=req_ids, kv_lens=kv_lens, topk_indices=b.topk)
        _assert_matches(out, lse, ref_out, ref_lse, b.num_real, dtype, f"topk={topk}")

    @pytest.mark.parametrize("poison", [float("nan"), float("inf"), 3e4])
    @pytest.mark.parametrize("physical", [False, True])
    def test_topk_exact(poison, physical):
        """A key outside the top-k list has no influence: every written row not selected by any token is poisoned
        (NaN, inf, huge) and the outputs stay bit-identical to those with the clean cache."""
        b = make_batch([23, 9], [2, 1], 3, 32, 16, 4, torch.bfloat16, topk=8, scatter_pad=True, topk_fill=0.75,
                       seed=7)
        kw = b.decode_kwargs(physical)
        clean = mla_decode(b.q_nope, b.q_pe, b.kv_cache, b.scale, num_splits=2, **kw)
        selected = torch.zeros_like(b.written)
        phys = b.physical_topk()
        selected[phys[phys >= 0].long()] = True
        assert (b.written & ~selected).sum() > 10
        b.flat_rows()[b.written & ~selected] = poison
        dirty = mla_decode(b.q_nope, b.q_pe, b.kv_cache, b.scale, num_splits=2, **kw)
        assert torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])
        assert torch.isfinite(dirty[0]).all()
        ref_out, ref_lse = mla_reference(b.q_nope, b.q_pe, b.kv_cache, b.scale, **kw)
        _assert_matches(dirty[0], dirty[1], ref_out, ref_lse, b.num_real, torch.bfloat16)

    def test_dense_reads_nothing_past_kv_len():
        """Dense decode: the rows past each token's kv_len (same block, later blocks, spare blocks) are NaN by
        construction; outputs are finite and equal the reference."""
        b = make_batch([5, 16, 17], [1, 1, 1], 16, 32, 16, 8, torch.bfloat16, block_pad=2, seed=3)
        out, lse = mla_decode(b.q_nope, b.q_pe, b.kv_cache, b.scale, num_splits=3, **b.decode_kwargs())
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        ref_out, ref_lse = mla_reference(b.q_nope, b.q_pe, b.kv_cache, b.scale, **b.decode_kwargs())
        _assert_matches(out, lse, ref_out, ref_lse, b.num_real, torch.bfloat16)

    def test_split_merge_equals_single_pass():
        """Split-K with more splits than key tiles (empty splits) merges to the one-split result."""
        b = make_batch([40, 3], [1, 1], 5, 32, 16, 8, torch.float16, seed=11)
        one = mla_decode(b.q_nope, b.q_pe, b.kv_cache, b.scale, num_splits=1, **b.decode_kwargs())
        for splits in (2, 7, 16):
            many = mla_decode(b.q_nope, b.q_pe, b.kv_cache, b.scale, num_splits=splits, **b.decode_kwargs())
            torch.testing.assert_close(many[0].float(), one[0].float(), atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(many[1], one[1], atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("sparse", [False, True])
    def test_absorbed_equals_expanded_mla(sparse):
        """Kernel in absorbed form (q.W_UK against the latent, then W_UV) == expanded MLA (per-head keys and values
        from kv_b_proj, transformers' form) on the same random weights, causal, with or without a top-k mask."""
        g = torch.Generator().manual_seed(5)
        H, nope, R, v, L, bs = 3, 16, 8, 24, 32, 4
        q_lens, seq_lens = [3, 1], [7, 12]
        b = make_batch(seq_lens, q_lens, H, L, R, bs, torch.float16, topk=4 if sparse else None, seed=9)
        kv_b = torch.randn(H * (nope + v), L, generator=g) / L ** 0.5  # HF kv_b_proj.weight
        k_b, v_b = split_kv_b(kv_b, H, nope, v)  # attn_k_b (H, L, nope), attn_v_b (H, v, L)
        q_nope = torch.randn(b.num_real, H, nope, generator=g)
        q_pe = b.q_pe.float()
        scale = (nope + R) ** -0.5

        q_abs = torch.einsum("thn,hln->thl", q_nope, k_b).to(torch.float16)
        out, _ = mla_prefill(q_abs, b.q_pe, b.kv_cache, scale, block_table=b.block_table,
                             query_start_loc=b.query_start_loc, seq_lens=b.seq_lens, max_query_len=max(q_lens),
                             topk_indices=b.topk)
        absorbed = torch.einsum("thl,hvl->thv", out.float(), v_b)

        expanded = torch.zeros(b.num_real, H, v)
        rows = b.flat_rows().float()
        for t in range(b.num_real):
            req, kv_len = int(b.req_ids[t]), int(b.kv_lens[t])
            pos = torch.arange(kv_len) if b.topk is None else b.topk[t][b.topk[t] >= 0].long()
            r = b.block_table[req].long()[pos // bs] * bs + pos % bs
            latent, k_pe = rows[r, :L], rows[r, L:]
            kv = (latent @ kv_b.T).view(-1, H, nope + v)  # (S, H, nope + v)
            k = torch.cat([kv[..., :nope], k_pe[:, None].expand(-1, H, R)], -1)
            scores = torch.einsum("hd,shd->hs", torch.cat([q_nope[t], q_pe[t]], -1), k) * scale
            expanded[t] = torch.einsum("hs,shv->hv", torch.softmax(scores, -1), kv[..., nope:])
        torch.testing.assert_close(absorbed, expanded, atol=5e-3, rtol=5e-3)

    def test_bad_inputs_raise():
        b = make_batch([5], [1], 2, 32, 16, 4, torch.bfloat16)
        with pytest.raises(ValueError, match="dense MLA decode needs"):
            mla_decode(b.q_nope, b.q_pe, b.kv_cache, b.scale)
        with pytest.raises(ValueError, match="dtypes differ"):
            mla_decode(b.q_nope.half(), b.q_pe.half(), b.kv_cache, b.scale, **b.decode_kwargs())
        with pytest.raises(ValueError, match="kv_cache"):
            mla_decode(b.q_nope, b.q_pe[..., :8], b.kv_cache, b.scale, **b.decode_kwargs())

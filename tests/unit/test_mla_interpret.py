"""The Triton MLA kernels on the CPU through Triton's interpreter, against the plain torch reference and against the
expanded (non-absorbed) MLA on random weights.

``TRITON_INTERPRET=1`` must be set before triton is imported, so outside the interpreter this file holds one test that
re-runs it in a fresh process. Shapes are tiny (the interpreter runs programs one by one) but cover head counts that
are not a multiple of the head tile, head dims that are not powers of two, partial blocks, lengths around the block
size and the top-k width, split-K with empty splits, block strides wider than a block, physical and logical top-k
indices, -1 padding at the end or scattered, and NaN in every cache row and query row no real token may read.
Every load and store is bounds-checked (``testing.triton_interpret.check_bounds``).

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

    def test_import_is_light():
        """Importing glm5serve.mla (and the kernels' reference) imports neither vLLM nor, for the package, Triton."""
        code = ("import sys, glm5serve, glm5serve.mla\n"
                "assert 'triton' not in sys.modules and 'vllm' not in sys.modules\n"
                "from glm5serve.mla import triton_mla\nassert 'vllm' not in sys.modules")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]

    COMPILE_CASES = [  # (kernel, launch constants, num_warps, num_stages): the launches mla_decode/mla_prefill make
        ("decode", dict(SPARSE=False, PHYSICAL=False, HAS_KVLEN=True, BLOCK_H=16, BLOCK_N=32), 4, 2),
        ("decode", dict(SPARSE=True, PHYSICAL=False, HAS_KVLEN=False, BLOCK_H=16, BLOCK_N=32), 4, 2),
        ("decode", dict(SPARSE=True, PHYSICAL=True, HAS_KVLEN=False, BLOCK_H=16, BLOCK_N=32), 4, 2),
        ("merge", dict(NUM_SPLITS=32, BLOCK_S=32), 2, 3),
        ("prefill", dict(BLOCK_H=16, BLOCK_N=32), 8, 2),
    ]

    @pytest.mark.parametrize("arch", [80, 90, 120])
    def test_kernels_compile_for_gpus(arch):
        """Every kernel at GLM-5's dims compiles to a cubin for sm_80/90/120 with Triton's own ptxas (no GPU needed;
        16-byte aligned pointers and strides, as the JIT specialises them at launch) without spilling registers."""
        import re

        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from glm5serve.mla import triton_mla as m

        from glm5serve.mla.triton_mla import prefill_rows

        ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / ("ptxas-blackwell" if arch >= 100
                                                                               else "ptxas")
        if not ptxas.exists():
            pytest.skip("Triton's bundled ptxas is missing")
        dims = dict(L=512, R=64, BLOCK_L=512, BLOCK_R=64, PAGE=64, HAS_REQ=True)
        kernels = {"decode": m._mla_decode_kernel, "merge": m._mla_merge_kernel, "prefill": m._mla_prefill_kernel}
        for name, consts, warps, stages in COMPILE_CASES:
            kernel = kernels[name]
            consts = {k: v for k, v in {**dims, "NUM_SPLITS": 8, "BLOCK_LM": 32, "BLOCK_H": 16,
                                        "BLOCK_T": prefill_rows(arch // 10) // 16, **consts}.items()
                      if k in kernel.arg_names}
            ptrs = {n for n in kernel.arg_names if n.isupper() and n not in consts}
            sig = {n: "constexpr" if n in consts else "*i32" if n in ("BT", "REQ", "KVLEN", "TOPK", "QSL", "SEQ")
                   else "*fp32" if n in ("PART", "PLSE", "LSE") else "*bf16" if n in ptrs
                   else "fp32" if n == "qk_scale" else "i32" for n in kernel.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names)
                     if n in ptrs or n.startswith("stride")}
            k = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                               target=GPUTarget("cuda", arch, 32),
                               options=dict(num_warps=warps, num_stages=stages))
            assert k.asm.get("cubin"), f"{name}: no cubin for sm_{arch}"
            ptx = Path(os.environ.get("TMPDIR", "/tmp")) / f"glm5serve-mla-{os.getpid()}.ptx"
            ptx.write_text(k.asm["ptx"])
            r = subprocess.run([str(ptxas), f"-arch=sm_{arch}{'a' if arch >= 90 else ''}", "-v", str(ptx),
                                "-o", os.devnull], capture_output=True, text=True)
            ptx.unlink()
            spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", r.stderr)]
            assert r.returncode == 0 and spills and max(spills) == 0, f"{name} {consts} sm_{arch}: {r.stderr}"

    if os.environ.get("GLM5SERVE_VLLM025_PATH"):  # a folder holding vLLM 0.25's ``vllm`` package (source)

        def test_backend_under_vllm_025():
            root = Path(__file__).resolve().parents[2]
            path = os.pathsep.join([os.environ["GLM5SERVE_VLLM025_PATH"], os.environ.get("PYTHONPATH", "")])
            env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
            r = subprocess.run([sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-x", "-k",
                                "backend or scratch", "-p", "no:cacheprovider"], cwd=root, env=env,
                               capture_output=True, text=True, timeout=900)
            assert r.returncode == 0 and "passed" in r.stdout, f"{r.stdout[-12000:]}\n{r.stderr[-3000:]}"

else:
    import torch
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from glm5serve.mla.testing import batch_params, make_batch
    from glm5serve.mla.triton_mla import mla_decode, mla_prefill, mla_reference, prefill_kv_lens
    from glm5serve.schema import split_kv_b

    from glm5serve.testing.triton_interpret import check_bounds
    from glm5serve.triton_interpreter import patch_bf16_dot

    patch_bf16_dot()
    check_bounds()  # every load and store of every kernel below stays inside its launch's tensors

    # Output error of one bf16/fp16 rounding of p and of the output, on O(1) values; LSE is fp32 throughout.
    # (vLLM's MLA backend tests allow rtol 1e-2 / atol 5e-1; these are far tighter.)
    TOL = {torch.bfloat16: dict(atol=3e-2, rtol=1e-2), torch.float16: dict(atol=4e-3, rtol=4e-3)}
    LSE_TOL = dict(atol=2e-3, rtol=1e-3)

    def _assert_matches(out, lse, ref_out, ref_lse, n, dtype, what=""):
        torch.testing.assert_close(out[:n].float(), ref_out[:n], **TOL[dtype], msg=lambda m: f"{what} out: {m}")
        torch.testing.assert_close(lse[:n], ref_lse[:n], **LSE_TOL, msg=lambda m: f"{what} lse: {m}")

    dims = st.sampled_from([(16, 16), (32, 16), (48, 8), (24, 0)])  # (kv_lora, rope): non-pow2 and NoPE too

    def _build(p):
        return make_batch(**{k: v for k, v in p.items() if k != "num_splits"})

    @settings(max_examples=20)
    @given(batch_params())
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

    def test_stale_topk_rows_stay_in_bounds():
        """Padding rows whose top-k lists hold stale or uninitialised positions (huge, past the block table) read
        nothing outside the cache, and the real rows are untouched."""
        b = make_batch([9, 20], [1, 1], 3, 32, 16, 4, torch.bfloat16, topk=8, pad_tokens=2, seed=4)
        b.topk[b.num_real:] = torch.tensor([[2**31 - 1, 10**6, 5 * 4, 4 * 5 - 1, -7, -1, 3, 0]] * 2,
                                           dtype=torch.int32)
        out, lse = mla_decode(b.q_nope, b.q_pe, b.kv_cache, b.scale, num_splits=2, **b.decode_kwargs())
        ref_out, ref_lse = mla_reference(b.q_nope, b.q_pe, b.kv_cache, b.scale, **b.decode_kwargs())
        _assert_matches(out, lse, ref_out, ref_lse, b.num_real, torch.bfloat16)

    def test_sparse_positions_past_kv_len_are_dropped():
        """With ``kv_lens``, a sparse token's list positions at or past its kv_len are dropped (``mla_decode``'s
        contract): here each list also names the later tokens of the token's own request, which are written in the
        cache, and the output equals that of the list without them. No test gave a sparse list such positions, so
        dropping the kv_len mask of the sparse path passed the suite."""
        b = make_batch([12, 7], [5, 3], 2, 32, 16, 4, torch.bfloat16, topk=6, seed=2)
        T = b.q_nope.shape[0]
        late = [list(range(int(k), int(b.seq_lens[int(r)]))) for k, r in zip(b.kv_lens, b.req_ids)]
        assert sum(map(len, late)) >= 5
        topk = torch.full((T, b.topk.shape[1] + max(map(len, late))), -1, dtype=torch.int32)
        for t in range(T):
            row = torch.cat([b.topk[t][b.topk[t] >= 0], torch.tensor(late[t], dtype=torch.int32)])
            topk[t, :len(row)] = row
        kw = dict(block_table=b.block_table, req_ids=b.req_ids, kv_lens=b.kv_lens)
        for splits in (1, 2):
            out, lse = mla_decode(b.q_nope, b.q_pe, b.kv_cache, b.scale, topk_indices=topk, num_splits=splits, **kw)
            ref_out, ref_lse = mla_reference(b.q_nope, b.q_pe, b.kv_cache, b.scale, topk_indices=b.topk, **kw)
            _assert_matches(out, lse, ref_out, ref_lse, b.num_real, torch.bfloat16, f"splits={splits}")

    def test_dense_reads_nothing_past_kv_len():
        """Dense decode: the rows past each token's kv_len (same block, later blocks, spare blocks) are NaN by
        construction; outputs are finite and equal the reference."""
        b = make_batch([5, 16, 17], [1, 1, 1], 16, 32, 16, 8, torch.bfloat16, block_pad=2, seed=3)
        out, lse = mla_decode(b.q_nope, b.q_pe, b.kv_cache, b.scale, num_splits=3, **b.decode_kwargs())
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()
        ref_out, ref_lse = mla_reference(b.q_nope, b.q_pe, b.kv_cache, b.scale, **b.decode_kwargs())
        _assert_matches(out, lse, ref_out, ref_lse, b.num_real, torch.bfloat16)

    def test_bad_index_values_read_nothing_outside():
        """Decode with index values past their tensors (fresh-user finding: each read outside the cache or the
        block table): a ``req_ids`` row outside the block table gives the token no key; a ``kv_len`` past the
        block table stops at its end; block-table entries outside the cache are dropped. ``check_bounds`` fails
        any load outside the operands; the real rows equal the reference over the keys that remain."""
        b = make_batch([5, 16, 17], [1, 1, 1], 3, 32, 16, 8, torch.bfloat16, poison=0.0, seed=5)
        span = b.block_table.shape[1] * 8  # 24 positions
        req_ids = torch.tensor([7, -1, 2, 1, 2], dtype=torch.int32)
        kv_lens = torch.tensor([5, 16, 17, 10**6, -3], dtype=torch.int32)
        q_nope, q_pe = b.q_nope[[0, 1, 2, 1, 2]], b.q_pe[[0, 1, 2, 1, 2]]
        bt = b.block_table.clone()
        bt[2, 1], bt[2, 2] = 10**6, -5  # request 2 keeps its first block only
        for splits in (1, 3):
            out, lse = mla_decode(q_nope, q_pe, b.kv_cache, b.scale, block_table=bt, kv_lens=kv_lens,
                                  req_ids=req_ids, num_splits=splits)
            keyless = [0, 1, 4]
            assert torch.equal(out[keyless], torch.zeros_like(out[keyless])) and torch.isneginf(lse[keyless]).all()
            # token 2: positions 0..7 of request 2 only; token 3: request 1 over the whole span
            topk = torch.full((5, span), -1, dtype=torch.int32)
            topk[2, :8] = torch.arange(8)
            topk[3] = torch.arange(span)
            ref_out, ref_lse = mla_reference(q_nope, q_pe, b.kv_cache, b.scale, block_table=bt,
                                             req_ids=req_ids.clamp(0, 2), topk_indices=topk)
            _assert_matches(out[2:4], lse[2:4], ref_out[2:4], ref_lse[2:4], 2, torch.bfloat16, f"splits={splits}")

    def test_prefill_bad_index_values_read_nothing_outside():
        """Prefill, dense and sparse, with a bad ``query_start_loc`` (past the T tokens, short, decreasing, not
        starting at 0), a ``seq_len`` past the block table (up to int32's maximum) and a block-table entry outside
        the cache: nothing is read or written outside the operands; a token of no request gets (0, -inf) when sparse
        and is left as it was when dense; the rows of well-formed requests equal the reference over the keys that
        remain (fresh-user findings: a decreasing qsl took tokens from request 0, a taller block table gave tokens
        of no request keys, an int32 sum wrapped)."""
        pre = make_batch([12, 7], [5, 3], 2, 32, 16, 4, torch.bfloat16, poison=0.0, topk=6, seed=2)
        span = pre.block_table.shape[1] * 4
        i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
        taller = torch.cat([pre.block_table, pre.block_table[:1]])  # vLLM's tables have rows past num_reqs
        for topk in (None, pre.topk):
            kw = dict(block_table=pre.block_table, req_ids=pre.req_ids, kv_lens=pre.kv_lens, topk_indices=topk)
            ref_out, ref_lse = mla_reference(pre.q_nope, pre.q_pe, pre.kv_cache, pre.scale, **kw)
            # (query_start_loc, block table, rows that match the reference, rows of no request)
            for qsl, bt, good, orphan in (
                    (i32(0, 5, 100), pre.block_table, range(8), []),  # clamped to the 8 tokens: as (0, 5, 8)
                    (i32(-9, 5, 8), pre.block_table, range(5, 8), range(5)),  # from -1: request 0 is skipped
                    (i32(0, 5, 6), taller, range(5), [6, 7]),
                    (i32(0, 5, 3), pre.block_table, range(5), [5, 6, 7]),
                    (i32(2, 5, 8), pre.block_table, range(5, 8), [0, 1])):
                out = torch.full_like(pre.q_nope, 7.0)
                lse = torch.full(pre.q_nope.shape[:2], 7.0)
                mla_prefill(pre.q_nope, pre.q_pe, pre.kv_cache, pre.scale, block_table=bt, query_start_loc=qsl,
                            seq_lens=pre.seq_lens, max_query_len=8, topk_indices=topk, out=out, lse=lse)
                what = f"qsl={qsl.tolist()} sparse={topk is not None}"
                good = list(good)
                _assert_matches(out[good], lse[good], ref_out[good], ref_lse[good], len(good), torch.bfloat16, what)
                for t in orphan:
                    want = (0.0, float("-inf")) if topk is not None else (7.0, 7.0)
                    assert (out[t] == want[0]).all() and (lse[t] == want[1]).all(), f"{what}: token {t}"
            # request 0's tokens see the whole block table (sparse: their whole list) however far seq_len points
            whole = torch.full((8, span), -1, dtype=torch.int32)
            whole[:5] = torch.arange(span)
            for seq_len in (10**6, 2**31 - 1):
                out, lse = mla_prefill(pre.q_nope, pre.q_pe, pre.kv_cache, pre.scale, block_table=pre.block_table,
                                       query_start_loc=pre.query_start_loc, seq_lens=i32(seq_len, 7),
                                       max_query_len=5, topk_indices=topk)
                ref = mla_reference(pre.q_nope, pre.q_pe, pre.kv_cache, pre.scale, block_table=pre.block_table,
                                    req_ids=pre.req_ids, topk_indices=whole if topk is None else topk)
                _assert_matches(out, lse, *ref, 5, torch.bfloat16, f"seq_len={seq_len} sparse={topk is not None}")
        bt = pre.block_table.clone()
        bt[1, 1] = 10**6  # request 1 loses its positions 4..7
        out, lse = mla_prefill(pre.q_nope, pre.q_pe, pre.kv_cache, pre.scale, block_table=bt,
                               query_start_loc=pre.query_start_loc, seq_lens=pre.seq_lens, max_query_len=5)
        topk = torch.full((8, span), -1, dtype=torch.int32)
        for t, kv_len in enumerate(pre.kv_lens.tolist()):
            keep = [p for p in range(kv_len) if t < 5 or not 4 <= p < 8]
            topk[t, :len(keep)] = torch.tensor(keep)
        ref_out, ref_lse = mla_reference(pre.q_nope, pre.q_pe, pre.kv_cache, pre.scale, block_table=bt,
                                         req_ids=pre.req_ids, topk_indices=topk)
        _assert_matches(out, lse, ref_out, ref_lse, 8, torch.bfloat16, "bad block")

    def test_split_merge_equals_single_pass():
        """Split-K with more splits than key tiles (empty splits), and other tile shapes, give the one-split result."""
        b = make_batch([40, 3], [1, 1], 5, 32, 16, 8, torch.float16, seed=11)
        one = mla_decode(b.q_nope, b.q_pe, b.kv_cache, b.scale, num_splits=1, **b.decode_kwargs())
        for splits, block_h, block_n in ((2, 16, 32), (7, 16, 16), (16, 16, 32), (3, 32, 16)):
            many = mla_decode(b.q_nope, b.q_pe, b.kv_cache, b.scale, num_splits=splits, block_h=block_h,
                              block_n=block_n, **b.decode_kwargs())
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
        # fresh-user findings: each of these crashed the interpreter (out too small: heap corruption), read past
        # the operands, or (num_splits 0) returned uninitialised memory
        two = make_batch([20, 9], [1, 1], 4, 32, 16, 8, torch.bfloat16)
        kw = two.decode_kwargs()
        for bad, words in (
                (dict(out=torch.empty(1, 1, 1, dtype=torch.bfloat16)),
                 r"out \(1, 1, 1\) torch.bfloat16 must be \(2, 4, 32\)"),
                (dict(lse=torch.empty(2, 4, dtype=torch.float16)), r"lse \(2, 4\) torch.float16 must be"),
                (dict(kv_lens=two.kv_lens[:1]), r"kv_lens \(1,\) torch.int32 must be a 1-D int32 tensor of >= 2"),
                (dict(kv_lens=two.kv_lens.long()), r"kv_lens \(2,\) torch.int64 must be a 1-D int32"),
                (dict(block_table=two.block_table[0]), r"block_table \(\d+,\) torch.int32 must be a 2-D"),
                (dict(num_splits=0), "num_splits must be a positive integer, not 0"),
                # fresh-user findings: strided index tensors were read as contiguous; a short req_ids past its storage
                (dict(kv_lens=torch.stack([two.kv_lens] * 2, 1)[:, 0]), r"kv_lens \(2,\) must be contiguous"),
                (dict(block_table=two.block_table.t().contiguous().t()), r"block_table \(2, \d+\) must be contig"),
                (dict(req_ids=torch.zeros(1, dtype=torch.int32)), r"req_ids \(1,\): its storage holds fewer than"),
                (dict(num_splits=-1), "num_splits must be a positive integer, not -1")):
            with pytest.raises(ValueError, match=words):
                mla_decode(two.q_nope, two.q_pe, two.kv_cache, two.scale, **{**kw, **bad})
        pre = make_batch([12, 7], [5, 3], 2, 32, 16, 4, torch.bfloat16)
        for max_query_len in (0, 9):
            words = f"max_query_len must be in 1..8 \\(the tokens\\), not {max_query_len}"
            with pytest.raises(ValueError, match=words):
                mla_prefill(pre.q_nope, pre.q_pe, pre.kv_cache, pre.scale, block_table=pre.block_table,
                            query_start_loc=pre.query_start_loc, seq_lens=pre.seq_lens, max_query_len=max_query_len)
        with pytest.raises(ValueError, match="8 query tokens but no request"):
            mla_prefill(pre.q_nope, pre.q_pe, pre.kv_cache, pre.scale, block_table=pre.block_table[:0],
                        query_start_loc=pre.query_start_loc[:1], seq_lens=pre.seq_lens[:0], max_query_len=5)

    # -----------------------------------------------------------------------------------------------------------
    # The vLLM backend (whichever vLLM is importable: 0.33 here, 0.25 with GLM5SERVE_VLLM025_PATH)
    # -----------------------------------------------------------------------------------------------------------

    def _selector_config(**kw):
        from vllm.v1.attention.selector import AttentionSelectorConfig

        base = dict(head_size=576, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None, use_mla=True,
                    use_sparse=True)
        return AttentionSelectorConfig(**{**base, **kw})

    def test_backend_registers_as_custom():
        """register_backend() makes CUSTOM resolve to the backend (what ``--attention-backend CUSTOM`` does: the
        CUDA platform resolves the enum's class and runs its validate_configuration)."""
        pytest.importorskip("vllm")
        from vllm.platforms.interface import DeviceCapability
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        from glm5serve.mla import BACKEND_CLASS, register_backend
        from glm5serve.mla.backend import TritonMLASparseBackend

        register_backend()
        register_backend()  # idempotent
        assert AttentionBackendEnum.CUSTOM.get_path() == BACKEND_CLASS
        assert AttentionBackendEnum.CUSTOM.get_class() is TritonMLASparseBackend
        assert AttentionBackendEnum[TritonMLASparseBackend.get_name()] is AttentionBackendEnum.CUSTOM
        assert TritonMLASparseBackend.validate_configuration(device_capability=DeviceCapability(9, 0),
                                                             **_selector_config()._asdict()) == []

    @pytest.mark.parametrize("cap, kw, reason", [
        ((9, 0), {}, None), ((8, 0), dict(head_size=96, dtype=torch.float16), None), ((12, 0), {}, None),
        ((10, 0), dict(kv_cache_dtype="bfloat16", block_size=16), None),
        ((7, 5), {}, "compute capability not supported"), ((9, 0), dict(use_mla=False), "MLA not supported"),
        ((9, 0), dict(use_sparse=False), "non-sparse not supported"),
        ((9, 0), dict(kv_cache_dtype="fp8"), "fp16/bf16 KV cache"),
        ((9, 0), dict(dtype=torch.float32), "dtype not supported"),
    ])
    def test_backend_validate_configuration(cap, kw, reason):
        pytest.importorskip("vllm")
        from vllm.platforms.interface import DeviceCapability

        from glm5serve.mla.backend import TritonMLASparseBackend

        reasons = TritonMLASparseBackend.validate_configuration(device_capability=DeviceCapability(*cap),
                                                                **_selector_config(**kw)._asdict())
        assert (reasons == []) if reason is None else any(reason in r for r in reasons), reasons

    @pytest.mark.parametrize("index_topk, dcp, reason", [(2048, 1, None), (None, 1, "index_topk"),
                                                          (64, 2, "decode context parallelism")])
    def test_backend_model_checks(monkeypatch, index_topk, dcp, reason):
        """supports_combination reads the current vLLM config: a DSA model, no DCP."""
        pytest.importorskip("vllm")
        import types

        import vllm.config

        from glm5serve.mla.backend import TritonMLASparseBackend

        text = types.SimpleNamespace(kv_lora_rank=512, **({} if index_topk is None else {"index_topk": index_topk}))
        cfg = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_text_config=text, hf_config=text),
                                    parallel_config=types.SimpleNamespace(decode_context_parallel_size=dcp),
                                    attention_config=types.SimpleNamespace(hisparse_config=None))
        monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: cfg)
        got = TritonMLASparseBackend.supports_combination(576, torch.bfloat16, "auto", None, True, False, True, False,
                                                          None)
        assert got is None if reason is None else reason in got

    def test_backend_builder(monkeypatch):
        """UNIFORM_BATCH CUDA graphs; on vLLM 0.25 the own builder maps tokens to requests (padding -> 0)."""
        pytest.importorskip("vllm")
        import types

        from vllm.v1.attention.backend import AttentionCGSupport

        from glm5serve.mla import backend

        assert backend.TritonMLASparseMetadataBuilder.get_cudagraph_support(None, None) == \
            AttentionCGSupport.UNIFORM_BATCH
        if backend.HAS_SPARSE_COMMON:
            from vllm.model_executor.layers.attention.sparse_mla_attention import SparseMLACommonMetadataBuilder

            assert issubclass(backend.TritonMLASparseMetadataBuilder, SparseMLACommonMetadataBuilder)
            return
        monkeypatch.setattr("vllm.utils.torch_utils.PIN_MEMORY", False)  # no driver here
        ns = types.SimpleNamespace
        vcfg = ns(scheduler_config=ns(max_num_batched_tokens=16), speculative_config=None,
                  parallel_config=ns(decode_context_parallel_size=1),
                  model_config=ns(hf_config=ns(index_topk=32)))
        builder = backend.TritonMLASparseMetadataBuilder(ns(block_size=16), ["l0"], vcfg, torch.device("cpu"))
        cm = ns(query_start_loc_cpu=torch.tensor([0, 1, 4, 6], dtype=torch.int32), num_reqs=3, max_query_len=3,
                max_seq_len=50, num_actual_tokens=8, query_start_loc=None, slot_mapping=None,
                block_table_tensor=torch.zeros(3, 4, dtype=torch.int32))
        md = builder.build(0, cm)
        assert md.req_id_per_token.tolist() == [0, 1, 1, 1, 2, 2, 0, 0]
        assert (md.block_size, md.topk_tokens) == (16, 32)

    @pytest.mark.parametrize("need_lse", [False, True])
    def test_backend_forward_mqa_runs_the_kernel(need_lse):
        """The impl's forward_mqa on vLLM's inputs (ql_nope as the transposed bmm output, a top-k buffer longer than
        the batch, token -> request map) == reference; the lse is returned only when vLLM asks for it."""
        pytest.importorskip("vllm")
        import types

        from glm5serve.mla import backend

        b = make_batch([13, 30, 7], [1, 2, 1], 5, 32, 16, 8, torch.bfloat16, topk=16, scatter_pad=True,
                       topk_fill=0.8, seed=2)
        impl = object.__new__(backend.TritonMLASparseImpl)  # the attributes forward_mqa reads, no vLLM config
        impl.num_heads, impl.kv_lora_rank, impl.scale = 5, 32, b.scale
        impl.need_to_return_lse_for_decode = need_lse
        impl.topk_indices_buffer = torch.cat([b.topk, torch.full((3, 16), 7, dtype=torch.int32)])
        impl._init_triton()
        ql_nope = b.q_nope.transpose(0, 1).contiguous().transpose(0, 1)  # (B, N, L) view of an (N, B, L) bmm
        md = types.SimpleNamespace(block_table=b.block_table,
                                   req_id_per_token=torch.cat([b.req_ids, torch.zeros(3, dtype=torch.int32)]))
        out, lse = impl.forward_mqa((ql_nope, b.q_pe), b.kv_cache, md, None)
        ref_out, ref_lse = mla_reference(b.q_nope, b.q_pe, b.kv_cache, b.scale, **b.decode_kwargs())
        torch.testing.assert_close(out.float(), ref_out, **TOL[torch.bfloat16])
        assert (lse is not None) == need_lse
        if need_lse:
            torch.testing.assert_close(lse, ref_lse, **LSE_TOL)
        out2, _ = impl.forward_mqa(torch.cat([b.q_nope, b.q_pe], -1), b.kv_cache, md, None)  # fused q
        assert torch.equal(out2, out)

    def test_split_scratch_bound():
        """The shared split-K scratch covers every batch size the default split choice can produce."""
        from glm5serve.mla.backend import scratch_numel
        from glm5serve.mla.triton_mla import default_num_splits, split_workspace_numel

        cpu = torch.device("cpu")  # 4 "SMs"
        for H in (1, 3, 8, 16, 17, 64, 128):
            for T in range(1, 200):
                for keys in (1, 64, 2048):
                    need = split_workspace_numel(T, H, default_num_splits(T, H, keys, cpu), 512)
                    assert need <= scratch_numel(H, 512, 4), (T, H, keys)

    def test_select_backend(monkeypatch):
        """CUSTOM is chosen for a DSA model only when vLLM's selector finds no sparse backend or the dims are not
        512 + 64, and never over the user's choice."""
        pytest.importorskip("vllm")
        import types

        from vllm.platforms import current_platform
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        import glm5serve.mla as mla

        def config(dims=(512, 64), topk=2048, backend=None):
            text = types.SimpleNamespace(kv_lora_rank=dims[0], qk_rope_head_dim=dims[1], index_topk=topk)
            mc = types.SimpleNamespace(hf_text_config=text, use_mla=True, dtype=torch.bfloat16,
                                       get_head_size=lambda: sum(dims), get_num_attention_heads=lambda p: 8)
            return types.SimpleNamespace(model_config=mc, cache_config=types.SimpleNamespace(cache_dtype="auto"),
                                         parallel_config=None, attention_config=types.SimpleNamespace(backend=backend))

        def no_backend(*a, **k):
            raise ValueError("No valid attention backend")

        monkeypatch.setattr("vllm.config.set_current_vllm_config", lambda cfg: __import__("contextlib").nullcontext())
        monkeypatch.setattr(type(current_platform), "get_attn_backend_cls",
                            classmethod(lambda cls, *a, **k: "vllm.FlashMLASparse"))
        monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: False)
        c = config(dims=(256, 32))  # not a CUDA platform (this CPU): never chosen, whatever the dims
        assert not mla.select_backend(c) and c.attention_config.backend is None
        monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
        c = config()
        assert not mla.select_backend(c) and c.attention_config.backend is None
        c = config(dims=(256, 32))
        assert mla.select_backend(c) and c.attention_config.backend is AttentionBackendEnum.CUSTOM
        c = config(dims=(256, 32), backend=AttentionBackendEnum.TRITON_MLA)
        assert not mla.select_backend(c) and c.attention_config.backend is AttentionBackendEnum.TRITON_MLA
        monkeypatch.setattr(type(current_platform), "get_attn_backend_cls", classmethod(no_backend))
        c = config()
        assert mla.select_backend(c) and c.attention_config.backend is AttentionBackendEnum.CUSTOM
        c = config(topk=None)
        del c.model_config.hf_text_config.index_topk
        assert not mla.select_backend(c)

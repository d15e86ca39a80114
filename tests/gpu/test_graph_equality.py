"""Eager vs CUDA-graph equality at op and layer level (issue 6, item 2; bug classes 15, 16, 18), many Hypothesis
examples: glm5serve's GGUF GEMV and MoE kernels, its MLA decode kernel, and the reference engine's layers.

For each drawn case: capture the op once on static buffers, then for fresh inputs written *into those buffers*
replay it and compare with an eager call on the same inputs -- bit for bit (class 18: right only with
``--enforce-eager``). Between replays, eager calls of other shapes run, so a kernel that grew or moved an internal
buffer (counters, workspaces) while the graph kept the old address fails (class 15); the captured outputs and inputs
keep their ``data_ptr()``. Rows a captured batch holds only as padding are poisoned with NaN/inf and the real rows
must not change by a bit (class 16). Engine-level graph checks (vLLM with cudagraphs) are in the GPU e2e tests.

Run on a GPU host: ``python -m pytest tests/gpu/test_graph_equality.py -m gpu -q``.
``GLM5SERVE_TEST_DEVICE=cpu TRITON_INTERPRET=1`` runs the same tests on the CPU through Triton's interpreter with an
eager stand-in for the graph (checks the tests' own logic, not CUDA graphs).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from glm5serve.testing import assert_bitwise_equal
from glm5serve.testing import strategies as gst

DEV = os.environ.get("GLM5SERVE_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")]
GRAPH = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

TYPES = (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
POISONS = (float("nan"), float("inf"), float("-inf"))


class Captured:
    """``fn()`` captured in a CUDA graph after a warm-up on a side stream (as vLLM captures); ``out`` is the tensor
    (or tuple of tensors) the capture returned. On a CPU dry run, ``replay`` re-runs ``fn`` into ``out``."""

    def __init__(self, fn):
        self.fn = fn
        if DEV != "cuda":
            self.out = fn()
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn()

    def outputs(self) -> tuple[torch.Tensor, ...]:
        return self.out if isinstance(self.out, tuple) else (self.out,)

    def replay(self) -> None:
        ptrs = [t.data_ptr() for t in self.outputs()]
        if DEV == "cuda":
            self.graph.replay()
        else:
            fresh = self.fn()
            for o, f in zip(self.outputs(), fresh if isinstance(fresh, tuple) else (fresh,)):
                o.copy_(f)
        assert [t.data_ptr() for t in self.outputs()] == ptrs, "a captured output moved"


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit-identical, NaN where NaN (a graph replays the same kernels on the same data)."""
    assert_bitwise_equal(a, b, f"{what}: replay != eager")


# -- GGUF GEMV ----------------------------------------------------------------------------------------------------

@GRAPH
@given(qtype=st.sampled_from(TYPES), n=st.integers(1, 300), blocks=st.integers(1, 8), real=st.integers(1, 16),
       pad=st.integers(0, 8), dtype=st.sampled_from((torch.bfloat16, torch.float16, torch.float32)),
       split_k=st.sampled_from((None, 1, 3)), poison=st.sampled_from(POISONS), seed=st.integers(0, 2**16))
def test_gemv_replay_equals_eager(qtype, n, blocks, real, pad, dtype, split_k, poison, seed):
    """``gguf_linear`` on a static (real + pad)-row batch: replay == eager for fresh inputs; NaN/inf padding rows
    leave the real rows' outputs unchanged; eager GEMVs of other shapes in between do not disturb the graph."""
    from glm5serve.kernels import GemvConfig, gguf_linear
    from glm5serve.kernels.gguf_gemv import BLOCK_SIZES
    from glm5serve.kernels.testing import random_qweight

    k = blocks * BLOCK_SIZES[int(qtype)][0]
    rng = np.random.default_rng(seed)
    w = torch.from_numpy(random_qweight(qtype, n, k, rng)).to(DEV)
    cfg = None if split_k is None else GemvConfig(split_k=split_k)
    m = real + pad
    x = torch.randn(m, k, generator=_seeded(seed)).to(dtype).to(DEV)
    x_ptr = x.data_ptr()
    graph = Captured(lambda: gguf_linear(x, w, qtype, n, cfg))
    other = torch.from_numpy(random_qweight(qtype, 2 * n + 17, k, rng)).to(DEV)
    for step in range(3):
        fresh = torch.randn(m, k, generator=_seeded(seed + 1 + step)).to(dtype).to(DEV)
        if step == 2:
            fresh[real:] = 0.0
        x.copy_(fresh)
        eager = gguf_linear(fresh, w, qtype, n, cfg)
        gguf_linear(torch.randn(m + 5, k).to(dtype).to(DEV), other, qtype, 2 * n + 17,
                    None if cfg is None else GemvConfig(split_k=split_k + 1))  # other shapes, other splits
        if step == 2 and pad:  # the real rows must not see the padding
            x[real:] = poison
        graph.replay()
        _equal(graph.out[:real], eager[:real], f"{qtype.name} step {step}")
        if step < 2:
            _equal(graph.out, eager, f"{qtype.name} step {step} (all rows)")
    assert x.data_ptr() == x_ptr


# -- GGUF MoE -----------------------------------------------------------------------------------------------------

@GRAPH
@given(q13=st.sampled_from(TYPES), q2=st.sampled_from(TYPES), experts=st.integers(2, 8), top_k=st.integers(1, 3),
       real=st.integers(1, 8), pad=st.integers(0, 4), dtype=st.sampled_from((torch.bfloat16, torch.float16)),
       poison=st.sampled_from(POISONS), seed=st.integers(0, 2**16))
def test_moe_replay_equals_eager(q13, q2, experts, top_k, real, pad, dtype, poison, seed):
    """``gguf_moe`` with static activations, routing ids and weights: replay == eager for fresh routing; padding
    tokens (poisoned activations, weights 0, as a padded batch carries them) leave the real tokens unchanged."""
    from glm5serve.kernels import gguf_moe
    from glm5serve.kernels.gguf_gemv import BLOCK_SIZES
    from glm5serve.kernels.testing import random_qweight

    top_k = min(top_k, experts)
    rng = np.random.default_rng(seed)
    hidden, inter = BLOCK_SIZES[int(q13)][0] * 2, BLOCK_SIZES[int(q2)][0] * 2
    w13 = torch.from_numpy(np.stack([random_qweight(q13, 2 * inter, hidden, rng) for _ in range(experts)])).to(DEV)
    w2 = torch.from_numpy(np.stack([random_qweight(q2, hidden, inter, rng) for _ in range(experts)])).to(DEV)
    t = real + pad

    def routing(step: int):
        g = _seeded(seed + step)
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(t)]).int()
        return torch.randn(t, hidden, generator=g).to(dtype), ids, torch.rand(t, top_k, generator=g)

    x, ids, wts = (a.to(DEV) for a in routing(0))
    graph = Captured(lambda: gguf_moe(x, w13, w2, wts, ids, q13, q2))
    for step in (1, 2):
        fx, fids, fwts = (a.to(DEV) for a in routing(step))
        if step == 2:
            fwts[real:] = 0.0
        x.copy_(fx), ids.copy_(fids), wts.copy_(fwts)
        eager = gguf_moe(fx, w13, w2, fwts, fids, q13, q2)
        gguf_moe(fx[:1].repeat(t + 3, 1), w13, w2, fwts[:1].repeat(t + 3, 1), fids[:1].repeat(t + 3, 1), q13, q2)
        if step == 2 and pad:
            x[real:] = poison
        graph.replay()
        _equal(graph.out[:real], eager[:real], f"{q13.name}/{q2.name} step {step}")


# -- MLA decode over the paged latent cache ----------------------------------------------------------------------

@GRAPH
@given(batch=gst.batch_compositions(max_requests=4, max_seq_len=80, max_query_len=1, max_pad=3),
       heads=st.sampled_from((1, 4, 16)), topk=st.sampled_from((None, 8, 64)),
       dtype=st.sampled_from((torch.bfloat16, torch.float16)), poison=st.sampled_from(POISONS),
       seed=st.integers(0, 2**16))
def test_mla_decode_replay_equals_eager(batch, heads, topk, dtype, poison, seed):
    """``mla_decode`` (dense, or DSA top-k) captured on static queries, block table, lengths and top-k lists with a
    preallocated output and split-K workspace (as a CUDA-graph backend must): fresh contents of those buffers
    replay == eager; padding tokens (poisoned queries, no keys) leave the real tokens unchanged."""
    from glm5serve.mla.testing import make_batch
    from glm5serve.mla.triton_mla import default_num_splits, mla_decode, split_workspace_numel

    seq_lens, q_lens, pad = batch
    dims = dict(kv_lora_rank=64, rope_dim=16, block_size=16)

    def build(s: int, poisoned: float):
        return make_batch(seq_lens, q_lens, heads, dims["kv_lora_rank"], dims["rope_dim"], dims["block_size"],
                          dtype, topk=topk, pad_tokens=pad, poison=poisoned, seed=s, device=DEV)

    b = build(seed, 0.0)
    t = b.q_nope.shape[0]
    splits = default_num_splits(t, heads, topk or 8192, b.q_nope.device)
    ws = torch.empty(max(1, split_workspace_numel(t, heads, splits, dims["kv_lora_rank"])), dtype=torch.float32,
                     device=DEV)
    out = torch.empty_like(b.q_nope)
    lse = torch.empty(t, heads, dtype=torch.float32, device=DEV)
    static = dict(q_nope=b.q_nope.clone(), q_pe=b.q_pe.clone(), kv_cache=b.kv_cache.clone())
    kw = {k: v.clone() for k, v in b.decode_kwargs().items()}

    def run():
        return mla_decode(static["q_nope"], static["q_pe"], static["kv_cache"], b.scale, num_splits=splits,
                          out=out, lse=lse, workspace=ws, **kw)

    graph = Captured(run)
    for step, poisoned in ((1, 0.0), (2, poison)):
        fresh = build(seed + step, 0.0)  # same composition: same shapes, new values and top-k lists
        for name in static:
            static[name].copy_(getattr(fresh, name))
        for name, v in fresh.decode_kwargs().items():
            kw[name].copy_(v)
        eager = mla_decode(fresh.q_nope, fresh.q_pe, fresh.kv_cache, b.scale, num_splits=splits,
                           **fresh.decode_kwargs())
        mla_decode(fresh.q_nope, fresh.q_pe, fresh.kv_cache, b.scale, num_splits=max(1, splits // 2),
                   **fresh.decode_kwargs())  # another split count in between, with its own scratch
        if b.num_real < t:
            static["q_nope"][b.num_real:] = poisoned
            static["q_pe"][b.num_real:] = poisoned
        graph.replay()
        n = b.num_real
        _equal(out[:n], eager[0][:n], f"out step {step}")
        _equal(lse[:n], eager[1][:n], f"lse step {step}")


# -- the reference engine's layers -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference_on_device(tiny_checkpoint):
    from glm5serve.reference import ReferenceModel

    return ReferenceModel.from_gguf(tiny_checkpoint, dtype=torch.float32, device=DEV)


@settings(deadline=None, max_examples=15, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(real=st.integers(1, 20), pad=st.integers(0, 4), mla=st.sampled_from(("expanded", "absorbed")),
       poison=st.sampled_from(POISONS), seed=st.integers(0, 2**16))
def test_reference_layers_replay_equal_eager(reference_on_device, real, pad, mla, poison, seed):
    """The reference's layer-0 block on the GPU -- RMSNorm, MLA attention with the DSA indexer (T crosses
    index_topk = 8), dense SwiGLU -- captured once: replay == eager for fresh hidden states. The row-wise parts
    (norm, SwiGLU) also keep their real rows when the padding rows are poisoned. (Attention mixes rows by design:
    a causal batch is not padded in the middle.)"""
    from glm5serve.reference import rms_norm, rope_cos_sin

    ref = reference_on_device
    ref.mla = mla
    h = ref.cfg.hidden_size
    positions = torch.arange(real, device=DEV)
    cos, sin = rope_cos_sin(positions, ref.rope, ref.rope_theta)
    norm_w = ref._p(0, "input_layernorm.weight")
    x = torch.randn(real, h, generator=_seeded(seed)).to(DEV)
    rows = torch.randn(real + pad, h, generator=_seeded(seed)).to(DEV)

    def attention():
        return ref.attention(0, rms_norm(x, norm_w, ref.rms_eps), positions, cos, sin, None, None)[0]

    def rowwise():
        return ref.ffn(0, rms_norm(rows, norm_w, ref.rms_eps))

    try:
        graphs = [(Captured(attention), attention, x, None), (Captured(rowwise), rowwise, rows, real)]
        for step in (1, 2):
            for graph, fn, buf, n_real in graphs:
                buf.copy_(torch.randn(buf.shape, generator=_seeded(seed + step)).to(DEV))
                if n_real is not None and step == 2:
                    buf[n_real:] = 0.0
                eager = fn().clone()
                if n_real is not None and step == 2 and pad:
                    buf[n_real:] = poison
                graph.replay()
                keep = slice(None) if n_real is None else slice(0, n_real)
                _equal(graph.out[keep], eager[keep], f"{fn.__name__} step {step}")
    finally:
        ref.mla = "expanded"

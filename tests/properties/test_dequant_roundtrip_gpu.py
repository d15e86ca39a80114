"""Dequant round trips, GPU half (issue 6, item 2; bug classes 9 and 10): the GGUF kernels that run on the GPU
against gguf-py's dequantizer (the oracle), for fp16, bf16 and fp32 activations, on drawn types and shapes.

- vllm-gguf-plugin's Triton kernels (what the plugin runs on the GPU host, where its CUDA extension does not load):
  dequantize (upstream tolerance atol 1e-2, rtol 4e-2) and the a8 matmul (upstream atol 1, rtol 0.1, plus a budget
  relative to ``|x| @ |W|ᵀ`` that the 8-bit activation quantization keeps far inside);
- the plugin's CUDA extension: the same checks when it loads, else skipped with the reason;
- glm5serve's GEMV with fp32 activations (bf16/fp16 are in ``tests/gpu/test_kernels_gpu.py``) and its MoE with
  fp16 activations whose partial sums over experts pass fp16's range while the result stays inside it (class 10).

glm5serve's own dequantizer on CUDA is checked bit for bit in ``tests/unit/test_dequant.py::test_cuda_matches_cpu``.
``GLM5SERVE_TEST_DEVICE=cpu TRITON_INTERPRET=1`` runs the Triton kernels here through Triton's interpreter (slow;
for checking the tests themselves).
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from glm5serve.testing import strategies as gst
from vllm_layers import gguf_py_values

DEV = os.environ.get("GLM5SERVE_TEST_DEVICE", "cuda")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_TYPES = gst.BLOCK_TYPES
GLM5SERVE_GEMV_TYPES = (Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


@st.composite
def weights(draw, types=BLOCK_TYPES, max_rows: int = 40, max_blocks: int = 4, scale: float = 1.0):
    """(qtype, raw uint8 (N, row_bytes), float64 values (N, K) by gguf-py)."""
    qtype = draw(st.sampled_from(types))
    n = draw(st.integers(1, max_rows))
    k = draw(st.integers(1, max_blocks)) * GGML_QUANT_SIZES[qtype][0]
    raw = draw(gst.finite_gguf_rows(qtype, n, k, scale=scale))
    return qtype, raw, gguf_py_values(raw, qtype, (n, k))


def _x(data, k: int, dtype: torch.dtype, max_m: int = 16) -> torch.Tensor:
    m = data.draw(st.integers(1, max_m), label="tokens")
    seed = data.draw(st.integers(0, 2**16), label="x seed")
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _plugin_triton():
    try:
        from vllm_gguf_plugin.triton.dequantize.interface import ggml_dequantize_triton
        from vllm_gguf_plugin.triton.gemm.interface import ggml_mul_mat_a8_triton
    except Exception as e:  # noqa: BLE001 - any import failure means "not available on this host"
        pytest.skip(f"vllm-gguf-plugin's Triton kernels are not importable: {type(e).__name__}: {e}")
    return ggml_dequantize_triton, ggml_mul_mat_a8_triton


def _plugin_cuda_ops():
    """The plugin's CUDA extension ops, or a skip saying why they are unavailable."""
    try:
        from vllm_gguf_plugin import _C_gguf  # noqa: F401
    except Exception as e:  # noqa: BLE001
        pytest.skip("vllm-gguf-plugin's CUDA extension does not load with this host's torch "
                    f"(torch {torch.__version__}; it was built for another): {type(e).__name__}: {e}"[:300])
    if DEV != "cuda":
        pytest.skip("the plugin's CUDA extension needs a CUDA device")
    return torch.ops._C_gguf


def _check_matmul(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, what: str) -> None:
    ref = x.double().cpu() @ w.T
    bound = x.double().abs().cpu() @ w.abs().T
    y = y.double().cpu()
    assert torch.isfinite(y).all(), f"{what}: non-finite output"
    torch.testing.assert_close(y, ref, atol=1.0, rtol=0.1, msg=what)  # upstream's criterion
    assert ((y - ref).abs() <= 2.0 ** -5 * bound + 2.0 ** -7 * ref.abs() + 1e-6).all(), what


@settings(deadline=None)
@given(w=weights(), dtype=st.sampled_from(DTYPES))
def test_plugin_triton_dequantize_matches_gguf_py(w, dtype):
    """Class 9: the plugin's Triton dequantizer, for each output dtype, against gguf-py (upstream tolerance)."""
    dequantize_triton, _ = _plugin_triton()
    qtype, raw, values = w
    got = dequantize_triton(torch.from_numpy(raw).to(DEV), int(qtype), *values.shape, dtype)
    assert got.dtype == dtype and tuple(got.shape) == tuple(values.shape)
    torch.testing.assert_close(got.cpu().double(), values.to(dtype).double(), atol=1e-2, rtol=4e-2,
                               msg=f"{qtype.name} {dtype}")


@settings(deadline=None)
@given(w=weights(), dtype=st.sampled_from(DTYPES), data=st.data())
def test_plugin_triton_matmul_matches_gguf_py(w, dtype, data):
    """Class 9 (vllm#30090/#30408: kernels right for one activation dtype only): the plugin's Triton a8 matmul
    for fp16, bf16 and fp32 activations against ``x @ Wᵀ`` with gguf-py's W."""
    _, mul_mat_triton = _plugin_triton()
    qtype, raw, values = w
    x = _x(data, values.shape[1], dtype)
    y = mul_mat_triton(torch.from_numpy(raw).to(DEV), x.to(DEV), int(qtype), values.shape[0])
    assert y.dtype == dtype and tuple(y.shape) == (x.shape[0], values.shape[0])
    _check_matmul(y, x, values, f"plugin Triton {qtype.name} {dtype} M={x.shape[0]}")


@settings(deadline=None, max_examples=10)
@given(w=weights(), dtype=st.sampled_from(DTYPES), data=st.data())
def test_plugin_cuda_extension_matches_gguf_py(w, dtype, data):
    """The plugin's CUDA kernels (MMVQ for small batches, dequantize), where the extension loads."""
    ops = _plugin_cuda_ops()
    qtype, raw, values = w
    qweight = torch.from_numpy(raw).to(DEV)
    got = ops.ggml_dequantize(qweight, int(qtype), *values.shape, dtype)
    torch.testing.assert_close(got.cpu().double(), values.to(dtype).double(), atol=1e-2, rtol=4e-2)
    if dtype != torch.float32:
        x = _x(data, values.shape[1], dtype, max_m=6)
        y = ops.ggml_mul_mat_vec_a8(qweight, x.to(DEV), int(qtype), values.shape[0])
        _check_matmul(y, x, values, f"plugin CUDA {qtype.name} {dtype}")


@settings(deadline=None)
@given(w=weights(types=GLM5SERVE_GEMV_TYPES, max_rows=70, scale=0.05), data=st.data())
def test_glm5serve_gemv_fp32_activations(w, data):
    """glm5serve's GEMV with fp32 activations: fp32 products and sums, so the error is fp32 rounding only."""
    from glm5serve.kernels import gguf_linear

    qtype, raw, values = w
    x = _x(data, values.shape[1], torch.float32)
    y = gguf_linear(x.to(DEV), torch.from_numpy(raw).to(DEV), qtype, values.shape[0])
    assert y.dtype == torch.float32
    ref, bound = x.double() @ values.T, x.double().abs() @ values.abs().T
    assert ((y.double().cpu() - ref).abs() <= 2.0 ** -20 * bound + 1e-30).all(), f"{qtype.name}"


@settings(deadline=None, max_examples=10)
@given(q13=st.sampled_from(GLM5SERVE_GEMV_TYPES), q2=st.sampled_from(GLM5SERVE_GEMV_TYPES),
       seed=st.integers(0, 2**16))
def test_class10_moe_sum_over_experts_stays_finite_in_fp16(q13, q2, seed):
    """Class 10 (vllm#13167/#13232): fp16 activations, three experts of one token whose weighted outputs are
    +c, +c and -0.8c with |1.2c| up to 6e4 (top-k weights with the routed scaling folded in): the result is
    representable, the running sum of the first two is not. glm5serve's MoE must return finite values within fp16
    rounding of the fp64 result with the fp32 decode (q8=False), and with int8 activations (q8=True: a Q4_K
    projection's x and h rounded to int8 blocks, the GPU's default) within fp16 rounding of the float64 value of
    that int8 arithmetic (``q8_moe_model``, plus its codes of h at a tie): the fp64 result itself is too sharp there
    (seed 620, Q4_K gate+up, Q4_0 down: 441 off, 1.14x the fp16 budget) and ``q8_moe_bound`` too loose (above |y|)."""
    from glm5serve.kernels import gguf_moe
    from glm5serve.kernels.gguf_gemv_q8 import quantize_activations
    from glm5serve.kernels.testing import dequant, q8_moe_model, random_qweight, reference_moe

    rng = np.random.default_rng(seed)
    hidden = GGML_QUANT_SIZES[q13][0] * 2
    inter = GGML_QUANT_SIZES[q2][0] * 2
    one13, one2 = random_qweight(q13, 2 * inter, hidden, rng), random_qweight(q2, hidden, inter, rng)
    w13, w2 = np.stack([one13] * 3), np.stack([one2] * 3)  # three identical experts: parallel outputs
    x = torch.from_numpy(rng.standard_normal((1, hidden)).astype(np.float32)).half()
    ids = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    unit, _ = reference_moe(x.float(), dequant(w13, q13), dequant(w2, q2), torch.tensor([[1.0, 0.0, 0.0]]), ids)
    c = 6e4 / 1.2 / float(unit.abs().max())
    wts = torch.tensor([[c, c, -0.8 * c]], dtype=torch.float32)
    ref, bound = reference_moe(x.float(), dequant(w13, q13), dequant(w2, q2), wts, ids)
    assert float(ref.abs().max()) <= 6.01e4 and float((2 * c * unit).abs().max()) > 65504
    cases = [(False, ref, 0.0)]
    if Q.Q4_K in (q13, q2):  # q8 runs only Q4_K projections with int8 activations
        xq, xd, _ = quantize_activations(x.to(DEV))
        model, tie = q8_moe_model(x.float(), xq, xd, w13, w2, q13, q2, wts, ids)
        cases.append((True, model, tie))
    for q8, want, tie in cases:
        y = gguf_moe(x.to(DEV), torch.from_numpy(w13).to(DEV), torch.from_numpy(w2).to(DEV), wts.to(DEV),
                     ids.to(DEV), q13, q2, q8=q8)
        assert y.dtype == torch.float16 and torch.isfinite(y).all(), f"fp16 MoE output overflowed (q8={q8})"
        err = (y.double().cpu() - want).abs()
        tol = 2.0 ** -10 * want.abs() + 2.0 ** -14 * bound + 1e-3 + tie
        assert (err <= tol).all(), f"q8={q8}: max error {err.max():.3g}, {(err / tol).max():.3g}x the budget"

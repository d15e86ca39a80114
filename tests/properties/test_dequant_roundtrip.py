"""Dequant round trips (issue 6, item 2; bug class 9): glm5serve.dequant equals gguf-py on any bytes, for every type
and output dtype; numpy and torch inputs agree; quantize -> dequantize stays within a per-type error bound and no
worse than ggml's own quantizer."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants
from hypothesis import given
from hypothesis import strategies as st

from glm5serve.dequant import dequantize
from glm5serve.quantize import quantize
from glm5serve.testing import assert_bitwise_equal, llamacpp
from glm5serve.testing import strategies as gst


def gguf_py(raw: np.ndarray, qtype: Q) -> np.ndarray:
    with np.errstate(all="ignore"):
        typed = {Q.F32: np.float32, Q.F16: np.float16}.get(qtype)
        return gguf_quants.dequantize(raw.view(typed) if typed else raw, qtype)


@given(tensor=gst.quant_types().flatmap(gst.gguf_tensors), dtype=st.sampled_from(gst.DEQUANT_DTYPES))
def test_dequant_equals_gguf_py_on_any_bytes(tensor, dtype):
    raw, qtype, shape = tensor
    expected = torch.from_numpy(gguf_py(raw, qtype)).to(dtype)
    got = dequantize(raw, qtype, dtype=dtype)
    assert tuple(got.shape) == shape
    assert_bitwise_equal(got, expected, f"{qtype.name} {dtype}")


@given(tensor=gst.quant_types().flatmap(gst.gguf_tensors), dtype=st.sampled_from(gst.DEQUANT_DTYPES))
def test_numpy_and_torch_data_give_identical_results(tensor, dtype):
    raw, qtype, shape = tensor
    a = dequantize(raw, qtype, shape, dtype=dtype)
    b = dequantize(torch.from_numpy(raw.copy()), qtype, shape, dtype=dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(a.view(bits), b.view(bits))  # NaN payloads included


# --- quantize -> dequantize -------------------------------------------------------------------------------------
# Per-type bound on each block's largest error, in nominal quantization steps: amax / 2^(bits-1) for the symmetric
# formats, (max - min(min, 0)) / (2^bits - 1) for those with a min. Symmetric 4/5-bit clip the top code (a full
# step); K-quants also round each sub-block's scale and min to 6 bits. On top of the steps: fp16 rounding of the
# block scales (2^-10 of the block's amax) and fp16 subnormal scales (the largest code times scale product the
# dequantizer applies to one fp16 scale, times fp16's smallest step 2^-24) -- tiny weights make ggml's scales
# subnormal, which costs precision by design.
FORMATS = {  # qtype: (bits, symmetric, steps allowed, largest multiplier of one fp16 scale)
    Q.Q4_0: (4, True, 1.0, 8), Q.Q5_0: (5, True, 1.0, 16), Q.Q8_0: (8, True, 0.55, 127),
    Q.Q4_1: (4, False, 0.55, 15), Q.Q5_1: (5, False, 0.55, 31),
    Q.Q4_K: (4, False, 1.5, 63 * 15 + 63 * 63), Q.Q5_K: (5, False, 1.5, 63 * 31 + 63 * 63),
    Q.Q6_K: (6, True, 0.6, 128 * 32),
}
weights_256 = gst.float_weights(st.tuples(st.integers(1, 3), st.sampled_from([256, 512, 1024])))


@given(qtype=st.sampled_from(tuple(FORMATS)), x=weights_256)
def test_quantize_round_trip_error_within_type_bound(qtype, x):
    bits, symmetric, steps, mult = FORMATS[qtype]
    y = dequantize(quantize(x, qtype), qtype, x.shape).numpy().astype(np.float64)
    block_size = GGML_QUANT_SIZES[qtype][0]
    xb, yb = x.reshape(-1, block_size).astype(np.float64), y.reshape(-1, block_size)
    amax = np.abs(xb).max(axis=1)
    if symmetric:
        step = amax / 2 ** (bits - 1)
    else:
        step = (xb.max(axis=1) - np.minimum(xb.min(axis=1), 0)) / (2**bits - 1)
    allowed = steps * step + 2.0**-10 * amax + mult * 2.0**-24
    err = np.abs(xb - yb).max(axis=1)
    worst = int(np.argmax(err - allowed))
    assert err[worst] <= allowed[worst], f"{qtype.name} block {worst}: error {err[worst]} > {allowed[worst]}"


@given(qtype=st.sampled_from((Q.F16, Q.BF16)), x=weights_256)
def test_float_round_trip_within_half_ulp(qtype, x):
    mantissa = {Q.F16: 10, Q.BF16: 7}[qtype]
    y = dequantize(quantize(x, qtype), qtype, x.shape).numpy()
    bound = np.abs(x) * 2.0 ** -(mantissa + 1) + 2.0**-25  # round to nearest; fp16 subnormals below 6e-5
    assert np.all(np.abs(x.astype(np.float64) - y) <= bound)


@given(qtype=st.sampled_from(tuple(FORMATS) + (Q.F16, Q.BF16)),
       x=gst.float_weights(st.tuples(st.integers(1, 2), st.sampled_from([256, 512])),
                           scales=(1e-6, 1e-4) + gst.WEIGHT_SCALES))
def test_quantize_no_worse_than_ggml(qtype, x):
    """Error (llama.cpp's metric) at most 1.1x ggml's own quantizer's, tiny weights included."""
    if not llamacpp.available():
        pytest.skip("llama_cpp (llama-cpp-python's libggml) is not installed: no ggml quantizer to compare with")

    def err(q):
        d = gguf_py(q, qtype).reshape(x.shape).astype(np.float64) - x
        return np.sqrt(np.sum(d * d)) / x.size

    assert err(quantize(x, qtype)) <= 1.1 * err(llamacpp.ggml_quantize(x, qtype)) + 1e-12

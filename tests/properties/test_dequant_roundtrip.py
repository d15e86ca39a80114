"""Dequant round trips (issue 6, item 2): glm5serve.dequant equals gguf-py on any bytes, for every type and output
dtype; numpy and torch inputs agree. Quantize->dequantize error bounds live further down."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants as gguf_quants
from hypothesis import given
from hypothesis import strategies as st

from glm5serve.dequant import dequantize
from glm5serve.testing import assert_bitwise_equal
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

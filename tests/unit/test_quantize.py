"""glm5serve.quantize: bytes gguf-py decodes, llama.cpp's test-quantize-fns error limit computed its way, and
error no worse than 1.1x ggml's own quantizer (called through llama-cpp-python's libggml) on the same arrays."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf import quants as gguf_quants

from glm5serve.dequant import dequantize
from glm5serve.errors import GGUFModelError
from glm5serve.quantize import OWN_TYPES, QUANTIZE_TYPES, _seq_sum, quantize
from glm5serve.testing import llamacpp

BLOCK_TYPES = [t for t in QUANTIZE_TYPES if t not in (Q.F32, Q.F16)]
ids = lambda t: t.name  # noqa: E731


def cos_data(offset: float, n: int = 4096, amplitude: float = 2.0) -> np.ndarray:
    """test-quantize-fns.cpp ``generate_data``: ``0.1 + amplitude*cosf(i + offset)`` (the 0.1 is a double)."""
    c = np.cos(np.arange(n, dtype=np.float32) + np.float32(offset)).astype(np.float32)
    return (0.1 + (np.float32(amplitude) * c).astype(np.float64)).astype(np.float32)


def llama_rmse(x: np.ndarray, y: np.ndarray) -> float:
    """test-quantize-fns.cpp ``array_rmse``: ``sqrt(sum((a-b)^2 in double)) / n`` (an RMS error over sqrt(n))."""
    diff = (x.astype(np.float32) - y.astype(np.float32)).astype(np.float64).reshape(-1)
    return float(np.sqrt(np.sum(diff * diff)) / diff.size)


def round_trip(x: np.ndarray, qtype: Q) -> np.ndarray:
    q = quantize(x, qtype)
    return dequantize(q, qtype, x.shape).numpy()


def test_arrays() -> dict[str, np.ndarray]:
    """Weight-like arrays for the comparison with ggml: 8 rows of 4096 each."""
    rng = np.random.default_rng(1234)
    base = rng.standard_normal((8, 4096)).astype(np.float32)
    outliers = np.where(rng.random((8, 4096)) < 0.01, base * 50, base).astype(np.float32)
    half_zero = base.copy()
    half_zero[:, ::2] = 0
    return {"cos0": cos_data(0.0)[None], "cos1": cos_data(1.0)[None], "cos3_amp1": cos_data(3.0, amplitude=1.0)[None],
            "normal_0.02": base * np.float32(0.02), "normal_1": base, "positive": np.abs(base),
            "negative": -np.abs(base) * np.float32(3), "outliers": outliers, "half_zero": half_zero,
            "uniform": rng.uniform(-1, 1, (8, 4096)).astype(np.float32)}


test_arrays.__test__ = False  # a helper, not a test


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=ids)
@pytest.mark.parametrize("offset", [0.0, 1.0, 3.0])
def test_quantize_fns_total_error_limit(qtype, offset):
    """llama.cpp test-quantize-fns: total quantization error < 0.002 for 4-bit and wider types."""
    x = cos_data(offset)
    err = llama_rmse(x, round_trip(x, qtype))
    assert err < 0.002, f"{qtype.name}: {err}"


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=ids)
def test_bytes_decode_with_gguf_py(qtype):
    """Our bytes have gguf-py's layout: gguf-py reads them back to the same values as glm5serve.dequant, and
    close to the input."""
    x = test_arrays()["normal_1"][:3]
    q = quantize(x, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    assert q.dtype == np.uint8 and q.shape == (3, 4096 // block_size * type_size)
    ref = gguf_quants.dequantize(q, qtype)
    assert ref.shape == x.shape
    np.testing.assert_array_equal(dequantize(q, qtype).numpy(), ref)
    assert np.sqrt(np.mean((ref - x) ** 2)) < 0.2  # 4-bit on unit gaussians: ~0.1


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16], ids=ids)
def test_plain_float_types(qtype):
    x = test_arrays()["normal_1"][:2, :64]
    q = quantize(x, qtype)
    assert q.dtype == (np.float32 if qtype == Q.F32 else np.float16) and q.shape == x.shape
    np.testing.assert_array_equal(q, x.astype(q.dtype))


@pytest.mark.parametrize("qtype", OWN_TYPES, ids=ids)
def test_zero_constant_and_tiny_blocks(qtype):
    rows = np.zeros((4, 512), dtype=np.float32)
    rows[1] = 0.75                  # constant positive
    rows[2] = -3.0                  # constant negative
    rows[3, :256] = 1e-20           # below fp16 range: scales round to zero
    back = round_trip(rows, qtype)
    assert np.all(back[0] == 0) and np.all(np.isfinite(back))
    assert np.max(np.abs(back[1:3] - rows[1:3])) < 0.02 * 3
    assert np.max(np.abs(back[3])) <= 1e-20


@pytest.mark.parametrize("qtype", OWN_TYPES, ids=ids)
def test_shape_and_row_independence(qtype):
    """Leading dims are kept, and each row is quantized on its own (a row's bytes don't depend on the others)."""
    x = test_arrays()["uniform"][:6, :512].reshape(2, 3, 512)
    q = quantize(x, qtype)
    assert q.shape[:2] == (2, 3)
    np.testing.assert_array_equal(q[1, 2], quantize(x[1, 2], qtype))


def test_errors_are_one_line_and_name_the_type():
    with pytest.raises(GGUFModelError, match="Q4_K.*256-value blocks"):
        quantize(np.zeros((2, 100), dtype=np.float32), Q.Q4_K)
    with pytest.raises(GGUFModelError, match="non-finite.*Q6_K"):
        quantize(np.full((1, 256), np.nan, dtype=np.float32), Q.Q6_K)
    for qtype in (Q.F16, Q.BF16):
        with pytest.raises(GGUFModelError, match=f"non-finite.*{qtype.name}"):
            quantize(np.full((1, 256), np.inf, dtype=np.float32), qtype)
    with pytest.raises(GGUFModelError, match=r"up to 1e\+05 to F16 \(largest: 65504\)"):
        quantize(np.full((1, 4), 1e5, dtype=np.float32), Q.F16)  # would be inf
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, *OWN_TYPES):  # block scales past fp16 dequantize to inf
        with pytest.raises(GGUFModelError, match=f"up to 1e\\+30 to {qtype.name}: a block scale overflows"):
            quantize(np.full((1, 256), 1e30, dtype=np.float32), qtype)
        assert torch.isfinite(dequantize(quantize(np.full((1, 256), 1e4, dtype=np.float32), qtype), qtype)).all()
    for qtype in (Q.Q2_K, Q.IQ2_XXS):
        with pytest.raises(GGUFModelError, match=f"{qtype.name} is not supported"):
            quantize(np.zeros((1, 256), dtype=np.float32), qtype)



def test_too_large_for_bf16_or_float32_is_named():
    """3.4e38 to BF16 came back as bytes that decode to inf; a finite float64 1e300 was called non-finite (NaN/inf)
    (fresh-user finding). BF16 rounds to nearest even as gguf-py and ggml: 0x7F7F7FFF is the last float32 that
    rounds to bf16's largest, 0x7F7F8000 the first that rounds to inf."""
    with pytest.raises(GGUFModelError, match=r"up to 3\.4e\+38 to BF16: rounds past bf16's largest 3\.3895e\+38 "
                                             "to inf"):
        quantize(np.full(4, 3.4e38, np.float32), Q.BF16)
    last, first_inf = np.array([0x7F7F7FFF, 0x7F7F8000], np.uint32).view(np.float32)
    assert (quantize(np.array([last, -last]), Q.BF16).view(np.uint16) & 0x7FFF == 0x7F7F).all()
    with pytest.raises(GGUFModelError, match="to BF16: rounds past"):
        quantize(np.array([0.0, -first_inf], np.float32), Q.BF16)
    for qtype in (Q.F32, Q.BF16, Q.Q8_0):
        with pytest.raises(GGUFModelError, match=f"^cannot quantize \\|values\\| up to 1e\\+300 to {qtype.name}: too "
                                                 "large for float32"):
            quantize(np.full(32, -1e300), qtype)
    with pytest.raises(GGUFModelError, match=r"non-finite values \(NaN/inf\) to F32"):  # NaN wins over overflow
        quantize(np.array([1e300, np.nan]), Q.F32)


def test_f16_largest_finite_value_is_stored():
    """65504 is fp16's largest finite value: F16 stores it exactly, as gguf-py does; only larger values are refused."""
    x = np.array([[65504.0, -65504.0, 1.0, 0.0]], np.float32)
    q = quantize(x, Q.F16)
    np.testing.assert_array_equal(q, gguf_quants.quantize(x, Q.F16))
    np.testing.assert_array_equal(q.astype(np.float32), x)


@pytest.mark.parametrize("qtype", QUANTIZE_TYPES, ids=ids)
def test_empty_input_gives_an_empty_result(qtype):
    """Every type returns an empty array: F32/F16 of the input's shape, the others of gguf-py's byte shape (gguf-py's
    own Q4_0..Q8_0/BF16 quantizers raised 'cannot reshape array of size 0' for a row of 0 values, while the K types
    returned (0,)) (fresh-user finding)."""
    plain = {Q.F32: np.float32, Q.F16: np.float16}
    for shape in [(0,), (3, 0), (0, 256), (2, 0, 256)]:
        q = quantize(np.zeros(shape, np.float32), qtype)
        want = shape if qtype in plain else gguf_quants.quant_shape_to_byte_shape(shape, qtype)
        assert q.dtype == plain.get(qtype, np.uint8) and q.shape == want, shape
        assert dequantize(q, qtype, shape).shape == shape


def test_sequential_sum_is_the_c_loop_order():
    """The byte-exactness with ggml relies on numpy reducing a leading axis row by row."""
    rng = np.random.default_rng(0)
    a = (rng.standard_normal((32, 5000)) * np.exp(rng.standard_normal((32, 5000)) * 4)).astype(np.float32)
    acc = a[0].copy()
    for row in a[1:]:
        acc += row
    np.testing.assert_array_equal(_seq_sum(a), acc)


@pytest.fixture(scope="module")
def ggml():
    if not llamacpp.available():
        pytest.skip("llama_cpp (llama-cpp-python's libggml) is not installed: no ggml quantizer to compare with")
    return llamacpp.ggml_quantize


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=ids)
def test_error_no_worse_than_ggml(ggml, qtype):
    """On every array, the round-trip error (llama.cpp's metric) is at most 1.1x that of ggml's own quantizer."""
    for name, x in test_arrays().items():
        ours = llama_rmse(x, round_trip(x, qtype))
        theirs = llama_rmse(x, gguf_quants.dequantize(ggml(x, qtype), qtype))
        assert ours <= 1.1 * theirs + 1e-12, f"{qtype.name} {name}: {ours} vs ggml {theirs}"


@pytest.mark.parametrize("qtype", OWN_TYPES, ids=ids)
def test_bytes_match_ggml_reference(ggml, qtype):
    """Ours is ggml's reference algorithm, sums in C order: blocks come out byte-identical to ggml's. (A ggml
    build with FMA contraction may flip a rare rounding, hence 99% rather than all.)"""
    _, type_size = GGML_QUANT_SIZES[qtype]
    total = same = 0
    for x in test_arrays().values():
        a, b = quantize(x, qtype).reshape(-1, type_size), ggml(x, qtype).reshape(-1, type_size)
        same += int((a == b).all(axis=1).sum())
        total += a.shape[0]
    assert same >= 0.99 * total, f"{qtype.name}: only {same}/{total} blocks identical to ggml's"


@pytest.mark.parametrize("qtype", OWN_TYPES, ids=ids)
def test_tiny_blocks_are_byte_identical_to_ggml(ggml, qtype):
    """Blocks of tiny values, around ggml's GROUP_MAX_EPS (1e-15) and fp16's smallest subnormal: below the eps
    ggml's Q6_K stores the whole block as zero bytes (``memset``), not the codes of its fit; every byte as ggml's."""
    c = np.cos(np.arange(256, dtype=np.float32))
    x = np.stack([c * np.float32(a) for a in (1e-20, 1e-15, 1e-14, 3e-14, 1e-13, 1e-10)]).astype(np.float32)
    np.testing.assert_array_equal(quantize(x, qtype), ggml(x, qtype))


def test_ggml_quantize_rejects_partial_blocks(ggml):
    with pytest.raises(ValueError, match="whole number"):
        ggml(np.zeros((1, 100), dtype=np.float32), Q.Q8_0)
    # these killed the process: GGML_ASSERT in ggml_quantize_chunk (Q8_K, I8), SIGFPE on rows of 0 (fresh-user
    # finding); a whole pytest session went with them
    for qtype in (Q.Q8_K, Q.I8):
        with pytest.raises(ValueError, match=f"cannot quantize to {qtype.name}"):
            ggml(np.zeros((2, 256), dtype=np.float32), qtype)
    with pytest.raises(ValueError, match="row of 0 values"):
        ggml(np.zeros((2, 0), dtype=np.float32), Q.Q4_0)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=ids)
def test_ggml_wrapper_agrees_with_gguf_py(ggml, qtype):
    """The ctypes wrapper itself: gguf-py's Q8_0/Q4_0 are documented bit-exact with ggml's reference."""
    x = test_arrays()["normal_1"]
    np.testing.assert_array_equal(ggml(x, qtype), gguf_quants.quantize(x, qtype))


def test_dequantized_round_trip_in_torch_dtypes():
    """bf16/fp16 dequant of quantized weights equals the fp32 result rounded (what kernels consume)."""
    x = test_arrays()["normal_0.02"][:2]
    q = quantize(x, Q.Q4_K)
    full = dequantize(q, Q.Q4_K)
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(dequantize(q, Q.Q4_K, dtype=dtype), full.to(dtype))


@pytest.mark.parametrize("qtype,shown", [("Q4_K", "'Q4_K'"), (None, "None"), (9999, "9999"), (12.7, "12.7"),
                                         (True, "True")])
def test_unknown_quantization_type_is_named(qtype, shown):
    """As dequantize: a type's name or None is an unknown type, named in the error (None gave a TypeError); 12.7 and
    True were truncated to Q4_K and F16 (fresh-user finding)."""
    with pytest.raises(GGUFModelError, match=f"^quantization to unknown ggml type {shown} is not supported"):
        quantize(np.zeros((1, 256), np.float32), qtype)

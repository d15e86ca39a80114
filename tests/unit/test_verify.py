"""``glm5serve verify``: passes on what make-checkpoint writes, accepts what llama.cpp's loader accepts, and finds
TP incompatibilities, inconsistent metadata and non-finite values (sampled rows for large tensors)."""
from __future__ import annotations

import dataclasses
import re
import shutil
import struct

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from glm5serve import schema, verify as verify_mod
from glm5serve.config import config_from_metadata
from glm5serve.checkpoint import make_checkpoint
from glm5serve.dequant import dequantize_tensor
from glm5serve.gguf_file import GGUFModel, TensorInfo
from glm5serve.quantize import quantize
from glm5serve.verify import verify

CHECK_NAMES = ["files", "metadata", "tokenizer", "tensors", "types", "tp", "finite"]
# the header-only checks: enough where values are not what a test is about (the finite check dequantizes all)
HEADER = [verify_mod.check_open, verify_mod.check_metadata, verify_mod.check_tensors, verify_mod.check_types,
          verify_mod.check_tp]


def _failures(results):
    return [c.line() for c in results if not c.ok]


@pytest.mark.parametrize("fixture", ["tiny_checkpoint", "tiny_bf16_checkpoint", "tiny_f32_checkpoint",
                                     "tiny_split_checkpoint"])
def test_passes_on_every_tiny_checkpoint(fixture, request):
    path = request.getfixturevalue(fixture)
    results = verify(path, 4)  # the preset's largest TP; every check runs
    assert [c.name for c in results] == CHECK_NAMES
    assert not _failures(results)
    n_files = len(GGUFModel(path).paths)
    assert results[0].detail.startswith(f"{n_files} files" if n_files > 1 else path.name)
    assert "94 tensors" in results[0].detail
    m = GGUFModel(path)
    cfg = config_from_metadata(m)
    specs = {s.gguf_name: s for s in schema.expected_tensors(cfg)}
    for tp in (1, 2):
        assert verify_mod.tp_problems(cfg, m, specs, tp) == []


def test_tp8_is_refused_for_four_heads(tiny_checkpoint):
    results = verify(tiny_checkpoint, 8, HEADER)
    assert [c.name for c in results if not c.ok] == ["tp"]
    assert "head_count=4 does not divide by TP=8" in _failures(results)[0]


def test_tp_failure_names_the_next_problems(tiny_checkpoint):
    """TP=3 breaks the heads, both intermediate sizes and 25 tensors: the line names the first problem and the next
    three (tensors by name), not just a count."""
    (line,) = _failures(verify(tiny_checkpoint, 3, HEADER))
    m = GGUFModel(tiny_checkpoint)
    cfg = config_from_metadata(m)
    problems = verify_mod.tp_problems(cfg, m, {s.gguf_name: s for s in schema.expected_tensors(cfg)}, 3)
    rest = [name or why for name, why in problems[1:]]
    assert len(rest) > 3 and any(name for name, _ in problems[1:4]), problems[:4]
    assert line.endswith(f"{problems[0][1]} (and {len(rest)} more: {', '.join(rest[:3])}, ...)"), line


def test_row_parallel_k_quant_blocks_must_not_straddle_ranks(tiny_bf16_checkpoint, tmp_path, gguf_rewrite):
    """attn_output (row 256) in Q4_K is one 256-block per row: fine at TP 1, split across ranks at TP 2."""
    m = GGUFModel(tiny_bf16_checkpoint)
    name = "blk.2.attn_output.weight"
    q4k = quantize(dequantize_tensor(m[name]).numpy(), Q.Q4_K)
    path = gguf_rewrite(tiny_bf16_checkpoint, tmp_path / "q4k_o.gguf", replace={name: (q4k, Q.Q4_K)})
    assert not _failures(verify(path, 1, HEADER))
    (line,) = _failures(verify(path, 2, HEADER))
    assert name in line and "Q4_K" in line and line.startswith("FAIL  tp")


def test_optional_tensors_are_accepted(tmp_path):
    path = make_checkpoint(tmp_path, "tiny", "bf16", mtp_shared_tensors=True)
    m = GGUFModel(path)
    assert "blk.3.nextn.embed_tokens.weight" in m and "blk.3.nextn.shared_head_head.weight" in m
    results = verify(path, 1, HEADER)
    assert not _failures(results)
    assert "2 optional" in results[2].detail


def test_shared_indexer_layers_may_omit_their_indexer(tmp_path, gguf_rewrite):
    path = make_checkpoint(tmp_path, "tiny", "bf16", indexer_types=["full", "shared", "shared"])
    assert "blk.2.indexer.proj.weight" not in GGUFModel(path)
    assert not _failures(verify(path, 1, HEADER))
    bad = gguf_rewrite(path, tmp_path / "first_shared.gguf",
                  set_keys={"glm-dsa.attention.indexer.types": [False, True, True]})
    (line,) = _failures(verify(bad))
    assert "layer 0 is 'shared'" in line


def test_missing_gating_func_means_sigmoid(tiny_bf16_checkpoint, tmp_path, gguf_rewrite):
    path = gguf_rewrite(tiny_bf16_checkpoint, tmp_path / "nogating.gguf",
                        drop_keys={"glm-dsa.expert_gating_func"})
    results = verify(path, 1, HEADER)
    assert not _failures(results)
    assert "expert_gating_func absent: sigmoid" in results[1].detail


@pytest.mark.parametrize("key,value,words", [
    ("glm-dsa.attention.value_length", 7, "value_length=7"),
    ("glm-dsa.expert_used_count", 17, "expert_used_count=17"),
    ("glm-dsa.vocab_size", 500, "vocab_size=500 but tokenizer.ggml.tokens holds 512"),
])
def test_inconsistent_metadata(key, value, words, tiny_bf16_checkpoint, tmp_path, gguf_rewrite):
    path = gguf_rewrite(tiny_bf16_checkpoint, tmp_path / "md.gguf", set_keys={key: value})
    (line,) = _failures(verify(path))
    assert words in line and path.name in line


def test_large_tensors_are_sampled_and_still_checked(tiny_checkpoint, tmp_path, monkeypatch):
    name = "blk.1.ffn_up_exps.weight"  # (16, 256, 256) Q4_K: 4096 rows of one block
    t = GGUFModel(tiny_checkpoint)[name]
    assert t.qtype == Q.Q4_K
    path = tmp_path / "inf_scale.gguf"
    shutil.copy(tiny_checkpoint, path)
    with open(path, "r+b") as fh:  # the fp16 super-block scale d of the last row := +inf
        fh.seek(t.data_offset + t.n_bytes - t.data.shape[-1])
        fh.write(struct.pack("<H", 0x7C00))
    monkeypatch.setattr(verify_mod, "FULL_CHECK_BYTES", 64 << 10)
    import glm5serve.dequant as dq

    read_rows, real = [], dq.dequantize

    def spy(data, qtype, *a, **k):
        read_rows.append(data.shape[0])
        return real(data, qtype, *a, **k)

    monkeypatch.setattr(dq, "dequantize", spy)
    (line,) = _failures(verify(path, 1, [*HEADER, verify_mod.check_finite]))
    assert name in line and "row 4095" in line and "non-finite" in line
    assert 16 * 256 not in read_rows  # the expert tensors were sampled, not read whole
    assert verify_mod.SAMPLE_ROWS in read_rows


@pytest.mark.parametrize("word", [0x7FC0, 0xFF81, 0x7F80], ids=["qNaN", "negative sNaN", "inf"])
def test_bf16_nan_and_inf_are_not_finite(word, tiny_bf16_checkpoint, tmp_path, gguf_rewrite):
    """A BF16 weight is NaN when its exponent bits are all ones and its mantissa is not 0 (inf when it is 0); both
    fail the finite check, naming the tensor and the row, as gguf-py's dequantized values are not finite there."""
    from gguf.quants import dequantize as gguf_dequantize

    m = GGUFModel(tiny_bf16_checkpoint)
    name = "blk.0.attn_q_b.weight"
    assert m[name].qtype == Q.BF16
    raw = np.array(m[name].data)  # uint8 rows of 2-byte values
    raw.view(np.uint16)[3, 5] = word
    assert not np.isfinite(gguf_dequantize(raw, Q.BF16)[3, 5])
    path = gguf_rewrite(tiny_bf16_checkpoint, tmp_path / "bf16_nan.gguf", replace={name: (raw, Q.BF16)})
    (line,) = _failures(verify(path, 1, [*HEADER, verify_mod.check_finite]))
    assert name in line and "non-finite value after dequantization (row 3, block 5)" in line, line


def _zero_tail(src, dst, start: int) -> list[str]:
    """Copy ``src`` to ``dst`` with every byte from ``start`` on zero (a download that preallocated the file and
    stopped there); return the names of the weight matrices (two or more dims above 1) lying wholly in the zeros,
    in file order."""
    shutil.copy(src, dst)
    size = dst.stat().st_size
    with open(dst, "r+b") as f:
        f.seek(start)
        f.write(bytes(size - start))
    return [t.name for t in sorted(GGUFModel(src), key=lambda t: t.data_offset)
            if t.data_offset >= start and sum(d > 1 for d in t.shape) >= 2]


@pytest.mark.parametrize("fixture", ["tiny_checkpoint", "tiny_bf16_checkpoint"])
def test_a_file_whose_tail_is_zeros_fails_naming_its_first_zero_matrix(fixture, request, tmp_path):
    """The size is right but the second half of the data was never written (aria2/hf_transfer preallocate): every
    value there dequantizes to 0, finite, and generation printed '!!!!!!!!'. The finite check fails at the first
    weight matrix wholly in the zeros (a 1-D norm or bias may be zero)."""
    src = request.getfixturevalue(fixture)
    path = tmp_path / "prealloc.gguf"
    zeroed = _zero_tail(src, path, src.stat().st_size // 2)
    assert len(zeroed) > 3
    (line,) = _failures(verify(path, 1, [*HEADER, verify_mod.check_finite]))
    assert line.startswith("FAIL") and f"{path}: {zeroed[0]}: every value is zero" in line, line


def test_a_zero_bias_passes_and_a_zero_matrix_fails(tiny_checkpoint, tmp_path, gguf_rewrite, monkeypatch):
    """Only matrices are held to it: an all-zero ``e_score_correction_bias`` (DeepSeek-V3 starts it at zero) passes;
    a zeroed router matrix fails, and a large tensor's sampled rows are named as such."""
    m = GGUFModel(tiny_checkpoint)
    bias, gate = m["blk.1.exp_probs_b.bias"], m["blk.1.ffn_gate_inp.weight"]
    ok = gguf_rewrite(tiny_checkpoint, tmp_path / "bias.gguf", replace={bias.name: (np.zeros(bias.shape, np.float32),
                                                                                     Q.F32)})
    assert not _failures(verify(ok, 1, [*HEADER, verify_mod.check_finite]))
    bad = gguf_rewrite(tiny_checkpoint, tmp_path / "gate.gguf", replace={gate.name: (np.zeros(gate.shape, np.float32),
                                                                                      Q.F32)})
    (line,) = _failures(verify(bad, 1, [*HEADER, verify_mod.check_finite]))
    assert f"{gate.name}: every value is zero" in line, line
    monkeypatch.setattr(verify_mod, "FULL_CHECK_BYTES", gate.n_bytes - 1)
    (line,) = _failures(verify(bad, 1, [*HEADER, verify_mod.check_finite]))
    rows = len(verify_mod._sample_rows(gate.shape[0]))
    assert f"{gate.name}: every value of {rows} sampled rows is zero" in line, line


#: one block's fp16 scale ``d``, its fp16 min (``dmin``; ``m`` of Q4_1/Q5_1) or None, and its packed sub-block
#: scales (and mins) or None, as (start, stop) byte ranges (gguf-py ``gguf/quants.py`` ``dequantize_blocks``, ggml
#: ``ggml-common.h`` ``block_*``). Values: Q4_0/Q5_0 ``d * (q - 8 | 16)``, Q8_0 ``d * q``, Q4_1/Q5_1 ``d * q + m``,
#: Q3_K ``d * (sc - 32) * q``, Q6_K ``d * sc * q``, Q2_K/Q4_K/Q5_K ``d * sc * q - dmin * m``.
_BLOCK_FIELDS = {
    Q.Q4_0: ((0, 2), None, None), Q.Q4_1: ((0, 2), (2, 4), None), Q.Q5_0: ((0, 2), None, None),
    Q.Q5_1: ((0, 2), (2, 4), None), Q.Q8_0: ((0, 2), None, None), Q.Q2_K: ((80, 82), (82, 84), (0, 16)),
    Q.Q3_K: ((108, 110), None, (96, 108)), Q.Q4_K: ((0, 2), (2, 4), (4, 16)), Q.Q5_K: ((0, 2), (2, 4), (4, 16)),
    Q.Q6_K: ((208, 210), None, (192, 208)),
}


def _blocks(qtype, shape, d: float, dmin: float, sub: bool) -> np.ndarray:
    """``uint8 (*shape[:-1], row_bytes)`` of ``qtype`` blocks: random nonzero bytes (codes, ``qh``, sub-scales), then
    every block's fp16 ``d`` and ``dmin`` set to the values given and, unless ``sub``, its sub-scales zeroed."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(1, 256, (*shape[:-1], shape[-1] // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    (d0, d1), min_at, sub_at = _BLOCK_FIELDS[qtype]
    blocks[:, d0:d1] = np.float16(d).reshape(1).view(np.uint8)
    if min_at:
        blocks[:, min_at[0]:min_at[1]] = np.float16(dmin).reshape(1).view(np.uint8)
    if sub_at and not sub:
        blocks[:, sub_at[0]:sub_at[1]] = 0
    return raw


@pytest.mark.parametrize("qtype", list(_BLOCK_FIELDS), ids=lambda q: q.name)
def test_blocks_whose_values_are_zero_fail_though_their_bytes_are_not(qtype, tiny_checkpoint, tmp_path,
                                                                       gguf_rewrite):
    """Blocks whose scale d (and dmin) is 0 dequantize to zeros whatever their code bytes (not one of which is 0
    here): a weight matrix the reference refuses (``dequant.zero_refused``), which verify, reading bytes, passed.
    A d of 0 with a nonzero dmin and nonzero mins (``- dmin * m``; Q4_1/Q5_1: ``+ m``) is not zero and passes; with
    the mins zeroed, or a nonzero d with zeroed sub-scales (not Q3_K: its are stored + 32), it is zero again. Each
    case as gguf-py dequantizes it, and as the reference engine loads it (the same FAIL text, or a model)."""
    from gguf.quants import dequantize as gguf_dequantize

    from glm5serve.errors import GGUFModelError
    from glm5serve.reference import ReferenceModel

    name = "blk.1.ffn_up_shexp.weight"  # (256, 256): one block type as good as another
    shape = GGUFModel(tiny_checkpoint)[name].shape
    has_min, has_sub = _BLOCK_FIELDS[qtype][1] is not None, _BLOCK_FIELDS[qtype][2] is not None
    cases = [(0.0, 0.0, True, True)]  # (d, dmin, keep sub-scales, every value zero)
    cases += [(0.0, 1.0, True, False)] if has_min else []
    cases += [(0.0, 1.0, False, True)] if has_min and has_sub else []
    cases += [(1.0, 1.0, False, qtype != Q.Q3_K)] if has_sub else []
    for i, (d, dmin, sub, zero) in enumerate(cases):
        raw = _blocks(qtype, shape, d, dmin, sub)
        assert zero == (not gguf_dequantize(raw, qtype).any()), (d, dmin, sub)  # the formulas, as gguf-py has them
        path = gguf_rewrite(tiny_checkpoint, tmp_path / f"{qtype.name}-{i}.gguf", replace={name: (raw, qtype)})
        failures = _failures(verify(path, 1, [*HEADER, verify_mod.check_finite]))
        if zero:
            why = f"{name}: every value is zero, which no trained weight matrix is"
            assert len(failures) == 1 and failures[0].startswith("FAIL") and f"{path}: {why}" in failures[0], \
                (d, dmin, sub, failures)
            with pytest.raises(GGUFModelError, match=re.escape(why)):
                ReferenceModel.from_gguf(path)
        else:
            assert not failures, (d, dmin, sub, failures)
            ReferenceModel.from_gguf(path)


def test_a_bf16_matrix_of_negative_zeros_fails(tiny_bf16_checkpoint, tmp_path, gguf_rewrite, monkeypatch):
    """-0.0 (BF16 0x8000, F16 0x8000, F32 0x80000000: nonzero bytes) is a zero value to the reference engine, which
    refuses a weight matrix of them; verify passed a BF16 one (its raw words are not 0). F16 and F32 arrive typed,
    so ``any()`` already took -0.0 for 0: they are here so that stays so. A large tensor's sampled rows are named;
    one smallest -0.0 neighbour (0x8001, a negative subnormal) is not zero."""
    from glm5serve.errors import GGUFModelError
    from glm5serve.reference import ReferenceModel

    name = "blk.1.ffn_up_shexp.weight"
    shape = GGUFModel(tiny_bf16_checkpoint)[name].shape
    neg_zero = {Q.BF16: np.full(shape, 0x8000, np.uint16).view(np.uint8), Q.F16: np.full(shape, -0.0, np.float16),
                Q.F32: np.full(shape, -0.0, np.float32)}
    why = f"{name}: every value is zero, which no trained weight matrix is"
    for qtype, raw in neg_zero.items():
        path = gguf_rewrite(tiny_bf16_checkpoint, tmp_path / f"{qtype.name}.gguf", replace={name: (raw, qtype)})
        (line,) = _failures(verify(path, 1, [*HEADER, verify_mod.check_finite]))
        assert line.startswith("FAIL") and f"{path}: {why}" in line, (qtype.name, line)
        with pytest.raises(GGUFModelError, match=re.escape(why)):
            ReferenceModel.from_gguf(path)
    raw = neg_zero[Q.BF16].copy()
    raw.view(np.uint16)[-1, -1] = 0x8001
    ok = gguf_rewrite(tiny_bf16_checkpoint, tmp_path / "subnormal.gguf", replace={name: (raw, Q.BF16)})
    assert not _failures(verify(ok, 1, [*HEADER, verify_mod.check_finite]))
    monkeypatch.setattr(verify_mod, "FULL_CHECK_BYTES", 1024)
    (line,) = _failures(verify(tmp_path / "BF16.gguf", 1, [*HEADER, verify_mod.check_finite]))
    rows = len(verify_mod._sample_rows(shape[0]))
    assert f"{name}: every value of {rows} sampled rows is zero" in line, line


def test_sample_rows_cover_both_ends():
    rows = verify_mod._sample_rows(10_000)
    assert rows[0] == 0 and rows[-1] == 9999 and len(rows) == verify_mod.SAMPLE_ROWS
    assert list(verify_mod._sample_rows(3)) == [0, 1, 2]


def test_check_lines_are_single_lines(tiny_checkpoint):
    results = verify(tiny_checkpoint, 8, HEADER)
    assert all("\n" not in c.line() for c in results) and len(results) == len(HEADER)


def test_finite_line_says_which_tensors_were_sampled(tiny_checkpoint, monkeypatch):
    """The PASS line counts the tensors read in full and the sampled ones; it does not claim that all were read
    (fresh-user finding: 'all 94 tensors dequantize to finite values, 9 large ones sampled')."""
    model = GGUFModel(tiny_checkpoint)
    monkeypatch.setattr(verify_mod, "FULL_CHECK_BYTES", 64 << 10)
    large = sum(1 for t in model if t.n_bytes > verify_mod.FULL_CHECK_BYTES)
    assert 0 < large < len(model)
    (check,) = [c for c in verify(tiny_checkpoint, 1, [*HEADER, verify_mod.check_finite]) if c.name == "finite"]
    assert check.ok and check.detail == (f"{len(model)} tensors dequantize to finite values, no matrix or norm to zeros "
                                         f"({len(model) - large} in full, {large} large ones on "
                                         f"{verify_mod.SAMPLE_ROWS} sampled rows each)")


# ---------------------------------------------------------------- ne padded with 1s (llama.cpp's check_tensor_dims)
@pytest.mark.parametrize("fixture", ["tiny_checkpoint", "tiny_bf16_checkpoint"])
def test_ne_padded_with_trailing_ones_passes(fixture, request, padded_copy):
    """ne [K, N, 1] is the tensor [K, N] to llama.cpp (every ggml tensor is 4-D; check_tensor_dims pads the
    expected dims with 1): verify passes with the same lines, and the checked model holds the schema's shapes over
    the file's bytes (fresh-user finding: refused as 'shape (1, 384, 256) (numpy order), expected (384, 256)')."""
    path = request.getfixturevalue(fixture)
    padded = padded_copy(path)
    stored, original = GGUFModel(padded), GGUFModel(path)
    changed = [n for n in original.tensors if stored[n].shape != original[n].shape]
    assert len(changed) == 5 and all(stored[n].shape[-len(original[n].shape):] == original[n].shape and
                                     set(stored[n].shape[:-len(original[n].shape)]) == {1} for n in changed)
    results = verify(padded, 4)
    assert not _failures(results)
    assert [c.line() for c in results[1:]] == [c.line() for c in verify(path, 4)[1:]]
    ctx = verify_mod.require(padded, tuple(HEADER))
    specs = {s.gguf_name: s for s in schema.expected_tensors(ctx.cfg)}
    for name in changed:
        t = ctx.model[name]
        assert t.shape == specs[name].shape and t.ne == tuple(reversed(t.shape)), name
        assert t.data.shape[:-1] == t.shape[:-1] and isinstance(t.data, np.memmap), name  # the file map, reshaped
        assert np.array_equal(t.data, stored[name].data.reshape(t.data.shape)), name


def test_expected_dims_of_one_that_the_file_leaves_out(tiny_checkpoint, monkeypatch):
    """The other way round: a schema shape with a size-1 dimension (n_head = 1, say) that the file does not store
    (ne [K, N] for [K, N, 1]) passes every check, and the dimension is there for the readers after verify."""
    one = {"blk.1.attn_q_b.weight", "blk.1.attn_norm.weight", "blk.1.attn_k_b.weight"}
    real = schema.expected_tensors

    def with_ones(cfg):
        return [dataclasses.replace(s, shape=(1, *s.shape)) if s.gguf_name in one else s for s in real(cfg)]

    monkeypatch.setattr(schema, "expected_tensors", with_ones)
    results = verify(tiny_checkpoint, 4)
    assert not _failures(results), _failures(results)
    ctx = verify_mod.require(tiny_checkpoint, tuple(HEADER))
    stored = GGUFModel(tiny_checkpoint)
    for name in one:
        assert ctx.model[name].shape == (1, *stored[name].shape), name
        assert np.array_equal(ctx.model[name].data[0], stored[name].data), name


@pytest.mark.parametrize("stored,expected,ok", [
    ((1, 512, 256), (512, 256), True),
    ((512, 256), (1, 512, 256), True),  # a real dimension of 1 the file left out
    ((1, 1, 512, 256), (512, 256), True),
    ((1, 512, 256), (1, 512, 256), True),  # stored as expected: a real size-1 dimension is never dropped
    ((1, 1, 1, 1, 512, 256), (512, 256), False),  # more than ggml's 4 dimensions
    ((512, 1, 256), (512, 256), False),  # a 1 anywhere but outermost is another tensor
    ((512, 256, 1), (512, 256), False),
    ((2, 256, 256), (512, 256), False),
    ((256,), (1, 256), True),
    ((1,), (1,), True),
])
def test_only_outer_size_one_dims_are_equivalent(stored, expected, ok):
    data = np.zeros((*stored[:-1], 68), np.uint8)  # Q8_0 rows of 64 values, had they been 64
    t = TensorInfo("t", Q.Q8_0, tuple(reversed(stored)), stored, data.nbytes, "f.gguf", 0, data)
    got = t.as_shape(expected)
    if not ok:
        assert got is None
        return
    assert got.shape == expected and got.ne == tuple(reversed(expected)) and got.data.shape == (*expected[:-1], 68)
    assert np.shares_memory(got.data, data) and (got is t) == (stored == expected)

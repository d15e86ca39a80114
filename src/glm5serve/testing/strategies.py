"""Reusable Hypothesis strategies for GGUF data: quant blocks (hostile bytes included), block-respecting weight
shapes, tensor-parallel sizes and float weights to quantize.

Import them in any project's tests::

    from glm5serve.testing import strategies as gst

    @given(gst.quant_types().flatmap(gst.gguf_tensors))
    def test_something(tensor): raw, qtype, shape = tensor; ...
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import strategies as st

from glm5serve.dequant import SUPPORTED_TYPES

Q = GGMLQuantizationType
TP_SIZES = (1, 2, 4, 8)
DEQUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Byte offsets of every fp16 scale/min field inside one block (ggml-common.h block_* layouts).
FP16_FIELDS: dict[Q, tuple[int, ...]] = {
    Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}
# fp16 bit patterns that break careless kernels: ±0, ±inf, quiet/signalling/negative NaN, max, min subnormal,
# min normal, 1.0, -1.0.
SPECIAL_F16 = (0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE00, 0x7BFF, 0xFBFF, 0x0001, 0x0400, 0x3C00, 0xBC00)
SPECIAL_F32 = (0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFC00000,
               0x7F7FFFFF, 0x00000001, 0x00800000, 0x3F800000)
SPECIAL_BF16 = tuple(v >> 16 for v in SPECIAL_F32) + (0x7F81,)


def quant_types(types=SUPPORTED_TYPES) -> st.SearchStrategy[Q]:
    """One of ``types`` (default: every type :mod:`glm5serve.dequant` supports)."""
    return st.sampled_from(tuple(types))


def tp_sizes(max_tp: int = 8) -> st.SearchStrategy[int]:
    """A tensor-parallel world size: 1, 2, 4 or 8 (up to ``max_tp``)."""
    return st.sampled_from(tuple(t for t in TP_SIZES if t <= max_tp))


def block_geometry(qtype: Q) -> tuple[int, int]:
    """``(block_size, type_size)``: elements per block and bytes per block (one element for F32/F16/BF16)."""
    return GGML_QUANT_SIZES[qtype]


@st.composite
def _element_words(draw, qtype: Q, n: int) -> np.ndarray:
    """n plain-float elements as bytes, each random or a special bit pattern."""
    bits, specials = {Q.F32: (32, SPECIAL_F32), Q.F16: (16, SPECIAL_F16), Q.BF16: (16, SPECIAL_BF16)}[qtype]
    word = st.one_of(st.integers(0, (1 << bits) - 1), st.sampled_from(specials))
    words = np.array(draw(st.lists(word, min_size=n, max_size=n)), dtype=np.uint32 if bits == 32 else np.uint16)
    return words.view(np.uint8)


@st.composite
def gguf_blocks(draw, qtype: Q, n_blocks: int | st.SearchStrategy[int] = st.integers(1, 4)) -> np.ndarray:
    """Raw bytes of ``n_blocks`` blocks of ``qtype``: ``uint8 (n_blocks, type_size)``.

    Each block is random bytes, all zero or all 0xFF (every code and 6-bit sub-scale at its min or max); then each
    fp16 scale field may be overwritten with a hostile value (0, ±inf, NaN, subnormal, max, ...) or any 16 bits.
    F32/F16/BF16 "blocks" are single elements drawn the same way.
    """
    n = draw(n_blocks) if isinstance(n_blocks, st.SearchStrategy) else n_blocks
    block_size, type_size = block_geometry(qtype)
    if qtype in (Q.F32, Q.F16, Q.BF16):
        return draw(_element_words(qtype, n)).reshape(n, type_size)
    blocks = []
    for _ in range(n):
        kind = draw(st.sampled_from(("random", "zero", "ones")))
        if kind == "random":  # bytes from a drawn seed: keeps Hypothesis' buffer small for 210-byte blocks
            seed = draw(st.integers(0, 2**32 - 1))
            b = np.random.default_rng(seed).integers(0, 256, type_size, dtype=np.uint8)
        else:
            b = np.full(type_size, 0 if kind == "zero" else 0xFF, dtype=np.uint8)
        for off in FP16_FIELDS[qtype]:
            v = draw(st.one_of(st.none(), st.sampled_from(SPECIAL_F16), st.integers(0, 0xFFFF)))
            if v is not None:
                b[off:off + 2] = np.array([v], dtype=np.uint16).view(np.uint8)
        blocks.append(b)
    return np.stack(blocks)


def weight_shapes(qtype: Q, *, tp: int = 1, max_rows: int = 8, max_blocks_per_row: int = 4,
                  row_parallel: bool = False) -> st.SearchStrategy[tuple[int, int]]:
    """A 2-D numpy-order weight shape ``(rows, cols)`` that ggml can store as ``qtype``.

    ``cols`` is a whole number of blocks; with ``tp > 1`` the TP-split dimension divides evenly: ``rows`` for a
    column-parallel weight, ``cols`` into whole blocks per rank for a row-parallel one (``row_parallel=True``).
    """
    block_size, _ = block_geometry(qtype)
    rows = st.integers(1, max_rows).map(lambda r: r * (tp if not row_parallel else 1))
    cols = st.integers(1, max_blocks_per_row).map(lambda b: b * block_size * (tp if row_parallel else 1))
    return st.tuples(rows, cols)


@st.composite
def gguf_tensors(draw, qtype: Q, **shape_kw) -> tuple[np.ndarray, Q, tuple[int, int]]:
    """``(raw, qtype, shape)``: raw ``uint8 (rows, row_bytes)`` bytes of a ``qtype`` tensor of numpy ``shape``."""
    rows, cols = draw(weight_shapes(qtype, **shape_kw))
    block_size, type_size = block_geometry(qtype)
    raw = draw(gguf_blocks(qtype, rows * cols // block_size))
    return raw.reshape(rows, cols // block_size * type_size), qtype, (rows, cols)


WEIGHT_SCALES = (1e-3, 0.02, 1.0, 30.0)


@st.composite
def float_weights(draw, shape: tuple[int, ...] | st.SearchStrategy, *, scales=WEIGHT_SCALES) -> np.ndarray:
    """Finite ``float32`` weights of ``shape`` in the forms quantizers must survive: gaussian at a drawn scale,
    all-positive / all-negative, 1% outliers (x30), constant rows, and rows whose first half is zero.

    The default scales keep every fp16 block scale of every GGUF type a normal number (values up to ~5e3); pass
    smaller ``scales`` to probe underflow, where all ggml formats lose everything.
    """
    shape = draw(shape) if isinstance(shape, st.SearchStrategy) else tuple(shape)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from(tuple(scales)))
    kind = draw(st.sampled_from(("normal", "positive", "negative", "outliers", "constant", "half_zero")))
    x = rng.standard_normal(shape).astype(np.float32) * np.float32(scale)
    if kind == "positive":
        x = np.abs(x)
    elif kind == "negative":
        x = -np.abs(x)
    elif kind == "outliers":
        x = np.where(rng.random(shape) < 0.01, x * np.float32(30), x).astype(np.float32)
    elif kind == "constant":
        x = np.broadcast_to(x[..., :1], shape).copy()
    elif kind == "half_zero":
        x[..., : shape[-1] // 2] = 0
    return x


# --- weights with finite values, shard sets and arrival orders, TP divisors, batch compositions ------------------

BLOCK_TYPES = tuple(t for t in SUPPORTED_TYPES if t not in (Q.F32, Q.F16, Q.BF16))


@st.composite
def finite_gguf_rows(draw, qtype: Q, rows: int, cols: int, *, scale: float = 0.05) -> np.ndarray:
    """Raw bytes ``uint8 (rows, row_bytes)`` of a ``qtype`` weight of numpy shape ``(rows, cols)`` whose values are
    all finite and about ``scale``: random bytes (every code and packed sub-scale pattern) with each fp16 scale/min
    field overwritten by a finite value of either sign. F32/F16/BF16: N(0, scale²) values in that type.

    For differential tests of layout (order, slicing) where hostile bytes would only add NaN noise.
    """
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if qtype in (Q.F32, Q.F16, Q.BF16):
        w = torch.from_numpy((rng.standard_normal((rows, cols)) * scale).astype(np.float32))
        if qtype == Q.F32:
            return w.numpy().view(np.uint8)
        return w.to(torch.float16 if qtype == Q.F16 else torch.bfloat16).view(torch.uint8).numpy()
    block_size, type_size = block_geometry(qtype)
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    # a scale field times the largest code/sub-scale product stays about ``scale``
    unit = {Q.Q6_K: scale / (32 * 128), Q.Q2_K: scale / (16 * 3), Q.Q3_K: scale / (32 * 4), Q.Q8_0: scale / 128}.get(
        qtype, scale / (16 * 63) if block_size == 256 else scale / 16)
    for off in FP16_FIELDS[qtype]:
        d = (rng.uniform(-1, 1, blocks.shape[:2]) * unit).astype(np.float16)
        blocks[..., off:off + 2] = d.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def tp_sizes_dividing(n: int, max_tp: int = 8) -> st.SearchStrategy[int]:
    """A tensor-parallel size from :data:`TP_SIZES` (up to ``max_tp``) that divides ``n``."""
    return st.sampled_from(tuple(t for t in TP_SIZES if t <= max_tp and n % t == 0))


@st.composite
def shard_sets(draw, *, n_shards: int | st.SearchStrategy[int] = st.integers(2, 4),
               qtypes: st.SearchStrategy[Q] | None = None, max_rows: int = 3, max_blocks: int = 2,
               rows_multiple: int = 1) -> tuple[int, list[tuple[int, Q]]]:
    """``(cols, [(rows_i, qtype_i), ...])``: the shards of a merged (fused) layer in declared order, sizes and quant
    types drawn independently per shard. ``cols`` (the shared input size) is a whole number of blocks of every
    shard's type; each ``rows_i`` is a multiple of ``rows_multiple`` (the TP size, for column-parallel shards).
    ``qtypes`` defaults to every block-quantized type glm5serve supports.
    """
    n = draw(n_shards) if isinstance(n_shards, st.SearchStrategy) else n_shards
    types = qtypes if qtypes is not None else quant_types(BLOCK_TYPES)
    shards = [(draw(st.integers(1, max_rows)) * rows_multiple, draw(types)) for _ in range(n)]
    block = max(block_geometry(q)[0] for _, q in shards)
    return draw(st.integers(1, max_blocks)) * block, shards


def arrival_orders(n: int) -> st.SearchStrategy[list[int]]:
    """An order in which the ``n`` shards of a merged layer reach the loader (a permutation of ``range(n)``)."""
    return st.permutations(list(range(n)))


@st.composite
def batch_compositions(draw, *, max_requests: int = 4, max_seq_len: int = 48, max_query_len: int = 4,
                       max_pad: int = 3) -> tuple[list[int], list[int], int]:
    """``(seq_lens, q_lens, pad_tokens)``: a batch of requests as a scheduler forms it, request b holding
    ``seq_lens[b]`` tokens of which the last ``q_lens[b]`` (1 ≤ q ≤ seq) are new this step, plus ``pad_tokens``
    padding rows (a CUDA graph captured for a larger batch). ``max_query_len=1`` gives a decode batch."""
    n = draw(st.integers(1, max_requests))
    seq_lens = [draw(st.integers(1, max_seq_len)) for _ in range(n)]
    q_lens = [draw(st.integers(1, min(s, max_query_len))) for s in seq_lens]
    return seq_lens, q_lens, draw(st.integers(0, max_pad))


@st.composite
def engine_batches(draw, vocab_ids, *, max_requests: int = 24, max_prompt_len: int = 700,
                   max_new_tokens: int = 12) -> tuple[list[list[int]], list[int]]:
    """``(prompts, max_tokens)``: one batch for a live engine's ``LLM.generate``, 1..``max_requests`` requests,
    request b a prompt of 1..``max_prompt_len`` token ids taken from ``vocab_ids`` asking for ``max_tokens[b]`` in
    1..``max_new_tokens`` greedy tokens -- so the running batch shrinks as requests finish and a CUDA-graph engine
    pads its decode steps to several captured sizes. Counts and lengths are drawn (and shrink); the ids come from a
    drawn seed, which keeps Hypothesis' buffer small for batches of thousands of tokens.
    """
    n = draw(st.integers(1, max_requests))
    lens = [draw(st.integers(1, max_prompt_len)) for _ in range(n)]
    max_tokens = [draw(st.integers(1, max_new_tokens)) for _ in range(n)]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    vocab = np.asarray(vocab_ids, dtype=np.int64)
    return [vocab[rng.integers(0, len(vocab), size=L)].tolist() for L in lens], max_tokens

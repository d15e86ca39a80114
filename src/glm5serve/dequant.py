"""Dequantize GGUF tensors with torch, on CPU or CUDA, bit-exact with gguf-py.

Each block kind is unpacked with whole-tensor integer ops (no Python loop over blocks) and then scaled in fp32 with
the same float operations, in the same order, as gguf-py's ``gguf/quants.py`` (which mirrors ggml's
``dequantize_row_*`` in ``ggml/src/ggml-quants.c``): e.g. Q4_0 is ``d * (q - 8)`` with the subtraction done on
integers, Q4_K is ``(d * sc) * q - dmin * m``. Every multiply/add is its own eager torch op, so no FMA contraction
can change a rounding. A bf16/fp16 result is the fp32 result rounded once.
"""
from __future__ import annotations

import math
import operator
import warnings
from typing import Callable, Sequence

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from glm5serve.errors import GGUFModelError
from glm5serve.gguf_file import TensorInfo

Q = GGMLQuantizationType
# Output elements dequantized per step: bounds the fp32 temporaries (~5x this many floats) for big tensors.
CHUNK_ELEMENTS = 1 << 22
#: why a weight matrix of zeros is refused: no trained one is, and it is what a download that preallocated the file
#: and stopped (aria2, hf_transfer), or a hole in a sparse file, reads as
ZERO_MATRIX = "is zero, which no trained weight matrix is (a download preallocated and never filled?)"


#: why a norm's scale of zeros is refused: it zeroes what the norm feeds (``output_norm``: every logit, so the text
#: went on '!!!!!!!!' with every check passed), and it is what the last bytes of an unfilled download read as
ZERO_NORM = "is zero, which no trained norm weight is (a download preallocated and never filled?)"


def is_matrix(shape: Sequence[int]) -> bool:
    """Whether a tensor of numpy ``shape`` has two or more dimensions above 1 (ggml pads ``ne`` with 1s): a weight
    matrix or a stack of them, not a norm or bias vector."""
    return sum(int(d) > 1 for d in shape) >= 2


def zero_refused(name: str, shape: Sequence[int]) -> str | None:
    """Why tensor ``name`` of numpy ``shape`` is refused when every value is zero (:data:`ZERO_MATRIX` for a weight
    matrix, :data:`ZERO_NORM` for a norm's scale, ``*norm.weight``), None for one that may be all zeros (a bias such
    as ``exp_probs_b.bias`` or ``indexer.k_norm.bias``)."""
    return ZERO_MATRIX if is_matrix(shape) else ZERO_NORM if name.endswith("norm.weight") else None


def _f16(b: torch.Tensor) -> torch.Tensor:
    """``(n, 2)`` uint8 little-endian fp16 bytes -> ``(n, 1)`` fp32."""
    return b.contiguous().view(torch.float16).float()


def _shift(b: torch.Tensor, shifts: Sequence[int], view: Sequence[int]) -> torch.Tensor:
    """``b >> shifts`` with the shifts laid along a new axis, shaped ``view`` for broadcasting."""
    s = torch.tensor(shifts, dtype=torch.uint8, device=b.device).view(*view)
    return b >> s


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``(..., k)`` bytes -> ``(..., 2k)``: the k low nibbles, then the k high nibbles (ggml's 4-bit layout)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(b: torch.Tensor) -> torch.Tensor:
    """``(n, k)`` bytes -> ``(n, 8k)`` bits, bit i of the little-endian word at position i (Q5_0/Q5_1 ``qh``)."""
    return (_shift(b.unsqueeze(-1), range(8), (1, 1, 8)) & 1).reshape(b.shape[0], -1)


def _k4_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte packed 6-bit scales -> ``(n, 8)`` scales and mins (``get_scale_min_k4``)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d, qs = _f16(b[:, :2]), b[:, 2:]
    return d * (_nibbles(qs).to(torch.int8) - 8).float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:]
    return d * _nibbles(qs).float() + m


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d, qh, qs = _f16(b[:, :2]), b[:, 2:6], b[:, 6:]
    q = _nibbles(qs) | (_bits(qh) << 4)
    return d * (q.to(torch.int8) - 16).float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m, qh, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:8], b[:, 8:]
    q = _nibbles(qs) | (_bits(qh) << 4)
    return d * q.float() + m


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d, qs = _f16(b[:, :2]), b[:, 2:]
    return qs.view(torch.int8).float() * d


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0x0F).float()).unsqueeze(-1)
    ml = (dmin * (scales >> 4).float()).unsqueeze(-1)
    q = (_shift(qs.reshape(n, 2, 1, 32), (0, 2, 4, 6), (1, 1, 4, 1)) & 3).reshape(n, 16, 16)
    return (dl * q.float() - ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales, d = b[:, :32], b[:, 32:96], b[:, 96:108], _f16(b[:, 108:110])
    lo = _shift(scales[:, :8].reshape(n, 1, 8), (0, 4), (1, 2, 1)).reshape(n, 16)
    hi = _shift(scales[:, 8:].reshape(n, 1, 4), (0, 2, 4, 6), (1, 4, 1)).reshape(n, 16)
    sc = ((lo & 0x0F) | ((hi & 3) << 4)).to(torch.int8) - 32
    dl = (d * sc.float()).unsqueeze(-1)
    ql = _shift(qs.reshape(n, 2, 1, 32), (0, 2, 4, 6), (1, 1, 4, 1)).reshape(n, 16, 16) & 3
    qh = _shift(hmask.reshape(n, 1, 1, 32), range(8), (1, 1, 8, 1)).reshape(n, 16, 16) & 1
    q = ql.to(torch.int8) - ((qh ^ 1) << 2).to(torch.int8)  # the high bit *set* means no -4 offset
    return (dl * q.float()).reshape(n, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin, scales, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:16], b[:, 16:]
    sc, mn = _k4_scale_min(scales)
    dl, ml = (d * sc.float()).unsqueeze(-1), (dmin * mn.float()).unsqueeze(-1)
    q = _nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32)
    return (dl * q.float() - ml).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin, scales, qh, qs = _f16(b[:, :2]), _f16(b[:, 2:4]), b[:, 4:16], b[:, 16:48], b[:, 48:]
    sc, mn = _k4_scale_min(scales)
    dl, ml = (d * sc.float()).unsqueeze(-1), (dmin * mn.float()).unsqueeze(-1)
    ql = _nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32)
    qh = _shift(qh.reshape(n, 1, 32), range(8), (1, 8, 1)) & 1
    return (dl * (ql | (qh << 4)).float() - ml).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208], _f16(b[:, 208:210])
    dl = (d * scales.view(torch.int8).float()).unsqueeze(-1)
    lo = (_shift(ql.reshape(n, 2, 1, 64), (0, 4), (1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    hi = (_shift(qh.reshape(n, 2, 1, 32), (0, 2, 4, 6), (1, 1, 4, 1)) & 3).reshape(n, 8, 32)
    q = (lo | (hi << 4)).to(torch.int8) - 32
    return (dl * q.reshape(n, 16, 16).float()).reshape(n, 256)


def _bf16(b: torch.Tensor) -> torch.Tensor:
    return (b.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


def _f16_plain(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).float()


def _f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


# qtype -> fn((n_blocks, type_size) uint8) -> (n_blocks, block_size) fp32.  F32/F16/BF16 use one element per block.
_BLOCK_FNS: dict[Q, Callable[[torch.Tensor], torch.Tensor]] = {
    Q.F32: _f32, Q.F16: _f16_plain, Q.BF16: _bf16,
    Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
    Q.Q2_K: _q2_k, Q.Q3_K: _q3_k, Q.Q4_K: _q4_k, Q.Q5_K: _q5_k, Q.Q6_K: _q6_k,
}
SUPPORTED_TYPES: tuple[Q, ...] = tuple(_BLOCK_FNS)
_ELEMENT_BYTES = {Q.F32: 4, Q.F16: 2, Q.BF16: 2}
_INT64_MAX = 2**63 - 1


def _as_uint8_tensor(data) -> torch.Tensor:
    """Raw bytes as a uint8 tensor, last dim = bytes per row; numpy (even read-only memmaps) is not copied, unless it
    is a view with a negative stride (``a[::-1]``, which torch cannot wrap)."""
    if isinstance(data, torch.Tensor):
        t = data
    else:
        arr = np.asarray(data)
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        if any(s < 0 for s in arr.strides):
            arr = arr.copy()
        with warnings.catch_warnings():  # read-only memmap: we never write through this view
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(arr)
    if t.dtype != torch.uint8:
        if t.dim() == 0:
            t = t.reshape(1)
        if t.numel() == 0:  # torch cannot view an empty tensor (stride 0) as bytes
            return torch.empty((*t.shape[:-1], t.shape[-1] * t.element_size()), dtype=torch.uint8, device=t.device)
        t = t.contiguous().view(torch.uint8)
    return t


def _int_shape(shape) -> tuple[int, ...]:
    """``shape`` as a tuple of Python ints; TypeError for anything but a sequence of integers (no float, no bool)."""
    try:
        entries = list(shape)
        if isinstance(shape, (str, bytes)) or any(isinstance(s, bool) for s in entries):
            raise TypeError
        return tuple(operator.index(s) for s in entries)
    except TypeError:
        raise TypeError(f"shape must be a sequence of integers, not {shape!r}") from None


def dequantize(data, qtype, shape: Sequence[int] | None = None, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str | None = None) -> torch.Tensor:
    """Dequantize raw GGUF tensor data.

    Args:
        data: the tensor's bytes as numpy or torch ``uint8`` of shape ``(..., row_bytes)`` (GGUFReader's layout for
            block types and BF16), or a typed array as GGUFReader gives F32 (``float32``) and F16 (``float16``)
            tensors, shape ``(..., row)``. Any other dtype is reinterpreted as bytes along the last dim. A numpy view
            with a negative stride (``a[::-1]``) is copied first.
        qtype: a ``GGMLQuantizationType`` (``qweight_type``) among :data:`SUPPORTED_TYPES`, or its integer value.
        shape: numpy-order output shape, a sequence of integers; default ``(..., row_bytes // type_size * block_size)``.
        dtype: ``torch.float32`` (bit-exact with ``gguf.quants.dequantize``), ``bfloat16`` or ``float16`` (that
            fp32 result rounded to nearest even).
        device: where to compute and return; default the device of ``data`` (CPU for numpy).

    Returns:
        A new tensor (never a view of ``data``) of ``shape`` and ``dtype`` on ``device``.

    Raises:
        GGUFModelError: unsupported or unknown ``qtype`` (the message names it; a float or a bool is unknown, not
        truncated), a row byte count that is not a whole number of blocks, or a ``shape`` with a negative size or a
        different number of elements (however large their product), or one whose sizes multiply past int64.
        TypeError: a ``shape`` that is not a sequence of integers (a float or a bool entry included).
        ValueError: a ``dtype`` other than the three above.

    Source: gguf-py ``gguf/quants.py`` ``dequantize_blocks``; ggml ``ggml/src/ggml-quants.c`` ``dequantize_row_*``.
    """
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, bfloat16 or float16, not {dtype}")
    supported = f"(supported: {', '.join(t.name for t in SUPPORTED_TYPES)})"
    try:  # operator.index: 12.7 is not truncated to Q4_K; a bool is refused, not taken as F16 / F32
        if isinstance(qtype, bool):
            raise TypeError
        qtype = Q(operator.index(qtype))
    except (TypeError, ValueError):  # a number ggml does not define, a type's name, None
        raise GGUFModelError(f"unknown ggml type {qtype!r} for dequantization {supported}") from None
    fn = _BLOCK_FNS.get(qtype)
    if fn is None:
        raise GGUFModelError(f"unsupported ggml type {qtype.name} for dequantization {supported}")
    name = qtype.name
    raw = _as_uint8_tensor(data)
    if device is not None:
        raw = raw.to(device)
    block_size, type_size = (1, _ELEMENT_BYTES[qtype]) if qtype in _ELEMENT_BYTES else GGML_QUANT_SIZES[qtype]
    lead = tuple(raw.shape[:-1]) if raw.dim() else ()
    row_bytes = raw.shape[-1] if raw.dim() else 1
    if row_bytes % type_size:
        raise GGUFModelError(f"{name} row of {row_bytes} bytes is not a whole number of {type_size}-byte blocks")
    n_blocks = raw.numel() // type_size
    out_shape = (*lead, row_bytes // type_size * block_size)
    if shape is not None:
        shape = _int_shape(shape)
        # Python ints, so no product wraps; sizes whose nonzero product passes int64 are no tensor torch can make
        if (any(s < 0 for s in shape) or math.prod(s for s in shape if s) > _INT64_MAX
                or math.prod(shape) != n_blocks * block_size):
            raise GGUFModelError(f"{name} data holds {n_blocks * block_size} values, not shape {list(shape)}")
        out_shape = shape
    blocks = raw.reshape(n_blocks, type_size)
    out = torch.empty((n_blocks, block_size), dtype=dtype, device=raw.device)
    step = max(1, CHUNK_ELEMENTS // block_size)
    for start in range(0, n_blocks, step):  # a few big chunks, each fully vectorised
        out[start:start + step] = fn(blocks[start:start + step]).reshape(-1, block_size)
    return out.reshape(out_shape)


def dequantize_tensor(info: TensorInfo, dtype: torch.dtype = torch.float32,
                      device: torch.device | str | None = None) -> torch.Tensor:
    """Dequantize one GGUF tensor to its numpy-order ``info.shape`` (see :func:`dequantize`).

    Raises GGUFModelError naming the file, the tensor and the type for an unsupported type or malformed data.
    """
    try:
        return dequantize(info.data, info.qtype, info.shape, dtype=dtype, device=device)
    except GGUFModelError as e:
        raise GGUFModelError(e.reason, file=info.file, tensor=info.name) from None

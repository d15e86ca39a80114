"""ggml's own quantizer, called through the ``libggml-base`` that llama-cpp-python bundles (the ``oracle`` extra).

Only ctypes and the shared library are used (``llama_cpp`` itself is not imported), so this works wherever the
package's ``lib/`` directory is installed. ``ggml_quantize_chunk`` with ``imatrix=NULL`` runs ggml's reference
quantizers (``quantize_row_*_ref`` in ``ggml/src/ggml-quants.c``) -- the oracle for :mod:`glm5serve.quantize`.
"""
from __future__ import annotations

import ctypes
import importlib.util
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


class LlamaCppUnavailable(RuntimeError):
    """llama-cpp-python (``llama_cpp``) or its bundled libggml is not installed here."""


def lib_dir() -> Path:
    """The ``lib/`` directory of the installed ``llama_cpp`` package; raises LlamaCppUnavailable."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        raise LlamaCppUnavailable("llama_cpp (llama-cpp-python, the `oracle` extra) is not installed")
    for root in spec.submodule_search_locations:
        if (Path(root) / "lib").is_dir():
            return Path(root) / "lib"
    raise LlamaCppUnavailable("llama_cpp is installed without its lib/ directory of shared libraries")


@lru_cache(maxsize=1)
def libggml() -> ctypes.CDLL:
    """``libggml-base`` with the signatures used here declared; raises LlamaCppUnavailable."""
    d = lib_dir()
    candidates = sorted(d.glob("libggml-base.*")) + sorted(d.glob("ggml-base.*"))
    if not candidates:
        raise LlamaCppUnavailable(f"no libggml-base shared library in {d} (llama_cpp build without it?)")
    try:
        lib = ctypes.CDLL(str(candidates[0]))
    except OSError as e:
        raise LlamaCppUnavailable(f"cannot load {candidates[0]}: {e}") from None
    # size_t ggml_quantize_chunk(enum ggml_type type, const float * src, void * dst, int64_t start,
    #                            int64_t nrows, int64_t n_per_row, const float * imatrix);   (ggml.h)
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_requires_imatrix.restype = ctypes.c_bool
    lib.ggml_quantize_requires_imatrix.argtypes = [ctypes.c_int]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


def available() -> bool:
    """Whether ggml's quantizer can be called here."""
    try:
        libggml()
        return True
    except LlamaCppUnavailable:
        return False


#: the types ``ggml_quantize_chunk`` (ggml/src/ggml.c) has a case for; any other aborts the process
_GGML_QUANTIZE_CHUNK_TYPES = frozenset(
    "Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 MXFP4 Q2_K Q3_K Q4_K Q5_K Q6_K TQ1_0 TQ2_0 IQ2_XXS IQ2_XS IQ3_XXS IQ3_S IQ2_S IQ1_S "
    "IQ1_M IQ4_NL IQ4_XS F16 BF16 F32".split())


def ggml_quantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Quantize with ggml itself: ``float32 (..., row)`` -> ``uint8 (..., row_bytes)``, same layout as
    ``gguf.quants.quantize``. Uses no importance matrix (``imatrix=NULL``), i.e. ggml's reference algorithm.

    Raises LlamaCppUnavailable without llama-cpp-python, ValueError for a type ``ggml_quantize_chunk`` has no case
    for (Q8_K, the integer types: ggml aborts the process), a row of no values (a division by zero in ggml) or one
    that is not a whole number of blocks, or a type that needs an importance matrix.
    """
    lib = libggml()
    qtype = GGMLQuantizationType(qtype)
    if qtype.name not in _GGML_QUANTIZE_CHUNK_TYPES:
        raise ValueError(f"ggml_quantize_chunk cannot quantize to {qtype.name}")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    x = np.ascontiguousarray(data, dtype=np.float32)
    n_per_row = x.shape[-1] if x.ndim else 0
    if n_per_row == 0 or n_per_row % block_size:
        raise ValueError(f"row of {n_per_row} values is not a whole number of {qtype.name} blocks of {block_size}")
    if lib.ggml_quantize_requires_imatrix(int(qtype)):
        raise ValueError(f"ggml needs an importance matrix to quantize {qtype.name}")
    nrows = x.size // n_per_row if n_per_row else 0
    row_bytes = n_per_row // block_size * type_size
    assert lib.ggml_row_size(int(qtype), n_per_row) == row_bytes
    out = np.empty((*x.shape[:-1], row_bytes), dtype=np.uint8)
    written = lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, nrows, n_per_row, None)
    assert written == out.nbytes, (written, out.nbytes)
    return out

"""Test helpers other projects can import: Hypothesis strategies (:mod:`.strategies`), the real GGUF test asset
(:mod:`.assets`), ggml's own quantizer through llama-cpp-python (:mod:`.llamacpp`), and exact comparisons."""
from __future__ import annotations

import numpy as np
import torch


def _as_numpy(a) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        if a.dtype == torch.bfloat16:  # numpy has no bf16; widening to fp32 is exact and keeps every bit
            return a.float().numpy()
        return a.numpy()
    return np.asarray(a)


def assert_bitwise_equal(actual, expected, err_msg: str = "") -> None:
    """Assert two arrays/tensors have the same shape and dtype, NaN at the same places, and otherwise identical bit
    patterns (so ``-0.0 != +0.0``; NaN payloads may differ, as CPUs and numpy/torch propagate them differently)."""
    a, e = _as_numpy(actual), _as_numpy(expected)
    assert a.shape == e.shape, f"{err_msg}: shape {a.shape} != {e.shape}"
    assert a.dtype == e.dtype, f"{err_msg}: dtype {a.dtype} != {e.dtype}"
    if a.dtype.kind != "f":
        np.testing.assert_array_equal(a, e, err_msg=err_msg)
        return
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
    a, e = np.ascontiguousarray(a), np.ascontiguousarray(e)
    if np.array_equal(a.view(uint), e.view(uint)):  # fast path: identical bits, NaN payloads included
        return
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    np.testing.assert_array_equal(nan_a, nan_e, err_msg=f"{err_msg}: NaN positions differ")
    bits_a, bits_e = np.where(nan_a, 0, a.view(uint)), np.where(nan_e, 0, e.view(uint))
    bad = np.flatnonzero(bits_a != bits_e)
    assert bad.size == 0, (f"{err_msg}: {bad.size} of {a.size} values differ in their bits, first at flat index "
                           f"{bad[0]}: {a.reshape(-1)[bad[0]]!r} != {e.reshape(-1)[bad[0]]!r}")

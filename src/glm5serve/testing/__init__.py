"""Test helpers other projects can import: Hypothesis strategies (:mod:`.strategies`), the real GGUF test asset
(:mod:`.assets`), ggml's own quantizer through llama-cpp-python (:mod:`.llamacpp`), and exact comparisons."""
from __future__ import annotations

import numpy as np
import torch


def _as_numpy(a) -> tuple[np.ndarray, str]:
    """``(array, dtype name)``: torch's bf16 and float8 widened to fp32 for numpy (exact: every bit is kept), named
    as they were, so a bf16 tensor never equals an fp32 one."""
    if isinstance(a, torch.Tensor):
        a = a.detach().cpu()
        name = str(a.dtype).removeprefix("torch.")
        if a.dtype == torch.bfloat16 or (a.is_floating_point() and a.element_size() == 1):  # numpy has neither
            return a.float().numpy(), name
        return a.numpy(), name
    a = np.asarray(a)
    return a, a.dtype.name


def assert_bitwise_equal(actual, expected, err_msg: str = "") -> None:
    """Assert two arrays/tensors have the same shape and dtype, NaN at the same places, and otherwise identical bit
    patterns (so ``-0.0 != +0.0``; NaN payloads may differ, as CPUs and numpy/torch propagate them differently).
    Raises TypeError for a float dtype wider than 8 bytes (``np.longdouble``: its padding bytes are not defined)."""
    (a, a_name), (e, e_name) = _as_numpy(actual), _as_numpy(expected)
    assert a.shape == e.shape, f"{err_msg}: shape {a.shape} != {e.shape}"
    assert a_name == e_name, f"{err_msg}: dtype {a_name} != {e_name}"
    if a.dtype.kind != "f":
        np.testing.assert_array_equal(a, e, err_msg=err_msg)
        return
    uint = {2: np.uint16, 4: np.uint32, 8: np.uint64}.get(a.dtype.itemsize)
    if uint is None:
        raise TypeError(f"{err_msg}: cannot compare the bits of {a_name} values")
    a, e = np.ascontiguousarray(a), np.ascontiguousarray(e)
    if np.array_equal(a.view(uint), e.view(uint)):  # fast path: identical bits, NaN payloads included
        return
    nan_a, nan_e = np.isnan(a), np.isnan(e)
    np.testing.assert_array_equal(nan_a, nan_e, err_msg=f"{err_msg}: NaN positions differ")
    bits_a, bits_e = np.where(nan_a, 0, a.view(uint)), np.where(nan_e, 0, e.view(uint))
    bad = np.flatnonzero(bits_a != bits_e)
    assert bad.size == 0, (f"{err_msg}: {bad.size} of {a.size} values differ in their bits, first at flat index "
                           f"{bad[0]}: {a.reshape(-1)[bad[0]]!r} != {e.reshape(-1)[bad[0]]!r}")

"""The comparison helpers of :mod:`glm5serve.testing` that other tests trust: they must be able to fail."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from glm5serve.testing import assert_bitwise_equal
from glm5serve.testing.compare import first_divergence


def test_first_divergence_does_not_read_nan_or_inf_as_agreement():
    # rel_err is NaN there, and NaN > tol is False: hidden states full of NaN passed (fresh-user finding)
    ok = torch.ones(4)
    for bad in (torch.tensor([math.nan, 1, 1, 1]), torch.tensor([math.inf, 1, 1, 1])):
        i, e = first_divergence([ok, bad], [ok, ok], 1e-3)
        assert i == 1 and not e <= 1e-3
        assert first_divergence([bad.clone()], [bad], 1e-3) is not None  # equal, but not finite
    assert first_divergence([torch.zeros(3), ok], [torch.zeros(3), ok], 1e-3) is None  # 0/0, yet equal
    assert first_divergence([ok * 1.0001], [ok], 1e-3) is None
    assert first_divergence([ok * 1.01], [ok], 1e-3)[0] == 0


def test_assert_bitwise_equal_compares_dtypes_before_widening():
    # a bf16 tensor passed against an fp32 one: bf16 is widened to fp32 for numpy (fresh-user finding)
    with pytest.raises(AssertionError, match="dtype bfloat16 != float32"):
        assert_bitwise_equal(torch.tensor([1.5], dtype=torch.bfloat16), torch.tensor([1.5]))
    assert_bitwise_equal(torch.tensor([1.5], dtype=torch.bfloat16), torch.tensor([1.5], dtype=torch.bfloat16))
    assert_bitwise_equal(torch.tensor([1.5]), np.array([1.5], np.float32))
    f8 = torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn)  # a TypeError from numpy before
    assert_bitwise_equal(f8, f8.clone())
    with pytest.raises(AssertionError, match="differ in their bits"):
        assert_bitwise_equal(f8, torch.tensor([0.5, 2.0]).to(torch.float8_e4m3fn))
    with pytest.raises(AssertionError, match="differ in their bits"):
        assert_bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    if np.dtype(np.longdouble).itemsize > 8:  # a KeyError: 16 before
        with pytest.raises(TypeError, match="cannot compare the bits of float(96|128) values"):
            assert_bitwise_equal(np.ones(2, np.longdouble), np.ones(2, np.longdouble))

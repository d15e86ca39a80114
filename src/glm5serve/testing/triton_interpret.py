"""Helpers for running Triton kernels under the CPU interpreter (``TRITON_INTERPRET=1``) in tests."""
from __future__ import annotations


def patch_bf16_dot() -> None:
    """Make the interpreter's ``tl.dot`` exact for bf16 operands (idempotent).

    Triton's interpreter (3.6-3.8) multiplies bf16 ``tl.dot`` operands as their raw 16-bit integers; widening them to
    fp32 first (bf16 is the top half of an fp32) gives the product a GPU computes. Call only with the interpreter on.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    builder = interp.InterpreterBuilder
    if getattr(builder.create_dot, "_glm5serve_bf16", False):
        return
    create_dot = builder.create_dot

    def widen(h):
        if not h.dtype.is_bf16():
            return h
        return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def patched(self, a, b, d, *rest):
        return create_dot(self, widen(a), widen(b), d, *rest)

    patched._glm5serve_bf16 = True
    builder.create_dot = patched

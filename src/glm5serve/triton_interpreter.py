"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) made to compute glm5serve's kernels as a GPU does.

The kernel modules call :func:`apply` when imported, so that a kernel run on CPU tensors under the interpreter (tests,
debugging) gives the GPU's numbers, bf16 included; without the interpreter it does nothing.
"""
from __future__ import annotations

import os


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, read when triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def apply() -> None:
    """:func:`patch_bf16_dot` when :func:`interpreting`, else nothing (idempotent)."""
    if interpreting():
        patch_bf16_dot()


def patch_bf16_dot() -> None:
    """Make the interpreter's ``tl.dot`` exact for bf16 operands (idempotent).

    Triton's interpreter (3.6-3.8) multiplies bf16 ``tl.dot`` operands as their raw 16-bit integers (upstream:
    triton-lang/triton#11584; the fix, #11585, was declined: bf16 is not supported by the interpreter), so every
    bf16 tensor-core path of the kernels returned values around 1e11. Widening the operands to fp32 first (bf16 is
    the top half of an fp32) gives the product a GPU computes. Call only with the interpreter on.
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

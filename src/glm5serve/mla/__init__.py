"""Portable Triton MLA attention (dense and DSA-sparse) and its vLLM attention backend.

``triton_mla`` holds the kernels and their torch reference; ``backend`` the vLLM backend (imported lazily: importing
this package imports neither vLLM nor Triton). :func:`register_backend` makes the backend selectable with
``--attention-backend CUSTOM``.
"""
from __future__ import annotations

__all__ = ["mla_decode", "mla_prefill", "mla_reference", "register_backend"]


def __getattr__(name: str):
    if name in ("mla_decode", "mla_prefill", "mla_reference"):
        from glm5serve.mla import triton_mla

        return getattr(triton_mla, name)
    if name == "register_backend":
        from glm5serve.mla.backend import register

        return register
    raise AttributeError(name)

"""``glm5serve.kernels.vllm_ops.install`` on the CPU: it replaces vllm-gguf-plugin's op lookups with glm5serve's
custom ops once, and those fall back to the plugin's own op wherever the Triton kernels do not apply (here: CPU
tensors, unquantized weights).  The GPU side (decode batches reach ``gguf_linear``/``gguf_moe``) is in
``tests/gpu/test_kernels_gpu.py``."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm_gguf_plugin", reason="vllm / vllm-gguf-plugin not installed")


def test_install_patches_plugin_ops_once_and_falls_back():
    from gguf import GGMLQuantizationType as Q
    from vllm_gguf_plugin import quantization

    from glm5serve.kernels import vllm_ops

    plugin_mul_mat = quantization.fused_mul_mat_gguf
    assert vllm_ops.install() and vllm_ops.install()
    assert str(quantization.fused_mul_mat_gguf) == "vllm.glm5serve_gguf_mul_mat"
    assert str(quantization.fused_moe_gguf) == "vllm.glm5serve_gguf_moe"
    x, w = torch.randn(3, 64), torch.randn(5, 64)
    y = quantization.fused_mul_mat_gguf(x, w, int(Q.F32))
    torch.testing.assert_close(y, x @ w.T)
    if not getattr(plugin_mul_mat, vllm_ops._MARK, False):  # first install in this process: original kept
        torch.testing.assert_close(plugin_mul_mat(x, w, int(Q.F32)), y)

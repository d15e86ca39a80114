"""Route vllm-gguf-plugin's GGUF matmul and MoE ops to glm5serve's Triton kernels where those apply.

``install()`` replaces the two ops the plugin's ``GGUFLinearMethod.apply`` and ``GGUFMoEMethod.apply`` look up
at call time (``vllm_gguf_plugin.quantization.fused_mul_mat_gguf`` / ``fused_moe_gguf``) with custom ops that
run ``gguf_linear`` / ``gguf_moe`` for decode batches (<= 256 rows, supported types, CUDA, bf16/fp16) and call
the plugin's own op otherwise (prefill, F16/BF16/F32 weights, IQ types).  They are registered through vLLM's
``direct_register_custom_op`` with fake implementations, so torch.compile treats them as opaque and CUDA graphs
capture the Triton launches.  Call ``install()`` in every vLLM process after the plugin is imported, e.g. from
``glm5serve.vllm_plugin.register``; it is idempotent.
"""
from __future__ import annotations

import torch

from glm5serve.kernels.gguf_gemv import gguf_linear, supports
from glm5serve.kernels.gguf_moe import gguf_moe, supports_moe

_MARK = "_glm5serve_kernels"
_FAST_DTYPES = (torch.bfloat16, torch.float16)


def _use_linear(x: torch.Tensor, qweight: torch.Tensor, qweight_type: int) -> bool:
    return (x.is_cuda and x.dim() == 2 and x.dtype in _FAST_DTYPES and qweight.dtype == torch.uint8
            and supports(qweight_type, x.shape[0], qweight.shape[0], x.shape[1]))


def _use_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, qweight_type: int, qweight_type2: int,
             activation: str) -> bool:
    return (x.is_cuda and x.dim() == 2 and x.dtype in _FAST_DTYPES and activation == "silu"
            and w13.dtype == torch.uint8 and w2.dtype == torch.uint8
            and supports_moe(qweight_type, qweight_type2, x.shape[0], x.shape[1], w13.shape[1] // 2))


def install() -> bool:
    """Patch the plugin's op lookups (idempotent).  Returns False when vllm-gguf-plugin is not importable."""
    try:
        from vllm.utils.torch_utils import direct_register_custom_op
        from vllm_gguf_plugin import quantization
    except ImportError:
        return False
    if getattr(quantization.fused_mul_mat_gguf, _MARK, False):
        return True
    plugin_mul_mat, plugin_moe = quantization.fused_mul_mat_gguf, quantization.fused_moe_gguf

    def mul_mat(x: torch.Tensor, qweight: torch.Tensor, qweight_type: int) -> torch.Tensor:
        if _use_linear(x, qweight, qweight_type):
            return gguf_linear(x, qweight, qweight_type, qweight.shape[0])
        return plugin_mul_mat(x, qweight, qweight_type)

    def mul_mat_fake(x: torch.Tensor, qweight: torch.Tensor, qweight_type: int) -> torch.Tensor:
        return torch.empty(x.shape[0], qweight.shape[0], dtype=x.dtype, device=x.device)

    def moe(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, qweight_type: int, qweight_type2: int, activation: str) -> torch.Tensor:
        if _use_moe(x, w1, w2, qweight_type, qweight_type2, activation):
            return gguf_moe(x, w1, w2, topk_weights, topk_ids, qweight_type, qweight_type2, activation)
        return plugin_moe(x, w1, w2, topk_weights, topk_ids, qweight_type, qweight_type2, activation)

    def moe_fake(x, w1, w2, topk_weights, topk_ids, qweight_type, qweight_type2, activation) -> torch.Tensor:
        return torch.empty_like(x)

    direct_register_custom_op(op_name="glm5serve_gguf_mul_mat", op_func=mul_mat, fake_impl=mul_mat_fake)
    direct_register_custom_op(op_name="glm5serve_gguf_moe", op_func=moe, fake_impl=moe_fake)
    new_mul_mat, new_moe = torch.ops.vllm.glm5serve_gguf_mul_mat, torch.ops.vllm.glm5serve_gguf_moe
    for op in (new_mul_mat, new_moe):
        setattr(op, _MARK, True)
    quantization.fused_mul_mat_gguf, quantization.fused_moe_gguf = new_mul_mat, new_moe
    return True

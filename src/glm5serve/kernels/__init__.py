"""Triton kernels for GGUF-quantized decode: dense GEMV (``gguf_linear``) and top-k MoE (``gguf_moe``).

Both read the raw GGUF byte tensors as vllm-gguf-plugin stores them (``qweight``: (N, row_bytes) uint8,
MoE: (E, N, row_bytes) uint8) and dequantize in registers.  ``supports``/``supports_moe`` say where they are
meant to replace the plugin's kernels (decode batches of 1..256 rows); ``vllm_ops.install()`` makes the plugin's
``GGUFLinearMethod``/``GGUFMoEMethod`` use them there.
"""
from glm5serve.kernels.gguf_gemv import SUPPORTED_QTYPES, GemvConfig, gguf_linear, pick_config, supports
from glm5serve.kernels.gguf_topk_moe import gguf_moe, supports_moe

__all__ = ["SUPPORTED_QTYPES", "GemvConfig", "gguf_linear", "gguf_moe", "pick_config", "supports", "supports_moe"]

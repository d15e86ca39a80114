"""Single vLLM layers with vllm-gguf-plugin's GGUF methods (as glm5serve patches them) on a CPU, for the properties.

What is real: vLLM's layer classes, their ``weight_loader_v2``, the plugin's ``create_weights``/parameter loaders/
``process_weights_after_loading``/``apply``/``embedding``, glm5serve's fixes (:func:`glm5serve.vllm_plugin.register`)
and glm5serve's TP group stand-in (:func:`glm5serve.vllm_plugin.cpu.simulated_tp`). What is substituted: the plugin's
two kernel entry points (``fused_mul_mat_gguf``, ``apply_gguf_embedding``; CUDA or Triton only) by
:func:`cpu_fused_mul_mat_gguf`/:func:`cpu_apply_gguf_embedding` (glm5serve's dequantizer, then a float64 matmul).
"""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_py_dequantize

from glm5serve.dequant import dequantize

FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


def cpu_fused_mul_mat_gguf(x: torch.Tensor, qweight: torch.Tensor, qweight_type: int) -> torch.Tensor:
    """CPU stand-in for the plugin's ``fused_mul_mat_gguf`` op: ``x @ dequantize(qweight).T`` (float64 sums,
    rounded once to ``x.dtype``). ``qweight``: (N, row_bytes) uint8, or (N, K) in a float dtype for F32/F16/BF16."""
    if Q(int(qweight_type)) in FLOAT_TYPES:
        return (x.double() @ qweight.double().T).to(x.dtype)
    w = dequantize(qweight, Q(int(qweight_type))).double()  # fp32 values, exactly
    return (x.double() @ w.T).to(x.dtype)


def cpu_apply_gguf_embedding(x: torch.Tensor, qweight: torch.Tensor, qweight_type: int, hidden_size: int,
                             dtype: torch.dtype | None = None) -> torch.Tensor:
    """CPU stand-in for the plugin's ``apply_gguf_embedding`` op: the dequantized rows ``x`` of ``qweight``."""
    if Q(int(qweight_type)) in FLOAT_TYPES:
        return torch.embedding(qweight, x)
    rows = torch.index_select(qweight, 0, x.flatten())
    return dequantize(rows, Q(int(qweight_type)), dtype=dtype or torch.float32).view(*x.shape, hidden_size)


@contextlib.contextmanager
def cpu_kernels():
    """Within the block the plugin's GGUF linear and embedding methods run on the CPU stand-ins (``apply`` and
    ``embedding`` import the ops from ``vllm_gguf_plugin.quantization`` at call time)."""
    import vllm_gguf_plugin.quantization as quantization

    saved = quantization.fused_mul_mat_gguf, quantization.apply_gguf_embedding
    quantization.fused_mul_mat_gguf, quantization.apply_gguf_embedding = cpu_fused_mul_mat_gguf, cpu_apply_gguf_embedding
    try:
        yield
    finally:
        quantization.fused_mul_mat_gguf, quantization.apply_gguf_embedding = saved


def gguf_py_values(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> torch.Tensor:
    """The oracle: gguf-py's dequantization of raw bytes (uint8 (rows, row_bytes)) as float64 of numpy ``shape``."""
    typed = {Q.F32: np.float32, Q.F16: np.float16}.get(qtype)
    data = raw.view(typed) if typed is not None else raw
    return torch.from_numpy(gguf_py_dequantize(data, qtype).reshape(shape).astype(np.float64))


def as_loaded(raw: np.ndarray, qtype: Q, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A GGUF tensor as glm5serve's adapter hands it to vLLM: raw uint8 rows for block types, values in the model
    dtype for F32/F16/BF16 (the plugin computes float ``qweight``s as ``x @ W.T``)."""
    if qtype in FLOAT_TYPES:
        return gguf_py_values(raw, qtype, (raw.shape[0], cols)).to(dtype)
    return torch.from_numpy(raw.copy())


def load_gguf(layer, raw: torch.Tensor, qtype: Q, shard_id=None) -> None:
    """Feed one GGUF tensor to a layer's GGUF parameters as vLLM's ``load_weights`` does: ``qweight_type`` first,
    then ``qweight`` (the order of vllm-gguf-plugin's weight iterator), each through its own ``weight_loader``."""
    stored = {torch.float32: Q.F32, torch.float16: Q.F16, torch.bfloat16: Q.BF16}.get(raw.dtype, qtype)
    args = () if shard_id is None else (shard_id,)
    layer.qweight_type.weight_loader(layer.qweight_type, torch.tensor(int(stored), dtype=torch.uint8), *args)
    layer.qweight.weight_loader(layer.qweight, raw, *args)


def finish(layer) -> None:
    """``process_weights_after_loading`` of the layer's quant method (materialises, pads and orders shards)."""
    layer.quant_method.process_weights_after_loading(layer)


@pytest.fixture(scope="module")
def vllm_layers(tiny_checkpoint):
    """A registered glm5serve plugin (with its fixes), vLLM's stub CPU platform, a one-process distributed state and
    a current VllmConfig, so single vLLM layers can be built (module scope). Yields None: Hypothesis prints the
    arguments of a failing example, and a VllmConfig's repr raises."""
    pytest.importorskip("vllm")
    pytest.importorskip("vllm_gguf_plugin")
    from vllm.config import set_current_vllm_config

    from glm5serve.vllm_plugin import register
    from glm5serve.vllm_plugin.config_parser import hf_folder
    from glm5serve.vllm_plugin.cpu import init_single_process, use_stub_platform, vllm_config_for

    use_stub_platform()
    register()
    vc = vllm_config_for(hf_folder(tiny_checkpoint), dtype=torch.float32)
    init_single_process(vc)
    with set_current_vllm_config(vc):
        yield

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


_MEMO = "_glm5serve_test_values"


def _values(qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """float64 values of a GGUF weight (any leading dims), memoised per weight tensor while its storage, version
    and shape stay the same (a layer's parameters are dequantized once, not at every call)."""
    key = (qweight.data_ptr(), qweight._version, tuple(qweight.shape), int(qtype))
    hit = getattr(qweight, _MEMO, None)
    if hit is None or hit[0] != key:
        if Q(int(qtype)) in FLOAT_TYPES:
            values = qweight.detach().double()
        else:
            values = dequantize(qweight.detach(), Q(int(qtype))).double()  # fp32 values, exactly
        hit = (key, values)
        setattr(qweight, _MEMO, hit)
    return hit[1]


def cpu_fused_mul_mat_gguf(x: torch.Tensor, qweight: torch.Tensor, qweight_type: int) -> torch.Tensor:
    """CPU stand-in for the plugin's ``fused_mul_mat_gguf`` op: ``x @ dequantize(qweight).T`` (float64 sums,
    rounded once to ``x.dtype``). ``qweight``: (N, row_bytes) uint8, or (N, K) in a float dtype for F32/F16/BF16."""
    return (x.double() @ _values(qweight, qweight_type).T).to(x.dtype)


def cpu_apply_gguf_embedding(x: torch.Tensor, qweight: torch.Tensor, qweight_type: int, hidden_size: int,
                             dtype: torch.dtype | None = None) -> torch.Tensor:
    """CPU stand-in for the plugin's ``apply_gguf_embedding`` op: the dequantized rows ``x`` of ``qweight``."""
    if Q(int(qweight_type)) in FLOAT_TYPES:
        return torch.embedding(qweight, x)
    rows = torch.index_select(qweight, 0, x.flatten())
    return dequantize(rows, Q(int(qweight_type)), dtype=dtype or torch.float32).view(*x.shape, hidden_size)


def cpu_fused_moe_gguf(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor, qweight_type: int, qweight_type2: int, activation: str) -> torch.Tensor:
    """CPU stand-in for the plugin's ``fused_moe_gguf`` op: for each token, ``sum_k w_k · W2[e_k] (silu(g) * u)``
    with ``[g; u] = W13[e_k] x`` (vLLM's w13 layout: gate rows, then up rows), float64 sums, rounded once.
    ``w1``: (E, 2I, row_bytes) uint8, ``w2``: (E, H, row_bytes) uint8; ``topk_*``: (T, k)."""
    if activation != "silu":
        raise NotImplementedError(f"activation {activation!r}")
    out = torch.zeros(x.shape, dtype=torch.float64)
    w13, w2_values = _values(w1, qweight_type), _values(w2, qweight_type2)
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        g, u = (x[tok].double() @ w13[e].T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(g) * u) @ w2_values[e].T
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].double())
    return out.to(x.dtype)


@contextlib.contextmanager
def cpu_kernels():
    """Within the block the plugin's GGUF linear, embedding and MoE methods run on the CPU stand-ins (``apply`` and
    ``embedding`` import the ops from ``vllm_gguf_plugin.quantization`` at call time)."""
    import vllm_gguf_plugin.quantization as quantization

    names = ("fused_mul_mat_gguf", "apply_gguf_embedding", "fused_moe_gguf")
    saved = [getattr(quantization, n) for n in names]
    for n, f in zip(names, (cpu_fused_mul_mat_gguf, cpu_apply_gguf_embedding, cpu_fused_moe_gguf)):
        setattr(quantization, n, f)
    try:
        yield
    finally:
        for n, f in zip(names, saved):
            setattr(quantization, n, f)


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


_MODELS: dict = {}


def tiny_vllm_model(path, tp: int = 1, rank: int = 0, **overrides):
    """vLLM's GLM-5 class (``generic``) for rank ``rank`` of ``tp``, fp32, ``overrides`` set on its HF config,
    loaded from the GGUF at ``path`` by :func:`glm5serve.vllm_plugin.cpu.build_and_load`, then every linear,
    embedding and MoE layer's ``quant_method.process_weights_after_loading`` (attention has no CPU kernels and is
    left alone). Built once per process."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from glm5serve.vllm_plugin.cpu import build_and_load

    key = (str(path), tp, rank, tuple(sorted(overrides.items())))
    if key not in _MODELS:
        model, _ = build_and_load(path, tp=tp, rank=rank, dtype=torch.float32, config_overrides=overrides)
        with _simulated(tp, rank):
            for module in model.modules():
                if isinstance(module, (LinearBase, VocabParallelEmbedding)) or hasattr(module, "w13_qweight"):
                    module.quant_method.process_weights_after_loading(module)
        _MODELS[key] = model
    return _MODELS[key]


@contextlib.contextmanager
def _simulated(tp: int, rank: int):
    from glm5serve.vllm_plugin.cpu import simulated_tp

    with simulated_tp(tp, rank):
        yield


@contextlib.contextmanager
def running_rank(model, tp: int = 1, rank: int = 0):
    """Run ``model``'s layers as rank ``rank`` of ``tp`` on the CPU: the simulated TP group (whose ``all_reduce``
    returns this rank's partial result, for the caller to sum over ranks), vLLM's forward context for ``model``, and
    the CPU kernel stand-ins."""
    from vllm.distributed import parallel_state
    from vllm.forward_context import set_forward_context

    with _simulated(tp, rank), set_forward_context(None, model.model.vllm_config), cpu_kernels():
        parallel_state._TP.all_reduce = lambda t: t
        yield

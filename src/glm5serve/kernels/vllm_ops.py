"""Route vllm-gguf-plugin's GGUF matmul and MoE ops to glm5serve's Triton kernels where those apply.

``install()`` replaces the two ops the plugin's ``GGUFLinearMethod.apply`` and ``GGUFMoEMethod.apply`` look up
at call time (``vllm_gguf_plugin.quantization.fused_mul_mat_gguf`` / ``fused_moe_gguf``) with custom ops that
run ``gguf_linear`` / ``gguf_moe`` for decode batches (<= 256 rows, supported types, CUDA, bf16/fp16) and call
the plugin's own op otherwise (prefill, F16/BF16/F32 weights, IQ types).  They are registered through vLLM's
``direct_register_custom_op`` with fake implementations, so torch.compile treats them as opaque and CUDA graphs
capture the Triton launches.  Call ``install()`` in every vLLM process after the plugin is imported, e.g. from
``glm5serve.vllm_plugin.register``; it is idempotent.

With the ops installed, ``split_linear_weights`` (run by glm5serve's model loader after
``process_weights_after_loading``) regroups every Q4_0/Q5_0/Q8_0/Q6_K linear weight into split rows
(``kernels.gguf_split``) and gives it its split type id; ``mul_mat`` sends every call of a split type, any batch
size, to ``gguf_linear`` (the plugin's kernels cannot read split rows).
"""
from __future__ import annotations

import torch

from glm5serve.kernels.gguf_gemv import SPLIT_QTYPES, gguf_linear, supports
from glm5serve.kernels.gguf_topk_moe import gguf_moe, supports_moe

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
        if qweight_type in SPLIT_QTYPES:  # split rows: only glm5serve reads them, at every batch size
            y = gguf_linear(x.reshape(-1, x.shape[-1]), qweight, qweight_type, qweight.shape[0])
            return y.reshape(*x.shape[:-1], qweight.shape[0])
        if _use_linear(x, qweight, qweight_type):
            return gguf_linear(x, qweight, qweight_type, qweight.shape[0])
        return plugin_mul_mat(x, qweight, qweight_type)

    def mul_mat_fake(x: torch.Tensor, qweight: torch.Tensor, qweight_type: int) -> torch.Tensor:
        return torch.empty(*x.shape[:-1], qweight.shape[0], dtype=x.dtype, device=x.device)

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


def installed() -> bool:
    """Whether ``install()`` has replaced the plugin's ops in this process."""
    try:
        from vllm_gguf_plugin import quantization
    except ImportError:
        return False
    return bool(getattr(quantization.fused_mul_mat_gguf, _MARK, False))


def split_linear_weights(model: torch.nn.Module, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Regroup the weights glm5serve serves as split rows (``gguf_split.served_split``: Q4_0/Q5_0/Q8_0/Q6_K of an
    even number of blocks; Q6_K unless ``$GLM5SERVE_SPLIT_Q6_K=0``) of every GGUF linear layer (vllm-gguf-plugin's
    ``GGUFLinearMethod``, and an untied ``ParallelLMHead``, whose ``GGUFEmbeddingMethod`` only multiplies) on a CUDA device into split rows, in
    place, and set their type ids (``layer.qweight_type.weight_type`` and the fused shards' ``shard_weight_type``)
    to the split ids, so the plugin's ``apply`` hands them to ``mul_mat``.  Fused shards of mixed types are
    regrouped shard by shard (rows ``start:end``, the shard's ``size`` bytes).  Run after
    ``process_weights_after_loading`` (vLLM's MLA has by then dequantized ``kv_b_proj`` through the GGUF bytes) and
    only with ``install()`` in effect.  ``devices``: the device types whose weights are regrouped (the kernels run on
    CUDA).  Returns the number of layers regrouped (in whole or in some of their shards)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm_gguf_plugin.quantization.linear import GGUFLinearMethod
    from vllm_gguf_plugin.quantization.vocal_embeds import GGUFEmbeddingMethod

    from glm5serve.kernels.gguf_split import served_split, split_rows, split_type

    done = 0
    for layer in model.modules():
        method = type(getattr(layer, "quant_method", None))
        # an untied lm_head (its own ParallelLMHead; a tied one is the embedding module) is only read by apply()
        lm_head = method is GGUFEmbeddingMethod and isinstance(layer, ParallelLMHead)
        if method is not GGUFLinearMethod and not lm_head:
            continue
        qweight, types = getattr(layer, "qweight", None), getattr(layer, "qweight_type", None)
        # ReplicatedLinear (the indexer's wq_b) has no input_size_per_partition: its input_size is the whole K
        K = (layer.embedding_dim if lm_head else
             getattr(layer, "input_size_per_partition", None) or getattr(layer, "input_size", None))
        if qweight is None or types is None or K is None or qweight.dim() != 2 or qweight.device.type not in devices:
            continue
        shard_ids = list(getattr(qweight, "shard_id", None) or [])
        shard_types = {i: types.shard_weight_type.get(i, types.weight_type) for i in shard_ids}
        if len(set(shard_types.values())) > 1:  # mixed types: the plugin's apply slices each shard out
            ours = [i for i in shard_ids if served_split(shard_types[i], K)]
            for i in ours:
                start, end, size = qweight.shard_offset_map[i]
                qweight.data[start:end, :size] = split_rows(qweight.data[start:end, :size], shard_types[i], K)
                types.shard_weight_type[i] = split_type(shard_types[i])
            done += bool(ours)
        elif served_split(types.weight_type if not shard_ids else shard_types[shard_ids[0]], K):
            qtype = types.weight_type if not shard_ids else shard_types[shard_ids[0]]
            qweight.data.copy_(split_rows(qweight.data, qtype, K))
            types.weight_type = split_type(qtype)
            for i in shard_ids:
                types.shard_weight_type[i] = split_type(qtype)
            done += 1
    return done


def split_weight_count(model: torch.nn.Module) -> int:
    """The number of layers of ``model`` whose GGUF weight holds split rows in whole or in some fused shards (a
    ``qweight_type`` or shard type that is a split id): what :func:`split_linear_weights` left regrouped."""
    n = 0
    for layer in model.modules():
        types = getattr(layer, "qweight_type", None)
        if types is not None and hasattr(types, "weight_type"):
            ids = [types.weight_type, *(getattr(types, "shard_weight_type", None) or {}).values()]
            n += any(t in SPLIT_QTYPES for t in ids)
    return n

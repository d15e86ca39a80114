"""vLLM attention backend ``CUSTOM`` = glm5serve's Triton sparse MLA (DSA top-k), for vLLM 0.25.x and 0.33.x.

The thinnest wrapper vLLM allows: the backend, metadata and builder follow vLLM's own ``FLASH_ATTN_MLA_SPARSE``
(``v1/attention/backends/mla/flashattn_mla_sparse.py``), and the impl's ``forward_mqa`` hands every token (decode,
and in 0.25 prefill too) to :func:`glm5serve.mla.triton_mla.mla_decode` with the indexer's logical top-k list, the
request of each token and the block table; the kernel resolves positions through the block table itself, so there
is no index conversion pass and no constraint on ``index_topk``, head count or MLA dims.

* 0.33: the impl is a ``SparseMLACommonImpl`` (its dense-MHA prefill for prompts no longer than ``index_topk``
  and its weight handling are vLLM's), the builder a ``SparseMLACommonMetadataBuilder``.
* 0.25: the impl is a ``SparseMLAAttentionImpl`` (MQA only: vLLM sends all tokens through ``forward_mqa``), with the
  same builder as vLLM 0.25's ``FlashAttnMLASparseMetadataBuilder``.

CUDA graphs: ``UNIFORM_BATCH`` (full graphs for uniform decode batches). The launch depends only on the token count,
the head count and the top-k width; the split-K scratch is one static buffer per device shared by all layers (they
run one after another on one stream), sized for the largest split any batch can use; outputs come from the caching
allocator, as in vLLM's own MLA backends. Not supported (refused by ``supports_combination``): fp8 KV cache,
decode context parallelism, HiSparse.

Select with ``--attention-backend CUSTOM`` after :func:`glm5serve.mla.register_backend` has run (the glm5serve
vLLM plugin does it in every process). This module imports vLLM; only vLLM imports it (through the class path).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.config import VllmConfig
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, AttentionLayer, MultipleOf

from glm5serve.mla import triton_mla

#: vLLM >= 0.26 has a shared sparse-MLA base (``SparseMLACommonImpl``); 0.25 has ``SparseMLAAttentionImpl``.
HAS_SPARSE_COMMON = importlib.util.find_spec("vllm.model_executor.layers.attention.sparse_mla_attention") is not None
NAME = "CUSTOM"


def _hf_text_config(vllm_config: VllmConfig):
    mc = vllm_config.model_config
    return getattr(mc, "hf_text_config", None) or mc.hf_config


class TritonMLASparseBackend(AttentionBackend):
    """DSA-sparse MLA on any CUDA GPU with Triton (sm80+), any head count, MLA dims and ``index_topk``."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_builder_cls():
        return TritonMLASparseMetadataBuilder

    @staticmethod
    def get_impl_cls():
        return TritonMLASparseImpl

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any kv_lora_rank + qk_rope_head_dim

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return capability.major >= 8

    @classmethod
    def supports_combination(cls, head_size: int, dtype: torch.dtype, kv_cache_dtype, block_size, use_mla: bool,
                             has_sink: bool, use_sparse: bool, use_mm_prefix: bool,
                             device_capability: DeviceCapability) -> str | None:
        """None if this backend can serve the current vLLM config, else the reason (vLLM's selector prints it)."""
        if kv_cache_dtype not in (None, "auto", "float16", "bfloat16"):
            return "glm5serve Triton sparse MLA supports only an fp16/bf16 KV cache"
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
        if vllm_config is None or vllm_config.model_config is None:
            return None
        if vllm_config.parallel_config.decode_context_parallel_size > 1:
            return "glm5serve Triton sparse MLA does not support decode context parallelism"
        if getattr(getattr(vllm_config, "attention_config", None), "hisparse_config", None) is not None:
            return "glm5serve Triton sparse MLA does not support HiSparse"
        if not hasattr(_hf_text_config(vllm_config), "index_topk"):
            return "glm5serve Triton sparse MLA needs a model with index_topk (a DSA indexer)"
        return None

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        """vLLM's MLA cache layout: one latent row ``[c_kv | k_pe]`` of ``head_size`` per token slot."""
        return (num_blocks, block_size, head_size)  # vLLM 0.25 asks; 0.33 derives it from the spec


# One split-K scratch per device, shared by every layer; sized by :func:`scratch_numel`.
_SCRATCH: dict[torch.device, torch.Tensor] = {}


def scratch_numel(num_heads: int, kv_lora_rank: int, num_sms: int) -> int:
    """Upper bound of ``split_workspace_numel`` over every token count: splits are only used while tokens x head
    tiles x splits <= 2 x SMs (``default_num_splits``), so tokens x heads x splits <= 32 x SMs."""
    return 2 * num_sms * min(num_heads, triton_mla.BLOCK_H) * (kv_lora_rank + 1)


def shared_scratch(device: torch.device, numel: int) -> torch.Tensor:
    """The device's fp32 scratch, grown (before any CUDA graph capture: impls call this at construction)."""
    buf = _SCRATCH.get(device)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[device] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf


class _TritonForwardMQA:
    """``forward_mqa`` shared by both vLLM versions (mixed into the version's sparse impl)."""

    num_heads: int
    kv_lora_rank: int
    scale: float

    def _init_triton(self) -> None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self._scratch = shared_scratch(device, scratch_numel(self.num_heads, self.kv_lora_rank, sms))

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata, layer: AttentionLayer
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q = (ql_nope (T, H, L), q_pe (T, H, R)) or their concatenation; returns ((T, H, L), lse (T, H) or None).
        Every token attends to its own top-k list (``topk_indices_buffer``, logical positions, -1 unused)."""
        if isinstance(q, tuple):
            ql_nope, q_pe = q
        else:
            ql_nope, q_pe = q[..., :self.kv_lora_rank], q[..., self.kv_lora_rank:]
        T = q_pe.shape[0]
        topk = self.topk_indices_buffer[:T]
        num_splits = triton_mla.default_num_splits(T, ql_nope.shape[1], topk.shape[1], ql_nope.device)
        if triton_mla.split_workspace_numel(T, ql_nope.shape[1], num_splits, self.kv_lora_rank) > \
                self._scratch.numel():
            num_splits = 1  # only if the heads were all-gathered past num_heads; never in supported configs
        out, lse = triton_mla.mla_decode(
            ql_nope, q_pe, kv_c_and_k_pe_cache, self.scale, block_table=attn_metadata.block_table,
            req_ids=attn_metadata.req_id_per_token[:T], topk_indices=topk, num_splits=num_splits,
            workspace=self._scratch)
        return out, (lse if getattr(self, "need_to_return_lse_for_decode", False) else None)


if HAS_SPARSE_COMMON:  # vLLM 0.33
    from vllm.model_executor.layers.attention.sparse_mla_attention import (
        SparseMLACommonImpl,
        SparseMLACommonMetadata,
        SparseMLACommonMetadataBuilder,
    )

    @dataclass
    class TritonMLASparseMetadata(SparseMLACommonMetadata):
        pass

    class TritonMLASparseMetadataBuilder(SparseMLACommonMetadataBuilder[TritonMLASparseMetadata]):
        metadata_cls = TritonMLASparseMetadata
        _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

        def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig,
                     device: torch.device) -> None:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)

    class TritonMLASparseImpl(_TritonForwardMQA, SparseMLACommonImpl[TritonMLASparseMetadata]):
        def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes,
                     sliding_window, kv_cache_dtype: str, logits_soft_cap, attn_type: str,
                     kv_sharing_target_layer_name, topk_indices_buffer: torch.Tensor | None = None,
                     indexer: Any | None = None, **mla_args: Any) -> None:
            if any([alibi_slopes, sliding_window, logits_soft_cap]):
                raise NotImplementedError("glm5serve Triton sparse MLA: no alibi, sliding window or soft cap")
            super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                             kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                             indexer=indexer, topk_indices_buffer=topk_indices_buffer, **mla_args)
            assert self.topk_indices_buffer is not None, "sparse MLA needs the indexer's top-k buffer"
            self.supports_quant_query_input = False
            self._init_triton()

else:  # vLLM 0.25
    from vllm.utils.torch_utils import np_to_pinned_tensor
    from vllm.v1.attention.backend import (
        AttentionMetadata,
        AttentionMetadataBuilder,
        CommonAttentionMetadata,
        SparseMLAAttentionImpl,
    )

    @dataclass
    class TritonMLASparseMetadata(AttentionMetadata):
        num_reqs: int
        max_query_len: int
        max_seq_len: int
        num_actual_tokens: int
        query_start_loc: torch.Tensor
        slot_mapping: torch.Tensor
        block_table: torch.Tensor
        req_id_per_token: torch.Tensor
        block_size: int = 64
        topk_tokens: int = 2048

    class TritonMLASparseMetadataBuilder(AttentionMetadataBuilder[TritonMLASparseMetadata]):
        _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

        def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig,
                     device: torch.device) -> None:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
            self.topk_tokens = _hf_text_config(vllm_config).index_topk
            self.req_id_per_token_buffer = torch.empty(
                (vllm_config.scheduler_config.max_num_batched_tokens,), dtype=torch.int32, device=device)

        def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
                  fast_build: bool = False) -> TritonMLASparseMetadata:
            """The step's metadata; ``req_id_per_token`` is a view of a buffer whose zeroed tail serves the
            CUDA-graph padding tokens (graphs capture its address, so it is refilled, never reallocated)."""
            cm = common_attn_metadata
            starts = np.asarray(cm.query_start_loc_cpu, dtype=np.int32)
            req_id_per_token = np.repeat(np.arange(len(starts) - 1, dtype=np.int32), np.diff(starts))
            self.req_id_per_token_buffer.fill_(0)  # CUDA-graph padding tokens read request 0
            self.req_id_per_token_buffer[:req_id_per_token.shape[0]].copy_(
                np_to_pinned_tensor(req_id_per_token), non_blocking=True)
            return TritonMLASparseMetadata(
                num_reqs=cm.num_reqs, max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
                num_actual_tokens=cm.num_actual_tokens, query_start_loc=cm.query_start_loc,
                slot_mapping=cm.slot_mapping, block_table=cm.block_table_tensor,
                req_id_per_token=self.req_id_per_token_buffer[:cm.num_actual_tokens],
                block_size=self.kv_cache_spec.block_size, topk_tokens=self.topk_tokens)

    class TritonMLASparseImpl(_TritonForwardMQA, SparseMLAAttentionImpl[TritonMLASparseMetadata]):
        def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int, alibi_slopes,
                     sliding_window, kv_cache_dtype: str, logits_soft_cap, attn_type: str,
                     kv_sharing_target_layer_name, topk_indices_buffer: torch.Tensor | None = None,
                     indexer: Any | None = None, **mla_args: Any) -> None:
            if any([alibi_slopes, sliding_window, logits_soft_cap]):
                raise NotImplementedError("glm5serve Triton sparse MLA: no alibi, sliding window or soft cap")
            if kv_cache_dtype not in ("auto", "float16", "bfloat16"):
                raise NotImplementedError("glm5serve Triton sparse MLA supports only an fp16/bf16 KV cache")
            self.num_heads = num_heads
            self.head_size = head_size
            self.scale = float(scale)
            self.num_kv_heads = num_kv_heads
            self.kv_cache_dtype = kv_cache_dtype
            self.kv_lora_rank: int = mla_args["kv_lora_rank"]
            self.qk_rope_head_dim: int = mla_args["qk_rope_head_dim"]
            self.topk_indices_buffer = indexer.topk_indices_buffer if indexer is not None else topk_indices_buffer
            assert self.topk_indices_buffer is not None, "sparse MLA needs the indexer's top-k buffer"
            self.supports_quant_query_input = False
            self.dcp_world_size = -1  # as vLLM 0.25's sparse impls: MLAAttention fills it in
            self.q_pad_num_heads = None
            self._init_triton()

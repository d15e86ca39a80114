"""Portable Triton MLA attention (dense and DSA-sparse) and its vLLM attention backend.

``triton_mla`` holds the kernels and their torch reference, ``testing`` test batches, ``backend`` the vLLM backend
(imported by vLLM through its class path only). Importing this package imports neither vLLM nor Triton.

* :func:`register_backend` makes the backend vLLM's ``CUSTOM`` attention backend (``--attention-backend CUSTOM``);
* :func:`select_backend` picks it for a sparse-MLA model when vLLM has no sparse MLA backend of its own for the
  GPU, dims and ``index_topk``.
"""
from __future__ import annotations

__all__ = ["BACKEND_CLASS", "hook_backend_selection", "mla_decode", "mla_prefill", "mla_reference",
           "register_backend", "select_backend", "vllm_sparse_backend"]

BACKEND_CLASS = "glm5serve.mla.backend.TritonMLASparseBackend"
#: (kv_lora_rank, qk_rope_head_dim) that vLLM's own sparse MLA kernels are written for (FlashMLA, FA3 q_v, TRT-LLM)
VLLM_SPARSE_MLA_DIMS = (512, 64)


def __getattr__(name: str):
    if name in ("mla_decode", "mla_prefill", "mla_reference"):
        from glm5serve.mla import triton_mla

        return getattr(triton_mla, name)
    raise AttributeError(name)


def register_backend() -> None:
    """Register :data:`BACKEND_CLASS` as ``AttentionBackendEnum.CUSTOM`` (idempotent; vLLM 0.25 and 0.33)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.backends.registry import register_backend as vllm_register_backend

    vllm_register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS)


def vllm_sparse_backend(vllm_config) -> str | None:
    """The sparse MLA backend vLLM itself would pick for ``vllm_config`` on this GPU (class path), or None.

    Asks the platform's own selector (every backend's ``validate_configuration``), then drops the answer when the
    model's MLA dims are not :data:`VLLM_SPARSE_MLA_DIMS`: vLLM's sparse kernels are hand-written for those, and
    not every backend says so in its checks (FLASH_ATTN_MLA_SPARSE accepts any head size).
    """
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    mc = vllm_config.model_config
    text = getattr(mc, "hf_text_config", None) or mc.hf_config
    if (getattr(text, "kv_lora_rank", None), getattr(text, "qk_rope_head_dim", None)) != VLLM_SPARSE_MLA_DIMS:
        return None
    cfg = AttentionSelectorConfig(head_size=mc.get_head_size(), dtype=mc.dtype,
                                  kv_cache_dtype=vllm_config.cache_config.cache_dtype, block_size=None,
                                  use_mla=True, use_sparse=True)
    with set_current_vllm_config(vllm_config):
        try:
            return current_platform.get_attn_backend_cls(
                None, attn_selector_config=cfg, num_heads=mc.get_num_attention_heads(vllm_config.parallel_config))
        except ValueError:
            return None


def select_backend(vllm_config) -> bool:
    """For a DSA-sparse MLA model with no attention backend chosen by the user, choose ``CUSTOM`` when vLLM has no
    sparse MLA backend of its own (:func:`vllm_sparse_backend`). Returns True when it did. Call it in the engine
    process once ``vllm_config`` exists and before the model is built (e.g. after ``EngineArgs.create_engine_config``);
    workers receive the choice with the config."""
    from vllm.platforms import current_platform

    mc = vllm_config.model_config
    if mc is None or not current_platform.is_cuda():
        return False
    text = getattr(mc, "hf_text_config", None) or mc.hf_config
    attention = vllm_config.attention_config
    if attention.backend is not None or not getattr(mc, "use_mla", False) or not hasattr(text, "index_topk"):
        return False
    if vllm_sparse_backend(vllm_config) is not None:
        return False
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    register_backend()
    attention.backend = AttentionBackendEnum.CUSTOM
    return True


def hook_backend_selection() -> None:
    """Wrap ``EngineArgs.create_engine_config`` so that every engine built from arguments (``vllm serve``,
    ``vllm.LLM``) runs :func:`select_backend` on its config (idempotent). The workers' block size follows the
    chosen backend later (``Platform.update_block_size_for_backend`` runs in the executor)."""
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_engine_config
    if getattr(orig, "_glm5serve_hooked", False):
        return

    def create_engine_config(self, *args, **kwargs):
        config = orig(self, *args, **kwargs)
        if select_backend(config):
            import logging

            logging.getLogger("glm5serve").info(
                "glm5serve: vLLM has no sparse MLA backend for this GPU and these dims; using the Triton backend "
                "(attention backend CUSTOM)")
        return config

    create_engine_config._glm5serve_hooked = True
    EngineArgs.create_engine_config = create_engine_config

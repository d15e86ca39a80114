"""vLLM's own GLM-5 model classes on a CPU, loaded from a GGUF at a simulated tensor-parallel rank (for tests).

vLLM cannot run GLM-5 on a CPU (its CPU platform rejects sparse attention; the plugin's kernels are CUDA/Triton), but
building the model and loading its weights needs no kernel. Stubbed here, and nothing else: the platform (vLLM's
``CpuPlatform`` with a stub attention backend selection: :class:`StubSparseMLABackend` has no kernels and is only
ever constructed; dense CPU weights are not packed for ``vllm._C``, which is not built here) and the TP group
(``parallel_state._TP`` is replaced by a :class:`SimulatedTPGroup`, which is what
``get_tensor_model_parallel_rank``/``world_size`` read, so every module sees rank ``r`` of ``tp``). Model classes,
``create_weights``, weight loaders and ``load_weights`` are vLLM's and the plugin's own.
"""
from __future__ import annotations

import contextlib
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

#: vLLM's GLM-5 model classes by where they run: ``generic`` is ``model_executor/models/deepseek_v2.py``'s
#: ``GlmMoeDsaForCausalLM`` (vLLM 0.33 on CPU/XPU, and the class vLLM 0.25 uses everywhere); ``cuda`` is 0.33's
#: ``models/deepseek_v32/nvidia/model.py`` ``DeepseekV32ForCausalLM`` (what a GPU runs with 0.33)
MODEL_CLASSES = {
    "generic": ("vllm.model_executor.models.deepseek_v2", "GlmMoeDsaForCausalLM"),
    "cuda": ("vllm.models.deepseek_v32.nvidia.model", "DeepseekV32ForCausalLM"),
}


class StubSparseMLAImpl:
    """Accepts whatever ``MLAAttention`` constructs its backend impl with; has no kernels."""

    is_sparse = True
    supports_dense_mha_prefill = False
    supports_quant_query_input = False
    dcp_world_size = 1

    def __init__(self, **kwargs):
        self.kwargs = kwargs

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        pass


class StubSparseMLABackend:
    """An MLA backend class as ``get_attn_backend`` returns it (selection only)."""

    @staticmethod
    def is_mla() -> bool:
        return True

    @staticmethod
    def get_name() -> str:
        return "GLM5SERVE_CPU_STUB"

    @staticmethod
    def get_impl_cls():
        return StubSparseMLAImpl


def _stub_platform_cls():
    from vllm.platforms.cpu import CpuPlatform

    class StubCpuPlatform(CpuPlatform):
        """vLLM's CPU platform whose attention selection returns :class:`StubSparseMLABackend`."""

        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
            return f"{__name__}.StubSparseMLABackend"

    return StubCpuPlatform


def use_stub_platform() -> None:
    """Make vLLM's current platform the stub CPU platform, also in vLLM modules that already bound
    ``current_platform`` at import (idempotent)."""
    import vllm.platforms as platforms
    from vllm.platforms.interface import Platform

    from vllm.model_executor.layers import utils as layer_utils

    current = platforms._current_platform
    if current is not None and type(current).__name__ == "StubCpuPlatform":
        return
    # the CPU platform packs dense weights for vllm._C's CPU GEMM (not built here): use a plain F.linear
    layer_utils.dispatch_cpu_unquantized_gemm = _plain_cpu_gemm
    stub = _stub_platform_cls()()
    platforms._current_platform = stub
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm") and isinstance(getattr(module, "current_platform", None), Platform):
            module.current_platform = stub


def _plain_cpu_gemm(layer: torch.nn.Module, remove_weight: bool) -> None:
    layer.cpu_linear = torch.nn.functional.linear


@dataclass
class SimulatedTPGroup:
    """What vLLM reads from the TP ``GroupCoordinator`` while building and loading a model."""

    world_size: int
    rank_in_group: int


_DIST_READY = False


def init_single_process(vllm_config) -> None:
    """vLLM's distributed state for one CPU process (gloo, world size 1); once per process."""
    global _DIST_READY
    if _DIST_READY:
        return
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(vllm_config):
        rendezvous = Path(tempfile.mkdtemp(prefix="glm5serve-dist-")) / "init"
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{rendezvous}")
        initialize_model_parallel(1, 1)
    _DIST_READY = True


@contextlib.contextmanager
def simulated_tp(tp: int, rank: int):
    """Within the block, this process is rank ``rank`` of a ``tp``-way tensor-parallel group."""
    from vllm.distributed import parallel_state

    real = parallel_state._TP
    parallel_state._TP = SimulatedTPGroup(tp, rank)
    try:
        yield
    finally:
        parallel_state._TP = real


def vllm_config_for(folder, dtype: torch.dtype = torch.bfloat16, max_model_len: int | None = None):
    """A ``VllmConfig`` for the HF folder of a GLM-5 GGUF (:func:`config_parser.hf_folder`), CPU device, eager."""
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=str(folder), dtype=dtype, max_model_len=max_model_len, skip_tokenizer_init=True,
                     enforce_eager=True)
    return VllmConfig(model_config=mc, device_config=DeviceConfig(device="cpu"))


def model_class(kind: str):
    """vLLM's GLM-5 class ``generic`` or ``cuda`` (see :data:`MODEL_CLASSES`)."""
    import importlib

    module, name = MODEL_CLASSES[kind]
    return getattr(importlib.import_module(module), name)


def build_and_load(gguf_path, *, tp: int = 1, rank: int = 0, kind: str = "generic",
                   dtype: torch.dtype = torch.bfloat16, config_overrides: dict | None = None):
    """Build vLLM's GLM-5 model for rank ``rank`` of ``tp`` on CPU and load ``gguf_path`` into it with
    :class:`~glm5serve.vllm_plugin.weights.GlmDsaWeightsAdapter` (before ``process_weights_after_loading``).
    ``config_overrides`` are set on the HF config first (as ``--hf-overrides`` would).

    Returns ``(model, adapter)``. Raises GGUFModelError exactly where a real load would (bad file, TP size the
    file does not allow, tensors or parameters left unused).
    """
    use_stub_platform()
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_gguf_plugin import GGUFConfig

    from glm5serve.vllm_plugin import register
    from glm5serve.vllm_plugin.config_parser import hf_folder
    from glm5serve.vllm_plugin.weights import GlmDsaWeightsAdapter

    register()
    vc = vllm_config_for(hf_folder(gguf_path), dtype)
    init_single_process(vc)
    for key, value in (config_overrides or {}).items():
        setattr(vc.model_config.hf_config, key, value)
    adapter = GlmDsaWeightsAdapter(vc.model_config.hf_config)
    spec = adapter.prepare_loading(str(Path(gguf_path)), vc.model_config, tp_size=tp)
    vc.quant_config = GGUFConfig(list(spec.unquantized_modules))
    with simulated_tp(tp, rank), set_default_torch_dtype(dtype):
        with torch.device("cpu"):  # as GGUFModelLoader.load_model builds it
            model = initialize_model(vllm_config=vc, model_class=model_class(kind))
        adapter.load_into(model, vc.model_config)
    return model, adapter

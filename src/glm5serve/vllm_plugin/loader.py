"""The ``gguf`` model loader with a checked GLM-5 load: vllm-gguf-plugin's ``GGUFModelLoader`` for every other model.

The plugin's ``load_model`` hands the adapter's stream to ``model.load_weights`` and ignores what was loaded. For a
GLM-5 GGUF this loader builds the model the same way, then loads through
:meth:`~glm5serve.vllm_plugin.weights.GlmDsaWeightsAdapter.load_into`, which checks before
``process_weights_after_loading`` that every GGUF tensor and every vLLM parameter was used, and afterwards, with
glm5serve's kernels installed, regroups Q4_0/Q5_0/Q8_0/Q6_K linear weights into split rows
(:func:`glm5serve.kernels.vllm_ops.split_linear_weights`).

:class:`GLM5SyntheticModelLoader` (``load_format="glm5-synthetic"``) is the same load with random valid tensor
bytes made on the device (:class:`~glm5serve.synthetic.SyntheticSource`) instead of the file's data.
"""
from __future__ import annotations

import torch
from vllm.logger import init_logger
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm_gguf_plugin.loader import GGUFModelLoader

from glm5serve.errors import GGUFModelError
from glm5serve.kernels import vllm_ops
from glm5serve.synthetic import LOAD_FORMAT, SyntheticSource
from glm5serve.vllm_plugin import check_parallel
from glm5serve.vllm_plugin.weights import GlmDsaWeightsAdapter

logger = init_logger(__name__)


class GLM5GGUFModelLoader(GGUFModelLoader):
    """``load_format="gguf"``: checked loading for ``glm_moe_dsa``, the plugin's loader otherwise."""

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        """Build the model and load the GGUF into it (GLM-5: every tensor checked against the schema, GGUFModelError
        naming file and tensor otherwise); then regroup split-row weights for glm5serve's kernels."""
        if not GlmDsaWeightsAdapter.matches(model_config.hf_config):
            return super().load_model(vllm_config, model_config, prefix)
        _check_parallel(vllm_config, model_config)
        adapter = self._prepare_adapter(model_config)
        vllm_config.model_config.hf_config = model_config.hf_config
        vllm_config.quant_config.unquantized_modules.extend(adapter.load_spec.unquantized_modules)
        target_device = torch.device(vllm_config.device_config.device)
        with set_default_torch_dtype(model_config.dtype):
            with target_device:
                model = initialize_model(vllm_config=vllm_config, prefix=prefix)
            adapter.load_into(model, model_config)
            process_weights_after_loading(model, model_config, target_device)
        if vllm_ops.installed():  # Q4_0/Q5_0/Q8_0 (Q6_K) linears to split rows, read by glm5serve's kernels only
            n = vllm_ops.split_linear_weights(model)
            logger.info("glm5serve: %d GGUF linear weights regrouped into split rows", n)
        return model

    def load_weights(self, model: torch.nn.Module, model_config) -> None:
        """Load the GGUF's weights into a ``model`` vLLM built already (the loader interface's other entry point),
        GLM-5 checked as in :meth:`load_model`."""
        if not GlmDsaWeightsAdapter.matches(model_config.hf_config):
            return super().load_weights(model, model_config)
        self._prepare_adapter(model_config).load_into(model, model_config)


class GLM5SyntheticModelLoader(GLM5GGUFModelLoader):
    """``load_format="glm5-synthetic"``: :class:`GLM5GGUFModelLoader`'s checked GLM-5 load, with every tensor's bytes
    from a :class:`~glm5serve.synthetic.SyntheticSource` (seed 0) on the model's device instead of from the file.

    The GGUF -- a header from ``glm5serve synthetic-gguf`` or any GLM-5 GGUF -- gives names, types and shapes only;
    its data is never read. For benchmarks: the engine runs the real shapes and kernels on meaningless weights.
    """

    seed = 0

    def load_model(self, vllm_config, model_config, prefix: str = ""):
        if not GlmDsaWeightsAdapter.matches(model_config.hf_config):
            raise GGUFModelError(f"load format {LOAD_FORMAT} is for GLM-5 (glm-dsa) GGUFs, not model type "
                                 f"{getattr(model_config.hf_config, 'model_type', None)!r}",
                                 file=str(model_config.model_weights or model_config.model))
        self.device = torch.device(vllm_config.device_config.device)
        return super().load_model(vllm_config, model_config, prefix)

    def load_weights(self, model: torch.nn.Module, model_config) -> None:
        self.device = next(model.parameters()).device
        super().load_weights(model, model_config)

    def _prepare_adapter(self, model_config):
        adapter = GlmDsaWeightsAdapter(model_config.hf_config)
        adapter.source = SyntheticSource(self.seed, self.device)
        adapter.prepare_loading(self._prepare_weights(model_config), model_config)
        return adapter


def register_synthetic_loader() -> None:
    """Register :class:`GLM5SyntheticModelLoader` as vLLM's ``glm5-synthetic`` load format (idempotent)."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER, register_model_loader

    if _LOAD_FORMAT_TO_MODEL_LOADER.get(LOAD_FORMAT) is not GLM5SyntheticModelLoader:
        register_model_loader(LOAD_FORMAT)(GLM5SyntheticModelLoader)


def _check_parallel(vllm_config, model_config) -> None:
    """:func:`glm5serve.vllm_plugin.check_parallel` on vLLM's parallel config (no pipeline or expert parallelism)."""
    pc = vllm_config.parallel_config
    check_parallel(pc.pipeline_parallel_size, getattr(pc, "enable_expert_parallel", False),
                   file=str(model_config.model_weights or model_config.model))

"""glm5serve as a vLLM plugin: ``vllm serve GLM-5-00001-of-0000N.gguf`` with nothing else on the command line.

The ``vllm.general_plugins`` entry point ``glm5serve`` runs :func:`register` in every vLLM process. Modules:
``config_parser`` (config and tokenizer from GGUF metadata), ``weights`` (the GLM-DSA weights adapter),
``loader`` (checked loading), ``fixes`` (every vllm-gguf-plugin fault fix), ``cpu`` (vLLM's GLM-5 model on a
CPU, for tests), ``serve`` (``glm5serve serve``).
Importing this package does not import vLLM.
"""
from __future__ import annotations


def require_gpus(tp: int) -> None:
    """Raise GGUFModelError (one line) unless vLLM is installed and at least ``tp`` CUDA GPUs are visible: what a
    vLLM engine would otherwise fail on only after a long start, or with a traceback from deep inside vLLM."""
    import importlib.util

    from glm5serve.errors import GGUFModelError

    if importlib.util.find_spec("vllm") is None:
        raise GGUFModelError("vLLM is not installed: pip install 'glm5serve[vllm]'")
    import torch

    if torch.cuda.device_count() < tp:
        raise GGUFModelError(f"needs {tp} CUDA GPU(s), {torch.cuda.device_count()} visible: vLLM cannot run GLM-5's "
                             "sparse attention on a CPU")


def check_parallel(pipeline_parallel_size: int, expert_parallel: bool, file: str | None = None) -> None:
    """Raise GGUFModelError (one line, naming ``file`` and the flag) for pipeline parallelism (a size above 1) or
    expert parallelism: glm5serve loads GLM-5's experts as whole 3-D tensors (no per-expert placement) and needs
    every layer's tensors in each process (the completeness check). The loader and ``serve``'s pre-flight both ask
    here, so that what vLLM would refuse only after it took the GPUs is refused before."""
    from glm5serve.errors import GGUFModelError

    given = [f"--pipeline-parallel-size {pipeline_parallel_size}"] * (pipeline_parallel_size > 1)
    given += ["--enable-expert-parallel"] * bool(expert_parallel)
    if given:
        raise GGUFModelError(f"glm5serve loads GLM-5 GGUF with tensor parallelism only, not {' or '.join(given)} "
                             "(experts load as whole 3-D tensors; every layer must reach each GPU)", file=file)


#: vLLM's switch for running MoE shared experts on a second CUDA stream, overlapped with the routed experts
SHARED_EXPERTS_STREAM_ENV = "VLLM_DISABLE_SHARED_EXPERTS_STREAM"


def serialize_shared_experts() -> None:
    """Run MoE shared experts on the main CUDA stream (``VLLM_DISABLE_SHARED_EXPERTS_STREAM=1``) unless the user set
    the variable.

    Measured on an H200 (vLLM 0.25, narrow ud-q4_k_xl, eager): with the overlap of vllm#26440 (shared experts on
    an aux stream, launched after the routed experts), an engine whose first request ran while Triton compiled its
    kernels and other processes loaded the GPU returned wrong logits for that whole request: step-0 chosen-token
    logprob -0.08 where a warm engine, an engine without the aux stream and the fp32 reference give -0.46 / -0.45.
    5 of 5 engines started together next to a matmul load (vLLM's sparse MLA and glm5serve's Triton MLA alike),
    1 of 3 in ``test_vllm_e2e.py`` at three engines per GPU; with the stream off 0 of 3; without the load 0 of 1.
    Later requests were exact. The root cause is not isolated (glm5serve's GEMV on an aux stream alone is exact);
    vllm#28942 (and the closed #28939) fixed a related fault: shared experts reading hidden states the routed
    experts had changed. Costs the overlap: at most the shared expert's time per MoE layer."""
    import os

    os.environ.setdefault(SHARED_EXPERTS_STREAM_ENV, "1")


KERNELS_ENV = "GLM5SERVE_GGUF_KERNELS"


def gguf_kernels() -> str:
    """Whose GGUF decode kernels vLLM runs: ``glm5serve`` (the default) or ``plugin`` (vllm-gguf-plugin's own), from
    ``$GLM5SERVE_GGUF_KERNELS``. Raises ValueError for another value."""
    from glm5serve.kernels.gguf_gemv import env_choice

    return env_choice(KERNELS_ENV, ("glm5serve", "plugin"), "glm5serve")


def register() -> None:
    """Register glm5serve with vLLM (idempotent; vLLM runs general plugins in no fixed order).

    Runs ``vllm_gguf_plugin.register()`` first (idempotent too), then layers on top: the plugin fixes, the GLM-DSA
    weights adapter (first in the plugin's adapter registry), the checked ``gguf`` model loader, the ``gguf``
    config parser and the engine-argument hook that gives a ``glm-dsa`` GGUF its config and tokenizer; then
    glm5serve's GGUF decode kernels (:func:`glm5serve.kernels.vllm_ops.install`; ``GLM5SERVE_GGUF_KERNELS=plugin``
    keeps the plugin's own) and the Triton MLA backend as ``CUSTOM`` (``--attention-backend CUSTOM``; chosen
    automatically where vLLM has no sparse MLA backend for the GPU and dims: :func:`glm5serve.mla.select_backend`).
    Before anything, :func:`serialize_shared_experts`. Raises ValueError for a bad ``$GLM5SERVE_GGUF_KERNELS``.
    """
    serialize_shared_experts()  # before vLLM builds the MoE layers, which read it
    import vllm_gguf_plugin
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader, register_model_loader
    from vllm_gguf_plugin import weights_adapter

    from glm5serve import mla
    from glm5serve.kernels import vllm_ops
    from glm5serve.vllm_plugin import config_parser, fixes
    from glm5serve.vllm_plugin.loader import GLM5GGUFModelLoader, register_synthetic_loader
    from glm5serve.vllm_plugin.weights import GlmDsaWeightsAdapter

    vllm_gguf_plugin.register()
    fixes.apply()
    if GlmDsaWeightsAdapter not in weights_adapter._ADAPTER_REGISTRY:
        weights_adapter._ADAPTER_REGISTRY.insert(0, GlmDsaWeightsAdapter)
    if not isinstance(get_model_loader(LoadConfig(load_format="gguf")), GLM5GGUFModelLoader):
        register_model_loader("gguf")(GLM5GGUFModelLoader)
    register_synthetic_loader()
    config_parser.register()
    if gguf_kernels() == "glm5serve":
        vllm_ops.install()
    mla.register_backend()
    mla.hook_backend_selection()

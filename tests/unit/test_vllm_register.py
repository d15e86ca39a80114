"""``glm5serve.vllm_plugin.register`` wires everything a vLLM process needs: the plugin fixes and loader (tested
in test_vllm_load/test_vllm_faults), glm5serve's GGUF decode kernels, the Triton MLA backend as ``CUSTOM`` and the
automatic backend choice on every engine config."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("vllm_gguf_plugin", reason="vllm / vllm-gguf-plugin not installed")

_PROBE = """
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm_gguf_plugin import quantization
from glm5serve.vllm_plugin import register
register(); register()
print(str(quantization.fused_mul_mat_gguf), str(quantization.fused_moe_gguf))
print(AttentionBackendEnum.CUSTOM.get_path())
print(getattr(EngineArgs.create_engine_config, "_glm5serve_hooked", False))
"""


def _probe(**env) -> list[str]:
    import os

    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, **env))
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-3:]


def test_register_installs_kernels_backend_and_selection():
    from glm5serve.mla import BACKEND_CLASS

    ops, backend, hooked = _probe()
    assert ops == "vllm.glm5serve_gguf_mul_mat vllm.glm5serve_gguf_moe"
    assert backend == BACKEND_CLASS
    assert hooked == "True"


def test_plugin_kernels_kept_on_request():
    ops, backend, hooked = _probe(GLM5SERVE_GGUF_KERNELS="plugin")
    assert "glm5serve" not in ops
    assert hooked == "True"


_STREAM_PROBE = """
from glm5serve.vllm_plugin import register
register()
import vllm.envs as envs
print(envs.VLLM_DISABLE_SHARED_EXPERTS_STREAM)
"""


@pytest.mark.parametrize("user, expected", [(None, "True"), ("0", "False"), ("1", "True")])
def test_register_runs_shared_experts_on_the_main_stream_unless_the_user_chose(user, expected):
    """vLLM reads VLLM_DISABLE_SHARED_EXPERTS_STREAM as True after register() (the aux-stream overlap returned wrong
    first requests on the H200, see ``serialize_shared_experts``); a user's own setting wins."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "VLLM_DISABLE_SHARED_EXPERTS_STREAM"}
    if user is not None:
        env["VLLM_DISABLE_SHARED_EXPERTS_STREAM"] = user
    r = subprocess.run([sys.executable, "-c", _STREAM_PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == expected

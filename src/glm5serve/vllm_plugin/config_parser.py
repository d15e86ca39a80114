"""Config and tokenizer for vLLM from a ``glm-dsa`` GGUF alone: no config.json, no tokenizer files, no HF repo.

vllm-gguf-plugin reads the HF config from a folder (``--hf-config-path``, ``--tokenizer`` or the GGUF's own folder)
and vLLM loads the tokenizer from one. For a GLM-5 GGUF given with neither option, :func:`register`'s engine
argument hook writes that folder from the GGUF metadata once — ``config.json`` (:func:`glm5_config`),
``generation_config.json`` and the tokenizer files (:func:`glm5serve.tokenizer.tokenizer_from_gguf`) — into the
glm5serve cache and points ``hf_config_path`` and ``tokenizer`` at it, so every later step (vLLM 0.25 or 0.33,
front end or worker) sees an ordinary HF folder. The ``gguf`` config parser is also extended: handed a GLM-5 GGUF
file itself (``--hf-config-path model.gguf``), it builds the config from the metadata.
"""
from __future__ import annotations

import functools
import hashlib
import shutil
import tempfile
from pathlib import Path

from vllm_gguf_plugin.config_parser import GGUFConfigParser

from glm5serve.config import ARCH, eog_token_ids

#: the modules whose code decides what :func:`hf_folder` writes: a change to any of them makes a fresh folder
WRITERS = ("config", "tokenizer", "vllm_plugin.config_parser")


@functools.lru_cache(maxsize=64)
def _arch(path: str, size: int, mtime_ns: int) -> str | None:
    from gguf import GGUFReader

    try:
        field = GGUFReader(path, "r").fields.get("general.architecture")
        return None if field is None else str(field.contents())
    except Exception:  # not a readable GGUF: not ours to handle; vLLM reports it
        return None


def is_glm_dsa_gguf(path) -> bool:
    """True if ``path`` is a GGUF file (any shard 1) whose ``general.architecture`` is ``glm-dsa``."""
    p = Path(str(path))
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            return False
    st = p.stat()
    return _arch(str(p.resolve()), st.st_size, st.st_mtime_ns) == ARCH


def glm5_config(model):
    """The ``GlmMoeDsaConfig`` vLLM gets for a GLM-5 GGUF (:class:`~glm5serve.gguf_file.GGUFModel` or path).

    :func:`glm5serve.config.config_from_metadata` plus ``index_topk_pattern`` (``F``/``S`` per layer) when the file
    declares ``shared`` indexer layers (GLM-5.2): vLLM builds an indexer where the pattern says ``F`` and lets an
    ``S`` layer reuse the previous layer's top-k, which is what transformers' ``indexer_types`` means.
    """
    from glm5serve.config import config_from_metadata
    from glm5serve.gguf_file import GGUFModel

    cfg = config_from_metadata(model if hasattr(model, "metadata") else GGUFModel(model))
    types = list(getattr(cfg, "indexer_types", None) or [])
    if "shared" in types:
        cfg.index_topk_pattern = "".join("F" if t == "full" else "S" for t in types)
    return cfg


def hf_folder(gguf_path, tokenizer: bool = True) -> Path:
    """The HF-style folder (config, generation config and, if ``tokenizer``, the tokenizer) for a GLM-5 GGUF, written
    once per file version. Without ``tokenizer`` (vLLM was given ``--tokenizer``) the GGUF's tokenizer is never built,
    so one that does not build is no obstacle; that folder is another cache entry.

    Keyed by the resolved path, size and mtime of shard 1, the transformers version and a digest of the code that
    writes it (:data:`WRITERS`, :func:`glm5serve.cache.code_digest`); written to a temporary folder
    and renamed, so concurrent callers never see a half-written folder. Raises GGUFModelError for a bad GGUF.
    """
    from transformers import GenerationConfig

    from glm5serve.gguf_file import GGUFModel
    from glm5serve.tokenizer import tokenizer_from_gguf

    p = Path(str(gguf_path)).resolve()
    st = p.stat()
    import transformers

    from glm5serve.cache import cache_dir, code_digest, shareable

    stamp = f"{p}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}|{code_digest(WRITERS)}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    out = cache_dir() / "hf" / f"{p.stem}-{key}{'' if tokenizer else '-config'}"
    if (out / "config.json").is_file():
        return out
    model = GGUFModel(p)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        cfg = glm5_config(model)
        cfg.save_pretrained(tmp)
        gen = GenerationConfig.from_model_config(cfg)
        if len(eog := eog_token_ids(model)) > 1:  # vLLM adds the others to every request's stop_token_ids
            gen.eos_token_id = eog
        gen.save_pretrained(tmp)
        if tokenizer:
            tokenizer_from_gguf(model).save_pretrained(tmp)
        shareable(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process won the race: use its folder
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def register() -> None:
    """Install the ``gguf`` config parser and the engine-argument hook (idempotent)."""
    from vllm.transformers_utils.config import get_config_parser, register_config_parser

    if not isinstance(get_config_parser("gguf"), GLM5ConfigParser):
        register_config_parser("gguf")(GLM5ConfigParser)
    _hook_engine_args()


def _hook_engine_args() -> None:
    """Wrap ``EngineArgs.create_model_config`` (outside the plugin's own wrap, which turns GGUF on and picks the
    config folder from ``hf_config_path``): a GLM-5 GGUF without ``--hf-config-path``/``--tokenizer`` gets the
    :func:`hf_folder` for whichever is missing (without the tokenizer when ``--tokenizer`` brings one or
    ``--skip-tokenizer-init`` needs none)."""
    from vllm.engine.arg_utils import EngineArgs

    orig = EngineArgs.create_model_config
    if getattr(orig, "_glm5serve_hooked", False):
        return

    @functools.wraps(orig)
    def create_model_config(self, *args, **kwargs):
        if (self.hf_config_path is None or self.tokenizer is None) and isinstance(self.model, str) \
                and is_glm_dsa_gguf(self.model):
            folder = str(hf_folder(self.model, tokenizer=self.tokenizer is None and not self.skip_tokenizer_init))
            self.hf_config_path = self.hf_config_path or folder
            self.tokenizer = self.tokenizer or folder
        return orig(self, *args, **kwargs)

    create_model_config._glm5serve_hooked = True
    EngineArgs.create_model_config = create_model_config


class GLM5ConfigParser(GGUFConfigParser):
    """vllm-gguf-plugin's ``gguf`` config parser, plus: a GLM-5 GGUF file yields :func:`glm5_config`."""

    def parse(self, model, trust_remote_code, revision=None, code_revision=None, **kwargs):
        """(config dict, ``PretrainedConfig``) of ``model``; GLM-5 GGUFs from their metadata, others as the plugin."""
        if is_glm_dsa_gguf(model):
            cfg = glm5_config(model)
            return cfg.to_dict(), cfg
        return super().parse(model, trust_remote_code, revision=revision, code_revision=code_revision, **kwargs)

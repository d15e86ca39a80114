"""Config and tokenizer from a GLM-5 GGUF alone through vLLM's hooks, and the plugin's registration (issue 4, 1-2)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("vllm_gguf_plugin")

TEXTS = ["Hello, world! 123", "  spaces\tand\nnewlines  ", "<|user|>hi<|assistant|>", "naïve café 😀"]


@pytest.fixture(scope="module")
def registered():
    from glm5serve.vllm_plugin import register
    from glm5serve.vllm_plugin.cpu import use_stub_platform

    use_stub_platform()
    register()


def test_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("glm5serve") == "glm5serve.vllm_plugin:register"


@pytest.mark.parametrize("order", ["glm5serve-first", "plugin-first"])
def test_register_is_idempotent_in_either_plugin_order(registered, order):
    """vLLM runs general plugins in no fixed order, in every process, maybe more than once."""
    import vllm_gguf_plugin
    from vllm.config.load import LoadConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.transformers_utils.config import get_config_parser
    from vllm_gguf_plugin import weight_utils, weights_adapter
    from vllm_gguf_plugin.quantization import linear, params

    from glm5serve.vllm_plugin import register
    from glm5serve.vllm_plugin.config_parser import GLM5ConfigParser
    from glm5serve.vllm_plugin.loader import GLM5GGUFModelLoader
    from glm5serve.vllm_plugin.weights import GlmDsaWeightsAdapter

    calls = [register, vllm_gguf_plugin.register] * 2
    for f in calls if order == "glm5serve-first" else calls[::-1]:
        f()
    assert weights_adapter._ADAPTER_REGISTRY.count(GlmDsaWeightsAdapter) == 1
    assert weights_adapter._ADAPTER_REGISTRY[0] is GlmDsaWeightsAdapter
    assert type(get_model_loader(LoadConfig(load_format="gguf"))) is GLM5GGUFModelLoader
    assert type(get_config_parser("gguf")) is GLM5ConfigParser
    hook = EngineArgs.create_model_config
    assert hook._glm5serve_hooked and not getattr(hook.__wrapped__, "_glm5serve_hooked", False)
    # each plugin function wrapped exactly once: the wrapper's __wrapped__ is the plugin's own function
    for fn in (params._GGUFParamLoadMixin.load_merged_column_weight, params._GGUFParamLoadMixin.load_qkv_weight,
               linear.GGUFLinearMethod.create_weights, weight_utils.gguf_quant_weights_iterator_multi):
        assert fn._glm5serve_fixed and fn.__wrapped__.__module__.startswith("vllm_gguf_plugin")
        assert not getattr(fn.__wrapped__, "__wrapped__", None)


def test_hf_folder_config_round_trips(registered, tiny_checkpoint):
    from transformers import AutoConfig

    from glm5serve.vllm_plugin.config_parser import glm5_config, hf_folder

    folder = hf_folder(tiny_checkpoint)
    got = AutoConfig.from_pretrained(folder).to_dict()
    want = glm5_config(str(tiny_checkpoint)).to_dict()
    for d in (got, want):
        for key in ("transformers_version", "_name_or_path"):
            d.pop(key, None)
    assert got == want
    assert got["model_type"] == "glm_moe_dsa" and got["topk_method"] == "noaux_tc"


def test_hf_folder_tokenizer_is_the_gguf_tokenizer(registered, tiny_checkpoint):
    from transformers import AutoTokenizer

    from glm5serve.tokenizer import tokenizer_from_gguf
    from glm5serve.vllm_plugin.config_parser import hf_folder

    folder_tok = AutoTokenizer.from_pretrained(hf_folder(tiny_checkpoint))
    gguf_tok = tokenizer_from_gguf(tiny_checkpoint)
    for text in TEXTS:
        assert folder_tok.encode(text) == gguf_tok.encode(text), text
    msgs = [{"role": "user", "content": "Hi"}]
    assert (folder_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == gguf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    assert folder_tok.eos_token_id == gguf_tok.eos_token_id


def test_hf_folder_is_written_once_per_file_version(registered, tiny_checkpoint, tmp_path, monkeypatch):
    from glm5serve.vllm_plugin.config_parser import hf_folder

    monkeypatch.setenv("GLM5SERVE_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / "model.gguf"
    shutil.copy(tiny_checkpoint, copy)
    first = hf_folder(copy)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert hf_folder(copy) == first and (first / "config.json").stat().st_mtime_ns == stamp
    os.utime(copy, ns=(stamp + 10**9, stamp + 10**9))  # a rewritten file gets a fresh folder
    assert hf_folder(copy) != first
    assert [p.name for p in first.parent.iterdir() if p.name.startswith(".")] == []  # no temporary left over
    second = hf_folder(copy)
    import glm5serve.cache

    # a change to the code that writes the folder (config, tokenizer, this parser) gets a fresh folder too
    monkeypatch.setattr(glm5serve.cache, "code_digest", lambda sources: "changed-code")
    assert hf_folder(copy) not in (first, second)


def test_config_parser_reads_a_gguf_file(registered, tiny_checkpoint):
    from vllm.transformers_utils.config import get_config_parser

    from glm5serve.vllm_plugin.config_parser import glm5_config

    config_dict, cfg = get_config_parser("gguf").parse(str(tiny_checkpoint), trust_remote_code=False)
    assert cfg.to_dict() == glm5_config(str(tiny_checkpoint)).to_dict() == config_dict


def test_engine_args_with_only_the_gguf(registered, tiny_split_checkpoint):
    """``vllm serve shard-1.gguf``: quantization, loader, config and tokenizer all come from the file."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.tokenizers.registry import cached_tokenizer_from_config

    from glm5serve.tokenizer import tokenizer_from_gguf
    from glm5serve.vllm_plugin.config_parser import hf_folder

    path = str(tiny_split_checkpoint)
    args = EngineArgs(model=path, enforce_eager=True)
    mc = args.create_model_config()
    folder = str(hf_folder(path))
    assert (mc.model, mc.tokenizer, mc.hf_config_path, mc.model_weights) == (folder, folder, folder, path)
    assert (mc.quantization, args.load_format) == ("gguf", "gguf")
    assert mc.hf_config.model_type == "glm_moe_dsa" and mc.architectures == ["GlmMoeDsaForCausalLM"]
    assert mc.max_model_len == mc.hf_config.max_position_embeddings
    tok = cached_tokenizer_from_config(mc)
    for text in TEXTS:
        assert tok.encode(text) == tokenizer_from_gguf(path).encode(text), text


def test_explicit_config_folder_and_tokenizer_are_kept(registered, tiny_checkpoint, tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    from glm5serve.vllm_plugin.config_parser import hf_folder

    mine = tmp_path / "mine"
    shutil.copytree(hf_folder(tiny_checkpoint), mine)
    mc = EngineArgs(model=str(tiny_checkpoint), hf_config_path=str(mine), tokenizer=str(mine),
                    enforce_eager=True).create_model_config()
    assert (mc.hf_config_path, mc.tokenizer) == (str(mine), str(mine))


def test_a_tokenizer_given_to_vllm_replaces_the_ggufs(registered, tiny_checkpoint, tmp_path, gguf_rewrite):
    """With --tokenizer the GGUF's tokenizer is never built: a file whose merges are missing still gets its config
    (the config folder was written with the GGUF's tokenizer, which failed: session 41 left-alone item)."""
    from vllm.engine.arg_utils import EngineArgs

    from glm5serve.errors import GGUFModelError
    from glm5serve.vllm_plugin.config_parser import glm5_config, hf_folder

    mine = tmp_path / "mine"
    shutil.copytree(hf_folder(tiny_checkpoint), mine)
    path = str(gguf_rewrite(tiny_checkpoint, tmp_path / "notok.gguf", drop_keys={"tokenizer.ggml.merges"}))
    with pytest.raises(GGUFModelError, match="merges"):
        EngineArgs(model=path, enforce_eager=True).create_model_config()
    mc = EngineArgs(model=path, tokenizer=str(mine), enforce_eager=True).create_model_config()
    assert mc.tokenizer == str(mine) and mc.hf_config_path == str(hf_folder(path, tokenizer=False))
    got, want = mc.hf_config.to_dict(), glm5_config(str(tiny_checkpoint)).to_dict()
    assert got.pop("_name_or_path") == mc.hf_config_path and got == {k: v for k, v in want.items()
                                                                     if k != "_name_or_path"}
    assert not list(Path(mc.hf_config_path).glob("tokenizer*"))
    mc = EngineArgs(model=path, skip_tokenizer_init=True, enforce_eager=True).create_model_config()
    assert mc.skip_tokenizer_init and mc.hf_config_path == str(hf_folder(path, tokenizer=False))


def test_glm52_shared_indexer_layers_become_vllms_topk_pattern(registered, tmp_path):
    from glm5serve.checkpoint import make_checkpoint
    from glm5serve.vllm_plugin.config_parser import glm5_config

    path = make_checkpoint(tmp_path, "tiny", "bf16", indexer_types=["full", "shared", "full"])
    cfg = glm5_config(str(path))
    assert cfg.indexer_types == ["full", "shared", "full"] and cfg.index_topk_pattern == "FSF"


def test_vllm_stops_on_every_end_of_generation_token(registered, tiny_checkpoint):
    """The GGUF names three end-of-generation tokens (eos <|endoftext|>, eot <|user|>, eom <|observation|>), as
    llama.cpp's special_eog_ids and GLM's generation_config.json have them. vLLM must stop on all three: through
    vLLM's own code, the generation config of the model config it builds and a request's SamplingParams."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs

    from glm5serve.gguf_file import GGUFModel

    md = GGUFModel(tiny_checkpoint).metadata
    eos, eot, eom = (int(md[f"tokenizer.ggml.{r}_token_id"]) for r in ("eos", "eot", "eom"))
    assert len({eos, eot, eom}) == 3
    mc = EngineArgs(model=str(tiny_checkpoint), enforce_eager=True).create_model_config()
    gen = mc.try_get_generation_config()
    assert gen["eos_token_id"] == [eos, eot, eom], gen
    sp = SamplingParams(max_tokens=8)
    sp.update_from_generation_config(gen, eos)
    assert sorted(sp.stop_token_ids) == sorted([eot, eom]) and sp.eos_token_id == eos


def test_generate_stops_at_the_end_of_the_turn(tiny_checkpoint, monkeypatch, capsys):
    """``glm5serve generate`` stops on eot and eom as on eos (llama.cpp's llama-cli does the same)."""
    from glm5serve.cli import main
    from glm5serve.gguf_file import GGUFModel
    from glm5serve.reference import ReferenceModel

    md = GGUFModel(tiny_checkpoint).metadata
    seen, orig = [], ReferenceModel.stream

    def stream(self, ids, n, **kw):
        seen.append(set(kw["stop_ids"]))
        return orig(self, ids, n, **kw)

    monkeypatch.setattr(ReferenceModel, "stream", stream)
    assert main(["generate", str(tiny_checkpoint), "--prompt", "Hi", "--max-tokens", "2"]) == 0
    assert seen == [{int(md[f"tokenizer.ggml.{r}_token_id"]) for r in ("eos", "eot", "eom")}]


def test_hf_folder_is_readable_by_other_users(registered, tiny_checkpoint, tmp_path, monkeypatch):
    from glm5serve.vllm_plugin.config_parser import hf_folder

    monkeypatch.setenv("GLM5SERVE_CACHE", str(tmp_path / "cache"))
    mask = os.umask(0o022)
    try:
        folder = hf_folder(tiny_checkpoint)
    finally:
        os.umask(mask)
    assert folder.stat().st_mode & 0o777 == 0o755

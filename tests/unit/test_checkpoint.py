"""Synthetic checkpoints: determinism, converter layout (metadata, tensor inventory and order, F32 rules, kv_b
split), the quant mixes, split sets, logit margins / indexer ties, and llama.cpp accepting (and agreeing with) them."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFReader
from torch.overrides import TorchFunctionMode

from glm5serve import schema
from glm5serve._corpus import TEXT
from glm5serve.checkpoint import PRESETS, hf_state_dict, make_checkpoint, preset_config
from glm5serve.config import config_from_metadata
from glm5serve.dequant import dequantize_tensor
from glm5serve.gguf_file import GGUFModel
from glm5serve.tokenizer import tokenizer_from_gguf
from glm5serve.verify import verify

TINY = PRESETS["tiny"]


def test_same_arguments_give_the_same_bytes(tmp_path):
    a = make_checkpoint(tmp_path / "a", "tiny", "f32")
    b = make_checkpoint(tmp_path / "b", "tiny", "f32")
    c = make_checkpoint(tmp_path / "c", "tiny", "f32", seed=1)
    assert a.read_bytes() == b.read_bytes()
    assert c.name == "glm5-tiny-f32-s1.gguf" and c.read_bytes() != a.read_bytes()


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown preset"):
        make_checkpoint(tmp_path, "huge")
    with pytest.raises(ValueError, match="unknown mix"):
        make_checkpoint(tmp_path, "tiny", "q2_k")
    with pytest.raises(ValueError, match="--split must be >= 1"):
        make_checkpoint(tmp_path, "tiny", "bf16", split=0)
    with pytest.raises(ValueError, match="cannot split .* into 200 files"):
        make_checkpoint(tmp_path, "tiny", "bf16", split=200)


@pytest.mark.parametrize("split, want", [("0", "--split must be >= 1, not 0"), ("-1", "--split must be >= 1, not -1"),
                                         ("1000", "cannot split 94 tensors into 1000 files")])
def test_llama_q4_k_m_split_is_checked_before_any_work(tmp_path, capsys, split, want):
    """As for the other mixes: one line, exit 2, nothing written (no bf16 build, no llama.cpp quantize)."""
    from glm5serve.cli import main

    out = tmp_path / "out"
    assert main(["make-checkpoint", str(out), "--mix", "llama-q4_k_m", "--split", split]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"glm5serve make-checkpoint: {want}") and err.count("\n") == 1 and not out.exists()


def test_metadata_is_what_the_converter_writes(tiny_bf16_checkpoint):
    r = GGUFReader(tiny_bf16_checkpoint)
    md = {k: f.contents() for k, f in r.fields.items()}
    keys = [k for k in r.fields if not k.startswith("GGUF.")]
    assert keys[0] == "general.architecture" and md["general.architecture"] == "glm-dsa"
    p, a = TINY, "glm-dsa."
    want = {  # glm5-gguf.md "Metadata keys written", values from the preset
        "block_count": 4, "context_length": 512, "embedding_length": 256, "feed_forward_length": 512,
        "vocab_size": 512, "leading_dense_block_count": 1, "attention.head_count": 4, "attention.head_count_kv": 1,
        "attention.q_lora_rank": 256, "attention.kv_lora_rank": 128, "attention.key_length": 128 + 32,
        "attention.value_length": 128, "attention.key_length_mla": 64 + 32, "attention.value_length_mla": 64,
        "rope.dimension_count": 32, "expert_count": 16, "expert_used_count": 2, "expert_shared_count": 1,
        "expert_feed_forward_length": 256, "expert_weights_norm": True, "expert_gating_func": 2,
        "expert_group_count": 1, "expert_group_used_count": 1, "nextn_predict_layers": 1,
        "attention.indexer.head_count": p.index_n_heads, "attention.indexer.key_length": 64,
        "attention.indexer.top_k": 8}
    assert {k: md[a + k] for k in want} == want
    assert md[a + "expert_weights_scale"] == pytest.approx(2.5)
    assert md[a + "rope.freq_base"] == pytest.approx(1e6)
    assert md[a + "attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "glm4"
    assert len(md["tokenizer.ggml.tokens"]) == len(md["tokenizer.ggml.token_type"]) == 512
    tokens = md["tokenizer.ggml.tokens"]
    assert tokens[md["tokenizer.ggml.bos_token_id"]] == "[gMASK]"
    assert tokens[md["tokenizer.ggml.eos_token_id"]] == "<|endoftext|>"
    assert md["tokenizer.chat_template"].startswith("[gMASK]<sop>")
    assert md["general.file_type"] == 32  # LlamaFileType.MOSTLY_BF16
    assert a + "attention.indexer.types" not in md  # GLM-5 (not 5.2) files have none: every layer full


def test_tensor_inventory_order_and_f32_rule(tiny_bf16_checkpoint):
    m = GGUFModel(tiny_bf16_checkpoint)
    cfg = config_from_metadata(m)
    required = {s.gguf_name: s for s in schema.expected_tensors(cfg) if s.required}
    assert set(m.tensors) == set(required)
    names = list(m.tensors)
    # converter order: lm_head sorts first among HF names, model.norm last; merged experts down, gate, up;
    # kv_b_proj -> attn_k_b then attn_v_b
    assert names[0] == "output.weight" and names[1] == "token_embd.weight" and names[-1] == "output_norm.weight"
    for b in range(1, 4):
        i = names.index(f"blk.{b}.ffn_down_exps.weight")
        assert names[i:i + 3] == [f"blk.{b}.ffn_{w}_exps.weight" for w in ("down", "gate", "up")]
    for b in range(4):
        i = names.index(f"blk.{b}.attn_k_b.weight")
        assert names[i + 1] == f"blk.{b}.attn_v_b.weight"
    assert [n for n in names if ".nextn." in n] == [
        "blk.3.nextn.eh_proj.weight", "blk.3.nextn.enorm.weight", "blk.3.nextn.hnorm.weight",
        "blk.3.nextn.shared_head_norm.weight"]
    for t in m:
        f32 = len(t.shape) == 1 or t.name.endswith("_norm.weight") or ".ffn_gate_inp." in t.name or \
            not t.name.endswith(".weight")
        assert t.qtype == (Q.F32 if f32 else Q.BF16), t.name
    assert m["blk.1.exp_probs_b.bias"].qtype == Q.F32 and m["blk.1.ffn_gate_inp.weight"].qtype == Q.F32


def test_ud_mix(tiny_checkpoint):
    m = GGUFModel(tiny_checkpoint)
    types = {t.name: t.qtype for t in m}
    assert types["token_embd.weight"] == Q.Q4_K and types["output.weight"] == Q.Q6_K
    for b in range(4):
        assert types[f"blk.{b}.attn_k_b.weight"] in (Q.Q8_0, Q.Q5_0)
        assert types[f"blk.{b}.attn_norm.weight"] == Q.F32
    for b in range(1, 4):
        assert types[f"blk.{b}.ffn_gate_exps.weight"] == types[f"blk.{b}.ffn_up_exps.weight"] == Q.Q4_K
        assert types[f"blk.{b}.ffn_gate_inp.weight"] == Q.F32
        # UD-Q4_K_XL keeps more bits in the first MoE block's routed down projection only (not blocks 2 and MTP 3):
        # Q5_K there, Q4_K after, each a row-parallel share of 256 / max_tp 4 = 64 values cannot hold, so llama.cpp's
        # fallbacks Q5_1 and Q5_0
        assert types[f"blk.{b}.ffn_down_exps.weight"] == (Q.Q5_1 if b == TINY.first_k_dense_replace else Q.Q5_0), b
    specs = {s.gguf_name: s for s in schema.expected_tensors(config_from_metadata(m))}
    for t in m:  # blocks fit every row, and every row-parallel shard at the preset's largest TP
        block = GGML_QUANT_SIZES[t.qtype][0]
        assert t.shape[-1] % block == 0
        if specs[t.name].tp_split == "row":
            assert (t.shape[-1] // TINY.max_tp) % block == 0, t.name
    assert sum(t.qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K) for t in m) >= 20


def _dequantized_hf_state(path) -> tuple[object, dict[str, torch.Tensor]]:
    """The main model's transformers state dict rebuilt from a GGUF (dequantize; merge kv_b and gate/up)."""
    m = GGUFModel(path)
    cfg = config_from_metadata(m)
    parts: dict[str, list[torch.Tensor]] = {}
    required = {s.gguf_name for s in schema.expected_tensors(cfg) if s.required}
    for hf, gg in schema.hf_to_gguf(cfg).items():
        if not any(g in m for g in gg) and not required.intersection(gg):
            continue  # optional: the indexer of a "shared" layer
        parts[hf] = [dequantize_tensor(m[g]) for g in gg]
    state = {}
    for hf, ts in parts.items():
        if hf.endswith("kv_b_proj.weight"):
            state[hf] = schema.merge_kv_b(*ts)
        elif hf.endswith("experts.gate_up_proj"):
            state[hf] = schema.merge_gate_up(*ts)
        else:
            (state[hf],) = ts
    return cfg, state


def test_f32_checkpoint_holds_the_drawn_weights_exactly(tiny_f32_checkpoint):
    cfg, state = _dequantized_hf_state(tiny_f32_checkpoint)
    drawn = hf_state_dict(preset_config("tiny"), seed=0)
    main = {k: v for k, v in drawn.items() if not k.startswith(f"model.layers.{cfg.num_hidden_layers}.")}
    assert set(state) == set(main)
    for k in main:
        assert torch.equal(state[k], main[k]), k


def test_split_set_holds_the_same_tensors(tiny_split_checkpoint, tiny_checkpoint):
    assert tiny_split_checkpoint.name.endswith("-00001-of-00003.gguf")
    split, whole = GGUFModel(tiny_split_checkpoint), GGUFModel(tiny_checkpoint)
    assert [p.name[-20:] for p in split.paths] == [f"-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    assert list(split.tensors) == list(whole.tensors)
    assert len({t.file for t in split}) == 3
    for name, t in whole.tensors.items():
        assert split[name].qtype == t.qtype and np.array_equal(split[name].raw(), t.raw()), name
    later = GGUFReader(split.paths[1]).fields
    assert {k for k in later if not k.startswith("GGUF.")} == {"split.no", "split.count", "split.tensors.count"}
    for shard in split.paths[1:]:  # any shard names the set, the last one included
        other = GGUFModel(shard)
        assert other.paths == split.paths and list(other.tensors) == list(whole.tensors), shard.name


class _TopKRecorder(TorchFunctionMode):
    """Records the input of every ``Tensor.topk`` call while ``active`` (set by hooks around the indexer)."""

    def __init__(self):
        super().__init__()
        self.active, self.scores = False, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.active and func is torch.Tensor.topk:
            self.scores.append((args[0].detach().clone(), args[1]))
        return func(*args, **(kwargs or {}))


def _prompts(tok, n: int, length: int) -> list[list[int]]:
    ids = tok.encode(TEXT, add_special_tokens=False)
    step = (len(ids) - length) // n
    return [ids[i * step:i * step + length] for i in range(n)]


def test_logit_margins_and_no_indexer_ties(tiny_checkpoint):
    """On the quantized weights engines run: >= 80 % of positions have a top-1 margin >= 0.5 nat, and the
    indexer's k-th and (k+1)-th scores never tie (every query longer than index_topk is sparse)."""
    from transformers import GlmMoeDsaForCausalLM

    cfg, state = _dequantized_hf_state(tiny_checkpoint)
    cfg._attn_implementation = "eager"
    model = GlmMoeDsaForCausalLM(cfg).eval()
    model.load_state_dict(state, strict=True)
    tok = tokenizer_from_gguf(tiny_checkpoint)
    rec = _TopKRecorder()
    for layer in model.model.layers:
        ix = layer.self_attn.indexer
        ix.register_forward_pre_hook(lambda *_: setattr(rec, "active", True))
        ix.register_forward_hook(lambda *_: setattr(rec, "active", False))
    margins = []
    with torch.no_grad(), rec:
        for ids in _prompts(tok, 4, 64):
            logits = model(torch.tensor([ids])).logits[0]
            top2 = logits.topk(2, dim=-1).values
            margins.append(top2[:, 0] - top2[:, 1])
    margins = torch.cat(margins)
    assert (margins >= 0.5).float().mean() >= 0.8, f"only {(margins >= 0.5).float().mean():.2f} with margin >= 0.5"
    assert len(rec.scores) == 4 * cfg.num_hidden_layers
    sparse_queries = 0
    for scores, k in rec.scores:
        assert k == cfg.index_topk
        s = scores.reshape(-1, scores.shape[-1])
        ordered = s.sort(dim=-1, descending=True).values
        candidates = (ordered > torch.finfo(ordered.dtype).min / 2).sum(-1)  # causal mask adds finfo.min
        rows = candidates > k  # queries that really choose
        sparse_queries += int(rows.sum())
        assert torch.all(ordered[rows, k - 1] > ordered[rows, k]), "tie at the indexer's top-k boundary"
    assert sparse_queries >= 4 * cfg.num_hidden_layers * (64 - cfg.index_topk)


LLAMA_LOGITS = """
import json, sys
import numpy as np
from llama_cpp import Llama
req = json.load(sys.stdin)
llm = Llama(model_path=req["model"], n_ctx=128, n_batch=128, verbose=False, logits_all=True, n_threads=2)
out = []
for ids in req["prompts"]:
    llm.reset()
    llm.eval(ids)
    out.append(np.asarray(llm.scores[:len(ids)], dtype=np.float32).tolist())
print(json.dumps(out))
"""


def _transformers_logits(path, prompts) -> list[np.ndarray]:
    from transformers import GlmMoeDsaForCausalLM

    cfg, state = _dequantized_hf_state(path)
    cfg._attn_implementation = "eager"
    model = GlmMoeDsaForCausalLM(cfg).eval()
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0].numpy() for ids in prompts]


@pytest.mark.parametrize("indexer_types", [None, ["full", "shared", "full"]], ids=["glm5", "glm5.2-shared"])
def test_llama_cpp_agrees_with_transformers_on_f32(indexer_types, tiny_f32_checkpoint, tmp_path, subprocess_json):
    """llama.cpp (its own GGUF loader and glm-dsa graph) and transformers (our HF-named weights) compute the same
    logits, sparse positions included: the layout -- kv_b split, rope, indexer, router -- means what it should."""
    pytest.importorskip("llama_cpp", reason="llama_cpp (the oracle extra) is needed to run llama.cpp")
    path = tiny_f32_checkpoint if indexer_types is None else \
        make_checkpoint(tmp_path, "tiny", "f32", indexer_types=indexer_types)
    if indexer_types:
        m = GGUFModel(path)
        assert "blk.1.indexer.attn_q_b.weight" not in m and "blk.2.indexer.attn_q_b.weight" in m
        assert m.get(".attention.indexer.types") == [True, False, True]
        assert all(c.ok for c in verify(path))
    prompts = _prompts(tokenizer_from_gguf(path), 3, 48)
    got = subprocess_json(LLAMA_LOGITS, {"model": str(path), "prompts": prompts})
    k = PRESETS["tiny"].index_topk
    close = []
    for want, have in zip(_transformers_logits(path, prompts), got):
        err = np.abs(want - np.asarray(have)).max(-1)  # per position; logits are ~10 nats wide
        assert np.all(err[:k] < 0.1)  # dense positions: only rounding (llama.cpp keeps K in f16)
        close.append(err < 0.1)
        # a sparse position may differ: an indexer near-tie (not an exact one) that f16 rounding flips
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0] > 0.2) & (err < 0.1)
        assert np.array_equal(want.argmax(-1)[clear], np.asarray(have).argmax(-1)[clear])
    assert np.concatenate(close).mean() >= 0.95


def test_llama_cpp_reads_one_indexer_type_as_every_layers(tiny_f32_checkpoint, tmp_path, gguf_rewrite,
                                                         subprocess_json):
    """A UINT32 ``attention.indexer.types`` instead of an array: llama.cpp's ``get_key_or_arr`` gives every layer
    that value, so 1 computes the logits of a file without the key (every layer full); glm5serve reads it alike."""
    pytest.importorskip("llama_cpp", reason="llama_cpp (the oracle extra) is needed to run llama.cpp")
    from gguf import GGUFValueType

    full = make_checkpoint(tmp_path / "full", "tiny", "f32", indexer_types=["full"] * 3)
    one = gguf_rewrite(full, tmp_path / "one.gguf",
                       set_keys={"glm-dsa.attention.indexer.types": (1, GGUFValueType.UINT32)})
    assert GGUFModel(one).get(".attention.indexer.types") == 1
    assert config_from_metadata(GGUFModel(one)).indexer_types == ["full"] * 3 and all(c.ok for c in verify(one))
    prompts = _prompts(tokenizer_from_gguf(one), 2, 40)  # past index_topk, so the indexer chooses keys
    got, want = (subprocess_json(LLAMA_LOGITS, {"model": str(p), "prompts": prompts})
                 for p in (one, tiny_f32_checkpoint))
    assert np.array_equal(np.asarray(got), np.asarray(want))


def test_rope_keys_are_refused_exactly_where_llama_cpp_applies_them(tiny_f32_checkpoint, tmp_path, gguf_rewrite,
                                                                    subprocess_json):
    """llama.cpp's logits tell which RoPE keys change the model: ``rope.scaling.type`` ``none`` with a factor of 8
    computes the logits of the plain file (llama_context: "never scale if scaling type is none"), and so does
    ``longrope`` without a factor (a type llama.cpp knows; glm-dsa has no rope_long/rope_short factors), and so does
    the older ``rope.scale_linear`` 2 beside a ``rope.scaling.factor`` of 1 (read only without it), and glm5serve
    accepts them; ``rope.scaling.attn_factor`` 2 or ``rope.scale_linear`` 2 alone change them (the first scales the
    rotated queries and keys, the second the positions), and glm5serve refuses them, naming the key, instead of
    running plain RoPE."""
    pytest.importorskip("llama_cpp", reason="llama_cpp (the oracle extra) is needed to run llama.cpp")
    from gguf import GGUFValueType as T

    none8 = gguf_rewrite(tiny_f32_checkpoint, tmp_path / "none8.gguf", set_keys={
        "glm-dsa.rope.scaling.type": ("none", T.STRING), "glm-dsa.rope.scaling.factor": (8.0, T.FLOAT32)})
    attn2 = gguf_rewrite(tiny_f32_checkpoint, tmp_path / "attn2.gguf",
                         set_keys={"glm-dsa.rope.scaling.attn_factor": (2.0, T.FLOAT32)})
    longrope = gguf_rewrite(tiny_f32_checkpoint, tmp_path / "longrope.gguf",
                            set_keys={"glm-dsa.rope.scaling.type": ("longrope", T.STRING)})
    # the older rope.scale_linear counts only without rope.scaling.factor (load_hparams reads it as a fallback)
    old2 = gguf_rewrite(tiny_f32_checkpoint, tmp_path / "old2.gguf",
                        set_keys={"glm-dsa.rope.scale_linear": (2.0, T.FLOAT32)})
    new1_old2 = gguf_rewrite(old2, tmp_path / "new1_old2.gguf",
                             set_keys={"glm-dsa.rope.scaling.factor": (1.0, T.FLOAT32)})
    assert GGUFModel(none8).get(".rope.scaling.factor") == 8.0
    assert GGUFModel(attn2).get(".rope.scaling.attn_factor") == 2.0
    assert GGUFModel(longrope).get(".rope.scaling.type") == "longrope"
    prompts = _prompts(tokenizer_from_gguf(tiny_f32_checkpoint), 1, 40)
    assert GGUFModel(new1_old2).get(".rope.scale_linear") == 2.0
    plain, got_none8, got_attn2, got_longrope, got_old2, got_new1_old2 = (
        np.asarray(subprocess_json(LLAMA_LOGITS, {"model": str(p), "prompts": prompts}))
        for p in (tiny_f32_checkpoint, none8, attn2, longrope, old2, new1_old2))
    assert np.array_equal(got_none8, plain) and np.abs(got_attn2 - plain).max() > 1.0
    assert np.array_equal(got_longrope, plain) and np.array_equal(got_new1_old2, plain)
    assert np.abs(got_old2 - plain).max() > 1.0
    for accepted in (none8, longrope, new1_old2):
        assert all(c.ok for c in verify(accepted)), accepted.name
    for refused, words in ((attn2, "glm-dsa.rope.scaling.attn_factor=2: llama.cpp scales"),
                           (old2, "glm-dsa.rope.scale_linear=2: RoPE scaling (linear) is not supported")):
        (fail,) = [c for c in verify(refused) if not c.ok]
        assert words in fail.detail, fail.detail


LLAMA_GENERATE = """
import json, sys, time
import numpy as np
from llama_cpp import Llama
req = json.load(sys.stdin)
llm = Llama(model_path=req["model"], n_ctx=128, verbose=False, n_threads=2)
t = time.perf_counter()
out = []
for tok in llm.generate(req["prompt"], temp=0.0):
    out.append(tok)
    if len(out) == req["n"]:
        break
print(json.dumps({"tokens": out, "seconds": time.perf_counter() - t,
                  "finite": bool(np.isfinite(np.asarray(llm.scores[:llm.n_tokens])).all())}))
"""


def test_llama_cpp_generates_from_the_default_checkpoint(tiny_checkpoint, subprocess_json):
    pytest.importorskip("llama_cpp", reason="llama_cpp (the oracle extra) is needed to run llama.cpp")
    tok = tokenizer_from_gguf(tiny_checkpoint)
    prompt = tok.encode("The harbour town woke slowly that morning.", add_special_tokens=False)
    got = subprocess_json(LLAMA_GENERATE, {"model": str(tiny_checkpoint), "prompt": prompt, "n": 32})
    assert len(got["tokens"]) == 32 and all(0 <= t < 512 for t in got["tokens"]) and got["finite"]


@pytest.mark.slow
def test_llama_q4_k_m_mix(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama_cpp (the oracle extra) runs llama_model_quantize")
    path = make_checkpoint(tmp_path, "tiny", "llama-q4_k_m", split=2)
    m = GGUFModel(path)
    assert len(m.paths) == 2 and m.get("general.file_type") == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert {t.qtype for t in m} >= {Q.Q4_K, Q.F32}
    assert all(c.ok for c in verify(path)), [c.line() for c in verify(path) if not c.ok]


def test_default_checkpoint_is_built_once(tmp_path, monkeypatch):
    from glm5serve import cache
    from glm5serve.checkpoint import default_checkpoint

    monkeypatch.setenv("GLM5SERVE_CACHE", str(tmp_path))
    root = tmp_path / "checkpoints"
    old, recent = root / "glm5-tiny-ud-q4_k_xl-x1-0123456789ab", root / "glm5-tiny-ud-q4_k_xl-x1-ba9876543210"
    crashed = root / ".build-xyz"
    for d in (old, recent, crashed):
        d.mkdir(parents=True)
    for d in (old, crashed):
        os.utime(d, (0, 0))
    mask = os.umask(0o022)
    try:
        first = default_checkpoint()
    finally:
        os.umask(mask)
    assert not old.exists() and not crashed.exists() and recent.exists()  # stale builds of older code go
    assert first.parent.stat().st_mode & 0o777 == 0o755  # as mkdir makes it, not mkdtemp's 0700: shareable
    assert first.is_relative_to(tmp_path) and first.name == "glm5-tiny-ud-q4_k_xl.gguf"
    stamp = first.stat().st_mtime_ns
    calls = []
    monkeypatch.setattr("glm5serve.checkpoint.make_checkpoint", lambda *a, **k: calls.append(a))
    assert cache.default_checkpoint() == first and first.stat().st_mtime_ns == stamp and not calls
    assert not list(root.glob(".build-*"))  # no temporary directory left behind



@pytest.mark.parametrize("module", ["checkpoint", "quantize", "tokenizer", "_corpus", "schema", "config"])
def test_an_edit_to_any_module_that_writes_checkpoint_bytes_changes_the_cache_digest(module, monkeypatch):
    """A cached checkpoint is keyed by the code that wrote it: the layout and mixes (checkpoint), the K-quant bytes
    (quantize), the vocabulary (tokenizer, _corpus), the tensor inventory and kv_b split (schema) and the metadata
    read back as a config (config). Editing any of them must give a new digest, or a stale checkpoint is served."""
    import importlib.util
    from pathlib import Path

    from glm5serve.cache import code_digest

    before = code_digest.__wrapped__()
    origin = Path(importlib.util.find_spec(f"glm5serve.{module}").origin)
    read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read(self) + (b"\n# edited\n" if self == origin else b""))
    assert code_digest.__wrapped__() != before


@pytest.mark.parametrize("damage", ["truncate", "grow", "remove", "empty COMPLETE", "garbled COMPLETE",
                                    "no COMPLETE", "COMPLETE a folder"])
def test_a_damaged_cached_checkpoint_is_rebuilt(damage, tmp_path, monkeypatch, capsys):
    """A cached file cut short or removed after its build (COMPLETE records each file's size), or a COMPLETE emptied
    or garbled, is rebuilt with a one-line note, not reported as a broken GGUF (or, for COMPLETE, a traceback:
    fresh-user finding) on every use; an intact one is not touched."""
    from glm5serve.cache import cached_checkpoint

    monkeypatch.setenv("GLM5SERVE_CACHE", str(tmp_path))
    first = cached_checkpoint("tiny", "bf16", split=2)
    shard2 = first.with_name(first.name.replace("00001-of", "00002-of"))
    sizes = {f: f.stat().st_size for f in (first, shard2)}
    assert capsys.readouterr().err == ""
    if damage == "truncate":
        with open(shard2, "r+b") as f:
            f.truncate(sizes[shard2] // 2)
        said = f"{shard2.name} is {sizes[shard2] // 2} bytes, built as {sizes[shard2]}"
    elif damage == "grow":  # written over by something longer (another build's file, an append)
        with open(shard2, "ab") as f:
            f.write(b"\0" * 32)
        said = f"{shard2.name} is {sizes[shard2] + 32} bytes, built as {sizes[shard2]}"
    elif damage == "remove":
        shard2.unlink()
        said = f"{shard2.name} is missing"
    elif damage == "empty COMPLETE":
        (first.parent / "COMPLETE").write_text("")
        said = "COMPLETE records no size for the model file ''"
    elif damage == "garbled COMPLETE":
        (first.parent / "COMPLETE").write_text(f"{first.name}\n{first.name}\n")
        said = f"COMPLETE line {first.name!r} is not 'name size'"
    else:  # every use failed with the build folder's "Directory not empty" (fresh-user finding)
        (first.parent / "COMPLETE").unlink()
        if damage == "COMPLETE a folder":
            (first.parent / "COMPLETE").mkdir()
        said = "no COMPLETE file"
    again = cached_checkpoint("tiny", "bf16", split=2)
    err = capsys.readouterr().err
    assert again == first and {f: f.stat().st_size for f in (first, shard2)} == sizes
    assert err.count("\n") == 1 and f"cached checkpoint {first.parent} is damaged ({said}); rebuilding it" in err
    from glm5serve.gguf_file import GGUFModel

    assert len(GGUFModel(first).tensors) > 0  # the rebuilt set opens as a whole
    stamp = first.stat().st_mtime_ns
    assert cached_checkpoint("tiny", "bf16", split=2) == first and first.stat().st_mtime_ns == stamp
    assert capsys.readouterr().err == ""


def test_a_cache_that_cannot_be_written_is_still_used(tmp_path, monkeypatch):
    """A complete entry in a cache shared read-only (another user's, a read-only mount) failed every command with
    'Permission denied' from touching its timestamp (fresh-user finding)."""
    from glm5serve.cache import cached_checkpoint

    monkeypatch.setenv("GLM5SERVE_CACHE", str(tmp_path))
    first = cached_checkpoint("tiny", "f32")

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("os.utime", refused)
    assert cached_checkpoint("tiny", "f32") == first


@pytest.mark.slow
def test_narrow_preset(narrow_checkpoint, subprocess_json):
    m = GGUFModel(narrow_checkpoint)
    assert narrow_checkpoint.stat().st_size <= 250e6
    cfg = config_from_metadata(m)
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (512, 64, 192, 256)
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (32, 128, 2048)
    for tp in (1, 2, 4, 8):
        results = verify(narrow_checkpoint, tp)
        assert all(c.ok for c in results), [c.line() for c in results if not c.ok]
    pytest.importorskip("llama_cpp", reason="llama_cpp (the oracle extra) is needed to run llama.cpp")
    tok = tokenizer_from_gguf(narrow_checkpoint)
    prompt = tok.encode("The harbour town woke slowly that morning.", add_special_tokens=False)
    got = subprocess_json(LLAMA_GENERATE, {"model": str(narrow_checkpoint), "prompt": prompt, "n": 8})
    assert len(got["tokens"]) == 8 and got["finite"]


@pytest.mark.parametrize("split", [1, 3])
def test_a_failed_write_names_the_file_and_leaves_nothing(split, tmp_path):
    """A full disk (here: a 2 MB file size limit, SIGXFSZ ignored, so write() fails with EFBIG) used to print
    '589824 requested and 304704 written' without a path and leave truncated .gguf files that later read as
    'truncated file'."""
    import resource
    import signal
    import subprocess
    import sys

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2_000_000, 2_000_000))

    out = tmp_path / "ck"
    proc = subprocess.run([sys.executable, "-m", "glm5serve.cli", "make-checkpoint", str(out), "--preset", "tiny",
                           "--mix", "f32", "--split", str(split)], capture_output=True, text=True, preexec_fn=limit,
                          timeout=300)
    last = proc.stderr.strip().splitlines()[-1]  # after the progress bar
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    first = "glm5-tiny-f32.gguf" if split == 1 else "glm5-tiny-f32-00001-of-00003.gguf"
    assert last.startswith(f"glm5serve make-checkpoint: {out / first}: cannot write the "), last
    assert list(out.iterdir()) == []
    # with --force over a checkpoint already there: that one is kept whole (it was deleted: fresh-user finding)
    keep = out / first
    keep.write_bytes(b"the old checkpoint")
    proc = subprocess.run([sys.executable, "-m", "glm5serve.cli", "make-checkpoint", str(out), "--preset", "tiny",
                           "--mix", "f32", "--split", str(split), "--force"], capture_output=True, text=True,
                          preexec_fn=limit, timeout=300)
    assert proc.returncode == 2 and "cannot write the " in proc.stderr, proc.stderr
    assert list(out.iterdir()) == [keep] and keep.read_bytes() == b"the old checkpoint"

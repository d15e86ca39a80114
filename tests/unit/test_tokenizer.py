"""The tokenizer built from ``tokenizer.ggml.*`` metadata: layout, round trips, special ids, and agreement with
llama.cpp's own tokenizer on the same GGUF."""
from __future__ import annotations

import pytest
from gguf import TokenType
from hypothesis import given, strategies as st
from tokenizers import pre_tokenizers

from glm5serve.errors import GGUFModelError
from glm5serve.gguf_file import GGUFModel
from glm5serve.tokenizer import CONTROL_TOKENS, USER_DEFINED_TOKENS, build_vocab, tokenizer_from_gguf

# the converter's pre-tokenizer probe text (convert_hf_to_gguf.py get_vocab_base_pre), plus everyday cases
CHKTXT = ("\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 "
          "333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
          "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, "
          "'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL")
STRINGS = [
    CHKTXT, "Hello, world!", "The harbour town woke slowly that morning.", "  leading spaces", "trailing  ",
    "tabs\tand\nnewlines\n\n", "numbers 1 12 123 1234 12345 3.14159", "I've been 'told' he's there; we'LL see",
    "café naïve résumé", "日本語のテキスト", "emoji 🚀🦙 done", "<|user|>\nhi<|assistant|>\n",
    "[gMASK]<sop><|system|>\nBe brief.<|user|>\nhello", "<think>reasoning</think> answer /nothink",
    "def f(x):\n    return x**2  # square", "   \n \n\n  \t", "a", "MiXeD CaSe WORDS", "----======......!!!!!!??????",
    "<|user|", "<|endoftext|><|endoftext|>", "[PAD500] is not a token",
]


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return tokenizer_from_gguf(tiny_checkpoint)


def test_vocab_layout_is_glm_like_and_deterministic():
    v = build_vocab(4096)
    assert len(v.tokens) == len(v.token_types) == 4096 and len(set(v.tokens)) == 4096
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(v.tokens[:256]) == alphabet  # every byte is a token, so any text encodes
    n_bpe = 256 + len(v.merges)
    assert all(t == TokenType.NORMAL for t in v.token_types[:n_bpe])
    added = v.tokens[n_bpe:n_bpe + len(CONTROL_TOKENS) + len(USER_DEFINED_TOKENS)]
    assert added == [*CONTROL_TOKENS, *USER_DEFINED_TOKENS]
    assert v.token_types[n_bpe:n_bpe + len(CONTROL_TOKENS)] == [TokenType.CONTROL] * len(CONTROL_TOKENS)
    pads = v.tokens[n_bpe + len(added):]
    assert pads == [f"[PAD{i}]" for i in range(4096 - len(pads), 4096)]
    assert all(t == TokenType.UNUSED for t in v.token_types[4096 - len(pads):])
    assert len(pads) < 300  # the corpus fills most of the vocabulary with real merges
    assert {r: v.tokens[i] for r, i in v.special_ids.items()} == {
        "bos": "[gMASK]", "eos": "<|endoftext|>", "eot": "<|user|>", "eom": "<|observation|>",
        "unknown": "<|endoftext|>", "padding": "<|endoftext|>"}
    build_vocab.cache_clear()
    assert build_vocab(4096) == v


def test_special_ids_come_from_the_metadata(tok, tiny_checkpoint):
    md = GGUFModel(tiny_checkpoint).metadata
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tok) == len(tokens) == 512
    assert tok.bos_token_id == md["tokenizer.ggml.bos_token_id"] and tok.bos_token == "[gMASK]"
    assert tok.eos_token_id == md["tokenizer.ggml.eos_token_id"] and tok.eos_token == "<|endoftext|>"
    assert tok.pad_token_id == md["tokenizer.ggml.padding_token_id"]
    assert tok.convert_ids_to_tokens(md["tokenizer.ggml.eot_token_id"]) == "<|user|>"
    for i, t in enumerate(tokens):  # every token keeps its GGUF id
        if md["tokenizer.ggml.token_type"][i] != TokenType.UNUSED:
            assert tok.convert_tokens_to_ids(t) == i
    assert tok.encode("<|user|><think>", add_special_tokens=False) == [tokens.index("<|user|>"),
                                                                      tokens.index("<think>")]
    assert tok.encode("hello", add_special_tokens=True) == tok.encode("hello", add_special_tokens=False)  # no BOS


def test_a_special_id_one_past_the_vocabulary_names_no_token(tiny_checkpoint):
    """Token ids run 0..n-1: a special-token id of n is outside the vocabulary (no such token; verify refuses it
    from the metadata), so the tokenizer has no token in that role rather than failing with an IndexError."""
    md = dict(GGUFModel(tiny_checkpoint).metadata)
    tokens = md["tokenizer.ggml.tokens"]
    md["tokenizer.ggml.eos_token_id"], md["tokenizer.ggml.padding_token_id"] = len(tokens), len(tokens) - 1
    tok = tokenizer_from_gguf(md)
    assert tok.eos_token is None and tok.pad_token == tokens[-1] and tok.bos_token == "[gMASK]"


def test_chat_template_renders_glm_prompt(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "[gMASK]<sop><|user|>\nhi<|assistant|>\n"


@pytest.mark.parametrize("text", STRINGS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@given(st.text(max_size=60))
def test_round_trip_any_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < len(tok) for i in ids)
    assert tok.decode(ids) == text


def test_bad_tokenizer_metadata_is_a_one_line_error(tiny_checkpoint):
    md = dict(GGUFModel(tiny_checkpoint).metadata)
    with pytest.raises(GGUFModelError, match="not 'gpt2'"):
        tokenizer_from_gguf({**md, "tokenizer.ggml.model": "llama"})
    with pytest.raises(GGUFModelError, match="tokenizer.ggml.pre is 'qwen2'"):
        tokenizer_from_gguf({**md, "tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(GGUFModelError, match="missing"):
        tokenizer_from_gguf({k: v for k, v in md.items() if k != "tokenizer.ggml.merges"})
    # one type per token: a short array would leave the last tokens (here a PAD) typed by nothing, silently
    with pytest.raises(GGUFModelError, match="tokens/token_type/merges missing or of different lengths"):
        tokenizer_from_gguf({**md, "tokenizer.ggml.token_type": md["tokenizer.ggml.token_type"][:-1]})


@pytest.mark.parametrize("key,value,words", [
    # a scalar where llama.cpp reads an array: a TypeError traceback (generate) or an unnamed key (verify)
    ("tokenizer.ggml.tokens", 5, "metadata key tokenizer.ggml.tokens is 5, expected an array of strings"),
    ("tokenizer.ggml.token_type", 5, "metadata key tokenizer.ggml.token_type is 5, expected an array of integers"),
    ("tokenizer.ggml.merges", 5, "metadata key tokenizer.ggml.merges is 5, expected an array of strings"),
    # a string array of token types matched no TokenType: every CONTROL token became plain text, silently
    ("tokenizer.ggml.token_type", "strings", "tokenizer.ggml.token_type[0] is '1', expected an array of integers"),
    # integer tokens reached the tokenizers library, whose error was reported as one about the merges
    ("tokenizer.ggml.tokens", "ints", "tokenizer.ggml.tokens[0] is 0, expected an array of strings"),
    # a list (a string array) was a TypeError traceback inside transformers
    ("tokenizer.chat_template", ["a", "b"], "metadata key tokenizer.chat_template is ['a', 'b'], expected a string"),
])
def test_tokenizer_metadata_of_the_wrong_type_names_the_key(key, value, words, tiny_checkpoint):
    md = dict(GGUFModel(tiny_checkpoint).metadata)
    if value == "strings":
        value = [str(int(t)) for t in md[key]]
    elif value == "ints":
        value = list(range(len(md[key])))
    with pytest.raises(GGUFModelError) as e:
        tokenizer_from_gguf({**md, key: value})
    assert words in str(e.value) and "\n" not in str(e.value)


LLAMA_TOKENIZE = """
import json, sys
from llama_cpp import Llama
req = json.load(sys.stdin)
llm = Llama(model_path=req["model"], vocab_only=True, verbose=False)
out = {"special": [], "plain": [], "detok": []}
for s in req["strings"]:
    ids = llm.tokenize(s.encode(), add_bos=False, special=True)
    out["special"].append(ids)
    out["plain"].append(llm.tokenize(s.encode(), add_bos=False, special=False))
    out["detok"].append(llm.detokenize(ids, special=True).decode("utf-8", "replace"))
print(json.dumps(out))
"""


@pytest.mark.parametrize("preset", ["tiny", "narrow_vocab"])
def test_agrees_with_llama_cpp(preset, tiny_checkpoint, tmp_path, subprocess_json):
    pytest.importorskip("llama_cpp", reason="llama_cpp (the oracle extra) is needed to compare with llama.cpp")
    if preset == "tiny":
        path = tiny_checkpoint
    else:  # narrow's 4096-token vocabulary, on the tiny tensors: only the metadata matters here
        path = _with_vocab(tiny_checkpoint, tmp_path / "vocab4096.gguf", 4096)
    tok = tokenizer_from_gguf(path)
    got = subprocess_json(LLAMA_TOKENIZE, {"model": str(path), "strings": STRINGS})
    for s, ids, plain, detok in zip(STRINGS, got["special"], got["plain"], got["detok"]):
        assert tok.encode(s, add_special_tokens=False) == ids, s
        # llama.cpp without special parsing still matches USER_DEFINED tokens, as HF does for non-special ones
        assert tok(s, add_special_tokens=False, split_special_tokens=True)["input_ids"] == plain, s
        assert tok.decode(ids) == detok == s


def _with_vocab(src, dst, vocab_size: int):
    """Copy of ``src`` whose tokenizer arrays are :func:`build_vocab` of another size (tensors unchanged)."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    v = build_vocab(vocab_size)
    r = GGUFReader(src)
    w = GGUFWriter(dst, "glm-dsa")
    replace = {"tokenizer.ggml.tokens": v.tokens, "tokenizer.ggml.token_type": v.token_types,
               "tokenizer.ggml.merges": v.merges, "glm-dsa.vocab_size": vocab_size,
               **{f"tokenizer.ggml.{role}_token_id": i for role, i in v.special_ids.items()}}
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value = replace.get(key, f.contents())
        w.add_key_value(key, value, f.types[0], sub_type=f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # byte shape for block types
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst

"""GLM-5's tokenizer from ``tokenizer.ggml.*`` GGUF metadata alone, and the small BPE vocabulary our checkpoints carry.

GLM-5 ships a GPT-2-style byte-level BPE (``tokenizer.ggml.model = gpt2``) with the ``glm4`` pre-tokenizer. llama.cpp
maps ``glm4`` to ``LLAMA_VOCAB_PRE_TYPE_CHATGLM4`` (``src/llama-vocab.cpp``), whose split regex is the GPT-4
(cl100k) one below -- the same ``Split`` regex as the ``pre_tokenizer`` of GLM's HF ``tokenizer.json``, followed by
``ByteLevel(use_regex=False)``. Token types follow gguf-py ``TokenType``: CONTROL tokens are special tokens (their
text in a prompt becomes the token, as with llama.cpp's ``parse_special`` and vLLM; ``skip_special_tokens`` drops
them on decode), USER_DEFINED tokens are always matched whole, UNUSED tokens (``[PADn]``) are never produced.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from glm5serve.config import ARCH
from glm5serve.errors import GGUFModelError
from glm5serve.gguf_file import _short, metadata_value

#: llama.cpp LLAMA_VOCAB_PRE_TYPE_CHATGLM4 (``(?i:...)`` spelled as ``'[sS]|...`` there)
GLM4_SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                    r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("glm4", "chatglm-bpe")

#: GLM-4.5/GLM-5 added tokens (``tokenizer_config.json``), appended after the BPE vocabulary as GLM does.
CONTROL_TOKENS = (
    "<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>", "<|assistant|>",
    "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>", "<|end_of_video|>",
    "<|begin_of_audio|>", "<|end_of_audio|>", "<|begin_of_transcription|>", "<|end_of_transcription|>",
    "<|code_prefix|>", "<|code_middle|>", "<|code_suffix|>",
)
USER_DEFINED_TOKENS = (
    "/nothink", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
    "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
)
#: special-token roles as the converter's ``_set_vocab_glm`` writes them (``tokenizer.ggml.<role>_token_id``)
SPECIAL_ROLES = {"bos": "[gMASK]", "eos": "<|endoftext|>", "eot": "<|user|>", "eom": "<|observation|>",
                 "unknown": "<|endoftext|>", "padding": "<|endoftext|>"}

#: A compact GLM-4.5/5-style chat template (llama.cpp recognises it as chatglm4 by its ``[gMASK]<sop>`` prefix).
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>{{ '\\n' }}{{ message['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{{ '\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class GGUFVocab:
    """The ``tokenizer.ggml.*`` arrays: ``tokens[i]`` (byte-level text), ``token_types[i]`` (gguf TokenType) and
    the BPE ``merges`` (``"left right"``, in rank order); ``special_ids`` maps role (``bos``...) to token id."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    special_ids: dict[str, int]


def _pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GLM4_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


@lru_cache(maxsize=4)
def build_vocab(vocab_size: int) -> GGUFVocab:
    """Train a byte-level BPE with the GLM-4 pre-tokenizer on the embedded English text (:mod:`glm5serve._corpus`).

    Layout as in GLM's own vocabulary and the converter's ``get_vocab_base``: the 256 byte tokens and the learned
    merges first, then GLM's added tokens (CONTROL, then USER_DEFINED), then ``[PADi]`` UNUSED tokens up to
    ``vocab_size`` (the corpus holds only so many merges). Deterministic: the ``tokenizers`` trainer breaks count
    ties by pair order. Raises ValueError when ``vocab_size`` cannot hold the bytes and added tokens.
    """
    n_added = len(CONTROL_TOKENS) + len(USER_DEFINED_TOKENS)
    if vocab_size < 256 + n_added:
        raise ValueError(f"vocab_size {vocab_size} < 256 byte tokens + {n_added} added tokens")
    from glm5serve._corpus import TEXT

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - n_added, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    # the text in its own, upper, title and lower case, plus every 1-3 digit number (as GLM's vocabulary has)
    lines = [line for t in (TEXT, TEXT.upper(), TEXT.title(), TEXT.lower()) for line in t.splitlines(keepends=True)]
    tok.train_from_iterator(lines + [" ".join(str(i) for i in range(1000))], trainer=trainer)
    bpe = tok.get_vocab()
    tokens = sorted(bpe, key=bpe.__getitem__)
    merges = [" ".join(m) if isinstance(m, (list, tuple)) else m
              for m in json.loads(tok.to_str())["model"]["merges"]]
    types = [TokenType.NORMAL] * len(tokens)
    tokens += [*CONTROL_TOKENS, *USER_DEFINED_TOKENS]
    types += [TokenType.CONTROL] * len(CONTROL_TOKENS) + [TokenType.USER_DEFINED] * len(USER_DEFINED_TOKENS)
    pad = range(len(tokens), vocab_size)
    tokens += [f"[PAD{i}]" for i in pad]
    types += [TokenType.UNUSED] * len(pad)
    ids = {t: i for i, t in enumerate(tokens)}
    return GGUFVocab(tokens, [int(t) for t in types], merges, {r: ids[t] for r, t in SPECIAL_ROLES.items()})


def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_int(v) -> bool:
    """A gguf TokenType: an integer (a bool array or a float one is another GGUF type, as is a string)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def tokenizer_from_gguf(model_or_path) -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer built from the GGUF's ``tokenizer.ggml.*`` metadata alone.

    ``model_or_path`` is a :class:`~glm5serve.gguf_file.GGUFModel`, a path, or a plain metadata dict. Byte-level
    BPE (``ignore_merges=False``, as llama.cpp for ``glm4``), GLM-4 split regex, ByteLevel decoder; CONTROL tokens
    become special added tokens and USER_DEFINED ones plain added tokens, both with their GGUF ids. No BOS/EOS is
    added on encode (llama.cpp adds none for ``glm4``; the chat template writes ``[gMASK]<sop>``).
    Raises GGUFModelError (naming the file) for a model whose ``general.architecture`` is not ``glm-dsa`` (a plain
    dict may omit the key), a non-``gpt2`` model, an unknown pre-tokenizer, missing arrays, a value of the wrong
    type (``tokens``/``merges`` not arrays of strings, ``token_type`` not an array of integers, a
    ``tokenizer.chat_template`` that is not a string), or a merge that is not two tokens of the vocabulary.
    """
    from glm5serve.gguf_file import GGUFModel

    if isinstance(model_or_path, dict):
        md, path = model_or_path, "<metadata>"
    else:
        model = model_or_path if isinstance(model_or_path, GGUFModel) else GGUFModel(model_or_path)
        md, path = model.metadata, str(model.path)
    arch = md.get("general.architecture")
    if arch != ARCH and (arch is not None or not isinstance(model_or_path, dict)):  # a foreign model: say that first
        raise GGUFModelError(f"architecture is {arch!r}, not {ARCH!r}: not a GLM-5 GGUF", file=path)
    kind, pre = md.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.pre")
    if kind != "gpt2":
        raise GGUFModelError(f"tokenizer.ggml.model is {kind!r}, not 'gpt2' (byte-level BPE)", file=path)
    if pre not in PRE_TOKENIZERS:
        raise GGUFModelError(f"tokenizer.ggml.pre is {pre!r}, not one of {PRE_TOKENIZERS}", file=path)
    tokens, types, merges = (md.get(f"tokenizer.ggml.{k}") for k in ("tokens", "token_type", "merges"))
    if tokens is None or types is None or merges is None:
        raise GGUFModelError("tokenizer.ggml.tokens/token_type/merges missing or of different lengths", file=path)
    for key, values, ok, what in (("tokens", tokens, _is_str, "strings"), ("token_type", types, _is_int, "integers"),
                                  ("merges", merges, None, "strings")):
        if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
            raise GGUFModelError(f"metadata key tokenizer.ggml.{key} is {_short(values)}, expected an array of {what}",
                                 file=path)
        if ok is not None and (bad := next((i for i, v in enumerate(values) if not ok(v)), None)) is not None:
            raise GGUFModelError(f"tokenizer.ggml.{key}[{bad}] is {_short(values[bad])}, expected an array of {what}",
                                 file=path)
    if len(tokens) != len(types):
        raise GGUFModelError("tokenizer.ggml.tokens/token_type/merges missing or of different lengths", file=path)
    template = md.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):  # llama.cpp reads it with gguf_get_val_str
        raise GGUFModelError(f"metadata key tokenizer.chat_template is {_short(template)}, expected a string",
                             file=path)

    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFModelError("tokenizer.ggml.tokens holds duplicate tokens", file=path)
    pairs = [tuple(m.split(" ", 1)) if isinstance(m, str) else () for m in merges]
    if (bad := next((i for i, p in enumerate(pairs) if len(p) != 2), None)) is not None:
        raise GGUFModelError(f"tokenizer.ggml.merges[{bad}] is {merges[bad]!r}, not two tokens separated by a space",
                             file=path)
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=False, byte_fallback=False))
    except Exception as e:  # the tokenizers library's words, e.g. "Token 'zz' out of vocabulary"
        raise GGUFModelError(f"tokenizer.ggml.merges: {e}", file=path) from None
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == TokenType.CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == TokenType.USER_DEFINED])

    def special(role: str) -> str | None:
        key = f"tokenizer.ggml.{role}_token_id"
        i = None if md.get(key) is None else metadata_value(key, md[key], int, path)
        return None if i is None or not 0 <= i < len(tokens) else tokens[i]

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=special("bos"), eos_token=special("eos"), unk_token=special("unknown"),
        pad_token=special("padding"), chat_template=template,
        clean_up_tokenization_spaces=False,
    )

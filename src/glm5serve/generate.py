"""``glm5serve generate [MODEL] --prompt TEXT [--max-tokens N] [--logprobs K]``: text from a GLM-5 GGUF with the
reference engine (:mod:`glm5serve.reference`) on the CPU, tokenized with the GGUF's own tokenizer.

With no MODEL the embedded default checkpoint (:func:`glm5serve.cache.default_checkpoint`) is built once and used.
The prompt is echoed, then the continuation streams token by token; generation stops at ``--max-tokens`` or at an
end-of-generation token. ``--logprobs K`` then prints one line per new token:
``[n] ID 'TOKEN' LOGPROB | top-K: ID 'TOKEN' LOGPROB, ...`` (natural log, fp32 logits before any temperature;
TOKEN is the vocabulary string, byte-level BPE spelling).
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def add_parser(subparsers) -> None:
    """Register ``generate`` with the ``glm5serve`` argparse sub-commands."""
    p = subparsers.add_parser("generate", help="generate text with the reference engine (CPU)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="GGUF file or shard 1 of a split set (default: the embedded checkpoint)")
    p.add_argument("--prompt", required=True, help="prompt text (tokenized as is, no chat template)")
    p.add_argument("--max-tokens", type=int, default=32, help="most new tokens (default 32)")
    p.add_argument("--logprobs", type=int, default=0, metavar="K",
                   help="after the text, list each new token's logprob and the top-K alternatives (default 0: "
                        "no list)")
    p.add_argument("--temperature", type=_temperature, default=0.0, help="0 = greedy (default); else sample")
    p.add_argument("--seed", type=_seed, default=0, help="sampling seed, 0..2**32-1 as llama.cpp's (default 0)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="weights and compute dtype (default float32)")
    p.add_argument("--mla", choices=("expanded", "absorbed"), default="expanded",
                   help="MLA form: expanded (kv_b_proj, default) or absorbed into q and o (the same math: results "
                        "equal up to rounding)")
    p.add_argument("--qa-kv-norm-eps", type=_eps, default="1e-6",
                   help='q_a/kv_a RMSNorm eps: 1e-6 (transformers, default) or "rms_norm_eps" (llama.cpp, vLLM)')
    p.set_defaults(func=run)


def _checked(convert, ok, what: str):
    """An argparse type: ``convert(value)`` where that succeeds and ``ok`` accepts it, else an error saying ``what``
    the value must be."""
    def parse(value: str):
        try:
            v = convert(value)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise argparse.ArgumentTypeError(f"{value!r} is not {what}")
        return v
    return parse


_positive = _checked(float, lambda v: math.isfinite(v) and v > 0, "a positive number")
# llama.cpp's seed is a uint32_t, and torch's CPU generator keeps only the low 32 bits: 2**32 + 2 sampled as 2
_seed = _checked(int, lambda v: 0 <= v < 2**32, "an integer in 0..2**32-1")
_temperature = _checked(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")


def _eps(value: str) -> float | str:
    """argparse type: ``rms_norm_eps`` or a positive finite float."""
    if value == "rms_norm_eps":
        return value
    try:
        return _positive(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f'{value!r} is neither a positive number nor "rms_norm_eps"') from None


def run(args: argparse.Namespace) -> int:
    """``glm5serve generate``: stream the reference engine's continuation of ``--prompt`` to stdout. Returns the
    exit status: 0, or 2 after one line on stderr naming the file (bad GGUF, prompt past the context length...)."""
    from glm5serve.config import eog_token_ids
    from glm5serve import verify
    from glm5serve.reference import ReferenceModel
    from glm5serve.tokenizer import tokenizer_from_gguf

    for flag, value, least in (("--max-tokens", args.max_tokens, 1), ("--logprobs", args.logprobs, 0)):
        if value < least:
            print(f"glm5serve generate: {flag} {value} must be >= {least}", file=sys.stderr)
            return 2
    if args.model is None:
        from glm5serve.cache import default_checkpoint

        args.model = str(default_checkpoint())
    # what verify refuses is refused here too (an unknown tensor would otherwise be skipped or mis-assigned)
    gguf = verify.require(args.model, (verify.check_open, verify.check_metadata, verify.check_tensors,
                                       verify.check_types)).model
    tok = tokenizer_from_gguf(gguf)
    model = ReferenceModel.from_gguf(args.model, dtype=DTYPES[args.dtype], mla=args.mla,
                                     qa_kv_norm_eps=args.qa_kv_norm_eps)
    if args.logprobs > model.cfg.vocab_size:
        print(f"glm5serve generate: --logprobs {args.logprobs} exceeds the vocabulary ({model.cfg.vocab_size} tokens)",
              file=sys.stderr)
        return 2
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes that are not UTF-8 on the command line arrive as lone surrogates
        print("glm5serve generate: the prompt is not valid UTF-8", file=sys.stderr)
        return 2
    prompt_ids = tok.encode(args.prompt)
    if not prompt_ids:
        print("glm5serve generate: the prompt encodes to no tokens", file=sys.stderr)
        return 2
    n_ctx = model.cfg.max_position_embeddings
    if len(prompt_ids) + args.max_tokens > n_ctx:  # as vLLM refuses a request past max_model_len
        print(f"glm5serve generate: {args.model}: a prompt of {len(prompt_ids)} tokens + --max-tokens "
              f"{args.max_tokens} exceeds the model's context length of {n_ctx} tokens (glm-dsa.context_length)",
              file=sys.stderr)
        return 2
    stop = set(eog_token_ids(gguf)) | {i for i in (tok.eos_token_id, model.cfg.eos_token_id) if i is not None}
    out = sys.stdout
    out.write(args.prompt)
    out.flush()
    ids: list[int] = []
    steps: list[tuple[int, torch.Tensor]] = []
    shown = ""
    for t, logprobs in model.stream(prompt_ids, args.max_tokens, greedy=args.temperature <= 0,
                                    temperature=max(args.temperature, 1e-6), seed=args.seed, stop_ids=stop):
        ids.append(t)
        if args.logprobs:
            steps.append((t, logprobs))
        # hold back a trailing replacement character: the next token may complete its multi-byte sequence
        text = tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
        if len(text) > len(shown) and text.startswith(shown):
            out.write(text[len(shown):])
            out.flush()
            shown = text
    text = tok.decode(ids, skip_special_tokens=True)  # what is held back at the end is final
    out.write(text[len(shown):] if text.startswith(shown) else "")
    out.write("\n")
    for n, (t, logprobs) in enumerate(steps):  # tokens as vocabulary strings: byte tokens stay readable
        top = torch.topk(logprobs, args.logprobs)
        alts = ", ".join(f"{int(i)} {tok.convert_ids_to_tokens(int(i))!r} {float(v):.4f}"
                         for v, i in zip(top.values, top.indices))
        chosen = f"{t} {tok.convert_ids_to_tokens(t)!r} {float(logprobs[t]):.4f}"
        out.write(f"[{n}] {chosen} | top-{args.logprobs}: {alts}\n")
    return 0

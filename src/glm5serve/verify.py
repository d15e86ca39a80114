"""``glm5serve verify [MODEL] [--tp N]``: the static half of the harness -- is this GGUF a loadable GLM-5?

Checks, in order (each a function ``(ctx) -> list[Check]``; :data:`STATIC_CHECKS`; other layers -- e.g. an engine
run -- extend the list): the files open as one split set; architecture and metadata present and consistent; the
tokenizer builds; every required tensor present exactly once with the right shape, optional ones accepted as
llama.cpp's ``glm-dsa`` loader accepts them, no unknown tensors; every type allowed; TP=N compatible; every tensor
dequantizes to finite values (whole tensors up to :data:`FULL_CHECK_BYTES`, evenly spaced sample rows beyond, so a
430 GB model reads headers plus samples only). Each failing check names file and tensor in one line.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from glm5serve import schema
from glm5serve.config import ARCH, config_from_metadata
from glm5serve.errors import GGUFModelError, one_line
from glm5serve.gguf_file import GGUFModel

FULL_CHECK_BYTES = 16 << 20
SAMPLE_ROWS = 64


@dataclass(frozen=True)
class Check:
    """One verification result: ``name`` of the check, ``ok``, and a one-line ``detail`` (for a failure:
    ``FILE: TENSOR: reason``, as a GGUFModelError prints it)."""

    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        """The check as ``verify`` prints it: ``PASS`` or ``FAIL``, the check's name, what it found."""
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name:<10} {self.detail}"


@dataclass
class Context:
    """What the checks share: the path, the TP size, and what earlier checks established."""

    path: str
    tp: int = 1
    model: GGUFModel | None = None
    cfg: object | None = None
    specs: dict[str, schema.TensorSpec] = field(default_factory=dict)


def _fail(name: str, err: GGUFModelError | str, **where) -> Check:
    return Check(name, False, str(err if isinstance(err, GGUFModelError) else GGUFModelError(err, **where)))


def check_open(ctx: Context) -> list[Check]:
    """All files of the split set present, readable, consistent ``split.*`` keys, no tensor stored twice."""
    try:
        ctx.model = GGUFModel(ctx.path)
    except GGUFModelError as e:
        return [_fail("files", e)]
    m = ctx.model
    n_files = len(m.paths)
    where = f"{n_files} files ({m.paths[0].name} ... {m.paths[-1].name})" if n_files > 1 else m.path.name
    return [Check("files", True, f"{where}: {len(m)} tensors, {sum(t.n_bytes for t in m) / 2**20:.1f} MiB")]


def check_metadata(ctx: Context) -> list[Check]:
    """``general.architecture`` is ``glm-dsa``; every key the loader needs is present, of its type, and the keys
    agree (:func:`glm5serve.config.config_from_metadata` and its :func:`~glm5serve.config.metadata_problems`)."""
    m = ctx.model
    try:
        ctx.cfg = config_from_metadata(m)
    except GGUFModelError as e:
        return [_fail("metadata", e)]
    except (TypeError, ValueError) as e:  # a config transformers rejects (types and consistency: checked above)
        return [_fail("metadata", f"inconsistent metadata: {e}", file=str(m.path))]
    c = ctx.cfg
    gating = "" if m.get(".expert_gating_func") is not None else " (expert_gating_func absent: sigmoid)"
    return [Check("metadata", True,
                  f"{ARCH}: {c.num_hidden_layers} layers + {c.num_nextn_predict_layers} MTP, hidden {c.hidden_size}, "
                  f"{c.num_attention_heads} heads, {c.n_routed_experts} experts top-{c.num_experts_per_tok}, "
                  f"index_topk {c.index_topk}, vocab {c.vocab_size}{gating}")]


#: what vLLM may hand a chat template: string content, or OpenAI-style parts (vLLM detects which one the template
#: reads: vllm/renderers/hf.py ``_detect_content_format``), with or without a system message first
_SYSTEM, _USER, _PARTS = "You are helpful.", "Hi", lambda text: [{"type": "text", "text": text}]
_CONVERSATIONS = (
    [{"role": "user", "content": _USER}],
    [{"role": "user", "content": _PARTS(_USER)}],
    [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _USER}],
    [{"role": "system", "content": _PARTS(_SYSTEM)}, {"role": "user", "content": _PARTS(_USER)}],
)


def _chat_template_error(tok) -> str | None:
    """None when ``tok.chat_template`` renders one of :data:`_CONVERSATIONS` (transformers ``apply_chat_template``,
    as vLLM's chat endpoint calls it); else the first conversation's error, in one line."""
    first = None
    for messages in _CONVERSATIONS:
        try:
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return None
        except ImportError:
            raise
        except Exception as e:  # jinja2's TemplateSyntaxError or UndefinedError, a raise_exception(...)
            first = first or " ".join(f"{type(e).__name__}: {e}".split())
    return first


def check_tokenizer(ctx: Context, chat_template: bool = True) -> list[Check]:
    """The ``tokenizer.ggml.*`` arrays build a working tokenizer (:func:`glm5serve.tokenizer.tokenizer_from_gguf`),
    and (``chat_template``) ``tokenizer.chat_template``, where there is one, renders a user message, alone or after
    a system message, with string or OpenAI-style content, as vLLM's chat endpoint renders it (transformers
    ``apply_chat_template``)."""
    from glm5serve.tokenizer import tokenizer_from_gguf

    try:
        tok = tokenizer_from_gguf(ctx.model)
        ids = tok.encode("Hello, world! 123", add_special_tokens=False)
    except GGUFModelError as e:
        return [_fail("tokenizer", e)]
    except Exception as e:  # malformed merges or tokens: the tokenizers library's own error
        return [_fail("tokenizer", f"tokenizer does not build: {type(e).__name__}: {e}", file=str(ctx.model.path))]
    chat = ""
    if chat_template and tok.chat_template:  # vLLM's chat endpoint renders it per request: a broken one fails all
        try:
            why = _chat_template_error(tok)
        except ImportError:  # no jinja2 (transformers needs it only for chat templates): not checked
            chat = ", chat template not checked (no jinja2)"
        else:
            if why:
                return [_fail("tokenizer", f"tokenizer.chat_template renders no conversation ({why})",
                              file=str(ctx.model.path))]
            chat = ", chat template renders"
    return [Check("tokenizer", True, f"gpt2 BPE, {len(tok)} tokens, {ctx.model.get('tokenizer.ggml.pre')} "
                                     f"pre-tokenizer, 'Hello, world! 123' -> {len(ids)} tokens{chat}")]


def check_tensors(ctx: Context) -> list[Check]:
    """Required tensors present with the right shape; optional ones accepted; nothing unknown. A shape that
    differs only by size-1 dimensions llama.cpp pads with (:meth:`GGUFModel.conform`) is right: ``ctx.model``
    then holds the tensor in the schema's shape, for the checks and loaders after this one."""
    m, specs = ctx.model, schema.expected_tensors(ctx.cfg)
    ctx.specs = {s.gguf_name: s for s in specs}
    for s in specs:
        if s.gguf_name not in m:
            if s.required:
                return [_fail("tensors", "required tensor missing", file=str(m.path), tensor=s.gguf_name)]
            continue
        try:
            m.conform(s.gguf_name, s.shape)  # ne padded with 1s, as llama.cpp accepts it, becomes the schema's shape
        except GGUFModelError as e:
            return [_fail("tensors", e)]
    for t in m:
        if t.name not in ctx.specs:
            return [_fail("tensors", "unknown tensor (not part of a GLM-5 GGUF of this configuration)", file=t.file,
                          tensor=t.name)]
    n_opt = sum(1 for s in specs if not s.required and s.gguf_name in m)
    n_req = sum(1 for s in specs if s.required)
    return [Check("tensors", True, f"{n_req} required present with expected shapes, {n_opt} optional, none unknown")]


def check_types(ctx: Context) -> list[Check]:
    """Every type supported and allowed for its tensor: block size divides the row, 1-D tensors F32,
    no 256-element blocks in ``attn_k_b`` (:meth:`glm5serve.schema.TensorSpec.check_type`)."""
    counts: dict[str, int] = {}
    for t in ctx.model:
        s = ctx.specs.get(t.name)
        reason = s.check_type(t.qtype) if s is not None else None
        if reason:
            return [_fail("types", reason, file=t.file, tensor=t.name)]
        counts[t.qtype.name] = counts.get(t.qtype.name, 0) + 1
    return [Check("types", True, ", ".join(f"{k} x{v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])))]


def tp_problems(cfg, model: GGUFModel, specs: dict[str, schema.TensorSpec], tp: int) -> list[tuple[str, str]]:
    """Why ``model`` cannot be split ``tp`` ways, as (tensor or "", reason) pairs.

    Attention heads and the (shared-)expert and dense intermediate sizes must divide by ``tp``; a column-parallel
    tensor's rows (dim -2) must divide; a row-parallel tensor's row (dim -1) must divide into shards that are whole
    quant blocks, since vLLM slices quantized rows by bytes.
    """
    out: list[tuple[str, str]] = []
    for what, n in (("attention.head_count", cfg.num_attention_heads),
                    ("expert_feed_forward_length", cfg.moe_intermediate_size),
                    ("feed_forward_length", cfg.intermediate_size)):
        if n % tp:
            out.append(("", f"{ARCH}.{what}={n} does not divide by TP={tp}"))
    for t in model:
        s = specs.get(t.name)
        if s is None or s.tp_split is None:
            continue
        block = GGML_QUANT_SIZES[t.qtype][0]
        if s.tp_split == "col" and t.shape[-2] % tp:
            out.append((t.name, f"{t.shape[-2]} output rows do not divide by TP={tp}"))
        if s.tp_split == "row" and (t.shape[-1] % tp or (t.shape[-1] // tp) % block):
            out.append((t.name, f"row of {t.shape[-1]} split {tp} ways is not a whole number of "
                                f"{t.qtype.name} blocks of {block}"))
    return out


def check_tp(ctx: Context) -> list[Check]:
    """TP=N compatibility (:func:`tp_problems`)."""
    problems = tp_problems(ctx.cfg, ctx.model, ctx.specs, ctx.tp)
    if problems:
        tensor, reason = problems[0]
        t = ctx.model.tensors.get(tensor)
        rest = [name or why for name, why in problems[1:]]  # tensors by name, the other problems as said
        more = f" (and {len(rest)} more: {', '.join(rest[:3])}{', ...' if len(rest) > 3 else ''})" if rest else ""
        return [_fail("tp", reason + more, file=t.file if t else str(ctx.model.path), tensor=tensor or None)]
    return [Check("tp", True, f"TP={ctx.tp}: heads, intermediate sizes and row-parallel quant blocks divide")]


def _sample_rows(n_rows: int, n: int = SAMPLE_ROWS) -> np.ndarray:
    return np.unique(np.linspace(0, n_rows - 1, num=min(n, n_rows)).round().astype(np.int64))


def check_finite(ctx: Context) -> list[Check]:
    """Every tensor dequantizes to finite values, and no weight matrix or norm weight to zeros alone
    (:func:`~glm5serve.dequant.zero_refused`: a file whose tail was never downloaded): whole tensors up to
    FULL_CHECK_BYTES, else SAMPLE_ROWS rows. Zero is judged on values, as the reference engine judges the fp32 it
    loads, not on bytes: BF16/F16/F32 -0.0 is zero, and so is a block whose fp16 scales make every value 0 whatever
    its codes (Q4_K ``d * sc * q - dmin * m`` with d = dmin = 0; gguf-py ``gguf/quants.py``); the rows read are
    dequantized for the finite check anyway. Fails for a ``synthetic-gguf`` header: its data section is a hole that
    reads as zeros, not weights."""
    from glm5serve.dequant import dequantize, zero_refused
    from glm5serve.synthetic import LOAD_FORMAT, is_synthetic

    if is_synthetic(ctx.model):
        return [_fail("finite", f"synthetic header without tensor data (serve it with --load-format {LOAD_FORMAT})",
                      file=str(ctx.model.path))]
    sampled = 0
    for t in ctx.model:
        if t.qtype not in schema.SUPPORTED_TYPES:
            continue  # reported by the types check
        rows = t.data.reshape(-1, t.data.shape[-1])
        if t.n_bytes > FULL_CHECK_BYTES:
            idx = _sample_rows(rows.shape[0])
            rows, sampled = rows[idx], sampled + 1
        else:
            idx = None
        rows = np.ascontiguousarray(rows)
        if t.qtype in (Q.F32, Q.F16):  # typed values: -0.0 is zero to any(), as to the reference's t.any()
            bad, nonzero = ~np.isfinite(rows), bool(rows.any())
        elif t.qtype == Q.BF16:  # uint16 words; all-ones exponent: inf or NaN (no need to widen to fp32)
            words = rows.view(np.uint16)
            bad = (words & 0x7F80) == 0x7F80
            nonzero = bool((words & 0x7FFF).any())  # sign bit masked off: -0.0 (0x8000) is zero, as in fp32
        else:  # block types: the rows' values, as the reference reads them (zero scales zero nonzero codes)
            try:
                values = dequantize(rows, t.qtype)
            except GGUFModelError as e:
                return [_fail("finite", e.reason, file=t.file, tensor=t.name)]
            bad, nonzero = (~values.isfinite()).numpy(), bool(values.any())
        if bad.any():
            r, c = (int(x[0]) for x in bad.nonzero())
            row = int(idx[r]) if idx is not None else r
            block = GGML_QUANT_SIZES[t.qtype][0]
            return [_fail("finite", f"non-finite value after dequantization (row {row}, block {c // block})",
                          file=t.file, tensor=t.name)]
        if (why := zero_refused(t.name, t.shape)) and not nonzero:  # every value read is +-0, not just every byte
            what = "every value" if idx is None else f"every value of {len(idx)} sampled rows"
            return [_fail("finite", f"{what} {why}", file=t.file, tensor=t.name)]
    how = (f"{len(ctx.model) - sampled} in full, {sampled} large ones on {SAMPLE_ROWS} sampled rows each"
           if sampled else "all in full")
    return [Check("finite", True, f"{len(ctx.model)} tensors dequantize to finite values, no matrix or norm to zeros "
                  f"({how})")]


STATIC_CHECKS: list[Callable[[Context], list[Check]]] = [
    check_open, check_metadata, check_tokenizer, check_tensors, check_types, check_tp, check_finite]
FATAL = {check_open, check_metadata, check_tensors}


def require(path, checks: tuple[Callable[[Context], list[Check]], ...], tp: int = 1) -> Context:
    """Run ``checks`` in order on the GGUF at ``path`` and return their :class:`Context` (``model``, ``cfg``,
    ``specs`` filled in): the pre-flight of commands that use a file, so they refuse what ``verify`` fails.

    Raises GGUFModelError with the first failed check's one-line detail (``FILE: TENSOR: reason``)."""
    ctx = Context(str(path), tp)
    for check in checks:
        for result in check(ctx):
            if not result.ok:
                raise GGUFModelError(result.detail)
    return ctx


def verify(path, tp: int = 1, checks: list[Callable[[Context], list[Check]]] | None = None) -> list[Check]:
    """Run ``checks`` (default :data:`STATIC_CHECKS`) on the GGUF at ``path`` for tensor-parallel size ``tp``.

    Stops when a check that later ones build on fails (:data:`FATAL`: no tensor table without readable files, no
    expected shapes without metadata, no values without the right tensors), so one defect gives one FAIL line.
    Never raises GGUFModelError: problems are returned as failed :class:`Check` s.
    """
    ctx = Context(str(path), tp)
    results: list[Check] = []
    for check in checks or STATIC_CHECKS:
        out = check(ctx)
        results += out
        if check in FATAL and not all(c.ok for c in out):
            break
    return results


def add_parser(subparsers) -> None:
    """Register ``verify`` with the ``glm5serve`` argparse sub-commands."""
    p = subparsers.add_parser("verify", help="statically verify a GLM-5 GGUF (metadata, tensors, types, TP, values)",
                              description=__doc__.split("\n\n")[0],
                              epilog="exit status: 0 every check passed, 1 a check failed (its FAIL line says "
                                     "which), 2 bad arguments")
    p.add_argument("model", nargs="?", help="GGUF file or shard 1 of a split set (default: the embedded checkpoint)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to check compatibility for (default 1)")
    p.add_argument("--engine", choices=("vllm",), help="then run the model: vLLM eager vs the reference engine, "
                   "CUDA graphs vs eager (needs a GPU and the vllm extra)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Print one line per check and a verdict; 0 when every check passes, 1 otherwise."""
    if args.tp < 1:
        raise GGUFModelError(f"--tp must be at least 1, not {args.tp}")
    if getattr(args, "engine", None) == "vllm":  # before minutes of static checks, not a vLLM traceback after
        from glm5serve.vllm_plugin import require_gpus

        require_gpus(args.tp)
    if args.model is None:
        from glm5serve.cache import default_checkpoint

        args.model = str(default_checkpoint())
    results = verify(args.model, args.tp)
    for c in results:  # printed at once: the engine checks below take minutes
        print(c.line(), flush=True)
    if getattr(args, "engine", None) == "vllm" and all(c.ok for c in results):
        from glm5serve.engine_check import engine_checks

        print("verify: running vLLM eager, the reference engine, then vLLM with CUDA graphs (minutes)",
              file=sys.stderr, flush=True)
        engine = engine_checks(args.model, args.tp, progress=lambda line: print(line, file=sys.stderr, flush=True))
        for c in engine:
            print(c.line(), flush=True)
        results += engine
    failed = [c for c in results if not c.ok]
    print(f"verify: {'FAILED' if failed else 'OK'} ({len(results) - len(failed)}/{len(results)} checks passed, "
          f"TP={args.tp}) {one_line(args.model)}")
    return 1 if failed else 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(run(argparse.Namespace(model=sys.argv[1], tp=1, engine=None)))

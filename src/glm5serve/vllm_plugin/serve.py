"""``glm5serve serve MODEL [vLLM args...]``: print the resolved settings, then start vLLM's OpenAI-compatible server.

A thin wrapper: the arguments after MODEL go to ``python -m vllm.entrypoints.cli.main serve MODEL ...`` (the same as
``vllm serve MODEL ...``, which works too: the ``glm5serve`` vLLM plugin is what makes a GLM-5 GGUF load) unchanged,
but for ``--tp N`` (glm5serve's spelling, given to vLLM as ``--tensor-parallel-size N``) and ``--dry-run`` and ``--``
(taken out). Before handing over it runs ``glm5serve verify --tp``'s metadata, tokenizer, tensor, type and TP checks
(not its finite-values check, which reads every weight), refuses what would fail only once vLLM has started (pipeline or
expert parallelism, a ``--max-model-len`` above the GGUF's context length), reading the options as vLLM does, a
``--config`` file's included, and prints the tensor-parallel size, the max model length, the attention backend
vLLM will pick, the quant types and an estimate of the weight memory per GPU.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys

from gguf import GGMLQuantizationType as Q

from glm5serve.errors import GGUFModelError
from glm5serve.vllm_plugin import check_parallel, require_gpus

FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


def add_parser(subparsers) -> None:
    """Register ``serve`` with the ``glm5serve`` argparse sub-commands."""
    p = subparsers.add_parser("serve", help="serve a GLM-5 GGUF with vLLM's OpenAI-compatible server",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="GGUF file or shard 1 of a split set")
    p.add_argument("--dry-run", action="store_true", help="print the settings and the vLLM command, start nothing")
    # argparse marks every REMAINDER positional required, so a missing MODEL was reported as "model, vllm_args"
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="passed to `vllm serve` unchanged, but --tp N as "
                   "--tensor-parallel-size N").required = False
    p.set_defaults(func=run)


_TP_ALIAS = re.compile(r"^--tp(?==|$)")


def _vllm_spelling(arg: str) -> str:
    """``arg`` as vLLM's ``FlexibleArgumentParser`` reads it: in a ``--name`` (before any ``=`` or ``.``) underscores
    are dashes (vllm/utils/argparse_utils.py, ``parse_args``)."""
    if not arg.startswith("--"):
        return arg
    key, eq, value = arg.partition("=")
    head, dot, tail = key[2:].partition(".")
    return f"--{head.replace('_', '-')}{dot}{tail}{eq}{value}"


def option(args: list[str], *names: str, default=None):
    """The value of a vLLM command-line option (``--name V`` or ``--name=V``, underscores for dashes as vLLM allows;
    the last one wins).

    Raises GGUFModelError for ``--name`` as the last argument or followed by another option (no value), and for an
    abbreviation of a ``--name`` (argparse would take ``--tensor-parallel 3``; glm5serve checks the value first)."""
    value = default
    for i, arg in enumerate(args):
        a = _vllm_spelling(arg)
        key = a.partition("=")[0]
        for n in names:
            if a == n:
                if i + 1 == len(args) or (args[i + 1].startswith("-") and not args[i + 1][1:2].isdigit()):
                    raise GGUFModelError(f"{n} needs a value")
                value = args[i + 1]
            elif a.startswith(n + "="):
                value = a[len(n) + 1:]
            elif n.startswith("--") and len(key) > 2 and key != n and n.startswith(key):
                raise GGUFModelError(f"{arg.partition('=')[0]}: write {n} in full (glm5serve checks it before vLLM)")
    return value


def flag(args: list[str], name: str, *aliases: str) -> bool:
    """Whether a vLLM on/off option is on: the last of ``--name`` (or an alias such as ``-ep``) and its negations
    ``--no-name`` and, for ``--enable-X``, ``--disable-X`` wins (vLLM's ``EnableDisableAction``), off when none is
    given; underscores for dashes as vLLM allows.

    Raises GGUFModelError for an abbreviation of ``--name`` or a negation (argparse would take ``--enable-expert``;
    glm5serve checks the flag first)."""
    off = ("--no-" + name[2:], *(["--disable-" + name[9:]] if name.startswith("--enable-") else []))
    on = False
    for arg in args:
        a = _vllm_spelling(arg)
        if a in (name, *aliases, *off):
            on = a not in off
        elif a.startswith("--") and len(a) > 2 and any(n.startswith(a) for n in (name, *off)):
            raise GGUFModelError(f"{arg}: write {name} in full (glm5serve checks it before vLLM)")
    return on


def size_option(args: list[str], name: str, alias: str, file: str | None = None) -> int:
    """A vLLM parallel size (``--name N`` or ``alias N``, as :func:`option` reads it), 1 when not given. Raises
    GGUFModelError (naming ``file``, where the value came from) for a value that is not an integer >= 1."""
    text = option(args, name, alias, default="1")
    try:
        n = int(text)
    except ValueError:
        raise GGUFModelError(f"{name} must be an integer, not {text!r}", file=file) from None
    if n < 1:  # 0 would divide by zero in the checks, a negative size print negative memory
        raise GGUFModelError(f"{name} must be >= 1, not {n}", file=file)
    return n


#: vLLM's ``human_readable_int`` suffixes: lower case decimal, upper case binary
_SCALE = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def max_model_len_option(args: list[str], file: str | None = None) -> int | None:
    """``--max-model-len`` in tokens as vLLM reads it (``human_readable_int_or_auto``: ``4096``, ``4k`` = 4000,
    ``4K`` = 4096; ``-1`` or ``auto``, returned as -1: what fits in GPU memory), None when not given. Raises
    GGUFModelError (naming ``file``, where the value came from) for another value."""
    text = option(args, "--max-model-len")
    if text is None:
        return None
    t = text.strip()
    if t == "-1" or t.lower() == "auto":
        return -1
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", t)
    try:  # int() refuses a decimal before a binary suffix, as vLLM does
        n = (int(float(m[1]) * _SCALE[m[2]]) if m[2].islower() else int(m[1]) * _SCALE[m[2]]) if m else int(t)
    except ValueError:
        n = 0  # not a length: refused below
    if n < 1:
        raise GGUFModelError(f"--max-model-len must be a number of tokens (4096, 4k, 4K) or auto, not {text!r}",
                             file=file)
    return n


#: the options and flags ``serve`` reads (an abbreviation of one is refused: :func:`option`, :func:`flag`)
_READ_OPTIONS = ("--tensor-parallel-size", "--pipeline-parallel-size", "--max-model-len", "--tokenizer",
                 "--load-format", "--chat-template", "--attention-backend")
_READ_FLAGS = ("--enable-expert-parallel", "--skip-tokenizer-init")


def with_config_file(args: list[str]) -> tuple[list[str], str | None]:
    """``args`` (what follows MODEL) as vLLM reads them, with the options of a ``--config FILE``, and FILE (None
    without one).

    vLLM 0.33's ``FlexibleArgumentParser`` (``_pull_args_from_config``, ``load_config_file``) reads a YAML mapping
    from FILE and puts its keys, as options, right after MODEL: ``key: value`` -> ``--key value``, ``true`` ->
    ``--key``, ``false`` -> ``--no-key``, a list -> ``--key item ...``, a mapping -> ``--key JSON``; the command
    line's options come after them, so one given there wins. Raises GGUFModelError naming FILE
    for one vLLM fails on (not ``.yaml``/``.yml``, unreadable, not a YAML mapping, a key ``tp``: glm5serve's
    command-line spelling, which vLLM does not know), for a key that abbreviates an option glm5serve reads (as on
    the command line: :func:`option`), for ``--config`` twice or without a value, and for
    ``--config=FILE``, which vLLM takes but never reads."""
    import json

    import yaml  # a vLLM (and transformers) dependency

    if any(_vllm_spelling(a).startswith("--config=") for a in args):
        raise GGUFModelError("write --config FILE, not --config=FILE: vLLM reads the file only in that spelling")
    path = option(args, "--config")
    if path is None:
        return args, None
    if args.count("--config") > 1:
        raise GGUFModelError("--config given twice: vLLM reads one config file")
    if path.rpartition(".")[2] not in ("yaml", "yml"):
        raise GGUFModelError("--config must name a .yaml or .yml file (vLLM reads no other)", file=path)
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise GGUFModelError(f"--config: cannot read it: {e.strerror}", file=path) from None
    except yaml.YAMLError as e:
        raise GGUFModelError(f"--config: not valid YAML: {e}", file=path) from None
    if not isinstance(config, dict):
        raise GGUFModelError("--config: not a YAML mapping of vLLM options (key: value lines)", file=path)
    front: list[str] = []
    for key, value in config.items():
        if key == "tp":  # the command line's --tp is rewritten for vLLM; a file goes to vLLM as it is
            raise GGUFModelError("--config: vLLM has no option tp (it stops on 'unrecognized arguments: --tp'); "
                                 "write tensor-parallel-size (--tp is glm5serve's command-line spelling)", file=path)
        if isinstance(value, bool):
            front.append(f"--{key}" if value else f"--no-{key}")
        elif isinstance(value, list):
            front += [f"--{key}", *map(str, value)] if value else []
        else:
            front += [f"--{key}", json.dumps(value) if isinstance(value, dict) else str(value)]
    try:  # an abbreviated key is refused where it is read, by then merged in: name its file here
        for name in _READ_OPTIONS:
            option(front, name)
        for name in _READ_FLAGS:
            flag(front, name)
    except GGUFModelError as e:
        raise GGUFModelError(f"--config: {e.reason}", file=path) from None
    i = args.index("--config")
    return front + args[:i] + args[i + 2:], path


def attention_backend(index_topk: int, requested: str | None, capability: tuple[int, int] | None) -> str:
    """The sparse MLA backend vLLM will use for GLM-5 (docs/vllm-integration.md: GLM-5 can only use sparse MLA).

    ``requested`` is ``--attention-backend``; ``capability`` the CUDA compute capability (None: no GPU visible).
    """
    if requested:
        return f"{requested} (--attention-backend)"
    if capability is None:
        return "none: no CUDA GPU visible (vLLM cannot run GLM-5's sparse attention on a CPU)"
    major = capability[0]
    if major == 9:
        return "FLASH_ATTN_MLA_SPARSE or FLASHMLA_SPARSE (SM90; vLLM picks)"
    if major == 10:
        return "FLASHMLA_SPARSE or FLASHINFER_MLA_SPARSE (SM100; vLLM picks)"
    custom = "CUSTOM (glm5serve's Triton MLA, chosen automatically; vLLM's DSA indexer must still run on this GPU)"
    if major == 12 and index_topk == 2048:
        return "FLASHINFER_MLA_SPARSE_SM120 (SM120)"
    return custom if major >= 8 else f"none for SM{major}{capability[1]} (Triton MLA needs SM80 or newer)"


def weight_bytes_per_gpu(model, cfg, tp: int, dtype_bytes: int = 2) -> int:
    """Estimated bytes of weights one GPU holds at TP=``tp`` (MTP block excluded).

    Quantized tensors keep their GGUF bytes; what glm5serve hands over dense takes ``dtype_bytes`` per element
    (``kv_b_proj`` re-fused from ``attn_k_b``/``attn_v_b``, the indexer's ``wk``/``weights_proj``, the router and
    F32/F16/BF16 matrices). Column/row-parallel tensors and the vocabulary are split ``tp`` ways; the rest is
    replicated (``q_a``, ``kv_a_mqa``, the indexer). Norms and biases count at their stored size.
    """
    from glm5serve.schema import expected_tensors

    total = 0
    for spec in expected_tensors(cfg):
        if spec.kind == "mtp" or spec.gguf_name not in model:
            continue
        t = model[spec.gguf_name]
        name = spec.gguf_name
        split = spec.tp_split is not None or name in ("token_embd.weight", "output.weight") or spec.hf_part in (
            "k_b", "v_b")
        dense = (len(t.shape) > 1 and (t.qtype in FLOAT_TYPES or spec.hf_part in ("k_b", "v_b")
                                       or ".indexer.attn_k." in name or ".indexer.proj." in name))
        size = t.n_elements * dtype_bytes if dense else t.n_bytes
        total += size // tp if split else size
    return total


def kernel_settings() -> str:
    """The GGUF decode kernels vLLM will run, from ``$GLM5SERVE_GGUF_KERNELS``, ``$GLM5SERVE_PDL`` and
    ``$GLM5SERVE_SPLIT_Q6_K``, as one phrase. Raises GGUFModelError (one line naming the variable) for a value
    those do not take, so that a typo is refused before vLLM starts instead of silently keeping the default."""
    from glm5serve.kernels.gguf_gemv import pdl_mode
    from glm5serve.kernels.gguf_split import split_q6_k
    from glm5serve.vllm_plugin import gguf_kernels

    try:
        if gguf_kernels() == "plugin":
            return "vllm-gguf-plugin's ($GLM5SERVE_GGUF_KERNELS=plugin)"
        pdl = pdl_mode()
        q6_k_split = split_q6_k()
    except ValueError as e:
        raise GGUFModelError(str(e)) from None
    return (f"glm5serve's Triton kernels (PDL {pdl} on sm_90+; Q4_0/Q5_0/Q8_0{'/Q6_K' if q6_k_split else ''} "
            "linear weights as split rows)")


def preflight(path, tp: int, load_format: str = "auto", chat_template: bool = True, tokenizer: bool = True,
              max_model_len: int | None = None):
    """The checks ``serve`` and ``bench`` make before vLLM starts: ``glm5serve verify --tp``'s open, metadata,
    tokenizer (if ``tokenizer``; with the GGUF's chat template if ``chat_template`` too), tensor, type and TP checks
    (not the finite-values check: it reads every weight), that the data fits ``load_format``
    (:func:`glm5serve.synthetic.check_load_format`) and that ``max_model_len`` (tokens; None or -1: vLLM's choice)
    is at most the GGUF's ``context_length``, as vLLM requires unless ``$VLLM_ALLOW_LONG_MAX_MODEL_LEN`` is 1 or
    true. Returns ``(GGUFModel, config)``; raises GGUFModelError with verify's message, or naming both lengths."""
    from glm5serve import verify
    from glm5serve.synthetic import check_load_format

    def check_tokenizer(ctx):
        return verify.check_tokenizer(ctx, chat_template)

    ctx = verify.require(path, (verify.check_open, verify.check_metadata, *([check_tokenizer] if tokenizer else []),
                                verify.check_tensors, verify.check_types, verify.check_tp), tp)
    check_load_format(ctx.model, load_format)
    context = ctx.cfg.max_position_embeddings
    allow_long = os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0").strip().lower() in ("1", "true")  # vLLM's test
    if max_model_len is not None and max_model_len > context and not allow_long:
        raise GGUFModelError(f"--max-model-len {max_model_len} is above the GGUF's context_length {context} (vLLM's "
                             "max_position_embeddings; vLLM refuses it unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)",
                             file=str(path))
    return ctx.model, ctx.cfg


def settings(path, tp: int, vllm_args: list[str]) -> list[tuple[str, str]]:
    """(label, value) lines describing how vLLM will serve ``path`` at TP=``tp``.

    Raises GGUFModelError for a file that ``glm5serve verify --tp``'s open, metadata, tokenizer, tensor, type or TP
    check rejects (with verify's message; the finite-values check is not run: it reads every weight; vLLM builds its
    tokenizer from the GGUF), or whose data does not fit
    ``--load-format`` (:func:`glm5serve.synthetic.check_load_format`), for a ``--max-model-len`` that is not a
    length or is above the GGUF's context length (:func:`max_model_len_option`, :func:`preflight`), and for a bad
    kernel setting (:func:`kernel_settings`).
    """
    kernels = kernel_settings()
    # vLLM's --tokenizer brings its own tokenizer and template (--skip-tokenizer-init uses none), --chat-template its
    # own template: the file's are then never built or rendered
    own_tokenizer = option(vllm_args, "--tokenizer") is not None or flag(vllm_args, "--skip-tokenizer-init")
    max_len = max_model_len_option(vllm_args)
    model, cfg = preflight(path, tp, option(vllm_args, "--load-format", default="auto"), tokenizer=not own_tokenizer,
                           chat_template=not own_tokenizer and option(vllm_args, "--chat-template") is None,
                           max_model_len=max_len)
    context = cfg.max_position_embeddings
    types: dict[str, int] = {}
    for t in model:
        types[t.qtype.name] = types.get(t.qtype.name, 0) + t.n_bytes
    capability = None
    try:
        import torch

        if torch.cuda.is_available():
            capability = torch.cuda.get_device_capability()
    except Exception:  # a broken CUDA setup: report no GPU, vLLM will say more
        pass
    files = f"{len(model.paths)} files" if len(model.paths) > 1 else "1 file"
    return [
        ("model", f"{path} ({files}, {_size(sum(t.n_bytes for t in model))})"),
        ("architecture", f"glm-dsa: {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
                         f"{cfg.n_routed_experts} experts top-{cfg.num_experts_per_tok}, index_topk {cfg.index_topk}"),
        ("tensor parallel", f"{tp} (checked: heads, intermediate sizes and quant blocks divide)"),
        ("max model len", f"{context} (the GGUF's context_length; --max-model-len to lower it)" if max_len is None
         else f"auto (what fits in GPU memory, at most the GGUF's context_length {context})" if max_len == -1
         else f"{max_len} (--max-model-len; the GGUF's context_length is {context})"),
        ("attention backend", attention_backend(cfg.index_topk, option(vllm_args, "--attention-backend"),
                                                capability)),
        ("GGUF kernels", kernels),
        ("quant types", ", ".join(f"{k} {_size(v)}" for k, v in sorted(types.items(), key=lambda kv: -kv[1]))),
        ("weights per GPU", f"~{_size(weight_bytes_per_gpu(model, cfg, tp))} (the MTP block, which vLLM loads only "
                            "for speculative decoding, not counted; KV cache and activations come on top: "
                            "--gpu-memory-utilization)"),
    ]


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def vllm_command(path, vllm_args: list[str]) -> list[str]:
    """The command that starts vLLM's OpenAI server (console scripts may be missing: the GPU host has none)."""
    return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(path), *vllm_args]


def run(args: argparse.Namespace) -> int:
    """Print the settings, then replace this process with vLLM's server (``--dry-run``: print the command).

    The options are read as vLLM reads them, a ``--config`` file's included (:func:`with_config_file`). Raises
    GGUFModelError, before anything starts, for what :func:`settings` or :func:`with_config_file` refuses, a
    parallel size that is not an integer >= 1, pipeline or expert parallelism
    (:func:`~glm5serve.vllm_plugin.check_parallel`) and too few GPUs."""
    dry_run = args.dry_run or "--dry-run" in args.vllm_args  # after MODEL, argparse leaves it to vLLM's args
    # glm5serve's own commands spell it --tp; vLLM refuses that spelling ("unrecognized arguments")
    vllm_args = [_TP_ALIAS.sub("--tensor-parallel-size", a) for a in args.vllm_args if a not in ("--", "--dry-run")]
    view, config = with_config_file(vllm_args)  # what vLLM reads: vllm_args still go to vLLM as they are

    def source(*names: str) -> str | None:  # the --config file, where it and not the command line gives `names`
        return None if any(_vllm_spelling(a).partition("=")[0] in names for a in vllm_args) else config

    tp = size_option(view, "--tensor-parallel-size", "-tp", source("--tensor-parallel-size", "-tp"))
    pp = size_option(view, "--pipeline-parallel-size", "-pp", source("--pipeline-parallel-size", "-pp"))
    # the loader refuses these only once vLLM has taken the GPUs (data parallelism it takes: not refused here)
    check_parallel(pp, flag(view, "--enable-expert-parallel", "-ep"), file=source(
        "--pipeline-parallel-size", "-pp", "--enable-expert-parallel", "-ep", "--disable-expert-parallel",
        "--no-enable-expert-parallel") or str(args.model))
    max_model_len_option(view, source("--max-model-len"))  # settings reads it again; a bad one names its file here
    for label, value in settings(args.model, tp, view):
        print(f"{label:>18}: {value}")
    cmd = vllm_command(args.model, vllm_args)
    print(f"{'vLLM':>18}: {shlex.join(cmd)}", flush=True)  # quoted: a path with spaces pastes into a shell
    if dry_run:
        return 0
    require_gpus(tp)
    os.execv(cmd[0], cmd)
    return 1  # pragma: no cover (execv does not return)

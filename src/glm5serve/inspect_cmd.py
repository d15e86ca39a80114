"""``glm5serve inspect [MODEL] [--json]``: every tensor of a GGUF model (name, type, shape, bytes) and a summary.

Reads headers only. The summary counts parameters (elements), bytes per ggml type, layers (main and MTP) and
experts from the ``glm-dsa.*`` metadata when present (any architecture is listed). With no MODEL, the embedded
default checkpoint (:func:`glm5serve.cache.default_checkpoint`) is inspected.
"""
from __future__ import annotations

import argparse
import json
import sys

from glm5serve.errors import GGUFModelError
from glm5serve.gguf_file import _short, metadata_value
from glm5serve.gguf_file import GGUFModel


def summarize(model: GGUFModel) -> dict:
    """Summary of ``model``: ``files``, ``architecture``, ``tensors``, ``parameters``, ``bytes``,
    ``bytes_per_type`` and ``tensors_per_type`` (ggml type name -> count), ``layers``, ``mtp_layers``,
    ``experts``, ``experts_used``, ``shared_experts`` (None where the metadata lacks them)."""
    by_type: dict[str, int] = {}
    n_by_type: dict[str, int] = {}
    for t in model:
        by_type[t.qtype.name] = by_type.get(t.qtype.name, 0) + t.n_bytes
        n_by_type[t.qtype.name] = n_by_type.get(t.qtype.name, 0) + 1
    arch = model.metadata.get("general.architecture")
    if arch is not None and not isinstance(arch, str):  # a NaN one made --json print NaN, which is not JSON
        raise GGUFModelError(f"metadata key general.architecture is {_short(arch)}, expected a string",
                             file=str(model.path))

    def key(k: str):  # a value of the wrong type: GGUFModelError naming the key and the type expected
        v = model.metadata.get(f"{arch}.{k}")
        return None if v is None else metadata_value(f"{arch}.{k}", v, int, str(model.path))

    blocks, mtp = key("block_count"), key("nextn_predict_layers") or 0
    if blocks is not None and not 0 <= mtp <= blocks:  # a negative layer count in the summary (fresh-user finding)
        raise GGUFModelError(f"{arch}.block_count={blocks} with nextn_predict_layers={mtp} leaves {blocks - mtp} "
                             "main layers", file=str(model.path))
    return {
        "files": [str(p) for p in model.paths],
        "architecture": arch,
        "tensors": len(model),
        "parameters": sum(t.n_elements for t in model),
        "bytes": sum(t.n_bytes for t in model),
        "bytes_per_type": dict(sorted(by_type.items(), key=lambda kv: -kv[1])),
        "tensors_per_type": n_by_type,
        "layers": None if blocks is None else blocks - mtp,
        "mtp_layers": mtp,
        "experts": key("expert_count"),
        "experts_used": key("expert_used_count"),
        "shared_experts": key("expert_shared_count"),
    }


def tensor_rows(model: GGUFModel) -> list[dict]:
    """One dict per tensor in file order: ``name``, ``type``, ``shape`` (numpy order), ``bytes``, ``file``."""
    return [{"name": t.name, "type": t.qtype.name, "shape": list(t.shape), "bytes": t.n_bytes,
             "file": t.file} for t in model]


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def print_table(model: GGUFModel, file=None) -> None:
    """Rich tables: every tensor, then the summary."""
    from rich.console import Console
    from rich.table import Table

    s = summarize(model)  # first: a bad metadata value is one error line, not a table and then an error
    console = Console(file=file or sys.stdout, width=120)
    multi = len(model.paths) > 1
    table = Table(title=f"{model.path.name}: {len(model)} tensors", show_lines=False)
    # numpy order (outermost first), as gguf-py's ReaderTensor.data is shaped; llama.cpp's ne lists it reversed
    for col, justify in (("name", "left"), ("type", "left"), ("shape (numpy order)", "right"), ("bytes", "right")):
        table.add_column(col, justify=justify)
    if multi:
        table.add_column("file", justify="right")
    for t in model:
        row = [t.name, t.qtype.name, " x ".join(map(str, t.shape)), _size(t.n_bytes)]
        if multi:
            row.append(str(model.paths.index(type(model.path)(t.file)) + 1))
        table.add_row(*row)
    console.print(table)

    summary = Table(title="summary", show_header=False)
    summary.add_column("key")
    summary.add_column("value", justify="right")
    summary.add_row("architecture", str(s["architecture"]))
    summary.add_row("files", str(len(s["files"])))
    summary.add_row("tensors", str(s["tensors"]))
    summary.add_row("parameters", f"{s['parameters']:,}")
    summary.add_row("size", _size(s["bytes"]))
    for name, n in s["bytes_per_type"].items():
        count = s["tensors_per_type"][name]
        summary.add_row(f"  {name}", f"{_size(n)} in {count} tensor{'s' if count != 1 else ''}")
    if s["layers"] is not None:
        summary.add_row("layers", f"{s['layers']} + {s['mtp_layers']} MTP")
    if s["experts"] is not None:
        summary.add_row("experts", f"{s['experts']} routed (top-{s['experts_used']}) + {s['shared_experts']} shared")
    console.print(summary)


def add_parser(subparsers) -> None:
    """Register ``inspect`` with the ``glm5serve`` argparse sub-commands."""
    p = subparsers.add_parser("inspect", help="list every tensor of a GGUF model and summarize it",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help="GGUF file or shard 1 of a split set (default: the embedded checkpoint)")
    p.add_argument("--json", action="store_true", help="print JSON ({summary, tensors}) instead of tables")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``glm5serve inspect``: print every tensor and the summary of ``args.model`` (tables, or JSON with ``--json``);
    returns 0. Bad input raises GGUFModelError, which :func:`glm5serve.cli.main` prints as one line."""
    if args.model is None:
        from glm5serve.cache import default_checkpoint

        args.model = str(default_checkpoint())
    model = GGUFModel(args.model)
    if args.json:
        json.dump({"summary": summarize(model), "tensors": tensor_rows(model)}, sys.stdout, indent=1)
        print()
    else:
        print_table(model)
    return 0

"""Checkpoints built once into the user cache (``$GLM5SERVE_CACHE`` or ``~/.cache/glm5serve``), the embedded default.

A cached checkpoint lives in a directory named after its arguments and a digest of the code that writes it
(checkpoint, tokenizer, corpus, schema, config and quantizer modules, gguf-py's version), so a change to any of them
builds a fresh one (stale ones are deleted after a day unused). Building happens in a temporary directory renamed
into place, so concurrent builders (parallel test sessions) never see a half-written file. Each entry records its
files' sizes; one cut short or removed later is rebuilt on its next use.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import gguf

STALE_AFTER_S = 24 * 3600
_SOURCES = ("checkpoint", "tokenizer", "_corpus", "schema", "config", "quantize")


def cache_dir() -> Path:
    """``$GLM5SERVE_CACHE`` if set, else ``~/.cache/glm5serve`` (created on demand by the builders)."""
    return Path(os.environ.get("GLM5SERVE_CACHE") or Path.home() / ".cache" / "glm5serve")


def shareable(path: Path) -> None:
    """Give a directory made by ``tempfile.mkdtemp`` (mode 0700) the mode ``mkdir`` would give it (0777 less the
    umask) before it is renamed into the cache, so a ``$GLM5SERVE_CACHE`` shared between users stays readable."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o777 & ~mask)


@lru_cache(maxsize=None)
def code_digest(sources: tuple[str, ...] = _SOURCES) -> str:
    """12 hex digits identifying the code that writes a cached artefact: gguf-py's version and the source of the
    ``glm5serve.<name>`` modules in ``sources`` (default: those that write checkpoints, see module docstring)."""
    h = hashlib.sha256(getattr(gguf, "__version__", "").encode())
    for name in sources:
        spec = importlib.util.find_spec(f"glm5serve.{name}")
        if spec is not None and spec.origin:
            h.update(name.encode() + Path(spec.origin).read_bytes())
    return h.hexdigest()[:12]


def cached_checkpoint(preset: str = "tiny", mix: str = "ud-q4_k_xl", split: int = 1, seed: int = 0, *,
                      progress: bool = False, **options) -> Path:
    """:func:`glm5serve.checkpoint.make_checkpoint` into the cache, built on first use; returns the model path.

    ``options`` (``indexer_types``, ``mtp_shared_tensors``) are passed on and become part of the directory name.
    """
    from glm5serve.checkpoint import checkpoint_name, make_checkpoint

    extra = "".join(f"-{k}={'+'.join(v) if isinstance(v, (list, tuple)) else v}" for k, v in sorted(options.items()))
    stem = f"{checkpoint_name(preset, mix, seed)}-x{split}{extra}-"
    target = cache_dir() / "checkpoints" / f"{stem}{code_digest()}"
    done = target / "COMPLETE"
    # an entry only ever appears whole (renamed into place with COMPLETE inside): one without is damaged too
    if os.path.lexists(target) and (damage := _damage(target)):
        print(f"glm5serve: cached checkpoint {target} is damaged ({damage}); rebuilding it", file=sys.stderr)
        aside = target.parent / f".build-damaged-{os.getpid()}-{time.time_ns()}"
        try:
            os.replace(target, aside)  # atomic: concurrent users see the old entry or none
        except OSError:
            pass  # another process moved it first
        shutil.rmtree(aside, ignore_errors=True)
    if done.is_file():
        try:
            os.utime(target)  # in use: not stale
        except OSError:  # a cache shared read-only (another user's, a read-only mount) is still usable
            pass
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
        try:
            path = make_checkpoint(tmp, preset, mix, split, seed, progress=progress, **options)
            sizes = "".join(f"{f.name} {f.stat().st_size}\n" for f in sorted(tmp.iterdir()) if f.is_file())
            (tmp / "COMPLETE").write_text(path.name + "\n" + sizes)
            shareable(tmp)
            try:
                os.replace(tmp, target)  # atomic; fails if another builder got there first
            except OSError:
                if not done.is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        # the same checkpoint written by older code, or a crashed build, unused for a day
        for stale in [*target.parent.glob(f"{stem}*"), *target.parent.glob(".build-*")]:
            older_code = re.fullmatch(r"[0-9a-f]{12}", stale.name[len(stem):]) and stale != target
            try:
                unused_s = time.time() - stale.stat().st_mtime
            except OSError:  # another builder's temporary folder, gone since the glob
                continue
            if (older_code or stale.name.startswith(".build-")) and unused_s > STALE_AFTER_S:
                shutil.rmtree(stale, ignore_errors=True)
    return target / done.read_text().splitlines()[0]


def _damage(target: Path) -> str | None:
    """How a built cache entry differs from what its ``COMPLETE`` file recorded (the model's file name, then one
    ``name size`` line per file, size in bytes), or None if it does not. A file truncated or removed after the build,
    or a ``COMPLETE`` emptied or garbled, would otherwise be reported as a bad GGUF (or a traceback) on every use,
    never rebuilt."""
    if not (target / "COMPLETE").is_file():
        return "no COMPLETE file"
    lines = (target / "COMPLETE").read_text(errors="replace").splitlines()
    sizes = {}
    for line in lines[1:]:
        name, _, size = line.rpartition(" ")
        if not name or not size.isdigit():
            return f"COMPLETE line {line!r} is not 'name size'"
        sizes[name] = int(size)
    if not lines or lines[0] not in sizes:
        return f"COMPLETE records no size for the model file {lines[0] if lines else ''!r}"
    for name, size in sizes.items():
        f = target / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != size:
            return f"{name} is {f.stat().st_size} bytes, built as {size}"
    return None


def default_checkpoint() -> Path:
    """The embedded default model: the tiny preset in the ud-q4_k_xl mix, built once (with a progress bar)."""
    return cached_checkpoint("tiny", "ud-q4_k_xl", progress=True)

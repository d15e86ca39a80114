"""Open a GGUF model -- one file or a ``NAME-0000k-of-0000n.gguf`` split set -- as one memory-mapped tensor index.

Parsing is gguf-py's ``GGUFReader``; this module adds split-set discovery and consistency checks, and turns every
parse failure into a one-line :class:`~glm5serve.errors.GGUFModelError` naming the file (and tensor).
"""
from __future__ import annotations

import errno
import itertools
import math
import os
import re
import stat
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, gguf_reader

from glm5serve.errors import GGUFModelError

SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS = "split.count", "split.no", "split.tensors.count"
GGML_MAX_DIMS = 4  # ggml.h: every ggml tensor has 4 dimensions, of which a GGUF stores n_dims
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a GGUF model, data not read.

    ``ne`` is ggml's dimension order (fastest first); ``shape`` is the numpy/PyTorch order (``ne`` reversed).
    ``qtype`` is the ggml type (``qweight_type`` in vLLM's words). ``data`` is a read-only memory map:
    ``uint8`` of shape ``(*shape[:-1], row_bytes)`` for block-quantized and BF16 types, typed for F32/F16.
    :meth:`GGUFModel.conform` replaces a tensor stored with ``ne`` padded by 1s (or missing them) with the schema's
    ``ne``/``shape`` (:meth:`as_shape`); otherwise both are as stored.
    """

    name: str
    qtype: GGMLQuantizationType
    ne: tuple[int, ...]
    shape: tuple[int, ...]
    n_bytes: int
    file: str
    data_offset: int
    data: np.ndarray

    @property
    def n_elements(self) -> int:
        """Number of values (the product of ``ne``)."""
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def block_size(self) -> int:
        """Values per quant block of ``qtype`` (256 for the K-quants, 32 for Q4_0/Q5_0/Q8_0, 1 for F32/F16/BF16)."""
        return GGML_QUANT_SIZES[self.qtype][0]

    def raw(self) -> np.ndarray:
        """The tensor's bytes as a flat ``uint8`` memory-mapped view (nothing is copied)."""
        return self.data.reshape(-1).view(np.uint8)

    def as_shape(self, shape: tuple[int, ...]) -> TensorInfo | None:
        """This tensor as numpy ``shape`` if it is the same tensor: ``self`` when the shapes are equal; a copy of
        this info with ``shape``, ``ne`` and ``data`` reshaped (a view, nothing copied) when they differ only by
        leading size-1 dimensions (``ne`` padded with trailing 1s, either way round); else None.

        In ggml every tensor has 4 dimensions and ``n_dims`` is only how many are stored: llama.cpp's
        ``llama_model_loader::check_tensor_dims`` (src/llama-model-loader.cpp) compares ``ne[i]`` for every
        ``i < GGML_MAX_DIMS`` with the expected dimensions padded with 1, so ne ``[K, N, 1]`` is an ``[K, N]``
        tensor and ``[K, N]`` a ``[K, N, 1]`` one. The padding is outermost: a block type's rows are unchanged.
        """
        shape = tuple(int(n) for n in shape)
        if shape == self.shape:
            return self
        if max(len(shape), len(self.shape)) > GGML_MAX_DIMS or _unpadded(shape) != _unpadded(self.shape):
            return None
        data = self.data.reshape(*shape[:-1], self.data.shape[-1])
        return replace(self, ne=tuple(reversed(shape)), shape=shape, data=data)


def _unpadded(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` without its leading size-1 dimensions (ggml's trailing ``ne`` of 1)."""
    return tuple(itertools.dropwhile(lambda n: n == 1, shape))


def split_paths(path: str | os.PathLike) -> list[Path]:
    """Every file of the model that ``path`` names.

    ``path`` is a single ``.gguf`` file or any shard of a split set (``…-0000k-of-0000n.gguf``); the result lists
    shard 1..n in order. Raises GGUFModelError if the file or a shard is missing.
    """
    if not str(path):
        raise GGUFModelError("empty path: name a .gguf file")
    p = Path(path)
    m = SPLIT_RE.match(p.name)
    if not m:
        if why := _not_a_file(p):
            raise GGUFModelError(why, file=str(p))
        return [p]
    count = int(m["count"])
    if not 1 <= int(m["no"]) <= count:
        raise GGUFModelError(f"the file name says shard {int(m['no'])} of {count}: not a split set", file=str(p))
    paths = [p.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for q in paths:
        if why := _not_a_file(q):
            what = "missing" if why == "no such file" else f"unreadable ({why})"
            raise GGUFModelError(f"{what} shard {q.name} of a {count}-file split set", file=str(q))
    return paths


def _not_a_file(p: Path) -> str | None:
    """Why ``p`` cannot be opened as a GGUF file, in a few words (None when it is a regular file, or a link to one).

    ``Path.is_file`` is False alike for a missing file, a symlink loop, a dangling link and a FIFO, all of which were
    reported as "no such file"; a FIFO or device cannot be memory-mapped, so it is refused before gguf-py opens it.
    """
    try:
        mode = p.stat().st_mode
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "too many levels of symbolic links (a symlink loop)"
        if e.errno == errno.ENOENT:
            try:
                return f"a broken symbolic link (to {os.readlink(p)})"
            except OSError:  # not a link (or its own folder cannot be read): the name itself is missing
                return "no such file"
        return (e.strerror or str(e)).lower()  # "permission denied" for a folder that cannot be entered, ...
    if stat.S_ISDIR(mode):
        return "is a directory, not a GGUF file"
    if not stat.S_ISREG(mode):
        return "not a regular file (a FIFO, socket or device): a GGUF file is memory-mapped"
    return None


class _TensorProblem(Exception):
    def __init__(self, tensor: str | None, reason: str):
        super().__init__(reason)
        self.tensor, self.reason = tensor, reason


class _HeaderProblem(ValueError):
    """A metadata value that cannot be in the file (said in words of its own, not gguf-py's)."""


class _Reader(GGUFReader):
    """gguf-py's reader, plus the per-tensor checks llama.cpp's ``gguf_init_from_file_impl`` (ggml/src/gguf.cpp)
    makes, each naming the tensor: a known type, rows that are whole blocks, data that starts exactly where the
    previous tensor's padded data ends (so no two tensors overlap), and data inside the file; and a metadata array
    that the rest of the file cannot hold is refused before it is read."""

    def _get_field_parts(self, orig_offs: int, raw_type: int, *more, **named):  # more: a later gguf's depth (#28880)
        # gguf-py reads an array of numbers element by element; past the end of the file a read is empty and does
        # not advance, so a count garbled to 2**60 looped (growing a list) until memory ran out; gguf.cpp's read
        # fails at the end (an array of strings or arrays fails in gguf-py too, at its first element past the end).
        # Upstream: ggml-org/llama.cpp PR #27188 ("gguf-py : add size guards to GGUFReader"), not in gguf 0.19.0
        if raw_type == GGUFValueType.ARRAY:
            itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            scalar = self.gguf_scalar_to_np.get(GGUFValueType(int(itype[0]))) if len(itype) else None
            left = max(len(self.data) - orig_offs - 12, 0)
            if scalar is not None and len(count) and int(count[0]) * np.dtype(scalar).itemsize > left:
                raise _HeaderProblem(f"a metadata array declares {int(count[0])} {GGUFValueType(int(itype[0])).name} "
                                     f"values, more than the {left} bytes left in the file hold")
        return super()._get_field_parts(orig_offs, raw_type, *more, **named)

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list]:
        # gguf-py's loop, naming the tensor whose name is not UTF-8 (its "'utf-8' codec can't decode" names none)
        fields: list = []
        for i in range(count):
            try:
                field = self._get_tensor_info_field(offs)
            except UnicodeDecodeError:
                after = f"after {fields[-1].name}" if fields else "the first"
                raise _TensorProblem(None, f"tensor name #{i} ({after}) is not valid UTF-8") from None
            offs += sum(int(part.nbytes) for part in field.parts)
            fields.append(field)
        return offs, fields

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size, expected, previous, seen = len(self.data), 0, None, set()
        align = int(self.alignment)  # gguf-py keeps general.alignment as np.uint32: -n // it would overflow
        for field in fields:
            _, name, _, dims, raw_dtype, offset = field.parts
            tensor = bytes(name).decode("utf-8", "replace")
            if tensor in seen:  # gguf-py's "Found duplicated tensor" came out as a corrupt header
                raise _TensorProblem(tensor, "tensor stored twice")
            seen.add(tensor)
            ne = [int(d) for d in dims]
            if not ne:  # a scalar for ggml; gguf-py indexes ne[0] ("index 0 is out of bounds", a corrupt header)
                raise _TensorProblem(tensor, "0 dimensions: gguf-py cannot read a tensor without ne[0]")
            # gguf.cpp refuses both ("invalid number of dimensions", "number of elements overflows"); here the
            # product wrapped in int64 and the tensor read as "truncated"
            if len(ne) > GGML_MAX_DIMS:
                raise _TensorProblem(tensor, f"{len(ne)} dimensions (ne {ne}): ggml has at most {GGML_MAX_DIMS}")
            if math.prod(ne) > _INT64_MAX or any(d > _INT64_MAX for d in ne):
                raise _TensorProblem(tensor, f"ne {ne}: the number of values overflows int64")
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise _TensorProblem(tensor, f"unknown ggml tensor type id {int(raw_dtype[0])}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            if int(dims[0]) % block:
                raise _TensorProblem(tensor, f"rows of {int(dims[0])} {qtype.name} values are not whole "
                                             f"{block}-value blocks")
            if int(offset[0]) != expected:
                after = f"where {previous}'s padded data ends" if previous else "the start of the data section"
                raise _TensorProblem(tensor, f"data offset {int(offset[0])} is not {expected}, {after} "
                                             "(overlapping or misplaced tensor data, or a wrong type or shape before)")
            n_bytes = math.prod(ne) * type_size // block
            if start_offs + expected + n_bytes > size:
                raise _TensorProblem(tensor, "truncated file: tensor data runs past the end of the file")
            expected, previous = expected + -(-n_bytes // align) * align, tensor
        super()._build_tensors(start_offs, fields)


def _open_reader(path: Path) -> GGUFReader:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if not b"GGUF".startswith(magic):  # a shorter prefix is a truncated header: gguf-py says so below
            raise GGUFModelError(f"not a GGUF file (it starts with {magic!r}, not b'GGUF')", file=str(path))
        reader = _Reader(path, "r")
        if reader.byte_order == "S":  # gguf-py reads it byte-swapped; the tensor bytes would be decoded as stored
            raise GGUFModelError("big-endian GGUF file: not supported, as by llama.cpp (gguf-py's "
                                 "gguf_convert_endian.py FILE little converts it)", file=str(path))
        return reader
    except _TensorProblem as e:
        raise GGUFModelError(e.reason, file=str(path), tensor=e.tensor) from None
    except _HeaderProblem as e:
        raise GGUFModelError(f"not a readable GGUF file: header truncated or corrupt: {_header_extent(path)} ({e})",
                             file=str(path)) from None
    except OSError as e:
        raise GGUFModelError(f"not a readable GGUF file ({type(e).__name__}: {e})", file=str(path)) from None
    except (ValueError, IndexError, KeyError, UnicodeDecodeError, struct.error) as e:
        # gguf-py's own words for a cut-off or garbled header ("When changing to a larger dtype...", "not enough
        # values to unpack", "index 0 is out of bounds") say nothing to a user: name the defect, keep the reason
        msg = str(e)
        version = re.match(r"Sorry, file appears to be version (\d+)", msg)
        if version:
            readable = " and ".join(map(str, getattr(gguf_reader, "READER_SUPPORTED_VERSIONS", (2, 3))))
            with open(path, "rb") as f:
                field = f.read(8)[4:]
            # gguf-py reads a field whose low 16 bits are 0 as a big-endian file's (GGUFReader.__init__)
            order = f"field bytes {field.hex(' ')}, read as big-endian; " if field[:2] == b"\0\0" else ""
            raise GGUFModelError(f"unsupported GGUF version {version[1]} ({order}gguf-py reads versions {readable})",
                                 file=str(path)) from None
        if "GGMLQuantizationType" in msg:
            raise GGUFModelError(f"unknown ggml tensor type ({msg})", file=str(path)) from None
        if "alignment" in msg:  # a value, not a cut-off: "Invalid alignment: must be a non-zero power of two"
            raise GGUFModelError(f"bad general.alignment (gguf-py: {msg})", file=str(path)) from None
        if "reshape" in msg:  # tensor data cut off (the size check in _Reader should catch it first)
            raise GGUFModelError("truncated file: tensor data runs past the end of the file", file=str(path)) from None
        reason = " ".join(msg.split())[:120] or type(e).__name__
        raise GGUFModelError(f"not a readable GGUF file: header truncated or corrupt: {_header_extent(path)} "
                             f"(gguf-py: {reason})", file=str(path)) from None


def _header_extent(path: Path) -> str:
    """What a cut-off or garbled header still tells: the file's size against the fixed header (magic, version,
    tensor count, metadata key count: 24 bytes, ggml/docs/gguf.md) and the counts it declares."""
    size = path.stat().st_size
    if size < 24:
        return f"the file is {size} bytes and ends inside GGUF's 24-byte fixed header"
    with open(path, "rb") as f:
        n_tensors, n_kv = struct.unpack("<QQ", f.read(24)[8:])
    return f"the file is {size} bytes; its header declares {n_kv} metadata keys and {n_tensors} tensors"


def _field_value(field, path: Path) -> Any:
    """``field.contents()``, with a string that is not UTF-8 reported by key (and array element)."""
    try:
        return field.contents()
    except UnicodeDecodeError:
        pass
    for i, idx in enumerate(field.data):  # find the bad element (string arrays: one part per element)
        try:
            field.parts[idx].tobytes().decode("utf-8")
        except UnicodeDecodeError:
            where = f" at element {i}" if len(field.data) > 1 or field.types[0].name == "ARRAY" else ""
            raise GGUFModelError(f"{field.name}: invalid UTF-8{where}", file=str(path)) from None
    raise GGUFModelError(f"{field.name}: invalid UTF-8", file=str(path))


_KINDS = {int: "an integer", float: "a number", bool: "a boolean"}


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def metadata_value(key: str, v: Any, kind: type, path: str):
    """Metadata value ``v`` of ``key`` as ``kind`` (int, float or bool). Raises GGUFModelError naming ``path``,
    ``key`` and the type expected when a value of another GGUF type (a string, an array, a boolean for a number,
    a float for an integer key, even 4.0, as llama.cpp's typed ``get_key`` refuses it: "wrong type f32 but expected
    type u32"; a number other than 0 or 1 for a boolean key: NaN or 0.5 is no truth value) is stored there."""
    is_bool = isinstance(v, (bool, np.bool_))
    ok = isinstance(v, (int, float, np.integer, np.floating, np.bool_)) and (kind is bool or not is_bool) and (
        kind is not int or not isinstance(v, (float, np.floating))) and (kind is not bool or is_bool or v in (0, 1))
    if not ok:
        raise GGUFModelError(f"metadata key {key} is {_short(v)}, expected {_KINDS[kind]}", file=path)
    return kind(v)


class GGUFModel:
    """A GGUF model as one tensor index over all its split files (memory-mapped; nothing is read eagerly).

    ``metadata`` holds shard 1's key/value pairs (``split.*`` keys included). ``tensors`` maps GGUF tensor name to
    :class:`TensorInfo` in file order. Raises GGUFModelError for a missing shard, a truncated or non-GGUF file,
    inconsistent ``split.*`` keys, or a tensor stored twice.
    """

    def __init__(self, path: str | os.PathLike):
        self.paths = split_paths(path)
        self.path = self.paths[0]
        self.readers = [_open_reader(p) for p in self.paths]
        self.metadata: dict[str, Any] = {
            k: _field_value(f, self.path) for k, f in self.readers[0].fields.items() if not k.startswith("GGUF.")
        }
        self.tensors: dict[str, TensorInfo] = {}
        count = len(self.paths)
        if count > 1 and self.metadata.get(SPLIT_COUNT) is None:  # said "split.count=1", a default it does not hold
            raise GGUFModelError(f"metadata key {SPLIT_COUNT} is missing from shard 1 of {count}",
                                 file=str(self.path))
        declared = metadata_value(SPLIT_COUNT, self.metadata.get(SPLIT_COUNT, 1), int, str(self.path))
        if declared < 0:  # llama.cpp reads it as u16 ("wrong type"); the lines below would print shard 1 of -2
            raise GGUFModelError(f"{SPLIT_COUNT}={declared} is negative", file=str(self.path))
        if declared != count and not (declared in (0, 1) and count == 1):  # 0: not split (llama.cpp's default)
            no = self.metadata.get(SPLIT_NO)  # a shard renamed: part of a model, shard split.no + 1 of it
            no = 0 if no is None else metadata_value(SPLIT_NO, no, int, str(self.path))
            k = no + 1 if 0 <= no < declared else 1
            names = (f"the file name says {count} files" if count > 1 else
                     f"the file is not named as shard {k} of {declared} (NAME-{k:05d}-of-{declared:05d}.gguf)")
            raise GGUFModelError(f"{SPLIT_COUNT}={declared} but {names}", file=str(self.path))
        for i, (p, r) in enumerate(zip(self.paths, self.readers)):
            if count > 1:
                no = r.fields.get(SPLIT_NO)
                no = None if no is None else metadata_value(SPLIT_NO, _field_value(no, p), int, str(p))
                if no != i:  # split.no counts from 0, file names from 1
                    got = "missing" if no is None else no
                    raise GGUFModelError(f"{SPLIT_NO} is {got}, but shard {i + 1} of the set needs {SPLIT_NO}={i}",
                                         file=str(p))
            size = p.stat().st_size
            for t in r.tensors:
                if t.name in self.tensors:
                    raise GGUFModelError("tensor stored twice", file=str(p), tensor=t.name)
                if t.data_offset + t.n_bytes > size:
                    raise GGUFModelError("truncated file: tensor data runs past the end of the file", file=str(p), tensor=t.name)
                ne = tuple(int(x) for x in t.shape)
                self.tensors[t.name] = TensorInfo(
                    name=t.name, qtype=GGMLQuantizationType(t.tensor_type), ne=ne, shape=tuple(reversed(ne)),
                    n_bytes=int(t.n_bytes), file=str(p), data_offset=int(t.data_offset), data=t.data,
                )
        if count > 1:
            if self.metadata.get(SPLIT_TENSORS) is None:  # llama.cpp: "key not found in model"
                raise GGUFModelError(f"metadata key {SPLIT_TENSORS} is missing from shard 1 of {count}",
                                     file=str(self.path))
            want = metadata_value(SPLIT_TENSORS, self.metadata[SPLIT_TENSORS], int, str(self.path))
            if want != len(self.tensors):
                raise GGUFModelError(
                    f"{SPLIT_TENSORS}={want} but the {count} files hold {len(self.tensors)} tensors", file=str(self.path))

    @property
    def arch(self) -> str:
        """``general.architecture`` (e.g. ``glm-dsa``); raises GGUFModelError if absent."""
        a = self.metadata.get("general.architecture")
        if a is None:
            raise GGUFModelError("no general.architecture key", file=str(self.path))
        return str(a)

    def get(self, key: str, default: Any = None) -> Any:
        """Metadata value; a key starting with ``.`` is prefixed with the architecture (``.expert_count``)."""
        if key.startswith("."):
            key = self.arch + key
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """Like :meth:`get` but raises GGUFModelError naming the key when it is absent."""
        v = self.get(key)
        if v is None:
            raise GGUFModelError(f"metadata key {key if not key.startswith('.') else self.arch + key} is missing",
                                 file=str(self.path))
        return v

    def conform(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        """Tensor ``name`` as the numpy ``shape`` the schema expects: one stored with extra or missing size-1
        dimensions that llama.cpp accepts (:meth:`TensorInfo.as_shape`) is replaced in :attr:`tensors` by its view
        of ``shape``, so every later reader sees that shape. Raises GGUFModelError naming file and tensor for a
        missing tensor or any other shape."""
        t = self[name]
        conformed = t.as_shape(shape)
        if conformed is None:
            raise GGUFModelError(f"shape {t.shape} (numpy order), expected {tuple(shape)}", file=t.file, tensor=name)
        self.tensors[name] = conformed
        return conformed

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFModelError("tensor not found", file=str(self.path), tensor=name) from None

    def __len__(self) -> int:
        return len(self.tensors)

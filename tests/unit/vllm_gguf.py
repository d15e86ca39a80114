"""GGUF variants for the vLLM plugin tests: an existing checkpoint rewritten with other tensor types or order.

Values come from gguf-py's dequantizer (the oracle) and are re-encoded with :func:`glm5serve.checkpoint.encode`
(glm5serve's K-quant encoders, gguf-py's for the rest); metadata is copied key by key.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
from gguf import GGMLQuantizationType as Q, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def tensor_values(path, name: str) -> np.ndarray:
    """fp32 values of one tensor of a single-file GGUF, numpy shape, by gguf-py's dequantizer."""
    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    return dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape])))


def rewrite(src, dst, types: dict[str, Q] | Callable[[str, Q], Q] | None = None,
            order: Callable[[list[str]], list[str]] | None = None, drop: set[str] = frozenset()) -> Path:
    """Copy the single-file GGUF ``src`` to ``dst``, re-encoding tensors to ``types`` (name -> type, or a function
    of name and current type), writing them in ``order(names)``, leaving out ``drop``. Returns ``dst``."""
    from glm5serve.checkpoint import encode

    r = GGUFReader(src)
    arch = str(r.fields["general.architecture"].contents())
    w = GGUFWriter(dst, arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if f.types[0] == GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), f.types[0])
    tensors = {t.name: t for t in r.tensors if t.name not in drop}
    names = order(list(tensors)) if order else list(tensors)
    for name in names:
        t = tensors[name]
        shape = tuple(reversed([int(x) for x in t.shape]))
        old = Q(t.tensor_type)
        new = (types(name, old) if callable(types) else (types or {}).get(name, old))
        if new == old:  # raw rows as stored (GGUFWriter takes uint8 data with its byte shape)
            w.add_tensor(name, np.asarray(t.data), raw_dtype=old)
            continue
        values = dequantize(t.data, old).reshape(shape).astype(np.float32)
        w.add_tensor(name, encode(values, new), raw_dtype=new)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)

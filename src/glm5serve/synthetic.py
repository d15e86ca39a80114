"""Synthetic GLM-5: a GGUF header without tensor data, and random but valid tensor bytes made on the device.

Decode speed depends on shapes and quant types, not on the weights' values, so the full model can be measured
without its 420 GB. :func:`write_header` (``glm5serve synthetic-gguf``) writes an ordinary GGUF -- the metadata
``make-checkpoint`` writes (tokenizer included), every tensor's name, type and shape -- whose data section is a hole
(the file is truncated to its full length: ``ls`` shows the model's size, ``du`` a few MB), marked
``glm5serve.synthetic = true``. Served with ``--load-format glm5-synthetic``, the same vLLM loader and weights
adapter run as for a real file, with one difference: tensor bytes come from a :class:`SyntheticSource` instead of
the file. A normal load of such a header is refused (:func:`refuse_synthetic`), never silently given zeros.
"""
from __future__ import annotations

import math
import os
import zlib
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter

from glm5serve.checkpoint import _FILE_TYPES, FULL_PRESETS, PRESETS, Preset, gguf_metadata, layer_slice, \
    preset_config, refuse_existing, replacing, tensor_type
from glm5serve.config import ARCH
from glm5serve.errors import GGUFModelError
from glm5serve.gguf_file import SPLIT_RE
from glm5serve.schema import expected_tensors

#: metadata key marking a header whose tensor data is a hole
SYNTHETIC_KEY = "glm5serve.synthetic"
#: the vLLM load format that fills the parameters from a :class:`SyntheticSource`
LOAD_FORMAT = "glm5-synthetic"
MIXES = ("ud-q4_k_xl", "bf16", "f32")
#: quantized blocks per (type, row length) pool: enough that gathered rows do not visibly repeat
POOL_BLOCKS = 4096
#: 1-D tensors: norm weights ~ N(1, NORM_STD^2), biases (indexer k_norm, router score correction) ~ N(0, BIAS_STD^2)
NORM_STD, BIAS_STD = 0.02, 0.01
_TORCH_DTYPE = {Q.F32: torch.float32, Q.F16: torch.float16, Q.BF16: torch.bfloat16}


def preset_for(preset: str, layers: int | None = None) -> Preset:
    """A preset of :data:`checkpoint.PRESETS` or :data:`checkpoint.FULL_PRESETS` (``glm5``), optionally cut to
    ``layers`` main layers by :func:`checkpoint.layer_slice` (no MTP block). Raises ValueError for an unknown
    preset or too few layers."""
    presets = {**PRESETS, **FULL_PRESETS}
    if preset not in presets:
        raise ValueError(f"unknown preset {preset!r} (expected one of {', '.join(presets)})")
    p = presets[preset]
    if layers is not None and layers > p.first_k_dense_replace + p.n_moe_layers:
        raise ValueError(f"--layers {layers}: {preset} has {p.first_k_dense_replace + p.n_moe_layers} main layers")
    return p if layers is None else layer_slice(p, layers)


def write_header(path, preset: str = "glm5", layers: int | None = None, mix: str = "ud-q4_k_xl") -> Path:
    """Write a GGUF header for ``preset`` (cut to ``layers`` main layers) in ``mix``; its data section is a hole.

    The metadata is :func:`checkpoint.gguf_metadata` (what ``make-checkpoint`` writes, tokenizer included) plus
    ``glm5serve.synthetic = true``; the tensors are every required tensor of :func:`schema.expected_tensors` with the
    type :func:`checkpoint.tensor_type` gives it in ``mix``, at the offsets gguf-py's ``GGUFWriter`` assigns. The
    file is then truncated to header + data length, so every GGUF reader accepts it while the data occupies no disk
    (on file systems with sparse files). Takes about a second and little memory for the full ~420 GB GLM-5.
    Returns the path. Raises ValueError for an unknown preset or mix.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r} (expected one of {', '.join(MIXES)})")
    p = preset_for(preset, layers)
    cfg = preset_config(p)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n_layers = p.first_k_dense_replace + p.n_moe_layers
    with replacing([path]) as (tmp,):
        _write_header(tmp, p, cfg, f"GLM-5 glm5serve synthetic {preset} {n_layers} layers {mix}", mix)
    return path


def _write_header(path: Path, p: Preset, cfg, name: str, mix: str) -> None:
    writer = GGUFWriter(path, ARCH)
    for key, value, kind in gguf_metadata(p, name, int(_FILE_TYPES[mix])):
        if key != "general.architecture":  # GGUFWriter writes it
            getattr(writer, f"add_{kind}")(key, value)
    writer.add_bool(SYNTHETIC_KEY, True)
    for s in expected_tensors(cfg):
        if s.required:  # what make_checkpoint writes by default (no optional MTP embed/head copies)
            qtype = tensor_type(s, mix, p)
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = math.prod(s.shape) // block * type_size
            writer.add_tensor_info(s.gguf_name, s.shape, np.dtype(np.float32), n_bytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    align = writer.data_alignment
    size = GGUFWriter.ggml_pad(writer.fout[0].tell(), align) + sum(
        GGUFWriter.ggml_pad(ti.nbytes, align) for ti in writer.tensors[0].values())
    writer.close()
    os.truncate(path, size)


def is_synthetic(model) -> bool:
    """Whether a :class:`~glm5serve.gguf_file.GGUFModel` is a header written by :func:`write_header`."""
    return bool(model.metadata.get(SYNTHETIC_KEY, False))


def check_load_format(model, load_format: str) -> None:
    """Raise GGUFModelError naming ``model`` (a GGUFModel) when ``load_format`` does not fit its data: a header
    without ``--load-format glm5-synthetic`` (vLLM would read the hole), or real weights with it (they would be
    replaced by random ones without a word)."""
    synthetic = is_synthetic(model)
    if synthetic and load_format != LOAD_FORMAT:
        raise GGUFModelError(f"synthetic header without tensor data: add --load-format {LOAD_FORMAT}",
                             file=str(model.path))
    if not synthetic and load_format == LOAD_FORMAT:
        raise GGUFModelError(f"--load-format {LOAD_FORMAT} needs a header from glm5serve synthetic-gguf (this file "
                             "has real weights)", file=str(model.path))


def refuse_synthetic(model) -> None:
    """Raise GGUFModelError if ``model`` (a GGUFModel) has no tensor data: a load must not read its hole."""
    if is_synthetic(model):
        raise GGUFModelError(f"synthetic header without tensor data: serve it with --load-format {LOAD_FORMAT}",
                             file=str(model.path))


def _seed(*parts) -> int:
    return zlib.crc32("/".join(str(p) for p in parts).encode())


class SyntheticSource:
    """Random but valid GGUF tensor data, made on ``device``, deterministic per ``seed``, tensor name and device
    type: the byte source of the ``glm5-synthetic`` load format.

    :meth:`read` has the layout of the file map (``TensorInfo.data`` as torch): ``uint8 (*shape[:-1], row_bytes)``
    for block types, ``float32``/``float16``/``bfloat16`` of ``shape`` for F32/F16/BF16. Magnitudes are those of a
    trained model's: a matrix with rows of length K holds values ~ N(0, 1/K), so its outputs have unit variance for
    unit-variance inputs; 1-D tensors are norm weights ~ 1 or biases ~ 0 (:data:`NORM_STD`, :data:`BIAS_STD`).
    Block types are filled by gathering random blocks (``torch.randint`` on the device) from a pool of
    :data:`POOL_BLOCKS` blocks that :func:`glm5serve.quantize.quantize` made once per (type, row length) from
    N(0, 1/K) data: every block is one the quantizer wrote (finite scales), with no per-type byte-layout code here.
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu", pool_blocks: int = POOL_BLOCKS):
        self.seed, self.device, self.pool_blocks = seed, torch.device(device), pool_blocks
        self._pools: dict[tuple[Q, int], torch.Tensor] = {}

    def read(self, info) -> torch.Tensor:
        """The data of one tensor (a :class:`~glm5serve.gguf_file.TensorInfo`: only ``name``, ``qtype`` and
        ``shape`` are used) as a new tensor on :attr:`device`; the same tensor for the same name every time."""
        qtype, shape = Q(int(info.qtype)), tuple(info.shape)
        gen = torch.Generator(device=self.device).manual_seed(_seed(self.seed, info.name))
        if qtype in _TORCH_DTYPE:
            x = torch.randn(shape, generator=gen, device=self.device, dtype=_TORCH_DTYPE[qtype])
            if len(shape) > 1:
                return x.mul_(1 / math.sqrt(shape[-1]))
            if info.name.endswith(".bias"):
                return x.mul_(BIAS_STD)
            return x.mul_(NORM_STD).add_(1.0)
        block, type_size = GGML_QUANT_SIZES[qtype]
        if shape[-1] % block:
            raise GGUFModelError(f"row length {shape[-1]} is not a multiple of the {qtype.name} block size {block}",
                                 tensor=info.name)
        pool = self._pool(qtype, shape[-1])
        n_blocks = math.prod(shape) // block
        idx = torch.randint(len(pool), (n_blocks,), generator=gen, device=self.device)
        return pool[idx].reshape(*shape[:-1], shape[-1] // block * type_size)

    def _pool(self, qtype: Q, row: int) -> torch.Tensor:
        """``(pool_blocks, type_size)`` uint8 on the device: N(0, 1/row) data quantized to ``qtype``."""
        key = (qtype, row)
        if key not in self._pools:
            from glm5serve.quantize import quantize

            block = GGML_QUANT_SIZES[qtype][0]
            rng = np.random.RandomState(_seed(self.seed, qtype.name, row))
            x = rng.standard_normal((self.pool_blocks, block)).astype(np.float32) / np.float32(math.sqrt(row))
            self._pools[key] = torch.from_numpy(quantize(x, qtype)).to(self.device)
        return self._pools[key]


def add_parser(subparsers) -> None:
    """Register ``synthetic-gguf`` with the ``glm5serve`` argparse sub-commands."""
    p = subparsers.add_parser("synthetic-gguf", help="write a GLM-5 GGUF header without tensor data (for "
                              f"--load-format {LOAD_FORMAT}: benchmark without the weights)",
                              description="Write a GLM-5 GGUF header: metadata, tokenizer and every tensor's name, "
                                          "type and shape, with a data section that is a hole (a sparse file).")
    p.add_argument("out", help="GGUF file to write")
    p.add_argument("--preset", choices=sorted({**PRESETS, **FULL_PRESETS}), default="glm5",
                   help="model dimensions (default glm5: the real GLM-5)")
    p.add_argument("--layers", type=int, help="main layers to keep (a slice: the dense layers, then MoE layers; "
                   "no MTP block); default all")
    p.add_argument("--mix", choices=MIXES, default="ud-q4_k_xl", help="tensor types, as make-checkpoint's --mix "
                   "(default ud-q4_k_xl)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists (by default an existing file is "
                   "refused: a real checkpoint's weights would be lost)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    out = Path(args.out)
    if (m := SPLIT_RE.match(out.name)) and (int(m["no"]), int(m["count"])) != (1, 1):  # readers look for the rest
        raise GGUFModelError("named like a shard of a split set (...-0000k-of-0000n.gguf); a synthetic header is one "
                             "file: choose another name", file=str(out))
    refuse_existing(out, args.force)  # a dangling link was written through, creating its target
    if not out.parent.is_dir():
        raise GGUFModelError("not a directory" if out.parent.exists() else "no such directory", file=str(out.parent))
    try:
        path = write_header(args.out, args.preset, args.layers, args.mix)
    except ValueError as e:
        raise GGUFModelError(str(e)) from None
    st = os.stat(path)
    print(f"{path}: {st.st_size / 1e9:.3g} GB of GGUF ({st.st_blocks * 512 / 1e6:.3g} MB on disk): serve it with "
          f"--load-format {LOAD_FORMAT}")
    return 0

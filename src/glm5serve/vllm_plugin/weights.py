"""GLM-DSA (GLM-5, ``glm-dsa``) weights adapter for vllm-gguf-plugin: every GGUF tensor to the vLLM parameter it feeds.

The plugin's default adapter maps names through gguf-py's table for the arch whose name equals ``model_type``;
``glm_moe_dsa`` has none ("Unknown gguf model_type"), and even the deepseek2 table cannot express GLM-5's split
``kv_b_proj``. This adapter instead derives an explicit map from :mod:`glm5serve.schema` and hands vLLM's own
``load_weights`` (``DeepseekV2Model``/``DeepseekV32Model``) the checkpoint names it expects:

- ``attn_k_b`` + ``attn_v_b`` are dequantized and re-fused into one float ``kv_b_proj`` (:func:`schema.merge_kv_b`),
  listed as an unquantized module, because MLA splits ``kv_b_proj`` into ``W_UK_T``/``W_UV`` after loading;
- routed experts go as whole 3-D tensors (``experts.0.{gate,up,down}_proj`` with ``ndim == 3``: vLLM's
  ``RoutedExperts.weight_loader`` loads all experts at once and slices them for the TP rank);
- each matrix is stored the way the vLLM module was built: raw GGUF bytes as ``qweight`` + ``qweight_type`` where
  the module has GGUF parameters, a dequantized ``weight`` where it has a plain one (the indexer's
  ``wk_weights_proj`` is built without a quant config; so is any layer vLLM keeps dense). The decision is read from
  the model's parameters, not guessed from prefixes, which is what makes an unquantized ``token_embd`` load into a
  module that was built for GGUF (the plugin's prefix match fails for a layer built without ``prefix``);
- the MTP block (``blk.{num_hidden_layers}+``) is skipped: vLLM loads it only as a separate draft model.

Tensor bytes come from one byte source, :meth:`GlmDsaWeightsAdapter.read`: the GGUF's file map, or, for the
``glm5-synthetic`` load format, a :class:`~glm5serve.synthetic.SyntheticSource` (random valid blocks made on the
device); everything else -- planning, dequantization, storage decisions, the checks -- is the same code.

Every load is checked both ways (:meth:`GlmDsaWeightsAdapter.load_into`): a GGUF tensor that no weight loader
consumed, or a vLLM parameter that no tensor reached, is a :class:`~glm5serve.errors.GGUFModelError` naming them.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from vllm_gguf_plugin.weights_adapter.base import BaseGGUFWeightsAdapter, GGUFLoadSpec

from glm5serve.dequant import dequantize
from glm5serve.errors import GGUFModelError
from glm5serve.gguf_file import GGUFModel, TensorInfo
from glm5serve.schema import FLOAT_TYPES, expected_tensors, merge_kv_b
from glm5serve.synthetic import refuse_synthetic

MODEL_TYPE = "glm_moe_dsa"
#: checkpoint module -> (vLLM module it is stacked into, shard id): the ``stacked_params_mapping`` of
#: ``DeepseekV2Model.load_weights`` (vLLM 0.25/0.33) and ``DeepseekV32Model.load_weights`` (0.33, CUDA)
STACKED = {
    "q_a_proj": ("fused_qkv_a_proj", 0), "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    "wk": ("wk_weights_proj", 0), "weights_proj": ("wk_weights_proj", 1),
}
#: tensor attribute naming the GGUF tensors a yielded tensor was made from (read by the load recorder)
SOURCE_ATTR = "_glm5serve_gguf_sources"
_DTYPE_QTYPE = {torch.float32: Q.F32, torch.float16: Q.F16, torch.bfloat16: Q.BF16}


def qweight_names(weight_name: str) -> tuple[str, str]:
    """``X.weight`` -> (``X.qweight``, ``X.qweight_type``): the plugin's GGUF parameter names, renaming only the
    suffix (``indexer.weights_proj.weight`` keeps its module name; vllm-gguf-plugin#131)."""
    if not weight_name.endswith(".weight"):
        raise ValueError(f"{weight_name!r} does not end in .weight")
    base = weight_name[: -len(".weight")]
    return f"{base}.qweight", f"{base}.qweight_type"


def vllm_module(module: str) -> str:
    """Checkpoint module name -> the vLLM module that holds it (``...q_a_proj`` -> ``...fused_qkv_a_proj``)."""
    head, _, last = module.rpartition(".")
    return f"{head}.{STACKED[last][0]}" if last in STACKED else module


@dataclass(frozen=True)
class Load:
    """One checkpoint parameter to hand to vLLM.

    ``kind``: ``vector`` (1-D, or the router: always a plain float tensor), ``matrix`` (a linear or embedding
    weight: GGUF bytes or dequantized, as the vLLM module was built), ``kv_b`` (re-fused float ``kv_b_proj``) or
    ``experts`` (one 3-D expert tensor, GGUF bytes). ``name`` is the checkpoint name (``...weight``; for experts
    ``...experts.0.gate_proj.weight``), ``sources`` the GGUF tensors it is made of.
    """

    name: str
    kind: str
    sources: tuple[str, ...]

    @property
    def module(self) -> str:
        return self.name.rsplit(".", 1)[0]


def _tag(t: torch.Tensor, sources: Iterable[str]) -> torch.Tensor:
    setattr(t, SOURCE_ATTR, tuple(sources))
    return t


def _raw(info: TensorInfo) -> torch.Tensor:
    """The tensor's stored data as torch, a view of the read-only file map (uint8 ``(..., row_bytes)`` for block
    types, else typed: float32/float16/bfloat16 of ``info.shape``). Not copied: the loaders only narrow, clone or
    ``copy_`` from it, so each TP rank reads just its own slice of the file instead of copying every tensor whole
    (as the plugin's iterator does)."""
    a = info.data.view(np.int16) if info.qtype == Q.BF16 else info.data
    with warnings.catch_warnings():  # "not writable": nothing writes through this view
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(a)
    return t.view(torch.bfloat16).reshape(info.shape) if info.qtype == Q.BF16 else t


class GlmDsaWeightsAdapter(BaseGGUFWeightsAdapter):
    """vllm-gguf-plugin weights adapter for ``model_type == "glm_moe_dsa"`` (see the module docstring).

    Use: ``prepare_loading(path, model_config)`` once (checks the file and the TP size, returns the plugin's
    ``GGUFLoadSpec`` whose ``unquantized_modules`` must reach the GGUF quant config before the model is built),
    then ``load_into(model, model_config)``. ``prepare_weights`` is the plugin's stream API (storage decided from
    ``unquantized_modules`` alone, without the model).
    """

    load_spec: GGUFLoadSpec | None = None
    #: where tensor bytes come from: None for the GGUF's own file map, else an object with the :meth:`read`
    #: signature (the ``glm5-synthetic`` loader sets a :class:`~glm5serve.synthetic.SyntheticSource`)
    source = None

    @classmethod
    def matches(cls, config) -> bool:
        return getattr(config, "model_type", None) == MODEL_TYPE

    def prepare_loading(self, model_path: str, model_config, tp_size: int | None = None) -> GGUFLoadSpec:
        """Open the GGUF (any shard of a split set), check it against the config and TP size, plan the load.

        Raises GGUFModelError for anything :func:`check_file` refuses (what ``glm5serve verify --tp`` refuses,
        e.g. a TP size that would cut a quant block of a row-parallel weight), for routed ``gate``/``up``
        experts of different types (the plugin runs the fused ``w13`` experts with one kernel type), and for a
        synthetic header (no tensor data) read through the file map.
        """
        cfg = model_config.hf_config
        self.gguf = check_file(model_path, cfg, _tp_size() if tp_size is None else tp_size)
        if self.source is None:
            refuse_synthetic(self.gguf)
        self.dtype = model_config.dtype
        self.plan = _plan(self.gguf, cfg)
        # what must be consumed, from the file itself (not from the plan, so a planning gap is caught too); the MTP
        # block and a shared layer's indexer (llama.cpp loads it but never runs it) are not handed over
        skipped = _skipped(cfg)
        self.sources = {n for n in self.gguf.tensors if n not in skipped}
        unquantized = _unquantized_modules(self.plan, self.gguf)
        self.load_spec = GGUFLoadSpec(
            weights_source=[str(p) for p in self.gguf.paths],
            unquantized_modules=unquantized,
            gguf_to_hf_name_map={s: ld.name for ld in self.plan for s in ld.sources},
        )
        return self.load_spec

    # -- the byte source ---------------------------------------------------------------------------------------

    def read(self, info: TensorInfo) -> torch.Tensor:
        """One tensor's stored data: uint8 ``(*shape[:-1], row_bytes)`` for block types, float32/float16/bfloat16
        of ``info.shape`` for F32/F16/BF16. From the file map (a view, not copied: the loaders only narrow, clone
        or ``copy_`` from it) or from :attr:`source` (a new tensor on its device)."""
        return _raw(info) if self.source is None else self.source.read(info)

    def dequantized(self, info: TensorInfo, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """:meth:`read` dequantized by :func:`glm5serve.dequant.dequantize` to ``info.shape`` in ``dtype``.
        Raises GGUFModelError naming the file, tensor and type for an unsupported type."""
        try:
            return dequantize(self.read(info), info.qtype, info.shape, dtype=dtype)
        except GGUFModelError as e:
            raise GGUFModelError(e.reason, file=info.file, tensor=info.name) from None

    # -- the stream ------------------------------------------------------------------------------------------

    def prepare_weights(self, model_config=None) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) pairs for ``model.load_weights``, storage from ``unquantized_modules`` (which
        lists every shard of a dense stacked module, so the checkpoint module name decides)."""
        dense = set(self.load_spec.unquantized_modules)
        return self._weights(lambda ld: ld.module in dense)

    def weights_for(self, params: dict[str, torch.nn.Parameter]) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor) pairs for ``model.load_weights``, each matrix stored as its vLLM module was
        built: dense where ``{module}.weight`` exists, GGUF where ``{module}.qweight`` does.

        Raises GGUFModelError (during iteration) for a tensor whose vLLM parameter does not exist (e.g. an
        indexer on a layer the config makes ``shared``): vLLM would drop it silently or fail with a KeyError.
        """
        def dense(ld: Load) -> bool:
            """True: a plain float parameter; False: the plugin's ``qweight``/``qweight_type``."""
            if ld.kind == "matrix":
                vm = vllm_module(ld.module)
                if f"{vm}.qweight" in params:
                    return False
                if f"{vm}.weight" in params:
                    return True
                missing = f"{vm}.weight or {vm}.qweight"
            elif ld.kind == "experts":
                layer = ld.name.split(".experts.")[0]
                if any(n.startswith(f"{layer}.experts.") and n.endswith("_qweight") for n in params):
                    return False
                missing = f"{layer}.experts.*_qweight"
            else:  # vector, kv_b: plain parameters under their checkpoint names
                if ld.name in params:
                    return True
                missing = ld.name
            raise GGUFModelError(f"vLLM's model has no parameter {missing} for it", file=str(self.gguf.path),
                                 tensor=ld.sources[0])
        return self._weights(dense)

    def _weights(self, is_dense) -> Iterator[tuple[str, torch.Tensor]]:
        for ld in self.plan:
            infos = [self.gguf[s] for s in ld.sources]
            dense = is_dense(ld)
            if ld.kind == "vector":  # fp32: some of these parameters are fp32 (router, indexer k_norm)
                yield ld.name, _tag(self.dequantized(infos[0]), ld.sources)
            elif ld.kind == "kv_b":  # the transpose of attn_k_b happens after dequantization, in fp32
                w = merge_kv_b(self.dequantized(infos[0]), self.dequantized(infos[1]))
                yield ld.name, _tag(w.to(self.dtype), ld.sources)
            elif ld.kind == "matrix" and dense:  # fp32 rounded once to the model dtype
                yield ld.name, _tag(self.dequantized(infos[0], self.dtype), ld.sources)
            else:  # GGUF storage: matrix in a GGUF-built module, or 3-D experts
                yield from self._gguf_pair(ld, infos[0])

    def _gguf_pair(self, ld: Load, info: TensorInfo) -> Iterator[tuple[str, torch.Tensor]]:
        qweight, qweight_type = qweight_names(ld.name)
        if info.qtype in FLOAT_TYPES:
            # the plugin computes float "qweight"s as x @ W.T: they must be in the activation dtype
            data, qtype = self.read(info).to(self.dtype), _DTYPE_QTYPE[self.dtype]
        else:
            data, qtype = self.read(info), info.qtype
        yield qweight_type, _tag(torch.tensor(int(qtype), dtype=torch.uint8), ld.sources)
        yield qweight, _tag(data, ld.sources)

    # -- loading with the bijection check --------------------------------------------------------------------

    def load_into(self, model: torch.nn.Module, model_config=None) -> None:
        """Load every planned tensor into ``model`` with its own ``load_weights`` and check the result.

        Raises GGUFModelError listing the GGUF tensors that no weight loader consumed and the vLLM parameters
        that no tensor reached (before ``process_weights_after_loading``, which would hide them).
        """
        params = dict(model.named_parameters())
        with LoadRecorder(params) as rec:
            model.load_weights(self.weights_for(params))
        unused = sorted(self.sources - rec.used_sources)
        unloaded = sorted(set(params) - rec.loaded_params)
        if unused or unloaded:
            parts = []
            if unused:
                parts.append(f"{len(unused)} GGUF tensor(s) not loaded by vLLM: {_names(unused)}")
            if unloaded:
                parts.append(f"{len(unloaded)} vLLM parameter(s) not loaded: {_names(unloaded)}")
            raise GGUFModelError("; ".join(parts), file=str(self.gguf.path))


class LoadRecorder:
    """Context manager wrapping every parameter's ``weight_loader`` to record which parameters were loaded and
    which GGUF tensors (by the :data:`SOURCE_ATTR` tag on the tensor) reached a loader; restores them on exit."""

    def __init__(self, params: dict[str, torch.nn.Parameter]):
        self.params = params
        self.loaded_params: set[str] = set()
        self.used_sources: set[str] = set()
        self._saved: list[tuple[torch.nn.Parameter, object, bool]] = []

    def __enter__(self) -> "LoadRecorder":
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        for name, p in self.params.items():
            had = hasattr(p, "weight_loader")
            orig = p.weight_loader if had else default_weight_loader
            self._saved.append((p, orig, had))
            p.weight_loader = self._wrap(name, orig)
        return self

    def _wrap(self, name: str, orig):
        def weight_loader(param, loaded_weight, *args, **kwargs):
            self.loaded_params.add(name)
            self.used_sources.update(getattr(loaded_weight, SOURCE_ATTR, ()))
            return orig(param, loaded_weight, *args, **kwargs)
        return weight_loader

    def __exit__(self, *exc) -> None:
        for p, orig, had in self._saved:
            if had:
                p.weight_loader = orig
            else:
                del p.weight_loader


# -- planning ---------------------------------------------------------------------------------------------------

def _tp_size() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size
    try:
        return get_tensor_model_parallel_world_size()
    except AssertionError:  # no TP group (a bare process): nothing is split
        return 1


def _names(names: list[str], limit: int = 20) -> str:
    return ", ".join(names[:limit]) + (f" (+{len(names) - limit} more)" if len(names) > limit else "")


#: config fields that fix the shape of some tensor: a folder config must agree with the GGUF metadata on them
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
                "index_head_dim", "n_routed_experts", "n_shared_experts", "moe_intermediate_size",
                "intermediate_size", "first_k_dense_replace")


def check_file(path, cfg, tp: int) -> GGUFModel:
    """Refuse what ``glm5serve verify --tp`` refuses, with the same message, and a config that disagrees with
    the file; returns the opened model.

    Runs verify's open, metadata, tensors, types and TP checks (:mod:`glm5serve.verify`: presence, shapes, unknown
    tensors, allowed types, heads/intermediate sizes/row-parallel quant blocks divisible by ``tp``), then compares
    ``cfg`` (the config vLLM builds the model from) with the metadata on :data:`SHAPE_FIELDS`.
    """
    from glm5serve import verify

    ctx = verify.Context(str(path), tp)
    for check in (verify.check_open, verify.check_metadata, verify.check_tensors, verify.check_types,
                  verify.check_tp):
        for result in check(ctx):
            if not result.ok:
                raise GGUFModelError(result.detail)
    wrong = [f"{f}={getattr(cfg, f, None)} (GGUF: {getattr(ctx.cfg, f)})" for f in SHAPE_FIELDS
             if getattr(cfg, f, None) != getattr(ctx.cfg, f)]
    if wrong:
        raise GGUFModelError(f"the model config disagrees with the GGUF metadata: {', '.join(wrong)}",
                             file=str(ctx.model.path))
    return ctx.model


def _skipped(cfg) -> set[str]:
    """GGUF tensors never handed to vLLM: the MTP block, and the indexer tensors of a layer whose ``indexer_types``
    entry is ``shared`` (vLLM builds no indexer there; llama.cpp loads them as optional and reuses the previous
    layer's top-k, so a file that keeps them is served the same way)."""
    return {s.gguf_name for s in expected_tensors(cfg) if s.kind == "mtp" or (s.kind == "indexer" and not s.required)}


def _plan(gguf: GGUFModel, cfg) -> list[Load]:
    """The loads, in GGUF file order of their first tensor (the order vLLM sees them), :func:`_skipped` excluded."""
    skipped = _skipped(cfg)
    specs = [s for s in expected_tensors(cfg) if s.gguf_name not in skipped and s.gguf_name in gguf]
    by_hf: dict[str, list] = {}
    for s in specs:
        by_hf.setdefault(s.hf_name, []).append(s)
    loads = []
    for hf, group in by_hf.items():
        if len(group) == 2 and {s.hf_part for s in group} == {"k_b", "v_b"}:
            k_b, v_b = sorted(group, key=lambda s: s.hf_part)
            loads.append(Load(hf, "kv_b", (k_b.gguf_name, v_b.gguf_name)))
        elif hf.endswith(".experts.gate_up_proj") or hf.endswith(".experts.down_proj"):
            for s in group:
                part = "down" if s.hf_part is None else s.hf_part
                loads.append(Load(f"{hf.rsplit('.', 1)[0]}.0.{part}_proj.weight", "experts", (s.gguf_name,)))
        else:
            (s,) = group
            vector = len(s.shape) == 1 or hf.endswith(".mlp.gate.weight")
            loads.append(Load(hf, "vector" if vector else "matrix", (s.gguf_name,)))
    order = {n: i for i, n in enumerate(gguf.tensors)}
    loads.sort(key=lambda ld: order[ld.sources[0]])
    for ld in loads:
        if ld.kind == "experts" and ld.name.endswith(".gate_proj.weight"):
            up = ld.sources[0].replace("ffn_gate_exps", "ffn_up_exps")
            g, u = gguf[ld.sources[0]], gguf[up]
            if g.qtype != u.qtype:
                raise GGUFModelError(
                    f"routed experts gate ({g.qtype.name}) and up ({u.qtype.name}, {up}) have different types: "
                    "vllm-gguf-plugin runs the fused w13 experts with one kernel type", file=g.file, tensor=g.name)
    return loads


def _unquantized_modules(plan: list[Load], gguf: GGUFModel) -> list[str]:
    """Checkpoint module names the GGUF quant config must build dense (``GGUFConfig.unquantized_modules``).

    ``kv_b_proj`` always (it is handed over re-fused in float); the indexer's ``wk``/``weights_proj`` (vLLM builds
    ``wk_weights_proj`` without a quant config, so listing them only documents it); every module stored as F32, F16 or
    BF16 (the plugin's own rule); and all shards of a stacked module (``fused_qkv_a_proj``, ``gate_up_proj``) if
    any shard is float, since the plugin cannot mix float and quantized shards in one fused parameter.
    """
    out: set[str] = set()
    groups: dict[str, list[Load]] = {}
    for ld in plan:
        if ld.kind == "kv_b":
            out.add(ld.module)
        elif ld.kind == "matrix":
            groups.setdefault(vllm_module(ld.module), []).append(ld)
    for vm, members in groups.items():
        if vm.endswith(".wk_weights_proj") or any(gguf[ld.sources[0]].qtype in FLOAT_TYPES for ld in members):
            out.update(ld.module for ld in members)
    return sorted(out)

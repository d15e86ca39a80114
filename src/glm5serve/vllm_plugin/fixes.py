"""Every fix glm5serve applies to vllm-gguf-plugin 0.0.5, in one place, each a narrow wrap of one plugin function.

:func:`apply` installs them (idempotent; called by :func:`glm5serve.vllm_plugin.register` in every vLLM process).

=================================  ==========================================================================
fault (upstream)                   fix
=================================  ==========================================================================
merged/QKV loaders take TP rank 0  :func:`_tp_rank_from_group`: ``load_merged_column_weight``/``load_qkv_weight``
(vllm-gguf-plugin#103; PR#106,     read ``kwargs.get("tp_rank", 0)``; vLLM 0.25 passes ``tp_rank``, 0.33 does not,
merged after 0.0.5)                so at TP > 1 every rank kept rank 0's rows. Take the rank from the TP group
                                   when the caller does not pass it (and only when a slice is actually taken).
``weight`` -> ``qweight`` by       :func:`_suffix_only_names`: ``gguf_quant_weights_iterator_multi`` does
substring (plugin PR#131, open)    ``name.replace("weight", "qweight")``: ``indexer.weights_proj.weight`` became
                                   ``indexer.qweights_proj.qweight``. Rename only the suffix.
ReplicatedLinear GGUF params       :func:`_replicated_linear_loader`: ``GGUFLinearMethod`` gives a layer without
(no upstream issue found)          ``weight_loader_v2`` (``ReplicatedLinear``: the indexer's ``wq_b``) that
                                   layer's size-asserting loader, which fails on the uninitialised GGUF param
                                   ("Tried to load weights of size [16, 68] to a parameter of size [0]").
                                   Store the bytes as the plugin stores any unsharded GGUF weight.
=================================  ==========================================================================

Faults fixed outside this module, because the fix is the GLM-5 adapter's own job (tested the same way):
``glm_moe_dsa`` not mapped and ``kv_b_proj`` never loaded (``weights.GlmDsaWeightsAdapter``); an unquantized
``token_embd`` sent to a module the plugin built for GGUF (``weights.GlmDsaWeightsAdapter.weights_for`` reads the
storage from the model's parameters); row-parallel and expert ``down`` weights sliced by bytes across a quant
block at TP > 1 (``weights.check_file`` refuses at load what ``glm5serve verify --tp`` refuses). Fused-shard order
(``fused_qkv_a_proj`` with ``attn_kv_a_mqa`` stored first, different quant types; vllm#35019/#41057) is already
right in 0.0.5 (``_gguf_ordered_shard_ids``); ``tests/unit/test_vllm_faults.py`` keeps it that way.
"""
from __future__ import annotations

import functools

_MARK = "_glm5serve_fixed"


def apply() -> None:
    """Install every fix (idempotent: a wrapped function is marked and never wrapped twice)."""
    from vllm_gguf_plugin import weight_utils
    from vllm_gguf_plugin.quantization import linear, params
    from vllm_gguf_plugin.weights_adapter import default, gemma3

    mixin = params._GGUFParamLoadMixin
    for name in ("load_merged_column_weight", "load_qkv_weight"):
        _patch(mixin, name, _tp_rank_from_group)
    iterator = weight_utils.gguf_quant_weights_iterator_multi
    fixed = iterator if getattr(iterator, _MARK, False) else _mark(_suffix_only_names(iterator))
    for module in (weight_utils, default, gemma3):  # default/gemma3 imported the function by name
        module.gguf_quant_weights_iterator_multi = fixed
    _patch(linear.GGUFLinearMethod, "create_weights", _replicated_linear_loader)


def _mark(fn):
    setattr(fn, _MARK, True)
    return fn


def _patch(owner, name: str, fix) -> None:
    orig = getattr(owner, name)
    if not getattr(orig, _MARK, False):
        setattr(owner, name, _mark(fix(orig)))


def _tp_rank_from_group(orig):
    """vllm-gguf-plugin#103: default ``tp_rank`` to this process's TP rank instead of 0 (as PR#106 does)."""
    @functools.wraps(orig)
    def load(self, loaded_weight, **kwargs):
        shard_size = kwargs.get("shard_size")
        sliced = shard_size is not None and loaded_weight.ndim >= 1 and 0 < shard_size < loaded_weight.shape[0]
        if "tp_rank" not in kwargs and sliced:
            from vllm.distributed import get_tensor_model_parallel_rank
            kwargs["tp_rank"] = get_tensor_model_parallel_rank()
        return orig(self, loaded_weight, **kwargs)
    return load


#: stands for a ``weight`` inside a module path while the plugin renames names (no name contains a NUL)
_HIDDEN = "\x00"


def _suffix_only_names(orig):
    """vllm-gguf-plugin PR#131: hide every ``weight`` but the last name component from the plugin's
    ``name.replace("weight", ...)``, then restore them, so only the parameter suffix is renamed."""
    @functools.wraps(orig)
    def iterator(gguf_files, gguf_to_hf_name_map=None):
        if gguf_to_hf_name_map is None:  # raw GGUF names (blk.N.*) have no inner "weight"
            yield from orig(gguf_files, gguf_to_hf_name_map)
            return
        hidden = {}
        for gguf_name, hf_name in gguf_to_hf_name_map.items():
            module, dot, param = hf_name.rpartition(".")
            hidden[gguf_name] = module.replace("weight", _HIDDEN) + dot + param
        for name, tensor in orig(gguf_files, hidden):
            yield name.replace(_HIDDEN, "weight"), tensor
    return iterator


def _replicated_linear_loader(orig):
    """A GGUF ``qweight`` of a layer without ``weight_loader_v2`` (``ReplicatedLinear``) is stored whole, as the
    plugin stores any unsharded GGUF weight, instead of going through the layer's size-asserting loader."""
    @functools.wraps(orig)
    def create_weights(self, layer, *args, **kwargs):
        orig(self, layer, *args, **kwargs)
        if not hasattr(layer, "weight_loader_v2"):
            layer.qweight.weight_loader = _store_whole
    return create_weights


def _store_whole(param, loaded_weight, *args, **kwargs) -> None:
    from vllm_gguf_plugin.quantization.params import _store_gguf_loaded_weight

    _store_gguf_loaded_weight(param, loaded_weight)

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
MoE expert offsets in int32        :func:`_expert_groups`: the fused MoE kernels compute an expert's offset as
(CUDA extension: vllm-gguf-plugin  ``expert * stride_we`` in int32 (Triton: ``expert`` is loaded as int32 and the
#127; Triton kernels: same class,  stride passed as an int32 scalar), so past 2**31 bytes of one expert tensor the
no issue found)                    pointer wraps: GLM-5's whole ``w13`` (256 x 4096 x 3456 B = 3.6 GB at TP=1)
                                   faults with an illegal memory access. Run the experts in groups whose bytes stay
                                   below 2**31 (two calls for GLM-5 at TP=1; one at TP >= 2).
MoE expert id -1 (padding; plugin  the same wrap: vLLM 0.33 routes padding tokens to expert -1
PR#130, open)                      (``VLLM_MOE_SKIP_PADDING=1``), which the kernels index as an expert (the bytes
                                   before the tensor). A slot outside the group, -1 included, gets expert 0 and
                                   weight 0.
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

import torch

_MARK = "_glm5serve_fixed"
#: the first element offset a kernel with int32 offsets cannot address
INT32_LIMIT = 2**31


def apply() -> None:
    """Install every fix (idempotent: a wrapped function is marked and never wrapped twice)."""
    from vllm_gguf_plugin import quantization, weight_utils
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
    # GGUFMoEMethod.apply looks the op up in the package at call time; glm5serve's kernel op
    # (kernels.vllm_ops.install, marked "_glm5serve_kernels") already calls the fixed plugin op
    if not getattr(quantization.fused_moe_gguf, "_glm5serve_kernels", False):
        _patch(quantization, "fused_moe_gguf", _expert_groups)


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


def _expert_groups(orig, limit: int = INT32_LIMIT):
    """Run the plugin's fused MoE on groups of experts whose weights each span at most ``limit`` elements, with
    every slot routed outside the group (padding's expert -1 included) given expert 0 and weight 0.

    ``orig(x, w1, w2, topk_weights, topk_ids, qweight_type, qweight_type2, activation)`` takes ``w1`` (E, 2I, row
    bytes) and ``w2`` (E, H, row bytes) uint8 GGUF experts (or float ones), ``topk_ids``/``topk_weights`` (T, k).
    A group ``[a, b)`` gets the views ``w[a:b]`` (offsets from their own base stay below ``limit``) and ids shifted
    by ``a``; the groups' (T, H) outputs are summed. One expert larger than ``limit`` cannot be fixed this way:
    ValueError.
    """
    @functools.wraps(orig)
    def fused_moe(x, w1, w2, topk_weights, topk_ids, qweight_type, qweight_type2, activation):
        n_experts, step = w1.shape[0], max(w1.stride(0), w2.stride(0))
        group = limit // step
        if group < 1:
            raise ValueError(f"one GGUF expert spans {step} elements, more than the MoE kernels address ({limit})")
        out = None
        for a in range(0, n_experts, group):
            inside = (topk_ids >= a) & (topk_ids < a + group)
            y = orig(x, w1[a:a + group], w2[a:a + group], torch.where(inside, topk_weights, 0),
                     torch.where(inside, topk_ids - a, 0), qweight_type, qweight_type2, activation)
            out = y if out is None else out.add_(y)
        return out
    return fused_moe

"""Which tensor-parallel sizes a GLM-5 GGUF can be loaded at by vLLM + vllm-gguf-plugin (no vLLM import).

vLLM splits MLA by attention heads (``q_b_proj``/``kv_b_proj`` column-parallel, ``o_proj`` row-parallel), dense and
shared-expert MLPs and routed experts by intermediate size (``gate``/``up`` rows, ``down`` columns), and pads the
vocabulary (any TP). The plugin slices a quantized row-parallel weight by *bytes* (``load_row_parallel_weight`` in
``quantization/params.py``; vLLM's ``RoutedExperts._load_w2`` for expert ``down``): right only when each rank's
share of a row is a whole number of quant blocks. Nothing upstream checks that; a misaligned slice loads silently
and computes garbage. :func:`tp_problems` is the one rule set that ``glm5serve verify --tp`` and the loader share.
"""
from __future__ import annotations

from gguf import GGML_QUANT_SIZES

from glm5serve.errors import GGUFModelError
from glm5serve.schema import expected_tensors


def tp_problems(model, cfg, tp: int) -> list[GGUFModelError]:
    """Every reason ``model`` (a :class:`~glm5serve.gguf_file.GGUFModel`) cannot be split ``tp`` ways by vLLM.

    ``cfg`` is its ``GlmMoeDsaConfig``. Checks: ``tp >= 1``; the attention heads divide by ``tp``; every
    column-parallel tensor's rows (numpy dim -2) divide by ``tp``; every row-parallel tensor's quant blocks per row
    (row length / block size; block size 1 for F32/F16/BF16) divide by ``tp``. Tensors absent from the file are
    skipped (presence is checked elsewhere). Returns one-line :class:`GGUFModelError` s naming file and tensor.
    """
    path = str(getattr(model, "path", "<model>"))
    if tp < 1:
        return [GGUFModelError(f"tensor-parallel size must be >= 1, got {tp}", file=path)]
    errors = []
    heads = cfg.num_attention_heads
    if heads % tp:
        errors.append(GGUFModelError(f"TP={tp} does not divide the {heads} attention heads", file=path))
    for spec in expected_tensors(cfg):
        if spec.kind == "mtp" or spec.tp_split is None or spec.gguf_name not in model:
            continue
        info = model[spec.gguf_name]
        if spec.tp_split == "col" and info.shape[-2] % tp:
            errors.append(GGUFModelError(
                f"TP={tp} does not divide its {info.shape[-2]} output rows (column-parallel)",
                file=info.file, tensor=info.name))
        elif spec.tp_split == "row":
            block = GGML_QUANT_SIZES[info.qtype][0]
            blocks = info.shape[-1] // block
            if blocks % tp:
                unit = f"{blocks} {info.qtype.name} blocks of {block}" if block > 1 else f"{blocks} elements"
                errors.append(GGUFModelError(
                    f"TP={tp} would cut a row of {unit} between ranks (row-parallel weights are sliced by bytes); "
                    f"use a TP that divides {blocks}", file=info.file, tensor=info.name))
    return errors


def check_tp(model, cfg, tp: int) -> None:
    """Raise the first of :func:`tp_problems` (a :class:`GGUFModelError`) if there is any."""
    problems = tp_problems(model, cfg, tp)
    if problems:
        raise problems[0]

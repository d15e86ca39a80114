"""The planted faults of issue 6 (item 4): each one a small textual patch that brings back a failure class of
``docs/bug-classes.md`` in a copy of the code, and the CPU tests that must catch it.

``path`` is relative to the repository root, or ``plugin:<path>`` inside the installed ``vllm_gguf_plugin`` package
(copied and patched, then put first on ``PYTHONPATH``). ``edits`` are ``(old, new)`` replacements; each ``old`` must
occur exactly once in the file (else the list is stale and ``run.py`` says so). ``tests`` are pytest node ids
(``file`` or ``file::test``, parametrisations included).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    name: str
    bug_class: str
    what: str
    path: str
    edits: tuple[tuple[str, str], ...]
    tests: tuple[str, ...]


P = "tests/properties/"
U = "tests/unit/"

FAULTS: tuple[Fault, ...] = (
    Fault("unsorted-shards", "1", "the plugin pads and runs fused shards in arrival order, not declared order",
          "plugin:quantization/params.py",
          (("return sorted(shard_ids, key=_gguf_shard_id_as_int)", "return list(shard_ids)"),),
          (P + "test_fused_shard_order.py",
           U + "test_vllm_faults.py::test_fused_qkv_a_is_in_declared_order_whatever_the_storage_order")),
    Fault("rank0-slicing", "2", "glm5serve's fix for vllm-gguf-plugin#103 passes rank 0 instead of this rank",
          "src/glm5serve/vllm_plugin/fixes.py",
          (('kwargs["tp_rank"] = get_tensor_model_parallel_rank()', 'kwargs["tp_rank"] = 0'),),
          (P + "test_tp_recombination.py", P + "test_fused_shard_order.py",
           U + "test_vllm_faults.py::test_merged_column_gguf_weight_holds_this_ranks_rows",
           U + "test_vllm_faults.py::test_qkv_gguf_weight_holds_this_ranks_rows")),
    Fault("neox-rope-vllm", "12", "the config tells vLLM the indexer RoPE is NEOX (indexer_rope_interleave=False)",
          "src/glm5serve/config.py",
          (("indexer_rope_interleave=True,", "indexer_rope_interleave=False,"),),
          (P + "test_bug_classes.py::test_class12_vllm_indexer_and_mla_rope_are_interleaved",)),
    Fault("neox-rope-reference", "12", "the reference's DSA indexer rotates half-split (NEOX) pairs",
          "src/glm5serve/reference.py",
          (("apply_rope_interleaved(q[..., :r], cos, sin)",
            "apply_rope_interleaved(q[..., :r].unflatten(-1, (2, r // 2)).transpose(-1, -2).flatten(-2), cos, sin)"),
           ("apply_rope_interleaved(k[:, :r], cos, sin)",
            "apply_rope_interleaved(k[:, :r].unflatten(-1, (2, r // 2)).transpose(-1, -2).flatten(-2), cos, sin)")),
          (U + "test_reference.py::test_logits_match_transformers",
           U + "test_reference.py::test_hidden_states_match_transformers_layer_by_layer")),
    Fault("scaling-twice", "11", "the reference multiplies the routed output by routed_scaling_factor again",
          "src/glm5serve/reference.py",
          (("return self.routed_experts(i, x) + shared",
            "return self.routed_experts(i, x) * self.routed_scaling_factor + shared"),),
          (U + "test_reference.py::test_logits_match_transformers",
           P + "test_bug_classes.py::test_class11_14_vllm_moe_layer_equals_reference")),
    Fault("scaling-never-config", "11", "the config ignores expert_weights_scale (vLLM and reference scale by 1)",
          "src/glm5serve/config.py",
          (('routed_scaling_factor=opt("expert_weights_scale", 1.0, float),', "routed_scaling_factor=1.0,"),),
          (P + "test_bug_classes.py::test_class11_vllm_routed_output_scales_linearly_with_routed_scaling_factor",)),
    Fault("bias-in-weights", "11/14", "the reference weights experts by sigmoid + e_score_correction_bias",
          "src/glm5serve/reference.py",
          (("weights = scores.gather(1, ids)", "weights = choice.gather(1, ids)"),),
          (U + "test_reference.py::test_logits_match_transformers",
           P + "test_bug_classes.py::test_class11_14_vllm_moe_layer_equals_reference")),
    Fault("softmax-gating-reference", "14", "the reference router scores experts with softmax",
          "src/glm5serve/reference.py",
          (('scores = logits.softmax(-1) if self.scoring_func == "softmax" else logits.sigmoid()',
            "scores = logits.softmax(dim=-1)"),),
          (U + "test_reference.py::test_logits_match_transformers",
           P + "test_bug_classes.py::test_class11_14_vllm_moe_layer_equals_reference")),
    Fault("softmax-gating-vllm", "14", "the config tells vLLM to score experts with softmax",
          "src/glm5serve/config.py",
          (('scoring_func="sigmoid" if gating == GATING_SIGMOID else "softmax",', 'scoring_func="softmax",'),),
          # the reference follows the config's scoring_func (softmax files): both tests check it against the key
          (P + "test_bug_classes.py::test_class11_14_vllm_moe_layer_equals_reference",
           U + "test_config_schema.py::test_config_from_metadata_gives_the_preset_dimensions")),
    Fault("k_b-no-transpose", "5", "kv_b_proj re-fused with attn_k_b reshaped instead of transposed",
          "src/glm5serve/schema.py",
          (("torch.cat([k_b.transpose(1, 2), v_b], dim=1)", "torch.cat([k_b.reshape(h, nope, kvl), v_b], dim=1)"),),
          (U + "test_config_schema.py::test_split_kv_b_matches_the_converter_and_merge_inverts_it",
           U + "test_vllm_load.py::test_tiny_ud_q4_k_xl_every_parameter_every_rank")),
    # extra faults, one per class the new properties cover, to show each of them is sharp
    Fault("norm-eps-config", "14", "the config uses 1e-6 for every RMSNorm instead of the GGUF's epsilon",
          "src/glm5serve/config.py",
          (('rms_norm_eps=req("attention.layer_norm_rms_epsilon", float),', "rms_norm_eps=1e-6,"),),
          (P + "test_bug_classes.py::test_class14_vllm_norms_use_the_gguf_epsilons",)),
    Fault("substring-rename", "6", "glm5serve's fix for vllm-gguf-plugin PR#131 is not installed",
          "src/glm5serve/vllm_plugin/fixes.py",
          (("fixed = iterator if getattr(iterator, _MARK, False) else _mark(_suffix_only_names(iterator))",
            "fixed = iterator"),),
          (P + "test_bug_classes.py::test_class6_plugin_renames_only_the_weight_suffix",)),
    Fault("tp-cuts-blocks", "3", "the TP check forgets that a row-parallel share must be whole quant blocks",
          "src/glm5serve/verify.py",
          (("(t.shape[-1] % tp or (t.shape[-1] // tp) % block)", "(t.shape[-1] % tp)"),),
          (P + "test_tp_recombination.py::test_tp_that_cuts_a_quant_block_is_refused",)),
    # found by a mutation audit: each fault went through the suite until the test named with it was added
    Fault("sample-times-temperature", "sampling", "the reference samples from softmax(logits * temperature)",
          "src/glm5serve/reference.py",
          (("torch.softmax(logits / temperature, dim=-1)", "torch.softmax(logits * temperature, dim=-1)"),),
          (U + "test_reference.py::test_sampling_draws_from_softmax_of_logits_over_temperature",)),
    Fault("rope-base-default", "config default",
          "the config reads a missing rope.freq_base as 1e6, not llama.cpp's 10000",
          "src/glm5serve/config.py",
          (('opt("rope.freq_base", 10000.0, float)', 'opt("rope.freq_base", 1000000.0, float)'),),
          (U + "test_llamacpp_oracle.py::test_missing_rope_freq_base_is_read_as_llamacpp_reads_it",)),
    Fault("unpadded-offsets", "gguf",
          "the GGUF reader expects each tensor where the previous one's unpadded data ends",
          "src/glm5serve/gguf_file.py",
          (("expected, previous = expected + -(-n_bytes // align) * align, tensor",
            "expected, previous = expected + n_bytes, tensor"),),
          (U + "test_bad_input.py::test_custom_alignment_is_read",)),
    Fault("mixed-shards-quantized", "fused shards",
          "a stacked module is built dense only when all its shards are float",
          "src/glm5serve/vllm_plugin/weights.py",
          (("any(gguf[ld.sources[0]].qtype in FLOAT_TYPES for ld in members)",
            "all(gguf[ld.sources[0]].qtype in FLOAT_TYPES for ld in members)"),),
          (U + "test_vllm_load.py::test_stacked_module_with_one_float_shard_loads_dense",)),
    Fault("indexer-head-bf16", "numerics", "the bf16 reference rounds indexer.weights_proj to bf16 (transformers keeps "
          "it fp32)", "src/glm5serve/reference.py",
          (('FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")',
            'FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")'),),
          (U + "test_reference_gguf.py::test_bf16_load_is_close_to_fp32",)),
    Fault("expert-groups-w13-only", "int32", "the MoE int32 fix sizes its expert groups by w13's span alone",
          "src/glm5serve/vllm_plugin/fixes.py",
          (("n_experts, step = w1.shape[0], max(w1.stride(0), w2.stride(0))",
            "n_experts, step = w1.shape[0], w1.stride(0)"),),
          (U + "test_vllm_faults.py::test_moe_expert_groups_are_sized_by_the_wider_expert_tensor",)),
    Fault("sparse-mla-ignores-kv-len", "sparse attention",
          "the Triton MLA decode attends to sparse positions past the token's kv_len",
          "src/glm5serve/mla/triton_mla.py",
          (("            if HAS_KVLEN:\n                valid = valid & (pos < kv_len)\n", ""),),
          (U + "test_mla_interpret.py::test_mla_kernels_under_triton_interpreter",)),
    Fault("softmax-gating-ignored", "14", "the reference routes with sigmoid whatever expert_gating_func says",
          "src/glm5serve/reference.py",
          (('scores = logits.softmax(-1) if self.scoring_func == "softmax" else logits.sigmoid()',
            "scores = logits.sigmoid()"),),
          (U + "test_llamacpp_oracle.py::test_softmax_gating_is_run_as_llamacpp_runs_it",
           P + "test_bug_classes.py::test_class14_vllm_softmax_gated_moe_layer_equals_reference")),
    # a second mutation audit (GGUF reading, verify, the vLLM adapter, split rows, the quantizer)
    Fault("last-shard-refused", "split shards", "a split set cannot be opened by its last shard (shard n of n)",
          "src/glm5serve/gguf_file.py",
          (('if not 1 <= int(m["no"]) <= count:', 'if not 1 <= int(m["no"]) < count:'),),
          (U + "test_checkpoint.py::test_split_set_holds_the_same_tensors",)),
    Fault("split-count-ignored-for-one-file", "split shards",
          "a lone file whose split.count says 3 (a renamed shard 1) is opened as a whole model",
          "src/glm5serve/gguf_file.py",
          (("if declared != count and not (declared in (0, 1) and count == 1):",
            "if count > 1 and declared != count:"),),
          (U + "test_bad_input.py::test_a_renamed_shard_is_not_read_as_a_whole_model",)),
    Fault("bf16-nan-is-finite", "numerics", "verify's finite check takes a BF16 NaN (mantissa not 0) for finite",
          "src/glm5serve/verify.py",
          (("bad = (words & 0x7F80) == 0x7F80", "bad = (words & 0x7FFF) == 0x7F80"),),
          (U + "test_verify.py::test_bf16_nan_and_inf_are_not_finite",)),
    Fault("config-check-skips-indexer-dim", "name map", "the adapter accepts a config whose index_head_dim differs "
          "from the GGUF's", "src/glm5serve/vllm_plugin/weights.py",
          (('"index_head_dim", "n_routed_experts",', '"n_routed_experts",'),),
          (U + "test_vllm_load.py::test_a_config_that_disagrees_with_the_gguf_on_a_tensor_shape_is_refused",)),
    Fault("split-rows-whole-row-k", "TP slicing", "split rows of a row-parallel rank's share are regrouped as "
          "rows of the whole input_size", "src/glm5serve/kernels/vllm_ops.py",
          (('getattr(layer, "input_size_per_partition", None) or getattr(layer, "input_size", None))',
            'getattr(layer, "input_size", None) or getattr(layer, "input_size_per_partition", None))'),),
          (U + "test_split_rows.py::test_split_linear_weights_uses_the_rows_this_rank_holds",)),
    Fault("q6k-tiny-block-codes", "quant bytes", "Q6_K keeps the codes of a block whose scale is below "
          "GROUP_MAX_EPS (ggml zeroes it)", "src/glm5serve/quantize.py",
          (("    out[zero] = 0\n    return out", "    return out"),),
          (U + "test_quantize.py::test_tiny_blocks_are_byte_identical_to_ggml",)),
    # a third mutation audit (RoPE-scaling refusals, the zero-matrix refusal, serve's --config, bench's defaults)
    Fault("longrope-unknown", "config", "rope.scaling.type longrope (a type llama.cpp knows) is refused as unknown",
          "src/glm5serve/config.py",
          (('ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")',
            'ROPE_SCALING_TYPES = ("none", "linear", "yarn")'),),
          (U + "test_config_schema.py::test_rope_scaling_by_one_is_plain_rope",
           U + "test_checkpoint.py::test_rope_keys_are_refused_exactly_where_llama_cpp_applies_them")),
    Fault("reference-zero-vector-refused", "bad input", "the reference refuses an all-zero bias as it does a matrix",
          "src/glm5serve/reference.py",
          (("if (why := zero_refused(p, t.shape)) and not bool(t.any()):",
            'if (why := zero_refused(p, t.shape) or "is zero") and not bool(t.any()):'),),
          (U + "test_reference_gguf.py::test_a_zero_bias_loads_and_a_zero_matrix_is_refused",)),
    Fault("split-tensors-count-0-missing", "split shards", "a split.tensors.count of 0 is said to be missing",
          "src/glm5serve/gguf_file.py",
          (("if self.metadata.get(SPLIT_TENSORS) is None:", "if not self.metadata.get(SPLIT_TENSORS):"),),
          (U + "test_bad_input.py::test_a_split_set_without_its_tensor_count",)),
    Fault("serve-source-ignores-equals", "CLI", "serve names the --config file for a size given as --name=V",
          "src/glm5serve/vllm_plugin/serve.py",
          (('return None if any(_vllm_spelling(a).partition("=")[0] in names for a in vllm_args) else config',
            "return None if any(_vllm_spelling(a) in names for a in vllm_args) else config"),),
          (U + "test_vllm_serve.py::test_options_in_a_config_file_are_read_as_vllm_reads_them",)),
    Fault("bench-len-sum-at-default-refused", "CLI", "bench refuses --input-len + --output-len equal to the default "
          "--max-model-len", "src/glm5serve/bench.py",
          (("if args.input_len + args.output_len > max_model_len:",
            "if args.input_len + args.output_len >= max_model_len:"),),
          (U + "test_bench_command.py::test_bench_max_model_len_defaults_to_what_the_gguf_holds",)),
    Fault("bench-duplicate-key-order", "CLI", "bench --projection compares records in their files' key order",
          "src/glm5serve/bench.py",
          (("same = json.dumps(rec, sort_keys=True)", "same = json.dumps(rec)"),),
          (U + "test_bench_command.py::test_projection_refuses_records_that_do_not_belong_together",)),
    Fault("verify-zero-bf16-sign", "bad input", "verify passes a BF16 weight matrix of -0.0 (words 0x8000), which "
          "the reference refuses as zero", "src/glm5serve/verify.py",
          (("nonzero = bool((words & 0x7FFF).any())", "nonzero = bool(words.any())"),),
          (U + "test_verify.py::test_a_bf16_matrix_of_negative_zeros_fails",)),
    Fault("verify-zero-block-bytes", "bad input", "verify passes blocks whose scales are 0 but codes are not (zero "
          "values, refused by the reference): it reads bytes", "src/glm5serve/verify.py",
          (("bool(values.any())", "bool(rows.any())"),),
          (U + "test_verify.py::test_blocks_whose_values_are_zero_fail_though_their_bytes_are_not",)),
    Fault("gguf-array-guard-header-bytes", "gguf", "the metadata-array size guard counts 4 bytes, not 12, before the "
          "array's values: an array 8 bytes past the end of the file is read", "src/glm5serve/gguf_file.py",
          (("left = max(len(self.data) - orig_offs - 12, 0)", "left = max(len(self.data) - orig_offs - 4, 0)"),),
          (U + "test_bad_input.py::test_a_metadata_array_that_ends_on_the_end_of_the_file_is_read_and_one_value_more_"
               "is_refused",)),
    Fault("serve-config-abbrev-list", "CLI", "serve's --config check leaves --pipeline-parallel-size out: its "
          "abbreviation in a config file is refused later, naming no file", "src/glm5serve/vllm_plugin/serve.py",
          (('_READ_OPTIONS = ("--tensor-parallel-size", "--pipeline-parallel-size", "--max-model-len",',
            '_READ_OPTIONS = ("--tensor-parallel-size", "--max-model-len",'),),
          (U + "test_vllm_serve.py::test_options_in_a_config_file_are_read_as_vllm_reads_them",)),
    Fault("one-line-unicode-breaks", "bad input", "errors.one_line leaves \\x85, \\u2028 and \\u2029 raw: a name "
          "holding one splits the one error line", "src/glm5serve/errors.py",
          ((r'_CONTROL = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]")',
            r'_CONTROL = re.compile(r"[\x00-\x1f\x7f]")'),),
          (U + "test_bad_input.py::test_one_line_escapes_every_character_a_line_breaks_at_and_keeps_the_rest",)),
    Fault("bench-projection-model-with-json-only", "CLI", "bench MODEL --projection is refused only with --json: "
          "without it the projection prints as if MODEL were measured", "src/glm5serve/bench.py",
          (("if args.model is not None:  # it was ignored",
            "if args.model is not None and args.json:  # it was ignored"),),
          (U + "test_bench_command.py::test_projection_refuses_a_model_it_would_not_measure",)),
)

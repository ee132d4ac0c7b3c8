"""Which tests run which cell of ``sp_jax.compat``'s table: ``COVERED``, rows ``(modes,
features, pytest node id)``: the test runs these features together in these modes, so
every pair of them (and each alone) is supported there.

``sp_jax.compat.load_coverage()`` reads this file into the table (``python -m
sp_jax.compat`` does, from a checkout; tests/test_compat.py checks that every node id
exists and that no row runs a refused cell). Plain data: the rows written here, then
those of the covering array's cases that passed, as ``make test-combinations`` recorded
them in tests/combinations/ran.json (tests/combinations/recording.py; one row a case:
its mode, its combination's features, its node id). It imports only json and pathlib.
"""

import json
from pathlib import Path

# (modes, features, test node id): the test runs these features together in these modes,
# so every pair of them (and each alone) is supported there.
_GPT = "tests/test_gpt.py::test_sp_gpt_trains_like_unsharded"
_CONTEXT = "tests/test_context.py::test_gpt_with_a_context_axis_trains_like_unsharded"
_FSDP = "tests/test_fsdp.py::test_fsdp_trains_like_unsharded"
_PIPE = "tests/test_pipeline.py::test_pipeline_trains_like_unsharded"
_PIPE_DOCS = "tests/test_pipeline_packed.py::test_pipeline_trains_packed_rows_like_unsharded"
_PIPE_EVAL = ("tests/test_pipeline_forward.py::"
              "test_pipelined_logits_and_hidden_states_equal_unpipelined")
_MOE = "tests/test_moe.py::test_dropless_experts_train_like_the_reference_loop"
_MOE_CAPACITY = "tests/test_moe.py::test_capacity_drops_the_same_pairs_on_every_mesh"
_MOE_PIPE = "tests/test_moe.py::test_experts_in_pipeline_stages_train_like_the_reference_loop"
_FP8_PIPE = "tests/test_fp8.py::test_pipelined_fp8_first_step_equals_unpipelined"
_FP8 = "tests/test_fp8.py::test_sharded_fp8_gpt_first_step_equals_unsharded"
_FP8_LAYER = "tests/test_fp8.py::test_layer_equals_numpy_fp8_reference"
_FP8_EXPERTS = "tests/test_fp8_experts.py::test_sharded_fp8_experts_first_step_equals_unsharded"
_PACKED = "tests/test_packed.py::test_packed_batch_equals_its_documents_one_by_one"
_HF = "tests/test_hf.py::test_golden_logits_loss_and_gradients"
_HF_MOE = "tests/test_hf.py::test_golden_moe_logits_losses_and_gradients"
_GENERATE = "tests/test_generate.py::test_greedy_equals_transformers"
_COMPAT = "tests/test_compat.py::test_combination_equals_unsharded"
_COMPAT_PIPE = "tests/test_compat.py::test_pipelined_combination_equals_unsharded"
_COMPAT_GEN = ("tests/test_compat.py::"
               "test_generation_with_features_reads_its_cache_like_a_full_forward")
_GEN_CONTEXT = "tests/test_generate_sharded.py::test_greedy_on_a_context_axis_equals_transformers"
_GEN_PIPE = "tests/test_generate_sharded.py::test_pipelined_model_generates_the_unpipelined_tokens"
_TS, _CM, _RA = "tensor_sequence", "collective_matmul", "recompute_allgather"
_RING, _ULYSSES, _DOCS = "context_ring", "context_ulysses", "packed_documents"
_EXPERTS, _WINDOW, _DROP = ("experts", "expert_parallel"), "sliding_window", "attention_dropout"
_TRAIN, _EVAL, _GEN = ("train",), ("eval",), ("generate",)
_SCAN, _UNROLLED = "scan_layers", "unrolled_layers"
_LAYER_WINDOWS = "layer_windows"
_LW = "tests/test_layer_windows.py::test_layer_windows_"
_CAP = "attention_softcap"
_CAP_GPT = ("tests/test_attention_softcap.py::test_gpt_with_scale_and_softcap_sharded_equals_"
            "one_device")
_ZERO1, _PRECISION = "tests/test_zero1.py::test_zero1_", "tests/test_optimizer_precision.py::"
_OFFLOAD = "tests/test_offload_optimizer.py::test_offload_"
_OFFLOAD_ACT = "tests/test_offload_activations.py::test_offload_trains_bitwise_like_no_offload"
_CAP_KERNELS = ("tests/test_attention_softcap.py::test_ring_and_ulysses_scale_and_softcap_match_"
                "the_dense_reference")
_DENSE, _DENSE_TEST = "dense_layers", "tests/test_dense_layers.py::test_"
_DENSE_PIPE = f"{_DENSE_TEST}pipeline_stages_of_two_kinds_equal_the_unpipelined_model"
_ROWS: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
    (_TRAIN, (_TS, "zero1"), f"{_ZERO1}trains_like_replicated_on_data_x_tensor"),
    (_TRAIN, (_TS, "zero1", _RING),
     f"{_ZERO1}with_a_context_axis_and_dropout_trains_like_replicated"),
    (_TRAIN, (_TS, "zero1", "pipeline_1f1b"),
     f"{_ZERO1}with_pipeline_stages_trains_like_replicated"),
    (_TRAIN, (_TS, "zero1", *_EXPERTS), f"{_ZERO1}with_experts_trains_like_replicated"),
    (_TRAIN, (_TS, "grad_reduce_dtype"),
     f"{_PRECISION}test_grad_reduce_bf16_is_the_bf16_sum_of_per_shard_fp32_gradients"),
    (_TRAIN, (_TS, "grad_reduce_dtype", "pipeline_gpipe"),
     f"{_PRECISION}test_grad_reduce_bf16_in_a_pipeline[gpipe-False]"),
    (_TRAIN, (_TS, "grad_reduce_dtype", "pipeline_1f1b", "fsdp"),
     f"{_PRECISION}test_grad_reduce_bf16_in_a_pipeline[1f1b-True]"),
    (_TRAIN, (_TS, "offload_optimizer", _SCAN),
     f"{_OFFLOAD}is_bitwise_the_step_without[optimizer-scan]"),
    (_TRAIN, (_TS, "offload_optimizer", _UNROLLED),
     f"{_OFFLOAD}is_bitwise_the_step_without[optimizer-unrolled]"),
    (_TRAIN, (_TS, "offload_optimizer", "pipeline_gpipe"),
     f"{_OFFLOAD}in_pipeline_stages_is_bitwise"),
    (_TRAIN, (_TS, _RA, "offload_activations"), f"{_OFFLOAD_ACT}[2x4_recompute]"),
    (_TRAIN, (_TS, "offload_activations", _RING), f"{_OFFLOAD_ACT}[2x2x2_ring]"),
    (_TRAIN, (_TS, "offload_activations", "pipeline_gpipe"),
     f"{_OFFLOAD_ACT}[2x2x1x2_gpipe_scan]"),
    (_TRAIN, (_TS, "offload_activations", "pipeline_1f1b"),
     f"{_OFFLOAD_ACT}[2x2x1x2_1f1b_remat]"),
    (_TRAIN, (_TS, _CM, _RA, _UNROLLED), f"{_GPT}[fp32]"),
    (_TRAIN, (_TS, _RA, _DROP, _SCAN), f"{_GPT}[scan_remat_dropout]"),
    (_TRAIN, (_TS, _CM, "fsdp", _SCAN), f"{_GPT}[collective_matmul_scan_untied_50]"),
    (_TRAIN, (_TS, "fsdp", _RA), f"{_FSDP}[4x2_micro_recompute_dropout]"),
    (_TRAIN, (_TS, "fsdp", _RING),
     "tests/test_fsdp.py::test_fsdp_with_a_context_axis_trains_like_unsharded"),
    (_TRAIN, (_TS, _RING, _RA), f"{_CONTEXT}[ring_2x2x2_rotary_mqa_recompute]"),
    (_TRAIN, (_TS, _ULYSSES), f"{_CONTEXT}[ulysses_2x2x2_gqa]"),
    (_TRAIN, (_TS, _ULYSSES, _DROP), f"{_CONTEXT}[ulysses_1x4x2_dropout]"),
    (_TRAIN, (_RING, _DROP), f"{_CONTEXT}[ring_1x8x1_dropout]"),
    (_TRAIN, (_TS, "pipeline_1f1b"), f"{_PIPE}[2x1x1x4_1f1b_r1_m4]"),
    (_TRAIN, (_TS, "pipeline_gpipe", _RA, _CM), f"{_PIPE}[2x1x1x4_gpipe_r2_m4_recompute_cm]"),
    (_TRAIN, ("pipeline_1f1b", "fsdp"), f"{_PIPE}[4x2x1x1_1f1b_r1_m8_fsdp]"),
    (_TRAIN, (_TS, "pipeline_1f1b", _DROP), f"{_PIPE}[2x2x1x2_1f1b_r2_m8_dropout]"),
    (_TRAIN, (_TS, "pipeline_1f1b", _RING), f"{_PIPE}[2x1x2x2_ring_1f1b_r2_m4]"),
    (_TRAIN, (_TS, "pipeline_gpipe", _RING), f"{_PIPE}[2x1x2x2_ring_gpipe_r1_m8]"),
    (_TRAIN, (_TS, "pipeline_1f1b", _RING, "mla_attention"),
     f"{_PIPE}[2x1x2x2_ring_mla_1f1b_r2_m4]"),
    (_TRAIN, (_TS, "pipeline_gpipe", "mla_attention"), f"{_PIPE}[2x2x1x2_mla_gpipe_r1_m4_remat]"),
    (_TRAIN, (_TS, "pipeline_1f1b", "experts", "dense_layers", "sigmoid_routing",
              "aux_free_bias"),
     "tests/test_routing.py::test_pipeline_stages_train_with_the_bias_update[1f1b]"),
    (_TRAIN, (_TS, "pipeline_gpipe", "experts", "dense_layers", "sigmoid_routing",
              "aux_free_bias"),
     "tests/test_routing.py::test_pipeline_stages_train_with_the_bias_update[gpipe]"),
    (_TRAIN, (_TS, "pipeline_1f1b", _DOCS), f"{_PIPE_DOCS}[2x2x1x2_1f1b_r1_m4_learned]"),
    (_TRAIN, (_TS, "pipeline_1f1b", _DOCS, _RING),
     f"{_PIPE_DOCS}[2x1x2x2_ring_1f1b_r2_m4_rotary]"),
    (_TRAIN, (_TS, "pipeline_gpipe", _DOCS, _RING),
     f"{_PIPE_DOCS}[2x1x2x2_ring_gpipe_r1_m4_learned]"),
    (_TRAIN, (_TS, "pipeline_gpipe", _DOCS, _ULYSSES),
     f"{_PIPE_DOCS}[2x1x2x2_ulysses_gpipe_r2_m4_rotary]"),
    (_TRAIN, ("pipeline_1f1b", _DOCS, _ULYSSES, "fsdp"),
     f"{_PIPE_DOCS}[2x2x2x1_ulysses_1f1b_r1_m2_learned_fsdp]"),
    (_EVAL, (_TS, "pipeline_gpipe"), f"{_PIPE_EVAL}[2x2x1x2_gpipe_r1_m2]"),
    (_EVAL, (_TS, "pipeline_1f1b", _DOCS), f"{_PIPE_EVAL}[2x2x1x2_1f1b_r2_m2_packed]"),
    (_EVAL, (_TS, "pipeline_gpipe", _DROP),
     f"{_PIPE_EVAL}[4x1x1x2_gpipe_r1_m4_dropout_untied]"),
    (_EVAL, (_TS, "pipeline_1f1b", _DOCS, _RING),
     f"{_PIPE_EVAL}[2x1x2x2_ring_1f1b_r2_m2_packed_rotary]"),
    (_EVAL, ("pipeline_gpipe", _DOCS, _ULYSSES, "fsdp"),
     f"{_PIPE_EVAL}[2x2x2x1_ulysses_gpipe_r1_m4_packed_fsdp]"),
    (_EVAL, (_TS, "experts", "pipeline_gpipe"), f"{_PIPE_EVAL}[2x1x1x2_gpipe_r1_m2_experts]"),
    (_EVAL, (_TS, "pipeline_1f1b", _DOCS, "experts"),
     f"{_PIPE_EVAL}[2x2x1x2_1f1b_r1_m2_packed_experts]"),
    (_TRAIN, (_TS, *_EXPERTS, "fsdp", _RA), _MOE),
    (_TRAIN, (_TS, *_EXPERTS, _RING), _MOE),
    (_TRAIN, (_TS, *_EXPERTS, _ULYSSES), f"{_MOE_CAPACITY}[expert2_ulysses2_tensor2]"),
    (_TRAIN, (_TS, *_EXPERTS, "pipeline_1f1b"), f"{_MOE_PIPE}[2x1x2x1x2_1f1b_r1]"),
    (_TRAIN, (_TS, *_EXPERTS, "pipeline_gpipe"), f"{_MOE_PIPE}[2x1x2x1x2_gpipe_r1]"),
    (_TRAIN, (_TS, *_EXPERTS, "pipeline_gpipe", "fsdp"),
     f"{_MOE_PIPE}[2x2x2x1x1_gpipe_r2_fsdp]"),
    (_TRAIN, (_TS, *_EXPERTS, "pipeline_1f1b", _RING), f"{_MOE_PIPE}[2x1x2x2x1_ring_1f1b_r1]"),
    (("train", "eval"), (_TS, *_EXPERTS), f"{_HF_MOE}[mixtral]"),
    (_TRAIN, (_TS, "fp8_current"), f"{_FP8}[2x4-current]"),
    (_TRAIN, (_TS, "fp8_current", "fsdp"), f"{_FP8}[2x4_fsdp-current]"),
    (_TRAIN, (_TS, "fp8_current", _RING), f"{_FP8}[1x2x4_ring-current]"),
    (_TRAIN, (_TS, "fp8_delayed"), f"{_FP8}[2x4-delayed]"),
    (_TRAIN, (_TS, "fp8_current", "pipeline_1f1b"), f"{_FP8_PIPE}[2x2x1x2_1f1b_r1-current]"),
    (_TRAIN, (_TS, "fp8_delayed", "pipeline_1f1b"), f"{_FP8_PIPE}[2x2x1x2_1f1b_r1-delayed]"),
    (_TRAIN, (_TS, "fp8_current", "pipeline_gpipe"), f"{_FP8_PIPE}[2x2x1x2_gpipe_r2-current]"),
    (_TRAIN, (_TS, "fp8_delayed", "pipeline_gpipe"), f"{_FP8_PIPE}[2x2x1x2_gpipe_r2-delayed]"),
    (_TRAIN, (_TS, "fp8_current", "pipeline_1f1b", _RING),
     f"{_FP8_PIPE}[2x1x2x2_ring_1f1b_r2-current]"),
    (_TRAIN, (_TS, "fp8_delayed", "pipeline_1f1b", _RING),
     f"{_FP8_PIPE}[2x1x2x2_ring_1f1b_r2-delayed]"),
    (_TRAIN, (_TS, "fp8_current", _CM, _RA), f"{_FP8_LAYER}[column_sp-2x4_cm_recompute-current]"),
    (_TRAIN, (_TS, "fp8_delayed", _CM, _RA), f"{_FP8_LAYER}[column_sp-2x4_cm_recompute-delayed]"),
    (_TRAIN, (_TS, "fp8_delayed", "fsdp"), f"{_FP8_LAYER}[column_sp-2x4_fsdp-delayed]"),
    (_TRAIN, (_TS, "fp8_delayed", _RING), f"{_FP8_LAYER}[column_sp-1x2x4_ring-delayed]"),
    (_TRAIN, (_TS, *_EXPERTS, "fp8_current"), f"{_FP8_EXPERTS}[current-data2_expert2_tensor2]"),
    (_TRAIN, (_TS, *_EXPERTS, "fp8_delayed"), f"{_FP8_EXPERTS}[delayed-data2_expert2_tensor2]"),
    (_TRAIN, (_TS, *_EXPERTS, "fp8_current", "fsdp"),
     f"{_FP8_EXPERTS}[current-data2_expert2_tensor2_scan_fsdp]"),
    (_TRAIN, (_TS, *_EXPERTS, "fp8_delayed", "fsdp"),
     f"{_FP8_EXPERTS}[delayed-data2_expert2_tensor2_scan_fsdp]"),
    (_TRAIN, (_TS, *_EXPERTS, "fp8_current", "pipeline_1f1b"),
     f"{_FP8_EXPERTS}[current-stage2_expert2_tensor2_1f1b]"),
    (_TRAIN, (_TS, *_EXPERTS, "fp8_delayed", "pipeline_1f1b"),
     f"{_FP8_EXPERTS}[delayed-stage2_expert2_tensor2_1f1b]"),
    (_TRAIN, (_TS, _DOCS), f"{_PACKED}[2x4_learned]"),
    (_TRAIN, (_TS, _DOCS, "fsdp"), f"{_PACKED}[2x4_rotary_gqa_fsdp]"),
    (_TRAIN, (_TS, _DOCS, _RING), f"{_PACKED}[ring_zigzag_1x2x4_rotary]"),
    (_TRAIN, (_TS, _DOCS, _ULYSSES, _SCAN), f"{_PACKED}[ulysses_1x4x2_scan_remat]"),
    (_TRAIN, (_DOCS, _WINDOW),
     "tests/test_attention.py::test_sliding_window_matches_dense_reference[24-8-4-13-None-True]"),
    (("train", "eval"), (_TS, _WINDOW), f"{_HF}[mistral]"),
    (_TRAIN, (_TS, _RING, _WINDOW), f"{_CONTEXT}[ring_2x2x2_window_rotary_gqa]"),
    (_TRAIN, (_TS, _RING, _WINDOW, _DROP), f"{_CONTEXT}[ring_1x4x2_window_dropout]"),
    (_TRAIN, (_RING, _WINDOW),
     "tests/test_attention.py::test_ring_sliding_window_matches_dense_reference[5]"),
    (("train", "eval"), (_TS, _RING, _WINDOW),
     "tests/test_hf.py::test_mistral_on_a_ring_mesh_gives_golden_logits_and_gradients[1x2x4]"),
    (_EVAL, (_TS,), "tests/test_gpt.py::test_logits_layout_and_padding"),
    (_EVAL, (_TS, _RING),
     "tests/test_context.py::test_logits_and_hidden_states_come_back_in_the_input_order"),
    (_EVAL, (_WINDOW, _ULYSSES),
     "tests/test_attention.py::test_sliding_window_errors_and_context_parallel"),
    (_GEN, (_TS,), f"{_GENERATE}[gpt2-2x4]"),
    (_GEN, (_TS, "fsdp"),
     "tests/test_generate.py::test_cache_gives_the_logits_of_a_full_forward[mqa_fsdp]"),
    (_GEN, (_TS, _WINDOW), f"{_GENERATE}_new_families[mistral]"),
    (_GEN, (_TS, *_EXPERTS), "tests/test_generate.py::test_greedy_with_experts_equals_"
     "transformers[mixtral-2x2x1x2]"),
    (_GEN, (_TS, *_EXPERTS, _SCAN),
     "tests/test_generate.py::test_cache_with_experts_gives_the_logits_of_a_full_forward"
     "[scan_2x2x1x2]"),
    (_GEN, (_TS, *_EXPERTS, "interleaved_experts", _UNROLLED),
     "tests/test_generate.py::test_cache_with_experts_gives_the_logits_of_a_full_forward"
     "[shared_1x4x1x2]"),
    (_GEN, (_TS, _RING), f"{_GEN_CONTEXT}[llama-ring-1x2x2]"),
    (_GEN, (_TS, _ULYSSES), f"{_GEN_CONTEXT}[llama-ulysses-2x2x1]"),
    (_GEN, (_TS, _ULYSSES, _WINDOW), f"{_GEN_CONTEXT}[mistral-ulysses-1x2x1]"),
    (_GEN, (_TS, "pipeline_gpipe"), f"{_GEN_PIPE}[gpipe-r1]"),
    (_GEN, (_TS, "pipeline_1f1b"), f"{_GEN_PIPE}[1f1b-r2]"),
    (_GEN, (_TS, "pipeline_1f1b", *_EXPERTS), f"{_GEN_PIPE}[1f1b-r1-experts]"),
    (_GEN, (_TS, _CM, _RA, "fsdp", _WINDOW, _DROP, _UNROLLED),
     f"{_COMPAT_GEN}[2x4_cm_fsdp_window_dropout]"),
    (_GEN, (_TS, *_EXPERTS, _RING, _UNROLLED), f"{_COMPAT_GEN}[1x2x2x2_experts_ring]"),
    (_GEN, (_TS, _RING, _WINDOW, _UNROLLED), f"{_COMPAT_GEN}[1x2x4_ring_window]"),
    # tests/test_compat.py: one model with several features, train and eval, against the
    # same model unsharded
    (("train", "eval"), (_TS, _CM, _RA, "fsdp", _WINDOW, _DOCS, _UNROLLED),
     f"{_COMPAT}[2x4_cm_fsdp]"),
    (("train", "eval"), (_TS, _ULYSSES, _CM, _RA, "fsdp", _WINDOW, _DOCS, _UNROLLED),
     f"{_COMPAT}[2x2x2_ulysses_cm_fsdp]"),
    (("train", "eval"), (_TS, _RING, _CM, _RA, _DOCS, "fp8_current", _UNROLLED),
     f"{_COMPAT}[1x2x4_ring_cm_fp8]"),
    (("train", "eval"), (_TS, *_EXPERTS, "fsdp", _CM, _RA, _DOCS, _WINDOW, "fp8_delayed",
                        _UNROLLED),
     f"{_COMPAT}[2x2x1x2_experts_fsdp_cm_fp8]"),
    (("train", "eval"), (_TS, _RING, _WINDOW, _DOCS, _UNROLLED), f"{_COMPAT}[1x2x4_ring_window]"),
    # pipelined: logits through the stages (eval), AdamW steps (train), packed rows
    (("train", "eval"), (_TS, "pipeline_1f1b", *_EXPERTS, _DOCS, _WINDOW),
     f"{_COMPAT_PIPE}[2x1x2x1x2_1f1b_experts_window]"),
    (("train", "eval"), (_TS, "pipeline_gpipe", "fp8_delayed", _DOCS, _ULYSSES, _WINDOW),
     f"{_COMPAT_PIPE}[2x1x1x2x2_ulysses_gpipe_fp8_window]"),
    (("train", "eval"), (_TS, "pipeline_gpipe", *_EXPERTS, _RING, _DOCS),
     f"{_COMPAT_PIPE}[2x1x2x2x1_ring_gpipe_experts]"),
    (_TRAIN, (_TS, "custom_loss"), "tests/test_compat.py::test_custom_loss_fn_trains_like_lm_loss"),
    # the attention scores' soft cap: a GPT sharded against one device, generation, and
    # the kernels against a dense reference
    (("train", "eval"), (_TS, _CAP), f"{_CAP_GPT}[2x4]"),
    (("train", "eval"), (_TS, _RING, _CAP), f"{_CAP_GPT}[1x2x4_ring]"),
    (("train", "eval"), (_TS, "pipeline_gpipe", _CAP),
     "tests/test_attention_softcap.py::test_pipelined_gpt_with_scale_and_softcap_equals_one_"
     "device"),
    (_GEN, (_TS, _CAP),
     "tests/test_attention_softcap.py::test_greedy_generation_equals_an_argmax_loop_of_full_"
     "forwards"),
    (_TRAIN, (_RING, _CAP, _WINDOW, _DOCS), f"{_CAP_KERNELS}[ring_c2_traced_window5_documents]"),
    (_TRAIN, (_ULYSSES, _CAP, _DOCS), f"{_CAP_KERNELS}[ulysses_c2_documents]"),
    (_TRAIN, (_ULYSSES, _CAP, _WINDOW), f"{_CAP_KERNELS}[ulysses_c2_window3]"),
    (_TRAIN, (_CAP, _WINDOW, _DOCS), "tests/test_attention_softcap.py::test_blockwise_scale_and_"
     "softcap_match_the_dense_reference[blocks16_traced_window3_documents]"),
    # per-layer windows (the window as data): against static windows, the cache, ring
    # attention and pipeline stages
    (("generate", "eval"), (_TS, _WINDOW, _LAYER_WINDOWS, _SCAN),
     f"{_LW}cache_logits_equal_forward[True]"),
    (("generate", "eval"), (_TS, _WINDOW, _LAYER_WINDOWS, _UNROLLED),
     f"{_LW}cache_logits_equal_forward[False]"),
    (("train", "eval"), (_TS, _RING, _WINDOW, _LAYER_WINDOWS, _SCAN),
     f"{_LW}with_ring_attention[True]"),
    (("train", "eval"), (_TS, _RING, _WINDOW, _LAYER_WINDOWS, _UNROLLED),
     f"{_LW}with_ring_attention[False]"),
    (_TRAIN, (_TS, "pipeline_1f1b", _WINDOW, _LAYER_WINDOWS),
     "tests/test_layer_windows.py::test_pipeline_stages_with_layer_windows_and_head_dim"
     "[windows_2x1x1x4_1f1b_r1_m4]"),
    # dense layers before the experts (GPTConfig(num_dense_layers=k))
    (_TRAIN, (_TS, *_EXPERTS, _DENSE, _SCAN, _RA), f"{_DENSE_TEST}scanned_dense_and_expert_"
     "stacks_equal_the_unrolled_layers"),
    (_TRAIN, (_TS, *_EXPERTS, _DENSE, _UNROLLED), f"{_DENSE_TEST}scanned_dense_and_expert_"
     "stacks_equal_the_unrolled_layers"),
    (_TRAIN, (_TS, *_EXPERTS, _DENSE, _SCAN, "fsdp"),
     f"{_DENSE_TEST}dense_first_experts_train_like_unsharded[1]"),
    (("eval", "generate"), (_TS, *_EXPERTS, _DENSE, _SCAN),
     f"{_DENSE_TEST}greedy_generation_equals_an_argmax_loop_of_forwards"),
    (_TRAIN, (_TS, *_EXPERTS, _DENSE, "pipeline_1f1b", _WINDOW, _LAYER_WINDOWS),
     f"{_DENSE_PIPE}[2x1x2x1x1_1f1b_r1_3-5_dense1_dropout_windows]"),
    (_TRAIN, (_TS, "experts", _DENSE, "pipeline_gpipe"),
     f"{_DENSE_PIPE}[2x2x1x1x2_gpipe_r2_1-3-2-2_dense2]"),
    (_TRAIN, (_TS, *_EXPERTS, _DENSE, "pipeline_1f1b", "fp8_delayed"),
     f"{_DENSE_TEST}deferred_weight_gradients_of_two_kinds_with_fp8_delayed"),
]

# The covering array's cases that passed in the last `make test-combinations`.
_RAN = Path(__file__).resolve().parent / "combinations" / "ran.json"
_CASES = json.loads(_RAN.read_text())["passed"] if _RAN.is_file() else []

# A pipeline's layers are scanned (sp_jax.compat refuses pipeline x unrolled_layers): each
# row written here with pipeline stages runs scan_layers too (a recorded case names every
# feature it runs).
COVERED: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
    *((modes, (*features, _SCAN) if _SCAN not in features and any(
        f.startswith("pipeline_") for f in features) else features, test)
      for modes, features, test in _ROWS),
    *(((case["mode"],), tuple(case["features"]), case["test"]) for case in _CASES)]

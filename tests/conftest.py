"""Test setup: 8 simulated CPU devices, configured before JAX initialises its backend; the
marker for tests that compile for a GPU without one."""

import atexit
import gc
import os
import shutil
import tempfile

os.environ["JAX_PLATFORMS"] = "cpu"
# The scripts' persistent compilation cache (tests/_util.py), one for the whole session:
# made here, in the first process (xdist's controller, before it starts the workers, which
# inherit the variable), and removed when that process exits.
if "SP_JAX_TEST_JIT_CACHE" not in os.environ:
    os.environ["SP_JAX_TEST_JIT_CACHE"] = tempfile.mkdtemp(prefix="sp_jax_test_jit_cache_")
    atexit.register(shutil.rmtree, os.environ["SP_JAX_TEST_JIT_CACHE"], ignore_errors=True)
from sp_jax.xla_flags import apply_xla_flags, cpu_simulation_flags  # noqa: E402

# 8 host devices; cse_barrier_expander off so XLA:CPU keeps recompute's backward
# re-all-gather separate from the forward one (XLA:GPU keeps it without this flag).
# The suite's shapes are tiny and compiling dominates its time: LLVM's optimisation of
# the CPU code is not worth it here (a quarter of the suite's time; HLO passes, and so
# every collective, buffer and schedule the tests check, are unaffected).
#
# XLA:CPU's legacy (non-MLIR) fusion emitters compile the suite's programs about twice
# as fast (measured: a GPT training step 1.7 vs 3.4 s; the pipeline tests 114 vs ~450 s).
# The scripts the tests start get the same compile-speed flags (tests/_util.py).
COMPILE_SPEED_FLAGS = ("--xla_backend_optimization_level=0",
                       "--xla_cpu_use_fusion_emitters=false")
apply_xla_flags([*cpu_simulation_flags(8), *COMPILE_SPEED_FLAGS])

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

assert jax.device_count() == 8, f"expected 8 simulated CPU devices, got {jax.devices()}"

from sp_jax.analysis import cuda_plugin_available  # noqa: E402

HAS_CUDA_PLUGIN = cuda_plugin_available()
requires_cuda_plugin = pytest.mark.skipif(
    not HAS_CUDA_PLUGIN,
    reason="deviceless GPU compiles need the CUDA PJRT plugin: pip install -e '.[gpu-aot]'",
)
"""Marks a test that compiles for a GPU mesh without a GPU (``compile_for_gpu``,
``gpu_mesh``): skipped where the plugin is missing (``make test`` installs it)."""


def make_mesh(data: int, tensor: int, axis_type: AxisType = AxisType.Explicit):
    """A (data, tensor) mesh over the first data*tensor simulated devices."""
    return jax.make_mesh(
        (data, tensor),
        ("data", "tensor"),
        axis_types=(axis_type, axis_type),
        devices=jax.devices()[: data * tensor],
    )


@pytest.fixture(scope="session")
def mesh_2x4():
    return make_mesh(2, 4)


@pytest.fixture(scope="session")
def mesh_2x4_auto():
    return make_mesh(2, 4, AxisType.Auto)


@pytest.fixture(scope="session")
def mesh_8x1():
    return make_mesh(8, 1)


# The slowest test files (measured, `pytest --durations`), longest first: with
# `--dist loadfile --no-loadscope-reorder` (make test) xdist hands files to its workers
# in collection order, so starting with these keeps one long file from running alone at
# the end. Every other file follows in its usual order.
SLOWEST_FIRST = ("test_doc_snippets.py", "test_benchmarks.py", "test_pipeline.py",
                 "test_gpt.py", "test_fp8.py", "test_plan.py", "test_train_gpt.py",
                 "test_fsdp.py", "test_moe.py", "test_faults.py", "test_gpu_check.py",
                 "test_context.py", "test_attention.py", "test_collective_matmul.py",
                 "test_blocks.py", "test_hf.py", "test_analysis.py", "test_multiprocess.py",
                 "test_trainer.py", "test_generate.py", "test_pipeline_hlo.py",
                 "test_packed.py", "test_checkpoint.py")

# The fast tier (`make test-fast`, the inner loop; under 3 minutes on 2 idle cores): the
# unit tests of every floor and one end-to-end test per feature, on small shapes. A file
# maps to None (all of its tests) or to the tests it keeps, by name (every parameter) or
# name[parameters]. Every other test is marked `slow`: `make test` (CI) runs them all.
FAST = {
    "test_config.py": None, "test_ops.py": None, "test_recompute.py": None,
    "test_errors.py": None, "test_schedule.py": None, "test_launch.py": None,
    "test_data.py": None, "test_training_log.py": None, "test_xla_flags.py": None,
    "test_data_text.py": None,
    "test_generate.py": ("test_greedy_equals_transformers[llama-2x4]",
                         "test_filters_equal_a_numpy_reference"),
    "test_packed.py": ("test_packed_batch_equals_its_documents_one_by_one[2x4_learned]",
                       "test_document_labels_drop_targets_across_documents",
                       "test_blocks_of_other_documents_are_skipped",
                       "test_bad_document_arrays_are_refused"),
    "test_checkpoint_faults.py": None,
    # (the full tier adds: batches placed on the mesh by the step; the docs' trainer
    # example, which the doc-snippet tests run too)
    "test_train_step.py": ("test_evaluate_is_the_token_mean_in_eval_mode",
                           "test_device_bytes_and_temp_bytes",
                           "test_a_non_finite_step_changes_nothing"),
    "test_trainer.py": ("test_run_logs_every_step_and_evals",
                        "test_stop_request_checkpoints_and_exits_75",
                        "test_diverged_run_saves_nothing_and_resumes_with_a_lower_lr",
                        "test_debug_nans_stops_with_step",
                        "test_resume_onto_another_mesh_falls_back_from_a_damaged_step",
                        "test_fresh_run_into_a_used_directory_and_resume_without_checkpoint_are_refused",
                        "test_a_log_that_cannot_be_written_or_read_stops_in_one_line",
                        "test_config_names_the_bad_field", "test_config_checks_paths",
                        "test_import_needs_no_tqdm"),
    "test_fp8.py": ("test_round_trip_equals_ml_dtypes_and_saturates",
                    "test_amax_history_rolls_newest_first", "test_fp8_errors",
                    "test_layer_equals_numpy_fp8_reference[column_sp-2x4-current]",
                    "test_layer_equals_numpy_fp8_reference[row_sp-2x4-delayed]",
                    "test_block_gathers_move_fp8_as_traced"),
    "test_layout.py": ("test_named_specs", "test_replicated_batch_and_tuple_data_axes",
                       "test_context_axis_shards_the_sequence_everywhere", "test_errors",
                       "test_layer_parameters_carry_the_layout_specs"),
    "test_layers.py": ("test_layer_matches_nnx_linear[column-explicit_2x4-False]",
                       "test_layer_matches_nnx_linear[row-explicit_2x4-False]",
                       "test_layer_matches_nnx_linear[column_sp-explicit_2x4-True]",
                       "test_layer_matches_nnx_linear[row_sp-explicit_2x4-False]",
                       "test_column_gelu_row_residual_matches_unsharded[explicit_2x4-sp_recompute]",
                       "test_parameters_match_nnx_linear_and_are_sharded",
                       "test_input_with_other_sharding_is_resharded"),
    "test_blocks.py": ("test_embedding_matches_nnx_embed[sp-padded]",
                       "test_parallel_cross_entropy_ignores_padding_columns",
                       "test_norm_param_grads_equal_unsharded[AxisType.Explicit-RMSNorm]",
                       "test_dropout_mask_is_sharding_invariant[AxisType.Explicit]",
                       "test_attention_matches_independent_reference",
                       "test_grouped_query_attention_matches_reference_with_one_all_gather[2]",
                       "test_heads_not_divisible_by_tensor_size",
                       "test_gated_mlp_matches_a_plain_swiglu"),
    "test_attention.py": ("test_blockwise_matches_naive_fp32[30-4-7-blocks2]",
                          "test_blockwise_grouped_query_matches_repeated_kv[2]",
                          "test_blockwise_input_errors", "test_zigzag_order",
                          "test_attention_block_counts_balance",
                          "test_context_parallel_matches_naive[ring-2]",
                          "test_context_parallel_matches_naive[ulysses-2]",
                          "test_ulysses_needs_heads_divisible_by_context",
                          "test_sliding_window_matches_dense_reference[24-8-4-13-None-True]"),
    "test_gpt.py": ("test_sp_gpt_trains_like_unsharded[llama_gqa_kv2_t4_vocab50]",
                    "test_gpt_config_errors", "test_gpt_input_errors"),
    "test_context.py": ("test_errors",),
    "test_fsdp.py": ("test_fsdp_errors", "test_fsdp_trains_like_unsharded[2x4_scan_untied_rotary]"),
    "test_collective_matmul.py": ("test_ring_steps",
                                  "test_column_row_pair_matches_unsharded[2x4_rec]"),
    "test_checkpoint.py": ("test_restore_onto_other_meshes_bitwise[shape1]",
                           "test_other_model_shape_names_parameter_and_shapes",
                           "test_manager_lists_keeps_and_refuses_existing_step",
                           "test_check_metadata_returns_changed_run_settings",
                           "test_missing_orbax_names_the_core_dependency"),
    "test_hf.py": ("test_golden_logits_loss_and_gradients[llama]",
                   "test_round_trip_is_bitwise[llama]", "test_config_translation",
                   "test_config_translation_mistral_qwen2_qwen3",
                   "test_bad_checkpoints_are_named_before_anything_is_placed"),
    "test_faults.py": ("test_divergence_guard", "test_same_settings_is_free_in_one_process",
                       "test_first_signal_requests_a_stop_second_exits_at_once",
                       "test_watchdog_ends_a_stalled_call"),
    "test_analysis.py": ("test_formula_matches_the_paper",
                         "test_peak_breakdown_reads_the_top_level_entries_and_live_ranges",
                         "test_compile_for_gpu_errors",
                         "test_compile_for_gpu_without_the_plugin_says_how_to_install",
                         "test_no_jax_plugins_package_at_all_is_a_missing_plugin",
                         "test_h100_tp_column_dx_all_reduce_is_async"),
    "test_plan.py": ("test_parameter_count_of_the_presets", "test_candidates",
                     "test_pipelined_candidates_on_request_and_their_errors",
                     "test_xla_does_not_fit_lines_are_kept_out_and_explained",
                     "test_command_line_without_the_plugin_is_one_error_line",
                     "test_sharding_over_data_only_where_the_data_size_divides_the_hidden_size",
                     "test_help_has_the_whole_description"),
    "test_benchmarks.py": ("test_collective_roles_from_the_issuing_functions",
                           "test_out_is_required",
                           "test_gspmd_baseline_rejects_explicit_mesh"),
    "test_gpu_check.py": ("test_fit_shape", "test_peak_table", "test_model_flops_formula"),
    "test_train_gpt.py": ("test_bad_numbers_and_paths_are_usage_errors",
                          "test_plot_without_matplotlib_is_a_usage_error",
                          "test_presets_are_the_library_presets"),
    "test_docs.py": ("test_readme_opens_with_the_two_commands", "test_readme_example_runs",
                     "test_readme_context_example_runs", "test_linked_docs_exist",
                     "test_import_sp_jax_exposes_the_subpackages"),
    "test_doc_snippets.py": ("test_block_runs_as_written[README.md#1]",
                             "test_every_doc_has_its_blocks_found"),
    "test_pipeline.py": ("test_schedule_tables_keep_every_dependency",
                         "test_1f1b_keeps_the_same_inputs_whatever_the_microbatches",
                         "test_schedule_errors", "test_config_errors",
                         "test_pipeline_trains_like_unsharded[2x1x1x4_1f1b_r1_m4]"),
    "test_pipeline_hlo.py": (
        "test_only_activation_permutes_cross_stages_one_per_tick_and_direction",
        "test_hlo_helpers_read_groups_pairs_loops_and_counts"),
    "test_moe.py": ("test_capacity_drops_the_same_pairs_on_every_mesh["
                    "data2_expert2_tensor2_fsdp]",
                    "test_aux_loss_equals_transformers_mixtral", "test_moe_config_errors",
                    "test_moe_layer_freq_mixes_dense_and_expert_layers",
                    "test_h100_expert_traffic_is_ragged_all_to_all_without_a_dense_dispatch"),
}


def _fast(item) -> bool:
    keep = FAST.get(item.path.name, ())
    return keep is None or item.name in keep or item.originalname in keep


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable
    for item in items:
        if not _fast(item):
            item.add_marker(pytest.mark.slow)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test of a file (its module fixtures already torn down): JAX's caches
    of traced and compiled functions cleared and a full garbage collection. A worker
    process runs many files; what the earlier ones leave alive makes every later trace and
    compile slower (measured: tests/test_gpt.py after the quick benchmark run, 85 -> 54 s
    of CPU time, as in a fresh process). A file's tests still share their compiled
    functions."""
    if nextitem is None or nextitem.path != item.path:
        for array in jax.live_arrays():  # nothing still running while executables are freed
            array.block_until_ready()
        jax.clear_caches()
        gc.collect()

"""What combines with what: one table, as data, of the features of sp_jax in each mode.

A *feature* is one option of :class:`~sp_jax.ParallelConfig`, :class:`~sp_jax.models.GPTConfig`
or of the call (:data:`FEATURES`); a *mode* is what the model is asked to do
(:data:`MODES`: ``"train"``, ``"eval"``, ``"generate"``). For each mode and each pair of
features (the diagonal: the feature alone in that mode) :data:`TABLE` holds a
:class:`Cell`: ``supported`` (with the pytest node ids of the tests that run that
combination), ``refused`` (with what to do instead), ``exclusive`` (two values of one
option), ``n/a`` (the feature has no meaning in that mode) or ``untested`` (nothing
refuses it, and no test runs it yet).

Every refusal of a combination in sp_jax is raised here, by :func:`check`, as one
:class:`CombinationError` (a ``ValueError``) that names both features, the mode and what
to do. ``python -m sp_jax.compat`` prints the table; ``docs/api.md`` shows
:func:`markdown`'s output.

This module imports nothing from sp_jax (every floor may ask it).
"""

from __future__ import annotations

import dataclasses
import itertools
import textwrap
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["ALIASES", "COVERED", "FEATURES", "MODES", "REFUSALS", "STATUSES", "TABLE", "Cell",
           "CombinationError", "cell", "check", "features_of", "markdown", "refusals", "render"]

MODES: dict[str, str] = {
    "train": "a training step: TrainStep, or jax.grad of GPT.loss",
    "eval": "logits or hidden states without gradients (GPT.__call__, GPT.hidden_states)",
    "generate": "sp_jax.models.generate: prefill and key/value-cache decoding",
}
"""The modes, each with what it covers."""

FEATURES: dict[str, str] = {
    "tensor_sequence": "tensor + sequence parallelism (ParallelConfig.tensor_axis)",
    "collective_matmul": "ParallelConfig(collective_matmul=True): ring-overlapped GEMMs",
    "recompute_allgather": "ParallelConfig(recompute_allgather=True)",
    "fsdp": "ParallelConfig(fsdp=True): parameters sharded over the data axes",
    "context_ring": "ParallelConfig(context_parallel='ring'): ring attention",
    "context_ulysses": "ParallelConfig(context_parallel='ulysses'): all-to-all attention",
    "pipeline_gpipe": "ParallelConfig(pipeline_axis=..., pipeline_schedule='gpipe')",
    "pipeline_1f1b": "ParallelConfig(pipeline_axis=..., pipeline_schedule='1f1b')",
    "experts": "GPTConfig(num_experts=E > 0): mixture-of-experts layers",
    "expert_parallel": "ParallelConfig(expert_axis=...): experts sharded over a mesh axis",
    "fp8_current": "GPTConfig(fp8=Fp8Recipe('current')): FP8 GEMMs, current scaling",
    "fp8_delayed": "GPTConfig(fp8=Fp8Recipe('delayed')): FP8 GEMMs, amax history",
    "packed_documents": "segment_ids / positions: several documents per row",
    "sliding_window": "GPTConfig(sliding_window=w): attention to the last w tokens",
    "cudnn_attention": "GPTConfig(attention_implementation='cudnn'): cuDNN's kernel",
    "attention_dropout": "GPTConfig(attention_dropout > 0): dropout on the probabilities",
    "attention_softcap": "GPTConfig(attention_softcap=c): scores c * tanh(s / c) (Gemma 2)",
    "custom_loss": "TrainStep(loss_fn=...) other than the default lm_loss",
    "zero1": "ParallelConfig(fsdp='optimizer'): the optimizer state sharded over data (ZeRO-1)",
    "grad_reduce_dtype": "ParallelConfig(grad_reduce_dtype=...): gradients reduced in bf16",
    "offload_optimizer": "TrainStep(offload_optimizer / offload_params): state on the host",
    "offload_activations": "ParallelConfig(offload_activations=True): saved values on the host",
}
"""Every feature the table knows, with a one-line description."""

ALIASES: dict[str, tuple[str, ...]] = {
    "pipeline": ("pipeline_gpipe", "pipeline_1f1b"),
    "fp8": ("fp8_current", "fp8_delayed"),
    "context": ("context_ring", "context_ulysses"),
}
"""Names for a whole option (either of its values): ``check`` accepts them, the table's
entries are written with them."""

_NAMES: dict[str, str] = {  # how a message spells a feature (a caller may spell the value)
    "tensor_sequence": "tensor + sequence parallelism",
    "collective_matmul": "collective_matmul=True",
    "recompute_allgather": "recompute_allgather=True",
    "fsdp": "fsdp=True",
    "context_ring": "ring attention",
    "context_ulysses": "Ulysses attention",
    "pipeline_gpipe": "pipeline stages",
    "pipeline_1f1b": "pipeline stages",
    "pipeline": "pipeline stages",
    "experts": "a mixture of experts (num_experts > 0)",
    "expert_parallel": "expert_axis",
    "fp8_current": "FP8 (fp8=Fp8Recipe('current'))",
    "fp8_delayed": "FP8 (fp8=Fp8Recipe('delayed'))",
    "fp8": "FP8 (fp8=Fp8Recipe(...))",
    "context": "a context axis",
    "packed_documents": "packed documents (segment_ids / positions)",
    "sliding_window": "a sliding window",
    "cudnn_attention": "attention_implementation='cudnn'",
    "attention_dropout": "attention dropout",
    "attention_softcap": "an attention soft cap (attention_softcap)",
    "custom_loss": "a custom loss_fn",
    "zero1": "fsdp='optimizer' (ZeRO-1)",
    "grad_reduce_dtype": "grad_reduce_dtype",
    "offload_optimizer": "optimizer offload",
    "offload_activations": "offload_activations=True",
}

STATUSES: dict[str, tuple[str, str]] = {
    "supported": ("+", "supported: a test runs it (its node ids)"),
    "refused": ("x", "refused: a ValueError says what to do instead"),
    "exclusive": ("=", "exclusive: two values of one option"),
    "n/a": ("·", "not applicable: the feature has no meaning in this mode"),
    "untested": ("?", "not refused, but no test runs it yet"),
}
"""Each status of a cell: its symbol in :func:`render` and its meaning."""


class CombinationError(ValueError):
    """A combination of features (or a feature in a mode) that sp_jax refuses."""


@dataclasses.dataclass(frozen=True)
class Cell:
    """One cell of :data:`TABLE`.

    Attributes:
      status: one of :data:`STATUSES`.
      tests: with ``supported``: pytest node ids that run the combination.
      fix: with ``refused``: what to do instead (the end of the error message; a
        ``{feature}`` field in it is that feature as the message spells it).
      first: with ``refused``: the feature the message names first (the subject).
      alone: with ``refused``: the feature whose refusal in this mode (alone) refuses the
        pair too, or ``""``.
    """

    status: str
    tests: tuple[str, ...] = ()
    fix: str = ""
    first: str = ""
    alone: str = ""


def _expand(name: str) -> tuple[str, ...]:
    if name in ALIASES:
        return ALIASES[name]
    if name not in FEATURES:
        raise ValueError(f"sp_jax.compat: unknown feature {name!r}; use one of "
                         f"{sorted(FEATURES)} or {sorted(ALIASES)}.")
    return (name,)


def _key(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


# -- the table: each entry (modes, feature, feature or None for alone, cell) ----------------
# Features may be aliases (every member gets the cell). What no entry names is "untested".

_ALL = tuple(MODES)
_TRAIN_EVAL = ("train", "eval")

REFUSALS: list[tuple[tuple[str, ...], str, str | None, str]] = [
    (_ALL, "cudnn_attention", "context_ring",
     "attention_implementation='cudnn' cannot run ring attention (its steps are merged "
     "by log-sum-exp, which cuDNN's kernel does not return); use "
     "attention_implementation='xla' or context_parallel='ulysses'."),
    (_TRAIN_EVAL, "packed_documents", "cudnn_attention",
     "segment_ids (packed documents) need implementation='xla': "
     "jax.nn.dot_product_attention's cuDNN kernel takes no document ids in this JAX (only "
     "a dense [s, s] mask, which would undo the memory savings)."),
    (_ALL, "attention_dropout", "cudnn_attention",
     "{attention_dropout} needs attention_implementation='xla' (cuDNN's kernel draws masks "
     "of its own, which would not be the same under every sharding)."),
    (_ALL, "attention_softcap", "cudnn_attention",
     "{attention_softcap} needs attention_implementation='xla' (jax.nn.dot_product_attention's "
     "cuDNN kernel takes a scale but no soft cap of the scores; a dense bias or mask cannot "
     "express c * tanh(s / c))."),
    (("train",), "custom_loss", "pipeline",
     "a pipelined model trains with the default loss_fn=lm_loss through its own schedule "
     "(model.pipeline_loss_and_grads); a custom loss_fn cannot run on it."),
]
"""Each refusal: ``(modes, first feature, second feature or None: the first alone, what to
do)``; a feature may be an alias (each of its values is refused)."""

_EXCLUSIVE = [("context_ring", "context_ulysses"), ("pipeline_gpipe", "pipeline_1f1b"),
              ("fp8_current", "fp8_delayed")]

_NOT_APPLICABLE = [(("generate",), "packed_documents"), (("eval", "generate"), "custom_loss"),
                   *((("eval", "generate"), f) for f in (
                       "zero1", "grad_reduce_dtype", "offload_optimizer",
                       "offload_activations"))]  # training only: no gradients, no update

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
_CAP = "attention_softcap"
_CAP_GPT = ("tests/test_attention_softcap.py::test_gpt_with_scale_and_softcap_sharded_equals_"
            "one_device")
_ZERO1, _PRECISION = "tests/test_zero1.py::test_zero1_", "tests/test_optimizer_precision.py::"
_OFFLOAD = "tests/test_offload_optimizer.py::test_offload_"
_OFFLOAD_ACT = "tests/test_offload_activations.py::test_offload_trains_bitwise_like_no_offload"
_CAP_KERNELS = ("tests/test_attention_softcap.py::test_ring_and_ulysses_scale_and_softcap_match_"
                "the_dense_reference")
COVERED: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
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
    (_TRAIN, (_TS, "offload_optimizer"),
     f"{_OFFLOAD}is_bitwise_the_step_without[optimizer-scan]"),
    (_TRAIN, (_TS, "offload_optimizer", "pipeline_gpipe"),
     f"{_OFFLOAD}in_pipeline_stages_is_bitwise"),
    (_TRAIN, (_TS, _RA, "offload_activations"), f"{_OFFLOAD_ACT}[2x4_recompute]"),
    (_TRAIN, (_TS, "offload_activations", _RING), f"{_OFFLOAD_ACT}[2x2x2_ring]"),
    (_TRAIN, (_TS, "offload_activations", "pipeline_gpipe"),
     f"{_OFFLOAD_ACT}[2x2x1x2_gpipe_scan]"),
    (_TRAIN, (_TS, "offload_activations", "pipeline_1f1b"),
     f"{_OFFLOAD_ACT}[2x2x1x2_1f1b_remat]"),
    (_TRAIN, (_TS, _CM, _RA), f"{_GPT}[fp32]"),
    (_TRAIN, (_TS, _RA, _DROP), f"{_GPT}[scan_remat_dropout]"),
    (_TRAIN, (_TS, _CM, "fsdp"), f"{_GPT}[collective_matmul_scan_untied_50]"),
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
    (_TRAIN, (_TS, _DOCS, _ULYSSES), f"{_PACKED}[ulysses_1x4x2_scan_remat]"),
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
    (_GEN, (_TS, *_EXPERTS),
     "tests/test_generate.py::test_cache_with_experts_gives_the_logits_of_a_full_forward"
     "[scan_2x2x1x2]"),
    (_GEN, (_TS, _RING), f"{_GEN_CONTEXT}[llama-ring-1x2x2]"),
    (_GEN, (_TS, _ULYSSES), f"{_GEN_CONTEXT}[llama-ulysses-2x2x1]"),
    (_GEN, (_TS, _ULYSSES, _WINDOW), f"{_GEN_CONTEXT}[mistral-ulysses-1x2x1]"),
    (_GEN, (_TS, "pipeline_gpipe"), f"{_GEN_PIPE}[gpipe-r1]"),
    (_GEN, (_TS, "pipeline_1f1b"), f"{_GEN_PIPE}[1f1b-r2]"),
    (_GEN, (_TS, "pipeline_1f1b", *_EXPERTS), f"{_GEN_PIPE}[1f1b-r1-experts]"),
    (_GEN, (_TS, _CM, _RA, "fsdp", _WINDOW, _DROP),
     f"{_COMPAT_GEN}[2x4_cm_fsdp_window_dropout]"),
    (_GEN, (_TS, *_EXPERTS, _RING), f"{_COMPAT_GEN}[1x2x2x2_experts_ring]"),
    (_GEN, (_TS, _RING, _WINDOW), f"{_COMPAT_GEN}[1x2x4_ring_window]"),
    # tests/test_compat.py: one model with several features, train and eval, against the
    # same model unsharded
    (("train", "eval"), (_TS, _CM, _RA, "fsdp", _WINDOW, _DOCS), f"{_COMPAT}[2x4_cm_fsdp]"),
    (("train", "eval"), (_TS, _ULYSSES, _CM, _RA, "fsdp", _WINDOW, _DOCS),
     f"{_COMPAT}[2x2x2_ulysses_cm_fsdp]"),
    (("train", "eval"), (_TS, _RING, _CM, _RA, _DOCS, "fp8_current"),
     f"{_COMPAT}[1x2x4_ring_cm_fp8]"),
    (("train", "eval"), (_TS, *_EXPERTS, "fsdp", _CM, _RA, _DOCS, _WINDOW, "fp8_delayed"),
     f"{_COMPAT}[2x2x1x2_experts_fsdp_cm_fp8]"),
    (("train", "eval"), (_TS, _RING, _WINDOW, _DOCS), f"{_COMPAT}[1x2x4_ring_window]"),
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
]
"""``(modes, features, pytest node id)``: the test runs these features together."""


def _build() -> dict[str, dict[frozenset[str], Cell]]:
    table: dict[str, dict[frozenset[str], Cell]] = {m: {} for m in MODES}

    def put(modes: Iterable[str], a: str, b: str | None, value: Cell) -> None:
        for mode in modes:
            for x in _expand(a):
                for y in _expand(b) if b is not None else (x,):
                    if x == y and b is not None:
                        continue  # an alias against itself: its members are exclusive
                    key = _key(x, y)
                    old = table[mode].get(key)
                    if old is not None and old != value and old.status != "exclusive":
                        raise AssertionError(f"sp_jax.compat: two cells for {mode} {x} x {y}")
                    if old is None:
                        table[mode][key] = dataclasses.replace(
                            value, first=x if value.status == "refused" else "")

    for a, b in _EXCLUSIVE:
        put(_ALL, a, b, Cell("exclusive"))
    for modes, a, b, fix in REFUSALS:
        put(modes, a, b, Cell("refused", fix=fix))
    for modes, a in _NOT_APPLICABLE:
        put(modes, a, None, Cell("n/a"))
    for modes, features, test in COVERED:
        for mode in modes:
            for x, y in itertools.combinations_with_replacement(features, 2):
                old = table[mode].get(_key(x, y))
                if old is not None and old.status != "supported":
                    raise AssertionError(f"sp_jax.compat: {test} runs {x} x {y} in {mode}, "
                                         f"which the table says is {old.status}")
                tests = () if old is None else old.tests
                table[mode][_key(x, y)] = Cell("supported", tests=(*tests, test))
    for cells in table.values():
        for x, y in itertools.combinations(FEATURES, 2):
            key = _key(x, y)
            if key in cells:
                continue
            for status, f in itertools.product(("n/a", "refused"), (x, y)):
                alone = cells.get(_key(f, f))  # refused (or meaningless) alone: the pair too
                if alone is not None and alone.status == status:
                    cells[key] = dataclasses.replace(alone, alone=f)
                    break
        for x, y in itertools.combinations_with_replacement(FEATURES, 2):
            cells.setdefault(_key(x, y), Cell("untested"))
    return table


TABLE: dict[str, dict[frozenset[str], Cell]] = {}
"""``TABLE[mode][frozenset({a, b})]``: the :class:`Cell` of features ``a`` and ``b``
(``frozenset({a})``: ``a`` alone) in ``mode``."""


def cell(mode: str, a: str, b: str | None = None) -> Cell:
    """The cell of features ``a`` and ``b`` (``None``: ``a`` alone) in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"sp_jax.compat: unknown mode {mode!r}; use one of {list(MODES)}.")
    for name in (a, b):
        if name is not None and name not in FEATURES:
            raise ValueError(f"sp_jax.compat: unknown feature {name!r}; use one of "
                             f"{sorted(FEATURES)}.")
    return TABLE[mode][_key(a, a if b is None else b)]


def _message(mode: str, found: Cell, a: str, b: str | None, where: str,
             names: Mapping[str, str], given_as: Mapping[str, str]) -> str:
    """The refusal's message; its tag names each feature as the caller gave it (an alias,
    ``fp8``, stands for whichever of its values the caller has)."""
    def name(f: str) -> str:
        return names.get(f, _NAMES[f])

    fix = found.fix.format_map(_Spelled(names))
    if b is None:
        return f"{where}: {name(a)}: {fix} (sp_jax.compat: {given_as[a]} in {mode})"
    return (f"{where}: {name(a)} is not supported with {name(b)}; {fix} "
            f"(sp_jax.compat: {given_as[a]} x {given_as[b]} in {mode})")


class _Spelled(dict):
    """The spellings of a message's features for its fix text: ``{feature}`` in a fix
    is the caller's spelling of that feature (a flag, a value) or the default one."""

    def __missing__(self, feature: str) -> str:
        return _NAMES[feature]


def check(mode: str, features: Iterable[str], *, where: str) -> None:
    """Raises a :class:`CombinationError` for the first refused cell among ``features``
    in ``mode``: each feature alone first, then each pair, in the order given (a set: in
    :data:`FEATURES`' order). ``features`` are names of :data:`FEATURES` or
    :data:`ALIASES` (``"pipeline"``, ``"fp8"``, ``"context"``); a mapping from names to
    how the message spells each (e.g. ``{"sliding_window": "sliding_window=4"}``) works
    too. The message starts with ``where`` (e.g. ``"GPT"``), names both features (or the
    feature and the mode) and ends with what to do."""
    if mode not in MODES:
        raise ValueError(f"sp_jax.compat.check: unknown mode {mode!r}; use one of "
                         f"{list(MODES)}.")
    names: dict[str, str] = dict(features) if isinstance(features, Mapping) else {}
    given = list(features)
    if isinstance(features, (set, frozenset)):
        order = {f: i for i, f in enumerate((*FEATURES, *ALIASES))}
        given.sort(key=lambda f: order.get(f, len(order)))
    active: list[tuple[str, str]] = []  # (feature, the name it was given as)
    for f in given:
        for x in _expand(f):
            if x not in (a for a, _ in active):
                active.append((x, f))
    spell = {x: names.get(f, names.get(x, _NAMES.get(f, _NAMES[x]))) for x, f in active}
    spell |= {f: spell[x] for x, f in active if f not in spell}  # an alias: its value's
    cells, given_as = TABLE[mode], dict(active)
    for x, _ in active:
        found = cells[_key(x, x)]
        if found.status == "refused":
            raise CombinationError(_message(mode, found, x, None, where, spell, given_as))
    for (x, fx), (y, fy) in itertools.combinations(active, 2):
        if fx == fy and fx in ALIASES:
            continue  # both values of one option were named by their alias
        found = cells[_key(x, y)]
        if found.status == "refused":
            a, b = (x, y) if found.first in ("", x) else (y, x)
            raise CombinationError(_message(mode, found, a, b, where, spell, given_as))


def features_of(config: Any = None, parallel: Any = None, mesh: Any = None) -> frozenset[str]:
    """The features a model uses, from its ``GPTConfig`` and ``ParallelConfig`` (duck
    typed: their field names), for :func:`check`. With ``mesh``, a context axis of size
    1 is no context feature. Call-time features (``packed_documents``, ``custom_loss``,
    ``offload_optimizer``) are the caller's to add."""
    found: set[str] = set()
    if parallel is not None:
        found.add("tensor_sequence")
        for name in ("collective_matmul", "recompute_allgather"):
            if getattr(parallel, name, False):
                found.add(name)
        if getattr(parallel, "fsdp", False) in (True, "full"):  # not "optimizer" (ZeRO-1)
            found.add("fsdp")
        elif getattr(parallel, "fsdp", False) == "optimizer":
            found.add("zero1")
        if getattr(parallel, "grad_reduce_dtype", None) is not None:
            found.add("grad_reduce_dtype")
        if getattr(parallel, "offload_activations", False):
            found.add("offload_activations")
        context = getattr(parallel, "context_parallel", None)
        if context is not None and (mesh is None or dict(mesh.shape).get(
                parallel.context_axis, 1) > 1):
            found.add(f"context_{context}")
        if getattr(parallel, "pipeline_axis", None) is not None:
            found.add(f"pipeline_{parallel.pipeline_schedule}")
        if getattr(parallel, "expert_axis", None) is not None:
            found.add("expert_parallel")
    if config is not None:
        if getattr(config, "num_experts", 0):
            found.add("experts")
        fp8 = getattr(config, "fp8", None)
        if fp8 is not None:
            found.add(f"fp8_{fp8.scaling}")
        if getattr(config, "sliding_window", None) is not None or any(
                w is not None for w in getattr(config, "layer_windows", None) or ()):
            found.add("sliding_window")  # one window for every layer, or per layer
        if getattr(config, "attention_implementation", "xla") == "cudnn":
            found.add("cudnn_attention")
        if getattr(config, "attention_dropout", 0.0):
            found.add("attention_dropout")
        if getattr(config, "attention_softcap", None) is not None:
            found.add("attention_softcap")
    return frozenset(found)


def refusals(mode: str | None = None) -> list[tuple[str, str, str | None, Cell]]:
    """``(mode, a, b or None, cell)`` of every refused cell (pairs refused because one
    feature is refused alone are left out: the alone cell names them)."""
    out = []
    for m in MODES if mode is None else (mode,):
        for x, y in itertools.combinations_with_replacement(FEATURES, 2):
            c = TABLE[m][_key(x, y)]
            if c.status == "refused" and not c.alone:
                a, b = (x, y) if c.first in ("", x) else (y, x)
                out.append((m, a, None if x == y else b, c))
    return out


_SHORT: dict[str, str] = {
    "tensor_sequence": "ts", "collective_matmul": "cm", "recompute_allgather": "ra",
    "fsdp": "fs", "context_ring": "cr", "context_ulysses": "cu", "pipeline_gpipe": "pg",
    "pipeline_1f1b": "p1", "experts": "ex", "expert_parallel": "ep", "fp8_current": "8c",
    "fp8_delayed": "8d", "packed_documents": "pd", "sliding_window": "sw",
    "cudnn_attention": "cd", "attention_dropout": "ad", "attention_softcap": "ac",
    "custom_loss": "cl", "zero1": "z1", "grad_reduce_dtype": "gr", "offload_optimizer": "oo",
    "offload_activations": "oa",
}


def render() -> str:
    """The table as text: one matrix per mode (compact symbols, under 100 columns), the
    legend, then every refused cell with its fix."""
    width = max(map(len, FEATURES))
    lines = ["Legend:", *(f"  {s}  {text}" for s, text in STATUSES.values()), "Features:"]
    lines.extend(textwrap.wrap(", ".join(f"{_SHORT[f]} {f}" for f in FEATURES), 99,
                               initial_indent="  ", subsequent_indent="  "))
    lines.append("")
    for mode, text in MODES.items():
        lines.append(f"{mode}: {text}")
        lines.append(" " * (width + 2) + " ".join(_SHORT[f] for f in FEATURES))
        for f in FEATURES:
            row = " ".join(f"{STATUSES[TABLE[mode][_key(f, g)].status][0]:>2}"
                           for g in FEATURES)
            lines.append(f"{f:<{width + 2}}{row}")
        lines.append("")
    lines.append("Refused (modes: features: what to do; pipeline, fp8 and context stand for "
                 "each of their values):")
    for modes, a, b, fix in REFUSALS:
        pair = a if b is None else f"{a} x {b}"
        fix = fix.format_map(_Spelled())
        lines.extend(textwrap.wrap(f"- {', '.join(modes)}: {pair}: {fix}", 99,
                                   subsequent_indent="  "))
    return "\n".join(lines)


def markdown() -> str:
    """The table for ``docs/api.md``: :func:`render` in a text block."""
    return "```text\n" + render() + "\n```\n"


TABLE.update(_build())

if __name__ == "__main__":
    import sys

    print(markdown() if sys.argv[1:] == ["--markdown"] else render())

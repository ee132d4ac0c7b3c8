"""Parallel configuration: the explicit, immutable analog of Paddle's ``MpConfig``.

A :class:`ParallelConfig` is passed to every parallel layer (and from there to the
functional ops). There are no environment flags and no global state: two layers in one
model may use different configurations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["CONTEXT_PARALLEL", "FP8_SCALINGS", "FSDP_MODES", "LORA_BASE_DTYPES", "LORA_TARGETS",
           "PIPELINE_SCHEDULES", "Fp8Recipe", "LoRAConfig", "ParallelConfig", "PipelineConfig",
           "check_layer_args"]

CONTEXT_PARALLEL = (None, "ring", "ulysses")
"""The values of ``ParallelConfig.context_parallel``."""

PIPELINE_SCHEDULES = ("gpipe", "1f1b")
"""The values of ``ParallelConfig.pipeline_schedule``."""

FSDP_MODES = (False, "optimizer", "full")
"""What ``ParallelConfig.fsdp`` holds after construction (``True`` is read as ``"full"``):
nothing sharded over the data axes, the optimizer state only (ZeRO-1), or the parameters
and with them their gradients and optimizer state (ZeRO-3 / FSDP)."""

FP8_SCALINGS = ("current", "delayed")
"""The values of ``Fp8Recipe.scaling``."""

_FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")


def _canonical_dtype(name: str, value: Any) -> np.dtype | None:
    """Turn ``value`` (None, a dtype, or a dtype name such as ``"float32"``) into a dtype."""
    if value is None:
        return None
    try:
        dtype = jnp.dtype(value)
    except TypeError as e:
        raise TypeError(
            f"ParallelConfig.{name}={value!r} is not a dtype; use None or one of "
            f"{', '.join(_FLOAT_DTYPES)} (e.g. jnp.float32)."
        ) from e
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"ParallelConfig.{name}={value!r} must be a floating dtype; use None or one of "
            f"{', '.join(_FLOAT_DTYPES)}."
        )
    return dtype


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How a parallel layer maps onto the device mesh.

    Attributes:
      tensor_axis: mesh axis used for tensor parallelism. In sequence-parallel regions the
        activations are also sharded along the sequence dimension on this axis.
      data_axis: mesh axis (or tuple of axes) the batch dimension is sharded over; ``None``
        keeps the batch replicated.
      recompute_allgather: sequence-parallel column layers keep only the local sequence
        shard of their input for the backward pass and all-gather it again there, instead
        of keeping the gathered ``[batch, seq, features]`` input alive between forward and
        backward (saves ``(t - 1) / t`` of that activation per layer).
      wgrad_dtype: dtype in which weight (and bias) gradients are accumulated. ``None``
        follows plain autodiff: the gradient is computed at the compute dtype's precision
        and returned in the parameter dtype. With bf16 compute and ``jnp.float32`` the
        weight gradient is computed from the bf16 operands straight into fp32 (the analog
        of Paddle's ``mp_fused_linear_param_grad_add`` / Megatron's
        ``gradient_accumulation_fusion``), with no intermediate bf16 rounding.
      collective_matmul: sequence-parallel column and row layers (and the GPT's LM head)
        decompose their all-gather / reduce-scatter into a bidirectional ring of ``t - 1``
        collective-permutes, each overlapped with the GEMM of one sequence chunk, in the
        forward and the backward pass (Megatron's ``tp_comm_overlap``; Wang et al.
        2023). Same results as the plain path up to the summation order; no-op when the
        tensor axis has size 1. Needs XLA's latency-hiding scheduler on GPU
        (:mod:`sp_jax.xla_flags`).
      context_axis: mesh axis of context parallelism (used when ``context_parallel`` is
        set): the sequence is then sharded over ``(context_axis, tensor_axis)`` in
        sequence-parallel regions and over ``context_axis`` inside tensor-parallel ones
        (mesh ``(data, context, tensor)``, tensor innermost); column layers all-gather over
        the tensor axis only, and attention runs across the context axis.
      context_parallel: how attention spans the context axis: ``"ring"`` (each device
        keeps its queries and passes key/value blocks around the context ring; the
        sequence is assigned to devices in zigzag order for causal load balance,
        handled inside the model), ``"ulysses"`` (all-to-all from sequence-sharded to
        head-sharded and back; heads per tensor shard must divide by the context size),
        or ``None``: no context axis (the default).
      fsdp: what is sharded over the data axes besides the batch: ``False`` (the
        default) nothing; ``"optimizer"`` the optimizer state only (ZeRO-1, Megatron's
        distributed optimizer); ``"full"`` (or ``True``, the same) the parameters, and so
        their gradients and optimizer state (ZeRO-3 / FSDP). The field holds ``False``,
        ``"optimizer"`` or ``"full"`` after construction (:data:`FSDP_MODES`).

        ``"full"`` shards parameters on the dimension tensor parallelism does not split:
        column kernels ``[in, out]`` over ``in``, row kernels over ``out``, vocabulary
        tables over the hidden dimension. Each layer all-gathers its weights over the data
        axes just before use, inside its computation, and re-gathers them in the backward
        pass instead of keeping them (``ops.fsdp_gather``: all-gather forward,
        reduce-scatter of the weight gradient backward), so weight gradients come out
        sharded and no full-size gradient all-reduce exists. Biases, norm parameters and
        the learned position table stay replicated over the data axes (small). Needs a
        ``data_axis``. Inside a pipeline the weights of a stage are gathered once per
        step and their gradients reduce-scattered once (:mod:`sp_jax.pipeline`).

        ``"optimizer"`` lays parameters and gradients out as without fsdp (replicated
        over the data axes) and shards each optimizer-state leaf over the data axes
        (:attr:`zero1_axes`; an expert weight, already split over the expert axis, over
        the others) on a dimension nothing else splits; :class:`~sp_jax.training.TrainStep`
        reshards the gradients to that layout before the optimizer's update (the
        reduction over the data axes becomes a reduce-scatter where XLA sees it whole),
        computes the update on each device's shard and all-gathers the new parameters.
      pipeline_axis: mesh axis of pipeline parallelism (mesh ``(stage, data, context,
        tensor)``, stage outermost), or ``None`` (the default): no pipeline. The GPT's
        scanned blocks ``[num_layers, ...]`` are sharded over it, the embedding runs on
        the first stage and the final norm, head and loss on the last; activations
        cross stages as their sequence-parallel shard with ``ppermute``
        (:mod:`sp_jax.pipeline`).
      pipeline_microbatches: micro-batches ``M`` one training step runs through the
        pipeline (the leading dimension of the step's batch).
      pipeline_schedule: ``"gpipe"`` (every forward, then every backward, by autodiff
        of the forward loop: activations of all ``M`` micro-batches stay alive) or
        ``"1f1b"`` (after a warm-up every stage does one forward and one backward per
        tick: at most ``2 * stages * repeats - 1`` stage inputs stay alive per stage,
        whatever ``M``).
      pipeline_repeats: ``R`` layer chunks per stage (``> 1``: the circular /
        interleaved assignment, chunk ``c`` of ``stages * R`` on stage ``c % stages``;
        fewer idle ticks, ``(P - 1) / (R M + P - 1)``); ``num_layers`` must divide by
        ``stages * R`` and ``M`` by ``stages``.
      pipeline_layers_per_stage: None (the default: every stage holds ``num_layers /
        (stages * R)`` layers per chunk), or the number of layers of each virtual stage
        ``v = r * stages + s`` (chunk ``r`` of stage ``s``; ``stages * R`` positive ints
        summing to ``num_layers``), e.g. ``(3, 5)``: fewer layers on the stage that also
        runs the embedding (Megatron's first / last stage layer counts). Each stage runs
        the most layers of any, the padding ones as identities (one SPMD program); the
        parameters keep their ``[num_layers, ...]`` layout (:mod:`sp_jax.pipeline`).
        With dense layers before the experts (``GPTConfig.num_dense_layers``) the counts
        cover both kinds: each chunk runs its dense layers, then its expert layers
        (:mod:`sp_jax.pipeline.placement`).
      expert_axis: mesh axis of expert parallelism (mesh ``(data, expert, context,
        tensor)``), or ``None`` (the default): the experts of a mixture-of-experts layer
        (``GPTConfig(num_experts=...)``) are sharded over it, and the tokens of a layer go
        to the devices holding their experts and back by all-to-all over it
        (:class:`~sp_jax.layers.MoE`). Outside the expert layers it carries the batch
        like a data axis: ``data_axes`` ends with it, so the batch is split over
        ``(data..., expert)`` and ``fsdp`` shards parameters over it too (expert weights
        over the other data axes). Dense models may use it as a data axis.
      manual_data_axes: data axes that an enclosing ``shard_map`` has already made
        manual, so the batch the layers see is this device's block of it. Set by the
        pipeline for the layers it runs (with ``data_axis=None``); dropout then draws the
        masks of the whole batch and keeps this block's rows, so they still equal the
        unsharded model's. Leave it empty otherwise.
      grad_reduce_dtype: the dtype gradients are reduced in across the data axes, or
        ``None`` (the default): the gradients' own dtype. With ``jnp.bfloat16`` each
        data shard sums its micro-batches' gradients in fp32 (Megatron's main grads),
        then the all-reduce (reduce-scatter) over the data axes carries them in bf16,
        half the bytes, and the result is cast back to fp32 (Megatron's
        ``grad_reduce_in_fp32=False``). In :class:`~sp_jax.training.TrainStep` (the
        per-shard gradients computed in a ``shard_map`` over the data axes, for a GPT
        without fsdp, experts or FP8) and in the pipeline's one reduction per step.
      offload_activations: what each layer keeps for its backward pass goes to the
        host's ``pinned_host`` memory in the forward pass and comes back to device memory
        in the backward pass: the GEMM operand of the linear rules (the local sequence
        shard with ``recompute_allgather``, else the gathered input; a row layer's input,
        the MLP's hidden layer), attention's ``q, k, v``, output and log-sum-exp, the
        norms' input and statistics, and with ``GPTConfig.remat`` the block's input (the
        one thing a rematerialised block keeps). The custom-VJP rules move their own
        residuals (``jax.device_put`` to ``jax.memory.Space.Host`` and back), so it works
        inside scanned layers, ``remat`` and pipeline stages, where checkpoint-name
        policies do not reach. Bitwise the same results; costs host bandwidth. Needs a
        backend with host memory kinds (CPU, GPU, TPU: a ValueError otherwise).
    """

    tensor_axis: str = "tensor"
    data_axis: str | tuple[str, ...] | None = "data"
    recompute_allgather: bool = False
    wgrad_dtype: Any = None
    collective_matmul: bool = False
    context_axis: str = "context"
    context_parallel: str | None = None
    fsdp: bool | str = False
    pipeline_axis: str | None = None
    pipeline_microbatches: int = 1
    pipeline_schedule: str = "gpipe"
    pipeline_repeats: int = 1
    expert_axis: str | None = None
    manual_data_axes: tuple[str, ...] = ()
    grad_reduce_dtype: Any = None
    offload_activations: bool = False
    pipeline_layers_per_stage: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_axis, str) or not self.tensor_axis:
            raise TypeError(
                f"ParallelConfig.tensor_axis={self.tensor_axis!r} must be a non-empty mesh "
                "axis name (str), e.g. 'tensor'."
            )
        data_axis = self.data_axis
        if isinstance(data_axis, list):
            data_axis = tuple(data_axis)
        if data_axis is not None:
            names = (data_axis,) if isinstance(data_axis, str) else data_axis
            if (
                not isinstance(names, tuple)
                or not names
                or not all(isinstance(n, str) and n for n in names)
            ):
                raise TypeError(
                    f"ParallelConfig.data_axis={self.data_axis!r} must be None, a mesh axis "
                    "name (str) or a non-empty tuple of axis names."
                )
            if self.tensor_axis in names:
                raise ValueError(
                    f"ParallelConfig.data_axis={self.data_axis!r} contains the tensor axis "
                    f"{self.tensor_axis!r}; the batch and the tensor-parallel dimension must "
                    "use different mesh axes."
                )
            if len(set(names)) != len(names):
                raise ValueError(
                    f"ParallelConfig.data_axis={self.data_axis!r} repeats an axis name."
                )
        object.__setattr__(self, "data_axis", data_axis)
        if not isinstance(self.recompute_allgather, (bool, np.bool_)):
            raise TypeError(
                f"ParallelConfig.recompute_allgather={self.recompute_allgather!r} must be "
                "True or False."
            )
        object.__setattr__(self, "recompute_allgather", bool(self.recompute_allgather))
        if not isinstance(self.collective_matmul, (bool, np.bool_)):
            raise TypeError(
                f"ParallelConfig.collective_matmul={self.collective_matmul!r} must be True "
                "or False."
            )
        object.__setattr__(self, "collective_matmul", bool(self.collective_matmul))
        fsdp = self.fsdp
        if isinstance(fsdp, (bool, np.bool_)):
            fsdp = "full" if fsdp else False
        if not isinstance(fsdp, (bool, str)) or fsdp not in FSDP_MODES:
            raise ValueError(
                f"ParallelConfig.fsdp={self.fsdp!r} is not a known fsdp mode; use False "
                "(nothing sharded over the data axes), 'optimizer' (the optimizer state: "
                "ZeRO-1) or 'full' (= True: parameters, gradients and optimizer state).")
        if fsdp and data_axis is None and self.expert_axis is None:
            raise ValueError(
                f"ParallelConfig(fsdp={self.fsdp!r}) shards "
                f"{'parameters' if fsdp == 'full' else 'the optimizer state'} over the data "
                "axes, but data_axis=None; name the data axis (e.g. data_axis='data').")
        object.__setattr__(self, "fsdp", fsdp)
        if not isinstance(self.offload_activations, (bool, np.bool_)):
            raise TypeError(f"ParallelConfig.offload_activations={self.offload_activations!r} "
                            "must be True or False.")
        object.__setattr__(self, "offload_activations", bool(self.offload_activations))
        if self.context_parallel not in CONTEXT_PARALLEL:
            raise ValueError(
                f"ParallelConfig.context_parallel={self.context_parallel!r} is not a known "
                f"kind of context parallelism; use one of {CONTEXT_PARALLEL}."
            )
        if not isinstance(self.context_axis, str) or not self.context_axis:
            raise TypeError(
                f"ParallelConfig.context_axis={self.context_axis!r} must be a non-empty mesh "
                "axis name (str), e.g. 'context'."
            )
        if self.context_parallel is not None and self.context_axis in (
                self.tensor_axis, *self.data_axes):
            raise ValueError(
                f"ParallelConfig.context_axis={self.context_axis!r} is also the tensor or a "
                "data axis; context parallelism needs a mesh axis of its own, e.g. "
                "jax.make_mesh((data, context, tensor), ('data', 'context', 'tensor'))."
            )
        object.__setattr__(
            self, "wgrad_dtype", _canonical_dtype("wgrad_dtype", self.wgrad_dtype)
        )
        object.__setattr__(self, "grad_reduce_dtype",
                           _canonical_dtype("grad_reduce_dtype", self.grad_reduce_dtype))
        self._check_pipeline()
        self._check_expert_axis()

    def _check_expert_axis(self) -> None:
        """Validates ``expert_axis``: a mesh axis of its own."""
        axis = self.expert_axis
        if axis is None:
            return
        if not isinstance(axis, str) or not axis:
            raise TypeError(
                f"ParallelConfig.expert_axis={axis!r} must be None or a non-empty mesh axis "
                "name (str), e.g. 'expert'.")
        names = self.data_axes[:-1]
        if axis in (self.tensor_axis, *names, *self.context_axes, *self.pipeline_axes):
            raise ValueError(
                f"ParallelConfig.expert_axis={axis!r} is also the tensor, a data, the "
                "context or the pipeline axis; expert parallelism needs a mesh axis of its "
                "own, e.g. jax.make_mesh((data, expert, context, tensor), ('data', "
                "'expert', 'context', 'tensor')).")

    def _check_pipeline(self) -> None:
        """Validates the ``pipeline_*`` fields and ``manual_data_axes``."""
        axis = self.pipeline_axis
        if axis is not None and (not isinstance(axis, str) or not axis):
            raise TypeError(
                f"ParallelConfig.pipeline_axis={axis!r} must be None or a non-empty mesh "
                "axis name (str), e.g. 'stage'.")
        if axis is not None and axis in (self.tensor_axis, *self.data_axes,
                                         *self.context_axes):
            raise ValueError(
                f"ParallelConfig.pipeline_axis={axis!r} is also the tensor, a data or the "
                "context axis; pipeline stages need a mesh axis of their own, e.g. "
                "jax.make_mesh((stage, data, context, tensor), ('stage', 'data', "
                "'context', 'tensor')).")
        for name in ("pipeline_microbatches", "pipeline_repeats"):
            value = getattr(self, name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(
                    value, (int, np.integer)) or value < 1:
                raise ValueError(f"ParallelConfig.{name}={value!r} must be a positive int.")
            object.__setattr__(self, name, int(value))
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"ParallelConfig.pipeline_schedule={self.pipeline_schedule!r} is not a known "
                f"schedule; use one of {PIPELINE_SCHEDULES}.")
        counts = self.pipeline_layers_per_stage
        if counts is not None:
            if isinstance(counts, (str, bytes)) or not hasattr(counts, "__iter__") or \
                    not tuple(counts) or not all(
                        isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c > 0
                        for c in counts):
                raise ValueError(
                    f"ParallelConfig.pipeline_layers_per_stage={counts!r} must be None or a "
                    "tuple of positive ints (the layers of each virtual stage), e.g. (3, 5).")
            object.__setattr__(self, "pipeline_layers_per_stage", tuple(int(c) for c in counts))
        if axis is None and (self.pipeline_microbatches > 1 or self.pipeline_repeats > 1
                             or self.pipeline_schedule != "gpipe"):
            raise ValueError(
                "ParallelConfig: pipeline_microbatches, pipeline_repeats and "
                "pipeline_schedule need a pipeline; set pipeline_axis (e.g. "
                "pipeline_axis='stage') or leave them at their defaults.")
        if axis is None and counts is not None:
            raise ValueError(
                f"ParallelConfig: pipeline_layers_per_stage={counts!r} needs a pipeline; set "
                "pipeline_axis (e.g. pipeline_axis='stage') or leave it None.")
        manual = self.manual_data_axes
        manual = (manual,) if isinstance(manual, str) else tuple(manual)
        if not all(isinstance(n, str) and n for n in manual):
            raise TypeError(
                f"ParallelConfig.manual_data_axes={self.manual_data_axes!r} must be a "
                "tuple of mesh axis names.")
        object.__setattr__(self, "manual_data_axes", manual)

    @property
    def pipeline_axes(self) -> tuple[str, ...]:
        """The pipeline axis as a tuple (empty without a pipeline)."""
        return (self.pipeline_axis,) if self.pipeline_axis is not None else ()

    def split_pipeline(self) -> tuple[ParallelConfig, PipelineConfig | None]:
        """The request split once, at a model's construction: the config of its layers
        (every ``pipeline_*`` field at its default: the layers know nothing of stages)
        and the pipeline's own :class:`PipelineConfig` (None without ``pipeline_axis``)."""
        if self.pipeline_axis is None:
            return self, None
        layers = self.replace(pipeline_axis=None, pipeline_microbatches=1,
                              pipeline_schedule="gpipe", pipeline_repeats=1,
                              pipeline_layers_per_stage=None)
        return layers, PipelineConfig(
            axis=self.pipeline_axis, microbatches=self.pipeline_microbatches,
            schedule=self.pipeline_schedule, repeats=self.pipeline_repeats,
            layers_per_stage=self.pipeline_layers_per_stage)

    @property
    def context_axes(self) -> tuple[str, ...]:
        """The context axis as a tuple (empty without context parallelism)."""
        return (self.context_axis,) if self.context_parallel is not None else ()

    @property
    def fsdp_axes(self) -> tuple[str, ...]:
        """The axes parameters are sharded over besides tensor: the data axes with
        ``fsdp="full"`` (or ``True``), else empty."""
        return self.data_axes if self.fsdp == "full" else ()

    @property
    def zero1_axes(self) -> tuple[str, ...]:
        """The axes only the optimizer state is sharded over (``fsdp="optimizer"``: the
        data axes), else empty."""
        return self.data_axes if self.fsdp == "optimizer" else ()

    @property
    def data_axes(self) -> tuple[str, ...]:
        """The axes the batch is split over: the data axes, then the expert axis when set
        (empty when the batch is replicated)."""
        names = () if self.data_axis is None else \
            (self.data_axis,) if isinstance(self.data_axis, str) else self.data_axis
        return (*names, *self.expert_axes)

    @property
    def expert_axes(self) -> tuple[str, ...]:
        """The expert axis as a tuple (empty without expert parallelism)."""
        return (self.expert_axis,) if self.expert_axis is not None else ()

    def replace(self, **changes: Any) -> ParallelConfig:
        """Returns a copy with ``changes`` applied (validated like the constructor)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ParallelConfig:
        """Builds a config from a plain mapping (e.g. parsed YAML or CLI arguments).

        Unknown keys are rejected with the list of valid ones; ``wgrad_dtype`` and
        ``grad_reduce_dtype`` may be dtype names such as ``"float32"``.
        """
        if not isinstance(d, Mapping):
            raise TypeError(
                f"ParallelConfig.from_dict expects a mapping, got {type(d).__name__}."
            )
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(valid))
        if unknown:
            raise ValueError(
                f"Unknown ParallelConfig key(s) {unknown}; valid keys are {valid}."
            )
        return cls(**dict(d))


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """The pipeline part of a :class:`ParallelConfig` (its ``pipeline_*`` fields, checked
    there), which :meth:`ParallelConfig.split_pipeline` hands to the pipeline
    (:mod:`sp_jax.pipeline`) while the layers get the rest.

    Attributes:
      axis: the stage mesh axis.
      microbatches / schedule / repeats / layers_per_stage: ``pipeline_microbatches``,
        ``pipeline_schedule``, ``pipeline_repeats``, ``pipeline_layers_per_stage``.
    """

    axis: str
    microbatches: int = 1
    schedule: str = "gpipe"
    repeats: int = 1
    layers_per_stage: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How the parallel linear layers compute in FP8 (Transformer Engine's recipe, in JAX).

    With a recipe, a linear layer's GEMMs take inputs and weights in ``float8_e4m3fn``
    and the gradient of its output in ``float8_e5m2``, each with one per-tensor scale,
    and accumulate in fp32 (:mod:`sp_jax.ops.fp8`); master weights, norms, softmax and
    the loss are untouched. A tensor's scale comes from the amax of the *whole* tensor
    (the maximum over its shards on the data, context and tensor axes), so a sharded
    FP8 model computes what the unsharded one computes. A sequence-parallel column layer
    quantises its local shard and all-gathers FP8 bytes.

    Attributes:
      scaling: ``"current"``: each tensor is scaled by its own amax, taken just before it
        is quantised (one small all-reduce of a scalar per tensor on the critical path).
        ``"delayed"``: scaled by the largest amax of the last ``amax_history_len`` steps
        (kept per layer as :class:`sp_jax.ops.fp8.Fp8History` state, updated by the
        training step); the step's own amax is only recorded, off the critical path.
        Values above the history's amax saturate at the format's largest value.
      amax_history_len: steps of amax history kept per tensor with ``"delayed"``.
      margin: the scale is ``amax * 2**margin / fp8_max``: ``margin`` binades of headroom
        (Transformer Engine's ``margin``).
    """

    scaling: str = "current"
    amax_history_len: int = 16
    margin: int = 0

    def __post_init__(self) -> None:
        if self.scaling not in FP8_SCALINGS:
            raise ValueError(f"Fp8Recipe.scaling={self.scaling!r} must be one of "
                             f"{FP8_SCALINGS}.")
        for name, low in (("amax_history_len", 1), ("margin", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"Fp8Recipe.{name}={value!r} must be an int >= {low}.")

    @property
    def delayed(self) -> bool:
        """Whether the scales come from an amax history (``scaling="delayed"``)."""
        return self.scaling == "delayed"


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
"""The linear layers LoRA can adapt, by the names PEFT's Llama targets use (``q_proj`` ...
``down_proj``): the attention's query, key, value and output projections, the MLP's gate,
up and down projections."""

LORA_BASE_DTYPES = ("bf16", "int8", "nf4", "fp8")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters on the frozen linear layers of a model (Hu et al. 2021; PEFT's
    ``LoraConfig``): each targeted kernel ``W [in, out]`` computes ``x @ W + (alpha /
    rank) * (x @ lora_a) @ lora_b`` with ``lora_a [in, rank]`` (PEFT's initialisation:
    Kaiming-uniform) and ``lora_b [rank, out]`` (zeros: the adapted model starts equal to
    its base, bitwise). Only the adapters train; the base stays frozen.

    The adapters run inside the base layer's op and share its collectives
    (:class:`sp_jax.ops.lora.LoRAGemm`): a column layer's ``lora_a`` is replicated over
    the tensor axis and multiplies the same gathered input as the base, ``lora_b`` is
    split like the base's output columns; a row layer's ``lora_a`` is split like the
    base's input rows and its ``lora_b`` replicated, the adapter's partial products
    joining the base's before the one reduce-scatter (all-reduce).

    Attributes:
      rank: the adapters' rank ``r`` (a positive int).
      alpha: the scale's numerator (``alpha / rank``; PEFT's ``lora_alpha``).
      dropout: dropout on the adapter's input (PEFT's ``lora_dropout``); only 0.0 runs
        today (a ValueError names the fix for another value).
      targets: which linear layers get adapters, a subset of :data:`LORA_TARGETS`.
      base_dtype: how the frozen base kernels are stored: None (their ``param_dtype``),
        or one of :data:`LORA_BASE_DTYPES`.
      init_lora_weights: PEFT's option of the same name: True, ``lora_b`` starts at
        zeros (the adapted model is its base); False, at random (normal, std 0.02; zero
        outside each adapter's part of a fused kernel): the adapters change the model
        from the start, for tests of their arithmetic.
    """

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = LORA_TARGETS
    base_dtype: str | None = None
    init_lora_weights: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRAConfig.rank={self.rank!r} must be a positive int "
                             "(e.g. LoRAConfig(rank=16)).")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) \
                or not self.alpha > 0:
            raise ValueError(f"LoRAConfig.alpha={self.alpha!r} must be a positive number "
                             "(PEFT's lora_alpha; the scale is alpha / rank).")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout={self.dropout!r} must be in [0, 1).")
        if self.dropout:
            raise ValueError(f"LoRAConfig.dropout={self.dropout!r}: dropout on the "
                             "adapters' input is not implemented yet; pass dropout=0.0.")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown or not targets or len(set(targets)) != len(targets):
            raise ValueError(f"LoRAConfig.targets={self.targets!r} must be distinct names "
                             f"among {LORA_TARGETS} (at least one).")
        object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in targets))
        if self.base_dtype is not None and self.base_dtype not in LORA_BASE_DTYPES:
            raise ValueError(f"LoRAConfig.base_dtype={self.base_dtype!r} must be None (the "
                             f"parameters' dtype) or one of {LORA_BASE_DTYPES}.")

    @property
    def scale(self) -> float:
        """``alpha / rank``: the factor of the adapter's product."""
        return float(self.alpha) / self.rank

    def to_dict(self) -> dict:
        """The fields as a JSON-ready dict (:meth:`from_dict` reads it back)."""
        return dataclasses.asdict(self) | {"targets": list(self.targets)}

    @classmethod
    def from_dict(cls, d: dict) -> LoRAConfig:
        """A LoRAConfig from :meth:`to_dict`'s dict; a ValueError naming unknown keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"LoRAConfig.from_dict: unknown keys {unknown}; known: "
                             f"{sorted(names)}.")
        return cls(**{k: tuple(v) if k == "targets" else v for k, v in d.items()})


def check_layer_args(where: str, parallel: Any, **sizes: Any) -> None:
    """A layer's constructor arguments: each of ``sizes`` a positive int (a ValueError
    naming it) and ``parallel`` a :class:`ParallelConfig` (a TypeError)."""
    for arg, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{where}: {arg}={value!r} must be a positive int.")
    if not isinstance(parallel, ParallelConfig):
        raise TypeError(f"{where}: parallel={parallel!r} must be a sp_jax.ParallelConfig "
                        "(use ParallelConfig.from_dict for a plain dict).")

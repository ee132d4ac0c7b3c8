"""Memory planner: per-GPU memory of a GPT training run on a GPU cluster, from deviceless
XLA:GPU compiles of the real training step, for every sensible layout.

``plan(model, gpus)`` enumerates meshes ``data x context x tensor`` (tensor within one
8-GPU host and dividing the heads; a context axis only for long sequences) and option
sets (sharding over data, remat, context parallelism; ``recompute_allgather`` always on),
and pipelined meshes ``stage x data x context x tensor`` (a 1F1B pipeline of
``4 x stages`` micro-batches over the GPUs beyond one tensor group, the stage count
dividing the layers: :func:`candidates`). It compiles
:func:`sp_jax.training.train_step_fn` (forward, backward, AdamW update, the parameters and
optimizer state donated) of :class:`sp_jax.models.GPT` with scanned layers for each on
abstract H100s (``1x1x8`` for 8 GPUs, hosts of 8 beyond: no GPU needed), and reads
``memory_analysis()``. Each row splits the per-GPU peak into parameters and optimizer
state (the per-device shards the compiled step takes), gradients (fp32, sharded like the
parameters) and activations/temporaries (XLA's temp minus the gradients), next to the
analytic values, and counts the collective bytes per step (each collective of the
compiled program times the trip counts of the loops around it).
``python -m sp_jax.plan`` prints the table.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sp_jax.analysis.shapes import MODELS, ModelShape

__all__ = ["MODELS", "PIPELINE_MICROBATCHES_PER_STAGE", "ModelShape", "PlanOption", "PlanRow",
           "candidates", "collective_bytes", "format_table", "pipeline_stage_counts",
           "layout_formula", "plan", "plan_one", "shape_line", "expert_fsdp_bytes"]

GiB = 2**30
H100_BYTES = 80 * 10**9

XLA_DOES_NOT_FIT = (
    re.compile(r"E\d{4} [\d:.]+ +\d+ gpu_hlo_schedule\.cc:\d+\] The byte size of input/output "
               r"arguments \(\d+\) exceeds the base limit \(\d+\)\. This indicates an error in "
               r"the calculation!"),
    re.compile(r"W\d{4} [\d:.]+ +\d+ hlo_rematerialization\.cc:\d+\] Can't reduce memory use "
               r"below .*by rematerialization.*"),
)
"""What XLA:GPU prints (stderr) when a layout's arguments exceed its scheduler's memory
limit (it calls that an error in *its* calculation) and remat cannot get under it. Not a
failure: :func:`plan_one` keeps these lines out and explains them (:attr:`PlanRow.xla_notes`)."""


SLOW_COMPILE = (
    re.compile(r"E\d{4} [\d:.]+ +\d+ slow_operation_alarm\.cc:\d+\].*"),
    re.compile(r"\*{8,}"),
    re.compile(r"\[Compiling module .*\] Very slow compile\?.*"),
    re.compile(r"The operation took .*"),
    re.compile(r"\s*"),  # the box's blank lines
)
"""XLA's "Very slow compile?" box on stderr (a large model's compile takes minutes on a
few CPU cores: expected here), kept out of the planner's output."""


PIPELINE_MICROBATCHES_PER_STAGE = 4
"""Micro-batches of a pipelined layout per stage (``M = 4 x stages`` unless given): the
1F1B schedule's memory does not depend on ``M`` (each stage keeps at most
``2 x stages - 1`` stage inputs), and its idle fraction, ``(P - 1) / (M + P - 1)`` with
``P`` stages (:func:`sp_jax.pipeline.bubble_formula`), is below 1/5 at ``M = 4P``."""


@dataclasses.dataclass(frozen=True)
class PlanOption:
    """One layout: mesh ``data x context x tensor``, or ``stages x data x context x
    tensor`` with a pipeline (``stages > 1``), and the options of the run.

    Attributes:
      data / context / tensor: the mesh's axis sizes.
      fsdp: parameters and optimizer state sharded over data.
      remat: each layer's activations recomputed in the backward.
      micro_batches: micro-batches of one step; with a pipeline the pipeline's ``M``
        (the step's batch ``[M, batch / M, seq]``).
      context_parallel: the context-parallel attention (with ``context > 1``).
      stages: pipeline stages (the ``stage`` mesh axis, outermost); 1: no pipeline.
      pipeline_schedule: ``"1f1b"`` or ``"gpipe"`` (with ``stages > 1``).
      expert: the expert axis' size (``> 1``: a mixture of experts' experts split over it,
        mesh ``data x expert x context x tensor``; it carries the batch like data).
    """

    data: int
    context: int
    tensor: int
    fsdp: bool
    remat: bool
    micro_batches: int = 1
    context_parallel: str = "ring"
    stages: int = 1
    pipeline_schedule: str = "1f1b"
    expert: int = 1

    def __post_init__(self) -> None:
        from sp_jax.config import PIPELINE_SCHEDULES

        for name in ("data", "context", "tensor", "micro_batches", "stages", "expert"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PlanOption: {name}={value!r} must be a positive int.")
        if self.pipeline_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"PlanOption: pipeline_schedule={self.pipeline_schedule!r} is "
                             f"not one of {PIPELINE_SCHEDULES}.")

    @property
    def pipelined(self) -> bool:
        """Whether the layout runs a pipeline (``stages > 1``)."""
        return self.stages > 1

    @property
    def gpus(self) -> int:
        return self.stages * self.data * self.expert * self.context * self.tensor

    @property
    def batch_shards(self) -> int:
        """How many ways the batch is split: the data and expert axes."""
        return self.data * self.expert

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh: ``(stages, data, context, tensor)`` with a pipeline, ``(data,
        expert, context, tensor)`` with an expert axis, else ``(data, context, tensor)``
        (:attr:`axis_names`)."""
        inner = (self.data, self.context, self.tensor) if self.expert == 1 else \
            (self.data, self.expert, self.context, self.tensor)
        return (self.stages, *inner) if self.pipelined else inner

    @property
    def axis_names(self) -> tuple[str, ...]:
        """``("stage", "data", "context", "tensor")`` with a pipeline, ``("data",
        "expert", "context", "tensor")`` with an expert axis, else ``("data", "context",
        "tensor")``."""
        inner = ("data", "context", "tensor") if self.expert == 1 else \
            ("data", "expert", "context", "tensor")
        return ("stage", *inner) if self.pipelined else inner

    @property
    def bubble(self) -> float:
        """Idle fraction of the pipeline's time, ``(P - 1) / (M + P - 1)``
        (:func:`sp_jax.pipeline.bubble_formula`: 1F1B's ticks without any forward, or any
        backward, skip that half); 0 without a pipeline."""
        if not self.pipelined:
            return 0.0
        from sp_jax.pipeline import bubble_formula

        return bubble_formula(self.stages, self.micro_batches)

    @property
    def label(self) -> str:
        opts = ["recompute_allgather"] + (["fsdp"] if self.fsdp else []) + (
            [f"experts over {self.expert}"] if self.expert > 1 else []) + (
            ["remat"] if self.remat else []) + (
            [self.context_parallel] if self.context > 1 else [])
        mesh = "x".join(str(n) for n in self.mesh_shape)
        if self.pipelined:
            opts.append(f"{self.pipeline_schedule} ({self.stages} stages, "
                        f"M={self.micro_batches}, bubble {100 * self.bubble:.0f}%)")
        elif self.micro_batches > 1:
            opts.append(f"{self.micro_batches} micro-batches")
        return f"{mesh} " + "+".join(opts)


@dataclasses.dataclass(frozen=True)
class PlanRow:
    """Per-GPU bytes of one layout (``compiled``: from the compile; ``formula``: analytic)."""

    option: PlanOption
    batch: int
    param_bytes: int
    opt_bytes: int
    grad_bytes: int
    activation_bytes: int
    peak_bytes: int
    fits: bool
    collective_bytes: int
    formula_param_bytes: float
    formula_activation_bytes: float
    compile_s: float
    error: str = ""
    xla_notes: tuple[str, ...] = ()
    host_bytes: int = 0       # host arguments + temp (offloaded state), with ``memory``
    memory: Any = None        # the MemoryOptions compiled (plan_one's ``memory``), or None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"label": self.option.label}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tensor_size(model: ModelShape, gpus: int, max_tensor: int) -> int:
    """The largest tensor size within a host (``max_tensor``) dividing the GPUs and the
    heads."""
    return max(d for d in _divisors(gpus) if d <= max_tensor and model.heads % d == 0)


def _split(model: ModelShape, rest: int, tensor: int, long_context: int
           ) -> list[tuple[int, int]]:
    """``(data, context)`` meshes of ``rest`` GPUs: all over data, or for sequences of
    ``long_context`` tokens or more the two with the largest context sizes that divide
    the sequence into zigzag chunks."""
    if model.seq >= long_context:
        meshes = [(rest // c, c) for c in _divisors(rest)
                  if c > 1 and model.seq % (2 * c * tensor) == 0][-2:]
        if meshes:
            return meshes
    return [(rest, 1)]


def pipeline_stage_counts(model: ModelShape, gpus: int, *, max_tensor: int = 8
                          ) -> list[int]:
    """Every stage count ``> 1`` a pipelined layout of ``model`` on ``gpus`` GPUs can
    have: dividing the layers and the GPUs beyond one tensor group
    (``gpus / tensor``; the stage axis is outermost, across hosts)."""
    rest = gpus // _tensor_size(model, gpus, max_tensor)
    return [p for p in _divisors(rest) if p > 1 and model.layers % p == 0]


def _check_stages(model: ModelShape, gpus: int, stages: Sequence[int], max_tensor: int
                  ) -> list[int]:
    """``stages`` without the 1s, each checked (ValueError naming it and the fix)."""
    tensor = _tensor_size(model, gpus, max_tensor)
    possible = pipeline_stage_counts(model, gpus, max_tensor=max_tensor)
    out = []
    for p in stages:
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise ValueError(f"plan: stages={p!r} must be a positive int (1: no pipeline).")
        if p == 1:
            continue
        if model.layers % p:
            raise ValueError(
                f"plan: stages={p} does not divide the {model.layers} layers of "
                f"{model.name} (each stage runs layers / stages of them); use one of "
                f"{possible or 'none: no pipeline fits these layers and GPUs'}.")
        if (gpus // tensor) % p:
            raise ValueError(
                f"plan: stages={p} does not divide the {gpus // tensor} GPU groups beyond "
                f"the tensor size {tensor} of {gpus} GPUs (stages x data x context x "
                f"tensor = GPUs); use one of "
                f"{possible or 'none: no pipeline fits these layers and GPUs'}, or "
                f"{p * tensor}, {2 * p * tensor}, ... GPUs.")
        out.append(p)
    return out


def candidates(model: ModelShape, gpus: int, *, max_tensor: int = 8,
               long_context: int = 32768, stages: Sequence[int] | None = None,
               microbatches: int | None = None, batch: int | None = None
               ) -> list[PlanOption]:
    """The layouts :func:`plan` compiles for ``model`` on ``gpus`` GPUs.

    Without a pipeline: tensor = the largest size within a host that divides the heads
    (TP beyond a host is never worth it); the rest of the GPUs over data, or, for
    sequences of ``long_context`` tokens or more, over context (ring) or split between
    the two; each mesh without and with sharding over data and with and without remat
    (the replicated run without remat only when nothing else is tried, as it never uses
    less memory; sharding over data only where the data size divides the hidden size).

    Pipelined (``stage x data x context x tensor``, the same tensor size, the stage axis
    outermost): for each stage count of ``stages`` (default: the two largest of
    :func:`pipeline_stage_counts`, which use the least memory; ``()`` or ``[1]``: no
    pipeline) the rest split as above (one mesh: the larger context size), a 1F1B
    schedule of ``microbatches`` micro-batches (default: ``batch / data``, one sequence
    per micro-batch and data shard, when ``batch`` is given, else
    :data:`PIPELINE_MICROBATCHES_PER_STAGE` ``x stages``), without sharding over data,
    with and without remat, and with both where the data size is above 1 and divides the
    hidden size.

    Raises:
      ValueError: a stage count that does not divide the layers or the GPUs beyond the
        tensor group, or a non-positive ``microbatches``.
    """
    if microbatches is not None and (isinstance(microbatches, bool)
                                     or not isinstance(microbatches, int) or microbatches < 1):
        raise ValueError(f"plan: microbatches={microbatches!r} must be a positive int.")
    if model.moe:
        return _moe_candidates(model, gpus, max_tensor)
    t = _tensor_size(model, gpus, max_tensor)
    rest = gpus // t
    out = []
    for d, c in _split(model, rest, t, long_context):
        out += [PlanOption(d, c, t, fsdp=False, remat=True)]
        if d > 1 and model.hidden % d == 0:  # sharding over data splits the hidden size
            out += [PlanOption(d, c, t, fsdp=True, remat=False),
                    PlanOption(d, c, t, fsdp=True, remat=True)]
        else:
            out += [PlanOption(d, c, t, fsdp=False, remat=False)]
    if t > 1 and gpus <= max_tensor and model.seq < long_context and model.hidden % gpus == 0:
        # one host: pure data parallelism with everything sharded over data (ZeRO-3)
        out += [PlanOption(gpus, 1, 1, fsdp=True, remat=True)]
    if stages is None:
        stage_counts = pipeline_stage_counts(model, gpus, max_tensor=max_tensor)[-2:]
    else:
        stage_counts = _check_stages(model, gpus, stages, max_tensor)
    for p in stage_counts:
        d, c = _split(model, rest // p, t, long_context)[-1]
        m = microbatches or (batch // d if batch and batch % d == 0
                             else PIPELINE_MICROBATCHES_PER_STAGE * p)
        kw = {"micro_batches": m, "stages": p, "pipeline_schedule": "1f1b"}
        out += [PlanOption(d, c, t, fsdp=False, remat=False, **kw),
                PlanOption(d, c, t, fsdp=False, remat=True, **kw)]
        if d > 1 and model.hidden % d == 0:
            out += [PlanOption(d, c, t, fsdp=True, remat=True, **kw)]
    return out


def _moe_candidates(model: ModelShape, gpus: int, max_tensor: int) -> list[PlanOption]:
    """A mixture of experts' layouts (no pipeline, no context axis): for tensor sizes 1
    and 2 (within a host, dividing the heads and key/value heads), the experts over the
    largest expert axis dividing them and the GPUs left, the rest over data; each with
    parameters sharded over the batch axes (the experts over the data axes too) and
    remat, and sharded without remat."""
    out = []
    for t in (1, 2):
        kv = model.kv_heads or model.heads
        if gpus % t or t > max_tensor or model.heads % t or (kv % t and t % kv):
            continue
        ep = math.gcd(model.experts, gpus // t)
        d = gpus // (t * ep)
        for remat in (True, False):
            out.append(PlanOption(d, 1, t, fsdp=True, remat=remat, expert=ep))
    return out


def layout_formula(model: ModelShape, option: PlanOption, batch: int) -> tuple[float, float]:
    """(parameter bytes, activation bytes) per device.

    fp32 parameters: kernels and the vocabulary table over tensor, and data with fsdp (a
    table whose vocabulary t does not divide: its features over tensor only, the layout
    of :class:`~sp_jax.layers.VocabParallelEmbedding`); the MLP-up bias over tensor; the
    other biases and the norms replicated; with a pipeline the layers' parameters also
    over the stages (the vocabulary table and the final norm on every stage).

    Activations of one micro-batch of ``b = batch / (data M)`` sequences: with remat each
    layer keeps its bf16 input ``[b, s, h] / (c t)`` plus one layer's TP+SP residuals
    (34 s b h / (c t) bytes, Korthikanti et al. with selective recomputation; with a
    head_dim, the 8 s b h of q, k, v and the output projection's input scaled by ``heads x
    head_dim / h``), else
    every layer's. A pipeline's stage runs ``L / P`` of the layers; 1F1B keeps up to
    ``2 P - 1`` bf16 stage inputs (its ring of slots) and one micro-batch's activations
    of its layers (the backward's recomputed forward, the schedule of
    :mod:`sp_jax.pipeline`); GPipe every micro-batch's. Temporaries beyond the
    activations (gathered weights, gradient accumulators, the vocabulary's logits) are
    not counted.
    """
    h, t, L, p = model.hidden, option.tensor, model.layers, option.stages
    if model.moe:
        return _moe_formula(model, option, batch)
    shards = t * (option.data if option.fsdp else 1)
    if model.vocab % t == 0:
        table = model.vocab * h / shards
    else:  # the library splits the features of such a table over tensor, not over data
        table = model.vocab * h / (t if h % t == 0 else 1)
    layers = (L * (4 * h * model.attention + 2 * h * model.mlp) / shards + L * model.mlp / t
              + L * 6 * h)
    params = 4 * (layers / p + table + 2 * h)
    b = batch // option.data // option.micro_batches
    sbh = model.seq * b * model.hidden / (option.context * option.tensor)
    per_layer = 26 * sbh + _attention_bytes(model, sbh, option.tensor)
    depth = L // p
    acts = depth * 2 * sbh + per_layer if option.remat else depth * per_layer
    if option.pipelined:
        if option.pipeline_schedule == "1f1b":
            acts += (2 * p - 1) * 2 * sbh
        else:
            acts *= option.micro_batches
    return params, acts


def _moe_formula(model: ModelShape, option: PlanOption, batch: int) -> tuple[float, float]:
    """:func:`layout_formula` of a mixture of experts: fp32 parameters, the experts over
    expert x tensor (and data with fsdp), the rest over tensor (and data x expert with fsdp);
    the activations as GPT blocks of the active MLP width ``k F``, plus per layer the
    rows of the dispatch's static receive buffer (``ep T min(k, E / ep)``, the worst
    case) through the grouped GEMMs: bf16, the received rows and their gradient (``2 h``),
    ``2F / t`` up-projected and ``F / t`` activated, and with an expert axis the ``T k``
    routed copies of the tokens six times (``h`` each: sorted for the dispatch, returned,
    their gradients and XLA's transposes of them; measured, the live ranges of
    DeepSeek-V3's 2-layer slice on expert 8 and 16 at the peak of its expert layer's
    backward, deviceless H100 compiles, BENCHMARKS.md), or, where larger (few expert
    devices: many experts a GPU), the up-projection's weight-gradient moment: the
    received rows and their gradient, the up-projection's gradient, two token-side
    copies and its fp32 accumulator ``[E / ep, h, 2F / t]`` (the peak of DeepSeek-V3's
    and Kimi K2's slices at expert 4); the shared
    experts (dense over tensor, with the attention) likewise for the ``T`` tokens. With
    fsdp over data, :func:`expert_fsdp_bytes`. The grouped GEMMs are counted by their
    routed rows: XLA's masked ``ragged_dot`` lowering's ``[E / ep, rows, F]`` buffers
    (BENCHMARKS.md "Mixture of experts") are not, the compiled plan measures them."""
    h, t, ep = model.hidden, option.tensor, option.expert
    fsdp = option.batch_shards if option.fsdp else 1
    f = model.moe_mlp_hidden or model.mlp
    experts = model.experts * 3 * h * f / (ep * t * (option.data if option.fsdp else 1))
    split, up, whole, norms = model.attention_params
    attention = split / (t * fsdp) + up / t + whole / fsdp + norms + 2 * h
    moe = experts + attention + 3 * h * f * model.shared_experts / (t * fsdp) + \
        h * model.experts
    dense = attention + 3 * h * model.mlp / (t * fsdp)  # the first dense_layers layers
    params = 4 * ((model.layers - model.dense_layers) * moe + model.dense_layers * dense
                  + 2 * model.vocab * h / (t * fsdp) + h)
    b = batch // option.batch_shards // option.micro_batches
    tokens = b * model.seq
    sbh = tokens * h / t
    rows = ep * tokens * min(model.experts_per_token, model.experts // ep)
    common = 26 * sbh + _attention_bytes(model, sbh, t)
    pairs = tokens * model.experts_per_token  # the token side of the dispatch, [T k, h]
    token_side = pairs * h if ep > 1 else 0
    # the larger of two moments of an expert layer's backward: the dispatch's (the
    # received rows and their gradient, the up-projection and activation, six token-side
    # copies) and the up-projection's weight gradient (the received rows and their
    # gradient being built, the up-projection's gradient, two token-side copies, its fp32
    # accumulator [E / ep, h, 2F / t]); measured, BENCHMARKS.md: the peak is the first at
    # expert 8 and 16, the second at expert 4 (64 and 96 experts a GPU)
    dispatch = 2 * rows * (2 * h + 3 * f / t) + 12 * token_side
    wgrad = 4 * rows * h + 4 * rows * f / t + 4 * token_side + \
        4 * model.experts / ep * h * 2 * f / t
    per_layer = common + max(dispatch, wgrad) \
        + 2 * 2 * tokens * 3 * f * model.shared_experts / t
    per_dense = common + 2 * 2 * tokens * 3 * model.mlp / t
    if option.remat:
        acts = model.layers * 2 * sbh + max(per_layer, per_dense if model.dense_layers else 0)
    else:
        acts = (model.layers - model.dense_layers) * per_layer + model.dense_layers * per_dense
    return params, acts + expert_fsdp_bytes(model, option)


def expert_fsdp_bytes(model: ModelShape, option: PlanOption) -> float:
    """What fsdp over data adds to a mixture of experts' device bytes (data > 1; else 0):
    the fp32 copy of the stacked expert kernels that XLA lays out with the hidden
    dimension major (each layer's shard is gathered over data along that non-major
    dimension inside the grouped GEMMs' ops, and XLA's layout assignment relays out the
    whole scanned stack once rather than each layer's slice): 4 bytes per expert
    parameter on the device (measured: ``f32[512, L, 32, 2048]`` and ``f32[512, L, 32,
    1024]`` beside the parameters at the peak of DeepSeek-V3's 2-, 4- and 6-layer slices
    on expert 8 x data 14 x tensor 2, deviceless H100 compiles; BENCHMARKS.md); and one
    layer's experts gathered over data in bf16 for its GEMMs (2 bytes per parameter of
    the layer's ``E / ep`` experts: with a small expert axis, the largest term; a layout
    without one gathers every expert)."""
    if not (model.experts > 1 and option.fsdp and option.data > 1):  # (1: Llama blocks)
        return 0.0
    f = model.moe_mlp_hidden or model.mlp
    gathered = 3 * model.hidden * f * model.experts / (option.expert * option.tensor)
    return 4 * gathered / option.data * (model.layers - model.dense_layers) + 2 * gathered


def _attention_bytes(model: ModelShape, sbh: float, tensor: int) -> float:
    """Bytes one layer's attention keeps for its backward, of ``sbh = s b h / (c t)``
    (:attr:`~sp_jax.analysis.shapes.ModelShape.attention_values`: bf16, the split values
    over ``c t``, the whole ones over ``c``): GPT blocks' ``8 s b h a / (h c t)``."""
    split, whole = model.attention_values
    return 2 * sbh * (split + whole * tensor) / model.hidden


def collective_bytes(hlo: str) -> int:
    """Per-device bytes the collectives of a compiled program (its optimized HLO text)
    move per step: each collective's bytes times the runs of its computation
    (:func:`sp_jax.analysis.hlo.execution_counts`: the trip counts of the while loops
    around it, so a scanned layer's collectives count once per layer also when XLA
    unrolls or double-buffers the loop; a branch of a conditional as if it ran every
    time, an upper bound where a pipeline's ticks skip work; once where a loop's trip
    count is unknown)."""
    from sp_jax.analysis.hlo import execution_counts, parse_collectives

    runs = execution_counts(hlo)
    return sum(c.bytes * (runs.get(c.computation) or 1) for c in parse_collectives(hlo))


def _device_bytes(tree: Any, itemsize: int | None = None) -> int:
    """Bytes one device holds of the abstract arrays in ``tree`` (from their shardings),
    each element ``itemsize`` bytes if given, else its dtype's."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        local = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(local) * (itemsize or np.dtype(leaf.dtype).itemsize)
    return total


def _batch_error(batch: int, option: PlanOption) -> str:
    """Why ``batch`` sequences do not fit ``option``, and what would."""
    n = option.batch_shards * option.micro_batches
    return (f"batch={batch} does not split into {option.micro_batches} micro-batch"
            f"{'es' if option.micro_batches > 1 else ''} over data {option.batch_shards} of "
            f"{option.label}; use a multiple of {n} sequences")


def plan_one(model: ModelShape, option: PlanOption, *, batch: int | None = None,
             target: str = "h100", memory: Any = None) -> PlanRow:
    """Compiles the training step of ``model`` under ``option`` for ``option.gpus``
    abstract GPUs and returns its per-GPU memory. ``batch``: global sequences per step
    (default: one per data shard and micro-batch), as ``option.micro_batches``
    micro-batches (with a pipeline: the pipeline's, ``ParallelConfig(pipeline_axis=
    "stage", pipeline_microbatches=M, pipeline_schedule=...)`` on the mesh
    ``stage x data x context x tensor``). A layout the model or the batch does not divide
    over is a row with ``error`` set.

    ``memory``: a :class:`sp_jax.analysis.memory_options.MemoryOptions` (its ``fsdp``
    replaces the option's): the step as :class:`~sp_jax.training.TrainStep` runs it with
    them (:func:`sp_jax.training.adamw` with the moments' dtype, ZeRO-1's update shardings
    and data-manual graph, the offloaded state in ``pinned_host``, activation offload),
    Llama-blocks presets (``experts=1``) as the dense model they stand for; the row's
    ``host_bytes`` are its host arguments and temp."""
    import optax
    from flax import nnx

    from sp_jax._quiet import filtered_stderr
    from sp_jax.analysis.gpu import compile_for_gpu, gpu_mesh
    from sp_jax.analysis.memory_step import compile_with_memory, memory_adamw, zero1_step
    from sp_jax.config import ParallelConfig
    from sp_jax.layout import Layout
    from sp_jax.models import GPT
    from sp_jax.training.step import train_step_fn, trained_filter, trained_state

    batch = batch or option.batch_shards * option.micro_batches
    axes, shape = option.axis_names, option.mesh_shape
    pipeline = {"pipeline_axis": "stage", "pipeline_microbatches": option.micro_batches,
                "pipeline_schedule": option.pipeline_schedule} if option.pipelined else {}
    experts = {"expert_axis": "expert"} if option.expert > 1 else {}
    parallel = ParallelConfig(
        recompute_allgather=True, wgrad_dtype=jnp.float32,
        fsdp=option.fsdp if memory is None else memory.fsdp,
        context_parallel=option.context_parallel if option.context > 1 else None,
        offload_activations=bool(memory is not None and memory.offload_activations),
        **pipeline, **experts)
    dense = {"num_experts": 0} if memory is not None and model.experts == 1 else {}
    cfg = model.gpt_config(remat=option.remat, **dense)
    tx = optax.adamw(1e-4) if memory is None else memory_adamw(memory)
    t0 = time.perf_counter()
    formula_params, formula_acts = layout_formula(model, option, batch)
    if batch % (option.batch_shards * option.micro_batches):
        return PlanRow(option, batch, 0, 0, 0, 0, 0, False, 0, formula_params,
                       formula_acts, 0.0, error=_batch_error(batch, option))
    mesh = gpu_mesh(shape, axes, target=target)
    with jax.set_mesh(mesh):
        try:
            gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        except ValueError as e:  # a layout the model does not divide over: reported
            return PlanRow(option, batch, 0, 0, 0, 0, 0, False, 0, formula_params,
                           formula_acts, time.perf_counter() - t0,
                           error=f"ValueError: {str(e).splitlines()[0][:200]}")
        # (with LoRA: the adapters; the frozen base is with the rest of the state)
        graphdef, params, rest = nnx.split(gpt, trained_filter(gpt), ...)
        trained = trained_state(params)  # no router biases: no optimizer state
        zero1 = zero1_step(gpt, trained, parallel, mesh) if memory is not None else {}
        opt_state = jax.eval_shape(tx.init, zero1.pop("state_of", trained))
    micro = batch // option.micro_batches
    tokens = jax.ShapeDtypeStruct((option.micro_batches, micro, model.seq), jnp.int32,
                                  sharding=Layout.of(parallel).micro_batched_tokens)
    batch_tree = {"tokens": tokens, "labels": tokens}
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)

    param_bytes, opt_bytes = _device_bytes(params), _device_bytes(opt_state)
    grad_bytes = _device_bytes(params, itemsize=4)  # fp32 gradients, sharded like params
    host = 0
    try:
        with filtered_stderr(XLA_DOES_NOT_FIT + SLOW_COMPILE) as notes:
            if memory is None:
                report = compile_for_gpu(train_step_fn(graphdef, tx), params, rest,
                                         opt_state, batch_tree, key, mesh_shape=shape,
                                         axis_names=axes, target=target,
                                         donate_argnums=(0, 2))
                hlo, temp, peak = report.hlo, report.temp_bytes, report.peak_bytes
            else:
                hlo, temp, peak, host = compile_with_memory(
                    graphdef, tx, params, rest, opt_state, batch_tree, key, mesh, memory,
                    cfg.dtype, zero1)
    except Exception as e:  # noqa: BLE001 - a layout that cannot compile is reported
        return PlanRow(option, batch, param_bytes, opt_bytes, grad_bytes, 0, 0, False, 0,
                       formula_params, formula_acts, time.perf_counter() - t0,
                       error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return PlanRow(
        option=option, batch=batch, param_bytes=param_bytes, opt_bytes=opt_bytes,
        grad_bytes=grad_bytes, activation_bytes=max(temp - grad_bytes, 0),
        peak_bytes=peak, fits=peak <= H100_BYTES, collective_bytes=collective_bytes(hlo),
        formula_param_bytes=formula_params, formula_activation_bytes=formula_acts,
        compile_s=time.perf_counter() - t0,
        xla_notes=tuple(n for n in notes if any(p.fullmatch(n) for p in XLA_DOES_NOT_FIT)),
        host_bytes=host, memory=memory)


def plan(model: ModelShape | str, gpus: int, *, options: Sequence[PlanOption] | None = None,
         batch: int | None = None, stages: Sequence[int] | None = None,
         microbatches: int | None = None, progress: bool = True,
         on_row: Callable[[PlanRow], None] | None = None, memory: Any = None
         ) -> list[PlanRow]:
    """:func:`plan_one` for every layout of ``options`` (default: :func:`candidates` with
    ``stages``, ``microbatches`` and ``batch``), with a progress bar (tqdm, on stderr)
    while it compiles; ``memory``: :func:`plan_one`'s, for every layout.

    Raises:
      ValueError: an unknown preset, a non-positive size, layouts that do not use
        ``gpus`` GPUs, a stage count the model or the GPUs do not divide into, or a
        ``batch`` that no layout can split."""
    if isinstance(model, str):
        if model not in MODELS:
            raise ValueError(f"plan: unknown model {model!r}; presets are {sorted(MODELS)} "
                             "(or pass a ModelShape).")
        model = MODELS[model]
    for name, value in (("gpus", gpus), ("batch", batch)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"plan: {name}={value!r} must be a positive int.")
    if options is None:
        options = candidates(model, gpus, stages=stages, microbatches=microbatches,
                             batch=batch)
    elif stages is not None or microbatches is not None:
        raise ValueError("plan: stages / microbatches choose the candidate layouts; with "
                         "options given, set them in each PlanOption instead.")
    options = list(options)
    bad = [o.label for o in options if o.gpus != gpus]
    if bad:
        raise ValueError(f"plan: layouts {bad} do not use {gpus} GPUs.")
    if batch is not None and options and all(batch % (o.batch_shards * o.micro_batches)
                                             for o in options):
        raise ValueError(f"plan: {_batch_error(batch, options[0])} (and likewise for every "
                         "other layout).")
    rows = []
    iterator = options
    if progress:
        from tqdm import tqdm

        iterator = tqdm(options, desc=f"compiling {model.name} on {gpus} GPUs", unit="layout")
    for option in iterator:
        rows.append(plan_one(model, option, batch=batch, memory=memory))
        if on_row is not None:
            on_row(rows[-1])
    return rows


def shape_line(model: ModelShape) -> str:
    """``"70b: h=8192, 80 layers, 64 heads, vocab 32000, s=4096 (64.69B parameters)"``."""
    heads = f"{model.heads} heads" + (f" of {model.head_dim}" if model.head_dim else "")
    return (f"{model.name}: h={model.hidden}, {model.layers} layers, {heads}, "
            f"vocab {model.vocab}, s={model.seq} ({model.params / 1e9:.2f}B parameters)")


def format_table(model: ModelShape, rows: Sequence[PlanRow], reserve: float = 0.0) -> str:
    """A markdown table of ``rows`` (GiB per GPU; MiB when every peak is below 1 GiB);
    with a ``reserve`` (bytes) a row fits when its peak plus the reserve is within 80 GB
    (:attr:`PlanRow.fits` has none)."""
    big = any(r.peak_bytes >= GiB for r in rows)
    unit, scale = ("GiB", GiB) if big else ("MiB", 2**20)

    def g(x: float) -> str:
        return f"{x / scale:.1f}"

    def fits(r: PlanRow) -> bool:
        return r.fits and r.peak_bytes + reserve <= H100_BYTES

    budget = "H100: 80 GB = 74.5 GiB" + (
        f", fits = peak + {reserve / GiB:.1f} GiB reserve <= 74.5 GiB" if reserve else "")
    head = f"{shape_line(model)}; {unit} per GPU ({budget})\n\n"
    pipelined = [r for r in rows if r.option.pipelined]
    mesh = "[stages x] data x context x tensor" if pipelined else \
        "data x expert x context x tensor" if any(r.option.expert > 1 for r in rows) else \
        "data x context x tensor"
    lines = [f"| layout ({mesh}, options) | batch | params (formula) | "
             "optimizer | gradients | activations + temp (formula) | peak | fits | "
             f"collectives {unit}/step |", "|" + "---|" * 9]
    for r in rows:
        if r.error:
            failed = "not compiled" if r.error.startswith("batch=") else "compile failed"
            lines.append(f"| {r.option.label} | {r.batch} | | | | | | {failed}: "
                         f"{r.error} | |")
            continue
        lines.append(
            f"| {r.option.label} | {r.batch} | {g(r.param_bytes)} ({g(r.formula_param_bytes)})"
            f" | {g(r.opt_bytes)} | {g(r.grad_bytes)} | {g(r.activation_bytes)} "
            f"({g(r.formula_activation_bytes)}) | {g(r.peak_bytes)} | "
            f"{'yes' if fits(r) else '**no**'} | {g(r.collective_bytes)} |")
    compiled = [r for r in rows if not r.error]
    if compiled and not any(fits(r) for r in compiled):
        best = min(compiled, key=lambda r: r.peak_bytes)
        budget = "80 GB" + (f" less a {reserve / GiB:.1f} GiB reserve" if reserve else "")
        lines.append(f"\nNo layout fits in {budget}: the best, {best.option.label}, needs "
                     f"{best.peak_bytes / GiB:.1f} GiB, "
                     f"{(best.peak_bytes + reserve - H100_BYTES) / GiB:.1f} GiB too many.")
    if pipelined:
        lines.append(
            "\nPipelined rows: mesh stages x data x context x tensor (the stage axis "
            "outermost, across hosts); each step runs M micro-batches (batch / (data M) "
            "sequences each) through the schedule; bubble: the idle fraction of its time, "
            "(stages - 1) / (M + stages - 1). Their collectives count every tick's work "
            "on every stage (an idle stage computes on zeros in lockstep).")
    arguments = [r for r in rows if any("exceeds the base limit" in line
                                        for line in r.xla_notes)]
    if arguments:
        limits = {int(m.group(1)) for r in arguments for line in r.xla_notes
                  if (m := re.search(r"exceeds the base limit \((\d+)\)", line))}
        limit = f" ({', '.join(f'{b / GiB:.1f} GiB' for b in sorted(limits))})"
        lines.append(
            f"\nXLA:GPU warned while compiling {', '.join(r.option.label for r in arguments)}: "
            "the arguments (parameters, optimizer state, batch) alone exceed the memory limit "
            f"its scheduler plans with{limit}, below the GPU's 80 GB, and rematerialization "
            "could not bring the program under that limit (its message calls this an error "
            "in its calculation). The peak above is what the compiled program needs; "
            "\"fits\" compares it with the GPU's memory.")
    remat_only = [r for r in rows if r.xla_notes and all(r is not a for a in arguments)]
    if remat_only:
        limits = {float(m.group(1)) for r in remat_only for line in r.xla_notes
                  if (m := re.search(r"Can't reduce memory use below ([\d.]+)GiB", line))}
        limit = f" ({', '.join(f'{b:.1f} GiB' for b in sorted(limits))})" if limits else ""
        lines.append(
            "\nXLA:GPU's rematerialization could not bring its estimate of the memory of "
            f"{', '.join(r.option.label for r in remat_only)} under the limit its scheduler "
            f"plans with{limit}, below the GPU's 80 GB (a warning, not a failure). The peak "
            "above is what the compiled program needs; \"fits\" compares it with the GPU's "
            "memory.")
    return head + "\n".join(lines)

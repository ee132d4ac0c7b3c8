"""What fits where: the memory planner's formula search over the memory options (issue 41).

For every layout of a model on ``gpus`` GPUs (``[stages x] data x [expert x] tensor``,
with and without remat) and every combination of

* ``fsdp``: ``False`` (replicated over data), ``"optimizer"`` (ZeRO-1: the optimizer
  state sharded over the batch axes, :class:`sp_jax.config.ParallelConfig`'s
  ``fsdp="optimizer"``), ``"full"`` (parameters, gradients and state sharded);
* ``moments``: AdamW's two moments in ``"fp32"`` or ``"bf16"``
  (:func:`sp_jax.training.adamw`'s ``mu_dtype`` / ``nu_dtype``);
* ``offload``: ``"off"``, ``"optimizer"`` (the moments in pinned host memory between
  steps: ``TrainStep(offload_optimizer=True)``) or ``"optimizer+params"`` (also the fp32
  master weights, a bf16 compute copy on the GPU: ``offload_params=True``);
* ``offload_activations``: what each layer keeps for its backward in host memory
  (``ParallelConfig(offload_activations=True)``),

:func:`search` computes the per-GPU device peak and host bytes from formulas: bytes per
parameter (:func:`bytes_per_param`: fp32 master 4, fp32 gradients 4, moments 8 or 4 in
bf16; ZeRO-1 divides the moments by the batch shards, ``"full"`` everything; offloaded
bytes count as host) times the parameters one GPU holds
(:func:`sp_jax.analysis.plan.layout_formula`), plus the activations of that formula
(with activation offload: one layer's on the device, the other layers' saved
activations on the host), plus what XLA's live ranges show the compiled step holding
beyond them (:func:`update_bytes`: the second fp32 buffer of the largest stacked leaf's
gradient accumulator, the new fp32 moments of that leaf, the offloaded moments moved back
for the update, ZeRO-1's gathered parameters). Other temporaries (gathered weights, the
logits) are not counted: the compile measures them (:mod:`sp_jax.analysis.confirm`: the
answer is confirmed by one; Mixtral-8x7B on 8 GPUs, ZeRO-1 + bf16 moments + optimizer
offload: 0.4 GiB above the formula).

A row fits when its device peak plus a reserve (:data:`DEFAULT_RESERVE`, ``python -m
sp_jax.plan --device-reserve``) is within an H100's 80 GB and its host bytes within the
host memory per GPU.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from sp_jax.analysis.plan import (
    H100_BYTES,
    GiB,
    ModelShape,
    PlanOption,
    expert_fsdp_bytes,
    layout_formula,
    pipeline_stage_counts,
)

__all__ = ["BASE_BYTES", "DEFAULT_RESERVE", "FSDP_MODES", "MOMENTS", "OFFLOADS", "FitRow",
           "MemoryOptions", "best", "bytes_per_param", "chosen_per_layout", "format_fits",
           "layouts", "lora_counts", "parse_bytes", "ranked", "reserve_note", "search",
           "update_bytes"]

FSDP_MODES = (False, "optimizer", "full")
MOMENTS = ("fp32", "bf16")
OFFLOADS = ("off", "optimizer", "optimizer+params")
HOST_BYTES_PER_NODE = 2 * 10**12
"""Host memory of one 8-GPU node the search checks against by default (2 TB)."""

DEFAULT_RESERVE = 4 * GiB
"""Device bytes a layout must leave free of the 80 GB (74.5 GiB) the planner counts per
H100 (``--device-reserve``, default 4 GiB: "fits" means a peak within 70.5 GiB). The
compile counts the step's buffers only; a real process also holds what it does not count:
the CUDA context and the cuBLAS / cuDNN workspaces (about 0.5 GiB per process: LLM-PQ
measures 430 MB of CUDA context), the NCCL communicators' buffers (one per mesh axis a
collective crosses, more with NVLink SHARP), and the allocator's fragmentation and
rounding outside XLA's one temp allocation. The 80 GB H100 reports about 79.1 GiB to
CUDA; JAX's pool takes a fraction of it (``XLA_PYTHON_CLIENT_MEM_FRACTION``; NVIDIA's
JAX-Toolbox Llama-70B scripts run with 0.85 to 0.90): 70.5 GiB is 0.89 of 79.1 GiB, within
the 71.2 GiB a pool of ``XLA_PYTHON_CLIENT_MEM_FRACTION=.9`` holds, the rest of the GPU
left to the context and NCCL. Before this reserve the planner's ZeRO-1 + bf16-moments answer for
Mixtral-8x7B on 8 GPUs compiled at 74.0 GiB of 74.5: 0.5 GiB for all of that."""


@dataclasses.dataclass(frozen=True)
class MemoryOptions:
    """One combination of the memory options (see the module's docstring)."""

    fsdp: bool | str = False
    moments: str = "fp32"
    offload: str = "off"
    offload_activations: bool = False

    def __post_init__(self) -> None:
        for name, allowed in (("fsdp", FSDP_MODES), ("moments", MOMENTS),
                              ("offload", OFFLOADS), ("offload_activations", (False, True))):
            value = getattr(self, name)
            if not any(value is a or (isinstance(a, str) and value == a) for a in allowed):
                raise ValueError(f"MemoryOptions: {name}={value!r} is not one of {allowed}.")

    @property
    def label(self) -> str:
        parts = {False: [], "optimizer": ["zero1"], "full": ["fsdp"]}[self.fsdp]
        parts = parts + (["bf16 moments"] if self.moments == "bf16" else [])
        parts += {"off": [], "optimizer": ["offload opt"],
                  "optimizer+params": ["offload opt+params"]}[self.offload]
        return "+".join(parts + (["offload acts"] if self.offload_activations else [])) or \
            "none"

    @property
    def cost(self) -> tuple[int, ...]:
        """Preference order (lower first): no host transfers, then no activation
        transfers, then the least sharding, then fp32 moments."""
        return (OFFLOADS.index(self.offload), int(self.offload_activations),
                FSDP_MODES.index(self.fsdp), MOMENTS.index(self.moments))


def bytes_per_param(options: MemoryOptions, shards: int) -> tuple[float, float, float]:
    """``(weights and gradients on the device, optimizer state on the device, host)``
    bytes per parameter with ``shards`` batch shards (data x expert): fp32 master 4 and
    fp32 gradients 4 (``/ shards`` with ``fsdp="full"``), moments 8 (bf16: 4; ``/ shards``
    with ``fsdp`` ``"optimizer"`` or ``"full"``); offloaded moments and master weights
    count as host bytes, with the master weights a bf16 copy (2 bytes) on the device."""
    full = shards if options.fsdp == "full" else 1
    state = shards if options.fsdp in ("optimizer", "full") else 1
    moments = (8 if options.moments == "fp32" else 4) / state
    master, grads = 4 / full, 4 / full
    host = 0.0
    if options.offload == "off":
        device_opt = moments
    else:
        device_opt, host = 0.0, moments
    if options.offload == "optimizer+params":
        host += master
        master = 2 / full
    return master + grads, device_opt, host


@dataclasses.dataclass(frozen=True)
class FitRow:
    """Per-GPU bytes of one layout and option set (formulas)."""

    layout: PlanOption
    options: MemoryOptions
    batch: int
    weights_bytes: float      # master weights (or their bf16 copy) and gradients
    optimizer_bytes: float    # the moments on the device
    activation_bytes: float
    host_bytes: float
    host_limit: float         # host bytes per GPU: per node / GPUs per node
    reserve: float = 0.0      # device bytes a layout leaves free (DEFAULT_RESERVE)
    update_bytes: float = 0.0  # XLA's buffers around the update (update_bytes())

    @property
    def device_bytes(self) -> float:
        return (self.weights_bytes + self.optimizer_bytes + self.activation_bytes
                + self.update_bytes)

    @property
    def fits(self) -> bool:
        return (self.device_bytes + self.reserve <= H100_BYTES
                and self.host_bytes <= self.host_limit)


def layouts(model: ModelShape, gpus: int, *, max_tensor: int = 8) -> list[PlanOption]:
    """The layouts :func:`search` tries: every tensor size within a host dividing the
    GPUs and the (key/value) heads (1 or 2 with experts); a mixture of experts' experts
    over each expert axis dividing them and the GPUs left (no pipeline); GPT
    blocks also pipelined over the stage counts of
    :func:`sp_jax.analysis.plan.pipeline_stage_counts` (1F1B, ``4 x stages``
    micro-batches); the rest over data; each with and without remat."""
    out = []
    kv = model.kv_heads or model.heads
    # experts: tensor 1 or 2, as the compiled planner (chosen while the experts' GEMMs were
    # XLA's masked ragged_dot, which expanded the rows once per local expert; with
    # grouped_matmul wider tensor axes are not yet searched: BENCHMARKS.md "Mixture of
    # experts")
    for t in (d for d in range(1, (2 if model.experts > 1 else max_tensor) + 1)
              if gpus % d == 0):
        if model.heads % t or (kv % t and t % kv):
            continue
        rest = gpus // t
        stage_counts = [1] if model.moe else [1] + [
            p for p in pipeline_stage_counts(model, gpus, max_tensor=max_tensor)
            if (rest % p == 0)]
        for ep in _expert_axes(model, rest):
            for p in stage_counts:
                d = rest // (ep * p)
                for remat in (True, False):
                    out.append(PlanOption(d, 1, t, fsdp=False, remat=remat, expert=ep,
                                          stages=p, micro_batches=4 * p if p > 1 else 1))
    return out


def _expert_axes(model: ModelShape, rest: int) -> list[int]:
    """The expert-axis sizes :func:`layouts` tries on ``rest`` GPUs (those beyond tensor):
    every size dividing the experts and ``rest`` (from the largest), the rest over data. A
    smaller expert axis holds more experts per GPU but a smaller dispatch receive buffer
    (``ep T min(k, E / ep)`` rows, dropless; :func:`~sp_jax.analysis.plan.layout_formula`
    weighs the two): DeepSeek-V3's fewest-GPU answer is expert 4 of 224 GPUs, Kimi K2's
    expert 8 of 448, not the largest axes (BENCHMARKS.md). 1 for a dense model."""
    if model.experts <= 1:
        return [1]
    g = math.gcd(model.experts, rest)
    return [e for e in range(g, 0, -1) if g % e == 0]


def _largest_leaf(model: ModelShape, layout: PlanOption, over_data: bool) -> float:
    """Parameters one GPU holds of the largest stacked leaf: a mixture's ``experts_up``
    ``[L, E / ep, h, 2F / t]`` (Llama blocks: the SwiGLU MLP-up ``[L, h, 2F / t]``), a GPT
    stack's MLP-up ``[L / P, h, mlp / t]``, or the vocabulary table ``[V, h / t]``;
    ``over_data``: also split over the batch axes, as fsdp splits a leaf (an expert leaf
    over data only)."""
    h, t, L = model.hidden, layout.tensor, model.layers
    dense = layout.batch_shards if over_data else 1
    if model.moe:
        f = model.moe_mlp_hidden or model.mlp
        up = (L - model.dense_layers) * (model.experts // layout.expert) * h * 2 * f / t
        up /= layout.data if over_data and model.experts > 1 else dense
    else:
        up = L // layout.stages * h * model.mlp / t / dense
    return max(up, model.vocab * h / t / dense)


def update_bytes(model: ModelShape, layout: PlanOption, options: MemoryOptions) -> float:
    """Device bytes the compiled step holds beyond the formula's state, gradients and
    activations: a rule read from XLA's live ranges at the compiled peak.

    * **The gradient accumulator's second buffer** (every mode): the backward pass of a
      scanned stack writes each layer's weight gradient into an fp32 ``[L, ...]`` stack
      (a ``dynamic_update_slice`` per layer), and XLA double-buffers that stack for the
      largest leaf (:func:`_largest_leaf`, sharded as its gradient: over data with
      ``fsdp="full"``): at the peak two fp32 buffers of the MLP-up gradient are live where
      the formula counts one: 4 bytes per parameter of that leaf (a mixture's
      ``experts_up``: 2, what Mixtral-8x7B's compiles keep).
    * **The new moments beside the old** (fp32 moments on the device): the update of that
      leaf writes its new fp32 moment before the old one is dead: 4 bytes per parameter
      of the leaf's state (over data with ZeRO-1 or fsdp) more.
    * replicated (``fsdp=False``): the gradients' reduction over the batch axes keeps a
      second fp32 copy of those it reduces (the accumulator's included; a mixture's expert
      leaves with data 1 are not reduced: Qwen3-30B-A3B on expert 4 x tensor 2, bf16
      moments, 53.0 GiB compiled against 67.7 when every gradient was counted, 54.4 now).
    * fp32 moments offloaded: XLA brings every moment back to the device for the update
      (its rematerialization cannot get under its limit), beside the accumulator's buffer.
    * ZeRO-1 of dense blocks: the update all-gathers the new fp32 parameters over data
      beside the old ones (``(1 - 1 / data)`` of them, every leaf resharded); after the
      backward, so the larger of that and the terms above.

    Measured (deviceless H100 compiles of the whole step, remat; compiled / formula, the
    difference in % of the compile; ``benchmarks/fits.py``,
    ``tests/test_plan.py``, BENCHMARKS.md "What fits where"):

    * Llama blocks h=2048, 16 layers, MLP 8192, s=256, vocab 4096 on data 4 x tensor 2
      (MiB, 2026-12-08): fsdp fp32 2371 / 2432 (+2.6), bf16 1698 / 1704 (+0.3), fp32
      offloaded 2063 / 2176 (+5.5), bf16 offloaded 1228 / 1231 (+0.3); ZeRO-1 fp32 6257 /
      6168 (-1.4), bf16 5529 / 5696 (+3.0), bf16 offloaded 4825 / 5223 (+8.3); replicated
      fp32 9565 / 9472 (-1.0). GPT blocks of the same size (4h MLP): fsdp fp32 1955 / 1829
      (-6.5: MLP-down's accumulator, as large as MLP-up's, is kept transposed and copied),
      ZeRO-1 fp32 4915 / 5065 (+3.0).
    * Mixture blocks, same size, 4 experts of 4096 (MiB): ZeRO-1 + bf16 on expert 4 x
      tensor 2 3419 / 3403 (-0.5), offloaded 2830 / 2546 (-10.0); on data 2 x expert 4,
      fsdp fp32 4322 / 4284 (-0.9), fsdp + bf16 offloaded 3008 / 2059 (-32: XLA also
      double-buffers ``experts_down``'s accumulator and brings both leaves' moments to the
      device ahead; not yet in the rule).
    * Llama-3-70B, fsdp on data 2 x tensor 8 (GiB): bf16 moments 57.3 / 60.1 (+5.0), fp32
      82.5 / 85.3 (+3.4); 8 layers fp32 11.07 / 11.05, bf16 7.90 / 8.10. The 405B shape,
      fsdp on data 16 x tensor 8, fp32: 59.8 / 65.7 (+9.9: XLA keeps the accumulator's
      second buffer, not the new moment). Before this rule (one moment of the largest leaf)
      the 70B fp32 row was 5.9 GiB under.
    * Mixtral-8x7B on expert 4 x tensor 2, ZeRO-1 + bf16 moments (GiB): offloaded 59.3 /
      58.9 (-0.7), not offloaded 74.0 / 80.6; fsdp on expert 8, bf16 offloaded 57.7 / 57.8,
      fp32 108.9 / 115.3.

    Where XLA is under memory pressure it keeps less than this (an upper bound there).
    """
    full = options.fsdp == "full"
    # a mixture's experts_up: XLA keeps half of the second buffer at Mixtral's size
    accumulator = (2 if model.experts > 1 else 4) * _largest_leaf(model, layout, full)
    state_leaf = _largest_leaf(model, layout, options.fsdp in ("optimizer", "full"))
    fp32 = options.moments == "fp32"
    params = 4 * _largest_leaf(model, layout, full) if options.offload == "optimizer+params" \
        else 0.0
    if options.offload != "off" and fp32:
        extra = accumulator + layout_formula(model, dataclasses.replace(
            layout, fsdp=options.fsdp in ("optimizer", "full")), layout.batch_shards *
            layout.micro_batches)[0] / 4 * 8 + params
    elif options.fsdp is False:  # fp32 gradients of the leaves reduced over the batch axes
        extra = layout_formula(model, layout, layout.batch_shards)[0]
        if model.experts > 1 and layout.data == 1:  # expert leaves: not reduced
            f = model.moe_mlp_hidden or model.mlp
            extra -= 4 * model.layers * model.experts * 3 * model.hidden * f / (
                layout.expert * layout.tensor)
    else:
        extra = accumulator + (4 * state_leaf if fp32 and options.offload == "off"
                                 else 0.0) + params
    if options.fsdp == "optimizer" and model.experts <= 1:
        # ZeRO-1 over data of dense blocks: the new parameters all-gathered beside the old
        held, state = (layout_formula(model, dataclasses.replace(layout, fsdp=f),
                                      layout.batch_shards)[0] for f in (False, True))
        extra = max(extra, held - state)
    return extra


BASE_BYTES = {None: 4.0, "bf16": 2.0, "int8": 1 + 4 / 64, "fp8": 1 + 4 / 64,
              "nf4": 0.5 + 1 / 64 + 8 / 64 / 256}
"""Bytes per frozen base parameter by ``LoRAConfig.base_dtype`` (None: the fp32
parameters; the quantized formats with their per-block absmaxes,
:mod:`sp_jax.ops.quant`: 64-row blocks, nf4's double-quantised in groups of 256)."""


def lora_counts(model: ModelShape, layout: PlanOption) -> tuple[float, float, float, float]:
    """Per GPU for LoRA fine-tuning (``model.lora_rank``): ``(frozen kernel parameters,
    other frozen parameters, adapter parameters, the largest kernel's parameters)``.
    Kernels over tensor (and the batch axes with fsdp, :func:`_row`'s caller divides);
    Llama blocks (``experts == 1``: grouped-query q/k/v, SwiGLU) or GPT blocks (fused
    multi-head q/k/v, a 4h MLP). The adapters as sp_jax holds them
    (:mod:`sp_jax.layers.lora`): one ``lora_a`` per fused kernel with a rank-``r``
    column block per part, ``lora_b`` rows of every part over all the kernel's columns."""
    if model.experts > 1 or model.mla:
        raise ValueError(f"{model.name}: the planner counts LoRA on dense blocks; sp_jax "
                         "refuses LoRA with experts and MLA (sp_jax.compat).")
    h, a, r, t = model.hidden, model.attention, model.lora_rank, layout.tensor
    layers = model.layers / layout.stages
    if model.experts == 1:  # Llama blocks
        kv, f = 2 * (model.kv_heads or model.heads) * model.head_size, model.mlp
        kernels = h * a + h * kv + a * h + 2 * h * f + f * h
        adapters = (h * 3 * r + 3 * r * (a + kv) / t + a / t * r + r * h
                    + h * 2 * r + 2 * r * 2 * f / t + f / t * r + r * h)
        largest = 2 * h * f
        others = 2 * model.vocab * h / t  # an untied head
    else:  # GPT blocks
        f = model.mlp
        kernels = 3 * h * a + a * h + 2 * h * f
        adapters = (h * 3 * r + 3 * r * 3 * a / t + a / t * r + r * h
                    + h * r + r * f / t + f / t * r + r * h)
        largest = h * f
        others = model.vocab * h / t
    return layers * kernels / t, others, layers * adapters, largest / t


def _lora_row(model: ModelShape, layout: PlanOption, options: MemoryOptions, batch: int,
              host_limit: float, reserve: float) -> FitRow:
    """:func:`_row` of LoRA fine-tuning: the frozen base (``BASE_BYTES`` a kernel
    parameter, 4 bytes the others; over the batch axes too with ``fsdp="full"``), the
    adapters with their fp32 gradients and moments (on the host with optimizer offload),
    the activations of the full fine-tune's formula (the adapters need the same inputs),
    and one kernel cast (dequantised) to bf16 for its GEMM."""
    kernels, others, adapters, largest = lora_counts(model, layout)
    shards = layout.batch_shards if options.fsdp == "full" else 1
    base = (BASE_BYTES[model.base_dtype] * kernels + 4 * others) / shards
    moments = (8 if options.moments == "fp32" else 4) * adapters
    weights = base + 8 * adapters  # adapters' fp32 master and gradients
    opt_bytes = moments if options.offload == "off" else 0.0
    host_bytes = moments - opt_bytes
    sharded = dataclasses.replace(layout, fsdp=options.fsdp == "full")
    acts = layout_formula(model, sharded, batch)[1]
    if options.offload_activations:
        one = layout_formula(model.replace(layers=layout.stages), sharded, batch)[1]
        host_bytes += acts - one
        acts = one
    return FitRow(layout, options, batch, weights, opt_bytes, acts, host_bytes, host_limit,
                  reserve, 2 * largest)


def _row(model: ModelShape, layout: PlanOption, options: MemoryOptions, batch: int,
         host_limit: float, reserve: float) -> FitRow:
    if model.lora:
        return _lora_row(model, layout, options, batch, host_limit, reserve)
    full = dataclasses.replace(layout, fsdp=True)
    rep_params = layout_formula(model, layout, batch)[0] / 4
    sharded_params = layout_formula(model, full, batch)[0] / 4
    held = sharded_params if options.fsdp == "full" else rep_params
    state = sharded_params if options.fsdp in ("optimizer", "full") else rep_params
    moments = (8 if options.moments == "fp32" else 4) * state
    params_host = options.offload == "optimizer+params"
    weights = 4 * held + (2 if params_host else 4) * held  # gradients + master (or bf16 copy)
    opt_bytes = moments if options.offload == "off" else 0.0
    host_bytes = (moments if options.offload != "off" else 0.0) + (4 * held if params_host
                                                                   else 0.0)
    sharded = dataclasses.replace(layout, fsdp=options.fsdp == "full")  # (its transients)
    acts = layout_formula(model, sharded, batch)[1]
    if options.offload_activations:
        one_layer = model.replace(layers=layout.stages, dense_layers=0)
        one = (layout_formula(one_layer, sharded, batch)[1]  # one layer of each stage
               - expert_fsdp_bytes(one_layer, sharded)
               + expert_fsdp_bytes(model, sharded))  # (the model's, on the device)
        host_bytes += acts - one
        acts = one
    return FitRow(layout, options, batch, weights, opt_bytes, acts, host_bytes, host_limit,
                  reserve, update_bytes(model, layout, options))


def search(model: ModelShape, gpus: int, *, host_bytes_per_node: float = HOST_BYTES_PER_NODE,
           gpus_per_node: int = 8, batch: int | None = None,
           reserve: float = DEFAULT_RESERVE,
           options: Sequence[MemoryOptions] | None = None) -> list[FitRow]:
    """Every layout of :func:`layouts` with every option set (default: all 36), each a
    :class:`FitRow`; ``batch``: global sequences per step (default: one per batch shard
    and micro-batch). Host bytes are checked against ``host_bytes_per_node /
    min(gpus, gpus_per_node)`` per GPU; a row fits when its device bytes plus ``reserve``
    (:data:`DEFAULT_RESERVE`: what a real process holds beyond the compiled step) are
    within an H100's 80 GB."""
    for name, value in (("gpus", gpus), ("gpus_per_node", gpus_per_node)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"search: {name}={value!r} must be a positive int.")
    if not reserve >= 0:
        raise ValueError(f"search: reserve={reserve!r} must be at least 0 (bytes).")
    if not host_bytes_per_node > 0:
        raise ValueError(f"search: host_bytes_per_node={host_bytes_per_node!r} must be "
                         "positive (e.g. 2e12 for 2 TB).")
    if options is None:
        options = [MemoryOptions(f, m, o, a) for f in FSDP_MODES for m in MOMENTS
                   for o in OFFLOADS for a in (False, True)]
    limit = host_bytes_per_node / min(gpus, gpus_per_node)
    rows = []
    for layout in layouts(model, gpus):
        b = batch or layout.batch_shards * layout.micro_batches
        if b % (layout.batch_shards * layout.micro_batches):
            continue
        # fsdp="full" splits the hidden dimension over the batch axes (the model refuses
        # a size that does not divide it)
        rows += [_row(model, layout, o, b, limit, reserve) for o in options
                 if o.fsdp != "full" or model.hidden % layout.batch_shards == 0]
    return rows


def _preference(r: FitRow) -> tuple:
    """:func:`best`'s order: the least offloading (:attr:`MemoryOptions.cost`), then the
    fewest host bytes (each crosses PCIe twice a step: bf16 moments halve them), then the
    least sharding, fp32 moments, the lowest device peak."""
    return (r.options.cost[:2], round(r.host_bytes / 2**20), r.options.cost[2:],
            r.device_bytes)


def ranked(rows: Sequence[FitRow]) -> list[FitRow]:
    """The rows that fit, the preferred first (:func:`best`'s order)."""
    return sorted((r for r in rows if r.fits), key=_preference)


def best(rows: Sequence[FitRow]) -> FitRow | None:
    """The cheapest row that fits, or None: the least offloading
    (:attr:`MemoryOptions.cost`), then the fewest host bytes (each crosses PCIe twice a
    step: bf16 moments halve them), then the least sharding, fp32 moments, the lowest
    device peak."""
    fitting = ranked(rows)
    return fitting[0] if fitting else None


def reserve_note(reserve: float) -> str:
    """How the planner's tables state the device budget and the reserve."""
    return (f"device: 80 GB = {H100_BYTES / GiB:.1f} GiB, of it {reserve / GiB:.1f} GiB "
            f"reserved (CUDA context, NCCL, fragmentation: --device-reserve): fits = "
            f"device peak <= {(H100_BYTES - reserve) / GiB:.1f} GiB")


def chosen_per_layout(rows: Sequence[FitRow]) -> dict[PlanOption, tuple[FitRow, FitRow]]:
    """Per layout (in ``rows``' order): the row without options and the cheapest that
    fits (:func:`best`; else the one with the lowest device peak)."""
    by_layout: dict[PlanOption, list[FitRow]] = {}
    for r in rows:
        by_layout.setdefault(r.layout, []).append(r)
    return {layout: (next((r for r in group if r.options == MemoryOptions()), group[0]),
                     best(group) or min(group, key=lambda r: r.device_bytes))
            for layout, group in by_layout.items()}


def format_fits(model: ModelShape, gpus: int, rows: Sequence[FitRow]) -> str:
    """A markdown table: per layout the cheapest option set that fits (else the one with
    the lowest device peak) and the layout without options; then the answer. The
    optimizer column adds XLA's buffers around the update (:func:`update_bytes`) as
    ``+ N update``."""
    def g(x: float) -> str:
        return f"{x / GiB:.1f}"

    limit = rows[0].host_limit if rows else 0
    reserve = rows[0].reserve if rows else 0
    lines = [f"{model.name} ({model.params / 1e9:.2f}B parameters, s={model.seq}) on {gpus} "
             f"GPUs, formulas: GiB per GPU ({reserve_note(reserve)}; host: "
             f"{limit / GiB:.0f} GiB per GPU)\n",
             "| layout | options | weights + grads | optimizer | activations | device peak | "
             "host | fits |", "|" + "---|" * 8]
    for layout, (plain, chosen) in chosen_per_layout(rows).items():
        for r in dict.fromkeys([plain, chosen]):
            staged = f" + {g(r.update_bytes)} update" if r.update_bytes else ""
            lines.append(f"| {layout.label.replace('recompute_allgather', 'rag')} | "
                         f"{r.options.label} | {g(r.weights_bytes)} | {g(r.optimizer_bytes)}"
                         f"{staged} | {g(r.activation_bytes)} | {g(r.device_bytes)} | "
                         f"{g(r.host_bytes)} | {'yes' if r.fits else '**no**'} |")
    top = best(rows)
    if top is None:
        low = min(rows, key=lambda r: r.device_bytes)
        lines.append(f"\nNothing fits: the lowest device peak, {low.layout.label} with "
                     f"{low.options.label}, is {g(low.device_bytes)} GiB (host "
                     f"{g(low.host_bytes)} GiB) + {g(reserve)} GiB reserve.")
    else:
        lines.append(f"\nFits: {top.layout.label} with {top.options.label}: device "
                     f"{g(top.device_bytes)} GiB + {g(reserve)} GiB reserve, host "
                     f"{g(top.host_bytes)} GiB per GPU "
                     f"({g(top.host_bytes * min(gpus, 8))} GiB per node).")
    return "\n".join(lines)


def parse_bytes(text: str) -> float:
    """``"2TB"`` (10**12), ``"2TiB"``, ``"512GB"``, ``"2048GiB"``, or a plain number of
    GiB, to bytes."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"{text!r} is not a size; write e.g. 2TB, 2048GiB or 2048 (GiB).")
    unit = (m.group(2) or "GiB").upper()
    power = "KMGT".index(unit[0]) + 1
    base = 1024 if "I" in unit else 1000
    return float(m.group(1)) * base**power

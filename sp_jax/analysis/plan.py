"""Memory planner: per-GPU memory of a GPT training run on a GPU cluster, from deviceless
XLA:GPU compiles of the real training step, for every sensible layout.

``plan(model, gpus)`` enumerates meshes ``data x context x tensor`` (tensor within one
8-GPU host and dividing the heads; a context axis only for long sequences) and option
sets (sharding over data, remat, context parallelism; ``recompute_allgather`` always on),
compiles :func:`sp_jax.training.train_step_fn` (forward, backward, AdamW update, the
parameters and optimizer state donated) of :class:`sp_jax.models.GPT` with scanned layers
for each on abstract H100s (``1x1x8`` for 8 GPUs, hosts of 8 beyond: no GPU needed), and
reads ``memory_analysis()``. Each row splits the per-GPU peak into parameters and
optimizer state (the per-device shards the compiled step takes), gradients (fp32, sharded
like the parameters) and activations/temporaries (XLA's temp minus the gradients), next to
the analytic values, and counts the collective bytes per step (ops inside the scanned
layer counted once per layer). ``python -m sp_jax.plan`` prints the table.
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

__all__ = ["MODELS", "ModelShape", "PlanOption", "PlanRow", "candidates", "format_table",
           "plan", "plan_one"]

GiB = 2**30
H100_BYTES = 80 * 10**9

XLA_DOES_NOT_FIT = (
    re.compile(r"E\d{4} [\d:.]+ +\d+ gpu_hlo_schedule\.cc:\d+\] The byte size of input/output "
               r"arguments \(\d+\) exceeds the base limit \(\d+\)\. This indicates an error in "
               r"the calculation!"),
    re.compile(r"W\d{4} [\d:.]+ +\d+ hlo_rematerialization\.cc:\d+\] Can't reduce memory use "
               r"below .*by rematerialization.*"),
)
"""What XLA:GPU prints (to stderr, from C++) when the arguments of a layout exceed the
memory limit its scheduler plans with (below the GPU's memory; it calls that an error in
*its* calculation), and rematerialization cannot bring the program under that limit. Not
a failure: :func:`plan_one` keeps these lines out of the output and says what they mean
(:attr:`PlanRow.xla_notes`, the note under :func:`format_table`)."""


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A GPT shape (:class:`sp_jax.models.GPTConfig` with rotary positions, bf16 compute,
    fp32 master weights, MLP width ``4 * hidden`` unless given)."""

    name: str
    hidden: int
    layers: int
    heads: int
    vocab: int
    seq: int
    mlp_hidden: int | None = None

    @property
    def mlp(self) -> int:
        return self.mlp_hidden or 4 * self.hidden

    @property
    def params(self) -> int:
        """Parameter count: per layer q/k/v/out kernels (4 h^2), MLP kernels (2 h mlp),
        the out-projection, MLP-up and MLP-down biases (h + mlp + h) and 2 LayerNorms
        (4 h); plus the tied vocabulary table and the final norm."""
        h = self.hidden
        return self.layers * (4 * h * h + 2 * h * self.mlp + self.mlp + 6 * h) \
            + self.vocab * h + 2 * h

    def replace(self, **kw: Any) -> ModelShape:
        return dataclasses.replace(self, **kw)


MODELS = {
    "gpt2-small": ModelShape("gpt2-small", hidden=768, layers=12, heads=12, vocab=50304,
                             seq=1024),
    "1.3b": ModelShape("1.3b", hidden=2048, layers=24, heads=16, vocab=50304, seq=2048),
    "7b": ModelShape("7b", hidden=4096, layers=32, heads=32, vocab=32000, seq=4096),
    "70b": ModelShape("70b", hidden=8192, layers=80, heads=64, vocab=32000, seq=4096),
}
"""Presets: GPT-2 small, a 1.3B, a 7B and a 70B shape (GPT blocks: 4h MLP with GeLU,
LayerNorm; the 7B and 70B have the Llama widths, depths and head counts)."""


@dataclasses.dataclass(frozen=True)
class PlanOption:
    """One layout: mesh ``data x context x tensor`` and the options of the run."""

    data: int
    context: int
    tensor: int
    fsdp: bool
    remat: bool
    micro_batches: int = 1
    context_parallel: str = "ring"

    @property
    def gpus(self) -> int:
        return self.data * self.context * self.tensor

    @property
    def label(self) -> str:
        opts = ["recompute_allgather"] + (["fsdp"] if self.fsdp else []) + (
            ["remat"] if self.remat else []) + (
            [self.context_parallel] if self.context > 1 else [])
        if self.micro_batches > 1:
            opts.append(f"{self.micro_batches} micro-batches")
        return f"{self.data}x{self.context}x{self.tensor} " + "+".join(opts)


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

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"label": self.option.label}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(model: ModelShape, gpus: int, *, max_tensor: int = 8,
               long_context: int = 32768) -> list[PlanOption]:
    """The layouts :func:`plan` compiles for ``model`` on ``gpus`` GPUs: tensor = the
    largest size within a host that divides the heads (TP beyond a host is never
    worth it); the rest of the GPUs over data, or, for sequences of ``long_context``
    tokens or more, over context (ring) or split between the two; each mesh without and
    with sharding over data and with and without remat (the replicated run without remat
    only when nothing else is tried, as it never uses less memory; sharding over data only
    where the data size divides the hidden size)."""
    t = max(d for d in _divisors(gpus) if d <= max_tensor and model.heads % d == 0)
    rest = gpus // t
    meshes = [(rest, 1)]
    if model.seq >= long_context:
        meshes = [(rest // c, c) for c in _divisors(rest)
                  if c > 1 and model.seq % (2 * c * t) == 0][-2:] or meshes
    out = []
    for d, c in meshes:
        out += [PlanOption(d, c, t, fsdp=False, remat=True)]
        if d > 1 and model.hidden % d == 0:  # sharding over data splits the hidden size
            out += [PlanOption(d, c, t, fsdp=True, remat=False),
                    PlanOption(d, c, t, fsdp=True, remat=True)]
        else:
            out += [PlanOption(d, c, t, fsdp=False, remat=False)]
    if t > 1 and gpus <= max_tensor and model.seq < long_context and model.hidden % gpus == 0:
        # one host: pure data parallelism with everything sharded over data (ZeRO-3)
        out += [PlanOption(gpus, 1, 1, fsdp=True, remat=True)]
    return out


def _formula(model: ModelShape, option: PlanOption, batch: int) -> tuple[float, float]:
    """(parameter bytes, activation bytes) per device. fp32 parameters: kernels and the
    vocabulary table (padded to a multiple of t) over tensor, and data with fsdp; the
    MLP-up bias over tensor; the other biases and the norms replicated. Activations: with
    remat each layer keeps its bf16 input ``[b, s, h] / (c t)`` plus one layer's TP+SP
    residuals (34 s b h / (c t) bytes, Korthikanti et al. with selective
    recomputation), else every layer's."""
    h, t, L = model.hidden, option.tensor, model.layers
    shards = t * (option.data if option.fsdp else 1)
    vocab = -(-model.vocab // t) * t
    params = 4 * ((L * (4 * h * h + 2 * h * model.mlp) + vocab * h) / shards
                  + L * model.mlp / t + L * 6 * h + 2 * h)
    b = batch // option.data // option.micro_batches
    sbh = model.seq * b * model.hidden / (option.context * option.tensor)
    per_layer = 34 * sbh
    acts = model.layers * 2 * sbh + per_layer if option.remat else model.layers * per_layer
    return params, acts


def _device_bytes(tree: Any, itemsize: int | None = None) -> int:
    """Bytes one device holds of the abstract arrays in ``tree`` (from their shardings),
    each element ``itemsize`` bytes if given, else its dtype's."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        local = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(local) * (itemsize or np.dtype(leaf.dtype).itemsize)
    return total


def plan_one(model: ModelShape, option: PlanOption, *, batch: int | None = None,
             target: str = "h100") -> PlanRow:
    """Compiles the training step of ``model`` under ``option`` for ``option.gpus``
    abstract GPUs and returns its per-GPU memory. ``batch``: global sequences per step
    (default: one per data shard and micro-batch)."""
    import optax
    from flax import nnx

    from sp_jax._quiet import filtered_stderr
    from sp_jax.analysis.gpu import compile_for_gpu, gpu_mesh
    from sp_jax.analysis.hlo import parse_collectives
    from sp_jax.config import ParallelConfig
    from sp_jax.layout import Layout
    from sp_jax.models import GPT, GPTConfig
    from sp_jax.training.step import train_step_fn

    batch = batch or option.data * option.micro_batches
    axes = ("data", "context", "tensor")
    shape = (option.data, option.context, option.tensor)
    parallel = ParallelConfig(
        recompute_allgather=True, wgrad_dtype=jnp.float32, fsdp=option.fsdp,
        context_parallel=option.context_parallel if option.context > 1 else None)
    cfg = GPTConfig(vocab_size=model.vocab, max_seq_len=model.seq, num_layers=model.layers,
                    num_heads=model.heads, hidden=model.hidden, mlp_hidden=model.mlp,
                    positions="rotary", dtype=jnp.bfloat16, param_dtype=jnp.float32,
                    scan_layers=True, remat=option.remat)
    tx = optax.adamw(1e-4)
    t0 = time.perf_counter()
    formula_params, formula_acts = _formula(model, option, batch)
    with jax.set_mesh(gpu_mesh(shape, axes, target=target)):
        try:
            gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        except ValueError as e:  # a layout the model does not divide over: reported
            return PlanRow(option, batch, 0, 0, 0, 0, 0, False, 0, formula_params,
                           formula_acts, time.perf_counter() - t0,
                           error=f"ValueError: {str(e).splitlines()[0][:200]}")
        graphdef, params, rest = nnx.split(gpt, nnx.Param, ...)
        opt_state = jax.eval_shape(tx.init, params)
    micro = batch // option.micro_batches
    tokens = jax.ShapeDtypeStruct((option.micro_batches, micro, model.seq), jnp.int32,
                                  sharding=Layout.of(parallel).micro_batched_tokens)
    batch_tree = {"tokens": tokens, "labels": tokens}
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)

    param_bytes, opt_bytes = _device_bytes(params), _device_bytes(opt_state)
    grad_bytes = _device_bytes(params, itemsize=4)  # fp32 gradients, sharded like params
    try:
        with filtered_stderr(XLA_DOES_NOT_FIT) as xla_notes:
            report = compile_for_gpu(train_step_fn(graphdef, tx), params, rest, opt_state,
                                     batch_tree, key, mesh_shape=shape, axis_names=axes,
                                     target=target, donate_argnums=(0, 2))
    except Exception as e:  # noqa: BLE001 - a layout that cannot compile is reported
        return PlanRow(option, batch, param_bytes, opt_bytes, grad_bytes, 0, 0, False, 0,
                       formula_params, formula_acts, time.perf_counter() - t0,
                       error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    collectives = 0
    for c in parse_collectives(report.hlo):
        scanned = "/while/body/" in c.op_name or "scan" in c.op_name
        collectives += c.bytes * (model.layers if scanned else 1)
    return PlanRow(
        option=option, batch=batch, param_bytes=param_bytes, opt_bytes=opt_bytes,
        grad_bytes=grad_bytes,
        activation_bytes=max(report.temp_bytes - grad_bytes, 0),
        peak_bytes=report.peak_bytes, fits=report.peak_bytes <= H100_BYTES,
        collective_bytes=collectives, formula_param_bytes=formula_params,
        formula_activation_bytes=formula_acts, compile_s=time.perf_counter() - t0,
        xla_notes=tuple(xla_notes))


def plan(model: ModelShape | str, gpus: int, *, options: Sequence[PlanOption] | None = None,
         batch: int | None = None, progress: bool = True,
         on_row: Callable[[PlanRow], None] | None = None) -> list[PlanRow]:
    """:func:`plan_one` for every layout of ``options`` (default :func:`candidates`),
    with a progress bar (tqdm, on stderr) while it compiles."""
    if isinstance(model, str):
        if model not in MODELS:
            raise ValueError(f"plan: unknown model {model!r}; presets are {sorted(MODELS)} "
                             "(or pass a ModelShape).")
        model = MODELS[model]
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"plan: gpus={gpus!r} must be a positive int.")
    options = list(options) if options is not None else candidates(model, gpus)
    bad = [o.label for o in options if o.gpus != gpus]
    if bad:
        raise ValueError(f"plan: layouts {bad} do not use {gpus} GPUs.")
    rows = []
    iterator = options
    if progress:
        from tqdm import tqdm

        iterator = tqdm(options, desc=f"compiling {model.name} on {gpus} GPUs", unit="layout")
    for option in iterator:
        rows.append(plan_one(model, option, batch=batch))
        if on_row is not None:
            on_row(rows[-1])
    return rows


def format_table(model: ModelShape, rows: Sequence[PlanRow]) -> str:
    """A markdown table of ``rows`` (GiB per GPU; MiB when every peak is below 1 GiB)."""
    big = any(r.peak_bytes >= GiB for r in rows)
    unit, scale = ("GiB", GiB) if big else ("MiB", 2**20)

    def g(x: float) -> str:
        return f"{x / scale:.1f}"

    head = (f"{model.name}: h={model.hidden}, {model.layers} layers, {model.heads} heads, "
            f"vocab {model.vocab}, s={model.seq} ({model.params / 1e9:.2f}B parameters); "
            f"{unit} per GPU (H100: 80 GB = 74.5 GiB)\n\n")
    lines = ["| layout (data x context x tensor, options) | batch | params (formula) | "
             "optimizer | gradients | activations + temp (formula) | peak | fits | "
             f"collectives {unit}/step |", "|" + "---|" * 9]
    for r in rows:
        if r.error:
            lines.append(f"| {r.option.label} | {r.batch} | | | | | | compile failed: "
                         f"{r.error} | |")
            continue
        lines.append(
            f"| {r.option.label} | {r.batch} | {g(r.param_bytes)} ({g(r.formula_param_bytes)})"
            f" | {g(r.opt_bytes)} | {g(r.grad_bytes)} | {g(r.activation_bytes)} "
            f"({g(r.formula_activation_bytes)}) | {g(r.peak_bytes)} | "
            f"{'yes' if r.fits else '**no**'} | {g(r.collective_bytes)} |")
    noted = [r.option.label for r in rows if r.xla_notes]
    if noted:
        limits = {int(m.group(1)) for r in rows for line in r.xla_notes
                  if (m := re.search(r"exceeds the base limit \((\d+)\)", line))}
        limit = f" ({', '.join(f'{b / GiB:.1f} GiB' for b in sorted(limits))})" if limits \
            else ""
        lines.append(
            f"\nXLA:GPU warned while compiling {', '.join(noted)}: the arguments (parameters, "
            "optimizer state, batch) alone exceed the memory limit its scheduler plans "
            f"with{limit}, below the GPU's 80 GB, and rematerialization could not bring the "
            "program under that limit (its message calls this an error in its calculation). "
            "The peak above is what the compiled program needs; \"fits\" compares it with "
            "the GPU's memory.")
    return head + "\n".join(lines)

"""The planner's answer confirmed by compile, and the command line that runs it.

:func:`sp_jax.analysis.memory_options.search` answers "what fits?" by formula;
:func:`confirm` compiles the answer (the whole training step as
:class:`~sp_jax.training.TrainStep` runs it: AdamW with the row's moments, ZeRO-1's update
shardings, the offloaded state in ``pinned_host``, donated parameters and state, scanned
layers, ``recompute_allgather``, bf16 compute, fp32 master weights) deviceless for H100s
and reads ``memory_analysis()``; where the compiled peak plus the reserve does not fit,
it compiles the next answer, so the answer printed is one a compile confirmed.
:func:`command_line` turns a row into the ``examples/train_gpt.py`` or
``examples/finetune_hf.py`` command that trains that layout with those options.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import time
from collections.abc import Callable, Sequence
from typing import Any

from sp_jax.analysis.memory_options import FitRow, ranked
from sp_jax.analysis.plan import H100_BYTES, XLA_DOES_NOT_FIT, ModelShape

SLOW_COMPILE = (
    re.compile(r"E\d{4} [\d:.]+ +\d+ slow_operation_alarm\.cc:\d+\].*"),
    re.compile(r"\*{8,}"),
    re.compile(r"\[Compiling module .*\] Very slow compile\?.*"),
    re.compile(r"The operation took .*"),
    re.compile(r"\s*"),  # the box's blank lines
)
"""XLA's "Very slow compile?" box on stderr (a large model's compile takes minutes on a
few CPU cores: expected here), kept out of the planner's output."""

__all__ = ["EXAMPLE_PRESETS", "SLOW_COMPILE", "Confirmation", "command_line", "compile_fit",
           "confirm", "format_answer"]

EXAMPLE_PRESETS = {"mixtral-8x7b": "mixtral-8x7b", "llama-3-70b": "llama-3-70b",
                   "405b": "llama-3.1-405b", "qwen3-30b-a3b": "qwen3-30b-a3b",
                   "deepseek-v3": "deepseek-v3"}
"""The planner's presets (:data:`sp_jax.analysis.MODELS`) that are ``--preset`` s of
``examples/train_gpt.py`` (:data:`sp_jax.training.cli.PRESETS`), by the example's name.
Every other shape is GPT blocks: ``--preset gpt`` with its sizes."""


@dataclasses.dataclass(frozen=True)
class Confirmation:
    """One compile of a :class:`~sp_jax.analysis.memory_options.FitRow`: per-GPU bytes.

    Attributes:
      row: the formula's row.
      device_bytes: the compiled device peak, ``arguments + outputs - aliased + temp``
        in device memory (``memory_analysis()``).
      host_bytes: the compiled host bytes, host ``arguments + temp``.
      temp_bytes: the device temp (activations, gradients, XLA's buffers).
      compile_s: seconds the compile took.
      error: why the layout did not compile ("" if it did).
      xla_notes: XLA:GPU's does-not-fit warnings (:data:`~sp_jax.analysis.plan.XLA_DOES_NOT_FIT`).
    """

    row: FitRow
    device_bytes: int = 0
    host_bytes: int = 0
    temp_bytes: int = 0
    compile_s: float = 0.0
    error: str = ""
    xla_notes: tuple[str, ...] = ()

    @property
    def fits(self) -> bool:
        """Compiled device peak plus the row's reserve within an H100's 80 GB, and host
        bytes within the row's host limit."""
        return (not self.error and self.device_bytes + self.row.reserve <= H100_BYTES
                and self.host_bytes <= self.row.host_limit)


def compile_fit(model: ModelShape, row: FitRow, *, target: str = "h100") -> Confirmation:
    """Compiles the training step of ``model`` with ``row``'s layout and memory options
    for ``row.layout.gpus`` abstract GPUs (deviceless; needs the CUDA compiler plugin) as
    :class:`~sp_jax.training.TrainStep` would run it, and returns its per-GPU bytes. A
    shape the model does not divide over, or a layout that does not compile, is a
    :class:`Confirmation` with ``error`` set.

    Llama-blocks presets held as one-expert mixtures (``experts=1``) compile as the
    dense SwiGLU model they stand for (``num_experts=0``), as the example runs them.

    Raises:
      RuntimeError: no CUDA compiler plugin (the message says how to install it).
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    from sp_jax._quiet import filtered_stderr
    from sp_jax.analysis.gpu import default_compiler_options, gpu_mesh
    from sp_jax.config import ParallelConfig
    from sp_jax.layout import Layout
    from sp_jax.models import GPT
    from sp_jax.training.offload import HOST
    from sp_jax.training.optimizer import MOMENTS_DTYPES, adamw
    from sp_jax.training.step import manual_data_graphdef, optimizer_shardings, train_step_fn

    layout, opts = row.layout, row.options
    t0 = time.perf_counter()
    mesh = gpu_mesh(layout.mesh_shape, layout.axis_names, target=target)  # plugin check
    pipeline = {"pipeline_axis": "stage", "pipeline_microbatches": layout.micro_batches,
                "pipeline_schedule": layout.pipeline_schedule} if layout.pipelined else {}
    experts = {"expert_axis": "expert"} if layout.expert > 1 else {}
    offload_opt = opts.offload != "off"
    offload_params = opts.offload == "optimizer+params"

    def failed(e: Exception) -> Confirmation:
        return Confirmation(row, compile_s=time.perf_counter() - t0,
                            error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")

    try:
        parallel = ParallelConfig(
            recompute_allgather=True, wgrad_dtype=jnp.float32, fsdp=opts.fsdp,
            context_parallel=layout.context_parallel if layout.context > 1 else None,
            offload_activations=opts.offload_activations, **pipeline, **experts)
        cfg = model.gpt_config(remat=layout.remat,
                               **({"num_experts": 0} if model.experts == 1 else {}))
        key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)  # outside the GPU mesh
        moments = MOMENTS_DTYPES[opts.moments]
        tx = adamw(1e-4, mu_dtype=moments, nu_dtype=moments)

        def named(x: Any) -> Any:  # a leaf's sharding on the mesh (replicated if none)
            spec = getattr(getattr(x, "sharding", None), "spec", None) or PartitionSpec()
            return NamedSharding(mesh, spec)

        with jax.set_mesh(mesh):
            gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
            graphdef, params, rest = nnx.split(gpt, nnx.Param, ...)
            params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                 sharding=named(x)), params)
            param_s = jax.tree.map(lambda x: x.sharding, params)
            update_s = optimizer_shardings(params, parallel) if opts.fsdp == "optimizer" \
                else None
            manual = manual_data_graphdef(gpt, parallel, mesh) if update_s is not None \
                else None
            state_of = params if update_s is None else jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                params, update_s)
            opt_state = jax.eval_shape(tx.init, state_of)

            def placed(tree: Any, host: bool) -> Any:
                return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=named(x).with_memory_kind(
                        HOST if host else "device")), tree)

            p_in, o_in = placed(params, offload_params), placed(opt_state, offload_opt)
            micro = row.batch // layout.micro_batches
            tokens = jax.ShapeDtypeStruct(
                (layout.micro_batches, micro, model.seq), jnp.int32,
                sharding=NamedSharding(mesh, Layout.of(parallel).micro_batched_tokens))
            step = train_step_fn(
                graphdef, tx, update_shardings=update_s, param_shardings=param_s,
                manual_graphdef=manual, manual_axes=parallel.data_axes if manual else (),
                offload_optimizer=offload_opt, offload_params=offload_params,
                compute_dtype=cfg.dtype)
            shard = lambda t: jax.tree.map(lambda x: x.sharding, t)  # noqa: E731
            with filtered_stderr(XLA_DOES_NOT_FIT + SLOW_COMPILE) as notes:
                compiled = jax.jit(
                    step, in_shardings=(shard(p_in), None, shard(o_in), None, None),
                    out_shardings=(shard(p_in), shard(o_in), None), donate_argnums=(0, 2),
                ).lower(p_in, rest, o_in, {"tokens": tokens, "labels": tokens}, key).compile(
                    compiler_options=default_compiler_options())
    except Exception as e:  # noqa: BLE001 - a layout that cannot be built or compiled
        return failed(e)
    mem = compiled.memory_analysis()
    temp = int(mem.temp_size_in_bytes)
    device = (int(mem.argument_size_in_bytes) + int(mem.output_size_in_bytes)
              - int(mem.alias_size_in_bytes) + temp)
    host = int(mem.host_argument_size_in_bytes) + int(mem.host_temp_size_in_bytes)
    xla_notes = tuple(n for n in notes if any(p.fullmatch(n) for p in XLA_DOES_NOT_FIT))
    return Confirmation(row, device, host, temp, time.perf_counter() - t0,
                        xla_notes=xla_notes)


def confirm(model: ModelShape, rows: Sequence[FitRow], *, tries: int = 3,
            target: str = "h100", on_try: Callable[[Confirmation], None] | None = None
            ) -> tuple[Confirmation | None, list[Confirmation]]:
    """Compiles the fitting rows in the order of
    :func:`~sp_jax.analysis.memory_options.ranked` (the formula's answer first) until one
    fits by compile (:attr:`Confirmation.fits`: its compiled peak plus its reserve), at
    most ``tries`` compiles (one layout and option set each, the next where a compile
    does not fit). Returns ``(the confirmed one or None, every compile)``."""
    if isinstance(tries, bool) or not isinstance(tries, int) or tries < 1:
        raise ValueError(f"confirm: tries={tries!r} must be a positive int.")
    done: list[Confirmation] = []
    for row in ranked(rows)[:tries]:
        done.append(compile_fit(model, row, target=target))
        if on_try is not None:
            on_try(done[-1])
        if done[-1].fits:
            return done[-1], done
    return None, done


def _mesh_flag(row: FitRow) -> list[str]:
    """``--mesh`` with a STAGE axis (the examples then scan the layers, as the planner
    compiles them), and the pipeline's flags."""
    lay = row.layout
    if lay.expert > 1:
        sizes = {"stage": lay.stages, "data": lay.data, "expert": lay.expert,
                 "context": lay.context, "tensor": lay.tensor}
        mesh = ",".join(f"{k}={v}" for k, v in sizes.items() if v > 1 or k == "stage")
    else:
        mesh = f"{lay.stages},{lay.data},{lay.context},{lay.tensor}"
    out = ["--mesh", mesh]
    if lay.context > 1:
        out += ["--context-parallel", lay.context_parallel]
    if lay.pipelined:
        out += ["--pipeline-schedule", lay.pipeline_schedule,
                "--microbatches", str(lay.micro_batches)]
    else:
        out += ["--micro-batches", str(lay.micro_batches)]
    return out


def _model_flags(model: ModelShape) -> list[str]:
    """``--preset`` and the size flags of ``model`` for ``examples/train_gpt.py``: the
    example's preset of the same name with the sizes that differ from the planner's
    preset, else ``--preset gpt`` with every size."""
    from sp_jax.analysis.shapes import MODELS

    base = MODELS.get(model.name)
    preset = EXAMPLE_PRESETS.get(model.name) if base is not None else None
    sizes = {"--layers": "layers", "--hidden": "hidden", "--heads": "heads",
             "--kv-heads": "kv_heads", "--mlp-hidden": "mlp_hidden"}
    out = ["--preset", preset or "gpt"]
    for flag, field in sizes.items():
        value = getattr(model, field)
        if value is not None and (preset is None or value != getattr(base, field)):
            out += [flag, str(value)]
    return out + ["--seq-len", str(model.seq)]


def command_line(model: ModelShape, row: FitRow, script: str = "train_gpt") -> str:
    """The command that trains ``model`` with ``row``'s layout and memory options:
    ``script`` ``"train_gpt"`` (``examples/train_gpt.py --preset ...`` with the sizes) or
    ``"finetune_hf"`` (``examples/finetune_hf.py --hf-dir DIR``: the model from the
    checkpoint). bf16 compute with fp32 master weights and weight gradients
    (``--precision bf16``), ``--recompute-allgather``, the mesh (with a STAGE axis: the
    layers scanned), ``--remat``, ``--fsdp``, ``--moments-dtype``, the offloads, the
    batch. The vocabulary is the run's tokenizer's (``--tokenizer``)."""
    if script not in ("train_gpt", "finetune_hf"):
        raise ValueError(f"command_line: script={script!r} is not 'train_gpt' or "
                         "'finetune_hf'.")
    lay, opts = row.layout, row.options
    args = (_model_flags(model) if script == "train_gpt"
            else ["--hf-dir", "DIR", "--seq-len", str(model.seq)])
    args += _mesh_flag(row) + ["--batch-size", str(row.batch), "--precision", "bf16",
                               "--recompute-allgather"]
    args += ["--remat"] if lay.remat else []
    args += ["--fsdp", opts.fsdp] if opts.fsdp else []
    args += ["--moments-dtype", opts.moments] if opts.moments != "fp32" else []
    args += ["--offload-optimizer"] if opts.offload != "off" else []
    args += ["--offload-params"] if opts.offload == "optimizer+params" else []
    args += ["--offload-activations"] if opts.offload_activations else []
    return shlex.join(["python", f"examples/{script}.py", *args])


def format_answer(model: ModelShape, gpus: int, rows: Sequence[FitRow],
                  confirmed: Confirmation | None, tried: Sequence[Confirmation]) -> str:
    """The default answer of ``python -m sp_jax.plan``: per layout the cheapest option set
    that fits by formula (and each compiled one), its formula bytes and, where compiled,
    the compiled ones; then the answer, formula against compile, the reserve, and the
    command lines that run it. GiB per GPU (MiB when every peak is below 1 GiB)."""
    from sp_jax.analysis.memory_options import chosen_per_layout, reserve_note
    from sp_jax.analysis.plan import shape_line

    by_row = {c.row: c for c in tried}
    shown = list(dict.fromkeys([chosen for _, chosen in chosen_per_layout(rows).values()]
                               + [c.row for c in tried]))
    big = any(r.device_bytes >= 2**30 for r in shown) or any(
        c.device_bytes >= 2**30 for c in tried)
    unit, scale = ("GiB", 2**30) if big else ("MiB", 2**20)
    reserve = rows[0].reserve if rows else 0.0
    limit = rows[0].host_limit if rows else 0.0

    def g(x: float) -> str:
        return f"{x / scale:.1f}"

    lines = [f"{shape_line(model)}; {unit} per GPU ({reserve_note(reserve)}; host: "
             f"{limit / 2**30:.0f} GiB per GPU)\n",
             "| layout | batch | options | weights + grads | optimizer | activations | "
             "device peak: formula | compiled | host: formula / compiled | fits |",
             "|" + "---|" * 10]
    for r in shown:
        c = by_row.get(r)
        compiled = ("" if c is None else f"failed: {c.error}" if c.error
                    else g(c.device_bytes))
        host = g(r.host_bytes) + ("" if c is None or c.error else f" / {g(c.host_bytes)}")
        fits = ("yes" if r.fits else "**no**") if c is None else \
            ("yes, compiled" if c.fits else "**no**, compiled")
        staged = f" + {g(r.update_bytes)} update" if r.update_bytes else ""
        lines.append(f"| {r.layout.label} | {r.batch} | {r.options.label} | "
                     f"{g(r.weights_bytes)} | {g(r.optimizer_bytes)}{staged} | "
                     f"{g(r.activation_bytes)} | {g(r.device_bytes)} | {compiled} | {host} | "
                     f"{fits} |")
    if confirmed is not None:
        r, c = confirmed.row, confirmed
        lines.append(
            f"\nFits, confirmed by compile (the whole training step, deviceless XLA:GPU, "
            f"{c.compile_s:.0f} s): {r.layout.label} with {r.options.label}: device "
            f"{g(c.device_bytes)} {unit} compiled ({g(r.device_bytes)} by formula, "
            f"{(c.device_bytes - r.device_bytes) / scale:+.1f}) + {g(reserve)} {unit} "
            f"reserve = {g(c.device_bytes + reserve)} of {g(80e9)} {unit}; host "
            f"{g(c.host_bytes)} {unit} per GPU compiled ({g(r.host_bytes)} by formula).")
        lines.append(
            f"\nRun it (the vocabulary is your --tokenizer's, the plan counts {model.vocab}; "
            "set XLA_PYTHON_CLIENT_MEM_FRACTION=.9 where JAX preallocates 75%):\n"
            f"  {command_line(model, r, 'train_gpt')}\n"
            f"  {command_line(model, r, 'finetune_hf')}")
    elif tried:
        low = min((c for c in tried if not c.error), key=lambda c: c.device_bytes,
                  default=None)
        lines.append(
            f"\nNo answer confirmed: {len(tried)} compile(s) of the formula's answers, none "
            f"within {g(80e9 - reserve)} {unit}"
            + (f" (the lowest, {low.row.layout.label} with {low.row.options.label}: "
               f"{g(low.device_bytes)} {unit} compiled against {g(low.row.device_bytes)} "
               "by formula)" if low else "")
            + "; more GPUs, --confirm-tries N, or a smaller --device-reserve.")
    elif rows:
        low = min(rows, key=lambda r: r.device_bytes)
        lines.append(f"\nNothing fits by formula: the lowest device peak, {low.layout.label} "
                     f"with {low.options.label}, is {g(low.device_bytes)} {unit} (host "
                     f"{g(low.host_bytes)} {unit}) + {g(reserve)} {unit} reserve.")
    return "\n".join(lines)

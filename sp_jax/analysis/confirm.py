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
import importlib
import shlex
from collections.abc import Callable, Sequence

from sp_jax.analysis.memory_options import FitRow, ranked
from sp_jax.analysis.plan import H100_BYTES, ModelShape, PlanRow

__all__ = ["EXAMPLE_PRESETS", "Confirmation", "command_line", "confirm", "format_answer"]

EXAMPLE_PRESETS = {"mixtral-8x7b": "mixtral-8x7b", "llama-3-70b": "llama-3-70b",
                   "405b": "llama-3.1-405b", "qwen3-30b-a3b": "qwen3-30b-a3b",
                   "deepseek-v3": "deepseek-v3", "kimi-k2": "kimi-k2"}
"""The planner's presets (:data:`sp_jax.analysis.MODELS`) that are ``--preset`` s of
``examples/train_gpt.py`` (:data:`sp_jax.training.cli.PRESETS`), by the example's name.
Every other shape is GPT blocks: ``--preset gpt`` with its sizes."""


@dataclasses.dataclass(frozen=True)
class Confirmation:
    """One compile of a :class:`~sp_jax.analysis.memory_options.FitRow`: per-GPU bytes.

    Attributes:
      row: the formula's row.
      compiled: the compile's :class:`~sp_jax.analysis.plan.PlanRow` (``plan_one`` with
        the row's memory options): ``peak_bytes`` the device peak (arguments + outputs -
        aliased + temp in device memory), ``host_bytes`` the host arguments + temp,
        ``error`` why it did not compile.
    """

    row: FitRow
    compiled: PlanRow

    @property
    def device_bytes(self) -> int:
        return self.compiled.peak_bytes

    @property
    def host_bytes(self) -> int:
        return self.compiled.host_bytes

    @property
    def error(self) -> str:
        return self.compiled.error

    @property
    def compile_s(self) -> float:
        return self.compiled.compile_s

    @property
    def fits(self) -> bool:
        """Compiled device peak plus the row's reserve within an H100's 80 GB, and host
        bytes within the row's host limit."""
        return (not self.error and self.device_bytes + self.row.reserve <= H100_BYTES
                and self.host_bytes <= self.row.host_limit)


def confirm(model: ModelShape, rows: Sequence[FitRow], *, tries: int = 3,
            target: str = "h100", on_try: Callable[[Confirmation], None] | None = None
            ) -> tuple[Confirmation | None, list[Confirmation]]:
    """Compiles the fitting rows in the order of
    :func:`~sp_jax.analysis.memory_options.ranked` (the formula's answer first) with
    :func:`sp_jax.analysis.plan.plan` (``memory=`` the row's options; deviceless, needs
    the CUDA compiler plugin) until one fits by compile (:attr:`Confirmation.fits`: its
    compiled peak plus its reserve), at most ``tries`` compiles (one layout and option set
    each, the next where a compile does not fit). Returns ``(the confirmed one or None,
    every compile)``.

    Raises:
      RuntimeError: no CUDA compiler plugin (the message says how to install it).
    """
    if isinstance(tries, bool) or not isinstance(tries, int) or tries < 1:
        raise ValueError(f"confirm: tries={tries!r} must be a positive int.")
    planner = importlib.import_module("sp_jax.analysis.plan")  # (the package's plan: a function)
    done: list[Confirmation] = []
    for row in ranked(rows)[:tries]:
        compiled = planner.plan(model, row.layout.gpus, options=[row.layout], batch=row.batch,
                                progress=False, memory=row.options)
        if not compiled:
            break
        done.append(Confirmation(row, compiled[0]))
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
             "--kv-heads": "kv_heads", "--head-dim": "head_dim", "--mlp-hidden": "mlp_hidden"}
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
            f"{c.compile_s:.0f} s): {r.layout.label} with "
            f"{'no memory option' if r.options.label == 'none' else r.options.label}: "
            f"device {g(c.device_bytes)} {unit} compiled ({g(r.device_bytes)} by formula, "
            f"{(c.device_bytes - r.device_bytes) / scale:+.1f}) + {reserve / 2**30:.1f} GiB "
            f"reserve = {(c.device_bytes + reserve) / 2**30:.1f} of {80e9 / 2**30:.1f} GiB; "
            f"host {g(c.host_bytes)} {unit} per GPU compiled ({g(r.host_bytes)} by formula).")
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

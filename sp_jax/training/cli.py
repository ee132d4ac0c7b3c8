"""The command line of a training script: its flags, their checks, and what they build.

A script adds the flag groups it needs, parses, checks (every rule a ``ValueError`` whose
message names the flags, for ``parser.error``), and builds from the flags::

    parser = argparse.ArgumentParser(description=description(__doc__),
                                     formatter_class=HelpFormatter)
    add_trainer_arguments(parser)      # --steps, --batch-size, --lr, --ckpt-dir, ...
    add_parallel_arguments(parser)     # --mesh, --context-parallel, --precision, --fsdp, ...
    add_model_arguments(parser)        # --preset, --layers, --hidden, --heads, ...
    args = parser.parse_args()
    try:
        args.mesh_shape = parse_mesh(args.mesh)
        check_pipeline_args(args)      # with a STAGE axis: --microbatches, --pipeline-...
        check_model_args(args)         # the preset's values filled in, checked on the mesh
        config = check_run_args(args)  # a TrainerConfig
    except ValueError as e:
        parser.error(str(e))
    parallel, cfg, tx = parallel_config(args), model_config(args), optimizer(args)

Beside them: :func:`shared_settings` (what every process of a run must agree on, for
:func:`~sp_jax.training.faults.check_same_settings`) and :func:`run_metadata` (what a
checkpoint records: the model, which must match on resume, and the run's settings, which
may change with a warning).
"""

from __future__ import annotations

import argparse
import functools
import glob
import math
import os
import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sp_jax.attention import zigzag_order
from sp_jax.config import PIPELINE_SCHEDULES, Fp8Recipe, ParallelConfig
from sp_jax.layers import check_kv_heads, kv_heads_per_shard
from sp_jax.models import GPTConfig
from sp_jax.training.optimizer import MOMENTS_DTYPES, adamw
from sp_jax.training.schedule import warmup_cosine_schedule
from sp_jax.training.trainer import TrainerConfig

__all__ = ["PER_PROCESS", "PRESETS", "RUN_SETTINGS", "HelpFormatter",
           "add_fp8_argument", "add_model_arguments", "add_parallel_arguments",
           "add_trainer_arguments", "fp8_recipe",
           "check_model_args", "check_pipeline_args", "check_run_args", "check_text_args",
           "description", "format_warning",
           "lr_schedule", "markdown_flags", "model_config", "offload_options", "optimizer",
           "parallel_config",
           "run_metadata", "scan_layers", "shared_settings"]

PRESETS: dict[str, Callable[..., GPTConfig]] = {
    "gpt": lambda **o: GPTConfig(**{"vocab_size": 256, "max_seq_len": 128, "num_layers": 2,
                                    "num_heads": 4, "hidden": 128, **o}),
    "llama-tiny": lambda **o: GPTConfig.llama("llama-tiny", **o),
    "mixtral-tiny": lambda **o: GPTConfig.mixtral("mixtral-tiny", **o),
    "qwen3-moe-tiny": lambda **o: GPTConfig.qwen3_moe("qwen3-moe-tiny", **o),
    "deepseek-v3-tiny": lambda **o: GPTConfig.deepseek_v3("deepseek-v3-tiny", **o),
    "glm-4.5-tiny": lambda **o: GPTConfig.glm4_moe("glm-4.5-tiny", **o),
    # the memory planner's shapes (python -m sp_jax.plan prints commands with them)
    "mixtral-8x7b": lambda **o: GPTConfig.mixtral("mixtral-8x7b", **o),
    "llama-3-70b": lambda **o: GPTConfig.llama("llama-3-8b", **{
        "num_layers": 80, "num_heads": 64, "hidden": 8192, "mlp_hidden": 28672, **o}),
    "llama-3.1-405b": lambda **o: GPTConfig.llama("llama-3.1-8b", **{
        "num_layers": 126, "num_heads": 128, "hidden": 16384, "mlp_hidden": 53248, **o}),
    "qwen3-30b-a3b": lambda **o: GPTConfig.qwen3_moe("qwen3-30b-a3b", **o),
    "deepseek-v3": lambda **o: GPTConfig.deepseek_v3("deepseek-v3", **o),
    "kimi-k2": lambda **o: GPTConfig.deepseek_v3("kimi-k2", **o),
    "glm-4.5-air": lambda **o: GPTConfig.glm4_moe("glm-4.5-air", **o),
}
"""``--preset``: the model a name stands for, with :class:`GPTConfig` fields overridden."""

# --flag -> the GPTConfig field it sets (None: the preset's value).
_MODEL_FLAGS = {"layers": "num_layers", "hidden": "hidden", "heads": "num_heads",
                "kv_heads": "num_kv_heads", "head_dim": "head_dim", "mlp_hidden": "mlp_hidden",
                "seq_len": "max_seq_len"}

PER_PROCESS = ("process_id", "log_json", "tensorboard", "plot", "no_progress",
               "local_device_ids",
               "local_devices", "launch", "trainer")
"""Flags (and attributes a script adds) that may differ between the processes of a run."""

RUN_SETTINGS = ("seed", "data", "max_data_bytes", "tokenizer", "text_field", "packing",
                "batch_size", "micro_batches", "lr", "warmup_steps", "final_lr_fraction",
                "weight_decay")
"""The flags :func:`run_metadata` records as the run's settings (those a script has)."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Adds ``(default: X)`` to a flag's help, except where X is None or False (no
    default to state) or the help text states the default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def description(doc: str | None) -> str:
    """The first paragraph of a module docstring, on one line (a parser's description)."""
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def add_trainer_arguments(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Adds the flags of a :class:`~sp_jax.training.TrainerConfig` and the optimizer:
    ``--steps --seed --debug-nans --loss-spike --max-update-ratio`` (group "run"),
    ``--batch-size --micro-batches --micro-batch-size --lr --warmup-steps --final-lr-fraction
    --weight-decay --offload-optimizer --offload-params --moments-dtype`` ("optimization";
    :func:`offload_options`),
    ``--eval-every --eval-batches`` ("evaluation"), ``--ckpt-dir --save-every --resume
    --log-json --no-progress`` ("output").

    Args:
      defaults: other defaults by destination, e.g. ``steps=50, lr=1e-4``.
    Raises:
      TypeError: a default for a flag that is not added here.
    """
    add = parser.add_argument_group("run").add_argument
    add("--steps", type=int, default=600, help="total optimizer steps")
    add("--seed", type=int, default=0, help="seeds the initialisation, dropout and data order")
    add("--debug-nans", action="store_true", help="jax_debug_nans: name the op making a NaN")
    add("--loss-spike", type=float, default=3.0, metavar="FACTOR",
        help="stop as diverged when a loss exceeds FACTOR x the median of the last 20 "
             "(a checkpoint is written only after its parameters gave a good held-out "
             "loss); 0: stop on non-finite losses only")
    add("--max-update-ratio", type=float, default=1.0, metavar="R",
        help="stop as diverged when a step's update norm exceeds R x the parameters' norm "
             "(healthy: ~1e-3); 0: no limit")
    add = parser.add_argument_group("optimization").add_argument
    add("--batch-size", type=int, default=16, help="global batch (sequences) per step")
    add("--micro-batches", type=int, default=2, action=_NoteGiven,
        help="gradient-accumulation micro-batches")
    add("--micro-batch-size", type=int, default=None, metavar="ROWS",
        help="instead of --micro-batches: sequences per data-parallel shard (DATA x EXPERT "
             "of --mesh) in one micro-batch; the micro-batches are --batch-size / (ROWS x "
             "shards), so the global batch stays the same on a mesh of another size "
             "(--mesh -1,TENSOR); not with a pipeline (STAGE > 1)")
    add("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    add("--warmup-steps", type=int, default=20,
        help="linear warmup, then cosine decay to --final-lr-fraction x lr")
    add("--final-lr-fraction", type=float, default=0.1, metavar="F",
        help="where the cosine decay ends at --steps, a fraction of --lr (1: constant)")
    add("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    add("--offload-optimizer", action="store_true",
        help="keep the optimizer state in pinned host memory between steps "
             "(TrainStep(offload_optimizer=True); the same arithmetic)")
    add("--offload-params", action="store_true",
        help="also keep the fp32 master weights in pinned host memory, the forward and "
             "backward on a copy in the compute dtype (TrainStep(offload_params=True))")
    add("--moments-dtype", choices=tuple(MOMENTS_DTYPES), default="fp32",
        help="storage dtype of AdamW's first and second moments (bf16: 4 instead of 8 "
             "bytes per parameter; the update still computes in fp32)")
    add = parser.add_argument_group("evaluation").add_argument
    add("--eval-every", type=int, default=100, help="evaluate at 0, every K steps and the end")
    add("--eval-batches", type=int, default=4, help="held-out micro-batches per eval")
    add = parser.add_argument_group("output").add_argument
    add("--ckpt-dir", default=None, help="checkpoint directory (shared by all processes)")
    add("--save-every", type=int, default=0, help="checkpoint every K steps and at the end")
    add("--resume", nargs="?", const=True, default=False, type=_resume_mode, metavar="auto",
        help="continue from the latest in --ckpt-dir (an error when it holds none); "
             "--resume auto: continue when there is one, else start (a requeued job)")
    add("--log-json", default=None, help="JSON lines: one record per step, plus evals")
    add("--tensorboard", default=None, metavar="DIR",
        help="TensorBoard event files of the same metrics (process 0)")
    add("--no-progress", action="store_true", help="no progress bar")
    _set_defaults(parser, defaults)
    if parser.get_default("warmup_steps") is None:  # check_run_args takes a tenth of --steps
        next(a for a in parser._actions if a.dest == "warmup_steps").help += \
            " (default: a tenth of --steps)"


class _NoteGiven(argparse.Action):
    """Stores the value and sets ``<dest>_given`` (for a flag whose default may be
    replaced by another flag's: given both is a usage error)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def _resume_mode(value: str) -> str:
    if value != "auto":
        raise argparse.ArgumentTypeError(f"--resume takes no value or 'auto', not {value!r}")
    return value


def _set_defaults(parser: argparse.ArgumentParser, defaults: Mapping[str, Any]) -> None:
    known = {a.dest for a in parser._actions}
    unknown = sorted(set(defaults) - known)
    if unknown:
        raise TypeError(f"no flag for the defaults {unknown}; flags: {sorted(known)}")
    parser.set_defaults(**defaults)


def add_parallel_arguments(parser: argparse.ArgumentParser, **defaults: Any) -> None:
    """Adds ``--mesh --context-parallel --pipeline-schedule --microbatches
    --pipeline-repeats --precision --recompute-allgather --fsdp --remat
    --offload-activations`` (group "parallelism"),
    read by :func:`parallel_config` (after :func:`check_pipeline_args`); ``defaults`` as for
    :func:`add_trainer_arguments`."""
    # "--mesh -1,4": Python < 3.13's argparse takes an argument starting with "-" for an
    # option unless it is a plain negative number; 3.13's rule (any "-" + digit is a
    # value) lets the -1 of a mesh through
    parser._negative_number_matcher = re.compile(r"-\.?\d")
    add = parser.add_argument_group("parallelism").add_argument
    add("--mesh", default="2,4",
        help="DATA,TENSOR, DATA,CONTEXT,TENSOR or STAGE,DATA,CONTEXT,TENSOR mesh shape "
             "(with STAGE the layers are scanned; STAGE > 1 runs a pipeline), or named "
             "sizes such as data=2,expert=2,tensor=2 (EXPERT > 1: the experts of "
             "--preset mixtral-tiny are split over it). One size may be -1: that axis "
             "takes the devices the others leave (-1,4: DATA = the run's devices / 4), so "
             "the same command fits an allocation of another size")
    add("--context-parallel", choices=("ring", "ulysses"), default="ring",
        help="attention across the CONTEXT axis of the --mesh")
    add("--pipeline-schedule", choices=PIPELINE_SCHEDULES, default="1f1b",
        help="with STAGE > 1: gpipe (all forwards, then all backwards) or 1f1b (one "
             "forward and one backward per tick: activation memory independent of "
             "--microbatches)")
    add("--microbatches", type=int, default=None,
        help="with STAGE > 1: micro-batches per step through the pipeline (default: 2 x "
             "STAGE); they are also the step's --micro-batches")
    add("--pipeline-repeats", type=int, default=1,
        help="with STAGE > 1: layer chunks per stage (> 1: the circular schedule)")
    add("--precision", choices=("fp32", "bf16"), default="fp32",
        help="compute dtype (parameters stay in their own dtype, fp32 master weights)")
    add("--recompute-allgather", action="store_true", help="re-gather SP inputs in backward")
    add("--fsdp", nargs="?", choices=("optimizer", "full"), const="full", default=False,
        help="shard over DATA too: 'optimizer' the optimizer state (ZeRO-1), 'full' (the "
             "default of a bare --fsdp) parameters, gradients and optimizer state (ZeRO-3)")
    add("--remat", action="store_true",
        help="recompute each block in the backward pass (GPTConfig(remat=True)): each "
             "layer keeps only its input")
    add("--offload-activations", action="store_true",
        help="keep what each layer saves for its backward in host memory "
             "(ParallelConfig(offload_activations=True))")
    _set_defaults(parser, defaults)


def parallel_config(args: argparse.Namespace) -> ParallelConfig:
    """The :class:`ParallelConfig` of the flags (``args.mesh_shape``: the parsed
    ``--mesh``, ``(stage, data, context, tensor)``; a pipeline when STAGE > 1, after
    :func:`check_pipeline_args`)."""
    stages = args.mesh_shape[0]
    pipeline = dict(pipeline_axis="stage", pipeline_microbatches=args.microbatches,
                    pipeline_schedule=args.pipeline_schedule,
                    pipeline_repeats=args.pipeline_repeats) if stages > 1 else {}
    experts = {"expert_axis": "expert"} if args.mesh_shape[2] > 1 else {}
    return ParallelConfig(
        recompute_allgather=args.recompute_allgather, fsdp=args.fsdp,
        offload_activations=getattr(args, "offload_activations", False),
        wgrad_dtype=jnp.float32 if args.precision == "bf16" else None,
        context_parallel=args.context_parallel if args.mesh_shape[3] > 1 else None,
        **pipeline, **experts)


def check_pipeline_args(args: argparse.Namespace) -> None:
    """With STAGE > 1 in ``args.mesh_shape``: ``--microbatches`` (default 2 x STAGE)
    becomes the step's ``--micro-batches`` too; checks ``--microbatches`` and
    ``--pipeline-repeats``. Call it before :func:`check_run_args`.

    Raises:
      ValueError: a pipeline flag without STAGE > 1, or a bad value, naming the flags.
    """
    stages = args.mesh_shape[0]
    if stages == 1:
        if args.microbatches is not None or args.pipeline_repeats != 1:
            raise ValueError("--microbatches and --pipeline-repeats need a pipeline: a "
                             "--mesh STAGE,DATA,CONTEXT,TENSOR with STAGE > 1")
        return
    if args.microbatches is None:
        args.microbatches = 2 * stages
    if args.microbatches <= 0 or args.pipeline_repeats <= 0:
        raise ValueError("--microbatches and --pipeline-repeats must be positive")
    if args.pipeline_repeats > 1 and args.microbatches % stages:
        raise ValueError(f"--microbatches {args.microbatches} must be a multiple of STAGE "
                         f"{stages} with --pipeline-repeats {args.pipeline_repeats}")
    args.micro_batches = args.microbatches


def _describe_preset(name: str) -> str:
    c = PRESETS[name]()
    kv = f" ({c.num_kv_heads} key/value)" if c.num_kv_heads != c.num_heads else ""
    mlp = f"{c.mlp_activation} MLP of {c.mlp_hidden}" if not c.num_experts else (
        f"{c.num_experts} {c.mlp_activation} experts of {c.moe_mlp_hidden} "
        f"({c.experts_per_token} per token"
        f"{f', {c.num_shared_experts} shared' if c.num_shared_experts else ''})")
    if c.attention == "mla":
        kv = f" of latent attention (kv rank {c.kv_lora_rank})"
    elif c.head_dim is not None:
        kv += f" of {c.head_dim}"
    if c.qk_norm:
        kv += " with q/k norms"
    if c.num_experts and c.num_dense_layers:
        mlp = f"{c.num_dense_layers} dense then {mlp}"
    if c.mtp_depth:
        mlp += f", {c.mtp_depth} MTP module{'s' if c.mtp_depth > 1 else ''}"
    return (f"{name}: {c.num_layers} layers, hidden {c.hidden}, {c.num_heads} heads{kv}, "
            f"{mlp}, {c.positions} positions, {c.norm}, "
            f"{'tied' if c.tie_embeddings else 'untied'} head"
            f"{'' if c.qkv_bias or c.out_bias or c.mlp_bias else ', no biases'}")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds ``--preset`` (:data:`PRESETS`) and the flags that override its values:
    ``--layers --hidden --heads --kv-heads --head-dim --mlp-hidden --seq-len --fp8``
    (group "model")."""
    group = parser.add_argument_group("model")
    add = group.add_argument
    add("--preset", choices=tuple(PRESETS), default="gpt",
        help="the model: " + "; ".join(_describe_preset(n) for n in PRESETS) + ". The flags "
             "below override a preset's values (llama-tiny is GPTConfig.llama('llama-tiny'), "
             "mixtral-tiny GPTConfig.mixtral('mixtral-tiny'), qwen3-moe-tiny "
             "GPTConfig.qwen3_moe('qwen3-moe-tiny'), deepseek-v3 / kimi-k2 / "
             "deepseek-v3-tiny GPTConfig.deepseek_v3(name), glm-4.5-air / glm-4.5-tiny "
             "GPTConfig.glm4_moe(name))")
    add("--layers", type=int, default=None, help="transformer blocks (default: the preset's)")
    add("--hidden", type=int, default=None, help="model width (default: the preset's)")
    add("--heads", type=int, default=None,
        help="attention heads, a multiple of TENSOR (default: the preset's)")
    add("--kv-heads", type=int, default=None,
        help="key/value heads: a divisor of HEADS, and a divisor or a multiple of TENSOR "
             "(default: the preset's, or HEADS where the preset has as many as heads)")
    add("--head-dim", type=int, default=None,
        help="features per attention head (default: the preset's, else HIDDEN / HEADS)")
    add("--mlp-hidden", type=int, default=None,
        help="MLP width (default: the preset's, or 4 x HIDDEN where the preset has that)")
    add("--seq-len", type=int, default=None,
        help="tokens per sequence, a multiple of CONTEXT x TENSOR (default: the preset's)")
    add_fp8_argument(group)


def add_fp8_argument(group: Any) -> None:
    """Adds ``--fp8 current|delayed`` (the blocks' projections in FP8; :func:`fp8_recipe`)
    to ``group`` (a parser or an argument group)."""
    group.add_argument(
        "--fp8", choices=("current", "delayed"), default=None,
        help="the blocks' linear layers in FP8 (sp_jax.Fp8Recipe): scales from each "
             "tensor's current amax or from an amax history (default: off)")


def fp8_recipe(args: argparse.Namespace) -> Fp8Recipe | None:
    """The :class:`~sp_jax.Fp8Recipe` of ``--fp8`` (None without it)."""
    return None if getattr(args, "fp8", None) is None else Fp8Recipe(args.fp8)


def _resolve_model_args(args: argparse.Namespace) -> None:
    """Fills the model flags not given with the preset's values; where the preset follows
    GPTConfig's own rule (key/value heads = heads, MLP = 4 x hidden) the rule is kept."""
    for flag in _MODEL_FLAGS:
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive")
    base = PRESETS[args.preset]()
    for flag in ("layers", "hidden", "heads", "seq_len"):
        if getattr(args, flag) is None:
            setattr(args, flag, getattr(base, _MODEL_FLAGS[flag]))
    if args.kv_heads is None:
        args.kv_heads = base.num_kv_heads if base.num_kv_heads != base.num_heads else args.heads
    if args.head_dim is None:
        args.head_dim = base.head_dim  # None: HIDDEN / HEADS
    if args.mlp_hidden is None:
        args.mlp_hidden = base.mlp_hidden if base.mlp_hidden != 4 * base.hidden \
            else 4 * args.hidden


def _breaks(rule: Callable[..., Any], *args: Any) -> bool:
    """Whether the library's ``rule(*args)`` raises a ValueError."""
    try:
        rule(*args)
    except ValueError:
        return True
    return False


def check_model_args(args: argparse.Namespace) -> None:
    """Fills in the preset's values of the model flags not given, then checks the model
    and batch flags against the mesh ``args.mesh_shape`` (``(stage, data, expert, context,
    tensor)``).

    Raises:
      ValueError: a flag that is not positive, or sizes the mesh cannot split, naming
        the flags and the fix.
    """
    _resolve_model_args(args)
    (stages, data, experts, c, tensor), ring = args.mesh_shape, \
        args.context_parallel == "ring"
    data *= experts  # the expert axis carries the batch too
    chunks = stages * getattr(args, "pipeline_repeats", 1)
    sp, heads = tensor * c, tensor * (1 if ring else c)
    micro = args.batch_size // args.micro_batches
    # the library's rules (the zigzag order, the kv-head rules), reported as flags
    kv_bad = _breaks(check_kv_heads, "", args.heads, args.kv_heads) or _breaks(
        kv_heads_per_shard, args.kv_heads, tensor, "")
    count = "--microbatches" if stages > 1 else "--micro-batches"
    for bad, message in [
        (micro % data, f"a micro-batch of --batch-size {args.batch_size} / {count} "
                       f"{args.micro_batches} = {micro} sequences does not split over the "
                       f"{data} data shards (DATA{' x EXPERT' if experts > 1 else ''} of "
                       f"--mesh): make --batch-size / {count} a multiple of {data}"),
        (args.seq_len % sp or ring and c > 1 and _breaks(zigzag_order, args.seq_len, c),
         f"--seq-len {args.seq_len} must divide by {sp} (context x tensor) and, for ring "
         f"attention, by {2 * c}"),
        (args.heads % heads or args.head_dim is None and args.hidden % args.heads,
         f"--heads {args.heads} must be a multiple of {heads} (tensor "
         f"size{', x context' if heads > tensor else ''}) and divide --hidden {args.hidden} "
         "(or give --head-dim)"),
        (kv_bad, f"--kv-heads {args.kv_heads} must divide --heads {args.heads} and divide or "
         f"be a multiple of the tensor size {tensor}"),
        (not ring and c > 1 and not kv_bad
         and kv_heads_per_shard(args.kv_heads, tensor, "") % c, f"ulysses needs the "
         f"key/value heads per tensor shard divisible by the context size {c}: use more "
         "--kv-heads or --context-parallel ring"),
        (args.fsdp == "full" and args.hidden % data, f"--fsdp shards the hidden dimension over the "
         f"data size {data}: --hidden {args.hidden} must be a multiple of it"),
        (args.layers % chunks, f"--layers {args.layers} must divide by STAGE x "
         f"--pipeline-repeats = {chunks} (each stage holds the same number of layers)")]:
        if bad:
            raise ValueError(message)


def model_config(args: argparse.Namespace, *, vocab_size: int = 256) -> GPTConfig:
    """The :class:`GPTConfig` of ``--preset`` with the model flags (after
    :func:`check_model_args`), no dropout, fp32 parameters, ``--precision`` compute,
    ``--fp8``'s recipe."""
    overrides = {field: getattr(args, flag) for flag, field in _MODEL_FLAGS.items()}
    return PRESETS[args.preset](
        **overrides, vocab_size=vocab_size, dropout=0.0, param_dtype=jnp.float32,
        dtype=jnp.bfloat16 if args.precision == "bf16" else jnp.float32,
        scan_layers=scan_layers(args), remat=getattr(args, "remat", False),
        fp8=fp8_recipe(args))


def scan_layers(args: argparse.Namespace) -> bool:
    """Whether the model scans its layers: when ``--mesh`` names a STAGE axis (the
    stages hold slices of the stacked blocks; ``1,D,C,T`` too, so that its checkpoints
    move to and from pipelined runs)."""
    return args.mesh.count(",") == 3 or "stage=" in args.mesh.replace(" ", "")


def add_held_out_argument(add: Callable[..., Any]) -> None:
    """Adds ``--held-out-fraction`` with ``add`` (a parser's or group's ``add_argument``);
    :func:`check_run_args` checks it."""
    add("--held-out-fraction", type=float, default=0.05, metavar="F",
        help="the share of the data (the last documents or bytes) held out for evaluation")


def check_text_args(args: argparse.Namespace, *, byte_tokenizer: bool = True) -> None:
    """Checks ``--tokenizer`` (an existing file, or ``bytes`` where ``byte_tokenizer``)
    and ``--text-field`` (when given, some ``--data`` file must be JSON lines or parquet:
    the files whose records hold the text in that field), then sets ``--text-field``'s
    default, ``text``.

    Raises:
      ValueError: a missing tokenizer file, or a ``--text-field`` no file reads, naming
        the flag.
    """
    from sp_jax.data.sources import JSON_LINES, PARQUET, is_record_file

    tok = args.tokenizer
    if tok is not None and not (byte_tokenizer and tok == "bytes") and not os.path.isfile(tok):
        raise ValueError(f"--tokenizer {tok}: no such file; give a Hugging Face "
                         f"tokenizer.json{' (or bytes)' if byte_tokenizer else ''}, or make "
                         "one with python -m sp_jax.data.tokenizer")
    field = args.text_field
    if field is None:
        args.text_field = "text"
        return
    files = [f for p in args.data or () for f in glob.glob(p, recursive=True)]
    if not field or (files or not args.data) and not any(map(is_record_file, files)):
        raise ValueError(f"--text-field {field!r} names the JSON field or parquet column "
                         "that holds the text, but " + (
                             "it is empty" if not field else "there is no --data" if not
                             args.data else "no --data file is JSON lines or parquet "
                             f"({', '.join(JSON_LINES + PARQUET)}; other files are one "
                             "document each, read whole)") + ": drop --text-field or give "
                         "such files")


def format_warning(message: Warning | str, category: type[Warning], filename: str,
                   lineno: int, line: str | None = None) -> str:
    """``warnings.formatwarning`` for a command line (a script sets it before it runs): a
    ``UserWarning`` (sp_jax's, e.g. a stale ``--ckpt-dir`` lock taken over, too few
    held-out documents) is one line ``warning: <message>``, as errors are ``error: ...``,
    without Python's category and source line; other warnings (another library's
    included) as Python prints them."""
    if category is UserWarning and os.path.abspath(filename).startswith(_SP_JAX_DIR):
        return f"warning: {' '.join(str(message).split())}\n"
    return _PYTHON_FORMAT(message, category, filename, lineno, line)


_PYTHON_FORMAT = warnings.formatwarning
_SP_JAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def text_data(args: argparse.Namespace) -> Any:
    """``--data`` (default: the standard library's sources) as bytes
    (:class:`~sp_jax.data.ByteCorpus`, up to ``--max-data-bytes``) or, with
    ``--tokenizer``, as packed documents (:class:`~sp_jax.data.PackedText`), the last
    ``--held-out-fraction`` held out: examples/train_gpt.py's data."""
    from sp_jax.data import ByteCorpus, ByteTokenizer, PackedText, load_tokenizer

    held = args.held_out_fraction
    if not args.tokenizer:  # JSON lines and parquet: their documents' text, as bytes
        return ByteCorpus.from_files(args.data, seq_len=args.seq_len,
                                     max_bytes=args.max_data_bytes, held_out_fraction=held,
                                     text_field=args.text_field, flag="--text-field")
    tokenizer = ByteTokenizer() if args.tokenizer == "bytes" else load_tokenizer(args.tokenizer)
    return PackedText.from_files(args.data, tokenizer=tokenizer, seq_len=args.seq_len,
                                 text_field=args.text_field, packing=args.packing,
                                 held_out_fraction=held)


def check_run_args(args: argparse.Namespace) -> TrainerConfig:
    """Checks the flags of :func:`add_trainer_arguments`; returns their
    :class:`~sp_jax.training.TrainerConfig`.

    ``--warmup-steps`` None (a script's default) becomes a tenth of ``--steps`` (at least 1).
    ``--micro-batch-size ROWS`` sets ``args.micro_batches`` to ``--batch-size`` / (ROWS x
    DATA x EXPERT of ``args.mesh_shape``, :func:`~sp_jax.training.Launch.resolve_mesh`'s
    resolved shape); call it after :func:`check_pipeline_args`.

    Raises:
      ValueError: a bad value, naming the flag, e.g. ``--lr inf must be positive and
        finite``.
    """
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.steps // 10)
    _resolve_micro_batch_size(args)
    if not 0 < args.lr < math.inf:
        raise ValueError(f"--lr {args.lr} must be positive and finite")
    if not 0 <= args.weight_decay < math.inf:
        raise ValueError(f"--weight-decay {args.weight_decay} must be >= 0 and finite")
    if min(args.warmup_steps, args.save_every, args.eval_every) < 0:
        raise ValueError("--warmup-steps, --save-every and --eval-every must be >= 0")
    if not 0 <= args.final_lr_fraction <= 1:
        raise ValueError(f"--final-lr-fraction {args.final_lr_fraction} must be in [0, 1]")
    held = getattr(args, "held_out_fraction", None)  # add_held_out_argument's flag
    if held is not None and not 0 < held < 1:
        raise ValueError(f"--held-out-fraction {held} must be in (0, 1)")
    return TrainerConfig.from_args(args)


def _resolve_micro_batch_size(args: argparse.Namespace) -> None:
    """``--micro-batch-size ROWS`` -> ``args.micro_batches``: ``--batch-size`` / (ROWS x
    the batch's shards, DATA x EXPERT of ``args.mesh_shape``, as :func:`check_model_args`
    splits a micro-batch)."""
    rows = getattr(args, "micro_batch_size", None)
    if rows is None:
        return
    if getattr(args, "micro_batches_given", False):
        raise ValueError("--micro-batches and --micro-batch-size are two ways to set the "
                         "same thing: give one of them")
    if rows <= 0:
        raise ValueError(f"--micro-batch-size {rows} must be positive")
    stages, data, experts, _, _ = getattr(args, "mesh_shape", None) or (1,) * 5
    if stages > 1:
        raise ValueError("--micro-batch-size with a pipeline (STAGE > 1 in --mesh): the "
                         "step's micro-batches are the pipeline's --microbatches; give that")
    shards = data * experts
    if args.batch_size % (rows * shards):
        raise ValueError(f"--batch-size {args.batch_size} is not divisible by "
                         f"--micro-batch-size {rows} x {shards} data shards (DATA x EXPERT "
                         f"of --mesh) = {rows * shards} sequences per micro-batch")
    args.micro_batches = args.batch_size // (rows * shards)


def optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    """Global-norm clipping at 1.0, then AdamW with ``--lr`` (linear warmup over
    ``--warmup-steps``, cosine decay to ``--final-lr-fraction`` x lr at ``--steps``) and
    ``--weight-decay``, its moments stored in ``--moments-dtype``
    (:func:`sp_jax.training.adamw`; fp32: bitwise ``optax.adamw``)."""
    moments = MOMENTS_DTYPES[getattr(args, "moments_dtype", "fp32")]
    moments = None if moments == jnp.float32 else moments
    return optax.chain(optax.clip_by_global_norm(1.0), adamw(
        warmup_cosine_schedule(args.lr, args.warmup_steps, args.steps,
                               final_fraction=args.final_lr_fraction),
        weight_decay=args.weight_decay, mu_dtype=moments, nu_dtype=moments))


def offload_options(args: argparse.Namespace) -> dict[str, bool]:
    """:class:`~sp_jax.training.TrainStep`'s offload options from ``--offload-optimizer``
    and ``--offload-params`` (False where a parser lacks them)."""
    return {"offload_optimizer": bool(getattr(args, "offload_optimizer", False)),
            "offload_params": bool(getattr(args, "offload_params", False))}


def lr_schedule(step: int, run: Mapping[str, Any]) -> float:
    """The learning rate of :func:`optimizer` at optimizer step ``step`` (1-based) of a run
    with the settings ``run`` (a checkpoint's ``"run"`` section: ``lr``,
    ``warmup_steps``, ``steps``, ``final_lr_fraction``), for
    :class:`~sp_jax.training.Trainer`'s ``lr_schedule``."""
    schedule = _compiled_schedule(run["lr"], run["warmup_steps"], run["steps"],
                                  run["final_lr_fraction"])
    return float(schedule(np.int32(step - 1)))


@functools.lru_cache(maxsize=8)
def _compiled_schedule(lr: float, warmup_steps: int, steps: int, final_lr_fraction: float
                       ) -> Callable[[Any], jax.Array]:
    """:func:`optimizer`'s schedule as one compiled function (evaluated op by op, it
    dispatches a dozen operations every step); the step computes it the same way."""
    return jax.jit(warmup_cosine_schedule(lr, warmup_steps, steps,
                                          final_fraction=final_lr_fraction))


def shared_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The settings every process must agree on (checked before the first step): every
    attribute of ``args`` but the :data:`PER_PROCESS` ones."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in PER_PROCESS}


def run_metadata(args: argparse.Namespace, model: Any) -> dict[str, dict[str, Any]]:
    """What a checkpoint records besides the arrays: ``"model"``, the fields of the model
    config ``model`` (must match on resume; non-JSON values as strings), and ``"run"``, the
    :data:`RUN_SETTINGS` flags ``args`` has (may change, with a warning)."""
    fields = {k: v if isinstance(v, int | float | str | bool | None) else str(v)
              for k, v in vars(model).items()}
    return {"model": fields, "run": {k: getattr(args, k) for k in RUN_SETTINGS
                                     if hasattr(args, k)}}


def _flag_invocation(action: argparse.Action) -> str:
    """``--steps N`` / ``--preset {gpt,llama-tiny}`` / ``--data GLOB [GLOB ...]``: the
    option strings and what follows them (nothing for a switch)."""
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar or (
        "{" + ",".join(map(str, action.choices)) + "}" if action.choices
        else action.dest.upper())
    value = f"{metavar} [{metavar} ...]" if action.nargs == "+" else \
        f"[{metavar} ...]" if action.nargs == "*" else metavar
    return f"{names} {value}"


def _flag_default(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "off" if action.default is False else "on" if action.default is True else ""
    if action.default is None or action.required:
        return "required" if action.required else ""
    value = action.default
    return "`" + (" ".join(map(str, value)) if isinstance(value, list | tuple)
                  else str(value)) + "`"


def markdown_flags(parser: argparse.ArgumentParser) -> str:
    """The flags of ``parser`` as a markdown table (``flag | default | meaning``, one row
    per flag in the order they were added, ``-h`` left out; the meaning is the
    flag's help text): what docs/training.md shows of each example script, written by
    ``scripts/flag_tables.py`` (``--check``: compare only)."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        text = (action.help or "") % {"default": action.default, "prog": parser.prog} \
            if "%(" in (action.help or "") else (action.help or "")
        cells = [f"`{_flag_invocation(action)}`", _flag_default(action), " ".join(text.split())]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"

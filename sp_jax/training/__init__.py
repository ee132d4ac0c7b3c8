"""Training: the loop, the jitted step, its schedule, multi-process launch, faults, logs, flags.

Modules:

* ``trainer``: :class:`Trainer` (the training loop: resume with fallback over damaged
  checkpoints, eval before save, divergence, stop requests, watchdogs, metrics log,
  progress bar), :class:`TrainerConfig`, :class:`TrainResult`, :class:`TrainingStopped`
  (a stopped run's message and exit status), :func:`open_checkpoints`,
  :func:`~trainer.data_state` (a stateful input pipeline's position, merged over the
  processes, saved with each checkpoint); ``trainer_config`` holds the config, result and
  stop types it re-exports.
* ``cli``: the command line of a training script: :func:`add_trainer_arguments` (and the
  parallelism and model flags, ``--preset``), the checks of the flags (``ValueError``
  naming them), :func:`~cli.shared_settings`, :func:`~cli.run_metadata`.
* ``finetune``: fine-tuning a Hugging Face checkpoint on text (``examples/finetune_hf.py``):
  the data flags, the checkpoint's own tokenizer checked against its vocabulary and
  ``eos_token_id``, the tokenizer files written beside the checkpoint.
* ``step``: :class:`TrainStep` (one jitted optimizer step with micro-batch gradient
  accumulation in fp32, explicit shardings, donated state), :func:`accumulate_gradients`,
  :func:`lm_loss`, :func:`device_bytes`, :func:`optimizer_shardings` (ZeRO-1's layout of
  the optimizer state).
* ``offload``: the optimizer state and master weights in ``pinned_host`` memory between
  steps (``TrainStep(offload_optimizer=True, offload_params=True)``): the transfers, the
  refusal on a backend without host memory.
* ``optimizer``: :func:`adamw` (``optax.adamw`` with the first and second moments
  stored in a chosen dtype, e.g. bf16; bitwise ``optax.adamw`` without one).
* ``schedule``: :func:`warmup_cosine_schedule` (optax's warmup-cosine in 1-based steps).
* ``launch``: :class:`Launch` (``jax.distributed`` set-up, SLURM / Open MPI detection),
  :func:`build_mesh`, :func:`parse_mesh` / :func:`mesh_description` (``--mesh
  DATA[,CONTEXT],TENSOR``), :func:`add_launch_arguments`, :func:`cluster_tasks`.
* ``log``: :class:`MetricsLog` (JSON lines, resumable, whole lines only:
  :class:`MetricsLogError` on a full disk), :class:`TensorBoardLog` (the same records as
  TensorBoard scalars), :func:`~log.device_peak_flops` / :func:`~log.model_flops_utilization`
  and :func:`plot_losses`.
* ``faults``: :class:`StopSignals` and :func:`agree_to_stop` (SIGTERM / SIGINT: every
  process stops after the same step), :func:`check_same_settings` (processes started
  with different flags fail fast), :class:`Watchdog` (a stalled peer ends the run),
  :class:`Heartbeats` (name the process that stalled, died or failed), :func:`leave`,
  :class:`DivergenceGuard` (nothing diverged is saved) and the exit statuses.

The data these steps train on comes from :mod:`sp_jax.data`; checkpoints from
:mod:`sp_jax.checkpoint`.
"""

from sp_jax.training import (
    cli,
    faults,
    finetune,
    launch,
    log,
    offload,
    optimizer,
    schedule,
    step,
    trainer,
)
from sp_jax.training.cli import add_trainer_arguments
from sp_jax.training.faults import (
    DivergenceGuard,
    Heartbeats,
    StopSignals,
    Watchdog,
    agree_to_stop,
    announce_failure,
    check_same_settings,
    exit_on_peer_failure,
    leave,
)
from sp_jax.training.launch import (
    MESH_AXES,
    Launch,
    add_launch_arguments,
    build_mesh,
    cluster_tasks,
    mesh_description,
    parse_mesh,
)
from sp_jax.training.log import MetricsLog, MetricsLogError, TensorBoardLog, plot_losses
from sp_jax.training.optimizer import adamw
from sp_jax.training.preference import dpo_loss, dpo_pair_losses, reference_log_probs
from sp_jax.training.schedule import warmup_cosine_schedule
from sp_jax.training.step import (
    TrainStep,
    accumulate_gradients,
    device_bytes,
    lm_loss,
    optimizer_shardings,
    train_step_fn,
)
from sp_jax.training.trainer import (
    Trainer,
    TrainerConfig,
    TrainingStopped,
    TrainResult,
    open_checkpoints,
)

__all__ = [
    "MESH_AXES",
    "DivergenceGuard",
    "Heartbeats",
    "StopSignals",
    "Watchdog",
    "agree_to_stop",
    "announce_failure",
    "check_same_settings",
    "exit_on_peer_failure",
    "leave",
    "faults",
    "finetune",
    "Launch",
    "MetricsLog",
    "MetricsLogError",
    "TensorBoardLog",
    "TrainResult",
    "TrainStep",
    "Trainer",
    "TrainerConfig",
    "TrainingStopped",
    "accumulate_gradients",
    "adamw",
    "add_launch_arguments",
    "add_trainer_arguments",
    "build_mesh",
    "cli",
    "cluster_tasks",
    "device_bytes",
    "dpo_loss",
    "dpo_pair_losses",
    "launch",
    "lm_loss",
    "log",
    "reference_log_probs",
    "mesh_description",
    "offload",
    "open_checkpoints",
    "optimizer",
    "optimizer_shardings",
    "parse_mesh",
    "plot_losses",
    "schedule",
    "step",
    "train_step_fn",
    "trainer",
    "warmup_cosine_schedule",
]

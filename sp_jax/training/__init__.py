"""Training: the jitted step, its learning-rate schedule, multi-process launch, metrics logs.

Modules:

* ``step``: :class:`TrainStep` (one jitted optimizer step with micro-batch gradient
  accumulation in fp32, explicit shardings, donated state), :func:`accumulate_gradients`,
  :func:`lm_loss`, :func:`device_bytes`.
* ``schedule``: :func:`warmup_cosine_schedule` (optax's warmup-cosine in 1-based steps).
* ``launch``: :class:`Launch` (``jax.distributed`` set-up, SLURM / Open MPI detection),
  :func:`build_mesh`, :func:`parse_mesh` / :func:`mesh_description` (``--mesh
  DATA[,CONTEXT],TENSOR``), :func:`add_launch_arguments`, :func:`cluster_tasks`.
* ``log``: :class:`MetricsLog` (JSON lines, resumable) and :func:`plot_losses`.
* ``faults``: :class:`StopSignals` and :func:`agree_to_stop` (SIGTERM / SIGINT: every
  process stops after the same step), :func:`check_same_settings` (processes started
  with different flags fail fast), :class:`Watchdog` (a stalled peer ends the run),
  :class:`DivergenceGuard` (nothing diverged is saved) and the exit statuses.

The data these steps train on comes from :mod:`sp_jax.data`; checkpoints from
:mod:`sp_jax.checkpoint`.
"""

from sp_jax.training import faults, launch, log, schedule, step
from sp_jax.training.faults import (
    DivergenceGuard,
    StopSignals,
    Watchdog,
    agree_to_stop,
    check_same_settings,
    exit_on_peer_failure,
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
from sp_jax.training.log import MetricsLog, plot_losses
from sp_jax.training.schedule import warmup_cosine_schedule
from sp_jax.training.step import (
    TrainStep,
    accumulate_gradients,
    device_bytes,
    lm_loss,
    train_step_fn,
)

__all__ = [
    "MESH_AXES",
    "DivergenceGuard",
    "StopSignals",
    "Watchdog",
    "agree_to_stop",
    "check_same_settings",
    "exit_on_peer_failure",
    "faults",
    "Launch",
    "MetricsLog",
    "TrainStep",
    "accumulate_gradients",
    "add_launch_arguments",
    "build_mesh",
    "cluster_tasks",
    "device_bytes",
    "launch",
    "lm_loss",
    "log",
    "mesh_description",
    "parse_mesh",
    "plot_losses",
    "schedule",
    "step",
    "train_step_fn",
    "warmup_cosine_schedule",
]

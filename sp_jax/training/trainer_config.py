"""What a :class:`~sp_jax.training.Trainer` run does and how it ends: its
:class:`TrainerConfig` (every field checked, with messages that name the command-line
flags of ``examples/train_gpt.py``), :class:`TrainResult` and :class:`TrainingStopped`."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any, Literal

from sp_jax.training import faults

__all__ = ["TrainResult", "TrainerConfig", "TrainingStopped", "flag"]

# The command-line flag of a TrainerConfig field where it is not "--" + field with dashes.
_FLAGS = {"peer_timeout_s": "--peer-timeout", "compile_allowance_s": "--compile-allowance",
          "progress": "--no-progress"}


def flag(field: str) -> str:
    """The command-line flag of a :class:`TrainerConfig` field (``--peer-timeout``)."""
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _problems(v: Mapping[str, Any], flags: bool) -> Iterator[str]:
    """The problems of the settings ``v`` (TrainerConfig fields), first to last, as
    command-line flags (``flags``: ``--loss-spike 0.5 must be > 1 ...``) or as fields
    (``loss_spike=0.5 must be > 1 ...``)."""
    def name(field: str, value: bool = True) -> str:
        if flags:
            return flag(field) + (f" {v[field]}" if value else "")
        return f"{field}={v[field]!r}" if value else field

    for f in ("steps", "batch_size", "micro_batches", "eval_batches"):
        if not _is_int(v[f]) or v[f] <= 0:
            yield f"{name(f, not flags)} must be positive" + ("" if flags else " (an int)")
    for f in ("eval_every", "save_every", "seed"):
        if not _is_int(v[f]) or v[f] < 0:
            yield f"{name(f)} must be an int >= 0"
    if _is_int(v["seed"]) and v["seed"] >= 2**63:
        yield f"{name('seed')} must be < 2**63 (a 64-bit seed)"
    if v["batch_size"] % v["micro_batches"]:
        yield f"{name('batch_size')} is not divisible by {name('micro_batches')}"
    spike = v["loss_spike"]
    if not isinstance(spike, int | float) or spike and not (spike > 1 and math.isfinite(spike)):
        yield f"{name('loss_spike')} must be > 1 (or 0 to stop on non-finite losses only)"
    if not isinstance(v["max_update_ratio"], int | float) or not (
            0 <= v["max_update_ratio"] < math.inf):
        yield f"{name('max_update_ratio')} must be >= 0 and finite (0: no limit)"
    if v["ckpt_dir"] and os.path.exists(v["ckpt_dir"]) and not os.path.isdir(v["ckpt_dir"]):
        yield f"{name('ckpt_dir')} is a file, not a directory"
    if v["tensorboard"] and os.path.isfile(v["tensorboard"]):
        yield f"{name('tensorboard')} is a file; name a directory"
    if v["log_json"] and os.path.isdir(v["log_json"]):
        yield f"{name('log_json')} is a directory; name a file"
    if (v["save_every"] or v["resume"]) and not v["ckpt_dir"]:
        yield (f"{name('save_every', False)} / {name('resume', False)} need "
               f"{name('ckpt_dir', False)}")
    if v["max_to_keep"] is not None and (not _is_int(v["max_to_keep"]) or v["max_to_keep"] < 1):
        yield f"{name('max_to_keep')} must be a positive int (or None to keep every step)"
    for f in ("peer_timeout_s", "compile_allowance_s"):
        if not isinstance(v[f], int | float) or not 0 < v[f] < math.inf:
            yield f"{name(f)} must be positive (seconds)"
    for f in ("debug_nans", "progress"):
        if not isinstance(v[f], bool):
            yield f"{name(f)} must be True or False"
    if not (isinstance(v["resume"], bool) or v["resume"] == "auto"):
        yield f"{name('resume')} must be True, False or 'auto'"


@dataclasses.dataclass(frozen=True)
class TrainerConfig:
    """What a :class:`Trainer` run does (every field is checked on construction).

    Attributes:
      steps: the last optimizer step (a resumed run continues up to it).
      batch_size: global sequences per step, split into ``micro_batches``.
      micro_batches: gradient-accumulation micro-batches (the batch's leading dimension).
      seed: the data order (and, with the step, dropout's key).
      eval_every: held-out loss at step 0, every K steps and after the last; 0: after the
        last (and before each save) only.
      eval_batches: held-out micro-batches per evaluation.
      save_every: checkpoint every K steps and after the last (needs ``ckpt_dir``); 0: only
        when stopped by a signal.
      ckpt_dir: the checkpoint directory (shared by all processes); None: no checkpoints.
      resume: continue from the newest intact checkpoint in ``ckpt_dir`` (required when it
        holds any; an error when it holds none); ``"auto"``: continue from it when there
        is one, else start (a job that a scheduler requeues runs the same command again).
      max_to_keep: checkpoints kept (the oldest are deleted); None keeps all.
      log_json: the JSON-lines metrics file process 0 writes; None: in memory only.
      tensorboard: a TensorBoard directory process 0 writes the same metrics to
        (:class:`~sp_jax.training.log.TensorBoardLog`); None: none.
      loss_spike: a loss over this factor x the median of the last 20 stops the run as
        diverged; 0: non-finite losses only.
      max_update_ratio: a step whose update norm exceeds this x the parameters' norm stops
        the run as diverged; 0: no limit.
      peer_timeout_s: multi-process: a step, evaluation, save or restore that makes no
        progress for this long ends the process (a stalled or dead peer).
      compile_allowance_s: added to the first call of each kind (it compiles).
      debug_nans: run under ``jax.debug_nans`` (names the operation making a NaN).
      progress: a tqdm progress bar on stderr (process 0, when stderr is a terminal).
    """

    steps: int
    batch_size: int
    micro_batches: int = 1
    seed: int = 0
    eval_every: int = 0
    eval_batches: int = 4
    save_every: int = 0
    ckpt_dir: str | None = None
    resume: bool | Literal["auto"] = False
    max_to_keep: int | None = 3
    log_json: str | None = None
    tensorboard: str | None = None
    loss_spike: float = 3.0
    max_update_ratio: float = 1.0
    peer_timeout_s: float = 120.0
    compile_allowance_s: float = 600.0
    debug_nans: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        for field in ("ckpt_dir", "log_json", "tensorboard"):
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, os.fspath(value))
        problem = next(_problems(dataclasses.asdict(self), flags=False), None)
        if problem:
            raise ValueError(f"TrainerConfig: {problem}.")

    @classmethod
    def from_args(cls, args: Any) -> TrainerConfig:
        """The config of the flags :func:`sp_jax.training.cli.add_trainer_arguments` and
        :func:`~sp_jax.training.add_launch_arguments` (``--peer-timeout``) define; flags
        that are absent keep the defaults.

        Raises:
          ValueError: a bad value, naming the flag as the command line spells it, e.g.
            ``--loss-spike 0.5 must be > 1 (or 0 to stop on non-finite losses only)``.
        """
        values = {f.name: getattr(args, f.name, f.default) for f in dataclasses.fields(cls)}
        values["peer_timeout_s"] = getattr(args, "peer_timeout", cls.peer_timeout_s)
        values["compile_allowance_s"] = getattr(args, "compile_allowance",
                                                cls.compile_allowance_s)
        values["progress"] = not getattr(args, "no_progress", not cls.progress)
        problem = next(_problems(values, flags=True), None)
        if problem:
            raise ValueError(problem)
        return cls(**values)


class TrainingStopped(Exception):
    """The run stopped before its last step; ``str(e)`` says why and what to do.

    Attributes:
      status: the process exit status it calls for: :data:`~faults.EXIT_DIVERGED`,
        :data:`~faults.EXIT_INTERRUPTED`, :data:`~faults.EXIT_PEER_FAILED` or
        :data:`~faults.EXIT_ERROR`.
    """

    def __init__(self, message: str, status: int = faults.EXIT_ERROR):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What :meth:`Trainer.run` did.

    Attributes:
      start_step: the checkpoint step the run continued from (0: a fresh run).
      first_loss: the training loss of step ``start_step + 1`` (None: nothing to do).
      last_loss: the training loss of the last step (None: nothing to do).
      eval_loss: the held-out loss after the last step (None: nothing to do).
      records: the metrics log's records, those kept from before a resume included.
      seconds: the run's wall time.
    """

    start_step: int
    first_loss: float | None
    last_loss: float | None
    eval_loss: float | None
    records: list[dict[str, Any]]
    seconds: float

    @property
    def losses(self) -> dict[int, float]:
        """``{step: training loss}`` of :attr:`records`."""
        return {r["step"]: r["loss"] for r in self.records if "loss" in r}

    @property
    def eval_losses(self) -> dict[int, float]:
        """``{step: held-out loss}`` of :attr:`records` (step 0: before training)."""
        return {r["step"]: r["eval_loss"] for r in self.records if "eval_loss" in r}

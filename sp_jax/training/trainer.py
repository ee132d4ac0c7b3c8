"""The training loop: resumable, checkpointed, and safe against the faults of a long run.

:class:`Trainer` runs a :class:`~sp_jax.training.TrainStep` over the batches of a
:class:`~sp_jax.data.TrainData` (e.g. :class:`~sp_jax.data.ByteCorpus`,
:class:`~sp_jax.data.TokenIds`) as its :class:`TrainerConfig` says, on every process of a
multi-process run alike::

    config = TrainerConfig(steps=600, batch_size=16, micro_batches=2, eval_every=100,
                           ckpt_dir="runs/ckpt", save_every=50, log_json="runs/gpt.jsonl")
    with jax.set_mesh(mesh):
        step = TrainStep(GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)), tx)
        result = Trainer(step, corpus, config, metadata={"model": {...}, "run": {...}}).run()
    print(result.first_loss, result.last_loss, result.eval_loss)

What it does, step ``i`` of ``1 .. steps`` (the batch of step ``i`` is
``data.train_batch(i, seed=...)``, so a resumed run trains on what an uninterrupted one
would have):

* Resume (``ckpt_dir``): a fresh run into a directory that holds checkpoints is refused,
  and so is ``resume`` without one. The newest intact checkpoint is restored onto the
  current mesh; damaged newer steps are named, skipped and moved aside
  (``CheckpointManager.quarantine``). Every checkpoint records what changes a run's
  numbers, and a resume compares it (:data:`RESUME_RULE`): another model (metadata
  section ``"model"``) is refused; a changed run setting (section ``"run"``: ``steps``,
  ``batch_size``, ``micro_batches`` and ``seed``, which the trainer adds, and the
  caller's, e.g. the learning rate and the data) is warned about with both values and
  what it does to the run (another ``steps`` moves the learning-rate schedule); the
  mesh and the process count may change freely (the same numbers up to float rounding).
* Eval before save: the held-out loss is computed at step 0, every ``eval_every`` steps,
  at the end and right before every checkpoint, so a checkpoint is written only after
  its own parameters gave a good held-out loss.
* Divergence (:class:`~sp_jax.training.faults.DivergenceGuard`): a non-finite loss, a
  loss over ``loss_spike`` x the recent median, or an update over ``max_update_ratio`` x
  the parameters' norm stops the run without saving (:data:`~faults.EXIT_DIVERGED`).
* Stop requests: SIGTERM / SIGINT to any process (:class:`~faults.StopSignals`) stop
  every process after the same step (:func:`~faults.agree_to_stop`) with a checkpoint
  (:data:`~faults.EXIT_INTERRUPTED`).
* Peers: every step, evaluation, save, restore and stop agreement is watched
  (:class:`~faults.Watchdog`, ``peer_timeout_s``; the first of each kind compiles and gets
  ``compile_allowance_s`` more), and a failed collective ends the process
  (:func:`~faults.exit_on_peer_failure`): one line, exit 4, naming the step and the
  process that stalled or died (:class:`~faults.Heartbeats`).
* Output: one JSON line per step and per evaluation (:class:`MetricsLog`, kept up to the
  checkpoint on resume), a tqdm progress bar on stderr (``progress``; tqdm is imported only
  then), and process 0 alone prints (``say``): the held-out losses, the compile time and
  per-device memory after the first step, resume warnings.

A run that cannot go on raises :class:`TrainingStopped` with the message to print and the
exit status (``faults.EXIT_*``). Messages name the command-line flags of
``examples/train_gpt.py`` (``--lr``, ``--resume``, ...) that :mod:`sp_jax.training.cli`
maps onto :class:`TrainerConfig`.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from sp_jax._quiet import quiet_gloo
from sp_jax.checkpoint import (
    ABSENT,
    CheckpointLockedError,
    CheckpointManager,
    CheckpointSaveError,
    NonFiniteError,
    abstract_like,
)
from sp_jax.data import Batch, TrainData
from sp_jax.layout import Layout
from sp_jax.training import faults
from sp_jax.training.launch import mesh_description
from sp_jax.training.log import (
    MetricsLog,
    TensorBoardLog,
    device_peak_flops,
    model_flops_utilization,
)
from sp_jax.training.step import TrainStep, device_bytes
from sp_jax.training.trainer_config import TrainerConfig, TrainingStopped, TrainResult
from sp_jax.training.trainer_config import flag as _flag

__all__ = ["RESUME_RULE", "TrainResult", "Trainer", "TrainerConfig", "TrainingStopped",
           "data_state", "open_checkpoints"]


@contextlib.contextmanager
def open_checkpoints(config: TrainerConfig) -> Iterator[CheckpointManager | None]:
    """The :class:`~sp_jax.checkpoint.CheckpointManager` of ``config.ckpt_dir`` (None
    without one), closed on exit. It takes the directory's writer lock: open it before
    building the model to refuse a second trainer early, and pass it to :class:`Trainer`.

    Raises:
      TrainingStopped: the directory is in use by another writer or cannot be created;
        it holds checkpoints and ``config.resume`` is off, or none and ``config.resume``
        is True (:meth:`Trainer.run` would refuse it after building everything).
    """
    if config.ckpt_dir is None:
        yield None
        return
    try:
        manager = CheckpointManager(config.ckpt_dir, max_to_keep=config.max_to_keep)
    except (ValueError, OSError, CheckpointLockedError) as e:
        raise TrainingStopped(str(e)) from e
    with manager:
        _resume_step(manager, config)
        yield manager


def _resume_step(manager: CheckpointManager, config: TrainerConfig) -> int | None:
    """The latest step in ``manager`` to resume from (None: start afresh); refuses a fresh
    run into a used directory, and ``resume=True`` without a checkpoint (``resume="auto"``
    then starts)."""
    latest, where = manager.latest_step(), config.ckpt_dir or manager.directory
    if latest is not None and not config.resume:
        raise TrainingStopped(f"--ckpt-dir {where} already holds checkpoints (steps "
                              f"{manager.all_steps()}); pass --resume to continue from "
                              f"step {latest}, or use another directory")
    if latest is None and config.resume is True:  # a mistyped --ckpt-dir must not start over
        raise TrainingStopped(f"--resume: no checkpoint in --ckpt-dir {where}; check "
                              "the path, or drop --resume to start a new run")
    return latest


def _print(message: str) -> None:
    print(message, file=sys.stdout, flush=True)


_RUN_FIELDS = ("steps", "batch_size", "micro_batches", "seed")
"""The :class:`TrainerConfig` fields that change a run's numbers, recorded in the
``"run"`` section of every checkpoint's metadata."""

_CONSEQUENCE = {
    "batch_size": "each step from step {next} on draws another batch than the saved run's",
    "micro_batches": "the same batches, accumulated in another number of parts: the losses "
                     "equal the saved run's up to float rounding",
    "seed": "the data order (and dropout) from step {next} on differ from the saved run's; "
            "the parameters come from the checkpoint, not from the new seed",
    "data": "training and held-out data from step {next} on differ from the saved run's",
    **dict.fromkeys(("max_data_bytes", "tokenizer", "text_field", "packing"),
                    "training and held-out data from step {next} on differ from the saved "
                    "run's"),
    "lr": "the optimizer uses the new value from step {next} on",
    "warmup_steps": "the learning-rate schedule from step {next} on follows the new value",
    "final_lr_fraction": "the learning-rate schedule from step {next} on follows the new "
                         "value",
    "weight_decay": "the optimizer uses the new value from step {next} on",
    "remat": "the same arrays, the blocks' activations recomputed in the backward or kept: "
             "memory and step time change, the losses equal the saved run's up to float "
             "rounding",
    "attention_implementation": "the same arrays through another attention kernel: the "
                                "losses equal the saved run's up to float rounding",
}
"""What a changed run setting does to a resumed run (``{next}``: its first step)."""

RESUME_RULE = """On resume each setting a checkpoint records is compared with the current run's:
- the model (metadata section "model", e.g. every GPTConfig field, the compute dtype
  included) must be equal: a difference is refused, naming each field with both values;
  but remat and the attention kernel, which compute the same arrays another way, may
  change, with a warning as a run setting's;
- a run setting (section "run": steps, batch_size, micro_batches, seed, and those the
  caller records, e.g. the learning rate, its warmup and decay, weight decay, the data) may
  change: one warning per setting with the saved and the current value and what it does;
  another --steps moves a learning-rate schedule that depends on the run length (warmup,
  cosine decay) to the new length from the next step on;
- the mesh, the process count and the parallel layout may change without a word (the
  same numbers up to float rounding; the layers, their optimizer moments and FP8 amax
  histories converted between the unrolled, stacked and pipeline-repeat forms); the
  resume line names the mesh the step was saved on;
- a setting the checkpoint does not record (saved by an earlier version) is named once
  and not checked."""
"""The rule a :class:`Trainer` applies to a checkpoint's recorded settings on resume."""


def _gather_json(value: Any) -> list[Any]:
    """Every process's JSON-serialisable ``value`` (in process order), on every process."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    blob = np.frombuffer(json.dumps(value).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.int64(len(blob)))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(blob)] = blob
    every = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(every, lengths, strict=True)]


def data_state(data: TrainData) -> dict[str, Any] | None:
    """The input pipeline's position for a checkpoint: a stateful source's (one with
    ``state()``, e.g. :class:`~sp_jax.data.PackedText`) states of all processes merged
    (every process reads only its rows' streams); None for a pure function of the step
    (:class:`~sp_jax.data.TokenIds`). A collective in a multi-process run."""
    if not hasattr(data, "state"):
        return None
    from sp_jax.data.packed import merge_states

    return merge_states(_gather_json(data.state()))


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.2f}MiB"


def _tokens(batch: Batch) -> int:
    """Tokens of a batch: the size of its ``tokens`` (else of its first leaf)."""
    leaf = batch["tokens"] if isinstance(batch, Mapping) and "tokens" in batch else \
        jax.tree.leaves(batch)[0]
    return int(leaf.size)


class Trainer:
    """Trains ``step`` on ``data`` as ``config`` says (see the module docstring).

    Args:
      step: the :class:`~sp_jax.training.TrainStep` (model and optimizer state, built under
        the mesh); :meth:`run` updates its ``params`` and ``opt_state``.
      data: a :class:`~sp_jax.data.TrainData`; batches ``[micro_batches, batch_size /
        micro_batches, seq]`` sharded ``layout.micro_batched_tokens``, held-out
        ``[batch_size / micro_batches, seq]`` sharded ``layout.tokens``.
      config: the :class:`TrainerConfig`.
      metadata: saved with every checkpoint, JSON sections ``{"model": {...}, "run":
        {...}}``: on resume a differing ``"model"`` is refused, other sections are warned
        about (:func:`sp_jax.training.cli.run_metadata` builds them from flags). The
        trainer adds its own run settings to ``"run"`` (:data:`RESUME_RULE`).
      lr_schedule: ``(step, run) -> learning rate`` at optimizer step ``step`` (1-based)
        of the run whose ``"run"`` settings (the metadata section, e.g. ``steps``,
        ``lr``, ``warmup_steps``) are ``run``; with it, a resume with another ``steps``
        says where the schedule moves (e.g. from 1.6e-3 to 2.1e-3 at the next step).
      mesh: the mesh to train on; default: the current one (``jax.set_mesh``).
      layout: the batches' layout; default ``Layout.of(step.model.parallel)`` (a
        :class:`~sp_jax.models.GPT`'s), else ``Layout()``.
      checkpoints: an open manager of ``config.ckpt_dir`` (:func:`open_checkpoints`,
        opened early to refuse a second writer before building anything); default:
        :meth:`run` opens and closes it.
      signals: entered :class:`~faults.StopSignals` to poll (installed early, to catch a
        signal while the model is built); default: :meth:`run` installs its own.
      say: prints one line on process 0 (default: stdout, flushed); never called on the
        other processes.
      flops_per_token: the model's training FLOPs per token (e.g.
        :meth:`~sp_jax.models.GPTConfig.flops_per_token`): each step's record then has its
        model FLOPs utilisation ``mfu`` where the devices' peak is known
        (:func:`~sp_jax.training.log.device_peak_flops`; not on CPUs).

    A stateful ``data`` (``state()`` / ``restore(state)``, e.g.
    :class:`~sp_jax.data.PackedText`) has its position saved with every checkpoint
    (:func:`data_state`) and restored on resume, so the resumed run reads exactly the
    batches the uninterrupted one would have, on any mesh and process count.
    """

    def __init__(self, step: TrainStep, data: TrainData, config: TrainerConfig, *,
                 metadata: Mapping[str, Mapping[str, Any]] | None = None,
                 mesh: jax.sharding.Mesh | None = None, layout: Layout | None = None,
                 checkpoints: CheckpointManager | None = None,
                 signals: faults.StopSignals | None = None,
                 say: Callable[[str], None] | None = None,
                 lr_schedule: Callable[[int, Mapping[str, Any]], float] | None = None,
                 flops_per_token: float | None = None):
        if not isinstance(config, TrainerConfig):
            raise TypeError(f"Trainer: config must be a TrainerConfig, got "
                            f"{type(config).__name__}.")
        if not isinstance(data, TrainData):
            raise TypeError(f"Trainer: data ({type(data).__name__}) needs train_batch(step, *, "
                            "seed, batch_size, micro_batches, sharding) and held_out_batches("
                            "count, *, batch_size, sharding), as sp_jax.data.TokenIds has.")
        self.mesh = mesh if mesh is not None else jax.sharding.get_mesh()
        if self.mesh.empty:
            raise ValueError("Trainer: no mesh: build the trainer under jax.set_mesh(mesh) "
                             "or pass mesh=.")
        parallel = getattr(step.model, "parallel", None)
        if layout is None:
            layout = Layout.of(parallel) if parallel is not None else Layout()
        self.layout = layout
        data_size = math.prod(self.mesh.shape[a] for a in layout.data_axes)
        micro = config.batch_size // config.micro_batches
        if micro % data_size:
            raise ValueError(
                f"Trainer: the micro-batch (batch_size / micro_batches = {micro} sequences) "
                f"is not divisible by the data-parallel size {data_size} (mesh axes "
                f"{layout.data_axes}); choose a batch size that is a multiple of "
                f"{data_size * config.micro_batches}.")
        self.step, self.data, self.config = step, data, config
        self.metadata = {**(metadata or {}), "run": {
            **{f: getattr(config, f) for f in _RUN_FIELDS},
            **(metadata or {}).get("run", {})}}
        self.lr_schedule = lr_schedule
        peak = device_peak_flops(self.mesh.devices.flat[0])
        self._peak = None if peak is None or not flops_per_token else \
            (peak * self.mesh.devices.size, flops_per_token)
        self.checkpoints, self.signals = checkpoints, signals
        self.say = say or _print
        self.records: list[dict[str, Any]] = []
        multiprocess = jax.process_count() > 1
        self.heartbeats = (faults.Heartbeats(faults.Heartbeats.interval_for(
            config.peer_timeout_s)) if multiprocess else None)
        self.watchdog = faults.Watchdog(config.peer_timeout_s if multiprocess else None,
                                        name=f"process {jax.process_index()}",
                                        heartbeats=self.heartbeats)
        self._compiled: set[str] = set()
        self._tensorboard = TensorBoardLog(None)
        self._bar: Any = None
        self.guard = self._new_guard()
        self.saved: int | None = None

    def _new_guard(self) -> faults.DivergenceGuard:
        return faults.DivergenceGuard(self.config.loss_spike or None,
                                      max_update_ratio=self.config.max_update_ratio or None)

    @property
    def _ckpt_dir(self) -> str | None:
        if self.config.ckpt_dir is not None or self.checkpoints is None:
            return self.config.ckpt_dir
        return self.checkpoints.directory

    # -- output ---------------------------------------------------------------------------

    def _print(self, message: str) -> None:
        """``say`` on process 0 only (every process runs the same loop), above the bar."""
        if jax.process_index() != 0:
            return
        if self._bar is None:
            self.say(message)
            return
        with self._bar.external_write_mode(file=sys.stdout):
            self.say(message)

    def _progress(self, start: int) -> contextlib.AbstractContextManager:
        """tqdm's bar over steps ``start + 1 .. steps`` on process 0 (``progress``)."""
        if not (self.config.progress and jax.process_index() == 0):
            return contextlib.nullcontext()
        try:
            from tqdm import tqdm
        except ImportError as e:
            raise ImportError("Trainer: progress=True needs tqdm, a dependency of sp_jax: "
                              "pip install tqdm, or pass progress=False") from e
        # disable=None: no bar when stderr is not a terminal (a pipe, a CI log)
        return tqdm(initial=start, total=self.config.steps, desc="train", unit="step",
                    mininterval=0.5, dynamic_ncols=True, file=sys.stderr, disable=None)

    # -- pieces of a step -----------------------------------------------------------------

    @contextlib.contextmanager
    def _watch(self, what: str, kind: str | None = None) -> Iterator[None]:
        """Watches a blocking call; the first one of each ``kind`` compiles (longer limit)
        and connects gloo's device groups in a multi-process CPU run (their lines
        dropped). Calls without a kind compile nothing."""
        first = kind is not None and kind not in self._compiled
        self._compiled.add(kind)
        with (quiet_gloo() if first else contextlib.nullcontext()), self.watchdog.watch(
                what, extra_s=self.config.compile_allowance_s if first else 0.0):
            yield

    def _changes(self, step: int, changed: Mapping[str, Mapping[str, tuple[Any, Any]]],
                 saved_run: Mapping[str, Any]) -> Iterator[str]:
        """The warnings of a resume from ``step`` with the ``changed`` settings
        (``{section: {key: (saved, now)}}``; :data:`RESUME_RULE`); ``saved_run``: the
        checkpoint's ``"run"`` section."""
        unrecorded = []
        for diff in changed.values():
            for key, (saved, now) in diff.items():
                if now is ABSENT:  # the current run does not record it
                    continue
                if saved is ABSENT:
                    unrecorded.append(_flag(key))
                    continue
                yield (f"resuming with {_flag(key)} {now} (saved: {saved}): "
                       f"{self._consequence(key, saved, step + 1, saved_run)}")
        if unrecorded:
            yield (f"checkpoint step {step} does not record {', '.join(unrecorded)} (saved "
                   "by an earlier version): not checked")

    def _consequence(self, key: str, saved: Any, next_step: int,
                     saved_run: Mapping[str, Any]) -> str:
        if key != "steps":
            return _CONSEQUENCE.get(key, "the run's numbers from step {next} on differ from "
                                         "the saved run's").format(next=next_step)
        now = self.config.steps
        where = ""
        if self.lr_schedule is not None:
            with contextlib.suppress(Exception):  # a saved run the schedule cannot rebuild
                where = (f"at step {next_step} the learning rate is "
                         f"{self.lr_schedule(next_step, self.metadata['run']):.3g} (the saved "
                         f"run's schedule: {self.lr_schedule(next_step, saved_run):.3g}); ")
        return (f"a learning-rate schedule that depends on the run length (warmup, decay) "
                f"follows a run of {now} steps from step {next_step} on: {where}to finish the "
                f"saved run as it was planned, resume with {_flag(key)} {saved}")

    def _peer_failure(self) -> contextlib.AbstractContextManager:
        """A failed collective ends the process with one line naming the call and the
        process that died (:func:`~faults.exit_on_peer_failure`)."""
        return faults.exit_on_peer_failure(heartbeats=self.heartbeats,
                                           activity=lambda: self.watchdog.last)

    def _intact(self) -> str:
        """``"; the latest complete checkpoint is step N"`` (or that there is none), for a
        message about a failed write."""
        if self._ckpt_dir is None:
            return ""
        return (f"; the latest complete checkpoint is step {self.saved}" if self.saved
                else "; no checkpoint was written yet")

    def _log(self, log: MetricsLog, record: dict[str, Any]) -> None:
        """Writes a metrics record (and to TensorBoard); a full disk stops the run with one
        line."""
        try:
            log.write(record)
            self._tensorboard.write(record)
        except OSError as e:  # MetricsLogError: nothing torn left in the file
            raise TrainingStopped(f"{str(e).rstrip('.')}{self._intact()}") from e

    def _diverged(self, i: int, reason: str) -> TrainingStopped:
        kept = (f"the last checkpoint, step {self.saved}, holds parameters that gave a good "
                f"held-out loss: resume from it with a lower --lr (or more --warmup-steps)"
                if self.saved is not None else "try a lower --lr or more --warmup-steps")
        return TrainingStopped(f"step {i}: training diverged ({reason}); stopped without "
                               f"saving: {kept}", faults.EXIT_DIVERGED)

    def _evaluate(self, i: int, held_out: list[Batch], log: MetricsLog) -> float:
        """Held-out loss of the current parameters, logged and checked for divergence."""
        with self._watch(f"evaluation at step {i}", "eval"):
            loss = self.step.evaluate(held_out)
        self._log(log, {"step": i, "eval_loss": loss})
        reason = self.guard.check(loss, "held-out loss")
        if reason:
            raise self._diverged(i, reason)
        return loss

    def _save(self, i: int, manager: CheckpointManager) -> None:
        """Checkpoint ``i``; the caller evaluated its parameters first (known-good rule)."""
        try:
            with self._watch(f"saving step {i}", "save"):
                state = data_state(self.data)
                manager.save(i, self.step.params, self.step.opt_state,
                             metadata={"step": i, "next_batch": i + 1, **self.metadata,
                                       "mesh": mesh_description(self.mesh),
                                       "recent_losses": list(self.guard.recent),
                                       **({"data_state": state} if state else {})})
        except (CheckpointSaveError, NonFiniteError) as e:
            raise TrainingStopped(str(e)) from e
        self.saved = i

    def _resume(self, manager: CheckpointManager | None) -> tuple[int, list[float]]:
        """Restores the newest intact checkpoint into ``step`` (resharded onto the mesh);
        returns its step and the training losses before it ((0, []) when there is none).
        Refuses a fresh run into a used directory, and ``resume=True`` without a
        checkpoint (``resume="auto"`` then starts)."""
        cfg, where, t0 = self.config, self._ckpt_dir, time.perf_counter()
        if manager is None or _resume_step(manager, cfg) is None:
            return 0, []
        try:  # damaged steps are skipped (named); another model is refused, naming each one
            restored = manager.restore(params_like=abstract_like(self.step.params),
                                       opt_state_like=abstract_like(self.step.opt_state),
                                       fallback=True, expect_metadata=self.metadata or None,
                                       must_match=("model",), allow_dtype_cast=("opt_state",))
        except ValueError as e:  # CheckpointCorruptError (all damaged), MetadataMismatchError
            raise TrainingStopped(str(e)) from e
        for reason in restored.skipped:
            self._print(f"warning: {reason}; skipped")
        for damaged in [s for s in manager.all_steps() if s > restored.step]:
            self._print(f"warning: moved damaged checkpoint step {damaged} aside to "
                        f"{manager.quarantine(damaged)}")
        for line in self._changes(restored.step, restored.changed,
                                  restored.metadata.get("run", {})):
            self._print(f"warning: {line}")
        if restored.cast:  # e.g. another --moments-dtype: the moments, converted
            kinds = sorted({c.split(": ")[-1] for c in restored.cast})
            self._print(f"resume: the checkpoint's optimizer state cast to this run's "
                        f"dtypes ({', '.join(kinds)}; {len(restored.cast)} arrays): another "
                        "--moments-dtype than the saved run's")
        if hasattr(self.data, "restore"):  # a stateful input pipeline: its position
            state = restored.metadata.get("data_state")
            try:
                if state is None:
                    raise ValueError("it holds no input-pipeline position (saved by a run "
                                     "on other data); resume with the data it was trained "
                                     "on, or start a new run")
                self.data.restore(state)
            except ValueError as e:
                raise TrainingStopped(f"checkpoint step {restored.step}: {e}") from e
        self.step.params, self.step.opt_state = restored.params, restored.opt_state
        saved_on = restored.metadata.get("mesh")
        now_on = mesh_description(self.mesh)
        self._print(f"resume: restored step {restored.step} from {where} onto mesh {now_on}"
                    + (f" (saved on {saved_on})" if saved_on and saved_on != now_on else "")
                    + f" in {time.perf_counter() - t0:.2f} s")
        return restored.step, list(restored.metadata.get("recent_losses", []))

    # -- the run --------------------------------------------------------------------------

    def run(self) -> TrainResult:
        """Resumes (as ``config`` says), trains steps ``start + 1 .. steps`` and returns
        what happened; :attr:`records` holds the metrics log's records meanwhile.

        Raises:
          TrainingStopped: a refused resume or save, a full disk (``EXIT_ERROR``; in a
            multi-process run the other processes are told and end within two heartbeat
            intervals, :meth:`~faults.Heartbeats.fail`), divergence (``EXIT_DIVERGED``,
            nothing diverged saved), or a stop request (``EXIT_INTERRUPTED``, after a
            checkpoint when ``ckpt_dir`` is set).
        """
        try:
            return self._run()
        except TrainingStopped as e:  # an error of this process: the others end at once
            if e.status == faults.EXIT_ERROR and self.heartbeats is not None:
                self.heartbeats.fail(str(e))
            raise
        finally:
            if self.heartbeats is not None:  # no write left running into the exit
                self.heartbeats.stop()

    def _run(self) -> TrainResult:
        cfg, t0 = self.config, time.perf_counter()
        self.guard, self.saved, self._bar, self.records = self._new_guard(), None, None, []
        with contextlib.ExitStack() as stack:
            signals = (self.signals if self.signals is not None
                       else stack.enter_context(faults.StopSignals()))
            manager = (self.checkpoints if self.checkpoints is not None
                       else stack.enter_context(open_checkpoints(cfg)))
            stack.enter_context(jax.set_mesh(self.mesh))
            if cfg.debug_nans:
                stack.enter_context(jax.debug_nans(True))
            try:
                held_out = self.data.held_out_batches(
                    cfg.eval_batches, batch_size=cfg.batch_size // cfg.micro_batches,
                    sharding=NamedSharding(self.mesh, self.layout.tokens))
            except ValueError as e:  # e.g. too few held-out documents
                raise TrainingStopped(str(e)) from e
            if self.heartbeats is not None:
                self.heartbeats.start(lambda: self.watchdog.activity)
            with self._peer_failure(), self._watch(  # dead peer: one line
                    "restoring the checkpoint", "restore"):
                start, recent_losses = self._resume(manager)
            self.saved = start or None
            if start >= cfg.steps:
                self._print(f"nothing to do: checkpoint step {start} >= --steps {cfg.steps}")
            try:  # a bad line before the last, or a file that cannot be written
                log = stack.enter_context(MetricsLog(
                    cfg.log_json if jax.process_index() == 0 else None, resume_from=start))
            except (ValueError, OSError) as e:
                raise TrainingStopped(f"{str(e).rstrip('.')}{self._intact()}") from e
            self.records = log.records
            try:
                self._tensorboard = stack.enter_context(TensorBoardLog(
                    cfg.tensorboard if jax.process_index() == 0 else None,
                    resume_from=start))
            except OSError as e:
                raise TrainingStopped(f"{str(e).rstrip('.')}{self._intact()}") from e
            self._bar = stack.enter_context(self._progress(start))
            try:
                with self._peer_failure():
                    first, last, final_eval = self._loop(start, recent_losses, held_out, log,
                                                         manager, signals)
            finally:
                self._bar = None
        return TrainResult(start, first, last, final_eval, log.records,
                           time.perf_counter() - t0)

    def _loop(self, start: int, recent_losses: list[float], held_out: list[Batch],
              log: MetricsLog, manager: CheckpointManager | None,
              signals: faults.StopSignals) -> tuple[float | None, float | None, float | None]:
        """Steps ``start + 1 .. steps`` after the checkpoint of ``start`` (0: none) and
        the training losses before it; returns (first loss, last loss, last held-out)."""
        cfg, step, bar = self.config, self.step, self._bar
        sharding = NamedSharding(self.mesh, self.layout.micro_batched_tokens)
        key0 = jax.random.key(cfg.seed)
        param_b, opt_b, temp = device_bytes(step.params), device_bytes(step.opt_state), None
        first = last = final_eval = None
        self.saved = start or None
        for loss in recent_losses:  # the same on every process: from the checkpoint
            self.guard.record(loss)
        if start == 0 and cfg.eval_every:
            self._print(f"step 0: held-out loss {self._evaluate(0, held_out, log):.4f}")
        for i in range(start + 1, cfg.steps + 1):
            batch = self.data.train_batch(i, seed=cfg.seed, batch_size=cfg.batch_size,
                                          micro_batches=cfg.micro_batches, sharding=sharding)
            key, t0 = jax.random.fold_in(key0, i), time.perf_counter()
            try:
                with self._watch(f"step {i}", "step"):  # the step's scalars, in one transfer
                    metrics = {k: float(v) if np.ndim(v) == 0 else np.asarray(v).tolist()
                               for k, v in jax.device_get(step(batch, key)).items()}
                    loss = metrics["loss"]
            except FloatingPointError as e:  # debug_nans
                raise TrainingStopped(f"NaN at step {i} (--debug-nans): {e}",
                                      faults.EXIT_DIVERGED) from e
            dt, tokens = time.perf_counter() - t0, _tokens(batch)
            if not math.isfinite(loss) or not metrics["finite"]:
                raise self._diverged(i, f"loss is {loss}, grad norm {metrics['grad_norm']:.3g}"
                                        "; this step's update was not applied")
            reason = self.guard.check(loss) or self.guard.check_update(
                metrics["update_norm"], metrics["param_norm"])
            if reason:
                raise self._diverged(i, reason)
            self.guard.record(loss)
            if i == start + 1:  # the first call compiled the step: time it as such
                temp = step.temp_bytes(batch, key)
                self._print(f"compiled the step in {dt:.1f} s; per device: params "
                            f"{_mib(param_b)}, optimizer state {_mib(opt_b)}, activations and "
                            f"temporaries (XLA temp of the compiled step) {_mib(temp)}")
            first, last = first if first is not None else loss, loss
            record = {"step": i, "loss": loss, "tokens_per_s": tokens / dt,
                      "grad_norm": metrics["grad_norm"],
                      "update_ratio": metrics["update_norm"] / metrics["param_norm"],
                      "time_s": dt, "unix_time": time.time(),  # when the step ended
                      # a mixture of experts': the losses, dropped fraction, tokens per expert
                      **{k: v for k, v in metrics.items() if k.startswith("moe_")}}
            if self.lr_schedule is not None:
                with contextlib.suppress(Exception):  # a schedule of other run settings
                    record["lr"] = float(self.lr_schedule(i, self.metadata["run"]))
            if self._peak is not None:
                record["mfu"] = model_flops_utilization(tokens / dt, self._peak[1],
                                                        self._peak[0])
            self._log(log, record)
            if bar is not None:
                bar.set_postfix_str(f"loss={loss:.3f} tok/s={tokens / dt:,.0f} mem/dev: params="
                                    f"{_mib(param_b)} opt={_mib(opt_b)} act(temp)={_mib(temp)}",
                                    refresh=False)
                bar.update()
            with self._watch(f"agreeing whether to stop after step {i}"):
                stop = faults.agree_to_stop(i, signals.received is not None)
            save = manager is not None and (stop or cfg.save_every and (
                i % cfg.save_every == 0 or i == cfg.steps))
            if save or (cfg.eval_every and i % cfg.eval_every == 0) or i == cfg.steps:
                final_eval = self._evaluate(i, held_out, log)  # before a save: only good ones
                self._print(f"step {i}: train loss {loss:.4f}, held-out loss {final_eval:.4f}")
            if save:
                self._save(i, manager)
            if stop and i < cfg.steps:
                where = (f"checkpoint step {i} written to {self._ckpt_dir}; continue with "
                         "--resume" if manager is not None else "no --ckpt-dir, nothing saved")
                raise TrainingStopped(f"stopped by {signals.received or 'another process'} "
                                      f"after step {i}: {where}", faults.EXIT_INTERRUPTED)
        return first, last, final_eval

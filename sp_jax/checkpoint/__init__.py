"""Orbax checkpoints of sharded training state: save on one mesh, restore onto any other,
and find out when a checkpoint was damaged on disk.

A checkpoint holds the parameters, optionally the optimizer state, and a JSON record (the
step, free-form metadata such as the model configuration, and integrity data). Arrays are
written shard by shard from wherever they live (every process writes the shards it holds,
replicated shards once) and read back into whatever shardings the *target* asks for, so a
model trained on a ``data=2 x tensor=4`` mesh restores onto ``(1, 8)``, ``(4, 2)``, one
device, or into a plain unsharded model, bitwise.

Layout of ``directory`` (one sub-directory per step, written by orbax)::

    <directory>/.sp_jax.lock       the writer's lock (see "One writer" below)
    <directory>/<step>/params/      the params pytree (OCDBT / tensorstore arrays)
    <directory>/<step>/opt_state/   the optimizer-state pytree (when saved)
    <directory>/<step>/meta/        JSON {"step", "metadata", "integrity", "digest"}

Atomicity: orbax writes a step into ``<directory>/<step>.orbax-checkpoint-tmp-<n>`` and
renames it to ``<directory>/<step>`` only once every item (and, in multi-process runs,
every process) has finished, so a save that fails or is killed part-way never shows up as
a step; the previous checkpoints stay loadable and leftover temporary directories are
removed when the directory is next opened by a writer (``lock=True``). A failed save
raises :class:`CheckpointSaveError` naming the step and the directory.

Integrity: ``save`` first computes, on the devices and in one jitted pass over every
array of params and opt_state, two 32-bit checksums per array (wrap-around sums of the
array's bits, read as uint32 words ``w`` at flat word index ``i``:
``sum(w * (2i + 1))`` and ``sum(fmix32(w ^ (i * 0x9E3779B1)))``). Integer wrap-around
sums do not depend on the order of the additions, so the values are the same for any
sharding, mesh or number of processes, and a single flipped bit always changes the first
one. The same pass checks that every floating array is finite: NaN or inf raises
:class:`NonFiniteError` and nothing is written (``check_finite=False`` to save anyway).
The checksums, dtypes and shapes go into the JSON record with a SHA-256 digest of the
record itself. ``restore`` verifies the record's digest and every array it reads (a cast
leaf in its saved dtype, before the cast). A damaged checkpoint (a missing, truncated or
changed file, an empty step directory, an unreadable record) raises one
:class:`CheckpointCorruptError` naming the step, the directory and what is wrong; values
that differ from the saved ones are never returned. Checkpoints written before integrity
data existed restore with a warning that they are unverified.

An empty step directory (a directory named like a step with nothing in it) is listed by
:meth:`~CheckpointManager.all_steps` (orbax lists it) and reported as damaged when read.

Falling back: ``restore(fallback=True)`` tries the steps newest first and skips damaged
ones; :attr:`Restored.skipped` says which and why (a target or metadata mismatch is never
a reason to fall back: it is raised).

One writer: a :class:`CheckpointManager` (``lock=True``, the default) holds an exclusive
``fcntl.flock`` lock on ``<directory>/.sp_jax.lock`` (taken by process 0 only) until
``close()``, and records in it who holds it; a second writer gets
:class:`CheckpointLockedError` naming the holder. The kernel drops the lock when its
holder dies, so a lock file left by a killed run is taken over (``stale_lock`` says whose
it was). flock needs a file system with working locks (local disks, NFSv4, Lustre mounted
with ``flock``); where locking is not supported, the manager warns and runs unlocked.
Readers (``lock=False``, :func:`restore_checkpoint`, :func:`latest_step`) take no lock and
delete nothing.

At exit: a manager with ``async_save=True`` that still has a save in flight when the
program ends without ``close()`` waits for it before the interpreter shuts down and
prints one line to stderr saying whether the step was committed.

Multi-process runs (``jax.distributed.initialize``): every process calls ``save`` and
``restore`` with the same arguments; ``directory`` must be on a file system all processes
share. Process 0 writes the JSON record, renames the step directory and holds the lock.

Example::

    ckpt = CheckpointManager("runs/ckpt", max_to_keep=3)
    ckpt.save(step, params, opt_state, metadata={"model": {...}})
    ...
    # params_like / opt_state_like: arrays or jax.ShapeDtypeStruct carrying the shardings
    # wanted *now* (e.g. those of a freshly initialised model on another mesh).
    restored = ckpt.restore(params_like=abstract_like(params),
                            opt_state_like=abstract_like(opt_state), fallback=True)
    for reason in restored.skipped:
        print("skipped:", reason)
    params, opt_state, step = restored.params, restored.opt_state, restored.step
    ckpt.close()

Resuming a run: :meth:`CheckpointManager.check_metadata` (or ``restore(expect_metadata=)``)
compares the metadata saved with a step to the current run's, section by section: it
raises :class:`MetadataMismatchError` for sections that must match (e.g. ``"model"``) and
returns the differences of the others (e.g. run settings such as the learning rate) for
the caller to report::

    changed = ckpt.check_metadata({"model": {...}, "run": {...}}, must_match=("model",))

The package has one concern per module: :mod:`~sp_jax.checkpoint.manager`
(:class:`CheckpointManager`, :func:`abstract_like`), :mod:`~sp_jax.checkpoint.oneshot`
(:func:`save_checkpoint`, :func:`restore_checkpoint`, :func:`latest_step`),
:mod:`~sp_jax.checkpoint.relayout` (a checkpoint's stacked layers restored into unrolled
ones, or the other way), :mod:`~sp_jax.checkpoint.errors` (the
exceptions), :mod:`~sp_jax.checkpoint.integrity` (the checksums and the record's digest),
:mod:`~sp_jax.checkpoint.lock` (the writer's lock), :mod:`~sp_jax.checkpoint.metadata`
(saved metadata and restore targets checked against the current run's),
:mod:`~sp_jax.checkpoint.diagnose` (what orbax's and tensorstore's read errors mean) and
:mod:`~sp_jax.checkpoint.at_exit` (saves in flight finished at interpreter exit). Every
public name is importable from ``sp_jax.checkpoint``.

orbax-checkpoint (a core dependency of sp_jax) is imported on first use, so
``import sp_jax`` stays light.
"""

from .errors import (
    CheckpointCorruptError,
    CheckpointLockedError,
    CheckpointSaveError,
    MetadataMismatchError,
    NonFiniteError,
)
from .manager import CheckpointManager, Restored, abstract_like
from .metadata import ABSENT
from .oneshot import latest_step, restore_checkpoint, save_checkpoint

__all__ = [
    "ABSENT",
    "CheckpointCorruptError",
    "CheckpointLockedError",
    "CheckpointManager",
    "CheckpointSaveError",
    "MetadataMismatchError",
    "NonFiniteError",
    "Restored",
    "abstract_like",
    "latest_step",
    "restore_checkpoint",
    "save_checkpoint",
]

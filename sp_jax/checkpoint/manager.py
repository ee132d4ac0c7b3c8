"""The checkpoint manager: :class:`CheckpointManager` (save, list, verify, restore onto any
mesh, quarantine damaged steps, compare the saved metadata with the current run's) and
:func:`abstract_like` for restore targets (the one-shot functions: :mod:`.oneshot`). The
package docstring (:mod:`sp_jax.checkpoint`) describes the layout on disk and the
guarantees.

orbax-checkpoint is imported on first use (by :func:`_ocp`), not with this module.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from . import relayout
from .at_exit import IN_FLIGHT, register_exit_hook
from .diagnose import describe, not_damage, quiet_abandoned_io
from .errors import CheckpointCorruptError, CheckpointSaveError, NonFiniteError
from .integrity import CHECKSUM, VERSION, checksums, dtype_name, leaf_dtype, record_digest
from .lock import WriterLock
from .metadata import (
    Differences,
    check_compatible,
    compare,
    flatten,
    json_sections,
    listing,
    path_name,
)

__all__ = ["CheckpointManager", "Restored", "abstract_like"]

_PARAMS, _OPT_STATE, _META = "params", "opt_state", "meta"


class Restored(NamedTuple):
    """What :meth:`CheckpointManager.restore` returns.

    Attributes:
      step: the restored step.
      params: the parameters, with the structure and shardings of ``params_like``.
      opt_state: the optimizer state like ``opt_state_like``; None when not requested.
      metadata: the JSON-serialisable ``metadata`` given to ``save`` ({} if none).
      cast: the leaves read in another dtype than the target's and cast, as
        ``"opt_state/0/mu/...: float32 -> bfloat16"`` (``allow_dtype_cast``).
      skipped: with ``fallback=True``, one line per newer step that was skipped because
        it is damaged (the message of its :class:`CheckpointCorruptError`), newest first.
      changed: with ``expect_metadata``, the differences of the sections that may change
        (``{section: {key: (saved, now)}}``, as :meth:`CheckpointManager.check_metadata`
        returns them); {} otherwise.
    """

    step: int
    params: Any
    opt_state: Any
    metadata: dict
    cast: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    changed: dict = {}  # never mutated: restore passes a dict of its own


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError("sp_jax.checkpoint needs orbax-checkpoint, a dependency of sp_jax "
                          "that is missing from this environment: pip install orbax-checkpoint "
                          "(or reinstall sp_jax: pip install '.' in its clone)") from e
    return ocp


def abstract_like(tree: Any) -> Any:
    """``tree`` with every array replaced by a ``jax.ShapeDtypeStruct`` of the same shape,
    dtype and sharding: a restore target that allocates nothing until the restore."""
    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(leaf, tree)


def _target(like: Any) -> Any:
    """Restore target: a ShapeDtypeStruct with a sharding for every leaf (a leaf without
    one goes to the first local device, as a plain unsharded array would)."""
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

    def leaf(x):
        sharding = getattr(x, "sharding", None)
        if not isinstance(sharding, jax.sharding.Sharding):
            sharding = default
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(leaf, like)


class CheckpointManager:
    """Saves and restores ``(params, opt_state, metadata)`` per step in ``directory``.

    A thin wrapper around ``orbax.checkpoint.CheckpointManager`` that adds: restoring into
    target shardings given as arrays or ``ShapeDtypeStruct`` (resharding onto another
    mesh), a tree/shape/dtype check naming the mismatched leaf before orbax reads
    anything, :class:`CheckpointSaveError` naming the step and directory when a save
    fails, checksums of every array verified on restore (:class:`CheckpointCorruptError`
    for a damaged step, ``restore(fallback=True)`` to go back to the newest intact one), a
    finite check before writing (:class:`NonFiniteError`), one writer per directory
    (:class:`CheckpointLockedError`), and saves in flight finished at interpreter exit.

    Args:
      directory: where the step directories live (created if missing). In multi-process
        runs, a path every process sees.
      max_to_keep: keep this many latest steps, deleting older ones after each save;
        None keeps all.
      async_save: write in a background thread (``save`` returns once the arrays are
        copied off the devices). Errors then surface, as :class:`CheckpointSaveError`
        naming the step, from the next ``save``, ``wait_until_finished`` or ``close``; a
        save still in flight when the program exits without ``close()`` is waited for
        at exit (one line to stderr says whether it was committed). Default False:
        ``save`` returns when the step is committed.
      lock: be the directory's only writer: process 0 takes an exclusive ``flock`` on
        ``<directory>/.sp_jax.lock`` before anything else (raising
        :class:`CheckpointLockedError` naming the holder if another live process has
        it, on every process of a multi-process run; taking over, with a warning and
        :attr:`stale_lock`, a lock file left by a process that died) and releases it in
        ``close()``; it then deletes the temporary directories of unfinished saves.
        False (readers): no lock, and nothing is deleted on opening (another writer may
        be in the middle of a save). flock needs a file system with working locks
        (local disks, NFSv4, Lustre mounted with ``flock``).

    Attributes:
      directory: the absolute checkpoint directory.
      stale_lock: what the lock file said about its previous holder, a process that
        died without releasing it (``host``, ``pid``, ``started``, ``argv``); None when
        the lock was free and clean (or ``lock=False``).
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 async_save: bool = False, lock: bool = True):
        ocp = _ocp()
        self.directory = os.path.abspath(os.fspath(directory))
        self.stale_lock: dict | None = None
        self._pending: int | None = None
        self._async = bool(async_save)
        self._closed = False
        self._writer = WriterLock(self.directory)
        try:
            if lock:
                self._writer.acquire()  # its warnings name this line (stacklevel=3)
                self.stale_lock = self._writer.stale
            self._manager = ocp.CheckpointManager(
                self.directory,
                item_handlers={_PARAMS: ocp.handlers.StandardCheckpointHandler(),
                               _OPT_STATE: ocp.handlers.StandardCheckpointHandler(),
                               _META: ocp.handlers.JsonCheckpointHandler()},
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=max_to_keep,
                    create=True,
                    # Removed below, synchronously (writers only): orbax's own clean-up
                    # runs in the background and has no public way to wait for it.
                    cleanup_tmp_directories=False,
                    enable_async_checkpointing=self._async,
                ),
            )
            if lock:
                self._remove_unfinished_saves(ocp)
        except BaseException:
            self._writer.release()
            raise
        register_exit_hook()

    def _remove_unfinished_saves(self, ocp: Any) -> None:
        """Deletes the temporary directories of saves that never committed (a failed or
        killed run), so the directory holds only committed steps from here on.

        Process 0 deletes, as orbax's own clean-up does; the other processes need not wait:
        they never read temporary directories, and orbax starts every save with a barrier
        of all processes, which process 0 reaches only after this.
        """
        if jax.process_index() != 0:
            return
        for tmp in ocp.path.step.all_temporary_paths(self.directory):
            shutil.rmtree(os.fspath(tmp.get()), ignore_errors=True)

    # -- listing ------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The committed steps, ascending (in-progress or failed saves are not listed; an
        empty step directory is listed, and reported as damaged when read)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The latest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _resolve(self, step: int | None) -> int:
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint in {self.directory}")
            return steps[-1]
        if step not in steps:
            raise FileNotFoundError(f"no checkpoint step {step} in {self.directory} "
                                    f"(steps there: {steps or 'none'})")
        return step

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def quarantine(self, step: int) -> str:
        """Moves committed step ``step`` (e.g. one a fallback skipped as damaged) out of the
        listing, to ``<directory>/damaged/<step>`` (``-1``, ``-2``, ... appended when that
        exists), where it is kept for inspection; returns that path.

        After a fallback to an older step a resumed run saves the newer step numbers
        again: the damaged ones must be out of the way first. Every process calls it with
        the same step; process 0 moves the directory.

        Raises:
          FileNotFoundError: no such committed step.
        """
        step = self._resolve(step)
        base = os.path.join(self.directory, "damaged", str(step))
        target, n = base, 0
        while os.path.exists(target):
            n += 1
            target = f"{base}-{n}"
        self._sync(f"quarantine-{step}-a")  # everyone chose the same name
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.rename(self._step_dir(step), target)
        self._sync(f"quarantine-{step}-b")
        self._manager.reload()
        return target

    @staticmethod
    def _sync(name: str) -> None:
        """A barrier of all processes (nothing in a single-process run)."""
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"sp_jax.checkpoint.{name}")

    # -- saving -------------------------------------------------------------------------

    def _failed(self, step: int, error: BaseException) -> CheckpointSaveError:
        latest = self.latest_step()
        before = (f"the latest complete checkpoint is step {latest}" if latest is not None
                  else "there is no earlier complete checkpoint")
        full = (getattr(error, "errno", None) == errno.ENOSPC
                or "No space left on device" in str(error))
        return CheckpointSaveError(
            f"saving checkpoint step {step} to {self.directory} failed: "
            f"{type(error).__name__}: {error}. Nothing of step {step} was committed; "
            f"{before}" + (f". The file system of {self.directory} is full: free space (or "
                           "keep fewer checkpoints) and resume" if full else "") + ".",
            step=step, directory=self.directory)

    def _check_pending(self) -> None:
        """Surfaces the error of a background save (async_save=True)."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - re-raised with the step named
            raise self._failed(step, e) from e
        finally:
            IN_FLIGHT.pop(self, None)

    def save(self, step: int, params: Any, opt_state: Any = None,
             metadata: Mapping[str, Any] | None = None, *, check_finite: bool = True) -> None:
        """Writes checkpoint ``step``, with a checksum of every array.

        Args:
          step: a non-negative int not already saved in the directory.
          params: pytree of ``jax.Array`` (any shardings, e.g. ``nnx.State`` of
            ``nnx.Param``); each array is written as its global value.
          opt_state: optional pytree of arrays (e.g. an optax state).
          metadata: optional JSON-serialisable dict, returned by ``restore`` and
            :meth:`metadata`.
          check_finite: refuse to write NaN or inf: raise :class:`NonFiniteError` if a
            floating array of ``params`` or ``opt_state`` holds one (checked in the same
            device pass as the checksums).
        Raises:
          NonFiniteError: (a ``ValueError``) NaN or inf found; nothing was written.
          CheckpointSaveError: the write failed (the step is not committed).
          ValueError: ``step`` is negative or already saved.
        """
        ocp = _ocp()
        self._check_pending()
        if isinstance(step, bool) or not isinstance(step, int | np.integer) or step < 0:
            raise ValueError(f"checkpoint step must be a non-negative int, got {step!r}")
        step = int(step)
        if step in self.all_steps():
            raise ValueError(f"checkpoint step {step} already exists in {self.directory}; "
                             "delete it or save into another directory")
        trees = {_PARAMS: params}
        if opt_state is not None:
            trees[_OPT_STATE] = opt_state
        leaves = {f"{name}/{path}": x for name, tree in trees.items()
                  for path, x in flatten(tree).items()}
        try:
            sums = checksums(leaves)
        except Exception as e:  # noqa: BLE001 - re-raised with the step named
            raise self._failed(step, e) from e
        bad = [path for path, s in sums.items() if s is not None and not s[2]]
        if check_finite and bad:
            raise NonFiniteError(
                f"checkpoint step {step} not saved to {self.directory}: NaN or inf in "
                f"{len(bad)} array(s): {listing(bad)}. Nothing was written (the earlier "
                "checkpoints are unchanged); save(..., check_finite=False) writes them "
                "anyway", step=step, paths=bad)
        integrity = {
            "version": VERSION, "checksum": CHECKSUM, "items": list(trees),
            "leaves": {path: {"dtype": dtype_name(leaf_dtype(x)),
                              "shape": [int(n) for n in np.shape(x)],
                              "checksum": None if sums[path] is None else
                              list(sums[path][:2])}
                       for path, x in leaves.items()}}
        try:
            record = json.loads(json.dumps({"step": step, "metadata": dict(metadata or {}),
                                            "integrity": integrity}))
        except (TypeError, ValueError) as e:
            raise self._failed(step, e) from e
        record["digest"] = record_digest(record)
        items = {name: ocp.args.StandardSave(tree) for name, tree in trees.items()}
        items[_META] = ocp.args.JsonSave(record)
        quiet_abandoned_io()  # a failed write is reported once, by _failed
        try:
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # noqa: BLE001 - re-raised with the step named
            raise self._failed(step, e) from e
        self._pending = step
        if self._async:
            IN_FLIGHT[self] = self._exit_hook  # finished at exit if never waited for
        else:
            self._check_pending()

    def wait_until_finished(self) -> None:
        """Blocks until a background save has committed (raises its error, if any)."""
        self._check_pending()
        self._manager.wait_until_finished()

    # -- reading ------------------------------------------------------------------------

    def _corrupt(self, step: int, reason: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(step=step, directory=self.directory, reason=reason)

    def _record(self, step: int) -> dict:
        """The JSON record of ``step``, its digest verified (CheckpointCorruptError)."""
        ocp = _ocp()
        try:
            empty = not os.listdir(self._step_dir(step))
        except FileNotFoundError:
            raise FileNotFoundError(f"checkpoint step {step} in {self.directory} was "
                                    "deleted (by another process?)") from None
        if empty:
            raise self._corrupt(step, "the step directory is empty (its files were "
                                      "deleted)")
        try:
            record = self._manager.restore(step, args=ocp.args.Composite(
                **{_META: ocp.args.JsonRestore()}))[_META]
        except Exception as e:  # noqa: BLE001 - reported as damage, with its gist
            if not_damage(e):
                raise
            raise self._corrupt(step, f"{_META}: the JSON record cannot be read: "
                                      f"{describe(e, self.directory, step)}") from e
        if not isinstance(record, dict):
            raise self._corrupt(step, f"{_META}: the JSON record is not an object")
        if "digest" in record or "integrity" in record:
            if "digest" not in record or not isinstance(record.get("integrity"), dict):
                raise self._corrupt(step, f"{_META}: the JSON record's integrity data is "
                                          "incomplete (the file was changed after it was "
                                          "written)")
            if record["digest"] != record_digest(record):
                raise self._corrupt(step, f"{_META}: digest mismatch (the JSON record was "
                                          "changed after it was written)")
        return record

    def _item_metadata(self, step: int) -> Any:
        quiet_abandoned_io()
        try:
            return self._manager.item_metadata(step)
        except Exception as e:  # noqa: BLE001 - reported as damage, with its gist
            if not_damage(e):
                raise
            raise self._corrupt(step, "the orbax metadata cannot be read: "
                                      f"{describe(e, self.directory, step)}") from e

    def _match_record(self, step: int, item: str, tree: Any, leaves: Mapping) -> None:
        """Raises CheckpointCorruptError unless orbax's metadata of ``item`` lists the
        arrays, shapes and dtypes of the JSON record."""
        recorded = {path[len(item) + 1:]: leaf for path, leaf in leaves.items()
                    if path.startswith(item + "/")}
        have = flatten(tree)
        if set(have) != set(recorded):
            odd = sorted(set(have) ^ set(recorded))
            raise self._corrupt(step, f"{item}: the orbax metadata lists other arrays than "
                                      f"the integrity record ({listing(odd)})")
        for path, meta in have.items():
            shape, dtype = [int(n) for n in meta.shape], dtype_name(meta.dtype)
            want = recorded[path]
            if shape != want.get("shape") or dtype != want.get("dtype"):
                raise self._corrupt(step, f"{item}/{path}: the orbax metadata says {dtype} "
                                          f"{tuple(shape)}, the integrity record "
                                          f"{want.get('dtype')} "
                                          f"{tuple(want.get('shape') or ())}")

    def _verify_arrays(self, step: int, arrays: Mapping[str, Any], leaves: Mapping) -> None:
        """Raises CheckpointCorruptError naming the first of ``arrays`` (``{"params/...":
        array}``, read in their saved dtypes) whose checksum differs from the record's."""
        checked = {path: x for path, x in arrays.items()
                   if (leaves.get(path) or {}).get("checksum") is not None
                   and dtype_name(leaf_dtype(x)) == leaves[path].get("dtype")}
        sums = checksums(checked)
        bad = [path for path, s in sums.items()
               if s is None or [s[0], s[1]] != leaves[path]["checksum"]]
        if bad:
            also = f" (and {listing(bad[1:])})" if len(bad) > 1 else ""
            raise self._corrupt(step, f"{bad[0]}: checksum mismatch (the file holding it "
                                      f"was changed after it was written){also}")

    def _restore_step(self, step: int, params_like: Any, opt_state_like: Any,
                      allow_dtype_cast: Any, now: dict | None,
                      must_match: Sequence[str], cast: bool = True) -> Restored:
        """Reads and verifies one step (see :meth:`restore`)."""
        ocp = _ocp()
        record = self._record(step)
        saved_meta = record.get("metadata")
        saved_meta = dict(saved_meta) if isinstance(saved_meta, Mapping) else {}
        changed = {} if now is None else compare(saved_meta, now, must_match, step=step,
                                                 directory=self.directory)
        integrity = record.get("integrity")
        if integrity is None:
            warnings.warn(f"checkpoint step {step} in {self.directory} has no integrity "
                          "data (saved by an older sp_jax): restored unverified",
                          stacklevel=3)
        saved = self._item_metadata(step)
        targets = {_PARAMS: params_like}
        if opt_state_like is not None:
            targets[_OPT_STATE] = opt_state_like
        items, wanted, layers, casts = {}, {}, {}, []
        for name, like in targets.items():
            tree = saved.get(name)
            if tree is None:
                in_record = integrity is not None and name in integrity.get("items", ())
                if in_record or os.path.isdir(os.path.join(self._step_dir(step), name)):
                    gone = ("the item's directory is missing" if not os.path.isdir(
                        os.path.join(self._step_dir(step), name)) else
                        "its orbax metadata is missing")
                    raise self._corrupt(step, f"{name}: {gone}")
                if name == _OPT_STATE:
                    raise ValueError(f"checkpoint step {step} in {self.directory} holds no "
                                     "optimizer state; restore with opt_state_like=None")
                raise ValueError(f"checkpoint step {step} in {self.directory} has no "
                                 f"'{name}' item (not written by sp_jax.checkpoint?)")
            tree = getattr(tree, "tree", tree)
            if integrity is not None:
                self._match_record(step, name, tree, integrity.get("leaves", {}))
            target = _target(like)
            saved_leaves, want = flatten(tree), flatten(target)
            layers[name] = relayout.plan(saved_leaves, want)  # stacked <-> unrolled layers
            cast_ok = allow_dtype_cast if isinstance(allow_dtype_cast, bool) \
                else name in allow_dtype_cast
            casts += check_compatible(name, tree if layers[name] is None else
                                      relayout.saved_as_target(layers[name], saved_leaves,
                                                               want),
                                      target, step, self.directory, cast_ok)
            read = None if layers[name] is None else relayout.read_target(
                layers[name], saved_leaves, want)

            def as_saved(path, t, saved_leaves=saved_leaves, read=read):
                if read is not None:  # the saved form, sharded as the target's layers
                    return read[path_name(path)]
                dtype = np.dtype(saved_leaves[path_name(path)].dtype)
                if dtype == np.dtype(t.dtype):
                    return t
                return jax.ShapeDtypeStruct(t.shape, dtype, sharding=t.sharding)

            # Read in the saved dtypes (verified as written), cast afterwards.
            items[name] = ocp.args.StandardRestore(jax.tree_util.tree_map_with_path(
                as_saved, tree if read is not None else target))
            wanted[name] = target
        quiet_abandoned_io()
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - reported as damage, with its gist
            if not_damage(e):
                raise
            raise self._corrupt(step, describe(e, self.directory, step)) from e
        if integrity is not None:  # one device pass over every array read
            self._verify_arrays(step, {f"{name}/{path}": x for name in wanted
                                       for path, x in flatten(out[name]).items()},
                                integrity.get("leaves", {}))
        result = {}
        for name, target in wanted.items():
            tree = out[name]
            if layers[name] is not None:  # the target's form of the layers
                parts = relayout.assemble(layers[name], flatten(tree), flatten(target))
                tree = jax.tree_util.tree_map_with_path(
                    lambda p, _, parts=parts: parts[path_name(p)], target)
            if cast:
                tree = jax.tree.map(
                    lambda x, t: x if x.dtype == t.dtype else jax.device_put(
                        x.astype(t.dtype), t.sharding), tree, target)
            result[name] = tree
        return Restored(step=int(record.get("step", step)), params=result[_PARAMS],
                        opt_state=result.get(_OPT_STATE), metadata=saved_meta,
                        changed=changed, cast=tuple(casts))

    def metadata(self, step: int | None = None) -> dict:
        """The ``metadata`` dict saved with ``step`` (default: the latest), without
        reading any array.

        Raises:
          FileNotFoundError: no such step.
          CheckpointCorruptError: the step's JSON record is missing, unreadable or was
            changed (its digest differs), or the step directory is empty.
        """
        step = self._resolve(step)
        saved = self._record(step).get("metadata")
        return dict(saved) if isinstance(saved, Mapping) else {}

    def check_metadata(self, current: Mapping[str, Mapping[str, Any]],
                       step: int | None = None, *,
                       must_match: Sequence[str] = ("model",)) -> Differences:
        """Compares the metadata saved with ``step`` (default: the latest) to ``current``,
        the metadata this run would save, section by section.

        Only the sections of ``current`` are compared (other saved keys, e.g. a step
        counter, are ignored), key by key, after a JSON round trip of ``current`` (as
        saving does: tuples compare equal to lists). A key one side lacks shows as
        :data:`ABSENT`.

        Args:
          current: ``{section: {key: value}}``, JSON-serialisable, e.g.
            ``{"model": {...}, "run": {"lr": 3e-3, ...}}``.
          step: the checkpoint step; None for the latest.
          must_match: sections that must be equal (e.g. the model configuration: the
            arrays would not fit another one).
        Returns:
          ``{section: {key: (saved, now)}}`` for the other sections that differ (empty
          when none does): settings a resumed run may change, to report.
        Raises:
          MetadataMismatchError: (a ``ValueError``) a ``must_match`` section differs; the
            message names the checkpoint and each differing key with both values.
          FileNotFoundError: no such step.
          CheckpointCorruptError: the step's JSON record is damaged (see :meth:`metadata`).
          TypeError: a section of ``current`` is not a mapping or not JSON-serialisable.
        """
        step = self._resolve(step)
        now = json_sections(current, "check_metadata")
        return compare(self.metadata(step), now, must_match, step=step,
                       directory=self.directory)

    def restore(self, step: int | None = None, *, params_like: Any,
                opt_state_like: Any = None,
                allow_dtype_cast: bool | Sequence[str] = False, fallback: bool = False,
                expect_metadata: Mapping[str, Mapping[str, Any]] | None = None,
                must_match: Sequence[str] = ("model",)) -> Restored:
        """Reads checkpoint ``step`` (default: the latest) into the shardings of the
        targets, verifying every array against the checksum saved with it.

        Args:
          step: the step to read; None for the latest.
          params_like: a pytree with the saved parameter tree's structure whose leaves are
            ``jax.Array`` or ``jax.ShapeDtypeStruct`` giving the target shape, dtype and
            sharding (e.g. ``abstract_like(params)`` of a freshly built model on the
            current mesh, or ``nnx.state(unsharded_model, nnx.Param)`` for plain
            single-device arrays). A leaf without a sharding lands on the first local
            device. The values of array leaves are not used.
          opt_state_like: the same for the optimizer state; None skips it.
          allow_dtype_cast: cast to the target dtypes instead of raising on a mismatch
            (the arrays are read and verified in their saved dtypes, then cast; listed in
            :attr:`Restored.cast`): True for every item, or the items to cast, e.g.
            ``("opt_state",)`` (another storage dtype of the optimizer's moments).
          fallback: if the step is damaged, try the next older committed step, and so on
            (newest first; from ``step`` down when it is given). The steps skipped are
            listed in :attr:`Restored.skipped`. Only damage is skipped: a target or
            metadata mismatch raises.
          expect_metadata: the current run's metadata, ``{section: {key: value}}``: when
            given, compared with each candidate step's saved metadata as
            :meth:`check_metadata` does, before any array is read; the differences of the
            sections not in ``must_match`` come back in :attr:`Restored.changed`.
          must_match: with ``expect_metadata``: the sections that must be equal.
        Returns:
          :class:`Restored` ``(step, params, opt_state, metadata, cast, skipped, changed)``;
          arrays are global ``jax.Array`` with the target shardings (and the target tree
          structure).
        Raises:
          FileNotFoundError: no such step (or no step at all).
          CheckpointCorruptError: (a ``ValueError``) the step is damaged: a file is
            missing, truncated or changed (an array's checksum or the JSON record's
            digest differs), or the step directory is empty; with ``fallback=True``:
            every step is. The message is one line naming the step and what is wrong.
          MetadataMismatchError: (a ``ValueError``) with ``expect_metadata``: a
            ``must_match`` section differs.
          ValueError: the target's tree structure, a shape or a dtype differs from the
            checkpoint's; the message names each mismatched leaf path and both values.
          TypeError: ``expect_metadata`` is not ``{section: mapping}`` or not
            JSON-serialisable.
        """
        self._check_pending()
        if not isinstance(allow_dtype_cast, bool) and (
                isinstance(allow_dtype_cast, str | bytes)
                or not set(allow_dtype_cast) <= {_PARAMS, _OPT_STATE}):
            raise ValueError(f"restore: allow_dtype_cast={allow_dtype_cast!r} must be a bool "
                             f"or a sequence of the items to cast, {_PARAMS!r} and/or "
                             f"{_OPT_STATE!r} (e.g. ({_OPT_STATE!r},)).")
        now = (None if expect_metadata is None
               else json_sections(expect_metadata, "restore: expect_metadata"))
        args = (params_like, opt_state_like, allow_dtype_cast, now, must_match)
        if not fallback:
            return self._restore_step(self._resolve(step), *args)
        newest = self._resolve(step)
        candidates = [s for s in self.all_steps() if s <= newest]
        damaged: list[CheckpointCorruptError] = []
        for candidate in reversed(candidates):
            try:
                restored = self._restore_step(candidate, *args)
            except CheckpointCorruptError as e:
                damaged.append(e)
                continue
            return restored._replace(skipped=tuple(str(e) for e in damaged))
        reason = "; ".join(f"step {e.step}: {e.reason}" for e in damaged)
        raise CheckpointCorruptError(
            f"every checkpoint step in {self.directory} is damaged, newest first: "
            f"{reason}", step=newest, directory=self.directory, reason=reason)

    def verify(self, step: int | None = None, *, params_like: Any,
               opt_state_like: Any = None) -> None:
        """Reads checkpoint ``step`` (default: the latest) as :meth:`restore` does and
        checks every array against its checksum, keeping nothing; writes nothing.

        Args:
          step: the step to check; None for the latest.
          params_like: the parameter target (shapes and shardings to read into), as for
            :meth:`restore`; its dtypes do not matter (the arrays are checked as saved).
          opt_state_like: the optimizer-state target; None skips the optimizer state.
        Raises:
          CheckpointCorruptError: the step is damaged.
          FileNotFoundError, ValueError: as :meth:`restore`.
        """
        self._check_pending()
        self._restore_step(self._resolve(step), params_like, opt_state_like, True, None,
                           (), cast=False)

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Waits for a background save, releases orbax's resources and the lock."""
        if self._closed:
            return
        self._closed = True
        try:
            self._check_pending()
        finally:
            try:
                self._manager.close()
            finally:
                self._writer.release()

    def _exit_hook(self) -> None:
        """At interpreter exit (never closed): waits for a save in flight, saying on
        stderr how it ended."""
        if self._closed:
            return
        step = self._pending
        if step is not None:
            try:
                self._check_pending()
                outcome = "committed"
            except CheckpointSaveError as e:
                cause = e.__cause__ or e
                outcome = f"failed: {type(cause).__name__}: {cause}"
            print(f"sp_jax.checkpoint: waited at exit for step {step} to be written to "
                  f"{self.directory}: {outcome}", file=sys.stderr, flush=True)
        # The lock is released later, by its finaliser (atexit), once the interpreter has
        # joined the program's other threads (one of them might still be saving).

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

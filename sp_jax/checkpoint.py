"""Orbax checkpoints of sharded training state: save on one mesh, restore onto any other.

A checkpoint holds the parameters, optionally the optimizer state, and a JSON record (the
step and free-form metadata, e.g. the model configuration). Arrays are written shard by
shard from wherever they live (every process writes the shards it holds, replicated
shards once) and read back into whatever shardings the *target* asks for, so a model
trained on a ``data=2 x tensor=4`` mesh restores onto ``(1, 8)``, ``(4, 2)``, one device,
or into a plain unsharded model, bitwise.

Layout of ``directory`` (one sub-directory per step, written by orbax)::

    <directory>/<step>/params/      the params pytree (OCDBT / tensorstore arrays)
    <directory>/<step>/opt_state/   the optimizer-state pytree (when saved)
    <directory>/<step>/meta/        JSON {"step": step, "metadata": {...}}

Atomicity: orbax writes a step into ``<directory>/<step>.orbax-checkpoint-tmp-<n>`` and
renames it to ``<directory>/<step>`` only once every item (and, in multi-process runs,
every process) has finished, so a save that fails or is killed part-way never shows up as
a step; the previous checkpoints stay loadable and leftover temporary directories are
removed when the directory is next opened. A failed save raises
:class:`CheckpointSaveError` naming the step and the directory.

Multi-process runs (``jax.distributed.initialize``): every process calls ``save`` and
``restore`` with the same arguments; ``directory`` must be on a file system all processes
share. Process 0 writes the JSON record and renames the step directory.

Example::

    ckpt = CheckpointManager("runs/ckpt", max_to_keep=3)
    ckpt.save(step, params, opt_state, metadata={"model": {...}})
    ...
    # params_like / opt_state_like: arrays or jax.ShapeDtypeStruct carrying the shardings
    # wanted *now* (e.g. those of a freshly initialised model on another mesh).
    restored = ckpt.restore(params_like=abstract_like(params),
                            opt_state_like=abstract_like(opt_state))
    params, opt_state, step = restored.params, restored.opt_state, restored.step
    ckpt.close()

Resuming a run: :meth:`CheckpointManager.check_metadata` compares the metadata saved with a
step to the current run's, section by section: it raises :class:`MetadataMismatchError`
for sections that must match (e.g. ``"model"``) and returns the differences of the others
(e.g. run settings such as the learning rate) for the caller to report::

    changed = ckpt.check_metadata({"model": {...}, "run": {...}}, must_match=("model",))

orbax-checkpoint (a core dependency of sp_jax) is imported on first use, so
``import sp_jax`` stays light.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

__all__ = [
    "ABSENT",
    "CheckpointManager",
    "CheckpointSaveError",
    "MetadataMismatchError",
    "Restored",
    "abstract_like",
    "latest_step",
    "restore_checkpoint",
    "save_checkpoint",
]

_PARAMS, _OPT_STATE, _META = "params", "opt_state", "meta"
_MAX_LISTED = 8


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; ``step`` and ``directory`` say which one.

    Nothing of that step was committed: the checkpoints saved before it are intact.
    """

    def __init__(self, message: str, *, step: int, directory: str):
        super().__init__(message)
        self.step = step
        self.directory = directory


class _Absent:
    """The value of a metadata key one side does not have (see :data:`ABSENT`)."""

    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()
"""Stands, in :meth:`CheckpointManager.check_metadata` differences, for a key that the
saved or the current metadata lacks."""

Differences = dict[str, dict[str, tuple[Any, Any]]]
"""``{section: {key: (saved, now)}}``: the metadata keys that differ, per section."""


class MetadataMismatchError(ValueError):
    """A checkpoint's saved metadata differs from the current run's in a section that must
    match (e.g. another model configuration).

    Attributes:
      step, directory: the checkpoint.
      differences: ``{section: {key: (saved, now)}}`` of the must-match sections only.
    """

    def __init__(self, message: str, *, step: int, directory: str, differences: Differences):
        super().__init__(message)
        self.step = step
        self.directory = directory
        self.differences = differences


class Restored(NamedTuple):
    """What :meth:`CheckpointManager.restore` returns.

    Attributes:
      step: the restored step.
      params: the parameters, with the structure and shardings of ``params_like``.
      opt_state: the optimizer state like ``opt_state_like``; None when not requested.
      metadata: the JSON-serialisable ``metadata`` given to ``save`` ({} if none).
    """

    step: int
    params: Any
    opt_state: Any
    metadata: dict


def _ocp():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError("sp_jax.checkpoint needs orbax-checkpoint, a dependency of sp_jax "
                          "that is missing from this environment: reinstall sp_jax "
                          "(pip install sp_jax) or pip install orbax-checkpoint") from e
    return ocp


def abstract_like(tree: Any) -> Any:
    """``tree`` with every array replaced by a ``jax.ShapeDtypeStruct`` of the same shape,
    dtype and sharding: a restore target that allocates nothing until the restore."""
    def leaf(x):
        if isinstance(x, jax.ShapeDtypeStruct):
            return x
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(leaf, tree)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _flatten(tree: Any) -> dict[str, Any]:
    """{"a/b/0/c": leaf}: the leaves of ``tree`` by '/'-joined key path (dict keys,
    attribute names and sequence indices alike, as orbax stores them)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_name(k) for k in path): leaf for path, leaf in leaves}


def _listing(paths: list[str]) -> str:
    shown = ", ".join(paths[:_MAX_LISTED])
    return shown + (f", ... ({len(paths)} in all)" if len(paths) > _MAX_LISTED else "")


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


def _check_compatible(item: str, saved: Any, target: Any, step: int, directory: str,
                      allow_dtype_cast: bool) -> None:
    """Raises ValueError unless ``target`` has the saved tree structure, shapes and dtypes,
    naming every mismatched leaf path with both values."""
    where = f"checkpoint step {step} in {directory}"
    have, want = _flatten(saved), _flatten(target)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"not in the checkpoint: {_listing(missing)}")
        if extra:
            parts.append(f"in the checkpoint but not in the target: {_listing(extra)}")
        raise ValueError(f"{where}: the {item} tree does not match the target's "
                         f"({'; '.join(parts)}). Restore into the model/optimizer the "
                         "checkpoint was saved from (same configuration).")
    problems = []
    for path in sorted(want):
        saved_shape, saved_dtype = tuple(have[path].shape), np.dtype(have[path].dtype)
        shape, dtype = tuple(np.shape(want[path])), np.dtype(want[path].dtype)
        if saved_shape != shape:
            problems.append(f"{item}/{path}: shape {saved_shape} in the checkpoint, "
                            f"{shape} in the target")
        elif saved_dtype != dtype and not allow_dtype_cast:
            problems.append(f"{item}/{path}: dtype {saved_dtype} in the checkpoint, "
                            f"{dtype} in the target")
    if problems:
        raise ValueError(f"{where} does not fit the target ({len(problems)} mismatched "
                         "leaves; a different model shape?):\n  " + "\n  ".join(
                             problems[:_MAX_LISTED])
                         + ("\n  ..." if len(problems) > _MAX_LISTED else "")
                         + ("\nPass allow_dtype_cast=True to cast dtypes." if any(
                             "dtype" in p for p in problems) else ""))


class CheckpointManager:
    """Saves and restores ``(params, opt_state, metadata)`` per step in ``directory``.

    A thin wrapper around ``orbax.checkpoint.CheckpointManager`` that adds: restoring into
    target shardings given as arrays or ``ShapeDtypeStruct`` (resharding onto another
    mesh), a tree/shape/dtype check naming the mismatched leaf before orbax reads
    anything, and :class:`CheckpointSaveError` naming the step and directory when a save
    fails.

    Args:
      directory: where the step directories live (created if missing). In multi-process
        runs, a path every process sees.
      max_to_keep: keep this many latest steps, deleting older ones after each save;
        None keeps all.
      async_save: write in a background thread (``save`` returns once the arrays are
        copied off the devices). Errors then surface, as :class:`CheckpointSaveError`
        naming the step, from the next ``save``, ``wait_until_finished`` or ``close``.
        Default False: ``save`` returns when the step is committed.
    """

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3,
                 async_save: bool = False):
        ocp = _ocp()
        self.directory = os.path.abspath(os.fspath(directory))
        self._pending: int | None = None
        self._async = bool(async_save)
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_handlers={_PARAMS: ocp.handlers.StandardCheckpointHandler(),
                           _OPT_STATE: ocp.handlers.StandardCheckpointHandler(),
                           _META: ocp.handlers.JsonCheckpointHandler()},
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                create=True,
                # Removed below, synchronously: orbax's own clean-up runs in the
                # background and has no public way to wait for it.
                cleanup_tmp_directories=False,
                enable_async_checkpointing=self._async,
            ),
        )
        self._remove_unfinished_saves(ocp)

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
        """The committed steps, ascending (in-progress or failed saves are not listed)."""
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

    # -- saving -------------------------------------------------------------------------

    def _failed(self, step: int, error: BaseException) -> CheckpointSaveError:
        latest = self.latest_step()
        before = (f"the latest complete checkpoint is step {latest}" if latest is not None
                  else "there is no earlier complete checkpoint")
        return CheckpointSaveError(
            f"saving checkpoint step {step} to {self.directory} failed: "
            f"{type(error).__name__}: {error}. Nothing of step {step} was committed; "
            f"{before}.", step=step, directory=self.directory)

    def _check_pending(self) -> None:
        """Surfaces the error of a background save (async_save=True)."""
        if self._pending is None:
            return
        step, self._pending = self._pending, None
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - re-raised with the step named
            raise self._failed(step, e) from e

    def save(self, step: int, params: Any, opt_state: Any = None,
             metadata: Mapping[str, Any] | None = None) -> None:
        """Writes checkpoint ``step``.

        Args:
          step: a non-negative int not already saved in the directory.
          params: pytree of ``jax.Array`` (any shardings, e.g. ``nnx.State`` of
            ``nnx.Param``); each array is written as its global value.
          opt_state: optional pytree of arrays (e.g. an optax state).
          metadata: optional JSON-serialisable dict, returned by ``restore`` and
            :meth:`metadata`.
        Raises:
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
        items = {_PARAMS: ocp.args.StandardSave(params),
                 _META: ocp.args.JsonSave({"step": step, "metadata": dict(metadata or {})})}
        if opt_state is not None:
            items[_OPT_STATE] = ocp.args.StandardSave(opt_state)
        try:
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # noqa: BLE001 - re-raised with the step named
            raise self._failed(step, e) from e
        self._pending = step
        if not self._async:
            self._check_pending()

    def wait_until_finished(self) -> None:
        """Blocks until a background save has committed (raises its error, if any)."""
        self._check_pending()
        self._manager.wait_until_finished()

    # -- restoring ----------------------------------------------------------------------

    def metadata(self, step: int | None = None) -> dict:
        """The ``metadata`` dict saved with ``step`` (default: the latest), without
        reading any array."""
        ocp = _ocp()
        step = self._resolve(step)
        meta = self._manager.restore(step, args=ocp.args.Composite(
            **{_META: ocp.args.JsonRestore()}))[_META]
        return dict(meta.get("metadata", {}))

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
          TypeError: a section of ``current`` is not a mapping or not JSON-serialisable.
        """
        step = self._resolve(step)
        for section, values in current.items():
            if not isinstance(values, Mapping):
                raise TypeError(f"check_metadata: section {section!r} must be a mapping of "
                                f"keys to values, got {type(values).__name__}.")
        try:
            now = json.loads(json.dumps(current))
        except (TypeError, ValueError) as e:
            raise TypeError(f"check_metadata: the current metadata must be JSON-serialisable "
                            f"(as save() needs it): {e}") from e
        saved = self.metadata(step)
        differences: Differences = {}
        for section, values in now.items():
            old = saved.get(section)
            old = old if isinstance(old, Mapping) else {}
            diff = {k: (old.get(k, ABSENT), values.get(k, ABSENT))
                    for k in sorted({*old, *values}) if old.get(k, ABSENT) != values.get(k, ABSENT)}
            if diff:
                differences[section] = diff
        fatal = {s: d for s, d in differences.items() if s in must_match}
        if fatal:
            parts = "; ".join(f"{section}: " + ", ".join(
                f"{k} {old!r} saved vs {new!r} now" for k, (old, new) in diff.items())
                for section, diff in fatal.items())
            raise MetadataMismatchError(
                f"checkpoint step {step} in {self.directory} was saved with another "
                f"{' and '.join(fatal)} than this run's ({parts}); use the same settings as "
                "the saved run or another checkpoint directory",
                step=step, directory=self.directory, differences=fatal)
        return {s: d for s, d in differences.items() if s not in must_match}

    def restore(self, step: int | None = None, *, params_like: Any,
                opt_state_like: Any = None, allow_dtype_cast: bool = False) -> Restored:
        """Reads checkpoint ``step`` (default: the latest) into the shardings of the targets.

        Args:
          step: the step to read; None for the latest.
          params_like: a pytree with the saved parameter tree's structure whose leaves are
            ``jax.Array`` or ``jax.ShapeDtypeStruct`` giving the target shape, dtype and
            sharding (e.g. ``abstract_like(params)`` of a freshly built model on the
            current mesh, or ``nnx.state(unsharded_model, nnx.Param)`` for plain
            single-device arrays). A leaf without a sharding lands on the first local
            device. The values of array leaves are not used.
          opt_state_like: the same for the optimizer state; None skips it.
          allow_dtype_cast: cast to the target dtypes instead of raising on a mismatch.
        Returns:
          :class:`Restored` ``(step, params, opt_state, metadata)``; arrays are global
          ``jax.Array`` with the target shardings (and the target tree structure).
        Raises:
          FileNotFoundError: no such step.
          ValueError: the target's tree structure, a shape or a dtype differs from the
            checkpoint's; the message names each mismatched leaf path and both values.
        """
        ocp = _ocp()
        self._check_pending()
        step = self._resolve(step)
        saved = self._manager.item_metadata(step)
        targets = {_PARAMS: params_like}
        if opt_state_like is not None:
            if saved.get(_OPT_STATE) is None:
                raise ValueError(f"checkpoint step {step} in {self.directory} holds no "
                                 "optimizer state; restore with opt_state_like=None")
            targets[_OPT_STATE] = opt_state_like
        items = {}
        for name, like in targets.items():
            target = _target(like)
            tree = saved.get(name)
            if tree is None:
                raise ValueError(f"checkpoint step {step} in {self.directory} has no "
                                 f"'{name}' item (not written by sp_jax.checkpoint?)")
            _check_compatible(name, getattr(tree, "tree", tree), target, step,
                              self.directory, allow_dtype_cast)
            items[name] = ocp.args.StandardRestore(target)
        items[_META] = ocp.args.JsonRestore()
        out = self._manager.restore(step, args=ocp.args.Composite(**items))
        meta = out[_META] or {}
        return Restored(step=int(meta.get("step", step)), params=out[_PARAMS],
                        opt_state=out[_OPT_STATE] if opt_state_like is not None else None,
                        metadata=dict(meta.get("metadata", {})))

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Waits for a background save and releases orbax's resources."""
        try:
            self._check_pending()
        finally:
            self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def save_checkpoint(directory: str | os.PathLike, step: int, params: Any,
                    opt_state: Any = None, metadata: Mapping[str, Any] | None = None) -> None:
    """One-shot :meth:`CheckpointManager.save` (keeps every step in ``directory``)."""
    with CheckpointManager(directory, max_to_keep=None) as manager:
        manager.save(step, params, opt_state, metadata)


def restore_checkpoint(directory: str | os.PathLike, step: int | None = None, *,
                       params_like: Any, opt_state_like: Any = None,
                       allow_dtype_cast: bool = False) -> Restored:
    """One-shot :meth:`CheckpointManager.restore` (default: the latest step)."""
    with CheckpointManager(directory, max_to_keep=None) as manager:
        return manager.restore(step, params_like=params_like, opt_state_like=opt_state_like,
                               allow_dtype_cast=allow_dtype_cast)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The latest committed step in ``directory``, None if there is none (or no directory)."""
    if not os.path.isdir(directory):
        return None
    with CheckpointManager(directory, max_to_keep=None) as manager:
        return manager.latest_step()

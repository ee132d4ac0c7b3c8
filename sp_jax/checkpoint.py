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

orbax-checkpoint (a core dependency of sp_jax) is imported on first use, so
``import sp_jax`` stays light.
"""

from __future__ import annotations

import atexit
import datetime
import errno
import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import socket
import sys
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

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

_PARAMS, _OPT_STATE, _META = "params", "opt_state", "meta"
_MAX_LISTED = 8
_LOCK_FILE = ".sp_jax.lock"
_INTEGRITY_VERSION = 1
_CHECKSUM = ("uint32 wrap-around sums over the array's bits as uint32 words w at flat word "
             "index i: [sum(w * (2i + 1)), sum(fmix32(w ^ (i * 0x9E3779B1)))]")


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; ``step`` and ``directory`` say which one.

    Nothing of that step was committed: the checkpoints saved before it are intact.
    """

    def __init__(self, message: str, *, step: int, directory: str):
        super().__init__(message)
        self.step = step
        self.directory = directory


class CheckpointCorruptError(ValueError):
    """A checkpoint on disk is damaged: a file is missing, truncated or was changed after
    it was written (an array's checksum or the JSON record's digest differs), or the step
    directory is empty.

    The message is one line: ``checkpoint step <step> in <directory> is damaged: <reason>``
    (built from the attributes unless ``message`` is given).

    Attributes:
      step: the damaged step (with ``restore(fallback=True)`` finding every step damaged:
        the newest).
      directory: the checkpoint directory.
      reason: what is wrong, naming the leaf, item or file where known.
    """

    def __init__(self, message: str | None = None, *, step: int, directory: str,
                 reason: str):
        super().__init__(message or f"checkpoint step {step} in {directory} is damaged: "
                                    f"{reason}")
        self.step = step
        self.directory = directory
        self.reason = reason


class NonFiniteError(ValueError):
    """``save`` found NaN or inf in floating arrays of params or opt_state and wrote
    nothing.

    Attributes:
      step: the step that was not saved.
      paths: the non-finite leaves (``"params/..."`` or ``"opt_state/..."``), all of them.
    """

    def __init__(self, message: str, *, step: int, paths: Sequence[str]):
        super().__init__(message)
        self.step = step
        self.paths = tuple(paths)


class CheckpointLockedError(RuntimeError):
    """Another live process holds the checkpoint directory's writer lock.

    Attributes:
      directory: the checkpoint directory.
      holder: what the holder recorded in the lock file: ``host``, ``pid``, ``started``
        (ISO time) and ``argv``; empty when it has not written it yet.
    """

    def __init__(self, message: str, *, directory: str, holder: dict):
        super().__init__(message)
        self.directory = directory
        self.holder = holder


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
    skipped: tuple[str, ...] = ()
    changed: dict = {}  # never mutated: restore passes a dict of its own


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


def _path_name(path: Sequence[Any]) -> str:
    return "/".join(_key_name(k) for k in path)


def _flatten(tree: Any) -> dict[str, Any]:
    """{"a/b/0/c": leaf}: the leaves of ``tree`` by '/'-joined key path (dict keys,
    attribute names and sequence indices alike, as orbax stores them)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {_path_name(path): leaf for path, leaf in leaves}


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


# -- integrity data ----------------------------------------------------------------------

def _dtype_name(dtype: Any) -> str:
    try:
        return str(np.dtype(dtype))
    except TypeError:  # e.g. a PRNG key dtype
        return str(dtype)


def _checksummable(dtype: Any) -> bool:
    """Whether arrays of ``dtype`` get checksums: bool and numeric dtypes (not e.g. PRNG
    keys, whose leaves are saved unverified)."""
    import jax.numpy as jnp

    try:
        dtype = np.dtype(dtype)
    except TypeError:
        return False
    return dtype == np.bool_ or bool(jnp.issubdtype(dtype, jnp.number))


def _words(x: Any, xp: Any) -> Any:
    """The bits of ``x`` as zero-extended uint32 words: one per element, or a trailing axis
    of ``bits / 32`` words per element for 64-bit (and wider) dtypes. ``xp`` is
    ``jax.numpy`` (inside jit) or ``numpy``; both give the same words."""
    import jax.numpy as jnp

    dtype = np.dtype(x.dtype)
    bits = jax.dtypes.itemsize_bits(dtype)
    if dtype == np.bool_:
        return x.astype(xp.uint32)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return _words(xp.stack([xp.real(x), xp.imag(x)], axis=-1), xp)
    if bits < 8:  # int4, float4, ...: widened exactly, value for value
        if jnp.issubdtype(dtype, jnp.floating):
            wide = xp.float32
        else:
            wide = xp.int8 if jnp.issubdtype(dtype, jnp.signedinteger) else xp.uint8
        return _words(x.astype(wide), xp)
    if bits <= 32:
        unsigned = {8: xp.uint8, 16: xp.uint16, 32: xp.uint32}[bits]
        if xp is np:
            words = np.ascontiguousarray(x).reshape(-1).view(unsigned).reshape(np.shape(x))
        else:
            words = jax.lax.bitcast_convert_type(x, unsigned)
        return words.astype(xp.uint32)
    if xp is np:
        flat = np.ascontiguousarray(x).reshape(-1).view(np.uint32)
        return flat.reshape((*np.shape(x), bits // 32))
    return jax.lax.bitcast_convert_type(x, xp.uint32)


def _fmix32(h: Any, xp: Any) -> Any:
    """MurmurHash3's 32-bit finaliser (every input bit affects every output bit)."""
    h = h ^ (h >> xp.uint32(16))
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> xp.uint32(13))
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> xp.uint32(16))


def _leaf_sums(x: Any, xp: Any) -> list[Any]:
    """``[sum(w * (2i + 1)), sum(fmix32(w ^ (i * 0x9E3779B1))), all finite]`` as uint32
    for one array (``i``: the row-major flat index of each word ``w``)."""
    import jax.numpy as jnp

    words = _words(x, xp)
    if xp is np:
        index = np.arange(words.size, dtype=np.uint64).astype(np.uint32).reshape(words.shape)
    else:  # built from iotas, so a sharded array is never reshaped (no resharding)
        index = jnp.zeros(words.shape, jnp.uint32)
        stride = 1
        for axis in reversed(range(words.ndim)):
            iota = jax.lax.broadcasted_iota(jnp.uint32, words.shape, axis)
            index = index + iota * jnp.uint32(stride % 2**32)
            stride *= words.shape[axis]
    odd = index * xp.uint32(2) + xp.uint32(1)
    first = xp.sum(words * odd, dtype=xp.uint32)
    second = xp.sum(_fmix32(words ^ (index * xp.uint32(0x9E3779B1)), xp), dtype=xp.uint32)
    if jnp.issubdtype(np.dtype(x.dtype), jnp.inexact):
        finite = xp.all(xp.isfinite(x)).astype(xp.uint32)
    else:
        finite = xp.uint32(1)
    return [first, second, finite]


def _sums_on_device(leaves: tuple[jax.Array, ...]) -> jax.Array:
    import jax.numpy as jnp

    return jnp.stack([jnp.stack(_leaf_sums(x, jnp)) for x in leaves])


@functools.lru_cache(maxsize=16)
def _sums_jit(out_sharding: jax.sharding.Sharding | None) -> Any:
    """The jitted pass over a group of arrays, its (n, 3) result replicated on their
    devices (so every process reads the same values)."""
    return jax.jit(_sums_on_device, out_shardings=out_sharding)


def _replicated(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding | None:
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None


def _device_order(x: jax.Array) -> tuple[int, ...]:
    devices = getattr(x.sharding, "_device_assignment", None)
    if devices is None:
        devices = sorted(x.sharding.device_set, key=lambda d: d.id)
    return tuple(d.id for d in devices)


def _checksums(leaves: Mapping[str, Any]) -> dict[str, tuple[int, int, bool] | None]:
    """``{path: (checksum_1, checksum_2, all_finite)}`` of each leaf (None for a dtype
    without checksums). ``jax.Array`` leaves are summed on their devices, in one jitted
    pass per set of devices (one for a model on one mesh), which also works on global
    arrays of multi-process runs (every process calls it); other leaves on the host."""
    found: dict[str, tuple[int, int, bool] | None] = {}
    groups: dict[tuple[int, ...], list[str]] = {}
    for path, x in leaves.items():
        if isinstance(x, jax.Array):
            if _checksummable(x.dtype):
                groups.setdefault(_device_order(x), []).append(path)
            else:
                found[path] = None
            continue
        host = np.asarray(x)
        if _checksummable(host.dtype):
            with np.errstate(all="ignore"):
                first, second, finite = _leaf_sums(host, np)
            found[path] = (int(first), int(second), bool(finite))
        else:
            found[path] = None
    for paths in groups.values():
        arrays = tuple(leaves[p] for p in paths)
        sums = np.asarray(_sums_jit(_replicated(arrays[0].sharding))(arrays))
        for path, (first, second, finite) in zip(paths, sums.tolist(), strict=True):
            found[path] = (first, second, bool(finite))
    return {path: found[path] for path in leaves}


def _record_digest(record: Mapping[str, Any]) -> str:
    """SHA-256 of the JSON record's canonical text, without its ``digest`` entry."""
    body = {k: v for k, v in record.items() if k != "digest"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _leaf_dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


_STATUS_HINTS = {
    "NOT_FOUND": "a file is missing",
    "OUT_OF_RANGE": "a file is truncated",
    "DATA_LOSS": "a file was changed after it was written (its checksum or encoding is "
                 "broken)",
    "FAILED_PRECONDITION": "a file is damaged",
}
_JSON_FILES = ("_METADATA", "_sharding", "_CHECKPOINT_METADATA", "metadata")


def _unparsable_json(step_dir: str) -> list[str]:
    """The orbax JSON files under ``step_dir`` that do not parse (for error messages)."""
    broken = []
    for root, _, files in os.walk(step_dir):
        for name in sorted(files):
            if name not in _JSON_FILES and os.path.basename(root) != "array_metadatas":
                continue
            path = os.path.join(root, name)
            try:
                with open(path, "rb") as f:
                    json.loads(f.read())
            except (OSError, ValueError):
                broken.append(os.path.relpath(path, os.path.dirname(step_dir)))
    return sorted(broken)


class _AbandonedReads(logging.Filter):
    """Drops asyncio's "... exception was never retrieved" records of the tensorstore
    reads (status-coded errors, as orbax wraps them or not) that a failed restore
    abandoned."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(("Future exception was never retrieved",
                                           "Task exception was never retrieved")):
            return True
        error = record.exc_info[1] if record.exc_info else None
        for _ in range(8):
            if error is None:
                return True
            if (re.match(r"[A-Z_]+: ", str(error))
                    or str(error).startswith("Encountered error while reading array")):
                return False
            error = error.__cause__
        return True


def _quiet_abandoned_reads() -> None:
    """When one array fails to read, orbax closes its event loop while tensorstore still
    completes the other reads of the step: each then reports "Event loop is closed"
    through ``sys.unraisablehook`` (as do orbax's read coroutines when they are
    collected), and asyncio logs their errors as never retrieved.
    Both are noise about reads already given up (the failure itself is raised as one
    :class:`CheckpointCorruptError`): filtered out here, and nothing else."""
    if not getattr(sys.unraisablehook, "_sp_jax_quiet", False):
        previous = sys.unraisablehook

        def hook(unraisable: Any) -> None:
            error = unraisable.exc_value
            if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
                return
            code = getattr(unraisable.object, "cr_code", None)  # an orbax read coroutine
            if code is not None and "orbax" in code.co_filename.split(os.sep):
                return
            previous(unraisable)

        hook._sp_jax_quiet = True  # type: ignore[attr-defined]
        sys.unraisablehook = hook
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedReads) for f in asyncio_log.filters):
        asyncio_log.addFilter(_AbandonedReads())


def _not_damage(error: BaseException) -> bool:
    """Errors of a read that say nothing about the files (out of memory)."""
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in str(error)


# -- the writer's lock -------------------------------------------------------------------

def _holder_record() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "argv": [str(a) for a in getattr(sys, "orig_argv", sys.argv)]}


def _read_holder(fd: int) -> dict | None:
    """The lock file's record; None when it is empty."""
    try:
        raw = os.pread(fd, 1 << 16, 0)
    except OSError:
        return None
    if not raw.strip():
        return None
    try:
        holder = json.loads(raw)
    except ValueError:
        holder = None
    if not isinstance(holder, dict):
        return {"unparsable": raw[:200].decode(errors="replace")}
    return holder


def _describe_holder(holder: Mapping[str, Any] | None) -> str:
    if not holder:
        return "another process (it has not recorded itself in the lock file yet)"
    if "pid" not in holder:
        return f"another process (lock file: {holder.get('unparsable', holder)!r})"
    argv = holder.get("argv")
    command = shlex.join(map(str, argv)) if isinstance(argv, list) else str(argv)
    command = " ".join(command.split())  # one line (e.g. python -c '<script>')
    if len(command) > 120:
        command = command[:117] + "..."
    return (f"pid {holder.get('pid')} on host {holder.get('host', '?')} "
            f"(since {holder.get('started', '?')}, {command})")


def _unlock(fd: int, path: str) -> None:
    """Releases the lock: removes the lock file (while still holding it, and only if the
    path is still this file) and unlocks. Lockers check, once locked, that the path still
    names the file they locked, so removing it never lets two writers in."""
    try:
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                os.unlink(path)
        except OSError:
            try:
                os.ftruncate(fd, 0)  # cannot remove it: leave it empty (not stale)
            except OSError:
                pass
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        pass
    finally:
        os.close(fd)


# -- exit --------------------------------------------------------------------------------

_IN_FLIGHT: set[CheckpointManager] = set()  # async saves not waited for yet: kept alive
_HOOK = threading.Lock()
_hooked = False


def _register_exit_hook() -> None:
    """Registers :func:`_finish_at_exit`, once per process."""
    global _hooked
    with _HOOK:
        if _hooked:
            return
        # threading runs its exit hooks in reverse order, while threads and executors
        # still work (atexit would be too late: orbax needs concurrent.futures, which
        # refuses new work once its own hook has run). concurrent.futures registers that
        # hook on import: imported first, it runs after ours.
        import concurrent.futures.thread  # noqa: F401

        register = getattr(threading, "_register_atexit", None)
        try:
            if register is None:
                raise RuntimeError("threading._register_atexit is missing")
            register(_finish_at_exit)
        except RuntimeError:
            atexit.register(_finish_at_exit)  # late: saves may not finish then
        _hooked = True


def _finish_at_exit() -> None:
    """At interpreter exit: waits for the saves still in flight of managers that were
    never closed (one line each to stderr)."""
    for manager in list(_IN_FLIGHT):
        try:
            manager._exit_hook()
        except Exception as e:  # noqa: BLE001 - never block the exit
            print(f"sp_jax.checkpoint: at exit, {manager.directory}: {type(e).__name__}: "
                  f"{e}", file=sys.stderr, flush=True)


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


def _json_sections(current: Mapping[str, Mapping[str, Any]], caller: str) -> dict:
    """``current`` after a JSON round trip (as saving does), checked to be
    ``{section: mapping}``; TypeError otherwise."""
    for section, values in current.items():
        if not isinstance(values, Mapping):
            raise TypeError(f"{caller}: section {section!r} must be a mapping of "
                            f"keys to values, got {type(values).__name__}.")
    try:
        return json.loads(json.dumps(current))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{caller}: the current metadata must be JSON-serialisable "
                        f"(as save() needs it): {e}") from e


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
        self._release: weakref.finalize | None = None
        try:
            if lock:
                self._lock_all_processes()
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
            self._release_lock()
            raise
        _register_exit_hook()

    def _lock_all_processes(self) -> None:
        """Process 0 takes the lock; in multi-process runs every process learns whether it
        did (so none goes on to wait for process 0 in orbax when it could not)."""
        refused = None
        if jax.process_index() == 0:
            os.makedirs(self.directory, exist_ok=True)
            try:
                self._lock()
            except CheckpointLockedError as e:
                refused = e
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            flag = multihost_utils.broadcast_one_to_all(np.int32(refused is not None))
            if refused is None and int(flag):
                raise CheckpointLockedError(
                    f"checkpoint directory {self.directory} is in use by another writer "
                    "(process 0 could not take its lock; its error names the holder): one "
                    "writer per directory", directory=self.directory, holder={})
        if refused is not None:
            raise refused

    def _lock(self) -> None:
        """Takes the writer's lock (process 0), or raises CheckpointLockedError."""
        path = os.path.join(self.directory, _LOCK_FILE)
        for _ in range(100):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd) or {}
                os.close(fd)
                own = (holder.get("pid") == os.getpid()
                       and holder.get("host") == socket.gethostname())
                raise CheckpointLockedError(
                    f"checkpoint directory {self.directory} is in use by "
                    f"{_describe_holder(holder)}"
                    + (" (this process: close its other CheckpointManager first)" if own
                       else "")
                    + ": one writer per directory; wait for it to finish or use another "
                    "--ckpt-dir", directory=self.directory, holder=holder) from None
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS,
                                   errno.EINVAL):
                    raise
                warnings.warn(f"checkpoint directory {self.directory}: the file system "
                              f"does not support flock ({e.strerror}); running without "
                              "the one-writer lock", stacklevel=3)
                return
            try:  # still the file at `path`? (its previous holder may have removed it)
                current = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                current = False
            if current:
                break
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        else:  # pragma: no cover - another process keeps replacing the file
            raise CheckpointLockedError(
                f"checkpoint directory {self.directory}: could not take the lock "
                f"{path} (it keeps being replaced)", directory=self.directory, holder={})
        old = _read_holder(fd)
        if old:
            self.stale_lock = old
            warnings.warn(f"checkpoint directory {self.directory}: taking over the lock "
                          f"left by {_describe_holder(old)}, which ended without "
                          "releasing it (killed?)", stacklevel=3)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder_record()).encode(), 0)
        self._release = weakref.finalize(self, _unlock, fd, path)

    def _release_lock(self) -> None:
        if self._release is not None:
            self._release()  # runs once; also on garbage collection and at exit

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
        finally:
            _IN_FLIGHT.discard(self)

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
                  for path, x in _flatten(tree).items()}
        try:
            sums = _checksums(leaves)
        except Exception as e:  # noqa: BLE001 - re-raised with the step named
            raise self._failed(step, e) from e
        bad = [path for path, s in sums.items() if s is not None and not s[2]]
        if check_finite and bad:
            raise NonFiniteError(
                f"checkpoint step {step} not saved to {self.directory}: NaN or inf in "
                f"{len(bad)} array(s): {_listing(bad)}. Nothing was written (the earlier "
                "checkpoints are unchanged); save(..., check_finite=False) writes them "
                "anyway", step=step, paths=bad)
        integrity = {
            "version": _INTEGRITY_VERSION, "checksum": _CHECKSUM, "items": list(trees),
            "leaves": {path: {"dtype": _dtype_name(_leaf_dtype(x)),
                              "shape": [int(n) for n in np.shape(x)],
                              "checksum": None if sums[path] is None else
                              list(sums[path][:2])}
                       for path, x in leaves.items()}}
        try:
            record = json.loads(json.dumps({"step": step, "metadata": dict(metadata or {}),
                                            "integrity": integrity}))
        except (TypeError, ValueError) as e:
            raise self._failed(step, e) from e
        record["digest"] = _record_digest(record)
        items = {name: ocp.args.StandardSave(tree) for name, tree in trees.items()}
        items[_META] = ocp.args.JsonSave(record)
        try:
            self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # noqa: BLE001 - re-raised with the step named
            raise self._failed(step, e) from e
        self._pending = step
        if self._async:
            _IN_FLIGHT.add(self)  # finished at exit if never waited for
        else:
            self._check_pending()

    def wait_until_finished(self) -> None:
        """Blocks until a background save has committed (raises its error, if any)."""
        self._check_pending()
        self._manager.wait_until_finished()

    # -- reading ------------------------------------------------------------------------

    def _corrupt(self, step: int, reason: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(step=step, directory=self.directory, reason=reason)

    def _describe(self, error: BaseException, step: int) -> str:
        """One line on what orbax/tensorstore raised reading ``step``: the leaf or file
        it names, what that suggests (missing, truncated, changed) and the gist of the
        message (paths relative to the checkpoint directory, no tensorstore spec)."""
        chain = [error]  # orbax wraps tensorstore's errors (raise ... from e)
        while chain[-1].__cause__ is not None and len(chain) < 8:
            chain.append(chain[-1].__cause__)
        error = next((e for e in reversed(chain) if re.match(r"[A-Z_]+: ", str(e))),
                     chain[-1])
        text = str(error) or type(error).__name__
        for cut in (" [tensorstore_spec=", " [source locations="):
            text = text.split(cut, 1)[0]
        text = " ".join(text.split()).replace('Error opening "zarr" driver: ', "")
        text = text.replace(self.directory + os.sep, "")
        where = ""
        leaf = re.search(r'"([^"/]+)/[^"]*" in OCDBT database at local file '
                         r'"(?:[^"]*/)?(params|opt_state)/"', text)
        if leaf:
            where = f"{leaf.group(2)}/{leaf.group(1).replace('.', '/')}: "
        status = re.match(r"([A-Z_]+): ", text)
        hint = _STATUS_HINTS.get(status.group(1)) if status else None
        if "decompress" in text or "decoding" in text:
            hint = _STATUS_HINTS["DATA_LOSS"]
        if "Truncated" in text:  # tensorstore reads a missing data file as empty
            hint = "a file is truncated or missing"
        if isinstance(error, FileNotFoundError):
            hint = "a file is missing"
        if isinstance(error, json.JSONDecodeError) or "Invalid JSON" in text:
            broken = _unparsable_json(self._step_dir(step))
            hint = "a JSON file is truncated or garbled" + (
                f" ({', '.join(broken)})" if broken else "")
        if len(text) > 300:
            text = text[:297] + "..."
        if not status:
            text = f"{type(error).__name__}: {text}"
        return f"{where}{hint}: {text}" if hint else f"{where}{text}"

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
            if _not_damage(e):
                raise
            raise self._corrupt(step, f"{_META}: the JSON record cannot be read: "
                                      f"{self._describe(e, step)}") from e
        if not isinstance(record, dict):
            raise self._corrupt(step, f"{_META}: the JSON record is not an object")
        if "digest" in record or "integrity" in record:
            if "digest" not in record or not isinstance(record.get("integrity"), dict):
                raise self._corrupt(step, f"{_META}: the JSON record's integrity data is "
                                          "incomplete (the file was changed after it was "
                                          "written)")
            if record["digest"] != _record_digest(record):
                raise self._corrupt(step, f"{_META}: digest mismatch (the JSON record was "
                                          "changed after it was written)")
        return record

    def _item_metadata(self, step: int) -> Any:
        _quiet_abandoned_reads()
        try:
            return self._manager.item_metadata(step)
        except Exception as e:  # noqa: BLE001 - reported as damage, with its gist
            if _not_damage(e):
                raise
            raise self._corrupt(step, "the orbax metadata cannot be read: "
                                      f"{self._describe(e, step)}") from e

    def _match_record(self, step: int, item: str, tree: Any, leaves: Mapping) -> None:
        """Raises CheckpointCorruptError unless orbax's metadata of ``item`` lists the
        arrays, shapes and dtypes of the JSON record."""
        recorded = {path[len(item) + 1:]: leaf for path, leaf in leaves.items()
                    if path.startswith(item + "/")}
        have = _flatten(tree)
        if set(have) != set(recorded):
            odd = sorted(set(have) ^ set(recorded))
            raise self._corrupt(step, f"{item}: the orbax metadata lists other arrays than "
                                      f"the integrity record ({_listing(odd)})")
        for path, meta in have.items():
            shape, dtype = [int(n) for n in meta.shape], _dtype_name(meta.dtype)
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
                   and _dtype_name(_leaf_dtype(x)) == leaves[path].get("dtype")}
        sums = _checksums(checked)
        bad = [path for path, s in sums.items()
               if s is None or [s[0], s[1]] != leaves[path]["checksum"]]
        if bad:
            also = f" (and {_listing(bad[1:])})" if len(bad) > 1 else ""
            raise self._corrupt(step, f"{bad[0]}: checksum mismatch (the file holding it "
                                      f"was changed after it was written){also}")

    def _restore_step(self, step: int, params_like: Any, opt_state_like: Any,
                      allow_dtype_cast: bool, now: dict | None,
                      must_match: Sequence[str], cast: bool = True) -> Restored:
        """Reads and verifies one step (see :meth:`restore`)."""
        ocp = _ocp()
        record = self._record(step)
        saved_meta = record.get("metadata")
        saved_meta = dict(saved_meta) if isinstance(saved_meta, Mapping) else {}
        changed = {} if now is None else self._compare(saved_meta, now, step, must_match)
        integrity = record.get("integrity")
        if integrity is None:
            warnings.warn(f"checkpoint step {step} in {self.directory} has no integrity "
                          "data (saved by an older sp_jax): restored unverified",
                          stacklevel=3)
        saved = self._item_metadata(step)
        targets = {_PARAMS: params_like}
        if opt_state_like is not None:
            targets[_OPT_STATE] = opt_state_like
        items, wanted = {}, {}
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
            _check_compatible(name, tree, target, step, self.directory, allow_dtype_cast)
            saved_leaves = _flatten(tree)

            def as_saved(path, t, saved_leaves=saved_leaves):
                dtype = np.dtype(saved_leaves[_path_name(path)].dtype)
                if dtype == np.dtype(t.dtype):
                    return t
                return jax.ShapeDtypeStruct(t.shape, dtype, sharding=t.sharding)

            # Read in the saved dtypes (verified as written), cast afterwards.
            items[name] = ocp.args.StandardRestore(
                jax.tree_util.tree_map_with_path(as_saved, target))
            wanted[name] = target
        _quiet_abandoned_reads()
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # noqa: BLE001 - reported as damage, with its gist
            if _not_damage(e):
                raise
            raise self._corrupt(step, self._describe(e, step)) from e
        if integrity is not None:  # one device pass over every array read
            self._verify_arrays(step, {f"{name}/{path}": x for name in wanted
                                       for path, x in _flatten(out[name]).items()},
                                integrity.get("leaves", {}))
        result = {}
        for name, target in wanted.items():
            tree = out[name]
            if cast:
                tree = jax.tree.map(
                    lambda x, t: x if x.dtype == t.dtype else jax.device_put(
                        x.astype(t.dtype), t.sharding), tree, target)
            result[name] = tree
        return Restored(step=int(record.get("step", step)), params=result[_PARAMS],
                        opt_state=result.get(_OPT_STATE), metadata=saved_meta,
                        changed=changed)

    def _compare(self, saved: Mapping[str, Any], now: Mapping[str, Any], step: int,
                 must_match: Sequence[str]) -> Differences:
        """check_metadata's comparison of ``now`` (JSON round-tripped) with ``saved``."""
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
        now = _json_sections(current, "check_metadata")
        return self._compare(self.metadata(step), now, step, must_match)

    def restore(self, step: int | None = None, *, params_like: Any,
                opt_state_like: Any = None, allow_dtype_cast: bool = False,
                fallback: bool = False,
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
            (the arrays are read and verified in their saved dtypes, then cast).
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
          :class:`Restored` ``(step, params, opt_state, metadata, skipped, changed)``;
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
        now = (None if expect_metadata is None
               else _json_sections(expect_metadata, "restore: expect_metadata"))
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
                self._release_lock()

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


def save_checkpoint(directory: str | os.PathLike, step: int, params: Any,
                    opt_state: Any = None, metadata: Mapping[str, Any] | None = None) -> None:
    """One-shot :meth:`CheckpointManager.save` (keeps every step in ``directory``; takes
    the writer's lock while saving)."""
    with CheckpointManager(directory, max_to_keep=None) as manager:
        manager.save(step, params, opt_state, metadata)


def restore_checkpoint(directory: str | os.PathLike, step: int | None = None, *,
                       params_like: Any, opt_state_like: Any = None,
                       allow_dtype_cast: bool = False) -> Restored:
    """One-shot :meth:`CheckpointManager.restore` (default: the latest step); a reader:
    takes no lock, so it works while a writer holds the directory."""
    with CheckpointManager(directory, max_to_keep=None, lock=False) as manager:
        return manager.restore(step, params_like=params_like, opt_state_like=opt_state_like,
                               allow_dtype_cast=allow_dtype_cast)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The latest committed step in ``directory``, None if there is none (or no directory).
    Takes no lock."""
    if not os.path.isdir(directory):
        return None
    with CheckpointManager(directory, max_to_keep=None, lock=False) as manager:
        return manager.latest_step()

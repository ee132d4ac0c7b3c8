"""The one-writer lock of a checkpoint directory (:class:`WriterLock`): an exclusive
``fcntl.flock`` on ``<directory>/.sp_jax.lock`` holding a record of its holder, taken over
from a holder that died, skipped with a warning where the file system cannot lock."""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import os
import shlex
import socket
import sys
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from .errors import CheckpointLockedError

__all__ = ["LOCK_FILE", "WriterLock"]

LOCK_FILE = ".sp_jax.lock"


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


class WriterLock:
    """The writer's lock of checkpoint directory ``directory``: an exclusive ``fcntl.flock``
    on ``<directory>/.sp_jax.lock``, taken by process 0, in which the holder records
    itself (``host``, ``pid``, ``started``, ``argv``) for the error of a second writer.

    The kernel drops the lock when its holder dies, so a lock file left by a killed run is
    taken over (with a warning; :attr:`stale` says whose it was).

    Attributes:
      directory: the checkpoint directory.
      stale: what the lock file said about its previous holder, a process that died
        without releasing it; None when the lock was free and clean (or not taken).
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.stale: dict | None = None
        self._release: weakref.finalize | None = None

    def acquire(self) -> None:
        """Takes the lock, or raises :class:`CheckpointLockedError` naming the holder (on
        every process). Process 0 takes the lock; in multi-process runs every process
        learns whether it did (so none goes on to wait for process 0 in orbax when it
        could not). Warns, and runs unlocked, where the file system has no flock."""
        refused = None
        if jax.process_index() == 0:
            os.makedirs(self.directory, exist_ok=True)
            try:
                self._take()
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

    def _take(self) -> None:
        """Takes the writer's lock (process 0), or raises CheckpointLockedError. Its
        warnings (stacklevel=3: this, :meth:`acquire`, its caller) name the code that
        opened the directory, e.g. ``CheckpointManager.__init__``."""
        path = os.path.join(self.directory, LOCK_FILE)
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
            self.stale = old
            warnings.warn(f"checkpoint directory {self.directory} (--ckpt-dir): taking "
                          f"over the lock left by {_describe_holder(old)}, which ended "
                          "without releasing it (killed?)", stacklevel=3)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_holder_record()).encode(), 0)
        self._release = weakref.finalize(self, _unlock, fd, path)

    def release(self) -> None:
        """Releases the lock if it was taken (once: also done on garbage collection and
        at exit)."""
        if self._release is not None:
            self._release()  # runs once; also on garbage collection and at exit


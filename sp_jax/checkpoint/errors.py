"""The exceptions of :mod:`sp_jax.checkpoint`: a save that failed or was refused, a damaged
checkpoint, a directory held by another writer, and saved metadata that does not match the
current run's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["CheckpointCorruptError", "CheckpointLockedError", "CheckpointSaveError",
           "Differences", "MetadataMismatchError", "NonFiniteError"]

Differences = dict[str, dict[str, tuple[Any, Any]]]
"""``{section: {key: (saved, now)}}``: the metadata keys that differ, per section."""


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

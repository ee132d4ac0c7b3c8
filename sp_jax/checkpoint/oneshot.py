"""One-shot checkpoint calls: :func:`save_checkpoint`, :func:`restore_checkpoint` and
:func:`latest_step`, each a :class:`~.manager.CheckpointManager` opened and closed."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .manager import CheckpointManager, Restored

__all__ = ["latest_step", "restore_checkpoint", "save_checkpoint"]


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

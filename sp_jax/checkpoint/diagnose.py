"""What a failed read of a checkpoint means: orbax's and tensorstore's errors translated into
one line naming the leaf or file and what is wrong with it (missing, truncated, changed),
errors that say nothing about the files (out of memory) told apart, and the noise of the
reads a failed restore abandoned (unraisable "Event loop is closed", asyncio's "exception
was never retrieved") filtered out."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from typing import Any

__all__ = ["describe", "not_damage", "quiet_abandoned_io"]

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


class _ReraisedThreadErrors(logging.Filter):
    """Drops orbax's log record (with a traceback) of a worker thread that raised: the
    thread keeps the exception and orbax raises it again to the caller who waits for the
    save, which :class:`~sp_jax.checkpoint.CheckpointManager` reports as one
    :class:`~sp_jax.checkpoint.CheckpointSaveError`."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "_SignalingThread.run() raised an exception" not in str(record.msg)


def quiet_abandoned_io() -> None:
    """When one array fails to read or write (a damaged file, a full disk), orbax closes
    its event loop while tensorstore still completes the other reads or writes of the
    step: each then reports "Event loop is closed" through ``sys.unraisablehook`` (as do
    orbax's read coroutines when they are collected), asyncio logs their errors as never
    retrieved, and orbax logs the traceback of each worker thread that failed. All of it
    is noise about work already given up (the failure itself is raised as one
    :class:`CheckpointCorruptError` or :class:`CheckpointSaveError`): filtered out here,
    and nothing else."""
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
    for name, kind in (("asyncio", _AbandonedReads), ("absl", _ReraisedThreadErrors)):
        log = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in log.filters):
            log.addFilter(kind())


def not_damage(error: BaseException) -> bool:
    """Errors of a read that say nothing about the files (out of memory)."""
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in str(error)


def describe(error: BaseException, directory: str, step: int) -> str:
    """One line on what orbax/tensorstore raised reading ``step`` of checkpoint directory
    ``directory``: the leaf or file it names, what that suggests (missing, truncated,
    changed) and the gist of the message (paths relative to the checkpoint directory, no
    tensorstore spec)."""
    chain = [error]  # orbax wraps tensorstore's errors (raise ... from e)
    while chain[-1].__cause__ is not None and len(chain) < 8:
        chain.append(chain[-1].__cause__)
    error = next((e for e in reversed(chain) if re.match(r"[A-Z_]+: ", str(e))),
                 chain[-1])
    text = str(error) or type(error).__name__
    for cut in (" [tensorstore_spec=", " [source locations="):
        text = text.split(cut, 1)[0]
    text = " ".join(text.split()).replace('Error opening "zarr" driver: ', "")
    text = text.replace(directory + os.sep, "")
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
        broken = _unparsable_json(os.path.join(directory, str(step)))
        hint = "a JSON file is truncated or garbled" + (
            f" ({', '.join(broken)})" if broken else "")
    if len(text) > 300:
        text = text[:297] + "..."
    if not status:
        text = f"{type(error).__name__}: {text}"
    return f"{where}{hint}: {text}" if hint else f"{where}{text}"

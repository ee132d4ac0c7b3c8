"""What a checkpoint holds against what the caller expects: the saved metadata compared with
the current run's, section by section, and a restore target's tree, shapes and dtypes
checked against the saved arrays (naming every mismatched leaf); with the helpers that name
a pytree's leaves by path, as orbax stores them."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from .errors import Differences, MetadataMismatchError
from .relayout import LAYOUT_KEYS

__all__ = ["ABSENT", "Differences", "check_compatible", "compare", "flatten", "json_sections",
           "listing", "path_name"]

_MAX_LISTED = 8


class _Absent:
    """The value of a metadata key one side does not have (see :data:`ABSENT`)."""

    def __repr__(self) -> str:
        return "<absent>"


ABSENT = _Absent()
"""Stands, in :meth:`CheckpointManager.check_metadata` differences, for a key that the
saved or the current metadata lacks."""


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: Sequence[Any]) -> str:
    """A leaf's key path as '/'-joined names ("a/b/0/c")."""
    return "/".join(_key_name(k) for k in path)


def flatten(tree: Any) -> dict[str, Any]:
    """{"a/b/0/c": leaf}: the leaves of ``tree`` by '/'-joined key path (dict keys,
    attribute names and sequence indices alike, as orbax stores them)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {path_name(path): leaf for path, leaf in leaves}


def listing(paths: list[str]) -> str:
    """``paths`` comma-separated for a message: the first few, then how many in all."""
    shown = ", ".join(paths[:_MAX_LISTED])
    return shown + (f", ... ({len(paths)} in all)" if len(paths) > _MAX_LISTED else "")


def check_compatible(item: str, saved: Any, target: Any, step: int, directory: str,
                     allow_dtype_cast: bool) -> list[str]:
    """Raises ValueError unless ``target`` has the saved tree structure, shapes and dtypes
    (other dtypes too where ``allow_dtype_cast``), naming every mismatched leaf path with
    both values; returns the leaves to cast, ``"<item>/<path>: float32 -> bfloat16"``."""
    where = f"checkpoint step {step} in {directory}"
    have, want = flatten(saved), flatten(target)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"not in the checkpoint: {listing(missing)}")
        if extra:
            parts.append(f"in the checkpoint but not in the target: {listing(extra)}")
        raise ValueError(f"{where}: the {item} tree does not match the target's "
                         f"({'; '.join(parts)}). Restore into the model/optimizer the "
                         "checkpoint was saved from (same configuration).")
    problems, casts = [], []
    for path in sorted(want):
        saved_shape, saved_dtype = tuple(have[path].shape), np.dtype(have[path].dtype)
        shape, dtype = tuple(np.shape(want[path])), np.dtype(want[path].dtype)
        if saved_shape != shape:
            problems.append(f"{item}/{path}: shape {saved_shape} in the checkpoint, "
                            f"{shape} in the target")
        elif saved_dtype != dtype and not allow_dtype_cast:
            problems.append(f"{item}/{path}: dtype {saved_dtype} in the checkpoint, "
                            f"{dtype} in the target")
        elif saved_dtype != dtype:
            casts.append(f"{item}/{path}: {saved_dtype} -> {dtype}")
    if problems:
        raise ValueError(f"{where} does not fit the target ({len(problems)} mismatched "
                         "leaves; a different model shape?):\n  " + "\n  ".join(
                             problems[:_MAX_LISTED])
                         + ("\n  ..." if len(problems) > _MAX_LISTED else "")
                         + ("\nTo cast them, restore with allow_dtype_cast=True (or the "
                            "items to cast, e.g. ('opt_state',)); examples/train_gpt.py "
                            "casts the moments of another --moments-dtype itself." if any(
                             "dtype" in p for p in problems) else ""))
    return casts


def json_sections(current: Mapping[str, Mapping[str, Any]], caller: str) -> dict:
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


COMPUTE_KEYS = frozenset({"remat", "attention_implementation"})
"""Model settings that choose how the same arrays are computed (``GPTConfig.remat``:
``--remat``; the attention kernel), not what they are: they may differ on resume, and
:func:`compare` returns their changes with the run settings' instead of refusing."""

FREE_KEYS = LAYOUT_KEYS | COMPUTE_KEYS
"""Model settings a resume may change: the layers' form, which a restore converts, and
:data:`COMPUTE_KEYS`."""


def compare(saved: Mapping[str, Any], now: Mapping[str, Any], must_match: Sequence[str], *,
            step: int, directory: str) -> Differences:
    """Compares ``now`` (JSON round-tripped, see :func:`json_sections`) with ``saved``, the
    metadata saved with checkpoint ``step`` in ``directory``, section by section (only the
    sections of ``now``): raises :class:`MetadataMismatchError` when a ``must_match``
    section differs (in a key other than :data:`FREE_KEYS`: the layers' form, which a
    restore converts, and how they are computed), returns the differences of the others
    and those of :data:`COMPUTE_KEYS`."""
    differences: Differences = {}
    for section, values in now.items():
        old = saved.get(section)
        old = old if isinstance(old, Mapping) else {}
        diff = {k: (old.get(k, ABSENT), values.get(k, ABSENT))
                for k in sorted({*old, *values}) if old.get(k, ABSENT) != values.get(k, ABSENT)}
        if diff:
            differences[section] = diff
    # the layers' form (stacked or unrolled) may differ: restore converts the arrays; how
    # they are computed too (FREE_KEYS): reported as changed settings
    fatal = {s: f for s, d in differences.items() if s in must_match
             and (f := {k: v for k, v in d.items() if k not in FREE_KEYS})}
    if fatal:
        parts = "; ".join(f"{section}: " + ", ".join(
            f"{k} {old!r} saved vs {new!r} now" for k, (old, new) in diff.items())
            for section, diff in fatal.items())
        raise MetadataMismatchError(
            f"checkpoint step {step} in {directory} was saved with another "
            f"{' and '.join(fatal)} than this run's ({parts}); use the same settings as "
            "the saved run or another checkpoint directory",
            step=step, directory=directory, differences=fatal)
    return {s: d for s, d in differences.items() if s not in must_match} | {
        s: f for s, d in differences.items() if s in must_match
        and (f := {k: v for k, v in d.items() if k in COMPUTE_KEYS})}  # layout: silent

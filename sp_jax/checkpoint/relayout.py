"""Restoring a checkpoint whose layers are stored in another form than the target's.

A GPT stores its blocks unrolled (``GPTConfig(scan_layers=False)``: ``blocks/<i>/...``, one
entry per layer) or stacked (``scan_layers=True``, what a STAGE mesh needs:
``blocks/...`` ``[L, ...]``, with ``num_dense_layers`` the dense layers apart in
``dense_blocks/...`` ``[k, ...]`` and the rest in ``blocks/...`` ``[L - k, ...]``; a
circular pipeline (``pipeline_repeats = R > 1``) keeps ``[R, L / R, ...]``, still in
layer order). The values are the same, so a checkpoint of one form restores into any
other: :func:`plan` maps each target leaf to the saved leaves that hold it (a layer of a
saved stack, the saved layers to stack, or a saved stack whose layer dimensions have
another shape: ``[L, ...]`` against ``[R, L / R, ...]``, or other repeats), the arrays
are read in their saved form (sharded as the target's layers are, the layer dimensions
whole) and verified, and :func:`assemble` slices, stacks or reshapes them into the
target's form and sharding. The optimizer state mirrors the parameters
(``0/mu/blocks/...``) and the FP8 amax histories are per layer too
(``blocks/.../fp8_history`` ``[L, 3, n]``), so they convert the same way.

:data:`LAYOUT_KEYS` are the model settings that only choose the form: a checkpoint's
``"model"`` metadata may differ from the current run's in them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["LAYOUT_KEYS", "Source", "assemble", "plan", "read_target", "saved_as_target"]

LAYOUT_KEYS = frozenset({"scan_layers"})
"""Model metadata keys that change how the layers are stored, not their values: a resume
across them converts the arrays (:func:`plan`) instead of refusing."""

_STACKS = ("dense_blocks", "blocks")  # a scanned model's stacks, in layer order


class Source(NamedTuple):
    """Where a target leaf's value is in the checkpoint.

    Attributes:
      paths: the saved leaves: one (a leaf of the same form, or a stack holding the
        layer) or one per layer of a stacked target (unrolled saved layers, in order).
      layer: with one stacked saved leaf for an unrolled target, the layer's index in
        that stack (flattened over its leading layer dimensions); None otherwise.
      lead: how many leading dimensions of the stacked side count layers (of the
        target's stack where both sides are stacks).
      saved_lead: where both are stacks whose layer dimensions differ in shape (``[L,
        ...]`` saved, ``[R, L / R, ...]`` now, or back), how many leading dimensions of
        the saved stack count layers; 0 otherwise.
    """

    paths: tuple[str, ...]
    layer: int | None = None
    lead: int = 0
    saved_lead: int = 0


def _split(path: str) -> tuple[str, str, int | None, str] | None:
    """``(prefix, stack, index, rest)`` of a layer leaf's path: ``P/blocks/<i>/R`` (an
    unrolled layer, index ``i``) or ``P/<stack>/R`` (a stack, index None); None for a
    leaf outside the layers."""
    parts = path.split("/")
    for k, part in enumerate(parts):
        if part in _STACKS:
            prefix, tail = "/".join(parts[:k]), parts[k + 1:]
            if part == "blocks" and tail and tail[0].isdigit():
                return prefix, part, int(tail[0]), "/".join(tail[1:])
            return prefix, part, None, "/".join(tail)
    return None


def _join(*parts: Any) -> str:
    return "/".join(str(p) for p in parts if p != "")


def _layers(shape: tuple[int, ...], per_layer: tuple[int, ...]) -> tuple[int, int] | None:
    """``(leading dimensions, layers)`` of a stack of ``shape`` whose layers have the
    shape ``per_layer``; None when it is no such stack."""
    lead = len(shape) - len(per_layer)
    if lead < 1 or tuple(shape[lead:]) != tuple(per_layer):
        return None
    return lead, math.prod(shape[:lead])


def _restacked(path: str, saved: Any, target: Any) -> Source | None:
    """The source of a stacked target leaf whose saved stack (same path) holds the same
    layers under leading layer dimensions of another shape (``[L, ...]`` and ``[R, L /
    R, ...]``, or two repeats): the per-layer shape is the longest common trailing
    shape (the innermost layer dimensions of two such stacks differ: ``L / R``); None
    for a leaf outside the stacks, of the same shape, or of other layers."""
    where = _split(path)
    a, b = tuple(saved.shape), tuple(target.shape)
    if where is None or where[2] is not None or a == b:
        return None
    common = 0
    while common < min(len(a), len(b)) and a[len(a) - 1 - common] == b[len(b) - 1 - common]:
        common += 1
    la, lb = len(a) - common, len(b) - common
    if not la or not lb or math.prod(a[:la]) != math.prod(b[:lb]):
        return None
    return Source((path,), None, lb, la)


def plan(saved: Mapping[str, Any], target: Mapping[str, Any]) -> dict[str, Source] | None:
    """For each target leaf (``{path: leaf}``, as :func:`~.metadata.flatten` names them)
    the saved leaves (``{path: leaf with .shape}``) that hold its value, where the two
    store the layers in different forms (unrolled, stacked ``[L, ...]``, stacked by
    pipeline repeats ``[R, L / R, ...]``) and every other leaf alike; None where they
    are alike already, or differ otherwise (the caller's checks then name the
    mismatch)."""
    dense: dict[str, int] = {}  # prefix -> the dense layers stacked apart (either side)
    for side, other in ((saved, target), (target, saved)):
        layer0 = {(w[0], w[3]): leaf for p, leaf in other.items()
                  if (w := _split(p)) and w[2] == 0}
        for path, leaf in side.items():
            where = _split(path)
            if where and where[1] == "dense_blocks" and (where[0], where[3]) in layer0:
                found = _layers(tuple(leaf.shape), tuple(layer0[where[0], where[3]].shape))
                if found:
                    dense[where[0]] = found[1]
    sources: dict[str, Source] = {}
    for path, leaf in target.items():
        if path in saved:
            sources[path] = _restacked(path, saved[path], leaf) or Source((path,))
            continue
        where = _split(path)
        if where is None:
            return None
        prefix, stack, index, rest = where
        k = dense.get(prefix, 0)
        if index is not None:  # an unrolled target layer from a saved stack
            name, layer = ("dense_blocks", index) if index < k else ("blocks", index - k)
            source = _join(prefix, name, rest)
            found = source in saved and _layers(tuple(saved[source].shape), tuple(leaf.shape))
            if not found or layer >= found[1]:
                return None
            sources[path] = Source((source,), layer, found[0])
            continue
        first = k if stack == "blocks" else 0  # a stacked target from saved layers
        one = saved.get(_join(prefix, "blocks", first, rest))
        found = one is not None and _layers(tuple(leaf.shape), tuple(one.shape))
        paths = tuple(_join(prefix, "blocks", first + m, rest) for m in range(found[1])) \
            if found else ()
        if not found or not all(p in saved for p in paths):
            return None
        sources[path] = Source(paths, None, found[0])
    used = {p for s in sources.values() for p in s.paths}
    converts = any(s != Source((p,)) for p, s in sources.items())
    return sources if converts and used == set(saved) else None


def _spec(sharding: Any, add: int, drop: int) -> Any:
    """``sharding`` with its first ``drop`` dimensions left out and ``add`` whole leading
    dimensions put in their place, in device memory (where it is sliced, stacked or
    reshaped; a leaf read as it is, ``add = drop = 0``, and a non-named sharding: as it
    is, host memory included)."""
    if not isinstance(sharding, jax.sharding.NamedSharding) or not add and not drop:
        return sharding
    spec = (None,) * add + tuple(sharding.spec)[drop:]
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def read_target(sources: Mapping[str, Source], saved: Mapping[str, Any],
                target: Mapping[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """``{saved path: ShapeDtypeStruct}`` to read each saved leaf into: its saved shape
    and dtype, sharded as the target leaf it feeds (a stack's layer dimensions whole)."""
    out = {}
    for path, source in sources.items():
        t = target[path]
        for p in source.paths:
            sharding = (_spec(t.sharding, source.lead, 0) if source.layer is not None
                        else _spec(t.sharding, source.saved_lead, source.lead))
            out[p] = jax.ShapeDtypeStruct(tuple(saved[p].shape), saved[p].dtype,
                                          sharding=sharding)
    return out


def saved_as_target(sources: Mapping[str, Source], saved: Mapping[str, Any],
                    target: Mapping[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """``{target path: ShapeDtypeStruct}``: what the checkpoint holds in the target's
    form (its shapes, the saved dtypes; a leaf read as it is keeps its saved shape), for
    the shape and dtype checks."""
    return {path: jax.ShapeDtypeStruct(
        tuple((saved[path] if source == Source((path,)) else target[path]).shape),
        saved[source.paths[0]].dtype) for path, source in sources.items()}


def assemble(sources: Mapping[str, Source], read: Mapping[str, jax.Array],
             target: Mapping[str, Any]) -> dict[str, jax.Array]:
    """The target leaves (``{path: array}`` in the target's shapes and shardings, the
    saved dtypes) from the saved arrays ``read`` (``{saved path: array}``)."""
    out = {}
    for path, source in sources.items():
        t = target[path]
        if source.layer is not None:  # one layer of a saved stack
            x = _reshape(read[source.paths[0]], (-1, *t.shape), _spec(t.sharding, 1, 0))
            x = x[source.layer]
        elif source.lead:  # the saved layers stacked, or the saved stack re-shaped
            x = _reshape(jnp.stack([read[p] for p in source.paths]), t.shape,
                         _spec(t.sharding, source.lead, source.lead))
        else:
            out[path] = read[source.paths[0]]
            continue
        out[path] = jax.device_put(x, t.sharding)
    return out


def _reshape(x: jax.Array, shape: tuple[int, ...], sharding: Any) -> jax.Array:
    """``x`` (its layer dimensions whole) with its layer dimensions merged or split into
    ``shape``'s, the result sharded as ``sharding`` (those dimensions whole too): under
    a mesh of explicit axes JAX refuses a reshape that merges or splits dimensions
    unless it is told the result's sharding."""
    named = isinstance(sharding, jax.sharding.NamedSharding)
    return jnp.reshape(x, shape, out_sharding=sharding if named else None)

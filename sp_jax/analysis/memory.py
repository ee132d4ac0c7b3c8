"""Activation memory: what ``jax.vjp`` keeps alive between forward and backward."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Residual:
    """One array saved for the backward pass.

    Attributes:
      shape: global shape.
      device_shape: shape of the block one device holds.
      dtype: element type.
      device_bytes: bytes one device holds (the largest block where blocks differ).
      source: where JAX says the residual comes from (the operation that produced it),
        when it can tell; else empty.
    """

    shape: tuple[int, ...]
    device_shape: tuple[int, ...]
    dtype: np.dtype
    device_bytes: int
    source: str = ""


def _device_shape(x: Any) -> tuple[int, ...]:
    sharding = getattr(x, "sharding", None)
    if sharding is None or not hasattr(sharding, "shard_shape"):
        return tuple(x.shape)
    return tuple(sharding.shard_shape(x.shape))


def _sources(fn: Callable[..., Any], args: tuple) -> list[tuple[tuple, str]]:
    """(shape, source) per residual from JAX's own residual listing, when available."""
    try:  # the listing behind jax.ad_checkpoint.print_saved_residuals
        from jax._src.ad_checkpoint import saved_residuals as _jax_saved_residuals

        return [(tuple(aval.shape), src) for aval, src in _jax_saved_residuals(fn, *args)]
    except Exception:  # noqa: BLE001 - a private helper; the breakdown is optional
        return []


def saved_residuals(fn: Callable[..., Any], *args: Any) -> list[Residual]:
    """The residual arrays ``jax.vjp(fn, *args)`` keeps for the backward pass.

    Evaluated abstractly (``jax.eval_shape`` of the VJP function: nothing is computed, so
    realistic model sizes are cheap). The residuals carry their shardings, so
    ``device_bytes`` is what one device holds on an Explicit mesh (on an Auto mesh
    shardings are not part of the types and whole arrays are counted). Call it under the
    mesh ``fn`` runs on (``jax.set_mesh``).
    """
    vjp_fn = jax.eval_shape(lambda *a: jax.vjp(fn, *a)[1], *args)
    leaves = [x for x in jax.tree.leaves(vjp_fn) if hasattr(x, "shape") and hasattr(x, "dtype")]
    sources = _sources(fn, args)
    if [shape for shape, _ in sources] != [tuple(x.shape) for x in leaves]:
        sources = [((), "")] * len(leaves)
    out = []
    for leaf, (_, source) in zip(leaves, sources, strict=True):
        device_shape = _device_shape(leaf)
        dtype = np.dtype(leaf.dtype)
        out.append(
            Residual(
                shape=tuple(leaf.shape),
                device_shape=device_shape,
                dtype=dtype,
                device_bytes=math.prod(device_shape) * dtype.itemsize,
                source=source,
            )
        )
    return out


class SavedBytes(int):
    """Per-device bytes saved for backward (an ``int``), with the breakdown.

    Attributes:
      residuals: the :class:`Residual` s behind the total.
      by_source: bytes per source (JAX's note on the producing operation; residuals it
        cannot attribute are grouped under ``"unattributed"``), largest first.
    """

    residuals: list[Residual]
    by_source: dict[str, int]

    def __new__(cls, residuals: list[Residual]) -> SavedBytes:
        obj = super().__new__(cls, sum(r.device_bytes for r in residuals))
        obj.residuals = residuals
        totals: dict[str, int] = {}
        for r in residuals:
            key = r.source or "unattributed"
            totals[key] = totals.get(key, 0) + r.device_bytes
        obj.by_source = dict(sorted(totals.items(), key=lambda kv: -kv[1]))
        return obj


def saved_activation_bytes(fn: Callable[..., Any], *args: Any) -> SavedBytes:
    """Per-device bytes of all residuals ``jax.vjp(fn, *args)`` saves (see
    :func:`saved_residuals`), as an ``int`` that also carries ``.residuals`` and the
    breakdown ``.by_source``."""
    return SavedBytes(saved_residuals(fn, *args))

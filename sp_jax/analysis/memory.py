"""Activation memory: what ``jax.vjp`` keeps alive between forward and backward."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

__all__ = ["Residual", "SavedBytes", "saved_activation_bytes", "saved_residuals"]

_Listing = list[tuple[tuple[int, ...], str, str]]  # (shape, dtype, source) per residual


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


def _jax_sources(fn: Callable[..., Any], args: tuple) -> _Listing:
    """(shape, dtype, source) per residual from JAX's own residual listing, when available."""
    try:  # the listing behind jax.ad_checkpoint.print_saved_residuals (a private helper)
        from jax._src.ad_checkpoint import saved_residuals as _jax_saved_residuals

        return [(tuple(aval.shape), str(aval.dtype), src)
                for aval, src in _jax_saved_residuals(fn, *args)]
    except Exception:  # noqa: BLE001 - only the optional source column depends on it
        return []


def _match_sources(leaves: list[Any], listing: _Listing) -> list[str]:
    """JAX's source string for each residual in ``leaves`` ("" where none matches).

    JAX's listing may order residuals differently and reports ``shard_map`` residuals with
    per-device shapes: equal (shape, dtype) are matched first, then the rest in order by
    dtype.
    """
    out: list[str | None] = [None] * len(leaves)
    used = [False] * len(listing)
    for exact in (True, False):
        for i, leaf in enumerate(leaves):
            if out[i] is not None:
                continue
            for j, (shape, dtype, src) in enumerate(listing):
                if used[j] or dtype != str(leaf.dtype):
                    continue
                if exact and shape != tuple(leaf.shape):
                    continue
                out[i], used[j] = src, True
                break
    return [s or "" for s in out]


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
    sources = _match_sources(leaves, _jax_sources(fn, args))
    out = []
    for leaf, source in zip(leaves, sources, strict=True):
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

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
    """

    shape: tuple[int, ...]
    device_shape: tuple[int, ...]
    dtype: np.dtype
    device_bytes: int


def _device_shape(x: jax.Array) -> tuple[int, ...]:
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return tuple(x.shape)
    return tuple(sharding.shard_shape(x.shape))


def saved_residuals(fn: Callable[..., Any], *args: Any) -> list[Residual]:
    """Runs ``jax.vjp(fn, *args)`` and lists the residual arrays it keeps for backward.

    The residuals are the leaves of the returned VJP function: real arrays with their
    real shardings, so ``device_bytes`` is what one device holds. Call it under the mesh
    the function runs on (``jax.set_mesh``); ``fn`` runs eagerly (op by op).
    """
    _, vjp_fn = jax.vjp(fn, *args)
    out = []
    for leaf in jax.tree.leaves(vjp_fn):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            continue
        device_shape = _device_shape(leaf)
        dtype = np.dtype(leaf.dtype)
        out.append(
            Residual(
                shape=tuple(leaf.shape),
                device_shape=device_shape,
                dtype=dtype,
                device_bytes=math.prod(device_shape) * dtype.itemsize,
            )
        )
    return out


def saved_activation_bytes(fn: Callable[..., Any], *args: Any) -> int:
    """Per-device bytes of all residuals ``jax.vjp(fn, *args)`` saves (see
    :func:`saved_residuals`)."""
    return sum(r.device_bytes for r in saved_residuals(fn, *args))

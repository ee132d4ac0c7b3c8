"""Optimizer state and master weights in host memory between steps (ZeRO-Offload's
placement, MaxText's ``optimizer_memory_host_offload`` / ``parameter_memory_host_offload``).

:class:`~sp_jax.training.TrainStep` with ``offload_optimizer=True`` keeps the optimizer
state's arrays in ``pinned_host`` memory (their shardings ``with_memory_kind
("pinned_host")``); the jitted step moves each leaf to device memory where the update
needs it (one ``jax.device_put`` per leaf, :func:`sp_jax.ops.primitives.to_device`) and
the new state back (:func:`~sp_jax.ops.primitives.to_host`), so XLA sees one transfer per
array and may schedule each next to its use. ``offload_params=True`` does the same for
the fp32 master weights, the forward and backward running on a copy in the model's
compute dtype (:func:`compute_copy`).

A backend without host memory (no ``pinned_host`` among the device's memory kinds) is
refused with a ``ValueError`` naming it (:func:`sp_jax.mesh.require_host_memory`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["HOST", "compute_copy", "on_host"]

HOST = "pinned_host"
"""The memory kind offloaded arrays live in between steps."""


def _host_sharding(x: Any) -> Any:
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, jax.sharding.Sharding):
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return sharding.with_memory_kind(HOST)


def on_host(tree: Any) -> Any:
    """``tree``'s arrays moved to ``pinned_host`` memory, keeping their shardings."""
    return jax.tree.map(lambda x: jax.device_put(x, _host_sharding(x)), tree)


def compute_copy(params: Any, dtype: Any) -> Any:
    """The floating leaves of ``params`` cast to ``dtype`` (None: unchanged), the copy
    the forward and backward of an ``offload_params`` step run on."""
    if dtype is None:
        return params
    return jax.tree.map(
        lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, params)

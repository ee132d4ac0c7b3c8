"""The order the model holds a sequence in: the one place that owns ring attention's
zigzag order.

With ring context parallelism over ``c > 1`` devices the model holds the sequence in the
zigzag order (:func:`zigzag_order`): the sequence is cut into ``2c`` chunks and device
``r`` holds chunks ``r`` and ``2c - 1 - r``, so every device has as many early (cheap) as
late (expensive) causal queries. Everything that depends on a position follows from here:
the held order of a model's inputs (:func:`sequence_order`, :func:`to_held`), the global
positions of a device's rows inside the kernels (:func:`zigzag_positions`,
:func:`local_positions`: rotary angles, dropout masks), and the way back
(:func:`to_natural`). Other layouts hold the natural order (``None``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sp_jax.config import ParallelConfig
from sp_jax.layout import Layout
from sp_jax.mesh import Mesh, axis_size, current_mesh, reshard

__all__ = ["local_positions", "sequence_order", "to_held", "to_natural", "zigzag_inverse",
           "zigzag_order", "zigzag_positions"]


def zigzag_order(seq_len: int, context: int) -> np.ndarray:
    """The zigzag permutation of a sequence for :func:`ring_attention` over ``context``
    devices.

    The sequence is cut into ``2 * context`` chunks of ``n = seq_len / (2 * context)``
    positions; device ``r`` gets chunk ``r`` followed by chunk ``2 * context - 1 - r``, so
    every device holds as many early (cheap) as late (expensive) causal queries.

    Args:
      seq_len: the global sequence length, divisible by ``2 * context``.
      context: the size of the context mesh axis.
    Returns:
      int array ``perm`` of shape ``[seq_len]``, permuted position -> original position:
      ``x_zigzag = x[:, perm]`` is the sequence to shard contiguously over the context
      axis (``P(None, context)``). Its inverse is :func:`zigzag_inverse`
      (``np.argsort(perm)``): ``x = x_zigzag[:, zigzag_inverse(seq_len, context)]``.
    """
    seq_len, context = int(seq_len), int(context)
    if context < 1:
        raise ValueError(f"context={context} must be a positive number of devices.")
    if seq_len < 1 or seq_len % (2 * context):
        raise ValueError(
            f"zigzag_order: seq_len={seq_len} must be a positive multiple of 2 * context = "
            f"{2 * context} (context={context}); pad the sequence to a multiple of "
            f"{2 * context}."
        )
    n = seq_len // (2 * context)
    chunks = np.arange(seq_len).reshape(2 * context, n)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * context - 1 - r]])
                           for r in range(context)])


def zigzag_inverse(seq_len: int, context: int) -> np.ndarray:
    """The inverse of :func:`zigzag_order` (original position -> permuted position):
    ``x = x_zigzag[:, zigzag_inverse(seq_len, context)]``."""
    return np.argsort(zigzag_order(seq_len, context))


def zigzag_positions(r, c: int, n: int) -> jax.Array:
    """Global positions of device ``r``'s zigzag rows (traced ``r`` allowed): chunks ``r``
    and ``2c - 1 - r`` of ``n`` positions each, ``[2n]`` int32."""
    return jnp.concatenate([r * n + jnp.arange(n), (2 * c - 1 - r) * n + jnp.arange(n)])


def sequence_order(parallel: ParallelConfig, mesh: Mesh, seq_len: int) -> np.ndarray | None:
    """The order in which the model holds the sequence: ``None`` (the natural order), or,
    with ring context parallelism over ``c > 1`` devices, the zigzag order
    (:func:`zigzag_order`: position ``i`` of the held sequence is position ``order[i]`` of
    the input), which gives every device an equal share of the causal attention work.
    Raises a ValueError when the sequence cannot be split so."""
    if parallel.context_parallel != "ring":
        return None
    c = axis_size(mesh, parallel.context_axis)
    if c == 1:
        return None
    if seq_len % (2 * c):
        raise ValueError(
            f"ring context parallelism over {c} devices splits the sequence into {2 * c} "
            f"chunks (zigzag order), but sequence length={seq_len} is not divisible by "
            f"{2 * c}; pad the sequence.")
    return zigzag_order(seq_len, c)


def local_positions(parallel: ParallelConfig, order: np.ndarray | None, s_local: int
                    ) -> jax.Array:
    """Per device (inside ``shard_map``): the global positions of this device's
    ``s_local`` rows of a sequence held in ``order`` and sharded over the context axis
    (the whole sequence ``0 .. s_local - 1`` without one)."""
    if not parallel.context_axes:
        return jnp.arange(s_local)
    start = lax.axis_index(parallel.context_axis) * s_local
    held = jnp.arange(s_local * lax.axis_size(parallel.context_axis)) if order is None \
        else jnp.asarray(order)
    return lax.dynamic_slice_in_dim(held, start, s_local)


def _permute(x: jax.Array, perm: np.ndarray, parallel: ParallelConfig, feature: str | None
             ) -> jax.Array:
    """``x [batch, seq, ...]`` with its sequence gathered (batch still over the data axes,
    the third dimension's logical axis ``feature``) and permuted by ``perm``."""
    mesh = current_mesh(parallel, where="sequence order")
    trailing = [feature] + [None] * (x.ndim - 3) if x.ndim > 2 else []
    whole = Layout.of(parallel).spec("activation_batch", None, *trailing)
    return jnp.take(reshard(jnp.asarray(x), whole, mesh), jnp.asarray(perm), axis=1)


def to_held(x: jax.Array, order: np.ndarray | None, parallel: ParallelConfig,
            feature: str | None = None) -> jax.Array:
    """A global ``x [batch, seq, ...]`` in the natural order, in the held ``order`` (as
    is when ``order`` is None). ``feature``: the logical axis of a third dimension
    (e.g. ``"activation_vocab"``); the result is sharded over the batch only (callers
    reshard it to their layout)."""
    return x if order is None else _permute(x, order, parallel, feature)


def to_natural(x: jax.Array, order: np.ndarray | None, parallel: ParallelConfig,
               feature: str | None = None) -> jax.Array:
    """The inverse of :func:`to_held`: ``x`` held in ``order``, in the natural order."""
    return x if order is None else _permute(x, np.argsort(order), parallel, feature)

"""Dropout whose mask does not depend on the sharding (Flax NNX)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from sp_jax.attention.sequence_order import sequence_order, to_held
from sp_jax.config import ParallelConfig
from sp_jax.layout import Layout
from sp_jax.mesh import axis_size, current_mesh, reshard, to_sequence_parallel

__all__ = ["Dropout"]


class Dropout(nnx.Dropout):
    """:class:`flax.nnx.Dropout` whose mask does not depend on the sharding.

    Same arguments as ``nnx.Dropout`` plus ``parallel`` (the
    :class:`~sp_jax.ParallelConfig`). The mask is drawn with ``out_sharding`` equal to the
    input's (SP) sharding: each device generates only its own block, and, keys being
    partitionable, the values equal the unsharded draw (Megatron and Paddle seed each rank
    separately and cannot reproduce the unsharded model's dropout). When the model holds
    the sequence in another order (ring context parallelism's zigzag order,
    :func:`~sp_jax.attention.sequence_order`), the mask is drawn in the natural order and
    permuted like the activations, so it still equals the unsharded model's at every
    (batch, position, feature).
    """

    def __init__(self, rate: float, *, parallel: ParallelConfig = ParallelConfig(),
                 **kwargs: Any):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"Dropout: rate={rate} must be in [0, 1].")
        super().__init__(rate, **kwargs)
        self.parallel = parallel

    def __call__(self, inputs: jax.Array, *, deterministic: bool | None = None,
                 rngs: Any = None) -> jax.Array:
        active = self.rate and not (deterministic if deterministic is not None
                                    else self.deterministic)
        if not active:
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        inputs = to_sequence_parallel(inputs, self.parallel, where="Dropout")
        order = None
        if inputs.ndim == 3:
            order = sequence_order(self.parallel, current_mesh(self.parallel, where="Dropout"),
                                   inputs.shape[1])
        manual = self.parallel.manual_data_axes and inputs.ndim >= 1
        if (order is None and not manual) or self.rate == 1.0 or self.broadcast_dims:
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        return self._drawn(inputs, order, rngs)

    def _drawn(self, inputs: jax.Array, order: np.ndarray | None, rngs: Any) -> jax.Array:
        """Dropout with the mask of the natural order, permuted to ``order``, and of the
        whole batch when the data axes are manual (``ParallelConfig.manual_data_axes``:
        this device keeps its rows of it)."""
        stream = rngs if rngs is not None else self.rngs
        if isinstance(stream, nnx.Rngs):
            key = stream[self.rng_collection]()
        elif isinstance(stream, nnx.RngStream):
            key = stream()
        else:
            key = stream
        keep = 1.0 - self.rate
        sharding = jax.typeof(inputs).sharding
        mesh = current_mesh(self.parallel, where="Dropout")
        manual = self.parallel.manual_data_axes
        rows = inputs.shape[0]
        shape = (rows * axis_size(mesh, manual), *inputs.shape[1:]) if manual else inputs.shape
        mask = jax.random.bernoulli(key, p=keep, shape=shape, out_sharding=sharding)
        if order is not None:
            mask = reshard(to_held(mask, order, self.parallel), Layout.of(self.parallel).sp,
                           mesh)
        if manual:
            mask = lax.dynamic_slice_in_dim(mask, lax.axis_index(manual) * rows, rows, 0)
        return lax.select(mask, inputs / keep, jnp.zeros_like(inputs))


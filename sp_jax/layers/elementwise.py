"""Norms and dropout on sequence-sharded activations (the layers outside the TP region).

In a sequence-parallel region every device holds ``[batch, seq / t, hidden]``. These
layers are :mod:`flax.nnx` layers with the same parameters, whose input is placed in the
SP layout ``P(data, tensor, None)`` first, so each device normalises / masks only its own
tokens:

- :class:`LayerNorm`, :class:`RMSNorm`: the scale/bias are replicated. Their gradient is
  a sum over every token of every device; JAX inserts that all-reduce itself (the
  transpose of broadcasting a replicated parameter over sharded activations), which is
  what Paddle does by hand with ``register_sequence_parallel_allreduce_hooks``.
- :class:`Dropout`: the mask is drawn with the input's sharding from a partitionable
  (threefry) key, so the mask at every ``(batch, position, feature)`` equals the one the
  unsharded model draws from the same key, whatever the mesh. Megatron and Paddle seed
  each rank separately and cannot reproduce the unsharded model's dropout.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from sp_jax.config import ParallelConfig
from sp_jax.layers._sharding import current_mesh, data_spec, reshard

__all__ = ["LayerNorm", "RMSNorm", "Dropout", "to_sequence_parallel"]


def to_sequence_parallel(x: jax.Array, config: ParallelConfig, *, where: str) -> jax.Array:
    """Places ``[batch, seq, hidden]`` ``x`` in the SP layout ``P(data, tensor, None)``.

    A sequence not divisible by the tensor size is left as it is (GSPMD then chooses).
    """
    mesh = current_mesh(config, where=where)
    if x.ndim != 3 or x.shape[1] % mesh.shape[config.tensor_axis]:
        return x
    if config.data_axes and x.shape[0] % mesh.shape[config.data_axes[0]]:
        return x
    return reshard(x, P(data_spec(config), config.tensor_axis, None), mesh)


class LayerNorm(nnx.LayerNorm):
    """:class:`flax.nnx.LayerNorm` over the last axis of SP-sharded activations.

    Same arguments as ``nnx.LayerNorm`` plus ``config``; parameters ``scale`` / ``bias``
    ``[num_features]``, replicated.
    """

    def __init__(self, num_features: int, *, config: ParallelConfig = ParallelConfig(),
                 **kwargs: Any):
        super().__init__(num_features, **kwargs)
        self.config = config

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        x = to_sequence_parallel(x, self.config, where="LayerNorm")
        return super().__call__(x, mask=mask)


class RMSNorm(nnx.RMSNorm):
    """:class:`flax.nnx.RMSNorm` over the last axis of SP-sharded activations.

    Same arguments as ``nnx.RMSNorm`` plus ``config``; parameter ``scale``
    ``[num_features]``, replicated.
    """

    def __init__(self, num_features: int, *, config: ParallelConfig = ParallelConfig(),
                 **kwargs: Any):
        super().__init__(num_features, **kwargs)
        self.config = config

    def __call__(self, x: jax.Array, mask: jax.Array | None = None) -> jax.Array:
        x = to_sequence_parallel(x, self.config, where="RMSNorm")
        return super().__call__(x, mask=mask)


class Dropout(nnx.Dropout):
    """:class:`flax.nnx.Dropout` whose mask does not depend on the sharding.

    Same arguments as ``nnx.Dropout`` plus ``config``. The mask is drawn with
    ``out_sharding`` equal to the input's (SP) sharding: each device generates only its
    own block, and, keys being partitionable, the values equal the unsharded draw.
    """

    def __init__(self, rate: float, *, config: ParallelConfig = ParallelConfig(),
                 **kwargs: Any):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"Dropout: rate={rate} must be in [0, 1].")
        super().__init__(rate, **kwargs)
        self.config = config

    def __call__(self, inputs: jax.Array, *, deterministic: bool | None = None,
                 rngs: Any = None) -> jax.Array:
        if self.rate and not (deterministic if deterministic is not None
                              else self.deterministic):
            inputs = to_sequence_parallel(inputs, self.config, where="Dropout")
        return super().__call__(inputs, deterministic=deterministic, rngs=rngs)

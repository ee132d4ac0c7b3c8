"""sp_jax: Megatron-style tensor and sequence parallelism for JAX / Flax NNX."""

from sp_jax import ops
from sp_jax.config import ParallelConfig
from sp_jax.layers import (
    ColumnParallelLinear,
    ColumnSequenceParallelLinear,
    RowParallelLinear,
    RowSequenceParallelLinear,
)

__version__ = "0.1.0"

__all__ = [
    "ParallelConfig",
    "ops",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ColumnSequenceParallelLinear",
    "RowSequenceParallelLinear",
]

"""sp_jax: Megatron-style tensor and sequence parallelism for JAX / Flax NNX."""

from sp_jax import checkpoint, ops, xla_flags
from sp_jax.config import ParallelConfig
from sp_jax.layers import (
    MLP,
    CausalSelfAttention,
    ColumnParallelLinear,
    ColumnSequenceParallelLinear,
    Dropout,
    LayerNorm,
    RMSNorm,
    RowParallelLinear,
    RowSequenceParallelLinear,
    VocabParallelEmbedding,
    padded_vocab_size,
    parallel_cross_entropy,
)

__version__ = "0.1.0"

__all__ = [
    "ParallelConfig",
    "checkpoint",
    "ops",
    "xla_flags",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ColumnSequenceParallelLinear",
    "RowSequenceParallelLinear",
    "VocabParallelEmbedding",
    "padded_vocab_size",
    "parallel_cross_entropy",
    "LayerNorm",
    "RMSNorm",
    "Dropout",
    "CausalSelfAttention",
    "MLP",
]

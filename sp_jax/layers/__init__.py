"""Flax NNX parallel layers on global arrays."""

from sp_jax.layers.cross_entropy import parallel_cross_entropy
from sp_jax.layers.elementwise import Dropout, LayerNorm, RMSNorm, to_sequence_parallel
from sp_jax.layers.embedding import VocabParallelEmbedding, padded_vocab_size
from sp_jax.layers.linear import (
    ColumnParallelLinear,
    ColumnSequenceParallelLinear,
    RowParallelLinear,
    RowSequenceParallelLinear,
)
from sp_jax.layers.transformer import MLP, CausalSelfAttention, rotary_embedding

__all__ = [
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
    "to_sequence_parallel",
    "CausalSelfAttention",
    "MLP",
    "rotary_embedding",
]

"""Flax NNX parallel layers on global arrays."""

from sp_jax.layers.cross_entropy import parallel_cross_entropy
from sp_jax.layers.elementwise import (
    NORMS,
    Dropout,
    LayerNorm,
    RMSNorm,
    layer_norm,
    make_norm,
    rms_norm,
    to_sequence_parallel,
)
from sp_jax.layers.embedding import VocabParallelEmbedding, padded_vocab_size
from sp_jax.layers.linear import (
    ColumnParallelLinear,
    ColumnSequenceParallelLinear,
    RowParallelLinear,
    RowSequenceParallelLinear,
)
from sp_jax.layers.transformer import (
    MLP,
    CausalSelfAttention,
    GroupedQKVProjection,
    RopeScaling,
    causal_attention,
    kv_heads_per_shard,
    rope_frequencies,
    rotary_embedding,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ColumnSequenceParallelLinear",
    "RowSequenceParallelLinear",
    "VocabParallelEmbedding",
    "padded_vocab_size",
    "parallel_cross_entropy",
    "NORMS",
    "LayerNorm",
    "RMSNorm",
    "layer_norm",
    "rms_norm",
    "make_norm",
    "Dropout",
    "to_sequence_parallel",
    "CausalSelfAttention",
    "GroupedQKVProjection",
    "MLP",
    "RopeScaling",
    "causal_attention",
    "kv_heads_per_shard",
    "rope_frequencies",
    "rotary_embedding",
]

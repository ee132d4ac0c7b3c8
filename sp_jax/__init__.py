"""sp_jax: Megatron-style tensor and sequence parallelism for JAX / Flax NNX.

Subpackages and modules, bottom to top: ``config`` (:class:`ParallelConfig`), ``layout``
(the logical-axis table and PartitionSpecs), ``ops`` (per-device collectives with their
VJPs), ``attention`` (blockwise, ring and Ulysses attention kernels), ``layers`` (NNX
modules on global arrays), ``models`` (GPT), ``data`` (a byte corpus and batches
assembled across processes), ``training`` (the jitted step, schedule, multi-process
launch, metrics log), ``checkpoint`` (orbax across meshes); beside them ``analysis``
(measurement) and ``xla_flags`` (XLA GPU overlap flags).
"""

from sp_jax import (
    analysis,
    attention,
    checkpoint,
    data,
    layers,
    layout,
    models,
    ops,
    training,
    xla_flags,
)
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
from sp_jax.layout import Layout

__version__ = "0.1.0"

__all__ = [
    "ParallelConfig",
    "Layout",
    "analysis",
    "attention",
    "checkpoint",
    "data",
    "layers",
    "layout",
    "models",
    "ops",
    "training",
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

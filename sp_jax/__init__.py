"""sp_jax: Megatron-style tensor and sequence parallelism for JAX / Flax NNX.

Modules, bottom to top: ``config`` (:class:`ParallelConfig`), ``layout`` (the logical-axis
table and PartitionSpecs), ``mesh`` (the current mesh, size checks, resharding), ``ring``
(bidirectional ring schedules), ``ops`` (per-device collectives with their VJPs),
``attention`` (blockwise, ring and Ulysses attention kernels; the zigzag sequence order),
``layers`` (NNX modules on global arrays), ``pipeline`` (pipeline schedules and their
SPMD tick loops), ``models`` (GPT; ``models.hf``: Hugging Face
checkpoints), ``training`` (the jitted step, the trainer, schedule, launch, faults,
metrics log), ``data`` (token corpora and global batches), ``checkpoint`` (orbax across
meshes, with integrity checks); beside them ``xla_flags`` (XLA GPU overlap flags) and
``analysis`` (measurement: loaded on first use of ``sp_jax.analysis``, never by
``import sp_jax``).
"""

import importlib
import warnings
from typing import Any

from sp_jax._quiet import quiet_import_jax

# `python -m sp_jax.compat` (the table of what combines) runs a module that `import sp_jax`
# has loaded already (every refusal asks it); runpy's warning about that is noise here.
warnings.filterwarnings("ignore", message="'sp_jax.compat' found in sys.modules",
                        category=RuntimeWarning)

quiet_import_jax()  # before JAX starts: no CUDA-plugin noise on machines without a GPU

from sp_jax import (  # noqa: E402
    attention,
    checkpoint,
    data,
    layers,
    layout,
    mesh,
    models,
    ops,
    pipeline,
    training,
    xla_flags,
)
from sp_jax.config import Fp8Recipe, LoRAConfig, ParallelConfig  # noqa: E402
from sp_jax.layers import (  # noqa: E402
    MLP,
    AttentionConfig,
    CausalSelfAttention,
    ColumnParallelLinear,
    ColumnSequenceParallelLinear,
    Dropout,
    LayerNorm,
    MLPConfig,
    RMSNorm,
    RowParallelLinear,
    RowSequenceParallelLinear,
    VocabParallelEmbedding,
    padded_vocab_size,
    parallel_cross_entropy,
)
from sp_jax.layout import Layout  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "Fp8Recipe",
    "LoRAConfig",
    "ParallelConfig",
    "Layout",
    "attention",
    "checkpoint",
    "data",
    "layers",
    "layout",
    "mesh",
    "models",
    "pipeline",
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
    "AttentionConfig",
    "CausalSelfAttention",
    "MLPConfig",
    "MLP",
]


def __getattr__(name: str) -> Any:
    """``sp_jax.analysis`` (measurement) is imported on first use only."""
    if name == "analysis":
        return importlib.import_module("sp_jax.analysis")
    raise AttributeError(f"module 'sp_jax' has no attribute {name!r}")

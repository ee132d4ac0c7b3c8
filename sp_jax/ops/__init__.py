"""Per-device collectives and linear ops for tensor and sequence parallelism, each paired
with its VJP (but decoding's forward-only ``decode_matmul``).

Every function works on the *local* (per-device) block of an array and is meant to be
called inside :func:`jax.shard_map` over a mesh that has the named axes. Modules, bottom
to top:

* :mod:`~sp_jax.ops.primitives`: varying-manual-axes typing, tiled collectives, the
  factory of conjugate pairs.
* :mod:`~sp_jax.ops.mappings`: the region mappings (Megatron's ``mappings.py``), named
  ``<forward>_with_<backward>_grad``.
* :mod:`~sp_jax.ops.grouped`: the grouped GEMMs' tile loops (the work of the routed
  rows).
* :mod:`~sp_jax.ops.gemm`: local GEMMs with weight gradients in ``wgrad_dtype``, and
  the GEMM object of the linear rules in the compute dtype (the precision a layer is
  given).
* :mod:`~sp_jax.ops.fp8`: FP8 quantisation with whole-tensor scales, FP8 GEMMs, and the
  GEMM object of the linear rules in FP8 (FP8 gathers and residuals).
* :mod:`~sp_jax.ops.transport`: how the sequence-parallel rules move the sequence: whole
  collectives, or rings of collective-permutes overlapped with chunk GEMMs (collective
  matmul).
* :mod:`~sp_jax.ops.fsdp`: parameters sharded over the data axes, gathered inside the op.
* :mod:`~sp_jax.ops.rules`: one rule per linear op (the experts' grouped GEMMs and the
  single-token product included), forward and backward, the backward as an
  input-gradient and a weight-gradient part, over a GEMM and a transport.
* :mod:`~sp_jax.ops.deferred`: the weight gradients deferred through taps, a stage's
  backward as an input-gradient pass and a weight-gradient pass.
* :mod:`~sp_jax.ops.linear`: the linear ops and the one dispatch to their forms.
"""

from sp_jax.ops.fsdp import fsdp_gather
from sp_jax.ops.linear import (
    add_bias,
    column_parallel_matmul,
    column_sequence_parallel_matmul,
    decode_matmul,
    matmul,
    row_parallel_matmul,
    row_sequence_parallel_matmul,
)
from sp_jax.ops.mappings import (
    all_gather_with_reduce_scatter_grad,
    all_gather_with_split_grad,
    all_reduce_with_identity_grad,
    identity_with_all_reduce_grad,
    reduce_scatter_with_all_gather_grad,
    split_with_all_gather_grad,
)

__all__ = [
    "split_with_all_gather_grad",
    "all_gather_with_split_grad",
    "all_gather_with_reduce_scatter_grad",
    "reduce_scatter_with_all_gather_grad",
    "identity_with_all_reduce_grad",
    "all_reduce_with_identity_grad",
    "matmul",
    "add_bias",
    "column_parallel_matmul",
    "column_sequence_parallel_matmul",
    "row_parallel_matmul",
    "row_sequence_parallel_matmul",
    "decode_matmul",
    "fsdp_gather",
]

"""Vocabulary-parallel embedding (Flax NNX) on global arrays."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import initializers
from jax import lax

from sp_jax import ops
from sp_jax.config import ParallelConfig, check_layer_args
from sp_jax.layout import Layout
from sp_jax.mesh import (
    Mesh,
    axis_size,
    check_batch_and_sequence,
    check_divisible,
    check_int_range,
    current_mesh,
    nan_where,
    reshard,
)

__all__ = ["VocabParallelEmbedding", "check_token_ids", "padded_vocab_size",
           "vocab_parallel_lookup"]

default_embed_init = initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


def padded_vocab_size(vocab_size: int, tensor_size: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``tensor_size``."""
    return -(-vocab_size // tensor_size) * tensor_size


def vocab_parallel_lookup(ids: jax.Array, table: jax.Array, axis_name: str,
                          vocab_size: int) -> jax.Array:
    """Per device (before the sum over ``axis_name``): rows of this device's vocabulary
    block ``table [V / t, features]`` for ``ids``, zero for ids outside it, and NaN for
    ids outside the vocabulary (so a bad id can never pass unnoticed)."""
    rows = table.shape[0]
    start = lax.axis_index(axis_name) * rows
    local = ids - start
    inside = (local >= 0) & (local < rows)
    emb = jnp.take(table, jnp.where(inside, local, 0), axis=0)
    emb = jnp.where(inside[..., None], emb, jnp.zeros((), emb.dtype))
    return emb + nan_where((ids < 0) | (ids >= vocab_size))[..., None].astype(emb.dtype)


def check_token_ids(where: str, ids: jax.Array) -> None:
    """A ValueError unless ``ids`` is ``[batch, seq]``, a TypeError unless it holds
    integers; both name ``where``."""
    if ids.ndim != 2:
        raise ValueError(f"{where} expects token ids of shape [batch, seq], got rank "
                         f"{ids.ndim} shape {ids.shape}.")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{where}: token ids must be integers, got dtype {ids.dtype}; cast "
                        "them (e.g. ids.astype(jnp.int32)).")


class VocabParallelEmbedding(nnx.Module):
    """Token embedding with the vocabulary split over the tensor axis.

    Each device holds a block of ``ceil(V / t)`` rows. Ids outside the vocabulary raise a
    ValueError when the ids are concrete, and embed as NaN under ``jit`` (the loss then
    becomes NaN instead of silently wrong). Ids outside a device's block give zeros
    there, and the partial results are summed across the tensor axis: with
    ``sequence_parallel=True`` by a reduce-scatter straight into the SP layout
    ``P(data, tensor, None)``, else by an all-reduce into ``P(data, None, None)``.

    A vocabulary not divisible by ``t`` is padded internally with zero rows to
    ``padded_vocab_size(V, t)``; ids ``< V`` never select a padded row. The parameter keeps
    the global shape ``[num_embeddings, features]`` of :class:`flax.nnx.Embed` (same
    initialiser and rng draw); it is stored sharded over the vocabulary when ``V`` is
    divisible by ``t``, else over the features (resharded to vocabulary blocks per call;
    pad the vocabulary to a multiple of ``t`` to avoid that all-to-all).

    Args:
      num_embeddings: vocabulary size ``V``.
      features: embedding size.
      parallel: the :class:`~sp_jax.ParallelConfig`.
      sequence_parallel: output in the SP layout (reduce-scatter) or replicated over the
        tensor axis (all-reduce).
      dtype: dtype of the output (default: the parameter dtype).
      param_dtype: parameter dtype.
      embedding_init: initializer of the ``[V, features]`` table.
      rngs: one ``params`` draw.
    """

    def __init__(
        self,
        num_embeddings: int,
        features: int,
        *,
        parallel: ParallelConfig = ParallelConfig(),
        sequence_parallel: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        embedding_init: Any = default_embed_init,
        rngs: nnx.Rngs,
    ):
        check_layer_args("VocabParallelEmbedding", parallel, num_embeddings=num_embeddings,
                         features=features)
        self.num_embeddings = num_embeddings
        self.features = features
        self.parallel = parallel
        self.sequence_parallel = sequence_parallel
        self.dtype = dtype
        self.param_dtype = param_dtype
        mesh = current_mesh(parallel, where="VocabParallelEmbedding", required=False)
        layout, t = Layout.of(parallel), parallel.tensor_axis
        if mesh is not None and parallel.fsdp_axes:
            check_divisible("VocabParallelEmbedding (fsdp)", "features", features, mesh,
                            parallel.fsdp_axes, "choose features as a multiple of the "
                            "data-parallel size, or fsdp=False")
        if mesh is None or num_embeddings % axis_size(mesh, t) == 0:
            spec = layout.vocab_table
        elif features % axis_size(mesh, t) == 0:
            spec = layout.spec(None, "mlp")  # features split; vocabulary blocks per call
        else:
            spec = layout.spec(None, None)
        self.embedding = nnx.Param(
            embedding_init(rngs.params(), (num_embeddings, features), param_dtype),
            out_sharding=tuple(spec),
            eager_sharding=mesh is not None,
        )

    def padded_table(self, mesh: Mesh | None = None) -> jax.Array:
        """The ``[padded_vocab_size(V, t), features]`` table sharded ``P(tensor, None)``."""
        mesh = mesh or current_mesh(self.parallel, where="VocabParallelEmbedding")
        t = self.parallel.tensor_axis
        table = self.embedding[...]
        pad = padded_vocab_size(self.num_embeddings, axis_size(mesh, t)) - self.num_embeddings
        if pad:
            table = jnp.pad(table, ((0, pad), (0, 0)))
        return reshard(table, Layout.of(self.parallel).vocab_table, mesh)

    def __call__(self, ids: jax.Array, *, table: jax.Array | None = None) -> jax.Array:
        """Embeds integer ids ``[batch, seq]`` -> ``[batch, seq, features]``.

        Output sharding ``P(data, tensor, None)`` (``sequence_parallel``; ``seq``
        divisible by the tensor size) or ``P(data, None, None)``. ``table`` may pass a
        precomputed :meth:`padded_table` (e.g. shared with a tied LM head).
        """
        mesh = current_mesh(self.parallel, where="VocabParallelEmbedding")
        ids = jnp.asarray(ids)
        check_token_ids("VocabParallelEmbedding", ids)
        layout, t = Layout.of(self.parallel), self.parallel.tensor_axis
        check_batch_and_sequence("VocabParallelEmbedding", mesh, self.parallel, ids.shape[0],
                                 ids.shape[1] if self.sequence_parallel else None,
                                 length=ids.shape[1])
        check_int_range("VocabParallelEmbedding", "token id", ids, 0, self.num_embeddings)
        # int32 whatever the integer dtype: in uint8 a range guard against a vocabulary of
        # 256 would wrap the bound to 0 (and flag every id)
        ids = ids.astype(jnp.int32)
        if table is None:
            table = self.padded_table(mesh)
        dtype = self.dtype if self.dtype is not None else table.dtype
        table = table.astype(dtype)

        fsdp_axes = self.parallel.fsdp_axes

        def local(ids, table):
            table = ops.fsdp_gather(table, fsdp_axes, 1)  # hidden dim over the data axes
            emb = vocab_parallel_lookup(ids, table, t, self.num_embeddings)
            if self.sequence_parallel:
                return ops.reduce_scatter_with_all_gather_grad(emb, t, dim=1)
            return ops.all_reduce_with_identity_grad(emb, t)

        out_spec = layout.sp if self.sequence_parallel else layout.tensor_replicated
        return jax.shard_map(local, in_specs=(layout.tokens, layout.vocab_table),
                             out_specs=out_spec)(reshard(ids, layout.tokens, mesh), table)

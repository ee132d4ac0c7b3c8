"""Cross-entropy over vocabulary-parallel logits, without gathering the vocabulary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.config import ParallelConfig
from sp_jax.layers.embedding import padded_vocab_size
from sp_jax.layout import Layout
from sp_jax.mesh import (
    axis_size,
    check_batch_and_sequence,
    check_int_range,
    current_mesh,
    nan_where,
    reshard,
)

__all__ = ["document_labels", "logit_softcap", "parallel_cross_entropy"]


def logit_softcap(logits: jax.Array, cap: float | None) -> jax.Array:
    """Soft-capped logits ``cap * tanh(logits / cap)`` (Gemma 2's
    ``final_logit_softcapping``, computed in fp32 and returned in the logits' dtype;
    the gradient is the tanh's), or ``logits`` unchanged for ``cap`` None. Elementwise,
    so any sharding and padded vocabulary entries (which stay out of the loss by
    :func:`parallel_cross_entropy`'s ``vocab_size``) are fine."""
    if cap is None:
        return logits
    capped = jnp.tanh(logits.astype(jnp.float32) / jnp.float32(cap)) * jnp.float32(cap)
    return capped.astype(logits.dtype)


def document_labels(labels: jax.Array, segment_ids: jax.Array | None,
                    ignore_index: int = -100) -> jax.Array:
    """``labels [batch, seq]`` of packed rows with ``ignore_index`` wherever the target is
    not in the position's own document: padding (``segment_ids == 0``) and the last token
    of each document before another one starts in the row (its label would be the next
    document's first token). The row's last position keeps its label (a document split
    across rows continues in the next row; a pipeline marks a true document end itself).
    ``segment_ids`` None: ``labels`` as they are. Global arrays, sharded over the batch."""
    if segment_ids is None:
        return labels
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.shape != labels.shape:
        raise ValueError(f"segment_ids of shape {segment_ids.shape} must match the labels' "
                         f"{labels.shape} ([batch, seq]).")
    segment_ids, labels = _whole_rows(segment_ids), _whole_rows(labels)
    same_next = jnp.concatenate([segment_ids[:, 1:] == segment_ids[:, :-1],
                                 jnp.ones_like(segment_ids[:, :1], dtype=bool)], axis=1)
    return jnp.where((segment_ids != 0) & same_next, labels, ignore_index)


def _whole_rows(x: jax.Array) -> jax.Array:
    """``x [batch, seq]`` with its sequence gathered where an explicit mesh shards it (a
    shift along a sharded sequence is not expressible in explicit sharding)."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or spec is None or len(spec) < 2 or spec[1] is None:
        return x
    return jax.sharding.reshard(x, jax.sharding.PartitionSpec(spec[0], None))


def _local_cross_entropy(logits, labels, *, axis_name, vocab_size, ignore_index,
                         label_smoothing, z_loss):
    """Per device: ``logits`` ``[b, s, Vp / t]`` (this device's vocabulary block)."""
    rows = logits.shape[-1]
    start = lax.axis_index(axis_name) * rows
    vocab_ids = start + jnp.arange(rows)
    valid = vocab_ids < vocab_size  # padded entries take no part
    z = jnp.where(valid, logits.astype(jnp.float32), -jnp.inf)
    # The max only shifts the log-sum-exp; no gradient flows through it.
    m = lax.pmax(lax.stop_gradient(jnp.max(z, axis=-1)), axis_name)
    lse = m + jnp.log(lax.psum(jnp.sum(jnp.exp(z - m[..., None]), axis=-1), axis_name))
    local_label = labels - start
    inside = (local_label >= 0) & (local_label < rows)
    picked = jnp.take_along_axis(z, jnp.where(inside, local_label, 0)[..., None], axis=-1)
    target = lax.psum(jnp.where(inside, picked[..., 0], 0.0), axis_name)
    loss = lse - target
    if label_smoothing:
        mean_z = lax.psum(jnp.sum(jnp.where(valid, z, 0.0), axis=-1), axis_name) / vocab_size
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - mean_z)
    if z_loss:
        loss = loss + z_loss * lse**2
    loss = loss + nan_where((labels < 0) | (labels >= vocab_size))  # never silently wrong
    return jnp.where(labels == ignore_index, 0.0, loss)


def parallel_cross_entropy(
    logits: jax.Array,
    labels: jax.Array,
    *,
    parallel: ParallelConfig = ParallelConfig(),
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    vocab_size: int | None = None,
) -> jax.Array:
    """Per-token softmax cross-entropy of vocabulary-parallel logits.

    The max, the sum of exponentials and the target logit are reduced across the tensor
    axis (two ``psum`` s and a ``pmax`` of ``[batch, seq]`` values); the full vocabulary is
    never gathered on one device. Computed in fp32 whatever the logits dtype; the gradient
    is that of the unsharded loss.

    Args:
      logits: ``[batch, seq, V]`` (any float dtype), sharded ``P(data, None, tensor)``
        (other layouts are resharded). A ``V`` not divisible by the tensor size is padded
        internally with entries that take no part in the loss.
      labels: integer ``[batch, seq]`` in ``[0, vocab_size)``; ``ignore_index`` marks
        tokens without a loss. Other values raise a ValueError when the labels are
        concrete, and give a NaN loss under ``jit``.
      parallel: the :class:`~sp_jax.ParallelConfig` (mesh axes).
      ignore_index: label value whose loss is 0.
      label_smoothing: ``eps``: the target distribution puts ``1 - eps`` on the label and
        ``eps`` uniformly over the ``vocab_size`` entries.
      z_loss: coefficient of the auxiliary ``log(Z)**2`` term (PaLM).
      vocab_size: number of real vocabulary entries when ``logits`` carries padding
        columns beyond them (default: ``V``).
    Returns:
      ``[batch, seq]`` float32 loss per token (0 where ``labels == ignore_index``), sharded
      ``P(data, None)``.
    """
    mesh = current_mesh(parallel, where="parallel_cross_entropy")
    logits, labels = jnp.asarray(logits), jnp.asarray(labels)
    if logits.ndim != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(
            f"parallel_cross_entropy expects logits [batch, seq, vocab] and labels "
            f"[batch, seq], got logits {logits.shape} and labels {labels.shape}."
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"parallel_cross_entropy: labels must be integers, got {labels.dtype}.")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must be in [0, 1).")
    vocab = logits.shape[-1]
    vocab_size = vocab if vocab_size is None else vocab_size
    if not 0 < vocab_size <= vocab:
        raise ValueError(
            f"parallel_cross_entropy: vocab_size={vocab_size} must be in [1, {vocab}] (the "
            "logits' last dimension)."
        )
    layout, t = Layout.of(parallel), parallel.tensor_axis
    check_batch_and_sequence("parallel_cross_entropy", mesh, parallel, labels.shape[0],
                             length=labels.shape[1])
    check_int_range("parallel_cross_entropy", "label", labels, 0, vocab_size,
                    allowed=(ignore_index,))
    labels = labels.astype(jnp.int32)  # any integer dtype (uint8 would wrap the bounds)
    padded = padded_vocab_size(vocab, axis_size(mesh, t))
    if padded != vocab:
        logits = jnp.pad(logits, ((0, 0), (0, 0), (0, padded - vocab)))
    local = jax.shard_map(
        lambda z, y: _local_cross_entropy(
            z, y, axis_name=t, vocab_size=vocab_size, ignore_index=ignore_index,
            label_smoothing=label_smoothing, z_loss=z_loss),
        in_specs=(layout.logits, layout.tokens),
        out_specs=layout.tokens,
    )
    return local(reshard(logits, layout.logits, mesh), reshard(labels, layout.tokens, mesh))

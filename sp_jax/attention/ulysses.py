"""Causal attention by DeepSpeed-Ulysses sequence parallelism: all-to-all from sequence
shards to head shards, blockwise attention, and back."""

from __future__ import annotations

import dataclasses

import jax
from jax import lax

from sp_jax.attention.blockwise import (
    IMPLEMENTATIONS,
    blockwise_attention,
    check_cudnn_inputs,
    check_segments,
)
from sp_jax.attention.dropout import AttentionDropout
from sp_jax.attention.kernels import check_qkv, same_vma
from sp_jax.ops.primitives import AxisName, vary

__all__ = ["ulysses_attention"]


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: AxisName,
                      block_q: int = 512, block_k: int = 512,
                      implementation: str = "xla",
                      dropout: AttentionDropout | None = None,
                      segment_ids: jax.Array | None = None,
                      sliding_window: int | None = None, scale: float | None = None,
                      softcap: float | None = None,
                      offload_residuals: bool = False) -> jax.Array:
    """Causal attention by DeepSpeed-Ulysses sequence parallelism, per device.

    Call inside :func:`jax.shard_map` with the sequence sharded contiguously over
    ``axis_name`` (size ``c``): an all-to-all turns the sequence shards ``[batch, s / c,
    heads, head_dim]`` into head shards ``[batch, s, heads / c, head_dim]``,
    :func:`blockwise_attention` runs on them, and an all-to-all turns the result back.
    The backward pass is the same all-to-alls around the blockwise kernel's backward.

    Args:
      q, k, v: local ``[batch, s / c, heads, head_dim]`` (k, v: ``kv_heads``, v's head
        size free, as in :func:`blockwise_attention`); ``heads`` and ``kv_heads`` (the
        heads on this device) divisible by ``c``, so each context device gets whole
        query groups.
      axis_name: the context mesh axis.
      block_q / block_k: rows per block: the largest divisors of ``s`` up to these.
      implementation: the kernel on the head shards, as in :func:`blockwise_attention`
        (``"xla"`` or ``"cudnn"``).
      dropout: dropout on the probabilities (:class:`AttentionDropout`, ``head_offset``
        the global index of this device's first head before the all-to-all), or None.
      segment_ids: int ``[batch, s / c]``: the document ids of the local rows (0 =
        padding), or None; all-gathered over ``axis_name`` (``[batch, s]``, 4 bytes a row)
        for the blockwise kernel on the head shards (see :func:`blockwise_attention`).
      sliding_window: None or the keys each query sees (:func:`blockwise_attention`;
        the head shards hold the whole sequence, so the window is exact).
      scale / softcap: the scores' factor and soft cap (:func:`blockwise_attention`).
      offload_residuals: the local attention's residuals in host memory between the
        passes (:func:`blockwise_attention`).
    Returns:
      ``[batch, s / c, heads, v_head_dim]`` in ``q.dtype``.
    """
    check_qkv("ulysses_attention", q, k, v)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"ulysses_attention: implementation={implementation!r}: use 'xla' "
                         "or 'cudnn'.")
    if implementation == "cudnn":  # before the all-to-alls, naming this entry point
        check_cudnn_inputs("ulysses_attention", q, k, v)
    c, heads = lax.axis_size(axis_name), q.shape[2]
    if heads % c:
        raise ValueError(
            f"ulysses_attention: the {heads} heads on each device are not divisible by the "
            f"size {c} of the context axis {axis_name!r}; use a context axis whose size "
            f"divides {heads} (or ring_attention, which has no such constraint)."
        )
    if k.shape[2] % c:
        raise ValueError(
            f"ulysses_attention: the {k.shape[2]} key/value heads on each device are not "
            f"divisible by the size {c} of the context axis {axis_name!r}: Ulysses gives each "
            "context device whole query groups with their key/value heads; use more "
            "key/value heads, a context axis whose size divides them, or ring_attention."
        )

    def to_heads(x):
        return lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)

    def to_sequence(x):
        return lax.all_to_all(x, axis_name, split_axis=1, concat_axis=2, tiled=True)

    q, k, v = (to_heads(vary(x, (axis_name,))) for x in same_vma(q, k, v))
    if dropout is not None:  # this device's heads after the all-to-all
        dropout = dataclasses.replace(dropout, head_offset=dropout.head_offset + lax.axis_index(
            axis_name) * q.shape[2])
    if segment_ids is not None:  # the whole sequence's ids, for the head shards
        segment_ids = lax.all_gather(vary(check_segments(
            "ulysses_attention", segment_ids, q, q.shape[1] // c), (axis_name,)),
            axis_name, axis=1, tiled=True)
    out = blockwise_attention(q, k, v, block_q=block_q, block_k=block_k,
                              implementation=implementation, dropout=dropout,
                              segment_ids=segment_ids, sliding_window=sliding_window,
                              scale=scale, softcap=softcap,
                              offload_residuals=offload_residuals)
    return to_sequence(out)

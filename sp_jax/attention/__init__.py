"""Causal attention kernels for long context: blockwise (flash-style), ring (context
parallelism over a zigzag-sharded sequence) and Ulysses (all-to-all to head sharding).

All three work on per-device arrays ``[batch, seq, heads, head_dim]`` (the values may
have a head size of their own, ``[batch, seq, kv_heads, v_head_dim]``, and so has the
output: multi-head latent attention's); the two context-parallel ones run inside
:func:`jax.shard_map` over a mesh with the context axis ``axis_name`` (of size ``c``),
like the ops of :mod:`sp_jax.ops`. Each is a small
:func:`jax.custom_vjp` whose residuals are ``q, k, v``, the output and the fp32
log-sum-exp of every query row (flash-attention-2): no ``s x s`` array exists, forward
or backward.

==================  ===============================  =====================================
function            local q, k, v                    communication (forward; backward)
==================  ===============================  =====================================
blockwise_attention the whole sequence ``[b, s, ..]``  none
ring_attention      zigzag shard ``[b, s / c, ..]``   ``c - 1`` k/v ring steps (ppermute);
                                                     k/v and fp32 dk/dv ring steps
ulysses_attention   contiguous shard ``[b, s / c,..]``  all-to-all to ``[b, s, h / c, ..]``
                                                     and back; the same in backward
==================  ===============================  =====================================

Dtypes: scores, softmax statistics (running max, sum, log-sum-exp) and the accumulation
of ``out``, ``dq``, ``dk`` and ``dv`` are fp32; the probabilities (and in backward the
score gradients) are cast to the input dtype for their matmuls, as in flash attention;
outputs and cotangents come back in the dtypes of ``q``, ``k`` and ``v``. The scores are
``(q . k) * scale`` (``scale``: ``head_dim ** -0.5`` unless given), with ``softcap=c``
then ``c * tanh(scores / c)`` (Gemma 2), before the mask and the softmax.

Block sizes (``block_q``, ``block_k``): a kernel over ``L`` query (key) rows uses the
largest divisor of ``L`` up to ``block_q`` (``block_k``), so any length works, including
an odd number of blocks (a prime length gets blocks of one row: slow, still correct).
``L`` is the sequence for :func:`blockwise_attention` and :func:`ulysses_attention` and
the zigzag chunk ``s / (2c)`` for :func:`ring_attention` (its blocks never straddle two
chunks). The largest array is one ``[batch, heads, block_q, block_k]`` block of scores.

Causality: a ``(q block, k block)`` product is computed only when some query of the block
sees some key of it: the loops' bounds skip the blocks above the diagonal, and only the
blocks crossing it are masked. :func:`attention_block_counts` counts the products per
device (the attention FLOPs are ``4 * batch * heads * head_dim * block_q * block_k`` per
product, ``heads`` the heads on the device).

Modules: :mod:`~sp_jax.attention.sequence_order` (the zigzag order and every position
that follows from it), :mod:`~sp_jax.attention.dropout` (sharding-invariant dropout of
the probabilities), :mod:`~sp_jax.attention.kernels` (the block kernels),
:mod:`~sp_jax.attention.blockwise`, :mod:`~sp_jax.attention.ring`,
:mod:`~sp_jax.attention.ulysses` (the three attention functions),
:mod:`~sp_jax.attention.counts` (block products per device) and
:mod:`~sp_jax.attention.cached` (decoding: one query token per row against its key/value
cache, :func:`cached_attention`).
"""

from sp_jax.attention.blockwise import (
    CUDNN_DTYPES,
    IMPLEMENTATIONS,
    blockwise_attention,
    cudnn_takes,
)
from sp_jax.attention.cached import cached_attention
from sp_jax.attention.counts import attention_block_counts
from sp_jax.attention.dropout import AttentionDropout
from sp_jax.attention.latent_ring import expand_latent, latent_ring_attention
from sp_jax.attention.ring import ring_attention
from sp_jax.attention.sequence_order import (
    local_positions,
    sequence_order,
    to_held,
    to_natural,
    zigzag_inverse,
    zigzag_order,
    zigzag_positions,
)
from sp_jax.attention.ulysses import ulysses_attention

__all__ = [
    "CUDNN_DTYPES",
    "IMPLEMENTATIONS",
    "AttentionDropout",
    "attention_block_counts",
    "blockwise_attention",
    "cached_attention",
    "cudnn_takes",
    "expand_latent",
    "latent_ring_attention",
    "local_positions",
    "ring_attention",
    "sequence_order",
    "to_held",
    "to_natural",
    "ulysses_attention",
    "zigzag_inverse",
    "zigzag_order",
    "zigzag_positions",
]

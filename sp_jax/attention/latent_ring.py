"""Ring attention that passes multi-head latent attention's latent: each context device's
chunk travels the ring as ``kv_lora_rank + qk_rope_head_dim`` values per token (the
normalised latent and the rotated rotary key) instead of per-head keys and values, and
every device up-projects each received chunk for its own heads; the backward pass sends
the latent's gradients. The ring itself (zigzag order, causal skipping, windows, packed
documents, dropout, the transfer/compute overlap) is :func:`~sp_jax.attention.ring.
ring_forward` / :func:`~sp_jax.attention.ring.ring_backward` with an ``expand`` step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from sp_jax.attention.blockwise import check_segments, check_window
from sp_jax.attention.dropout import AttentionDropout, drop_arguments
from sp_jax.attention.kernels import (
    block_size,
    q_from_kernel,
    q_to_kernel,
    score_rule,
    to_bhsd,
)
from sp_jax.attention.ring import ring_backward, ring_forward
from sp_jax.ops.primitives import AxisName, residuals_to_device, residuals_to_host, vary, vma

__all__ = ["expand_latent", "latent_ring_attention"]


def expand_latent(latent: jax.Array, k_rope: jax.Array, kv_b: jax.Array, nope: int,
                  heads: int) -> tuple[jax.Array, jax.Array]:
    """The latent ``[b, s, r]`` up-projected by ``kv_b [r, heads * (nope + d_v)]``
    (columns ``(head, [k_nope | v])``) into keys ``[b, s, heads, nope + p]`` (``[k_nope
    | k_rope]``, the rotary key ``k_rope [b, s, p]`` shared by the heads) and values
    ``[b, s, heads, d_v]``, in the latent's dtype."""
    b, s, _ = latent.shape
    kv = jnp.einsum("bsr,rc->bsc", latent, kv_b.astype(latent.dtype)).reshape(
        b, s, heads, -1)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None].astype(k_nope.dtype),
                                                  (b, s, heads, k_rope.shape[-1]))], axis=-1)
    return k, v


def _expand(nope, heads, kv_b, block):
    """``(k, v)`` in the kernels' layout ``[b, heads, 2n, ...]`` of a travelling
    ``block = (latent, k_rope)``."""
    k, v = expand_latent(*block, kv_b, nope, heads)
    return to_bhsd(k), to_bhsd(v)


def _forward(q, latent, k_rope, kv_b, dropout, seg, window, axis_name, bq, bk, rule, nope):
    heads = q.shape[2]
    expand = (functools.partial(_expand, nope, heads), kv_b)
    o, lse, _ = ring_forward(q_to_kernel(q, heads), (latent, k_rope), seg, axis_name, bq, bk,
                             dropout, window, rule, expand)
    return q_from_kernel(o).astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10, 11, 12))
def _latent_ring(q, latent, k_rope, kv_b, dropout, seg, window, axis_name, bq, bk, rule,
                 nope, offload=False):
    return _forward(q, latent, k_rope, kv_b, dropout, seg, window, axis_name, bq, bk, rule,
                    nope)[0]


def _latent_ring_fwd(q, latent, k_rope, kv_b, dropout, seg, window, axis_name, bq, bk, rule,
                     nope, offload):
    out, lse = _forward(q, latent, k_rope, kv_b, dropout, seg, window, axis_name, bq, bk,
                        rule, nope)
    # the residuals: the queries, the latent (not per-head keys and values), the output
    res, out = residuals_to_host((q, latent, k_rope, kv_b, out, lse), out, offload)
    return out, (res, dropout, seg, window)


def _latent_ring_bwd(axis_name, bq, bk, rule, nope, offload, res, d_out):
    res, dropout, seg, window = res
    (q, latent, k_rope, kv_b, out, lse), d_out = residuals_to_device(res, d_out, offload)
    heads = q.shape[2]
    expand = (functools.partial(_expand, nope, heads), kv_b)
    dq, (d_latent, d_rope), d_kv_b, _ = ring_backward(
        (q_to_kernel(q, heads), (latent, k_rope), q_to_kernel(out, heads), lse),
        q_to_kernel(d_out, heads), seg, axis_name, bq, bk, dropout, window, rule, expand)
    return (q_from_kernel(dq).astype(q.dtype), d_latent.astype(latent.dtype),
            d_rope.astype(k_rope.dtype), d_kv_b.astype(kv_b.dtype), None, None, None)


_latent_ring.defvjp(_latent_ring_fwd, _latent_ring_bwd)


def latent_ring_attention(q: jax.Array, latent: jax.Array, k_rope: jax.Array,
                          kv_b: jax.Array, *, axis_name: AxisName, block_q: int = 512,
                          block_k: int = 512, dropout: AttentionDropout | None = None,
                          segment_ids: jax.Array | None = None,
                          sliding_window: int | jax.Array | None = None,
                          scale: float | None = None, softcap: float | None = None,
                          offload_residuals: bool = False) -> jax.Array:
    """Causal ring attention of multi-head latent attention over the context axis
    ``axis_name``, per device, passing the latent: as
    :func:`~sp_jax.attention.ring_attention` (the sequence in zigzag order, the same
    steps, masks, windows, documents, dropout and log-sum-exp merge), but what travels
    the ring is each chunk's ``latent`` and rotated ``k_rope`` (``r + p`` values a token),
    which every device up-projects with its ``kv_b`` block for its own heads
    (:func:`expand_latent`) before each step's products. The backward pass sends the
    latent and the rotary key around again with fp32 accumulators of their gradients
    (``r + p`` values a token, each step's ``dk, dv`` taken back through the up
    projection), ending at their owner; ``kv_b``'s gradient is summed on each device.

    Args:
      q: ``[batch, 2n, heads, nope + p]`` (rotary applied to the last ``p``).
      latent: ``[batch, 2n, r]`` normalised latent; k_rope: ``[batch, 2n, p]`` rotated.
      kv_b: ``[r, heads * (nope + d_v)]``, this device's heads' block (columns ``(head,
        [k_nope | v])``).
      others: as :func:`~sp_jax.attention.ring_attention` (``scale`` None: ``(nope + p)
        ** -0.5``).
    Returns:
      ``[batch, 2n, heads, d_v]`` in ``q.dtype``, in the zigzag layout of ``q``.
    """
    b, s, heads, d = q.shape
    if latent.shape[:2] != (b, s) or k_rope.shape[:2] != (b, s) or s % 2:
        raise ValueError(f"latent_ring_attention: q {q.shape}, latent {latent.shape} and "
                         f"k_rope {k_rope.shape} must share an even local sequence length "
                         "(two zigzag chunks) and the batch.")
    nope = d - k_rope.shape[-1]
    if kv_b.shape[0] != latent.shape[-1] or kv_b.shape[1] % heads or \
            kv_b.shape[1] // heads <= nope:
        raise ValueError(f"latent_ring_attention: kv_b {kv_b.shape} must be [r={latent.shape[-1]}"
                         f", heads={heads} * (nope={nope} + v_head_dim)].")
    if isinstance(sliding_window, jax.Array):
        sliding_window = check_window("latent_ring_attention", sliding_window)
    elif sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or \
                sliding_window < 1:
            raise ValueError(f"latent_ring_attention: sliding_window={sliding_window!r} must "
                             "be a positive int (keys per query, itself included) or None.")
        sliding_window = jnp.int32(sliding_window)
    n = s // 2
    bq, bk = block_size(n, block_q, "block_q"), block_size(n, block_k, "block_k")
    rule = score_rule("latent_ring_attention", scale, softcap)
    axes = vma(q) | vma(latent) | vma(k_rope) | vma(kv_b) | {axis_name}
    q, latent, k_rope, kv_b = (vary(x, axes) for x in (q, latent, k_rope, kv_b))
    drop = drop_arguments(dropout, None, s, "xla")
    seg = check_segments("latent_ring_attention", segment_ids, q)
    if seg is not None:
        seg = vary(seg, (axis_name,))
    return _latent_ring(q, latent, k_rope, kv_b, None if drop is None else drop[0], seg,
                        sliding_window, axis_name, bq, bk, rule, nope,
                        bool(offload_residuals))

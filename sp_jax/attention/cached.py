"""The one-query-token attention of decoding: each row's new token against its key/value
cache (:func:`cached_attention`), per device, in the layout of
:meth:`sp_jax.layers.CausalSelfAttention.decode_step` (this shard's heads, whole rows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.attention.kernels import score_rule

__all__ = ["cached_attention"]


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array,
                     v_cache: jax.Array, positions: jax.Array,
                     sliding_window: int | None = None, *,
                     cache_positions: jax.Array | None = None,
                     axis_name: str | tuple[str, ...] | None = None,
                     scale: float | None = None, softcap: float | None = None,
                     rope: tuple[jax.Array, jax.Array, jax.Array] | None = None
                     ) -> jax.Array:
    """Per device: one query token per row against its cache.

    Args:
      q: ``[b, 1, heads, d]`` (rotary applied); ``k`` / ``v``: ``[b, 1, kv_heads, d]`` /
        ``[b, 1, kv_heads, d_v]`` of the same token (``heads`` a multiple of
        ``kv_heads``: consecutive query heads share a key/value head; ``d_v``, the value
        head size, may differ from ``d``).
      k_cache / v_cache: ``[b, length, kv_heads, d]`` / ``[b, length, kv_heads, d_v]``:
        the entries of positions ``< positions[b]`` are row ``b``'s earlier tokens
        (later ones are ignored).
      positions: int ``[b]``: each row's position of this token.
      sliding_window: attend only to the last ``sliding_window`` tokens (this one
        included), or None.
      cache_positions: int ``[length]``: the position each cache entry holds (None:
        entry ``j`` holds position ``j``).
      axis_name: the mesh axes (manual here) the cache is split over along the
        sequence, each device holding its part (a context axis), or None: the whole
        cache. Each device then weighs its own entries by the exponentials of their
        scores less the maximum over all parts (one ``pmax``) and the sums and weighted
        values of the parts are added (one ``psum``): the log-sum-exp merge of the
        parts, equal to attention over the whole cache; this token's own key and value
        are added once, after the merge.
      scale / softcap: the scores' factor (None: ``d ** -0.5``) and soft cap (None, or
        ``c``: ``c * tanh(s / c)`` before the mask), as the training kernels'
        (:func:`~sp_jax.attention.blockwise_attention`).
      rope: None, or a second part of the queries and keys held apart, ``(q_rope [b, 1,
        heads, d_r], k_rope [b, 1, kv_heads, d_r], k_rope_cache [b, length, kv_heads,
        d_r])``, its products added to the scores (absorbed multi-head latent
        attention: ``q`` / ``k`` the latent part, these the rotary key's; ``scale``
        then given).
    Returns:
      ``[b, 1, heads * d_v]`` in ``q.dtype``; softmax in fp32.
    """
    b, _, heads, d = q.shape
    kv_heads, length = k.shape[2], k_cache.shape[1]
    qg = q.reshape(b, kv_heads, heads // kv_heads, d)
    rule = score_rule("cached_attention", scale, softcap)
    scale = rule.scale_for(d)
    f32 = jnp.float32
    dot_cache = jnp.einsum("bhgd,bshd->bhgs", qg, k_cache, preferred_element_type=f32)
    dot_self = jnp.einsum("bhgd,bhd->bhg", qg, k[:, 0], preferred_element_type=f32)
    if rope is not None:
        q_rope, k_rope, k_rope_cache = rope
        qr = q_rope.reshape(b, kv_heads, heads // kv_heads, q_rope.shape[-1])
        dot_cache += jnp.einsum("bhgd,bshd->bhgs", qr, k_rope_cache,
                                preferred_element_type=f32)
        dot_self += jnp.einsum("bhgd,bhd->bhg", qr, k_rope[:, 0], preferred_element_type=f32)
    s_cache, _ = rule(dot_cache * scale)
    s_self, _ = rule(dot_self * scale)
    j = (jnp.arange(length) if cache_positions is None else cache_positions)[None, :]
    visible = j < positions[:, None]
    if sliding_window is not None:
        visible &= j > positions[:, None] - sliding_window
    s_cache = jnp.where(visible[:, None, None, :], s_cache, -jnp.inf)
    top = jnp.max(s_cache, axis=-1)
    if axis_name is not None:
        top = lax.pmax(top, axis_name)
    top = jnp.maximum(top, s_self)  # finite: this token's own score
    p_cache, p_self = jnp.exp(s_cache - top[..., None]), jnp.exp(s_self - top)
    total = jnp.sum(p_cache, axis=-1)
    out = jnp.einsum("bhgs,bshd->bhgd", p_cache, v_cache.astype(f32))
    if axis_name is not None:  # one all-reduce: the values and their sum side by side
        both = lax.psum(jnp.concatenate([out, total[..., None]], axis=-1), axis_name)
        out, total = both[..., :-1], both[..., -1]
    total = total + p_self
    out = out + p_self[..., None] * v[:, 0][:, :, None, :].astype(f32)
    out = out / total[..., None]
    return out.reshape(b, 1, heads * v.shape[-1]).astype(q.dtype)

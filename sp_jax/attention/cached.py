"""The attention of decoding: each row's new tokens (one a step; a speculative step's
token and drafts) against its key/value cache (:func:`cached_attention`), per device, in
the layout of :meth:`sp_jax.layers.CausalSelfAttention.decode_step` (this shard's heads,
whole rows)."""

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
    """Per device: ``T`` consecutive query tokens per row against its cache (``T = 1``:
    a decoding step; ``T = D + 1``: speculative decoding's verification of ``D`` drafts,
    :mod:`sp_jax.models.speculative`).

    Args:
      q: ``[b, T, heads, d]`` (rotary applied); ``k`` / ``v``: ``[b, T, kv_heads, d]`` /
        ``[b, T, kv_heads, d_v]`` of the same tokens (``heads`` a multiple of
        ``kv_heads``: consecutive query heads share a key/value head; ``d_v``, the value
        head size, may differ from ``d``). Token ``t`` attends to the cache and to the
        tokens ``<= t`` of these (causal).
      k_cache / v_cache: ``[b, length, kv_heads, d]`` / ``[b, length, kv_heads, d_v]``:
        the entries of positions ``< positions[b]`` are row ``b``'s earlier tokens
        (later ones are ignored: entries a rejected draft left are never read).
      positions: int ``[b]``: each row's position of its first token (token ``t`` at
        ``positions + t``; a token at a negative position is none: only itself attends
        to it).
      sliding_window: attend only to the last ``sliding_window`` tokens (this one
        included), or None.
      cache_positions: int ``[length]``: the position each cache entry holds (None:
        entry ``j`` holds position ``j``).
      axis_name: the mesh axes (manual here) the cache is split over along the
        sequence, each device holding its part (a context axis), or None: the whole
        cache. Each device then weighs its own entries by the exponentials of their
        scores less the maximum over all parts (one ``pmax``) and the sums and weighted
        values of the parts are added (one ``psum``): the log-sum-exp merge of the
        parts, equal to attention over the whole cache; these tokens' own keys and
        values are added once, after the merge.
      scale / softcap: the scores' factor (None: ``d ** -0.5``) and soft cap (None, or
        ``c``: ``c * tanh(s / c)`` before the mask), as the training kernels'
        (:func:`~sp_jax.attention.blockwise_attention`).
      rope: None, or a second part of the queries and keys held apart, ``(q_rope [b, T,
        heads, d_r], k_rope [b, T, kv_heads, d_r], k_rope_cache [b, length, kv_heads,
        d_r])``, its products added to the scores (absorbed multi-head latent
        attention: ``q`` / ``k`` the latent part, these the rotary key's; ``scale``
        then given).
    Returns:
      ``[b, T, heads * d_v]`` in ``q.dtype``; softmax in fp32.
    """
    b, steps, heads, d = q.shape
    kv_heads, length = k.shape[2], k_cache.shape[1]
    qg = q.reshape(b, steps, kv_heads, heads // kv_heads, d)
    rule = score_rule("cached_attention", scale, softcap)
    scale = rule.scale_for(d)
    f32 = jnp.float32
    dot_cache = jnp.einsum("bthgd,bshd->bhgts", qg, k_cache, preferred_element_type=f32)
    dot_self = jnp.einsum("bthgd,bshd->bhgts", qg, k, preferred_element_type=f32)
    if rope is not None:
        q_rope, k_rope, k_rope_cache = rope
        qr = q_rope.reshape(b, steps, kv_heads, heads // kv_heads, q_rope.shape[-1])
        dot_cache += jnp.einsum("bthgd,bshd->bhgts", qr, k_rope_cache,
                                preferred_element_type=f32)
        dot_self += jnp.einsum("bthgd,bshd->bhgts", qr, k_rope, preferred_element_type=f32)
    s_cache, _ = rule(dot_cache * scale)
    s_self, _ = rule(dot_self * scale)
    j = (jnp.arange(length) if cache_positions is None else cache_positions)[None, None, :]
    first = positions[:, None, None]  # [b, 1, 1]
    t = jnp.arange(steps)
    visible = j < first  # [b, T or 1, length]: the entries before this step's tokens
    # [b, T, T]: query t sees its tokens t' <= t; one at a negative position is no token
    # (speculative decoding's modules behind the main model), seen by itself only
    mine = (t[None, :] <= t[:, None]) & ((first + t[None, :] >= 0) | (t[None, :] == t[:, None]))
    if sliding_window is not None:
        visible &= j > first + t[:, None] - sliding_window
        mine &= t[None, :] > t[:, None] - sliding_window
    s_cache = jnp.where(visible[:, None, None], s_cache, -jnp.inf)
    s_self = jnp.where(mine[:, None, None], s_self, -jnp.inf)
    top = jnp.max(s_cache, axis=-1)
    if axis_name is not None:
        top = lax.pmax(top, axis_name)
    top = jnp.maximum(top, jnp.max(s_self, axis=-1))  # finite: each token's own score
    p_cache, p_self = jnp.exp(s_cache - top[..., None]), jnp.exp(s_self - top[..., None])
    total = jnp.sum(p_cache, axis=-1)
    out = jnp.einsum("bhgts,bshd->bhgtd", p_cache, v_cache.astype(f32))
    if axis_name is not None:  # one all-reduce: the values and their sum side by side
        both = lax.psum(jnp.concatenate([out, total[..., None]], axis=-1), axis_name)
        out, total = both[..., :-1], both[..., -1]
    total = total + jnp.sum(p_self, axis=-1)
    out = out + jnp.einsum("bhgts,bshd->bhgtd", p_self, v.astype(f32))
    out = out / total[..., None]  # [b, kv_heads, group, T, d_v]
    return jnp.moveaxis(out, 3, 1).reshape(b, steps, heads * v.shape[-1]).astype(q.dtype)

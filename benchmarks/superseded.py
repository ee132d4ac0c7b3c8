"""Superseded attention kernel, kept for the benchmarks that compare against it.

:func:`causal_attention` was sp_jax's first memory-lean attention: query blocks against
*all* keys (a ``[batch, heads, block, seq]`` score block), backward recomputed from the
log-sum-exp. :func:`sp_jax.attention.blockwise_attention` (blocks of keys too, causal
blocks skipped) replaced it; ``benchmarks/context.py`` measures one against the other.
Not part of the installed package.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["QUERY_BLOCK", "causal_attention"]


QUERY_BLOCK = 512
"""Queries per block of :func:`causal_attention` (the largest divisor of the sequence
length up to this): its ``[batch, heads, block, seq]`` scores are the largest array the
attention ever holds, in forward and backward."""


def _query_block(s: int) -> int:
    return next(b for b in range(min(s, QUERY_BLOCK), 0, -1) if s % b == 0)


def _causal_scores(q: jax.Array, k: jax.Array, offset) -> jax.Array:
    """fp32 scaled scores ``[b, heads, s_q, s_k]`` of queries at positions ``offset ..
    offset + s_q`` against keys ``0 .. s_k``, the future masked to -inf."""
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    s_q, s_k = q.shape[1], k.shape[1]
    causal = (offset + jnp.arange(s_q))[:, None] >= jnp.arange(s_k)[None, :]
    return jnp.where(causal, scores, -jnp.inf)


def _blocks(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """``x`` with ``axis`` split into ``n`` blocks, the block index first."""
    shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocks(x: jax.Array, axis: int = 1) -> jax.Array:
    """The inverse of :func:`_blocks`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


@jax.custom_vjp
def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention that keeps no ``s x s`` array, forward or backward.

    ``q, k, v``: ``[batch, seq, heads, head_dim]`` -> ``[batch, seq, heads, head_dim]``,
    softmax in fp32. Queries are processed in blocks of :data:`QUERY_BLOCK` (a
    ``lax.scan``), so the largest array is a ``[batch, heads, block, seq]`` block of
    scores. The backward pass recomputes the probabilities from ``q``, ``k`` and the saved
    log-sum-exp ``[batch, heads, seq]`` (Korthikanti et al.'s *selective recomputation*,
    as in flash attention), block by block, accumulating ``dk`` and ``dv`` in fp32: the
    residuals are ``q, k, v``, the output and the log-sum-exp, instead of the ``5 a s^2
    b`` bytes of scores, probabilities and masks that plain autodiff keeps per layer.
    """
    return _causal_attention_fwd(q, k, v)[0]


def _causal_attention_fwd(q, k, v):
    n = q.shape[1] // _query_block(q.shape[1])

    def block(args):
        q_i, offset = args
        scores = _causal_scores(q_i, k, offset)
        lse = jax.nn.logsumexp(scores, axis=-1)
        probs = jnp.exp(scores - lse[..., None])
        return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v), lse

    if n == 1:  # one block: no loop (XLA would keep its copies)
        out, lse = block((q, 0))
    else:
        offsets = jnp.arange(n) * (q.shape[1] // n)
        out, lse = jax.lax.map(block, (_blocks(q, n), offsets))
        out, lse = _unblocks(out), _unblocks(lse, axis=2)
    return out, (q, k, v, out, lse)


def _causal_attention_bwd(res, d_out):
    # Tie the residuals to the incoming cotangent: otherwise XLA's CSE merges the
    # recomputed scores with the forward ones and keeps those alive until backward.
    res, d_out = jax.lax.optimization_barrier((res, d_out))
    q, k, v, out, lse = res
    n = q.shape[1] // _query_block(q.shape[1])
    scale = q.shape[-1] ** -0.5

    def block(carry, xs):
        d_k, d_v = carry
        q_i, do_i, o_i, lse_i, offset = xs
        probs = jnp.exp(_causal_scores(q_i, k, offset) - lse_i[..., None])  # recomputed
        d_v = d_v + jnp.einsum("bhqk,bqhd->bkhd", probs.astype(do_i.dtype), do_i,
                               preferred_element_type=jnp.float32)
        d_probs = jnp.einsum("bqhd,bkhd->bhqk", do_i, v, preferred_element_type=jnp.float32)
        row = jnp.einsum("bqhd,bqhd->bhq", do_i.astype(jnp.float32), o_i.astype(jnp.float32))
        d_scores = probs * (d_probs - row[..., None]) * scale
        d_q = jnp.einsum("bhqk,bkhd->bqhd", d_scores.astype(q.dtype), k)
        d_k = d_k + jnp.einsum("bhqk,bqhd->bkhd", d_scores.astype(k.dtype), q_i,
                               preferred_element_type=jnp.float32)
        return (d_k, d_v), d_q

    zeros = jnp.zeros_like(k, dtype=jnp.float32)  # varies like k inside shard_map
    if n == 1:  # one block: no loop
        (d_k, d_v), d_q = block((zeros, zeros), (q, d_out, out, lse, 0))
        return d_q, d_k.astype(k.dtype), d_v.astype(v.dtype)
    offsets = jnp.arange(n) * (q.shape[1] // n)
    (d_k, d_v), d_q = jax.lax.scan(
        block, (zeros, zeros),
        (_blocks(q, n), _blocks(d_out, n), _blocks(out, n), _blocks(lse, n, axis=2), offsets))
    return _unblocks(d_q), d_k.astype(k.dtype), d_v.astype(v.dtype)


causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)

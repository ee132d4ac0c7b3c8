"""Causal attention kernels for long context: blockwise (flash-style), ring (context
parallelism over a zigzag-sharded sequence) and Ulysses (all-to-all to head sharding).

All three work on per-device arrays ``[batch, seq, heads, head_dim]``; the two
context-parallel ones run inside :func:`jax.shard_map` over a mesh with the context axis
``axis_name`` (of size ``c``), like the ops of :mod:`sp_jax.ops`. Each is a small
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
outputs and cotangents come back in the dtypes of ``q``, ``k`` and ``v``. The scale is
``head_dim ** -0.5``.

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
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sp_jax.ops import _vary, _vma

__all__ = [
    "AttentionDropout",
    "attention_block_counts",
    "blockwise_attention",
    "ring_attention",
    "ulysses_attention",
    "zigzag_inverse",
    "zigzag_order",
]

AxisName = Hashable
IMPLEMENTATIONS = ("xla", "cudnn")
"""Kernels of :func:`blockwise_attention`: sp_jax's (every backend) or cuDNN's (GPU)."""
_F32 = jnp.float32
_MODES = ("ring", "ring_contiguous", "ulysses", "local")


# --------------------------------------------------------------------------------------
# Block sizes, zigzag order, block counts (host-side)
# --------------------------------------------------------------------------------------


def _block_size(length: int, block: int, name: str = "block") -> int:
    """The largest divisor of ``length`` up to ``block``."""
    if int(block) < 1:
        raise ValueError(f"{name}={block} must be a positive number of rows.")
    return next(b for b in range(min(length, int(block)), 0, -1) if length % b == 0)


def zigzag_order(seq_len: int, context: int) -> np.ndarray:
    """The zigzag permutation of a sequence for :func:`ring_attention` over ``context``
    devices.

    The sequence is cut into ``2 * context`` chunks of ``n = seq_len / (2 * context)``
    positions; device ``r`` gets chunk ``r`` followed by chunk ``2 * context - 1 - r``, so
    every device holds as many early (cheap) as late (expensive) causal queries.

    Args:
      seq_len: the global sequence length, divisible by ``2 * context``.
      context: the size of the context mesh axis.
    Returns:
      int array ``perm`` of shape ``[seq_len]``, permuted position -> original position:
      ``x_zigzag = x[:, perm]`` is the sequence to shard contiguously over the context
      axis (``P(None, context)``). Its inverse is :func:`zigzag_inverse`
      (``np.argsort(perm)``): ``x = x_zigzag[:, zigzag_inverse(seq_len, context)]``.
    """
    seq_len, context = int(seq_len), int(context)
    if context < 1:
        raise ValueError(f"context={context} must be a positive number of devices.")
    if seq_len < 1 or seq_len % (2 * context):
        raise ValueError(
            f"zigzag_order: seq_len={seq_len} must be a positive multiple of 2 * context = "
            f"{2 * context} (context={context}); pad the sequence to a multiple of "
            f"{2 * context}."
        )
    n = seq_len // (2 * context)
    chunks = np.arange(seq_len).reshape(2 * context, n)
    return np.concatenate([np.concatenate([chunks[r], chunks[2 * context - 1 - r]])
                           for r in range(context)])


def zigzag_inverse(seq_len: int, context: int) -> np.ndarray:
    """The inverse of :func:`zigzag_order` (original position -> permuted position):
    ``x = x_zigzag[:, zigzag_inverse(seq_len, context)]``."""
    return np.argsort(zigzag_order(seq_len, context))


def _causal_count(length: int, bq: int, bk: int) -> int:
    """Block products of causal attention over ``length`` rows in ``bq x bk`` blocks:
    query block ``i`` needs key blocks ``0 .. ceil((i + 1) bq / bk) - 1``."""
    return sum(-(-(i + 1) * bq // bk) for i in range(length // bq))


def attention_block_counts(seq_len: int, context: int, *, mode: str, block_q: int,
                           block_k: int) -> np.ndarray:
    """How many ``(q block, k block)`` products each device of the context axis computes.

    Args:
      seq_len: the global sequence length ``s``.
      context: the size ``c`` of the context axis.
      mode: ``"ring"`` (:func:`ring_attention` on the zigzag order: blocks divide the
        chunk ``s / (2c)``), ``"ring_contiguous"`` (a ring over contiguous shards of
        ``s / c`` rows without zigzag, for comparison: device ``r`` needs the blocks of
        devices ``0 .. r``), ``"ulysses"`` (:func:`ulysses_attention`: every device runs
        the causal kernel over all ``s`` rows for ``heads / c`` heads) or ``"local"``
        (:func:`blockwise_attention` of the whole sequence; ``context`` must be 1).
      block_q / block_k: the kernels' ``block_q`` / ``block_k``.
    Returns:
      int64 array ``[c]``: device ``r``'s number of block products (forward; the backward
      computes the same products once more).
    """
    if mode not in _MODES:
        raise ValueError(f"mode={mode!r} is not one of {_MODES}.")
    s, c = int(seq_len), int(context)
    if mode == "local":
        if c != 1:
            raise ValueError(f"mode='local' is one device's blockwise_attention: context={c} "
                             "must be 1 (use 'ulysses' or 'ring' for a context axis).")
        bq, bk = _block_size(s, block_q, "block_q"), _block_size(s, block_k, "block_k")
        return np.array([_causal_count(s, bq, bk)], dtype=np.int64)
    if mode == "ring":
        n = len(zigzag_order(s, c)) // (2 * c)  # validates s
        bq, bk = _block_size(n, block_q, "block_q"), _block_size(n, block_k, "block_k")
        # step 0: causal over the local 2n rows; each other step: n x 2n rows, unmasked
        per = _causal_count(2 * n, bq, bk) + (c - 1) * 2 * (n // bq) * (n // bk)
        return np.full(c, per, dtype=np.int64)
    if s % c:
        raise ValueError(f"seq_len={s} must be divisible by context={c}.")
    if mode == "ulysses":
        bq, bk = _block_size(s, block_q, "block_q"), _block_size(s, block_k, "block_k")
        return np.full(c, _causal_count(s, bq, bk), dtype=np.int64)
    m = s // c  # ring_contiguous
    bq, bk = _block_size(m, block_q, "block_q"), _block_size(m, block_k, "block_k")
    return np.array([_causal_count(m, bq, bk) + r * (m // bq) * (m // bk) for r in range(c)],
                    dtype=np.int64)


# --------------------------------------------------------------------------------------
# Dropout on the attention probabilities
# --------------------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=["seed", "batch_offset",
                                                                  "head_offset"],
                   meta_fields=["rate"])
@dataclasses.dataclass(frozen=True)
class AttentionDropout:
    """Dropout on the attention probabilities, reproducible under any sharding.

    The kernels drop probability ``(b, h, i, j)`` (batch row, query head, query position,
    key position, all global) when a counter-based hash of those four numbers and the
    ``seed`` falls below ``rate`` (as flash attention does with Philox), and scale the
    kept ones by ``1 / (1 - rate)``; the normaliser of the softmax is the undropped one.
    The mask is recomputed, not stored, in the backward pass, and it depends on nothing
    but the global coordinates: the same for every block size, mesh, tensor, context
    (ring or Ulysses) or data split, so a sharded model drops exactly what the unsharded
    one drops.

    Attributes:
      seed: uint32 ``[2]`` (e.g. ``jax.random.bits(key, (2,), jnp.uint32)``).
      rate: the drop probability in ``[0, 1)`` (static).
      batch_offset: the global index of this device's first batch row.
      head_offset: the global index of this device's first query head.
    """

    seed: jax.Array
    rate: float
    batch_offset: Any = 0
    head_offset: Any = 0

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.rate) < 1.0:
            raise ValueError(f"AttentionDropout.rate={self.rate} must be in [0, 1).")


def _fmix(x):
    """MurmurHash3's 32-bit finaliser (a bijection that mixes every input bit)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _drop_scale(drop, q_start, k_start, shape):
    """fp32 ``[b, h, g, bq, bk]`` factors ``1 / (1 - rate)`` (kept) or 0 (dropped) of the
    block at rows ``q_start``, columns ``k_start``; ``drop = (dropout, qpos, kpos)`` with
    the global positions ``qpos [sq]``, ``kpos [sk]`` of the kernel's rows and columns."""
    dropout, qpos, kpos = drop
    b, hk, g, nq, nk = shape
    u = jnp.uint32
    seed = dropout.seed.astype(u)
    rows = (jnp.asarray(dropout.batch_offset) + jnp.arange(b)).astype(u)[:, None, None]
    heads = (jnp.asarray(dropout.head_offset) + jnp.arange(hk * g)).astype(u).reshape(hk, g)
    x = _fmix(_fmix(seed[0] ^ (rows * u(0x9E3779B1))) ^ (heads[None] * u(0x85EBCA77)))
    q = _slice(qpos, q_start, nq, -1).astype(u)
    k = _slice(kpos, k_start, nk, -1).astype(u)
    x = _fmix(x[..., None] ^ (q * u(0xC2B2AE3D)))
    x = _fmix(x[..., None] ^ (k * u(0x27D4EB2F) + seed[1]))
    threshold = min(int(round(dropout.rate * 2.0 ** 32)), 2 ** 32 - 1)
    return jnp.where(x >= u(threshold), _F32(1.0 / (1.0 - dropout.rate)), _F32(0.0))


# --------------------------------------------------------------------------------------
# The block kernels (layout [batch, heads, seq, head_dim], fp32 statistics)
# --------------------------------------------------------------------------------------


def _scores(q_i, k_j, scale, mask_at=None):
    """fp32 scaled scores ``[b, h, g, bq, bk]`` of ``q_i [b, h, g, bq, d]`` (``g`` query
    heads per key/value head) and ``k_j [b, h, bk, d]``; with ``mask_at = (q_start, k_start)`` the
    keys after each query (causal, positions from the block starts) are -inf."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q_i, k_j, preferred_element_type=_F32) * scale
    if mask_at is not None:
        q_start, k_start = mask_at
        rows = q_start + lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0)
        cols = k_start + lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1)
        s = jnp.where(rows >= cols, s, -jnp.inf)
    return s


def _slice(x, start, size, axis=-2):
    """Rows ``start .. start + size`` of ``x`` along ``axis`` (default: the sequence axis
    of ``[..., seq, head_dim]``; ``axis=-1`` for the statistics ``[..., seq]``)."""
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis % x.ndim)


def _forward_blocks(q, k, v, *, causal: bool, bq: int, bk: int, drop=None):
    """Attention of ``q [b, h, g, sq, d]`` over ``k, v [b, h, sk, d]`` in blocks (the
    ``g`` query heads of group ``h`` share key/value head ``h``).

    ``causal``: ``sq == sk`` and query ``i`` sees keys ``0 .. i`` (key blocks above the
    diagonal are not visited; those crossing it are masked); else every query sees every
    key. Every query row must see at least one key (true for both). ``drop``: None or
    ``(AttentionDropout, qpos, kpos)`` (:func:`_drop_scale`).

    Returns:
      ``(out, lse, count)``: normalised ``out`` fp32 ``[b, h, g, sq, d]``, the log-sum-exp
      fp32 ``[b, h, g, sq]`` and the number of block products computed (int32).
    """
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = d ** -0.5

    def q_block(i, carry):
        out, lse, count = carry
        q_start = i * bq
        q_i = _slice(q, q_start, bq)

        def kv_step(j, acc, masked):
            o, m, norm, n = acc
            s = _scores(q_i, _slice(k, j * bk, bk), scale,
                        (q_start, j * bk) if masked else None)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # finite: key 0 comes first
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            norm = alpha * norm + jnp.sum(p, axis=-1)  # the undropped normaliser
            if drop is not None:
                p = p * _drop_scale(drop, q_start, j * bk, p.shape)
            o = alpha[..., None] * o + jnp.einsum(
                "bhgqk,bhkd->bhgqd", p.astype(v.dtype), _slice(v, j * bk, bk),
                preferred_element_type=_F32)
            return o, m_new, norm, n + 1

        zero = jnp.zeros_like(q_i, dtype=_F32)  # varies like q inside shard_map
        acc = (zero, zero[..., 0] - jnp.inf, zero[..., 0], count)
        if causal:
            # key blocks wholly at or before the first query: unmasked; then the blocks
            # crossing the diagonal, up to the one holding the last query's position
            n_full = (q_start + 1) // bk
            n_end = (q_start + bq + bk - 1) // bk
            acc = lax.fori_loop(0, n_full, functools.partial(kv_step, masked=False), acc)
            acc = lax.fori_loop(n_full, n_end, functools.partial(kv_step, masked=True), acc)
        else:
            acc = lax.fori_loop(0, sk // bk, functools.partial(kv_step, masked=False), acc)
        o, m, norm, count = acc
        out = lax.dynamic_update_slice_in_dim(out, o / norm[..., None], q_start,
                                              axis=out.ndim - 2)
        lse = lax.dynamic_update_slice_in_dim(lse, m + jnp.log(norm), q_start,
                                              axis=lse.ndim - 1)
        return out, lse, count

    out = jnp.zeros_like(q, dtype=_F32)
    init = (out, out[..., 0], jnp.int32(0))
    return lax.fori_loop(0, sq // bq, q_block, init)


def _backward_blocks(q, k, v, do, lse, delta, dq, *, causal: bool, bq: int, bk: int,
                     drop=None):
    """The gradients of :func:`_forward_blocks`, recomputing each block's probabilities
    from the final ``lse`` (flash-attention-2: outer loop over key blocks, inner over the
    query blocks that see them; the same blocks skipped and masked as forward).

    Args:
      q, do: ``[b, h, g, sq, d]``; k, v: ``[b, h, sk, d]``.
      lse, delta: fp32 ``[b, h, g, sq]``: the log-sum-exp of the whole attention row and
        ``rowsum(do * out)``.
      dq: fp32 ``[b, h, g, sq, d]`` accumulator the query gradients are added to.
    Returns:
      ``(dq, dk, dv, count)``: ``dq`` accumulated, fp32 ``dk, dv [b, h, sk, d]`` of this
      call, the number of block products.
    """
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = d ** -0.5

    def k_block(j, carry):
        dq, dk, dv, count = carry
        k_start = j * bk
        k_j, v_j = _slice(k, k_start, bk), _slice(v, k_start, bk)

        def q_step(i, acc, masked):
            dq, dk_j, dv_j, n = acc
            q_start = i * bq
            q_i, do_i = _slice(q, q_start, bq), _slice(do, q_start, bq)
            s = _scores(q_i, k_j, scale, (q_start, k_start) if masked else None)
            p = jnp.exp(s - _slice(lse, q_start, bq, -1)[..., None])  # recomputed
            z = 1.0 if drop is None else _drop_scale(drop, q_start, k_start, p.shape)
            dv_j = dv_j + jnp.einsum("bhgqk,bhgqd->bhkd", (p * z).astype(do.dtype), do_i,
                                     preferred_element_type=_F32)
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_i, v_j, preferred_element_type=_F32) * z
            ds = (p * (dp - _slice(delta, q_start, bq, -1)[..., None]) * scale
                  ).astype(q.dtype)
            dq_i = _slice(dq, q_start, bq) + jnp.einsum(
                "bhgqk,bhkd->bhgqd", ds, k_j, preferred_element_type=_F32)
            dq = lax.dynamic_update_slice_in_dim(dq, dq_i, q_start, axis=dq.ndim - 2)
            dk_j = dk_j + jnp.einsum("bhgqk,bhgqd->bhkd", ds, q_i,
                                     preferred_element_type=_F32)
            return dq, dk_j, dv_j, n + 1

        zero = jnp.zeros_like(k_j, dtype=_F32)
        acc = (dq, zero, zero, count)
        if causal:
            # query blocks from the one holding position k_start; masked while their first
            # query precedes the block's last key
            i_start = k_start // bq
            i_full = jnp.minimum((k_start + bk - 1 + bq - 1) // bq, sq // bq)
            acc = lax.fori_loop(i_start, i_full, functools.partial(q_step, masked=True), acc)
            acc = lax.fori_loop(i_full, sq // bq, functools.partial(q_step, masked=False), acc)
        else:
            acc = lax.fori_loop(0, sq // bq, functools.partial(q_step, masked=False), acc)
        dq, dk_j, dv_j, count = acc
        dk = lax.dynamic_update_slice_in_dim(dk, dk_j, k_start, axis=dk.ndim - 2)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_j, k_start, axis=dv.ndim - 2)
        return dq, dk, dv, count

    zero = jnp.zeros_like(k, dtype=_F32)
    return lax.fori_loop(0, sk // bk, k_block, (dq, zero, zero, jnp.int32(0)))


def _delta(do, out):
    """``rowsum(do * out)`` in fp32, ``[..., s]``."""
    return jnp.einsum("...sd,...sd->...s", do.astype(_F32), out.astype(_F32))


def _to_bhsd(x):
    """Keys and values ``[b, s, h, d]`` <-> the kernels' ``[b, h, s, d]``."""
    return jnp.swapaxes(x, 1, 2)


_to_bshd = _to_bhsd


def _q_to_kernel(q, kv_heads: int):
    """Queries ``[b, s, h, d]`` -> ``[b, kv_heads, h / kv_heads, s, d]``: query head
    ``j * g + i`` is the ``i``-th of the ``g`` heads that share key/value head ``j``."""
    b, s, h, d = q.shape
    return q.reshape(b, s, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)


def _q_from_kernel(x):
    """The inverse of :func:`_q_to_kernel`."""
    b, hk, g, s, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, s, hk * g, d)


def _check_qkv(name: str, q, k, v) -> None:
    if (q.ndim != 4 or k.shape != v.shape or k.ndim != 4 or q.shape[:2] != k.shape[:2]
            or q.shape[3] != k.shape[3] or k.shape[2] == 0 or q.shape[2] % k.shape[2]):
        raise ValueError(
            f"{name}: q [batch, seq, heads, head_dim] and k, v [batch, seq, kv_heads, "
            f"head_dim] must agree, with heads a multiple of kv_heads (grouped-query "
            f"attention); got q {q.shape}, k {k.shape}, v {v.shape}."
        )


def _same_vma(q, k, v):
    """``q, k, v`` cast to vary over the union of their mesh axes, so that each custom
    VJP returns cotangents of its inputs' types (the casts' transposes sum the
    cotangents of an input replicated over an axis)."""
    vma = _vma(q) | _vma(k) | _vma(v)
    return _vary(q, vma), _vary(k, vma), _vary(v, vma)


# --------------------------------------------------------------------------------------
# blockwise_attention
# --------------------------------------------------------------------------------------


def _blockwise_forward(q, k, v, drop, bq, bk):
    """``q [b, s, h, d]``, ``k, v [b, s, hk, d]`` -> (out ``[b, s, h, d]`` in q's dtype,
    lse, count); ``drop``: None or ``(AttentionDropout, positions)``."""
    o, lse, count = _forward_blocks(_q_to_kernel(q, k.shape[2]), _to_bhsd(k), _to_bhsd(v),
                                    causal=True, bq=bq, bk=bk, drop=_kernel_drop(drop))
    return _q_from_kernel(o).astype(q.dtype), lse, count


def _kernel_drop(drop):
    """``(AttentionDropout, positions)`` -> the kernels' ``(dropout, qpos, kpos)``."""
    return None if drop is None else (drop[0], drop[1], drop[1])


def _blockwise_backward(res, d_out, drop, bq, bk):
    # Tie the residuals to the incoming cotangent: otherwise XLA's CSE may merge the
    # recomputed scores with the forward ones and keep those alive until backward.
    res, d_out = lax.optimization_barrier((res, d_out))
    q, k, v, out, lse = res
    hk = k.shape[2]
    qh, kh, vh, doh = _q_to_kernel(q, hk), _to_bhsd(k), _to_bhsd(v), _q_to_kernel(d_out, hk)
    dq, dk, dv, count = _backward_blocks(
        qh, kh, vh, doh, lse, _delta(doh, _q_to_kernel(out, hk)),
        jnp.zeros_like(qh, dtype=_F32), causal=True, bq=bq, bk=bk, drop=_kernel_drop(drop))
    grads = (_q_from_kernel(dq).astype(q.dtype), _to_bshd(dk).astype(k.dtype),
             _to_bshd(dv).astype(v.dtype))
    return grads, count


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _blockwise(q, k, v, drop, bq, bk):
    return _blockwise_forward(q, k, v, drop, bq, bk)[0]


def _blockwise_fwd(q, k, v, drop, bq, bk):
    out, lse, _ = _blockwise_forward(q, k, v, drop, bq, bk)
    return out, ((q, k, v, out, lse), drop)


def _blockwise_bwd(bq, bk, res, d_out):
    res, drop = res
    return (*_blockwise_backward(res, d_out, drop, bq, bk)[0], None)


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block_q: int = 512,
                        block_k: int = 512, implementation: str = "xla",
                        dropout: AttentionDropout | None = None,
                        positions: jax.Array | None = None) -> jax.Array:
    """Causal softmax attention in blocks (flash attention), on one device's arrays.

    Online softmax over key blocks with fp32 running statistics; key blocks above the
    causal diagonal are skipped (loop bounds), the ones crossing it masked. The largest
    array, forward or backward, is one ``[batch, heads, block_q, block_k]`` block. The
    backward pass recomputes each block's probabilities from the saved log-sum-exp
    (residuals ``q, k, v``, the output and the fp32 log-sum-exp ``[batch, heads, seq]``)
    and accumulates ``dq, dk, dv`` in fp32.

    Args:
      q: ``[batch, seq, heads, head_dim]``; k, v: ``[batch, seq, kv_heads, head_dim]``
        (any float dtype), ``heads`` a multiple of ``kv_heads``: grouped-query attention
        (query head ``j * heads / kv_heads + i`` uses key/value head ``j``, as in Hugging
        Face's ``repeat_kv``), computed without repeating k and v.
      block_q / block_k: query / key rows per block: the largest divisors of ``seq`` up to
        these.
      implementation: ``"xla"`` (this kernel, every backend) or ``"cudnn"``
        (:func:`jax.nn.dot_product_attention` with ``is_causal=True`` and cuDNN's fused
        kernel: GPU only; JAX raises elsewhere; block sizes unused).
      dropout: dropout on the probabilities (:class:`AttentionDropout`), or None.
      positions: int ``[seq]``: the global positions of the rows, which the dropout mask
        depends on (default ``0 .. seq - 1``; causality uses the row order).
    Returns:
      ``[batch, seq, heads, head_dim]`` in ``q.dtype``.
    """
    _check_qkv("blockwise_attention", q, k, v)
    drop = _drop_args(dropout, positions, q.shape[1], implementation)
    if implementation == "cudnn":
        try:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                implementation="cudnn")
        except RuntimeError as e:  # JAX: "cuDNN not found." without a GPU
            raise RuntimeError(
                f"blockwise_attention(implementation='cudnn') needs cuDNN on a GPU ({e}); "
                "use implementation='xla' on other backends."
            ) from e
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={implementation!r}: use 'xla' or 'cudnn'.")
    s = q.shape[1]
    bq, bk = _block_size(s, block_q, "block_q"), _block_size(s, block_k, "block_k")
    return _blockwise(*_same_vma(q, k, v), drop, bq, bk)


def _drop_args(dropout, positions, s: int, implementation: str):
    """``(dropout, positions)`` for the kernels, or None without dropout."""
    if dropout is None or dropout.rate == 0.0:
        return None
    if not isinstance(dropout, AttentionDropout):
        raise TypeError(f"dropout={dropout!r} must be an AttentionDropout or None.")
    if implementation != "xla":
        raise ValueError(f"attention dropout needs implementation='xla' (got "
                         f"{implementation!r}: cuDNN's kernel draws its own masks).")
    positions = jnp.arange(s, dtype=jnp.int32) if positions is None else positions
    return dropout, positions.astype(jnp.int32)


# --------------------------------------------------------------------------------------
# ring_attention
# --------------------------------------------------------------------------------------


def _shift(x, axis_name: AxisName, c: int):
    """``x`` of device ``i`` moved to device ``i + 1`` (mod ``c``)."""
    return lax.ppermute(x, axis_name, perm=[(i, (i + 1) % c) for i in range(c)])


def _merge(o1, lse1, o2, lse2):
    """Softmax-weighted merge of two normalised partial results over disjoint keys."""
    lse = jnp.logaddexp(lse1, lse2)
    return (o1 * jnp.exp(lse1 - lse)[..., None] + o2 * jnp.exp(lse2 - lse)[..., None], lse)


def _zigzag_positions(r, c: int, n: int):
    """Global positions of device ``r``'s zigzag rows: chunks ``r`` and ``2c - 1 - r``."""
    return jnp.concatenate([r * n + jnp.arange(n), (2 * c - 1 - r) * n + jnp.arange(n)])


def _ring_drops(dropout, r, c: int, n: int):
    """The dropout arguments of the ring's steps: (own, before(src), after(src))."""
    if dropout is None:
        return None, lambda src: None, lambda src: None
    qpos = _zigzag_positions(r, c, n)
    return ((dropout, qpos, qpos),
            lambda src: (dropout, qpos, src * n + jnp.arange(n)),
            lambda src: (dropout, qpos[n:], _zigzag_positions(src, c, n)))


def _ring_forward(q, k, v, axis_name, bq, bk, dropout=None):
    """Per device, zigzag shards ``q [b, h, g, 2n, d]``, ``k, v [b, h, 2n, d]`` -> (out
    fp32, lse, count)."""
    c, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    n = q.shape[-2] // 2
    own, drop_before, drop_after = _ring_drops(dropout, r, c, n)
    kv = (k, v)
    recv = _shift(kv, axis_name, c) if c > 1 else None  # in flight during step 0
    # step 0: own keys; the local zigzag rows are in increasing global order -> causal
    o, lse, count = _forward_blocks(q, k, v, causal=True, bq=bq, bk=bk, drop=own)

    def before(kv, src, o, lse):
        # source r - t < r: every local query sees the source's first chunk, none its
        # second: all 2n queries x the first n keys, unmasked
        k_t, v_t = kv
        o_p, lse_p, cnt = _forward_blocks(q, k_t[..., :n, :], v_t[..., :n, :],
                                          causal=False, bq=bq, bk=bk, drop=drop_before(src))
        return (*_merge(o, lse, o_p, lse_p), cnt)

    def after(kv, src, o, lse):
        # source after r: only the second local chunk sees keys, all 2n of them, unmasked
        k_t, v_t = kv
        o_p, lse_p, cnt = _forward_blocks(q[..., n:, :], k_t, v_t, causal=False, bq=bq,
                                          bk=bk, drop=drop_after(src))
        o2, lse2 = _merge(o[..., n:, :], lse[..., n:], o_p, lse_p)
        return (jnp.concatenate([o[..., :n, :], o2], axis=-2),
                jnp.concatenate([lse[..., :n], lse2], axis=-1), cnt)

    for t in range(1, c):
        # The block that arrived, tied to the previous step's results: the next transfer
        # leaves when this step's compute starts and runs during it (without the tie XLA
        # runs the whole chain of transfers up front, holding every block at once).
        cur, (o, lse) = lax.optimization_barrier((recv, (o, lse)))
        if t < c - 1:  # independent of this step's compute
            recv = _shift(cur, axis_name, c)
        src = (r - t) % c
        o, lse, cnt = lax.cond(src < r, before, after, cur, src, o, lse)
        count = count + cnt
    return o, lse, count


def _ring_backward(res, d_out, axis_name, bq, bk, dropout=None):
    """Per device: the gradients of :func:`_ring_forward` (its layouts):
    ``k, v`` travel the ring again with fp32 accumulators of their gradients, which end
    at their owner. Returns (dq, dk, dv, count), fp32."""
    res, d_out = lax.optimization_barrier((res, d_out))  # no CSE with the forward pass
    q, k, v, out, lse = res
    c, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    n = q.shape[-2] // 2
    delta = _delta(d_out, out)
    own, drop_before, drop_after = _ring_drops(dropout, r, c, n)
    kv = (k, v)
    recv_kv = _shift(kv, axis_name, c) if c > 1 else None
    dq, dk, dv, count = _backward_blocks(q, k, v, d_out, lse, delta,
                                         jnp.zeros_like(q, dtype=_F32),
                                         causal=True, bq=bq, bk=bk, drop=own)
    acc = (dk, dv)  # gradient of the block held, summed over the devices it has visited

    def before(kv, src, dq):
        k_t, v_t = kv
        dq, dk_p, dv_p, cnt = _backward_blocks(q, k_t[..., :n, :], v_t[..., :n, :], d_out,
                                               lse, delta, dq, causal=False, bq=bq, bk=bk,
                                               drop=drop_before(src))
        pad = jnp.zeros_like(dk_p)
        return (dq, jnp.concatenate([dk_p, pad], axis=-2),
                jnp.concatenate([dv_p, pad], axis=-2), cnt)

    def after(kv, src, dq):
        k_t, v_t = kv
        dq2, dk_p, dv_p, cnt = _backward_blocks(
            q[..., n:, :], k_t, v_t, d_out[..., n:, :], lse[..., n:], delta[..., n:],
            dq[..., n:, :], causal=False, bq=bq, bk=bk, drop=drop_after(src))
        return jnp.concatenate([dq[..., :n, :], dq2], axis=-2), dk_p, dv_p, cnt

    for t in range(1, c):
        # The k/v block in flight has arrived before the accumulators leave: two
        # transfers XLA cannot combine into one that would wait for this step's compute.
        cur, acc = lax.optimization_barrier((recv_kv, acc))
        if t < c - 1:
            recv_kv = _shift(cur, axis_name, c)
        recv_acc = _shift(acc, axis_name, c)  # in flight during this step's compute
        src = (r - t) % c
        dq, dk_p, dv_p, cnt = lax.cond(src < r, before, after, cur, src, dq)
        acc = (recv_acc[0] + dk_p, recv_acc[1] + dv_p)
        count = count + cnt
    if c > 1:  # the accumulators of block r + 1 go home
        acc = _shift(acc, axis_name, c)
    return dq, acc[0], acc[1], count


def _ring_forward_bshd(q, k, v, axis_name, bq, bk, dropout=None):
    o, lse, count = _ring_forward(_q_to_kernel(q, k.shape[2]), _to_bhsd(k), _to_bhsd(v),
                                  axis_name, bq, bk, dropout)
    return _q_from_kernel(o).astype(q.dtype), lse, count


def _ring_backward_bshd(res, d_out, axis_name, bq, bk, dropout=None):
    q, k, v, out, lse = res
    hk = k.shape[2]
    res = (_q_to_kernel(q, hk), _to_bhsd(k), _to_bhsd(v), _q_to_kernel(out, hk), lse)
    dq, dk, dv, count = _ring_backward(res, _q_to_kernel(d_out, hk), axis_name, bq, bk,
                                       dropout)
    grads = (_q_from_kernel(dq).astype(q.dtype), _to_bshd(dk).astype(k.dtype),
             _to_bshd(dv).astype(v.dtype))
    return grads, count


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _ring(q, k, v, dropout, axis_name, bq, bk):
    return _ring_forward_bshd(q, k, v, axis_name, bq, bk, dropout)[0]


def _ring_fwd(q, k, v, dropout, axis_name, bq, bk):
    out, lse, _ = _ring_forward_bshd(q, k, v, axis_name, bq, bk, dropout)
    return out, ((q, k, v, out, lse), dropout)


def _ring_bwd(axis_name, bq, bk, res, d_out):
    res, dropout = res
    return (*_ring_backward_bshd(res, d_out, axis_name, bq, bk, dropout)[0], None)


_ring.defvjp(_ring_fwd, _ring_bwd)


def _ring_blocks(q, block_q: int, block_k: int) -> tuple[int, int]:
    if q.shape[1] % 2:
        raise ValueError(
            f"ring_attention: the local sequence length {q.shape[1]} (q shape {q.shape}) "
            "must be even: two zigzag chunks of seq / (2 * context) rows (see zigzag_order)."
        )
    n = q.shape[1] // 2
    return _block_size(n, block_q, "block_q"), _block_size(n, block_k, "block_k")


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: AxisName,
                   block_q: int = 512, block_k: int = 512,
                   dropout: AttentionDropout | None = None) -> jax.Array:
    """Causal ring attention over the context axis ``axis_name`` (size ``c``), per device.

    Call inside :func:`jax.shard_map` with the sequence in zigzag order
    (:func:`zigzag_order`) sharded over ``axis_name``: device ``r`` holds ``[batch, 2n,
    heads, head_dim]`` whose first ``n`` rows are the global chunk ``r`` and the last
    ``n`` rows the chunk ``2c - 1 - r`` (``n = seq / (2c)``). Each device keeps its
    queries; the key/value blocks travel the ring (``c - 1`` ``ppermute`` steps, each
    transfer issued before, and independent of, the previous block's compute). Step 0 is
    causal attention over the local rows; at each later step only what causality needs is
    computed: all local queries x the first chunk of a source before this device, or the
    second local chunk x both chunks of a source after it (``lax.cond``), ``2 n^2`` scores
    each, the same on every device. Partial results are merged with log-sum-exp weights.

    The backward pass sends ``k, v`` around the ring again with fp32 accumulators of their
    gradients (so they end at their owner), recomputing every block from the saved
    log-sum-exp. With ``c = 1`` this is :func:`blockwise_attention` of the local rows.

    Args:
      q, k, v: the local zigzag shards ``[batch, 2n, heads, head_dim]`` (k, v:
        ``kv_heads``, as in :func:`blockwise_attention`; only the key/value heads travel
        the ring).
      axis_name: the context mesh axis.
      block_q / block_k: query / key rows per block: the largest divisors of ``n`` up to
        these.
      dropout: dropout on the probabilities (:class:`AttentionDropout`; the positions are
        the zigzag layout's global ones), or None.
    Returns:
      ``[batch, 2n, heads, head_dim]`` in ``q.dtype``, causal over global positions, in
      the same zigzag layout as ``q``.
    """
    _check_qkv("ring_attention", q, k, v)
    bq, bk = _ring_blocks(q, block_q, block_k)
    q, k, v = _same_vma(q, k, v)
    q, k, v = (_vary(x, (axis_name,)) for x in (q, k, v))
    drop = _drop_args(dropout, None, q.shape[1], "xla")
    return _ring(q, k, v, None if drop is None else drop[0], axis_name, bq, bk)


# --------------------------------------------------------------------------------------
# ulysses_attention
# --------------------------------------------------------------------------------------


def ulysses_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: AxisName,
                      block_q: int = 512, block_k: int = 512,
                      implementation: str = "xla",
                      dropout: AttentionDropout | None = None) -> jax.Array:
    """Causal attention by DeepSpeed-Ulysses sequence parallelism, per device.

    Call inside :func:`jax.shard_map` with the sequence sharded contiguously over
    ``axis_name`` (size ``c``): an all-to-all turns the sequence shards ``[batch, s / c,
    heads, head_dim]`` into head shards ``[batch, s, heads / c, head_dim]``,
    :func:`blockwise_attention` runs on them, and an all-to-all turns the result back.
    The backward pass is the same all-to-alls around the blockwise kernel's backward.

    Args:
      q, k, v: local ``[batch, s / c, heads, head_dim]`` (k, v: ``kv_heads``, as in
        :func:`blockwise_attention`); ``heads`` and ``kv_heads`` (the heads on this device)
        divisible by ``c``, so each context device gets whole query groups.
      axis_name: the context mesh axis.
      block_q / block_k: rows per block: the largest divisors of ``s`` up to these.
      implementation: the kernel on the head shards, as in :func:`blockwise_attention`
        (``"xla"`` or ``"cudnn"``).
      dropout: dropout on the probabilities (:class:`AttentionDropout`, ``head_offset``
        the global index of this device's first head before the all-to-all), or None.
    Returns:
      ``[batch, s / c, heads, head_dim]`` in ``q.dtype``.
    """
    _check_qkv("ulysses_attention", q, k, v)
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"ulysses_attention: implementation={implementation!r}: use 'xla' "
                         "or 'cudnn'.")
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

    q, k, v = (to_heads(_vary(x, (axis_name,))) for x in _same_vma(q, k, v))
    if dropout is not None:  # this device's heads after the all-to-all
        dropout = dataclasses.replace(dropout, head_offset=dropout.head_offset + lax.axis_index(
            axis_name) * q.shape[2])
    out = blockwise_attention(q, k, v, block_q=block_q, block_k=block_k,
                              implementation=implementation, dropout=dropout)
    return to_sequence(out)

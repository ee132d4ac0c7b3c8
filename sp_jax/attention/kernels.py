"""The flash-attention block kernels every attention function runs: online softmax over
key blocks with fp32 statistics forward, per-block recomputation from the log-sum-exp
backward, causal blocks above the diagonal skipped and those crossing it masked; with a
sliding window, the key blocks wholly before it skipped too and those crossing its edge
masked.

Layout inside the kernels: queries ``[b, kv_heads, g, s, d]`` (``g`` query heads per
key/value head), keys ``[b, kv_heads, s, d]`` and values ``[b, kv_heads, s, d_v]`` (the
value head size ``d_v`` may differ from the query/key one ``d``: the output and the value
gradients are ``d_v`` wide); :func:`q_to_kernel` / :func:`q_from_kernel` and
:func:`to_bhsd` / :func:`to_bshd` convert from and to the public ``[b, s, heads, d]``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.attention.dropout import drop_scale
from sp_jax.ops.primitives import fresh_zeros, vary, vma

__all__ = ["ScoreRule", "backward_blocks", "block_size", "check_qkv", "forward_blocks",
           "kernel_segments", "q_from_kernel", "q_to_kernel", "row_delta", "same_vma",
           "score_rule", "to_bhsd", "to_bshd", "zeros_of_shape"]

_F32 = jnp.float32
# The score of a key in another document: finite, so that a row whose keys in a block are
# all of other documents stays finite (its weight is wiped by the first visible key, whose
# score is larger by ~1e30: exp underflows to exactly 0).
_OTHER_DOCUMENT = -1e30
# The padding segment (0) as the largest id: packed rows keep their ids non-decreasing, and
# each block's [min, max] range then tells whether two blocks can share a document.
_PADDING = jnp.iinfo(jnp.int32).max


def zeros_of_shape(zero: jax.Array, shape: tuple[int, ...], make: Callable[[], jax.Array]
                   ) -> jax.Array:
    """``zero`` itself when it has ``shape``, else ``make()``: the value-sized accumulators
    (``d_v`` wide) start from the key-sized zeros when the head sizes agree, so those
    programs keep one buffer, as before the value head size could differ."""
    return zero if tuple(zero.shape) == tuple(shape) else make()


def block_size(length: int, block: int, name: str = "block") -> int:
    """The largest divisor of ``length`` up to ``block``."""
    if int(block) < 1:
        raise ValueError(f"{name}={block} must be a positive number of rows.")
    return next(b for b in range(min(length, int(block)), 0, -1) if length % b == 0)


@dataclasses.dataclass(frozen=True)
class ScoreRule:
    """How the kernels make the scores of ``q . k`` (static: hashed into the programs).

    Attributes:
      scale: the factor of ``q . k`` (None: ``head_dim ** -0.5``).
      softcap: None, or ``c``: the scaled scores ``s`` become ``c * tanh(s / c)`` before
        the mask and the softmax (Gemma 2's ``attn_logit_softcapping``); the backward
        pass multiplies the scores' gradients by ``1 - tanh(s / c) ** 2``, recomputing
        ``tanh`` from the scaled scores.
    """

    scale: float | None = None
    softcap: float | None = None

    def scale_for(self, head_dim: int) -> float:
        """The factor of ``q . k`` for heads of ``head_dim`` features."""
        return head_dim ** -0.5 if self.scale is None else self.scale

    def __call__(self, s: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """The scaled scores ``s`` (fp32) -> ``(scores, tanh(s / c) or None)``."""
        if self.softcap is None:
            return s, None
        t = jnp.tanh(s / self.softcap)
        return self.softcap * t, t


def score_rule(name: str, scale: float | None = None,
               softcap: float | None = None) -> ScoreRule:
    """The :class:`ScoreRule` of an attention function's ``scale`` and ``softcap``
    arguments; a ValueError naming ``name`` unless each is None or a positive finite
    number."""
    for field, value, example in (("scale", scale, "e.g. 256 ** -0.5"),
                                  ("softcap", softcap, "e.g. 50.0")):
        if value is not None and (isinstance(value, bool) or not isinstance(
                value, int | float) or not 0 < value < math.inf):
            raise ValueError(f"{name}: {field}={value!r} must be None or a positive number "
                             f"({example}).")
    return ScoreRule(None if scale is None else float(scale),
                     None if softcap is None else float(softcap))


def kernel_segments(segment_ids: jax.Array) -> jax.Array:
    """Document ids ``[b, s]`` (0 = padding) as the kernels take them: int32."""
    return jnp.asarray(segment_ids).astype(jnp.int32)


def _scores(q_i: jax.Array, k_j: jax.Array, rule: ScoreRule,
            mask_at: tuple[Any, Any] | None = None,
            segments: tuple[jax.Array, jax.Array] | None = None,
            window: int | None = None) -> tuple[jax.Array, jax.Array | None]:
    """fp32 scaled scores ``[b, h, g, bq, bk]`` of ``q_i [b, h, g, bq, d]`` (``g`` query
    heads per key/value head) and ``k_j [b, h, bk, d]``, soft-capped by ``rule``, with
    the ``tanh`` of the cap (or None: the backward pass's factor); with ``mask_at = (q_start,
    k_start)`` the keys after each query (causal, positions from the block starts) are
    -inf; with ``segments = (q_seg [b, bq], k_seg [b, bk])`` the keys of other documents
    (and, with ``mask_at``, the later keys) are ``_OTHER_DOCUMENT``, by one mask; with
    ``window`` (and ``mask_at``) so are the keys ``window`` or more rows before each query
    (finite: a row may see no key of a block at the window's edge)."""
    s, t = rule(jnp.einsum("bhgqd,bhkd->bhgqk", q_i, k_j, preferred_element_type=_F32)
                * rule.scale_for(q_i.shape[-1]))
    causal = None
    if mask_at is not None:
        q_start, k_start = mask_at
        rows = q_start + lax.broadcasted_iota(jnp.int32, s.shape[-2:], 0)
        cols = k_start + lax.broadcasted_iota(jnp.int32, s.shape[-2:], 1)
        causal = rows >= cols
        if window is not None:
            causal = causal & (rows - cols < window)
    if segments is None:
        if causal is None:
            return s, t
        return jnp.where(causal, s, -jnp.inf if window is None else _OTHER_DOCUMENT), t
    # one mask per block (documents and causality together): a row's own key is always
    # visible, so the finite score of the others vanishes in the softmax
    q_seg, k_seg = segments
    keep = q_seg[:, None, None, :, None] == k_seg[:, None, None, None, :]
    return jnp.where(keep if causal is None else keep & causal, s, _OTHER_DOCUMENT), t


def _block_ranges(seg: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Per batch row and block of ``block`` rows, the smallest and largest document id,
    padding (0) counted as the largest: ``([b, n_blocks], [b, n_blocks])``."""
    b, s = seg.shape
    blocks = jnp.where(seg == 0, _PADDING, seg).reshape(b, s // block, block)
    return blocks.min(axis=-1), blocks.max(axis=-1)


class _Documents:
    """The document ids of a kernel call: the per-block masks, and the loop bounds that
    skip the ``(q block, k block)`` products whose rows share no document in any batch row.

    For each query block the key blocks run from the first that shares a document with it
    to the last (and the other way round in backward): a range, so the loops keep plain
    (dynamic) bounds and no conditional (one would copy its carried accumulators).
    Exact for packed rows, whose ids never decrease (padding counts as the last document):
    every block inside the range shares a document; otherwise the blocks inside the range
    that share none are computed and masked."""

    def __init__(self, segments: tuple[jax.Array, jax.Array] | None, bq: int, bk: int):
        self.segments, self.bq, self.bk = segments, bq, bk
        if segments is None:
            return
        (q_lo, q_hi), (k_lo, k_hi) = _block_ranges(segments[0], bq), _block_ranges(
            segments[1], bk)
        shared = jnp.any((q_lo[:, :, None] <= k_hi[:, None, :])
                         & (k_lo[:, None, :] <= q_hi[:, :, None]), axis=0)  # [nq, nk]
        self.k_first, self.k_end = _first_and_end(shared)
        self.q_first, self.q_end = _first_and_end(shared.T)

    def of(self, q_start: Any, k_start: Any) -> tuple[jax.Array, jax.Array] | None:
        """The ``(q_seg, k_seg)`` of the blocks starting at these rows."""
        if self.segments is None:
            return None
        q_seg, k_seg = self.segments
        return (_slice(q_seg, q_start, self.bq, -1), _slice(k_seg, k_start, self.bk, -1))

    def key_blocks(self, i: Any, lo: Any, hi: Any) -> tuple[Any, Any]:
        """Key blocks ``lo .. hi - 1`` of query block ``i``, narrowed to those that may
        share a document with it."""
        if self.segments is None:
            return lo, hi
        return jnp.maximum(lo, self.k_first[i]), jnp.minimum(hi, self.k_end[i])

    def query_blocks(self, j: Any, lo: Any, hi: Any) -> tuple[Any, Any]:
        """Query blocks ``lo .. hi - 1`` of key block ``j``, narrowed likewise."""
        if self.segments is None:
            return lo, hi
        return jnp.maximum(lo, self.q_first[j]), jnp.minimum(hi, self.q_end[j])


def _slice(x: jax.Array, start: Any, size: int, axis: int = -2) -> jax.Array:
    """Rows ``start .. start + size`` of ``x`` along ``axis`` (default: the sequence axis
    of ``[..., seq, head_dim]``; ``axis=-1`` for the statistics ``[..., seq]``)."""
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis % x.ndim)


def _first_and_end(shared: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of the boolean ``shared [n, m]``: the first column that is True and one
    past the last (``(m, 0)``, an empty range, when none is), int32 ``[n]`` each."""
    m = shared.shape[1]
    any_ = jnp.any(shared, axis=1)
    first = jnp.where(any_, jnp.argmax(shared, axis=1), m)
    end = jnp.where(any_, m - jnp.argmax(shared[:, ::-1], axis=1), 0)
    return first.astype(jnp.int32), end.astype(jnp.int32)


def _check_window(window: int | None, causal: bool, offset: Any = 0) -> None:
    if window is not None and not causal:
        raise ValueError(f"attention kernels: a sliding window ({window}) needs the causal "
                         "kernel (queries and keys at the same positions).")
    if window is None and not (isinstance(offset, int) and offset == 0):
        raise ValueError("attention kernels: offset is for a sliding window's blocks; "
                         "pass window= with it.")


def _three_loops(step: Any, acc: Any, lo: Any, hi: Any, a: Any, b: Any) -> Any:
    """``step(n, acc, masked)`` over blocks ``lo .. hi - 1``: masked below ``a``, unmasked
    from ``a`` to ``b`` (``a <= b``), masked from ``b`` on: three loops with plain
    dynamic bounds, each empty when its range is."""
    acc = lax.fori_loop(lo, jnp.minimum(a, hi), functools.partial(step, masked=True), acc)
    acc = lax.fori_loop(jnp.maximum(lo, a), jnp.minimum(b, hi),
                        functools.partial(step, masked=False), acc)
    return lax.fori_loop(jnp.maximum(lo, b), hi, functools.partial(step, masked=True), acc)


def forward_blocks(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, bq: int,
                   bk: int, drop: tuple | None = None,
                   segments: tuple[jax.Array, jax.Array] | None = None,
                   window: int | None = None, offset: Any = 0,
                   rule: ScoreRule = ScoreRule()
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Attention of ``q [b, h, g, sq, d]`` over ``k [b, h, sk, d]`` and ``v [b, h, sk,
    d_v]`` in blocks (the ``g`` query heads of group ``h`` share key/value head ``h``;
    ``d_v``, the value head size, may differ from ``d``).

    ``causal``: ``sq == sk`` and query ``i`` sees keys ``0 .. i`` (key blocks above the
    diagonal are not visited; those crossing it are masked); else every query sees every
    key. ``window`` (causal only): query ``i`` sees keys ``i - window < j <= i`` only
    (a sliding window; key blocks wholly before it are not visited, those crossing its
    edge are masked). ``offset`` (causal, with ``window``; int or traced): query ``i`` is at
    position ``i + offset`` of the keys' (``sq`` may differ from ``sk``): ring attention's
    blocks of two chunks apart, whose key blocks wholly outside the window are not
    visited. ``drop``: None or ``(AttentionDropout, qpos, kpos)`` (:func:`drop_scale`).
    ``segments``: None or the document ids ``(q_seg [b, sq], k_seg [b, sk])``
    (:func:`kernel_segments`): a query sees only keys of its own document, and products
    of blocks that share no document are skipped. A row that sees no key here gets out 0
    and lse -inf (a part of a merge; a whole attention row always sees its own key).
    ``rule``: the scores' scale and soft cap (:class:`ScoreRule`; default ``head_dim **
    -0.5``, no cap).

    Returns:
      ``(out, lse, count)``: normalised ``out`` fp32 ``[b, h, g, sq, d_v]``, the log-sum-exp
      fp32 ``[b, h, g, sq]`` and the number of block products computed (int32).
    """
    sq, sk, dv = q.shape[-2], k.shape[-2], v.shape[-1]
    docs = _Documents(segments, bq, bk)
    _check_window(window, causal, offset)

    def q_block(i, carry):
        out, lse, count = carry
        q_start = i * bq
        q_pos = q_start + offset  # the block's first query, in the keys' positions
        q_i = _slice(q, q_start, bq)

        def kv_step(j, acc, masked):
            o, m, norm, n = acc
            s, _ = _scores(q_i, _slice(k, j * bk, bk), rule,
                           (q_pos, j * bk) if masked else None, docs.of(q_start, j * bk),
                           window)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # finite: each row's first key
            p = jnp.exp(s - m_new[..., None])
            alpha = jnp.exp(m - m_new)
            norm = alpha * norm + jnp.sum(p, axis=-1)  # the undropped normaliser
            if drop is not None:
                p = p * drop_scale(drop, q_start, j * bk, p.shape)
            o = alpha[..., None] * o + jnp.einsum(
                "bhgqk,bhkd->bhgqd", p.astype(v.dtype), _slice(v, j * bk, bk),
                preferred_element_type=_F32)
            return o, m_new, norm, n + 1

        zero = jnp.zeros_like(q_i, dtype=_F32)  # varies like q inside shard_map
        o_zero = zeros_of_shape(zero, (*q_i.shape[:-1], dv), lambda: jnp.zeros_like(
            q_i, dtype=_F32, shape=(*q_i.shape[:-1], dv)))
        acc = (o_zero, zero[..., 0] - jnp.inf, zero[..., 0], count)
        if causal:
            # key blocks wholly at or before the first query: unmasked; then the blocks
            # crossing the diagonal, up to the one holding the last query's position
            n_full = (q_pos + 1) // bk
            n_end = jnp.minimum((q_pos + bq + bk - 1) // bk, sk // bk)
            if window is None:
                lo, hi = docs.key_blocks(i, 0, n_end)
                acc = lax.fori_loop(lo, jnp.minimum(n_full, hi),
                                    functools.partial(kv_step, masked=False), acc)
                acc = lax.fori_loop(jnp.maximum(lo, n_full), hi,
                                    functools.partial(kv_step, masked=True), acc)
            else:
                # from the block holding the first query's first key (masked while the
                # last query's window starts after the block's first key), unmasked
                # blocks, then the ones crossing the diagonal
                first = jnp.maximum(q_pos - window + 1, 0) // bk
                in_window = (jnp.maximum(q_pos + bq - window, 0) + bk - 1) // bk
                lo, hi = docs.key_blocks(i, first, n_end)
                acc = _three_loops(kv_step, acc, lo, hi, in_window,
                                   jnp.maximum(in_window, n_full))
        else:
            lo, hi = docs.key_blocks(i, 0, sk // bk)
            acc = lax.fori_loop(lo, hi, functools.partial(kv_step, masked=False), acc)
        o, m, norm, count = acc
        if segments is not None or window is not None:
            # rows that saw no key (all their blocks skipped): out 0
            o = o / jnp.where(norm == 0, 1.0, norm)[..., None]
        else:
            o = o / norm[..., None]
        out = lax.dynamic_update_slice_in_dim(out, o, q_start,
                                              axis=out.ndim - 2)
        lse = lax.dynamic_update_slice_in_dim(lse, m + jnp.log(norm), q_start,
                                              axis=lse.ndim - 1)
        return out, lse, count

    # not a constant that every layer would share; d_v wide
    out = fresh_zeros((*q.shape[:-1], dv), _F32, q)
    init = (out, out[..., 0], jnp.int32(0))
    return lax.fori_loop(0, sq // bq, q_block, init)


def backward_blocks(q: jax.Array, k: jax.Array, v: jax.Array, do: jax.Array, lse: jax.Array,
                    delta: jax.Array, dq: jax.Array, *, causal: bool, bq: int, bk: int,
                    drop: tuple | None = None,
                    segments: tuple[jax.Array, jax.Array] | None = None,
                    window: int | None = None, offset: Any = 0,
                    rule: ScoreRule = ScoreRule()
                    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The gradients of :func:`forward_blocks`, recomputing each block's probabilities
    from the final ``lse`` (flash-attention-2: outer loop over key blocks, inner over the
    query blocks that see them; the same blocks skipped and masked as forward).

    Args:
      q: ``[b, h, g, sq, d]``; k: ``[b, h, sk, d]``; v: ``[b, h, sk, d_v]``; do:
        ``[b, h, g, sq, d_v]``.
      lse, delta: fp32 ``[b, h, g, sq]``: the log-sum-exp of the whole attention row and
        ``rowsum(do * out)``.
      dq: fp32 ``[b, h, g, sq, d]`` accumulator the query gradients are added to.
      segments, window, offset, rule: the document ids, the sliding window, the queries'
        offset and the scores' rule, as in :func:`forward_blocks`.
    Returns:
      ``(dq, dk, dv, count)``: ``dq`` accumulated, fp32 ``dk [b, h, sk, d]`` and ``dv
      [b, h, sk, d_v]`` of this call, the number of block products.
    """
    sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = rule.scale_for(d)
    docs = _Documents(segments, bq, bk)
    _check_window(window, causal, offset)

    def k_block(j, carry):
        dq, dk, dv, count = carry
        k_start = j * bk
        k_j, v_j = _slice(k, k_start, bk), _slice(v, k_start, bk)

        def q_step(i, acc, masked):
            dq, dk_j, dv_j, n = acc
            q_start = i * bq
            q_i, do_i = _slice(q, q_start, bq), _slice(do, q_start, bq)
            s, t = _scores(q_i, k_j, rule,
                           (q_start + offset, k_start) if masked else None,
                           docs.of(q_start, k_start), window)
            p = jnp.exp(s - _slice(lse, q_start, bq, -1)[..., None])  # recomputed
            z = 1.0 if drop is None else drop_scale(drop, q_start, k_start, p.shape)
            dv_j = dv_j + jnp.einsum("bhgqk,bhgqd->bhkd", (p * z).astype(do.dtype), do_i,
                                     preferred_element_type=_F32)
            dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_i, v_j, preferred_element_type=_F32) * z
            ds = p * (dp - _slice(delta, q_start, bq, -1)[..., None])
            if t is not None:  # through the soft cap: d(c tanh(s / c)) / ds
                ds = ds * (1.0 - t * t)
            ds = (ds * scale).astype(q.dtype)
            dq_i = _slice(dq, q_start, bq) + jnp.einsum(
                "bhgqk,bhkd->bhgqd", ds, k_j, preferred_element_type=_F32)
            dq = lax.dynamic_update_slice_in_dim(dq, dq_i, q_start, axis=dq.ndim - 2)
            dk_j = dk_j + jnp.einsum("bhgqk,bhgqd->bhkd", ds, q_i,
                                     preferred_element_type=_F32)
            return dq, dk_j, dv_j, n + 1

        zero = jnp.zeros_like(k_j, dtype=_F32)
        acc = (dq, zero, zeros_of_shape(zero, v_j.shape,
                                        lambda: jnp.zeros_like(v_j, dtype=_F32)), count)
        if causal:
            # query blocks from the one holding position k_start; masked while their first
            # query precedes the block's last key
            k_pos = k_start - offset  # the block's first key, in the queries' positions
            i_start = jnp.maximum(k_pos, 0) // bq
            i_full = jnp.minimum((jnp.maximum(k_pos + bk - 1, 0) + bq - 1) // bq, sq // bq)
            if window is None:
                lo, hi = docs.query_blocks(j, i_start, sq // bq)
                acc = lax.fori_loop(lo, jnp.minimum(i_full, hi),
                                    functools.partial(q_step, masked=True), acc)
                acc = lax.fori_loop(jnp.maximum(lo, i_full), hi,
                                    functools.partial(q_step, masked=False), acc)
            else:
                # up to the block holding the last key's last query (row k_start + bk - 2
                # + window); unmasked while the block's last query sees the first key
                i_end = jnp.minimum((k_pos + bk + window - 2) // bq + 1, sq // bq)
                in_window = jnp.minimum((k_pos + window) // bq, i_end)
                lo, hi = docs.query_blocks(j, i_start, i_end)
                acc = _three_loops(q_step, acc, lo, hi, i_full,
                                   jnp.maximum(i_full, in_window))
        else:
            lo, hi = docs.query_blocks(j, 0, sq // bq)
            acc = lax.fori_loop(lo, hi, functools.partial(q_step, masked=False), acc)
        dq, dk_j, dv_j, count = acc
        dk = lax.dynamic_update_slice_in_dim(dk, dk_j, k_start, axis=dk.ndim - 2)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_j, k_start, axis=dv.ndim - 2)
        return dq, dk, dv, count

    # dk / dv made from k, not a constant that every layer would share (one buffer alive
    # across the whole backward pass)
    zero = fresh_zeros(k.shape, _F32, k)
    dv = zeros_of_shape(zero, v.shape, lambda: fresh_zeros(v.shape, _F32, v))
    return lax.fori_loop(0, sk // bk, k_block, (dq, zero, dv, jnp.int32(0)))


def row_delta(do: jax.Array, out: jax.Array) -> jax.Array:
    """``rowsum(do * out)`` in fp32, ``[..., s]``."""
    return jnp.einsum("...sd,...sd->...s", do.astype(_F32), out.astype(_F32))


def to_bhsd(x: jax.Array) -> jax.Array:
    """Keys and values ``[b, s, h, d]`` <-> the kernels' ``[b, h, s, d]``."""
    return jnp.swapaxes(x, 1, 2)


to_bshd = to_bhsd


def q_to_kernel(q: jax.Array, kv_heads: int) -> jax.Array:
    """Queries ``[b, s, h, d]`` -> ``[b, kv_heads, h / kv_heads, s, d]``: query head
    ``j * g + i`` is the ``i``-th of the ``g`` heads that share key/value head ``j``."""
    b, s, h, d = q.shape
    return q.reshape(b, s, kv_heads, h // kv_heads, d).transpose(0, 2, 3, 1, 4)


def q_from_kernel(x: jax.Array) -> jax.Array:
    """The inverse of :func:`q_to_kernel`."""
    b, hk, g, s, d = x.shape
    return x.transpose(0, 3, 1, 2, 4).reshape(b, s, hk * g, d)


def check_qkv(name: str, q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    """A ValueError naming ``name`` unless ``q [batch, seq, heads, head_dim]``, ``k
    [batch, seq, kv_heads, head_dim]`` and ``v [batch, seq, kv_heads, v_head_dim]``
    agree (``heads`` a multiple of ``kv_heads``; the value head size is free)."""
    if (q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]
            or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or k.shape[2] == 0
            or q.shape[2] % k.shape[2] or v.shape[3] == 0):
        raise ValueError(
            f"{name}: q [batch, seq, heads, head_dim], k [batch, seq, kv_heads, head_dim] "
            f"and v [batch, seq, kv_heads, v_head_dim] must agree, with heads a multiple "
            f"of kv_heads (grouped-query attention); got q {q.shape}, k {k.shape}, "
            f"v {v.shape}."
        )


def same_vma(q: jax.Array, k: jax.Array, v: jax.Array
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``q, k, v`` cast to vary over the union of their mesh axes, so that each custom
    VJP returns cotangents of its inputs' types (the casts' transposes sum the
    cotangents of an input replicated over an axis)."""
    axes = vma(q) | vma(k) | vma(v)
    return vary(q, axes), vary(k, axes), vary(v, axes)


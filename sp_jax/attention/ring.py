"""Causal ring attention over the context axis: each device keeps its queries of a
zigzag-ordered sequence while key/value blocks travel the ring (``ppermute``), each
transfer overlapped with the attention of the previous block."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.attention.blockwise import check_segments, check_window
from sp_jax.attention.dropout import AttentionDropout, drop_arguments
from sp_jax.attention.kernels import (
    ScoreRule,
    backward_blocks,
    block_size,
    check_qkv,
    forward_blocks,
    q_from_kernel,
    q_to_kernel,
    row_delta,
    same_vma,
    score_rule,
    to_bhsd,
    to_bshd,
    zeros_of_shape,
)
from sp_jax.attention.sequence_order import zigzag_positions
from sp_jax.ops.primitives import (
    AxisName,
    fresh_zeros,
    residuals_to_device,
    residuals_to_host,
    vary,
)

__all__ = ["ring_attention", "ring_backward", "ring_forward"]

_F32 = jnp.float32


def _shift(x, axis_name: AxisName, c: int):
    """``x`` of device ``i`` moved to device ``i + 1`` (mod ``c``)."""
    return lax.ppermute(x, axis_name, perm=[(i, (i + 1) % c) for i in range(c)])


def _merge(o1, lse1, o2, lse2):
    """Softmax-weighted merge of two normalised partial results over disjoint keys."""
    lse = jnp.logaddexp(lse1, lse2)
    return (o1 * jnp.exp(lse1 - lse)[..., None] + o2 * jnp.exp(lse2 - lse)[..., None], lse)


def _ring_drops(dropout, r, c: int, n: int):
    """The dropout arguments of the ring's steps: (own, before(src), after(src))."""
    if dropout is None:
        return None, lambda src: None, lambda src: None
    qpos = zigzag_positions(r, c, n)
    return ((dropout, qpos, qpos),
            lambda src: (dropout, qpos, src * n + jnp.arange(n)),
            lambda src: (dropout, qpos[n:], zigzag_positions(src, c, n)))


def _expanded(kv, expand):
    """The travelling block ``kv`` (its arrays, then the keys' document ids) as the
    kernels' ``(k, v, seg)``: ``expand`` of the arrays (None: they are ``k, v``)."""
    if expand is None:
        return kv
    fn, params = expand
    return (*fn(params, kv[:-1]), kv[-1])


def _expanded_with_pull(kv, expand):
    """:func:`_expanded` and the function taking ``(dk, dv)`` of the expanded block to
    ``(gradients of the travelling arrays, gradients of expand's parameters)``."""
    if expand is None:
        return kv, lambda dk, dv: ((dk, dv), ())
    fn, params = expand
    k, v = fn(params, kv[:-1])

    def grads(dk, dv):
        # taken back in the cotangents' dtype (fp32): the travelling gradients are fp32
        # accumulators as the plain ring's dk, dv are (the vjp of a bf16 expansion
        # refuses fp32 cotangents, measured); its forward recomputation is dead code
        def up(tree):
            return jax.tree.map(lambda a: a.astype(dk.dtype), tree)
        _, pull = jax.vjp(fn, up(params), up(kv[:-1]))
        d_params, d_block = pull((dk, dv))
        return d_block, d_params
    return (k, v, kv[-1]), grads


def _segments(seg, k_seg):
    """The kernels' ``(q_seg, k_seg)`` (None without document ids)."""
    return None if seg is None else (seg, k_seg)


class _Window:
    """A sliding window's block products of ring attention: each local zigzag half
    (chunk ``r``, chunk ``2c - 1 - r``) against each key chunk it can see, as one kernel
    call whose queries sit ``offset = (q chunk - k chunk) n`` positions after the keys
    (:func:`forward_blocks`' ``offset``): the kernel's loop bounds then visit no key block
    wholly before the window (none of a chunk two or more window lengths back), and mask
    the blocks crossing its edge. ``part(qi, kv, kj, src)``: local half ``qi`` x half
    ``kj`` of the block of device ``src``."""

    def __init__(self, q, seg, axis_name, bq, bk, window, dropout, rule):
        c, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
        self.n, self.c, self.bq, self.bk, self.window = q.shape[-2] // 2, c, bq, bk, window
        self.rule = rule
        self.chunks, self.dropout, self.seg = (r, 2 * c - 1 - r), dropout, seg

    def args(self, qi, kv, kj, src):
        """(k, v, keyword arguments) of the kernel call of one pair of halves."""
        n, c = self.n, self.c
        k_t, v_t, seg_t = kv
        q_chunk, k_chunk = self.chunks[qi], (src, 2 * c - 1 - src)[kj]
        keys = slice(kj * n, (kj + 1) * n)
        drop = None if self.dropout is None else (
            self.dropout, q_chunk * n + jnp.arange(n), k_chunk * n + jnp.arange(n))
        segments = _segments(None if self.seg is None else self.seg[:, qi * n:(qi + 1) * n],
                             None if seg_t is None else seg_t[:, keys])
        return k_t[..., keys, :], v_t[..., keys, :], dict(
            causal=True, bq=self.bq, bk=self.bk, drop=drop, segments=segments,
            window=self.window, offset=(q_chunk - k_chunk) * n, rule=self.rule)

    def half(self, x, qi):
        return x[..., qi * self.n:(qi + 1) * self.n, :]

    def forward(self, q, kv, src, pairs, o, lse):
        """``(o, lse)`` of the local rows merged with the pairs ``(qi, kj)``' products
        (``o`` None: the first products), and their count."""
        halves = [None if o is None else (self.half(o, i), lse[..., i * self.n:
                                                                (i + 1) * self.n])
                  for i in (0, 1)]
        count = jnp.int32(0)
        for qi, kj in pairs:
            k_t, v_t, kw = self.args(qi, kv, kj, src)
            o_p, lse_p, cnt = forward_blocks(self.half(q, qi), k_t, v_t, **kw)
            halves[qi] = (o_p, lse_p) if halves[qi] is None else _merge(*halves[qi], o_p,
                                                                        lse_p)
            count = count + cnt
        return (jnp.concatenate([h[0] for h in halves], axis=-2),
                jnp.concatenate([h[1] for h in halves], axis=-1), count)

    def backward(self, q, kv, src, pairs, d_out, lse, delta, dq):
        """``dq`` accumulated with the pairs' products, and the block's ``dk, dv``."""
        n = self.n
        dqs = [self.half(dq, 0), self.half(dq, 1)]
        dks = [None, None]
        count = jnp.int32(0)
        for qi, kj in pairs:
            k_t, v_t, kw = self.args(qi, kv, kj, src)
            rows = slice(qi * n, (qi + 1) * n)
            dqs[qi], dk_p, dv_p, cnt = backward_blocks(
                self.half(q, qi), k_t, v_t, self.half(d_out, qi), lse[..., rows],
                delta[..., rows], dqs[qi], **kw)
            dks[kj] = (dk_p, dv_p) if dks[kj] is None else (dks[kj][0] + dk_p,
                                                            dks[kj][1] + dv_p)
            count = count + cnt
        zero = [jnp.zeros_like(d) for d in next(d for d in dks if d is not None)]
        dks = [zero if d is None else d for d in dks]
        return (jnp.concatenate(dqs, axis=-2), jnp.concatenate([dks[0][0], dks[1][0]], -2),
                jnp.concatenate([dks[0][1], dks[1][1]], -2), count)


# The pairs of local query halves and key halves each ring step computes with a window:
# own keys (both halves causal, the second half after the first), a source before this
# device (its first chunk, before both local halves), a source after it (both its chunks,
# before the second local half only).
_OWN, _BEFORE, _AFTER = ((0, 0), (1, 1), (1, 0)), ((0, 0), (1, 0)), ((1, 0), (1, 1))


def ring_forward(q, block, seg, axis_name, bq, bk, dropout=None, window=None,
                 rule=ScoreRule(), expand=None):
    """Per device, zigzag shards ``q [b, h, g, 2n, d]``, the travelling ``block`` and the
    kernel document ids ``seg [b, 2n]`` (or None) -> (out fp32, lse, count); ``rule``:
    the scores' :class:`~sp_jax.attention.kernels.ScoreRule`. ``block``: ``(k [b, h, 2n,
    d], v [b, h, 2n, d_v])`` with ``expand`` None; else any arrays ``[b, 2n, ...]`` that
    ``expand = (fn, params)`` turns into them on every device, ``fn(params, block) -> (k,
    v)`` (multi-head latent attention's latent ring: the latent travels, each device
    up-projects it for its own heads)."""
    c, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    n = q.shape[-2] // 2
    own, drop_before, drop_after = _ring_drops(dropout, r, c, n)
    kv = (*block, seg)  # the keys' document ids travel with them
    recv = _shift(kv, axis_name, c) if c > 1 else None  # in flight during step 0
    k, v, _ = _expanded(kv, expand)
    if window is not None:
        w = _Window(q, seg, axis_name, bq, bk, window, dropout, rule)
        o, lse, count = w.forward(q, (k, v, seg), r, _OWN, None, None)
        before = lambda kv, src, o, lse: w.forward(  # noqa: E731
            q, _expanded(kv, expand), src, _BEFORE, o, lse)
        after = lambda kv, src, o, lse: w.forward(  # noqa: E731
            q, _expanded(kv, expand), src, _AFTER, o, lse)
        return _ring_loop_forward(recv, o, lse, count, before, after, axis_name, c, r)
    # step 0: own keys; the local zigzag rows are in increasing global order -> causal
    o, lse, count = forward_blocks(q, k, v, causal=True, bq=bq, bk=bk, drop=own,
                                   segments=_segments(seg, seg), rule=rule)

    def before(kv, src, o, lse):
        # source r - t < r: every local query sees the source's first chunk, none its
        # second: all 2n queries x the first n keys, unmasked
        k_t, v_t, seg_t = _expanded(kv, expand)
        o_p, lse_p, cnt = forward_blocks(
            q, k_t[..., :n, :], v_t[..., :n, :], causal=False, bq=bq, bk=bk,
            drop=drop_before(src), segments=_segments(seg, None if seg is None
                                                      else seg_t[:, :n]), rule=rule)
        return (*_merge(o, lse, o_p, lse_p), cnt)

    def after(kv, src, o, lse):
        # source after r: only the second local chunk sees keys, all 2n of them, unmasked
        k_t, v_t, seg_t = _expanded(kv, expand)
        o_p, lse_p, cnt = forward_blocks(
            q[..., n:, :], k_t, v_t, causal=False, bq=bq, bk=bk, drop=drop_after(src),
            segments=_segments(None if seg is None else seg[:, n:], seg_t), rule=rule)
        o2, lse2 = _merge(o[..., n:, :], lse[..., n:], o_p, lse_p)
        return (jnp.concatenate([o[..., :n, :], o2], axis=-2),
                jnp.concatenate([lse[..., :n], lse2], axis=-1), cnt)

    return _ring_loop_forward(recv, o, lse, count, before, after, axis_name, c, r)


def _ring_loop_forward(recv, o, lse, count, before, after, axis_name, c, r):
    """The ring's steps ``1 .. c - 1`` of the forward pass: ``before(kv, src, o, lse)``
    or ``after(...)`` on the block that arrived from ``src``."""
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


def ring_backward(res, d_out, seg, axis_name, bq, bk, dropout=None, window=None,
                  rule=ScoreRule(), expand=None):
    """Per device: the gradients of :func:`ring_forward` (its layouts; ``res = (q,
    block, out, lse)``): the ``block`` travels the ring again with fp32 accumulators of
    its gradients, which end at their owner (with ``expand``, each step's ``dk, dv``
    taken back through it: the travelling arrays' gradients, e.g. the latent's, travel,
    and ``expand``'s parameters' gradients are summed on each device). Returns (dq,
    block gradients, parameter gradients, count), fp32."""
    res, d_out = lax.optimization_barrier((res, d_out))  # no CSE with the forward pass
    q, block, out, lse = res
    c, r = lax.axis_size(axis_name), lax.axis_index(axis_name)
    n = q.shape[-2] // 2
    delta = row_delta(d_out, out)
    own, drop_before, drop_after = _ring_drops(dropout, r, c, n)
    kv = (*block, seg)
    recv_kv = _shift(kv, axis_name, c) if c > 1 else None
    (k, v, _), pull = _expanded_with_pull(kv, expand)
    if window is not None:
        w = _Window(q, seg, axis_name, bq, bk, window, dropout, rule)
        dq, dk, dv, count = w.backward(q, (k, v, seg), r, _OWN, d_out, lse, delta,
                                       fresh_zeros(q.shape, _F32, q))

        def windowed(pairs):
            def step(kv, src, dq):
                expanded, pull = _expanded_with_pull(kv, expand)
                dq, dk_p, dv_p, cnt = w.backward(q, expanded, src, pairs, d_out, lse, delta,
                                                 dq)
                return (dq, *pull(dk_p, dv_p), cnt)
            return step
        return _ring_loop_backward(recv_kv, *pull(dk, dv), dq, count, windowed(_BEFORE),
                                   windowed(_AFTER), axis_name, c, r)
    dq, dk, dv, count = backward_blocks(q, k, v, d_out, lse, delta,
                                         fresh_zeros(q.shape, _F32, q),
                                         causal=True, bq=bq, bk=bk, drop=own,
                                         segments=_segments(seg, seg), rule=rule)
    # gradient of the block held, summed over the devices it has visited; and of expand's
    # parameters, summed here
    acc, d_params = pull(dk, dv)

    def before(kv, src, dq):
        (k_t, v_t, seg_t), pull = _expanded_with_pull(kv, expand)
        dq, dk_p, dv_p, cnt = backward_blocks(
            q, k_t[..., :n, :], v_t[..., :n, :], d_out, lse, delta, dq, causal=False,
            bq=bq, bk=bk, drop=drop_before(src),
            segments=_segments(seg, None if seg is None else seg_t[:, :n]), rule=rule)
        pad = jnp.zeros_like(dk_p)
        pad_v = zeros_of_shape(pad, dv_p.shape, lambda: jnp.zeros_like(dv_p))
        return (dq, *pull(jnp.concatenate([dk_p, pad], axis=-2),
                          jnp.concatenate([dv_p, pad_v], axis=-2)), cnt)

    def after(kv, src, dq):
        (k_t, v_t, seg_t), pull = _expanded_with_pull(kv, expand)
        dq2, dk_p, dv_p, cnt = backward_blocks(
            q[..., n:, :], k_t, v_t, d_out[..., n:, :], lse[..., n:], delta[..., n:],
            dq[..., n:, :], causal=False, bq=bq, bk=bk, drop=drop_after(src),
            segments=_segments(None if seg is None else seg[:, n:], seg_t), rule=rule)
        return (jnp.concatenate([dq[..., :n, :], dq2], axis=-2), *pull(dk_p, dv_p), cnt)

    return _ring_loop_backward(recv_kv, acc, d_params, dq, count, before, after, axis_name,
                               c, r)


def _ring_loop_backward(recv_kv, acc, d_params, dq, count, before, after, axis_name, c, r):
    """The ring's steps ``1 .. c - 1`` of the backward pass, the block's gradient
    accumulators ``acc`` travelling with the blocks, ``d_params`` summed here; returns
    (dq, acc, d_params, count) at the owners."""
    for t in range(1, c):
        # The k/v block in flight has arrived before the accumulators leave: two
        # transfers XLA cannot combine into one that would wait for this step's compute.
        cur, acc = lax.optimization_barrier((recv_kv, acc))
        if t < c - 1:
            recv_kv = _shift(cur, axis_name, c)
        recv_acc = _shift(acc, axis_name, c)  # in flight during this step's compute
        src = (r - t) % c
        dq, d_block, d_params_p, cnt = lax.cond(src < r, before, after, cur, src, dq)
        acc = tuple(a + d for a, d in zip(recv_acc, d_block, strict=True))
        d_params = jax.tree.map(jnp.add, d_params, d_params_p)
        count = count + cnt
    if c > 1:  # the accumulators of block r + 1 go home
        acc = _shift(acc, axis_name, c)
    return dq, acc, d_params, count


def _ring_forward_bshd(q, k, v, seg, axis_name, bq, bk, dropout=None, window=None,
                       rule=ScoreRule()):
    o, lse, count = ring_forward(q_to_kernel(q, k.shape[2]), (to_bhsd(k), to_bhsd(v)), seg,
                                 axis_name, bq, bk, dropout, window, rule)
    return q_from_kernel(o).astype(q.dtype), lse, count


def _ring_backward_bshd(res, d_out, seg, axis_name, bq, bk, dropout=None, window=None,
                        rule=ScoreRule()):
    q, k, v, out, lse = res
    hk = k.shape[2]
    res = (q_to_kernel(q, hk), (to_bhsd(k), to_bhsd(v)), q_to_kernel(out, hk), lse)
    dq, (dk, dv), _, count = ring_backward(res, q_to_kernel(d_out, hk), seg, axis_name, bq,
                                           bk, dropout, window, rule)
    grads = (q_from_kernel(dq).astype(q.dtype), to_bshd(dk).astype(k.dtype),
             to_bshd(dv).astype(v.dtype))
    return grads, count


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9, 10))
def _ring(q, k, v, dropout, seg, axis_name, bq, bk, window, rule, offload=False):
    return _ring_forward_bshd(q, k, v, seg, axis_name, bq, bk, dropout, window, rule)[0]


def _ring_fwd(q, k, v, dropout, seg, axis_name, bq, bk, window, rule, offload):
    out, lse, _ = _ring_forward_bshd(q, k, v, seg, axis_name, bq, bk, dropout, window, rule)
    res, out = residuals_to_host((q, k, v, out, lse), out, offload)
    return out, (res, dropout, seg)


def _ring_bwd(axis_name, bq, bk, window, rule, offload, res, d_out):
    res, dropout, seg = res
    res, d_out = residuals_to_device(res, d_out, offload)
    return (*_ring_backward_bshd(res, d_out, seg, axis_name, bq, bk, dropout, window,
                                 rule)[0], None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 9, 10))
def _ring_traced(q, k, v, dropout, seg, axis_name, bq, bk, window, rule, offload=False):
    """:func:`_ring` with the window an int32 array (data: a scanned layer's)."""
    return _ring_forward_bshd(q, k, v, seg, axis_name, bq, bk, dropout, window, rule)[0]


def _ring_traced_fwd(q, k, v, dropout, seg, axis_name, bq, bk, window, rule, offload):
    out, lse, _ = _ring_forward_bshd(q, k, v, seg, axis_name, bq, bk, dropout, window, rule)
    res, out = residuals_to_host((q, k, v, out, lse), out, offload)
    return out, (res, dropout, seg, window)


def _ring_traced_bwd(axis_name, bq, bk, rule, offload, res, d_out):
    res, dropout, seg, window = res
    res, d_out = residuals_to_device(res, d_out, offload)
    return (*_ring_backward_bshd(res, d_out, seg, axis_name, bq, bk, dropout, window,
                                 rule)[0], None, None, None)


_ring_traced.defvjp(_ring_traced_fwd, _ring_traced_bwd)


def _ring_blocks(q, block_q: int, block_k: int) -> tuple[int, int]:
    if q.shape[1] % 2:
        raise ValueError(
            f"ring_attention: the local sequence length {q.shape[1]} (q shape {q.shape}) "
            "must be even: two zigzag chunks of seq / (2 * context) rows (see zigzag_order)."
        )
    n = q.shape[1] // 2
    return block_size(n, block_q, "block_q"), block_size(n, block_k, "block_k")


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, axis_name: AxisName,
                   block_q: int = 512, block_k: int = 512,
                   dropout: AttentionDropout | None = None,
                   segment_ids: jax.Array | None = None,
                   sliding_window: int | jax.Array | None = None,
                   scale: float | None = None, softcap: float | None = None,
                   offload_residuals: bool = False) -> jax.Array:
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
        the ring); ``v``'s head size may differ from q's and k's (``[batch, 2n,
        kv_heads, v_head_dim]``: the values, their gradients' accumulators and the output
        are that wide).
      axis_name: the context mesh axis.
      block_q / block_k: query / key rows per block: the largest divisors of ``n`` up to
        these.
      dropout: dropout on the probabilities (:class:`AttentionDropout`; the positions are
        the zigzag layout's global ones), or None.
      segment_ids: int ``[batch, 2n]``: the document ids of the local zigzag rows (0 =
        padding), or None. They travel the ring with the keys; a query attends only to
        keys of its own document, and block products that share no document are skipped
        (as in :func:`blockwise_attention`).
      sliding_window: the keys each query sees (itself included; Mistral's window), or
        None (every earlier key): key chunks wholly before a query chunk's window are
        not visited, those crossing its edge are masked. Also an int scalar array
        (traced: a scanned layer's window, ``GPTConfig.layer_windows``): the same loop
        bounds, computed from the traced value.
      scale / softcap: the scores' factor (None: ``head_dim ** -0.5``) and soft cap
        (None, or ``c``: ``c * tanh(s / c)`` before the mask), as in
        :func:`blockwise_attention`; the log-sum-exp merge of the ring's steps holds for
        the capped scores as for any.
      offload_residuals: keep the residuals (``q, k, v``, output, log-sum-exp) in host
        memory between the passes (``ParallelConfig.offload_activations``).
    Returns:
      ``[batch, 2n, heads, v_head_dim]`` in ``q.dtype``, causal over global positions, in
      the same zigzag layout as ``q``.
    """
    check_qkv("ring_attention", q, k, v)
    traced = isinstance(sliding_window, jax.Array)
    if traced:
        sliding_window = check_window("ring_attention", sliding_window)
    elif sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(
            sliding_window, int) or sliding_window < 1):
        raise ValueError(f"ring_attention: sliding_window={sliding_window!r} must be a "
                         "positive int (keys per query, itself included) or None.")
    bq, bk = _ring_blocks(q, block_q, block_k)
    rule = score_rule("ring_attention", scale, softcap)
    q, k, v = same_vma(q, k, v)
    q, k, v = (vary(x, (axis_name,)) for x in (q, k, v))
    drop = drop_arguments(dropout, None, q.shape[1], "xla")
    seg = check_segments("ring_attention", segment_ids, q)
    if seg is not None:
        seg = vary(seg, (axis_name,))
    return (_ring_traced if traced else _ring)(
        q, k, v, None if drop is None else drop[0], seg, axis_name, bq, bk, sliding_window,
        rule, bool(offload_residuals))


"""The attention kernels with a value head size apart from the query/key one (multi-head
latent attention's ``v_head_dim``): blockwise, ring and Ulysses (forward and gradients)
and the cached decode attention, with grouped-query heads, packed documents, windows
(static and traced), soft caps, scales and dropout, against a plain dense attention
(cuDNN's kernel refuses such values: tests/test_errors.py, E79)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import dense_attention, slow_except
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from sp_jax import attention as A
from sp_jax.attention.dropout import drop_scale

DQK = 8
RATE = 0.25


def inputs(b, s, h, hk, dv, seed=0):
    """``q [b, s, h, DQK]``, ``k [b, s, hk, DQK]``, ``v [b, s, hk, dv]`` and an output
    cotangent ``[b, s, h, dv]``."""
    keys = jax.random.split(jax.random.key(seed), 4)
    return tuple(jax.random.normal(key, shape) for key, shape in zip(
        keys, ((b, s, h, DQK), (b, s, hk, DQK), (b, s, hk, dv), (b, s, h, dv)), strict=True))


def packed_ids(b, s):
    """Document ids of packed rows: three documents, the last cut short by padding (0)."""
    row = np.concatenate([np.full(s // 4, 1), np.full(s // 2, 2), np.full(s // 8, 3),
                          np.zeros(s - s // 4 - s // 2 - s // 8)])
    return jnp.asarray(np.tile(row, (b, 1)), jnp.int32)


def dropout_factors(dropout, b, h, hk, s):
    """The dropout factors ``[b, h, s, s]`` the kernels apply (their mask's definition,
    :func:`~sp_jax.attention.dropout.drop_scale`, over the whole square at once)."""
    pos = jnp.arange(s, dtype=jnp.int32)
    z = drop_scale((dropout, pos, pos), 0, 0, (b, hk, h // hk, s, s))
    return z.reshape(b, h, s, s)


def vjp_of(f, q, k, v, do):
    out, back = jax.vjp(f, q, k, v)
    return out, back(do)


def assert_close(got, want, tol=2e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.shape == w.shape, (g.shape, w.shape)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol)


def _dropout(seed=7, **offsets):
    return A.AttentionDropout(jnp.array([seed, 2 * seed + 1], jnp.uint32), RATE, **offsets)


# Each case: (d_v, the kernels' keyword arguments, the reference's); "plain" is the fast one.
CASES = {
    "plain": (2 * DQK, {}, {}),
    "narrow": (DQK // 2, {}, {}),
    "documents-window-softcap": (2 * DQK, dict(sliding_window=5, softcap=4.0, scale=0.3),
                                 dict(window=5, softcap=4.0, scale=0.3)),
    "traced-window": (2 * DQK, dict(sliding_window=jnp.int32(5)), dict(window=5)),
    "dropout": (2 * DQK, dict(dropout=_dropout()), {}),
}


@pytest.mark.parametrize("case", slow_except(tuple(CASES), "plain"))
def test_blockwise_value_head_size_matches_dense(case):
    """blockwise_attention with ``d_v != d``: output ``[b, s, h, d_v]`` and the gradients
    of q, k and v against the dense reference, grouped-query heads, blocks of 4 x 8
    (masked, skipped and unmasked blocks)."""
    dv, kw, ref_kw = CASES[case]
    b, s, h, hk = 2, 32, 4, 2
    q, k, v, do = inputs(b, s, h, hk, dv)
    if case == "documents-window-softcap":
        kw = dict(kw, segment_ids=packed_ids(b, s))
        ref_kw = dict(ref_kw, segments=packed_ids(b, s))
    if case == "dropout":
        ref_kw = dict(z=dropout_factors(kw["dropout"], b, h, hk, s))
    got = vjp_of(functools.partial(A.blockwise_attention, block_q=4, block_k=8, **kw),
                 q, k, v, do)
    assert got[0].shape == (b, s, h, dv)
    assert_close(got, vjp_of(functools.partial(dense_attention, **ref_kw), q, k, v, do))


def _mesh():
    return jax.make_mesh((2, 2, 2), ("data", "context", "tensor"),
                         axis_types=(AxisType.Explicit,) * 3, devices=jax.devices()[:8])


@functools.cache
def _context_vjp(mode, window, softcap, packed, dropout):
    """``(q, k, v, do, seg) -> (out, grads)`` on global unpermuted arrays: ``mode``
    attention inside a shard_map over (data=2, context=2, tensor=2), the sequence over
    "context" (zigzag for the ring), batch over "data", heads over "tensor"."""
    mesh = _mesh()
    spec, tokens = P("data", "context", "tensor", None), P("data", "context")
    kernel = A.ring_attention if mode == "ring" else A.ulysses_attention

    def local(q, k, v, seg):
        drop = _dropout(batch_offset=jax.lax.axis_index("data") * q.shape[0],
                        head_offset=jax.lax.axis_index("tensor") * q.shape[2]) \
            if dropout else None
        return kernel(q, k, v, axis_name="context", block_q=2, block_k=4, dropout=drop,
                      segment_ids=seg if packed else None, sliding_window=window,
                      softcap=softcap)

    inner = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, tokens),
                          out_specs=spec)

    def attention(q, k, v, seg):
        s = q.shape[1]
        if mode == "ring":  # zigzag in, zigzag out
            perm, inv = A.zigzag_order(s, 2), A.zigzag_inverse(s, 2)
            q, k, v, seg = (x[:, perm] for x in (q, k, v, seg))
        out = inner(*(jax.reshard(x, spec) for x in (q, k, v)), jax.reshard(seg, tokens))
        out = jax.reshard(out, P())
        return out[:, inv] if mode == "ring" else out

    @jax.jit
    def f(q, k, v, do, seg):
        return vjp_of(lambda q, k, v: attention(q, k, v, seg), q, k, v, do)

    def call(*args):
        with jax.set_mesh(mesh):
            return f(*args)

    return call


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
@pytest.mark.parametrize("features", ["plain", "documents-window-softcap", "dropout"])
def test_context_parallel_value_head_size_matches_dense(mode, features):
    """Ring (its k/v transfers and dk/dv accumulators ``d_v`` wide) and Ulysses with
    ``d_v = 2 d`` on a (data, context, tensor) mesh: outputs and gradients equal the
    dense reference, with packed documents, a window and a soft cap, or dropout
    (the masks of global rows and heads)."""
    b, s, h, hk, dv = 4, 32, 8, 4, 2 * DQK
    q, k, v, do = inputs(b, s, h, hk, dv, seed=1)
    seg = packed_ids(b, s)
    window, softcap = (6, 3.0) if features == "documents-window-softcap" else (None, None)
    ref_kw = dict(window=window, softcap=softcap)
    if features == "documents-window-softcap":
        ref_kw["segments"] = seg
    if features == "dropout":
        ref_kw["z"] = dropout_factors(_dropout(), b, h, hk, s)
    got = _context_vjp(mode, window, softcap, features == "documents-window-softcap",
                       features == "dropout")(q, k, v, do, seg)
    assert got[0].shape == (b, s, h, dv)
    assert_close(got, vjp_of(functools.partial(dense_attention, **ref_kw), q, k, v, do))


def _cached_attention(new, k_cache, v_cache, positions, split, **kw):
    """``cached_attention`` of the new tokens ``new = (q, k, v)`` against the cache, whole
    or (``split``) with the cache split over a context axis of 2 (each device its half of
    the positions; the log-sum-exp merge)."""
    if not split:
        return A.cached_attention(*new, k_cache, v_cache, positions, **kw)
    s = k_cache.shape[1]
    mesh = jax.make_mesh((2,), ("context",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:2])
    seq = P(None, "context")

    def local(q, k_new, v_new, k_cache, v_cache, positions):
        held = jax.lax.axis_index("context") * (s // 2) + jnp.arange(s // 2)
        return A.cached_attention(q, k_new, v_new, k_cache, v_cache, positions,
                                  cache_positions=held, axis_name="context", **kw)

    with jax.set_mesh(mesh):
        return jax.jit(jax.shard_map(local, in_specs=(P(),) * 3 + (seq, seq, P()),
                                     out_specs=P()))(*new, jax.reshard(k_cache, seq),
                                                     jax.reshard(v_cache, seq), positions)


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True])
def test_cached_attention_value_head_size_matches_dense(split):
    """One query token per row against a cache of ``d_v``-wide values (rows at different
    positions; a window of 5 and a soft cap), whole or split over a context axis of 2
    (the log-sum-exp merge), equals the dense attention's row at that position."""
    b, s, h, hk, dv = 2, 16, 4, 2, 2 * DQK
    q, k, v, _ = inputs(b, s, h, hk, dv, seed=2)
    positions = jnp.array([9, 14])
    rows = jnp.arange(b)
    want = dense_attention(q, k, v, window=5, softcap=3.0)[rows, positions]  # [b, h, dv]
    args = (q[rows, positions][:, None], k[rows, positions][:, None],
            v[rows, positions][:, None])
    got = _cached_attention(args, k, v, positions, split, sliding_window=5, softcap=3.0)
    assert got.shape == (b, 1, h * dv)
    assert_close(got.reshape(b, h, dv), want)


@pytest.mark.parametrize("split", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_cached_attention_of_several_tokens_matches_dense(split):
    """Three consecutive query tokens per row (speculative decoding's verification),
    rows at different positions, against a cache of ``d_v``-wide values whose entries at
    and past each row's first position are stale (a rejected draft's: never read), a
    window of 5 and a soft cap, whole or split over a context axis of 2: each token
    equals the dense attention's row at its position."""
    b, s, h, hk, dv, steps = 2, 16, 4, 2, 2 * DQK, 3
    q, k, v, _ = inputs(b, s, h, hk, dv, seed=3)
    first = jnp.array([6, 12])
    at = first[:, None] + jnp.arange(steps)  # [b, T]
    rows = jnp.arange(b)[:, None]
    want = dense_attention(q, k, v, window=5, softcap=3.0)[rows, at]  # [b, T, h, dv]
    args = (q[rows, at], k[rows, at], v[rows, at])
    stale = jnp.arange(s)[None, :, None, None] >= first[:, None, None, None]
    k_cache, v_cache = jnp.where(stale, 7.0, k), jnp.where(stale, -7.0, v)
    got = _cached_attention(args, k_cache, v_cache, first, split, sliding_window=5,
                            softcap=3.0)
    assert got.shape == (b, steps, h * dv)
    assert_close(got.reshape(b, steps, h, dv), want)


@pytest.mark.slow  # the fast tier has the several tokens against dense attention
def test_cached_attention_tokens_at_negative_positions_are_none():
    """Tokens whose positions are negative (speculative decoding's later modules at a
    one-token prompt) are no tokens: the tokens at positions 0, 1 after two of them
    equal attention over a sequence that starts with them (an empty cache)."""
    b, s, h, hk, dv = 1, 4, 4, 2, DQK
    q, k, v, _ = inputs(b, s, h, hk, dv, seed=4)
    got = A.cached_attention(q, k, v, jnp.zeros((b, 3, hk, DQK)), jnp.zeros((b, 3, hk, dv)),
                             jnp.array([-2]))
    want = dense_attention(q[:, 2:], k[:, 2:], v[:, 2:])
    assert_close(got.reshape(b, s, h, dv)[:, 2:], want)

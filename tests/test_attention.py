"""The long-context attention kernels of sp_jax.attention against an independent plain
attention (explicit causal mask, jax.nn.softmax), forward and gradients; blocks skipped,
not masked; ring and Ulysses on context meshes; their collectives; no s x s buffer."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import h100_block_stack
from conftest import requires_cuda_plugin
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from sp_jax import attention as A
from sp_jax.analysis import parse_collectives
from sp_jax.attention import blockwise, kernels, ring

# --------------------------------------------------------------------------------------
# The independent reference and helpers
# --------------------------------------------------------------------------------------


def naive_attention(q, k, v):
    """Plain causal attention in fp32 with the whole s x s score matrix; grouped-query
    k, v are repeated to the query heads first (Hugging Face's ``repeat_kv``)."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    s = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    mask = np.tril(np.ones((s, s), dtype=bool))
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


@jax.jit
def naive_vjp(q, k, v, do):
    out, vjp = jax.vjp(naive_attention, q, k, v)
    return out, vjp(do)


def inputs(shape, seed=0, dtype=jnp.float32, kv_heads=None):
    """q, k, v and an output cotangent (k, v with ``kv_heads`` heads if given)."""
    kv_shape = shape if kv_heads is None else (*shape[:2], kv_heads, shape[3])
    return tuple(jax.random.normal(key, s, dtype) for key, s in zip(
        jax.random.split(jax.random.key(seed), 4), (shape, kv_shape, kv_shape, shape),
        strict=True))


def assert_close(got, want, rtol=1e-5, atol=1e-5):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=rtol, atol=atol)


@functools.cache
def blockwise_vjp(block_q, block_k):
    def f(q, k, v, do):
        out, vjp = jax.vjp(
            functools.partial(A.blockwise_attention, block_q=block_q, block_k=block_k),
            q, k, v)
        return out, vjp(do)

    return jax.jit(f)


# --------------------------------------------------------------------------------------
# blockwise_attention
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "seq,block_q,block_k,blocks",
    [
        pytest.param(30, 6, 6, (5, 5), marks=pytest.mark.slow),  # an odd number of blocks
        pytest.param(30, 10, 6, (3, 5), marks=pytest.mark.slow),  # unequal blocks, odd counts
        (30, 4, 7, (10, 5)),  # blocks: the largest divisors of 30 up to 4 and 7 -> 3, 6
        pytest.param(16, 512, 512, (1, 1), marks=pytest.mark.slow),  # one block
    ],
)
def test_blockwise_matches_naive_fp32(seq, block_q, block_k, blocks):
    bq, bk = kernels.block_size(seq, block_q), kernels.block_size(seq, block_k)
    assert (seq // bq, seq // bk) == blocks
    args = inputs((2, seq, 3, 8), seed=seq + block_q)
    assert_close(blockwise_vjp(block_q, block_k)(*args), naive_vjp(*args))


@pytest.mark.parametrize("kv_heads", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_blockwise_grouped_query_matches_repeated_kv(kv_heads):
    """Grouped-query (6 query heads over 2 key/value heads) and multi-query attention:
    the kernel's k, v gradients sum over each group, like autodiff of repeat_kv."""
    args = inputs((2, 30, 6, 8), seed=kv_heads, kv_heads=kv_heads)
    assert_close(blockwise_vjp(6, 10)(*args), naive_vjp(*args))


@pytest.mark.slow
def test_blockwise_bf16_within_bf16_rounding():
    """bf16 inputs against the fp32 reference on the same (bf16-rounded) inputs.

    The kernel's statistics and accumulations are fp32; what bf16 adds is the rounding
    of the matmul operands (probabilities, score gradients: relative error u = 2^-9
    each) and of the results (u again). Each output element is a sum of such products,
    so its error is below ~3u times the sum of the magnitudes of its terms; for these
    O(1) inputs those sums are below ~4 max|reference|, so 2^-5 max|reference| (16u x
    the largest reference value... with margin) bounds it. Plain bf16 autodiff of the
    naive attention has errors of the same size (checked below, within 2x).
    """
    args = inputs((2, 64, 4, 16), seed=3, dtype=jnp.bfloat16)
    got = blockwise_vjp(16, 32)(*args)
    want = naive_vjp(*(x.astype(jnp.float32) for x in args))
    plain = jax.jit(lambda q, k, v, do: jax.vjp(
        lambda q, k, v: naive_bf16(q, k, v), q, k, v)[1](do))(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == jnp.bfloat16
        err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)))
        assert err <= 2.0 ** -5 * float(jnp.max(jnp.abs(w))), err
    for g, p, w in zip(jax.tree.leaves(got)[1:], plain, want[1], strict=True):
        err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - w)))
        plain_err = float(jnp.max(jnp.abs(p.astype(jnp.float32) - w)))
        assert err <= 2 * plain_err + 1e-3, (err, plain_err)


def naive_bf16(q, k, v):
    """Plain autodiff-able causal attention computed in bf16 (the accuracy yardstick)."""
    s = q.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1]).astype(q.dtype)
    mask = np.tril(np.ones((s, s), dtype=bool))
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.mark.slow
def test_blocks_above_the_diagonal_are_skipped():
    """The kernels' loop counters (carried by the compiled while loops, one per block
    product) count exactly the causal blocks: n (n + 1) / 2 of n^2 for n equal blocks,
    forward and backward; no score block is larger than block_q x block_k."""
    q, k, v, do = inputs((1, 48, 2, 8), seed=1)
    for block_q, block_k, n_q, n_k in ((8, 8, 6, 6), (16, 6, 3, 8), (6, 16, 8, 3)):
        fwd = jax.jit(blockwise._blockwise_forward, static_argnums=(3, 4, 5, 6))
        bwd = jax.jit(blockwise._blockwise_backward, static_argnums=(2, 3, 4, 5))
        out, lse, count = fwd(q, k, v, None, None, block_q, block_k)
        _, count_bwd = bwd((q, k, v, out, lse), do, None, None, block_q, block_k)
        expected = A.attention_block_counts(48, 1, mode="local", block_q=block_q,
                                            block_k=block_k)
        assert int(count) == int(count_bwd) == int(expected[0])
        # independently: the (query block, key block) pairs with any unmasked entry
        causal = sum(j * block_k <= i * block_q + block_q - 1
                     for i in range(n_q) for j in range(n_k))
        assert int(count) == causal < n_q * n_k
        if block_q == block_k:
            assert int(count) == n_q * (n_q + 1) // 2
    jaxpr = jax.make_jaxpr(jax.grad(
        lambda q: A.blockwise_attention(q, k, v, block_q=16, block_k=8).sum()))(q)
    dots = [e for e in _all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert dots and all(np.prod(e.outvars[0].aval.shape) <= 2 * 16 * 16 for e in dots)


def naive_window_attention(q, k, v, window, segment_ids=None):
    """Plain fp32 attention with the whole s x s mask: query ``i`` sees keys ``i - window
    < j <= i`` (transformers' sliding window) of its own document."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    k, v = (jnp.repeat(x, q.shape[2] // k.shape[2], axis=2) for x in (k, v))
    s = q.shape[1]
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    mask = jnp.asarray((j <= i) & (j > i - window))[None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.mark.parametrize("seq,block_q,block_k,window,kv_heads,packed", [
    # the window inside a block, blocks skipped both ways
    pytest.param(24, 4, 6, 5, None, False, marks=pytest.mark.slow),
    # unequal blocks, grouped-query
    pytest.param(30, 10, 6, 7, 2, False, marks=pytest.mark.slow),
    # each query sees itself only
    pytest.param(30, 6, 10, 1, None, False, marks=pytest.mark.slow),
    # packed documents: both masks, both skips
    (24, 8, 4, 13, None, True),
    # a window longer than the sequence: plain causal
    pytest.param(16, 4, 4, 64, 1, False, marks=pytest.mark.slow),
])
def test_sliding_window_matches_dense_reference(seq, block_q, block_k, window, kv_heads,
                                                packed):
    """Forward and gradients equal a dense masked softmax in fp32; the block products
    computed (forward = backward) are exactly the (query block, key block) pairs with a
    key inside some query's window, so the blocks wholly before the window are skipped."""
    q, k, v, do = inputs((2, seq, 4, 8), seed=seq + window, kv_heads=kv_heads)
    seg = None
    if packed:  # documents of 5, 11 and 8 rows; the second row: 13 rows, then padding
        seg = jnp.asarray([[1] * 5 + [2] * 11 + [3] * 8, [4] * 13 + [0] * 11], jnp.int32)
    f = functools.partial(A.blockwise_attention, block_q=block_q, block_k=block_k,
                          sliding_window=window, segment_ids=seg)
    got = jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, vjp(do)))(*jax.vjp(f, q, k, v)))(
        q, k, v, do)
    ref = functools.partial(naive_window_attention, window=window, segment_ids=seg)
    want = jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, vjp(do)))(*jax.vjp(ref, q, k, v)))(
        q, k, v, do)
    assert_close(got, want)
    bq, bk = kernels.block_size(seq, block_q), kernels.block_size(seq, block_k)
    kseg = None if seg is None else kernels.kernel_segments(seg)
    out, lse, count = blockwise._blockwise_forward(q, k, v, None, kseg, bq, bk, window)
    _, count_bwd = blockwise._blockwise_backward((q, k, v, out, lse), do, None, kseg, bq,
                                                 bk, window)
    band = sum(j * bk <= i * bq + bq - 1 and j * bk + bk - 1 > i * bq - window
               for i in range(seq // bq) for j in range(seq // bk))
    assert int(count) == int(count_bwd)
    if not packed:
        assert int(count) == band
        causal = sum(j * bk <= i * bq + bq - 1 for i in range(seq // bq)
                     for j in range(seq // bk))
        assert band < causal or window >= seq
    else:
        assert int(count) < band  # blocks of other documents skipped as well


@pytest.mark.slow
def test_sliding_window_errors_and_context_parallel():
    q = jnp.zeros((1, 8, 2, 4))
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="sliding_window=.* must be a positive int"):
            A.blockwise_attention(q, q, q, sliding_window=bad)
    mesh, spec = context_mesh((2,), ("context",)), P(None, "context")

    def sharded(kernel, **kw):
        inner = jax.shard_map(functools.partial(kernel, axis_name="context", **kw),
                              mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        return jax.jit(lambda *a: inner(*(jax.reshard(x, spec) for x in a)))

    for bad in (0, 2.0):
        with jax.set_mesh(mesh), pytest.raises(ValueError, match="sliding_window=.* must be "
                                               "a positive int"):
            sharded(A.ring_attention, sliding_window=bad)(q, q, q)
    # Ulysses: the head shards hold the whole sequence, the window is exact
    q, k, v, _ = inputs((1, 16, 4, 8), seed=11)
    with jax.set_mesh(mesh):
        got = sharded(A.ulysses_attention, block_q=4, block_k=4, sliding_window=3)(q, k, v)
    assert_close(got, naive_window_attention(q, k, v, 3))


def _all_eqns(jaxpr):
    yield from jaxpr.eqns
    for sub in jax.extend.core.subjaxprs(jaxpr):
        yield from _all_eqns(sub)


def test_blockwise_input_errors():
    q = jnp.zeros((1, 8, 2, 4))
    with pytest.raises(ValueError, match=r"must agree.*got q \(1, 8, 2, 4\), k \(1, 4"):
        A.blockwise_attention(q, q[:, :4], q)
    with pytest.raises(ValueError, match="heads a multiple of kv_heads"):
        A.blockwise_attention(jnp.zeros((1, 8, 3, 4)), q, q)
    with pytest.raises(ValueError, match="implementation='tpu'.*'xla' or 'cudnn'"):
        A.blockwise_attention(q, q, q, implementation="tpu")
    with pytest.raises(ValueError, match="block_q=0"):
        A.blockwise_attention(q, q, q, block_q=0)
    # cuDNN's kernel takes fp16 / bf16 only: refused on every backend, naming the fix
    with pytest.raises(ValueError, match=r"implementation='cudnn' takes float16 or bfloat16 q, "
                                         r"k and v .*got float32.*implementation='xla'"):
        A.blockwise_attention(q, q, q, implementation="cudnn")
    with pytest.raises(ValueError, match=r"got bfloat16, float32, bfloat16"):
        A.blockwise_attention(q.astype(jnp.bfloat16), q, q.astype(jnp.bfloat16),
                              implementation="cudnn")
    if jax.default_backend() == "cpu":
        with pytest.raises(RuntimeError, match="cuDNN.*implementation='xla'"):
            A.blockwise_attention(*(q.astype(jnp.bfloat16),) * 3, implementation="cudnn")


# --------------------------------------------------------------------------------------
# zigzag_order and attention_block_counts
# --------------------------------------------------------------------------------------


def test_zigzag_order():
    np.testing.assert_array_equal(A.zigzag_order(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
    np.testing.assert_array_equal(A.zigzag_order(6, 1), np.arange(6))
    for s, c in ((48, 4), (96, 8)):
        perm, inv = A.zigzag_order(s, c), A.zigzag_inverse(s, c)
        np.testing.assert_array_equal(np.sort(perm), np.arange(s))
        np.testing.assert_array_equal(perm[inv], np.arange(s))
        n = s // (2 * c)
        for r, shard in enumerate(perm.reshape(c, 2 * n)):  # device r: chunks r, 2c-1-r
            np.testing.assert_array_equal(shard // n, [r] * n + [2 * c - 1 - r] * n)
    with pytest.raises(ValueError, match=r"seq_len=12 .* 2 \* context = 8"):
        A.zigzag_order(12, 4)


def test_attention_block_counts_balance():
    s = 8192
    for c in (2, 4, 8):
        zigzag = A.attention_block_counts(s, c, mode="ring", block_q=512, block_k=512)
        contiguous = A.attention_block_counts(s, c, mode="ring_contiguous", block_q=512,
                                              block_k=512)
        ulysses = A.attention_block_counts(s, c, mode="ulysses", block_q=512, block_k=512)
        assert zigzag.shape == contiguous.shape == ulysses.shape == (c,)
        assert zigzag.max() <= 1.1 * zigzag.mean()  # balanced (here exactly)
        assert contiguous.max() >= 1.4 * contiguous.mean()  # the last device does most
        # the ring does no redundant work: every device's products add up to one device's
        # causal attention over the whole sequence in the same blocks
        n = s // (2 * c)
        local = A.attention_block_counts(s, 1, mode="local", block_q=min(512, n),
                                         block_k=min(512, n))
        assert zigzag.sum() == local[0]
        assert contiguous.sum() == local[0] if (s // c) % 512 == 0 else True
    # the largest divisors: 8192 / 16 = 512-row chunks -> blocks of 512 (the last row of
    # a 2-block causal product plus 7 unmasked steps of 2 x 1 blocks)
    np.testing.assert_array_equal(
        A.attention_block_counts(8192, 8, mode="ring", block_q=512, block_k=512),
        [3 + 7 * 2] * 8)
    np.testing.assert_array_equal(
        A.attention_block_counts(12, 1, mode="local", block_q=4, block_k=4), [6])
    with pytest.raises(ValueError, match="mode='zigzag'"):
        A.attention_block_counts(64, 2, mode="zigzag", block_q=8, block_k=8)
    with pytest.raises(ValueError, match="context=2 must be 1"):
        A.attention_block_counts(64, 2, mode="local", block_q=8, block_k=8)


# --------------------------------------------------------------------------------------
# ring_attention and ulysses_attention inside shard_map
# --------------------------------------------------------------------------------------


def context_mesh(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape),
                         devices=jax.devices()[:n])


@functools.cache
def sharded_vjp(shape, names, mode, block_q, block_k, window=None):
    """A jitted ``(q, k, v, do) -> (out, (dq, dk, dv))`` on global, unpermuted arrays:
    ``mode`` ("ring" or "ulysses") inside shard_map over the mesh ``(shape, names)``,
    the sequence on "context", batch on "data", heads on "tensor" where present."""
    mesh = context_mesh(shape, names)
    spec = P(*(a if a in names else None for a in ("data", "context", "tensor")), None)
    c = dict(zip(names, shape, strict=True))["context"]
    kernel = A.ring_attention if mode == "ring" else A.ulysses_attention
    inner = jax.shard_map(
        functools.partial(kernel, axis_name="context", block_q=block_q, block_k=block_k,
                          sliding_window=window),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

    def attention(q, k, v):
        s = q.shape[1]
        if mode == "ring":  # zigzag in, zigzag out
            perm, inv = A.zigzag_order(s, c), A.zigzag_inverse(s, c)
            q, k, v = (x[:, perm] for x in (q, k, v))
        out = inner(*(jax.reshard(x, spec) for x in (q, k, v)))
        out = jax.reshard(out, P())
        return out[:, inv] if mode == "ring" else out

    def f(q, k, v, do):
        out, vjp = jax.vjp(attention, q, k, v)
        return out, vjp(do)

    jitted = jax.jit(f)

    def call(*args):
        with jax.set_mesh(mesh):
            return jitted(*args)

    call.lower = lambda *args: _lower(mesh, jitted, *args)
    return call


def _lower(mesh, jitted, *args):
    with jax.set_mesh(mesh):
        return jitted.lower(*args)


# 2n = 12 rows per device, chunks of n = 6: ring blocks 2 x 3 rows (3 and 2 blocks per
# chunk: odd numbers and unequal sizes); Ulysses over s = 12 c rows, blocks 4c and 3c
# rows (3 and 4 blocks).
@pytest.mark.parametrize("c", [  # 4: the composed meshes below, tests/test_context
    2, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_context_parallel_matches_naive(mode, c):
    shape = (1, 12 * c, 8, 8)
    blocks = (2, 3) if mode == "ring" else (4 * c, 3 * c)
    args = inputs(shape, seed=c)
    got = sharded_vjp((c,), ("context",), mode, *blocks)(*args)
    assert_close(got, naive_vjp(*args))


@pytest.mark.slow
@pytest.mark.parametrize("mode,kv_heads", [("ring", None), ("ulysses", None), ("ring", 2),
                                           ("ulysses", 4)])
def test_context_parallel_composed_with_data_and_tensor(mode, kv_heads):
    """A (data=2, context=2, tensor=2) mesh: batch on data, heads on tensor as well;
    grouped-query k, v (one or two key/value heads per tensor shard; the ring passes only
    those)."""
    heads = 4 if kv_heads is None else 8
    args = inputs((2, 20, heads, 8), seed=5, kv_heads=kv_heads)  # ring blocks: 5 and 1
    got = sharded_vjp((2, 2, 2), ("data", "context", "tensor"), mode, 5, 1)(*args)
    assert_close(got, naive_vjp(*args))


def _ring_window_counts(s, c, bq, bk, window):
    """The block products device ``r`` computes with a sliding window, from the pairs of
    zigzag chunks (``n = s / 2c`` rows each) it attends: per pair, the (query block, key
    block) pairs with a key inside some query's window (global positions)."""
    n = s // (2 * c)

    def band(q0, k0):  # chunk at q0 attending the chunk at k0 (k0 <= q0)
        return sum(k0 + j * bk <= q0 + i * bq + bq - 1
                   and k0 + j * bk + bk - 1 > q0 + i * bq - window
                   for i in range(n // bq) for j in range(n // bk))

    counts = []
    for r in range(c):
        mine = (r, 2 * c - 1 - r)
        total = band(mine[0] * n, mine[0] * n) + band(mine[1] * n, mine[1] * n) + band(
            mine[1] * n, mine[0] * n)
        for src in range(c):
            if src < r:
                total += band(mine[0] * n, src * n) + band(mine[1] * n, src * n)
            elif src > r:
                total += band(mine[1] * n, src * n) + band(mine[1] * n,
                                                            (2 * c - 1 - src) * n)
        counts.append(total)
    return counts


# zigzag over c = 4: 2n = 12 rows per device, chunks of n = 6 (blocks of 2 and 3 rows)
@pytest.mark.parametrize("window", [
    5,  # inside a chunk: every pair of chunks one apart masked, farther ones skipped
    pytest.param(1, marks=pytest.mark.slow),  # each query sees itself only
    pytest.param(9, marks=pytest.mark.slow),  # across a chunk boundary
    pytest.param(13, marks=pytest.mark.slow),  # over two chunks
    pytest.param(64, marks=pytest.mark.slow),  # longer than the sequence: plain causal
])
def test_ring_sliding_window_matches_dense_reference(window):
    """Ring attention with a sliding window on the zigzag order (context 4): output and
    gradients equal a dense masked softmax (fp32, 1e-5); the block products each device
    computes (forward = backward) are exactly those of the chunk pairs it attends with a
    key inside some query's window: the key blocks wholly before the window are not
    visited (fewer than without the window, unless it spans the sequence)."""
    c, s = 4, 48
    args = inputs((1, s, 4, 8), seed=window, kv_heads=2)
    got = sharded_vjp((c,), ("context",), "ring", 2, 3, window)(*args)
    want = jax.jit(lambda q, k, v, do: (lambda o, vjp: (o, vjp(do)))(
        *jax.vjp(functools.partial(naive_window_attention, window=window), q, k, v)))(*args)
    assert_close(got, want)
    mesh = context_mesh((c,), ("context",))
    spec = P(None, "context")
    bq, bk = ring._ring_blocks(jnp.zeros((1, s // c)), 2, 3)

    def per_device(q, k, v, do):
        out, lse, count = ring._ring_forward_bshd(q, k, v, None, "context", bq, bk,
                                                  window=window)
        _, count_bwd = ring._ring_backward_bshd((q, k, v, out, lse), do, None, "context", bq,
                                                bk, window=window)
        return jnp.stack([count, count_bwd])[None]

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 4,
                              out_specs=P("context")))
    with jax.set_mesh(mesh):
        counts = np.asarray(f(*(jax.reshard(x, spec) for x in inputs((1, s, 2, 4)))))
    want_counts = _ring_window_counts(s, c, bq, bk, window)
    np.testing.assert_array_equal(counts[:, 0], want_counts)
    np.testing.assert_array_equal(counts[:, 1], want_counts)
    causal = A.attention_block_counts(s, c, mode="ring", block_q=2, block_k=3)
    assert (counts[:, 0] < causal).all() if window < s else (counts[:, 0] >= causal).all()


@pytest.mark.slow
def test_ring_block_counts_per_device():
    """The products each device computes (its loop counters) are
    attention_block_counts(mode="ring"): the same on every device."""
    c, s = 4, 48
    mesh = context_mesh((c,), ("context",))
    spec = P(None, "context")
    bq, bk = ring._ring_blocks(jnp.zeros((1, s // c)), 2, 3)

    def per_device(q, k, v, do):
        out, lse, count = ring._ring_forward_bshd(q, k, v, None, "context", bq, bk)
        _, count_bwd = ring._ring_backward_bshd((q, k, v, out, lse), do, None, "context", bq,
                                                bk)
        return jnp.stack([count, count_bwd])[None]

    f = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(spec,) * 4,
                              out_specs=P("context")))
    with jax.set_mesh(mesh):
        counts = np.asarray(f(*(jax.reshard(x, spec) for x in inputs((1, s, 2, 4)))))
    want = A.attention_block_counts(s, c, mode="ring", block_q=2, block_k=3)
    np.testing.assert_array_equal(counts[:, 0], want)
    np.testing.assert_array_equal(counts[:, 1], want)


def test_ulysses_needs_heads_divisible_by_context():
    mesh = context_mesh((4,), ("context",))
    f = jax.shard_map(functools.partial(A.ulysses_attention, axis_name="context"),
                      mesh=mesh, in_specs=(P(None, "context"),) * 3,
                      out_specs=P(None, "context"))
    q = jax.ShapeDtypeStruct((1, 16, 6, 4), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "context")))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"6 heads.*size 4.*divides 6"):
        jax.eval_shape(f, q, q, q)
    kv = jax.ShapeDtypeStruct((1, 16, 2, 4), jnp.float32,
                              sharding=NamedSharding(mesh, P(None, "context")))
    q8 = jax.ShapeDtypeStruct((1, 16, 8, 4), jnp.float32,
                              sharding=NamedSharding(mesh, P(None, "context")))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"2 key/value heads.*size 4"):
        jax.eval_shape(f, q8, kv, kv)


# --------------------------------------------------------------------------------------
# Compiled programs
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_hlo_collectives_cpu():
    """Ring: collective-permutes only (no all-gather of the k/v sequence); Ulysses:
    all-to-alls only. CPU compiles of the forward + backward programs at c = 4."""
    args = inputs((1, 48, 8, 8))
    kinds = {}
    for mode in ("ring", "ulysses"):
        lowered = sharded_vjp((4,), ("context",), mode, 2, 3).lower(*args)
        inner = [col for col in parse_collectives(lowered.compile().as_text())
                 if "shard_map" in col.op_name]
        kinds[mode] = {col.kind for col in inner}
        if mode == "ring":  # forward: 3 k/v steps; backward: 3 k/v steps, 4 dk/dv steps
            shapes = [dims for col in inner for _, dims in col.arrays]
            assert all(dims[2] == 12 for dims in shapes), shapes  # [b, h, 2n, d] blocks
    assert kinds == {"ring": {"collective-permute"}, "ulysses": {"all-to-all"}}


def _permute_overlaps(hlo: str) -> list[bool]:
    """For each async collective-permute, whether attention compute (a conditional or a
    while loop) runs between its start and its done."""
    lines, starts, out = hlo.splitlines(), {}, []
    for i, line in enumerate(lines):
        m = re.match(r"\s*%(\S+) = .*collective-permute-start\(", line)
        if m:
            starts[m.group(1)] = i
        m = re.match(r"\s*%\S+ = .*collective-permute-done\(%(\S+)\)", line)
        if m:
            between = lines[starts[m.group(1)] + 1:i]
            out.append(any(" conditional(" in b or " while(" in b for b in between))
    return out


def _no_s_by_s(buffers, s: int, heads: int) -> None:
    """No live buffer is [.., s, .., s, ..] or holds half of the heads' s x s scores
    (a score block [b * heads, block_q, block_k] is far smaller)."""
    assert buffers
    for b in buffers:
        dims = [int(d) for d in b.shape.split("[")[1].rstrip("]").split(",") if d]
        assert sum(d >= s for d in dims) < 2 and np.prod(dims) < heads * s * s // 2, b


@pytest.mark.slow
@requires_cuda_plugin
def test_gpu_no_s_by_s_buffer_and_ring_overlap():
    """Deviceless H100 compiles of forward + backward at s = 4096, blocks of 512 (bf16):
    no buffer of the blockwise program has two dims of 4096 or 4096^2 elements; the ring
    program on 4 GPUs (local 1024 rows) none with two dims of 1024 or 1024^2 elements,
    and every one of its k/v transfers but the final return of dk/dv runs while a block
    of attention is computed."""
    from sp_jax.analysis import compile_for_gpu

    s = 4096
    x = jax.ShapeDtypeStruct((1, s, 8, 64), jnp.bfloat16)

    def loss(q, k, v):
        return A.blockwise_attention(q, k, v).astype(jnp.float32).sum()

    report = compile_for_gpu(jax.grad(loss, argnums=(0, 1, 2)), x, x, x, mesh_shape=(1,),
                             axis_names=("context",), live_buffers=True)
    _no_s_by_s(report.peak_live.buffers, s, 8)

    spec = P(None, "context")
    x = jax.ShapeDtypeStruct((1, s, 8, 64), jnp.bfloat16, sharding=spec)
    ring = jax.shard_map(functools.partial(A.ring_attention, axis_name="context"),
                         in_specs=(spec,) * 3, out_specs=spec)

    def ring_loss(q, k, v):
        return ring(q, k, v).astype(jnp.float32).sum()

    report = compile_for_gpu(jax.grad(ring_loss, argnums=(0, 1, 2)), x, x, x,
                             mesh_shape=(4,), axis_names=("context",), live_buffers=True)
    _no_s_by_s(report.peak_live.buffers, s // 4, 8)
    collectives = parse_collectives(report.hlo)
    assert {c.kind for c in collectives} == {"collective-permute"}
    forward = [c for c in collectives if c.phase == "forward"]
    assert len(forward) == 3 and all(c.is_async for c in forward)
    overlaps = _permute_overlaps(report.hlo)
    # forward 3, backward: 3 k/v (2 combined with dk/dv), 1 dk/dv; then dk/dv go home
    assert sum(overlaps) >= 7, overlaps


# --------------------------------------------------------------------------------------
# Dropout on the attention probabilities
# --------------------------------------------------------------------------------------

RATE = 0.25


def _dropout(seed=7, **offsets):
    return A.AttentionDropout(jnp.array([seed, 2 * seed + 1], jnp.uint32), RATE, **offsets)


def _probe(out, q, k):
    """The kernel's dropout factors ``Z [b, h, i, j]``, read off its output for the
    identity values (``v = I``: ``out[b, i, h, j] = P_ij Z_ij``) against the plain
    softmax ``P``; -1 above the diagonal."""
    s, k = q.shape[1], jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    probs = jax.nn.softmax(jnp.where(np.tril(np.ones((s, s), bool)), scores, -jnp.inf), -1)
    z = np.asarray(jnp.swapaxes(out, 1, 2) / jnp.where(probs > 0, probs, 1.0))
    assert np.all((np.abs(z) < 1e-4) | (np.abs(z - 1 / (1 - RATE)) < 1e-4))  # 0 or 1/(1-r)
    return np.where(np.tril(np.ones((s, s), bool)), np.where(z > 0.5, 1 / (1 - RATE), 0.0),
                    -1.0)


def _identity_inputs(b=2, s=16, h=4, kv=2, seed=0):
    q, k = (jax.random.normal(key, (b, s, n, s)) for key, n in
            zip(jax.random.split(jax.random.key(seed)), (h, kv), strict=True))
    v = jnp.broadcast_to(jnp.eye(s)[None, :, None, :], (b, s, kv, s))
    return q, k, v


@pytest.mark.slow
def test_attention_dropout_is_independent_of_blocks_and_sharding():
    """The dropped probabilities (read off with v = I) are the same for every block size,
    for ring and Ulysses over (data=2, context=2, tensor=2) meshes, and about RATE of
    them; another seed drops others."""
    q, k, v = _identity_inputs(h=8, kv=4)  # Ulysses: 2 kv heads per tensor shard
    z = _probe(A.blockwise_attention(q, k, v, block_q=16, block_k=16, dropout=_dropout()),
               q, k)
    kept = z[z >= 0]
    assert abs(np.mean(kept == 0) - RATE) < 0.05  # 2 x 8 x 136 probabilities
    for bq, bk in ((4, 8), (8, 2)):
        out = A.blockwise_attention(q, k, v, block_q=bq, block_k=bk, dropout=_dropout())
        np.testing.assert_array_equal(_probe(out, q, k), z)
    other = _probe(A.blockwise_attention(q, k, v, dropout=_dropout(seed=8)), q, k)
    assert np.mean(other != z) > 0.1
    for mode in ("ring", "ulysses"):
        mesh, f = _sharded_dropout(mode)
        with jax.set_mesh(mesh):
            out = f(q, k, v)
        np.testing.assert_array_equal(_probe(out, q, k), z, err_msg=mode)


@functools.cache
def _sharded_dropout(mode):
    """``mode`` attention with dropout on a (data=2, context=2, tensor=2) mesh, on
    global unpermuted arrays (offsets: this device's first batch row and head)."""
    mesh = context_mesh((2, 2, 2), ("data", "context", "tensor"))
    spec = P("data", "context", "tensor", None)
    kernel = A.ring_attention if mode == "ring" else A.ulysses_attention

    def local(q, k, v):
        dropout = _dropout(batch_offset=jax.lax.axis_index("data") * q.shape[0],
                           head_offset=jax.lax.axis_index("tensor") * q.shape[2])
        return kernel(q, k, v, axis_name="context", block_q=2, block_k=4, dropout=dropout)

    inner = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)

    @jax.jit
    def f(q, k, v):
        s = q.shape[1]
        if mode == "ring":
            perm, inv = A.zigzag_order(s, 2), A.zigzag_inverse(s, 2)
            q, k, v = (x[:, perm] for x in (q, k, v))
        out = jax.reshard(inner(*(jax.reshard(x, spec) for x in (q, k, v))), P())
        return out[:, inv] if mode == "ring" else out

    return mesh, f


@pytest.mark.slow
def test_attention_dropout_gradients_match_plain_dropout_attention():
    """Forward and gradients against plain attention with the kernel's dropout factors
    applied to the probabilities (autodiff of the plain formula), blockwise and ring."""
    q0, k0, v0 = _identity_inputs(seed=3)
    z = jnp.asarray(np.maximum(_probe(
        A.blockwise_attention(q0, k0, v0, dropout=_dropout()), q0, k0), 0.0))
    q, k, v, do = inputs((2, 16, 4, 16), seed=4, kv_heads=2)

    def plain(q, k, v):
        kr, vr = (jnp.repeat(x, 2, axis=2) for x in (k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, kr) / np.sqrt(q.shape[-1])
        probs = jax.nn.softmax(jnp.where(np.tril(np.ones((16, 16), bool)), scores, -jnp.inf))
        return jnp.einsum("bhqk,bkhd->bqhd", probs * z, vr)

    want = jax.vjp(plain, q, k, v)
    want = (want[0], want[1](do))
    got = jax.vjp(functools.partial(A.blockwise_attention, block_q=4, block_k=8,
                                    dropout=_dropout()), q, k, v)
    assert_close((got[0], got[1](do)), want, rtol=1e-5, atol=1e-5)
    mesh, ring_fn = _sharded_dropout("ring")
    with jax.set_mesh(mesh):
        ring = jax.vjp(ring_fn, q, k, v)
        ring = (ring[0], ring[1](do))
    assert_close(ring, want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@requires_cuda_plugin
def test_h100_accumulators_live_within_their_layer():
    """The kernels' fp32 ``[s, head_dim]`` accumulators and output buffers (forward output,
    backward dq, dk, dv) of a 4-layer stack each live within a quarter of the program:
    they start from zeros made from the op's own input. From a zeros constant, XLA merged
    them across layers and allocated copies layers before their use (the longest lived
    2217 of 2558 positions)."""
    layers, h, s, heads = 4, 256, 512, 8
    peak = h100_block_stack(layers, h=h, s=s, heads=heads, attention_block_q=128,
                            attention_block_k=128, live_buffers=True).peak_live
    d = h // heads
    shapes = (f"f32[1,1,{s},{d}]", f"f32[1,1,1,{s},{d}]")  # one head per device
    accumulators = [b for b in peak.buffers if b.shape in shapes]
    assert len(accumulators) >= 4 * layers
    length = max(b.end for b in peak.buffers)
    longest = max(accumulators, key=lambda b: b.end - b.start)
    assert longest.end - longest.start < length / layers, (longest, length)

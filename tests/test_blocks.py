"""Building blocks of the GPT: embedding, cross-entropy, norms, dropout, attention, MLP."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import copy_weights, to_host
from conftest import make_mesh
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import sp_jax

TOL = dict(rtol=1e-5, atol=1e-5)
B, S, H = 4, 8, 16


# --------------------------------------------------------------------------------------
# VocabParallelEmbedding
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [pytest.param(64, marks=pytest.mark.slow), 50],
                         ids=["divisible", "padded"])
@pytest.mark.parametrize("sequence_parallel", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["sp", "allreduce"])
def test_embedding_matches_nnx_embed(mesh_2x4, vocab, sequence_parallel):
    ids = np.random.default_rng(0).integers(0, vocab, size=(B, S))
    probe = np.random.default_rng(1).normal(size=(B, S, H)).astype(np.float32)
    with jax.set_mesh(mesh_2x4):
        emb = sp_jax.VocabParallelEmbedding(vocab, H, sequence_parallel=sequence_parallel,
                                            rngs=nnx.Rngs(0))
        loss = lambda m, i: jnp.sum(jnp.sin(m(i)) * probe)  # noqa: E731
        out = nnx.jit(lambda m, i: m(i))(emb, ids)
        grad = nnx.jit(nnx.grad(loss))(emb, ids)
    ref = nnx.Embed(vocab, H, rngs=nnx.Rngs(0))  # same initialiser and rng draw
    chex.assert_trees_all_equal(to_host(emb.embedding[...]), np.asarray(ref.embedding[...]))
    chex.assert_trees_all_close(to_host(out), np.asarray(ref(ids)), **TOL)
    chex.assert_trees_all_close(to_host(grad.embedding[...]),
                                np.asarray(nnx.grad(loss)(ref, ids).embedding[...]), **TOL)
    expected = P("data", "tensor", None) if sequence_parallel else P("data", None, None)
    assert out.sharding.spec == expected
    assert emb.embedding[...].shape == (vocab, H)


@pytest.mark.slow
def test_embedding_padded_rows_never_selected(mesh_2x4):
    with jax.set_mesh(mesh_2x4):
        emb = sp_jax.VocabParallelEmbedding(50, H, rngs=nnx.Rngs(0))
        table = emb.padded_table()
        assert table.shape == (52, H) and table.sharding.spec == P("tensor", None)
        assert not np.any(to_host(table)[50:])
        out = emb(np.full((B, S), 49))  # the last real row, in the last (padded) block
    np.testing.assert_allclose(to_host(out), np.broadcast_to(to_host(table)[49], (B, S, H)))


# --------------------------------------------------------------------------------------
# parallel_cross_entropy
# --------------------------------------------------------------------------------------


def _reference_ce(logits, labels, ignore_index, smoothing, z_loss, vocab):
    logits = jnp.asarray(logits, jnp.float32)[..., :vocab]
    safe = jnp.where(labels == ignore_index, 0, labels)
    # optax puts 1 - eps on the label and eps / V on every entry, as documented for ours.
    targets = optax.smooth_labels(jax.nn.one_hot(safe, vocab), smoothing)
    loss = optax.softmax_cross_entropy(logits, targets)
    loss = loss + z_loss * jax.nn.logsumexp(logits, axis=-1) ** 2
    return jnp.where(labels == ignore_index, 0.0, loss)


@pytest.mark.slow
@pytest.mark.parametrize(
    "vocab, smoothing, z_loss",
    [(64, 0.0, 0.0), (50, 0.0, 0.0), (64, 0.1, 1e-3), (50, 0.2, 0.0)],
)
def test_parallel_cross_entropy_matches_reference(mesh_2x4, vocab, smoothing, z_loss):
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(B, S, vocab)).astype(np.float32) * 3
    labels = rng.integers(0, vocab, size=(B, S))
    labels[0, :3] = -100
    kw = dict(ignore_index=-100, label_smoothing=smoothing, z_loss=z_loss)

    def ours(z):
        return sp_jax.parallel_cross_entropy(z, labels, **kw)

    def ref(z):
        return _reference_ce(z, labels, -100, smoothing, z_loss, vocab)

    weights = rng.normal(size=(B, S)).astype(np.float32)
    with jax.set_mesh(mesh_2x4):
        loss = jax.jit(ours)(logits)
        grad = jax.jit(jax.grad(lambda z: jnp.sum(ours(z) * weights)))(logits)
        assert loss.sharding.spec == P("data", None)
    chex.assert_trees_all_close(to_host(loss), np.asarray(ref(logits)), **TOL)
    assert np.all(to_host(loss)[0, :3] == 0)
    ref_grad = jax.grad(lambda z: jnp.sum(ref(z) * weights))(logits)
    chex.assert_trees_all_close(to_host(grad), np.asarray(ref_grad), **TOL)


def test_parallel_cross_entropy_ignores_padding_columns(mesh_2x4):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(B, S, 52)).astype(np.float32)
    logits[..., 50:] = 100.0  # huge padding logits must not matter
    labels = rng.integers(0, 50, size=(B, S))
    with jax.set_mesh(mesh_2x4):
        loss = sp_jax.parallel_cross_entropy(logits, labels, vocab_size=50)
    chex.assert_trees_all_close(to_host(loss),
                                np.asarray(_reference_ce(logits, labels, -100, 0, 0, 50)), **TOL)


@pytest.mark.slow
def test_parallel_cross_entropy_never_gathers_the_vocabulary(mesh_2x4):
    logits = jax.ShapeDtypeStruct((B, S, 64), jnp.float32)
    labels = jax.ShapeDtypeStruct((B, S), jnp.int32)
    with jax.set_mesh(mesh_2x4):
        logits = jax.ShapeDtypeStruct(
            logits.shape, logits.dtype,
            sharding=jax.NamedSharding(mesh_2x4, P("data", None, "tensor")))
        labels = jax.ShapeDtypeStruct(
            labels.shape, labels.dtype, sharding=jax.NamedSharding(mesh_2x4, P("data", None)))
        f = jax.jit(jax.grad(lambda z, y: jnp.sum(sp_jax.parallel_cross_entropy(z, y))))
        text = f.lower(logits, labels).compile().as_text()
    assert " all-gather(" not in text and "all-to-all" not in text
    for line in text.splitlines():  # only [b, s]-sized reductions cross devices
        if " all-reduce(" in line:
            assert f",{64 // 4}]" not in line.split("all-reduce(")[0]


# --------------------------------------------------------------------------------------
# Norms and dropout on sequence-sharded activations
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [pytest.param("LayerNorm", marks=pytest.mark.slow), "RMSNorm"])
@pytest.mark.parametrize("axis_type",
                         [AxisType.Explicit, pytest.param(AxisType.Auto, marks=pytest.mark.slow)])
def test_norm_param_grads_equal_unsharded(kind, axis_type):
    mesh = make_mesh(2, 4, axis_type)
    x = np.random.default_rng(4).normal(size=(B, S, H)).astype(np.float32)
    probe = np.random.default_rng(5).normal(size=(B, S, H)).astype(np.float32)

    def loss(m, x):
        return jnp.sum(m(x) * probe)

    with jax.set_mesh(mesh):
        norm = getattr(sp_jax, kind)(H, rngs=nnx.Rngs(0))
        state = nnx.state(norm, nnx.Param)
        state = jax.tree.map(lambda v: v + jnp.arange(H, dtype=jnp.float32) / H, state)
        nnx.update(norm, state)
        y = nnx.jit(lambda m, x: m(x))(norm, x)
        g = nnx.jit(nnx.grad(loss))(norm, x)
        if axis_type == AxisType.Explicit:
            assert y.sharding.spec == P("data", "tensor", None)
    ref = copy_weights(getattr(nnx, kind)(H, rngs=nnx.Rngs(0)), norm)
    chex.assert_trees_all_close(to_host(y), np.asarray(ref(x)), **TOL)
    chex.assert_trees_all_close(to_host(nnx.to_pure_dict(nnx.state(g))),
                                to_host(nnx.to_pure_dict(nnx.state(nnx.grad(loss)(ref, x)))),
                                **TOL)


@pytest.mark.parametrize("axis_type",
                         [AxisType.Explicit, pytest.param(AxisType.Auto, marks=pytest.mark.slow)])
def test_dropout_mask_is_sharding_invariant(axis_type):
    mesh = make_mesh(2, 4, axis_type)
    x = np.ones((B, S, H), np.float32)
    key = jax.random.key(42)
    with jax.set_mesh(mesh):
        drop = sp_jax.Dropout(0.5)
        y = jax.jit(lambda x, k: drop(x, rngs=k))(x, key)
    y_ref = nnx.Dropout(0.5)(x, rngs=key)  # unsharded, one device
    chex.assert_trees_all_equal(to_host(y), np.asarray(y_ref))
    assert 0.3 < np.mean(to_host(y) == 0) < 0.7
    if axis_type == AxisType.Explicit:
        assert y.sharding.spec == P("data", "tensor", None)


@pytest.mark.slow
def test_dropout_deterministic_is_identity(mesh_2x4):
    x = np.ones((B, S, H), np.float32)
    with jax.set_mesh(mesh_2x4):
        drop = sp_jax.Dropout(0.5, deterministic=True)
        chex.assert_trees_all_equal(to_host(drop(x)), x)


# --------------------------------------------------------------------------------------
# Attention and MLP blocks
# --------------------------------------------------------------------------------------


def _reference_attention(block, x):
    """Independent pre-LN causal attention from the block's weights (plain jnp)."""
    p = to_host(nnx.to_pure_dict(nnx.state(block, nnx.Param)))
    heads, hd = block.config.num_heads, block.config.head_dim
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    h = (x - mu) / np.sqrt(var + 1e-5) * p["norm"]["scale"] + p["norm"]["bias"]
    qkv = (h @ p["qkv"]["kernel"]).reshape(B, S, heads, 3, hd)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((S, S), bool)), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", w, v).reshape(B, S, heads * hd)
    return x + out @ p["out"]["kernel"] + p["out"]["bias"]


def test_attention_matches_independent_reference(mesh_2x4):
    x = np.random.default_rng(6).normal(size=(B, S, H)).astype(np.float32)
    with jax.set_mesh(mesh_2x4):
        block = sp_jax.CausalSelfAttention(sp_jax.AttentionConfig(H, 4), rngs=nnx.Rngs(0))
        block.out.bias[...] = jnp.arange(H, dtype=jnp.float32) / H
        y = nnx.jit(lambda m, x: m(x))(block, x)
        assert y.sharding.spec == P("data", "tensor", None)
    chex.assert_trees_all_close(to_host(y), _reference_attention(block, x), rtol=1e-4,
                                atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("rotary", [False, True])
def test_blocks_equal_on_sharded_and_single_device_mesh(rotary):
    x = np.random.default_rng(7).normal(size=(B, S, H)).astype(np.float32)

    def loss(attn, mlp, x):
        return jnp.sum(jnp.sin(mlp(attn(x))))

    out, sharded = {}, None
    for shape in ((2, 4), (1, 1)):
        with jax.set_mesh(make_mesh(*shape)):
            attn = sp_jax.CausalSelfAttention(sp_jax.AttentionConfig(H, 4, rotary=rotary),
                                              rngs=nnx.Rngs(0))
            mlp = sp_jax.MLP(sp_jax.MLPConfig(H, 4 * H), rngs=nnx.Rngs(1))
            if sharded is None:
                sharded = (attn, mlp)
            else:  # the single-device copy starts from the sharded blocks' weights
                copy_weights(attn, sharded[0])
                copy_weights(mlp, sharded[1])
            val, g = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1, 2)))(attn, mlp, x)
        out[shape] = to_host((val, nnx.to_pure_dict(nnx.state(g[0])),
                              nnx.to_pure_dict(nnx.state(g[1])), g[2]))
    chex.assert_trees_all_close(out[(2, 4)], out[(1, 1)], **TOL)


@pytest.mark.parametrize("kv_heads", [  # replicated over pairs of shards / split
    2, pytest.param(4, marks=pytest.mark.slow)])
def test_grouped_query_attention_matches_reference_with_one_all_gather(kv_heads, mesh_2x4):
    """8 query heads over ``kv_heads`` on tensor 4 against plain jnp from the block's
    ``q_kernel`` / ``kv_kernel`` (kv heads repeated), q/k/v biases included; the compiled
    forward all-gathers the input once and reduce-scatters once, as for MHA."""
    from sp_jax.analysis import parse_collectives

    hidden, heads, hd = 32, 8, 4
    x = np.random.default_rng(8).normal(size=(B, S, hidden)).astype(np.float32)
    with jax.set_mesh(mesh_2x4):
        block = sp_jax.CausalSelfAttention(
            sp_jax.AttentionConfig(hidden, heads, num_kv_heads=kv_heads, qkv_bias=True),
            rngs=nnx.Rngs(0))
        kv = block.config.num_kv_heads
        for b in (block.qkv.q_bias, block.qkv.kv_bias):
            b[...] = jax.random.normal(jax.random.key(kv), b[...].shape)
        forward = nnx.jit(lambda m, x: m(x))
        y = forward(block, x)
        kinds = [c.kind for c in parse_collectives(forward.lower(block, x).compile())]
    assert kinds.count("all-gather") == 1 and kinds.count("reduce-scatter") == 1, kinds
    p = to_host(nnx.to_pure_dict(nnx.state(block, nnx.Param)))
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    h = (x - mu) / np.sqrt(var + 1e-5) * p["norm"]["scale"] + p["norm"]["bias"]
    q = (h @ p["qkv"]["q_kernel"] + p["qkv"]["q_bias"]).reshape(B, S, heads, hd)
    kvs = (h @ p["qkv"]["kv_kernel"] + p["qkv"]["kv_bias"]).reshape(B, S, kv, 2, hd)
    k, v = (np.repeat(kvs[..., i, :], heads // kv, axis=2) for i in (0, 1))
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((S, S), bool)), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", w, v).reshape(B, S, hidden)
    want = x + out @ p["out"]["kernel"] + p["out"]["bias"]
    chex.assert_trees_all_close(to_host(y), want, rtol=1e-4, atol=1e-4)


def test_heads_not_divisible_by_tensor_size(mesh_2x4):
    with jax.set_mesh(mesh_2x4):
        with pytest.raises(ValueError, match=r"num_heads=6 is not divisible by the size 4"):
            sp_jax.CausalSelfAttention(sp_jax.AttentionConfig(24, 6), rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"out_features=18 is not divisible"):
            sp_jax.MLP(sp_jax.MLPConfig(16, 18), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="hidden=30 must be divisible by num_heads=4"):
        sp_jax.AttentionConfig(30, 4)


@pytest.mark.slow
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_mlp_keeps_its_hidden_layer_once(mesh_2x4, activation):
    """The MLP's backward keeps one [b, s, width] hidden array: the up projection's output
    (the activation's input), from which the down projection's backward computes the
    activation again; not also the activation's output (two before)."""
    with jax.set_mesh(mesh_2x4):
        mlp = sp_jax.MLP(sp_jax.MLPConfig(16, 24, mlp_activation=activation),
                         rngs=nnx.Rngs(0))
        graphdef, params = nnx.split(mlp)
        x = jax.random.normal(jax.random.key(1), (2, 8, 16))
        _, vjp = jax.vjp(lambda p, x: nnx.merge(graphdef, p)(x), params, x)
    hidden = [r.shape for r in jax.tree.leaves(vjp) if r.shape[:2] == (2, 8)
              and r.shape[-1] in (24, 48)]
    assert hidden == [(2, 8, 48 if activation == "swiglu" else 24)], hidden


def test_gated_mlp_matches_a_plain_swiglu(mesh_2x4):
    """SwiGLU MLP on 2 x 4 devices against jnp: gate and up are the even and odd columns
    of the fused up kernel, ``down(silu(gate) * up)`` plus the residual."""
    with jax.set_mesh(mesh_2x4):
        mlp = sp_jax.MLP(sp_jax.MLPConfig(16, 24, mlp_activation="swiglu"), rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), (2, 8, 16))
        got = np.asarray(mlp(x))
    p = to_host(nnx.to_pure_dict(nnx.state(mlp, nnx.Param)))
    xn = np.asarray(x)
    mean, var = xn.mean(-1, keepdims=True), xn.var(-1, keepdims=True)
    h = (xn - mean) / np.sqrt(var + 1e-5) * p["norm"]["scale"] + p["norm"]["bias"]
    u = h @ p["up"]["kernel"] + p["up"]["bias"]
    assert u.shape[-1] == 48
    y = jax.nn.silu(u[..., 0::2]) * u[..., 1::2]
    want = xn + np.asarray(y) @ p["down"]["kernel"] + p["down"]["bias"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

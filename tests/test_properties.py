"""Property tests: over batch / sequence / feature / mesh sizes, valid shapes match the
unsharded layer and invalid ones raise the documented error."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import reference_linear, to_host
from conftest import make_mesh
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sp_jax

pytestmark = pytest.mark.slow  # the whole file: make test only, not make test-fast
LAYERS = {
    "column": (sp_jax.ColumnParallelLinear, False, False),
    "row": (sp_jax.RowParallelLinear, True, False),
    "column_sp": (sp_jax.ColumnSequenceParallelLinear, False, True),
    "row_sp": (sp_jax.RowSequenceParallelLinear, True, True),
}  # name -> (class, kernel split on the input dim, sequence parallel)

MESHES = [(1, 1), (1, 2), (2, 2), (1, 4), (2, 4), (1, 8)]

SETTINGS = settings(max_examples=15, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _loss(layer, x):
    y = layer(x)
    return jnp.sum(jnp.sin(y) * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape)))


@SETTINGS
@given(
    layer=st.sampled_from(sorted(LAYERS)),
    mesh_shape=st.sampled_from(MESHES),
    batch=st.integers(1, 4),
    seq=st.integers(1, 8),
    n_in=st.integers(1, 12),
    n_out=st.integers(1, 12),
    recompute=st.booleans(),
)
def test_layer_matches_unsharded_or_raises(layer, mesh_shape, batch, seq, n_in, n_out,
                                           recompute):
    cls, split_in, sequence_parallel = LAYERS[layer]
    data, tensor = mesh_shape
    cfg = sp_jax.ParallelConfig(recompute_allgather=recompute)
    x = np.random.default_rng(batch * 100 + seq).normal(size=(batch, seq, n_in))
    x = x.astype(np.float32)
    sharded = n_in if split_in else n_out
    with jax.set_mesh(make_mesh(data, tensor)):
        if sharded % tensor:
            with pytest.raises(ValueError, match=r"(in|out)_features=\d+ is not divisible"):
                cls(n_in, n_out, parallel=cfg, rngs=nnx.Rngs(0))
            return
        module = cls(n_in, n_out, parallel=cfg, rngs=nnx.Rngs(0))
        if batch % data:
            with pytest.raises(ValueError, match=rf"batch size={batch} is not divisible"):
                module(x)
            return
        if sequence_parallel and seq % tensor:
            with pytest.raises(ValueError, match=rf"sequence length={seq} is not divisible"):
                module(x)
            return
        loss, (g_layer, g_x) = nnx.jit(nnx.value_and_grad(_loss, argnums=(0, 1)))(module, x)
    ref = reference_linear(module)
    ref_loss, (g_ref, g_x_ref) = nnx.value_and_grad(_loss, argnums=(0, 1))(ref, x)
    tol = dict(rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(float(loss), float(ref_loss), **tol)
    chex.assert_trees_all_close(to_host(g_x), np.asarray(g_x_ref), **tol)
    chex.assert_trees_all_close(to_host(nnx.to_pure_dict(nnx.state(g_layer))),
                                to_host(nnx.to_pure_dict(nnx.state(g_ref))), **tol)


@SETTINGS
@given(
    mesh_shape=st.sampled_from(MESHES),
    vocab=st.integers(1, 40),
    batch=st.integers(1, 4),
    seq=st.integers(1, 8),
    smoothing=st.sampled_from([0.0, 0.1]),
)
def test_embedding_and_cross_entropy_match_unsharded_or_raise(mesh_shape, vocab, batch, seq,
                                                             smoothing):
    data, tensor = mesh_shape
    rng = np.random.default_rng(vocab * 7 + seq)
    ids = rng.integers(0, vocab, size=(batch, seq)).astype(np.int32)
    with jax.set_mesh(make_mesh(data, tensor)):
        emb = sp_jax.VocabParallelEmbedding(vocab, 8, rngs=nnx.Rngs(0))
        if batch % data or seq % tensor:
            with pytest.raises(ValueError, match=r"(batch size|sequence length)=\d+ is not"):
                emb(ids)
            return
        out = nnx.jit(lambda m, i: m(i))(emb, ids)
        logits = jnp.asarray(rng.normal(size=(batch, seq, vocab)), jnp.float32)
        loss = jax.jit(lambda z, y: sp_jax.parallel_cross_entropy(
            z, y, label_smoothing=smoothing))(logits, ids)
    ref = nnx.Embed(vocab, 8, rngs=nnx.Rngs(0))
    chex.assert_trees_all_close(to_host(out), np.asarray(ref(ids)), rtol=1e-6, atol=1e-6)
    targets = optax.smooth_labels(jax.nn.one_hot(ids, vocab), smoothing)
    ref_loss = optax.softmax_cross_entropy(np.asarray(logits), targets)
    chex.assert_trees_all_close(to_host(loss), np.asarray(ref_loss), rtol=1e-5, atol=1e-5)

"""The layout vocabulary: one table of logical axes, the named specs built from it, and
layers/models that take their shardings from it (tuple data axes included)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import copy_weights, to_host
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import sp_jax
from sp_jax import Layout, ParallelConfig
from sp_jax.models import GPT, GPTConfig


def test_named_specs():
    lay = Layout.of(ParallelConfig())
    assert (lay.data_axes, lay.tensor_axis, lay.context_axes) == (("data",), "tensor", ())
    assert lay.sp == P("data", "tensor", None)
    assert lay.tp == P("data", None, "tensor")
    assert lay.tensor_replicated == P("data", None, None)
    assert lay.tokens == P("data", None)
    assert lay.logits == P("data", None, "tensor")
    assert lay.heads(4) == P("data", None, "tensor", None)
    assert lay.heads(5) == P("data", None, "tensor", None, None)
    assert lay.column_kernel == P(None, "tensor") and lay.row_kernel == P("tensor", None)
    assert lay.column_bias == P("tensor") and lay.row_bias == P(None)
    assert lay.vocab_table == P("tensor", None)


def test_replicated_batch_and_tuple_data_axes():
    assert Layout.of(ParallelConfig(data_axis=None)).sp == P(None, "tensor", None)
    lay = Layout.of(ParallelConfig(data_axis=("replica", "data"), tensor_axis="model"))
    assert lay.sp == P(("replica", "data"), "model", None)
    assert lay.micro_batched_tokens == P(None, ("replica", "data"), None)


def test_context_axis_shards_the_sequence_everywhere():
    """A third mesh axis for the sequence: every spec follows from the table."""
    lay = Layout(data_axes=("data",), tensor_axis="tensor", context_axes=("context",))
    assert lay.rules()["activation_length_sp"] == ("context", "tensor")
    assert lay.sp == P("data", ("context", "tensor"), None)
    assert lay.tp == P("data", "context", "tensor")
    assert lay.tokens == P("data", "context")
    assert lay.column_kernel == P(None, "tensor")  # parameters do not change


def test_errors():
    with pytest.raises(ValueError, match="unknown logical axis 'seq'"):
        Layout().spec("activation_batch", "seq")
    with pytest.raises(ValueError, match="must be distinct"):
        Layout(data_axes=("tensor",), tensor_axis="tensor")
    with pytest.raises(TypeError, match="ParallelConfig"):
        Layout.of({"tensor_axis": "tensor"})
    with pytest.raises(ValueError, match="rank=2"):
        Layout().heads(2)


def test_layer_parameters_carry_the_layout_specs(mesh_2x4):
    config = ParallelConfig()
    lay = Layout.of(config)
    with jax.set_mesh(mesh_2x4):
        col = sp_jax.ColumnSequenceParallelLinear(16, 32, parallel=config, rngs=nnx.Rngs(0))
        row = sp_jax.RowSequenceParallelLinear(32, 16, parallel=config, rngs=nnx.Rngs(0))
        emb = sp_jax.VocabParallelEmbedding(64, 16, parallel=config, rngs=nnx.Rngs(0))
    assert col.kernel[...].sharding.spec == lay.column_kernel
    assert col.bias[...].sharding.spec == lay.column_bias
    assert row.kernel[...].sharding.spec == lay.row_kernel
    assert emb.embedding[...].sharding.spec == lay.vocab_table


@pytest.mark.slow
def test_gpt_over_two_data_axes_equals_unsharded():
    """Batch sharded over a tuple of data axes (replica x data x tensor = 2 x 2 x 2): loss
    and gradients equal the unsharded model's."""
    mesh = jax.make_mesh((2, 2, 2), ("replica", "data", "tensor"),
                         axis_types=(AxisType.Explicit,) * 3, devices=jax.devices()[:8])
    cfg = GPTConfig(vocab_size=64, max_seq_len=8, num_layers=1, num_heads=2, hidden=16)
    parallel = ParallelConfig(data_axis=("replica", "data"))
    tokens = np.random.default_rng(0).integers(0, 64, size=(4, 9)).astype(np.int32)

    def loss(model, tokens):
        return model.loss(tokens[:, :-1], tokens[:, 1:])

    with jax.set_mesh(mesh):
        model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0))
        sharded_loss, sharded_grads = nnx.jit(nnx.value_and_grad(loss))(model, tokens)
        logits = nnx.jit(lambda m, t: m(t))(model, tokens[:, :-1])
        assert logits.sharding.spec == Layout.of(parallel).logits
    single = jax.make_mesh((1, 1), ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2,
                           devices=jax.devices()[:1])
    with jax.set_mesh(single):
        ref = copy_weights(GPT(cfg, rngs=nnx.Rngs(1)), model)
        ref_loss, ref_grads = nnx.jit(nnx.value_and_grad(loss))(ref, tokens)

    def pure(g):
        return to_host(nnx.to_pure_dict(nnx.state(g, nnx.Param)))

    chex.assert_trees_all_close(to_host(sharded_loss), to_host(ref_loss), rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(pure(sharded_grads), pure(ref_grads), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(sharded_loss)) > 0

"""Every documented bad input fails early with a ValueError/TypeError that names it."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import sp_jax

LAYERS = [
    sp_jax.ColumnParallelLinear,
    sp_jax.RowParallelLinear,
    sp_jax.ColumnSequenceParallelLinear,
    sp_jax.RowSequenceParallelLinear,
]


def test_sequence_not_divisible_by_tensor_size(mesh_2x4):
    with jax.set_mesh(mesh_2x4):
        for cls in (sp_jax.ColumnSequenceParallelLinear, sp_jax.RowSequenceParallelLinear):
            layer = cls(16, 16, rngs=nnx.Rngs(0))
            with pytest.raises(ValueError, match=r"sequence length=6 .* size 4 .*'tensor'"):
                layer(jnp.ones((2, 6, 16)))
            with pytest.raises(ValueError, match="sequence length=6"):
                nnx.jit(lambda m, x: m(x))(layer, jnp.ones((2, 6, 16)))


@pytest.mark.parametrize("cls", LAYERS)
def test_features_not_divisible_at_construction(mesh_2x4, cls):
    split_in = cls in (sp_jax.RowParallelLinear, sp_jax.RowSequenceParallelLinear)
    shape, name = ((30, 16), "in_features=30") if split_in else ((16, 30), "out_features=30")
    with jax.set_mesh(mesh_2x4):
        with pytest.raises(ValueError, match=rf"{name} is not divisible by the size 4"):
            cls(*shape, rngs=nnx.Rngs(0))


def test_features_not_divisible_when_built_without_mesh(mesh_2x4):
    layer = sp_jax.ColumnParallelLinear(16, 30, rngs=nnx.Rngs(0))  # no mesh: no check yet
    with jax.set_mesh(mesh_2x4):
        with pytest.raises(ValueError, match="out_features=30"):
            layer(jnp.ones((2, 8, 16)))


@pytest.mark.parametrize("cls", LAYERS)
def test_no_mesh_set(cls):
    layer = cls(16, 16, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="needs a device mesh, but none is set.*set_mesh"):
        layer(jnp.ones((2, 8, 16)))


def test_tensor_axis_not_in_mesh(mesh_2x4):
    cfg = sp_jax.ParallelConfig(tensor_axis="model")
    with jax.set_mesh(mesh_2x4):
        with pytest.raises(ValueError, match=r"tensor axis 'model'.*\('data', 'tensor'\)"):
            sp_jax.ColumnParallelLinear(16, 16, config=cfg, rngs=nnx.Rngs(0))


def test_data_axis_not_in_mesh():
    mesh = jax.make_mesh((4,), ("tensor",), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"data axis 'data'.*data_axis=None"):
            sp_jax.RowSequenceParallelLinear(16, 16, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("cls", LAYERS)
def test_wrong_input_rank(mesh_2x4, cls):
    with jax.set_mesh(mesh_2x4):
        layer = cls(16, 16, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"\[batch, seq, 16\], got rank 2"):
            layer(jnp.ones((8, 16)))


@pytest.mark.parametrize("cls", LAYERS)
def test_wrong_feature_size(mesh_2x4, cls):
    with jax.set_mesh(mesh_2x4):
        layer = cls(16, 16, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="input feature size 12 .* in_features=16"):
            layer(jnp.ones((2, 8, 12)))


def test_batch_not_divisible_by_data_size(mesh_2x4):
    with jax.set_mesh(mesh_2x4):
        layer = sp_jax.ColumnSequenceParallelLinear(16, 16, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"batch size=3 .* size 2 .*data_axis=None"):
            layer(jnp.ones((3, 8, 16)))


def test_integer_input(mesh_2x4):
    with jax.set_mesh(mesh_2x4):
        layer = sp_jax.ColumnParallelLinear(16, 16, rngs=nnx.Rngs(0))
        with pytest.raises(TypeError, match="int32 is not floating point"):
            layer(jnp.ones((2, 8, 16), jnp.int32))


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_bad_feature_arguments(value):
    with pytest.raises(ValueError, match=f"in_features={value!r}"):
        sp_jax.ColumnParallelLinear(value, 16, rngs=nnx.Rngs(0))


def test_config_must_be_parallel_config():
    with pytest.raises(TypeError, match="ParallelConfig.from_dict"):
        sp_jax.ColumnParallelLinear(16, 16, config={"recompute_allgather": True},
                                    rngs=nnx.Rngs(0))


def test_unknown_config_key():
    with pytest.raises(ValueError, match=r"Unknown ParallelConfig key\(s\) \['tensor_size'\]"):
        sp_jax.ParallelConfig.from_dict({"tensor_size": 4})


def test_op_shape_errors():
    with pytest.raises(ValueError, match="must equal the kernel's input dimension 8"):
        sp_jax.ops.matmul(jnp.ones((2, 4)), jnp.ones((8, 3)))
    with pytest.raises(ValueError, match="seq_dim must not be the feature"):
        sp_jax.ops.column_sequence_parallel_matmul(
            jnp.ones((2, 4, 8)), jnp.ones((8, 3)), axis_name="tensor", seq_dim=-1)
    with pytest.raises(ValueError, match=r"bias must have shape \(3,\)"):
        sp_jax.ops.column_sequence_parallel_matmul(
            jnp.ones((2, 4, 8)), jnp.ones((8, 3)), jnp.ones(4), axis_name="tensor")

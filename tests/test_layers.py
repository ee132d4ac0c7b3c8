"""Each parallel layer against flax.nnx.Linear with the same weights (fp32, tight)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import grads_dict, probe, reference_linear, slow_except, to_host
from conftest import make_mesh
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import sp_jax

B, S, IN, OUT = 8, 8, 16, 32
TOL = dict(rtol=1e-5, atol=1e-5)

MESHES = {
    "explicit_2x4": (2, 4, AxisType.Explicit),
    "auto_2x4": (2, 4, AxisType.Auto),
    "explicit_8x1": (8, 1, AxisType.Explicit),
}

# (layer class, extra kwargs, input spec, expected output spec) with d=data, t=tensor.
LAYERS = {
    "column": (sp_jax.ColumnParallelLinear, {}, P("data", None, None), P("data", None, "tensor")),
    "column_gather": (sp_jax.ColumnParallelLinear, {"gather_output": True},
                      P("data", None, None), P("data", None, None)),
    "row": (sp_jax.RowParallelLinear, {}, P("data", None, "tensor"), P("data", None, None)),
    "row_scatter": (sp_jax.RowParallelLinear, {"input_is_parallel": False},
                    P("data", None, None), P("data", None, None)),
    "column_sp": (sp_jax.ColumnSequenceParallelLinear, {}, P("data", "tensor", None),
                  P("data", None, "tensor")),
    "row_sp": (sp_jax.RowSequenceParallelLinear, {}, P("data", None, "tensor"),
               P("data", "tensor", None)),
}


def _loss(layer, x):
    y = layer(x)
    return jnp.sum(jnp.sin(y) * probe(y.shape)), y


_sharded_step = nnx.jit(nnx.value_and_grad(_loss, argnums=(0, 1), has_aux=True))
_reference_step = jax.jit(
    lambda ref, x: nnx.value_and_grad(_loss, argnums=(0, 1), has_aux=True)(ref, x)
)


def _random_bias(layer, seed):
    if layer.bias is not None:
        layer.bias[...] = jax.random.normal(jax.random.key(seed), layer.bias.shape)


# recompute_allgather only changes ColumnSequenceParallelLinear: run it there.
LAYER_CASES = [
    (layer, mesh, recompute)
    for layer in LAYERS
    for mesh in MESHES
    for recompute in ((False, True) if layer == "column_sp" else (False,))
]


@pytest.mark.parametrize("layer_name, mesh_name, recompute", slow_except(
    LAYER_CASES, ("column", "explicit_2x4", False), ("row", "explicit_2x4", False),
    ("column_sp", "explicit_2x4", True), ("row_sp", "explicit_2x4", False)))
def test_layer_matches_nnx_linear(layer_name, mesh_name, recompute):
    _check_layer(layer_name, mesh_name, sp_jax.ParallelConfig(recompute_allgather=recompute))


@pytest.mark.slow
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_fsdp_layer_matches_nnx_linear(layer_name):
    """Every layer with its kernel sharded over the data axis too (the column layer's
    all-reduced dx and its reduce-scattered weight gradient differ in their axes)."""
    _check_layer(layer_name, "explicit_2x4", sp_jax.ParallelConfig(fsdp=True))


def _check_layer(layer_name, mesh_name, cfg):
    cls, kwargs, in_spec, out_spec = LAYERS[layer_name]
    data, tensor, axis_type = MESHES[mesh_name]
    mesh = make_mesh(data, tensor, axis_type)
    n_in, n_out = (IN, OUT) if "column" in layer_name else (OUT, IN)
    x_host = np.random.default_rng(1).normal(size=(B, S, n_in)).astype(np.float32)

    with jax.set_mesh(mesh):
        layer = cls(n_in, n_out, parallel=cfg, rngs=nnx.Rngs(0), **kwargs)
        _random_bias(layer, 3)
        ref = reference_linear(layer)
        (loss, y), (g_layer, g_x) = _sharded_step(layer, jnp.asarray(x_host))

    (loss_r, y_r), (g_ref, g_x_r) = _reference_step(ref, x_host)
    chex.assert_trees_all_close(to_host(y), np.asarray(y_r), **TOL)
    chex.assert_trees_all_close(float(loss), float(loss_r), **TOL)
    chex.assert_trees_all_close(to_host(g_x), np.asarray(g_x_r), **TOL)
    chex.assert_trees_all_close(grads_dict(g_layer), grads_dict(g_ref), **TOL)
    if axis_type == AxisType.Explicit:
        assert y.sharding.spec == out_spec
    assert y.shape == (B, S, n_out)


@pytest.mark.parametrize(
    "sp, recompute",
    [pytest.param(False, False, marks=pytest.mark.slow),
     pytest.param(True, False, marks=pytest.mark.slow), (True, True)],
    ids=["tp", "sp_save", "sp_recompute"],
)
@pytest.mark.parametrize("mesh_name", slow_except(MESHES, "explicit_2x4"))
def test_column_gelu_row_residual_matches_unsharded(sp, recompute, mesh_name):
    data, tensor, axis_type = MESHES[mesh_name]
    mesh = make_mesh(data, tensor, axis_type)
    cfg = sp_jax.ParallelConfig(recompute_allgather=recompute)
    col_cls = sp_jax.ColumnSequenceParallelLinear if sp else sp_jax.ColumnParallelLinear
    row_cls = sp_jax.RowSequenceParallelLinear if sp else sp_jax.RowParallelLinear
    x_host = np.random.default_rng(2).normal(size=(B, S, IN)).astype(np.float32)

    def block(col, row, x):
        y = x + row(jax.nn.gelu(col(x)))
        return jnp.sum(jnp.sin(y) * probe(y.shape))

    with jax.set_mesh(mesh):
        col = col_cls(IN, 4 * IN, parallel=cfg, rngs=nnx.Rngs(1))
        row = row_cls(4 * IN, IN, parallel=cfg, rngs=nnx.Rngs(2))
        _random_bias(col, 4)
        _random_bias(row, 5)
        ref_col, ref_row = reference_linear(col), reference_linear(row)
        loss, grads = nnx.jit(nnx.value_and_grad(block, argnums=(0, 1, 2)))(
            col, row, jnp.asarray(x_host)
        )
    loss_r, grads_r = jax.value_and_grad(block, argnums=(0, 1, 2))(ref_col, ref_row, x_host)
    chex.assert_trees_all_close(float(loss), float(loss_r), **TOL)
    for g, g_r in zip(grads[:2], grads_r[:2], strict=True):
        chex.assert_trees_all_close(grads_dict(g), grads_dict(g_r), **TOL)
    chex.assert_trees_all_close(to_host(grads[2]), np.asarray(grads_r[2]), **TOL)


@pytest.mark.slow
def test_eager_call_and_grad_without_jit(mesh_2x4):
    x_host = np.random.default_rng(3).normal(size=(B, S, IN)).astype(np.float32)
    with jax.set_mesh(mesh_2x4):
        layer = sp_jax.ColumnSequenceParallelLinear(
            IN, OUT, parallel=sp_jax.ParallelConfig(recompute_allgather=True), rngs=nnx.Rngs(0)
        )
        ref = reference_linear(layer)
        y = layer(jnp.asarray(x_host))
        g = nnx.grad(lambda m, x: jnp.sum(m(x) ** 2))(layer, jnp.asarray(x_host))
    chex.assert_trees_all_close(to_host(y), np.asarray(ref(x_host)), **TOL)
    g_r = nnx.grad(lambda m, x: jnp.sum(m(x) ** 2))(ref, x_host)
    chex.assert_trees_all_close(grads_dict(g), grads_dict(g_r), **TOL)


@pytest.mark.parametrize(
    "cls, kernel_spec, bias_spec",
    [
        (sp_jax.ColumnParallelLinear, P(None, "tensor"), P("tensor")),
        (sp_jax.RowParallelLinear, P("tensor", None), P(None)),
        (sp_jax.ColumnSequenceParallelLinear, P(None, "tensor"), P("tensor")),
        (sp_jax.RowSequenceParallelLinear, P("tensor", None), P(None)),
    ],
)
def test_parameters_match_nnx_linear_and_are_sharded(mesh_2x4, cls, kernel_spec, bias_spec):
    with jax.set_mesh(mesh_2x4):
        layer = cls(IN, OUT, rngs=nnx.Rngs(11))
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(11))
    # Same names, shapes, dtypes and (same seed) values as nnx.Linear.
    ours = to_host(nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
    theirs = to_host(nnx.to_pure_dict(nnx.state(linear, nnx.Param)))
    chex.assert_trees_all_equal(ours, theirs)
    assert layer.kernel.get_metadata()["out_sharding"] == tuple(kernel_spec)
    assert layer.bias.get_metadata()["out_sharding"] == tuple(bias_spec)
    assert layer.kernel[...].sharding.spec == kernel_spec
    assert layer.bias[...].sharding.spec == bias_spec
    assert nnx.get_partition_spec(nnx.state(layer))["kernel"].get_value() == kernel_spec


@pytest.mark.slow
@pytest.mark.parametrize("cls", [sp_jax.ColumnSequenceParallelLinear, sp_jax.RowParallelLinear])
def test_nnx_update_loads_unsharded_linear(mesh_2x4, cls):
    linear = nnx.Linear(IN, OUT, rngs=nnx.Rngs(5))
    linear.bias[...] = jnp.arange(OUT, dtype=jnp.float32)
    x_host = np.random.default_rng(4).normal(size=(B, S, IN)).astype(np.float32)
    with jax.set_mesh(mesh_2x4):
        layer = cls(IN, OUT, rngs=nnx.Rngs(99))
        nnx.update(layer, nnx.state(linear))
        y = layer(jnp.asarray(x_host))
    chex.assert_trees_all_close(to_host(y), np.asarray(linear(x_host)), **TOL)


def test_input_with_other_sharding_is_resharded(mesh_2x4):
    """An SP layer fed a replicated array (or the TP layout) still computes correctly."""
    x_host = np.random.default_rng(6).normal(size=(B, S, IN)).astype(np.float32)
    with jax.set_mesh(mesh_2x4):
        layer = sp_jax.ColumnSequenceParallelLinear(IN, OUT, rngs=nnx.Rngs(0))
        ref = reference_linear(layer)
        for spec in (P(), P(None, None, "tensor"), P("tensor", "data", None)):
            x = jax.device_put(x_host, jax.sharding.NamedSharding(mesh_2x4, spec))
            y = nnx.jit(lambda m, x: m(x))(layer, x)
            chex.assert_trees_all_close(to_host(y), np.asarray(ref(x_host)), **TOL)
            assert y.sharding.spec == P("data", None, "tensor")


@pytest.mark.slow
def test_batch_replicated_with_data_axis_none():
    mesh = jax.make_mesh((4,), ("tensor",), devices=jax.devices()[:4])
    cfg = sp_jax.ParallelConfig(data_axis=None)
    x_host = np.random.default_rng(8).normal(size=(3, S, IN)).astype(np.float32)
    with jax.set_mesh(mesh):
        col = sp_jax.ColumnSequenceParallelLinear(IN, OUT, parallel=cfg, rngs=nnx.Rngs(0))
        row = sp_jax.RowSequenceParallelLinear(OUT, IN, parallel=cfg, rngs=nnx.Rngs(1))
        y = row(col(jnp.asarray(x_host)))
        assert y.sharding.spec == P(None, "tensor", None)
    ref = reference_linear(row)(reference_linear(col)(x_host))
    chex.assert_trees_all_close(to_host(y), np.asarray(ref), **TOL)


@pytest.mark.slow
def test_bf16_compute_dtype(mesh_2x4):
    x_host = np.random.default_rng(9).normal(size=(B, S, IN)).astype(np.float32)
    with jax.set_mesh(mesh_2x4):
        layer = sp_jax.ColumnSequenceParallelLinear(IN, OUT, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
        y = layer(jnp.asarray(x_host))
        g = nnx.grad(lambda m, x: jnp.sum(m(x).astype(jnp.float32)))(layer, jnp.asarray(x_host))
    assert y.dtype == jnp.bfloat16
    assert layer.kernel[...].dtype == jnp.float32
    assert g.kernel[...].dtype == jnp.float32
    ref = reference_linear(layer)
    ref_y = nnx.Linear(IN, OUT, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    nnx.update(ref_y, nnx.state(ref))
    chex.assert_trees_all_close(
        to_host(y).astype(np.float32), np.asarray(ref_y(x_host)).astype(np.float32),
        rtol=2e-2, atol=2e-2,
    )

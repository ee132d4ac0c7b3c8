"""The single-token (decode) mode of the linear layers and the grouped-query projection:
one token per row, activations whole over the tensor axis; column layers multiply their
own column block (no collective), row layers all-reduce their partial products (one
all-reduce, no reduce-scatter). Equal to the unsharded ``flax.nnx.Linear``; the MLP's
single-token step per device equal to its training path; and the linear rules are frozen
dataclasses (hashable statics)."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import reference_linear
from conftest import make_mesh
from flax import nnx

import sp_jax
from sp_jax.layers import AttentionConfig, GroupedQKVProjection, MLPActivation
from sp_jax.ops.fp8 import Fp8Gemm, Fp8Spec
from sp_jax.ops.gemm import ComputeGemm
from sp_jax.ops.rules import ColumnSequence, RowSequence
from sp_jax.ops.transport import Collectives, Ring

TOL = dict(rtol=1e-5, atol=1e-5)
IN, OUT = 16, 48  # OUT divisible by 1, 2, 4, 8

LAYERS = ["ColumnSequenceParallelLinear", "RowSequenceParallelLinear",
          "ColumnParallelLinear", "RowParallelLinear"]


def _layer(name, fsdp=False):
    cfg = sp_jax.ParallelConfig(fsdp=fsdp)
    split_in = name.startswith("Row")
    shape = (OUT, IN) if split_in else (IN, OUT)
    layer = getattr(sp_jax, name)(*shape, parallel=cfg, rngs=nnx.Rngs(1))
    layer.bias[...] = jax.random.normal(jax.random.key(3), layer.bias.shape)
    return layer


def _collectives(fn, *args):
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    kinds = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute")
    return {k: sum(f" {k}(" in ln or f" {k}-start(" in ln for ln in hlo.splitlines())
            for k in kinds}


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)], ids=["2x4", "1x8"])
@pytest.mark.parametrize("name", LAYERS)
def test_decode_mode_matches_nnx_linear(name, mesh_shape):
    """``layer(x, decode=True)`` on ``[b, 1, in]`` equals nnx.Linear; column layers use no
    collective, row layers one all-reduce."""
    b = 2 * mesh_shape[0]
    x = np.random.default_rng(0).normal(size=(b, 1, OUT if name.startswith("Row") else IN))
    x = x.astype(np.float32)
    with jax.set_mesh(make_mesh(*mesh_shape)):
        layer = _layer(name)
        ref = reference_linear(layer)
        y = nnx.jit(lambda layer, x: layer(x, decode=True))(layer, jnp.asarray(x))
        counts = _collectives(lambda x: layer(x, decode=True), jnp.asarray(x))
    chex.assert_trees_all_close(np.asarray(y), np.asarray(ref(x)), **TOL)
    expected = {"all-reduce": 1 if name.startswith("Row") else 0, "all-gather": 0,
                "reduce-scatter": 0, "collective-permute": 0}
    assert counts == expected, counts


@pytest.mark.parametrize("name, option", [("ColumnParallelLinear", "gather_output"),
                                          ("RowParallelLinear", "input_is_parallel")])
def test_decode_mode_keeps_the_layers_options(name, option):
    """``ColumnParallelLinear(gather_output=True)`` gives whole rows in decode mode and
    ``RowParallelLinear(input_is_parallel=False)`` takes them, as in their training path
    (and equal to nnx.Linear)."""
    x = np.random.default_rng(0).normal(size=(4, 1, OUT if name.startswith("Row") else IN))
    with jax.set_mesh(make_mesh(2, 4)):
        layer = getattr(sp_jax, name)(*((OUT, IN) if name.startswith("Row") else (IN, OUT)),
                                      **{option: option == "gather_output"},
                                      rngs=nnx.Rngs(1))
        x = jnp.asarray(x, jnp.float32)
        y = nnx.jit(lambda layer, x: layer(x, decode=True))(layer, x)
        train = nnx.jit(lambda layer, x: layer(x))(layer, x)
        ref = reference_linear(layer)
    assert y.shape == (4, 1, IN if name.startswith("Row") else OUT)
    chex.assert_trees_all_close(np.asarray(y), np.asarray(ref(np.asarray(x))), **TOL)
    chex.assert_trees_all_close(np.asarray(y), np.asarray(train), **TOL)


@pytest.mark.parametrize("mesh_shape", [(2, 4), (1, 8)], ids=["2x4", "1x8"])
def test_decode_mode_row_with_activation_and_fsdp_parameters(mesh_shape):
    """The row layer's decode mode applies the MLP activation first; an fsdp layer's
    parameters are read whole over the data axes."""
    b = 2 * mesh_shape[0]
    x = np.random.default_rng(1).normal(size=(b, 1, 2 * OUT)).astype(np.float32)
    act = MLPActivation("swiglu")
    with jax.set_mesh(make_mesh(*mesh_shape)):
        layer = _layer("RowSequenceParallelLinear", fsdp=mesh_shape[0] > 1)
        ref = reference_linear(layer)
        y = layer(jnp.asarray(x), activation=act, decode=True)
    pairs = x.reshape(b, 1, OUT, 2)
    h = np.asarray(jax.nn.silu(pairs[..., 0])) * pairs[..., 1]
    chex.assert_trees_all_close(np.asarray(y), np.asarray(ref(h)), **TOL)


@pytest.mark.parametrize("mesh_shape, kv_heads", [((2, 4), 4), ((1, 8), 2)],
                         ids=["2x4_split", "1x8_replicated"])
def test_grouped_qkv_decode_mode_matches_training_path(mesh_shape, kv_heads):
    """The projection's decode mode gives the blocks its training path gives for the
    same token (kv heads split over the tensor axis, or replicated)."""
    cfg = AttentionConfig(hidden=32, num_heads=8, num_kv_heads=kv_heads, qkv_bias=True)
    t, b = mesh_shape[1], 2 * mesh_shape[0]
    x = np.random.default_rng(2).normal(size=(b, t, 32)).astype(np.float32)
    with jax.set_mesh(make_mesh(*mesh_shape)):
        qkv = GroupedQKVProjection(cfg, rngs=nnx.Rngs(0))
        qkv.q_bias[...] = jax.random.normal(jax.random.key(5), qkv.q_bias.shape)
        qkv.kv_bias[...] = jax.random.normal(jax.random.key(6), qkv.kv_bias.shape)
        full = qkv(jnp.asarray(x))
        one = qkv(jnp.asarray(x[:, :1]), decode=True)
        counts = _collectives(lambda x: qkv(x, decode=True), jnp.asarray(x[:, :1]))
    chex.assert_trees_all_close(np.asarray(one), np.asarray(full)[:, :1], **TOL)
    assert sum(counts.values()) == 0, counts


def test_rules_are_hashable_frozen_dataclasses():
    """A rule's statics are a frozen dataclass: equal options give equal, hashable rules;
    the GEMM and transport are fields, not names."""
    spec = Fp8Spec(sp_jax.Fp8Recipe("delayed"), ("data", "tensor"))
    gemm = Fp8Gemm(spec, jnp.dtype(jnp.float32), jnp.dtype(jnp.float32))
    a = ColumnSequence(gemm, Ring("tensor", 1), True)
    assert a == ColumnSequence(gemm, Ring("tensor", 1), True)
    assert hash(a) == hash(ColumnSequence(gemm, Ring("tensor", 1), True))
    assert a != ColumnSequence(gemm, Collectives("tensor", 1), True)
    plain = RowSequence(ComputeGemm(None, jnp.dtype(jnp.bfloat16)), Collectives("tensor", 1))
    assert {plain: 1}[RowSequence(ComputeGemm(None, jnp.dtype(jnp.bfloat16)),
                                  Collectives("tensor", 1))] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.recompute = False  # type: ignore[misc]


@pytest.mark.parametrize("activation, norm", [("gelu", "layernorm"), ("swiglu", "rmsnorm")])
def test_mlp_decode_step_matches_the_training_path(activation, norm):
    """``MLP.decode_step`` per device inside one shard_map (the norm's per-device call,
    ``up`` on its own column block, ``down`` with the activation and one all-reduce), its
    parameters in the decode layout its layers state (``param_specs`` of
    ``decode_layout``; fsdp parameters whole over the data axes), equals the MLP's
    training path on the same tokens."""
    from jax.sharding import PartitionSpec as P

    from sp_jax.layers import MLP, MLPConfig
    from sp_jax.layers.linear import decode_layout

    cfg = MLPConfig(hidden=16, mlp_hidden=32, mlp_activation=activation, norm=norm)
    par = sp_jax.ParallelConfig(fsdp=True)
    x = np.random.default_rng(3).normal(size=(4, 4, 16)).astype(np.float32)
    with jax.set_mesh(make_mesh(2, 4)) as mesh:
        mlp = MLP(cfg, parallel=par, rngs=nnx.Rngs(0))
        mlp.up.bias[...] = jax.random.normal(jax.random.key(7), mlp.up.bias.shape)
        full = mlp(jnp.asarray(x))
        layout = decode_layout(par)
        specs = {name: layer.param_specs(layout, mesh) for name, layer in
                 (("up", mlp.up), ("down", mlp.down))}
        graph, state = nnx.split(mlp)
        spec_tree = jax.tree_util.tree_map_with_path(
            lambda path, leaf: specs.get(path[0].key, {}).get(path[1].key,
                                                             P(*(None,) * leaf.ndim)), state)
        step = jax.shard_map(lambda s, x: nnx.merge(graph, s).decode_step(x),
                             in_specs=(spec_tree, layout.tensor_replicated),
                             out_specs=layout.tensor_replicated)
        state = jax.tree.map(jax.sharding.reshard, state, spec_tree)
        rows = jax.sharding.reshard(jnp.asarray(x), layout.tensor_replicated)
        one = step(state, rows)
        counts = _collectives(step, state, rows)
    chex.assert_trees_all_close(np.asarray(one), np.asarray(full), **TOL)
    assert counts == {"all-reduce": 1, "all-gather": 0, "reduce-scatter": 0,
                      "collective-permute": 0}, counts

"""FP8: the quantisation against ml_dtypes, the FP8 linear layers against a NumPy /
ml_dtypes reference of the same arithmetic (whole-tensor amaxes, e4m3 forward, e5m2
output gradients, fp32 accumulation) on several meshes, and the errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import sp_jax
from sp_jax.ops import fp8 as f8

B, S, IN, OUT = 4, 16, 16, 32

MESHES = {  # name: (mesh shape, axis names, ParallelConfig options)
    "1x8": ((1, 8), ("data", "tensor"), {}),
    "2x4": ((2, 4), ("data", "tensor"), {}),
    "1x2x4_ring": ((1, 2, 4), ("data", "context", "tensor"), {"context_parallel": "ring"}),
    # collective matmul (rings of FP8 chunks) with the re-gather; FSDP
    "2x4_cm_recompute": ((2, 4), ("data", "tensor"),
                         {"collective_matmul": True, "recompute_allgather": True}),
    "2x4_fsdp": ((2, 4), ("data", "tensor"), {"fsdp": True}),
}
LAYERS = {
    "column_sp": (sp_jax.ColumnSequenceParallelLinear, IN, OUT),
    "row_sp": (sp_jax.RowSequenceParallelLinear, OUT, IN),
    "column": (sp_jax.ColumnParallelLinear, IN, OUT),
    "row": (sp_jax.RowParallelLinear, OUT, IN),
}


def _mesh(name):
    shape, axes, _ = MESHES[name]
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Explicit,) * len(shape),
                         devices=jax.devices()[: int(np.prod(shape))])


# --- the NumPy / ml_dtypes reference ---------------------------------------------------

NP_FORMATS = (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)


def np_scale(amax, fmt, margin=0):
    amax = np.float32(amax)
    if not (amax > 0 and np.isfinite(amax)):
        return np.float32(1.0)
    return amax * np.float32(2.0 ** margin / float(ml_dtypes.finfo(fmt).max))


def np_quantize(x, fmt, scale):
    m = np.float32(ml_dtypes.finfo(fmt).max)
    return np.clip(x.astype(np.float32) / np.float32(scale), -m, m).astype(fmt)


def np_qdq(x, role, basis):
    """x quantised in ``role``'s format with the scale of amax ``basis``, dequantised."""
    fmt = NP_FORMATS[role]
    s = np_scale(basis, fmt)
    return np_quantize(x, fmt, s).astype(np.float32) * s


def np_fp8_linear(x, w, b, dy, history=None):
    """y, dx, dW, db and the amaxes (x, w, dy) of ``y = x @ w + b`` in FP8; scales from
    the whole tensors' amaxes, or from ``history`` [3, n] (delayed)."""
    amaxes = [np.float32(np.max(np.abs(t))) for t in (x, w, dy)]
    basis = amaxes if history is None else [np.max(h) for h in history]
    xq, wq, gq = (np_qdq(t, role, basis[role]) for role, t in enumerate((x, w, dy)))
    y = (xq @ wq).astype(np.float32) + b
    dx = gq @ wq.T
    dw = np.einsum("bsi,bso->io", xq, gq)
    return y, dx, dw, dy.sum((0, 1)), np.stack(amaxes)


# --- quantisation ------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_round_trip_equals_ml_dtypes_and_saturates(fmt):
    x = np.random.default_rng(0).normal(size=(64, 33)).astype(np.float32) * 3
    x[0, :3] = [1e9, -1e9, 0.0]
    fmt_np = getattr(ml_dtypes, jnp.dtype(fmt).name)
    scale = np.float32(0.0371)
    q = np.asarray(jax.jit(lambda x: f8.quantize(x, fmt, scale))(x))
    np.testing.assert_array_equal(q[1:], (x[1:] / scale).astype(fmt_np))  # in range
    big = float(ml_dtypes.finfo(fmt_np).max)
    assert float(q[0, 0]) == big and float(q[0, 1]) == -big and float(q[0, 2]) == 0
    assert q.dtype == fmt_np and np.all(np.isfinite(q.astype(np.float32)))
    back = np.asarray(jax.jit(f8.dequantize)(q, scale))
    np.testing.assert_array_equal(back, q.astype(np.float32) * scale)
    assert float(f8.scale_from_amax(jnp.float32(2.5), fmt, 2)) == np_scale(2.5, fmt_np, 2)
    assert float(f8.scale_from_amax(jnp.float32(0.0), fmt)) == 1.0


def test_amax_history_rolls_newest_first():
    h = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    new = np.asarray(f8.roll_history(h, jnp.array([10.0, 20.0, 30.0])))
    np.testing.assert_array_equal(new, [[10, 0, 1, 2], [20, 4, 5, 6], [30, 8, 9, 10]])
    stacked = f8.roll_history(jnp.zeros((2, 3, 4)), jnp.ones((2, 3)))  # scanned layers
    assert stacked.shape == (2, 3, 4) and float(stacked[..., 0].min()) == 1.0


# --- the layers against the reference ----------------------------------------------------


def _loss(layer, x, dy):
    y = layer(x)
    return jnp.sum(y * dy), y


_step = nnx.jit(nnx.value_and_grad(_loss, argnums=(0, 1), has_aux=True))


@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_layer_equals_numpy_fp8_reference(layer_name, mesh_name, scaling):
    cls, n_in, n_out = LAYERS[layer_name]
    rng = np.random.default_rng(3)
    x = rng.normal(size=(B, S, n_in)).astype(np.float32)
    dy = (rng.normal(size=(B, S, n_out)) * 1e-3).astype(np.float32)
    parallel = sp_jax.ParallelConfig(**MESHES[mesh_name][2])
    with jax.set_mesh(_mesh(mesh_name)):
        layer = cls(n_in, n_out, parallel=parallel, fp8=sp_jax.Fp8Recipe(scaling, 4),
                    rngs=nnx.Rngs(0))
        layer.bias[...] = jnp.asarray(rng.normal(size=(n_out,)), jnp.float32)
        w, b = np.asarray(layer.kernel[...]), np.asarray(layer.bias[...])
        history = None
        if scaling == "delayed":  # amaxes of earlier steps, some below this step's:
            # the input saturates, the kernel and the gradient are scaled more coarsely
            amax = np.array([np.abs(t).max() for t in (x, w, dy)], np.float32)
            history = (amax[:, None] * np.array([[0.5, 0.7, 0.2, 0.1], [1.5, 1, 3, 0],
                                                 [2, 0, 1, 0]], np.float32))
            layer.fp8_history[...] = jnp.asarray(history)
        (_, y), (g_layer, g_x) = _step(layer, jnp.asarray(x), jnp.asarray(dy))
    y_r, dx_r, dw_r, db_r, amax_r = np_fp8_linear(x, w, b, dy, history)
    for got, ref in ((y, y_r), (g_x, dx_r), (g_layer.kernel[...], dw_r),
                     (g_layer.bias[...], db_r)):
        got = np.asarray(got)
        assert got.shape == ref.shape
        err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
        assert err <= 1e-5, (layer_name, mesh_name, scaling, err)
    if scaling == "delayed":  # the history's gradient: this step's whole-tensor amaxes
        cot = np.asarray(g_layer.fp8_history[...])
        np.testing.assert_array_equal(cot[:, 0], amax_r)
        assert not cot[:, 1:].any()
    else:
        assert layer.fp8_history is None


def test_fp8_errors(mesh_2x4):
    with jax.set_mesh(mesh_2x4):
        with pytest.raises(TypeError, match="fp8='current' must be a sp_jax.Fp8Recipe"):
            sp_jax.ColumnSequenceParallelLinear(8, 8, fp8="current", rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="pipeline"):
            sp_jax.ColumnSequenceParallelLinear(
                8, 8, fp8=sp_jax.Fp8Recipe(), rngs=nnx.Rngs(0),
                parallel=sp_jax.ParallelConfig(pipeline_axis="data", data_axis=None))
    with pytest.raises(ValueError, match="scaling='late' must be one of"):
        sp_jax.Fp8Recipe("late")
    with pytest.raises(ValueError, match="amax_history_len=0 must be an int >= 1"):
        sp_jax.Fp8Recipe("delayed", amax_history_len=0)
    spec = f8.Fp8Spec(sp_jax.Fp8Recipe("delayed", 4), ("tensor",))

    def local(x, k):
        return sp_jax.ops.matmul(x, k, fp8=spec, fp8_history=jnp.zeros((3, 2)))

    with pytest.raises(ValueError, match=r"fp8_history of shape \(3, 4\)"):
        jax.shard_map(local, mesh=mesh_2x4, in_specs=(jax.P(), jax.P()),
                      out_specs=jax.P())(jnp.ones((4, 8)), jnp.ones((8, 8)))

"""Collective matmul (``ParallelConfig(collective_matmul=True)``): the SP layers compute what
flax.nnx.Linear computes, with rings of collective-permutes in place of every all-gather
and reduce-scatter of activations, chunk GEMMs that XLA does not merge back, and (on
8 x H100, deviceless) every transfer asynchronous with a GEMM inside it."""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import grads_dict, h100_block_stack, probe, reference_linear, to_host
from conftest import requires_cuda_plugin
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from sp_jax.analysis import parse_collectives
from sp_jax.ring import ring_steps

TOL = dict(rtol=1e-5, atol=1e-5)
IN, HID = 16, 48  # HID divisible by 1, 2, 3, 4, 6, 8


def _mesh(data, tensor, axis_type=AxisType.Explicit):
    return jax.make_mesh((data, tensor), ("data", "tensor"), axis_types=(axis_type,) * 2,
                         devices=jax.devices()[: data * tensor])


def _pair_loss(col, row, x):
    y = x + row(jax.nn.gelu(col(x)))
    return jnp.sum(jnp.sin(y) * probe(y.shape))


_pair_grads = nnx.jit(nnx.value_and_grad(_pair_loss, argnums=(0, 1, 2)))


@pytest.mark.parametrize("data, tensor, axis_type, recompute", [
    pytest.param(1, 2, AxisType.Explicit, False, marks=pytest.mark.slow),
    # odd ring: one more hop forward than backward
    pytest.param(1, 3, AxisType.Explicit, True, marks=pytest.mark.slow),
    (2, 4, AxisType.Explicit, True),
    pytest.param(2, 4, AxisType.Auto, False, marks=pytest.mark.slow),
    pytest.param(1, 8, AxisType.Explicit, False, marks=pytest.mark.slow),
    pytest.param(4, 1, AxisType.Explicit, True, marks=pytest.mark.slow),  # t = 1: no ring at all
], ids=["1x2", "1x3_rec", "2x4_rec", "2x4_auto", "1x8", "4x1_rec"])
def test_column_row_pair_matches_unsharded(data, tensor, axis_type, recompute):
    """Output, input gradient and every weight and bias gradient of ColumnSP -> gelu ->
    RowSP equal flax.nnx.Linear's on one device (fp32)."""
    cfg = sp_jax.ParallelConfig(recompute_allgather=recompute, collective_matmul=True)
    s = 4 * tensor  # a few sequence positions per device
    x_host = np.random.default_rng(0).normal(size=(2 * data, s, IN)).astype(np.float32)
    with jax.set_mesh(_mesh(data, tensor, axis_type)):
        col = sp_jax.ColumnSequenceParallelLinear(IN, HID, parallel=cfg, rngs=nnx.Rngs(1))
        row = sp_jax.RowSequenceParallelLinear(HID, IN, parallel=cfg, rngs=nnx.Rngs(2))
        for layer, seed in ((col, 3), (row, 4)):
            layer.bias[...] = jax.random.normal(jax.random.key(seed), layer.bias.shape)
        ref_col, ref_row = reference_linear(col), reference_linear(row)
        loss, grads = _pair_grads(col, row, jnp.asarray(x_host))
    loss_r, grads_r = jax.value_and_grad(_pair_loss, argnums=(0, 1, 2))(ref_col, ref_row,
                                                                        x_host)
    chex.assert_trees_all_close(float(loss), float(loss_r), **TOL)
    for g, g_r in zip(grads[:2], grads_r[:2], strict=True):
        chex.assert_trees_all_close(grads_dict(g), grads_dict(g_r), **TOL)
    chex.assert_trees_all_close(to_host(grads[2]), np.asarray(grads_r[2]), **TOL)


def test_ring_steps():
    assert [ring_steps(t) for t in (1, 2, 3, 4, 8)] == [(0, 0), (1, 0), (1, 1), (2, 1), (4, 3)]
    assert all(sum(ring_steps(t)) == t - 1 for t in range(1, 17))


# --------------------------------------------------------------------------------------
# The compiled program (CPU, 8 simulated devices)
# --------------------------------------------------------------------------------------


def _cpu_hlo(recompute, t=4, collective_matmul=True):
    cfg = sp_jax.ParallelConfig(recompute_allgather=recompute, data_axis=None,
                                collective_matmul=collective_matmul)
    mesh = _mesh(1, t)
    with jax.set_mesh(mesh):
        col = sp_jax.ColumnSequenceParallelLinear(IN, HID, parallel=cfg, rngs=nnx.Rngs(1))
        row = sp_jax.RowSequenceParallelLinear(HID, IN, parallel=cfg, rngs=nnx.Rngs(2))
        x = jax.device_put(jnp.ones((2, 4 * t, IN)), NamedSharding(mesh, P(None, "tensor")))
        fwd = nnx.jit(lambda c, r, x: c(x)).lower(col, row, x).compile().as_text()
        both = nnx.jit(nnx.grad(_pair_loss, argnums=(0, 1, 2))).lower(col, row, x)
        return fwd, both.compile().as_text()


def _transfers(hlo, where):
    """Arrays moved by collective-permutes whose op_name contains ``where``."""
    return sum(c.operands for c in parse_collectives(hlo)
               if c.kind == "collective-permute" and f"/{where}/" in c.op_name)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", [False, True], ids=["save", "recompute"])
def test_rings_replace_all_gathers_and_reduce_scatters(recompute):
    t = 4
    _, hlo = _cpu_hlo(recompute, t)
    kinds = {c.kind for c in parse_collectives(hlo)}
    assert not kinds & {"all-gather", "reduce-scatter"}, kinds
    # t - 1 transfers per ring: column forward (gather), column backward (reduce-scatter
    # of dx, plus the re-gather of x with recompute), row forward (reduce-scatter), row
    # backward (gather of dy).
    assert _transfers(hlo, "sp_cm_column") == t - 1
    assert _transfers(hlo, "sp_cm_column_bwd") == (t - 1) * (2 if recompute else 1)
    assert _transfers(hlo, "sp_cm_row") == t - 1
    assert _transfers(hlo, "sp_cm_row_bwd") == t - 1


@pytest.mark.slow
def test_chunk_gemms_are_not_merged():
    """XLA's dot merger would fuse the independent chunk GEMMs of a ring back into one
    GEMM that waits for every chunk; the barriers between steps keep one GEMM per ring
    step (the two chunks of a bidirectional step may share one)."""
    t = 8
    fwd, _ = _cpu_hlo(False, t)
    plain, _ = _cpu_hlo(False, t, collective_matmul=False)

    def dots(text):
        return len(re.findall(r"= \S+ dot\(|= \S+ fusion\(.*calls=%[\w.]*dot", text))

    steps = max(ring_steps(t)) + 1  # own chunk, then one step per hop
    assert dots(plain) == 1
    assert dots(fwd) >= steps, fwd


# --------------------------------------------------------------------------------------
# 8 x H100 (deviceless): every transfer async, with a GEMM inside it
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def h100_stacks():
    return {cm: h100_block_stack(2, h=512, collective_matmul=cm) for cm in (False, True)}


@pytest.mark.slow
@requires_cuda_plugin
def test_h100_every_transfer_is_async_with_a_gemm_inside(h100_stacks):
    report = h100_stacks[True]
    collectives = parse_collectives(report.hlo)
    activations = [c for c in collectives if c.kind in ("all-gather", "reduce-scatter")]
    assert activations == [], [c.op_name for c in activations]  # fwd and bwd
    permutes = [c for c in collectives if c.kind == "collective-permute"]
    layers, t = 2, 8
    per_ring = {"sp_cm_column": 2, "sp_cm_row": 2, "sp_cm_row_bwd": 2,
                "sp_cm_column_bwd": 4}  # per layer: qkv + up, out + down; recompute
    for scope, rings in per_ring.items():
        moved = sum(c.operands for c in permutes if f"/{scope}/" in c.op_name)
        assert moved == rings * layers * (t - 1), (scope, moved)
    lazy = [c.op_name for c in permutes if not c.is_async or c.overlapped_gemms == 0]
    assert lazy == [], lazy


@pytest.mark.slow
@requires_cuda_plugin
def test_h100_collective_matmul_costs_little_memory(h100_stacks):
    """The rings add less than one full ``[b, s, h]`` activation to the plain path's peak:
    their assembly buffers are each op's own (a zeros constant, shared by every layer,
    kept one ``[s, h]`` and one ``[s, 4h / t]`` buffer alive across the whole program:
    +1.1 MiB here)."""
    plain, ring = h100_stacks[False], h100_stacks[True]
    full = 512 * 512 * 2  # [1, s, h] bf16
    assert ring.peak_bytes - plain.peak_bytes < full, (ring.peak_bytes, plain.peak_bytes)

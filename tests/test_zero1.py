"""ZeRO-1 (``ParallelConfig(fsdp="optimizer")``): parameters and gradients laid out as
without fsdp, the optimizer state sharded over the data axes, the update computed on each
device's shard and the new parameters all-gathered. A few AdamW steps equal the
replicated step on the same mesh (fp32, 1e-6) on data x tensor, with a context axis, with
pipeline stages and with an expert axis; each device holds 1 / data of each moment; the
compiled step reduce-scatters the gradients it updates and all-gathers the new
parameters."""

import chex
import jax
import numpy as np
import pytest
from _util import assert_bitwise, restore_onto, train_gpt
from conftest import make_mesh
from jax.sharding import AxisType

import sp_jax
from sp_jax.analysis import parse_collectives
from sp_jax.checkpoint import save_checkpoint
from sp_jax.models import GPTConfig
from sp_jax.training import optimizer_shardings

B, S, STEPS = 8, 16, 3
BASE = dict(vocab_size=64, max_seq_len=S, num_layers=2, num_heads=4, hidden=32)


def _batches(micro=1, steps=STEPS, seed=0, batch=B, seq=S):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, BASE["vocab_size"], size=(steps, batch, seq + 1)).astype(np.int32)
    return [{"tokens": t[:, :-1].reshape(micro, batch // micro, seq),
             "labels": t[:, 1:].reshape(micro, batch // micro, seq)} for t in tokens]


def _mesh(shape, axes):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Explicit,) * len(shape),
                         devices=jax.devices()[:n])


def _moments(step):
    """AdamW's (mu, nu) states (optax.adamw: scale_by_adam first in its chain)."""
    adam = step.opt_state[0]
    return adam.mu, adam.nu


def _shard_bytes(x) -> int:
    return x.addressable_shards[0].data.nbytes


def _zero1_like_replicated(cfg, mesh, batches, data: int, train=False, **parallel_kw):
    """Trains ``cfg`` on ``mesh`` with fsdp="optimizer" and with fsdp=False from the same
    initial parameters; asserts equal losses and parameters (fp32, 1e-6), the same
    parameter layout, and each moment leaf at 1 / ``data`` of the parameter's bytes per
    device. Returns the ZeRO-1 :class:`~sp_jax.training.TrainStep`."""
    init, losses, params, step = train_gpt(
        cfg, sp_jax.ParallelConfig(fsdp="optimizer", **parallel_kw), mesh, batches,
        train_mode=train)
    _, want_losses, want_params, ref = train_gpt(
        cfg, sp_jax.ParallelConfig(**parallel_kw), mesh, batches, init=init, train_mode=train)
    assert want_losses[-1] < want_losses[0]
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(params, want_params, rtol=1e-6, atol=1e-6)
    got_p, want_p = jax.tree.leaves(step.params), jax.tree.leaves(ref.params)
    assert [p.sharding for p in got_p] == [p.sharding for p in want_p]
    for moments, ref_moments in zip(_moments(step), _moments(ref), strict=True):
        for m, r, p in zip(jax.tree.leaves(moments), jax.tree.leaves(ref_moments), got_p,
                           strict=True):
            assert m.shape == p.shape and _shard_bytes(r) == _shard_bytes(p)
            assert _shard_bytes(m) * data == _shard_bytes(p), (m.shape, m.sharding)
    return step


def test_zero1_trains_like_replicated_on_data_x_tensor():
    """2 x 4 (data, tensor), 2 micro-batches: equal to the replicated step; each moment
    1 / 2 per device (every leaf of this model has a dimension that splits)."""
    _zero1_like_replicated(GPTConfig(**{**BASE, "scan_layers": True}), make_mesh(2, 4),
                           _batches(micro=2), 2)


def test_zero1_errors():
    with pytest.raises(ValueError, match="fsdp='optimizer'.*data_axis=None"):
        sp_jax.ParallelConfig(fsdp="optimizer", data_axis=None)
    with pytest.raises(ValueError, match=r"fsdp='zero1' is not a known.*'optimizer'.*'full'"):
        sp_jax.ParallelConfig(fsdp="zero1")
    assert sp_jax.ParallelConfig(fsdp=True) == sp_jax.ParallelConfig(fsdp="full")
    assert sp_jax.ParallelConfig(fsdp="optimizer").fsdp_axes == ()  # parameters replicated
    assert sp_jax.ParallelConfig(fsdp="optimizer").zero1_axes == ("data",)


@pytest.mark.slow
def test_zero1_with_a_context_axis_and_dropout_trains_like_replicated():
    """Ring attention on (data 2, context 2, tensor 2), dropout on: the data-manual step
    draws the whole batch's masks and keeps its rows, as the replicated step."""
    cfg = GPTConfig(**{**BASE, "max_seq_len": 32, "positions": "rotary", "dropout": 0.1})
    _zero1_like_replicated(cfg, _mesh((2, 2, 2), ("data", "context", "tensor")),
                           _batches(batch=4, seq=32), 2, train=True, context_parallel="ring")


@pytest.mark.slow
def test_zero1_with_pipeline_stages_trains_like_replicated():
    cfg = GPTConfig(**{**BASE, "num_layers": 4, "scan_layers": True})
    _zero1_like_replicated(cfg, _mesh((2, 2, 1, 2), ("stage", "data", "context", "tensor")),
                           _batches(micro=4), 2, pipeline_axis="stage",
                           pipeline_microbatches=4, pipeline_schedule="1f1b")


@pytest.mark.slow
def test_zero1_with_experts_trains_like_replicated():
    """(data 2, expert 2, tensor 2): the expert weights, already split over the expert
    axis, have their moments split over data too (1 / 2 more); the rest over (data,
    expert) (1 / 4)."""
    cfg = GPTConfig(**{**BASE, "scan_layers": True, "num_experts": 4, "experts_per_token": 2,
                       "moe_mlp_hidden": 16})
    mesh = _mesh((2, 2, 1, 2), ("data", "expert", "context", "tensor"))
    init, losses, params, step = train_gpt(
        cfg, sp_jax.ParallelConfig(fsdp="optimizer", expert_axis="expert"), mesh, _batches())
    _, want_losses, want_params, _ = train_gpt(
        cfg, sp_jax.ParallelConfig(expert_axis="expert"), mesh, _batches(), init=init)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(params, want_params, rtol=1e-6, atol=1e-6)
    leaves = jax.tree_util.tree_leaves_with_path(step.params)
    for moments in _moments(step):
        for (path, p), m in zip(leaves, jax.tree.leaves(moments), strict=True):
            experts = "experts_" in jax.tree_util.keystr(path)
            assert _shard_bytes(m) * (2 if experts else 4) == _shard_bytes(p), path


@pytest.mark.slow
def test_zero1_step_reduce_scatters_gradients_and_all_gathers_parameters():
    """The compiled ZeRO-1 step on 4 x 2 (data, tensor), 2 micro-batches, reduce-scatters
    each parameter's gradient over the data axis once per step (JAX scope
    ``zero1_grad_reduce_scatter``) and all-reduces no weight gradient (the replicated step
    all-reduces them whole); it all-gathers the new parameters over data."""
    cfg = GPTConfig(**{**BASE, "scan_layers": True})
    mesh = make_mesh(4, 2)
    batches = _batches(micro=2, steps=1)
    found = {}
    for fsdp in (False, "optimizer"):
        _, _, _, step = train_gpt(cfg, sp_jax.ParallelConfig(fsdp=fsdp), mesh, batches)
        with jax.set_mesh(mesh):
            hlo = step.compile(step.place(batches[0]), jax.random.key(0)).as_text()
        found[fsdp] = parse_collectives(hlo), step
    # per-device shapes of the weights (each tensor shard) and of their data shards
    collectives, step = found["optimizer"]
    params = jax.tree.leaves(step.params)
    local = {tuple(p.sharding.shard_shape(p.shape)) for p in params}
    big = {s for s in local if np.prod(s) >= 16 * 32}
    per_layer = {s[1:] for s in big if len(s) == 3}  # the scanned blocks' one layer
    scattered = [c for c in collectives if c.kind == "reduce-scatter"
                 and "zero1_grad_reduce_scatter" in c.op_name]
    update = jax.tree.leaves(optimizer_shardings(step.params, step.model.parallel))
    # every leaf but the [2, 128 / 2] bias: no free dimension divisible by 4, its moments
    # split as P(None, ('tensor', 'data')), its gradient all-reduced then sliced
    split = [u for u in update if "data" in tuple(u.spec)]
    assert len(split) >= len(params) - 1
    assert sum(len(c.arrays) for c in scattered) >= len(split)
    for c in collectives:
        if c.kind == "all-reduce":
            assert not {tuple(d) for _, d in c.arrays} & (big | per_layer), (c.op_name,
                                                                            c.arrays)
    gathered = {tuple(d) for c in collectives if c.kind == "all-gather" for _, d in c.arrays}
    assert big <= gathered, big - gathered
    replicated = found[False][0]
    assert not [c for c in replicated if c.kind == "reduce-scatter"
                and "zero1" in c.op_name]
    assert {tuple(d) for c in replicated if c.kind == "all-reduce"
            for _, d in c.arrays} & (big | per_layer)


@pytest.mark.slow
def test_zero1_checkpoint_restores_onto_replicated_and_full_fsdp_bitwise(tmp_path):
    """A ZeRO-1 run's parameters and AdamW state, saved, restore bitwise onto the
    replicated and the fsdp="full" layouts (each array in the target's own sharding)."""
    cfg = GPTConfig(**{**BASE, "scan_layers": True})
    _, _, _, step = train_gpt(cfg, sp_jax.ParallelConfig(fsdp="optimizer"), make_mesh(2, 4),
                              _batches(steps=2))
    save_checkpoint(tmp_path / "a", 2, step.params, step.opt_state)
    for parallel in (sp_jax.ParallelConfig(), sp_jax.ParallelConfig(fsdp="full"),
                     sp_jax.ParallelConfig(fsdp="optimizer")):
        restored = restore_onto(tmp_path / "a", cfg, parallel, make_mesh(4, 2))
        assert_bitwise(restored.params, step.params)
        assert_bitwise(restored.opt_state, step.opt_state)

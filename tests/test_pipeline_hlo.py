"""The compiled pipeline step on 8 simulated CPU devices: only the activation
collective-permutes of the tick loop cross stages (and, outside the loop, the all-reduce
of the shared parameters' gradients), each moves one sequence-parallel activation shard
``[b_local, s / (c t), h]``, and the loops run one permute per tick and direction (GPipe:
one in the forward loop, one in its autodiff backward loop; 1F1B: two per tick). Also the
HLO helpers that read it (replica groups in every notation, loops and execution counts).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding

import sp_jax
from sp_jax.analysis import hlo
from sp_jax.models import GPT, GPTConfig
from sp_jax.pipeline import pipeline_schedule
from sp_jax.training.step import train_step_fn

AXES = ("stage", "data", "context", "tensor")
LAYERS, HIDDEN, HEADS, SEQ, MICRO, VOCAB = 4, 16, 4, 16, 4, 64
B_LOCAL = 2  # sequences per data shard and micro-batch


# -- the HLO helpers on hand-written text --------------------------------------------------

HLO = """HloModule m, entry_computation_layout={(f32[2,4]{1,0})->f32[2,4]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[2,4])) -> (s32[], f32[2,4]) {
  %p = (s32[], f32[2,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %v = f32[2,4]{1,0} get-tuple-element(%p), index=1
  %cp = f32[2,4]{1,0} collective-permute(%v), channel_id=1, source_target_pairs={{0,2},{2,0},{1,3},{3,1}}, metadata={op_name="jit(f)/while/body/ppermute"}
  ROOT %t = (s32[], f32[2,4]{1,0}) tuple(%i, %cp)
}

%cond (p: (s32[], f32[2,4])) -> pred[] {
  %p = (s32[], f32[2,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: f32[2,4]) -> f32[2,4] {
  %a = f32[2,4]{1,0} parameter(0)
  %ar = f32[2,4]{1,0} all-reduce(%a), channel_id=2, replica_groups=[2,2]<=[4], use_global_device_ids=true, to_apply=%add
  %ag = f32[4,4]{1,0} all-gather(%ar), channel_id=3, replica_groups=mesh['x'=2,'y'=2], device_ids=([2,2]T(1,0)) {'x'}, dimensions={0}, use_global_device_ids=true
  %rs = f32[1,4]{1,0} reduce-scatter(%a), channel_id=4, replica_groups={{0,1},{2,3}}, dimensions={0}, to_apply=%add
  %z = s32[] constant(0)
  %t = (s32[], f32[2,4]{1,0}) tuple(%z, %a)
  %w = (s32[], f32[2,4]{1,0}) while(%t), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  ROOT %r = f32[2,4]{1,0} get-tuple-element(%w), index=1
}
"""  # noqa: E501 (HLO lines as XLA prints them)


def test_hlo_helpers_read_groups_pairs_loops_and_counts():
    # replica groups in XLA's three notations (and the "every device" empty list)
    assert hlo.replica_groups("replica_groups={{0,1},{2,3}}") == ((0, 1), (2, 3))
    assert hlo.replica_groups("x, replica_groups={}, y") == ()
    assert hlo.replica_groups("replica_groups=[2,4]<=[8]") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert hlo.replica_groups("replica_groups=[2,2]<=[2,2]T(1,0)") == ((0, 2), (1, 3))
    assert hlo.replica_groups("replica_groups=mesh['a'=2,'b'=1,'c'=4] {'c'}") == (
        (0, 1, 2, 3), (4, 5, 6, 7))
    # device ids iota([2,4]) transposed: [0,4,1,5,2,6,3,7] laid out over the mesh [4,1,2];
    # along 'a': {0,1,2,3} and {4,5,6,7}
    assert hlo.replica_groups("replica_groups=mesh['a'=4,'b'=1,'c'=2], device_ids=([2,4]T(1,0)) "
                          "{'a'}") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert hlo.replica_groups("replica_groups=mesh['a'=4] {'a':(1)2}") == ((0, 2), (1, 3))
    assert hlo.replica_groups("all-gather(%x), dimensions={0}") is None
    with pytest.raises(ValueError, match="unknown form"):
        hlo.replica_groups("replica_groups=something_new")
    assert hlo.source_target_pairs("source_target_pairs={{0,1},{1,0}}") == ((0, 1), (1, 0))

    cols = {c.name: c for c in hlo.parse_collectives(HLO)}
    assert cols["ar"].groups == ((0, 1), (2, 3)) and cols["ar"].computation == "main"
    assert cols["ag"].groups == ((0, 1), (2, 3))
    assert cols["cp"].pairs == ((0, 2), (2, 0), (1, 3), (3, 1)) and cols["cp"].groups is None
    assert cols["cp"].computation == "body"

    def pair_of(d):  # devices {0, 1} and {2, 3}
        return d // 2

    assert hlo.crosses(cols["cp"], pair_of)
    assert not hlo.crosses(cols["ar"], pair_of) and not hlo.crosses(cols["rs"], pair_of)
    assert hlo.crosses(cols["ar"], lambda d: d % 2)

    (loop,) = hlo.while_loops(HLO)
    assert (loop.name, loop.computation, loop.body, loop.condition, loop.trip_count) == (
        "w", "main", "body", "cond", 5)
    counts = hlo.execution_counts(HLO)
    assert counts["main"] == 1 and counts["body"] == 5 and counts["cond"] == 6
    assert counts["add"] == 2  # the reducer of two collectives of the entry
    assert hlo.execution_counts(HLO.replace(', backend_config={"known_trip_count":{"n":"5"}}',
                                        ""))["body"] is None


# -- the compiled pipeline step --------------------------------------------------------------


@functools.cache
def _compiled(kind: str, mesh_shape: tuple[int, ...]) -> tuple[str, Counter[int]]:
    """Optimized HLO of one training step of a tiny pipelined GPT (compiled once per
    config), and the per-device element counts of the parameters every stage holds."""
    mesh = jax.make_mesh(mesh_shape, AXES, axis_types=(AxisType.Explicit,) * 4,
                         devices=jax.devices()[:math.prod(mesh_shape)])
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=MICRO,
                                pipeline_schedule=kind)
    cfg = GPTConfig(vocab_size=VOCAB, max_seq_len=SEQ, num_layers=LAYERS, num_heads=HEADS,
                    hidden=HIDDEN, scan_layers=True)
    tx = optax.adamw(1e-3)
    with jax.set_mesh(mesh):
        gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=par, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(gpt, nnx.Param, ...)
        opt_state = jax.eval_shape(tx.init, params)
        tokens = jax.ShapeDtypeStruct(
            (MICRO, B_LOCAL * mesh_shape[1], SEQ), jnp.int32,
            sharding=NamedSharding(mesh, sp_jax.Layout.of(par).micro_batched_tokens))
        key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
        text = jax.jit(train_step_fn(graphdef, tx), donate_argnums=(0, 2)).lower(
            params, rest, opt_state, {"tokens": tokens, "labels": tokens}, key
        ).compile().as_text()
    shared = Counter(math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(params)
                     if "stage" not in jax.tree.leaves(tuple(x.sharding.spec)))
    return text, shared


CONFIGS = [
    pytest.param("1f1b", (2, 1, 1, 4), id="1f1b-2x1x1x4"),
    pytest.param("gpipe", (2, 1, 1, 4), id="gpipe-2x1x1x4", marks=pytest.mark.slow),
    pytest.param("1f1b", (2, 2, 1, 2), id="1f1b-2x2x1x2", marks=pytest.mark.slow),
    pytest.param("gpipe", (2, 2, 1, 2), id="gpipe-2x2x1x2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("kind", "mesh_shape"), CONFIGS)
def test_only_activation_permutes_cross_stages_one_per_tick_and_direction(
        kind: str, mesh_shape: tuple[int, ...]):
    text, shared = _compiled(kind, mesh_shape)
    stages, data, context, tensor = mesh_shape
    devices = math.prod(mesh_shape)
    per_stage = devices // stages

    def stage(d: int) -> int:  # the stage axis is outermost
        return d // per_stage

    counts = hlo.execution_counts(text)
    loops = {loop.body: loop for loop in hlo.while_loops(text)}
    shard = (B_LOCAL, SEQ // (context * tensor), HIDDEN)
    permutes: list[Any] = []
    reduced: Counter[int] = Counter()
    for c in hlo.parse_collectives(text):
        if not hlo.crosses(c, stage):
            continue
        if c.kind == "collective-permute":
            # an activation (or its gradient): the SP shard, one stage along the ring
            assert "ppermute" in c.op_name, c
            assert all(t in ((s + per_stage) % devices, (s - per_stage) % devices)
                       for s, t in c.pairs), c.pairs
            assert c.arrays == [("f32", shard)], c.arrays
            assert c.bytes == math.prod(shard) * 4
            permutes.append(c)
            continue
        # anything else spanning stages: the shared parameters' gradients (and scalars:
        # loss, token counts), summed over the stage axis once per step, outside the loop
        assert c.kind == "all-reduce", (c.kind, c.arrays, c.op_name)
        assert counts[c.computation] == 1, (c.arrays, c.computation)
        for _, dims in c.arrays:
            if math.prod(dims) > 1:
                reduced[math.prod(dims)] += 1
    assert reduced and not reduced - shared, (reduced, shared)  # each at most once

    ticks = pipeline_schedule(kind, stages, MICRO).num_ticks
    by_phase: Counter[str] = Counter()
    per_body: Counter[str] = Counter()  # permutes in each computation (a tick loop's body)
    for c in permutes:
        by_phase[c.phase] += counts[c.computation]
        per_body[c.computation] += 1
    if kind == "gpipe":  # forward loop: one per tick; its autodiff backward loop: one
        assert by_phase == {"forward": ticks, "backward": ticks}
        assert sorted(per_body.values()) == [1, 1]
        assert all(loops[body].trip_count == ticks for body in per_body)
    else:  # one loop doing a forward and a backward per tick (or one per phase)
        sched = pipeline_schedule(kind, stages, MICRO)
        fwd_ticks = int((sched.fwd_micro >= 0).any(axis=1).sum())
        bwd_ticks = int((sched.bwd_micro >= 0).any(axis=1).sum())
        assert set(by_phase) == {"forward"}  # 1F1B drives its backward itself
        # an activation to the next stage every tick that forwards and a gradient to the
        # previous one every tick that back-propagates; at most two per tick (lockstep:
        # both every tick, 2 x ticks; a send of zeros XLA can prove may be folded away)
        assert fwd_ticks + bwd_ticks <= by_phase["forward"] <= 2 * ticks, (
            by_phase, fwd_ticks, bwd_ticks, ticks)

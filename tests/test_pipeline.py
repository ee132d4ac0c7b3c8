"""Pipeline parallelism on a ``stage`` mesh axis (``ParallelConfig(pipeline_axis=...)``):
the schedules' tables keep every dependency; GPipe, circular and 1F1B steps train exactly
like the unsharded model (5 AdamW steps, fp32, rtol = atol = 1e-5) on meshes (stage,
data, context, tensor) with tensor, data, fsdp, ring attention, dropout, GQA, collective
matmul and recompute; checkpoints move between stage counts bitwise; 2 processes with
one stage each log the losses of one process; bad configurations are named."""

import dataclasses
import json
import time

import chex
import jax
import numpy as np
import optax
import pytest
from _util import (
    assert_bitwise,
    launch,
    read_jsonl,
    restore_onto,
    slow_except,
    train_gpt,
    two_processes,
    wait_all,
)
from conftest import make_mesh
from flax import nnx

import sp_jax
from sp_jax.checkpoint import save_checkpoint
from sp_jax.models import GPT, GPTConfig
from sp_jax.pipeline import bubble_formula, pipeline_schedule
from sp_jax.training import TrainStep

B, S, STEPS = 16, 16, 5
BASE = dict(vocab_size=61, max_seq_len=S, num_layers=8, num_heads=4, hidden=16,
            mlp_hidden=32, scan_layers=True)
AXES = ("stage", "data", "context", "tensor")


def _mesh(shape):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, AXES, devices=jax.devices()[:n])


def _batches(micro, steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, BASE["vocab_size"], size=(steps, B, S + 1)).astype(np.int32)
    return [{"tokens": t[:, :-1].reshape(micro, B // micro, S),
             "labels": t[:, 1:].reshape(micro, B // micro, S)} for t in tokens]


# -- schedules -------------------------------------------------------------------------


def _timeline(schedule):
    """{(micro-batch, virtual stage): tick} of the forward and backward tables."""
    p = schedule.stages
    fwd, bwd = {}, {}
    for t in range(schedule.num_ticks):
        for s in range(p):
            for table, (micro, chunk) in ((fwd, (schedule.fwd_micro, schedule.fwd_repeat)),
                                          (bwd, (schedule.bwd_micro, schedule.bwd_repeat))):
                if micro[t, s] >= 0:
                    key = (int(micro[t, s]), int(chunk[t, s]) * p + s)
                    assert key not in table, ("twice", key)
                    table[key] = t
    return fwd, bwd


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro,repeats", [(2, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2),
                                                  (4, 32, 1), (3, 5, 1), (2, 6, 3)])
def test_schedule_tables_keep_every_dependency(kind, stages, micro, repeats):
    """Each micro-batch passes every virtual stage once, in order, one tick per hop (the
    ppermute between ticks); 1F1B's backward runs them in reverse and starts in the tick
    of the last forward; tick counts, bubbles and live inputs are the analytic ones."""
    sched = pipeline_schedule(kind, stages, micro, repeats)
    v = stages * repeats
    fwd, bwd = _timeline(sched)
    assert sorted(fwd) == [(m, c) for m in range(micro) for c in range(v)]
    for m in range(micro):
        for c in range(1, v):
            assert fwd[m, c] == fwd[m, c - 1] + 1, (m, c)
    if kind == "gpipe":
        assert sched.num_ticks == micro * repeats + stages - 1
        assert sched.bubble_fraction == pytest.approx(bubble_formula(stages, micro, repeats))
        assert not bwd
        return
    assert sched.num_ticks == micro * repeats + v + stages - 2
    assert sorted(bwd) == sorted(fwd)
    for m in range(micro):
        assert bwd[m, v - 1] == fwd[m, v - 1]
        for c in range(v - 1):
            assert bwd[m, c] == bwd[m, c + 1] + 1
    # a stage keeps its inputs from forward to backward: at most 2V - 1, whatever M
    assert sched.max_live_inputs <= 2 * v - 1
    for t in range(sched.num_ticks):  # the slot read is the one written at the forward
        for s in range(stages):
            if sched.bwd_micro[t, s] >= 0:
                key = (int(sched.bwd_micro[t, s]), int(sched.bwd_repeat[t, s]) * stages + s)
                assert sched.bwd_slot[t, s] == fwd[key] % sched.num_slots


def test_1f1b_keeps_the_same_inputs_whatever_the_microbatches():
    live = {m: pipeline_schedule("1f1b", 4, m).max_live_inputs for m in (4, 8, 16, 32)}
    assert live == {m: min(m, 7) for m in live}, live  # 2 x 4 stages - 1 at most
    assert pipeline_schedule("gpipe", 4, 32).max_live_inputs == 32


def test_schedule_errors():
    with pytest.raises(ValueError, match=r"pipeline_microbatches=6 must be a multiple of "
                                         r"the 4 stages with pipeline_repeats=2.*use 4 or 8"):
        pipeline_schedule("1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match="kind='zb' is not one of"):
        pipeline_schedule("zb", 2, 4)
    with pytest.raises(ValueError, match="stages=0 must be a positive int"):
        pipeline_schedule("gpipe", 0, 4)


# -- configuration errors --------------------------------------------------------------


def test_config_errors():
    with pytest.raises(ValueError, match="pipeline_schedule='zb' is not a known schedule"):
        sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_schedule="zb")
    with pytest.raises(ValueError, match="pipeline_microbatches=0 must be a positive int"):
        sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=0)
    with pytest.raises(ValueError, match="need a pipeline; set pipeline_axis"):
        sp_jax.ParallelConfig(pipeline_microbatches=4)
    with pytest.raises(ValueError, match="pipeline_axis='tensor' is also the tensor"):
        sp_jax.ParallelConfig(pipeline_axis="tensor")
    with pytest.raises(TypeError, match="pipeline_axis=3 must be None or a non-empty"):
        sp_jax.ParallelConfig(pipeline_axis=3)
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=4)
    with jax.set_mesh(_mesh((2, 1, 1, 4))):
        with pytest.raises(ValueError, match=r"needs GPTConfig\(scan_layers=True\)"):
            GPT(GPTConfig(**{**BASE, "scan_layers": False}), parallel=par, rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match=r"num_layers=6 is not divisible by stages x "
                                             r"pipeline_repeats = 2 x 2 = 4"):
            GPT(GPTConfig(**{**BASE, "num_layers": 6}),
                parallel=par.replace(pipeline_repeats=2), rngs=nnx.Rngs(0))
        model = GPT(GPTConfig(**BASE), parallel=par, rngs=nnx.Rngs(0))
        step = TrainStep(model, optax.sgd(0.1))
        with pytest.raises(ValueError, match=r"has 2 micro-batches \(its leading "
                                             r"dimension\) but .*pipeline_microbatches=4"):
            step(_batches(2, steps=1)[0], jax.random.key(0))
        custom = TrainStep(model, optax.sgd(0.1), loss_fn=lambda m, b, k: (m.loss(
            b["tokens"]), 1))
        with pytest.raises(ValueError, match="a custom loss_fn cannot run on it"):
            custom(_batches(4, steps=1)[0], jax.random.key(0))
    with jax.set_mesh(make_mesh(2, 4)), pytest.raises(ValueError, match="pipeline axis "
                                                                       "'stage'.*not in"):
        GPT(GPTConfig(**BASE), parallel=par, rngs=nnx.Rngs(0))


# -- equivalence with the unsharded model ----------------------------------------------

_MLA = dict(attention="mla", q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
            qk_rope_head_dim=4, v_head_dim=6, positions="rotary", norm="rmsnorm",
            qkv_bias=False)
CASES = {  # id: (mesh, schedule, repeats, micro-batches, model options, parallel options)
    "2x1x1x4_1f1b_r1_m4": ((2, 1, 1, 4), "1f1b", 1, 4, {}, {}),
    "2x1x1x4_gpipe_r2_m4_recompute_cm": ((2, 1, 1, 4), "gpipe", 2, 4, {},
                                         {"recompute_allgather": True,
                                          "collective_matmul": True}),
    "4x2x1x1_1f1b_r1_m8_fsdp": ((4, 2, 1, 1), "1f1b", 1, 8, {}, {"fsdp": True}),
    "4x2x1x1_gpipe_r2_m8_gqa_rotary_untied": ((4, 2, 1, 1), "gpipe", 2, 8,
                                              {"num_kv_heads": 2, "positions": "rotary",
                                               "tie_embeddings": False}, {}),
    "2x2x1x2_1f1b_r2_m8_dropout": ((2, 2, 1, 2), "1f1b", 2, 8,
                                   {"dropout": 0.1, "attention_dropout": 0.1}, {}),
    "2x2x1x2_gpipe_r1_m4_remat": ((2, 2, 1, 2), "gpipe", 1, 4, {"remat": True}, {}),
    "2x1x2x2_ring_1f1b_r2_m4": ((2, 1, 2, 2), "1f1b", 2, 4, {"positions": "rotary"},
                                {"context_parallel": "ring"}),
    "2x1x2x2_ring_gpipe_r1_m8": ((2, 1, 2, 2), "gpipe", 1, 8, {},
                                 {"context_parallel": "ring"}),
    # multi-head latent attention in the stages: the latent ring on the context axis
    "2x1x2x2_ring_mla_1f1b_r2_m4": ((2, 1, 2, 2), "1f1b", 2, 4, _MLA,
                                    {"context_parallel": "ring"}),
    "2x2x1x2_mla_gpipe_r1_m4_remat": ((2, 2, 1, 2), "gpipe", 1, 4,
                                      {**_MLA, "q_lora_rank": None, "remat": True}, {}),
}


@pytest.mark.parametrize("case", slow_except(CASES, "2x1x1x4_1f1b_r1_m4"))
def test_pipeline_trains_like_unsharded(case):
    shape, kind, repeats, micro, model_kw, parallel_kw = CASES[case]
    cfg = GPTConfig(**{**BASE, **model_kw})
    parallel = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=micro,
                                     pipeline_schedule=kind, pipeline_repeats=repeats,
                                     **parallel_kw)
    batches = _batches(micro)
    train = cfg.dropout > 0
    init, losses, params, step = train_gpt(cfg, parallel, _mesh(shape), batches,
                                           train_mode=train)
    blocks = jax.tree.leaves(step.params["blocks"])
    # each stage holds its layers: [L, ...] over stage, or [R, L / R, ...] round robin
    assert all(tuple(x.sharding.spec)[repeats > 1] == "stage" for x in blocks)
    assert all(x.shape[:2] == (repeats, BASE["num_layers"] // repeats) for x in blocks
               if repeats > 1)
    per_device = sum(x.addressable_shards[0].data.nbytes for x in blocks)
    assert per_device <= sum(x.nbytes for x in blocks) // shape[0]
    init, params = _layer_order(init), _layer_order(params)
    want_losses, want_params = _unsharded(dataclasses.replace(cfg, remat=False), micro, init,
                                          train)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(params, want_params, rtol=1e-5, atol=1e-5)
    assert losses[-1] < losses[0]


_REFERENCES: dict = {}


def _unsharded(cfg, micro, init, train):
    """The unsharded model's losses and final parameters on :func:`_batches` from
    ``init`` (GPT's initial values depend on the config and seed only, not on the
    layout; asserted), computed once per config and micro-batch count."""
    key = (cfg, micro, train)
    if key not in _REFERENCES:
        _REFERENCES[key] = (init, *train_gpt(cfg, sp_jax.ParallelConfig(), make_mesh(1, 1),
                                             _batches(micro), init=init,
                                             train_mode=train)[1:3])
    start, losses, params = _REFERENCES[key]
    chex.assert_trees_all_equal(start, init)
    return losses, params


def _layer_order(values):
    """Host parameter values with the stacked blocks as ``[L, ...]`` (the unpipelined
    GPT's shape; a circular pipeline stores them ``[R, L / R, ...]``, in layer order)."""
    layers = BASE["num_layers"]
    return {**values, "blocks": jax.tree.map(
        lambda x: x.reshape(layers, *x.shape[2:]) if x.shape[:1] != (layers,) else x,
        values["blocks"])}


@pytest.mark.slow
def test_loss_of_a_pipelined_model_is_the_unsharded_loss():
    """``GPT.loss`` of a pipelined model (a GPipe forward: its micro-batches in eval mode,
    the whole batch as one in train mode, with the unpipelined model's dropout)."""
    cfg = GPTConfig(**{**BASE, "dropout": 0.1, "attention_dropout": 0.1})
    tokens = _batches(1, steps=1)[0]["tokens"][0]
    parallel = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=4)
    losses = {}
    for name, mesh, par in (("pipelined", _mesh((2, 2, 1, 2)), parallel),
                            ("unsharded", make_mesh(1, 1), sp_jax.ParallelConfig())):
        with jax.set_mesh(mesh):
            model = GPT(cfg, parallel=par, rngs=nnx.Rngs(0))
            loss = nnx.jit(lambda m, t: m.loss(t, rngs=nnx.Rngs(dropout=jax.random.key(3))))
            train = float(loss(model, tokens))
            model.eval()
            losses[name] = (train, float(loss(model, tokens)))
    np.testing.assert_allclose(losses["pipelined"], losses["unsharded"], rtol=1e-6)


# -- checkpoints ------------------------------------------------------------------------


@pytest.mark.slow
def test_checkpoint_moves_between_stage_counts_bitwise(tmp_path):
    """Saved with 2 stages, restored with 1 (no pipeline) and with 4: parameters and
    optimizer state bitwise, laid out as the target wants."""
    cfg = GPTConfig(**BASE)
    pipe = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=4,
                                 pipeline_schedule="1f1b")
    _, _, _, step = train_gpt(cfg, pipe, _mesh((2, 2, 1, 2)), _batches(4, steps=2))
    save_checkpoint(tmp_path / "two", 2, step.params, step.opt_state)
    for mesh, parallel in ((make_mesh(2, 4), sp_jax.ParallelConfig()),
                           (_mesh((4, 1, 1, 2)), pipe)):
        restored = restore_onto(tmp_path / "two", cfg, parallel, mesh)
        assert_bitwise(restored.params, step.params)
        assert_bitwise(restored.opt_state, step.opt_state)


# -- two processes, one stage each ------------------------------------------------------

FLAGS = ["--seq-len", "32", "--hidden", "32", "--heads", "4", "--layers", "2",
         "--batch-size", "8", "--mesh", "2,1,1,4", "--microbatches", "4",
         "--pipeline-schedule", "1f1b", "--steps", "3", "--eval-every", "3", "--no-progress"]


@pytest.mark.slow
def test_two_processes_with_one_stage_each_log_the_losses_of_one(tmp_path):
    """``--mesh 2,1,1,4`` as 2 processes x 4 devices (stage 0 on process 0, stage 1 on
    process 1: activations cross processes by ppermute) and as 1 process x 8."""
    procs = {"single": launch([*FLAGS, "--log-json", str(tmp_path / "single.jsonl")],
                              tmp_path / "single.out"),
             **two_processes(tmp_path, "pair", FLAGS)}
    codes = wait_all(procs, deadline=time.monotonic() + 300)
    outputs = {name: (tmp_path / f"{name}.out").read_text(errors="replace") for name in procs}
    assert set(codes.values()) == {0}, (codes, {k: v[-3000:] for k, v in outputs.items()})
    assert "1f1b pipeline, 4 micro-batches" in outputs["pair0"]
    single, pair = read_jsonl(tmp_path / "single.jsonl"), read_jsonl(tmp_path / "pair0.jsonl")
    want = [r["loss"] for r in single if "loss" in r]
    got = [r["loss"] for r in pair if "loss" in r]
    assert len(want) == 3, json.dumps(single)
    np.testing.assert_allclose(got, want, rtol=1e-6)

"""The pipeline outside the model and its one interpreter over action tables: tables are
data (drawn, their dependencies checked), a table of its own (8 stages, receive slots,
deferred weight gradients) runs with no driver code of its own and equals the
unpipelined model's gradients, deferred W actions equal the fused backward, and stages of
unequal depth (``pipeline_layers_per_stage``) train like the unsharded model."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import copy_weights, train_gpt
from conftest import make_mesh
from flax import nnx

import sp_jax
from sp_jax.models import GPT, GPTConfig
from sp_jax.pipeline import PipelinedGPT, PipelineSchedule, defer_weights, pipeline_schedule

AXES = ("stage", "data", "context", "tensor")
BASE = dict(vocab_size=61, max_seq_len=16, num_heads=4, hidden=16, mlp_hidden=32,
            scan_layers=True)


def _mesh(shape, axes=AXES):
    return jax.make_mesh(shape, axes, devices=jax.devices()[:int(np.prod(shape))])


def spread(stages: int, micro: int, gap: int = 2) -> PipelineSchedule:
    """A table of its own: micro-batch ``m`` forwards on stage ``s`` at tick ``m + gap
    s`` and back-propagates there at ``m + gap (2 P - 2 - s)``, so every activation and
    gradient waits ``gap - 1`` ticks in a receive slot (no built-in schedule does)."""
    ticks = micro + 2 * gap * (stages - 1)
    fwd = np.full((2, ticks, stages), -1)
    bwd = np.full((2, ticks, stages), -1)
    for m in range(micro):
        for s in range(stages):
            fwd[:, m + gap * s, s] = (m, 0)
            bwd[:, m + gap * (2 * stages - 2 - s), s] = (m, 0)
    return PipelineSchedule.from_actions("spread", stages, micro, 1, tuple(fwd), tuple(bwd))


# -- tables ----------------------------------------------------------------------------


def test_tables_are_data_drawn_and_checked():
    sched = pipeline_schedule("1f1b", 4, 6)
    text = str(sched).splitlines()
    assert text[0].startswith("1f1b: 4 stages, 6 micro-batches") and len(text) == 2 + 12
    assert text[1].split("|")[1].strip() == "stage 0"
    assert text[2 + 3].split("|")[4].split() == ["F0", "B0"]  # the last stage's loss tick
    # W actions two ticks after their backward (later where the stage's W is taken)
    late = defer_weights(sched, 2)
    assert late.driven and late.deferred and not sched.deferred
    for t, s in zip(*np.nonzero(late.wgt_micro >= 0), strict=True):
        m = late.wgt_micro[t, s]
        (b,) = np.flatnonzero(late.bwd_micro[:, s] == m)
        assert t >= b + 2 and late.wgt_slot[t, s] == late.bwd_wslot[b, s]
    assert "F5 B3 W1" in str(late)
    # receive slots: what arrives waits for its tick
    table = spread(4, 4)
    assert table.num_fwd_recv == table.num_bwd_recv == 2  # kept one tick: a ring of 2
    assert (table.fwd_from[table.fwd_micro[:, 1] >= 0, 1] >= 0).all()
    assert (table.fwd_keep[:, 1] >= 0).sum() == 4
    # dependencies are checked
    fwd = [np.array(sched.fwd_micro), np.array(sched.fwd_repeat)]
    for a in fwd:  # stage 1 forwards micro-batch 0 in the tick stage 0 does
        a[0, 1], a[1, 1] = a[1, 1], a[0, 1]
    with pytest.raises(ValueError, match="forward of virtual stage 1 at tick 0 is not after"):
        PipelineSchedule.from_actions("bad", 4, 6, 1, fwd)
    wgt = (np.roll(late.wgt_micro, -3, axis=0), np.roll(late.wgt_repeat, -3, axis=0))
    with pytest.raises(ValueError, match="comes before its backward"):
        PipelineSchedule.from_actions("bad", 4, 6, 1, (late.fwd_micro, late.fwd_repeat),
                                      (late.bwd_micro, late.bwd_repeat), wgt)


def test_the_layers_of_a_pipelined_gpt_hold_no_pipeline_field():
    """``GPT(..., parallel=ParallelConfig(pipeline_axis=...))`` builds the pipeline's
    wrapper of a plain GPT; the request is split once: every module inside holds the
    layers' config, the wrapper the pipeline's own."""
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=4,
                                pipeline_schedule="1f1b", pipeline_repeats=2)
    with jax.set_mesh(_mesh((2, 1, 1, 4))):
        model = nnx.eval_shape(lambda: GPT(GPTConfig(**BASE, num_layers=4), parallel=par,
                                           rngs=nnx.Rngs(0)))
    assert isinstance(model, PipelinedGPT) and model.parallel == par
    assert (model.pipeline.axis, model.pipeline.schedule, model.pipeline.repeats) == (
        "stage", "1f1b", 2)
    inner = [m for path, m in nnx.iter_graph(model) if path and hasattr(m, "parallel")]
    assert len(inner) > 10
    assert all(m.parallel.split_pipeline()[1] is None for m in inner)
    assert type(model.for_decoding) is not type(GPT.for_decoding)  # noqa: E721
    with pytest.raises(ValueError, match="run on its re-layout without stages"):
        model.check_decodable()


# -- tables of their own through the interpreter -----------------------------------------


def _grads(cfg, par, shape, tokens, labels, schedule=None):
    """Loss sum and gradients (blocks ``[L, ...]``) of one pipelined step with
    ``schedule`` (None: the config's), and the parameters."""
    with jax.set_mesh(_mesh(shape)):
        model = GPT(cfg, parallel=par, rngs=nnx.Rngs(0))
        step = nnx.jit(lambda m, a, b: m.pipeline_loss_and_grads(a, b, None,
                                                                 schedule=schedule))
        loss, _, grads = step(model, jnp.asarray(tokens), jnp.asarray(labels))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))

    def flat(v):
        v = jax.tree.map(np.asarray, v)
        return {**v, "blocks": jax.tree.map(
            lambda x: x.reshape(cfg.num_layers, *x.shape[2:]) if x.shape[0] !=
            cfg.num_layers else x, v["blocks"])}

    return float(loss), flat(grads), flat(params)


def _unpipelined(cfg, params, tokens, labels):
    """The same loss sum and its gradients, the unpipelined model on one device."""
    with jax.set_mesh(make_mesh(1, 1)):
        model = GPT(cfg, parallel=sp_jax.ParallelConfig(), rngs=nnx.Rngs(0))
        graphdef, state, rest = nnx.split(model, nnx.Param, ...)
        nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, params))

        def loss_sum(state):
            m = nnx.merge(graphdef, state, rest)
            return sum(m.loss(tokens[i], labels[i]) * jnp.sum(labels[i] != -100)
                       for i in range(tokens.shape[0]))

        loss, grads = jax.jit(jax.value_and_grad(loss_sum))(state)
    return float(loss), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


def _tokens(micro, rows, seed=0):
    t = np.random.default_rng(seed).integers(0, BASE["vocab_size"], (micro, rows, 17))
    return t[..., :-1].astype(np.int32), t[..., 1:].astype(np.int32)


@pytest.mark.slow
def test_an_8_stage_table_of_its_own_runs_through_the_interpreter():
    """8 stages (mesh 8 x 1 x 1 x 1), a table built as data (:func:`spread`: every
    activation and gradient waits in a receive slot; every weight gradient a W action a
    tick after its backward), run by the interpreter with no code of its own: the
    unpipelined model's loss and gradients (fp32)."""
    cfg = GPTConfig(**BASE, num_layers=8)
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=8,
                                pipeline_schedule="1f1b")
    table = defer_weights(spread(8, 8), 1)
    assert table.num_fwd_recv and table.num_bwd_recv and table.deferred
    tokens, labels = _tokens(8, 2)
    loss, grads, params = _grads(cfg, par, (8, 1, 1, 1), tokens, labels, table)
    want_loss, want = _unpipelined(cfg, params, tokens, labels)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    chex.assert_trees_all_close(grads, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    pytest.param({"fp8": sp_jax.Fp8Recipe("delayed", 4)}, id="fp8-delayed"),
    pytest.param({"num_experts": 4, "experts_per_token": 2, "moe_mlp_hidden": 16,
                  "router_aux_loss_coef": 0.01, "router_z_loss_coef": 0.001}, id="experts"),
])
def test_deferred_weight_gradients_equal_the_fused_backward(options):
    """1F1B with each weight gradient a W action of its own, 1 and 3 ticks after its
    backward (:func:`defer_weights`), against fused 1F1B (2 stages x 2 data x 2 tensor;
    FP8 delayed scaling: the amax histories' maximum; experts: the routers' coupled
    losses): loss and gradients equal (fp32, 1e-6)."""
    cfg = GPTConfig(**BASE, num_layers=4, **options)
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=4,
                                pipeline_schedule="1f1b")
    tokens, labels = _tokens(4, 4)
    labels[0, 0, :5] = -100
    loss, want, _ = _grads(cfg, par, (2, 2, 1, 2), tokens, labels)
    for ticks in (1, 3):
        table = defer_weights(pipeline_schedule("1f1b", 2, 4), ticks)
        got_loss, got, _ = _grads(cfg, par, (2, 2, 1, 2), tokens, labels, table)
        np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
        chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


# -- stages of unequal depth -------------------------------------------------------------

UNEQUAL = {  # id: (mesh, schedule, repeats, layers per virtual stage, model options)
    "2x1x1x2_1f1b_3-5": ((2, 1, 1, 2), "1f1b", 1, (3, 5), {}),
    "2x2x1x1_gpipe_r2_1-3-2-2_windows": ((2, 2, 1, 1), "gpipe", 2, (1, 3, 2, 2),
                                         {"layer_windows": (3, None, 5, None) * 2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(UNEQUAL))
def test_unequal_stages_train_like_unsharded(case):
    """``pipeline_layers_per_stage``: 3 layers on stage 0 and 5 on stage 1 (1F1B), or
    1, 3, 2, 2 over the virtual stages of a circular GPipe with per-layer windows: the
    blocks keep their ``[L, ...]`` layout, 3 AdamW steps equal the unsharded model's
    (fp32, 1e-5), and the logits of the trained model its logits."""
    shape, kind, repeats, counts, options = UNEQUAL[case]
    cfg = GPTConfig(**BASE, num_layers=8, **options)
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=4,
                                pipeline_schedule=kind, pipeline_repeats=repeats,
                                pipeline_layers_per_stage=counts)
    tokens, labels = _tokens(3, 8)
    batches = [{"tokens": tokens[i].reshape(4, 2, 16), "labels": labels[i].reshape(4, 2, 16)}
               for i in range(3)]
    init, losses, params, step = train_gpt(cfg, par, _mesh(shape), batches)
    assert all(x.shape[0] == 8 for x in jax.tree.leaves(step.params["blocks"]))
    _, want_losses, want_params, _ = train_gpt(cfg, sp_jax.ParallelConfig(),
                                               make_mesh(1, 1), batches, init=init)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(params, want_params, rtol=1e-5, atol=1e-5)
    with jax.set_mesh(_mesh(shape)):
        step.sync_model()
        model = step.model
        model.eval()
        got = np.asarray(nnx.jit(lambda m, t: m(t))(model, jnp.asarray(tokens[0])))
    with jax.set_mesh(make_mesh(1, 1)):
        flat = copy_weights(GPT(cfg, parallel=sp_jax.ParallelConfig(), rngs=nnx.Rngs(0)),
                            params)
        flat.eval()
        want = np.asarray(nnx.jit(lambda m, t: m(t))(flat, jnp.asarray(tokens[0])))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

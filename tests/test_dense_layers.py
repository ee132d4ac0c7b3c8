"""Dense layers before the experts (``GPTConfig(num_dense_layers=k)``, Hugging Face's
``first_k_dense_replace``): the scanned model holds a stack per kind (``dense_blocks``,
``blocks``) and equals the unrolled one; on a (data, expert, tensor) mesh it trains like
the unsharded model; it generates what an argmax loop of full forwards picks; pipeline
stages hold both kinds as data (a dense segment of inactive slots on the stages without
dense layers) and every schedule equals the unpipelined model; checkpoints round trip."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import (
    assert_bitwise,
    assert_restores,
    copy_weights,
    param_values,
    slow_except,
    to_host,
    train_gpt,
)
from flax import nnx
from jax.sharding import AxisType

import sp_jax
from sp_jax import compat
from sp_jax.models import GPT, GPTConfig, generate, hf
from sp_jax.pipeline import defer_weights, pipeline_schedule
from sp_jax.pipeline.placement import Placement, layer_kinds

S = 16
AXES = ("stage", "data", "expert", "context", "tensor")
MOE = dict(num_experts=4, experts_per_token=2, moe_mlp_hidden=16, router_aux_loss_coef=0.05,
           router_z_loss_coef=0.01)


def _config(**overrides) -> GPTConfig:
    return GPTConfig.llama("llama-tiny", **{
        "vocab_size": 64, "max_seq_len": S, "num_layers": 3, "num_heads": 4,
        "num_kv_heads": 2, "hidden": 32, "mlp_hidden": 48, "num_dense_layers": 1, **MOE,
        **overrides})


def _mesh(shape, axes=AXES):
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Explicit,) * len(axes),
                         devices=jax.devices()[:int(np.prod(shape))])


def _stacked(values, k):
    """An unrolled model's parameters (``blocks/{i}``) as the scanned model's:
    ``dense_blocks [k, ...]`` and ``blocks [L - k, ...]``."""
    layers = [values["blocks"][i] for i in sorted(values["blocks"])]
    rest = {n: v for n, v in values.items() if n != "blocks"}
    return {**rest, "dense_blocks": jax.tree.map(lambda *v: np.stack(v), *layers[:k]),
            "blocks": jax.tree.map(lambda *v: np.stack(v), *layers[k:])}


# -- the configuration, its layout and its tables ------------------------------------------


def test_dense_layers_config_layout_and_placement():
    """The field's checks (experts needed, fewer than the layers, moe_layer_freq 1 through
    sp_jax.compat), which layers are experts and the FLOPs, the state layout (scanned: a
    stack per kind; unrolled and without dense layers: as before), no Hugging Face family
    writing it, and the pipeline's placement of 8 layers (1 dense) on 2 stages: stage 0
    holds the dense layer and 3 expert layers, stage 1 an inactive dense slot and 4."""
    with pytest.raises(ValueError, match="num_dense_layers=1 needs num_experts > 0"):
        _config(num_experts=0)
    with pytest.raises(ValueError, match="num_dense_layers=3 must be below num_layers=3"):
        _config(num_dense_layers=3)
    with pytest.raises(ValueError, match=r"num_dense_layers=-1 must be an int >= 0"):
        _config(num_dense_layers=-1)
    with pytest.raises(compat.CombinationError, match=r"moe_layer_freq=2.*dense_layers x "
                                                      r"interleaved_experts in every mode"):
        _config(num_layers=4, moe_layer_freq=2)
    cfg = _config(num_layers=4, num_dense_layers=2)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, False, True, True]
    assert cfg.num_moe_layers == 2
    assert "dense_layers" in compat.features_of(cfg)
    assert "dense_layers" not in compat.features_of(_config(num_dense_layers=0))
    gated_mlp, gated_experts = 3 * 32 * 48, 3 * 32 * 16 * 2 + 32 * 4  # per token
    np.testing.assert_allclose(
        cfg.flops_per_token() - _config(num_layers=4, num_dense_layers=0).flops_per_token(),
        6 * 2 * (gated_mlp - gated_experts))
    with jax.set_mesh(_mesh((1, 1, 1, 1, 1))):
        def build(**overrides):
            return nnx.eval_shape(lambda: GPT(_config(**overrides), rngs=nnx.Rngs(0)))

        scanned, unrolled = build(scan_layers=True), build()
        plain = build(scan_layers=True, num_dense_layers=0)
    params = nnx.to_pure_dict(nnx.state(scanned, nnx.Param))
    assert params["dense_blocks"]["mlp"]["up"]["kernel"].shape == (1, 32, 96)
    assert params["blocks"]["mlp"]["experts_up"].shape == (2, 4, 32, 32)
    assert [type(b.mlp).__name__ for b in unrolled.blocks] == ["MLP", "MoE", "MoE"]
    assert unrolled.dense_blocks is None and plain.dense_blocks is None
    assert "dense_blocks" not in nnx.to_pure_dict(nnx.state(plain))
    with pytest.raises(ValueError, match="num_dense_layers=1"):
        hf.config_to_hf(_config())
    # 8 layers, the first dense, on 2 stages: (4, 4) and fewer on the first (3, 5)
    big = _config(num_layers=8, scan_layers=True)
    assert [(k.name, k.first, k.count) for k in layer_kinds(big)] == [
        ("dense_blocks", 0, 1), ("blocks", 1, 7)]
    for counts, expert_rows in (((4, 4), [[0, 1, 2, 0], [3, 4, 5, 6]]),
                                ((3, 5), [[0, 1, 0, 0, 0], [2, 3, 4, 5, 6]])):
        pipe = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_schedule="1f1b",
                                     pipeline_layers_per_stage=counts).split_pipeline()[1]
        dense, experts = (Placement.of(pipe, 2, 8, kind) for kind in layer_kinds(big))
        assert dense.active[:, 0].tolist() == [[True], [False]]
        assert experts.index[:, 0].tolist() == expert_rows
        assert experts.active[:, 0].sum(1).tolist() == [counts[0] - 1, counts[1]]
        assert experts.first == 1 and experts.layer_order().tolist() == [
            j for j, on in enumerate(experts.active[:, 0].reshape(-1)) if on]


# -- unpipelined: scanned against unrolled, sharded against unsharded ----------------------


def _loss_grads(cfg, par, mesh, values, tokens, key=None):
    """Loss, router metrics and gradients of ``GPT.loss`` (train mode: dropout of
    ``key``) of the model ``cfg`` holding ``values``."""
    with jax.set_mesh(mesh):
        model = copy_weights(GPT(cfg, parallel=par, rngs=nnx.Rngs(0)), values)

        def loss_fn(m, tokens):
            rngs = None if key is None else nnx.Rngs(dropout=key)
            return m.loss(tokens, rngs=rngs, return_metrics=True)

        @nnx.jit
        def run(m, tokens):
            return nnx.value_and_grad(loss_fn, has_aux=True)(m, tokens)

        (loss, metrics), grads = run(model, jnp.asarray(tokens))
    return float(loss), to_host(metrics), to_host(nnx.to_pure_dict(grads))


def test_scanned_dense_and_expert_stacks_equal_the_unrolled_layers():
    """scan_layers with remat and dropout (a key per layer, in layer order) on a (data,
    expert, tensor) = (2, 2, 2) mesh: a dense stack then an expert stack give the loss,
    router metrics and gradients of the unrolled layers (fp32)."""
    mesh, par = _mesh((2, 2, 2), ("data", "expert", "tensor")), sp_jax.ParallelConfig(
        expert_axis="expert")
    tokens = np.random.default_rng(5).integers(0, 64, (4, S)).astype(np.int32)
    cfg = _config(num_layers=2, dropout=0.1)
    with jax.set_mesh(mesh):
        init = param_values(GPT(cfg, parallel=par, rngs=nnx.Rngs(0)))
    key = jax.random.key(3)
    loss, metrics, grads = _loss_grads(cfg, par, mesh, init, tokens, key)
    got = _loss_grads(dataclasses.replace(cfg, scan_layers=True, remat=True), par, mesh,
                      _stacked(init, 1), tokens, key)
    np.testing.assert_allclose(got[0], loss, rtol=1e-6)
    chex.assert_trees_all_close(got[1], metrics, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(got[2], _stacked(grads, 1), rtol=1e-5, atol=1e-7)


def _batches(steps, rows=8, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        t = rng.integers(0, 64, (rows, S + 1)).astype(np.int32)
        out.append({"tokens": t[None, :, :-1], "labels": t[None, :, 1:]})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dense", [1, 2])
def test_dense_first_experts_train_like_unsharded(dense):
    """``num_dense_layers`` 1 and 2 of 4 scanned layers on a (data, expert, tensor) = (2,
    2, 2) mesh with fsdp: the loss and every gradient of the first batch, then 3 AdamW
    steps (losses and parameters), equal the unsharded model (fp32, 1e-5)."""
    cfg = _config(num_layers=4, num_dense_layers=dense, scan_layers=True)
    mesh = _mesh((2, 2, 1, 2), ("data", "expert", "context", "tensor"))
    par = sp_jax.ParallelConfig(expert_axis="expert", fsdp=True)
    one = _mesh((1, 1, 1, 1), ("data", "expert", "context", "tensor"))
    batches = _batches(3)
    init, losses, params, _ = train_gpt(cfg, par, mesh, batches)
    tokens = batches[0]["tokens"][0]
    got = _loss_grads(cfg, par, mesh, init, tokens)
    want = _loss_grads(cfg, sp_jax.ParallelConfig(), one, init, tokens)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    chex.assert_trees_all_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    _, want_losses, want_params, _ = train_gpt(cfg, sp_jax.ParallelConfig(), one, batches,
                                               init=init)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(params, want_params, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_greedy_generation_equals_an_argmax_loop_of_forwards():
    """A scanned dense-first mixture of experts on a (data, expert, context, tensor) =
    (1, 2, 1, 2) mesh: 6 greedy tokens of 2 ragged prompts (prefill, then the decode
    steps through the dense and the expert stacks over one cache) equal an argmax loop
    of full forwards."""
    cfg = _config(scan_layers=True, num_layers=4, num_dense_layers=2)
    prompts = [[5, 9, 3, 1, 7], [2, 8]]
    with jax.set_mesh(_mesh((1, 2, 1, 2), ("data", "expert", "context", "tensor"))):
        model = GPT(cfg, parallel=sp_jax.ParallelConfig(expert_axis="expert"),
                    rngs=nnx.Rngs(0))
        model.eval()
        out = generate(model, prompts, max_new_tokens=6)
        forward = nnx.jit(lambda m, t: m(t))
        for b, prompt in enumerate(prompts):
            row = list(prompt)
            for n in range(6):
                padded = np.zeros((2, S), np.int32)
                padded[:, :len(row)] = row
                logits = np.asarray(forward(model, jnp.asarray(padded)))
                assert out.tokens[b, n] == int(np.argmax(logits[0, len(row) - 1])), (b, n)
                row.append(int(out.tokens[b, n]))


@pytest.mark.slow
def test_hugging_face_tables_address_the_stack_of_each_kind(monkeypatch):
    """The conversion tables address a layer's row in its kind's stack: with a family
    that expresses dense layers first (Qwen3-MoE's table, test-only: no family sp_jax
    writes expresses ``num_dense_layers`` yet), the scanned model's Hugging Face tensors
    equal the unrolled model's (the dense layer's MLP from ``dense_blocks``, expert layer
    ``l`` from row ``l - k`` of ``blocks``), and reading them back gives the scanned
    parameters bitwise."""
    family = dataclasses.replace(hf.registry.REGISTRY["qwen3_moe"],
                                 expresses=lambda cfg: cfg.num_experts > 0)
    monkeypatch.setitem(hf.registry.REGISTRY, "qwen3_moe", family)
    cfg = GPTConfig.qwen3_moe("qwen3-moe-tiny", num_layers=3, num_dense_layers=1,
                              num_experts=4, experts_per_token=2)
    with jax.set_mesh(_mesh((1, 1), ("data", "tensor"))):
        unrolled = GPT(cfg, rngs=nnx.Rngs(0))
        scanned = copy_weights(GPT(dataclasses.replace(cfg, scan_layers=True),
                                   rngs=nnx.Rngs(1)),
                               jax.tree.map(jnp.asarray, _stacked(param_values(unrolled), 1)))
        want = hf.to_hf_state_dict(unrolled, model_type="qwen3_moe")
        got = hf.to_hf_state_dict(scanned, model_type="qwen3_moe")
        assert sorted(got) == sorted(want)
        assert "model.layers.0.mlp.gate_proj.weight" in got
        assert "model.layers.2.mlp.experts.3.down_proj.weight" in got
        for name, x in want.items():
            np.testing.assert_array_equal(got[name], x, err_msg=name)
        back = hf.from_hf(got, hf.config_to_hf(cfg, model_type="qwen3_moe"),
                          scan_layers=True, num_dense_layers=1)
    assert_bitwise(param_values(back), param_values(scanned))


# -- pipeline stages of two kinds ----------------------------------------------------------

PIPE = {  # id: (mesh, schedule, repeats, layers per virtual stage, dense layers, options)
    "2x1x2x1x1_1f1b_r1_3-5_dense1_dropout_windows": (
        (2, 1, 2, 1, 1), "1f1b", 1, (3, 5), 1,
        dict(dropout=0.1, layer_windows=(3, None, 5, None) * 2)),
    "2x2x1x1x2_gpipe_r2_1-3-2-2_dense2": ((2, 2, 1, 1, 2), "gpipe", 2, (1, 3, 2, 2), 2, {}),
    "2x1x2x1x1_deferred_1f1b_r1_even_dense1": ((2, 1, 2, 1, 1), "deferred", 1, None, 1, {}),
}
MICRO, ROWS = 4, 2


def _pipelined(cfg, par, shape, tokens, labels, key, schedule=None):
    """(loss sum / targets, router metrics, gradients / targets, parameters) of one
    pipelined step: the blocks of each kind ``[n, ...]`` in layer order."""
    with jax.set_mesh(_mesh(shape)):
        model = GPT(cfg, parallel=par, rngs=nnx.Rngs(0))
        model.train()
        step = nnx.jit(lambda m, a, b, k: m.pipeline_loss_and_grads(
            a, b, k, return_metrics=True, schedule=schedule))
        loss, count, grads, metrics = step(model, jnp.asarray(tokens), jnp.asarray(labels),
                                           key)
        params = param_values(model)
    count = float(count)
    return (float(loss) / count, to_host(metrics),
            jax.tree.map(lambda g: np.asarray(g) / count, grads), params)


def _unpipelined(cfg, params, tokens, labels, key):
    """The same of the unpipelined model on one device: each micro-batch's ``GPT.loss``
    (its dropout from ``fold_in(key, i)``, as ``lm_loss``) times its targets, summed."""
    with jax.set_mesh(_mesh((1,) * 5)):
        model = copy_weights(GPT(cfg, parallel=sp_jax.ParallelConfig(), rngs=nnx.Rngs(0)),
                             params)
        model.train()
        graphdef, state, rest = nnx.split(model, nnx.Param, ...)

        def loss_sum(state):
            m = nnx.merge(graphdef, state, rest)
            total, metrics = 0.0, []
            for i in range(tokens.shape[0]):
                rngs = nnx.Rngs(dropout=jax.random.fold_in(key, i))
                loss, mets = m.loss(tokens[i], labels[i], rngs=rngs, return_metrics=True)
                total = total + loss * jnp.sum(labels[i] != -100)
                metrics.append(mets)
            return total, jax.tree.map(lambda *v: sum(v) / len(v), *metrics)

        (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_sum, has_aux=True))(state)
    count = float(np.sum(labels != -100))
    return (float(loss) / count, to_host(metrics),
            jax.tree.map(lambda g: np.asarray(g) / count, nnx.to_pure_dict(grads)))


@pytest.mark.parametrize("case", slow_except(PIPE))
def test_pipeline_stages_of_two_kinds_equal_the_unpipelined_model(case):
    """8 layers, the first 1 or 2 dense, on 2 stages: 1F1B with 3 and 5 layers per stage
    (stage 0: the dense layer and 2 expert layers; dropout and per-layer windows), a
    circular GPipe of 1, 3, 2, 2 layers per virtual stage (the dense layers on two
    stages), and a table of its own (1F1B with each weight gradient a W action a tick
    later): the loss, the router metrics (only the real expert layers) and every
    gradient equal the unpipelined model's (fp32, per target: 1e-5)."""
    shape, kind, repeats, counts, dense, options = PIPE[case]
    cfg = _config(num_layers=8, num_dense_layers=dense, scan_layers=True,
                  **{"layer_windows": None, **options})
    par = sp_jax.ParallelConfig(
        pipeline_axis="stage", pipeline_microbatches=MICRO, pipeline_repeats=repeats,
        pipeline_schedule="1f1b" if kind == "deferred" else kind,
        pipeline_layers_per_stage=counts, expert_axis="expert" if shape[2] > 1 else None)
    table = defer_weights(pipeline_schedule("1f1b", 2, MICRO), 1) if kind == "deferred" \
        else None
    t = np.random.default_rng(1).integers(0, 64, (MICRO, ROWS * shape[1], S + 1))
    tokens, labels = t[..., :-1].astype(np.int32), t[..., 1:].astype(np.int32)
    labels[0, 0, :5] = -100
    key = jax.random.key(7)
    loss, metrics, grads, params = _pipelined(cfg, par, shape, tokens, labels, key, table)
    assert all(x.shape[0] == dense for x in jax.tree.leaves(params["dense_blocks"]))
    want_loss, want_metrics, want_grads = _unpipelined(cfg, params, tokens, labels, key)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    assert metrics["moe_expert_tokens"].shape == (8 - dense, 4)
    for name in ("moe_aux_loss", "moe_z_loss", "moe_expert_tokens"):
        np.testing.assert_allclose(metrics[name], want_metrics[name], rtol=1e-5, atol=1e-6,
                                   err_msg=name)
    chex.assert_trees_all_close(grads, want_grads, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_deferred_weight_gradients_of_two_kinds_with_fp8_delayed():
    """FP8 delayed scaling (each kind's amax histories combined by maximum) on a dense
    layer and 3 expert layers over 2 stages: 1F1B with its weight gradients W actions 2
    ticks later equals fused 1F1B (loss and gradients, the amaxes included; 1e-6)."""
    cfg = _config(num_layers=4, scan_layers=True, fp8=sp_jax.Fp8Recipe("delayed", 4))
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=MICRO,
                                pipeline_schedule="1f1b", pipeline_layers_per_stage=(1, 3),
                                expert_axis="expert")
    t = np.random.default_rng(2).integers(0, 64, (MICRO, ROWS, S + 1))
    tokens, labels = t[..., :-1].astype(np.int32), t[..., 1:].astype(np.int32)
    shape = (2, 1, 2, 1, 1)
    loss, _, want, _ = _pipelined(cfg, par, shape, tokens, labels, None)
    table = defer_weights(pipeline_schedule("1f1b", 2, MICRO), 2)
    got_loss, _, got, _ = _pipelined(cfg, par, shape, tokens, labels, None, table)
    histories = got["dense_blocks"]["attention"]["qkv"]["fp8_history"]
    assert np.any(np.asarray(jax.tree.leaves(histories)[0]) > 0)
    np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
    chex.assert_trees_all_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_checkpoint_of_two_kinds_moves_between_stages_and_no_pipeline(tmp_path):
    """A dense-first model trained on 2 pipeline stages (1F1B, 1 dense + 3 expert
    layers): its re-layout for decoding holds its parameters, and its checkpoint
    restores onto the unpipelined model and onto a circular GPipe of 2 chunks per stage
    (1 layer per virtual stage) with every parameter and Adam moment equal, and the
    restored model's loss equals the trained one's."""
    from sp_jax.checkpoint import save_checkpoint

    cfg = _config(num_layers=4, scan_layers=True)
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=MICRO,
                                pipeline_schedule="1f1b", expert_axis="expert")
    batches = [{k: v.reshape(MICRO, 2, S) for k, v in b.items()} for b in _batches(1)]
    _, _, params, step = train_gpt(cfg, par, _mesh((2, 1, 2, 1, 1)), batches)
    with jax.set_mesh(step.mesh):  # generation's re-layout: each stack off the stages
        assert_bitwise(param_values(step.sync_model().for_decoding()), params)
    save_checkpoint(tmp_path, 1, step.params, step.opt_state)
    circular = dataclasses.replace(par, pipeline_repeats=2, pipeline_schedule="gpipe")
    assert_restores(tmp_path, cfg, step, params, batches[0]["tokens"].reshape(-1, S), [
        (sp_jax.ParallelConfig(), _mesh((1, 1, 1, 1, 1))),
        (circular, _mesh((2, 1, 1, 1, 1)))])

"""Mixture of experts: the sharded, dropless (or capacity-limited) expert layers compute
exactly what a plain unsharded loop over the experts computes, on meshes with an expert
axis (data, expert, context, tensor), and the auxiliary loss is transformers' Mixtral one."""

import functools
import unittest.mock

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import (
    assert_restores,
    copy_weights,
    param_values,
    slow_except,
    to_host,
    token_batches,
    train_gpt,
)
from conftest import requires_cuda_plugin
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from sp_jax.layers import MoE, moe_losses
from sp_jax.models import GPT, GPTConfig
from sp_jax.ops.moe import router_stats

B, S = 8, 16
AXES = ("data", "expert", "context", "tensor")
# (data, expert, context, tensor) meshes and their ParallelConfig options
MESHES = {
    "expert8": ((1, 8, 1, 1), {}),
    "data2_expert2_tensor2_fsdp": ((2, 2, 1, 2), dict(fsdp=True, recompute_allgather=True)),
    "expert4_tensor2": ((1, 4, 1, 2), {}),
    "expert2_ring2_tensor2": ((1, 2, 2, 2), dict(context_parallel="ring")),
}
MOE = dict(num_experts=8, experts_per_token=2, moe_mlp_hidden=16, router_aux_loss_coef=0.05,
           router_z_loss_coef=0.01)


def _config(**overrides) -> GPTConfig:
    return GPTConfig.llama("llama-tiny", **{
        "vocab_size": 64, "max_seq_len": S, "num_layers": 2, "num_heads": 4,
        "num_kv_heads": 2, "hidden": 32, "mlp_hidden": 48, **MOE, **overrides})


def _mesh(shape):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Explicit,) * 4,
                         devices=jax.devices()[:n])


def _batches(vocab, steps, seed=0):
    return token_batches(vocab, steps, B, S, seed)


def reference_mixture(self, normed):
    """:meth:`MoE.mixture` written out plainly on the unsharded arrays: a loop over the
    experts, each computing every token and keeping those routed to it; the capacity rule
    as running counts over (choice rank, position)."""
    cfg = self.config
    e, k, f = cfg.num_experts, cfg.experts_per_token, cfg.moe_mlp_hidden
    x = jax.reshard(normed, P())  # whole, on the one device
    logits = x.astype(jnp.float32) @ jax.reshard(self.router[...], P()).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    chosen = jnp.argsort(-probs, axis=-1, stable=True)[..., :k]  # [b, s, k]
    weights = jnp.take_along_axis(probs, chosen, axis=-1)
    if cfg.moe_norm_topk:
        weights = weights / weights.sum(-1, keepdims=True)
    onehot = jax.nn.one_hot(chosen, e)  # [b, s, k, e]
    keep = jnp.ones(chosen.shape, bool)
    if cfg.moe_capacity_factor is not None:
        capacity = int(np.ceil(cfg.moe_capacity_factor * x.shape[1] * k / e))
        by_priority = onehot.transpose(0, 2, 1, 3).reshape(x.shape[0], -1, e)
        earlier = jnp.cumsum(by_priority, axis=1) - by_priority
        place = jnp.sum(earlier * by_priority, -1).reshape(x.shape[0], k, -1).transpose(0, 2, 1)
        keep = place < capacity
    gate = jnp.sum(onehot * (weights * keep)[..., None], axis=2)  # [b, s, e]
    up, down = (jax.reshard(w[...], P()) for w in (self.experts_up, self.experts_down))
    y = jnp.zeros(x.shape, jnp.float32)
    for i in range(e):
        h = (x @ up[i].astype(x.dtype)).reshape(*x.shape[:2], f, 2)
        out = (jax.nn.silu(h[..., 0]) * h[..., 1]) @ down[i].astype(x.dtype)
        y = y + gate[..., i, None] * out
    stats = {"expert_tokens": onehot.sum((0, 1, 2)),
             "router_probs": probs.sum((0, 1)),
             "router_z": jnp.sum(jax.nn.logsumexp(logits, -1) ** 2),
             "tokens": jnp.asarray(x.shape[0] * x.shape[1], jnp.float32),
             "dropped": jnp.sum(~keep).astype(jnp.float32)}
    return y.astype(x.dtype), stats


def _reference(monkeypatch, cfg, run):
    with monkeypatch.context() as m:
        m.setattr(MoE, "mixture", reference_mixture)
        return run(cfg, sp_jax.ParallelConfig(), _mesh((1, 1, 1, 1)))


@pytest.mark.slow
def test_dropless_experts_train_like_the_reference_loop(monkeypatch):
    """5 AdamW steps (aux and z losses on, one shared expert) on four meshes with an
    expert axis, one with fsdp and recompute_allgather, one with ring attention, equal
    to the unsharded model whose expert layers are the plain loop (fp32, 1e-5)."""
    cfg = _config(num_shared_experts=1)
    _train_like_the_reference_loop(monkeypatch, cfg, _batches(cfg.vocab_size, 5), MESHES)


def _train_like_the_reference_loop(monkeypatch, cfg, batches, names):
    """AdamW steps on ``batches`` on each of the ``names`` of :data:`MESHES` (an expert
    axis) equal the unsharded model whose expert layers are the plain loop (fp32, 1e-5):
    losses and parameters, from the same initial parameters."""
    init = None
    results = {}
    for name in names:
        shape, options = MESHES[name]
        par = sp_jax.ParallelConfig(expert_axis="expert", **options)
        got_init, losses, params, _ = train_gpt(cfg, par, _mesh(shape), batches, init=init)
        init = init or got_init
        results[name] = (losses, params)
    _, ref_losses, ref_params, _ = _reference(
        monkeypatch, cfg, lambda c, p, m: train_gpt(c, p, m, batches, init=init))
    assert ref_losses[-1] < ref_losses[0]
    for name, (losses, params) in results.items():
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5, err_msg=name)
        chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_experts_with_head_dim_apart_from_width_train_like_the_reference_loop(monkeypatch):
    """Expert layers beside attention whose head_dim (16) is not hidden / heads (32 / 4;
    2 key/value heads, q/k norm): 5 AdamW steps on an (expert, tensor, fsdp) mesh and
    an (expert, ring, tensor) mesh equal the unsharded model with the plain expert loop
    (fp32, 1e-5)."""
    cfg = _config(head_dim=16, qk_norm=True)
    batches = _batches(cfg.vocab_size, 1) * 5  # one batch again: its loss falls
    _train_like_the_reference_loop(monkeypatch, cfg, batches,
                                   ("data2_expert2_tensor2_fsdp", "expert2_ring2_tensor2"))


def _loss_and_grads(cfg, par, mesh, init, tokens):
    with jax.set_mesh(mesh):
        model = GPT(cfg, parallel=par, rngs=nnx.Rngs(0))
        if init is not None:
            copy_weights(model, init)

        @nnx.jit
        def loss_and_grads(m, tokens):
            return nnx.value_and_grad(lambda m: m.loss(tokens, return_metrics=True),
                                      has_aux=True)(m)

        (value, metrics), grads = loss_and_grads(model, tokens)
        return (param_values(model), float(value), to_host(metrics),
                to_host(nnx.to_pure_dict(grads)))


CAPACITY = _config(num_layers=1, moe_capacity_factor=1.0, num_heads=8, num_kv_heads=4)
CAPACITY_MESHES = {**MESHES,
                   "expert2_ulysses2_tensor2": ((1, 2, 2, 2), dict(context_parallel="ulysses"))}


@functools.cache
def _capacity_reference():
    """(initial parameters, tokens, (loss, metrics, gradients)) of the capacity-mode model
    unsharded, its expert layer the plain reference (computed once per process)."""
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, (B, S)), jnp.int32)
    with unittest.mock.patch.object(MoE, "mixture", reference_mixture):
        init, *ref = _loss_and_grads(CAPACITY, sp_jax.ParallelConfig(), _mesh((1, 1, 1, 1)),
                                     None, tokens)
    return init, tokens, ref


@pytest.mark.parametrize("name", slow_except(CAPACITY_MESHES, "data2_expert2_tensor2_fsdp"))
def test_capacity_drops_the_same_pairs_on_every_mesh(name):
    """Capacity mode (factor 1.0 on one expert layer): the loss, the dropped fraction,
    the tokens per expert and every gradient equal the reference rule's on all four
    meshes and with Ulysses attention, so each mesh keeps exactly the pairs the rule
    keeps."""
    init, tokens, ref = _capacity_reference()
    assert ref[1]["moe_dropped_fraction"] > 0.05  # the rule drops pairs here
    shape, options = CAPACITY_MESHES[name]
    par = sp_jax.ParallelConfig(expert_axis="expert", **options)
    _, value, metrics, grads = _loss_and_grads(CAPACITY, par, _mesh(shape), init, tokens)
    np.testing.assert_allclose(value, ref[0], rtol=1e-5)
    for key in ("moe_dropped_fraction", "moe_expert_tokens"):
        np.testing.assert_array_equal(metrics[key], ref[1][key], err_msg=key)
    chex.assert_trees_all_close(grads, ref[2], rtol=1e-5, atol=1e-6)


def test_aux_loss_equals_transformers_mixtral():
    """``moe_losses`` of the per-layer router statistics equals transformers' Mixtral
    ``load_balancing_loss_func`` (tests/fixtures/moe_aux_loss.npz: its value on random
    router logits of 3 layers, written by scripts/make_hf_fixtures.py)."""
    data = np.load("tests/fixtures/moe_aux_loss.npz")
    logits, k = jnp.asarray(data["logits"]), int(data["top_k"])  # [layers, tokens, E]
    stats = [router_stats(layer, jax.lax.top_k(jax.nn.softmax(layer), k)[1])
             for layer in logits]
    stacked = jax.tree.map(lambda *v: jnp.stack(v), *stats)
    got = moe_losses(stacked, logits.shape[-1], k)["moe_aux_loss"]
    np.testing.assert_allclose(got, data["aux_loss"], rtol=1e-6)


def test_moe_config_errors():
    with pytest.raises(ValueError, match="experts_per_token=9 must be at most num_experts=8"):
        _config(experts_per_token=9)
    with pytest.raises(ValueError, match="moe_capacity_factor=0 must be None"):
        _config(moe_capacity_factor=0)
    with pytest.raises(ValueError, match="moe_layer_freq=2 mixes dense and expert layers"):
        _config(scan_layers=True, moe_layer_freq=2)
    with pytest.raises(ValueError, match="expert_axis='tensor' is also the tensor"):
        sp_jax.ParallelConfig(expert_axis="tensor")
    with jax.set_mesh(_mesh((1, 8, 1, 1))), pytest.raises(
            ValueError, match="num_experts=4 must be divisible by the expert axis size 8"):
        GPT(_config(num_experts=4), parallel=sp_jax.ParallelConfig(expert_axis="expert"),
            rngs=nnx.Rngs(0))


def test_moe_layer_freq_mixes_dense_and_expert_layers():
    cfg = _config(num_layers=4, moe_layer_freq=2)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    with jax.set_mesh(_mesh((1, 1, 1, 1))):
        model = GPT(cfg, rngs=nnx.Rngs(0))
    assert [type(b.mlp).__name__ for b in model.blocks] == ["MLP", "MoE", "MLP", "MoE"]


def _arrays_of(jaxpr, per_device=False):
    """Every array the per-device programs (``shard_map`` bodies) of a jaxpr make:
    (shape, primitive name)."""
    for eqn in jaxpr.eqns:
        if per_device and eqn.primitive.name != "shard_map":
            for v in eqn.outvars:
                if hasattr(v.aval, "shape"):
                    yield tuple(v.aval.shape), eqn.primitive.name
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _arrays_of(inner, per_device or eqn.primitive.name == "shard_map")


@requires_cuda_plugin
def test_h100_expert_traffic_is_ragged_all_to_all_without_a_dense_dispatch():
    """One expert layer's forward+backward on (data, expert, context, tensor) = (2, 2, 1,
    2) H100s: the traced program has no array of ``T x E x h`` elements (``T`` a device's
    tokens), and in the compiled program the tokens cross devices only by ragged
    all-to-all over the expert axis (4: dispatch and return, forward and backward; two
    async), with
    the counts exchanged by small all-to-alls over the same groups; the rest of its
    traffic is the tensor axis' gather / reduce-scatter pair and gradient reductions."""
    from sp_jax.analysis import compile_for_gpu, gpu_mesh, parse_collectives

    shape, h, s, b = (2, 2, 1, 2), 64, 64, 4
    cfg = _config(num_layers=1, hidden=h, max_seq_len=s, moe_mlp_hidden=32,
                  dtype=jnp.bfloat16)
    par = sp_jax.ParallelConfig(expert_axis="expert")
    with jax.set_mesh(gpu_mesh(shape, AXES)):
        layer = nnx.eval_shape(lambda: MoE(cfg.moe_config(), parallel=par, rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(layer)
    x = jax.ShapeDtypeStruct((b, s, h), jnp.bfloat16, sharding=P(("data", "expert"), "tensor"))

    def grad(params, x):
        def loss(p, x):
            return jnp.sum(nnx.merge(graphdef, p)(x)[0].astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1))(params, x)

    tokens = b * s // (shape[0] * shape[1])  # a device's tokens after the tensor gather
    with jax.set_mesh(gpu_mesh(shape, AXES)):
        jaxpr = jax.make_jaxpr(grad)(params, x).jaxpr
    largest = max(np.prod(a) for a, _ in _arrays_of(jaxpr))
    assert largest < tokens * cfg.num_experts * h, largest
    report = compile_for_gpu(grad, params, x, mesh_shape=shape, axis_names=AXES)
    ops = parse_collectives(report.hlo)
    expert_groups = {(0, 2), (1, 3), (4, 6), (5, 7)}  # devices (d, e, c, t): e varies
    tensor_groups = {(0, 1), (2, 3), (4, 5), (6, 7)}
    ragged = [c for c in ops if c.kind == "ragged-all-to-all"]
    assert len(ragged) == 4
    for c in ops:
        if c.kind in ("ragged-all-to-all", "all-to-all"):
            assert set(c.groups) == expert_groups, c
            assert c.kind == "ragged-all-to-all" or c.bytes <= 64, c  # counts, offsets
        elif c.kind in ("all-gather", "reduce-scatter") and c.bytes > 4096:
            assert set(c.groups) == tensor_groups, c  # the activations' pair
    # The backward's pair overlaps the weight-gradient GEMMs. The forward's has nothing
    # independent to run beside it in this one-layer program (its dispatch feeds the
    # experts' GEMMs, their output the return), and XLA makes such a collective
    # synchronous; it was async only while the received rows' regrouping (a sort and
    # gathers, now gone) could run between start and done.
    assert sum(c.is_async for c in ragged) == 2, ragged


@pytest.mark.slow
def test_checkpoint_restores_across_expert_axis_sizes(tmp_path):
    """Trained on expert=4 x tensor=2, saved, restored onto expert=8 and onto data=2 x
    expert=2 x tensor=2 with fsdp: every parameter and Adam moment equal, each laid out as
    the new mesh wants, and the restored models' losses equal the trained one's."""
    from sp_jax.checkpoint import save_checkpoint

    cfg = _config(num_layers=1)
    batches = _batches(cfg.vocab_size, 1)
    par = sp_jax.ParallelConfig(expert_axis="expert")
    _, _, params, step = train_gpt(cfg, par, _mesh((1, 4, 1, 2)), batches)
    save_checkpoint(tmp_path, 1, step.params, step.opt_state)
    assert_restores(tmp_path, cfg, step, params, batches[0]["tokens"][0], [
        (sp_jax.ParallelConfig(expert_axis="expert", **options), _mesh(shape))
        for shape, options in (((1, 8, 1, 1), {}), ((2, 2, 1, 2), dict(fsdp=True)))])


@pytest.mark.slow
def test_scan_layers_and_remat_equal_the_unrolled_expert_layers():
    """scan_layers (the experts stacked on a layer axis) with remat: the same loss, router
    metrics and gradients as the unrolled layers, on expert=4 x tensor=2."""
    par = sp_jax.ParallelConfig(expert_axis="expert")
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 64, (B, S)), jnp.int32)
    init, unrolled = None, None
    for overrides in ({}, dict(scan_layers=True, remat=True)):
        cfg = _config(**overrides)
        if init is not None and overrides:  # stacked: [layers, ...] of the unrolled values
            stacked = jax.tree.map(lambda *v: np.stack(v), *init["blocks"].values())
            init = {**init, "blocks": stacked}
        got_init, *out = _loss_and_grads(cfg, par, _mesh((1, 4, 1, 2)), init, tokens)
        init = init or got_init
        if unrolled is None:
            unrolled = out
            continue
        np.testing.assert_allclose(out[0], unrolled[0], rtol=1e-6)
        np.testing.assert_allclose(out[1]["moe_expert_tokens"],
                                   unrolled[1]["moe_expert_tokens"])
        stacked_grads = jax.tree.map(lambda *v: np.stack(v), *unrolled[2]["blocks"].values())
        chex.assert_trees_all_close(out[2]["blocks"], stacked_grads, rtol=1e-5, atol=1e-7)


# -- experts in pipeline stages ------------------------------------------------------------

PIPE_AXES = ("stage", "data", "expert", "context", "tensor")
PIPE_MICRO, PIPE_BATCH = 4, 16
# id: ((stage, data, expert, context, tensor), schedule, repeats, ParallelConfig options)
PIPE_CASES = {
    "2x1x2x1x2_1f1b_r1": ((2, 1, 2, 1, 2), "1f1b", 1, {}),
    "2x2x2x1x1_gpipe_r2_fsdp": ((2, 2, 2, 1, 1), "gpipe", 2, {"fsdp": True}),
    "2x1x2x1x2_gpipe_r1": ((2, 1, 2, 1, 2), "gpipe", 1, {}),
    "2x2x2x1x1_1f1b_r2": ((2, 2, 2, 1, 1), "1f1b", 2, {}),
    "2x1x2x2x1_ring_1f1b_r1": ((2, 1, 2, 2, 1), "1f1b", 1, {"context_parallel": "ring"}),
}
ROUTER_METRICS = ("moe_aux_loss", "moe_z_loss", "moe_dropped_fraction", "moe_expert_tokens")


def _pipe_batches(steps=5, seed=0):
    """``[M, batch / M, seq]`` micro-batches whose target counts differ (a few targets
    ignored): each micro-batch's router losses weigh by its count, as in ``lm_loss``.
    Each step's batch twice in a row (the loss falls on it)."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(steps):
        if step % 2:
            out.append(out[-1])
            continue
        tokens = rng.integers(0, 64, size=(PIPE_BATCH, S + 1)).astype(np.int32)
        labels = tokens[:, 1:].copy()
        labels[0, : S // 2] = -100
        labels[PIPE_BATCH - 1, :3] = -100
        shape = (PIPE_MICRO, PIPE_BATCH // PIPE_MICRO, S)
        out.append({"tokens": tokens[:, :-1].reshape(shape), "labels": labels.reshape(shape)})
    return out


def _train_with_metrics(cfg, par, mesh, batches, init):
    """(initial parameters, per-step losses and router metrics, final parameters) of 5
    AdamW steps (as ``_util.train_gpt``), the blocks in layer order ``[L, ...]``."""
    with jax.set_mesh(mesh):
        model = GPT(cfg, parallel=par, rngs=nnx.Rngs(0))
        if init is not None:
            copy_weights(model, {**init, "blocks": jax.tree.map(
                lambda x, like: np.reshape(x, like.shape), init["blocks"],
                param_values(model)["blocks"])})
        start = param_values(model)
        step = sp_jax.training.TrainStep(model, optax.adamw(3e-3, eps=1e-5))
        place = NamedSharding(mesh, sp_jax.Layout.of(par).micro_batched_tokens)
        metrics = [to_host(step({k: jax.device_put(v, place) for k, v in b.items()},
                                jax.random.key(i))) for i, b in enumerate(batches)]
        final = to_host(nnx.to_pure_dict(step.params))
        # GPT.loss after training (eval mode): the whole batch, its router losses included
        whole = {k: v.reshape(-1, S) for k, v in batches[0].items()}
        metrics.append({"evaluate": step.evaluate([whole])})
    layers = cfg.num_layers

    def layer_order(values):
        return {**values, "blocks": jax.tree.map(
            lambda x: np.reshape(x, (layers, *x.shape[2:])) if x.shape[0] != layers else x,
            values["blocks"])}

    return layer_order(start), metrics, layer_order(final)


@functools.cache
def _pipe_reference():
    """The unsharded scanned model's run (its expert layers the plain reference loop):
    (initial parameters, per-step metrics, final parameters)."""
    cfg = _config(num_layers=4, scan_layers=True, num_shared_experts=1)
    with unittest.mock.patch.object(MoE, "mixture", reference_mixture):
        mesh = jax.make_mesh((1,) * 5, PIPE_AXES, axis_types=(AxisType.Explicit,) * 5,
                             devices=jax.devices()[:1])
        return _train_with_metrics(cfg, sp_jax.ParallelConfig(), mesh, _pipe_batches(), None)


# slow: the fast tier covers experts in pipeline stages in test_pipeline_forward.py
# (packed_experts), within make test-fast's budget
@pytest.mark.parametrize("case", slow_except(PIPE_CASES))
def test_experts_in_pipeline_stages_train_like_the_reference_loop(case):
    """Mixture-of-experts layers inside pipeline stages on (stage, data, expert, context,
    tensor) meshes (gpipe, circular, 1F1B; fsdp; ring attention): 5 AdamW steps (aux and
    z losses on, one shared expert, micro-batches of unequal target counts) equal the
    unsharded model with the plain expert loop (fp32, 1e-5): losses, parameters and the
    router metrics of every step, and the trained model's ``GPT.loss`` (evaluation). The
    load-balancing loss couples the layers of all stages (the stages exchange their
    router statistics: ``StageProgram.aux_loss``)."""
    shape, kind, repeats, options = PIPE_CASES[case]
    init, want, want_params = _pipe_reference()
    cfg = _config(num_layers=4, scan_layers=True, num_shared_experts=1)
    par = sp_jax.ParallelConfig(pipeline_axis="stage", expert_axis="expert",
                                pipeline_microbatches=PIPE_MICRO, pipeline_schedule=kind,
                                pipeline_repeats=repeats, **options)
    mesh = jax.make_mesh(shape, PIPE_AXES, axis_types=(AxisType.Explicit,) * 5,
                         devices=jax.devices()[:int(np.prod(shape))])
    start, got, params = _train_with_metrics(cfg, par, mesh, _pipe_batches(), init)
    chex.assert_trees_all_equal(start, init)
    np.testing.assert_allclose(got[-1]["evaluate"], want[-1]["evaluate"], rtol=1e-5)
    got, want = got[:-1], want[:-1]
    losses = [m["loss"] for m in got]
    np.testing.assert_allclose(losses, [m["loss"] for m in want], rtol=1e-5, atol=1e-5)
    assert losses[-1] < losses[0]
    for name in ROUTER_METRICS:
        np.testing.assert_allclose([m[name] for m in got], [m[name] for m in want],
                                   rtol=1e-5, atol=1e-6, err_msg=name)
    chex.assert_trees_all_close(params, want_params, rtol=1e-5, atol=1e-5)

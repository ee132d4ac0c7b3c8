"""Pre-LN mixture-of-experts MLP (Flax NNX) on global arrays: top-k routing, dropless
grouped GEMMs, experts split over the expert axis (all-to-all) and their width over the
tensor axis, in the sequence-parallel layout."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from sp_jax.attention import sequence_order
from sp_jax.config import ParallelConfig
from sp_jax.layers.block_config import MoEConfig, check_block_config
from sp_jax.layers.dropout import Dropout
from sp_jax.layers.gemm import layer_gemm
from sp_jax.layers.linear import ColumnSequenceParallelLinear, RowSequenceParallelLinear
from sp_jax.layers.mlp import MLPActivation
from sp_jax.layers.norm import make_norm
from sp_jax.layers.taps import layer_taps
from sp_jax.layout import Layout
from sp_jax.mesh import axis_size, check_activations, current_mesh, reshard
from sp_jax.ops.deferred import local_taps, placed_taps
from sp_jax.ops.gemm import Gemm
from sp_jax.ops.moe import (
    capacity_keep,
    expert_mixture,
    load_tap,
    route,
    router_scores,
    router_stats,
    routing_weights,
    select_experts,
)
from sp_jax.ops.primitives import all_gather, split

__all__ = ["MoE", "MoEStats", "RouterBias", "moe_losses", "router_loss",
           "update_router_biases"]

MoEStats = dict[str, jax.Array]
"""One layer's router statistics over the global batch (sums, fp32): ``expert_tokens``
``[E]`` (pairs routed to each expert, before any drop), ``router_probs`` ``[E]`` (router
probabilities), ``router_z`` (squared log-sum-exp of the router logits), ``tokens`` and
``dropped`` (pairs over capacity); with ``moe_seq_aux_loss_coef``, ``seq_balance`` and
``sequences`` (:func:`sp_jax.ops.moe.router_stats`)."""


class RouterBias(nnx.Param):
    """A mixture of experts' selection bias ``[E]`` (fp32, replicated; stacked layers:
    ``[layers, E]``): added to the router's scores for the choice of experts only
    (aux-loss-free balancing, Hugging Face's ``e_score_correction_bias``). Like the FP8
    amax history (:class:`~sp_jax.layers.fp8.Fp8History`) it travels with the parameters
    (shardings, checkpoints, the step's donated state) but is not trained: its
    "gradient" is the step's expert loads (:func:`sp_jax.ops.moe.load_tap`), which
    :class:`~sp_jax.training.TrainStep` sums over the micro-batches and turns into the
    update (:func:`update_router_biases`), with no optimizer state. Its metadata
    ``update_rate`` is the layer's ``moe_bias_update_rate``."""


def update_router_biases(biases: nnx.State, loads: nnx.State) -> nnx.State:
    """The biases after one step (DeepSeek-V3's rule, per layer): ``bias + rate *
    sign(mean_e load - load)``, ``load`` ``[..., E]`` the pairs routed to each expert
    over the whole step (the biases' "gradients": every data shard and micro-batch),
    ``rate`` each bias's ``update_rate``; an expert above the mean load loses ``rate``,
    one below gains it. Computed as ``sign(sum_e load - E * load)``: exact while the
    step's routed pairs stay below 2^24 (the counts are summed in fp32; only the sign
    is used)."""
    def one(bias: nnx.Variable, load: nnx.Variable) -> nnx.Variable:
        load = load[...]
        e = load.shape[-1]
        step = jnp.sign(jnp.sum(load, axis=-1, keepdims=True) - e * load)
        return bias.replace(bias[...] + bias.get_metadata().get("update_rate", 0.0) *
                            step.astype(bias[...].dtype))

    return jax.tree.map(one, biases, loads, is_leaf=lambda v: isinstance(v, nnx.Variable))


def router_loss(metrics: dict[str, jax.Array], config: Any) -> jax.Array:
    """The routers' share of the training loss from :func:`moe_losses`' ``metrics``:
    ``router_aux_loss_coef`` times the load-balancing loss, ``router_z_loss_coef`` the
    z-loss and ``moe_seq_aux_loss_coef`` the sequence-wise balance loss (``config``: a
    :class:`~sp_jax.models.GPTConfig`)."""
    loss = config.router_aux_loss_coef * metrics["moe_aux_loss"] + \
        config.router_z_loss_coef * metrics["moe_z_loss"]
    if "moe_seq_aux_loss" in metrics:
        loss = loss + config.moe_seq_aux_loss_coef * metrics["moe_seq_aux_loss"]
    return loss


def moe_losses(stats: MoEStats, num_experts: int, experts_per_token: int
               ) -> dict[str, jax.Array]:
    """The auxiliary losses and metrics of stacked per-layer :data:`MoEStats` (leaves
    ``[layers, ...]``), over every layer's tokens together (transformers'
    ``load_balancing_loss_func`` of the concatenated router logits):

    - ``moe_aux_loss``: ``E * sum_e f_e P_e``, ``f_e`` the fraction of (token, choice)
      pairs routed to expert ``e`` (summed over the ``k`` choices) and ``P_e`` the mean
      router probability of ``e``;
    - ``moe_z_loss``: the mean squared log-sum-exp of the router logits (ST-MoE);
    - ``moe_dropped_fraction``: dropped pairs over all pairs (capacity mode; else 0);
    - ``moe_expert_tokens``: ``[layers, E]`` pairs routed to each expert;
    - with the statistics of a sequence-wise loss (``moe_seq_aux_loss_coef``):
      ``moe_seq_aux_loss``, DeepSeek-V3's ``sum_i f_i P_i`` of each sequence (``f_i``:
      ``E / (k T)`` times its pairs routed to ``i``, ``P_i`` the mean normalised score
      of ``i`` over its ``T`` tokens), averaged over the sequences, summed over the layers.
    """
    tokens = jnp.maximum(jnp.sum(stats["tokens"]), 1.0)
    fraction = jnp.sum(stats["expert_tokens"], axis=0) / tokens
    probability = jnp.sum(stats["router_probs"], axis=0) / tokens
    out = {"moe_aux_loss": num_experts * jnp.sum(fraction * probability),
           "moe_z_loss": jnp.sum(stats["router_z"]) / tokens,
           "moe_dropped_fraction": jnp.sum(stats["dropped"]) / (tokens * experts_per_token),
           "moe_expert_tokens": stats["expert_tokens"]}
    if "seq_balance" in stats:  # every layer sees the same sequences
        out["moe_seq_aux_loss"] = jnp.sum(stats["seq_balance"]) / jnp.maximum(
            jnp.max(stats["sequences"]), 1.0)
    return out


class MoE(nnx.Module):
    """Pre-LN mixture of experts with a residual: ``x + dropout(sum_j w_j
    FFN_{e_j}(norm(x)) + shared(norm(x)))`` (with ``post_norms`` the sum normed first),
    the ``k`` experts ``e_j`` and weights ``w_j`` chosen per token by a linear router
    (fp32 softmax, top-k, renormalised with ``moe_norm_topk``; DeepSeek-V3's routing
    with ``moe_scoring="sigmoid"``, ``moe_groups`` / ``moe_topk_groups`` (group-limited
    top-k), ``moe_routed_scale`` and the selection bias ``router_bias``, a
    :class:`RouterBias` ``[E]`` (aux-loss-free balancing), :func:`~sp_jax.ops.moe.route`).

    Parameters: ``router`` ``[hidden, E]`` (replicated), ``experts_up`` ``[E, hidden,
    width]`` (``width = 2F`` gated, columns interleaved ``(j, {gate, up})`` as in
    :class:`~sp_jax.layers.MLP`, else ``F``) and ``experts_down`` ``[E, F, hidden]``,
    sharded ``Layout.expert_up`` / ``expert_down``: experts over the expert axis, ``F``
    over the tensor axis, and with fsdp ``hidden`` over the other data axes. With
    ``num_shared_experts``: ``shared_up`` / ``shared_down``, a dense gated MLP of width
    ``num_shared_experts * F``.

    Per device (one ``shard_map``): the router runs on the device's sequence shard; the
    normed input is all-gathered over the tensor axis (the dense MLP's gather), the
    device's (token, choice) pairs are sorted by expert and sent to the devices holding
    their experts and back by ragged all-to-all over the expert axis
    (:func:`sp_jax.ops.moe.expert_mixture`), each computing its experts' ``F / t``
    columns with grouped GEMMs (:func:`sp_jax.ops.moe.grouped_matmul`: the work of the
    routed rows), and the weighted sum is reduce-scattered back to the sequence shards
    (the dense MLP's scatter). Dropless unless ``moe_capacity_factor`` is set.

    With ``config.fp8`` (an :class:`~sp_jax.Fp8Recipe`) the two grouped GEMMs run in FP8
    (:func:`sp_jax.ops.moe.fp8_grouped_gemm`: the dense layers' recipe, one whole-tensor
    scale per operand over every device's rows and every expert shard), and so do the
    shared experts' projections; with delayed scaling the layer holds the up and down
    GEMMs' amax histories as ``experts_up_fp8_history`` / ``experts_down_fp8_history``
    (:class:`~sp_jax.layers.fp8.Fp8History`, rolled by the training step like the dense
    layers').

    Generation runs :meth:`decode_step` (one token per row, inside the decode
    ``shard_map``, the expert weights in their training layout; in the compute dtype,
    as the dense layers decode).

    Args:
      config: the :class:`~sp_jax.layers.MoEConfig`.
      parallel: the :class:`~sp_jax.ParallelConfig` (``expert_axis``: the experts'
        axis; None: every device holds every expert).
      rngs: ``params`` rng stream. Dropout draws from the ``rngs`` passed to each call.
    """

    def __init__(self, config: MoEConfig, *, parallel: ParallelConfig = ParallelConfig(),
                 rngs: nnx.Rngs):
        check_block_config("MoE", config, MoEConfig, "sp_jax.layers.MoEConfig", "moe_config")
        self.config, self.parallel = config, parallel
        mesh = current_mesh(parallel, where="MoE", required=False)
        if mesh is not None:
            self._check_mesh(mesh)
        layout, eager = Layout.of(parallel), mesh is not None
        e, h, f = config.num_experts, config.hidden, config.moe_mlp_hidden
        width = (2 if config.gated else 1) * f
        self.norm = make_norm(config.norm, h, parallel=parallel, epsilon=config.norm_epsilon,
                              dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs,
                              norm_offset=config.norm_offset)
        dense = nnx.initializers.lecun_normal()
        stacked = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
        self.router = nnx.Param(dense(rngs.params(), (h, e), config.param_dtype),
                                out_sharding=(None, None), eager_sharding=eager)
        self.router_bias = RouterBias(
            jnp.zeros((e,), jnp.float32), out_sharding=(None,), eager_sharding=eager,
            update_rate=float(config.moe_bias_update_rate)) if config.router_bias else None
        self.experts_up = nnx.Param(stacked(rngs.params(), (e, h, width), config.param_dtype),
                                    out_sharding=tuple(layout.expert_up), eager_sharding=eager)
        self.experts_down = nnx.Param(stacked(rngs.params(), (e, f, h), config.param_dtype),
                                      out_sharding=tuple(layout.expert_down),
                                      eager_sharding=eager)
        # the up and down GEMMs, their states at the layer's paths
        self.experts_up_gemm = layer_gemm("MoE", config.fp8, None, parallel, eager=eager)
        self.experts_down_gemm = layer_gemm("MoE", config.fp8, None, parallel, eager=eager)
        self.experts_up_fp8_history = self.experts_up_gemm.state
        self.experts_down_fp8_history = self.experts_down_gemm.state
        self.shared_up: ColumnSequenceParallelLinear | None = nnx.data(None)
        self.shared_down: RowSequenceParallelLinear | None = nnx.data(None)
        if config.num_shared_experts:
            shared = config.num_shared_experts * f
            common = dict(parallel=parallel, dtype=config.dtype, param_dtype=config.param_dtype,
                          use_bias=False, fp8=config.fp8, rngs=rngs)
            self.shared_up = ColumnSequenceParallelLinear(
                h, (2 if config.gated else 1) * shared, **common)
            self.shared_down = RowSequenceParallelLinear(shared, h, **common)
        self.dropout = Dropout(config.dropout, parallel=parallel)  # rngs come with each call
        # post_norms: the mixture's output normed before the residual add (as the MLP's)
        self.post_norm = make_norm(config.norm, h, parallel=parallel,
                                   epsilon=config.norm_epsilon, dtype=config.dtype,
                                   param_dtype=config.param_dtype, rngs=rngs,
                                   norm_offset=config.norm_offset) \
            if config.post_norms else None

    def _check_mesh(self, mesh: Any) -> None:
        cfg, par = self.config, self.parallel
        ep = axis_size(mesh, par.expert_axes) if par.expert_axes else 1
        t = axis_size(mesh, par.tensor_axis)
        if cfg.num_experts % ep:
            raise ValueError(f"MoE: num_experts={cfg.num_experts} must be divisible by the "
                             f"expert axis size {ep} (each device holds E / {ep} experts).")
        for name in ("moe_mlp_hidden",) + (("num_shared_experts",) if
                                           cfg.num_shared_experts else ()):
            width = cfg.moe_mlp_hidden * (cfg.num_shared_experts if name ==
                                          "num_shared_experts" else 1)
            if width % t:
                raise ValueError(f"MoE: the expert width {width} ({name}) must be divisible "
                                 f"by the tensor axis size {t}.")

    def param_specs(self, layout: Layout, mesh: Any = None) -> dict[str, P]:
        """The spec of each expert parameter by name in ``layout`` (training's or the
        decode layout, :func:`~sp_jax.layers.linear.decode_layout`): the router whole,
        the experts over the expert axis and their width over the tensor axis
        (``Layout.expert_up`` / ``expert_down``)."""
        return {"router": P(None, None), "experts_up": layout.expert_up,
                "experts_down": layout.expert_down}

    def decode_step(self, x: jax.Array) -> jax.Array:
        """The single-token (decode) mode per device, inside a ``shard_map`` whose copy of
        this module holds its blocks of the decode layout (:meth:`param_specs`: this
        device's ``E / ep`` experts, ``F / t`` columns each): ``x`` ``[b, 1, hidden]``
        whole rows (this device's rows of the batch) -> ``x + mixture(norm(x))``, whole
        rows, no dropout.

        The routing and the experts' grouped GEMMs are the training path's
        (:func:`~sp_jax.ops.moe.route`, :func:`~sp_jax.ops.moe.expert_mixture`); per
        layer and token, with an expert axis of size ``ep > 1``: one all-gather of the
        normed rows over the expert axis (each expert shard sees every row of its expert
        group), each device computes its own experts' columns for the pairs routed to
        them (the other pairs count as dropped there), and one all-reduce over the
        expert and tensor axes sums the experts and the column blocks, each device
        keeping its own rows. Without an expert axis: the one all-reduce over the tensor
        axis (the dense MLP's). Shared experts add the dense MLP's all-reduce.
        Dropless (a single token never exceeds an expert's capacity)."""
        cfg, par = self.config, self.parallel
        normed = self.norm.local(x)
        dtype = normed.dtype
        b, s, h = normed.shape
        router = (self.router[...],
                  None if self.router_bias is None else self.router_bias[...])
        y = _decode_device(normed.reshape(b * s, h), router,
                           self.experts_up[...].astype(dtype),
                           self.experts_down[...].astype(dtype), config=cfg, parallel=par)
        y = y.reshape(b, s, h)
        if self.shared_up is not None:
            y = y + self.shared_down.local_decode(
                self.shared_up.local_decode(normed),
                activation=MLPActivation(cfg.mlp_activation)).astype(y.dtype)
        if self.post_norm is not None:
            y = self.post_norm.local(y)
        return x.astype(y.dtype) + y

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None,
                 rngs: Any = None) -> tuple[jax.Array, MoEStats]:
        """``x``: ``[batch, seq, hidden]`` in the SP layout -> (same shape and layout,
        this layer's :data:`MoEStats` over the global batch)."""
        x = jnp.asarray(x)
        check_activations("MoE", x, self.config.hidden, "hidden")
        normed = self.norm(x)
        y, stats = self.mixture(normed)
        if self.shared_up is not None:
            y = y + self.shared_down(self.shared_up(normed),
                                     activation=MLPActivation(self.config.mlp_activation))
        if self.post_norm is not None:  # per token: the SP layout's rows
            y = self.post_norm(y)
        y = self.dropout(y, deterministic=deterministic, rngs=rngs)
        return x.astype(y.dtype) + y, stats

    def mixture(self, normed: jax.Array) -> tuple[jax.Array, MoEStats]:
        """The routed experts' weighted sum of the normed input ``[batch, seq, hidden]``
        (SP layout) and the layer's :data:`MoEStats`."""
        cfg, par = self.config, self.parallel
        mesh = current_mesh(par, where="MoE")
        self._check_mesh(mesh)
        layout = Layout.of(par)
        seq = normed.shape[1]
        positions = sequence_order(par, mesh, seq)
        capacity = None if cfg.moe_capacity_factor is None else math.ceil(
            cfg.moe_capacity_factor * seq * cfg.experts_per_token / cfg.num_experts)
        device = functools.partial(
            _mixture_device, config=cfg, parallel=par, capacity=capacity,
            positions=positions, fsdp_axes=layout.rules()["expert_embed"],
            gemm=self.experts_up_gemm.op)
        histories = tuple(None if s is None else reshard(s, P(), mesh) for s in (
            self.experts_up_gemm.state_value(), self.experts_down_gemm.state_value()))
        bias = None if self.router_bias is None else reshard(self.router_bias[...], P(), mesh)
        taps, tap_in_specs = placed_taps(layer_taps(self), mesh)
        return jax.shard_map(
            device, in_specs=(layout.sp, (P(), None if bias is None else P()),
                              layout.expert_up, layout.expert_down,
                              tuple(None if h is None else P() for h in histories),
                              tap_in_specs),
            out_specs=(layout.sp, P()))(
                reshard(normed, layout.sp, mesh),
                (reshard(self.router[...], P(), mesh), bias),
                # in the parameters' dtype: cast to the compute dtype in the grouped
                # GEMMs (with fsdp, gathered in it there, the gradients reduce-scattered
                # in the parameters' dtype)
                reshard(self.experts_up[...], layout.expert_up, mesh),
                reshard(self.experts_down[...], layout.expert_down, mesh),
                histories, taps)

    def weight_grad_covers(self) -> tuple[str, ...]:
        """The parameters whose gradients the experts' grouped GEMMs can defer (a
        weight-gradient tap, :mod:`sp_jax.layers.taps`; the router's and the norm's are
        computed with the input gradient)."""
        names = ("experts_up", "experts_down")
        if self.experts_up_fp8_history is not None:
            names += ("experts_up_fp8_history", "experts_down_fp8_history")
        return names


def _routing(config: MoEConfig) -> dict[str, Any]:
    """The keyword arguments of :func:`~sp_jax.ops.moe.route` a config gives."""
    return dict(scoring=config.moe_scoring, groups=config.moe_groups,
                topk_groups=config.moe_topk_groups, scale=config.moe_routed_scale)


def _mixture_device(x: jax.Array, router: tuple[jax.Array, jax.Array | None],
                    w_up: jax.Array, w_down: jax.Array,
                    gemm_states: tuple[Any, Any], taps: Any, *, config: MoEConfig,
                    parallel: ParallelConfig, capacity: int | None,
                    positions: np.ndarray | None, fsdp_axes: tuple[str, ...],
                    gemm: Gemm) -> tuple[jax.Array, MoEStats]:
    """Per device: ``x`` ``[b, s_local, h]`` (this device's sequence shard) -> the
    experts' output for it (same shape) and the global :data:`MoEStats`; ``router``:
    the kernel and the selection bias (or None); the grouped GEMMs with ``gemm`` (the
    layer's GEMM object) and the up / down GEMMs' states (the amax histories of FP8
    delayed scaling), with the layer's weight-gradient ``taps`` (or None)."""
    e, k = config.num_experts, config.experts_per_token
    tensor = parallel.tensor_axis
    sequence_axes = (*parallel.context_axes, tensor)
    token_axes = (*parallel.data_axes, *sequence_axes)
    routing = _routing(config)
    kernel, bias = router
    logits, scores = router_scores(x, kernel, routing["scoring"])
    experts = select_experts(scores, k, bias=bias, groups=routing["groups"],
                             topk_groups=routing["topk_groups"])
    stats = router_stats(logits, experts, None if routing["scoring"] == "softmax" else scores,
                         sequence_balance=config.moe_seq_aux_loss_coef > 0,
                         sequence_axes=sequence_axes)
    rows = {n: stats.pop(n) for n in ("seq_balance", "sequences") if n in stats}
    stats = jax.tree.map(lambda v: lax.psum(v, token_axes), stats)
    # the rows' terms are whole already (summed over the sequence axes)
    stats.update(jax.tree.map(lambda v: lax.psum(v, parallel.data_axes), rows))
    if bias is not None:  # the bias's "gradient": the layer's loads over the global batch
        scores = load_tap(scores, bias, stats["expert_tokens"])
    weights = routing_weights(scores, experts, config.moe_norm_topk, routing["scale"],
                              routing["scoring"])
    if capacity is not None:  # the rule sees whole sequences: gather the choices
        keep = split(capacity_keep(all_gather(experts, sequence_axes, 1), positions,
                                   capacity, e), sequence_axes, 1)
        experts = jnp.where(keep, experts, e)
        weights = jnp.where(keep, weights, 0.0)
        stats["dropped"] = lax.psum(jnp.sum(~keep).astype(jnp.float32), token_axes)
    # the tensor group's tokens, on every device of it (each computes F / t columns)
    x, experts, weights = (all_gather(a, tensor, 1) for a in (x, experts, weights))
    b, s, h = x.shape
    y = expert_mixture(x.reshape(b * s, h), experts.reshape(b * s, k),
                       weights.reshape(b * s, k), w_up, w_down,
                       MLPActivation(config.mlp_activation), num_experts=e,
                       expert_axis=parallel.expert_axis, gemm=gemm, gemm_states=gemm_states,
                       taps=(local_taps(taps, 0), local_taps(taps, 1)), fsdp_axes=fsdp_axes)
    y = lax.psum_scatter(y.reshape(b, s, h), tensor, scatter_dimension=1, tiled=True)
    return y, stats


def _decode_device(x: jax.Array, router: tuple[jax.Array, jax.Array | None],
                   w_up: jax.Array, w_down: jax.Array, *,
                   config: MoEConfig, parallel: ParallelConfig) -> jax.Array:
    """Per device, generation's tokens: ``x`` ``[rows, h]`` (this device's rows, whole)
    -> the experts' weighted sum ``[rows, h]``, whole (see :meth:`MoE.decode_step`)."""
    e, k = config.num_experts, config.experts_per_token
    expert = parallel.expert_axis
    ep = 1 if expert is None else lax.axis_size(expert)
    local = e // ep
    if ep > 1:  # the expert group's rows, on each of its devices
        x = all_gather(x, expert, 0)
    _, experts, weights = route(x, router[0], k, config.moe_norm_topk, bias=router[1],
                                **_routing(config))
    if ep > 1:  # this device's experts as 0..local-1; the others' pairs dropped here
        experts = experts - lax.axis_index(expert) * local
        experts = jnp.where((experts >= 0) & (experts < local), experts, local)
    y = expert_mixture(x, experts, weights, w_up, w_down,
                       MLPActivation(config.mlp_activation), num_experts=local)
    y = lax.psum(y, (*parallel.expert_axes, parallel.tensor_axis))
    return split(y, expert, 0) if ep > 1 else y

"""The GPT's stages (what :class:`~sp_jax.pipeline.gpt.PipelinedGPT` runs): its public
pieces as a :class:`~sp_jax.pipeline.StageProgram`, a training step's loss and gradients
(:func:`pipeline_loss_and_grads`), and forwards through the stages: the loss
(:func:`pipeline_forward_loss`) and the hidden states or logits
(:func:`pipeline_forward`).

A micro-batch is a dict of ``tokens``, ``labels`` and, for packed rows,
``segment_ids`` / ``positions``, which travel with it through the stages. With
mixture-of-experts layers each chunk returns its router statistics, from which the
interpreter's ``aux_loss`` adds the routers' losses as the unpipelined step does
(:func:`router_metrics` averages their metrics over the micro-batches); with FP8
delayed scaling the blocks' amax histories are flagged for the interpreter's ``maximum``.

The parameters keep the GPT's own layout: the scanned blocks ``[num_layers, ...]`` in
layer order, sharded over the stage axis on their first dimension, so checkpoints move
between stage counts (and to no pipeline) as they are. With ``pipeline_repeats = R > 1``
they are ``[R, num_layers / R, ...]``, still in layer order, sharded over the stage axis
on the second dimension: stage ``s`` holds the chunks ``s, s + P, s + 2P, ...`` (round
robin), where the circular schedule runs them (checkpoints move between stage counts of
the same ``R``; the shape names a change of ``R``). With ``pipeline_layers_per_stage``,
or with layers of different kinds (``GPTConfig.num_dense_layers``: the dense layers'
stack ``dense_blocks [k, ...]`` beside the experts' ``blocks [L - k, ...]``), each stack
keeps ``[n, ...]`` in layer order and every virtual stage's chunk holds a segment of
each kind, its slots chosen as data (:mod:`sp_jax.pipeline.placement`: the chunk's
layers of that kind active, the rest identities).

Inside the pipeline the layers run with the stage and data axes manual (their
``ParallelConfig``, the layers' own without pipeline fields, with ``data_axis=None``,
``manual_data_axes`` = the data axes but the expert axis (:func:`manual_data_axes`: it
stays explicit for the experts' all-to-alls) and ``fsdp=False``: fsdp weights are
gathered once per step by the pipeline; :func:`stage_parallel`), so the weight
gradients of all micro-batches are reduced over the data axes once per step. The
stage's modules are a plain GPT built with that config (its public ``embed_tokens``,
``logits_from_hidden`` and :func:`~sp_jax.models.blocks.scan_blocks` then run them) and
receive the model's parameters.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sp_jax.config import ParallelConfig, PipelineConfig
from sp_jax.layers import (
    FULL_WINDOW,
    LayerWindow,
    RouterBias,
    WeightGradTap,
    enable_weight_grad_taps,
    moe_losses,
    parallel_cross_entropy,
)
from sp_jax.layers.fp8 import Fp8History
from sp_jax.layout import Layout
from sp_jax.mesh import current_mesh
from sp_jax.models.blocks import layer_loop, run_block, scan_blocks
from sp_jax.ops.primitives import host_moves_real
from sp_jax.pipeline.interpreter import StageProgram, run_schedule
from sp_jax.pipeline.placement import (
    LayerKind,
    Placement,
    by_kind,
    layer_kinds,
    layer_major,
    of_kinds,
    placements,
    stage_major,
)
from sp_jax.pipeline.schedule import PipelineSchedule, pipeline_schedule
from sp_jax.pipeline.spmd import masked

__all__ = ["check_pipeline", "manual_data_axes", "pipeline_forward", "pipeline_forward_loss",
           "pipeline_loss_and_grads", "router_metrics", "stage_parallel"]


def manual_data_axes(parallel: ParallelConfig) -> tuple[str, ...]:
    """The data axes the pipeline's ``shard_map`` makes manual: the batch axes but the
    expert axis, which stays explicit for the mixture-of-experts layers (their
    all-to-alls), as the tensor and context axes do."""
    return tuple(a for a in parallel.data_axes if a not in parallel.expert_axes)


def stage_parallel(layers: ParallelConfig) -> ParallelConfig:
    """The config of the layers inside the pipeline's ``shard_map`` (stage and data
    axes manual there; the expert axis, carrying the batch too, explicit), from the
    layers' own (``ParallelConfig.split_pipeline``)."""
    return layers.replace(data_axis=None, fsdp=False,
                          manual_data_axes=manual_data_axes(layers))


def check_pipeline(config: Any, pipeline: PipelineConfig, mesh: Any) -> None:
    """Raises a ValueError for a GPT that cannot run on ``pipeline``: ``num_layers`` not
    divisible by ``stages * pipeline_repeats`` (when ``mesh`` is known), or
    ``pipeline_layers_per_stage`` that do not fit (blocks not scanned:
    :mod:`sp_jax.compat`, checked by the wrapper)."""
    counts = pipeline.layers_per_stage
    if counts is not None:
        if sum(counts) != config.num_layers or len(counts) % pipeline.repeats:
            raise ValueError(
                f"GPT: pipeline_layers_per_stage={counts} must hold stages x "
                f"pipeline_repeats counts summing to num_layers={config.num_layers} (got "
                f"{len(counts)} summing to {sum(counts)}).")
        if mesh is not None and len(counts) != mesh.shape[pipeline.axis] * pipeline.repeats:
            raise ValueError(
                f"GPT: pipeline_layers_per_stage={counts} has {len(counts)} counts; the mesh "
                f"has {mesh.shape[pipeline.axis]} stages x pipeline_repeats="
                f"{pipeline.repeats}: give one count per virtual stage.")
        return
    if config.num_layers % pipeline.repeats:
        raise ValueError(
            f"GPT: num_layers={config.num_layers} is not divisible by pipeline_repeats="
            f"{pipeline.repeats}; use a multiple of stages x pipeline_repeats "
            "layers.")
    if mesh is None:
        return
    stages = mesh.shape[pipeline.axis]
    chunks = stages * pipeline.repeats
    if config.num_layers % chunks:
        raise ValueError(
            f"GPT: num_layers={config.num_layers} is not divisible by stages x "
            f"pipeline_repeats = {stages} x {pipeline.repeats} = {chunks}; use a "
            f"multiple of {chunks} layers, or another stage count or pipeline_repeats.")


def _stage_graphdefs(model: Any, parallel: ParallelConfig, taps: bool = False
                     ) -> tuple[Any, list[Any], Any]:
    """The graph definitions a stage merges its parameters into: the GPT's (for the
    embedding and the head) and its stacked blocks' (one per kind of layer,
    :func:`~sp_jax.pipeline.placement.layer_kinds`), of modules built with the stage's
    ``parallel`` (:func:`stage_parallel`) in the mode of ``model`` (train or eval); and
    with ``taps`` (a table with W actions) the blocks' weight-gradient taps
    (:func:`~sp_jax.layers.enable_weight_grad_taps`: their graphs then take them beside
    the parameters; their pure dicts third, by kind as
    :func:`~sp_jax.pipeline.placement.of_kinds` lays them, else None).

    They are built abstractly (``nnx.eval_shape``) as a plain GPT (``model.wrapped``,
    the class the pipeline wraps) of ``model``'s config with one layer of each kind: the
    embedding, final norm and head do not depend on the number of layers, and a stacked
    block's graph does not either (the stage's slice of the layers is merged into it;
    with ``layer_windows`` its windows too)."""
    kinds = layer_kinds(model.config)
    windows, n = model.config.layer_windows, len(kinds)
    config = dataclasses.replace(model.config, num_layers=n, num_dense_layers=n - 1,
                                 layer_windows=None if windows is None else windows[:n])
    training = model.training

    def build():
        shell = model.wrapped(config, parallel=parallel, rngs=nnx.Rngs(0))
        if not training:  # dropout off, as in the model (with rates of 0 either will do)
            shell.eval()
        return shell

    shell = nnx.eval_shape(build)
    graphdef = nnx.graphdef(shell)
    stacks = [getattr(shell, kind.name) for kind in kinds]
    if not taps:
        return graphdef, [nnx.graphdef(b) for b in stacks], None
    stacks = [enable_weight_grad_taps(b) for b in stacks]  # tap slots hold no arrays
    return graphdef, [nnx.graphdef(b) for b in stacks], of_kinds(
        kinds, [nnx.to_pure_dict(nnx.state(b, WeightGradTap)) for b in stacks])


def _router_terms(model: Any, ignore_index: int) -> Any:
    """The ``aux_loss`` of a GPT with mixture-of-experts layers (a
    :class:`~sp_jax.pipeline.StageProgram`'s): the routers' load-balancing and z losses
    of one chunk's router statistics, exactly the unpipelined step's share (``lm_loss``
    weighs a micro-batch's mean loss, these terms included, by its target count).

    Over every layer of the micro-batch (:func:`~sp_jax.layers.moe_losses`), the
    load-balancing loss is ``E / T^2 sum_e N_e P_e`` (``N_e``: pairs routed to expert
    ``e``, not differentiable; ``P_e``: its router probabilities; ``T``: tokens, each
    summed over the layers) and the z loss ``sum Z / T``: linear in a chunk's ``P`` and
    ``Z`` once ``N`` and ``T`` come from the totals of all chunks."""
    cfg = model.config

    def aux_loss(aux, totals, micro):
        count = jnp.maximum(totals["targets"][0, 0], 1.0)  # every chunk counts it
        if "real" in micro:  # a forward's filling micro-batch (_filled): no router loss
            count = count * jnp.max(micro["real"]).astype(jnp.float32)
        tokens = jnp.maximum(jnp.sum(totals["tokens"]), 1.0)
        routed = jnp.sum(totals["expert_tokens"], axis=(0, 1, 2))  # [E], all layers
        balance = cfg.num_experts * jnp.sum(routed * jnp.sum(aux["router_probs"], 0)) \
            / (tokens * tokens)
        z = jnp.sum(aux["router_z"]) / tokens
        terms = cfg.router_aux_loss_coef * balance + cfg.router_z_loss_coef * z
        if "seq_balance" in aux:  # each layer's term whole already: over the sequences
            terms = terms + cfg.moe_seq_aux_loss_coef * jnp.sum(aux["seq_balance"]) / \
                jnp.maximum(jnp.max(totals["sequences"]), 1.0)
        return count * terms

    def counted(stats, micro):
        """The chunk's statistics, and the micro-batch's targets (this data shard's)."""
        targets = jnp.sum(micro["labels"] != ignore_index).astype(jnp.float32)
        return {**stats, "targets": targets}

    return aux_loss, counted


def router_metrics(model: Any, totals: Any, place: Placement | None = None
                   ) -> dict[str, jax.Array]:
    """The step's router metrics of a pipelined mixture of experts from the
    interpreter's statistics (leaves ``[M, R, P, layers_per_chunk, ...]``; ``place``:
    which slots hold which expert layers, None: every slot one, in order): each
    micro-batch's :func:`~sp_jax.layers.moe_losses` (its layers in order), averaged over
    the micro-batches as :func:`~sp_jax.training.accumulate_gradients` averages them."""
    cfg = model.config
    stats = {k: v.reshape(v.shape[0], -1, *v.shape[4:]) for k, v in totals.items()
             if k != "targets"}
    if place is not None and not place.even:  # the real layers, in order
        order = jnp.asarray(place.layer_order())
        stats = {k: v[:, order] for k, v in stats.items()}
    per_micro = jax.vmap(lambda st: moe_losses(st, cfg.num_experts,
                                               cfg.experts_per_token))(stats)
    return jax.tree.map(lambda m: jnp.mean(m, axis=0), per_micro)


def _masked_scan(stacked: Any, x: jax.Array, keys: Any, remat: bool, documents: Any,
                 active: jax.Array, unroll: bool) -> tuple[jax.Array, Any]:
    """:func:`~sp_jax.models.blocks.scan_blocks` with padding slots (``active [n]``
    False) as identities, their router statistics zero (unequal stages, or a kind of
    layer a stage holds fewer of: every stage scans the same number of slots)."""
    graphdef, state = nnx.split(stacked)

    def layer(x, xs):
        layer_state, key, on = xs
        y, stats = run_block(nnx.merge(graphdef, layer_state), x, key, remat, documents)
        return jnp.where(on, y, x), masked(on, stats)

    return layer_loop(layer, x, (state, keys, active), unroll)


def _documents(micro: dict[str, jax.Array]) -> Any:
    """A micro-batch's packed rows ``(segment_ids, positions)`` as the layers take them
    (:data:`~sp_jax.models.blocks.Documents`, held order), or None."""
    if "segment_ids" not in micro and "positions" not in micro:
        return None
    return micro.get("segment_ids"), micro.get("positions")


def _program(model: Any, order: np.ndarray | None, ignore_index: int,
             label_smoothing: float, z_loss: float, result: str = "loss",
             taps: bool = False, ticked_residuals: bool = False) -> StageProgram:
    """The GPT ``model``'s :class:`StageProgram` (functions of pure parameter dicts); its
    head returns the loss sum, or (``result``) the final-normed ``"hidden"`` states or
    the padded ``"logits"`` of a forward; with ``taps`` (a table with W actions) its
    chunks take the layers' weight-gradient taps (``StageProgram.weight_taps``).

    ``ticked_residuals``: the tick scan keeps each tick's residuals (a forward table,
    differentiated by autodiff: GPipe). With ``offload_activations`` where the host
    moves are real (XLA:GPU) a chunk's layers then run unrolled
    (:func:`~sp_jax.models.blocks.layer_loop`): the tick scan stacks each layer's host
    residuals itself, and XLA:GPU compiles that, where it fails on a layer scan's host
    buffers nested in it. A driven table (1F1B) differentiates each chunk within one
    tick, so its layer scan's host buffers stay in that tick (compiled, measured), and
    XLA:CPU runs the scan either way (its programs and bits as without the option)."""
    inner = stage_parallel(model.parallel.split_pipeline()[0])
    graphdef, block_graphdefs, weight_taps = _stage_graphdefs(model, inner, taps)
    rest = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.Param)))
    kinds = layer_kinds(model.config)
    empty = {kind.name: jax.tree.map(lambda x: np.zeros((0,), x.dtype), nnx.to_pure_dict(
        nnx.state(getattr(model, kind.name), nnx.Param))) for kind in kinds}
    remat, vocab = model.config.remat, model.config.vocab_size
    offload = ticked_residuals and inner.offload_activations

    def shell(shared):
        return nnx.merge(graphdef, {**shared, **empty}, rest)

    def key(data):
        return None if data is None else jax.random.wrap_key_data(data)

    def embed(shared, micro, key_data):
        return shell(shared).embed_tokens(micro["tokens"], None, order, key(key_data),
                                          micro.get("positions"))

    # a forward's outputs (no labels) take no router losses
    experts = bool(model.config.num_experts) and result == "loss"
    aux_loss, counted = _router_terms(model, ignore_index) if experts else (None, None)

    def segment(block_graphdef, chunk, x, layer_data, micro):
        """One kind's slots of a chunk (layer_data: their dropout keys, windows and
        active slots, _layer_data; or None)."""
        layer_data = layer_data or {}
        windows = [layer_data["windows"]] if "windows" in layer_data else []
        stacked = nnx.merge(block_graphdef, chunk, *windows)
        unroll = offload and host_moves_real()  # at trace time: the mesh's platform
        if "active" in layer_data:  # unequal stages: padding slots are identities
            return _masked_scan(stacked, x, key(layer_data.get("dropout")), remat,
                                _documents(micro), layer_data["active"], unroll)
        return scan_blocks(stacked, x, key(layer_data.get("dropout")), remat,
                           _documents(micro), unroll)

    def stage(chunk, x, layer_data, micro):
        # each kind's segment in turn (the dense layers, then the experts)
        y, stats = x, None
        for block_graphdef, part, data in zip(block_graphdefs, by_kind(kinds, chunk),
                                              by_kind(kinds, layer_data or {}), strict=True):
            y, layer = segment(block_graphdef, part, y, data, micro)
            stats = stats if layer is None else layer  # the experts' (one kind has any)
        if stats is None or not experts:
            return y, jnp.zeros((), jnp.float32)
        return y, counted(stats, micro)  # router statistics [layers_per_chunk, ...]

    def head(shared, x, micro):
        m = shell(shared)
        h = m.final_norm(x)
        if result == "hidden":
            return h
        logits = m.logits_from_hidden(h, m.vocab_table())
        if result == "logits":
            return logits
        per_token = parallel_cross_entropy(
            logits, micro["labels"], parallel=inner, ignore_index=ignore_index,
            label_smoothing=label_smoothing, z_loss=z_loss, vocab_size=vocab)
        return jnp.sum(per_token).astype(jnp.float32)

    return StageProgram(embed=embed, stage=stage, head=head, aux_loss=aux_loss,
                        weight_taps=weight_taps)


def _flagged(model: Any, kind_of: type) -> Any:
    """A tree of bools like the pure dict of the blocks' parameters (by kind:
    :func:`~sp_jax.pipeline.placement.of_kinds`): True at the variables of type
    ``kind_of``: the FP8 amax histories (:class:`~sp_jax.layers.fp8.Fp8History`), whose
    "gradients" are the step's amaxes, combined by maximum (the interpreter's
    ``maximum``), or the routers' selection biases (:class:`~sp_jax.layers.RouterBias`),
    whose "gradients" are the expert loads, summed over the ticks that run a micro-batch
    (its ``counted``)."""
    kinds, flags = layer_kinds(model.config), []
    for kind in kinds:
        state = nnx.state(getattr(model, kind.name), nnx.Param)
        flags.append(nnx.to_pure_dict(jax.tree.map(
            lambda v: isinstance(v, kind_of), state,
            is_leaf=lambda v: isinstance(v, nnx.Variable))))
    return of_kinds(kinds, flags)


def _draws(streams: list[Any], num_layers: int) -> tuple[jax.Array, jax.Array]:
    """Dropout key data of each micro-batch's stream: the draws ``GPT.loss`` makes (the
    embedding's, then one per layer)."""
    embed, layers = [], []
    for stream in streams:
        embed.append(jax.random.key_data(stream()))
        layers.append(jnp.stack([jax.random.key_data(stream()) for _ in range(num_layers)]))
    return jnp.stack(embed), jnp.stack(layers)


def _filled(batch: dict[str, jax.Array], keys: Any, stages: int, ignore_index: int
            ) -> tuple[dict[str, jax.Array], Any]:
    """A forward's ``[M, ...]`` micro-batches (and dropout keys) filled up to a multiple
    of ``stages`` with empty ones, which the circular schedule needs (it runs micro-batches
    in groups of ``P``): tokens and positions 0, one document, every label
    ``ignore_index`` (no loss; no router loss either: ``"real"`` 0), the last micro-batch's
    keys; ``"real"`` marks the micro-batches that are not filling. The caller keeps the
    first ``M`` outputs."""
    extra = -batch["tokens"].shape[0] % stages
    fill = {"labels": ignore_index, "segment_ids": 1}
    batch = {**batch, "real": jnp.ones_like(batch["tokens"])}

    def pad(x, **how):
        return jnp.pad(x, ((0, extra),) + ((0, 0),) * (x.ndim - 1), **how)

    batch = {k: pad(x, constant_values=fill.get(k, 0)) for k, x in batch.items()}
    return batch, jax.tree.map(lambda k: pad(k, mode="edge"), keys)


def _layer_data(model: Any, keys: tuple[jax.Array, jax.Array] | None, micro: int,
                places: list[Placement]) -> tuple[Any, Any] | None:
    """What the interpreter hands each chunk per layer (``[M, R, P, layers_per_chunk,
    ...]`` leaves, chunk ``r P + s`` at ``[:, r, s]``), for each kind of layer
    (``places``, one per kind: :func:`~sp_jax.pipeline.placement.placements`; several
    kinds: a dict by kind, :func:`~sp_jax.pipeline.placement.of_kinds`): the layers'
    dropout key data (``"dropout"``) and, with ``layer_windows``, the blocks'
    :class:`~sp_jax.layers.LayerWindow` values (``"windows"``, the same for every
    micro-batch: data, so a stage's program does not depend on its layers' windows);
    with unequal stages (or kinds) which slots are layers (``"active"``, the rest
    identities); with the embedding's keys: ``(embed keys or None, that data)``, or
    None."""
    kinds = layer_kinds(model.config)
    embed_keys, layer_keys = (None, None) if keys is None else keys
    data = [_kind_data(model, kind, layer_keys, micro, place)
            for kind, place in zip(kinds, places, strict=True)]
    return (embed_keys, of_kinds(kinds, data)) if any(data) else None


def _kind_data(model: Any, kind: LayerKind, layer_keys: jax.Array | None, micro: int,
               place: Placement) -> dict[str, Any]:
    """:func:`_layer_data` of one kind of layer (``layer_keys [M, L, ...]``: every
    layer's dropout key data, or None)."""
    stages, repeats = place.stages, place.repeats
    per = kind.count // (stages * repeats)

    def laid(a: Any) -> Any:
        """``[M, L, ...]`` per layer as ``[M, R, P, layers_per_chunk, ...]``."""
        if place.even:
            return a.reshape(micro, repeats, stages, per, *a.shape[2:])
        # the layers' own index array when the kind starts at layer 0 (one constant
        # with the stacks' gather: the program of one kind as it was)
        rows = place.index if not place.first else place.first + place.index
        return jnp.swapaxes(a[:, rows], 1, 2)

    data = {}
    if layer_keys is not None:
        data["dropout"] = laid(layer_keys)
    if model.config.layer_windows is not None:
        # From the config, as constants: the variables are sharded over the stage axis,
        # and gathering them whole (an all-gather on no other value's path) let XLA:CPU's
        # devices start it and the first layer collectives in different orders: the
        # step deadlocked in about 1 run of 5 (measured).
        values = np.array([FULL_WINDOW if w is None else w
                           for w in model.config.layer_windows], np.int32)
        if place.even:
            values = np.broadcast_to(values.reshape(repeats, stages, per),
                                     (micro, repeats, stages, per))
        else:
            values = laid(np.broadcast_to(values, (micro, len(values))))
        windows = nnx.to_pure_dict(nnx.state(getattr(model, kind.name), LayerWindow))
        data["windows"] = jax.tree.map(lambda _: jnp.asarray(values), windows)
    if not place.even:  # [P, R, n] -> [M, R, P, n]
        active = np.swapaxes(place.active, 0, 1)
        data["active"] = jnp.asarray(np.broadcast_to(active, (micro, *active.shape)))
    return data


def _jitted(run: Any, program: StageProgram, schedule: Any, *arrays: Any, **options: Any
            ) -> Any:
    """``run(program, schedule, *arrays, **options)`` (a pipeline of
    :mod:`sp_jax.pipeline`) under ``jax.jit``: called eagerly (``GPT.loss`` or
    ``model(tokens)`` outside jit), a ``shard_map`` manual over the stage and data axes
    only refuses outputs that the explicit (context, tensor) axes shard (measured); in a
    caller's jit this one is inlined."""
    return jax.jit(lambda *a: run(program, schedule, *a, **options))(*arrays)


def _run(model: Any, params: Any, batch: dict[str, jax.Array],
         keys: tuple[jax.Array, jax.Array] | None, ignore_index: int,
         label_smoothing: float, z_loss: float, grads: bool, result: str = "loss",
         schedule: PipelineSchedule | None = None
         ) -> tuple[jax.Array, Any, dict[str, jax.Array]]:
    """Loss sum, gradients (None without ``grads``) and router metrics (a mixture of
    experts'; else empty) of ``batch`` through the pipeline: ``tokens``, ``labels`` and
    optionally packed rows' ``segment_ids`` / ``positions``, each ``[M, batch, seq]``;
    with ``result`` ``"hidden"`` / ``"logits"`` (a GPipe forward, no labels): those
    outputs ``[M, batch, seq, ...]`` in the held order, None and no metrics.
    ``schedule``: the table to run (None: ``pipeline_schedule`` of the config's kind, or
    GPipe's for a forward)."""
    par, cfg, pipe = model.parallel, model.config, model.pipeline
    mesh = current_mesh(par, where="GPT")
    check_pipeline(cfg, pipe, mesh)
    if any(t != jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        raise ValueError(
            f"GPT: a pipeline (pipeline_axis={pipe.axis!r}) needs a mesh with "
            f"Explicit axes, got {mesh.axis_types}; build it with jax.make_mesh(shape, "
            "names) (Explicit by default) or axis_types=(AxisType.Explicit,) * len(names).")
    stages, repeats = mesh.shape[pipe.axis], pipe.repeats
    real = batch["tokens"].shape[0]
    if not grads and repeats > 1 and real % stages:
        batch, keys = _filled(batch, keys, stages, ignore_index)
    micro = batch["tokens"].shape[0]
    if schedule is None:
        schedule = pipeline_schedule(pipe.schedule if grads else "gpipe", stages, micro,
                                     repeats)
    elif (schedule.stages, schedule.microbatches, schedule.repeats) != (stages, micro,
                                                                         repeats):
        raise ValueError(
            f"GPT: the {schedule.kind!r} table is for {schedule.stages} stages, "
            f"{schedule.microbatches} micro-batches and {schedule.repeats} chunk(s) per "
            f"stage; this step has {stages}, {micro} and {repeats} (pipeline_repeats).")
    kinds, places = layer_kinds(cfg), placements(pipe, stages, cfg)
    # [M, batch, seq]: the batch over the data axes (each data shard its rows, whatever
    # the caller placed), whole sequences (ring attention's zigzag order is taken here;
    # packed rows' segment ids and positions travel in it with their tokens)
    whole = Layout.of(par).spec(None, "activation_batch", None)
    batch = {k: jax.reshard(x, whole) for k, x in batch.items()}
    order = model.sequence_order(batch["tokens"][0])
    if order is not None:
        batch = {k: jnp.take(x, jnp.asarray(order), axis=2) for k, x in batch.items()}
    keys = _layer_data(model, keys, micro, places)
    names = [kind.name for kind in kinds]
    shared = {k: v for k, v in params.items() if k not in names}
    # each kind's stack stage-major (one kind: its own tree; several: a dict by kind)
    blocks = of_kinds(kinds, [stage_major(params[name], place)
                              for name, place in zip(names, places, strict=True)])
    amaxes = _flagged(model, Fp8History)  # FP8 delayed scaling: combined by maximum
    loads = _flagged(model, RouterBias)  # aux-loss-free balancing: the real ticks' loads
    program = _program(model, order, ignore_index, label_smoothing, z_loss, result,
                       taps=schedule.deferred, ticked_residuals=not schedule.driven)
    axes = {"stage_axis": pipe.axis, "data_axes": manual_data_axes(par), "mesh": mesh,
            "reduce_dtype": par.grad_reduce_dtype}
    if result != "loss":  # a forward's outputs
        out, _ = _jitted(run_schedule, program, schedule, shared, blocks, batch, keys,
                         **axes, grads=False, outputs=True)
        return out[:real], None, {}
    run = functools.partial(run_schedule, grads=grads)
    experts = program.aux_loss is not None
    loss, out, *totals = _jitted(run, program, schedule, shared, blocks, batch, keys,
                                 **axes, totals=experts,
                                 **({"maximum": amaxes, "counted": loads} if grads else {}))
    metrics = router_metrics(model, jax.tree.map(lambda t: t[:real], totals[0]),
                             places[-1]) \
        if experts else {}
    if not grads:
        return loss, None, metrics
    g_shared, g_blocks = out
    g_blocks = [layer_major(g, params[name], place, flags) for g, name, place, flags in zip(
        by_kind(kinds, g_blocks), names, places, by_kind(kinds, amaxes), strict=True)]
    return loss, {**g_shared, **dict(zip(names, g_blocks, strict=True))}, metrics


def pipeline_loss_and_grads(model: Any, batch: dict[str, jax.Array], key: jax.Array | None,
                            *, ignore_index: int = -100, return_metrics: bool = False,
                            schedule: PipelineSchedule | None = None) -> tuple:
    """One training step's ``(loss_sum, count, grads)`` of a pipelined GPT ``model``:
    ``batch`` holds ``tokens`` / ``labels`` (and packed rows' ``segment_ids`` /
    ``positions``; labels across documents already dropped) ``[M, batch, seq]`` (``M``
    micro-batches), micro-batch ``i`` with the dropout of ``fold_in(key, i)`` (what
    ``lm_loss`` of the unpipelined model draws); ``grads`` of ``loss_sum`` as a pure dict
    shaped like the model's parameters (``nnx.to_pure_dict``). ``loss_sum`` holds, with
    mixture-of-experts layers, each micro-batch's router losses times its target count
    (as ``lm_loss``);
    with ``return_metrics`` a fourth element, their metrics (:func:`router_metrics`:
    ``moe_aux_loss``, ``moe_z_loss``, ``moe_dropped_fraction``, ``moe_expert_tokens``;
    empty without experts). ``schedule``: a table to run instead of the config's
    (:class:`~sp_jax.pipeline.schedule.PipelineSchedule` of as many stages,
    micro-batches and chunks)."""
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    keys = None
    if model.training and key is not None:
        keys = _draws([nnx.Rngs(dropout=jax.random.fold_in(key, i)).dropout
                       for i in range(batch["tokens"].shape[0])], model.config.num_layers)
    loss, grads, metrics = _run(model, params, batch, keys, ignore_index, 0.0, 0.0, True,
                                schedule=schedule)
    count = jnp.sum(batch["labels"] != ignore_index)
    return (loss, count, grads, metrics) if return_metrics else (loss, count, grads)


def _micro_batches(model: Any, rows: int) -> int:
    """How many micro-batches a ``[rows, ...]`` batch runs as outside a training step:
    ``pipeline_microbatches`` when the rows split evenly over them and the data axes, no
    dropout is drawn, there are no experts (whose router losses are then the whole
    batch's, as the unpipelined model's) and no FP8 current scaling (whose amaxes are then
    the whole batch's: measured, micro-batches of their own amaxes moved the logits by
    up to 0.35 from the unpipelined model's), else 1."""
    par = model.parallel
    mesh = current_mesh(par, where="GPT")
    data = math.prod(mesh.shape[a] for a in par.data_axes)
    micro = model.pipeline.microbatches
    fp8 = model.config.fp8
    current = fp8 is not None and fp8.scaling == "current"
    if model.training or model.config.num_experts or current or rows % (micro * data):
        return 1
    return micro


def _split(model: Any, x: jax.Array, micro: int) -> jax.Array:
    """``[batch, seq]`` as ``[micro, batch / micro, seq]``: micro-batch ``i`` the rows
    ``i, i + micro, ...`` (no data moves between devices)."""
    mesh = current_mesh(model.parallel, where="GPT")
    layout = Layout.of(model.parallel)
    x = jnp.reshape(jax.reshard(x, layout.spec("activation_batch", None)),
                    (x.shape[0] // micro, micro, x.shape[1]), out_sharding=NamedSharding(
                        mesh, layout.spec("activation_batch", None, None)))
    return jnp.swapaxes(x, 0, 1)


def pipeline_forward_loss(model: Any, batch: dict[str, jax.Array], stream: Any, *,
                          ignore_index: int, label_smoothing: float, z_loss: float
                          ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Sum of per-token losses of ``batch`` (``tokens``, ``labels`` and optionally
    ``segment_ids`` / ``positions``, each ``[batch, seq]``) through the pipeline
    (``GPT.loss`` of a pipelined model; with experts their router losses times the
    target count) and the router metrics (:func:`router_metrics`; empty without
    experts): the batch runs as micro-batches of a GPipe forward
    (:func:`_micro_batches`; as one, its dropout is the unpipelined model's: ``stream``,
    the dropout rng stream, draws its keys)."""
    loss, _, metrics = _forward(model, batch, stream, ignore_index, label_smoothing,
                                z_loss, "loss")
    return loss, metrics


def _forward(model: Any, batch: dict[str, jax.Array], stream: Any, ignore_index: int,
             label_smoothing: float, z_loss: float, result: str) -> tuple:
    """:func:`_run` without gradients on ``[batch, seq]`` arrays split into the
    micro-batches of :func:`_micro_batches`, the dropout keys drawn from ``stream``."""
    micro = _micro_batches(model, batch["tokens"].shape[0])
    batch = {k: _split(model, x, micro) for k, x in batch.items()}
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    keys = _draws([stream], model.config.num_layers) if model.training else None
    return _run(model, params, batch, keys, ignore_index, label_smoothing, z_loss, False,
                result)


def pipeline_forward(model: Any, batch: dict[str, jax.Array], stream: Any, result: str
                     ) -> jax.Array:
    """The final-normed hidden states (``result="hidden"``) or padded logits
    (``"logits"``) ``[batch, seq, ...]`` of a pipelined GPT (``GPT.hidden_states`` /
    ``padded_logits``), in the held order, by a GPipe forward through the stages: of
    ``batch``'s ``tokens`` (and packed rows' ``segment_ids`` / ``positions``) ``[batch,
    seq]`` in the natural order, micro-batched as in :func:`pipeline_forward_loss`.
    Laid out as the unpipelined model's (``Layout.sp`` / ``Layout.logits``)."""
    rows = batch["tokens"].shape[0]
    y = _forward(model, batch, stream, -100, 0.0, 0.0, result)[0]
    # [M, b, s, ...] -> [b, M, s, ...] -> [batch, s, ...]: row i of micro-batch m is row
    # i M + m (the inverse of _split; the batch stays on its data shards)
    spec = tuple(jax.typeof(y).sharding.spec) + (None,) * (y.ndim - 1)
    mesh = current_mesh(model.parallel, where="GPT")
    y = jnp.reshape(jnp.swapaxes(y, 0, 1), (rows, *y.shape[2:]),
                    out_sharding=NamedSharding(mesh, P(spec[1], *spec[2:y.ndim])))
    layout = Layout.of(model.parallel)
    return jax.reshard(y, layout.sp if result == "hidden" else layout.logits)

"""The pipeline in one SPMD program: one interpreter, :func:`run_schedule`, runs any
action table (:class:`~sp_jax.pipeline.schedule.PipelineSchedule`) in a ``shard_map``
manual over the stage and data axes.

Every device runs the same loop. At each tick a stage looks up in the tables what it
does: which micro-batch and layer chunk it forwards (F), back-propagates (B) and, for
tables that defer them, whose weight gradients it computes (W); an idle stage computes
on zeros and drops the result (conditions that differ between stages around the layers'
collectives are not supported by XLA). What it forwards leaves for the next stage, what
it back-propagates for the previous one, with one ``ppermute`` each on the stage axis:
the activation in its sequence-parallel layout, ``[b, s / (c t), h]`` per device
(Megatron's scatter-gather optimisation), kept in a receive slot when the table uses it
later. The context and tensor axes stay in the hands of the layers (their own
``shard_map`` s, nested in this one). The interpreter holds no code of any schedule:
the ticks are grouped into phases of the same kinds of actions (e.g. 1F1B's warm-up,
forwards only; steady state; cool-down, backwards only), one loop each, so no tick
computes a kind of action no stage needs.

Two modes, chosen by the table:

* a table of F actions only (GPipe; ``R > 1``: circular) runs its forward loop and is
  differentiated by autodiff: the backward is the same ticks in reverse, every
  micro-batch's residuals kept until it (GPipe's memory and results, bitwise);
* a table with B actions is driven: the B of a chunk is ``jax.vjp`` of the stage,
  recomputing its forward from the kept stage input (1F1B keeps at most ``2 V - 1`` of
  them, ``V = stages * repeats``, whatever the number of micro-batches); with W actions
  the B computes the input gradient alone and keeps what the weight gradients need for
  its W, which may run ticks later: with the program's ``weight_taps``, the layers' own
  split (:func:`sp_jax.layers.backward_input` / :func:`~sp_jax.layers.backward_weight`:
  each deferring GEMM keeps its operand and output gradient, the W runs only the weight
  GEMMs and FSDP's reduce-scatters), else the chunk's input and output gradient, from
  which the W differentiates the chunk again for its parameters. A tick's activation
  transfer travels during its backward and its gradient transfer during the next tick's
  forward.

Gradients are computed per device, inside the loop's ``shard_map``, and reduced once per
step (:mod:`sp_jax.pipeline.spmd`): over the data axes (a ``psum``, or a
``psum_scatter`` for parameters sharded over them by fsdp, whose stage weights are
all-gathered once before the loop) and, for the parameters every stage holds
(embedding, head, final norm), over the stage axis.

A micro-batch is a dict of ``[b, s]`` arrays (tokens, labels, packed rows' ids and
positions) that every stage holds and indexes, so it travels with its micro-batch
without a transfer. A stage may return statistics beside its output
(:class:`StageProgram`'s ``aux``: a loss term, or with ``aux_loss`` statistics such as a
mixture of experts' router sums, exchanged between the stages so that a term coupling
every layer is exact); leaves flagged in ``maximum`` (FP8 amax histories) get the
maximum of their per-tick "gradients" instead of the sum; and with ``outputs`` a forward
table returns the head's per-micro-batch outputs (hidden states, logits) instead of a
loss.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sp_jax.layers import backward_input, backward_weight
from sp_jax.mesh import mesh_platform
from sp_jax.pipeline.schedule import PipelineSchedule
from sp_jax.pipeline.spmd import (
    StageAxes,
    always,
    exchanged,
    finish,
    leaf_flags,
    masked,
    ordered,
    prepare,
    run_manual,
    stacked_zeros,
    when_busy,
)

__all__ = ["StageProgram", "gpipe", "one_f_one_b", "run_schedule"]

_F32 = jnp.float32


def _from_last(y: jax.Array, last: jax.Array, stage_axis: str) -> jax.Array:
    """``y`` of the last stage on every stage (``last``: this stage is it): a ``psum``
    over ``stage_axis`` of ``y`` there and zeros elsewhere, exact (one term is nonzero).

    A 16-bit float is summed as its bits (uint16), the same bytes: measured, a bf16
    ``psum`` here (a pipeline's eval outputs in bf16 compute) aborts XLA:CPU's
    compiler (jax 0.10.2: ``Invalid binary instruction opcode copy`` in
    AllReducePromotion, which widens bf16 all-reduces and cannot rebuild this one's
    reducer, whose root the Explicit mesh's sharding annotation turned into a copy)."""
    if jnp.issubdtype(y.dtype, jnp.floating) and y.dtype.itemsize == 2:
        bits = lax.bitcast_convert_type(y, jnp.uint16)
        bits = lax.psum(jnp.where(last, bits, jnp.zeros_like(bits)), stage_axis)
        return lax.bitcast_convert_type(bits, y.dtype)
    return lax.psum(jnp.where(last, y, jnp.zeros_like(y)), stage_axis)


@dataclasses.dataclass(frozen=True)
class StageProgram:
    """What a model runs on the pipeline, as functions of one device's values inside the
    pipeline's ``shard_map`` (batch dimensions local to the data shard).

    A micro-batch is a dict of ``[b, s]`` arrays (``"tokens"``, ``"labels"`` and what
    else the model reads, e.g. packed rows' ``"segment_ids"`` / ``"positions"``): every
    stage holds every micro-batch's dict (small integers), so what a stage needs of its
    micro-batch travels with it by index, not through the stage transfers.

    Attributes:
      embed: ``(shared, micro, key) -> x [b, s, h]``: the input of the first stage
        (sequence-parallel layout) from the micro-batch dict ``micro``; ``key`` is the
        micro-batch's dropout key data or None.
      stage: ``(chunk, x, keys, micro) -> (x, aux)``: one layer chunk (``chunk``: the
        chunk's parameters, leaves ``[layers_per_chunk, ...]``; ``keys``: its per-layer
        data, e.g. dropout key data, leaves ``[layers_per_chunk, ...]``, or None (as the
        interpreter was given it); ``micro``: the micro-batch
        dict); ``aux``: a float32 scalar the step adds to its loss (e.g. auxiliary losses
        of the chunk's layers; 0.0 for none), differentiated with it.
      head: ``(shared, x, micro) -> loss sum`` (float32 scalar) of the last stage.
      aux_loss: None (``aux`` is the loss term itself), or ``(aux, totals, micro) ->``
        the float32 loss term of one chunk's ``aux`` (then a pytree of float32 statistics
        of the chunk, e.g. a mixture of experts' router sums): ``totals`` is every
        chunk's ``aux`` of the micro-batch summed over the data axes, leaves ``[R, P,
        ...]`` (chunk ``r P + s`` at ``[r, s]``: layer order), the same on every device
        and not differentiated. It must be linear in ``aux``: the step's term is its
        sum over the devices, as the head's loss. A term that couples the layers of
        all stages (the load-balancing loss's expert counts times router probabilities
        of every layer) is then exact: the backward of a chunk runs after every
        chunk's forward of its micro-batch, whose statistics the stages exchange (a
        small all-gather per tick).
      weight_taps: None, or the weight-gradient taps of a chunk's layers (a pure dict of
        :class:`~sp_jax.layers.WeightGradTap` values, no arrays), which the interpreter
        puts beside a chunk's parameters for a table with W actions: ``stage`` then
        takes them (its layers built with :func:`~sp_jax.layers.enable_weight_grad_taps`)
        and the B and W actions are the layers' own split
        (:func:`~sp_jax.layers.backward_input`); without them a W differentiates the
        chunk again for its parameters.
    """

    embed: Callable[[Any, Any, Any], jax.Array]
    stage: Callable[[Any, jax.Array, Any, Any], tuple[jax.Array, Any]]
    head: Callable[[Any, jax.Array, Any], jax.Array]
    aux_loss: Callable[[Any, Any, Any], jax.Array] | None = None
    weight_taps: Any = None


# -- the input- and weight-gradient halves of a stage's backward ---------------------------


def _recomputed_input(fn: Callable, params: Any, x: jax.Array, gy: Any
                      ) -> tuple[jax.Array, None, Any]:
    """The B half of ``fn(params, x)``'s backward without the layers' split (a program
    without ``weight_taps``): ``(dx, None, wres)``, ``wres`` the input and the
    cotangent ``gy``, from which :func:`_recomputed_weight` differentiates ``fn`` again
    (the signature of :func:`sp_jax.layers.backward_input`)."""
    _, pullback = jax.vjp(lambda x: fn(params, x), x)
    return pullback(gy)[0], None, (x, gy)


def _recomputed_weight(fn: Callable, params: Any, wres: Any) -> Any:
    """The W half: all the gradients of ``params`` from :func:`_recomputed_input`'s
    ``wres`` (the fused ``jax.vjp``'s)."""
    x, gy = wres
    return jax.vjp(lambda p: fn(p, x), params)[1](gy)[0]


def _with_taps(chunk: Any, taps: Any) -> Any:
    """A chunk's parameter dict with the layers' weight-gradient taps beside the
    parameters they cover (``taps``: a pure dict of tap values; None: none)."""
    if taps is None:
        return chunk
    if not isinstance(taps, dict):
        return taps
    out = dict(chunk)
    for key, value in taps.items():
        out[key] = _with_taps(chunk.get(key, {}), value)
    return out


def _without_taps(grads: Any, like: Any) -> Any:
    """Gradients of a chunk with taps as the chunk ``like`` without them (the taps hold
    no arrays: the leaves are the same, in the same order)."""
    return jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(grads))


# -- the tables --------------------------------------------------------------------------


def _micro(batch: Any, m: jax.Array | int) -> Any:
    """Micro-batch ``m`` of a dict of ``[M, b, s]`` arrays."""
    return jax.tree.map(lambda a: a[m], batch)


def _chunk(tree: Any, r: jax.Array) -> Any:
    """Layer chunk ``r`` of a tree of ``[R, layers_per_chunk, ...]`` leaves."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, r, 0, keepdims=False), tree)


def _keys_at(keys: Any, m: jax.Array, r: jax.Array, s: jax.Array) -> Any:
    """The per-layer data of micro-batch ``m``, chunk ``r`` on stage ``s`` from a pytree
    of ``[M, R, P, layers_per_chunk, ...]`` leaves (dropout key data; None without)."""
    return jax.tree.map(lambda k: k[m, r, s], keys)


def _aux_table(program: StageProgram, chunk: Any, x: jax.Array, keys: Any, micro: Any,
               shape: tuple[int, ...]) -> Any:
    """Zeros ``[*shape, ...]`` for the ``aux`` statistics of a chunk (its shapes from
    :meth:`StageProgram.stage` of ``chunk``)."""
    aux = jax.eval_shape(lambda c, x, k: program.stage(c, x, k, micro)[1], chunk, x, keys)
    return jax.tree.map(lambda a: jnp.zeros((*shape, *a.shape), _F32), aux)


def _phases(schedule: PipelineSchedule) -> list[tuple[int, int, bool, bool, bool]]:
    """``(first tick, end tick, forward, backward, weight)`` of the loops a driven table
    runs as: consecutive ticks with the same kinds of actions on some stage (1F1B: the
    warm-up, forwards only; the steady state, one forward and one backward per stage and
    tick; the cool-down, backwards only). Each is a loop without conditions, so XLA's
    scheduler can overlap a tick's transfers with its GEMMs."""
    kinds = np.stack([(schedule.fwd_micro >= 0).any(axis=1),
                      (schedule.bwd_micro >= 0).any(axis=1),
                      (schedule.wgt_micro >= 0).any(axis=1)], axis=1)
    phases, begin = [], 0
    for t in range(1, schedule.num_ticks + 1):
        if t == schedule.num_ticks or (kinds[t] != kinds[begin]).any():
            phases.append((begin, t, *(bool(k) for k in kinds[begin])))
            begin = t
    return phases


def _busy_ticks(schedule: PipelineSchedule) -> dict[str, jax.Array]:
    """Per tick, whether the last stage ends a micro-batch (its last chunk: the loss) and
    whether the first stage back-propagates into the embedding (its chunk 0): the same on
    every device (:func:`~sp_jax.pipeline.spmd.when_busy`)."""
    fm, fr = schedule.fwd_micro, schedule.fwd_repeat
    bm, br = schedule.bwd_micro, schedule.bwd_repeat
    return {"last": jnp.asarray((fm[:, -1] >= 0) & (fr[:, -1] == schedule.repeats - 1)),
            "embed_bwd": jnp.asarray((bm[:, 0] >= 0) & (br[:, 0] == 0))}


def _unconditional(micro: np.ndarray, chunk: np.ndarray, wanted: int) -> bool:
    """Whether every action of a stage's column is of chunk ``wanted`` (the head, or
    the embedding's backward, is then needed at each of them: it runs without a
    condition, on zeros where the stage is idle)."""
    return bool((chunk[micro >= 0] == wanted).all())


# -- the interpreter ---------------------------------------------------------------------


def run_schedule(program: StageProgram, schedule: PipelineSchedule, shared: Any,
                 stages: Any, batch: Any, keys: tuple[Any, Any] | None, *, stage_axis: str,
                 data_axes: tuple[str, ...], mesh: Any, grads: bool = True,
                 totals: bool = False, maximum: Any = None, outputs: bool = False,
                 reduce_dtype: Any = None, counted: Any = None
                 ) -> tuple[jax.Array, tuple[Any, Any] | None]:
    """Loss sum and gradients of a pipeline step run by ``schedule``'s tables (or, with
    ``outputs``, the head's outputs of a forward).

    Args:
      program: the model's :class:`StageProgram`.
      schedule: the :class:`~sp_jax.pipeline.schedule.PipelineSchedule`: a forward table
        (differentiated by autodiff) or a driven one (backward actions; then ``grads``
        and not ``outputs``).
      shared: parameters every stage holds (replicated over the stage axis).
      stages: layer parameters, leaves ``[P, R, layers_per_chunk, ...]`` sharded over the
        stage axis on dimension 0: stage ``s`` holds the chunks ``r P + s`` it runs.
      batch: the micro-batches, a dict of ``[M, batch, seq]`` arrays (``"tokens"``,
        ``"labels"``, ...: see :class:`StageProgram`), batch over the data axes.
      keys: ``(embed [M, ...] or None, layers)``: the embedding's dropout key data and
        the layers' per-layer data (dropout key data, or a pytree of such leaves: what
        else a chunk takes per layer, e.g. its attention windows), leaves ``[M, R, P,
        layers_per_chunk, ...]``, not differentiated; or None.
      stage_axis / data_axes: the mesh axes; mesh: the mesh.
      grads: False for the loss alone (a forward table's loop, no autodiff).
      totals: also return the ``aux`` statistics of every micro-batch (a program with
        ``aux_loss``): leaves ``[M, R, P, ...]``, summed over the data axes.
      maximum: None, or a tree of bools like ``stages``: the "gradients" of the leaves
        marked True (an FP8 layer's amax history, whose cotangent is the step's amaxes)
        are their maximum over the micro-batches a stage runs and over the data axes,
        not a sum (each tick's taken apart).
      counted: None, or a tree of bools like ``stages``: the "gradients" of the leaves
        marked True (a router's selection bias, whose cotangent is the expert loads of
        the tokens it routed, whatever the output's cotangent) are summed over the ticks
        in which the stage runs a micro-batch only: an idle tick runs micro-batch 0 again
        (its outputs dropped, its cotangents zero), which must not count.
      outputs: True for a forward whose ``program.head`` returns an array per micro-batch
        (e.g. hidden states or logits ``[b, s, ...]``) instead of a loss: the result is
        then ``(outputs [M, batch, ...], None)``, the last stage's, on every stage (one
        ``psum`` over the stage axis), batch over the data axes like ``batch``.
      reduce_dtype: None, or the dtype the gradients are reduced in over the data (and
        for the shared parameters the stage) axes (``ParallelConfig.grad_reduce_dtype``:
        each device's gradient, summed over the micro-batches in its own dtype, cast to
        it for the collectives and back after them).
    Returns:
      ``(loss_sum, (shared_grads, stage_grads))``: float32 sum of per-token losses over
      the step (with the stages' ``aux`` terms) and its gradients, sharded like
      ``shared`` and ``stages`` (None without ``grads``); with ``totals`` a third
      element, the statistics.
    """
    if schedule.driven and (outputs or not grads):
        raise ValueError(f"run_schedule: the {schedule.kind!r} table drives a backward; a "
                         "forward (outputs=True or grads=False) runs a forward table, e.g. "
                         "pipeline_schedule('gpipe', ...).")
    if not schedule.driven and schedule.num_fwd_recv:
        raise ValueError(f"run_schedule: the forward table {schedule.kind!r} keeps "
                         "activations in receive slots; a table differentiated by autodiff "
                         "forwards each one at the tick it arrives.")
    run = _driven if schedule.driven else _autodiff
    return run(program, schedule, shared, stages, batch, keys,
               StageAxes(stage_axis, tuple(data_axes)), mesh, grads=grads, totals=totals,
               maximum=maximum, outputs=outputs, reduce_dtype=reduce_dtype,
               counted=leaf_flags(counted, stages))


def _autodiff(program, schedule, shared, stages, batch, keys, axes, mesh, *, grads, totals,
              maximum, outputs, reduce_dtype, counted):
    """:func:`run_schedule` of a forward table: its loop, differentiated by autodiff."""
    stage_axis = axes.stage
    shared_specs = jax.tree.map(axes.restrict, shared)
    stage_specs = jax.tree.map(axes.restrict, stages)
    fwd_micro = jnp.asarray(schedule.fwd_micro)
    fwd_repeat = jnp.asarray(schedule.fwd_repeat)
    p, r_last, m_count = schedule.stages, schedule.repeats - 1, schedule.microbatches
    repeats = schedule.repeats
    ring = [(i, (i + 1) % p) for i in range(p)]
    coupled = program.aux_loss is not None
    flags = leaf_flags(maximum, stages)
    apart = jax.tree.map(lambda f, c: f or c, flags, counted)  # taken apart per tick
    maxed = any(jax.tree.leaves(apart))

    def body(shared, stages, batch, keys):
        s = lax.axis_index(stage_axis)
        shared, stages = prepare(shared, stages, axes, shared_specs, stage_specs)
        ekeys, lkeys = keys if keys is not None else (None, None)
        # the flagged and counted leaves of each tick's chunk, [ticks, ...]: their
        # per-tick cotangents come apart (combined below: the maximum, or the sum over
        # the ticks that ran a micro-batch), not summed by autodiff
        ticked = jax.tree.map(lambda f, x: jnp.take(x, jnp.maximum(fwd_repeat[:, s], 0),
                                                    axis=0) if f else None, apart, stages)

        def forward(shared, stages, ticked):
            """The last virtual stage's outputs ``[M, b, s, h]`` and the aux sums."""
            x0 = program.embed(shared, _micro(batch, 0), None if ekeys is None else ekeys[0])
            # aux: a scalar sum, or (aux_loss) each (micro-batch, chunk)'s statistics
            aux0 = _aux_table(program, _chunk(stages, 0), x0, _keys_at(lkeys, 0, 0, s),
                              _micro(batch, 0), (m_count, repeats)) if coupled else \
                jnp.zeros((), _F32)

            def tick(carry, t):
                recv, outputs, aux_sum = carry
                m, r = fwd_micro[t, s], fwd_repeat[t, s]
                active = m >= 0
                m, r = jnp.maximum(m, 0), jnp.maximum(r, 0)
                first = active & (r == 0) & (s == 0)
                # some stage forwards in every tick: no condition (see when_busy)
                micro = _micro(batch, m)
                x = jnp.where(first, program.embed(
                    shared, micro, None if ekeys is None else ekeys[m]), recv)
                # the chunk is picked again in the backward loop, not kept per tick
                # (the layers' custom VJPs still keep their kernel shards per tick:
                # BENCHMARKS.md, "Pipeline parallelism")
                chunk = jax.checkpoint(_chunk)(stages, r)
                if maxed:
                    chunk = jax.tree.map(lambda f, c, x: x[t] if f else c, apart, chunk,
                                         ticked, is_leaf=lambda x: x is None)
                y, aux = program.stage(chunk, x, _keys_at(lkeys, m, r, s), micro)
                y = jnp.where(active, y, jnp.zeros_like(y))
                aux = masked(active, jax.tree.map(lambda a: a.astype(_F32), aux))
                if coupled:  # each (micro-batch, chunk) runs once on this stage
                    aux_sum = jax.tree.map(lambda acc, a: acc.at[m, r].add(a), aux_sum, aux)
                else:
                    aux_sum = aux_sum + aux
                last = active & (r == r_last) & (s == p - 1)
                outputs = outputs.at[m].set(jnp.where(last, y, outputs[m]))
                return (lax.ppermute(y, stage_axis, ring), outputs, aux_sum), None

            outputs = stacked_zeros(m_count, x0)
            (_, outputs, aux_sum), _ = lax.scan(
                tick, (jnp.zeros_like(x0), outputs, aux0), jnp.arange(schedule.num_ticks))
            return outputs, aux_sum

        def local_loss(shared, stages, ticked):
            outputs, aux_sum = forward(shared, stages, ticked)

            def one(total, i):  # on every stage (see when_busy); the last one's counts
                return total + program.head(shared, outputs[i], _micro(batch, i)), None

            total = lax.scan(one, jnp.zeros((), _F32), jnp.arange(m_count))[0]
            if not coupled:
                return jnp.where(s == p - 1, total, 0.0) + aux_sum, None
            # [P, M, R, ...] -> [M, R, P, ...]: every chunk's statistics per micro-batch
            table = jax.tree.map(lambda a: jnp.moveaxis(a, 0, 2), exchanged(aux_sum, axes))

            def coupled_terms(acc, i):
                micro, sums = _micro(batch, i), _micro(table, i)
                return acc + sum(program.aux_loss(_micro(_micro(aux_sum, i), r), sums, micro)
                                 for r in range(repeats)), None

            extra = lax.scan(coupled_terms, jnp.zeros((), _F32), jnp.arange(m_count))[0]
            return jnp.where(s == p - 1, total, 0.0) + extra, table

        if outputs:  # the last stage's head outputs, on every stage
            last, _ = forward(shared, stages, ticked)
            ys = lax.map(lambda i: program.head(shared, last[i], _micro(batch, i)),
                         jnp.arange(m_count))
            return _from_last(ys, s == p - 1, stage_axis)
        if not grads:
            loss, table = local_loss(shared, stages, ticked)
            loss = lax.psum(loss, tuple(axes.manual))
            return (loss, table) if totals else loss
        (loss, table), (g_shared, g_stages, g_ticked) = jax.value_and_grad(
            local_loss, argnums=(0, 1, 2), has_aux=True)(shared, stages, ticked)
        if maxed:  # per chunk, the maximum (or the sum) over the ticks that ran it
            active = fwd_micro[:, s] >= 0
            chunks = jnp.maximum(fwd_repeat[:, s], 0)

            def over_ticks(g, combine):
                here = active[:, None] & (chunks[:, None] == jnp.arange(repeats)[None])
                shape = (*here.shape, *([1] * (g.ndim - 1)))
                return combine(jnp.where(here.reshape(shape), g[:, None], 0.0), axis=0)

            g_stages = jax.tree.map(
                lambda f, c, g, gt: over_ticks(gt, jnp.max) if f else
                over_ticks(gt, jnp.sum).astype(g.dtype) if c else g,
                flags, counted, g_stages, g_ticked, is_leaf=lambda x: x is None)
        g_shared, g_stages = finish(g_shared, g_stages, axes, shared_specs, stage_specs,
                                    flags, reduce_dtype)
        out = (lax.psum(loss, tuple(axes.manual)), (g_shared, g_stages))
        return (*out, table) if totals else out

    inputs = (shared, stages, batch, keys)
    if outputs:  # [M, batch, ...]: the micro-batch and batch dimensions of the tokens'
        spec = jax.tree.leaves(jax.tree.map(axes.restrict, batch))[0]
        return run_manual(body, inputs, axes, mesh, False,
                          out_spec=jax.sharding.PartitionSpec(*spec[:2])), None
    if not grads:
        out = run_manual(body, inputs, axes, mesh, False, totals)
        return (out[0], None, out[1]) if totals else (out, None)
    return run_manual(body, inputs, axes, mesh, True, totals)


def _driven(program, schedule, shared, stages, batch, keys, axes, mesh, *, grads, totals,
            maximum, outputs, reduce_dtype, counted):
    """:func:`run_schedule` of a table with backward actions: each tick's F, B and W
    actions. Gradients accumulate in float32 and come back in the parameters' dtypes.
    With a program's ``aux_loss``, each tick's forward statistics are exchanged
    (:func:`~sp_jax.pipeline.spmd.exchanged`) before its backward, which takes each
    chunk's term and its cotangent from the micro-batch's totals."""
    del grads, outputs  # a driven table computes gradients (checked by run_schedule)
    stage_axis = axes.stage
    shared_specs = jax.tree.map(axes.restrict, shared)
    stage_specs = jax.tree.map(axes.restrict, stages)
    names = ["fwd_micro", "fwd_repeat", "bwd_micro", "bwd_repeat", "fwd_slot", "bwd_slot"]
    deferred = schedule.deferred  # W actions: B computes the input gradients alone
    if deferred:
        names += ["wgt_micro", "wgt_repeat", "bwd_wslot", "wgt_slot"]
    receive = {"fwd": schedule.num_fwd_recv, "bwd": schedule.num_bwd_recv}
    for kind, slots in receive.items():
        if slots:
            names += [f"{kind}_keep", f"{kind}_from"]
    tables = {name: jnp.asarray(getattr(schedule, name)) for name in names}
    p, r_last = schedule.stages, schedule.repeats - 1
    coupled = program.aux_loss is not None
    flags = leaf_flags(maximum, stages)
    ticks = _busy_ticks(schedule)
    taps = program.weight_taps if deferred else None
    split_input, split_weight = (backward_input, backward_weight) if taps is not None \
        else (_recomputed_input, _recomputed_weight)
    # Where the last stage only ever forwards a micro-batch's last chunk (one chunk per
    # stage), it ends a micro-batch (and the first starts one) in every tick it works:
    # no condition around the head or the embedding backward.
    head_when = always if _unconditional(schedule.fwd_micro[:, -1],
                                         schedule.fwd_repeat[:, -1], r_last) else when_busy
    embed_when = always if _unconditional(schedule.bwd_micro[:, 0],
                                          schedule.bwd_repeat[:, 0], 0) else when_busy
    forward_ring = [(i, (i + 1) % p) for i in range(p)]
    backward_ring = [(i, (i - 1) % p) for i in range(p)]
    cpu = mesh_platform() == "cpu"

    def body(shared, stages, batch, keys):
        s = lax.axis_index(stage_axis)
        shared, stages = prepare(shared, stages, axes, shared_specs, stage_specs)
        ekeys, lkeys = keys if keys is not None else (None, None)

        def embed(shared, m):
            return program.embed(shared, _micro(batch, m), None if ekeys is None else ekeys[m])

        def chunk_fn(m, r):
            """Chunk ``r``'s stage function of micro-batch ``m``: ``(chunk, x) ->
            (y, aux)``."""
            return lambda chunk, x: program.stage(chunk, x, _keys_at(lkeys, m, r, s),
                                                  _micro(batch, m))

        def aux_cotangent(active, m, aux_b, table, loss):
            """The cotangent of a chunk's ``aux`` in a backward (``active`` where this
            stage back-propagates micro-batch ``m``), and the loss with the chunk's
            coupled term (``aux_b``: the chunk's statistics)."""
            if coupled:  # the chunk's term and its cotangent, from the totals
                value, d_aux = jax.value_and_grad(program.aux_loss)(
                    aux_b, _micro(table, m), _micro(batch, m))
                loss = loss + jnp.where(active, value.astype(_F32), 0.0)
                return masked(active, d_aux), loss
            # the aux term's cotangent: 1 where this stage back-propagates
            return active.astype(_F32), loss

        def pick(r):
            """Chunk ``r``'s parameters (with W actions, the layers' taps beside them)."""
            return _with_taps(_chunk(stages, r), taps)

        def add_grads(g_stages, r, d_chunk, active):
            """The chunk's parameter gradients added at chunk ``r`` (amaxes, flagged: the
            maximum where ``active``; counted leaves: added where ``active``)."""
            return jax.tree.map(
                lambda f, c, g, d: g.at[r].max(jnp.where(active, d.astype(_F32), 0.0))
                if f else g.at[r].add(jnp.where(active, d.astype(_F32), 0.0) if c
                                      else d.astype(_F32)), flags, counted, g_stages, d_chunk)

        x0 = embed(shared, 0)
        zeros32 = jax.tree.map(lambda x: jnp.zeros_like(x, dtype=_F32), (shared, stages))
        # aux_loss: every (micro-batch, chunk)'s statistics [M, R, P, ...], filled as the
        # forwards run (a micro-batch's are complete before its first backward)
        table0 = _aux_table(program, pick(0), x0, _keys_at(lkeys, 0, 0, s), _micro(batch, 0),
                            (schedule.microbatches, schedule.repeats, p)) if coupled else None
        # with W actions: what each backward keeps for its W, and (aux_loss) each
        # forward's statistics for its backward's term
        wres0 = auxes0 = None
        if deferred:  # laid out as a backward's (traced for its layouts: dead code)
            aux_like = jax.tree.map(lambda a: jnp.zeros(a.shape, _F32), jax.eval_shape(
                lambda c: chunk_fn(0, 0)(c, x0)[1], pick(0)))
            like = split_input(chunk_fn(0, 0), pick(0), x0, (x0, aux_like))[2]
            wres0 = jax.tree.map(lambda a: stacked_zeros(schedule.num_wslots, a), like)
            if coupled:
                auxes0 = jax.tree.map(lambda a: jnp.zeros((schedule.num_slots, *a.shape),
                                                          _F32), aux_like)
        kept0 = {kind: stacked_zeros(slots, x0) for kind, slots in receive.items() if slots}

        def tick(carry, t, forward, backward, weight):
            """One tick; ``forward`` / ``backward`` / ``weight`` (static): whether any
            stage forwards / back-propagates / computes deferred weight gradients in
            this phase of the table."""
            recv_f, sent_b, inputs, loss, (g_shared, g_stages), table, extra = carry
            wres, auxes, kept = extra
            # The gradient the previous tick sent back: it travels while this tick's
            # forward runs (needed only by the backward below), as this tick's forward
            # output travels during its backward.
            recv_b = lax.ppermute(sent_b, stage_axis, backward_ring)
            recv_b, recv_f, inputs, sh = ordered(cpu, (recv_b, recv_f, inputs, shared))
            at = {name: table[t, s] for name, table in tables.items()}
            arrived = {"fwd": recv_f, "bwd": recv_b}
            for kind, buffer in kept.items():  # what arrives now for a later tick
                slot = jnp.maximum(at[f"{kind}_keep"], 0)
                keep = at[f"{kind}_keep"] >= 0
                kept[kind] = buffer.at[slot].set(jnp.where(keep, arrived[kind], buffer[slot]))
                src = at[f"{kind}_from"]
                arrived[kind] = jnp.where(src >= 0, kept[kind][jnp.maximum(src, 0)],
                                          arrived[kind])
            y, dy = jnp.zeros_like(x0), jnp.zeros_like(x0)
            if forward:  # one micro-batch through this stage's chunk
                m, r = at["fwd_micro"], at["fwd_repeat"]
                active = m >= 0
                m, r = jnp.maximum(m, 0), jnp.maximum(r, 0)
                first = active & (r == 0) & (s == 0)
                x = jnp.where(first, embed(sh, m), arrived["fwd"])
                slot = jnp.maximum(at["fwd_slot"], 0)
                inputs = inputs.at[slot].set(jnp.where(active, x, inputs[slot]))
                y, aux = program.stage(pick(r), x, _keys_at(lkeys, m, r, s),
                                       _micro(batch, m))
                y = jnp.where(active, y, jnp.zeros_like(y))
                if auxes is not None:  # for the deferred backward's coupled term
                    auxes = jax.tree.map(lambda b, a: b.at[slot].set(
                        jnp.where(active, a.astype(_F32), b[slot])), auxes, aux)
                if coupled:  # this tick's statistics of every stage, into the table
                    gathered = exchanged(
                        masked(active, jax.tree.map(lambda a: a.astype(_F32), aux)), axes)
                    where_m = lax.all_gather(jnp.where(active, m, schedule.microbatches),
                                             stage_axis)
                    where_r = lax.all_gather(r, stage_axis)
                    table = jax.tree.map(
                        lambda tb, g: tb.at[where_m, where_r, jnp.arange(p)].add(
                            g, mode="drop"), table, gathered)
                    table, y = ordered(cpu, (table, y))
                else:
                    loss = loss + jnp.where(active, aux.astype(_F32), 0.0)
                sent_f = lax.ppermute(y, stage_axis, forward_ring)  # during the backward
                sent_f, y, inputs, sh = ordered(cpu, (sent_f, y, inputs, sh))
                # The last virtual stage: the loss and its gradient, which starts this
                # micro-batch's backward in the same tick.
                last = active & (r == r_last) & (s == p - 1)

                def head():
                    value, (dh, dy) = jax.value_and_grad(program.head, argnums=(0, 1))(
                        sh, y, _micro(batch, m))
                    return value.astype(_F32), dh, dy

                like = (jnp.zeros((), _F32), sh, y)
                value, dh, dy = head_when(ticks["last"][t], last, head, like)
                loss = loss + value
                g_shared = jax.tree.map(lambda g, d: g + d.astype(_F32), g_shared, dh)
            dx = jnp.zeros_like(x0)
            if backward:  # one micro-batch back through this stage's chunk
                mb, rb = at["bwd_micro"], at["bwd_repeat"]
                active_b = mb >= 0
                mb, rb = jnp.maximum(mb, 0), jnp.maximum(rb, 0)
                xb = inputs[jnp.maximum(at["bwd_slot"], 0)]
                gy = jnp.where(active_b & (rb == r_last) & (s == p - 1), dy, arrived["bwd"])
                gy = jnp.where(active_b, gy, jnp.zeros_like(gy))  # idle: zero gradients
                if deferred:  # the input gradient now, the weights' at the W action
                    aux_b = None if auxes is None else jax.tree.map(
                        lambda b: b[jnp.maximum(at["bwd_slot"], 0)], auxes)
                    d_aux, loss = aux_cotangent(active_b, mb, aux_b, table, loss)
                    dx, now, res = split_input(chunk_fn(mb, rb), pick(rb), xb, (gy, d_aux))
                    if now is not None:  # the gradients of what does not defer
                        g_stages = add_grads(g_stages, rb, _without_taps(
                            now, _chunk(stages, rb)), active_b)
                    slot = jnp.maximum(at["bwd_wslot"], 0)
                    wres = jax.tree.map(lambda b, v: b.at[slot].set(
                        jnp.where(active_b, v, b[slot])), wres, res)
                else:
                    outs, pullback = jax.vjp(chunk_fn(mb, rb), _chunk(stages, rb), xb)
                    d_aux, loss = aux_cotangent(active_b, mb, outs[1], table, loss)
                    d_chunk, dx = pullback((gy, d_aux))
                    g_stages = add_grads(g_stages, rb, d_chunk, active_b)
                first_b = active_b & (rb == 0) & (s == 0)

                def embed_backward():
                    return jax.vjp(lambda params: embed(params, mb), sh)[1](dx)[0]

                de = embed_when(ticks["embed_bwd"][t], first_b, embed_backward, sh)
                g_shared = jax.tree.map(lambda g, d: g + d.astype(_F32), g_shared, de)
            if weight:  # deferred weight gradients of one backward
                mw, rw = at["wgt_micro"], at["wgt_repeat"]
                active_w = mw >= 0
                mw, rw = jnp.maximum(mw, 0), jnp.maximum(rw, 0)
                res = jax.tree.map(lambda b: b[jnp.maximum(at["wgt_slot"], 0)], wres)
                later = split_weight(chunk_fn(mw, rw), pick(rw), res)
                g_stages = add_grads(g_stages, rw, masked(  # idle: a stale slot's
                    active_w, _without_taps(later, _chunk(stages, rw))), active_w)
            if not forward:
                y, dx, g_shared, g_stages = ordered(cpu, (y, dx, g_shared, g_stages))
                sent_f = lax.ppermute(y, stage_axis, forward_ring)
            return (sent_f, dx, inputs, loss, (g_shared, g_stages), table,
                    (wres, auxes, kept)), None

        inputs = stacked_zeros(schedule.num_slots, x0)
        carry = (jnp.zeros_like(x0), jnp.zeros_like(x0), inputs, jnp.zeros((), _F32),
                 zeros32, table0, (wres0, auxes0, kept0))
        for begin, end, forward, backward, weight in _phases(schedule):
            carry, _ = lax.scan(functools.partial(tick, forward=forward, backward=backward,
                                                  weight=weight),
                                carry, jnp.arange(begin, end))
        _, _, _, loss, (g_shared, g_stages), table, _ = carry
        g_shared = jax.tree.map(lambda g, x: g.astype(x.dtype), g_shared, shared)
        g_stages = jax.tree.map(lambda g, x: g.astype(x.dtype), g_stages, stages)
        g_shared, g_stages = finish(g_shared, g_stages, axes, shared_specs, stage_specs,
                                    flags, reduce_dtype)
        out = (lax.psum(loss, tuple(axes.manual)), (g_shared, g_stages))
        return (*out, table) if totals else out

    return run_manual(body, (shared, stages, batch, keys), axes, mesh, True, totals)


# The names of the drivers this interpreter replaces: any table runs through either.
gpipe = run_schedule
one_f_one_b = run_schedule

"""The pipeline in one SPMD program: a ``shard_map`` manual over the stage and data axes
whose tick loop runs a :class:`~sp_jax.pipeline.schedule.PipelineSchedule`.

Every device runs the same loop. At each tick a stage looks up in the schedule's tables
which micro-batch and layer chunk it works on, runs it (an idle stage computes on
zeros and drops the result: conditions that differ between stages around the layers'
collectives are not supported by XLA), and passes its output to the next stage with one
``ppermute`` on the stage axis: the activation in its sequence-parallel layout,
``[b, s / (c t), h]`` per device (Megatron's scatter-gather optimisation). The context
and tensor axes stay in the hands of the layers (their own ``shard_map`` s, nested in
this one).

Gradients are computed per device, inside the loop's ``shard_map``, and reduced once per
step: over the data axes (a ``psum``, or a ``psum_scatter`` for parameters sharded over
them by fsdp, whose stage weights are all-gathered once before the loop) and, for the
parameters every stage holds (embedding, head, final norm), over the stage axis.

A micro-batch is a dict of ``[b, s]`` arrays (tokens, labels, packed rows' ids and
positions) that every stage holds and indexes, so it travels with its micro-batch
without a transfer. A stage may return statistics beside its output
(:class:`StageProgram`'s ``aux``: a loss term, or with ``aux_loss`` statistics such as a
mixture of experts' router sums, exchanged between the stages so that a term coupling
every layer is exact); leaves flagged in ``maximum`` (FP8 amax histories) get the
maximum of their per-tick "gradients" instead of the sum; and :func:`gpipe` with
``outputs`` returns the head's per-micro-batch outputs of a forward (hidden states,
logits) instead of a loss.

* :func:`gpipe` differentiates the forward loop (GPipe: every micro-batch's activations
  stay alive until the backward; ``R > 1`` is the circular schedule).
* :func:`one_f_one_b` drives forward and backward itself: each tick a stage forwards one
  micro-batch and back-propagates another (``jax.vjp`` of the stage, recomputing its
  forward from the kept stage input), so it keeps at most ``2 V - 1`` stage inputs
  (``V = stages * repeats``) whatever the number of micro-batches. It runs as three
  loops, warm-up (forwards only), steady state and cool-down (backwards only), so no
  tick computes a half that no stage needs; a tick's activation transfer travels during
  its backward and its gradient transfer during the next tick's forward.
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
from jax.sharding import PartitionSpec as P

from sp_jax.mesh import mesh_platform, restrict_spec, spec_axes
from sp_jax.ops.primitives import reduce_in
from sp_jax.pipeline.schedule import PipelineSchedule

__all__ = ["StageProgram", "gpipe", "one_f_one_b"]

_F32 = jnp.float32


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
        runner was given it); ``micro``: the micro-batch
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
    """

    embed: Callable[[Any, Any, Any], jax.Array]
    stage: Callable[[Any, jax.Array, Any, Any], tuple[jax.Array, Any]]
    head: Callable[[Any, jax.Array, Any], jax.Array]
    aux_loss: Callable[[Any, Any, Any], jax.Array] | None = None


def _micro(batch: Any, m: jax.Array | int) -> Any:
    """Micro-batch ``m`` of a dict of ``[M, b, s]`` arrays."""
    return jax.tree.map(lambda a: a[m], batch)


@dataclasses.dataclass(frozen=True)
class _Axes:
    """The manual axes of the pipeline's ``shard_map``: the stage and the data axes."""

    stage: str
    data: tuple[str, ...]

    @property
    def manual(self) -> frozenset[str]:
        return frozenset((self.stage, *self.data))

    def restrict(self, x: jax.Array) -> P:
        """``x``'s spec with only the manual axes kept."""
        return restrict_spec(jax.typeof(x).sharding.spec, self.manual, x.ndim)


def _data_dims(spec: P, data: tuple[str, ...]) -> list[tuple[int, tuple[str, ...]]]:
    """(dimension, data axes) of each dimension of ``spec`` sharded over data axes."""
    return [(dim, spec_axes(entry, data)) for dim, entry in enumerate(spec)
            if spec_axes(entry, data)]


def _gather(x: jax.Array, spec: P, data: tuple[str, ...]) -> jax.Array:
    """The whole of ``x`` over the data axes (fsdp): one all-gather per sharded dim."""
    for dim, axes in _data_dims(spec, data):
        x = lax.all_gather(x, axes, axis=dim, tiled=True)
    return x


def _psum_scatter(g: jax.Array, axes: tuple[str, ...], dim: int) -> jax.Array:
    """``lax.psum_scatter`` over the (manual) ``axes`` on dimension ``dim`` of ``g``,
    which may still be sharded over other, explicit axes (the reduce-scatter runs on
    each device's block, in a ``shard_map`` over those)."""
    spec = jax.typeof(g).sharding.spec
    mesh = jax.sharding.get_abstract_mesh()
    explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                if t != jax.sharding.AxisType.Manual}
    if not explicit:
        return lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
    return jax.shard_map(lambda b: lax.psum_scatter(b, axes, scatter_dimension=dim,
                                                    tiled=True),
                         in_specs=spec, out_specs=spec, axis_names=explicit)(g)


def _reduce(g: jax.Array, spec: P, axes: _Axes, over_stage: bool,
            dtype: Any = None) -> jax.Array:
    """The per-device gradient ``g`` of a whole (gathered) parameter, summed over the
    devices that shared it: reduce-scattered over the data axes it is sharded over,
    summed over the other data axes, and over the stage axis when ``over_stage``;
    ``dtype`` (``ParallelConfig.grad_reduce_dtype``): the collectives carry ``g`` cast
    to it, the result cast back to ``g``'s dtype."""
    dims = _data_dims(spec, axes.data)
    scattered = {a for _, names in dims for a in names}
    for dim, names in dims:
        g = _psum_scatter(g, names, dim) if dtype is None else \
            reduce_in(g, names, dtype, scatter_dim=dim)
    rest = tuple(a for a in axes.data if a not in scattered)
    if over_stage:
        rest = (axes.stage, *rest)
    if not rest:
        return g
    return lax.psum(g, rest) if dtype is None else reduce_in(g, rest, dtype)


def _chunk(tree: Any, r: jax.Array) -> Any:
    """Layer chunk ``r`` of a tree of ``[R, layers_per_chunk, ...]`` leaves."""
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, r, 0, keepdims=False), tree)


def _when(anywhere: jax.Array, here: jax.Array, fn: Callable[[], Any], like: Any) -> Any:
    """``fn()`` where ``here`` (this stage's slot is busy), else zeros shaped like
    ``like``.

    ``anywhere`` (some stage is busy in this tick: the same on every device) skips the
    work of a tick in which every stage is idle, with ``lax.cond``. Within a tick every
    stage runs ``fn`` and the idle ones drop the result: a stage-dependent branch would
    put the layers' own collectives (tensor, context) under a condition that differs
    between devices, which XLA does not support (found with ring attention on XLA:CPU:
    wrong values). In lockstep the tick takes as long as its busiest stage either way.
    """
    def run():
        out = fn()
        return jax.tree.map(lambda o: jnp.where(here, o, jnp.zeros_like(o)), out)

    return lax.cond(anywhere, run, lambda: jax.tree.map(jnp.zeros_like, like))


def _always(anywhere: jax.Array, here: jax.Array, fn: Callable[[], Any], like: Any) -> Any:
    """:func:`_when` without the condition: ``fn()`` on every stage, kept where ``here``."""
    del anywhere, like
    return jax.tree.map(lambda o: jnp.where(here, o, jnp.zeros_like(o)), fn())


def _ordered(cpu: bool, tree: Any) -> Any:
    """``tree`` behind an optimization barrier on XLA:CPU (``cpu``), unchanged elsewhere.

    XLA:CPU's runtime starts the collectives that do not depend on each other in any
    order, and each device may pick another: one device of a stage then waits in a
    stage transfer (``ppermute``) while another waits in a layer's all-gather, and the
    step deadlocks (seen with XLA:CPU's legacy fusion emitters). Barriers that tie each
    transfer to the values the next collectives use put them in one order on every
    device. XLA:GPU issues collectives in its schedule's order on every device and
    overlaps the transfers with the layers' GEMMs: no barrier there.
    """
    return lax.optimization_barrier(tree) if cpu else tree


def _phases(schedule: PipelineSchedule) -> list[tuple[int, int, bool, bool]]:
    """``(first tick, end tick, forward, backward)`` of a 1F1B schedule's three loops:
    the warm-up (forwards only), the steady state (one forward and one backward per
    stage and tick) and the cool-down (backwards only). Each is a loop without
    conditions, so XLA's scheduler can overlap a tick's transfers with its GEMMs."""
    fwd = np.flatnonzero((schedule.fwd_micro >= 0).any(axis=1))
    bwd = np.flatnonzero((schedule.bwd_micro >= 0).any(axis=1))
    steady = (int(bwd[0]), int(fwd[-1]) + 1)
    phases = [(0, steady[0], True, False), (steady[0], steady[1], True, True),
              (steady[1], schedule.num_ticks, False, True)]
    return [phase for phase in phases if phase[1] > phase[0]]


def _busy_ticks(schedule: PipelineSchedule) -> dict[str, jax.Array]:
    """Per tick, whether the last stage ends a micro-batch (its last chunk: the loss) and
    whether the first stage back-propagates into the embedding (its chunk 0): the same on
    every device (:func:`_when`)."""
    fm, fr = schedule.fwd_micro, schedule.fwd_repeat
    bm, br = schedule.bwd_micro, schedule.bwd_repeat
    return {"last": jnp.asarray((fm[:, -1] >= 0) & (fr[:, -1] == schedule.repeats - 1)),
            "embed_bwd": jnp.asarray((bm[:, 0] >= 0) & (br[:, 0] == 0))}


def _stacked_zeros(n: int, like: jax.Array) -> jax.Array:
    """Zeros ``[n, *like.shape]`` laid out as ``like`` on the trailing dimensions."""
    spec = tuple(jax.typeof(like).sharding.spec)
    return jnp.zeros((n, *like.shape), like.dtype, out_sharding=P(None, *spec))


def _keys_at(keys: Any, m: jax.Array, r: jax.Array, s: jax.Array) -> Any:
    """The per-layer data of micro-batch ``m``, chunk ``r`` on stage ``s`` from a pytree
    of ``[M, R, P, layers_per_chunk, ...]`` leaves (dropout key data; None without)."""
    return jax.tree.map(lambda k: k[m, r, s], keys)


def _masked(active: jax.Array, tree: Any) -> Any:
    """``tree`` where ``active``, else zeros."""
    return jax.tree.map(lambda a: jnp.where(active, a, jnp.zeros_like(a)), tree)


def _aux_table(program: StageProgram, stages: Any, x: jax.Array, keys: Any, micro: Any,
               shape: tuple[int, ...]) -> Any:
    """Zeros ``[*shape, ...]`` for the ``aux`` statistics of a chunk (its shapes from
    :meth:`StageProgram.stage`)."""
    aux = jax.eval_shape(lambda c, x, k: program.stage(c, x, k, micro)[1],
                         _chunk(stages, 0), x, keys)
    return jax.tree.map(lambda a: jnp.zeros((*shape, *a.shape), _F32), aux)


def _exchanged(aux: Any, axes: _Axes) -> Any:
    """``aux`` summed over the data axes and gathered over the stage axis: ``[P, ...]``
    on every device (not differentiated)."""
    aux = jax.lax.stop_gradient(aux)
    if axes.data:
        aux = jax.tree.map(lambda a: lax.psum(a, axes.data), aux)
    return jax.tree.map(lambda a: lax.all_gather(a, axes.stage), aux)


def _loop_spec(x: jax.Array, axes: _Axes) -> P:
    """``x``'s spec without the explicit axes of the dimensions it shares with data axes
    (an fsdp parameter's hidden dimension over the data and the expert axes: the loop
    gathers it whole over the data axes, so its expert part is gathered before, and the
    gradient's reduce-scatter over the data axes sees no explicit axis on that
    dimension)."""
    spec = jax.typeof(x).sharding.spec
    return P(*(entry if not spec_axes(entry, axes.data) else spec_axes(entry, axes.manual)
               for entry in spec))


def _run(body: Callable, program_inputs: tuple, axes: _Axes, mesh: Any, grads: bool = True,
         totals: bool = False, out_spec: P | None = None) -> Any:
    """``body`` under the pipeline's ``shard_map`` (manual over stage and data); the
    parameters (the first two inputs) in their :func:`_loop_spec` layout there, their
    gradients back in the parameters' layout; ``out_spec``: the result's spec instead
    (a forward's outputs)."""
    params = program_inputs[:2]
    loop = jax.tree.map(lambda x: _loop_spec(x, axes), params)
    program_inputs = (*jax.tree.map(jax.reshard, params, loop), *program_inputs[2:])
    specs = jax.tree.map(axes.restrict, program_inputs)
    out_specs = (P(), (specs[0], specs[1])) if grads else P()
    if totals:
        out_specs = (*out_specs, P()) if grads else (P(), P())
    if out_spec is not None:
        out_specs = out_spec
    out = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs,
                        axis_names=set(axes.manual), check_vma=False)(*program_inputs)
    if not grads or out_spec is not None:
        return out
    original = jax.tree.map(lambda x: jax.typeof(x).sharding.spec, params)
    return (out[0], jax.tree.map(jax.reshard, out[1], original), *out[2:])


def _prepare(shared, stages, axes, shared_specs, stage_specs):
    """Parameters as the loop uses them: this stage's chunks ``[R, ...]``, each whole
    over the data axes (fsdp's one gather per step)."""
    shared = jax.tree.map(lambda x, sp: _gather(x, sp, axes.data), shared, shared_specs)
    stages = jax.tree.map(lambda x, sp: _gather(x, sp, axes.data)[0], stages, stage_specs)
    # The gathers before the first embedding's reduce-scatter, on every device: left
    # free, XLA:CPU devices of a stage took them in different orders and the step
    # deadlocked (measured: 1 run in 5 with per-layer windows; _ordered).
    return _ordered(mesh_platform() == "cpu", (shared, stages))


def _finish(g_shared, g_stages, axes, shared_specs, stage_specs, maximum=None,
            dtype=None):
    """Per-device gradients reduced once: see :func:`_reduce` (``dtype``: the reduction's
    dtype); the stage leaves flagged in ``maximum`` (amaxes) by their maximum over the
    data axes instead."""
    g_shared = jax.tree.map(lambda g, sp: _reduce(g, sp, axes, True, dtype), g_shared,
                            shared_specs)

    def one(g, sp, flag):
        if not flag:
            return _reduce(g[None], sp, axes, False, dtype)
        return lax.pmax(g[None], axes.data) if axes.data else g[None]

    g_stages = jax.tree.map(one, g_stages, stage_specs, _flags(maximum, g_stages))
    return g_shared, g_stages


def _flags(maximum: Any, stages: Any) -> Any:
    """``maximum`` (a tree of bools like ``stages``, or None: none) as a full tree."""
    if maximum is None:
        return jax.tree.map(lambda _: False, stages)
    return jax.tree.map(bool, maximum)


def gpipe(program: StageProgram, schedule: PipelineSchedule, shared: Any, stages: Any,
          batch: Any, keys: tuple[Any, Any] | None, *,
          stage_axis: str, data_axes: tuple[str, ...], mesh: Any, grads: bool = True,
          totals: bool = False, maximum: Any = None, outputs: bool = False,
          reduce_dtype: Any = None) -> tuple[jax.Array, tuple[Any, Any] | None]:
    """Loss sum and gradients of a GPipe (``R > 1``: circular) pipeline step (or, with
    ``outputs``, the head's outputs of a forward).

    Args:
      program: the model's :class:`StageProgram`.
      schedule: a ``"gpipe"`` :class:`~sp_jax.pipeline.schedule.PipelineSchedule`.
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
      grads: False for the loss alone (the forward loop, no autodiff).
      totals: also return the ``aux`` statistics of every micro-batch (a program with
        ``aux_loss``): leaves ``[M, R, P, ...]``, summed over the data axes.
      maximum: None, or a tree of bools like ``stages``: the "gradients" of the leaves
        marked True (an FP8 layer's amax history, whose cotangent is the step's amaxes)
        are their maximum over the micro-batches a stage runs and over the data axes,
        not a sum (each tick's taken apart: the forward loop gets them per tick).
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
    axes = _Axes(stage_axis, tuple(data_axes))
    shared_specs = jax.tree.map(axes.restrict, shared)
    stage_specs = jax.tree.map(axes.restrict, stages)
    fwd_micro = jnp.asarray(schedule.fwd_micro)
    fwd_repeat = jnp.asarray(schedule.fwd_repeat)
    p, r_last, m_count = schedule.stages, schedule.repeats - 1, schedule.microbatches
    repeats = schedule.repeats
    ring = [(i, (i + 1) % p) for i in range(p)]
    coupled = program.aux_loss is not None
    flags = _flags(maximum, stages)
    maxed = any(jax.tree.leaves(flags))

    def body(shared, stages, batch, keys):
        s = lax.axis_index(stage_axis)
        shared, stages = _prepare(shared, stages, axes, shared_specs, stage_specs)
        ekeys, lkeys = keys if keys is not None else (None, None)
        # the flagged leaves of each tick's chunk, [ticks, ...]: their per-tick
        # cotangents come apart (combined by maximum below), not summed by autodiff
        ticked = jax.tree.map(lambda f, x: jnp.take(x, jnp.maximum(fwd_repeat[:, s], 0),
                                                    axis=0) if f else None, flags, stages)

        def forward(shared, stages, ticked):
            """The last virtual stage's outputs ``[M, b, s, h]`` and the aux sums."""
            x0 = program.embed(shared, _micro(batch, 0), None if ekeys is None else ekeys[0])
            # aux: a scalar sum, or (aux_loss) each (micro-batch, chunk)'s statistics
            aux0 = _aux_table(program, stages, x0, _keys_at(lkeys, 0, 0, s),
                              _micro(batch, 0), (m_count, repeats)) if coupled else \
                jnp.zeros((), _F32)

            def tick(carry, t):
                recv, outputs, aux_sum = carry
                m, r = fwd_micro[t, s], fwd_repeat[t, s]
                active = m >= 0
                m, r = jnp.maximum(m, 0), jnp.maximum(r, 0)
                first = active & (r == 0) & (s == 0)
                # some stage forwards in every tick: no condition (see _when)
                micro = _micro(batch, m)
                x = jnp.where(first, program.embed(
                    shared, micro, None if ekeys is None else ekeys[m]), recv)
                # the chunk is picked again in the backward loop, not kept per tick
                # (the layers' custom VJPs still keep their kernel shards per tick:
                # BENCHMARKS.md, "Pipeline parallelism")
                chunk = jax.checkpoint(_chunk)(stages, r)
                if maxed:
                    chunk = jax.tree.map(lambda f, c, x: x[t] if f else c, flags, chunk,
                                         ticked, is_leaf=lambda x: x is None)
                y, aux = program.stage(chunk, x, _keys_at(lkeys, m, r, s), micro)
                y = jnp.where(active, y, jnp.zeros_like(y))
                aux = _masked(active, jax.tree.map(lambda a: a.astype(_F32), aux))
                if coupled:  # each (micro-batch, chunk) runs once on this stage
                    aux_sum = jax.tree.map(lambda acc, a: acc.at[m, r].add(a), aux_sum, aux)
                else:
                    aux_sum = aux_sum + aux
                last = active & (r == r_last) & (s == p - 1)
                outputs = outputs.at[m].set(jnp.where(last, y, outputs[m]))
                return (lax.ppermute(y, stage_axis, ring), outputs, aux_sum), None

            outputs = _stacked_zeros(m_count, x0)
            (_, outputs, aux_sum), _ = lax.scan(
                tick, (jnp.zeros_like(x0), outputs, aux0), jnp.arange(schedule.num_ticks))
            return outputs, aux_sum

        def local_loss(shared, stages, ticked):
            outputs, aux_sum = forward(shared, stages, ticked)

            def one(total, i):  # on every stage (see _when); the last one's counts
                return total + program.head(shared, outputs[i], _micro(batch, i)), None

            total = lax.scan(one, jnp.zeros((), _F32), jnp.arange(m_count))[0]
            if not coupled:
                return jnp.where(s == p - 1, total, 0.0) + aux_sum, None
            # [P, M, R, ...] -> [M, R, P, ...]: every chunk's statistics per micro-batch
            table = jax.tree.map(lambda a: jnp.moveaxis(a, 0, 2),
                                 _exchanged(aux_sum, axes))

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
            return lax.psum(jnp.where(s == p - 1, ys, jnp.zeros_like(ys)), stage_axis)
        if not grads:
            loss, table = local_loss(shared, stages, ticked)
            loss = lax.psum(loss, tuple(axes.manual))
            return (loss, table) if totals else loss
        (loss, table), (g_shared, g_stages, g_ticked) = jax.value_and_grad(
            local_loss, argnums=(0, 1, 2), has_aux=True)(shared, stages, ticked)
        if maxed:  # per chunk, the maximum over the ticks that ran it
            active = fwd_micro[:, s] >= 0
            chunks = jnp.maximum(fwd_repeat[:, s], 0)

            def over_ticks(g):
                here = active[:, None] & (chunks[:, None] == jnp.arange(repeats)[None])
                shape = (*here.shape, *([1] * (g.ndim - 1)))
                return jnp.max(jnp.where(here.reshape(shape), g[:, None], 0.0), axis=0)

            g_stages = jax.tree.map(lambda f, g, gt: over_ticks(gt) if f else g, flags,
                                    g_stages, g_ticked, is_leaf=lambda x: x is None)
        g_shared, g_stages = _finish(g_shared, g_stages, axes, shared_specs, stage_specs,
                                     flags, reduce_dtype)
        out = (lax.psum(loss, tuple(axes.manual)), (g_shared, g_stages))
        return (*out, table) if totals else out

    inputs = (shared, stages, batch, keys)
    if outputs:  # [M, batch, ...]: the micro-batch and batch dimensions of the tokens'
        spec = jax.tree.leaves(jax.tree.map(axes.restrict, batch))[0]
        return _run(body, inputs, axes, mesh, False, out_spec=P(*spec[:2])), None
    if not grads:
        out = _run(body, inputs, axes, mesh, False, totals)
        return (out[0], None, out[1]) if totals else (out, None)
    return _run(body, inputs, axes, mesh, True, totals)


def one_f_one_b(program: StageProgram, schedule: PipelineSchedule, shared: Any,
                stages: Any, batch: Any, keys: tuple[Any, Any] | None, *, stage_axis: str,
                data_axes: tuple[str, ...], mesh: Any, totals: bool = False,
                maximum: Any = None, reduce_dtype: Any = None
                ) -> tuple[jax.Array, tuple[Any, Any]]:
    """Loss sum and gradients of a 1F1B pipeline step: arguments and results as
    :func:`gpipe` with ``grads`` (a loss alone is :func:`gpipe`'s forward), ``schedule``
    a ``"1f1b"`` one. Gradients accumulate in float32 and come back in the parameters'
    dtypes. With a program's ``aux_loss``, each tick's forward statistics are exchanged
    (:func:`_exchanged`) before its backward, which takes each chunk's term and its
    cotangent from the micro-batch's totals."""
    axes = _Axes(stage_axis, tuple(data_axes))
    shared_specs = jax.tree.map(axes.restrict, shared)
    stage_specs = jax.tree.map(axes.restrict, stages)
    tables = {name: jnp.asarray(getattr(schedule, name)) for name in (
        "fwd_micro", "fwd_repeat", "bwd_micro", "bwd_repeat", "fwd_slot", "bwd_slot")}
    p, r_last = schedule.stages, schedule.repeats - 1
    coupled = program.aux_loss is not None
    flags = _flags(maximum, stages)
    ticks = _busy_ticks(schedule)
    # With one chunk per stage the last stage ends a micro-batch (and the first starts
    # one) in every steady tick: no condition around the head or the embedding backward.
    head_when = _when if schedule.repeats > 1 else _always
    forward_ring = [(i, (i + 1) % p) for i in range(p)]
    backward_ring = [(i, (i - 1) % p) for i in range(p)]
    cpu = mesh_platform() == "cpu"

    def body(shared, stages, batch, keys):
        s = lax.axis_index(stage_axis)
        shared, stages = _prepare(shared, stages, axes, shared_specs, stage_specs)
        ekeys, lkeys = keys if keys is not None else (None, None)

        def embed(shared, m):
            return program.embed(shared, _micro(batch, m), None if ekeys is None else ekeys[m])

        x0 = embed(shared, 0)
        zeros32 = jax.tree.map(lambda x: jnp.zeros_like(x, dtype=_F32), (shared, stages))
        # aux_loss: every (micro-batch, chunk)'s statistics [M, R, P, ...], filled as the
        # forwards run (a micro-batch's are complete before its first backward)
        table0 = _aux_table(program, stages, x0, _keys_at(lkeys, 0, 0, s), _micro(batch, 0),
                            (schedule.microbatches, schedule.repeats, p)) if coupled else None

        def tick(carry, t, forward, backward):
            """One tick; ``forward`` / ``backward`` (static): whether any stage
            forwards / back-propagates in this phase of the schedule."""
            recv_f, sent_b, inputs, loss, (g_shared, g_stages), table = carry
            # The gradient the previous tick sent back: it travels while this tick's
            # forward runs (needed only by the backward below), as this tick's forward
            # output travels during its backward.
            recv_b = lax.ppermute(sent_b, stage_axis, backward_ring)
            recv_b, recv_f, inputs, sh = _ordered(cpu, (recv_b, recv_f, inputs, shared))
            at = {name: table[t, s] for name, table in tables.items()}
            y, dy = jnp.zeros_like(x0), jnp.zeros_like(x0)
            if forward:  # one micro-batch through this stage's chunk
                m, r = at["fwd_micro"], at["fwd_repeat"]
                active = m >= 0
                m, r = jnp.maximum(m, 0), jnp.maximum(r, 0)
                first = active & (r == 0) & (s == 0)
                x = jnp.where(first, embed(sh, m), recv_f)
                slot = jnp.maximum(at["fwd_slot"], 0)
                inputs = inputs.at[slot].set(jnp.where(active, x, inputs[slot]))
                y, aux = program.stage(_chunk(stages, r), x, _keys_at(lkeys, m, r, s),
                                       _micro(batch, m))
                y = jnp.where(active, y, jnp.zeros_like(y))
                if coupled:  # this tick's statistics of every stage, into the table
                    gathered = _exchanged(
                        _masked(active, jax.tree.map(lambda a: a.astype(_F32), aux)), axes)
                    where_m = lax.all_gather(jnp.where(active, m, schedule.microbatches),
                                             stage_axis)
                    where_r = lax.all_gather(r, stage_axis)
                    table = jax.tree.map(
                        lambda tb, g: tb.at[where_m, where_r, jnp.arange(p)].add(
                            g, mode="drop"), table, gathered)
                    table, y = _ordered(cpu, (table, y))
                else:
                    loss = loss + jnp.where(active, aux.astype(_F32), 0.0)
                sent_f = lax.ppermute(y, stage_axis, forward_ring)  # during the backward
                sent_f, y, inputs, sh = _ordered(cpu, (sent_f, y, inputs, sh))
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
                gy = jnp.where(active_b & (rb == r_last) & (s == p - 1), dy, recv_b)
                gy = jnp.where(active_b, gy, jnp.zeros_like(gy))  # idle: zero gradients
                (_, aux_b), pullback = jax.vjp(
                    lambda chunk, x: program.stage(chunk, x, _keys_at(lkeys, mb, rb, s),
                                                   _micro(batch, mb)),
                    _chunk(stages, rb), xb)
                if coupled:  # the chunk's term and its cotangent, from the totals
                    value, d_aux = jax.value_and_grad(program.aux_loss)(
                        aux_b, _micro(table, mb), _micro(batch, mb))
                    loss = loss + jnp.where(active_b, value.astype(_F32), 0.0)
                    d_aux = _masked(active_b, d_aux)
                else:  # the aux term's cotangent: 1 where this stage back-propagates
                    d_aux = active_b.astype(_F32)
                d_chunk, dx = pullback((gy, d_aux))
                g_stages = jax.tree.map(  # amaxes (flags): the maximum where active
                    lambda f, g, d: g.at[rb].max(jnp.where(active_b, d.astype(_F32), 0.0))
                    if f else g.at[rb].add(d.astype(_F32)), flags, g_stages, d_chunk)
                first_b = active_b & (rb == 0) & (s == 0)

                def embed_backward():
                    return jax.vjp(lambda params: embed(params, mb), sh)[1](dx)[0]

                de = head_when(ticks["embed_bwd"][t], first_b, embed_backward, sh)
                g_shared = jax.tree.map(lambda g, d: g + d.astype(_F32), g_shared, de)
            if not forward:
                y, dx, g_shared, g_stages = _ordered(cpu, (y, dx, g_shared, g_stages))
                sent_f = lax.ppermute(y, stage_axis, forward_ring)
            return (sent_f, dx, inputs, loss, (g_shared, g_stages), table), None

        inputs = _stacked_zeros(schedule.num_slots, x0)
        carry = (jnp.zeros_like(x0), jnp.zeros_like(x0), inputs, jnp.zeros((), _F32),
                 zeros32, table0)
        for begin, end, forward, backward in _phases(schedule):
            carry, _ = lax.scan(functools.partial(tick, forward=forward, backward=backward),
                                carry, jnp.arange(begin, end))
        _, _, _, loss, (g_shared, g_stages), table = carry
        g_shared = jax.tree.map(lambda g, x: g.astype(x.dtype), g_shared, shared)
        g_stages = jax.tree.map(lambda g, x: g.astype(x.dtype), g_stages, stages)
        g_shared, g_stages = _finish(g_shared, g_stages, axes, shared_specs, stage_specs,
                                     flags, reduce_dtype)
        out = (lax.psum(loss, tuple(axes.manual)), (g_shared, g_stages))
        return (*out, table) if totals else out

    return _run(body, (shared, stages, batch, keys), axes, mesh, True, totals)

"""The stage axis's ``shard_map`` and its collectives, shared by every schedule the
interpreter runs (:mod:`sp_jax.pipeline.interpreter`): the loop's manual axes (stage and
data), fsdp's one gather of a stage's weights per step and the one reduction of their
gradients (over the data axes; the shared parameters' also over the stage axis), the
exchange of a chunk's statistics between the stages, the ordering barrier of XLA:CPU,
and the conditions that keep every stage of a tick in lockstep.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from sp_jax.mesh import mesh_platform, restrict_spec, spec_axes
from sp_jax.ops.primitives import reduce_in

__all__ = ["StageAxes", "always", "exchanged", "finish", "leaf_flags", "masked", "ordered",
           "prepare", "run_manual", "stacked_zeros", "when_busy"]


@dataclasses.dataclass(frozen=True)
class StageAxes:
    """The manual axes of the pipeline's ``shard_map``: the stage and the data axes."""

    stage: str
    data: tuple[str, ...]

    @property
    def manual(self) -> tuple[str, ...]:
        """The stage axis, then the data axes: a tuple, in this order in every process.
        A set's order follows the strings' hashes, which differ between processes: the
        loss's ``psum`` over these axes then listed its devices in another order from
        one run of a step to the next, and XLA's all-reduce combiner merged it into the
        shared gradients' all-reduce in one run and not in the other (measured, 2 x 2 x
        1 x 2 mesh): two processes of one step could compile different collectives."""
        return (self.stage, *self.data)

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


def _reduce(g: jax.Array, spec: P, axes: StageAxes, over_stage: bool,
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


def when_busy(anywhere: jax.Array, here: jax.Array, fn: Callable[[], Any], like: Any
              ) -> Any:
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


def always(anywhere: jax.Array, here: jax.Array, fn: Callable[[], Any], like: Any) -> Any:
    """:func:`when_busy` without the condition: ``fn()`` on every stage, kept where ``here``."""
    del anywhere, like
    return jax.tree.map(lambda o: jnp.where(here, o, jnp.zeros_like(o)), fn())


def ordered(cpu: bool, tree: Any) -> Any:
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


def stacked_zeros(n: int, like: jax.Array) -> jax.Array:
    """Zeros ``[n, *like.shape]`` laid out as ``like`` on the trailing dimensions."""
    spec = tuple(jax.typeof(like).sharding.spec)
    return jnp.zeros((n, *like.shape), like.dtype, out_sharding=P(None, *spec))


def masked(active: jax.Array, tree: Any) -> Any:
    """``tree`` where ``active``, else zeros."""
    return jax.tree.map(lambda a: jnp.where(active, a, jnp.zeros_like(a)), tree)


def exchanged(aux: Any, axes: StageAxes) -> Any:
    """``aux`` summed over the data axes and gathered over the stage axis: ``[P, ...]``
    on every device (not differentiated)."""
    aux = jax.lax.stop_gradient(aux)
    if axes.data:
        aux = jax.tree.map(lambda a: lax.psum(a, axes.data), aux)
    return jax.tree.map(lambda a: lax.all_gather(a, axes.stage), aux)


def _loop_spec(x: jax.Array, axes: StageAxes) -> P:
    """``x``'s spec without the explicit axes of the dimensions it shares with data axes
    (an fsdp parameter's hidden dimension over the data and the expert axes: the loop
    gathers it whole over the data axes, so its expert part is gathered before, and the
    gradient's reduce-scatter over the data axes sees no explicit axis on that
    dimension)."""
    spec = jax.typeof(x).sharding.spec
    return P(*(entry if not spec_axes(entry, axes.data) else spec_axes(entry, axes.manual)
               for entry in spec))


def run_manual(body: Callable, program_inputs: tuple, axes: StageAxes, mesh: Any,
               grads: bool = True, totals: bool = False, out_spec: P | None = None) -> Any:
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


def prepare(shared, stages, axes, shared_specs, stage_specs):
    """Parameters as the loop uses them: this stage's chunks ``[R, ...]``, each whole
    over the data axes (fsdp's one gather per step)."""
    shared = jax.tree.map(lambda x, sp: _gather(x, sp, axes.data), shared, shared_specs)
    stages = jax.tree.map(lambda x, sp: _gather(x, sp, axes.data)[0], stages, stage_specs)
    # The gathers before the first embedding's reduce-scatter, on every device: left
    # free, XLA:CPU devices of a stage took them in different orders and the step
    # deadlocked (measured: 1 run in 5 with per-layer windows; ordered).
    return ordered(mesh_platform() == "cpu", (shared, stages))


def finish(g_shared, g_stages, axes, shared_specs, stage_specs, maximum=None,
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

    g_stages = jax.tree.map(one, g_stages, stage_specs, leaf_flags(maximum, g_stages))
    return g_shared, g_stages


def leaf_flags(maximum: Any, stages: Any) -> Any:
    """``maximum`` (a tree of bools like ``stages``, or None: none) as a full tree."""
    if maximum is None:
        return jax.tree.map(lambda _: False, stages)
    return jax.tree.map(bool, maximum)

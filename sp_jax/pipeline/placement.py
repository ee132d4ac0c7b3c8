"""Which layer each pipeline stage runs where, as data: the kinds of a GPT's layers
(:func:`layer_kinds`: one stack of parameters per kind, e.g. dense layers before
mixtures of experts), each kind's :class:`Placement` over the virtual stages, and the
stacked parameters laid out stage-major for the interpreter (:func:`stage_major`) and
their gradients back (:func:`layer_major`).

Every virtual stage's chunk holds a segment per kind: ``n`` slots of that kind's layers
(``n`` the most any chunk holds of it), the chunk's own layers active and the rest
padding, run as identities, so one SPMD program runs stages of different depths and of
different kinds (a stage without dense layers scans a dense segment of inactive slots).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sp_jax.config import PipelineConfig

__all__ = ["LayerKind", "Placement", "by_kind", "layer_kinds", "layer_major", "of_kinds",
           "placements", "stage_major"]


class LayerKind(NamedTuple):
    """One kind of a GPT's layers: the state attribute holding its stacked parameters
    (``name``: ``"blocks"`` or ``"dense_blocks"``), its first layer and how many
    consecutive layers it holds."""

    name: str
    first: int
    count: int


def layer_kinds(config: Any) -> tuple[LayerKind, ...]:
    """The kinds of a scanned GPT ``config``'s layers, in layer order: every layer in
    ``blocks``, or with ``num_dense_layers = k`` the dense ones in ``dense_blocks`` and
    the experts in ``blocks``."""
    k, layers = config.num_dense_layers, config.num_layers
    if not k:
        return (LayerKind("blocks", 0, layers),)
    return LayerKind("dense_blocks", 0, k), LayerKind("blocks", k, layers - k)


def by_kind(kinds: tuple[LayerKind, ...], tree: Any) -> list[Any]:
    """A tree per kind of ``tree``: itself for one kind, else its entry of each kind's
    name (the layout the stage program and the interpreter see: a single kind keeps
    the blocks' own tree)."""
    return [tree] if len(kinds) == 1 else [tree[kind.name] for kind in kinds]


def of_kinds(kinds: tuple[LayerKind, ...], values: list[Any]) -> Any:
    """The inverse of :func:`by_kind`: one kind's value, or a dict by kind name."""
    return values[0] if len(kinds) == 1 else {
        kind.name: v for kind, v in zip(kinds, values, strict=True)}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Which layer of one kind each stage runs where (``pipeline_layers_per_stage``, or
    kinds of layers): ``index [P, R, n]``, the row in the kind's stack of slot ``j`` of
    chunk ``r`` on stage ``s`` (``n``: the most layers of the kind in a virtual stage; a
    padding slot repeats its chunk's first layer of the kind, or row 0 in a chunk
    without any) and ``active [P, R, n]`` (False: a padding slot, run as an identity:
    one SPMD program for stages of different depths); both None when every virtual
    stage holds ``L / (P R)`` layers of the one kind (the parameters' own layout, split
    without moving data). ``first``: the kind's first layer (row ``i`` of its stack is
    layer ``first + i``)."""

    axis: str
    stages: int
    repeats: int
    index: np.ndarray | None = None
    active: np.ndarray | None = None
    first: int = 0

    @classmethod
    def of(cls, pipeline: PipelineConfig, stages: int, num_layers: int,
           kind: LayerKind | None = None) -> Placement:
        """The placement of ``pipeline`` on ``stages`` stages of ``num_layers`` layers:
        of all of them (``kind`` None), or of one kind's rows."""
        counts, r_count = pipeline.layers_per_stage, pipeline.repeats
        if counts is None:
            if kind is None:
                return cls(pipeline.axis, stages, r_count)
            counts = (num_layers // (stages * r_count),) * (stages * r_count)
        first, count = (0, num_layers) if kind is None else (kind.first, kind.count)
        starts = np.cumsum((0, *counts[:-1]))
        # each virtual stage's rows of the kind: [lo, hi) of its stack
        lo = np.clip(starts - first, 0, count)
        hi = np.clip(starts + np.asarray(counts) - first, 0, count)
        most = int(np.max(hi - lo))
        index = np.zeros((stages, r_count, most), np.int32)
        active = np.zeros((stages, r_count, most), bool)
        slots = np.arange(most)
        for v in range(len(counts)):
            r, st = divmod(v, stages)
            n = hi[v] - lo[v]
            index[st, r] = np.minimum(lo[v], count - 1) + np.where(slots < n, slots, 0)
            active[st, r, :n] = True
        return cls(pipeline.axis, stages, r_count, index, active, first)

    @property
    def even(self) -> bool:
        return self.index is None

    def layer_order(self) -> np.ndarray:
        """Flat ``(r, s, j)`` positions of the kind's rows ``0 .. n - 1`` (the slots of
        ``[R, P, n]`` tables that hold them, in layer order)."""
        flat = np.transpose(self.index, (1, 0, 2)).reshape(-1)
        on = np.transpose(self.active, (1, 0, 2)).reshape(-1)
        positions = np.flatnonzero(on)
        return positions[np.argsort(flat[positions], kind="stable")]


def placements(pipeline: PipelineConfig, stages: int, config: Any) -> list[Placement]:
    """The :class:`Placement` of each kind of the GPT ``config``'s layers
    (:func:`layer_kinds`): a single kind as ``pipeline_layers_per_stage`` says (even
    without it), several each with a segment in every chunk."""
    kinds = layer_kinds(config)
    if len(kinds) == 1:
        return [Placement.of(pipeline, stages, config.num_layers)]
    return [Placement.of(pipeline, stages, config.num_layers, kind) for kind in kinds]


def stage_major(blocks: Any, place: Placement) -> Any:
    """The stacked blocks as ``[P, R, L / (P R), ...]``, chunk ``r P + s`` at ``[s, r]``,
    from ``[L, ...]`` (``R = 1``) or ``[R, L / R, ...]`` sharded over the stage axis on
    the layer dimension: splits and a transpose of the sharded dimension, no data moves.
    With unequal stages (``place.index``), ``[P, R, n, ...]`` gathered from ``[L, ...]``
    (whole over the stage axis for the gather, once per step)."""
    stages, repeats = place.stages, place.repeats
    if not place.even:
        def gathered(x):
            rest = (tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim)[1:x.ndim]
            x = jax.reshard(x, P(None, *rest)).at[jnp.asarray(place.index)].get(
                out_sharding=P(None, None, None, *rest))
            return jax.reshard(x, P(place.axis, None, None, *rest))

        return jax.tree.map(gathered, blocks)

    def one(x):
        if repeats == 1:
            return jnp.reshape(x, (stages, 1, x.shape[0] // stages, *x.shape[1:]))
        x = jnp.reshape(x, (repeats, stages, x.shape[1] // stages, *x.shape[2:]))
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(one, blocks)


def layer_major(grads: Any, like: Any, place: Placement, flags: Any) -> Any:
    """The inverse of :func:`stage_major`: gradients shaped like the blocks ``like``
    (unequal stages: each layer's from its slot, the padding slots' dropped; ``flags``:
    the FP8 amax histories, their maximum)."""
    repeats = place.repeats
    if not place.even:
        index = jnp.asarray(place.index.reshape(-1))
        active = jnp.asarray(place.active.reshape(-1))

        def scattered(g, x, flag):
            rest = (tuple(jax.typeof(x).sharding.spec) + (None,) * x.ndim)[1:x.ndim]
            g = jax.reshard(g, P(None, None, None, *rest))
            g = g.reshape(-1, *g.shape[3:], out_sharding=P(None, *rest))
            g = jnp.where(active.reshape(-1, *(1,) * (g.ndim - 1)), g, jnp.zeros_like(g))
            out = jnp.zeros(x.shape, g.dtype, out_sharding=P(None, *rest))
            out = out.at[index].max(g, out_sharding=P(None, *rest)) if flag else \
                out.at[index].add(g, out_sharding=P(None, *rest))
            return jax.reshard(out, jax.typeof(x).sharding.spec)

        return jax.tree.map(scattered, grads, like, flags)

    def one(g, x):
        return jnp.reshape(g if repeats == 1 else jnp.swapaxes(g, 0, 1), x.shape)

    return jax.tree.map(one, grads, like)

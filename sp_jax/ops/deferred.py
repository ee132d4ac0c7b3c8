"""Deferred weight gradients: a stage's backward as an input-gradient pass (B) that hands
out what the weight gradients need, and a weight-gradient pass (W) that computes them
later from it (zero-bubble pipeline schedules).

Every linear rule (:mod:`sp_jax.ops.rules`) splits its backward into ``bwd_input(res,
g) -> (dx, wres)`` and ``bwd_weight(wres) -> (dkernel, daux)``. To move ``wres`` out of
a stage (through the layers' ``shard_map``, a scan over stacked layers, remat) each
deferring op takes a *tap*: an extra input whose cotangent is ``wres``. The taps live on
the layers as :class:`~sp_jax.layers.WeightGradTap` variables
(:func:`~sp_jax.layers.enable_weight_grad_taps`), so they are stacked and scanned with
the parameters; a tap's value says the op's mode, statically (its pytree type):

==========================  ========================================================
tap value                   the op
==========================  ========================================================
``None`` (no tap)           the fused op (today's ``linear_op``)
:class:`TapSlot`            fused: what a layer holds between passes (no arrays)
:class:`Taps` ``"record"``  forward, recording the shapes of its ``wres`` (an abstract
                            pass of :func:`backward_input`)
:class:`Taps` ``"input"``   B: forward; backward ``bwd_input``, zero weight, bias and
                            state gradients, ``wres`` as the tap's cotangent
:class:`Taps` ``"weight"``  W: the tap holds ``wres``; forward zeros (its input is not
                            used); backward ``bwd_weight`` (with FSDP's reduce-scatter),
                            zero ``dx``
==========================  ========================================================

A layer with several ops (experts: the up and down GEMMs) hands op ``i``
``taps.site(i)``. Per device, ``wres`` is carried as global arrays with one leading
dimension over the mesh axes of the layer's ``shard_map`` that the value varies over
(:func:`tap_specs`: each device its own block), so the specs are generic.

The stage-level API: :func:`backward_input` and :func:`backward_weight`. The W pass
differentiates the stage again, its ops in W mode: every computation but the weight
gradients of the deferring ops (the forward on zeros, the input gradients between the
ops, which the W ops do not read) is dead code, removed by the compiler (XLA and JAX's
DCE, through scans, remat and ``shard_map``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sp_jax.mesh import reshard
from sp_jax.ops.primitives import vary, vma

__all__ = ["TapSlot", "Taps", "WeightGradResiduals", "apply_deferred", "backward_input",
           "backward_weight", "local_taps", "tap_specs"]

MODES = ("record", "input", "weight")


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class TapSlot:
    """The value of a layer's :class:`~sp_jax.layers.WeightGradTap` between passes: no
    arrays (a static pytree), the names of the layer's parameters whose gradients its
    ops defer (``covers``: the kernel, bias and amax history of each op). The fused op
    runs."""

    covers: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class _Site:
    """What an op records in the abstract pass: its packed ``wres`` (shapes), the mesh
    axes each leaf varies over, and its kernel's rank."""

    avals: Any
    varying: Any
    kernel_ndim: int


class _Recorder:
    """The abstract pass's record: per slot, the inner mesh axes of its layer's
    ``shard_map`` and its sites (hashed by identity: a static of the taps)."""

    def __init__(self):
        self.axes: dict[int, tuple] = {}
        self.sites: dict[int, dict[int, _Site]] = {}


@jax.tree_util.register_pytree_node_class
class Taps:
    """A layer's taps in one pass (see the module docstring): ``mode`` one of
    ``"record"``, ``"input"``, ``"weight"``; ``sites`` one tree of arrays per op (its
    packed ``wres``, or zeros shaped like it; empty when recording); ``layout``, per
    site, the inner mesh axes each leaf's leading dimension spans, in leaf order
    (static); ``slot`` the
    layer's :class:`TapSlot`; ``record`` ``(recorder, index)`` when recording."""

    def __init__(self, mode: str, sites: tuple, layout: tuple, slot: TapSlot,
                 record: Any = None):
        self.mode, self.sites, self.layout, self.slot, self.record = (
            mode, sites, layout, slot, record)

    def tree_flatten(self):
        return (self.sites,), (self.mode, self.layout, self.slot, self.record)

    @classmethod
    def tree_unflatten(cls, aux, children):
        mode, layout, slot, record = aux
        return cls(mode, children[0], layout, slot, record)

    def site(self, i: int) -> _SiteTap:
        """The tap of the layer's op ``i`` (inside its ``shard_map``, after
        :func:`local_taps`)."""
        if not self.sites:
            return _SiteTap(self.mode, None, i, self.record, ())
        return _SiteTap(self.mode, self.sites[i], i, self.record, self.layout[i])


@dataclasses.dataclass(frozen=True)
class _SiteTap:
    mode: str
    arrays: Any
    index: int
    record: Any
    layout: tuple  # per leaf (mesh axes of its blocks, its own dtype when not the tap's)


def tap_specs(taps: Any) -> Any:
    """The ``shard_map`` in-specs of a layer's ``taps`` (None, a :class:`TapSlot` or
    :class:`Taps`): each leaf's leading dimension over the mesh axes its layout names
    (the axes the ``shard_map`` makes manual that the value varies over). Recording, it
    records those axes (the mesh axes not manual yet)."""
    # (the taps of a pass are made in these specs: no reshard is needed)
    if not isinstance(taps, Taps):
        return None if taps is None else P()
    if taps.mode == "record":
        recorder, index = taps.record
        mesh = jax.sharding.get_abstract_mesh()
        manual = set(getattr(mesh, "manual_axes", ()))
        recorder.axes[index] = tuple(a for a in mesh.axis_names if a not in manual)
        return P()
    sites = tuple(
        jax.tree.unflatten(jax.tree.structure(site),
                           [P(axes or None) for axes, _ in layout])
        for site, layout in zip(taps.sites, taps.layout, strict=True))
    return Taps(taps.mode, sites, taps.layout, taps.slot, taps.record)


def local_taps(taps: Any, i: int = 0) -> Any:
    """Inside the layer's ``shard_map``: the tap of its op ``i`` (None without
    :class:`Taps`), each leaf's block ``[1, ...]`` as the op's ``[...]`` (a reshape)."""
    if not isinstance(taps, Taps):
        return None
    if not taps.sites:
        return taps.site(i)
    sites = jax.tree.map(lambda a: a.reshape(a.shape[1:]), taps.sites)
    return Taps(taps.mode, sites, taps.layout, taps.slot, taps.record).site(i)


# --------------------------------------------------------------------------------------
# The op in each mode
# --------------------------------------------------------------------------------------

def _aval(x) -> tuple:
    return tuple(x.shape), jnp.dtype(x.dtype), vma(x)


def _zeros(aval) -> jax.Array | None:
    """Zeros of ``aval``; None (a zero cotangent) for an integer value."""
    shape, dtype, axes = aval
    if not jnp.issubdtype(dtype, jnp.inexact):
        return None
    return vary(jnp.zeros(shape, dtype), axes)


def _avals(tree) -> tuple:
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(_aval(leaf) for leaf in leaves)


def _zeros_tree(avals) -> Any:
    treedef, leaves = avals
    return jax.tree.unflatten(treedef, [_zeros(a) for a in leaves])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _input_op(x, kernel, aux, site, rule, statics):
    return rule.fwd(x, kernel, aux)[0]


def _input_fwd(x, kernel, aux, site, rule, statics):
    return rule.fwd(x, kernel, aux)


def _input_bwd(rule, statics, res, g):
    params, site_avals = statics
    dx, w = rule.bwd_input(res, g)
    packed = rule.pack(w)
    treedef, leaves = site_avals
    # as the tap's leaves: varying alike, integers (group sizes) as float32 (exact)
    packed = jax.tree.unflatten(treedef, [vary(v.astype(a[1]), a[2]) for v, a in zip(
        jax.tree.leaves(packed), leaves, strict=True)])
    dkernel, daux = _zeros_tree(params)
    return dx, dkernel, daux, packed


_input_op.defvjp(_input_fwd, _input_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _weight_op(x, kernel, aux, site, rule, statics):
    y = rule.fwd(x, kernel, aux)[0]
    return jnp.zeros_like(y)  # does not read y: the forward is dead code


def _weight_fwd(x, kernel, aux, site, rule, statics):
    return _weight_op(x, kernel, aux, site, rule, statics), (rule.weight_aux(aux), site)


def _weight_bwd(rule, statics, res, g):
    x_aval, layout = statics
    aux, site = res
    leaves, treedef = jax.tree.flatten(site)
    site = jax.tree.unflatten(treedef, [v if dtype is None else v.astype(dtype)
                                        for v, (_, dtype) in zip(leaves, layout, strict=True)])
    dkernel, daux = rule.bwd_weight(rule.unpack(site, aux))
    return _zeros(x_aval), dkernel, daux, None


_weight_op.defvjp(_weight_fwd, _weight_bwd)


def apply_deferred(rule: Any, x: jax.Array, kernel: jax.Array, aux: Any, tap: Any,
                   fused: Callable[[], jax.Array]) -> jax.Array:
    """``rule`` applied to ``x``, ``kernel`` and ``aux`` in the mode of ``tap`` (an op's
    site tap, ``Taps.site(i)``, or None / a :class:`TapSlot`: ``fused()``, the fused
    op). ``rule`` is the outermost rule (FSDP's, offload's wrapper included), with
    ``fwd``, ``bwd_input``, ``bwd_weight``, ``pack`` and ``unpack``."""
    if not isinstance(tap, _SiteTap):
        return fused()
    if tap.mode == "record":
        y, res = rule.fwd(x, kernel, aux)
        _, w = rule.bwd_input(res, jnp.zeros_like(y))
        packed = rule.pack(w)
        recorder, index = tap.record
        recorder.sites.setdefault(index, {})[tap.index] = _Site(
            jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), packed),
            jax.tree.map(vma, packed), kernel.ndim)
        return y
    if tap.mode == "input":
        statics = (_avals((kernel, aux)), _avals(tap.arrays))
        return _input_op(x, kernel, aux, tap.arrays, rule, statics)
    return _weight_op(x, kernel, aux, tap.arrays, rule, (_aval(x), tap.layout))


# --------------------------------------------------------------------------------------
# The stage-level API
# --------------------------------------------------------------------------------------

def _is_slot(v) -> bool:
    return isinstance(v, TapSlot)


def _key(k) -> Any:
    for name in ("key", "name", "idx"):
        if hasattr(k, name):
            return getattr(k, name)
    return k


def _path(path) -> tuple:
    return tuple(_key(k) for k in path)


def _slots(params) -> tuple[list, Any, list]:
    """``(leaves, treedef, slot indices)`` of ``params`` flattened with its
    :class:`TapSlot` values as leaves, with their paths."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_slot)
    slots = [i for i, (_, v) in enumerate(flat) if _is_slot(v)]
    if not slots:
        raise ValueError("backward_input: params hold no weight-gradient tap (TapSlot); "
                         "build the layers with sp_jax.layers.enable_weight_grad_taps and "
                         "pass their WeightGradTap state with the parameters.")
    return flat, treedef, slots


def _with(treedef, flat, values: dict) -> Any:
    return jax.tree.unflatten(treedef, [values.get(i, v) for i, (_, v) in enumerate(flat)])


def _covered(flat, slots) -> dict[int, tuple[int, str]]:
    """Leaf index -> (slot index, name) of the parameters the slots' ops cover: those
    named in a slot's ``covers`` beside it (the same module path)."""
    where = {_path(p): i for i, (p, _) in enumerate(flat)}
    covered = {}
    for s in slots:
        path, slot = flat[s]
        module = _path(path)[:-1]
        for name in slot.covers:
            i = where.get((*module, name))
            if i is None:
                raise ValueError(f"backward_input: the parameter {name!r} a weight-gradient "
                                 f"tap at {'/'.join(map(str, _path(path)))} covers is not "
                                 "beside it in params; pass the tap state and the "
                                 "parameters as one tree (as the module's state).")
            covered[i] = (s, name)
    return covered


def _zeros_like(x) -> Any:
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return np.zeros(x.shape, jax.dtypes.float0)
    return jnp.zeros_like(x)  # x's sharding and varying axes


def _site_taps(site: _Site, lead: tuple, inner: tuple) -> tuple[Any, tuple]:
    """The zeros of one op's ``"input"`` tap and its layout: per leaf of its packed
    ``wres`` (local shape ``S``), ``[*lead, blocks, *S]`` with ``blocks`` one per device
    of the inner mesh axes it varies over (the layout), varying over the enclosing
    manual axes it varies over. An integer leaf (group sizes) travels as float32 (a
    cotangent; exact below 2**24), its dtype in the layout."""
    mesh = jax.sharding.get_abstract_mesh()
    leaves, treedef = jax.tree.flatten(site.avals)
    arrays, layout = [], []
    for aval, axes in zip(leaves, jax.tree.leaves(
            site.varying, is_leaf=lambda v: isinstance(v, frozenset)), strict=True):
        mine = tuple(a for a in inner if a in axes)
        blocks = int(np.prod([mesh.shape[a] for a in mine]))
        exact = jnp.issubdtype(aval.dtype, jnp.inexact)
        z = jnp.zeros((*lead, blocks, *aval.shape), aval.dtype if exact else jnp.float32)
        z = reshard(z, P(*(None,) * len(lead), mine or None), mesh)
        arrays.append(vary(z, frozenset(axes) - set(inner)))
        layout.append((mine, None if exact else jnp.dtype(aval.dtype)))
    return jax.tree.unflatten(treedef, arrays), tuple(layout)


def _record(fn, x, args, flat, treedef, slots) -> dict[int, Taps]:
    """The abstract pass: every slot's ``"input"`` taps (zeros shaped like its ops'
    ``wres``, with their leading layer dimensions and per-device blocks)."""
    recorder = _Recorder()
    values = {s: Taps("record", (), (), flat[s][1], (recorder, s)) for s in slots}
    jax.eval_shape(lambda p: fn(p, x, *args), _with(treedef, flat, values))
    where = {_path(p): i for i, (p, _) in enumerate(flat)}
    taps = {}
    for s in slots:
        path, slot = flat[s]
        sites = recorder.sites.get(s)
        if not sites or s not in recorder.axes:
            raise ValueError(f"backward_input: the layer of the weight-gradient tap at "
                             f"{'/'.join(map(str, _path(path)))} ran no deferring op in fn.")
        first = flat[where[(*_path(path)[:-1], slot.covers[0])]][1]
        lead = tuple(first.shape[:first.ndim - sites[0].kernel_ndim])
        built = [_site_taps(sites[i], lead, recorder.axes[s]) for i in range(len(sites))]
        taps[s] = Taps("input", tuple(a for a, _ in built), tuple(lo for _, lo in built),
                       slot)
    return taps


@dataclasses.dataclass(frozen=True)
class _Input:
    """The abstract value of ``fn``'s input (shape, dtype, sharding spec, varying mesh
    axes): the W pass runs ``fn`` on zeros of it."""

    shape: tuple
    dtype: Any
    spec: Any
    varying: frozenset

    @classmethod
    def of(cls, x) -> _Input:
        spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
        return cls(tuple(x.shape), jnp.dtype(x.dtype), spec, vma(x))

    def zeros(self) -> jax.Array:
        z = jnp.zeros(self.shape, self.dtype)
        mesh = jax.sharding.get_abstract_mesh()
        if self.spec is not None and not mesh.empty:
            z = reshard(z, self.spec, mesh)
        return vary(z, self.varying)


@jax.tree_util.register_pytree_node_class
class WeightGradResiduals:
    """What :func:`backward_input` hands out for :func:`backward_weight`: ``sites``, per
    tap, per op, its packed ``wres`` (arrays only), with static data (the layout of each
    leaf's per-device blocks, the abstract value of ``fn``'s input). Store it as any
    pytree (``jax.tree.map`` keeps the static data)."""

    def __init__(self, sites: tuple, layouts: tuple, inputs: Any):
        self.sites, self.layouts, self.inputs = sites, layouts, inputs

    def tree_flatten(self):
        return (self.sites,), (self.layouts, self.inputs)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)


def backward_input(fn: Callable[..., Any], params: Any, x: Any, gy: Any, *args: Any
                   ) -> tuple[Any, Any, WeightGradResiduals]:
    """The input-gradient pass (B) of ``fn(params, x, *args)`` (e.g. a pipeline chunk):
    ``(dx, dparams_now, wres)``.

    ``params`` holds the weight-gradient taps of its layers (their
    :class:`~sp_jax.layers.WeightGradTap` state, :class:`TapSlot` values, beside the
    parameters they cover: one tree, as the module's state). The deferring ops run
    their input-gradient part only: ``dparams_now`` (shaped like ``params``, the taps
    as they are) holds the gradients of every parameter whose op does not defer (norm
    scales, embeddings, routers) and zeros for those the taps cover (the kernels, biases
    and amax histories of the linear and expert GEMMs); ``wres`` is a
    :class:`WeightGradResiduals` of arrays (per op: the GEMM operand and the output
    gradient as the weight-gradient GEMM takes them, the GEMM's context; stacked on the
    leading layer dimensions of a scanned stack), to keep until
    :func:`backward_weight`. ``gy`` is the cotangent of ``fn``'s output (``(gy, gaux)``
    when it returns ``(y, aux)``, as :func:`jax.vjp` takes it).

    ``fn`` is traced twice (once abstractly, to find the shapes of ``wres``); each
    layer with a tap runs once in it.
    """
    flat, treedef, slots = _slots(params)
    _covered(flat, slots)
    taps = _record(fn, x, args, flat, treedef, slots)
    _, pullback = jax.vjp(lambda p, x: fn(p, x, *args), _with(treedef, flat, taps), x)
    dparams, dx = pullback(gy)
    grads = _by_path(dparams)
    now = jax.tree.unflatten(treedef, [v if _is_slot(v) else grads[_path(p)]
                                       for p, v in flat])
    return dx, now, WeightGradResiduals(
        tuple(grads[_path(flat[s][0])].sites for s in slots),
        tuple(taps[s].layout for s in slots),
        jax.tree.map(_Input.of, x))


def _by_path(tree) -> dict:
    """Leaf (or :class:`Taps`) by path."""
    flat = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda v: isinstance(v, Taps))[0]
    return {_path(p): v for p, v in flat}


def backward_weight(fn: Callable[..., Any], params: Any, wres: WeightGradResiduals,
                    *args: Any) -> Any:
    """The weight-gradient pass (W) of ``fn(params, x, *args)`` from the ``wres`` of
    :func:`backward_input` (with the same ``params`` and ``args``): ``dparams_later``,
    shaped like ``params``, the gradients of the parameters the taps cover (zeros
    elsewhere), so that ``dparams_now + dparams_later`` are ``jax.vjp``'s parameter
    gradients. Runs the deferring ops' weight-gradient parts (with FSDP's reduce-scatter)
    and nothing else: ``fn`` is differentiated with its ops in W mode, every other
    computation dead code."""
    flat, treedef, slots = _slots(params)
    covered = _covered(flat, slots)
    if len(wres.sites) != len(slots):
        raise ValueError(f"backward_weight: wres holds {len(wres.sites)} taps, params "
                         f"{len(slots)}; pass backward_input's wres with the same params.")
    values = {s: Taps("weight", sites, layout, flat[s][1])
              for s, sites, layout in zip(slots, wres.sites, wres.layouts, strict=True)}
    x = jax.tree.map(lambda i: i.zeros(), wres.inputs,
                     is_leaf=lambda v: isinstance(v, _Input))
    y, pullback = jax.vjp(lambda p: fn(p, x, *args), _with(treedef, flat, values))
    grads = _by_path(pullback(jax.tree.map(_zeros_like, y))[0])
    return jax.tree.unflatten(treedef, [
        v if _is_slot(v) else grads[_path(p)] if i in covered else _zeros_like(v)
        for i, (p, v) in enumerate(flat)])

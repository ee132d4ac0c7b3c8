"""The building blocks of every op: varying-manual-axes typing, tiled collectives, and
the factory of conjugate collective pairs.

Typing (``check_vma=True``, the :func:`jax.shard_map` default): a custom VJP must return
cotangents with exactly the varying-manual-axes (VMA) type of its primal inputs. The
public ops therefore settle the types *before* a custom VJP is entered: replicated
parameters are cast to vary like the activations (``lax.pcast(..., to="varying")``),
whose transpose is the ``psum`` that sums the data-parallel weight gradients. The ops are
equally correct with ``check_vma=False``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.mesh import mesh_platform

try:  # public from the jax release that exports it; the primitive has existed since 0.6
    _all_gather_invariant = lax.all_gather_invariant  # type: ignore[attr-defined]
except AttributeError:  # pragma: no cover - depends on the installed jax
    from jax._src.lax.parallel import all_gather_invariant as _all_gather_invariant

__all__ = ["AxisName", "all_gather", "all_gather_invariant", "canonical_dim",
           "check_divisible", "conjugate_pair", "cotangent_barrier", "fresh_zeros",
           "host_moves_real", "reduce_in",
           "reduce_scatter", "residuals_to_device", "residuals_to_host", "split",
           "tied_host_moves", "to_device", "to_host", "vary", "vary_then", "vma"]

AxisName = Hashable


def _is_tree(x: Any) -> bool:
    """Whether ``x`` is a pytree of arrays rather than one (an adapted layer's
    ``LoRAKernel``, a quantized kernel)."""
    return isinstance(x, tuple) or dataclasses.is_dataclass(x)


def vma(x: jax.Array) -> frozenset:
    """The mesh axes ``x`` varies over (empty outside ``check_vma`` shard_maps); of a
    pytree of arrays (an adapted layer's kernel, :class:`~sp_jax.ops.lora.LoRAKernel`),
    the axes any leaf varies over."""
    if _is_tree(x):
        return frozenset().union(*(vma(v) for v in jax.tree.leaves(x)))
    mat = getattr(jax.typeof(x), "mat", None)
    return frozenset(mat.varying) if mat is not None else frozenset()


def typed(axes) -> bool:
    """Whether the shard_map over ``axes`` types its values (``check_vma=True``): only
    then does a cast to vary over them show in the type (without typing ``lax.pcast`` is
    no-op, and so is its transpose, where with typing the transpose is a ``psum``). The
    cast of a constant scalar is dead code to XLA."""
    axes = tuple(axes)
    return bool(axes) and bool(vma(lax.pcast(jnp.zeros((), jnp.float32), axes, to="varying")))


def vary(x, axes) -> jax.Array:
    """Casts ``x`` to vary over ``axes`` (no-op for axes it already varies over; None
    stays None)."""
    if x is None:
        return None
    if _is_tree(x):  # a pytree of arrays: each leaf where it does not already
        return jax.tree.map(lambda v: vary(v, axes), x)
    missing = tuple(sorted(set(axes) - vma(x), key=str))
    return lax.pcast(x, missing, to="varying") if missing else x


def fresh_zeros(shape, dtype, like: jax.Array) -> jax.Array:
    """Zeros of ``shape`` and ``dtype`` computed from ``like`` (its first element), so they
    exist only once ``like`` does and belong to the op that makes them: the start of an
    accumulator or of a buffer chunks are written into.

    ``jnp.zeros`` is a constant: XLA merges (CSE) the equal constants of every layer into
    one buffer and keeps it alive from the first layer's use to the last one's (measured:
    the attention backward's fp32 accumulators and collective matmul's assembly buffers,
    each held across the whole program). Exact zeros whatever ``like`` holds (NaN and
    infinities included); varies over the mesh axes ``like`` varies over. Constant to
    autodiff: no cotangent flows back to ``like`` (a buffer's cotangent, e.g. that of the
    receive buffer of a ragged all-to-all, is never formed and summed to zero)."""
    seed = lax.stop_gradient(
        lax.reshape(lax.slice(like, (0,) * like.ndim, (1,) * like.ndim), ()))
    zero = jnp.where(jnp.isfinite(seed), jnp.abs(seed * 0), 0).astype(dtype)
    return jnp.broadcast_to(zero, tuple(shape))


def canonical_dim(dim: int, ndim: int, name: str) -> int:
    """``dim`` of an array of rank ``ndim`` as a non-negative index; a ValueError naming
    ``name`` when it is out of range."""
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for an array of rank {ndim}.")
    return dim % ndim


def check_divisible(x: jax.Array, dim: int, axis_name: AxisName, what: str) -> None:
    """A ValueError naming ``what`` unless ``x.shape[dim]`` splits over ``axis_name``."""
    size = lax.axis_size(axis_name)
    if x.shape[dim] % size:
        raise ValueError(
            f"{what}: dimension {dim} of the local array {x.shape} has size {x.shape[dim]}, "
            f"which is not divisible by the size {size} of mesh axis {axis_name!r}."
        )


def split(x: jax.Array, axis_name: AxisName, dim: int) -> jax.Array:
    """This device's chunk of ``x`` along ``dim`` (chunk ``axis_index`` of ``axis_size``)."""
    chunk = x.shape[dim] // lax.axis_size(axis_name)
    start = lax.axis_index(axis_name) * chunk
    return lax.dynamic_slice_in_dim(x, start, chunk, axis=dim)


def all_gather(x: jax.Array, axis_name: AxisName, dim: int) -> jax.Array:
    """Tiled all-gather along ``dim``; the result varies over ``axis_name``."""
    return lax.all_gather(x, axis_name, axis=dim, tiled=True)


def all_gather_invariant(x: jax.Array, axis_name: AxisName, dim: int) -> jax.Array:
    """Tiled all-gather along ``dim``; the result is invariant over ``axis_name``."""
    return _all_gather_invariant(x, axis_name, axis=dim, tiled=True)


def reduce_scatter(x: jax.Array, axis_name: AxisName, dim: int) -> jax.Array:
    """Tiled reduce-scatter (``psum_scatter``) along ``dim``."""
    return lax.psum_scatter(x, axis_name, scatter_dimension=dim, tiled=True)


def reduce_in(x: jax.Array, axes: tuple[str, ...], dtype, scatter_dim: int | None = None
              ) -> jax.Array:
    """The sum of ``x`` over the manual mesh ``axes`` (``psum``, or with ``scatter_dim`` a
    tiled ``psum_scatter`` on that dimension), the collective carrying ``x`` cast to
    ``dtype`` (None: ``x``'s), the result cast back to ``x``'s dtype (a low-precision gradient
    reduction: ``ParallelConfig.grad_reduce_dtype``).

    Called where other mesh axes are still explicit (a ``shard_map`` manual over some
    axes), the collective runs on each device's block in a ``shard_map`` over those
    axes: a bf16 ``psum`` lowered with them explicit keeps a sharding constraint in its
    reduction computation, on which XLA:CPU's AllReducePromotion aborts ("Invalid binary
    instruction opcode copy", measured with jax 0.10). XLA:CPU then still sums bf16 in
    fp32 (it promotes bf16 all-reduces), each device's input rounded to bf16; GPUs reduce
    bf16 as they are.
    """
    mesh = jax.sharding.get_abstract_mesh()
    explicit = {a for a, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
                if t != jax.sharding.AxisType.Manual}

    def collective(b: jax.Array) -> jax.Array:
        if scatter_dim is None:
            return lax.psum(b, axes)
        return lax.psum_scatter(b, axes, scatter_dimension=scatter_dim, tiled=True)

    low = x if dtype is None else x.astype(dtype)
    if explicit:
        spec = jax.typeof(low).sharding.spec
        low = jax.shard_map(collective, in_specs=spec, out_specs=spec,
                            axis_names=explicit)(low)
    else:
        low = collective(low)
    return low.astype(x.dtype)


def conjugate_pair(forward: Callable, backward: Callable) -> Callable:
    """A custom-VJP op ``op(x, axis_name, dim)`` running ``forward`` and, for its VJP,
    ``backward(g, axis_name, dim)``."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
    def op(x, axis_name, dim):
        return forward(x, axis_name, dim)

    op.defvjp(
        lambda x, axis_name, dim: (forward(x, axis_name, dim), None),
        lambda axis_name, dim, _, g: (backward(g, axis_name, dim),),
    )
    return op


def vary_then(f: Callable) -> Callable:
    """``f(g, axis_name, dim)`` applied after casting ``g`` to vary over ``axis_name``."""
    return lambda g, axis_name, dim: f(vary(g, (axis_name,)), axis_name, dim)


def to_host(tree, enabled: bool = True):
    """The arrays of ``tree`` placed in the host's ``pinned_host`` memory
    (``jax.memory.Space.Host``; unchanged without ``enabled``): a custom-VJP forward rule
    parks its residuals there (``ParallelConfig.offload_activations``). Works on local
    blocks inside ``shard_map``, ``lax.scan`` and ``jax.checkpoint``; on GPU the HLO
    then holds them in host memory space ``S(5)``. (XLA:CPU lowers the move to a no-op:
    the values are the same either way.)"""
    if not enabled:
        return tree
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), tree)


def to_device(tree, enabled: bool = True):
    """The arrays of ``tree`` back in device memory (:func:`to_host`'s inverse, in the
    backward rule)."""
    if not enabled:
        return tree
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


_TIED_HOST_MOVES = contextvars.ContextVar("sp_jax_tied_host_moves", default=False)


@contextlib.contextmanager
def tied_host_moves():
    """Within it (at trace time), :func:`residuals_to_host` ties each move to the op's
    output: the layers of an unrolled stack (``GPTConfig(scan_layers=False)``) trace
    their forward passes in it. Outside it (a layer scan, a pipeline's ticks) the moves
    are left untied: a scan writes each layer's residuals into its stacked host buffer
    within the layer's iteration, and XLA:GPU's host offloader rejects such a buffer
    written through an optimization barrier (an INTERNAL error, measured)."""
    token = _TIED_HOST_MOVES.set(True)
    try:
        yield
    finally:
        _TIED_HOST_MOVES.reset(token)


def host_moves_real() -> bool:
    """Whether the host moves of the current mesh's platform are real (at trace time):
    XLA:CPU lowers them to nothing, and without the ties below, or another form of the
    layers chosen for the moves' sake (a pipeline stage's layers unrolled), its programs
    (and their bits) stay those of a run without the option."""
    return mesh_platform() != "cpu"


def residuals_to_host(res, y, enabled: bool = True) -> tuple[Any, Any]:
    """``(res, y)``: a forward rule's residuals ``res`` moved to host memory
    (:func:`to_host`; both unchanged without ``enabled``), within
    :func:`tied_host_moves` the moves done before its output ``y`` is used (an
    optimization barrier ties them, where the moves are real). Untied outside a scan,
    XLA:GPU's scheduler starts each move as late as it can, just before the backward
    pass brings the value back, so the device copy stays alive through the forward
    pass and nothing is saved (measured, deviceless 8 x H100: an unrolled stack of
    blocks kept every residual on the device)."""
    if not enabled:
        return res, y
    if _TIED_HOST_MOVES.get() and host_moves_real():
        return lax.optimization_barrier((to_host(res), y))
    return to_host(res), y


def residuals_to_device(res, g, enabled: bool = True) -> tuple[Any, Any]:
    """``(res, g)``: a backward rule's residuals ``res`` that :func:`to_host` parked in
    host memory, back in device memory once the cotangent ``g`` exists (an optimization
    barrier ties the host values to ``g`` before the move where the moves are real; both
    unchanged without ``enabled``). Without the tie XLA:GPU's algebraic simplifier folds
    a move to the host followed directly by the move back into nothing (measured,
    deviceless 8 x H100: an unrolled stack of blocks moved 0 bytes; a scanned one's
    moves survive only because the scan stacks its residuals in a host buffer), and the
    move back may be scheduled before the backward pass reaches the layer."""
    if not enabled:
        return res, g
    if host_moves_real():
        res, g = lax.optimization_barrier((res, g))
    return to_device(res), g


@jax.custom_vjp
def _cotangent_barrier(x):
    return x


def _cotangent_barrier_fwd(x):
    return x, None


def _cotangent_barrier_bwd(_, g):
    return (lax.optimization_barrier(g),)


_cotangent_barrier.defvjp(_cotangent_barrier_fwd, _cotangent_barrier_bwd)


def cotangent_barrier(x, enabled: bool = True):
    """``x`` unchanged; in the backward pass its cotangent goes through an optimization
    barrier where the host moves are real (not XLA:CPU; nothing without ``enabled``):
    it is materialised there, and what reads it below reads that buffer. An unrolled
    stack's residual-stream gradient is a sum of every layer's norm input gradients;
    without the barrier XLA:GPU fuses the chain of adds into each of its consumers, each
    fusion reading all the layers' norm gradients again, so every one of them lives to
    the end of the backward pass (measured, deviceless 8 x H100, h=256, s=1024, t=8:
    2 x [s / t, h] bf16 per layer, 0.125 of the 0.150 MiB per layer that stayed on the
    device with ``offload_activations``)."""
    if not enabled or not host_moves_real():
        return x
    return _cotangent_barrier(x)

"""Collectives between the sequence-parallel and tensor-parallel regions, each paired with
its VJP (Megatron's ``mappings.py``).

Every function works on the *local* (per-device) block of an array, inside
:func:`jax.shard_map` over a mesh that has ``axis_name``, and is one small custom VJP: a
forward collective and its conjugate backward collective. Each name says both:
``<forward>_with_<backward>_grad``.

=======================================  ==============  ==============  ===============
function                                 forward         backward        Megatron
=======================================  ==============  ==============  ===============
``split_with_all_gather_grad``           keep own chunk  all-gather      ``scatter_to``
``all_gather_with_split_grad``           all-gather      keep own chunk  ``gather_from``
                                                                         (no reduction)
``all_gather_with_reduce_scatter_grad``  all-gather      reduce-scatter  ``gather_from``
``reduce_scatter_with_all_gather_grad``  reduce-scatter  all-gather      ``reduce_scatter_to``
``identity_with_all_reduce_grad``        identity        all-reduce      ``copy_to``
``all_reduce_with_identity_grad``        all-reduce      identity        ``reduce_from``
=======================================  ==============  ==============  ===============

(Megatron's ``*_sequence_parallel_region`` / ``*_tensor_model_parallel_region``
functions; its ``gather_from_sequence_parallel_region`` is either gather, chosen by
``tensor_parallel_output_grad``.) The split and gather functions take any dimension, so
with ``dim=-1`` they double as Megatron's ``scatter_to/gather_from_tensor_model_parallel_region``
over features.
"""

from __future__ import annotations

import jax
from jax import lax

from sp_jax.ops.primitives import (
    AxisName,
    all_gather,
    all_gather_invariant,
    canonical_dim,
    check_divisible,
    conjugate_pair,
    reduce_scatter,
    split,
    vary,
    vary_then,
    vma,
)

__all__ = [
    "all_gather_with_reduce_scatter_grad",
    "all_gather_with_split_grad",
    "all_reduce_with_identity_grad",
    "identity_with_all_reduce_grad",
    "reduce_scatter_with_all_gather_grad",
    "split_with_all_gather_grad",
]


def _tp_dx_all_reduce(g, axis_name, _):
    with jax.named_scope("tp_dx_all_reduce"):  # names show in HLO and profiles
        return lax.psum(vary(g, (axis_name,)), axis_name)


# name                       forward                backward
_split_replicated = conjugate_pair(split, all_gather_invariant)
_split_varying = conjugate_pair(split, all_gather)
_gather_split = conjugate_pair(all_gather_invariant, vary_then(split))
_gather_rs = conjugate_pair(all_gather, vary_then(reduce_scatter))
_rs_gather = conjugate_pair(reduce_scatter, vary_then(all_gather))
_identity = conjugate_pair(lambda x, axis_name, _: vary(x, (axis_name,)), _tp_dx_all_reduce)
_all_reduce = conjugate_pair(lambda x, axis_name, _: lax.psum(x, axis_name),
                             lambda g, axis_name, _: vary(g, (axis_name,)))


def split_with_all_gather_grad(x: jax.Array, axis_name: AxisName, dim: int = 1) -> jax.Array:
    """Keeps this device's chunk of a replicated ``x`` along ``dim``; VJP: all-gather.

    Args:
      x: local array, the same on every device of ``axis_name``; ``x.shape[dim]``
        divisible by the axis size ``t``.
      axis_name: mesh axis to split over.
      dim: dimension to split (the sequence; ``-1``: Megatron's scatter to the tensor
        region).
    Returns:
      ``x`` with ``shape[dim] // t`` along ``dim``, varying over ``axis_name``.
    """
    dim = canonical_dim(dim, x.ndim, "dim")
    check_divisible(x, dim, axis_name, "split_with_all_gather_grad")
    op = _split_varying if axis_name in vma(x) else _split_replicated
    return op(x, axis_name, dim)


def all_gather_with_split_grad(x: jax.Array, axis_name: AxisName, dim: int = 1) -> jax.Array:
    """All-gathers ``x`` along ``dim`` into a replicated array; VJP: keep the local chunk.

    Use it where everything after the gather is computed redundantly on every device
    (the cotangent is then the same everywhere and each device keeps its own chunk), e.g.
    ``ColumnParallelLinear(gather_output=True)``.

    Args:
      x: local shard ``[..., s / t, ...]`` varying over ``axis_name``.
    Returns:
      ``[..., s, ...]``, invariant over ``axis_name``.
    """
    dim = canonical_dim(dim, x.ndim, "dim")
    return _gather_split(vary(x, (axis_name,)), axis_name, dim)


def all_gather_with_reduce_scatter_grad(x: jax.Array, axis_name: AxisName,
                                        dim: int = 1) -> jax.Array:
    """All-gathers ``x`` along ``dim``; VJP: reduce-scatter.

    The entry into a tensor-parallel region from a sequence-parallel one: each device
    then computes with its own weight shard, so the cotangents differ per device and are
    summed and re-split by the reduce-scatter.

    Args:
      x: local shard ``[..., s / t, ...]``.
    Returns:
      ``[..., s, ...]``, varying over ``axis_name``.
    """
    dim = canonical_dim(dim, x.ndim, "dim")
    return _gather_rs(vary(x, (axis_name,)), axis_name, dim)


def reduce_scatter_with_all_gather_grad(x: jax.Array, axis_name: AxisName,
                                        dim: int = 1) -> jax.Array:
    """Sums partial results over ``axis_name`` and keeps this device's chunk along ``dim``;
    VJP: all-gather.

    The exit from a tensor-parallel region into a sequence-parallel one.

    Args:
      x: local partial sums ``[..., s, ...]``, ``s`` divisible by the axis size ``t``.
    Returns:
      ``[..., s / t, ...]`` (the sum over devices, this device's chunk).
    """
    dim = canonical_dim(dim, x.ndim, "dim")
    check_divisible(x, dim, axis_name, "reduce_scatter_with_all_gather_grad")
    return _rs_gather(vary(x, (axis_name,)), axis_name, dim)


def identity_with_all_reduce_grad(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """Identity into a tensor-parallel region; VJP: all-reduce (psum) of the cotangents.

    Args:
      x: local array, replicated over ``axis_name`` (invariant).
      axis_name: the tensor-parallel mesh axis.
    Returns:
      ``x`` unchanged (no copy in the HLO), typed as varying over ``axis_name``.
    """
    if axis_name in vma(x):
        raise TypeError(
            f"identity_with_all_reduce_grad expects an input replicated over {axis_name!r}, "
            f"but it already varies over that axis (type {jax.typeof(x)}). Its VJP would "
            "sum gradients of different values; use all_gather_with_reduce_scatter_grad to "
            "enter the region from sharded activations."
        )
    return _identity(x, axis_name, None)


def all_reduce_with_identity_grad(x: jax.Array, axis_name: AxisName) -> jax.Array:
    """All-reduce (psum) out of a tensor-parallel region; VJP: identity.

    Args:
      x: local partial sums, varying over ``axis_name``.
      axis_name: the tensor-parallel mesh axis.
    Returns:
      The sum over ``axis_name``, invariant over it.
    """
    return _all_reduce(vary(x, (axis_name,)), axis_name, None)

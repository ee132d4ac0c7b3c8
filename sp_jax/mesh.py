"""The mesh a layer runs on: look-up, validation of sizes against it, resharding.

Every parallel layer and model calls these outside its ``shard_map``: :func:`current_mesh`
(the mesh set with ``jax.set_mesh``, checked against a :class:`~sp_jax.ParallelConfig`),
the divisibility and range checks that turn a bad size into a ValueError naming the value
and the fix, :func:`reshard` / :func:`to_sequence_parallel` (placing an input in the
layout a layer expects) and :func:`mesh_platform`.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from sp_jax.config import ParallelConfig
from sp_jax.layout import Layout

__all__ = ["Mesh", "axis_size", "check_activations", "check_batch_and_sequence",
           "check_divisible", "check_int_range", "current_mesh", "host_memory_supported",
           "mesh_platform", "nan_where", "require_host_memory", "reshard", "restrict_spec",
           "spec_axes",
           "to_sequence_parallel", "warn_if_recompute_may_be_merged"]

Mesh = jax.sharding.Mesh | jax.sharding.AbstractMesh


def current_mesh(parallel: ParallelConfig, *, where: str, required: bool = True) -> Mesh | None:
    """The mesh set with ``jax.set_mesh``, checked against ``parallel``'s axis names.

    Returns ``None`` when no mesh is set and ``required`` is false. A ``parallel`` that is
    not a :class:`~sp_jax.ParallelConfig` (e.g. a plain dict) is a TypeError.
    """
    if not isinstance(parallel, ParallelConfig):
        raise TypeError(
            f"{where}: parallel={parallel!r} must be a sp_jax.ParallelConfig (use "
            "ParallelConfig.from_dict for a plain dict)."
        )
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        if not required:
            return None
        raise ValueError(
            f"{where} needs a device mesh, but none is set. Create one with "
            "jax.make_mesh((data, tensor), ('data', 'tensor')) and call the layer inside "
            "`with jax.set_mesh(mesh):`."
        )
    if parallel.offload_activations:
        require_host_memory(f"{where} (ParallelConfig.offload_activations=True)")
    axes = tuple(mesh.axis_names)
    if parallel.tensor_axis not in axes:
        raise ValueError(
            f"{where}: tensor axis {parallel.tensor_axis!r} (ParallelConfig.tensor_axis) is "
            f"not in the mesh axes {axes}; name a mesh axis or build the mesh with it."
        )
    for name in parallel.expert_axes:
        if name not in axes:
            raise ValueError(
                f"{where}: expert axis {name!r} (ParallelConfig.expert_axis) is not in the "
                f"mesh axes {axes}; build the mesh as jax.make_mesh((data, expert, context, "
                f"tensor), ('data', '{name}', 'context', 'tensor')) or pass expert_axis=None.")
    for name in parallel.data_axes:
        if name not in axes:
            raise ValueError(
                f"{where}: data axis {name!r} (ParallelConfig.data_axis) is not in the mesh "
                f"axes {axes}; pass ParallelConfig(data_axis=None) to replicate the batch, "
                "or name one of the mesh axes."
            )
    for name in parallel.context_axes:
        if name not in axes:
            raise ValueError(
                f"{where}: context axis {name!r} (ParallelConfig.context_axis, with "
                f"context_parallel={parallel.context_parallel!r}) is not in the mesh axes "
                f"{axes}; build the mesh as jax.make_mesh((data, context, tensor), ('data', "
                f"'{name}', 'tensor')) or pass context_parallel=None."
            )
    if parallel.pipeline_axis is not None and parallel.pipeline_axis not in axes:
        raise ValueError(
            f"{where}: pipeline axis {parallel.pipeline_axis!r} (ParallelConfig."
            f"pipeline_axis) is not in the mesh axes {axes}; build the mesh as "
            f"jax.make_mesh((stage, data, context, tensor), ('{parallel.pipeline_axis}', "
            "'data', 'context', 'tensor')) or pass pipeline_axis=None.")
    return mesh


def axis_size(mesh: Mesh, axes: str | tuple[str, ...]) -> int:
    """Product of the sizes of mesh ``axes`` (1 for an empty tuple)."""
    names = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[name] for name in names)


def check_divisible(where: str, what: str, size: int, mesh: Mesh, axes, fix: str) -> None:
    """Raises a ValueError when ``size`` does not split evenly over mesh ``axes``."""
    n = axis_size(mesh, axes)
    if size % n:
        raise ValueError(
            f"{where}: {what}={size} is not divisible by the size {n} of mesh axis "
            f"{axes!r}; {fix}."
        )


def check_activations(where: str, x: Any, size: int, what: str, *,
                      fix: bool = True) -> None:
    """Raises a ValueError unless ``x`` has shape ``[batch, seq, size]``: the rank and
    hidden-size check of every layer that takes activations.

    Shapes are static, so it runs at trace time and costs nothing at run time. ``where``
    (the layer's name) starts the message; ``what`` names the argument or field that set
    ``size`` (``in_features``, ``num_features``, ``hidden``); ``fix`` appends how to
    resolve a size mismatch (the linear layers' message, docs/errors.md E13, has none).
    """
    shape = tuple(x.shape)
    if len(shape) != 3:
        raise ValueError(
            f"{where} expects input of shape [batch, seq, {size}], got rank {len(shape)} "
            f"shape {shape}; reshape to [batch, seq, features]."
        )
    if shape[-1] != size:
        hint = (f"; pass [batch, seq, {size}] activations, or build the layer with "
                f"{what}={shape[-1]}" if fix else "")
        raise ValueError(
            f"{where}: input feature size {shape[-1]} (shape {shape}) does not match "
            f"{what}={size}{hint}."
        )


def check_batch_and_sequence(where: str, mesh: Mesh, parallel: ParallelConfig, batch: int,
                             seq: int | None = None, *, length: int | None = None) -> None:
    """The batch must split over the data axes, ``seq`` (the sequence of an SP layout) over
    the context and tensor axes, and ``length`` (a sequence outside SP regions) over the
    context axis; raises a ValueError naming the size and the fix otherwise."""
    if parallel.data_axes:
        check_divisible(
            where, "batch size", batch, mesh, parallel.data_axes,
            "use a batch that is a multiple of the data-parallel size or "
            "ParallelConfig(data_axis=None)",
        )
    if seq is not None:
        axes = (*parallel.context_axes, parallel.tensor_axis)
        check_divisible(
            where, "sequence length", seq, mesh, axes if len(axes) > 1 else axes[0],
            "pad the sequence to a multiple of the tensor-parallel size"
            + (" times the context-parallel size" if parallel.context_axes else ""),
        )
    if length is not None and parallel.context_axes:
        check_divisible(
            where, "sequence length", length, mesh, parallel.context_axes,
            "pad the sequence to a multiple of the context-parallel size",
        )


def check_int_range(where: str, what: str, values: Any, low: int, high: int,
                    allowed: tuple[int, ...] = ()) -> None:
    """Raises a ValueError when concrete integer ``values`` fall outside ``[low, high)``
    (``allowed`` values excepted), naming the first offending value and its position.

    Traced values (inside ``jit``) cannot be inspected here; the layers then make the
    affected outputs NaN instead, so the loss is NaN, never silently wrong.
    """
    if isinstance(values, jax.core.Tracer):
        return
    v = np.asarray(values)
    bad = ((v < low) | (v >= high)) & ~np.isin(v, allowed)
    if bad.any():
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        extra = f" (or {', '.join(map(str, allowed))})" if allowed else ""
        raise ValueError(
            f"{where}: {what} {int(v[pos])} at position {pos} is outside [{low}, {high}){extra}; "
            f"{int(bad.sum())} value(s) out of range."
        )


def nan_where(bad: jax.Array) -> jax.Array:
    """0 where ``bad`` is false and NaN where it is true, made without a NaN constant
    (so ``jax_debug_nans`` fires only when a bad value really occurs): the traced side of
    :func:`check_int_range`, added to the outputs a bad value would make wrong, so the
    loss is NaN, never silently wrong."""
    return jnp.sqrt(jnp.where(bad, -1.0, 0.0))


def reshard(x: jax.Array, spec: P, mesh: Mesh) -> jax.Array:
    """Moves ``x`` to ``spec`` on ``mesh``: ``jax.reshard`` on Explicit meshes.

    On Auto meshes the layout is left to ``shard_map``, which reshards its arguments to
    its ``in_specs`` (GSPMD inside ``jit``).
    """
    if any(t == AxisType.Auto for t in mesh.axis_types):
        return x
    # Explicit, or Manual inside a pipeline's shard_map. An array already in ``spec`` is
    # returned as it is: a no-op reshard is still a new value, and a scanned layer's
    # parameter slice that became one was stacked again by the scan as a residual of
    # the backward pass (measured: a copy of every layer's fp32 kernels, 96 MiB per
    # layer and GPU at h=4096, t=8; BENCHMARKS.md "Activations on the host").
    sharding = getattr(jax.typeof(x), "sharding", None)
    have = getattr(sharding, "spec", None)
    if have is not None and _padded(have, x.ndim) == _padded(spec, x.ndim):
        return x
    return jax.reshard(x, spec)


def _padded(spec: P, ndim: int) -> tuple:
    entries = tuple(spec)
    return entries + (None,) * (ndim - len(entries))


def spec_axes(entry: Any, among: Any = None) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry (None: none; a name; a tuple), those
    in ``among`` only when given."""
    names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    return names if among is None else tuple(n for n in names if n in among)


def restrict_spec(spec: P, axes: Any, ndim: int) -> P:
    """``spec`` (of an ``ndim``-dimensional array) with only the mesh ``axes`` kept: the
    spec a ``shard_map`` manual over ``axes`` takes."""
    entries = []
    for entry in (*spec, *([None] * (ndim - len(spec)))):
        kept = spec_axes(entry, axes)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return P(*entries)


def to_sequence_parallel(x: jax.Array, parallel: ParallelConfig, *, where: str) -> jax.Array:
    """Places ``[batch, seq, hidden]`` ``x`` in the SP layout ``P(data, tensor, None)``
    (``P(data, (context, tensor), None)`` with a context axis).

    A sequence (or batch) that does not split evenly is left as it is (GSPMD then
    chooses).
    """
    mesh = current_mesh(parallel, where=where)
    if x.ndim != 3 or x.shape[1] % axis_size(mesh, (*parallel.context_axes, parallel.tensor_axis)):
        return x
    if x.shape[0] % axis_size(mesh, parallel.data_axes):
        return x
    return reshard(x, Layout.of(parallel).sp, mesh)


def mesh_platform() -> str:
    """Platform of the devices of the current mesh (``"cpu"``, ``"gpu"``, ...).

    Deviceless compiles for GPU run on a CPU-only host: the mesh, not the default
    backend, says what the program is compiled for.
    """
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None) if not mesh.empty else None
    platform = getattr(device, "platform", None)
    return platform if platform is not None else jax.default_backend()


def warn_if_recompute_may_be_merged(parallel: ParallelConfig) -> None:
    """Warns when XLA:CPU would merge recompute's re-all-gather with the forward one.

    XLA:CPU's CSE merges the backward re-gather into the forward gather unless the
    ``cse_barrier_expander`` pass is disabled; the result is still correct, but the
    gathered input is then kept alive and ``recompute_allgather`` saves nothing.
    """
    if not parallel.recompute_allgather or mesh_platform() != "cpu":
        return
    if "cse_barrier_expander" in os.environ.get("XLA_FLAGS", ""):
        return
    warnings.warn(
        "recompute_allgather=True on XLA:CPU without "
        "XLA_FLAGS=--xla_disable_hlo_passes=cse_barrier_expander: XLA merges the backward "
        "re-all-gather with the forward one, so no activation memory is saved (results "
        "are unaffected). Set the flag before JAX starts.",
        stacklevel=3,
    )


HOST_MEMORY_PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu")
"""Platforms whose devices have a ``pinned_host`` memory kind (assumed for a mesh of
abstract devices: a deviceless compile)."""


def host_memory_supported(platform: str) -> bool:
    """Whether the devices of ``platform`` have a ``pinned_host`` memory kind: asked of
    the first local device when there is one (``addressable_memories``), else
    :data:`HOST_MEMORY_PLATFORMS` decides (deviceless compiles)."""
    try:
        devices = jax.local_devices(backend=platform)
    except RuntimeError:  # no such backend here: a deviceless compile
        return platform in HOST_MEMORY_PLATFORMS
    kinds = {m.kind for m in devices[0].addressable_memories()} if devices else set()
    return "pinned_host" in kinds


def require_host_memory(where: str) -> str:
    """The platform of the current mesh (:func:`mesh_platform`), or a ValueError naming
    ``where`` and the platform when its devices have no ``pinned_host`` memory (the
    host-offload options park arrays there)."""
    platform = mesh_platform()
    if not host_memory_supported(platform):
        raise ValueError(
            f"{where}: the {platform!r} backend has no 'pinned_host' memory kind to offload "
            "to; run on CPU, GPU or TPU, or turn the offload option off.")
    return platform

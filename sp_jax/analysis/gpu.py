"""Deviceless ahead-of-time compilation for a GPU mesh, on a machine without a GPU.

XLA:GPU compiles from a target description (``GpuTargetConfigProto``) instead of a live
device, so the real GPU pipeline runs here: SPMD partitioning, the latency-hiding
scheduler, async collectives, GPU memory planning. What it produces is the HLO a GPU
cluster would run, and its ``memory_analysis()``.

Requirements: the CUDA PJRT plugin of the installed jax version, without the NVIDIA
runtime libraries (about 180 MB)::

    pip install --no-deps "jax-cuda12-plugin==$JAXVER" "jax-cuda12-pjrt==$JAXVER"
    # or: pip install "sp_jax[gpu-aot]"   (the plugin's CUDA libraries are an extra of it)

and ``JAX_PLATFORMS=cpu`` in the environment before JAX starts (otherwise the plugin
probes for a GPU and is not registered). The target descriptions ship with sp_jax
(``sp_jax/analysis/targets/*.txtpb``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from sp_jax.analysis.hlo import CollectiveStats, collective_stats
from sp_jax.xla_flags import recommended_compiler_options

__all__ = ["GpuCompileReport", "compile_for_gpu", "gpu_mesh", "TARGETS"]

TARGETS = {"h100": "h100_sxm.txtpb"}

# XLA:CPU runs need --xla_disable_hlo_passes=cse_barrier_expander (see
# ParallelConfig.recompute_allgather); the GPU pipeline must run that pass (XLA:GPU cannot
# emit an optimization barrier), so the process-wide setting is cleared for GPU compiles.
_GPU_ONLY_OPTIONS: dict[str, Any] = {"xla_disable_hlo_passes": ""}


def default_compiler_options() -> dict[str, Any]:
    """Options of every GPU compile: sp_jax's recommended XLA GPU flags
    (:func:`sp_jax.xla_flags.recommended_compiler_options`, what a real run would set),
    plus the GPU-only settings above."""
    return {**recommended_compiler_options(), **_GPU_ONLY_OPTIONS}


@functools.cache
def _target_config(target: str) -> str:
    if target not in TARGETS:
        raise ValueError(f"Unknown GPU target {target!r}; known targets: {sorted(TARGETS)}.")
    return resources.files("sp_jax.analysis").joinpath("targets", TARGETS[target]).read_text()


def _check_plugin() -> None:
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        raise RuntimeError(
            "Deviceless GPU compilation needs the CUDA PJRT plugin matching jax "
            f"{jax.__version__}: pip install --no-deps jax-cuda12-plugin=={jax.__version__} "
            f"jax-cuda12-pjrt=={jax.__version__} (or `pip install sp_jax[gpu-aot]`), and "
            "JAX_PLATFORMS=cpu set before JAX starts."
        )


@functools.cache
def _topology(target: str, num_devices: int):
    from jax.experimental import topologies

    _check_plugin()
    try:
        return topologies.get_topology_desc(
            platform="cuda", topology=f"1x1x{num_devices}", target_config=_target_config(target)
        )
    except Exception as e:  # the plugin raises various types when it cannot load
        hint = "" if os.environ.get("JAX_PLATFORMS") == "cpu" else (
            " Set JAX_PLATFORMS=cpu before JAX starts: otherwise the CUDA plugin probes for "
            "a GPU and is not registered."
        )
        raise RuntimeError(
            f"Could not build a {num_devices}-device '{target}' GPU topology: {e}.{hint}"
        ) from e


def gpu_mesh(mesh_shape: Sequence[int], axis_names: Sequence[str], *, target: str = "h100",
             axis_types: AxisType = AxisType.Explicit) -> jax.sharding.Mesh:
    """A mesh over ``prod(mesh_shape)`` abstract GPUs of ``target`` (no GPU needed)."""
    mesh_shape, axis_names = tuple(mesh_shape), tuple(axis_names)
    _target_config(target)  # unknown targets fail here, before the plugin is involved
    if len(mesh_shape) != len(axis_names):
        raise ValueError(f"mesh_shape {mesh_shape} and axis_names {axis_names} differ in length.")
    n = 1
    for s in mesh_shape:
        n *= s
    devices = _topology(target, n).devices
    import numpy as np

    return jax.sharding.Mesh(np.asarray(devices).reshape(mesh_shape), axis_names,
                             axis_types=(axis_types,) * len(axis_names))


@dataclasses.dataclass
class GpuCompileReport:
    """What one deviceless GPU compile tells.

    Attributes:
      compiled: the ``jax.stages.Compiled`` executable (not runnable here).
      hlo: its optimized HLO text.
      argument_bytes / output_bytes / temp_bytes / alias_bytes: per-device
        ``memory_analysis()`` figures.
      peak_bytes: per-device peak, ``temp + arguments + outputs - aliased``.
      collectives: :class:`~sp_jax.analysis.CollectiveStats` of the HLO.
    """

    compiled: Any
    hlo: str
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    peak_bytes: int
    collectives: CollectiveStats

    def as_dict(self) -> dict[str, Any]:
        return {
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "temp_bytes": self.temp_bytes,
            "alias_bytes": self.alias_bytes,
            "peak_bytes": self.peak_bytes,
            "collectives": dataclasses.asdict(self.collectives),
        }


def _abstract(x: Any, mesh: jax.sharding.Mesh) -> Any:
    """A ShapeDtypeStruct on ``mesh`` for an array / ShapeDtypeStruct leaf."""
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, NamedSharding):
        spec = sharding.spec
    elif isinstance(sharding, PartitionSpec):
        spec = sharding
    else:
        spec = PartitionSpec()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))


def compile_for_gpu(
    fn: Callable[..., Any],
    *args: Any,
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    target: str = "h100",
    axis_types: AxisType = AxisType.Explicit,
    compiler_options: dict[str, Any] | None = None,
) -> GpuCompileReport:
    """Compiles ``jax.jit(fn)(*args)`` for a ``mesh_shape`` mesh of ``target`` GPUs.

    ``args`` are pytrees of arrays or ``jax.ShapeDtypeStruct`` s; each leaf keeps the
    ``PartitionSpec`` of its sharding (a ``NamedSharding`` on any mesh, or a bare
    ``PartitionSpec``), re-targeted to the GPU mesh; leaves without one are replicated.
    ``fn`` is traced under ``jax.set_mesh`` of the GPU mesh, so sp_jax layers called in it
    shard over it. The compile uses sp_jax's recommended XLA GPU flags
    (:func:`default_compiler_options`); ``compiler_options`` adds to or overrides them.

    Returns:
      a :class:`GpuCompileReport` (per-device peak memory and collective statistics).
    """
    mesh = gpu_mesh(mesh_shape, axis_names, target=target, axis_types=axis_types)
    options = {**default_compiler_options(), **(compiler_options or {})}
    with jax.set_mesh(mesh):
        abstract_args = jax.tree.map(lambda x: _abstract(x, mesh), args)
        compiled = jax.jit(fn).lower(*abstract_args).compile(compiler_options=options)
    mem = compiled.memory_analysis()
    arg, out = int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes)
    temp, alias = int(mem.temp_size_in_bytes), int(mem.alias_size_in_bytes)
    hlo = compiled.as_text()
    return GpuCompileReport(
        compiled=compiled, hlo=hlo, argument_bytes=arg, output_bytes=out, temp_bytes=temp,
        alias_bytes=alias, peak_bytes=temp + arg + out - alias,
        collectives=collective_stats(hlo),
    )

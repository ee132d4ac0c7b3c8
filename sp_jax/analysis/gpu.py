"""Deviceless ahead-of-time compilation for a GPU mesh, on a machine without a GPU.

XLA:GPU compiles from a target description (``GpuTargetConfigProto``) instead of a live
device, so the real GPU pipeline runs here: SPMD partitioning, the latency-hiding
scheduler, async collectives, GPU memory planning. What it produces is the HLO a GPU
cluster would run, and its ``memory_analysis()``.

Requirements: the CUDA PJRT plugin of the installed jax version, without the NVIDIA
runtime libraries (about 180 MB)::

    pip install --no-deps "jax-cuda12-plugin==$JAXVER" "jax-cuda12-pjrt==$JAXVER"
    # or, in a clone of sp_jax: pip install ".[gpu-aot]"  (its CUDA libraries: the plugin's extra)

and ``JAX_PLATFORMS=cpu`` in the environment before JAX starts (otherwise the plugin
probes for a GPU and is not registered). The target descriptions ship with sp_jax
(``sp_jax/analysis/targets/*.txtpb``).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import importlib.util
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from sp_jax.analysis.hlo import CollectiveStats, collective_stats
from sp_jax.xla_flags import recommended_compiler_options

__all__ = [
    "GpuCompileReport",
    "LiveBuffer",
    "PeakBreakdown",
    "TARGETS",
    "compile_for_gpu",
    "cuda_plugin_available",
    "default_compiler_options",
    "gpu_mesh",
    "peak_breakdown",
]

TARGETS = {"h100": "h100_sxm.txtpb"}

# XLA:CPU runs need --xla_disable_hlo_passes=cse_barrier_expander (see
# ParallelConfig.recompute_allgather); the GPU pipeline must run that pass (XLA:GPU cannot
# emit an optimization barrier), so the process-wide setting is cleared for GPU compiles.
# Deviceless compiles cannot size the scratch of CUB's radix sort (it asks the CUDA
# runtime; "Error loading CUDA libraries"): XLA's own sort kernel instead (the sorts of
# the mixture-of-experts dispatch).
_GPU_ONLY_OPTIONS: dict[str, Any] = {"xla_disable_hlo_passes": "",
                                     "xla_gpu_enable_cub_radix_sort": False}


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


def cuda_plugin_available() -> bool:
    """Whether the CUDA PJRT plugin (``jax_plugins.xla_cuda12``) is installed."""
    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def _check_plugin() -> None:
    if not cuda_plugin_available():
        raise RuntimeError(
            "Deviceless GPU compilation needs the CUDA PJRT plugin matching jax "
            f"{jax.__version__}: pip install --no-deps jax-cuda12-plugin=={jax.__version__} "
            f"jax-cuda12-pjrt=={jax.__version__} (or `pip install '.[gpu-aot]'` in a clone of "
            "sp_jax), and JAX_PLATFORMS=cpu set before JAX starts."
        )


@functools.cache
def _topology(target: str, num_devices: int):
    from jax.experimental import topologies

    _check_plugin()
    # one host of up to 8 GPUs; more: hosts of 8 (as real clusters are built)
    hosts, per_host = (num_devices // 8, 8) if num_devices > 8 and num_devices % 8 == 0 \
        else (1, num_devices)
    try:
        return topologies.get_topology_desc(
            platform="cuda", topology=f"1x{hosts}x{per_host}",
            target_config=_target_config(target)
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


@dataclasses.dataclass(frozen=True)
class LiveBuffer:
    """One buffer of a compiled program and when it is live (XLA's live-range analysis).

    Attributes:
      name: the HLO value, ``instruction{tuple index}`` (e.g. ``all-gather-start.3{1}``).
      shape: its HLO shape, e.g. ``bf16[2048,4096]``.
      bytes: its size per device.
      start / end: first and last position in the program's instruction sequence at which
        it is live.
      op_name: the JAX ``op_name`` of the instruction that produced it (``jvp(...)``:
        forward, ``transpose(jvp(...))``: backward); empty if XLA made it.
    """

    name: str
    shape: str
    bytes: int
    start: int
    end: int
    op_name: str

    @property
    def backward(self) -> bool:
        """Produced by the backward pass."""
        return "transpose(" in self.op_name


@dataclasses.dataclass(frozen=True)
class PeakBreakdown:
    """What is live at the peak of a compiled program (XLA's buffer live-range analysis).

    Attributes:
      peak_bytes: the largest sum of simultaneously live buffers, per device (the
        allocator's peak in ``memory_analysis()`` also counts fragmentation).
      entries: ``(name, bytes)`` of the top-level groups of those buffers, largest first:
        ``params`` / argument names, or the JAX ``op_name`` of the instruction that
        produced a buffer (``jvp()`` = forward, ``transpose(jvp())`` = backward).
      peak_position: the position of the peak in the instruction sequence.
      buffers: every buffer with its live range (:class:`LiveBuffer`), when the HLO
        text was given to :func:`peak_breakdown`; else empty.
    """

    peak_bytes: int
    entries: list[tuple[str, int]]
    peak_position: int = -1
    buffers: tuple[LiveBuffer, ...] = ()

    def live_at(self, position: int) -> list[LiveBuffer]:
        """The buffers live at ``position`` of the instruction sequence."""
        return [b for b in self.buffers if b.start <= position <= b.end]

    def as_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "entries": [list(e) for e in self.entries],
                "peak_position": self.peak_position}


_PEAK = re.compile(r"Stack trace breakdown for peak usage:\s*(?P<total>[\d ]+) bytes")
_ENTRY = re.compile(r"^(?P<indent>[\s│]*)[├└]── (?P<name>.+?) \([\d.]+%, total: "
                    r"(?P<total>[\d ]+) bytes")
_PEAK_AT = re.compile(r"Live ranges at (\d+) \(peak\)")
_RANGE = re.compile(r"^\s+(?P<name>[\w.\-]+)(?P<index>\{[\d,]*\}):(?P<start>\d+)-(?P<end>\d+)$",
                    re.M)
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>.*?) [\w\-]+\(")
_SHAPE = re.compile(r"(?:pred|[a-z]+\d+)\[[\d,]*\]")


def _definitions(hlo: str) -> dict[str, tuple[list[str], str]]:
    """instruction name -> (the array shapes of its result, flattened; its op_name)."""
    out = {}
    for line in hlo.splitlines():
        m = _DEF.match(line)
        if m:
            op = re.search(r'op_name="([^"]*)"', line)
            out[m.group("name")] = (_SHAPE.findall(m.group("shape")),
                                    op.group(1) if op else "")
    return out


def _live_buffers(live_range_text: str, hlo: str) -> tuple[LiveBuffer, ...]:
    from sp_jax.analysis.hlo import array_bytes

    defs = _definitions(hlo)
    out = []
    for m in _RANGE.finditer(live_range_text):
        name, index = m.group("name"), m.group("index").strip("{}")
        if name not in defs:
            continue
        shapes, op_name = defs[name]
        i = int(index.split(",")[0]) if index else 0
        if not shapes or (index and i >= len(shapes)) or (not index and len(shapes) != 1):
            continue  # a tuple as a whole holds no memory of its own
        shape = shapes[i]
        dtype, dims = shape.split("[")
        nbytes = array_bytes(dtype, tuple(int(d) for d in dims.rstrip("]").split(",") if d))
        out.append(LiveBuffer(name=f"{name}{{{index}}}", shape=shape, bytes=nbytes,
                              start=int(m.group("start")), end=int(m.group("end")),
                              op_name=op_name))
    return tuple(out)


def peak_breakdown(live_range_text: str, hlo: str | None = None) -> PeakBreakdown | None:
    """Parses XLA's live-range dump (``*after_optimizations-live-range.txt``, written with
    the ``xla_dump_to`` option) into a :class:`PeakBreakdown`; ``None`` if the text has no
    peak-usage section. With the optimized ``hlo`` text of the same program, the
    breakdown also lists every buffer's live range (``buffers``).
    :func:`compile_for_gpu` does this with ``live_buffers=True``."""
    m = _PEAK.search(live_range_text)
    if m is None:
        return None
    entries, top = [], None
    for line in live_range_text[m.end():].splitlines()[1:]:
        e = _ENTRY.match(line)
        if e is None:
            if entries:
                break
            continue
        depth = len(e.group("indent"))
        top = depth if top is None else top
        if depth == top:
            entries.append((e.group("name"), int(e.group("total").replace(" ", ""))))
    entries.sort(key=lambda x: -x[1])
    at = _PEAK_AT.search(live_range_text)
    return PeakBreakdown(
        peak_bytes=int(m.group("total").replace(" ", "")), entries=entries,
        peak_position=int(at.group(1)) if at else -1,
        buffers=_live_buffers(live_range_text, hlo) if hlo is not None else (),
    )


_LIVE_RANGE_GLOB = "*after_optimizations-live-range.txt"


@dataclasses.dataclass
class GpuCompileReport:
    """What one deviceless GPU compile tells.

    Attributes:
      compiled: the ``jax.stages.Compiled`` executable (not runnable here).
      hlo: its optimized HLO text.
      argument_bytes / output_bytes / temp_bytes / alias_bytes: per-device
        ``memory_analysis()`` figures.
      peak_bytes: per-device peak, ``temp + arguments + outputs - aliased``.
      collectives: :class:`~sp_jax.analysis.CollectiveStats` of the HLO (per instruction:
        :func:`~sp_jax.analysis.parse_collectives` of ``hlo``).
      peak_live: what is live at the peak (:class:`PeakBreakdown`), with
        ``compile_for_gpu(..., live_buffers=True)``; else ``None``.
    """

    compiled: Any
    hlo: str
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    peak_bytes: int
    collectives: CollectiveStats
    peak_live: PeakBreakdown | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "temp_bytes": self.temp_bytes,
            "alias_bytes": self.alias_bytes,
            "peak_bytes": self.peak_bytes,
            "collectives": dataclasses.asdict(self.collectives),
            "peak_live": self.peak_live.as_dict() if self.peak_live is not None else None,
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
    live_buffers: bool = False,
    donate_argnums: Sequence[int] = (),
) -> GpuCompileReport:
    """Compiles ``jax.jit(fn)(*args)`` for a ``mesh_shape`` mesh of ``target`` GPUs.

    ``args`` are pytrees of arrays or ``jax.ShapeDtypeStruct`` s; each leaf keeps the
    ``PartitionSpec`` of its sharding (a ``NamedSharding`` on any mesh, or a bare
    ``PartitionSpec``), re-targeted to the GPU mesh; leaves without one are replicated.
    ``fn`` is traced under ``jax.set_mesh`` of the GPU mesh, so sp_jax layers called in it
    shard over it. The compile uses sp_jax's recommended XLA GPU flags
    (:func:`default_compiler_options`); ``compiler_options`` adds to or overrides them.

    Args:
      live_buffers: also report what is live at the peak (``peak_live``): XLA dumps its
        buffer live-range analysis to a temporary directory (or to the ``xla_dump_to``
        of ``compiler_options``, which is kept), parsed by :func:`peak_breakdown`.

      donate_argnums: arguments whose buffers the outputs may reuse (as a training
        step donates its parameters and optimizer state): ``alias_bytes`` then counts
        them once.

    Returns:
      a :class:`GpuCompileReport` (per-device peak memory and collective statistics).
    """
    mesh = gpu_mesh(mesh_shape, axis_names, target=target, axis_types=axis_types)
    options = {**default_compiler_options(), **(compiler_options or {})}
    peak_live = None
    with jax.set_mesh(mesh):
        abstract_args = jax.tree.map(lambda x: _abstract(x, mesh), args)
        lowered = jax.jit(fn, donate_argnums=tuple(donate_argnums)).lower(*abstract_args)
        if not live_buffers:
            compiled = lowered.compile(compiler_options=options)
        elif options.get("xla_dump_to"):
            started = time.time()
            compiled = lowered.compile(compiler_options=options)
            peak_live = _read_peak(str(options["xla_dump_to"]), compiled.as_text(),
                                   since=started)
        else:
            with tempfile.TemporaryDirectory(prefix="sp_jax_live_range_") as dump:
                compiled = lowered.compile(compiler_options={**options, "xla_dump_to": dump})
                peak_live = _read_peak(dump, compiled.as_text())
    mem = compiled.memory_analysis()
    arg, out = int(mem.argument_size_in_bytes), int(mem.output_size_in_bytes)
    temp, alias = int(mem.temp_size_in_bytes), int(mem.alias_size_in_bytes)
    hlo = compiled.as_text()
    return GpuCompileReport(
        compiled=compiled, hlo=hlo, argument_bytes=arg, output_bytes=out, temp_bytes=temp,
        alias_bytes=alias, peak_bytes=temp + arg + out - alias,
        collectives=collective_stats(hlo), peak_live=peak_live,
    )


def _read_peak(dump: str, hlo: str, since: float | None = None) -> PeakBreakdown | None:
    """The breakdown of the last live-range dump (by name) in ``dump``, among the files
    written at or after ``since`` (a ``time.time()``; all files if ``None``)."""
    paths = sorted(p for p in glob.glob(os.path.join(dump, _LIVE_RANGE_GLOB))
                   if since is None or os.path.getmtime(p) >= since - 0.05)  # coarse fs clock
    return peak_breakdown(Path(paths[-1]).read_text(), hlo) if paths else None

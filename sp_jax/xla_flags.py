"""XLA GPU flags for TP+SP communication/compute overlap: the XLA analog of Megatron's check.

Megatron-LM (and Paddle's fleet) warn when ``CUDA_DEVICE_MAX_CONNECTIONS != 1``, because
their overlap of tensor/sequence-parallel collectives with GEMMs depends on it. Under XLA
the overlap is decided at compile time: which collectives run asynchronously next to which
matmuls is chosen by XLA:GPU's scheduler and collective passes, steered by ``XLA_FLAGS``.
This module names the flags, sets them, and warns (once) when a training program is set up
on a GPU without them.

Usage, before JAX starts its backend (before the first ``jax.devices()`` / computation)::

    import sp_jax
    sp_jax.xla_flags.apply_xla_flags()    # adds the flags the installed jaxlib accepts

or in the shell: ``XLA_FLAGS="$(python -c 'import sp_jax.xla_flags as f;
print(" ".join(f.recommended_xla_flags()))')" python train.py``.

Recommended flags (:data:`RECOMMENDED_GPU_FLAGS`)
-------------------------------------------------
- ``--xla_gpu_enable_latency_hiding_scheduler=true``: the latency-hiding scheduler (LHS)
  places each async collective's start/done pair around independent compute using a cost
  model (and PGLE profiles when given), within a memory limit; it decides, for example,
  whether the sequence-parallel reduce-scatter of ``dx`` overlaps the ``dW`` matmul in the
  backward pass (``mp_async_allreduce``). Off by default (on only from
  ``jax_exec_time_optimization_effort >= 0.2`` / XLA's ``-O1``); without it XLA:GPU uses a
  memory-minimising schedule that starts collectives early and finishes them late. In
  deviceless H100 compiles with jaxlib 0.10.2 both gave the same schedule for small TP+SP
  blocks; the flag is the documented switch (openxla.org/xla/gpu_optimization_levels; JAX's
  GPU performance tips; NVIDIA JAX-Toolbox sets it in its images).
- ``--xla_gpu_enable_highest_priority_async_stream=true``: async collectives run on the
  highest-priority CUDA stream, so NCCL kernels are not starved by the GEMMs they are meant
  to overlap (JAX's GPU performance tips; JAX-Toolbox GPU performance guide; MaxText GPU
  configs). Already the default in recent XLA; set explicitly so it stays on.
- ``--xla_gpu_enable_pipelined_all_gather=true``,
  ``--xla_gpu_enable_pipelined_reduce_scatter=true``,
  ``--xla_gpu_enable_pipelined_all_reduce=true``: the collective pipeliner moves these
  collectives across iterations of a ``lax.scan`` over layers (``GPTConfig.scan_layers``),
  so e.g. the data-parallel gradient reduction of one layer overlaps the next layer's
  compute instead of sitting at the loop boundary (XLA ``-O1`` set; JAX-Toolbox
  "pipelined comm/compute"; MaxText GPU configs).
- ``--xla_gpu_enable_while_loop_double_buffering=true``: unrolls while loops (scan over
  layers) by two, removing the loop barrier so collectives at a layer boundary can overlap
  compute of the neighbouring layer (XLA ``-O1`` set; JAX-Toolbox; MaxText GPU configs).
  Measured in a deviceless H100 compile (jaxlib 0.10.2) of the backward pass of a 4-layer
  scanned TP+SP block on a 2x4 mesh, the pipelining and double-buffering flags together
  halve the scan's trip count (4 -> 2) and take the async collectives with a GEMM
  scheduled between start and done from 2 of 5 to 9 of 16, for 12% more temporary memory
  (1152 -> 1296 MiB).
- ``--xla_gpu_experimental_parallel_collective_overlap_limit=2``: how many async
  collectives the latency-hiding scheduler keeps in flight at once (default 1).
  ``ParallelConfig(collective_matmul=True)`` sends chunks both ways around the ring at
  every step; with the default one of the two transfers of each step is serialised.
  Measured in a deviceless H100 compile (jaxlib 0.10.2) of a 2-layer TP+SP stack on 8
  GPUs: 20 of 28 forward column-ring permutes async with the default, all 28 (and all of
  the row and backward rings') with 2, at the same peak memory.

Considered and not recommended:
- ``--xla_gpu_{all_gather,reduce_scatter,all_reduce}_combine_threshold_bytes``: workload-
  and cluster-size dependent (MaxText derives them from the GPU count). TP+SP activation
  collectives form a dependency chain that the combiners cannot merge anyway; raising the
  thresholds mainly batches data-parallel/FSDP gradient collectives, at a memory cost, and
  over-combining delays the first collective and so reduces overlap. XLA's defaults stay.
- ``--xla_gpu_enable_command_buffer=`` (CUDA graphs off; MaxText sets it): changes launch
  overhead, not overlap, and NVIDIA's current guidance prefers command buffers on Blackwell.
- ``--xla_gpu_multi_streamed_windowed_einsum`` / ``--xla_gpu_threshold_for_windowed_einsum_mib``:
  XLA's collective matmul for einsums that GSPMD partitions; sp_jax issues its collectives
  explicitly inside ``shard_map``, where those passes do not apply.
- ``--xla_gpu_enable_async_collectives`` / ``--xla_gpu_enable_async_all_gather`` /
  ``..._reduce_scatter`` / ``..._all_reduce`` (older JAX and JAX-Toolbox docs),
  ``--xla_gpu_enable_pipelined_collectives``, ``--xla_gpu_graph_level``: removed from XLA;
  jaxlib 0.10.2 rejects them (collectives are async by default; the opposite switch is
  ``--xla_gpu_disable_async_collectives``).

How flag support is detected
----------------------------
jaxlib aborts the process at backend initialisation (``Unknown flag in XLA_FLAGS``) when
``XLA_FLAGS`` holds a flag its XLA does not define, and flags come and go between
versions. :func:`supported_xla_flags` therefore asks the installed jaxlib itself: a
subprocess (``JAX_PLATFORMS=cpu``, ``XLA_FLAGS`` = the candidates) makes jaxlib parse the
flags (``jaxlib._jax.CompileOptions()``, falling back to ``jax.devices()``), exactly as
backend start-up does. XLA parses GPU flags on CPU too, and reports every unknown flag in
one message, so one probe (about 0.15 s; 0.5 s through ``jax.devices()``) finds them all;
the remaining flags are probed once more to confirm. Results are cached per process.

Scanning jaxlib's shared library (``libjax_common.so``, 334 MB in 0.10.2) for the flag
names was measured and rejected: a substring match accepts removed flags, whose names
survive as reserved or deprecated fields of the ``DebugOptions`` proto (e.g.
``xla_gpu_enable_async_all_gather``, ``xla_gpu_enable_pipelined_collectives``), and a
stricter NUL-delimited match misses live flags the linker stores without a terminator
(e.g. ``xla_gpu_enable_highest_priority_async_stream``); it is also no faster (0.5 s).
The CUDA plugin (released in lockstep with jaxlib) parses ``XLA_FLAGS`` with its own copy
of the same XLA; tests/test_xla_flags.py checks in a deviceless GPU compile that it accepts
and applies the recommended flags.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterable
from typing import NamedTuple

import jax

from sp_jax._quiet import accelerator_present

__all__ = [
    "accelerator_present",
    "cpu_simulation_flags",
    "simulate_cpu_devices",
    "XlaFlag",
    "RECOMMENDED_GPU_FLAGS",
    "FP8_GPU_FLAGS",
    "FP8_COMPILER_OPTIONS",
    "recommended_xla_flags",
    "supported_xla_flags",
    "recommended_compiler_options",
    "missing_xla_flags",
    "gpu_flags_not_set",
    "apply_xla_flags",
    "warn_if_gpu_flags_missing",
]


class XlaFlag(NamedTuple):
    """One recommended XLA flag: ``name`` (without ``--``), its ``value`` and ``why``."""

    name: str
    value: str
    why: str

    @property
    def flag(self) -> str:
        """The ``--name=value`` form used in ``XLA_FLAGS``."""
        return f"--{self.name}={self.value}"


RECOMMENDED_GPU_FLAGS: tuple[XlaFlag, ...] = (
    XlaFlag(
        "xla_gpu_enable_latency_hiding_scheduler", "true",
        "schedules async collectives around independent compute (e.g. the backward "
        "reduce-scatter of dx next to the dW matmul); without it there is no overlap",
    ),
    XlaFlag(
        "xla_gpu_enable_highest_priority_async_stream", "true",
        "runs async collectives on the highest-priority stream so GEMMs do not starve them",
    ),
    XlaFlag(
        "xla_gpu_enable_pipelined_all_gather", "true",
        "pipelines all-gathers across iterations of a scan over layers",
    ),
    XlaFlag(
        "xla_gpu_enable_pipelined_reduce_scatter", "true",
        "pipelines reduce-scatters across iterations of a scan over layers",
    ),
    XlaFlag(
        "xla_gpu_enable_pipelined_all_reduce", "true",
        "pipelines all-reduces (e.g. data-parallel gradients) across scan iterations",
    ),
    XlaFlag(
        "xla_gpu_enable_while_loop_double_buffering", "true",
        "unrolls scan loops by two so collectives overlap the neighbouring layer's compute",
    ),
    XlaFlag(
        "xla_gpu_experimental_parallel_collective_overlap_limit", "2",
        "lets two async collectives be in flight at once: collective matmul's rings send "
        "both ways around the ring at every step",
    ),
)
"""The XLA GPU flags recommended for TP+SP overlap (see the module docstring for sources)."""

FP8_GPU_FLAGS: tuple[XlaFlag, ...] = (
    XlaFlag(
        "xla_gpu_enable_triton_gemm", "false",
        "FP8 layers (sp_jax.Fp8Recipe): every forward, dgrad and wgrad GEMM of a linear "
        "layer becomes one cuBLASLt FP8 GEMM with its scales fused "
        "(__cublas$lt$matmul$f8); with Triton GEMMs enabled XLA may pick a Triton kernel "
        "instead (always, in a deviceless compile, which cannot autotune)",
    ),
)
"""The XLA GPU flags of FP8 training, besides :data:`RECOMMENDED_GPU_FLAGS` (not in
:func:`recommended_xla_flags`: they change the GEMMs of bf16 models too)."""

FP8_COMPILER_OPTIONS: dict[str, bool] = {"xla_gpu_enable_triton_gemm": False}
""":data:`FP8_GPU_FLAGS` as per-compilation options (``compiler_options=...``)."""

_GPU_BACKENDS = ("gpu", "cuda", "rocm")
_FLAG_RE = re.compile(r"^--([A-Za-z0-9_]+)(=.*)?$")
_UNKNOWN_RE = re.compile(r"Unknown flags? in XLA_FLAGS: (.*)")
_PROBE_TIMEOUT_S = 120
# Make jaxlib parse XLA_FLAGS the way backend start-up does: CompileOptions() reads the
# DebugOptions from the environment without importing jax; jax.devices() is the public
# (slower) path if that private entry point moves.
_PROBE_CODE = """
try:
    from jaxlib import _jax
    _jax.CompileOptions()
except (ImportError, AttributeError):
    import jax
    jax.devices()
"""


def _flag_name(flag: str) -> str:
    match = _FLAG_RE.match(flag)
    if match is None:
        raise ValueError(
            f"{flag!r} is not an XLA flag; write it as '--name=value' "
            "(e.g. '--xla_gpu_enable_latency_hiding_scheduler=true')."
        )
    return match.group(1)


def _names_in(xla_flags: str) -> set[str]:
    """Names of the flags set in an ``XLA_FLAGS`` string."""
    return set(re.findall(r"(?:^|\s)--?([A-Za-z0-9_]+)(?==|\s|$)", xla_flags))


def _probe(flags: tuple[str, ...]) -> tuple[bool, frozenset[str]]:
    """Runs jaxlib's flag parser on ``flags`` in a subprocess.

    Returns (parsed without error, names jaxlib reported as unknown).
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE_CODE],
            env=env, capture_output=True, text=True, timeout=_PROBE_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return False, frozenset()
    if proc.returncode == 0:
        return True, frozenset()
    match = _UNKNOWN_RE.search(proc.stderr)
    if match is None:
        return False, frozenset()
    return False, frozenset(_names_in(match.group(1)))


@functools.cache
def _supported(flags: tuple[str, ...]) -> tuple[str, ...]:
    if not flags:
        return ()
    ok, unknown = _probe(flags)
    if ok:
        return flags
    rest = tuple(f for f in flags if _flag_name(f) not in unknown)
    if rest != flags:
        # Drop what jaxlib named as unknown, then confirm the rest parses.
        return _supported(rest)
    if len(flags) == 1 or not _probe(())[0]:
        # A value jaxlib cannot parse, or the probe itself cannot run (no subprocess, a
        # broken environment): recommend nothing rather than something that may abort.
        return ()
    # Some value failed to parse; keep the flags that parse on their own.
    return tuple(f for f in flags if _supported((f,)))


def supported_xla_flags(flags: Iterable[str]) -> list[str]:
    """The subset of ``flags`` (``--name=value`` strings) the installed jaxlib accepts.

    Asks jaxlib's own parser in a subprocess (see the module docstring); drops flags it
    does not know and flags whose value it cannot parse. Cached per process.
    """
    flags = tuple(dict.fromkeys(flags))
    for flag in flags:
        _flag_name(flag)
    return list(_supported(flags))


def recommended_xla_flags() -> list[str]:
    """The :data:`RECOMMENDED_GPU_FLAGS` the installed jaxlib accepts, as ``--name=value``.

    Safe to put in ``XLA_FLAGS``: a flag this jaxlib does not define would abort JAX at
    backend start-up, so it is left out.
    """
    return supported_xla_flags(f.flag for f in RECOMMENDED_GPU_FLAGS)


def _option_value(value: str) -> bool | int | str:
    """An XLA_FLAGS value as a compiler option: options want typed bools and ints."""
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    try:
        return int(value)
    except ValueError:
        return value


def recommended_compiler_options() -> dict[str, bool | int | str]:
    """:func:`recommended_xla_flags` as per-compilation options, ``{name: value}``.

    For ``jax.jit(f, compiler_options=...)`` or ``.lower(...).compile(compiler_options=...)``:
    the same settings for one executable, usable after the backend has started.
    """
    options = {}
    for flag in recommended_xla_flags():
        name, _, value = flag[2:].partition("=")
        options[name] = _option_value(value)
    return options


def missing_xla_flags() -> list[str]:
    """Recommended flags whose name does not appear in the current ``XLA_FLAGS``.

    A flag the user set to any value counts as present.
    """
    present = _names_in(os.environ.get("XLA_FLAGS", ""))
    return [f for f in recommended_xla_flags() if _flag_name(f) not in present]


def _backend_initialized() -> bool:
    """Whether JAX has started its backends (after which XLA_FLAGS is no longer read)."""
    from jax._src import xla_bridge

    check = getattr(xla_bridge, "backends_are_initialized", None)
    if callable(check):
        return bool(check())
    return bool(getattr(xla_bridge, "_backends", None))


def cpu_simulation_flags(num_devices: int) -> list[str]:
    """XLA_FLAGS for running sharded programs on a CPU-only machine.

    ``num_devices`` simulated host devices (the flag affects only the host platform, so a
    run on GPUs uses its real devices), and XLA:CPU's ``cse_barrier_expander`` pass off, so
    that ``recompute_allgather``'s backward re-all-gather is not merged with the forward
    one (XLA:GPU keeps it by itself). Pass them to :func:`apply_xla_flags` before JAX
    starts; flags already in ``XLA_FLAGS`` keep the user's value.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices <= 0:
        raise ValueError(f"cpu_simulation_flags: num_devices={num_devices!r} must be a "
                         "positive int.")
    return [f"--xla_force_host_platform_device_count={num_devices}",
            "--xla_disable_hlo_passes=cse_barrier_expander"]


def simulate_cpu_devices(num_devices: int) -> bool:
    """On a machine without an accelerator (:func:`accelerator_present`): adds
    :func:`cpu_simulation_flags` ``(num_devices)`` to ``XLA_FLAGS`` and returns True;
    elsewhere changes nothing (real devices are used, and XLA:GPU must keep the pass those
    flags turn off) and returns False: a mesh then needs that many real devices. Call it
    before JAX starts its backend; once it has started with at least ``num_devices``
    devices (a notebook cell run again, a test process) there is nothing to do and it
    returns False.

    Raises:
      RuntimeError: on a machine without an accelerator, the JAX backend has already
        started with fewer devices (the flags can no longer take effect).
      ValueError: ``num_devices`` is not a positive int.
    """
    flags = cpu_simulation_flags(num_devices)
    if _backend_initialized() and jax.device_count() >= num_devices:
        return False
    if accelerator_present():
        return False
    apply_xla_flags(flags)
    return True


def apply_xla_flags(flags: Iterable[str] | None = None) -> str:
    """Adds ``flags`` (default: :func:`recommended_xla_flags`) to ``os.environ["XLA_FLAGS"]``.

    Call it before JAX starts its backend, i.e. before the first ``jax.devices()`` or
    computation: XLA reads ``XLA_FLAGS`` once, at backend start-up. A flag already in
    ``XLA_FLAGS`` keeps the user's value; given ``flags`` are added as they are (not checked
    against jaxlib).

    Returns:
      the new value of ``XLA_FLAGS``.

    Raises:
      RuntimeError: if the JAX backend is already initialised.
      ValueError: if a flag is not of the form ``--name=value``.
    """
    if _backend_initialized():
        raise RuntimeError(
            "sp_jax.xla_flags.apply_xla_flags() was called after JAX initialised its "
            "backend, when XLA_FLAGS is no longer read. Call it before the first JAX "
            "computation (before jax.devices(), jnp arrays or jit), e.g. at the top of "
            "your script, or set XLA_FLAGS in the shell. For a single function, pass "
            "jax.jit(f, compiler_options=sp_jax.xla_flags.recommended_compiler_options())."
        )
    flags = recommended_xla_flags() if flags is None else list(flags)
    current = os.environ.get("XLA_FLAGS", "").strip()
    present = _names_in(current)
    added = []
    for flag in flags:
        name = _flag_name(flag)
        if name not in present:
            present.add(name)
            added.append(flag)
    value = " ".join([current, *added]).strip()
    os.environ["XLA_FLAGS"] = value
    return value


def gpu_flags_not_set() -> list[str]:
    """:data:`RECOMMENDED_GPU_FLAGS` whose name does not appear in ``XLA_FLAGS``, as
    ``--name=value``; compares names only (no probe of jaxlib, no subprocess)."""
    present = _names_in(os.environ.get("XLA_FLAGS", ""))
    return [f.flag for f in RECOMMENDED_GPU_FLAGS if f.name not in present]


def warn_if_gpu_flags_missing() -> None:
    """Warns once per process when running on a GPU without the recommended flags.

    Called where a program is set up (:class:`sp_jax.training.TrainStep`), never by the
    layers. Reads only ``XLA_FLAGS`` and the default backend: no subprocess, no probe.
    """
    if jax.default_backend() not in _GPU_BACKENDS:
        return
    _warn_gpu_flags_missing_once()


@functools.cache
def _warn_gpu_flags_missing_once() -> None:
    # functools.cache, not the warnings registry, makes this once per process: the
    # registry's once-per-location holds only under the default filter (pytest or -W always
    # would repeat it) and resets when filters change. Users can still silence it with
    # warnings filters.
    missing = gpu_flags_not_set()
    if not missing:
        return
    line = " ".join(missing)
    warnings.warn(
        "sp_jax: running tensor/sequence-parallel layers on GPU without the XLA flags that "
        f"let XLA overlap their collectives with compute; missing: {line}. Call "
        "sp_jax.xla_flags.apply_xla_flags() before JAX starts (before the first JAX "
        f"computation), or set XLA_FLAGS=\"$XLA_FLAGS {line}\" in the environment.",
        UserWarning,
        stacklevel=3,
    )

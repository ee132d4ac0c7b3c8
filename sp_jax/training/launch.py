"""Multi-process launch: which processes take part, ``jax.distributed``, and the mesh over them.

One process per host or per GPU (CPU processes simulate devices). A run is multi-process
when it is given ``--coordinator HOST:PORT --num-processes N --process-id I``, or when a
SLURM (``srun``) or Open MPI (``mpirun``) launcher started more than one task: then
``jax.distributed.initialize()`` without arguments auto-detects all three from the
launcher's variables (:func:`cluster_tasks` reads the same ones). ``distributed="on"``
forces initialisation, ``"off"`` disables it.

The rules are plain functions raising ``ValueError`` whose messages name the command-line
flags :func:`add_launch_arguments` defines, so a script reports them with
``parser.error(str(e))``::

    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    args = parser.parse_args()
    try:
        launch = Launch.from_args(args)
        shape = launch.resolve_mesh(parse_mesh("-1,4", fill=True), args.local_devices)
        n_local = launch.local_device_count(shape, args.local_devices)
    except ValueError as e:
        parser.error(str(e))
    apply_xla_flags(cpu_simulation_flags(n_local))   # before JAX starts its backend
    launch.initialize()                               # before any JAX computation
    mesh = build_mesh(shape, MESH_AXES)

Under SLURM / Open MPI JAX gives each process the one GPU of its local rank;
``local_device_ids`` overrides it (e.g. all GPUs of a node for one process per node).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping, Sequence

import jax

from sp_jax.xla_flags import accelerator_present

__all__ = ["JAX_MARGIN_S", "MESH_AXES", "Launch", "add_launch_arguments", "build_mesh",
           "cluster_tasks", "mesh_description", "parse_local_device_ids", "parse_mesh"]

_SLURM = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
          "SLURM_LOCALID")
_OPEN_MPI = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE")
_MODES = ("auto", "on", "off")


def cluster_tasks(environ: Mapping[str, str] | None = None) -> int | None:
    """How many tasks a SLURM (``srun``) or Open MPI (``mpirun``) launcher started, from
    the variables JAX's own cluster detection reads; None outside such a launch.

    Args:
      environ: the environment to read (default ``os.environ``).
    """
    env = os.environ if environ is None else environ
    if all(k in env for k in _SLURM):
        return int(env["SLURM_NTASKS"])
    if all(k in env for k in _OPEN_MPI):
        return int(env["OMPI_COMM_WORLD_SIZE"])
    return None


def parse_local_device_ids(text: str) -> tuple[int, ...]:
    """``"0,1,2,3"`` -> ``(0, 1, 2, 3)``; ValueError naming the text otherwise."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--local-device-ids {text!r}: expected integers separated by "
                         "commas, e.g. 0,1,2,3") from None


_AGREED = (0, 3, 75)  # statuses every process of a run ends with alike (faults.EXIT_*)

JAX_MARGIN_S = 60
"""Seconds by which JAX's coordination-service timeouts exceed the longest sp_jax watchdog
bound (:meth:`Launch.jax_timeouts`)."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process takes part in a run (build it with :meth:`plan`).

    Attributes:
      multiprocess: whether to call ``jax.distributed.initialize``.
      processes: the expected number of processes (1 for a single-process run).
      coordinator, num_processes, process_id, local_device_ids: the arguments for
        ``jax.distributed.initialize``; None ones are left to JAX's cluster detection.
      peer_timeout_s: the bound on every wait for another process (``--peer-timeout``).
      compile_allowance_s: what a first call, which compiles, may take longer
        (``--compile-allowance``); with ``peer_timeout_s`` it sets JAX's own timeouts
        (:meth:`jax_timeouts`).
    """

    multiprocess: bool
    processes: int
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    peer_timeout_s: float = 120.0
    compile_allowance_s: float = 600.0

    @classmethod
    def plan(cls, *, coordinator: str | None = None, num_processes: int | None = None,
             process_id: int | None = None,
             local_device_ids: str | Sequence[int] | None = None,
             distributed: str = "auto", peer_timeout_s: float = 120.0,
             compile_allowance_s: float = 600.0,
             environ: Mapping[str, str] | None = None) -> Launch:
        """Checks the combination of launch settings and decides on multi-process.

        Args:
          coordinator: ``HOST:PORT`` of process 0's coordinator service.
          num_processes: number of processes (> 0).
          process_id: this process's index, ``0 .. num_processes - 1``.
          local_device_ids: GPU ids this process uses, as ints or ``"0,1"``.
          distributed: ``"auto"`` (multi-process when the three above are given or a
            SLURM / Open MPI launch has several tasks), ``"on"`` or ``"off"``.
          peer_timeout_s: how long a process waits for a missing, dead or stalled peer
            before every process ends with an error (the coordination service's
            initialisation, heartbeat and shutdown timeouts, and the bound of
            :func:`sp_jax.training.faults.check_same_settings` and the watchdog).
          compile_allowance_s: added to the watchdog's bound for a first call, which
            compiles (a step, an evaluation, a save, a restore).
          environ: the environment to detect a cluster launch in (default
            ``os.environ``).
        Raises:
          ValueError: a contradictory or incomplete combination, naming the flags.
        """
        if distributed not in _MODES:
            raise ValueError(f"--distributed {distributed!r}: expected one of {_MODES}")
        explicit = [v is not None for v in (coordinator, num_processes, process_id)]
        tasks = cluster_tasks(environ)
        if distributed == "off" and any(explicit):
            raise ValueError("--distributed off contradicts --coordinator / --num-processes"
                             " / --process-id")
        if any(explicit) and not all(explicit) and tasks is None:
            raise ValueError("--coordinator HOST:PORT, --num-processes N and --process-id I "
                             "go together (only a SLURM / Open MPI launch can supply the "
                             "missing ones)")
        if isinstance(local_device_ids, str):
            local_device_ids = parse_local_device_ids(local_device_ids)
        elif local_device_ids is not None:
            local_device_ids = tuple(int(v) for v in local_device_ids)
        for flag, value in (("--peer-timeout", peer_timeout_s),
                            ("--compile-allowance", compile_allowance_s)):
            if not (isinstance(value, int | float) and 0 < value < math.inf):
                raise ValueError(f"{flag} {value}: must be a positive number of seconds")
        if num_processes is not None and num_processes <= 0:
            raise ValueError("--num-processes must be positive")
        if process_id is not None and not (
                0 <= process_id < (num_processes or tasks or process_id + 1)):
            raise ValueError(f"--process-id {process_id} must be in 0 .. --num-processes - 1")
        multiprocess = distributed == "on" or (
            distributed == "auto" and (any(explicit) or (tasks or 1) > 1))
        return cls(multiprocess=multiprocess,
                   processes=(num_processes or tasks or 1) if multiprocess else 1,
                   coordinator=coordinator, num_processes=num_processes,
                   process_id=process_id, local_device_ids=local_device_ids,
                   peer_timeout_s=float(peer_timeout_s),
                   compile_allowance_s=float(compile_allowance_s))

    @classmethod
    def from_args(cls, args: argparse.Namespace,
                  environ: Mapping[str, str] | None = None) -> Launch:
        """:meth:`plan` from the flags :func:`add_launch_arguments` defines."""
        return cls.plan(coordinator=args.coordinator, num_processes=args.num_processes,
                        process_id=args.process_id, local_device_ids=args.local_device_ids,
                        distributed=args.distributed,
                        peer_timeout_s=getattr(args, "peer_timeout", 120.0),
                        compile_allowance_s=getattr(args, "compile_allowance", 600.0),
                        environ=environ)

    def local_device_count(self, mesh_shape: Sequence[int],
                           local_devices: int | None = None) -> int:
        """Simulated CPU devices for this process: ``local_devices`` if given, else the
        mesh's devices divided evenly over the processes (no effect on GPUs).

        Raises:
          ValueError: ``local_devices`` is not positive, or the mesh does not divide over
            the processes (the message asks for ``--local-devices``).
        """
        n_dev = 1
        for size in mesh_shape:
            n_dev *= size
        if local_devices is not None:
            if local_devices <= 0:
                raise ValueError("--local-devices must be positive")
            return local_devices
        if n_dev % self.processes:
            mesh = ",".join(str(s) for s in mesh_shape)
            raise ValueError(f"--mesh {mesh} ({n_dev} devices) does not divide over "
                             f"{self.processes} processes; set --local-devices")
        return n_dev // self.processes

    def resolve_mesh(self, shape: Sequence[int], local_devices: int | None = None, *,
                     environ: Mapping[str, str] | None = None) -> tuple[int, ...]:
        """``shape`` (:func:`parse_mesh` with ``fill=True``) with its ``-1`` axis, if any,
        replaced by the devices of the run the other axes leave: the same ``--mesh``
        then fits an allocation of any size, e.g. ``-1,4`` is data=2 x tensor=4 in 2
        processes of 4 devices and data=1 x tensor=4 in one. Call it before JAX starts
        its backend (a single process on GPUs reads ``jax.local_device_count()``).

        The run's devices are :attr:`processes` x the devices of one process:
        ``local_devices`` (``--local-devices``) if given; on a machine without an
        accelerator nothing else (the simulated count must be given); on GPUs the
        length of ``--local-device-ids``, else one per process when a SLURM / Open MPI
        launcher started several tasks (JAX's default there: the GPU of the local
        rank), else, in a single process, ``jax.local_device_count()``.

        Args:
          shape: ``(stage, data, expert, context, tensor)`` sizes, at most one of them -1.
          local_devices: ``--local-devices``.
          environ: the environment to detect a cluster launch in (default ``os.environ``).
        Raises:
          ValueError: the devices per process are unknown, or the other axes' product does
            not divide the run's devices, naming ``--mesh`` and how they were counted.
        """
        shape = tuple(int(s) for s in shape)
        axis = (MESH_AXES[shape.index(-1)] if -1 in shape and len(shape) == len(MESH_AXES)
                else "one")
        counted = self._devices_per_process(local_devices, environ)
        if -1 not in shape:
            if counted is not None and self.multiprocess:
                self._check_fits(shape, *counted)
            return shape
        if counted is None and not accelerator_present():
            raise ValueError(f"--mesh with {axis}=-1 on CPU needs --local-devices N: the "
                             "simulated devices per process")
        if counted is None:
            raise ValueError(f"--mesh with {axis}=-1 in a multi-process run needs "
                             "--local-device-ids (or --local-devices N): the devices of "
                             "each process")
        per, source = counted
        total, others = self.processes * per, -math.prod(shape)
        if total % others:
            named = " x ".join(f"{n}={s}" for n, s in zip(MESH_AXES, shape, strict=True)
                               if s > 1) or "1"
            raise ValueError(f"--mesh with {axis}=-1: the other axes ({named}, {others} "
                             f"devices) do not divide the run's {total} devices "
                             f"({self.processes} processes x {per} devices, {source})")
        return tuple(total // others if s == -1 else s for s in shape)

    def _devices_per_process(self, local_devices: int | None,
                             environ: Mapping[str, str] | None) -> tuple[int, str] | None:
        """(devices of one process, how they were counted), or None where only JAX's
        start-up would tell (CPU without --local-devices, several processes started by
        flags on GPUs)."""
        if local_devices is not None:
            if local_devices <= 0:
                raise ValueError("--local-devices must be positive")
            return local_devices, "--local-devices"
        if not accelerator_present():
            return None
        if self.local_device_ids:
            return len(self.local_device_ids), "--local-device-ids"
        if self.multiprocess and cluster_tasks(environ) is not None:
            return 1, "one GPU per SLURM / Open MPI task"
        if self.multiprocess:
            return None
        return jax.local_device_count(), "jax.local_device_count()"

    def _check_fits(self, shape: tuple[int, ...], per: int, source: str) -> None:
        """Several processes: the mesh must use every device of every process."""
        need, total = math.prod(shape), self.processes * per
        if need != total:
            fit = f"start {need // per} processes" if need % per == 0 else "change --mesh"
            raise ValueError(f"--mesh ({mesh_description(shape)}) needs {need} devices; the "
                             f"{self.processes} processes have {total} ({per} each, "
                             f"{source}): {fit} (SLURM: sbatch / srun --ntasks; mpirun -np), "
                             "or give the data axis as -1 to fill the devices")

    def jax_timeouts(self) -> dict[str, int]:
        """The timeouts of JAX's coordination service (``jax.distributed.initialize``'s
        keyword arguments), set so that sp_jax's watchdogs always speak first.

        JAX ends every process with SIGABRT and a C++ stack trace when a process misses
        heartbeats for ``heartbeat_timeout_seconds`` (measured with jaxlib 0.10: 5 to 10 s
        before that timeout; its error then reaches the others at once). The longest
        watchdog bound of a run is ``peer_timeout_s + compile_allowance_s`` (a first call,
        which compiles) plus the heartbeats' naming of the culprit (at most 11 s), so the
        heartbeat timeout is that plus :data:`JAX_MARGIN_S`. Initialisation and the final
        shutdown barrier are watched with ``peer_timeout_s``: their JAX timeouts are
        ``peer_timeout_s + JAX_MARGIN_S``.
        """
        peer = math.ceil(self.peer_timeout_s)
        return {"initialization_timeout": peer + JAX_MARGIN_S,
                "heartbeat_timeout_seconds":
                    math.ceil(self.peer_timeout_s + self.compile_allowance_s) + JAX_MARGIN_S,
                "shutdown_timeout_seconds": peer + JAX_MARGIN_S}

    def initialize(self) -> None:
        """``jax.distributed.initialize`` for a multi-process run (nothing otherwise);
        call it before any JAX computation.

        Cross-process collectives on the CPU platform go through gloo (set first); on
        GPUs NCCL is used and that setting has no effect. Arguments that are None are
        left to JAX's cluster auto-detection (SLURM, Open MPI, Cloud TPU, ...).
        :attr:`peer_timeout_s` bounds every wait for another process: a process that
        never starts (or a duplicate ``--process-id``) ends this one after that long
        with one line and status :data:`~sp_jax.training.faults.EXIT_PEER_FAILED` (a
        :class:`~sp_jax.training.faults.Watchdog`); one that dies or stalls later is
        caught by the training loop's watchdogs. JAX's own timeouts come after all of
        them (:meth:`jax_timeouts`).
        """
        if not self.multiprocess:
            return
        from sp_jax.training.faults import Watchdog

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        waiting = (f"starting: waiting for all {self.processes} processes (each with its own "
                   "--process-id) to connect to the coordinator"
                   f"{f' at {self.coordinator}' if self.coordinator else ''}")
        with Watchdog(self.peer_timeout_s, name=self._name(), coordinate=False).watch(waiting):
            jax.distributed.initialize(
                coordinator_address=self.coordinator, num_processes=self.num_processes,
                process_id=self.process_id,
                local_device_ids=(list(self.local_device_ids) if self.local_device_ids
                                  else None), **self.jax_timeouts())

    def _name(self) -> str | None:
        return f"process {self.process_id}" if self.process_id is not None else None

    def end(self, status: int) -> int:
        """Ends a process's part in the run with exit ``status``; returns it (to
        ``sys.exit``) in a single-process run.

        Multi-process: a status every process ends with alike (0 done, 3 diverged, 75
        stopped by a signal: the trainer's agreed outcomes) passes the final barrier
        (:meth:`shutdown`) and is returned. Any other status (an error of this process,
        a failed peer) leaves without that barrier, by
        :func:`~sp_jax.training.faults.leave` (process 0 last, after the others or
        :attr:`peer_timeout_s`): the other processes may be gone, and JAX's barrier would
        wait for them and then abort the process.
        """
        if not self.multiprocess or jax.process_count() == 1:
            return status
        if status in _AGREED:
            self.shutdown()
            return status
        from sp_jax.training.faults import leave

        leave(status, wait_s=self.peer_timeout_s)

    def shutdown(self) -> None:
        """``jax.distributed.shutdown`` (nothing in a single-process run): the final
        barrier, where every process waits for the others to finish; a process that
        does not arrive within :attr:`peer_timeout_s` ends this one with one line and
        status :data:`~sp_jax.training.faults.EXIT_PEER_FAILED`."""
        if not self.multiprocess or jax.process_count() == 1:
            return
        from sp_jax.training.faults import Watchdog

        with Watchdog(self.peer_timeout_s, name=self._name()).watch(
                "finishing: waiting for every process to reach the end"):
            jax.distributed.shutdown()


MESH_AXES = ("stage", "data", "expert", "context", "tensor")
"""The mesh axes of :func:`parse_mesh`'s shapes, outermost first (tensor innermost): the
pipeline stages outermost, across hosts; the tensor axis within one. The expert axis
carries the batch like data outside the mixture-of-experts layers."""


def parse_mesh(text: str, *, fill: bool = False) -> tuple[int, int, int, int, int]:
    """``"DATA,TENSOR"``, ``"DATA,CONTEXT,TENSOR"``, ``"STAGE,DATA,CONTEXT,TENSOR"`` or named
    sizes such as ``"data=2,expert=2,tensor=2"`` (any of :data:`MESH_AXES`, the others 1)
    -> ``(stage, data, expert, context, tensor)`` sizes of a :data:`MESH_AXES` mesh.

    Args:
      text: the ``--mesh`` value.
      fill: allow ``-1`` as the size of one axis (MaxText's ``ici_*_parallelism: -1``):
        that axis takes the devices the others leave, resolved by
        :meth:`Launch.resolve_mesh` once the run's device count is known; the shape
        returned keeps the ``-1``.

    Raises:
      ValueError: not two, three or four positive integers separated by commas, nor
        ``axis=size`` pairs of known axes with positive sizes (with ``fill``: or ``-1``,
        for one axis at most).
    """
    fill_note = ", or -1 for one axis: it takes the devices the others leave" if fill else ""

    def size_of(value: str) -> int | None:
        value = value.strip()
        digits = value[1:] if value.startswith("-") else value
        if not digits.isdigit():
            return None
        size = int(value)
        return size if size > 0 or (fill and size == -1) else None

    if "=" in text:
        sizes = dict.fromkeys(MESH_AXES, 1)
        for part in text.split(","):
            name, _, value = part.partition("=")
            if name.strip() not in sizes or size_of(value) is None:
                raise ValueError(f"--mesh {text!r}: {part!r} is not AXIS=SIZE with AXIS one "
                                 f"of {', '.join(MESH_AXES)} and a positive SIZE{fill_note}, "
                                 "e.g. data=2,expert=2,tensor=2")
            sizes[name.strip()] = size_of(value)
        shape = tuple(sizes.values())
    else:
        sizes = [size_of(v) for v in text.split(",")]
        if len(sizes) not in (2, 3, 4) or None in sizes:
            raise ValueError(f"--mesh {text!r}: expected DATA,TENSOR, DATA,CONTEXT,TENSOR or "
                             "STAGE,DATA,CONTEXT,TENSOR (positive integers"
                             f"{fill_note}), e.g. 2,4, 1,2,4 or 2,1,1,4, or AXIS=SIZE pairs, "
                             "e.g. data=2,expert=2,tensor=2")
        if len(sizes) == 2:
            sizes = [1, sizes[0], 1, sizes[1]]
        elif len(sizes) == 3:
            sizes = [1, *sizes]
        stage, data, context, tensor = sizes
        shape = (stage, data, 1, context, tensor)
    if shape.count(-1) > 1:
        raise ValueError(f"--mesh {text!r}: only one axis size may be -1 (the axis that takes "
                         "the devices the others leave)")
    return shape


def mesh_description(shape: Sequence[int] | jax.sharding.Mesh) -> str:
    """``"data=2 x tensor=4"`` (``"stage=2 x data=1 x context=2 x tensor=4"`` with stage
    and context axes) for a :data:`MESH_AXES` shape, or for a mesh (its axes and sizes; a
    stage, expert or context axis of size 1 left out)."""
    axes = (shape.shape.items() if isinstance(shape, jax.sharding.Mesh)
            else zip(MESH_AXES, shape, strict=True))
    return " x ".join(f"{name}={size}" for name, size in axes
                      if name not in ("stage", "expert", "context") or size > 1)


def build_mesh(shape: Sequence[int], axis_names: Sequence[str] = ("data", "tensor")
               ) -> jax.sharding.Mesh:
    """The mesh of ``shape`` over the first ``prod(shape)`` devices of a single process, or
    over all devices of all processes (in process order, so an inner axis stays within a
    process when its size divides the process's device count).

    Raises:
      ValueError: too few devices, or, with several processes, a mesh that does not use
        every process's devices (each process must hold part of the mesh).
    """
    n_dev = 1
    for size in shape:
        n_dev *= size
    devices = jax.devices()
    mesh = (f"({mesh_description(shape)})" if len(shape) == len(MESH_AXES)
            else ",".join(str(s) for s in shape))
    if jax.process_count() > 1 and len(devices) != n_dev:
        raise ValueError(f"--mesh {mesh} needs {n_dev} devices; the {jax.process_count()} "
                         f"processes have {len(devices)} ({jax.local_device_count()} each, "
                         f"{devices[0].platform}). Use a mesh of all of them, start as many "
                         "processes as the mesh needs (SLURM: sbatch / srun --ntasks; "
                         "mpirun -np), or set --local-devices on CPU.")
    if len(devices) < n_dev:
        raise ValueError(f"--mesh {mesh} needs {n_dev} devices, found {len(devices)} "
                         f"({devices[0].platform})")
    return jax.make_mesh(tuple(shape), tuple(axis_names), devices=devices[:n_dev])


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the multi-process flags (an argument group) that :meth:`Launch.from_args`
    reads: ``--coordinator``, ``--num-processes``, ``--process-id``,
    ``--local-device-ids``, ``--distributed``, ``--local-devices``, ``--peer-timeout`` and
    ``--compile-allowance``."""
    g = parser.add_argument_group("multi-process (jax.distributed)")
    g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="address of process 0's coordinator service")
    g.add_argument("--num-processes", type=int, default=None, help="number of processes")
    g.add_argument("--process-id", type=int, default=None,
                   help="this process's index, 0 .. N-1")
    g.add_argument("--local-device-ids", default=None, metavar="IDS",
                   help="comma-separated GPU ids this process uses (jax.distributed's "
                        "local_device_ids). Under SLURM / Open MPI JAX's default is one GPU "
                        "per process, the one of its local rank; with one process per node "
                        "pass all of them, e.g. 0,1,2,3,4,5,6,7")
    g.add_argument("--distributed", choices=_MODES, default="auto",
                   help="auto: initialise jax.distributed when the three flags above are "
                        "given or a SLURM/Open MPI launcher started several tasks; on: "
                        "always (JAX's cluster auto-detection fills in what the flags do not "
                        "give); off: single process")
    g.add_argument("--local-devices", "--cpu-devices", dest="local_devices", type=int,
                   default=None,
                   help="simulated CPU devices per process (default: the mesh's devices "
                        "divided by the number of processes; needed for a --mesh with a -1 "
                        "size); no effect on GPUs but the count a -1 size is resolved with")
    g.add_argument("--peer-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="multi-process: how long to wait for a process that did not start, "
                        "died or stalled before every process ends with an error")
    g.add_argument("--compile-allowance", type=float, default=600.0, metavar="SECONDS",
                   help="multi-process: how much longer than --peer-timeout a first step, "
                        "evaluation, save or restore (which compile) may take")

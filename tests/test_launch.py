"""sp_jax.training.launch: the multi-process rules (flags, SLURM / Open MPI detection, the
simulated device count) and the mesh over all devices. The environment is passed
explicitly, so the machine's own variables play no part."""

from __future__ import annotations

import argparse

import jax
import pytest

from sp_jax.training.launch import (
    Launch,
    add_launch_arguments,
    build_mesh,
    cluster_tasks,
    parse_local_device_ids,
)

SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_NTASKS": "4",
         "SLURM_PROCID": "3", "SLURM_LOCALID": "1"}
OPEN_MPI = {"OMPI_MCA_orte_hnp_uri": "123.0;tcp://10.0.0.1:5000", "OMPI_COMM_WORLD_SIZE": "3"}
EXPLICIT = dict(coordinator="10.0.0.1:1234", num_processes=2, process_id=1)


def test_single_process_by_default():
    launch = Launch.plan(environ={})
    assert not launch.multiprocess and launch.processes == 1
    assert launch.local_device_count((2, 4)) == 8
    launch.initialize()  # single process: nothing to initialise, no error
    assert jax.process_count() == 1


def test_explicit_processes():
    launch = Launch.plan(**EXPLICIT, environ={})
    assert launch.multiprocess and launch.processes == 2
    assert launch.coordinator == "10.0.0.1:1234" and launch.process_id == 1
    assert launch.local_device_count((2, 4)) == 4  # 8 devices over 2 processes
    assert launch.local_device_count((1, 4), local_devices=2) == 2
    assert Launch.plan(**EXPLICIT, local_device_ids="0,1", environ={}).local_device_ids == (0, 1)
    assert Launch.plan(**EXPLICIT, local_device_ids=[3], environ={}).local_device_ids == (3,)


@pytest.mark.parametrize("kwargs, message", [
    (dict(coordinator="h:1"), "go together"),
    (dict(num_processes=2, process_id=0), "go together"),
    (dict(coordinator="h:1", num_processes=2, process_id=2),
     "--process-id 2 must be in 0 .. --num-processes - 1"),
    (dict(coordinator="h:1", num_processes=2, process_id=-1), "--process-id -1 must be in"),
    (dict(coordinator="h:1", num_processes=0, process_id=0), "--num-processes must be positive"),
    (dict(distributed="off", **EXPLICIT), "contradicts"),
    (dict(local_device_ids="0;1"), "expected integers"),
    (dict(distributed="maybe"), "--distributed 'maybe'"),
])
def test_bad_combinations(kwargs, message):
    with pytest.raises(ValueError) as err:
        Launch.plan(**kwargs, environ={})
    assert message in str(err.value)


def test_mesh_must_divide_over_processes():
    launch = Launch.plan(coordinator="h:1", num_processes=3, process_id=0, environ={})
    with pytest.raises(ValueError, match=r"--mesh 2,4 \(8 devices\) does not divide over 3 "
                                         r"processes; set --local-devices"):
        launch.local_device_count((2, 4))
    assert launch.local_device_count((2, 4), local_devices=3) == 3
    with pytest.raises(ValueError, match="--local-devices must be positive"):
        launch.local_device_count((2, 4), local_devices=0)


def test_slurm_launch_is_detected():
    """srun with 4 tasks: jax.distributed.initialize() auto-detects the rest."""
    assert cluster_tasks(SLURM) == 4
    launch = Launch.plan(environ=SLURM)
    assert launch.multiprocess and launch.processes == 4
    assert launch.coordinator is None  # left to JAX's cluster detection
    assert launch.local_device_count((2, 4)) == 2
    assert not Launch.plan(distributed="off", environ=SLURM).multiprocess
    # A launcher may supply what the flags leave out.
    assert Launch.plan(process_id=3, environ=SLURM).multiprocess
    one_task = {**SLURM, "SLURM_NTASKS": "1"}  # one task: a plain single-process run
    assert not Launch.plan(environ=one_task).multiprocess
    forced = Launch.plan(distributed="on", environ=one_task)
    assert forced.multiprocess and forced.processes == 1
    # Without every SLURM variable JAX would not detect a cluster either.
    partial = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
    assert cluster_tasks(partial) is None and not Launch.plan(environ=partial).multiprocess


def test_open_mpi_launch_is_detected():
    assert cluster_tasks(OPEN_MPI) == 3
    launch = Launch.plan(environ=OPEN_MPI)
    assert launch.multiprocess and launch.processes == 3
    assert cluster_tasks({"OMPI_COMM_WORLD_SIZE": "3"}) is None


def test_parse_local_device_ids():
    assert parse_local_device_ids("0,1,2,3") == (0, 1, 2, 3)
    with pytest.raises(ValueError, match=r"--local-device-ids '0,a': expected integers"):
        parse_local_device_ids("0,a")


def test_from_command_line_flags():
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    args = parser.parse_args(["--coordinator", "h:1", "--num-processes", "2",
                              "--process-id", "0", "--local-device-ids", "0,1",
                              "--cpu-devices", "2"])
    assert args.local_devices == 2
    launch = Launch.from_args(args, environ={})
    assert launch == Launch(multiprocess=True, processes=2, coordinator="h:1",
                            num_processes=2, process_id=0, local_device_ids=(0, 1))
    defaults = parser.parse_args([])
    assert defaults.distributed == "auto" and defaults.local_devices is None
    assert not Launch.from_args(defaults, environ={}).multiprocess


def test_build_mesh():
    mesh = build_mesh((2, 4))
    assert dict(mesh.shape) == {"data": 2, "tensor": 4}
    assert list(mesh.devices.flat) == jax.devices()[:8]
    small = build_mesh((1, 2), axis_names=("x", "y"))
    assert dict(small.shape) == {"x": 1, "y": 2}
    with pytest.raises(ValueError, match=r"--mesh 4,4 needs 16 devices, found 8 \(cpu\)"):
        build_mesh((4, 4))


@pytest.mark.parametrize("peer_timeout_s", [6.0, 30.0, 60.0, 120.0])
def test_jax_timeouts_come_after_every_watchdog(peer_timeout_s):
    """JAX's coordination service aborts every process (SIGABRT, a C++ stack trace) once a
    process misses heartbeats for up to 10 s less than its heartbeat timeout (measured:
    tests/test_faults.py::test_jax_heartbeat_abort_comes_near_its_timeout). Every
    sp_jax watchdog must end the run first: the longest bound is a first call's
    (--peer-timeout + --compile-allowance) plus the heartbeats' naming of the culprit
    (two 5-s intervals, two 3-s reads) and process 0's wait for the others to leave."""
    from sp_jax.training.faults import Heartbeats

    launch = Launch.plan(**EXPLICIT, peer_timeout_s=peer_timeout_s, environ={})
    timeouts = launch.jax_timeouts()
    interval = Heartbeats.interval_for(peer_timeout_s)
    naming_s = 2 * interval + 0.5 + 2 * 3.0
    leaving_s = 5.0 + 2 * interval
    longest_watch = peer_timeout_s + launch.compile_allowance_s + naming_s + leaving_s
    jax_lag_s = 10.0
    assert timeouts["heartbeat_timeout_seconds"] - jax_lag_s > longest_watch
    # jax.distributed.initialize and the final barrier are watched with --peer-timeout
    assert timeouts["initialization_timeout"] - jax_lag_s > peer_timeout_s
    assert timeouts["shutdown_timeout_seconds"] - jax_lag_s > peer_timeout_s + naming_s
    assert all(isinstance(v, int) for v in timeouts.values())  # JAX takes whole seconds


def test_timeouts_must_be_positive_and_finite():
    for flag, bad in (("peer_timeout_s", float("inf")), ("compile_allowance_s", 0.0),
                      ("compile_allowance_s", float("nan"))):
        with pytest.raises(ValueError, match="must be a positive number of seconds"):
            Launch.plan(**EXPLICIT, **{flag: bad}, environ={})

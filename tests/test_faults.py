"""Faults of training runs: signals, processes that disagree, never start, die or stall,
diverging losses.

Unit checks of sp_jax.training.faults (signals and the watchdog in small subprocesses),
then examples/train_gpt.py as 2 jax.distributed processes x 4 simulated CPU devices, all
concurrently in one module fixture:

* ``mismatch``: processes started with different ``--seed``: both exit at once with
  EXIT_PEER_FAILED naming the setting;
* ``missing``: process 0 alone (process 1 never starts): it ends after ``--peer-timeout``;
* ``killed`` / ``stalled``: process 1 killed with SIGKILL / stopped with SIGSTOP after the
  first step: process 0 ends within the ``--peer-timeout`` bound, with EXIT_PEER_FAILED
  and one line naming the step and process 1;
* ``killed_coordinator`` / ``stalled_coordinator``: the same to process 0, which hosts
  JAX's coordination service;
* ``failed``: process 0's log on a full disk (``/dev/full``): it ends with EXIT_ERROR
  naming the file, and process 1 within a heartbeat interval, naming process 0's error.

SIGTERM to one of 2 processes, and the resume to the same losses, are in
tests/test_multiprocess.py (next to their 1-process reference run).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest
from _util import (
    ROOT,
    free_port,
    launch,
    process_env,
    read_jsonl,
    two_processes,
    wait_all,
    wait_until,
)

from sp_jax.training import faults
from sp_jax.training.faults import DivergenceGuard, check_same_settings

DATA = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
STEPS = 3
FLAGS = ["--seq-len", "32", "--hidden", "32", "--heads", "4", "--layers", "1",
         "--batch-size", "8", "--micro-batches", "2", "--mesh", "2,4", "--data", DATA,
         "--eval-every", "0", "--no-progress", "--steps", str(STEPS)]
PEER_TIMEOUT_S = 6
# the watchdog's limit, then naming the culprit (two heartbeat intervals of 0.75 s, two
# reads), with the slack of 2 cores shared by 12 processes
BOUND_S = PEER_TIMEOUT_S + 15
TIMEOUT_S = 240


# -- units ------------------------------------------------------------------------------

def test_divergence_guard():
    guard = DivergenceGuard(3.0, window=4, min_history=2)
    assert guard.check(float("nan")) == "loss is nan"
    assert "inf" in guard.check(float("inf"), "held-out loss")
    assert guard.check(100.0) is None  # no history yet
    guard.record(100.0)
    assert guard.check(1000.0) is None  # still too little history for a spike
    guard.recent.clear()
    for loss in (5.0, 4.0, 3.0, 2.5):
        assert guard.check(loss) is None
        guard.record(loss)
    assert guard.check(11.9) is None  # the median of (5, 4, 3, 2.5) is 4
    reason = guard.check(12.5)
    assert reason and "over 3x the median of the last 4 training losses (4)" in reason
    assert DivergenceGuard(0).check(1e30) is None  # finiteness only
    for bad in (1.0, 0.5, -2.0, float("inf")):
        with pytest.raises(ValueError, match="factor > 1"):
            DivergenceGuard(bad)


def test_same_settings_is_free_in_one_process():
    check_same_settings({"seed": 0}, timeout_s=0.1)  # nothing to agree with


def _python(code: str, timeout: float = 60) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                            env=process_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_first_signal_requests_a_stop_second_exits_at_once():
    proc = _python("""
        import os, signal, sys, time
        from sp_jax.training.faults import StopSignals
        with StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):
                if signals.received:
                    break
                time.sleep(0.05)
            print("received", signals.received, flush=True)
            time.sleep(60)  # a long blocking call: the second signal must end it
        print("not reached", flush=True)
    """)
    line = proc.stdout.readline()
    assert line.strip() == "received SIGTERM", (line, proc.stderr.read())
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT, (out, err)
    assert time.monotonic() - t0 < 10
    assert "not reached" not in out
    assert "SIGTERM received: stopping after the current step" in err
    assert f"SIGINT again: exiting now (status {128 + signal.SIGINT})" in err


def test_a_repeated_sigterm_within_the_window_is_the_same_request():
    # SLURM delivers one stop twice (to the step, and to every process with --full; a batch
    # script passing its own TERM on adds one): within repeat_window_s it is one request.
    proc = _python("""
        import os, signal, time
        from sp_jax.training.faults import StopSignals
        with StopSignals(repeat_window_s=2.0) as signals:
            t0 = time.monotonic()
            for _ in range(3):
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
            time.sleep(0.5)
            print("still here", signals.received, flush=True)
            time.sleep(max(0.0, t0 + 2.5 - time.monotonic()))
            print("window over", flush=True)
            time.sleep(60)  # a TERM after the window is a second request: it exits
        print("not reached", flush=True)
    """)
    assert proc.stdout.readline().strip() == "still here SIGTERM", proc.stderr.read()
    assert proc.stdout.readline().strip() == "window over"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, (out, err)
    assert err.count("SIGTERM received: stopping after the current step") == 1, err
    assert err.count("SIGTERM again: exiting now") == 1, err


def test_watchdog_ends_a_stalled_call():
    proc = _python("""
        import time
        from sp_jax.training.faults import Watchdog
        with Watchdog(1.0).watch("step 3"):
            time.sleep(0.2)  # in time
        with Watchdog(1.0, name="process 1").watch("step 4"):
            time.sleep(60)
    """)
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == faults.EXIT_PEER_FAILED, (out, err)
    assert time.monotonic() - t0 < 20
    assert ("error: process 1: step 4 made no progress for 1 s: another process is stalled, "
            "dead or was never started (--peer-timeout)") in err
    assert "step 3" not in err


# -- two processes ----------------------------------------------------------------------

def _wait_for_step(log: Path, step: int, procs, deadline: float) -> bool:
    """Polls ``log`` until it records ``step`` (False if a process ended or time ran out)."""
    return wait_until(lambda: any(r.get("step", 0) >= step and "loss" in r
                                  for r in _records(log)), procs, deadline)


def _records(log: Path) -> list[dict]:
    try:
        return read_jsonl(log)
    except ValueError:  # a line being written
        return []


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("faults")
    deadline = time.monotonic() + TIMEOUT_S
    long_run = [*FLAGS[:-1], "100000", "--peer-timeout", str(PEER_TIMEOUT_S)]
    # tag -> (the process hit, the signal); the other one must end within the bound
    faults_of = {"killed": (1, signal.SIGKILL), "stalled": (1, signal.SIGSTOP),
                 "killed_coordinator": (0, signal.SIGKILL),
                 "stalled_coordinator": (0, signal.SIGSTOP)}
    hit = {tag: two_processes(tmp, tag, long_run) for tag in faults_of}
    mismatch = two_processes(tmp, "mismatch", FLAGS, (["--seed", "0"], ["--seed", "1"]))
    # Process 0's log is on a full disk (/dev/full): it stops with an error of its own.
    failed = two_processes(tmp, "failed", long_run, (["--log-json", "/dev/full"], []))
    # Process 1 is never started.
    missing = {"missing0": launch([*FLAGS, "--coordinator", f"127.0.0.1:{free_port()}",
                                   "--num-processes", "2", "--process-id", "0",
                                   "--peer-timeout", str(PEER_TIMEOUT_S)],
                                  tmp / "missing0.out")}
    t0 = time.monotonic()
    codes = wait_all(mismatch, deadline)
    mismatch_s = time.monotonic() - t0
    codes.update(wait_all(missing, deadline))
    missing_s = time.monotonic() - t0
    codes.update(wait_all(failed, deadline))
    bound_s = {}
    for tag, (victim, fault) in faults_of.items():
        procs = hit[tag]
        if _wait_for_step(tmp / f"{tag}0.jsonl", 1, procs, deadline):
            procs[f"{tag}{victim}"].send_signal(fault)
            t_fault, other = time.monotonic(), f"{tag}{1 - victim}"
            codes.update(wait_all({other: procs[other]}, t_fault + 3 * PEER_TIMEOUT_S + 20))
            bound_s[tag] = time.monotonic() - t_fault
    codes.update(wait_all({k: v for procs in hit.values() for k, v in procs.items()},
                          time.monotonic()))  # the rest: killed
    outputs = {name: (tmp / f"{name}.out").read_text(errors="replace") for name in codes}
    return dict(tmp=tmp, codes=codes, out=outputs, mismatch_s=mismatch_s,
                missing_s=missing_s, bound_s=bound_s)


def _status(runs, name: str, expected: int) -> str:
    assert runs["codes"][name] == expected, (
        f"{name}: exit {runs['codes'][name]}, expected {expected}\n{runs['out'][name][-4000:]}")
    return runs["out"][name]


@pytest.mark.slow
def test_mismatched_flags_fail_fast_naming_the_setting(runs):
    for name in ("mismatch0", "mismatch1"):
        out = _status(runs, name, faults.EXIT_PEER_FAILED)
        assert "started with different settings (seed: process 0 0, process 1 1)" in out, out
    assert runs["mismatch_s"] < 60  # seconds: no model was built, nothing waited


@pytest.mark.slow
def test_missing_peer_ends_the_run_within_the_bound(runs):
    out = _status(runs, "missing0", faults.EXIT_PEER_FAILED)
    assert ("error: process 0: starting: waiting for all 2 processes (each with its own "
            "--process-id) to connect to the coordinator at 127.0.0.1:") in out, out[-3000:]
    assert f"made no progress for {PEER_TIMEOUT_S} s" in out
    # Its start-up (imports, connecting) is that of the mismatched pair, started at the same
    # time and ended before any wait: the missing peer costs the timeout on top, not more.
    assert runs["missing_s"] - runs["mismatch_s"] < PEER_TIMEOUT_S + 15, runs
    assert runs["missing_s"] < TIMEOUT_S / 2, runs


def _line(out: str) -> str:
    """The one ``error:`` line of a process's output (asserting there is exactly one and
    no traceback)."""
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    return errors[0]


# Where the surviving process waited when the peer stopped: in a step's collectives, or
# (when the stop lands between steps) in the agreement on whether to stop after one.
WAITED_IN = r"(step \d+|agreeing whether to stop after step \d+)"


@pytest.mark.slow
def test_stalled_peer_ends_the_other_within_the_bound(runs):
    """Process 1 stopped (SIGSTOP) mid-run: process 0's step waits for it in a
    collective; the watchdog ends process 0 after --peer-timeout, naming the step and,
    from the heartbeats, process 1 and where it was last seen."""
    assert "stalled" in runs["bound_s"], runs["out"]["stalled0"][-3000:]
    out = _status(runs, "stalled0", faults.EXIT_PEER_FAILED)
    assert runs["bound_s"]["stalled"] < BOUND_S, runs["bound_s"]
    assert re.fullmatch(rf"error: process 0: {WAITED_IN} made no progress for {PEER_TIMEOUT_S} s: "
                        rf"process 1 \(last seen in (after )?{WAITED_IN}\) stopped answering: it "
                        r"is stalled or dead \(--peer-timeout\); exiting with status 4",
                        _line(out)), out[-3000:]


@pytest.mark.slow
def test_stalled_coordinator_ends_the_others_within_the_bound(runs):
    """Process 0, which hosts JAX's coordination service, stopped: process 1's watchdog
    ends it after --peer-timeout (JAX's own heartbeat timeout comes much later), naming
    process 0 by the key-value store that no longer answers."""
    assert "stalled_coordinator" in runs["bound_s"], runs["out"]["stalled_coordinator1"][-3000:]
    out = _status(runs, "stalled_coordinator1", faults.EXIT_PEER_FAILED)
    assert runs["bound_s"]["stalled_coordinator"] < BOUND_S, runs["bound_s"]
    assert re.fullmatch(rf"error: process 1: {WAITED_IN} made no progress for {PEER_TIMEOUT_S} s: "
                        "process 0, which hosts the coordination service, does not answer: "
                        r"it is stalled or dead \(--peer-timeout\); exiting with status 4",
                        _line(out)), out[-3000:]


@pytest.mark.slow
def test_killed_peer_ends_the_other_within_the_bound(runs):
    assert "killed" in runs["bound_s"], runs["out"]["killed0"][-3000:]
    out = _status(runs, "killed0", faults.EXIT_PEER_FAILED)
    assert runs["bound_s"]["killed"] < BOUND_S, runs["bound_s"]
    # gloo usually reports the lost connection in the next collective; where the
    # collective just waits (as NCCL does), the watchdog ends it after --peer-timeout.
    assert re.fullmatch(r"error: process 0: (step \d+: a collective with the other processes "
                        r"failed \(.*\)|step \d+ made no progress for "
                        rf"{PEER_TIMEOUT_S} s): process 1 \(last seen in .*\) stopped "
                        r"answering: it is stalled or dead.*; exiting with status 4",
                        _line(out)), out[-3000:]


@pytest.mark.slow
def test_killed_coordinator_is_ended_by_jax(runs):
    """Process 0 killed: it hosted JAX's coordination service, and jaxlib ends every
    other process at once itself (SIGABRT from a C++ thread, with its own message and
    stack trace, which sp_jax cannot intercept): within seconds, nothing hangs
    (docs/errors.md, Faults)."""
    assert "killed_coordinator" in runs["bound_s"], runs["out"]["killed_coordinator1"][-3000:]
    assert runs["bound_s"]["killed_coordinator"] < BOUND_S, runs["bound_s"]
    code, out = runs["codes"]["killed_coordinator1"], runs["out"]["killed_coordinator1"]
    assert code in (-signal.SIGABRT, faults.EXIT_PEER_FAILED), (code, out[-3000:])
    if code == -signal.SIGABRT:
        assert "Terminating process because the JAX distributed service detected fatal " \
               "errors" in out, out[-3000:]


@pytest.mark.slow
def test_an_error_of_one_process_ends_the_others_at_once(runs):
    """Process 0 cannot write its log (a full disk): it stops with one line naming the
    file (exit 1) and tells the others, which end within a heartbeat interval with one
    line naming it (exit 4) instead of waiting for it in the next collective."""
    out0 = _status(runs, "failed0", faults.EXIT_ERROR)
    assert re.fullmatch(r"error: MetricsLog: cannot write /dev/full \(a record of step 1\): "
                        r"No space left on device; it holds no complete record", _line(out0)), \
        out0[-3000:]
    out1 = _status(runs, "failed1", faults.EXIT_PEER_FAILED)
    assert re.fullmatch(r"error: process 1: [a-z ]*step \d+: stopping because process 0 "
                        r"failed: MetricsLog: cannot write /dev/full .*; exiting with status 4",
                        _line(out1)), out1[-3000:]


_HEARTBEAT = """
import sys, time
import jax
jax.distributed.initialize(f"127.0.0.1:{sys.argv[2]}", 2, int(sys.argv[1]),
                           heartbeat_timeout_seconds=int(sys.argv[3]))
print("connected", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_jax_heartbeat_abort_comes_near_its_timeout(tmp_path):
    """JAX's own backstop, measured: process 1 stopped (SIGSTOP), process 0 is aborted
    by JAX's coordination service between 10 s before its heartbeat timeout and a little
    after it. Launch.jax_timeouts (tests/test_launch.py) puts that timeout after every
    sp_jax watchdog with this lag accounted for."""
    heartbeat_s, port = 20, str(free_port())
    procs = []
    for i in range(2):
        with (tmp_path / f"p{i}.out").open("w") as log:  # the child keeps its descriptor
            procs.append(subprocess.Popen([sys.executable, "-c", _HEARTBEAT, str(i), port,
                                           str(heartbeat_s)], env=process_env(), stdout=log,
                                          stderr=subprocess.STDOUT))
    try:
        assert wait_until(lambda: all("connected" in (tmp_path / f"p{i}.out").read_text()
                                      for i in range(2)), dict(enumerate(procs)),
                          time.monotonic() + 120)
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        procs[0].wait(timeout=heartbeat_s + 30)
        lag_s = time.monotonic() - t0
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert procs[0].returncode == -signal.SIGABRT
    assert heartbeat_s - 10 <= lag_s <= heartbeat_s + 5, lag_s

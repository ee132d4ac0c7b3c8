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
  and one line.

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


def test_mismatched_flags_fail_fast_naming_the_setting(runs):
    for name in ("mismatch0", "mismatch1"):
        out = _status(runs, name, faults.EXIT_PEER_FAILED)
        assert "started with different settings (seed: process 0 0, process 1 1)" in out, out
    assert runs["mismatch_s"] < 60  # seconds: no model was built, nothing waited


def test_missing_peer_ends_the_run_within_the_bound(runs):
    out = _status(runs, "missing0", faults.EXIT_PEER_FAILED)
    assert ("error: process 0: starting: waiting for all 2 processes (each with its own "
            "--process-id) to connect to the coordinator at 127.0.0.1:") in out, out[-3000:]
    assert f"made no progress for {PEER_TIMEOUT_S} s" in out
    assert runs["missing_s"] < PEER_TIMEOUT_S + 30


def test_stalled_peer_ends_the_other_within_the_bound(runs):
    """Process 1 stopped (SIGSTOP) mid-run: process 0's step waits for it in a
    collective; the watchdog ends process 0 after --peer-timeout."""
    assert "stalled" in runs["bound_s"], runs["out"]["stalled0"][-3000:]
    out = _status(runs, "stalled0", faults.EXIT_PEER_FAILED)
    assert runs["bound_s"]["stalled"] < PEER_TIMEOUT_S + 10, runs["bound_s"]
    assert re.search(rf"error: process 0: step \d+ made no progress for {PEER_TIMEOUT_S} s: "
                     "another process is stalled, dead or was never started", out), out[-3000:]


def test_killed_peer_ends_the_other_within_the_bound(runs):
    assert "killed" in runs["bound_s"], runs["out"]["killed0"][-3000:]
    out = _status(runs, "killed0", faults.EXIT_PEER_FAILED)
    assert runs["bound_s"]["killed"] < PEER_TIMEOUT_S + 10, runs["bound_s"]
    # gloo usually reports the lost connection in the next collective; where the
    # collective just waits (as NCCL does), the watchdog ends it after --peer-timeout.
    assert re.search(r"error: process 0: (a collective with the other processes failed "
                     r"\(.*\): another process died|step \d+ made no progress for "
                     rf"{PEER_TIMEOUT_S} s: another process is stalled, dead)", out), out[-3000:]
    assert "Traceback" not in out

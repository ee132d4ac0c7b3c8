"""SLURM jobs of ``examples/slurm/train.sbatch`` on a real cluster, for the goodput
measurement (``benchmarks/slurm_goodput.py``) and the SLURM tests (``tests/test_slurm.py``):
submit a job, wait for it or for a step, read the batch script's time-stamped lines and the
run's ``--log-json`` losses, find a task's process, and split the seconds from a fault to
the first step after the resume (:func:`breakdown`).

The split, from the batch script's lines and the resumed run's ``--log-json`` records
(``unix_time``, ``time_s``) and resume line:

- ``stop``: the fault until the job step ended (a preemption: the current step, its
  checkpoint and exit 75; a kill: srun's ``--kill-on-bad-exit`` ending the other tasks);
- ``requeue``: the step's end until the requeued batch script starts (SLURM's requeue
  delay, ``AuthInfo=cred_expire``, 120 s by default, then a scheduler pass);
- ``process start``: the batch script's start until the first step begins, less the
  restore (Python and JAX start-up, ``jax.distributed``, building the model, reading data);
- ``restore``: the checkpoint's restore (the resume line);
- ``compile``: the first step's time less a compiled step's (the median of the others);
- ``steps lost``: steps done before the fault that the resumed run trains again.

Needs a checkout (the batch script lives in ``examples/``) and ``SLURM_CONF`` naming a
running cluster (``make slurm-test`` starts one: ``scripts/slurm_cluster.sh``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout holding sp_jax/
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
# The tiny model of the SLURM tests and of this benchmark: 4 simulated CPU devices per
# task; a step takes ~0.15 s, so a signal sent after step 4 lands mid-run.
FLAGS = ["--seq-len", "32", "--hidden", "32", "--heads", "4", "--layers", "1",
         "--batch-size", "8", "--steps", "30", "--eval-every", "10", "--save-every", "5",
         "--no-progress", "--max-data-bytes", "1000000"]
_LINE = re.compile(r"^sp_jax-slurm: (?P<t>[0-9.]+) job (?P<job>\d+) restart (?P<restart>\d+): "
                   r"(?P<text>.*)$")
_RESTORE = re.compile(r"^resume: restored step (?P<step>\d+) .* in (?P<s>[0-9.]+) s$")

__all__ = ["FLAGS", "SBATCH", "batch_lines", "breakdown", "job_info", "losses",
           "not_ready", "submit", "task_pid", "wait_for_step", "wait_job"]


def not_ready() -> str | None:
    """Why no SLURM cluster can take jobs here (None when one can)."""
    if not os.environ.get("SLURM_CONF"):
        return "no SLURM cluster: run `make slurm-test` (it starts one) or set SLURM_CONF"
    if shutil.which("sbatch") is None:
        return "sbatch is not installed (apt-get install slurm-wlm munge)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo failed: {e}"
    if out.returncode or not {"idle", "mix", "alloc"} & set(out.stdout.split()):
        return f"the SLURM cluster of {os.environ['SLURM_CONF']} has no usable node: {out}"
    return None


def submit(ntasks: int, argv: list[str], out: Path, env: dict[str, str] | None = None,
           sbatch_args: tuple[str, ...] = (), script: Path = SBATCH) -> int:
    """``sbatch -n NTASKS SCRIPT ARGV`` (by default examples/slurm/train.sbatch) from the
    checkout, output to ``out``; the job's id. The tasks' Python is this one
    (``PYTHON``)."""
    env = dict(env if env is not None else os.environ, PYTHON=sys.executable)
    count = [] if any(a.startswith(("-N", "--nodes")) for a in sbatch_args) \
        else ["-n", str(ntasks)]
    res = subprocess.run(["sbatch", "--parsable", *count, "-o", str(out),
                          *sbatch_args, str(script), *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    if res.returncode:
        raise RuntimeError(f"sbatch failed ({res.returncode}): {res.stderr.strip()}")
    return int(res.stdout.strip().split(";")[0])


def job_info(job: int) -> dict[str, str]:
    """``scontrol show job``'s fields (``JobState``, ``Restarts``, ``ExitCode``, ...)."""
    res = subprocess.run(["scontrol", "show", "job", "-o", str(job)], capture_output=True,
                         text=True, timeout=30)
    if res.returncode:
        raise RuntimeError(f"scontrol show job {job}: {res.stderr.strip()}")
    return dict(part.split("=", 1) for part in res.stdout.split() if "=" in part)


def wait_job(job: int, deadline: float) -> dict[str, str]:
    """Waits until ``job`` has ended for good (a requeued job runs again first); its
    fields. Cancels it at ``deadline`` (monotonic) and raises TimeoutError."""
    while True:
        info = job_info(job)
        if info["JobState"] in TERMINAL:
            return info
        if time.monotonic() > deadline:
            subprocess.run(["scancel", str(job)], timeout=30)
            raise TimeoutError(f"job {job} still {info['JobState']} at the deadline")
        time.sleep(0.5)


def _records(log: Path) -> list[dict[str, Any]]:
    """The records of a ``--log-json`` file (none when it does not exist yet)."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def losses(log: Path) -> dict[int, float]:
    """step -> training loss of a ``--log-json`` file."""
    return {r["step"]: r["loss"] for r in _records(log) if "loss" in r}


def wait_for_step(log: Path, step: int, job: int, deadline: float,
                  after: float = 0.0) -> float:
    """Waits until ``log`` has the loss of ``step`` or later, logged after ``after``
    (unix time); returns when (unix time). Raises TimeoutError at ``deadline``, or when
    the job ended first."""
    while time.monotonic() < deadline:
        if any("loss" in r and r["step"] >= step and r.get("unix_time", 0) > after
               for r in _records(log)):
            return time.time()
        if job_info(job)["JobState"] in TERMINAL:
            raise TimeoutError(f"job {job} ended before step {step}")
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} in {log} by the deadline")


def batch_lines(out: Path) -> list[tuple[float, int, str]]:
    """The batch script's time-stamped lines: (unix time, restart, text)."""
    found = []
    for line in out.read_text(errors="replace").splitlines():
        if m := _LINE.match(line.strip()):
            found.append((float(m["t"]), int(m["restart"]), m["text"]))
    return found


def task_pid(job: int, procid: int, timeout_s: float = 30.0) -> int:
    """The process id of task ``procid`` of ``job``'s training step (the Python process
    whose environment has that SLURM_JOB_ID and SLURM_PROCID)."""
    want = {b"SLURM_JOB_ID=" + str(job).encode(), b"SLURM_PROCID=" + str(procid).encode()}
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes()
                env = set((entry / "environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if b"train_gpt.py" in cmd and want <= env and b"python" in cmd.split(b"\0")[0]:
                return int(entry.name)
        time.sleep(0.2)
    raise TimeoutError(f"no process of task {procid} of job {job}")


def breakdown(out: Path, log: Path, fault_t: float, done_at_fault: int) -> dict[str, Any]:
    """Where the seconds from a fault (unix time ``fault_t``) to the first step after the
    resume went (see the module doc), from the job's output ``out`` and its ``log``;
    ``done_at_fault`` is the last step logged before the fault."""
    lines = batch_lines(out)
    ended = next(t for t, _, text in lines if t >= fault_t and "the step ended" in text)
    restart = next(r for t, r, text in lines if t > ended and text.startswith("starting"))
    started = next(t for t, r, text in lines if r == restart and text.startswith("starting"))
    restored, restore_s, seen = 0, 0.0, False  # the resume line after that start
    for line in out.read_text(errors="replace").splitlines():
        m = _LINE.match(line.strip())
        if m and float(m["t"]) == started:
            seen = True
        elif seen and (m := _RESTORE.match(line.strip())):
            restored, restore_s = int(m["step"]), float(m["s"])
            break
    steps = [r for r in _records(log) if "loss" in r and r.get("unix_time", 0) > started]
    first = steps[0]
    step_s = statistics.median(r["time_s"] for r in steps[1:]) if len(steps) > 1 else 0.0
    first_began = first["unix_time"] - first["time_s"]
    return {"stop_s": ended - fault_t, "requeue_s": started - ended,
            "process_start_s": first_began - started - restore_s, "restore_s": restore_s,
            "compile_s": first["time_s"] - step_s, "step_s": step_s,
            "fault_to_first_step_s": first["unix_time"] - fault_t,
            "restored_step": restored, "steps_lost": max(0, done_at_fault - restored)}

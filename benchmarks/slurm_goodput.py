"""Goodput of examples/slurm/train.sbatch under a real SLURM cluster: for a preemption
(``scancel --signal=TERM``) and a killed task (SIGKILL), the seconds from the fault to the
first training step after the resume, split into what they are spent on, and the steps
lost (the job helpers and the split: :mod:`sp_jax.analysis.slurm`, which
``tests/test_slurm.py`` uses too).

    make slurm-test                                  # starts a cluster, runs the tests
    scripts/slurm_cluster.sh start /tmp/slurm && SLURM_CONF=/tmp/slurm/slurm.conf \\
        python -m benchmarks.slurm_goodput [--json PATH]

The split into stop, requeue, process start, restore, compile and steps lost:
:func:`sp_jax.analysis.slurm.breakdown`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from sp_jax.analysis.slurm import (
    FLAGS,
    breakdown,
    losses,
    not_ready,
    submit,
    task_pid,
    wait_for_step,
    wait_job,
)

__all__ = ["main"]


def _measure(kind: str, tmp: Path, deadline: float, env: dict[str, str]) -> dict[str, Any]:
    """One job of 2 tasks, one fault (``kind``: "preempt" or "kill") after step 7."""
    out, log = tmp / f"{kind}.out", tmp / f"{kind}.jsonl"
    job = submit(2, [*FLAGS, "--mesh", "2,4", "--peer-timeout", "30", "--ckpt-dir",
                     str(tmp / f"ckpt_{kind}"), "--log-json", str(log)], out, env)
    wait_for_step(log, 7, job, deadline)
    done = max(losses(log))
    fault_t = time.time()
    if kind == "preempt":
        subprocess.run(["scancel", "--signal=TERM", str(job)], check=True, timeout=30)
    else:
        os.kill(task_pid(job, 1), signal.SIGKILL)
    info = wait_job(job, deadline)
    if info["JobState"] != "COMPLETED":
        raise RuntimeError(f"{kind}: job {job} ended {info['JobState']}: {out.read_text()}")
    return {"kind": kind, "job": job, **breakdown(out, log, fault_t, done)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--dir", type=Path, default=Path("runs/slurm_goodput"),
                   help="checkpoints, logs and job output (shared by the tasks)")
    p.add_argument("--kinds", nargs="+", default=["preempt", "kill"],
                   choices=["preempt", "kill"], help="the faults to measure")
    args = p.parse_args(argv)
    if reason := not_ready():
        print(reason, file=sys.stderr)
        return 2
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    cache = args.dir / "jax_cache"
    results = []
    for kind in args.kinds:
        for cached in (False, True):  # the persistent compilation cache of the resumed run
            env = dict(os.environ)
            env.pop("JAX_COMPILATION_CACHE_DIR", None)
            if cached:
                env.update(JAX_COMPILATION_CACHE_DIR=str(cache.resolve()),
                           JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
            tmp = args.dir / f"{kind}_{'cache' if cached else 'nocache'}"
            tmp.mkdir()
            res = _measure(kind, tmp, time.monotonic() + 600, env)
            res["compilation_cache"] = cached
            results.append(res)
            print(json.dumps(res), flush=True)
    conf = Path(os.environ["SLURM_CONF"]).read_text()
    meta = {"cred_expire": re.search(r"cred_expire=(\d+)", conf)[1]
            if "cred_expire" in conf else "120 (default)",
            "sched": re.search(r"SchedulerParameters=(\S+)", conf)[1]
            if "SchedulerParameters" in conf else "default"}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

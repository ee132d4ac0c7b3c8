"""examples/train_gpt.py as 2 processes x 4 simulated CPU devices (jax.distributed on
loopback, gloo collectives) trains exactly like 1 process with 8 devices, and stops and
resumes together after a SIGTERM to one of them. The data are packed documents
(``--tokenizer bytes``: sp_jax.data.PackedText): each process reads only the streams of
its rows, the global batches are the 1-process run's, and the input pipeline's position
saved by 1 process (or by 2, merged) resumes in 2.

First, concurrently: the 1-process reference (4 steps, checkpoints at steps 3 and 4; the
warmup is 20 steps, so steps 1-4 do not depend on --steps) and a 2-process run of the same
4 steps whose process 1 alone receives SIGTERM before its first step. Then the 2
processes resume from the reference's step-3 checkpoint and train step 4, and the
interrupted run resumes from its own checkpoint to step 4. Checked: the signalled run
stops both processes after the same step with one checkpoint (exit 75); process 0 alone
writes the log; the interrupted and resumed run's losses and held-out losses are the
reference's; the checkpoint the two processes wrote together (each its own shards) holds
the reference's parameters and optimizer state; restoring the reference's checkpoint in 2
processes continues the reference run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sysconfig
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from _util import launch, read_jsonl, two_processes, wait_all, wait_until
from flax import nnx

from sp_jax.checkpoint import restore_checkpoint
from sp_jax.models import GPT, GPTConfig
from sp_jax.training import faults

pytestmark = pytest.mark.slow  # the whole file: make test only, not make test-fast
DATA = os.path.join(sysconfig.get_paths()["stdlib"], "email", "*.py")  # 20 documents
STEPS = 3
FLAGS = ["--seq-len", "32", "--hidden", "32", "--heads", "4", "--layers", "1",
         "--batch-size", "8", "--micro-batches", "2", "--mesh", "2,4", "--data", DATA,
         "--tokenizer", "bytes",
         "--eval-every", "3", "--save-every", "3", "--no-progress"]
TIMEOUT_S = 240
# Gloo's cross-process all-reduce sums in another order than XLA:CPU's in-process one:
# the losses agree to the last bit or two (observed: <= 1e-7 relative).
RTOL = 1e-6


def _launch(*extra: str, log: Path) -> subprocess.Popen:
    return launch([*FLAGS, *extra], log)


def _two_processes(tmp: Path, tag: str, *extra: str) -> dict[str, subprocess.Popen]:
    return two_processes(tmp, tag, [*FLAGS, *extra])  # 8 / 2 = 4 devices each


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multiprocess")
    deadline = time.monotonic() + TIMEOUT_S
    procs = {}
    procs["single"] = _launch("--steps", str(STEPS + 1), "--ckpt-dir", str(tmp / "ckpt_1x8"),
                              "--log-json", str(tmp / "single.jsonl"),
                              log=tmp / "single.out")
    interrupted = _two_processes(tmp, "int", "--steps", str(STEPS + 1),
                                 "--ckpt-dir", str(tmp / "ckpt_int"))
    # Process 0 prints the model line after building the model, which every process does
    # together (after installing its signal handling): then process 1 alone is signalled.
    out0 = tmp / "int0.out"
    signalled = wait_until(lambda: "model:" in out0.read_text(errors="replace"), interrupted,
                           deadline)
    if signalled:
        interrupted["int1"].send_signal(signal.SIGTERM)
    codes = wait_all({**procs, **interrupted}, deadline)
    codes["signalled"] = 0 if signalled else None
    interrupted_at = _steps(tmp / "ckpt_int") if (tmp / "ckpt_int").is_dir() else []
    (tmp / "int_steps.json").write_text(json.dumps(interrupted_at))  # before the resume
    later = {}
    if codes["single"] == 0:
        # The reference's step-3 checkpoint, restored by 2 processes (each reads its shards)
        # with the parameters and optimizer state sharded over data as well (--fsdp).
        shutil.copytree(tmp / "ckpt_1x8" / str(STEPS), tmp / "ckpt_resume" / str(STEPS))
        later.update(_two_processes(tmp, "resumed", "--steps", str(STEPS + 1), "--resume",
                                    "--fsdp", "--ckpt-dir", str(tmp / "ckpt_resume")))
    if (tmp / "int0.jsonl").exists():
        shutil.copy(tmp / "int0.jsonl", tmp / "intres0.jsonl")  # one log, continued
        later.update(_two_processes(tmp, "intres", "--steps", str(STEPS + 1), "--resume",
                                    "--ckpt-dir", str(tmp / "ckpt_int")))
    codes.update(wait_all(later, deadline + TIMEOUT_S))
    outputs = {name: (tmp / f"{name}.out").read_text(errors="replace")
               for name in codes if (tmp / f"{name}.out").exists()}
    return tmp, codes, outputs


def _steps(directory: Path) -> list[int]:
    return sorted(int(name) for name in os.listdir(directory) if name.isdigit())


def _ok(runs, name: str) -> str:
    _, codes, outputs = runs
    assert codes[name] == 0, f"{name}: exit {codes[name]}\n{outputs[name][-4000:]}"
    return outputs[name]


def test_two_processes_log_the_losses_of_one(runs):
    """The interrupted and resumed 2-process run's one log (steps 1-4) holds the 1-process
    run's losses and held-out losses."""
    tmp, _, outputs = runs
    _ok(runs, "single")
    out = _ok(runs, "intres0")
    _ok(runs, "intres1")
    assert "on 8 of 8 cpu devices in 2 processes (4 each)" in outputs["int0"]
    assert f"-{STEPS + 1}, loss" in out and "done: steps" in out
    # Process 0 alone writes the log (and prints).
    assert not (tmp / "int1.jsonl").exists() and not (tmp / "intres1.jsonl").exists()
    assert "done:" not in outputs["intres1"] and "model:" not in outputs["int1"]
    multi, single = read_jsonl(tmp / "intres0.jsonl"), read_jsonl(tmp / "single.jsonl")
    losses = {r["step"]: r["loss"] for r in multi if "loss" in r}
    reference = {r["step"]: r["loss"] for r in single if "loss" in r}
    assert sorted(losses) == sorted(reference) == list(range(1, STEPS + 2))
    for step in losses:
        assert losses[step] == pytest.approx(reference[step], rel=RTOL, abs=0), step
    evals = dict((r["step"], r["eval_loss"]) for r in multi if "eval_loss" in r)
    ref_evals = dict((r["step"], r["eval_loss"]) for r in single if "eval_loss" in r)
    assert sorted(ref_evals) == [0, STEPS, STEPS + 1] and set(ref_evals) <= set(evals)
    for step in ref_evals:
        assert evals[step] == pytest.approx(ref_evals[step], rel=RTOL, abs=0), step


def test_two_processes_save_one_checkpoint(runs):
    """The checkpoint the two resumed processes wrote at step 3 is complete: restored here
    (one process, one device, unsharded, checksums verified), it equals the 1-process
    run's up to the same last-bit differences (a missing shard would read back as
    zeros)."""
    tmp, _, _ = runs
    _ok(runs, "intres0")
    _ok(runs, "single")
    assert STEPS in _steps(tmp / "ckpt_int")
    assert _steps(tmp / "ckpt_1x8") == [STEPS, STEPS + 1]
    model = GPT(GPTConfig(vocab_size=257, max_seq_len=32, num_layers=1, num_heads=4,
                          hidden=32), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    # The example's optimizer structure (clipping, AdamW with a schedule).
    opt_state = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(lambda count: 1e-3)).init(params)
    multi = restore_checkpoint(tmp / "ckpt_int", STEPS, params_like=params,
                               opt_state_like=opt_state)
    single = restore_checkpoint(tmp / "ckpt_1x8", STEPS, params_like=params,
                                opt_state_like=opt_state)
    assert multi.step == single.step == STEPS
    # The recent training losses (for the divergence check) agree to the last bit or two.
    recent, ref_recent = (m.metadata.pop("recent_losses") for m in (multi, single))
    assert recent == pytest.approx(ref_recent, rel=RTOL, abs=0)
    # the input pipeline's position: every stream's, merged from both processes
    assert sorted(multi.metadata["data_state"]["streams"], key=int) == [str(j) for j in range(8)]
    assert multi.metadata == single.metadata
    leaves = jax.tree.leaves((multi.params, multi.opt_state))
    ref_leaves = jax.tree.leaves((single.params, single.opt_state))
    for a, b in zip(leaves, ref_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_two_processes_resume_a_checkpoint(runs):
    """2 processes restore the 1-process run's step-3 checkpoint (each reading the shards
    its devices hold, parameters and optimizer state now sharded over data too: --fsdp)
    and train step 4 as the 1-process run did."""
    tmp, _, _ = runs
    _ok(runs, "single")
    out = _ok(runs, "resumed0")
    _ok(runs, "resumed1")
    assert f"resume: restored step {STEPS}" in out and f"done: steps {STEPS + 1}-" in out
    resumed = {r["step"]: r for r in read_jsonl(tmp / "resumed0.jsonl") if "loss" in r}
    reference = {r["step"]: r for r in read_jsonl(tmp / "single.jsonl") if "loss" in r}
    assert sorted(resumed) == [STEPS + 1]
    assert resumed[STEPS + 1]["loss"] == pytest.approx(reference[STEPS + 1]["loss"], rel=RTOL,
                                                       abs=0)
    assert _steps(tmp / "ckpt_resume") == [STEPS, STEPS + 1]


def test_sigterm_to_one_process_stops_both_after_one_step_with_a_checkpoint(runs):
    tmp, codes, outputs = runs
    assert codes["signalled"] == 0, outputs["int0"][-3000:]
    for name in ("int0", "int1"):
        assert codes[name] == faults.EXIT_INTERRUPTED, f"{name}: {outputs[name][-3000:]}"
    assert "SIGTERM received" in outputs["int1"] and "SIGTERM received" not in outputs["int0"]
    steps = json.loads((tmp / "int_steps.json").read_text())
    assert len(steps) == 1 and 1 <= steps[0] <= STEPS, steps
    assert (f"stopped by another process after step {steps[0]}: checkpoint step {steps[0]} "
            "written to") in outputs["int0"]
    logged = [r["step"] for r in read_jsonl(tmp / "int0.jsonl") if "loss" in r]
    assert logged == list(range(1, steps[0] + 1))


def test_interrupted_run_resumes_to_the_reference_losses(runs):
    tmp, _, _ = runs
    _ok(runs, "single")
    out = _ok(runs, "intres0")
    _ok(runs, "intres1")
    assert "resume: restored step" in out
    resumed = {r["step"]: r["loss"] for r in read_jsonl(tmp / "intres0.jsonl") if "loss" in r}
    reference = {r["step"]: r["loss"] for r in read_jsonl(tmp / "single.jsonl") if "loss" in r}
    assert sorted(resumed) == sorted(reference) == list(range(1, STEPS + 2))
    for step in resumed:
        assert resumed[step] == pytest.approx(reference[step], rel=RTOL, abs=0), step

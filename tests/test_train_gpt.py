"""End-to-end runs of examples/train_gpt.py as a subprocess (tiny model, 8 simulated CPU
devices configured by the example itself), plus how it reports bad flags and data.

The runs share one module fixture. First, concurrently: an uninterrupted 6-step run that
checkpoints every 3 steps; a run of 3 steps that checkpoints and stops; two runs whose loss
blows up (one with --debug-nans). Then, from copies of the 3-step run's checkpoint and log:
a resumed run on the same data=2 x tensor=4 mesh, one resumed on a data=4 x tensor=2 mesh,
and a fresh run refused because the checkpoint directory is not empty.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from _util import script_env

from sp_jax.training import faults

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
DATA = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
# Llama-shaped: 4 query heads over 2 key/value heads, replicated over tensor 4 (pairs)
TINY = ["--preset", "llama-tiny", "--seq-len", "32", "--hidden", "32", "--heads", "4",
        "--layers", "1",
        "--batch-size", "8", "--micro-batches", "2", "--mesh", "2,4", "--data", DATA,
        "--eval-every", "3", "--no-progress"]


def _start(*extra: str) -> subprocess.Popen:
    env = script_env()  # the example configures its own simulated devices
    return subprocess.Popen([sys.executable, str(SCRIPT), *TINY, *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _truncate_an_array_file(step_dir: Path) -> str:
    """Cuts the largest array data file of a checkpoint step in half; returns its path."""
    files = [p for p in (step_dir / "params").rglob("*") if p.is_file()]
    biggest = max(files, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])
    return str(biggest)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_gpt")
    started = {
        "full": _start("--steps", "6", "--save-every", "3", "--ckpt-dir", str(tmp / "ckpt_full"),
                       "--log-json", str(tmp / "full.jsonl"), "--plot", str(tmp / "full.png")),
        "part": _start("--steps", "3", "--save-every", "3", "--ckpt-dir", str(tmp / "ckpt_part"),
                       "--log-json", str(tmp / "part.jsonl")),
        # Blow-ups with the update-ratio and spike checks off: only a non-finite value stops.
        "nan": _start("--steps", "6", "--lr", "1e9", "--warmup-steps", "0",
                      "--max-update-ratio", "0", "--loss-spike", "0",
                      "--log-json", str(tmp / "nan.jsonl")),
        "debug_nans": _start("--steps", "6", "--lr", "1e9", "--warmup-steps", "0",
                             "--max-update-ratio", "0", "--loss-spike", "0", "--debug-nans"),
    }
    results = {name: _finish(proc) for name, proc in started.items()}
    # The full run's checkpoints (steps 3 and 6) with step 6 damaged, resumed on another
    # mesh: it falls back to step 3 and redoes steps 4-6.
    shutil.copytree(tmp / "ckpt_full", tmp / "ckpt_damaged")
    shutil.copy(tmp / "full.jsonl", tmp / "part_4x2.jsonl")
    truncated = _truncate_an_array_file(tmp / "ckpt_damaged" / "6")
    # The 3-step run's checkpoint, resumed with a learning rate that makes it diverge.
    shutil.copytree(tmp / "ckpt_part", tmp / "ckpt_blowup")
    shutil.copy(tmp / "part.jsonl", tmp / "blowup.jsonl")
    started = {
        # Resumed into the same log: its records up to step 3 are kept, steps 4-6 appended.
        "resumed": _start("--steps", "6", "--resume", "--save-every", "3",
                          "--ckpt-dir", str(tmp / "ckpt_part"),
                          "--log-json", str(tmp / "part.jsonl")),
        "resumed_4x2": _start("--steps", "6", "--resume", "--save-every", "3", "--mesh", "4,2",
                              "--ckpt-dir", str(tmp / "ckpt_damaged"),
                              "--log-json", str(tmp / "part_4x2.jsonl")),
        "blowup": _start("--steps", "6", "--resume", "--save-every", "1", "--lr", "1e9",
                         "--ckpt-dir", str(tmp / "ckpt_blowup"),
                         "--log-json", str(tmp / "blowup.jsonl")),
        # Not resuming into a directory with checkpoints: refused before any training.
        "refused": _start("--steps", "6", "--save-every", "3",
                          "--ckpt-dir", str(tmp / "ckpt_full")),
    }
    results.update({name: _finish(proc) for name, proc in started.items()})
    # The diverged run resumed as the first one ran (its --lr): it continues from the
    # last good checkpoint exactly as the uninterrupted run did.
    results["recovered"] = _finish(_start(
        "--steps", "6", "--resume", "--save-every", "3", "--ckpt-dir", str(tmp / "ckpt_blowup"),
        "--log-json", str(tmp / "blowup.jsonl")))
    return tmp, results, truncated


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


def test_run_logs_every_step(runs):
    tmp, results, _ = runs
    _ok(results["full"])
    records = _read(tmp / "full.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert all(math.isfinite(r["eval_loss"]) for r in evals)
    out = results["full"].stdout
    assert "mesh: data=2 x tensor=4 on 8 of 8 cpu devices" in out
    assert "model: Llama-shaped GPT 1 layers, hidden 32, 4 heads (2 key/value)" in out
    assert "optimizer state" in out and "done: steps 1-6" in out


def test_plot_written(runs):
    tmp, *_ = runs
    png = tmp / "full.png"
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoints_saved(runs):
    tmp, *_ = runs
    assert sorted(p.name for p in (tmp / "ckpt_full").iterdir() if p.name.isdigit()) == ["3", "6"]


def test_resume_reproduces_uninterrupted_run(runs):
    tmp, results, _ = runs
    _ok(results["part"])
    _ok(results["resumed"])
    assert "resume: restored step 3" in results["resumed"].stdout
    assert "done: steps 4-6" in results["resumed"].stdout
    evals = _assert_resumed_like_full(tmp, "part.jsonl", rel=1e-6)
    assert [r["step"] for r in evals] == [0, 3, 6]


def _assert_resumed_like_full(tmp, log, rel):
    """The resumed run's log covers steps 1-6, and its steps 4-6 and final held-out loss
    equal the uninterrupted run's within ``rel``; returns its eval records."""
    full = _losses(_read(tmp / "full.jsonl"))
    resumed = _losses(_read(tmp / log))
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=rel, abs=0), step
    evals = [r for r in _read(tmp / log) if "eval_loss" in r]
    full_evals = [r for r in _read(tmp / "full.jsonl") if "eval_loss" in r]
    assert evals[-1]["eval_loss"] == pytest.approx(full_evals[-1]["eval_loss"], rel=rel)
    return evals


def test_nan_loss_stops_with_step(runs):
    tmp, results, _ = runs
    nan = results["nan"]
    assert nan.returncode == faults.EXIT_DIVERGED, nan.stderr[-3000:]
    assert re.search(r"step \d+: training diverged \(loss is (nan|inf|-inf)", nan.stderr), \
        nan.stderr[-3000:]
    logged = _losses(_read(tmp / "nan.jsonl"))
    assert all(math.isfinite(v) for v in logged.values())
    assert len(logged) < 6


def test_diverged_run_saves_nothing_and_resumes_with_a_lower_lr(runs):
    """--lr 1e9 from step 3, saving every step: step 4's update is orders of magnitude
    larger than the weights (the blown-up model's loss alone can look fine: collapsed to
    uniform), so the run stops before saving and step 3 stays the last checkpoint;
    resumed with the original --lr, steps 4-6 equal the uninterrupted run's."""
    tmp, results, _ = runs
    blowup = results["blowup"]
    assert blowup.returncode == faults.EXIT_DIVERGED, blowup.stderr[-3000:]
    assert re.search(r"step 4: training diverged \(the update's norm \S+ is over 1x the "
                     r"parameters' norm", blowup.stderr), blowup.stderr[-3000:]
    assert ("stopped without saving: the last checkpoint, step 3, holds parameters that "
            "gave a good held-out loss: resume from it with a lower --lr") in blowup.stderr
    assert "warning: resuming with changed settings" in blowup.stdout  # lr 3e-3 -> 1e9
    recovered = results["recovered"]
    _ok(recovered)
    assert "resume: restored step 3" in recovered.stdout
    assert sorted(p.name for p in (tmp / "ckpt_blowup").iterdir() if p.name.isdigit()) \
        == ["3", "6"]
    _assert_resumed_like_full(tmp, "blowup.jsonl", rel=1e-6)


def test_resume_onto_another_mesh_falls_back_from_a_damaged_step(runs):
    """Steps 3 and 6 saved on data=2 x tensor=4, step 6 then damaged (an array file cut
    in half); resumed on data=4 x tensor=2: step 6 is named and skipped (moved aside),
    step 3 restored and resharded; the losses agree with the uninterrupted run up to the
    different meshes' summation order."""
    tmp, results, truncated = runs
    _ok(results["resumed_4x2"])
    out = results["resumed_4x2"].stdout
    assert "mesh: data=4 x tensor=2" in out
    assert re.search(r"warning: checkpoint step 6 in \S+ckpt_damaged is damaged: .*; skipped",
                     out), out
    assert "moved damaged checkpoint step 6 aside to" in out
    assert "resume: restored step 3" in out and "onto mesh data=4 x tensor=2" in out
    evals = _assert_resumed_like_full(tmp, "part_4x2.jsonl", rel=1e-5)
    assert evals[-1]["step"] == 6
    assert sorted(p.name for p in (tmp / "ckpt_damaged").iterdir() if p.name.isdigit()) \
        == ["3", "6"]


def test_debug_nans_stops_with_step(runs):
    _, results, _ = runs
    run = results["debug_nans"]
    assert run.returncode == faults.EXIT_DIVERGED, run.stderr[-3000:]
    # JAX's check fires only where it runs (see --help); either way the step is named.
    assert re.search(r"(NaN at step \d+ \(--debug-nans\)|step \d+: training diverged)",
                     run.stderr), run.stderr[-3000:]


def test_fresh_run_refuses_nonempty_checkpoint_dir(runs):
    tmp, results, _ = runs
    run = results["refused"]
    assert run.returncode != 0
    assert f"--ckpt-dir {tmp / 'ckpt_full'} already holds checkpoints (steps [3, 6]); " \
           "pass --resume" in run.stderr, run.stderr[-2000:]
    assert "step 1" not in run.stdout  # nothing trained


# -- command line: the library's rules (tests/test_launch.py, tests/test_data.py) reach the
# user as a usage error or an "error: ..." exit ------------------------------------------

_CLUSTER_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                 "SLURM_LOCALID", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE")


def _run_quick(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=script_env()["XLA_FLAGS"])
    return subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_bad_process_flags_are_usage_errors():
    run = _run_quick("--coordinator", "h:1")
    assert run.returncode == 2, run.stderr[-2000:]
    assert "usage:" in run.stderr
    assert "--coordinator HOST:PORT, --num-processes N and --process-id I go together" \
        in run.stderr
    run = _run_quick("--coordinator", "h:1", "--num-processes", "3", "--process-id", "0")
    assert run.returncode == 2 and "does not divide over 3 processes" in run.stderr


def test_bad_data_is_an_error_exit(tmp_path):
    missing = str(tmp_path / "none" / "*.txt")
    run = _run_quick("--data", missing, "--steps", "1", "--no-progress")
    assert run.returncode == 1, run.stderr[-2000:]
    assert f"error: no files match {missing}" in run.stderr


def test_unreadable_data_file_is_an_error_exit():
    run = _run_quick("--data", "/proc/self/mem", "--steps", "1", "--no-progress")
    assert run.returncode == 1, run.stderr[-2000:]
    assert "error: cannot read data file /proc/self/mem: Input/output error" in run.stderr


def test_second_trainer_on_one_checkpoint_dir_is_refused(tmp_path):
    """One writer per --ckpt-dir: held here, a trainer (or a --resume) is refused, naming
    the holder, before it builds anything."""
    from sp_jax.checkpoint import CheckpointManager

    with CheckpointManager(tmp_path / "ckpt"):
        run = _run_quick(*TINY, "--steps", "2", "--ckpt-dir", str(tmp_path / "ckpt"))
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"is in use by pid {os.getpid()}" in run.stderr, run.stderr[-2000:]


def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    """A mistyped --ckpt-dir with --resume must not start over (and truncate the log)."""
    log = tmp_path / "run.jsonl"
    log.write_text('{"step": 1, "loss": 5.0}\n')
    run = _run_quick(*TINY, "--steps", "2", "--resume", "--ckpt-dir", str(tmp_path / "typo"),
                     "--log-json", str(log))
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "--resume: no checkpoint in --ckpt-dir" in run.stderr
    assert log.read_text() == '{"step": 1, "loss": 5.0}\n'


def test_bad_numbers_and_paths_are_usage_errors(tmp_path):
    """Checked before JAX starts: in-process parse of the example's flags."""
    import contextlib
    import importlib.util
    import io

    spec = importlib.util.spec_from_file_location("train_gpt_flags", SCRIPT)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for argv, message in [
        (["--lr", "-0.003"], "--lr -0.003 must be positive"),
        (["--weight-decay", "-1"], "--weight-decay -1.0 >= 0"),
        (["--max-data-bytes", "0"], "--max-data-bytes 0 must be positive"),
        (["--ckpt-dir", str(a_file)], "is a file, not a directory"),
        (["--log-json", str(tmp_path)], "is a directory; name a file"),
        (["--loss-spike", "0.5"], "--loss-spike 0.5 must be > 1"),
        (["--max-update-ratio", "-1"], "--max-update-ratio -1.0 must be >= 0"),
        (["--peer-timeout", "0"], "--peer-timeout 0.0: must be positive"),
        (["--mesh", "0,4"], "--mesh '0,4': expected DATA,TENSOR or DATA,CONTEXT,TENSOR"),
    ]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
            example.parse(argv)
        assert exit_info.value.code == 2 and message in err.getvalue(), (argv, err.getvalue())

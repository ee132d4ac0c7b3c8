"""End-to-end runs of examples/train_gpt.py as a subprocess (tiny model, 8 simulated CPU
devices configured by the example itself).

Four runs share one module fixture, two at a time: an uninterrupted 6-step run that
checkpoints every 3 steps; a run of 3 steps that checkpoints and stops; a resumed run to
6 steps from that checkpoint; a run whose loss blows up.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
DATA = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
TINY = ["--seq-len", "32", "--hidden", "32", "--heads", "4", "--layers", "1",
        "--batch-size", "8", "--micro-batches", "2", "--mesh", "2,4", "--data", DATA,
        "--eval-every", "3", "--no-progress"]


def _start(*extra: str) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # the example configures its own simulated devices
    return subprocess.Popen([sys.executable, str(SCRIPT), *TINY, *extra], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_gpt")
    full = _start("--steps", "6", "--save-every", "3", "--ckpt-dir", str(tmp / "ckpt_full"),
                  "--log-json", str(tmp / "full.jsonl"), "--plot", str(tmp / "full.png"))
    part = _start("--steps", "3", "--save-every", "3", "--ckpt-dir", str(tmp / "ckpt_part"),
                  "--log-json", str(tmp / "part.jsonl"))
    results = {"full": _finish(full), "part": _finish(part)}
    # Resumed into the same log: its records up to step 3 are kept, steps 4-6 appended.
    resumed = _start("--steps", "6", "--resume", "--save-every", "3",
                     "--ckpt-dir", str(tmp / "ckpt_part"), "--log-json", str(tmp / "part.jsonl"))
    nan = _start("--steps", "6", "--lr", "1e9", "--warmup-steps", "0",
                 "--log-json", str(tmp / "nan.jsonl"))
    results["resumed"], results["nan"] = _finish(resumed), _finish(nan)
    return tmp, results


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


def test_run_logs_every_step(runs):
    tmp, results = runs
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
    assert "optimizer state" in out and "done: steps 1-6" in out


def test_plot_written(runs):
    tmp, _ = runs
    png = tmp / "full.png"
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_checkpoints_saved(runs):
    tmp, _ = runs
    assert sorted(p.name for p in (tmp / "ckpt_full").iterdir() if p.name.isdigit()) == ["3", "6"]


def test_resume_reproduces_uninterrupted_run(runs):
    tmp, results = runs
    _ok(results["part"])
    _ok(results["resumed"])
    assert "resume: restored step 3" in results["resumed"].stdout
    assert "done: steps 4-6" in results["resumed"].stdout
    full = _losses(_read(tmp / "full.jsonl"))
    resumed = _losses(_read(tmp / "part.jsonl"))
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6, abs=0), step
    evals = [r for r in _read(tmp / "part.jsonl") if "eval_loss" in r]
    full_evals = [r for r in _read(tmp / "full.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3, 6]
    assert evals[-1]["eval_loss"] == pytest.approx(full_evals[-1]["eval_loss"], rel=1e-6)


def test_nan_loss_stops_with_step(runs):
    tmp, results = runs
    nan = results["nan"]
    assert nan.returncode != 0
    assert re.search(r"loss is (nan|inf|-inf) at step \d+", nan.stderr), nan.stderr
    logged = _losses(_read(tmp / "nan.jsonl"))
    assert all(math.isfinite(v) for v in logged.values())
    assert len(logged) < 6

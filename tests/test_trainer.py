"""sp_jax.training.Trainer in-process (8 simulated devices, a 1-layer GPT of width 32 on
sequences of 32 bytes): its log, checkpoints, resume, divergence and stop requests.

One module fixture shares three compiled training steps, each reused across runs by
restoring its state (a fresh run starts from a copy of the initial state):

* ``A`` on data=2 x tensor=4 (lr 3e-3): an uninterrupted 6-step run checkpointing at 3 and
  6; a run stopped by a (simulated) SIGTERM during step 3; the run resumed from the
  diverged one's checkpoint to step 6; two refused starts;
* ``X`` on data=2 x tensor=4 (lr 1e9, no warmup): resumed from step 3, it diverges at step
  4 without saving; a fresh run under ``debug_nans``;
* ``B`` on data=4 x tensor=2: resumed from the uninterrupted run's checkpoints with step 6
  damaged, it falls back to step 3.

Subprocess runs of examples/train_gpt.py (the command line, exit statuses) are in
tests/test_train_gpt.py.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from _util import read_jsonl, truncate_an_array_file
from conftest import make_mesh
from flax import nnx

import sp_jax
from sp_jax.data import ByteCorpus
from sp_jax.models import GPT, GPTConfig
from sp_jax.training import (
    TrainerConfig,
    TrainingStopped,
    TrainStep,
    faults,
    warmup_cosine_schedule,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
CFG = GPTConfig(vocab_size=256, max_seq_len=32, num_layers=1, num_heads=4, hidden=32)
CORPUS = ByteCorpus.from_files([DATA], seq_len=32)
BASE = dict(steps=6, batch_size=8, micro_batches=2, eval_every=3, progress=False)


@dataclasses.dataclass
class Run:
    """What one ``Trainer.run`` printed (process 0's lines), returned or raised."""

    lines: list[str]
    result: sp_jax.training.TrainResult | None
    stopped: TrainingStopped | None
    records: list[dict]

    @property
    def out(self) -> str:
        return "\n".join(self.lines)


class Model:
    """A compiled TrainStep on ``mesh`` and a copy of its initial state."""

    def __init__(self, mesh, lr: float, warmup: int):
        self.mesh, self.lr, self.warmup = mesh, lr, warmup
        tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
            warmup_cosine_schedule(lr, warmup, 6), weight_decay=0.1))
        with jax.set_mesh(mesh):
            self.step = TrainStep(GPT(CFG, rngs=nnx.Rngs(0)), tx)
        self.init = jax.tree.map(jnp.copy, (self.step.params, self.step.opt_state))

    def run(self, *, fresh: bool = False, data=CORPUS, signals=None, **config) -> Run:
        if fresh:  # the step donates its state: start from another copy
            self.step.params, self.step.opt_state = jax.tree.map(jnp.copy, self.init)
        lines: list[str] = []
        metadata = {"model": {"hidden": CFG.hidden, "num_layers": CFG.num_layers},
                    "run": {"lr": self.lr, "warmup_steps": self.warmup}}
        trainer = sp_jax.training.Trainer(
            self.step, data, TrainerConfig(**{**BASE, **config}), metadata=metadata,
            mesh=self.mesh, signals=signals, say=lines.append)
        try:
            return Run(lines, trainer.run(), None, trainer.records)
        except TrainingStopped as e:
            return Run(lines, None, e, trainer.records)


class SignalledAt:
    """The corpus, with a stop request (as SIGTERM would set it) arriving during step
    ``step``."""

    def __init__(self, step: int, signals: faults.StopSignals):
        self.step, self.signals = step, signals

    def train_batch(self, step: int, **kwargs):
        if step == self.step:
            self.signals.received = "SIGTERM"
        return CORPUS.train_batch(step, **kwargs)

    def held_out_batches(self, count: int, **kwargs):
        return CORPUS.held_out_batches(count, **kwargs)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mesh_2x4):
    tmp = tmp_path_factory.mktemp("trainer")
    a, x = Model(mesh_2x4, 3e-3, 20), Model(mesh_2x4, 1e9, 0)
    runs = {"full": a.run(fresh=True, save_every=3, ckpt_dir=tmp / "ckpt_full",
                          log_json=tmp / "full.jsonl")}
    signals = faults.StopSignals()  # not entered: no handlers, only its `received`
    runs["stopped"] = a.run(fresh=True, data=SignalledAt(3, signals), signals=signals,
                            ckpt_dir=tmp / "ckpt_stop", log_json=tmp / "stop.jsonl")
    # Not resuming into a directory with checkpoints / resuming from an empty one.
    runs["refused"] = a.run(ckpt_dir=tmp / "ckpt_full", save_every=3)
    # The log on a full disk: the first record (step 0's held-out loss) cannot be written.
    runs["full_disk_log"] = a.run(fresh=True, log_json="/dev/full")
    # A resume whose log has a bad line before its last: refused in one line.
    shutil.copytree(tmp / "ckpt_full", tmp / "ckpt_bad_log")
    (tmp / "bad.jsonl").write_text('{"step": 1, "loss": 5.0}\n{"step": 2,\n{"step": 3}\n')
    runs["bad_log"] = a.run(resume=True, ckpt_dir=tmp / "ckpt_bad_log",
                            log_json=tmp / "bad.jsonl")
    (tmp / "typo.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    runs["no_checkpoint"] = a.run(resume=True, ckpt_dir=tmp / "typo",
                                  log_json=tmp / "typo.jsonl")
    # The stopped run's checkpoint (step 3) resumed with lr 1e9, saving every step.
    shutil.copytree(tmp / "ckpt_stop", tmp / "ckpt_blowup")
    shutil.copy(tmp / "stop.jsonl", tmp / "blowup.jsonl")
    runs["blowup"] = x.run(resume=True, save_every=1, ckpt_dir=tmp / "ckpt_blowup",
                           log_json=tmp / "blowup.jsonl")
    # A fresh run under debug_nans (the step is built again, donating nothing).
    runs["debug_nans"] = x.run(fresh=True, debug_nans=True, loss_spike=0, max_update_ratio=0)
    # ... then with the first run's lr: it continues as the uninterrupted run did.
    runs["recovered"] = a.run(resume=True, save_every=3, ckpt_dir=tmp / "ckpt_blowup",
                              log_json=tmp / "blowup.jsonl")
    # The uninterrupted run's checkpoints with step 6 damaged, resumed on data=4 x tensor=2.
    shutil.copytree(tmp / "ckpt_full", tmp / "ckpt_damaged")
    shutil.copy(tmp / "full.jsonl", tmp / "damaged.jsonl")
    truncate_an_array_file(tmp / "ckpt_damaged" / "6")
    b = Model(make_mesh(4, 2), 3e-3, 20)
    runs["fallback"] = b.run(resume=True, save_every=3, ckpt_dir=tmp / "ckpt_damaged",
                             log_json=tmp / "damaged.jsonl")
    return tmp, runs


def _steps(directory) -> list[int]:
    return sorted(int(p) for p in os.listdir(directory) if p.isdigit())


def _ok(run: Run) -> sp_jax.training.TrainResult:
    assert run.stopped is None, f"{run.stopped} (status {run.stopped.status})\n{run.out}"
    return run.result


def _assert_continues_full(runs, name: str, log, rel: float) -> list[dict]:
    """The resumed run's log covers steps 1-6, and its steps 4-6 and final held-out loss
    equal the uninterrupted run's within ``rel``; returns the log's records."""
    full, resumed = _ok(runs["full"]), _ok(runs[name])
    records = read_jsonl(log)
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert losses[step] == pytest.approx(full.losses[step], rel=rel, abs=0), step
        assert resumed.losses[step] == losses[step]
    assert resumed.start_step == 3 and resumed.first_loss == losses[4]
    assert resumed.eval_loss == pytest.approx(full.eval_loss, rel=rel)
    return records


def test_run_logs_every_step_and_evals(runs):
    tmp, runs = runs
    result = _ok(runs["full"])
    records = read_jsonl(tmp / "full.jsonl")
    assert records == result.records
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for r in train:
        assert math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 and r["time_s"] > 0
        assert 0 < r["update_ratio"] < 1 and r["grad_norm"] > 0
    assert sorted(result.eval_losses) == [0, 3, 6]
    assert all(math.isfinite(v) for v in result.eval_losses.values())
    assert result.start_step == 0 and result.first_loss == train[0]["loss"]
    assert result.last_loss == train[-1]["loss"] and result.eval_loss == result.eval_losses[6]
    out = runs["full"].out
    assert re.search(r"^step 0: held-out loss \d+\.\d{4}$", out, re.M), out
    assert "compiled the step in" in out and "optimizer state" in out
    assert f"step 6: train loss {train[-1]['loss']:.4f}, held-out loss" in out
    assert _steps(tmp / "ckpt_full") == [3, 6]


def test_stop_request_checkpoints_and_exits_75(runs):
    """A stop request during step 3 (one process: no peers to agree with) ends the run
    after step 3 with a checkpoint of it, evaluated first; it resumes as the blowup and
    recovered runs show."""
    tmp, runs = runs
    stopped = runs["stopped"].stopped
    assert stopped is not None and stopped.status == faults.EXIT_INTERRUPTED
    assert str(stopped) == (f"stopped by SIGTERM after step 3: checkpoint step 3 written to "
                            f"{tmp / 'ckpt_stop'}; continue with --resume")
    assert _steps(tmp / "ckpt_stop") == [3]
    records = read_jsonl(tmp / "stop.jsonl")
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 3]
    full = _ok(runs["full"]).losses
    for r in records:
        if "loss" in r:
            assert r["loss"] == full[r["step"]]  # the same program on the same data


def test_diverged_run_saves_nothing_and_resumes_with_a_lower_lr(runs):
    """lr 1e9 from step 3, saving every step: step 4's update is orders of magnitude
    larger than the weights (the blown-up model's loss alone can look fine: collapsed to
    uniform), so the run stops before saving and step 3 stays the last checkpoint;
    resumed with the original lr, steps 4-6 equal the uninterrupted run's exactly."""
    tmp, runs = runs
    blowup = runs["blowup"]
    assert blowup.stopped is not None and blowup.stopped.status == faults.EXIT_DIVERGED
    message = str(blowup.stopped)
    assert re.match(r"step 4: training diverged \(the update's norm \S+ is over 1x the "
                    r"parameters' norm", message), message
    assert ("stopped without saving: the last checkpoint, step 3, holds parameters that "
            "gave a good held-out loss: resume from it with a lower --lr") in message
    changed = [line for line in blowup.lines if line.startswith("warning: resuming with")]
    assert changed == [
        "warning: resuming with --lr 1000000000.0 (saved: 0.003): the optimizer uses the new "
        "value from step 4 on",
        "warning: resuming with --warmup-steps 0 (saved: 20): the learning-rate schedule from "
        "step 4 on follows the new value"], changed
    assert [r["step"] for r in blowup.records if "loss" in r] == [1, 2, 3]
    recovered = runs["recovered"]
    assert f"resume: restored step 3 from {tmp / 'ckpt_blowup'} onto mesh data=2 x tensor=4" \
        in recovered.out
    assert _steps(tmp / "ckpt_blowup") == [3, 6]
    records = _assert_continues_full(runs, "recovered", tmp / "blowup.jsonl", rel=1e-6)
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 3, 6]


def test_debug_nans_stops_with_step(runs):
    _, runs = runs
    stopped = runs["debug_nans"].stopped
    assert stopped is not None and stopped.status == faults.EXIT_DIVERGED
    # JAX's check fires only where it runs; either way the step is named.
    assert re.match(r"(NaN at step \d+ \(--debug-nans\)|step \d+: training diverged)",
                    str(stopped)), str(stopped)
    assert not jax.config.jax_debug_nans  # only inside the run


def test_resume_onto_another_mesh_falls_back_from_a_damaged_step(runs):
    """Steps 3 and 6 saved on data=2 x tensor=4, step 6 then damaged (an array file cut
    in half); resumed on data=4 x tensor=2: step 6 is named and skipped (moved aside),
    step 3 restored and resharded; the losses agree with the uninterrupted run up to the
    different meshes' summation order."""
    tmp, runs = runs
    out = runs["fallback"].out
    assert re.search(r"warning: checkpoint step 6 in \S+ckpt_damaged is damaged: .*; skipped",
                     out), out
    assert f"moved damaged checkpoint step 6 aside to {tmp / 'ckpt_damaged'}" in out
    assert (f"resume: restored step 3 from {tmp / 'ckpt_damaged'} onto mesh data=4 x tensor=2"
            in out)
    records = _assert_continues_full(runs, "fallback", tmp / "damaged.jsonl", rel=1e-5)
    assert [r["step"] for r in records if "eval_loss" in r] == [0, 3, 6]
    assert _steps(tmp / "ckpt_damaged") == [3, 6]


def test_fresh_run_into_a_used_directory_and_resume_without_checkpoint_are_refused(runs):
    tmp, runs = runs
    refused = runs["refused"]
    assert refused.stopped is not None and refused.stopped.status == faults.EXIT_ERROR
    assert str(refused.stopped) == (
        f"--ckpt-dir {tmp / 'ckpt_full'} already holds checkpoints (steps [3, 6]); pass "
        "--resume to continue from step 6, or use another directory")
    assert refused.lines == [] and refused.records == []  # nothing trained or printed
    missing = runs["no_checkpoint"].stopped
    assert missing is not None and missing.status == faults.EXIT_ERROR
    assert str(missing).startswith(f"--resume: no checkpoint in --ckpt-dir {tmp / 'typo'}; ")
    assert (tmp / "typo.jsonl").read_text() == '{"step": 1, "loss": 5.0}\n'  # untouched


def test_a_log_that_cannot_be_written_or_read_stops_in_one_line(runs):
    """A full disk under --log-json, or a log with a bad line before its last on resume:
    TrainingStopped (exit 1) naming the file and what is intact; nothing torn is written."""
    tmp, runs = runs
    full = runs["full_disk_log"].stopped
    assert full is not None and full.status == faults.EXIT_ERROR
    assert str(full) == ("MetricsLog: cannot write /dev/full (a record of step 0): No space "
                         "left on device; it holds no complete record")
    bad = runs["bad_log"].stopped
    assert bad is not None and bad.status == faults.EXIT_ERROR
    assert re.fullmatch(rf"MetricsLog: line 2 of {re.escape(str(tmp / 'bad.jsonl'))} is not "
                        r"JSON \(.*\); resume with another log file; the latest complete "
                        r"checkpoint is step 6", str(bad)), str(bad)
    assert "\n" not in str(full) + str(bad)


BAD_FIELDS = [  # (fields, the error's words)
    (dict(steps=0), "TrainerConfig: steps=0 must be positive (an int)."),
    (dict(batch_size=6, micro_batches=4), "batch_size=6 is not divisible by micro_batches=4"),
    (dict(loss_spike=0.5), "loss_spike=0.5 must be > 1 (or 0 to stop on non-finite"),
    (dict(max_update_ratio=-1.0), "max_update_ratio=-1.0 must be >= 0"),
    (dict(save_every=3), "save_every / resume need ckpt_dir"),
    (dict(eval_every=-1), "eval_every=-1 must be an int >= 0"),
    (dict(max_to_keep=0), "max_to_keep=0 must be a positive int (or None"),
    (dict(peer_timeout_s=0), "peer_timeout_s=0 must be positive (seconds)"),
    (dict(progress="yes"), "progress='yes' must be True or False"),
]


def test_config_names_the_bad_field():
    """Each of BAD_FIELDS (one test: they cost no compile) names its field."""
    for change, message in BAD_FIELDS:
        with pytest.raises(ValueError, match=re.escape(message)):
            TrainerConfig(**{**BASE, **change})


def test_config_checks_paths(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="ckpt_dir='.*file' is a file, not a directory"):
        TrainerConfig(**BASE, ckpt_dir=tmp_path / "file")
    with pytest.raises(ValueError, match="log_json='.*' is a directory; name a file"):
        TrainerConfig(**BASE, log_json=tmp_path)
    assert TrainerConfig(**BASE, ckpt_dir=tmp_path / "new").ckpt_dir == str(tmp_path / "new")


@pytest.mark.slow
def test_docs_example_runs_verbatim(tmp_path, monkeypatch):
    """docs/training.md's Trainer example trains and checkpoints; run again, it is refused
    (its directory holds checkpoints and it does not resume)."""
    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split("## The training loop (`sp_jax.training.Trainer`)")[1]
    code = compile(re.search(r"```python\n(.*?)```", section, re.S).group(1),
                   "docs/training.md", "exec")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 - our own docs
    result = namespace["result"]
    assert sorted(result.losses) == [1, 2, 3, 4, 5, 6] and sorted(result.eval_losses) == [0, 3, 6]
    assert _steps(tmp_path / "runs" / "trainer") == [3, 6]
    assert read_jsonl(tmp_path / "runs" / "trainer.jsonl") == result.records
    with pytest.raises(TrainingStopped, match="already holds checkpoints"):
        exec(code, {})  # noqa: S102


def test_import_needs_no_tqdm():
    """The progress bar's tqdm is imported by Trainer.run alone (progress=True)."""
    code = "import sys, sp_jax.training; assert 'tqdm' not in sys.modules"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]

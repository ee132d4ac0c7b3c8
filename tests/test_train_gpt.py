"""End-to-end runs of examples/train_gpt.py as a subprocess (tiny model, 8 simulated CPU
devices configured by the example itself), plus how it reports bad flags and data, and
its --help.

The runs share one module fixture. First, concurrently: an uninterrupted 6-step run that
checkpoints every 3 steps, and a run whose loss blows up (exit 3). Then, from a copy of
the first run's checkpoints and log with step 6 damaged: a run resumed on a data=4 x
tensor=2 mesh, and a fresh run refused because the checkpoint directory is not empty.
The loop's behaviour in detail (resume to the same losses, divergence and recovery with a
lower --lr, stop requests, --debug-nans, refusals) is tested in-process against
sp_jax.training.Trainer in tests/test_trainer.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from _util import script_env, truncate_an_array_file

import sp_jax.checkpoint
from sp_jax.models import GPTConfig
from sp_jax.training import faults, warmup_cosine_schedule

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


HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None  # the examples extra


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train_gpt")
    plot = ["--plot", str(tmp / "full.png")] if HAS_MATPLOTLIB else []
    started = {
        "full": _start("--steps", "6", "--save-every", "3", "--ckpt-dir", str(tmp / "ckpt_full"),
                       "--log-json", str(tmp / "full.jsonl"), *plot),
        # A blow-up with the update-ratio and spike checks off: only a non-finite value stops.
        "nan": _start("--steps", "6", "--lr", "1e9", "--warmup-steps", "0",
                      "--max-update-ratio", "0", "--loss-spike", "0",
                      "--log-json", str(tmp / "nan.jsonl")),
    }
    results = {name: _finish(proc) for name, proc in started.items()}
    # The full run's checkpoints (steps 3 and 6) with step 6 damaged, resumed on another
    # mesh: it falls back to step 3 and redoes steps 4-6.
    shutil.copytree(tmp / "ckpt_full", tmp / "ckpt_damaged")
    shutil.copy(tmp / "full.jsonl", tmp / "part_4x2.jsonl")
    truncated = truncate_an_array_file(tmp / "ckpt_damaged" / "6")
    shutil.copytree(tmp / "ckpt_full", tmp / "ckpt_extended")
    started = {
        "resumed_4x2": _start("--steps", "6", "--resume", "--save-every", "3", "--mesh", "4,2",
                              "--ckpt-dir", str(tmp / "ckpt_damaged"),
                              "--log-json", str(tmp / "part_4x2.jsonl")),
        # Not resuming into a directory with checkpoints: refused before any training.
        "refused": _start("--steps", "6", "--save-every", "3",
                          "--ckpt-dir", str(tmp / "ckpt_full")),
        # The finished 6-step run extended to 8 steps: warned about, with the schedule.
        "extended": _start("--steps", "8", "--resume", "--ckpt-dir", str(tmp / "ckpt_extended"),
                           "--warmup-steps", "2"),
    }
    results.update({name: _finish(proc) for name, proc in started.items()})
    return tmp, results, truncated


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="plots need matplotlib (the examples extra)")
def test_plot_written(runs):
    tmp, *_ = runs
    png = tmp / "full.png"
    assert png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_checkpoints_saved(runs):
    tmp, *_ = runs
    assert sorted(p.name for p in (tmp / "ckpt_full").iterdir() if p.name.isdigit()) == ["3", "6"]


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


@pytest.mark.slow
def test_nan_loss_stops_with_step(runs):
    tmp, results, _ = runs
    nan = results["nan"]
    assert nan.returncode == faults.EXIT_DIVERGED, nan.stderr[-3000:]
    assert re.search(r"step \d+: training diverged \(loss is (nan|inf|-inf)", nan.stderr), \
        nan.stderr[-3000:]
    logged = _losses(_read(tmp / "nan.jsonl"))
    assert all(math.isfinite(v) for v in logged.values())
    assert len(logged) < 6


@pytest.mark.slow
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


@pytest.mark.slow
def test_fresh_run_refuses_nonempty_checkpoint_dir(runs):
    tmp, results, _ = runs
    run = results["refused"]
    assert run.returncode != 0
    assert f"--ckpt-dir {tmp / 'ckpt_full'} already holds checkpoints (steps [3, 6]); " \
           "pass --resume" in run.stderr, run.stderr[-2000:]
    assert "step 1" not in run.stdout  # nothing trained


@pytest.mark.slow
def test_resume_with_other_run_settings_warns_with_both_values(runs):
    """A finished 6-step run (warmup 20) resumed with --steps 8 --warmup-steps 2: one
    warning per changed setting, with both values and what it does; --steps names the
    learning rate of the next step under both schedules (the trainer's RESUME_RULE)."""
    tmp, results, _ = runs
    run = results["extended"]
    _ok(run)
    lr = {steps: float(warmup_cosine_schedule(3e-3, warmup, steps, 0.1)(6))
          for steps, warmup in ((8, 2), (6, 20))}
    warnings = [line for line in run.stdout.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: resuming with --steps 8 (saved: 6): a learning-rate schedule that depends "
        "on the run length (warmup, decay) follows a run of 8 steps from step 7 on: at step 7 "
        f"the learning rate is {lr[8]:.3g} (the saved run's schedule: {lr[6]:.3g}); to "
        "finish the saved run as it was planned, resume with --steps 6",
        "warning: resuming with --warmup-steps 2 (saved: 20): the learning-rate schedule "
        "from step 7 on follows the new value"], run.stdout
    assert "resume: restored step 6" in run.stdout
    assert "done: steps 7-8" in run.stdout


def _small_disk(size: str, mount: Path, script: str) -> list[str] | None:
    """The command running ``script`` (sh) with a tmpfs of ``size`` mounted at ``mount``,
    in a user and mount namespace of its own (no root needed); None where this machine
    does not allow that."""
    command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
               f"mount -t tmpfs -o size={size} tmpfs {mount} && {script}"]
    try:
        probe = subprocess.run([*command[:-1], f"mount -t tmpfs -o size={size} tmpfs "
                                               f"{mount} && true"],
                               capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return command if probe.returncode == 0 else None


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_latest_step(tmp_path):
    """--ckpt-dir on a 1 MB file system, saving every step: a save runs out of space.
    The run ends with exit 1 and one line (the step, the directory, the cause, the latest
    complete step), none of orbax's or asyncio's tracebacks; a resume from that step
    (copied off the small disk) restores and verifies it."""
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    argv = [sys.executable, str(SCRIPT), *TINY, "--steps", "30", "--save-every", "1",
            "--ckpt-dir", str(disk / "ckpt")]
    command = _small_disk("1000k", disk, f"{shlex.join(argv)}; status=$?; "
                                         f"cp -r {disk / 'ckpt'} {kept}; exit $status")
    if command is None:
        pytest.skip("no unprivileged user namespaces here (unshare) for a small file system")
    run = subprocess.run(command, cwd=ROOT, env=script_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == faults.EXIT_ERROR, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    match = re.fullmatch(rf"error: saving checkpoint step (\d+) to {disk / 'ckpt'} failed: .*"
                         r"No space left on device.*\. Nothing of step \1 was committed; the "
                         r"latest complete checkpoint is step (\d+)\. The file system of "
                         rf"{disk / 'ckpt'} is full: free space \(or keep fewer checkpoints\) "
                         r"and resume\.", errors[0])
    assert match, errors[0]
    latest = int(match.group(2))
    assert latest >= 1 and int(match.group(1)) == latest + 1
    assert sp_jax.checkpoint.latest_step(kept) == latest
    resumed = _finish(_start("--steps", str(latest + 1), "--resume", "--ckpt-dir", str(kept)))
    _ok(resumed)  # every array's checksum verified on restore
    assert f"resume: restored step {latest} from {kept}" in resumed.stdout


# -- command line: the library's rules (tests/test_launch.py, tests/test_data.py) reach the
# user as a usage error or an "error: ..." exit ------------------------------------------

_CLUSTER_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                 "SLURM_LOCALID", "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE")


def _run_quick(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _CLUSTER_VARS}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=script_env()["XLA_FLAGS"])
    return subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_bad_process_flags_are_usage_errors():
    run = _run_quick("--coordinator", "h:1")
    assert run.returncode == 2, run.stderr[-2000:]
    assert "usage:" in run.stderr
    assert "--coordinator HOST:PORT, --num-processes N and --process-id I go together" \
        in run.stderr
    run = _run_quick("--coordinator", "h:1", "--num-processes", "3", "--process-id", "0")
    assert run.returncode == 2 and "does not divide over 3 processes" in run.stderr


@pytest.mark.slow
def test_bad_data_is_an_error_exit(tmp_path):
    missing = str(tmp_path / "none" / "*.txt")
    run = _run_quick("--data", missing, "--steps", "1", "--no-progress")
    assert run.returncode == 1, run.stderr[-2000:]
    assert f"error: no files match {missing}" in run.stderr


@pytest.mark.slow
def test_unreadable_data_file_is_an_error_exit():
    run = _run_quick("--data", "/proc/self/mem", "--steps", "1", "--no-progress")
    assert run.returncode == 1, run.stderr[-2000:]
    assert "error: cannot read data file /proc/self/mem: Input/output error" in run.stderr


@pytest.mark.slow
def test_second_trainer_on_one_checkpoint_dir_is_refused(tmp_path):
    """One writer per --ckpt-dir: held here, a trainer (or a --resume) is refused, naming
    the holder, before it builds anything."""
    from sp_jax.checkpoint import CheckpointManager

    with CheckpointManager(tmp_path / "ckpt"):
        run = _run_quick(*TINY, "--steps", "2", "--ckpt-dir", str(tmp_path / "ckpt"))
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert f"is in use by pid {os.getpid()}" in run.stderr, run.stderr[-2000:]


@pytest.mark.slow
def test_resume_without_a_checkpoint_is_an_error(tmp_path):
    """A mistyped --ckpt-dir with --resume must not start over (and truncate the log)."""
    log = tmp_path / "run.jsonl"
    log.write_text('{"step": 1, "loss": 5.0}\n')
    run = _run_quick(*TINY, "--steps", "2", "--resume", "--ckpt-dir", str(tmp_path / "typo"),
                     "--log-json", str(log))
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "--resume: no checkpoint in --ckpt-dir" in run.stderr
    assert log.read_text() == '{"step": 1, "loss": 5.0}\n'


def _example(name: str):
    """An example's module, loaded without running it (its flags parse in-process)."""
    spec = importlib.util.spec_from_file_location(f"{name}_flags", ROOT / "examples" / f"{name}.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def test_held_out_fraction_sets_the_packed_and_byte_data_split(tmp_path):
    """``--held-out-fraction`` reaches the data: the last 3 of 10 documents, the last
    30% of the bytes."""
    from sp_jax.training import cli

    example = _example("train_gpt")
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(f'{{"text": "document {i}"}}\n' for i in range(10)))
    base = ["--data", str(docs), "--seq-len", "16", "--held-out-fraction", "0.3"]
    packed = cli.text_data(example.parse([*base, "--tokenizer", "bytes"]))
    assert (packed.train_documents, packed.held_out_fraction) == (7, 0.3)
    default = cli.text_data(example.parse(base[:4] + ["--tokenizer", "bytes"]))
    assert default.train_documents == 9  # 5% of 10: at least one held out
    corpus = cli.text_data(example.parse(base))  # bytes: the documents' text, not the JSON
    n = sum(len(f"document {i}\n") for i in range(10))
    assert (len(corpus.train), len(corpus.held_out)) == (int(n * 0.7), n - int(n * 0.7))


def test_bad_numbers_and_paths_are_usage_errors(tmp_path):
    """Checked before JAX starts: in-process parse of the example's flags."""
    example = _example("train_gpt")
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for argv, message in [
        (["--lr", "-0.003"], "--lr -0.003 must be positive and finite"),
        (["--lr", "inf"], "--lr inf must be positive and finite"),
        (["--weight-decay", "-1"], "--weight-decay -1.0 must be >= 0 and finite"),
        (["--weight-decay", "nan"], "--weight-decay nan must be >= 0 and finite"),
        (["--seed", "-1"], "--seed -1 must be an int >= 0"),
        (["--seed", str(2**63)], f"--seed {2**63} must be < 2**63"),
        (["--max-update-ratio", "inf"], "--max-update-ratio inf must be >= 0 and finite"),
        (["--compile-allowance", "nan"], "--compile-allowance nan: must be a positive"),
        (["--max-data-bytes", "0"], "--max-data-bytes 0 must be positive"),
        (["--ckpt-dir", str(a_file)], f"--ckpt-dir {a_file} is a file, not a directory"),
        (["--log-json", str(tmp_path)], f"--log-json {tmp_path} is a directory; name a file"),
        (["--loss-spike", "0.5"], "--loss-spike 0.5 must be > 1"),
        (["--max-update-ratio", "-1"], "--max-update-ratio -1.0 must be >= 0 and finite"),
        (["--peer-timeout", "0"], "--peer-timeout 0.0: must be a positive number of seconds"),
        (["--mesh", "0,4"], "--mesh '0,4': expected DATA,TENSOR, DATA,CONTEXT,TENSOR or "
                                "STAGE,DATA,CONTEXT,TENSOR"),
            (["--microbatches", "4"], "--microbatches and --pipeline-repeats need a pipeline"),
            (["--mesh", "2,1,1,4", "--layers", "3"], "--layers 3 must divide by STAGE x "
                                                    "--pipeline-repeats = 2"),
        (["--batch-size", "6", "--micro-batches", "4"],
         "--batch-size 6 is not divisible by --micro-batches 4"),
        (["--save-every", "3"], "--save-every / --resume need --ckpt-dir"),
        (["--eval-every", "-1"], "--warmup-steps, --save-every and --eval-every must be >= 0"),
        (["--steps", "0"], "--steps must be positive"),
        (["--held-out-fraction", "1"], "--held-out-fraction 1.0 must be in (0, 1)"),
        (["--hidden", "0"], "--hidden must be positive"),
        (["--heads", "6"], "--heads 6 must be a multiple of 4 (tensor size) and divide "
                           "--hidden 128"),
        (["--preset", "llama-tiny", "--heads", "12", "--hidden", "48", "--kv-heads", "3"],
         "--kv-heads 3 must divide --heads 12 and divide or be a multiple of the tensor size 4"),
    ]:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
            example.parse(argv)
        assert exit_info.value.code == 2 and message in err.getvalue(), (argv, err.getvalue())


FINETUNE = ["--hf-dir", str(ROOT / "tests" / "fixtures" / "hf" / "llama")]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "argv", "ending"), [
    ("train_gpt", [], "with sp_jax's training loop, on a simulated or real device mesh."),
    ("finetune_hf", FINETUNE, "and write it back as a Hugging Face checkpoint."),
])
def test_help_has_the_whole_description_and_each_default_once(name, argv, ending):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        _example(name).parse([*argv, "--help"])
    assert exit_info.value.code == 0
    text = out.getvalue()
    assert " ".join(text.split("\n\n")[1].split()).endswith(ending), text[:1000]
    for option in re.split(r"\n  (?=-)", text.split("options:")[1]):
        assert option.count("default") <= 1, option
    assert "(default: None)" not in text and "(default: False)" not in text


def test_presets_are_the_library_presets():
    """--preset llama-tiny is GPTConfig.llama("llama-tiny"); each model flag given
    overrides the preset's value, and only that one."""
    from sp_jax.training import TrainerConfig, cli

    example = _example("train_gpt")
    assert cli.model_config(example.parse(["--preset", "llama-tiny"])) \
        == GPTConfig.llama("llama-tiny")
    assert cli.model_config(example.parse(TINY)) == GPTConfig.llama(
        "llama-tiny", max_seq_len=32, hidden=32, num_heads=4, num_layers=1)
    assert cli.model_config(example.parse([])) == GPTConfig(
        vocab_size=256, max_seq_len=128, num_layers=2, num_heads=4, hidden=128)
    wide = cli.model_config(example.parse(["--hidden", "64", "--heads", "8"]))
    assert (wide.num_kv_heads, wide.mlp_hidden) == (8, 256)  # GPTConfig's own rules
    args = example.parse(["--preset", "llama-tiny", "--kv-heads", "4", "--mlp-hidden", "96"])
    assert cli.model_config(args) == GPTConfig.llama("llama-tiny", num_kv_heads=4,
                                                     mlp_hidden=96)
    assert isinstance(args.trainer, TrainerConfig) and args.trainer.steps == 600


def test_plot_without_matplotlib_is_a_usage_error(monkeypatch):
    """--plot is refused before anything runs when matplotlib is missing (not after the
    whole run, when the plot would be drawn)."""
    import sys

    example = _example("train_gpt")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # not importable
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        example.parse(["--plot", "loss.png"])
    assert exit_info.value.code == 2 and "--plot needs matplotlib" in err.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("mesh, micro, shown", [
    ("data=1,expert=4,tensor=2", 2, "data=1 x expert=4 x tensor=2"),
    ("stage=2,expert=2,tensor=2", 4, "stage=2 x data=1 x expert=2 x tensor=2")])
def test_mixture_of_experts_trains_on_an_expert_mesh(tmp_path, mesh, micro, shown):
    """--preset mixtral-tiny on --mesh data=1,expert=4,tensor=2 and in pipeline stages
    (stage=2,expert=2,tensor=2, 4 micro-batches): the run ends, logs the router metrics
    per step (the (token, choice) pairs per expert summing to the micro-batch's, per
    layer) and its loss falls."""
    log = tmp_path / "moe.jsonl"
    args = [a if a != "llama-tiny" else "mixtral-tiny" for a in TINY]
    args[args.index("--mesh") + 1] = mesh
    if mesh.startswith("stage"):
        args[args.index("--micro-batches") + 1] = str(micro)
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--layers", "2", "--steps", "4",
                           "--warmup-steps", "0",
                           "--eval-every", "0", "--log-json", str(log)],
                          cwd=ROOT, env=script_env(), capture_output=True, text=True,
                          timeout=300)
    _ok(proc)
    assert f"mesh: {shown}" in proc.stdout
    steps = [r for r in _read(log) if "loss" in r]
    assert len(steps) == 4 and steps[-1]["loss"] < steps[0]["loss"]
    pairs = 8 // micro * 32 * GPTConfig.mixtral("mixtral-tiny").experts_per_token  # a micro-batch
    for record in steps:
        assert record["moe_aux_loss"] > 0 and record["moe_dropped_fraction"] == 0
        assert [sum(layer) for layer in record["moe_expert_tokens"]] == [pairs, pairs]


@pytest.mark.slow
def test_fp8_delayed_scaling_trains_from_the_command_line(tmp_path):
    """--fp8 delayed on a 2 x 4 mesh with 2 micro-batches: the run ends, its loss falls,
    and the checkpoint holds the amax history of every projection of the block (the
    values and their resume: tests/test_fp8.py)."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--steps", "3", "--fp8",
                           "delayed", "--eval-every", "0", "--warmup-steps", "0",
                           "--ckpt-dir", str(ckpt), "--save-every", "3",
                           "--log-json", str(tmp_path / "fp8.jsonl")],
                          cwd=ROOT, env=script_env(), capture_output=True, text=True,
                          timeout=300)
    _ok(proc)
    steps = [r for r in _read(tmp_path / "fp8.jsonl") if "loss" in r]
    assert len(steps) == 3 and steps[-1]["loss"] < steps[0]["loss"]
    # the checkpoint's parameter tree names the four amax histories (qkv, out, up, down)
    names = {m.replace(".", "/") for f in (ckpt / "3").rglob("*")
             if f.is_file() and f.stat().st_size < 1 << 20
             for m in re.findall(r"blocks[./]0[./]\w+[./]\w+[./]fp8_history",
                                 f.read_text(errors="ignore"))}
    assert names == {f"blocks/0/{m}/fp8_history" for m in
                     ("attention/qkv", "attention/out", "mlp/up", "mlp/down")}, names


@pytest.mark.slow
def test_fp8_trains_in_pipeline_stages_from_the_command_line(tmp_path):
    """--fp8 current with --mesh S,D,C,T = 2,2,1,2 (1F1B, 4 micro-batches): the run
    ends and its loss falls (the values against the unpipelined FP8 model:
    tests/test_fp8.py)."""
    args = [*TINY, "--layers", "2", "--steps", "3", "--fp8", "current", "--eval-every", "0",
            "--warmup-steps", "0", "--log-json", str(tmp_path / "fp8.jsonl")]
    args[args.index("--mesh") + 1] = "2,2,1,2"
    args[args.index("--micro-batches") + 1] = "4"
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=script_env(),
                          capture_output=True, text=True, timeout=300)
    _ok(proc)
    assert "1f1b pipeline, 4 micro-batches" in proc.stdout
    steps = [r for r in _read(tmp_path / "fp8.jsonl") if "loss" in r]
    assert len(steps) == 3 and steps[-1]["loss"] < steps[0]["loss"]

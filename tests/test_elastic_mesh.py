"""One command line for allocations of any size: ``--mesh`` with a ``-1`` axis (it takes
the devices the others leave, :meth:`sp_jax.training.Launch.resolve_mesh`) and
``--micro-batch-size`` (the micro-batches follow from the data axis, so the global batch
stays). The flags are parsed in-process with the cluster's variables passed in (as
tests/test_launch.py does); one slow test runs examples/train_gpt.py on 8 and on 4
devices with the same flags and compares the losses with a run on a fixed mesh."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from _util import script_env

import sp_jax.training.launch as launch_module
from sp_jax.training import Launch, cli, parse_mesh

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
SLURM_2 = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node1", "SLURM_NTASKS": "2",
           "SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
CLUSTER_VARS = (*SLURM_2, "OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE")
MODEL = ["--seq-len", "32", "--hidden", "32", "--heads", "4", "--layers", "1"]


@pytest.fixture
def cpu(monkeypatch):
    """No launcher variables, no accelerator."""
    for name in CLUSTER_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")


def _module(path: Path):
    """An example's module, loaded without running it (its flags parse in-process)."""
    spec = importlib.util.spec_from_file_location(f"{path.stem}_elastic", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _usage_error(parse, argv: list[str]) -> str:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2, err.getvalue()
    return err.getvalue()


PARSED = [("-1,4", (1, -1, 1, 1, 4)), ("2,-1,4", (1, 2, 1, -1, 4)),
          ("2,-1,1,4", (2, -1, 1, 1, 4)), ("data=-1,tensor=4", (1, -1, 1, 1, 4)),
          ("data=2,expert=-1", (1, 2, -1, 1, 1)), ("2,4", (1, 2, 1, 1, 4))]
REFUSED = [("-1,-1", "only one axis size may be -1"),
           ("data=-1,tensor=-1", "only one axis size may be -1"),
           ("0,4", "positive integers, or -1 for one axis"),
           ("-2,4", "positive integers, or -1 for one axis"),
           ("data=-2,tensor=4", "'data=-2' is not AXIS=SIZE")]


def test_parse_mesh_keeps_one_minus_one():
    """Every form takes one -1 (kept for resolve_mesh); two, 0 or -2 are refused, and
    without ``fill`` a -1 too."""
    for text, shape in PARSED:
        assert parse_mesh(text, fill=True) == shape, text
    for text, message in REFUSED:
        with pytest.raises(ValueError, match=f"--mesh '{text}'.*{message}"):
            parse_mesh(text, fill=True)
    for text in ("-1,4", "data=-1,tensor=4"):
        with pytest.raises(ValueError, match=f"--mesh '{text}'"):
            parse_mesh(text)


# (environment, --local-devices, shape, resolved)
RESOLVED = [({}, 4, (1, -1, 1, 1, 4), (1, 1, 1, 1, 4)),
            ({}, 8, (1, -1, 1, 1, 4), (1, 2, 1, 1, 4)),
            (SLURM_2, 4, (1, -1, 1, 1, 4), (1, 2, 1, 1, 4)),
            (SLURM_2, 4, (1, 2, 1, 1, -1), (1, 2, 1, 1, 4)),
            (SLURM_2, 4, (2, -1, 1, 1, 2), (2, 2, 1, 1, 2)),
            (SLURM_2, 4, (1, 2, 1, 1, 4), (1, 2, 1, 1, 4))]  # no -1: as it is


def test_resolve_mesh_counts_processes_times_local_devices(cpu, monkeypatch):
    """CPU: processes x --local-devices (required); GPUs: --local-device-ids, else one
    GPU per SLURM task, else (one process) the devices JAX sees; several processes
    without a launcher must say. The errors name --mesh and how the devices were
    counted."""
    for environ, local, shape, resolved in RESOLVED:
        launch = Launch.plan(environ=environ)
        assert launch.resolve_mesh(shape, local, environ=environ) == resolved, shape
        assert launch.local_device_count(resolved, local) == local  # still the flag's
    launch = Launch.plan(environ=SLURM_2)
    with pytest.raises(ValueError, match=r"--mesh with data=-1: the other axes \(tensor=3, 3 "
                                         r"devices\) do not divide the run's 8 devices \(2 "
                                         r"processes x 4 devices, --local-devices\)"):
        launch.resolve_mesh((1, -1, 1, 1, 3), 4, environ=SLURM_2)
    with pytest.raises(ValueError, match="--mesh with data=-1 on CPU needs --local-devices N"):
        launch.resolve_mesh((1, -1, 1, 1, 4), environ=SLURM_2)
    with pytest.raises(ValueError, match="--local-devices must be positive"):
        launch.resolve_mesh((1, -1, 1, 1, 4), 0, environ=SLURM_2)
    # a concrete mesh that does not use every process's devices: an error before JAX starts
    three = {**SLURM_2, "SLURM_NTASKS": "3"}
    with pytest.raises(ValueError, match=r"--mesh \(data=2 x tensor=4\) needs 8 devices; the "
                                         r"3 processes have 12 \(4 each, --local-devices\): "
                                         r"start 2 processes \(SLURM: sbatch / srun --ntasks"):
        Launch.plan(environ=three).resolve_mesh((1, 2, 1, 1, 4), 4, environ=three)
    assert launch.resolve_mesh((1, 2, 1, 1, 4), 4, environ=SLURM_2) == (1, 2, 1, 1, 4)

    monkeypatch.setattr(launch_module, "accelerator_present", lambda: True)
    shape = (1, -1, 1, 1, 4)
    ids = Launch.plan(environ=SLURM_2, local_device_ids="0,1,2,3")
    assert ids.resolve_mesh(shape, environ=SLURM_2) == (1, 2, 1, 1, 4)
    per_task = {**SLURM_2, "SLURM_NTASKS": "8"}
    assert Launch.plan(environ=per_task).resolve_mesh(shape, environ=per_task) \
        == (1, 2, 1, 1, 4)
    import jax  # the test process's 8 simulated devices stand for one process's GPUs

    single = Launch.plan(environ={}).resolve_mesh(shape, environ={})
    assert single == (1, jax.local_device_count() // 4, 1, 1, 4)
    explicit = Launch.plan(coordinator="h:1", num_processes=2, process_id=0, environ={})
    with pytest.raises(ValueError, match="multi-process run needs --local-device-ids"):
        explicit.resolve_mesh(shape, environ={})


BAD_FLAGS = [(["--mesh", "-1,4"], "--mesh with data=-1 on CPU needs --local-devices N"),
             (["--mesh", "-1,-1", "--local-devices", "4"], "only one axis size may be -1"),
             (["--mesh", "-1,3", "--local-devices", "4"], "do not divide the run's 4 devices"),
             (["--micro-batches", "2", "--micro-batch-size", "2"],
              "--micro-batches and --micro-batch-size are two ways to set the same thing"),
             (["--batch-size", "8", "--micro-batch-size", "3"],
              "--batch-size 8 is not divisible by --micro-batch-size 3 x 2 data shards"),
             (["--micro-batch-size", "0"], "--micro-batch-size 0 must be positive"),
             (["--mesh", "2,1,1,4", "--micro-batch-size", "1"],
              "--micro-batch-size with a pipeline (STAGE > 1 in --mesh)")]


def test_the_same_flags_fit_one_or_two_processes(cpu, monkeypatch):
    """The issue's example in examples/train_gpt.py's parse(): --mesh -1,4 --batch-size 8
    --micro-batch-size 2 with 4 devices per process: 2 SLURM tasks -> data 2 in 2
    micro-batches, 1 -> data 1 in 4 (the checkpoint's run settings record them); the
    expert axis carries the batch too; bad combinations are usage errors; and
    examples/finetune_hf.py resolves the same way."""
    example = _module(SCRIPT)
    for environ, data, micro in [({}, 1, 4), (SLURM_2, 2, 2)]:
        with monkeypatch.context() as m:
            for name, value in environ.items():
                m.setenv(name, value)
            args = example.parse(["--mesh", "-1,4", "--local-devices", "4", "--batch-size",
                                  "8", "--micro-batch-size", "2", *MODEL])
        assert args.mesh_shape == (1, data, 1, 1, 4) and args.local_devices == 4
        assert args.micro_batches == micro and args.trainer.micro_batches == micro
        assert args.launch.processes == data  # 4 devices each, tensor=4 fills one
        assert cli.run_metadata(args, argparse.Namespace())["run"]["micro_batches"] == micro
    args = example.parse(["--mesh", "data=-1,expert=2,tensor=2", "--local-devices", "8",
                          "--batch-size", "16", "--micro-batch-size", "2", *MODEL])
    assert args.mesh_shape == (1, 2, 2, 1, 2) and args.micro_batches == 2
    for argv, message in BAD_FLAGS:
        assert message in _usage_error(example.parse, [*MODEL, *argv]), argv

    finetune = _module(ROOT / "examples" / "finetune_hf.py")
    hf = ["--hf-dir", str(ROOT / "tests" / "fixtures" / "hf" / "llama")]
    args = finetune.parse([*hf, "--mesh", "-1,2", "--local-devices", "4", "--batch-size",
                           "8", "--micro-batch-size", "1"])
    assert args.mesh_shape == (1, 2, 1, 1, 2) and args.micro_batches == 4
    assert "needs --local-devices N" in _usage_error(finetune.parse, [*hf, "--mesh", "-1,2"])


# -- end to end: the same command on 8 and on 4 devices --------------------------------

DATA = os.path.join(sysconfig.get_paths()["stdlib"], "json", "*.py")
RUN = [*MODEL, "--preset", "llama-tiny", "--batch-size", "8", "--data", DATA,
       "--steps", "4", "--eval-every", "0", "--warmup-steps", "1", "--no-progress"]
ELASTIC = ["--mesh", "-1,4", "--micro-batch-size", "2"]
# An all-reduce over 2 data shards and 2 micro-batches sums the rows in another order than
# 4 micro-batches on one shard: the losses agree to the last bit or two.
RTOL = 1e-6


def _losses(path: Path) -> dict[int, float]:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _run(*argv: str) -> subprocess.Popen:
    env = {k: v for k, v in script_env().items() if k not in CLUSTER_VARS}
    return subprocess.Popen([sys.executable, str(SCRIPT), *RUN, *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-4000:]}"
    return out


@pytest.mark.slow
def test_the_same_command_on_half_the_devices_trains_the_same_losses(tmp_path):
    """A fixed data=2 x tensor=4 run in 2 micro-batches (checkpoint at step 2) is the
    reference. The elastic flags on 4 devices (data=1, 4 micro-batches of 2 sequences)
    log its losses from scratch, and, resuming its step-2 checkpoint, its steps 3-4."""
    ref = _finish(_run("--mesh", "2,4", "--micro-batches", "2", "--save-every", "2",
                       "--ckpt-dir", str(tmp_path / "ckpt"), "--log-json",
                       str(tmp_path / "ref.jsonl")))
    assert "mesh: data=2 x tensor=4 on 8 of 8" in ref
    (tmp_path / "resume").mkdir()
    shutil.copytree(tmp_path / "ckpt" / "2", tmp_path / "resume" / "2")
    fresh = _run(*ELASTIC, "--local-devices", "4", "--log-json", str(tmp_path / "fresh.jsonl"))
    resumed = _run(*ELASTIC, "--local-devices", "4", "--resume", "auto",
                   "--ckpt-dir", str(tmp_path / "resume"),
                   "--log-json", str(tmp_path / "resumed.jsonl"))
    fresh_out, resumed_out = _finish(fresh), _finish(resumed)
    for out in (fresh_out, resumed_out):
        assert "mesh: data=1 x tensor=4 on 4 of 4" in out
        assert "8 x 32 = 256 tokens/step in 4 micro-batch(es)" in out
    assert "resuming with --micro-batches 4 (saved: 2)" in resumed_out  # warned, not refused
    reference = _losses(tmp_path / "ref.jsonl")
    fresh_losses, resumed_losses = _losses(tmp_path / "fresh.jsonl"), \
        _losses(tmp_path / "resumed.jsonl")
    assert sorted(reference) == sorted(fresh_losses) == [1, 2, 3, 4]
    assert sorted(resumed_losses) == [3, 4]
    for step, loss in reference.items():
        assert fresh_losses[step] == pytest.approx(loss, rel=RTOL, abs=0), step
        if step > 2:
            assert resumed_losses[step] == pytest.approx(loss, rel=RTOL, abs=0), step

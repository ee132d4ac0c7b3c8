"""What a new user meets on the command line of examples/train_gpt.py and
examples/finetune_hf.py: JSON-lines data without --tokenizer, --text-field, a missing
--tokenizer file, a --mesh that does not split the micro-batch, --resume on an empty
directory, warnings, and examples/slurm/train.sbatch's choice of script and Python.

The flags parse in-process (a usage error exits 2 before JAX starts); one subprocess run
checks that --resume on an empty --ckpt-dir is refused before the model is built. Resumes
across meshes and moment dtypes are in tests/test_checkpoint_relayout.py.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from _util import script_env

import sp_jax.checkpoint.lock
from sp_jax.training import TrainerConfig, TrainingStopped, cli, open_checkpoints

ROOT = Path(__file__).resolve().parents[1]
FINETUNE = ["--hf-dir", str(ROOT / "tests" / "fixtures" / "hf" / "llama")]


def _example(name: str):
    """An example's module, loaded without running it (its flags parse in-process)."""
    spec = importlib.util.spec_from_file_location(f"{name}_inputs",
                                                  ROOT / "examples" / f"{name}.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


def _usage_error(name: str, argv: list[str]) -> str:
    """The usage message of ``argv`` (exit status 2 asserted)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        _example(name).parse(argv)
    assert exit_info.value.code == 2, err.getvalue()
    return err.getvalue()


@pytest.fixture
def documents(tmp_path):
    """A JSON-lines file whose text is in "body", a parquet-free plain text file."""
    texts = [f"document {i}: naïve text" for i in range(12)]
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(f'{{"id": {i}, "body": "{t}"}}\n' for i, t in enumerate(texts)))
    plain = tmp_path / "notes.txt"
    plain.write_text("plain text\n")
    return jsonl, plain, texts


def test_json_lines_without_a_tokenizer_are_read_as_documents(documents):
    """Byte-level training on a .jsonl reads each record's --text-field, never the JSON."""
    jsonl, _, texts = documents
    args = _example("train_gpt").parse(["--data", str(jsonl), "--text-field", "body",
                                        "--seq-len", "16", "--held-out-fraction", "0.25"])
    corpus = cli.text_data(args)
    stream = bytes(np.concatenate([corpus.train, corpus.held_out]))
    assert stream == "".join(t + "\n" for t in texts).encode("utf-8")
    assert b'"' not in stream and b"body" not in stream and b"{" not in stream
    assert len(corpus.held_out) == len(stream) - int(len(stream) * 0.75)
    # --max-data-bytes caps the documents' bytes as it caps a text file's
    args = _example("train_gpt").parse(["--data", str(jsonl), "--text-field", "body",
                                        "--seq-len", "4", "--max-data-bytes", "100",
                                        "--held-out-fraction", "0.25"])
    capped = cli.text_data(args)
    assert len(capped.train) + len(capped.held_out) == 100


def test_a_missing_text_field_names_the_flag(documents):
    jsonl, _, _ = documents
    args = _example("train_gpt").parse(["--data", str(jsonl), "--seq-len", "16"])
    with pytest.raises(ValueError, match=r"docs.jsonl:1: no field 'text' \(fields: 'id', "
                                         r"'body'\); pass --text-field naming the field"):
        cli.text_data(args)


@pytest.mark.parametrize("name", ["train_gpt", "finetune_hf"])
def test_text_field_without_a_file_that_has_fields_is_a_usage_error(name, documents):
    jsonl, plain, _ = documents
    base = FINETUNE if name == "finetune_hf" else []
    message = _usage_error(name, [*base, "--data", str(plain), "--text-field", "body"])
    assert "--text-field 'body' names the JSON field or parquet column that holds the " \
           "text, but no --data file is JSON lines or parquet" in message
    message = _usage_error(name, [*base, "--text-field", "body"])
    assert "--text-field 'body'" in message and "there is no --data" in message
    # with a JSON-lines file among the data it is taken; without the flag: "text"
    example = _example(name)
    assert example.parse([*base, "--data", str(plain), str(jsonl), "--text-field",
                          "body"]).text_field == "body"
    assert example.parse([*base, "--data", str(jsonl)]).text_field == "text"


@pytest.mark.parametrize("name", ["train_gpt", "finetune_hf"])
def test_a_missing_tokenizer_file_is_a_usage_error(name, documents, tmp_path):
    jsonl, _, _ = documents
    base = FINETUNE if name == "finetune_hf" else []
    missing = tmp_path / "missing.json"
    message = _usage_error(name, [*base, "--data", str(jsonl), "--tokenizer", str(missing)])
    assert f"--tokenizer {missing}: no such file; give a Hugging Face tokenizer.json" \
        in message
    if name == "train_gpt":
        _example(name).parse(["--data", str(jsonl), "--tokenizer", "bytes"])  # accepted
    else:
        assert "--tokenizer bytes: no such file" in _usage_error(
            name, [*base, "--data", str(jsonl), "--tokenizer", "bytes"])


def test_a_mesh_that_does_not_split_the_micro_batch_names_the_flags():
    message = _usage_error("train_gpt", ["--mesh", "3,4"])
    assert ("a micro-batch of --batch-size 16 / --micro-batches 2 = 8 sequences does not "
            "split over the 3 data shards (DATA of --mesh): make --batch-size / "
            "--micro-batches a multiple of 3") in message
    message = _usage_error("train_gpt", ["--mesh", "2,3,1,4", "--layers", "2"])
    assert "--batch-size 16 / --microbatches 4 = 4 sequences does not split over the 3" \
        in message


def test_warnings_print_as_one_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("checkpoint directory d (--ckpt-dir): taking over the lock\n  left "
                      "by pid 1", stacklevel=1)
        warnings.warn("old", DeprecationWarning, stacklevel=1)
    user, other = caught
    lock = sp_jax.checkpoint.lock.__file__  # as sp_jax's lock module warns
    assert cli.format_warning(user.message, user.category, lock, user.lineno) == \
        "warning: checkpoint directory d (--ckpt-dir): taking over the lock left by pid 1\n"
    shown = cli.format_warning(other.message, other.category, other.filename, other.lineno)
    assert "DeprecationWarning: old" in shown and __file__ in shown
    # another library's UserWarning (here: this file's) keeps Python's form
    shown = cli.format_warning(user.message, user.category, user.filename, user.lineno)
    assert "UserWarning: checkpoint directory" in shown and __file__ in shown


def test_resume_on_an_empty_directory_is_refused_when_it_is_opened(tmp_path):
    """open_checkpoints, which a script enters before building anything, refuses it."""
    config = TrainerConfig(steps=2, batch_size=8, ckpt_dir=str(tmp_path / "empty"), resume=True)
    with pytest.raises(TrainingStopped, match=r"--resume: no checkpoint in --ckpt-dir "):
        with open_checkpoints(config):
            pytest.fail("opened")
    with open_checkpoints(TrainerConfig(steps=2, batch_size=8, ckpt_dir=str(tmp_path / "empty"),
                                        resume="auto")) as manager:
        assert manager.latest_step() is None


@pytest.mark.slow
def test_resume_on_an_empty_directory_exits_before_the_model_is_built(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "train_gpt.py"),
                          "--steps", "2", "--resume", "--ckpt-dir", str(tmp_path / "typo"),
                          "--no-progress"], cwd=ROOT, env=script_env(), capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "error: --resume: no checkpoint in --ckpt-dir" in run.stderr
    assert "model:" not in run.stdout and "data:" not in run.stdout  # nothing was built


def _sbatch(tmp_path: Path, *argv: str, python: str | None = None, venv: bool = True):
    """examples/slurm/train.sbatch's command for ``argv`` (SPJAX_PRINT_COMMAND), run by
    bash in a checkout-like directory (its examples/, and a .venv when ``venv``)."""
    checkout = tmp_path / "checkout"
    (checkout / "examples").mkdir(parents=True, exist_ok=True)
    for script in ("train_gpt.py", "finetune_hf.py"):
        (checkout / "examples" / script).write_text("")
    if venv:
        (checkout / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
        (checkout / ".venv" / "bin" / "python").write_text("#!/bin/sh\n")
        os.chmod(checkout / ".venv" / "bin" / "python", 0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env.update(SPJAX_DIR=str(checkout), SPJAX_PRINT_COMMAND="1", SLURM_JOB_ID="1",
               PATH="/usr/bin:/bin", **({"PYTHON": python} if python else {}))
    run = subprocess.run(["bash", str(ROOT / "examples" / "slurm" / "train.sbatch"), *argv],
                         env=env, capture_output=True, text=True, timeout=60)
    return checkout, run


def test_sbatch_runs_the_script_given_with_the_checkouts_python(tmp_path):
    checkout, run = _sbatch(tmp_path, "--steps", "3")
    assert run.returncode == 0, run.stderr
    assert run.stdout == f"{checkout}/.venv/bin/python examples/train_gpt.py --steps 3\n"
    _, run = _sbatch(tmp_path, "examples/finetune_hf.py", "--hf-dir", "d")
    assert run.stdout == f"{checkout}/.venv/bin/python examples/finetune_hf.py --hf-dir d\n"
    _, run = _sbatch(tmp_path, "--steps", "3", python="/opt/py")
    assert run.stdout == "/opt/py examples/train_gpt.py --steps 3\n"
    _, run = _sbatch(tmp_path / "bare", "--steps", "3", venv=False)
    assert run.stdout == "python3 examples/train_gpt.py --steps 3\n"
    _, run = _sbatch(tmp_path, "examples/missing.py")
    assert run.returncode == 2 and "no script examples/missing.py" in run.stderr
    multinode = subprocess.run(
        ["bash", str(ROOT / "examples" / "slurm" / "train_multinode.sbatch"),
         "examples/finetune_hf.py"], capture_output=True, text=True, timeout=60,
        env=dict(os.environ, SPJAX_DIR=str(tmp_path / "checkout")))
    assert multinode.returncode == 2 and "runs in one process" in multinode.stderr

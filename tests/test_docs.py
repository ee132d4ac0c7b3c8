"""The README's example runs as written, and the docs it links to exist."""

import re
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands():
    first_block = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["make demo", "make test"]


def test_readme_example_runs():
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    loss, grads = namespace["loss"], namespace["grads"]
    assert np.isfinite(float(loss)) and float(loss) > 0
    kernel_grad = np.asarray(grads["up"]["kernel"][...])
    assert kernel_grad.shape == (64, 256) and np.abs(kernel_grad).max() > 0


def test_readme_context_example_runs():
    """The long-context snippet: a ring-attention GPT on a (1, 2, 4) mesh computes the
    loss of the same model on one device."""
    import jax
    from flax import nnx

    code = re.findall(r"```python\n(.*?)```", README, re.S)[1]
    assert 'context_parallel="ring"' in code
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    model, tokens = namespace["model"], namespace["tokens"]
    single = jax.make_mesh((1, 1, 1), ("data", "context", "tensor"),
                           devices=jax.devices()[:1])
    with jax.set_mesh(single):
        state = jax.device_put(nnx.state(model), jax.NamedSharding(single, jax.P()))
        unsharded = nnx.merge(nnx.graphdef(model), state)
        tokens = jax.device_put(tokens, jax.NamedSharding(single, jax.P()))
        want = nnx.jit(lambda m, t: m.loss(t[:, :-1], t[:, 1:]))(unsharded, tokens)
    np.testing.assert_allclose(float(namespace["loss"]), float(want), rtol=1e-5)


def test_linked_docs_exist():
    links = re.findall(r"\]\(([^)#]+\.md)\)", README)
    assert {"docs/api.md", "docs/training.md", "docs/measurement.md",
            "docs/errors.md"} <= set(links)
    for link in links:
        assert (ROOT / link).is_file(), link


def test_import_sp_jax_exposes_the_subpackages():
    """``import sp_jax`` alone gives ``sp_jax.models.GPT`` and friends (fresh interpreter,
    so no other test's import can help), without starting the JAX backend."""
    import os
    import subprocess
    import sys

    code = ("import sp_jax\n"
            "from jax._src import xla_bridge\n"
            "assert sp_jax.models.GPT and sp_jax.training.TrainStep and sp_jax.layout.Layout\n"
            "import sys\n"
            "loaded = [m for m in ('sp_jax.analysis', 'tqdm', 'matplotlib', 'orbax')\n"
            "          if any(n == m or n.startswith(m + '.') for n in sys.modules)]\n"
            "assert not loaded, loaded  # measurement code and heavy optional imports\n"
            "assert sp_jax.analysis.compile_for_gpu and sp_jax.checkpoint.CheckpointManager\n"
            "assert not xla_bridge.backends_are_initialized()\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_readme_hf_round_trip_runs(tmp_path, monkeypatch):
    """The Hugging Face snippet (ten lines): the fixture Llama loads on 2x4 devices, its
    loss is finite, and what it writes reads back to the same parameters."""
    import jax
    from _util import assert_bitwise, param_values

    from sp_jax.models import hf

    code = next(c for c in re.findall(r"```python\n(.*?)```", README, re.S)
                if "hf.from_hf" in c)
    assert "hf.from_hf" in code and "hf.to_hf" in code and len(code.splitlines()) <= 10
    monkeypatch.chdir(ROOT)
    code = code.replace('"runs/llama-out"', repr(str(tmp_path / "out")))
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    assert np.isfinite(float(namespace["loss"]))
    with jax.set_mesh(jax.make_mesh((1, 8), ("data", "tensor"))):
        again = hf.from_hf(tmp_path / "out")
    assert_bitwise(param_values(namespace["model"]), param_values(again))


@pytest.mark.slow
def test_every_test_the_fault_table_names_exists():
    """docs/errors.md "Faults": each row's tests (``file.py::name``; a bare name is in the
    file named before it in the same cell; ``*`` matches any name) are test functions of
    tests/."""
    import fnmatch

    faults = (ROOT / "docs" / "errors.md").read_text().split("# Faults", 1)[1]
    rows = [line for line in faults.splitlines() if line.startswith("| ")][2:]
    assert len(rows) >= 20
    missing = []
    for row in rows:
        test_file = None
        for token in re.findall(r"`([^`]+)`", row.rstrip(" |").rsplit(" | ", 1)[1]):
            if token.endswith(".py"):  # "(and the same test in `test_x.py`)"
                test_file = token
                continue
            file_name, _, name = token.rpartition("::")
            test_file = file_name or test_file
            assert test_file is not None, row
            source = (ROOT / "tests" / test_file).read_text()
            defined = re.findall(r"^def (test_\w+)", source, re.M)
            if not fnmatch.filter(defined, name):
                missing.append(f"{test_file}::{name}")
    assert not missing, missing


def test_flag_tables_are_the_parsers():
    """docs/training.md's flag tables of examples/train_gpt.py and examples/finetune_hf.py
    are what scripts/flag_tables.py renders from their parsers (every flag, its default
    and its help), so a flag added to a parser shows up in the docs or fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "flag_tables", ROOT / "scripts" / "flag_tables.py")
    flag_tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(flag_tables)
    text = (ROOT / "docs" / "training.md").read_text()
    shown = flag_tables.tables(text)
    assert sorted(shown) == sorted(flag_tables.SCRIPTS)
    rendered = flag_tables.tables(flag_tables.render(text))
    for script in flag_tables.SCRIPTS:
        assert shown[script] == rendered[script], (
            f"{script}'s flags changed: run python scripts/flag_tables.py")
        parser = flag_tables.parser_of(script)
        for action in parser._actions:  # every flag is a row, named as --help names it
            if action.option_strings and action.dest != "help":
                assert f"`{', '.join(action.option_strings)}" in shown[script], action.dest
    train = shown["examples/train_gpt.py"]
    for flag in ("--tokenizer", "--text-field", "--packing", "--tensorboard", "--fp8",
                 "mixtral-tiny"):
        assert flag in train, flag

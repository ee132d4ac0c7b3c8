"""sp_jax.checkpoint: save on a data=2 x tensor=4 mesh, restore onto other meshes and into
the unsharded model bitwise; clear errors for another model; failed or killed saves leave
the previous checkpoint loadable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from _util import assert_bitwise
from conftest import make_mesh
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sp_jax.checkpoint import (
    ABSENT,
    CheckpointManager,
    CheckpointSaveError,
    MetadataMismatchError,
    abstract_like,
    latest_step,
    restore_checkpoint,
    save_checkpoint,
)
from sp_jax.models import GPT, GPTConfig
from sp_jax.training import TrainStep

ROOT = Path(__file__).resolve().parents[1]
CFG = dict(vocab_size=64, max_seq_len=16, num_layers=1, num_heads=8, hidden=32)


def _trainer(mesh, **overrides) -> TrainStep:
    """A tiny GPT and AdamW on ``mesh`` (same initial values on every mesh)."""
    with jax.set_mesh(mesh):
        model = GPT(GPTConfig(**{**CFG, **overrides}), rngs=nnx.Rngs(0))
        return TrainStep(model, optax.adamw(1e-2))


def _trained(mesh) -> TrainStep:
    """Two optimizer steps, so the parameters and Adam moments are far from their init."""
    step = _trainer(mesh)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG["vocab_size"], size=(2, 8, CFG["max_seq_len"] + 1))
    batch = {"tokens": tokens[..., :-1].astype(np.int32),
             "labels": tokens[..., 1:].astype(np.int32)}
    with jax.set_mesh(mesh):
        batch = jax.device_put(batch, NamedSharding(mesh, P(None, "data", None)))
        for i in range(2):
            step(batch, jax.random.key(i))
    return step


def _listed(directory) -> list[str]:
    """The entries of a checkpoint directory but the writer's lock file."""
    return sorted(p for p in os.listdir(directory) if p != ".sp_jax.lock")


def _host(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint (step 2) written from a data=2 x tensor=4 mesh, and its source."""
    directory = tmp_path_factory.mktemp("ckpt") / "run"
    src = _trained(make_mesh(2, 4))
    save_checkpoint(directory, 2, src.params, src.opt_state, metadata={"note": "2x4"})
    return directory, src


@pytest.mark.parametrize("shape", [pytest.param((2, 4), marks=pytest.mark.slow), (4, 2),
                                   pytest.param((1, 1), marks=pytest.mark.slow)])
def test_restore_onto_other_meshes_bitwise(saved, shape):
    directory, src = saved
    mesh = make_mesh(*shape)
    dst = _trainer(mesh)
    # The fresh model differs from the saved one: the restore must overwrite every leaf.
    assert any(not np.array_equal(x, y) for x, y in zip(_host(dst.params),
                                                        _host(src.params), strict=True))
    restored = restore_checkpoint(directory, params_like=abstract_like(dst.params),
                                  opt_state_like=abstract_like(dst.opt_state))
    assert restored.step == 2 and restored.metadata == {"note": "2x4"}
    assert_bitwise(restored.params, src.params)
    assert_bitwise(restored.opt_state, src.opt_state)
    # ... laid out as the target mesh says, so the step function accepts them as they are.
    for got, want in zip(jax.tree.leaves(restored.params), jax.tree.leaves(dst.params),
                         strict=True):
        assert got.sharding == want.sharding
    if shape == (1, 8):
        kernel = restored.params["blocks"][0]["mlp"]["up"]["kernel"]
        assert kernel.sharding.mesh.shape == {"data": 1, "tensor": 8}
        assert kernel.addressable_shards[0].data.shape == (32, 128 // 8)
    dst.params, dst.opt_state = restored.params, restored.opt_state
    with jax.set_mesh(mesh):  # training continues from the restored state
        tokens = np.zeros((1, 8, CFG["max_seq_len"]), np.int32)
        batch = jax.device_put({"tokens": tokens, "labels": tokens},
                               NamedSharding(mesh, P(None, "data", None)))
        assert np.isfinite(float(dst(batch, jax.random.key(0))["loss"]))


@pytest.mark.slow
def test_restore_into_unsharded_model(saved):
    """Plain single-device arrays: the target is the unsharded model's own state."""
    directory, src = saved
    model = GPT(GPTConfig(**CFG), rngs=nnx.Rngs(1))  # no mesh: one device
    target = nnx.state(model, nnx.Param)
    restored = restore_checkpoint(directory, params_like=target)
    assert restored.opt_state is None
    for leaf in jax.tree.leaves(restored.params):
        assert isinstance(leaf.sharding, jax.sharding.SingleDeviceSharding)
    assert_bitwise(restored.params, src.params)
    nnx.update(model, restored.params)
    assert_bitwise(nnx.state(model, nnx.Param), src.params)


def test_other_model_shape_names_parameter_and_shapes(saved):
    directory, _ = saved
    narrower = _trainer(make_mesh(2, 4), mlp_hidden=64)
    with pytest.raises(ValueError) as err:
        restore_checkpoint(directory, params_like=abstract_like(narrower.params))
    msg = str(err.value)
    assert f"checkpoint step 2 in {directory}" in msg
    assert "3 mismatched leaves" in msg, msg
    assert "params/blocks/0/mlp/up/kernel/value: shape (32, 128) in the checkpoint, " \
           "(32, 64) in the target" in msg, msg
    assert "params/blocks/0/mlp/down/kernel/value: shape (128, 32)" in msg, msg
    # Every leaf of a wider model mismatches: the message stays short.
    wider = _trainer(make_mesh(2, 4), hidden=64)
    with pytest.raises(ValueError, match=r"15 mismatched leaves(.|\n)*\n  \.\.\.$"):
        restore_checkpoint(directory, params_like=abstract_like(wider.params))


@pytest.mark.slow
def test_other_model_structure_names_missing_parameters(saved):
    directory, _ = saved
    deeper = _trainer(make_mesh(2, 4), num_layers=2)
    with pytest.raises(ValueError, match=r"not in the checkpoint: .*blocks/1/") as err:
        restore_checkpoint(directory, params_like=abstract_like(deeper.params))
    assert "params tree does not match" in str(err.value)
    # The optimizer state is checked too.
    src = _trainer(make_mesh(2, 4))
    other_tx = optax.sgd(0.1, momentum=0.9).init(src.params)
    with pytest.raises(ValueError, match="opt_state tree does not match"):
        restore_checkpoint(directory, params_like=abstract_like(src.params),
                           opt_state_like=abstract_like(other_tx))


@pytest.mark.slow
def test_other_dtype_raises_unless_cast(saved):
    directory, src = saved
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, jax.numpy.bfloat16, sharding=x.sharding),
        src.params)
    with pytest.raises(ValueError, match=r"dtype float32 in the checkpoint, bfloat16"):
        restore_checkpoint(directory, params_like=target)
    cast = restore_checkpoint(directory, params_like=target, allow_dtype_cast=True)
    leaf = jax.tree.leaves(cast.params)[0]
    assert leaf.dtype == jax.numpy.bfloat16
    np.testing.assert_array_equal(np.asarray(leaf),
                                  np.asarray(jax.tree.leaves(src.params)[0]).astype(leaf.dtype))


def test_manager_lists_keeps_and_refuses_existing_step(tmp_path):
    src = _trainer(make_mesh(2, 4))
    with CheckpointManager(tmp_path / "c", max_to_keep=2) as ckpt:
        assert ckpt.latest_step() is None
        for step in (1, 2, 3):
            ckpt.save(step, src.params, metadata={"step_was": step})
        assert ckpt.all_steps() == [2, 3]
        assert ckpt.metadata() == {"step_was": 3}
        with pytest.raises(ValueError, match=r"step 3 already exists in .*c"):
            ckpt.save(3, src.params)
        with pytest.raises(FileNotFoundError, match=r"no checkpoint step 1 in .*steps there: "
                                                     r"\[2, 3\]"):
            ckpt.restore(1, params_like=src.params)
        with pytest.raises(ValueError, match="holds no optimizer state"):
            ckpt.restore(params_like=src.params, opt_state_like=src.opt_state)
    assert latest_step(tmp_path / "c") == 3
    assert latest_step(tmp_path / "missing") is None


def _inject_write_failure(monkeypatch):
    """The parameter arrays are written, then the save fails (as a full disk would)."""
    import orbax.checkpoint as ocp

    handler = ocp.handlers.StandardCheckpointHandler
    original = handler.async_save

    async def failing(self, directory, *args, **kwargs):
        futures = await original(self, directory, *args, **kwargs)
        for f in futures or []:
            f.result()  # the arrays really are on disk (in the temporary directory)
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(handler, "async_save", failing)


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch, async_save):
    directory = tmp_path / "c"
    src = _trained(make_mesh(2, 4))
    ckpt = CheckpointManager(directory, async_save=async_save)
    ckpt.save(1, src.params, src.opt_state)
    ckpt.wait_until_finished()
    with monkeypatch.context() as m:
        _inject_write_failure(m)
        with pytest.raises(CheckpointSaveError) as err:
            ckpt.save(2, jax.tree.map(lambda x: x + 1, src.params), src.opt_state)
            ckpt.wait_until_finished()  # async: the error surfaces here
    e = err.value
    assert e.step == 2 and e.directory == str(directory)
    assert f"saving checkpoint step 2 to {directory} failed" in str(e)
    assert "No space left on device (injected)" in str(e)
    assert "latest complete checkpoint is step 1" in str(e)
    ckpt.close()
    # Nothing of step 2 was committed; reopening cleans up its temporary directory.
    assert not (directory / "2").exists()
    reopened = CheckpointManager(directory)
    assert reopened.all_steps() == [1]
    assert _listed(directory) == ["1"]
    dst = _trainer(make_mesh(4, 2))
    restored = reopened.restore(params_like=abstract_like(dst.params),
                                opt_state_like=abstract_like(dst.opt_state))
    assert restored.step == 1
    assert_bitwise(restored.params, src.params)
    assert_bitwise(restored.opt_state, src.opt_state)
    # And the manager saves again afterwards.
    reopened.save(2, src.params, src.opt_state)
    assert reopened.all_steps() == [1, 2]
    reopened.close()


_KILLED_SAVER = """
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P
from sp_jax.checkpoint import CheckpointManager

mesh = jax.make_mesh((2, 4), ("data", "tensor"))
params = {"w": jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
                              NamedSharding(mesh, P("data", "tensor")))}
ckpt = CheckpointManager(sys.argv[1])
ckpt.save(1, params)
handler = ocp.handlers.StandardCheckpointHandler
original = handler.async_save

async def stalled(self, directory, *args, **kwargs):
    futures = await original(self, directory, *args, **kwargs)
    for f in futures or []:
        f.result()
    print("WRITTEN", flush=True)  # the arrays of step 2 are on disk; now hang
    time.sleep(600)

handler.async_save = stalled
ckpt.save(2, {"w": params["w"] + 1})
"""


@pytest.mark.slow
def test_killed_save_keeps_previous_checkpoint(tmp_path):
    """A process killed (SIGKILL) while writing step 2: step 1 still loads, step 2 is
    absent, and its temporary directory is removed when the directory is reopened."""
    directory = tmp_path / "c"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_KILLED_SAVER),
                             str(directory)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while "WRITTEN" not in line and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "WRITTEN" in line, proc.stderr.read() if proc.poll() is not None else ""
        tmp = [p for p in os.listdir(directory) if p.startswith("2.")]
        assert tmp and "tmp" in tmp[0], os.listdir(directory)  # written, not committed
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    # The killed writer's lock file is left behind; its lock died with it: taken over.
    with pytest.warns(UserWarning, match=f"taking over the lock left by pid {proc.pid} "):
        ckpt = CheckpointManager(directory)
    with ckpt:
        assert ckpt.stale_lock["pid"] == proc.pid
        assert ckpt.all_steps() == [1]
        assert _listed(directory) == ["1"]
        target = {"w": jax.ShapeDtypeStruct((64, 32), np.float32,
                                            sharding=NamedSharding(make_mesh(1, 8),
                                                                   P(None, "tensor")))}
        restored = ckpt.restore(params_like=target)
    np.testing.assert_array_equal(np.asarray(restored.params["w"]),
                                  np.arange(64 * 32, dtype=np.float32).reshape(64, 32))


# -- resume metadata ---------------------------------------------------------------------

_MODEL = {"hidden": 32, "num_layers": 1, "dtype": "float32"}
_RUN = {"lr": 3e-3, "data": ["a/*.py"], "seed": 0}


@pytest.fixture(scope="module")
def with_metadata(tmp_path_factory):
    """Step 5 saved with model and run sections (and a step counter besides them)."""
    directory = tmp_path_factory.mktemp("meta") / "c"
    save_checkpoint(directory, 5, {"w": np.zeros(3, np.float32)},
                    metadata={"step": 5, "model": _MODEL, "run": _RUN})
    return directory


@pytest.mark.slow
def test_check_metadata_same_run(with_metadata):
    with CheckpointManager(with_metadata) as ckpt:
        # Tuples compare as the lists JSON saved; keys outside the sections are ignored.
        current = {"model": dict(_MODEL), "run": {**_RUN, "data": ("a/*.py",)}}
        assert ckpt.check_metadata(current) == {}
        assert ckpt.check_metadata(current, 5, must_match=()) == {}


def test_check_metadata_returns_changed_run_settings(with_metadata):
    with CheckpointManager(with_metadata) as ckpt:
        changed = ckpt.check_metadata({"model": _MODEL,
                                       "run": {"lr": 1e-3, "data": ["a/*.py"], "warmup": 5}})
    assert changed == {"run": {"lr": (3e-3, 1e-3), "seed": (0, ABSENT),
                               "warmup": (ABSENT, 5)}}
    assert repr(ABSENT) == "<absent>"


@pytest.mark.slow
def test_check_metadata_refuses_another_model(with_metadata):
    with CheckpointManager(with_metadata) as ckpt:
        with pytest.raises(MetadataMismatchError) as err:
            ckpt.check_metadata({"model": {**_MODEL, "hidden": 64, "norm": "rmsnorm"},
                                 "run": {**_RUN, "lr": 1.0}})
        e = err.value
        assert isinstance(e, ValueError)
        assert e.step == 5 and e.directory == str(with_metadata)
        assert e.differences == {"model": {"hidden": (32, 64), "norm": (ABSENT, "rmsnorm")}}
        msg = str(e)
        assert f"checkpoint step 5 in {with_metadata} was saved with another model" in msg
        assert "hidden 32 saved vs 64 now" in msg and "norm <absent> saved vs 'rmsnorm' now" in msg
        assert "lr" not in msg  # run settings may change
        # How the same arrays are computed may change (--remat, the attention kernel):
        # returned as changed settings, not refused.
        changed = ckpt.check_metadata({"model": {**_MODEL, "remat": True}, "run": _RUN})
        assert changed == {"model": {"remat": (ABSENT, True)}}
        # Any section can be declared must-match.
        with pytest.raises(MetadataMismatchError, match=r"another run .*lr 0\.003 saved vs 1"):
            ckpt.check_metadata({"run": {**_RUN, "lr": 1}}, must_match=("run",))


@pytest.mark.slow
def test_check_metadata_bad_input(with_metadata):
    with CheckpointManager(with_metadata) as ckpt:
        with pytest.raises(TypeError, match="section 'model' must be a mapping"):
            ckpt.check_metadata({"model": 3})
        with pytest.raises(TypeError, match="must be JSON-serialisable"):
            ckpt.check_metadata({"model": {"dtype": np.float32}})
        with pytest.raises(FileNotFoundError, match="no checkpoint step 4"):
            ckpt.check_metadata({"model": _MODEL}, 4)


def test_missing_orbax_names_the_core_dependency(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # import fails
    with pytest.raises(ImportError) as err:
        CheckpointManager(tmp_path / "c")
    assert "pip install orbax-checkpoint" in str(err.value)
    assert "reinstall sp_jax" in str(err.value) and "examples" not in str(err.value)


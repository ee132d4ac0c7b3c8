"""sp_jax.checkpoint under faults: damaged files give one CheckpointCorruptError (never
changed values), restore falls back to the newest intact step, NaN is never written, one
writer per directory (stale locks of killed writers taken over), and an async save in
flight at interpreter exit is finished."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import assert_bitwise, script_env
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sp_jax.checkpoint import (
    CheckpointCorruptError,
    CheckpointLockedError,
    CheckpointManager,
    MetadataMismatchError,
    NonFiniteError,
    abstract_like,
    integrity,
    restore_checkpoint,
    save_checkpoint,
)

ROOT = Path(__file__).resolve().parents[1]
MODEL = {"hidden": 48, "layers": 1}
RUN = {"lr": 3e-3, "seed": 0}


def _state(scale: float = 1.0) -> tuple[dict, dict]:
    """Small params and optimizer state on a data=2 x tensor=4 mesh, of several dtypes.
    Random values (zstd stores them nearly raw, so a flipped bit in a data file often
    decodes to another value: the case only the checksums catch)."""
    mesh = make_mesh(2, 4)
    rng = np.random.default_rng(0)

    def put(x, *spec):
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    w = rng.normal(size=(64, 48)).astype(np.float32) * scale
    params = {"w": put(w, "data", "tensor"),
              "emb": put(rng.normal(size=(32, 16)).astype(jnp.bfloat16), None, "tensor"),
              "ids": put(rng.integers(-1000, 1000, size=(40,), dtype=np.int32), "data")}
    opt_state = {"mu": put(w * 0.1, "data", "tensor"), "count": put(np.int32(7))}
    return params, opt_state


@pytest.fixture(scope="module")
def state():
    return _state()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, state):
    """Step 7 of ``state``, with model and run metadata: copied, then damaged, per test."""
    directory = tmp_path_factory.mktemp("faults") / "ckpt"
    params, opt_state = state
    save_checkpoint(directory, 7, params, opt_state, metadata={"model": MODEL, "run": RUN})
    return directory


def _copy(saved: Path, tmp_path: Path, name: str = "ckpt") -> Path:
    directory = tmp_path / name
    shutil.copytree(saved, directory)
    return directory


def _restore(directory: Path, state, **kwargs):
    params, opt_state = state
    with CheckpointManager(directory, lock=False) as manager:
        return manager.restore(params_like=abstract_like(params),
                               opt_state_like=abstract_like(opt_state), **kwargs)


def _flip(path: Path, offset: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def _data_files(step_dir: Path) -> list[Path]:
    """The files holding array data (OCDBT ``d/`` files) of params and opt_state."""
    files = sorted(p for p in step_dir.rglob("*") if p.is_file() and p.parent.name == "d")
    assert {p.relative_to(step_dir).parts[0] for p in files} == {"params", "opt_state"}
    return files


def _damaged(directory: Path, step: int, match: str = "") -> CheckpointCorruptError:
    """Asserts a one-line CheckpointCorruptError naming the step and directory."""

    def check(e: CheckpointCorruptError) -> CheckpointCorruptError:
        msg = str(e)
        assert msg.startswith(f"checkpoint step {step} in {directory} is damaged: "), msg
        assert "\n" not in msg and "tensorstore_spec" not in msg and len(msg) < 700, msg
        assert e.step == step and e.directory == str(directory) and e.reason in msg
        assert match in msg, msg
        return e

    return check


# -- integrity data ----------------------------------------------------------------------

def test_checksums_are_sharding_independent_and_catch_every_single_bit_flip():
    """The checksum of the same values is equal on any mesh, on one device and on the
    host, and flipping any one bit of any element changes it, for every dtype width."""
    rng = np.random.default_rng(1)
    values = {"f32": rng.normal(size=(8, 12)).astype(np.float32),
              "bf16": rng.normal(size=(8, 4)).astype(jnp.bfloat16),
              "i8": rng.integers(-128, 127, size=(16, 3), dtype=np.int8),
              "u16": rng.integers(0, 2**16, size=(8, 2), dtype=np.uint16),
              "bool": rng.integers(0, 2, size=(8,)).astype(bool),
              "f64": rng.normal(size=(4, 3)),  # host only (x64 is off)
              "scalar": np.float32(3.5)}
    host = integrity.checksums(values)
    for shape in [(2, 4), (4, 2)]:
        mesh = make_mesh(*shape)
        placed = {k: jax.device_put(v, NamedSharding(mesh, P("data") if v.ndim else P()))
                  for k, v in values.items() if v.dtype != np.float64}
        assert integrity.checksums(placed) == {k: host[k] for k in placed}
    assert integrity.checksums({"f32": jnp.asarray(values["f32"])})["f32"] == host["f32"]
    for name, x in values.items():
        raw = np.ascontiguousarray(x).reshape(-1).view(np.uint8)
        for byte in range(raw.size) if raw.size <= 32 else rng.choice(raw.size, 32, False):
            for bit in range(1 if x.dtype == bool else 8):
                flipped = raw.copy()
                flipped[byte] ^= 1 << bit
                other = flipped.view(x.dtype).reshape(np.shape(x))
                assert integrity.checksums({name: other})[name][:2] != host[name][:2], (
                    name, byte, bit)


def test_bit_flips_in_data_files_are_detected_or_harmless(saved, state, tmp_path, capfd):
    """A flipped bit at offsets spread over every array data file: each restore either
    raises CheckpointCorruptError naming the step, or returns the saved values bitwise
    (the bit was in bytes nothing reads) -- never other values."""
    src = saved / "7"
    outcomes = {"equal": 0, "checksum": 0, "read error": 0}
    case = 0
    for path in _data_files(src):
        size = path.stat().st_size
        for offset in sorted({int(o) for o in np.linspace(0, size - 1, 4)}):
            case += 1
            directory = _copy(saved, tmp_path, f"c{case}")
            _flip(directory / "7" / path.relative_to(src), offset, bit=case % 8)
            try:
                restored = _restore(directory, state)
            except CheckpointCorruptError as e:
                _damaged(directory, 7)(e)
                outcomes["checksum" if "checksum mismatch" in e.reason else "read error"] += 1
            else:
                assert_bitwise(restored.params, state[0])
                assert_bitwise(restored.opt_state, state[1])
                outcomes["equal"] += 1
            shutil.rmtree(directory)
    assert outcomes["checksum"] >= 1, outcomes  # values tensorstore decoded without error
    assert outcomes["read error"] >= 1, outcomes
    # Only the one error: no tracebacks of the reads orbax abandoned.
    err = capfd.readouterr().err
    assert "Traceback" not in err and "never retrieved" not in err, err[-2000:]


def test_checksum_mismatch_names_the_leaf(saved, state, tmp_path):
    """A changed value that decodes fine (here: the stored array rewritten through
    tensorstore, as a bit flip in its raw data would) is caught by its checksum."""
    directory = _copy(saved, tmp_path)
    params, opt_state = state
    w = np.asarray(params["w"]).copy()
    w[3, 5] += 1.0
    other = {**params, "w": jax.device_put(w, params["w"].sharding)}
    staging = tmp_path / "staging"
    save_checkpoint(staging, 7, other, opt_state)
    shutil.rmtree(directory / "7" / "params")
    shutil.copytree(staging / "7" / "params", directory / "7" / "params")
    with pytest.raises(CheckpointCorruptError) as err:
        _restore(directory, state)
    _damaged(directory, 7, "params/w: checksum mismatch (the file holding it was changed "
                           "after it was written)")(err.value)
    # ... also when the target asks for a cast: verified in the saved dtype, then cast.
    cast = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float16, sharding=x.sharding)
                        if x.dtype == jnp.float32 else x, abstract_like(params))
    with CheckpointManager(directory, lock=False) as manager:
        with pytest.raises(CheckpointCorruptError, match="params/w: checksum mismatch"):
            manager.restore(params_like=cast, allow_dtype_cast=True)
        with pytest.raises(CheckpointCorruptError, match="params/w: checksum mismatch"):
            manager.verify(params_like=params, opt_state_like=opt_state)
    with CheckpointManager(saved, lock=False) as manager:
        assert manager.verify(7, params_like=cast, opt_state_like=opt_state) is None
        # the items to cast are named exactly: a misspelt or bare-string one is refused
        for bad in ("opt_state", ("opt-state",)):
            with pytest.raises(ValueError, match=r"allow_dtype_cast=.* must be a bool or a "
                                                 r"sequence of the items to cast, 'params'"):
                manager.restore(params_like=cast, allow_dtype_cast=bad)
    restored = restore_checkpoint(saved, params_like=cast, allow_dtype_cast=True)
    assert restored.params["w"].dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(restored.params["w"]),
                                  np.asarray(params["w"]).astype(np.float16))


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_truncated_or_deleted_array_file(saved, state, tmp_path, damage):
    directory = _copy(saved, tmp_path)
    largest = max(_data_files(directory / "7"), key=lambda p: p.stat().st_size)
    if damage == "truncate":
        os.truncate(largest, largest.stat().st_size // 2)
    else:
        largest.unlink()
    with pytest.raises(CheckpointCorruptError) as err:
        _restore(directory, state)
    _damaged(directory, 7)(err.value)
    # The leaf (or else the file) is named, and what happened to it.
    hint = "truncated" if damage == "truncate" else "missing"
    assert re.search(rf"is damaged: (params|opt_state)/\w+: a file is [a-z ]*{hint}",
                     str(err.value)) or largest.name in str(err.value), str(err.value)


def test_damaged_orbax_metadata(saved, state, tmp_path):
    directory = _copy(saved, tmp_path)
    os.truncate(directory / "7" / "params" / "_METADATA", 50)
    with pytest.raises(CheckpointCorruptError) as err:
        _restore(directory, state)
    _damaged(directory, 7, "a JSON file is truncated or garbled (7/params/_METADATA)")(err.value)
    shutil.rmtree(directory / "7" / "params")
    with pytest.raises(CheckpointCorruptError) as err:
        _restore(directory, state)
    _damaged(directory, 7, "params: the item's directory is missing")(err.value)


def _meta_file(directory: Path) -> Path:
    (path,) = [p for p in (directory / "7" / "meta").iterdir() if p.suffix != ".txt"]
    return path


@pytest.mark.parametrize("damage", ["delete", "truncate", "flip"])
def test_damaged_meta_json(saved, state, tmp_path, damage):
    """restore, metadata and check_metadata all report the damaged JSON record."""
    directory = _copy(saved, tmp_path)
    meta = _meta_file(directory)
    if damage == "delete":
        meta.unlink()
        hint = "meta: the JSON record cannot be read: a file is missing"
    elif damage == "truncate":
        os.truncate(meta, meta.stat().st_size // 2)
        hint = "meta: the JSON record cannot be read: a JSON file is truncated or garbled"
    else:  # a digit of the step's metadata (still valid JSON): only the digest sees it
        text = meta.read_bytes()
        _flip(meta, text.index(b'"hidden": 48') + len(b'"hidden": '), bit=1)  # 48 -> 68
        hint = "meta: digest mismatch (the JSON record was changed after it was written)"
    check = _damaged(directory, 7, hint)
    with pytest.raises(CheckpointCorruptError) as err:
        _restore(directory, state)
    check(err.value)
    with CheckpointManager(directory, lock=False) as manager:
        with pytest.raises(CheckpointCorruptError) as err:
            manager.metadata(7)
        check(err.value)
        with pytest.raises(CheckpointCorruptError) as err:
            manager.check_metadata({"model": MODEL})
        check(err.value)


def test_bit_flips_in_meta_json_are_detected_or_harmless(saved, tmp_path):
    """A flipped bit anywhere in the JSON record (sampled offsets, all bit positions):
    CheckpointCorruptError, or -- when the JSON still means the same (e.g. 'e' -> 'E' in
    a float) -- the saved metadata."""
    directory = _copy(saved, tmp_path)
    meta = _meta_file(directory)
    original = meta.read_bytes()
    detected = 0
    with CheckpointManager(directory, lock=False) as manager:
        for i, offset in enumerate(np.linspace(0, len(original) - 1, 48).astype(int)):
            meta.write_bytes(original)
            _flip(meta, int(offset), bit=i % 8)
            try:
                got = manager.metadata(7)
            except CheckpointCorruptError as e:
                _damaged(directory, 7, "meta: ")(e)
                detected += 1
            else:
                assert got == {"model": MODEL, "run": RUN}, (offset, i % 8)
    assert detected >= 40


def test_empty_step_directory_is_listed_and_damaged(saved, state, tmp_path):
    """An empty directory named like a step: listed (as orbax lists it), and reported as
    damaged by restore, metadata and check_metadata."""
    directory = _copy(saved, tmp_path)
    (directory / "9").mkdir()
    with CheckpointManager(directory, lock=False) as manager:
        assert manager.all_steps() == [7, 9] and manager.latest_step() == 9
        check = _damaged(directory, 9, "the step directory is empty")
        for read in (lambda: manager.metadata(), lambda: manager.check_metadata({}),
                     lambda: manager.restore(params_like=abstract_like(state[0]))):
            with pytest.raises(CheckpointCorruptError) as err:
                read()
            check(err.value)
        restored = manager.restore(params_like=abstract_like(state[0]), fallback=True)
    assert restored.step == 7
    assert restored.skipped == (f"checkpoint step 9 in {directory} is damaged: the step "
                                "directory is empty (its files were deleted)",)


def test_checkpoint_without_integrity_data_restores_with_a_warning(saved, state, tmp_path):
    """A checkpoint written before checksums existed: restored, unverified, with a
    warning saying so."""
    directory = _copy(saved, tmp_path)
    meta = _meta_file(directory)
    record = json.loads(meta.read_text())
    meta.write_text(json.dumps({"step": record["step"], "metadata": record["metadata"]}))
    with pytest.warns(UserWarning, match="checkpoint step 7 .* has no integrity data .*"
                                         "restored unverified"):
        restored = _restore(directory, state)
    assert_bitwise(restored.params, state[0])
    assert restored.metadata == {"model": MODEL, "run": RUN}


# -- fallback ----------------------------------------------------------------------------

def test_fallback_to_the_newest_intact_step(state, tmp_path):
    params, opt_state = state
    directory = tmp_path / "ckpt"
    later = jax.tree.map(lambda x: x + 1, params)
    with CheckpointManager(directory) as manager:
        manager.save(1, params, opt_state, metadata={"model": MODEL})
        manager.save(2, later, opt_state, metadata={"model": MODEL})
        manager.save(3, later, opt_state, metadata={"model": MODEL})
    shutil.rmtree(directory / "3")  # damage 3 and 2 in two ways
    (directory / "3").mkdir()
    largest = max((p for p in _data_files(directory / "2") if "params" in p.parts),
                  key=lambda p: p.stat().st_size)
    os.truncate(largest, 10)
    with pytest.raises(CheckpointCorruptError) as err:
        _restore(directory, state)  # no fallback: the latest step's damage is raised
    _damaged(directory, 3)(err.value)
    restored = _restore(directory, state, fallback=True)
    assert restored.step == 1
    assert_bitwise(restored.params, params)
    assert len(restored.skipped) == 2
    assert restored.skipped[0].startswith(f"checkpoint step 3 in {directory} is damaged: "
                                          "the step directory is empty")
    assert restored.skipped[1].startswith(f"checkpoint step 2 in {directory} is damaged: ")
    assert "a file is truncated" in restored.skipped[1], restored.skipped
    # From a given step down.
    with CheckpointManager(directory, lock=False) as manager:
        again = manager.restore(2, params_like=abstract_like(params), fallback=True)
    assert again.step == 1 and len(again.skipped) == 1
    assert again.skipped[0].startswith(f"checkpoint step 2 in {directory} is damaged: ")
    # A target mismatch is not damage: raised, not skipped.
    with pytest.raises(ValueError, match="shape") as err:
        _restore(directory, ({**params, "w": jax.ShapeDtypeStruct((3, 3), np.float32)},
                             opt_state), fallback=True)
    assert not isinstance(err.value, CheckpointCorruptError)
    # Every step damaged: one error listing them all.
    shutil.rmtree(directory / "1" / "meta")
    with pytest.raises(CheckpointCorruptError) as err:
        _restore(directory, state, fallback=True)
    msg = str(err.value)
    assert msg.startswith(f"every checkpoint step in {directory} is damaged, newest first: "
                          "step 3: the step directory is empty"), msg
    assert "; step 2: " in msg and "; step 1: meta: " in msg and err.value.step == 3


def test_quarantine_moves_a_damaged_step_out_of_the_way(state, tmp_path):
    """After falling back, the damaged newer steps are moved aside, so that the resumed run
    can save those step numbers again (and rotation never trips over them)."""
    params, _ = state
    directory = tmp_path / "ckpt"
    with CheckpointManager(directory, max_to_keep=2) as manager:
        manager.save(1, params)
        manager.save(2, params)
        (directory / "2" / "meta").rename(directory / "2" / "gone")  # damaged
        restored = manager.restore(params_like=abstract_like(params), fallback=True)
        assert restored.step == 1 and len(restored.skipped) == 1
        moved = manager.quarantine(2)
        assert moved == str(directory / "damaged" / "2") and os.path.isdir(moved)
        assert manager.all_steps() == [1]
        for step in (2, 3):  # 2 is saved anew; 1 rotates out
            manager.save(step, params)
        assert manager.all_steps() == [2, 3]
        assert manager.quarantine(2) == str(directory / "damaged" / "2-1")
        with pytest.raises(FileNotFoundError, match="no checkpoint step 7"):
            manager.quarantine(7)
    with CheckpointManager(directory) as manager:
        assert manager.all_steps() == [3]


def test_expect_metadata_before_reading_arrays(saved, state, tmp_path):
    """restore(expect_metadata=): changed run settings come back in .changed; another
    model raises MetadataMismatchError before any array is read (here: even though the
    arrays are damaged, and with fallback=True: a mismatch is no reason to fall back)."""
    restored = _restore(saved, state, expect_metadata={"model": MODEL,
                                                       "run": {**RUN, "lr": 1e-3}})
    assert restored.changed == {"run": {"lr": (3e-3, 1e-3)}}
    assert restored._fields[-2:] == ("skipped", "changed") and restored.skipped == ()
    assert _restore(saved, state).changed == {}
    directory = _copy(saved, tmp_path)
    for path in _data_files(directory / "7"):
        path.unlink()
    with pytest.raises(MetadataMismatchError, match="another model .*hidden 48 saved vs 64"):
        _restore(directory, state, expect_metadata={"model": {**MODEL, "hidden": 64}},
                 fallback=True)
    with pytest.raises(TypeError, match="restore: expect_metadata: section 'model' must"):
        _restore(directory, state, expect_metadata={"model": 3})


# -- finite check ------------------------------------------------------------------------

def test_non_finite_values_are_not_written(state, tmp_path):
    params, opt_state = state
    directory = tmp_path / "ckpt"
    with CheckpointManager(directory) as manager:
        manager.save(1, params, opt_state)
        w, mu = np.asarray(params["w"]).copy(), np.asarray(opt_state["mu"]).copy()
        w[10, 3], mu[0, 0] = np.nan, -np.inf
        bad = {**params, "w": jax.device_put(w, params["w"].sharding)}
        with pytest.raises(NonFiniteError) as err:
            manager.save(2, bad, {**opt_state,
                                  "mu": jax.device_put(mu, opt_state["mu"].sharding)})
        e = err.value
        assert isinstance(e, ValueError) and e.step == 2
        assert e.paths == ("params/w", "opt_state/mu")
        assert str(e).startswith(f"checkpoint step 2 not saved to {directory}: NaN or inf in "
                                 "2 array(s): params/w, opt_state/mu. Nothing was written")
        assert manager.all_steps() == [1]
        assert sorted(p.name for p in directory.iterdir()) == [".sp_jax.lock", "1"]
        manager.save(2, bad, check_finite=False)  # on request
        assert manager.all_steps() == [1, 2]
    restored = restore_checkpoint(directory, params_like=abstract_like(params))
    assert np.isnan(np.asarray(restored.params["w"])[10, 3])


# -- one writer --------------------------------------------------------------------------

def test_one_writer_per_directory(state, tmp_path):
    params, _ = state
    directory = tmp_path / "ckpt"
    with CheckpointManager(directory) as writer:
        assert writer.stale_lock is None
        writer.save(1, params)
        holder = json.loads((directory / ".sp_jax.lock").read_text())
        assert holder["pid"] == os.getpid() and holder["argv"]
        with pytest.raises(CheckpointLockedError) as err:
            CheckpointManager(directory)
        e = err.value
        assert isinstance(e, RuntimeError) and e.directory == str(directory)
        assert e.holder == holder
        assert str(e).startswith(f"checkpoint directory {directory} is in use by pid "
                                 f"{os.getpid()} on host {holder['host']} (since "
                                 f"{holder['started']}, ")
        assert "one writer per directory" in str(e)
        with pytest.raises(CheckpointLockedError):
            save_checkpoint(directory, 2, params)
        # Readers take no lock.
        assert restore_checkpoint(directory, params_like=abstract_like(params)).step == 1
        with CheckpointManager(directory, lock=False) as reader:
            assert reader.all_steps() == [1]
    assert not (directory / ".sp_jax.lock").exists()  # released: removed
    with CheckpointManager(directory) as again:
        assert again.stale_lock is None and again.all_steps() == [1]


def test_reader_keeps_a_writers_unfinished_save(tmp_path):
    """lock=False deletes no temporary directory (a writer may be writing it)."""
    directory = tmp_path / "ckpt"
    tmp = directory / "5.orbax-checkpoint-tmp"
    tmp.mkdir(parents=True)
    with CheckpointManager(directory, lock=False):
        pass
    assert tmp.is_dir()
    with CheckpointManager(directory):  # a writer cleans up
        pass
    assert not tmp.exists()


_HOLDER = """
import sys, time
from sp_jax.checkpoint import CheckpointManager
manager = CheckpointManager(sys.argv[1])
print("LOCKED", flush=True)
time.sleep(600)
"""


def test_lock_of_a_killed_writer_is_taken_over(tmp_path):
    """Another process holds the lock: refused, naming its pid; killed (SIGKILL, so it
    cannot clean up), its lock file stays but the lock is free: taken over."""
    directory = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_HOLDER), str(directory)],
                            cwd=ROOT, env=script_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "LOCKED" in line, proc.stderr.read() if proc.poll() is not None else line
        with pytest.raises(CheckpointLockedError, match=f"in use by pid {proc.pid} on host "):
            CheckpointManager(directory)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    assert json.loads((directory / ".sp_jax.lock").read_text())["pid"] == proc.pid
    with pytest.warns(UserWarning, match=f"taking over the lock left by pid {proc.pid} "):
        manager = CheckpointManager(directory)
    with manager:
        assert manager.stale_lock["pid"] == proc.pid
        assert json.loads((directory / ".sp_jax.lock").read_text())["pid"] == os.getpid()


# -- exit --------------------------------------------------------------------------------

_UNCLOSED_ASYNC_SAVE = """
import sys
import jax.numpy as jnp
from sp_jax.checkpoint import CheckpointManager


def main():
    manager = CheckpointManager(sys.argv[1], async_save=True)
    manager.save(1, {"w": jnp.arange(4096.0).reshape(64, 64)}, metadata={"note": "exit"})
    print("RETURNING", flush=True)  # no close(): the save may still be in flight


main()  # ... and nothing refers to the manager any more
"""


def test_async_save_in_flight_at_exit_is_finished(tmp_path):
    directory = tmp_path / "ckpt"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_UNCLOSED_ASYNC_SAVE),
                           str(directory)], cwd=ROOT, env=script_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RETURNING" in proc.stdout
    assert (f"sp_jax.checkpoint: waited at exit for step 1 to be written to {directory}: "
            "committed") in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in directory.iterdir()) == ["1"]  # lock released too
    target = {"w": jax.ShapeDtypeStruct((64, 64), np.float32)}
    restored = restore_checkpoint(directory, params_like=target)
    np.testing.assert_array_equal(np.asarray(restored.params["w"]),
                                  np.arange(4096.0, dtype=np.float32).reshape(64, 64))
    assert restored.metadata == {"note": "exit"}
    assert time.monotonic() - start < 60

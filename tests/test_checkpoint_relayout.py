"""A checkpoint restored into layers stored in another form (sp_jax.checkpoint.relayout):
unrolled (``--mesh D,T``) into stacked ones (``--mesh S,D,C,T``: scanned, pipelined)
and back, between pipelines of other stage counts and repeats (``[L, ...]`` and ``[R, L
/ R, ...]`` stacks), the optimizer state and the FP8 amax histories with them, and the
optimizer's moments cast to another dtype (``--moments-dtype``) on resume; the values
compared with the saved ones leaf by leaf, layer by layer (a NumPy reshape of the saved
arrays), and a resumed run's losses with an uninterrupted one's."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import script_env, slow_except
from flax import nnx

from sp_jax import Fp8Recipe, ParallelConfig
from sp_jax.checkpoint import CheckpointManager, abstract_like
from sp_jax.checkpoint.metadata import flatten
from sp_jax.checkpoint.relayout import Source, plan, saved_as_target
from sp_jax.models import GPT, GPTConfig
from sp_jax.training import TrainStep, adamw

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("stage", "data", "context", "tensor")


def _shape(*dims):
    return jax.ShapeDtypeStruct(dims, jnp.float32)


def test_plan_maps_dense_and_expert_stacks_and_repeats_to_layers():
    """Scanned with 1 dense layer apart (``dense_blocks`` [1, ...], ``blocks`` [3, ...]),
    and a stack of pipeline repeats ``[2, 2, ...]``, against 4 unrolled layers."""
    unrolled = {"embed": _shape(8, 4),
                **{f"0/mu/blocks/{i}/attn/k": _shape(4, 4) for i in range(4)},
                "0/mu/blocks/0/mlp/k": _shape(4, 16),
                **{f"0/mu/blocks/{i}/moe/k": _shape(2, 4, 16) for i in (1, 2, 3)}}
    scanned = {"embed": _shape(8, 4), "0/mu/dense_blocks/attn/k": _shape(1, 4, 4),
               "0/mu/dense_blocks/mlp/k": _shape(1, 4, 16),
               "0/mu/blocks/attn/k": _shape(3, 4, 4), "0/mu/blocks/moe/k": _shape(3, 2, 4, 16)}
    into_unrolled = plan(scanned, unrolled)
    assert into_unrolled["embed"] == Source(("embed",))
    assert into_unrolled["0/mu/blocks/0/attn/k"] == Source(("0/mu/dense_blocks/attn/k",), 0, 1)
    assert into_unrolled["0/mu/blocks/3/attn/k"] == Source(("0/mu/blocks/attn/k",), 2, 1)
    assert into_unrolled["0/mu/blocks/2/moe/k"] == Source(("0/mu/blocks/moe/k",), 1, 1)
    into_scanned = plan(unrolled, scanned)
    assert into_scanned["0/mu/blocks/attn/k"] == Source(
        tuple(f"0/mu/blocks/{i}/attn/k" for i in (1, 2, 3)), None, 1)
    assert into_scanned["0/mu/dense_blocks/mlp/k"] == Source(("0/mu/blocks/0/mlp/k",), None, 1)
    repeats = {"blocks/k": _shape(2, 2, 4, 4)}
    layers = {f"blocks/{i}/k": _shape(4, 4) for i in range(4)}
    assert plan(repeats, layers)["blocks/3/k"] == Source(("blocks/k",), 3, 2)
    assert plan(layers, repeats)["blocks/k"].lead == 2
    # a stack of repeats against a plain stack, or other repeats: the same layers
    # reshaped (an expert dimension or a per-layer dimension equal to L / R included)
    plain = {"blocks/k": _shape(4, 2, 4, 16), "blocks/h": _shape(4, 3, 2)}
    circular = {"blocks/k": _shape(2, 2, 2, 4, 16), "blocks/h": _shape(2, 2, 3, 2)}
    assert plan(plain, circular) == {"blocks/k": Source(("blocks/k",), None, 2, 1),
                                     "blocks/h": Source(("blocks/h",), None, 2, 1)}
    assert plan(circular, plain)["blocks/k"] == Source(("blocks/k",), None, 1, 2)
    assert plan({"blocks/k": _shape(4, 2, 4)}, {"blocks/k": _shape(2, 4, 4)}) == {
        "blocks/k": Source(("blocks/k",), None, 2, 2)}  # R = 4 saved, R = 2 now (L = 8)
    assert plan({"blocks/k": _shape(4, 4, 4)}, {"blocks/k": _shape(2, 2, 2, 4)}) is None
    assert plan({"embed": _shape(4, 4)}, {"embed": _shape(2, 2, 4)}) is None  # no stack
    # a leaf read as it is keeps its saved shape for the caller's checks (another vocab)
    saved, target = {"embed": _shape(8, 4), **plain}, {"embed": _shape(9, 4), **circular}
    assert saved_as_target(plan(saved, target), saved, target)["embed"].shape == (8, 4)
    # another model: no plan (the caller's checks name the mismatch)
    assert plan({"blocks/k": _shape(3, 4, 4)}, layers) is None
    assert plan({**layers, "other": _shape(1)}, repeats) is None
    assert plan(layers, layers) is None


def _step(mesh: jax.sharding.Mesh, scan: bool, parallel: ParallelConfig = ParallelConfig(),
          moments=None, layers: int = 4, fp8: Fp8Recipe | None = None) -> TrainStep:
    cfg = GPTConfig(vocab_size=64, max_seq_len=16, num_layers=layers, num_heads=4,
                    hidden=16, scan_layers=scan, fp8=fp8)
    with jax.set_mesh(mesh):
        return TrainStep(GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)),
                         adamw(1e-3, mu_dtype=moments, nu_dtype=moments))


def _layers(tree, n: int = 4) -> dict[str, np.ndarray]:
    """``{"<layer>/<rest>": value}`` of every per-layer leaf of a model of ``n`` layers
    (unrolled, or stacked ``[n, ...]`` or ``[R, n / R, ...]``: the leading dimensions
    whose product is ``n``)."""
    out = {}
    for path, x in flatten(tree).items():
        head, _, rest = path.partition("blocks/")
        x = np.asarray(x)
        if not rest:
            out[path] = x
        elif rest.split("/")[0].isdigit():
            i, _, tail = rest.partition("/")
            out[f"{head}{i}/{tail}"] = x
        else:
            lead = next(k for k in range(1, x.ndim + 1) if np.prod(x.shape[:k]) == n)
            for i, layer in enumerate(x.reshape(n, *x.shape[lead:])):
                out[f"{head}{i}/{rest}"] = layer
    return out


@pytest.mark.parametrize("stages", [1, 2])
def test_unrolled_checkpoint_restores_into_stacked_layers_and_back(tmp_path, stages):
    """--mesh 2,4 saved, resumed on --mesh 1,2,1,4 / 2,1,1,4 (scanned; a pipeline) with
    bf16 moments, saved again and restored into the unrolled model: bitwise where no cast."""
    flat = jax.make_mesh((2, 4), ("data", "tensor"))
    saved = _step(flat, False)
    opt = jax.tree.map(lambda x: x + 0.25 if jnp.issubdtype(x.dtype, jnp.floating) else x,
                       saved.opt_state)  # moments that are not zeros
    with CheckpointManager(tmp_path / "a") as ckpt:
        ckpt.save(1, saved.params, opt)
    pipeline = ParallelConfig(pipeline_axis="stage", pipeline_microbatches=2) \
        if stages > 1 else ParallelConfig()
    staged = jax.make_mesh((stages, 2 // stages, 1, 4), STAGES)
    target = _step(staged, True, pipeline, moments=jnp.bfloat16)
    with jax.set_mesh(staged), CheckpointManager(tmp_path / "a") as ckpt:
        with pytest.raises(ValueError, match="dtype float32 in the checkpoint, bfloat16"):
            ckpt.restore(params_like=abstract_like(target.params),
                         opt_state_like=abstract_like(target.opt_state))
        restored = ckpt.restore(params_like=abstract_like(target.params),
                                opt_state_like=abstract_like(target.opt_state),
                                allow_dtype_cast=("opt_state",))
    assert _layers(restored.params).keys() == _layers(saved.params).keys()
    for key, value in _layers(saved.params).items():
        np.testing.assert_array_equal(_layers(restored.params)[key], value, err_msg=key)
    for key, value in _layers(opt).items():
        want = value.astype(jnp.bfloat16) if value.dtype == np.float32 else value
        np.testing.assert_array_equal(_layers(restored.opt_state)[key], want, err_msg=key)
    assert restored.cast and all(c.startswith("opt_state/") and c.endswith(
        "float32 -> bfloat16") for c in restored.cast)
    for got, like in zip(jax.tree.leaves(restored.params), jax.tree.leaves(target.params),
                         strict=True):
        assert got.sharding == like.sharding
    with CheckpointManager(tmp_path / "b") as ckpt:  # and back into the unrolled layers
        ckpt.save(1, restored.params, restored.opt_state)
    with jax.set_mesh(flat), CheckpointManager(tmp_path / "b") as ckpt:
        back = ckpt.restore(params_like=abstract_like(saved.params),
                            opt_state_like=abstract_like(saved.opt_state),
                            allow_dtype_cast=True)
    for got, want in zip(jax.tree.leaves(back.params), jax.tree.leaves(saved.params),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert jax.tree.structure(back.opt_state) == jax.tree.structure(saved.opt_state)


@pytest.mark.slow
def test_train_gpt_resumes_on_a_stage_mesh_with_other_moments(tmp_path):
    """The user's case: a --mesh 2,4 run resumed with --mesh 2,1,1,4 --moments-dtype bf16:
    no refusal, one line for the cast, the resume line names both meshes."""
    common = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--seq-len", "32",
              "--batch-size", "8", "--eval-every", "2", "--save-every", "2", "--no-progress",
              "--ckpt-dir", str(tmp_path / "ckpt"), "--data",
              str(ROOT / "sp_jax" / "data" / "*.py")]
    first = subprocess.run([*common, "--steps", "2", "--mesh", "2,4"], cwd=ROOT,
                           env=script_env(), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    resumed = subprocess.run([*common, "--steps", "3", "--mesh", "2,1,1,4", "--resume",
                              "--moments-dtype", "bf16"], cwd=ROOT, env=script_env(),
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    out = resumed.stdout
    assert "resume: the checkpoint's optimizer state cast to this run's dtypes (float32 -> " \
           "bfloat16;" in out and "another --moments-dtype than the saved run's" in out
    assert "resume: restored step 2 from" in out and "(saved on data=2 x tensor=4)" in out
    assert "scan_layers" not in out + resumed.stderr


def _marked(tree):
    """``tree`` with every floating leaf plus a distinct ramp: each layer's values (the FP8
    histories and the moments too, zeros at first) differ, so a wrong order shows."""
    def mark(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return x + (jnp.arange(x.size, dtype=jnp.float32) * 1e-3).reshape(x.shape).astype(
            x.dtype)
    return jax.tree.map(mark, tree)


_LAYOUTS = {  # name: (mesh shape, scanned, pipeline fields); 8 layers
    "unrolled": ((2, 4), False, None),
    "scanned": ((1, 2, 1, 4), True, None),
    "1f1b": ((2, 1, 1, 4), True, {}),
    "gpipe4": ((4, 1, 1, 2), True, {"pipeline_schedule": "gpipe", "pipeline_microbatches": 4}),
    "circular2": ((2, 1, 1, 4), True, {"pipeline_repeats": 2}),
    "circular4": ((2, 1, 1, 4), True, {"pipeline_repeats": 4}),
}


def _layout_step(name: str, fp8: Fp8Recipe | None) -> tuple[jax.sharding.Mesh, TrainStep]:
    shape, scan, pipe = _LAYOUTS[name]
    mesh = jax.make_mesh(shape, ("data", "tensor") if len(shape) == 2 else STAGES)
    parallel = ParallelConfig() if pipe is None else ParallelConfig(
        pipeline_axis="stage", **{"pipeline_microbatches": 2, **pipe})
    return mesh, _step(mesh, scan, parallel, layers=8, fp8=fp8)


@pytest.mark.parametrize("saved_as,resumed_as", slow_except(
    [("scanned", "circular2"), ("circular2", "circular4"), ("circular4", "gpipe4"),
     ("1f1b", "unrolled"), ("unrolled", "circular4"), ("circular2", "scanned")],
    ("circular2", "circular4")))
def test_pipeline_layouts_restore_into_each_other(tmp_path, saved_as, resumed_as):
    """Params (FP8 amax histories included) and AdamW moments saved from one layout of 8
    layers restore into another: ``[8, ...]`` stacks (scanned, 1f1b on 2 stages, gpipe
    on 4), ``[R, 8 / R, ...]`` ones (circular, R = 2 or 4) and unrolled layers; each
    layer equal to the saved one, bitwise, each leaf sharded as the target's."""
    fp8 = Fp8Recipe("delayed")
    mesh, saved = _layout_step(saved_as, fp8)
    params, opt = _marked(saved.params), _marked(saved.opt_state)
    assert any("fp8_history" in k for k in flatten(params))
    with CheckpointManager(tmp_path) as ckpt:
        ckpt.save(1, params, opt)
    mesh, target = _layout_step(resumed_as, fp8)
    with jax.set_mesh(mesh), CheckpointManager(tmp_path) as ckpt:
        restored = ckpt.restore(params_like=abstract_like(target.params),
                                opt_state_like=abstract_like(target.opt_state))
    for got, want in ((restored.params, params), (restored.opt_state, opt)):
        got, want = _layers(got, 8), _layers(want, 8)
        assert got.keys() == want.keys()
        for key, value in want.items():
            np.testing.assert_array_equal(got[key], value, err_msg=key)
    for got, like in zip(jax.tree.leaves((restored.params, restored.opt_state)),
                         jax.tree.leaves((target.params, target.opt_state)), strict=True):
        assert got.shape == like.shape and got.sharding == like.sharding


def _train(tmp_path: Path, name: str, *flags: str, ckpt: str) -> dict[int, float]:
    """examples/train_gpt.py (4 layers, checkpoints in ``tmp_path / ckpt``) with
    ``flags``; its losses by step, from its --log-json."""
    log = tmp_path / f"{name}.jsonl"
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--layers", "4",
         "--seq-len", "32", "--batch-size", "8", "--eval-every", "0", "--save-every", "2",
         "--warmup-steps", "1", "--no-progress", "--ckpt-dir", str(tmp_path / ckpt),
         "--log-json", str(log), "--data", str(ROOT / "sp_jax" / "data" / "*.py"), *flags],
        cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "scan_layers" not in run.stdout + run.stderr
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow
def test_train_gpt_resumes_a_pipeline_checkpoint_on_circular_stages(tmp_path):
    """A 1f1b run (--mesh 2,1,1,4: [4, ...] stacks) of 4 steps, its step-2 checkpoint
    resumed with --pipeline-repeats 2 ([2, 2, ...] stacks): steps 3-4 train to the losses
    of an uninterrupted --pipeline-repeats 2 run (fp32, the same micro-batches and
    learning-rate schedule: equal to rounding)."""
    circular = ("--mesh", "2,1,1,4", "--pipeline-repeats", "2")
    reference = _train(tmp_path, "reference", *circular, "--steps", "4", ckpt="ref")
    first = _train(tmp_path, "first", "--mesh", "2,1,1,4", "--steps", "4", ckpt="run")
    (tmp_path / "resume").mkdir()
    shutil.copytree(tmp_path / "run" / "2", tmp_path / "resume" / "2")
    resumed = _train(tmp_path, "resumed", *circular, "--steps", "4", "--resume",
                     ckpt="resume")
    assert sorted(reference) == sorted(first) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    print("reference", reference, "first", first, "resumed", resumed)
    for step in (1, 2, 3, 4):  # the same model and data on either pipeline
        assert first[step] == pytest.approx(reference[step], rel=1e-5, abs=0), step
    for step in (3, 4):
        assert resumed[step] == pytest.approx(reference[step], rel=1e-5, abs=0), step


@pytest.mark.slow
def test_train_gpt_resumes_an_fp8_circular_pipeline_checkpoint_unrolled(tmp_path):
    """The user's case: an FP8 (delayed scaling: per-layer amax histories) checkpoint of
    circular stages (--mesh 2,1,1,4 --pipeline-repeats 2) resumed on --mesh 2,4 (unrolled
    layers): no refusal, the resume line names both meshes, the loss still finite."""
    fp8 = ("--fp8", "delayed")
    _train(tmp_path, "first", "--mesh", "2,1,1,4", "--pipeline-repeats", "2", *fp8,
           "--steps", "2", ckpt="run")
    resumed = _train(tmp_path, "resumed", "--mesh", "2,4", *fp8, "--steps", "3",
                     "--resume", ckpt="run")
    assert sorted(resumed) == [3] and np.isfinite(resumed[3])

"""TrainStep(offload_optimizer=True, offload_params=True): the optimizer state and the fp32
master weights in pinned_host memory between steps (8 simulated CPU devices, which have
the pinned_host memory kind), against the same step without offload: bitwise (several
AdamW steps with a schedule and weight decay, data=2 x tensor=4, scanned and unrolled
blocks); with bf16 compute against the non-offloaded step on a bf16 copy of the weights;
checkpoints saved and restored into pinned_host; a Trainer resumed from them; pipeline
stages; examples/train_gpt.py's flags; the update layer by layer (equal up to rounding);
the refusal on a backend without host memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import sp_jax.mesh
from sp_jax import ParallelConfig
from sp_jax.checkpoint import abstract_like, restore_checkpoint, save_checkpoint
from sp_jax.models import GPT, GPTConfig
from sp_jax.training import TrainStep, lm_loss, offload

CFG = GPTConfig(vocab_size=64, max_seq_len=16, num_layers=3, num_heads=4, hidden=32,
                scan_layers=True)


def _tx() -> optax.GradientTransformation:
    return optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10),
                       weight_decay=0.1)


def _batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    tokens = np.random.default_rng(seed).integers(0, CFG.vocab_size, (n, 2, 4, 17))
    return [{"tokens": t[..., :-1].astype(np.int32), "labels": t[..., 1:].astype(np.int32)}
            for t in tokens]


def _train(mesh, cfg=CFG, steps: int = 3, loss_fn=lm_loss, tx=None, **offload_options):
    """(params, opt_state, metrics of each step) as NumPy, and the TrainStep."""
    with jax.set_mesh(mesh):
        step = TrainStep(GPT(cfg, rngs=nnx.Rngs(0)), tx or _tx(), loss_fn, **offload_options)
        metrics = [step(b, jax.random.key(i)) for i, b in enumerate(_batches(steps))]
    state = jax.tree.map(np.asarray, (step.params, step.opt_state))
    return state, [jax.tree.map(np.asarray, m) for m in metrics], step


def _kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _assert_same(got, want) -> None:
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                            jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_offload_needs_host_memory(monkeypatch, mesh_2x4):
    """Item 6: on a backend whose devices have no pinned_host memory kind the offload
    options are refused, naming the backend and the fix; CPUs have it."""
    assert sp_jax.mesh.host_memory_supported("cpu")
    with jax.set_mesh(mesh_2x4):
        step = TrainStep(GPT(CFG, rngs=nnx.Rngs(0)), _tx(), offload_optimizer=True)
    assert _kinds(step.opt_state) == {"pinned_host"} and _kinds(step.params) == {"device"}
    monkeypatch.setattr(sp_jax.mesh, "host_memory_supported", lambda platform: False)
    with jax.set_mesh(mesh_2x4):
        model = GPT(CFG, rngs=nnx.Rngs(0))
        for option in ("offload_optimizer", "offload_params"):
            with pytest.raises(ValueError, match=rf"TrainStep\({option}=True\): the 'cpu' "
                               r"backend has no 'pinned_host' memory kind to offload to; run "
                               r"on CPU, GPU or TPU, or turn the offload option off"):
                TrainStep(model, _tx(), **{option: True})


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("what", ["optimizer", "optimizer_params"])
def test_offload_is_bitwise_the_step_without(mesh_2x4, what, scan):
    """3 AdamW steps (warmup-cosine schedule, weight decay) on data=2 x tensor=4: the
    parameters, optimizer state and metrics bitwise those of the step without offload,
    and the offloaded trees stay in pinned_host between steps."""
    cfg = GPTConfig(**{**vars(CFG), "scan_layers": scan})
    options = {"offload_optimizer": True, "offload_params": what == "optimizer_params"}
    want, want_metrics, _ = _train(mesh_2x4, cfg)
    got, got_metrics, step = _train(mesh_2x4, cfg, **options)
    assert _kinds(step.opt_state) == {"pinned_host"}
    assert _kinds(step.params) == {"pinned_host" if options["offload_params"] else "device"}
    _assert_same(got, want)
    _assert_same(got_metrics, want_metrics)
    assert float(want_metrics[-1]["update_norm"]) > 0  # the schedule's lr is past 0
    # the model written back is on the device and evaluates like the step
    model = step.sync_model()
    assert _kinds(nnx.state(model, nnx.Param)) == {"device"}


@pytest.mark.slow
def test_offload_params_bf16_compute_is_the_step_on_a_bf16_copy(mesh_2x4):
    """bf16 compute, fp32 master weights on the host: the forward and backward run on the
    weights rounded to bf16; equal (bitwise) to the step without offload whose loss
    function rounds the weights to bf16 itself (the same dtype policy)."""
    cfg = GPTConfig(**{**vars(CFG), "dtype": jnp.bfloat16})

    def rounded_loss(model, batch, key):
        params = nnx.state(model, nnx.Param)
        nnx.update(model, offload.compute_copy(params, jnp.bfloat16))
        return lm_loss(model, batch, key)

    want, want_metrics, _ = _train(mesh_2x4, cfg, loss_fn=rounded_loss)
    got, got_metrics, step = _train(mesh_2x4, cfg, offload_optimizer=True,
                                    offload_params=True)
    assert {x.dtype for x in jax.tree.leaves(step.params)} == {np.dtype(np.float32)}
    _assert_same(got, want)
    _assert_same(got_metrics, want_metrics)


@pytest.mark.slow
def test_offloaded_checkpoint_restores_into_pinned_host(tmp_path, mesh_2x4):
    """An offloaded state saved and restored unchanged, into pinned_host again; the next
    step from it equals the next step of the run that saved it (and the non-offloaded
    run's)."""
    batches = _batches(3)
    with jax.set_mesh(mesh_2x4):
        step = TrainStep(GPT(CFG, rngs=nnx.Rngs(0)), _tx(), offload_optimizer=True,
                         offload_params=True)
        for i, b in enumerate(batches[:2]):
            step(b, jax.random.key(i))
        save_checkpoint(tmp_path, 2, step.params, step.opt_state)
        fresh = TrainStep(GPT(CFG, rngs=nnx.Rngs(1)), _tx(), offload_optimizer=True,
                          offload_params=True)
        restored = restore_checkpoint(tmp_path, params_like=abstract_like(fresh.params),
                                      opt_state_like=abstract_like(fresh.opt_state))
        assert _kinds(restored.params) == _kinds(restored.opt_state) == {"pinned_host"}
        _assert_same(jax.tree.map(np.asarray, (restored.params, restored.opt_state)),
                     jax.tree.map(np.asarray, (step.params, step.opt_state)))
        fresh.params, fresh.opt_state = restored.params, restored.opt_state
        got = fresh(batches[2], jax.random.key(2))
        want = step(batches[2], jax.random.key(2))
    _assert_same(jax.tree.map(np.asarray, (fresh.params, fresh.opt_state, got)),
                 jax.tree.map(np.asarray, (step.params, step.opt_state, want)))
    reference, reference_metrics, _ = _train(mesh_2x4)
    _assert_same(jax.tree.map(np.asarray, (fresh.params, fresh.opt_state)), reference)
    _assert_same(jax.tree.map(np.asarray, got), reference_metrics[-1])


@pytest.mark.slow
def test_trainer_resumes_an_offloaded_run(tmp_path, mesh_2x4):
    """Trainer with an offloaded TrainStep: 2 steps saved, resumed by a new offloaded
    step to 4; its losses of steps 3-4 are the uninterrupted non-offloaded run's."""
    from sp_jax.data import ByteCorpus
    from sp_jax.training import Trainer, TrainerConfig

    corpus = ByteCorpus.from_bytes(
        np.random.default_rng(0).integers(0, 256, 8192).astype(np.uint8), seq_len=16)
    cfg = GPTConfig(**{**vars(CFG), "vocab_size": 256})
    base = dict(batch_size=4, micro_batches=2, eval_every=0, progress=False)

    def run(steps, directory, **options):
        with jax.set_mesh(mesh_2x4):
            step = TrainStep(GPT(cfg, rngs=nnx.Rngs(0)), _tx(), **options)
            config = TrainerConfig(steps=steps, save_every=2, ckpt_dir=str(directory),
                                   resume=steps > 2 and bool(options), **base)
            return Trainer(step, corpus, config).run()

    full = run(4, tmp_path / "full")
    run(2, tmp_path / "offloaded", offload_optimizer=True, offload_params=True)
    resumed = run(4, tmp_path / "offloaded", offload_optimizer=True, offload_params=True)
    assert resumed.start_step == 2
    assert [resumed.losses[s] for s in (3, 4)] == [full.losses[s] for s in (3, 4)]


@pytest.mark.slow
def test_train_gpt_offload_flags(tmp_path):
    """examples/train_gpt.py --offload-optimizer --offload-params: the same losses as the
    run without them (3 steps, data=2 x tensor=4)."""
    import json
    import subprocess
    import sys
    import sysconfig
    from pathlib import Path

    from _util import script_env

    root = Path(__file__).resolve().parents[1]
    data = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")
    base = [sys.executable, str(root / "examples" / "train_gpt.py"), "--preset", "gpt",
            "--seq-len", "32", "--hidden", "32", "--heads", "4", "--layers", "2",
            "--batch-size", "8", "--micro-batches", "2", "--mesh", "2,4", "--data", data,
            "--steps", "3", "--eval-every", "3", "--no-progress"]
    losses = []
    for name, extra in (("plain", []), ("offload", ["--offload-optimizer",
                                                   "--offload-params"])):
        log = tmp_path / f"{name}.jsonl"
        done = subprocess.run([*base, *extra, "--log-json", str(log)], cwd=root,
                              env=script_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        losses.append({r["step"]: r["loss"] for r in records if "loss" in r})
    assert sorted(losses[1]) == [1, 2, 3] and losses[1] == losses[0]


@pytest.mark.slow
def test_offload_in_pipeline_stages_is_bitwise():
    """A pipelined GPT (2 stages x data 2 x tensor 2, 1F1B over 2 micro-batches): the
    offloaded step's state and metrics bitwise those of the step without offload."""
    mesh = jax.make_mesh((2, 2, 1, 2), ("stage", "data", "context", "tensor"),
                         devices=jax.devices()[:8])
    parallel = ParallelConfig(pipeline_axis="stage", pipeline_microbatches=2)
    cfg = GPTConfig(**{**vars(CFG), "num_layers": 4})
    out = []
    for options in ({}, {"offload_optimizer": True, "offload_params": True}):
        with jax.set_mesh(mesh):
            step = TrainStep(GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)), _tx(), **options)
            metrics = [step(b, jax.random.key(i)) for i, b in enumerate(_batches(3))]
        out.append(jax.tree.map(np.asarray, (step.params, step.opt_state, metrics)))
    assert _kinds(step.opt_state) == _kinds(step.params) == {"pinned_host"}
    _assert_same(out[1], out[0])

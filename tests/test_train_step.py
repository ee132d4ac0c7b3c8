"""TrainStep's evaluation and memory helpers (the training itself: tests/test_gpt.py)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from _util import copy_weights
from conftest import make_mesh
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from sp_jax.models import GPT, GPTConfig
from sp_jax.training import TrainStep, device_bytes

CFG = GPTConfig(vocab_size=64, max_seq_len=16, num_layers=1, num_heads=4, hidden=32,
                dropout=0.5)


def _batches(n: int, batch: int = 4, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(0, CFG.vocab_size, size=(batch, CFG.max_seq_len + 1))
        out.append({"tokens": tokens[:, :-1].astype(np.int32),
                    "labels": tokens[:, 1:].astype(np.int32)})
    return out


def test_evaluate_is_the_token_mean_in_eval_mode(mesh_2x4):
    batches = _batches(3)
    batches[1]["labels"][:, ::2] = -100  # fewer target tokens: weighted by count
    with jax.set_mesh(mesh_2x4):
        model = GPT(CFG, parallel=sp_jax.ParallelConfig(), rngs=nnx.Rngs(0))
        model.train()  # dropout on: evaluate must switch it off
        step = TrainStep(model, optax.sgd(0.1))
        place = NamedSharding(mesh_2x4, sp_jax.Layout().tokens)
        got = step.evaluate([jax.device_put(b, place) for b in batches])
    # Independent reference: the same weights unsharded (one device), in eval mode.
    step.sync_model()
    total = count = 0.0
    with jax.set_mesh(make_mesh(1, 1)):
        reference = copy_weights(GPT(CFG, parallel=sp_jax.ParallelConfig(),
                                     rngs=nnx.Rngs(1)), model)
        reference.eval()
        loss = nnx.jit(lambda m, tokens, labels: m.loss(tokens, labels))
        for b in batches:
            n = np.sum(b["labels"] != -100)
            total += float(loss(reference, b["tokens"], b["labels"])) * n
            count += n
    assert got == pytest.approx(total / count, rel=1e-5)
    assert np.isnan(step.evaluate([]))


def test_device_bytes_and_temp_bytes(mesh_2x4):
    with jax.set_mesh(mesh_2x4):
        sharded = jax.device_put(np.zeros((8, 16), np.float32),
                                 NamedSharding(mesh_2x4, P("data", "tensor")))
        replicated = jax.device_put(np.zeros((4,), np.float32), NamedSharding(mesh_2x4, P()))
        assert device_bytes({"a": sharded, "b": replicated, "c": None}) == 8 * 16 * 4 // 8 + 16
        step = TrainStep(GPT(CFG, parallel=sp_jax.ParallelConfig(), rngs=nnx.Rngs(0)),
                         optax.sgd(0.1))
        place = NamedSharding(mesh_2x4, P(None, "data", None))
        batch = jax.device_put(jax.tree.map(lambda x: x[None], _batches(1)[0]), place)
        temp = step.temp_bytes(batch, jax.random.key(0))
    assert isinstance(temp, int) and temp > 0


def test_a_non_finite_step_changes_nothing(mesh_2x4):
    """SGD with lr 1e9: the first step makes huge but finite weights, the second a NaN
    loss; that step reports finite=False and leaves parameters and optimizer state exactly
    as they were, so nothing non-finite can reach a checkpoint."""
    cfg = GPTConfig(vocab_size=64, max_seq_len=16, num_layers=1, num_heads=4, hidden=32)
    tokens = np.random.default_rng(0).integers(0, 64, (1, 8, 17)).astype(np.int32)
    with jax.set_mesh(mesh_2x4):
        step = TrainStep(GPT(cfg, rngs=nnx.Rngs(0)), optax.chain(
            optax.scale_by_adam(), optax.scale(-1e9)))
        batch = jax.device_put({"tokens": tokens[..., :-1], "labels": tokens[..., 1:]},
                               NamedSharding(mesh_2x4, P(None, "data", None)))
        assert bool(step(batch, jax.random.key(0))["finite"])
        before = jax.tree.map(np.asarray, (step.params, step.opt_state))
        metrics = step(batch, jax.random.key(1))
        after = jax.tree.map(np.asarray, (step.params, step.opt_state))
    assert not bool(metrics["finite"]) and not np.isfinite(float(metrics["loss"]))
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True):
        np.testing.assert_array_equal(a, b)
        assert np.isfinite(a).all()


@pytest.mark.slow
def test_batches_not_on_the_mesh_are_placed(mesh_2x4):
    """Host arrays and arrays on one device are laid out on the step's mesh (token ids
    like the data pipeline's batches): the losses equal those of batches placed by hand;
    a batch that does not split over the data axes is a ValueError naming the fix."""
    cfg = GPTConfig(vocab_size=64, max_seq_len=16, num_layers=1, num_heads=4, hidden=32)
    host = jax.tree.map(lambda x: x.reshape(2, 2, -1), _batches(1)[0])
    losses = {}
    for how in ("placed", "host", "one device"):
        with jax.set_mesh(mesh_2x4):
            step = TrainStep(GPT(cfg, rngs=nnx.Rngs(0)), optax.sgd(0.1))
            batch = {"placed": lambda: jax.device_put(host, NamedSharding(
                         mesh_2x4, sp_jax.Layout().micro_batched_tokens)),
                     "host": lambda: host,
                     "one device": lambda: jax.device_put(host, jax.devices()[0])}[how]()
            losses[how] = [float(step(batch, jax.random.key(i))["loss"]) for i in range(2)]
            held_out = step.evaluate([_batches(1, seed=1)[0]])
            assert np.isfinite(held_out)
            with pytest.raises(ValueError, match=r"batch dimension 1 divisible by the "
                                                 r"data-parallel size 2"):
                step(jax.tree.map(lambda x: x[:, :1], host), jax.random.key(0))
    assert losses["host"] == losses["placed"] == losses["one device"]

"""Training on packed documents: the Trainer saves the input pipeline's position with each
checkpoint, and a run resumed on another mesh trains on exactly the batches (and to the
losses) of the uninterrupted one; the metrics go to TensorBoard event files that
TensorBoard's reader opens. (The example training on a tokenizer.json it made itself is
the README's block, run verbatim by tests/test_doc_snippets.py.)"""

import json
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import sp_jax
from sp_jax.data import ByteTokenizer, PackedText
from sp_jax.models import GPT, GPTConfig
from sp_jax.training import Trainer, TrainerConfig, TrainStep

pytestmark = pytest.mark.slow  # the whole file: make test only, not make test-fast
SEQ = 32
CFG = GPTConfig(vocab_size=257, max_seq_len=SEQ, num_layers=1, num_heads=4, hidden=32,
                positions="rotary", attention_block_q=8, attention_block_k=8)


def _corpus(path):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    with open(path, "w") as f:
        for i in range(200):
            text = " ".join(rng.choice(words, int(rng.integers(2, 20))))
            f.write(json.dumps({"text": f"{i}: {text}."}) + "\n")
    return str(path)


def _run(tmp_path, corpus, mesh_shape, steps, **kw):
    mesh = jax.make_mesh(mesh_shape, ("data", "tensor"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:8])
    data = PackedText.from_files(corpus, tokenizer=ByteTokenizer(), seq_len=SEQ)
    config = TrainerConfig(steps=steps, batch_size=8, micro_batches=2, eval_every=3,
                           eval_batches=1, save_every=3, ckpt_dir=str(tmp_path / "ckpt"),
                           progress=False, **kw)
    with jax.set_mesh(mesh):
        step = TrainStep(GPT(CFG, parallel=sp_jax.ParallelConfig(), rngs=nnx.Rngs(0)),
                         optax.adamw(1e-2))
        return Trainer(step, data, config, mesh=mesh, say=lambda _: None,
                       flops_per_token=CFG.flops_per_token(SEQ)).run()


def test_packed_run_resumes_on_another_mesh_with_the_uninterrupted_batches(tmp_path):
    corpus = _corpus(tmp_path / "docs.jsonl")
    full = _run(tmp_path / "a", corpus, (2, 4), 6, tensorboard=str(tmp_path / "a" / "tb"))
    shutil.rmtree(tmp_path / "a" / "ckpt" / "6")  # as if stopped after the save of step 3
    resumed = _run(tmp_path / "a", corpus, (4, 2), 6, resume=True,
                   tensorboard=str(tmp_path / "a" / "tb"))
    assert resumed.start_step == 3
    for i in (4, 5, 6):  # the same batches: the same losses up to float rounding
        np.testing.assert_allclose(resumed.losses[i], full.losses[i], rtol=2e-5)
    assert full.losses[6] < full.losses[1]
    event_accumulator = pytest.importorskip(
        "tensorboard.backend.event_processing.event_accumulator")
    events = event_accumulator.EventAccumulator(str(tmp_path / "a" / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "eval/loss", "train/tokens_per_s", "train/grad_norm"} <= tags
    losses = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]  # the interrupted run's 4..6 purged
    np.testing.assert_allclose(losses[5], resumed.losses[5], rtol=1e-6)

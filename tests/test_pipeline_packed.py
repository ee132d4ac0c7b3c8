"""Packed documents in pipeline stages: a pipelined TrainStep on batches ``{"tokens",
"labels", "segment_ids", "positions"}`` ``[micro_batches, batch, seq]`` (each micro-batch's
ids and positions travel with it through the stages) trains like the unpipelined model on
the same packed rows (3 AdamW steps, fp32, rtol = atol = 1e-5), with GPipe, circular and
1F1B schedules and ring or Ulysses attention inside the stages."""


import os
import sysconfig
import time

import chex
import jax
import numpy as np
import optax
import pytest
from _util import launch, read_jsonl, slow_except, train_gpt, wait_all
from conftest import make_mesh
from flax import nnx
from test_pipeline import _mesh

import sp_jax
from sp_jax.models import GPT, GPTConfig
from sp_jax.training import TrainStep

B, S, STEPS = 8, 16, 3
BASE = dict(vocab_size=61, max_seq_len=S, num_layers=4, num_heads=4, hidden=16,
            mlp_hidden=32, scan_layers=True)


def packed_rows(rows, seed):
    """``rows`` packed rows of ``S`` tokens: documents of 2..8 tokens (ids from 1, positions
    from 0 in each), some rows ending in padding (segment id 0); labels the next token of
    the row (``document_labels`` drops those across documents)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, BASE["vocab_size"], size=(rows, S + 1)).astype(np.int32)
    segment_ids = np.zeros((rows, S), np.int32)
    positions = np.zeros((rows, S), np.int32)
    for row in range(rows):
        at, doc = 0, 1
        while at < S and not (at > S // 2 and rng.random() < 0.3):
            n = min(int(rng.integers(2, 9)), S - at)
            segment_ids[row, at:at + n] = doc
            positions[row, at:at + n] = np.arange(n)
            at, doc = at + n, doc + 1
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "segment_ids": segment_ids,
            "positions": positions}


def _batches(micro, steps=STEPS):
    return [{k: v.reshape(micro, B // micro, S) for k, v in packed_rows(B, seed).items()}
            for seed in range(steps)]


CASES = {  # id: (mesh, schedule, repeats, micro-batches, model options, parallel options)
    "2x2x1x2_1f1b_r1_m4_learned": ((2, 2, 1, 2), "1f1b", 1, 4, {}, {}),
    "2x1x2x2_ring_1f1b_r2_m4_rotary": ((2, 1, 2, 2), "1f1b", 2, 4, {"positions": "rotary"},
                                       {"context_parallel": "ring"}),
    "2x1x2x2_ring_gpipe_r1_m4_learned": ((2, 1, 2, 2), "gpipe", 1, 4, {},
                                         {"context_parallel": "ring"}),
    "2x1x2x2_ulysses_gpipe_r2_m4_rotary": ((2, 1, 2, 2), "gpipe", 2, 4,
                                           {"positions": "rotary"},
                                           {"context_parallel": "ulysses"}),
    "2x2x2x1_ulysses_1f1b_r1_m2_learned_fsdp": ((2, 2, 2, 1), "1f1b", 1, 2, {},
                                                {"context_parallel": "ulysses",
                                                 "fsdp": True}),
}

_REFERENCES: dict = {}


@pytest.mark.parametrize("case", slow_except(CASES, "2x2x1x2_1f1b_r1_m4_learned"))
def test_pipeline_trains_packed_rows_like_unsharded(case):
    shape, kind, repeats, micro, model_kw, parallel_kw = CASES[case]
    cfg = GPTConfig(**{**BASE, **model_kw})
    parallel = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=micro,
                                     pipeline_schedule=kind, pipeline_repeats=repeats,
                                     **parallel_kw)
    batches = _batches(micro)
    init, losses, params, _ = train_gpt(cfg, parallel, _mesh(shape), batches)
    init, params = _layer_order(init), _layer_order(params)
    key = (cfg, micro)
    if key not in _REFERENCES:
        _REFERENCES[key] = (init, *train_gpt(cfg, sp_jax.ParallelConfig(),
                                             make_mesh(1, 1), batches, init=init)[1:3])
    start, want_losses, want_params = _REFERENCES[key]
    chex.assert_trees_all_equal(start, init)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(params, want_params, rtol=1e-5, atol=1e-5)
    # the packing matters: the same rows unpacked give another loss
    plain = [{k: b[k] for k in ("tokens", "labels")} for b in batches[:1]]
    other = train_gpt(cfg, sp_jax.ParallelConfig(), make_mesh(1, 1), plain, init=init)[1]
    assert abs(other[0] - losses[0]) > 1e-3


def _layer_order(values):
    """Host parameter values with the stacked blocks as ``[L, ...]`` (a circular pipeline
    stores them ``[R, L / R, ...]``, in layer order)."""
    layers = BASE["num_layers"]
    return {**values, "blocks": jax.tree.map(
        lambda x: x.reshape(layers, *x.shape[2:]) if x.shape[:1] != (layers,) else x,
        values["blocks"])}


def test_pipelined_step_names_a_bad_batch():
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=2)
    with jax.set_mesh(_mesh((2, 1, 1, 1))):
        model = GPT(GPTConfig(**BASE), parallel=par, rngs=nnx.Rngs(0))
        batch = _batches(2, steps=1)[0]
        with pytest.raises(ValueError, match=r"takes batches \{'tokens', 'labels'\} .*"
                                             r"got \['labels', 'mask', 'tokens'\]"):
            TrainStep(model, optax.sgd(0.1))({"tokens": batch["tokens"], "labels":
                                              batch["labels"], "mask": batch["labels"]},
                                             jax.random.key(0))
        step = TrainStep(model, optax.sgd(0.1))
        with pytest.raises(ValueError, match=r"segment_ids must be integers of the tokens' "
                                             r"shape \(2, 4, 16\)"):
            step({**batch, "segment_ids": batch["segment_ids"][:, :, :8]},
                 jax.random.key(0))


FLAGS = ["--seq-len", "32", "--hidden", "32", "--heads", "4", "--layers", "2",
         "--batch-size", "8", "--data", os.path.join(sysconfig.get_paths()["stdlib"], "json",
                                                     "*.py"),
         "--tokenizer", "bytes", "--steps", "3", "--eval-every", "3", "--no-progress"]


@pytest.mark.slow
def test_example_trains_packed_rows_in_stages(tmp_path):
    """``examples/train_gpt.py --data ... --tokenizer bytes --mesh 2,1,1,4`` (2 stages x
    tensor 4, 1F1B, 4 micro-batches of packed rows) logs the losses of the same run on a
    data 2 x tensor 4 mesh without stages."""
    runs = {"stages": ["--mesh", "2,1,1,4", "--microbatches", "4"],
            "flat": ["--mesh", "2,4", "--micro-batches", "4"]}
    procs = {name: launch([*FLAGS, *flags, "--log-json", str(tmp_path / f"{name}.jsonl")],
                          tmp_path / f"{name}.out") for name, flags in runs.items()}
    codes = wait_all(procs, deadline=time.monotonic() + 400)
    outputs = {name: (tmp_path / f"{name}.out").read_text(errors="replace") for name in runs}
    assert set(codes.values()) == {0}, (codes, {k: v[-3000:] for k, v in outputs.items()})
    assert "1f1b pipeline, 4 micro-batches" in outputs["stages"]
    assert "first-fit packing" in outputs["stages"]
    logs = {name: read_jsonl(tmp_path / f"{name}.jsonl") for name in runs}
    got, want = ([(r["step"], k, r[k]) for r in logs[name]
                  for k in ("loss", "grad_norm", "eval_loss") if k in r]
                 for name in ("stages", "flat"))
    assert len(want) == 3 * 2 + 2, logs["flat"]  # 3 steps' loss and norm, 2 evaluations
    assert [g[:2] for g in got] == [w[:2] for w in want]
    np.testing.assert_allclose([g[2] for g in got], [w[2] for w in want], rtol=1e-5)

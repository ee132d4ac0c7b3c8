"""Logits and hidden states of a pipelined GPT: ``model(tokens)``, ``hidden_states`` and
``padded_logits`` on a stage mesh (a GPipe forward through the stages, micro-batched)
equal the unpipelined model's with the same parameters, in the same layouts, with packed
rows, ring or Ulysses attention, circular stages, dropout and mixture-of-experts layers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import param_values, slow_except
from flax import nnx
from test_pipeline import _mesh
from test_pipeline_packed import packed_rows

import sp_jax
from sp_jax.models import GPT, GPTConfig

B, S = 8, 16
BASE = dict(vocab_size=61, max_seq_len=S, num_layers=4, num_heads=4, hidden=16,
            mlp_hidden=32, scan_layers=True)

CASES = {  # id: (mesh, schedule, repeats, micro-batches, packed, model / parallel options)
    "2x2x1x2_gpipe_r1_m2": ((2, 2, 1, 2), "gpipe", 1, 2, False, {}, {}),
    "2x2x1x2_1f1b_r2_m2_packed": ((2, 2, 1, 2), "1f1b", 2, 2, True, {}, {}),
    "4x1x1x2_gpipe_r1_m4_dropout_untied": ((4, 1, 1, 2), "gpipe", 1, 4, False,
                                           {"dropout": 0.1, "attention_dropout": 0.1,
                                            "tie_embeddings": False}, {}),
    "2x1x2x2_ring_1f1b_r2_m2_packed_rotary": ((2, 1, 2, 2), "1f1b", 2, 2, True,
                                              {"positions": "rotary"},
                                              {"context_parallel": "ring"}),
    "2x2x2x1_ulysses_gpipe_r1_m4_packed_fsdp": ((2, 2, 2, 1), "gpipe", 1, 4, True, {},
                                                {"context_parallel": "ulysses",
                                                 "fsdp": True}),
    "2x1x1x2_gpipe_r1_m2_experts": ((2, 1, 1, 2), "gpipe", 1, 2, False,
                                    {"num_experts": 4, "experts_per_token": 2,
                                     "moe_mlp_hidden": 16}, {}),
    # mixture-of-experts layers: the stages' router statistics in a forward without labels
    "2x2x1x2_1f1b_r1_m2_packed_experts": ((2, 2, 1, 2), "1f1b", 1, 2, True,
                                          {"num_experts": 4, "moe_mlp_hidden": 16}, {}),
}


@nnx.jit
def _outputs(model, tokens, documents, key):
    """``model(tokens)``, ``hidden_states`` and ``padded_logits``, each call drawing its
    dropout from ``key``."""
    return tuple(call(tokens, **documents, rngs=nnx.Rngs(dropout=key)) for call in (
        model, model.hidden_states, model.padded_logits))


@pytest.mark.parametrize("case", slow_except(CASES, "2x2x1x2_1f1b_r1_m2_packed_experts"))
def test_pipelined_logits_and_hidden_states_equal_unpipelined(case):
    shape, kind, repeats, micro, packed, model_kw, parallel_kw = CASES[case]
    cfg = GPTConfig(**{**BASE, **model_kw})
    rows = packed_rows(B, seed=7)
    documents = {k: rows[k] for k in ("segment_ids", "positions")} if packed else {}
    mesh = _mesh(shape)
    flat = sp_jax.ParallelConfig(**parallel_kw)
    parallel = flat.replace(pipeline_axis="stage", pipeline_microbatches=micro,
                            pipeline_schedule=kind, pipeline_repeats=repeats)
    got, want = {}, {}
    with jax.set_mesh(mesh):
        for par, out in ((parallel, got), (flat, want)):
            model = GPT(cfg, parallel=par, rngs=nnx.Rngs(0))
            out["params"] = jax.tree.map(  # the stacked blocks as [L, ...] either way
                lambda x: x.reshape(cfg.num_layers, *x.shape[repeats:]) if repeats > 1
                and x.shape[0] == repeats else x, param_values(model))
            out["outputs"] = _outputs(model, rows["tokens"], documents, jax.random.key(3))
        plain = _outputs(model, rows["tokens"], {}, jax.random.key(3))[1]
    # GPT's initial values depend on the config and seed, not on the layout
    jax.tree.map(np.testing.assert_array_equal, got["params"], want["params"])
    for g, w in zip(got["outputs"], want["outputs"], strict=True):
        assert g.shape == w.shape
        assert g.sharding.spec == w.sharding.spec, (g.sharding.spec, w.sharding.spec)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    if packed:  # the documents matter
        assert np.abs(np.asarray(plain) - np.asarray(want["outputs"][1])).max() > 1e-3


def test_a_pipelined_model_runs_outside_jit():
    """``GPT.loss`` and ``model(tokens)`` of a pipelined model called eagerly (no jit
    around them) equal the unpipelined model's: the pipeline runs its ``shard_map``
    under a jit of its own (eagerly, one manual over only the stage and data axes
    refused the outputs sharded over the tensor axis)."""
    cfg = GPTConfig(**{**BASE, "num_layers": 2})
    tokens = np.random.default_rng(0).integers(0, BASE["vocab_size"], (4, S)).astype(np.int32)
    mesh = _mesh((2, 1, 1, 2))
    with jax.set_mesh(mesh):
        flat = GPT(cfg, rngs=nnx.Rngs(0))
        piped = GPT(cfg, parallel=sp_jax.ParallelConfig(pipeline_axis="stage",
                                                        pipeline_microbatches=2),
                    rngs=nnx.Rngs(0))
        assert param_values(piped).keys() == param_values(flat).keys()
        np.testing.assert_allclose(piped.loss(tokens), flat.loss(tokens), rtol=1e-5)
        np.testing.assert_allclose(piped(tokens), flat(tokens), atol=1e-5)


def test_a_pipelined_model_evaluates_in_bf16():
    """bf16 compute: the last stage's logits and hidden states reach every stage as they
    are (a bf16 ``psum`` there aborted XLA:CPU's compiler, AllReducePromotion's
    "Invalid binary instruction opcode copy"; now a sum of their bits), equal to the
    unpipelined bf16 model's up to bf16 rounding in another order."""
    cfg = GPTConfig(**{**BASE, "num_layers": 2, "dtype": jnp.bfloat16})
    tokens = np.random.default_rng(0).integers(0, BASE["vocab_size"], (4, S)).astype(np.int32)
    with jax.set_mesh(_mesh((2, 1, 1, 2))):
        flat = GPT(cfg, rngs=nnx.Rngs(0))
        piped = GPT(cfg, parallel=sp_jax.ParallelConfig(pipeline_axis="stage",
                                                        pipeline_microbatches=2),
                    rngs=nnx.Rngs(0))
        for model in (flat, piped):
            model.eval()
        got = _outputs(piped, tokens, {}, jax.random.key(3))[:2]
        want = _outputs(flat, tokens, {}, jax.random.key(3))[:2]
    for g, w in zip(got, want, strict=True):
        assert g.dtype == jnp.bfloat16
        # a bf16 quantum or two of values up to ~4
        np.testing.assert_allclose(np.float32(g), np.float32(w), rtol=2e-2, atol=5e-2)


@pytest.mark.slow
def test_circular_stages_take_a_batch_of_any_rows():
    """With pipeline_repeats = 2 a batch that does not split into the micro-batches runs
    as one, filled with an empty micro-batch for the circular schedule (which needs a
    multiple of the stages): ``GPT.loss`` and the logits still equal the unpipelined
    model's."""
    tokens = np.random.default_rng(1).integers(0, BASE["vocab_size"], (3, S)).astype(np.int32)
    mesh = _mesh((2, 1, 1, 2))
    with jax.set_mesh(mesh):
        flat = GPT(GPTConfig(**BASE), rngs=nnx.Rngs(0))
        piped = GPT(GPTConfig(**BASE), parallel=sp_jax.ParallelConfig(
            pipeline_axis="stage", pipeline_microbatches=2, pipeline_repeats=2),
            rngs=nnx.Rngs(0))
        np.testing.assert_allclose(piped.loss(tokens), flat.loss(tokens), rtol=1e-5)
        np.testing.assert_allclose(piped(tokens), flat(tokens), atol=1e-5)

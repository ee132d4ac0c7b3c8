"""Generation from a pipelined model (its blocks re-laid out off the stage axis,
:func:`sp_jax.models.decode.unpipelined`) and with the KV cache split over a context axis
(ring and Ulysses prefill, each decode step's attention merged across the context shards
by log-sum-exp): the greedy tokens of ragged prompts equal the same model's (same
parameters) generation on one device, and, for the golden fixtures, transformers'."""

import jax
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx

import sp_jax
from sp_jax.models import GPT, GPTConfig, generate
from sp_jax.models.decode import unpipelined

PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [12, 2], [70, 33, 8, 19]]  # ragged rows


def _host(model) -> dict:
    """The model's parameters as NumPy arrays, the stacked blocks ``[L, ...]`` (a
    circular pipeline stores them ``[R, L / R, ...]`` in layer order)."""
    values = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    layers = model.config.num_layers
    values["blocks"] = jax.tree.map(lambda x: x.reshape(layers, *x.shape[-(x.ndim - 2):])
                                    if x.shape[0] != layers else x, values["blocks"])
    return values


def _one_device_tokens(cfg: GPTConfig, values: dict, max_new_tokens: int) -> np.ndarray:
    """Greedy tokens of a GPT with ``values`` as parameters on one device (built from
    another seed, then overwritten)."""
    with jax.set_mesh(make_mesh(1, 1)):
        ref = GPT(cfg, rngs=nnx.Rngs(1))
        params = nnx.state(ref, nnx.Param)
        nnx.replace_by_pure_dict(params, jax.tree.map(jax.numpy.asarray, values))
        nnx.update(ref, params)
        return generate(ref, PROMPTS, max_new_tokens=max_new_tokens).tokens


# -- a pipelined model ------------------------------------------------------------------


@pytest.mark.parametrize("schedule, repeats", [
    ("gpipe", 1), pytest.param("1f1b", 2, marks=pytest.mark.slow)],
    ids=lambda v: v if isinstance(v, str) else f"r{v}")
def test_pipelined_model_generates_the_unpipelined_tokens(schedule, repeats):
    """``generate`` on a model with ``pipeline_axis`` (2 stages x 2 data x 2 tensor, its
    blocks ``[L, ...]`` or, with 2 repeats, ``[2, L / 2, ...]`` over the stages) gives
    the tokens of the same parameters unpipelined on one device; the model keeps its
    pipeline layout."""
    cfg = GPTConfig.llama("llama-tiny", vocab_size=97, num_layers=4, scan_layers=True)
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=4,
                                pipeline_schedule=schedule, pipeline_repeats=repeats)
    mesh = jax.make_mesh((2, 2, 1, 2), ("stage", "data", "context", "tensor"),
                         devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
        model = GPT(cfg, parallel=par, rngs=nnx.Rngs(0))
        got = generate(model, PROMPTS, max_new_tokens=8).tokens
        flat = unpipelined(model)
        assert flat.parallel.pipeline_axis is None
        kernel = flat.blocks.mlp.up.kernel[...]
        assert kernel.shape[0] == 4 and "stage" not in str(jax.typeof(kernel).sharding.spec)
        kept = model.blocks.mlp.up.kernel[...]
        assert "stage" in str(jax.typeof(kept).sharding.spec)
        values = _host(model)
    np.testing.assert_array_equal(got, _one_device_tokens(cfg, values, 8))

"""Generation from a pipelined model (its blocks re-laid out off the stage axis,
:func:`sp_jax.models.decode.unpipelined`) and with the KV cache split over a context axis
(ring and Ulysses prefill, each decode step's attention merged across the context shards
by log-sum-exp): the greedy tokens of ragged prompts equal the same model's (same
parameters) generation on one device, and, for the golden fixtures, transformers'."""

import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import ROOT, script_env
from conftest import make_mesh
from flax import nnx

import sp_jax
from sp_jax.attention import zigzag_order
from sp_jax.models import GPT, GPTConfig, generate, hf
from sp_jax.models.decode import cache_slots, decode_step, prefill, unpipelined

PROMPTS = [[5, 17, 3, 88, 41, 9, 60], [12, 2], [70, 33, 8, 19]]  # ragged rows


def _host(model) -> dict:
    """The model's parameters as NumPy arrays, the stacked blocks ``[L, ...]`` (a
    circular pipeline stores them ``[R, L / R, ...]`` in layer order)."""
    values = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    if model.parallel.pipeline_repeats > 1:
        layers = model.config.num_layers
        values["blocks"] = jax.tree.map(lambda x: x.reshape(layers, *x.shape[2:]),
                                        values["blocks"])
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


@pytest.mark.parametrize("schedule, repeats, experts", [
    pytest.param("gpipe", 1, 0, id="gpipe-r1"),
    pytest.param("1f1b", 2, 0, id="1f1b-r2", marks=pytest.mark.slow),
    pytest.param("1f1b", 1, 4, id="1f1b-r1-experts", marks=pytest.mark.slow)])
def test_pipelined_model_generates_the_unpipelined_tokens(schedule, repeats, experts):
    """``generate`` on a model with ``pipeline_axis`` (2 stages x 2 data x 2 tensor, its
    blocks ``[L, ...]`` or, with 2 repeats, ``[2, L / 2, ...]`` over the stages; with
    ``experts``: mixture-of-experts layers, 2 stages x 2 expert x 2 tensor) gives the
    tokens of the same parameters unpipelined on one device; the model keeps its
    pipeline layout."""
    cfg = GPTConfig.llama("llama-tiny", vocab_size=97, num_layers=4, scan_layers=True,
                          **(dict(num_experts=experts, moe_mlp_hidden=32) if experts else {}))
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=4,
                                pipeline_schedule=schedule, pipeline_repeats=repeats,
                                expert_axis="expert" if experts else None)
    shape = (2, 1, 2, 1, 2) if experts else (2, 2, 1, 1, 2)
    mesh = jax.make_mesh(shape, ("stage", "data", "expert", "context", "tensor"),
                         devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
        model = GPT(cfg, parallel=par, rngs=nnx.Rngs(0))
        got = generate(model, PROMPTS, max_new_tokens=8).tokens
        flat = unpipelined(model)
        assert flat.parallel.pipeline_axis is None
        kernel = jax.tree.leaves(nnx.state(flat.blocks.mlp, nnx.Param))[0]
        assert kernel.shape[0] == 4 and "stage" not in str(jax.typeof(kernel).sharding.spec)
        kept = jax.tree.leaves(nnx.state(model.blocks.mlp, nnx.Param))[0]
        assert "stage" in str(jax.typeof(kept).sharding.spec)
        values = _host(model)
    np.testing.assert_array_equal(got, _one_device_tokens(cfg, values, 8))


# -- a KV cache split over a context axis ----------------------------------------------

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
AXES = ("data", "context", "tensor")


def _mesh(shape):
    return jax.make_mesh(shape, AXES, devices=jax.devices()[:int(np.prod(shape))])


@pytest.mark.parametrize("family, kind, shape", [
    pytest.param("llama", "ring", (1, 2, 2), id="llama-ring-1x2x2"),
    pytest.param("llama", "ulysses", (2, 2, 1), id="llama-ulysses-2x2x1",
                 marks=pytest.mark.slow),
    pytest.param("mistral", "ulysses", (1, 2, 1), id="mistral-ulysses-1x2x1",
                 marks=pytest.mark.slow)])
def test_greedy_on_a_context_axis_equals_transformers(family, kind, shape):
    """32 new tokens of 3 ragged prompts (5, 9 and 3 tokens) with the prefill's ring or
    Ulysses attention and the KV cache split over the context axis (a data x context x
    tensor mesh), equal to transformers' greedy tokens (tests/fixtures/hf goldens;
    Mistral's sliding window of 4 with Ulysses)."""
    golden = np.load(FIXTURES / family / "golden.npz")
    prompts = [golden[f"gen_prompt_{i}"].tolist() for i in range(3)]
    expected = np.stack([golden[f"gen_tokens_{i}"] for i in range(3)])
    par = sp_jax.ParallelConfig(context_axis="context", context_parallel=kind)
    with jax.set_mesh(_mesh(shape)):
        out = generate(hf.from_hf(FIXTURES / family, parallel=par), prompts,
                       max_new_tokens=32)
    np.testing.assert_array_equal(out.tokens, expected)


@pytest.mark.parametrize("preset, kind, shape", [
    pytest.param("gpt2", "ring", (1, 4, 2), id="gpt2-ring-1x4x2"),
    pytest.param("llama", "ulysses", (1, 2, 2), id="llama-ulysses-1x2x2",
                 marks=pytest.mark.slow),
    pytest.param("llama", "ring", (2, 2, 2), id="llama-ring-2x2x2", marks=pytest.mark.slow)])
def test_context_generation_equals_one_device(preset, kind, shape):
    """The same parameters generate the same tokens with the cache split over the
    context axis as on one device (learned positions with ring attention's zigzag
    prefill; rotary with grouped-query attention), 12 new tokens of ragged prompts; each
    context shard holds ``length / context`` positions of the cache, and a decode step
    merges the shards' attention with one all-reduce pair per layer over the context
    axis (a max and a sum)."""
    cfg = {"gpt2": lambda: GPTConfig.gpt2("tiny", vocab_size=97),
           "llama": lambda: GPTConfig.llama("llama-tiny", vocab_size=97, num_kv_heads=4,
                                            scan_layers=True)}[preset]()
    par = sp_jax.ParallelConfig(context_axis="context", context_parallel=kind)
    context = shape[1]
    with jax.set_mesh(_mesh(shape)):
        model = GPT(cfg, parallel=par, rngs=nnx.Rngs(0))
        got = generate(model, PROMPTS, max_new_tokens=12).tokens
        model.eval()
        tokens = jnp.zeros((shape[0], 16), jnp.int32)
        _, cache = nnx.jit(prefill, static_argnums=(3,))(
            model, tokens, jnp.full((shape[0],), 3), 16 + 4 * context)
        assert cache.k.shape[2] == 16 + 4 * context
        assert {s.data.shape[2] for s in cache.k.addressable_shards} == {16 // context + 4}
        text = nnx.jit(decode_step).lower(model, cache, jnp.zeros(shape[0], jnp.int32),
                                          jnp.full((shape[0],), 4)).as_text()
        values = _host(model)
    bodies = 1 if cfg.scan_layers else cfg.num_layers  # a scan's body is written once
    # per layer: 2 over the tensor axis, the max and the sum over the context axis
    assert text.count("stablehlo.all_reduce") == 4 * bodies + 1
    np.testing.assert_array_equal(got, _one_device_tokens(cfg, values, 12))


def test_cache_slots_place_every_position_once():
    """:func:`cache_slots`: every position at one (shard, slot), the prompt's as its
    held order puts them, the later ones round robin."""
    order = zigzag_order(8, 2)  # [0 1 6 7 | 2 3 4 5]
    table, shard, slot = cache_slots(8, 14, 2, order)
    np.testing.assert_array_equal(table, [[0, 1, 6, 7, 8, 10, 12], [2, 3, 4, 5, 9, 11, 13]])
    np.testing.assert_array_equal(table[shard, slot], np.arange(14))


@pytest.mark.slow
def test_example_generates_on_a_context_mesh():
    """``examples/generate.py --mesh 1,2,2 --context-parallel ring`` (data x context x
    tensor) prints transformers' greedy tokens of the golden prompts."""
    golden = np.load(FIXTURES / "llama" / "golden.npz")
    prompts = [golden[f"gen_prompt_{i}"].tolist() for i in range(3)]
    expected = np.stack([golden[f"gen_tokens_{i}"] for i in range(3)])[:, :8]
    ids = [arg for p in prompts for arg in ("--prompt-ids", ",".join(map(str, p)))]
    out = subprocess.run(
        [sys.executable, "examples/generate.py", "--hf-dir", str(FIXTURES / "llama"), *ids,
         "--max-new-tokens", "8", "--ignore-eos", "--mesh", "1,2,2",
         "--context-parallel", "ring"],
        cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    got = [[int(t) for t in line.split(" -> ")[1].split(",")] for line in lines[:3]]
    np.testing.assert_array_equal(got, expected)
    assert "on mesh data=1 x context=2 x tensor=2" in lines[3]

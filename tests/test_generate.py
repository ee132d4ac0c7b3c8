"""Generation: greedy tokens equal to transformers' ``generate(do_sample=False)`` token for
token (tests/fixtures/hf goldens: 3 ragged prompts, 32 new tokens) on 1, 4 and 2 x 4
devices; rows ending at their eos; the cache's next-token logits equal to a full forward
(an independent computation: the training path over prompt + generated tokens);
sampling filters equal to a NumPy reference; one compile of the decode step; the
collectives per token."""

import logging
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import cache_and_forward_logits
from conftest import make_mesh
from flax import nnx

import sp_jax
from sp_jax.models import GPT, GPTConfig, filter_logits, generate, hf
from sp_jax.models.decode import decode_step, prefill

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
MESHES = [pytest.param((1, 1), marks=pytest.mark.slow),
          pytest.param((1, 4), marks=pytest.mark.slow), (2, 4)]


def _golden(family: str):
    golden = np.load(FIXTURES / family / "golden.npz")
    prompts = [golden[f"gen_prompt_{i}"].tolist() for i in range(3)]
    expected = np.stack([golden[f"gen_tokens_{i}"] for i in range(3)])
    return prompts, expected


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("family", [pytest.param("gpt2", marks=pytest.mark.slow), "llama"])
def test_greedy_equals_transformers(family, shape):
    """32 new tokens of 3 ragged prompts in one batch, equal to transformers' greedy
    generation of each prompt alone."""
    prompts, expected = _golden(family)
    with jax.set_mesh(make_mesh(*shape)):
        model = hf.from_hf(FIXTURES / family)
        out = generate(model, prompts, max_new_tokens=32)
    np.testing.assert_array_equal(out.tokens, expected)
    np.testing.assert_array_equal(out.lengths, [32, 32, 32])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "qwen3_head_dim"])
def test_greedy_equals_transformers_new_families(family):
    """The same for Mistral (a sliding window of 4, below the 32 new tokens), Qwen2
    (q/k/v biases), Qwen3 (per-head q/k norm) and a Qwen3 whose head_dim (8) is not
    hidden / heads (4) on 2 x 4 devices."""
    prompts, expected = _golden(family)
    with jax.set_mesh(make_mesh(2, 4)):
        out = generate(hf.from_hf(FIXTURES / family), prompts, max_new_tokens=32)
    np.testing.assert_array_equal(out.tokens, expected)


@pytest.mark.slow
def test_rows_stop_at_their_eos():
    """With ``eos_token_id`` each row ends at its first eos (kept), then pad tokens; rows
    without it run to max_new_tokens."""
    prompts, expected = _golden("gpt2")
    eos = int(expected[0, 5])
    with jax.set_mesh(make_mesh(1, 4)):
        out = generate(hf.from_hf(FIXTURES / "gpt2"), prompts, max_new_tokens=32,
                       eos_token_id=eos, pad_token_id=99)
    for row, tokens, n in zip(expected, out.tokens, out.lengths, strict=True):
        hits = np.flatnonzero(row == eos)
        end = int(hits[0]) + 1 if hits.size else 32
        assert n == end
        np.testing.assert_array_equal(tokens[:end], row[:end])
        assert (tokens[end:] == 99).all()
    assert out.lengths[0] <= 6


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["gpt2", "llama", "mqa_fsdp", "head_dim16_gqa_qk_norm"])
def test_cache_gives_the_logits_of_a_full_forward(preset):
    """After the prefill and n decode steps, the next-token logits from the cache equal
    the logits of a forward over each row's prompt + n tokens (fp32, 1e-5); ragged rows
    at different positions (2 x 4 devices; learned positions; rotary with rope scaling
    and GQA, scanned layers; multi-query attention with parameters sharded by fsdp;
    head_dim 16 apart from hidden / heads = 8, GQA with q/k norm)."""
    parallel = sp_jax.ParallelConfig(fsdp=preset == "mqa_fsdp")
    scaling = dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8)
    cfg = {"gpt2": lambda: GPTConfig.gpt2("tiny", vocab_size=97),
           "llama": lambda: GPTConfig.llama("llama-tiny", vocab_size=97, scan_layers=True,
                                            rope_scaling=scaling),
           "mqa_fsdp": lambda: GPTConfig.llama("llama-tiny", vocab_size=97, num_kv_heads=1,
                                               tie_embeddings=True),
           "head_dim16_gqa_qk_norm": lambda: GPTConfig.llama(
               "llama-tiny", vocab_size=97, head_dim=16, num_kv_heads=2, qk_norm=True)}[preset]()
    rng = np.random.default_rng(0)
    lengths = np.array([5, 3])
    full = rng.integers(0, 97, (2, 12)).astype(np.int32)
    steps = 4
    with jax.set_mesh(make_mesh(2, 4)):
        model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0))
        model.eval()
        logits, reference = cache_and_forward_logits(model, full[:, :12], lengths, steps)
    for b in range(2):
        np.testing.assert_allclose(logits[b], reference[b, lengths[b] + steps - 1],
                                   rtol=1e-5, atol=1e-5)


def _numpy_filter(logits, temperature, top_k, top_p):
    """transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper."""
    x = logits.astype(np.float32) / np.float32(temperature)
    if top_k is not None:
        kth = np.sort(x, axis=-1)[..., -top_k][..., None]
        x = np.where(x < kth, -np.inf, x)
    if top_p is not None:
        for row in x:
            order = np.argsort(row, kind="stable")
            p = np.exp(row[order] - row[order].max())
            cumulative = np.cumsum(p / p.sum())
            remove = cumulative <= 1 - top_p
            remove[-1] = False
            row[order[remove]] = -np.inf
    return x


@pytest.mark.parametrize("temperature, top_k, top_p",
                         [(1.0, 5, None), (0.7, None, 0.9), (1.3, 20, 0.5), (1.0, None, 1.0)])
def test_filters_equal_a_numpy_reference(temperature, top_k, top_p):
    logits = np.random.default_rng(1).normal(size=(3, 50)).astype(np.float32) * 3
    got = np.asarray(filter_logits(jnp.asarray(logits), temperature=temperature,
                                   top_k=top_k, top_p=top_p))
    want = _numpy_filter(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[~np.isinf(got)], want[~np.isinf(want)], rtol=1e-6)


@pytest.mark.slow
def test_sampling_is_reproducible_and_mesh_independent():
    """One key gives the same tokens twice and on another mesh; another key, other
    tokens; a tiny temperature gives the greedy tokens."""
    prompts, expected = _golden("llama")
    kwargs = dict(max_new_tokens=8, temperature=1.0, top_k=20, top_p=0.95)
    outs = {}
    for shape in [(1, 4), (2, 4)]:
        with jax.set_mesh(make_mesh(*shape)):
            model = hf.from_hf(FIXTURES / "llama")
            outs[shape] = generate(model, prompts, rngs=jax.random.key(3), **kwargs).tokens
            again = generate(model, prompts, rngs=jax.random.key(3), **kwargs).tokens
            streams = [generate(model, prompts, rngs=nnx.Rngs(sample=7), **kwargs).tokens
                       for _ in range(2)]
            other = generate(model, prompts, rngs=jax.random.key(4), **kwargs).tokens
            cold = generate(model, prompts, max_new_tokens=8, temperature=1e-4,
                            rngs=jax.random.key(0)).tokens
        np.testing.assert_array_equal(again, outs[shape])
        np.testing.assert_array_equal(*streams)
        assert (other != outs[shape]).any()
        np.testing.assert_array_equal(cold, expected[:, :8])
    np.testing.assert_array_equal(outs[(1, 4)], outs[(2, 4)])


@pytest.mark.slow
def test_one_compile_and_the_collectives_per_token():
    """Generating 24 tokens compiles the prefill and the decode step once each (none per
    token; jax's compile log), and a second call of the same shapes compiles neither.
    The step's program has 2 all-reduces per layer + 1 (the embedding) and 1 all-gather
    (the logits), all over the tensor axis."""
    prompts, _ = _golden("llama")
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())

    def compiled(**kwargs) -> list[str]:
        logged.clear()
        logging.getLogger("jax").addHandler(handler)
        try:
            with jax.log_compiles():
                generate(model, prompts, **kwargs)
        finally:
            logging.getLogger("jax").removeHandler(handler)
        return sorted(m.split()[1] for m in logged
                      if m.startswith(("Compiling jit(first)", "Compiling jit(step)")))

    with jax.set_mesh(make_mesh(2, 4)):
        model = hf.from_hf(FIXTURES / "llama")
        assert compiled(max_new_tokens=24) == ["jit(first)", "jit(step)"]
        assert compiled(max_new_tokens=24) == []
        model.eval()
        _, cache = nnx.jit(prefill, static_argnums=(3,))(
            model, jnp.zeros((2, 8), jnp.int32), jnp.array([3, 5]), 16)
        text = nnx.jit(decode_step).lower(model, cache, jnp.zeros(2, jnp.int32),
                                          jnp.array([4, 6])).as_text()
    layers = model.config.num_layers
    assert text.count("stablehlo.all_reduce") == 2 * layers + 1
    assert text.count("stablehlo.all_gather") == 1


# -- mixtures of experts -------------------------------------------------------------------

EXPERTS = sp_jax.ParallelConfig(expert_axis="expert")


def _expert_mesh(*shape: int) -> jax.sharding.Mesh:
    """A (data, expert, context, tensor) mesh over the first devices."""
    return jax.make_mesh(shape, ("data", "expert", "context", "tensor"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 4,
                         devices=jax.devices()[:int(np.prod(shape))])


@pytest.mark.parametrize("family, mesh", [
    ("mixtral", "2x2x1x2"),
    pytest.param("mixtral", "1x4x1x2", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "1x2x1x2", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "1x1x1x4", marks=pytest.mark.slow),
])
def test_greedy_with_experts_equals_transformers(family, mesh):
    """Mixtral and Qwen3-MoE (4 experts, 2 per token) on (data, expert, context, tensor)
    meshes with the experts split over the expert axis and their width over the tensor
    axis: 32 new tokens of 3 ragged prompts equal to transformers' greedy generation (the
    fixtures' routing has no near-ties on any generated token), and the first token's
    logits equal to transformers' (1e-5)."""
    prompts, expected = _golden(family)
    golden = np.load(FIXTURES / family / "golden.npz")
    shape = tuple(int(n) for n in mesh.split("x"))  # (data, expert, context, tensor)
    parallel = EXPERTS if shape[1] > 1 else sp_jax.ParallelConfig()
    with jax.set_mesh(_expert_mesh(*shape) if shape[1] > 1 else make_mesh(1, shape[3])):
        model = hf.from_hf(FIXTURES / family, parallel=parallel)
        out = generate(model, prompts, max_new_tokens=32)
        model.eval()
        lengths = np.array([len(p) for p in prompts])
        tokens = np.zeros((4, 12), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = p
        first, _ = nnx.jit(prefill, static_argnums=(3,))(
            model, jnp.asarray(tokens), jnp.asarray(np.append(lengths, 1) - 1), 16)
    np.testing.assert_array_equal(out.tokens, expected)
    for i in range(3):
        np.testing.assert_allclose(np.asarray(first)[i], golden[f"gen_next_logits_{i}"],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["scan_2x2x1x2", "shared_1x4x1x2"])
def test_cache_with_experts_gives_the_logits_of_a_full_forward(preset):
    """A mixture of experts' next-token logits from its cache after the prefill and 4
    decode steps equal a forward over each row's prompt + tokens (fp32, 1e-5): experts
    over the expert axis; scanned layers, or a shared expert (DeepSeek style) and a dense
    layer between the expert layers."""
    overrides = dict(scan_layers=True) if preset.startswith("scan") else dict(
        num_shared_experts=1, moe_layer_freq=2, num_layers=3)
    cfg = GPTConfig.mixtral("mixtral-tiny", vocab_size=97, num_experts=4, **overrides)
    shape = tuple(int(n) for n in preset.split("_")[1].split("x"))
    rng = np.random.default_rng(0)
    lengths = np.array([5, 3, 7, 2])
    full = rng.integers(0, 97, (4, 12)).astype(np.int32)
    steps = 4
    with jax.set_mesh(_expert_mesh(*shape)):
        model = GPT(cfg, parallel=EXPERTS, rngs=nnx.Rngs(0))
        model.eval()
        logits, reference = cache_and_forward_logits(model, full, lengths, steps)
    for b in range(4):
        np.testing.assert_allclose(logits[b], reference[b, lengths[b] + steps - 1],
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_collectives_per_token_with_experts():
    """The decode step of a mixture of experts on a (1, 2, 1, 2) mesh, from its compiled
    HLO: per expert layer 1 all-gather over the expert axis (the normed rows) and 1
    all-reduce over the expert and tensor axes (the experts' and columns' sum), besides
    the attention's 1 all-reduce per layer, the embedding's all-reduce and the logits'
    all-gather; no all-to-all."""
    from sp_jax.analysis.hlo import collective_stats
    prompts, _ = _golden("mixtral")
    with jax.set_mesh(_expert_mesh(1, 2, 1, 2)):
        model = hf.from_hf(FIXTURES / "mixtral", parallel=EXPERTS)
        model.eval()
        _, cache = nnx.jit(prefill, static_argnums=(3,))(
            model, jnp.zeros((2, 8), jnp.int32), jnp.array([3, 5]), 16)
        hlo = nnx.jit(decode_step).lower(model, cache, jnp.zeros(2, jnp.int32),
                                         jnp.array([4, 6])).compile().as_text()
    layers = model.config.num_layers
    counts = collective_stats(hlo).ops
    assert counts["all-reduce"] == 2 * layers + 1, counts
    assert counts["all-gather"] == layers + 1, counts
    assert counts["all-to-all"] == counts["ragged-all-to-all"] == 0, counts

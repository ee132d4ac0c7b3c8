"""The attention seam end to end: a test-only attention variant, defined and registered
here (one class, one ``register_attention`` call, nothing in ``sp_jax.models``), with a
value head size twice the query/key one, trains, evaluates and generates on a (data,
context, tensor) mesh with ring and Ulysses attention exactly as the same parameters do
on one device; its attention layer matches a plain dense formula; a second variant with a
cache type of its own (a latent whole over the tensor axis, as multi-head latent
attention's) generates through the same generic decoding; the registry names what it
holds."""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import copy_weights, param_values, to_host, train_gpt
from conftest import make_mesh
from flax import nnx
from jax.sharding import AxisType

import sp_jax
from sp_jax.attention import cached_attention
from sp_jax.layers import (
    AttentionCache,
    AttentionConfig,
    CausalSelfAttention,
    ColumnSequenceParallelLinear,
    RowSequenceParallelLinear,
    attention_names,
    register_attention,
    rotary_embedding,
    token_positions,
)
from sp_jax.layout import Layout
from sp_jax.models import GPT, GPTConfig, generate, hf
from sp_jax.models.decode import prefill


class WideValueAttention(CausalSelfAttention):
    """Multi-head attention whose value heads are twice as wide as the query/key heads:
    ``qkv [hidden, heads * 4 * head_dim]`` with columns ``(head, [q | k | v v])`` (so each
    tensor shard's column block holds its heads' q, k and 2-wide v), ``out [heads * 2 *
    head_dim, hidden]``. Training, prefill, decoding and its cache
    (:class:`~sp_jax.layers.KVCache`, values ``2 * head_dim`` wide) are the base class's."""

    def projections(self, rngs):
        cfg = self.config
        if cfg.num_kv_heads != cfg.num_heads:
            raise ValueError("WideValueAttention: num_kv_heads must equal num_heads.")
        common = dict(parallel=self.parallel, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                      fp8=cfg.fp8, rngs=rngs)
        return (ColumnSequenceParallelLinear(cfg.hidden, 4 * cfg.attention_width,
                                             use_bias=cfg.qkv_bias, **common),
                RowSequenceParallelLinear(2 * cfg.attention_width, cfg.hidden,
                                          use_bias=cfg.out_bias, **common))

    def heads_of(self, qkv):
        b, s, width = qkv.shape
        d = self.config.head_dim
        cols = qkv.reshape(b, s, width // (4 * d), 4 * d)
        return cols[..., :d], cols[..., d:2 * d], cols[..., 2 * d:]


register_attention("wide_value", WideValueAttention)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NormedInputCache(AttentionCache):
    """Each layer's normed input ``h [layers, batch, length, hidden]``, whole over the
    tensor axis (``P(None, data, context, None)``): a latent every tensor shard projects
    its own heads' keys and values from, as multi-head latent attention's cache."""

    h: jax.Array
    prompt: int = dataclasses.field(default=0, metadata=dict(static=True))

    @classmethod
    def entry_specs(cls, layout):
        return {"h": layout.spec("activation_batch", "activation_length", None)}


class NormedInputCacheAttention(CausalSelfAttention):
    """Multi-head attention (training as ``"mha"``) whose decoding caches the normed input
    instead of keys and values: each step projects this shard's keys and values of every
    cached token again (rotary angles of the positions they hold)."""

    cache_type = NormedInputCache

    def prefill(self, x):
        spec = NormedInputCache.entry_specs(Layout.of(self.parallel))["h"]
        return self(x), NormedInputCache(jax.reshard(self.norm(x), spec))

    def decode_step(self, x, cache, positions, cache_positions=None):
        b, length = x.shape[0], cache.h.shape[1]
        held = jnp.arange(length) if cache_positions is None else cache_positions
        scales = self.qk_scales()
        layer_window = None if self.window is None else self.window[...]
        h = self.norm.local(x)
        q, k, v = self.split_heads(self.qkv.local_decode(h),
                                   token_positions(positions, x.shape[1]), scales, layer_window)
        _, k_cache, v_cache = self.split_heads(self.qkv.local_decode(cache.h),
                                               jnp.broadcast_to(held, (b, length)), scales,
                                               layer_window)
        o = cached_attention(q, k, v, k_cache, v_cache, positions,
                             self.config.sliding_window if layer_window is None
                             else layer_window, cache_positions=cache_positions,
                             axis_name=self.parallel.context_axes or None,
                             scale=self.config.attention_scale,
                             softcap=self.config.attention_softcap)
        return x + self.out.local_decode(o), NormedInputCache(h)


register_attention("normed_input_cache", NormedInputCacheAttention)

B, S, V = 4, 16, 64
CONFIG = dict(vocab_size=V, max_seq_len=32, num_layers=2, num_heads=4, hidden=32,
              positions="rotary", norm="rmsnorm", mlp_activation="swiglu", mlp_bias=False,
              out_bias=False, attention_block_q=4, attention_block_k=4,
              attention="wide_value")
MODES = {"ring": dict(scan_layers=True), "ulysses": dict(scan_layers=False)}


def _mesh(data, context, tensor):
    return jax.make_mesh((data, context, tensor), ("data", "context", "tensor"),
                         axis_types=(AxisType.Explicit,) * 3,
                         devices=jax.devices()[: data * context * tensor])


def _batches(steps=4, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        start, stride = rng.integers(0, V, size=(B, 1)), rng.integers(1, 4, size=(B, 1))
        tokens = ((start + stride * np.arange(S + 1)) % V).astype(np.int32)
        out.append({"tokens": tokens[None, :, :-1], "labels": tokens[None, :, 1:]})
    return out


def test_registry_names_and_refusals():
    """``GPTConfig(attention=...)`` is checked at construction against the registered
    names; a class without the protocol, or a second class under a taken name, is
    refused; no Hugging Face family writes a variant."""
    assert attention_names()[:1] == ("mha",) and "wide_value" in attention_names()
    assert GPTConfig(**CONFIG).attention_config().attention == "wide_value"
    with pytest.raises(ValueError, match=r"attention='latent' is not a registered attention;"
                                         r" use one of \['mha', .*'wide_value'"):
        GPTConfig(**{**CONFIG, "attention": "latent"})
    with pytest.raises(ValueError, match="register_attention"):
        AttentionConfig(32, 4, attention="latent")
    with pytest.raises(TypeError, match=r"must define \['__call__', 'prefill', 'decode_step'\] "
                                        r"\(missing \['__call__', 'prefill', 'decode_step'\]"):
        register_attention("broken", type("Broken", (), {}))
    with pytest.raises(ValueError, match="'mha' is already .*CausalSelfAttention"):
        register_attention("mha", WideValueAttention)
    register_attention("wide_value", WideValueAttention)  # the same class again: no-op
    with pytest.raises(ValueError, match="attention='wide_value'"):  # no family writes it
        hf.config_to_hf(GPTConfig(**CONFIG), "llama")


def _out_and_grad(f, x):
    """``f(x)`` and the gradient of ``sum(f(x))`` with respect to ``x``."""
    out, back = jax.vjp(f, x)
    return out, back(jnp.ones_like(out))[0]


@pytest.mark.slow
def test_wide_value_layer_matches_a_dense_formula():
    """The variant's layer on one device: ``x + out(attention(q, k, v))`` with q, k
    ``head_dim`` wide (rotary applied), v ``2 * head_dim`` wide, from its own kernels'
    columns, against plain jnp; and the gradient of x."""
    cfg = AttentionConfig(16, 2, rotary=True, norm="rmsnorm", attention="wide_value")
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 8, 16)), jnp.float32)
    with jax.set_mesh(make_mesh(1, 1)):
        layer = WideValueAttention(cfg, rngs=nnx.Rngs(0))
        got, grad = to_host(nnx.jit(_out_and_grad)(layer, x))
        p = param_values(layer)

    def dense(x):
        h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * p["norm"]["scale"]
        cols = (h @ p["qkv"]["kernel"]).reshape(2, 8, 2, 4 * 8)
        q, k, v = cols[..., :8], cols[..., 8:16], cols[..., 16:]
        q, k = (rotary_embedding(a, jnp.arange(8)) for a in (q, k))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
        probs = jax.nn.softmax(jnp.where(np.tril(np.ones((8, 8), bool)), scores, -jnp.inf))
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(2, 8, 2 * 16)
        return x + out @ p["out"]["kernel"]

    want, want_grad = _out_and_grad(dense, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-5)


def _loss_and_grads(cfg, parallel, mesh, values, batch):
    """The loss of ``batch`` and its gradients, on ``mesh``, from parameters ``values``."""
    with jax.set_mesh(mesh):
        model = copy_weights(GPT(cfg, parallel=parallel, rngs=nnx.Rngs(1)), values)
        loss, grads = nnx.jit(nnx.value_and_grad(
            lambda m, t, y: m.loss(t, y)))(model, batch["tokens"][0], batch["labels"][0])
        return float(loss), to_host(nnx.to_pure_dict(nnx.state(grads)))


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_wide_value_variant_trains_like_one_device(mode):
    """On (data=2, context=2, tensor=2) with ``mode`` attention: the first batch's loss
    and gradients, then 4 AdamW steps (losses and parameters), equal the same
    parameters' on one device."""
    cfg = GPTConfig(**CONFIG, **MODES[mode])
    batches = _batches()
    single = sp_jax.ParallelConfig(data_axis=None)
    init, ref_losses, ref_params, _ = train_gpt(cfg, single, _mesh(1, 1, 1), batches,
                                                tx=optax.adamw(3e-3, eps=1e-5))
    blocks = init["blocks"] if cfg.scan_layers else init["blocks"][0]
    assert blocks["attention"]["out"]["kernel"].shape[-2] == 4 * 2 * 8  # v 2x wide
    parallel = sp_jax.ParallelConfig(context_axis="context", context_parallel=mode)
    ref = _loss_and_grads(cfg, single, _mesh(1, 1, 1), init, batches[0])
    got = _loss_and_grads(cfg, parallel, _mesh(2, 2, 2), init, batches[0])
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-6)
    chex.assert_trees_all_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    _, losses, params, _ = train_gpt(cfg, parallel, _mesh(2, 2, 2), batches, init=init)
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-5)


PROMPTS = [[5, 17, 3, 41, 9, 60, 2], [12, 2], [33, 8, 19]]


def _argmax_loop(model, prompts, steps):
    """Greedy tokens by full forwards: each step the argmax of the logits at each row's
    last token, appended (one jitted forward over a fixed right-padded width)."""
    width = max(map(len, prompts)) + steps
    tokens = np.zeros((len(prompts), width), np.int32)
    lengths = np.array([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    forward = nnx.jit(lambda m, t: m(t))
    rows = np.arange(len(prompts))
    for n in range(steps):
        logits = np.asarray(forward(model, jnp.asarray(tokens)))
        tokens[rows, lengths + n] = logits[rows, lengths + n - 1].argmax(-1)
    return tokens[rows[:, None], lengths[:, None] + np.arange(steps)]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_wide_value_variant_evaluates_and_generates_like_one_device(mode):
    """On (data=2, context=2, tensor=2) with ``mode`` attention: logits and hidden states
    equal one device's for the same parameters; the prefill's cache holds values twice
    as wide as keys; greedy generation (cache split over the context axis) gives the
    tokens of an argmax loop of full forwards on one device."""
    cfg = GPTConfig(**CONFIG, **MODES[mode])
    parallel = sp_jax.ParallelConfig(context_axis="context", context_parallel=mode)
    tokens = jnp.asarray(_batches(1, seed=5)[0]["tokens"][0])
    with jax.set_mesh(_mesh(2, 2, 2)):
        model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0))
        model.eval()
        logits = to_host(nnx.jit(lambda m, t: m(t))(model, tokens))
        hidden = to_host(nnx.jit(lambda m, t: m.hidden_states(t))(model, tokens))
        _, cache = nnx.jit(prefill, static_argnums=(3,))(model, tokens, jnp.full((B,), 3), 20)
        assert cache.v.shape[-1] == 2 * cache.k.shape[-1] == 2 * cfg.attention_config().head_dim
        got = generate(model, PROMPTS, max_new_tokens=8).tokens
        values = param_values(model)
    with jax.set_mesh(_mesh(1, 1, 1)):
        ref = copy_weights(GPT(cfg, rngs=nnx.Rngs(1)), values)
        ref.eval()
        np.testing.assert_allclose(logits, nnx.jit(lambda m, t: m(t))(ref, tokens),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(hidden, nnx.jit(lambda m, t: m.hidden_states(t))(
            ref, tokens), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got, _argmax_loop(ref, PROMPTS, 8))


@pytest.mark.slow
def test_a_cache_type_of_its_own_generates_like_one_device():
    """A variant with its own cache type (the normed input, whole over the tensor axis,
    split over the context axis along the length) generates on (data=2, context=2,
    tensor=2) with ring attention the tokens of an argmax loop on one device; the
    prefill's cache is laid out as the type states."""
    cfg = GPTConfig(**{**CONFIG, "attention": "normed_input_cache", "scan_layers": True})
    parallel = sp_jax.ParallelConfig(context_axis="context", context_parallel="ring")
    tokens = jnp.asarray(_batches(1, seed=5)[0]["tokens"][0])
    with jax.set_mesh(_mesh(2, 2, 2)):
        model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0))
        model.eval()
        _, cache = nnx.jit(prefill, static_argnums=(3,))(model, tokens, jnp.full((B,), 3), 20)
        assert isinstance(cache, NormedInputCache) and cache.h.shape == (2, B, 20, 32)
        assert jax.typeof(cache.h).sharding.spec == jax.P(None, "data", "context", None)
        got = generate(model, PROMPTS, max_new_tokens=8).tokens
        values = param_values(model)
    with jax.set_mesh(_mesh(1, 1, 1)):
        ref = copy_weights(GPT(cfg, rngs=nnx.Rngs(1)), values)
        ref.eval()
        np.testing.assert_array_equal(got, _argmax_loop(ref, PROMPTS, 8))

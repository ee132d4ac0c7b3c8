"""The Gemma 2 / 3 features of a GPT (``norm_offset``, ``post_norms``, ``scale_embeddings``,
``final_logit_softcap``, ``rope_local_base``, with q/k norms, tanh GeGLU and per-layer
windows) against an independent plain-jnp decoder written here from transformers'
Gemma 2 / 3 modeling (``(1 + weight)`` RMSNorm in fp32, the post-attention and
post-feedforward norms, embeddings times ``sqrt(hidden)``, ``c * tanh(z / c)`` logits,
local layers rotated with their own base); sharded (2 x 4: tensor and sequence) equal
to one device, scanned or not; generation equal to an argmax loop of full forwards; and
each flag changing the result."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _util import cache_and_forward_logits, param_values
from conftest import make_mesh
from flax import nnx

from sp_jax.layers import CausalSelfAttention, RMSNorm, RopeScaling, rope_frequencies
from sp_jax.models import GPT, GPTConfig, generate

WINDOWS = (4, None)
GEMMA = dict(norm_offset=1.0, post_norms=True, scale_embeddings=True, final_logit_softcap=3.0,
             mlp_activation="geglu_tanh", layer_windows=WINDOWS, rope_local_base=10000.0,
             qk_norm=True, tie_embeddings=True, attention_block_q=4, attention_block_k=4)
# each Gemma flag's value when off
OFF = dict(norm_offset=0.0, post_norms=False, scale_embeddings=False,
           final_logit_softcap=None, rope_local_base=None)


def _config(**overrides) -> GPTConfig:
    return GPTConfig.llama("llama-tiny", **{**GEMMA, **overrides})


def _perturb_norms(model: GPT) -> GPT:
    """Every norm weight (block norms, post-norms, q/k norms, final norm) moved off its
    initial value by a fixed pattern per layer and name (alike scanned or not), so the
    offset and each weight matter."""
    state = nnx.state(model, nnx.Param)
    values = nnx.to_pure_dict(state)

    def move(path, x):
        names = [k.key for k in path]
        if names[-1] not in ("scale", "q_norm", "k_norm"):
            return x
        name = "/".join(str(n) for n in names if not isinstance(n, int))
        layer = next((n for n in names if isinstance(n, int)), None)
        seed = sum(map(ord, name))

        def noise(i):
            return 0.3 * np.sin(np.arange(x.shape[-1]) * 0.7 + seed + 5 * i)

        if x.ndim == 2:  # stacked layers [L, features]
            delta = np.stack([noise(i) for i in range(x.shape[0])])
        else:
            delta = noise(-1 if layer is None else layer)
        return x + jnp.asarray(delta, x.dtype)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(move, values))
    nnx.update(model, state)
    return model


# -- the independent reference (plain jnp, transformers' Gemma 2 / 3 order) ---------------


def _rms(x, w, cfg):
    """Gemma's RMSNorm: fp32 ``x * rsqrt(mean(x^2) + eps) * (offset + w)``."""
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + cfg.norm_epsilon)
    return y * (cfg.norm_offset + w)


def _rope(x, base):
    """Rotate-half rotary embedding at positions 0..s-1 of ``x [b, s, heads, d]``."""
    d = x.shape[-1]
    inv = (1.0 / base ** (np.arange(0, d, 2) / d)).astype(np.float32)
    angles = np.arange(x.shape[1], dtype=np.float32)[:, None] * inv  # [s, d / 2]
    cos = jnp.asarray(np.concatenate([np.cos(angles)] * 2, -1))[None, :, None]
    sin = jnp.asarray(np.concatenate([np.sin(angles)] * 2, -1))[None, :, None]
    rotated = jnp.concatenate([-x[..., d // 2:], x[..., :d // 2]], axis=-1)
    return x * cos + rotated * sin


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + jnp.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def reference_logits(p: dict, tokens, cfg: GPTConfig):
    """Logits ``[b, s, vocab]`` of the parameters ``p`` (an unrolled GPT's pure dict)."""
    heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.hidden // cfg.num_heads
    table = p["embed"]["embedding"]
    x = table[tokens]
    if cfg.scale_embeddings:
        x = x * np.float32(cfg.hidden ** 0.5)
    b, s, _ = x.shape
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    for layer, window in enumerate(cfg.layer_windows):
        a, m = p["blocks"][layer]["attention"], p["blocks"][layer]["mlp"]
        y = _rms(x, a["norm"]["scale"], cfg)
        q = (y @ a["qkv"]["q_kernel"]).reshape(b, s, heads, d)
        kv = (y @ a["qkv"]["kv_kernel"]).reshape(b, s, kv_heads, 2, d)
        k, v = kv[..., 0, :], kv[..., 1, :]
        q, k = _rms(q, a["q_norm"], cfg), _rms(k, a["k_norm"], cfg)
        base = cfg.rope_local_base if window is not None and cfg.rope_local_base \
            else cfg.rope_base
        q, k = _rope(q, base), _rope(k, base)
        k, v = (jnp.repeat(t, heads // kv_heads, axis=2) for t in (k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * np.float32(d ** -0.5)
        allowed = (j <= i) & ((i - j < window) if window is not None else True)
        probs = jax.nn.softmax(jnp.where(allowed, scores, -jnp.inf), axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, heads * d)
        o = o @ a["out"]["kernel"]
        if cfg.post_norms:
            o = _rms(o, a["post_norm"]["scale"], cfg)
        x = x + o
        y = _rms(x, m["norm"]["scale"], cfg)
        u = (y @ m["up"]["kernel"]).reshape(b, s, -1, 2)  # columns (j, {gate, up})
        o = (_gelu_tanh(u[..., 0]) * u[..., 1]) @ m["down"]["kernel"]
        if cfg.post_norms:
            o = _rms(o, m["post_norm"]["scale"], cfg)
        x = x + o
    logits = _rms(x, p["final_norm"]["scale"], cfg) @ table.T
    if cfg.final_logit_softcap is not None:
        c = cfg.final_logit_softcap
        logits = jnp.tanh(logits / c) * c
    return logits


def reference_loss(p, tokens, labels, cfg):
    logp = jax.nn.log_softmax(reference_logits(p, tokens, cfg), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _tokens(seed=1, shape=(2, 17)):
    return jax.random.randint(jax.random.key(seed), shape, 0, 256)


def _model(cfg: GPTConfig) -> GPT:
    return _perturb_norms(GPT(cfg, rngs=nnx.Rngs(0)))


def _loss_and_grads(model, tokens):
    value, grads = nnx.jit(nnx.value_and_grad(
        lambda m: m.loss(tokens[:, :-1], tokens[:, 1:])))(model)
    return float(value), nnx.to_pure_dict(grads)


# -- the tests ---------------------------------------------------------------------------


FLAGS = ("norm_offset", "post_norms", "scale_embeddings", "final_logit_softcap",
         "rope_local_base")


@pytest.mark.parametrize("only", [None, *(pytest.param(f, marks=pytest.mark.slow)
                                          for f in FLAGS)])
def test_gpt_equals_plain_gemma_reference(only):
    """Logits, loss and every gradient of a 1-device GPT equal the plain-jnp decoder's;
    ``only``: that Gemma flag alone on (the others off), None: all on. Each flag moves
    the reference's logits (it is not a no-op)."""
    cfg = _config() if only is None else _config(
        **{**OFF, only: GEMMA.get(only, True)})
    tokens = _tokens()
    with jax.set_mesh(make_mesh(1, 1)):
        model = _model(cfg)
        got_logits = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens[:, :-1]))
        got_loss, got_grads = _loss_and_grads(model, tokens)
    p = param_values(model)
    want_logits = np.asarray(reference_logits(p, tokens[:, :-1], cfg))
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    want_loss, want_grads = jax.value_and_grad(reference_loss)(p, tokens[:, :-1],
                                                               tokens[:, 1:], cfg)
    assert got_loss == pytest.approx(float(want_loss), abs=1e-5)
    flat_want = dict(jax.tree_util.tree_flatten_with_path(want_grads)[0])
    for path, g in jax.tree_util.tree_flatten_with_path(got_grads)[0]:
        np.testing.assert_allclose(np.asarray(g), np.asarray(flat_want[path]), atol=1e-5,
                                   rtol=1e-4, err_msg=jax.tree_util.keystr(path))
    for flag in ([only] if only else FLAGS):  # each flag changes the result
        off = dataclasses.replace(cfg, **{flag: OFF[flag]})
        moved = np.asarray(reference_logits(p, tokens[:, :-1], off))
        assert np.abs(moved - want_logits).max() > 1e-3, flag


@pytest.mark.slow  # fast: the plain-jnp reference above, Gemma 2's golden test
@pytest.mark.parametrize("scan", [False, True])
def test_gemma_sharded_equals_one_device(scan):
    """Loss and gradients on 2 x 4 devices (data, tensor + sequence) equal one device's."""
    tokens = _tokens(2)
    with jax.set_mesh(make_mesh(1, 1)):
        want_loss, want = _loss_and_grads(_model(_config()), tokens)
    with jax.set_mesh(make_mesh(2, 4)):
        got_loss, got = _loss_and_grads(_model(_config(scan_layers=scan)), tokens)
    assert got_loss == pytest.approx(want_loss, abs=1e-5)
    got = jax.tree.map(np.asarray, got)
    for path, w in jax.tree_util.tree_flatten_with_path(want)[0]:
        keys = [k.key for k in path]
        if scan and keys[0] == "blocks":  # stacked [L, ...]: this layer's row
            g = got["blocks"]
            for k in keys[2:]:
                g = g[k]
            g = g[keys[1]]
        else:
            g = got
            for k in keys:
                g = g[k]
        np.testing.assert_allclose(g, np.asarray(w), atol=1e-5, rtol=1e-4,
                                   err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # the fast tier's greedy check: test_attention_softcap.py's
@pytest.mark.parametrize("scan", [False, True])
def test_gemma_generation_equals_argmax_of_full_forwards(scan):
    """Greedy ``generate`` on 2 x 4 devices gives the tokens of an argmax loop over full
    forwards of one device, and the KV cache's next-token logits equal a forward's."""
    prompts = np.asarray(_tokens(3, (2, 6)))
    steps = 6
    with jax.set_mesh(make_mesh(1, 1)):
        ref = _model(_config())
        ref.eval()
        forward = nnx.jit(lambda m, t: m(t))
        seq = prompts
        for _ in range(steps):
            nxt = np.argmax(np.asarray(forward(ref, jnp.asarray(seq)))[:, -1], axis=-1)
            seq = np.concatenate([seq, nxt[:, None]], axis=1)
    with jax.set_mesh(make_mesh(2, 4)):
        model = _model(_config(scan_layers=scan))
        out = generate(model, prompts.tolist(), max_new_tokens=steps)
        np.testing.assert_array_equal(out.tokens, seq[:, prompts.shape[1]:])
        full = np.asarray(_tokens(4, (2, 16)))
        lengths = np.array([5, 8])
        model.eval()
        cached, forward_logits = cache_and_forward_logits(model, full, lengths, steps=4)
    np.testing.assert_allclose(cached, forward_logits[np.arange(2), lengths + 3], atol=2e-5,
                               rtol=2e-5)


def test_gemma_norm_and_rotary_pieces():
    """Gemma's RMSNorm weights start at 0 (a factor of 1); ``norm_offset=0`` is the plain
    norm; the q/k norms start at ``1 - norm_offset``; a local layer's rotary frequencies
    are of ``rope_local_base`` unscaled, a full layer's of ``rope_base`` with
    ``rope_scaling``, chosen by the traced window."""
    x = jax.random.normal(jax.random.key(0), (2, 4, 8))
    w = jnp.linspace(-0.5, 0.5, 8)
    gemma = RMSNorm(8, norm_offset=1.0, epsilon=1e-6, rngs=nnx.Rngs(0))
    assert np.all(np.asarray(gemma.scale[...]) == 0)
    gemma.scale[...] = w
    xf = np.asarray(x, np.float64)
    want = xf / np.sqrt(np.mean(xf ** 2, -1, keepdims=True) + 1e-6) * (1.0 + np.asarray(w))
    np.testing.assert_allclose(np.asarray(gemma.local(x)), want, atol=1e-5, rtol=1e-5)
    plain = RMSNorm(8, epsilon=1e-6, rngs=nnx.Rngs(0))
    plain.scale[...] = 1.0 + w
    np.testing.assert_allclose(np.asarray(plain.local(x)), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="norm_offset=True must be a number"):
        RMSNorm(8, norm_offset=True, rngs=nnx.Rngs(0))

    scaling = RopeScaling(factor=8.0, original_max_position_embeddings=16)
    cfg = _config(rope_scaling=scaling).attention_config()
    with jax.set_mesh(make_mesh(1, 1)):
        layer = CausalSelfAttention(cfg, rngs=nnx.Rngs(0), window=4)
    assert np.all(np.asarray(layer.q_norm[...]) == 0)
    d = cfg.head_dim
    local = (1.0 / 10000.0 ** (np.arange(0, d, 2) / d)).astype(np.float32)
    scaled = rope_frequencies(d, cfg.rope_base, scaling)
    assert np.abs(scaled - rope_frequencies(d, cfg.rope_base)).max() > 0  # scaling bites
    choose = jax.jit(layer.rotary_frequencies)
    np.testing.assert_allclose(np.asarray(choose(jnp.int32(4))), local, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(choose(jnp.int32(2 ** 30))), scaled)
    static = CausalSelfAttention(dataclasses.replace(cfg, window_per_layer=False,
                                                     sliding_window=4),
                                 rngs=nnx.Rngs(0))
    np.testing.assert_allclose(np.asarray(static.rotary_frequencies()), local, rtol=1e-6)


@pytest.mark.slow
def test_moe_post_norm_normalises_the_mixture():
    """A mixture-of-experts layer with ``post_norms`` adds the (offset) RMSNorm of the
    mixture the same layer computes without it."""
    from sp_jax.layers import MoE, MoEConfig

    cfg = MoEConfig(hidden=16, num_experts=4, experts_per_token=2, moe_mlp_hidden=8,
                    num_shared_experts=1, norm_offset=1.0)
    x = jax.random.normal(jax.random.key(5), (2, 8, 16))
    w = jnp.linspace(-0.4, 0.6, 16)
    with jax.set_mesh(make_mesh(1, 1)):
        plain = MoE(cfg, rngs=nnx.Rngs(0))
        post = MoE(cfg.replace(post_norms=True), rngs=nnx.Rngs(0))
        post.post_norm.scale[...] = w
        delta = np.asarray(plain(x)[0] - x)
        got = np.asarray(post(x)[0] - x)
    want = delta / np.sqrt(np.mean(delta ** 2, -1, keepdims=True) + cfg.norm_epsilon) * (
        1.0 + np.asarray(w))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

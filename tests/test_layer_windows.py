"""Per-layer attention windows (``GPTConfig.layer_windows``): each layer's window is data
(a scanned int32 per layer), against an unrolled model whose layers each hold their own
static ``sliding_window`` (the kernels' static path), sharded and not, forward, gradients
and generation's KV cache."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from _util import cache_and_forward_logits
from conftest import make_mesh
from flax import nnx

from sp_jax.models import GPT, GPTConfig

WINDOWS = (3, None, 5)


def _config(**kw) -> GPTConfig:
    return GPTConfig(**dict(dict(vocab_size=64, max_seq_len=16, num_layers=3, hidden=32,
                                 num_heads=4, num_kv_heads=2, positions="rotary",
                                 norm="rmsnorm", attention_block_q=4, attention_block_k=4),
                            **kw))


def _static_reference() -> GPT:
    """An unrolled GPT (same initial weights) whose layer ``i`` has the static window
    ``WINDOWS[i]`` in its own attention config."""
    model = GPT(_config(), rngs=nnx.Rngs(0))
    for block, w in zip(model.blocks, WINDOWS, strict=True):
        block.attention.config = dataclasses.replace(block.attention.config, sliding_window=w)
    return model


def _loss_and_grads(model, tokens):
    def loss(m):
        return m.loss(tokens[:, :-1], tokens[:, 1:])

    value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
    return float(value), grads


@pytest.mark.parametrize("scan,shape", [pytest.param(False, (1, 1), marks=pytest.mark.slow),
                                        (True, (2, 4))])
def test_layer_windows_equal_static_windows(scan, shape):
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 64)
    with jax.set_mesh(make_mesh(1, 1)):
        ref = _static_reference()
        want_logits = np.asarray(nnx.jit(lambda m, t: m(t))(ref, tokens[:, :-1]))
        want_loss, want_grads = _loss_and_grads(ref, tokens)
        # the windows matter: full attention everywhere differs
        full = GPT(_config(), rngs=nnx.Rngs(0))
        assert np.abs(np.asarray(full(tokens[:, :-1])) - want_logits).max() > 1e-3
    with jax.set_mesh(make_mesh(*shape)):
        model = GPT(_config(layer_windows=WINDOWS, scan_layers=scan), rngs=nnx.Rngs(0))
        got_logits = np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens[:, :-1]))
        got_loss, got_grads = _loss_and_grads(model, tokens)
    np.testing.assert_allclose(got_logits, want_logits, atol=2e-5, rtol=2e-5)
    assert got_loss == pytest.approx(want_loss, abs=1e-5)
    want_q = np.stack([np.asarray(want_grads["blocks"][i]["attention"]["qkv"]["q_kernel"][...])
                       for i in range(3)])
    got_q = got_grads["blocks"]["attention"]["qkv"]["q_kernel"][...] if scan else np.stack(
        [got_grads["blocks"][i]["attention"]["qkv"]["q_kernel"][...] for i in range(3)])
    np.testing.assert_allclose(np.asarray(got_q), want_q, atol=2e-5, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True])
def test_layer_windows_cache_logits_equal_forward(scan):
    full = np.asarray(jax.random.randint(jax.random.key(2), (2, 16), 0, 64))
    lengths = np.array([5, 8])
    with jax.set_mesh(make_mesh(2, 4)):
        model = GPT(_config(layer_windows=WINDOWS, scan_layers=scan), rngs=nnx.Rngs(0))
        model.eval()
        cached, forward = cache_and_forward_logits(model, full, lengths, steps=4)
    np.testing.assert_allclose(cached, forward[np.arange(2), lengths + 3], atol=2e-5,
                               rtol=2e-5)


@pytest.mark.slow
def test_layer_windows_bad_input():
    with pytest.raises(ValueError, match=r"layer_windows=\(3, None\) with num_layers=3"):
        _config(layer_windows=(3, None))
    with pytest.raises(ValueError, match=r"layer_windows\[1\]=0"):
        _config(layer_windows=(3, 0, None))
    with pytest.raises(ValueError, match="sliding_window=4 and layer_windows both set"):
        _config(layer_windows=WINDOWS, sliding_window=4)
    assert _config(layer_windows=[3, None, 5]).layer_windows == WINDOWS


def test_qwen_max_window_layers_read_and_written():
    from sp_jax.models import hf

    base = hf.config_to_hf(_config(qkv_bias=True, out_bias=False, mlp_bias=False,
                                   mlp_activation="swiglu", num_kv_heads=4))
    for extra in ({"max_window_layers": 1, "layer_types": None},
                  {"layer_types": ["full_attention", "sliding_attention",
                                   "sliding_attention"]}):
        got = hf.config_from_hf({**base, "model_type": "qwen2", "use_sliding_window": True,
                                 "sliding_window": 4, **extra})
        assert got.layer_windows == (None, 4, 4) and got.sliding_window is None
        back = hf.config_to_hf(got)
        assert back["layer_types"] == ["full_attention", "sliding_attention",
                                       "sliding_attention"]
        assert (back["sliding_window"], back["max_window_layers"]) == (4, 1)

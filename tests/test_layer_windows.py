"""Per-layer attention windows (``GPTConfig.layer_windows``): each layer's window is data
(a scanned int32 per layer), against an unrolled model whose layers each hold their own
static ``sliding_window`` (the kernels' static path), sharded and not, forward, gradients
and generation's KV cache; with ring attention (the ring kernel's traced window) and on
pipeline stages (each chunk's windows handed to it with its dropout keys), and head_dim
apart from hidden / heads on pipeline stages, against the unpipelined, unsharded model."""

from __future__ import annotations

import dataclasses

import chex
import jax
import numpy as np
import pytest
from _util import cache_and_forward_logits, compiled_logits, slow_except, to_host, train_gpt
from conftest import make_mesh
from flax import nnx
from jax.sharding import AxisType

from sp_jax import ParallelConfig
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
        want_logits = np.asarray(compiled_logits(ref, tokens[:, :-1]))
        want_loss, want_grads = _loss_and_grads(ref, tokens)
        # the windows matter: full attention everywhere differs
        full = GPT(_config(), rngs=nnx.Rngs(0))
        assert np.abs(np.asarray(compiled_logits(full, tokens[:, :-1])) - want_logits).max() > 1e-3
    with jax.set_mesh(make_mesh(*shape)):
        model = GPT(_config(layer_windows=WINDOWS, scan_layers=scan), rngs=nnx.Rngs(0))
        got_logits = np.asarray(compiled_logits(model, tokens[:, :-1]))
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


# -- ring attention and pipeline stages --------------------------------------------------


def _axes_mesh(shape, axes):
    return jax.make_mesh(shape, axes, axis_types=(AxisType.Explicit,) * len(shape),
                         devices=jax.devices()[:int(np.prod(shape))])


@pytest.mark.slow  # the traced-window ring kernel's fast case: test_attention_softcap.py
@pytest.mark.parametrize("scan", [False, True])
def test_layer_windows_with_ring_attention(scan):
    """Ring attention (the traced-window path of the ring kernel) on a (data, context,
    tensor) = (2, 2, 2) mesh: 16 tokens in zigzag chunks of 4, windows of 3 (inside a
    chunk and its neighbour) and 5 (across chunk boundaries) against the unsharded
    unrolled model with static windows: logits, loss and gradients (fp32, 1e-5)."""
    tokens = jax.random.randint(jax.random.key(3), (2, 17), 0, 64)
    with jax.set_mesh(make_mesh(1, 1)):
        ref = _static_reference()
        want_logits = np.asarray(compiled_logits(ref, tokens[:, :-1]))
        want_loss, want_grads = _loss_and_grads(ref, tokens)
    with jax.set_mesh(_axes_mesh((2, 2, 2), ("data", "context", "tensor"))):
        model = GPT(_config(layer_windows=WINDOWS, scan_layers=scan),
                    parallel=ParallelConfig(context_parallel="ring"), rngs=nnx.Rngs(0))
        got_logits = to_host(compiled_logits(model, tokens[:, :-1]))
        got_loss, got_grads = _loss_and_grads(model, tokens)
    np.testing.assert_allclose(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert got_loss == pytest.approx(want_loss, abs=1e-5)
    for name in ("q_kernel", "kv_kernel"):
        want = np.stack([to_host(want_grads["blocks"][i]["attention"]["qkv"][name][...])
                         for i in range(3)])
        got = to_host(got_grads["blocks"]["attention"]["qkv"][name][...]) if scan else \
            np.stack([to_host(got_grads["blocks"][i]["attention"]["qkv"][name][...])
                      for i in range(3)])
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4, err_msg=name)


PIPE_BASE = dict(vocab_size=61, max_seq_len=16, num_layers=4, num_heads=4, hidden=16,
                 mlp_hidden=32, scan_layers=True, positions="rotary", attention_block_q=4,
                 attention_block_k=4)
PIPE_AXES = ("stage", "data", "context", "tensor")
PIPE_WINDOWS = (3, None, 5, None)
PIPE_CASES = {  # id: (mesh, schedule, repeats, micro-batches, model options, parallel options)
    # stage 0 holds layers 0, 1 (windows 3, full), stage 1 layers 2, 3 (5, full)
    "windows_2x1x1x4_1f1b_r1_m4": ((2, 1, 1, 4), "1f1b", 1, 4,
                                   {"layer_windows": PIPE_WINDOWS}, {}),
    # circular: stage 0 runs layers 0 and 2 (windows 3, 5), stage 1 the full ones; ring
    "windows_2x1x2x2_ring_gpipe_r2_m4": ((2, 1, 2, 2), "gpipe", 2, 4,
                                         {"layer_windows": PIPE_WINDOWS, "num_kv_heads": 2},
                                         {"context_parallel": "ring"}),
    # Gemma 3's block in stages: every Gemma field, the local rotary base by window
    "gemma_2x1x1x4_1f1b_r1_m4": ((2, 1, 1, 4), "1f1b", 1, 4, {
        "layer_windows": PIPE_WINDOWS, "head_dim": 8, "num_kv_heads": 2, "qk_norm": True,
        "norm": "rmsnorm", "norm_offset": 1.0, "post_norms": True, "scale_embeddings": True,
        "mlp_activation": "geglu_tanh", "attention_scale": 0.3, "attention_softcap": 5.0,
        "final_logit_softcap": 3.0, "rope_local_base": 100.0, "rope_base": 10000.0}, {}),
    # head_dim 8 apart from hidden / heads (16 / 4 = 4): q 32 wide, o 32 -> 16
    "head_dim8_2x2x1x2_1f1b_r1_m4": ((2, 2, 1, 2), "1f1b", 1, 4,
                                     {"head_dim": 8, "num_kv_heads": 2}, {}),
}


def _pipe_batches(micro, steps=3, batch=8):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, PIPE_BASE["vocab_size"], (steps, batch, 17)).astype(np.int32)
    return [{"tokens": t[:, :-1].reshape(micro, batch // micro, 16),
             "labels": t[:, 1:].reshape(micro, batch // micro, 16)} for t in tokens]


def _in_layer_order(values):
    """Host values with the stacked blocks ``[L, ...]`` (a circular pipeline stores them
    ``[R, L / R, ...]``, in layer order)."""
    layers = PIPE_BASE["num_layers"]
    return {**values, "blocks": jax.tree.map(
        lambda x: x.reshape(layers, *x.shape[2:]) if x.shape[:1] != (layers,) else x,
        values["blocks"])}


@pytest.mark.parametrize("case", slow_except(PIPE_CASES))  # fast: test_pipeline*.py
def test_pipeline_stages_with_layer_windows_and_head_dim(case):
    """A pipelined GPT (scanned blocks sliced over 2 stages) with per-layer windows (each
    stage's windows travel with its slice of the layers), with ring attention inside the
    stages, with every Gemma field (Gemma 3's block), and with head_dim apart from hidden /
    heads: 3 AdamW steps' losses and final parameters against the unpipelined, unsharded
    model's (fp32, 1e-5)."""
    shape, kind, repeats, micro, model_kw, parallel_kw = PIPE_CASES[case]
    cfg = GPTConfig(**{**PIPE_BASE, **model_kw})
    parallel = ParallelConfig(pipeline_axis="stage", pipeline_microbatches=micro,
                              pipeline_schedule=kind, pipeline_repeats=repeats,
                              **parallel_kw)
    batches = _pipe_batches(micro)
    init, losses, params, _ = train_gpt(cfg, parallel, _axes_mesh(shape, PIPE_AXES), batches)
    _, want_losses, want_params, _ = train_gpt(cfg, ParallelConfig(), make_mesh(1, 1),
                                               batches, init=_in_layer_order(init))
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(_in_layer_order(params), want_params, rtol=1e-5, atol=1e-5)
    if "layer_windows" in model_kw:  # the windows matter
        _, full_losses, _, _ = train_gpt(dataclasses.replace(cfg, layer_windows=None),
                                         ParallelConfig(), make_mesh(1, 1), batches[:1],
                                         init=_in_layer_order(init))
        assert abs(full_losses[0] - want_losses[0]) > 1e-4


@pytest.mark.slow
def test_pipelined_forward_with_layer_windows_and_dropout():
    """``GPT.loss`` and ``model(tokens)`` of a circular pipeline (2 stages, 2 repeats)
    with per-layer windows, a batch of 3 rows (run as one micro-batch, filled with an
    empty one), in train mode with dropout (the dropout keys and the windows travel
    together per layer) and in eval mode: the unpipelined model's (1e-5)."""
    cfg = GPTConfig(**{**PIPE_BASE, "layer_windows": PIPE_WINDOWS, "dropout": 0.1,
                       "attention_dropout": 0.1})
    tokens = np.random.default_rng(1).integers(0, PIPE_BASE["vocab_size"], (3, 16))
    tokens = tokens.astype(np.int32)
    got = {}
    for name, par in (("flat", ParallelConfig()),
                      ("piped", ParallelConfig(pipeline_axis="stage", pipeline_microbatches=2,
                                               pipeline_repeats=2))):
        with jax.set_mesh(_axes_mesh((2, 1, 1, 2), PIPE_AXES)):
            model = GPT(cfg, parallel=par, rngs=nnx.Rngs(0))
            run = nnx.jit(lambda m, t: (m.loss(t, rngs=nnx.Rngs(dropout=jax.random.key(3))),
                                        m(t, rngs=nnx.Rngs(dropout=jax.random.key(4)))))
            train = run(model, tokens)
            model.eval()
            got[name] = to_host((train, run(model, tokens)))
    chex.assert_trees_all_close(got["piped"], got["flat"], rtol=1e-5, atol=1e-5)

"""The SP GPT trains exactly like the same model unsharded (the reference system's
SP-vs-DP acceptance test), in fp32 and under mixed precision."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import param_values, slow_except, to_host, train_gpt
from conftest import make_mesh
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import sp_jax
from sp_jax.models import GPT, GPTConfig

B, S, STEPS = 8, 16, 5
BASE = dict(vocab_size=64, max_seq_len=S, num_layers=2, num_heads=4, hidden=32)


def _batches(vocab, steps=STEPS, batch=B, micro=1, ignore_every=0, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        # learnable sequences: arithmetic progressions mod vocab with a few step sizes
        start = rng.integers(0, vocab, size=(batch, 1))
        stride = rng.integers(1, 4, size=(batch, 1))
        tokens = ((start + stride * np.arange(S + 1)) % vocab).astype(np.int32)
        x, y = tokens[:, :-1], tokens[:, 1:].copy()
        if ignore_every:  # uneven numbers of target tokens per sequence
            y[rng.random(y.shape) < 1.0 / ignore_every] = -100
        out.append({"tokens": x.reshape(micro, batch // micro, S),
                    "labels": y.reshape(micro, batch // micro, S)})
    return out


AUTO = AxisType.Auto
LLAMA_SCALING = dict(factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8)
# id: (model options, [(mesh shape, parallel options[, mesh axis type]), ...]): every run
# is compared with ONE unsharded run of the model from the same weights and batches.
CASES = {
    # (fsdp: tests/test_fsdp.py, and below with other options)
    "fp32": ({}, [((2, 4), {}), ((2, 4), {}, AUTO),
                  ((2, 4), dict(collective_matmul=True, recompute_allgather=True))]),
    "scan_remat_dropout": (dict(scan_layers=True, remat=True, dropout=0.1,
                                attention_dropout=0.1),
                           [((2, 4), dict(recompute_allgather=True))]),
    "vocab_50": (dict(vocab_size=50), [((2, 4), {})]),
    # Llama-shaped (RMSNorm, SwiGLU, rotary with Llama-3.1 scaling, no biases, untied
    # head): 8 query heads over 2 key/value heads on tensor size 4 (kv heads replicated
    # over pairs of shards), and over 4 on tensor size 2 with q/k/v biases; both with fsdp
    "llama_gqa_kv2_t4_vocab50": (dict(preset="llama", num_kv_heads=2, vocab_size=50,
                                      rope_scaling=LLAMA_SCALING),
                                 [((2, 4), {}), ((2, 4), dict(fsdp=True))]),
    "llama_gqa_kv4_t2_bias": (dict(preset="llama", num_kv_heads=4, qkv_bias=True),
                              [((4, 2), dict(fsdp=True))]),
    # head_dim apart from hidden / heads (16 with hidden 32 and 4 heads: q, k, v 64 wide,
    # the output projection 64 -> 32): multi-head with rotary on tensor size 4, and
    # Qwen3-shaped grouped-query (2 kv heads replicated over pairs of shards, q/k norm)
    "head_dim16_rotary": (dict(head_dim=16, positions="rotary"), [((2, 4), {})]),
    "llama_head_dim16_gqa_kv2_qk_norm": (dict(preset="llama", num_heads=4, num_kv_heads=2,
                                              head_dim=16, qk_norm=True),
                                         [((2, 4), {}), ((4, 2), dict(fsdp=True))]),
    "collective_matmul_scan_untied_50": (dict(scan_layers=True, tie_embeddings=False,
                                              vocab_size=50),
                                         [((4, 2), dict(collective_matmul=True, fsdp=True))]),
}


def _config(model_kw) -> GPTConfig:
    """``model_kw`` over BASE; ``preset="llama"``: over the Llama preset at test size."""
    model_kw = dict(model_kw)
    if model_kw.pop("preset", None) == "llama":
        return GPTConfig.llama("llama-tiny", **{**BASE, "num_heads": 8, "mlp_hidden": 64,
                                                **model_kw})
    return GPTConfig(**{**BASE, **model_kw})


@pytest.mark.parametrize("case", slow_except(CASES, "llama_gqa_kv2_t4_vocab50"))
def test_sp_gpt_trains_like_unsharded(case):
    model_kw, runs = CASES[case]
    cfg = _config(model_kw)
    batches = _batches(cfg.vocab_size)
    train_mode = max(cfg.dropout, cfg.attention_dropout) > 0
    init = ref_losses = ref_params = None
    for shape, parallel_kw, *axis_type in runs:
        mesh = make_mesh(*shape, *axis_type)
        got_init, losses, params, _ = train_gpt(cfg, sp_jax.ParallelConfig(**parallel_kw), mesh,
                                          batches, init=init, train_mode=train_mode)
        if init is None:  # the first run's initial weights, for every other run
            init = got_init
            _, ref_losses, ref_params, _ = train_gpt(cfg, sp_jax.ParallelConfig(), make_mesh(1, 1),
                                               batches, init=init, train_mode=train_mode)
        assert losses[-1] < losses[0]  # it trains
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5,
                                   err_msg=f"{shape} {parallel_kw} {axis_type}")
        chex.assert_trees_all_close(params, ref_params, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("rates", [dict(dropout=0.5), dict(attention_dropout=0.5)])
def test_dropout_changes_the_loss_in_train_mode_only(rates):
    """Residual and attention dropout: a fresh model is in train mode (documented);
    model.eval() turns both off."""
    cfg = GPTConfig(**{**BASE, **rates})
    tokens = _batches(64, steps=1)[0]["tokens"][0]
    loss = nnx.jit(lambda m, t, key: m.loss(t, rngs=nnx.Rngs(dropout=key)))
    with jax.set_mesh(make_mesh(2, 4)):
        model = GPT(cfg, rngs=nnx.Rngs(0))
        c = to_host(loss(model, tokens, jax.random.key(1)))  # fresh: train mode
        d = to_host(loss(model, tokens, jax.random.key(2)))
        model.eval()
        a = to_host(loss(model, tokens, jax.random.key(1)))
        b = to_host(loss(model, tokens, jax.random.key(2)))
        model.train()
        e = to_host(loss(model, tokens, jax.random.key(1)))
    assert a == b and c != a and c != d and e == c


@pytest.mark.slow
def test_logits_layout_and_padding(mesh_2x4):
    tokens = _batches(50, steps=1)[0]["tokens"][0]
    with jax.set_mesh(mesh_2x4):
        for vocab, spec in ((64, P("data", None, "tensor")), (50, P("data", "tensor", None))):
            model = GPT(GPTConfig(**{**BASE, "vocab_size": vocab}), rngs=nnx.Rngs(0))
            logits = nnx.jit(lambda m, t: m(t))(model, tokens)
            assert logits.shape == (B, S, vocab) and logits.sharding.spec == spec


# --------------------------------------------------------------------------------------
# Micro-batches
# --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_micro_batches_equal_one_large_batch():
    """4 micro-batches of 8 == one batch of 32, even with unevenly ignored tokens.

    SGD keeps the parameters a linear function of the gradients, so the comparison is as
    tight as the gradients' (Adam would turn fp32 rounding of near-zero gradient entries
    into +-lr steps)."""
    cfg = GPTConfig(**BASE)
    big = _batches(64, steps=3, batch=32, micro=1, ignore_every=5, seed=3)
    split = [{k: v.reshape(4, 8, S) for k, v in b.items()} for b in big]
    sgd = optax.sgd(0.5)
    init, losses, params, _ = train_gpt(cfg, sp_jax.ParallelConfig(), make_mesh(2, 4), big, tx=sgd)
    _, micro_losses, micro_params, _ = train_gpt(cfg, sp_jax.ParallelConfig(), make_mesh(2, 4),
                                           split, init=init, tx=sgd)
    assert not np.allclose(jax.tree.leaves(init)[0], jax.tree.leaves(params)[0])
    np.testing.assert_allclose(micro_losses, losses, rtol=1e-5, atol=1e-5)
    chex.assert_trees_all_close(micro_params, params, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------
# Mixed precision: bf16 compute, fp32 master weights, fp32 weight gradients
# --------------------------------------------------------------------------------------


def _global_norm(tree) -> float:
    return float(np.sqrt(sum(np.sum(np.square(x.astype(np.float64)))
                             for x in jax.tree.leaves(tree))))


@pytest.mark.slow
def test_amp_sp_gpt_matches_unsharded_under_same_policy():
    """bf16 compute + fp32 master weights + fp32 wgrad, sharded vs unsharded.

    Tolerance: bf16 keeps 8 significant bits, so every activation carries a relative
    rounding error of up to 2**-8. The sharded model rounds in other places (it sums
    partial products in another order, and the row layers reduce-scatter bf16 partial
    sums), so two correct bf16 runs differ by about one bf16 ulp of the loss: we allow
    ``rtol = 2**-8`` on the losses (a wiring bug moves the loss by far more). For the
    parameters, and as a second check on the losses, the sharded run must stay inside
    the error band bf16 itself opens around fp32: no further from the fp32 run than
    twice the unsharded bf16 run is, all measured here on the same weights and batches.
    """
    amp = GPTConfig(**{**BASE, "dtype": jnp.bfloat16, "param_dtype": jnp.float32})
    fp32 = GPTConfig(**BASE)
    policy = sp_jax.ParallelConfig(wgrad_dtype=jnp.float32)
    batches = _batches(64)
    init, sp, sp_params, _ = train_gpt(amp, policy, make_mesh(2, 4), batches)
    _, ref, ref_params, _ = train_gpt(amp, policy, make_mesh(1, 1), batches, init=init)
    _, full, full_params, _ = train_gpt(fp32, policy, make_mesh(1, 1), batches, init=init)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(sp_params))  # fp32 master
    np.testing.assert_allclose(sp, ref, rtol=2**-8)
    band = np.abs(ref - full).max()
    assert 0 < np.abs(sp - full).max() <= 2 * band
    dist = lambda a, b: _global_norm(jax.tree.map(np.subtract, a, b))  # noqa: E731
    assert dist(sp_params, full_params) <= 2 * dist(ref_params, full_params)


@pytest.mark.slow
def test_fp32_wgrad_is_closer_to_fp32_than_bf16_autodiff(mesh_2x4):
    """ColumnSequenceParallelLinear in bf16: dW with wgrad_dtype=float32 vs plain bf16
    autodiff, both against the fp32 layer (bf16-representable inputs, so the only
    difference left is how dW is accumulated)."""
    rng = np.random.default_rng(0)
    x = np.asarray(jnp.asarray(rng.normal(size=(8, 64, 32)), jnp.bfloat16), np.float32)
    probe = np.asarray(jnp.asarray(rng.normal(size=(8, 64, 64)), jnp.bfloat16), np.float32)

    def dkernel(dtype, wgrad_dtype):
        cfg = sp_jax.ParallelConfig(wgrad_dtype=wgrad_dtype)
        with jax.set_mesh(mesh_2x4):
            layer = sp_jax.ColumnSequenceParallelLinear(32, 64, dtype=dtype, parallel=cfg,
                                                        rngs=nnx.Rngs(0))
            g = nnx.jit(nnx.grad(
                lambda m, x: jnp.sum(m(x).astype(jnp.float32) * probe)))(layer, x)
        return to_host(g.kernel[...])

    exact = dkernel(jnp.float32, None)
    fused = dkernel(jnp.bfloat16, jnp.float32)
    plain = dkernel(jnp.bfloat16, None)
    assert fused.dtype == plain.dtype == np.float32
    err_fused, err_plain = np.abs(fused - exact).max(), np.abs(plain - exact).max()
    assert err_fused < err_plain / 10, (err_fused, err_plain)


def _merged_loss(graphdef, rest, params, tokens):
    return nnx.merge(graphdef, params, rest).loss(tokens, tokens)


@pytest.mark.slow
def test_remat_gives_the_same_gradients_with_less_saved_memory(mesh_2x4):
    from sp_jax.analysis import saved_activation_bytes

    tokens = _batches(64, steps=1)[0]["tokens"][0]
    grads, saved = {}, {}
    for remat in (False, True):
        with jax.set_mesh(mesh_2x4):
            model = GPT(GPTConfig(**{**BASE, "remat": remat}), rngs=nnx.Rngs(0))
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            loss = functools.partial(_merged_loss, graphdef, rest)
            grads[remat] = to_host(nnx.to_pure_dict(jax.jit(jax.grad(loss))(params, tokens)))
            saved[remat] = saved_activation_bytes(loss, params, tokens)
    chex.assert_trees_all_close(grads[True], grads[False], rtol=1e-6, atol=1e-6)
    assert saved[True] < saved[False]


CONFIG_ERRORS = [  # (fields, the error's words)
        (dict(hidden=30), "hidden=30 must be divisible by num_heads=4"),
        (dict(num_layers=0), "num_layers=0 must be a positive int"),
        (dict(head_dim=0), r"head_dim=0 must be a positive int"),
        (dict(head_dim=6.0), r"head_dim=6.0 must be a positive int"),
        (dict(head_dim=7, positions="rotary"), "even head size, got head_dim=7"),
        (dict(positions="alibi"), "positions='alibi'"),
        (dict(dropout=1.0), "dropout=1.0"),
        (dict(mlp_activation="swish"), r"mlp_activation='swish' is not a known activation; "
                                       r"use one of \['geglu', 'geglu_tanh', 'gelu', "
                                       r"'gelu_exact', 'relu'"),
        (dict(attention_softcap=0.0), r"attention_softcap=0.0 must be None or a positive"),
        (dict(rope_local_base=-1.0), r"rope_local_base=-1.0 must be None or a positive"),
]


def test_gpt_config_errors():
    """Each of CONFIG_ERRORS (one test: they cost no compile) raises one ValueError naming
    the field."""
    for kwargs, match in CONFIG_ERRORS:
        with pytest.raises(ValueError, match=match):
            GPTConfig(**{**BASE, **kwargs})


def test_gpt_input_errors(mesh_2x4):
    with jax.set_mesh(mesh_2x4):
        model = GPT(GPTConfig(**BASE), rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="exceeds max_seq_len=16"):
            model(np.zeros((B, 32), np.int32))
        with pytest.raises(TypeError, match="GPT: token ids must be integers, got dtype float32"):
            model(np.zeros((B, S), np.float32))
        with pytest.raises(ValueError, match=r"GPT expects token ids of shape \[batch, seq\], "
                                             r"got rank 1"):
            model(np.zeros((S,), np.int32))
        with pytest.raises(ValueError, match=r"num_heads=6 is not divisible"):
            GPT(GPTConfig(**{**BASE, "num_heads": 6, "hidden": 48}), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="Unknown GPTConfig key"):
        GPTConfig.from_dict({**BASE, "n_layer": 2})


@pytest.mark.slow
def test_scan_layers_equals_unrolled_layers(mesh_2x4):
    """scan_layers stacks the same initial values and computes the same loss/gradients."""
    tokens = _batches(64, steps=1)[0]["tokens"][0]
    out = {}
    with jax.set_mesh(mesh_2x4):
        for scan in (False, True):
            model = GPT(GPTConfig(**{**BASE, "num_layers": 3, "dropout": 0.1,
                                     "scan_layers": scan}), rngs=nnx.Rngs(0))
            model.train()
            loss, g = nnx.jit(nnx.value_and_grad(
                lambda m, t: m.loss(t, t, rngs=nnx.Rngs(dropout=3))))(model, tokens)
            out[scan] = (float(loss), param_values(model),
                         to_host(nnx.to_pure_dict(nnx.state(g))))
        kernel = model.blocks.mlp.up.kernel
        assert kernel[...].shape == (3, 32, 128)
        assert kernel[...].sharding.spec == P(None, None, "tensor")
    stack = lambda tree: jax.tree.map(lambda *xs: np.stack(xs), *tree.values())  # noqa: E731
    assert out[True][0] == pytest.approx(out[False][0], rel=1e-6)
    chex.assert_trees_all_equal(out[True][1]["blocks"], stack(out[False][1]["blocks"]))
    chex.assert_trees_all_close(out[True][2]["blocks"], stack(out[False][2]["blocks"]),
                                rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_token_ids_and_labels_of_any_integer_dtype(mesh_2x4):
    """Byte data as uint8 ids with a vocabulary of 256 (the bound does not fit uint8) and
    other integer dtypes give the int32 loss; shifted and explicit labels alike."""
    cfg = GPTConfig(**{**BASE, "vocab_size": 256, "num_layers": 1})
    tokens = np.random.default_rng(0).integers(0, 256, (B, S + 1)).astype(np.int32)
    tokens[0, :4] = 255, 0, 255, 128  # the ends of the byte range
    with jax.set_mesh(mesh_2x4):
        model = GPT(cfg, rngs=nnx.Rngs(0))
        shifted = nnx.jit(lambda m, t: m.loss(t[:, 1:]))
        explicit = nnx.jit(lambda m, t: m.loss(t[:, :-1], t[:, 1:]))
        want = float(shifted(model, tokens)), float(explicit(model, tokens))
        for dtype in (np.uint8, np.uint16, np.int16, np.uint32):
            got = float(shifted(model, tokens.astype(dtype))), \
                float(explicit(model, tokens.astype(dtype)))
            assert np.isfinite(got).all() and got == pytest.approx(want, rel=1e-6), dtype

"""Multi-token prediction (``GPTConfig.mtp_depth``): the MTP loss equals a NumPy
transcription of DeepSeek-V3's modules on one device; the sharded model's loss and
gradients (tensor + sequence, context ring / Ulysses, scanned and unrolled) equal the
unsharded model's (fp32, 1e-5); speculative decoding with the modules gives plain greedy
decoding's tokens."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import compiled_loss, copy_weights, param_values, slow_except, to_host
from flax import nnx
from jax.sharding import AxisType

import sp_jax
from sp_jax.models import GPT, GPTConfig, generate
from sp_jax.training import TrainStep

B, S, V = 4, 16, 64


def _config(**overrides) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=V, max_seq_len=S, num_layers=2, num_heads=4,
                               hidden=32, positions="rotary", norm="rmsnorm",
                               mlp_activation="swiglu", mlp_bias=False, out_bias=False,
                               attention_block_q=4, attention_block_k=4, mtp_depth=2,
                               mtp_loss_weight=0.5), **overrides})


def _mesh(data=1, context=1, tensor=1):
    return jax.make_mesh((data, context, tensor), ("data", "context", "tensor"),
                         axis_types=(AxisType.Explicit,) * 3,
                         devices=jax.devices()[:data * context * tensor])


def _parallel(context=None, **options):
    if context is None:
        return sp_jax.ParallelConfig(**options)
    return sp_jax.ParallelConfig(context_axis="context", context_parallel=context, **options)


def _tokens(seed=0):
    return np.random.default_rng(seed).integers(0, V, (B, S)).astype(np.int32)


def _rms(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * np.asarray(w, np.float64)


def _ce(logits, targets, ignore=-100):
    logits = np.asarray(logits, np.float64)
    keep = targets != ignore
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, np.where(keep, targets, 0)[..., None], -1)[..., 0]
    return -(picked * keep).sum() / max(keep.sum(), 1)


@pytest.mark.slow  # make test-fast's budget (46 s on 2 cores); the MTP loss's fast check:
# test_train_step_reports_the_mtp_loss
def test_mtp_loss_equals_numpy_transcription():
    """One device: ``loss - lm_loss`` is ``mtp_loss_weight`` times the mean over depths
    of the cross-entropies of a NumPy transcription of DeepSeek-V3's MTP (the shifted
    embedding, enorm / hnorm, the [e; h] concatenation, eh_proj, the block, post_norm,
    the shared head, targets ``t_{i+k+1}``); the block is the module's own Block."""
    cfg = _config()
    tokens = _tokens()
    with jax.set_mesh(_mesh()):
        model = GPT(cfg, parallel=_parallel(), rngs=nnx.Rngs(0))
        loss, metrics = compiled_loss(model, tokens)
        h = np.asarray(nnx.jit(lambda m, t: m.hidden_states(t))(model, tokens),
                       np.float64)  # final-normed
        table = np.asarray(model.embed.embedding[...], np.float64)
        eps = cfg.norm_epsilon
        losses = []
        for k, module in enumerate(model.mtp, start=1):
            shifted = np.concatenate([tokens[:, k:], np.zeros((B, k), np.int32)], 1)
            e = table[shifted]
            x = np.concatenate([_rms(e, module.enorm.scale[...], eps),
                                _rms(h, module.hnorm.scale[...], eps)], -1)
            x = x @ np.asarray(module.eh_proj[...], np.float64)
            x = np.asarray(module.block(jnp.asarray(x, jnp.float32)), np.float64)
            h = _rms(x, module.post_norm.scale[...], eps)
            targets = np.concatenate([tokens[:, k + 1:], np.full((B, k + 1), -100)], 1)
            losses.append(_ce(h @ table.T, targets))
    np.testing.assert_allclose(float(metrics["mtp_loss"]), np.mean(losses), rtol=1e-5)
    np.testing.assert_allclose(float(loss), float(metrics["lm_loss"]) + 0.5 * np.mean(losses),
                               rtol=1e-5)


@pytest.mark.slow  # make test-fast's budget (35 s on 2 cores)
def test_depth_zero_keeps_the_loss_and_parameters():
    """``mtp_depth=0`` builds no modules, and the main loss of a model with them is the
    loss of the same model without (the modules only add a term)."""
    tokens = _tokens(1)
    with jax.set_mesh(_mesh()):
        with_mtp = GPT(_config(), parallel=_parallel(), rngs=nnx.Rngs(0))
        without = GPT(_config(mtp_depth=0), parallel=_parallel(), rngs=nnx.Rngs(0))
        assert without.mtp is None and "mtp" not in param_values(without)
        values = param_values(with_mtp)
        del values["mtp"]
        copy_weights(without, values)
        _, metrics = compiled_loss(with_mtp, tokens)
        loss, _ = compiled_loss(without, tokens)
        np.testing.assert_allclose(float(loss), float(metrics["lm_loss"]), rtol=1e-6)


def _loss_and_grads(model, tokens, segment_ids=None, positions=None):
    def f(m):
        return m.loss(tokens, segment_ids=segment_ids, positions=positions,
                      return_metrics=True)
    (loss, metrics), grads = nnx.jit(nnx.value_and_grad(f, has_aux=True))(model)
    return float(loss), float(metrics["mtp_loss"]), to_host(nnx.to_pure_dict(grads))


MESHES = {  # (data, context, tensor), context parallelism, config overrides
    "data2_context2_tensor2_ring": ((2, 2, 2), "ring", {}),
    "data2_context2_tensor2_ulysses_scan": ((2, 2, 2), "ulysses", dict(scan_layers=True)),
    "tensor4_remat": ((1, 1, 4), None, dict(remat=True)),
    "context4_ring_scan": ((1, 4, 2), "ring", dict(scan_layers=True)),
}


@pytest.mark.slow  # 63 s on 2 busy cores: the fast tier has the NumPy transcription
@pytest.mark.parametrize("name", list(MESHES))
@pytest.mark.parametrize("documents", [False, True])
def test_sharded_mtp_loss_and_grads_equal_unsharded(name, documents):
    """Loss, MTP loss and every gradient on a sharded mesh equal the one-device model's
    (fp32, 1e-5): the shifted embeddings cross the sequence shards (zigzag with the
    ring) as the unsharded shift; with packed documents no depth's target crosses a
    document."""
    shape, context, overrides = MESHES[name]
    cfg = _config(**overrides)
    tokens = _tokens(2)
    segment_ids = positions = None
    if documents:
        segment_ids = np.repeat(np.array([[1] * 7 + [2] * 6 + [0] * 3]), B, 0).astype(np.int32)
        positions = np.repeat(np.array([list(range(7)) + list(range(6)) + [0] * 3]), B,
                              0).astype(np.int32)
    with jax.set_mesh(_mesh()):
        ref = GPT(cfg, parallel=_parallel(), rngs=nnx.Rngs(0))
        want = _loss_and_grads(ref, tokens, segment_ids, positions)
        init = param_values(ref)
    with jax.set_mesh(_mesh(*shape)):
        model = GPT(cfg, parallel=_parallel(context), rngs=nnx.Rngs(1))
        copy_weights(model, init)
        got = _loss_and_grads(model, tokens, segment_ids, positions)
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-5)
    chex.assert_trees_all_close(got[2], want[2], rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(got[2]["mtp"][1]["eh_proj"])).max() > 0  # the last depth trains


def test_train_step_reports_the_mtp_loss():
    """TrainStep's metrics carry ``lm_loss`` and ``mtp_loss``; their weighted sum is the
    loss, and a few steps lower both."""
    cfg = _config(mtp_depth=1)
    mesh = _mesh(2, 1, 2)
    with jax.set_mesh(mesh):
        model = GPT(cfg, parallel=_parallel(), rngs=nnx.Rngs(0))
        step = TrainStep(model, optax.adamw(1e-2))
        tokens = np.tile(np.arange(S, dtype=np.int32) % 8, (B, 1))
        batch = {"tokens": tokens[None], "labels": np.concatenate(
            [tokens[:, 1:], np.full((B, 1), -100, np.int32)], 1)[None]}
        metrics = [to_host(step(batch, jax.random.key(i))) for i in range(6)]
    first, last = metrics[0], metrics[-1]
    np.testing.assert_allclose(first["loss"], first["lm_loss"] + 0.5 * first["mtp_loss"],
                               rtol=1e-5)
    assert last["mtp_loss"] < first["mtp_loss"] and last["lm_loss"] < first["lm_loss"]


PROMPTS = [[3, 4, 5, 6, 7], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28]]


def _trained(cfg, mesh, parallel, steps):
    """A model trained ``steps`` AdamW steps on rows counting up (``t_{i+1} = t_i + 1``):
    what the main model and the MTP modules can learn in a few steps."""
    with jax.set_mesh(mesh):
        model = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0))
        step = TrainStep(model, optax.adamw(1e-2))
        rng = np.random.default_rng(0)
        for i in range(steps):
            tokens = ((rng.integers(0, V, (B, 1)) + np.arange(S)) % V).astype(np.int32)
            labels = np.concatenate([tokens[:, 1:], np.full((B, 1), -100, np.int32)], 1)
            step({"tokens": tokens[None], "labels": labels[None]}, jax.random.key(i))
        return copy_weights(model, to_host(nnx.to_pure_dict(step.params)))


SPECULATIVE = {"depth1_one_device": (1, (1, 1, 1), None),
               "depth2_data2_context2_tensor2_ring": (2, (2, 2, 2), "ring"),
               "depth2_tensor2": (2, (1, 1, 2), None)}


@pytest.mark.parametrize("name", slow_except(SPECULATIVE, "depth1_one_device"))
def test_speculative_mtp_equals_greedy(name):
    """``generate(..., speculative="mtp")`` gives plain greedy decoding's tokens on 3
    ragged prompts, and after a few training steps the modules' drafts are accepted
    (mean accepted drafts per step > 0)."""
    depth, shape, context = SPECULATIVE[name]
    cfg = _config(mtp_depth=depth, max_seq_len=64)
    mesh, parallel = _mesh(*shape), _parallel(context)
    model = _trained(cfg, mesh, parallel, 40)
    with jax.set_mesh(mesh):
        want = generate(model, PROMPTS, max_new_tokens=16)
        got = generate(model, PROMPTS, max_new_tokens=16, speculative="mtp")
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.lengths, want.lengths)
    assert got.accepted_drafts > 0 and got.steps < 16


@pytest.mark.slow  # the fast tier has the speculative tokens on one device
def test_speculative_step_verifies_the_drafts_in_one_forward(monkeypatch):
    """The main model and each MTP module run once on the ``D + 1`` tokens of a step
    (each layer's weights read once, not once per position): every attention call the
    speculative step traces has ``D + 1`` query tokens a row, except the drafting chain's
    one-token calls (modules ``2 .. D``); the tokens are greedy's."""
    from sp_jax.layers import attention as attention_module
    from sp_jax.models import speculative

    depth, seen = 2, []

    def recording(q, *args, **kwargs):
        seen.append(q.shape[1])
        return real(q, *args, **kwargs)

    real = attention_module.cached_attention
    cfg = _config(mtp_depth=depth, max_seq_len=64)
    with jax.set_mesh(_mesh()):
        model = GPT(cfg, parallel=_parallel(), rngs=nnx.Rngs(0))
        want = generate(model, PROMPTS, max_new_tokens=6)
        speculative.programs.cache_clear()
        monkeypatch.setattr(attention_module, "cached_attention", recording)
        got = generate(model, PROMPTS, max_new_tokens=6, speculative="mtp")
    np.testing.assert_array_equal(got.tokens, want.tokens)
    # traced once each: the prefill's drafting chain (module 2: one token), the step's
    # main model (each of its layers, unrolled) and modules (D + 1 tokens), its chain
    one, verify = [1] * (depth - 1), [depth + 1] * (cfg.num_layers + depth)
    assert seen == one + verify + one, seen


def test_speculative_refusals():
    """speculative='mtp' needs MTP modules and greedy decoding."""
    with jax.set_mesh(_mesh()):
        plain = GPT(_config(mtp_depth=0), parallel=_parallel(), rngs=nnx.Rngs(0))
        with pytest.raises(ValueError, match="mtp_depth"):
            generate(plain, PROMPTS, max_new_tokens=2, speculative="mtp")
        with pytest.raises(ValueError, match="speculative="):
            generate(plain, PROMPTS, max_new_tokens=2, speculative="medusa")

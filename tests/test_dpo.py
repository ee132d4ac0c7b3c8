"""Direct Preference Optimization (``sp_jax.training.dpo_loss``): summed completion
log-probabilities equal a NumPy log-softmax of the model's logits; the loss and its
gradient equal TRL's ``DPOTrainer`` definition (``loss_type="sigmoid"``: ``-log
sigmoid(beta * ((pc - rc) - (pr - rr)))``, the mean over pairs, the reference the PEFT
model with its adapter disabled) computed by torch on the transformers model with the
adapter sp_jax exports; a training step lowers the loss."""

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _util import compiled_logits, perturb_adapters
from conftest import make_mesh
from flax import nnx

import sp_jax
from sp_jax.layers.lora import LoRAParam
from sp_jax.models import hf
from sp_jax.training import TrainStep, dpo_loss, dpo_pair_losses

pytestmark = pytest.mark.slow

FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "hf"
LORA = sp_jax.LoRAConfig(rank=4, alpha=8)
BETA = 0.5
S = 16


def _pairs(vocab: int, n: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """``n`` pairs: a shared prompt of 3..6 tokens, two completions of 2..8 tokens, rows
    padded to ``S``; labels aligned with the positions, -100 on the prompt and padding."""
    rng = np.random.default_rng(seed)
    out = {k: np.zeros((n, S), np.int32) for k in ("chosen_tokens", "rejected_tokens")}
    out |= {k: np.full((n, S), -100, np.int32) for k in ("chosen_labels", "rejected_labels")}
    for i in range(n):
        prompt = rng.integers(1, vocab, rng.integers(3, 7))
        for side in ("chosen", "rejected"):
            ids = np.concatenate([prompt, rng.integers(1, vocab, rng.integers(2, 9))])
            out[f"{side}_tokens"][i, :len(ids)] = ids
            out[f"{side}_labels"][i, len(prompt) - 1:len(ids) - 1] = ids[len(prompt):]
    return out


def _model():
    model = hf.from_hf(FIXTURES / "llama", lora=LORA)
    perturb_adapters(model, scale=0.05)
    return model


def test_sequence_log_probs_are_the_completion_sums():
    with jax.set_mesh(make_mesh(2, 4)):
        model = _model()
        batch = _pairs(model.config.vocab_size)
        tokens, labels = batch["chosen_tokens"], batch["chosen_labels"]
        got = np.asarray(nnx.jit(lambda m, t, y: m.sequence_log_probs(t, y))(
            model, jnp.asarray(tokens), jnp.asarray(labels)))
        logits = np.asarray(compiled_logits(model, jnp.asarray(tokens)), np.float64)
    logits = logits[..., :model.config.vocab_size]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(
        -1, keepdims=True)) - logits.max(-1, keepdims=True)
    mask = labels != -100
    want = np.where(mask, np.take_along_axis(logp, np.where(mask, labels, 0)[..., None],
                                             -1)[..., 0], 0).sum(1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_pair_losses_formula():
    pc, pr, rc, rr = (np.array(v, np.float32) for v in ([-3., -5.], [-4., -2.],
                                                        [-3.5, -5.], [-3.5, -2.5]))
    losses, m = dpo_pair_losses(pc, pr, rc, rr, beta=0.2, label_smoothing=0.1)
    z = 0.2 * ((pc - pr) - (rc - rr))
    want = 0.9 * np.log1p(np.exp(-z)) + 0.1 * np.log1p(np.exp(z))
    np.testing.assert_allclose(np.asarray(losses), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(m["rewards_chosen"]), 0.2 * (pc - rc), rtol=1e-6)


def _sp_jax_loss_and_grads(model, batch):
    def loss(m):
        total, count, _ = dpo_loss(m, batch, jax.random.key(0), beta=BETA)
        return total / count
    return nnx.jit(nnx.value_and_grad(loss, argnums=nnx.DiffState(0, LoRAParam)))(model)


def test_dpo_loss_and_gradient_equal_trl_definition(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from safetensors.numpy import load_file

    with jax.set_mesh(make_mesh(2, 4)):
        model = _model()
        model.eval()
        batch = {k: jnp.asarray(v) for k, v in _pairs(model.config.vocab_size).items()}
        loss, grads = _sp_jax_loss_and_grads(model, batch)
        hf.to_peft(model, tmp_path / "adapter")
        nnx.update(model, grads)  # the gradients written out as PEFT names them
        hf.to_peft(model, tmp_path / "grads")
    base = transformers.AutoModelForCausalLM.from_pretrained(FIXTURES / "llama",
                                                             dtype=torch.float32)
    policy = peft.PeftModel.from_pretrained(base, tmp_path / "adapter", is_trainable=True)
    policy.eval()

    def logps(tokens, labels):  # TRL: the completion tokens' log-probabilities, summed
        logits = policy(input_ids=torch.from_numpy(np.asarray(tokens, np.int64))).logits
        labels = torch.from_numpy(np.asarray(labels, np.int64))
        per_token = torch.log_softmax(logits, -1).gather(
            -1, labels.clamp(min=0)[..., None])[..., 0]
        return (per_token * (labels != -100)).sum(1)

    with torch.no_grad(), policy.disable_adapter():
        ref_c = logps(batch["chosen_tokens"], batch["chosen_labels"])
        ref_r = logps(batch["rejected_tokens"], batch["rejected_labels"])
    pc = logps(batch["chosen_tokens"], batch["chosen_labels"])
    pr = logps(batch["rejected_tokens"], batch["rejected_labels"])
    delta = (pc - ref_c) - (pr - ref_r)
    want = -torch.nn.functional.logsigmoid(BETA * delta).mean()  # loss_type="sigmoid"
    want.backward()
    assert float(loss) == pytest.approx(float(want.detach()), rel=1e-5)
    got = load_file(str(tmp_path / "grads" / "adapter_model.safetensors"))
    named = {n.replace(".default", ""): p.grad.numpy() for n, p in policy.named_parameters()
             if p.grad is not None}
    assert sorted(got) == sorted(named)
    for name in got:
        np.testing.assert_allclose(got[name], named[name], rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def test_dpo_training_step_lowers_the_loss():
    with jax.set_mesh(make_mesh(2, 2)):
        model = hf.from_hf(FIXTURES / "llama", lora=LORA)
        model.eval()
        step = TrainStep(model, optax.adam(3e-2), loss_fn=functools.partial(dpo_loss,
                                                                           beta=BETA))
        batch = {k: v[None] for k, v in _pairs(model.config.vocab_size).items()}
        outs = [step(batch, jax.random.key(i)) for i in range(6)]
    losses = [float(o["loss"]) for o in outs]
    assert losses[0] == pytest.approx(np.log(2), rel=1e-4)  # policy = reference at start
    assert losses[-1] < losses[0] - 0.05
    assert float(outs[-1]["reward_accuracy"]) > 0.5


def test_dpo_loss_errors():
    with jax.set_mesh(make_mesh(1, 1)):
        plain = hf.from_hf(FIXTURES / "llama")
        batch = {k: jnp.asarray(v) for k, v in _pairs(plain.config.vocab_size, 2).items()}
        with pytest.raises(ValueError, match="ref_chosen_logps"):
            dpo_loss(plain, batch, jax.random.key(0))
        with pytest.raises(ValueError, match="lacks"):
            dpo_loss(plain, {"chosen_tokens": batch["chosen_tokens"]}, jax.random.key(0))

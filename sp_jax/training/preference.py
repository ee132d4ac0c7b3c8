"""Preference training: Direct Preference Optimization (Rafailov et al. 2023) as TRL's
``DPOTrainer`` defines it (``loss_type="sigmoid"``), a loss function of
:class:`~sp_jax.training.TrainStep`.

A batch holds each pair's two rows, prompt and completion, ``chosen_tokens`` /
``chosen_labels`` and ``rejected_tokens`` / ``rejected_labels`` ``[batch, seq]`` (labels
aligned with the positions, as :meth:`~sp_jax.models.GPT.loss` takes them:
``ignore_index`` on the prompt and the padding, so a row's log-probability is the sum
over its completion's tokens, TRL's). The reference model is the policy's frozen base:
with LoRA adapters, the same model with the adapters switched off
(:func:`sp_jax.models.lora.disabled`: no second copy of the weights); without, the
batch brings the reference log-probabilities (``ref_chosen_logps`` /
``ref_rejected_logps`` ``[batch]``, TRL's ``precompute_ref_log_probs``; e.g.
:func:`reference_log_probs` of the model before training).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sp_jax.models import lora as model_lora

__all__ = ["dpo_loss", "dpo_pair_losses", "reference_log_probs"]

_ROWS = ("chosen_tokens", "chosen_labels", "rejected_tokens", "rejected_labels")


def dpo_pair_losses(policy_chosen: jax.Array, policy_rejected: jax.Array,
                    ref_chosen: jax.Array, ref_rejected: jax.Array, *, beta: float = 0.1,
                    label_smoothing: float = 0.0) -> tuple[jax.Array, dict[str, jax.Array]]:
    """TRL's sigmoid DPO loss of each pair from summed log-probabilities ``[batch]``:
    ``-(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z)``, ``z = (policy_chosen
    - policy_rejected) - (ref_chosen - ref_rejected)``; and the rewards ``beta *
    (policy - ref)`` of each side (TRL's ``rewards/chosen``, ``rewards/rejected``)."""
    z = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    losses = -jax.nn.log_sigmoid(beta * z) * (1.0 - label_smoothing) \
        - jax.nn.log_sigmoid(-beta * z) * label_smoothing
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    return losses, {"rewards_chosen": chosen, "rewards_rejected": rejected,
                    "reward_accuracy": (chosen > rejected).astype(jnp.float32)}


def _log_probs(model: nnx.Module, batch: dict[str, Any], rngs: Any, ignore_index: int
               ) -> tuple[jax.Array, jax.Array]:
    """(chosen, rejected) summed completion log-probabilities, one forward over both."""
    tokens = jnp.concatenate([batch["chosen_tokens"], batch["rejected_tokens"]])
    labels = jnp.concatenate([batch["chosen_labels"], batch["rejected_labels"]])
    logps = model.sequence_log_probs(tokens, labels, ignore_index=ignore_index, rngs=rngs)
    n = batch["chosen_tokens"].shape[0]
    return logps[:n], logps[n:]


def reference_log_probs(model: nnx.Module, batch: dict[str, Any], *,
                        ignore_index: int = -100) -> tuple[jax.Array, jax.Array]:
    """The reference ``(chosen, rejected)`` log-probabilities ``[batch]`` of a preference
    ``batch``: ``model``'s with its LoRA adapters switched off (its frozen base), or
    ``model``'s own without adapters (call it before training: the reference of a full
    fine-tune); no gradient flows through them."""
    if getattr(getattr(model, "config", None), "lora", None) is not None:
        with model_lora.disabled(model):
            out = _log_probs(model, batch, None, ignore_index)
    else:
        out = _log_probs(model, batch, None, ignore_index)
    return jax.tree.map(jax.lax.stop_gradient, out)


def dpo_loss(model: nnx.Module, batch: dict[str, Any], key: jax.Array, *,
             beta: float = 0.1, label_smoothing: float = 0.0, ignore_index: int = -100
             ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """The DPO loss function of a :class:`~sp_jax.training.TrainStep`
    (``functools.partial(dpo_loss, beta=0.1)`` as its ``loss_fn``): ``(sum of the pairs'
    losses, number of pairs, metrics)``, so the step's loss is the mean over pairs, TRL's.

    The policy's log-probabilities are the model's (dropout from ``key``); the
    reference's come from the batch (``ref_chosen_logps`` / ``ref_rejected_logps``) or,
    for a model with LoRA adapters, from the model with them switched off
    (:func:`reference_log_probs`).

    Raises:
      ValueError: a batch without the four rows, or a model without adapters and a
        batch without reference log-probabilities.
    """
    missing = [k for k in _ROWS if k not in batch]
    if missing:
        raise ValueError(f"dpo_loss: the batch lacks {missing}; a preference batch holds "
                         f"{list(_ROWS)} [batch, seq] (labels ignore_index on the prompt).")
    if not 0 < beta:
        raise ValueError(f"dpo_loss: beta={beta!r} must be positive (TRL's default: 0.1).")
    if "ref_chosen_logps" in batch and "ref_rejected_logps" in batch:
        ref = (batch["ref_chosen_logps"], batch["ref_rejected_logps"])
    elif getattr(getattr(model, "config", None), "lora", None) is not None:
        ref = reference_log_probs(model, batch, ignore_index=ignore_index)
    else:
        raise ValueError("dpo_loss: the model has no LoRA adapters to switch off for the "
                         "reference; add ref_chosen_logps / ref_rejected_logps to the batch "
                         "(sp_jax.training.reference_log_probs of the model before "
                         "training).")
    chosen, rejected = _log_probs(model, batch, nnx.Rngs(dropout=key), ignore_index)
    losses, metrics = dpo_pair_losses(chosen, rejected, *ref, beta=beta,
                                      label_smoothing=label_smoothing)
    n = losses.shape[0]
    metrics = {k: jnp.mean(v) for k, v in metrics.items()} | {
        "logps_chosen": jnp.mean(chosen), "logps_rejected": jnp.mean(rejected)}
    return jnp.sum(losses), jnp.asarray(n, jnp.int32), metrics

"""The experts' load balance under training: the max/mean expert load of a model trained on
skewed tokens (aux-loss-free balancing's target: lower with the selection bias updated
than without it)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

__all__ = ["expert_load_imbalance", "skewed_batches"]


def skewed_batches(vocab: int, steps: int, *, batch: int = 8, seq: int = 16,
                   skew: float = 1.5, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``steps`` batches ``{"tokens", "labels"}`` ``[1, batch, seq]`` (one micro-batch) of
    token ids drawn with probabilities ``~ skew ** -id``: a few ids most of the time, so
    an untrained router sends most tokens to a few experts."""
    rng = np.random.default_rng(seed)
    p = float(skew) ** -np.arange(vocab, dtype=np.float64)
    out = []
    for _ in range(steps):
        tokens = rng.choice(vocab, size=(batch, seq + 1), p=p / p.sum()).astype(np.int32)
        out.append({"tokens": tokens[None, :, :-1], "labels": tokens[None, :, 1:]})
    return out


def expert_load_imbalance(config: Any, *, steps: int = 50, last: int = 10, skew: float = 1.5,
                          lr: float = 3e-3, seed: int = 0) -> dict[str, Any]:
    """Trains a :class:`~sp_jax.models.GPT` of ``config`` (a mixture of experts) for
    ``steps`` AdamW steps (lr ``lr``) on :func:`skewed_batches` on the current mesh
    (unsharded by default) and measures its expert loads.

    Returns:
      ``{"max_over_mean": float, "loads": [layers, E] list, "losses": list}``: the
      largest expert load over the mean load of its layer, the loads (pairs routed to
      each expert) summed over the last ``last`` steps.
    """
    from sp_jax.models import GPT
    from sp_jax.training import TrainStep

    model = GPT(config, rngs=nnx.Rngs(seed))
    step = TrainStep(model, optax.adamw(lr))
    metrics = [jax.device_get(step(b, jax.random.key(i))) for i, b in enumerate(
        skewed_batches(config.vocab_size, steps, skew=skew, seed=seed))]
    loads = np.sum([m["moe_expert_tokens"] for m in metrics[-last:]], axis=0)
    return {"max_over_mean": float(np.max(loads / loads.mean(-1, keepdims=True))),
            "loads": loads.tolist(), "losses": [float(m["loss"]) for m in metrics]}

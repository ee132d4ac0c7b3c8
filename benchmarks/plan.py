"""The memory planner's targets (``sp_jax.analysis.plan``): a 7B on 8 H100s, a 7B at 128k
tokens on 64 and a 70B on 64, each from deviceless compiles of the real training step,
and the planner's figures against analytic values and a CPU compile of a small model."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from sp_jax.analysis.plan import MODELS, ModelShape, PlanOption, format_table, plan
from sp_jax.models import GPT, GPTConfig
from sp_jax.training import TrainStep

__all__ = ["PLANS", "run_plans", "small_check"]

PLANS = (("7b", 8, {}), ("7b", 64, {"seq": 131072}), ("70b", 64, {}),
         ("gpt3-175b", 128, {}))
SMALL = ModelShape("small", hidden=256, layers=2, heads=8, vocab=512, seq=256)


def small_check(model: ModelShape = SMALL) -> dict[str, Any]:
    """The planner on a small model (data 2 x tensor 4, sharded over data) against the
    analytic parameter and optimizer bytes and against the same training step compiled
    for the 8 simulated CPU devices (XLA:CPU temp minus the gradients)."""
    option = PlanOption(2, 1, 4, fsdp=True, remat=False)
    (row,) = plan(model, 8, options=[option], progress=False)
    mesh = jax.make_mesh((2, 1, 4), ("data", "context", "tensor"))
    cfg = GPTConfig(vocab_size=model.vocab, max_seq_len=model.seq, num_layers=model.layers,
                    num_heads=model.heads, hidden=model.hidden, positions="rotary",
                    dtype=jax.numpy.bfloat16, scan_layers=True)
    parallel = sp_jax.ParallelConfig(recompute_allgather=True, fsdp=True,
                                     wgrad_dtype=jax.numpy.float32)
    with jax.set_mesh(mesh):
        step = TrainStep(GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)), optax.adamw(1e-4))
        tokens = np.zeros((1, 2, model.seq), np.int32)
        batch = jax.device_put({"tokens": tokens, "labels": tokens},
                               NamedSharding(mesh, P(None, "data", None)))
        temp = step.temp_bytes(batch, jax.random.key(0))
    return {"row": row.as_dict(), "cpu_temp_bytes": temp,
            "cpu_activation_bytes": temp - row.grad_bytes}


def run_plans(log=print) -> dict[str, Any]:
    out: dict[str, Any] = {"plans": []}
    for name, gpus, overrides in PLANS:
        model = MODELS[name].replace(**overrides)
        rows = plan(model, gpus, progress=False)
        out["plans"].append({"model": name, "seq": model.seq, "gpus": gpus,
                             "params": model.params, "table": format_table(model, rows),
                             "rows": [r.as_dict() for r in rows]})
        fits = [r.option.label for r in rows if r.fits]
        log(f"  {name} s={model.seq} on {gpus} GPUs: {len(fits)}/{len(rows)} layouts fit")
    out["small"] = small_check()
    return out

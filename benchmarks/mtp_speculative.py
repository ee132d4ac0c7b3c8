"""Speculative decoding with multi-token prediction (issue 51's target): a tiny
DeepSeek-style model with ``mtp_depth=1`` trained 200 steps on the demo corpus (the
standard library's sources as bytes, ``make demo``'s data), then greedy generation from 3
held-out prompts with and without ``speculative="mtp"``: the tokens must be identical;
the mean accepted drafts per verification step is the figure.

``python -m benchmarks.mtp_speculative [--steps 200]`` prints one JSON record.
"""

from __future__ import annotations

import argparse
import json
import time

import sp_jax

sp_jax.xla_flags.simulate_cpu_devices(1)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from sp_jax.data import ByteCorpus  # noqa: E402
from sp_jax.data.corpus import default_patterns  # noqa: E402
from sp_jax.models import GPT, GPTConfig, generate  # noqa: E402
from sp_jax.training import TrainStep  # noqa: E402

SEQ = 128
CONFIG = dict(vocab_size=256, max_seq_len=2 * SEQ, num_layers=2, num_heads=4, hidden=128,
              positions="rotary", norm="rmsnorm", mlp_activation="swiglu", mlp_bias=False,
              out_bias=False, mtp_depth=1, mtp_loss_weight=0.3, attention_block_q=64,
              attention_block_k=64)


def measure(steps: int = 200, batch: int = 16, new_tokens: int = 48) -> dict:
    corpus = ByteCorpus.from_files(default_patterns(), seq_len=SEQ, max_bytes=4 << 20,
                                   held_out_fraction=0.05)
    mesh = jax.make_mesh((1, 1), ("data", "tensor"))
    place = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    with jax.set_mesh(mesh):
        model = GPT(GPTConfig(**CONFIG), rngs=nnx.Rngs(0))
        step = TrainStep(model, optax.adamw(3e-3))
        start, metrics = time.perf_counter(), []
        for i in range(steps):
            b = corpus.train_batch(i, seed=0, batch_size=batch, micro_batches=1,
                                  sharding=place)
            metrics.append({k: float(v) for k, v in step(b, jax.random.key(i)).items()
                            if np.ndim(v) == 0})
        train_s = time.perf_counter() - start
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, nnx.to_pure_dict(step.params))
        nnx.update(model, state)
        model.eval()
        held = np.asarray(corpus.held_out_batches(1, batch_size=3, sharding=place)[0][
            "tokens"]).reshape(-1, SEQ)
        prompts = [list(map(int, held[i, :n])) for i, n in enumerate((17, 40, 29))]
        plain = generate(model, prompts, max_new_tokens=new_tokens)
        spec = generate(model, prompts, max_new_tokens=new_tokens, speculative="mtp")
    return {"steps": steps, "config": {k: v for k, v in CONFIG.items()},
            "lm_loss_first_last": [metrics[0]["lm_loss"], metrics[-1]["lm_loss"]],
            "mtp_loss_first_last": [metrics[0]["mtp_loss"], metrics[-1]["mtp_loss"]],
            "identical": bool(np.array_equal(plain.tokens, spec.tokens)),
            "accepted_drafts_per_step": spec.accepted_drafts,
            "verification_steps": spec.steps, "new_tokens": new_tokens, "prompts": 3,
            "train_seconds": round(train_s, 1)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    print(json.dumps(measure(p.parse_args().steps)))

"""CPU step time of the whole GPT training step, sp_jax against the GSPMD baseline GPT.

Each variant is a :class:`sp_jax.training.TrainStep` (forward, backward, global-norm
clipping, AdamW, parameters and optimizer state donated) of the same model from the same
weights on the same batches, on 8 simulated CPU devices (data=2 x tensor=4):
``sp_jax`` (:class:`sp_jax.models.GPT`), ``sp_jax_cm`` (with
``ParallelConfig(collective_matmul=True)``) and ``gspmd``
(:class:`benchmarks.baseline.GspmdGPT` on an Auto mesh). All are compiled and warmed up,
then timed in interleaved rounds (every variant once per round, ``inner`` steps, the
order rotated), so a slow phase of a noisy machine hits all alike; reported: the median
step time and the median over rounds of each variant's ratio to the GSPMD step of the
same round.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding

import sp_jax
from benchmarks.baseline import GspmdGPT, copy_weights
from sp_jax import Layout
from sp_jax.analysis import parse_collectives
from sp_jax.models import GPT, GPTConfig
from sp_jax.training import TrainStep

__all__ = ["GPT_VARIANTS", "Model", "gpt_step_times"]

GPT_VARIANTS = ("gspmd", "sp_jax", "sp_jax_cm")
REFERENCE = "gspmd"


@dataclasses.dataclass(frozen=True)
class Model:
    """A GPT and its batch: ``batch`` sequences of ``seq`` tokens per step in ``micro``
    micro-batches, compute dtype ``dtype``."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int = 256
    batch: int = 16
    micro: int = 2
    dtype: str = "float32"

    def config(self) -> GPTConfig:
        return GPTConfig(vocab_size=self.vocab, max_seq_len=self.seq, num_layers=self.layers,
                         num_heads=self.heads, hidden=self.hidden, dtype=jnp.dtype(self.dtype))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _mesh(axis_type: AxisType, data: int, tensor: int) -> jax.sharding.Mesh:
    return jax.make_mesh((data, tensor), ("data", "tensor"), axis_types=(axis_type,) * 2,
                         devices=jax.devices()[: data * tensor])


def _steps(model: Model, data: int, tensor: int) -> dict[str, tuple[Any, TrainStep]]:
    cfg = model.config()
    wgrad = jnp.float32 if model.dtype != "float32" else None
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4))
    out, init = {}, None
    for variant in GPT_VARIANTS:
        mesh = _mesh(AxisType.Auto if variant == "gspmd" else AxisType.Explicit, data, tensor)
        with jax.set_mesh(mesh):
            if variant == "gspmd":
                net = GspmdGPT(cfg, layout=Layout(), rngs=nnx.Rngs(1))
            else:
                parallel = sp_jax.ParallelConfig(wgrad_dtype=wgrad,
                                                 collective_matmul=variant == "sp_jax_cm")
                net = GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0))
            if init is None:
                init = net
            else:
                copy_weights(net, init)
            out[variant] = (mesh, TrainStep(net, tx))
    return out


def gpt_step_times(model: Model, *, rounds: int, inner: int, warmup: int, data: int = 2,
                   tensor: int = 4) -> dict[str, Any]:
    """Times one training step of every :data:`GPT_VARIANTS` of ``model``."""
    steps = _steps(model, data, tensor)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.vocab, size=(model.micro, model.batch // model.micro,
                                                model.seq + 1)).astype(np.int32)
    runs, losses, hlo = {}, {}, {}
    for variant, (mesh, step) in steps.items():
        with jax.set_mesh(mesh):
            place = NamedSharding(mesh, Layout().micro_batched_tokens)
            batch = {"tokens": jax.device_put(tokens[..., :-1], place),
                     "labels": jax.device_put(tokens[..., 1:], place)}
            key = jax.random.key(0)
            t0 = time.perf_counter()
            losses[variant] = float(step(batch, key)["loss"])  # compiles
            compile_s = time.perf_counter() - t0
            hlo[variant] = _hlo_counts(step.compile(batch, key).as_text())
            for _ in range(warmup):
                jax.block_until_ready(step(batch, key)["loss"])
        runs[variant] = (mesh, step, batch, key, compile_s)
    samples = {v: [] for v in steps}
    ratios = {v: [] for v in steps}
    order = list(steps)
    for r in range(rounds):
        this_round = {}
        for v in order[r % len(order):] + order[: r % len(order)]:
            mesh, step, batch, key, _ = runs[v]
            with jax.set_mesh(mesh):
                t0 = time.perf_counter()
                for _ in range(inner):
                    metrics = step(batch, key)
                jax.block_until_ready(metrics["loss"])
                this_round[v] = (time.perf_counter() - t0) / inner
        for v in steps:
            samples[v].append(this_round[v])
            ratios[v].append(this_round[v] / this_round[REFERENCE])
    return {
        "model": model.as_dict(), "mesh": {"data": data, "tensor": tensor},
        "rounds": rounds, "inner": inner, "warmup": warmup, "reference": REFERENCE,
        "first_loss": losses,
        "median_s": {v: statistics.median(samples[v]) for v in steps},
        "ratio_to_reference": {v: statistics.median(ratios[v]) for v in steps},
        "ratio_quartiles": {v: _quartiles(ratios[v]) for v in steps},
        "compile_s": {v: runs[v][4] for v in steps},
        "hlo": hlo,
    }


def _hlo_counts(text: str) -> dict[str, int]:
    """Instructions of a compiled step that move data rather than compute: copies
    (layout changes XLA inserts), transposes, and collectives (arrays moved)."""
    out = {"copy": len(re.findall(r"= \S+ copy\(", text)),
           "transpose": len(re.findall(r"= \S+ transpose\(", text)),
           "collective_arrays": sum(c.operands for c in parse_collectives(text))}
    return out


def _quartiles(xs: list[float]) -> list[float]:
    if len(xs) < 2:
        return [xs[0], xs[0]]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return [q[0], q[2]]

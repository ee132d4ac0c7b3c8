"""What is live at the peak of one of the memory planner's compiled layouts: the planner's
training step (``sp_jax.analysis.plan.plan_one``'s: AdamW with fp32 moments, parameters
and state donated, layers scanned, ``recompute_allgather``, bf16 compute, fp32 master
weights) of a :data:`sp_jax.analysis.plan.MODELS` preset compiled deviceless for H100s,
with XLA's live ranges: the per-GPU peak, temp, and the largest buffers live at the peak.

Run: ``JAX_PLATFORMS=cpu PYTHONPATH=. .venv/bin/python benchmarks/plan_peak.py --model
qwen3-30b-a3b --mesh 1 4 1 2`` (data expert context tensor; fsdp and remat on; about a
minute on 2 CPU cores). Prints JSON.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sp_jax.analysis.gpu import compile_for_gpu, gpu_mesh
from sp_jax.analysis.plan import MODELS, PlanOption
from sp_jax.config import ParallelConfig
from sp_jax.layout import Layout
from sp_jax.models import GPT
from sp_jax.training.step import train_step_fn

GiB = 2**30


def measure(name: str, mesh: tuple[int, int, int, int], *, layers: int | None = None,
            remat: bool = True, top: int = 8) -> dict:
    model = MODELS[name] if layers is None else MODELS[name].replace(layers=layers)
    data, expert, context, tensor = mesh
    option = PlanOption(data, context, tensor, fsdp=True, remat=remat, expert=expert)
    parallel = ParallelConfig(recompute_allgather=True, wgrad_dtype=jnp.float32, fsdp=True,
                              expert_axis="expert" if expert > 1 else None)
    cfg = model.gpt_config(remat=remat)
    tx = optax.adamw(1e-4)
    with jax.set_mesh(gpu_mesh(option.mesh_shape, option.axis_names)):
        gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(gpt, nnx.Param, ...)
        opt_state = jax.eval_shape(tx.init, params)
    tokens = jax.ShapeDtypeStruct((1, option.batch_shards, model.seq), jnp.int32,
                                  sharding=Layout.of(parallel).micro_batched_tokens)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    report = compile_for_gpu(train_step_fn(graphdef, tx), params, rest, opt_state,
                             {"tokens": tokens, "labels": tokens}, key,
                             mesh_shape=option.mesh_shape, axis_names=option.axis_names,
                             donate_argnums=(0, 2), live_buffers=True)
    live = report.peak_live
    at = sorted(live.live_at(live.peak_position), key=lambda b: -b.bytes) if live else []
    return {"model": name, "layout": option.label, "layers": model.layers,
            "peak_gib": round(report.peak_bytes / GiB, 2),
            "temp_gib": round(report.temp_bytes / GiB, 2),
            "live_at_peak": [{"shape": b.shape, "gib": round(b.bytes / GiB, 2),
                              "op_name": b.op_name[-120:]} for b in at[:top]]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    p.add_argument("--mesh", type=int, nargs=4, default=[1, 4, 1, 2],
                   metavar=("DATA", "EXPERT", "CONTEXT", "TENSOR"))
    p.add_argument("--layers", type=int, help="default: the model's")
    p.add_argument("--no-remat", action="store_true")
    p.add_argument("--top", type=int, default=8, help="buffers to list")
    args = p.parse_args()
    print(json.dumps(measure(args.model, tuple(args.mesh), layers=args.layers,
                             remat=not args.no_remat, top=args.top), indent=1))


if __name__ == "__main__":
    main()

"""What fits where: the planner's chosen Mixtral-8x7B layout with its memory options,
checked by deviceless 8 x H100 compiles of the real training step.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/fits.py [--layers 1 2]`` (JSON lines).
Compiles :func:`sp_jax.training.train_step_fn` of Mixtral-8x7B's blocks (scanned, remat,
``recompute_allgather``, bf16 compute, fp32 master weights) on data x expert x context x
tensor = 1 x 8 x 1 x 1, parameters sharded over the batch axes (``fsdp="full"``), with
AdamW's moments in bf16 (:func:`sp_jax.training.adamw`) and the optimizer state in
``pinned_host`` (``offload_optimizer``), for 1 and 2 layers; the full 32-layer figure is
the 2-layer one plus 30 times the per-layer difference (each layer's parameters, state
and remat input are the same size).
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import sp_jax
from sp_jax.analysis.gpu import default_compiler_options, gpu_mesh
from sp_jax.analysis.plan import MODELS
from sp_jax.layout import Layout
from sp_jax.models import GPT
from sp_jax.training import adamw
from sp_jax.training.step import train_step_fn

AXES = ("data", "expert", "context", "tensor")


def _abstract(tree, mesh, host):
    def leaf(x):
        spec = getattr(getattr(x, "sharding", None), "spec", PartitionSpec())
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
            mesh, spec).with_memory_kind("pinned_host" if host else "device"))
    return jax.tree.map(leaf, tree)


def measure(layers: int, *, offload_optimizer: bool, moments: str) -> dict:
    model = MODELS["mixtral-8x7b"].replace(layers=layers)
    parallel = sp_jax.ParallelConfig(recompute_allgather=True, wgrad_dtype=jnp.float32,
                                     fsdp="full", expert_axis="expert")
    cfg = model.gpt_config(remat=True)
    dt = jnp.bfloat16 if moments == "bf16" else None
    tx = adamw(1e-4, mu_dtype=dt, nu_dtype=dt)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    mesh = gpu_mesh((1, 8, 1, 1), AXES)
    with jax.set_mesh(mesh):
        gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(gpt, nnx.Param, ...)
        opt_state = jax.eval_shape(tx.init, params)
        p_in = _abstract(params, mesh, False)
        o_in = _abstract(opt_state, mesh, offload_optimizer)
        tokens = jax.ShapeDtypeStruct((1, 8, model.seq), jnp.int32, sharding=NamedSharding(
            mesh, Layout.of(parallel).micro_batched_tokens))
        step = train_step_fn(graphdef, tx, offload_optimizer=offload_optimizer,
                             compute_dtype=cfg.dtype)
        shard = lambda t: jax.tree.map(lambda x: x.sharding, t)  # noqa: E731
        t0 = time.perf_counter()
        compiled = jax.jit(
            step, in_shardings=(shard(p_in), None, shard(o_in), None, None),
            out_shardings=(shard(p_in), shard(o_in), None), donate_argnums=(0, 2),
        ).lower(p_in, rest, o_in, {"tokens": tokens, "labels": tokens}, key).compile(
            compiler_options=default_compiler_options())
        seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    dev = {k: int(getattr(mem, f"{k}_size_in_bytes"))
           for k in ("argument", "output", "alias", "temp")}
    host = {k: int(getattr(mem, f"host_{k}_size_in_bytes"))
            for k in ("argument", "output", "alias", "temp")}
    return {"layers": layers, "moments": moments, "offload_optimizer": offload_optimizer,
            "compile_s": round(seconds, 1), "device": dev, "host": host,
            "device_peak": dev["argument"] + dev["output"] - dev["alias"] + dev["temp"],
            "host_bytes": host["argument"] + host["temp"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--moments", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--no-offload", action="store_true")
    args = p.parse_args()
    rows = [measure(n, offload_optimizer=not args.no_offload, moments=args.moments)
            for n in args.layers]
    for r in rows:
        print(json.dumps(r), flush=True)
    if len(rows) == 2 and rows[1]["layers"] == rows[0]["layers"] + 1:
        grow = rows[1]["device_peak"] - rows[0]["device_peak"]
        hgrow = rows[1]["host_bytes"] - rows[0]["host_bytes"]
        n = MODELS["mixtral-8x7b"].layers - rows[1]["layers"]
        print(json.dumps({"layers": MODELS["mixtral-8x7b"].layers, "scaled": True,
                          "device_peak_gib": (rows[1]["device_peak"] + n * grow) / 2**30,
                          "host_gib": (rows[1]["host_bytes"] + n * hgrow) / 2**30}))


if __name__ == "__main__":
    main()

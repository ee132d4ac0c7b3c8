"""What fits where: the planner's chosen Mixtral-8x7B layout with its memory options,
checked by deviceless 8 x H100 compiles of the real training step.

Run: ``JAX_PLATFORMS=cpu PYTHONPATH=. .venv/bin/python benchmarks/fits.py [--layers 32]
[--moments fp32] [--no-offload]`` (JSON lines; about 40 s per compile on 2 CPU cores), and
``... benchmarks/fits.py --model llama-3-70b --mesh 2 1 1 8 --no-offload`` (Llama blocks:
the preset's one-expert mixture compiled as a dense SwiGLU MLP) or ``--model 405b --mesh
16 1 1 8 --moments fp32 --no-offload``.
Compiles :func:`sp_jax.training.train_step_fn` of Mixtral-8x7B's blocks (scanned, remat,
``recompute_allgather``, bf16 compute, fp32 master weights) on data x expert x context x
tensor = 1 x 8 x 1 x 1, parameters sharded over the batch axes (``fsdp="full"``), with
AdamW's moments in bf16 (:func:`sp_jax.training.adamw`) and the optimizer state in
``pinned_host`` (``offload_optimizer``), all 32 layers (scanned: the compile does not
grow with them).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

import sp_jax
from benchmarks.offload import abstract_on, compile_step, memory_bytes
from sp_jax.analysis.gpu import gpu_mesh
from sp_jax.analysis.plan import MODELS
from sp_jax.layout import Layout
from sp_jax.models import GPT
from sp_jax.training import adamw
from sp_jax.training.step import optimizer_shardings, train_step_fn


def measure(layers: int, *, offload_optimizer: bool, moments: str, name: str = "mixtral-8x7b",
            mesh_shape: tuple[int, ...] = (1, 8, 1, 1), fsdp: str = "full") -> dict:
    model = MODELS[name].replace(layers=layers)
    experts = model.experts > 1
    axes = ("data", "expert", "context", "tensor") if experts else ("data", "context", "tensor")
    mesh_shape = mesh_shape if experts else (mesh_shape[0], *mesh_shape[2:])
    parallel = sp_jax.ParallelConfig(recompute_allgather=True, wgrad_dtype=jnp.float32,
                                     fsdp=fsdp, **({"expert_axis": "expert"} if experts else {}))
    cfg = model.gpt_config(remat=True, **({} if experts else {"num_experts": 0}))
    dt = jnp.bfloat16 if moments == "bf16" else None
    tx = adamw(1e-4, mu_dtype=dt, nu_dtype=dt)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    mesh = gpu_mesh(mesh_shape, axes)
    batch = mesh_shape[0] * (mesh_shape[1] if experts else 1)
    with jax.set_mesh(mesh):
        gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(gpt, nnx.Param, ...)
        upd = None
        if fsdp == "optimizer":  # ZeRO-1: the state and the update over the data axes
            upd = optimizer_shardings(params, parallel)
            params_upd = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=s), params, upd)
            opt_state = jax.eval_shape(tx.init, params_upd)
        else:
            opt_state = jax.eval_shape(tx.init, params)
        p_in = abstract_on(params, mesh, False)
        o_in = abstract_on(opt_state, mesh, offload_optimizer)
        tokens = jax.ShapeDtypeStruct((1, batch, model.seq), jnp.int32, sharding=NamedSharding(
            mesh, Layout.of(parallel).micro_batched_tokens))
        step = train_step_fn(graphdef, tx, offload_optimizer=offload_optimizer,
                             compute_dtype=cfg.dtype, update_shardings=upd,
                             param_shardings=jax.tree.map(lambda x: x.sharding, params))
        compiled, seconds = compile_step(step, p_in, rest, o_in, tokens, key)
    dev, host = memory_bytes(compiled)
    return {"model": name, "mesh": mesh_shape, "fsdp": fsdp, "layers": layers,
            "moments": moments, "offload_optimizer": offload_optimizer,
            "compile_s": round(seconds, 1), "device": dev, "host": host,
            "device_peak": dev["argument"] + dev["output"] - dev["alias"] + dev["temp"],
            "host_bytes": host["argument"] + host["temp"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mixtral-8x7b", choices=sorted(MODELS))
    p.add_argument("--mesh", type=int, nargs=4, default=[1, 8, 1, 1],
                   metavar=("DATA", "EXPERT", "CONTEXT", "TENSOR"))
    p.add_argument("--fsdp", default="full", choices=["full", "optimizer"])
    p.add_argument("--layers", type=int, nargs="+", help="default: the model's")
    p.add_argument("--moments", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--no-offload", action="store_true")
    args = p.parse_args()
    rows = [measure(n, offload_optimizer=not args.no_offload, moments=args.moments,
                    name=args.model, mesh_shape=tuple(args.mesh), fsdp=args.fsdp)
            for n in args.layers or [MODELS[args.model].layers]]
    for r in rows:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()

"""What fits where: one of the planner's layouts with its memory options, checked by a
deviceless H100 compile of the real training step (:func:`sp_jax.analysis.plan.plan_one`
with ``memory=``, what ``python -m sp_jax.plan`` confirms its answer with), beside the
planner's formula.

Run: ``JAX_PLATFORMS=cpu PYTHONPATH=. .venv/bin/python benchmarks/fits.py [--layers 32]
[--moments fp32] [--no-offload]`` (JSON lines; one to three minutes per compile on 2 CPU
cores), and ``... benchmarks/fits.py --model llama-3-70b --mesh 2 1 1 8 --no-offload``
(Llama blocks: the preset's one-expert mixture compiled as a dense SwiGLU MLP) or
``--model 405b --mesh 16 1 1 8 --moments fp32 --no-offload``.
Default: Mixtral-8x7B's blocks (scanned, remat, ``recompute_allgather``, bf16 compute, fp32
master weights) on data x expert x context x tensor = 1 x 8 x 1 x 1, parameters sharded
over the batch axes (``fsdp="full"``), AdamW's moments in bf16 and the optimizer state in
``pinned_host`` (``offload_optimizer``), all 32 layers (scanned: the compile does not grow
with them).
"""

from __future__ import annotations

import argparse
import json
import math

from sp_jax.analysis.memory_options import MemoryOptions, search
from sp_jax.analysis.plan import MODELS, plan_one


def measure(layers: int, *, offload_optimizer: bool, moments: str, name: str = "mixtral-8x7b",
            mesh_shape: tuple[int, ...] = (1, 8, 1, 1), fsdp: str = "full") -> dict:
    """One compile of ``name`` (``layers`` of them) on ``mesh_shape`` (data, expert,
    context, tensor) with remat and the options; per-GPU bytes, compiled and by formula."""
    model = MODELS[name].replace(layers=layers)
    data, expert, _, tensor = mesh_shape
    options = MemoryOptions(fsdp, moments, "optimizer" if offload_optimizer else "off")
    want = (data, expert if model.experts > 1 else 1, tensor, True, 1)
    row = next(r for r in search(model, math.prod(mesh_shape), options=[options])
               if (r.layout.data, r.layout.expert, r.layout.tensor, r.layout.remat,
                   r.layout.stages) == want)
    got = plan_one(model, row.layout, batch=row.batch, memory=options)
    return {"model": name, "mesh": list(mesh_shape), "fsdp": fsdp, "layers": layers,
            "moments": moments, "offload_optimizer": offload_optimizer,
            "compile_s": round(got.compile_s, 1), "error": got.error,
            "device_peak": got.peak_bytes, "host_bytes": got.host_bytes,
            "temp": got.activation_bytes + got.grad_bytes,
            "formula_device": row.device_bytes,
            "formula_update": row.update_bytes, "formula_host": row.host_bytes}


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

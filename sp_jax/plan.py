"""``python -m sp_jax.plan``: per-GPU memory of a GPT training run for every sensible
layout, from deviceless XLA:GPU compiles of the real training step (no GPU needed).

Example::

    python -m sp_jax.plan --model 70b --gpus 64
    python -m sp_jax.plan --model gpt3-175b --gpus 128 --stages 8 16
    python -m sp_jax.plan --model 7b --gpus 64 --seq 131072
    python -m sp_jax.plan --hidden 2048 --layers 24 --heads 16 --vocab 50304 --seq 2048 --gpus 8
    python -m sp_jax.plan --model 7b --head-dim 256 --gpus 8   # heads x head_dim != hidden
    python -m sp_jax.plan --model mixtral-8x7b --gpus 8 --memory-options \
        --host-memory-per-node 2TB --device-reserve 15GiB   # formulas, no compiles
    python -m sp_jax.plan --model qwen3-30b-a3b --gpus 8   # 128 experts of 768, top 8

See :func:`sp_jax.analysis.plan` and :mod:`sp_jax.analysis.memory_options`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys


def main(argv: list[str] | None = None) -> int:
    # Deviceless compiles: the CUDA plugin registers for compilation only on a CPU backend
    # (``import sp_jax`` has imported jax already, but no backend has started).
    import jax

    jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS") or "cpu")
    from sp_jax.analysis.plan import MODELS, ModelShape, format_table, plan

    p = argparse.ArgumentParser(
        prog="python -m sp_jax.plan",
        description="Per-GPU memory of a GPT training run on H100s for every sensible layout, "
                    "from deviceless XLA:GPU compiles of the real training step (no GPU "
                    "needed).")
    p.add_argument("--model", choices=sorted(MODELS), help="a preset shape")
    for name in ("hidden", "layers", "heads", "vocab", "seq", "mlp-hidden"):
        p.add_argument(f"--{name}", type=int, help=f"model {name} (overrides the preset)")
    p.add_argument("--head-dim", type=int,
                   help="model head size (overrides the preset; default: hidden / heads): "
                        "q, k, v and the output projection heads x head-dim wide")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (H100)")
    p.add_argument("--batch", type=int, help="global sequences per step (default: one per "
                                             "data shard; pipelined layouts: one per data "
                                             "shard and micro-batch)")
    p.add_argument("--stages", type=int, nargs="+", metavar="P",
                   help="pipeline stage counts to try (default: the two largest that divide "
                        "the layers and the GPUs beyond one tensor group; 1: no pipeline)")
    p.add_argument("--microbatches", type=int, metavar="M",
                   help="micro-batches per step of the pipelined layouts (default: batch / "
                        "data with --batch, else 4 x stages)")
    p.add_argument("--memory-options", action="store_true",
                   help="search the memory options by formula instead of compiling: fsdp "
                        "(off / optimizer = ZeRO-1 / full), AdamW moments (fp32 / bf16), "
                        "optimizer offload (off / optimizer / optimizer+params), activation "
                        "offload (off / on); prints device peak and host bytes per GPU")
    p.add_argument("--host-memory-per-node", default="2TB", metavar="SIZE",
                   help="host memory of one node the host bytes are checked against "
                        "(--memory-options; default 2TB; e.g. 1.5TB, 2048GiB, or GiB)")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs sharing one node's host memory (default 8)")
    p.add_argument("--device-reserve", default="0", metavar="SIZE",
                   help="device bytes a layout must leave free beyond the formulas' "
                        "(--memory-options: XLA's temporaries; e.g. 15GiB; default 0)")
    p.add_argument("--json", help="also write the rows as JSON to this path")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    sizes = {k: getattr(args, k.replace("-", "_")) for k in
             ("hidden", "layers", "heads", "vocab", "seq", "mlp-hidden", "head-dim")}
    if args.model:
        model = MODELS[args.model].replace(**{k.replace("-", "_"): v for k, v in sizes.items()
                                              if v is not None})
    else:
        missing = [k for k in ("hidden", "layers", "heads", "vocab", "seq") if sizes[k] is None]
        if missing:
            p.error(f"give --model or all of --hidden --layers --heads --vocab --seq "
                    f"(missing: {', '.join('--' + m for m in missing)})")
        model = ModelShape("custom", sizes["hidden"], sizes["layers"], sizes["heads"],
                           sizes["vocab"], sizes["seq"], sizes["mlp-hidden"],
                           head_dim=sizes["head-dim"])
    for name, value in [("gpus", args.gpus), ("batch", args.batch),
                        ("microbatches", args.microbatches),
                        *(("stages", v) for v in args.stages or ()),
                        *((k, v) for k, v in sizes.items() if v is not None)]:
        if value is not None and value < 1:
            p.error(f"--{name} {value} must be positive")
    if model.head_dim is None and model.hidden % model.heads:
        p.error(f"--heads {model.heads} must divide --hidden {model.hidden} (or give "
                "--head-dim)")
    if args.memory_options:
        from sp_jax.analysis.memory_options import format_fits, parse_bytes, search

        try:
            host, reserve = (parse_bytes(args.host_memory_per_node),
                             parse_bytes(args.device_reserve))
            fits = search(model, args.gpus, host_bytes_per_node=host, batch=args.batch,
                          gpus_per_node=args.gpus_per_node, reserve=reserve)
        except ValueError as e:
            p.error(str(e))
        print(format_fits(model, args.gpus, fits))
        if args.json:
            with open(args.json, "w") as f:
                json.dump([dataclasses.asdict(r) | {"device_bytes": r.device_bytes,
                                                    "fits": r.fits} for r in fits],
                          f, indent=1, default=str)
        return 0
    try:
        rows = plan(model, args.gpus, batch=args.batch, stages=args.stages,
                    microbatches=args.microbatches, progress=not args.no_progress)
    except (RuntimeError, ValueError) as e:  # e.g. no CUDA plugin: one line, how to fix it
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_table(model, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict() for r in rows], f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

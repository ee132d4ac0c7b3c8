"""``python -m sp_jax.plan``: what fits where, per GPU, for a GPT training run on H100s:
the memory options searched by formula, the answer confirmed by a deviceless XLA:GPU
compile of the real training step (no GPU needed), and the command line that runs it.

Example::

    python -m sp_jax.plan --model mixtral-8x7b --gpus 8   # formula, then one compile
    python -m sp_jax.plan --model llama-3-70b --gpus 16 --device-reserve 6GiB
    python -m sp_jax.plan --model 70b --gpus 64 --no-memory-options   # every layout compiled
    python -m sp_jax.plan --model gpt3-175b --gpus 128 --no-memory-options --stages 8 16
    python -m sp_jax.plan --hidden 2048 --layers 24 --heads 16 --vocab 50304 --seq 2048 --gpus 8
    python -m sp_jax.plan --model 7b --head-dim 256 --gpus 8   # heads x head_dim != hidden
    python -m sp_jax.plan --model mixtral-8x7b --gpus 8 --no-confirm \
        --host-memory-per-node 2TB   # formulas only, no compile
    python -m sp_jax.plan --model qwen3-30b-a3b --gpus 8   # 128 experts of 768, top 8
    python -m sp_jax.plan --model llama-3-70b --gpus 1 --lora-rank 16 --base-dtype nf4

See :mod:`sp_jax.analysis.memory_options`, :mod:`sp_jax.analysis.confirm` and
:func:`sp_jax.analysis.plan`.
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
    from sp_jax.analysis.memory_options import DEFAULT_RESERVE, parse_bytes
    from sp_jax.analysis.plan import MODELS, ModelShape, format_table, plan

    p = argparse.ArgumentParser(
        prog="python -m sp_jax.plan",
        description="Per-GPU memory of a GPT training run on H100s, and the command line "
                    "that runs it: the memory options searched by formula for every "
                    "sensible layout, the answer confirmed from deviceless XLA:GPU "
                    "compiles of the real training step (no GPU needed).")
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
                   help="pipeline stage counts to try (default: every count that divides "
                        "the layers and the GPUs beyond one tensor group, with "
                        "--no-memory-options the two largest; 1: no pipeline)")
    p.add_argument("--microbatches", type=int, metavar="M",
                   help="micro-batches per step of the pipelined layouts of "
                        "--no-memory-options (default: batch / data with --batch, else 4 x "
                        "stages)")
    answer = p.add_argument_group(
        "the answer (default: the memory options searched by formula, the answer "
        "confirmed by compile)")
    # one of them at most: each says how the answer is found
    how = answer.add_mutually_exclusive_group()
    how.add_argument(
        "--no-memory-options", action="store_true",
        help="compile every candidate layout without the memory options instead (no "
             "ZeRO-1, bf16 moments or offload; --stages and --microbatches apply): a "
             "table of compiled peaks")
    how.add_argument(
        "--no-confirm", action="store_true",
        help="the formula search alone, no compile (under a second): the memory options "
             "fsdp (off / optimizer = ZeRO-1 / full), AdamW moments (fp32 / bf16), optimizer "
             "offload (off / optimizer / optimizer+params), activation offload (off / on); "
             "prints device peak and host bytes per GPU")
    how.add_argument(
        "--memory-options", action="store_true",
        help="as --no-confirm (kept for compatibility: the memory options are searched "
             "by default now)")
    answer.add_argument(
        "--confirm-tries", type=int, default=3, metavar="N",
        help="compile at most N of the formula's answers, the preferred first, until one "
             "fits by compile")
    answer.add_argument(
        "--device-reserve", default=f"{DEFAULT_RESERVE / 2**30:g}GiB", metavar="SIZE",
        help=f"device memory a layout must leave free for what the compile does not count "
             f"(CUDA context, NCCL buffers, fragmentation): fits = peak <= 80 GB - SIZE "
             f"(default {DEFAULT_RESERVE / 2**30:g}GiB; e.g. 6GiB or 6)")
    answer.add_argument(
        "--host-memory-per-node", default="2TB", metavar="SIZE",
        help="host memory of one node the host bytes are checked against (default 2TB; "
             "e.g. 1.5TB, 2048GiB, or GiB)")
    answer.add_argument("--gpus-per-node", type=int, default=8,
                        help="GPUs sharing one node's host memory (default 8)")
    lora = p.add_argument_group("LoRA fine-tuning")
    lora.add_argument("--lora-rank", type=int, metavar="R",
                      help="fine-tune with LoRA adapters of rank R on every linear layer, "
                           "the base frozen: counts the adapters, their optimizer state "
                           "and the frozen base")
    lora.add_argument("--base-dtype", choices=("bf16", "int8", "fp8", "nf4"),
                      help="with --lora-rank: the frozen base stored in bf16 or quantized "
                           "(QLoRA; default: its fp32 parameters)")
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
    if args.base_dtype is not None and args.lora_rank is None:
        p.error("--base-dtype needs --lora-rank R (the frozen base of a LoRA fine-tune)")
    if args.lora_rank is not None:
        if args.lora_rank < 1:
            p.error(f"--lora-rank {args.lora_rank} must be positive")
        if model.experts > 1 or model.mla:
            p.error(f"--lora-rank: {model.name} has experts or latent attention, which "
                    "sp_jax's LoRA does not adapt yet; plan a dense model")
        model = model.replace(lora_rank=args.lora_rank, base_dtype=args.base_dtype)
    for name, value in [("gpus", args.gpus), ("batch", args.batch),
                        ("microbatches", args.microbatches),
                        *(("stages", v) for v in args.stages or ()),
                        *((k, v) for k, v in sizes.items() if v is not None)]:
        if value is not None and value < 1:
            p.error(f"--{name} {value} must be positive")
    if model.head_dim is None and model.hidden % model.heads:
        p.error(f"--heads {model.heads} must divide --hidden {model.hidden} (or give "
                "--head-dim)")
    if args.confirm_tries < 1:
        p.error(f"--confirm-tries {args.confirm_tries} must be positive")
    try:
        host, reserve = (parse_bytes(args.host_memory_per_node),
                         parse_bytes(args.device_reserve))
    except ValueError as e:
        p.error(str(e))
    if args.no_memory_options:
        try:
            rows = plan(model, args.gpus, batch=args.batch, stages=args.stages,
                        microbatches=args.microbatches, progress=not args.no_progress)
        except (RuntimeError, ValueError) as e:  # e.g. no CUDA plugin: one line, the fix
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(format_table(model, rows, reserve))
        if args.json:
            with open(args.json, "w") as f:
                json.dump([r.as_dict() for r in rows], f, indent=1, default=str)
        return 0
    return _memory_options(p, args, model, host, reserve)


def _memory_options(p: argparse.ArgumentParser, args: argparse.Namespace, model: object,
                    host: float, reserve: float) -> int:
    """The default answer: the formula search, then (without --no-confirm) its answers
    compiled until one fits by compile."""
    from sp_jax.analysis.confirm import confirm, format_answer
    from sp_jax.analysis.memory_options import format_fits, search

    if args.microbatches is not None:
        p.error("--microbatches applies with --no-memory-options (the formula search runs "
                "4 x stages micro-batches)")
    try:
        fits = search(model, args.gpus, host_bytes_per_node=host, batch=args.batch,
                      gpus_per_node=args.gpus_per_node, reserve=reserve)
    except ValueError as e:
        p.error(str(e))
    if args.stages:
        from sp_jax.analysis.plan import candidates

        try:  # the stage counts checked as the compiled table checks them
            candidates(model, args.gpus, stages=args.stages)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        fits = [r for r in fits if r.layout.stages in args.stages]
        if not fits:
            p.error(f"--stages {' '.join(map(str, args.stages))}: no layout of "
                    f"{args.gpus} GPUs has that many stages")
    records = [dataclasses.asdict(r) | {"device_bytes": r.device_bytes, "fits": r.fits}
               for r in fits]
    if args.no_confirm or args.memory_options:
        print(format_fits(model, args.gpus, fits))
    else:
        def progress(c: object) -> None:
            if not args.no_progress:
                print(f"compiled {c.row.layout.label} with {c.row.options.label} in "
                      f"{c.compile_s:.0f} s", file=sys.stderr, flush=True)

        try:
            confirmed, tried = confirm(model, fits, tries=args.confirm_tries,
                                       on_try=progress)
        except (RuntimeError, ValueError) as e:  # e.g. no CUDA plugin: one line, the fix
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(format_answer(model, args.gpus, fits, confirmed, tried))
        compiled = {id(c.row): c for c in tried}
        for r, record in zip(fits, records, strict=True):
            if id(r) in compiled:
                c = compiled[id(r)]
                record.update(compiled_device_bytes=c.device_bytes,
                              compiled_host_bytes=c.host_bytes, compile_error=c.error,
                              confirmed=c is confirmed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

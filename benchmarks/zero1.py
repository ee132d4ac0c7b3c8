"""ZeRO-1 on 8 x H100 (deviceless compiles): optimizer-state bytes and peak memory per GPU
of the training step with ``ParallelConfig(fsdp="optimizer")`` against the replicated
step (``fsdp=False``), and the collectives the step moves the gradients and parameters
with.

Run ``python -m benchmarks.zero1 [--quick] [--json PATH] [--markdown PATH]`` (about a
minute on 2 CPU cores; needs the CUDA PJRT plugin; ``make bench`` runs it as its ZeRO-1
section). For each layout it compiles the GPT training step
(:func:`sp_jax.training.train_step_fn` as :class:`~sp_jax.training.TrainStep` builds it:
forward, backward, AdamW; parameters and optimizer state donated; rotary positions, bf16
compute, fp32 master weights, ``recompute_allgather``, fp32 weight gradients) of
``layers`` scanned layers at h=4096, s=2048 (one sequence per data shard), vocabulary
32,000, on a data 8 mesh, and reads ``memory_analysis()`` and the compiled HLO:

- optimizer bytes per GPU (AdamW's two fp32 moments: each leaf's per-device shard);
  target: ZeRO-1 = 1/8 of replicated;
- per-device peak (temp + arguments + outputs - aliased); target: lower than the
  replicated step's by at least 3/4 of the replicated optimizer state;
- reduce-scatter / all-reduce / all-gather bytes per GPU (reported).

Public ``sp_jax`` names and :mod:`sp_jax.analysis` only.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before JAX starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Zero1Bench:
    layers: int = 8
    h: int = 4096
    heads: int = 32
    s: int = 2048
    vocab: int = 32000
    data: int = 8
    tensor: int = 1


FULL = Zero1Bench()
QUICK = Zero1Bench(layers=2, h=512, heads=8, s=256, vocab=1024)


def _shard_bytes(x: Any) -> int:
    """Bytes of one device's shard of an abstract array with a ``NamedSharding``."""
    shape = x.sharding.shard_shape(x.shape)
    n = 1
    for d in shape:
        n *= d
    return n * x.dtype.itemsize


def compile_step(bench: Zero1Bench, fsdp: Any) -> dict[str, Any]:
    """Optimizer bytes, memory and collectives per GPU of one training step."""
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from sp_jax.analysis.gpu import compile_for_gpu, gpu_mesh
    from sp_jax.config import ParallelConfig
    from sp_jax.layout import Layout
    from sp_jax.models import GPT, GPTConfig
    from sp_jax.training.step import manual_data_graphdef, optimizer_shardings, train_step_fn

    parallel = ParallelConfig(recompute_allgather=True, wgrad_dtype=jnp.float32, fsdp=fsdp)
    cfg = GPTConfig(vocab_size=bench.vocab, max_seq_len=bench.s, num_layers=bench.layers,
                    num_heads=bench.heads, hidden=bench.h, positions="rotary",
                    dtype=jnp.bfloat16, param_dtype=jnp.float32, scan_layers=True)
    tx = optax.adamw(1e-4)
    mesh_shape, axes = (bench.data, bench.tensor), ("data", "tensor")
    mesh = gpu_mesh(mesh_shape, axes)
    with jax.set_mesh(mesh):
        gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        manual = manual_data_graphdef(gpt, parallel, mesh) if parallel.zero1_axes else None
        graphdef, params, rest = nnx.split(gpt, nnx.Param, ...)
        update = optimizer_shardings(params, parallel)
        moments = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                               params, update)
        # the moments laid out as TrainStep lays them out (tx.init of the resharded params:
        # zeros_like keeps the sharding)
        opt_state = jax.eval_shape(tx.init, moments)
    step = train_step_fn(graphdef, tx, update_shardings=update if parallel.zero1_axes else None,
                         param_shardings=jax.tree.map(lambda x: x.sharding, params),
                         manual_graphdef=manual, manual_axes=parallel.data_axes)
    tokens = jax.ShapeDtypeStruct((1, bench.data, bench.s), jnp.int32,
                                  sharding=Layout.of(parallel).micro_batched_tokens)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    rep = compile_for_gpu(step, params, rest, opt_state, {"tokens": tokens, "labels": tokens},
                          key, mesh_shape=mesh_shape, axis_names=axes, donate_argnums=(0, 2))
    opt_bytes = sum(_shard_bytes(x) for x in jax.tree.leaves(opt_state) if x.ndim)
    c = rep.collectives
    return {"fsdp": fsdp, "hlo": rep.hlo, "optimizer_mib": opt_bytes / MiB,
            "param_mib": sum(_shard_bytes(x) for x in jax.tree.leaves(params)) / MiB,
            "peak_mib": rep.peak_bytes / MiB, "temp_mib": rep.temp_bytes / MiB,
            "argument_mib": rep.argument_bytes / MiB,
            **{f"{k}_mib": c.bytes[k] / MiB for k in ("reduce-scatter", "all-reduce",
                                                       "all-gather")},
            **{f"{k}_ops": c.ops[k] for k in ("reduce-scatter", "all-reduce", "all-gather")}}


def run_zero1(bench: Zero1Bench) -> dict[str, Any]:
    rep, zero = compile_step(bench, False), compile_step(bench, "optimizer")
    for row in (rep, zero):
        del row["hlo"]
    saved = rep["peak_mib"] - zero["peak_mib"]
    targets = [
        {"id": "zero1_optimizer_bytes", "target": f"optimizer bytes per GPU = 1/{bench.data} "
         "of replicated", "measured": f"{zero['optimizer_mib']:.1f} / "
         f"{rep['optimizer_mib']:.1f} MiB = 1/{rep['optimizer_mib'] / zero['optimizer_mib']:.2f}",
         "met": abs(zero["optimizer_mib"] * bench.data - rep["optimizer_mib"])
         <= 1e-3 * rep["optimizer_mib"]},
        {"id": "zero1_peak", "target": "peak lower than replicated by >= 3/4 of the "
         "optimizer state", "measured": f"{zero['peak_mib']:.1f} vs {rep['peak_mib']:.1f} MiB: "
         f"{saved:.1f} MiB lower = {saved / rep['optimizer_mib']:.2f} x the optimizer state "
         f"({rep['optimizer_mib']:.1f} MiB)",
         "met": saved >= 0.75 * rep["optimizer_mib"]},
    ]
    for row in (rep, zero):
        print(f"[zero1] fsdp={row['fsdp']}: " + ", ".join(
            f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            if k != "fsdp"), flush=True)
    for t in targets:
        print(f"[zero1] {t['id']}: {t['measured']} ({'met' if t['met'] else 'MISSED'})")
    return {"bench": dataclasses.asdict(bench), "replicated": rep, "zero1": zero,
            "targets": targets}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.render.zero1 import render_markdown
    from benchmarks.section import write_outputs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (seconds)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--markdown", type=Path, help="write the BENCHMARKS.md section here")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    res = run_zero1(QUICK if args.quick else FULL)
    res["meta"] = {"runtime_s": time.perf_counter() - t0, "jax": jax.__version__}
    write_outputs(res, json_path=args.json, markdown_path=args.markdown,
                  render=render_markdown, log=lambda m: print(f"[zero1] {m}", flush=True))
    return res


if __name__ == "__main__":
    main()

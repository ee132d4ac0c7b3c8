"""Generation with experts: the collectives of one decode step of a Mixtral-8x7B-shaped
model on 8 x H100 (deviceless compile), per decoded token.

    JAX_PLATFORMS=cpu python -m benchmarks.moe_generation [--markdown PATH]

``GPTConfig.mixtral("mixtral-8x7b")`` (32 layers, h=4096, 32 heads over 8 key/value heads,
E=8 experts of F=14336, k=2; bf16 parameters and compute, scanned layers) on ``data 1 x
expert 4 x context 1 x tensor 2`` (``ParallelConfig(expert_axis="expert")``):
:func:`sp_jax.models.decode.decode_step` for a batch of 8 (2 rows per expert shard) with a
4,096-token cache (donated), compiled by :func:`sp_jax.analysis.compile_for_gpu` from
abstract arguments. Every collective of the compiled program with how many times it runs
per call (:func:`sp_jax.analysis.execution_counts`: a loop's body its trip count times),
against the expected per token: 2 all-reduces per layer (the attention output over the
tensor axis; the experts' sum over the expert and tensor axes) + 1 (the embedding), and 1
all-gather per layer (the normed rows over the expert axis) + 1 (the logits); no
all-to-all. Needs the CUDA PJRT plugin (``pip install -e '.[gpu-aot]'``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from sp_jax import Layout
from sp_jax.analysis import compile_for_gpu, execution_counts, gpu_mesh, parse_collectives
from sp_jax.models import GPT, GPTConfig
from sp_jax.models.decode import KVCache, decode_step

__all__ = ["MESH", "decode_collectives", "main", "markdown"]

AXES = ("data", "expert", "context", "tensor")
MESH = (1, 4, 1, 2)
"""(data, expert, context, tensor) of the 8 H100s."""
MiB = 2**20


def decode_collectives(batch: int = 8, cache: int = 4096, mesh_shape: tuple = MESH,
                       preset: str = "mixtral-8x7b", **overrides: Any) -> dict[str, Any]:
    """The compiled decode step's collectives per decoded token, per kind: instructions
    in the HLO, runs per token, bytes per GPU per token, and the expected runs."""
    cfg = GPTConfig.mixtral(preset, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                            scan_layers=True, **overrides)
    par = sp_jax.ParallelConfig(expert_axis="expert")
    layout = Layout.of(par)
    mesh = gpu_mesh(mesh_shape, AXES)
    t = mesh_shape[AXES.index("tensor")]
    kv_local = cfg.num_kv_heads // t if cfg.num_kv_heads % t == 0 else 1
    with jax.set_mesh(mesh):
        gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=par, rngs=nnx.Rngs(0)))
        gpt.eval()
        graph, state = nnx.split(gpt)
        kv = jax.ShapeDtypeStruct(
            (cfg.num_layers, batch, cache, t * kv_local, cfg.hidden // cfg.num_heads),
            cfg.dtype, sharding=NamedSharding(mesh, P(None, *layout.heads(4))))
        ids = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=NamedSharding(
            mesh, layout.spec("activation_batch")))

    def step(state, kv_cache, tokens, positions):
        return decode_step(nnx.merge(graph, state), kv_cache, tokens, positions)

    t0 = time.perf_counter()
    report = compile_for_gpu(step, state, KVCache(kv, kv), ids, ids, mesh_shape=mesh_shape,
                             axis_names=AXES, donate_argnums=(1,))
    seconds = time.perf_counter() - t0
    counts = execution_counts(report.hlo)
    kinds: dict[str, dict[str, Any]] = {}
    for c in parse_collectives(report.hlo):
        runs = counts.get(c.computation) or 1
        k = kinds.setdefault(c.kind, {"in_hlo": 0, "runs": 0, "bytes": 0, "arrays": set()})
        k["in_hlo"] += 1
        k["runs"] += runs
        k["bytes"] += c.bytes * runs
        k["arrays"].update(f"{d}[{','.join(map(str, s))}]" for d, s in c.arrays)
    layers = cfg.num_layers
    expected = {"all-reduce": 2 * layers + 1, "all-gather": layers + 1}
    return {"config": cfg, "mesh": mesh_shape, "batch": batch, "cache": cache,
            "compile_s": seconds, "kinds": kinds, "expected": expected,
            "temp_bytes": report.temp_bytes, "argument_bytes": report.argument_bytes}


def markdown(res: dict[str, Any]) -> str:
    """The BENCHMARKS.md subsection of :func:`decode_collectives`' result."""
    cfg = res["config"]
    lines = [
        "### Collectives per decoded token with experts (8 x H100)", "",
        f"`GPTConfig.mixtral(\"mixtral-8x7b\", dtype=bfloat16, param_dtype=bfloat16, "
        f"scan_layers=True)` ({cfg.num_layers} layers, h={cfg.hidden}, E={cfg.num_experts} "
        f"experts of F={cfg.moe_mlp_hidden}, k={cfg.experts_per_token}) on data x expert x "
        f"context x tensor = {' x '.join(map(str, res['mesh']))} "
        "(`ParallelConfig(expert_axis=\"expert\")`): `decode_step` for a batch of "
        f"{res['batch']} with a {res['cache']:,}-token cache, compiled deviceless in "
        f"{res['compile_s']:.1f} s (per GPU: arguments {res['argument_bytes'] / MiB:,.1f} "
        f"MiB, temp {res['temp_bytes'] / MiB:,.1f} MiB). Reproduce: `JAX_PLATFORMS=cpu "
        "python -m benchmarks.moe_generation`.", "",
        "| collective | instructions in the HLO | run per token | expected per token | "
        "bytes per GPU per token | arrays |",
        "|---|---|---|---|---|---|"]
    for kind, k in sorted(res["kinds"].items()):
        lines.append(f"| {kind} | {k['in_hlo']} | {k['runs']} | "
                     f"{res['expected'].get(kind, 0)} | {k['bytes'] / MiB:.3f} MiB | "
                     f"{', '.join(sorted(k['arrays']))} |")
    lines += ["", "Expected per token (`MoE.decode_step`): per layer 1 all-reduce of the "
              "attention output over the tensor axis, 1 all-gather of the normed rows over "
              "the expert axis (each expert shard sees the rows of its expert group) and 1 "
              "all-reduce over the expert and tensor axes (each device computes its own "
              "experts' F / t columns for the pairs routed to them; the sum adds the experts "
              "and the column blocks); besides, 1 all-reduce (the vocabulary-parallel "
              "embedding) and 1 all-gather (the logits). No all-to-all: at one token per row "
              "the all-gather of the rows (a few KiB) replaces training's dispatch and return "
              "by ragged all-to-all and their size exchanges.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_generation",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path, help="write the subsection here")
    args = parser.parse_args(argv)
    res = decode_collectives()
    text = markdown(res)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return res


if __name__ == "__main__":
    main()

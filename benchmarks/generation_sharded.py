"""Generation on a context axis and from a pipelined model: a plain script printing the
markdown tables of BENCHMARKS.md's section "Generation: a KV cache split over a context
axis, and from a pipelined model".

Run ``JAX_PLATFORMS=cpu python -m benchmarks.generation_sharded`` (``--quick``: tiny
shapes, seconds; ``--json PATH`` writes the numbers). It simulates 8 CPU devices and
measures:

- :func:`context_cache`: deviceless compiles for H100s (``sp_jax.analysis.
  compile_for_gpu``, needs the CUDA PJRT plugin) of a Llama-3-8B-shaped model (bf16,
  scanned layers): :func:`sp_jax.models.decode.prefill` of a 131,072-token prompt and
  one :func:`~sp_jax.models.decode.decode_step` (the cache donated), on 8 GPUs with the
  KV cache split over a context axis of 8 (ring attention's prefill), and unsplit (the
  whole cache on one GPU, context 1): ``memory_analysis()`` per GPU beside the analytic
  cache bytes;
- :func:`relayout`: :func:`sp_jax.models.decode.unpipelined` (what ``generate`` does
  with a pipelined model): the bytes each GPU receives in the deviceless compile of the
  re-layout of a Llama-3-8B-shaped pipelined model (stage 4 x tensor 2) beside the
  analytic ``(S - 1) / S`` of a tensor shard of the blocks, and its time on the 8
  simulated CPU devices (a smaller model, median of 5).
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # before JAX starts: 8 simulated CPU devices, the CUDA plugin
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # registered for deviceless compiles
    from sp_jax.xla_flags import apply_xla_flags, cpu_simulation_flags

    apply_xla_flags(cpu_simulation_flags(8))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import sp_jax  # noqa: E402
from sp_jax import Layout  # noqa: E402
from sp_jax.analysis import compile_for_gpu, cuda_plugin_available, gpu_mesh  # noqa: E402
from sp_jax.models import GPT, GPTConfig  # noqa: E402
from sp_jax.models.decode import KVCache, decode_step, prefill, unpipelined  # noqa: E402

AXES = ("data", "context", "tensor")
MIB = 2 ** 20
GIB = 2 ** 30


def llama(quick: bool, **overrides: Any) -> GPTConfig:
    """Llama-3-8B (or, ``quick``, a 2-layer model of its head layout and width 512)."""
    bf16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, scan_layers=True)
    if quick:
        return GPTConfig.llama("llama-tiny", **{
            **dict(num_layers=2, hidden=512, num_heads=8, num_kv_heads=8, mlp_hidden=1024,
                   vocab_size=1024, max_seq_len=1 << 20), **bf16, **overrides})
    return GPTConfig.llama("llama-3-8b", max_seq_len=1 << 20, **bf16, **overrides)


def cache_bytes(cfg: GPTConfig, batch: int, length: int) -> int:
    """Keys and values of every layer: ``2 x layers x batch x length x kv_heads x
    head_dim`` elements of the compute dtype."""
    head_dim = cfg.hidden // cfg.num_heads
    return 2 * cfg.num_layers * batch * length * cfg.num_kv_heads * head_dim * \
        jnp.dtype(cfg.dtype).itemsize


def context_cache(quick: bool, context: int, tensor: int, prompt: int, new: int
                  ) -> dict[str, Any]:
    """The prefill and a decode step compiled for ``context x tensor`` H100s (``1 x 1``:
    one GPU, the cache unsplit; ``1 x 8``: the cache split over the key/value heads)."""
    cfg = llama(quick)
    par = sp_jax.ParallelConfig(context_axis="context", context_parallel="ring")
    layout = Layout.of(par)
    shape = (1, context, tensor)
    mesh = gpu_mesh(shape, AXES)
    per = -(-new // context)  # each shard's slots of the new tokens
    length = prompt + per * context
    with jax.set_mesh(mesh):
        gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=par, rngs=nnx.Rngs(0)))
        gpt.eval()
        graph, state = nnx.split(gpt)
        tokens = jax.ShapeDtypeStruct((1, prompt), jnp.int32,
                                      sharding=NamedSharding(mesh, layout.tokens))
        ids = jax.ShapeDtypeStruct((1,), jnp.int32, sharding=NamedSharding(
            mesh, layout.spec("activation_batch")))
        kv = jax.ShapeDtypeStruct(
            (cfg.num_layers, 1, length, cfg.num_kv_heads, (cfg.hidden // cfg.num_heads)), cfg.dtype,
            sharding=NamedSharding(mesh, P(None, *layout.heads(4))))

    def first(state, tokens, last):
        return prefill(nnx.merge(graph, state), tokens, last, length)

    def step(state, cache, tokens, positions):
        return decode_step(nnx.merge(graph, state), cache, tokens, positions)

    out: dict[str, Any] = {"context": context, "tensor": tensor, "prompt": prompt,
                           "cache_tokens": length, "cache_bytes": cache_bytes(cfg, 1, length),
                           "cache_bytes_per_gpu": cache_bytes(cfg, 1, length) // (
                               context * tensor)}
    for name, fn, args, donate in (
            ("prefill", first, (state, tokens, ids), ()),
            ("decode_step", step, (state, KVCache(kv, kv, prompt), ids, ids), (1,))):
        t0 = time.perf_counter()
        try:
            report = compile_for_gpu(fn, *args, mesh_shape=shape, axis_names=AXES,
                                     donate_argnums=donate)
        except Exception as e:  # noqa: BLE001 - reported: e.g. out of memory at compile
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            continue
        out[name] = {**report.as_dict(), "compile_s": time.perf_counter() - t0,
                     "async": {k: v for k, v in report.collectives.async_ops.items() if v},
                     "collectives": {k: v for k, v in report.collectives.ops.items() if v}}
    return out


def relayout(quick: bool) -> dict[str, Any]:
    """The re-layout of a pipelined model: a deviceless compile for 8 H100s (stage 4 x
    tensor 2) of a Llama-3-8B shape, and the time on the 8 simulated CPU devices."""
    axes = ("stage", "data", "context", "tensor")
    stages, tensor = 4, 2
    par = sp_jax.ParallelConfig(pipeline_axis="stage", pipeline_microbatches=4)
    cfg = llama(quick, num_layers=4) if quick else llama(False)
    shape = (stages, 1, 1, tensor)
    mesh = gpu_mesh(shape, axes)
    with jax.set_mesh(mesh):
        gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=par, rngs=nnx.Rngs(0)))
        gpt.eval()
        graph, state = nnx.split(gpt)
        blocks = sum(x.size * x.dtype.itemsize
                     for x in jax.tree.leaves(nnx.state(gpt.blocks, nnx.Param)))

    def fn(state):
        return nnx.state(unpipelined(nnx.merge(graph, state)).blocks, nnx.Param)

    t0 = time.perf_counter()
    report = compile_for_gpu(fn, state, mesh_shape=shape, axis_names=axes)
    compile_s = time.perf_counter() - t0
    gathered = report.collectives.bytes["all-gather"]  # per GPU: its whole tensor shard
    out = {"gpu": {"stages": stages, "tensor": tensor, "blocks_bytes": blocks,
                   "all_gather_output_bytes": gathered,
                   "received_bytes": gathered * (stages - 1) // stages,
                   **report.as_dict(), "compile_s": compile_s,
                   "collectives": {k: v for k, v in report.collectives.ops.items() if v}}}
    # CPU: a smaller model on the 8 simulated devices, the re-layout timed
    small = GPTConfig.llama("llama-tiny", num_layers=8, hidden=512, num_heads=8,
                            num_kv_heads=8, mlp_hidden=1536, vocab_size=1024,
                            scan_layers=True)
    cpu_mesh = jax.make_mesh(shape, axes, devices=jax.devices()[:8])
    times = []
    with jax.set_mesh(cpu_mesh):
        model = GPT(small, parallel=par, rngs=nnx.Rngs(0))
        small_blocks = sum(x.size * x.dtype.itemsize
                           for x in jax.tree.leaves(nnx.state(model.blocks, nnx.Param)))
        for _ in range(6):
            t0 = time.perf_counter()
            jax.block_until_ready(nnx.state(unpipelined(model)))
            times.append(time.perf_counter() - t0)
    out["cpu"] = {"layers": small.num_layers, "hidden": small.hidden,
                  "mlp_hidden": small.mlp_hidden, "blocks_bytes": small_blocks,
                  "first_s": times[0], "median_s": statistics.median(times[1:])}
    return out


def markdown(r: dict[str, Any]) -> str:
    """The tables."""
    cols = [r["context"][k] for k in ("8x1", "1x1", "1x8")]
    lines = ["| | context 8 (8 GPUs) | unsplit (1 GPU) | tensor 8, context 1 (8 GPUs) |",
             "|---|---|---|---|"]

    def row(name: str, cell) -> None:
        lines.append(f"| {name} | " + " | ".join(cell(c) for c in cols) + " |")

    row("KV cache (analytic, all GPUs)", lambda c: f"{c['cache_bytes'] / GIB:,.2f} GiB")
    row("KV cache per GPU (analytic)", lambda c: f"{c['cache_bytes_per_gpu'] / GIB:,.2f} GiB")
    for prog in ("prefill", "decode_step"):
        for key in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
                    "peak_bytes"):
            row(f"{prog}: {key.replace('_bytes', '')} (measured)",
                lambda c, p=prog, k=key: c[p]["error"] if "error" in c[p]
                else f"{c[p][k] / GIB:,.2f} GiB")
        row(f"{prog}: collectives in the HLO", lambda c, p=prog: ", ".join(
            f"{k} {v}" for k, v in c[p].get("collectives", {}).items()) or "none")
    g, c = r["relayout"]["gpu"], r["relayout"]["cpu"]
    lines += ["", "| re-layout (`decode.unpipelined`) | value |", "|---|---|",
              f"| 8 x H100, stage {g['stages']} x tensor {g['tensor']}: blocks (all GPUs) | "
              f"{g['blocks_bytes'] / GIB:,.2f} GiB |",
              f"| all-gather output per GPU (measured) | "
              f"{g['all_gather_output_bytes'] / GIB:,.2f} GiB |",
              f"| received per GPU ((S - 1) / S of it) | {g['received_bytes'] / GIB:,.2f} GiB |",
              f"| temp / peak per GPU | {g['temp_bytes'] / GIB:,.2f} / "
              f"{g['peak_bytes'] / GIB:,.2f} GiB |",
              f"| collectives in the HLO | {g['collectives']} |",
              f"| CPU, 8 simulated devices ({c['layers']} layers, hidden {c['hidden']}, "
              f"blocks {c['blocks_bytes'] / MIB:,.1f} MiB fp32): first call / median | "
              f"{c['first_s'] * 1e3:,.0f} ms / {c['median_s'] * 1e3:,.0f} ms |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes (seconds)")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    if not cuda_plugin_available():
        raise SystemExit("benchmarks.generation_sharded needs the CUDA PJRT plugin "
                         "(/work/shared/gpu-targets/README: deviceless compiles).")
    prompt, new = (4096, 256) if args.quick else (131072, 1024)
    t0 = time.perf_counter()
    results: dict[str, Any] = {"context": {}}
    for context, tensor in ((8, 1), (1, 1), (1, 8)):
        results["context"][f"{context}x{tensor}"] = context_cache(args.quick, context, tensor,
                                                                  prompt, new)
    results["relayout"] = relayout(args.quick)
    results["seconds"] = time.perf_counter() - t0
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()

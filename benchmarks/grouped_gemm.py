"""Fine-grained experts on CPU: the dropless MoE layer's grouped GEMMs by
``sp_jax.ops.moe.grouped_matmul`` against XLA's ``lax.ragged_dot``, and a dense MLP of the
same active FLOPs.

    python -m benchmarks.grouped_gemm [--tokens T] [--rounds R] [--h100] [--json PATH]

Layer: 64 experts, top 8, on 8 simulated CPU devices with an expert axis of 8 (8 experts
per device), h=256, expert width F=128 (SwiGLU), ``T`` tokens per device, fp32,
forward+backward (gradients of a sum of squares w.r.t. the parameters and the input),
under ``jit``; the same layer with its grouped GEMMs replaced by ``lax.ragged_dot`` (the
path before ``grouped_matmul``: XLA:CPU computes it as a dense product over every local
expert of the whole static receive buffer, ``ep T min(k, E / ep)`` rows); and a dense
SwiGLU MLP of width ``k F`` on the same tokens and mesh (the same active FLOPs); and the
layer with no expert GEMM at all (each grouped GEMM replaced by a row scaling of the same
shape: the routing, sorting, all-to-alls, gathers and scatters alone). Median of
interleaved rounds. Then the tile sweep that chose ``sp_jax.ops.grouped.CPU_TILE``:
``grouped_matmul`` forward+backward on one device, rows of 8 groups. With ``--h100``:
deviceless 8 x H100 compiles of one Qwen3-30B-A3B-shaped block (expert 8) both ways.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

__all__ = ["QWEN3_30B_A3B_LAYER", "fine_grained_step_times", "h100_layer_memory", "main",
           "tile_sweep"]

AXES = ("data", "expert", "context", "tensor")


def _timed(fn, args) -> float:
    import jax

    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def fine_grained_step_times(*, tokens: int = 128, h: int = 256, F: int = 128, E: int = 64,
                            k: int = 8, ep: int = 8, rounds: int = 5,
                            reference: bool = True) -> dict[str, Any]:
    """Median forward+backward seconds of the MoE layer with ``grouped_matmul``, with
    ``lax.ragged_dot`` and without expert GEMMs (with ``reference``), and of a dense MLP
    of width ``k F`` (``tokens`` per device, ``ep`` devices on the expert axis;
    interleaved rounds)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax import lax

    import sp_jax
    from benchmarks.moe import LayerBench
    from sp_jax.ops import moe as moe_ops

    bench = LayerBench.make(tokens=tokens, h=h, F=F, E=E, k=k, ep=ep)
    cfg, par, moe, dense, xs, program = (bench.cfg, bench.parallel, bench.moe, bench.dense,
                                         bench.x, bench.program)
    with jax.set_mesh(bench.mesh):
        programs = {"dense MLP (width k F)": (program(dense), dense),
                    "MoE, grouped_matmul": (program(moe), moe)}
        compile_s = {}
        for name, (fn, module) in programs.items():
            compile_s[name] = _timed(fn, (module, xs))
        real = moe_ops.grouped_matmul
        replacements = {
            "MoE, lax.ragged_dot": lambda x, w, sizes, **_: lax.ragged_dot(x, w, sizes),
            # the rest of the layer: no expert GEMM (each row scaled, the shapes kept)
            "MoE, no expert GEMMs": lambda x, w, sizes, **_: jnp.broadcast_to(
                x[:, :1] * w[0, 0, :1], (x.shape[0], w.shape[2]))}
        for name, replacement in replacements.items() if reference else ():
            moe_ops.grouped_matmul = replacement
            try:  # traced (and compiled) with the replacement
                fn = program(sp_jax.layers.MoE(cfg.moe_config(), parallel=par,
                                               rngs=nnx.Rngs(0)))
                compile_s[name] = _timed(fn, (moe, xs))
            finally:
                moe_ops.grouped_matmul = real
            programs[name] = (fn, moe)
        gap = None
        if reference:  # the same values both ways (one gradient checked)
            a, b = (programs[n][0](moe, xs)[1] for n in ("MoE, grouped_matmul",
                                                          "MoE, lax.ragged_dot"))
            gap = float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        times: dict[str, list[float]] = {name: [] for name in programs}
        for _ in range(rounds):
            for name, (fn, module) in programs.items():
                times[name].append(_timed(fn, (module, xs)))
    seconds = {name: statistics.median(v) for name, v in times.items()}
    dense_s = seconds["dense MLP (width k F)"]
    return {"tokens_per_device": tokens, "h": h, "F": F, "E": E, "k": k, "ep": ep,
            "rounds": rounds, "seconds": seconds,
            "vs_dense": {n: s / dense_s for n, s in seconds.items()},
            "first_call_s": compile_s, "input_grad_relative_gap": gap,
            "receive_rows": ep * tokens * min(k, E // ep), "routed_rows": tokens * k}


def tile_sweep(*, rows: int = 4096, k: int = 256, n: int = 256, groups: int = 8,
               tiles: tuple[int, ...] = (16, 32, 64, 128), rounds: int = 5
               ) -> dict[str, float]:
    """Median forward+backward seconds of ``grouped_matmul`` on one device per tile (rows
    spread over ``groups`` random-sized groups), and of one dense GEMM of the rows."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sp_jax.ops.moe import grouped_matmul

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(rows, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(groups, k, n)), jnp.float32)
    sizes = jnp.asarray(rng.multinomial(rows, np.ones(groups) / groups), jnp.int32)

    def step(f):
        return jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w) ** 2), argnums=(0, 1)))

    fns = {f"tile {t}": step(lambda x, w, t=t: grouped_matmul(x, w, sizes, tile=t))
           for t in tiles}
    fns["dense GEMM"] = step(lambda x, w: x @ w[0])
    for fn in fns.values():
        _timed(fn, (x, w))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(_timed(fn, (x, w)))
    return {name: statistics.median(v) for name, v in times.items()}


QWEN3_30B_A3B_LAYER = dict(layers=1, h=2048, F=768, E=128, k=8, s=4096, batch=8, heads=32,
                          kv_heads=4)
"""One Qwen3-30B-A3B-shaped block (``benchmarks.moe.compile_moe_stack``'s shapes)."""


def h100_layer_memory(mesh_shape: tuple[int, ...] = (1, 8, 1, 1)) -> dict[str, Any]:
    """Deviceless 8 x H100 compiles of one Qwen3-30B-A3B-shaped block (bf16 compute,
    forward+backward, ``benchmarks.moe.compile_moe_stack``) with ``grouped_matmul`` and with
    ``lax.ragged_dot``: per-GPU peak, temp and the largest buffers live at the peak."""
    from jax import lax

    from benchmarks.moe import compile_moe_stack
    from sp_jax.ops import moe as moe_ops

    out = {}
    real = moe_ops.grouped_matmul
    for name, gemm in (("grouped_matmul", real),
                       ("lax.ragged_dot", lambda x, w, sizes, **_: lax.ragged_dot(x, w, sizes))):
        moe_ops.grouped_matmul = gemm
        try:
            r = compile_moe_stack(mesh_shape, **QWEN3_30B_A3B_LAYER)
        finally:
            moe_ops.grouped_matmul = real
        out[name] = {key: r[key] for key in ("peak_bytes", "temp_bytes", "receive_rows",
                                             "send_rows", "largest_at_peak", "compile_s")}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from sp_jax.xla_flags import apply_xla_flags, cpu_simulation_flags

    apply_xla_flags(cpu_simulation_flags(8))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per device")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-sweep", action="store_true", help="skip the tile sweep")
    parser.add_argument("--cpu-tile", type=int, help="sp_jax.ops.grouped.CPU_TILE for the run")
    parser.add_argument("--no-reference", action="store_true",
                        help="only the dense MLP and the layer with grouped_matmul")
    parser.add_argument("--h100", action="store_true",
                        help="also the deviceless 8 x H100 memory of a Qwen3-30B-A3B block "
                             "(needs the CUDA PJRT plugin)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.cpu_tile:
        from sp_jax.ops import grouped

        grouped.CPU_TILE = args.cpu_tile
    res = {"layer": fine_grained_step_times(tokens=args.tokens, rounds=args.rounds,
                                            reference=not args.no_reference)}
    for name, s in res["layer"]["seconds"].items():
        print(f"{name}: {s:.4f} s ({res['layer']['vs_dense'][name]:.2f}x dense)")
    if res["layer"]["input_grad_relative_gap"] is not None:
        print(f"input gradient, grouped_matmul vs ragged_dot: relative gap "
              f"{res['layer']['input_grad_relative_gap']:.1e}")
    if not args.no_sweep:
        res["tile_sweep"] = tile_sweep(rounds=args.rounds)
        for name, s in res["tile_sweep"].items():
            print(f"{name}: {s:.4f} s")
    if args.h100:
        res["h100"] = h100_layer_memory()
        for name, r in res["h100"].items():
            print(f"H100 {name}: peak {r['peak_bytes'] / 2**20:,.0f} MiB, temp "
                  f"{r['temp_bytes'] / 2**20:,.0f} MiB; largest at the peak "
                  + "; ".join(f"{shape} {b / 2**20:,.0f} MiB"
                              for b, shape, _ in r["largest_at_peak"][:3]))
    res["runtime_s"] = time.perf_counter() - started
    print(f"total {res['runtime_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])

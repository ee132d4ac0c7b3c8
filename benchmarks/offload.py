"""Optimizer state and master weights on the host: device and host bytes per GPU of a
full training step, deviceless 8 x H100 (tensor 8), and the bytes each step moves over
PCIe.

Run: ``PYTHONPATH=. .venv/bin/python benchmarks/offload.py [--layers 8 --hidden 4096
--seq 8192]`` (JSON lines). Each variant compiles :func:`sp_jax.training.train_step_fn`
(AdamW, scanned blocks, bf16 compute, fp32 master weights, one micro-batch of one
sequence) with the shardings :class:`~sp_jax.training.TrainStep` gives it (the offloaded
trees in ``pinned_host``), and reads XLA:GPU's ``memory_analysis()``: device
``argument/output/temp`` bytes and the ``host_*`` bytes it reports separately.

Bytes moved per step: every offloaded array goes to the device and back once
(``2 x`` its bytes); the time is that over the H100's PCIe Gen5 x16 link (64 GB/s per
direction, both directions at once: ``bytes / 2 / 64 GB/s``), set against the step's
model FLOPs (``6 N tokens`` plus attention) at 989 TFLOP/s bf16 dense and 40% MFU. Both
are estimates, said as such in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import sp_jax
from sp_jax.analysis.gpu import default_compiler_options, gpu_mesh
from sp_jax.layout import Layout
from sp_jax.models import GPT, GPTConfig
from sp_jax.training.step import train_step_fn

PCIE_BYTES_PER_S = 64e9   # PCIe Gen5 x16, one direction (H100 SXM host link)
H100_BF16_FLOPS = 989e12  # dense
MFU = 0.4
AXES = ("data", "tensor")


def abstract_on(tree: Any, mesh: Any, host: bool) -> Any:
    """``tree``'s leaves as abstract arrays on ``mesh`` in their specs, in ``pinned_host``
    memory (``host``) or device memory."""
    def leaf(x):
        spec = getattr(getattr(x, "sharding", None), "spec", PartitionSpec())
        sharding = NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.with_memory_kind(
            "pinned_host" if host else "device"))
    return jax.tree.map(leaf, tree)


def measure(layers: int, hidden: int, seq: int, heads: int, tensor: int, *,
            offload_optimizer: bool, offload_params: bool) -> dict[str, Any]:
    """One deviceless compile; per-GPU bytes."""
    parallel = sp_jax.ParallelConfig(recompute_allgather=True, wgrad_dtype=jnp.float32)
    cfg = GPTConfig(vocab_size=32768, max_seq_len=seq, num_layers=layers, num_heads=heads,
                    hidden=hidden, positions="rotary", dtype=jnp.bfloat16,
                    param_dtype=jnp.float32, scan_layers=True)
    tx = optax.adamw(1e-4, weight_decay=0.1)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    mesh = gpu_mesh((1, tensor), AXES)
    with jax.set_mesh(mesh):
        gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(gpt, nnx.Param, ...)
        opt_state = jax.eval_shape(tx.init, params)
        p_in = abstract_on(params, mesh, offload_params)
        o_in = abstract_on(opt_state, mesh, offload_optimizer)
        tokens = jax.ShapeDtypeStruct((1, 1, seq), jnp.int32, sharding=NamedSharding(
            mesh, Layout.of(parallel).micro_batched_tokens))
        step = train_step_fn(graphdef, tx, offload_optimizer=offload_optimizer,
                             offload_params=offload_params, compute_dtype=cfg.dtype)
        compiled, seconds = compile_step(step, p_in, rest, o_in, tokens, key)
    device, host = memory_bytes(compiled)
    per_gpu = lambda t: sum(  # noqa: E731
        x.dtype.itemsize * _size(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(t))
    opt_b, param_b = per_gpu(o_in), per_gpu(p_in)
    moved = 2 * (opt_b * offload_optimizer + param_b * offload_params)
    n = sum(_size(x.shape) for x in jax.tree.leaves(params))
    flops = 6 * n * seq + 12 * layers * hidden * seq * seq  # + causal attention (x1/2 x2)
    compute_s = flops / tensor / (H100_BF16_FLOPS * MFU)
    return {
        "layers": layers, "hidden": hidden, "seq": seq, "tensor": tensor,
        "offload_optimizer": offload_optimizer, "offload_params": offload_params,
        "compile_s": round(seconds, 1),
        "device": device, "host": host,
        "device_peak_gib": (device["argument"] + device["output"] - device["alias"]
                            + device["temp"]) / 2**30,
        "optimizer_gib": opt_b / 2**30, "master_params_gib": param_b / 2**30,
        "moved_gib_per_step": moved / 2**30,
        "pcie_s_estimate": moved / 2 / PCIE_BYTES_PER_S,
        "compute_s_estimate": compute_s,
    }


def compile_step(step: Any, params: Any, rest: Any, opt_state: Any, tokens: Any, key: Any
                 ) -> tuple[Any, float]:
    """``train_step_fn``'s ``step`` compiled for the GPU target on abstract ``params`` and
    ``opt_state`` (their shardings and memory kinds; both donated) and a batch of
    ``tokens`` as tokens and labels; returns it and the seconds the compile took."""
    shard = lambda t: jax.tree.map(lambda x: x.sharding, t)  # noqa: E731
    t0 = time.perf_counter()
    compiled = jax.jit(
        step, in_shardings=(shard(params), None, shard(opt_state), None, None),
        out_shardings=(shard(params), shard(opt_state), None), donate_argnums=(0, 2),
    ).lower(params, rest, opt_state, {"tokens": tokens, "labels": tokens}, key).compile(
        compiler_options=default_compiler_options())
    return compiled, time.perf_counter() - t0


def memory_bytes(compiled: Any) -> tuple[dict[str, int], dict[str, int]]:
    """``(device, host)``: ``memory_analysis()``'s argument, output, alias and temp bytes
    in device memory and in host memory."""
    mem = compiled.memory_analysis()
    kinds = ("argument", "output", "alias", "temp")
    return ({k: int(getattr(mem, f"{k}_size_in_bytes")) for k in kinds},
            {k: int(getattr(mem, f"host_{k}_size_in_bytes")) for k in kinds})


def _size(shape: tuple) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--tensor", type=int, default=8)
    args = parser.parse_args()
    for opt, par in ((False, False), (True, False), (True, True)):
        print(json.dumps(measure(args.layers, args.hidden, args.seq, args.heads, args.tensor,
                                 offload_optimizer=opt, offload_params=par)), flush=True)


if __name__ == "__main__":
    main()

"""Long context on a context mesh axis: deviceless H100 compiles of a 7B-shaped stack at
128k and 1M tokens, activation memory against the sequence length and the mesh, the
attention's communication against the analytic volumes, the ring's causal load balance,
and the CPU cost of the blockwise attention kernel.

- :func:`long_context_compile`: a GPT with 7B-shaped blocks (h=4096, a=32, rotary
  positions; layers run with ``lax.scan``; a 256-entry vocabulary so the blocks dominate)
  at one sequence length on a ``data x context x tensor`` mesh of H100s (1x1x8 for 8
  GPUs, hosts of 8 beyond), the gradients of the loss: per-GPU peak memory for ring and
  Ulysses attention and for TP+SP alone (context 1).
- :func:`activation_scaling`: per-device bytes one block keeps for backward (abstract
  ``jax.vjp`` residuals on the simulated CPU devices; activations only: the difference
  between batch 2 and batch 1, so weights drop out) against the sequence length, for
  meshes of ``context x tensor`` = 1 to 8: they scale as ``s / (context x tensor)``.
- :func:`attention_communication`: the context-axis collectives of one block's
  forward+backward in the compiled H100 program against the analytic volumes.
- :func:`ring_balance`: block products (hence attention FLOPs) per device for ring
  attention on the zigzag order and, for contrast, on contiguous shards.
- :func:`attention_step_times`: CPU time of one attention forward+backward on 8 simulated
  devices (heads sharded), the blockwise kernel against the query-blocked kernel it
  replaced, interleaved rounds.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import sp_jax
from benchmarks.superseded import causal_attention
from sp_jax import Layout
from sp_jax.analysis import compile_for_gpu, gpu_mesh, parse_collectives, saved_residuals
from sp_jax.attention import attention_block_counts, blockwise_attention
from sp_jax.models import GPT, Block, GPTConfig

__all__ = [
    "ContextBench",
    "LongRun",
    "activation_scaling",
    "attention_communication",
    "attention_step_times",
    "layer_grad_compile",
    "long_context_compile",
    "ring_balance",
    "run_context_cpu",
    "run_context_gpu",
]

AXES = ("data", "context", "tensor")
H100_BYTES = 80 * 10**9  # HBM of an H100 SXM (80 GB)
LABELS = {"tp_sp": "TP+SP alone", "ring": "ring", "ulysses": "Ulysses"}


@dataclasses.dataclass(frozen=True)
class LongRun:
    """One deviceless compile: ``mode`` (``"tp_sp"``, ``"ring"`` or ``"ulysses"``) on a
    ``1 x context x tensor`` mesh at sequence length ``s``."""

    mode: str
    context: int
    tensor: int
    s: int

    @property
    def gpus(self) -> int:
        return self.context * self.tensor

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"gpus": self.gpus}


@dataclasses.dataclass(frozen=True)
class ContextBench:
    """Shapes of the long-context benchmark."""

    h: int
    a: int
    layers: int
    block: int  # attention block_q = block_k
    runs: tuple[LongRun, ...]  # long_context_compile
    scaling_s: tuple[int, ...]  # activation_scaling
    scaling_meshes: tuple[tuple[str, int, int], ...]  # (mode, context, tensor)
    comm: tuple[LongRun, ...]  # attention_communication (one block)
    balance_s: int
    balance_contexts: tuple[int, ...]
    timing_s: int
    timing_heads: int
    timing_head_dim: int
    timing_rounds: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _parallel(mode: str, context: int) -> sp_jax.ParallelConfig:
    return sp_jax.ParallelConfig(
        data_axis=None, recompute_allgather=True, wgrad_dtype=jnp.float32,
        context_parallel=None if mode == "tp_sp" or context == 1 else mode)


def _config(bench: ContextBench, s: int, layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=256, max_seq_len=s, num_layers=layers, num_heads=bench.a,
                     hidden=bench.h, dtype=jnp.bfloat16, positions="rotary",
                     scan_layers=layers > 1, attention_block_q=bench.block,
                     attention_block_k=bench.block)


def long_context_compile(bench: ContextBench, run: LongRun) -> dict[str, Any]:
    """Deviceless H100 compile of the loss gradient of a ``bench.layers``-layer GPT
    (scanned blocks, bf16 compute, fp32 parameters) at ``run.s`` tokens, batch 1."""
    cfg = _config(bench, run.s, bench.layers)
    parallel = _parallel(run.mode, run.context)
    shape = (1, run.context, run.tensor)
    with jax.set_mesh(gpu_mesh(shape, AXES)):
        model = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.ShapeDtypeStruct((1, run.s), jnp.int32, sharding=Layout.of(parallel).tokens)

    def grads(params, rest, tokens):
        return jax.grad(lambda p: nnx.merge(graphdef, p, rest).loss(tokens, tokens))(params)

    t0 = time.perf_counter()
    report = compile_for_gpu(grads, params, rest, tokens, mesh_shape=shape, axis_names=AXES)
    mem = {k: v for k, v in report.as_dict().items() if k.endswith("_bytes")}
    return {**run.as_dict(), "compile_s": time.perf_counter() - t0, **mem,
            "fits_h100": mem["peak_bytes"] <= H100_BYTES}


def _block_activation_bytes(bench: ContextBench, mode: str, c: int, t: int, s: int) -> int:
    """Per-device bytes of the activations one block keeps for backward (batch 2 minus
    batch 1: the weights are the same in both and cancel)."""
    cfg = _config(bench, s, 1)
    parallel = _parallel(mode, c)
    mesh = jax.make_mesh((1, c, t), AXES, axis_types=(AxisType.Explicit,) * 3,
                         devices=jax.devices()[: c * t])
    totals = []
    with jax.set_mesh(mesh):
        block = nnx.eval_shape(lambda: Block(cfg, parallel, rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(block)
        for b in (1, 2):
            x = jax.ShapeDtypeStruct((b, s, bench.h), jnp.bfloat16,
                                     sharding=NamedSharding(mesh, Layout.of(parallel).sp))
            residuals = saved_residuals(lambda p, x: nnx.merge(graphdef, p)(x), params, x)
            totals.append(sum(r.device_bytes for r in residuals))
    return totals[1] - totals[0]


def activation_scaling(bench: ContextBench) -> dict[str, Any]:
    """Activation bytes per device of one block for every ``s`` of ``bench.scaling_s`` and
    every mesh of ``bench.scaling_meshes`` (abstract: nothing is computed), with the
    normalised ``bytes * context * tensor / s`` (constant when memory scales as
    ``s / (context x tensor)``)."""
    rows = []
    for mode, c, t in bench.scaling_meshes:
        measured = [_block_activation_bytes(bench, mode, c, t, s) for s in bench.scaling_s]
        rows.append({"mode": mode, "context": c, "tensor": t, "bytes": measured,
                     "per_token_x_devices": [m * c * t / s
                                             for m, s in zip(measured, bench.scaling_s,
                                                             strict=True)]})
    return {"s": list(bench.scaling_s), "h": bench.h, "a": bench.a, "meshes": rows}


def _analytic(run: LongRun, h: int, itemsize: int = 2) -> dict[str, int]:
    """Bytes per device and block the attention moves over the context axis.

    ring: ``kv`` = the device's heads of k and v over the whole sequence; forward sends
    ``(c - 1) / c`` of it; backward sends it again, plus fp32 dk/dv accumulators for the
    same ``c - 1`` steps and their final return home (``1 / c`` of ``kv``; XLA casts it to
    the gradient's dtype before sending). Ulysses: 4 all-to-alls of ``s*h/(c*t)``
    elements each way (q, k, v in, out back; backward: d_out in, dq, dk, dv back)."""
    c, t, s = run.context, run.tensor, run.s
    if run.mode == "ring":
        kv = 2 * s * h // t * itemsize
        return {"forward collective-permute": kv * (c - 1) // c,
                "backward collective-permute": kv * (c - 1) // c + 2 * kv * (c - 1) // c
                + kv // c}
    if run.mode == "ulysses":
        four = 4 * s * h // (c * t) * itemsize
        return {"forward all-to-all": four, "backward all-to-all": four}
    return {}


def layer_grad_compile(make: Any, parallel: sp_jax.ParallelConfig, shape: tuple[int, ...],
                       s: int, hidden: int) -> Any:
    """Deviceless compile for a ``data x context x tensor`` (``shape``) H100 mesh of the
    input and parameter gradients of the layer ``make()`` builds (abstract), on a bf16
    input ``[1, s, hidden]`` in the SP layout (loss: the mean square of its output):
    the :class:`~sp_jax.analysis.GpuCompileReport`."""
    with jax.set_mesh(gpu_mesh(shape, AXES)):
        graphdef, params = nnx.split(nnx.eval_shape(make))
    x = jax.ShapeDtypeStruct((1, s, hidden), jnp.bfloat16, sharding=Layout.of(parallel).sp)

    def grad(params, x):
        def loss(p, x):
            return jnp.mean(nnx.merge(graphdef, p)(x).astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1))(params, x)

    return compile_for_gpu(grad, params, x, mesh_shape=shape, axis_names=AXES)


def attention_communication(bench: ContextBench, run: LongRun) -> dict[str, Any]:
    """Context-axis collectives (collective-permutes, all-to-alls) of one block's
    forward+backward in the compiled H100 program, bytes by phase, against
    :func:`_analytic`."""
    cfg = _config(bench, run.s, 1)
    parallel = _parallel(run.mode, run.context)
    report = layer_grad_compile(lambda: Block(cfg, parallel, rngs=nnx.Rngs(0)), parallel,
                                (1, run.context, run.tensor), run.s, bench.h)
    measured: dict[str, int] = {}
    ops: dict[str, int] = {}
    asynchronous: dict[str, int] = {}
    for col in parse_collectives(report.hlo):
        if col.kind in ("collective-permute", "all-to-all"):
            key = f"{col.phase} {col.kind}"
            measured[key] = measured.get(key, 0) + col.bytes
            ops[key] = ops.get(key, 0) + 1
            asynchronous[key] = asynchronous.get(key, 0) + int(col.is_async)
    return {**run.as_dict(), "measured_bytes": measured, "ops": ops, "async_ops": asynchronous,
            "analytic_bytes": _analytic(run, bench.h)}


def ring_balance(bench: ContextBench) -> list[dict[str, Any]]:
    """Block products per device (:func:`sp_jax.attention.attention_block_counts`, which
    tests/test_attention.py checks against the kernels' own loop counters): the ring on
    the zigzag order and on contiguous shards. Every product is a ``block x block`` score
    block, so attention FLOPs per device are proportional."""
    out = []
    for c in bench.balance_contexts:
        row: dict[str, Any] = {"context": c, "s": bench.balance_s, "block": bench.block}
        for mode in ("ring", "ring_contiguous"):
            counts = attention_block_counts(bench.balance_s, c, mode=mode,
                                            block_q=bench.block, block_k=bench.block)
            row[mode] = {"counts": counts.tolist(),
                         "max_over_mean": float(counts.max() / counts.mean())}
        out.append(row)
    return out


def attention_step_times(bench: ContextBench) -> dict[str, Any]:
    """CPU forward+backward time of the blockwise kernel
    (:func:`sp_jax.attention.blockwise_attention`) and of the query-blocked kernel it
    replaced (:func:`benchmarks.superseded.causal_attention`), fp32, batch 1, heads sharded over
    8 simulated devices, interleaved rounds."""
    n = 8
    mesh = jax.make_mesh((n,), ("tensor",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:n])
    spec = P(None, None, "tensor")
    s, heads, d = bench.timing_s, bench.timing_heads, bench.timing_head_dim
    rng = np.random.default_rng(0)
    kernels = {"query_blocked": causal_attention,
               "blockwise": functools.partial(blockwise_attention, block_q=bench.block,
                                              block_k=bench.block)}
    with jax.set_mesh(mesh):
        q, k, v = (jax.device_put(jnp.asarray(rng.normal(size=(1, s, heads, d)), jnp.float32),
                                  NamedSharding(mesh, spec)) for _ in range(3))
        fns = {}
        for name, kernel in kernels.items():
            attend = jax.shard_map(kernel, in_specs=(spec,) * 3, out_specs=spec)
            fns[name] = jax.jit(jax.grad(lambda q, k, v, f=attend: jnp.sum(f(q, k, v) ** 2),
                                         argnums=(0, 1, 2)))
        for fn in fns.values():
            jax.block_until_ready(fn(q, k, v))
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for r in range(bench.timing_rounds):
            order = list(fns)[r % 2:] + list(fns)[: r % 2]
            for name in order:
                t0 = time.perf_counter()
                jax.block_until_ready(fns[name](q, k, v))
                samples[name].append(time.perf_counter() - t0)
    ratios = [b / q_ for b, q_ in zip(samples["blockwise"], samples["query_blocked"],
                                      strict=True)]
    return {"s": s, "heads": heads, "head_dim": d, "devices": n, "block": bench.block,
            "rounds": bench.timing_rounds,
            "median_s": {name: statistics.median(v) for name, v in samples.items()},
            "ratio_blockwise_to_query_blocked": statistics.median(ratios),
            "ratio_quartiles": [float(x) for x in np.percentile(ratios, [25, 75])]}


def run_context_gpu(bench: ContextBench, log=print) -> dict[str, Any]:
    """The deviceless H100 measurements of ``bench`` (needs the CUDA plugin)."""
    out: dict[str, Any] = {"runs": []}
    for run in bench.runs:
        out["runs"].append(long_context_compile(bench, run))
        r = out["runs"][-1]
        log(f"  {LABELS[run.mode]} {run.context}x{run.tensor}, s={run.s}: peak "
            f"{r['peak_bytes'] / 2**30:.1f} GiB ({r['compile_s']:.0f} s)")
    out["communication"] = [attention_communication(bench, run) for run in bench.comm]
    return out


def run_context_cpu(bench: ContextBench) -> dict[str, Any]:
    """The CPU measurements of ``bench`` (8 simulated devices)."""
    return {"scaling": activation_scaling(bench), "balance": ring_balance(bench),
            "step_time": attention_step_times(bench)}

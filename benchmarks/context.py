"""Long context on a context mesh axis: deviceless 8 x H100 compiles of a 7B-shaped stack at
up to 128k tokens, activation memory against the sequence length, communication against
the analytic volumes, and the CPU cost of blockwise attention.

- :func:`long_context_compile`: a GPT with 7B-shaped blocks (h=4096, a=32; layers run
  with ``lax.scan``; a 256-entry vocabulary so the blocks dominate) at one sequence length
  on ``data x context x tensor`` H100s, forward+backward of the loss: per-GPU peak memory
  for ring and Ulysses attention and for TP+SP alone (context 1, tensor 8).
- :func:`activation_scaling`: per-device bytes one block keeps for backward (abstract
  ``jax.vjp`` residuals on the 8 simulated CPU devices) against the sequence length:
  they scale as ``1 / (context x tensor)``.
- :func:`attention_communication`: the collectives of one attention layer in the compiled
  H100 program against the analytic volumes: ring moves ``(c - 1) / c`` of the key and
  value bytes each way (forward; twice, plus dk/dv, backward), Ulysses runs 4 all-to-alls
  of ``s*b*h/(c*t)`` elements.
- :func:`attention_step_times`: CPU time of one attention forward+backward, the blockwise
  kernel against the query-blocked kernel it replaced, interleaved rounds.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding

import sp_jax
from sp_jax import Layout
from sp_jax.analysis import compile_for_gpu, gpu_mesh, parse_collectives, saved_residuals
from sp_jax.models import Block, GPT, GPTConfig

__all__ = ["MODES", "activation_scaling", "attention_communication", "attention_step_times",
           "long_context_compile"]

MODES = {  # name: (context, tensor, context_parallel)
    "tp_sp": (1, 8, None),
    "ring": (4, 2, "ring"),
    "ulysses": (4, 2, "ulysses"),
}
AXES = ("data", "context", "tensor")


def _parallel(mode: str) -> sp_jax.ParallelConfig:
    return sp_jax.ParallelConfig(data_axis=None, recompute_allgather=True,
                                 wgrad_dtype=jnp.float32, context_parallel=MODES[mode][2])


def long_context_compile(mode: str, *, s: int, h: int = 4096, a: int = 32, layers: int = 4,
                         block: int = 512) -> dict[str, Any]:
    """Deviceless H100 compile of the loss gradient of a ``layers``-layer GPT (scanned
    blocks, bf16 compute, fp32 parameters) at sequence length ``s``, batch 1."""
    c, t, _ = MODES[mode]
    cfg = GPTConfig(vocab_size=256, max_seq_len=s, num_layers=layers, num_heads=a, hidden=h,
                    dtype=jnp.bfloat16, scan_layers=True, attention_block_q=block,
                    attention_block_k=block)
    parallel = _parallel(mode)
    shape = (1, c, t)
    with jax.set_mesh(gpu_mesh(shape, AXES)):
        model = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.ShapeDtypeStruct((1, s), jnp.int32, sharding=Layout.of(parallel).tokens)

    def grads(params, rest, tokens):
        return jax.grad(lambda p: nnx.merge(graphdef, p, rest).loss(tokens, tokens))(params)

    t0 = time.perf_counter()
    report = compile_for_gpu(grads, params, rest, tokens, mesh_shape=shape, axis_names=AXES)
    return {"mode": mode, "context": c, "tensor": t, "s": s, "layers": layers,
            "compile_s": time.perf_counter() - t0,
            **{k: v for k, v in report.as_dict().items() if k.endswith("_bytes")}}


def _block_setup(mode: str, *, s: int, h: int, a: int, block: int, devices: tuple[int, int]):
    c, t = devices
    parallel = sp_jax.ParallelConfig(data_axis=None, recompute_allgather=True,
                                     context_parallel=MODES[mode][2] if c > 1 else None)
    cfg = GPTConfig(vocab_size=256, max_seq_len=s, num_layers=1, num_heads=a, hidden=h,
                    dtype=jnp.bfloat16, attention_block_q=block, attention_block_k=block)
    return cfg, parallel


def activation_scaling(*, s_values: tuple[int, ...], h: int, a: int, block: int
                       ) -> dict[str, Any]:
    """Per-device residual bytes of one block for ``s`` in ``s_values`` and every mode of
    :data:`MODES` (8 simulated CPU devices, abstract: nothing is computed)."""
    out: dict[str, Any] = {"s": list(s_values), "bytes": {}, "h": h, "a": a}
    for mode, (c, t, _) in MODES.items():
        rows = []
        for s in s_values:
            cfg, parallel = _block_setup(mode, s=s, h=h, a=a, block=block, devices=(c, t))
            mesh = jax.make_mesh((1, c, t), AXES, axis_types=(AxisType.Explicit,) * 3,
                                 devices=jax.devices()[: c * t])
            with jax.set_mesh(mesh):
                block_ = nnx.eval_shape(lambda cfg=cfg, p=parallel: Block(cfg, p,
                                                                          rngs=nnx.Rngs(0)))
                graphdef, params = nnx.split(block_)
                x = jax.ShapeDtypeStruct((1, s, h), jnp.bfloat16,
                                         sharding=NamedSharding(mesh, Layout.of(parallel).sp))
                residuals = saved_residuals(lambda p, x: nnx.merge(graphdef, p)(x), params, x)
            weights = {(tuple(p.sharding.shard_shape(p.shape)), np.dtype(p.dtype))
                       for p in jax.tree.leaves(params)}
            rows.append(sum(r.device_bytes for r in residuals
                            if (r.device_shape, r.dtype) not in weights))
        out["bytes"][mode] = rows
    return out


def attention_communication(mode: str, *, s: int, h: int = 4096, a: int = 32,
                            block: int = 512) -> dict[str, Any]:
    """Collectives of one block's forward+backward in the compiled H100 program, by kind
    and phase, with the analytic volumes of the attention's context-axis traffic."""
    c, t, _ = MODES[mode]
    cfg, parallel = _block_setup(mode, s=s, h=h, a=a, block=block, devices=(c, t))
    shape = (1, c, t)
    with jax.set_mesh(gpu_mesh(shape, AXES)):
        block_ = nnx.eval_shape(lambda: Block(cfg, parallel, rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(block_)
    x = jax.ShapeDtypeStruct((1, s, h), jnp.bfloat16, sharding=Layout.of(parallel).sp)

    def grad(params, x):
        return jax.grad(lambda p, x: jnp.mean(nnx.merge(graphdef, p)(x).astype(jnp.float32)
                                              ** 2), argnums=(0, 1))(params, x)

    report = compile_for_gpu(grad, params, x, mesh_shape=shape, axis_names=AXES)
    moved: dict[str, int] = {}
    for col in parse_collectives(report.hlo):
        if col.kind in ("collective-permute", "all-to-all"):
            key = f"{col.phase} {col.kind}"
            moved[key] = moved.get(key, 0) + col.bytes
    kv_bytes = 2 * s * h // t * 2  # this device's heads of k and v over the whole sequence
    analytic = ({"forward collective-permute": kv_bytes * (c - 1) // c}
                if mode == "ring" else
                {"forward all-to-all": 4 * s * h // (c * t) * 2} if mode == "ulysses" else {})
    return {"mode": mode, "s": s, "context": c, "tensor": t, "measured_bytes": moved,
            "analytic_bytes": analytic}


def attention_step_times(*, s: int, heads: int, head_dim: int, rounds: int, inner: int = 1
                         ) -> dict[str, Any]:
    """CPU forward+backward time of the blockwise kernel
    (:func:`sp_jax.attention.blockwise_attention`) and of the query-blocked kernel it
    replaced (:func:`sp_jax.layers.causal_attention`), one device, bf16, interleaved."""
    from sp_jax.attention import blockwise_attention
    from sp_jax.layers import causal_attention

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, s, heads, head_dim)), jnp.bfloat16)
               for _ in range(3))
    kernels = {"query_blocked": causal_attention, "blockwise": blockwise_attention}
    fns = {name: jax.jit(jax.grad(lambda q, k, v, f=f: jnp.sum(f(q, k, v).astype(jnp.float32)),
                                  argnums=(0, 1, 2))) for name, f in kernels.items()}
    for fn in fns.values():
        jax.block_until_ready(fn(q, k, v))
    samples = {name: [] for name in fns}
    for r in range(rounds):
        order = list(fns)[r % 2:] + list(fns)[: r % 2]
        for name in order:
            t0 = time.perf_counter()
            for _ in range(inner):
                out = fns[name](q, k, v)
            jax.block_until_ready(out)
            samples[name].append((time.perf_counter() - t0) / inner)
    ratio = statistics.median(b / q_ for b, q_ in zip(samples["blockwise"],
                                                       samples["query_blocked"], strict=True))
    return {"s": s, "heads": heads, "head_dim": head_dim, "rounds": rounds,
            "median_s": {n: statistics.median(v) for n, v in samples.items()},
            "ratio_blockwise_to_query_blocked": ratio}

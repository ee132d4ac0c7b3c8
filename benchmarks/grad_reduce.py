"""Bytes of the gradient all-reduce over the data axis with and without
``ParallelConfig(grad_reduce_dtype=jnp.bfloat16)`` (deviceless 8 x H100 compile).

``python -m benchmarks.grad_reduce`` compiles the GPT training step (2 layers, h=256,
s=256, bf16 compute, fp32 master weights, 2 micro-batches) for data 4 x tensor 2 H100s
(:func:`sp_jax.analysis.compile_for_gpu`; needs the CUDA plugin, no GPU) and counts,
per dtype, the elements the all-reduces over the data axis carry per device and step.
"""

from __future__ import annotations

import math
import re
import sys

import sp_jax  # noqa: F401  (first: quiets JAX's start-up messages)

DATA_GROUPS = ("replica_groups={{0,2,4,6},{1,3,5,7}}", "replica_groups=[2,4]<=[4,2]T(1,0)")


def data_all_reduce_elements(hlo: str) -> dict[str, int]:
    """{dtype: elements} of the all-reduces over the data axis of a data 4 x tensor 2
    mesh in compiled HLO text."""
    out: dict[str, int] = {}
    for line in hlo.splitlines():
        m = re.search(r"= (\(.*?\)|\S+) all-reduce(-start)?\(", line)
        if not m or not any(g in line.replace(" ", "") for g in DATA_GROUPS):
            continue
        for dtype, shape in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            if shape:
                out[dtype] = out.get(dtype, 0) + math.prod(int(v) for v in shape.split(","))
    return out


def measure(grad_reduce_dtype) -> dict[str, int]:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from sp_jax.analysis.gpu import compile_for_gpu, gpu_mesh
    from sp_jax.layout import Layout
    from sp_jax.models import GPT, GPTConfig
    from sp_jax.training.step import train_step_fn

    cfg = GPTConfig(vocab_size=512, max_seq_len=256, num_layers=2, num_heads=8, hidden=256,
                    positions="rotary", dtype=jnp.bfloat16, param_dtype=jnp.float32,
                    scan_layers=True)
    parallel = sp_jax.ParallelConfig(grad_reduce_dtype=grad_reduce_dtype)
    tx = optax.adamw(1e-4)
    mesh_shape, axes = (4, 2), ("data", "tensor")
    with jax.set_mesh(gpu_mesh(mesh_shape, axes)):
        gpt = nnx.eval_shape(lambda: GPT(cfg, parallel=parallel, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(gpt, nnx.Param, ...)
        opt_state = jax.eval_shape(tx.init, params)
    tokens = jax.ShapeDtypeStruct((2, 8, 256), jnp.int32,
                                  sharding=Layout.of(parallel).micro_batched_tokens)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    rep = compile_for_gpu(train_step_fn(graphdef, tx), params, rest, opt_state,
                          {"tokens": tokens, "labels": tokens}, key, mesh_shape=mesh_shape,
                          axis_names=axes, donate_argnums=(0, 2))
    return data_all_reduce_elements(rep.hlo)


def main() -> int:
    import jax.numpy as jnp

    for name, dtype in (("None (fp32 gradients)", None), ("jnp.bfloat16", jnp.bfloat16)):
        elements = measure(dtype)
        size = {"f32": 4, "bf16": 2}
        mb = sum(n * size.get(t, 4) for t, n in elements.items()) / 1e6
        print(f"| `{name}` | {elements} | {mb:.2f} MB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

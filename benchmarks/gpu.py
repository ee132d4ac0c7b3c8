"""8 x H100 deviceless compiles (no GPU needed): per-device memory, what is live at the
peak, and async collectives.

- :func:`gpu_block`: one block's forward+backward for each variant (the unsharded one on
  a single H100);
- :func:`gpu_gpt`: a full GPT forward+backward (embedding, blocks, tied LM head,
  vocabulary-parallel cross-entropy) in save and recompute mode.

Needs the CUDA PJRT plugin (``pip install -e '.[gpu-aot]'``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType

import sp_jax
from benchmarks.collectives import gpu_compile
from benchmarks.variants import Shape, make_setup
from sp_jax import Layout
from sp_jax.analysis import gpu_mesh
from sp_jax.models import GPT, GPTConfig

__all__ = ["gpu_block", "gpu_gpt"]


def gpu_block(variant: str, shape: Shape) -> dict[str, Any]:
    """Forward+backward of one block of ``variant`` on ``d x t`` H100s (1 for unsharded)."""
    setup = make_setup(variant, shape, abstract=True)
    if variant == "unsharded":
        mesh_shape, axis_types = (1, 1), AxisType.Auto
    else:
        mesh_shape = (shape.d, shape.t)
        axis_types = AxisType.Auto if variant == "gspmd" else AxisType.Explicit
    kw = dict(mesh_shape=mesh_shape, axis_names=("data", "tensor"), axis_types=axis_types,
              unit_elements=shape.s * shape.b_local * shape.h)
    out = gpu_compile(setup.grad_fn(), (setup.params, setup.x), setup, **kw)
    out["devices"] = mesh_shape[0] * mesh_shape[1]
    if variant != "unsharded":  # the forward alone: phases of ops XLA made without metadata
        fwd = gpu_compile(setup.loss, (setup.params, setup.x), setup, live_buffers=False,
                          **kw)
        out["forward_only_compile"] = fwd["all_phases"]
    return out


def gpu_gpt(recompute: bool, *, layers: int, shape: Shape, vocab: int) -> dict[str, Any]:
    """Forward+backward (parameter gradients of the LM loss) of a ``layers``-layer GPT on
    ``t`` H100s (tensor axis only; batch ``b`` replicated)."""
    cfg = GPTConfig(vocab_size=vocab, max_seq_len=shape.s, num_layers=layers,
                    num_heads=shape.a, hidden=shape.h, dtype=shape.dtype,
                    param_dtype=jnp.float32)
    par = sp_jax.ParallelConfig(recompute_allgather=recompute, data_axis=None,
                                wgrad_dtype=jnp.float32)
    with jax.set_mesh(gpu_mesh((shape.t,), ("tensor",))):
        model = nnx.eval_shape(lambda: GPT(cfg, parallel=par, rngs=nnx.Rngs(0)))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jax.ShapeDtypeStruct((shape.b, shape.s), jnp.int32,
                                  sharding=Layout.of(par).tokens)  # replicated batch

    def grads(params, rest, tokens):
        return jax.grad(lambda p: nnx.merge(graphdef, p, rest).loss(tokens, tokens))(params)

    replicated = set()
    for leaf in jax.tree.leaves(params):
        spec = getattr(getattr(leaf, "sharding", None), "spec", None)
        if spec is None or all(e is None for e in spec):
            replicated.add(tuple(sorted(d for d in leaf.shape if d != 1)))
    out = gpu_compile(grads, (params, rest, tokens), None, mesh_shape=(shape.t,),
                      axis_names=("tensor",), unit_elements=shape.s * shape.b * shape.h,
                      param_shapes=replicated)
    out["devices"] = shape.t
    return out

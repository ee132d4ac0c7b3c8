"""Multi-layer stacks of blocks on 8 x H100 (deviceless compiles): per-device peak and temp
memory of sp_jax against the GSPMD baseline, and collective matmul's rings in the schedule.

A single block hides what stays alive across layers (gathered activations waiting for a
weight-gradient GEMM, low-precision weight copies kept from forward to backward), so the
headline memory comparison compiles the forward+backward of ``layers`` blocks in a row
(:class:`sp_jax.models.Block` vs :class:`benchmarks.baseline.GspmdBlock`, same shapes,
bf16 compute) and reads ``memory_analysis()``: per-device peak = temp + arguments +
outputs - aliased; arguments (parameters, input) and outputs (their gradients) are the
same for every variant, temp is what the parallelisation controls.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding

import sp_jax
from benchmarks.baseline import GspmdBlock, param_specs
from benchmarks.records import STACK_VARIANTS
from benchmarks.variants import Shape
from sp_jax import Layout
from sp_jax.analysis import compile_for_gpu, gpu_mesh, parse_collectives
from sp_jax.models import Block, GPTConfig

__all__ = ["RINGS", "STACK_VARIANTS", "Stack", "compile_stack", "ring_report"]


# Collective matmul's rings per layer (HLO scope -> rings): the column layers (qkv, MLP
# up) gather forward and reduce-scatter dx backward (plus re-gather x with recompute);
# the row layers (out, MLP down) reduce-scatter forward and gather dy backward.
RINGS = {"sp_cm_column": 2, "sp_cm_row": 2, "sp_cm_row_bwd": 2, "sp_cm_column_bwd": 2}


@dataclasses.dataclass(frozen=True)
class Stack:
    """``layers`` blocks at sequence length ``s`` with parameters in ``param_dtype``."""

    layers: int
    s: int
    param_dtype: str = "float32"

    @property
    def name(self) -> str:
        params = "" if self.param_dtype == "float32" else f", {self.param_dtype} params"
        return f"{self.layers} layers, s={self.s}{params}"

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"name": self.name}


def _build(variant: str, stack: Stack, shape: Shape) -> nnx.Module:
    pdt = jnp.dtype(stack.param_dtype)
    if variant == "gspmd":
        return nnx.List([GspmdBlock(shape.h, shape.a, dtype=shape.dtype, param_dtype=pdt,
                                    layout=Layout(), rngs=nnx.Rngs(i))
                         for i in range(stack.layers)])
    cfg = GPTConfig(vocab_size=256, max_seq_len=stack.s, num_layers=1, num_heads=shape.a,
                    hidden=shape.h, dtype=shape.dtype, param_dtype=pdt)
    parallel = sp_jax.ParallelConfig(recompute_allgather="recompute" in variant,
                                     collective_matmul=variant.endswith("_cm"),
                                     wgrad_dtype=jnp.float32)
    return nnx.List([Block(cfg, parallel, rngs=nnx.Rngs(i)) for i in range(stack.layers)])


def compile_stack(variant: str, stack: Stack, shape: Shape) -> dict[str, Any]:
    """Deviceless H100 compile of ``stack``'s forward+backward (gradients of a mean-square
    loss w.r.t. the parameters and the input) on a ``data x tensor`` mesh of ``shape``."""
    if variant not in STACK_VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; one of {STACK_VARIANTS}")
    axis = AxisType.Auto if variant == "gspmd" else AxisType.Explicit
    mesh = gpu_mesh((shape.d, shape.t), ("data", "tensor"), axis_types=axis)
    with jax.set_mesh(mesh):
        model = nnx.eval_shape(lambda: _build(variant, stack, shape))
        graphdef, params = nnx.split(model)
        params = jax.tree.map(
            lambda v, spec: jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                 sharding=NamedSharding(mesh, spec)),
            params, param_specs(model))
    x = jax.ShapeDtypeStruct((shape.b, stack.s, shape.h), shape.dtype, sharding=Layout().sp)

    def loss(p, x):
        for block in nnx.merge(graphdef, p):
            x = block(x)
        return jnp.mean(jnp.square(x.astype(jnp.float32)))

    report = compile_for_gpu(jax.grad(loss, argnums=(0, 1)), params, x,
                             mesh_shape=(shape.d, shape.t), axis_names=("data", "tensor"),
                             axis_types=axis)
    out = {k: v for k, v in report.as_dict().items() if k.endswith("_bytes")}
    if variant.endswith("_cm"):
        out["rings"] = ring_report(report.hlo, layers=stack.layers, t=shape.t,
                                   recompute="recompute" in variant)
    return out


def ring_report(hlo: str, *, layers: int, t: int, recompute: bool) -> dict[str, Any]:
    """Collective matmul's transfers in a compiled program, per ring scope: arrays moved
    (against ``t - 1`` per ring and layer), permutes XLA scheduled asynchronously, and
    how many of those have a GEMM between start and done; plus the all-gathers and
    reduce-scatters of activations left anywhere (forward, backward)."""
    collectives = parse_collectives(hlo)
    permutes = [c for c in collectives if c.kind == "collective-permute"]
    scopes = {}
    for scope, rings in RINGS.items():
        mine = [c for c in permutes if f"/{scope}/" in c.op_name]
        per_layer = rings * (2 if scope == "sp_cm_column_bwd" and recompute else 1)
        scopes[scope] = {
            "expected_transfers": per_layer * layers * (t - 1),
            "transfers": sum(c.operands for c in mine),
            "permutes": len(mine),
            "async": sum(c.is_async for c in mine),
            "async_with_gemm": sum(c.is_async and c.overlapped_gemms > 0 for c in mine),
        }
    left = {}
    for c in collectives:
        if c.kind in ("all-gather", "reduce-scatter"):
            key = f"{c.phase} {c.kind}"
            left[key] = left.get(key, 0) + c.operands
    return {"scopes": scopes, "all_gathers_and_reduce_scatters": left}

"""Does XLA:GPU run an FP8 ``jax.lax.ragged_dot`` (the experts' grouped GEMM) as an FP8 GEMM?
A deviceless H100 compile of one grouped GEMM, read off the optimized HLO.

    JAX_PLATFORMS=cpu python -m benchmarks.fp8_ragged_dot [--markdown PATH]

Four programs of a Mixtral-shaped grouped GEMM (``rows`` token rows sorted by expert, ``E``
groups, ``[rows, h] x [E, h, F]``), compiled by :func:`sp_jax.analysis.compile_for_gpu`
for one H100 with :data:`sp_jax.xla_flags.FP8_COMPILER_OPTIONS` (the options under which
sp_jax's FP8 dense GEMMs become cuBLASLt FP8 GEMMs):

- ``dense fp8 (control)``: the dense GEMM of sp_jax's FP8 recipe
  (:func:`sp_jax.ops.fp8.gemm`: e4m3 operands dequantised by their scales, fp32
  accumulation) of ``[rows, h] x [h, F]``;
- ``ragged fp8 recipe``: the same dequantise-then-multiply pattern with ``ragged_dot``;
- ``ragged fp8 direct``: ``ragged_dot`` of the e4m3 operands themselves
  (``preferred_element_type=float32``);
- ``ragged bf16``: the compute-dtype grouped GEMM;
- ``experts fwd+bwd bf16`` / ``experts fwd+bwd fp8``: the gradients (rows, up and down
  weights) of one Mixtral expert layer's grouped FFN, :func:`sp_jax.ops.moe.grouped_ffn`
  (up ``[rows, h] x [E, h, 2F]``, SwiGLU, down ``[rows, F] x [E, F, h]``), in bf16 and
  with ``gemm=`` an FP8 GEMM (current scaling: :func:`sp_jax.ops.moe.fp8_grouped_gemm`, what
  ``GPTConfig(fp8=...)`` runs for the experts).

For each: the GEMM instructions of the optimized HLO (cuBLAS / cuBLASLt custom calls,
their targets, and ``dot`` / fusion kinds) and the element types entering them (an
``f8e4m3fn`` operand reaching the GEMM, or a ``convert`` to bf16 / f32 first).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.analysis import compile_for_gpu
from sp_jax.config import Fp8Recipe
from sp_jax.layers.mlp import MLPActivation
from sp_jax.ops import fp8
from sp_jax.ops.moe import grouped_ffn
from sp_jax.xla_flags import FP8_COMPILER_OPTIONS

__all__ = ["PROGRAMS", "inspect", "main", "markdown"]

E4M3 = jnp.float8_e4m3fn
SHAPE = dict(rows=4096, h=4096, F=14336, E=8)


def _programs(rows: int, h: int, F: int, E: int) -> dict[str, tuple[Any, tuple]]:
    x8 = jax.ShapeDtypeStruct((rows, h), E4M3)
    w8 = jax.ShapeDtypeStruct((E, h, F), E4M3)
    d8 = jax.ShapeDtypeStruct((h, F), E4M3)
    xb = jax.ShapeDtypeStruct((rows, h), jnp.bfloat16)
    wb = jax.ShapeDtypeStruct((E, h, F), jnp.bfloat16)
    scale = jax.ShapeDtypeStruct((), jnp.float32)
    sizes = jax.ShapeDtypeStruct((E,), jnp.int32)

    def dense(a, a_s, b, b_s):
        return fp8.gemm(a, a_s, b, b_s, ((1,), (0,)), jnp.bfloat16)

    def ragged_recipe(a, a_s, b, b_s, g):
        return lax.ragged_dot(fp8.dequantize(a, a_s), fp8.dequantize(b, b_s), g,
                              preferred_element_type=jnp.float32).astype(jnp.bfloat16)

    def ragged_direct(a, b, g):
        return lax.ragged_dot(a, b, g, preferred_element_type=jnp.float32
                              ).astype(jnp.bfloat16)

    def ragged_bf16(a, b, g):
        return lax.ragged_dot(a, b, g)

    def experts(gemm):
        def grads(x, w_up, w_down, g):
            def loss(x, w_up, w_down):
                y = grouped_ffn(x, g, w_up, w_down, MLPActivation("swiglu"), gemm=gemm)
                return jnp.sum(y.astype(jnp.float32) ** 2)
            return jax.grad(loss, argnums=(0, 1, 2))(x, w_up, w_down)
        return grads

    up = jax.ShapeDtypeStruct((E, h, 2 * F), jnp.bfloat16)
    down = jax.ShapeDtypeStruct((E, F, h), jnp.bfloat16)
    return {"dense fp8 (control)": (dense, (x8, scale, d8, scale)),
            "ragged fp8 recipe": (ragged_recipe, (x8, scale, w8, scale, sizes)),
            "ragged fp8 direct": (ragged_direct, (x8, w8, sizes)),
            "ragged bf16": (ragged_bf16, (xb, wb, sizes)),
            "experts fwd+bwd bf16": (experts(None), (xb, up, down, sizes)),
            "experts fwd+bwd fp8": (experts(fp8.Fp8Gemm(fp8.Fp8Spec(Fp8Recipe("current"),
                                                                    ()))),
                                    (xb, up, down, sizes))}


PROGRAMS = tuple(_programs(**SHAPE))
"""The names of the compiled programs."""

_GEMM = re.compile(r'custom_call_target="(__cublas[^"]*|__cudnn[^"]*|__triton[^"]*)"')
_FUSION_KIND = re.compile(r'"kind":"(__triton[^"]*|__cudnn[^"]*)"')


def inspect(hlo: str) -> dict[str, Any]:
    """The GEMMs of an optimized HLO text: cuBLAS / cuDNN / Triton custom-call targets,
    Triton / cuDNN GEMM fusions, the element types of the GEMM calls' two matrix operands
    (``f8e4m3fn``: the FP8 values reach the GEMM; ``bf16`` / ``f32``: converted first),
    and whether one is cuBLASLt's FP8 GEMM."""
    types = {m[1]: m[2] for m in re.finditer(r"%([\w.\-]+) = \(?(\w+)\[", hlo)}
    operands = []
    for m in re.finditer(r"custom-call\(([^)]*)\), custom_call_target=\"__cublas", hlo):
        names = [o.strip().lstrip("%") for o in m[1].split(",")][:2]
        operands.append([types.get(n, "?") for n in names])
    return {
        "custom_calls": sorted(set(_GEMM.findall(hlo))),
        "fusion_kinds": sorted(set(_FUSION_KIND.findall(hlo))),
        "gemm_operand_types": operands,
        "fp8_gemm": "__cublas$lt$matmul$f8" in hlo,
        "fp8_gemms": hlo.count('custom_call_target="__cublas$lt$matmul$f8"'),
        "gemms": len(re.findall(r'custom_call_target="__cublas', hlo)),
    }


def run(rows: int = SHAPE["rows"], h: int = SHAPE["h"], F: int = SHAPE["F"],
        E: int = SHAPE["E"], hlo_dir: Path | None = None) -> dict[str, dict[str, Any]]:
    """Each program's :func:`inspect` of its deviceless H100 compile (its HLO text
    written into ``hlo_dir`` when given)."""
    out = {}
    for name, (fn, args) in _programs(rows, h, F, E).items():
        rep = compile_for_gpu(fn, *args, mesh_shape=(1,), axis_names=("x",),
                              axis_types=jax.sharding.AxisType.Auto,
                              compiler_options=FP8_COMPILER_OPTIONS)
        out[name] = {**inspect(rep.hlo), "temp_bytes": rep.temp_bytes}
        if hlo_dir is not None:
            hlo_dir.mkdir(parents=True, exist_ok=True)
            (hlo_dir / (name.split(" (")[0].replace(" ", "_") + ".hlo")).write_text(rep.hlo)
    return out


def markdown(res: dict[str, dict[str, Any]]) -> str:
    """A table of :func:`run`'s result."""
    lines = ["| program | cuBLAS(Lt) FP8 GEMMs | GEMM custom calls | their operands | "
             "Triton / cuDNN fusions | temp (MiB) |", "|---|---|---|---|---|---|"]
    for name, r in res.items():
        lines.append(f"| {name} | {r['fp8_gemms']} of {r['gemms']} | "
                     f"{', '.join(f'`{c}`' for c in r['custom_calls']) or 'none'} | "
                     f"{'; '.join(' x '.join(t) for t in r['gemm_operand_types'])} | "
                     f"{', '.join(f'`{c}`' for c in r['fusion_kinds']) or 'none'} | "
                     f"{r['temp_bytes'] / 2**20:,.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fp8_ragged_dot",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", type=Path, help="write the table here")
    parser.add_argument("--hlo", type=Path, help="write each program's HLO into this folder")
    args = parser.parse_args(argv)
    res = run(hlo_dir=args.hlo)
    for name, r in res.items():
        print(name, r)
    text = markdown(res)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return res


if __name__ == "__main__":
    main()

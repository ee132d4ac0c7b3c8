"""FP8 training: what it changes on 8 x H100 (deviceless compiles) and in the loss on CPU.

``python -m benchmarks.fp8 [--quick] [--json PATH] [--markdown PATH]`` (part of ``make
bench``):

* H100: the forward+backward of ``layers`` :class:`sp_jax.models.Block` s (h=4096,
  s=2048, t=8, bf16 compute, fp32 parameters and weight gradients,
  ``recompute_allgather``) in bf16 and with ``GPTConfig(fp8=Fp8Recipe(...))``, compiled
  with :data:`sp_jax.xla_flags.FP8_COMPILER_OPTIONS` (cuBLASLt FP8 GEMMs): the
  tensor-axis bytes per layer by collective kind and element type, the per-device peak and
  temp, and the cuBLASLt FP8 GEMMs per layer.
* CPU: the demo (``examples/train_gpt.py``: its default model, data and 8 simulated
  devices) trained ``steps`` steps in bf16 and with ``--fp8``, from the same
  initialisation and batches; the held-out loss at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

import sp_jax
from benchmarks.records import fmt_mib
from sp_jax.analysis import array_bytes, compile_for_gpu, gpu_mesh, parse_collectives
from sp_jax.models import Block, GPTConfig
from sp_jax.xla_flags import FP8_COMPILER_OPTIONS

__all__ = ["FULL", "QUICK", "Fp8Bench", "compile_fp8_stack", "cpu_losses",
           "run_fp8"]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"
RECIPES = {"bf16": None, "fp8 current": sp_jax.Fp8Recipe("current"),
           "fp8 delayed": sp_jax.Fp8Recipe("delayed")}


@dataclasses.dataclass(frozen=True)
class Fp8Bench:
    """What :func:`run_fp8` measures: the H100 stack's shape and the CPU run's length."""

    layers: int = 8
    h: int = 4096
    s: int = 2048
    heads: int = 32
    t: int = 8
    cpu_steps: int = 300
    cpu_eval_batches: int = 8

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FULL = Fp8Bench()
QUICK = Fp8Bench(layers=2, h=256, s=256, heads=8, cpu_steps=0)  # no CPU runs


def compile_fp8_stack(recipe: sp_jax.Fp8Recipe | None, bench: Fp8Bench) -> dict[str, Any]:
    """Deviceless 8 x H100 compile of ``bench.layers`` Blocks' gradients (mean-square
    loss, w.r.t. the parameters and the input) with ``recipe``."""
    cfg = GPTConfig(vocab_size=256, max_seq_len=bench.s, num_layers=1, num_heads=bench.heads,
                    hidden=bench.h, dtype=jnp.bfloat16, fp8=recipe)
    parallel = sp_jax.ParallelConfig(recompute_allgather=True, data_axis=None,
                                     wgrad_dtype=jnp.float32)
    with jax.set_mesh(gpu_mesh((bench.t,), ("tensor",))):
        blocks = nnx.eval_shape(lambda: nnx.List(
            [Block(cfg, parallel, rngs=nnx.Rngs(i)) for i in range(bench.layers)]))
        graphdef, params = nnx.split(blocks)
    x = jax.ShapeDtypeStruct((1, bench.s, bench.h), jnp.bfloat16, sharding=P(None, "tensor"))

    def loss(p, x):
        for block in nnx.merge(graphdef, p):
            x = block(x)
        return jnp.mean(jnp.square(x.astype(jnp.float32)))

    rep = compile_for_gpu(jax.grad(loss, argnums=(0, 1)), params, x, mesh_shape=(bench.t,),
                          axis_names=("tensor",), compiler_options=FP8_COMPILER_OPTIONS)
    by_kind: dict[str, int] = {}
    for c in parse_collectives(rep.hlo):
        for dtype, dims in c.arrays:
            key = f"{c.kind} {dtype}"
            by_kind[key] = by_kind.get(key, 0) + array_bytes(dtype, dims)
    gemms = re.findall(r'custom_call_target="(__cublas\$[^"]+)"', rep.hlo)
    return {"peak_bytes": rep.peak_bytes, "temp_bytes": rep.temp_bytes,
            "bytes_per_layer": {k: v / bench.layers for k, v in sorted(by_kind.items())},
            "fp8_gemms_per_layer": gemms.count("__cublas$lt$matmul$f8") / bench.layers,
            "other_gemms_per_layer": (len(gemms) - gemms.count("__cublas$lt$matmul$f8"))
            / bench.layers}


def cpu_losses(fp8: str | None, steps: int, eval_batches: int, out: Path) -> dict[str, Any]:
    """``examples/train_gpt.py`` (the demo: its default model and data) for ``steps``
    steps in bf16 (``--precision bf16``), with ``--fp8 fp8`` if given, in a subprocess;
    the held-out loss at the end and the training losses from its JSON log."""
    log = out / f"fp8_cpu_{fp8 or 'bf16'}.jsonl"
    argv = [sys.executable, str(EXAMPLE), "--steps", str(steps), "--precision", "bf16",
            "--eval-every", str(steps), "--eval-batches", str(eval_batches),
            "--log-json", str(log), *(["--fp8", fp8] if fp8 else [])]
    started = time.perf_counter()
    subprocess.run(argv, check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                   stdout=subprocess.DEVNULL)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    return {"held_out_loss": evals[-1], "train_losses": [r["loss"] for r in records
                                                         if "loss" in r],
            "seconds": time.perf_counter() - started}


def run_fp8(bench: Fp8Bench = FULL, log=print, out: Path | None = None) -> dict[str, Any]:
    """The section's measurements and targets (the CPU runs' logs in ``out``, else a
    temporary directory)."""
    started = time.perf_counter()
    gpu = {}
    for name, recipe in RECIPES.items():
        gpu[name] = compile_fp8_stack(recipe, bench)
        log(f"  H100 {name}: peak {fmt_mib(gpu[name]['peak_bytes'])}, temp "
            f"{fmt_mib(gpu[name]['temp_bytes'])}")
    cpu = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, recipe in RECIPES.items() if bench.cpu_steps else ():
            cpu[name] = cpu_losses(recipe and recipe.scaling, bench.cpu_steps,
                                   bench.cpu_eval_batches, Path(out or tmp))
            log(f"  CPU {name}: held-out loss {cpu[name]['held_out_loss']:.4f}")
    base = gpu["bf16"]
    gathers = {name: sum(v for k, v in r["bytes_per_layer"].items()
                         if k.startswith("all-gather")) for name, r in gpu.items()}
    targets = []
    for name in ("fp8 current", "fp8 delayed"):
        r = gpu[name]
        targets.append({
            "id": f"fp8_h100_{name.split()[1]}",
            "target": f"8 x H100, {name}: the activation all-gathers' bytes per layer halved "
                      "vs bf16; peak and temp vs bf16; every linear GEMM a cuBLASLt FP8 GEMM",
            "measured": f"all-gathers {fmt_mib(gathers[name])} vs {fmt_mib(gathers['bf16'])} per "
                        f"layer; peak {fmt_mib(r['peak_bytes'])} vs {fmt_mib(base['peak_bytes'])}, "
                        f"temp {fmt_mib(r['temp_bytes'])} vs {fmt_mib(base['temp_bytes'])}; "
                        f"{r['fp8_gemms_per_layer']:g} FP8 GEMMs per layer",
            "met": gathers[name] <= 0.5 * gathers["bf16"] + 1
            and r["temp_bytes"] < base["temp_bytes"] and r["fp8_gemms_per_layer"] == 12})
        target = {"id": f"fp8_cpu_{name.split()[1]}",
                  "target": f"CPU: the demo, {bench.cpu_steps} steps, {name}: held-out loss "
                            "within 3% of the bf16 run", "measured": "not run", "met": None}
        if cpu:
            held, ref = cpu[name]["held_out_loss"], cpu["bf16"]["held_out_loss"]
            target |= {"measured": f"{held:.4f} vs {ref:.4f} ({(held - ref) / ref:+.2%})",
                       "met": abs(held - ref) <= 0.03 * ref}
        targets.append(target)
    return {"config": bench.as_dict(), "gpu": gpu, "cpu": cpu, "targets": targets,
            "meta": {"runtime_s": time.perf_counter() - started}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from benchmarks.render.fp8 import render_markdown
    from benchmarks.section import section_main

    return section_main(argv, description=__doc__.splitlines()[0], run=run_fp8, full=FULL,
                        quick=QUICK, render=render_markdown, quick_help="tiny shapes, no CPU runs")


if __name__ == "__main__":
    main()

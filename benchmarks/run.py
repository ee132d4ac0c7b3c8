"""Runs every measurement of ``python -m benchmarks`` in one process, then the report.

See :mod:`benchmarks` for what is measured. ``main`` parses the command line; ``run``
does the work and returns the results as one JSON-serialisable dict.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import time
from pathlib import Path
from typing import Any

import flax
import jax
import jax.numpy as jnp

from benchmarks.collectives import MEGATRON, cpu_block_collectives
from benchmarks.context import ContextBench, LongRun, run_context_cpu, run_context_gpu
from benchmarks.fsdp import FULL as FSDP_FULL
from benchmarks.fsdp import QUICK as FSDP_QUICK
from benchmarks.fsdp import FsdpBench
from benchmarks.generation import FULL as GENERATION_FULL
from benchmarks.generation import QUICK as GENERATION_QUICK
from benchmarks.generation import GenerationBench, run_generation
from benchmarks.gpt_timing import Model
from benchmarks.memory import activation_memory
from benchmarks.moe import FULL as MOE_FULL
from benchmarks.moe import QUICK as MOE_QUICK
from benchmarks.moe import MoEBench, run_moe
from benchmarks.pipeline import FULL as PIPELINE_FULL
from benchmarks.pipeline import QUICK as PIPELINE_QUICK
from benchmarks.pipeline import PipelineBench, run_pipeline
from benchmarks.records import load_recorded
from benchmarks.stacks import STACK_VARIANTS, Stack
from benchmarks.targets import evaluate_targets
from benchmarks.text import FULL as TEXT_FULL
from benchmarks.text import QUICK as TEXT_QUICK
from benchmarks.text import TextBench, run_text
from benchmarks.variants import SP_VARIANTS, VARIANTS, Shape, make_setup
from benchmarks.zero1 import FULL as ZERO1_FULL
from benchmarks.zero1 import QUICK as ZERO1_QUICK
from benchmarks.zero1 import Zero1Bench, run_zero1
from sp_jax.analysis import activation_bytes_formula

__all__ = ["Config", "FULL", "QUICK", "RECORDED", "main", "run"]

RECORDED = Path(__file__).resolve().parents[1] / "docs" / "bench_recorded.json"
"""The sections of ``BENCHMARKS.md`` that ``make bench`` does not measure
(:func:`benchmarks.records.load_recorded`), copied into the run's results."""


@dataclasses.dataclass(frozen=True)
class Config:
    """Shapes and repeat counts of one benchmark run."""

    realistic: Shape  # activation memory and the H100 block compiles
    t_values: tuple[int, ...]  # activation memory vs t (realistic s)
    s_values: tuple[int, ...]  # activation memory vs s (realistic t)
    cpu_collectives: Shape  # CPU compile (8 simulated devices); s has a factor 5
    gpt_layers: int
    gpt_vocab: int
    timing: Shape
    rounds: int
    inner: int
    warmup: int
    stack_shape: Shape  # multi-layer H100 compiles (b, h, a, t; s per stack)
    stacks: tuple[Stack, ...]  # the first two: same s, fewer and more layers; then others
    gpt_models: tuple[Model, ...]  # CPU training step time, sp_jax vs the GSPMD GPT
    gpt_rounds: int
    context: ContextBench  # long context: ring / Ulysses on a context axis
    pipeline: PipelineBench  # pipeline parallelism: GPipe vs 1F1B (deviceless H100)
    text: TextBench  # packed documents: input pipeline vs step, packing, masked attention
    generation: GenerationBench  # decode tokens/s vs transformers, the H100 decode step
    fsdp: FsdpBench = FSDP_FULL  # the training step sharded over data (deviceless H100)
    zero1: Zero1Bench = ZERO1_FULL  # ZeRO-1 against the replicated step (deviceless H100)
    moe: MoEBench = MOE_FULL  # mixture of experts: Mixtral-shaped H100 stack, CPU, planner
    fp8: bool = True  # FP8: 8 H100 blocks vs bf16, the demo's loss (benchmarks.fp8; minutes)
    timing_fp32: bool = True  # also time the variants with fp32 compute (secondary)
    plans: bool = True  # the memory planner's 7B / 70B plans (deviceless, minutes)
    stack_variants: tuple[str, ...] = STACK_VARIANTS


FULL = Config(
    realistic=Shape(h=4096, a=32, s=2048, b=1, t=8),
    t_values=(1, 2, 4, 8),
    s_values=(512, 1024, 2048, 4096),
    cpu_collectives=Shape(h=256, a=8, s=160, b=8, t=4, d=2),
    gpt_layers=2,
    gpt_vocab=32768,
    timing=Shape(h=256, a=8, s=256, b=8, t=4, d=2),
    rounds=15,
    inner=3,
    warmup=2,
    stack_shape=Shape(h=4096, a=32, s=2048, b=1, t=8),
    stacks=(Stack(4, 2048), Stack(8, 2048), Stack(8, 2048, "bfloat16"), Stack(4, 8192)),
    gpt_models=tuple(
        Model(name, dtype=dtype, **shape)
        for name, shape in (("demo", dict(layers=2, hidden=128, heads=4, seq=128)),
                            ("4 layers, h=256", dict(layers=4, hidden=256, heads=8, seq=256)))
        for dtype in ("float32", "bfloat16")),
    gpt_rounds=21,
    context=ContextBench(
        h=4096, a=32, layers=4, block=512,
        runs=(LongRun("tp_sp", 1, 8, 131072), LongRun("ring", 4, 2, 131072),
              LongRun("ulysses", 4, 2, 131072), LongRun("ring", 8, 1, 131072),
              LongRun("ulysses", 8, 1, 131072), LongRun("tp_sp", 1, 8, 1048576),
              LongRun("ring", 8, 8, 1048576), LongRun("ulysses", 4, 8, 1048576)),
        scaling_s=(8192, 16384, 32768, 65536, 131072),
        scaling_meshes=(("tp_sp", 1, 1), ("tp_sp", 1, 8), ("ring", 2, 1), ("ring", 2, 2),
                        ("ring", 4, 2), ("ring", 8, 1), ("ulysses", 2, 2),
                        ("ulysses", 4, 2), ("ulysses", 8, 1)),
        comm=(LongRun("ring", 4, 2, 131072), LongRun("ulysses", 4, 2, 131072)),
        balance_s=131072, balance_contexts=(2, 4, 8),
        timing_s=2048, timing_heads=8, timing_head_dim=64, timing_rounds=15),
    pipeline=PIPELINE_FULL,
    text=TEXT_FULL,
    generation=GENERATION_FULL,
)

QUICK = Config(  # 5as/h = 80 as in FULL, so the memory terms compare alike
    realistic=Shape(h=128, a=8, s=256, b=1, t=8),
    t_values=(1, 8),
    s_values=(128, 256),
    cpu_collectives=Shape(h=64, a=8, s=40, b=4, t=4, d=2),
    gpt_layers=1,
    gpt_vocab=512,
    timing=Shape(h=64, a=8, s=64, b=4, t=4, d=2),
    rounds=2,
    inner=1,
    warmup=1,
    stack_shape=Shape(h=128, a=8, s=128, b=1, t=8),
    stacks=(Stack(1, 128), Stack(2, 128)),
    gpt_models=(Model("tiny", layers=1, hidden=32, heads=4, seq=32, batch=8),),
    gpt_rounds=2,
    timing_fp32=False,
    plans=False,
    stack_variants=("gspmd", "sp_save", "sp_recompute", "sp_recompute_cm"),
    context=ContextBench(
        h=128, a=8, layers=1, block=64,
        runs=(LongRun("tp_sp", 1, 8, 512), LongRun("ulysses", 4, 2, 512)),
        scaling_s=(256, 512), scaling_meshes=(("tp_sp", 1, 1), ("ring", 4, 2),
                                              ("ulysses", 4, 2)),
        comm=(LongRun("ring", 4, 2, 256), LongRun("ulysses", 4, 2, 256)),
        balance_s=1024, balance_contexts=(4,),
        timing_s=256, timing_heads=8, timing_head_dim=16, timing_rounds=2),
    # M = 8 only (the targets' and tables' M), R = 1: one compile per schedule; one block
    # per stage (8 blocks: 34 s of compiles, 4: 25 s)
    pipeline=dataclasses.replace(PIPELINE_QUICK, microbatches=(8,), repeats=(1,), layers=4),
    text=TEXT_QUICK,  # tiny model, 20 batches per pipeline, s=1024 attention
    generation=GENERATION_QUICK,  # llama-tiny, batch 8, 8 tokens, 2 rounds
    moe=MOE_QUICK,
    fsdp=FSDP_QUICK,  # 2 layers, h=512, data 8
    zero1=ZERO1_QUICK,  # 2 layers, h=512, data 8
    fp8=False,  # its own quick run: python -m benchmarks.fp8 --quick
)


def _log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _memory(cfg: Config) -> dict[str, Any]:
    sh = cfg.realistic
    cache: dict[tuple[str, Shape], dict[str, Any]] = {}

    def measure(v: str, shape: Shape) -> int:
        if (v, shape) not in cache:
            cache[(v, shape)] = activation_memory(v, shape)
        return cache[(v, shape)]["activation_bytes"]

    realistic = {v: activation_memory(v, sh, detail=True) for v in VARIANTS}
    for v, m in realistic.items():
        cache[(v, sh)] = m
    vs_t: dict[str, Any] = {"t": list(cfg.t_values), "measured": {}}
    for v in ("gspmd", *SP_VARIANTS):
        vs_t["measured"][v] = [measure(v, sh.replace(t=t)) for t in cfg.t_values]
    f = activation_bytes_formula
    vs_t["formula"] = {mode: [f(sh.s, sh.b, sh.h, sh.a, t, mode) for t in cfg.t_values]
                       for mode in ("tp", "tp_sp", "tp_sp_selective")}
    vs_s: dict[str, Any] = {"s": list(cfg.s_values), "measured": {}}
    for v in VARIANTS:
        vs_s["measured"][v] = [measure(v, sh.replace(s=s)) for s in cfg.s_values]
    vs_s["formula"] = {
        "none": [f(s, sh.b, sh.h, sh.a, 1, "none") for s in cfg.s_values],
        "tp_sp": [f(s, sh.b, sh.h, sh.a, sh.t, "tp_sp") for s in cfg.s_values],
        "tp_sp_selective": [f(s, sh.b, sh.h, sh.a, sh.t, "tp_sp_selective")
                            for s in cfg.s_values],
    }
    return {"shape": sh.as_dict(), "realistic": realistic, "vs_t": vs_t, "vs_s": vs_s}


def _collectives_cpu(cfg: Config) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": cfg.cpu_collectives.as_dict()}
    for v in ("gspmd", *SP_VARIANTS):
        out[v] = cpu_block_collectives(make_setup(v, cfg.cpu_collectives, abstract=True))
    return out


def _gpu(cfg: Config) -> dict[str, Any]:
    from benchmarks.gpu import gpu_block, gpu_gpt  # needs the CUDA plugin

    sh = cfg.realistic
    block = {"shape": sh.as_dict()}
    for v in VARIANTS:
        block[v] = gpu_block(v, sh)
    gpt = {"layers": cfg.gpt_layers, "vocab": cfg.gpt_vocab, "shape": sh.as_dict()}
    for name, rec in (("sp_save", False), ("sp_recompute", True)):
        gpt[name] = gpu_gpt(rec, layers=cfg.gpt_layers, shape=sh, vocab=cfg.gpt_vocab)
    return {"block": block, "gpt": gpt}


def _fsdp(cfg: Config) -> dict[str, Any]:
    from benchmarks.fsdp import run_fsdp  # needs the CUDA plugin

    return run_fsdp(cfg.fsdp)


def _stacks(cfg: Config) -> dict[str, Any]:
    from benchmarks.stacks import compile_stack  # needs the CUDA plugin

    sh = cfg.stack_shape
    out: dict[str, Any] = {"shape": sh.as_dict(), "stacks": []}
    for stack in cfg.stacks:
        row = {"stack": stack.as_dict()}
        for v in cfg.stack_variants:
            row[v] = compile_stack(v, stack, sh.replace(s=stack.s))
        out["stacks"].append(row)
        _log(f"  {stack.name}: " + ", ".join(
            f"{v} {row[v]['peak_bytes'] / 2**20:.1f} MiB" for v in cfg.stack_variants))
    return out


def _gpt_times(cfg: Config) -> list[dict[str, Any]]:
    from benchmarks.gpt_timing import gpt_step_times

    out = []
    for model in cfg.gpt_models:
        out.append(gpt_step_times(model, rounds=cfg.gpt_rounds, inner=1,
                                  warmup=cfg.warmup))
        _log(f"  {model.name} {model.dtype}: " + ", ".join(
            f"{v} {r:.2f}x" for v, r in out[-1]["ratio_to_reference"].items()))
    return out


def run(cfg: Config = FULL, *, quick: bool = False) -> dict[str, Any]:
    """Runs every measurement; returns the results (see ``BENCHMARKS.md`` for the meaning
    of each number)."""
    if jax.device_count() < 8:
        raise RuntimeError(
            f"the benchmark needs 8 devices, found {jax.device_count()}: run it as "
            "`python -m benchmarks` (which simulates 8 CPU devices) or set XLA_FLAGS="
            "--xla_force_host_platform_device_count=8 before JAX starts.")
    from benchmarks.timing import step_times

    start = time.perf_counter()
    seconds: dict[str, float] = {}
    results: dict[str, Any] = {}

    def section(name, fn):
        t0 = time.perf_counter()
        _log(f"{name} ...")
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - recorded in the report, the rest still runs
            if name not in ("gpu", "stacks", "context", "pipeline", "generation", "fsdp",
                            "zero1", "plan", "moe", "fp8"):
                raise
            results[name] = {"error": f"{type(e).__name__}: {e}"}
            _log(f"{name} failed: {results[name]['error']}")
        seconds[name] = time.perf_counter() - t0
        _log(f"{name} done in {seconds[name]:.1f} s")

    section("memory", lambda: _memory(cfg))
    section("collectives_cpu", lambda: _collectives_cpu(cfg))
    section("gpu", lambda: _gpu(cfg))
    section("stacks", lambda: _stacks(cfg))
    section("step_time", lambda: step_times(cfg.timing, rounds=cfg.rounds, inner=cfg.inner,
                                            warmup=cfg.warmup))
    if cfg.timing_fp32:
        section("step_time_fp32", lambda: step_times(
            cfg.timing.replace(dtype=jnp.float32), rounds=cfg.rounds, inner=cfg.inner,
            warmup=cfg.warmup))
    section("gpt_step_time", lambda: _gpt_times(cfg))
    section("context", lambda: run_context_gpu(cfg.context, log=_log))
    section("context_cpu", lambda: run_context_cpu(cfg.context))
    section("pipeline", lambda: run_pipeline(cfg.pipeline, log=_log))  # CUDA plugin
    section("text", lambda: run_text(cfg.text, log=_log))  # its H100 part: CUDA plugin
    # transformers from $SP_JAX_TORCH_PYTHON (else its ratio is not measured); H100: plugin
    section("generation", lambda: run_generation(cfg.generation, log=_log))
    section("fsdp", lambda: _fsdp(cfg))  # CUDA plugin
    section("zero1", lambda: run_zero1(cfg.zero1))  # CUDA plugin
    section("moe", lambda: run_moe(cfg.moe, log=_log))  # CUDA plugin
    if cfg.fp8:
        from benchmarks.fp8 import run_fp8

        section("fp8", lambda: run_fp8(log=_log))  # CUDA plugin; the demo as subprocesses
    if cfg.plans:
        from benchmarks.plan import run_plans

        section("plan", lambda: run_plans(log=_log))
    results["megatron"] = MEGATRON
    # the sections measured outside the run (each says when, how and where); a quick run
    # renders what it measured only
    results["recorded"] = [] if quick else load_recorded(RECORDED)
    results["meta"] = {
        "quick": quick,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "devices": f"{jax.device_count()} x {jax.devices()[0].platform}",
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "section_seconds": seconds,
        "runtime_s": time.perf_counter() - start,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items()
                   if not isinstance(v, dict | tuple | list) or k.endswith("_values")} | {
            k: getattr(cfg, k).as_dict()
            for k in ("realistic", "cpu_collectives", "timing", "stack_shape", "context",
                      "pipeline", "text", "generation")} | {
            "fsdp": dataclasses.asdict(cfg.fsdp), "zero1": dataclasses.asdict(cfg.zero1)} | {
            "stacks": [s.as_dict() for s in cfg.stacks],
            "gpt_models": [m.as_dict() for m in cfg.gpt_models]},
    }
    results["targets"] = evaluate_targets(results)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Parses ``argv`` (``--out DIR`` required, ``--quick``), runs, writes the outputs and
    returns the results."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark sp_jax's TP+SP block against a GSPMD baseline and the "
                    "unsharded block; writes BENCHMARKS.md, docs/bench.json and plots.")
    parser.add_argument("--out", type=Path, required=True,
                        help="output directory: OUT/BENCHMARKS.md, OUT/docs/bench.json and "
                             "OUT/docs/bench_memory_vs_{t,s}.png (`make bench`: the "
                             "repository root)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes and few repeats (seconds; for tests)")
    args = parser.parse_args(argv)
    from benchmarks.report import write_outputs

    cfg = QUICK if args.quick else FULL
    results = run(cfg, quick=args.quick)
    paths = write_outputs(results, args.out)
    met = sum(t["met"] is True for t in results["targets"])
    _log(f"targets met: {met}/{len(results['targets'])}; wrote " +
         ", ".join(str(p) for p in paths))
    _log(f"total {results['meta']['runtime_s']:.0f} s")
    return results


"""The FP8 section of BENCHMARKS.md from :func:`benchmarks.fp8.run_fp8`'s results."""

from __future__ import annotations

from typing import Any

from benchmarks.fp8 import fmt_mib
from benchmarks.section import status, table


def render_markdown(res: dict[str, Any]) -> str:
    """The ``## FP8`` section of ``BENCHMARKS.md``."""

    c, gpu, cpu = res["config"], res["gpu"], res["cpu"]
    kinds = sorted({k for r in gpu.values() for k in r["bytes_per_layer"]})
    lines = ["## FP8", "",
             "`python -m benchmarks.fp8` (`benchmarks/fp8.py`; part of `make bench`). "
             "`GPTConfig(fp8=Fp8Recipe(...))`: e4m3 inputs and weights, e5m2 output "
             "gradients, per-tensor scales of whole-tensor amaxes, fp32 accumulation, the "
             "sequence all-gathers in FP8; the LM head, attention, norms and the loss in "
             "bf16.", "", "### Targets", "",
             table(["target", "measured", "status"],
                   [[t["target"], t["measured"], status(t["met"])] for t in res["targets"]]),
             "",
             f"### {c['layers']} Blocks on 8 x H100 (h={c['h']}, s={c['s']}, t={c['t']}, "
             "bf16 compute, fp32 parameters and weight gradients, recompute_allgather; "
             "`xla_gpu_enable_triton_gemm=false`)", "",
             table(["", "per-GPU peak", "temp", "cuBLASLt FP8 GEMMs / layer",
                    "other cuBLAS GEMMs / layer", *(f"{k} / layer" for k in kinds)],
                   [[name, fmt_mib(r["peak_bytes"]), fmt_mib(r["temp_bytes"]),
                     f"{r['fp8_gemms_per_layer']:g}", f"{r['other_gemms_per_layer']:g}",
                     *(fmt_mib(r["bytes_per_layer"].get(k, 0)) for k in kinds)]
                    for name, r in gpu.items()]), "",
             "Bytes are the per-device results of the collectives on the tensor axis. The "
             "other GEMMs are attention's (bf16).", "",
             *_cpu_table(c, cpu)]
    return "\n".join(lines)


def _cpu_table(c: dict[str, Any], cpu: dict[str, Any]) -> list[str]:

    if not cpu:
        return []
    return [f"### CPU: the demo, {c['cpu_steps']} steps (`examples/train_gpt.py --steps "
             f"{c['cpu_steps']} --precision bf16 [--fp8 ...]`: its default model, data and "
             "simulated devices; the same initialisation and batches)", "",
             table(["", "held-out loss", "vs bf16", "last training loss", "seconds"],
                   [[name, f"{r['held_out_loss']:.5f}",
                     f"{r['held_out_loss'] / cpu['bf16']['held_out_loss'] - 1:+.2%}",
                     f"{r['train_losses'][-1]:.4f}", f"{r['seconds']:.0f}"]
                    for name, r in cpu.items()]), "",
            "The first training losses: " + ", ".join(
                f"{name} {r['train_losses'][0]:.4f}" for name, r in cpu.items()) + ".", ""]

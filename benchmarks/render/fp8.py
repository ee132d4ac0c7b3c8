"""The FP8 section of BENCHMARKS.md from :func:`benchmarks.fp8.run_fp8`'s results."""

from __future__ import annotations

from typing import Any

from benchmarks.records import fmt_mib
from benchmarks.render.common import targets_lines
from benchmarks.render.template import fields, filler, table

_fill = filler("fp8")


def render_markdown(res: dict[str, Any]) -> str:
    """The ``## FP8`` section of ``BENCHMARKS.md``."""

    c, gpu, cpu = res["config"], res["gpu"], res["cpu"]
    kinds = sorted({k for r in gpu.values() for k in r["bytes_per_layer"]})
    lines = [
        "## FP8",
        "",
        _fill("section.1"),
        "",
        *targets_lines(res["targets"]),
        _fill("section.2", **fields(c, "layers", "h", "s", "t")),
        "",
        table(
            [
                "",
                "per-GPU peak",
                "temp",
                "cuBLASLt FP8 GEMMs / layer",
                "other cuBLAS GEMMs / layer",
                *(f"{k} / layer" for k in kinds),
            ],
            [
                [
                    name,
                    fmt_mib(r["peak_bytes"]),
                    fmt_mib(r["temp_bytes"]),
                    f"{r['fp8_gemms_per_layer']:g}",
                    f"{r['other_gemms_per_layer']:g}",
                    *(fmt_mib(r["bytes_per_layer"].get(k, 0)) for k in kinds),
                ]
                for name, r in gpu.items()
            ],
        ),
        "",
        _fill("section.3"),
        "",
        *_cpu_table(c, cpu),
    ]
    return "\n".join(lines)


def _cpu_table(c: dict[str, Any], cpu: dict[str, Any]) -> list[str]:

    if not cpu:
        return []
    return [
        _fill("cpu_table.1", cpu_steps=c["cpu_steps"]),
        "",
        table(
            ["", "held-out loss", "vs bf16", "last training loss", "seconds"],
            [
                [
                    name,
                    f"{r['held_out_loss']:.5f}",
                    f"{r['held_out_loss'] / cpu['bf16']['held_out_loss'] - 1:+.2%}",
                    f"{r['train_losses'][-1]:.4f}",
                    f"{r['seconds']:.0f}",
                ]
                for name, r in cpu.items()
            ],
        ),
        "",
        _fill(
            "cpu_table.2",
            join=", ".join(f"{name} {r['train_losses'][0]:.4f}" for name, r in cpu.items()),
        ),
        "",
    ]

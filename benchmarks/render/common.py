"""Names the report's sections share: the files BENCHMARKS.md links to, the context
modes' labels, MiB formatting, a section's targets table and its run's facts."""

from __future__ import annotations

from typing import Any

from benchmarks.records import MiB, status
from benchmarks.render.template import table

__all__ = [
    "GPU_CHECK_NAME",
    "JSON_NAME",
    "LABELS_CP",
    "PLOT_CONTEXT",
    "PLOT_S",
    "PLOT_T",
    "fmt_mib",
    "run_facts",
    "targets_lines",
    "targets_table",
]

JSON_NAME = "bench.json"
PLOT_T = "bench_memory_vs_t.png"
PLOT_S = "bench_memory_vs_s.png"
PLOT_CONTEXT = "bench_context_memory.png"
LABELS_CP = {"tp_sp": "TP+SP alone", "ring": "ring", "ulysses": "Ulysses"}
GPU_CHECK_NAME = "gpu_check.md"


def fmt_mib(x: float, digits: int = 1) -> str:
    """``x`` bytes in MiB with ``digits`` decimals."""
    return f"{x / MiB:.{digits}f}"


def targets_table(targets: list[dict[str, Any]]) -> str:
    """A stand-alone section's targets: target, measured, PASS / **MISS** / not measured."""
    return table(
        ["target", "measured", "status"],
        [[t["target"], t["measured"], status(t["met"])] for t in targets],
    )


def targets_lines(targets: list[dict[str, Any]]) -> list[str]:
    """The ``### Targets`` part of a stand-alone section: heading, table, blank line."""
    return ["### Targets", "", targets_table(targets), ""]


def run_facts(meta: dict[str, Any]) -> dict[str, Any]:
    """When, with which JAX, on how many CPUs and in how long a section's run ran (its
    ``meta``), for the fragment that says so."""
    return {
        "date": meta["date"],
        "jax": meta["jax"],
        "cpu_count": meta["cpu_count"],
        "runtime_s": format(meta["runtime_s"], ".0f"),
    }

"""Names the report's sections share: the files BENCHMARKS.md links to, the context
modes' labels, MiB formatting."""

from __future__ import annotations

from benchmarks.targets import MiB

__all__ = [
    "GPU_CHECK_NAME",
    "JSON_NAME",
    "LABELS_CP",
    "PLOT_CONTEXT",
    "PLOT_S",
    "PLOT_T",
    "fmt_mib",
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

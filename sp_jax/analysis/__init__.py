"""Measurement: saved residuals (activation memory), collectives in compiled HLO (and how
often its loops run them), deviceless GPU compilation (peak memory and what is live at
it), and the Korthikanti et al. activation-memory formula."""

from sp_jax.analysis.formula import MODES, activation_bytes_formula
from sp_jax.analysis.gpu import (
    GpuCompileReport,
    LiveBuffer,
    PeakBreakdown,
    compile_for_gpu,
    cuda_plugin_available,
    default_compiler_options,
    gpu_mesh,
    peak_breakdown,
)
from sp_jax.analysis.hlo import (
    COLLECTIVE_KINDS,
    Collective,
    CollectiveStats,
    WhileLoop,
    array_bytes,
    collective_stats,
    crosses,
    execution_counts,
    parse_collectives,
    replica_groups,
    source_target_pairs,
    while_loops,
)
from sp_jax.analysis.memory import (
    Residual,
    SavedBytes,
    saved_activation_bytes,
    saved_residuals,
)
from sp_jax.analysis.plan import MODELS, ModelShape, PlanOption, PlanRow, plan

__all__ = [
    "COLLECTIVE_KINDS",
    "MODELS",
    "ModelShape",
    "PlanOption",
    "PlanRow",
    "plan",
    "MODES",
    "Collective",
    "CollectiveStats",
    "GpuCompileReport",
    "LiveBuffer",
    "PeakBreakdown",
    "Residual",
    "SavedBytes",
    "WhileLoop",
    "activation_bytes_formula",
    "array_bytes",
    "collective_stats",
    "compile_for_gpu",
    "crosses",
    "cuda_plugin_available",
    "default_compiler_options",
    "execution_counts",
    "gpu_mesh",
    "parse_collectives",
    "peak_breakdown",
    "replica_groups",
    "saved_activation_bytes",
    "saved_residuals",
    "source_target_pairs",
    "while_loops",
]

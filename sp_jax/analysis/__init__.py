"""Measurement: saved residuals (activation memory), collectives in compiled HLO,
deviceless GPU compilation, and the Korthikanti et al. activation-memory formula."""

from sp_jax.analysis.formula import MODES, activation_bytes_formula
from sp_jax.analysis.gpu import GpuCompileReport, compile_for_gpu, gpu_mesh
from sp_jax.analysis.hlo import CollectiveStats, collective_stats
from sp_jax.analysis.memory import (
    Residual,
    SavedBytes,
    saved_activation_bytes,
    saved_residuals,
)

__all__ = [
    "MODES",
    "CollectiveStats",
    "GpuCompileReport",
    "Residual",
    "SavedBytes",
    "activation_bytes_formula",
    "collective_stats",
    "compile_for_gpu",
    "gpu_mesh",
    "saved_activation_bytes",
    "saved_residuals",
]

"""Measurement: saved residuals (activation memory) and collectives in compiled HLO."""

from sp_jax.analysis.hlo import CollectiveStats, collective_stats
from sp_jax.analysis.memory import Residual, saved_activation_bytes, saved_residuals

__all__ = [
    "CollectiveStats",
    "Residual",
    "collective_stats",
    "saved_activation_bytes",
    "saved_residuals",
]

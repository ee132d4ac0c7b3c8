"""Rotary position embeddings (rotate-half, as Hugging Face's Llama), with Llama-3 style
frequency scaling."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RopeScaling", "rope_frequencies", "rotary_embedding"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style rotary frequency scaling (Hugging Face's ``rope_type="llama3"``).

    Frequencies whose wavelength exceeds ``original_max_position_embeddings /
    low_freq_factor`` are divided by ``factor``; those shorter than ``... /
    high_freq_factor`` are kept; the ones between are interpolated smoothly.

    Attributes:
      factor: the division of the low frequencies (context extension factor).
      low_freq_factor / high_freq_factor: the wavelength band boundaries (above).
      original_max_position_embeddings: the context the frequencies were trained for.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"RopeScaling.factor={self.factor} must be >= 1.")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"RopeScaling: need 0 < low_freq_factor ({self.low_freq_factor}) < "
                f"high_freq_factor ({self.high_freq_factor}).")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("RopeScaling.original_max_position_embeddings="
                             f"{self.original_max_position_embeddings} must be positive.")


def rope_frequencies(head_dim: int, base: float = 10000.0,
                     scaling: RopeScaling | None = None) -> np.ndarray:
    """The ``head_dim / 2`` rotary angular frequencies ``base ** (-2i / head_dim)``,
    optionally Llama-3 scaled, computed in float64 on the host (float32 result)."""
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is not None:
        old = scaling.original_max_position_embeddings
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        scaled = np.where(wavelen > old / scaling.low_freq_factor, inv / scaling.factor, inv)
        medium = (wavelen >= old / scaling.high_freq_factor) & (
            wavelen <= old / scaling.low_freq_factor)
        inv = np.where(medium, (1 - smooth) * scaled / scaling.factor + smooth * scaled,
                       scaled)
    return inv.astype(np.float32)


def rotary_embedding(x: jax.Array, positions: jax.Array, base: float = 10000.0,
                     scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary position embedding (rotate-half form, as Hugging Face's Llama) of ``x``
    ``[b, s, heads, head_dim]`` at integer ``positions`` ``[s]`` (every batch row alike)
    or ``[b, s]`` (per row, e.g. positions restarting in each packed document), computed in
    fp32; frequencies from :func:`rope_frequencies`."""
    freqs = jnp.asarray(rope_frequencies(x.shape[-1], base, scaling))
    angles = positions[..., None].astype(jnp.float32) * freqs  # [(b,) s, half]
    if angles.ndim == 2:
        angles = angles[None]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)

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
    """The ``head_dim / 2`` rotary angular frequencies ``1 / base ** (2i / head_dim)``,
    optionally Llama-3 scaled, float32, computed on the host as transformers computes
    them in float32: the exponent ``arange(0, d, 2) / d`` in float32, the power rounded
    to float32 (from float64: correctly rounded), its float32 reciprocal, the Llama-3
    scaling in float32 in transformers' order of operations. Equal bit for bit to
    transformers' ``inv_freq`` for the test fixtures and Llama-3.1-8B's; elsewhere
    torch's float32 ``pow`` can differ by one unit in the last place in a few entries
    (a relative 6e-8: an angle error growing with the position)."""
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2).astype(f32) / f32(head_dim)
    inv = f32(1.0) / (np.float64(base) ** exponent.astype(np.float64)).astype(f32)
    if scaling is not None:
        old = scaling.original_max_position_embeddings
        low_wavelen = f32(old / scaling.low_freq_factor)
        high_wavelen = f32(old / scaling.high_freq_factor)
        factor = f32(scaling.factor)
        # torch divides a number by a tensor as the tensor's reciprocal times the number
        wavelen = (f32(1.0) / inv) * f32(2 * math.pi)
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = ((f32(1.0) / wavelen) * f32(old) - f32(scaling.low_freq_factor)) / f32(
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (f32(1.0) - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def rotary_embedding(x: jax.Array, positions: jax.Array, base: float = 10000.0,
                     scaling: RopeScaling | None = None, *,
                     frequencies: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding (rotate-half form, as Hugging Face's Llama) of ``x``
    ``[b, s, heads, head_dim]`` at integer ``positions`` ``[s]`` (every batch row alike)
    or ``[b, s]`` (per row, e.g. positions restarting in each packed document), computed in
    fp32; frequencies from :func:`rope_frequencies`, or ``frequencies`` ``[head_dim / 2]``
    fp32 when given (e.g. a layer's choice between two bases, traced)."""
    freqs = jnp.asarray(rope_frequencies(x.shape[-1], base, scaling)) \
        if frequencies is None else frequencies
    angles = positions[..., None].astype(jnp.float32) * freqs  # [(b,) s, half]
    if angles.ndim == 2:
        angles = angles[None]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)

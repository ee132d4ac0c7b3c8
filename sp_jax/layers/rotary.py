"""Rotary position embeddings (rotate-half, as Hugging Face's Llama), with Llama-3 style
frequency scaling (:class:`RopeScaling`) or YaRN's (:class:`YarnScaling`: DeepSeek-V3,
Kimi K2)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["RopeScaling", "YarnScaling", "rope_attention_factor", "rope_frequencies",
           "rotary_embedding", "yarn_mscale"]


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


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN's rotary scaling (Peng et al. 2023; Hugging Face's ``rope_type="yarn"``, as
    DeepSeek-V3 and Kimi K2 use it: ``factor`` 40 (32 for Kimi K2), ``mscale`` and
    ``mscale_all_dim`` 1, ``beta_fast`` 32 (1 for Kimi K2), ``beta_slow`` 1, 4096
    original positions).

    Frequencies that turn fewer than ``beta_slow`` times over the original context are
    divided by ``factor``, those that turn more than ``beta_fast`` times are kept, with a
    linear ramp between (over the feature index, the bounds floored / ceiled with
    ``truncate``); the rotated features are multiplied by the attention factor
    (:func:`rope_attention_factor`). transformers' ``_compute_yarn_parameters``, bit for
    bit in float32.

    Attributes:
      factor: the context extension factor (>= 1).
      original_max_position_embeddings: the context the frequencies were trained for.
      beta_fast / beta_slow: the ramp's bounds in rotations over that context.
      mscale / mscale_all_dim: the attention factor ``m(mscale) / m(mscale_all_dim)``
        with ``m(a) = 0.1 * a * ln(factor) + 1`` (when both are nonzero; else ``m(1)``).
        DeepSeek's softmax scale also takes ``m(mscale_all_dim) ** 2``
        (:func:`~sp_jax.layers.mla.mla_softmax_scale`, ``GPTConfig.attention_scale``).
      attention_factor: the factor itself (None: from the fields above).
      truncate: floor / ceil the ramp's bounds (transformers' default True).
    """

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"YarnScaling.factor={self.factor} must be >= 1.")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("YarnScaling.original_max_position_embeddings="
                             f"{self.original_max_position_embeddings} must be positive.")
        if not 0 < self.beta_slow <= self.beta_fast:
            raise ValueError(f"YarnScaling: need 0 < beta_slow ({self.beta_slow}) <= "
                             f"beta_fast ({self.beta_fast}).")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"YarnScaling.attention_factor={self.attention_factor} must be "
                             "positive or None (from factor, mscale and mscale_all_dim).")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: RopeScaling | YarnScaling | None) -> float:
    """The factor the rotated features are multiplied by (transformers'
    ``attention_scaling`` of the rotary ``cos`` and ``sin``): YaRN's (its field, or
    ``m(mscale) / m(mscale_all_dim)`` when both are nonzero, else ``m(1)``), 1.0 for
    the others."""
    if not isinstance(scaling, YarnScaling):
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    if scaling.mscale and scaling.mscale_all_dim:
        return float(yarn_mscale(scaling.factor, scaling.mscale)
                     / yarn_mscale(scaling.factor, scaling.mscale_all_dim))
    return yarn_mscale(scaling.factor)


def _yarn(pos: np.ndarray, head_dim: int, base: float, scaling: YarnScaling) -> np.ndarray:
    """YaRN's frequencies from ``pos = base ** (2i / d)`` (float32, transformers'
    ``pos_freqs``), in float32 in transformers' order of operations."""
    f32 = np.float32
    extrapolation = f32(1.0) / pos
    interpolation = f32(1.0) / (f32(scaling.factor) * pos)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(scaling.original_max_position_embeddings
                                    / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(head_dim // 2, dtype=f32) - f32(low)) / f32(high - low), 0, 1)
    keep = f32(1.0) - ramp.astype(f32)  # the extrapolation's share
    return interpolation * (f32(1.0) - keep) + extrapolation * keep


def rope_frequencies(head_dim: int, base: float = 10000.0,
                     scaling: RopeScaling | YarnScaling | None = None) -> np.ndarray:
    """The ``head_dim / 2`` rotary angular frequencies ``1 / base ** (2i / head_dim)``,
    optionally Llama-3 or YaRN scaled (:class:`YarnScaling`), float32, computed on the
    host as transformers computes them in float32: the exponent ``arange(0, d, 2) / d``
    in float32, the power rounded to float32 (from float64: correctly rounded), its
    float32 reciprocal, the Llama-3 or YaRN scaling in float32 in transformers' order of
    operations. Equal bit for bit to transformers' ``inv_freq`` for the test fixtures
    and Llama-3.1-8B's and DeepSeek-V3's; elsewhere torch's float32 ``pow`` can differ
    by one unit in the last place in a few entries (a relative 6e-8: an angle error
    growing with the position)."""
    f32 = np.float32
    exponent = np.arange(0, head_dim, 2).astype(f32) / f32(head_dim)
    pos = (np.float64(base) ** exponent.astype(np.float64)).astype(f32)
    if isinstance(scaling, YarnScaling):
        return _yarn(pos, head_dim, base, scaling).astype(np.float32)
    inv = f32(1.0) / pos
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
                     scaling: RopeScaling | YarnScaling | None = None, *,
                     frequencies: jax.Array | None = None,
                     attention_factor: float | jax.Array | None = None) -> jax.Array:
    """Rotary position embedding (rotate-half form, as Hugging Face's Llama) of ``x``
    ``[b, s, heads, head_dim]`` at integer ``positions`` ``[s]`` (every batch row alike)
    or ``[b, s]`` (per row, e.g. positions restarting in each packed document), computed in
    fp32; frequencies from :func:`rope_frequencies`, or ``frequencies`` ``[head_dim / 2]``
    fp32 when given (e.g. a layer's choice between two bases, traced). ``cos`` and
    ``sin`` are multiplied by ``attention_factor`` (None: :func:`rope_attention_factor`
    of ``scaling``; give it with ``frequencies``), as transformers does."""
    freqs = jnp.asarray(rope_frequencies(x.shape[-1], base, scaling)) \
        if frequencies is None else frequencies
    if attention_factor is None:
        attention_factor = rope_attention_factor(scaling)
    angles = positions[..., None].astype(jnp.float32) * freqs  # [(b,) s, half]
    if angles.ndim == 2:
        angles = angles[None]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    if not (isinstance(attention_factor, float | int) and attention_factor == 1):
        factor = jnp.asarray(attention_factor, jnp.float32)
        sin, cos = sin * factor, cos * factor
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)

"""Dropout on the attention probabilities, reproducible under any sharding: a
counter-based hash of the global batch row, head and positions decides each drop.

The kernels call :func:`drop_scale` per block; :func:`drop_arguments` validates an
:class:`AttentionDropout` for a kernel call.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from sp_jax.compat import check

__all__ = ["AttentionDropout", "drop_arguments", "drop_scale"]

_F32 = jnp.float32


@functools.partial(jax.tree_util.register_dataclass, data_fields=["seed", "batch_offset",
                                                                  "head_offset"],
                   meta_fields=["rate"])
@dataclasses.dataclass(frozen=True)
class AttentionDropout:
    """Dropout on the attention probabilities, reproducible under any sharding.

    The kernels drop probability ``(b, h, i, j)`` (batch row, query head, query position,
    key position, all global) when a counter-based hash of those four numbers and the
    ``seed`` falls below ``rate`` (as flash attention does with Philox), and scale the
    kept ones by ``1 / (1 - rate)``; the normaliser of the softmax is the undropped one.
    The mask is recomputed, not stored, in the backward pass, and it depends on nothing
    but the global coordinates: the same for every block size, mesh, tensor, context
    (ring or Ulysses) or data split, so a sharded model drops exactly what the unsharded
    one drops.

    Attributes:
      seed: uint32 ``[2]`` (e.g. ``jax.random.bits(key, (2,), jnp.uint32)``).
      rate: the drop probability in ``[0, 1)`` (static).
      batch_offset: the global index of this device's first batch row.
      head_offset: the global index of this device's first query head.
    """

    seed: jax.Array
    rate: float
    batch_offset: Any = 0
    head_offset: Any = 0

    def __post_init__(self) -> None:
        if not 0.0 <= float(self.rate) < 1.0:
            raise ValueError(f"AttentionDropout.rate={self.rate} must be in [0, 1).")


def _fmix(x):
    """MurmurHash3's 32-bit finaliser (a bijection that mixes every input bit)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def drop_scale(drop, q_start, k_start, shape):
    """fp32 ``[b, h, g, bq, bk]`` factors ``1 / (1 - rate)`` (kept) or 0 (dropped) of the
    block at rows ``q_start``, columns ``k_start``; ``drop = (dropout, qpos, kpos)`` with
    the global positions ``qpos [sq]``, ``kpos [sk]`` of the kernel's rows and columns."""
    dropout, qpos, kpos = drop
    b, hk, g, nq, nk = shape
    u = jnp.uint32
    seed = dropout.seed.astype(u)
    rows = (jnp.asarray(dropout.batch_offset) + jnp.arange(b)).astype(u)[:, None, None]
    heads = (jnp.asarray(dropout.head_offset) + jnp.arange(hk * g)).astype(u).reshape(hk, g)
    x = _fmix(_fmix(seed[0] ^ (rows * u(0x9E3779B1))) ^ (heads[None] * u(0x85EBCA77)))
    q = lax.dynamic_slice_in_dim(qpos, q_start, nq).astype(u)
    k = lax.dynamic_slice_in_dim(kpos, k_start, nk).astype(u)
    x = _fmix(x[..., None] ^ (q * u(0xC2B2AE3D)))
    x = _fmix(x[..., None] ^ (k * u(0x27D4EB2F) + seed[1]))
    threshold = min(int(round(dropout.rate * 2.0 ** 32)), 2 ** 32 - 1)
    return jnp.where(x >= u(threshold), _F32(1.0 / (1.0 - dropout.rate)), _F32(0.0))


def drop_arguments(dropout: AttentionDropout | None, positions: jax.Array | None, s: int,
                   implementation: str):
    """``(dropout, positions)`` for the kernels (positions default ``0 .. s - 1``), or
    None without dropout; errors for a wrong type or a kernel that draws its own masks."""
    if dropout is None or dropout.rate == 0.0:
        return None
    if not isinstance(dropout, AttentionDropout):
        raise TypeError(f"dropout={dropout!r} must be an AttentionDropout or None.")
    if implementation == "cudnn":  # refused in every mode: sp_jax.compat
        check(None, {"attention_dropout": "attention dropout",
                     "cudnn_attention": "implementation='cudnn'"}, where="attention kernels")
    positions = jnp.arange(s, dtype=jnp.int32) if positions is None else positions
    return dropout, positions.astype(jnp.int32)


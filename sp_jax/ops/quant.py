"""Frozen base kernels stored in fewer bits (QLoRA): :class:`QuantizedKernel`,
:func:`quantize` and :func:`dequantize`.

A kernel ``W [..., in, out]`` is cut into blocks of ``block`` consecutive input rows of
one output column; each block has its absmax ``s`` (fp32) and its values are stored as

* ``"int8"``: ``round(127 W / s)``, int8 (``W ~ (codes * f32(1 / 127)) * s``);
* ``"fp8"``: ``W * 448 / s`` in ``float8_e4m3fn`` (``W ~ (codes * f32(1 / 448)) * s``);
* ``"nf4"``: the index of the nearest of the 16 NormalFloat-4 levels (QLoRA's
  :data:`NF4`, Dettmers et al. 2023) of ``W / s``, two 4-bit indices a byte (row ``2i``
  in the low nibble, ``2i + 1`` in the high one: ``codes [..., in / 2, out]`` uint8), and
  the absmaxes double-quantised as QLoRA does: in groups of ``scale_block`` consecutive
  blocks of a column, their mean ``offset`` (fp32) and ``round(127 (s - offset) /
  s2)`` int8 with ``s2`` the group's absmax of ``s - offset`` (fp32); ``s ~ q (s2
  f32(1 / 127)) + offset``. (bitsandbytes
  quantises the absmaxes with its dynamic 8-bit map and one mean for the whole tensor;
  here the map is linear and the mean per group, so that every block and group lies in
  one device's shard.)

Blocks and groups run along the input dimension within a column, so a kernel split over
either dimension (a column layer's output, a row layer's input, fsdp's other one) is
quantised and dequantised shard by shard, the same numbers as whole, provided a shard's
rows are a whole number of blocks (and groups): :func:`block_sizes` picks them for a
layer. Every array of a :class:`QuantizedKernel` is ``[..., rows, out]``: sharded like
the kernel.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FORMATS", "NF4", "QuantizedKernel", "block_sizes", "dequantize", "kernel_dtype",
           "kernel_shape", "quantize"]

FORMATS = ("int8", "fp8", "nf4")
"""The quantised formats of a frozen base (``LoRAConfig.base_dtype``; ``"bf16"`` is a
plain cast)."""

NF4 = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                0.7229568362236023, 1.0], np.float32)
"""The 16 NormalFloat-4 levels (bitsandbytes' ``NF4`` code, QLoRA's Appendix E)."""

_FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
# Dequantisation multiplies by these fp32 constants (not a division: XLA rewrites a
# division by a constant as this product, so the format is defined by it)
_INV127 = np.float32(1.0 / 127.0)
_INV448 = np.float32(1.0 / _FP8_MAX)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedKernel:
    """A kernel in a quantised format (see the module's docstring): per device, its
    block. ``codes`` ``[..., in (/ 2 for nf4), out]``; ``scales`` ``[..., in / block,
    out]`` (fp32 absmaxes; nf4: int8, double-quantised); nf4's ``scales2`` and
    ``offset`` ``[..., in / (block * scale_block), out]`` fp32 (None otherwise).
    ``logical_shape`` is the kernel's (this block's), ``dtype`` the one it dequantises to
    by default. (No ``shape`` attribute: nnx reads a variable's ``shape`` and ``dtype``
    as its value's, and an abstract model would then hold a full-precision kernel's
    shape.)"""

    codes: jax.Array
    scales: jax.Array
    scales2: jax.Array | None = None
    offset: jax.Array | None = None
    kind: str = dataclasses.field(default="int8", metadata=dict(static=True))
    block: int = dataclasses.field(default=64, metadata=dict(static=True))
    scale_block: int = dataclasses.field(default=256, metadata=dict(static=True))
    out_dtype: Any = dataclasses.field(default=jnp.float32, metadata=dict(static=True))

    @property
    def sharding(self) -> Any:
        """The codes' sharding (every array of it is split alike): what ``nnx.eval_shape``
        reads of an abstract variable's value."""
        return getattr(self.codes, "sharding", None)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        lead, rows, out = self.codes.shape[:-2], self.codes.shape[-2], self.codes.shape[-1]
        return (*lead, rows * (2 if self.kind == "nf4" else 1), out)

    def astype(self, dtype) -> jax.Array:
        """The dequantised kernel in ``dtype`` (what a GEMM multiplies with)."""
        return dequantize(self, dtype)


def block_sizes(rows: int, block: int = 64, scale_block: int = 256) -> tuple[int, int]:
    """``(block, scale_block)`` for a shard of ``rows`` input rows: ``block`` (or the
    largest power of two dividing ``rows`` below it) and ``scale_block`` (or the largest
    power of two dividing the shard's blocks below it), so that blocks and groups lie in
    one shard."""
    def fit(n: int, most: int) -> int:
        size = 1
        while size * 2 <= most and n % (size * 2) == 0:
            size *= 2
        return size
    b = fit(rows, block)
    return b, fit(rows // b, scale_block)


def _blocks(w: jax.Array, block: int) -> jax.Array:
    """``[..., in, out]`` -> ``[..., in / block, block, out]``."""
    *lead, rows, out = w.shape
    return w.reshape(*lead, rows // block, block, out)


def quantize(w: jax.Array, kind: str, *, block: int = 64, scale_block: int = 256,
             dtype: Any = None) -> QuantizedKernel:
    """``w [..., in, out]`` in ``kind`` (one of :data:`FORMATS`), blocks of ``block``
    input rows (and nf4's scale groups of ``scale_block`` blocks), which must divide
    ``in``; ``dtype``: what it dequantises to by default (``w``'s dtype)."""
    if kind not in FORMATS:
        raise ValueError(f"quantize: kind={kind!r} must be one of {FORMATS}.")
    rows = w.shape[-2]
    if rows % block or (kind == "nf4" and (rows // block) % scale_block):
        raise ValueError(f"quantize: {rows} input rows are not a whole number of blocks of "
                         f"{block} (nf4: of groups of {scale_block} blocks); use "
                         "sp_jax.ops.quant.block_sizes(rows).")
    dtype = jnp.dtype(dtype or w.dtype)
    blocks = _blocks(w.astype(jnp.float32), block)
    absmax = jnp.max(jnp.abs(blocks), axis=-2)  # [..., nb, out]
    safe = jnp.where(absmax > 0, absmax, 1.0)[..., None, :]
    if kind == "int8":
        codes = jnp.round(blocks / safe * 127.0).astype(jnp.int8)
        return QuantizedKernel(codes.reshape(w.shape), absmax, kind=kind, block=block,
                               scale_block=scale_block, out_dtype=dtype)
    if kind == "fp8":
        codes = (blocks / safe * _FP8_MAX).astype(jnp.float8_e4m3fn)
        return QuantizedKernel(codes.reshape(w.shape), absmax, kind=kind, block=block,
                               scale_block=scale_block, out_dtype=dtype)
    levels = jnp.asarray(NF4)
    index = jnp.argmin(jnp.abs((blocks / safe)[..., None] - levels), axis=-1)
    index = index.reshape(w.shape).astype(jnp.uint8)
    *lead, _, out = w.shape
    pairs = index.reshape(*lead, rows // 2, 2, out)
    codes = pairs[..., 0, :] | (pairs[..., 1, :] << 4)
    groups = _blocks(absmax, scale_block)  # [..., nb / sb, sb, out]
    offset = jnp.mean(groups, axis=-2)
    centred = groups - offset[..., None, :]
    scales2 = jnp.max(jnp.abs(centred), axis=-2)
    safe2 = jnp.where(scales2 > 0, scales2, 1.0)[..., None, :]
    scales = jnp.round(centred / safe2 * 127.0).astype(jnp.int8).reshape(absmax.shape)
    return QuantizedKernel(codes, scales, scales2, offset, kind=kind, block=block,
                           scale_block=scale_block, out_dtype=dtype)


def _absmax(q: QuantizedKernel) -> jax.Array:
    """The blocks' absmaxes ``[..., in / block, out]`` fp32 (nf4: dequantised)."""
    if q.kind != "nf4":
        return q.scales
    groups = _blocks(q.scales.astype(jnp.float32), q.scale_block)
    return (groups * (q.scales2 * _INV127)[..., None, :] + q.offset[..., None, :]).reshape(
        q.scales.shape)


def dequantize(q: QuantizedKernel, dtype: Any = None) -> jax.Array:
    """The kernel ``[..., in, out]`` of ``q`` in ``dtype`` (``q.out_dtype`` by default): each
    value ``level * absmax`` computed in fp32, then cast."""
    dtype = jnp.dtype(dtype or q.out_dtype)
    absmax = _absmax(q)[..., None, :]
    if q.kind == "nf4":
        low, high = q.codes & 0xF, q.codes >> 4
        index = jnp.stack([low, high], axis=-2)  # [..., in / 2, 2, out]
        index = index.reshape(q.logical_shape)
        values = jnp.asarray(NF4)[index.astype(jnp.int32)]
    else:
        values = q.codes.astype(jnp.float32) * (_INV127 if q.kind == "int8" else _INV448)
    w = _blocks(values, q.block) * absmax
    return w.reshape(q.logical_shape).astype(dtype)


def kernel_shape(kernel: Any) -> tuple[int, ...]:
    """The shape of a kernel, quantized (its logical shape) or not."""
    return kernel.logical_shape if isinstance(kernel, QuantizedKernel) else tuple(kernel.shape)


def kernel_dtype(kernel: Any) -> Any:
    """The dtype a kernel multiplies in: a quantized one's ``out_dtype``, else its own."""
    return kernel.out_dtype if isinstance(kernel, QuantizedKernel) else kernel.dtype

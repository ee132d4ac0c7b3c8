"""The adapters of a linear layer (LoRA, :class:`~sp_jax.LoRAConfig`): their parameters,
how they are split over the mesh, and which output columns of a fused kernel each
adapter writes.

A layer with adapters holds ``lora_a [in, n * r]`` and ``lora_b [n * r, out]``
(:class:`LoRAParam`, global shapes), ``n`` the targeted parts of its kernel: a fused
kernel is several of PEFT's modules side by side (the attention's q/k/v columns
``(head, {q, k, v}, head_dim)``, a gated MLP's ``(j, {gate, up})`` pairs), each with its
own adapter: adapter ``j``'s rows ``j * r ... (j + 1) * r`` of ``lora_b`` are non-zero
only on the columns of its part (:func:`lora_mask`; zeros at the start, and their
gradient is masked, so they stay zeros). ``x @ lora_a`` is then ONE GEMM for all the
parts of the kernel, on the input the base multiplies.

Split (torchtitan's rule): a column layer's ``lora_a`` replicated, ``lora_b`` by columns
over the tensor axis like the kernel; a row layer's ``lora_a`` by rows like the kernel,
``lora_b`` replicated. Adapters are never sharded over the data axes (they are small;
their gradients are summed there).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from sp_jax.config import LoRAConfig
from sp_jax.layout import Layout

__all__ = ["LORA_SALT", "LoRAParam", "LoRAParts", "QuantizedBase", "adapter_params",
           "adapter_specs", "base_spec", "base_value", "dequantized", "initial_a", "initial_b",
           "lora_mask", "masked_b", "quantized_base"]


LORA_SALT = 0x4C6F5241
"""Folded into a kernel's rng key for its adapters' draw ("LoRA"): a layer with adapters
draws its base weights as it does without them."""


class LoRAParam(nnx.Param):
    """A LoRA adapter (``lora_a`` / ``lora_b``): the parameters that train when a model
    has adapters (the rest, :class:`flax.nnx.Param` but not this, is the frozen base)."""


@dataclasses.dataclass(frozen=True)
class LoRAParts:
    """What a layer's output columns are made of: column ``c`` belongs to part
    ``names[(c // stride) % len(names)]`` (PEFT's module names: ``"q"``, ``"k"``,
    ``"v"``, ``"o"``, ``"gate"``, ``"up"``, ``"down"``)."""

    names: tuple[str, ...]
    stride: int = 1

    def of_columns(self, out: int) -> np.ndarray:
        """The part index of each of ``out`` columns."""
        return (np.arange(out) // self.stride) % len(self.names)

    def targeted(self, lora: LoRAConfig) -> tuple[int, ...]:
        """The indices of the parts ``lora`` adapts."""
        return tuple(i for i, name in enumerate(self.names) if name in lora.targets)


def lora_mask(parts: LoRAParts, lora: LoRAConfig, out: int,
              adapters: tuple[str, ...] | None = None) -> np.ndarray | None:
    """``[n * r, out]`` float32: 1 where adapter ``j`` may write (the columns of its
    part), else 0; None when one adapter writes every column. ``adapters``: the names of
    the ``n`` adapters in row order (default: the targeted parts of ``parts``; a kernel
    fused from several parameters, the grouped-query projection's, gives all of its)."""
    if adapters is None:
        adapters = tuple(parts.names[i] for i in parts.targeted(lora))
    if adapters == parts.names and len(adapters) == 1:
        return None
    cols, r = parts.of_columns(out), lora.rank
    mask = np.zeros((len(adapters) * r, out), np.float32)
    for j, name in enumerate(adapters):
        if name in parts.names:
            mask[j * r:(j + 1) * r, cols == parts.names.index(name)] = 1.0
    return mask


def adapter_specs(layout: Layout, split_in: bool) -> tuple[P, P]:
    """``(lora_a, lora_b)`` specs: a column layer's (``split_in`` False) ``lora_a``
    replicated and ``lora_b`` split by columns over the tensor axis; a row layer's
    ``lora_a`` split by rows, ``lora_b`` replicated."""
    if split_in:
        return P(layout.row_kernel[0], None), P(None, None)
    return P(None, None), P(None, layout.column_kernel[1])


def adapter_params(where: str, lora: LoRAConfig | None, parts: LoRAParts,
                   in_features: int, out_features: int, *, split_in: bool,
                   layout: Layout, key: jax.Array, dtype, eager: bool
                   ) -> tuple[LoRAParam | None, LoRAParam | None]:
    """``(lora_a, lora_b)`` of a layer whose kernel is ``[in_features, out_features]``
    made of ``parts``, or ``(None, None)`` when ``lora`` targets none of them.

    ``lora_a`` is PEFT's Kaiming-uniform start (``U(-1/sqrt(in), 1/sqrt(in))``), drawn
    from ``key`` (a key derived from the kernel's: the base's draws are those of a layer
    without adapters); ``lora_b`` zeros."""
    if lora is None:
        return None, None
    if not isinstance(lora, LoRAConfig):
        raise TypeError(f"{where}: lora={lora!r} must be a sp_jax.LoRAConfig (e.g. "
                        "LoRAConfig(rank=16)) or None.")
    n = len(parts.targeted(lora))
    if n == 0:
        return None, None
    width = n * lora.rank
    a_spec, b_spec = adapter_specs(layout, split_in)
    b = initial_b(jax.random.fold_in(key, 1), (width, out_features), dtype, lora, parts)
    return (LoRAParam(initial_a(key, (in_features, width), dtype),
                      out_sharding=tuple(a_spec), eager_sharding=eager),
            LoRAParam(b, out_sharding=tuple(b_spec), eager_sharding=eager))


def initial_a(key: jax.Array, shape: tuple[int, int], dtype) -> jax.Array:
    """``lora_a``'s start ``[in, width]``: PEFT's Kaiming-uniform,
    ``U(-1/sqrt(in), 1/sqrt(in))``."""
    bound = 1.0 / np.sqrt(shape[0])
    return jax.random.uniform(key, shape, dtype, -bound, bound)


def initial_b(key: jax.Array, shape: tuple[int, int], dtype, lora: LoRAConfig,
              parts: LoRAParts, adapters: tuple[str, ...] | None = None) -> jax.Array:
    """``lora_b``'s start: zeros, or with ``init_lora_weights=False`` a normal draw (std
    0.02) zero outside each adapter's part (``adapters`` as :func:`lora_mask`'s)."""
    if lora.init_lora_weights:
        return jnp.zeros(shape, dtype)
    return masked_b(0.02 * jax.random.normal(key, shape, dtype), parts, lora, adapters)


def masked_b(b: jax.Array, parts: LoRAParts, lora: LoRAConfig,
             adapters: tuple[str, ...] | None = None) -> jax.Array:
    """``lora_b`` with the columns outside each adapter's part zeroed (an elementwise
    product: its gradient is masked the same way, so those entries never train);
    ``adapters`` as :func:`lora_mask`'s."""
    mask = lora_mask(parts, lora, b.shape[-1], adapters)
    return b if mask is None else b * jnp.asarray(mask, b.dtype)


class QuantizedBase(nnx.Variable):
    """A frozen base kernel stored quantized (QLoRA, ``LoRAConfig.base_dtype`` ``"int8"``,
    ``"nf4"`` or ``"fp8"``): its value a :class:`~sp_jax.ops.quant.QuantizedKernel`,
    dequantised inside each GEMM's op (the full-precision kernel lives only there). Not a
    ``nnx.Param``: no gradient, no optimizer state, not in a Hugging Face export (a
    merged export dequantises it)."""


def _rows_per_shard(shape: tuple[int, ...], spec: P, mesh: Any) -> int:
    """The input rows (dimension -2) of one device's block of a kernel ``shape`` split
    as ``spec`` on ``mesh`` (None: the whole)."""
    rows = shape[-2]
    entries = (*tuple(spec), *([None] * (len(shape) - len(tuple(spec)))))
    entry = entries[len(shape) - 2]
    if mesh is None or entry is None:
        return rows
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    return rows // math.prod(mesh.shape[n] for n in names)


def quantized_base(kernel: jax.Array, spec: P, base_dtype: str, mesh: Any):
    """The frozen base of ``kernel`` (``[..., in, out]``, split as ``spec`` on ``mesh``, or
    whole without one) stored as ``base_dtype``: a ``bf16`` :class:`flax.nnx.Param`, or a
    :class:`QuantizedBase` quantised shard by shard (blocks of
    :func:`~sp_jax.ops.quant.block_sizes` of a shard's rows: the same numbers as whole)."""
    from sp_jax.ops.quant import block_sizes, quantize

    if base_dtype == "bf16":
        return nnx.Param(kernel.astype(jnp.bfloat16), out_sharding=tuple(spec),
                         eager_sharding=mesh is not None)
    block, scale_block = block_sizes(_rows_per_shard(kernel.shape, spec, mesh))

    def local(w):
        return quantize(w, base_dtype, block=block, scale_block=scale_block)

    if mesh is None:
        return QuantizedBase(local(kernel))
    specs = jax.tree.map(lambda _: spec, jax.eval_shape(local, kernel))
    return QuantizedBase(jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec,
                                               out_specs=specs))(kernel))


def base_value(var: nnx.Variable) -> Any:
    """A base kernel's value: the array of a ``nnx.Param``, the
    :class:`~sp_jax.ops.quant.QuantizedKernel` of a :class:`QuantizedBase`."""
    return var.get_value()


def base_spec(value: Any, spec: P) -> Any:
    """The spec (tree) of a base kernel's ``value``: ``spec``, or for a quantized
    kernel ``spec`` for each of its arrays (all split as the kernel is)."""
    from sp_jax.ops.quant import QuantizedKernel

    if isinstance(value, QuantizedKernel):
        return jax.tree.map(lambda _: spec, value)
    return spec


def dequantized(var: nnx.Variable) -> jax.Array:
    """A base kernel's full-precision value: a ``nnx.Param``'s array, or a
    :class:`QuantizedBase` dequantised (to its original dtype) shard by shard where it
    lies (a merge, an export: not the training path, which dequantises in each op)."""
    from sp_jax.ops.quant import dequantize

    value = var.get_value()
    if not isinstance(var, QuantizedBase):
        return value
    sharding = getattr(value.codes, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not hasattr(sharding, "spec") or getattr(mesh, "empty", True):
        return dequantize(value)
    spec = sharding.spec
    return jax.jit(jax.shard_map(dequantize, mesh=mesh, in_specs=(
        jax.tree.map(lambda _: spec, value),), out_specs=spec))(value)

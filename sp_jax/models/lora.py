"""LoRA on a whole model: :func:`apply` (adapters onto a model, e.g. one just read from a
Hugging Face checkpoint), :func:`merge` (the adapters folded into the base kernels),
:func:`adapters` (the adapters' state) and :func:`disabled` (the base model's forward
with the adapters switched off, without a second copy of the weights: DPO's reference
model).

Which layer holds which adapters is the layers' business (:mod:`sp_jax.layers.lora`):
a layer with adapters has ``lora_a`` and ``lora_b`` (the grouped q/k/v projection
``lora_a``, ``q_lora_b``, ``kv_lora_b``), :class:`~sp_jax.layers.lora.LoRAParam`
variables, next to the kernels they adapt.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sp_jax.config import LoRAConfig
from sp_jax.layers.lora import LoRAParam, dequantized, masked_b

__all__ = ["adapters", "apply", "disabled", "merge", "merged_kernels", "quantize_base"]


def apply(model: nnx.Module, lora: LoRAConfig, *, seed: int = 0) -> nnx.Module:
    """``model`` with LoRA adapters on the layers ``lora`` targets: a model of the same
    class built from ``model.config`` with ``lora`` (under the current mesh, as
    ``model``), holding ``model``'s state (its base weights, frozen from now on) and
    fresh adapters (``lora_a`` drawn from ``seed``'s stream, ``lora_b`` zeros: the new
    model computes what ``model`` does, bitwise).

    Raises:
      TypeError: ``model`` has no ``config`` / ``parallel`` to build from (a GPT has),
        or ``lora`` is not a :class:`~sp_jax.LoRAConfig`.
    """
    if not isinstance(lora, LoRAConfig):
        raise TypeError(f"lora.apply: lora={lora!r} must be a sp_jax.LoRAConfig (e.g. "
                        "LoRAConfig(rank=16)).")
    config, parallel = getattr(model, "config", None), getattr(model, "parallel", None)
    if config is None or parallel is None or not dataclasses.is_dataclass(config):
        raise TypeError(f"lora.apply: {type(model).__name__} has no config / parallel "
                        "to build an adapted copy from; build the model with "
                        "GPTConfig(lora=...) instead.")
    adapted = type(model)(dataclasses.replace(config, lora=dataclasses.replace(
        lora, base_dtype=None)), parallel=parallel, rngs=nnx.Rngs(seed))
    nnx.update(adapted, nnx.state(model))
    if lora.base_dtype is not None:
        adapted = quantize_base(adapted, lora.base_dtype)
    return adapted


def quantize_base(model: nnx.Module, base_dtype: str) -> nnx.Module:
    """``model`` (with LoRA adapters, its base in full precision) with its adapted layers'
    frozen kernels stored as ``base_dtype`` (QLoRA; :class:`~sp_jax.LoRAConfig`'s
    ``base_dtype``): a model built abstractly from its config with that ``base_dtype``
    and filled with ``model``'s values, each adapted kernel quantized shard by shard
    (:func:`~sp_jax.layers.lora.quantized_base`) where it lies. ``model``'s
    full-precision kernels are not kept (drop the reference to free them)."""
    from jax.sharding import PartitionSpec as P

    from sp_jax.layers.lora import QuantizedBase, quantized_base

    lora = model.config.lora
    if lora is None:
        raise ValueError("quantize_base: the model has no LoRA adapters; apply them first "
                         "(sp_jax.models.lora.apply(model, LoRAConfig(..., base_dtype=...))).")
    config = dataclasses.replace(model.config, lora=dataclasses.replace(
        lora, base_dtype=base_dtype))
    target = nnx.eval_shape(lambda: type(model)(config, parallel=model.parallel,
                                                rngs=nnx.Rngs(0)))
    mesh = jax.sharding.get_mesh()
    source = dict(nnx.to_flat_state(nnx.state(model)))
    values = []
    for path, var in nnx.to_flat_state(nnx.state(target)):
        value = source[path].get_value()
        if isinstance(var, QuantizedBase):
            spec = getattr(getattr(value, "sharding", None), "spec", P())
            value = quantized_base(value, spec, base_dtype, None if mesh.empty else
                                   mesh).get_value()
        elif hasattr(value, "dtype") and hasattr(var.get_value(), "dtype") and \
                value.dtype != var.get_value().dtype:  # a bf16 base
            value = value.astype(var.get_value().dtype)
        values.append((path, var.replace(value)))
    nnx.update(target, nnx.from_flat_state(values))
    return target


def adapters(model: nnx.Module) -> nnx.State:
    """The adapters' state of ``model`` (its :class:`~sp_jax.layers.lora.LoRAParam`
    variables)."""
    return nnx.state(model, LoRAParam)


def _adapted_layers(model: nnx.Module) -> Iterator[nnx.Module]:
    for _, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Module) and isinstance(
                getattr(module, "lora_a", None), LoRAParam):
            yield module


def _delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """``scale * a @ b`` per stacked layer (leading dimensions shared), in fp32."""
    return scale * jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32),
                              b.astype(jnp.float32))


def merged_kernels(layer: nnx.Module) -> dict[str, jax.Array]:
    """The base kernels of an adapted ``layer`` with its adapters folded in (``W +
    scale * lora_a @ lora_b``, each adapter on its part's columns; a quantized base
    dequantised), by parameter name, in the kernels' dtype (at least fp32)."""
    lora = layer.lora
    a = layer.lora_a[...]
    if hasattr(layer, "q_lora_b"):  # the grouped q/k/v projection
        q_b, kv_b = layer.lora_b_masked()
        pairs = (("q_kernel", q_b), ("kv_kernel", kv_b))
    else:
        pairs = (("kernel", masked_b(layer.lora_b[...], layer.lora_parts, lora)),)
    out = {}
    for name, b in pairs:
        w = dequantized(getattr(layer, name))
        out[name] = (w.astype(jnp.float32) + _delta(a, b, lora.scale)).astype(
            jnp.promote_types(w.dtype, jnp.float32))  # (a bf16 base: not rounded again)
    return out


def merge(model: nnx.Module) -> nnx.Module:
    """A model without adapters computing what the adapted ``model`` computes: built from
    its config with ``lora=None``, its base kernels ``W + scale * lora_a @ lora_b``
    (in the kernels' dtype; exact up to that rounding)."""
    plain = type(model)(dataclasses.replace(model.config, lora=None),
                        parallel=model.parallel, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.All(nnx.Param, nnx.Not(LoRAParam)))
    nnx.update(plain, state)  # (a bf16 base: cast back to the parameters' dtype below)
    modules = {path: m for path, m in nnx.iter_graph(plain) if isinstance(m, nnx.Module)}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Module) and isinstance(getattr(module, "lora_a", None),
                                                         LoRAParam):
            for name, value in merged_kernels(module).items():
                getattr(modules[path], name).set_value(value.astype(plain.config.param_dtype))
    return plain


@contextlib.contextmanager
def disabled(model: nnx.Module) -> Iterator[nnx.Module]:
    """Within the block, ``model``'s adapters contribute nothing: each ``lora_b`` is
    zeros (the base model's forward, bitwise; the same weights, no second copy), set
    back on exit. Used for DPO's reference log-probabilities."""
    saved: list[tuple[Any, jax.Array]] = []
    for layer in _adapted_layers(model):
        for name in ("lora_b", "q_lora_b", "kv_lora_b"):
            var = getattr(layer, name, None)
            if isinstance(var, LoRAParam):
                saved.append((var, var[...]))
                var[...] = jnp.zeros_like(var[...])
    try:
        yield model
    finally:
        for var, value in saved:
            var[...] = value

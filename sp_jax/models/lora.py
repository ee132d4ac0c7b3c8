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
from sp_jax.layers.lora import LoRAParam, masked_b

__all__ = ["adapters", "apply", "disabled", "merge", "merged_kernels"]


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
    adapted = type(model)(dataclasses.replace(config, lora=lora), parallel=parallel,
                          rngs=nnx.Rngs(seed))
    nnx.update(adapted, nnx.state(model))
    return adapted


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
    scale * lora_a @ lora_b``, each adapter on its part's columns), by parameter name,
    in the kernels' dtype."""
    lora = layer.lora
    a = layer.lora_a[...]
    if hasattr(layer, "q_lora_b"):  # the grouped q/k/v projection
        q_b, kv_b = layer.lora_b_masked()
        pairs = (("q_kernel", q_b), ("kv_kernel", kv_b))
    else:
        pairs = (("kernel", masked_b(layer.lora_b[...], layer.lora_parts, lora)),)
    out = {}
    for name, b in pairs:
        w = getattr(layer, name)[...]
        out[name] = (w.astype(jnp.float32) + _delta(a, b, lora.scale)).astype(w.dtype)
    return out


def merge(model: nnx.Module) -> nnx.Module:
    """A model without adapters computing what the adapted ``model`` computes: built from
    its config with ``lora=None``, its base kernels ``W + scale * lora_a @ lora_b``
    (in the kernels' dtype; exact up to that rounding)."""
    plain = type(model)(dataclasses.replace(model.config, lora=None),
                        parallel=model.parallel, rngs=nnx.Rngs(0))
    state = nnx.state(model, nnx.All(nnx.Param, nnx.Not(LoRAParam)))
    nnx.update(plain, state)
    modules = {path: m for path, m in nnx.iter_graph(plain) if isinstance(m, nnx.Module)}
    for path, module in nnx.iter_graph(model):
        if isinstance(module, nnx.Module) and isinstance(getattr(module, "lora_a", None),
                                                         LoRAParam):
            for name, value in merged_kernels(module).items():
                getattr(modules[path], name)[...] = value
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

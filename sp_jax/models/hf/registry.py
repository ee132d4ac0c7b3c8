"""The families sp_jax converts, by ``model_type``, and ``config.json`` <-> :class:`GPTConfig`
through them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from sp_jax.models.gpt import GPTConfig
from sp_jax.models.hf import gpt2, llama
from sp_jax.models.hf.family import Family

__all__ = ["FAMILIES", "REGISTRY", "config_from_hf", "config_to_hf", "family_of"]

REGISTRY: dict[str, Family] = {f.model_type: f for f in (gpt2.GPT2, llama.LLAMA)}
"""``model_type`` -> :class:`Family`; the first that expresses a :class:`GPTConfig` writes it."""

FAMILIES = tuple(REGISTRY)
"""The ``model_type`` s of ``config.json`` that :func:`from_hf` reads."""


def family_of(cfg: GPTConfig) -> Family:
    """The Hugging Face family that expresses ``cfg`` exactly, or a ValueError naming the
    fields that no family has."""
    for family in REGISTRY.values():
        if family.expresses(cfg):
            return family
    raise ValueError(
        "to_hf: this GPTConfig is neither "
        + " nor ".join(f.description for f in REGISTRY.values())
        + f": positions={cfg.positions!r}, norm={cfg.norm!r}, "
        f"mlp_activation={cfg.mlp_activation!r}, qkv_bias={cfg.qkv_bias}, "
        f"out_bias={cfg.out_bias}, mlp_bias={cfg.mlp_bias}, num_kv_heads={cfg.num_kv_heads}.")


def _dtype_of(config: Mapping[str, Any]):
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    try:
        return jnp.dtype(str(name).removeprefix("torch."))
    except TypeError as e:
        raise ValueError(f"config.json: dtype {name!r} is not a dtype sp_jax knows.") from e


def config_from_hf(config: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face ``config.json`` (a dict).

    ``model_type`` ``"gpt2"`` or ``"llama"``, as written by transformers 4.x (``rope_theta``
    and ``rope_scaling`` at the top level) or 5.x (``rope_parameters``). Options sp_jax
    cannot reproduce exactly raise a ValueError naming the key (e.g. GPT-2's
    ``scale_attn_by_inverse_layer_idx``, a Llama ``head_dim`` other than ``hidden /
    heads``, rope types other than default and ``llama3``). ``param_dtype`` is the
    config's ``dtype`` (``torch_dtype`` in 4.x), float32 when absent.

    GPT-2 has three dropout rates; sp_jax has one for embeddings and residuals
    (``dropout`` = ``resid_pdrop``, which must equal ``embd_pdrop`` unless ``dropout`` is
    overridden) and ``attention_dropout`` = ``attn_pdrop``.

    Args:
      config: the parsed ``config.json``.
      overrides: :class:`GPTConfig` fields to set instead (e.g. ``dtype=jnp.bfloat16``,
        ``remat=True``, ``dropout=0.0``).
    """
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise ValueError(f"config.json: model_type={kind!r} is not one sp_jax converts; "
                         f"supported: {list(FAMILIES)}.")
    fields = REGISTRY[kind].config_from_hf(config, overrides)
    return GPTConfig(**{**fields, "param_dtype": _dtype_of(config), **overrides})


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The ``config.json`` dict of ``cfg`` for transformers (4.x and 5.x read it: Llama's
    rope settings are written in both spellings). Raises a ValueError when neither
    GPT-2 nor Llama expresses ``cfg``."""
    family = family_of(cfg)
    return {"model_type": family.model_type, **family.config_to_hf(cfg),
            "dtype": jnp.dtype(cfg.param_dtype).name}

"""Mistral (``model_type`` ``"mistral"``): Llama-shaped without biases, with
``sliding_window`` (null: full causal attention) honoured by the attention kernels (key
blocks outside the window skipped). The conversion table is Llama's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sp_jax.models.gpt_config import GPTConfig
from sp_jax.models.hf.family import PLAIN, Family, has_fields
from sp_jax.models.hf.llama import llama_shaped_fields, llama_shaped_rules, llama_shaped_to_hf

__all__ = ["MISTRAL"]


def config_from_hf(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of a Mistral ``config.json``: no biases (transformers'
    Mistral has none), ``sliding_window`` as it is (an int, or null)."""
    del overrides
    return dict(llama_shaped_fields(config, "mistral"), qkv_bias=False, out_bias=False,
                mlp_bias=False, sliding_window=config.get("sliding_window"))


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The Mistral ``config.json`` entries of ``cfg``."""
    return dict(llama_shaped_to_hf(cfg, "MistralForCausalLM"),
                sliding_window=cfg.sliding_window)


def expresses(cfg: GPTConfig) -> bool:
    """Dense (no experts); rotary positions, RMSNorm, SwiGLU, no biases, no q/k norm; any
    sliding window (without one, :mod:`.llama` comes first in the registry and writes it,
    unless the config remembers ``hf_model_type="mistral"``, as one read from a Mistral
    checkpoint does, or ``model_type="mistral"`` is asked for)."""
    return has_fields(cfg, **PLAIN, num_experts=0, positions="rotary", norm="rmsnorm",
                      mlp_activation="swiglu", qkv_bias=False, out_bias=False, mlp_bias=False,
                      layer_windows=None, qk_norm=False)


MISTRAL = Family(
    model_type="mistral",
    description="Mistral-shaped (Llama-shaped without biases, with a sliding window)",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, expresses=expresses,
    rules=llama_shaped_rules)

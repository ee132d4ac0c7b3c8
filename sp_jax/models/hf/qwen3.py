"""Qwen3 (``model_type`` ``"qwen3"``): Llama-shaped with per-head q/k RMSNorm
(``self_attn.q_norm`` / ``k_norm``, ``[head_dim]``, applied to each head's q and k before
the rotary angles: ``GPTConfig.qk_norm``), biases on q/k/v and the output projection
together (``attention_bias``, off in the published models), tied or untied head, and
Qwen2's sliding-window settings. transformers' default ``head_dim`` is 128 whatever the
width (Qwen3-0.6B: 1024 / 16 heads, 128 each): read as ``GPTConfig.head_dim``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sp_jax.models.gpt_config import GPTConfig
from sp_jax.models.hf.family import PLAIN, Family, has_fields
from sp_jax.models.hf.llama import llama_shaped_fields, llama_shaped_rules, llama_shaped_to_hf
from sp_jax.models.hf.qwen2 import qwen_window, qwen_window_to_hf

__all__ = ["QWEN3"]


def config_from_hf(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of a Qwen3 ``config.json``."""
    del overrides
    bias = bool(config.get("attention_bias", False))
    return dict(llama_shaped_fields(config, "qwen3", default_head_dim=128), qkv_bias=bias,
                out_bias=bias, mlp_bias=False, qk_norm=True,
                **qwen_window(config))


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The Qwen3 ``config.json`` entries of ``cfg``."""
    return dict(llama_shaped_to_hf(cfg, "Qwen3ForCausalLM"), attention_bias=cfg.qkv_bias,
                **qwen_window_to_hf(cfg))


def expresses(cfg: GPTConfig) -> bool:
    """Dense (no experts); rotary positions, RMSNorm, SwiGLU, q/k norm, ``qkv_bias ==
    out_bias``, no MLP bias."""
    return has_fields(cfg, **PLAIN, num_experts=0, positions="rotary", norm="rmsnorm",
                      mlp_activation="swiglu", qk_norm=True, out_bias=cfg.qkv_bias,
                      mlp_bias=False)


QWEN3 = Family(
    model_type="qwen3",
    description="Qwen3-shaped (Llama-shaped with per-head q/k RMSNorm)",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, expresses=expresses,
    rules=llama_shaped_rules)

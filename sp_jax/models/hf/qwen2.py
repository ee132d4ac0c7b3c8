"""Qwen2 (``model_type`` ``"qwen2"``): Llama-shaped with q/k/v biases and no output or MLP
bias (transformers' Qwen2 always has exactly these), tied or untied head. A sliding window
(``use_sliding_window``) is kept when it covers every layer and refused when it covers only
some (``max_window_layers`` / ``layer_types``): sp_jax has one window for all layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sp_jax.models.gpt_config import GPTConfig
from sp_jax.models.hf.family import Family, has_fields
from sp_jax.models.hf.llama import llama_shaped_fields, llama_shaped_rules, llama_shaped_to_hf

__all__ = ["QWEN2", "qwen_window", "qwen_window_to_hf"]


def qwen_window(config: Mapping[str, Any]) -> int | None:
    """The sliding window of a Qwen2 / Qwen3 ``config.json`` as transformers applies it:
    ``sliding_window`` when ``use_sliding_window``, on the layers ``layer_types`` names
    ``"sliding_attention"`` (without ``layer_types``: those from ``max_window_layers``
    on). The window when every layer has it, None when none has; a ValueError naming the
    key when only some layers have it."""
    get = config.get
    window = get("sliding_window") if get("use_sliding_window", False) else None
    if window is None:
        return None
    layers = get("num_hidden_layers")
    types = get("layer_types")
    if types is not None:
        sliding = [t == "sliding_attention" for t in types]
        key = f"layer_types={types!r}"
    else:
        first = get("max_window_layers", 28)
        sliding = [i >= first for i in range(layers)]
        key = f"max_window_layers={first}"
    if all(sliding):
        return int(window)
    if not any(sliding):
        return None
    raise ValueError(
        f"config.json: use_sliding_window with sliding_window={window} on some layers only "
        f"({key}, {layers} layers); sp_jax has one window for every layer: a window on all "
        "layers (max_window_layers=0) or on none is supported.")


def qwen_window_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The sliding-window entries of a Qwen2 / Qwen3 ``config.json`` of ``cfg``."""
    window = cfg.sliding_window
    kind = "full_attention" if window is None else "sliding_attention"
    return dict(use_sliding_window=window is not None, sliding_window=window,
                max_window_layers=cfg.num_layers if window is None else 0,
                layer_types=[kind] * cfg.num_layers)


def config_from_hf(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of a Qwen2 ``config.json``."""
    del overrides
    return dict(llama_shaped_fields(config, "qwen2"), qkv_bias=True, out_bias=False,
                mlp_bias=False, sliding_window=qwen_window(config))


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The Qwen2 ``config.json`` entries of ``cfg``."""
    return dict(llama_shaped_to_hf(cfg, "Qwen2ForCausalLM"), **qwen_window_to_hf(cfg))


def expresses(cfg: GPTConfig) -> bool:
    """Dense (no experts); rotary positions, RMSNorm, SwiGLU, q/k/v biases without an
    output or MLP bias, no q/k norm."""
    return has_fields(cfg, num_experts=0, positions="rotary", norm="rmsnorm",
                      mlp_activation="swiglu", qkv_bias=True, out_bias=False, mlp_bias=False,
                      qk_norm=False)


QWEN2 = Family(
    model_type="qwen2",
    description="Qwen2-shaped (Llama-shaped with q/k/v biases and no output bias)",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, expresses=expresses,
    rules=llama_shaped_rules)

"""Qwen2 (``model_type`` ``"qwen2"``): Llama-shaped with q/k/v biases and no output or MLP
bias (transformers' Qwen2 always has exactly these), tied or untied head. A sliding window
(``use_sliding_window``) on every layer is ``GPTConfig.sliding_window``; on some layers
only (``max_window_layers`` / ``layer_types``) it is ``GPTConfig.layer_windows``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sp_jax.models.gpt_config import GPTConfig
from sp_jax.models.hf.family import PLAIN, Family, has_fields
from sp_jax.models.hf.llama import llama_shaped_fields, llama_shaped_rules, llama_shaped_to_hf

__all__ = ["LAYER_TYPES", "QWEN2", "qwen_window", "qwen_window_to_hf"]


LAYER_TYPES = ("sliding_attention", "full_attention")
"""The ``layer_types`` entries of a Qwen2 / Qwen3 ``config.json`` sp_jax reads."""


def qwen_window(config: Mapping[str, Any]) -> dict[str, Any]:
    """The window fields of :class:`GPTConfig` (``sliding_window``, ``layer_windows``) of
    a Qwen2 / Qwen3 ``config.json`` as transformers applies it: ``sliding_window`` when
    ``use_sliding_window``, on the layers ``layer_types`` names ``"sliding_attention"``
    (without ``layer_types``: those from ``max_window_layers`` on). Every layer alike:
    ``sliding_window``; some only: ``layer_windows``. A ValueError naming an unknown
    ``layer_types`` entry."""
    get = config.get
    layers = get("num_hidden_layers")
    types = get("layer_types")
    if types is not None:
        for i, t in enumerate(types):
            if t not in LAYER_TYPES:
                raise ValueError(
                    f"config.json: layer_types[{i}]={t!r} is not a layer type sp_jax reads; "
                    f"use one of {list(LAYER_TYPES)} per layer.")
    window = get("sliding_window") if get("use_sliding_window", False) else None
    if window is None:
        return dict(sliding_window=None)
    if types is not None:
        sliding = [t == "sliding_attention" for t in types]
    else:
        first = get("max_window_layers", 28)
        sliding = [i >= first for i in range(layers)]
    if all(sliding):
        return dict(sliding_window=int(window))
    if not any(sliding):
        return dict(sliding_window=None)
    return dict(sliding_window=None,
                layer_windows=tuple(int(window) if s else None for s in sliding))


def qwen_window_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The sliding-window entries of a Qwen2 / Qwen3 ``config.json`` of ``cfg`` (a
    ValueError when its ``layer_windows`` hold more than one window: Qwen has one)."""
    windows = cfg.layer_windows or (cfg.sliding_window,) * cfg.num_layers
    sizes = sorted({w for w in windows if w is not None})
    if len(sizes) > 1:
        raise ValueError(f"to_hf: GPTConfig.layer_windows={cfg.layer_windows} holds windows "
                         f"{sizes}; a Qwen2 / Qwen3 config.json has one sliding_window.")
    window = sizes[0] if sizes else None
    kinds = ["full_attention" if w is None else "sliding_attention" for w in windows]
    leading = next((i for i, w in enumerate(windows) if w is not None), cfg.num_layers)
    return dict(use_sliding_window=window is not None, sliding_window=window,
                max_window_layers=leading, layer_types=kinds)


def config_from_hf(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of a Qwen2 ``config.json``."""
    del overrides
    return dict(llama_shaped_fields(config, "qwen2"), qkv_bias=True, out_bias=False,
                mlp_bias=False, **qwen_window(config))


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The Qwen2 ``config.json`` entries of ``cfg``."""
    return dict(llama_shaped_to_hf(cfg, "Qwen2ForCausalLM"), **qwen_window_to_hf(cfg))


def expresses(cfg: GPTConfig) -> bool:
    """Dense (no experts); rotary positions, RMSNorm, SwiGLU, q/k/v biases without an
    output or MLP bias, no q/k norm."""
    return has_fields(cfg, **PLAIN, num_experts=0, positions="rotary", norm="rmsnorm",
                      mlp_activation="swiglu", qkv_bias=True, out_bias=False, mlp_bias=False,
                      qk_norm=False)


QWEN2 = Family(
    model_type="qwen2",
    description="Qwen2-shaped (Llama-shaped with q/k/v biases and no output bias)",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, expresses=expresses,
    rules=llama_shaped_rules)

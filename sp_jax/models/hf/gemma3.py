"""Gemma 3, text only (``model_type`` ``"gemma3_text"``, ``Gemma3ForCausalLM``): Gemma 2's
block (:mod:`.gemma2`) with per-head q / k RMSNorms (``1 + weight``), five sliding layers
to one full by default (``layer_types``, or ``sliding_window_pattern``), and a rotary
base of their own for the sliding layers: ``rope_parameters["sliding_attention"]`` (4.x:
``rope_local_base_freq``) is ``GPTConfig.rope_local_base``, ``rope_parameters
["full_attention"]`` (4.x: ``rope_theta`` and ``rope_scaling``) ``rope_base`` and
``rope_scaling`` (``linear``, as Gemma 3 4B-27B, or ``llama3``). Soft caps, null in
Gemma 3's checkpoints, are read as Gemma 2's. The conversion table is Gemma 2's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sp_jax.models.gpt_config import GPTConfig
from sp_jax.models.hf.family import Family, has_fields
from sp_jax.models.hf.gemma2 import (
    gemma_expresses,
    gemma_fields,
    gemma_rope,
    gemma_rope_to_hf,
    gemma_rules,
    gemma_to_hf,
    gemma_windows,
)

__all__ = ["GEMMA3"]


def _rope_fields(config: Mapping[str, Any], windows: tuple | None) -> dict[str, Any]:
    """``rope_base``, ``rope_scaling`` and ``rope_local_base`` of a Gemma 3
    ``config.json`` (``rope_local_base`` None without sliding layers)."""
    get = config.get
    params = get("rope_parameters")
    if isinstance(params, Mapping) and ("full_attention" in params
                                        or "sliding_attention" in params):
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:  # transformers 4.x (or a flat 5.x dict: the full layers')
        full = dict(params or get("rope_scaling") or {})
        local = {"rope_theta": get("rope_local_base_freq", 10000.0)}
    base, scaling = gemma_rope(full, get("rope_theta", 1_000_000.0),
                               "rope_parameters['full_attention']")
    local_base, local_scaling = gemma_rope(local, 10000.0,
                                           "rope_parameters['sliding_attention']")
    if local_scaling is not None:
        raise ValueError(
            "config.json: rope_parameters['sliding_attention'] rope_type="
            f"{local.get('rope_type')!r}: sp_jax scales the full layers' rotary "
            "frequencies only; the sliding layers' rope_type must be 'default'.")
    has_local = windows is not None and any(w is not None for w in windows)
    return dict(rope_base=base, rope_scaling=scaling,
                rope_local_base=local_base if has_local else None)


def config_from_hf(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of a Gemma 3 text ``config.json``."""
    del overrides
    windows = gemma_windows(config, pattern=6)
    return dict(gemma_fields(config, "gemma3_text"), qk_norm=True, **windows,
                **_rope_fields(config, windows["layer_windows"]))


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The Gemma 3 text ``config.json`` entries of ``cfg`` (``rope_parameters`` per
    layer type, transformers 5.x; ``rope_theta`` / ``rope_local_base_freq`` /
    ``rope_scaling`` too, for 4.x)."""
    local = cfg.rope_base if cfg.rope_local_base is None else cfg.rope_local_base
    full = gemma_rope_to_hf(cfg.rope_base, cfg.rope_scaling)
    return dict(gemma_to_hf(cfg, "Gemma3ForCausalLM"), rope_parameters={
        "sliding_attention": gemma_rope_to_hf(local, None), "full_attention": full},
        rope_theta=cfg.rope_base, rope_local_base_freq=local,
        rope_scaling=None if cfg.rope_scaling is None else full)


def expresses(cfg: GPTConfig) -> bool:
    """A Gemma (:func:`~sp_jax.models.hf.gemma2.gemma_expresses`) with q/k norms whose
    sliding layers, if any, have unscaled rotary frequencies (``rope_scaling`` None or a
    ``rope_local_base``: Gemma 3 scales the full layers' only)."""
    local = any(cfg.layer_window(i) is not None for i in range(cfg.num_layers))
    return gemma_expresses(cfg) and has_fields(cfg, qk_norm=True) and not (
        local and cfg.rope_scaling is not None and cfg.rope_local_base is None)


GEMMA3 = Family(
    model_type="gemma3_text",
    description="Gemma-3-shaped (Gemma-2-shaped with per-head q/k RMSNorm and a local "
                "rotary base)",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, expresses=expresses,
    rules=gemma_rules)

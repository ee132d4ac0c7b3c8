"""Qwen3-MoE (``model_type`` ``"qwen3_moe"``): Qwen3's attention (per-head q/k RMSNorm,
``attention_bias`` on q/k/v and the output together) with a mixture of experts in every
``decoder_sparse_step``-th layer (layer ``i`` when ``(i + 1) % decoder_sparse_step ==
0``: ``GPTConfig.moe_layer_freq``), the other layers keeping a dense SwiGLU MLP of
``intermediate_size``. ``num_experts`` experts of width ``moe_intermediate_size``,
``num_experts_per_tok`` per token, renormalised when ``norm_topk_prob``; no shared
experts. ``mlp_only_layers`` (dense layers listed by index) is refused unless empty:
sp_jax places its expert layers by ``moe_layer_freq`` alone. ``sliding_window`` applies
to every layer when ``use_sliding_window`` (as transformers 5.x's Qwen3-MoE applies it).
transformers has no default ``head_dim`` here other than ``hidden / heads``; a
``head_dim`` that differs (Qwen3-30B-A3B's 128 with 2048 / 32 heads) is read as
``GPTConfig.head_dim``.

Tensors: as :mod:`.mixtral`, under ``mlp.``: the router ``mlp.gate.weight`` and expert
``e``'s ``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` (as
``save_pretrained`` writes them), or transformers 5.x's fused ``mlp.experts.gate_up_proj``
/ ``down_proj`` (its ``state_dict()``); the dense layers' ``mlp.gate_proj`` / ``up_proj``
/ ``down_proj`` as Llama's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from sp_jax.models.gpt_config import GPTConfig
from sp_jax.models.hf.family import PLAIN, Family, Rule, has_fields
from sp_jax.models.hf.llama import llama_shaped_fields, llama_shaped_to_hf
from sp_jax.models.hf.mixtral import (
    expert_rules,
    fused_expert_rules,
    is_fused,
    moe_shaped_rules,
    num_experts_of,
)

__all__ = ["QWEN3_MOE"]

_MLP = "model.layers.{i}.mlp."


def _rules(cfg: GPTConfig) -> list[Rule]:
    """Qwen3-MoE's conversion table as ``save_pretrained`` writes it (one module per
    expert)."""
    e = _MLP + "experts.{e}."
    return moe_shaped_rules(cfg, expert_rules(
        cfg, _MLP + "gate.weight", e + "gate_proj.weight", e + "up_proj.weight",
        e + "down_proj.weight"))


def _read_rules(cfg: GPTConfig, names: Collection[str]) -> list[Rule]:
    """:func:`_rules`, or for transformers 5.x's fused experts (its ``state_dict()``)
    theirs."""
    if is_fused(names):
        return moe_shaped_rules(cfg, fused_expert_rules(cfg, _MLP))
    return _rules(cfg)


def config_from_hf(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of a Qwen3-MoE ``config.json`` (``num_experts`` or,
    as transformers 5.x writes it, ``num_local_experts``)."""
    del overrides
    get = config.get
    fields = llama_shaped_fields(config, "qwen3_moe")
    experts = num_experts_of(config, "qwen3_moe")
    for key in ("moe_intermediate_size", "num_experts_per_tok"):
        if get(key) is None:
            raise ValueError(f"config.json: the key {key!r} is missing (a qwen3_moe "
                             "config.json needs it: the model's shape depends on it).")
    only = get("mlp_only_layers") or []
    if only:
        raise ValueError(f"config.json: mlp_only_layers={list(only)!r}: sp_jax chooses its "
                         "dense layers by decoder_sparse_step alone (GPTConfig."
                         "moe_layer_freq); a checkpoint with mlp_only_layers=[] is "
                         "supported.")
    step = get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise ValueError(f"config.json: decoder_sparse_step={step!r} must be a positive int.")
    bias = bool(get("attention_bias", False))
    window = get("sliding_window") if get("use_sliding_window", False) else None
    return dict(fields, qkv_bias=bias, out_bias=bias, mlp_bias=False, qk_norm=True,
                sliding_window=window, num_experts=experts,
                experts_per_token=get("num_experts_per_tok"),
                moe_mlp_hidden=get("moe_intermediate_size"),
                moe_norm_topk=bool(get("norm_topk_prob", False)), moe_layer_freq=step,
                router_aux_loss_coef=float(get("router_aux_loss_coef", 0.001)))


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The Qwen3-MoE ``config.json`` entries of ``cfg`` (``num_experts``, which
    transformers 4.x reads and 5.x maps to ``num_local_experts``)."""
    window = cfg.sliding_window
    return dict(llama_shaped_to_hf(cfg, "Qwen3MoeForCausalLM"), attention_bias=cfg.qkv_bias,
                use_sliding_window=window is not None, sliding_window=window,
                decoder_sparse_step=cfg.moe_layer_freq, mlp_only_layers=[],
                moe_intermediate_size=cfg.moe_mlp_hidden, num_experts=cfg.num_experts,
                num_experts_per_tok=cfg.experts_per_token, norm_topk_prob=cfg.moe_norm_topk,
                router_aux_loss_coef=cfg.router_aux_loss_coef, output_router_logits=False)


def expresses(cfg: GPTConfig) -> bool:
    """Experts (any ``moe_layer_freq``, renormalised top-k or not), no shared experts;
    rotary positions, RMSNorm, SwiGLU, q/k norm, ``qkv_bias == out_bias``, no MLP bias,
    any sliding window. The training-only ``moe_capacity_factor`` / ``router_z_loss_coef``
    are not written: transformers' Qwen3-MoE is dropless and has no z-loss."""
    return cfg.num_experts > 0 and has_fields(
        cfg, **PLAIN, positions="rotary", norm="rmsnorm", mlp_activation="swiglu", qk_norm=True,
        out_bias=cfg.qkv_bias, mlp_bias=False, num_shared_experts=0)


QWEN3_MOE = Family(
    model_type="qwen3_moe",
    description="Qwen3-MoE-shaped (Qwen3-shaped with experts every moe_layer_freq-th layer, "
                "no shared experts)",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, expresses=expresses,
    rules=_rules, read_rules=_read_rules)

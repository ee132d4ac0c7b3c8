"""GLM-4.5 (``model_type`` ``"glm4_moe"``: GLM-4.5, GLM-4.5-Air): grouped-query attention
with partial rotary angles (the first ``partial_rotary_factor`` of each head, 0.5 when
``config.json`` gives none, as transformers), biases on q/k/v (``attention_bias``; none
on the output), optional per-head q/k RMSNorm (``use_qk_norm``), RMSNorm, SwiGLU, and
DeepSeek-V3's mixture of experts (:mod:`.deepseek_v3`: ``first_k_dense_replace`` dense
layers, sigmoid group-limited routing with ``e_score_correction_bias``,
``routed_scaling_factor``, shared experts).

Tensors: the attention as :mod:`.llama`'s (``q_proj`` / ``k_proj`` / ``v_proj`` with
their biases, ``o_proj``, ``q_norm`` / ``k_norm``), the mixture as DeepSeek-V3's. The
multi-token-prediction layers (``num_nextn_predict_layers``, after the decoder layers)
are read into ``GPT.mtp`` and written as DeepSeek-V3's (:mod:`.deepseek_v3`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from sp_jax.models.gpt_config import GPTConfig
from sp_jax.models.hf.deepseek_v3 import (
    deepseek_moe_expresses,
    deepseek_moe_fields,
    deepseek_moe_rules,
    deepseek_moe_to_hf,
    mtp_layers_skipped,
)
from sp_jax.models.hf.family import ATTENTION, PLAIN, Family, Rule, has_fields
from sp_jax.models.hf.llama import (
    llama_shaped_fields,
    llama_shaped_rules,
    llama_shaped_to_hf,
    rope_of,
)
from sp_jax.models.hf.mixtral import is_fused

__all__ = ["GLM4_MOE"]

DEFAULT_PARTIAL_ROTARY = 0.5
"""transformers' ``partial_rotary_factor`` of a GLM-4.5 ``config.json`` that gives none."""


def _attention_rules(cfg: GPTConfig) -> list[Rule]:
    return [r for r in llama_shaped_rules(cfg) if r.ours.startswith(ATTENTION)]


def _rules(cfg: GPTConfig) -> list[Rule]:
    """GLM-4.5's conversion table as ``save_pretrained`` writes it (one module per
    expert)."""
    return deepseek_moe_rules(cfg, _attention_rules(cfg))


def _read_rules(cfg: GPTConfig, names: Collection[str]) -> list[Rule]:
    """:func:`_rules`, or for transformers 5.x's fused experts theirs."""
    return deepseek_moe_rules(cfg, _attention_rules(cfg), fused=is_fused(names),
                              names=names)


def config_from_hf(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of a GLM-4.5 ``config.json`` (``partial_rotary_factor``
    in ``rope_parameters`` or at the top level)."""
    del overrides
    get = config.get
    factor = rope_of(config).get("partial_rotary_factor",
                                 get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY))
    return dict(llama_shaped_fields(config, "glm4_moe", yarn=True),
                qkv_bias=bool(get("attention_bias", False)), out_bias=False, mlp_bias=False,
                qk_norm=bool(get("use_qk_norm", False)),
                partial_rotary_factor=float(factor),
                **deepseek_moe_fields(config, "glm4_moe"))


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The GLM-4.5 ``config.json`` entries of ``cfg`` (rope settings in transformers
    4.x's and 5.x's spelling)."""
    out = llama_shaped_to_hf(cfg, "Glm4MoeForCausalLM")
    out["rope_parameters"] = {**out["rope_parameters"],
                              "partial_rotary_factor": cfg.partial_rotary_factor}
    return dict(out, partial_rotary_factor=cfg.partial_rotary_factor,
                attention_bias=cfg.qkv_bias, use_qk_norm=cfg.qk_norm,
                **deepseek_moe_to_hf(cfg))


def expresses(cfg: GPTConfig) -> bool:
    """Grouped-query (or multi-head) attention with any partial rotary factor, q/k/v
    biases or not, no output bias, q/k norm or not, no window; a DeepSeek-routed
    mixture (:func:`.deepseek_v3.deepseek_moe_expresses`)."""
    return deepseek_moe_expresses(cfg) and has_fields(
        cfg, **{**PLAIN, "num_dense_layers": cfg.num_dense_layers, "moe_scoring": "sigmoid",
                "moe_groups": cfg.moe_groups, "moe_topk_groups": cfg.moe_topk_groups,
                "moe_routed_scale": cfg.moe_routed_scale,
                "partial_rotary_factor": cfg.partial_rotary_factor},
        out_bias=False, sliding_window=None, layer_windows=None)


GLM4_MOE = Family(
    model_type="glm4_moe",
    description="GLM-4.5-shaped (grouped-query attention with partial rotary, q/k/v biases "
                "and optional q/k norm; DeepSeek-routed experts after num_dense_layers dense "
                "layers)",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, expresses=expresses,
    rules=_rules, read_rules=_read_rules, skipped=mtp_layers_skipped, yarn=True)

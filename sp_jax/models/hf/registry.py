"""The families sp_jax converts, by ``model_type``, and ``config.json`` <-> :class:`GPTConfig`
through them (with the special token ids every family keeps the same way)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

from sp_jax.models.gpt_config import GPTConfig
from sp_jax.models.hf import (
    deepseek_v3,
    gemma2,
    gemma3,
    glm4_moe,
    gpt2,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen3,
    qwen3_moe,
)
from sp_jax.models.hf.family import Family

__all__ = ["FAMILIES", "READ_AS", "REGISTRY", "TOKEN_IDS", "config_from_hf", "config_to_hf",
           "family_of", "family_read_as", "generation_config"]

REGISTRY: dict[str, Family] = {f.model_type: f for f in (
    gpt2.GPT2, llama.LLAMA, mistral.MISTRAL, qwen2.QWEN2, qwen3.QWEN3, mixtral.MIXTRAL,
    qwen3_moe.QWEN3_MOE, gemma2.GEMMA2, gemma3.GEMMA3, deepseek_v3.DEEPSEEK_V3,
    glm4_moe.GLM4_MOE)}
"""``model_type`` -> :class:`Family`; the first that expresses a :class:`GPTConfig` writes it
when the config remembers no family that does (``GPTConfig.hf_model_type``) and
``model_type=`` asks for none."""

READ_AS = {"kimi_k2": "deepseek_v3"}
"""``model_type`` s read as another family's: Kimi K2's published ``config.json`` says
``kimi_k2`` for DeepSeek-V3's architecture (written back as ``deepseek_v3``)."""

FAMILIES = tuple(REGISTRY)
"""The ``model_type`` s of ``config.json`` that :func:`from_hf` reads (and
:data:`READ_AS`'s)."""


def family_read_as(model_type: Any) -> Family:
    """The family a ``config.json`` of ``model_type`` is read as; a ValueError naming the
    ones sp_jax reads."""
    kind = READ_AS.get(model_type, model_type)
    if kind not in REGISTRY:
        raise ValueError(f"config.json: model_type={model_type!r} is not one sp_jax converts; "
                         f"supported: {[*FAMILIES, *READ_AS]}.")
    return REGISTRY[kind]


TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The special token ids kept from ``config.json`` in :class:`GPTConfig` and written back
(``config.json`` and ``generation_config.json``), in every family."""


def family_of(cfg: GPTConfig, model_type: str | None = None) -> Family:
    """The Hugging Face family that writes ``cfg``: ``model_type``'s when given (a
    ValueError when it cannot express ``cfg`` exactly); else the family ``cfg``
    remembers (``GPTConfig.hf_model_type``: the one it was read as, or its preset's)
    while that one still expresses it; else the first of :data:`REGISTRY` that does, or
    a ValueError naming the fields that no family has."""
    if model_type is not None:
        if model_type not in REGISTRY:
            raise ValueError(f"to_hf: model_type={model_type!r} is not one sp_jax writes; "
                             f"supported: {list(FAMILIES)}.")
        family = REGISTRY[model_type]
        if not family.writes(cfg):
            raise ValueError(
                f"to_hf: model_type={model_type!r} cannot express this GPTConfig exactly: "
                f"{family.description}; got {_shape_fields(cfg)}.")
        return family
    remembered = cfg.hf_model_type
    if remembered is not None:
        if remembered not in REGISTRY:
            raise ValueError(f"to_hf: GPTConfig.hf_model_type={remembered!r} is not one "
                             f"sp_jax writes; supported: {list(FAMILIES)} (pass "
                             "model_type= or set hf_model_type=None).")
        if REGISTRY[remembered].writes(cfg):
            return REGISTRY[remembered]
    for family in REGISTRY.values():
        if family.writes(cfg):
            return family
    raise ValueError(
        "to_hf: this GPTConfig is neither "
        + " nor ".join(f.description for f in REGISTRY.values())
        + f": {_shape_fields(cfg)}.")


def _shape_fields(cfg: GPTConfig) -> str:
    return (f"positions={cfg.positions!r}, norm={cfg.norm!r}, "
            f"mlp_activation={cfg.mlp_activation!r}, qkv_bias={cfg.qkv_bias}, "
            f"out_bias={cfg.out_bias}, mlp_bias={cfg.mlp_bias}, "
            f"num_kv_heads={cfg.num_kv_heads}, qk_norm={cfg.qk_norm}, "
            f"sliding_window={cfg.sliding_window}, num_experts={cfg.num_experts}"
            + (f", moe_layer_freq={cfg.moe_layer_freq}, moe_norm_topk={cfg.moe_norm_topk}, "
               f"num_shared_experts={cfg.num_shared_experts}" if cfg.num_experts else "")
            + (f", num_dense_layers={cfg.num_dense_layers}" if cfg.num_dense_layers else "")
            + (f", attention={cfg.attention!r}" if cfg.attention != "mha" else ""))


def _dtype_of(config: Mapping[str, Any]):
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    try:
        return jnp.dtype(str(name).removeprefix("torch."))
    except TypeError as e:
        raise ValueError(f"config.json: dtype {name!r} is not a dtype sp_jax knows.") from e


def config_from_hf(config: Mapping[str, Any], **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a Hugging Face ``config.json`` (a dict).

    ``model_type`` one of :data:`FAMILIES` (``"gpt2"``, ``"llama"``, ``"mistral"``,
    ``"qwen2"``, ``"qwen3"``, ``"mixtral"``, ``"qwen3_moe"``, ``"gemma2"``,
    ``"gemma3_text"``), as written by transformers
    4.x (``rope_theta`` and ``rope_scaling`` at the top level) or 5.x
    (``rope_parameters``). Options sp_jax cannot reproduce exactly raise a ValueError
    naming the key (e.g. GPT-2's ``scale_attn_by_inverse_layer_idx``, rope types other
    than default and ``llama3``, a Qwen sliding window on some layers only, Qwen3-MoE's
    ``mlp_only_layers``, Mixtral's ``router_jitter_noise``), and so does a missing shape
    key (``hidden_size``, ...). ``head_dim`` other than ``hidden / heads`` is read as
    ``GPTConfig.head_dim``. ``param_dtype`` is the config's ``dtype`` (``torch_dtype`` in
    4.x), float32 when absent;
    ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` are kept as they are (None
    when absent), and ``model_type`` as ``hf_model_type`` (the family :func:`config_to_hf`
    and :func:`~sp_jax.models.hf.to_hf` write back).

    GPT-2 has three dropout rates; sp_jax has one for embeddings and residuals
    (``dropout`` = ``resid_pdrop``, which must equal ``embd_pdrop`` unless ``dropout`` is
    overridden) and ``attention_dropout`` = ``attn_pdrop``.

    Args:
      config: the parsed ``config.json``.
      overrides: :class:`GPTConfig` fields to set instead (e.g. ``dtype=jnp.bfloat16``,
        ``remat=True``, ``dropout=0.0``).
    """
    return translate(config, "config.json", overrides)


def translate(config: Mapping[str, Any], where: str, overrides: Mapping[str, Any]
              ) -> GPTConfig:
    """:func:`config_from_hf` with the errors about the file naming ``where`` (its path)
    instead of ``config.json``."""
    try:
        if not isinstance(config, Mapping):
            raise ValueError(f"config.json: expected a JSON object, got "
                             f"{type(config).__name__}.")
        family = family_read_as(config.get("model_type"))
        quantized = config.get("quantization_config")
        if quantized:
            method = quantized.get("quant_method") if isinstance(quantized, Mapping) else None
            raise ValueError(
                f"config.json: quantization_config (quant_method={method!r}: quantised "
                "weights with their scale tensors, as DeepSeek-V3 and Kimi K2 publish FP8 "
                "block-scaled ones) is not read; dequantise the checkpoint to bf16 first "
                "(e.g. DeepSeek-V3's inference/fp8_cast_bf16.py) and read that.")
        fields = family.config_from_hf(config, overrides)
        fields.update({k: config.get(k) for k in TOKEN_IDS}, hf_model_type=family.model_type)
        return GPTConfig(**{**fields, "param_dtype": _dtype_of(config), **overrides})
    except ValueError as e:
        prefix = "config.json: "
        if where == "config.json" or not str(e).startswith(prefix):
            raise
        raise ValueError(f"{where}: {str(e)[len(prefix):]}") from e


def config_to_hf(cfg: GPTConfig, model_type: str | None = None) -> dict[str, Any]:
    """The ``config.json`` dict of ``cfg`` for transformers (4.x and 5.x read it: rope
    settings are written in both spellings), by the family :func:`family_of` picks:
    ``model_type``'s when given (e.g. ``"mistral"`` for a Llama-shaped config without
    biases), else the one ``cfg.hf_model_type`` remembers while it expresses ``cfg``,
    else the first that does.
    ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` are written when not None.
    Raises a ValueError when no family expresses ``cfg``."""
    family = family_of(cfg, model_type)
    return {"model_type": family.model_type, **family.config_to_hf(cfg),
            "dtype": jnp.dtype(cfg.param_dtype).name, **_token_ids(cfg)}


def _token_ids(cfg: GPTConfig) -> dict[str, Any]:
    out = {}
    for k in TOKEN_IDS:
        value = getattr(cfg, k)
        if value is not None:
            out[k] = list(value) if isinstance(value, tuple) else value
    return out


def generation_config(cfg: GPTConfig) -> dict[str, Any]:
    """The ``generation_config.json`` dict of ``cfg``, as transformers'
    ``GenerationConfig.save_pretrained`` writes one made from a model config: the special
    token ids that are not None and ``"_from_model_config": true``."""
    return {"_from_model_config": True, **_token_ids(cfg)}

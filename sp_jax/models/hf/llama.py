"""Llama (``model_type`` ``"llama"``): rotary positions (default or ``llama3`` scaling),
RMSNorm, SwiGLU, optional biases, grouped-query attention; ``torch.nn.Linear`` weights
``[out, in]`` transposed, ``q_proj`` / ``k_proj`` / ``v_proj`` fused into sp_jax's per-head
columns and ``gate_proj`` / ``up_proj`` interleaved into the fused SwiGLU kernel.

The Llama-shaped families (:mod:`.mistral`, :mod:`.qwen2`, :mod:`.qwen3`) are written with
this module's pieces: :func:`llama_shaped_fields` / :func:`llama_shaped_to_hf` (the
``config.json`` entries they share) and :func:`llama_shaped_rules` (the conversion table,
with Qwen3's q/k norms when the config has them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sp_jax.models.gpt_config import GPTConfig, RopeScaling, YarnScaling
from sp_jax.models.hf.family import (
    ATTENTION,
    MLP,
    PLAIN,
    Family,
    Rule,
    has_fields,
    interleave,
    require,
    same,
    transposed,
)

__all__ = ["LLAMA", "LLAMA_SHAPED_KEYS", "llama_shaped_fields", "llama_shaped_rules",
           "llama_shaped_to_hf", "rope_of", "rope_scaling_from_hf", "rope_scaling_to_hf",
           "rope_settings", "shape_to_hf"]

LLAMA_SHAPED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "max_position_embeddings")
"""The ``config.json`` keys a Llama-shaped model cannot be read without."""


def rope_scaling_from_hf(rope: Mapping[str, Any], config: Mapping[str, Any],
                         yarn: bool = False) -> RopeScaling | YarnScaling | None:
    """The rotary scaling of one rope parameter dict (``rope_scaling`` / ``rope_parameters``
    of a ``config.json``, ``config`` the whole file): None (``default``), Llama-3's
    (:class:`RopeScaling`) or, for a family that reads it (``yarn``: DeepSeek-V3 and
    GLM-4.5's), YaRN's (:class:`YarnScaling`; without ``factor``,
    ``max_position_embeddings / original_max_position_embeddings`` as transformers);
    a ValueError naming another type."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type == "llama3":
        return RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    if rope_type == "yarn" and yarn:
        original = int(rope["original_max_position_embeddings"])
        factor = rope.get("factor")
        if factor is None:
            factor = config["max_position_embeddings"] / original
        optional = {k: rope[k] for k in ("mscale", "mscale_all_dim", "attention_factor")
                    if rope.get(k) is not None}
        return YarnScaling(factor=float(factor), original_max_position_embeddings=original,
                           beta_fast=float(rope.get("beta_fast") or 32.0),
                           beta_slow=float(rope.get("beta_slow") or 1.0),
                           truncate=bool(rope.get("truncate", True)),
                           **{k: float(v) for k, v in optional.items()})
    raise ValueError(f"config.json: rope type {rope_type!r} has no sp_jax counterpart; "
                     "sp_jax implements 'default' and 'llama3'"
                     + (" and 'yarn'." if yarn else " (and 'yarn' for deepseek_v3 and "
                        "glm4_moe)."))


def rope_scaling_to_hf(scaling: RopeScaling | YarnScaling | None) -> dict[str, Any]:
    """The rope parameter dict of ``scaling`` (without ``rope_theta``), as
    :func:`rope_scaling_from_hf` reads it back."""
    if scaling is None:
        return {"rope_type": "default"}
    fields = {k: v for k, v in dataclasses.asdict(scaling).items() if v is not None}
    return {"rope_type": "yarn" if isinstance(scaling, YarnScaling) else "llama3", **fields}


def rope_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The rope parameter dict of a ``config.json`` (transformers 4.x: ``rope_scaling`` at
    the top level; 5.x: ``rope_parameters``; ``{}`` when it has none)."""
    return dict(config.get("rope_parameters") or config.get("rope_scaling") or {})


def rope_settings(config: Mapping[str, Any], yarn: bool = False
          ) -> tuple[float, RopeScaling | YarnScaling | None]:
    """``(rope_base, rope_scaling)`` of a ``config.json`` (transformers 4.x: ``rope_theta``
    and ``rope_scaling`` at the top level; 5.x: ``rope_parameters``); ``yarn``: as
    :func:`rope_scaling_from_hf`."""
    rope = rope_of(config)
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    return theta, rope_scaling_from_hf(rope, config, yarn)


def llama_shaped_fields(config: Mapping[str, Any], model_type: str,
                        default_head_dim: int | None = None, yarn: bool = False
                        ) -> dict[str, Any]:
    """The :class:`GPTConfig` fields every Llama-shaped ``config.json`` gives the same way
    (shapes, heads, rotary settings, RMSNorm, SwiGLU, tied head, attention dropout); the
    family adds its biases, window and q/k norm. ``default_head_dim``: the head size
    transformers assumes when ``head_dim`` is absent (Qwen3: 128; None: ``hidden /
    heads``). A head size other than ``hidden / heads`` becomes ``GPTConfig.head_dim``
    (equal to it: None, the derived default). ``yarn``: the family reads YaRN's rope
    scaling (:func:`rope_scaling_from_hf`)."""
    require(config, model_type, *LLAMA_SHAPED_KEYS)
    get = config.get
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim") or default_head_dim
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 \
            and hidden % heads == 0 and head_dim == hidden // heads:
        head_dim = None  # today's derived head size: the config compares equal
    if get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={get('hidden_act')!r}: sp_jax's "
                         f"{model_type} MLP is SwiGLU ('silu').")
    theta, scaling = rope_settings(config, yarn)
    return dict(
        vocab_size=get("vocab_size"), max_seq_len=get("max_position_embeddings"),
        num_layers=get("num_hidden_layers"), num_heads=heads, hidden=hidden,
        head_dim=head_dim, mlp_hidden=get("intermediate_size"),
        num_kv_heads=get("num_key_value_heads") or heads,
        attention_dropout=float(get("attention_dropout", 0.0)),
        tie_embeddings=bool(get("tie_word_embeddings", False)), positions="rotary",
        rope_base=theta, rope_scaling=scaling, norm="rmsnorm",
        norm_epsilon=float(get("rms_norm_eps", 1e-6)), mlp_activation="swiglu")


def shape_to_hf(cfg: GPTConfig, architecture: str) -> dict[str, Any]:
    """The ``config.json`` shape entries of a decoder with RMSNorm (the Llama-shaped and
    Gemma families): class, vocabulary, widths, layers, heads, positions, epsilon, and
    the attention dropout and tied head."""
    return dict(
        architectures=[architecture], vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden, intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.attention_config().head_dim,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_epsilon,
        attention_dropout=cfg.attention_dropout, tie_word_embeddings=cfg.tie_embeddings)


def llama_shaped_to_hf(cfg: GPTConfig, architecture: str) -> dict[str, Any]:
    """The ``config.json`` entries every Llama-shaped family writes the same way, rope
    settings in both transformers 4.x's and 5.x's spelling."""
    rope = rope_scaling_to_hf(cfg.rope_scaling)
    return dict(
        shape_to_hf(cfg, architecture), hidden_act="silu", rope_theta=cfg.rope_base,
        rope_scaling=None if cfg.rope_scaling is None else rope,
        rope_parameters={**rope, "rope_theta": cfg.rope_base})


def config_from_hf(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of a Llama ``config.json`` (transformers 4.x:
    ``rope_theta`` and ``rope_scaling`` at the top level; 5.x: ``rope_parameters``)."""
    del overrides  # no check depends on them
    bias = bool(config.get("attention_bias", False))
    return dict(llama_shaped_fields(config, "llama"), qkv_bias=bias, out_bias=bias,
                mlp_bias=bool(config.get("mlp_bias", False)))


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The Llama ``config.json`` entries of ``cfg``."""
    return dict(llama_shaped_to_hf(cfg, "LlamaForCausalLM"), attention_bias=cfg.qkv_bias,
                mlp_bias=cfg.mlp_bias)


def expresses(cfg: GPTConfig) -> bool:
    """Dense (no experts); rotary positions, RMSNorm, SwiGLU, ``qkv_bias == out_bias``, no
    sliding window, no q/k norm."""
    return has_fields(cfg, **PLAIN, num_experts=0, positions="rotary", norm="rmsnorm",
                      mlp_activation="swiglu", out_bias=cfg.qkv_bias, sliding_window=None,
                      layer_windows=None, qk_norm=False)


def llama_shaped_rules(cfg: GPTConfig) -> list[Rule]:
    """The conversion table of a Llama-shaped ``cfg`` (``model.layers.{i}.self_attn`` /
    ``.mlp``; biases, untied head and Qwen3's ``q_norm`` / ``k_norm`` as ``cfg`` has
    them)."""
    h, d = cfg.num_heads, cfg.attention_config().head_dim
    a, m, p = ATTENTION, MLP, "model.layers.{i}."
    q, k, v = (p + f"self_attn.{n}_proj." for n in "qkv")
    table = [same("embed/embedding", "model.embed_tokens.weight"),
             same(a + "norm/scale", p + "input_layernorm.weight"),
             transposed(a + "out/kernel", p + "self_attn.o_proj.weight"),
             same(m + "norm/scale", p + "post_attention_layernorm.weight"),
             transposed(m + "down/kernel", p + "mlp.down_proj.weight"),
             same("final_norm/scale", "model.norm.weight"),
             interleave(m + "up/kernel", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                        (1, 1), cfg.mlp_hidden, transpose=True)]
    # q/k/v weights (and biases): one fused (head, {q, k, v}, head_dim) kernel, or with
    # grouped-query attention q_kernel and (kv_head, {k, v}, head_dim)
    for kind, names, transpose in (("weight", ("kernel", "q_kernel", "kv_kernel"), True),
                                   ("bias", ("bias", "q_bias", "kv_bias"), False)):
        if kind == "bias" and not cfg.qkv_bias:
            continue
        if cfg.num_kv_heads == h:
            table.append(interleave(a + "qkv/" + names[0], (q + kind, k + kind, v + kind),
                                    (d, d, d), h, transpose=transpose))
        else:
            table += [(transposed if transpose else same)(a + "qkv/" + names[1], q + kind),
                      interleave(a + "qkv/" + names[2], (k + kind, v + kind), (d, d),
                                 cfg.num_kv_heads, transpose=transpose)]
    if cfg.out_bias:
        table.append(same(a + "out/bias", p + "self_attn.o_proj.bias"))
    if cfg.qk_norm:
        table += [same(a + "q_norm", p + "self_attn.q_norm.weight"),
                  same(a + "k_norm", p + "self_attn.k_norm.weight")]
    if cfg.mlp_bias:
        table += [interleave(m + "up/bias", (p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"),
                             (1, 1), cfg.mlp_hidden, transpose=False),
                  same(m + "down/bias", p + "mlp.down_proj.bias")]
    if not cfg.tie_embeddings:
        table.append(same("head/embedding", "lm_head.weight"))
    return table


LLAMA = Family(
    model_type="llama",
    description="Llama-shaped (rotary, RMSNorm, SwiGLU, qkv_bias == out_bias)",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, expresses=expresses,
    rules=llama_shaped_rules)

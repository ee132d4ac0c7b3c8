"""Gemma 2 (``model_type`` ``"gemma2"``): Llama-shaped projections with Gemma's block,
RMSNorm scaling by ``1 + weight``, embeddings times ``sqrt(hidden)``, a norm before and
after the attention and the MLP, gated tanh-GELU (``gelu_pytorch_tanh``), queries scaled
by ``query_pre_attn_scalar ** -0.5``, attention-logit and final-logit soft caps, tied
embeddings by default, sliding and full layers alternating (``layer_types``).

The pieces every Gemma shares (:mod:`.gemma3` builds on them): :func:`gemma_fields` /
:func:`gemma_to_hf` (the ``config.json`` entries), :func:`gemma_rules` (the conversion
table: Llama's, whose ``post_attention_layernorm`` is Gemma's norm *after* the attention,
its MLP's pre-norm being ``pre_feedforward_layernorm``) and :func:`gemma_expresses`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sp_jax.models.gpt_config import GPTConfig, RopeScaling
from sp_jax.models.hf.family import ATTENTION, MLP, Family, Rule, has_fields, require, same
from sp_jax.models.hf.llama import LLAMA_SHAPED_KEYS, llama_shaped_rules, shape_to_hf

__all__ = ["ATTENTION_POST_NORM", "GEMMA2", "MLP_POST_NORM", "gemma_expresses",
           "gemma_fields", "gemma_rope", "gemma_rope_to_hf", "gemma_rules", "gemma_to_hf",
           "gemma_windows", "gemma_windows_to_hf", "linear_rope_scaling"]

ATTENTION_POST_NORM = ATTENTION + "post_norm/scale"
"""The sp_jax path of a block's norm after the attention (Gemma's
``post_attention_layernorm``)."""
MLP_POST_NORM = MLP + "post_norm/scale"
"""The sp_jax path of a block's norm after the MLP (``post_feedforward_layernorm``)."""

ACTIVATIONS = ("gelu_pytorch_tanh",)
"""The ``hidden_activation`` s sp_jax's ``"geglu_tanh"`` MLP computes."""

LAYER_TYPES = ("sliding_attention", "full_attention")
"""The ``layer_types`` entries of a Gemma ``config.json`` sp_jax reads."""


def linear_rope_scaling(factor: float) -> RopeScaling:
    """transformers' ``rope_type="linear"`` (every frequency divided by ``factor``) as
    the Llama-3 scaling it equals: with ``original_max_position_embeddings=1`` and
    ``low_freq_factor=1`` every wavelength (at least ``2 pi``) is above the band, so each
    frequency is divided by ``factor``, the one float32 division transformers makes."""
    return RopeScaling(factor=float(factor), low_freq_factor=1.0, high_freq_factor=2.0,
                       original_max_position_embeddings=1)


def gemma_rope(rope: Mapping[str, Any], theta: float, where: str
               ) -> tuple[float, RopeScaling | None]:
    """``(rope_base, rope_scaling)`` of one rope parameter dict (``rope_type``
    ``"default"``, ``"linear"`` or ``"llama3"``; ``theta`` when it holds no
    ``rope_theta``); ``where`` names it in the ValueError on another type."""
    theta = float(rope.get("rope_theta", theta))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "linear":
        return theta, linear_rope_scaling(rope["factor"])
    if kind == "llama3":
        return theta, RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    raise ValueError(f"config.json: {where} rope_type={kind!r} has no sp_jax counterpart; "
                     "sp_jax implements 'default', 'linear' and 'llama3'.")


def gemma_rope_to_hf(base: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """One rope parameter dict (transformers 5.x) of ``base`` and ``scaling``."""
    if scaling is None:
        return {"rope_type": "default", "rope_theta": base}
    if scaling == linear_rope_scaling(scaling.factor):
        return {"rope_type": "linear", "factor": scaling.factor, "rope_theta": base}
    return {"rope_type": "llama3", **dataclasses.asdict(scaling), "rope_theta": base}


def gemma_windows(config: Mapping[str, Any], pattern: int) -> dict[str, Any]:
    """``layer_windows`` of a Gemma ``config.json``: ``sliding_window`` on the layers
    ``layer_types`` names ``"sliding_attention"`` (without ``layer_types``: all but every
    ``pattern``-th, as transformers' default; Gemma 3's ``sliding_window_pattern``).
    A ValueError naming an unknown ``layer_types`` entry."""
    get = config.get
    layers = get("num_hidden_layers")
    types = get("layer_types")
    if types is None:
        pattern = int(get("sliding_window_pattern", get("_sliding_window_pattern", pattern)))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]
    if len(types) != layers:
        raise ValueError(f"config.json: layer_types has {len(types)} entries for "
                         f"num_hidden_layers={layers}; give one per layer.")
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ValueError(f"config.json: layer_types[{i}]={t!r} is not a layer type sp_jax "
                             f"reads; use one of {list(LAYER_TYPES)} per layer.")
    window = get("sliding_window")
    if window is None or "sliding_attention" not in types:
        return dict(sliding_window=None, layer_windows=None)
    return dict(sliding_window=None, layer_windows=tuple(
        int(window) if t == "sliding_attention" else None for t in types))


def gemma_windows_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` of ``cfg`` (a ValueError when its layers
    hold more than one window: Gemma has one)."""
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    sizes = sorted({w for w in windows if w is not None})
    if len(sizes) > 1:
        raise ValueError(f"to_hf: GPTConfig.layer_windows={cfg.layer_windows} holds windows "
                         f"{sizes}; a Gemma config.json has one sliding_window.")
    return dict(sliding_window=sizes[0] if sizes else None,
                layer_types=["full_attention" if w is None else "sliding_attention"
                             for w in windows])


def gemma_fields(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The :class:`GPTConfig` fields every Gemma ``config.json`` gives the same way
    (shapes, heads, head size (default 256), RMSNorm ``1 + weight``, post-norms, scaled
    embeddings, gated tanh-GELU, query scale, soft caps, biases, tied head); the family
    adds its rotary settings, windows and q/k norms. ValueErrors name the key sp_jax
    cannot reproduce (another ``hidden_activation``, bidirectional attention)."""
    require(config, model_type, *LLAMA_SHAPED_KEYS)
    get = config.get
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    head_dim = get("head_dim") or 256
    act_key = "hidden_activation" if get("hidden_activation") is not None else "hidden_act"
    act = get(act_key, "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json: {act_key}={act!r}: sp_jax's {model_type} MLP is gated "
                         f"tanh-GELU ({list(ACTIVATIONS)}, mlp_activation='geglu_tanh').")
    if get("use_bidirectional_attention"):
        raise ValueError(f"config.json: use_bidirectional_attention=true: sp_jax's {model_type} "
                         "attention is causal (set it false, or use another library).")
    scalar = get("query_pre_attn_scalar", 256)
    bias = bool(get("attention_bias", False))
    softcaps = {}
    for ours, key in (("attention_softcap", "attn_logit_softcapping"),
                      ("final_logit_softcap", "final_logit_softcapping")):
        value = get(key)
        softcaps[ours] = None if value is None else float(value)
    return dict(
        vocab_size=get("vocab_size"), max_seq_len=get("max_position_embeddings"),
        num_layers=get("num_hidden_layers"), num_heads=heads, hidden=hidden,
        head_dim=None if isinstance(hidden, int) and isinstance(heads, int) and heads > 0
        and hidden % heads == 0 and head_dim == hidden // heads else head_dim,
        mlp_hidden=get("intermediate_size"), num_kv_heads=get("num_key_value_heads") or heads,
        attention_dropout=float(get("attention_dropout") or 0.0),
        tie_embeddings=bool(get("tie_word_embeddings", True)), positions="rotary",
        norm="rmsnorm", norm_epsilon=float(get("rms_norm_eps", 1e-6)), norm_offset=1.0,
        post_norms=True, scale_embeddings=True, mlp_activation="geglu_tanh",
        attention_scale=None if scalar == head_dim else float(scalar) ** -0.5,
        qkv_bias=bias, out_bias=bias, mlp_bias=False, **softcaps)


def query_pre_attn_scalar(cfg: GPTConfig) -> int | float:
    """``query_pre_attn_scalar`` of ``cfg``: ``attention_scale ** -2`` (an int when it is
    one to rounding), ``head_dim`` without a scale."""
    head_dim = cfg.attention_config().head_dim
    if cfg.attention_scale is None:
        return head_dim
    scalar = float(cfg.attention_scale) ** -2
    return round(scalar) if abs(scalar - round(scalar)) < 1e-9 * max(1.0, scalar) else scalar


def gemma_to_hf(cfg: GPTConfig, architecture: str) -> dict[str, Any]:
    """The ``config.json`` entries every Gemma family writes the same way."""
    return dict(
        shape_to_hf(cfg, architecture), hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=query_pre_attn_scalar(cfg),
        attn_logit_softcapping=cfg.attention_softcap,
        final_logit_softcapping=cfg.final_logit_softcap, attention_bias=cfg.qkv_bias,
        use_bidirectional_attention=False, **gemma_windows_to_hf(cfg))


def gemma_expresses(cfg: GPTConfig) -> bool:
    """Dense; rotary, RMSNorm with ``1 + weight``, post-norms, scaled embeddings, gated
    tanh-GELU, ``qkv_bias == out_bias``, no MLP bias (windows of more than one size are
    named by :func:`gemma_windows_to_hf`)."""
    return has_fields(
        cfg, num_experts=0, positions="rotary", norm="rmsnorm", norm_offset=1.0,
        post_norms=True, scale_embeddings=True, mlp_activation="geglu_tanh",
        out_bias=cfg.qkv_bias, mlp_bias=False, attention="mha")


def gemma_rules(cfg: GPTConfig) -> list[Rule]:
    """The conversion table of a Gemma ``cfg``: Llama's (q/k/v, o, gate/up, down, q/k
    norms as ``cfg`` has them, embeddings, final norm), the MLP's pre-norm from
    ``pre_feedforward_layernorm`` (Llama's is ``post_attention_layernorm``), and the two
    norms after the attention and the MLP."""
    p = "model.layers.{i}."
    table = [r for r in llama_shaped_rules(cfg) if r.ours != MLP + "norm/scale"]
    return [*table, same(MLP + "norm/scale", p + "pre_feedforward_layernorm.weight"),
            same(ATTENTION_POST_NORM, p + "post_attention_layernorm.weight"),
            same(MLP_POST_NORM, p + "post_feedforward_layernorm.weight")]


def config_from_hf(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of a Gemma 2 ``config.json`` (transformers 4.x:
    ``rope_theta`` / ``rope_scaling``; 5.x: ``rope_parameters``)."""
    del overrides
    get = config.get
    rope = dict(get("rope_parameters") or get("rope_scaling") or {})
    base, scaling = gemma_rope(rope, get("rope_theta", 10000.0), "rope_parameters")
    return dict(gemma_fields(config, "gemma2"), rope_base=base, rope_scaling=scaling,
                **gemma_windows(config, pattern=2))


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The Gemma 2 ``config.json`` entries of ``cfg``."""
    rope = gemma_rope_to_hf(cfg.rope_base, cfg.rope_scaling)
    return dict(gemma_to_hf(cfg, "Gemma2ForCausalLM"), rope_parameters=rope,
                rope_theta=cfg.rope_base)


def expresses(cfg: GPTConfig) -> bool:
    """A Gemma (:func:`gemma_expresses`) without q/k norms or a separate local rotary
    base."""
    return gemma_expresses(cfg) and has_fields(cfg, qk_norm=False, rope_local_base=None)


GEMMA2 = Family(
    model_type="gemma2",
    description="Gemma-2-shaped (rotary, RMSNorm 1 + weight, post-norms, scaled embeddings, "
                "gated tanh-GELU)",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, expresses=expresses,
    rules=gemma_rules)

"""Mixtral (``model_type`` ``"mixtral"``): Mistral-shaped attention (no biases, optional
``sliding_window``) with a mixture of experts in every layer (:class:`~sp_jax.layers.MoE`):
``num_local_experts`` SwiGLU experts of width ``intermediate_size``, ``num_experts_per_tok``
of them per token, chosen by a linear router (fp32 softmax, top-k, always renormalised).

Tensors: the router ``block_sparse_moe.gate.weight`` ``[E, hidden]`` is ``router``
transposed; expert ``e``'s ``w1`` (gate), ``w3`` (up) ``[F, hidden]`` and ``w2`` (down)
``[hidden, F]`` (``torch.nn.Linear`` weights, as ``save_pretrained`` of transformers 4.x
and 5.x writes them) become row ``e`` of ``experts_up`` ``[E, hidden, 2F]`` (gate and up
columns interleaved ``(j, {gate, up})`` like the dense SwiGLU kernel) and
``experts_down`` ``[E, F, hidden]``. transformers 5.x's modules hold them fused
(``mlp.gate.weight``, ``mlp.experts.gate_up_proj`` ``[E, 2F, hidden]``: gate rows then
up rows, ``mlp.experts.down_proj`` ``[E, hidden, F]``), as its ``state_dict()`` gives
them; :func:`~sp_jax.models.hf.from_hf` reads either, :func:`~sp_jax.models.hf.to_hf`
writes the per-expert ones (which both versions load).

The shared pieces of the mixture-of-experts families (:mod:`.qwen3_moe` too):
:func:`moe_shaped_rules`, :func:`expert_rules`, :func:`fused_expert_rules`,
:func:`num_experts_of` and :func:`is_fused`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sp_jax.models.gpt_config import GPTConfig
from sp_jax.models.hf.family import (
    MLP,
    PLAIN,
    Family,
    Rule,
    has_fields,
    interleave,
    on_layers,
    per_expert,
    transposed,
)
from sp_jax.models.hf.llama import llama_shaped_fields, llama_shaped_rules, llama_shaped_to_hf

__all__ = ["MIXTRAL", "expert_rules", "fused_expert_rules", "is_fused", "moe_shaped_rules",
           "num_experts_of"]

MIXTRAL_ROPE_THETA = 1e6
"""transformers' Mixtral ``rope_theta`` when ``config.json`` gives none."""


def num_experts_of(config: Mapping[str, Any], model_type: str) -> int:
    """The routed experts of a mixture-of-experts ``config.json``: ``num_local_experts``
    (Mixtral, and what transformers 5.x writes for every family) or ``num_experts``
    (Qwen3-MoE's published configs); a ValueError when neither is there or the count is
    not a positive int."""
    value = config.get("num_local_experts", config.get("num_experts"))
    if value is None:
        raise ValueError(f"config.json: the key 'num_local_experts' (or 'num_experts') is "
                         f"missing (a {model_type} config.json needs it: the model's shape "
                         "depends on it).")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: num_experts={value!r}: a {model_type} model in sp_jax "
                         "has a positive number of experts (a config without experts is a "
                         "dense model: write it as its dense family, e.g. 'qwen3' / "
                         "'mistral').")
    return value


def expert_rules(cfg: GPTConfig, router: str, gate: str, up: str, down: str) -> list[Rule]:
    """The rules of a mixture-of-experts layer whose experts are separate modules
    (``{i}``: the layer, ``{e}``: the expert): the ``router`` weight ``[E, hidden]``,
    each expert's ``gate`` / ``up`` ``[F, hidden]`` and ``down`` ``[hidden, F]`` Linear
    weights."""
    e, f = cfg.num_experts, cfg.moe_mlp_hidden
    return [transposed(MLP + "router", router),
            per_expert(MLP + "experts_up",
                       interleave(MLP + "experts_up", (gate, up), (1, 1), f, transpose=True),
                       e),
            per_expert(MLP + "experts_down", transposed(MLP + "experts_down", down), e)]


def _xp(x: Any):
    """The array module of ``x`` (jax.numpy for jax arrays and tracers, else NumPy)."""
    return jnp if isinstance(x, jax.Array) else np


def fused_expert_rules(cfg: GPTConfig, prefix: str) -> list[Rule]:
    """The rules of a mixture-of-experts layer as transformers 5.x's modules hold it
    (``prefix``: the layer's MLP, e.g. ``"model.layers.{i}.mlp."``): ``gate.weight``
    ``[E, hidden]``, ``experts.gate_up_proj`` ``[E, 2F, hidden]`` (every expert's gate
    rows, then its up rows) and ``experts.down_proj`` ``[E, hidden, F]``."""
    f = cfg.moe_mlp_hidden

    def up_to_ours(t):  # [E, 2F, h] -> [E, h, 2F], columns (j, {gate, up})
        x = _xp(t).swapaxes(t.reshape(t.shape[0], 2, f, t.shape[-1]), 1, 3)  # [E, h, F, 2]
        return x.reshape(t.shape[0], t.shape[-1], 2 * f)

    def up_to_hf(x):
        t = _xp(x).swapaxes(x.reshape(x.shape[0], x.shape[1], f, 2), 1, 3)  # [E, 2, F, h]
        return (t.reshape(x.shape[0], 2 * f, x.shape[1]),)

    def swap(x):  # [E, a, b] <-> [E, b, a]
        return _xp(x).swapaxes(x, 1, 2)

    return [transposed(MLP + "router", prefix + "gate.weight"),
            Rule(MLP + "experts_up", (prefix + "experts.gate_up_proj",), up_to_ours, up_to_hf),
            Rule(MLP + "experts_down", (prefix + "experts.down_proj",), swap,
                 lambda x: (swap(x),))]


def is_fused(names: Collection[str]) -> bool:
    """Whether a checkpoint's tensor ``names`` hold fused experts (transformers 5.x's
    ``experts.gate_up_proj``) rather than one module per expert."""
    return any(n.endswith(".experts.gate_up_proj") for n in names)


def moe_shaped_rules(cfg: GPTConfig, experts: list[Rule]) -> list[Rule]:
    """The conversion table of a Llama-shaped ``cfg`` with mixture-of-experts layers:
    :func:`~.llama.llama_shaped_rules` (the dense MLP's rules on the dense layers only,
    ``post_attention_layernorm`` on every layer) and ``experts`` (a mixture-of-experts
    layer's rules) on the mixture-of-experts layers."""
    moe = [i for i in range(cfg.num_layers) if cfg.is_moe_layer(i)]
    dense = [i for i in range(cfg.num_layers) if not cfg.is_moe_layer(i)]
    table, dense_mlp = [], []
    for rule in llama_shaped_rules(cfg):
        is_dense_mlp = rule.ours.startswith(MLP) and not rule.ours.startswith(MLP + "norm/")
        (dense_mlp if is_dense_mlp else table).append(rule)
    return table + on_layers(dense_mlp, dense) + on_layers(experts, moe)


def _rules(cfg: GPTConfig) -> list[Rule]:
    """Mixtral's conversion table as ``save_pretrained`` writes it (one module per
    expert)."""
    p = "model.layers.{i}.block_sparse_moe."
    return moe_shaped_rules(cfg, expert_rules(
        cfg, p + "gate.weight", p + "experts.{e}.w1.weight", p + "experts.{e}.w3.weight",
        p + "experts.{e}.w2.weight"))


def _read_rules(cfg: GPTConfig, names: Collection[str]) -> list[Rule]:
    """:func:`_rules`, or for transformers 5.x's fused experts (its ``state_dict()``)
    theirs."""
    if is_fused(names):
        return moe_shaped_rules(cfg, fused_expert_rules(cfg, "model.layers.{i}.mlp."))
    return _rules(cfg)


def config_from_hf(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of a Mixtral ``config.json``: Mistral's, with
    ``num_local_experts`` experts of width ``intermediate_size`` (also ``mlp_hidden``,
    which no layer uses), ``num_experts_per_tok``, ``router_aux_loss_coef`` (the weight
    sp_jax's :meth:`~sp_jax.models.GPT.loss` always adds; transformers adds it only with
    ``output_router_logits``) and ``rope_theta`` 1e6 when absent (transformers'
    default). A ``router_jitter_noise`` other than 0 is refused: sp_jax's router has no
    jitter."""
    del overrides
    get = config.get
    if not any("rope_theta" in (d or {}) for d in
               (config, get("rope_parameters"), get("rope_scaling"))):
        config = {**config, "rope_theta": MIXTRAL_ROPE_THETA}
    fields = llama_shaped_fields(config, "mixtral")
    experts = num_experts_of(config, "mixtral")
    if get("num_experts_per_tok") is None:
        raise ValueError("config.json: the key 'num_experts_per_tok' is missing (a mixtral "
                         "config.json needs it: the model's shape depends on it).")
    jitter = get("router_jitter_noise") or 0.0
    if jitter != 0:
        raise ValueError(f"config.json: router_jitter_noise={jitter!r}: sp_jax's router has no "
                         "jitter (training-time multiplicative noise on the router input); "
                         "set it to 0.0 to train without it.")
    return dict(fields, qkv_bias=False, out_bias=False, mlp_bias=False,
                sliding_window=get("sliding_window"), num_experts=experts,
                experts_per_token=get("num_experts_per_tok"),
                moe_mlp_hidden=get("intermediate_size"), moe_norm_topk=True, moe_layer_freq=1,
                router_aux_loss_coef=float(get("router_aux_loss_coef", 0.001)))


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The Mixtral ``config.json`` entries of ``cfg`` (``intermediate_size`` is the
    experts' width)."""
    return dict(llama_shaped_to_hf(cfg, "MixtralForCausalLM"),
                intermediate_size=cfg.moe_mlp_hidden, sliding_window=cfg.sliding_window,
                num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
                router_aux_loss_coef=cfg.router_aux_loss_coef, router_jitter_noise=0.0,
                output_router_logits=False)


def expresses(cfg: GPTConfig) -> bool:
    """Experts in every layer (``moe_layer_freq=1``), renormalised top-k, no shared
    experts; rotary positions, RMSNorm, SwiGLU, no attention biases, no q/k norm, any
    sliding window. ``mlp_hidden`` and ``mlp_bias`` (no dense MLP uses them) and the
    training-only ``moe_capacity_factor`` / ``router_z_loss_coef`` are not written:
    transformers' Mixtral is dropless and has no z-loss."""
    return cfg.num_experts > 0 and has_fields(
        cfg, **PLAIN, positions="rotary", norm="rmsnorm", mlp_activation="swiglu", qkv_bias=False,
        out_bias=False, qk_norm=False, moe_layer_freq=1, num_shared_experts=0,
        moe_norm_topk=True)


MIXTRAL = Family(
    model_type="mixtral",
    description="Mixtral-shaped (Mistral-shaped with experts in every layer, renormalised "
                "top-k, no shared experts)",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, expresses=expresses,
    rules=_rules, read_rules=_read_rules)

"""DeepSeek-V3 (``model_type`` ``"deepseek_v3"``: DeepSeek-V3 / V3.1, Kimi K2): multi-head
latent attention (:class:`~sp_jax.layers.MultiHeadLatentAttention`, ``attention="mla"``,
with or without ``q_lora_rank``), RMSNorm, SwiGLU, the first ``first_k_dense_replace``
layers dense (``GPTConfig.num_dense_layers``) and the others mixtures of experts with
DeepSeek's routing: sigmoid scores, group-limited top-k (``n_group`` / ``topk_group``),
the selection bias ``e_score_correction_bias`` (:class:`~sp_jax.layers.RouterBias`),
``norm_topk_prob`` and ``routed_scaling_factor``, ``n_shared_experts`` shared experts.
Rotary positions with YaRN's scaling (:class:`~sp_jax.layers.YarnScaling`) and
DeepSeek's softmax scale (:func:`~sp_jax.layers.mla.mla_softmax_scale`, read as
``GPTConfig.attention_scale``).

Tensors (``torch.nn.Linear`` weights ``[out, in]`` transposed): ``q_a_proj`` /
``q_a_layernorm`` / ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa`` /
``kv_a_layernorm`` / ``kv_b_proj`` become ``attention/qkv/{q_a_kernel, q_a_norm,
q_b_kernel | q_kernel, kv_a_kernel, kv_a_norm, kv_b_kernel}`` (Hugging Face's column
order); with ``rope_interleave`` the rotary columns of ``q_b_proj`` / ``q_proj`` and
``kv_a_proj_with_mqa`` are permuted to rotate-half order on reading and back on writing
(``GPTConfig.rope_interleave`` remembers it). The mixture: ``mlp.gate.weight`` (the
router), ``mlp.gate.e_score_correction_bias`` (``mlp/router_bias``), the experts as
:mod:`.mixtral` (one module per expert as ``save_pretrained`` writes them, or
transformers 5.x's fused ``mlp.experts.gate_up_proj`` / ``down_proj``) and
``mlp.shared_experts.{gate,up,down}_proj`` (``mlp/shared_up`` / ``shared_down``).

Multi-token prediction (``GPTConfig.mtp_depth``, :mod:`sp_jax.models.mtp`): DeepSeek's
checkpoints hold ``num_nextn_predict_layers`` MTP modules as layers ``num_hidden_layers
...`` (``model.layers.61.*`` in DeepSeek-V3's); MTP layer ``k`` (from 0) ``L =
num_hidden_layers + k`` is read into ``GPT.mtp[k]``: ``enorm`` / ``hnorm`` /
``shared_head.norm`` (``post_norm``), ``eh_proj`` transposed, and its decoder layer by
the main layers' rules (a mixture of experts, as the last main layer: transformers'
``MtpModel`` builds every MTP layer with experts). Its ``embed_tokens`` /
``shared_head.head`` are copies of the main model's (checked equal on reading, where
present; written as copies, as DeepSeek's checkpoints hold them). ``mtp_depth`` defaults
to ``num_nextn_predict_layers``; ``from_hf(..., mtp_depth=0)`` (or any smaller depth)
skips the surplus MTP layers (every tensor of a layer after the decoder layers holding
an ``eh_proj``), and the writer writes ``num_nextn_predict_layers = mtp_depth``.

The shared pieces of the DeepSeek-routed families (:mod:`.glm4_moe` too):
:func:`deepseek_moe_fields`, :func:`deepseek_moe_to_hf`, :func:`deepseek_moe_rules`,
:func:`deepseek_moe_expresses` and :func:`mtp_layers_skipped`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from sp_jax.layers.mla import deinterleave_rope, mla_softmax_scale
from sp_jax.models.gpt_config import GPTConfig
from sp_jax.models.hf.family import (
    ATTENTION,
    MLP,
    PLAIN,
    Family,
    Rule,
    has_fields,
    interleave,
    on_layers,
    require,
    same,
    transposed,
)
from sp_jax.models.hf.llama import (
    LLAMA_SHAPED_KEYS,
    rope_of,
    rope_scaling_to_hf,
    rope_settings,
    shape_to_hf,
)
from sp_jax.models.hf.mixtral import expert_rules, fused_expert_rules, is_fused, num_experts_of

__all__ = ["DEEPSEEK_V3", "deepseek_moe_expresses", "deepseek_moe_fields",
           "deepseek_moe_rules", "deepseek_moe_to_hf", "held_mtp_depth", "mtp_layers_skipped"]

_P = "model.layers.{i}."


# --------------------------------------------------------------------------------------
# DeepSeek's mixture of experts (shared with GLM-4.5)
# --------------------------------------------------------------------------------------


def _layer_of(name: str) -> int | None:
    """``L`` of a ``model.layers.<L>.*`` tensor name, else None."""
    parts = name.split(".")
    if name.startswith("model.layers.") and len(parts) > 2 and parts[2].isdigit():
        return int(parts[2])
    return None


def held_mtp_depth(cfg: GPTConfig, names: Collection[str]) -> GPTConfig:
    """``cfg`` read from a checkpoint whose canonical tensor names are ``names``, with
    ``mtp_depth = 0`` where its ``config.json`` counts MTP layers
    (``num_nextn_predict_layers``, which transformers 5.x writes as 1 for every
    DeepSeek-V3 and GLM-4.5 config) but it holds none (transformers'
    ``DeepseekV3ForCausalLM`` / ``Glm4MoeForCausalLM`` save no MTP layer): the main model
    is read. ``from_hf(..., mtp_depth=D)`` is not changed (missing MTP tensors are then
    named)."""
    if not cfg.mtp_depth or any(".eh_proj." in n for n in names):
        return cfg
    return dataclasses.replace(cfg, mtp_depth=0)


def mtp_layers_skipped(cfg: GPTConfig, names: Collection[str]) -> set[str]:
    """The tensors of ``names`` (a checkpoint's) that a model of ``cfg`` does not read:
    every ``model.layers.<L>.*`` tensor of an MTP layer (one holding an ``eh_proj``) at
    ``L >= num_layers + mtp_depth`` (the checkpoint has more MTP layers than
    ``cfg.mtp_depth``: ``from_hf(..., mtp_depth=0)`` reads the main model alone)."""
    first = cfg.num_layers + cfg.mtp_depth
    mtp = {_layer_of(n) for n in names if ".eh_proj." in n}
    return {n for n in names if _layer_of(n) in mtp and _layer_of(n) >= first}


def deepseek_moe_fields(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """The mixture-of-experts :class:`GPTConfig` fields of a DeepSeek-routed
    ``config.json``: ``n_routed_experts`` (or ``num_local_experts``) experts of
    ``moe_intermediate_size``, ``num_experts_per_tok``, ``n_shared_experts``,
    ``first_k_dense_replace`` dense layers (``intermediate_size`` wide), sigmoid scores,
    ``n_group`` / ``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor``; no
    auxiliary loss (transformers adds none) and a frozen selection bias
    (``moe_bias_update_rate=0.0``: pass ``moe_bias_update_rate=1e-3`` to train as
    DeepSeek-V3 did). A ``scoring_func`` other than ``"sigmoid"`` or a
    ``moe_layer_freq`` other than 1 (DeepSeek's own keys) is refused."""
    get = config.get
    experts = num_experts_of({**config, "num_local_experts": get(
        "n_routed_experts", get("num_local_experts"))}, model_type)
    require(config, model_type, "moe_intermediate_size", "num_experts_per_tok")
    if get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"config.json: scoring_func={get('scoring_func')!r}: transformers' "
                         f"{model_type} scores experts with a sigmoid; sp_jax reads those.")
    if get("moe_layer_freq", 1) != 1:
        raise ValueError(f"config.json: moe_layer_freq={get('moe_layer_freq')!r}: every layer "
                         "after first_k_dense_replace is a mixture of experts in "
                         f"transformers' {model_type}; sp_jax reads moe_layer_freq=1.")
    return dict(
        num_experts=experts, experts_per_token=get("num_experts_per_tok"),
        moe_mlp_hidden=get("moe_intermediate_size"),
        num_shared_experts=int(get("n_shared_experts") or 0),
        num_dense_layers=int(get("first_k_dense_replace") or 0), moe_layer_freq=1,
        moe_scoring="sigmoid", moe_groups=int(get("n_group") or 1),
        moe_topk_groups=int(get("topk_group") or 1),
        moe_norm_topk=bool(get("norm_topk_prob", True)),
        moe_routed_scale=float(get("routed_scaling_factor", 1.0)),
        router_aux_loss_coef=0.0, moe_bias_update_rate=0.0,
        mtp_depth=int(get("num_nextn_predict_layers", get("num_mtp_layers")) or 0))


def deepseek_moe_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The mixture-of-experts ``config.json`` entries of ``cfg``
    (:func:`deepseek_moe_fields` back)."""
    return dict(
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.experts_per_token,
        moe_intermediate_size=cfg.moe_mlp_hidden, n_shared_experts=cfg.num_shared_experts,
        first_k_dense_replace=cfg.num_dense_layers, n_group=cfg.moe_groups,
        topk_group=cfg.moe_topk_groups, norm_topk_prob=cfg.moe_norm_topk,
        routed_scaling_factor=cfg.moe_routed_scale, num_nextn_predict_layers=cfg.mtp_depth,
        output_router_logits=False)


def deepseek_moe_expresses(cfg: GPTConfig) -> bool:
    """Experts after ``num_dense_layers`` dense layers in every layer, sigmoid scores
    (any groups, renormalisation, routed scale and shared experts); RMSNorm, SwiGLU, no
    MLP bias, rotary positions; MTP modules only after a mixture-of-experts layer
    (transformers builds them with experts). Training-only fields
    (``moe_bias_update_rate``, ``moe_seq_aux_loss_coef``, ``moe_capacity_factor``,
    ``mtp_loss_weight``, the z-loss and aux loss) are not written."""
    if cfg.mtp_depth and cfg.num_dense_layers >= cfg.num_layers:
        return False
    return cfg.num_experts > 0 and has_fields(
        cfg, moe_scoring="sigmoid", moe_layer_freq=1, positions="rotary", norm="rmsnorm",
        mlp_activation="swiglu", mlp_bias=False)


def _shared_rules(cfg: GPTConfig) -> list[Rule]:
    if not cfg.num_shared_experts:
        return []
    s = _P + "mlp.shared_experts."
    return [interleave(MLP + "shared_up/kernel", (s + "gate_proj.weight", s + "up_proj.weight"),
                       (1, 1), cfg.num_shared_experts * cfg.moe_mlp_hidden, transpose=True),
            transposed(MLP + "shared_down/kernel", s + "down_proj.weight")]


def _copies(rule: Rule, copies: tuple[str, ...]) -> Rule:
    """``rule`` (one Hugging Face tensor) whose tensor is also stored as ``copies``
    (the MTP layers' ``embed_tokens`` / ``shared_head.head``): written as copies, and
    on reading checked equal to it (a ValueError naming the copy otherwise)."""
    if not copies:
        return rule

    def to_ours(first, *others):
        for name, other in zip(copies, others, strict=True):
            if not np.array_equal(np.asarray(first), np.asarray(other)):
                raise ValueError(f"from_hf: {name} differs from {rule.hf[0]}: sp_jax's MTP "
                                 "modules share the main model's embedding and LM head "
                                 "(DeepSeek's checkpoints store equal copies).")
        return rule.to_ours(first)

    def to_hf(x):
        out = rule.to_hf(x)
        return out + out[:1] * len(copies)

    return Rule(rule.ours, rule.hf + copies, to_ours, to_hf)


def _mtp_rules(cfg: GPTConfig, block: list[Rule], names: Collection[str] | None
               ) -> tuple[list[Rule], tuple[str, ...], tuple[str, ...]]:
    """The rules of ``GPT.mtp`` (module ``k``: Hugging Face layer ``num_layers + k``)
    given ``block``, the per-layer rules of the last main layer's kind; and the MTP
    layers' copies of ``embed_tokens`` and of the head (those in ``names`` when
    reading, all when writing)."""
    rules, embeds, heads = [], [], []
    for k in range(cfg.mtp_depth):
        n, ours = f"model.layers.{cfg.num_layers + k}.", f"mtp/{k}/"
        rules += [same(ours + "enorm/scale", n + "enorm.weight"),
                  same(ours + "hnorm/scale", n + "hnorm.weight"),
                  transposed(ours + "eh_proj", n + "eh_proj.weight"),
                  same(ours + "post_norm/scale", n + "shared_head.norm.weight")]
        rules += [dataclasses.replace(
            r, ours=r.ours.replace("blocks/{i}/", ours + "block/"),
            hf=tuple(h.format(i=cfg.num_layers + k) for h in r.hf), layers=None)
            for r in block]
        embeds.append(n + "embed_tokens.weight")
        heads.append(n + "shared_head.head.weight")
    if names is not None:
        embeds = [e for e in embeds if e in names]
        heads = [h for h in heads if h in names]
    return rules, tuple(embeds), tuple(heads)


def deepseek_moe_rules(cfg: GPTConfig, attention: list[Rule], fused: bool = False,
                       names: Collection[str] | None = None) -> list[Rule]:
    """The conversion table of a DeepSeek-routed ``cfg`` given its ``attention`` rules
    (with the input norm): embeddings, final norm and head, each layer's
    ``post_attention_layernorm``; the dense MLP (``mlp.{gate,up,down}_proj``) on the
    first ``num_dense_layers`` layers; on the others the router, its selection bias,
    the experts (``fused``: transformers 5.x's fused tensors) and the shared experts;
    the ``mtp_depth`` MTP layers (module docstring; ``names``: the checkpoint's when
    reading, whose MTP layers may lack the embedding and head copies)."""
    m = _P + "mlp."
    dense = range(cfg.num_dense_layers)
    moe = range(cfg.num_dense_layers, cfg.num_layers)
    experts = fused_expert_rules(cfg, m) if fused else expert_rules(
        cfg, m + "gate.weight", m + "experts.{e}.gate_proj.weight",
        m + "experts.{e}.up_proj.weight", m + "experts.{e}.down_proj.weight")
    norm = same(MLP + "norm/scale", _P + "post_attention_layernorm.weight")
    mlp = [interleave(MLP + "up/kernel", (m + "gate_proj.weight", m + "up_proj.weight"),
                      (1, 1), cfg.mlp_hidden, transpose=True),
           transposed(MLP + "down/kernel", m + "down_proj.weight")]
    mixture = [*experts, same(MLP + "router_bias", m + "gate.e_score_correction_bias"),
               *_shared_rules(cfg)]
    last = mixture if cfg.num_layers > cfg.num_dense_layers else mlp
    mtp, embeds, heads = _mtp_rules(cfg, [*attention, norm, *last], names)
    embed = same("embed/embedding", "model.embed_tokens.weight")
    table = [same("final_norm/scale", "model.norm.weight"), norm, *attention, *mtp]
    if cfg.tie_embeddings:
        table.append(_copies(embed, embeds + heads))
    else:
        table += [_copies(embed, embeds),
                  _copies(same("head/embedding", "lm_head.weight"), heads)]
    return table + on_layers(mlp, dense) + on_layers(mixture, moe)


# --------------------------------------------------------------------------------------
# DeepSeek-V3
# --------------------------------------------------------------------------------------


def _rope_rule(ours: str, hf: str, width: int, rope: int, interleaved: bool) -> Rule:
    """``ours`` ``[in, groups * width]`` from the Linear weight ``hf``, each group's last
    ``rope`` columns from DeepSeek's interleaved pairs to rotate-half order when
    ``interleaved`` (:func:`~sp_jax.layers.mla.deinterleave_rope`) and back."""
    if not interleaved:
        return transposed(ours, hf)

    def to_ours(w):
        return deinterleave_rope(np.asarray(w).T, width, rope)

    def to_hf(x):
        order = deinterleave_rope(np.arange(x.shape[1])[None], width, rope)[0]
        return (x[:, np.argsort(order)].T,)

    return Rule(ours, (hf,), to_ours, to_hf)


def _attention_rules(cfg: GPTConfig) -> list[Rule]:
    a, s = ATTENTION + "qkv/", _P + "self_attn."
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    p, interleaved = cfg.qk_rope_head_dim, cfg.rope_interleave
    rules = [same(ATTENTION + "norm/scale", _P + "input_layernorm.weight"),
             transposed(ATTENTION + "out/kernel", s + "o_proj.weight"),
             _rope_rule(a + "kv_a_kernel", s + "kv_a_proj_with_mqa.weight",
                        cfg.kv_lora_rank + p, p, interleaved),
             same(a + "kv_a_norm", s + "kv_a_layernorm.weight"),
             transposed(a + "kv_b_kernel", s + "kv_b_proj.weight")]
    if cfg.q_lora_rank is None:
        return rules + [_rope_rule(a + "q_kernel", s + "q_proj.weight", qk, p, interleaved)]
    return rules + [transposed(a + "q_a_kernel", s + "q_a_proj.weight"),
                    same(a + "q_a_norm", s + "q_a_layernorm.weight"),
                    _rope_rule(a + "q_b_kernel", s + "q_b_proj.weight", qk, p, interleaved)]


def _rules(cfg: GPTConfig) -> list[Rule]:
    """DeepSeek-V3's conversion table as ``save_pretrained`` writes it (one module per
    expert)."""
    return deepseek_moe_rules(cfg, _attention_rules(cfg))


def _read_rules(cfg: GPTConfig, names: Collection[str]) -> list[Rule]:
    """:func:`_rules`, or for transformers 5.x's fused experts theirs."""
    return deepseek_moe_rules(cfg, _attention_rules(cfg), fused=is_fused(names),
                              names=names)


_MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _softmax_scale(cfg_qk: int, rope: Mapping[str, Any]) -> float | None:
    """``GPTConfig.attention_scale`` of DeepSeek's softmax scale: None when it is the
    default ``qk_head_dim ** -0.5``."""
    scale = mla_softmax_scale(cfg_qk, rope)
    return None if scale == cfg_qk ** -0.5 else scale


def config_from_hf(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of a DeepSeek-V3 ``config.json`` (transformers 4.x's
    ``rope_scaling`` with ``type: "yarn"``, as DeepSeek publishes it, or 5.x's
    ``rope_parameters``). ``attention_bias`` (no MLA projection has a bias in sp_jax), a
    ``num_key_value_heads`` other than ``num_attention_heads`` and an activation other
    than ``silu`` are refused; ``num_nextn_predict_layers`` is ``mtp_depth`` (module
    docstring)."""
    del overrides
    get = config.get
    require(config, "deepseek_v3", *LLAMA_SHAPED_KEYS, *_MLA_KEYS)
    if get("attention_bias", False):
        raise ValueError("config.json: attention_bias=True: sp_jax's multi-head latent "
                         "attention has no projection biases (DeepSeek-V3 has none).")
    heads = get("num_attention_heads")
    if get("num_key_value_heads", heads) not in (None, heads):
        raise ValueError(f"config.json: num_key_value_heads={get('num_key_value_heads')} with "
                         f"num_attention_heads={heads}: multi-head latent attention "
                         "up-projects one key and value per head; set them equal.")
    if get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json: hidden_act={get('hidden_act')!r}: sp_jax's deepseek_v3 "
                         "MLP is SwiGLU ('silu').")
    theta, scaling = rope_settings(config, yarn=True)
    qk = get("qk_nope_head_dim") + get("qk_rope_head_dim")
    hidden = get("hidden_size")
    return dict(
        vocab_size=get("vocab_size"), max_seq_len=get("max_position_embeddings"),
        num_layers=get("num_hidden_layers"), num_heads=heads, hidden=hidden,
        head_dim=None if hidden % heads == 0 else qk, mlp_hidden=get("intermediate_size"),
        attention_dropout=float(get("attention_dropout", 0.0)),
        tie_embeddings=bool(get("tie_word_embeddings", False)), positions="rotary",
        rope_base=theta, rope_scaling=scaling, norm="rmsnorm",
        norm_epsilon=float(get("rms_norm_eps", 1e-6)), mlp_activation="swiglu",
        qkv_bias=False, out_bias=False, mlp_bias=False, attention="mla",
        q_lora_rank=get("q_lora_rank"), **{k: get(k) for k in _MLA_KEYS},
        attention_scale=_softmax_scale(qk, rope_of(config)),
        rope_interleave=bool(get("rope_interleave", True)),
        **deepseek_moe_fields(config, "deepseek_v3"))


def _rope_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    return {**rope_scaling_to_hf(cfg.rope_scaling), "rope_theta": cfg.rope_base}


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The DeepSeek-V3 ``config.json`` entries of ``cfg`` (rope settings in transformers
    4.x's and 5.x's spelling)."""
    rope = _rope_to_hf(cfg)
    out = dict(shape_to_hf(cfg, "DeepseekV3ForCausalLM"), hidden_act="silu",
               num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
               **{k: getattr(cfg, k) for k in _MLA_KEYS}, attention_bias=False,
               rope_interleave=cfg.rope_interleave, rope_theta=cfg.rope_base,
               rope_scaling=None if cfg.rope_scaling is None else rope, rope_parameters=rope,
               **deepseek_moe_to_hf(cfg))
    del out["head_dim"]  # transformers derives it (qk_rope_head_dim)
    return out


def expresses(cfg: GPTConfig) -> bool:
    """Multi-head latent attention without biases, q/k norm or window, DeepSeek's
    softmax scale for its rope scaling (``attention_scale``); a DeepSeek-routed
    mixture (:func:`deepseek_moe_expresses`)."""
    if cfg.attention != "mla":
        return False
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    scale = _softmax_scale(qk, _rope_to_hf(cfg))  # None (DeepSeek's from the YaRN fields) too
    scale = cfg.attention_scale if cfg.attention_scale in (None, scale) else scale
    return deepseek_moe_expresses(cfg) and has_fields(
        cfg, **{**PLAIN, "attention": "mla", "num_dense_layers": cfg.num_dense_layers,
                "moe_scoring": "sigmoid", "moe_groups": cfg.moe_groups,
                "moe_topk_groups": cfg.moe_topk_groups,
                "moe_routed_scale": cfg.moe_routed_scale,
                "attention_scale": scale},
        qkv_bias=False, out_bias=False,
        qk_norm=False, sliding_window=None, layer_windows=None)


DEEPSEEK_V3 = Family(
    model_type="deepseek_v3",
    description="DeepSeek-V3-shaped (multi-head latent attention, RMSNorm, SwiGLU, sigmoid "
                "group-limited routing after num_dense_layers dense layers)",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, expresses=expresses,
    rules=_rules, read_rules=_read_rules, skipped=mtp_layers_skipped, yarn=True)

"""GPT-2 (``model_type`` ``"gpt2"``): learned positions, LayerNorm, a gelu/relu MLP, all
biases; ``Conv1D`` weights ``[in, out]`` as sp_jax stores them, ``c_attn``'s ``(q | k | v)``
columns permuted to sp_jax's per-head ``(head, {q, k, v}, head_dim)``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sp_jax.models.gpt_config import GPTConfig
from sp_jax.models.hf.family import (
    ATTENTION,
    MLP,
    PLAIN,
    Family,
    Rule,
    has_fields,
    require,
    same,
    swap_qkv,
)

__all__ = ["ACTIVATIONS", "GPT2"]

# config.json's activation_function -> sp_jax's mlp_activation (the first of a value is
# the one written).
ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu",
               "gelu": "gelu_exact", "relu": "relu"}


def config_from_hf(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`GPTConfig` fields of a GPT-2 ``config.json`` (``dropout`` in
    ``overrides`` lifts the check that ``embd_pdrop`` equals ``resid_pdrop``)."""
    require(config, "gpt2", "vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    get = config.get
    for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                    ("add_cross_attention", False)):
        if bool(get(key, ok)) != ok:
            raise ValueError(f"config.json: {key}={get(key)!r} has no sp_jax counterpart "
                             f"(sp_jax computes GPT-2 attention with {key}={ok}).")
    act = get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json: activation_function={act!r} is not one of "
                         f"{sorted(ACTIVATIONS)}.")
    resid, embd = float(get("resid_pdrop", 0.1)), float(get("embd_pdrop", 0.1))
    if resid != embd and "dropout" not in overrides:
        raise ValueError(
            f"config.json: embd_pdrop={embd} differs from resid_pdrop={resid}; sp_jax has "
            "one rate for both: pass dropout=... to choose it.")
    return dict(
        vocab_size=get("vocab_size"), max_seq_len=get("n_positions"),
        num_layers=get("n_layer"), num_heads=get("n_head"), hidden=get("n_embd"),
        mlp_hidden=get("n_inner") or 4 * get("n_embd"), dropout=resid,
        attention_dropout=float(get("attn_pdrop", 0.1)),
        tie_embeddings=bool(get("tie_word_embeddings", True)), positions="learned",
        norm="layernorm", norm_epsilon=float(get("layer_norm_epsilon", 1e-5)),
        mlp_activation=ACTIVATIONS[act], qkv_bias=True, out_bias=True, mlp_bias=True)


def config_to_hf(cfg: GPTConfig) -> dict[str, Any]:
    """The GPT-2 ``config.json`` entries of ``cfg``."""
    act = {v: k for k, v in reversed(ACTIVATIONS.items())}[cfg.mlp_activation]
    return dict(
        architectures=["GPT2LMHeadModel"], vocab_size=cfg.vocab_size,
        n_positions=cfg.max_seq_len, n_embd=cfg.hidden, n_layer=cfg.num_layers,
        n_head=cfg.num_heads, n_inner=cfg.mlp_hidden, activation_function=act,
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.attention_dropout, layer_norm_epsilon=cfg.norm_epsilon,
        tie_word_embeddings=cfg.tie_embeddings, scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False)


def expresses(cfg: GPTConfig) -> bool:
    """Dense (no experts); learned positions, LayerNorm, a gelu/relu MLP, all biases, no
    grouped-query attention, no sliding window, no q/k norm, heads of ``hidden / heads``
    (GPT-2 has no ``head_dim``)."""
    return has_fields(cfg, **PLAIN, num_experts=0, positions="learned", norm="layernorm",
                      qkv_bias=True, out_bias=True, mlp_bias=True, num_kv_heads=cfg.num_heads,
                      rope_scaling=None, sliding_window=None, layer_windows=None,
                      qk_norm=False) and \
        cfg.mlp_activation in ACTIVATIONS.values() and \
        cfg.num_heads * cfg.attention_config().head_dim == cfg.hidden


def rules(cfg: GPTConfig) -> list[Rule]:
    """The conversion table of ``cfg``."""
    h, d = cfg.num_heads, cfg.attention_config().head_dim
    a, m, p = ATTENTION, MLP, "transformer.h.{i}."
    table = [same("embed/embedding", "transformer.wte.weight"),
             same("position", "transformer.wpe.weight"),
             same(a + "norm/scale", p + "ln_1.weight"),
             same(a + "norm/bias", p + "ln_1.bias"),
             same(a + "out/kernel", p + "attn.c_proj.weight"),
             same(a + "out/bias", p + "attn.c_proj.bias"),
             same(m + "norm/scale", p + "ln_2.weight"),
             same(m + "norm/bias", p + "ln_2.bias"),
             same(m + "up/kernel", p + "mlp.c_fc.weight"),
             same(m + "up/bias", p + "mlp.c_fc.bias"),
             same(m + "down/kernel", p + "mlp.c_proj.weight"),
             same(m + "down/bias", p + "mlp.c_proj.bias"),
             same("final_norm/scale", "transformer.ln_f.weight"),
             same("final_norm/bias", "transformer.ln_f.bias")]
    # c_attn columns (q | k | v) x (head, head_dim) -> (head, {q, k, v}, head_dim)
    for kind, tensor in (("kernel", "weight"), ("bias", "bias")):
        table.append(Rule(a + "qkv/" + kind, (p + "attn.c_attn." + tensor,),
                          lambda w: swap_qkv(w, 3, h, d), lambda w: (swap_qkv(w, h, 3, d),)))
    if not cfg.tie_embeddings:
        table.append(same("head/embedding", "lm_head.weight"))
    return table


def canonicalize(names: dict[str, str]) -> dict[str, str]:
    """Canonical name -> checkpoint name: GPT-2 checkpoints are written with and without
    the ``transformer.`` prefix."""
    if "transformer.wte.weight" not in names and "wte.weight" in names:
        return {("transformer." + n if n != "lm_head.weight" else n): n for n in names}
    return names


GPT2 = Family(
    model_type="gpt2",
    description="GPT-2-shaped (learned positions, LayerNorm, gelu/relu MLP, all biases, no "
                "grouped-query attention)",
    config_from_hf=config_from_hf, config_to_hf=config_to_hf, expresses=expresses,
    rules=rules, canonicalize=canonicalize)

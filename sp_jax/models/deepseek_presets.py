"""The :class:`~sp_jax.models.GPTConfig` fields of the DeepSeek-V3-architecture presets
(``GPTConfig.deepseek_v3``: DeepSeek-V3, Kimi K2) and GLM-4.5's (``GPTConfig.glm4_moe``),
from the published Hugging Face ``config.json`` files:

- ``deepseek-ai/DeepSeek-V3`` (``model_type`` ``deepseek_v3``): 61 layers, hidden 7168,
  128 heads, MLA ``q_lora_rank`` 1536, ``kv_lora_rank`` 512, ``qk_nope_head_dim`` 128,
  ``qk_rope_head_dim`` 64, ``v_head_dim`` 128, ``intermediate_size`` 18432 (the 3 dense
  layers, ``first_k_dense_replace``), 256 routed experts of 2048 (8 per token, 8 groups
  of which 4, ``routed_scaling_factor`` 2.5, ``norm_topk_prob``), 1 shared, vocabulary
  129280, 163840 positions with YaRN (``factor`` 40 over 4096, ``beta_fast`` 32,
  ``beta_slow`` 1, ``mscale`` = ``mscale_all_dim`` = 1), ``rope_theta`` 1e4, RMSNorm eps
  1e-6, untied head, ``bos_token_id`` 0, ``eos_token_id`` 1, one MTP layer (not built
  here: ``num_nextn_predict_layers``);
- ``moonshotai/Kimi-K2-Instruct`` (``deepseek_v3``): DeepSeek-V3's shape with 64 heads,
  384 routed experts (one group), ``routed_scaling_factor`` 2.827, 1 dense layer,
  vocabulary 163840, 131072 positions with YaRN ``factor`` 32, ``beta_fast`` =
  ``beta_slow`` = 1, ``rope_theta`` 5e4, ``bos_token_id`` 163584, ``eos_token_id`` 163585;
- ``zai-org/GLM-4.5-Air`` (``glm4_moe``): 46 layers, hidden 4096, 96 heads over 8
  key/value heads of 128, q/k/v biases, no q/k norm, ``partial_rotary_factor`` 0.5,
  ``rope_theta`` 1e6, 131072 positions, ``intermediate_size`` 10944 (1 dense layer), 128
  routed experts of 1408 (8 per token, one group, ``routed_scaling_factor`` 1), 1 shared,
  vocabulary 151552, RMSNorm eps 1e-5, ``eos_token_id`` [151329, 151336, 151338],
  ``pad_token_id`` 151329.

The training-only fields follow DeepSeek-V3's recipe (the aux-loss-free bias moved by
1e-3 a step, the sequence-wise balance loss 1e-4, no batch-wide load-balancing loss);
the checkpoints' readers set the bias frozen (:func:`~sp_jax.models.hf.from_hf`)."""

from __future__ import annotations

from typing import Any

from sp_jax.layers import YarnScaling
from sp_jax.layers.mla import mla_softmax_scale

__all__ = ["DEEPSEEK_V3_COMMON", "DEEPSEEK_V3_PRESETS", "GLM4_MOE_COMMON", "GLM4_MOE_PRESETS"]

_RECIPE = dict(positions="rotary", norm="rmsnorm", mlp_activation="swiglu", qkv_bias=False,
               out_bias=False, mlp_bias=False, tie_embeddings=False, moe_norm_topk=True,
               moe_layer_freq=1, num_shared_experts=1, router_aux_loss_coef=0.0,
               moe_scoring="sigmoid", moe_bias_update_rate=1e-3, moe_seq_aux_loss_coef=1e-4)


def _yarn(factor: float, original: int, beta_fast: float, beta_slow: float,
          qk_head_dim: int) -> dict[str, Any]:
    """``rope_scaling`` (YaRN, ``mscale`` = ``mscale_all_dim`` = 1) and DeepSeek's softmax
    scale (``attention_scale``) for it."""
    scaling = YarnScaling(factor=factor, original_max_position_embeddings=original,
                          beta_fast=beta_fast, beta_slow=beta_slow, mscale=1.0,
                          mscale_all_dim=1.0)
    rope = {"rope_type": "yarn", "factor": factor, "mscale_all_dim": 1.0}
    return dict(rope_scaling=scaling, attention_scale=mla_softmax_scale(qk_head_dim, rope))


DEEPSEEK_V3_COMMON = dict(_RECIPE, attention="mla", norm_epsilon=1e-6, rope_interleave=True,
                          experts_per_token=8, hf_model_type="deepseek_v3")
"""The fields every ``GPTConfig.deepseek_v3`` preset shares."""

_V3_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, hidden=7168, num_layers=61, mlp_hidden=18432,
               moe_mlp_hidden=2048)

DEEPSEEK_V3_PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v3": dict(_V3_MLA, vocab_size=129280, max_seq_len=163840, num_heads=128,
                        rope_base=1e4, **_yarn(40.0, 4096, 32.0, 1.0, 192), num_experts=256,
                        num_dense_layers=3, moe_groups=8, moe_topk_groups=4,
                        moe_routed_scale=2.5, bos_token_id=0, eos_token_id=1),
    "kimi-k2": dict(_V3_MLA, vocab_size=163840, max_seq_len=131072, num_heads=64,
                    rope_base=5e4, **_yarn(32.0, 4096, 1.0, 1.0, 192), num_experts=384,
                    num_dense_layers=1, moe_groups=1, moe_topk_groups=1,
                    moe_routed_scale=2.827, bos_token_id=163584, eos_token_id=163585),
    "deepseek-v3-tiny": dict(vocab_size=256, max_seq_len=128, num_layers=3, num_heads=4,
                             hidden=64, mlp_hidden=160, q_lora_rank=32, kv_lora_rank=32,
                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                             rope_base=1e4, **_yarn(4.0, 32, 32.0, 1.0, 24), num_experts=16,
                             experts_per_token=4, moe_mlp_hidden=32, num_dense_layers=1,
                             moe_groups=4, moe_topk_groups=2, moe_routed_scale=2.5),
}
"""``GPTConfig.deepseek_v3``'s presets by name (module docstring; ``deepseek-v3-tiny``:
the same structure at test size: 3 layers, the first dense, hidden 64, 4 heads, ranks 32,
q/k 16 + 8 rotary, v 16, YaRN factor 4 over 32 positions, 16 experts of 32 in 4 groups
of which 2, 4 per token, 1 shared, vocabulary 256, 128 positions)."""

GLM4_MOE_COMMON = dict(_RECIPE, qkv_bias=True, partial_rotary_factor=0.5, norm_epsilon=1e-5,
                       rope_base=1e6, moe_groups=1, moe_topk_groups=1, num_dense_layers=1,
                       hf_model_type="glm4_moe")
"""The fields every ``GPTConfig.glm4_moe`` preset shares."""

GLM4_MOE_PRESETS: dict[str, dict[str, Any]] = {
    "glm-4.5-air": dict(vocab_size=151552, max_seq_len=131072, num_layers=46, num_heads=96,
                        num_kv_heads=8, head_dim=128, hidden=4096, mlp_hidden=10944,
                        qk_norm=False, num_experts=128, experts_per_token=8,
                        moe_mlp_hidden=1408, moe_routed_scale=1.0,
                        eos_token_id=(151329, 151336, 151338), pad_token_id=151329),
    "glm-4.5-tiny": dict(vocab_size=256, max_seq_len=128, num_layers=3, num_heads=8,
                         num_kv_heads=4, head_dim=16, hidden=64, mlp_hidden=160,
                         qk_norm=True, num_experts=16, experts_per_token=4, moe_mlp_hidden=32,
                         moe_routed_scale=1.0),
}
"""``GPTConfig.glm4_moe``'s presets by name (module docstring; ``glm-4.5-tiny``: the
structure at test size, with GLM-4.5's q/k norms: 3 layers, the first dense, hidden 64,
8 heads over 4 key/value heads of 16, half of each rotated, 16 experts of 32, 4 per
token, 1 shared, vocabulary 256, 128 positions)."""

"""Flax NNX parallel layers on global arrays.

Modules, bottom to top: ``linear`` (the four TP / SP linear layers), ``embedding``
(vocabulary-parallel embedding), ``cross_entropy`` (loss over vocabulary-parallel
logits), ``norm`` (LayerNorm / RMSNorm on sequence shards), ``dropout`` (sharding-invariant
dropout), ``rotary`` (rotary position embeddings), ``block_config`` (the configurations of
a block's attention and MLP, and the grouped-query rules), ``qkv`` (the grouped-query
q/k/v projection), ``attention_registry`` (the attention seam: the registry of attention
classes, ``GPTConfig.attention``, and the base of their cache types), ``attention``
(causal self-attention, the ``"mha"`` entry, and its :class:`KVCache`), ``mlp`` and
``moe`` (the mixture-of-experts MLP); ``taps`` (the weight-gradient taps through which a stage's
backward defers its weight gradients: :func:`backward_input`, :func:`backward_weight`).
"""

from sp_jax.layers.attention import FULL_WINDOW, CausalSelfAttention, KVCache, LayerWindow
from sp_jax.layers.attention_registry import (
    Attention,
    AttentionCache,
    attention_class,
    attention_names,
    register_attention,
    token_positions,
)
from sp_jax.layers.block_config import (
    MLP_ACTIVATIONS,
    AttentionConfig,
    MLPConfig,
    MoEConfig,
    check_block_fields,
    check_kv_heads,
    check_moe_fields,
    kv_heads_per_shard,
    kv_heads_replicated,
    settle_block_fields,
)
from sp_jax.layers.cross_entropy import document_labels, logit_softcap, parallel_cross_entropy
from sp_jax.layers.dropout import Dropout
from sp_jax.layers.embedding import VocabParallelEmbedding, padded_vocab_size
from sp_jax.layers.linear import (
    ColumnParallelLinear,
    ColumnSequenceParallelLinear,
    RowParallelLinear,
    RowSequenceParallelLinear,
)
from sp_jax.layers.mla import (
    LatentCache,
    LatentProjection,
    MultiHeadLatentAttention,
    deinterleave_rope,
    mla_softmax_scale,
)
from sp_jax.layers.mlp import MLP, MLPActivation
from sp_jax.layers.moe import (
    MoE,
    MoEStats,
    RouterBias,
    moe_losses,
    router_loss,
    update_router_biases,
)
from sp_jax.layers.norm import NORMS, LayerNorm, RMSNorm, layer_norm, make_norm, rms_norm
from sp_jax.layers.qkv import GroupedQKVProjection
from sp_jax.layers.rotary import (
    RopeScaling,
    YarnScaling,
    rope_attention_factor,
    rope_frequencies,
    rotary_embedding,
)
from sp_jax.layers.taps import (
    WeightGradTap,
    backward_input,
    backward_weight,
    enable_weight_grad_taps,
)

__all__ = [
    "FULL_WINDOW",
    "LayerWindow",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ColumnSequenceParallelLinear",
    "RowSequenceParallelLinear",
    "VocabParallelEmbedding",
    "padded_vocab_size",
    "document_labels",
    "logit_softcap",
    "parallel_cross_entropy",
    "NORMS",
    "LayerNorm",
    "RMSNorm",
    "layer_norm",
    "rms_norm",
    "make_norm",
    "Dropout",
    "RopeScaling",
    "YarnScaling",
    "rope_attention_factor",
    "rope_frequencies",
    "rotary_embedding",
    "MLP_ACTIVATIONS",
    "AttentionConfig",
    "MLPConfig",
    "check_block_fields",
    "check_kv_heads",
    "settle_block_fields",
    "kv_heads_per_shard",
    "kv_heads_replicated",
    "GroupedQKVProjection",
    "LatentCache",
    "LatentProjection",
    "MultiHeadLatentAttention",
    "deinterleave_rope",
    "mla_softmax_scale",
    "CausalSelfAttention",
    "KVCache",
    "Attention",
    "AttentionCache",
    "attention_class",
    "attention_names",
    "register_attention",
    "token_positions",
    "MLP",
    "MLPActivation",
    "MoE",
    "MoEConfig",
    "MoEStats",
    "RouterBias",
    "check_moe_fields",
    "moe_losses",
    "router_loss",
    "update_router_biases",
    "WeightGradTap",
    "enable_weight_grad_taps",
    "backward_input",
    "backward_weight",
]

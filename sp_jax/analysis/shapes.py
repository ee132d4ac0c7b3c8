"""The model shapes the memory planner sizes and compiles (:class:`ModelShape`) and its
presets (:data:`MODELS`, ``python -m sp_jax.plan --model NAME``)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

__all__ = ["MODELS", "ModelShape"]


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A GPT shape (:class:`sp_jax.models.GPTConfig` with rotary positions, bf16 compute,
    fp32 master weights, MLP width ``4 * hidden`` and ``head_dim`` ``hidden / heads``
    unless given). ``qk_norm``: per-head q/k RMSNorm (Qwen3's); ``shared_experts``: experts
    every token also goes through (DeepSeek's, one dense SwiGLU MLP of width
    ``shared_experts x moe_mlp_hidden``)."""

    name: str
    hidden: int
    layers: int
    heads: int
    vocab: int
    seq: int
    mlp_hidden: int | None = None
    kv_heads: int | None = None
    experts: int = 0
    experts_per_token: int = 2
    moe_mlp_hidden: int | None = None
    head_dim: int | None = None
    qk_norm: bool = False
    shared_experts: int = 0
    sigmoid_router: bool = False
    dense_layers: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    lora_rank: int = 0
    base_dtype: str | None = None

    @property
    def lora(self) -> bool:
        """LoRA fine-tuning (``lora_rank`` > 0): adapters of that rank on every linear
        layer of the blocks, the base frozen (stored as ``base_dtype``: None, its fp32
        parameters; ``"bf16"``, ``"int8"``, ``"fp8"``, ``"nf4"``)."""
        return self.lora_rank > 0

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (``kv_lora_rank`` given): DeepSeek-V3's."""
        return self.kv_lora_rank is not None

    @property
    def attention_params(self) -> tuple[int, int, int, int]:
        """Attention parameters per layer as the model shards them: ``(over tensor (and the
        batch axes with fsdp), over tensor only, whole on every tensor shard (over the
        batch axes with fsdp), norms)``. Multi-head latent attention: ``q [h, heads (n +
        p)]`` (without ``q_lora_rank``) and the output ``[heads d_v, h]``; the up
        projections ``q_b [q_lora, heads (n + p)]`` and ``kv_b [r, heads (n + d_v)]``
        (never over the batch axes); the down projections ``q_a [h, q_lora]``, ``kv_a [h,
        r + p]``; their norms. Else q/out (``h a`` each) and k/v (``h kv_heads
        head_size`` each), and the q/k norms."""
        h = self.hidden
        if self.mla:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            r, lora = self.kv_lora_rank, self.q_lora_rank
            out = self.heads * self.v_head_dim * h
            up = r * self.heads * (self.qk_nope_head_dim + self.v_head_dim)
            if lora:
                return out, up + lora * self.heads * qk, h * (lora + r + self.qk_rope_head_dim), \
                    lora + r
            return out + h * self.heads * qk, up, h * (r + self.qk_rope_head_dim), r
        kv = (self.kv_heads or self.heads) * self.head_size
        return 2 * h * self.attention + 2 * h * kv, 0, 0, 2 * self.head_size * self.qk_norm

    @property
    def attention_values(self) -> tuple[int, int]:
        """bf16 values per token one layer's attention keeps for its backward: ``(split
        over the tensor axis, whole on every tensor shard)``. GPT blocks: q, k, v and the
        attention's output, ``4 a`` (Korthikanti et al.'s ``8 s b h`` bytes, by head
        width); multi-head latent attention: q and k ``heads (n + p)`` each, v and the
        output ``heads d_v`` each, and the down projections' output (``q_lora + r + p``:
        every tensor shard's whole)."""
        if self.mla:
            split = 2 * self.heads * (self.qk_nope_head_dim + self.qk_rope_head_dim
                                      + self.v_head_dim)
            return split, (self.q_lora_rank or 0) + self.kv_lora_rank + self.qk_rope_head_dim
        return 4 * self.attention, 0

    @property
    def mlp(self) -> int:
        return self.mlp_hidden or 4 * self.hidden

    @property  # the head size
    def head_size(self) -> int: return self.head_dim or self.hidden // self.heads  # noqa: E704

    @property
    def attention(self) -> int:
        """The queries' (and the output projection's input) width: heads x head_size."""
        return self.heads * self.head_size

    @property
    def moe(self) -> bool:
        """A mixture of experts in every layer (Mixtral's blocks: grouped-query attention,
        RMSNorm, SwiGLU experts, no biases, an untied head); else GPT blocks."""
        return self.experts > 0

    @property
    def params(self) -> int:
        """Parameter count (``a``: heads x head_size). GPT blocks: per layer q/k/v/out
        kernels (4 h a), MLP kernels (2 h mlp), out-projection, MLP-up and MLP-down biases
        (h + mlp + h), 2 LayerNorms (4 h); the tied vocabulary table, the final norm.
        Mixture of experts: per layer q/out (2 h a) and k/v (2 h kv_heads head_size)
        kernels, the router (h E), E SwiGLU experts (3 h F each) and the shared experts
        (3 h F each), 2 RMSNorms (2 h), the q/k norms (2 head_size) and a sigmoid router's
        selection bias (E); the embedding, the untied head, the final norm. Multi-head
        latent attention's kernels and norms in place of q/k/v/out
        (:attr:`attention_params`); the first ``dense_layers`` layers a SwiGLU MLP of
        ``mlp`` (3 h mlp) in place of the router and experts."""
        h, a = self.hidden, self.attention
        if self.moe:
            f = self.moe_mlp_hidden or self.mlp
            layer = sum(self.attention_params) + h * self.experts + 3 * h * f * (
                self.experts + self.shared_experts) + self.experts * self.sigmoid_router
            dense = sum(self.attention_params) + 3 * h * self.mlp
            return (self.layers - self.dense_layers) * (layer + 2 * h) + \
                self.dense_layers * (dense + 2 * h) + 2 * self.vocab * h + h
        return self.layers * (4 * h * a + 2 * h * self.mlp + self.mlp + 6 * h) \
            + self.vocab * h + 2 * h

    def gpt_config(self, **kw: Any) -> Any:
        """The :class:`sp_jax.models.GPTConfig` the planner compiles (Mixtral's blocks
        for experts, with q/k norms and shared experts if given), with the fields ``kw``
        (e.g. ``remat``)."""
        from sp_jax.models import GPTConfig

        moe = dict(num_kv_heads=self.kv_heads, norm="rmsnorm", mlp_activation="swiglu",
                   qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=False,
                   num_experts=self.experts, experts_per_token=self.experts_per_token,
                   moe_mlp_hidden=self.moe_mlp_hidden, qk_norm=self.qk_norm,
                   num_shared_experts=self.shared_experts,
                   num_dense_layers=self.dense_layers,
                   **(dict(moe_scoring="sigmoid") if self.sigmoid_router else {})
                   ) if self.moe else {}
        mla = dict(attention="mla", q_lora_rank=self.q_lora_rank,
                   kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                   qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim
                   ) if self.mla else {}
        lora = {}
        if self.lora:
            from sp_jax.config import LoRAConfig

            lora = dict(lora=LoRAConfig(rank=self.lora_rank, alpha=2.0 * self.lora_rank,
                                        base_dtype=self.base_dtype))
        return GPTConfig(**{**dict(
            vocab_size=self.vocab, max_seq_len=self.seq, num_layers=self.layers,
            num_heads=self.heads, hidden=self.hidden, mlp_hidden=self.mlp,
            head_dim=self.head_dim, positions="rotary", dtype=jnp.bfloat16,
            param_dtype=jnp.float32, scan_layers=True, **moe, **mla, **lora), **kw})

    def replace(self, **kw: Any) -> ModelShape: return dataclasses.replace(self, **kw)  # noqa: E704


_MLA = dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
            v_head_dim=128)  # DeepSeek-V3's multi-head latent attention (Kimi K2's too)

MODELS = {
    "gpt2-small": ModelShape("gpt2-small", hidden=768, layers=12, heads=12, vocab=50304,
                             seq=1024),
    "1.3b": ModelShape("1.3b", hidden=2048, layers=24, heads=16, vocab=50304, seq=2048),
    "7b": ModelShape("7b", hidden=4096, layers=32, heads=32, vocab=32000, seq=4096),
    "70b": ModelShape("70b", hidden=8192, layers=80, heads=64, vocab=32000, seq=4096),
    "gpt3-175b": ModelShape("gpt3-175b", hidden=12288, layers=96, heads=96, vocab=50257,
                            seq=2048),
    "mixtral-8x7b": ModelShape("mixtral-8x7b", hidden=4096, layers=32, heads=32, vocab=32000,
                               seq=4096, mlp_hidden=14336, kv_heads=8, experts=8,
                               experts_per_token=2, moe_mlp_hidden=14336),
    "llama-3-70b": ModelShape("llama-3-70b", 8192, 80, 64, 128256, 8192, 28672, kv_heads=8,
                              experts=1, experts_per_token=1),
    "405b": ModelShape("405b", 16384, 126, 128, 128256, 8192, 53248, kv_heads=8, experts=1,
                       experts_per_token=1),
    "qwen3-30b-a3b": ModelShape("qwen3-30b-a3b", 2048, 48, 32, 151936, 4096, 6144,
                                kv_heads=4, experts=128, experts_per_token=8,
                                moe_mlp_hidden=768, head_dim=128, qk_norm=True),
    "deepseek-v3": ModelShape("deepseek-v3", 7168, 61, 128, 129280, 4096, 18432,
                              experts=256, experts_per_token=8, moe_mlp_hidden=2048,
                              shared_experts=1, sigmoid_router=True, dense_layers=3, **_MLA),
    "kimi-k2": ModelShape("kimi-k2", 7168, 61, 64, 163840, 4096, 18432, experts=384,
                          experts_per_token=8, moe_mlp_hidden=2048, shared_experts=1,
                          sigmoid_router=True, dense_layers=1, **_MLA),
}
"""Presets: GPT-2 small, a 1.3B, 7B, 70B (Llama widths, depths, heads) and GPT-3 175B as GPT
blocks (4h GeLU MLP, LayerNorm), Mixtral-8x7B (46.7B: 8 experts of 14336, 2 per token, 8
key/value heads), Llama-3-70B and a 405B shape as Llama blocks (a one-expert mixture:
GQA, SwiGLU, RMSNorm, untied head, plus an h-wide router); Qwen3-30B-A3B
(``GPTConfig.qwen3_moe("qwen3-30b-a3b")`` at s=4096: 128 experts of 768, 8 per token,
q/k norms, 4 key/value heads of 128) and DeepSeek-V3's MoE shape
(``GPTConfig.deepseek_v3_moe("deepseek-v3")`` at s=4096: 256 experts of 2048, 8 per
token, one shared, sigmoid routing; multi-head latent attention, the first 3 layers dense
with an MLP of 18432: 671B parameters) and Kimi K2's (``moonshotai/Kimi-K2-Instruct``'s
config.json: 61 layers, 64 heads of DeepSeek-V3's MLA, 384 experts of 2048, 8 per token,
one shared, the first layer dense, a 163,840-entry vocabulary: 1.03T parameters)."""

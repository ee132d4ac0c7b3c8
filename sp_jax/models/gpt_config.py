"""The configuration of a :class:`~sp_jax.models.GPT`: :class:`GPTConfig` (shape, numerics,
the GPT-2, Llama, Mixtral, Qwen3-MoE, DeepSeek-V3 / Kimi K2 and GLM-4.5 presets, the
checkpoint's special token ids) and
:data:`POSITIONS`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from sp_jax.config import Fp8Recipe, LoRAConfig
from sp_jax.layers import (
    AttentionConfig,
    MLPConfig,
    MoEConfig,
    RopeScaling,
    YarnScaling,
    check_block_fields,
    check_moe_fields,
    settle_block_fields,
)
from sp_jax.models.deepseek_presets import (
    DEEPSEEK_V3_COMMON,
    DEEPSEEK_V3_PRESETS,
    GLM4_MOE_COMMON,
    GLM4_MOE_PRESETS,
)

__all__ = ["GPTConfig", "POSITIONS", "RopeScaling", "YarnScaling"]

POSITIONS = ("learned", "rotary")
"""Position encodings a :class:`GPT` supports: a learned table or rotary embeddings."""


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape and numerics of a :class:`GPT`.

    Attributes:
      vocab_size: vocabulary size ``V`` (any size: padded internally to a multiple of the
        tensor size; padded entries never appear in logits or loss).
      max_seq_len: longest sequence (size of the learned position table).
      num_layers: transformer blocks.
      num_heads: attention heads (a multiple of the tensor size).
      hidden: model width (a multiple of ``num_heads`` unless ``head_dim`` is given).
      head_dim: features per attention head, or None (the default: ``hidden /
        num_heads``). Given, q, k and v are ``num_heads x head_dim`` (k, v:
        ``num_kv_heads x head_dim``) wide and the output projection maps ``num_heads x
        head_dim`` back to ``hidden``, as Qwen3 (head size 128 at any width) and
        Mistral-Nemo; even with rotary positions.
      mlp_hidden: MLP inner width (default ``4 * hidden``).
      num_kv_heads: key/value heads (default ``num_heads``): fewer is grouped-query
        attention (1: multi-query); a divisor of ``num_heads``, and a divisor or a
        multiple of the tensor size (split, or replicated so each shard holds the one its
        query heads use; :class:`~sp_jax.layers.CausalSelfAttention`).
      dropout: dropout rate on the embeddings and on each block's residual branches (the
        attention and MLP outputs); active in train mode (``model.train()``, the mode of
        a freshly built model), off in ``model.eval()``.
      attention_dropout: dropout rate on the attention probabilities (GPT-2's
        ``attn_pdrop``), in train mode.
      tie_embeddings: the LM head reuses the token embedding table.
      positions: ``"learned"`` (table added to the embeddings) or ``"rotary"``.
      rope_base: rotary base frequency (Llama-2: 1e4, Llama-3: 5e5).
      rope_scaling: Llama-3.1 style frequency scaling (:class:`RopeScaling`, or a dict of
        its fields), YaRN's (:class:`~sp_jax.layers.YarnScaling`, or a dict of its fields
        with ``rope_type="yarn"``: DeepSeek-V3, Kimi K2), or None.
      partial_rotary_factor: the share of each head's features the rotary angles turn
        (GLM-4.5: 0.5, the first half of each head; Hugging Face's
        ``partial_rotary_factor``); 1.0: all (:class:`~sp_jax.layers.AttentionConfig`).
      rope_interleave: the Hugging Face checkpoint's rotary features come in interleaved
        pairs (DeepSeek-V3's ``rope_interleave``): data for
        :func:`~sp_jax.models.hf.to_hf`, which writes them so again; sp_jax's parameters
        hold them in rotate-half order whatever it says (the reader permutes them,
        :func:`~sp_jax.layers.mla.deinterleave_rope`), and the model's math does not read
        it.
      qkv_bias / out_bias / mlp_bias: biases on the q/k/v projection, the attention
        output projection and the MLP projections (GPT-2: all; Llama: none).
      norm: ``"layernorm"`` or ``"rmsnorm"``.
      norm_epsilon: epsilon of the norms (GPT-2: 1e-5; Llama-2: 1e-5 or 1e-6).
      dtype: compute dtype (e.g. ``jnp.bfloat16``); parameters stay in ``param_dtype``.
      param_dtype: parameter (master weight) dtype.
      remat: recompute each block in the backward pass (``jax.checkpoint``) instead of
        keeping its activations; composes with ``recompute_allgather``.
      attention_block_q / attention_block_k: query and key/value block sizes of the
        blockwise attention (:func:`sp_jax.attention.blockwise_attention`; the largest
        divisors of the sequence length up to these).
      mlp_activation: ``"gelu"`` (tanh approximation), ``"gelu_exact"``, ``"relu"``,
        ``"swiglu"``, ``"geglu"`` or Gemma's ``"geglu_tanh"`` (gated: gate and up fused
        in one column layer, :class:`~sp_jax.layers.MLP`).
      attention_implementation: ``"xla"`` (the blockwise kernel, every backend) or
        ``"cudnn"`` (cuDNN's fused attention on GPUs; not with ring attention).
      scan_layers: store the blocks' parameters stacked along a leading layer axis and
        run them with one ``lax.scan`` (compile time independent of ``num_layers``).
        Same initial values as the unrolled model; parameters ``blocks/...`` get shape
        ``[num_layers, ...]``.
      qk_norm: RMS-normalise each head's query and key (Qwen3's ``q_norm`` / ``k_norm``,
        scales ``[head_dim]`` per layer, epsilon ``norm_epsilon``) before the rotary
        angles (:class:`~sp_jax.layers.AttentionConfig`).
      sliding_window: None (causal attention over every earlier token) or ``w``: token
        ``i`` attends tokens ``i - w < j <= i`` only (Mistral's ``sliding_window``); key
        blocks wholly outside the window are skipped. Not with ring attention.
      layer_windows: None (every layer as ``sliding_window`` says), or one entry per
        layer: None (full causal attention) or ``w`` (that layer's sliding window), e.g.
        transformers' ``layer_types`` ``("sliding_attention", "full_attention", ...)``
        as ``(w, None, ...)``. Each layer's window is data (an int32 scalar variable of
        its attention, :class:`~sp_jax.layers.LayerWindow`; a full layer holds
        :data:`~sp_jax.layers.FULL_WINDOW`), so a scanned stack (``scan_layers``) and
        pipeline stages keep one program; the kernels compute their loop bounds from the
        traced window, so key blocks wholly before a layer's window are still skipped.
        ``sliding_window`` must be None with it; ``attention_implementation="xla"``.
      attention_scale: the factor of the attention scores ``q . k`` (None: ``head_dim **
        -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``).
      attention_softcap: None, or ``c``: attention scores ``c * tanh(s / c)`` before the
        mask and softmax (Gemma 2's ``attn_logit_softcapping``).
      final_logit_softcap: None, or ``c``: the LM head's logits become ``c * tanh(z /
        c)``, in the loss and in generation (Gemma 2's ``final_logit_softcapping``).
      norm_offset: every norm (and the q/k norms) scales by ``norm_offset + weight``:
        0.0, or Gemma's 1.0 (its RMSNorm's ``1 + weight``, weights initialised to 0).
      post_norms: each block also normalises its attention and MLP outputs before the
        residual adds (Gemma 2 / 3's ``post_attention_layernorm`` and
        ``post_feedforward_layernorm``).
      scale_embeddings: the token embeddings are multiplied by ``sqrt(hidden)`` (in the
        compute dtype) before the first block (Gemma).
      rope_local_base: None, or the rotary base of the layers with a sliding window
        (Gemma 3's ``rope_local_base_freq``; ``rope_scaling`` then applies to the full
        layers only).
      num_experts: routed experts ``E`` of the mixture-of-experts layers; 0 (the default)
        keeps every MLP dense. Layer ``i`` is a mixture of experts
        (:class:`~sp_jax.layers.MoE`) when ``(i + 1) % moe_layer_freq == 0`` and ``i >=
        num_dense_layers``.
      experts_per_token: ``k``, the experts each token goes to.
      moe_mlp_hidden: inner width ``F`` of each expert (default ``mlp_hidden``).
      moe_capacity_factor: None (dropless) or ``c``: each expert takes at most
        ``ceil(c * seq * k / E)`` (token, choice) pairs of a sequence, first choices
        first, in position order; the rest are dropped.
      router_aux_loss_coef: weight of the load-balancing loss added to the training loss
        (transformers' Mixtral ``router_aux_loss_coef``; the loss over every layer's
        tokens together, :func:`~sp_jax.layers.moe_losses`).
      router_z_loss_coef: weight of the router z-loss (ST-MoE) added to the loss.
      num_shared_experts: experts every token also goes through (one dense MLP of width
        ``num_shared_experts * moe_mlp_hidden``, DeepSeek style, no gate).
      moe_norm_topk: renormalise the ``k`` chosen router probabilities (Mixtral, Qwen3-MoE).
      moe_layer_freq: every ``moe_layer_freq``-th layer is a mixture of experts (Qwen's
        ``decoder_sparse_step``; 1: every layer, as Mixtral); the others keep the dense
        MLP. With ``scan_layers`` the expert layers must be alike: 1 (dense layers
        first, before them: ``num_dense_layers``).
      bos_token_id / eos_token_id / pad_token_id: the checkpoint's special token ids
        (``config.json``'s), kept for :func:`~sp_jax.models.hf.to_hf` and generation;
        None when it has none. ``eos_token_id`` may be several ids (a list in
        ``config.json``, a tuple here). The model itself does not use them.
      lora: a :class:`~sp_jax.LoRAConfig` (or a dict of its fields): low-rank adapters
        on the linear layers it targets (q/k/v, output, gate/up, down), inside their ops
        and split as each layer's kind says; the base weights frozen (the training step
        differentiates the adapters only). None: no adapters.
      fp8: an :class:`~sp_jax.Fp8Recipe` (or a dict of its fields): every block's
        q/k/v, output, up and down projections compute in FP8 (e4m3 inputs and weights,
        e5m2 output gradients, whole-tensor scales, fp32 accumulation; the sequence
        all-gathers move FP8); or None (the default: ``dtype``). Embeddings, norms,
        attention, the LM head (a documented choice: its logits feed the loss
        directly, and it is a small share of the FLOPs at scale) and the router stay in
        ``dtype``; a mixture of experts' grouped GEMMs (and shared experts) run in FP8
        too (:class:`~sp_jax.layers.MoE`). In pipeline stages too (each stage holds its
        layers' amax histories).
      hf_model_type: the Hugging Face family (``config.json``'s ``model_type``, one of
        :data:`sp_jax.models.hf.FAMILIES`) this config was read as or stands for: set by
        :func:`~sp_jax.models.hf.from_hf` / :func:`~sp_jax.models.hf.config_from_hf` to
        the checkpoint's, by the presets to theirs (``"gpt2"``, ``"llama"``,
        ``"mixtral"``, ``"qwen3_moe"``; the DeepSeek-V3-shaped presets: None); None: not
        remembered. :func:`~sp_jax.models.hf.to_hf` writes this family while it still
        expresses the config (a Mistral without a window stays ``MistralForCausalLM``),
        else the first that does; its ``model_type=`` argument still chooses. Data only:
        the model's math does not read it; checkpoints record it with the other fields.
      attention: the registered name of every block's attention class (``"mha"``, the
        default: :class:`~sp_jax.layers.CausalSelfAttention`, multi-head, grouped-query
        and multi-query attention as ``num_kv_heads`` says); another name registered
        with :func:`~sp_jax.layers.register_attention` (checked here, the error naming
        the registered ones) builds that class, which owns its parameters, forward,
        prefill, decode step and cache type (docs/api.md, "Seams: attention variants").
      num_dense_layers: ``k``, the first ``k`` layers keep the dense MLP (``mlp_hidden``
        wide) and every later one is a mixture of experts (Hugging Face's
        ``first_k_dense_replace``, DeepSeek-V3's 3); 0 (the default): the layers as
        ``moe_layer_freq`` says. Needs ``num_experts > 0``, ``k < num_layers`` and
        ``moe_layer_freq=1`` (:mod:`sp_jax.compat`). With ``scan_layers`` the dense
        layers are a stack of their own, ``dense_blocks/...`` ``[k, ...]``, run before
        the experts' ``blocks/...`` ``[num_layers - k, ...]`` (one ``lax.scan`` each);
        pipeline stages hold both kinds as data (:mod:`sp_jax.pipeline.gpt_stages`).
      q_lora_rank / kv_lora_rank / qk_nope_head_dim / qk_rope_head_dim / v_head_dim: with
        ``attention="mla"``, multi-head latent attention's shape (DeepSeek-V3's fields:
        :class:`~sp_jax.layers.MultiHeadLatentAttention`; ``q_lora_rank=None``: q
        projected directly); None otherwise.
      mla_absorb: multi-head latent attention's decode from its latent cache: True
        (absorbed, in latent space) or False (the cached latent up-projected into
        per-head keys and values each step; the same tokens, more memory:
        :meth:`~sp_jax.layers.MultiHeadLatentAttention.decode_step`).
      moe_scoring / moe_groups / moe_topk_groups / moe_routed_scale: DeepSeek-V3's
        routing (Hugging Face's ``scoring_func``, ``n_group``, ``topk_group``,
        ``routed_scaling_factor``): ``"sigmoid"`` scores, group-limited top-k and the
        weights' factor (:class:`~sp_jax.layers.MoEConfig`); the defaults: softmax top-k.
      moe_bias_update_rate: aux-loss-free balancing: each expert layer's selection bias
        (``e_score_correction_bias``, a :class:`~sp_jax.layers.RouterBias`, held with a
        sigmoid router or a rate > 0) moves by ``rate * sign(mean load - load)`` after
        each training step, from the expert loads of the whole global batch
        (:class:`~sp_jax.training.TrainStep`, outside the optimizer); 0.0: frozen.
      moe_seq_aux_loss_coef: weight of DeepSeek-V3's sequence-wise balance loss added to
        the training loss (``moe_seq_aux_loss`` of :func:`~sp_jax.layers.moe_losses`).
      mtp_depth: ``D``, DeepSeek-V3's sequential multi-token prediction modules
        (:class:`~sp_jax.models.mtp.MTPModule`, Hugging Face's
        ``num_nextn_predict_layers``): module ``k`` predicts token ``i + k + 1`` at
        position ``i`` from module ``k - 1``'s hidden state (the main model's for the
        first) and the embedding of token ``i + k``; trained as an added loss
        (:meth:`GPT.loss <sp_jax.models.GPT.loss>`), drafting for
        ``generate(..., speculative="mtp")``. 0 (the default): none.
      mtp_loss_weight: ``lambda``, the weight of the MTP loss (the mean over the ``D``
        depths of their mean cross-entropies) added to the training loss (DeepSeek-V3:
        0.3, then 0.1).
    """

    vocab_size: int
    max_seq_len: int
    num_layers: int
    num_heads: int
    hidden: int
    mlp_hidden: int | None = None
    dropout: float = 0.0
    tie_embeddings: bool = True
    positions: str = "learned"
    rope_base: float = 10000.0
    norm: str = "layernorm"
    norm_epsilon: float = 1e-5
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    remat: bool = False
    scan_layers: bool = False
    attention_block_q: int = 512
    attention_block_k: int = 512
    attention_implementation: str = "xla"
    mlp_activation: str = "gelu"
    num_kv_heads: int | None = None
    rope_scaling: RopeScaling | YarnScaling | None = None
    qkv_bias: bool = False
    out_bias: bool = True
    mlp_bias: bool = True
    attention_dropout: float = 0.0
    qk_norm: bool = False
    sliding_window: int | None = None
    num_experts: int = 0
    experts_per_token: int = 2
    moe_mlp_hidden: int | None = None
    moe_capacity_factor: float | None = None
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    num_shared_experts: int = 0
    moe_norm_topk: bool = True
    moe_layer_freq: int = 1
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    fp8: Fp8Recipe | None = None
    lora: LoRAConfig | None = None
    hf_model_type: str | None = None
    head_dim: int | None = None
    layer_windows: tuple[int | None, ...] | None = None
    attention_scale: float | None = None
    attention_softcap: float | None = None
    final_logit_softcap: float | None = None
    norm_offset: float = 0.0
    post_norms: bool = False
    scale_embeddings: bool = False
    rope_local_base: float | None = None
    attention: str = "mha"
    num_dense_layers: int = 0
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    mla_absorb: bool = True
    moe_scoring: str = "softmax"
    moe_groups: int = 1
    moe_topk_groups: int = 1
    moe_routed_scale: float = 1.0
    moe_bias_update_rate: float = 0.0
    moe_seq_aux_loss_coef: float = 0.0
    partial_rotary_factor: float = 1.0
    rope_interleave: bool = False
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "num_layers"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name}={value!r} must be a positive int.")
        if self.mlp_hidden is None and isinstance(self.hidden, int):
            object.__setattr__(self, "mlp_hidden", 4 * self.hidden)
        if not isinstance(self.tie_embeddings, bool):
            raise TypeError(f"GPTConfig.tie_embeddings={self.tie_embeddings!r} must be True or "
                            "False.")
        if self.positions not in POSITIONS:
            raise ValueError(
                f"GPTConfig.positions={self.positions!r} is not a known position encoding; "
                f"use one of {list(POSITIONS)}."
            )
        settle_block_fields(self)
        check_block_fields("GPTConfig", self)  # the fields the blocks' configs share
        self._check_experts()
        self._check_token_ids()
        self._check_layer_windows()
        self._check_mtp()
        if self.hf_model_type is not None and (
                not isinstance(self.hf_model_type, str) or not self.hf_model_type):
            raise ValueError(f"GPTConfig.hf_model_type={self.hf_model_type!r} must be a "
                             "Hugging Face model_type (e.g. 'llama', 'mistral') or None.")

    def _check_experts(self) -> None:
        """The mixture-of-experts fields (checked when ``num_experts > 0``)."""
        e = self.num_experts
        if isinstance(e, bool) or not isinstance(e, int) or e < 0:
            raise ValueError(f"GPTConfig.num_experts={e!r} must be an int >= 0 (0: dense MLPs).")
        if self.moe_mlp_hidden is None:
            object.__setattr__(self, "moe_mlp_hidden", self.mlp_hidden)
        dense = self.num_dense_layers
        if isinstance(dense, bool) or not isinstance(dense, int | np.integer) or dense < 0:
            raise ValueError(f"GPTConfig.num_dense_layers={dense!r} must be an int >= 0 (the "
                             "first layers that keep a dense MLP before the experts).")
        object.__setattr__(self, "num_dense_layers", int(dense))
        if dense and not e:
            raise ValueError(f"GPTConfig.num_dense_layers={dense} needs num_experts > 0: the "
                             "layers after the dense ones are mixtures of experts (with "
                             "num_experts=0 every layer is dense already).")
        if dense >= self.num_layers:
            raise ValueError(f"GPTConfig.num_dense_layers={dense} must be below num_layers="
                             f"{self.num_layers} (the layers after them are the experts'); "
                             "use num_experts=0 for a dense model.")
        if not e:
            return
        check_moe_fields("GPTConfig", self)
        freq = self.moe_layer_freq
        if isinstance(freq, bool) or not isinstance(freq, int) or freq <= 0:
            raise ValueError(f"GPTConfig.moe_layer_freq={freq!r} must be a positive int.")
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"GPTConfig.{name}={value!r} must be a number >= 0.")

    def _check_mtp(self) -> None:
        """``mtp_depth`` (an int >= 0) and ``mtp_loss_weight`` (a number >= 0)."""
        depth, weight = self.mtp_depth, self.mtp_loss_weight
        if isinstance(depth, bool) or not isinstance(depth, int | np.integer) or depth < 0:
            raise ValueError(f"GPTConfig.mtp_depth={depth!r} must be an int >= 0 (the number "
                             "of multi-token prediction modules; 0: none).")
        object.__setattr__(self, "mtp_depth", int(depth))
        if isinstance(weight, bool) or not isinstance(weight, int | float) or weight < 0:
            raise ValueError(f"GPTConfig.mtp_loss_weight={weight!r} must be a number >= 0 "
                             "(the weight of the multi-token prediction loss).")

    def _check_layer_windows(self) -> None:
        """``layer_windows``: None or one entry (None or a positive int) per layer."""
        windows = self.layer_windows
        if windows is None:
            return
        fix = ("give one entry per layer: None (full attention) or a positive int (that "
               "layer's window)")
        if not isinstance(windows, list | tuple) or len(windows) != self.num_layers:
            raise ValueError(f"GPTConfig.layer_windows={windows!r} with num_layers="
                             f"{self.num_layers}: {fix}.")
        for i, w in enumerate(windows):
            if w is not None and (isinstance(w, bool) or not isinstance(w, int | np.integer)
                                  or w <= 0):
                raise ValueError(f"GPTConfig.layer_windows[{i}]={w!r}: {fix}.")
        object.__setattr__(self, "layer_windows",
                           tuple(None if w is None else int(w) for w in windows))
        if self.sliding_window is not None:
            raise ValueError(f"GPTConfig: sliding_window={self.sliding_window} and "
                             "layer_windows both set; give the window of every layer in "
                             "layer_windows and sliding_window=None.")

    def layer_window(self, index: int) -> int | None:
        """Layer ``index``'s sliding window (None: full causal attention)."""
        if self.layer_windows is not None:
            return self.layer_windows[index]
        return self.sliding_window

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index`` (from 0) is a mixture of experts: with experts, not one
        of the first ``num_dense_layers``, and every ``moe_layer_freq``-th."""
        return self.num_experts > 0 and index >= self.num_dense_layers and \
            (index + 1) % self.moe_layer_freq == 0

    @property
    def num_moe_layers(self) -> int:
        """How many layers are mixtures of experts."""
        return sum(map(self.is_moe_layer, range(self.num_layers)))

    def _check_token_ids(self) -> None:
        """The special token ids: ints or None (``eos_token_id``: also several, kept as a
        tuple)."""
        def is_id(v: Any) -> bool:
            return isinstance(v, int | np.integer) and not isinstance(v, bool)

        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if name == "eos_token_id" and isinstance(value, list | tuple) and value \
                    and all(map(is_id, value)):
                object.__setattr__(self, name, tuple(int(v) for v in value))
                continue
            if value is None:
                continue
            if not is_id(value):
                raise TypeError(f"GPTConfig.{name}={value!r} must be a token id (an int) or "
                                "None" + (" or a list of ids" if name == "eos_token_id"
                                          else "") + ".")
            object.__setattr__(self, name, int(value))

    @classmethod
    def gpt2(cls, size: str = "small", **overrides: Any) -> GPTConfig:
        """GPT-2's shapes (Radford et al. 2019; Hugging Face ``gpt2``, ``gpt2-medium``, ...):
        learned positions, LayerNorm (eps 1e-5), tanh-gelu MLP of ``4 * hidden``, biases
        everywhere, tied embeddings, vocabulary 50257, 1024 positions. Only shapes:
        nothing is downloaded (see :func:`sp_jax.models.hf.from_hf` for weights).

        Args:
          size: ``"small"`` (124M), ``"medium"`` (355M), ``"large"`` (774M), ``"xl"``
            (1.5B) or ``"tiny"`` (a 2-layer model of the same structure, for tests).
          overrides: any other :class:`GPTConfig` field (e.g. ``dtype``, ``remat``).
        """
        shapes = {"tiny": (2, 4, 64), "small": (12, 12, 768), "medium": (24, 16, 1024),
                  "large": (36, 20, 1280), "xl": (48, 25, 1600)}
        if size not in shapes:
            raise ValueError(f"GPTConfig.gpt2: size={size!r} is not one of {list(shapes)}.")
        layers, heads, hidden = shapes[size]
        base = dict(vocab_size=50257, max_seq_len=1024, num_layers=layers, num_heads=heads,
                    hidden=hidden, qkv_bias=True, out_bias=True, mlp_bias=True,
                    norm="layernorm", norm_epsilon=1e-5, mlp_activation="gelu",
                    positions="learned", tie_embeddings=True, hf_model_type="gpt2")
        if size == "tiny":
            base.update(vocab_size=256, max_seq_len=128)
        return cls(**{**base, **overrides})

    @classmethod
    def _preset(cls, family: str, name: str, presets: dict[str, dict[str, Any]],
                common: dict[str, Any], overrides: dict[str, Any]) -> GPTConfig:
        """The config of preset ``name`` of a ``family`` classmethod: its ``common``
        fields, the preset's, then ``overrides``."""
        if name not in presets:
            raise ValueError(f"GPTConfig.{family}: name={name!r} is not one of "
                             f"{list(presets)}.")
        return cls(**{**common, **presets[name], **overrides})

    @classmethod
    def llama(cls, name: str = "llama-2-7b", **overrides: Any) -> GPTConfig:
        """Llama-family shapes (Touvron et al. 2023; Meta's Llama 3): rotary positions,
        RMSNorm, SwiGLU MLP, no biases, untied head. Only shapes: nothing is downloaded.

        Args:
          name: ``"llama-2-7b"`` (32 heads, 4096 wide, MLP 11008, vocabulary 32000, 4096
            positions, rope_base 1e4), ``"llama-3-8b"`` (8 key/value heads, MLP 14336,
            vocabulary 128256, 8192 positions, rope_base 5e5), ``"llama-3.1-8b"`` (the
            same with Llama-3.1's :class:`RopeScaling` and 131072 positions) or
            ``"llama-tiny"`` (2 layers, 8 heads over 2 key/value heads, 64 wide: the
            structure of Llama-3 at test size).
          overrides: any other :class:`GPTConfig` field.
        """
        common = dict(positions="rotary", norm="rmsnorm", mlp_activation="swiglu",
                      qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=False,
                      num_layers=32, num_heads=32, hidden=4096, hf_model_type="llama")
        presets = {
            "llama-2-7b": dict(vocab_size=32000, max_seq_len=4096, mlp_hidden=11008,
                               num_kv_heads=32, rope_base=10000.0, norm_epsilon=1e-5),
            "llama-3-8b": dict(vocab_size=128256, max_seq_len=8192, mlp_hidden=14336,
                               num_kv_heads=8, rope_base=500000.0, norm_epsilon=1e-5),
            "llama-3.1-8b": dict(vocab_size=128256, max_seq_len=131072, mlp_hidden=14336,
                                 num_kv_heads=8, rope_base=500000.0, norm_epsilon=1e-5,
                                 rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192)),
            "llama-tiny": dict(vocab_size=256, max_seq_len=128, num_layers=2, num_heads=8,
                               num_kv_heads=2, hidden=64, mlp_hidden=160,
                               rope_base=500000.0, norm_epsilon=1e-5),
        }
        return cls._preset("llama", name, presets, common, overrides)

    @classmethod
    def mixtral(cls, name: str = "mixtral-8x7b", **overrides: Any) -> GPTConfig:
        """Mixtral shapes (Jiang et al. 2024; Hugging Face ``mistralai/Mixtral-8x7B-v0.1``):
        Mistral's attention (rotary, RMSNorm eps 1e-5, 8 key/value heads, no biases, no
        sliding window) with a mixture of experts in every layer (8 SwiGLU experts, 2 per
        token, renormalised top-k, ``router_aux_loss_coef`` 0.02), untied head. Only
        shapes: nothing is downloaded (see :func:`sp_jax.models.hf.from_hf` for weights).

        Args:
          name: ``"mixtral-8x7b"`` (46.7B parameters: 32 layers, 32 heads, 4096 wide,
            experts 14336 wide, vocabulary 32000, 32768 positions, rope_base 1e6) or
            ``"mixtral-tiny"`` (2 layers, 8 heads over 2 key/value heads, 64 wide,
            experts 32 wide, vocabulary 256, 128 positions: the same structure at test
            size).
          overrides: any other :class:`GPTConfig` field (e.g. ``moe_capacity_factor``).
        """
        common = dict(positions="rotary", norm="rmsnorm", mlp_activation="swiglu",
                      qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=False,
                      norm_epsilon=1e-5, rope_base=1e6, sliding_window=None, num_experts=8,
                      experts_per_token=2, moe_norm_topk=True, router_aux_loss_coef=0.02,
                      hf_model_type="mixtral")
        presets = {
            "mixtral-8x7b": dict(vocab_size=32000, max_seq_len=32768, num_layers=32,
                                 num_heads=32, num_kv_heads=8, hidden=4096, mlp_hidden=14336,
                                 moe_mlp_hidden=14336),
            "mixtral-tiny": dict(vocab_size=256, max_seq_len=128, num_layers=2, num_heads=8,
                                 num_kv_heads=2, hidden=64, mlp_hidden=32, moe_mlp_hidden=32),
        }
        return cls._preset("mixtral", name, presets, common, overrides)

    @classmethod
    def qwen3_moe(cls, name: str = "qwen3-30b-a3b", **overrides: Any) -> GPTConfig:
        """Qwen3-MoE shapes (Qwen team 2025; Hugging Face ``Qwen/Qwen3-30B-A3B``'s
        ``config.json``): Qwen3's attention (rotary, RMSNorm eps 1e-6, per-head q/k RMSNorm,
        grouped-query, ``head_dim`` 128 whatever the width, no biases) with a fine-grained
        mixture of experts in every layer (``decoder_sparse_step`` 1, ``mlp_only_layers``
        empty: SwiGLU experts, renormalised top-k (``norm_topk_prob``), no shared experts,
        ``router_aux_loss_coef`` 0.001), untied head; the family
        :func:`~sp_jax.models.hf.to_hf` writes is ``qwen3_moe``. Only shapes: nothing is
        downloaded (see :func:`sp_jax.models.hf.from_hf` for weights).

        Args:
          name: ``"qwen3-30b-a3b"`` (30.5B parameters, 3.3B active per token: 48 layers,
            hidden 2048, 32 heads over 4 key/value heads of 128, 128 experts of 768, 8 per
            token, vocabulary 151936, 40960 positions, rope_base 1e6; ``mlp_hidden`` 6144
            is ``config.json``'s ``intermediate_size``, which no layer uses) or
            ``"qwen3-moe-tiny"`` (the same structure at test size: 2 layers, hidden 64, 8
            heads over 2 key/value heads of 16 (heads x head_dim twice the width, as the
            30B's), 16 experts of 16, 4 per token, vocabulary 256, 128 positions).
          overrides: any other :class:`GPTConfig` field (e.g. ``moe_capacity_factor``).
        """
        common = dict(positions="rotary", norm="rmsnorm", mlp_activation="swiglu",
                      qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=False,
                      qk_norm=True, norm_epsilon=1e-6, rope_base=1e6, moe_norm_topk=True,
                      moe_layer_freq=1, num_shared_experts=0, router_aux_loss_coef=0.001,
                      hf_model_type="qwen3_moe")
        presets = {
            "qwen3-30b-a3b": dict(vocab_size=151936, max_seq_len=40960, num_layers=48,
                                  num_heads=32, num_kv_heads=4, head_dim=128, hidden=2048,
                                  mlp_hidden=6144, num_experts=128, experts_per_token=8,
                                  moe_mlp_hidden=768),
            "qwen3-moe-tiny": dict(vocab_size=256, max_seq_len=128, num_layers=2, num_heads=8,
                                   num_kv_heads=2, head_dim=16, hidden=64, mlp_hidden=192,
                                   num_experts=16, experts_per_token=4, moe_mlp_hidden=16),
        }
        return cls._preset("qwen3_moe", name, presets, common, overrides)

    @classmethod
    def deepseek_v3_moe(cls, name: str = "deepseek-v3", **overrides: Any) -> GPTConfig:
        """DeepSeek-V3-MoE-shaped presets (DeepSeek-AI 2024; Hugging Face
        ``deepseek-ai/DeepSeek-V3``'s ``config.json``): its mixture of experts (256 routed
        SwiGLU experts of 2048, 8 per token, plus 1 shared expert every token goes
        through) and its routing: sigmoid scores, group-limited top-k (8 groups, the best
        4 by their top-2 sums), the chosen scores renormalised and scaled by 2.5,
        aux-loss-free balancing (a per-expert selection bias moved by 0.001 a step) and
        the sequence-wise balance loss (alpha 0.0001; no batch-wide load-balancing
        loss); width, depth, vocabulary and norms (RMSNorm eps 1e-6), rotary positions
        (base 1e4), untied head, no biases; the rest in the nearest form sp_jax has, so
        the shape is DeepSeek-V3's for the experts and not a DeepSeek-V3 checkpoint:

        * **attention is not MLA**: DeepSeek-V3's multi-head latent attention (queries
          through a rank-1536 and keys/values through a rank-512 latent, 128 heads with
          128 + 64 rotary query/key features and 128 value features) is plain multi-head
          attention here, 128 heads of 128 (q, k, v, out: 470M parameters a layer
          against MLA's 187M);
        * **every layer is a mixture of experts**: DeepSeek-V3's first 3 layers are dense
          (MLP 18432, ``first_k_dense_replace``); these presets keep all 61 as mixtures
          (the shape the planner's figures were measured on), and the override
          ``num_dense_layers=3`` makes the first 3 dense MLPs of ``mlp_hidden`` 18432;
        * no multi-token-prediction module, and no YaRN: 4096 positions (the
          pretraining length, ``original_max_position_embeddings``) rather than the
          163840 of its YaRN scaling.

        No Hugging Face family (``hf_model_type`` None): a DeepSeek-V3 checkpoint is
        :meth:`deepseek_v3`'s architecture (MLA, dense first layers), which
        :func:`~sp_jax.models.hf.from_hf` reads; this stand-in stays as it was for the
        figures measured on it (``to_hf`` writes it as the first family expressing it,
        GLM-4.5's ``glm4_moe`` with every rotary feature turned).

        Args:
          name: ``"deepseek-v3"`` (61 layers, hidden 7168, 128 heads of 128, 256 routed
            experts of 2048 in 8 groups, 8 per token, 1 shared, vocabulary 129280: 721B
            parameters with the attention and the first 3 layers above, against
            DeepSeek-V3's 671B) or ``"deepseek-v3-tiny"`` (the same structure at test
            size: 2 layers, hidden 64, 8 heads of 16, 32 routed experts of 16 in 8 groups,
            4 chosen, 8 per token, 1 shared, vocabulary 256, 128 positions).
          overrides: any other :class:`GPTConfig` field (``moe_scoring="softmax",
            moe_groups=1, moe_topk_groups=1, moe_routed_scale=1.0,
            moe_bias_update_rate=0.0``: softmax top-k, as before issue 51).
        """
        common = dict(positions="rotary", norm="rmsnorm", mlp_activation="swiglu",
                      qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=False,
                      norm_epsilon=1e-6, rope_base=1e4, moe_norm_topk=True, moe_layer_freq=1,
                      experts_per_token=8, num_shared_experts=1, router_aux_loss_coef=0.0,
                      moe_scoring="sigmoid", moe_groups=8, moe_topk_groups=4,
                      moe_routed_scale=2.5, moe_bias_update_rate=1e-3,
                      moe_seq_aux_loss_coef=1e-4)
        presets = {
            "deepseek-v3": dict(vocab_size=129280, max_seq_len=4096, num_layers=61,
                                num_heads=128, num_kv_heads=128, head_dim=128, hidden=7168,
                                mlp_hidden=18432, num_experts=256, moe_mlp_hidden=2048),
            "deepseek-v3-tiny": dict(vocab_size=256, max_seq_len=128, num_layers=2,
                                     num_heads=8, num_kv_heads=8, head_dim=16, hidden=64,
                                     mlp_hidden=160, num_experts=32, moe_mlp_hidden=16),
        }
        return cls._preset("deepseek_v3_moe", name, presets, common, overrides)

    @classmethod
    def deepseek_v3(cls, name: str = "deepseek-v3", **overrides: Any) -> GPTConfig:
        """DeepSeek-V3-architecture shapes (``model_type`` ``deepseek_v3``: DeepSeek-V3,
        Kimi K2), as their Hugging Face ``config.json`` files give them
        (:mod:`sp_jax.models.deepseek_presets`): multi-head latent attention
        (``attention="mla"``) with YaRN rotary scaling and DeepSeek's softmax scale,
        the first layers dense, then mixtures of experts with sigmoid group-limited
        routing, a selection bias and one shared expert; untied head. Only shapes (no
        multi-token-prediction module); :func:`sp_jax.models.hf.from_hf` reads the
        weights, :func:`~sp_jax.models.hf.to_hf` writes them back. Unlike
        :meth:`deepseek_v3_moe` (multi-head attention, every layer a mixture: the
        stand-in the planner's and routing's figures were measured on, kept as it
        was), this is the architecture itself.

        Args:
          name: ``"deepseek-v3"`` (671B: 61 layers, hidden 7168, 128 heads, 256 experts
            of 2048, 3 dense layers, 163840 positions), ``"kimi-k2"`` (1.03T: 64 heads,
            384 experts, 1 dense layer, 131072 positions) or ``"deepseek-v3-tiny"``
            (the structure at test size).
          overrides: any other :class:`GPTConfig` field.
        """
        return cls._preset("deepseek_v3", name, DEEPSEEK_V3_PRESETS, DEEPSEEK_V3_COMMON,
                           overrides)

    @classmethod
    def glm4_moe(cls, name: str = "glm-4.5-air", **overrides: Any) -> GPTConfig:
        """GLM-4.5 shapes (``model_type`` ``glm4_moe``; Hugging Face ``zai-org/GLM-4.5-Air``'s
        ``config.json``, :mod:`sp_jax.models.deepseek_presets`): grouped-query attention
        with half of each head rotated, q/k/v biases, one dense layer, then mixtures of
        experts with sigmoid routing, a selection bias and one shared expert; untied
        head. Only shapes (no multi-token-prediction module).

        Args:
          name: ``"glm-4.5-air"`` (106B: 46 layers, hidden 4096, 96 heads over 8 of
            128, 128 experts of 1408, 8 per token) or ``"glm-4.5-tiny"`` (the structure
            at test size, with GLM-4.5's q/k norms).
          overrides: any other :class:`GPTConfig` field.
        """
        return cls._preset("glm4_moe", name, GLM4_MOE_PRESETS, GLM4_MOE_COMMON, overrides)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward and backward, recomputation not counted;
        PaLM's accounting): ``6 N + 12 L a s`` with ``N`` the matmul parameters (every
        block's projections and the LM head; of a mixture of experts, the router and the
        ``k`` routed and the shared experts a token goes through) and the attention scores
        and values over ``seq_len`` (default ``max_seq_len``) keys, ``a = num_heads x
        head_dim`` wide, causal masking not discounted."""
        s = self.max_seq_len if seq_len is None else int(seq_len)
        h, kv = self.hidden, (self.num_kv_heads or self.num_heads)
        d = self.attention_config().head_dim
        attention = 2 * h * self.num_heads * d + 2 * h * kv * d
        mlp_hidden = self.mlp_hidden or 4 * h
        gated = self.mlp_config().gated
        mlp = (3 if gated else 2) * h * mlp_hidden
        moe = self.num_moe_layers
        active = (3 if gated else 2) * h * (self.moe_mlp_hidden or mlp_hidden) * (
            self.experts_per_token + self.num_shared_experts) + h * self.num_experts
        matmul_params = self.num_layers * attention + (self.num_layers - moe) * mlp + \
            moe * active + self.vocab_size * h
        return float(6 * matmul_params + 12 * self.num_layers * self.num_heads * d * s)

    def attention_config(self) -> AttentionConfig:
        """The :class:`~sp_jax.layers.AttentionConfig` of every block (the fields of the
        same names, and ``rotary`` for ``positions="rotary"``)."""
        return AttentionConfig(rotary=self.positions == "rotary",
                               window_per_layer=self.layer_windows is not None,
                               **self._fields_of(AttentionConfig))

    def moe_config(self) -> MoEConfig:
        """The :class:`~sp_jax.layers.MoEConfig` of the mixture-of-experts layers (the
        fields of the same names)."""
        return MoEConfig(**self._fields_of(MoEConfig))

    def mlp_config(self) -> MLPConfig:
        """The :class:`~sp_jax.layers.MLPConfig` of every block (the fields of the same
        names)."""
        return MLPConfig(**self._fields_of(MLPConfig))

    def _fields_of(self, config_class: type) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(config_class)
                if hasattr(self, f.name)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        """Builds a config from a plain dict, rejecting unknown keys."""
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(d) - set(valid))
        if unknown:
            raise ValueError(f"Unknown GPTConfig key(s) {unknown}; valid keys are {valid}.")
        return cls(**d)

"""Multi-head latent attention (DeepSeek-V2/V3's MLA) in the TP+SP layout: the ``"mla"``
attention of the registry (:mod:`sp_jax.layers.attention_registry`), its projections
(:class:`LatentProjection`) and its latent cache (:class:`LatentCache`).

Per token (``r = kv_lora_rank``, ``n = qk_nope_head_dim``, ``p = qk_rope_head_dim``,
``d_v = v_head_dim``; Hugging Face's ``DeepseekV3Attention``):

- queries: ``q = q_b(rms(q_a(h)))`` (or ``q = q_proj(h)`` without ``q_lora_rank``),
  ``[heads, n + p]``, the last ``p`` features of each head turned by the rotary angles;
- keys and values from a latent: ``kv_a(h) = [c | k_rope]`` (``r + p`` features),
  ``c = rms(c)`` (``kv_a_layernorm``), ``kv_b(c) = [k_nope | v]`` per head (``n + d_v``),
  the key ``[k_nope | rotary(k_rope)]`` (the rotary key shared by every head);
- softmax scale ``(n + p) ** -0.5`` (:func:`mla_softmax_scale`: times YaRN's mscale
  squared for scaled checkpoints), the output ``o_proj`` of ``heads x d_v``.

Hugging Face's ``rope_interleave`` (DeepSeek's interleaved rotary pairs) is the same
model with the rotary features of ``q_b`` / ``q_proj`` and ``kv_a`` permuted (the even
features, then the odd ones: :func:`deinterleave_rope`): scores ``q . k`` do not change
when q and k are permuted alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from sp_jax import ops
from sp_jax.attention import cached_attention, expand_latent, latent_ring_attention
from sp_jax.config import ParallelConfig
from sp_jax.layers.attention import CausalSelfAttention, head_rms_norm
from sp_jax.layers.attention_registry import (
    AttentionCache,
    register_attention,
    token_positions,
)
from sp_jax.layers.block_config import AttentionConfig
from sp_jax.layers.gemm import layer_gemm
from sp_jax.layers.linear import RowSequenceParallelLinear, column_sp_matmul, shard_linear
from sp_jax.layers.rotary import (
    YarnScaling,
    rope_attention_factor,
    rotary_embedding,
    yarn_mscale,
)
from sp_jax.layout import Layout
from sp_jax.mesh import Mesh, check_activations, check_divisible, current_mesh, reshard

__all__ = ["LatentCache", "LatentProjection", "MultiHeadLatentAttention", "deinterleave_rope",
           "mla_softmax_scale"]


LATENT_NORM_EPSILON = 1e-6
"""The epsilon of the q and kv latents' RMS norms (``q_a_layernorm`` / ``kv_a_layernorm``):
DeepSeek's reference and transformers build them with their default 1e-6, not the model's
``rms_norm_eps`` (which the block norms take)."""


def mla_softmax_scale(qk_head_dim: int, rope_scaling: dict[str, Any] | None = None) -> float:
    """DeepSeek's softmax scale: ``qk_head_dim ** -0.5``, times YaRN's ``mscale`` squared
    when ``rope_scaling`` (a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict)
    is a YaRN one with ``mscale_all_dim`` (``0.1 * mscale_all_dim * ln(factor) + 1``,
    for ``factor > 1``): transformers' ``yarn_apply_mscale``. Give it as
    ``GPTConfig.attention_scale``."""
    scale = qk_head_dim ** -0.5
    rope = rope_scaling or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    all_dim = rope.get("mscale_all_dim", 0)
    if kind != "default" and all_dim:
        mscale = yarn_mscale(rope["factor"], all_dim)
        scale = scale * mscale * mscale
    return scale


def deinterleave_rope(kernel: np.ndarray, width: int, rope: int) -> np.ndarray:
    """The columns of ``kernel [in, groups * width]`` with each group's last ``rope``
    features taken from DeepSeek's interleaved rotary pairs to the rotate-half order
    (even features, then odd ones): Hugging Face's ``rope_interleave=True`` weights
    (``q_b_proj`` / ``q_proj``: ``width = n + p`` per head; ``kv_a_proj_with_mqa``:
    one group, ``width = r + p``) for this module."""
    kernel = np.asarray(kernel)
    groups = kernel.shape[1] // width
    perm = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)]) + width - rope
    order = np.arange(kernel.shape[1]).reshape(groups, width).copy()
    order[:, width - rope:] = order[:, perm]
    return kernel[:, order.reshape(-1)]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LatentCache(AttentionCache):
    """The cache of :class:`MultiHeadLatentAttention`: per token the normalised latent
    ``latent [layers, batch, length, kv_lora_rank]`` and the rotated rotary key
    ``k_rope [layers, batch, length, qk_rope_head_dim]`` (not per-head keys and values:
    ``kv_lora_rank + qk_rope_head_dim`` values a token and layer), each sharded
    ``P(None, data, context, None)``: the batch over the data axes, the length over the
    context axes, whole over the tensor axis (every tensor shard up-projects its own
    heads from it). ``prompt``: the padded prompt width of the prefill (static)."""

    latent: jax.Array
    k_rope: jax.Array
    prompt: int = dataclasses.field(default=0, metadata=dict(static=True))

    @classmethod
    def entry_specs(cls, layout: Layout) -> dict[str, P]:
        """``latent`` and ``k_rope`` of one layer, ``[batch, length, features]``:
        ``P(data, context, None)``."""
        spec = layout.spec("activation_batch", "activation_length", None)
        return {"latent": spec, "k_rope": spec}


class LatentProjection(nnx.Module):
    """MLA's projections before attention, sequence-parallel, with ONE all-gather of the
    input: the down projections ``q_a_kernel [hidden, q_lora_rank]`` (or, without
    ``q_lora_rank``, ``q_kernel [hidden, heads * (n + p)]`` split by columns over the
    tensor axis) and ``kv_a_kernel [hidden, r + p]`` (replicated over the tensor axis:
    every shard needs the whole latent) are concatenated per device into one kernel and
    applied by :func:`sp_jax.ops.column_sequence_parallel_matmul` (every option of the
    parallel config; their gradients summed over the tensor shards by the
    ``shard_map``); then per device the norms ``q_a_norm [q_lora_rank]`` and
    ``kv_a_norm [r]`` (RMSNorm, fp32, replicated) and the query up projection
    ``q_b_kernel [q_lora_rank, heads * (n + p)]`` (columns ``(head, n + p)``, split
    over the tensor axis). It also holds ``kv_b_kernel [r, heads * (n + d_v)]`` (columns
    ``(head, [k_nope | v])``, split over the tensor axis), which the attention applies
    to the latent (:class:`MultiHeadLatentAttention`; the latent ring up-projects each
    received chunk with it).

    Shapes: input ``[b, s, hidden]`` ``P(data, tensor, None)`` (the SP layout); output
    ``[b, s, t * width]`` ``P(data, context, tensor)`` where shard ``i``'s ``width =
    heads / t * (n + p) + r + p`` columns are its heads' queries (before the rotary
    angles), then the normalised latent and the rotary key (the same on every shard).
    The up projections compute in the compute dtype without FP8 and, with fsdp, are not
    split over the data axes.
    """

    def __init__(self, config: AttentionConfig, *, parallel: ParallelConfig = ParallelConfig(),
                 rngs: nnx.Rngs):
        self.config, self.parallel = config, parallel
        cfg = config
        mesh = current_mesh(parallel, where="LatentProjection", required=False)
        layout, eager, dtype = Layout.of(parallel), mesh is not None, cfg.param_dtype
        init = nnx.initializers.lecun_normal()
        specs = self.param_specs(layout)
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim

        def param(name, shape, value=None):
            value = init(rngs.params(), shape, dtype) if value is None else value
            return nnx.Param(value, out_sharding=tuple(specs[name]), eager_sharding=eager)

        heads, lora = cfg.num_heads, cfg.q_lora_rank
        self.q_kernel = nnx.data(None if lora is not None
                                 else param("q_kernel", (cfg.hidden, heads * qk)))
        self.q_a_kernel = nnx.data(None if lora is None
                                   else param("q_a_kernel", (cfg.hidden, lora)))
        self.q_a_norm = nnx.data(None if lora is None else param(
            "q_a_norm", (lora,), jnp.ones((lora,), dtype)))
        self.q_b_kernel = nnx.data(None if lora is None
                                   else param("q_b_kernel", (lora, heads * qk)))
        self.kv_a_kernel = param("kv_a_kernel", (cfg.hidden, cfg.kv_lora_rank
                                                 + cfg.qk_rope_head_dim))
        self.kv_a_norm = param("kv_a_norm", (cfg.kv_lora_rank,),
                               jnp.ones((cfg.kv_lora_rank,), dtype))
        self.kv_b_kernel = param("kv_b_kernel", (cfg.kv_lora_rank,
                                                 heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)))
        # In the compute dtype, not FP8, as the up projections: the latent's output
        # gradient arrives on each device as its heads' part of a sum (kv_b and q_b are
        # split over the tensor axis by heads), and FP8 would quantise those parts, where
        # the unsharded model quantises their sum (measured: the combination harness's
        # tensor_sequence + FP8 + MLA gradients off by up to 0.015 against FP8's bound)
        self.gemm = layer_gemm("LatentProjection", None, None, parallel, eager=eager)
        self.fp8_history = self.gemm.state

    def param_specs(self, layout: Layout, mesh: Mesh | None = None) -> dict[str, P]:
        """The spec of each parameter by name in ``layout`` (training's, or
        :func:`~sp_jax.layers.linear.decode_layout`)."""
        heads = layout.spec(None, "mlp")
        return {"q_kernel": layout.column_kernel, "q_a_kernel": layout.spec("embed", None),
                "kv_a_kernel": layout.spec("embed", None), "q_a_norm": P(None),
                "kv_a_norm": P(None), "q_b_kernel": heads, "kv_b_kernel": heads}

    def _params(self, layout: Layout) -> tuple[tuple[jax.Array | None, P], ...]:
        specs = self.param_specs(layout)
        return tuple((None if v is None else v[...], specs[name]) for name, v in (
            ("q_kernel", self.q_kernel), ("q_a_kernel", self.q_a_kernel),
            ("kv_a_kernel", self.kv_a_kernel), ("q_a_norm", self.q_a_norm),
            ("kv_a_norm", self.kv_a_norm), ("q_b_kernel", self.q_b_kernel)))

    def parts(self, down: jax.Array, q_a_norm: jax.Array | None, kv_a_norm: jax.Array,
              q_b_kernel: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per device: the down projections' output ``[b, s, q_width + r + p]`` ->
        ``(q [b, s, heads / t * (n + p)], latent [b, s, r], k_rope [b, s, p])``: this
        shard's queries, the normalised latent, the rotary key (no rotary angles)."""
        cfg = self.config
        q, kv = jnp.split(down, [down.shape[-1] - cfg.kv_lora_rank - cfg.qk_rope_head_dim],
                          axis=-1)
        q = self.query_part(q, q_a_norm, q_b_kernel)
        return (q, *self.latent_part(kv, kv_a_norm, q.dtype))

    def query_part(self, q: jax.Array, q_a_norm: jax.Array | None,
                   q_b_kernel: jax.Array | None) -> jax.Array:
        """Per device: the query's down projection ``[b, s, q_lora_rank]`` (or, without
        ``q_lora_rank``, already this shard's queries) -> this shard's queries."""
        if q_b_kernel is not None:
            q = head_rms_norm(q, q_a_norm, LATENT_NORM_EPSILON)
            q = jnp.einsum("bsr,rc->bsc", q, q_b_kernel.astype(q.dtype))
        return q

    def latent_part(self, kv: jax.Array, kv_a_norm: jax.Array, dtype: Any
                    ) -> tuple[jax.Array, jax.Array]:
        """Per device: ``kv_a``'s output ``[b, s, r + p]`` -> the normalised latent and the
        rotary key (in ``dtype``)."""
        latent, k_rope = jnp.split(kv, [self.config.kv_lora_rank], axis=-1)
        return head_rms_norm(latent, kv_a_norm, LATENT_NORM_EPSILON), k_rope.astype(dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x``: ``[batch, seq, hidden]`` in the SP layout -> the per-shard columns
        above, ``P(data, context, tensor)``."""
        par, cfg = self.parallel, self.config
        x = jnp.asarray(x)
        check_activations("LatentProjection", x, cfg.hidden, "hidden")
        layout = Layout.of(par)
        dtype = cfg.dtype if cfg.dtype is not None else jnp.result_type(
            x.dtype, self.kv_a_kernel[...].dtype)

        def local(x, q_kernel, q_a_kernel, kv_a_kernel, q_a_norm, kv_a_norm, q_b_kernel,
                  **gemm):
            kernel = jnp.concatenate([q_a_kernel if q_kernel is None else q_kernel,
                                      kv_a_kernel], axis=1)
            down = column_sp_matmul(x, kernel, None, par, **gemm)
            return jnp.concatenate(self.parts(down, q_a_norm, kv_a_norm, q_b_kernel), axis=-1)

        return shard_linear(local, x.astype(dtype), layout.sp, layout.tp,
                            self._params(layout), parallel=par, gemm=self.gemm,
                            where="LatentProjection")

    def local_decode(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The single-token (decode) mode per device, inside a ``shard_map`` whose copy of
        this module holds its blocks of the decode layout: :meth:`parts` of whole rows
        ``x [b, 1, hidden]`` (no collective; the latent and rotary key from the
        replicated ``kv_a_kernel``, alike on every tensor shard), compute dtype."""
        cfg = self.config
        value = {name: None if v is None else v[...] for name, v in (
            ("q_kernel", self.q_kernel), ("q_a_kernel", self.q_a_kernel),
            ("q_a_norm", self.q_a_norm), ("q_b_kernel", self.q_b_kernel))}
        q_kernel = value["q_a_kernel"] if value["q_kernel"] is None else value["q_kernel"]
        dtype = cfg.dtype if cfg.dtype is not None else jnp.result_type(x.dtype,
                                                                         q_kernel.dtype)
        x = x.astype(dtype)
        # two products, kept apart: the latent's stays invariant over the tensor axis (the
        # cache's entries are whole over it); a concatenation with the queries (split
        # over the tensor axis without q_lora_rank) would make it vary
        q = self.query_part(ops.decode_matmul(x, q_kernel, None), value["q_a_norm"],
                            value["q_b_kernel"])
        return (q, *self.latent_part(ops.decode_matmul(x, self.kv_a_kernel[...], None),
                                     self.kv_a_norm[...], q.dtype))


class MultiHeadLatentAttention(CausalSelfAttention):
    """Pre-LN multi-head latent attention (DeepSeek-V3's MLA, module docstring) with a
    residual, tensor- and sequence-parallel: ``x + dropout(out(attention(qkv(norm(x)))))``
    with ``qkv`` a :class:`LatentProjection` (one all-gather of the normed input; this
    tensor shard's heads), ``out`` a :class:`~sp_jax.layers.RowSequenceParallelLinear`
    ``[heads * v_head_dim, hidden]``.

    Attention per device: the latent up-projected for this shard's heads (``kv_b``) into
    ``k_nope``, ``v``; the keys ``[k_nope | rotary key]``; over the full sequence
    (:func:`~sp_jax.attention.blockwise_attention`) or across the context axis
    (``parallel.context_parallel``): Ulysses (heads exchanged,
    :func:`~sp_jax.attention.ulysses_attention`), or the ring
    (:func:`~sp_jax.attention.ring_attention`). Packed documents, sliding windows,
    attention dropout and the post-norm as :class:`~sp_jax.layers.CausalSelfAttention`.

    Generation keeps a :class:`LatentCache` (the normalised latent and the rotated
    rotary key per token) and decodes "absorbed": the key up projection folded into the
    query (``q_nope W_UK^T``: ``r`` features a head), attention over the latent as one
    shared key/value head, the value up projection applied to the output
    (:meth:`decode_step`).

    Args: as :class:`~sp_jax.layers.CausalSelfAttention` (``config.attention == "mla"``
    with its :data:`~sp_jax.layers.block_config.MLA_FIELDS`; no ``qkv_bias``, no
    ``qk_norm``).
    """

    cache_type = LatentCache

    def __init__(self, config: AttentionConfig, *, parallel: ParallelConfig = ParallelConfig(),
                 rngs: nnx.Rngs, window: int | None = None):
        if isinstance(config, AttentionConfig) and (config.qkv_bias or config.qk_norm):
            raise ValueError("MultiHeadLatentAttention: qkv_bias and qk_norm are not part of "
                             "multi-head latent attention; set them False.")
        super().__init__(config, parallel=parallel, rngs=rngs, window=window)

    def projections(self, rngs: nnx.Rngs) -> tuple[nnx.Module, nnx.Module]:
        """``qkv``: the :class:`LatentProjection`; ``out``: the row layer from ``heads x
        v_head_dim``."""
        cfg = self.config
        out = RowSequenceParallelLinear(cfg.num_heads * cfg.v_head_dim, cfg.hidden,
                                        use_bias=cfg.out_bias, fp8=cfg.fp8,
                                        parallel=self.parallel, dtype=cfg.dtype,
                                        param_dtype=cfg.param_dtype, rngs=rngs)
        return LatentProjection(cfg, parallel=self.parallel, rngs=rngs), out

    def _check_heads(self, mesh: Mesh) -> None:
        cfg, par = self.config, self.parallel
        check_divisible("MultiHeadLatentAttention", "num_heads", cfg.num_heads, mesh,
                        par.tensor_axis,
                        "choose a head count that is a multiple of the tensor-parallel size")
        if par.context_parallel == "ulysses":
            check_divisible(
                "MultiHeadLatentAttention (ulysses)", "num_heads", cfg.num_heads, mesh,
                (par.tensor_axis, par.context_axis),
                "Ulysses gives each context device whole heads: choose num_heads a multiple "
                "of tensor x context, or context_parallel='ring'")

    @property
    def qk_head_dim(self) -> int:
        """Features of each query / key head: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.config.qk_nope_head_dim + self.config.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``attention_scale``, or DeepSeek's (:func:`mla_softmax_scale`):
        ``qk_head_dim ** -0.5``, times ``m(mscale_all_dim) ** 2`` with a YaRN
        ``rope_scaling`` that has ``mscale_all_dim``."""
        scale, yarn = self.config.attention_scale, self.config.rope_scaling
        if scale is not None:
            return scale
        if isinstance(yarn, YarnScaling) and yarn.mscale_all_dim:
            return mla_softmax_scale(self.qk_head_dim, {
                "rope_type": "yarn", "factor": yarn.factor,
                "mscale_all_dim": yarn.mscale_all_dim})
        return self.qk_head_dim ** -0.5

    @property
    def rope_dim(self) -> int:
        """The rotary features of each head: ``qk_rope_head_dim``."""
        return self.config.qk_rope_head_dim

    def attention_params(self) -> tuple[tuple[jax.Array, P], ...]:
        """``kv_b_kernel``, split by columns (heads) over the tensor axis."""
        spec = self.qkv.param_specs(Layout.of(self.parallel))["kv_b_kernel"]
        return ((self.qkv.kv_b_kernel[...], spec),)

    def kept_specs(self, layout: Layout) -> tuple[P, ...]:
        """The latent and rotary key ``[b, s, t, features]`` (each tensor shard's copy):
        ``layout.heads(4)``; :meth:`prefill` keeps shard 0's."""
        return (layout.heads(4),) * 2

    def split_latent(self, parts: tuple[jax.Array, jax.Array, jax.Array],
                     positions: jax.Array | None, window: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per device: :meth:`LatentProjection.parts` -> ``q [b, s, heads / t, n + p]``,
        ``latent [b, s, r]``, ``k_rope [b, s, p]``, the rotary angles of ``positions``
        (``[s]`` or ``[b, s]``) applied to q's last ``p`` features and to ``k_rope``."""
        cfg = self.config
        q, latent, k_rope = parts
        b, s, _ = q.shape
        q = q.reshape(b, s, -1, self.qk_head_dim)
        if cfg.rotary:
            freqs = self.rotary_frequencies(window)
            factor = rope_attention_factor(cfg.rope_scaling)  # YaRN's, else 1
            q_rope = rotary_embedding(q[..., cfg.qk_nope_head_dim:], positions,
                                      frequencies=freqs, attention_factor=factor)
            q = jnp.concatenate([q[..., :cfg.qk_nope_head_dim], q_rope], axis=-1)
            k_rope = rotary_embedding(k_rope[:, :, None], positions, frequencies=freqs,
                                      attention_factor=factor)[:, :, 0]
        return q, latent, k_rope

    def _attend(self, qkv: jax.Array, order: np.ndarray | None,
                segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                seed: jax.Array | None = None, rows: jax.Array | None = None, *,
                keep_kv: bool = False, params: tuple[jax.Array, ...] = (),
                window: jax.Array | None = None) -> Any:
        """Per device: :class:`LatentProjection`'s columns ``[b, s_local, width]`` ->
        ``[b, s_local, heads / t * d_v]`` (with ``keep_kv``, also the normalised latent
        and the rotated rotary key ``[b, s_local, 1, r]`` / ``[..., p]``); ``params``:
        ``(kv_b_kernel,)``, this shard's block; the rest as the base class's."""
        b, s, _ = qkv.shape
        (kv_b,) = params
        r, p = self.config.kv_lora_rank, self.config.qk_rope_head_dim
        parts = jnp.split(qkv, [qkv.shape[-1] - r - p, qkv.shape[-1] - p], axis=-1)
        q, latent, k_rope = self.split_latent(parts, self.held_positions(order, s, positions),
                                              window)
        heads = q.shape[2]
        blocks = self.kernel_arguments(heads, b, segment_ids, seed, rows, window)
        if self.parallel.context_parallel == "ring":  # the latent travels, not k and v
            out = latent_ring_attention(q, latent, k_rope, kv_b,
                                        axis_name=self.parallel.context_axis, **blocks)
        else:  # this shard's heads' keys and values
            k, v = expand_latent(latent, k_rope, kv_b, self.config.qk_nope_head_dim, heads)
            out = self.run_kernel(q, k, v, blocks)
        out = out.reshape(b, s, heads * out.shape[-1])
        return (out, latent[:, :, None], k_rope[:, :, None]) if keep_kv else out

    def prefill(self, x: jax.Array) -> tuple[jax.Array, LatentCache]:
        """The training forward without dropout or documents, keeping the latent and
        the rotated rotary key of every token: ``x [batch, seq, hidden]`` (SP layout) ->
        ``(x + attention, LatentCache(latent, k_rope))`` in
        :meth:`LatentCache.entry_specs` (the sequence in the held order)."""
        y, (latent, k_rope) = self(x, keep_kv=True)
        specs = LatentCache.entry_specs(Layout.of(self.parallel))
        mesh = current_mesh(self.parallel, where="MultiHeadLatentAttention")
        whole = Layout.of(self.parallel).spec("activation_batch", "activation_length", None,
                                              None)  # every shard's copy, then shard 0's
        return y, LatentCache(*(reshard(reshard(a, whole, mesh)[:, :, 0], spec, mesh)
                                for a, spec in ((latent, specs["latent"]),
                                                (k_rope, specs["k_rope"]))))

    def decode_step(self, x: jax.Array, cache: LatentCache, positions: jax.Array,
                    cache_positions: jax.Array | None = None
                    ) -> tuple[jax.Array, LatentCache]:
        """The single-token mode per device (the decode layout, inside the decode
        ``shard_map``), absorbed: ``q_nope`` of this shard's heads times ``W_UK^T``
        (``kv_b``'s key columns) gives ``r``-wide latent queries; with the rotary part
        they attend to the cache as one shared key/value head (keys ``[latent |
        k_rope]``, values the latent:
        :func:`~sp_jax.attention.cached_attention`'s ``rope`` part, merged over the
        context axis); the ``r``-wide outputs times ``W_UV`` give ``heads / t x d_v``,
        then the output projection (one all-reduce over the tensor axis). With
        ``config.mla_absorb=False``: the cached latent (and this token's) up-projected
        by ``kv_b`` into this shard's heads' keys ``[b, length, heads / t, n + p]`` and
        values ``[b, length, heads / t, d_v]`` every step, then multi-head
        :func:`~sp_jax.attention.cached_attention` (the same numbers; the cache stays
        the latent).

        Args:
          x: ``[b, 1, hidden]`` whole rows; cache: this layer's :class:`LatentCache`,
            this shard's part (``[b, length, r]`` / ``[b, length, p]``); positions:
            int ``[b]``; cache_positions: int ``[length]`` or None (as the base class's).
        Returns:
          ``(x + attention [b, 1, hidden], LatentCache)`` with this token's ``[b, 1,
          r]`` latent and ``[b, 1, p]`` rotated rotary key.
        """
        cfg = self.config
        n = cfg.qk_nope_head_dim
        layer_window = None if self.window is None else self.window[...]
        q, latent, k_rope = self.split_latent(self.qkv.local_decode(self.norm.local(x)),
                                              token_positions(positions, x.shape[1]),
                                              layer_window)
        b, steps, heads, _ = q.shape
        window = cfg.sliding_window if layer_window is None else layer_window
        attend = dict(cache_positions=cache_positions,
                      axis_name=self.parallel.context_axes or None,
                      scale=self.softmax_scale, softcap=cfg.attention_softcap)
        if not cfg.mla_absorb:  # the cache up-projected into this shard's heads' k, v
            kv_b = self.qkv.kv_b_kernel[...]
            k, v = expand_latent(latent, k_rope, kv_b, n, heads)
            k_cache, v_cache = expand_latent(cache.latent.astype(q.dtype),
                                             cache.k_rope.astype(q.dtype), kv_b, n, heads)
            o = cached_attention(q, k, v, k_cache, v_cache, positions, window, **attend)
            return self._decode_out(x, o), LatentCache(latent, k_rope)
        kv_b = self.qkv.kv_b_kernel[...].astype(q.dtype).reshape(cfg.kv_lora_rank, heads,
                                                                  n + cfg.v_head_dim)
        q_latent = jnp.einsum("bshn,rhn->bshr", q[..., :n], kv_b[..., :n])
        o = cached_attention(q_latent, latent[:, :, None], latent[:, :, None],
                             cache.latent[:, :, None], cache.latent[:, :, None], positions,
                             window, **attend,
                             rope=(q[..., n:], k_rope[:, :, None], cache.k_rope[:, :, None]))
        o = jnp.einsum("bshr,rhv->bshv", o.reshape(b, steps, heads, cfg.kv_lora_rank),
                       kv_b[..., n:]).reshape(b, steps, heads * cfg.v_head_dim)
        return self._decode_out(x, o), LatentCache(latent, k_rope)

    def _decode_out(self, x: jax.Array, o: jax.Array) -> jax.Array:
        """``x + out(o)`` (the post-norm between), per device: ``o [b, 1, heads / t x
        d_v]``."""
        y = self.out.local_decode(o)
        if self.post_norm is not None:
            y = self.post_norm.local(y)
        return x.astype(y.dtype) + y


register_attention("mla", MultiHeadLatentAttention)


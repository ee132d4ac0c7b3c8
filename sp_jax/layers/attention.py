"""Pre-LN causal self-attention in the TP+SP layout (Flax NNX) on global arrays: the
``"mha"`` attention of the registry (:mod:`sp_jax.layers.attention_registry`) and its
cache type, :class:`KVCache`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from sp_jax.attention import (
    AttentionDropout,
    blockwise_attention,
    cached_attention,
    local_positions,
    ring_attention,
    sequence_order,
    ulysses_attention,
)
from sp_jax.compat import check_mode
from sp_jax.config import ParallelConfig, check_layer_args
from sp_jax.layers.attention_registry import (
    AttentionCache,
    register_attention,
    token_positions,
)
from sp_jax.layers.block_config import AttentionConfig, check_block_config, kv_heads_per_shard
from sp_jax.layers.dropout import Dropout
from sp_jax.layers.linear import ColumnSequenceParallelLinear, RowSequenceParallelLinear
from sp_jax.layers.lora import LoRAParts
from sp_jax.layers.norm import make_norm
from sp_jax.layers.qkv import GroupedQKVProjection
from sp_jax.layers.rotary import rope_attention_factor, rope_frequencies, rotary_embedding
from sp_jax.layout import Layout
from sp_jax.mesh import (
    Mesh,
    axis_size,
    check_activations,
    check_divisible,
    current_mesh,
    reshard,
)

__all__ = ["FULL_WINDOW", "CausalSelfAttention", "KVCache", "LayerWindow", "head_rms_norm"]

FULL_WINDOW = 2 ** 30
"""The window a full-attention layer holds under ``GPTConfig.layer_windows``: more keys
than any sequence has (causal attention; the kernels' loop bounds stay in int32)."""


class LayerWindow(nnx.Variable):
    """A layer's sliding window as data (int32 scalar; :data:`FULL_WINDOW`: full causal
    attention): stacked and scanned with the layer's parameters, never trained."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache(AttentionCache):
    """The cache of :class:`CausalSelfAttention`: every layer's keys and values (rotary
    angles applied), ``k [layers, batch, length, t * kv_local, head_dim]`` and ``v
    [layers, batch, length, t * kv_local, v_head_dim]`` (``v_head_dim``: ``head_dim``
    here; a variant may make the values wider or narrower), each sharded ``P(None, data,
    context, tensor, None)``: the batch over the data axes, the length over the context
    axes (:meth:`~sp_jax.layers.AttentionCache.slots`), the key/value heads as training
    holds them (split over the tensor axis when its size divides them, else the one each
    shard's query heads read; :func:`~sp_jax.layers.kv_heads_per_shard`). ``prompt``:
    the padded prompt width of the prefill (static)."""

    k: jax.Array
    v: jax.Array
    prompt: int = dataclasses.field(default=0, metadata=dict(static=True))

    @classmethod
    def entry_specs(cls, layout: Layout) -> dict[str, P]:
        """``k`` and ``v`` of one layer, ``[batch, length, heads, head_dim]``:
        ``layout.heads(4)``, ``P(data, context, tensor, None)``."""
        heads = layout.heads(4)
        return {"k": heads, "v": heads}


def head_rms_norm(x: jax.Array, scale: jax.Array, epsilon: float,
                   offset: float = 0.0) -> jax.Array:
    """RMSNorm of each head ``x [..., head_dim]`` over ``head_dim`` in fp32, times
    ``scale [head_dim]`` (Qwen3's q/k norm; with ``offset``, times ``offset + scale``:
    Gemma 3's ``1 + weight``), in ``x``'s dtype. The same forward as
    :func:`~sp_jax.layers.rms_norm` (bitwise), differentiated by JAX: inside the attention's
    ``shard_map`` the scale is replicated, and ``rms_norm``'s custom VJP returns its
    gradient varying over the manual axes, which JAX refuses (measured)."""
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(jnp.square(xf), axis=-1, keepdims=True) + epsilon)
    factor = scale.astype(jnp.float32)
    if offset:
        factor = jnp.float32(offset) + factor
    return (y * factor).astype(x.dtype)


class CausalSelfAttention(nnx.Module):
    """Pre-LN causal self-attention with a residual, tensor- and sequence-parallel.

    ``x + dropout(out(attention(qkv(norm(x)))))`` where

    - ``qkv`` is ONE :class:`~sp_jax.layers.ColumnSequenceParallelLinear` ``[hidden, 3 *
      heads * head_dim]`` (``head_dim``: ``hidden / heads`` unless given), so the normed
      input is all-gathered once per block. Its output columns are laid out per head,
      ``(head, {q, k, v}, head_dim)``, so the column block of tensor shard ``i`` holds
      the q, k and v of heads ``i * heads / t ...`` and attention needs no
      communication;
    - with ``num_kv_heads < num_heads`` (grouped-query / multi-query attention) the
      projection is a :class:`~sp_jax.layers.GroupedQKVProjection` instead
      (``q_kernel`` and ``kv_kernel``, still one all-gather): kv heads are split over the
      tensor axis when its size divides them, and replicated when it is a multiple of
      them;
    - attention runs over the full sequence on each device's heads
      (:func:`sp_jax.attention.blockwise_attention`), or, with context parallelism
      (``parallel.context_parallel``), across the context axis:
      :func:`sp_jax.attention.ring_attention` on the zigzag-ordered sequence, or
      :func:`sp_jax.attention.ulysses_attention`; rotary positions follow each device's
      tokens;
    - ``out`` is a :class:`~sp_jax.layers.RowSequenceParallelLinear` ``[heads * head_dim,
      hidden]`` back to the SP layout;
    - with ``post_norms``, ``post_norm`` (a second norm, Gemma's
      ``post_attention_layernorm``) normalises ``out``'s output per token before the
      dropout and the residual add. Every norm scales by ``norm_offset + weight``.

    Args:
      config: the block's :class:`~sp_jax.layers.AttentionConfig`.
      parallel: the :class:`~sp_jax.ParallelConfig`.
      window: with ``config.window_per_layer``, this layer's sliding window (None: full
        causal attention), held as a :class:`LayerWindow` (``self.window``).
      rngs: ``params`` rng stream. Dropout draws from the ``rngs`` passed to each call
        (e.g. ``nnx.Rngs(dropout=key)``) in train mode; the attention dropout's key is
        drawn before the output dropout's.

    The ``"mha"`` attention of :func:`~sp_jax.layers.register_attention`
    (:class:`~sp_jax.layers.Attention`): :meth:`__call__` trains, :meth:`prefill` and
    :meth:`decode_step` generate, with its cache type :class:`KVCache`. A variant that
    only changes the projections' widths and column layout (e.g. another value head
    size) subclasses it and overrides :meth:`projections` and :meth:`heads_of`.
    """

    cache_type = KVCache

    def __init__(self, config: AttentionConfig, *, parallel: ParallelConfig = ParallelConfig(),
                 rngs: nnx.Rngs, window: int | None = None):
        check_block_config("CausalSelfAttention", config, AttentionConfig,
                           "sp_jax.AttentionConfig", "attention_config")
        check_layer_args("CausalSelfAttention", parallel)
        check_mode(None, config=config, parallel=parallel, where="CausalSelfAttention")
        self.config, self.parallel = config, parallel
        if config.window_per_layer and config.sliding_window is not None:
            raise ValueError(f"CausalSelfAttention: window_per_layer with sliding_window="
                             f"{config.sliding_window}; pass the layer's window= instead.")
        # window_per_layer: this layer's window as data (GPTConfig.layer_windows)
        self.window = LayerWindow(jnp.int32(FULL_WINDOW if window is None else window)) \
            if config.window_per_layer else None
        mesh = current_mesh(parallel, where="CausalSelfAttention", required=False)
        if mesh is not None:
            self._check_heads(mesh)
        common = dict(parallel=parallel, dtype=config.dtype, param_dtype=config.param_dtype,
                      rngs=rngs)
        self.norm = make_norm(config.norm, config.hidden, epsilon=config.norm_epsilon,
                              norm_offset=config.norm_offset, **common)
        self.qkv, self.out = self.projections(rngs)
        self.q_norm: nnx.Param | None
        self.k_norm: nnx.Param | None
        if config.qk_norm:  # Qwen3: one RMSNorm scale [head_dim] each for q and k, replicated
            one = 1.0 - config.norm_offset  # a factor of 1 to start with
            self.q_norm = nnx.Param(jnp.full((config.head_dim,), one, config.param_dtype))
            self.k_norm = nnx.Param(jnp.full((config.head_dim,), one, config.param_dtype))
        else:
            self.q_norm = self.k_norm = None
        self.dropout = Dropout(config.dropout, parallel=parallel)  # rngs come with each call
        # holds the rate and the train/eval mode of the attention-probability dropout
        self.attention_dropout = Dropout(config.attention_dropout, parallel=parallel)
        # Gemma's post_attention_layernorm: the output projection's output normed
        self.post_norm = make_norm(config.norm, config.hidden, epsilon=config.norm_epsilon,
                                   norm_offset=config.norm_offset, **common) \
            if config.post_norms else None

    def projections(self, rngs: nnx.Rngs) -> tuple[nnx.Module, nnx.Module]:
        """The q/k/v projection (``qkv``: a column layer, SP layout in, ``P(data, None,
        tensor)`` out, each tensor shard's columns those of its heads) and the output
        projection (``out``: a row layer back to the SP layout), built from
        ``self.config`` and ``self.parallel`` with ``rngs``' ``params`` draws. A variant
        with other widths (e.g. another value head size) overrides this and
        :meth:`heads_of`."""
        config, parallel = self.config, self.parallel
        common = dict(parallel=parallel, dtype=config.dtype, param_dtype=config.param_dtype,
                      rngs=rngs)
        if config.num_kv_heads == config.num_heads:  # columns (head, {q, k, v}, head_dim)
            qkv: nnx.Module = ColumnSequenceParallelLinear(
                config.hidden, 3 * config.attention_width, use_bias=config.qkv_bias,
                fp8=config.fp8, lora=config.lora,
                lora_parts=LoRAParts(("q", "k", "v"), config.head_dim), **common)
        else:
            qkv = GroupedQKVProjection(config, parallel=parallel, rngs=rngs)
        out = RowSequenceParallelLinear(config.attention_width, config.hidden,
                                        use_bias=config.out_bias, fp8=config.fp8,
                                        lora=config.lora, lora_parts=LoRAParts(("o",)),
                                        **common)
        return qkv, out

    def _check_heads(self, mesh: Mesh) -> None:
        cfg, par = self.config, self.parallel
        check_divisible("CausalSelfAttention", "num_heads", cfg.num_heads, mesh,
                        par.tensor_axis,
                        "choose a head count that is a multiple of the tensor-parallel size")
        t = axis_size(mesh, par.tensor_axis)
        kv_local = kv_heads_per_shard(cfg.num_kv_heads, t, "CausalSelfAttention")
        if par.context_parallel == "ulysses":
            check_divisible(
                "CausalSelfAttention (ulysses)", "num_heads", cfg.num_heads, mesh,
                (par.tensor_axis, par.context_axis),
                "Ulysses gives each context device whole heads: choose num_heads a multiple "
                "of tensor x context, or context_parallel='ring'")
            check_divisible(
                "CausalSelfAttention (ulysses)", "key/value heads per tensor shard",
                kv_local, mesh, par.context_axis,
                "Ulysses gives each context device whole query groups with their key/value "
                "heads: choose num_kv_heads a multiple of tensor x context, or "
                "context_parallel='ring'")

    def _attend(self, qkv: jax.Array, order: np.ndarray | None,
                segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
                seed: jax.Array | None = None, rows: jax.Array | None = None, *,
                keep_kv: bool = False, params: tuple[jax.Array, ...] = (),
                window: jax.Array | None = None) -> Any:
        """Per device: ``[b, s_local, 3 * heads * head_dim / t]`` (local heads, this
        device's part of the sequence) -> ``[b, s_local, heads * v_head_dim / t]`` (with
        ``keep_kv``, also this device's rotated ``k`` and ``v`` ``[b, s_local, kv_local,
        head_dim]``: a KV cache's prefill); ``segment_ids`` / ``positions``:
        this device's ``[b, s_local]`` document ids and token positions (or None);
        ``seed``: the attention dropout's; ``rows``: the global index of this device's
        first batch row when the data axes are manual outside
        (``ParallelConfig.manual_data_axes``); ``params``: :meth:`attention_params`'
        values (here :meth:`qk_scales`'); ``window``: this layer's window (int32 scalar,
        ``window_per_layer``) or None."""
        b, s, _ = qkv.shape
        positions = self.held_positions(order, s, positions)
        q, k, v = self.split_heads(qkv, positions, params, window)
        heads = q.shape[2]
        blocks = self.kernel_arguments(heads, b, segment_ids, seed, rows, window)
        out = self.run_kernel(q, k, v, blocks)
        out = out.reshape(b, s, heads * out.shape[-1])  # the values' head size
        return (out, k, v) if keep_kv else out

    def held_positions(self, order: np.ndarray | None, s: int,
                       positions: jax.Array | None) -> jax.Array | None:
        """Per device: the rotary positions of this device's ``s`` tokens: ``positions``
        when given (packed documents), else those of the held order (None without
        rotary)."""
        if self.config.rotary and positions is None:
            return local_positions(self.parallel, order, s)
        return positions

    def kernel_arguments(self, heads: int, b: int, segment_ids: jax.Array | None,
                         seed: jax.Array | None, rows: jax.Array | None,
                         window: jax.Array | None) -> dict[str, Any]:
        """Per device: the attention kernels' keyword arguments (blocks, documents,
        window, :attr:`softmax_scale`, soft cap, offload, and the dropout of ``seed``
        with this device's first global row and head; ``heads`` this device's query
        heads, ``b`` its rows)."""
        cfg, par = self.config, self.parallel
        blocks: dict[str, Any] = dict(block_q=cfg.attention_block_q,
                                      block_k=cfg.attention_block_k, segment_ids=segment_ids,
                                      sliding_window=cfg.sliding_window if window is None
                                      else window, scale=self.softmax_scale,
                                      softcap=cfg.attention_softcap,
                                      offload_residuals=par.offload_activations)
        if seed is not None:  # global coordinates of this device's first row and head
            # rows: the manual data axes' offset, taken outside (a pipeline's stages); the
            # batch's other axes (an expert axis there) split the rows here too
            inner = tuple(a for a in par.data_axes if a not in par.manual_data_axes)
            inner_rows = lax.axis_index(inner) * b if inner else 0
            rows = inner_rows if rows is None else rows + inner_rows
            blocks["dropout"] = AttentionDropout(
                seed, cfg.attention_dropout, batch_offset=rows,
                head_offset=lax.axis_index(par.tensor_axis) * heads)
        return blocks

    def run_kernel(self, q: jax.Array, k: jax.Array, v: jax.Array,
                   blocks: dict[str, Any]) -> jax.Array:
        """Per device: the attention kernel of the context-parallel mode (ring, Ulysses
        or none) on ``q [b, s, heads, d]``, ``k [b, s, kv, d]``, ``v [b, s, kv, d_v]``
        with :meth:`kernel_arguments` ``blocks`` -> ``[b, s, heads, d_v]``."""
        cfg, par = self.config, self.parallel
        if par.context_parallel == "ring":
            return ring_attention(q, k, v, axis_name=par.context_axis, **blocks)
        if par.context_parallel == "ulysses":
            return ulysses_attention(q, k, v, axis_name=par.context_axis,
                                     implementation=cfg.attention_implementation, **blocks)
        return blockwise_attention(q, k, v, implementation=cfg.attention_implementation,
                                   **blocks)

    @property
    def softmax_scale(self) -> float | None:
        """The factor of the scores ``q . k`` (``attention_scale``; None: ``head_dim **
        -0.5``)."""
        return self.config.attention_scale

    @property
    def rope_dim(self) -> int:
        """The features of each head the rotary angles turn: the first ``int(head_dim *
        partial_rotary_factor)`` (``head_dim`` by default)."""
        return int(self.config.head_dim * self.config.partial_rotary_factor)

    def rotary(self, x: jax.Array, positions: jax.Array, freqs: jax.Array) -> jax.Array:
        """The rotary angles of ``positions`` on the first :attr:`rope_dim` features of
        each head of ``x [b, s, heads, d]`` (the rest pass through), the rotated ones
        times YaRN's attention factor (:func:`~sp_jax.layers.rotary.rope_attention_factor`
        of ``rope_scaling``; YaRN is refused with ``rope_local_base``)."""
        cfg, r = self.config, self.rope_dim
        factor = rope_attention_factor(cfg.rope_scaling)
        turned = rotary_embedding(x[..., :r], positions, frequencies=freqs,
                                  attention_factor=factor)
        return turned if r == x.shape[-1] else jnp.concatenate([turned, x[..., r:]], axis=-1)

    def attention_params(self) -> tuple[tuple[jax.Array, P], ...]:
        """The parameters the per-device attention (:meth:`_attend`) reads, each with
        its spec for the ``shard_map`` (which cannot close over them): here the q/k norm
        scales (:meth:`qk_scales`, replicated ``P()``)."""
        return tuple((a, P()) for a in self.qk_scales())

    def kept_specs(self, layout: Layout) -> tuple[P, ...]:
        """The specs in which :meth:`_attend` returns its cache entries with
        ``keep_kv`` (here :meth:`KVCache.entry_specs`, in field order)."""
        return tuple(self.cache_type.entry_specs(layout).values())

    def qk_scales(self) -> tuple[jax.Array, ...]:
        """The q/k norm scales ``(q_norm, k_norm)``, ``[head_dim]`` each, with
        ``qk_norm`` (else ``()``): pass them into the ``shard_map`` that calls
        :meth:`split_heads` (``in_specs`` ``P()``: replicated; a ``shard_map`` cannot
        close over them)."""
        if self.q_norm is None or self.k_norm is None:
            return ()
        return (self.q_norm[...], self.k_norm[...])

    def rotary_frequencies(self, window: jax.Array | None = None) -> jax.Array:
        """The rotary frequencies ``[head_dim / 2]`` (fp32) of this layer: of
        ``rope_base`` and ``rope_scaling``, or, with ``rope_local_base``, of that base
        (unscaled) when the layer has a sliding window: chosen statically for
        ``sliding_window``, and by the traced ``window`` (:class:`LayerWindow`'s value,
        ``window_per_layer``) with a ``where`` between the two, so the layers of a scan
        share one program."""
        cfg = self.config
        full = jnp.asarray(rope_frequencies(self.rope_dim, cfg.rope_base, cfg.rope_scaling))
        if cfg.rope_local_base is None:
            return full
        local = jnp.asarray(rope_frequencies(self.rope_dim, cfg.rope_local_base))
        if window is None:
            return full if cfg.sliding_window is None else local
        return jnp.where(window < FULL_WINDOW, local, full)

    def heads_of(self, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per device: the projection's columns ``[b, s, width]`` (this shard's heads) ->
        ``q [b, s, heads / t, head_dim]`` and ``k``, ``v [b, s, kv_local, head_dim]`` as
        :meth:`projections` lays them out (before the q/k norms and the rotary angles;
        a variant with other widths overrides this)."""
        cfg, par = self.config, self.parallel
        b, s, width = qkv.shape
        head_dim = cfg.head_dim
        if cfg.num_kv_heads == cfg.num_heads:  # columns (head, {q, k, v}, head_dim)
            heads = width // (3 * head_dim)
            q, k, v = jnp.unstack(qkv.reshape(b, s, heads, 3, head_dim), axis=3)
        else:  # this shard's query heads, then (kv_head, {k, v}, head_dim)
            heads = cfg.num_heads // lax.axis_size(par.tensor_axis)
            q = qkv[..., :heads * head_dim].reshape(b, s, heads, head_dim)
            k, v = jnp.unstack(qkv[..., heads * head_dim:].reshape(b, s, -1, 2, head_dim),
                               axis=3)
        return q, k, v

    def split_heads(self, qkv: jax.Array, positions: jax.Array | None,
                    qk_scales: tuple[jax.Array, ...] = (), window: jax.Array | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Per device: the projection's columns ``[b, s, width]`` (this shard's heads) ->
        ``q [b, s, heads / t, head_dim]``, ``k [b, s, kv_local, head_dim]`` and ``v [b,
        s, kv_local, v_head_dim]`` (:meth:`heads_of`) with, with ``qk_norm``, each head's
        q and k RMS-normalised by ``qk_scales`` (:meth:`qk_scales`, ``[head_dim]`` each;
        epsilon ``norm_epsilon``), then the rotary angles of ``positions`` (``[s]`` or
        ``[b, s]``; unused without rotary) applied to q and k (:meth:`rotary_frequencies`
        of ``window``, the layer's traced window under ``window_per_layer``): what
        attention needs, in training and in decoding."""
        cfg = self.config
        q, k, v = self.heads_of(qkv)
        if cfg.qk_norm:
            if len(qk_scales) != 2:
                raise ValueError(
                    "CausalSelfAttention.split_heads: qk_norm=True needs qk_scales=(q_norm, "
                    "k_norm): pass self.qk_scales() into the shard_map (in_specs P()).")
            q = head_rms_norm(q, qk_scales[0], cfg.norm_epsilon, cfg.norm_offset)
            k = head_rms_norm(k, qk_scales[1], cfg.norm_epsilon, cfg.norm_offset)
        if cfg.rotary:
            freqs = self.rotary_frequencies(window)
            q, k = self.rotary(q, positions, freqs), self.rotary(k, positions, freqs)
        return q, k, v

    def prefill(self, x: jax.Array) -> tuple[jax.Array, KVCache]:
        """The training forward without dropout or documents, keeping the keys and values
        attention used (a prompt for decoding): ``x [batch, seq, hidden]`` (SP layout) ->
        ``(x + attention, KVCache(k, v))`` with ``k``, ``v`` ``[batch, seq, t * kv_local,
        head_dim]`` in :meth:`KVCache.entry_specs` (``keep_kv``)."""
        y, kept = self(x, keep_kv=True)
        return y, self.cache_type(*kept)

    def decode_step(self, x: jax.Array, cache: KVCache, positions: jax.Array,
                    cache_positions: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
        """The single-token (decode) mode per device, inside a ``shard_map`` whose copy of
        this module holds its blocks of the decode layout
        (:func:`~sp_jax.layers.linear.decode_layout`; :func:`sp_jax.models.decode.
        decode_step`): one token of every row through the same layers as
        :meth:`__call__`, attending to this shard's key/value cache (no dropout).

        Args:
          x: ``[b, 1, hidden]`` whole rows (alike on every tensor shard).
          cache: this layer's :class:`KVCache`, this shard's part: ``k`` / ``v`` ``[b,
            length, kv_local, head_dim]``, its key/value heads of the earlier tokens
            (:func:`~sp_jax.attention.cached_attention`).
          positions: int ``[b]``: each row's position of this token.
          cache_positions: int ``[length]``: the position each entry of this shard's
            cache holds, or None (entry ``j``: position ``j``). With a context axis the
            cache is split over it along the sequence and the parts of the attention
            are merged across it (:func:`~sp_jax.attention.cached_attention`'s
            ``axis_name``: one ``pmax`` and one ``psum`` over the context axis).
        Returns:
          ``(x + attention, KVCache(k, v))``: ``[b, 1, hidden]`` whole rows (the output
          projection's one all-reduce over the tensor axis) and this token's rotated keys
          and values ``[b, 1, kv_local, head_dim]`` for the cache.
        """
        qkv = self.qkv.local_decode(self.norm.local(x))  # this shard's heads, no collective
        layer_window = None if self.window is None else self.window[...]
        q, k, v = self.split_heads(qkv, token_positions(positions, x.shape[1]),
                                   self.qk_scales(), layer_window)
        window = self.config.sliding_window if layer_window is None else layer_window
        o = cached_attention(q, k, v, cache.k, cache.v, positions, window,
                             cache_positions=cache_positions,
                             axis_name=self.parallel.context_axes or None,
                             scale=self.softmax_scale,
                             softcap=self.config.attention_softcap)
        y = self.out.local_decode(o)
        if self.post_norm is not None:
            y = self.post_norm.local(y)
        return x.astype(y.dtype) + y, KVCache(k, v)

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None,
                 rngs: Any = None, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, keep_kv: bool = False) -> Any:
        """``x``: ``[batch, seq, hidden]`` in the SP layout -> same shape and layout.

        ``segment_ids``: int ``[batch, seq]`` document ids of packed rows (0 = padding),
        in the order ``x`` is held, or None: each token attends only to earlier tokens of
        its own document (:func:`~sp_jax.attention.blockwise_attention`).
        ``positions``: int ``[batch, seq]`` token positions (restarting in each document)
        for the rotary angles, or None (the row's global positions). Both are sharded
        like the tokens (``Layout.tokens``) and resharded here.

        ``keep_kv``: also return the keys and values attention used (rotary angles
        applied), ``(out, (k, v))`` with ``k``, ``v`` ``[batch, seq, t * kv_local,
        head_dim]`` in :meth:`KVCache.entry_specs` (``P(data, context, tensor, None)``:
        each tensor shard's ``kv_local`` key/value heads, the split or replicated ones
        of training), in the held order: what :func:`sp_jax.models.generate` keeps as
        its KV cache after the prefill (:meth:`prefill`)."""
        mesh = current_mesh(self.parallel, where="CausalSelfAttention")
        x = jnp.asarray(x)
        check_activations("CausalSelfAttention", x, self.config.hidden, "hidden")
        self._check_heads(mesh)
        order = sequence_order(self.parallel, mesh, x.shape[1])
        tp = Layout.of(self.parallel).tp
        qkv = self.qkv(self.norm(x))  # tp layout: this device's heads, full sequence
        seeds = ()
        if self.attention_dropout.rate and not (
                deterministic if deterministic is not None
                else self.attention_dropout.deterministic):
            if rngs is None:
                raise ValueError(
                    "CausalSelfAttention: attention dropout is active (train mode) but no "
                    "rngs were passed; call with rngs=nnx.Rngs(dropout=key), or model.eval().")
            key = rngs.dropout() if isinstance(rngs, nnx.Rngs) else rngs()
            seeds = (jax.random.bits(key, (2,), jnp.uint32),)
            if self.parallel.manual_data_axes:  # taken here, outside the tensor shard_map
                seeds += (lax.axis_index(self.parallel.manual_data_axes) * x.shape[0],)
        doc_spec = Layout.of(self.parallel).tokens
        docs = tuple(None if a is None else reshard(jnp.asarray(a).astype(jnp.int32),
                                                    doc_spec, mesh)
                     for a in (segment_ids, positions))
        kept = self.kept_specs(Layout.of(self.parallel))
        params = self.attention_params()
        values = tuple(reshard(a, spec, mesh) for a, spec in params)
        window = () if self.window is None else (reshard(self.window[...], P(), mesh),)
        attended = jax.shard_map(
            lambda qkv, docs, values, window, *seed: self._attend(
                qkv, order, *docs, *seed, keep_kv=keep_kv, params=values,
                window=window[0] if window else None),
            in_specs=(tp, tuple(None if a is None else doc_spec for a in docs),
                      tuple(spec for _, spec in params), (P(),) * len(window),
                      *(P(),) * len(seeds)),
            out_specs=(tp, *kept) if keep_kv else tp)(
                qkv, docs, values, window, *seeds)
        if keep_kv:
            attended, *kv = attended
        y = self.out(attended)
        if self.post_norm is not None:  # per token: the SP layout's rows
            y = self.post_norm(y)
        y = self.dropout(y, deterministic=deterministic, rngs=rngs)
        out = x.astype(y.dtype) + y
        return (out, tuple(kv)) if keep_kv else out


register_attention("mha", CausalSelfAttention)

"""Pre-LN transformer blocks in the TP+SP layout (Flax NNX) on global arrays.

Both blocks take and return ``[batch, seq, hidden]`` activations in the SP layout
``P(data, tensor, None)``. Per block and direction the collectives are exactly
Megatron's: one all-gather before the column projection and one reduce-scatter after the
row projection (forward), and the conjugate pair in backward; no all-reduce of
activations.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from sp_jax.attention import (
    IMPLEMENTATIONS,
    AttentionDropout,
    blockwise_attention,
    ring_attention,
    ulysses_attention,
)
from sp_jax.config import ParallelConfig
from sp_jax.layers._sharding import (
    Mesh,
    axis_size,
    check_divisible,
    current_mesh,
    reshard,
    sequence_order,
    warn_if_recompute_may_be_merged,
)
from sp_jax.layers.elementwise import Dropout, make_norm
from sp_jax.layers.linear import (
    ColumnSequenceParallelLinear,
    RowSequenceParallelLinear,
    column_sp_matmul,
)
from sp_jax.layout import Layout

__all__ = ["QUERY_BLOCK", "CausalSelfAttention", "GroupedQKVProjection", "MLP",
           "RopeScaling", "causal_attention", "kv_heads_per_shard", "rope_frequencies",
           "rotary_embedding"]


QUERY_BLOCK = 512
"""Queries per block of :func:`causal_attention` (the largest divisor of the sequence
length up to this): its ``[batch, heads, block, seq]`` scores are the largest array the
attention ever holds, in forward and backward."""


def _query_block(s: int) -> int:
    return next(b for b in range(min(s, QUERY_BLOCK), 0, -1) if s % b == 0)


def _causal_scores(q: jax.Array, k: jax.Array, offset) -> jax.Array:
    """fp32 scaled scores ``[b, heads, s_q, s_k]`` of queries at positions ``offset ..
    offset + s_q`` against keys ``0 .. s_k``, the future masked to -inf."""
    scale = q.shape[-1] ** -0.5
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * scale
    s_q, s_k = q.shape[1], k.shape[1]
    causal = (offset + jnp.arange(s_q))[:, None] >= jnp.arange(s_k)[None, :]
    return jnp.where(causal, scores, -jnp.inf)


def _blocks(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """``x`` with ``axis`` split into ``n`` blocks, the block index first."""
    shape = x.shape[:axis] + (n, x.shape[axis] // n) + x.shape[axis + 1:]
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocks(x: jax.Array, axis: int = 1) -> jax.Array:
    """The inverse of :func:`_blocks`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


@jax.custom_vjp
def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention that keeps no ``s x s`` array, forward or backward.

    ``q, k, v``: ``[batch, seq, heads, head_dim]`` -> ``[batch, seq, heads, head_dim]``,
    softmax in fp32. Queries are processed in blocks of :data:`QUERY_BLOCK` (a
    ``lax.scan``), so the largest array is a ``[batch, heads, block, seq]`` block of
    scores. The backward pass recomputes the probabilities from ``q``, ``k`` and the saved
    log-sum-exp ``[batch, heads, seq]`` (Korthikanti et al.'s *selective recomputation*,
    as in flash attention), block by block, accumulating ``dk`` and ``dv`` in fp32: the
    residuals are ``q, k, v``, the output and the log-sum-exp, instead of the ``5 a s^2
    b`` bytes of scores, probabilities and masks that plain autodiff keeps per layer.
    """
    return _causal_attention_fwd(q, k, v)[0]


def _causal_attention_fwd(q, k, v):
    n = q.shape[1] // _query_block(q.shape[1])

    def block(args):
        q_i, offset = args
        scores = _causal_scores(q_i, k, offset)
        lse = jax.nn.logsumexp(scores, axis=-1)
        probs = jnp.exp(scores - lse[..., None])
        return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v), lse

    if n == 1:  # one block: no loop (XLA would keep its copies)
        out, lse = block((q, 0))
    else:
        offsets = jnp.arange(n) * (q.shape[1] // n)
        out, lse = jax.lax.map(block, (_blocks(q, n), offsets))
        out, lse = _unblocks(out), _unblocks(lse, axis=2)
    return out, (q, k, v, out, lse)


def _causal_attention_bwd(res, d_out):
    # Tie the residuals to the incoming cotangent: otherwise XLA's CSE merges the
    # recomputed scores with the forward ones and keeps those alive until backward.
    res, d_out = jax.lax.optimization_barrier((res, d_out))
    q, k, v, out, lse = res
    n = q.shape[1] // _query_block(q.shape[1])
    scale = q.shape[-1] ** -0.5

    def block(carry, xs):
        d_k, d_v = carry
        q_i, do_i, o_i, lse_i, offset = xs
        probs = jnp.exp(_causal_scores(q_i, k, offset) - lse_i[..., None])  # recomputed
        d_v = d_v + jnp.einsum("bhqk,bqhd->bkhd", probs.astype(do_i.dtype), do_i,
                               preferred_element_type=jnp.float32)
        d_probs = jnp.einsum("bqhd,bkhd->bhqk", do_i, v, preferred_element_type=jnp.float32)
        row = jnp.einsum("bqhd,bqhd->bhq", do_i.astype(jnp.float32), o_i.astype(jnp.float32))
        d_scores = probs * (d_probs - row[..., None]) * scale
        d_q = jnp.einsum("bhqk,bkhd->bqhd", d_scores.astype(q.dtype), k)
        d_k = d_k + jnp.einsum("bhqk,bqhd->bkhd", d_scores.astype(k.dtype), q_i,
                               preferred_element_type=jnp.float32)
        return (d_k, d_v), d_q

    zeros = jnp.zeros_like(k, dtype=jnp.float32)  # varies like k inside shard_map
    if n == 1:  # one block: no loop
        (d_k, d_v), d_q = block((zeros, zeros), (q, d_out, out, lse, 0))
        return d_q, d_k.astype(k.dtype), d_v.astype(v.dtype)
    offsets = jnp.arange(n) * (q.shape[1] // n)
    (d_k, d_v), d_q = jax.lax.scan(
        block, (zeros, zeros),
        (_blocks(q, n), _blocks(d_out, n), _blocks(out, n), _blocks(lse, n, axis=2), offsets))
    return _unblocks(d_q), d_k.astype(k.dtype), d_v.astype(v.dtype)


causal_attention.defvjp(_causal_attention_fwd, _causal_attention_bwd)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style rotary frequency scaling (Hugging Face's ``rope_type="llama3"``).

    Frequencies whose wavelength exceeds ``original_max_position_embeddings /
    low_freq_factor`` are divided by ``factor``; those shorter than ``... /
    high_freq_factor`` are kept; the ones between are interpolated smoothly.

    Attributes:
      factor: the division of the low frequencies (context extension factor).
      low_freq_factor / high_freq_factor: the wavelength band boundaries (above).
      original_max_position_embeddings: the context the frequencies were trained for.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ValueError(f"RopeScaling.factor={self.factor} must be >= 1.")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"RopeScaling: need 0 < low_freq_factor ({self.low_freq_factor}) < "
                f"high_freq_factor ({self.high_freq_factor}).")
        if self.original_max_position_embeddings <= 0:
            raise ValueError("RopeScaling.original_max_position_embeddings="
                             f"{self.original_max_position_embeddings} must be positive.")


def rope_frequencies(head_dim: int, base: float = 10000.0,
                     scaling: RopeScaling | None = None) -> np.ndarray:
    """The ``head_dim / 2`` rotary angular frequencies ``base ** (-2i / head_dim)``,
    optionally Llama-3 scaled, computed in float64 on the host (float32 result)."""
    inv = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is not None:
        old = scaling.original_max_position_embeddings
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        scaled = np.where(wavelen > old / scaling.low_freq_factor, inv / scaling.factor, inv)
        medium = (wavelen >= old / scaling.high_freq_factor) & (
            wavelen <= old / scaling.low_freq_factor)
        inv = np.where(medium, (1 - smooth) * scaled / scaling.factor + smooth * scaled,
                       scaled)
    return inv.astype(np.float32)


def rotary_embedding(x: jax.Array, positions: jax.Array, base: float = 10000.0,
                     scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary position embedding (rotate-half form, as Hugging Face's Llama) of ``x``
    ``[b, s, heads, head_dim]`` at integer ``positions [s]``, computed in fp32;
    frequencies from :func:`rope_frequencies`."""
    freqs = jnp.asarray(rope_frequencies(x.shape[-1], base, scaling))
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # [s, half]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _check_kv_heads(where: str, num_heads: int, num_kv_heads: int) -> None:
    if (isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int)
            or num_kv_heads <= 0 or num_heads % num_kv_heads):
        raise ValueError(
            f"{where}: num_kv_heads={num_kv_heads!r} must be a positive divisor of "
            f"num_heads={num_heads} (each key/value head serves num_heads / num_kv_heads "
            "query heads).")


def kv_heads_per_shard(num_kv_heads: int, tensor_size: int, where: str) -> int:
    """Key/value heads each tensor shard holds: ``num_kv_heads / t`` when ``t`` divides
    them, else 1 (replicated: ``t`` a multiple of ``num_kv_heads``, Megatron's rule);
    raises a ValueError naming the fix for any other pair."""
    if num_kv_heads % tensor_size == 0:
        return num_kv_heads // tensor_size
    if tensor_size % num_kv_heads == 0:
        return 1
    raise ValueError(
        f"{where}: num_kv_heads={num_kv_heads} cannot be laid out over a tensor axis of size "
        f"{tensor_size}: the key/value heads are split when the tensor size divides them "
        "and replicated when it is a multiple of them; choose num_kv_heads a divisor or a "
        f"multiple of {tensor_size}.")


class GroupedQKVProjection(nnx.Module):
    """The fused q/k/v projection of grouped-query attention, sequence-parallel.

    Two parameters with mesh-independent global shapes: ``q_kernel [hidden, heads *
    head_dim]`` (columns ``(head, head_dim)``) and ``kv_kernel [hidden, kv_heads * 2 *
    head_dim]`` (columns ``(kv_head, {k, v}, head_dim)``), and biases ``q_bias`` /
    ``kv_bias`` with ``use_bias``. ``q_kernel`` is split by columns over the tensor axis
    like a :class:`ColumnSequenceParallelLinear`; ``kv_kernel`` too when the tensor size
    ``t`` divides ``kv_heads``, else (``t`` a multiple of ``kv_heads``) it is replicated
    over the tensor axis and shard ``i`` uses kv head ``i * kv_heads / t``: the one its
    query heads read (Megatron's rule; its gradient is summed over the shards sharing it).

    Per device the two column blocks are concatenated into one kernel and applied by ONE
    :func:`sp_jax.ops.column_sequence_parallel_matmul`: one all-gather of the input per
    block, with every option of the config (``recompute_allgather``,
    ``collective_matmul``, ``wgrad_dtype``, ``fsdp``).

    Shapes: input ``[b, s, hidden]`` ``P(data, tensor, None)``; output ``[b, s, t *
    width]`` ``P(data, None, tensor)`` where shard ``i``'s ``width = (heads / t + 2 *
    kv_local) * head_dim`` columns are its query heads then ``(kv_head, {k, v},
    head_dim)`` of its ``kv_local`` (:func:`kv_heads_per_shard`) key/value heads.

    Args:
      hidden: model width.
      num_heads / num_kv_heads / head_dim: query heads, key/value heads, head size.
      use_bias: biases on q, k and v.
      config / dtype / param_dtype / rngs: as :class:`CausalSelfAttention` (two
        ``params`` draws, q then kv, then the biases).
    """

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 use_bias: bool = False, config: ParallelConfig = ParallelConfig(),
                 dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        _check_kv_heads("GroupedQKVProjection", num_heads, num_kv_heads)
        self.hidden, self.num_heads, self.num_kv_heads = hidden, num_heads, num_kv_heads
        self.head_dim, self.config, self.dtype = head_dim, config, dtype
        mesh = current_mesh(config, where="GroupedQKVProjection", required=False)
        kv_kernel_spec, kv_bias_spec = self._kv_specs(mesh)
        layout, eager = Layout.of(config), mesh is not None
        init = nnx.initializers.lecun_normal()
        self.q_kernel = nnx.Param(
            init(rngs.params(), (hidden, num_heads * head_dim), param_dtype),
            out_sharding=tuple(layout.column_kernel), eager_sharding=eager)
        self.kv_kernel = nnx.Param(
            init(rngs.params(), (hidden, 2 * num_kv_heads * head_dim), param_dtype),
            out_sharding=tuple(kv_kernel_spec), eager_sharding=eager)
        self.q_bias: nnx.Param | None
        self.kv_bias: nnx.Param | None
        if use_bias:
            self.q_bias = nnx.Param(jnp.zeros((num_heads * head_dim,), param_dtype),
                                    out_sharding=tuple(layout.column_bias),
                                    eager_sharding=eager)
            self.kv_bias = nnx.Param(jnp.zeros((2 * num_kv_heads * head_dim,), param_dtype),
                                     out_sharding=tuple(kv_bias_spec), eager_sharding=eager)
        else:
            self.q_bias = self.kv_bias = None

    def _replicated(self, mesh: Mesh | None) -> bool:
        if mesh is None:
            return False
        t = axis_size(mesh, self.config.tensor_axis)
        return kv_heads_per_shard(self.num_kv_heads, t, "GroupedQKVProjection") \
            * t != self.num_kv_heads

    def _kv_specs(self, mesh: Mesh | None):
        layout = Layout.of(self.config)
        if self._replicated(mesh):
            return layout.spec("param_embed", None), P(None)
        return layout.column_kernel, layout.column_bias

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x``: ``[batch, seq, hidden]`` in the SP layout -> the per-shard blocks above."""
        cfg = self.config
        mesh = current_mesh(cfg, where="GroupedQKVProjection")
        warn_if_recompute_may_be_merged(cfg)
        t = axis_size(mesh, cfg.tensor_axis)
        check_divisible("GroupedQKVProjection", "num_heads", self.num_heads, mesh,
                        cfg.tensor_axis, "choose a head count that is a multiple of the "
                        "tensor-parallel size")
        replicated = self._replicated(mesh)
        layout = Layout.of(cfg)
        kv_kernel_spec, kv_bias_spec = self._kv_specs(mesh)
        q_kernel, kv_kernel = self.q_kernel[...], self.kv_kernel[...]
        dtype = self.dtype if self.dtype is not None else jnp.result_type(x.dtype,
                                                                           q_kernel.dtype)
        args = [reshard(x.astype(dtype), layout.sp, mesh),
                reshard(q_kernel, layout.column_kernel, mesh),
                reshard(kv_kernel, kv_kernel_spec, mesh)]
        specs = [layout.sp, layout.column_kernel, kv_kernel_spec]
        if self.q_bias is not None:
            args += [reshard(self.q_bias[...], layout.column_bias, mesh),
                     reshard(self.kv_bias[...], kv_bias_spec, mesh)]
            specs += [layout.column_bias, kv_bias_spec]
        width = 2 * self.head_dim
        group = t // self.num_kv_heads if replicated else 1  # shards sharing a kv head

        def local(x, q_kernel, kv_kernel, q_bias=None, kv_bias=None):
            if replicated:  # this shard's kv head out of all of them
                start = lax.axis_index(cfg.tensor_axis) // group * width
                kv_kernel = lax.dynamic_slice_in_dim(kv_kernel, start, width, axis=1)
                if kv_bias is not None:
                    kv_bias = lax.dynamic_slice_in_dim(kv_bias, start, width, axis=0)
            kernel = jnp.concatenate([q_kernel, kv_kernel], axis=1)
            bias = None if q_bias is None else jnp.concatenate([q_bias, kv_bias])
            return column_sp_matmul(x, kernel, bias, cfg)

        return jax.shard_map(local, in_specs=tuple(specs), out_specs=layout.tp)(*args)


class CausalSelfAttention(nnx.Module):
    """Pre-LN causal self-attention with a residual, tensor- and sequence-parallel.

    ``x + dropout(out(attention(qkv(norm(x)))))`` where

    - ``qkv`` is ONE :class:`ColumnSequenceParallelLinear` ``[hidden, 3 * hidden]``, so the
      normed input is all-gathered once per block. Its output columns are laid out per
      head, ``(head, {q, k, v}, head_dim)``, so the column block of tensor shard ``i``
      holds the q, k and v of heads ``i * heads / t ...`` and attention needs no
      communication;
    - with ``num_kv_heads < num_heads`` (grouped-query / multi-query attention) the
      projection is a :class:`GroupedQKVProjection` instead (``q_kernel`` and
      ``kv_kernel``, still one all-gather): kv heads are split over the tensor axis when
      its size divides them, and replicated when it is a multiple of them;
    - attention runs over the full sequence on each device's heads;
    - ``out`` is a :class:`RowSequenceParallelLinear` back to the SP layout.

    Args:
      hidden: model width; divisible by ``num_heads``.
      num_heads: attention heads; divisible by the tensor-axis size.
      num_kv_heads: key/value heads (default ``num_heads``); a divisor of ``num_heads``.
        Fewer than ``num_heads``: grouped-query attention (1: multi-query), each key/value
        head serving ``num_heads / num_kv_heads`` consecutive query heads (Hugging Face's
        ``repeat_kv`` order); the tensor size must divide or be a multiple of it. With
        Ulysses the key/value heads per tensor shard must also divide by the context size.
      config: the :class:`~sp_jax.ParallelConfig`.
      dropout: dropout rate on the block output (sharding-invariant masks).
      attention_dropout: dropout rate on the attention probabilities, inside the
        attention kernels (:class:`~sp_jax.attention.AttentionDropout`: masks from a hash
        of the global batch row, head and positions, equal under every sharding and
        context layout; ``attention_implementation="xla"`` only). Its key is drawn from
        the call's ``rngs`` before the output dropout's.
      rotary: apply rotary position embeddings to q and k.
      rope_base: rotary base frequency.
      rope_scaling: Llama-3 frequency scaling (:class:`RopeScaling`) or None.
      qkv_bias: give the q/k/v projection a bias (GPT-2 has one; off by default: the key
        bias has an exactly zero gradient, since softmax ignores a constant added to every
        score).
      out_bias: give the output projection a bias (GPT-2: yes, Llama: no).
      norm: ``"layernorm"`` or ``"rmsnorm"``.
      norm_epsilon: epsilon of the norm.
      attention_block_q / attention_block_k: query and key/value block sizes of the
        blockwise attention kernel (:func:`sp_jax.attention.blockwise_attention`).
      attention_implementation: ``"xla"`` (sp_jax's blockwise kernel, every backend) or
        ``"cudnn"`` (cuDNN's fused attention through
        :func:`jax.nn.dot_product_attention`, GPUs only; without context parallelism or
        with Ulysses: ring attention merges partial results by their log-sum-exp, which
        the cuDNN call does not return).
      dtype / param_dtype: compute and parameter dtypes.
      rngs: ``params`` rng stream. Dropout draws from the ``rngs`` passed to each call
        (e.g. ``nnx.Rngs(dropout=key)``) in train mode.

    With context parallelism (``config.context_parallel``) the attention spans the
    context axis: :func:`sp_jax.attention.ring_attention` on the zigzag-ordered sequence,
    or :func:`sp_jax.attention.ulysses_attention`; rotary positions follow each device's
    tokens.
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        config: ParallelConfig = ParallelConfig(),
        dropout: float = 0.0,
        attention_dropout: float = 0.0,
        rotary: bool = False,
        rope_base: float = 10000.0,
        rope_scaling: RopeScaling | None = None,
        qkv_bias: bool = False,
        out_bias: bool = True,
        norm: str = "layernorm",
        norm_epsilon: float = 1e-5,
        attention_block_q: int = 512,
        attention_block_k: int = 512,
        attention_implementation: str = "xla",
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        if num_heads <= 0 or hidden % num_heads:
            raise ValueError(
                f"CausalSelfAttention: hidden={hidden} must be divisible by "
                f"num_heads={num_heads}."
            )
        if rotary and (hidden // num_heads) % 2:
            raise ValueError(
                f"CausalSelfAttention: rotary embeddings need an even head size, got "
                f"{hidden // num_heads}."
            )
        for name, value in (("attention_block_q", attention_block_q),
                            ("attention_block_k", attention_block_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"CausalSelfAttention: {name}={value!r} must be a positive "
                                 "int.")
        if attention_implementation not in IMPLEMENTATIONS:
            raise ValueError(
                f"CausalSelfAttention: attention_implementation={attention_implementation!r}"
                f" is not one of {IMPLEMENTATIONS}.")
        if attention_implementation == "cudnn" and attention_dropout:
            raise ValueError(
                f"CausalSelfAttention: attention_dropout={attention_dropout} needs "
                "attention_implementation='xla' (cuDNN's kernel draws masks of its own, "
                "which would not be the same under every sharding).")
        if attention_implementation == "cudnn" and config.context_parallel == "ring":
            raise ValueError(
                "CausalSelfAttention: attention_implementation='cudnn' cannot run ring "
                "attention (its steps are merged by log-sum-exp, which cuDNN's kernel does not "
                "return); use attention_implementation='xla' or context_parallel='ulysses'.")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        _check_kv_heads("CausalSelfAttention", num_heads, num_kv_heads)
        if rope_scaling is not None and not isinstance(rope_scaling, RopeScaling):
            raise TypeError(f"CausalSelfAttention: rope_scaling={rope_scaling!r} must be a "
                            "RopeScaling or None.")
        self.implementation = attention_implementation
        self.hidden, self.num_heads, self.config = hidden, num_heads, config
        self.num_kv_heads = num_kv_heads
        self.rotary, self.rope_base, self.rope_scaling = rotary, rope_base, rope_scaling
        self.block_q, self.block_k = attention_block_q, attention_block_k
        mesh = current_mesh(config, where="CausalSelfAttention", required=False)
        if mesh is not None:
            self._check_heads(mesh)
        self.norm = make_norm(norm, hidden, config=config, epsilon=norm_epsilon, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)
        if num_kv_heads == num_heads:
            self.qkv = ColumnSequenceParallelLinear(
                hidden, 3 * hidden, use_bias=qkv_bias, config=config, dtype=dtype,
                param_dtype=param_dtype, rngs=rngs)
        else:
            self.qkv = GroupedQKVProjection(
                hidden, num_heads, num_kv_heads, hidden // num_heads, use_bias=qkv_bias,
                config=config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.out = RowSequenceParallelLinear(
            hidden, hidden, use_bias=out_bias, config=config, dtype=dtype,
            param_dtype=param_dtype, rngs=rngs)
        self.dropout = Dropout(dropout, config=config)  # rngs come with each call
        # holds the rate and the train/eval mode of the attention-probability dropout
        self.attention_dropout = Dropout(attention_dropout, config=config)

    def _check_heads(self, mesh: Mesh) -> None:
        check_divisible("CausalSelfAttention", "num_heads", self.num_heads, mesh,
                        self.config.tensor_axis,
                        "choose a head count that is a multiple of the tensor-parallel size")
        cfg = self.config
        t = axis_size(mesh, cfg.tensor_axis)
        kv_local = kv_heads_per_shard(self.num_kv_heads, t, "CausalSelfAttention")
        if cfg.context_parallel == "ulysses":
            check_divisible(
                "CausalSelfAttention (ulysses)", "num_heads", self.num_heads, mesh,
                (cfg.tensor_axis, cfg.context_axis),
                "Ulysses gives each context device whole heads: choose num_heads a multiple "
                "of tensor x context, or context_parallel='ring'")
            check_divisible(
                "CausalSelfAttention (ulysses)", "key/value heads per tensor shard",
                kv_local, mesh, cfg.context_axis,
                "Ulysses gives each context device whole query groups with their key/value "
                "heads: choose num_kv_heads a multiple of tensor x context, or "
                "context_parallel='ring'")

    def _attend(self, qkv: jax.Array, order: np.ndarray | None,
                seed: jax.Array | None = None) -> jax.Array:
        """Per device: ``[b, s_local, 3 * hidden / t]`` (local heads, this device's part of
        the sequence) -> ``[b, s_local, hidden / t]``; ``seed``: the attention dropout's."""
        b, s, width = qkv.shape
        head_dim = self.hidden // self.num_heads
        if self.num_kv_heads == self.num_heads:  # columns (head, {q, k, v}, head_dim)
            heads = width // (3 * head_dim)
            q, k, v = jnp.unstack(qkv.reshape(b, s, heads, 3, head_dim), axis=3)
        else:  # this shard's query heads, then (kv_head, {k, v}, head_dim)
            heads = self.num_heads // lax.axis_size(self.config.tensor_axis)
            q = qkv[..., :heads * head_dim].reshape(b, s, heads, head_dim)
            k, v = jnp.unstack(qkv[..., heads * head_dim:].reshape(b, s, -1, 2, head_dim),
                               axis=3)
        cfg = self.config
        if self.rotary:
            positions = jnp.arange(s)
            if cfg.context_axes:  # this device's tokens of the (possibly permuted) sequence
                start = jax.lax.axis_index(cfg.context_axis) * s
                ordered = jnp.arange(s * jax.lax.axis_size(cfg.context_axis)) \
                    if order is None else jnp.asarray(order)
                positions = jax.lax.dynamic_slice_in_dim(ordered, start, s)
            q = rotary_embedding(q, positions, self.rope_base, self.rope_scaling)
            k = rotary_embedding(k, positions, self.rope_base, self.rope_scaling)
        blocks = dict(block_q=self.block_q, block_k=self.block_k)
        if seed is not None:  # global coordinates of this device's first row and head
            rows = lax.axis_index(cfg.data_axes) * b if cfg.data_axes else 0
            blocks["dropout"] = AttentionDropout(
                seed, self.attention_dropout.rate, batch_offset=rows,
                head_offset=lax.axis_index(cfg.tensor_axis) * heads)
        if cfg.context_parallel == "ring":
            out = ring_attention(q, k, v, axis_name=cfg.context_axis, **blocks)
        elif cfg.context_parallel == "ulysses":
            out = ulysses_attention(q, k, v, axis_name=cfg.context_axis,
                                    implementation=self.implementation, **blocks)
        else:
            out = blockwise_attention(q, k, v, implementation=self.implementation, **blocks)
        return out.reshape(b, s, heads * head_dim)

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None,
                 rngs: Any = None) -> jax.Array:
        """``x``: ``[batch, seq, hidden]`` in the SP layout -> same shape and layout."""
        mesh = current_mesh(self.config, where="CausalSelfAttention")
        self._check_heads(mesh)
        order = sequence_order(self.config, mesh, x.shape[1])
        tp = Layout.of(self.config).tp
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
        attended = jax.shard_map(lambda qkv, *seed: self._attend(qkv, order, *seed),
                                 in_specs=(tp, *(P(),) * len(seeds)),
                                 out_specs=tp)(qkv, *seeds)
        y = self.dropout(self.out(attended), deterministic=deterministic, rngs=rngs)
        return x.astype(y.dtype) + y


class MLP(nnx.Module):
    """Pre-LN MLP with a residual: ``x + dropout(down(act(up(norm(x)))))``.

    ``up`` is a :class:`ColumnSequenceParallelLinear` ``[hidden, mlp_hidden]`` and
    ``down`` a :class:`RowSequenceParallelLinear` ``[mlp_hidden, hidden]``; input and
    output in the SP layout.

    Gated (``gated=True``: SwiGLU with ``activation=jax.nn.silu``, GeGLU with gelu):
    ``down(act(gate(x)) * up(x))`` with gate and up fused in ONE column layer ``up``
    ``[hidden, 2 * mlp_hidden]`` whose columns are interleaved ``(j, {gate, up})``, so
    every tensor shard holds matching gate and up columns, for any tensor size dividing
    ``mlp_hidden``, and the normed input is gathered once.

    Args:
      hidden: model width.
      mlp_hidden: inner width; divisible by the tensor-axis size.
      activation: elementwise nonlinearity (default ``jax.nn.gelu``, tanh approximation).
      gated: gated linear unit (above).
      use_bias: biases on the up (gate) and down projections (GPT-2: yes, Llama: no).
      others: as :class:`CausalSelfAttention`.
    """

    def __init__(
        self,
        hidden: int,
        mlp_hidden: int,
        *,
        config: ParallelConfig = ParallelConfig(),
        dropout: float = 0.0,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
        gated: bool = False,
        use_bias: bool = True,
        norm: str = "layernorm",
        norm_epsilon: float = 1e-5,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.activation, self.gated = activation, bool(gated)
        self.norm = make_norm(norm, hidden, config=config, epsilon=norm_epsilon, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)
        self.up = ColumnSequenceParallelLinear(
            hidden, (2 if self.gated else 1) * mlp_hidden, use_bias=use_bias, config=config,
            dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.down = RowSequenceParallelLinear(
            mlp_hidden, hidden, use_bias=use_bias, config=config, dtype=dtype,
            param_dtype=param_dtype, rngs=rngs)
        self.dropout = Dropout(dropout, config=config)  # rngs come with each call
        self.config = config

    def _act(self, y: jax.Array) -> jax.Array:
        if not self.gated:
            return self.activation(y)
        tp = Layout.of(self.config).tp

        def local(y):  # this shard's interleaved (gate, up) column pairs
            pairs = y.reshape(*y.shape[:-1], -1, 2)
            return self.activation(pairs[..., 0]) * pairs[..., 1]

        return jax.shard_map(local, in_specs=tp, out_specs=tp)(y)

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None,
                 rngs: Any = None) -> jax.Array:
        """``x``: ``[batch, seq, hidden]`` in the SP layout -> same shape and layout."""
        # The activation is recomputed in backward: only its input is kept (the tanh
        # approximation of gelu would otherwise keep several [b, s, mlp_hidden / t] arrays).
        y = self.down(jax.checkpoint(self._act)(self.up(self.norm(x))))
        y = self.dropout(y, deterministic=deterministic, rngs=rngs)
        return x.astype(y.dtype) + y

"""Pre-LN transformer blocks in the TP+SP layout (Flax NNX) on global arrays.

Both blocks take and return ``[batch, seq, hidden]`` activations in the SP layout
``P(data, tensor, None)``. Per block and direction the collectives are exactly
Megatron's: one all-gather before the column projection and one reduce-scatter after the
row projection (forward), and the conjugate pair in backward; no all-reduce of
activations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sp_jax.attention import (
    IMPLEMENTATIONS,
    blockwise_attention,
    ring_attention,
    ulysses_attention,
)
from sp_jax.config import ParallelConfig
from sp_jax.layers._sharding import Mesh, check_divisible, current_mesh, sequence_order
from sp_jax.layers.elementwise import Dropout, make_norm
from sp_jax.layers.linear import ColumnSequenceParallelLinear, RowSequenceParallelLinear
from sp_jax.layout import Layout

__all__ = ["QUERY_BLOCK", "CausalSelfAttention", "MLP", "causal_attention",
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


def rotary_embedding(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding (rotate-half form) of ``x`` ``[b, s, heads, head_dim]``."""
    half = x.shape[-1] // 2
    freqs = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # [s, half]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class CausalSelfAttention(nnx.Module):
    """Pre-LN causal self-attention with a residual, tensor- and sequence-parallel.

    ``x + dropout(out(attention(qkv(norm(x)))))`` where

    - ``qkv`` is ONE :class:`ColumnSequenceParallelLinear` ``[hidden, 3 * hidden]``, so the
      normed input is all-gathered once per block. Its output columns are laid out per
      head, ``(head, {q, k, v}, head_dim)``, so the column block of tensor shard ``i``
      holds the q, k and v of heads ``i * heads / t ...`` and attention needs no
      communication;
    - attention runs over the full sequence on each device's heads;
    - ``out`` is a :class:`RowSequenceParallelLinear` back to the SP layout.

    Args:
      hidden: model width; divisible by ``num_heads``.
      num_heads: attention heads; divisible by the tensor-axis size.
      config: the :class:`~sp_jax.ParallelConfig`.
      dropout: dropout rate on the block output (sharding-invariant masks).
      rotary: apply rotary position embeddings to q and k.
      rope_base: rotary base frequency.
      qkv_bias: give the q/k/v projection a bias (off by default: the key bias has an
        exactly zero gradient, since softmax ignores a constant added to every score).
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
        config: ParallelConfig = ParallelConfig(),
        dropout: float = 0.0,
        rotary: bool = False,
        rope_base: float = 10000.0,
        qkv_bias: bool = False,
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
        if attention_implementation == "cudnn" and config.context_parallel == "ring":
            raise ValueError(
                "CausalSelfAttention: attention_implementation='cudnn' cannot run ring "
                "attention (its steps are merged by log-sum-exp, which cuDNN's kernel does not "
                "return); use attention_implementation='xla' or context_parallel='ulysses'.")
        self.implementation = attention_implementation
        self.hidden, self.num_heads, self.config = hidden, num_heads, config
        self.rotary, self.rope_base = rotary, rope_base
        self.block_q, self.block_k = attention_block_q, attention_block_k
        mesh = current_mesh(config, where="CausalSelfAttention", required=False)
        if mesh is not None:
            self._check_heads(mesh)
        self.norm = make_norm(norm, hidden, config=config, epsilon=norm_epsilon, dtype=dtype,
                              param_dtype=param_dtype, rngs=rngs)
        self.qkv = ColumnSequenceParallelLinear(
            hidden, 3 * hidden, use_bias=qkv_bias, config=config, dtype=dtype,
            param_dtype=param_dtype, rngs=rngs)
        self.out = RowSequenceParallelLinear(
            hidden, hidden, config=config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.dropout = Dropout(dropout, config=config)  # rngs come with each call

    def _check_heads(self, mesh: Mesh) -> None:
        check_divisible("CausalSelfAttention", "num_heads", self.num_heads, mesh,
                        self.config.tensor_axis,
                        "choose a head count that is a multiple of the tensor-parallel size")
        cfg = self.config
        if cfg.context_parallel == "ulysses":
            check_divisible(
                "CausalSelfAttention (ulysses)", "num_heads", self.num_heads, mesh,
                (cfg.tensor_axis, cfg.context_axis),
                "Ulysses gives each context device whole heads: choose num_heads a multiple "
                "of tensor x context, or context_parallel='ring'")

    def _attend(self, qkv: jax.Array, order: np.ndarray | None) -> jax.Array:
        """Per device: ``[b, s_local, 3 * hidden / t]`` (local heads, this device's part of
        the sequence) -> ``[b, s_local, hidden / t]``."""
        b, s, width = qkv.shape
        head_dim = self.hidden // self.num_heads
        heads = width // (3 * head_dim)
        q, k, v = jnp.unstack(qkv.reshape(b, s, heads, 3, head_dim), axis=3)
        cfg = self.config
        if self.rotary:
            positions = jnp.arange(s)
            if cfg.context_axes:  # this device's tokens of the (possibly permuted) sequence
                start = jax.lax.axis_index(cfg.context_axis) * s
                ordered = jnp.arange(s * jax.lax.axis_size(cfg.context_axis)) \
                    if order is None else jnp.asarray(order)
                positions = jax.lax.dynamic_slice_in_dim(ordered, start, s)
            q = rotary_embedding(q, positions, self.rope_base)
            k = rotary_embedding(k, positions, self.rope_base)
        blocks = dict(block_q=self.block_q, block_k=self.block_k)
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
        attended = jax.shard_map(lambda qkv: self._attend(qkv, order), in_specs=tp,
                                 out_specs=tp)(qkv)
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
            hidden, (2 if self.gated else 1) * mlp_hidden, config=config, dtype=dtype,
            param_dtype=param_dtype, rngs=rngs)
        self.down = RowSequenceParallelLinear(
            mlp_hidden, hidden, config=config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
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

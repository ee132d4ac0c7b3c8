"""GSPMD baseline: the sp_jax GPT block written the MaxText way, sharded by annotations.

The same pre-LN block as :class:`sp_jax.models.Block` (attention then MLP, one fused
``[hidden, 3 * hidden]`` q/k/v projection with its columns laid out per head
``(head, {q, k, v}, head_dim)``), built from plain :class:`flax.nnx.Linear` and ``jnp``
ops. There is no ``shard_map`` and no explicit collective: parameters carry sharding
annotations and the activations are pinned with ``jax.lax.with_sharding_constraint``,
every spec taken from the library's :class:`sp_jax.Layout` (one vocabulary for both):

- column kernels ``layout.column_kernel`` (``P(None, t)``), row kernels
  ``layout.row_kernel`` (``P(t, None)``), and their biases;
- block boundaries and norms in the SP layout ``layout.sp`` (``P(d, t, None)``);
- column-projection outputs and the row-projection input in ``layout.tp``
  (``P(d, None, t)``), heads in ``layout.heads(rank)`` (heads sharded);

and XLA's SPMD partitioner (GSPMD) inserts whatever collectives these annotations imply.
Run it under ``jax.set_mesh`` of a mesh with **Auto** axes
(``jax.make_mesh(..., axis_types=(AxisType.Auto,) * 2)``), or with no mesh at all: then
the constraints are skipped and it is the plain single-device block.

To compare parallelisation strategies rather than kernels, the baseline keeps sp_jax's
memory policy: the same attention kernel (:func:`sp_jax.attention.blockwise_attention`
with the same blocks, which saves the log-sum-exp instead of the ``s x s``
probabilities), the MLP activation
recomputed in backward (``jax.checkpoint``), and the same LayerNorm backward
(:func:`sp_jax.layers.layer_norm`: the norm keeps only its input and per-token
statistics). :func:`copy_weights` loads an sp_jax block's parameters into it (the
parameter tree has the same names and global shapes).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from sp_jax import Layout
from sp_jax.attention import blockwise_attention
from sp_jax.layers import layer_norm

__all__ = ["GspmdAttention", "GspmdBlock", "GspmdGPT", "GspmdMLP", "constrain",
           "copy_weights", "param_specs"]

_default_kernel_init = nnx.initializers.lecun_normal()


class _LayerNorm(nnx.LayerNorm):
    """``nnx.LayerNorm`` with sp_jax's memory-lean backward (no mesh needed)."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return layer_norm(x, self.scale[...], self.bias[...], epsilon=self.epsilon,
                          dtype=self.dtype)


def constrain(x: jax.Array, spec: P) -> jax.Array:
    """``with_sharding_constraint(x, spec)`` on the current (Auto) mesh; no-op without one."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        raise ValueError(
            "The GSPMD baseline annotates activations with with_sharding_constraint and "
            "needs a mesh with Auto axes: jax.make_mesh(shape, names, "
            "axis_types=(AxisType.Auto,) * len(names))."
        )
    return jax.lax.with_sharding_constraint(x, spec)


def _linear(in_f: int, out_f: int, layout: Layout, *, row: bool, use_bias: bool = True,
            dtype: Any, param_dtype: Any, rngs: nnx.Rngs) -> nnx.Linear:
    """``nnx.Linear`` annotated as a column (``row=False``) or row layer of ``layout``."""
    kernel_spec = layout.row_kernel if row else layout.column_kernel
    bias_spec = layout.row_bias if row else layout.column_bias
    # Annotated parameters are placed on creation only when a mesh is set.
    mesh = jax.sharding.get_abstract_mesh()
    eager = mesh is not None and not mesh.empty
    return nnx.Linear(
        in_f, out_f, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
        kernel_init=nnx.with_partitioning(_default_kernel_init, tuple(kernel_spec),
                                          eager_sharding=eager),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), tuple(bias_spec),
                                        eager_sharding=eager),
        rngs=rngs)


class GspmdAttention(nnx.Module):
    """Pre-LN causal self-attention with a residual, sharded by annotations only.

    ``x + out(attention(qkv(norm(x))))``; ``x`` ``[batch, seq, hidden]``.
    """

    def __init__(self, hidden: int, num_heads: int, *, layout: Layout = Layout(),
                 norm_epsilon: float = 1e-5, dtype: Any = None,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        if hidden % num_heads:
            raise ValueError(f"GspmdAttention: hidden={hidden} must be divisible by "
                             f"num_heads={num_heads}.")
        self.hidden, self.num_heads, self.layout = hidden, num_heads, layout
        self.norm = _LayerNorm(hidden, epsilon=norm_epsilon, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
        self.qkv = _linear(hidden, 3 * hidden, layout, row=False, use_bias=False, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)
        self.out = _linear(hidden, hidden, layout, row=True, dtype=dtype,
                           param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        lay = self.layout
        x = constrain(x, lay.sp)
        qkv = constrain(self.qkv(constrain(self.norm(x), lay.sp)), lay.tp)
        b, s, _ = qkv.shape
        head_dim = self.hidden // self.num_heads
        qkv = constrain(qkv.reshape(b, s, self.num_heads, 3, head_dim), lay.heads(5))
        q, k, v = (constrain(qkv[:, :, :, i], lay.heads(4)) for i in range(3))
        o = constrain(blockwise_attention(q, k, v), lay.heads(4))
        o = constrain(o.reshape(b, s, self.hidden), lay.tp)
        y = constrain(self.out(o), lay.sp)
        return x.astype(y.dtype) + y


class GspmdMLP(nnx.Module):
    """Pre-LN MLP with a residual: ``x + down(gelu(up(norm(x))))``, annotations only."""

    def __init__(self, hidden: int, mlp_hidden: int, *, layout: Layout = Layout(),
                 norm_epsilon: float = 1e-5, dtype: Any = None,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        self.layout = layout
        self.norm = _LayerNorm(hidden, epsilon=norm_epsilon, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)
        self.up = _linear(hidden, mlp_hidden, layout, row=False, dtype=dtype,
                          param_dtype=param_dtype, rngs=rngs)
        self.down = _linear(mlp_hidden, hidden, layout, row=True, dtype=dtype,
                            param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        lay = self.layout
        x = constrain(x, lay.sp)
        u = constrain(self.up(constrain(self.norm(x), lay.sp)), lay.tp)
        a = constrain(jax.checkpoint(jax.nn.gelu)(u), lay.tp)  # as sp_jax's MLP
        y = constrain(self.down(a), lay.sp)
        return x.astype(y.dtype) + y


class GspmdBlock(nnx.Module):
    """One transformer layer, :class:`GspmdAttention` then :class:`GspmdMLP`.

    Args:
      hidden, num_heads, mlp_hidden: shape (``mlp_hidden`` defaults to ``4 * hidden``).
      layout: the :class:`sp_jax.Layout` every annotation is taken from (default: data
        axis ``"data"``, tensor axis ``"tensor"``).
      norm_epsilon, dtype, param_dtype: as :class:`sp_jax.models.GPTConfig`.
      rngs: ``params`` stream (same draw order as the sp_jax block).
    """

    def __init__(self, hidden: int, num_heads: int, mlp_hidden: int | None = None, *,
                 layout: Layout = Layout(), norm_epsilon: float = 1e-5, dtype: Any = None,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        common = dict(layout=layout, norm_epsilon=norm_epsilon, dtype=dtype,
                      param_dtype=param_dtype, rngs=rngs)
        self.attention = GspmdAttention(hidden, num_heads, **common)
        self.mlp = GspmdMLP(hidden, mlp_hidden or 4 * hidden, **common)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.mlp(self.attention(x))


class _Embedding(nnx.Module):
    """The token table ``embedding`` ``[V, hidden]``, split over the vocabulary."""

    def __init__(self, vocab: int, hidden: int, layout: Layout, param_dtype: Any,
                 rngs: nnx.Rngs):
        mesh = jax.sharding.get_abstract_mesh()
        init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)
        self.embedding = nnx.Param(init(rngs.params(), (vocab, hidden), param_dtype),
                                   out_sharding=tuple(layout.vocab_table),
                                   eager_sharding=mesh is not None and not mesh.empty)


class GspmdGPT(nnx.Module):
    """The sp_jax GPT (:class:`sp_jax.models.GPT`: learned positions, pre-LN blocks, final
    LayerNorm, tied LM head, mean next-token cross-entropy) written the MaxText way:
    :class:`GspmdBlock` s, ``jnp.take`` on the vocabulary-sharded table, ``h @ table.T``
    with the logits pinned vocabulary-parallel (``layout.logits``), and optax's
    cross-entropy; GSPMD inserts every collective. The parameter tree has the sp_jax
    GPT's names and global shapes (tied head, learned positions), so :func:`copy_weights`
    moves weights either way. ``loss`` has the signature :func:`sp_jax.training.lm_loss`
    calls, so :class:`sp_jax.training.TrainStep` trains it unchanged.

    Args:
      config: a :class:`sp_jax.models.GPTConfig` with ``positions="learned"``,
        ``norm="layernorm"``, ``tie_embeddings=True`` and no dropout.
      layout: the :class:`sp_jax.Layout` of every annotation.
      rngs: ``params`` stream.
    """

    def __init__(self, config: Any, *, layout: Layout = Layout(), rngs: nnx.Rngs):
        cfg = config
        if (cfg.positions, cfg.norm, cfg.tie_embeddings, cfg.dropout) != (
                "learned", "layernorm", True, 0.0):
            raise ValueError("GspmdGPT mirrors the default GPT only: learned positions, "
                             "layernorm, tied embeddings, no dropout.")
        self.config, self.layout = cfg, layout
        self.embed = _Embedding(cfg.vocab_size, cfg.hidden, layout, cfg.param_dtype, rngs)
        self.position = nnx.Param(nnx.initializers.normal(0.02)(
            rngs.params(), (cfg.max_seq_len, cfg.hidden), cfg.param_dtype))
        self.blocks = nnx.List([
            GspmdBlock(cfg.hidden, cfg.num_heads, cfg.mlp_hidden, layout=layout,
                       norm_epsilon=cfg.norm_epsilon, dtype=cfg.dtype,
                       param_dtype=cfg.param_dtype, rngs=rngs)
            for _ in range(cfg.num_layers)])
        self.final_norm = _LayerNorm(cfg.hidden, epsilon=cfg.norm_epsilon, dtype=cfg.dtype,
                                     param_dtype=cfg.param_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """``tokens [b, s]`` -> logits ``[b, s, V]`` (vocabulary-parallel)."""
        cfg, lay = self.config, self.layout
        table = self.embed.embedding[...].astype(cfg.dtype)
        x = jnp.take(table, tokens, axis=0)
        x = constrain(x + self.position[: tokens.shape[1]].astype(cfg.dtype)[None], lay.sp)
        for block in self.blocks:
            x = block(x)
        h = constrain(self.final_norm(x), lay.sp)
        return constrain(jnp.einsum("bsh,vh->bsv", h, table), lay.logits)

    def loss(self, tokens: jax.Array, labels: jax.Array, *, ignore_index: int = -100,
             rngs: Any = None) -> jax.Array:
        """Mean next-token cross-entropy (fp32) over the labels that are not
        ``ignore_index``; ``rngs`` is accepted and unused (no dropout)."""
        logits = self(tokens).astype(jnp.float32)
        valid = labels != ignore_index
        per_token = optax.softmax_cross_entropy_with_integer_labels(
            logits, jnp.where(valid, labels, 0))
        return jnp.sum(jnp.where(valid, per_token, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def param_specs(module: nnx.Module) -> Any:
    """The ``PartitionSpec`` of every parameter of ``module`` (an ``nnx.State``)."""
    return nnx.get_partition_spec(nnx.state(module, nnx.Param))


def copy_weights(dst: nnx.Module, src: nnx.Module) -> nnx.Module:
    """Copies ``src``'s parameter values into ``dst`` (same tree of names and global
    shapes, e.g. an sp_jax :class:`~sp_jax.models.Block` into a :class:`GspmdBlock`),
    keeping ``dst``'s own variable metadata (its sharding annotations)."""
    values = jax.tree.map(lambda a: jax.device_get(a), nnx.to_pure_dict(nnx.state(src, nnx.Param)))
    state = nnx.state(dst, nnx.Param)
    nnx.replace_by_pure_dict(state, values)
    nnx.update(dst, state)
    return dst

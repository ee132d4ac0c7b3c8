"""Pre-LN MLP in the TP+SP layout (Flax NNX) on global arrays."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sp_jax.config import ParallelConfig
from sp_jax.layers.block_config import MLP_ACTIVATIONS, MLPConfig
from sp_jax.layers.dropout import Dropout
from sp_jax.layers.linear import ColumnSequenceParallelLinear, RowSequenceParallelLinear
from sp_jax.layers.norm import make_norm
from sp_jax.layout import Layout
from sp_jax.mesh import check_activations

__all__ = ["MLP"]


class MLP(nnx.Module):
    """Pre-LN MLP with a residual: ``x + dropout(down(act(up(norm(x)))))``.

    ``up`` is a :class:`~sp_jax.layers.ColumnSequenceParallelLinear` ``[hidden,
    mlp_hidden]`` and ``down`` a :class:`~sp_jax.layers.RowSequenceParallelLinear`
    ``[mlp_hidden, hidden]``; input and output in the SP layout: per direction one
    all-gather and one reduce-scatter.

    Gated (``config.mlp_activation`` ``"swiglu"`` or ``"geglu"``): ``down(act(gate(x)) *
    up(x))`` with gate and up fused in ONE column layer ``up`` ``[hidden, 2 *
    mlp_hidden]`` whose columns are interleaved ``(j, {gate, up})``, so every tensor shard
    holds matching gate and up columns, for any tensor size dividing ``mlp_hidden``, and
    the normed input is gathered once. The activation is recomputed in the backward pass
    (only its input is kept).

    Args:
      config: the block's :class:`~sp_jax.layers.MLPConfig`.
      parallel: the :class:`~sp_jax.ParallelConfig`.
      rngs: ``params`` rng stream (the norm, ``up``, ``down``). Dropout draws from the
        ``rngs`` passed to each call in train mode.
    """

    def __init__(self, config: MLPConfig, *, parallel: ParallelConfig = ParallelConfig(),
                 rngs: nnx.Rngs):
        if not isinstance(config, MLPConfig):
            raise TypeError(f"MLP: config must be an MLPConfig (sp_jax.MLPConfig), got "
                            f"{type(config).__name__}; a GPTConfig gives its blocks' with "
                            "config.mlp_config().")
        self.config, self.parallel = config, parallel
        common = dict(parallel=parallel, dtype=config.dtype, param_dtype=config.param_dtype,
                      rngs=rngs)
        self.norm = make_norm(config.norm, config.hidden, epsilon=config.norm_epsilon,
                              **common)
        self.up = ColumnSequenceParallelLinear(
            config.hidden, (2 if config.gated else 1) * config.mlp_hidden,
            use_bias=config.mlp_bias, **common)
        self.down = RowSequenceParallelLinear(config.mlp_hidden, config.hidden,
                                              use_bias=config.mlp_bias, **common)
        self.dropout = Dropout(config.dropout, parallel=parallel)  # rngs come with each call

    def _act(self, y: jax.Array) -> jax.Array:
        if not self.config.gated:
            return self.activate(y)
        tp = Layout.of(self.parallel).tp
        return jax.shard_map(self.activate, in_specs=tp, out_specs=tp)(y)

    def activate(self, y: jax.Array) -> jax.Array:
        """Per device: the activation of this shard's ``up`` columns ``[..., width]``;
        gated, its interleaved ``(gate, up)`` column pairs -> ``[..., width / 2]``."""
        activation, gated = MLP_ACTIVATIONS[self.config.mlp_activation]
        if not gated:
            return activation(y)
        pairs = y.reshape(*y.shape[:-1], -1, 2)
        return activation(pairs[..., 0]) * pairs[..., 1]

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None,
                 rngs: Any = None) -> jax.Array:
        """``x``: ``[batch, seq, hidden]`` in the SP layout -> same shape and layout."""
        x = jnp.asarray(x)
        check_activations("MLP", x, self.config.hidden, "hidden")
        # The activation is recomputed in backward: only its input is kept (the tanh
        # approximation of gelu would otherwise keep several [b, s, mlp_hidden / t] arrays).
        y = self.down(jax.checkpoint(self._act)(self.up(self.norm(x))))
        y = self.dropout(y, deterministic=deterministic, rngs=rngs)
        return x.astype(y.dtype) + y

"""Pre-LN MLP in the TP+SP layout (Flax NNX) on global arrays."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sp_jax.config import ParallelConfig
from sp_jax.layers.block_config import MLP_ACTIVATIONS, MLPConfig, check_block_config
from sp_jax.layers.dropout import Dropout
from sp_jax.layers.linear import ColumnSequenceParallelLinear, RowSequenceParallelLinear
from sp_jax.layers.lora import LoRAParts
from sp_jax.layers.norm import make_norm
from sp_jax.mesh import check_activations

__all__ = ["MLP", "MLPActivation"]


@dataclasses.dataclass(frozen=True)
class MLPActivation:
    """The MLP activation ``name`` (a key of ``MLP_ACTIVATIONS``) as a hashable function
    of one device's ``up`` columns ``[..., width]``: elementwise, or, gated, of its
    interleaved ``(gate, up)`` column pairs -> ``[..., width / 2]``."""

    name: str

    def __call__(self, y: jax.Array) -> jax.Array:
        activation, gated = MLP_ACTIVATIONS[self.name]
        if not gated:
            return activation(y)
        pairs = y.reshape(*y.shape[:-1], -1, 2)
        return activation(pairs[..., 0]) * pairs[..., 1]


class MLP(nnx.Module):
    """Pre-LN MLP with a residual: ``x + dropout(down(act(up(norm(x)))))`` (with
    ``post_norms``: ``x + dropout(post_norm(down(...)))``, Gemma's).

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
        check_block_config("MLP", config, MLPConfig, "sp_jax.MLPConfig", "mlp_config")
        self.config, self.parallel = config, parallel
        common = dict(parallel=parallel, dtype=config.dtype, param_dtype=config.param_dtype,
                      rngs=rngs)
        self.norm = make_norm(config.norm, config.hidden, epsilon=config.norm_epsilon,
                              norm_offset=config.norm_offset, **common)
        # the gated up kernel's columns are (j, {gate, up}) pairs: PEFT's two modules
        self.up = ColumnSequenceParallelLinear(
            config.hidden, (2 if config.gated else 1) * config.mlp_hidden,
            use_bias=config.mlp_bias, fp8=config.fp8, lora=config.lora,
            lora_parts=LoRAParts(("gate", "up") if config.gated else ("up",)), **common)
        self.down = RowSequenceParallelLinear(config.mlp_hidden, config.hidden,
                                              use_bias=config.mlp_bias, fp8=config.fp8,
                                              lora=config.lora,
                                              lora_parts=LoRAParts(("down",)), **common)
        self.dropout = Dropout(config.dropout, parallel=parallel)  # rngs come with each call
        # Gemma's post_feedforward_layernorm: the down projection's output normed
        self.post_norm = make_norm(config.norm, config.hidden, epsilon=config.norm_epsilon,
                                   norm_offset=config.norm_offset, **common) \
            if config.post_norms else None

    @property
    def activation(self) -> MLPActivation:
        """The activation of this shard's ``up`` columns ``[..., width]`` (gated: its
        interleaved ``(gate, up)`` column pairs -> ``[..., width / 2]``), applied inside
        ``down``'s op (a hashable static of it)."""
        return MLPActivation(self.config.mlp_activation)

    def decode_step(self, x: jax.Array) -> jax.Array:
        """The single-token (decode) mode per device, inside a ``shard_map`` whose copy of
        this module holds its blocks of the decode layout
        (:func:`~sp_jax.layers.linear.decode_layout`): ``x`` ``[b, 1, hidden]`` whole
        rows -> ``x + down(act(up(norm(x))))``, whole rows: ``up`` multiplies this
        shard's column block (no collective), ``down`` all-reduces its partial products
        over the tensor axis (no dropout)."""
        y = self.down.local_decode(self.up.local_decode(self.norm.local(x)),
                                   activation=self.activation)
        if self.post_norm is not None:
            y = self.post_norm.local(y)
        return x.astype(y.dtype) + y

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None,
                 rngs: Any = None) -> jax.Array:
        """``x``: ``[batch, seq, hidden]`` in the SP layout -> same shape and layout."""
        x = jnp.asarray(x)
        check_activations("MLP", x, self.config.hidden, "hidden")
        # The activation runs inside the down projection's op, per device, and is computed
        # again in its backward: the hidden layer is kept once (the activation's input),
        # not also as the activation's output for the weight gradient.
        y = self.down(self.up(self.norm(x)),
                      activation=self.activation)
        if self.post_norm is not None:  # per token: the SP layout's rows
            y = self.post_norm(y)
        y = self.dropout(y, deterministic=deterministic, rngs=rngs)
        return x.astype(y.dtype) + y

"""Multi-token prediction (DeepSeek-V3's MTP, ``GPTConfig.mtp_depth``): the modules and
their training loss.

Module ``k`` (from 1) at position ``i`` takes ``h^{k-1}_i`` (the main model's final-normed
hidden state for ``k = 1``, else module ``k - 1``'s output) and the embedding of token
``t_{i+k}`` (the main model's embedding table, shared), normalises both (``enorm``,
``hnorm``), projects their concatenation ``[enorm(e), hnorm(h)]`` from ``2 hidden`` to
``hidden`` (``eh_proj``), runs one transformer :class:`~sp_jax.models.blocks.Block` (built
like the main model's last layer: a mixture of experts where that is one) and its own
final norm (``post_norm``): ``h^k_i``, whose logits under the main model's LM head
(shared) predict ``t_{i+k+1}``. The loss adds ``mtp_loss_weight`` times the mean over the
depths of each depth's mean cross-entropy (:func:`mtp_loss`).

Parameters (``GPT.mtp[k - 1]``, ``k`` from 1) and Hugging Face's DeepSeek-V3 names (MTP
layer ``k`` is ``model.layers.{num_hidden_layers + k - 1}``; the block's own weights as the
main layers' rules map ``model.layers.{n}.self_attn/mlp/...``)::

    mtp/{k-1}/enorm/scale         <- model.layers.{n}.enorm.weight
    mtp/{k-1}/hnorm/scale         <- model.layers.{n}.hnorm.weight
    mtp/{k-1}/eh_proj  [2h, h]    <- model.layers.{n}.eh_proj.weight [h, 2h], transposed
    mtp/{k-1}/block/...           <- model.layers.{n}.{input_layernorm, self_attn, ...}
    mtp/{k-1}/post_norm/scale     <- model.layers.{n}.shared_head.norm.weight
    (shared)                      <- model.layers.{n}.embed_tokens / shared_head.head
                                     (copies of the main model's; not stored apart)

Sharding: the norms and ``eh_proj`` are replicated (``eh_proj`` runs on the SP layout's
sequence shards without a collective; its gradient is reduced as any replicated
parameter's), the block is sharded as every main block (tensor, sequence, context,
experts). The shifted token ids are made on whole rows in the natural order and then put
in the held order (a shift across sequence shards, zigzag included, is the gather of
whole rows that the labels' shift already makes).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sp_jax.attention import to_held
from sp_jax.config import ParallelConfig
from sp_jax.layers import make_norm, parallel_cross_entropy
from sp_jax.layout import Layout
from sp_jax.mesh import current_mesh, reshard
from sp_jax.models.blocks import Block, Documents, run_block
from sp_jax.models.gpt_config import GPTConfig

__all__ = ["MTPModule", "mtp_loss", "mtp_targets", "shift_left"]


class MTPModule(nnx.Module):
    """One multi-token prediction module (DeepSeek-V3's MTP layer).

    Args:
      config: the :class:`GPTConfig` (``norm``, ``hidden``, the block's fields).
      parallel: the :class:`~sp_jax.ParallelConfig`.
      rngs: ``params`` rng stream.
    """

    def __init__(self, config: GPTConfig, parallel: ParallelConfig = ParallelConfig(), *,
                 rngs: nnx.Rngs):
        norm = functools.partial(make_norm, config.norm, config.hidden, parallel=parallel,
                                 epsilon=config.norm_epsilon, dtype=config.dtype,
                                 param_dtype=config.param_dtype, rngs=rngs,
                                 norm_offset=config.norm_offset)
        self.enorm, self.hnorm = norm(), norm()
        self.eh_proj = nnx.Param(nnx.initializers.lecun_normal()(
            rngs.params(), (2 * config.hidden, config.hidden), config.param_dtype))
        self.block = Block(config, parallel, rngs=rngs, index=config.num_layers - 1)
        self.post_norm = norm()
        self.dtype = config.dtype

    def project(self, e: jax.Array, h: jax.Array, *, local: bool = False) -> jax.Array:
        """``eh_proj([enorm(e), hnorm(h)])``: ``e`` (token embeddings) and ``h`` (the
        previous depth's hidden states) ``[batch, seq, hidden]`` in the SP layout (or,
        ``local``, per device inside the decode ``shard_map``, whole rows) -> the block's
        input, same shape and layout."""
        if local:
            x = jnp.concatenate([self.enorm.local(e), self.hnorm.local(h)], axis=-1)
        else:
            x = jnp.concatenate([self.enorm(e), self.hnorm(h)], axis=-1)
        dtype = jnp.result_type(x.dtype, self.dtype)
        return jnp.dot(x.astype(dtype), self.eh_proj[...].astype(dtype))


def shift_left(x: jax.Array, k: int, fill: int) -> jax.Array:
    """``x [batch, seq]`` moved ``k`` places left (``out[:, i] = x[:, i + k]``), the last
    ``k`` places ``fill``; ``x`` as whole rows (the caller gathers a sharded sequence)."""
    if k == 0:
        return x
    pad = jnp.full_like(x[:, :k], fill)
    return jnp.concatenate([x[:, k:], pad], axis=1)


def mtp_targets(tokens: jax.Array, labels: jax.Array, segment_ids: jax.Array | None,
                depth: int, ignore_index: int) -> tuple[jax.Array, jax.Array]:
    """Depth ``depth``'s inputs and targets ``[batch, seq]`` in the natural order, whole
    rows: the token ids ``t_{i+depth}`` (0 past the end) and the labels ``labels[:, i +
    depth]`` (position ``i + depth``'s next-token targets, so ``t_{i+depth+1}`` for the
    shifted tokens), ``ignore_index`` past the end and, with ``segment_ids``, where
    position ``i + depth`` is in another document than ``i``."""
    inputs = shift_left(tokens, depth, 0)
    targets = shift_left(labels, depth, ignore_index)
    if segment_ids is not None:
        same = shift_left(segment_ids, depth, -1) == segment_ids
        targets = jnp.where(same, targets, ignore_index)
    return inputs, targets


def mtp_loss(model: Any, h: jax.Array, tokens: jax.Array, labels: jax.Array, *,
             segment_ids: jax.Array | None, order: np.ndarray | None,
             documents: Documents, table: jax.Array, stream: Any,
             ignore_index: int, label_smoothing: float, z_loss: float) -> jax.Array:
    """The MTP loss of a :class:`~sp_jax.models.GPT` with ``config.mtp_depth = D``: the
    mean over the ``D`` depths of each one's mean cross-entropy (float32 scalar).

    Args:
      model: the GPT (its ``mtp`` modules, ``embed``, ``logits_from_hidden``).
      h: the main model's final-normed hidden states ``[batch, seq, hidden]``, SP
        layout, held ``order``.
      tokens / labels: int ``[batch, seq]``, natural order: the inputs and the
        next-token targets of the main loss (documents' ends already dropped).
      segment_ids: the packed rows' document ids (natural order) or None.
      documents: the held-order ``(segment_ids, positions)`` the main blocks ran with.
      table: the LM head's padded table (:meth:`GPT.vocab_table`).
      stream: draws the blocks' dropout keys, or None.
    """
    cfg, par = model.config, model.parallel
    mesh = current_mesh(par, where="GPT")
    whole = Layout.of(par).spec("activation_batch", None)
    tokens, labels = reshard(tokens, whole, mesh), reshard(labels, whole, mesh)
    if segment_ids is not None:
        segment_ids = reshard(jnp.asarray(segment_ids, jnp.int32), whole, mesh)
    total = jnp.zeros((), jnp.float32)
    for depth, module in enumerate(model.mtp, start=1):
        inputs, targets = mtp_targets(tokens, labels, segment_ids, depth, ignore_index)
        e = model.scale_embeddings(model.embed(
            to_held(inputs, order, par), table=table if model.head is None else None))
        x = module.project(e, h)
        # its router's statistics are not added to the main layers' (moe_losses: no
        # auxiliary, z or sequence-wise loss for a module's experts; its selection bias
        # still follows its loads, the load tap)
        x, _ = run_block(module.block, x, None if stream is None else stream(), cfg.remat,
                         documents)
        h = module.post_norm(x)
        targets = to_held(targets, order, par)
        per_token = parallel_cross_entropy(
            model.logits_from_hidden(h, table), targets, parallel=par,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
            vocab_size=cfg.vocab_size)
        total = total + jnp.sum(per_token) / jnp.maximum(jnp.sum(targets != ignore_index), 1)
    return total / len(model.mtp)

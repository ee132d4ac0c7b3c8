"""Decoding a :class:`~sp_jax.models.GPT` with its attention's cache, in the model's
tensor layout.

Two programs, both jitted once per shape:

- :func:`prefill`: the prompts through the training path (sequence-parallel layers,
  blockwise attention), keeping every layer's cache entries (the attention's
  ``prefill``; ``"mha"``: the rotated keys and values), and the logits at each row's
  last prompt token;
- :func:`decode_step`: one token per row through ONE ``shard_map`` over the whole model
  (Megatron's inference layout): a sequence of one token has nothing to scatter, so the
  activations are whole on every tensor shard. Inside it the layers run their own
  single-token mode (:meth:`~sp_jax.models.blocks.Block.decode_step`: the norms per
  device, the column layers multiplying their own column block with no collective, the
  row layers summing their partial products with one all-reduce over the tensor axis,
  the attention's ``decode_step`` against the cache, e.g.
  :func:`~sp_jax.attention.cached_attention`). Per token and layer: 2 all-reduces
  (attention output, MLP down-projection); per token besides: 1 all-reduce (the
  vocabulary-parallel embedding) and 1 all-gather (the vocabulary-parallel logits). A
  mixture-of-experts layer in place of the MLP (:meth:`~sp_jax.layers.MoE.decode_step`,
  its experts over the expert axis as in training): 1 all-reduce over the expert and
  tensor axes, and with an expert axis 1 all-gather of the normed rows over it before.

The parameters are read in the decode layout (training's tensor split, nothing over the
data axes: :func:`~sp_jax.layers.linear.decode_layout`), as each layer states it
(``param_specs``); :func:`to_decode_layout` reshards a model into it once.

The cache is of the type the blocks' attention states (its ``cache_type``, a
:class:`~sp_jax.layers.AttentionCache`: arrays ``[layers, batch, length, ...]`` with the
batch over the data axes and the length over the context axes, the rest as the cache type
says; ``"mha"``'s :class:`~sp_jax.layers.KVCache` holds the keys and values ``[layers,
batch, length, t * kv_local, head_dim]``, the heads over the tensor axis). This module
only asks the cache for its specs, its slots and its writes. Rows may be at different
positions: row ``b``'s token at ``positions[b]`` is written at that index and attends to
the cache entries before it (and, with ``sliding_window``, only the last
``sliding_window`` of them, itself included).

With a context axis the prompts are prefilled by ring or Ulysses attention and the cache
stays split over the context axis along the sequence: each shard keeps the prefill's
entries its attention held, the generated positions go round robin
(:func:`~sp_jax.layers.attention_registry.cache_slots`), and each decode step's
attention merges the shards' parts (``"mha"``: by log-sum-exp,
:func:`~sp_jax.attention.cached_attention`'s ``axis_name``). A pipelined model decodes
after :func:`unpipelined` (``model.for_decoding()``) gathers its blocks off the stage
axis.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from sp_jax.attention import sequence_order, to_held
from sp_jax.config import ParallelConfig
from sp_jax.layers import AttentionCache, KVCache
from sp_jax.layers.attention_registry import cache_slots
from sp_jax.layers.embedding import padded_vocab_size, vocab_parallel_lookup
from sp_jax.layers.linear import decode_layout
from sp_jax.layout import Layout
from sp_jax.mesh import Mesh, axis_size, current_mesh, reshard
from sp_jax.models.blocks import Segments, decode_blocks, prefill_blocks
from sp_jax.ops.primitives import all_gather_invariant

# KVCache and cache_slots: "mha"'s cache type and the context split, kept importable here
__all__ = ["KVCache", "cache_index", "cache_slots", "check_decodable", "decode_step",
           "embed_local", "hidden_at", "local_logits", "merge_parts", "param_parts", "prefill",
           "prefill_states", "to_decode_layout", "unpipelined", "vocab_tables"]


def check_decodable(model: Any) -> None:
    """A ValueError when ``model`` cannot decode as it is (``model.check_decodable()``:
    a wrapper laid out otherwise, e.g. on pipeline stages, decodes as
    ``model.for_decoding()`` gives it). :mod:`sp_jax.compat`'s other refusals of
    ``"generate"`` are raised where the layers are built."""
    model.check_decodable()


# -- the decode layout of the parameters ---------------------------------------------------


def param_parts(module: nnx.Module, mesh: Mesh, par: ParallelConfig, stacked: bool
           ) -> tuple[Any, list[jax.Array], list[P]]:
    """``module``'s graph, its parameter leaves resharded into the decode layout, and
    their specs: each parallel layer's own specs under
    :func:`~sp_jax.layers.linear.decode_layout` (its ``param_specs``; a leading layer
    axis when ``stacked``), every other parameter (norm scales, ...) whole."""
    layout = decode_layout(par)
    layers = {}
    for path, sub in nnx.iter_modules(module):
        if hasattr(sub, "param_specs"):  # a parallel layer states its parameters' layout
            for name, spec in sub.param_specs(layout, mesh).items():
                layers[(*path, name)] = P(None, *spec) if stacked else spec
    graph, state = nnx.split(module)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves, specs = [], []
    for path, leaf in flat:
        names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        spec = layers.get(names, P(*(None,) * jnp.ndim(leaf)))
        leaves.append(reshard(leaf, spec, mesh) if isinstance(leaf, jax.Array) else leaf)
        specs.append(spec)
    return (graph, treedef), leaves, specs


def _stacks(model: Any) -> list[Any]:
    """The modules holding ``model``'s layers: ``blocks`` (stacked or a list), after
    the stacked dense layers (``dense_blocks``) when it has them."""
    return [m for m in (model.dense_blocks, model.blocks) if m is not None]


def merge_parts(graph_treedef: tuple[Any, Any], leaves: list[jax.Array]) -> nnx.Module:
    graph, treedef = graph_treedef
    return nnx.merge(graph, jax.tree_util.tree_unflatten(treedef, leaves))


def local_logits(model: Any, h: jax.Array, table: jax.Array) -> jax.Array:
    """Per device: fp32 logits ``[b, vocab_size]`` of final-normed ``h [b, hidden]``
    with this shard's vocabulary block ``table [Vp / t, hidden]`` (one all-gather),
    soft-capped as the training head's (``GPT.cap_logits``)."""
    local = jnp.dot(h, table.T.astype(jnp.result_type(h.dtype, table.dtype)))
    local = model.cap_logits(local)
    return all_gather_invariant(local, model.parallel.tensor_axis, -1)[
        :, :model.config.vocab_size].astype(jnp.float32)


# -- the two programs -------------------------------------------------------------------


def _padded(table: nnx.Module, mesh: Mesh) -> jax.Array:
    """A vocabulary table ``[V, hidden]`` padded to a multiple of the tensor size, in the
    decode layout ``P(tensor, None)`` (no fsdp split: whole rows for the lookups)."""
    value = table.embedding[...]
    pad = padded_vocab_size(value.shape[0], axis_size(mesh, table.parallel.tensor_axis)) \
        - value.shape[0]
    if pad:
        value = jnp.pad(value, ((0, pad), (0, 0)))
    return reshard(value, decode_layout(table.parallel).vocab_table, mesh)


def vocab_tables(model: Any, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
    """The embedding's and the LM head's padded tables, ``P(tensor, None)``."""
    embed = _padded(model.embed, mesh)
    return embed, embed if model.head is None else _padded(model.head, mesh)


def to_decode_layout(model: Any) -> None:
    """Reshards ``model``'s parameters in place into the layout :func:`decode_step`
    reads (the tensor split of training, nothing over the data axes): done once before
    decoding, so that a model sharded by fsdp is not gathered again at every token. The
    training path still runs on it (its layers reshard to their layouts by slicing)."""
    par, cfg = model.parallel, model.config
    mesh = current_mesh(par, where="generate")
    t = axis_size(mesh, par.tensor_axis)
    stacks = [(m, cfg.scan_layers) for m in _stacks(model)]
    mtp = [(m, False) for m in (getattr(model, "mtp", None) or ())]
    for module, stacked in (*stacks, *mtp, (model.final_norm, False)):
        (graph, treedef), leaves, _ = param_parts(module, mesh, par, stacked)
        nnx.update(module, jax.tree_util.tree_unflatten(treedef, leaves))
    for table in (model.embed, model.head):
        if table is not None:
            # set_value, not [...] = (a scatter into the old array, whose sharding the
            # new one need not have: parameters loaded unsharded)
            table.embedding.set_value(reshard(
                table.embedding[...], decode_layout(par).vocab_table
                if table.embedding.shape[0] % t == 0 else P(), mesh))
    if model.position is not None:
        model.position.set_value(reshard(model.position[...], P(), mesh))


def unpipelined(model: Any) -> Any:
    """The model that prefill and decode steps run: ``model.for_decoding()`` (a GPT
    itself; a GPT on pipeline stages, its re-layout without them: the same config and
    parameters, the blocks all-gathered off the stage axis,
    :meth:`sp_jax.pipeline.PipelinedGPT.for_decoding`). ``model`` itself is not
    changed."""
    return model.for_decoding()


def prefill(model: Any, tokens: jax.Array, last: jax.Array, length: int
            ) -> tuple[jax.Array, AttentionCache]:
    """The prompts through the training path.

    Args:
      model: a :class:`~sp_jax.models.GPT` in eval mode.
      tokens: ``[batch, seq]`` prompts, right-padded (``seq`` a multiple of the
        sequence shards ``context x tensor``, and of ``2 x context`` with ring
        attention); padding never reaches a prompt token (causal attention).
      last: int ``[batch]``: each row's last prompt position.
      length: the cache length (at least ``seq``; with a context axis of ``c`` shards
        rounded up to ``seq`` + a multiple of ``c``).
    Returns:
      fp32 logits ``[batch, vocab_size]`` at ``last``, and the cache of every position,
      of the attention's cache type (:class:`~sp_jax.layers.KVCache` for ``"mha"``;
      entries at and after a row's padding are overwritten by decoding before they are
      read). With a context axis each shard keeps the entries its attention computed
      (ring attention's zigzag parts, Ulysses' contiguous ones) and the generated
      positions are spread over the shards (:meth:`~sp_jax.layers.AttentionCache.slots`).
    """
    h, cache = prefill_states(model, tokens, length)
    mesh = current_mesh(model.parallel, where="generate")
    _, head = vocab_tables(model, mesh)
    return hidden_at(model, h, last, head), cache


def prefill_states(model: Any, tokens: jax.Array, length: int
                   ) -> tuple[jax.Array, AttentionCache]:
    """:func:`prefill`'s forward: the final-normed hidden states ``[batch, seq, hidden]``
    of every prompt position (SP layout, the held order of
    :meth:`~sp_jax.models.GPT.sequence_order`) and the cache of ``length`` (as
    :func:`prefill`'s)."""
    check_decodable(model)
    par = model.parallel
    mesh = current_mesh(par, where="generate")
    layout = Layout.of(par)
    order = model.sequence_order(tokens)  # ring attention's zigzag, else None
    x = model.embed_tokens(to_held(tokens, order, par),
                           model.vocab_table() if model.head is None else None, order)
    x, entries = prefill_blocks(model.layers, x)
    shards = axis_size(mesh, par.context_axes)
    seq = tokens.shape[1]
    extra = -(-(max(length, seq) - seq) // shards)  # each shard's slots for new tokens
    return model.final_norm(x), entries.grown(seq, extra, layout, mesh)


def hidden_at(model: Any, h: jax.Array, at: jax.Array, table: jax.Array | None = None
              ) -> jax.Array:
    """Row ``b``'s hidden state at position ``at[b]`` of ``h [batch, seq, hidden]`` (SP
    layout, held order): ``[batch, hidden]`` whole rows, batch over the data axes; with
    ``table`` (the head's, :func:`vocab_tables`) its fp32 logits ``[batch, vocab_size]``
    instead (:func:`local_logits`)."""
    par = model.parallel
    mesh = current_mesh(par, where="generate")
    layout = Layout.of(par)
    order = sequence_order(par, mesh, h.shape[1])
    held = np.arange(h.shape[1]) if order is None else np.argsort(order)  # position -> held
    seq_axes = (*par.context_axes, par.tensor_axis)

    def pick(h, at, *table):  # this device's sequence shard holds some rows' position
        s = h.shape[1]
        at = jnp.asarray(held, jnp.int32)[at] - lax.axis_index(seq_axes) * s
        inside = (at >= 0) & (at < s)
        row = jnp.take_along_axis(h, jnp.clip(at, 0, s - 1)[:, None, None], axis=1)[:, 0]
        row = lax.psum(jnp.where(inside[:, None], row, jnp.zeros((), row.dtype)), seq_axes)
        return local_logits(model, row, table[0]) if table else row

    batch = layout.spec("activation_batch")
    tables = () if table is None else (table,)
    return jax.shard_map(
        pick, in_specs=(layout.sp, batch, *(decode_layout(par).vocab_table,) * len(tables)),
        out_specs=layout.spec("activation_batch", None))(
        reshard(h, layout.sp, mesh), reshard(at, batch, mesh), *tables)


def cache_index(slots: Any, positions: jax.Array, length: int,
                axes: tuple[str, ...]) -> tuple[jax.Array | None, jax.Array]:
    """Per device: ``(cache_positions, at)``: the positions this shard's cache entries
    hold (None: entry ``j`` holds position ``j``) and where each row's entry of
    ``positions`` is written in it (``length``, dropped by the write, where another
    context shard keeps it or the position is negative), from the cache's ``slots``
    (:meth:`~sp_jax.layers.AttentionCache.slots`; None without a context axis)."""
    if slots is None:
        return None, jnp.where(positions >= 0, positions, length)
    shard = lax.axis_index(axes)
    p = jnp.maximum(positions, 0)
    at = jnp.where((jnp.asarray(slots[1])[p] == shard) & (positions >= 0),
                   jnp.asarray(slots[2])[p], length)
    return jnp.asarray(slots[0])[shard], at


def embed_local(model: Any, embed: jax.Array, tokens: jax.Array) -> jax.Array:
    """Per device: the token embeddings ``[b, T, hidden]`` (whole rows; scaled as
    ``GPT.embed_tokens``'s, no learned positions) of ``tokens [b, T]`` (``[b]``: ``T =
    1``) from this shard's vocabulary block ``embed [Vp / t, hidden]`` (one all-reduce
    over the tensor axis)."""
    tensor = model.parallel.tensor_axis
    tokens = tokens[:, None] if tokens.ndim == 1 else tokens
    x = lax.psum(vocab_parallel_lookup(tokens, embed, tensor,
                                       model.config.vocab_size), tensor)
    if model.embed.dtype is not None:
        x = x.astype(model.embed.dtype)
    return model.scale_embeddings(x)  # as GPT.embed_tokens


def decode_step(model: Any, cache: AttentionCache, tokens: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, AttentionCache]:
    """One token of every row.

    Args:
      model: a :class:`~sp_jax.models.GPT` in eval mode.
      cache: the cache :func:`prefill` made (the attention's cache type, e.g.
        :class:`~sp_jax.layers.KVCache`; donate it: it is updated in place).
      tokens: int ``[batch]``: each row's token.
      positions: int ``[batch]``: each row's position of that token (its cache entries
        are written there: :meth:`~sp_jax.layers.AttentionCache.write`).
    Returns:
      fp32 logits ``[batch, vocab_size]`` of the next token, and the updated cache.
    """
    check_decodable(model)
    par, cfg = model.parallel, model.config
    mesh = current_mesh(par, where="generate")
    layout = Layout.of(par)
    embed, head = vocab_tables(model, mesh)
    parts = [param_parts(m, mesh, par, cfg.scan_layers) for m in _stacks(model)]
    blocks = [graph for graph, _, _ in parts]
    block_leaves, block_specs = [p[1] for p in parts], [p[2] for p in parts]
    final, final_leaves, final_specs = param_parts(model.final_norm, mesh, par, False)
    position = None if model.position is None else reshard(model.position[...], P(), mesh)
    batch = layout.spec("activation_batch")
    cache_specs = cache.specs(layout)
    shards = axis_size(mesh, par.context_axes)
    slots = cache.slots(shards, sequence_order(par, mesh, cache.prompt)) \
        if par.context_axes else None

    def local(block_leaves, final_leaves, embed, head, position, cache, tokens, positions):
        # this shard's part of the cache, and the new entries in it
        cache_positions, at = cache_index(slots, positions, cache.length, par.context_axes)
        x = embed_local(model, embed, tokens)
        if position is not None:
            x = x + jnp.take(position, positions, axis=0)[:, None].astype(x.dtype)
        stacks = [merge_parts(g, leaves) for g, leaves in zip(blocks, block_leaves, strict=True)]
        layers = stacks[0] if len(stacks) == 1 else Segments(tuple(stacks))
        x, new = decode_blocks(layers, x, cache, positions, cache_positions)
        h = merge_parts(final, final_leaves).local(x)[:, 0]
        cache = cache.write(new, jnp.arange(tokens.shape[0]), at)
        return local_logits(model, h, head), cache

    table_spec = decode_layout(par).vocab_table
    return jax.shard_map(
        local,
        in_specs=(block_specs, final_specs, table_spec, table_spec,
                  None if position is None else P(), cache_specs, batch, batch),
        out_specs=(layout.spec("activation_batch", None), cache_specs))(
        block_leaves, final_leaves, embed, head, position, cache,
        reshard(tokens, batch, mesh), reshard(positions, batch, mesh))

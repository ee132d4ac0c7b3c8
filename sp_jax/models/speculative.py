"""Speculative decoding with the multi-token prediction modules (``generate(...,
speculative="mtp")``, greedy): the ``D`` MTP modules draft ``D`` tokens, the main model
verifies them in one forward over the ``D + 1`` positions, and each row keeps the longest
prefix of drafts equal to the main model's greedy tokens plus the main model's next
token. Every kept token is the main model's argmax after the tokens before it.

One step, per device inside one ``shard_map`` (Megatron's inference layout, as
:func:`~sp_jax.models.decode.decode_step`): the main model's layers run once on the ``D +
1`` tokens ``n .. n + D`` of each row (the committed token and the drafts; each layer's
weights read once, :func:`~sp_jax.attention.cached_attention` with ``D + 1`` causal
queries), writing their cache entries at those positions and giving the greedy tokens
``g_0 .. g_D``; then module 1 runs once on ``(h^0_{n+i}, g_i)`` at positions ``n + i``, and
module ``k > 1`` once on ``(h^{k-1}, g_i)`` one position behind module ``k - 1`` (positions
``n + i - k + 1``: its first input ``h^{k-1}`` the carry from the last step, the others
module ``k - 1``'s outputs of this step), so each module's cache holds the committed
tokens' entries up to where its inputs are known. Then: ``a`` accepted drafts per row,
the new tokens ``g_0 .. g_a``, and the next drafts from position ``q = n + a`` (module 1's
output there, then modules ``2 .. D`` on the drafts before them, one token each).
Entries written at positions past the accepted ones are rolled back by not advancing the
row: attention reads cache entries at positions below a step's first only, and they are
overwritten before a later step's tokens pass them. A module's tokens at negative
positions (the first steps after a one-token prompt) are no tokens: their entries are
dropped and no token attends to them.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from sp_jax.attention import sequence_order, to_held
from sp_jax.layers import AttentionCache, token_positions
from sp_jax.layers.linear import decode_layout
from sp_jax.layout import Layout
from sp_jax.mesh import axis_size, current_mesh, reshard
from sp_jax.models.blocks import Segments, decode_blocks, prefill_blocks
from sp_jax.models.decode import (
    cache_index,
    embed_local,
    hidden_at,
    local_logits,
    merge_parts,
    param_parts,
    prefill_states,
    vocab_tables,
)

__all__ = ["mtp_prefill", "programs", "speculative_step"]


def _parts(model: Any, mesh: Any) -> tuple[list[Any], list[Any], list[Any]]:
    """Graphs, decode-layout leaves and specs of the main stacks, the final norm and each
    MTP module, in that order."""
    par, cfg = model.parallel, model.config
    stacks = [m for m in (model.dense_blocks, model.blocks) if m is not None]
    parts = [param_parts(m, mesh, par, cfg.scan_layers) for m in stacks]
    parts += [param_parts(m, mesh, par, False) for m in (model.final_norm, *model.mtp)]
    return [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts]


def _slots(model: Any, mesh: Any, cache: AttentionCache) -> Any:
    par = model.parallel
    return cache.slots(axis_size(mesh, par.context_axes),
                       sequence_order(par, mesh, cache.prompt)) if par.context_axes else None


class _Local:
    """The per-device pieces of one program: the main model's token step and each MTP
    module's, on the merged decode-layout modules."""

    def __init__(self, model: Any, graphs: list[Any], leaves: list[Any], embed: jax.Array,
                 head: jax.Array, slots: Any, position: jax.Array | None):
        n = len(graphs) - 1 - len(model.mtp)
        stacks = [merge_parts(g, v) for g, v in zip(graphs[:n], leaves[:n], strict=True)]
        self.layers = stacks[0] if len(stacks) == 1 else Segments(tuple(stacks))
        self.final = merge_parts(graphs[n], leaves[n])
        self.mtp = [merge_parts(g, v) for g, v in
                    zip(graphs[n + 1:], leaves[n + 1:], strict=True)]
        self.model, self.embed, self.head, self.slots = model, embed, head, slots
        self.position = position  # the learned position table, whole, or None

    def _write(self, layers: Any, x: jax.Array, cache: AttentionCache, positions: jax.Array
               ) -> tuple[jax.Array, AttentionCache]:
        """``x [b, T, hidden]``: ``T`` tokens a row from ``positions [b]`` through
        ``layers``, their entries written in ``cache``."""
        cache_positions, at = cache_index(self.slots, token_positions(positions, x.shape[1]),
                                          cache.length, self.model.parallel.context_axes)
        x, new = decode_blocks(layers, x, cache, positions, cache_positions)
        return x, cache.write(new, jnp.arange(x.shape[0]), at)

    def main(self, cache: AttentionCache, tokens: jax.Array, positions: jax.Array
             ) -> tuple[jax.Array, jax.Array, AttentionCache]:
        """Tokens ``[b, T]`` from ``positions [b]`` through the main model in one
        forward: final-normed ``h [b, T, hidden]``, greedy next tokens ``[b, T]``, the
        cache."""
        x = embed_local(self.model, self.embed, tokens)
        if self.position is not None:  # as decode_step
            x = x + jnp.take(self.position, token_positions(positions, tokens.shape[1]),
                             axis=0).astype(x.dtype)
        x, cache = self._write(self.layers, x, cache, positions)
        h = self.final.local(x)
        return h, self.draft(h), cache

    def module(self, k: int, cache: AttentionCache, h: jax.Array, tokens: jax.Array,
               positions: jax.Array) -> tuple[jax.Array, AttentionCache]:
        """MTP module ``k`` (from 0) on the previous depth's ``h [b, T, hidden]`` and
        ``tokens [b, T]`` from ``positions [b]`` (negative ones: no tokens):
        ``h^{k+1}`` and its cache."""
        m = self.mtp[k]
        x = m.project(embed_local(self.model, self.embed, tokens), h, local=True)
        x, cache = self._write([m.block], x, cache, positions)
        return m.post_norm.local(x), cache

    def draft(self, h: jax.Array) -> jax.Array:
        """The greedy tokens ``[b, T]`` of final-normed ``h [b, T, hidden]``."""
        b, steps, hidden = h.shape
        logits = local_logits(self.model, h.reshape(b * steps, hidden), self.head)
        return jnp.argmax(logits, -1).astype(jnp.int32).reshape(b, steps)

    def chain(self, caches: list[AttentionCache], h1: jax.Array, q: jax.Array
              ) -> tuple[jax.Array, list[AttentionCache]]:
        """The drafts ``[b, D]`` from position ``q``: module 1's output there ``h1``, then
        modules ``2 .. D`` on the drafts before them (their entries at ``q`` written)."""
        drafts, h = [self.draft(h1)], h1
        for k in range(1, len(self.mtp)):
            h, caches[k] = self.module(k, caches[k], h, drafts[-1], q)
            drafts.append(self.draft(h))
        return jnp.concatenate(drafts, axis=1), caches


def _specs(model: Any, mesh: Any, cache: AttentionCache) -> tuple[Any, ...]:
    layout = Layout.of(model.parallel)
    batch = layout.spec("activation_batch")
    rows = layout.spec("activation_batch", None)
    carry = P(None, *batch, None, None)
    return layout, batch, rows, carry, cache.specs(layout)


def mtp_prefill(model: Any, tokens: jax.Array, lengths: jax.Array, first: jax.Array,
                length: int) -> tuple[Any, ...]:
    """The prompts through the main model and the MTP modules (training path) and the
    first drafts.

    Args:
      model: a GPT with ``mtp`` modules, in eval mode, its parameters in the decode
        layout.
      tokens: ``[batch, seq]`` right-padded prompts; lengths: ``[batch]``.
      first: ``[batch]`` the main model's greedy token after each prompt.
      length: the caches' length.
    Returns:
      ``(cache, mtp_caches, drafts [batch, D], carry [D - 1, batch, 1, hidden])``: the
      main model's cache, one cache per module (each with one layer), the first drafts
      and each module ``k < D``'s output at the position module ``k + 1`` runs next.
    """
    par = model.parallel
    mesh = current_mesh(par, where="generate")
    layout = Layout.of(par)
    depth = len(model.mtp)
    h, cache = prefill_states(model, tokens, length)
    b, seq = tokens.shape
    whole = reshard(tokens, layout.spec("activation_batch", None), mesh)
    full = jnp.pad(whole, ((0, 0), (0, depth)))  # [b, seq + D]: t_L written at L
    batch = layout.spec("activation_batch")
    at_end = jnp.arange(seq + depth)[None] == reshard(lengths, batch, mesh)[:, None]
    full = jnp.where(at_end, reshard(first, batch, mesh).astype(full.dtype)[:, None], full)
    order = model.sequence_order(tokens)
    table = model.vocab_table() if model.head is None else None
    caches, carry, h1 = [], [], None
    for k, module in enumerate(model.mtp, start=1):
        e = model.scale_embeddings(model.embed(to_held(full[:, k:k + seq], order, par),
                                               table=table))
        x, entries = prefill_blocks([module.block], module.project(e, h))
        h = module.post_norm(x)
        shards = axis_size(mesh, par.context_axes)
        caches.append(entries.grown(seq, -(-(max(length, seq) - seq) // shards), layout,
                                    mesh))
        if k == 1:
            h1 = hidden_at(model, h, lengths - 1)
        if k < depth:  # module k + 1 runs next at position length - k
            carry.append(hidden_at(model, h, jnp.maximum(lengths - k, 0)))
    drafts, caches = _draft_program(model, caches, h1[:, None], lengths - 1)
    hidden = h1.shape[-1]
    carry = jnp.stack(carry)[:, :, None] if carry else jnp.zeros((0, b, 1, hidden), h1.dtype)
    return cache, caches, drafts, carry


def _draft_program(model: Any, caches: list[AttentionCache], h1: jax.Array, q: jax.Array
                   ) -> tuple[jax.Array, list[AttentionCache]]:
    mesh = current_mesh(model.parallel, where="generate")
    graphs, leaves, specs = _parts(model, mesh)
    embed, head = vocab_tables(model, mesh)
    slots = _slots(model, mesh, caches[0])
    layout, batch, rows, _, cache_specs = _specs(model, mesh, caches[0])
    table = decode_layout(model.parallel).vocab_table

    def local(leaves, embed, head, caches, h1, q):
        return _Local(model, graphs, leaves, embed, head, slots, None).chain(list(caches), h1,
                                                                            q)

    return jax.shard_map(
        local, in_specs=(specs, table, table, [cache_specs] * len(caches), P(*batch, None, None),
                         batch),
        out_specs=(rows, [cache_specs] * len(caches)))(
        leaves, embed, head, caches, reshard(h1, P(*batch, None, None), mesh),
        reshard(q, batch, mesh))


def speculative_step(model: Any, cache: AttentionCache, caches: list[AttentionCache],
                     token: jax.Array, drafts: jax.Array, carry: jax.Array,
                     positions: jax.Array) -> tuple[Any, ...]:
    """One speculative step of every row (see the module's docstring).

    Args:
      cache / caches: the main model's and the MTP modules' caches (donate them).
      token: ``[b]`` each row's newest committed token, at ``positions [b]``.
      drafts: ``[b, D]`` the drafts of the next ``D`` positions.
      carry: ``[D - 1, b, 1, hidden]`` (from :func:`mtp_prefill` or the last step).
    Returns:
      ``(new [b, D + 1], accepted [b], drafts, carry, cache, caches)``: row ``b``'s new
      tokens are ``new[b, :accepted[b] + 1]``, its next committed token
      ``new[b, accepted[b]]`` at ``positions + accepted + 1``.
    """
    mesh = current_mesh(model.parallel, where="generate")
    graphs, leaves, specs = _parts(model, mesh)
    embed, head = vocab_tables(model, mesh)
    slots = _slots(model, mesh, cache)
    layout, batch, rows, carry_spec, cache_specs = _specs(model, mesh, cache)
    table = decode_layout(model.parallel).vocab_table
    depth = len(model.mtp)

    position = None if model.position is None else reshard(model.position[...], P(), mesh)

    def local(leaves, embed, head, position, cache, caches, token, drafts, carry, positions):
        run = _Local(model, graphs, leaves, embed, head, slots, position)
        inputs = jnp.concatenate([token[:, None], drafts], axis=1)  # [b, D + 1]
        caches = list(caches)
        h, g, cache = run.main(cache, inputs, positions)  # one forward over D + 1 tokens
        outs = []
        for k in range(depth):  # module k + 1 at positions - k .. positions - k + D
            if k:  # its input at its first position: the carry; then module k's outputs
                h = jnp.concatenate([carry[k - 1], h[:, :depth]], axis=1)
            h, caches[k] = run.module(k, caches[k], h, g, positions - k)
            outs.append(h)
        match = (inputs[:, 1:] == g[:, :-1]).astype(jnp.int32)
        accepted = jnp.sum(jnp.cumprod(match, axis=1), axis=1)
        rows_ = jnp.arange(g.shape[0])
        h1 = outs[0][rows_, accepted][:, None]  # [b, 1, hidden]: module 1 at n + a
        # module k + 1's first input next step, h^k at n + a + 1 - k: module k's index a
        carry = (jnp.stack([o[rows_, accepted][:, None] for o in outs[:-1]]) if depth > 1
                 else carry)
        drafts, caches = run.chain(caches, h1, positions + accepted)
        return g, accepted, drafts, carry, cache, caches

    return jax.shard_map(
        local,
        in_specs=(specs, table, table, None if position is None else P(), cache_specs,
                  [cache_specs] * depth, batch, rows, carry_spec, batch),
        out_specs=(rows, batch, rows, carry_spec, cache_specs, [cache_specs] * depth))(
        leaves, embed, head, position, cache, caches, reshard(token, batch, mesh),
        reshard(drafts, rows, mesh), reshard(carry, carry_spec, mesh),
        reshard(positions, batch, mesh))


@functools.lru_cache(maxsize=8)
def programs(graph: Any):
    """The jitted MTP prefill and speculative step of a model graph (cached)."""

    @functools.partial(jax.jit, static_argnums=(4,))
    def first(state, tokens, lengths, first_tokens, length):
        return mtp_prefill(nnx.merge(graph, state), tokens, lengths, first_tokens, length)

    @functools.partial(jax.jit, donate_argnums=(1, 2))
    def step(state, cache, caches, token, drafts, carry, positions):
        return speculative_step(nnx.merge(graph, state), cache, caches, token, drafts, carry,
                                positions)

    return first, step


"""Decoding a :class:`~sp_jax.models.GPT` with a key/value cache, in the model's tensor
layout.

Two programs, both jitted once per shape:

- :func:`prefill`: the prompts through the training path (sequence-parallel layers,
  blockwise attention), keeping every layer's rotated keys and values, and the logits
  at each row's last prompt token;
- :func:`decode_step`: one token per row through ONE ``shard_map`` over the whole model
  (Megatron's inference layout): a sequence of one token has nothing to scatter, so the
  activations are whole on every tensor shard, the column layers multiply their own
  column block (no collective) and the row layers sum their partial products with one
  all-reduce over the tensor axis. Per token and layer: 2 all-reduces (attention output,
  MLP down-projection); per token besides: 1 all-reduce (the vocabulary-parallel
  embedding) and 1 all-gather (the vocabulary-parallel logits).

The cache (:class:`KVCache`) is ``[layers, batch, length, t * kv_local, head_dim]``
sharded ``P(None, data, None, tensor, None)``: batch over the data axes, the key/value
heads as training holds them (split over the tensor axis when its size divides them,
else the one each shard's query heads read; :func:`~sp_jax.layers.kv_heads_per_shard`).
Rows may be at different positions: row ``b``'s token at ``positions[b]`` is written at
that index and attends to the cache entries before it (and, with
``sliding_window``, only the last ``sliding_window`` of them, itself included).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

from sp_jax.compat import check
from sp_jax.config import ParallelConfig
from sp_jax.layers import kv_heads_replicated
from sp_jax.layers.embedding import padded_vocab_size, vocab_parallel_lookup
from sp_jax.layers.norm import RMSNorm, layer_norm, rms_norm
from sp_jax.layout import Layout
from sp_jax.mesh import Mesh, axis_size, current_mesh, reshard
from sp_jax.ops.primitives import all_gather_invariant

__all__ = ["KVCache", "cached_attention", "check_decodable", "decode_step", "prefill",
           "to_decode_layout"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Every layer's keys and values, ``[layers, batch, length, t * kv_local, head_dim]``
    each, sharded ``P(None, data, None, tensor, None)`` (rotary angles applied)."""

    k: jax.Array
    v: jax.Array


def check_decodable(model: Any) -> None:
    """A ValueError when ``model`` cannot decode: pipeline stages, or a context axis
    larger than 1 (the cache would be split over the sequence)."""
    par: ParallelConfig = model.parallel
    features = {}
    if model.config.num_experts:
        features["experts"] = ("the model has mixture-of-experts layers (num_experts="
                               f"{model.config.num_experts})")
    if par.pipeline_axis is not None:
        features["pipeline"] = f"the model has ParallelConfig(pipeline_axis={par.pipeline_axis!r})"
    check("generate", features, where="generate")
    mesh = current_mesh(par, where="generate")
    if par.context_parallel and axis_size(mesh, par.context_axes) > 1:
        check("generate", {f"context_{par.context_parallel}": (
            f"context_parallel={par.context_parallel!r} over a context axis of size "
            f"{axis_size(mesh, par.context_axes)}")}, where="generate")


# -- the decode layout of the parameters ---------------------------------------------------

# (module, parameter) -> how a tensor shard holds it in decoding: "column" (output
# features split), "row" (input features split), "whole" (replicated), or "kv" (the
# grouped-query kv kernel / bias: split, or whole when replicated over the tensor axis).
_DECODE_RULES = {
    ("qkv", "kernel"): "column", ("qkv", "bias"): "column",
    ("qkv", "q_kernel"): "column", ("qkv", "q_bias"): "column",
    ("qkv", "kv_kernel"): "kv", ("qkv", "kv_bias"): "kv",
    ("up", "kernel"): "column", ("up", "bias"): "column",
    ("out", "kernel"): "row", ("down", "kernel"): "row",
}


def _decode_spec(path: tuple[Any, ...], ndim: int, stacked: bool, tensor: str,
                 kv_replicated: bool) -> P:
    """The decode sharding of the block parameter at ``path`` (``ndim`` dims, a leading
    layer axis when ``stacked``): the tensor split of training without fsdp."""
    names = tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
    kind = _DECODE_RULES.get(names[-2:], "whole")
    if kind == "kv":
        kind = "whole" if kv_replicated else "column"
    lead = (None,) if stacked else ()
    body = ndim - len(lead)
    if kind == "column":
        return P(*lead, *(None,) * (body - 1), tensor)
    if kind == "row" and body == 2:
        return P(*lead, tensor, None)
    return P(*lead, *(None,) * body)


def _parts(module: nnx.Module, mesh: Mesh, par: ParallelConfig, stacked: bool,
           kv_replicated: bool) -> tuple[Any, list[jax.Array], list[P]]:
    """``module``'s graph, its parameter leaves resharded into the decode layout, and
    their specs."""
    graph, state = nnx.split(module)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves, specs = [], []
    for path, leaf in flat:
        spec = _decode_spec(path, jnp.ndim(leaf), stacked, par.tensor_axis, kv_replicated) \
            if jnp.ndim(leaf) else P()
        leaves.append(reshard(leaf, spec, mesh) if isinstance(leaf, jax.Array) else leaf)
        specs.append(spec)
    return (graph, treedef), leaves, specs


def _merge(graph_treedef: tuple[Any, Any], leaves: list[jax.Array]) -> nnx.Module:
    graph, treedef = graph_treedef
    return nnx.merge(graph, jax.tree_util.tree_unflatten(treedef, leaves))


# -- per-device pieces -------------------------------------------------------------------


def _norm(norm: nnx.Module, x: jax.Array) -> jax.Array:
    """Per device: a LayerNorm / RMSNorm of whole rows (its parameters replicated)."""
    scale = norm.scale[...] if norm.scale is not None else None
    dtype = norm.dtype if norm.dtype is not None else jnp.result_type(x, scale)
    if isinstance(norm, RMSNorm):
        return rms_norm(x, scale, epsilon=norm.epsilon, dtype=dtype)
    bias = norm.bias[...] if norm.bias is not None else None
    return layer_norm(x, scale, bias, epsilon=norm.epsilon, dtype=dtype)


def _dense(dtype: Any, x: jax.Array, kernel: jax.Array,
           bias: jax.Array | None, reduce_over: str | None = None) -> jax.Array:
    """Per device: ``x @ kernel`` in the compute ``dtype`` (None: the promoted dtype of
    ``x`` and ``kernel``, as the layers compute); a row layer's partial products summed
    over ``reduce_over`` (one all-reduce) before its bias."""
    if dtype is None:
        dtype = jnp.result_type(x.dtype, kernel.dtype)
    y = jnp.dot(x.astype(dtype), kernel.astype(dtype))
    if reduce_over is not None:
        y = lax.psum(y, reduce_over)
    return y if bias is None else y + bias.astype(dtype)


def _qkv(attention: nnx.Module, x: jax.Array) -> jax.Array:
    """Per device: this shard's q/k/v projection columns of whole rows ``x``."""
    qkv = attention.qkv
    if hasattr(qkv, "kernel"):
        return _dense(qkv.dtype, x, qkv.kernel[...],
                      None if qkv.bias is None else qkv.bias[...])
    replicated = kv_heads_replicated(attention.config.num_kv_heads,
                                     lax.axis_size(attention.parallel.tensor_axis), "generate")
    kernel, bias = qkv.local_kernel(
        qkv.q_kernel[...], qkv.kv_kernel[...],
        None if qkv.q_bias is None else qkv.q_bias[...],
        None if qkv.kv_bias is None else qkv.kv_bias[...], replicated)
    return _dense(attention.config.dtype, x, kernel, bias)


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array,
                     v_cache: jax.Array, positions: jax.Array,
                     sliding_window: int | None = None) -> jax.Array:
    """Per device: one query token per row against its cache.

    Args:
      q: ``[b, 1, heads, d]`` (rotary applied); ``k`` / ``v``: ``[b, 1, kv_heads, d]`` of
        the same token (``heads`` a multiple of ``kv_heads``: consecutive query heads
        share a key/value head).
      k_cache / v_cache: ``[b, length, kv_heads, d]``; entries ``< positions[b]`` are row
        ``b``'s earlier tokens (later ones are ignored).
      positions: int ``[b]``: each row's position of this token.
      sliding_window: attend only to the last ``sliding_window`` tokens (this one
        included), or None.
    Returns:
      ``[b, 1, heads * d]`` in ``q.dtype``; softmax in fp32.
    """
    b, _, heads, d = q.shape
    kv_heads, length = k.shape[2], k_cache.shape[1]
    qg = q.reshape(b, kv_heads, heads // kv_heads, d)
    scale = d ** -0.5
    f32 = jnp.float32
    s_cache = jnp.einsum("bhgd,bshd->bhgs", qg, k_cache, preferred_element_type=f32) * scale
    s_self = jnp.einsum("bhgd,bhd->bhg", qg, k[:, 0], preferred_element_type=f32) * scale
    j = jnp.arange(length)[None, :]
    visible = j < positions[:, None]
    if sliding_window is not None:
        visible &= j > positions[:, None] - sliding_window
    s_cache = jnp.where(visible[:, None, None, :], s_cache, -jnp.inf)
    top = jnp.maximum(jnp.max(s_cache, axis=-1), s_self)
    p_cache, p_self = jnp.exp(s_cache - top[..., None]), jnp.exp(s_self - top)
    total = jnp.sum(p_cache, axis=-1) + p_self
    out = jnp.einsum("bhgs,bshd->bhgd", p_cache, v_cache.astype(f32)) + \
        p_self[..., None] * v[:, 0][:, :, None, :].astype(f32)
    out = out / total[..., None]
    return out.reshape(b, 1, heads * d).astype(q.dtype)


def _block_step(block: nnx.Module, x: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per device: one token of every row through one block -> ``(x, k, v)`` (the
    token's keys and values ``[b, 1, kv_local, d]`` for the cache)."""
    attention, mlp = block.attention, block.mlp
    tensor = attention.parallel.tensor_axis
    q, k, v = attention.split_heads(_qkv(attention, _norm(attention.norm, x)),
                                    positions[:, None], attention.qk_scales())
    o = cached_attention(q, k, v, k_cache, v_cache, positions,
                         getattr(attention.config, "sliding_window", None))
    out = attention.out
    y = _dense(out.dtype, o, out.kernel[...], None if out.bias is None else out.bias[...],
               tensor)
    x = x.astype(y.dtype) + y
    up, down = mlp.up, mlp.down
    h = _dense(up.dtype, _norm(mlp.norm, x), up.kernel[...],
               None if up.bias is None else up.bias[...])
    y = _dense(down.dtype, mlp.activate(h), down.kernel[...],
               None if down.bias is None else down.bias[...], tensor)
    return x.astype(y.dtype) + y, k, v


def _logits(h: jax.Array, table: jax.Array, tensor: str, vocab_size: int) -> jax.Array:
    """Per device: fp32 logits ``[b, vocab_size]`` of final-normed ``h [b, hidden]``
    with this shard's vocabulary block ``table [Vp / t, hidden]`` (one all-gather)."""
    local = jnp.dot(h, table.T.astype(jnp.result_type(h.dtype, table.dtype)))
    return all_gather_invariant(local, tensor, -1)[:, :vocab_size].astype(jnp.float32)


# -- the two programs -------------------------------------------------------------------


def _padded(table: nnx.Module, mesh: Mesh) -> jax.Array:
    """A vocabulary table ``[V, hidden]`` padded to a multiple of the tensor size,
    ``P(tensor, None)`` (no fsdp split: whole rows for the lookups)."""
    tensor = table.parallel.tensor_axis
    value = table.embedding[...]
    pad = padded_vocab_size(value.shape[0], axis_size(mesh, tensor)) - value.shape[0]
    if pad:
        value = jnp.pad(value, ((0, pad), (0, 0)))
    return reshard(value, P(tensor, None), mesh)


def _tables(model: Any, mesh: Mesh) -> tuple[jax.Array, jax.Array]:
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
    kv_replicated = kv_heads_replicated(cfg.num_kv_heads, t, "generate")
    for module, stacked in ((model.blocks, cfg.scan_layers), (model.final_norm, False)):
        (graph, treedef), leaves, _ = _parts(module, mesh, par, stacked, kv_replicated)
        nnx.update(module, jax.tree_util.tree_unflatten(treedef, leaves))
    for table in (model.embed, model.head):
        if table is not None:
            table.embedding[...] = reshard(table.embedding[...], P(par.tensor_axis, None)
                                           if table.embedding.shape[0] % t == 0 else P(), mesh)
    if model.position is not None:
        model.position[...] = reshard(model.position[...], P(), mesh)


def prefill(model: Any, tokens: jax.Array, last: jax.Array, length: int
            ) -> tuple[jax.Array, KVCache]:
    """The prompts through the training path.

    Args:
      model: a :class:`~sp_jax.models.GPT` in eval mode.
      tokens: ``[batch, seq]`` prompts, right-padded (``seq`` a multiple of the tensor
        size); padding never reaches a prompt token (causal attention).
      last: int ``[batch]``: each row's last prompt position.
      length: the cache length (at least ``seq``).
    Returns:
      fp32 logits ``[batch, vocab_size]`` at ``last``, and the :class:`KVCache` of every
      position (entries at and after a row's padding are overwritten by decoding before
      they are read).
    """
    par, cfg = model.parallel, model.config
    mesh = current_mesh(par, where="generate")
    layout = Layout.of(par)
    _, head = _tables(model, mesh)
    x = model._embed(tokens, model._vocab_table() if model.head is None else None, None,
                     None)
    if cfg.scan_layers:
        graph, state = nnx.split(model.blocks)

        def layer(x, layer_state):
            blk = nnx.merge(graph, layer_state)
            y, kv = blk.attention(x, keep_kv=True)
            return blk.mlp(y), kv

        x, (k, v) = lax.scan(layer, x, state)
    else:
        ks, vs = [], []
        for blk in model.blocks:
            y, (k1, v1) = blk.attention(x, keep_kv=True)
            x = blk.mlp(y)
            ks.append(k1)
            vs.append(v1)
        k, v = jnp.stack(ks), jnp.stack(vs)
    h = model.final_norm(x)
    cache_spec = P(None, *layout.heads(4))
    pad = ((0, 0), (0, 0), (0, length - tokens.shape[1]), (0, 0), (0, 0))
    cache = KVCache(reshard(jnp.pad(k, pad), cache_spec, mesh),
                    reshard(jnp.pad(v, pad), cache_spec, mesh))

    def pick(h, last, table):  # this device's sequence shard holds some rows' last token
        s = h.shape[1]
        at = last - lax.axis_index(par.tensor_axis) * s
        inside = (at >= 0) & (at < s)
        row = jnp.take_along_axis(h, jnp.clip(at, 0, s - 1)[:, None, None], axis=1)[:, 0]
        row = lax.psum(jnp.where(inside[:, None], row, jnp.zeros((), row.dtype)),
                       par.tensor_axis)
        return _logits(row, table, par.tensor_axis, cfg.vocab_size)

    batch = layout.spec("activation_batch")
    logits = jax.shard_map(pick, in_specs=(layout.sp, batch, P(par.tensor_axis, None)),
                           out_specs=layout.spec("activation_batch", None))(
        reshard(h, layout.sp, mesh), reshard(last, batch, mesh), head)
    return logits, cache


def decode_step(model: Any, cache: KVCache, tokens: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, KVCache]:
    """One token of every row.

    Args:
      model: a :class:`~sp_jax.models.GPT` in eval mode.
      cache: the :class:`KVCache` (donate it: it is updated in place).
      tokens: int ``[batch]``: each row's token.
      positions: int ``[batch]``: each row's position of that token (its keys and values
        are written there).
    Returns:
      fp32 logits ``[batch, vocab_size]`` of the next token, and the updated cache.
    """
    par, cfg = model.parallel, model.config
    mesh = current_mesh(par, where="generate")
    layout = Layout.of(par)
    tensor = par.tensor_axis
    t = axis_size(mesh, tensor)
    kv_replicated = kv_heads_replicated(cfg.num_kv_heads, t, "generate")
    embed, head = _tables(model, mesh)
    blocks, block_leaves, block_specs = _parts(model.blocks, mesh, par, cfg.scan_layers,
                                               kv_replicated)
    final, final_leaves, final_specs = _parts(model.final_norm, mesh, par, False, False)
    position = None if model.position is None else reshard(model.position[...], P(), mesh)
    batch = layout.spec("activation_batch")
    cache_spec = P(None, *layout.heads(4))

    def local(block_leaves, final_leaves, embed, head, position, k_all, v_all, tokens,
              positions):
        x = lax.psum(vocab_parallel_lookup(tokens[:, None], embed, tensor, cfg.vocab_size),
                     tensor)
        if model.embed.dtype is not None:
            x = x.astype(model.embed.dtype)
        if position is not None:
            x = x + jnp.take(position, positions, axis=0)[:, None].astype(x.dtype)
        stack = _merge(blocks, block_leaves)
        if cfg.scan_layers:
            graph, state = nnx.split(stack)

            def layer(x, xs):
                layer_state, k_cache, v_cache = xs
                return _swap(_block_step(nnx.merge(graph, layer_state), x, k_cache, v_cache,
                                         positions))

            x, (k_new, v_new) = lax.scan(layer, x, (state, k_all, v_all))
        else:
            news = []
            for i, blk in enumerate(stack):
                x, k1, v1 = _block_step(blk, x, k_all[i], v_all[i], positions)
                news.append((k1, v1))
            k_new = jnp.stack([kv[0] for kv in news])
            v_new = jnp.stack([kv[1] for kv in news])
        h = _norm(_merge(final, final_leaves), x)[:, 0]
        rows = jnp.arange(tokens.shape[0])
        k_all = k_all.at[:, rows, positions].set(k_new[:, :, 0].astype(k_all.dtype))
        v_all = v_all.at[:, rows, positions].set(v_new[:, :, 0].astype(v_all.dtype))
        return _logits(h, head, tensor, cfg.vocab_size), k_all, v_all

    table_spec = P(tensor, None)
    logits, k, v = jax.shard_map(
        local,
        in_specs=(block_specs, final_specs, table_spec, table_spec,
                  None if position is None else P(), cache_spec, cache_spec, batch, batch),
        out_specs=(layout.spec("activation_batch", None), cache_spec, cache_spec))(
        block_leaves, final_leaves, embed, head, position, cache.k, cache.v,
        reshard(tokens, batch, mesh), reshard(positions, batch, mesh))
    return logits, KVCache(k, v)


def _swap(out: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, tuple]:
    """``(x, k, v)`` -> ``(x, (k, v))`` for a scan body's carry and output."""
    x, k, v = out
    return x, (k, v)

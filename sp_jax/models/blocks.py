"""The GPT's transformer layers: :class:`Block` (attention then MLP or mixture of experts)
and the ways a stack of them runs: unrolled (a list of blocks, each optionally
rematerialised) or scanned (one :class:`Block` whose variables hold every layer's values
stacked on axis 0, run by ``lax.scan``), or for layers of different kinds (different
parameter trees: dense layers before mixtures of experts) scanned as
:class:`Segments`, one stacked :class:`Block` per kind run one after the other.

:class:`~sp_jax.models.GPT` holds its layers in one of these forms
(``GPTConfig.scan_layers``, ``GPTConfig.num_dense_layers``: :attr:`GPT.layers
<sp_jax.models.GPT.layers>`) and runs them with :func:`run_blocks`; a pipeline stage
(:mod:`sp_jax.pipeline.gpt_stages`) runs its slice of the stacked layers with
:func:`scan_blocks`, and generation (:mod:`sp_jax.models.decode`) its prompts with
:func:`prefill_blocks` and one token through them, per device, with :func:`decode_blocks`
(both layer loops are :func:`over_layers`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from sp_jax.config import ParallelConfig
from sp_jax.layers import MLP, AttentionCache, MoE, MoEStats, attention_class
from sp_jax.mesh import check_activations, reshard
from sp_jax.models.gpt_config import GPTConfig
from sp_jax.ops.primitives import (
    cotangent_barrier,
    residuals_to_device,
    residuals_to_host,
    tied_host_moves,
)

__all__ = ["Block", "Documents", "Layers", "Segments", "decode_blocks", "layer_loop",
           "over_layers", "prefill_blocks", "run_block", "run_blocks", "scan_blocks",
           "stack_blocks", "stack_size"]

# (segment_ids, positions) of packed rows, either None, or None: unpacked sequences
Documents = tuple[jax.Array | None, jax.Array | None] | None


class Block(nnx.Module):
    """One transformer layer: its attention, the class registered as ``config.attention``
    (:func:`~sp_jax.layers.register_attention`; ``"mha"``:
    :class:`~sp_jax.layers.CausalSelfAttention`), then :class:`MLP` (or, for a
    mixture-of-experts layer of the config, :class:`~sp_jax.layers.MoE`).

    Its dropouts hold no rng stream; they draw from ``nnx.Rngs(dropout=key)`` built
    from the ``key`` passed to each call (so a block can be rematerialised).

    Args:
      config: the :class:`GPTConfig` (its ``attention_config()`` and ``mlp_config()`` /
        ``moe_config()``).
      parallel: the :class:`~sp_jax.ParallelConfig`.
      rngs: ``params`` rng stream.
      index: the layer's index (from 0), which says whether it is a mixture of experts
        (``config.is_moe_layer(index)``).

    With ``config.remat`` and ``parallel.offload_activations`` the block's one residual,
    its input, is what goes to host memory (``offload_input``; :func:`run_block`), and
    its layers keep theirs on the device: they live only within the block's backward
    pass (moving them would cost transfers and save nothing).
    """

    def __init__(self, config: GPTConfig, parallel: ParallelConfig = ParallelConfig(), *,
                 rngs: nnx.Rngs, index: int = 0):
        self.offload = bool(parallel.offload_activations)
        self.offload_input = bool(config.remat and parallel.offload_activations)
        if self.offload_input:
            parallel = parallel.replace(offload_activations=False)
        self.attention = attention_class(config.attention, "GPTConfig")(
            config.attention_config(), parallel=parallel, rngs=rngs,
            window=config.layer_window(index))
        self.mlp = MoE(config.moe_config(), parallel=parallel, rngs=rngs) \
            if config.is_moe_layer(index) else \
            MLP(config.mlp_config(), parallel=parallel, rngs=rngs)

    def __call__(self, x: jax.Array, key: jax.Array | None = None,
                 documents: Documents = None) -> jax.Array:
        """``x``: hidden states ``[batch, seq, hidden]`` in the SP layout -> same shape and
        layout; ``key``: the dropout key of this block, or None; ``documents``: None or
        ``(segment_ids, positions)`` ``[batch, seq]`` of packed rows (either None), in
        the order ``x`` is held (see :meth:`GPT.loss`)."""
        return self.apply(x, key, documents)[0]

    def apply(self, x: jax.Array, key: jax.Array | None = None, documents: Documents = None
              ) -> tuple[jax.Array, MoEStats | None]:
        """As :meth:`__call__`, with the layer's router statistics (None for a dense
        layer)."""
        x = jnp.asarray(x)
        check_activations("Block", x, self.attention.config.hidden, "hidden")
        rngs = None if key is None else nnx.Rngs(dropout=key)
        segment_ids, positions = documents if documents is not None else (None, None)
        x = self.attention(x, rngs=rngs, segment_ids=segment_ids, positions=positions)
        if isinstance(self.mlp, MoE):
            return self.mlp(x, rngs=rngs)
        return self.mlp(x, rngs=rngs), None

    def prefill_step(self, x: jax.Array) -> tuple[jax.Array, AttentionCache]:
        """The training path's forward without dropout or documents, keeping the cache
        entries attention made of the prompt (the attention's ``prefill``): ``x``
        ``[batch, seq, hidden]`` (SP layout) -> ``(x, entries)``, ``entries`` of the
        attention's cache type with ``[batch, seq, ...]`` arrays (for ``"mha"``, a
        :class:`~sp_jax.layers.KVCache` of the keys and values)."""
        y, entries = self.attention.prefill(x)
        y = self.mlp(y)
        return (y[0] if isinstance(self.mlp, MoE) else y), entries

    def decode_step(self, x: jax.Array, cache: AttentionCache, positions: jax.Array,
                    cache_positions: jax.Array | None = None
                    ) -> tuple[jax.Array, AttentionCache]:
        """The single-token (decode) mode per device (the attention's ``decode_step``,
        e.g. :meth:`~sp_jax.layers.CausalSelfAttention.decode_step`, then
        :meth:`MLP.decode_step`: two all-reduces over the tensor axis; or
        :meth:`~sp_jax.layers.MoE.decode_step`): ``x`` ``[b, 1, hidden]`` whole rows,
        this shard's part of this layer's cache (the attention's cache type, ``[b,
        length, ...]`` arrays), ``positions`` ``[b]`` (``cache_positions``: the positions
        the cache's entries hold, None: their indices) -> ``(x, entries)``, the token's
        cache entries (``[b, 1, ...]`` arrays)."""
        x, entries = self.attention.decode_step(x, cache, positions, cache_positions)
        return self.mlp.decode_step(x), entries


@dataclasses.dataclass(frozen=True)
class Segments:
    """A scanned GPT's layers of several kinds, in layer order: one stacked
    :class:`Block` per kind (variables ``[n_i, ...]``, ``sum n_i`` the GPT's layers),
    e.g. the dense layers then the mixtures of experts (``GPTConfig.num_dense_layers``).
    The stack functions (:func:`run_blocks`, :func:`scan_blocks`, :func:`over_layers`)
    run the segments one after the other, each by its own ``lax.scan``; their per-layer
    inputs (dropout keys, cache entries) and outputs keep one leading layer axis over
    all segments."""

    stacks: tuple[Block, ...]


Layers = Block | Sequence[Block] | Segments
"""A GPT's layers as the stack functions take them: one stacked :class:`Block`, a list
of blocks (unrolled) or :class:`Segments` (stacked, of several kinds)."""


def stack_size(stacked: Block) -> int:
    """The number of layers of a stacked :class:`Block` (its variables' leading
    dimension)."""
    return jax.tree.leaves(nnx.state(stacked, nnx.Param))[0].shape[0]


def _concatenated(parts: list[Any]) -> Any:
    """Per-layer pytrees ``[n_i, ...]`` of consecutive segments as one ``[sum n_i,
    ...]`` (None when no segment has any: dense layers' router statistics)."""
    parts = [p for p in parts if p is not None]
    if len(parts) <= 1:
        return parts[0] if parts else None
    return jax.tree.map(lambda *v: jnp.concatenate(v), *parts)


def run_block(block: Block, x: jax.Array, key: jax.Array | None, remat: bool,
              documents: Documents = None) -> tuple[jax.Array, MoEStats | None]:
    """Applies ``block`` (:meth:`Block.apply`); with ``remat`` its activations are
    recomputed in backward."""
    if not remat:
        return block.apply(x, key, documents)
    graphdef, state = nnx.split(block)
    return _remat(lambda s, x, k, d: nnx.merge(graphdef, s).apply(x, k, d),
                  block.offload_input)(state, x, key, documents)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _remat_offloaded(f, *args):
    return f(*args)


def _remat_offloaded_fwd(f, state, x, *rest):
    x, out = residuals_to_host(x, f(state, x, *rest))
    return out, (state, x, *rest)


def _remat_offloaded_bwd(f, res, g):
    state, x, *rest = res
    # tied to the cotangent: the recomputation is neither hoisted into the forward pass
    # nor merged with it (CSE; XLA:CPU lowers the host moves to nothing)
    x, g = jax.lax.optimization_barrier(residuals_to_device(x, g))
    return jax.vjp(f, state, x, *rest)[1](g)


_remat_offloaded.defvjp(_remat_offloaded_fwd, _remat_offloaded_bwd)


def _remat(f: Callable, offload: bool) -> Callable:
    """``f(state, x, *rest)`` recomputed in the backward pass: ``jax.checkpoint``, or
    with ``offload`` a custom VJP whose one residual besides its arguments, the block's
    input ``x``, waits in host memory (``jax.checkpoint``'s saved inputs cannot be
    placed there: its differentiated arguments must stay in device memory)."""
    if not offload:
        return jax.checkpoint(f)
    return functools.partial(_remat_offloaded, f)


def stack_blocks(blocks: list[Block], layer_axis: str | None = None,
                 repeats: int = 1) -> Block:
    """One :class:`Block` whose variables hold ``blocks``' values stacked on axis 0
    (sharded over ``layer_axis``, the pipeline axis, when given). With ``repeats > 1``
    the stack is ``[repeats, L / repeats, ...]`` (still in layer order) sharded over
    ``layer_axis`` on its second dimension: stage ``s`` of ``P`` then holds the layer
    chunks ``r P + s`` (the circular assignment), each where the schedule runs it."""

    def stack_tree(variables):
        """A variable whose value is a pytree (a quantized base's QuantizedKernel): each
        array stacked, split as it was (and over ``layer_axis``)."""
        first = variables[0]
        mesh = jax.sharding.get_abstract_mesh()

        def leaf(*xs):
            value = jnp.stack(xs)
            inner = tuple(getattr(getattr(jax.typeof(xs[0]), "sharding", None), "spec",
                                  ()) or ())
            inner = inner + (None,) * (xs[0].ndim - len(inner))
            spec = (layer_axis, *inner)
            if repeats > 1:
                value = value.reshape(repeats, value.shape[0] // repeats, *value.shape[1:])
                spec = (None, *spec)
            if layer_axis is not None and not mesh.empty:
                value = reshard(value, P(*spec), mesh)
            return value

        return first.replace(jax.tree.map(leaf, *[v.get_value() for v in variables]))

    def stack(*variables):
        first = variables[0]
        if not hasattr(first.get_value(), "ndim") or dataclasses.is_dataclass(
                first.get_value()):
            return stack_tree(variables)
        value = jnp.stack([v[...] for v in variables])
        metadata = first.get_metadata()
        inner = metadata.get("out_sharding")
        if inner is not None or layer_axis is not None:
            inner = inner if inner is not None else (None,) * (value.ndim - 1)
            metadata["out_sharding"] = (layer_axis, *inner)
        if repeats > 1:
            value = value.reshape(repeats, value.shape[0] // repeats, *value.shape[1:])
            metadata["out_sharding"] = (None, *metadata["out_sharding"])
        mesh = jax.sharding.get_abstract_mesh()
        if layer_axis is not None and not mesh.empty:  # each stage holds its layers
            value = reshard(value, P(*metadata["out_sharding"]), mesh)
        return first.from_metadata(value, metadata)

    states = [nnx.state(b) for b in blocks]
    stacked = jax.tree.map(stack, *states, is_leaf=lambda v: isinstance(v, nnx.Variable))
    return nnx.merge(nnx.graphdef(blocks[0]), stacked)


def layer_loop(step: Callable, x: Any, xs: Any, unroll: bool = False) -> tuple[Any, Any]:
    """``lax.scan(step, x, xs)`` over a stack's layers (``xs``: leaves with a leading
    layer axis), or with ``unroll`` the same loop in Python: ``step`` traced once per
    layer on its slice of ``xs``, the outputs stacked on a leading layer axis.

    Unrolled, each layer's offloaded residuals are arrays of their own, not rows of a
    scan's stacked host buffer: a pipeline's tick scan (GPipe, differentiated by
    autodiff) stacks them per tick, which XLA:GPU compiles (measured, deviceless 8 x
    H100); a tick scan stacking a layer scan's host buffers it does not (INTERNAL error
    in layout assignment: the while loop's tuple keeps the nested buffers' host memory
    space where the loop expects device memory)."""
    if not unroll:
        return jax.lax.scan(step, x, xs)
    outs = []
    for i in range(jax.tree.leaves(xs)[0].shape[0]):
        x, out = step(x, jax.tree.map(lambda a, i=i: a[i], xs))
        outs.append(out)
    return x, jax.tree.map(lambda *v: jnp.stack(v), *outs)


def scan_blocks(stacked: Block | Segments, x: jax.Array, keys: jax.Array | None,
                remat: bool, documents: Documents = None, unroll: bool = False
                ) -> tuple[jax.Array, MoEStats | None]:
    """Runs the layers of a stacked block with ``lax.scan`` (one per-layer key each,
    ``keys [layers, ...]`` or None; ``unroll``: a Python loop instead,
    :func:`layer_loop`); returns the output and the layers' stacked router statistics
    (None: dense). :class:`Segments`: each segment's scan in turn, with its slice of
    ``keys``; the statistics of the mixture-of-experts segments (the dense ones have
    none)."""
    if isinstance(stacked, Segments):
        stats, start = [], 0
        for stack in stacked.stacks:
            n = stack_size(stack)
            x, layer = scan_blocks(stack, x, None if keys is None else keys[start:start + n],
                                   remat, documents, unroll)
            stats.append(layer)
            start += n
        return x, _concatenated(stats)
    graphdef, state = nnx.split(stacked)

    def apply(layer_state, x, key, documents):
        return nnx.merge(graphdef, layer_state).apply(x, key, documents)

    if remat:  # with offload_input each layer's input, the scan's saved carry, on the host
        apply = _remat(apply, stacked.offload_input)
    return layer_loop(lambda x, xs: apply(xs[0], x, xs[1], documents), x, (state, keys),
                      unroll)


def over_layers(blocks: Layers, step: Callable, x: jax.Array, xs: Any = None
                ) -> tuple[jax.Array, Any]:
    """``x`` through every layer of a GPT without gradients: ``step(block, x,
    layer_xs) -> (x, out)`` per layer, ``blocks`` stacked (``lax.scan`` over the layers
    and ``xs``, whose leaves have a leading layer axis), :class:`Segments` (a scan per
    segment, each layer reading its row of ``xs`` by its index in the GPT: no segment's
    slice of ``xs`` is copied) or a list (unrolled). Returns the last layer's ``x`` and
    the layers' ``out`` stacked on a leading layer axis."""
    if isinstance(blocks, Segments):
        outs, start = [], 0
        for stack in blocks.stacks:
            graphdef, state = nnx.split(stack)
            n = stack_size(stack)

            def layer(x, s_i, graphdef=graphdef):
                rows = jax.tree.map(
                    lambda a: jax.lax.dynamic_index_in_dim(a, s_i[1], 0, keepdims=False), xs)
                return step(nnx.merge(graphdef, s_i[0]), x, rows)

            x, out = jax.lax.scan(layer, x, (state, jnp.arange(start, start + n)))
            outs.append(out)
            start += n
        return x, _concatenated(outs)
    if isinstance(blocks, Block):
        graphdef, state = nnx.split(blocks)
        return jax.lax.scan(
            lambda x, s_xs: step(nnx.merge(graphdef, s_xs[0]), x, s_xs[1]), x, (state, xs))
    outs = []
    for i, block in enumerate(blocks):
        x, out = step(block, x, jax.tree.map(lambda a, i=i: a[i], xs))
        outs.append(out)
    return x, jax.tree.map(lambda *v: jnp.stack(v), *outs)


def prefill_blocks(blocks: Layers, x: jax.Array
                   ) -> tuple[jax.Array, AttentionCache]:
    """The prompts' hidden states ``x`` (SP layout) through a GPT's layers (their
    training-path forward, :meth:`Block.prefill_step`): the last layer's output and every
    layer's cache entries, the attention's cache type with ``[layers, batch, seq, ...]``
    arrays."""
    return over_layers(blocks, lambda block, x, _: block.prefill_step(x), x)


def decode_blocks(blocks: Layers, x: jax.Array, cache: AttentionCache,
                  positions: jax.Array, cache_positions: jax.Array | None = None
                  ) -> tuple[jax.Array, AttentionCache]:
    """Per device (inside the decode ``shard_map``): one token of every row through a
    GPT's layers (:meth:`Block.decode_step`), ``blocks`` stacked (``lax.scan`` over the
    layers and the cache), :class:`Segments` or a list.

    Args:
      x: ``[b, 1, hidden]`` whole rows; positions: int ``[b]``.
      cache: this shard's part of the cache (the attention's cache type, e.g.
        :class:`~sp_jax.layers.KVCache`), ``[layers, b, length, ...]`` arrays.
      cache_positions: int ``[length]``: the positions the cache's entries hold (a part
        of the sequence with a context axis), or None: entry ``j`` holds position ``j``.
    Returns:
      the last layer's output and every layer's entries of the token (the cache type,
      ``[layers, b, 1, ...]`` arrays).
    """
    return over_layers(
        blocks, lambda block, x, layer: block.decode_step(x, layer, positions,
                                                          cache_positions), x, cache)


def run_blocks(blocks: Layers, x: jax.Array, *, num_layers: int, remat: bool,
               stream: Callable[[], jax.Array] | None = None,
               documents: Documents = None) -> tuple[jax.Array, MoEStats | None]:
    """Runs a GPT's ``num_layers`` layers on hidden states ``x`` (SP layout): ``blocks``
    stacked (one :class:`Block` of stacked variables, or :class:`Segments` of such
    blocks: :func:`scan_blocks`) or a list of blocks (unrolled, :func:`run_block`
    each).

    Args:
      stream: draws one dropout key per layer, in layer order (all before the scan, or
        before each unrolled layer), or None: no dropout.
      remat: recompute each layer's activations in backward.
      documents: packed rows' ``(segment_ids, positions)`` in the held order, or None.
    Returns:
      the last layer's output and the mixture-of-experts layers' stacked router
      statistics (None without any).
    """
    if isinstance(blocks, Block | Segments):
        keys = None if stream is None else jnp.stack([stream() for _ in range(num_layers)])
        return scan_blocks(blocks, x, keys, remat, documents)
    layers = []
    for block in blocks:
        # the residual stream's gradient materialised at each layer (a scan's carry is)
        x = cotangent_barrier(x, block.offload)
        with tied_host_moves():  # the offloaded residuals' moves (no scan writes them)
            x, layer = run_block(block, x, None if stream is None else stream(), remat,
                                 documents)
        if layer is not None:  # a mixture-of-experts layer's router statistics
            layers.append(layer)
    return x, jax.tree.map(lambda *v: jnp.stack(v), *layers) if layers else None

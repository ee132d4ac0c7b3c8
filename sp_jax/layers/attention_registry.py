"""The attention seam: which attention a transformer block runs (a registry of attention
classes by name, ``GPTConfig.attention``) and what such a class owns, its cache type
included (:class:`AttentionCache`).

An attention class (``"mha"``: :class:`~sp_jax.layers.CausalSelfAttention`, multi-head,
grouped-query and multi-query attention) is a Flax NNX module with a residual, built and
called by :class:`~sp_jax.models.Block` as follows (:class:`Attention` states it as a
protocol):

- ``cls(config, *, parallel, rngs, window)``: ``config`` the block's
  :class:`~sp_jax.layers.AttentionConfig` handed whole (a variant reads the fields it
  needs), ``parallel`` the :class:`~sp_jax.ParallelConfig`, ``window`` the layer's
  sliding window (``GPTConfig.layer_windows``; None: full causal attention). It keeps
  ``config`` as ``self.config``.
- parameters and their layouts: the training layout is each parameter's
  ``out_sharding``; the decode layout (:func:`~sp_jax.layers.linear.decode_layout`: the
  tensor split of training, nothing over the data axes) is stated by each sub-module
  with a ``param_specs(layout, mesh) -> {name: PartitionSpec}`` method (the parallel
  linear layers, :class:`~sp_jax.layers.GroupedQKVProjection`, or the attention itself
  for the parameters it holds directly); a parameter no module states is whole.
- ``__call__(x, *, deterministic=None, rngs=None, segment_ids=None, positions=None)``:
  the training forward, ``x [batch, seq, hidden]`` in the SP layout ``P(data, tensor,
  None)`` -> the same, with every context-parallel form it supports
  (``parallel.context_parallel``; the sequence held in
  :func:`~sp_jax.attention.sequence_order`), packed documents (``segment_ids`` /
  ``positions`` ``[batch, seq]``, ``Layout.tokens``) and dropout (``rngs``).
- ``prefill(x) -> (y, entries)``: the training forward without dropout or documents that
  also returns its cache entries of the prompt, an instance of its ``cache_type`` whose
  arrays are ``[batch, seq, ...]`` in the specs the cache type states
  (:meth:`AttentionCache.entry_specs`; the sequence in the held order).
- ``decode_step(x, cache, positions, cache_positions=None) -> (y, entries)``: ``T``
  consecutive tokens of every row per device (one in a decoding step; a speculative
  step's token and its drafts, :mod:`sp_jax.models.speculative`), inside the decode
  ``shard_map`` over the whole model, its parameters in the decode layout: ``x [b, T,
  hidden]`` whole rows, ``cache`` this layer's part of the cache (``[b, length, ...]``
  arrays: this device's; its entries at positions ``>= positions`` are not read),
  ``positions`` int ``[b]`` the first token's (:func:`token_positions`: each one's),
  ``cache_positions`` int ``[length]`` (the position each entry holds, with a context
  axis; None: entry ``j`` holds position ``j``) -> ``y [b, T, hidden]`` whole rows and
  these tokens' entries (``[b, T, ...]`` arrays of the cache type). Token ``t`` attends
  to the cache and to tokens ``<= t`` (:func:`~sp_jax.attention.cached_attention`).
- ``cache_type``: a class attribute, the :class:`AttentionCache` subclass of its cache.

A new attention is one module holding such a class and one call of
:func:`register_attention`; ``GPTConfig(attention=name)`` then builds every block with it,
and training, evaluation and :func:`~sp_jax.models.generate` run it unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sp_jax.layout import Layout
from sp_jax.mesh import Mesh, reshard

__all__ = ["Attention", "AttentionCache", "attention_class", "attention_names", "cache_slots",
           "check_attention_name", "register_attention", "token_positions"]


def cache_slots(prompt: int, length: int, shards: int, order: np.ndarray | None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where a cache of ``length`` positions split over ``shards`` context shards holds
    each position: ``(positions [shards, length / shards], shard [length], slot
    [length])``: the position at slot ``j`` of shard ``c``, and the shard and slot of
    each position.

    Each shard's first ``prompt / shards`` slots hold the prefill's entries as its
    attention held them (``order``: the held order of the ``prompt`` positions, ring
    attention's zigzag, or None: the natural order), so the prefill's cache is kept
    where it was computed; the later positions go round robin (position ``prompt + q``
    to shard ``q % shards``, slot ``prompt / shards + q // shards``), so that every
    shard holds as many of the generated tokens."""
    per = prompt // shards
    held = np.arange(prompt) if order is None else np.asarray(order)
    table = np.empty((shards, length // shards), np.int32)
    table[:, :per] = held.reshape(shards, per)
    table[:, per:] = np.arange(prompt, length).reshape(-1, shards).T
    shard, slot = np.empty(length, np.int32), np.empty(length, np.int32)
    shard[table] = np.arange(shards)[:, None]
    slot[table] = np.arange(length // shards)[None, :]
    return table, shard, slot


class AttentionCache:
    """The base of an attention's cache type.

    A cache type is a frozen dataclass registered as a pytree
    (``jax.tree_util.register_dataclass``) whose data fields are arrays ``[layers,
    batch, length, ...]`` (every layer's, stacked; one layer's ``[batch, length, ...]``
    inside the layer loop, and a token's entries ``[batch, 1, ...]``) and whose one
    static field is ``prompt`` (``int``, default 0), the padded prompt width of the
    prefill. It states (:meth:`entry_specs`) how its arrays are sharded, the batch over
    the data axes and the length over the context axes (the rest as the attention holds
    them: e.g. :class:`~sp_jax.layers.KVCache`'s key/value heads over the tensor axis);
    this base then gives the generic parts: the specs of the stacked arrays
    (:meth:`specs`), the cache grown from the prefill's entries with each context shard's
    slots for the new tokens (:meth:`grown`), where each position is held
    (:meth:`slots`, round robin over the context shards) and a token's entries written
    into it (:meth:`write`). A cache type may override any of them."""

    prompt: int

    @classmethod
    def entry_specs(cls, layout: Layout) -> dict[str, P]:
        """Per data field, the spec of one layer's ``[batch, length, ...]`` array in
        ``layout`` (the activations' :class:`~sp_jax.layout.Layout`): also the specs in
        which the attention's ``prefill`` returns its entries."""
        raise NotImplementedError(f"{cls.__name__}.entry_specs: a cache type states the "
                                  "specs of its arrays.")

    def arrays(self) -> dict[str, jax.Array]:
        """The data fields by name, in field order."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)  # type: ignore[arg-type]
                if not f.metadata.get("static")}

    @property
    def length(self) -> int:
        """Entries per row of a stacked cache (``[layers, batch, length, ...]``; inside a
        ``shard_map``, this device's)."""
        return next(iter(self.arrays().values())).shape[2]

    def specs(self, layout: Layout) -> Any:
        """The same cache type with a ``PartitionSpec`` per array of the stacked cache
        (``P(None, *entry_spec)``): ``shard_map`` specs and reshards."""
        return dataclasses.replace(self, **{  # type: ignore[type-var]
            name: P(None, *spec) for name, spec in self.entry_specs(layout).items()})

    def grown(self, prompt: int, extra: int, layout: Layout, mesh: Mesh) -> Any:
        """The prefill's stacked entries ``[layers, batch, prompt, ...]`` resharded into
        :meth:`specs` and grown along the length by ``extra`` slots per context shard
        (each shard keeps its own part of the prompt, then its slots of the new tokens:
        :meth:`slots`), with ``prompt`` recorded."""
        specs = self.specs(layout)

        def grow(a: jax.Array) -> jax.Array:
            return jnp.pad(a, ((0, 0), (0, 0), (0, extra), *((0, 0),) * (a.ndim - 3)))

        grownup = {name: jax.shard_map(grow, in_specs=spec, out_specs=spec)(
            reshard(a, spec, mesh)) for (name, a), spec in zip(
                self.arrays().items(), specs.arrays().values(), strict=True)}
        return dataclasses.replace(self, prompt=prompt, **grownup)  # type: ignore[type-var]

    def slots(self, shards: int, order: np.ndarray | None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where this cache (``length`` positions, the prefill's ``prompt`` held in
        ``order``) holds each position over ``shards`` context shards:
        :func:`cache_slots`."""
        return cache_slots(self.prompt, self.length, shards, order)

    def write(self, new: Any, rows: jax.Array, at: jax.Array) -> Any:
        """Per device: this cache with the entries ``new`` of ``T`` tokens a row (the
        same type, ``[layers, batch, T, ...]``) written at slots ``at [batch, T]`` (or
        ``[batch]``: ``T = 1``) of rows ``rows [batch]`` (an ``at`` of ``length`` or
        more: dropped, a token another context shard holds), in the cache's dtypes."""
        at = at[:, None] if at.ndim == 1 else at
        return dataclasses.replace(self, **{  # type: ignore[type-var]
            name: a.at[:, rows[:, None], at].set(n.astype(a.dtype), mode="drop")
            for (name, a), n in zip(self.arrays().items(), new.arrays().values(),
                                    strict=True)})


def token_positions(positions: jax.Array, steps: int) -> jax.Array:
    """``[b, steps]``: the positions of ``steps`` consecutive tokens of each row whose
    first is at ``positions [b]`` (a ``decode_step``'s tokens)."""
    return positions[:, None] + jnp.arange(steps, dtype=positions.dtype)


@runtime_checkable
class Attention(Protocol):
    """What :class:`~sp_jax.models.Block` asks of an attention class (the module docstring
    says each part's shapes and shardings)."""

    cache_type: ClassVar[type[AttentionCache]]
    config: Any

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None, rngs: Any = None,
                 segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None) -> jax.Array: ...

    def prefill(self, x: jax.Array) -> tuple[jax.Array, AttentionCache]: ...

    def decode_step(self, x: jax.Array, cache: AttentionCache, positions: jax.Array,
                    cache_positions: jax.Array | None = None
                    ) -> tuple[jax.Array, AttentionCache]: ...


_REGISTRY: dict[str, type] = {}
_METHODS = ("__call__", "prefill", "decode_step")


def register_attention(name: str, cls: type) -> type:
    """Registers the attention class ``cls`` as ``name`` (``GPTConfig(attention=name)``)
    and returns it. ``cls`` must have the methods of :class:`Attention` and a
    ``cache_type``, a dataclass subclass of :class:`AttentionCache`. Registering a name
    again with another class is a ValueError (the same class again: a no-op)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_attention: name={name!r} must be a non-empty string.")
    if not isinstance(cls, type):
        raise TypeError(f"register_attention({name!r}): cls={cls!r} must be a class.")
    missing = [m for m in _METHODS  # defined by the class or a base (not by type: __call__)
               if not any(callable(vars(base).get(m)) for base in cls.__mro__)]
    cache = getattr(cls, "cache_type", None)
    if missing or not (isinstance(cache, type) and issubclass(cache, AttentionCache)
                       and dataclasses.is_dataclass(cache)):
        raise TypeError(
            f"register_attention({name!r}): {cls.__name__} must define {list(_METHODS)} "
            f"(missing {missing}) and cache_type, a dataclass subclass of "
            f"sp_jax.layers.AttentionCache (got {cache!r}); see sp_jax.layers.Attention.")
    known = _REGISTRY.get(name)
    if known is not None and known is not cls:
        raise ValueError(f"register_attention: {name!r} is already {known.__module__}."
                         f"{known.__qualname__}; choose another name.")
    _REGISTRY[name] = cls
    return cls


def attention_names() -> tuple[str, ...]:
    """The registered attention names, in registration order (``"mha"`` first)."""
    return tuple(_REGISTRY)


def check_attention_name(owner: str, name: Any) -> None:
    """A ValueError naming ``owner.attention`` and the registered names unless ``name``
    is one of them."""
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(
            f"{owner}.attention={name!r} is not a registered attention; use one of "
            f"{list(_REGISTRY)}, or register a class first with "
            "sp_jax.layers.register_attention(name, cls).")


def attention_class(name: str, owner: str = "Block") -> type:
    """The attention class registered as ``name`` (a ValueError naming ``owner`` and the
    registered names otherwise)."""
    check_attention_name(owner, name)
    return _REGISTRY[name]

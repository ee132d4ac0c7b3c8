"""Text out: :func:`generate` (greedy or sampled, ragged prompts, a sharded cache of the
attention's type) and the logit filters it samples through (:func:`filter_logits`,
transformers' order and rules)."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from sp_jax.compat import check_mode
from sp_jax.layout import Layout
from sp_jax.mesh import axis_size, current_mesh, mesh_platform, reshard
from sp_jax.models.decode import (
    check_decodable,
    decode_step,
    prefill,
    to_decode_layout,
)
from sp_jax.models.speculative import programs as speculative_programs

__all__ = ["Generation", "SpeculativeGeneration", "filter_logits", "generate",
           "sample_tokens"]


class Generation(NamedTuple):
    """What :func:`generate` returns.

    Attributes:
      tokens: int32 ``[batch, max_new_tokens]`` new tokens; after a row's end (its
        ``eos_token_id``, included) ``pad_token_id``.
      lengths: int32 ``[batch]``: new tokens of each row, its eos included.
    """

    tokens: np.ndarray
    lengths: np.ndarray


class SpeculativeGeneration(Generation):
    """What :func:`generate` returns with ``speculative="mtp"``: a :class:`Generation`
    (the same ``tokens`` and ``lengths``; it unpacks as one) with two attributes more.

    Attributes:
      accepted_drafts: the mean number of drafts accepted per verification step and
        row (0 .. ``mtp_depth``), over the steps each row was still generating: each
        such step gives the row ``accepted_drafts + 1`` tokens.
      steps: the verification steps run (each one jitted program).
    """

    accepted_drafts: float
    steps: int


def filter_logits(logits: jax.Array, *, temperature: float = 1.0, top_k: int | None = None,
                  top_p: float | None = None) -> jax.Array:
    """``logits [..., vocab]`` scaled by ``1 / temperature``, then the entries outside the
    ``top_k`` largest and outside the smallest set of largest whose probabilities sum
    beyond ``top_p`` set to ``-inf`` (transformers' order and rules: top-k keeps ties of
    the k-th value; top-p removes the tokens whose ascending cumulative probability is
    at most ``1 - top_p``, always keeping the most likely). fp32."""
    x = jnp.asarray(logits, jnp.float32) / jnp.float32(temperature)
    if top_k is not None:
        k = min(int(top_k), x.shape[-1])
        kth = jax.lax.top_k(x, k)[0][..., -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if top_p is not None and top_p < 1.0:
        order = jnp.argsort(x, axis=-1, stable=True)  # ascending
        ascending = jnp.take_along_axis(x, order, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
        remove = (cumulative <= 1.0 - top_p).at[..., -1].set(False)
        back = jnp.argsort(order, axis=-1)  # the inverse permutation
        x = jnp.where(jnp.take_along_axis(remove, back, axis=-1), -jnp.inf, x)
    return x


def sample_tokens(logits: jax.Array, key: jax.Array | None, *, temperature: float = 0.0,
                  top_k: int | None = None, top_p: float | None = None) -> jax.Array:
    """Next tokens ``[...]`` of ``logits [..., vocab]``: the argmax when ``temperature``
    is 0 (greedy), else drawn with ``key`` from :func:`filter_logits`."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    filtered = filter_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
    return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)


# -- the jitted programs (one compile per shape, not per token) ------------------------------


@functools.lru_cache(maxsize=16)
def _programs(graph: Any, sampling: tuple[float, int | None, float | None]):
    """The jitted prefill and decode step of a model graph (cached: a second
    :func:`generate` of the same model and shapes compiles nothing)."""
    temperature, top_k, top_p = sampling

    def pick(logits, key):  # on every device the whole [batch, vocab]: any mesh alike
        return sample_tokens(jax.sharding.reshard(logits, P()), key,
                             temperature=temperature, top_k=top_k, top_p=top_p)

    @functools.partial(jax.jit, static_argnums=(3,))
    def first(state, tokens, last, length, key):
        logits, cache = prefill(nnx.merge(graph, state), tokens, last, length)
        return pick(logits, key), cache

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(state, cache, tokens, positions, done, key, eos, pad):
        logits, cache = decode_step(nnx.merge(graph, state), cache, tokens, positions)
        new = jnp.where(done, pad, pick(logits, key))
        return new, done | jnp.isin(new, eos), cache

    return first, step


def _prompt_rows(prompts: Any, lengths: Any, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(tokens [batch, longest], lengths [batch])`` int32 of a list of token-id lists or
    a padded array with ``lengths``; a ValueError names what is wrong."""
    if isinstance(prompts, tuple) and len(prompts) == 2 and lengths is None:
        prompts, lengths = prompts
    if lengths is None:
        if not isinstance(prompts, Sequence) or isinstance(prompts, str) or not prompts:
            raise ValueError("generate: prompts must be a non-empty list of token-id lists, "
                             "or a padded [batch, length] array with lengths=.")
        rows = [np.asarray(p) for p in prompts]
        if any(r.ndim != 1 for r in rows):
            raise ValueError("generate: each prompt must be a flat list of token ids.")
        lens = np.array([len(r) for r in rows], np.int32)
        tokens = np.zeros((len(rows), max(1, int(lens.max()))), np.int64)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r
    else:
        tokens, lens = np.asarray(prompts), np.asarray(lengths).astype(np.int32)
        if tokens.ndim != 2 or lens.shape != tokens.shape[:1]:
            raise ValueError(f"generate: a padded prompt array must be [batch, length] with "
                             f"lengths [batch], got {tokens.shape} and {lens.shape}.")
        if np.any(lens > tokens.shape[1]):
            raise ValueError(f"generate: lengths {lens.tolist()} exceed the prompt array's "
                             f"{tokens.shape[1]} columns.")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise TypeError(f"generate: token ids must be integers, got {tokens.dtype}.")
    if np.any(lens < 1):
        raise ValueError(f"generate: every prompt needs at least one token; lengths "
                         f"{lens.tolist()}.")
    held = np.concatenate([tokens[i, :n] for i, n in enumerate(lens)])
    if held.size and (held.min() < 0 or held.max() >= vocab_size):
        raise ValueError(f"generate: token ids must be in [0, {vocab_size}) (the model's "
                         f"vocab_size); got {int(held.min())}..{int(held.max())}.")
    return tokens.astype(np.int32), lens


def _key(rngs: Any) -> jax.Array:
    """A PRNG key from ``nnx.Rngs`` (its ``sample`` stream, else its default) or a key."""
    if isinstance(rngs, nnx.Rngs):
        return rngs.sample() if "sample" in rngs else rngs()
    return jnp.asarray(rngs)


def generate(model: Any, prompts: Any, *, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None,
             eos_token_id: int | Sequence[int] | None = None,
             pad_token_id: int | None = None, rngs: Any = None,
             lengths: Any = None, speculative: str | None = None) -> Generation:
    """New tokens after each prompt, from a :class:`~sp_jax.models.GPT` on its mesh.

    The prompts run through the training path once (the prefill: sequence-parallel
    layers, blockwise attention), keeping every layer's cache entries in a cache
    preallocated to the longest prompt + ``max_new_tokens`` (the attention's cache type,
    :class:`~sp_jax.layers.AttentionCache`; for ``"mha"`` the keys and values,
    :class:`~sp_jax.layers.KVCache`: batch over the data axes, key/value heads over the
    tensor axis as in training). Then one jitted step per token for all rows (compiled
    once; rows at their own positions), in which the row layers reduce with an all-reduce
    (:mod:`sp_jax.models.decode`). Prompt lengths need not divide by anything: the
    prompts are right-padded to a multiple of the tensor size, and the batch to a
    multiple of the data size, inside. Dropout is off (the model is used in eval mode;
    ``model`` itself is not changed).

    Args:
      model: a :class:`~sp_jax.models.GPT` (no pipeline stages, no context axis larger
        than 1).
      prompts: a list of token-id lists (any lengths), or a right-padded ``[batch,
        length]`` array with ``lengths`` (or the pair ``(array, lengths)``).
      max_new_tokens: tokens to generate per row (at most; a row ends at its eos).
      temperature: 0 for greedy decoding (argmax); else the logits' temperature.
      top_k / top_p: sampling filters (:func:`filter_logits`), or None.
      eos_token_id: the token (or tokens) that end a row, kept in its output; None:
        every row gets ``max_new_tokens`` (a model loaded with
        :func:`~sp_jax.models.hf.from_hf` has its checkpoint's in
        ``model.config.eos_token_id``).
      pad_token_id: fills a row after its end (default: the first ``eos_token_id``,
        else 0).
      rngs: ``nnx.Rngs`` (its ``sample`` stream, else its default) or a PRNG key; needed
        when ``temperature > 0``. Step ``n`` draws with ``fold_in(key, n)``: one key
        gives the same tokens on every mesh.
      lengths: prompt lengths ``[batch]`` of a padded ``prompts`` array.
      speculative: None, or ``"mtp"``: greedy speculative decoding with the model's
        multi-token prediction modules (``GPTConfig.mtp_depth = D``,
        :mod:`sp_jax.models.speculative`): each step drafts ``D`` tokens with them and
        verifies them with the main model in one jitted step over ``D + 1`` positions,
        keeping the drafts up to the first that differs from the main model's greedy
        token and that token: the tokens of plain greedy decoding. Needs
        ``temperature=0``. Returns a :class:`SpeculativeGeneration` (its
        ``accepted_drafts``).
    Returns:
      :class:`Generation`: ``tokens [batch, max_new_tokens]`` and ``lengths [batch]``
      (NumPy, int32).
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) \
            or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens={max_new_tokens!r} must be a positive int.")
    if not (isinstance(temperature, int | float) and np.isfinite(temperature)
            and temperature >= 0):
        raise ValueError(f"generate: temperature={temperature!r} must be a finite number "
                         ">= 0 (0: greedy).")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise ValueError(f"generate: top_k={top_k!r} must be a positive int or None.")
    if top_p is not None and not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise ValueError(f"generate: top_p={top_p!r} must be in (0, 1] or None.")
    if temperature > 0 and rngs is None:
        raise ValueError("generate: sampling (temperature > 0) needs rngs= (e.g. "
                         "nnx.Rngs(sample=0) or jax.random.key(0)); temperature=0 is greedy.")
    if speculative not in (None, "mtp"):
        raise ValueError(f"generate: speculative={speculative!r} is not a drafting method; "
                         "use None or 'mtp' (the model's multi-token prediction modules).")
    if speculative == "mtp" and (temperature != 0 or getattr(model.config, "mtp_depth", 0) < 1):
        raise ValueError("generate: speculative='mtp' drafts with the model's multi-token "
                         "prediction modules and verifies greedily: it needs a model with "
                         f"GPTConfig(mtp_depth >= 1) (this one: {model.config.mtp_depth}) "
                         f"and temperature=0 (got {temperature}).")
    check_mode("generate", model, where="generate")  # sp_jax.compat's generate column
    model = model.for_decoding()  # e.g. a pipelined model's blocks off the stage axis
    cfg, par = model.config, model.parallel
    check_decodable(model)
    tokens, lens = _prompt_rows(prompts, lengths, cfg.vocab_size)
    mesh = current_mesh(par, where="generate")
    batch = tokens.shape[0]
    data = axis_size(mesh, par.data_axes)
    seq_shards = axis_size(mesh, (*par.context_axes, par.tensor_axis))
    if par.context_parallel == "ring" and axis_size(mesh, par.context_axes) > 1:
        seq_shards = math.lcm(seq_shards, 2 * axis_size(mesh, par.context_axes))  # zigzag
    rows = -(-batch // data) * data
    width = -(-tokens.shape[1] // seq_shards) * seq_shards
    # a speculative step writes up to D + 1 entries past the last token it keeps
    extra = cfg.mtp_depth + 1 if speculative else 0
    length = max(width, int(lens.max()) + max_new_tokens + extra)
    if cfg.positions == "learned" and max(width, int(lens.max()) + max_new_tokens - 1) \
            > cfg.max_seq_len:
        raise ValueError(
            f"generate: the longest prompt ({int(lens.max())} tokens, padded to {width}) and "
            f"max_new_tokens={max_new_tokens} reach position "
            f"{max(width, int(lens.max()) + max_new_tokens - 1) - 1}, outside the learned "
            f"position table of max_seq_len={cfg.max_seq_len}; generate fewer tokens.")
    padded = np.zeros((rows, width), np.int32)
    padded[:batch, :tokens.shape[1]] = tokens
    # Filler rows (the data axes' multiple), dropped at the end: copies of the first row,
    # so that a whole-tensor statistic of the batch is that of the rows given (FP8 current
    # scaling's amax: measured, a filler row of one token changed 1 of 18 greedy tokens of
    # the one-device FP8 model; a copy adds no new value to a maximum).
    padded[batch:] = padded[0]
    all_lens = np.concatenate([lens, np.full(rows - batch, lens[0], np.int32)])
    eos_ids = [] if eos_token_id is None else \
        [int(eos_token_id)] if isinstance(eos_token_id, int | np.integer) else \
        [int(e) for e in eos_token_id]
    pad = int(pad_token_id if pad_token_id is not None else eos_ids[0] if eos_ids else 0)
    eos = jnp.asarray(eos_ids or [-1], jnp.int32)
    key = _key(rngs) if temperature > 0 else jax.random.key(0)

    evaluation = nnx.clone(model)  # new variables (the same arrays): model is not changed
    evaluation.eval()
    to_decode_layout(evaluation)
    graph, state = nnx.split(evaluation)
    first, step = _programs(graph, (float(temperature), top_k, top_p))
    new, cache = first(state, jnp.asarray(padded), jnp.asarray(all_lens - 1), length,
                       jax.random.fold_in(key, 0))
    if speculative:
        return _speculate(graph, state, cache, new, padded, all_lens, length, batch,
                          max_new_tokens, eos_ids, pad, mesh, evaluation.parallel)
    done = jnp.isin(new, eos)
    out = [new]
    positions = jnp.asarray(all_lens)
    pad_arr = jnp.int32(pad)
    # XLA:CPU runs each simulated device's part of a program as a task of one thread pool;
    # with several decode steps queued, the devices' collectives of consecutive steps can
    # wait on each other until XLA aborts the process (measured on 2 cores: 2 of 12 runs
    # of tests/test_generate.py with 4 concurrent copies). On CPU one step at a time.
    one_at_a_time = mesh_platform() == "cpu" and mesh.size > 1
    for n in range(1, max_new_tokens):
        new, done, cache = step(state, cache, new, positions + (n - 1), done,
                                jax.random.fold_in(key, n), eos, pad_arr)
        if one_at_a_time:
            new.block_until_ready()
        out.append(new)
        if eos_ids and n % 8 == 0 and bool(jnp.all(done[:batch])):
            break
    return _finished(np.asarray(jnp.stack(out, axis=1))[:batch], max_new_tokens, eos_ids, pad)


def _finished(generated: np.ndarray, max_new_tokens: int, eos_ids: list[int], pad: int
              ) -> Generation:
    """The :class:`Generation` of ``generated [batch, n]`` tokens: cut or padded to
    ``max_new_tokens``, ``pad`` after each row's first eos."""
    batch = generated.shape[0]
    result = np.full((batch, max_new_tokens), pad, np.int32)
    n = min(generated.shape[1], max_new_tokens)
    result[:, :n] = generated[:, :n]
    ends = np.isin(result, eos_ids)
    after = np.cumsum(ends, axis=1) - ends > 0  # past the row's first eos
    result[after] = pad
    lengths_out = np.where(ends.any(axis=1), ends.argmax(axis=1) + 1, max_new_tokens)
    return Generation(result, lengths_out.astype(np.int32))


def _speculate(graph: Any, state: Any, cache: Any, new: jax.Array, padded: np.ndarray,
               lens: np.ndarray, length: int, batch: int, max_new_tokens: int,
               eos_ids: list[int], pad: int, mesh: Any, parallel: Any
               ) -> SpeculativeGeneration:
    """:func:`generate`'s loop with ``speculative="mtp"`` after the main prefill (its
    greedy tokens ``new``): the MTP prefill, then speculative steps until every row has
    ``max_new_tokens`` or its eos (:mod:`sp_jax.models.speculative`)."""
    mtp_first, mtp_step = speculative_programs(graph)
    cache, caches, drafts, carry = mtp_first(state, jnp.asarray(padded), jnp.asarray(lens),
                                             new, length)
    rows = [[int(t)] for t in np.asarray(new)[:batch]]
    # in the batch's layout, as the steps return them: one compile of the step, not two
    spec = Layout.of(parallel).spec("activation_batch")
    token, positions = (reshard(jnp.asarray(a, jnp.int32), spec, mesh) for a in (new, lens))
    accepted_sum, counted, steps = 0, 0, 0
    one_at_a_time = mesh_platform() == "cpu" and mesh.size > 1  # as generate's loop

    def active(r: list[int]) -> bool:
        return len(r) < max_new_tokens and not (set(r) & set(eos_ids))

    while any(active(r) for r in rows):
        g, accepted, drafts, carry, cache, caches = mtp_step(
            state, cache, caches, token, drafts, carry, positions)
        if one_at_a_time:
            g.block_until_ready()
        steps += 1
        g_host, a_host = np.asarray(g), np.asarray(accepted)
        for b, r in enumerate(rows):
            if active(r):
                accepted_sum += int(a_host[b])
                counted += 1
                r.extend(int(t) for t in g_host[b, :a_host[b] + 1])
        token = jnp.take_along_axis(g, accepted[:, None], axis=1)[:, 0]
        positions = positions + accepted + 1
    width = max(len(r) for r in rows)
    generated = np.array([r + [pad] * (width - len(r)) for r in rows], np.int32)
    out = SpeculativeGeneration(*_finished(generated, max_new_tokens, eos_ids, pad))
    out.accepted_drafts = accepted_sum / max(counted, 1)
    out.steps = steps
    return out


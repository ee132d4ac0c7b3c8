"""A GPT language model built from the sequence-parallel layers (its configuration,
:class:`GPTConfig`, lives in :mod:`sp_jax.models.gpt_config` and is re-exported here)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from sp_jax.attention import sequence_order, to_held, to_natural
from sp_jax.config import ParallelConfig
from sp_jax.layers import (
    MLP,
    CausalSelfAttention,
    Dropout,
    MoE,
    MoEStats,
    VocabParallelEmbedding,
    document_labels,
    make_norm,
    moe_losses,
    parallel_cross_entropy,
)
from sp_jax.layers.linear import column_sp_matmul
from sp_jax.layout import Layout
from sp_jax.mesh import (
    axis_size,
    check_activations,
    current_mesh,
    reshard,
    to_sequence_parallel,
)
from sp_jax.models.gpt_config import POSITIONS, GPTConfig, RopeScaling
from sp_jax.models.pipelined import check_pipeline, pipeline_forward_loss, pipeline_loss_and_grads

__all__ = ["GPT", "GPTConfig", "Block", "POSITIONS", "RopeScaling"]


class Block(nnx.Module):
    """One transformer layer: :class:`CausalSelfAttention` then :class:`MLP` (or, for a
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
    """

    def __init__(self, config: GPTConfig, parallel: ParallelConfig = ParallelConfig(), *,
                 rngs: nnx.Rngs, index: int = 0):
        self.attention = CausalSelfAttention(config.attention_config(), parallel=parallel,
                                             rngs=rngs)
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


# (segment_ids, positions) of packed rows, either None, or None: unpacked sequences
Documents = tuple[jax.Array | None, jax.Array | None] | None


def _run_block(block: Block, x: jax.Array, key: jax.Array | None, remat: bool,
               documents: Documents = None) -> tuple[jax.Array, MoEStats | None]:
    """Applies ``block`` (:meth:`Block.apply`); with ``remat`` its activations are
    recomputed in backward."""
    if not remat:
        return block.apply(x, key, documents)
    graphdef, state = nnx.split(block)
    return jax.checkpoint(lambda s, x, k, d: nnx.merge(graphdef, s).apply(x, k, d))(
        state, x, key, documents)


def _stack_blocks(blocks: list[Block], layer_axis: str | None = None,
                  repeats: int = 1) -> Block:
    """One :class:`Block` whose variables hold ``blocks``' values stacked on axis 0
    (sharded over ``layer_axis``, the pipeline axis, when given). With ``repeats > 1``
    the stack is ``[repeats, L / repeats, ...]`` (still in layer order) sharded over
    ``layer_axis`` on its second dimension: stage ``s`` of ``P`` then holds the layer
    chunks ``r P + s`` (the circular assignment), each where the schedule runs it."""

    def stack(*variables):
        first = variables[0]
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


def _scan_blocks(stacked: Block, x: jax.Array, keys: jax.Array | None, remat: bool,
                 documents: Documents = None) -> tuple[jax.Array, MoEStats | None]:
    """Runs the layers of a stacked block with ``lax.scan`` (one per-layer key each);
    returns the output and the layers' stacked router statistics (None: dense)."""
    graphdef, state = nnx.split(stacked)

    def layer(x, xs):
        layer_state, key = xs
        return nnx.merge(graphdef, layer_state).apply(x, key, documents)

    body = jax.checkpoint(layer) if remat else layer
    return jax.lax.scan(body, x, (state, keys))


class GPT(nnx.Module):
    """Decoder-only transformer in the TP+SP layout.

    ``tokens [batch, seq] -> logits [batch, seq, vocab]``. Hidden states between blocks
    are sequence-sharded ``P(data, tensor, None)``; the LM head (tied to the embedding, or
    its own vocabulary-parallel ``[vocab, hidden]`` table) produces vocabulary-parallel logits
    ``P(data, None, tensor)`` from them, which :meth:`loss` consumes with
    :func:`parallel_cross_entropy` without gathering the vocabulary.

    Mode: a freshly built GPT is in **train mode**, like every Flax NNX module: with a
    dropout rate above 0 its dropouts are active (drawing from the ``rngs`` passed to the
    call, else the ``dropout`` stream given here). Call ``model.eval()`` before
    evaluating or generating and ``model.train()`` to switch back; with the default
    rates of 0 both modes compute the same function.

    Args:
      config: the :class:`GPTConfig`.
      parallel: the :class:`~sp_jax.ParallelConfig`.
      rngs: rng streams (``params``; ``dropout`` when ``config.dropout > 0``).
    """

    def __init__(self, config: GPTConfig, *, parallel: ParallelConfig = ParallelConfig(),
                 rngs: nnx.Rngs):
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT: config must be a GPTConfig, got {type(config).__name__}.")
        if not isinstance(parallel, ParallelConfig):
            raise TypeError(f"GPT: parallel={parallel!r} must be a sp_jax.ParallelConfig "
                            "(use ParallelConfig.from_dict for a plain dict).")
        cfg = config
        self.config, self.parallel = cfg, parallel
        self.embed = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden, parallel=parallel, dtype=cfg.dtype,
            param_dtype=cfg.param_dtype, rngs=rngs)
        if cfg.positions == "learned":
            self.position = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (cfg.max_seq_len, cfg.hidden),
                                             cfg.param_dtype))
        else:
            self.position = None
        self.dropout = Dropout(cfg.dropout, parallel=parallel, rngs=rngs)
        if parallel.pipeline_axis is not None:
            check_pipeline(cfg, parallel, current_mesh(parallel, where="GPT", required=False))
        blocks = [Block(cfg, parallel, rngs=rngs, index=i) for i in range(cfg.num_layers)]
        self.blocks = _stack_blocks(blocks, parallel.pipeline_axis,
                                    parallel.pipeline_repeats) if cfg.scan_layers \
            else nnx.List(blocks)
        self.final_norm = make_norm(cfg.norm, cfg.hidden, parallel=parallel,
                                    epsilon=cfg.norm_epsilon, dtype=cfg.dtype,
                                    param_dtype=cfg.param_dtype, rngs=rngs)
        # An untied head is a second vocabulary table [V, hidden] (the layout of Megatron's
        # output layer), vocabulary-parallel like the embedding.
        self.head = None if cfg.tie_embeddings else VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden, parallel=parallel, param_dtype=cfg.param_dtype, rngs=rngs)

    # -- pieces -------------------------------------------------------------------------

    @staticmethod
    def _ids(x: jax.Array) -> jax.Array:
        """Token ids or labels of any integer dtype as int32 (a float array is left for
        :meth:`_check_tokens` to reject)."""
        x = jnp.asarray(x)
        return x.astype(jnp.int32) if jnp.issubdtype(x.dtype, jnp.integer) else x

    def _check_tokens(self, tokens: jax.Array) -> None:
        if tokens.ndim != 2:
            raise ValueError(
                f"GPT expects token ids of shape [batch, seq], got rank {tokens.ndim} shape "
                f"{tokens.shape}."
            )
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(
                f"GPT: token ids must be integers, got dtype {tokens.dtype}; cast them "
                "(e.g. tokens.astype(jnp.int32))."
            )
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"GPT: sequence length {tokens.shape[1]} exceeds max_seq_len="
                f"{self.config.max_seq_len}."
            )

    def hidden_states(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None, rngs: Any = None) -> jax.Array:
        """Final-normed hidden states ``[batch, seq, hidden]``, SP layout, in the order of
        ``tokens``; ``segment_ids`` / ``positions`` as in :meth:`loss`."""
        tokens = self._ids(tokens)
        order = self._order(tokens)
        held, _ = self._hidden_states(to_held(tokens, order, self.parallel), rngs, None,
                                      order, self._documents(tokens, segment_ids, positions,
                                                             order))
        return to_natural(held, order, self.parallel)

    def _documents(self, tokens: jax.Array, segment_ids: jax.Array | None,
                   positions: jax.Array | None, order: np.ndarray | None) -> Documents:
        """``(segment_ids, positions)`` int32 in the held ``order`` (None when neither is
        given), checked against ``tokens``."""
        if segment_ids is None and positions is None:
            return None
        if self.parallel.pipeline_axis is not None:
            raise ValueError("GPT: segment_ids / positions (packed documents) are not "
                             "supported with pipeline_axis yet; train packed rows without "
                             "pipeline stages.")
        held = []
        for name, a in (("segment_ids", segment_ids), ("positions", positions)):
            if a is not None:
                a = jnp.asarray(a)
                if not jnp.issubdtype(a.dtype, jnp.integer) or a.shape != tokens.shape:
                    raise ValueError(
                        f"GPT: {name} must be integers of the tokens' shape {tokens.shape} "
                        f"([batch, seq]), got {a.dtype} {a.shape}.")
                a = to_held(a.astype(jnp.int32), order, self.parallel)
            held.append(a)
        if positions is not None and self.position is not None:
            self._check_positions(positions)
        return held[0], held[1]

    def _check_positions(self, positions: jax.Array) -> None:
        """Learned positions index a table of ``max_seq_len`` rows (checked on concrete
        values only)."""
        if isinstance(positions, jax.core.Tracer):
            return
        top = int(jnp.max(positions))
        if top >= self.config.max_seq_len or int(jnp.min(positions)) < 0:
            raise ValueError(f"GPT: positions up to {top} are outside the learned position "
                             f"table of max_seq_len={self.config.max_seq_len} rows.")

    def _order(self, tokens: jax.Array) -> np.ndarray | None:
        """The order the model holds the sequence in (zigzag with ring context
        parallelism, else None: the natural order)."""
        mesh = current_mesh(self.parallel, where="GPT")
        return sequence_order(self.parallel, mesh, tokens.shape[-1])

    def _hidden_states(self, tokens: jax.Array, rngs: Any, table: jax.Array | None,
                       order: np.ndarray | None, documents: Documents = None
                       ) -> tuple[jax.Array, MoEStats | None]:
        """:meth:`hidden_states` of ``tokens`` already in the held ``order``, and the
        mixture-of-experts layers' stacked router statistics (None without any); ``table``:
        the embedding's padded table if already made; ``documents``: from
        :meth:`_documents`."""
        self._check_pipeline_call()
        training = self.training
        stream = None
        if training:  # keys are drawn here, outside any rematerialised block
            stream = rngs.dropout if rngs is not None else self.dropout.rngs
        x = self._embed(tokens, table, order, stream() if training else None,
                        None if documents is None else documents[1])
        if self.config.scan_layers:
            keys = jnp.stack([stream() for _ in range(self.config.num_layers)]) \
                if training else None
            x, stats = _scan_blocks(self.blocks, x, keys, self.config.remat, documents)
        else:
            layers = []
            for block in self.blocks:
                x, layer = _run_block(block, x, stream() if training else None,
                                      self.config.remat, documents)
                if layer is not None:  # a mixture-of-experts layer's router statistics
                    layers.append(layer)
            stats = jax.tree.map(lambda *v: jnp.stack(v), *layers) if layers else None
        return self.final_norm(x), stats

    @property
    def training(self) -> bool:
        """Whether a call draws dropout masks: a rate above 0 and train mode."""
        return max(self.config.dropout, self.config.attention_dropout) > 0 and \
            not self.dropout.deterministic

    def _embed(self, tokens: jax.Array, table: jax.Array | None, order: np.ndarray | None,
               key: jax.Array | None, positions: jax.Array | None = None) -> jax.Array:
        """Token (and learned position) embeddings of ``tokens`` in the held ``order``,
        SP layout, with the embedding dropout of ``key`` (None: none); ``positions``:
        ``[batch, seq]`` held-order positions of packed rows, or None (the row's own)."""
        self._check_tokens(tokens)
        x = self.embed(tokens, table=table)
        if self.position is not None:
            table_p = self.position[...]
            if positions is not None:  # per row: [b, s, hidden], laid out like x
                mesh = current_mesh(self.parallel, where="GPT")
                layout = Layout.of(self.parallel)
                rows = reshard(table_p, P(), mesh).at[
                    reshard(positions, layout.spec("activation_batch", None), mesh)].get(
                        out_sharding=layout.spec("activation_batch", None, None))
                x = x + reshard(rows.astype(x.dtype), jax.typeof(x).sharding.spec, mesh)
            else:
                rows = table_p[: tokens.shape[1]] if order is None else \
                    jnp.take(table_p, jnp.asarray(order), axis=0)
                x = x + rows.astype(x.dtype)[None]
            x = to_sequence_parallel(x, self.parallel, where="GPT")
        return self.dropout(x, rngs=key)

    def _vocab_table(self) -> jax.Array:
        """The LM head's padded ``[Vp, hidden]`` table (the embedding's when tied)."""
        mesh = current_mesh(self.parallel, where="GPT")
        return (self.embed if self.head is None else self.head).padded_table(mesh)

    def _lm_head(self, h: jax.Array, table: jax.Array) -> jax.Array:
        """Vocabulary-parallel logits ``P(data, None, tensor)`` of final-normed hidden
        states ``h`` (SP layout) with the padded ``table``."""
        mesh = current_mesh(self.parallel, where="GPT")
        layout = Layout.of(self.parallel)
        par = self.parallel

        def lm_head(h, table):
            return column_sp_matmul(h, table.T, None, par)

        return jax.shard_map(lm_head, in_specs=(layout.sp, layout.vocab_table),
                             out_specs=layout.logits)(reshard(h, layout.sp, mesh), table)

    def _check_pipeline_call(self) -> None:
        """A pipelined GPT runs whole only as a training step's loss (the schedule of
        :mod:`sp_jax.pipeline`)."""
        if self.parallel.pipeline_axis is not None:
            raise ValueError(
                f"GPT with ParallelConfig(pipeline_axis={self.parallel.pipeline_axis!r}) "
                "runs as a pipeline: call model.loss(tokens[, labels]) (or train it with "
                "TrainStep); for logits or hidden states, restore the parameters into a "
                "GPT without pipeline_axis.")

    def padded_logits(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None, rngs: Any = None) -> jax.Array:
        """Logits over the padded vocabulary ``[batch, seq, padded_vocab]``,
        ``P(data, None, tensor)``; entries ``>= vocab_size`` are padding.
        ``segment_ids`` / ``positions`` as in :meth:`loss`."""
        tokens = self._ids(tokens)
        order = self._order(tokens)
        held, _ = self._padded_logits(to_held(tokens, order, self.parallel), rngs, order,
                                      self._documents(tokens, segment_ids, positions, order))
        return to_natural(held, order, self.parallel, "activation_vocab")

    def _padded_logits(self, tokens: jax.Array, rngs: Any, order: np.ndarray | None,
                       documents: Documents = None) -> tuple[jax.Array, MoEStats | None]:
        """:meth:`padded_logits` of ``tokens`` already in the held ``order``, in that
        order, and the router statistics of :meth:`_hidden_states`."""
        table = self._vocab_table()  # [Vp, hidden], layout.vocab_table
        # A tied head shares the padded table with the embedding: made once.
        h, stats = self._hidden_states(tokens, rngs, table if self.head is None else None,
                                       order, documents)
        return self._lm_head(h, table), stats

    # -- public API -----------------------------------------------------------------------

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 positions: jax.Array | None = None, rngs: Any = None) -> jax.Array:
        """``tokens [batch, seq]`` -> ``logits [batch, seq, vocab_size]``
        (``segment_ids`` / ``positions``: packed documents, as in :meth:`loss`).

        Sharded ``P(data, None, tensor)`` over the vocabulary when ``vocab_size`` is a
        multiple of the tensor size; otherwise the padding is cut off and the logits come
        back sharded over the sequence ``P(data, tensor, None)``. For training use
        :meth:`loss`, which never materialises more than a vocabulary block per device.
        """
        logits = self.padded_logits(tokens, segment_ids=segment_ids, positions=positions,
                                    rngs=rngs)
        vocab = self.config.vocab_size
        if logits.shape[-1] == vocab:
            return logits
        mesh = current_mesh(self.parallel, where="GPT")
        layout = Layout.of(self.parallel)
        par = self.parallel
        if tokens.shape[1] % axis_size(mesh, (*par.context_axes, par.tensor_axis)) == 0:
            logits = reshard(logits, layout.sp, mesh)
        else:
            logits = reshard(logits, layout.spec("activation_batch", None, None), mesh)
        return logits[..., :vocab]

    def pipeline_loss_and_grads(self, tokens: jax.Array, labels: jax.Array,
                                key: jax.Array | None, *, ignore_index: int = -100
                                ) -> tuple[jax.Array, jax.Array, dict[str, Any]]:
        """A training step's loss and gradients through the pipeline of
        ``ParallelConfig(pipeline_axis=...)``, by its schedule (what
        :class:`~sp_jax.training.TrainStep` runs for a pipelined GPT).

        Args:
          tokens / labels: ``[M, batch, seq]``, ``M = pipeline_microbatches``, labels
            aligned as in :meth:`loss`.
          key: dropout key; micro-batch ``i`` draws from ``fold_in(key, i)`` as
            :func:`~sp_jax.training.lm_loss` of the unpipelined model does.
          ignore_index: the target id that contributes no loss.
        Returns:
          ``(loss_sum, count, grads)``: the float32 sum of per-token losses, the number
          of target tokens and the gradients of ``loss_sum``, a pure dict shaped like
          ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``.
        """
        if self.parallel.pipeline_axis is None:
            raise ValueError("GPT.pipeline_loss_and_grads needs ParallelConfig("
                             "pipeline_axis=...); use jax.grad of GPT.loss otherwise.")
        tokens, labels = self._ids(tokens), self._ids(labels)
        if tokens.ndim != 3 or labels.shape != tokens.shape:
            raise ValueError(
                f"GPT.pipeline_loss_and_grads expects tokens and labels [micro_batches, "
                f"batch, seq] of one shape, got {tokens.shape} and {labels.shape}.")
        if tokens.shape[0] != self.parallel.pipeline_microbatches:
            raise ValueError(
                f"GPT: the batch has {tokens.shape[0]} micro-batches (its leading "
                f"dimension) but ParallelConfig.pipeline_microbatches="
                f"{self.parallel.pipeline_microbatches}; make them equal (the example's "
                "--microbatches sets both).")
        self._check_tokens(tokens[0])
        return pipeline_loss_and_grads(self, tokens, labels, key, ignore_index=ignore_index)

    def loss(self, tokens: jax.Array, labels: jax.Array | None = None, *,
             segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
             ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
             rngs: Any = None, return_metrics: bool = False
             ) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        """Mean next-token loss over the targets that are not ``ignore_index``, plus, with
        mixture-of-experts layers, ``router_aux_loss_coef`` times the load-balancing loss
        and ``router_z_loss_coef`` times the router z-loss (both over the whole batch,
        :func:`~sp_jax.layers.moe_losses`).

        ``model.loss(tokens)``: the targets are the tokens themselves, shifted inside:
        position ``i`` predicts ``tokens[:, i + 1]`` and the last position has no target
        (the loss Hugging Face computes from ``labels=input_ids``).

        ``model.loss(tokens, labels)``: explicit targets, **already aligned** with the
        positions: ``labels[:, i]`` is what position ``i`` must predict (e.g.
        ``tokens[:, 1:]`` of a ``seq + 1`` window). Hugging Face-style labels (a copy of
        the inputs, shifted by the model) must be shifted first: ``labels[:, 1:]`` padded
        with ``ignore_index``.

        Args:
          tokens: ``[batch, seq]`` input ids.
          labels: ``[batch, seq]`` target ids (``ignore_index`` = no loss), or None.
          segment_ids: int ``[batch, seq]`` document ids of packed rows (0 = padding),
            sharded like the tokens, or None: attention does not cross documents, and
            padding and the last token of each document before the next one in the row
            have no target (:func:`~sp_jax.layers.document_labels`).
          positions: int ``[batch, seq]`` token positions (restarting at 0 in each
            document) for the rotary or learned position embeddings, or None (``0 ..
            seq - 1`` in every row).
          ignore_index: the target id that contributes no loss.
          label_smoothing / z_loss: as :func:`~sp_jax.layers.parallel_cross_entropy`.
          rngs: dropout rngs (e.g. ``nnx.Rngs(dropout=key)``) in train mode.
          return_metrics: also return a dict of metrics: ``lm_loss`` (the mean next-token
            loss alone) and, with mixture-of-experts layers, those of
            :func:`~sp_jax.layers.moe_losses`.
        Returns:
          scalar float32 (with ``return_metrics``: ``(loss, metrics)``).
        """
        tokens = self._ids(tokens)
        if labels is None:
            self._check_tokens(tokens)
            pad = jnp.full_like(tokens[:, :1], ignore_index)
            labels = jnp.concatenate([tokens[:, 1:], pad], axis=1)
        if segment_ids is not None:
            self._documents(tokens, segment_ids, None, None)  # checked first
            mesh = current_mesh(self.parallel, where="GPT")
            whole = Layout.of(self.parallel).spec("activation_batch", None)
            labels = document_labels(reshard(self._ids(labels), whole, mesh),
                                     reshard(self._ids(segment_ids), whole, mesh),
                                     ignore_index)
        if self.parallel.pipeline_axis is not None:
            self._check_tokens(tokens)
            self._documents(tokens, segment_ids, positions, None)  # refused
            labels = self._ids(labels)
            stream = None
            if self.training:
                stream = rngs.dropout if rngs is not None else self.dropout.rngs
            total = pipeline_forward_loss(
                self, tokens, labels, stream, ignore_index=ignore_index,
                label_smoothing=label_smoothing, z_loss=z_loss)
            mean = total / jnp.maximum(jnp.sum(labels != ignore_index), 1)
            return (mean, {"lm_loss": mean}) if return_metrics else mean
        order = self._order(tokens)  # the loss is a mean: the held order will do
        labels = to_held(self._ids(labels), order, self.parallel)
        documents = self._documents(tokens, segment_ids, positions, order)
        logits, stats = self._padded_logits(to_held(tokens, order, self.parallel), rngs,
                                            order, documents)
        per_token = parallel_cross_entropy(
            logits, labels, parallel=self.parallel,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
            vocab_size=self.config.vocab_size)
        count = jnp.sum(labels != ignore_index)
        mean = jnp.sum(per_token) / jnp.maximum(count, 1)
        metrics = {"lm_loss": mean}
        loss = mean
        if stats is not None:
            cfg = self.config
            metrics.update(moe_losses(stats, cfg.num_experts, cfg.experts_per_token))
            loss = mean + cfg.router_aux_loss_coef * metrics["moe_aux_loss"] + \
                cfg.router_z_loss_coef * metrics["moe_z_loss"]
        return (loss, metrics) if return_metrics else loss

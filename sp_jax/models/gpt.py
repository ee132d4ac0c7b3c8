"""A GPT language model built from the sequence-parallel layers (its configuration,
:class:`GPTConfig`, lives in :mod:`sp_jax.models.gpt_config` and is re-exported here)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from sp_jax.attention import sequence_order, to_held, to_natural
from sp_jax.compat import check_mode
from sp_jax.config import ParallelConfig
from sp_jax.layers import (
    Dropout,
    MoEStats,
    VocabParallelEmbedding,
    document_labels,
    logit_softcap,
    make_norm,
    moe_losses,
    parallel_cross_entropy,
    router_loss,
)
from sp_jax.layers.embedding import check_token_ids
from sp_jax.layers.linear import column_sp_matmul, shard_linear
from sp_jax.layout import Layout
from sp_jax.mesh import (
    axis_size,
    current_mesh,
    reshard,
    to_sequence_parallel,
)
from sp_jax.models.blocks import Block, Documents, Layers, Segments, run_blocks, stack_blocks
from sp_jax.models.gpt_config import POSITIONS, GPTConfig, RopeScaling
from sp_jax.models.mtp import MTPModule, mtp_loss

__all__ = ["GPT", "GPTConfig", "Block", "POSITIONS", "RopeScaling"]


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

    Pipeline stages: ``GPT(config, parallel=ParallelConfig(pipeline_axis=...), ...)``
    builds the class that the pipeline registered (:meth:`register_pipeline`; the
    pipeline wraps the plain model, :class:`sp_jax.pipeline.PipelinedGPT`): the GPT
    itself knows nothing of stages, and its layers get the request without its pipeline
    fields (:meth:`~sp_jax.ParallelConfig.split_pipeline`).

    Args:
      config: the :class:`GPTConfig`.
      parallel: the :class:`~sp_jax.ParallelConfig`.
      rngs: rng streams (``params``; ``dropout`` when ``config.dropout > 0``).
    """

    # The class a pipeline request builds instead of ``cls`` (``wrap(cls)``), registered by
    # the pipeline, a floor above this one (:meth:`register_pipeline`).
    _pipelined: ClassVar[Callable[[type], type] | None] = None

    def __new__(cls, *args: Any, parallel: Any = None, **kwargs: Any) -> GPT:
        del args, kwargs
        if isinstance(parallel, ParallelConfig) and parallel.split_pipeline()[1] is not None:
            if GPT._pipelined is None:
                raise ValueError("GPT: ParallelConfig(pipeline_axis=...) needs the pipeline "
                                 "loaded; import sp_jax (or sp_jax.pipeline) first.")
            cls = GPT._pipelined(cls)
        return super().__new__(cls)

    @staticmethod
    def register_pipeline(wrap: Callable[[type], type]) -> None:
        """Registers what a request with a pipeline builds: ``wrap(cls)``, the class that
        runs GPT class ``cls`` on pipeline stages (``cls`` itself when it already does)."""
        GPT._pipelined = wrap

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
        check_mode(None, config=cfg, parallel=parallel, where="GPT")  # every mode: compat
        blocks = [Block(cfg, parallel, rngs=rngs, index=i) for i in range(cfg.num_layers)]
        # scanned, each kind of layer is a stack of its own: the dense layers first
        # ([k, ...]), then the rest ([L - k, ...]; without dense layers, all of them)
        dense = cfg.num_dense_layers if cfg.scan_layers else 0
        self.dense_blocks = self.stack_layers(blocks[:dense]) if dense else None
        self.blocks = self.stack_layers(blocks[dense:]) if cfg.scan_layers else \
            nnx.List(blocks)
        self.final_norm = make_norm(cfg.norm, cfg.hidden, parallel=parallel,
                                    epsilon=cfg.norm_epsilon, dtype=cfg.dtype,
                                    param_dtype=cfg.param_dtype, rngs=rngs,
                                    norm_offset=cfg.norm_offset)
        # An untied head is a second vocabulary table [V, hidden] (the layout of Megatron's
        # output layer), vocabulary-parallel like the embedding.
        self.head = None if cfg.tie_embeddings else VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden, parallel=parallel, param_dtype=cfg.param_dtype, rngs=rngs)
        # DeepSeek-V3's multi-token prediction modules (sp_jax.models.mtp), or None
        self.mtp = nnx.List([MTPModule(cfg, parallel, rngs=rngs)
                             for _ in range(cfg.mtp_depth)]) if cfg.mtp_depth else None

    def stack_layers(self, blocks: list[Block]) -> Block:
        """The layers of one kind of a scanned model (``config.scan_layers``: all of
        them, or with ``num_dense_layers`` the dense ones and the experts apart) as one
        stacked :class:`Block` (:func:`~sp_jax.models.blocks.stack_blocks`); a wrapper
        that places them otherwise (over pipeline stages) overrides it."""
        return stack_blocks(blocks)

    @property
    def layers(self) -> Layers:
        """The layers as the stack functions of :mod:`sp_jax.models.blocks` take them
        (:data:`~sp_jax.models.blocks.Layers`): ``blocks``, a list of the layers
        (unrolled) or one stacked :class:`Block` ``[num_layers, ...]``; with scanned
        dense layers (``num_dense_layers``) the
        :class:`~sp_jax.models.blocks.Segments` ``(dense_blocks, blocks)``: ``[k, ...]``
        dense layers, then ``[num_layers - k, ...]`` mixtures of experts."""
        if self.dense_blocks is None:
            return self.blocks
        return Segments((self.dense_blocks, self.blocks))

    def for_decoding(self) -> GPT:
        """The model that generation runs (prefill and decode steps): this one; a
        wrapper laid out otherwise (pipeline stages) returns its re-layout."""
        return self

    def check_decodable(self) -> None:
        """Raises a ValueError where this model cannot run prefill and decode steps as
        it is (a wrapper's: use :meth:`for_decoding`); nothing for a GPT."""

    # -- pieces -------------------------------------------------------------------------

    @staticmethod
    def _ids(x: jax.Array) -> jax.Array:
        """Token ids or labels of any integer dtype as int32 (a float array is left for
        :meth:`_check_tokens` to reject)."""
        x = jnp.asarray(x)
        return x.astype(jnp.int32) if jnp.issubdtype(x.dtype, jnp.integer) else x

    def _check_tokens(self, tokens: jax.Array) -> None:
        check_token_ids("GPT", tokens)
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(
                f"GPT: sequence length {tokens.shape[1]} exceeds max_seq_len="
                f"{self.config.max_seq_len}."
            )

    def hidden_states(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None, rngs: Any = None) -> jax.Array:
        """Final-normed hidden states ``[batch, seq, hidden]``, SP layout, in the order of
        ``tokens``; ``segment_ids`` / ``positions`` as in :meth:`loss`."""
        check_mode("eval", self, documents=segment_ids is not None, where="GPT.hidden_states")
        tokens = self._ids(tokens)
        order = self.sequence_order(tokens)
        held, _ = self._hidden_states(to_held(tokens, order, self.parallel), rngs, None,
                                      order, self._documents(tokens, segment_ids, positions,
                                                             order))
        return to_natural(held, order, self.parallel)

    def _documents(self, tokens: jax.Array, segment_ids: jax.Array | None,
                   positions: jax.Array | None, order: np.ndarray | None) -> Documents:
        """``(segment_ids, positions)`` int32 in the held ``order`` (None when neither is
        given), checked against ``tokens`` (``[batch, seq]``, or a pipelined step's
        ``[micro_batches, batch, seq]`` with ``order`` None)."""
        if segment_ids is None and positions is None:
            return None
        held = []
        for name, a in (("segment_ids", segment_ids), ("positions", positions)):
            if a is not None:
                a = jnp.asarray(a)
                if not jnp.issubdtype(a.dtype, jnp.integer) or a.shape != tokens.shape:
                    dims = "[micro_batches, batch, seq]" if tokens.ndim == 3 else \
                        "[batch, seq]"
                    raise ValueError(
                        f"GPT: {name} must be integers of the tokens' shape {tokens.shape} "
                        f"({dims}), got {a.dtype} {a.shape}.")
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
        # eager even while a jit traces (NumPy positions closed over by a jitted call:
        # jnp.max would otherwise stage a tracer out of the constant)
        with jax.ensure_compile_time_eval():
            top, low = int(jnp.max(positions)), int(jnp.min(positions))
        if top >= self.config.max_seq_len or low < 0:
            raise ValueError(f"GPT: positions up to {top} are outside the learned position "
                             f"table of max_seq_len={self.config.max_seq_len} rows.")

    def sequence_order(self, tokens: jax.Array) -> np.ndarray | None:
        """The order the model holds the sequence of ``tokens`` (``[..., seq]``) in:
        zigzag with ring context parallelism, else None (the natural order); see
        :func:`sp_jax.attention.sequence_order`."""
        mesh = current_mesh(self.parallel, where="GPT")
        return sequence_order(self.parallel, mesh, tokens.shape[-1])

    def _hidden_states(self, tokens: jax.Array, rngs: Any, table: jax.Array | None,
                       order: np.ndarray | None, documents: Documents = None
                       ) -> tuple[jax.Array, MoEStats | None]:
        """:meth:`hidden_states` of ``tokens`` already in the held ``order``, and the
        mixture-of-experts layers' stacked router statistics (None without any); ``table``:
        the embedding's padded table if already made; ``documents``: from
        :meth:`_documents`."""
        stream = self._stream(rngs)
        x = self.embed_tokens(tokens, table, order, None if stream is None else stream(),
                              None if documents is None else documents[1])
        x, stats = self.run_blocks(x, stream=stream, documents=documents)
        return self.final_norm(x), stats

    def _stream(self, rngs: Any) -> Callable[[], jax.Array] | None:
        """The dropout key stream of a call in train mode (``rngs.dropout``, else the
        model's own), None without dropout; keys are drawn from it outside any
        rematerialised block."""
        if not self.training:
            return None
        return rngs.dropout if rngs is not None else self.dropout.rngs

    def run_blocks(self, x: jax.Array, *, stream: Callable[[], jax.Array] | None = None,
                   documents: Documents = None) -> tuple[jax.Array, MoEStats | None]:
        """The layers on embeddings ``x`` ``[batch, seq, hidden]`` (SP layout, held
        order), scanned or unrolled as ``config.scan_layers`` says
        (:func:`sp_jax.models.blocks.run_blocks`): the last layer's output (not
        final-normed) and the mixture-of-experts layers' stacked router statistics
        (None without any).

        Args:
          stream: draws one dropout key per layer, in layer order, or None (no dropout).
          documents: packed rows' ``(segment_ids, positions)`` in the held order, or None.
        """
        return run_blocks(self.layers, x, num_layers=self.config.num_layers,
                          remat=self.config.remat, stream=stream, documents=documents)

    @property
    def training(self) -> bool:
        """Whether a call draws dropout masks: a rate above 0 and train mode."""
        return max(self.config.dropout, self.config.attention_dropout) > 0 and \
            not self.dropout.deterministic

    def embed_tokens(self, tokens: jax.Array, table: jax.Array | None = None,
                     order: np.ndarray | None = None, key: jax.Array | None = None,
                     positions: jax.Array | None = None) -> jax.Array:
        """Token (and learned position) embeddings ``[batch, seq, hidden]``, SP layout,
        of ``tokens`` ``[batch, seq]`` already in the held ``order``
        (:meth:`sequence_order`), with the embedding dropout of ``key`` (None: none).

        Args:
          table: the embedding's padded table (:meth:`vocab_table` of a tied model) if
            already made, else None.
          positions: ``[batch, seq]`` held-order positions of packed rows, or None (the
            row's own).
        """
        self._check_tokens(tokens)
        x = self.scale_embeddings(self.embed(tokens, table=table))
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

    def scale_embeddings(self, x: jax.Array) -> jax.Array:
        """Token embeddings ``x`` times ``sqrt(hidden)`` rounded to ``x``'s dtype with
        ``config.scale_embeddings`` (Gemma's normalizer), else ``x``: every mode's
        embedding (:meth:`embed_tokens`, generation's decode step) goes through it."""
        if not self.config.scale_embeddings:
            return x
        return x * jnp.asarray(self.config.hidden ** 0.5, x.dtype)

    def cap_logits(self, logits: jax.Array) -> jax.Array:
        """``final_logit_softcap`` ``c``: ``logits`` become ``c * tanh(logits / c)``
        (computed in fp32, returned in their dtype; Gemma 2's final soft cap), else as
        they are: the LM head of the loss, of :meth:`padded_logits` and of generation
        (:func:`~sp_jax.layers.logit_softcap`)."""
        return logit_softcap(logits, self.config.final_logit_softcap)

    def vocab_table(self) -> jax.Array:
        """The LM head's padded ``[Vp, hidden]`` table (the embedding's when tied),
        vocabulary-parallel (``layout.vocab_table``)."""
        mesh = current_mesh(self.parallel, where="GPT")
        return (self.embed if self.head is None else self.head).padded_table(mesh)

    def logits_from_hidden(self, h: jax.Array, table: jax.Array | None = None) -> jax.Array:
        """The LM head: vocabulary-parallel logits ``[batch, seq, padded_vocab]``
        ``P(data, None, tensor)`` of final-normed hidden states ``h`` (SP layout) with the
        padded ``table`` (None: :meth:`vocab_table`), soft-capped (:meth:`cap_logits`;
        the padded entries stay out of the loss by ``vocab_size``)."""
        if table is None:
            table = self.vocab_table()
        layout, par = Layout.of(self.parallel), self.parallel
        # the column op of the parallel layers (the table's rows are the kernel's columns)
        return self.cap_logits(shard_linear(
            lambda h, table: column_sp_matmul(h, table.T, None, par), h, layout.sp,
            layout.logits, ((table, layout.vocab_table),), parallel=par, where="GPT"))

    def padded_logits(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None, rngs: Any = None) -> jax.Array:
        """Logits over the padded vocabulary ``[batch, seq, padded_vocab]``,
        ``P(data, None, tensor)``; entries ``>= vocab_size`` are padding.
        ``segment_ids`` / ``positions`` as in :meth:`loss`."""
        check_mode("eval", self, documents=segment_ids is not None, where="GPT")
        tokens = self._ids(tokens)
        order = self.sequence_order(tokens)
        held, _ = self._padded_logits(to_held(tokens, order, self.parallel), rngs, order,
                                      self._documents(tokens, segment_ids, positions, order))
        return to_natural(held, order, self.parallel, "activation_vocab")

    def _padded_logits(self, tokens: jax.Array, rngs: Any, order: np.ndarray | None,
                       documents: Documents = None) -> tuple[jax.Array, MoEStats | None]:
        """:meth:`padded_logits` of ``tokens`` already in the held ``order``, in that
        order, and the router statistics of :meth:`_hidden_states`."""
        table = self.vocab_table()  # [Vp, hidden], layout.vocab_table
        # A tied head shares the padded table with the embedding: made once.
        h, stats = self._hidden_states(tokens, rngs, table if self.head is None else None,
                                       order, documents)
        return self.logits_from_hidden(h, table), stats

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

    def _loss_targets(self, tokens: jax.Array, labels: jax.Array | None,
                      segment_ids: jax.Array | None, ignore_index: int) -> jax.Array:
        """:meth:`loss`'s targets ``[batch, seq]`` in the natural order: ``labels``, or the
        shifted ``tokens`` when None; with ``segment_ids`` none across documents
        (:func:`~sp_jax.layers.document_labels`)."""
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
        return labels

    def _token_losses(self, tokens, labels, segment_ids, positions, ignore_index: int,
                      label_smoothing: float, z_loss: float, rngs: Any) -> tuple:
        """The per-token losses of :meth:`loss` in the held order: ``((per_token, held
        labels, hidden states, router stats), (tokens, natural-order targets, order,
        documents, vocab table))``."""
        tokens = self._ids(tokens)
        labels = self._loss_targets(tokens, labels, segment_ids, ignore_index)
        order = self.sequence_order(tokens)  # the loss is a mean: the held order will do
        targets = self._ids(labels)  # natural order (the MTP depths shift them)
        labels = to_held(targets, order, self.parallel)
        documents = self._documents(tokens, segment_ids, positions, order)
        table = self.vocab_table()  # [Vp, hidden], layout.vocab_table
        h, stats = self._hidden_states(to_held(tokens, order, self.parallel), rngs,
                                       table if self.head is None else None, order,
                                       documents)
        logits = self.logits_from_hidden(h, table)
        per_token = parallel_cross_entropy(
            logits, labels, parallel=self.parallel,
            ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss,
            vocab_size=self.config.vocab_size)
        return (per_token, labels, h, stats), (tokens, targets, order, documents, table)

    def sequence_log_probs(self, tokens: jax.Array, labels: jax.Array | None = None, *,
                           segment_ids: jax.Array | None = None,
                           positions: jax.Array | None = None, ignore_index: int = -100,
                           rngs: Any = None) -> jax.Array:
        """``[batch]`` float32: each row's summed log-probability of its targets (those
        not ``ignore_index``; ``labels`` as :meth:`loss` takes them): what preference
        losses compare (:func:`sp_jax.training.dpo_loss`: the completion's tokens). The
        same forward as :meth:`loss` (every parallel layout; the vocab-parallel
        log-softmax), without the routers' auxiliary losses."""
        check_mode("train", self, mesh=jax.sharding.get_abstract_mesh(),
                   documents=segment_ids is not None, where="GPT.sequence_log_probs")
        (per_token, _, _, _), _ = self._token_losses(tokens, labels, segment_ids, positions,
                                                     ignore_index, 0.0, 0.0, rngs)
        return -jnp.sum(per_token.astype(jnp.float32), axis=1)

    def loss(self, tokens: jax.Array, labels: jax.Array | None = None, *,
             segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
             ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
             rngs: Any = None, return_metrics: bool = False
             ) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        """Mean next-token loss over the targets that are not ``ignore_index``, plus, with
        mixture-of-experts layers, ``router_aux_loss_coef`` times the load-balancing loss
        and ``router_z_loss_coef`` times the router z-loss (both over the whole batch,
        :func:`~sp_jax.layers.moe_losses`), and ``moe_seq_aux_loss_coef`` times the
        sequence-wise balance loss (:func:`~sp_jax.layers.router_loss`).

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
        check_mode("train", self, mesh=jax.sharding.get_abstract_mesh(),
                   documents=segment_ids is not None, where="GPT.loss")
        (per_token, labels, h, stats), (tokens, targets, order, documents, table) = \
            self._token_losses(tokens, labels, segment_ids, positions, ignore_index,
                               label_smoothing, z_loss, rngs)
        count = jnp.sum(labels != ignore_index)
        mean = jnp.sum(per_token) / jnp.maximum(count, 1)
        metrics = {"lm_loss": mean}
        loss = mean
        cfg = self.config
        if stats is not None:
            metrics.update(moe_losses(stats, cfg.num_experts, cfg.experts_per_token))
            loss = mean + router_loss(metrics, cfg)
        if self.mtp is not None:
            metrics["mtp_loss"] = mtp_loss(
                self, h, tokens, targets, segment_ids=segment_ids, order=order,
                documents=documents, table=table, stream=self._stream(rngs),
                ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss)
            loss = loss + cfg.mtp_loss_weight * metrics["mtp_loss"]
        return (loss, metrics) if return_metrics else loss

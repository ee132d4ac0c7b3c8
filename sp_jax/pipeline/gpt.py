"""The GPT on pipeline stages: :class:`PipelinedGPT`, a plain
:class:`~sp_jax.models.GPT` wrapped by the pipeline (torchtitan's ``pipeline_llama``
pattern).

``GPT(config, parallel=ParallelConfig(pipeline_axis=...), rngs=...)`` builds one: the
pipeline registers this wrapper with :meth:`GPT.register_pipeline
<sp_jax.models.GPT.register_pipeline>` when it is imported (``import sp_jax`` does), and
the request is split once (:meth:`~sp_jax.ParallelConfig.split_pipeline`): the layers
get its config without pipeline fields, the wrapper keeps the pipeline's own
(:attr:`PipelinedGPT.pipeline`). The wrapper overrides the forwards (``loss``,
``hidden_states``, ``padded_logits``, and so ``__call__``) with runs of the schedule
through the stages (:mod:`sp_jax.pipeline.gpt_stages`, whose stage program calls the
GPT's public pieces on a plain stage shell), adds the training step's
:meth:`~PipelinedGPT.pipeline_loss_and_grads`, places the stacked layers over the stage
axis (:meth:`~PipelinedGPT.stack_layers`) and decodes through its re-layout without
stages (:meth:`~PipelinedGPT.for_decoding`).
"""

from __future__ import annotations

import functools
import operator
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from sp_jax.attention import to_natural
from sp_jax.compat import check_mode
from sp_jax.config import ParallelConfig
from sp_jax.layers import document_labels, router_loss
from sp_jax.mesh import current_mesh, reshard
from sp_jax.models.blocks import Block, stack_blocks
from sp_jax.models.gpt import GPT, GPTConfig
from sp_jax.pipeline.gpt_stages import (
    check_pipeline,
    pipeline_forward,
    pipeline_forward_loss,
    pipeline_loss_and_grads,
)
from sp_jax.pipeline.schedule import PipelineSchedule

__all__ = ["PipelinedGPT", "pipelined_class"]


class PipelinedGPT(GPT):
    """A :class:`~sp_jax.models.GPT` on the pipeline stages of ``parallel``'s
    ``pipeline_axis`` (built by ``GPT(config, parallel=ParallelConfig(pipeline_axis=...),
    rngs=...)``).

    Its parameters keep the GPT's own state layout (checkpoints move between stage
    counts and to no pipeline): the scanned blocks ``[num_layers, ...]`` sharded over
    the stage axis on their first dimension, or ``[R, num_layers / R, ...]`` on their
    second with ``pipeline_repeats = R > 1``; with dense layers first
    (``num_dense_layers``) ``dense_blocks [k, ...]`` and ``blocks [num_layers - k,
    ...]`` (:mod:`sp_jax.pipeline.gpt_stages`).

    Attributes:
      parallel: the request as given (its ``pipeline_*`` fields included).
      pipeline: its :class:`~sp_jax.config.PipelineConfig`; every module inside holds
        the layers' config, without pipeline fields.
      wrapped: the plain GPT class the pipeline wraps (its stage shells and the
        re-layout for decoding are of it).
    """

    wrapped: ClassVar[type] = GPT

    def __init__(self, config: GPTConfig, *, parallel: ParallelConfig = ParallelConfig(),
                 rngs: nnx.Rngs):
        if not isinstance(parallel, ParallelConfig):
            raise TypeError(f"GPT: parallel={parallel!r} must be a sp_jax.ParallelConfig "
                            "(use ParallelConfig.from_dict for a plain dict).")
        layers, pipeline = parallel.split_pipeline()
        if pipeline is None:
            raise ValueError(f"{type(self).__name__} needs ParallelConfig(pipeline_axis=...)"
                             "; use GPT without a pipeline.")
        self.pipeline = pipeline
        if isinstance(config, GPTConfig):  # else GPT's TypeError
            # every mode: the request as given (the layers' config has no pipeline)
            check_mode(None, config=config, parallel=parallel, where="GPT")
            check_pipeline(config, pipeline,
                           current_mesh(parallel, where="GPT", required=False))
        super().__init__(config, parallel=layers, rngs=rngs)
        self.parallel = parallel

    def stack_layers(self, blocks: list[Block]) -> Block:
        """The stacked layers sharded over the stage axis (``[R, L / R, ...]`` with
        ``R = pipeline_repeats > 1``); with ``pipeline_layers_per_stage`` or layers of
        different kinds (``num_dense_layers``: each kind's stack apart) ``[n, ...]``,
        sharded over the stage axis when its size divides ``n`` (each step gathers each
        stage's layers from there)."""
        pipe = self.pipeline
        if pipe.layers_per_stage is None and not self.config.num_dense_layers:
            return stack_blocks(blocks, pipe.axis, pipe.repeats)
        mesh = current_mesh(self.parallel, where="GPT", required=False)
        even = mesh is not None and len(blocks) % mesh.shape[pipe.axis] == 0
        return stack_blocks(blocks, pipe.axis if even else None)

    # -- forwards through the stages ------------------------------------------------------

    def _stage_batch(self, tokens: jax.Array, segment_ids: jax.Array | None,
                     positions: jax.Array | None) -> dict[str, jax.Array]:
        """``tokens`` and the given ``segment_ids`` / ``positions`` by name, checked, in
        the natural order (a micro-batch dict of the stages)."""
        self._check_tokens(tokens if tokens.ndim == 2 else tokens[0])
        documents = self._documents(tokens, segment_ids, positions, None) or (None, None)
        return {"tokens": tokens, **{k: a for k, a in zip(("segment_ids", "positions"),
                                                          documents, strict=True)
                                     if a is not None}}

    def _stream(self, rngs: Any) -> Any:
        """The dropout rng stream of a forward (None in eval mode)."""
        if not self.training:
            return None
        return rngs.dropout if rngs is not None else self.dropout.rngs

    def hidden_states(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None, rngs: Any = None) -> jax.Array:
        """:meth:`GPT.hidden_states <sp_jax.models.GPT.hidden_states>` by a GPipe forward
        through the stages (:func:`~sp_jax.pipeline.gpt_stages.pipeline_forward`)."""
        check_mode("eval", self, documents=segment_ids is not None, where="GPT.hidden_states")
        tokens = self._ids(tokens)
        order = self.sequence_order(tokens)
        held = pipeline_forward(self, self._stage_batch(tokens, segment_ids, positions),
                                self._stream(rngs), "hidden")
        return to_natural(held, order, self.parallel)

    def padded_logits(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                      positions: jax.Array | None = None, rngs: Any = None) -> jax.Array:
        """:meth:`GPT.padded_logits <sp_jax.models.GPT.padded_logits>` by a GPipe forward
        through the stages."""
        check_mode("eval", self, documents=segment_ids is not None, where="GPT")
        tokens = self._ids(tokens)
        order = self.sequence_order(tokens)
        held = pipeline_forward(self, self._stage_batch(tokens, segment_ids, positions),
                                self._stream(rngs), "logits")
        return to_natural(held, order, self.parallel, "activation_vocab")

    def loss(self, tokens: jax.Array, labels: jax.Array | None = None, *,
             segment_ids: jax.Array | None = None, positions: jax.Array | None = None,
             ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
             rngs: Any = None, return_metrics: bool = False
             ) -> jax.Array | tuple[jax.Array, dict[str, jax.Array]]:
        """:meth:`GPT.loss <sp_jax.models.GPT.loss>` through the stages (a GPipe forward:
        :func:`~sp_jax.pipeline.gpt_stages.pipeline_forward_loss`)."""
        check_mode("train", self, mesh=jax.sharding.get_abstract_mesh(),
                   documents=segment_ids is not None, where="GPT.loss")
        tokens = self._ids(tokens)
        labels = self._ids(self._loss_targets(tokens, labels, segment_ids, ignore_index))
        batch = {**self._stage_batch(tokens, segment_ids, positions), "labels": labels}
        total, metrics = pipeline_forward_loss(
            self, batch, self._stream(rngs), ignore_index=ignore_index,
            label_smoothing=label_smoothing, z_loss=z_loss)
        mean = total / jnp.maximum(jnp.sum(labels != ignore_index), 1)
        if not return_metrics:
            return mean
        # the router losses of the experts
        lm = mean - router_loss(metrics, self.config) if metrics else mean
        return mean, {"lm_loss": lm, **metrics}

    def pipeline_loss_and_grads(self, tokens: jax.Array, labels: jax.Array,
                                key: jax.Array | None, *, segment_ids: jax.Array | None = None,
                                positions: jax.Array | None = None, ignore_index: int = -100,
                                return_metrics: bool = False,
                                schedule: PipelineSchedule | None = None) -> tuple:
        """A training step's loss and gradients through the pipeline, by its schedule
        (what :class:`~sp_jax.training.TrainStep` runs for a pipelined GPT).

        Args:
          tokens / labels: ``[M, batch, seq]``, ``M = pipeline_microbatches``, labels
            aligned as in :meth:`loss`.
          key: dropout key; micro-batch ``i`` draws from ``fold_in(key, i)`` as
            :func:`~sp_jax.training.lm_loss` of the unpipelined model does.
          segment_ids / positions: packed rows ``[M, batch, seq]`` (as in :meth:`loss`;
            each micro-batch's travel with it through the stages), or None.
          ignore_index: the target id that contributes no loss.
          return_metrics: also return the router metrics of mixture-of-experts layers
            (averaged over the micro-batches; empty without experts).
          schedule: an action table to run instead of the config's schedule (any
            :class:`~sp_jax.pipeline.PipelineSchedule` of as many stages, micro-batches
            and chunks per stage, e.g. :func:`~sp_jax.pipeline.defer_weights` of one),
            or None.
        Returns:
          ``(loss_sum, count, grads)``: the float32 sum of per-token losses (with the
          routers' auxiliary losses, each micro-batch's times its target count, as
          :func:`~sp_jax.training.lm_loss`), the number of target tokens and the
          gradients of ``loss_sum``, a pure dict shaped like
          ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``; with ``return_metrics``
          the metrics fourth.
        """
        tokens, labels = self._ids(tokens), self._ids(labels)
        if tokens.ndim != 3 or labels.shape != tokens.shape:
            raise ValueError(
                f"GPT.pipeline_loss_and_grads expects tokens and labels [micro_batches, "
                f"batch, seq] of one shape, got {tokens.shape} and {labels.shape}.")
        if tokens.shape[0] != self.pipeline.microbatches:
            raise ValueError(
                f"GPT: the batch has {tokens.shape[0]} micro-batches (its leading "
                f"dimension) but ParallelConfig.pipeline_microbatches="
                f"{self.pipeline.microbatches}; make them equal (the example's "
                "--microbatches sets both).")
        batch = {**self._stage_batch(tokens, segment_ids, positions), "labels": labels}
        if segment_ids is not None:  # per micro-batch, as lm_loss drops them
            batch["labels"] = jax.vmap(document_labels, in_axes=(0, 0, None))(
                labels, batch["segment_ids"], ignore_index)
        return pipeline_loss_and_grads(self, batch, key, ignore_index=ignore_index,
                                       return_metrics=return_metrics, schedule=schedule)

    # -- decoding ------------------------------------------------------------------------------

    def check_decodable(self) -> None:
        """Prefill and decode steps run on :meth:`for_decoding`, not on the stages."""
        raise ValueError(
            f"decode: the model has ParallelConfig(pipeline_axis={self.pipeline.axis!r}); "
            "prefill and decode_step run on its re-layout without stages, "
            "decode.unpipelined(model) (generate does so itself).")

    def for_decoding(self) -> GPT:
        """The model without its pipeline stages: a plain GPT (:attr:`wrapped`) of the
        same config and parameters, built with the layers' config (the stage axis then
        unused: everything replicated over it), so that it decodes (or computes logits)
        as any GPT. This model is not changed.

        The stacked blocks ``[L, ...]`` sharded over the stage axis on their first
        dimension (or ``[R, L / R, ...]`` on their second with ``pipeline_repeats = R >
        1``; both in layer order) are all-gathered over the stage axis and reshaped to
        ``[L, ...]``: each device receives ``(S - 1) / S`` of its tensor shard of the
        blocks (``S`` stages; BENCHMARKS.md has the bytes and times). Every other
        variable is shared as it is (not over the stage axis). The shell of the new model
        is built abstractly (``nnx.eval_shape``: no parameter is initialised)."""
        axis = self.pipeline.axis
        mesh = current_mesh(self.parallel, where="generate")
        flat = self.parallel.split_pipeline()[0]
        training = not self.dropout.deterministic
        config, plain = self.config, self.wrapped

        def build():
            shell = plain(config, parallel=flat, rngs=nnx.Rngs(0))
            if not training:
                shell.eval()
            return shell

        graph, abstract = nnx.split(nnx.eval_shape(build))
        values = nnx.to_pure_dict(nnx.state(self))

        def fill(path: tuple, like: jax.ShapeDtypeStruct) -> jax.Array:
            names = [k.key for k in path]
            try:
                x = functools.reduce(operator.getitem, names, values)
            except KeyError:  # an rng stream the model was built without (unused in eval)
                return jax.random.key(0) if jax.dtypes.issubdtype(
                    like.dtype, jax.dtypes.prng_key) else jnp.zeros(like.shape, like.dtype)
            spec = jax.typeof(x).sharding.spec if isinstance(x, jax.Array) else ()
            if names[0] not in ("blocks", "dense_blocks") or axis not in spec:
                return x
            whole = (*(None if a == axis else a for a in spec),
                     *(None,) * (x.ndim - len(spec)))
            x = reshard(x, P(*whole), mesh)  # the all-gather over the stage axis
            if x.shape != like.shape:  # [R, L / R, ...] -> [L, ...]
                x = jnp.reshape(x, like.shape,
                                out_sharding=NamedSharding(mesh, P(*whole[1:])))
            return x

        nnx.replace_by_pure_dict(abstract, jax.tree_util.tree_map_with_path(
            fill, nnx.to_pure_dict(abstract)))
        return nnx.merge(graph, abstract)


@functools.cache
def pipelined_class(cls: type) -> type:
    """The class that runs GPT class ``cls`` on pipeline stages: :class:`PipelinedGPT`
    for :class:`~sp_jax.models.GPT`, ``cls`` itself when it already does, else a
    subclass of both (its :attr:`~PipelinedGPT.wrapped` is ``cls``)."""
    if issubclass(cls, PipelinedGPT):
        return cls
    if cls is GPT:
        return PipelinedGPT
    return type(f"Pipelined{cls.__name__}", (PipelinedGPT, cls), {"wrapped": cls})


GPT.register_pipeline(pipelined_class)

"""Layout vocabulary: the one table from logical array axes to mesh axes, and the specs of
every activation and parameter sp_jax shards.

Every layer, model and baseline asks :class:`Layout` for its ``PartitionSpec`` s instead
of spelling them out, in the manner of MaxText's logical axis rules, whose lead it also
takes in naming activation axes apart from parameter axes (``activation_*`` for
activations, the plain names for parameters). The table (:meth:`Layout.rules`):

=========================  ======================================  ======================
logical axis               meaning                                 mesh axes
=========================  ======================================  ======================
``activation_batch``       batch dimension                         the data axes
``activation_length``      sequence inside tensor-parallel regions the context axes
``activation_length_sp``   sequence in sequence-parallel regions   context axes, tensor
``activation_embed``       hidden features outside the TP region   none (replicated)
``activation_heads``       attention heads                         tensor axis
``activation_head_dim``    features of one head                    none
``activation_mlp``         column-layer outputs / row-layer inputs tensor axis
``activation_vocab``       vocabulary entries of logits            tensor axis
``embed``                  hidden features of a parameter          data axes with fsdp
``mlp``                    column outputs / row inputs of a kernel tensor axis
``vocab``                  vocabulary rows of a table              tensor axis
``expert``                 experts of a mixture-of-experts layer   the expert axis
``expert_embed``           hidden features of an expert kernel     fsdp axes but expert
=========================  ======================================  ======================

The named specs built from it (``d`` = data axes, ``t`` = tensor axis):

========================  ==========================  ====================================
name                      shape                       spec
========================  ==========================  ====================================
``sp``                    ``[batch, seq, hidden]``    ``P(d, t, None)``
``tp``                    ``[batch, seq, features]``  ``P(d, None, t)``
``tensor_replicated``     ``[batch, seq, hidden]``    ``P(d, None, None)``
``tokens``                ``[batch, seq]``            ``P(d, None)``
``micro_batched_tokens``  ``[micro, batch, seq]``     ``P(None, d, None)``
``logits``                ``[batch, seq, vocab]``     ``P(d, None, t)``
``heads(rank)``           ``[batch, seq, heads, ..]`` ``P(d, None, t, None, ...)``
``column_kernel``         ``[in, out]``               ``P(None, t)`` (fsdp: ``P(d, t)``)
``row_kernel``            ``[in, out]``               ``P(t, None)`` (fsdp: ``P(t, d)``)
``column_bias``           ``[out]``                   ``P(t)``
``row_bias``              ``[out]``                   ``P(None)``
``vocab_table``           ``[vocab, hidden]``         ``P(t, None)`` (fsdp: ``P(t, d)``)
``expert_up``             ``[experts, in, out]``      ``P(e, None, t)`` (fsdp: ``P(e, d', t)``)
``expert_down``           ``[experts, in, out]``      ``P(e, t, None)`` (fsdp: ``P(e, t, d')``)
========================  ==========================  ====================================

(``e``: the expert axis, ``d'``: the data axes other than it.) With an expert axis the
data axes end with it (:attr:`~sp_jax.ParallelConfig.data_axes`): outside the expert
layers it carries the batch.

A context axis (``ParallelConfig(context_parallel=...)``: sequence sharding across
devices *inside* attention) maps ``activation_length`` to it and ``activation_length_sp``
to ``(context, tensor)``: the specs above then follow without any change to the layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jax.sharding import PartitionSpec as P

from sp_jax.config import ParallelConfig

__all__ = ["ACTIVATION_AXES", "LOGICAL_AXES", "PARAMETER_AXES", "Layout", "MeshAxes"]

MeshAxes = tuple[str, ...]
"""Mesh axes one logical axis is sharded over (empty: replicated)."""

ACTIVATION_AXES = ("activation_batch", "activation_length", "activation_length_sp",
                   "activation_embed", "activation_heads", "activation_head_dim",
                   "activation_mlp", "activation_vocab")
"""Logical axes of activations (inputs, hidden states, logits, token ids)."""

PARAMETER_AXES = ("embed", "mlp", "vocab", "expert", "expert_embed")
"""Logical axes of parameters (kernels, biases, vocabulary tables)."""

LOGICAL_AXES = ACTIVATION_AXES + PARAMETER_AXES
"""Every logical axis name :meth:`Layout.spec` understands."""


def _axes(value: str | tuple[str, ...] | None) -> MeshAxes:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclasses.dataclass(frozen=True)
class Layout:
    """Mesh axes of the data, context and tensor dimensions, and the specs they imply.

    Build one from a ParallelConfig with :meth:`of`; the layers do so on every call. The fields
    carry the names of the :class:`~sp_jax.ParallelConfig` properties they come from.

    Attributes:
      data_axes: mesh axes the batch is sharded over (empty: replicated batch).
      tensor_axis: the tensor-parallel mesh axis.
      context_axes: mesh axes the sequence is sharded over inside tensor-parallel regions
        (``ParallelConfig.context_axis`` with context parallelism; else empty: the whole
        sequence is on every device of a tensor group there).
      fsdp_axes: mesh axes the hidden dimension of kernels and vocabulary tables is
        sharded over (``ParallelConfig(fsdp=True)``: the data axes; else empty).
      expert_axes: the mesh axis experts are sharded over (``ParallelConfig.expert_axis``;
        else empty); also the last of ``data_axes``.
    """

    data_axes: MeshAxes = ("data",)
    tensor_axis: str = "tensor"
    context_axes: MeshAxes = ()
    fsdp_axes: MeshAxes = ()
    expert_axes: MeshAxes = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_axes", _axes(self.data_axes))
        object.__setattr__(self, "context_axes", _axes(self.context_axes))
        object.__setattr__(self, "fsdp_axes", _axes(self.fsdp_axes))
        object.__setattr__(self, "expert_axes", _axes(self.expert_axes))
        if self.tensor_axis in self.fsdp_axes or set(self.fsdp_axes) & set(self.context_axes):
            raise ValueError(
                f"Layout: the fsdp axes {self.fsdp_axes} must not include the tensor axis "
                f"{self.tensor_axis!r} or the context axes {self.context_axes}.")
        used = [*self.data_axes, self.tensor_axis, *self.context_axes]
        if len(set(used)) != len(used):
            raise ValueError(
                f"Layout: the data axes {self.data_axes}, tensor axis {self.tensor_axis!r} "
                f"and context axes {self.context_axes} must be distinct mesh axes."
            )

    @classmethod
    def of(cls, parallel: ParallelConfig) -> Layout:
        """The layout of a :class:`~sp_jax.ParallelConfig`."""
        if not isinstance(parallel, ParallelConfig):
            raise TypeError(
                f"Layout.of expects a sp_jax.ParallelConfig, got {type(parallel).__name__}."
            )
        return cls(data_axes=parallel.data_axes, tensor_axis=parallel.tensor_axis,
                   context_axes=parallel.context_axes, fsdp_axes=parallel.fsdp_axes,
                   expert_axes=parallel.expert_axes)

    # -- the table ------------------------------------------------------------------------

    def rules(self) -> Mapping[str, MeshAxes]:
        """Logical axis -> mesh axes: the one table every spec is built from."""
        t = (self.tensor_axis,)
        return {
            "activation_batch": self.data_axes,
            "activation_length": self.context_axes,
            "activation_length_sp": (*self.context_axes, self.tensor_axis),
            "activation_embed": (),
            "activation_heads": t,
            "activation_head_dim": (),
            "activation_mlp": t,
            "activation_vocab": t,
            "embed": self.fsdp_axes,
            "mlp": t,
            "vocab": t,
            "expert": self.expert_axes,
            "expert_embed": tuple(a for a in self.fsdp_axes if a not in self.expert_axes),
        }

    def spec(self, *logical: str | None) -> P:
        """The ``PartitionSpec`` of an array whose dimensions have the ``logical`` names
        (``None`` for a replicated dimension)."""
        rules = self.rules()
        entries = []
        for name in logical:
            if name is None:
                entries.append(None)
                continue
            if name not in rules:
                raise ValueError(
                    f"Layout.spec: unknown logical axis {name!r}; valid ones are "
                    f"{list(rules)} (or None)."
                )
            axes = rules[name]
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return P(*entries)

    # -- activations ----------------------------------------------------------------------

    @property
    def sp(self) -> P:
        """``[batch, seq, hidden]`` in a sequence-parallel region: ``P(d, t, None)``."""
        return self.spec("activation_batch", "activation_length_sp", "activation_embed")

    @property
    def tp(self) -> P:
        """``[batch, seq, features]`` with the features split: ``P(d, None, t)``."""
        return self.spec("activation_batch", "activation_length", "activation_mlp")

    @property
    def tensor_replicated(self) -> P:
        """``[batch, seq, hidden]`` whole on every device of a tensor group (the batch
        still sharded over the data axes): ``P(d, None, None)``."""
        return self.spec("activation_batch", "activation_length", "activation_embed")

    @property
    def tokens(self) -> P:
        """``[batch, seq]`` token ids, labels or per-token losses: ``P(d, None)``."""
        return self.spec("activation_batch", "activation_length")

    @property
    def micro_batched_tokens(self) -> P:
        """``[micro_batches, batch, seq]`` token ids or labels of a training step with
        gradient accumulation: ``P(None, d, None)``."""
        return self.spec(None, "activation_batch", "activation_length")

    @property
    def logits(self) -> P:
        """``[batch, seq, vocab]`` vocabulary-parallel logits: ``P(d, None, t)``."""
        return self.spec("activation_batch", "activation_length", "activation_vocab")

    def heads(self, rank: int = 4) -> P:
        """``[batch, seq, heads, ...]`` of rank ``rank`` with the heads split:
        ``P(d, None, t, None, ...)``."""
        if rank < 3:
            raise ValueError(f"Layout.heads: rank={rank} must be at least 3.")
        return self.spec("activation_batch", "activation_length", "activation_heads",
                         *(["activation_head_dim"] * (rank - 3)))

    # -- parameters -----------------------------------------------------------------------

    @property
    def column_kernel(self) -> P:
        """``[in, out]`` kernel split by columns (output features): ``P(None, t)``; with
        fsdp the input features over the data axes too: ``P(d, t)``."""
        return self.spec("embed", "mlp")

    @property
    def row_kernel(self) -> P:
        """``[in, out]`` kernel split by rows (input features): ``P(t, None)``; with fsdp
        the output features over the data axes too: ``P(t, d)``."""
        return self.spec("mlp", "embed")

    @property
    def column_bias(self) -> P:
        """``[out]`` bias of a column layer: ``P(t)``."""
        return self.spec("mlp")

    @property
    def row_bias(self) -> P:
        """``[out]`` bias of a row layer, added after the reduction: ``P(None)``."""
        return self.spec(None)

    @property
    def vocab_table(self) -> P:
        """``[vocab, hidden]`` embedding / LM-head table split over the vocabulary:
        ``P(t, None)`` (with fsdp ``P(t, d)``)."""
        return self.spec("vocab", "embed")

    @property
    def expert_up(self) -> P:
        """``[experts, hidden, width]`` expert kernels of the column (up) projection:
        ``P(e, None, t)`` (with fsdp ``P(e, d', t)``)."""
        return self.spec("expert", "expert_embed", "mlp")

    @property
    def expert_down(self) -> P:
        """``[experts, width, hidden]`` expert kernels of the row (down) projection:
        ``P(e, t, None)`` (with fsdp ``P(e, t, d')``)."""
        return self.spec("expert", "mlp", "expert_embed")
